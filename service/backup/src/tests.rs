//! Backups against a directory target in a temporary directory, with real
//! sparse files; and the parsing of target specifications.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, SystemTime};

use blockplane_system::image::AllocateJob;
use blockplane_test_support::s3::S3Server;
use bytes::Bytes;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::config::parse_with_env;
use crate::*;

mod standby;
mod trust;

const C: u64 = CHUNK_SIZE;

struct Env {
    _dir: tempfile::TempDir,
    /// A directory target's directory (an S3 target's is unused).
    root: PathBuf,
    images: PathBuf,
    target: Target,
    /// The S3 server of an S3 target, stopped when the test ends.
    s3: Option<S3Server>,
}

fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("target");
    let images = dir.path().join("images");
    std::fs::create_dir(&root).unwrap();
    std::fs::create_dir(&images).unwrap();
    let cfg = TargetConfig::parse(root.to_str().unwrap(), None).unwrap();
    let target = Target::open(&cfg, DEFAULT_TIMEOUT).unwrap();
    Env {
        _dir: dir,
        root,
        images,
        target,
        s3: None,
    }
}

/// A target on the test S3 server.
trait S3Target {
    /// A target under `prefix` of the bucket, with `secret` as the secret
    /// key.
    fn target_config(&self, prefix: &str, secret: &str) -> TargetConfig;
}

impl S3Target for S3Server {
    fn target_config(&self, prefix: &str, secret: &str) -> TargetConfig {
        let spec = format!("s3://{}/{prefix}?endpoint={}", self.bucket, self.endpoint);
        parse_with_env(&spec, None, |n| match n {
            "AWS_ACCESS_KEY_ID" => Some(self.access_key_id.clone()),
            "AWS_SECRET_ACCESS_KEY" => Some(secret.to_string()),
            _ => None,
        })
        .unwrap()
    }
}

/// An environment whose target is the test S3 server, under a prefix of
/// its own.
fn s3_env() -> Env {
    s3_env_with(DEFAULT_TIMEOUT)
}

/// [`s3_env`] with `timeout` for the target.
fn s3_env_with(timeout: Duration) -> Env {
    let s3 = S3Server::start();
    let prefix = format!("run-{}", Uuid::new_v4());
    let target = Target::open(&s3.target_config(&prefix, &s3.secret_access_key), timeout).unwrap();
    Env {
        target,
        s3: Some(s3),
        ..env()
    }
}

/// A pattern no two chunks share unless given the same seed.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3] ^ seed)
        .collect()
}

/// A sparse file of `size` bytes with `writes` at their offsets.
fn image(env: &Env, name: &str, size: u64, writes: &[(u64, Vec<u8>)]) -> PathBuf {
    let path = env.images.join(name);
    let f = File::create(&path).unwrap();
    f.set_len(size).unwrap();
    for (off, data) in writes {
        f.write_all_at(data, *off).unwrap();
    }
    f.sync_all().unwrap();
    path
}

fn meta(name: &str, size: u64) -> BackupMeta {
    BackupMeta {
        id: Uuid::new_v4(),
        name: name.to_string(),
        image: ImageMeta {
            id: Uuid::new_v4(),
            name: format!("{name}-image"),
            size_bytes: size,
            encrypted: false,
        },
        source: SourceMeta {
            host: "host-a".to_string(),
            path: format!("/images/{name}"),
            service: "svc-1".to_string(),
        },
        created_at: OffsetDateTime::now_utc(),
    }
}

async fn take(env: &Env, name: &str, path: &Path) -> Manifest {
    let size = std::fs::metadata(path).unwrap().len();
    let job = Arc::new(AllocateJob::default());
    let m = backup(
        &env.target,
        meta(name, size),
        File::open(path).unwrap(),
        Arc::clone(&job),
        Arc::new(Counters::default()),
    )
    .await
    .unwrap()
    .expect("not cancelled");
    assert_eq!(job.done_bytes.load(Relaxed), job.total_bytes.load(Relaxed));
    m
}

async fn restore_to(env: &Env, m: &Manifest, name: &str) -> Result<PathBuf> {
    let path = env.images.join(name);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    let done = restore(&env.target, m, f, Arc::new(AllocateJob::default())).await?;
    assert!(done);
    Ok(path)
}

