//! A filesystem whose disk remembers only what reached stable storage, for
//! power-cut tests.
//!
//! `dm-log-writes` sits under the filesystem and logs a write only once it is
//! on stable storage: a plain write when a later FLUSH completes, a FUA write
//! when it completes (fstests checks crash consistency the same way). A mark
//! (`dmsetup message NAME 0 mark LABEL`) is logged after everything already
//! stable. Replaying the log from an empty disk up to a mark rebuilds the disk
//! exactly as a power cut at that instant leaves it: an acknowledged write that
//! no completed FLUSH covered is missing, and so would be a write the data path
//! claimed to flush but did not.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{Scratch, dmsetup, run, sh};

const LOG_FLUSH: u64 = 1;
const LOG_FUA: u64 = 2;
const LOG_DISCARD: u64 = 4;
const LOG_MARK: u64 = 8;
const LOG_MAGIC: u64 = 0x6a_7366_7773_6872;

/// The image filesystem (ext4 on a dm `linear` over a loop device, as the
/// direct-map rules want) keeps its disk as a file on an outer ext4, which sits
/// on `dm-log-writes`. The direct path writes the loop device, so every path of
/// every policy reaches the log; a FLUSH of the loop device is an fsync of that
/// file, which the outer filesystem passes down as a FLUSH.
pub struct LoggedFs {
    tag: String,
    log_writes: String,
    linear: String,
    data_lo: String,
    log_lo: String,
    inner_lo: String,
    data_file: PathBuf,
    log_file: PathBuf,
    outer: PathBuf,
    mnt: PathBuf,
    up: bool,
}

/// A loop device over a new sparse file of `mib` MiB.
fn loop_of(file: &Path, mib: u64) -> String {
    sh(
        "truncate",
        &["-s", &format!("{mib}M"), file.to_str().unwrap()],
    );
    sh("losetup", &["-f", "--show", file.to_str().unwrap()])
        .trim()
        .to_string()
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The device node of dm device `name`.
fn dm_node(name: &str) -> String {
    format!(
        "/dev/{}",
        dmsetup(&["info", "-c", "--noheadings", "-o", "blkdevname", name])
    )
}

/// ext4 on `dev` without discards (the log would need them replayed) or lazy
/// init (no background writes once mounted), mounted on `mnt`.
pub fn ext4_on(dev: &str, mnt: &Path) {
    sh(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            // 4 KiB blocks, as a file's 4 KiB pieces are found in the disk.
            "-b",
            "4096",
            "-E",
            "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
            dev,
        ],
    );
    std::fs::create_dir_all(mnt).unwrap();
    // ext4 commits its journal, with a FLUSH, every 5 s by default: such a
    // commit between a write and the cut would make the write stable and
    // hide a FLUSH the data path failed to pass down. A power cut can come
    // before that commit, so the test gives the journal no chance to.
    sh("mount", &["-o", "commit=600", dev, mnt.to_str().unwrap()]);
}

fn umount(mnt: &Path) {
    let out = run("umount", &[mnt.to_str().unwrap()]);
    assert!(out.status.success(), "umount {}: {out:?}", mnt.display());
}

impl LoggedFs {
    /// A fresh image filesystem of `mib` MiB, logged from its mkfs on,
    /// mounted under /tmp.
    pub fn new(tag: &str, mib: u64) -> Self {
        let base = Scratch::Xfs.base();
        let data_file = base.join(format!("logged-{tag}.raw"));
        let log_file = base.join(format!("logged-{tag}.log"));
        let outer_mib = mib + 64;
        let data_lo = loop_of(&data_file, outer_mib);
        // Sparse: the log holds every logged byte plus a header block each.
        let log_lo = loop_of(&log_file, 8 * outer_mib);
        let log_writes = format!("bp-logwrites-{tag}");
        dmsetup(&[
            "create",
            &log_writes,
            "--table",
            &format!("0 {} log-writes {data_lo} {log_lo}", outer_mib * 2048),
        ]);
        let outer = PathBuf::from(format!("/tmp/logged-{tag}-outer"));
        ext4_on(&dm_node(&log_writes), &outer);
        let inner_lo = loop_of(&outer.join("inner.raw"), mib);
        let linear = format!("bp-logged-{tag}");
        dmsetup(&[
            "create",
            &linear,
            "--table",
            &format!("0 {} linear {inner_lo} 0", mib * 2048),
        ]);
        let mnt = PathBuf::from(format!("/tmp/logged-{tag}"));
        ext4_on(&dm_node(&linear), &mnt);
        std::fs::create_dir_all(mnt.join("images")).unwrap();
        sh("sync", &["-f", mnt.to_str().unwrap()]);
        Self {
            tag: tag.to_string(),
            log_writes,
            linear,
            data_lo,
            log_lo,
            inner_lo,
            data_file,
            log_file,
            outer,
            mnt,
            up: true,
        }
    }

    /// A directory for images on this filesystem.
    pub fn root(&self) -> PathBuf {
        self.mnt.join("images")
    }

    /// Marks the log: a replay up to `label` is a power cut now.
    pub fn mark(&self, label: &str) {
        dmsetup(&["message", &self.log_writes, "0", "mark", label]);
    }

