//! The mount table (`/proc/self/mountinfo`): one parser, with the kernel's
//! octal escapes decoded (a mount point with a space is `\040` there), and
//! the questions blockplane asks of it.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// `major:minor` of the mounted filesystem (for a bind mount of a device
    /// node: of the filesystem holding the node, e.g. devtmpfs).
    pub dev: (u32, u32),
    /// The path inside that filesystem that is mounted.
    pub root: String,
    /// Where it is mounted, escapes decoded.
    pub mount_point: PathBuf,
    /// Per-mount options (`ro`, `nosuid`, ...).
    pub options: String,
    /// The filesystem type (`ext4`, `xfs`, `tmpfs`, ...).
    pub fstype: String,
    /// The mount source: a device node, or what the filesystem names it.
    pub source: String,
}

impl MountEntry {
    /// Whether the mount point is read-only.
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }
}

/// Decodes the octal escapes of mountinfo (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    let (left, right) = line.split_once(" - ")?;
    let l: Vec<&str> = left.split(' ').collect();
    let r: Vec<&str> = right.split(' ').collect();
    if l.len() < 6 || r.len() < 2 {
        return None;
    }
    let (major, minor) = l[2].split_once(':')?;
    Some(MountEntry {
        dev: (major.parse().ok()?, minor.parse().ok()?),
        root: unescape(l[3]),
        mount_point: PathBuf::from(unescape(l[4])),
        options: l[5].to_string(),
        fstype: r[0].to_string(),
        source: unescape(r[1]),
    })
}

/// The mount table of this process's mount namespace.
pub fn mounts() -> io::Result<Vec<MountEntry>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text.lines().filter_map(parse_line).collect())
}

/// `path` with symlinks resolved when it exists (mountinfo shows resolved
/// paths), else as given.
pub fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The topmost mount at `path`, if `path` is a mount point.
pub fn mount_at(path: &Path) -> io::Result<Option<MountEntry>> {
    let path = canonical(path);
    Ok(mounts()?.into_iter().rev().find(|m| m.mount_point == path))
}

/// Mount points where the block device `rdev` is in use: filesystems on it,
/// and bind mounts of its device node (found on devtmpfs and tmpfs mounts
/// only, so that no remote filesystem is ever stat'ed).
pub fn mounts_of_device(rdev: u64) -> io::Result<Vec<PathBuf>> {
    let dev = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let mut out = Vec::new();
    for m in mounts()? {
        let bound_node = m.root != "/"
            && matches!(m.fstype.as_str(), "devtmpfs" | "tmpfs")
            && std::fs::metadata(&m.mount_point)
                .is_ok_and(|md| md.file_type().is_block_device() && md.rdev() == rdev);
        if m.dev == dev || bound_node {
            out.push(m.mount_point);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_parse_with_escapes() {
        let m = parse_line(
            "36 35 98:0 /mnt1 /mnt\\040two rw,noatime master:1 - ext3 /dev/root rw,errors=continue",
        )
        .unwrap();
        assert_eq!(m.dev, (98, 0));
        assert_eq!(m.root, "/mnt1");
        assert_eq!(m.mount_point, PathBuf::from("/mnt two"));
        assert_eq!(m.fstype, "ext3");
        assert_eq!(m.source, "/dev/root");
        assert!(!m.read_only());
        let ro = parse_line("40 24 0:6 /loop3 /t ro,relatime - devtmpfs udev rw").unwrap();
        assert!(ro.read_only());
        assert_eq!(ro.root, "/loop3");
    }
}
