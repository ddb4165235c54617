//! Volumes that leave their host: host A exports its volumes over NVMe/TCP,
//! host B connects them as remote volumes and writes them under fio verify
//! through every live change and fault A's volumes survive. The two hosts
//! are two services of the VM, A in a network namespace of its own, joined
//! to B by a veth pair the test makes.

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::controlplane::Pod;
use crate::harness::{Opts, Service};
use crate::{Scratch, Vm, eventually, fio_ok, fio_verify, sh, writes_flow};
use blockplane_test_support::hosts::{A_IP, Hosts};

/// What a failed test leaves of the two hosts' NVMe/TCP, undone before the
/// services go: B's controllers deleted (their queued I/O fails, so no fio
/// waits on a device whose server is gone), then A's subsystems, ports and
/// hosts. Nothing is left after a passing test, so it finds nothing then.
pub(crate) struct Leftovers;

impl Drop for Leftovers {
    fn drop(&mut self) {
        const PREFIX: &str = "nqn.2026-12.dev.blockplane:";
        let names = |dir: &str| -> Vec<std::path::PathBuf> {
            std::fs::read_dir(dir)
                .map(|d| d.flatten().map(|e| e.path()).collect())
                .unwrap_or_default()
        };
        for ctrl in names("/sys/class/nvme") {
            let nqn = std::fs::read_to_string(ctrl.join("subsysnqn")).unwrap_or_default();
            if nqn.starts_with(PREFIX) {
                let _ = std::fs::write(ctrl.join("delete_controller"), "1");
            }
        }
        let listed = Command::new("dmsetup")
            .arg("ls")
            .env("DM_DISABLE_UDEV", "1")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for name in listed.lines().filter_map(|l| l.split_whitespace().next()) {
            if name.starts_with("blockplane-remote-") {
                let _ = Command::new("dmsetup")
                    .args(["remove", "--force", name])
                    .env("DM_DISABLE_UDEV", "1")
                    .status();
            }
        }
        let root = "/sys/kernel/config/nvmet";
        for port in names(&format!("{root}/ports")) {
            for link in names(&port.join("subsystems").display().to_string()) {
                let _ = std::fs::remove_file(link);
            }
            let _ = std::fs::remove_dir(port);
        }
        for sub in names(&format!("{root}/subsystems")) {
            if !sub
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(PREFIX)
            {
                continue;
            }
            let _ = std::fs::write(sub.join("namespaces/1/enable"), "0");
            let _ = std::fs::remove_dir(sub.join("namespaces/1"));
            for link in names(&sub.join("allowed_hosts").display().to_string()) {
                let _ = std::fs::remove_file(link);
            }
            let _ = std::fs::remove_dir(sub);
        }
        for host in names(&format!("{root}/hosts")) {
            let _ = std::fs::remove_dir(host);
        }
    }
}

/// Starts B: a service with no images, in the VM's own namespace.
async fn consumer() -> Service {
    Service::start_with(Opts::default()).await
}

async fn host_nqn(s: &Service) -> String {
    let host = s.get("/v1/host").await.body;
    host["fabric"]["host_nqn"].as_str().unwrap().to_string()
}

/// One volume of A for each way A serves one.
struct Kind {
    name: &'static str,
    body: Value,
}

fn kinds() -> Vec<Kind> {
    let v = |name: &'static str, backend: &str, dispatch: &str| Kind {
        name,
        body: json!({"name": name, "image": name, "backend": backend, "dispatch": dispatch}),
    };
    vec![
        v("x-loop", "loop", "auto"),
        v("x-unowait", "ublk", "nowait"),
        v("x-udirect", "ublk", "direct"),
        v("x-ddirect", "dm", "direct"),
        v("x-dkernel", "dm", "kernel"),
        Kind {
            name: "x-crypt",
            body: json!({"name": "x-crypt", "image": "x-crypt", "backend": "ublk",
                         "dispatch": "nowait", "key": "vm-export-key"}),
        },
    ]
}

/// A volume of A, exported to B and connected there.
struct Remote {
    name: &'static str,
    /// B's device.
    device: String,
}

