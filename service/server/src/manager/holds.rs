//! Image locks: while a volume serves an image, this service holds an OFD
//! lock (`fcntl(F_OFD_SETLK)`) on the file, so a second blockplane (another
//! data dir, the same image root) cannot make a second device over it.
//!
//! The lock is exclusive (`F_WRLCK`) on a descriptor opened for writing. An
//! image pinned immutable (direct-mapped) cannot be opened for writing: it is
//! then held shared (`F_RDLCK`), which the kernel lets a second shared lock
//! join; so a shared lock is kept only while no other open file description
//! holds any lock on the file, which refuses a second instance's read-only
//! device too (the second to lock sees the first and lets go). OFD locks
//! belong to the open file description, so they are released when this
//! process ends or the descriptor is closed, and they conflict across
//! processes whatever the processes' other descriptors.
//!
//! A ublk worker owns its device and outlives this service, so it gets a
//! duplicate of the locked descriptor (the same open file description) and
//! takes the lock again on it before it serves ([`blockplane_system::image::retake_lock`]): one lock, held
//! while the service or the worker lives, through a service crash as through
//! a worker crash (the service's duplicate bridges the replacement worker).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};

use uuid::Uuid;

use blockplane_system::image::{ImageFile, reopen, set_ofd_lock};

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
    /// "process N (what it is)" or "another process", for messages.
    pub fn holder(&self) -> String {
        match self.pid {
            Some(pid) => format!("process {pid}{}", describe(pid)),
            None => "another process (its pid could not be found)".into(),
        }
    }
}

/// " (a blockplane ublk worker, run dir D)" for a worker, " (comm)" else.
fn describe(pid: u32) -> String {
    if let Some(run_dir) = blockplane_protocol::worker_spec(pid)
        .as_ref()
        .and_then(|s| s["run_dir"].as_str())
    {
        return format!(" (a blockplane ublk worker, run dir {run_dir})");
    }
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| format!(" ({})", c.trim()))
        .unwrap_or_default()
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
    match set_ofd_lock(&fd, kind) {
        Ok(()) if kind == libc::F_RDLCK => match other_lock(&fd) {
            // Shared with another holder: not this service's to serve.
            Some(true) => {
                let (dev, ino) = file.identity();
                Err(Held {
                    pid: holder(dev, ino),
                })
            }
            Some(false) => Ok(fd),
            None => {
                tracing::warn!(image = %file.path(), "cannot ask whether another process holds the image's lock");
                Err(Held { pid: None })
            }
        },
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

/// Whether an open file description other than `fd`'s holds a lock (shared
/// or exclusive) on its file; `None` if the kernel would not say.
fn other_lock(fd: &OwnedFd) -> Option<bool> {
    // SAFETY: `flock` is plain data, for which all zeroes is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    // An exclusive lock conflicts with every lock but this description's own.
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_OFD_GETLK reads one `flock` through the pointer and writes the
    // conflicting lock back into it; it points at `fl`, borrowed by nothing
    // else for the call.
    let r = unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_OFD_GETLK,
            &mut fl as *mut libc::flock,
        )
    };
    (r == 0).then_some(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Whether another process's open file description holds a lock on `file`
/// (this service holds none on that descriptor); `Some` with its holder.
pub fn locked_by_other(file: &ImageFile) -> Option<Held> {
    (other_lock(file.fd()) == Some(true)).then(|| {
        let (dev, ino) = file.identity();
        Held {
            pid: holder(dev, ino),
        }
    })
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
    (other_lock(&fd) == Some(true)).then(|| Held {
        pid: holder(st.st_dev, st.st_ino),
    })
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;
    use blockplane_system::image::retake_lock as retake;

    fn open(path: &std::path::Path, write: bool) -> OwnedFd {
        File::options()
            .read(true)
            .write(write)
            .open(path)
            .unwrap()
            .into()
    }

    fn refused(fd: &OwnedFd) -> bool {
        matches!(
            retake(fd).map_err(|e| e.raw_os_error()),
            Err(Some(libc::EAGAIN))
        )
    }

    /// The lock a ublk worker takes again on its duplicate of the service's
    /// locked descriptor is that one lock: it succeeds there, lasts while
    /// either descriptor lives, and refuses every other open of the file,
    /// a read-only one included.
    #[test]
    fn a_duplicate_retakes_the_lock_and_keeps_it_after_the_original_closes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let service = open(&path, true);
        retake(&service).unwrap();
        let worker = service.try_clone().unwrap();
        retake(&worker).unwrap();
        let other = open(&path, true);
        assert!(refused(&other));
        assert!(refused(&open(&path, false)));
        // The service dies: the worker's duplicate keeps the lock.
        drop(service);
        assert!(refused(&other));
        assert!(held_elsewhere(&path).is_some());
        drop(worker);
        assert!(held_elsewhere(&path).is_none());
        retake(&other).unwrap();
    }

    /// Two shared locks do not conflict in the kernel: a holder of one sees
    /// the other, which is how a second read-only lock is refused (issue 26
    /// item 2: a pinned image, held shared, and a second instance).
    #[test]
    fn a_shared_lock_sees_another_shared_lock_but_not_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let first = open(&path, false);
        retake(&first).unwrap();
        assert_eq!(other_lock(&first), Some(false));
        let second = open(&path, false);
        retake(&second).unwrap();
        assert_eq!(other_lock(&second), Some(true));
        assert_eq!(other_lock(&first), Some(true));
        drop(first);
        assert_eq!(other_lock(&second), Some(false));
    }
}
