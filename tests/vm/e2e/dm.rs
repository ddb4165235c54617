//! dm volumes on a real kernel: linear tables over the image's extents, the
//! private ublk path, live switches that never change the node, drift.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use serde_json::json;

use crate::drift::move_first_blocks;
use crate::harness::assert_error;
use crate::{
    Scratch, Vm, direct_write, direct_write_ok, eventually, fio_ok, fio_verify, is_immutable, run,
    sh, writes_flow,
};

fn rdev(dev: &str) -> u64 {
    std::fs::metadata(dev).unwrap().rdev()
}

/// The live table of the dm device `dev` (`dmsetup table`).
pub(crate) fn table(dev: &str) -> String {
    let m = std::fs::metadata(dev).unwrap();
    let (major, minor) = (rustix::fs::major(m.rdev()), rustix::fs::minor(m.rdev()));
    String::from_utf8_lossy(
        &std::process::Command::new("dmsetup")
            .args(["table", "-j", &major.to_string(), "-m", &minor.to_string()])
            .env("DM_DISABLE_UDEV", "1")
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned()
}

/// Whether a table is one linear target over a ublk device.
pub(crate) fn over_ublk(table: &str) -> bool {
    let lines: Vec<&str> = table.lines().collect();
    lines.len() == 1
        && lines[0].split_whitespace().nth(3).is_some_and(|d| {
            std::fs::read_link(format!("/sys/dev/block/{d}"))
                .is_ok_and(|p| p.to_string_lossy().contains("ublkb"))
        })
}

/// Whether a table is one linear target over a loop device.
fn over_loop(table: &str) -> bool {
    let lines: Vec<&str> = table.lines().collect();
    lines.len() == 1
        && lines[0].split_whitespace().nth(3).is_some_and(|d| {
            std::fs::read_link(format!("/sys/dev/block/{d}")).is_ok_and(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("loop"))
            })
        })
}

/// Bound loop devices whose backing file is `image`.
fn loops_over(image: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let backing = std::fs::read_to_string(e.path().join("loop/backing_file"));
        if backing.is_ok_and(|b| std::path::Path::new(b.trim()) == image) {
            out.push(name);
        }
    }
    out
}

