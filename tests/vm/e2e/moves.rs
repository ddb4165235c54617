//! Moves: a volume of host A, served on host B remotely, becomes local to
//! B while B's consumer writes it under fio verify, on the kernel's own
//! mirror (dm-raid raid1), its device node the same throughout. The two
//! hosts are two services of the VM as in `exports`: A in a network
//! namespace of its own, its API on the veth pair so that B can tell it to
//! let go.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::exports::Leftovers;
use crate::{Scratch, Vm, dmsetup, eventually, fio_ok, fio_verify, writes_flow};
use blockplane_test_support::hosts::{A_IP, Hosts};

const TOKEN: &str = "vm-moves-shared-token";

/// A copy slow enough (6 min for a 24 MiB volume) that the faults a test
/// makes happen mid-copy; the test lifts it to let the move end.
const SLOW: u64 = 64 << 10;

/// fio verify runs on `device`, one short job after another, until told to
/// stop: the consumer writes through every step of a move, whatever its
/// length. Each job's result, with its longest write latency.
struct Consumer {
    stop: Arc<AtomicBool>,
    runs: std::thread::JoinHandle<Vec<String>>,
}

impl Consumer {
    fn start(device: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, device) = (stop.clone(), device.to_string());
        let runs = std::thread::spawn(move || {
            let mut out = Vec::new();
            while !flag.load(Ordering::Relaxed) || out.is_empty() {
                // Short: each job's assertion is that its writes verify.
                out.push(fio_ok(fio_verify(&device, "4M", &["--rate_iops=500"])));
            }
            out
        });
        Self { stop, runs }
    }

    /// Stops after the job running now; every job passed. The longest
    /// write completion latency any job saw, in ms.
    fn finish(self) -> (usize, f64) {
        self.stop.store(true, Ordering::Relaxed);
        let runs = self.runs.join().expect("a fio job failed");
        let longest = runs
            .iter()
            .filter_map(|r| max_write_ms(r))
            .fold(0.0, f64::max);
        (runs.len(), longest)
    }
}

/// The `clat` maximum of fio's write section, in ms.
fn max_write_ms(report: &str) -> Option<f64> {
    let write = &report[report.find("write:")?..];
    let line = write
        .lines()
        .find(|l| l.trim_start().starts_with("clat ("))?;
    let unit = if line.contains("(nsec)") {
        1e-6
    } else if line.contains("(usec)") {
        1e-3
    } else {
        1.0
    };
    let max = line.split("max=").nth(1)?.split(',').next()?.trim();
    let (num, k) = match max.strip_suffix('k') {
        Some(n) => (n, 1e3),
        None => (max, 1.0),
    };
    Some(num.parse::<f64>().ok()? * k * unit)
}

/// `major:minor` of the node `device` names.
fn dev_of(device: &str) -> u64 {
    std::fs::metadata(device).unwrap().rdev()
}

/// The two hosts' services, sharing the bearer token moves call with: A in
/// its namespace, exporting on and answering at its veth address; B in the
/// VM's own, with `b_roots` as image roots beside the scratch ones. B's
/// host NQN.
async fn two_hosts(hosts: &Hosts, b_roots: Vec<std::path::PathBuf>) -> (Vm, Vm, String) {
    let export_arg = format!("{A_IP}:4420");
    let listen = format!("{A_IP}:7400");
    let a = Vm::start_guarded(
        Some(&hosts.a),
        &["--export-address", &export_arg, "--listen", &listen],
        TOKEN,
        Vec::new(),
    )
    .await;
    let b = Vm::start_guarded(None, &[], TOKEN, b_roots).await;
    let b_nqn = b.s.get("/v1/host").await.body["fabric"]["host_nqn"]
        .as_str()
        .unwrap()
        .to_string();
    (a, b, b_nqn)
}

/// A's volume `name` (`body` its spec) on a fresh image (unless the test
/// made it), exported to B and connected there; B's device.
async fn served_on_b(a: &Vm, b: &Vm, b_nqn: &str, name: &str, body: Value) -> String {
    if a.s.get(&format!("/v1/images/{name}")).await.status.as_u16() == 404 {
        a.image(name, Scratch::Xfs, 24, "full").await;
    }
    a.volume(body).await;
    let export =
        a.s.put(
            &format!("/v1/volumes/{name}/export"),
            json!({"hosts": [b_nqn]}),
        )
        .await;
    assert_eq!(export.status.as_u16(), 200, "{}", export.body);
    let host = &export.body["hosts"][0];
    let remote =
        b.s.post(
            "/v1/remotes",
            json!({"name": name, "address": format!("{A_IP}:4420"),
                   "nqn": export.body["nqn"], "secret": host["secret"],
                   "ctrl_secret": host["ctrl_secret"]}),
        )
        .await;
    assert_eq!(
        remote.status.as_u16(),
        201,
        "{}\nthe kernel's last words on NVMe:\n{}",
        remote.body,
        kernel_nvme_log()
    );
    remote.body["device"].as_str().unwrap().to_string()
}

