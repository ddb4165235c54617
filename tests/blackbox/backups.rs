//! Backups off the host: to a directory and to a real S3-compatible server
//! (moto's, from PyPI: a whole S3 HTTP API in one process, started on
//! loopback by the test), incremental and deduplicated, restored byte-equal
//! by this service or another, and what a corrupt chunk, a kill, a target
//! that goes away and a gc during a backup leave.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper::StatusCode;
use serde_json::{Value, json};

use crate::eventually;
use crate::harness::{Opts, Service, assert_error};
use blockplane_test_support::s3::S3Server as S3;

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 4 * MIB;
/// Long enough for a slow (`slow_backup`) backup of a hundred chunks on a
/// loaded machine; a condition ends every wait long before.
const WAIT: Duration = Duration::from_secs(300);

/// A service whose backup target is `target`, with `env` set.
pub(crate) async fn service_to(target: &str, env: &[(&str, &str)]) -> Service {
    Service::start_with(Opts {
        extra_args: vec!["--backup-target".into(), target.into()],
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    })
    .await
}

/// A directory target beside the service's dirs.
pub(crate) fn dir_target() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("bp-target")
        .tempdir_in("/tmp")
        .unwrap()
}

/// Creates a sparse image `name` of `size` bytes with `seed`'s pattern
/// written over `data` (byte ranges); returns its path.
pub(crate) async fn image_with(
    s: &Service,
    name: &str,
    size: u64,
    data: &[(u64, u64)],
    seed: u8,
) -> PathBuf {
    let path = s.images.join(format!("{name}.img"));
    let a = s
        .post(
            "/v1/images",
            json!({"name": name, "path": path, "create": {"size_bytes": size}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    write_pattern(&path, data, seed);
    path
}

/// Writes `seed`'s pattern over each `(offset, len)` of the file.
pub(crate) fn write_pattern(path: &Path, data: &[(u64, u64)], seed: u8) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    for &(off, len) in data {
        let bytes: Vec<u8> = (0..len)
            .map(|i| ((off + i) % 251) as u8 ^ seed | 1)
            .collect();
        f.write_all_at(&bytes, off).unwrap();
    }
    f.sync_all().unwrap();
}

/// Starts a backup of `image` named `name`: the 202's backup.
async fn start_backup(s: &Service, image: &str, name: &str) -> Value {
    let a = s
        .post(
            &format!("/v1/images/{image}/backups"),
            json!({"name": name}),
        )
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(a.body["state"], "running", "{}", a.body);
    a.body
}

/// Waits until backup `id` is no longer running: its last view.
async fn backup_end(s: &Service, id: &str) -> Value {
    let mut last = Value::Null;
    eventually(WAIT, &format!("backup {id} to end"), async || {
        last = s.get(&format!("/v1/backups/{id}")).await.body;
        last["state"] != "running"
    })
    .await;
    last
}

/// A backup of `image` named `name`, done.
pub(crate) async fn backup(s: &Service, image: &str, name: &str) -> Value {
    let id = start_backup(s, image, name).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let b = backup_end(s, &id).await;
    assert_eq!(b["state"], "done", "{b}\n{}", s.log_text());
    b
}

/// Starts a restore of `backup` into image `name`: the 202's image.
async fn start_restore(s: &Service, backup: &str, name: &str) -> (Value, PathBuf) {
    let path = s.images.join(format!("{name}.img"));
    let a = s
        .post(
            "/v1/images",
            json!({"name": name, "path": path, "restore_from": backup}),
        )
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(a.body["state"], "copying", "{}", a.body);
    assert_eq!(a.body["method"], "restore", "{}", a.body);
    (a.body, path)
}

/// Waits until image `name` is no longer copying: its last view.
async fn image_end(s: &Service, name: &str) -> Value {
    let mut last = Value::Null;
    eventually(WAIT, &format!("image {name} to be restored"), async || {
        last = s.get(&format!("/v1/images/{name}")).await.body;
        last["state"] != "copying"
    })
    .await;
    last
}

/// A restore of `backup` into image `name`, ready: its file.
pub(crate) async fn restore(s: &Service, backup: &str, name: &str) -> PathBuf {
    let (_, path) = start_restore(s, backup, name).await;
    let i = image_end(s, name).await;
    assert_eq!(i["state"], "ready", "{i}\n{}", s.log_text());
    path
}

/// The chunk files a directory target holds.
fn chunk_files(target: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(dirs) = std::fs::read_dir(target.join("chunks")) else {
        return out;
    };
    for d in dirs.flatten() {
        // A name with '#' is a file being written (the target's staging name).
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            if !f.file_name().to_string_lossy().contains('#') {
                out.push(f.path());
            }
        }
    }
    out.sort();
    out
}

/// Kinds of the service's events, oldest first.
async fn event_kinds(s: &Service) -> Vec<String> {
    let a = s.get("/v1/events?limit=1000").await;
    a.body
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn backups_are_incremental_deduplicated_and_restore_byte_equal_from_a_directory() {
    let t = dir_target();
    let s = service_to(t.path().to_str().unwrap(), &[]).await;
    // Five chunks of data (the fifth in part), a chunk of zeros written
    // (stored as nothing), and holes.
    let size = 40 * MIB;
    let data = [(MIB, 18 * MIB)];
    let a_path = image_with(&s, "a", size, &data, 7).await;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&a_path)
        .unwrap();
    f.write_all_at(&vec![0u8; CHUNK as usize], 6 * CHUNK)
        .unwrap();
    f.sync_all().unwrap();
    let moment_one = std::fs::read(&a_path).unwrap();

    let one = backup(&s, "a", "one").await;
    assert_eq!(one["chunks"], 5, "{one}");
    assert_eq!(one["stored_bytes"], 5 * CHUNK, "{one}");
    assert_eq!(one["uploaded_bytes"], 5 * CHUNK, "{one}");
    assert_eq!(one["deduplicated_bytes"], 0, "{one}");
    assert_eq!(one["size_bytes"], size, "{one}");
    assert_eq!(chunk_files(t.path()).len(), 5);

    // 4 KiB changed in one chunk: that chunk is all the second backup puts.
    write_pattern(&a_path, &[(2 * CHUNK + 4096, 4096)], 99);
    let two = backup(&s, "a", "two").await;
    assert_eq!(two["uploaded_bytes"], CHUNK, "{two}");
    assert_eq!(two["deduplicated_bytes"], 4 * CHUNK, "{two}");
    assert_eq!(chunk_files(t.path()).len(), 6);

    // Another image with the first one's bytes: nothing to put.
    let b_path = s.images.join("b.img");
    std::fs::write(&b_path, &moment_one).unwrap();
    let a = s
        .post("/v1/images", json!({"name": "b", "path": b_path}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let b = backup(&s, "b", "one").await;
    assert_eq!(b["uploaded_bytes"], 0, "{b}");
    assert_eq!(b["deduplicated_bytes"], 5 * CHUNK, "{b}");

    // The name is the image's: taken for a, free for b.
    let again = s.post("/v1/images/a/backups", json!({"name": "one"})).await;
    assert_error(&again, 409, "name_taken");

    // The first moment comes back whole, holes as holes.
    let id = one["id"].as_str().unwrap();
    let r_path = restore(&s, id, "r").await;
    assert!(
        std::fs::read(&r_path).unwrap() == moment_one,
        "restored bytes differ"
    );
    let r = s.get("/v1/images/r").await.body;
    assert_eq!(r["restored_from"], one["id"], "{r}");
    assert!(
        r["allocated_bytes"].as_u64().unwrap() <= 6 * CHUNK,
        "the restore is not sparse: {r}"
    );
    // A restored image serves: a volume on it.
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "rv", "image": "r", "backend": "loop"}),
        )
        .await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);

    let list = s.get("/v1/backups?image=a").await.body;
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["one", "two"], "{list}");
    let kinds = event_kinds(&s).await;
    for k in [
        "backup_started",
        "backup_done",
        "image_restore_started",
        "image_restored",
    ] {
        assert!(kinds.iter().any(|e| e == k), "no {k} event in {kinds:?}");
    }
    let metrics = s.get_text("/metrics").await;
    assert!(
        metrics.contains(&format!(
            "blockplane_backup_uploaded_bytes_total {}",
            6 * CHUNK
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "blockplane_backup_deduplicated_bytes_total {}",
            9 * CHUNK
        )),
        "{metrics}"
    );
    for image in ["a", "b"] {
        assert!(
            metrics.contains(&format!(
                "blockplane_image_last_backup_age_seconds{{image=\"{image}\"}}"
            )),
            "no backup age of {image}: {metrics}"
        );
    }
}

