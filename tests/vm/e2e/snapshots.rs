//! Snapshots and clones of images that an attached ublk or dm volume is
//! writing: the worker holds the queues around the reflink, so a snapshot
//! holds every write that completed before the request and nothing torn; a
//! `direct` volume moves to `nowait` first, so no write goes through a map of
//! extents the snapshot now shares; a filesystem on a snapshot mounts after
//! log replay; on a filesystem that cannot share extents the worker copies
//! one moment, each chunk a write reaches copied before the write.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::{Scratch, Vm, fio_ok, fio_verify, sh, writes_flow};

pub(crate) const BLOCK: usize = 4096;
/// The sequence writer's blocks start with this.
const MAGIC: &[u8; 8] = b"BPSEQ-01";
/// The sequence writer keeps to the lower half of a 1 GiB device, fio to
/// `[FIO_AT, FIO_AT + FIO_SPAN)`.
pub(crate) const HALF: u64 = 512 << 20;
pub(crate) const FIO_AT: u64 = HALF;
pub(crate) const FIO_SPAN: u64 = 256 << 20;
/// A MiB the copy-before-write test writes before its request and discards
/// during the copy: past the sequence writer, below fio.
const MARK_AT: u64 = 256 << 20;

/// Block `i` of the sequence writer: magic, `i`, then words derived from `i`,
/// so a block that is neither all of it nor zeros is torn.
pub(crate) fn fill_block(buf: &mut [u8], i: u64) {
    buf[..8].copy_from_slice(MAGIC);
    buf[8..16].copy_from_slice(&i.to_le_bytes());
    for (k, w) in buf[16..].chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ k as u64).to_le_bytes());
    }
}

/// What a block of a snapshot holds.
#[derive(Debug, PartialEq)]
pub(crate) enum Held {
    /// Exactly the writer's block `i`.
    Written,
    /// Zeros: never written when the snapshot was taken.
    Zeros,
    /// Anything else.
    Torn,
}

pub(crate) fn classify(buf: &[u8], i: u64) -> Held {
    let mut want = vec![0u8; BLOCK];
    fill_block(&mut want, i);
    if buf == want.as_slice() {
        Held::Written
    } else if buf.iter().all(|&b| b == 0) {
        Held::Zeros
    } else {
        Held::Torn
    }
}

/// A writer thread that counts what it completed; stopped when dropped, so
/// a failed test stops it too.
pub(crate) struct Writer<T> {
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<T>>,
    what: &'static str,
}

