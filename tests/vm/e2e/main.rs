//! Kernel end-to-end tests: the real service with real ublk and dm devices.
//! Built on the host, run inside a VM booting Debian's kernels by
//! `tests/vm/run-suite.sh` (the host kernel has neither driver). Scratch
//! filesystems come from `guest-setup.sh`: xfs and ext4 on linear dm devices,
//! and ext4 directly on a disk.

// A test crate: its `pub` items serve its own modules, not readers of an API.
#![allow(missing_docs)]

pub use blockplane_test_support::wait::eventually;
use blockplane_test_support::wait::require_vm;
use blockplane_test_support::{builds, drift, harness, leaks};

mod backups;
mod controlplane;
mod dm;
mod encryption;
mod exports;
mod faults;
mod keepalloc;
mod live;
mod logwrites;
mod moves;
mod pagecache;
mod snapshots;
mod soak;
mod supervision;
mod ublk;
mod upgrade;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use harness::{Opts, Service};
use serde_json::{Value, json};

/// A scratch filesystem of the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scratch {
    /// xfs (reflink) on a linear dm device.
    Xfs,
    /// ext4 on a linear dm device.
    Ext4,
    /// ext4 mounted directly on a disk.
    Plain,
    /// The guest's tmpfs.
    Tmpfs,
}

impl Scratch {
    fn base(self) -> PathBuf {
        let var = match self {
            Scratch::Xfs => "SCRATCH_XFS",
            Scratch::Ext4 => "SCRATCH_EXT4",
            Scratch::Plain => "SCRATCH_PLAIN",
            Scratch::Tmpfs => return PathBuf::from("/tmp"),
        };
        PathBuf::from(
            std::env::var(var)
                .unwrap_or_else(|_| panic!("{var} not set: is guest-setup.sh sourced?")),
        )
    }
}

/// A service with image roots on the scratch filesystems.
pub struct Vm {
    pub s: Service,
    roots: Vec<(Scratch, PathBuf)>,
    /// More image roots given at start.
    more: Vec<PathBuf>,
}

/// A test's image roots on the scratch filesystems go with it: the
/// filesystems are shared by the whole suite, and images left behind filled
/// the 3 GiB xfs one.
impl Drop for Vm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failed test leaves its fio running on a volume, whose removal
            // below would wait for it: the logs first, then no fio (the
            // guest runs one test at a time, so every fio is this test's).
            self.s.print_logs();
            let _ = Command::new("pkill").args(["-KILL", "-x", "fio"]).status();
        }
        self.s.stop_and_clean();
        if std::thread::panicking() {
            // What the failed test's service could not remove (a direct dm
            // volume has no worker for the harness to find) would make the
            // next test's service refuse to start: none of it is left.
            remove_blockplane_dm_devices();
        }
        for (_, p) in &self.roots {
            // A pin left by a failed test would keep its file.
            let _ = Command::new("chattr").args(["-R", "-i"]).arg(p).output();
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// Removes every dm device blockplane made: the guest runs one test at a
/// time, so they are the current test's.
fn remove_blockplane_dm_devices() {
    for e in std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Some(name) = harness::remove_blockplane_dm(&e.file_name().to_string_lossy()) {
            eprintln!("removed {name}, left by the failed test");
        }
    }
}

/// Everything a refusal must leave unchanged in the VM: the service's own
/// view ([`harness::Snapshot`]), the kernel's ublk, dm (with their tables) and
/// loop devices, and every file under the image roots with its type, size,
/// mode, mtime, inode and attribute flags (immutable included).
#[derive(Debug, PartialEq)]
pub struct VmSnapshot {
    service: harness::Snapshot,
    ublk: Vec<String>,
    dm_tables: Vec<String>,
    loops: Vec<(String, String)>,
    files: Vec<String>,
}

/// `path type size mode mtime inode flags` of everything under `dir`, sorted.
fn files_under(dir: &std::path::Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            let flags = if m.is_file() || m.is_dir() {
                std::fs::File::open(&p)
                    .ok()
                    .and_then(|f| rustix::fs::ioctl_getflags(&f).ok())
                    .map_or("-".to_string(), |f| format!("{:#x}", f.bits()))
            } else {
                "-".to_string()
            };
            out.push(format!(
                "{} {:?} {} {:o} {}.{} {} {flags}",
                p.display(),
                m.file_type(),
                m.size(),
                m.mode(),
                m.mtime(),
                m.mtime_nsec(),
                m.ino()
            ));
            if m.is_dir() {
                todo.push(p);
            }
        }
    }
    out.sort();
    out
}

