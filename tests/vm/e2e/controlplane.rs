//! The control plane replaced under I/O: a new binary started on the same
//! data dir (an upgrade), and the service killed together with every worker
//! (a pod replaced, a cgroup killed), on every backend; and what one live
//! instance sees of another's devices.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{self, Service};
use crate::{Scratch, Vm, eventually, fio_verify, sectors_written, sh, writes_flow};

/// One volume of each kind a host serves: its name, how it is served, its
/// device, and its worker (the volume's own, or a dm volume's private one).
struct Served {
    name: String,
    /// `ublk nowait`, ...
    kind: String,
    id: String,
    device: String,
    /// The policy in force, as created.
    dispatch: Value,
}

/// What each volume's user saw of a replacement.
struct Seen {
    /// From the replacement until the device completed a write again.
    resumed: Duration,
    /// fio's longest I/O, read and write; or a [`PacedWriter`]'s longest
    /// gap between two completed writes.
    longest: Duration,
}

/// `(name, backend, dispatch)` of the volumes [`serve_each_kind`] makes: every
/// backend, the ublk policies with a worker on the data path or not, and dm
/// over a private worker and direct.
const KINDS: [(&str, &str, &str); 5] = [
    ("u-nowait", "ublk", "nowait"),
    ("u-direct", "ublk", "direct"),
    ("d-nowait", "dm", "nowait"),
    ("d-direct", "dm", "direct"),
    ("loop", "loop", "auto"),
];

/// Creates one volume of each of [`KINDS`], on full 40 MiB xfs images.
async fn serve_each_kind(vm: &Vm) -> Vec<Served> {
    let mut out = Vec::new();
    for (name, backend, dispatch) in KINDS {
        vm.image(name, Scratch::Xfs, 40, "full").await;
        let v = vm
            .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": dispatch}))
            .await;
        out.push(Served {
            name: name.to_string(),
            kind: match backend {
                "loop" => "loop".to_string(),
                _ => format!("{backend} {dispatch}"),
            },
            id: v["id"].as_str().unwrap().to_string(),
            device: v["device"].as_str().unwrap().to_string(),
            dispatch: v["dispatch"].clone(),
        });
    }
    out
}

/// The pid of a volume's ublk worker (a dm volume's private one too), from
/// its run dir.
fn worker_of(vm: &Vm, s: &Served) -> Option<u64> {
    let state = vm.s.data.join(format!("run/ublk/{}/state.json", s.id));
    let state: Value = serde_json::from_slice(&std::fs::read(state).ok()?).ok()?;
    state["pid"].as_u64()
}

/// fio write-then-verify of `size(volume)` on every volume, as JSON; returns
/// once each device completes writes, so that what follows happens under I/O.
/// `fio(volume)` gives its size, and whether its writes are paced (at most
/// 300 a second).
async fn fio_on_each(
    served: &[Served],
    fio: impl Fn(&Served) -> (&'static str, bool),
) -> Vec<Child> {
    let fios: Vec<Child> = served
        .iter()
        .map(|s| {
            let (size, paced) = fio(s);
            let mut extra = vec!["--output-format=json"];
            if paced {
                extra.push("--rate_iops=,300");
            }
            fio_verify(&s.device, size, &extra)
        })
        .collect();
    for s in served {
        writes_flow(&s.device, 1 << 20).await;
    }
    fios
}

/// Kills the fio processes still running when a test ends early (a failed
/// assert), so that the volumes' cleanup does not wait on their I/O.
struct Reaper(Vec<i32>);

impl Reaper {
    fn of(fios: &[Child]) -> Self {
        Self(fios.iter().map(|c| c.id() as i32).collect())
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for pid in &self.0 {
                if let Some(pid) = rustix::process::Pid::from_raw(*pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
    }
}

/// Waits for fio: it must have verified everything it wrote, with no error.
/// Returns its longest I/O.
fn fio_verified(name: &str, fio: Child) -> Duration {
    let out = fio.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name}: fio failed ({}):\n{stderr}\n{text}",
        out.status
    );
    let json: Value = serde_json::from_str(&text[text.find('{').unwrap_or(0)..])
        .unwrap_or_else(|e| panic!("{name}: fio's JSON: {e}\n{text}"));
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "{name}: fio: {job}");
    for op in ["write", "read"] {
        assert!(
            job[op]["io_bytes"].as_u64().unwrap_or(0) > 0,
            "{name}: fio did not {op} (write, then verify): {job}"
        );
    }
    let longest = ["write", "read"]
        .iter()
        .filter_map(|op| job[op]["lat_ns"]["max"].as_u64())
        .max()
        .unwrap_or(0);
    Duration::from_nanos(longest)
}

