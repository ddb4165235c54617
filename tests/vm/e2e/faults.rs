//! Faults: a failing disk, a power cut, a storm of worker crashes, a full
//! filesystem. The service stays up and loses nothing it acknowledged.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::{Scratch, Vm, eventually, fio_ok, fio_verify, run, sh};

/// A filesystem on a device-mapper device over a loop device, whose table a
/// test can swap: `linear` (healthy), `error` ranges, or `flakey` dropping
/// writes (a power cut).
struct FlakyFs {
    name: String,
    lo: String,
    sectors: u64,
    mnt: PathBuf,
    fs: &'static str,
}

fn dmsetup(args: &[&str]) -> String {
    let out = std::process::Command::new("dmsetup")
        .args(args)
        .env("DM_DISABLE_UDEV", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "dmsetup {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

impl FlakyFs {
    fn new(tag: &str, fs: &'static str, mib: u64) -> Self {
        let backing = Scratch::Xfs.base().join(format!("flaky-{tag}.raw"));
        sh(
            "truncate",
            &["-s", &format!("{mib}M"), backing.to_str().unwrap()],
        );
        let lo = sh("losetup", &["-f", "--show", backing.to_str().unwrap()])
            .trim()
            .to_string();
        let sectors = mib * 2048;
        let name = format!("bp-flaky-{tag}");
        dmsetup(&[
            "create",
            &name,
            "--table",
            &format!("0 {sectors} linear {lo} 0"),
        ]);
        let dev = Self::node_of(&name);
        let force = if fs == "xfs" { "-f" } else { "-F" };
        sh(&format!("mkfs.{fs}"), &["-q", force, &dev]);
        let mnt = PathBuf::from(format!("/tmp/flaky-{tag}"));
        std::fs::create_dir_all(&mnt).unwrap();
        sh("mount", &[&dev, mnt.to_str().unwrap()]);
        std::fs::create_dir_all(mnt.join("images")).unwrap();
        Self {
            name,
            lo,
            sectors,
            mnt,
            fs,
        }
    }

    fn node_of(name: &str) -> String {
        format!(
            "/dev/{}",
            dmsetup(&["info", "-c", "--noheadings", "-o", "blkdevname", name])
        )
    }

    fn root(&self) -> PathBuf {
        self.mnt.join("images")
    }

    fn load(&self, table: &str) {
        dmsetup(&["suspend", &self.name]);
        dmsetup(&["load", &self.name, "--table", table]);
        dmsetup(&["resume", &self.name]);
    }

    fn healthy(&self) {
        self.load(&format!("0 {} linear {} 0", self.sectors, self.lo));
    }

    /// Fails every I/O to sectors `[start, start + len)`.
    fn fail_range(&self, start: u64, len: u64) {
        let (s, lo, end) = (self.sectors, &self.lo, start + len);
        self.load(&format!(
            "0 {start} linear {lo} 0\n{start} {len} error\n{end} {} linear {lo} {end}",
            s - end
        ));
    }

    /// From now on every write is acknowledged and dropped: the power is cut.
    fn cut_power(&self) {
        self.load(&format!(
            "0 {} flakey {} 0 0 1 1 drop_writes",
            self.sectors, self.lo
        ));
    }

    /// Unmounts (without saving what was dropped), heals, mounts again.
    fn remount(&self) {
        let m = self.mnt.to_str().unwrap();
        let _ = run("umount", &["-l", m]);
        self.healthy();
        sh("mount", &[&Self::node_of(&self.name), m]);
    }

    /// First physical sector (on the loop device) of a file on this filesystem.
    fn first_sector(&self, file: &std::path::Path) -> u64 {
        let out = sh("filefrag", &["-v", "-b512", file.to_str().unwrap()]);
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with("0:"))
            .expect("an extent");
        line.split(':')
            .nth(2)
            .unwrap()
            .split("..")
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for FlakyFs {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", self.mnt.to_str().unwrap()]);
        let _ = std::process::Command::new("dmsetup")
            .args(["remove", "--force", &self.name])
            .env("DM_DISABLE_UDEV", "1")
            .status();
        let _ = run("losetup", &["-d", &self.lo]);
        let _ = self.fs;
    }
}

fn dd(args: &[&str]) -> std::process::Output {
    std::process::Command::new("timeout")
        .arg("60")
        .arg("dd")
        .args(args)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_disk_reaches_readers_stats_and_events_and_spares_other_volumes() {
    let flaky = FlakyFs::new("eio", "ext4", 64);
    let vm = Vm::start_with_roots(vec![flaky.root()]).await;
    let img = flaky.root().join("bad.img");
    let a = vm
        .s
        .post("/v1/images", json!({"name": "bad", "path": img, "create": {"size_bytes": 16 << 20, "allocation": "full"}}))
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    vm.image("good", Scratch::Ext4, 48, "full").await;
    let good = vm
        .volume(json!({"name": "good", "image": "good", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    for policy in ["nowait", "threaded"] {
        let v = vm
            .volume(json!({"name": "bad", "image": "bad", "backend": "ublk", "dispatch": policy}))
            .await;
        let dev = v["device"].as_str().unwrap().to_string();
        let start = flaky.first_sector(&img);
        flaky.fail_range(start, 2048);
        let fio = fio_verify(good["device"].as_str().unwrap(), "16M", &[]);
        let r = dd(&[
            &format!("if={dev}"),
            "of=/dev/null",
            "bs=64k",
            "count=4",
            "iflag=direct",
        ]);
        assert!(
            !r.status.success(),
            "{policy}: a read of the failed range succeeded"
        );
        assert!(
            String::from_utf8_lossy(&r.stderr).contains("Input/output error"),
            "{r:?}"
        );
        // Outside the failed megabyte, reads work.
        let ok = dd(&[
            &format!("if={dev}"),
            "of=/dev/null",
            "bs=64k",
            "count=4",
            "skip=128",
            "iflag=direct",
        ]);
        assert!(ok.status.success(), "{policy}: {ok:?}");
        let st = vm.s.get("/v1/volumes/bad/stats").await.body;
        assert!(st["read"]["errors"].as_u64().unwrap() >= 1, "{st}");
        let id = v["id"].as_str().unwrap().to_string();
        eventually(Duration::from_secs(15), "an I/O error event", async || {
            vm.event_kinds(&id)
                .await
                .contains(&"volume_io_errors".to_string())
        })
        .await;
        assert_eq!(vm.s.get("/healthz").await.status.as_u16(), 200);
        fio_ok(fio);
        flaky.healthy();
        let again = dd(&[
            &format!("if={dev}"),
            "of=/dev/null",
            "bs=64k",
            "count=4",
            "iflag=direct",
        ]);
        assert!(again.status.success(), "{again:?}");
        vm.delete("bad").await;
    }
    vm.delete("good").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn data_acknowledged_before_a_flush_survives_a_power_cut() {
    for (backend, policy) in [
        ("ublk", "nowait"),
        ("ublk", "threaded"),
        ("ublk", "direct"),
        ("dm", "direct"),
        ("dm", "nowait"),
    ] {
        let tag = format!("cut-{backend}-{policy}");
        let flaky = FlakyFs::new(&tag, "ext4", 64);
        let mut vm = Vm::start_with_roots(vec![flaky.root()]).await;
        let img = flaky.root().join("cut.img");
        let a = vm
            .s
            .post("/v1/images", json!({"name": "cut", "path": img, "create": {"size_bytes": 16 << 20, "allocation": "full"}}))
            .await;
        assert_eq!(a.status.as_u16(), 201, "{}", a.body);
        let v = vm
            .volume(json!({"name": "cut", "image": "cut", "backend": backend, "dispatch": policy}))
            .await;
        let dev = v["device"].as_str().unwrap().to_string();
        let pattern = format!("/tmp/{tag}.a");
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
        // Write A and flush it (fsync of the device sends FLUSH).
        sh(
            "dd",
            &[
                &format!("if={pattern}"),
                &format!("of={dev}"),
                "bs=1M",
                "oflag=direct",
                "conv=fsync",
                "status=none",
            ],
        );
        // The power goes: later writes are acknowledged and lost.
        flaky.cut_power();
        sh(
            "dd",
            &[
                "if=/dev/urandom",
                &format!("of={dev}"),
                "bs=1M",
                "count=4",
                "seek=8",
                "oflag=direct",
                "status=none",
            ],
        );
        // Everything dies at once: no clean detach.
        // (kill_workers_of removes a dm table stacked on a worker's device
        // before deleting that device.)
        vm.s.kill();
        crate::harness::kill_workers_of(&vm.s.data);
        let _ = std::process::Command::new("dmsetup")
            .args([
                "remove",
                "--force",
                &format!("blockplane-{}", v["id"].as_str().unwrap()),
            ])
            .env("DM_DISABLE_UDEV", "1")
            .status();
        let _ = run("chattr", &["-i", img.to_str().unwrap()]);
        flaky.remount();
        let got = sh(
            "bash",
            &[
                "-c",
                &format!(
                    "cmp <(head -c 4194304 {}) {pattern} && echo same",
                    img.display()
                ),
            ],
        );
        assert!(
            got.contains("same"),
            "{backend} {policy}: flushed data lost after the power cut"
        );
        drop(vm);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_worker_kills_under_fio_verify() {
    let vm = Vm::start().await;
    vm.image("storm", Scratch::Xfs, 64, "full").await;
    let v = vm
        .volume(json!({"name": "storm", "image": "storm", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let mut fio = fio_verify(&dev, "48M", &["--loops=20"]);
    let mut kills = 0;
    let mut pid = v["worker_pid"].as_u64().unwrap();
    while kills < 20 {
        assert!(
            fio.try_wait().unwrap().is_none(),
            "fio ended after {kills} kills; make it longer"
        );
        tokio::time::sleep(Duration::from_millis(700)).await;
        sh("kill", &["-9", &pid.to_string()]);
        kills += 1;
        let before = pid;
        eventually(
            Duration::from_secs(60),
            "a replacement worker",
            async || {
                let now = vm.s.get("/v1/volumes/storm").await.body["worker_pid"].as_u64();
                if let Some(p) = now.filter(|p| *p != before) {
                    pid = p;
                    true
                } else {
                    false
                }
            },
        )
        .await;
    }
    let _ = std::process::Command::new("kill")
        .arg(fio.id().to_string())
        .status();
    let out = fio.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    // Stopped by us (SIGTERM), not by an I/O error or a verify failure.
    assert!(
        !text.contains("verify:") || text.contains("err= 0"),
        "{text}"
    );
    assert!(
        !text.contains("Input/output error") && !text.contains("bad magic"),
        "{text}"
    );
    let st = vm.s.get("/v1/volumes/storm/stats").await.body;
    assert_eq!(st["worker_restarts"], 20, "{st}");
    assert_eq!(st["write"]["errors"], 0);
    assert_eq!(st["read"]["errors"], 0);
    // And the data is intact: a final verify pass over what was written.
    fio_ok(fio_verify(&dev, "8M", &[]));
    vm.delete("storm").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_filesystem_is_enospc_not_a_hang() {
    let small = FlakyFs::new("full", "ext4", 48);
    let vm = Vm::start_with_roots(vec![small.root()]).await;
    let img = small.root().join("sparse.img");
    let a =
        vm.s.post(
            "/v1/images",
            json!({"name": "sparse", "path": img, "create": {"size_bytes": 256 << 20}}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    let v = vm
        .volume(json!({"name": "full", "image": "sparse", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let started = Instant::now();
    let w = dd(&[
        "if=/dev/zero",
        &format!("of={dev}"),
        "bs=1M",
        "count=200",
        "oflag=direct",
    ]);
    assert!(
        started.elapsed() < Duration::from_secs(55),
        "the write hung"
    );
    assert!(!w.status.success());
    assert!(
        String::from_utf8_lossy(&w.stderr).contains("No space left on device"),
        "{w:?}"
    );
    assert_eq!(vm.s.get("/healthz").await.status.as_u16(), 200);
    assert_eq!(vm.s.get("/v1/volumes/full").await.body["state"], "attached");
    sh(
        "dd",
        &[
            &format!("if={dev}"),
            "of=/dev/null",
            "bs=1M",
            "count=16",
            "iflag=direct",
            "status=none",
        ],
    );
    let st = vm.s.get("/v1/volumes/full/stats").await.body;
    assert!(st["write"]["errors"].as_u64().unwrap() >= 1, "{st}");
    vm.delete("full").await;
}
