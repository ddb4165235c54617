//! The worker's control socket (`ctl.sock` in its run dir) and its state file
//! (`state.json`: what a control plane needs to take over after a crash of
//! either side: the device id and the image's pin).

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed, Ordering::SeqCst};
use std::time::{Duration, Instant};

use libublk::ctrl::UblkCtrl;
use libublk::sys;

use crate::refusal::Refusal;
use crate::shared::Shared;
use blockplane_protocol::DataPath;
use blockplane_protocol::{
    self as protocol, Allocation, Answer, ErrorCode, HandoverMethod, Reason, Request, Status,
};

/// The running control thread.
pub struct Control {
    shutdown: Arc<AtomicBool>,
    handover: Arc<Handover>,
    run_dir: PathBuf,
}

/// A handover asked of this worker ([`Request::Handover`]).
#[derive(Default)]
struct Handover {
    /// Set before the device is let go: the queues may end before the
    /// control thread knows how the handover went.
    asked: AtomicBool,
    /// How it went (0 until it is known): [`QUIESCED`], [`DRAINED`] or
    /// [`REFUSED`].
    outcome: AtomicU8,
    /// Set once the control plane has its answer: only then may the worker
    /// exit, or the answer is lost with it.
    answered: AtomicBool,
    /// The test fault's pause before the worker exits, ms.
    pace_ms: std::sync::atomic::AtomicU64,
}

const QUIESCED: u8 = 1;
const DRAINED: u8 = 2;
const REFUSED: u8 = 3;

/// How long the queue side waits for the control thread to answer a
/// handover whose QUIESCE ended the queues.
const ANSWER_WAIT: Duration = Duration::from_secs(60);

impl Control {
    /// Whether the control plane asked for the device to go.
    pub fn shutdown_requested(&self) -> bool {
        self.shutdown.load(Relaxed)
    }

    /// Whether the device was handed over to a successor; if so, after the
    /// pause the test fault asked for.
    /// A quiesce ends the queues before the QUIESCE command returns to the
    /// control thread: this waits for its answer to be sent.
    pub fn handed_over(&self) -> bool {
        let h = &self.handover;
        if !h.asked.load(SeqCst) {
            return false;
        }
        let deadline = std::time::Instant::now() + ANSWER_WAIT;
        while !h.answered.load(SeqCst)
            && h.outcome.load(SeqCst) != REFUSED
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        let done = h.answered.load(SeqCst);
        if done {
            std::thread::sleep(Duration::from_millis(h.pace_ms.load(SeqCst)));
        }
        done
    }

    /// Removes the socket and state file (the device is gone).
    pub fn remove_files(&self) {
        for f in ["ctl.sock", "state.json"] {
            let _ = std::fs::remove_file(self.run_dir.join(f));
        }
    }
}

struct Ctx {
    shared: Arc<Shared>,
    ctrl: Arc<UblkCtrl>,
    dev_id: u32,
    features: u64,
    dev_flags: u64,
    shutdown: Arc<AtomicBool>,
    handover: Arc<Handover>,
    resize_pending: AtomicBool,
}

/// Writes `state.json` atomically.
fn write_state(cx: &Ctx) {
    cx.shared.write_state_file(cx.dev_id);
}

/// The control loop, to run on the thread that calls [`Server::run`].
pub struct Server {
    cx: Ctx,
    listener: UnixListener,
}

