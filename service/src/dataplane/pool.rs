//! The `threaded` policy's pool: worker threads that take one command each
//! off a shared queue, do blocking syscalls on the image, and hand the result
//! back to the command's task. Any free thread takes the next command: there is
//! no single serialising dispatcher.
//!
//! The queue is a mutex and a condition variable, so an idle thread parks at
//! once: a channel that spins before parking (crossbeam's) cost 16% of all
//! CPU samples in the benchmark's profile, stolen from the threads doing I/O.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex};

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

/// The jobs waiting for a thread, and whether the pool is closing.
#[derive(Default)]
struct Queue {
    state: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
}

impl Queue {
    /// The next job, waiting for one; `None` once the pool closes.
    fn take(&self) -> Option<Job> {
        let mut st = self.state.lock().ok()?;
        loop {
            if let Some(job) = st.0.pop_front() {
                return Some(job);
            }
            if st.1 {
                return None;
            }
            st = self.ready.wait(st).ok()?;
        }
    }

    fn close(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.1 = true;
        }
        self.ready.notify_all();
    }
}

/// Closes the queue when the last [`Pool`] handle goes, so the threads end.
struct Closer(Arc<Queue>);

impl Drop for Closer {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// A handle to the pool; cloned into every queue.
#[derive(Clone)]
pub struct Pool {
    queue: Arc<Queue>,
    _closer: Arc<Closer>,
}

impl Pool {
    /// Starts `threads` pool threads.
    pub fn start(threads: usize) -> std::io::Result<Self> {
        let queue = Arc::new(Queue::default());
        for i in 0..threads.max(1) {
            let q = queue.clone();
            std::thread::Builder::new()
                .name(format!("pool-{i}"))
                .spawn(move || {
                    while let Some(job) = q.take() {
                        let res = blocking(&job);
                        job.slot.fill(res, &job.kick);
                    }
                })?;
        }
        Ok(Self {
            _closer: Arc::new(Closer(queue.clone())),
            queue,
        })
    }

    /// Queues a job; false if the pool is gone (its lock poisoned).
    pub fn submit(&self, job: Job) -> bool {
        let Ok(mut st) = self.queue.state.lock() else {
            return false;
        };
        st.0.push_back(job);
        drop(st);
        self.queue.ready.notify_one();
        true
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
