//! Snapshots and clones of images: reflink on xfs, background copies on
//! ext4 (progress, cancel, space, a crash), and the read-only rules.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper::StatusCode;
use serde_json::{Value, json};

use crate::eventually;
use crate::harness::{LoopFs, Opts, Service, assert_error};

const XFS: &[&str] = &["mkfs.xfs", "-q", "-f", "-m", "reflink=1"];
const EXT4: &[&str] = &["mkfs.ext4", "-q", "-F"];

/// A service with `fs` as a second image root, and `env` set.
async fn service_on(fs: &LoopFs, env: &[(&str, &str)]) -> Service {
    Service::start_with(Opts {
        extra_roots: vec![fs.mnt.clone()],
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    })
    .await
}

/// Creates a sparse image `name` of `size` bytes under `dir` with `data`
/// bytes of a pattern written from 1 MiB on; returns its path.
async fn image_with_data(s: &Service, dir: &Path, name: &str, size: u64, data: u64) -> PathBuf {
    let path = dir.join(format!("{name}.img"));
    let a = s
        .post(
            "/v1/images",
            json!({"name": name, "path": path, "create": {"size_bytes": size}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    for off in (0..data).step_by(1 << 20) {
        f.write_all_at(&chunk, (1 << 20) + off).unwrap();
    }
    f.sync_all().unwrap();
    path
}

/// Whole files compared at once (a byte loop is slow in a debug build).
fn same_bytes(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

/// Asks for a loop volume `name` on `image`.
pub(crate) async fn loop_volume(
    s: &Service,
    name: &str,
    image: &str,
    read_only: bool,
) -> blockplane_client::Answer {
    s.post(
        "/v1/volumes",
        json!({"name": name, "image": image, "backend": "loop", "read_only": read_only}),
    )
    .await
}

/// How long a copy may take to end, or to show progress: generous for a
/// loaded machine; a condition ends every wait long before.
const COPY_WAIT: Duration = Duration::from_secs(300);

/// Polls an image until it is no longer `copying`; its last view.
async fn wait_copy(s: &Service, image: &str) -> Value {
    let mut view = Value::Null;
    eventually(
        COPY_WAIT,
        &format!("the copy of image '{image}' to end"),
        async || {
            let g = s.get(&format!("/v1/images/{image}")).await;
            assert_eq!(g.status, StatusCode::OK, "{}", g.body);
            view = g.body;
            view["state"] != "copying"
        },
    )
    .await;
    view
}

/// Waits until an image's copy copied something, and checks it is short
/// of its total.
async fn wait_copy_progress(s: &Service, image: &str) -> Value {
    let mut view = Value::Null;
    let what = format!("the copy of image '{image}' to copy something");
    eventually(COPY_WAIT, &what, async || {
        view = s.get(&format!("/v1/images/{image}")).await.body;
        view["copied_bytes"].as_u64().unwrap_or(0) > 0
    })
    .await;
    let done = view["copied_bytes"].as_u64().unwrap();
    assert_eq!(view["state"], "copying", "{view}");
    assert!(done < view["copy_total_bytes"].as_u64().unwrap(), "{view}");
    view
}

#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_on_xfs_is_an_instant_read_only_reflink_and_a_clone_is_writable() {
    let fs = LoopFs::new(XFS, 512 << 20);
    let s = service_on(&fs, &[]).await;
    let src = image_with_data(&s, &fs.mnt, "gold", 128 << 20, 64 << 20).await;
    // Through an attached loop volume too: a write that completed before
    // the request is in the snapshot.
    let v = loop_volume(&s, "gv", "gold", false).await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let dev = v.body["device"].as_str().unwrap().to_string();
    let d = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
    d.write_all_at(&[0xa5; 4096], 100 << 20).unwrap();
    d.sync_all().unwrap();

    let t = Instant::now();
    let a = s
        .post("/v1/images/gold/snapshots", json!({"name": "gold-s1"}))
        .await;
    let took = t.elapsed();
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let gold_id = s.get("/v1/images/gold").await.body["id"].clone();
    assert_eq!(a.body["method"], "reflink", "{}", a.body);
    assert_eq!(a.body["read_only"], true, "{}", a.body);
    assert_eq!(a.body["state"], "ready", "{}", a.body);
    assert_eq!(a.body["snapshot_of"], gold_id, "{}", a.body);
    let snap = fs.mnt.join("gold-s1");
    assert_eq!(a.body["path"], snap.display().to_string(), "{}", a.body);
    assert!(took < Duration::from_secs(2), "a reflink took {took:?}");
    let mut b = [0u8; 4096];
    std::fs::File::open(&snap)
        .unwrap()
        .read_exact_at(&mut b, 100 << 20)
        .unwrap();
    assert_eq!(b, [0xa5; 4096], "a completed write is missing");
    assert!(same_bytes(&src, &snap));
    // The event says how long the loop volume's writes could wait.
    let events = s.get("/v1/events?limit=100").await.body;
    let made = events
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "image_snapshotted")
        .unwrap_or_else(|| panic!("no image_snapshotted event: {events}"));
    let msg = made["message"].as_str().unwrap();
    assert!(
        msg.contains("volume 'gv' (loop: the filesystem's lock on the file) held its I/O for ")
            && msg.ends_with(" µs"),
        "{msg}"
    );
    let ev = s.get("/v1/events?limit=100").await.body.to_string();
    assert!(ev.contains("image_snapshotted"), "{ev}");
    let l = s
        .get(&format!(
            "/v1/images?snapshot_of={}",
            gold_id.as_str().unwrap()
        ))
        .await;
    assert_eq!(l.status, StatusCode::OK, "{}", l.body);
    let names: Vec<&str> = l
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gold-s1"], "{}", l.body);
    let l = s.get("/v1/images?snapshot_of=nosuch").await;
    assert_error(&l, 404, "image_not_found");

    // Read-only: a writable volume, a grow and an allocate are refused,
    // naming the image and the rule.
    let v = loop_volume(&s, "sv", "gold-s1", false).await;
    assert_error(&v, 422, "image_read_only");
    let m = v.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("'gold-s1'") && m.contains("read_only"), "{m}");
    let r = s
        .post(
            "/v1/images/gold-s1/resize",
            json!({"size_bytes": 256 << 20}),
        )
        .await;
    assert_error(&r, 422, "image_read_only");
    let r = s.post("/v1/images/gold-s1/allocate", json!(null)).await;
    assert_error(&r, 422, "image_read_only");
    // A read-only loop volume on it: writes through the device fail.
    let v = loop_volume(&s, "sv", "gold-s1", true).await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let sdev = v.body["device"].as_str().unwrap();
    let w = std::fs::OpenOptions::new()
        .write(true)
        .open(sdev)
        .and_then(|f| f.write_all_at(&[1; 4096], 0));
    assert!(
        w.is_err(),
        "a write through a read-only snapshot's volume worked"
    );
    assert!(same_bytes(&src, &snap));
    let p = s.patch("/v1/volumes/sv", json!({"read_only": false})).await;
    assert_eq!(p.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", p.body);

    // A clone of the snapshot: writable, reflinked, its own data.
    let c = s
        .post(
            "/v1/images",
            json!({"name": "gold-c", "path": fs.mnt.join("gold-c.img"), "clone_from": "gold-s1"}),
        )
        .await;
    assert_eq!(c.status, StatusCode::CREATED, "{}", c.body);
    assert_eq!(c.body["method"], "reflink", "{}", c.body);
    assert_eq!(c.body["read_only"], false, "{}", c.body);
    assert_eq!(c.body["snapshot_of"], Value::Null, "{}", c.body);
    assert_eq!(c.body["cloned_from"], a.body["id"], "{}", c.body);
    let v = loop_volume(&s, "cv", "gold-c", false).await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let cdev = v.body["device"].as_str().unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(cdev).unwrap();
    f.write_all_at(&[7; 4096], 0).unwrap();
    f.sync_all().unwrap();
    assert!(
        same_bytes(&src, &snap),
        "a clone's write reached the snapshot"
    );
    let small = s
        .post(
            "/v1/images",
            json!({"name": "x", "path": fs.mnt.join("x.img"), "clone_from": "gold", "create": {"size_bytes": 4096}}),
        )
        .await;
    assert_error(&small, 422, "shrink_refused");
    assert!(!fs.mnt.join("x.img").exists());
    // A clone grown on the way: the source's bytes, then zeros.
    let g = s
        .post(
            "/v1/images",
            json!({"name": "big", "path": fs.mnt.join("big.img"), "clone_from": "gold", "create": {"size_bytes": 192 << 20}}),
        )
        .await;
    assert_eq!(g.status, StatusCode::CREATED, "{}", g.body);
    assert_eq!(g.body["size_bytes"], 192 << 20, "{}", g.body);
    let grown = std::fs::read(fs.mnt.join("big.img")).unwrap();
    let gold = std::fs::read(&src).unwrap();
    assert!(grown.len() == 192 << 20 && grown[..gold.len()] == gold[..]);
    assert!(grown[gold.len()..].iter().all(|&b| b == 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pinned_image_is_copied_never_reflinked() {
    let fs = LoopFs::new(XFS, 512 << 20);
    let s = service_on(&fs, &[]).await;
    let src = image_with_data(&s, &fs.mnt, "pinned", 32 << 20, 8 << 20).await;
    // What a direct map does to its image: FS_IMMUTABLE_FL.
    let chattr = |flag: &str| {
        assert!(
            std::process::Command::new("chattr")
                .arg(flag)
                .arg(&src)
                .status()
                .unwrap()
                .success()
        )
    };
    chattr("+i");
    let a = s
        .post("/v1/images/pinned/snapshots", json!({"name": "pinned-s"}))
        .await;
    chattr("-i");
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(a.body["method"], "copy", "{}", a.body);
    let end = wait_copy(&s, "pinned-s").await;
    assert_eq!(end["state"], "ready", "{end}");
    let snap = fs.mnt.join("pinned-s");
    assert!(same_bytes(&src, &snap));
    // No extent of the source is shared with the copy.
    let out = std::process::Command::new("filefrag")
        .arg("-v")
        .arg(&src)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("shared"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_copy_on_ext4_runs_in_the_background_and_delete_cancels_it() {
    let fs = LoopFs::new(EXT4, 512 << 20);
    let s = service_on(&fs, &[("BLOCKPLANE_TEST_FAULT", "slow_copy")]).await;
    let src = image_with_data(&s, &fs.mnt, "base", 128 << 20, 96 << 20).await;
    // A copy takes time: not while a writable volume writes the source.
    let v = loop_volume(&s, "bv", "base", false).await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let a = s
        .post("/v1/images/base/snapshots", json!({"name": "base-s"}))
        .await;
    assert_error(&a, 409, "volume_attached_snapshot_unsupported");
    let m = a.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("'base'") && m.contains("'bv'"), "{m}");
    assert!(!fs.mnt.join("base-s").exists());
    assert_eq!(
        s.delete("/v1/volumes/bv").await.status,
        StatusCode::NO_CONTENT
    );
    // The copy is held at the copy gate (`slow_copy`) after its first
    // stretch while the gate exists: the refusals below meet a copy that
    // still runs, however loaded the host.
    let gate = s.shut_copy_gate();
    let a = s
        .post("/v1/images/base/snapshots", json!({"name": "base-s"}))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(a.body["method"], "copy", "{}", a.body);
    assert_eq!(a.body["state"], "copying", "{}", a.body);
    assert_eq!(a.body["size_bytes"], 128 << 20, "{}", a.body);
    wait_copy_progress(&s, "base-s").await;
    // Not ready: no volume, not even a read-only one.
    let v = loop_volume(&s, "sv", "base-s", true).await;
    assert_error(&v, 409, "image_not_ready");
    assert!(
        v.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'base-s'")
    );
    // The source stays as it was until the copy ends.
    let v = loop_volume(&s, "bv", "base", false).await;
    assert_error(&v, 409, "copy_source_busy");
    let m = v.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("'base'") && m.contains("'base-s'"), "{m}");
    let r = s
        .post("/v1/images/base/resize", json!({"size_bytes": 256 << 20}))
        .await;
    assert_error(&r, 409, "copy_source_busy");
    std::fs::remove_file(&gate).unwrap();
    let (mut seen, mut end) = (Vec::new(), Value::Null);
    eventually(COPY_WAIT, "the copy of image 'base-s' to end", async || {
        end = s.get("/v1/images/base-s").await.body;
        if end["state"] == "copying" {
            seen.push(end["copied_bytes"].as_u64().unwrap());
        }
        end["state"] != "copying"
    })
    .await;
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
    assert_eq!(end["state"], "ready", "{end}");
    assert_eq!(end["copied_bytes"], Value::Null, "{end}");
    assert!(same_bytes(&src, &fs.mnt.join("base-s")));
    let ev = s.get("/v1/events?limit=100").await.body.to_string();
    let (started, ended) = (ev.find("image_copy_started"), ev.find("\"image_copied\""));
    assert!(
        started.is_some() && ended.is_some() && started < ended,
        "{ev}"
    );
    // Sizes for people, the exact count beside them: only the data is copied.
    assert!(
        ev.contains("copy done, 96.0 MiB (100663296 bytes) in"),
        "{ev}"
    );
    let v = loop_volume(&s, "sv", "base-s", true).await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);

    // A copied clone grown on the way: the source's bytes, then zeros.
    let g = s
        .post(
            "/v1/images",
            json!({"name": "grown", "path": fs.mnt.join("grown.img"), "clone_from": "base-s", "create": {"size_bytes": 160 << 20}}),
        )
        .await;
    assert_eq!(g.status, StatusCode::ACCEPTED, "{}", g.body);
    assert_eq!(wait_copy(&s, "grown").await["size_bytes"], 160 << 20);
    let grown = std::fs::read(fs.mnt.join("grown.img")).unwrap();
    let base = std::fs::read(&src).unwrap();
    assert!(grown.len() == 160 << 20 && grown[..base.len()] == base[..]);
    assert!(grown[base.len()..].iter().all(|&b| b == 0));
    assert_eq!(
        s.delete("/v1/images/grown?delete_file=true").await.status,
        StatusCode::NO_CONTENT
    );

    // A clone's copy, cancelled by deleting the image: its file goes.
    s.shut_copy_gate();
    let cpath = fs.mnt.join("clone.img");
    let c = s
        .post(
            "/v1/images",
            json!({"name": "clone", "path": cpath, "clone_from": "base"}),
        )
        .await;
    assert_eq!(c.status, StatusCode::ACCEPTED, "{}", c.body);
    assert_eq!(c.body["read_only"], false, "{}", c.body);
    wait_copy_progress(&s, "clone").await;
    let d = s.delete("/v1/images/clone").await;
    assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
    assert!(!cpath.exists(), "the partial copy was left");
    std::fs::remove_file(&gate).unwrap();
    assert_error(&s.get("/v1/images/clone").await, 404, "image_not_found");
    let ev = s.get("/v1/events?limit=100").await.body.to_string();
    assert!(ev.contains("image_copy_cancelled"), "{ev}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_copy_that_cannot_fit_is_refused_before_it_starts() {
    let fs = LoopFs::new(EXT4, 256 << 20);
    let s = service_on(&fs, &[]).await;
    image_with_data(&s, &fs.mnt, "big", 160 << 20, 150 << 20).await;
    let before: Vec<_> = std::fs::read_dir(&fs.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let a = s
        .post("/v1/images/big/snapshots", json!({"name": "big-s"}))
        .await;
    assert_error(&a, 507, "no_space");
    let m = a.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("'big-s'") && m.contains("free"), "{m}");
    let after: Vec<_> = std::fs::read_dir(&fs.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after, "a refused copy left a file");
    assert_error(&s.get("/v1/images/big-s").await, 404, "image_not_found");
    let ev = s.get("/v1/events?limit=100").await.body.to_string();
    assert!(!ev.contains("image_copy_started"), "{ev}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_during_a_copy_never_leaves_a_ready_half_file() {
    let fs = LoopFs::new(EXT4, 512 << 20);
    let mut s = service_on(&fs, &[("BLOCKPLANE_TEST_FAULT", "slow_copy")]).await;
    image_with_data(&s, &fs.mnt, "base", 128 << 20, 96 << 20).await;
    // Held at the copy gate (`slow_copy`): still copying when killed.
    let gate = s.shut_copy_gate();
    let a = s
        .post("/v1/images/base/snapshots", json!({"name": "base-s"}))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    wait_copy_progress(&s, "base-s").await;
    let snap = fs.mnt.join("base-s");
    assert!(snap.exists());
    s.kill();
    s.restart().await;
    let g = s.get("/v1/images/base-s").await;
    assert_eq!(g.status, StatusCode::OK, "{}", g.body);
    assert_eq!(g.body["state"], "failed", "{}", g.body);
    assert!(
        g.body["state_reason"].as_str().unwrap().contains("removed"),
        "{}",
        g.body
    );
    assert!(!snap.exists(), "the half copy is still there");
    let v = loop_volume(&s, "sv", "base-s", true).await;
    assert_error(&v, 409, "image_not_ready");
    let ev = s.get("/v1/events?limit=100").await.body.to_string();
    assert!(ev.contains("image_copy_failed"), "{ev}");
    let d = s.delete("/v1/images/base-s").await;
    assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
    let _ = std::fs::remove_file(&gate);
    // The same name again: made whole this time.
    let a = s
        .post("/v1/images/base/snapshots", json!({"name": "base-s"}))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(wait_copy(&s, "base-s").await["state"], "ready");
    assert!(same_bytes(&fs.mnt.join("base.img"), &snap));
}

/// The ranges of a snapshot (`/allocated`) and between two (`/changes`)
/// in the device's coordinates, an encrypted image's header left out; and
/// every refusal precise and changing nothing.
#[tokio::test]
async fn changed_ranges_are_a_snapshots_device_and_refusals_change_nothing() {
    const MIB: u64 = 1 << 20;
    let fs = LoopFs::new(XFS, 512 << 20);
    let s = service_on(&fs, &[]).await;
    let path = fs.mnt.join("enc.img");
    let key = format!("key-{}", uuid::Uuid::new_v4().simple());
    let a = s
        .post(
            "/v1/images",
            json!({"name": "enc", "path": path,
                   "create": {"size_bytes": 64 * MIB, "encryption": {"key": key}}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let header = a.body["encryption"]["header_bytes"].as_u64().unwrap();
    // Bytes of the payload, written as a volume's ciphertext would be.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0x5a; 8192], header + MIB).unwrap();
    f.sync_all().unwrap();
    let a = s
        .post("/v1/images/enc/snapshots", json!({"name": "enc-s1"}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    f.write_all_at(&[0xa5; 4096], header + 5 * MIB).unwrap();
    f.sync_all().unwrap();
    let a = s
        .post("/v1/images/enc/snapshots", json!({"name": "enc-s2"}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);

    let a = s.get("/v1/images/enc-s1/allocated").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["size_bytes"], 64 * MIB - header, "{}", a.body);
    assert_eq!(a.body["block_bytes"], 4096, "{}", a.body);
    assert_eq!(
        a.body["ranges"],
        json!([{"offset": MIB, "length": 8192}]),
        "{}",
        a.body
    );
    assert_eq!(a.body["next_offset"], Value::Null, "{}", a.body);
    let a = s.get("/v1/images/enc-s2/changes?base=enc-s1").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(
        a.body["ranges"],
        json!([{"offset": 5 * MIB, "length": 4096}]),
        "{}",
        a.body
    );
    assert_eq!(
        a.body["base_id"],
        s.get("/v1/images/enc-s1").await.body["id"]
    );
    // Pages: one range at a time, on from next_offset.
    let a = s.get("/v1/images/enc-s2/allocated?limit=1").await;
    assert_eq!(
        a.body["ranges"],
        json!([{"offset": MIB, "length": 8192}]),
        "{}",
        a.body
    );
    let next = a.body["next_offset"].as_u64().unwrap();
    let a = s
        .get(&format!(
            "/v1/images/enc-s2/allocated?limit=1&offset={next}"
        ))
        .await;
    assert_eq!(
        a.body["ranges"],
        json!([{"offset": 5 * MIB, "length": 4096}]),
        "{}",
        a.body
    );
    assert_eq!(a.body["next_offset"], Value::Null, "{}", a.body);

    // The CLI joins every page.
    let out = crate::cli::cli(&s, &["image", "ranges", "enc-s2", "--base", "enc-s1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 ranges of enc-s2 differ"), "{text}");
    assert!(text.contains(&(5 * MIB).to_string()), "{text}");
    let out = crate::cli::cli(&s, &["--json", "image", "ranges", "enc-s2"]);
    let all: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(all["ranges"].as_array().unwrap().len(), 2, "{all}");

    // Refusals.
    let other = image_with_data(&s, &fs.mnt, "other", 16 * MIB, MIB).await;
    assert!(other.exists());
    let a = s
        .post("/v1/images/other/snapshots", json!({"name": "other-s1"}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let before = s.snapshot().await;
    for (path, status, code) in [
        ("/v1/images/enc/allocated", 422, "not_a_snapshot"),
        ("/v1/images/enc-s2/changes?base=enc", 422, "not_a_snapshot"),
        (
            "/v1/images/enc-s2/changes?base=other-s1",
            422,
            "snapshots_of_different_images",
        ),
        ("/v1/images/enc-s2/allocated?limit=0", 422, "invalid_field"),
        (
            "/v1/images/enc-s2/allocated?limit=10001",
            422,
            "invalid_field",
        ),
        ("/v1/images/enc-s2/changes", 400, "invalid_query"),
        (
            "/v1/images/enc-s2/allocated?offset=-1",
            400,
            "invalid_query",
        ),
        ("/v1/images/enc-s2/allocated?bogus=1", 400, "invalid_query"),
        ("/v1/images/nope/allocated", 404, "image_not_found"),
        (
            "/v1/images/enc-s2/changes?base=nope",
            404,
            "image_not_found",
        ),
    ] {
        let a = s.get(path).await;
        assert_error(&a, status, code);
    }
    let a = s.get("/v1/images/enc-s2/changes?base=other-s1").await;
    let m = a.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("'enc-s2'") && m.contains("'other-s1'"), "{m}");
    assert_eq!(s.snapshot().await, before, "a refusal changed something");
}
