//! The soak loop shared by the host test (loop volumes) and the VM test
//! (ublk and dm volumes): rounds of images and volumes created, written,
//! read back and deleted, with a leak check after every round and the
//! control plane's RSS printed as a series.
//!
//! The short version runs in the normal test run; `BLOCKPLANE_SOAK=1` runs
//! the long one (64 volumes × 20 rounds on the host).

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};
use sqlx::Connection;

use crate::harness::{Service, loop_devices_under};

/// How much to do.
pub struct Plan {
    pub volumes: usize,
    pub rounds: usize,
}

impl Plan {
    /// `long` when `BLOCKPLANE_SOAK=1`, else `short`.
    pub fn pick(short: Plan, long: Plan) -> Plan {
        if std::env::var("BLOCKPLANE_SOAK").as_deref() == Ok("1") {
            long
        } else {
            short
        }
    }
}

/// What one round measured after its deletes.
#[derive(Debug)]
pub struct Round {
    pub rss_kib: u64,
    pub fds: usize,
}

/// Runs `plan` with volume `i` made from `specs[i % specs.len()]` (the
/// backend/dispatch part of a create request) on images under `root`;
/// panics on the first leak. Returns one [`Round`] per round.
pub async fn soak(s: &Service, root: &Path, specs: &[Value], plan: &Plan) -> Vec<Round> {
    let mut rounds = Vec::new();
    for round in 0..plan.rounds {
        let mut images = Vec::new();
        for i in 0..plan.volumes {
            let name = format!("soak-{round}-{i}");
            let path = root.join(format!("{name}.img"));
            let a = s
                .post(
                    "/v1/images",
                    json!({"name": name, "path": path, "create": {"size_bytes": 4 << 20, "allocation": "full"}}),
                )
                .await;
            assert_eq!(a.status.as_u16(), 201, "image {name}: {}", a.body);
            let mut spec = specs[i % specs.len()].clone();
            spec["name"] = json!(name);
            spec["image"] = json!(name);
            let v = s.post("/v1/volumes", spec).await;
            assert_eq!(v.status.as_u16(), 201, "volume {name}: {}", v.body);
            a_little_io(v.body["device"].as_str().unwrap(), i);
            images.push((name, path));
        }
        for (name, path) in &images {
            let d = s.delete(&format!("/v1/volumes/{name}")).await;
            assert_eq!(d.status.as_u16(), 204, "delete volume {name}: {}", d.body);
            assert!(!is_immutable(path), "{name}: image still immutable");
            let d = s
                .delete(&format!("/v1/images/{name}?delete_file=true"))
                .await;
            assert_eq!(d.status.as_u16(), 204, "delete image {name}: {}", d.body);
            assert!(!path.exists(), "{name}: image file left");
        }
        assert_nothing_left(s, root).await;
        let r = Round {
            rss_kib: rss_kib(s.pid()),
            fds: fd_count(s.pid()),
        };
        eprintln!(
            "soak round {:>2}: {} volumes, control plane RSS {} KiB, {} fds",
            round + 1,
            plan.volumes,
            r.rss_kib,
            r.fds
        );
        rounds.push(r);
    }
    rounds
}

/// Panics unless RSS and open files stayed flat from round 2 on: within
/// 10% (at least 8 MiB) and 8 descriptors of round 2. Allocator arenas and
/// caches settle in the first rounds; growth after that is a leak.
pub fn assert_flat(rounds: &[Round]) {
    let series: Vec<u64> = rounds.iter().map(|r| r.rss_kib).collect();
    eprintln!("soak: control-plane RSS series (KiB): {series:?}");
    let Some(base) = rounds.get(1) else { return };
    let rss_slack = (base.rss_kib / 10).max(8 << 10);
    for (i, r) in rounds.iter().enumerate().skip(2) {
        assert!(
            r.rss_kib <= base.rss_kib + rss_slack,
            "RSS grew after round 2: round {} has {} KiB, round 2 had {} KiB ({series:?})",
            i + 1,
            r.rss_kib,
            base.rss_kib
        );
        assert!(
            r.fds <= base.fds + 8,
            "open files grew after round 2: round {} has {}, round 2 had {}",
            i + 1,
            r.fds,
            base.fds
        );
    }
}

/// Writes 64 KiB of a pattern at an offset that depends on `i`, bypassing
/// the page cache, and reads it back.
fn a_little_io(dev: &str, i: usize) {
    let seek = (i % 32).to_string();
    let run = |args: &[&str]| {
        let out = Command::new("dd").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "dd {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let pattern = vec![(i % 251) as u8 + 1; 64 << 10];
    let src = std::env::temp_dir().join(format!("soak-pattern-{}-{i}", std::process::id()));
    std::fs::write(&src, &pattern).unwrap();
    run(&[
        &format!("if={}", src.display()),
        &format!("of={dev}"),
        "bs=64k",
        &format!("seek={seek}"),
        "oflag=direct",
        "conv=fsync",
        "status=none",
    ]);
    let back = run(&[
        &format!("if={dev}"),
        "bs=64k",
        "count=1",
        &format!("skip={seek}"),
        "iflag=direct",
        "status=none",
    ]);
    std::fs::remove_file(&src).unwrap();
    assert!(
        back == pattern,
        "{dev}: read back differs from what was written"
    );
}

/// Panics unless this service holds no device, worker, row or file any more.
async fn assert_nothing_left(s: &Service, root: &Path) {
    for dir in [s.dir.path(), root] {
        assert_eq!(
            loop_devices_under(dir),
            Vec::<String>::new(),
            "loop devices left"
        );
    }
    assert_eq!(
        block_devices("ublkb"),
        Vec::<String>::new(),
        "ublk devices left"
    );
    assert_eq!(
        blockplane_dm_devices(),
        Vec::<String>::new(),
        "dm devices left"
    );
    assert_eq!(
        workers_of(&s.data),
        Vec::<u32>::new(),
        "worker processes left"
    );
    let db = s.data.join("blockplane.db");
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}?mode=ro", db.display()))
        .await
        .unwrap();
    for (table, sql) in [
        ("volumes", "SELECT count(*) FROM volumes"),
        ("images", "SELECT count(*) FROM images"),
    ] {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap();
        assert_eq!(n, 0, "rows left in {table}");
    }
    c.close().await.unwrap();
}

fn is_immutable(path: &Path) -> bool {
    let out = Command::new("lsattr").arg("-d").arg(path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace().next().unwrap_or("").contains('i')
}

/// Block devices whose name starts with `prefix`.
fn block_devices(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// dm devices named `blockplane-*`.
fn blockplane_dm_devices() -> Vec<String> {
    block_devices("dm-")
        .into_iter()
        .filter_map(|d| std::fs::read_to_string(format!("/sys/block/{d}/dm/name")).ok())
        .map(|n| n.trim().to_string())
        .filter(|n| n.starts_with("blockplane-"))
        .collect()
}

/// Worker processes whose command line names `data`.
fn workers_of(data: &Path) -> Vec<u32> {
    let data = data.display().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.get(1).map(String::as_str) == Some("worker")
            && args.iter().any(|a| a.contains(&data))
        {
            out.push(pid);
        }
    }
    out
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}