fn chunk_file(env: &Env, hash: &str) -> PathBuf {
    env.root.join("chunks").join(&hash[..2]).join(hash)
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn set_mtime(path: &Path, ago: Duration) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - ago).unwrap();
}

/// Runs gc until its report passes `done`: on a target whose clock counts
/// whole seconds, what was written in gc's own second waits for the next.
async fn gc_until(target: &Target, done: impl Fn(&GcReport) -> bool) -> GcReport {
    for _ in 0..200 {
        let r = gc(target, "svc-1").await.unwrap();
        if done(&r) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "gc never reached the state asked for on {}",
        target.describe()
    );
}

/// Lets the filesystem's timestamp clock tick past what was just written.
async fn tick() {
    tokio::time::sleep(Duration::from_millis(30)).await;
}

#[tokio::test]
async fn a_sparse_image_restores_byte_equal_and_sparse() {
    let env = env();
    let size = 5 * C + 1000;
    let src = image(
        &env,
        "src",
        size,
        &[
            (0, pattern(1, C as usize)),
            // Chunk 2: written zeros, a data extent that is skipped like a hole.
            (2 * C, vec![0; C as usize]),
            // Chunk 3: data in its middle, hole around it.
            (3 * C + 4096 * 10, pattern(3, 100_000)),
            // The 1000-byte tail chunk.
            (5 * C, pattern(5, 1000)),
        ],
    );
    let job = Arc::new(AllocateJob::default());
    let counters = Arc::new(Counters::default());
    let md = meta("round-trip", size);
    let m = backup(
        &env.target,
        md.clone(),
        File::open(&src).unwrap(),
        Arc::clone(&job),
        Arc::clone(&counters),
    )
    .await
    .unwrap()
    .unwrap();
    let indexes: Vec<u64> = m.chunks.iter().map(|c| c.index).collect();
    assert_eq!(indexes, [0, 3, 5]);
    assert_eq!(m.chunks[2].bytes, 1000);
    assert_eq!(m.stored_bytes, 2 * C + 1000);
    assert_eq!(m.uploaded_bytes, 2 * C + 1000);
    assert_eq!(m.deduplicated_bytes, 0);
    assert_eq!(counters.uploaded_bytes.load(Relaxed), m.uploaded_bytes);
    // Chunks 0, 2, 3 and 5 hold data ranges.
    assert_eq!(job.total_bytes.load(Relaxed), 3 * C + 1000);
    assert_eq!(job.done_bytes.load(Relaxed), 3 * C + 1000);
    assert_eq!(
        (m.id, &m.name, &m.image, &m.source),
        (md.id, &md.name, &md.image, &md.source)
    );
    assert!(m.checksum.starts_with("blake3:"));
    assert!(
        files_under(&env.root.join("leases")).is_empty(),
        "the lease is deleted"
    );

    let listed = list(&env.target).await.unwrap();
    assert_eq!(listed, std::slice::from_ref(&m));
    assert_eq!(manifest(&env.target, m.id).await.unwrap(), m);

    let out = restore_to(&env, &m, "restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&src).unwrap());
    let (src_blocks, out_blocks) = (
        std::fs::metadata(&src).unwrap().blocks(),
        std::fs::metadata(&out).unwrap().blocks(),
    );
    assert!(
        out_blocks < src_blocks,
        "restored {out_blocks} blocks, source {src_blocks}"
    );
    assert!(
        out_blocks * 512 < 3 * C,
        "holes and the zero chunk stay holes: {out_blocks} blocks"
    );

    let report = verify(&env.target, &m, Arc::new(AllocateJob::default()))
        .await
        .unwrap();
    assert!(report.ok());
    assert_eq!((report.chunks, report.bytes), (3, 2 * C + 1000));
}

#[tokio::test]
async fn a_second_backup_uploads_only_the_changed_chunk() {
    let env = env();
    let size = 4 * C;
    let writes: Vec<(u64, Vec<u8>)> = (0..4)
        .map(|i| (i * C, pattern(i as u8, C as usize)))
        .collect();
    let src = image(&env, "src", size, &writes);
    let first = take(&env, "first", &src).await;
    assert_eq!(first.uploaded_bytes, 4 * C);

    File::options()
        .write(true)
        .open(&src)
        .unwrap()
        .write_all_at(b"changed", C + 17)
        .unwrap();
    let counters = Arc::new(Counters::default());
    let second = backup(
        &env.target,
        meta("second", size),
        File::open(&src).unwrap(),
        Arc::new(AllocateJob::default()),
        Arc::clone(&counters),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(second.uploaded_bytes, C);
    assert_eq!(second.deduplicated_bytes, 3 * C);
    assert_eq!(counters.uploaded_bytes.load(Relaxed), C);
    assert_eq!(counters.deduplicated_bytes.load(Relaxed), 3 * C);
    assert_eq!(files_under(&env.root.join("chunks")).len(), 5);

    let out = restore_to(&env, &second, "restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&src).unwrap());
    let list = list(&env.target).await.unwrap();
    assert_eq!(
        list.iter().map(|m| m.id).collect::<Vec<_>>(),
        [first.id, second.id],
        "oldest first"
    );
}

#[tokio::test]
async fn two_images_sharing_chunks_store_them_once() {
    let env = env();
    let shared = pattern(9, C as usize);
    let x = image(
        &env,
        "x",
        2 * C,
        &[(0, shared.clone()), (C, pattern(1, C as usize))],
    );
    // The shared chunk at another index, twice in one image.
    let y = image(
        &env,
        "y",
        3 * C,
        &[(C, shared.clone()), (2 * C, shared.clone())],
    );
    take(&env, "x", &x).await;
    let my = take(&env, "y", &y).await;
    assert_eq!(my.uploaded_bytes, 0);
    assert_eq!(my.deduplicated_bytes, 2 * C);
    assert_eq!(files_under(&env.root.join("chunks")).len(), 2);
    let out = restore_to(&env, &my, "y-restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&y).unwrap());
}

#[tokio::test]
async fn a_repeated_chunk_in_one_backup_is_uploaded_once() {
    let env = env();
    let p = pattern(4, C as usize);
    let src = image(
        &env,
        "src",
        3 * C,
        &[(0, p.clone()), (C, p.clone()), (2 * C, p)],
    );
    let m = take(&env, "rep", &src).await;
    assert_eq!((m.uploaded_bytes, m.deduplicated_bytes), (C, 2 * C));
}

#[tokio::test]
async fn a_corrupt_chunk_fails_the_restore_naming_it_and_verify_reports_it() {
    let env = env();
    let src = image(
        &env,
        "src",
        3 * C,
        &[(0, pattern(1, C as usize)), (2 * C, pattern(2, C as usize))],
    );
    let m = take(&env, "corrupt-me", &src).await;
    let bad = &m.chunks[1];
    assert_eq!(bad.index, 2);
    let f = File::options()
        .write(true)
        .open(chunk_file(&env, &bad.hash))
        .unwrap();
    f.write_all_at(b"X", 1234).unwrap();

    let err = restore_to(&env, &m, "out").await.unwrap_err();
    match &err {
        Error::ChunkCorrupt {
            backup,
            index,
            hash,
            found,
        } => {
            assert_eq!((backup.id, *index, hash), (m.id, 2, &bad.hash));
            assert_ne!(found, hash);
        }
        e => panic!("{e}"),
    }
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "backup 'corrupt-me' ({}): chunk 2 at offset {} (blake3 {}) is corrupt: its bytes hash to ",
            m.id,
            2 * C,
            bad.hash
        )),
        "{msg}"
    );

    let report = verify(&env.target, &m, Arc::new(AllocateJob::default()))
        .await
        .unwrap();
    assert!(!report.ok());
    assert_eq!(report.corrupt, std::slice::from_ref(bad));
    assert!(report.missing.is_empty());
    assert_eq!(report.chunks, 2);
}

#[tokio::test]
async fn a_missing_chunk_fails_the_restore_and_verify_goes_on_past_it() {
    let env = env();
    let src = image(
        &env,
        "src",
        3 * C,
        &[(0, pattern(1, C as usize)), (C, pattern(2, C as usize))],
    );
    let m = take(&env, "lose-one", &src).await;
    std::fs::remove_file(chunk_file(&env, &m.chunks[0].hash)).unwrap();

    let err = restore_to(&env, &m, "out").await.unwrap_err();
    assert!(
        matches!(&err, Error::ChunkMissing { index: 0, hash, .. } if *hash == m.chunks[0].hash),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "backup 'lose-one' ({}): chunk 0 at offset 0 (blake3 {}) is missing from the target",
            m.id, m.chunks[0].hash
        )
    );
    let report = verify(&env.target, &m, Arc::new(AllocateJob::default()))
        .await
        .unwrap();
    assert_eq!(report.missing, [m.chunks[0].clone()]);
    assert_eq!(report.chunks, 2, "every chunk checked");
}

