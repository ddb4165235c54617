//! One request, start to finish, on the policy in force: `nowait` (the queue's
//! io_uring with `RWF_NOWAIT`, an `EAGAIN` resubmitted to io-wq), `threaded`
//! (io_uring's blocking io-wq workers, `IOSQE_ASYNC`) or `direct` (the extent
//! map, straight to the raw device). Nothing here is shared with another
//! thread (see [`QueueCtx`]), but for the chunk states of a snapshot's
//! copy-before-write while one runs ([`super::moment`]): a write keeps the
//! moment's chunks it touches before it goes on.
//!
//! What each op does:
//!
//! | op | nowait / threaded (the image file) | direct (the raw device) |
//! |---|---|---|
//! | READ / WRITE | O_DIRECT read/write of the image | O_DIRECT read/write of each mapped piece |
//! | WRITE + FUA | `RWF_DSYNC` | `RWF_DSYNC` (REQ_FUA) |
//! | FLUSH | `fdatasync(image)` | `fsync(raw device)`: a cache flush |
//! | DISCARD, `sparse` image | punch a hole (`KEEP_SIZE`) | accepted, nothing done: the image's block map must not change, and discard promises nothing of the data |
//! | DISCARD, `full` image | accepted, nothing done: the blocks stay allocated and written, so the image stays eligible for `direct` | same |
//! | DISCARD while a snapshot's moment is copied | accepted, nothing done: the blocks stay (no chunk need be copied first) | — (no copy on `direct`) |
//! | WRITE_ZEROES, `sparse` image | zero range (`KEEP_SIZE`) | zeroes written on the raw device (`fallocate(ZERO_RANGE)` of the block device) |
//! | WRITE_ZEROES, `full` image | `fallocate(FALLOC_FL_WRITE_ZEROES)` (Linux 6.17+, where the filesystem has it), else zeroes written from the queue's zero buffer: extents stay written | same |
//! | other | `-EINVAL` | `-EINVAL` |

use std::alloc::Layout;
use std::cell::{Cell, OnceCell, Ref, RefCell};
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Waker;
use std::time::Instant;

use io_uring::{opcode, squeue, types};
use libublk::io::UblkQueue;
use libublk::sys;
use libublk::uring_async::UblkUringOpFuture;

use super::gate::Gate;
use super::mailbox::{Mailbox, Msg, QueueConfig};
use super::moment::ChunkBuf;
use super::stats::{QueueLatency, QueueReport};
use crate::direct_path::DirectPath;
use crate::qos;
use crate::shared::Shared;
use blockplane_protocol::DataPath;
use blockplane_protocol::stats_file::{Op, QueueCounters, bump};
use blockplane_system::image::FALLOC_FL_WRITE_ZEROES;

/// Registered-file slots of every queue's ring: libublk puts the ublk char
/// device at 0; the image (data fd) is at 1; the direct path's raw devices
/// follow, registered when a queue enters `direct`.
pub const IMAGE_SLOT: u32 = 1;
const RAW_SLOT: u32 = 2;
/// Raw devices that get a registered slot (a map rarely spans more than one).
pub const RAW_SLOTS: usize = 4;
/// Pieces of a `direct` request put on the ring together.
const PIECES_TOGETHER: usize = 8;

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

/// A file on a queue's ring: a registered slot or a plain descriptor.
#[derive(Debug, Clone, Copy)]
enum FileRef {
    Slot(u32),
    Fd(i32),
}

/// Builds an SQE on `file`, registered or not.
macro_rules! on_file {
    ($file:expr, |$t:ident| $sqe:expr) => {
        match $file {
            FileRef::Slot(i) => {
                let $t = types::Fixed(i);
                $sqe
            }
            FileRef::Fd(fd) => {
                let $t = types::Fd(fd);
                $sqe
            }
        }
    };
}

fn rw_sqe(op: u32, file: FileRef, p: *mut u8, n: u32, off: u64, flags: i32) -> squeue::Entry {
    if op == sys::UBLK_IO_OP_READ {
        on_file!(file, |f| opcode::Read::new(f, p, n)
            .offset(off)
            .rw_flags(flags)
            .build())
    } else {
        on_file!(file, |f| opcode::Write::new(f, p, n)
            .offset(off)
            .rw_flags(flags)
            .build())
    }
}

/// A request's data: the tag's own buffer (copy mode), or the request's pages,
/// which the kernel registered on the queue's ring at the tag's index
/// (zero copy, `UBLK_F_AUTO_BUF_REG`): the server never touches the bytes.
#[derive(Debug, Clone, Copy)]
pub enum Buf {
    Mem(*mut u8),
    Registered(u16),
}

