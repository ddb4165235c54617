//! The `threaded` policy's pool: worker threads that take one command each
//! off a shared channel, do blocking syscalls on the image, and hand the result
//! back to the command's task. Any free thread takes the next command: there is
//! no single serialising dispatcher.

use std::os::fd::RawFd;
use std::sync::Arc;

use libublk::sys;

use super::gate::{Kick, Slot};
use super::io::{Req, punch_or_zero};

/// One command for a pool thread.
pub struct Job {
    pub req: Req,
    pub fd: RawFd,
    /// The tag's buffer; its task is parked on `slot` until the job is done.
    pub buf: usize,
    pub slot: Arc<Slot>,
    pub kick: Arc<Kick>,
}

/// A handle to the pool; cloned into every queue.
#[derive(Clone)]
pub struct Pool {
    tx: crossbeam_channel::Sender<Job>,
}

impl Pool {
    /// Starts `threads` pool threads.
    pub fn start(threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("pool-{i}"))
                .spawn(move || {
                    for job in rx {
                        let res = blocking(&job);
                        job.slot.fill(res, &job.kick);
                    }
                })?;
        }
        Ok(Self { tx })
    }

    /// Queues a job; false if the pool is gone.
    pub fn submit(&self, job: Job) -> bool {
        self.tx.send(job).is_ok()
    }
}

fn neg_errno() -> i32 {
    -std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn blocking(j: &Job) -> i32 {
    let r = j.req;
    match r.op {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE => {
            let mut done = 0usize;
            while done < r.len as usize {
                let p = (j.buf + done) as *mut libc::c_void;
                let n = r.len as usize - done;
                let off = (r.off + done as u64) as libc::off_t;
                let iov = libc::iovec {
                    iov_base: p,
                    iov_len: n,
                };
                // SAFETY: the buffer is the parked tag's, at least r.len bytes.
                let rc = unsafe {
                    if r.op == sys::UBLK_IO_OP_READ {
                        libc::preadv2(j.fd, &iov, 1, off, 0)
                    } else {
                        let flags = if r.fua { libc::RWF_DSYNC } else { 0 };
                        libc::pwritev2(j.fd, &iov, 1, off, flags)
                    }
                };
                match rc {
                    rc if rc < 0 => return neg_errno(),
                    0 if r.op == sys::UBLK_IO_OP_READ => {
                        // Past the end of the image: zeroes.
                        // SAFETY: as above.
                        unsafe { libc::memset(p, 0, n) };
                        break;
                    }
                    0 => return -libc::EIO,
                    rc => done += rc as usize,
                }
            }
            r.len as i32
        }
        // SAFETY: plain syscalls on an open fd.
        sys::UBLK_IO_OP_FLUSH => match unsafe { libc::fdatasync(j.fd) } {
            0 => 0,
            _ => neg_errno(),
        },
        // SAFETY: as above.
        _ => match unsafe {
            libc::fallocate(
                j.fd,
                punch_or_zero(r.op),
                r.off as libc::off_t,
                r.len as libc::off_t,
            )
        } {
            0 => 0,
            _ => neg_errno(),
        },
    }
}
