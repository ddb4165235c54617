//! Mount helpers of the node service: mount and bind-mount with the CSI
//! mount flags (the mount table is `blockplane_system::mountinfo`), filesystem probing, creation and growth, and
//! sizes. Mounts are system calls (rustix); the filesystem tools run with
//! fixed arguments and a device path, never through a shell.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use rustix::mount::{MountFlags, UnmountFlags};

use blockplane_system::mountinfo::mount_at;

use super::errors::CsiError;

/// Mount flags of a CSI volume capability, split the way the kernel wants
/// them: flags of the mount point, and the filesystem's own options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    /// Per-mount-point flags (`MS_RDONLY`, `MS_NOSUID`, ...).
    pub flags: MountFlags,
    /// Filesystem options passed as mount data (`discard`, `data=ordered`).
    pub data: Vec<String>,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            flags: MountFlags::empty(),
            data: Vec::new(),
        }
    }
}

impl MountOptions {
    /// Parses CSI `mount_flags` (each may hold several, comma-separated).
    /// Options that would change what is mounted (`bind`, `remount`, ...) are
    /// refused: the driver decides that.
    pub fn parse(flags: &[String]) -> Result<Self, String> {
        let mut out = MountOptions::default();
        for opt in flags.iter().flat_map(|f| f.split(',')) {
            let opt = opt.trim();
            let flag = match opt {
                "" | "defaults" | "rw" | "suid" | "dev" | "exec" | "async" | "atime"
                | "diratime" | "nostrictatime" => continue,
                "ro" => MountFlags::RDONLY,
                "nosuid" => MountFlags::NOSUID,
                "nodev" => MountFlags::NODEV,
                "noexec" => MountFlags::NOEXEC,
                "noatime" => MountFlags::NOATIME,
                "nodiratime" => MountFlags::NODIRATIME,
                "relatime" => MountFlags::RELATIME,
                "strictatime" => MountFlags::STRICTATIME,
                "lazytime" => MountFlags::LAZYTIME,
                "sync" => MountFlags::SYNCHRONOUS,
                "dirsync" => MountFlags::DIRSYNC,
                "bind" | "rbind" | "remount" | "move" | "shared" | "rshared" | "slave"
                | "rslave" | "private" | "rprivate" | "unbindable" | "runbindable" | "loop" => {
                    return Err(format!(
                        "mount flag '{opt}' is not allowed: the driver decides how volumes are mounted"
                    ));
                }
                o if o.contains('\0') => return Err("a mount flag contains a NUL byte".into()),
                o => {
                    out.data.push(o.to_string());
                    continue;
                }
            };
            out.flags |= flag;
        }
        Ok(out)
    }

    /// The flags that apply to a (bind) mount point.
    pub fn mount_point_flags(&self) -> MountFlags {
        self.flags
            & (MountFlags::RDONLY
                | MountFlags::NOSUID
                | MountFlags::NODEV
                | MountFlags::NOEXEC
                | MountFlags::NOATIME
                | MountFlags::NODIRATIME
                | MountFlags::RELATIME
                | MountFlags::STRICTATIME)
    }
}

fn io_err(volume: &str, op: &'static str, path: &Path, source: io::Error) -> CsiError {
    CsiError::Io {
        volume: volume.to_string(),
        op,
        path: path.display().to_string(),
        source,
    }
}

/// Mounts the filesystem on `device` at `target`.
pub fn mount_device(
    volume: &str,
    device: &Path,
    target: &Path,
    fstype: &str,
    opts: &MountOptions,
) -> Result<(), CsiError> {
    let data = CString::new(opts.data.join(",")).map_err(|_| CsiError::Invalid {
        volume: volume.into(),
        reason: "mount options contain a NUL byte".into(),
    })?;
    rustix::mount::mount(device, target, fstype, opts.flags, data.as_c_str()).map_err(|e| {
        let e = io::Error::from(e);
        if e.raw_os_error() == Some(libc::EINVAL) {
            CsiError::Invalid {
                volume: volume.into(),
                reason: format!(
                    "mounting {} ({fstype}) at {} with options '{}' failed: {e} (an option the filesystem does not know?)",
                    device.display(),
                    target.display(),
                    opts.data.join(",")
                ),
            }
        } else {
            io_err(volume, "mount", target, e)
        }
    })
}

/// Bind-mounts `source` (a directory or a device node) at `target`, then
/// applies the mount-point `flags` (read-only, nosuid, ...), which a bind
/// mount only takes on a remount.
pub fn bind(volume: &str, source: &Path, target: &Path, flags: MountFlags) -> Result<(), CsiError> {
    rustix::mount::mount_bind(source, target)
        .map_err(|e| io_err(volume, "bind-mount at", target, e.into()))?;
    if !flags.is_empty()
        && let Err(e) = rustix::mount::mount_remount(target, MountFlags::BIND | flags, "")
    {
        // Never leave a writable mount where a read-only one was asked for.
        let _ = rustix::mount::unmount(target, UnmountFlags::empty());
        return Err(io_err(volume, "remount with flags", target, e.into()));
    }
    Ok(())
}

