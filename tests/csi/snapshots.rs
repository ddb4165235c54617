//! Snapshots and clones: CreateSnapshot, DeleteSnapshot and ListSnapshots
//! (idempotency, filters, pages), and CreateVolume from a snapshot or a
//! volume (data, sizes, refusals). Instant snapshots need an image root that
//! shares extents: an xfs with reflink made on a loop device here. On ext4
//! the service would copy, which it refuses under a writable volume.

use std::os::unix::fs::FileExt;

use blockplane_csi::proto::volume_content_source::{SnapshotSource, Type, VolumeSource};
use blockplane_csi::proto::{
    CapacityRange, CreateSnapshotRequest, DeleteSnapshotRequest, ListSnapshotsRequest,
    ListSnapshotsResponse, Snapshot, Volume, VolumeContentSource,
};
use tonic::Code;

use crate::harness::{LoopFs, Opts};
use crate::{Csi, MIB, NODE, assert_code, block, create_req};

/// A driver whose image root is an xfs with reflink (dropped after it).
pub(crate) async fn on_xfs() -> (Csi, LoopFs) {
    let fs = LoopFs::new(&["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], 512 << 20);
    let root = fs.mnt.display().to_string();
    let csi = Csi::start_with(
        Opts {
            extra_roots: vec![fs.mnt.clone()],
            ..Default::default()
        },
        &["--image-root", &root],
    )
    .await;
    (csi, fs)
}

pub(crate) async fn snap(csi: &Csi, name: &str, source: &str) -> Result<Snapshot, tonic::Status> {
    csi.controller
        .clone()
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: source.into(),
            name: name.into(),
            ..Default::default()
        })
        .await
        .map(|r| {
            r.into_inner()
                .snapshot
                .expect("CreateSnapshot answered no snapshot")
        })
}

async fn delete_snap(csi: &Csi, id: &str) -> Result<(), tonic::Status> {
    csi.controller
        .clone()
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        })
        .await
        .map(drop)
}

async fn list(csi: &Csi, req: ListSnapshotsRequest) -> ListSnapshotsResponse {
    csi.controller
        .clone()
        .list_snapshots(req)
        .await
        .unwrap()
        .into_inner()
}

fn ids(r: &ListSnapshotsResponse) -> Vec<String> {
    r.entries
        .iter()
        .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
        .collect()
}

fn from_snapshot(id: &str) -> Type {
    Type::Snapshot(SnapshotSource {
        snapshot_id: id.into(),
    })
}

fn from_volume(id: &str) -> Type {
    Type::Volume(VolumeSource {
        volume_id: id.into(),
    })
}

/// CreateVolume `name` of a block capability from `source`.
async fn restore(
    csi: &Csi,
    name: &str,
    required: i64,
    limit: i64,
    source: Type,
) -> Result<Volume, tonic::Status> {
    let mut req = create_req(name, required, block(), &[]);
    req.capacity_range = Some(CapacityRange {
        required_bytes: required,
        limit_bytes: limit,
    });
    req.volume_content_source = Some(VolumeContentSource {
        r#type: Some(source),
    });
    csi.controller
        .clone()
        .create_volume(req)
        .await
        .map(|r| r.into_inner().volume.unwrap())
}

/// A pattern of `len` bytes that differs for each `seed`.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(seed) % 251) as u8 ^ seed as u8)
        .collect()
}

/// Writes `data` at `off` of a volume's device, flushed.
async fn write_at(csi: &Csi, volume_id: &str, off: u64, data: &[u8]) {
    let dev = csi.device(volume_id).await;
    let f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
    f.write_all_at(data, off).unwrap();
    f.sync_all().unwrap();
}

async fn read_at(csi: &Csi, volume_id: &str, off: u64, len: usize) -> Vec<u8> {
    let dev = csi.device(volume_id).await;
    let mut back = vec![0u8; len];
    std::fs::File::open(&dev)
        .unwrap()
        .read_exact_at(&mut back, off)
        .unwrap();
    back
}

/// Asserts two byte ranges are equal without printing a megabyte of each.
#[track_caller]
fn assert_same(got: Vec<u8>, want: &[u8], what: &str) {
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    assert!(
        got.len() == want.len() && first.is_none(),
        "{what}: {} bytes read, {} expected, first difference at byte {first:?}",
        got.len(),
        want.len()
    );
}

