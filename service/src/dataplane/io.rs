//! One request, start to finish, on the policy in force: `nowait` (the queue's
//! io_uring with `RWF_NOWAIT`, resubmitted blocking on `EAGAIN`), `threaded`
//! (a pool thread's blocking syscalls) or `direct` (the extent map, straight to
//! the raw device).
//!
//! What each op does:
//!
//! | op | nowait / threaded (the image file) | direct (the raw device) |
//! |---|---|---|
//! | READ / WRITE | O_DIRECT read/write of the image | O_DIRECT read/write of each mapped piece |
//! | WRITE + FUA | `RWF_DSYNC` | `RWF_DSYNC` (REQ_FUA) |
//! | FLUSH | `fdatasync(image)` | `fsync(raw device)`: a cache flush |
//! | DISCARD | punch a hole (`KEEP_SIZE`) | accepted, nothing done: the image's block map must not change, and discard promises nothing of the data |
//! | WRITE_ZEROES | zero range (`KEEP_SIZE`) | zeroes written on the raw device (`fallocate(ZERO_RANGE)` of the block device) |
//! | other | `-EINVAL` | `-EINVAL` |

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use io_uring::{opcode, types};
use libublk::io::UblkQueue;
use libublk::sys;

use super::gate::{Gate, Kick, Slot};
use super::pool::{Job, Pool};
use super::stats::Op;
use super::{DirectPath, Policy, Shared};

/// A request as the kernel describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Req {
    pub op: u32,
    pub fua: bool,
    pub off: u64,
    pub len: u32,
}

impl Req {
    /// Decodes an I/O descriptor.
    pub fn from_iod(iod: &sys::ublksrv_io_desc) -> Self {
        Self {
            op: iod.op_flags & 0xff,
            fua: iod.op_flags & sys::UBLK_IO_F_FUA != 0,
            off: iod.start_sector << 9,
            len: iod.nr_sectors << 9,
        }
    }

    fn kind(&self) -> Option<Op> {
        match self.op {
            sys::UBLK_IO_OP_READ => Some(Op::Read),
            sys::UBLK_IO_OP_WRITE => Some(Op::Write),
            sys::UBLK_IO_OP_FLUSH => Some(Op::Flush),
            sys::UBLK_IO_OP_DISCARD | sys::UBLK_IO_OP_WRITE_ZEROES => Some(Op::Discard),
            _ => None,
        }
    }

    fn writes(&self) -> bool {
        matches!(
            self.op,
            sys::UBLK_IO_OP_WRITE | sys::UBLK_IO_OP_DISCARD | sys::UBLK_IO_OP_WRITE_ZEROES
        )
    }
}

/// What a queue thread's tasks share.
pub struct QueueCtx {
    pub qid: usize,
    pub shared: Arc<Shared>,
    pub gate: Arc<Gate>,
    pub kick: Arc<Kick>,
    pub pool: Pool,
}

impl QueueCtx {
    /// Serves one request; returns its result (bytes, 0, or -errno).
    pub async fn serve(&self, q: &UblkQueue<'_>, req: Req, buf: *mut u8) -> i32 {
        let Some(op) = req.kind() else {
            return -libc::EINVAL;
        };
        let started = Instant::now();
        let stats = &self.shared.stats;
        stats.in_flight.fetch_add(1, Relaxed);
        self.shared.qos.admit(q, &req, &stats.counters).await;
        let res = if req.writes() && self.shared.read_only.load(Relaxed) {
            -libc::EROFS
        } else {
            let _inside = self.gate.enter().await;
            match self.shared.policy() {
                Policy::Nowait => self.file_uring(q, req, buf).await,
                Policy::Threaded => self.file_pool(req, buf).await,
                Policy::Direct => match self.shared.direct_path() {
                    Some(d) => direct(q, &d, req, buf).await,
                    // Cannot happen: the policy and the path change together.
                    None => -libc::EIO,
                },
            }
        };
        stats.in_flight.fetch_sub(1, Relaxed);
        let bytes = if op == Op::Flush {
            0
        } else {
            u64::from(req.len)
        };
        stats.complete(
            self.qid,
            op,
            bytes,
            res,
            started.elapsed().as_micros() as u64,
        );
        res
    }