#[tokio::test]
async fn a_corrupt_or_missing_chunk_is_named_and_no_half_restore_is_served() {
    let t = dir_target();
    let s = service_to(t.path().to_str().unwrap(), &[]).await;
    image_with(&s, "a", 16 * MIB, &[(0, 12 * MIB)], 3).await;
    let one = backup(&s, "a", "one").await;
    let id = one["id"].as_str().unwrap();
    let v = s.post(&format!("/v1/backups/{id}/verify"), json!({})).await;
    assert_eq!(v.status, StatusCode::OK, "{}", v.body);
    assert_eq!(v.body["ok"], true, "{}", v.body);

    // One byte of the second chunk flipped.
    let chunks = chunk_files(t.path());
    let bad = chunks[1].clone();
    let hash = bad.file_name().unwrap().to_str().unwrap().to_string();
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[1000] ^= 0xff;
    std::fs::write(&bad, &bytes).unwrap();
    let v = s.post(&format!("/v1/backups/{id}/verify"), json!({})).await;
    assert_eq!(v.body["ok"], false, "{}", v.body);
    let corrupt = v.body["corrupt"].as_array().unwrap();
    assert_eq!(corrupt.len(), 1, "{}", v.body);
    assert_eq!(corrupt[0]["hash"], hash.as_str(), "{}", v.body);

    // The restore fails naming it, and leaves no file and nothing to serve.
    let (_, path) = start_restore(&s, id, "r").await;
    let r = image_end(&s, "r").await;
    assert_eq!(r["state"], "failed", "{r}");
    let reason = r["state_reason"].as_str().unwrap();
    assert!(
        reason.contains(&hash[..12]),
        "the reason names no chunk: {reason}"
    );
    assert!(!path.exists(), "the half-restored file stays");
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "rv", "image": "r", "backend": "loop"}),
        )
        .await;
    assert_error(&v, 409, "image_not_ready");

    // A chunk gone is named missing.
    std::fs::remove_file(&bad).unwrap();
    let v = s.post(&format!("/v1/backups/{id}/verify"), json!({})).await;
    assert_eq!(v.body["missing"][0]["hash"], hash.as_str(), "{}", v.body);
    let index = v.body["missing"][0]["index"].as_u64().unwrap();
    let out = std::process::Command::new(crate::harness::bin())
        .args([
            "--api",
            &format!("unix:{}", s.sock.display()),
            "backup",
            "verify",
            id,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!(
            "missing: chunk {index} at offset {}",
            index * CHUNK
        )),
        "{text}"
    );
}

