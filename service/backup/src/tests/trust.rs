//! The faults that once made a finished backup silently unrestorable, each
//! on a directory target and on S3 (moto, signatures checked): a chunk the
//! target lost, a backing-up host whose clock runs ahead, a chunk put again
//! within gc's second, two gcs at once.

use super::*;
use std::os::unix::fs::OpenOptionsExt;

use crate::gc::{Pause, collect};

/// Waits, polling, until `cond` holds (a condition, never a time).
async fn until(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    for _ in 0..2000 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

/// Verifies `m` and says what it found wrong.
async fn assert_whole(env: &Env, m: &Manifest, what: &str) {
    let r = verify(&env.target, m, Arc::new(AllocateJob::default()))
        .await
        .unwrap();
    let hashes = |cs: &[ChunkRef]| cs.iter().map(|c| c.index).collect::<Vec<_>>();
    assert!(
        r.ok(),
        "{what}: backup '{}' is done but not whole: chunks missing at {:?}, corrupt at {:?}",
        m.name,
        hashes(&r.missing),
        hashes(&r.corrupt)
    );
}

/// An image of `n` chunks, each of other bytes than every other test's.
fn distinct_image(env: &Env, name: &str, seed: u8, n: u64) -> PathBuf {
    let writes: Vec<(u64, Vec<u8>)> = (0..n)
        .map(|i| (i * C, pattern(seed.wrapping_add(i as u8), C as usize)))
        .collect();
    image(env, name, n * C, &writes)
}

/// A backup of `src` running in a task, held after each chunk while its
/// gate file exists: the task, its job and the gate.
fn gated_backup(
    env: &Env,
    name: &str,
    src: &Path,
    size: u64,
) -> (
    tokio::task::JoinHandle<Result<Option<Manifest>>>,
    Arc<AllocateJob>,
    PathBuf,
    Uuid,
) {
    let gate = env.images.join(format!("gate-{name}"));
    std::fs::write(&gate, b"").unwrap();
    let job = Arc::new(AllocateJob {
        gate: Some(gate.clone()),
        ..AllocateJob::default()
    });
    let md = meta(name, size);
    let id = md.id;
    let run = tokio::spawn({
        let (t, job) = (env.target.clone(), Arc::clone(&job));
        let file = File::open(src).unwrap();
        async move { backup(&t, md, file, job, Arc::new(Counters::default())).await }
    });
    (run, job, gate, id)
}

/// A gc of service `svc-b` running in a task, held (once it has read the
/// manifests) until the sender is used: the task and the sender.
async fn held_gc(
    t: &Target,
) -> (
    tokio::task::JoinHandle<Result<GcReport>>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (reached, at) = tokio::sync::oneshot::channel();
    let (go, resume) = tokio::sync::oneshot::channel();
    let collecting = tokio::spawn({
        let t = t.clone();
        async move { collect(&t, "svc-b", Some(Pause { reached, resume })).await }
    });
    at.await.unwrap();
    (collecting, go)
}

/// Item 1: a chunk that earlier backups name but the target lost (deleted
/// by hand, or overwritten with other bytes of the same length) is stored
/// again by the next backup of the same bytes, never taken on trust; and
/// that heals the earlier backups too.
async fn lost_chunks_are_stored_again(env: &Env) {
    let t = &env.target;
    let src = distinct_image(env, "src", 40, 4);
    let first = take(env, "first", &src).await;
    let (lost, overwritten) = (&first.chunks[1], &first.chunks[2]);
    t.delete(&t.chunk_path(&lost.hash)).await.unwrap();
    t.put(
        &t.chunk_path(&overwritten.hash),
        Bytes::from(pattern(99, C as usize)),
    )
    .await
    .unwrap();

    let second = take(env, "second", &src).await;
    assert_whole(env, &second, "a backup over a lost chunk").await;
    assert_eq!(
        (second.uploaded_bytes, second.deduplicated_bytes),
        (2 * C, 2 * C),
        "the lost and the overwritten chunk put again, the two intact ones reused"
    );
    assert_whole(env, &first, "the earlier backup, healed by the later one").await;
    let out = restore_to(env, &second, "restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&src).unwrap());
}

#[tokio::test]
async fn a_backup_stores_again_a_chunk_the_directory_target_lost() {
    lost_chunks_are_stored_again(&env()).await;
}

#[tokio::test]
async fn a_backup_stores_again_a_chunk_the_s3_target_lost() {
    lost_chunks_are_stored_again(&s3_env()).await;
}

/// Item 2: a backup whose host's clock runs hours ahead of the target's,
/// with a gc running through it: gc keeps every chunk the backup put.
/// The lease is written as such a host writes it (its `started_at` from
/// the host's clock), between the backup's first chunk and its manifest.
async fn a_fast_clock_does_not_expose_a_running_backup(env: &Env) {
    let t = &env.target;
    let src = distinct_image(env, "src", 60, 3);
    let (run, job, gate, id) = gated_backup(env, "ahead", &src, 3 * C);
    until("the backup's first chunk stored", async || {
        job.done_bytes.load(Relaxed) >= C
    })
    .await;
    let path = t.lease_path(id);
    let mut lease: serde_json::Value =
        serde_json::from_slice(&t.get(&path).await.unwrap().unwrap()).unwrap();
    let ahead = OffsetDateTime::now_utc() + Duration::from_secs(3 * 3600);
    lease["started_at"] = serde_json::to_value(
        ahead
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap(),
    )
    .unwrap();
    t.put(&path, Bytes::from(serde_json::to_vec(&lease).unwrap()))
        .await
        .unwrap();

    let r = gc(t, "svc-1").await.unwrap();
    assert_eq!(r.running_backups, 1, "{r:?}");
    std::fs::remove_file(&gate).unwrap();
    let m = run.await.unwrap().unwrap().expect("not cancelled");
    assert_whole(env, &m, "a backup from a host 3 h ahead, gc run meanwhile").await;
}

#[tokio::test]
async fn gc_keeps_a_running_backups_chunks_whatever_its_hosts_clock_on_a_directory() {
    a_fast_clock_does_not_expose_a_running_backup(&env()).await;
}

#[tokio::test]
async fn gc_keeps_a_running_backups_chunks_whatever_its_hosts_clock_on_s3() {
    a_fast_clock_does_not_expose_a_running_backup(&s3_env()).await;
}

/// Item 3: gc listed an orphan chunk; before gc deletes it, a backup puts
/// the same bytes again (within the same second, so S3's HEAD shows the
/// same time and the same MD5 entity tag) and writes a manifest naming it.
/// The chunk must stay.
async fn a_chunk_put_again_during_gc_stays(env: &Env) {
    let t = &env.target;
    let bytes = pattern(80, C as usize);
    let hash = blake3::hash(&bytes).to_hex().to_string();
    // An orphan of the same bytes, as a cancelled backup leaves one. Put
    // early in a second of the target's clock, so that on S3 the gc and
    // the backup below run within that second (this only makes the fault
    // reproducible; the test holds wherever the second falls).
    let orphan = t.chunk_path(&hash);
    until("the start of a second on the target's clock", async || {
        t.put(&orphan, Bytes::from(bytes.clone())).await.unwrap();
        let m = t.list("chunks").await.unwrap().pop().unwrap();
        m.last_modified.millisecond() < 200
    })
    .await;
    let src = image(env, "src", C, &[(0, bytes.clone())]);
    let (collecting, go) = held_gc(t).await;
    let m = take(env, "again", &src).await;
    go.send(()).unwrap();
    collecting.await.unwrap().unwrap();
    assert_whole(env, &m, "a backup that put a chunk again while gc ran").await;
}

#[tokio::test]
async fn gc_spares_a_chunk_put_again_while_it_runs_on_a_directory() {
    a_chunk_put_again_during_gc_stays(&env()).await;
}

#[tokio::test]
async fn gc_spares_a_chunk_put_again_within_its_second_on_s3() {
    a_chunk_put_again_during_gc_stays(&s3_env()).await;
}

/// Item 5: two gcs at once. Backup X reuses chunk c of backup M; M is
/// deleted (its tombstone keeps c for X); gc B lists while X runs and is
/// held before it reads the tombstones; X finishes; a second gc, A, runs
/// through. Unlocked, A deletes the tombstone (no backup runs by then) and
/// B, not finding it, deletes c, which X's manifest names. With one gc per
/// target, A is refused while B runs, and every backup left restores.
async fn two_gcs_at_once(env: &Env) {
    let t = &env.target;
    let shared = pattern(120, C as usize);
    let a = image(env, "a", C, &[(0, shared.clone())]);
    let m = take(env, "m", &a).await;
    if env.s3.is_none() {
        // An old chunk, as most are (S3's times cannot be set).
        set_mtime(
            &chunk_file(env, &m.chunks[0].hash),
            Duration::from_secs(3600),
        );
    }

    let x_src = image(
        env,
        "x",
        2 * C,
        &[(0, shared.clone()), (C, pattern(121, C as usize))],
    );
    let (x, job, gate, _) = gated_backup(env, "x", &x_src, 2 * C);
    until("X to have taken its first chunk", async || {
        job.done_bytes.load(Relaxed) >= C
    })
    .await;
    delete(t, m.id).await.unwrap();

    let (b, go) = held_gc(t).await;
    std::fs::remove_file(&gate).unwrap();
    let mx = x.await.unwrap().unwrap().expect("not cancelled");

    let other = gc(t, "svc-1").await;
    go.send(()).unwrap();
    let rb = b.await.unwrap().unwrap();
    match other {
        Err(Error::GcBusy {
            ref target,
            ref holder,
        }) => {
            assert_eq!(target, t.describe());
            assert!(holder.contains("service svc-b"), "{holder}");
            let msg = other.unwrap_err().to_string();
            assert!(msg.contains("another gc"), "{msg}");
        }
        Ok(r) => {
            // Either way, every backup left must restore.
            assert_whole(
                env,
                &mx,
                &format!("X, after two gcs at once ({r:?}, {rb:?})"),
            )
            .await;
            panic!("a second gc ran beside the first: {r:?}");
        }
        Err(e) => panic!("{e}"),
    }
    assert_whole(env, &mx, "X, after a gc held and a second refused").await;
    let out = restore_to(env, &mx, "x-restored").await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&x_src).unwrap());
    // With the first done, the next gc runs.
    gc(t, "svc-1").await.unwrap();
    assert_whole(env, &mx, "X, after the next gc").await;
}

