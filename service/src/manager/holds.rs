//! Image locks: while a volume serves an image, this service holds an OFD
//! lock (`fcntl(F_OFD_SETLK)`) on the file, so a second blockplane (another
//! data dir, the same image root) cannot make a second device over it.
//!
//! The lock is exclusive (`F_WRLCK`) on a descriptor opened for writing. An
//! image pinned immutable (direct-mapped) cannot be opened for writing: it is
//! then held shared (`F_RDLCK`), which still refuses every writable device
//! elsewhere. OFD locks belong to the open file description, so they are
//! released when this process ends or the descriptor is closed, and they
//! conflict across processes whatever the processes' other descriptors.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use uuid::Uuid;

use crate::image::{ImageFile, reopen};

/// The image locks this service holds, one per volume (a volume has one image,
/// an image at most one volume).
#[derive(Default)]
pub struct ImageHolds {
    held: std::sync::Mutex<HashMap<Uuid, OwnedFd>>,
}

/// The image is locked by another open file description.
#[derive(Debug)]
pub struct Held {
    /// The process that holds it, when it can be found.
    pub pid: Option<u32>,
}

impl Held {
    /// "process N" or "another process", for messages.
    pub fn holder(&self) -> String {
        match self.pid {
            Some(pid) => format!("process {pid}"),
            None => "another process (its pid could not be found)".into(),
        }
    }
}

impl ImageHolds {
    /// Hands a lock taken with [`lock`] to `volume`.
    pub fn keep(&self, volume: Uuid, fd: OwnedFd) {
        self.held.lock().expect("image holds").insert(volume, fd);
    }

    /// Drops `volume`'s lock, if held.
    pub fn release(&self, volume: Uuid) {
        self.held.lock().expect("image holds").remove(&volume);
    }
}

/// Takes an OFD lock on `file` through a new open file description of it.
pub fn lock(file: &ImageFile) -> Result<OwnedFd, Held> {
    let (fd, kind) = match reopen(file.fd(), true) {
        Ok(fd) => (fd, libc::F_WRLCK),
        // Pinned immutable (or otherwise not writable): a shared lock.
        Err(_) => match reopen(file.fd(), false) {
            Ok(fd) => (fd, libc::F_RDLCK),
            Err(e) => {
                tracing::warn!(image = %file.path(), error = %e, "cannot reopen the image to lock it");
                return Err(Held { pid: None });
            }
        },
    };
    match set_lock(&fd, kind) {
        Ok(()) => Ok(fd),
        Err(e) => {
            if !matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
                tracing::warn!(image = %file.path(), error = %e, "cannot lock the image");
            }
            let (dev, ino) = file.identity();
            Err(Held {
                pid: holder(dev, ino),
            })
        }
    }
}

fn set_lock(fd: &OwnedFd, kind: libc::c_int) -> io::Result<()> {
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

/// The process holding an OFD lock on the file `(dev, ino)`: the kernel does
/// not say (`F_OFD_GETLK` answers pid -1), so look for a descriptor of that
/// file whose fdinfo lists an OFD lock.
fn holder(dev: u64, ino: u64) -> Option<u32> {
    let me = std::process::id();
    for proc_entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = proc_entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(proc_entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(st) = rustix::fs::stat(fd.path()) else {
                continue;
            };
            if (st.st_dev, st.st_ino) != (dev, ino) {
                continue;
            }
            let info = proc_entry.path().join("fdinfo").join(fd.file_name());
            if std::fs::read_to_string(info).is_ok_and(|s| s.contains("OFDLCK")) {
                return Some(pid);
            }
        }
    }
    None
}

/// Whether another open file description holds a lock on the regular file at
/// `path` (the OFD lock of a serving blockplane); `Some` with its holder if so.
pub fn held_elsewhere(path: &std::path::Path) -> Option<Held> {
    use rustix::fs::{FileType, Mode, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return None;
    }
    // SAFETY: as in set_lock; F_OFD_GETLK writes the conflicting lock back.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    let r = unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_OFD_GETLK,
            &mut fl as *mut libc::flock,
        )
    };
    (r == 0 && fl.l_type != libc::F_UNLCK as libc::c_short).then(|| Held {
        pid: holder(st.st_dev, st.st_ino),
    })
}