#[tokio::test]
async fn a_gc_during_a_backup_keeps_the_chunks_it_uses_and_collects_the_rest() {
    let t = dir_target();
    // A backup waits after each chunk while the gate file exists.
    let s = service_to(
        t.path().to_str().unwrap(),
        &[("BLOCKPLANE_TEST_FAULT", "gate_backup")],
    )
    .await;
    let gate = s.data.join("run/backup-gate");
    // b holds a's bytes and more: its backup deduplicates a's chunks.
    let a_path = image_with(&s, "a", 24 * MIB, &[(0, 20 * MIB)], 5).await;
    image_with(&s, "old", 8 * MIB, &[(0, 8 * MIB)], 77).await;
    let a1 = backup(&s, "a", "one").await;
    let old1 = backup(&s, "old", "one").await;
    let b_path = s.images.join("b.img");
    let mut bytes = std::fs::read(&a_path).unwrap();
    bytes.resize((200 * MIB) as usize, 0);
    std::fs::write(&b_path, &bytes).unwrap();
    write_pattern(&b_path, &[(24 * MIB, 170 * MIB)], 11);
    let a = s
        .post("/v1/images", json!({"name": "b", "path": b_path}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let moment = std::fs::read(&b_path).unwrap();
    std::fs::create_dir_all(gate.parent().unwrap()).unwrap();
    std::fs::write(&gate, b"").unwrap();
    let b1 = start_backup(&s, "b", "one").await;
    let b_id = b1["id"].as_str().unwrap();
    // Once it stores chunks, it has read the manifests it deduplicates against.
    eventually(WAIT, "b's backup to start storing", async || {
        s.get(&format!("/v1/backups/{b_id}")).await.body["done_bytes"]
            .as_u64()
            .unwrap_or(0)
            > 0
    })
    .await;
    // Both earlier backups deleted while b's runs: a's chunks are then
    // referenced by no manifest, only by the running backup.
    for id in [&a1["id"], &old1["id"]] {
        let d = s
            .delete(&format!("/v1/backups/{}", id.as_str().unwrap()))
            .await;
        assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
    }
    let gc = s.post("/v1/backups/gc", json!({})).await;
    assert_eq!(gc.status, StatusCode::OK, "{}", gc.body);
    assert_eq!(gc.body["running_backups"], 1, "{}", gc.body);
    let still = s.get(&format!("/v1/backups/{b_id}")).await.body;
    assert_eq!(still["state"], "running", "the gate holds it: {still}");
    // Meanwhile the image it reads takes no writer.
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "bv", "image": "b", "backend": "loop"}),
        )
        .await;
    assert_error(&v, 409, "backup_source_busy");
    let msg = v.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(b_id), "the refusal names the backup: {msg}");
    std::fs::remove_file(&gate).unwrap();
    let b = backup_end(&s, b_id).await;
    assert_eq!(b["state"], "done", "{b}");
    assert_eq!(b["deduplicated_bytes"], 5 * CHUNK, "{b}");
    let v = s
        .post(&format!("/v1/backups/{b_id}/verify"), json!({}))
        .await;
    assert_eq!(
        v.body["ok"], true,
        "a gc took a chunk the backup uses: {}",
        v.body
    );
    let r = restore(&s, b_id, "r").await;
    assert!(
        std::fs::read(&r).unwrap() == moment,
        "restored bytes differ"
    );
    // With no backup running, old's chunks (no manifest) go; b's stay.
    let gc = s.post("/v1/backups/gc", json!({})).await;
    assert_eq!(gc.body["running_backups"], 0, "{}", gc.body);
    assert_eq!(
        chunk_files(t.path()).len() as u64,
        b["chunks"].as_u64().unwrap()
    );
}