/// The default on an image dm cannot map (a sparse one): dm `kernel`, a
/// table over a private loop device with direct I/O. It moves to a worker
/// and back live (a QoS limit, a named policy, a copy), grows, is adopted
/// by a restarted service, and leaves no loop device behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_sparse_image_is_served_by_the_kernel_and_moves_live_to_a_worker_and_back() {
    let mut vm = Vm::start().await;
    let src = vm.image("ks", Scratch::Xfs, 32, "sparse").await;
    let img = vm.root(Scratch::Xfs).join("ks.img");
    let v = vm.volume(json!({"name": "ks", "image": "ks"})).await;
    assert_eq!(
        (&v["backend"], &v["dispatch"]),
        (&json!("dm"), &json!("kernel")),
        "{v}"
    );
    let why = v["dispatch_reason"].as_str().unwrap();
    assert!(
        why.starts_with("auto: backend dm, kernel: direct-map rule 2: the image has a hole"),
        "{why}"
    );
    let dev = v["device"].as_str().unwrap().to_string();
    let node = rdev(&dev);
    assert!(over_loop(&table(&dev)), "{}", table(&dev));
    assert_eq!(
        sh(
            "cat",
            &[&format!("/sys/block/{}/loop/dio", loops_over(&img)[0])]
        )
        .trim(),
        "1"
    );

    let fio = fio_verify(&dev, "24M", &[]);
    for (patch, want) in [
        (json!({"qos": {"iops": 1_000_000}}), "nowait"),
        (json!({"qos": null}), "kernel"),
        (json!({"dispatch": "threaded"}), "threaded"),
        (json!({"dispatch": "auto"}), "kernel"),
    ] {
        // Each change lands while fio is writing.
        writes_flow(&dev, 1 << 20).await;
        let a = vm.s.patch("/v1/volumes/ks", patch.clone()).await;
        assert_eq!(a.status.as_u16(), 200, "{patch}: {}", a.body);
        assert_eq!(a.body["dispatch"], want, "{patch}: {}", a.body);
        assert_eq!(rdev(&dev), node, "the node never changes");
        let t = table(&dev);
        assert_eq!(over_loop(&t), want == "kernel", "{patch}: {t}");
        assert_eq!(over_ublk(&t), want != "kernel", "{patch}: {t}");
        if patch == json!({"qos": null}) {
            let why = a.body["dispatch_reason"].as_str().unwrap();
            assert!(
                why.starts_with(
                    "auto: the last QoS limit was removed, and kernel serves it: direct-map rule 2"
                ),
                "{why}"
            );
        }
    }
    writes_flow(&dev, 1 << 20).await;
    fio_ok(fio);
    // One loop device, the current one: each move let the last one go.
    assert_eq!(loops_over(&img).len(), 1, "{:?}", loops_over(&img));

    // A named kernel with a limit, and kernel on ublk: refused, nothing changed.
    let a =
        vm.s.patch(
            "/v1/volumes/ks",
            json!({"dispatch": "kernel", "qos": {"iops": 100}}),
        )
        .await;
    assert_error(&a, 422, "not_live");
    vm.image("ku", Scratch::Xfs, 16, "sparse").await;
    let a =
        vm.s.post(
            "/v1/volumes",
            json!({"name": "ku", "image": "ku", "backend": "ublk", "dispatch": "kernel"}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 422, "{}", a.body);
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("dispatch 'kernel' is dm's"),
        "{}",
        a.body
    );
    let now = vm.s.get("/v1/volumes/ks").await.body;
    assert_eq!(
        (&now["dispatch"], &now["qos"]),
        (&json!("kernel"), &json!(null)),
        "{now}"
    );

    // Grows: the file, the loop device under the table, the table.
    let a =
        vm.s.post("/v1/images/ks/resize", json!({"size_bytes": 48 << 20}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    let size: u64 = sh("blockdev", &["--getsize64", &dev])
        .trim()
        .parse()
        .unwrap();
    assert_eq!(size, 48 << 20, "blockdev sees the new size");

    // A copy: a worker holds the volume still for its moment, then the
    // kernel serves it again.
    let a =
        vm.s.post(
            &format!("/v1/images/{}/snapshots", src["id"].as_str().unwrap()),
            json!({"name": "ks-snap"}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    let now = vm.s.get("/v1/volumes/ks").await.body;
    assert_eq!(now["dispatch"], "kernel", "{now}");
    assert!(over_loop(&table(&dev)), "{}", table(&dev));

    // A restarted service adopts it as it is.
    vm.s.kill();
    vm.s.restart().await;
    let now = vm.s.get("/v1/volumes/ks").await.body;
    assert_eq!(
        (&now["state"], &now["dispatch"]),
        (&json!("attached"), &json!("kernel")),
        "{now}"
    );
    assert_eq!(now["device"], dev.as_str());
    fio_ok(fio_verify(&dev, "8M", &[]));
    let kinds = vm.event_kinds(v["id"].as_str().unwrap()).await;
    assert!(!kinds.contains(&"volume_error".to_string()), "{kinds:?}");

    vm.delete("ks").await;
    assert!(loops_over(&img).is_empty(), "{:?}", loops_over(&img));
}

#[tokio::test(flavor = "multi_thread")]
async fn fio_verify_on_direct_and_nowait_over_xfs_and_ext4_images() {
    let vm = Vm::start().await;
    for fs in [Scratch::Xfs, Scratch::Ext4] {
        let img = format!("dm-{fs:?}").to_lowercase();
        vm.image(&img, fs, 48, "full").await;
        for policy in ["direct", "nowait"] {
            let name = format!("{img}-{policy}");
            let v = vm
                .volume(json!({"name": name, "image": img, "backend": "dm", "dispatch": policy}))
                .await;
            assert_eq!(v["backend"], "dm");
            assert_eq!(v["dispatch"], policy, "{v}");
            let dev = v["device"].as_str().unwrap().to_string();
            assert!(
                dev.starts_with("/dev/dm-") || dev.starts_with("/dev/mapper/"),
                "{dev}"
            );
            let t = table(&dev);
            assert_eq!(over_ublk(&t), policy != "direct", "{t}");
            if policy == "direct" {
                assert!(t.lines().all(|l| l.contains(" linear ")), "{t}");
                assert!(is_immutable(&vm.root(fs).join(format!("{img}.img"))));
            }
            fio_ok(fio_verify(&dev, "24M", &[]));
            let st = vm.s.get(&format!("/v1/volumes/{name}/stats")).await.body;
            assert!(st["write"]["bytes"].as_u64().unwrap() >= 24 << 20, "{st}");
            assert!(
                st["kernel"].is_object(),
                "dm stats come from the kernel's counters: {st}"
            );
            vm.delete(&name).await;
            assert!(!std::path::Path::new(&dev).exists() || !table(&dev).contains("linear"));
            assert!(
                !is_immutable(&vm.root(fs).join(format!("{img}.img"))),
                "unpinned on delete"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_filesystem_on_a_direct_dm_volume_round_trips() {
    let vm = Vm::start().await;
    vm.image("fsimg", Scratch::Xfs, 304, "full").await;
    let spec = json!({"name": "f", "image": "fsimg", "backend": "dm", "dispatch": "direct"});
    let v = vm.volume(spec.clone()).await;
    let dev = v["device"].as_str().unwrap().to_string();
    let mnt = vm.root(Scratch::Tmpfs).join("mnt-dm");
    std::fs::create_dir_all(&mnt).unwrap();
    let m = mnt.to_str().unwrap();
    sh("mkfs.xfs", &["-q", "-f", &dev]);
    sh("mount", &[&dev, m]);
    sh("cp", &["-r", "/etc/ssl", &format!("{m}/tree")]);
    let sums = sh(
        "sh",
        &[
            "-c",
            &format!("cd {m} && find . -type f -exec sha256sum {{}} + | sort"),
        ],
    );
    sh("umount", &[m]);
    vm.delete("f").await;
    let v = vm.volume(spec).await;
    let dev = v["device"].as_str().unwrap().to_string();
    sh("xfs_repair", &["-n", &dev]);
    sh("mount", &[&dev, m]);
    let again = sh(
        "sh",
        &[
            "-c",
            &format!("cd {m} && find . -type f -exec sha256sum {{}} + | sort"),
        ],
    );
    assert_eq!(sums, again);
    sh("umount", &[m]);
    vm.delete("f").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn dm_refusals_name_their_rule_and_change_nothing() {
    let vm = Vm::start().await;
    vm.image("sparse", Scratch::Xfs, 16, "sparse").await;
    vm.image("ontmpfs", Scratch::Tmpfs, 16, "full").await;
    vm.image("onplain", Scratch::Plain, 16, "full").await;
    vm.image("orig", Scratch::Xfs, 16, "full").await;
    vm.reflinked_copy("orig").await;
    vm.image("q", Scratch::Xfs, 16, "full").await;
    let before = vm.snapshot().await;
    for (image, qos, code, needles) in [
        ("sparse", None, "refused", &["rule 2"][..]),
        ("ontmpfs", None, "refused", &["rule 1"]),
        ("copy", None, "refused", &["SHARED"]),
        (
            "onplain",
            None,
            "refused",
            &["mounted directly", "linear wrapper", "\"ublk\""],
        ),
        // QoS needs a worker: dm direct asked by name has none.
        (
            "q",
            Some(json!({"iops": 100})),
            "unsupported",
            &["volume 'x'", "'direct', asked by name, has none"],
        ),
    ] {
        let mut body = json!({"name": "x", "image": image, "backend": "dm", "dispatch": "direct"});
        if let Some(qos) = qos {
            body["qos"] = qos;
        }
        let a = vm.s.post("/v1/volumes", body).await;
        assert_error(&a, 422, code);
        let msg = a.body["error"]["message"].as_str().unwrap();
        assert!(needles.iter().all(|n| msg.contains(n)), "{msg}");
        assert_eq!(
            vm.snapshot().await,
            before,
            "refusal for {image} changed something"
        );
        assert!(!is_immutable(&vm.root(Scratch::Xfs).join("orig.img")));
        assert!(!is_immutable(&vm.root(Scratch::Plain).join("onplain.img")));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mapped_image_refuses_truncate_punch_and_reflink_onto_it() {
    let vm = Vm::start().await;
    vm.image("pin", Scratch::Xfs, 16, "full").await;
    vm.image("other", Scratch::Xfs, 16, "full").await;
    vm.volume(json!({"name": "p", "image": "pin", "backend": "dm", "dispatch": "direct"}))
        .await;
    let img = vm.root(Scratch::Xfs).join("pin.img");
    let other = vm.root(Scratch::Xfs).join("other.img");
    let p = img.to_str().unwrap();
    for (cmd, args) in [
        ("truncate", vec!["-s", "4096", p]),
        (
            "fallocate",
            vec!["--punch-hole", "--offset", "0", "--length", "65536", p],
        ),
        ("cp", vec!["--reflink=always", other.to_str().unwrap(), p]),
    ] {
        let out = run(cmd, &args);
        assert!(!out.status.success(), "{cmd} succeeded on a mapped image");
        assert!(String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"));
    }
    vm.delete("p").await;
    assert!(!is_immutable(&img));
}

#[tokio::test(flavor = "multi_thread")]
async fn switches_never_change_the_node_and_fio_verify_passes() {
    let vm = Vm::start().await;
    vm.image("sw", Scratch::Xfs, 64, "full").await;
    let v = vm
        .volume(json!({"name": "sw", "image": "sw", "backend": "dm", "dispatch": "direct"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let node = rdev(&dev);
    let img = vm.root(Scratch::Xfs).join("sw.img");
    let fio = fio_verify(&dev, "48M", &[]);
    for policy in ["nowait", "threaded", "direct", "threaded", "direct"] {
        // Each switch lands while fio is writing: 1 MiB more written first.
        let waited = writes_flow(&dev, 1 << 20).await;
        eprintln!("switch to {policy} after {waited:?} of writes");
        let after = vm.set_dispatch("sw", policy).await;
        assert_eq!(after["dispatch"], policy, "{after}");
        assert_eq!(after["device"], dev.as_str(), "the node never changes");
        assert_eq!(rdev(&dev), node, "major:minor never change");
        assert_eq!(is_immutable(&img), policy == "direct");
        let t = table(&dev);
        assert_eq!(over_ublk(&t), policy != "direct", "{policy}: {t}");
    }
    writes_flow(&dev, 1 << 20).await;
    fio_ok(fio);
    vm.delete("sw").await;
    assert!(!is_immutable(&img));
}

#[tokio::test(flavor = "multi_thread")]
async fn grow_under_io_and_toggle_read_only() {
    let vm = Vm::start().await;
    for policy in ["direct", "nowait"] {
        let img = format!("g-{policy}");
        vm.image(&img, Scratch::Xfs, 32, "full").await;
        let v = vm
            .volume(json!({"name": img, "image": img, "backend": "dm", "dispatch": policy}))
            .await;
        let dev = v["device"].as_str().unwrap().to_string();
        let fio = fio_verify(&dev, "24M", &[]);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let a =
            vm.s.post(
                &format!("/v1/images/{img}/resize"),
                json!({"size_bytes": 48 << 20}),
            )
            .await;
        let features =
            vm.s.get("/v1/host").await.body["backends"]["ublk"]["features"]["names"].clone();
        let live_resize = policy == "direct"
            || features
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n == "UPDATE_SIZE");
        assert_eq!(a.status.as_u16(), 200, "{}", a.body);
        fio_ok(fio);
        let size: u64 = sh("blockdev", &["--getsize64", &dev])
            .trim()
            .parse()
            .unwrap();
        if live_resize {
            assert_eq!(size, 48 << 20, "{policy}: blockdev sees the new size");
        } else {
            let ev = vm.s.get(&format!("/v1/events?volume={img}")).await.body;
            assert!(ev.to_string().contains("UPDATE_SIZE"), "{ev}");
        }
        // Read-only: writes fail, reads keep working.
        let a =
            vm.s.patch(&format!("/v1/volumes/{img}"), json!({"read_only": true}))
                .await;
        assert_eq!(a.status.as_u16(), 200, "{}", a.body);
        let w = direct_write(&dev);
        assert!(
            !w.status.success(),
            "a write to a read-only volume succeeded"
        );
        let err = String::from_utf8_lossy(&w.stderr);
        assert!(
            err.contains("Read-only")
                || err.contains("Input/output")
                || err.contains("Operation not permitted"),
            "{err}"
        );
        sh(
            "dd",
            &[
                &format!("if={dev}"),
                "of=/dev/null",
                "bs=4k",
                "count=16",
                "iflag=direct",
                "status=none",
            ],
        );
        let a =
            vm.s.patch(&format!("/v1/volumes/{img}"), json!({"read_only": false}))
                .await;
        assert_eq!(a.status.as_u16(), 200, "{}", a.body);
        direct_write_ok(&dev);
        vm.delete(&img).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_device_outlives_a_killed_control_plane_and_is_readopted() {
    let mut vm = Vm::start().await;
    vm.image("k", Scratch::Xfs, 64, "full").await;
    let v = vm
        .volume(json!({"name": "k", "image": "k", "backend": "dm", "dispatch": "direct"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let fio = fio_verify(&dev, "48M", &[]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    vm.s.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    vm.s.restart().await;
    let after = vm.s.get("/v1/volumes/k").await.body;
    assert_eq!(after["state"], "attached", "{after}");
    assert_eq!(after["device"], dev.as_str());
    fio_ok(fio);
    let kinds = vm.event_kinds(v["id"].as_str().unwrap()).await;
    assert!(!kinds.contains(&"volume_error".to_string()), "{kinds:?}");
    vm.delete("k").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn extent_drift_is_caught_and_the_volume_keeps_serving_on_nowait() {
    let vm = Vm::start().await;
    vm.image("drift", Scratch::Xfs, 32, "full").await;
    let v = vm
        .volume(json!({"name": "d", "image": "drift", "backend": "dm", "dispatch": "direct"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    // Known data through the device.
    sh(
        "dd",
        &[
            "if=/dev/urandom",
            "of=/tmp/drift.pattern",
            "bs=1M",
            "count=4",
            "status=none",
        ],
    );
    sh(
        "dd",
        &[
            "if=/tmp/drift.pattern",
            &format!("of={dev}"),
            "bs=1M",
            "oflag=direct,sync",
            "status=none",
        ],
    );
    // Someone unpins the image and moves its first blocks.
    let img = vm.root(Scratch::Xfs).join("drift.img");
    move_first_blocks(&img, 4 << 20, &vm.root(Scratch::Xfs));
    eventually(
        Duration::from_secs(30),
        "the volume to go degraded",
        async || vm.s.get("/v1/volumes/d").await.body["state"] == "degraded",
    )
    .await;
    let now = vm.s.get("/v1/volumes/d").await.body;
    assert_eq!(now["dispatch"], "nowait", "{now}");
    assert!(
        now["state_reason"].as_str().unwrap().contains("rule 5"),
        "{now}"
    );
    assert_eq!(now["device"], dev.as_str());
    assert!(
        vm.event_kinds(v["id"].as_str().unwrap())
            .await
            .contains(&"volume_degraded".to_string())
    );
    // The data written before is there, and new I/O verifies.
    sh(
        "bash",
        &[
            "-c",
            &format!(
                "cmp <(dd if={dev} bs=1M count=4 iflag=direct status=none) /tmp/drift.pattern"
            ),
        ],
    );
    fio_ok(fio_verify(&dev, "24M", &[]));
    vm.delete("d").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_orphan_dm_device_is_reported_and_removed_only_on_request() {
    let mut vm = Vm::start().await;
    vm.image("o", Scratch::Xfs, 16, "full").await;
    let v = vm
        .volume(json!({"name": "o", "image": "o", "backend": "dm", "dispatch": "direct"}))
        .await;
    let id = v["id"].as_str().unwrap().to_string();
    let dev = v["device"].as_str().unwrap().to_string();
    vm.s.kill();
    let db = vm.s.data.join("blockplane.db");
    sh("sqlite3", &[db.to_str().unwrap(), "DELETE FROM volumes;"]);
    vm.s.restart().await;
    let host = vm.s.get("/v1/host").await.body;
    let orphans = host["orphans"].as_array().unwrap();
    assert_eq!(orphans.len(), 1, "{host}");
    assert_eq!(orphans[0]["volume_id"], id.as_str());
    assert!(
        std::path::Path::new(&dev).exists(),
        "an orphan dm device is left alone"
    );
    let a = vm.s.delete(&format!("/v1/host/orphans/{id}")).await;
    assert_eq!(a.status.as_u16(), 204, "{}", a.body);
    assert!(
        vm.s.get("/v1/host").await.body["orphans"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_error(
        &vm.s.delete(&format!("/v1/host/orphans/{id}")).await,
        404,
        "orphan_not_found",
    );
    // Nothing knew the orphan's image: its pin stays for the owner to clear.
    let img = vm.root(Scratch::Xfs).join("o.img");
    sh("chattr", &["-i", img.to_str().unwrap()]);
}
