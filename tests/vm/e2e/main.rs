//! Kernel end-to-end tests: the real service with real ublk and dm devices.
//! Built on the host, run inside a VM booting Debian's kernels by
//! `tests/vm/run-suite.sh` (the host kernel has neither driver). Scratch
//! filesystems come from `guest-setup.sh`: xfs and ext4 on linear dm devices,
//! and ext4 directly on a disk.

#[path = "../../blackbox/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "../../blackbox/leaks.rs"]
mod leaks;

mod dm;
mod faults;
mod live;
mod soak;
mod ublk;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use harness::{Opts, Service};
use serde_json::{Value, json};

/// Panics unless running inside the test VM (its kernel command line says so).
pub fn in_vm() {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    assert!(
        cmdline.contains("blockplane_vm=1"),
        "these tests need ublk_drv and dm-mod: run them with tests/vm/run-suite.sh"
    );
}

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
}

impl Vm {
    /// Starts a service whose image roots are fresh directories on every scratch filesystem.
    pub async fn start() -> Self {
        Self::start_with_roots(Vec::new()).await
    }

    /// As [`Vm::start`], with more image roots (e.g. on a test's own filesystem).
    pub async fn start_with_roots(more: Vec<PathBuf>) -> Self {
        in_vm();
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
            extra_roots: roots.iter().map(|(_, p)| p.clone()).chain(more).collect(),
            extra_args: vec!["--extent-check-secs".into(), "2".into()],
            ..Default::default()
        })
        .await;
        Self { s, roots }
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
pub fn fio_verify(dev: &str, size: &str, extra: &[&str]) -> Child {
    Command::new("timeout")
        .args(["300", "fio", "--name=verify", "--filename"])
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
/// writes stop (e.g. fio finished its write phase). Returns the time waited.
pub async fn writes_flow(dev: &str, bytes: u64) -> Duration {
    let started = Instant::now();
    let from = sectors_written(dev);
    while (sectors_written(dev) - from) * 512 < bytes {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{dev}: fewer than {bytes} bytes written in 30 s: nothing is writing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// Polls `f` until it is true, up to `within`.
pub async fn eventually(within: Duration, what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether the file carries the immutable attribute.
pub fn is_immutable(path: &std::path::Path) -> bool {
    let out = sh("lsattr", &[path.to_str().unwrap()]);
    out.split_whitespace().next().unwrap_or("").contains('i')
}