/// A service holding a backup: its backups wait after each chunk while the
/// gate file exists (`gate_backup`); keys are made fast for the tests that
/// encrypt.
async fn gated_service(t: &tempfile::TempDir) -> Service {
    Service::start_with(Opts {
        extra_args: vec![
            "--backup-target".into(),
            t.path().to_str().unwrap().into(),
            "--key-unlock-ms".into(),
            "100".into(),
        ],
        env: vec![("BLOCKPLANE_TEST_FAULT".into(), "gate_backup".into())],
        ..Default::default()
    })
    .await
}

/// Holds a backup of `image` mid-way (the gate shut after its first chunk),
/// sends `writer` (`what` it is), and asserts it is 409
/// `backup_source_busy` naming the backup with nothing changed: images,
/// volumes, events, devices, files and the registry as before. Then lets
/// the backup end, `done`.
async fn refused_while_backed_up(
    s: &Service,
    image: &str,
    what: &str,
    writer: impl AsyncFnOnce() -> blockplane_client::Answer,
) {
    let gate = s.data.join("run/backup-gate");
    std::fs::create_dir_all(gate.parent().unwrap()).unwrap();
    std::fs::write(&gate, b"").unwrap();
    let id = start_backup(s, image, "held").await["id"]
        .as_str()
        .unwrap()
        .to_string();
    eventually(WAIT, "the backup to read its first chunk", async || {
        s.get(&format!("/v1/backups/{id}")).await.body["done_bytes"]
            .as_u64()
            .unwrap_or(0)
            > 0
    })
    .await;
    let before = s.snapshot().await;
    let a = writer().await;
    assert_error(&a, 409, "backup_source_busy");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&id),
        "{what}: the refusal names the backup: {msg}"
    );
    assert_eq!(
        s.snapshot().await,
        before,
        "{what} was refused but changed something"
    );
    let still = s.get(&format!("/v1/backups/{id}")).await.body;
    assert_eq!(still["state"], "running", "the gate holds it: {still}");
    std::fs::remove_file(&gate).unwrap();
    let b = backup_end(s, &id).await;
    assert_eq!(b["state"], "done", "{b}");
}

/// An image of three chunks (12 MiB, data in each) for a backup to hold.
async fn held_image(s: &Service) {
    image_with(s, "a", 3 * CHUNK, &[(0, 3 * CHUNK)], 31).await;
}

#[tokio::test]
async fn a_backup_refuses_a_writable_volume_and_nothing_changes() {
    let t = dir_target();
    let s = gated_service(&t).await;
    held_image(&s).await;
    refused_while_backed_up(&s, "a", "a writable volume", async || {
        s.post(
            "/v1/volumes",
            json!({"name": "av", "image": "a", "backend": "loop"}),
        )
        .await
    })
    .await;
}

#[tokio::test]
async fn a_backup_refuses_a_grow_and_nothing_changes() {
    let t = dir_target();
    let s = gated_service(&t).await;
    held_image(&s).await;
    refused_while_backed_up(&s, "a", "a grow", async || {
        s.post("/v1/images/a/resize", json!({"size_bytes": 4 * CHUNK}))
            .await
    })
    .await;
}

#[tokio::test]
async fn a_backup_refuses_an_allocate_and_nothing_changes() {
    let t = dir_target();
    let s = gated_service(&t).await;
    held_image(&s).await;
    refused_while_backed_up(&s, "a", "an allocate", async || {
        s.post("/v1/images/a/allocate", json!(null)).await
    })
    .await;
}

