//! Upgrades without detaching: a second build installed at the service's
//! path as a package upgrade does, the service restarted (its workers
//! adopted, shown as older), `blockplane upgrade` handing every volume over
//! to a worker of the new build under fio verify; a replacement worker that
//! runs the service's build, not the file now at its path; a handover whose
//! old worker is killed, whose new worker fails to start, or that an
//! allocate refuses.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::builds::{copy_as_build, exe_of, install};
use crate::harness::bin;
use crate::{Scratch, Vm, eventually, fio_ok, fio_verify, sh, writes_flow};

/// The worker of a volume (a dm volume's private one too), from its state file.
fn worker_pid(vm: &Vm, volume_id: &str) -> u64 {
    let state = vm.s.data.join(format!("run/ublk/{volume_id}/state.json"));
    let text = std::fs::read(&state).unwrap_or_else(|e| panic!("{}: {e}", state.display()));
    serde_json::from_slice::<Value>(&text).unwrap()["pid"]
        .as_u64()
        .unwrap()
}

/// The longest completion latency in a fio report, ms.
fn max_latency_ms(report: &str) -> f64 {
    report
        .lines()
        .filter(|l| l.trim_start().starts_with("clat ("))
        .filter_map(|l| {
            let unit = match l.split('(').nth(1)?.split(')').next()? {
                "nsec" => 1e-6,
                "usec" => 1e-3,
                "msec" => 1.0,
                _ => return None,
            };
            let max = l.split("max=").nth(1)?.split(',').next()?.trim();
            let n = match max.strip_suffix('k') {
                Some(k) => k.parse::<f64>().ok()? * 1000.0,
                None => max.parse::<f64>().ok()?,
            };
            Some(n * unit)
        })
        .fold(0.0, f64::max)
}

/// fio verify runs one after another on a device until stopped; each must
/// pass. Returns the longest completion latency seen, ms.
struct Load {
    stop: Arc<AtomicBool>,
    runner: Option<std::thread::JoinHandle<(f64, u32)>>,
}

impl Load {
    fn start(dev: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (dev, flag) = (dev.to_string(), stop.clone());
        let runner = std::thread::spawn(move || {
            let (mut worst, mut runs) = (0.0f64, 0);
            while runs == 0 || !flag.load(Relaxed) {
                let text = fio_ok(fio_verify(&dev, "12M", &[]));
                worst = worst.max(max_latency_ms(&text));
                runs += 1;
            }
            (worst, runs)
        });
        Self {
            stop,
            runner: Some(runner),
        }
    }

    /// Waits for the run in progress to verify; the longest latency, runs.
    fn finish(mut self) -> (f64, u32) {
        self.stop.store(true, Relaxed);
        let runner = self.runner.take().expect("finished once");
        runner.join().expect("a fio run failed")
    }
}

impl Drop for Load {
    /// A test that fails part way stops its fio loop, so that the devices
    /// can go.
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// A fresh directory on the guest's tmpfs for the service's executable.
fn bin_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("bp-bin")
        .tempdir_in("/tmp")
        .unwrap()
}

/// What a handover must keep of a volume.
fn settings(v: &Value) -> Value {
    json!({
        "device": v["device"], "backend": v["backend"], "dispatch": v["dispatch"],
        "requested_dispatch": v["requested_dispatch"], "read_only": v["read_only"],
        "qos": v["qos"], "queues": v["queues"], "size_bytes": v["size_bytes"],
        "state": v["state"],
    })
}

/// `major:minor` of a block device node.
fn devnum(dev: &str) -> String {
    let name = dev.rsplit('/').next().unwrap();
    std::fs::read_to_string(format!("/sys/block/{name}/dev"))
        .unwrap()
        .trim()
        .to_string()
}

/// Runs the CLI installed at `bin` against the service.
fn cli(vm: &Vm, bin: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin)
        .arg("--api")
        .arg(format!("unix:{}", vm.s.sock.display()))
        .args(args)
        .env_remove("BLOCKPLANE_TOKEN")
        .output()
        .unwrap()
}