impl Buf {
    /// Reads or writes `n` bytes at `at` within the buffer, on `file` at `off`.
    fn rw_sqe(
        self,
        op: u32,
        file: FileRef,
        at: u64,
        n: u32,
        off: u64,
        flags: i32,
    ) -> squeue::Entry {
        match self {
            // SAFETY: callers stay within the request, within the tag's buffer.
            Buf::Mem(p) => rw_sqe(op, file, unsafe { p.add(at as usize) }, n, off, flags),
            // A registered kernel buffer is addressed from 0.
            Buf::Registered(index) => {
                let at = at as usize as *mut u8;
                if op == sys::UBLK_IO_OP_READ {
                    on_file!(file, |f| opcode::ReadFixed::new(f, at, n, index)
                        .offset(off)
                        .rw_flags(flags)
                        .build())
                } else {
                    on_file!(file, |f| opcode::WriteFixed::new(f, at, n, index)
                        .offset(off)
                        .rw_flags(flags)
                        .build())
                }
            }
        }
    }

    /// Zeroes `n` bytes at `at` (a read past the image's end).
    async fn zero(self, q: &UblkQueue<'_>, zero: FileRef, at: u64, n: u32) -> i32 {
        match self {
            Buf::Mem(p) => {
                // SAFETY: within the request, within the tag's buffer.
                unsafe { std::ptr::write_bytes(p.add(at as usize), 0, n as usize) };
                0
            }
            // The bytes are the kernel's: /dev/zero fills them.
            Buf::Registered(_) => q
                .ublk_submit_sqe(self.rw_sqe(sys::UBLK_IO_OP_READ, zero, at, n, 0, 0))
                .await
                .min(0),
        }
    }
}

/// One read or write: `n` bytes at `at` within a request's buffer, at `off`
/// in a file.
#[derive(Debug, Clone, Copy)]
struct Io {
    op: u32,
    buf: Buf,
    at: u64,
    n: u32,
    off: u64,
    /// `RWF_*` (`RWF_DSYNC` for FUA).
    flags: i32,
}

impl Io {
    fn sqe(&self, file: FileRef, more_flags: i32) -> squeue::Entry {
        self.buf.rw_sqe(
            self.op,
            file,
            self.at,
            self.n,
            self.off,
            self.flags | more_flags,
        )
    }

    /// What is left after `done` bytes.
    fn after(self, done: u32) -> Self {
        Self {
            at: self.at + u64::from(done),
            n: self.n - done,
            off: self.off + u64::from(done),
            ..self
        }
    }
}

fn fallocate_sqe(file: FileRef, off: u64, len: u64, mode: i32) -> squeue::Entry {
    on_file!(file, |f| opcode::Fallocate::new(f, len)
        .offset(off)
        .mode(mode)
        .build())
}

fn fsync_sqe(file: FileRef, datasync: bool) -> squeue::Entry {
    let flags = if datasync {
        types::FsyncFlags::DATASYNC
    } else {
        types::FsyncFlags::empty()
    };
    on_file!(file, |f| opcode::Fsync::new(f).flags(flags).build())
}

/// Bytes of a queue's zero buffer, written from by WRITE_ZEROES on a `full`
/// image where `FALLOC_FL_WRITE_ZEROES` is missing.
const ZEROS_LEN: usize = 1 << 20;

/// A page-aligned (O_DIRECT) zeroed buffer, never written to: the source of
/// zeroes written to a `full` image. One per queue, allocated on first use.
struct Zeros(std::ptr::NonNull<u8>);

impl Zeros {
    fn layout() -> Layout {
        Layout::from_size_align(ZEROS_LEN, 4096).expect("valid layout")
    }

    fn new() -> Self {
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        Self(
            std::ptr::NonNull::new(p)
                .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout())),
        )
    }

    /// For write SQEs only: the kernel reads from it, nothing writes to it.
    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }
}

impl Drop for Zeros {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.0.as_ptr(), Self::layout()) }
    }
}

/// `fallocate` mode for DISCARD (punch) and WRITE_ZEROES (zero range) on a
/// `sparse` image.
pub fn punch_or_zero(op: u32) -> i32 {
    if op == sys::UBLK_IO_OP_DISCARD {
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
    } else {
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
    }
}