#[tokio::test]
async fn a_cancelled_backup_leaves_no_manifest_and_no_lease() {
    let env = env();
    let size = 4 * C;
    let writes: Vec<(u64, Vec<u8>)> = (0..4)
        .map(|i| (i * C, pattern(i as u8, C as usize)))
        .collect();
    let src = image(&env, "src", size, &writes);
    let job = Arc::new(AllocateJob {
        pace: Duration::from_millis(200),
        ..AllocateJob::default()
    });
    let md = meta("cancelled", size);
    let id = md.id;
    let run = tokio::spawn({
        let (target, job) = (env.target.clone(), Arc::clone(&job));
        let file = File::open(&src).unwrap();
        async move { backup(&target, md, file, job, Arc::new(Counters::default())).await }
    });
    while job.done_bytes.load(Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        env.root.join(format!("leases/{id}.json")).exists(),
        "the lease is there while it runs"
    );
    job.cancel.store(true, Relaxed);
    assert_eq!(run.await.unwrap().unwrap(), None);
    assert!(job.done_bytes.load(Relaxed) < size);
    assert!(files_under(&env.root.join("backups")).is_empty());
    assert!(files_under(&env.root.join("leases")).is_empty());
    assert!(matches!(manifest(&env.target, id).await, Err(Error::BackupNotFound(i)) if i == id));
}