#[tokio::test]
async fn a_backup_refuses_a_forget_and_nothing_changes() {
    let t = dir_target();
    let s = gated_service(&t).await;
    held_image(&s).await;
    refused_while_backed_up(&s, "a", "a forget", async || s.delete("/v1/images/a").await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_refuses_a_key_slot_change_and_nothing_changes() {
    let t = dir_target();
    let s = gated_service(&t).await;
    let path = s.images.join("a.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "a", "path": path,
                   "create": {"size_bytes": 24 * MIB, "encryption": {"key": "old"}}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    refused_while_backed_up(&s, "a", "a key slot added", async || {
        s.post("/v1/images/a/keys", json!({"key": "old", "new_key": "new"}))
            .await
    })
    .await;
}

#[tokio::test]
async fn a_kill_during_a_backup_or_a_restore_leaves_no_manifest_and_no_ready_image() {
    let t = dir_target();
    let mut s = service_to(t.path().to_str().unwrap(), &[]).await;
    let a_path = image_with(&s, "a", 48 * MIB, &[(0, 40 * MIB)], 9).await;
    let one = backup(&s, "a", "one").await;
    let moment = std::fs::read(&a_path).unwrap();
    write_pattern(&a_path, &[(0, 40 * MIB)], 10);
    let before = chunk_files(t.path());

    // A backup killed after its first chunks: no manifest, and its chunks
    // go at the next gc once the restarted service released its lease.
    s.kill();
    s.spawn(&[("BLOCKPLANE_TEST_FAULT", "slow_backup")]);
    s.wait_ready().await;
    let id = start_backup(&s, "a", "two").await["id"]
        .as_str()
        .unwrap()
        .to_string();
    eventually(WAIT, "the backup to store a chunk", async || {
        chunk_files(t.path()).len() > before.len()
    })
    .await;
    s.kill();
    s.spawn(&[]);
    s.wait_ready().await;
    let got = s.get(&format!("/v1/backups/{id}")).await;
    assert_error(&got, 404, "backup_not_found");
    assert!(!t.path().join(format!("backups/{id}.json")).exists());
    eventually(WAIT, "the dead backup's lease to be released", async || {
        std::fs::read_dir(t.path().join("leases")).map_or(true, |d| d.count() == 0)
    })
    .await;
    let gc = s.post("/v1/backups/gc", json!({})).await;
    assert!(
        gc.body["chunks_deleted"].as_u64().unwrap() >= 1,
        "{}",
        gc.body
    );
    assert_eq!(chunk_files(t.path()), before, "{}", gc.body);
    let kinds = event_kinds(&s).await;
    assert!(kinds.iter().any(|k| k == "backup_started"), "{kinds:?}");

    // A restore killed mid-way: its image is failed and its file gone.
    s.kill();
    s.spawn(&[("BLOCKPLANE_TEST_FAULT", "slow_copy")]);
    s.wait_ready().await;
    let (_, path) = start_restore(&s, one["id"].as_str().unwrap(), "r").await;
    eventually(WAIT, "the restore to write", async || {
        s.get("/v1/images/r").await.body["copied_bytes"]
            .as_u64()
            .unwrap_or(0)
            > 0
    })
    .await;
    s.kill();
    s.spawn(&[]);
    s.wait_ready().await;
    let r = s.get("/v1/images/r").await.body;
    assert_eq!(r["state"], "failed", "{r}");
    assert!(!path.exists(), "the half-restored file stays");
    // Deleted and restored again, it is whole.
    let d = s.delete("/v1/images/r").await;
    assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
    let r = restore(&s, one["id"].as_str().unwrap(), "r").await;
    assert!(
        std::fs::read(&r).unwrap() == moment,
        "restored bytes differ"
    );
}

#[tokio::test]
async fn a_target_that_goes_away_fails_the_backup_and_leaves_the_image_as_it_was() {
    let t = dir_target();
    let root = t.path().join("mnt");
    std::fs::create_dir(&root).unwrap();
    let s = service_to(
        root.to_str().unwrap(),
        &[("BLOCKPLANE_TEST_FAULT", "slow_backup")],
    )
    .await;
    image_with(&s, "a", 64 * MIB, &[(0, 60 * MIB)], 21).await;
    let id = start_backup(&s, "a", "one").await["id"]
        .as_str()
        .unwrap()
        .to_string();
    eventually(WAIT, "the backup to store a chunk", async || {
        !chunk_files(&root).is_empty()
    })
    .await;
    // The mount is gone: its path is now a plain file.
    std::fs::rename(&root, t.path().join("gone")).unwrap();
    std::fs::write(&root, b"not a directory").unwrap();
    let b = backup_end(&s, &id).await;
    assert_eq!(b["state"], "failed", "{b}");
    let error = b["error"].as_str().unwrap();
    assert!(
        error.contains(root.to_str().unwrap()),
        "the error names no target: {error}"
    );
    // The image is free again: a writable volume on it.
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "av", "image": "a", "backend": "loop"}),
        )
        .await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let kinds = event_kinds(&s).await;
    assert!(kinds.iter().any(|k| k == "backup_failed"), "{kinds:?}");
}

#[tokio::test]
async fn a_full_target_fails_the_backup_clearly_and_the_volume_keeps_serving() {
    // A 32 MiB filesystem for 48 MiB of data.
    let full = crate::harness::LoopFs::new(&["mkfs.ext4", "-q", "-F"], 32 * MIB);
    let s = service_to(full.mnt.to_str().unwrap(), &[]).await;
    image_with(&s, "a", 64 * MIB, &[(0, 48 * MIB)], 41).await;
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "av", "image": "a", "backend": "loop", "read_only": true}),
        )
        .await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let id = start_backup(&s, "a", "one").await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let b = backup_end(&s, &id).await;
    assert_eq!(b["state"], "failed", "{b}");
    let error = b["error"].as_str().unwrap();
    assert!(error.contains("No space left on device"), "{error}");
    assert!(
        error.contains(full.mnt.to_str().unwrap()),
        "the error names no target: {error}"
    );
    // The volume reads on, and no manifest was written.
    let dev = v.body["device"].as_str().unwrap();
    let mut buf = vec![0u8; 4096];
    std::fs::File::open(dev)
        .unwrap()
        .read_exact_at(&mut buf, 8 * MIB)
        .unwrap();
    assert!(buf.iter().any(|&b| b != 0), "the volume reads its data");
    assert!(std::fs::read_dir(full.mnt.join("backups")).map_or(true, |mut d| d.next().is_none()));
    let got = s.get("/v1/volumes/av").await.body;
    assert_eq!(got["state"], "attached", "{got}");
}