/// How the file policies submit a read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileMode {
    /// `RWF_NOWAIT` first, io-wq on EAGAIN.
    Nowait,
    /// Straight to io-wq's blocking workers (`IOSQE_ASYNC`), never NOWAIT.
    Threaded,
}

impl FileMode {
    /// An SQE as this mode submits it (blocking ones on io-wq for `threaded`).
    fn submit(self, sqe: squeue::Entry) -> squeue::Entry {
        match self {
            FileMode::Threaded => sqe.flags(squeue::Flags::ASYNC),
            FileMode::Nowait => sqe,
        }
    }
}

/// Whether an op type still asks `RWF_NOWAIT`: a type whose EAGAIN share over
/// a window is high (XFS writes that must update timestamps, say) stops for
/// a while, since every EAGAIN costs a trip back through the queue.
#[derive(Debug, Clone, Copy, Default)]
struct NowaitWindow {
    seen: u32,
    eagain: u32,
    paused_for: u32,
}

impl NowaitWindow {
    const WINDOW: u32 = 256;
    /// Submissions made without NOWAIT once paused, before trying it again.
    const PAUSE: u32 = 8192;

    fn asks(&mut self) -> bool {
        if self.paused_for > 0 {
            self.paused_for -= 1;
            return false;
        }
        true
    }

    /// Records one NOWAIT attempt; true if the type pauses now.
    fn record(&mut self, eagain: bool) -> bool {
        self.seen += 1;
        self.eagain += u32::from(eagain);
        if self.seen < Self::WINDOW {
            return false;
        }
        let pause = self.eagain * 2 > self.seen;
        *self = Self {
            paused_for: if pause { Self::PAUSE } else { 0 },
            ..Self::default()
        };
        pause
    }
}

/// The config in force on this queue, with what its ring holds for it.
struct Local {
    cfg: QueueConfig,
    /// The direct path's raw devices sit in registered slots.
    raw_registered: bool,
}

/// One queue thread's state: everything its requests touch, owned here.
pub struct QueueCtx {
    qid: usize,
    shared: Arc<Shared>,
    mailbox: Arc<Mailbox>,
    local: RefCell<Rc<Local>>,
    /// Where a policy switch holds new requests.
    gate: Gate,
    latency: RefCell<QueueLatency>,
    /// This queue's QoS tokens, leased from the volume's QoS thread.
    lease: RefCell<qos::Lease>,
    /// Read and write.
    nowait: [Cell<NowaitWindow>; 2],
    /// What the image's filesystem refused once, and is not asked again.
    unsupported: Unsupported,
    zeros: OnceCell<Zeros>,
    /// Where this queue's writes keep a moment's chunks (allocated when the
    /// first moment is put in force, for the queue's life).
    moment_buf: RefCell<Option<ChunkBuf>>,
}

/// What an image's filesystem refused once: the queue does without it from
/// then on.
#[derive(Default)]
struct Unsupported {
    /// `RWF_NOWAIT` (EOPNOTSUPP: no FMODE_NOWAIT, e.g. tmpfs on older
    /// kernels): blocking from then on.
    nowait: Cell<bool>,
    /// `FALLOC_FL_WRITE_ZEROES`: zeroes are written from
    /// [`QueueCtx::zeros`] from then on.
    write_zeroes: Cell<bool>,
}

impl QueueCtx {
    /// Queue `qid`'s state, serving with `cfg`.
    pub fn new(qid: usize, shared: Arc<Shared>, mailbox: Arc<Mailbox>, cfg: QueueConfig) -> Self {
        let me = Self {
            qid,
            shared,
            mailbox,
            local: RefCell::new(Rc::new(Local {
                cfg: cfg.clone(),
                raw_registered: false,
            })),
            gate: Gate::default(),
            latency: RefCell::default(),
            lease: RefCell::default(),
            nowait: Default::default(),
            unsupported: Unsupported::default(),
            zeros: OnceCell::new(),
            moment_buf: RefCell::default(),
        };
        me.install(cfg);
        me
    }

    fn counters(&self) -> &QueueCounters {
        self.shared.stats.queue(self.qid)
    }

    /// Puts a config in force; registers the direct path's raw devices on
    /// this thread's ring.
    fn install(&self, cfg: QueueConfig) {
        let raw_registered = cfg.direct.as_ref().is_some_and(|d| register_raw(d));
        if cfg.moment.is_some() {
            self.moment_buf
                .borrow_mut()
                .get_or_insert_with(ChunkBuf::new);
        }
        let limiter = |c: &QueueConfig| c.qos.as_ref().map(|l| l.id());
        let new_limits = limiter(&self.local.borrow().cfg) != limiter(&cfg);
        *self.local.borrow_mut() = Rc::new(Local {
            cfg,
            raw_registered,
        });
        if new_limits {
            // Requests waiting for tokens of the old limits look again.
            let waiting = self.lease.borrow_mut().void();
            waiting.into_iter().for_each(Waker::wake);
        }
    }