/// The kernel log's last NVMe lines: what a connect that failed leaves to
/// read.
fn kernel_nvme_log() -> String {
    let log = crate::sh("dmesg", &[]);
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("nvme")).collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Starts the move of remote volume `name` into B's xfs root.
async fn start_move(b: &Vm, name: &str, rate: u64) -> Value {
    start_move_to(b, name, &b.root(Scratch::Xfs), rate).await
}

/// The request of a move of remote volume `name` into directory `dir` of B.
fn move_request(name: &str, dir: &std::path::Path, rate: u64) -> Value {
    json!({"image": name, "path": dir.join(format!("{name}.img")),
           "source_api": format!("http://{A_IP}:7400"), "rate_limit_bytes_per_sec": rate})
}

/// Starts the move of remote volume `name` into directory `dir` of B.
async fn start_move_to(b: &Vm, name: &str, dir: &std::path::Path, rate: u64) -> Value {
    let m =
        b.s.post(
            &format!("/v1/remotes/{name}/move"),
            move_request(name, dir, rate),
        )
        .await;
    assert_eq!(m.status.as_u16(), 202, "{}", m.body);
    assert_eq!(m.body["state"], "syncing", "{}", m.body);
    m.body
}

async fn move_of(b: &Vm, id: &str) -> Value {
    b.s.get(&format!("/v1/moves/{id}")).await.body
}

