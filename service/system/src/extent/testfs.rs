//! Test helpers: temp files on a given filesystem, and real ext4 or xfs
//! filesystems on loop devices whose raw device the tests can read.

use std::path::PathBuf;

pub(crate) fn temp_file_on(dir: &str, name: &str) -> (tempfile::TempDir, std::fs::File, PathBuf) {
    let d = tempfile::tempdir_in(dir).unwrap();
    let p = d.path().join(name);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    (d, f, p)
}

pub(crate) fn run(cmd: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A real filesystem (mkfs.<fs>) on a loop device, mounted on a temp dir:
/// its raw device is readable here, unlike the host's own disk.
pub(crate) struct TestFs {
    dir: tempfile::TempDir,
    pub(crate) dev: String,
}

impl TestFs {
    pub(crate) fn new(fs: &str) -> Self {
        Self::sized(fs, 400 << 20)
    }

    /// A filesystem of `bytes` (its backing file sparse).
    pub(crate) fn sized(fs: &str, bytes: u64) -> Self {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let backing = dir.path().join("fs.raw");
        std::fs::File::create(&backing)
            .unwrap()
            .set_len(bytes)
            .unwrap();
        let dev = run("losetup", &["-f", "--show", backing.to_str().unwrap()]);
        run(&format!("mkfs.{fs}"), &["-q", &dev]);
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        run("mount", &[&dev, mnt.to_str().unwrap()]);
        Self { dir, dev }
    }

    pub(crate) fn mnt(&self) -> String {
        self.dir.path().join("mnt").display().to_string()
    }
}

impl Drop for TestFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.mnt())
            .status();
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.dev])
            .status();
    }
}