/// Makes `kind`'s image and volume on A, exports it to `b_nqn`, and
/// connects it on B.
async fn export_and_connect(a: &Vm, b: &Service, b_nqn: &str, kind: &Kind) -> Remote {
    let create = match kind.name {
        "x-crypt" => json!({"size_bytes": 40u64 << 20, "allocation": "full",
                            "encryption": {"key": "vm-export-key"}}),
        _ => json!({"size_bytes": 40u64 << 20, "allocation": "full"}),
    };
    let path = a.root(Scratch::Xfs).join(format!("{}.img", kind.name));
    let img =
        a.s.post(
            "/v1/images",
            json!({"name": kind.name, "path": path, "create": create}),
        )
        .await;
    assert_eq!(img.status.as_u16(), 201, "{}", img.body);
    let v = a.volume(kind.body.clone()).await;
    let export =
        a.s.put(
            &format!("/v1/volumes/{}/export", kind.name),
            json!({"hosts": [b_nqn]}),
        )
        .await;
    assert_eq!(export.status.as_u16(), 200, "{}", export.body);
    assert_eq!(export.body["state"], "serving", "{}", export.body);
    let host = &export.body["hosts"][0];
    let remote = b
        .post(
            "/v1/remotes",
            json!({"name": kind.name, "address": format!("{A_IP}:4420"),
                   "nqn": export.body["nqn"], "secret": host["secret"],
                   "ctrl_secret": host["ctrl_secret"]}),
        )
        .await;
    assert_eq!(remote.status.as_u16(), 201, "{}", remote.body);
    assert_eq!(remote.body["state"], "attached", "{}", remote.body);
    assert_eq!(
        remote.body["size_bytes"], v["size_bytes"],
        "{}",
        remote.body
    );
    Remote {
        name: kind.name,
        device: remote.body["device"].as_str().unwrap().to_string(),
    }
}

/// What happens on A to `name` while B writes it.
async fn live_change(a: &Vm, name: &str) {
    let path = format!("/v1/volumes/{name}");
    match name {
        "x-unowait" => {
            a.set_dispatch(name, "direct").await;
        }
        "x-crypt" => {
            a.set_dispatch(name, "threaded").await;
        }
        "x-ddirect" => {
            a.set_dispatch(name, "kernel").await;
        }
        "x-udirect" => {
            let h = a.s.post(&format!("{path}/handover"), json!({})).await;
            assert_eq!(h.status.as_u16(), 200, "{}", h.body);
        }
        "x-dkernel" => {
            let r =
                a.s.post(
                    &format!("/v1/images/{name}/resize"),
                    json!({"size_bytes": 48u64 << 20}),
                )
                .await;
            assert_eq!(r.status.as_u16(), 200, "{}", r.body);
        }
        _ => {}
    }
}

/// The two hosts of a test: A serving exports from its own namespace, B
/// consuming them, and B's host NQN.
struct TwoHosts {
    // Dropped in this order: a failure undoes the NVMe/TCP state before
    // the services' own clean-up runs, and the namespace goes last.
    _leftovers: Leftovers,
    a: Vm,
    b: Service,
    b_nqn: String,
    hosts: Hosts,
}

impl TwoHosts {
    async fn start() -> Self {
        let hosts = Hosts::new();
        let export_arg = format!("{A_IP}:4420");
        let a = Vm::start_in(&hosts.a, &["--export-address", &export_arg]).await;
        let b = consumer().await;
        let b_nqn = host_nqn(&b).await;
        Self {
            _leftovers: Leftovers,
            a,
            b,
            b_nqn,
            hosts,
        }
    }