#[tokio::test]
async fn one_gc_at_a_time_on_a_directory_and_every_backup_left_restores() {
    two_gcs_at_once(&env()).await;
}

#[tokio::test]
async fn one_gc_at_a_time_on_s3_and_every_backup_left_restores() {
    two_gcs_at_once(&s3_env()).await;
}

/// Item 4: S3 as users run it, and targets that misbehave.
///
/// A wrong secret is refused by the server (signatures are checked), with
/// an error that names the target; nothing is written.
#[tokio::test]
async fn an_s3_target_refuses_a_wrong_secret_naming_the_target() {
    let env = s3_env();
    let s3 = env.s3.as_ref().unwrap();
    let prefix = format!("wrong-{}", Uuid::new_v4());
    let wrong = Target::open(
        &s3.target_config(&prefix, "not-the-secret"),
        DEFAULT_TIMEOUT,
    )
    .unwrap();
    let err = wrong.check().await.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Unreachable { .. })
            && msg.contains(wrong.describe())
            && msg.contains("SignatureDoesNotMatch"),
        "{msg}"
    );
    let src = distinct_image(&env, "src", 140, 1);
    let err = backup(
        &wrong,
        meta("wrong", C),
        File::open(&src).unwrap(),
        Arc::new(AllocateJob::default()),
        Arc::new(Counters::default()),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    // A HEAD's answer has no body to name the reason: its status says it.
    assert!(
        msg.contains(wrong.describe()) && msg.contains("403 Forbidden"),
        "{msg}"
    );
    // The same prefix, with the right secret: nothing is there.
    let right = Target::open(
        &s3.target_config(&prefix, &s3.secret_access_key),
        DEFAULT_TIMEOUT,
    )
    .unwrap();
    for folder in ["chunks", "leases", "backups"] {
        assert!(
            right.list(folder).await.unwrap().is_empty(),
            "{folder}/ written"
        );
    }
}

