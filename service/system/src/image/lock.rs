//! OFD locks on image files: one lock per image, held by the service or
//! handed to the worker that serves it.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// Takes the lock again on a descriptor handed over already locked (a ublk
/// worker's `LOCK_FD`): exclusive if it is open for writing, shared if not,
/// as the server's `manager::holds::lock` took it. Succeeds when this open
/// file description holds it already; fails (`EAGAIN`) when another does.
pub fn retake_lock(fd: &OwnedFd) -> io::Result<()> {
    let mode = rustix::fs::fcntl_getfl(fd)?;
    let kind = if mode.contains(rustix::fs::OFlags::RDWR) {
        libc::F_WRLCK
    } else {
        libc::F_RDLCK
    };
    set_ofd_lock(fd, kind)
}

/// Sets an OFD lock of `kind` (`F_WRLCK`, `F_RDLCK`) on the whole file,
/// without waiting (`EAGAIN` when another open file description holds one).
pub fn set_ofd_lock(fd: &OwnedFd, kind: libc::c_int) -> io::Result<()> {
    // SAFETY: a zeroed flock is valid; the whole file (l_len 0), l_pid 0 as
    // OFD locks require.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_OFD_SETLK reads one flock through the pointer.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl as *const libc::flock) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