    /// Teardown in order: B disconnects everything; then A, whose kernel
    /// cannot say which export a connection is to, sees none and unexports.
    async fn tear_down(self, remotes: &[Remote]) {
        let Self {
            a, mut b, hosts, ..
        } = self;
        for r in remotes {
            let d = b.delete(&format!("/v1/remotes/{}", r.name)).await;
            assert_eq!(d.status.as_u16(), 204, "{}: {}", r.name, d.body);
        }
        for r in remotes {
            let e =
                a.s.get(&format!("/v1/volumes/{}/export", r.name))
                    .await
                    .body;
            assert_eq!(e["hosts"][0]["connected"], false, "{}: {e}", r.name);
            let d = a.s.delete(&format!("/v1/volumes/{}/export", r.name)).await;
            assert_eq!(d.status.as_u16(), 204, "{}: {}", r.name, d.body);
            a.delete(r.name).await;
        }
        b.stop_and_clean();
        drop(a);
        drop(hosts);
    }
}

/// A's volumes, one of each kind, each exported to B and written there by
/// fio verify across a live change on A (a switch, a handover, a grow).
/// What differs between kernels is here: nvmet serving each kind of node,
/// and each change under it. The hosts' kills, key rotation and refusals,
/// the control plane's logic over that, are the next test's, on one kernel.
#[tokio::test(flavor = "multi_thread")]
async fn a_volume_of_each_kind_serves_another_host_under_fio_verify() {
    let two = TwoHosts::start().await;
    let (a, b) = (&two.a, &two.b);
    let mut remotes = Vec::new();
    for kind in kinds() {
        let r = export_and_connect(a, b, &two.b_nqn, &kind).await;
        // Short: the assertion is that the writes across the change verify.
        let fio = fio_verify(&r.device, "8M", &[]);
        writes_flow(&r.device, 1 << 20).await;
        live_change(a, kind.name).await;
        fio_ok(fio);
        remotes.push(r);
    }
    // The grow reached B: its remote volume (and the dm node) is 48 MiB.
    eventually(
        Duration::from_secs(60),
        "B to see x-dkernel grown",
        async || b.get("/v1/remotes/x-dkernel").await.body["size_bytes"] == json!(48u64 << 20),
    )
    .await;
    two.tear_down(&remotes).await;
}

/// A's whole pod killed and B's service killed under B's fio verify, each
/// restarted and reconciled onto the same devices; B's key rotated on A;
/// and what each host refuses. Four kinds: a kernel loop, a ublk worker to
/// adopt, a dm table, and an encrypted volume whose key A's restart unlocks.
#[tokio::test(flavor = "multi_thread")]
async fn either_host_killed_under_fio_is_adopted_and_keys_rotate_and_refusals_hold() {
    let mut two = TwoHosts::start().await;
    let mut remotes = Vec::new();
    for kind in kinds()
        .into_iter()
        .filter(|k| ["x-loop", "x-unowait", "x-dkernel", "x-crypt"].contains(&k.name))
    {
        remotes.push(export_and_connect(&two.a, &two.b, &two.b_nqn, &kind).await);
    }

    // A's whole pod dies under B's writes; a new A adopts its exports.
    let pod = Pod::new();
    pod.enter(two.a.s.pid());
    let fios: Vec<_> = remotes
        .iter()
        .map(|r| fio_verify(&r.device, "8M", &["--rate_iops=300"]))
        .collect();
    for r in &remotes {
        writes_flow(&r.device, 256 << 10).await;
    }
    pod.kill().await;
    let _ = two.a.s.wait_exit(Duration::from_secs(10));
    two.a.s.restart().await;
    for fio in fios {
        fio_ok(fio);
    }
    for r in &remotes {
        let e = two.a.s.get(&format!("/v1/volumes/{}/export", r.name)).await;
        assert_eq!(e.body["state"], "serving", "{}: {}", r.name, e.body);
    }

    // B's service dies under its writes: the kernel keeps the connections,
    // and a new B adopts them on the same devices.
    let fios: Vec<_> = remotes
        .iter()
        .map(|r| fio_verify(&r.device, "8M", &[]))
        .collect();
    for r in &remotes {
        writes_flow(&r.device, 256 << 10).await;
    }
    two.b.kill();
    two.b.restart().await;
    for fio in fios {
        fio_ok(fio);
    }
    for r in &remotes {
        let got = two.b.get(&format!("/v1/remotes/{}", r.name)).await.body;
        assert_eq!(got["state"], "attached", "{}: {got}", r.name);
        assert_eq!(got["device"], r.device.as_str(), "{}: {got}", r.name);
    }

    rotate_b_key(&two.a, &two.b, &two.b_nqn, &remotes).await;
    refusals(&two.a, &two.b, &two.b_nqn).await;
    two.tear_down(&remotes).await;
}