    /// Takes the control thread's messages (on this queue's thread).
    pub fn take_messages(&self) {
        for m in self.mailbox.take() {
            match m {
                Msg::Hold(done) => self.gate.hold(done),
                Msg::Apply(cfg, done) => {
                    self.install(cfg);
                    self.gate.open();
                    let _ = done.send(());
                }
                Msg::Report(to) => {
                    let _ = to.send(QueueReport {
                        latency: self.latency.borrow().clone(),
                        in_flight: self.gate.in_flight(),
                    });
                }
                Msg::Grant(g) => {
                    let waiting = self.lease.borrow_mut().receive(g);
                    waiting.into_iter().for_each(Waker::wake);
                }
            }
        }
    }

    /// Serves one request; returns its result (bytes, 0, or -errno).
    pub async fn serve(&self, q: &UblkQueue<'_>, req: Req, buf: Buf) -> i32 {
        let Some(op) = req.kind() else {
            return -libc::EINVAL;
        };
        let started = Instant::now();
        if self.local.borrow().cfg.qos.is_some() {
            // Looked up at each wake-up: the limits may change meanwhile.
            let limiter = || Ref::filter_map(self.local.borrow(), |l| l.cfg.qos.as_deref()).ok();
            if qos::admit(limiter, &self.lease, &self.mailbox, req.len).await {
                bump(&self.counters().qos_throttled, 1);
            }
        }
        self.gate.admitted().await;
        let local = self.local.borrow().clone();
        self.gate.enter();
        let moment = local.cfg.moment.as_deref().filter(|_| req.writes());
        let res = if req.writes() && local.cfg.read_only {
            -libc::EROFS
        } else if moment.is_some() && req.op == sys::UBLK_IO_OP_DISCARD {
            // Discard promises nothing of the data: while a moment is copied
            // the blocks stay, so a large one never waits for the copy of
            // every chunk it spans.
            0
        } else {
            if let Some(m) = moment {
                let mut buf = self.moment_buf.borrow_mut();
                m.keep(
                    req.off,
                    u64::from(req.len),
                    buf.get_or_insert_with(ChunkBuf::new),
                );
            }
            match (local.cfg.policy, &local.cfg.direct) {
                (DataPath::Nowait, _) => {
                    let mode = FileMode::Nowait;
                    self.file(q, req, buf, mode, local.cfg.keep_allocated).await
                }
                (DataPath::Threaded, _) => {
                    let mode = FileMode::Threaded;
                    self.file(q, req, buf, mode, local.cfg.keep_allocated).await
                }
                (DataPath::Direct, Some(d)) => direct(q, d, local.raw_registered, req, buf).await,
                // Cannot happen: the policy and the path change together.
                (DataPath::Direct, None) => -libc::EIO,
            }
        };
        drop(local);
        self.gate.leave();
        let bytes = if op == Op::Flush {
            0
        } else {
            u64::from(req.len)
        };
        self.counters().complete(op, bytes, res);
        self.latency
            .borrow_mut()
            .record(op, started.elapsed().as_micros() as u64);
        res
    }