/// A ublk volume of A moves to B under B's writes: the copy starts slow,
/// its limit is lifted live, B's service is killed mid-copy and its restart
/// adopts the mirror; the move ends `done` with the node unchanged, A's
/// export, volume and image gone. An encrypted volume moves only into an
/// image encrypted on B. A dm volume's move is cancelled mid-copy: back on
/// A, nothing lost, B's image gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_volume_moves_to_the_host_that_uses_it_under_fio_verify() {
    let hosts = Hosts::new();
    let (a, mut b, b_nqn) = two_hosts(&hosts, Vec::new()).await;
    let _leftovers = Leftovers;

    let device = served_on_b(
        &a,
        &b,
        &b_nqn,
        "m-ublk",
        json!({"name": "m-ublk", "image": "m-ublk", "backend": "ublk", "dispatch": "nowait"}),
    )
    .await;
    let node = dev_of(&device);
    let consumer = Consumer::start(&device);
    writes_flow(&device, 1 << 20).await;
    let m = start_move(&b, "m-ublk", SLOW).await;
    let id = m["id"].as_str().unwrap().to_string();
    eventually(Duration::from_secs(120), "the copy to start", async || {
        move_of(&b, &id).await["synced_bytes"].as_u64() > Some(0)
    })
    .await;

    // A shows the move with its export, as B said it.
    eventually(Duration::from_secs(60), "A to show the move", async || {
        let e = a.s.get("/v1/volumes/m-ublk/export").await.body;
        e["moving"]["state"] == "syncing" && e["moving"]["host_nqn"] == b_nqn.as_str()
    })
    .await;

    // B's service dies mid-copy: the kernel's mirror runs on, and the
    // restart follows it.
    b.s.kill();
    b.s.restart().await;
    let adopted = move_of(&b, &id).await;
    assert_eq!(adopted["state"], "syncing", "{adopted}");
    let p =
        b.s.patch(
            &format!("/v1/moves/{id}"),
            json!({"rate_limit_bytes_per_sec": 0}),
        )
        .await;
    assert_eq!(p.status.as_u16(), 200, "{}", p.body);
    eventually(Duration::from_secs(300), "the move to end", async || {
        move_of(&b, &id).await["state"] != "syncing"
    })
    .await;
    eventually(
        Duration::from_secs(120),
        "the exporting host to let go",
        async || move_of(&b, &id).await["state"] != "releasing",
    )
    .await;
    let done = move_of(&b, &id).await;
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["synced_bytes"], done["total_bytes"], "{done}");
    writes_flow(&device, 1 << 20).await;
    let (jobs, longest) = consumer.finish();
    println!("m-ublk: {jobs} fio verify jobs through the move, longest write {longest:.0} ms");
    assert_eq!(dev_of(&device), node, "the consumer's node changed");

    let remote = b.s.get("/v1/remotes/m-ublk").await.body;
    assert_eq!(remote["state"], "moved", "{remote}");
    assert_eq!(remote["volume"], done["volume"], "{remote}");
    let local = b.s.get("/v1/volumes/m-ublk").await;
    assert_eq!(local.status.as_u16(), 200, "{}", local.body);
    for gone in ["/v1/volumes/m-ublk", "/v1/images/m-ublk"] {
        let r = a.s.get(gone).await;
        assert_eq!(r.status.as_u16(), 404, "{gone} on A: {}", r.body);
    }
    let kinds = b.event_kinds(done["remote"].as_str().unwrap()).await;
    for k in [
        "move_started",
        "move_syncing",
        "move_switched",
        "remote_moved",
        "move_done",
    ] {
        assert!(kinds.iter().any(|e| e == k), "no {k} event: {kinds:?}");
    }

    // An encrypted volume moves into an image encrypted here, and only so.
    let key = "vm-move-key";
    let path = a.root(Scratch::Xfs).join("m-crypt.img");
    let img =
        a.s.post(
            "/v1/images",
            json!({"name": "m-crypt", "path": path, "create": {"size_bytes": 32u64 << 20,
                   "allocation": "full", "encryption": {"key": key}}}),
        )
        .await;
    assert_eq!(img.status.as_u16(), 201, "{}", img.body);
    let device = served_on_b(
        &a,
        &b,
        &b_nqn,
        "m-crypt",
        json!({"name": "m-crypt", "image": "m-crypt", "backend": "ublk", "dispatch": "nowait",
               "key": key}),
    )
    .await;
    let node = dev_of(&device);
    let consumer = Consumer::start(&device);
    let plain =
        b.s.post(
            "/v1/remotes/m-crypt/move",
            move_request("m-crypt", &b.root(Scratch::Xfs), 0),
        )
        .await;
    assert_eq!(plain.status.as_u16(), 422, "{}", plain.body);
    assert_eq!(
        plain.body["error"]["code"], "key_required",
        "{}",
        plain.body
    );
    let mut req = move_request("m-crypt", &b.root(Scratch::Xfs), 0);
    req["key"] = json!(key);
    let m = b.s.post("/v1/remotes/m-crypt/move", req).await;
    assert_eq!(m.status.as_u16(), 202, "{}", m.body);
    let id = m.body["id"].as_str().unwrap().to_string();
    eventually(
        Duration::from_secs(300),
        "the encrypted move to end",
        async || move_of(&b, &id).await["state"] == "done",
    )
    .await;
    writes_flow(&device, 1 << 20).await;
    consumer.finish();
    assert_eq!(dev_of(&device), node, "the consumer's node changed");
    let local = b.s.get("/v1/volumes/m-crypt").await.body;
    assert_eq!(local["encrypted"], true, "{local}");

    // A second move, cancelled mid-copy: the node serves A again.
    let device = served_on_b(
        &a,
        &b,
        &b_nqn,
        "m-dm",
        json!({"name": "m-dm", "image": "m-dm", "backend": "dm", "dispatch": "direct"}),
    )
    .await;
    let node = dev_of(&device);
    let consumer = Consumer::start(&device);
    writes_flow(&device, 1 << 20).await;
    let m = start_move(&b, "m-dm", SLOW).await;
    let id = m["id"].as_str().unwrap().to_string();
    eventually(Duration::from_secs(120), "the copy to start", async || {
        move_of(&b, &id).await["synced_bytes"].as_u64() > Some(0)
    })
    .await;
    let c = b.s.post(&format!("/v1/moves/{id}/cancel"), json!({})).await;
    assert_eq!(c.status.as_u16(), 200, "{}", c.body);
    assert_eq!(c.body["state"], "cancelled", "{}", c.body);
    writes_flow(&device, 1 << 20).await;
    let (jobs, longest) = consumer.finish();
    println!(
        "m-dm: {jobs} fio verify jobs through a cancelled move, longest write {longest:.0} ms"
    );
    assert_eq!(dev_of(&device), node, "the consumer's node changed");
    let remote = b.s.get("/v1/remotes/m-dm").await.body;
    assert_eq!(remote["state"], "attached", "{remote}");
    let r = b.s.get("/v1/images/m-dm").await;
    assert_eq!(r.status.as_u16(), 404, "B's image stays: {}", r.body);
    let again = b.s.post(&format!("/v1/moves/{id}/cancel"), json!({})).await;
    assert_eq!(again.status.as_u16(), 409, "{}", again.body);
    assert_eq!(again.body["error"]["code"], "move_ended", "{}", again.body);

    // Teardown: the moved node's consumer is gone, so its remote goes and
    // the local volume stays B's; the cancelled one is disconnected and
    // A unexports.
    for name in ["m-ublk", "m-dm"] {
        let d = b.s.delete(&format!("/v1/remotes/{name}")).await;
        assert_eq!(d.status.as_u16(), 204, "{name}: {}", d.body);
    }
    let d = b.s.delete("/v1/remotes/m-crypt").await;
    assert_eq!(d.status.as_u16(), 204, "m-crypt: {}", d.body);
    b.delete("m-ublk").await;
    b.delete("m-crypt").await;
    let d = a.s.delete("/v1/volumes/m-dm/export").await;
    assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    a.delete("m-dm").await;
    b.s.stop_and_clean();
    drop(a);
    drop(hosts);
}