/// B's key rotated on A, for every export: B's connections take it live,
/// and one reconnected (its controller reset) authenticates with it and
/// verifies under fio.
async fn rotate_b_key(a: &Vm, b: &Service, b_nqn: &str, remotes: &[Remote]) {
    let keys =
        a.s.post(&format!("/v1/export-hosts/{b_nqn}/rotate"), json!({}))
            .await;
    assert_eq!(keys.status.as_u16(), 200, "{}", keys.body);
    assert_eq!(
        keys.body["exports"].as_array().unwrap().len(),
        remotes.len(),
        "{}",
        keys.body
    );
    for r in remotes {
        let p = b
            .patch(
                &format!("/v1/remotes/{}", r.name),
                json!({"secret": keys.body["secret"]}),
            )
            .await;
        assert_eq!(p.status.as_u16(), 200, "{}: {}", r.name, p.body);
        assert_eq!(p.body["state"], "attached", "{}: {}", r.name, p.body);
    }
    let nqn = a.s.get("/v1/volumes/x-loop/export").await.body["nqn"]
        .as_str()
        .unwrap()
        .to_string();
    let ctrl = std::fs::read_dir("/sys/class/nvme")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|c| std::fs::read_to_string(c.join("subsysnqn")).is_ok_and(|n| n.trim() == nqn))
        .expect("B's controller of x-loop");
    std::fs::write(ctrl.join("reset_controller"), "1").unwrap();
    eventually(
        Duration::from_secs(60),
        "x-loop's controller live again",
        async || std::fs::read_to_string(ctrl.join("state")).is_ok_and(|s| s.trim() == "live"),
    )
    .await;
    let dev = &remotes.iter().find(|r| r.name == "x-loop").unwrap().device;
    fio_ok(fio_verify(dev, "4M", &[]));
}