#[tokio::test]
async fn a_second_service_on_another_data_dir_lists_and_restores_the_backups() {
    let t = dir_target();
    let target = t.path().to_str().unwrap();
    let s1 = service_to(target, &[]).await;
    let a_path = image_with(&s1, "a", 16 * MIB, &[(4096, 9 * MIB)], 13).await;
    let one = backup(&s1, "a", "one").await;
    let s2 = service_to(target, &[]).await;
    let list = s2.get("/v1/backups").await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    assert_eq!(list.body[0]["id"], one["id"], "{}", list.body);
    // By name: the image is not registered here, the backup's name is unique.
    let got = s2.get("/v1/backups?image=a").await.body;
    assert_eq!(got.as_array().unwrap().len(), 1, "{got}");
    let r = restore(&s2, "one", "a").await;
    assert!(
        std::fs::read(&r).unwrap() == std::fs::read(&a_path).unwrap(),
        "restored bytes differ"
    );
}

#[tokio::test]
async fn without_a_target_backups_are_refused_naming_the_flag() {
    let s = Service::start().await;
    s.image("a", 4).await;
    let a = s.post("/v1/images/a/backups", json!({"name": "one"})).await;
    assert_error(&a, 409, "no_backup_target");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--backup-target"),
        "{}",
        a.body
    );
    assert_error(&s.get("/v1/backups").await, 409, "no_backup_target");
}