/// A's whole pod killed mid-copy (its service and every ublk worker, as
/// one cgroup): A's ublk device waits until A's new service recovers it,
/// B's consumer's writes wait meanwhile and then go on, and the move ends
/// `done` with every fio verify job clean and B's node the same.
#[tokio::test(flavor = "multi_thread")]
async fn a_move_waits_through_the_exporting_pod_killed_whole() {
    let hosts = Hosts::new();
    let (mut a, b, b_nqn) = two_hosts(&hosts, Vec::new()).await;
    let _leftovers = Leftovers;
    let pod = crate::controlplane::Pod::new();
    pod.enter(a.s.pid());
    let device = served_on_b(
        &a,
        &b,
        &b_nqn,
        "p-ublk",
        json!({"name": "p-ublk", "image": "p-ublk", "backend": "ublk", "dispatch": "nowait"}),
    )
    .await;
    let node = dev_of(&device);
    let consumer = Consumer::start(&device);
    writes_flow(&device, 1 << 20).await;
    let m = start_move(&b, "p-ublk", SLOW).await;
    let id = m["id"].as_str().unwrap().to_string();
    eventually(Duration::from_secs(120), "the copy to start", async || {
        move_of(&b, &id).await["synced_bytes"].as_u64() > Some(0)
    })
    .await;
    pod.kill().await;
    assert!(!a.s.wait_exit(Duration::from_secs(10)).success());
    a.s.restart().await;
    writes_flow(&device, 256 << 10).await;
    let p =
        b.s.patch(
            &format!("/v1/moves/{id}"),
            json!({"rate_limit_bytes_per_sec": 0}),
        )
        .await;
    assert_eq!(p.status.as_u16(), 200, "{}", p.body);
    eventually(Duration::from_secs(300), "the move to end", async || {
        move_of(&b, &id).await["state"] == "done"
    })
    .await;
    writes_flow(&device, 256 << 10).await;
    let (jobs, longest) = consumer.finish();
    println!(
        "p-ublk: {jobs} fio verify jobs through a move whose exporting pod was killed, longest write {longest:.0} ms"
    );
    assert_eq!(dev_of(&device), node, "the consumer's node changed");
    let r = a.s.get("/v1/volumes/p-ublk").await;
    assert_eq!(r.status.as_u16(), 404, "A's volume stays: {}", r.body);
    let d = b.s.delete("/v1/remotes/p-ublk").await;
    assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    b.delete("p-ublk").await;
    drop(b);
    drop(a);
    drop(pod);
    drop(hosts);
}

