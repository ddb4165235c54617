//! Faults: a failing disk, a power cut, a storm of worker crashes, a full
//! filesystem. The service stays up and loses nothing it acknowledged.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

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
    dd_write_on(None, dev, data, offset_mib, flags);
}

/// [`dd_write`] from a process pinned to CPU `cpu`, if given.
fn dd_write_on(cpu: Option<usize>, dev: &str, data: &[u8], offset_mib: u64, flags: &[&str]) {
    let src = format!("/tmp/cut-{}.src", std::process::id());
    std::fs::write(&src, data).unwrap();
    let (input, output, seek) = (
        format!("if={src}"),
        format!("of={dev}"),
        format!("seek={offset_mib}"),
    );
    let cpu = cpu.map(|c| c.to_string());
    let mut args = match &cpu {
        Some(c) => vec!["-c", c.as_str(), "dd"],
        None => Vec::new(),
    };
    args.extend([
        input.as_str(),
        output.as_str(),
        "bs=1M",
        seek.as_str(),
        "status=none",
    ]);
    args.extend_from_slice(flags);
    sh(if cpu.is_some() { "taskset" } else { "dd" }, &args);
    let _ = std::fs::remove_file(&src);
}

/// 4 KiB blocks of `data` found anywhere in `image`.
fn blocks_found(image: &[u8], data: &[u8]) -> usize {
    let want: std::collections::HashSet<&[u8]> = data.chunks(4096).collect();
    image.chunks(4096).filter(|b| want.contains(b)).count()
}

/// Reads and writes, flushes each queue of a worker's volume completed so far.
fn per_queue(vm: &Vm, volume_id: &str) -> Vec<[u64; 4]> {
    let stats = vm.s.data.join(format!("run/ublk/{volume_id}/stats"));
    blockplane_protocol::completed_per_queue(&stats).unwrap()
}

/// Queue by queue, what a worker completed between `before` and `after`:
/// (writes, flushes).
fn queue_delta(before: &[[u64; 4]], after: &[[u64; 4]]) -> Vec<(u64, u64)> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| (a[1] - b[1], a[2] - b[2]))
        .collect()
}

/// The queue of ublk device `dev` (`/dev/ublkbN`) that requests from CPU
/// `cpu` enter (blk-mq's map, in sysfs).
fn queue_of_cpu(dev: &str, cpu: usize) -> usize {
    let name = dev.rsplit('/').next().unwrap();
    let mq = format!("/sys/block/{name}/mq");
    for q in std::fs::read_dir(&mq).unwrap().flatten() {
        let cpus = std::fs::read_to_string(q.path().join("cpu_list")).unwrap();
        let has = cpus.trim().split(',').any(|r| {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            (a.trim().parse().unwrap_or(usize::MAX)..=b.trim().parse().unwrap_or(0)).contains(&cpu)
        });
        if has {
            return q.file_name().to_string_lossy().parse().unwrap();
        }
    }
    panic!("no queue of {dev} maps CPU {cpu} ({mq})")
}

/// Flushes served by the volume's worker (the ublk one, or a dm volume's
/// private one); `None` when no worker serves it.
fn worker_flushes(vm: &Vm, volume_id: &str) -> Option<u64> {
    use blockplane_protocol::{Answer, Request, talk};
    let sock = vm.s.data.join(format!("run/ublk/{volume_id}/ctl.sock"));
    match talk(&sock, &Request::Stats {}, Duration::from_secs(10)) {
        Ok(Answer::Stats(s)) => Some(s.flush.ops),
        _ => None,
    }
}