#[tokio::test]
async fn gc_after_a_delete_removes_only_unreferenced_chunks() {
    let env = env();
    let shared = pattern(7, C as usize);
    let a = image(
        &env,
        "a",
        3 * C,
        &[
            (0, shared.clone()),
            (C, pattern(1, C as usize)),
            (2 * C, pattern(2, C as usize)),
        ],
    );
    let b = image(
        &env,
        "b",
        2 * C,
        &[(0, shared.clone()), (C, pattern(3, C as usize))],
    );
    let ma = take(&env, "a", &a).await;
    let mb = take(&env, "b", &b).await;
    assert_eq!(files_under(&env.root.join("chunks")).len(), 4);

    delete(&env.target, ma.id).await.unwrap();
    assert!(matches!(
        manifest(&env.target, ma.id).await,
        Err(Error::BackupNotFound(_))
    ));
    assert!(
        env.root.join(format!("deleted/{}.json", ma.id)).exists(),
        "the tombstone"
    );
    assert!(matches!(
        delete(&env.target, ma.id).await,
        Err(Error::BackupNotFound(_))
    ));
    tick().await;

    let r = gc(&env.target, "svc-1").await.unwrap();
    assert_eq!(
        (
            r.chunks_deleted,
            r.bytes_deleted,
            r.chunks_kept,
            r.running_backups,
            r.tombstones_deleted
        ),
        (2, 2 * C, 2, 0, 1)
    );
    for c in &mb.chunks {
        assert!(chunk_file(&env, &c.hash).exists());
    }
    for c in &ma.chunks[1..] {
        assert!(!chunk_file(&env, &c.hash).exists());
    }
    assert!(files_under(&env.root.join("deleted")).is_empty());
    assert!(
        files_under(&env.root.join("gc")).is_empty(),
        "the clock marker is gone"
    );
    let out = restore_to(&env, &mb, "b-restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&b).unwrap());

    let again = gc(&env.target, "svc-1").await.unwrap();
    assert_eq!((again.chunks_deleted, again.chunks_kept), (0, 2));
}

#[tokio::test]
async fn gc_keeps_what_a_running_backup_may_reference() {
    let env = env();
    let t = &env.target;
    // A deleted backup's chunk, an old orphan, and a live lease.
    let a = image(&env, "a", C, &[(0, pattern(1, C as usize))]);
    let ma = take(&env, "a", &a).await;
    let old = pattern(2, 1000);
    let old_hash = blake3::hash(&old).to_hex().to_string();
    t.put(&t.chunk_path(&old_hash), Bytes::from(old))
        .await
        .unwrap();
    set_mtime(&chunk_file(&env, &old_hash), Duration::from_secs(3600));
    set_mtime(
        &chunk_file(&env, &ma.chunks[0].hash),
        Duration::from_secs(3600),
    );

    let running = Uuid::new_v4();
    let lease = Lease {
        backup: running,
        owner: "svc-2".to_string(),
        started_at: OffsetDateTime::now_utc(),
        started_on_target: None,
    };
    t.put(
        &t.lease_path(running),
        Bytes::from(serde_json::to_vec(&lease).unwrap()),
    )
    .await
    .unwrap();
    // Put by the running backup after its start.
    let new = pattern(3, 1000);
    let new_hash = blake3::hash(&new).to_hex().to_string();
    t.put(&t.chunk_path(&new_hash), Bytes::from(new))
        .await
        .unwrap();
    // A crashed backup's lease.
    let crashed = Uuid::new_v4();
    let stale = Lease {
        backup: crashed,
        owner: "svc-3".to_string(),
        started_at: OffsetDateTime::now_utc() - Duration::from_secs(7200),
        started_on_target: None,
    };
    t.put(
        &t.lease_path(crashed),
        Bytes::from(serde_json::to_vec(&stale).unwrap()),
    )
    .await
    .unwrap();
    set_mtime(
        &env.root.join(format!("leases/{crashed}.json")),
        Duration::from_secs(3600),
    );
    // Deleted while the backup runs: it may have listed the manifest.
    delete(t, ma.id).await.unwrap();
    tick().await;

    let r = gc(t, "svc-1").await.unwrap();
    assert_eq!(r.running_backups, 1);
    assert_eq!(r.leases_deleted, 1);
    assert_eq!((r.chunks_deleted, r.chunks_kept), (1, 2));
    assert!(!chunk_file(&env, &old_hash).exists(), "an old orphan goes");
    assert!(
        chunk_file(&env, &new_hash).exists(),
        "put after the lease's start"
    );
    assert!(
        chunk_file(&env, &ma.chunks[0].hash).exists(),
        "its tombstone is newer than the lease"
    );
    assert_eq!(r.tombstones_deleted, 0);
    assert!(env.root.join(format!("leases/{running}.json")).exists());
    assert!(!env.root.join(format!("leases/{crashed}.json")).exists());

    // The backup ends without referencing them: all goes.
    assert_eq!(
        release_leases(t, "svc-2", OffsetDateTime::now_utc())
            .await
            .unwrap(),
        1
    );
    tick().await;
    let r = gc(t, "svc-1").await.unwrap();
    assert_eq!(
        (
            r.chunks_deleted,
            r.chunks_kept,
            r.running_backups,
            r.tombstones_deleted
        ),
        (2, 0, 0, 1)
    );
}

#[tokio::test]
async fn gc_spares_a_chunk_written_again_after_it_was_listed() {
    let env = env();
    let t = &env.target;
    let data = pattern(5, 1000);
    let hash = blake3::hash(&data).to_hex().to_string();
    t.put(&t.chunk_path(&hash), Bytes::from(data.clone()))
        .await
        .unwrap();
    let listed = t.list("chunks").await.unwrap().pop().unwrap();
    // gc's start: after the listing, as in a gc.
    let began = listed.last_modified + Duration::from_nanos(1);
    // Within the same second: a directory's entity tag tells it apart.
    t.put(&t.chunk_path(&hash), Bytes::from(data))
        .await
        .unwrap();
    assert_eq!(
        crate::gc::delete_chunk(t, &listed, began).await.unwrap(),
        None
    );
    assert!(chunk_file(&env, &hash).exists());
}

#[tokio::test]
async fn a_tampered_manifest_is_detected() {
    let env = env();
    let src = image(&env, "src", C, &[(0, pattern(1, C as usize))]);
    let m = take(&env, "honest", &src).await;
    let path = env.root.join(format!("backups/{}.json", m.id));
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"honest\"", "\"forged\"")).unwrap();
    let err = manifest(&env.target, m.id).await.unwrap_err();
    assert!(
        matches!(&err, Error::ManifestCorrupt { id, .. } if *id == m.id),
        "{err}"
    );
    assert!(err.to_string().contains("checksum"), "{err}");
    assert!(
        list(&env.target).await.unwrap().is_empty(),
        "left out of the list"
    );
    assert_eq!(list_all(&env.target).await.unwrap().len(), 1);

    // A format from the future.
    let mut future = m.clone();
    future.format = 2;
    future.seal();
    std::fs::write(&path, future.to_bytes()).unwrap();
    let err = manifest(&env.target, m.id).await.unwrap_err();
    assert!(err.to_string().contains("format 2"), "{err}");

    // gc keeps the chunks of a manifest that fails its checks.
    tick().await;
    assert_eq!(gc(&env.target, "svc-1").await.unwrap().chunks_kept, 1);
}

