//! An image keeps its allocation: a `full` image served `nowait` or
//! `threaded` is never punched, so discard-heavy use leaves it eligible for
//! `direct`; a `sparse` one still gives space back; `allocate` makes a
//! punched image eligible again while its volume serves.

use std::time::Duration;

use serde_json::json;

use crate::{Scratch, Vm, eventually, fio_ok, fio_verify, run, sh, writes_flow};

/// `len` bytes of `dev` at `off`, read O_DIRECT.
fn read_at(dev: &str, off_mib: u64, len_mib: u64) -> Vec<u8> {
    let out = run(
        "dd",
        &[
            &format!("if={dev}"),
            "bs=1M",
            &format!("skip={off_mib}"),
            &format!("count={len_mib}"),
            "iflag=direct",
            "status=none",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn random_at(dev: &str, off_mib: u64, len_mib: u64) {
    sh(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={dev}"),
            "bs=1M",
            &format!("seek={off_mib}"),
            &format!("count={len_mib}"),
            "oflag=direct",
            "status=none",
        ],
    );
}

/// fio writing and trimming `dev` at once (4k random writes, 64k random
/// trims), for `secs` seconds.
fn fio_trim_and_write(dev: &str, secs: u32) {
    let rt = format!("--runtime={secs}");
    let mut args = vec![
        "--filename",
        dev,
        "--direct=1",
        "--time_based",
        &rt,
        "--size=128M",
        "--randrepeat=0",
    ];
    args.extend([
        "--name=write",
        "--rw=randwrite",
        "--bs=4k",
        "--ioengine=io_uring",
        "--iodepth=8",
    ]);
    args.extend([
        "--name=trim",
        "--rw=randtrim",
        "--bs=64k",
        "--ioengine=psync",
    ]);
    let out = fio_ok(
        std::process::Command::new("fio")
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("fio"),
    );
    assert!(out.contains("trim:"), "fio trimmed nothing:\n{out}");
}

/// A discard-heavy workload on `dev`: mkfs (which discards the whole
/// device), WRITE_ZEROES over data (which must read back as zeros),
/// discards of ranges and of everything, and fio trimming while it writes.
fn discard_heavy(dev: &str, mkfs: &str) {
    sh(
        mkfs,
        &["-q", if mkfs == "mkfs.xfs" { "-f" } else { "-F" }, dev],
    );
    random_at(dev, 1, 2);
    assert!(read_at(dev, 1, 2).iter().any(|&b| b != 0));
    sh("blkdiscard", &["-z", "-o", "1MiB", "-l", "2MiB", dev]);
    assert!(
        read_at(dev, 1, 2).iter().all(|&b| b == 0),
        "{dev}: zeroed range reads back zeros"
    );
    sh("blkdiscard", &["-o", "64MiB", "-l", "64MiB", dev]);
    sh("blkdiscard", &["-z", "-o", "160MiB", "-l", "32MiB", dev]);
    fio_trim_and_write(dev, 4);
    sh("blkdiscard", &[dev]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_image_stays_direct_eligible_through_discards_under_every_policy() {
    let vm = Vm::start().await;
    // mkfs.xfs wants at least 300 MB.
    vm.image("keep", Scratch::Xfs, 304, "full").await;
    // One image served in turn by every backend and policy that can serve
    // it direct; dm's nowait is a linear table over a private ublk worker.
    let turns = [
        ("ublk", "nowait", "mkfs.ext4"),
        ("ublk", "threaded", "mkfs.xfs"),
        ("dm", "nowait", "mkfs.ext4"),
        ("ublk", "direct", "mkfs.xfs"),
        ("dm", "direct", "mkfs.ext4"),
    ];
    for (backend, policy, mkfs) in turns {
        let name = format!("keep-{backend}-{policy}");
        let v = vm
            .volume(json!({"name": name, "image": "keep", "backend": backend, "dispatch": policy}))
            .await;
        assert_eq!(v["dispatch"], policy, "{v}");
        let dev = v["device"].as_str().unwrap().to_string();
        discard_heavy(&dev, mkfs);
        let img = vm.s.get("/v1/images/keep").await.body;
        assert_eq!(img["allocation"], "full", "{img}");
        assert!(
            img["allocated_bytes"].as_u64().unwrap() >= 304 << 20,
            "{backend} {policy}: {img}"
        );
        // Live to direct while fio verify writes and reads across the
        // switch: no hole, no unwritten extent (12 MiB: the switch comes
        // after the first MiB, and verify reads all of it back).
        let fio = fio_verify(&dev, "12M", &[]);
        if policy != "direct" {
            writes_flow(&dev, 1 << 20).await;
            let a =
                vm.s.patch(
                    &format!("/v1/volumes/{name}"),
                    json!({"dispatch": "direct"}),
                )
                .await;
            assert_eq!(a.status.as_u16(), 200, "{backend} {policy}: {}", a.body);
            assert_eq!(a.body["dispatch"], "direct", "{}", a.body);
        }
        fio_ok(fio);
        vm.delete(&name).await;
    }
    // `auto` picks direct for it.
    let v = vm
        .volume(json!({"name": "keep-auto", "image": "keep", "backend": "ublk"}))
        .await;
    assert_eq!(v["dispatch"], "direct", "{v}");
    fio_ok(fio_verify(v["device"].as_str().unwrap(), "8M", &[]));
    vm.delete("keep-auto").await;
}

/// Whether a discard of 16 MiB of fresh data on `dev` punches the image
/// file at `path` (the range is a hole after; fio writing elsewhere meanwhile
/// does not blur it, as the file's allocated bytes would).
fn punches(dev: &str, path: &std::path::Path) -> bool {
    use std::os::fd::AsFd;
    let (from, to) = (200u64 << 20, 216u64 << 20);
    let unwritten = || {
        let f = std::fs::File::open(path).unwrap();
        blockplane_system::extent::unwritten_ranges(f.as_fd(), from, to).unwrap()
    };
    random_at(dev, 200, 16);
    sh("sync", &[]);
    assert_eq!(unwritten(), vec![], "fresh data is written");
    sh("blkdiscard", &["-o", "200MiB", "-l", "16MiB", dev]);
    unwritten() == vec![(from, to)]
}

/// Polls an image until its allocate is no longer running; its last view.
async fn wait_allocate(vm: &Vm, image: &str) -> serde_json::Value {
    for _ in 0..1200 {
        let g = vm.s.get(&format!("/v1/images/{image}")).await.body;
        if g["allocate"]["state"] != "running" {
            return g;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the allocate of image '{image}' still runs after 120 s");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sparse_image_gives_space_back_and_allocate_runs_under_io_cancels_and_survives_a_restart()
{
    // Every 16 MiB stretch of an allocate takes 100 ms more: it runs for
    // seconds on any disk.
    let mut vm = Vm::start_with_env(&[("BLOCKPLANE_TEST_FAULT", "slow_allocate")]).await;
    vm.image("thin", Scratch::Xfs, 256, "sparse").await;
    let path = vm.root(Scratch::Xfs).join("thin.img");
    let v = vm
        .volume(json!({"name": "thin", "image": "thin", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    // Discard punches: the range is a hole, the file's allocated bytes drop.
    let allocated = |b: serde_json::Value| b["allocated_bytes"].as_u64().unwrap();
    random_at(&dev, 0, 16);
    sh("sync", &[]);
    let before = allocated(vm.s.get("/v1/images/thin").await.body);
    assert!(before >= 16 << 20, "{before}");
    assert!(punches(&dev, &path), "a sparse image gives space back");
    sh("blkdiscard", &["-o", "0", "-l", "16MiB", &dev]);
    let after = allocated(vm.s.get("/v1/images/thin").await.body);
    assert!(
        after < 1 << 20,
        "discard gave space back: {before} -> {after}"
    );

    // Allocate while fio verify writes and reads it; the worker's control
    // socket keeps answering (stats, a policy switch) while it fills.
    let fio = fio_verify(&dev, "32M", &[]);
    writes_flow(&dev, 1 << 20).await;
    let a = vm.s.post("/v1/images/thin/allocate", json!(null)).await;
    assert_eq!(a.status.as_u16(), 202, "{}", a.body);
    assert_eq!(a.body["allocate"]["state"], "running", "{}", a.body);
    let t = std::time::Instant::now();
    let st = vm.s.get("/v1/volumes/thin/stats").await;
    assert_eq!(st.status.as_u16(), 200, "{}", st.body);
    let sw =
        vm.s.patch("/v1/volumes/thin", json!({"dispatch": "threaded"}))
            .await;
    assert_eq!(sw.status.as_u16(), 200, "{}", sw.body);
    let answered = t.elapsed();
    let g = vm.s.get("/v1/images/thin").await.body;
    assert_eq!(g["allocate"]["state"], "running", "{g}");
    assert!(
        answered < std::time::Duration::from_secs(5),
        "the worker answered in {answered:?} while it filled"
    );
    let done = g["allocate"]["done_bytes"].as_u64().unwrap();
    assert!(
        done > 0 && done < g["allocate"]["total_bytes"].as_u64().unwrap(),
        "{g}"
    );
    // Cancel: the image stays sparse and the worker punches again.
    let c = vm.s.delete("/v1/images/thin/allocate").await;
    assert_eq!(c.status.as_u16(), 200, "{}", c.body);
    assert_eq!(c.body["allocate"]["state"], "cancelled", "{}", c.body);
    assert_eq!(c.body["allocation"], "sparse", "{}", c.body);
    assert!(
        punches(&dev, &path),
        "a cancelled allocate leaves the image punched on discard"
    );

    // Again; the service crashes mid-way and the worker goes on: the image
    // is still as declared, and an allocate re-run takes up the worker's fill.
    let a = vm.s.post("/v1/images/thin/allocate", json!(null)).await;
    assert_eq!(a.status.as_u16(), 202, "{}", a.body);
    eventually(
        Duration::from_secs(60),
        "the allocate's first bytes",
        async || {
            let g = vm.s.get("/v1/images/thin").await.body;
            g["allocate"]["done_bytes"].as_u64().unwrap_or(0) > 0
        },
    )
    .await;
    vm.s.kill();
    vm.s.restart().await;
    let g = vm.s.get("/v1/images/thin").await.body;
    assert_eq!(g["allocation"], "sparse", "{g}");
    assert_eq!(g["allocate"], serde_json::Value::Null, "{g}");
    let a = vm.s.post("/v1/images/thin/allocate", json!(null)).await;
    assert_eq!(a.status.as_u16(), 202, "{}", a.body);
    let end = wait_allocate(&vm, "thin").await;
    assert_eq!(end["allocate"]["state"], "done", "{end}");
    assert_eq!(end["allocation"], "full", "{end}");
    fio_ok(fio);
    // From now on the volume does not punch: discards leave it eligible, and
    // it goes direct live while fio verify runs.
    sh("blkdiscard", &[&dev]);
    let fio = fio_verify(&dev, "24M", &[]);
    writes_flow(&dev, 1 << 20).await;
    let a =
        vm.s.patch("/v1/volumes/thin", json!({"dispatch": "direct"}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    fio_ok(fio);
    vm.delete("thin").await;
}