/// The test S3 server as a backup target of a service.
pub(crate) trait S3Service {
    /// A service whose target is `prefix` of the bucket, with `secret` as
    /// its secret key, and `extra` arguments and `env`.
    async fn service(
        &self,
        prefix: &str,
        secret: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> (Service, tempfile::NamedTempFile);

    /// A credentials file with the server's key and `secret`.
    fn credentials(&self, secret: &str) -> tempfile::NamedTempFile;
}

impl S3Service for S3 {
    async fn service(
        &self,
        prefix: &str,
        secret: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> (Service, tempfile::NamedTempFile) {
        let creds = self.credentials(secret);
        let mut extra_args = vec![
            "--backup-target".to_string(),
            format!("s3://bucket/{prefix}?endpoint={}", self.endpoint),
            "--backup-credentials".to_string(),
            creds.path().display().to_string(),
        ];
        extra_args.extend(extra.iter().map(|a| a.to_string()));
        let s = Service::start_with(Opts {
            extra_args,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        })
        .await;
        (s, creds)
    }

    fn credentials(&self, secret: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            f.path(),
            format!(
                "access_key_id = {}\nsecret_access_key = {secret}\n",
                self.access_key_id
            ),
        )
        .unwrap();
        f
    }
}

/// Every place the service writes that a secret must never reach: the
/// registry and its WAL, the event log, and the service's own log. Each
/// is read whole, as bytes, so a value split across lines or tables is
/// still found.
async fn assert_nowhere(s: &Service, secret: &str) {
    assert!(secret.len() >= 16, "a secret too short to look for");
    let mut places: Vec<(String, Vec<u8>)> = ["blockplane.db", "blockplane.db-wal"]
        .iter()
        .map(|f| {
            let p = s.data.join(f);
            (
                p.display().to_string(),
                std::fs::read(&p).unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        !places[0].1.is_empty(),
        "the registry is where the test looks"
    );
    let events = s.get("/v1/events?limit=1000").await;
    places.push((
        "GET /v1/events".into(),
        events.body.to_string().into_bytes(),
    ));
    places.push(("the service's log".into(), s.log_text().into_bytes()));
    for (place, bytes) in &places {
        assert!(
            !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "the secret is in {place}"
        );
    }
}

#[tokio::test]
async fn backups_go_to_s3_compatible_storage_and_come_back() {
    let s3 = S3::start();
    let (s, _creds) = s3.service("host-a", &s3.secret_access_key, &[], &[]).await;
    let a_path = image_with(&s, "a", 24 * MIB, &[(0, 16 * MIB)], 31).await;
    let moment = std::fs::read(&a_path).unwrap();
    let one = backup(&s, "a", "one").await;
    assert_eq!(one["uploaded_bytes"], 4 * CHUNK, "{one}");
    write_pattern(&a_path, &[(CHUNK, 512)], 1);
    let two = backup(&s, "a", "two").await;
    assert_eq!(two["uploaded_bytes"], CHUNK, "{two}");
    let r = restore(&s, one["id"].as_str().unwrap(), "r").await;
    assert!(
        std::fs::read(&r).unwrap() == moment,
        "restored bytes differ"
    );
    // Deleted, and its own chunk collected.
    let d = s
        .delete(&format!("/v1/backups/{}", two["id"].as_str().unwrap()))
        .await;
    assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
    // S3 keeps times to the second: a tombstone of the same second as a
    // gc's start still protects its chunks, so a later gc collects them.
    eventually(
        WAIT,
        "a gc to collect the deleted backup's own chunk",
        async || {
            let gc = s.post("/v1/backups/gc", json!({})).await;
            assert_eq!(gc.status, StatusCode::OK, "{}", gc.body);
            gc.body["chunks_kept"] == 4
        },
    )
    .await;
    // The secret is nowhere the service writes.
    assert_nowhere(&s, &s3.secret_access_key).await;
}

/// Two services on one target delete backups and collect at once while
/// backups run on both; afterwards every backup left restores byte-equal.
/// One gc runs on a target at a time: a gc asked while another service's
/// runs is 409 `backup_gc_busy` and deletes nothing. (The interleaving that
/// loses a chunk without the lock is forced in the backup crate's unit
/// test `one_gc_at_a_time_on_a_directory_and_every_backup_left_restores`;
/// here the services race as they would.)
#[tokio::test]
async fn two_services_deleting_and_collecting_at_once_leave_every_backup_restorable() {
    let t = dir_target();
    let target = t.path().to_str().unwrap();
    let s1 = service_to(target, &[]).await;
    let s2 = service_to(target, &[]).await;
    // The same bytes at the same offsets: the two images share chunks, so
    // one service's deletes and gcs touch chunks the other's backups name.
    let a = image_with(&s1, "a", 16 * MIB, &[(0, 12 * MIB)], 21).await;
    let b = image_with(&s2, "b", 16 * MIB, &[(0, 12 * MIB)], 21).await;
    let mut kept: Vec<(String, Vec<u8>)> = Vec::new();
    let mut previous: Vec<String> = Vec::new();
    let (mut busy, mut collected) = (0, 0);
    for round in 0..4u64 {
        write_pattern(&a, &[(4 * MIB + round * MIB, 4096)], round as u8 + 1);
        write_pattern(&b, &[(8 * MIB + round * MIB, 4096)], round as u8 + 7);
        let moments = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let x = start_backup(&s1, "a", &format!("a{round}")).await;
        let y = start_backup(&s2, "b", &format!("b{round}")).await;
        // While both run: the last round's backups deleted, each by the
        // other service, and a gc asked of both at once.
        for (i, id) in previous.drain(..).enumerate() {
            let s = if i % 2 == 0 { &s2 } else { &s1 };
            let d = s.delete(&format!("/v1/backups/{id}")).await;
            assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
        }
        let (g1, g2) = tokio::join!(
            s1.post("/v1/backups/gc", json!({})),
            s2.post("/v1/backups/gc", json!({}))
        );
        for g in [g1, g2] {
            if g.status == StatusCode::CONFLICT {
                assert_error(&g, 409, "backup_gc_busy");
                busy += 1;
            } else {
                assert_eq!(g.status, StatusCode::OK, "{}", g.body);
                collected += 1;
            }
        }
        for (s, v, moment) in [(&s1, &x, moments.0), (&s2, &y, moments.1)] {
            let id = v["id"].as_str().unwrap().to_string();
            let end = backup_end(s, &id).await;
            assert_eq!(end["state"], "done", "{end}");
            // Every other round's backups stay to the end.
            if round % 2 == 0 {
                previous.push(id);
            } else {
                kept.push((id, moment));
            }
        }
    }
    eprintln!("gcs asked: {collected} ran, {busy} refused as busy");
    let last = s1.post("/v1/backups/gc", json!({})).await;
    assert_eq!(last.status, StatusCode::OK, "{}", last.body);
    for (i, (id, moment)) in kept.iter().enumerate() {
        let r = restore(&s1, id, &format!("r{i}")).await;
        assert!(
            std::fs::read(&r).unwrap() == *moment,
            "backup {id}: restored bytes differ"
        );
    }
}

/// A service whose S3 secret is wrong: the server refuses its requests
/// (signatures are checked), and a backup is refused with an error that
/// names the target.
#[tokio::test]
async fn a_wrong_s3_secret_is_refused_naming_the_target() {
    let s3 = S3::start();
    let (s, _creds) = s3
        .service("host-w", "not-the-secret-at-all", &[], &[])
        .await;
    s.image("w", 4).await;
    let a = s.post("/v1/images/w/backups", json!({"name": "one"})).await;
    assert_error(&a, 503, "backup_target_unavailable");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("s3://bucket/host-w") && msg.contains("SignatureDoesNotMatch"),
        "{msg}"
    );
    assert_nowhere(&s, "not-the-secret-at-all").await;
}

/// An S3 target that takes connections and never answers fails the
/// running backup after `--backup-timeout-secs`, naming the target, and
/// lets the image's writers go.
#[tokio::test]
async fn a_hung_target_fails_the_backup_after_the_timeout_and_frees_the_image() {
    let s3 = S3::start();
    let (s, _creds) = s3
        .service(
            "host-h",
            &s3.secret_access_key,
            &["--backup-timeout-secs", "2"],
            &[("BLOCKPLANE_TEST_FAULT", "slow_backup")],
        )
        .await;
    image_with(&s, "a", 64 * MIB, &[(0, 60 * MIB)], 23).await;
    let id = start_backup(&s, "a", "one").await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let busy = s
        .post(
            "/v1/volumes",
            json!({"name": "av", "image": "a", "backend": "loop"}),
        )
        .await;
    assert_error(&busy, 409, "backup_source_busy");
    s3.fault("hang");
    let b = backup_end(&s, &id).await;
    s3.fault("clear");
    assert_eq!(b["state"], "failed", "{b}");
    let error = b["error"].as_str().unwrap();
    assert!(
        error.contains("s3://bucket/host-h")
            && (error.contains("hung") || error.contains("timed out")),
        "{error}"
    );
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "av", "image": "a", "backend": "loop"}),
        )
        .await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
}