/// What A and B refuse, each changing nothing.
async fn refusals(a: &Vm, b: &Service, b_nqn: &str) {
    // A volume with an export, or an export with a host connected.
    let d = a.s.delete("/v1/volumes/x-loop").await;
    assert_eq!(d.status.as_u16(), 409, "{}", d.body);
    assert_eq!(d.body["error"]["code"], "volume_exported", "{}", d.body);
    let d = a.s.delete("/v1/volumes/x-loop/export").await;
    assert_eq!(d.status.as_u16(), 409, "{}", d.body);
    assert_eq!(d.body["error"]["code"], "host_connected", "{}", d.body);

    // A host the export does not list, then a listed host with a key that
    // is not its own: each refused by A's kernel, nothing left on B.
    const OTHER: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001";
    let path = a.root(Scratch::Xfs).join("x-other.img");
    let img =
        a.s.post(
            "/v1/images",
            json!({"name": "x-other", "path": path,
                                    "create": {"size_bytes": 8u64 << 20}}),
        )
        .await;
    assert_eq!(img.status.as_u16(), 201, "{}", img.body);
    a.volume(json!({"name": "x-other", "image": "x-other", "backend": "loop"}))
        .await;
    let other =
        a.s.put("/v1/volumes/x-other/export", json!({"hosts": [OTHER]}))
            .await
            .body;
    let connect = |secret: &Value| {
        json!({"name": "x-other", "address": format!("{A_IP}:4420"), "nqn": other["nqn"],
               "secret": secret, "ctrl_secret": other["hosts"][0]["ctrl_secret"]})
    };
    let r = b
        .post("/v1/remotes", connect(&other["hosts"][0]["secret"]))
        .await;
    assert_eq!(r.status.as_u16(), 403, "unlisted host: {}", r.body);
    assert_eq!(r.body["error"]["code"], "remote_refused", "{}", r.body);
    let both =
        a.s.put(
            "/v1/volumes/x-other/export",
            json!({"hosts": [b_nqn, OTHER]}),
        )
        .await
        .body;
    let others_key = both["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["host_nqn"] == OTHER)
        .unwrap()["secret"]
        .clone();
    let r = b.post("/v1/remotes", connect(&others_key)).await;
    assert_eq!(r.status.as_u16(), 403, "wrong key: {}", r.body);
    assert_eq!(r.body["error"]["code"], "remote_refused", "{}", r.body);
    assert!(
        !r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("DHHC-1"),
        "{}",
        r.body
    );
    let r = b.get("/v1/remotes/x-other").await;
    assert_eq!(r.status.as_u16(), 404, "{}", r.body);
    // B is connected to A's other exports, and A's kernel does not say to
    // which: only a forced removal goes.
    let d = a.s.delete("/v1/volumes/x-other/export").await;
    assert_eq!(d.status.as_u16(), 409, "{}", d.body);
    let d = a.s.delete("/v1/volumes/x-other/export?force=true").await;
    assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    a.delete("x-other").await;

    // What only A decides, refused on B with where to ask.
    let p = b
        .patch("/v1/remotes/x-loop", json!({"dispatch": "direct"}))
        .await;
    assert_eq!(p.status.as_u16(), 422, "{}", p.body);
    assert_eq!(p.body["error"]["code"], "not_for_remote", "{}", p.body);
    // An open device is not disconnected.
    let dev = b.get("/v1/remotes/x-loop").await.body["device"]
        .as_str()
        .unwrap()
        .to_string();
    let holder = std::fs::File::open(&dev).unwrap();
    let d = b.delete("/v1/remotes/x-loop").await;
    assert_eq!(d.status.as_u16(), 409, "{}", d.body);
    drop(holder);
}

/// One fio run's figures, and the CPU the guest spent meanwhile.
struct Run {
    iops: f64,
    /// Completion latency percentiles, µs: p50 and p99.
    p50_us: f64,
    p99_us: f64,
    /// Guest CPU (every process and the kernel's workers), µs per request.
    cpu_us: f64,
    /// CPU of blockplane's own processes per request, µs: A's service and
    /// worker, B's service.
    own_us: f64,
}

/// CPU time of the whole guest, in clock ticks (`/proc/stat`, every field
/// but idle and iowait).
fn busy_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let cpu: Vec<u64> = stat.lines().next().unwrap()[3..]
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    cpu.iter().sum::<u64>() - cpu[3] - cpu[4]
}

/// CPU time of processes, in clock ticks (utime + stime of each).
fn ticks_of(pids: &[u32]) -> u64 {
    pids.iter()
        .map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
            let f: Vec<&str> = after.split_whitespace().collect();
            f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
                + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
        })
        .sum()
}