/// The operator's upgrade: build B installed over build A at the service's
/// path, the service restarted (it adopts A's workers and shows them
/// older), then `blockplane upgrade`; under fio verify on ublk
/// nowait/threaded/direct and dm nowait. Each volume ends on B with its
/// device, number and settings, fio verify clean, no I/O error, counters
/// not reset; prints the longest I/O stall per volume.
#[tokio::test(flavor = "multi_thread")]
async fn an_upgrade_hands_every_volume_to_the_new_build_under_fio_verify() {
    let dir = bin_dir();
    let path = dir.path().join("blockplane");
    let old = copy_as_build(Path::new(bin()), &path, None);
    let mut vm = Vm::start_from(path.clone()).await;
    let host = vm.s.get("/v1/host").await.body;
    assert_eq!(host["build"]["version"], old.as_str(), "{host}");
    let quiesce = host["backends"]["ublk"]["features"]["names"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n == "QUIESCE");
    let specs = [
        ("u-nowait", "ublk", "nowait", json!({"iops": 100000})),
        ("u-threaded", "ublk", "threaded", Value::Null),
        ("u-direct", "ublk", "direct", Value::Null),
        ("d-nowait", "dm", "nowait", Value::Null),
    ];
    let mut vols = Vec::new();
    for (name, backend, dispatch, qos) in &specs {
        vm.image(name, Scratch::Xfs, 24, "full").await;
        let v = vm
            .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": dispatch, "qos": qos}))
            .await;
        assert_eq!(v["dispatch"], *dispatch, "{v}");
        let id = v["id"].as_str().unwrap().to_string();
        let dev = v["device"].as_str().unwrap().to_string();
        vols.push((name.to_string(), id, dev));
    }
    // One at a time: four fio starting at once on the emulator may take
    // longer than writes_flow waits.
    let mut loads = Vec::new();
    for (_, _, dev) in &vols {
        loads.push(Load::start(dev));
        writes_flow(dev, 1 << 20).await;
    }

    // The package upgrade: B renamed over A; A's workers run a deleted file.
    let staged = dir.path().join("blockplane.new");
    let new = copy_as_build(&path, &staged, Some("upgrade-test"));
    assert_ne!(new, old);
    install(&staged, &path);
    for (name, id, _) in &vols {
        let exe = exe_of(worker_pid(&vm, id));
        assert_eq!(exe, format!("{} (deleted)", path.display()), "{name}");
    }
    // The service restarted: on B, A's workers adopted and shown older.
    vm.s.signal(rustix::process::Signal::TERM);
    vm.s.restart().await;
    let host = vm.s.get("/v1/host").await.body;
    assert_eq!(host["build"]["version"], new.as_str(), "{host}");
    let mut before = Vec::new();
    for (name, id, dev) in &vols {
        let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
        assert_eq!(v["worker_version"], old.as_str(), "{name}: {v}");
        assert_eq!(v["worker_older"], true, "{name}: {v}");
        let stats = vm.s.get(&format!("/v1/volumes/{name}/stats")).await.body;
        before.push((settings(&v), devnum(dev), worker_pid(&vm, id), stats));
    }
    let metrics = vm.s.get_text("/metrics").await;
    assert!(
        metrics.contains(&format!(
            "blockplane_worker_info{{volume=\"u-direct\",backend=\"ublk\",version=\"{old}\",older=\"true\"}} 1"
        )),
        "{metrics}"
    );
    let ls = String::from_utf8(cli(&vm, &path, &["volume", "ls"]).stdout).unwrap();
    assert_eq!(ls.matches("OLDER").count(), 4, "{ls}");

    let started = Instant::now();
    let out = cli(&vm, &path, &["--json", "upgrade"]);
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "blockplane upgrade failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let done: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(done.len(), 4, "{done:?}");

    let mut stalls = Vec::new();
    for (((name, id, dev), (kept, num, old_pid, stats0)), load) in
        vols.iter().zip(&before).zip(loads)
    {
        let h = done
            .iter()
            .find(|h| h["volume"]["name"] == name.as_str())
            .unwrap_or_else(|| panic!("{name} not handed over: {done:?}"));
        let method = if quiesce { "quiesce" } else { "drain" };
        assert_eq!(h["method"], method, "{name}: {h}");
        let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
        assert_eq!(
            settings(&v),
            *kept,
            "{name}: the handover changed its settings"
        );
        assert_eq!(devnum(dev), *num, "{name}: the device number changed");
        assert_eq!(v["worker_version"], new.as_str(), "{name}: {v}");
        assert_eq!(v["worker_older"], false, "{name}: {v}");
        let pid = worker_pid(&vm, id);
        assert_ne!(pid, *old_pid, "{name}");
        assert_eq!(exe_of(pid), path.display().to_string(), "{name}");
        let (worst, runs) = load.finish();
        let stats = vm.s.get(&format!("/v1/volumes/{name}/stats")).await.body;
        for op in ["read", "write", "flush"] {
            // dm counts no errors of its own (null): fio's verify stands.
            let errors = &stats[op]["errors"];
            assert!(
                *errors == 0 || (name.starts_with("d-") && errors.is_null()),
                "{name}: {stats}"
            );
        }
        assert!(
            stats["write"]["ops"].as_u64() > stats0["write"]["ops"].as_u64(),
            "{name}: the counters were reset by the handover: {} then {}",
            stats0["write"]["ops"],
            stats["write"]["ops"]
        );
        assert_eq!(
            stats["since"], stats0["since"],
            "{name}: the counters restarted"
        );
        assert_eq!(
            stats["worker_restarts"], stats0["worker_restarts"],
            "{name}: a handover counted as a crash"
        );
        stalls.push(format!(
            "{name}: handover {} ms by {method}, longest fio completion {worst:.0} ms over {runs} verified runs",
            h["took_ms"]
        ));
    }
    let kernel = vm.s.get("/v1/host").await.body["kernel"].clone();
    eprintln!(
        "upgrade on {kernel}: 4 volumes in {took:?}\n  {}",
        stalls.join("\n  ")
    );
    let kinds = vm.event_kinds(&vols[0].1).await;
    assert!(kinds.iter().any(|k| k == "worker_handed_over"), "{kinds:?}");
}