/// How long an unmount refused as busy is retried: a process that only
/// looks (a stats scan, a probe, a fork between its open and its exec)
/// lets go within it; one that uses the volume does not, and is named.
const BUSY_RETRY: Duration = Duration::from_secs(2);

/// Unmounts `target` until nothing is mounted there; `Ok` when nothing was.
/// Busy (EBUSY) is retried for [`BUSY_RETRY`], then refused with the
/// processes holding files under `target`.
pub fn unmount_all(volume: &str, target: &Path) -> Result<(), CsiError> {
    let mut busy_since: Option<Instant> = None;
    while mount_at(target)
        .map_err(|e| io_err(volume, "read the mount table for", target, e))?
        .is_some()
    {
        match rustix::mount::unmount(target, UnmountFlags::empty()) {
            Ok(()) => busy_since = None,
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(rustix::io::Errno::BUSY) => {
                let since = *busy_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= BUSY_RETRY {
                    return Err(busy(volume, target));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(io_err(volume, "unmount", target, e.into())),
        }
    }
    Ok(())
}

/// The refusal of an unmount of `target` that stayed busy.
fn busy(volume: &str, target: &Path) -> CsiError {
    let holders = blockplane_system::holders::holding(&[], |link| {
        std::fs::read_link(link).is_ok_and(|p| p.starts_with(target))
    });
    let who = if holders.is_empty() {
        "no process of this node's namespace holds a file under it (a mount \
         below it, or a holder in another mount namespace?)"
            .to_string()
    } else {
        format!("held by {}", blockplane_system::holders::describe(&holders))
    };
    CsiError::Precondition {
        volume: volume.into(),
        reason: format!(
            "{} is still in use after {} s of retried unmounts: {who}",
            target.display(),
            BUSY_RETRY.as_secs()
        ),
    }
}

/// What a block device holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contents {
    /// No signature blkid knows: safe to format.
    Empty,
    /// A filesystem of this type.
    Filesystem(String),
    /// Something that is not a filesystem (a partition table, LVM, LUKS,
    /// swap): never formatted over.
    Other(String),
}

fn run(
    volume: &str,
    tool: &str,
    args: &[&std::ffi::OsStr],
) -> Result<std::process::Output, CsiError> {
    Command::new(tool)
        .args(args)
        .env("LC_ALL", "C")
        .output()
        .map_err(|e| CsiError::Tool {
            volume: volume.into(),
            tool: tool.into(),
            status: "not started".into(),
            output: format!("{e} (is it installed on the node?)"),
        })
}

fn tool_failed(volume: &str, tool: &str, out: &std::process::Output) -> CsiError {
    let mut text = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if text.is_empty() {
        text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    }
    CsiError::Tool {
        volume: volume.into(),
        tool: tool.into(),
        status: out.status.to_string(),
        output: text,
    }
}

/// Probes `device` with `blkid -p` (low-level, no cache).
pub fn probe(volume: &str, device: &Path) -> Result<Contents, CsiError> {
    let out = run(
        volume,
        "blkid",
        &[
            "-p".as_ref(),
            "-o".as_ref(),
            "export".as_ref(),
            device.as_os_str(),
        ],
    )?;
    // blkid exits 2 when it finds no signature at all.
    if out.status.code() == Some(2) {
        return Ok(Contents::Empty);
    }
    if !out.status.success() {
        return Err(tool_failed(volume, "blkid", &out));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            .map(str::to_string)
    };
    Ok(match (field("TYPE"), field("USAGE"), field("PTTYPE")) {
        (Some(t), Some(u), _) if u == "filesystem" => Contents::Filesystem(t),
        (Some(t), _, _) => Contents::Other(t),
        (None, _, Some(pt)) => Contents::Other(format!("a {pt} partition table")),
        (None, _, None) => Contents::Empty,
    })
}

/// The filesystems the driver creates and grows.
pub const FILESYSTEMS: [&str; 2] = ["ext4", "xfs"];

/// Creates a filesystem on an empty device. Neither tool discards: a volume
/// on a fully allocated image must stay fully allocated (a discard would
/// punch holes into the image and break its direct map).
pub fn mkfs(volume: &str, device: &Path, fstype: &str) -> Result<(), CsiError> {
    let (tool, args): (&str, Vec<&std::ffi::OsStr>) = match fstype {
        "ext4" => (
            "mkfs.ext4",
            vec![
                "-F".as_ref(),
                "-q".as_ref(),
                "-E".as_ref(),
                "nodiscard".as_ref(),
                device.as_os_str(),
            ],
        ),
        "xfs" => (
            "mkfs.xfs",
            vec!["-q".as_ref(), "-K".as_ref(), device.as_os_str()],
        ),
        other => {
            return Err(CsiError::Invalid {
                volume: volume.into(),
                reason: format!("filesystem '{other}' is not supported (ext4 or xfs)"),
            });
        }
    };
    let out = run(volume, tool, &args)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(tool_failed(volume, tool, &out))
    }
}