/// 503 SlowDown is tried again with backoff, and the backup is whole.
#[tokio::test]
async fn s3_slowdown_is_tried_again_with_backoff() {
    let env = s3_env();
    let s3 = env.s3.as_ref().unwrap();
    let src = distinct_image(&env, "src", 150, 2);
    s3.fault("slowdown?count=4");
    let m = take(&env, "slowed", &src).await;
    assert_eq!(s3.fault("stats")["slowdowns"], 4);
    assert_whole(&env, &m, "a backup through four 503 SlowDown answers").await;
}

/// An S3 endpoint that takes connections and never answers fails the
/// backup after the timeout, naming the target; no manifest.
#[tokio::test]
async fn an_s3_target_that_stops_answering_fails_the_backup_naming_it() {
    let env = s3_env_with(Duration::from_secs(2));
    let s3 = env.s3.as_ref().unwrap();
    let src = distinct_image(&env, "src", 160, 2);
    s3.fault("hang");
    let err = backup(
        &env.target,
        meta("hung", 2 * C),
        File::open(&src).unwrap(),
        Arc::new(AllocateJob::default()),
        Arc::new(Counters::default()),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Hung { .. } | Error::Target { .. })
            && msg.contains(env.target.describe()),
        "{msg}"
    );
    assert!(s3.fault("stats")["hung"].as_u64().unwrap() >= 1);
    s3.fault("clear");
    assert!(list_all(&env.target).await.unwrap().is_empty());
}

/// A directory whose read never returns (here a FIFO where a manifest
/// was: `open` blocks in the kernel as on a hung mount) fails after the
/// timeout, naming the target and the object; the blocked thread stays
/// until the file answers.
#[tokio::test]
async fn a_directory_read_that_never_returns_fails_after_the_timeout() {
    let env = env();
    let src = distinct_image(&env, "src", 170, 1);
    let m = take(&env, "m", &src).await;
    let path = env.root.join(format!("backups/{}.json", m.id));
    std::fs::remove_file(&path).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let cfg = TargetConfig::parse(env.root.to_str().unwrap(), None).unwrap();
    let target = Target::open(&cfg, Duration::from_secs(1)).unwrap();
    let err = verify_by_id(&target, m.id).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Hung { .. })
            && msg.contains(target.describe())
            && msg.contains(&format!("backups/{}.json", m.id)),
        "{msg}"
    );
    // The blocked thread's open returns once a writer comes.
    drop(
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(&path)
            .unwrap(),
    );
}

async fn verify_by_id(target: &Target, id: Uuid) -> Result<VerifyReport> {
    let m = manifest(target, id).await?;
    verify(target, &m, Arc::new(AllocateJob::default())).await
}