impl Vm {
    /// Starts a service whose image roots are fresh directories on every scratch filesystem.
    pub async fn start() -> Self {
        Self::start_with_roots(Vec::new()).await
    }

    /// As [`Vm::start`], with more image roots (e.g. on a test's own filesystem).
    pub async fn start_with_roots(more: Vec<PathBuf>) -> Self {
        Self::start_with(more, Vec::new()).await
    }

    /// As [`Vm::start`], with the service's environment extended (e.g. a
    /// test fault).
    pub async fn start_with_env(env: &[(&str, &str)]) -> Self {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self::start_with(Vec::new(), env).await
    }

    /// As [`Vm::start`], with the service run from `bin` (a copy the test
    /// can replace as a package upgrade does).
    pub async fn start_from(bin: PathBuf) -> Self {
        Self::start_opts(Vec::new(), Vec::new(), Some(bin), &[], None, None).await
    }

    async fn start_with(more: Vec<PathBuf>, env: Vec<(String, String)>) -> Self {
        Self::start_opts(more, env, None, &[], None, None).await
    }

    /// As [`Vm::start`], with more arguments to `serve`.
    pub async fn start_with_args(args: &[&str]) -> Self {
        Self::start_opts(Vec::new(), Vec::new(), None, args, None, None).await
    }

    /// As [`Vm::start`], with the service's environment extended and more
    /// arguments to `serve`.
    pub async fn start_with_env_and_args(env: &[(&str, &str)], args: &[&str]) -> Self {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self::start_opts(Vec::new(), env, None, args, None, None).await
    }

    /// As [`Vm::start`], in network namespace `netns` (one "host" of a test
    /// with two), with more arguments to `serve`.
    pub async fn start_in(netns: &str, args: &[&str]) -> Self {
        Self::start_opts(Vec::new(), Vec::new(), None, args, Some(netns), None).await
    }

    /// As [`Vm::start_in`], the service run from `bin` when given (a
    /// release build, for a benchmark).
    pub async fn start_in_from(netns: &str, args: &[&str], bin: Option<PathBuf>) -> Self {
        Self::start_opts(Vec::new(), Vec::new(), bin, args, Some(netns), None).await
    }

    /// As [`Vm::start_in`] (in the VM's own namespace for `None`), the API
    /// guarded by bearer `token`, which the test's client sends: a host
    /// another host's service calls.
    pub async fn start_guarded(
        netns: Option<&str>,
        args: &[&str],
        token: &str,
        more: Vec<PathBuf>,
    ) -> Self {
        Self::start_opts(more, Vec::new(), None, args, netns, Some(token)).await
    }

    async fn start_opts(
        more: Vec<PathBuf>,
        env: Vec<(String, String)>,
        bin: Option<PathBuf>,
        args: &[&str],
        netns: Option<&str>,
        token: Option<&str>,
    ) -> Self {
        require_vm();
        let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
        let roots: Vec<(Scratch, PathBuf)> =
            [Scratch::Xfs, Scratch::Ext4, Scratch::Plain, Scratch::Tmpfs]
                .into_iter()
                .map(|k| {
                    let p = k.base().join(format!("t-{tag}"));
                    std::fs::create_dir_all(&p).unwrap();
                    (k, p)
                })
                .collect();
        let s = Service::start_with(Opts {
            extra_roots: roots
                .iter()
                .map(|(_, p)| p.clone())
                .chain(more.iter().cloned())
                .collect(),
            extra_args: ["--extent-check-secs", "2"]
                .iter()
                // No VM test is about a key's cost; a timed one costs
                // seconds of benchmark per key under the emulator.
                .chain(&harness::CHEAP_KEYS)
                .chain(args)
                .map(|a| a.to_string())
                .collect(),
            env,
            bin,
            netns: netns.map(str::to_string),
            token: token.map(str::to_string),
            ..Default::default()
        })
        .await;
        Self { s, roots, more }
    }

