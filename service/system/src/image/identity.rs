//! A file's identity: `(st_dev, st_ino)` and its birth, which together tell
//! it from a later file that reuses its inode number, and reopening the very
//! inode an fd names.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

/// What tells a file from a later one that reuses its inode number: its
/// birth time (`statx` btime, `btime:SECS.NANOS`) or, on a filesystem that
/// keeps none, its inode generation (`FS_IOC_GETVERSION`, `gen:N`). `None`
/// when the filesystem has neither. Works on an `O_PATH` descriptor.
pub fn birth_of(fd: &OwnedFd) -> Option<String> {
    use rustix::fs::StatxFlags;
    if let Ok(stx) = rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BTIME)
        && stx.stx_mask & StatxFlags::BTIME.bits() != 0
    {
        return Some(format!(
            "btime:{}.{:09}",
            stx.stx_btime.tv_sec, stx.stx_btime.tv_nsec
        ));
    }
    // The ioctl needs a descriptor open for reading; `fd` may be `O_PATH`,
    // and only a regular file opens without side effects (a FIFO would block).
    if FileType::from_raw_mode(rustix::fs::fstat(fd).ok()?.st_mode) != FileType::RegularFile {
        return None;
    }
    let readable = reopen(fd, false).ok()?;
    let mut generation: libc::c_long = 0;
    // SAFETY: FS_IOC_GETVERSION writes one c_long through the pointer.
    let r = unsafe {
        libc::ioctl(
            readable.as_raw_fd(),
            libc::FS_IOC_GETVERSION,
            &mut generation as *mut libc::c_long,
        )
    };
    (r == 0).then(|| format!("gen:{generation}"))
}

/// Whether a file born at `now` is the one recorded as born at `recorded`.
/// A record without a birth (made before births were kept, or on a
/// filesystem with none) matches on `(dev, ino)` alone.
pub fn same_birth(recorded: Option<&str>, now: Option<&str>) -> bool {
    recorded.is_none() || recorded == now
}

/// Whether `fd` is open for reading only (an image opened while pinned
/// immutable is: only [`reopen`] once unpinned gives one for writing).
pub fn is_read_only(fd: &OwnedFd) -> bool {
    rustix::fs::fcntl_getfl(fd).is_ok_and(|f| f & OFlags::ACCMODE == OFlags::RDONLY)
}

/// Opens the very inode behind `fd` again (through /proc/self/fd), for
/// writing if asked.
pub fn reopen(fd: &OwnedFd, write: bool) -> io::Result<OwnedFd> {
    let flags = if write { OFlags::RDWR } else { OFlags::RDONLY };
    rustix::fs::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        flags | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(Into::into)
}