/// With build B at the path but the service still on A, a killed worker's
/// replacement runs A, from the file the service started from, not B.
#[tokio::test(flavor = "multi_thread")]
async fn a_replacement_worker_runs_the_services_build_not_the_file_at_its_path() {
    let dir = bin_dir();
    let path = dir.path().join("blockplane");
    let old = copy_as_build(Path::new(bin()), &path, None);
    let vm = Vm::start_from(path.clone()).await;
    vm.image("rb", Scratch::Xfs, 16, "full").await;
    let v = vm
        .volume(json!({"name": "rb", "image": "rb", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let (id, dev) = (v["id"].as_str().unwrap(), v["device"].as_str().unwrap());
    let staged = dir.path().join("blockplane.new");
    let new = copy_as_build(&path, &staged, Some("not-the-service"));
    install(&staged, &path);
    let host = vm.s.get("/v1/host").await.body;
    assert_eq!(host["build"]["executable_replaced"], true, "{host}");
    assert_eq!(host["build"]["executable_version"], new.as_str(), "{host}");
    let pid = worker_pid(&vm, id);
    sh("kill", &["-9", &pid.to_string()]);
    eventually(
        Duration::from_secs(60),
        "a replacement worker",
        async || {
            let v = vm.s.get("/v1/volumes/rb").await.body;
            v["worker_pid"].as_u64().is_some_and(|p| p != pid) && v["state"] == "attached"
        },
    )
    .await;
    let v = vm.s.get("/v1/volumes/rb").await.body;
    assert_eq!(
        v["worker_version"],
        old.as_str(),
        "the replacement runs the file now at the path: {v}"
    );
    assert_eq!(v["worker_older"], false, "{v}");
    let replacement = v["worker_pid"].as_u64().unwrap();
    assert_eq!(
        exe_of(replacement),
        format!("{} (deleted)", path.display()),
        "the replacement was started from the path"
    );
    crate::direct_write_ok(dev);
}

/// A handover whose old worker is SIGKILLed while it lets go still ends on a
/// new worker; one whose new worker cannot start is called off with the old
/// worker serving on; one whose new worker fails once the old one let go
/// leaves the device served by a restarted worker. Both failures say so
/// (500 and an event); the device, its data and fio verify come through all
/// three, with no I/O error.
#[tokio::test(flavor = "multi_thread")]
async fn a_handover_survives_its_old_worker_killed_and_a_new_worker_that_fails() {
    let mut vm = Vm::start().await;
    vm.image("hf", Scratch::Xfs, 24, "full").await;
    let v = vm
        .volume(json!({"name": "hf", "image": "hf", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let (id, dev) = (
        v["id"].as_str().unwrap().to_string(),
        v["device"].as_str().unwrap().to_string(),
    );
    let num = devnum(&dev);
    let load = Load::start(&dev);
    writes_flow(&dev, 1 << 20).await;

    // The old worker killed while it lets go (it pauses 3 s before exiting).
    vm.s.kill();
    vm.start_with_fault("slow_handover").await;
    let old = worker_pid(&vm, &id);
    let log = vm.s.data.join(format!("run/ublk/{id}/worker.log"));
    let sock = vm.s.sock.clone();
    let asked = tokio::spawn(async move {
        blockplane_client::Transport::new(blockplane_client::Endpoint::Unix(sock), None)
            .send(hyper::Method::POST, "/v1/volumes/hf/handover", None)
            .await
            .unwrap()
    });
    eventually(
        Duration::from_secs(60),
        "the old worker letting go",
        async || {
            std::fs::read_to_string(&log).is_ok_and(|l| l.contains("device let go for a successor"))
        },
    )
    .await;
    sh("kill", &["-9", &old.to_string()]);
    let a = asked.await.unwrap();
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    assert_eq!(a.body["previous_worker_pid"], old, "{}", a.body);
    let now = worker_pid(&vm, &id);
    assert_ne!(now, old);
    assert_eq!(devnum(&dev), num);
    writes_flow(&dev, 1 << 20).await;

    // The new worker refuses its spec and exits: the old one serves on.
    vm.s.kill();
    vm.start_with_fault("fail_handover_start").await;
    let restarts = vm.s.get("/v1/volumes/hf/stats").await.body["worker_restarts"]
        .as_u64()
        .unwrap();
    let a = vm.s.post("/v1/volumes/hf/handover", json!(null)).await;
    assert_eq!(a.status.as_u16(), 500, "{}", a.body);
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("called off")
            && msg.contains(&format!("worker {now} ("))
            && msg.contains("serves on"),
        "{msg}"
    );
    failed_handovers(&vm, &id, 1).await;
    assert_eq!(worker_pid(&vm, &id), now, "the old worker was replaced");
    let stats = vm.s.get("/v1/volumes/hf/stats").await.body;
    assert_eq!(stats["worker_restarts"], restarts, "{stats}");
    writes_flow(&dev, 1 << 20).await;

    // The new worker fails once the old one let go: a restarted one serves.
    vm.s.kill();
    vm.start_with_fault("fail_handover_recovery").await;
    let a = vm.s.post("/v1/volumes/hf/handover", json!(null)).await;
    assert_eq!(a.status.as_u16(), 500, "{}", a.body);
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("failed after it let go") && msg.contains("recovered the device"),
        "{msg}"
    );
    failed_handovers(&vm, &id, 2).await;
    let v = vm.s.get("/v1/volumes/hf").await.body;
    assert_eq!(v["state"], "attached", "{v}");
    assert_eq!(devnum(&dev), num);
    assert_ne!(worker_pid(&vm, &id), now);
    writes_flow(&dev, 1 << 20).await;
    let (worst, runs) = load.finish();
    let stats = vm.s.get("/v1/volumes/hf/stats").await.body;
    assert_eq!(stats["write"]["errors"], 0, "{stats}");
    assert_eq!(stats["read"]["errors"], 0, "{stats}");
    assert_eq!(stats["worker_restarts"], restarts + 1, "{stats}");
    eprintln!("killed and failed handovers: longest fio completion {worst:.0} ms over {runs} runs");
}

/// Waits until volume `id` has `n` `worker_handover_failed` events (each is
/// recorded once the volume's lock is free again).
async fn failed_handovers(vm: &Vm, id: &str, n: usize) {
    eventually(
        Duration::from_secs(30),
        &format!("{n} worker_handover_failed event(s)"),
        async || {
            vm.event_kinds(id)
                .await
                .iter()
                .filter(|k| *k == "worker_handover_failed")
                .count()
                == n
        },
    )
    .await;
}

/// A handover waits for an allocate of the volume's image: 409, nothing
/// changed.
#[tokio::test(flavor = "multi_thread")]
async fn a_handover_is_refused_while_an_allocate_runs() {
    let vm = Vm::start_with_env(&[("BLOCKPLANE_TEST_FAULT", "slow_allocate")]).await;
    vm.image("ha", Scratch::Xfs, 64, "sparse").await;
    let v = vm
        .volume(json!({"name": "ha", "image": "ha", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let pid = v["worker_pid"].as_u64().unwrap();
    let a = vm.s.post("/v1/images/ha/allocate", json!(null)).await;
    assert_eq!(a.status.as_u16(), 202, "{}", a.body);
    let a = vm.s.post("/v1/volumes/ha/handover", json!(null)).await;
    crate::harness::assert_error(&a, 409, "allocate_conflict");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("have volume 'ha' handed over to a new worker"),
        "{msg}"
    );
    let v = vm.s.get("/v1/volumes/ha").await.body;
    assert_eq!(v["worker_pid"], pid, "{v}");
    let kinds = vm.event_kinds(v["id"].as_str().unwrap()).await;
    assert!(!kinds.iter().any(|k| k.contains("handed")), "{kinds:?}");
}
