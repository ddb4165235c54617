//! The SnapshotMetadata service as the external-snapshot-metadata sidecar
//! calls it: GetMetadataAllocated and GetMetadataDelta streams, checked
//! against a byte comparison of the snapshots' files, on an xfs with
//! reflink (snapshots share extents; the delta reads only what changed)
//! and on ext4 (snapshots are copies; the delta reads both), and every
//! refusal the spec names.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use blockplane_csi::proto::{
    BlockMetadata, BlockMetadataType, GetMetadataAllocatedRequest, GetMetadataDeltaRequest,
};
use tonic::Code;

use crate::snapshots::{on_xfs, poll, snap};
use crate::{Csi, MIB, NODE, assert_code};

/// The service's block: every range starts and ends on one.
const BLOCK: i64 = 4096;
const SIZE: i64 = 32 * MIB;

/// One stream's messages, as (capacity, ranges) each.
type Pages = Vec<(i64, Vec<(i64, i64)>)>;

/// One message's parts: its block metadata type, capacity and ranges.
type Parts = (i32, i64, Vec<(i64, i64)>);

/// One stream's messages, each checked to be variable-length ranges.
async fn pages<M>(
    mut s: tonic::Streaming<M>,
    parts: fn(&M) -> Parts,
) -> Result<Pages, tonic::Status> {
    let mut out = Vec::new();
    while let Some(m) = s.message().await? {
        let (kind, capacity, ranges) = parts(&m);
        assert_eq!(kind, BlockMetadataType::VariableLength as i32);
        out.push((capacity, ranges));
    }
    Ok(out)
}

fn ranges(blocks: &[BlockMetadata]) -> Vec<(i64, i64)> {
    blocks
        .iter()
        .map(|b| (b.byte_offset, b.size_bytes))
        .collect()
}

async fn allocated(csi: &Csi, id: &str, offset: i64, max: i32) -> Result<Pages, tonic::Status> {
    let s = csi
        .snapshot_metadata
        .clone()
        .get_metadata_allocated(GetMetadataAllocatedRequest {
            snapshot_id: id.into(),
            starting_offset: offset,
            max_results: max,
            ..Default::default()
        })
        .await?
        .into_inner();
    pages(s, |m| {
        let r = ranges(&m.block_metadata);
        (m.block_metadata_type, m.volume_capacity_bytes, r)
    })
    .await
}

async fn delta(
    csi: &Csi,
    base: &str,
    target: &str,
    offset: i64,
    max: i32,
) -> Result<Pages, tonic::Status> {
    let s = csi
        .snapshot_metadata
        .clone()
        .get_metadata_delta(GetMetadataDeltaRequest {
            base_snapshot_id: base.into(),
            target_snapshot_id: target.into(),
            starting_offset: offset,
            max_results: max,
            ..Default::default()
        })
        .await?
        .into_inner();
    pages(s, |m| {
        let r = ranges(&m.block_metadata);
        (m.block_metadata_type, m.volume_capacity_bytes, r)
    })
    .await
}

/// Every page's ranges, joined (a range split over two pages is merged),
/// after checking each page's capacity and limit.
fn joined(pages: &Pages, max: usize) -> Vec<(i64, i64)> {
    let mut out: Vec<(i64, i64)> = Vec::new();
    for (capacity, ranges) in pages {
        assert_eq!(*capacity, SIZE, "every message carries the capacity");
        assert!(ranges.len() <= max, "a message holds at most max_results");
        for &(o, l) in ranges {
            match out.last_mut() {
                Some(last) if last.0 + last.1 == o => last.1 += l,
                _ => out.push((o, l)),
            }
        }
    }
    out
}

/// The 4 KiB blocks whose bytes differ, merged: what a delta must be.
fn differing(a: &[u8], b: &[u8]) -> Vec<(i64, i64)> {
    let mut out: Vec<(i64, i64)> = Vec::new();
    for (i, (x, y)) in a
        .chunks(BLOCK as usize)
        .zip(b.chunks(BLOCK as usize))
        .enumerate()
    {
        if x != y {
            let o = i as i64 * BLOCK;
            match out.last_mut() {
                Some(last) if last.0 + last.1 == o => last.1 += BLOCK,
                _ => out.push((o, BLOCK)),
            }
        }
    }
    out
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(seed).rotate_left(7) % 251) as u8 ^ seed as u8 | 1)
        .collect()
}