/// Binds the socket and writes the state file; the requests are served by
/// [`Server::run`].
pub fn start(
    shared: Arc<Shared>,
    ctrl: Arc<UblkCtrl>,
    dev_id: u32,
    features: u64,
    dev_flags: u64,
) -> std::io::Result<(Control, Server)> {
    let run_dir = shared.spec.run_dir.clone();
    let path = run_dir.join("ctl.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let shutdown = Arc::new(AtomicBool::new(false));
    let handover = Arc::new(Handover::default());
    let cx = Ctx {
        shared,
        ctrl,
        dev_id,
        features,
        dev_flags,
        shutdown: shutdown.clone(),
        handover: handover.clone(),
        resize_pending: AtomicBool::new(false),
    };
    write_state(&cx);
    Ok((
        Control {
            shutdown,
            handover,
            run_dir,
        },
        Server { cx, listener },
    ))
}

impl Server {
    /// Serves requests, and makes the periodic drift checks, until every
    /// one of `queues` queue threads has written to `ended` (an eventfd).
    /// The worker's main thread runs it: no thread of its own.
    pub fn run(self, ended: &OwnedFd, queues: u64) {
        let Self { cx, listener } = self;
        // Control commands go through a per-thread ring libublk keeps.
        if let Err(e) = libublk::ublk_init_ctrl_task_ring(|r| {
            if r.is_none() {
                *r = Some(io_uring::IoUring::<io_uring::squeue::Entry128>::builder().build(16)?);
            }
            Ok(())
        }) {
            tracing::error!(error = %e, "control ring");
            return;
        }
        let every = Duration::from_secs(u64::from(cx.shared.spec.extent_check_secs.max(1)));
        let mut next_check = Instant::now() + every;
        let mut done = 0;
        while done < queues {
            // Rule 5, periodically, while the volume is `direct`: the wait
            // for a connection ends at the next re-read. Off the direct path
            // there is nothing to re-read, and the thread sleeps until asked
            // (a switch to direct comes through here) or the queues end.
            let direct = cx.shared.policy() == DataPath::Direct;
            let wait = direct.then(|| next_check.saturating_duration_since(Instant::now()));
            let (conn, queue_ended) = readable(&listener, ended, wait);
            if queue_ended {
                let mut buf = [0u8; 8];
                if rustix::io::read(ended, &mut buf).is_ok() {
                    done += u64::from_ne_bytes(buf);
                }
            }
            if conn {
                match listener.accept() {
                    Ok((conn, _)) => {
                        if let Err(e) = serve_one(&cx, conn) {
                            tracing::warn!(error = %e, "control connection");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "control accept"),
                }
            }
            if Instant::now() >= next_check {
                if cx.shared.policy() == DataPath::Direct {
                    cx.shared.check_drift();
                }
                next_check = Instant::now() + every;
            }
        }
    }
}

/// Waits until a connection is waiting on `listener` or `ended` is
/// readable, or `wait` (`None`: forever) passes; which were ready.
fn readable(listener: &UnixListener, ended: &OwnedFd, wait: Option<Duration>) -> (bool, bool) {
    let timeout = wait.map(|d| rustix::event::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    });
    let mut fds = [
        rustix::event::PollFd::new(listener, rustix::event::PollFlags::IN),
        rustix::event::PollFd::new(ended, rustix::event::PollFlags::IN),
    ];
    match rustix::event::poll(&mut fds, timeout.as_ref()) {
        Ok(n) if n > 0 => (!fds[0].revents().is_empty(), !fds[1].revents().is_empty()),
        _ => (false, false),
    }
}

fn serve_one(cx: &Ctx, conn: UnixStream) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let served = protocol::serve_connection(&conn, |req| handle(cx, req));
    let outcome = cx.handover.outcome.load(SeqCst);
    if matches!(outcome, QUIESCED | DRAINED) {
        cx.handover.answered.store(true, SeqCst);
    }
    if matches!(outcome, QUIESCED | DRAINED) {
        // The answer is out: exit now rather than when the queues end.
        // Drained: the queues stay held; the kernel requeues what they hold
        // when this process's char device closes, for the successor.
        // Quiesced: no request is inside and new ones wait in the kernel,
        // but a queue's last fetch command may stay un-aborted until this
        // process's ring closes (the kernel skips a tag whose request is
        // starting as it cancels), so its queue would end only when the
        // service kills it, 30 s on.
        drop(conn);
        std::thread::sleep(Duration::from_millis(cx.handover.pace_ms.load(Relaxed)));
        let how = if outcome == QUIESCED {
            "quiesced"
        } else {
            "queues drained"
        };
        tracing::info!(dev_id = cx.dev_id, "handed over ({how}); worker exits");
        std::process::exit(0);
    }
    served
}

fn error(code: ErrorCode, message: impl Into<String>) -> Answer {
    Answer::Error {
        code,
        message: message.into(),
    }
}