/// The sectors each device has written so far.
fn written(served: &[Served]) -> Vec<u64> {
    served.iter().map(|s| sectors_written(&s.device)).collect()
}

/// Waits until every device completes a write beyond `from` (its
/// [`written`], taken at the stop, not at the restart: a device that never
/// stops may finish fio's write phase during a slow restart); returns, per
/// device, how long after `since` it did.
async fn resumed(served: &[Served], from: &[u64], since: Instant) -> Vec<Duration> {
    let mut at: Vec<Option<Duration>> = vec![None; served.len()];
    while at.iter().any(Option::is_none) {
        for (i, s) in served.iter().enumerate() {
            if at[i].is_none() && sectors_written(&s.device) > from[i] {
                at[i] = Some(since.elapsed());
            }
        }
        assert!(
            since.elapsed() < Duration::from_secs(180),
            "no write completed in 180 s on {:?}",
            served
                .iter()
                .zip(&at)
                .filter(|(_, a)| a.is_none())
                .map(|(s, _)| &s.device)
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    at.into_iter().map(Option::unwrap).collect()
}

/// The errors ublk and dm volumes counted (their worker's counters); loop
/// volumes count none.
async fn errors_of(vm: &Vm, s: &Served) -> (u64, u64) {
    let st =
        vm.s.get(&format!("/v1/volumes/{}/stats", s.name))
            .await
            .body;
    let n = |op: &str| st[op]["errors"].as_u64().unwrap_or(0);
    (n("read"), n("write"))
}

/// Kernel log lines reporting an I/O error on one of `served`'s devices (or
/// the ublk device under a dm one).
fn io_errors_logged(served: &[Served]) -> Vec<String> {
    let log = sh("dmesg", &[]);
    let names: Vec<String> = served
        .iter()
        .map(|s| s.device.rsplit('/').next().unwrap().to_string())
        .collect();
    log.lines()
        .filter(|l| l.contains("I/O error") || l.contains("Buffer I/O error"))
        .filter(|l| l.contains("ublkb") || names.iter().any(|n| l.contains(n.as_str())))
        .map(str::to_string)
        .collect()
}

/// Deletes every volume, so that no device is left to the next test (a new
/// registry beside one would be refused).
async fn delete_each(vm: &Vm, served: &[Served]) {
    for s in served {
        vm.delete(&s.name).await;
        assert!(
            !Path::new(&s.device).exists(),
            "{} is left after its delete",
            s.device
        );
    }
}

fn report(how: &str, served: &[Served], seen: &[Seen]) {
    let kernel = sh("uname", &["-r"]);
    eprintln!("{how}, kernel {}:", kernel.trim());
    eprintln!("| volume | served by | device writes again after | fio's longest I/O |");
    for (s, x) in served.iter().zip(seen) {
        eprintln!(
            "| {} | {} | {:.3} s | {:.3} s |",
            s.name,
            s.kind,
            x.resumed.as_secs_f64(),
            x.longest.as_secs_f64()
        );
    }
}

/// The service's executable at another path, as a package upgrade installs
/// a new one: a bind mount of the file (the test binary's 200 MB copy over
/// the emulator's 9p share takes minutes), which `/proc/PID/exe` names by
/// that path.
struct NewBinary(PathBuf);

impl NewBinary {
    fn at(path: &Path) -> Self {
        std::fs::write(path, b"").unwrap();
        sh("mount", &["--bind", harness::bin(), path.to_str().unwrap()]);
        Self(path.to_path_buf())
    }
}

impl Drop for NewBinary {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("--lazy")
            .arg(&self.0)
            .status();
    }
}

/// An upgrade of the control plane: the service stopped (SIGTERM) and a
/// newer binary (here a copy at another path) started on the same data dir,
/// while fio writes and then verifies on a volume of every kind. Every
/// device keeps serving and is adopted: same device, same worker process
/// (which still runs the old binary); fio verifies with no error.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_binary_adopts_every_device_under_fio_verify() {
    let mut vm = Vm::start().await;
    let served = serve_each_kind(&vm).await;
    let workers: Vec<Option<u64>> = served.iter().map(|s| worker_of(&vm, s)).collect();
    let fios = fio_on_each(&served, |_| ("32M", false)).await;
    let _reaper = Reaper::of(&fios);

    let next = NewBinary::at(&vm.s.dir.path().join("blockplane-next"));
    eprintln!("upgrade: the new binary is in place; stopping the service");
    let from = written(&served);
    let stopped = Instant::now();
    assert!(vm.s.signal(rustix::process::Signal::TERM).success());
    vm.s.opts.bin = Some(next.0.clone());
    vm.s.restart().await;
    let again = resumed(&served, &from, stopped).await;
    eprintln!("upgrade: every device writes again");
    let exe = std::fs::read_link(format!("/proc/{}/exe", vm.s.pid())).unwrap();
    assert_eq!(exe, next.0, "the new binary serves");

    for ((s, fio), (worker, resumed)) in served.iter().zip(fios).zip(workers.iter().zip(&again)) {
        let v = vm.s.get(&format!("/v1/volumes/{}", s.name)).await.body;
        assert_eq!(v["state"], "attached", "{}: {v}", s.name);
        assert_eq!(v["device"], s.device.as_str(), "{}: {v}", s.name);
        assert_eq!(v["dispatch"], s.dispatch, "{}: {v}", s.name);
        assert_eq!(
            worker_of(&vm, s),
            *worker,
            "{}: its worker was not adopted",
            s.name
        );
        if let Some(pid) = worker {
            let old = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
            assert_eq!(old, Path::new(harness::bin()), "{}: worker {pid}", s.name);
        }
        eprintln!("upgrade: waiting for fio on {}", s.name);
        let longest = fio_verified(&s.name, fio);
        assert_eq!(errors_of(&vm, s).await, (0, 0), "{}", s.name);
        eprintln!(
            "{}: writes again {:.3} s after the stop, longest I/O {:.3} s",
            s.name,
            resumed.as_secs_f64(),
            longest.as_secs_f64()
        );
    }
    // An adopted direct volume (ublk or dm: the latter's image is pinned,
    // held read-only) still leaves direct and writes on the file.
    for s in served.iter().filter(|s| s.kind.ends_with(" direct")) {
        eprintln!("upgrade: {} leaves direct", s.name);
        vm.set_dispatch(&s.name, "nowait").await;
        let fio = fio_verify(&s.device, "8M", &["--output-format=json"]);
        fio_verified(&s.name, fio);
        assert_eq!(errors_of(&vm, s).await, (0, 0), "{} on nowait", s.name);
    }
    assert_eq!(io_errors_logged(&served), Vec::<String>::new());
    delete_each(&vm, &served).await;
}

