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
    name: &'static str,
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
    /// fio's longest I/O, read and write.
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
            name,
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
        vm.delete(s.name).await;
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
        sh("mount", &["--bind", harness::BIN, path.to_str().unwrap()]);
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
            assert_eq!(old, Path::new(harness::BIN), "{}: worker {pid}", s.name);
        }
        eprintln!("upgrade: waiting for fio on {}", s.name);
        let longest = fio_verified(s.name, fio);
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
        vm.set_dispatch(s.name, "nowait").await;
        let fio = fio_verify(&s.device, "8M", &["--output-format=json"]);
        fio_verified(s.name, fio);
        assert_eq!(errors_of(&vm, s).await, (0, 0), "{} on nowait", s.name);
    }
    assert_eq!(io_errors_logged(&served), Vec::<String>::new());
    delete_each(&vm, &served).await;
}

/// A cgroup v2 group of processes killed as one (`cgroup.kill`), as systemd
/// stops a unit with `KillMode=control-group`, as a container runtime stops
/// a pod, as the OOM killer kills a `memory.oom.group` cgroup.
struct Pod(PathBuf);

impl Pod {
    fn new() -> Self {
        let root = Path::new("/sys/fs/cgroup");
        if !root.join("cgroup.controllers").exists() {
            sh("mount", &["-t", "cgroup2", "none", "/sys/fs/cgroup"]);
        }
        let dir = root.join(format!("bp-pod-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Self(dir)
    }

    /// Moves `pid` (with its threads) in: what it starts later is in too.
    fn enter(&self, pid: u32) {
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
    async fn kill(&self) {
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
    let fios = fio_on_each(&served, |s| match s.name {
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
        let longest = fio_verified(s.name, fio);
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