/// Grows the filesystem mounted at `mount_point` (on `device`) to the
/// device's size, online. Growing a filesystem that already fills its
/// device changes nothing and succeeds.
pub fn grow_fs(
    volume: &str,
    device: &Path,
    mount_point: &Path,
    fstype: &str,
) -> Result<(), CsiError> {
    let (tool, arg): (&str, &Path) = match fstype {
        "ext4" | "ext3" | "ext2" => ("resize2fs", device),
        "xfs" => ("xfs_growfs", mount_point),
        other => {
            return Err(CsiError::Precondition {
                volume: volume.into(),
                reason: format!("cannot grow a {other} filesystem (ext4 or xfs)"),
            });
        }
    };
    if tool == "resize2fs" && !has_capability(CAP_SYS_RESOURCE) {
        // The kernel refuses EXT4_IOC_RESIZE_FS without it, and resize2fs
        // then says only "Permission denied".
        return Err(CsiError::Precondition {
            volume: volume.into(),
            reason: format!(
                "growing the mounted ext4 filesystem at {} needs CAP_SYS_RESOURCE, which the driver process lacks: run it privileged",
                mount_point.display()
            ),
        });
    }
    let args: Vec<&std::ffi::OsStr> = if tool == "xfs_growfs" {
        vec!["-d".as_ref(), arg.as_os_str()]
    } else {
        vec![arg.as_os_str()]
    };
    let out = run(volume, tool, &args)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(tool_failed(volume, tool, &out))
    }
}

/// The capability number of `CAP_SYS_RESOURCE`.
pub const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process has capability `cap` in its effective set.
pub fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|mask| mask & (1 << cap) != 0)
}

/// Size in bytes of the block device at `path`.
pub fn device_size(volume: &str, path: &Path) -> Result<u64, CsiError> {
    File::open(path)
        .and_then(|mut f| f.seek(SeekFrom::End(0)))
        .map_err(|e| io_err(volume, "read the size of", path, e))
}

/// Bytes and inodes of the filesystem at `path`:
/// `(bytes available, total, used, inodes available, total, used)`.
pub fn fs_usage(volume: &str, path: &Path) -> Result<[u64; 6], CsiError> {
    let s = rustix::fs::statvfs(path).map_err(|e| io_err(volume, "statvfs", path, e.into()))?;
    let bs = s.f_frsize;
    Ok([
        s.f_bavail * bs,
        s.f_blocks * bs,
        (s.f_blocks - s.f_bfree) * bs,
        s.f_ffree,
        s.f_files,
        s.f_files - s.f_ffree,
    ])
}

/// The device number of the block device at `path`, `None` if it is not one.
pub fn block_rdev(path: &Path) -> io::Result<Option<u64>> {
    let md = std::fs::metadata(path)?;
    Ok(md.file_type().is_block_device().then(|| md.rdev()))
}

/// Creates an empty file at `path` (the target of a block volume) unless
/// something is there already.
pub fn ensure_file(volume: &str, path: &Path) -> Result<(), CsiError> {
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err(volume, "create", path, e)),
    }
}

/// Creates the directory `path` (and its parents) unless it exists.
pub fn ensure_dir(volume: &str, path: &Path) -> Result<(), CsiError> {
    std::fs::create_dir_all(path).map_err(|e| io_err(volume, "create directory", path, e))
}

/// Removes what [`ensure_file`] or [`ensure_dir`] created; `Ok` when it is gone.
pub fn remove_target(volume: &str, path: &Path) -> Result<(), CsiError> {
    let r = match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => std::fs::remove_dir(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
    };
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(volume, "remove", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_flags_split_into_flags_and_data() {
        let o =
            MountOptions::parse(&["noatime,discard".into(), "ro".into(), "data=ordered".into()])
                .unwrap();
        assert_eq!(o.flags, MountFlags::NOATIME | MountFlags::RDONLY);
        assert_eq!(o.data, vec!["discard", "data=ordered"]);
        assert_eq!(
            o.mount_point_flags(),
            MountFlags::NOATIME | MountFlags::RDONLY
        );
        assert!(MountOptions::parse(&["bind".into()]).is_err());
        assert_eq!(MountOptions::parse(&[]).unwrap(), MountOptions::default());
    }
}