    /// `nowait`: the image on the queue's ring, `RWF_NOWAIT` first.
    async fn file_uring(&self, q: &UblkQueue<'_>, req: Req, buf: *mut u8) -> i32 {
        let fd = self.shared.data.as_raw_fd();
        match req.op {
            sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE => {
                let c = &self.shared.stats.counters;
                let mut done = 0u32;
                while done < req.len {
                    // SAFETY: within the tag's buffer of at least req.len bytes.
                    let p = unsafe { buf.add(done as usize) };
                    let (n, o) = (req.len - done, req.off + u64::from(done));
                    let dsync = if req.fua { libc::RWF_DSYNC } else { 0 };
                    c.nowait_submitted.fetch_add(1, Relaxed);
                    let unsupported = &self.shared.nowait_unsupported;
                    let mut res = if unsupported.load(Relaxed) {
                        -libc::EAGAIN
                    } else {
                        q.ublk_submit_sqe(rw_sqe(req.op, fd, p, n, o, dsync | libc::RWF_NOWAIT))
                            .await
                    };
                    if res == -libc::EOPNOTSUPP && !unsupported.swap(true, Relaxed) {
                        tracing::warn!(
                            "the image's filesystem does not take RWF_NOWAIT; every request now takes the blocking path"
                        );
                    }
                    if res == -libc::EAGAIN || res == -libc::EOPNOTSUPP {
                        // Would block (or cannot say): io_uring without NOWAIT
                        // punts it to io-wq.
                        c.nowait_eagain_fallbacks.fetch_add(1, Relaxed);
                        res = q.ublk_submit_sqe(rw_sqe(req.op, fd, p, n, o, dsync)).await;
                    } else {
                        c.nowait_completed_inline.fetch_add(1, Relaxed);
                    }
                    match res {
                        r if r < 0 => return r,
                        0 => {
                            // Past the image's end (a grown device before the
                            // file caught up): reads see zeroes.
                            if req.op == sys::UBLK_IO_OP_WRITE {
                                return -libc::EIO;
                            }
                            // SAFETY: as above.
                            unsafe { std::ptr::write_bytes(p, 0, n as usize) };
                            break;
                        }
                        r => done += r as u32,
                    }
                }
                req.len as i32
            }
            sys::UBLK_IO_OP_FLUSH => {
                let sqe = opcode::Fsync::new(types::Fd(fd))
                    .flags(types::FsyncFlags::DATASYNC)
                    .build();
                q.ublk_submit_sqe(sqe).await.min(0)
            }
            _ => {
                let sqe = opcode::Fallocate::new(types::Fd(fd), u64::from(req.len))
                    .offset(req.off)
                    .mode(punch_or_zero(req.op))
                    .build();
                q.ublk_submit_sqe(sqe).await.min(0)
            }
        }
    }

    /// `threaded`: one work item for a pool thread.
    async fn file_pool(&self, req: Req, buf: *mut u8) -> i32 {
        let slot = Arc::new(Slot::default());
        let job = Job {
            req,
            fd: self.shared.data.as_raw_fd(),
            buf: buf as usize,
            slot: slot.clone(),
            kick: self.kick.clone(),
        };
        if !self.pool.submit(job) {
            return -libc::EIO;
        }
        slot.wait().await
    }
}

fn rw_sqe(op: u32, fd: RawFd, p: *mut u8, n: u32, off: u64, flags: i32) -> io_uring::squeue::Entry {
    if op == sys::UBLK_IO_OP_READ {
        opcode::Read::new(types::Fd(fd), p, n)
            .offset(off)
            .rw_flags(flags)
            .build()
    } else {
        opcode::Write::new(types::Fd(fd), p, n)
            .offset(off)
            .rw_flags(flags)
            .build()
    }
}

/// `fallocate` mode for DISCARD (punch) and WRITE_ZEROES (zero range).
pub fn punch_or_zero(op: u32) -> i32 {
    if op == sys::UBLK_IO_OP_DISCARD {
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
    } else {
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
    }
}

/// `direct`: through the extent map to the raw device(s).
async fn direct(q: &UblkQueue<'_>, d: &DirectPath, req: Req, buf: *mut u8) -> i32 {
    match req.op {
        sys::UBLK_IO_OP_FLUSH => {
            for dev in &d.devices {
                let r = q
                    .ublk_submit_sqe(opcode::Fsync::new(types::Fd(dev.as_raw_fd())).build())
                    .await;
                if r < 0 {
                    return r;
                }
            }
            0
        }
        sys::UBLK_IO_OP_DISCARD => 0,
        _ => {
            let Some(pieces) = d.map.pieces(req.off, u64::from(req.len)) else {
                return -libc::EIO;
            };
            for p in pieces {
                let fd = d.devices[p.device].as_raw_fd();
                let res = if req.op == sys::UBLK_IO_OP_WRITE_ZEROES {
                    let sqe = opcode::Fallocate::new(types::Fd(fd), p.len)
                        .offset(p.physical)
                        .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                        .build();
                    q.ublk_submit_sqe(sqe).await.min(0)
                } else {
                    // SAFETY: the piece lies within the request, within the buffer.
                    let at = unsafe { buf.add(p.offset_in_request as usize) };
                    let dsync = if req.fua { libc::RWF_DSYNC } else { 0 };
                    let mut done = 0u64;
                    let mut r = 0;
                    while done < p.len {
                        // SAFETY: as above.
                        let ptr = unsafe { at.add(done as usize) };
                        r = q
                            .ublk_submit_sqe(rw_sqe(
                                req.op,
                                fd,
                                ptr,
                                (p.len - done) as u32,
                                p.physical + done,
                                dsync,
                            ))
                            .await;
                        if r <= 0 {
                            break;
                        }
                        done += r as u64;
                    }
                    if r == 0 { -libc::EIO } else { r.min(0) }
                };
                if res < 0 {
                    return res;
                }
            }
            if req.op == sys::UBLK_IO_OP_WRITE_ZEROES {
                0
            } else {
                req.len as i32
            }
        }
    }
}
