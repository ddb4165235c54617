//! Rule 5 at the moment it matters. A pinned image's extents cannot move;
//! to move them once the pin is cleared, a process opens the image (to
//! punch, defragment, write or truncate it). While the volume is `direct`,
//! the worker holds a fanotify permission mark on the image, so every open of
//! it by another process waits for the worker's answer: one that finds the
//! pin cleared first takes the volume off the direct path, and only then
//! goes on, so no request uses an extent that moves after it. Opens while
//! the pin holds (a reader, `lsattr`, `chattr -i` itself) go on at once. The
//! answer is always "allow": this guards the map, it controls no access.
//!
//! What it cannot see is left to the periodic re-read (`Shared::check_drift`,
//! which also finds a cleared pin): a descriptor opened while the pin held
//! and used after it was cleared, and a `truncate(2)` by path.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// A fanotify group of permission events on the image.
pub(crate) struct Watch {
    group: OwnedFd,
}

impl Watch {
    /// A group whose events a thread of its own answers, telling
    /// `opened` the pid of each process that opens the image before its
    /// open goes on; `None` (and the reason logged) where the kernel refuses
    /// one (no `CONFIG_FANOTIFY_ACCESS_PERMISSIONS`, or no `CAP_SYS_ADMIN`).
    pub fn start(opened: impl Fn(i32) + Send + 'static) -> Option<Self> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe {
            libc::fanotify_init(
                libc::FAN_CLASS_CONTENT | libc::FAN_CLOEXEC,
                (libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC) as libc::c_uint,
            )
        };
        if fd < 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "no fanotify permission events: a moved extent of a direct image is caught by the periodic re-read only");
            return None;
        }
        // SAFETY: fanotify_init returned a new descriptor that nothing else owns.
        let group = unsafe { OwnedFd::from_raw_fd(fd) };
        let events = group.try_clone().ok()?;
        std::thread::Builder::new()
            .name("watch".into())
            .spawn(move || answer_opens(&opened, &events))
            .ok()?;
        Some(Self { group })
    }

    /// Starts (`true`) or stops making every open of `image` wait for the
    /// worker's answer.
    pub fn mark(&self, image: BorrowedFd<'_>, on: bool) {
        let how = if on {
            libc::FAN_MARK_ADD
        } else {
            libc::FAN_MARK_REMOVE
        };
        // SAFETY: a null path marks the object `image` refers to.
        let r = unsafe {
            libc::fanotify_mark(
                self.group.as_raw_fd(),
                how,
                libc::FAN_OPEN_PERM,
                image.as_raw_fd(),
                std::ptr::null(),
            )
        };
        if r < 0 {
            tracing::warn!(on, error = %std::io::Error::last_os_error(), "fanotify mark on the image");
        }
    }
}

/// Reads the group's events and answers each, forever (the group lives as
/// long as the worker).
fn answer_opens(opened: &dyn Fn(i32), group: &OwnedFd) {
    let meta = std::mem::size_of::<libc::fanotify_event_metadata>();
    let mut buf = vec![0u8; 64 * meta];
    loop {
        let n = match rustix::io::read(group, &mut buf[..]) {
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "reading fanotify events; opens of the image are no longer watched");
                return;
            }
        };
        let mut at = 0;
        while at + meta <= n {
            // SAFETY: the kernel wrote whole events; read_unaligned copes with
            // any alignment of the buffer.
            let ev: libc::fanotify_event_metadata =
                unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            if ev.event_len < meta as u32 {
                break;
            }
            at += ev.event_len as usize;
            if ev.vers != libc::FANOTIFY_METADATA_VERSION || ev.fd < 0 {
                continue;
            }
            // SAFETY: each event carries a new descriptor of the file, ours to close.
            let file = unsafe { OwnedFd::from_raw_fd(ev.fd) };
            if ev.mask & libc::FAN_OPEN_PERM != 0 {
                opened(ev.pid);
            }
            let answer = libc::fanotify_response {
                fd: file.as_raw_fd(),
                response: libc::FAN_ALLOW,
            };
            // SAFETY: `answer` is plain data, written whole.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    (&answer as *const libc::fanotify_response).cast::<u8>(),
                    std::mem::size_of::<libc::fanotify_response>(),
                )
            };
            if let Err(e) = rustix::io::write(group, bytes) {
                tracing::error!(error = %e, "answering a fanotify event");
            }
        }
    }
}

/// "process N (comm)", for the reason a volume left the map.
pub(crate) fn describe(pid: i32) -> String {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    format!("process {pid} ({})", comm.trim())
}