#[tokio::test]
async fn a_backup_id_is_never_reused_and_a_restore_never_overwrites() {
    let env = env();
    let src = image(&env, "src", C, &[(0, pattern(1, C as usize))]);
    let m = take(&env, "once", &src).await;
    let mut again = meta("twice", C);
    again.id = m.id;
    let err = backup(
        &env.target,
        again,
        File::open(&src).unwrap(),
        Arc::new(AllocateJob::default()),
        Arc::new(Counters::default()),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, Error::BackupExists(id) if id == m.id),
        "{err}"
    );

    let full = env.images.join("full");
    std::fs::write(&full, b"data").unwrap();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&full)
        .unwrap();
    let err = restore(&env.target, &m, f, Arc::new(AllocateJob::default()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Image { .. }), "{err}");
    assert_eq!(std::fs::read(&full).unwrap(), b"data");
}

#[tokio::test]
async fn a_cancelled_restore_and_verify_stop() {
    let env = env();
    let src = image(
        &env,
        "src",
        2 * C,
        &[(0, pattern(1, C as usize)), (C, pattern(2, C as usize))],
    );
    let m = take(&env, "m", &src).await;
    let job = Arc::new(AllocateJob::default());
    job.cancel.store(true, Relaxed);
    let f = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(env.images.join("out"))
        .unwrap();
    assert!(!restore(&env.target, &m, f, Arc::clone(&job)).await.unwrap());
    let report = verify(&env.target, &m, job).await.unwrap();
    assert!(report.cancelled && !report.ok());
}

