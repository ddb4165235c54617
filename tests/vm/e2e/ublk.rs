//! ublk volumes on a real kernel: every policy, live switches, the direct-map
//! rules, worker and control-plane crashes.

use std::time::Duration;

use serde_json::json;

use crate::harness::assert_error;
use crate::{
    Scratch, Vm, direct_write, direct_write_ok, eventually, fio_ok, fio_verify, is_immutable, run,
    sh, writes_flow,
};

const POLICIES: [&str; 3] = ["nowait", "threaded", "direct"];

/// mkfs, mount, write, unmount, detach, re-attach, fsck clean, files intact.
async fn filesystem_round_trip(vm: &Vm, image: &str, policy: &str, fs: &str) {
    let name = format!("fs-{policy}-{fs}");
    let spec = json!({"name": name, "image": image, "backend": "ublk", "dispatch": policy});
    let v = vm.volume(spec.clone()).await;
    assert_eq!(v["dispatch"], policy);
    let dev = v["device"].as_str().unwrap().to_string();
    let mnt = vm.root(Scratch::Tmpfs).join(format!("mnt-{name}"));
    std::fs::create_dir_all(&mnt).unwrap();
    let m = mnt.to_str().unwrap();
    // Forced: the image held the other filesystem in the previous round.
    let force = if fs == "xfs" { "-f" } else { "-F" };
    sh(&format!("mkfs.{fs}"), &["-q", force, &dev]);
    sh("mount", &[&dev, m]);
    sh(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={m}/data"),
            "bs=1M",
            "count=4",
            "status=none",
        ],
    );
    sh("cp", &["-r", "/etc/ssl", &format!("{m}/tree")]);
    let sums = sh(
        "sh",
        &[
            "-c",
            &format!("cd {m} && find . -type f -exec sha256sum {{}} + | sort"),
        ],
    );
    sh("umount", &[m]);
    vm.delete(&name).await;
    assert!(
        !std::path::Path::new(&dev).exists(),
        "device gone after delete"
    );

    let v = vm.volume(spec).await;
    let dev = v["device"].as_str().unwrap().to_string();
    match fs {
        "xfs" => drop(sh("xfs_repair", &["-n", &dev])),
        _ => drop(sh("fsck.ext4", &["-fn", &dev])),
    }
    sh("mount", &[&dev, m]);
    let again = sh(
        "sh",
        &[
            "-c",
            &format!("cd {m} && find . -type f -exec sha256sum {{}} + | sort"),
        ],
    );
    assert_eq!(
        sums, again,
        "files changed across detach and re-attach ({policy}, {fs})"
    );
    sh("umount", &[m]);
    vm.delete(&name).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn filesystems_survive_detach_and_reattach_on_every_policy() {
    let vm = Vm::start().await;
    // mkfs.xfs wants at least 300 MB. The file paths keep a `full` image
    // allocated through mkfs's discards (keepalloc:: tests that); `direct`
    // still gets its own image so each policy starts from a fresh one.
    vm.image("fs", Scratch::Xfs, 304, "full").await;
    vm.image("fs-direct", Scratch::Xfs, 304, "full").await;
    for policy in POLICIES {
        let image = if policy == "direct" {
            "fs-direct"
        } else {
            "fs"
        };
        for fs in ["ext4", "xfs"] {
            filesystem_round_trip(&vm, image, policy, fs).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn fio_verify_passes_on_every_policy_on_xfs_and_ext4() {
    let vm = Vm::start().await;
    for fs in [Scratch::Xfs, Scratch::Ext4] {
        let img = format!("fio-{fs:?}").to_lowercase();
        vm.image(&img, fs, 48, "full").await;
        for policy in POLICIES {
            let name = format!("{img}-{policy}");
            let v = vm
                .volume(json!({"name": name, "image": img, "backend": "ublk", "dispatch": policy}))
                .await;
            assert_eq!(v["dispatch"], policy, "{v}");
            fio_ok(fio_verify(v["device"].as_str().unwrap(), "24M", &[]));
            let st = vm.s.get(&format!("/v1/volumes/{name}/stats")).await.body;
            // The block layer may merge adjacent writes: count bytes.
            assert!(st["write"]["bytes"].as_u64().unwrap() >= 24 << 20, "{st}");
            assert_eq!(st["write"]["errors"], 0);
            assert_eq!(st["dispatch"], policy);
            assert!(
                st["latency_us"]["write"]["count"].as_u64().unwrap() > 0,
                "{st}"
            );
            assert!(
                st["latency_us"]["write"]["p99"].as_u64().unwrap()
                    >= st["latency_us"]["write"]["p50"].as_u64().unwrap()
            );
            if policy == "nowait" {
                let n = &st["nowait"];
                assert!(n["submitted"].as_u64().unwrap() > 0, "{st}");
                assert_eq!(
                    n["submitted"].as_u64().unwrap(),
                    n["completed_inline"].as_u64().unwrap()
                        + n["eagain_fallbacks"].as_u64().unwrap()
                );
            }
            vm.delete(&name).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn policies_switch_live_under_fio_verify() {
    let vm = Vm::start().await;
    vm.image("sw", Scratch::Xfs, 64, "full").await;
    let v = vm
        .volume(json!({"name": "sw", "image": "sw", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let img = vm.root(Scratch::Xfs).join("sw.img");
    let fio = fio_verify(&dev, "48M", &[]);
    for policy in [
        "threaded", "direct", "nowait", "direct", "threaded", "nowait",
    ] {
        // Each switch lands while fio is writing: 1 MiB more written first.
        let waited = writes_flow(&dev, 1 << 20).await;
        eprintln!("switch to {policy} after {waited:?} of writes");
        let after = vm.set_dispatch("sw", policy).await;
        assert_eq!(after["dispatch"], policy, "{after}");
        assert_eq!(
            is_immutable(&img),
            policy == "direct",
            "pinned exactly while direct"
        );
    }
    writes_flow(&dev, 1 << 20).await;
    fio_ok(fio);
    let kinds = vm.event_kinds(v["id"].as_str().unwrap()).await;
    assert_eq!(
        kinds.iter().filter(|k| *k == "dispatch_changed").count(),
        6,
        "{kinds:?}"
    );
    let ev = vm.s.get("/v1/events?volume=sw").await.body;
    assert!(
        ev.as_array().unwrap().iter().any(|e| e["message"]
            .as_str()
            .unwrap()
            .contains("dispatch threaded -> direct")),
        "{ev}"
    );
    vm.delete("sw").await;
    assert!(!is_immutable(&img));
}

#[tokio::test(flavor = "multi_thread")]
async fn auto_picks_direct_or_nowait_and_says_why() {
    let vm = Vm::start().await;
    vm.image("full", Scratch::Xfs, 32, "full").await;
    vm.image("sparse", Scratch::Xfs, 32, "sparse").await;
    let v = vm
        .volume(json!({"name": "a1", "image": "full", "backend": "ublk"}))
        .await;
    assert_eq!(v["dispatch"], "direct", "{v}");
    assert_eq!(v["requested_dispatch"], "auto");
    let v = vm
        .volume(json!({"name": "a2", "image": "sparse", "backend": "ublk"}))
        .await;
    assert_eq!(v["dispatch"], "nowait", "{v}");
    let why = v["dispatch_reason"].as_str().unwrap();
    assert!(why.contains("rule 2") && why.contains("hole"), "{why}");
    vm.delete("a1").await;
    vm.delete("a2").await;

    // Nothing named: the full image (xfs over a linear dm device) gets dm
    // direct; the sparse one dm kernel (a private loop device), and says
    // why not direct; a full image on a filesystem mounted on a raw disk
    // (dm's rule 7) ublk direct.
    vm.image("plain", Scratch::Plain, 16, "full").await;
    for (name, image, backend, dispatch, why_has) in [
        ("d1", "full", "dm", "direct", "auto: backend dm, direct: "),
        (
            "d2",
            "sparse",
            "dm",
            "kernel",
            "auto: backend dm, kernel: direct-map rule 2: the image has a hole at bytes 0..",
        ),
        ("d3", "plain", "ublk", "direct", "(direct-map rule 7"),
    ] {
        let v = vm.volume(json!({"name": name, "image": image})).await;
        assert_eq!(v["backend"], backend, "{v}");
        assert_eq!(v["dispatch"], dispatch, "{v}");
        let why = v["dispatch_reason"].as_str().unwrap();
        assert!(why.contains(why_has), "{why}");
        if name == "d2" {
            assert_eq!(why.matches("rule 2").count(), 1, "{why}");
        }
        if backend == "dm" {
            fio_ok(fio_verify(v["device"].as_str().unwrap(), "8M", &[]));
        }
    }
    for name in ["d1", "d2", "d3"] {
        vm.delete(name).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn direct_map_refusals_name_their_rule_and_change_nothing() {
    let vm = Vm::start().await;
    vm.image("sparse", Scratch::Xfs, 16, "sparse").await;
    vm.image("ontmpfs", Scratch::Tmpfs, 16, "full").await;
    vm.image("orig", Scratch::Xfs, 16, "full").await;
    vm.reflinked_copy("orig").await;
    let before = vm.snapshot().await;
    for (image, rule) in [
        ("sparse", "rule 2"),
        ("ontmpfs", "rule 1"),
        ("copy", "SHARED"),
    ] {
        let a =
            vm.s.post(
                "/v1/volumes",
                json!({"name": "x", "image": image, "backend": "ublk", "dispatch": "direct"}),
            )
            .await;
        assert_error(&a, 422, "refused");
        assert!(
            a.body["error"]["message"].as_str().unwrap().contains(rule),
            "{}",
            a.body
        );
        assert_eq!(vm.snapshot().await, before);
        assert!(
            !run("ls", &["/dev/ublkb0"]).status.success(),
            "no device made"
        );
    }
    // Switching to direct is refused the same way, and the volume keeps serving.
    let v = vm
        .volume(json!({"name": "s", "image": "sparse", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let before = vm.snapshot().await;
    let a =
        vm.s.patch("/v1/volumes/s", json!({"dispatch": "direct"}))
            .await;
    assert_error(&a, 422, "refused");
    assert_eq!(
        vm.snapshot().await,
        before,
        "the refused switch changed something"
    );
    assert!(!is_immutable(&vm.root(Scratch::Xfs).join("sparse.img")));
    fio_ok(fio_verify(v["device"].as_str().unwrap(), "8M", &[]));
    vm.delete("s").await;
}

/// FS_IMMUTABLE_FL makes the image refuse every change to itself, a reflink
/// onto it included. (A reflink *from* it is allowed by the kernel: the source
/// is not changed. Its extents then turn SHARED, which the periodic re-read
/// catches under rule 5: see the dm drift tests.)
#[tokio::test(flavor = "multi_thread")]
async fn a_mapped_image_refuses_truncate_punch_and_reflink() {
    let vm = Vm::start().await;
    vm.image("pinned", Scratch::Xfs, 32, "full").await;
    vm.image("other", Scratch::Xfs, 32, "full").await;
    let other = vm.root(Scratch::Xfs).join("other.img");
    vm.volume(json!({"name": "p", "image": "pinned", "backend": "ublk", "dispatch": "direct"}))
        .await;
    let img = vm.root(Scratch::Xfs).join("pinned.img");
    let p = img.to_str().unwrap();
    assert!(is_immutable(&img));
    for (cmd, args) in [
        ("truncate", vec!["-s", "4096", p]),
        (
            "fallocate",
            vec!["--punch-hole", "--offset", "0", "--length", "65536", p],
        ),
        ("cp", vec!["--reflink=always", other.to_str().unwrap(), p]),
        ("rm", vec!["-f", p]),
    ] {
        let out = run(cmd, &args);
        assert!(!out.status.success(), "{cmd} succeeded on a pinned image");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Operation not permitted"), "{cmd}: {err}");
    }
    vm.delete("p").await;
    assert!(!is_immutable(&img), "unpinned on delete");
    sh("truncate", &["-s", "32M", p]);
}

fn worker_pid(v: &serde_json::Value) -> u32 {
    v["worker_pid"]
        .as_u64()
        .expect("a ublk volume has a worker") as u32
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_worker_is_replaced_and_fio_never_notices() {
    let vm = Vm::start().await;
    vm.image("crash", Scratch::Xfs, 64, "full").await;
    for policy in ["nowait", "direct"] {
        let v = vm
            .volume(json!({"name": "c", "image": "crash", "backend": "ublk", "dispatch": policy}))
            .await;
        let dev = v["device"].as_str().unwrap().to_string();
        let fio = fio_verify(&dev, "48M", &[]);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pid = worker_pid(&v);
        sh("kill", &["-9", &pid.to_string()]);
        eventually(Duration::from_secs(60), "a new worker", async || {
            let now = vm.s.get("/v1/volumes/c").await.body;
            now["worker_pid"].as_u64().is_some_and(|p| p as u32 != pid)
        })
        .await;
        fio_ok(fio);
        let now = vm.s.get("/v1/volumes/c").await.body;
        assert_eq!(now["device"], dev.as_str(), "the same device, recovered");
        assert_eq!(now["dispatch"], policy);
        let st = vm.s.get("/v1/volumes/c/stats").await.body;
        assert_eq!(st["worker_restarts"], 1, "{st}");
        assert!(
            vm.event_kinds(v["id"].as_str().unwrap())
                .await
                .contains(&"worker_restarted".to_string())
        );
        vm.delete("c").await;
        assert!(!is_immutable(&vm.root(Scratch::Xfs).join("crash.img")));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_the_control_plane_does_not_stop_io() {
    let mut vm = Vm::start().await;
    vm.image("cp", Scratch::Xfs, 64, "full").await;
    let v = vm
        .volume(json!({"name": "cp", "image": "cp", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let fio = fio_verify(&dev, "48M", &[]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = vm.s.get("/v1/volumes/cp/stats").await.body;
    vm.s.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    vm.s.restart().await;
    let after = vm.s.get("/v1/volumes/cp").await.body;
    assert_eq!(after["state"], "attached", "{after}");
    assert_eq!(
        after["worker_pid"], v["worker_pid"],
        "the same worker, re-adopted"
    );
    assert_eq!(after["device"], dev.as_str());
    let text = fio_ok(fio);
    let stats = vm.s.get("/v1/volumes/cp/stats").await.body;
    assert!(
        stats["write"]["ops"].as_u64() > before["write"]["ops"].as_u64(),
        "counters kept counting: {before} then {stats}\n{text}"
    );
    assert_eq!(stats["since"], before["since"]);
    vm.delete("cp").await;
}

/// The counters `/metrics` shows for a ublk volume live in the service (the
/// worker's mapped counters file), not in the kernel: they keep counting
/// across a worker crash and a control-plane restart, and the worker
/// restart they record survives the restart too.
#[tokio::test(flavor = "multi_thread")]
async fn worker_counters_in_metrics_survive_a_worker_crash_and_a_restart() {
    let mut vm = Vm::start().await;
    vm.image("m", Scratch::Xfs, 16, "full").await;
    let v = vm
        .volume(json!({"name": "m", "image": "m", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    write_mib(&dev, 0);
    let first = counters_reaching(&vm, 1 << 20, 0).await;
    let pid = worker_pid(&v);
    sh("kill", &["-9", &pid.to_string()]);
    eventually(Duration::from_secs(60), "a new worker", async || {
        let now = vm.s.get("/v1/volumes/m").await.body;
        now["worker_pid"].as_u64().is_some_and(|p| p as u32 != pid)
    })
    .await;
    write_mib(&dev, 1);
    vm.s.kill();
    write_mib(&dev, 2);
    vm.s.restart().await;
    let last = counters_reaching(&vm, first.0 + (2 << 20), 1).await;
    assert!(
        last.1 > first.1,
        "nowait submissions: {first:?} then {last:?}"
    );
    vm.delete("m").await;
}

/// Writes 1 MiB at MiB `at` of `dev`, past the page cache.
fn write_mib(dev: &str, at: u64) {
    sh(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={dev}"),
            "bs=1M",
            "count=1",
            &format!("seek={at}"),
            "oflag=direct",
            "status=none",
        ],
    );
}

/// Polls `/metrics` until volume `m` shows at least `bytes` written and
/// `restarts` worker restarts; returns (bytes written, nowait submissions).
async fn counters_reaching(vm: &Vm, bytes: u64, restarts: u64) -> (u64, u64) {
    let sample = |text: &str, name: &str, extra: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter(|l| l.contains("volume=\"m\"") && l.contains(extra))
            .find_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    };
    let mut last = String::new();
    for _ in 0..150 {
        last = vm.s.get_text("/metrics").await;
        let got = (
            sample(&last, "blockplane_volume_bytes_total", "op=\"write\""),
            sample(&last, "blockplane_volume_nowait_submitted_total", ""),
            sample(&last, "blockplane_volume_worker_restarts_total", ""),
        );
        if got.0 >= bytes && got.2 == restarts {
            return (got.0, got.1);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("volume m never showed {bytes} bytes written and {restarts} worker restarts:\n{last}");
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_under_io_ends_it_with_errors_and_leaves_nothing() {
    let vm = Vm::start().await;
    vm.image("del", Scratch::Xfs, 16, "full").await;
    let v = vm
        .volume(json!({"name": "d", "image": "del", "backend": "ublk", "dispatch": "direct"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let pid = worker_pid(&v);
    let fio = std::process::Command::new("timeout")
        .args(["120", "fio", "--name=busy", "--filename", &dev])
        .args([
            "--rw=randrw",
            "--bs=4k",
            "--ioengine=io_uring",
            "--iodepth=16",
            "--direct=1",
        ])
        .args(["--time_based", "--runtime=60", "--size=16M"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = std::time::Instant::now();
    vm.delete("d").await;
    let out = fio.wait_with_output().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "fio hung after the delete"
    );
    assert_ne!(out.status.code(), Some(124), "fio was stuck until timeout");
    assert!(!out.status.success(), "fio should see I/O errors");
    assert!(!std::path::Path::new(&dev).exists(), "no device");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "no worker"
    );
    assert!(
        !is_immutable(&vm.root(Scratch::Xfs).join("del.img")),
        "no immutable flag"
    );
}

/// The CPUs a thread may run on, from `/proc/<pid>/task/<tid>/status`.
fn cpus_allowed(pid: u32, tid: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_default_volume_has_a_pinned_queue_per_cpu_and_says_how_it_copies() {
    let vm = Vm::start().await;
    vm.image("q", Scratch::Xfs, 64, "full").await;
    let cpus = std::thread::available_parallelism().unwrap().get().min(8);
    let v = vm
        .volume(json!({"name": "q", "image": "q", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    assert_eq!(v["queues"], cpus, "a queue per CPU: {v}");
    // Zero copy where the kernel offers AUTO_BUF_REG, else copy mode.
    let host = vm.s.get("/v1/host").await.body;
    let names = &host["backends"]["ublk"]["features"]["names"];
    let zc = names
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n == "AUTO_BUF_REG");
    assert_eq!(v["copy_mode"], if zc { "zero_copy" } else { "copy" }, "{v}");
    let per_queue = 128 * 256 * 1024;
    let buffers = if zc { 0 } else { cpus as u64 * per_queue };
    assert_eq!(v["buffer_bytes"], buffers);
    // One thread per queue, each pinned to a CPU of its own.
    let pid = worker_pid(&v);
    let mut pinned = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let tid = t.unwrap().file_name().into_string().unwrap();
        let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap();
        if comm.trim().starts_with("queue-") {
            pinned.push(cpus_allowed(pid, &tid));
        }
    }
    pinned.sort();
    let want: Vec<String> = (0..cpus).map(|c| c.to_string()).collect();
    assert_eq!(pinned, want, "queue threads and their CPUs");
    // The data path in that mode keeps data, on each policy.
    let dev = v["device"].as_str().unwrap().to_string();
    for policy in POLICIES {
        vm.set_dispatch("q", policy).await;
        fio_ok(fio_verify(&dev, "16M", &[]));
    }
    let st = vm.s.get("/v1/volumes/q/stats").await.body;
    assert!(st["nowait"]["pauses"].is_u64(), "{st}");
    vm.delete("q").await;
}

/// Sends a PATCH the service dies in the middle of (test fault
/// `kill_after_change`: the worker has the change, the row does not).
async fn patch_and_die(vm: &mut Vm, volume: &str, body: serde_json::Value) {
    let path = format!("/v1/volumes/{volume}");
    vm.die_during("kill_after_change", hyper::Method::PATCH, &path, Some(body))
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_change_the_service_died_before_recording_is_undone_at_restart() {
    let mut vm = Vm::start().await;
    vm.image("lc", Scratch::Xfs, 64, "full").await;
    let v = vm
        .volume(json!({"name": "lc", "image": "lc", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    direct_write_ok(&dev);

    // Read-only reached the worker; the row still says writable.
    patch_and_die(&mut vm, "lc", json!({"read_only": true})).await;
    assert!(
        !direct_write(&dev).status.success(),
        "the worker had taken the change"
    );
    vm.s.restart().await;
    let now = vm.s.get("/v1/volumes/lc").await.body;
    assert_eq!(now["read_only"], false, "{now}");
    assert_eq!(
        now["worker_pid"], v["worker_pid"],
        "the same worker, adopted"
    );
    direct_write_ok(&dev);

    // A policy switch reached the worker; the row still says nowait.
    patch_and_die(&mut vm, "lc", json!({"dispatch": "threaded"})).await;
    vm.s.restart().await;
    let now = vm.s.get("/v1/volumes/lc").await.body;
    assert_eq!(
        (&now["dispatch"], &now["requested_dispatch"]),
        (&json!("nowait"), &json!("nowait")),
        "{now}"
    );
    fio_ok(fio_verify(&dev, "16M", &[]));
    vm.delete("lc").await;
}

/// A worker of this service whose volume row vanished (a registry restored
/// from an older backup) is an orphan of this instance: stopped at start,
/// its device deleted, with an `orphan_removed` event.
#[tokio::test(flavor = "multi_thread")]
async fn an_orphan_worker_of_this_instance_is_removed_at_start() {
    let mut vm = Vm::start().await;
    vm.image("ow", Scratch::Xfs, 16, "full").await;
    let v = vm
        .volume(json!({"name": "ow", "image": "ow", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let pid = worker_pid(&v);
    vm.s.kill();
    let db = vm.s.data.join("blockplane.db");
    sh("sqlite3", &[db.to_str().unwrap(), "DELETE FROM volumes;"]);
    vm.s.restart().await;
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the orphan worker {pid} still runs"
    );
    assert!(!std::path::Path::new(&dev).exists(), "{dev} is left");
    let host = vm.s.get("/v1/host").await.body;
    assert_eq!(host["orphans"], json!([]), "{host}");
    let kinds = vm.event_kinds(v["id"].as_str().unwrap()).await;
    assert!(kinds.contains(&"orphan_removed".to_string()), "{kinds:?}");
}

/// `blockplane.db` lost while the data dir (and so the workers' run dirs) is
/// kept, a ublk volume and a dm one (over its private ublk worker) serving:
/// the start is refused, as for loop devices, and with
/// `--accept-new-registry` the service starts empty and reports the devices
/// as orphans. Either way nothing is stopped: the devices still read what
/// was written and their workers still run.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_registry_leaves_ublk_and_dm_devices_serving_and_reports_them() {
    let mut vm = Vm::start().await;
    vm.image("lu", Scratch::Xfs, 16, "full").await;
    vm.image("ld", Scratch::Ext4, 16, "full").await;
    let u = vm
        .volume(json!({"name": "lu", "image": "lu", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let d = vm
        .volume(json!({"name": "ld", "image": "ld", "backend": "dm", "dispatch": "nowait"}))
        .await;
    let pattern = "/tmp/lost-registry.pattern";
    sh(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={pattern}"),
            "bs=1M",
            "count=4",
            "status=none",
        ],
    );
    let mut serving = Vec::new();
    for v in [&u, &d] {
        let dev = v["device"].as_str().unwrap().to_string();
        sh(
            "dd",
            &[
                &format!("if={pattern}"),
                &format!("of={dev}"),
                "bs=1M",
                "oflag=direct,sync",
                "status=none",
            ],
        );
        let id = v["id"].as_str().unwrap();
        let state = vm.s.data.join(format!("run/ublk/{id}/state.json"));
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
        serving.push((
            dev,
            state["pid"].as_u64().unwrap(),
            state["dev_id"].as_u64().unwrap(),
        ));
    }
    let still_serving = |when: &str| {
        // Every worker and device first: a read from a device whose worker
        // was stopped under it can wait forever.
        for (dev, pid, _) in &serving {
            assert!(
                std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "{when}: the worker {pid} of {dev} was stopped"
            );
            assert!(std::path::Path::new(dev).exists(), "{when}: {dev} is gone");
        }
        for (dev, _, _) in &serving {
            sh(
                "bash",
                &[
                    "-c",
                    &format!(
                        "cmp <(timeout 30 dd if={dev} bs=1M count=4 iflag=direct status=none) {pattern}"
                    ),
                ],
            );
        }
    };
    assert!(vm.s.signal(rustix::process::Signal::TERM).success());
    let lost = vm.s.dir.path().join("lost");
    std::fs::create_dir(&lost).unwrap();
    for f in ["blockplane.db", "blockplane.db-wal", "blockplane.db-shm"] {
        let _ = std::fs::rename(vm.s.data.join(f), lost.join(f));
    }

    // Refused, and nothing touched.
    let reconciled = |log: &str| log.matches("reconciled with the kernel").count();
    let before = reconciled(&vm.s.log_text());
    vm.s.spawn(&[]);
    // Until it refuses or has reconciled (stopping a worker can take 30 s).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        let log = vm.s.log_text();
        if log.contains("is missing or empty") || reconciled(&log) > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    still_serving("after a start over the lost registry");
    let status = vm.s.wait_exit(Duration::from_secs(20));
    assert!(!status.success(), "started over a lost registry");
    let log = vm.s.log_text();
    let refusal = log
        .lines()
        .find(|l| l.contains("is missing or empty"))
        .unwrap_or_else(|| panic!("no refusal:\n{log}"));
    assert!(refusal.contains("--accept-new-registry"), "{refusal}");
    // Each device, and each worker with its image.
    for (dev, pid, dev_id) in &serving {
        for what in [
            dev.clone(),
            format!("/dev/ublkb{dev_id}"),
            format!("worker pid {pid}"),
        ] {
            assert!(refusal.contains(&what), "{what} not named: {refusal}");
        }
    }
    assert!(
        refusal.contains("/lu.img") && refusal.contains("/ld.img"),
        "{refusal}"
    );

    // Explicit recovery: an empty registry, the devices reported, untouched.
    vm.s.opts.extra_args.push("--accept-new-registry".into());
    vm.s.restart().await;
    still_serving("after --accept-new-registry");
    assert_eq!(vm.s.get("/v1/volumes").await.body, json!([]));
    let host = vm.s.get("/v1/host").await.body;
    let orphans = host["orphans"].as_array().unwrap();
    let find = |backend: &str, device: &str| {
        orphans
            .iter()
            .find(|o| o["backend"] == backend && o["device"] == device)
            .unwrap_or_else(|| panic!("no {backend} orphan {device}: {host}"))
    };
    let ou = find("ublk", &serving[0].0);
    assert_eq!(ou["volume_id"], u["id"], "{ou}");
    assert_eq!(ou["pid"], serving[0].1, "{ou}");
    assert!(
        ou["backing_file"].as_str().unwrap().ends_with("/lu.img"),
        "{ou}"
    );
    assert_eq!(ou["removable"], false, "{ou}");
    // The dm volume: its dm device and its private ublk device.
    let od = find("dm", &serving[1].0);
    assert_eq!(od["volume_id"], d["id"], "{od}");
    assert_eq!(od["removable"], false, "{od}");
    let private = find("ublk", &format!("/dev/ublkb{}", serving[1].2));
    assert_eq!(private["pid"], serving[1].1, "{private}");
    assert!(
        private["backing_file"]
            .as_str()
            .unwrap()
            .ends_with("/ld.img"),
        "{private}"
    );
    let a =
        vm.s.delete(&format!("/v1/host/orphans/{}", u["id"].as_str().unwrap()))
            .await;
    assert_eq!(a.status.as_u16(), 404, "{}", a.body);

    // The registry exists now: a later start needs no flag, and still leaves them.
    vm.s.opts.extra_args.clear();
    assert!(vm.s.signal(rustix::process::Signal::TERM).success());
    vm.s.restart().await;
    still_serving("after a second start");
    assert_eq!(
        vm.s.get("/v1/host").await.body["orphans"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
}

/// Writes 1 MiB of a fresh random pattern at the start of `dev`, past the
/// page cache, and reads it back: the device serves.
fn serves(dev: &str) {
    let pattern = format!("/tmp/serves-{}.pattern", dev.rsplit('/').next().unwrap());
    sh(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={pattern}"),
            "bs=1M",
            "count=1",
            "status=none",
        ],
    );
    sh(
        "timeout",
        &[
            "30",
            "dd",
            &format!("if={pattern}"),
            &format!("of={dev}"),
            "bs=1M",
            "oflag=direct,sync",
            "status=none",
        ],
    );
    sh(
        "bash",
        &[
            "-c",
            &format!(
                "cmp <(timeout 30 dd if={dev} bs=1M count=1 iflag=direct status=none) {pattern}"
            ),
        ],
    );
}

/// The pid of the worker serving volume `id` of `vm` (a dm volume's private
/// one included), from its run dir.
fn run_dir_pid(vm: &Vm, id: &str) -> u32 {
    let state = vm.s.data.join(format!("run/ublk/{id}/state.json"));
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(state).unwrap()).unwrap();
    state["pid"].as_u64().unwrap() as u32
}

/// Service `b`'s attach of image `name` on ublk: asserts 409
/// `image_locked` naming the image file; returns the message.
async fn locked_for(b: &crate::harness::Service, name: &str, when: &str) -> String {
    let a = b
        .post(
            "/v1/volumes",
            json!({"name": format!("b-{name}"), "image": name, "backend": "ublk"}),
        )
        .await;
    assert!(
        a.status.as_u16() == 409 && a.body["error"]["code"] == "image_locked",
        "{when}: service B got {} for {name}.img: {}",
        a.status,
        a.body
    );
    let msg = a.body["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains(&format!("{name}.img")), "{msg}");
    msg
}

/// Service B: another blockplane (its own data dir) over image root `root`.
/// Started before A makes its volumes: a service starting on an empty
/// registry refuses while the kernel serves another instance's dm devices
/// (issue 12 item 2).
async fn second_instance(root: &std::path::Path) -> crate::harness::Service {
    crate::harness::Service::start_with(crate::harness::Opts {
        extra_roots: vec![root.to_path_buf()],
        ..Default::default()
    })
    .await
}

/// Issue 12 item 4: a ublk worker owns its device and outlives its service,
/// so it holds the image lock too (the same open file description as its
/// service's). Service A serves `s.img` (ublk) and `d.img` (dm over a private
/// ublk worker); A is SIGKILLed: its workers keep serving, and a service B
/// with another data dir over the same image root is refused both images
/// with 409 `image_locked` naming the worker. A restarted adopts its workers
/// (no conflict with their locks); a killed worker's replacement takes the
/// lock over with no window, B refused throughout; deleting the volumes
/// lets B have the images.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_instance_is_refused_an_image_a_ublk_worker_serves_through_crashes() {
    let mut vm = Vm::start().await;
    let root = vm.root(Scratch::Xfs);
    let b = second_instance(&root).await;
    let mut vols = Vec::new();
    for (name, backend) in [("s", "ublk"), ("d", "dm")] {
        vm.image(name, Scratch::Xfs, 16, "full").await;
        let v = vm
            .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": "nowait"}))
            .await;
        let (id, dev) = (v["id"].as_str().unwrap(), v["device"].as_str().unwrap());
        serves(dev);
        vols.push((name, id.to_string(), dev.to_string()));
    }
    for (name, _, _) in &vols {
        let path = root.join(format!("{name}.img"));
        let r = b
            .post("/v1/images", json!({"name": name, "path": path}))
            .await;
        assert_eq!(r.status.as_u16(), 201, "{}", r.body);
    }
    let refused = async |when: &str| {
        for (name, _, _) in &vols {
            locked_for(&b, name, when).await;
        }
        assert_eq!(b.get("/v1/volumes").await.body, json!([]), "{when}");
    };
    refused("while A runs").await;

    vm.s.kill();
    for (name, id, dev) in &vols {
        serves(dev);
        let msg = locked_for(&b, name, "after A's SIGKILL").await;
        let worker = format!("process {}", run_dir_pid(&vm, id));
        let run_dir = vm.s.data.join(format!("run/ublk/{id}"));
        assert!(
            msg.contains(&worker) && msg.contains(&run_dir.display().to_string()),
            "the holder, {worker} with run dir {}, not named: {msg}",
            run_dir.display()
        );
    }
    refused("after A's SIGKILL").await;

    let pids: Vec<u32> = vols.iter().map(|(_, id, _)| run_dir_pid(&vm, id)).collect();
    vm.s.restart().await;
    for ((name, id, dev), pid) in vols.iter().zip(&pids) {
        let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
        assert_eq!(v["state"], "attached", "{v}\n{}", vm.s.log_text());
        assert_eq!(v["device"], dev.as_str());
        assert_eq!(
            run_dir_pid(&vm, id),
            *pid,
            "{name}: the same worker, adopted"
        );
        serves(dev);
    }
    let log = vm.s.log_text();
    assert!(
        !log.contains("locked elsewhere"),
        "A conflicted with its own workers' locks:\n{log}"
    );
    refused("after A's restart").await;

    // A worker dies under A: the service's duplicate holds the lock until
    // the replacement takes it again.
    for (name, id, dev) in &vols {
        let pid = run_dir_pid(&vm, id);
        sh("kill", &["-9", &pid.to_string()]);
        refused(&format!("right after worker {pid} of {name} died")).await;
        eventually(Duration::from_secs(60), "a new worker", async || {
            let now = run_dir_pid(&vm, id);
            now != pid && std::path::Path::new(&format!("/proc/{now}")).exists()
        })
        .await;
        serves(dev);
        let kinds = vm.event_kinds(id).await;
        assert!(kinds.contains(&"worker_restarted".to_string()), "{kinds:?}");
    }
    refused("after the workers' replacements").await;

    for (name, _, _) in &vols {
        vm.delete(name).await;
        let a = b
            .post(
                "/v1/volumes",
                json!({"name": format!("b-{name}"), "image": name, "backend": "ublk"}),
            )
            .await;
        assert_eq!(a.status.as_u16(), 201, "{}", a.body);
        serves(a.body["device"].as_str().unwrap());
        let d = b.delete(&format!("/v1/volumes/b-{name}")).await;
        assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    }
}

/// Issue 26 item 2: a `direct` volume pins its image immutable, so the image
/// opens read-only only, and a service re-adopting the volume at restart can
/// hold only a shared lock on it, which a second instance's read-only lock
/// would join. Service A serves two images `direct` (ublk, and dm, whose
/// lock no worker keeps through A's restart); A is SIGKILLed and restarted
/// and re-adopts both; service B, over the same image root, is then refused
/// every attach (ublk, dm and loop, read-only and writable) with 409
/// `image_locked`, and neither B's view nor the kernel nor A changes.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_instance_is_refused_a_direct_image_the_first_readopted() {
    let mut vm = Vm::start().await;
    let root = vm.root(Scratch::Xfs);
    let b = second_instance(&root).await;
    let mut devs = Vec::new();
    for (name, backend) in [("du", "ublk"), ("dd", "dm")] {
        vm.image(name, Scratch::Xfs, 16, "full").await;
        let v = vm
            .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": "direct"}))
            .await;
        assert_eq!(v["dispatch"], "direct", "{v}");
        devs.push(v["device"].as_str().unwrap().to_string());
        let path = root.join(format!("{name}.img"));
        assert!(is_immutable(&path), "{name}: not pinned");
        let r = b
            .post("/v1/images", json!({"name": name, "path": path}))
            .await;
        assert_eq!(r.status.as_u16(), 201, "{}", r.body);
    }
    vm.s.kill();
    vm.s.restart().await;
    for (name, dev) in ["du", "dd"].iter().zip(&devs) {
        let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
        assert_eq!(
            (&v["state"], &v["dispatch"]),
            (&json!("attached"), &json!("direct")),
            "{name} after A's restart: {v}"
        );
        serves(dev);
    }
    let (kernel, b_view) = (vm.snapshot().await, b.snapshot().await);
    let mut wrong = Vec::new();
    for name in ["du", "dd"] {
        for backend in ["ublk", "dm", "loop"] {
            for read_only in [true, false] {
                let a = b
                    .post(
                        "/v1/volumes",
                        json!({"name": format!("b-{name}-{backend}"), "image": name,
                               "backend": backend, "read_only": read_only}),
                    )
                    .await;
                if a.status.as_u16() != 409 || a.body["error"]["code"] != "image_locked" {
                    wrong.push(format!(
                        "{name}.img on {backend}, read_only {read_only}: {} {}",
                        a.status, a.body
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "service B was not refused with 409 image_locked:\n{}",
        wrong.join("\n")
    );
    assert_eq!(b.snapshot().await, b_view, "the refusals changed B's view");
    assert_eq!(
        vm.snapshot().await,
        kernel,
        "the refusals changed something"
    );
    for (name, dev) in ["du", "dd"].iter().zip(&devs) {
        serves(dev);
        vm.delete(name).await;
    }
}

/// `EXT4_IOC_MOVE_EXT`'s argument: blocks `[orig_start, orig_start + len)`
/// of the file trade places with those of the donor file, data included.
#[repr(C)]
struct MoveExtent {
    reserved: u32,
    donor_fd: u32,
    orig_start: u64,
    donor_start: u64,
    len: u64,
    moved_len: u64,
}

/// `_IOWR('f', 15, struct move_extent)`.
const EXT4_IOC_MOVE_EXT: libc::c_ulong = 0xC028_660F;

/// Moves `len` bytes at `at` of the ext4 file `file` to new blocks, as
/// ext4's online defragmenter does (`e4defrag`): the kernel copies them into
/// blocks allocated to `donor` under both inodes' locks and swaps the
/// extents, so the file keeps its data and `donor` gets its old blocks.
fn move_extent(file: &std::path::Path, donor: &std::path::Path, at: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let orig = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let d = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(donor)
        .unwrap();
    sh(
        "fallocate",
        &[
            "--offset",
            &at.to_string(),
            "--length",
            &len.to_string(),
            donor.to_str().unwrap(),
        ],
    );
    let mut arg = MoveExtent {
        reserved: 0,
        donor_fd: d.as_raw_fd() as u32,
        orig_start: at / 4096,
        donor_start: at / 4096,
        len: len / 4096,
        moved_len: 0,
    };
    // SAFETY: the ioctl reads and writes one move_extent through the pointer.
    let r = unsafe {
        libc::ioctl(
            orig.as_raw_fd(),
            EXT4_IOC_MOVE_EXT,
            &mut arg as *mut MoveExtent,
        )
    };
    assert_eq!(
        r,
        0,
        "EXT4_IOC_MOVE_EXT: {}",
        std::io::Error::last_os_error()
    );
    assert_eq!(arg.moved_len, len / 4096, "blocks moved");
}

/// Physical start of the extent holding byte `at` of `file` (filefrag).
fn physical_at(file: &std::path::Path, at: u64) -> String {
    let out = sh("filefrag", &["-v", "-b4096", file.to_str().unwrap()]);
    let block = at / 4096;
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').map(str::trim).collect();
            let (logical, physical) = (f.get(1)?, f.get(2)?);
            let (from, to) = logical.split_once("..")?;
            let (from, to): (u64, u64) = (from.trim().parse().ok()?, to.trim().parse().ok()?);
            (from <= block && block <= to).then(|| physical.to_string())
        })
        .next()
        .unwrap_or_else(|| {
            panic!(
                "no extent of {} holds block {block}:\n{out}",
                file.display()
            )
        })
}

/// `sha256sum` of what `path` reads with `O_DIRECT` (what its blocks hold,
/// not what a page cache remembers), from byte 0 for `mib` MiB.
fn sha256(path: &std::path::Path, mib: u64) -> String {
    sh(
        "bash",
        &[
            "-c",
            &format!(
                "set -o pipefail; dd if={} bs=1M count={mib} iflag=direct status=none | sha256sum",
                path.display()
            ),
        ],
    )
}

/// Issue 26 item 3: drift of a ublk `direct` volume's image, the way it
/// happens: the pin is cleared (`chattr -i`), then a middle extent of the
/// image (not the first) moves to other blocks as ext4's online defragmenter
/// moves it, while fio writes (for seconds after: paced) and then verifies
/// what it wrote. The
/// volume must be off the map before the move can start (the worker sees the
/// mover's open: it is off the direct path by the time the open returns), so
/// no write goes to the blocks the image gave up: fio verifies every block
/// it wrote, the image read through its file is what the device reads, and
/// the other files on the filesystem (the donor that took the old blocks,
/// and a bystander) keep their contents.
#[tokio::test(flavor = "multi_thread")]
async fn a_moved_middle_extent_takes_a_ublk_direct_volume_off_the_map_before_any_stale_write() {
    let vm = Vm::start().await;
    let root = vm.root(Scratch::Ext4);
    let bystander = root.join("bystander");
    sh(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", bystander.display()),
            "bs=1M",
            "count=4",
            "conv=fsync",
            "status=none",
        ],
    );
    let bystander_sum = sha256(&bystander, 4);
    vm.image("mv", Scratch::Ext4, 32, "full").await;
    let v = vm
        .volume(json!({"name": "mv", "image": "mv", "backend": "ublk", "dispatch": "direct"}))
        .await;
    assert_eq!(v["dispatch"], "direct", "{v}");
    let (id, dev) = (
        v["id"].as_str().unwrap().to_string(),
        v["device"].as_str().unwrap().to_string(),
    );
    let img = root.join("mv.img");
    let donor = root.join("donor");
    let (at, len) = (12 << 20, 4 << 20);
    let was = physical_at(&img, at);

    // Paced, so that its writes go on for seconds after the move: a stale
    // map would have time to send some to the old blocks.
    let fio = fio_verify(&dev, "16M", &["--rate_iops=400"]);
    writes_flow(&dev, 1 << 20).await;
    sh("chattr", &["-i", img.to_str().unwrap()]);
    move_extent(&img, &donor, at, len);
    let right_after = crate::faults::worker_status(&vm, &id);
    // What the kernel copied is on disk: the donor's blocks hold it from now on.
    sh("sync", &["-f", root.to_str().unwrap()]);
    let donor_sum = sha256(&donor, 16);
    assert_ne!(physical_at(&img, at), was, "the extent did not move");
    eventually(
        Duration::from_secs(30),
        "the volume to go degraded",
        async || vm.s.get("/v1/volumes/mv").await.body["state"] == "degraded",
    )
    .await;
    let text = fio_ok(fio);
    assert!(
        text.contains("write: IOPS") && text.contains("read: IOPS"),
        "fio did not write and read back:\n{text}"
    );
    assert_eq!(
        sha256(&donor, 16),
        donor_sum,
        "a write reached the blocks the image gave up (now the donor's)"
    );
    assert_eq!(
        sha256(&bystander, 4),
        bystander_sum,
        "the bystander changed"
    );
    assert_eq!(
        sha256(std::path::Path::new(&dev), 32),
        sha256(&img, 32),
        "the image's file does not hold what its device reads"
    );
    assert_eq!(
        right_after["dispatch"], "nowait",
        "the worker was still on the direct map when the move's open returned: {right_after}"
    );
    let now = vm.s.get("/v1/volumes/mv").await.body;
    assert!(
        now["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("rule 5"),
        "{now}"
    );
    vm.delete("mv").await;
}

/// The names of a process's threads, sorted.
fn thread_names(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    names.sort();
    names
}

/// Voluntary context switches of every thread of a process, summed: how
/// often its threads went to sleep, so (near enough) how often they woke.
fn voluntary_switches(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .sum()
}

/// Samples the stats sampler has taken of a volume (one a second).
async fn samples_of(vm: &Vm, volume: &str) -> usize {
    let h =
        vm.s.get(&format!("/v1/volumes/{volume}/stats/history?seconds=900"))
            .await;
    h.body["points"].as_array().map_or(0, Vec::len)
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_ublk_volumes_add_no_service_threads_and_their_workers_sleep() {
    let vm = Vm::start().await;
    let service = vm.s.pid();
    let attach = |name: String| {
        let vm = &vm;
        async move {
            vm.image(&name, Scratch::Xfs, 16, "sparse").await;
            vm.volume(json!({"name": name, "image": name, "backend": "ublk", "dispatch": "nowait"}))
                .await
        }
    };
    let first = attach("idle0".into()).await;
    // Settled: the sampler has read the volume a few times.
    eventually(
        Duration::from_secs(60),
        "three samples of idle0",
        async || samples_of(&vm, "idle0").await >= 3,
    )
    .await;
    // An idle worker: one thread per queue plus one, and asleep while the
    // sampler reads it (and the supervisor watches it) five times over.
    let pid = worker_pid(&first);
    let queues = first["queues"].as_u64().unwrap() as usize;
    let names = thread_names(pid);
    let before = (voluntary_switches(pid), samples_of(&vm, "idle0").await);
    eventually(
        Duration::from_secs(60),
        "five more samples of idle0",
        async || samples_of(&vm, "idle0").await >= before.1 + 5,
    )
    .await;
    let woke = voluntary_switches(pid) - before.0;
    eprintln!("idle worker: threads {names:?}; woke {woke} times over five samples");
    // The kernel's io-wq workers (`iou-wrk-*`) are not the worker's own: the
    // kernel starts them for a request it cannot issue without blocking, and
    // keeps the last one of each ring.
    let own: Vec<&String> = names
        .iter()
        .filter(|n| !n.starts_with("iou-wrk-"))
        .collect();
    assert_eq!(own.len(), queues + 1, "worker threads: {names:?}");
    // Less than once a sample: what is left is the queues' 20 s idle wait
    // and the kernel's io-wq worker's 5 s one.
    assert!(
        woke < 5,
        "an idle worker woke {woke} times over five samples (threads {names:?})"
    );
    // Threads of bounded pools (tokio's workers and blocking pool, sqlx's
    // connections, the kernel's io-wq workers) grow with load up to their
    // caps, not with volumes; every other thread is one the service keeps.
    let kept = |names: Vec<String>| -> Vec<String> {
        names
            .into_iter()
            .filter(|n| {
                !["tokio-", "sqlx-", "iou-wrk-"]
                    .iter()
                    .any(|p| n.starts_with(p))
            })
            .collect()
    };
    let one = kept(thread_names(service));
    let mut later = Vec::new();
    for i in 1..8 {
        later.push(attach(format!("idle{i}")).await);
    }
    let settled = async || kept(thread_names(service)).len() <= one.len();
    if tokio::time::timeout(Duration::from_secs(60), async {
        while !settled().await {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .is_err()
    {
        panic!(
            "the service's own threads with 8 volumes: {:?}; with 1: {one:?}",
            kept(thread_names(service))
        );
    }
    // A figure for the record, not an assert: wake-ups and CPU of the
    // service and the 8 idle workers over ten samples.
    let mut workers = vec![worker_pid(&first)];
    workers.extend(later.iter().map(worker_pid));
    let load = || {
        let w: u64 = workers.iter().map(|p| voluntary_switches(*p)).sum();
        (
            w,
            voluntary_switches(service),
            cpu_ticks(service),
            std::time::Instant::now(),
        )
    };
    let (w0, s0, c0, t0) = load();
    let n0 = samples_of(&vm, "idle0").await;
    eventually(
        Duration::from_secs(60),
        "ten more samples of idle0",
        async || samples_of(&vm, "idle0").await >= n0 + 10,
    )
    .await;
    let (w1, s1, c1, t1) = load();
    let secs = (t1 - t0).as_secs_f64();
    eprintln!(
        "8 idle ublk volumes over {secs:.1} s: {:.2} worker wake-ups/s per volume, service {:.1} wake-ups/s and {:.1}% of a CPU",
        (w1 - w0) as f64 / secs / 8.0,
        (s1 - s0) as f64 / secs,
        (c1 - c0) as f64 / 100.0 / secs * 100.0
    );
    for i in 0..8 {
        vm.delete(&format!("idle{i}")).await;
    }
}

/// utime+stime of a process, in clock ticks (100 a second).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}