/// Power cut, for real. The image filesystem sits on `dm-log-writes` (see
/// `logwrites.rs`), whose log keeps only what reached stable storage. Per
/// backend and policy, through the volume's device, each followed by a mark
/// (a replay to a mark is the disk a power cut then leaves):
///
/// 1. An `O_DSYNC` write (which the block layer sends as a FUA write and then
///    a FLUSH), a write followed by fsync (a FLUSH), and a write never
///    flushed: the first two must be there, the third must not (which shows
///    the cut is real). The `O_DSYNC` write comes first so that its own flush
///    cannot rescue the flushed write.
/// 2. A FLUSH covers writes completed on other queues (issue 26 item 1): a
///    write from a process pinned to CPU 0, then a flush from one pinned to
///    CPU 1, then the other way round; where a worker serves, its per-queue
///    counters show the write and the flush each on the queue blk-mq maps
///    its CPU to (sysfs `mq/*/cpu_list`), and nowhere else (the write with
///    no flush of its own).
/// 3. A bare FUA write, nothing flushed after it (issue 26 item 1): ext4 on
///    the volume, a file written and committed, then overwritten in place
///    with `O_DIRECT | O_DSYNC`, which the filesystem sends as FUA writes
///    alone (no FLUSH: the worker's flush count does not move). A data path
///    that ignored FUA loses it. dm `direct` and loop sit on a loop device,
///    which has no FUA: there the kernel sends a FLUSH after the write.
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
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert!(cpus >= 2, "two CPUs, so two queues, are needed: {cpus}");
    let mut disk = LoggedFs::new("cut", 160);
    let vm = Vm::start_with_roots(vec![disk.root()]).await;
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let (dsync, flushed, unflushed) = (
        labelled("dsync", 256, &nonce),
        labelled("flushed", 512, &nonce),
        labelled("unflushed", 256, &nonce),
    );
    // Whole 1 MiB blocks of dd: a short last block makes dd fsync it.
    let queue_writes = [
        labelled("queue0", 256, &nonce),
        labelled("queue1", 256, &nonce),
    ];
    let (before_fua, fua) = (labelled("pre-fua", 64, &nonce), labelled("fua", 64, &nonce));
    let mut failures = Vec::new();
    for (i, (backend, policy)) in cases.iter().enumerate() {
        let what = format!("{backend} {policy:?}");
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
        let (id, dev) = (
            v["id"].as_str().unwrap().to_string(),
            v["device"].as_str().unwrap().to_string(),
        );
        let worker = worker_flushes(&vm, &id).is_some();
        // The image and the volume are set up and stable: not what is tested.
        sh("sync", &["-f", disk.root().to_str().unwrap()]);
        dd_write(&dev, &dsync, 0, &["oflag=direct,dsync"]);
        dd_write(&dev, &flushed, 1, &["oflag=direct", "conv=fsync"]);
        dd_write(&dev, &unflushed, 4, &["oflag=direct"]);
        disk.mark(&name);

        // The ublk device the worker serves: the volume's, or a dm volume's private one.
        let ublk = worker.then(|| match *backend {
            "ublk" => dev.clone(),
            _ => worker_status(&vm, &id)["device"]
                .as_str()
                .unwrap()
                .to_string(),
        });
        for (round, data) in queue_writes.iter().enumerate() {
            let (writer, flusher) = (round % 2, (round + 1) % 2);
            let before = worker.then(|| per_queue(&vm, &id));
            dd_write_on(
                Some(writer),
                &dev,
                data,
                5 + round as u64,
                &["oflag=direct"],
            );
            let written = worker.then(|| per_queue(&vm, &id));
            sh("taskset", &["-c", &flusher.to_string(), "sync", &dev]);
            if let (Some(before), Some(written), Some(ublk)) = (before, written, &ublk) {
                let (wq, fq) = (queue_of_cpu(ublk, writer), queue_of_cpu(ublk, flusher));
                let write = queue_delta(&before, &written);
                let flush = queue_delta(&written, &per_queue(&vm, &id));
                let only = |d: &[(u64, u64)], q: usize, f: fn(&(u64, u64)) -> u64| {
                    d.iter().enumerate().all(|(i, x)| (f(x) > 0) == (i == q))
                };
                let unflushed = write.iter().all(|x| x.1 == 0);
                if wq == fq
                    || !unflushed
                    || !only(&write, wq, |x| x.0)
                    || !only(&flush, fq, |x| x.1)
                {
                    failures.push(format!(
                        "{what}: a write from CPU {writer} (queue {wq}) and a flush from CPU {flusher} (queue {fq}) did not land there alone: (writes, flushes) per queue for the write {write:?}, for the flush {flush:?}"
                    ));
                }
            }
            disk.mark(&format!("{name}-q{round}"));
        }

        let mnt = PathBuf::from(format!("/tmp/cut-fs-{i}"));
        crate::logwrites::ext4_on(&dev, &mnt);
        let file = mnt.join("fua");
        std::fs::write(&file, &before_fua).unwrap();
        sh("sync", &["-f", mnt.to_str().unwrap()]);
        let flushes = worker_flushes(&vm, &id);
        dd_into(&file, &fua, &["oflag=direct,dsync", "conv=notrunc"]);
        if let (Some(a), Some(b)) = (flushes, worker_flushes(&vm, &id))
            && a != b
        {
            failures.push(format!(
                "{what}: the O_DSYNC overwrite reached the worker with {} flushes, not as FUA writes alone",
                b - a
            ));
        }
        disk.mark(&format!("{name}-fua"));
        sh("umount", &[mnt.to_str().unwrap()]);
        vm.delete(&name).await;
    }
    drop(vm);
    disk.finish();
    let marks = disk.replay(|mark, replayed| {
        let Some((i, step)) = mark.strip_prefix("cut").and_then(|m| {
            let (n, step) = m.split_once('-').unwrap_or((m, ""));
            Some((n.parse::<usize>().ok()?, step.to_string()))
        }) else {
            return;
        };
        let (backend, policy) = cases[i];
        let what = format!("{backend} {policy:?}");
        let image = disk.on_copy(replayed, |mnt| {
            std::fs::read(mnt.join("images").join(format!("cut{i}.img")))
        });
        let image = match image {
            Ok(b) => b,
            Err(e) => {
                failures.push(format!("{what}: image gone after the cut at {mark}: {e}"));
                return;
            }
        };
        let at = |mib: usize, len: usize| &image[mib << 20..(mib << 20) + len];
        let mut must_hold = |what_write: &str, mib: usize, data: &[u8]| {
            if at(mib, data.len()) != data {
                let bad = (0..data.len() / 4096)
                    .find(|b| {
                        at(mib, data.len())[b * 4096..(b + 1) * 4096]
                            != data[b * 4096..(b + 1) * 4096]
                    })
                    .unwrap();
                failures.push(format!(
                    "{what}: {what_write} lost in the power cut at {mark} (block {bad} holds {:?})",
                    describe(&at(mib, data.len())[bad * 4096..(bad + 1) * 4096])
                ));
            }
        };
        match step.as_str() {
            "" => {
                must_hold("O_DSYNC write", 0, &dsync);
                must_hold("flushed write", 1, &flushed);
                if at(4, unflushed.len()) == unflushed.as_slice() {
                    failures.push(format!(
                        "{what}: a write never flushed survived: the cut is not real"
                    ));
                }
            }
            "q0" => must_hold("a write on queue 0 flushed from queue 1", 5, &queue_writes[0]),
            "q1" => must_hold("a write on queue 1 flushed from queue 0", 6, &queue_writes[1]),
            "fua" => {
                let found = blocks_found(&image, &fua);
                if found != fua.len() / 4096 {
                    failures.push(format!(
                        "{what}: a FUA write with no flush after it lost in the power cut: {found} of its {} blocks there, {} of the file's earlier ones",
                        fua.len() / 4096,
                        blocks_found(&image, &before_fua)
                    ));
                }
            }
            other => panic!("mark {mark}: step {other}"),
        }
    });
    let cuts = marks.iter().filter(|m| m.starts_with("cut")).count();
    assert_eq!(cuts, 4 * cases.len(), "marks in the log: {marks:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Writes `data` over the start of the existing file `file` with dd.
fn dd_into(file: &std::path::Path, data: &[u8], flags: &[&str]) {
    let src = format!("/tmp/cut-{}.fua", std::process::id());
    std::fs::write(&src, data).unwrap();
    let (input, output) = (format!("if={src}"), format!("of={}", file.display()));
    let mut args = vec![input.as_str(), output.as_str(), "bs=64k", "status=none"];
    args.extend_from_slice(flags);
    sh("dd", &args);
    let _ = std::fs::remove_file(&src);
}

/// Writes the volume's worker has completed so far.
async fn write_ops(vm: &Vm, volume: &str) -> u64 {
    let st = vm.s.get(&format!("/v1/volumes/{volume}/stats")).await.body;
    st["write"]["ops"].as_u64().unwrap_or(0)
}

/// Twenty SIGKILLs of a worker: ten on `nowait`, then five on each other
/// policy, each while fio is writing (its write count moved in the last
/// 300 ms). Each fio run writes with crc32c headers and then verifies
/// everything it wrote, so every kill lands between writes and the verify
/// that reads them back. Ten and five, not more: the recovery is the same
/// code on each policy, and from the second kill on each kill repeats the
/// last one; the storm's length is what the lanes' budget cannot spare.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_worker_kills_under_fio_verify() {
    let vm = Vm::start().await;
    vm.image("storm", Scratch::Xfs, 64, "full").await;
    for (policy, storm) in [("nowait", 10), ("threaded", 5), ("direct", 5)] {
        let v = vm
            .volume(
                json!({"name": "storm", "image": "storm", "backend": "ublk", "dispatch": policy}),
            )
            .await;
        let dev = v["device"].as_str().unwrap().to_string();
        let mut pid = v["worker_pid"].as_u64().unwrap();
        let (mut kills, mut runs) = (0, 0);
        while kills < storm {
            let mut fio = fio_verify(&dev, "24M", &[]);
            runs += 1;
            while kills < storm {
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
        assert_eq!(st["worker_restarts"], storm, "{policy}: {st}");
        assert_eq!(st["write"]["errors"], 0, "{policy}: {st}");
        assert_eq!(st["read"]["errors"], 0, "{policy}: {st}");
        eprintln!("{policy}: {storm} kills over {runs} verified fio runs");
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

/// What the kernel holds for one service: its dm devices (by volume id), the
/// ublk devices (block and char: a device added and never started has only
/// the char one), and its workers (volume id, pid), each set minus what was
/// there before the test began.
#[derive(Debug, Default, PartialEq)]
struct Held {
    dm: BTreeSet<String>,
    ublk: BTreeSet<String>,
    workers: BTreeSet<(String, u32)>,
}

impl Held {
    fn now(data: &std::path::Path) -> Self {
        let dm = dmsetup(&["ls"])
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.strip_prefix("blockplane-"))
            .map(str::to_string)
            .collect();
        let ublk = std::fs::read_dir("/dev")
            .unwrap()
            .flatten()
            .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
            .filter(|n| n.starts_with("/dev/ublkb") || n.starts_with("/dev/ublkc"))
            .collect();
        // A worker's command line is `blockplane worker --spec JSON`, its
        // spec naming its run dir under the data dir.
        let run = data.join("run/ublk").display().to_string();
        let mut workers = BTreeSet::new();
        for p in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            let args: Vec<String> = cmd
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if args.get(1).map(String::as_str) == Some("worker")
                && let Some(spec) = args.get(3).filter(|s| s.contains(&run))
            {
                let spec: Value = serde_json::from_str(spec).unwrap();
                workers.insert((spec["volume_id"].as_str().unwrap().to_string(), pid));
            }
        }
        Self { dm, ublk, workers }
    }

    /// Holds ublk device `dev` (`/dev/ublkbN`): its block and char nodes.
    fn ublk(&mut self, dev: &str) {
        self.ublk.insert(dev.to_string());
        self.ublk
            .insert(dev.replacen("/dev/ublkb", "/dev/ublkc", 1));
    }

    fn minus(mut self, base: &Held) -> Self {
        self.dm.retain(|d| !base.dm.contains(d));
        self.ublk.retain(|d| !base.ublk.contains(d));
        self.workers.retain(|w| !base.workers.contains(w));
        self
    }
}

/// The worker of a volume (a dm volume's private one too) as it describes
/// itself on its control socket.
pub(crate) fn worker_status(vm: &Vm, volume_id: &str) -> Value {
    use blockplane_protocol::{Answer, Request, talk};
    let sock = vm.s.data.join(format!("run/ublk/{volume_id}/ctl.sock"));
    match talk(&sock, &Request::Status {}, Duration::from_secs(10)) {
        Ok(Answer::Status(s)) => serde_json::to_value(*s).unwrap(),
        other => panic!("worker of {volume_id}: {other:?}"),
    }
}

/// Checks that the service's rows and the kernel agree: every volume is
/// attached on a device that exists, served as its row says (dispatch,
/// read-only, size) by exactly the workers and dm devices it needs, and
/// nothing else is held. Returns the volumes.
async fn rows_and_kernel_agree(vm: &Vm, base: &Held, step: &str) -> Vec<Value> {
    let vols = vm.s.get("/v1/volumes").await.body;
    let vols = vols.as_array().unwrap().clone();
    let mut want = Held::default();
    for v in &vols {
        let (id, dev) = (v["id"].as_str().unwrap(), v["device"].as_str());
        assert_eq!(v["state"], "attached", "{step}: {v}");
        let dev = dev.unwrap_or_else(|| panic!("{step}: no device: {v}"));
        assert!(
            std::path::Path::new(dev).exists(),
            "{step}: the row names {dev}, which does not exist"
        );
        let size: u64 = sh("blockdev", &["--getsize64", dev])
            .trim()
            .parse()
            .unwrap();
        assert_eq!(
            v["size_bytes"], size,
            "{step}: the row's size is not {dev}'s: {v}"
        );
        let ro = sh("blockdev", &["--getro", dev]).trim() == "1";
        match v["backend"].as_str().unwrap() {
            "ublk" => {
                want.ublk(dev);
                let pid = v["worker_pid"].as_u64().unwrap() as u32;
                want.workers.insert((id.to_string(), pid));
                let w = worker_status(vm, id);
                for (field, worker) in [("dispatch", "dispatch"), ("read_only", "read_only")] {
                    assert_eq!(
                        v[field], w[worker],
                        "{step}: the row's {field} is not the worker's: row {v}\nworker {w}"
                    );
                }
                // A resize the kernel cannot apply live (no UPDATE_SIZE)
                // leaves the worker's image larger than the device.
                if v["resize_pending"] != true {
                    assert_eq!(w["size_bytes"], size, "{step}: worker {w}");
                }
            }
            "dm" => {
                want.dm.insert(id.to_string());
                let name = format!("blockplane-{id}");
                let node = dmsetup(&["info", "-c", "--noheadings", "-o", "blkdevname", &name]);
                assert_eq!(format!("/dev/{node}"), dev, "{step}: {name}");
                assert_eq!(
                    v["read_only"], ro,
                    "{step}: the row's read_only is not the dm device's: {v}"
                );
                if v["dispatch"] != "direct" {
                    let w = worker_status(vm, id);
                    assert_eq!(v["dispatch"], w["dispatch"], "{step}: private worker {w}");
                    assert_eq!(v["read_only"], w["read_only"], "{step}: private worker {w}");
                    want.ublk(w["device"].as_str().unwrap());
                    want.workers
                        .insert((id.to_string(), w["pid"].as_u64().unwrap() as u32));
                }
            }
            other => panic!("{step}: backend {other}"),
        }
    }
    let held = Held::now(&vm.s.data).minus(base);
    assert_eq!(
        held, want,
        "{step}: what the kernel holds (left) is not what the rows say (right)"
    );
    vols
}

/// 64 KiB of data unique to `step`, written with `O_DIRECT` at `at` bytes
/// into `dev` and read back the same way.
fn round_trip(dev: &str, at: u64, step: &str) {
    let data: Vec<u8> = format!("{step} {}|", uuid::Uuid::new_v4())
        .into_bytes()
        .into_iter()
        .cycle()
        .take(64 << 10)
        .collect();
    let file = std::env::temp_dir().join(format!("rt-{}", uuid::Uuid::new_v4()));
    std::fs::write(&file, &data).unwrap();
    let block = (at >> 16).to_string();
    let w = run(
        "dd",
        &[
            &format!("if={}", file.display()),
            &format!("of={dev}"),
            "bs=64k",
            "count=1",
            &format!("seek={block}"),
            "oflag=direct",
            "conv=notrunc",
            "status=none",
        ],
    );
    std::fs::remove_file(&file).unwrap();
    assert!(
        w.status.success(),
        "{step}: a write to {dev} failed: {}",
        String::from_utf8_lossy(&w.stderr)
    );
    let r = run(
        "dd",
        &[
            &format!("if={dev}"),
            "bs=64k",
            "count=1",
            &format!("skip={block}"),
            "iflag=direct",
            "status=none",
        ],
    );
    assert!(r.status.success(), "{step}: a read of {dev} failed");
    assert!(
        r.stdout == data,
        "{step}: {dev} did not read back what was written"
    );
}

/// Writes 40 4 KiB blocks with `O_DIRECT`; returns how many requests the
/// worker held back for QoS meanwhile.
async fn throttled_by(vm: &Vm, name: &str, dev: &str) -> u64 {
    let count = async || {
        vm.s.get(&format!("/v1/volumes/{name}/stats")).await.body["qos_throttled"]
            .as_u64()
            .unwrap()
    };
    let before = count().await;
    sh(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={dev}"),
            "bs=4k",
            "count=40",
            "oflag=direct",
            "status=none",
        ],
    );
    count().await - before
}

/// Checks a volume made by a create the service died in: reconciled, on
/// the policy it was created with, and data round-trips.
async fn created(vm: &Vm, base: &Held, created: &str, step: &str) {
    let vols = rows_and_kernel_agree(vm, base, step).await;
    assert_eq!(vols.len(), 1, "{step}: {vols:?}");
    assert_eq!(vols[0]["dispatch"], created, "{step}: {}", vols[0]);
    round_trip(vols[0]["device"].as_str().unwrap(), 0, step);
}

/// Checks that no volume is left, nor anything of one in the kernel.
async fn none_left(vm: &Vm, base: &Held, step: &str) {
    let vols = rows_and_kernel_agree(vm, base, step).await;
    assert!(vols.is_empty(), "{step}: {vols:?}");
}

/// The service SIGKILLed in a PATCH of volume `name` (on `backend`) with
/// `change`, then started again (with the test fault `fault`, if given): the
/// row's settings stand and the device is back to them (the PATCH wholly
/// undone), and it round-trips data. Returns the device.
async fn a_dead_patch_is_undone(
    vm: &mut Vm,
    base: &Held,
    (name, backend): (&str, &str),
    change: &Value,
    fault: Option<&str>,
    what: &str,
) -> String {
    let path = format!("/v1/volumes/{name}");
    let before = vm.s.get(&path).await.body;
    let dev = before["device"].as_str().unwrap().to_string();
    vm.dies_in(hyper::Method::PATCH, &path, Some(change.clone()))
        .await;
    match fault {
        Some(f) => vm.start_with_fault(f).await,
        None => vm.s.restart().await,
    }
    let v = rows_and_kernel_agree(vm, base, what).await.remove(0);
    for f in [
        "dispatch",
        "requested_dispatch",
        "read_only",
        "qos",
        "device",
    ] {
        assert_eq!(v[f], before[f], "{what}: {f} changed: {v}");
    }
    round_trip(&dev, 0, what);
    if backend == "ublk" {
        assert_eq!(
            throttled_by(vm, name, &dev).await,
            0,
            "{what}: the worker still throttles"
        );
    }
    dev
}

/// The service is SIGKILLed at each step of each state change of a ublk
/// volume and of dm volumes (direct and over a private worker): between the
/// row and the device of a create (and a create failing there), between the
/// device's removal and the row's of a delete, between the changes of a PATCH
/// (dispatch switch, read-only, QoS for ublk) made on the device and their
/// record, and the same for a resize. After each restart the rows and the
/// kernel agree (no device or worker leaked, no row naming a missing device,
/// the row's settings are the device's, those of the last answered request),
/// data round-trips through the device, and a final delete leaves nothing.
/// (The dm volume over a private worker skips the create and delete steps
/// the direct one covers the same way: its changes and resize are its own.)
#[tokio::test(flavor = "multi_thread")]
async fn a_service_killed_at_any_step_of_a_ublk_or_dm_change_is_reconciled_at_restart() {
    let mut vm = Vm::start().await;
    let base = Held::now(&vm.s.data);
    let post = hyper::Method::POST;
    for (backend, created_as, every_create_step, change) in [
        (
            "ublk",
            "nowait",
            true,
            json!({"dispatch": "threaded", "read_only": true, "qos": {"iops": 10}}),
        ),
        (
            "dm",
            "direct",
            true,
            json!({"dispatch": "nowait", "read_only": true}),
        ),
        (
            "dm",
            "nowait",
            false,
            json!({"dispatch": "threaded", "read_only": true}),
        ),
    ] {
        let started = Instant::now();
        let name = format!("{backend}-{created_as}");
        vm.image(&name, Scratch::Xfs, 32, "full").await;
        let spec = json!({"name": name, "image": name, "backend": backend, "dispatch": created_as});
        let path = format!("/v1/volumes/{name}");
        let step = |s: &str| format!("{name}, killed {s}");
        // Each start with the next step's fault armed first reconciles what
        // the last crash left, which is then checked.
        vm.s.kill();
        if every_create_step {
            vm.start_with_fault("kill_after_insert").await;
            vm.dies_in(post.clone(), "/v1/volumes", Some(spec.clone()))
                .await;
            vm.start_with_fault("kill_after_detach").await;
            created(&vm, &base, created_as, &step("in a create after the row")).await;
            vm.dies_in(hyper::Method::DELETE, &path, None).await;
            vm.start_with_fault("fail_after_attach").await;
            none_left(&vm, &base, &step("in a delete after the device went")).await;
            assert_eq!(vm.s.get(&path).await.status.as_u16(), 404);
            let a = vm.s.post("/v1/volumes", spec.clone()).await;
            assert_eq!(a.status.as_u16(), 500, "fail_after_attach: {}", a.body);
            none_left(
                &vm,
                &base,
                &format!("{name}: a create failed after the device"),
            )
            .await;
            vm.s.kill();
        }
        if every_create_step {
            vm.start_with_fault("kill_after_attach").await;
            vm.dies_in(post.clone(), "/v1/volumes", Some(spec.clone()))
                .await;
        } else {
            vm.s.restart().await;
            vm.volume(spec.clone()).await;
            vm.s.kill();
        }
        vm.start_with_fault("kill_after_change").await;
        let what = match every_create_step {
            true => step("in a create after the device"),
            false => format!("{name}: created, then killed"),
        };
        created(&vm, &base, created_as, &what).await;

        // A PATCH: the device has every change, the row none, the client got
        // no answer: the row's settings stand.
        let what = step(&format!("after the changes of PATCH {change}"));
        let restart = Some("kill_after_change");
        let dev =
            a_dead_patch_is_undone(&mut vm, &base, (&name, backend), &change, restart, &what).await;

        // Resize: the image and the device grew, neither row says so.
        let what = step("after a resize");
        let resize = format!("/v1/images/{name}/resize");
        vm.dies_in(post.clone(), &resize, Some(json!({"size_bytes": 48 << 20})))
            .await;
        vm.s.restart().await;
        let v = rows_and_kernel_agree(&vm, &base, &what).await.remove(0);
        let image = vm.s.get(&format!("/v1/images/{name}")).await.body;
        let file = vm.root(Scratch::Xfs).join(format!("{name}.img"));
        assert_eq!(
            image["size_bytes"],
            std::fs::metadata(&file).unwrap().len(),
            "{what}: {image}"
        );
        if v["resize_pending"] == true {
            assert_eq!(v["size_bytes"], 32 << 20, "{what}: {v}");
        } else {
            assert_eq!(v["size_bytes"], 48 << 20, "{what}: {v}");
            round_trip(&dev, 40 << 20, &what);
        }
        round_trip(&dev, 0, &what);

        vm.delete(&name).await;
        none_left(&vm, &base, &format!("{name}: deleted")).await;
        assert!(!crate::is_immutable(&file), "{name}: still pinned");
        eprintln!("{name}: every step in {:?}", started.elapsed());
    }
}

/// The ublk worker of a ublk volume, and the private one of a dm volume, is
/// SIGKILLed right after each live change: its replacement serves the
/// changed state (the policy in the API and in the worker's own status, a
/// read-only volume refusing an `O_DIRECT` write while it reads (a ublk
/// volume's refusal is EIO: its disk's read-only flag is fixed at start), the
/// QoS limit, the new size), and data round-trips.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_killed_after_each_live_change_serves_the_changed_state() {
    let vm = Vm::start().await;
    for backend in ["ublk", "dm"] {
        let started = Instant::now();
        let name = format!("wk-{backend}");
        vm.image(&name, Scratch::Xfs, 32, "full").await;
        let v = vm
            .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": "nowait"}))
            .await;
        let (id, dev) = (v["id"].as_str().unwrap(), v["device"].as_str().unwrap());
        let path = format!("/v1/volumes/{name}");
        let patch = async |body: Value| {
            let a = vm.s.patch(&path, body).await;
            assert_eq!(a.status.as_u16(), 200, "{name}: {}", a.body);
        };

        let what = format!("{name}: worker killed after a switch to threaded");
        vm.set_dispatch(&name, "threaded").await;
        crate::live::kill_worker(&vm, id).await;
        let now = vm.s.get(&path).await.body;
        assert_eq!(now["dispatch"], "threaded", "{what}: {now}");
        let w = worker_status(&vm, id);
        assert_eq!(w["dispatch"], "threaded", "{what}: the worker says {w}");
        round_trip(dev, 0, &what);

        let what = format!("{name}: worker killed after read_only true");
        patch(json!({"read_only": true})).await;
        crate::live::kill_worker(&vm, id).await;
        let w = crate::direct_write(dev);
        assert!(
            !w.status.success(),
            "{what}: an O_DIRECT write succeeded on a read-only volume"
        );
        assert_eq!(worker_status(&vm, id)["read_only"], true, "{what}");
        // Refused, not failed: the device still reads.
        let r = run(
            "dd",
            &[
                &format!("if={dev}"),
                "of=/dev/null",
                "bs=4k",
                "count=1",
                "iflag=direct",
            ],
        );
        assert!(r.status.success(), "{what}: a read failed: {r:?}");
        patch(json!({"read_only": false})).await;
        round_trip(dev, 0, &what);

        if backend == "ublk" {
            let what = format!("{name}: worker killed after qos iops 10");
            patch(json!({"qos": {"iops": 10}})).await;
            crate::live::kill_worker(&vm, id).await;
            let started = Instant::now();
            let held = throttled_by(&vm, &name, dev).await;
            assert!(
                held > 0 && started.elapsed() >= Duration::from_secs(2),
                "{what}: 40 writes took {:?}, {held} held back",
                started.elapsed()
            );
            patch(json!({"qos": null})).await;
        }

        let what = format!("{name}: worker killed after a resize");
        let a =
            vm.s.post(
                &format!("/v1/images/{name}/resize"),
                json!({"size_bytes": 48 << 20}),
            )
            .await;
        assert_eq!(a.status.as_u16(), 200, "{what}: {}", a.body);
        crate::live::kill_worker(&vm, id).await;
        let now = vm.s.get(&path).await.body;
        let size: u64 = sh("blockdev", &["--getsize64", dev])
            .trim()
            .parse()
            .unwrap();
        assert_eq!(now["size_bytes"], size, "{what}: {now}");
        if now["resize_pending"] == true {
            assert_eq!(size, 32 << 20, "{what}: {now}");
        } else {
            assert_eq!(size, 48 << 20, "{what}: {now}");
            assert_eq!(worker_status(&vm, id)["size_bytes"], 48 << 20, "{what}");
            round_trip(dev, 40 << 20, &what);
        }
        round_trip(dev, 0, &what);
        vm.delete(&name).await;
        eprintln!("{name}: every kill in {:?}", started.elapsed());
    }
}