#[tokio::test]
async fn check_reports_a_vanished_directory() {
    let env = env();
    env.target.check().await.unwrap();
    std::fs::remove_dir_all(&env.root).unwrap();
    let err = env.target.check().await.unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("is unreachable"), "{err}");
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn creds_env(name: &str) -> Option<String> {
    match name {
        "AWS_ACCESS_KEY_ID" => Some("AKIDEXAMPLE".to_string()),
        "AWS_SECRET_ACCESS_KEY" => Some("very-secret".to_string()),
        _ => None,
    }
}

#[test]
fn directory_specs_parse() {
    assert_eq!(
        parse_with_env("/srv/backups", None, no_env).unwrap(),
        TargetConfig::Dir {
            path: "/srv/backups".into()
        }
    );
    let cfg = parse_with_env("file:///srv/my%20backups", None, no_env).unwrap();
    assert_eq!(
        cfg,
        TargetConfig::Dir {
            path: "/srv/my backups".into()
        }
    );
    assert_eq!(cfg.describe(), "dir:/srv/my backups");
    for bad in [
        "relative/dir",
        "file://host/srv",
        "/srv/../etc",
        "ftp://x",
        "",
    ] {
        let err = parse_with_env(bad, None, no_env).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{bad}: {err}");
    }
    let err = Target::open(
        &TargetConfig::Dir {
            path: "/nonexistent/backup/dir".into(),
        },
        DEFAULT_TIMEOUT,
    )
    .unwrap_err();
    assert!(err.to_string().contains("must exist"), "{err}");
}