/// fio 4k random 70/30 read/write on `dev` for `secs`: `psync` (one
/// request at a time) or io_uring at iodepth 16.
fn measure(dev: &str, engine: &str, secs: u32, pids: &[u32]) -> Run {
    let (busy, own) = (busy_ticks(), ticks_of(pids));
    let depth = if engine == "psync" { "1" } else { "16" };
    let out = Command::new("fio")
        .args([
            "--name=cost",
            "--filename",
            dev,
            "--rw=randrw",
            "--rwmixread=70",
            "--bs=4k",
        ])
        .args([
            "--direct=1",
            "--size=48M",
            "--time_based",
            "--output-format=json",
        ])
        .arg(format!("--ioengine={engine}"))
        .arg(format!("--iodepth={depth}"))
        .arg(format!("--runtime={secs}"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (busy, own) = (busy_ticks() - busy, ticks_of(pids) - own);
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let job = &json["jobs"][0];
    let ios =
        job["read"]["total_ios"].as_f64().unwrap() + job["write"]["total_ios"].as_f64().unwrap();
    let pct = |p: &str| {
        let r = job["read"]["clat_ns"]["percentile"][p]
            .as_f64()
            .unwrap_or(0.0);
        r / 1000.0
    };
    // Clock ticks are 1/100 s (USER_HZ) on Debian's kernels.
    let tick_us = 1e6 / 100.0;
    Run {
        iops: ios / f64::from(secs),
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        cpu_us: busy as f64 * tick_us / ios,
        own_us: own as f64 * tick_us / ios,
    }
}

/// The pid of a ublk volume's worker, from its run dir.
fn worker_pid(vm: &Vm, volume_id: &str) -> u32 {
    let state = vm.s.data.join(format!("run/ublk/{volume_id}/state.json"));
    let state: Value = serde_json::from_slice(&std::fs::read(state).unwrap()).unwrap();
    state["pid"].as_u64().unwrap() as u32
}

/// The cost of the network path (not a test: `tests/vm/export-bench.sh`):
/// one ublk `nowait` volume of A, written by fio 4k randrw (70% reads) on
/// A's own device, then on B's remote device over NVMe/TCP, one request at
/// a time (psync) and at iodepth 16 (io_uring); prints IOPS, read latency
/// and CPU per request of each, and remote over local as ratios. Both
/// hosts share the guest's two vCPUs, so the guest's CPU per request is
/// the cost of both ends together.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: tests/vm/export-bench.sh"]
async fn network_path_cost_benchmark() {
    let secs: u32 = std::env::var("BLOCKPLANE_BENCH_SECS")
        .map(|s| s.parse().expect("BLOCKPLANE_BENCH_SECS is a number"))
        .unwrap_or(20);
    let bin = std::env::var_os("BLOCKPLANE_BENCH_BIN").map(std::path::PathBuf::from);
    let build = if bin.is_some() { "release" } else { "debug" };
    let hosts = Hosts::new();
    let export_arg = format!("{A_IP}:4420");
    let a = Vm::start_in_from(&hosts.a, &["--export-address", &export_arg], bin.clone()).await;
    let b = Service::start_with(Opts {
        bin,
        ..Default::default()
    })
    .await;
    let _leftovers = Leftovers;
    let b_nqn = host_nqn(&b).await;
    let kind = Kind {
        name: "x-bench",
        body: json!({"name": "x-bench", "image": "x-bench", "backend": "ublk", "dispatch": "nowait"}),
    };
    let remote = export_and_connect(&a, &b, &b_nqn, &kind).await;
    let local = a.s.get("/v1/volumes/x-bench").await.body;
    let local_dev = local["device"].as_str().unwrap().to_string();
    let pids = [
        a.s.pid(),
        worker_pid(&a, local["id"].as_str().unwrap()),
        b.pid(),
    ];
    println!(
        "network path cost, {build} build, {secs} s per run, kernel {}",
        sh("uname", &["-r"]).trim()
    );
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "run", "IOPS", "p50 µs", "p99 µs", "CPU µs/req", "ours µs/req"
    );
    for engine in ["psync", "io_uring"] {
        let l = measure(&local_dev, engine, secs, &pids);
        let r = measure(&remote.device, engine, secs, &pids);
        for (what, run) in [("local", &l), ("remote", &r)] {
            println!(
                "{:<22} {:>9.0} {:>9.0} {:>9.0} {:>11.1} {:>11.1}",
                format!("{engine} {what}"),
                run.iops,
                run.p50_us,
                run.p99_us,
                run.cpu_us,
                run.own_us
            );
        }
        println!(
            "{:<22} {:>9.2} {:>9.2} {:>9.2} {:>11.2} {:>11.2}",
            format!("{engine} remote/local"),
            r.iops / l.iops,
            r.p50_us / l.p50_us,
            r.p99_us / l.p99_us,
            r.cpu_us / l.cpu_us,
            r.own_us / l.own_us.max(f64::MIN_POSITIVE)
        );
    }
    assert_eq!(b.delete("/v1/remotes/x-bench").await.status.as_u16(), 204);
    assert_eq!(
        a.s.delete("/v1/volumes/x-bench/export")
            .await
            .status
            .as_u16(),
        204
    );
    a.delete("x-bench").await;
}