    /// `nowait` and `threaded`: the image, through its registered slot.
    /// `keep_allocated` (a `full` image): DISCARD and WRITE_ZEROES never
    /// punch or leave unwritten extents.
    async fn file(
        &self,
        q: &UblkQueue<'_>,
        req: Req,
        buf: Buf,
        mode: FileMode,
        keep_allocated: bool,
    ) -> i32 {
        let image = FileRef::Slot(IMAGE_SLOT);
        let asynch = |sqe: squeue::Entry| mode.submit(sqe);
        match req.op {
            sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE => {
                let flags = if req.fua { libc::RWF_DSYNC } else { 0 };
                let mut done = 0u32;
                while done < req.len {
                    let io = Io {
                        op: req.op,
                        buf,
                        at: u64::from(done),
                        n: req.len - done,
                        off: req.off + u64::from(done),
                        flags,
                    };
                    let res = match mode {
                        FileMode::Threaded => q.ublk_submit_sqe(asynch(io.sqe(image, 0))).await,
                        FileMode::Nowait => self.nowait_rw(q, io).await,
                    };
                    match res {
                        r if r < 0 => return r,
                        0 => {
                            // Past the image's end (a grown device before the
                            // file caught up): reads see zeroes.
                            if req.op == sys::UBLK_IO_OP_WRITE {
                                return -libc::EIO;
                            }
                            let zero = FileRef::Fd(self.shared.zero.as_raw_fd());
                            let r = buf.zero(q, zero, io.at, io.n).await;
                            if r < 0 {
                                return r;
                            }
                            break;
                        }
                        r => done += r as u32,
                    }
                }
                req.len as i32
            }
            sys::UBLK_IO_OP_FLUSH => q
                .ublk_submit_sqe(asynch(fsync_sqe(image, true)))
                .await
                .min(0),
            // Discard promises nothing of the data: the blocks stay.
            sys::UBLK_IO_OP_DISCARD if keep_allocated => 0,
            sys::UBLK_IO_OP_WRITE_ZEROES if keep_allocated => self.write_zeroes(q, req, mode).await,
            _ => {
                let sqe = fallocate_sqe(image, req.off, u64::from(req.len), punch_or_zero(req.op));
                q.ublk_submit_sqe(sqe).await.min(0)
            }
        }
    }

    /// WRITE_ZEROES on a `full` image: zeroes that leave written extents.
    /// `FALLOC_FL_WRITE_ZEROES` while the kernel takes it; once refused, the
    /// queue's zero buffer written over the range (never the request's
    /// buffer, which may be the kernel's pages).
    async fn write_zeroes(&self, q: &UblkQueue<'_>, req: Req, mode: FileMode) -> i32 {
        let image = FileRef::Slot(IMAGE_SLOT);
        let len = u64::from(req.len);
        if !self.unsupported.write_zeroes.get() {
            let sqe = fallocate_sqe(image, req.off, len, FALLOC_FL_WRITE_ZEROES);
            let r = q.ublk_submit_sqe(sqe).await;
            if r != -libc::EOPNOTSUPP && r != -libc::EINVAL {
                return r.min(0);
            }
            self.unsupported.write_zeroes.set(true);
            tracing::info!(
                queue = self.qid,
                "FALLOC_FL_WRITE_ZEROES not available here; this queue writes zeroes for WRITE_ZEROES"
            );
        }
        let zeros = self.zeros.get_or_init(Zeros::new).ptr();
        let flags = if req.fua { libc::RWF_DSYNC } else { 0 };
        let (mut off, end) = (req.off, req.off + len);
        while off < end {
            let n = (end - off).min(ZEROS_LEN as u64) as u32;
            let sqe = rw_sqe(sys::UBLK_IO_OP_WRITE, image, zeros, n, off, flags);
            match q.ublk_submit_sqe(mode.submit(sqe)).await {
                r if r < 0 => return r,
                0 => return -libc::EIO,
                r => off += r as u64,
            }
        }
        0
    }

    /// One read or write on the `nowait` path: `RWF_NOWAIT` while its op type
    /// asks it; an EAGAIN goes straight to io-wq (`IOSQE_ASYNC`).
    async fn nowait_rw(&self, q: &UblkQueue<'_>, io: Io) -> i32 {
        let image = FileRef::Slot(IMAGE_SLOT);
        let c = self.counters();
        let window = &self.nowait[usize::from(io.op != sys::UBLK_IO_OP_READ)];
        let mut w = window.get();
        let asks = w.asks();
        window.set(w);
        if !asks || self.unsupported.nowait.get() {
            // io_uring still tries it without blocking first, then punts.
            bump(&c.nowait_bypassed, 1);
            return q.ublk_submit_sqe(io.sqe(image, 0)).await;
        }
        bump(&c.nowait_submitted, 1);
        let res = q.ublk_submit_sqe(io.sqe(image, libc::RWF_NOWAIT)).await;
        if res == -libc::EOPNOTSUPP && !self.unsupported.nowait.replace(true) {
            tracing::warn!(
                queue = self.qid,
                "the image's filesystem does not take RWF_NOWAIT; this queue now submits blocking"
            );
        }
        let again = res == -libc::EAGAIN || res == -libc::EOPNOTSUPP;
        let mut w = window.get();
        if w.record(again) {
            bump(&c.nowait_pauses, 1);
        }
        window.set(w);
        if !again {
            bump(&c.nowait_completed_inline, 1);
            return res;
        }
        bump(&c.nowait_eagain_fallbacks, 1);
        q.ublk_submit_sqe(io.sqe(image, 0).flags(squeue::Flags::ASYNC))
            .await
    }
}