#[test]
fn s3_specs_parse_and_never_show_the_secret() {
    let cfg = parse_with_env(
        "s3://my-bucket/team/backups/?endpoint=http://127.0.0.1:9000&region=eu-west-1",
        None,
        creds_env,
    )
    .unwrap();
    let TargetConfig::S3 {
        bucket,
        prefix,
        endpoint,
        region,
        credentials,
    } = &cfg
    else {
        panic!("{cfg:?}")
    };
    assert_eq!(
        (
            bucket.as_str(),
            prefix.as_str(),
            endpoint.as_deref(),
            region.as_str()
        ),
        (
            "my-bucket",
            "team/backups",
            Some("http://127.0.0.1:9000"),
            "eu-west-1"
        )
    );
    assert_eq!(credentials.access_key_id, "AKIDEXAMPLE");
    assert_eq!(
        cfg.describe(),
        "s3://my-bucket/team/backups (endpoint http://127.0.0.1:9000, region eu-west-1)"
    );
    assert!(!format!("{cfg:?}").contains("very-secret"));
    let target = Target::open(&cfg, DEFAULT_TIMEOUT).unwrap();
    assert!(!format!("{target:?}").contains("very-secret"));
    assert_eq!(target.describe(), cfg.describe());

    let plain = parse_with_env("s3://bucket", None, creds_env).unwrap();
    assert_eq!(plain.describe(), "s3://bucket (region us-east-1)");
    assert!(matches!(&plain, TargetConfig::S3 { prefix, endpoint: None, .. } if prefix.is_empty()));

    for bad in [
        "s3://",
        "s3://B",
        "s3://bucket?endpoint=ftp://x",
        "s3://bucket?endpoint=http://user:pw@host",
        "s3://bucket?colour=blue",
        "s3://bucket/a//b",
    ] {
        let err = parse_with_env(bad, None, creds_env).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{bad}: {err}");
        assert!(!err.to_string().contains("pw"), "{err}");
    }
}