    /// Records what a refusal must not change (see [`VmSnapshot`]).
    pub async fn snapshot(&self) -> VmSnapshot {
        let mut ublk: Vec<String> = std::fs::read_dir("/dev")
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ublk"))
            .collect();
        ublk.sort();
        let out = Command::new("dmsetup")
            .arg("table")
            .env("DM_DISABLE_UDEV", "1")
            .output()
            .unwrap();
        let mut dm_tables: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        dm_tables.sort();
        let mut loops = harness::loop_devices();
        loops.sort();
        let files = self
            .roots
            .iter()
            .map(|(_, p)| p)
            .chain(&self.more)
            .flat_map(|p| files_under(p))
            .collect();
        VmSnapshot {
            service: self.s.snapshot().await,
            ublk,
            dm_tables,
            loops,
            files,
        }
    }

    /// The image root on `k`.
    pub fn root(&self, k: Scratch) -> PathBuf {
        self.roots.iter().find(|(r, _)| *r == k).unwrap().1.clone()
    }

    /// Creates an image file of `mib` MiB on `k` and registers it.
    pub async fn image(&self, name: &str, k: Scratch, mib: u64, allocation: &str) -> Value {
        let path = self.root(k).join(format!("{name}.img"));
        let a = self
            .s
            .post(
                "/v1/images",
                json!({"name": name, "path": path, "create": {"size_bytes": mib << 20, "allocation": allocation}}),
            )
            .await;
        assert_eq!(a.status.as_u16(), 201, "{}", a.body);
        a.body
    }

    /// Makes `copy` a reflinked copy (shared extents) of the xfs image
    /// `orig` and registers it as image `copy`; panics unless 201.
    pub async fn reflinked_copy(&self, orig: &str) {
        let orig = self.root(Scratch::Xfs).join(format!("{orig}.img"));
        let copy = self.root(Scratch::Xfs).join("copy.img");
        sh(
            "cp",
            &[
                "--reflink=always",
                orig.to_str().unwrap(),
                copy.to_str().unwrap(),
            ],
        );
        sh("chmod", &["600", copy.to_str().unwrap()]);
        let a = self
            .s
            .post("/v1/images", json!({"name": "copy", "path": copy}))
            .await;
        assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    }

    /// Creates a volume and returns it; panics unless 201.
    pub async fn volume(&self, body: Value) -> Value {
        let a = self.s.post("/v1/volumes", body).await;
        assert_eq!(a.status.as_u16(), 201, "{}\n{}", a.body, self.s.log_text());
        a.body
    }

    /// Switches a volume's policy; panics unless 200.
    pub async fn set_dispatch(&self, volume: &str, dispatch: &str) -> Value {
        let a = self
            .s
            .patch(
                &format!("/v1/volumes/{volume}"),
                json!({"dispatch": dispatch}),
            )
            .await;
        assert_eq!(a.status.as_u16(), 200, "{}", a.body);
        a.body
    }

    /// Deletes a volume; panics unless 204.
    pub async fn delete(&self, volume: &str) {
        let a = self.s.delete(&format!("/v1/volumes/{volume}")).await;
        assert_eq!(a.status.as_u16(), 204, "{}", a.body);
    }

    /// Restarts the service with test fault `fault` (e.g. `kill_after_change`)
    /// and sends a request it must die in the middle of; returns once it is
    /// dead.
    pub async fn die_during(
        &mut self,
        fault: &str,
        method: hyper::Method,
        path: &str,
        body: Option<Value>,
    ) {
        self.s.kill();
        self.start_with_fault(fault).await;
        self.dies_in(method, path, body).await;
    }