fn refusal(e: Refusal) -> Answer {
    error(e.code(), e.to_string())
}

fn status(cx: &Ctx) -> Answer {
    let s = &cx.shared;
    let st = s.state.lock().expect("state poisoned").clone();
    let spec = &s.spec;
    let queues = cx.ctrl.dev_info().nr_hw_queues;
    let zero_copy = cx.dev_flags & u64::from(sys::UBLK_F_AUTO_BUF_REG) != 0;
    Answer::Status(Box::new(Status {
        pid: std::process::id(),
        dev_id: cx.dev_id,
        device: format!("/dev/ublkb{}", cx.dev_id),
        dispatch: s.policy(),
        dispatch_reason: st.dispatch_reason.to_string(),
        dispatch_why: Some(st.dispatch_reason),
        pinned: st.pinned,
        size_bytes: st.size_bytes,
        read_only: s.read_only(),
        buffer_bytes: if zero_copy {
            0
        } else {
            u64::from(queues) * u64::from(spec.queue_depth) * u64::from(spec.max_io_bytes)
        },
        queues,
        zero_copy,
        features: cx.features,
        dev_flags: cx.dev_flags,
        degraded: st.degraded,
        resize_pending: cx.resize_pending.load(Relaxed),
        allocate: s.fill_state(),
        copy: s.copy_state(),
        build: Some(blockplane_system::build::current().to_string()),
    }))
}

fn handle(cx: &Ctx, req: Request) -> Answer {
    match act(cx, req) {
        Ok(Some(answer)) => answer,
        Ok(None) => status(cx),
        Err(e) => refusal(e),
    }
}

/// Carries out `req`: its own answer, or `None` for the status after it.
fn act(cx: &Ctx, req: Request) -> Result<Option<Answer>, Refusal> {
    let s = &cx.shared;
    let held = |held: Duration| Answer::Snapshot {
        held_us: u64::try_from(held.as_micros()).unwrap_or(u64::MAX),
    };
    match req {
        // Answered by the connection itself (`protocol::serve_connection`).
        Request::Hello(_) => Ok(Some(error(ErrorCode::BadRequest, "a hello out of place"))),
        Request::Status {} => Ok(None),
        Request::Stats {} => Ok(Some(Answer::Stats(Box::new(s.stats())))),
        Request::SetDispatch {
            dispatch,
            reason,
            why,
        } => {
            let reason = Reason::carried(why, &reason);
            s.switch(dispatch, reason)?;
            // A deliberate switch ends a drift episode.
            s.state.lock().expect("state poisoned").degraded = None;
            write_state(cx);
            Ok(None)
        }
        Request::SetReadOnly { read_only } => {
            // The service's rule, guarded here: the image is open read-only.
            if !read_only && s.spec.read_only {
                return Ok(Some(error(
                    ErrorCode::Refused,
                    "invariant: a worker started read-only never takes writes (the service refuses this first)",
                )));
            }
            s.reconfigure(|c| c.read_only = read_only).map(|()| None)
        }
        Request::SetQos { qos } => {
            let limiter = super::qos::Limiter::for_limits(qos, usize::from(s.spec.queues))
                .map_err(|source| Refusal::Io {
                    op: "start the QoS thread",
                    source,
                })?;
            s.reconfigure(|c| c.qos = limiter).map(|()| None)
        }
        Request::Resize {
            size_bytes,
            allocation,
        } => resize(cx, size_bytes, allocation).map(|()| None),
        Request::Allocate { pace_ms } => s
            .start_allocate(Duration::from_millis(pace_ms))
            .map(|()| None),
        Request::CancelAllocate {} => {
            s.cancel_allocate();
            Ok(None)
        }
        Request::Snapshot { dest, dev, ino } => {
            snapshot_into(s, &dest, (dev, ino)).map(|h| Some(held(h)))
        }
        Request::CopyMoment {
            dest,
            dev,
            ino,
            pace_ms,
            gate,
        } => open_dest(&dest, (dev, ino))
            .and_then(|f| s.start_copy(f, Duration::from_millis(pace_ms), gate))
            .map(|h| Some(held(h))),
        Request::CancelCopy {} => {
            s.cancel_copy();
            Ok(None)
        }
        Request::Handover { pace_ms } => hand_over(cx, pace_ms).map(Some),
        Request::Shutdown {} => {
            cx.shutdown.store(true, Relaxed);
            Ok(match cx.ctrl.kill_dev() {
                Ok(_) => None,
                Err(e) => Some(error(ErrorCode::IoError, format!("STOP_DEV: {e}"))),
            })
        }
    }
}