#[test]
fn s3_credentials_come_from_a_private_file_or_the_environment() {
    let err = parse_with_env("s3://bucket", None, no_env).unwrap_err();
    assert!(
        err.to_string()
            .contains("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        "{err}"
    );
    let err = parse_with_env("s3://bucket", None, |n| {
        (n == "AWS_ACCESS_KEY_ID").then(|| "id".to_string())
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("set AWS_SECRET_ACCESS_KEY"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("creds");
    std::fs::write(
        &file,
        "# backups\naccess_key_id = AKIDFILE\nsecret_access_key = s3cr#3t\nsession_token = tok\n",
    )
    .unwrap();
    for mode in [0o644, 0o640] {
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        let err = parse_with_env("s3://bucket", Some(&file), creds_env).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("open to other users (mode {mode:04o})")),
            "{err}"
        );
        assert!(err.to_string().contains("chmod 600"), "{err}");
    }

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cfg = parse_with_env("s3://bucket", Some(&file), creds_env).unwrap();
    let TargetConfig::S3 { credentials, .. } = &cfg else {
        panic!()
    };
    assert_eq!(
        credentials,
        &Credentials {
            access_key_id: "AKIDFILE".to_string(),
            secret_access_key: "s3cr#3t".to_string(),
            session_token: Some("tok".to_string()),
        }
    );
    let shown = format!("{credentials:?}");
    assert!(
        !shown.contains("s3cr#3t") && !shown.contains("tok\"") && shown.contains("AKIDFILE"),
        "{shown}"
    );

    std::fs::write(&file, "access_key_id = A\nsecret = leaked-value\n").unwrap();
    let err = parse_with_env("s3://bucket", Some(&file), creds_env).unwrap_err();
    assert!(
        err.to_string().contains("line 2") && !err.to_string().contains("leaked-value"),
        "{err}"
    );
    std::fs::write(&file, "access_key_id = A\n").unwrap();
    let err = parse_with_env("s3://bucket", Some(&file), creds_env).unwrap_err();
    assert!(err.to_string().contains("lacks secret_access_key"), "{err}");
}

/// Against the test S3 server (moto, signatures checked): backup, dedup,
/// restore, verify and gc.
#[tokio::test]
async fn s3_backup_restore_verify_gc() {
    let env = s3_env();
    env.target.check().await.unwrap();

    let shared = pattern(7, C as usize);
    let a = image(
        &env,
        "a",
        3 * C + 10,
        &[(0, shared.clone()), (2 * C, pattern(2, C as usize + 10))],
    );
    let b = image(
        &env,
        "b",
        2 * C,
        &[(0, shared.clone()), (C, pattern(3, C as usize))],
    );
    let ma = take(&env, "a", &a).await;
    let mb = take(&env, "b", &b).await;
    assert_eq!((mb.uploaded_bytes, mb.deduplicated_bytes), (C, C));
    assert_eq!(list(&env.target).await.unwrap().len(), 2);
    let out = restore_to(&env, &ma, "a-restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&a).unwrap());
    assert!(
        verify(&env.target, &mb, Arc::new(AllocateJob::default()))
            .await
            .unwrap()
            .ok()
    );

    delete(&env.target, ma.id).await.unwrap();
    // S3 times are in whole seconds: a tombstone of gc's own second still
    // protects its chunks, so a later gc collects them.
    let r = gc_until(&env.target, |r| r.tombstones_deleted == 1).await;
    assert_eq!((r.chunks_deleted, r.chunks_kept), (2, 2), "{r:?}");
    let out = restore_to(&env, &mb, "b-restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&b).unwrap());

    delete(&env.target, mb.id).await.unwrap();
    let r = gc_until(&env.target, |r| r.tombstones_deleted == 1).await;
    assert_eq!((r.chunks_deleted, r.chunks_kept), (2, 0), "{r:?}");
}

/// Every operation's future can be spawned: the server runs them as tasks.
#[tokio::test]
async fn every_operation_can_be_spawned() {
    let env = env();
    let src = image(&env, "src", C, &[(0, pattern(1, C as usize))]);
    let t = env.target.clone();
    let (md, file) = (meta("spawned", C), File::open(&src).unwrap());
    let job = Arc::new(AllocateJob::default());
    let m = tokio::spawn({
        let (t, job) = (t.clone(), Arc::clone(&job));
        async move { backup(&t, md, file, job, Arc::new(Counters::default())).await }
    })
    .await
    .unwrap()
    .unwrap()
    .unwrap();
    let id = m.id;
    let all = tokio::spawn({
        let t = t.clone();
        async move { (list(&t).await, list_all(&t).await, manifest(&t, id).await) }
    })
    .await
    .unwrap();
    assert_eq!(all.0.unwrap().len(), 1);
    let out = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(env.images.join("out"))
        .unwrap();
    let (m2, job2) = (m.clone(), Arc::clone(&job));
    let t2 = t.clone();
    tokio::spawn(async move { restore(&t2, &m2, out, job2).await })
        .await
        .unwrap()
        .unwrap();
    let (m2, job2) = (m.clone(), Arc::clone(&job));
    let t2 = t.clone();
    tokio::spawn(async move { verify(&t2, &m2, job2).await })
        .await
        .unwrap()
        .unwrap();
    let t2 = t.clone();
    tokio::spawn(async move { delete(&t2, id).await })
        .await
        .unwrap()
        .unwrap();
    let t2 = t.clone();
    tokio::spawn(async move { gc(&t2, "svc-1").await })
        .await
        .unwrap()
        .unwrap();
    let t2 = t.clone();
    tokio::spawn(async move { release_leases(&t2, "svc-1", OffsetDateTime::now_utc()).await })
        .await
        .unwrap()
        .unwrap();
    let t2 = t.clone();
    tokio::spawn(async move { t2.check().await })
        .await
        .unwrap()
        .unwrap();
}