/// A volume of A's that nobody on B uses moves cold: B has A export it to
/// B, copies it, and ends with its local volume alone holding A's bytes;
/// cancelled, a cold move deletes the export it made and A's volume stays.
/// A drain of two volumes shares its limit between the copies, the whole
/// of it going to the one left when the other stops. (The kernel's part is
/// the live move's, which runs on both kernels; this runs on one.)
#[tokio::test(flavor = "multi_thread")]
async fn a_volume_nobody_uses_moves_cold_alone_or_in_a_drain() {
    let hosts = Hosts::new();
    let (a, b, _) = two_hosts(&hosts, Vec::new()).await;
    let _leftovers = Leftovers;

    // A cold move: a volume of A's that nobody on B uses comes to B. B has
    // A export it to B, connects, copies, and keeps the local volume alone.
    a.image("c-dm", Scratch::Xfs, 24, "full").await;
    let v = a
        .volume(json!({"name": "c-dm", "image": "c-dm", "backend": "dm"}))
        .await;
    let data = fill(v["device"].as_str().unwrap(), 24 << 20);
    let m = b.s.post("/v1/moves", cold_request("c-dm", &b, 0)).await;
    assert_eq!(m.status.as_u16(), 202, "{}", m.body);
    assert_eq!(m.body["cold"], "made", "{}", m.body);
    let id = m.body["id"].as_str().unwrap().to_string();
    eventually(
        Duration::from_secs(300),
        "the cold move to end and its remote volume to go",
        async || {
            move_of(&b, &id).await["state"] == "done"
                && b.s.get("/v1/remotes/c-dm").await.status.as_u16() == 404
        },
    )
    .await;
    let local = b.s.get("/v1/volumes/c-dm").await.body;
    assert!(
        read_all(local["device"].as_str().unwrap(), 24 << 20) == data,
        "B's volume holds other bytes than A's did: {local}"
    );
    let r = a.s.get("/v1/volumes/c-dm").await;
    assert_eq!(r.status.as_u16(), 404, "A's volume stays: {}", r.body);

    // A cold move cancelled: the export it made goes, A's volume stays.
    a.image("c-back", Scratch::Xfs, 24, "full").await;
    a.volume(json!({"name": "c-back", "image": "c-back", "backend": "loop"}))
        .await;
    let m =
        b.s.post("/v1/moves", cold_request("c-back", &b, SLOW))
            .await;
    assert_eq!(m.status.as_u16(), 202, "{}", m.body);
    let id = m.body["id"].as_str().unwrap().to_string();
    let c = b.s.post(&format!("/v1/moves/{id}/cancel"), json!({})).await;
    assert_eq!(c.status.as_u16(), 200, "{}", c.body);
    eventually(
        Duration::from_secs(120),
        "B's remote volume and A's export to go",
        async || {
            b.s.get("/v1/remotes/c-back").await.status.as_u16() == 404
                && a.s.get("/v1/volumes/c-back/export").await.status.as_u16() == 404
        },
    )
    .await;
    let r = a.s.get("/v1/volumes/c-back").await;
    assert_eq!(r.status.as_u16(), 200, "A's volume went: {}", r.body);
    let r = b.s.get("/v1/images/c-back").await;
    assert_eq!(r.status.as_u16(), 404, "B's image stays: {}", r.body);

    // A drain of two of A's volumes under one limit, shared: each copy
    // gets half; one cancelled, the other gets it all; lifted, it ends.
    for (name, backend) in [("d-one", "loop"), ("d-two", "dm")] {
        a.image(name, Scratch::Xfs, 24, "full").await;
        a.volume(json!({"name": name, "image": name, "backend": backend}))
            .await;
    }
    let v = a.s.get("/v1/volumes/d-two").await.body;
    let data = fill(v["device"].as_str().unwrap(), 24 << 20);
    let d =
        b.s.post(
            "/v1/drains",
            json!({"source_api": format!("http://{A_IP}:7400"), "volumes": ["d-one", "d-two"],
                   "dir": b.root(Scratch::Xfs), "rate_limit_bytes_per_sec": 2 * SLOW}),
        )
        .await;
    assert_eq!(d.status.as_u16(), 202, "{}", d.body);
    let drain = format!("/v1/drains/{}", d.body["id"].as_str().unwrap());
    let moves = d.body["moves"].as_array().unwrap().clone();
    assert_eq!(moves.len(), 2, "{}", d.body);
    for m in &moves {
        assert_eq!(m["rate_limit_bytes_per_sec"], SLOW, "{m}");
        assert_eq!(m["cold"], "made", "{m}");
    }
    let one = moves.iter().find(|m| m["image"] == "d-one").unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let two = moves.iter().find(|m| m["image"] == "d-two").unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let own =
        b.s.patch(
            &format!("/v1/moves/{two}"),
            json!({"rate_limit_bytes_per_sec": 0}),
        )
        .await;
    assert_eq!(own.status.as_u16(), 409, "{}", own.body);
    let c =
        b.s.post(&format!("/v1/moves/{one}/cancel"), json!({}))
            .await;
    assert_eq!(c.status.as_u16(), 200, "{}", c.body);
    eventually(
        Duration::from_secs(60),
        "the copying move to get the drain's whole limit",
        async || move_of(&b, &two).await["rate_limit_bytes_per_sec"] == 2 * SLOW,
    )
    .await;
    let p =
        b.s.patch(&drain, json!({"rate_limit_bytes_per_sec": 0}))
            .await;
    assert_eq!(p.status.as_u16(), 200, "{}", p.body);
    eventually(
        Duration::from_secs(300),
        "the drain's move to end and its remote volume to go",
        async || {
            move_of(&b, &two).await["state"] == "done"
                && b.s.get("/v1/remotes/d-two").await.status.as_u16() == 404
        },
    )
    .await;
    let local = b.s.get("/v1/volumes/d-two").await.body;
    assert!(
        read_all(local["device"].as_str().unwrap(), 24 << 20) == data,
        "B's volume holds other bytes than A's did: {local}"
    );
    let d = b.s.get(&drain).await.body;
    let states: Vec<&Value> = d["moves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| &m["state"])
        .collect();
    assert!(
        states.contains(&&json!("done")) && states.contains(&&json!("cancelled")),
        "{d}"
    );
    eventually(
        Duration::from_secs(60),
        "the cancelled move's export to go",
        async || a.s.get("/v1/volumes/d-one/export").await.status.as_u16() == 404,
    )
    .await;

    b.delete("c-dm").await;
    a.delete("c-back").await;
    b.delete("d-two").await;
    a.delete("d-one").await;
    drop(b);
    drop(a);
    drop(hosts);
}

/// The request of a cold move of A's volume `name` into B's xfs root.
fn cold_request(name: &str, b: &Vm, rate: u64) -> Value {
    json!({"source_api": format!("http://{A_IP}:7400"), "volume": name, "image": name,
           "path": b.root(Scratch::Xfs).join(format!("{name}.img")),
           "rate_limit_bytes_per_sec": rate})
}

/// Fills the first `bytes` of `device` with a pattern of its own, flushed;
/// the pattern.
fn fill(device: &str, bytes: usize) -> Vec<u8> {
    use std::io::Write;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let data: Vec<u8> = (0..bytes / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(device)
        .unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    data
}

/// The first `bytes` of `device`.
fn read_all(device: &str, bytes: usize) -> Vec<u8> {
    use std::io::Read;
    let mut out = vec![0; bytes];
    std::fs::File::open(device)
        .unwrap()
        .read_exact(&mut out)
        .unwrap();
    out
}

/// A small filesystem of its own (tmpfs), unmounted when dropped: B's disk
/// that fills up.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn new(mib: u64) -> Self {
        let dir = std::path::PathBuf::from(format!("/tmp/bp-small-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let size = format!("size={mib}m,mode=0700");
        crate::sh(
            "mount",
            &["-t", "tmpfs", "-o", &size, "tmpfs", dir.to_str().unwrap()],
        );
        Self(dir)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A loop volume's move through faults under B's writes: A's service
/// killed (the kernel serves on; the release waits for A's API, named in
/// `state_reason`, then ends `done` once A is back), and the network cut
/// mid-copy (the consumer's writes and the copy wait, then go on). A dm
/// volume's move into a disk that fills: the local leg fails, the node goes
/// back to A alone and the move ends `failed`, B's consumer seeing no
/// error; the same when B's disk fails by an I/O error. A new rate limit
/// mid-copy goes on from where the copy was.
#[tokio::test(flavor = "multi_thread")]
async fn a_move_waits_through_faults_and_falls_back_when_the_local_disk_fills() {
    let hosts = Hosts::new();
    let small = SmallDisk::new(12);
    let (mut a, b, b_nqn) = two_hosts(&hosts, vec![small.0.clone()]).await;
    let _leftovers = Leftovers;

    let device = served_on_b(
        &a,
        &b,
        &b_nqn,
        "f-loop",
        json!({"name": "f-loop", "image": "f-loop", "backend": "loop"}),
    )
    .await;
    let consumer = Consumer::start(&device);
    writes_flow(&device, 1 << 20).await;
    let m = start_move(&b, "f-loop", SLOW).await;
    let id = m["id"].as_str().unwrap().to_string();
    a.s.kill();
    eventually(Duration::from_secs(120), "the copy to start", async || {
        move_of(&b, &id).await["synced_bytes"].as_u64() > Some(0)
    })
    .await;
    // The cut: B's controller loses A, and the writes wait for it.
    hosts.cut();
    eventually(
        Duration::from_secs(60),
        "B to see its connection lost",
        async || b.s.get("/v1/remotes/f-loop").await.body["state"] == "reconnecting",
    )
    .await;
    hosts.mend();
    eventually(Duration::from_secs(120), "B to reconnect", async || {
        b.s.get("/v1/remotes/f-loop").await.body["state"] == "attached"
    })
    .await;
    writes_flow(&device, 256 << 10).await;
    // A new limit goes on from the copy's progress, which the mirror's
    // metadata legs keep: never back to the first sector.
    let before = move_of(&b, &id).await["synced_bytes"].as_u64().unwrap();
    let p =
        b.s.patch(
            &format!("/v1/moves/{id}"),
            json!({"rate_limit_bytes_per_sec": 2 * SLOW}),
        )
        .await;
    assert_eq!(p.status.as_u16(), 200, "{}", p.body);
    eventually(
        Duration::from_secs(120),
        "the copy to go on past where it was",
        async || {
            let now = move_of(&b, &id).await["synced_bytes"].as_u64().unwrap();
            assert!(now >= before, "the copy went back: {now} < {before}");
            now > before
        },
    )
    .await;
    let p =
        b.s.patch(
            &format!("/v1/moves/{id}"),
            json!({"rate_limit_bytes_per_sec": 0}),
        )
        .await;
    assert_eq!(p.status.as_u16(), 200, "{}", p.body);
    eventually(
        Duration::from_secs(300),
        "the release to wait for A's API",
        async || {
            let m = move_of(&b, &id).await;
            m["state"] == "releasing" && m["state_reason"].is_string()
        },
    )
    .await;
    a.s.restart().await;
    eventually(Duration::from_secs(120), "the move to end", async || {
        move_of(&b, &id).await["state"] == "done"
    })
    .await;
    let (jobs, longest) = consumer.finish();
    println!(
        "f-loop: {jobs} fio verify jobs through a move with faults, longest write {longest:.0} ms"
    );
    let r = a.s.get("/v1/volumes/f-loop").await;
    assert_eq!(r.status.as_u16(), 404, "A's volume stays: {}", r.body);

    // B's disk fills mid-copy.
    local_leg_fails(&a, &b, &b_nqn, "f-full", "dm", async |b, name| {
        let m = start_move_to(b, name, &small.0, 0).await;
        m["id"].as_str().unwrap().to_string()
    })
    .await;
    let r = b.s.get("/v1/images/f-full").await;
    assert_eq!(r.status.as_u16(), 404, "B's image stays: {}", r.body);

    // B's disk fails by an I/O error mid-copy: the mirror drops the local
    // leg, recorded on its metadata legs, and the remote leg serves on.
    local_leg_fails(&a, &b, &b_nqn, "f-eio", "loop", async |b, name| {
        // The start answers once the mirror copies: failed at once, the
        // local leg fails mid-copy (slow, so the copy cannot have ended).
        let m = start_move(b, name, SLOW).await;
        let local = b.s.get(&format!("/v1/volumes/{name}")).await.body;
        fail_device(local["device"].as_str().unwrap());
        m["id"].as_str().unwrap().to_string()
    })
    .await;

    for name in ["f-loop", "f-full", "f-eio"] {
        let d = b.s.delete(&format!("/v1/remotes/{name}")).await;
        assert_eq!(d.status.as_u16(), 204, "{name}: {}", d.body);
    }
    b.delete("f-loop").await;
    for name in ["f-full", "f-eio"] {
        let d = a.s.delete(&format!("/v1/volumes/{name}/export")).await;
        assert_eq!(d.status.as_u16(), 204, "{name}: {}", d.body);
        a.delete(name).await;
    }
    drop(b);
    drop(a);
    drop(small);
    drop(hosts);
}

/// A's volume `name` (on `backend`, dm's `kernel` dispatch for dm) served
/// on B under fio verify, moved by `start` (which returns the move's id and
/// makes B's local leg fail): the move ends `failed` for its local leg, the
/// consumer's writes go on through the remote leg, and the remote volume
/// stays attached.
async fn local_leg_fails(
    a: &Vm,
    b: &Vm,
    b_nqn: &str,
    name: &str,
    backend: &str,
    start: impl AsyncFnOnce(&Vm, &str) -> String,
) {
    let mut spec = json!({"name": name, "image": name, "backend": backend});
    if backend == "dm" {
        spec["dispatch"] = json!("kernel");
    }
    let device = served_on_b(a, b, b_nqn, name, spec).await;
    let consumer = Consumer::start(&device);
    writes_flow(&device, 1 << 20).await;
    let id = start(b, name).await;
    eventually(Duration::from_secs(300), "the move to stop", async || {
        move_of(b, &id).await["state"] != "syncing"
    })
    .await;
    let failed = move_of(b, &id).await;
    assert_eq!(failed["state"], "failed", "{name}: {failed}");
    assert!(
        failed["state_reason"]
            .as_str()
            .unwrap()
            .contains("local leg failed"),
        "{name}: {failed}"
    );
    writes_flow(&device, 1 << 20).await;
    let (jobs, _) = consumer.finish();
    println!("{name}: {jobs} fio verify jobs through a move whose local leg failed");
    let remote = b.s.get(&format!("/v1/remotes/{name}")).await.body;
    assert_eq!(remote["state"], "attached", "{name}: {remote}");
}

/// B's disk failing: every I/O to the dm node `device` fails from now on
/// (its table replaced by dm's `error` target).
fn fail_device(device: &str) {
    let rdev = dev_of(device);
    let (major, minor) = (libc::major(rdev).to_string(), libc::minor(rdev).to_string());
    let name = dmsetup(&[
        "info",
        "-c",
        "--noheadings",
        "-o",
        "name",
        "-j",
        &major,
        "-m",
        &minor,
    ]);
    let sectors = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/size")).unwrap();
    dmsetup(&[
        "reload",
        &name,
        "--table",
        &format!("0 {} error", sectors.trim()),
    ]);
    dmsetup(&["resume", &name]);
}

/// One write of [`Prober`]: when it started and how long it took.
type Probe = (std::time::SystemTime, Duration);

/// 4 KiB direct writes, one at a time, in the last MiB of a device, each
/// timed: how long the consumer's writes wait at each table change.
struct Prober {
    stop: Arc<AtomicBool>,
    probes: std::thread::JoinHandle<Vec<Probe>>,
}

impl Prober {
    fn start(device: &str, size: u64) -> Self {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, device) = (stop.clone(), device.to_string());
        let probes = std::thread::spawn(move || {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&device)
                .unwrap();
            let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
            // SAFETY: a 4 KiB buffer of 4 KiB alignment, freed below.
            let buf = unsafe { std::alloc::alloc_zeroed(layout) };
            // SAFETY: the allocation above, 4096 bytes.
            let data = unsafe { std::slice::from_raw_parts(buf, 4096) };
            let mut out = Vec::new();
            let mut n = 0u64;
            while !flag.load(Ordering::Relaxed) {
                let at = std::time::SystemTime::now();
                let started = std::time::Instant::now();
                file.write_all_at(data, size - (1 << 20) + (n % 256) * 4096)
                    .unwrap();
                out.push((at, started.elapsed()));
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(buf, layout) };
            out
        });
        Self { stop, probes }
    }

    fn finish(self) -> Vec<Probe> {
        self.stop.store(true, Ordering::Relaxed);
        self.probes.join().unwrap()
    }
}

/// The longest probe that started within `before` of `at` or after it,
/// up to `after`.
fn longest_near(
    probes: &[Probe],
    at: std::time::SystemTime,
    before: Duration,
    after: Duration,
) -> Duration {
    probes
        .iter()
        .filter(|(t, _)| *t + before >= at && *t <= at + after)
        .map(|(_, d)| *d)
        .max()
        .unwrap_or_default()
}

/// When the event of `kind` on `remote` was recorded.
async fn event_at(b: &Vm, remote: &str, kind: &str) -> std::time::SystemTime {
    let events =
        b.s.get(&format!("/v1/events?volume={remote}&limit=1000"))
            .await
            .body;
    let at = events
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} event: {events}"))["at"]
        .as_str()
        .unwrap()
        .to_string();
    let t =
        time::OffsetDateTime::parse(&at, &time::format_description::well_known::Rfc3339).unwrap();
    std::time::SystemTime::from(t)
}

/// fio 4k random writes at iodepth 16 for `secs` s on `device`: IOPS.
fn write_iops(device: &str, secs: u32) -> f64 {
    let out = std::process::Command::new("fio")
        .args([
            "--name=cost",
            "--filename",
            device,
            "--rw=randwrite",
            "--bs=4k",
        ])
        .args([
            "--direct=1",
            "--size=64M",
            "--time_based",
            "--output-format=json",
        ])
        .args(["--ioengine=io_uring", "--iodepth=16"])
        .arg(format!("--runtime={secs}"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    json["jobs"][0]["write"]["iops"].as_f64().unwrap()
}

/// What a move costs (not a test: `tests/vm/move-bench.sh`): one ublk
/// `nowait` volume of A served on B, then moved to B under B's writes.
/// Prints the copy's throughput against `dd` of the same device over the
/// same path, the consumer's write IOPS during the copy against before it,
/// and the longest write of a one-at-a-time prober around each of the two
/// table changes (the mirror made, the switch to the local leg) against its
/// longest elsewhere during the copy.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: tests/vm/move-bench.sh"]
async fn move_cost_benchmark() {
    let secs: u32 = std::env::var("BLOCKPLANE_BENCH_SECS")
        .map(|s| s.parse().expect("BLOCKPLANE_BENCH_SECS is a number"))
        .unwrap_or(10);
    const MIB: u64 = 384;
    let hosts = Hosts::new();
    let (a, b, b_nqn) = two_hosts(&hosts, Vec::new()).await;
    let _leftovers = Leftovers;
    a.image("bench", Scratch::Xfs, MIB, "full").await;
    a.volume(json!({"name": "bench", "image": "bench", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let export =
        a.s.put("/v1/volumes/bench/export", json!({"hosts": [b_nqn]}))
            .await
            .body;
    let host = &export["hosts"][0];
    let remote =
        b.s.post(
            "/v1/remotes",
            json!({"name": "bench", "address": format!("{A_IP}:4420"), "nqn": export["nqn"],
                   "secret": host["secret"], "ctrl_secret": host["ctrl_secret"]}),
        )
        .await
        .body;
    let device = remote["device"].as_str().unwrap().to_string();
    let nvme = remote["nvme_device"].as_str().unwrap().to_string();
    let remote_id = remote["id"].as_str().unwrap().to_string();

    // The same bytes over the same path, by dd.
    let copy = b.root(Scratch::Xfs).join("dd.img");
    let started = std::time::Instant::now();
    crate::sh(
        "dd",
        &[
            &format!("if={nvme}"),
            &format!("of={}", copy.display()),
            "bs=1M",
            "iflag=direct",
            "oflag=direct",
            "status=none",
        ],
    );
    let dd_mibs = MIB as f64 / started.elapsed().as_secs_f64();
    std::fs::remove_file(&copy).unwrap();

    let before = write_iops(&device, secs);
    let prober = Prober::start(&device, MIB << 20);
    writes_flow(&device, 64 << 10).await;
    let started = std::time::Instant::now();
    let m = start_move(&b, "bench", 0).await;
    let id = m["id"].as_str().unwrap().to_string();
    let during = write_iops(&device, secs);
    let still_copying = move_of(&b, &id).await["state"] == "syncing";
    eventually(Duration::from_secs(1200), "the move to end", async || {
        move_of(&b, &id).await["state"] == "done"
    })
    .await;
    let probes = prober.finish();
    let mirrored = event_at(&b, &remote_id, "move_syncing").await;
    let switched = event_at(&b, &remote_id, "move_switched").await;
    let copy_secs = switched
        .duration_since(std::time::SystemTime::now() - started.elapsed())
        .unwrap_or_default()
        .as_secs_f64();
    let window = (Duration::from_secs(2), Duration::from_millis(500));
    let at_mirror = longest_near(&probes, mirrored, window.0, window.1);
    let at_switch = longest_near(&probes, switched, window.0, window.1);
    let elsewhere = probes
        .iter()
        .filter(|(t, _)| *t > mirrored + window.1 && *t + window.0 < switched)
        .map(|(_, d)| *d)
        .max()
        .unwrap_or_default();
    println!(
        "move cost, kernel {}, {MIB} MiB ublk nowait volume, {secs} s fio runs",
        crate::sh("uname", &["-r"]).trim()
    );
    println!(
        "copy: dd over NVMe/TCP {dd_mibs:.1} MiB/s; move {:.1} MiB/s (start to switch, {copy_secs:.1} s, the consumer writing); move/dd {:.2}",
        MIB as f64 / copy_secs,
        MIB as f64 / copy_secs / dd_mibs
    );
    println!(
        "consumer 4k randwrite iodepth 16: before {before:.0} IOPS, during the copy {during:.0} IOPS{}; during/before {:.2}",
        if still_copying {
            ""
        } else {
            " (the copy ended within the run)"
        },
        during / before
    );
    println!(
        "longest probe write: at the mirror's load {} ms, at the switch {} ms, elsewhere in the copy {} ms ({} probes)",
        at_mirror.as_millis(),
        at_switch.as_millis(),
        elsewhere.as_millis(),
        probes.len()
    );
    assert_eq!(b.s.delete("/v1/remotes/bench").await.status.as_u16(), 204);
    b.delete("bench").await;
}