/// Registers the direct path's raw devices on this thread's ring; false if
/// the ring would not take them (they are then used by descriptor).
fn register_raw(d: &DirectPath) -> bool {
    if d.devices.len() > RAW_SLOTS {
        return false;
    }
    let fds: Vec<i32> = d.devices.iter().map(|f| f.as_raw_fd()).collect();
    libublk::io::with_task_io_ring(|r| r.submitter().register_files_update(RAW_SLOT, &fds))
        .inspect_err(|e| tracing::warn!(error = %e, "raw devices not registered with the ring"))
        .is_ok()
}

fn raw_device(d: &DirectPath, registered: bool, device: usize) -> FileRef {
    if registered {
        FileRef::Slot(RAW_SLOT + device as u32)
    } else {
        FileRef::Fd(d.devices[device].as_raw_fd())
    }
}

/// `direct`: through the extent map to the raw device(s). The pieces of a
/// request go on the ring together.
async fn direct(q: &UblkQueue<'_>, d: &DirectPath, registered: bool, req: Req, buf: Buf) -> i32 {
    match req.op {
        sys::UBLK_IO_OP_FLUSH => {
            for dev in 0..d.devices.len() {
                let r = q
                    .ublk_submit_sqe(fsync_sqe(raw_device(d, registered, dev), false))
                    .await;
                if r < 0 {
                    return r;
                }
            }
            0
        }
        sys::UBLK_IO_OP_DISCARD => 0,
        _ => {
            let Some(mut pieces) = d.map.pieces(req.off, u64::from(req.len)) else {
                return -libc::EIO;
            };
            let zeroes = req.op == sys::UBLK_IO_OP_WRITE_ZEROES;
            let flags = if req.fua { libc::RWF_DSYNC } else { 0 };
            loop {
                let mut out: [Option<(UblkUringOpFuture, FileRef, Io)>; PIECES_TOGETHER] =
                    Default::default();
                let mut any = false;
                for (slot, p) in out.iter_mut().zip(pieces.by_ref()) {
                    let file = raw_device(d, registered, p.device);
                    let io = Io {
                        op: req.op,
                        buf,
                        at: p.offset_in_request,
                        n: p.len as u32,
                        off: p.physical,
                        flags,
                    };
                    let sqe = if zeroes {
                        let mode = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
                        fallocate_sqe(file, p.physical, p.len, mode)
                    } else {
                        io.sqe(file, 0)
                    };
                    *slot = Some((q.ublk_submit_sqe(sqe), file, io));
                    any = true;
                }
                if !any {
                    break;
                }
                // Every piece in flight is awaited, even after a failure.
                let mut failed = 0;
                for (f, file, io) in out.into_iter().flatten() {
                    let r = f.await;
                    if failed < 0 {
                        continue;
                    }
                    failed = if r < 0 {
                        r
                    } else if !zeroes && (r as u32) < io.n {
                        // Short: finish the piece on its own.
                        finish(q, file, io.after(r as u32)).await
                    } else {
                        0
                    };
                }
                if failed < 0 {
                    return failed;
                }
            }
            if zeroes { 0 } else { req.len as i32 }
        }
    }
}

/// The rest of a piece after a short transfer.
async fn finish(q: &UblkQueue<'_>, file: FileRef, mut io: Io) -> i32 {
    while io.n > 0 {
        let r = q.ublk_submit_sqe(io.sqe(file, 0)).await;
        if r <= 0 {
            return if r == 0 { -libc::EIO } else { r };
        }
        io = io.after(r as u32);
    }
    0
}

#[cfg(test)]
mod tests {
    use super::NowaitWindow;

    #[test]
    fn an_op_type_that_mostly_gets_eagain_stops_asking_nowait_for_a_while() {
        let mut w = NowaitWindow::default();
        // Half or fewer EAGAINs: keeps asking.
        for i in 0..NowaitWindow::WINDOW {
            assert!(w.asks());
            assert!(!w.record(i % 2 == 0));
        }
        // Most: pauses at the end of the window.
        let mut paused = false;
        for _ in 0..NowaitWindow::WINDOW {
            assert!(w.asks());
            paused = w.record(true);
        }
        assert!(paused);
        let bypassed = (0..).take_while(|_| !w.asks()).count();
        assert_eq!(bypassed, NowaitWindow::PAUSE as usize);
        assert!(w.asks(), "asks again after the pause");
    }
}