/// Lets the device go for a successor, saying how to the thread that ends
/// this worker.
fn hand_over(cx: &Ctx, pace_ms: u64) -> Result<Answer, Refusal> {
    cx.handover.pace_ms.store(pace_ms, SeqCst);
    cx.handover.asked.store(true, SeqCst);
    let done = cx.shared.hand_over(&cx.ctrl, cx.dev_flags);
    let outcome = match done {
        Ok(HandoverMethod::Quiesce) => QUIESCED,
        Ok(_) => DRAINED,
        Err(_) => REFUSED,
    };
    cx.handover.outcome.store(outcome, SeqCst);
    let method = done?;
    tracing::info!(
        dev_id = cx.dev_id,
        method = method.as_str(),
        "device let go for a successor"
    );
    Ok(Answer::HandedOver { method })
}

/// Opens the snapshot's file (never through a symlink) and checks it is the
/// empty file the control plane made, then snapshots into it.
fn snapshot_into(
    s: &Shared,
    dest: &std::path::Path,
    identity: (u64, u64),
) -> Result<Duration, Refusal> {
    s.snapshot(&open_dest(dest, identity)?)
}

/// Opens a snapshot's file for writing (never through a symlink) and checks
/// it is the empty file `identity` the control plane made.
fn open_dest(dest: &std::path::Path, identity: (u64, u64)) -> Result<std::fs::File, Refusal> {
    use rustix::fs::{Mode, OFlags};
    let file = rustix::fs::open(
        dest,
        OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| Refusal::Io {
        op: "open the snapshot's file",
        source: e.into(),
    })?;
    let st = rustix::fs::fstat(&file).map_err(|e| Refusal::Io {
        op: "fstat the snapshot's file",
        source: e.into(),
    })?;
    if (st.st_dev, st.st_ino) != identity || st.st_size != 0 {
        return Err(Refusal::Rule(format!(
            "{} is not the empty file the control plane made for the snapshot",
            dest.display()
        )));
    }
    Ok(std::fs::File::from(file))
}

/// Grows the image and the device. For a direct volume the pin is lifted,
/// the file grown, re-mapped and pinned again while the queues are held.
fn resize(cx: &Ctx, size: u64, allocation: Allocation) -> Result<(), Refusal> {
    let s = &cx.shared;
    if s.spec.read_only {
        return Err(Refusal::Rule(
            "a read-only volume's worker cannot grow its image".into(),
        ));
    }
    let was = s.policy();
    let reason = s
        .state
        .lock()
        .expect("state poisoned")
        .dispatch_reason
        .clone();
    if was == DataPath::Direct {
        s.switch(DataPath::Nowait, reason.clone())?;
    }
    let grown = blockplane_system::image::grow_fd(
        &s.image
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| Refusal::Io { op: "dup", source })?,
        size,
        match allocation {
            Allocation::Sparse => blockplane_api::model::Allocation::Sparse,
            Allocation::Full => blockplane_api::model::Allocation::Full,
        },
    )
    .map_err(|(op, source)| Refusal::Io { op, source });
    if grown.is_ok() {
        s.state.lock().expect("state poisoned").size_bytes = size;
    }
    if was == DataPath::Direct {
        s.switch(DataPath::Direct, reason)?;
        write_state(cx);
    }
    grown?;
    if cx.dev_flags & u64::from(sys::UBLK_F_UPDATE_SIZE) != 0 {
        cx.ctrl.update_size(size).map_err(|e| Refusal::Io {
            op: "UPDATE_SIZE",
            source: std::io::Error::other(e.to_string()),
        })?;
    } else {
        cx.resize_pending.store(true, Relaxed);
    }
    Ok(())
}
