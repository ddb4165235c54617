//! Faults: a failing disk, a power cut, a storm of worker crashes, a full
//! filesystem. The service stays up and loses nothing it acknowledged.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::logwrites::LoggedFs;
use crate::{Scratch, Vm, dmsetup, eventually, fio_ok, fio_verify, run, sh};

/// A filesystem on a device-mapper device over a loop device, whose table a
/// test can swap: `linear` (healthy) or `error` ranges.
struct FlakyFs {
    name: String,
    lo: String,
    sectors: u64,
    mnt: PathBuf,
    fs: &'static str,
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

/// 4 KiB blocks that say what they are: phase, block number and this run's nonce.
fn labelled(phase: &str, blocks: u64, nonce: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity((blocks * 4096) as usize);
    for b in 0..blocks {
        let line = format!("{phase} block {b} run {nonce}\n");
        let block: Vec<u8> = line.bytes().cycle().take(4096).collect();
        out.extend_from_slice(&block);
    }
    out
}

/// What a 4 KiB block of a replayed image holds, for a failure message.
fn describe(block: &[u8]) -> String {
    if block.iter().all(|b| *b == 0) {
        "zeroes".into()
    } else {
        String::from_utf8_lossy(&block[..block.len().min(60)])
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    }
}

/// A write of `data` at `offset` MiB of `dev`, through a file (dd's flags say how).
fn dd_write(dev: &str, data: &[u8], offset_mib: u64, flags: &[&str]) {
    let src = format!("/tmp/cut-{}.src", std::process::id());
    std::fs::write(&src, data).unwrap();
    let (input, output, seek) = (
        format!("if={src}"),
        format!("of={dev}"),
        format!("seek={offset_mib}"),
    );
    let mut args = vec![
        input.as_str(),
        output.as_str(),
        "bs=1M",
        seek.as_str(),
        "status=none",
    ];
    args.extend_from_slice(flags);
    sh("dd", &args);
    let _ = std::fs::remove_file(&src);
}

/// Power cut, for real. The image filesystem sits on `dm-log-writes` (see
/// `logwrites.rs`), whose log keeps only what reached stable storage. Per
/// backend and policy, through the volume's device: a FUA write (O_DSYNC), then
/// a write followed by fsync (a FLUSH), then a write never flushed, then a mark.
/// Replaying the log to that mark is the disk a power cut then leaves: the FUA
/// and flushed writes must be there, and the unflushed one must not (which
/// shows the cut is real). The FUA write comes first so that its own flush, on
/// a path that turns FUA into write + flush, cannot rescue the flushed write.
#[tokio::test(flavor = "multi_thread")]
async fn data_acknowledged_before_a_flush_survives_a_power_cut() {
    let cases: [(&str, Option<&str>); 7] = [
        ("ublk", Some("nowait")),
        ("ublk", Some("threaded")),
        ("ublk", Some("direct")),
        ("dm", Some("direct")),
        ("dm", Some("nowait")),
        ("dm", Some("threaded")),
        ("loop", None),
    ];
    let mut disk = LoggedFs::new("cut", 160);
    let vm = Vm::start_with_roots(vec![disk.root()]).await;
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let (fua, flushed, unflushed) = (
        labelled("fua", 256, &nonce),
        labelled("flushed", 512, &nonce),
        labelled("unflushed", 256, &nonce),
    );
    for (i, (backend, policy)) in cases.iter().enumerate() {
        let name = format!("cut{i}");
        let img = disk.root().join(format!("{name}.img"));
        let a = vm
            .s
            .post("/v1/images", json!({"name": name, "path": img, "create": {"size_bytes": 8 << 20, "allocation": "full"}}))
            .await;
        assert_eq!(a.status.as_u16(), 201, "{}", a.body);
        let mut body = json!({"name": name, "image": name, "backend": backend});
        if let Some(p) = policy {
            body["dispatch"] = json!(p);
        }
        let v = vm.volume(body).await;
        let dev = v["device"].as_str().unwrap().to_string();
        // The image and the volume are set up and stable: not what is tested.
        sh("sync", &["-f", disk.root().to_str().unwrap()]);
        dd_write(&dev, &fua, 0, &["oflag=direct,dsync"]);
        dd_write(&dev, &flushed, 1, &["oflag=direct", "conv=fsync"]);
        dd_write(&dev, &unflushed, 4, &["oflag=direct"]);
        disk.mark(&name);
        vm.delete(&name).await;
    }
    drop(vm);
    disk.finish();
    let mut failures = Vec::new();
    let marks = disk.replay(|mark, replayed| {
        let Some(i) = mark
            .strip_prefix("cut")
            .and_then(|n| n.parse::<usize>().ok())
        else {
            return;
        };
        let (backend, policy) = cases[i];
        let image = disk.on_copy(replayed, |mnt| {
            std::fs::read(mnt.join("images").join(format!("{mark}.img")))
        });
        let image = match image {
            Ok(b) => b,
            Err(e) => {
                failures.push(format!(
                    "{backend} {policy:?}: image gone after the cut: {e}"
                ));
                return;
            }
        };
        let at = |mib: usize, len: usize| &image[mib << 20..(mib << 20) + len];
        for (what, mib, data) in [("FUA write", 0, &fua), ("flushed write", 1, &flushed)] {
            if at(mib, data.len()) != data.as_slice() {
                let bad = (0..data.len() / 4096)
                    .find(|b| {
                        at(mib, data.len())[b * 4096..(b + 1) * 4096]
                            != data[b * 4096..(b + 1) * 4096]
                    })
                    .unwrap();
                failures.push(format!(
                    "{backend} {policy:?}: {what} lost in the power cut (block {bad} holds {:?})",
                    describe(&at(mib, data.len())[bad * 4096..(bad + 1) * 4096])
                ));
            }
        }
        if at(4, unflushed.len()) == unflushed.as_slice() {
            failures.push(format!(
                "{backend} {policy:?}: a write never flushed survived: the cut is not real"
            ));
        }
    });
    let cuts = marks.iter().filter(|m| m.starts_with("cut")).count();
    assert_eq!(cuts, cases.len(), "marks in the log: {marks:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Writes the volume's worker has completed so far.
async fn write_ops(vm: &Vm, volume: &str) -> u64 {
    let st = vm.s.get(&format!("/v1/volumes/{volume}/stats")).await.body;
    st["write"]["ops"].as_u64().unwrap_or(0)
}

/// Twenty SIGKILLs of the worker per policy, each while fio is writing (its
/// write count moved in the last 300 ms). Each fio run writes with crc32c
/// headers and then verifies everything it wrote, so every kill lands between
/// writes and the verify that reads them back.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_worker_kills_under_fio_verify() {
    let vm = Vm::start().await;
    vm.image("storm", Scratch::Xfs, 64, "full").await;
    for policy in ["nowait", "threaded", "direct"] {
        let v = vm
            .volume(
                json!({"name": "storm", "image": "storm", "backend": "ublk", "dispatch": policy}),
            )
            .await;
        let dev = v["device"].as_str().unwrap().to_string();
        let mut pid = v["worker_pid"].as_u64().unwrap();
        let (mut kills, mut runs) = (0, 0);
        while kills < 20 {
            let mut fio = fio_verify(&dev, "24M", &[]);
            runs += 1;
            while kills < 20 {
                let before = write_ops(&vm, "storm").await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                if fio.try_wait().unwrap().is_some() {
                    break;
                }
                if write_ops(&vm, "storm").await == before {
                    // Verifying, not writing: this run's kills are done.
                    continue;
                }
                sh("kill", &["-9", &pid.to_string()]);
                kills += 1;
                let old = pid;
                eventually(
                    Duration::from_secs(60),
                    "a replacement worker",
                    async || {
                        let now = vm.s.get("/v1/volumes/storm").await.body["worker_pid"].as_u64();
                        if let Some(p) = now.filter(|p| *p != old) {
                            pid = p;
                            true
                        } else {
                            false
                        }
                    },
                )
                .await;
            }
            let text = fio_ok(fio);
            assert!(
                text.contains("write: IOPS") && text.contains("read: IOPS"),
                "{policy}: fio did not write and read back:\n{text}"
            );
        }
        let st = vm.s.get("/v1/volumes/storm/stats").await.body;
        assert_eq!(st["worker_restarts"], 20, "{policy}: {st}");
        assert_eq!(st["write"]["errors"], 0, "{policy}: {st}");
        assert_eq!(st["read"]["errors"], 0, "{policy}: {st}");
        eprintln!("{policy}: 20 kills over {runs} verified fio runs");
        vm.delete("storm").await;
    }
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