/// What a service killed inside an attach left (`left`, minus what was
/// there before), if it is the half-made device of that step: a ublk device
/// added, never started (its char node only, no worker), or a dm device
/// with no table.
fn half_made(left: &Held, backend: &str) -> Result<(), String> {
    let ok = match backend {
        "ublk" => {
            left.workers.is_empty()
                && left.ublk.len() == 1
                && left.ublk.iter().all(|d| d.starts_with("/dev/ublkc"))
        }
        _ => {
            left.dm.len() == 1
                && left
                    .dm
                    .iter()
                    .all(|id| dmsetup(&["table", &format!("blockplane-{id}")]).is_empty())
        }
    };
    if ok {
        Ok(())
    } else {
        Err(format!("not a half-made {backend} device: {left:?}"))
    }
}

/// Issue 26 item 5: the service is SIGKILLed inside an attach (a ublk
/// device its worker added and did not start, the worker dying there too;
/// a dm device created with no table yet, over its private worker or with
/// its image pinned) and between the first and the second change of one
/// PATCH; and a ublk worker alone dies after adding its device, which fails
/// the create and must leave nothing.
/// After each restart the rows and the kernel agree (no device, char device
/// or worker left over: [`rows_and_kernel_agree`]). The create stands: its
/// row was recorded before the device, so the volume is attached again and
/// data round-trips. The PATCH is wholly undone: the client got no answer,
/// the row recorded none of it, and the row is what the device is brought
/// back to (a PATCH is recorded in one commit, after all its changes).
#[tokio::test(flavor = "multi_thread")]
async fn a_service_killed_inside_an_attach_or_between_two_changes_is_reconciled_at_restart() {
    let mut vm = Vm::start().await;
    let base = Held::now(&vm.s.data);
    for (backend, created_as, fault, change) in [
        (
            "ublk",
            "nowait",
            "kill_after_add",
            json!({"dispatch": "threaded", "read_only": true, "qos": {"iops": 10}}),
        ),
        (
            "dm",
            "direct",
            "kill_after_create",
            json!({"dispatch": "nowait", "read_only": true}),
        ),
        (
            "dm",
            "nowait",
            "kill_after_create",
            json!({"dispatch": "threaded", "read_only": true}),
        ),
    ] {
        let started = Instant::now();
        let name = format!("mid-{backend}-{created_as}");
        vm.image(&name, Scratch::Xfs, 16, "full").await;
        let file = vm.root(Scratch::Xfs).join(format!("{name}.img"));
        let spec = json!({"name": name, "image": name, "backend": backend, "dispatch": created_as});
        vm.s.kill();
        if backend == "ublk" {
            // The worker alone dies there: the create fails, leaving nothing.
            vm.start_with_fault("fail_after_add").await;
            let a = vm.s.post("/v1/volumes", spec.clone()).await;
            assert_eq!(a.status.as_u16(), 500, "fail_after_add: {}", a.body);
            none_left(
                &vm,
                &base,
                &format!("{name}: its worker died after adding its device"),
            )
            .await;
            vm.s.kill();
        }
        vm.start_with_fault(fault).await;
        vm.dies_in(hyper::Method::POST, "/v1/volumes", Some(spec))
            .await;
        let what = format!("{name}, killed inside its attach ({fault})");
        half_made(&Held::now(&vm.s.data).minus(&base), backend)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        vm.start_with_fault("kill_after_first_change").await;
        created(&vm, &base, created_as, &what).await;
        assert_eq!(
            crate::is_immutable(&file),
            created_as == "direct",
            "{what}: the pin"
        );

        let what = format!("{name}, killed between the changes of PATCH {change}");
        a_dead_patch_is_undone(&mut vm, &base, (&name, backend), &change, None, &what).await;
        vm.delete(&name).await;
        none_left(&vm, &base, &format!("{name}: deleted")).await;
        assert!(!crate::is_immutable(&file), "{name}: still pinned");
        eprintln!("{name}: both kills in {:?}", started.elapsed());
    }
}