/// The blockplane image names of the service.
async fn images(csi: &Csi) -> Vec<String> {
    let a = csi.svc.get("/v1/images").await;
    assert_eq!(a.status, 200, "{}", a.body);
    let mut names: Vec<String> = a
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn snapshots_are_idempotent_by_name_listed_and_deleted() {
    let (csi, _fs) = on_xfs().await;
    let a = csi.create("a", 16 * MIB, block()).await;
    let b = csi.create("b", 16 * MIB, block()).await;
    let s1 = snap(&csi, "s1", &a.volume_id).await.unwrap();
    assert_eq!(s1.snapshot_id, format!("{NODE}/csi-s1"));
    assert_eq!(s1.source_volume_id, a.volume_id);
    assert_eq!(s1.size_bytes, 16 * MIB);
    assert!(s1.ready_to_use, "a reflink is ready at once: {s1:?}");
    assert!(s1.creation_time.as_ref().unwrap().seconds > 0);
    // The same name and source: the same snapshot.
    assert_eq!(snap(&csi, "s1", &a.volume_id).await.unwrap(), s1);
    // The same name of another source: refused.
    let e = assert_code(snap(&csi, "s1", &b.volume_id).await, Code::AlreadyExists);
    assert!(e.message().contains("csi-s1"), "{}", e.message());
    let s2 = snap(&csi, "s2", &b.volume_id).await.unwrap();
    // Bad requests.
    assert_code(snap(&csi, "s3", "test-node/csi-nope").await, Code::NotFound);
    // A snapshot is no volume.
    assert_code(snap(&csi, "s3", &s1.snapshot_id).await, Code::NotFound);
    assert_code(snap(&csi, "", &a.volume_id).await, Code::InvalidArgument);
    assert_code(snap(&csi, "s3", "").await, Code::InvalidArgument);
    assert_code(
        snap(&csi, "s3", "other-node/csi-a").await,
        Code::FailedPrecondition,
    );

    // Lists: all, by id, by source, and in pages.
    let all = list(&csi, ListSnapshotsRequest::default()).await;
    assert_eq!(
        ids(&all),
        [s1.snapshot_id.as_str(), s2.snapshot_id.as_str()]
    );
    assert_eq!(all.entries[0].snapshot.as_ref().unwrap(), &s1);
    let by_id = |id: &str| ListSnapshotsRequest {
        snapshot_id: id.into(),
        ..Default::default()
    };
    let by_source = |id: &str| ListSnapshotsRequest {
        source_volume_id: id.into(),
        ..Default::default()
    };
    assert_eq!(
        ids(&list(&csi, by_id(&s2.snapshot_id)).await),
        [s2.snapshot_id.as_str()]
    );
    assert_eq!(
        ids(&list(&csi, by_source(&a.volume_id)).await),
        [s1.snapshot_id.as_str()]
    );
    assert_eq!(
        ids(&list(&csi, by_source(&b.volume_id)).await),
        [s2.snapshot_id.as_str()]
    );
    for nothing in [
        by_id("other-node/csi-s1"),
        by_id("junk"),
        by_id(&a.volume_id),
    ] {
        assert!(list(&csi, nothing).await.entries.is_empty());
    }
    let first = list(
        &csi,
        ListSnapshotsRequest {
            max_entries: 1,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&first), [s1.snapshot_id.as_str()]);
    assert!(!first.next_token.is_empty());
    let second = list(
        &csi,
        ListSnapshotsRequest {
            max_entries: 1,
            starting_token: first.next_token.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&second), [s2.snapshot_id.as_str()]);
    assert!(second.next_token.is_empty());
    let bad = csi
        .controller
        .clone()
        .list_snapshots(ListSnapshotsRequest {
            starting_token: "nonsense".into(),
            ..Default::default()
        })
        .await;
    assert_code(bad, Code::Aborted);
    // Snapshots are not volumes.
    let volumes = csi.list_volumes().await;
    assert_eq!(volumes.entries.len(), 2);

    // Delete: idempotent, and a volume's id deletes no volume.
    delete_snap(&csi, &s1.snapshot_id).await.unwrap();
    delete_snap(&csi, &s1.snapshot_id).await.unwrap();
    delete_snap(&csi, "junk").await.unwrap();
    delete_snap(&csi, &a.volume_id).await.unwrap();
    assert_eq!(images(&csi).await, ["csi-a", "csi-b", "csi-s2"]);
    assert_eq!(
        ids(&list(&csi, ListSnapshotsRequest::default()).await),
        [s2.snapshot_id.as_str()]
    );
    // The name is free again, for another source.
    let s1b = snap(&csi, "s1", &b.volume_id).await.unwrap();
    assert_eq!(s1b.source_volume_id, b.volume_id);
    for s in [&s1b, &s2] {
        delete_snap(&csi, &s.snapshot_id).await.unwrap();
    }
    for v in [&a, &b] {
        csi.delete(&v.volume_id).await.unwrap();
    }
    assert!(images(&csi).await.is_empty());
}

#[tokio::test]
async fn a_snapshot_restores_into_a_new_volume_with_its_data_and_sizes() {
    let (csi, _fs) = on_xfs().await;
    let src = csi.create("src", 16 * MIB, block()).await;
    let staging = csi.staging("src");
    csi.stage(&src.volume_id, &staging, block()).await.unwrap();
    let (before, after) = (pattern(7, MIB as usize), pattern(13, MIB as usize));
    write_at(&csi, &src.volume_id, MIB as u64, &before).await;
    write_at(&csi, &src.volume_id, 15 * MIB as u64, &before).await;
    let s = snap(&csi, "snap", &src.volume_id).await.unwrap();
    // Written after the snapshot: not in it.
    write_at(&csi, &src.volume_id, MIB as u64, &after).await;

    let r = restore(&csi, "restored", 16 * MIB, 0, from_snapshot(&s.snapshot_id))
        .await
        .unwrap();
    assert_eq!(r.capacity_bytes, 16 * MIB);
    assert_eq!(
        r.content_source.as_ref().unwrap().r#type,
        Some(from_snapshot(&s.snapshot_id))
    );
    let staged = csi.staging("restored");
    csi.stage(&r.volume_id, &staged, block()).await.unwrap();
    assert_same(
        read_at(&csi, &r.volume_id, MIB as u64, MIB as usize).await,
        &before,
        "the restored volume at 1 MiB",
    );
    assert_same(
        read_at(&csi, &r.volume_id, 15 * MIB as u64, MIB as usize).await,
        &before,
        "the restored volume at 15 MiB",
    );
    csi.unstage(&r.volume_id, &staged).await.unwrap();
    // Idempotent; another source under the same name is another volume.
    let again = restore(&csi, "restored", 16 * MIB, 0, from_snapshot(&s.snapshot_id))
        .await
        .unwrap();
    assert_eq!(again.volume_id, r.volume_id);
    assert_code(
        restore(&csi, "restored", 16 * MIB, 0, from_volume(&src.volume_id)).await,
        Code::AlreadyExists,
    );

    // Larger grows the clone; the data stays.
    let big = restore(&csi, "big", 32 * MIB, 0, from_snapshot(&s.snapshot_id))
        .await
        .unwrap();
    assert_eq!(big.capacity_bytes, 32 * MIB);
    assert_eq!(csi.bp_volume(&big.volume_id).await["size_bytes"], 32 * MIB);
    assert_same(
        read_at(&csi, &big.volume_id, MIB as u64, MIB as usize).await,
        &before,
        "the grown restore",
    );
    // Less required than the source: the source's size; a limit below it:
    // OUT_OF_RANGE, and nothing is left behind.
    let small = restore(&csi, "small", 4 * MIB, 0, from_snapshot(&s.snapshot_id))
        .await
        .unwrap();
    assert_eq!(small.capacity_bytes, 16 * MIB);
    let e = assert_code(
        restore(
            &csi,
            "tiny",
            4 * MIB,
            8 * MIB,
            from_snapshot(&s.snapshot_id),
        )
        .await,
        Code::OutOfRange,
    );
    assert!(
        e.message().contains("smaller than its source"),
        "{}",
        e.message()
    );
    assert!(!images(&csi).await.contains(&"csi-tiny".to_string()));
    // A snapshot of another node: that node's provisioner makes the volume.
    assert_code(
        restore(&csi, "x", 16 * MIB, 0, from_snapshot("other-node/csi-snap")).await,
        Code::ResourceExhausted,
    );
    // A snapshot that does not exist, or that is a volume.
    for missing in [
        from_snapshot("test-node/csi-nope"),
        from_snapshot(&src.volume_id),
    ] {
        assert_code(
            restore(&csi, "x", 16 * MIB, 0, missing).await,
            Code::NotFound,
        );
    }
    csi.unstage(&src.volume_id, &staging).await.unwrap();
    for v in [&r, &big, &small, &src] {
        csi.delete(&v.volume_id).await.unwrap();
    }
    // The snapshot outlives its volume, whose name is gone with it.
    let left = list(&csi, ListSnapshotsRequest::default()).await;
    assert_eq!(ids(&left), [s.snapshot_id.as_str()]);
    assert_eq!(
        left.entries[0].snapshot.as_ref().unwrap().source_volume_id,
        ""
    );
    delete_snap(&csi, &s.snapshot_id).await.unwrap();
    assert!(images(&csi).await.is_empty());
}

#[tokio::test]
async fn a_volume_is_cloned_with_its_data_and_grown() {
    let (csi, _fs) = on_xfs().await;
    let src = csi.create("orig", 16 * MIB, block()).await;
    let data = pattern(5, MIB as usize);
    write_at(&csi, &src.volume_id, 2 * MIB as u64, &data).await;
    let c = restore(&csi, "copy", 24 * MIB, 0, from_volume(&src.volume_id))
        .await
        .unwrap();
    assert_eq!(c.capacity_bytes, 24 * MIB);
    assert_eq!(
        c.content_source.as_ref().unwrap().r#type,
        Some(from_volume(&src.volume_id))
    );
    assert_same(
        read_at(&csi, &c.volume_id, 2 * MIB as u64, MIB as usize).await,
        &data,
        "the clone",
    );
    // The clone is its own: writing it leaves the source as it was.
    write_at(
        &csi,
        &c.volume_id,
        2 * MIB as u64,
        &pattern(9, MIB as usize),
    )
    .await;
    assert_same(
        read_at(&csi, &src.volume_id, 2 * MIB as u64, MIB as usize).await,
        &data,
        "the clone's source after the clone was written",
    );
    assert_code(
        restore(&csi, "copy2", 0, 8 * MIB, from_volume(&src.volume_id)).await,
        Code::OutOfRange,
    );
    assert_code(
        restore(&csi, "copy2", 0, 0, from_volume("test-node/csi-gone")).await,
        Code::NotFound,
    );
    for v in [&c, &src] {
        csi.delete(&v.volume_id).await.unwrap();
    }
}

#[tokio::test]
async fn on_ext4_a_snapshot_under_a_writable_volume_is_a_failed_precondition() {
    // ext4 shares no extents: the service would copy, which it refuses
    // while a writable volume is attached (it would not be one moment).
    let csi = Csi::start().await;
    let v = csi.create("live", 8 * MIB, block()).await;
    let e = assert_code(
        snap(&csi, "s", &v.volume_id).await,
        Code::FailedPrecondition,
    );
    assert!(
        e.message().contains("volume_attached_snapshot_unsupported"),
        "{}",
        e.message()
    );
    assert_code(
        restore(&csi, "c", 8 * MIB, 0, from_volume(&v.volume_id)).await,
        Code::FailedPrecondition,
    );
    assert_eq!(images(&csi).await, ["csi-live"]);
    csi.delete(&v.volume_id).await.unwrap();
}

/// Polls `call` until it succeeds and `done` holds, for at most 60 s;
/// returns the first answer too.
pub(crate) async fn poll<T, F, Fut>(
    mut call: F,
    done: impl Fn(&T) -> bool,
) -> (Result<T, tonic::Status>, T)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let first = call().await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Ok(v) = call().await
            && done(&v)
        {
            return (first, v);
        }
        assert!(std::time::Instant::now() < deadline, "not done in 60 s");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_copy_is_not_ready_to_use_and_a_copying_clone_is_aborted_until_ready() {
    // ext4 shares no extents: the service copies in the background. The
    // source is an image without a volume (made through the API under a
    // name of the driver's), so that the copy is allowed.
    let csi = Csi::start().await;
    let path = csi.svc.images.join("csi-gold.img");
    let a = csi
        .svc
        .post(
            "/v1/images",
            serde_json::json!({"name": "csi-gold", "path": path, "create": {"size_bytes": 64 * MIB}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let data = pattern(11, 8 * MIB as usize);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&data, MIB as u64).unwrap();
    f.sync_all().unwrap();
    let gold = format!("{NODE}/csi-gold");

    let (first, s) = poll(|| snap(&csi, "gs", &gold), |s| s.ready_to_use).await;
    let first = first.unwrap();
    assert!(
        !first.ready_to_use,
        "a copy is not ready at once: {first:?}"
    );
    assert_eq!(first.snapshot_id, s.snapshot_id);

    let (first, v) = poll(
        || restore(&csi, "from-copy", 0, 0, from_snapshot(&s.snapshot_id)),
        |_| true,
    )
    .await;
    assert_code(first, Code::Aborted);
    assert_eq!(v.capacity_bytes, 64 * MIB);
    assert_same(
        read_at(&csi, &v.volume_id, MIB as u64, data.len()).await,
        &data,
        "the volume restored from a copied snapshot",
    );
    csi.delete(&v.volume_id).await.unwrap();
    delete_snap(&csi, &s.snapshot_id).await.unwrap();
    assert_eq!(images(&csi).await, ["csi-gold"]);
}