/// The names of image `p`'s backups, oldest first.
async fn listed(s: &Service) -> Vec<String> {
    let l = s.get("/v1/backups?image=p").await.body;
    names(&l).iter().map(|n| n.to_string()).collect()
}

/// The backups' names in a list.
fn names(list: &Value) -> Vec<&str> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn a_prune_deletes_what_its_policy_does_not_keep_and_the_kept_restore() {
    let t = dir_target();
    let s = service_to(t.path().to_str().unwrap(), &[]).await;
    let path = image_with(&s, "p", 16 * MIB, &[(0, 2 * CHUNK)], 1).await;
    // Four backups, each of a moment with a chunk of its own.
    let mut moments = Vec::new();
    for n in 1..=4u8 {
        write_pattern(&path, &[(2 * CHUNK, CHUNK)], 2 * n + 2);
        backup(&s, "p", &format!("p{n}")).await;
        moments.push(std::fs::read(&path).unwrap());
    }
    let chunks = chunk_files(t.path());
    assert_eq!(chunks.len(), 6);

    // Refused, changing nothing: a policy that keeps nothing, an unknown
    // field, an image nobody knows.
    let a = s
        .post("/v1/images/p/backups/prune", json!({"retention": {}}))
        .await;
    assert_error(&a, 422, "retention_keeps_nothing");
    let a = s
        .post(
            "/v1/images/p/backups/prune",
            json!({"retention": {"keep_last": 1, "keep_hourly": 2}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.body);
    let a = s
        .post(
            "/v1/images/nobody/backups/prune",
            json!({"retention": {"keep_last": 1}}),
        )
        .await;
    assert_error(&a, 404, "image_not_found");
    assert_eq!(listed(&s).await, ["p1", "p2", "p3", "p4"]);

    // A dry run says what would go, and deletes nothing.
    let a = s
        .post(
            "/v1/images/p/backups/prune",
            json!({"retention": {"keep_last": 2}, "dry_run": true}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["dry_run"], true, "{}", a.body);
    assert_eq!(names(&a.body["kept"]), ["p4", "p3"], "{}", a.body);
    assert_eq!(a.body["kept"][0]["kept_by"], "last", "{}", a.body);
    assert_eq!(names(&a.body["deleted"]), ["p2", "p1"], "{}", a.body);
    assert_eq!(listed(&s).await, ["p1", "p2", "p3", "p4"]);
    assert_eq!(chunk_files(t.path()), chunks);

    // The prune: p1 and p2 deleted, with their events; the gc that follows
    // frees the chunks only they had.
    let a = s
        .post(
            "/v1/images/p/backups/prune",
            json!({"retention": {"keep_last": 2}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(names(&a.body["deleted"]), ["p2", "p1"], "{}", a.body);
    assert_eq!(listed(&s).await, ["p3", "p4"]);
    let deletes = event_kinds(&s)
        .await
        .into_iter()
        .filter(|k| k == "backup_deleted")
        .count();
    assert_eq!(deletes, 2);
    eventually(WAIT, "the gc after the prune", async || {
        chunk_files(t.path()).len() == 4
    })
    .await;
    // Asked again, the same policy finds nothing more to delete.
    let a = s
        .post(
            "/v1/images/p/backups/prune",
            json!({"retention": {"keep_last": 2}}),
        )
        .await;
    assert_eq!(names(&a.body["deleted"]), Vec::<&str>::new(), "{}", a.body);

    // What was kept comes back byte-equal.
    for (n, moment) in [(3, &moments[2]), (4, &moments[3])] {
        let r = restore(&s, &format!("p{n}"), &format!("r{n}")).await;
        assert!(std::fs::read(&r).unwrap() == *moment, "p{n} restored wrong");
    }
}