    /// Unmounts both filesystems (which must work: nothing may still hold
    /// them) and removes the devices, which completes the log.
    pub fn finish(&mut self) {
        umount(&self.mnt);
        dmsetup(&["remove", &self.linear]);
        sh("losetup", &["-d", &self.inner_lo]);
        umount(&self.outer);
        dmsetup(&["remove", &self.log_writes]);
        self.up = false;
    }

    /// Replays the log onto an empty disk; at each mark calls `at_mark` with
    /// its label and the disk as it is then. Returns the labels seen.
    pub fn replay(&self, mut at_mark: impl FnMut(&str, &Path)) -> Vec<String> {
        assert!(!self.up, "finish() first: the log is still being written");
        let log = std::fs::File::open(&self.log_file).unwrap();
        let disk_path = self.data_file.with_extension("replay");
        let _ = std::fs::remove_file(&disk_path);
        let disk = std::fs::File::create(&disk_path).unwrap();
        disk.set_len(std::fs::metadata(&self.data_file).unwrap().len())
            .unwrap();
        let mut head = vec![0u8; 512];
        log.read_exact_at(&mut head, 0).unwrap();
        assert_eq!(le64(&head, 0), LOG_MAGIC, "not a dm-log-writes log");
        let entries = le64(&head, 16);
        let ss = u64::from(u32::from_le_bytes(head[24..28].try_into().unwrap()));
        let mut at = ss;
        let mut block = vec![0u8; ss as usize];
        let mut marks = Vec::new();
        for _ in 0..entries {
            log.read_exact_at(&mut block, at).unwrap();
            let (sector, count, flags, len) = (
                le64(&block, 0),
                le64(&block, 8),
                le64(&block, 16),
                le64(&block, 24),
            );
            at += ss;
            if flags & LOG_MARK != 0 {
                let label = String::from_utf8_lossy(&block[32..32 + len as usize]).into_owned();
                disk.sync_all().unwrap();
                at_mark(&label, &disk_path);
                marks.push(label);
            } else if flags & LOG_DISCARD != 0 {
                disk.write_all_at(&vec![0u8; (count * ss) as usize], sector * ss)
                    .unwrap();
            } else if count > 0 {
                let mut data = vec![0u8; (count * ss) as usize];
                log.read_exact_at(&mut data, at).unwrap();
                disk.write_all_at(&data, sector * ss).unwrap();
                at += count * ss;
            } else {
                assert!(flags & (LOG_FLUSH | LOG_FUA) != 0, "entry flags {flags:#x}");
            }
        }
        let _ = std::fs::remove_file(&disk_path);
        marks
    }

    /// Mounts a reflinked copy of a replayed disk (so journal recovery does
    /// not change the replay), then the image filesystem inside it, and runs
    /// `f` on that mount point.
    pub fn on_copy<T>(&self, disk: &Path, f: impl FnOnce(&Path) -> T) -> T {
        let copy = disk.with_extension("copy");
        sh(
            "cp",
            &[
                "--reflink=always",
                disk.to_str().unwrap(),
                copy.to_str().unwrap(),
            ],
        );
        let outer = PathBuf::from(format!("/tmp/replayed-{}-outer", self.tag));
        let inner = PathBuf::from(format!("/tmp/replayed-{}", self.tag));
        let mut undo: Vec<(&str, Vec<String>)> = Vec::new();
        let mut mount = |dev: &str, at: &Path| -> Result<String, String> {
            let lo = sh("losetup", &["-f", "--show", dev]).trim().to_string();
            undo.push(("losetup", vec!["-d".into(), lo.clone()]));
            std::fs::create_dir_all(at).unwrap();
            let m = run("mount", &[&lo, at.to_str().unwrap()]);
            if !m.status.success() {
                return Err(format!("mount of the replayed {dev}: {m:?}"));
            }
            undo.push(("umount", vec![at.display().to_string()]));
            Ok(lo)
        };
        let out = mount(copy.to_str().unwrap(), &outer)
            .and_then(|_| mount(outer.join("inner.raw").to_str().unwrap(), &inner))
            .map(|_| f(&inner));
        for (cmd, args) in undo.iter().rev() {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let _ = run(cmd, &args);
        }
        let _ = std::fs::remove_file(&copy);
        out.unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Drop for LoggedFs {
    fn drop(&mut self) {
        if self.up {
            let _ = run("umount", &["-l", self.mnt.to_str().unwrap()]);
            let _ = std::process::Command::new("dmsetup")
                .args(["remove", "--force", &self.linear])
                .env("DM_DISABLE_UDEV", "1")
                .status();
            let _ = run("losetup", &["-d", &self.inner_lo]);
            let _ = run("umount", &["-l", self.outer.to_str().unwrap()]);
            let _ = std::process::Command::new("dmsetup")
                .args(["remove", "--force", &self.log_writes])
                .env("DM_DISABLE_UDEV", "1")
                .status();
        }
        for lo in [&self.data_lo, &self.log_lo] {
            let _ = run("losetup", &["-d", lo]);
        }
        let _ = std::fs::remove_file(&self.data_file);
        let _ = std::fs::remove_file(&self.log_file);
    }
}