/// The bytes of a snapshot's file, read beside the service.
async fn bytes_of(csi: &Csi, id: &str) -> Vec<u8> {
    let name = id.rsplit_once('/').unwrap().1;
    let a = csi.svc.get(&format!("/v1/images/{name}")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    std::fs::read(a.body["path"].as_str().unwrap()).unwrap()
}

/// Writes `data` at `off` of the image file, flushed.
fn write(path: &PathBuf, off: i64, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, off as u64).unwrap();
    f.sync_all().unwrap();
}

/// An image of the driver's with two generations, a snapshot of each, and
/// the answers checked against their bytes. Returns the two snapshot ids.
async fn two_generations(csi: &Csi, root: &std::path::Path) -> (String, String) {
    let path = root.join("csi-data.img");
    let a = csi
        .svc
        .post(
            "/v1/images",
            serde_json::json!({"name": "csi-data", "path": path, "create": {"size_bytes": SIZE}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    write(&path, MIB, &pattern(3, 4 * MIB as usize));
    write(&path, 20 * MIB, &pattern(5, MIB as usize));
    let source = format!("{NODE}/csi-data");
    let (_, s1) = poll(|| snap(csi, "gen1", &source), |s| s.ready_to_use).await;

    // New bytes, the same bytes again, zeroes over data, and data in a hole.
    write(&path, 2 * MIB + 12 * 1024, &pattern(7, 3 * BLOCK as usize));
    let same = pattern(3, 4 * MIB as usize);
    write(
        &path,
        3 * MIB,
        &same[2 * MIB as usize..(2 * MIB + BLOCK) as usize],
    );
    write(&path, 4 * MIB, &[0; BLOCK as usize]);
    write(&path, 10 * MIB, &pattern(9, 2 * BLOCK as usize));
    let (_, s2) = poll(|| snap(csi, "gen2", &source), |s| s.ready_to_use).await;
    let (s1, s2) = (s1.snapshot_id, s2.snapshot_id);

    let (b1, b2) = (bytes_of(csi, &s1).await, bytes_of(csi, &s2).await);
    let want = differing(&b1, &b2);
    assert_eq!(
        want,
        [
            (2 * MIB + 12 * 1024, 3 * BLOCK),
            (4 * MIB, BLOCK),
            (10 * MIB, 2 * BLOCK)
        ],
        "the test's own comparison"
    );
    for max in [0, 1, 2] {
        let got = delta(csi, &s1, &s2, 0, max).await.unwrap();
        let limit = if max == 0 { usize::MAX } else { max as usize };
        assert_eq!(joined(&got, limit), want, "delta with max_results {max}");
    }
    // From an offset: what lies at or after it.
    let from = delta(csi, &s1, &s2, 4 * MIB + 100, 0).await.unwrap();
    assert_eq!(joined(&from, usize::MAX), want[1..]);

    // Allocated: every block holding a byte other than zero lies in a
    // range, and the ranges hold little more than was written.
    for (id, bytes) in [(&s1, &b1), (&s2, &b2)] {
        let got = joined(&allocated(csi, id, 0, 1).await.unwrap(), 1);
        for (i, block) in bytes.chunks(BLOCK as usize).enumerate() {
            let at = i as i64 * BLOCK;
            if block.iter().any(|&b| b != 0) {
                assert!(
                    got.iter().any(|&(o, l)| o <= at && at < o + l),
                    "{id}: block at {at} holds data outside {got:?}"
                );
            }
        }
        let held: i64 = got.iter().map(|r| r.1).sum();
        assert!(held <= 6 * MIB, "{id}: {held} bytes allocated: {got:?}");
    }
    (s1, s2)
}

#[tokio::test]
async fn on_xfs_reflinked_snapshots_answer_allocated_and_delta_as_their_bytes() {
    let (csi, fs) = on_xfs().await;
    let (s1, s2) = two_generations(&csi, &fs.mnt).await;
    // Shared extents: only what was written between them was read.
    let name = s2.rsplit_once('/').unwrap().1;
    let base = s1.rsplit_once('/').unwrap().1;
    let a = csi
        .svc
        .get(&format!("/v1/images/{name}/changes?base={base}"))
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let compared = a.body["compared_bytes"].as_u64().unwrap();
    assert!(
        compared <= MIB as u64,
        "compared {compared} bytes of reflinked snapshots: {}",
        a.body
    );
    drop(csi);
}

#[tokio::test]
async fn on_ext4_copied_snapshots_answer_allocated_and_delta_as_their_bytes() {
    let csi = Csi::start().await;
    let (s1, s2) = two_generations(&csi, &csi.svc.images.clone()).await;
    let name = s2.rsplit_once('/').unwrap().1;
    let base = s1.rsplit_once('/').unwrap().1;
    let a = csi
        .svc
        .get(&format!("/v1/images/{name}/changes?base={base}"))
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    // Copies share nothing: what either holds was read and compared.
    assert!(
        a.body["compared_bytes"].as_u64().unwrap() >= 5 * MIB as u64,
        "{}",
        a.body
    );
}

#[tokio::test]
async fn snapshot_metadata_refusals_carry_the_specs_codes() {
    let csi = Csi::start().await;
    let (s1, s2) = two_generations(&csi, &csi.svc.images.clone()).await;
    let volume = csi.create("vol", 8 * MIB, crate::block()).await;
    // A snapshot of another image (with no volume: ext4 copies it).
    let path = csi.svc.images.join("csi-elsewhere.img");
    let a = csi
        .svc
        .post(
            "/v1/images",
            serde_json::json!({"name": "csi-elsewhere", "path": path, "create": {"size_bytes": SIZE}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let source = format!("{NODE}/csi-elsewhere");
    let (_, other) = poll(|| snap(&csi, "other", &source), |s| s.ready_to_use).await;
    let other = other.snapshot_id;

    // Arguments.
    assert_code(allocated(&csi, "", 0, 0).await, Code::InvalidArgument);
    assert_code(allocated(&csi, &s1, -1, 0).await, Code::OutOfRange);
    assert_code(allocated(&csi, &s1, 0, -1).await, Code::InvalidArgument);
    assert_code(delta(&csi, "", &s2, 0, 0).await, Code::InvalidArgument);
    assert_code(delta(&csi, &s1, "", 0, 0).await, Code::InvalidArgument);
    // Snapshots of different volumes.
    let e = assert_code(delta(&csi, &other, &s2, 0, 0).await, Code::InvalidArgument);
    assert!(
        e.message().contains("not snapshots of one image"),
        "{}",
        e.message()
    );
    // Past the end; at the end, nothing is left (a resume after the last
    // range).
    assert_code(allocated(&csi, &s1, SIZE + 1, 0).await, Code::OutOfRange);
    assert_code(delta(&csi, &s1, &s2, SIZE + 1, 0).await, Code::OutOfRange);
    let end = allocated(&csi, &s1, SIZE, 0).await.unwrap();
    assert_eq!(joined(&end, usize::MAX), []);
    let end = delta(&csi, &s1, &s2, SIZE, 0).await.unwrap();
    assert_eq!(joined(&end, usize::MAX), []);
    // Not found: no such snapshot, an id not the driver's, a volume.
    for missing in [
        format!("{NODE}/csi-nope"),
        "garbage".into(),
        volume.volume_id.clone(),
    ] {
        assert_code(allocated(&csi, &missing, 0, 0).await, Code::NotFound);
        assert_code(delta(&csi, &s1, &missing, 0, 0).await, Code::NotFound);
    }
    // Another node's snapshot: its node's driver answers.
    let e = assert_code(
        allocated(&csi, "other-node/csi-gen1", 0, 0).await,
        Code::FailedPrecondition,
    );
    assert!(e.message().contains("other-node"), "{}", e.message());
    csi.delete(&volume.volume_id).await.unwrap();
}