/// A cgroup v2 group of processes killed as one (`cgroup.kill`), as systemd
/// stops a unit with `KillMode=control-group`, as a container runtime stops
/// a pod, as the OOM killer kills a `memory.oom.group` cgroup.
pub(crate) struct Pod(PathBuf);

impl Pod {
    pub(crate) fn new() -> Self {
        let root = Path::new("/sys/fs/cgroup");
        if !root.join("cgroup.controllers").exists() {
            sh("mount", &["-t", "cgroup2", "none", "/sys/fs/cgroup"]);
        }
        let dir = root.join(format!("bp-pod-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Self(dir)
    }

    /// Moves `pid` (with its threads) in: what it starts later is in too.
    pub(crate) fn enter(&self, pid: u32) {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string()).unwrap();
    }

    fn pids(&self) -> Vec<u64> {
        std::fs::read_to_string(self.0.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// SIGKILLs every process in it at once and waits until none is left.
    pub(crate) async fn kill(&self) {
        std::fs::write(self.0.join("cgroup.kill"), "1").unwrap();
        eventually(
            Duration::from_secs(30),
            "the pod's processes to die",
            async || self.pids().is_empty(),
        )
        .await;
    }
}

impl Drop for Pod {
    /// Moves what is left back to the parent group, alive: a test that
    /// failed before the kill must not leave ublk devices without servers
    /// under fio (the service's cleanup could then wait forever).
    fn drop(&mut self) {
        let parent = self.0.parent().unwrap().join("cgroup.procs");
        for pid in self.pids() {
            let _ = std::fs::write(&parent, pid.to_string());
        }
        for _ in 0..100 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The service and every worker SIGKILLed at once, under fio write-then-
/// verify on a volume of every kind, then a new service started: each ublk
/// device (and dm's private one) waits quiesced and the new service's
/// workers recover it; loop and dm direct devices never stopped. Every
/// volume ends attached on its device, fio verifies everything with no I/O
/// error, and how long each device's writes stalled is printed.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_killed_whole_recovers_every_device_under_fio_verify() {
    let began = Instant::now();
    // Where the test's time goes, in the lane's log.
    let at = |what: &str| eprintln!("pod: {what} at {:.1} s", began.elapsed().as_secs_f64());
    let mut vm = Vm::start().await;
    let pod = Pod::new();
    pod.enter(vm.s.pid());
    let served = serve_each_kind(&vm).await;
    let workers: Vec<Option<u64>> = served.iter().map(|s| worker_of(&vm, s)).collect();
    let in_pod = pod.pids();
    for (s, w) in served.iter().zip(&workers) {
        if let Some(pid) = w {
            assert!(
                in_pod.contains(pid),
                "{}: worker {pid} not in the pod",
                s.name
            );
        }
    }
    // A fio over a ublk device (dm nowait's too) waits through the gap, and
    // must still be writing when the pod dies: writes completed after the
    // kill are what shows it recovered. Paced (16 MiB at most 300 writes/s:
    // 13 s or more), its write phase outlasts the few seconds from its start
    // to the kill however fast the device is (an unpaced 8M on ublk direct
    // once finished first). Loop and dm direct never stop, so theirs need
    // only still be writing when the pod dies.
    let fios = fio_on_each(&served, |s| match s.name.as_str() {
        "loop" | "d-direct" => ("16M", false),
        _ => ("16M", true),
    })
    .await;
    let _reaper = Reaper::of(&fios);

    at("fio writes on every volume; killing the pod");
    let killed = Instant::now();
    pod.kill().await;
    // Counted from here, with every server dead: a ublk device completes
    // nothing until its new worker recovers it. Watched while the new
    // service starts, since loop and dm direct go on writing meanwhile.
    let from = written(&served);
    assert!(!vm.s.wait_exit(Duration::from_secs(10)).success());
    for s in &served {
        assert!(
            Path::new(&s.device).exists(),
            "{}: {} is gone",
            s.name,
            s.device
        );
    }
    let start = async {
        vm.s.restart().await;
        killed.elapsed()
    };
    let (ready, again) = tokio::join!(start, resumed(&served, &from, killed));
    at("every device writes again");

    let mut seen = Vec::new();
    for ((s, fio), (worker, resumed)) in served.iter().zip(fios).zip(workers.iter().zip(again)) {
        let v = vm.s.get(&format!("/v1/volumes/{}", s.name)).await.body;
        assert_eq!(v["state"], "attached", "{}: {v}", s.name);
        assert_eq!(v["device"], s.device.as_str(), "{}: {v}", s.name);
        assert_eq!(v["dispatch"], s.dispatch, "{}: {v}", s.name);
        if worker.is_some() {
            let now = worker_of(&vm, s);
            assert!(
                now.is_some() && now != *worker,
                "{}: no new worker ({worker:?}, now {now:?})",
                s.name
            );
        }
        let longest = fio_verified(&s.name, fio);
        at(&format!("fio verified {}", s.name));
        assert_eq!(errors_of(&vm, s).await, (0, 0), "{}", s.name);
        seen.push(Seen { resumed, longest });
    }
    assert_eq!(io_errors_logged(&served), Vec::<String>::new());
    eprintln!(
        "the new service answered {:.3} s after the kill",
        ready.as_secs_f64()
    );
    report("service and workers SIGKILLed at once", &served, &seen);
    delete_each(&vm, &served).await;
    at("every volume deleted");
}

/// Two services on one host, each with its own data dir: the dm device of
/// the live one neither refuses the other's first start (a new registry)
/// nor shows in its `GET /v1/host` as an orphan. Once its service is gone
/// (SIGKILL), the device is what a lost registry leaves, and is reported;
/// when that service is back, it is not.
#[tokio::test(flavor = "multi_thread")]
async fn a_live_instances_dm_device_blocks_no_start_and_is_no_orphan() {
    let mut a = Vm::start().await;
    a.image("live", Scratch::Xfs, 16, "full").await;
    let v = a
        .volume(json!({"name": "live", "image": "live", "backend": "dm", "dispatch": "direct"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let b = Service::start().await;
    let reported = async || -> Option<Value> {
        b.get("/v1/host").await.body["orphans"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["device"] == dev.as_str())
            .cloned()
    };
    assert_eq!(
        reported().await,
        None,
        "a live instance's device is no orphan"
    );

    a.s.kill();
    let o = reported()
        .await
        .expect("a dead instance's device is reported");
    assert_eq!(o["backend"], "dm", "{o}");
    assert_eq!(o["volume_id"], v["id"], "{o}");
    assert_eq!(o["removable"], false, "{o}");
    assert!(
        o["reason"]
            .as_str()
            .unwrap()
            .contains("no live service is that instance"),
        "{o}"
    );
    a.s.restart().await;
    assert_eq!(reported().await, None, "its service is back");
    assert_eq!(a.s.get("/v1/volumes/live").await.body["state"], "attached");
    a.delete("live").await;
    assert!(!Path::new(&dev).exists(), "{dev} is left after its delete");
}

/// A volume's backend and policy, as a create asks for them.
type BackendAndPolicy = (&'static str, &'static str);

/// The kinds of a many-volume host, as an operator mixes them: the
/// workers' two policies, dm over a private worker, and the default (no
/// backend or policy asked: dm `kernel` on a sparse image), with the
/// allocation each needs.
const MIXED: [(&str, Option<BackendAndPolicy>, &str); 4] = [
    ("un", Some(("ublk", "nowait")), "sparse"),
    ("ud", Some(("ublk", "direct")), "full"),
    ("dn", Some(("dm", "nowait")), "sparse"),
    ("df", None, "sparse"),
];

/// `count` volumes on 8 MiB xfs images, split evenly between [`MIXED`].
async fn serve_mixed(vm: &Vm, count: usize) -> Vec<Served> {
    let mut out = Vec::new();
    for i in 0..count {
        let (kind, asked, allocation) = MIXED[i % MIXED.len()];
        let name = format!("{kind}{i}");
        vm.image(&name, Scratch::Xfs, 8, allocation).await;
        let mut body = json!({"name": name, "image": name});
        if let Some((backend, dispatch)) = asked {
            body["backend"] = json!(backend);
            body["dispatch"] = json!(dispatch);
        }
        let v = vm.volume(body).await;
        out.push(Served {
            kind: format!(
                "{} {}",
                v["backend"].as_str().unwrap(),
                v["dispatch"].as_str().unwrap()
            ),
            name,
            id: v["id"].as_str().unwrap().to_string(),
            device: v["device"].as_str().unwrap().to_string(),
            dispatch: v["dispatch"].clone(),
        });
    }
    out
}

/// A paced O_DIRECT writer on one device, as an application's steady
/// trickle: a thread writing one 4 KiB block every 100 ms (10 a second)
/// round the device's first 1 MiB, each block stamped with its number and
/// the write's sequence number, noting when each write completed. A thread
/// of the test, not a process: dozens of fio processes load the emulator
/// more than the recoveries they measure.
struct PacedWriter {
    device: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Result<Paced, String>>,
}

/// What a [`PacedWriter`] did.
struct Paced {
    /// When each write completed.
    completed: Vec<Instant>,
    /// The sequence number last written to each block (0: never).
    last: Vec<u64>,
}

/// How often a [`PacedWriter`] writes: often enough to see a stall to a
/// tenth of a second, seldom enough that four dozen of them leave the
/// emulator's two CPUs to the recoveries they measure.
const PACED_EVERY: Duration = Duration::from_millis(100);

/// The block size, and how many blocks a [`PacedWriter`] goes round.
const PACED_BLOCK: usize = 4096;
const PACED_BLOCKS: usize = 256;

/// A 4 KiB buffer aligned for O_DIRECT.
struct Aligned(*mut u8);

// SAFETY: the buffer is owned by one thread at a time.
unsafe impl Send for Aligned {}

impl Aligned {
    const LAYOUT: std::alloc::Layout =
        match std::alloc::Layout::from_size_align(PACED_BLOCK, PACED_BLOCK) {
            Ok(l) => l,
            Err(_) => panic!("a valid layout"),
        };

    fn new() -> Self {
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(Self::LAYOUT) };
        assert!(!p.is_null(), "out of memory");
        Self(p)
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: allocated with LAYOUT's size, owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.0, PACED_BLOCK) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` with the same layout.
        unsafe { std::alloc::dealloc(self.0, Self::LAYOUT) }
    }
}

fn open_direct(device: &str) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)
        .unwrap_or_else(|e| panic!("open {device} O_DIRECT: {e}"))
}

impl PacedWriter {
    fn start(device: &str) -> Self {
        use std::os::unix::fs::FileExt;
        let file = open_direct(device);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let name = device.to_string();
        let thread = std::thread::spawn(move || {
            let mut buf = Aligned::new();
            let mut done = Paced {
                completed: Vec::new(),
                last: vec![0; PACED_BLOCKS],
            };
            let mut next = Instant::now();
            let mut seq = 0u64;
            while !stopping.load(std::sync::atomic::Ordering::Relaxed) {
                seq += 1;
                let block = (seq as usize) % PACED_BLOCKS;
                let b = buf.bytes();
                b[..8].copy_from_slice(&(block as u64).to_le_bytes());
                b[8..16].copy_from_slice(&seq.to_le_bytes());
                file.write_all_at(b, (block * PACED_BLOCK) as u64)
                    .map_err(|e| format!("{name}: write {seq} to block {block}: {e}"))?;
                done.completed.push(Instant::now());
                done.last[block] = seq;
                // The pace of the workload, not a wait for a condition.
                next += PACED_EVERY;
                if let Some(ahead) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(ahead);
                }
            }
            Ok(done)
        });
        Self {
            device: device.to_string(),
            stop,
            thread,
        }
    }

    /// Stops it; what it did, after each block read back holds the last
    /// write it completed there.
    fn finish(self) -> Paced {
        use std::os::unix::fs::FileExt;
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let done = self
            .thread
            .join()
            .expect("the writer thread")
            .unwrap_or_else(|e| panic!("{e}"));
        let file = open_direct(&self.device);
        let mut buf = Aligned::new();
        for (block, seq) in done.last.iter().enumerate() {
            let b = buf.bytes();
            file.read_exact_at(b, (block * PACED_BLOCK) as u64)
                .unwrap_or_else(|e| panic!("{}: read block {block}: {e}", self.device));
            if *seq > 0 {
                let found = (
                    u64::from_le_bytes(b[..8].try_into().unwrap()),
                    u64::from_le_bytes(b[8..16].try_into().unwrap()),
                );
                assert_eq!(
                    found,
                    (block as u64, *seq),
                    "{}: block {block} does not hold its last completed write",
                    self.device
                );
            }
        }
        done
    }
}

impl Paced {
    /// When writes came back after the kill, from `killed`: the end of
    /// the gap between two completed writes that spans `dead`, when every
    /// process of the pod was gone (a device goes on writing for a moment
    /// after the kill is asked, until its worker is dead).
    fn resumed(&self, killed: Instant, dead: Instant) -> Duration {
        self.completed
            .windows(2)
            .find(|w| w[0] <= dead && dead < w[1])
            .map(|w| w[1] - killed)
            .expect("writes completed after the pod died")
    }

    /// The longest time between two completed writes.
    fn longest_gap(&self) -> Duration {
        self.completed
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }
}

/// What a pod kill of a host with many volumes showed.
struct PodKill {
    served: Vec<Served>,
    /// Whether each volume's device waited for a new worker.
    waited: Vec<bool>,
    /// From the kill, and from the new service's start, until its
    /// `/healthz` answered.
    answered: (Duration, Duration),
    /// The volumes its first `GET /v1/volumes`, asked then, showed
    /// `recovering`.
    recovering: usize,
    /// Per volume: when its writes came back after the kill, from the kill,
    /// and its writer's longest gap between two completed writes.
    seen: Vec<Seen>,
    /// The new service's log, and each new worker's start from its own.
    log: String,
}

impl PodKill {
    /// When the devices that waited for a worker wrote again, first and
    /// last, from the kill.
    fn first_and_last(&self) -> (Duration, Duration) {
        let waited = || {
            self.seen
                .iter()
                .zip(&self.waited)
                .filter(|(_, w)| **w)
                .map(|(s, _)| s.resumed)
        };
        (waited().min().unwrap(), waited().max().unwrap())
    }

    /// Deletes its volumes, so that no device is left to the next test.
    async fn delete(&self, vm: &Vm) {
        delete_each(vm, &self.served).await;
    }

    /// The figures, one line per kind, and the new service's steps from its
    /// log, with their times.
    fn report(&self, build: &str) {
        for line in self.log.lines().filter(|l| {
            [
                "listening",
                "reconciling",
                "reconciled",
                "worker_restarted",
                "open-files",
                "recovered=true",
                "worker starting",
                "start: ",
                "reconcile: ",
                "a worker",
                "worker started",
            ]
            .iter()
            .any(|w| l.contains(w))
        }) {
            eprintln!("log: {line}");
        }
        let kernel = sh("uname", &["-r"]);
        eprintln!(
            "pod kill, {} volumes, {build} build, kernel {}: the API answered {:.2} s after the kill ({:.2} s after the new service's start), {} volumes recovering then",
            self.served.len(),
            kernel.trim(),
            self.answered.0.as_secs_f64(),
            self.answered.1.as_secs_f64(),
            self.recovering
        );
        eprintln!(
            "| served by | volumes | writes again after the kill (min–max) | longest gap between two writes (max) |"
        );
        let mut kinds: Vec<&str> = self.served.iter().map(|s| s.kind.as_str()).collect();
        kinds.sort();
        kinds.dedup();
        for kind in kinds {
            let of = || {
                self.served
                    .iter()
                    .zip(&self.seen)
                    .filter(move |(s, _)| s.kind == kind)
                    .map(|(_, x)| x)
            };
            eprintln!(
                "| {kind} | {} | {:.2}–{:.2} s | {:.2} s |",
                of().count(),
                of().map(|x| x.resumed).min().unwrap().as_secs_f64(),
                of().map(|x| x.resumed).max().unwrap().as_secs_f64(),
                of().map(|x| x.longest).max().unwrap().as_secs_f64()
            );
        }
    }
}

/// With `BLOCKPLANE_STALL_PERF` set, a `perf record` of every CPU from the
/// kill until the new service has reconciled: where a recovery's time goes.
struct Profile {
    perf: Child,
    data: PathBuf,
}

impl Profile {
    async fn start(vm: &Vm) -> Option<Profile> {
        std::env::var_os("BLOCKPLANE_STALL_PERF")?;
        let data = vm.s.data.join("stall.perf");
        let perf = std::process::Command::new("perf")
            .args(["record", "-a", "-g", "-e", "cpu-clock", "-F", "499", "-o"])
            .arg(&data)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("perf runs");
        // perf has opened its events once it has written its header.
        eventually(Duration::from_secs(30), "perf to start", async || {
            std::fs::metadata(&data).is_ok_and(|m| m.len() > 0)
        })
        .await;
        Some(Profile { perf, data })
    }

    fn report(mut self) {
        let pid = self.perf.id().to_string();
        sh("kill", &["-INT", &pid]);
        let _ = self.perf.wait();
        let data = self.data.to_str().unwrap();
        let by_comm = sh(
            "perf",
            &[
                "report",
                "--stdio",
                "--no-children",
                "-g",
                "none",
                "--percent-limit",
                "1",
                "--sort",
                "comm",
                "-i",
                data,
            ],
        );
        let comms: Vec<String> = by_comm
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .inspect(|l| eprintln!("perf: {l}"))
            .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
            .take(8)
            .collect();
        // Inclusive of callees: which calls a process's time went under.
        for comm in comms {
            let text = sh(
                "perf",
                &[
                    "report",
                    "--stdio",
                    "--children",
                    "-g",
                    "none",
                    "--percent-limit",
                    "0.7",
                    "--comms",
                    &comm,
                    "--sort",
                    "dso,sym",
                    "-i",
                    data,
                ],
            );
            for line in text
                .lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .take(45)
            {
                eprintln!("perf[{comm}]: {line}");
            }
        }
    }
}

/// Waits until every device has written `bytes` more, all side by side.
async fn all_write(served: &[Served], bytes: u64) {
    let flows: Vec<_> = served
        .iter()
        .map(|s| {
            let device = s.device.clone();
            tokio::spawn(async move { writes_flow(&device, bytes).await })
        })
        .collect();
    for f in flows {
        f.await.unwrap();
    }
}

/// `count` volumes of [`MIXED`] under a [`PacedWriter`] each, the pod (the
/// service and every worker) killed with `cgroup.kill`, a new service
/// started from `bin`. Asserts what holds on any build and load: every
/// device writes again and ends attached on its node, no write fails, each
/// block holds the last write completed to it, no I/O error is logged.
/// The caller deletes the volumes ([`PodKill::delete`]).
async fn kill_a_mixed_pod(count: usize, bin: Option<PathBuf>) -> (PodKill, Vm) {
    let began = Instant::now();
    let at = |what: &str| eprintln!("many: {what} at {:.1} s", began.elapsed().as_secs_f64());
    let mut vm = match bin {
        Some(bin) => Vm::start_from(bin).await,
        None => Vm::start().await,
    };
    let pod = Pod::new();
    pod.enter(vm.s.pid());
    let served = serve_mixed(&vm, count).await;
    let waited: Vec<bool> = served.iter().map(|s| worker_of(&vm, s).is_some()).collect();
    at("volumes made");
    let writers: Vec<PacedWriter> = served
        .iter()
        .map(|s| PacedWriter::start(&s.device))
        .collect();
    all_write(&served, 64 << 10).await;

    at("every volume writes; killing the pod");
    let profile = Profile::start(&vm).await;
    let killed = Instant::now();
    pod.kill().await;
    let dead = Instant::now();
    assert!(!vm.s.wait_exit(Duration::from_secs(10)).success());
    let log_from = vm.s.log_text().len();
    at("the pod is dead; starting a new service");
    let spawned = Instant::now();
    vm.s.spawn(&[]);
    vm.s.wait_answers().await;
    let answered = (killed.elapsed(), spawned.elapsed());
    at("/healthz answers");
    let listed = vm.s.get("/v1/volumes").await;
    assert_eq!(listed.status.as_u16(), 200, "{}", listed.body);
    let recovering = listed
        .body
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["state"] == "recovering")
        .count();
    vm.s.wait_ready().await;
    at("reconciled");
    if let Some(p) = profile {
        p.report();
    }
    // Two seconds more of writes on every device.
    all_write(&served, 80 << 10).await;

    let mut seen = Vec::new();
    for (s, writer) in served.iter().zip(writers) {
        let v = vm.s.get(&format!("/v1/volumes/{}", s.name)).await.body;
        assert_eq!(v["state"], "attached", "{}: {v}", s.name);
        assert_eq!(v["device"], s.device.as_str(), "{}: {v}", s.name);
        let done = writer.finish();
        assert_eq!(errors_of(&vm, s).await, (0, 0), "{}", s.name);
        seen.push(Seen {
            resumed: done.resumed(killed, dead),
            longest: done.longest_gap(),
        });
    }
    at("every volume verified");
    assert_eq!(io_errors_logged(&served), Vec::<String>::new());
    let mut log = vm.s.log_text()[log_from..].to_string();
    for s in &served {
        let worker_log = vm.s.data.join(format!("run/ublk/{}/worker.log", s.id));
        let text = std::fs::read_to_string(worker_log).unwrap_or_default();
        // The last start's steps (its debug ones under BLOCKPLANE_LOG).
        let last_start = text.rfind("worker starting").unwrap_or(0);
        let last_start = text[..last_start].rfind('\n').map_or(0, |i| i + 1);
        for line in text[last_start..].lines().filter(|l| {
            l.contains("worker starting") || l.contains("start: ") || l.contains("recovered=true")
        }) {
            log.push_str(&format!("{}: {line}\n", s.name));
        }
    }
    let k = PodKill {
        served,
        waited,
        answered,
        recovering,
        seen,
        log,
    };
    (k, vm)
}

/// A pod killed on a host of 12 volumes (3 of each of [`MIXED`]): its
/// interruption does not grow with the count. The new service answers its
/// API before the last device has recovered, with the volumes not yet done
/// saying `recovering`; the devices recover side by side, not one after
/// another: the last to write again does so within twice the first's wait
/// (with 8 recoveries at once, the ninth waits a whole turn more). No
/// write fails, every block holds its last completed write.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_kill_stalls_many_volumes_side_by_side_with_the_api_answering() {
    let (k, vm) = kill_a_mixed_pod(12, None).await;
    k.report("debug");
    k.delete(&vm).await;
    let (first, last) = k.first_and_last();
    assert!(
        k.answered.0 < last,
        "the API answered {:.2} s after the kill, after the last device wrote again ({:.2} s)",
        k.answered.0.as_secs_f64(),
        last.as_secs_f64()
    );
    assert!(
        k.recovering > 0,
        "the API's first listing showed no volume recovering"
    );
    assert!(
        last <= first * 2,
        "recoveries queued: the first device waiting for a worker wrote again {:.2} s after the kill, the last {:.2} s",
        first.as_secs_f64(),
        last.as_secs_f64()
    );
}

/// The pod-kill benchmark (not a test: `tests/vm/stall.sh`): the mix of
/// [`MIXED`] at `BLOCKPLANE_STALL_VOLUMES` (16), from the binary at
/// `BLOCKPLANE_STALL_BIN` (a release build), printing the figures.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: tests/vm/stall.sh"]
async fn pod_kill_stall_benchmark() {
    let count = std::env::var("BLOCKPLANE_STALL_VOLUMES")
        .map(|n| n.parse().expect("BLOCKPLANE_STALL_VOLUMES is a number"))
        .unwrap_or(16);
    let bin = std::env::var_os("BLOCKPLANE_STALL_BIN").map(PathBuf::from);
    let build = if bin.is_some() { "release" } else { "debug" };
    let (k, vm) = kill_a_mixed_pod(count, bin).await;
    k.report(build);
    k.delete(&vm).await;
}