    /// Waits while the object at `path` (an image, a backup) is in state
    /// `running`; panics unless it then is `want`. Its last view. Only a
    /// hung job ends this by time: its end is the condition.
    pub async fn ended(&self, path: &str, running: &str, want: &str) -> Value {
        let started = Instant::now();
        loop {
            let now = self.s.get(path).await.body;
            if now["state"] != running {
                assert_eq!(now["state"], want, "{path}: {now}\n{}", self.s.log_text());
                return now;
            }
            assert!(
                started.elapsed() < Duration::from_secs(900),
                "{path} is still {running}: {now}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts the stopped service (which reconciles what it finds) with test
    /// fault `fault` armed.
    pub async fn start_with_fault(&mut self, fault: &str) {
        self.s.spawn(&[("BLOCKPLANE_TEST_FAULT", fault)]);
        self.s.wait_ready().await;
    }

    /// Sends a request the service (started with a test fault) must die in
    /// the middle of; returns once it is dead.
    pub async fn dies_in(&mut self, method: hyper::Method, path: &str, body: Option<Value>) {
        let client = blockplane_client::Transport::new(
            blockplane_client::Endpoint::Unix(self.s.sock.clone()),
            None,
        );
        let answer = client.send(method.clone(), path, body.as_ref()).await;
        assert!(
            answer.is_err(),
            "the service should have died in {method} {path}: {answer:?}"
        );
        assert!(
            !self.s.wait_exit(Duration::from_secs(30)).success(),
            "{method} {path}"
        );
    }

    /// Event kinds of a volume, oldest first.
    pub async fn event_kinds(&self, volume_id: &str) -> Vec<String> {
        let ev = self
            .s
            .get(&format!("/v1/events?volume={volume_id}&limit=1000"))
            .await
            .body;
        ev.as_array()
            .unwrap()
            .iter()
            .map(|e| e["kind"].as_str().unwrap().to_string())
            .collect()
    }
}

/// Runs `dmsetup` without udev (the guest has none); panics with its stderr
/// on failure, returns its trimmed stdout.
pub fn dmsetup(args: &[&str]) -> String {
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

/// One 4 KiB `O_DIRECT` write at the start of `dev`.
pub fn direct_write(dev: &str) -> Output {
    run(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={dev}"),
            "bs=4k",
            "count=1",
            "oflag=direct",
            "status=none",
        ],
    )
}

/// [`direct_write`] that must succeed.
pub fn direct_write_ok(dev: &str) {
    let w = direct_write(dev);
    assert!(
        w.status.success(),
        "dd to {dev} failed ({}): {}",
        w.status,
        String::from_utf8_lossy(&w.stderr)
    );
}

/// Runs a command to success; returns its stdout.
pub fn sh(cmd: &str, args: &[&str]) -> String {
    let out = run(cmd, args);
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command, whatever its outcome.
pub fn run(cmd: &str, args: &[&str]) -> Output {
    Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"))
}

/// fio with a write-then-verify job on `dev` (crc32c), as a child process.
/// Its 900 s bound only ends a hung job: the slowest runs seen (five jobs at
/// once in an emulated guest on a loaded host) took over 300 s.
pub fn fio_verify(dev: &str, size: &str, extra: &[&str]) -> Child {
    Command::new("timeout")
        .args(["900", "fio", "--name=verify", "--filename"])
        .arg(dev)
        .args([
            "--rw=randwrite",
            "--bs=4k",
            "--ioengine=io_uring",
            "--iodepth=16",
            "--direct=1",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            "--randrepeat=0",
        ])
        .arg(format!("--size={size}"))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio")
}

/// Waits for fio and asserts it succeeded with no error.
pub fn fio_ok(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "fio failed ({}):\n{text}", out.status);
    assert!(text.contains("err= 0"), "fio reported errors:\n{text}");
    text
}

/// Sectors written to block device `dev` (`/dev/NAME`) so far, from
/// `/sys/block/NAME/stat` (counted at completion).
pub fn sectors_written(dev: &str) -> u64 {
    let name = dev.rsplit('/').next().unwrap();
    let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat")).unwrap();
    stat.split_whitespace().nth(6).unwrap().parse().unwrap()
}

/// Waits until `dev` completes at least `bytes` more writes, so that what
/// the caller does next happens while a writer is at work; panics if the
/// writes stop (e.g. fio finished its write phase): no write completed for
/// 60 s. A slow writer (a loaded host, an emulated guest) is waited for as
/// long as it makes progress. Returns the time waited.
pub async fn writes_flow(dev: &str, bytes: u64) -> Duration {
    const STALL: Duration = Duration::from_secs(60);
    let started = Instant::now();
    let from = sectors_written(dev);
    let (mut last, mut moved_at) = (from, Instant::now());
    while (last - from) * 512 < bytes {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = sectors_written(dev);
        if now != last {
            (last, moved_at) = (now, Instant::now());
        }
        assert!(
            moved_at.elapsed() < STALL,
            "{dev}: no write completed in {STALL:?} ({} of {bytes} bytes after {:?}): nothing is writing",
            (last - from) * 512,
            started.elapsed()
        );
    }
    started.elapsed()
}

/// Whether the file carries the immutable attribute.
pub fn is_immutable(path: &std::path::Path) -> bool {
    let out = sh("lsattr", &[path.to_str().unwrap()]);
    out.split_whitespace().next().unwrap_or("").contains('i')
}