impl<T> Drop for Writer<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl<T: Send + 'static> Writer<T> {
    /// Runs `body(done, stop)` on a thread of its own: it counts into `done`
    /// and returns once `stop` is set.
    fn spawn(
        what: &'static str,
        body: impl FnOnce(&AtomicU64, &AtomicBool) -> T + Send + 'static,
    ) -> Self {
        let (done, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (d, s) = (done.clone(), stop.clone());
        let thread = std::thread::spawn(move || body(&d, &s));
        Self {
            done,
            stop,
            thread: Some(thread),
            what,
        }
    }

    /// Writes completed so far.
    pub(crate) fn completed(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    pub(crate) fn running(&self) -> bool {
        !self.thread.as_ref().unwrap().is_finished()
    }

    /// Waits until at least `n` writes completed.
    pub(crate) async fn wait_for(&self, n: u64) {
        let started = Instant::now();
        while self.completed() < n {
            assert!(
                self.running(),
                "the {} stopped at {}",
                self.what,
                self.completed()
            );
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the {} did {} of {n} writes in 60 s",
                self.what,
                self.completed()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops the writer; what it returned.
    pub(crate) fn finish(mut self) -> T {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take().unwrap();
        thread
            .join()
            .unwrap_or_else(|_| panic!("the {} panicked", self.what))
    }
}

/// Writes block `i` with sequence number `i`, i = 0, 1, 2, ..., one
/// `O_DIRECT` pwrite at a time, recording when each started and ended
/// (block `completed() - 1` is the last done).
pub(crate) fn seq_writer(dev: &str) -> Writer<Vec<(Instant, Instant)>> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap_or_else(|e| panic!("open {dev} O_DIRECT: {e}"));
    Writer::spawn("sequence writer", move |d, s| {
        // O_DIRECT wants an aligned buffer.
        let mut raw = vec![0u8; 2 * BLOCK];
        let at = raw.as_ptr().align_offset(BLOCK);
        let buf = &mut raw[at..at + BLOCK];
        let mut times = Vec::new();
        let mut i = 0u64;
        while !s.load(Ordering::Relaxed) && i < HALF / BLOCK as u64 {
            fill_block(buf, i);
            let t0 = Instant::now();
            let n = f
                .write_at(buf, i * BLOCK as u64)
                .unwrap_or_else(|e| panic!("sequence write {i}: {e}"));
            assert_eq!(n, BLOCK, "short sequence write {i}");
            times.push((t0, Instant::now()));
            i += 1;
            d.store(i, Ordering::Release);
        }
        times
    })
}

/// Writes under which a moment is taken: fio `--verify` over `span` bytes
/// of the upper half (from [`FIO_AT`]), paced so it surely still writes
/// during the request (16 MiB at most 300 writes/s: 13 s or more), and the
/// sequence writer in the lower half, 64 writes done and writes reaching
/// the device when this returns.
pub(crate) async fn writes_under(
    dev: &str,
    span: u64,
) -> (std::process::Child, Writer<Vec<(Instant, Instant)>>) {
    let fio = fio_verify(
        dev,
        &format!("{}M", span >> 20),
        &[
            &format!("--offset={}M", FIO_AT >> 20),
            "--io_size=16M",
            "--rate_iops=,300",
        ],
    );
    let writer = seq_writer(dev);
    writer.wait_for(64).await;
    writes_flow(dev, 1 << 20).await;
    (fio, writer)
}

/// `len` bytes of `path` from `at`, read with `O_DIRECT`: from the disk,
/// not from pages cached by an earlier read (a write through a stale map
/// changes the disk under them).
pub(crate) fn read_range(path: &str, at: u64, len: u64) -> Vec<u8> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {path} O_DIRECT: {e}"));
    let mut raw = vec![0u8; len as usize + BLOCK];
    let off = raw.as_ptr().align_offset(BLOCK);
    f.read_exact_at(&mut raw[off..off + len as usize], at)
        .unwrap_or_else(|e| panic!("read {path} at {at}: {e}"));
    raw.drain(..off);
    raw.truncate(len as usize);
    raw
}

/// Writes `data` (whole blocks) at `at` of `path` with `O_DIRECT`, then
/// fsyncs.
pub(crate) fn write_range(path: &str, at: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {path} O_DIRECT: {e}"));
    let mut raw = vec![0u8; data.len() + BLOCK];
    let off = raw.as_ptr().align_offset(BLOCK);
    raw[off..off + data.len()].copy_from_slice(data);
    f.write_all_at(&raw[off..off + data.len()], at)
        .unwrap_or_else(|e| panic!("write {path} at {at}: {e}"));
    f.sync_all().unwrap();
}

/// Checks the snapshot file against the writer's `times`: every block up
/// to `last` (the last write completed before the request) holds its
/// sequence number; a block whose write started after the request was
/// answered (`answered`) holds zeros (the snapshot existed by then: a write
/// through a map of its shared extents would show here); the others hold
/// theirs or zeros; none is torn. Returns how many of the others made it in.
pub(crate) fn check_sequence(
    path: &str,
    last: u64,
    times: &[(Instant, Instant)],
    answered: Instant,
) -> u64 {
    let data = read_range(path, 0, times.len() as u64 * BLOCK as u64);
    let mut later = 0;
    for ((i, b), &(started, _)) in (0u64..).zip(data.chunks_exact(BLOCK)).zip(times) {
        let held = classify(b, i);
        let want: &[Held] = if i <= last {
            &[Held::Written]
        } else if started > answered {
            &[Held::Zeros]
        } else {
            &[Held::Written, Held::Zeros]
        };
        assert!(
            want.contains(&held),
            "{path}: block {i} (last write completed before the request: {last}; written {:?} after the answer) is {held:?}, not {want:?}: {:02x?}",
            started.checked_duration_since(answered),
            &b[..16]
        );
        later += u64::from(i > last && held == Held::Written);
    }
    later
}

/// The longest write among those in flight during `[t0, t1]`, and among
/// the others.
pub(crate) fn longest_writes(
    times: &[(Instant, Instant)],
    t0: Instant,
    t1: Instant,
) -> (Duration, Duration) {
    let (mut during, mut outside) = (Duration::ZERO, Duration::ZERO);
    for &(a, b) in times {
        let took = b - a;
        if a <= t1 && b >= t0 {
            during = during.max(took);
        } else {
            outside = outside.max(took);
        }
    }
    (during, outside)
}

/// The mean write among those that began during `[t0, t1]`, and among the
/// others.
pub(crate) fn mean_writes(
    times: &[(Instant, Instant)],
    t0: Instant,
    t1: Instant,
) -> (Duration, Duration) {
    let mean = |inside: bool| {
        let took: Vec<Duration> = times
            .iter()
            .filter(|(a, _)| (t0..=t1).contains(a) == inside)
            .map(|&(a, b)| b - a)
            .collect();
        took.iter().sum::<Duration>() / took.len().max(1) as u32
    };
    (mean(true), mean(false))
}

/// The µs the worker held the volume's I/O, from the message of the event
/// `kind` of the new image or its source (`... held its I/O for N µs`).
pub(crate) async fn held_us(vm: &Vm, made: &Value, source: &Value, kind: &str) -> u64 {
    let events = vm.s.get("/v1/events?limit=1000").await.body;
    let e = events
        .as_array()
        .unwrap()
        .iter()
        .find(|e| {
            e["kind"] == kind && (e["image_id"] == made["id"] || e["image_id"] == source["id"])
        })
        .unwrap_or_else(|| panic!("no {kind} event of image {}: {events}", made["id"]));
    let msg = e["message"].as_str().unwrap();
    let digits: String = msg
        .split("held its I/O for ")
        .nth(1)
        .unwrap_or_else(|| panic!("the {kind} event does not say how long the I/O was held: {msg}"))
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    assert!(
        msg.ends_with(" µs") && !digits.is_empty(),
        "the {kind} event's pause is not `N µs`: {msg}"
    );
    digits.parse().unwrap()
}

/// `POST /v1/images/{source}/snapshots`; panics unless a ready reflinked
/// read-only snapshot of `source` (201).
async fn snapshot_of(vm: &Vm, source: &Value, name: &str) -> Value {
    let snap = snapshot_made(vm, source, name, 201).await;
    assert_eq!(snap["method"], "reflink", "{snap}");
    assert_eq!(snap["state"], "ready", "{snap}");
    snap
}

/// `POST /v1/images/{source}/snapshots` where the filesystem cannot share
/// extents under a writable volume: 202 with the read-only snapshot of
/// `source` `copying`, by copy-before-write. Its view.
async fn copying_snapshot_of(vm: &Vm, source: &Value, name: &str) -> Value {
    let snap = snapshot_made(vm, source, name, 202).await;
    assert_eq!(snap["method"], "copy", "{snap}");
    assert_eq!(snap["state"], "copying", "{snap}");
    snap
}

/// `POST /v1/images/{source}/snapshots`; panics unless answered `status`
/// with a read-only snapshot of `source`.
async fn snapshot_made(vm: &Vm, source: &Value, name: &str, status: u16) -> Value {
    let a =
        vm.s.post(
            &format!("/v1/images/{}/snapshots", source["id"].as_str().unwrap()),
            json!({"name": name}),
        )
        .await;
    assert_eq!(a.status.as_u16(), status, "{}\n{}", a.body, vm.s.log_text());
    assert_eq!(a.body["read_only"], true, "{}", a.body);
    assert_eq!(a.body["snapshot_of"], source["id"], "{}", a.body);
    a.body
}

/// Deletes an image and its file; panics unless 204.
async fn delete_image(vm: &Vm, image: &Value) {
    let a =
        vm.s.delete(&format!(
            "/v1/images/{}?delete_file=true",
            image["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(a.status.as_u16(), 204, "{}", a.body);
}

/// A volume moved from `direct` to `nowait` by a snapshot says why, and
/// keeps out of `direct` while its image shares extents.
async fn assert_moved_off_direct(vm: &Vm, name: &str, snap: &Value) {
    let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
    assert_eq!(v["dispatch"], "nowait", "{v}");
    // The reason names the new image and the rule.
    let reason = v["dispatch_reason"].as_str().unwrap();
    assert!(
        reason.contains(&format!("'{}'", snap["name"].as_str().unwrap()))
            && reason.contains("SHARED"),
        "{v}"
    );
    let kinds = vm.event_kinds(v["id"].as_str().unwrap()).await;
    assert!(
        kinds.iter().any(|k| k == "dispatch_changed"),
        "{name}: {kinds:?}"
    );
    let a =
        vm.s.patch(
            &format!("/v1/volumes/{name}"),
            json!({"dispatch": "direct"}),
        )
        .await;
    assert!(a.status.is_client_error(), "PATCH direct: {}", a.body);
    let msg = a.body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("SHARED"), "PATCH direct: {}", a.body);
}

#[tokio::test(flavor = "multi_thread")]
async fn every_backend_and_policy_under_writes() {
    let vm = Vm::start().await;
    let mut lines = Vec::new();
    for (backend, dispatch) in [
        ("ublk", "nowait"),
        ("ublk", "threaded"),
        ("ublk", "direct"),
        ("dm", "nowait"),
        ("dm", "direct"),
        // Loop has no policy: the filesystem's lock on the file is its pause.
        ("loop", "none"),
    ] {
        let name = format!("{backend}-{dispatch}");
        // A direct map wants a written image; the others take holes.
        let alloc = if dispatch == "direct" {
            "full"
        } else {
            "sparse"
        };
        let src = vm.image(&name, Scratch::Xfs, 1024, alloc).await;
        let mut body = json!({"name": name, "image": name, "backend": backend});
        if backend != "loop" {
            body["dispatch"] = json!(dispatch);
        }
        let v = vm.volume(body).await;
        if backend != "loop" {
            assert_eq!(v["dispatch"], dispatch, "{v}");
        }
        let dev = v["device"].as_str().unwrap().to_string();
        let (mut fio, writer) = writes_under(&dev, FIO_SPAN).await;
        let last = writer.completed() - 1;
        let t0 = Instant::now();
        let snap = snapshot_of(&vm, &src, &format!("{name}-snap")).await;
        let t1 = Instant::now();
        assert!(
            fio.try_wait().unwrap().is_none(),
            "fio ended before the snapshot did: it did not run during it"
        );
        let snap_path = snap["path"].as_str().unwrap().to_string();
        // The blocks the writer writes next: a write reaching the snapshot
        // (through a map of its now shared extents) would change them. A
        // direct map is re-read every 2 s (rule 5, --extent-check-secs):
        // direct volumes write on for longer than that.
        let more = if dispatch == "direct" { 1024 } else { 128 };
        let until = writer.completed() + more;
        let before = read_range(&snap_path, 0, until * BLOCK as u64);
        writer.wait_for(until).await;
        let times = writer.finish();
        fio_ok(fio);
        let after = read_range(&snap_path, 0, before.len() as u64);
        let changed: Vec<usize> = (0..before.len() / BLOCK)
            .filter(|&i| before[i * BLOCK..][..BLOCK] != after[i * BLOCK..][..BLOCK])
            .collect();
        assert!(
            changed.is_empty(),
            "{name}: writes after the snapshot changed {} of its blocks, e.g. {:?}",
            changed.len(),
            &changed[..changed.len().min(8)]
        );
        let later = check_sequence(&snap_path, last, &times, t1);
        let held = held_us(&vm, &snap, &src, "image_snapshotted").await;
        assert!(held > 0, "{name}: held {held} µs");
        if dispatch == "direct" {
            assert_moved_off_direct(&vm, &name, &snap).await;
        }
        let (during, outside) = longest_writes(&times, t0, t1);
        let line = format!(
            "SNAPSHOT-PAUSE backend={backend} dispatch={dispatch} held_us={held} max_write_ms_during={:.1} max_write_ms_outside={:.1}",
            during.as_secs_f64() * 1e3,
            outside.as_secs_f64() * 1e3
        );
        eprintln!(
            "{line} (sequence: {} writes, last before the request {last}, {later} later ones in the snapshot; request took {:?})",
            times.len(),
            t1 - t0
        );
        lines.push(line);
        vm.delete(&name).await;
        delete_image(&vm, &snap).await;
        delete_image(&vm, &src).await;
    }
    eprintln!("{}", lines.join("\n"));
}

/// Files of `FILE_BYTES` bytes, file `j`'s words derived from `j`.
pub(crate) const FILE_BYTES: usize = 64 << 10;

pub(crate) fn file_data(j: u64) -> Vec<u8> {
    (0..FILE_BYTES as u64 / 8)
        .flat_map(|k| (j.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ k).to_le_bytes())
        .collect()
}

/// Checks that `dir` (`what`, for messages) holds files `f0` to
/// `f{synced - 1}` as [`file_writer`] wrote them: those fsynced before a
/// moment was taken.
pub(crate) fn assert_files_kept(dir: &Path, synced: u64, what: &str) {
    for j in 0..synced {
        let p = dir.join(format!("f{j}"));
        let data = std::fs::read(&p).unwrap_or_else(|e| {
            panic!(
                "{what}: file {}, fsynced before the moment: {e}",
                p.display()
            )
        });
        assert!(
            data == file_data(j),
            "{what}: file f{j}, fsynced before the moment, differs"
        );
    }
}

/// Makes files `f0`, `f1`, ... in `dir`, each fsynced with its directory
/// before it counts as done.
pub(crate) fn file_writer(dir: &Path) -> Writer<()> {
    let dir = dir.to_path_buf();
    Writer::spawn("file writer", move |d, s| {
        let parent = File::open(&dir).unwrap();
        let mut j = 0;
        while !s.load(Ordering::Relaxed) {
            let p = dir.join(format!("f{j}"));
            let f = File::create(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            f.write_all_at(&file_data(j), 0).unwrap();
            f.sync_all().unwrap();
            parent.sync_all().unwrap();
            j += 1;
            d.store(j, Ordering::Release);
        }
    })
}

/// A mount undone when dropped, so a failed test leaves nothing mounted for
/// the service's cleanup to trip on.
pub(crate) struct Mounted {
    dir: String,
    done: bool,
}

impl Mounted {
    pub(crate) fn new(dev: &str, dir: &Path, opts: &[&str]) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let dir = dir.to_str().unwrap().to_string();
        let mut args = opts.to_vec();
        args.extend([dev, dir.as_str()]);
        sh("mount", &args);
        Self { dir, done: false }
    }

    /// Unmounts; panics unless that works.
    pub(crate) fn unmount(mut self) {
        self.done = true;
        sh("umount", &[&self.dir]);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if !self.done && !crate::run("umount", &[&self.dir]).status.success() {
            crate::run("umount", &["-l", &self.dir]);
        }
    }
}

/// A loop device over a file, detached when dropped.
pub(crate) struct LoopDev(pub(crate) String);

impl LoopDev {
    pub(crate) fn new(file: &Path) -> Self {
        let lo = sh("losetup", &["-f", "--show", file.to_str().unwrap()]);
        Self(lo.trim().to_string())
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        crate::run("losetup", &["-d", &self.0]);
    }
}

/// xfs on a volume, files written and fsynced while a snapshot is taken; a
/// clone of the snapshot mounts (log replay), holds every file fsynced
/// before the request, and checks clean.
async fn xfs_snapshot_round(vm: &Vm, backend: &str, dispatch: &str, mib: u64) {
    let name = format!("fs-{backend}-{dispatch}");
    let alloc = if dispatch == "direct" {
        "full"
    } else {
        "sparse"
    };
    let src = vm.image(&name, Scratch::Xfs, mib, alloc).await;
    let v = vm
        .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": dispatch}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let mnt = vm.root(Scratch::Tmpfs).join(format!("mnt-{name}"));
    let again = vm.root(Scratch::Tmpfs).join(format!("mnt-{name}-clone"));
    sh("mkfs.xfs", &["-q", "-f", &dev]);
    let mounted = Mounted::new(&dev, &mnt, &[]);
    let writer = file_writer(&mnt);
    let started = Instant::now();
    while writer.completed() < 8 {
        assert!(
            writer.running() && started.elapsed() < Duration::from_secs(60),
            "{name}: the file writer made {} files",
            writer.completed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let synced = writer.completed();
    let snap = snapshot_of(vm, &src, &format!("{name}-snap")).await;
    assert!(writer.running(), "{name}: the file writer died");
    writer.finish();
    if dispatch == "direct" {
        let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
        assert_eq!(v["dispatch"], "nowait", "{v}");
    }

    let clone_path = vm.root(Scratch::Xfs).join(format!("{name}-clone.img"));
    let a =
        vm.s.post(
            "/v1/images",
            json!({"name": format!("{name}-clone"), "path": clone_path, "clone_from": snap["id"]}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    let clone = a.body;
    assert_eq!(clone["read_only"], false, "{clone}");
    // The clone's filesystem has the source's UUID, still mounted: nouuid.
    let lo = LoopDev::new(&clone_path);
    let clone_mounted = Mounted::new(&lo.0, &again, &["-o", "nouuid"]);
    assert_files_kept(&again, synced, &format!("{name}: the snapshot's clone"));
    clone_mounted.unmount();
    sh("xfs_repair", &["-n", &lo.0]);
    drop(lo);
    mounted.unmount();
    vm.delete(&name).await;
    for image in [&clone, &snap, &src] {
        delete_image(vm, image).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn xfs_on_a_snapshot_mounts_after_journal_replay() {
    let vm = Vm::start().await;
    xfs_snapshot_round(&vm, "ublk", "nowait", 1024).await;
    // The move to nowait under a mounted filesystem.
    xfs_snapshot_round(&vm, "dm", "direct", 512).await;
}

/// Waits until image `name` is no longer `copying`; panics unless `ready`.
async fn copy_done(vm: &Vm, name: &str) -> Value {
    vm.ended(&format!("/v1/images/{name}"), "copying", "ready")
        .await
}

/// On ext4, which cannot share extents, a writable ublk or dm volume's
/// snapshot is one moment all the same: the worker holds the queues once
/// and then copies the image, each chunk a write reaches copied before the
/// write. The copy waits at the `gate_copy` gate until the sequence writer
/// and fio have written well past the request, so their writes reach chunks
/// it has not copied. The snapshot holds every write completed before the
/// request, none begun after the answer, nothing torn; fio `--verify`
/// passes, and a discard during the copy changes nothing of the moment;
/// `direct` moves to `nowait` first. fio writes over 64 MiB for a
/// paced 16 MiB: only the verify is asserted, not the length. Then the
/// service is killed during a copy.
#[tokio::test(flavor = "multi_thread")]
async fn a_writable_volume_on_ext4_snapshots_one_moment_by_copy_before_write() {
    let mut vm = Vm::start_with_env(&[("BLOCKPLANE_TEST_FAULT", "gate_copy")]).await;
    let gate = vm.s.data.join("run/copy-gate");
    let mut lines = Vec::new();
    for (backend, dispatch) in [("ublk", "nowait"), ("dm", "direct")] {
        let name = format!("cbw-{backend}-{dispatch}");
        let alloc = if dispatch == "direct" {
            "full"
        } else {
            "sparse"
        };
        let src = vm.image(&name, Scratch::Ext4, 1024, alloc).await;
        let v = vm
            .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": dispatch}))
            .await;
        let dev = v["device"].as_str().unwrap().to_string();
        let (mut fio, writer) = writes_under(&dev, 64 << 20).await;
        let mark = vec![0x5au8; 1 << 20];
        write_range(&dev, MARK_AT, &mark);
        std::fs::write(&gate, b"").unwrap();
        let last = writer.completed() - 1;
        let t0 = Instant::now();
        let snap = copying_snapshot_of(&vm, &src, &format!("{name}-snap")).await;
        let t1 = Instant::now();
        assert!(
            fio.try_wait().unwrap().is_none(),
            "fio ended before the snapshot's moment: it did not run during it"
        );
        // 2 MiB more of the sequence: chunks the held copy has not reached.
        writer.wait_for(writer.completed() + 512).await;
        // A discard of a MiB written before the request, which the held
        // copy has not reached: the moment keeps it all the same.
        sh(
            "blkdiscard",
            &["-o", &MARK_AT.to_string(), "-l", "1MiB", &dev],
        );
        let copying = vm.s.get(&format!("/v1/images/{name}-snap")).await.body;
        assert_eq!(
            copying["state"], "copying",
            "the gate let the copy end: {copying}"
        );
        std::fs::remove_file(&gate).unwrap();
        let t2 = Instant::now();
        let ready = copy_done(&vm, &format!("{name}-snap")).await;
        let t3 = Instant::now();
        let times = writer.finish();
        fio_ok(fio);
        let snap_path = ready["path"].as_str().unwrap().to_string();
        let later = check_sequence(&snap_path, last, &times, t1);
        assert!(
            read_range(&snap_path, MARK_AT, mark.len() as u64) == mark,
            "{name}: a MiB written before the request and discarded during the copy is not in the snapshot"
        );
        let held = held_us(&vm, &snap, &src, "image_copy_started").await;
        if dispatch == "direct" {
            let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
            assert_eq!(v["dispatch"], "nowait", "{v}");
        }
        let (during, outside) = longest_writes(&times, t0, t3);
        let (mean_during, mean_outside) = mean_writes(&times, t1, t3);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let line = format!(
            "MOMENT-COPY backend={backend} dispatch={dispatch} held_us={held} copy_s={:.1} max_write_ms_during_copy={:.1} max_write_ms_outside={:.1} mean_write_ms_during_copy={:.2} mean_write_ms_outside={:.2}",
            (t3 - t2).as_secs_f64(),
            ms(during),
            ms(outside),
            ms(mean_during),
            ms(mean_outside)
        );
        eprintln!(
            "{line} (sequence: {} writes, last before the request {last}, {later} later ones in the snapshot)",
            times.len()
        );
        lines.push(line);
        vm.delete(&name).await;
        delete_image(&vm, &ready).await;
        delete_image(&vm, &src).await;
    }
    eprintln!("{}", lines.join("\n"));
    killed_during_a_copy(&mut vm, &gate).await;
}

/// The service killed while a worker copies a moment (held at the gate):
/// after the restart the snapshot is `failed` with its file removed, and
/// the worker's copy, which nothing will use, is stopped, so the next
/// snapshot begins at once (the gate still there: an orphan copy would
/// still run and refuse it).
async fn killed_during_a_copy(vm: &mut Vm, gate: &Path) {
    let name = "cbw-killed";
    let src = vm.image(name, Scratch::Ext4, 64, "sparse").await;
    vm.volume(json!({"name": name, "image": name, "backend": "ublk", "dispatch": "nowait"}))
        .await;
    std::fs::write(gate, b"").unwrap();
    let snap = copying_snapshot_of(vm, &src, "cbw-killed-1").await;
    vm.s.kill();
    vm.s.restart().await;
    let failed = vm.s.get("/v1/images/cbw-killed-1").await.body;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(
        !Path::new(snap["path"].as_str().unwrap()).exists(),
        "the killed copy's file is left: {failed}"
    );
    copying_snapshot_of(vm, &src, "cbw-killed-2").await;
    std::fs::remove_file(gate).unwrap();
    let ready = copy_done(vm, "cbw-killed-2").await;
    vm.delete(name).await;
    for image in [&ready, &src] {
        delete_image(vm, image).await;
    }
}

/// While a worker copies one moment (held at the `gate_copy` gate), what
/// would let a write reach the image past the copy's chunk tracking is
/// refused and changes nothing: a handover (the new worker would not know
/// the copy), a switch to `direct` (writes past the worker), a dm volume's
/// change of path (the kernel's table instead of its private worker), and a
/// second copy of the same volume. Each is checked on its own and every
/// failure reported. Then the worker is killed mid-copy: the snapshot ends
/// `failed` (never `ready` over a copy no worker finished), the volume
/// serves on, and the next snapshot copies.
#[tokio::test(flavor = "multi_thread")]
async fn a_moment_copy_refuses_what_would_lose_its_chunks_and_a_killed_worker_fails_it() {
    let vm = Vm::start_with_env(&[("BLOCKPLANE_TEST_FAULT", "gate_copy")]).await;
    let gate = vm.s.data.join("run/copy-gate");
    // `full`: direct is eligible but for the copy.
    let u = vm.image("ci-u", Scratch::Ext4, 64, "full").await;
    let d = vm.image("ci-d", Scratch::Ext4, 64, "full").await;
    let uv = vm
        .volume(json!({"name": "ci-u", "image": "ci-u", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    vm.volume(json!({"name": "ci-d", "image": "ci-d", "backend": "dm", "dispatch": "nowait"}))
        .await;
    std::fs::write(&gate, b"").unwrap();
    copying_snapshot_of(&vm, &u, "ci-u-snap").await;
    copying_snapshot_of(&vm, &d, "ci-d-snap").await;
    let before = vm.snapshot().await;
    let u_id = u["id"].as_str().unwrap();
    let refusals: [(&str, hyper::Method, String, Value, u16, &str); 5] = [
        (
            "a handover",
            hyper::Method::POST,
            "/v1/volumes/ci-u/handover".into(),
            json!({}),
            409,
            "copy_source_busy",
        ),
        (
            "a switch to direct",
            hyper::Method::PATCH,
            "/v1/volumes/ci-u".into(),
            json!({"dispatch": "direct"}),
            422,
            "refused",
        ),
        (
            "a dm path change to the kernel",
            hyper::Method::PATCH,
            "/v1/volumes/ci-d".into(),
            json!({"dispatch": "kernel"}),
            422,
            "refused",
        ),
        (
            "a dm path change to direct",
            hyper::Method::PATCH,
            "/v1/volumes/ci-d".into(),
            json!({"dispatch": "direct"}),
            422,
            "refused",
        ),
        (
            "a second copy",
            hyper::Method::POST,
            format!("/v1/images/{u_id}/snapshots"),
            json!({"name": "ci-u-snap-2"}),
            409,
            "copy_source_busy",
        ),
    ];
    let mut failures = Vec::new();
    for (what, method, path, body, status, code) in refusals {
        let a = vm.s.call(method, &path, Some(body)).await;
        let msg = a.body["error"]["message"].as_str().unwrap_or("");
        if a.status.as_u16() != status || a.body["error"]["code"] != code || !msg.contains("cop") {
            failures.push(format!(
                "{what} during a moment's copy: expected {status} {code} naming the copy, got {} {}",
                a.status, a.body
            ));
        } else if vm.snapshot().await != before {
            failures.push(format!(
                "{what} during a moment's copy was refused but changed something"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // The worker killed mid-copy: its replacement has no copy to finish.
    crate::live::kill_worker(&vm, uv["id"].as_str().unwrap()).await;
    let failed = vm.ended("/v1/images/ci-u-snap", "copying", "failed").await;
    assert!(failed["state_reason"].is_string(), "{failed}");
    std::fs::remove_file(&gate).unwrap();
    crate::direct_write_ok(uv["device"].as_str().unwrap());
    copying_snapshot_of(&vm, &u, "ci-u-snap-3").await;
    let u3 = copy_done(&vm, "ci-u-snap-3").await;
    let d1 = copy_done(&vm, "ci-d-snap").await;
    for v in ["ci-u", "ci-d"] {
        vm.delete(v).await;
    }
    for image in [&u3, &d1, &failed, &u, &d] {
        delete_image(&vm, image).await;
    }
}
