//! The data plane: a worker process (`blockplane worker`, started by the
//! control plane) that serves one volume's ublk device. It never touches
//! SQLite: it gets its image as an open fd and its spec on the command line,
//! and answers on a control socket in its run dir.
//!
//! Each queue thread owns what its requests touch; the control thread
//! changes it by message (`mailbox`). Policies switch live: the control
//! thread holds every queue, waits for the requests inside to finish, changes
//! what must change (the image's pin and map when entering or leaving
//! `direct`), and sends each queue its new config, which lets the held
//! requests continue on the new path.

mod control;
mod device;
mod io;
mod mailbox;
mod moment;
mod qos;
mod stats;
mod watch;

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use blockplane_protocol::{self as protocol, Allocation, DataPath, HandoverMethod};
use blockplane_system::extent::{self, ExtentMap, Pin};
use libublk::ctrl::UblkCtrl;
use libublk::sys;
use mailbox::{QueueConfig, Queues};
use protocol::{Fill, FillState, IMAGE_FD, LOCK_FD, WorkerSpec};
use stats::Stats;

// Bytes zeroed at a time by a fill, the queues held meanwhile.
use blockplane_system::image::ALLOCATE_STEP;

/// The data path in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Policy {
    Nowait = 0,
    Threaded = 1,
    Direct = 2,
}

impl Policy {
    /// The policy for a requested data path.
    pub fn from_requested(d: DataPath) -> Self {
        match d {
            DataPath::Nowait => Policy::Nowait,
            DataPath::Threaded => Policy::Threaded,
            DataPath::Direct => Policy::Direct,
        }
    }

    /// In the API's terms.
    pub fn active(self) -> DataPath {
        match self {
            Policy::Nowait => DataPath::Nowait,
            Policy::Threaded => DataPath::Threaded,
            Policy::Direct => DataPath::Direct,
        }
    }
}

/// The direct path: the image's map and its raw devices, opened O_DIRECT.
pub(crate) struct DirectPath {
    pub map: ExtentMap,
    pub devices: Vec<File>,
}

/// What changes under the control thread, besides the policy.
#[derive(Debug, Clone)]
pub(crate) struct WorkerState {
    pub dispatch_reason: String,
    pub pinned: Option<Pin>,
    pub degraded: Option<String>,
    pub size_bytes: u64,
}

/// Why a worker refused a change.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error(transparent)]
    Map(#[from] extent::MapError),
    #[error("{0}")]
    Rule(String),
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl Refusal {
    /// Its code on the control socket.
    pub fn code(&self) -> protocol::ErrorCode {
        match self {
            Refusal::Map(extent::MapError::Io { .. }) | Refusal::Io { .. } => {
                protocol::ErrorCode::IoError
            }
            Refusal::Map(_) | Refusal::Rule(_) => protocol::ErrorCode::Refused,
        }
    }
}

/// What the control thread and the queue threads share. Queue threads read
/// the spec, the stats mapping and the data fd; the rest is the control
/// thread's, sent to the queues as a [`QueueConfig`] (which, while a
/// snapshot's copy runs, holds its [`moment::Moment`], whose chunk states
/// the queues and the copy's thread share).
pub(crate) struct Shared {
    pub spec: WorkerSpec,
    pub stats: Stats,
    /// The image as handed over (ioctls, FIEMAP, flags).
    pub image: File,
    /// The image reopened for the data path (O_DIRECT where the filesystem allows).
    pub data: File,
    /// `/dev/zero`: fills a zero-copy read past the image's end.
    pub zero: File,
    /// The config in force on every queue (the control thread's copy).
    config: Mutex<QueueConfig>,
    /// One change at a time (the control socket and the drift checks).
    changing: Mutex<()>,
    /// The queues' mailboxes, once the device has its queues.
    queues: OnceLock<Queues>,
    pub state: Mutex<WorkerState>,
    /// The last fill of [`Shared::start_allocate`].
    fill: Mutex<Option<Fill>>,
    /// Set to stop a running fill.
    fill_cancel: AtomicBool,
    /// The last copy of one moment ([`Shared::start_copy`]).
    copy: Mutex<Option<Fill>>,
    /// This, for the threads it starts.
    me: Weak<Shared>,
    /// The device's id, once the state file first names it.
    dev_id: OnceLock<u32>,
    /// Opens of the image by other processes, watched from the first time
    /// the volume is `direct` (`None`: the kernel gives no such watch).
    watch: OnceLock<Option<watch::Watch>>,
}

impl Shared {
    fn config(&self) -> MutexGuard<'_, QueueConfig> {
        self.config.lock().expect("config poisoned")
    }

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.config().policy
    }

    /// Whether writes are refused now.
    pub fn read_only(&self) -> bool {
        self.config().read_only
    }

    fn queues(&self) -> &[Arc<mailbox::Mailbox>] {
        self.queues
            .get()
            .map(|q| q.0.as_slice())
            .unwrap_or_default()
    }

    fn ask_queues(&self) -> Queues {
        Queues(self.queues().to_vec())
    }

    /// Changes what the queues serve with (read-only, QoS) and waits until
    /// every queue has it.
    pub fn reconfigure(&self, change: impl FnOnce(&mut QueueConfig)) -> Result<(), Refusal> {
        let _one = self.changing.lock().expect("changing poisoned");
        let cfg = {
            let mut c = self.config();
            change(&mut c);
            c.clone()
        };
        if self.ask_queues().apply(&cfg) {
            Ok(())
        } else {
            Err(Refusal::Rule(
                "a queue did not take the change within 30 s".into(),
            ))
        }
    }

    /// Runs `f` with every queue held (no request inside), then lets them
    /// go on with the config in force.
    fn with_queues_held<T>(&self, f: impl FnOnce() -> Result<T, Refusal>) -> Result<T, Refusal> {
        let _one = self.changing.lock().expect("changing poisoned");
        let queues = self.ask_queues();
        let out = if queues.hold(Duration::from_secs(30)) {
            f()
        } else {
            Err(Refusal::Rule("requests did not finish within 30 s".into()))
        };
        let cfg = self.config().clone();
        if !queues.apply(&cfg) {
            tracing::error!("a queue did not take the config back within 30 s");
        }
        out
    }

    /// Lets go of the device for a successor ([`protocol::Request::Handover`]),
    /// for good: no change runs after it (the change lock is never given
    /// back) and the worker is to exit. With `UBLK_F_QUIESCE` the kernel lets
    /// the requests inside finish, keeps new ones queued and ends the queues;
    /// without it every queue is held until no request is inside the data
    /// path, and the requests it holds are requeued by the kernel when the
    /// worker exits (which needs `USER_RECOVERY_REISSUE`: without it they
    /// would fail). A refusal leaves the worker serving.
    pub fn hand_over(&self, ctrl: &UblkCtrl, dev_flags: u64) -> Result<HandoverMethod, Refusal> {
        let one = self.changing.lock().expect("changing poisoned");
        if self
            .fill_state()
            .is_some_and(|f| f.state == FillState::Running)
        {
            return Err(Refusal::Rule(
                "an allocate runs in this worker: a handover waits for its end (or its cancel)"
                    .into(),
            ));
        }
        if self.copy_running() {
            return Err(Refusal::Rule(protocol::COPY_RUNS_HANDOVER.into()));
        }
        if dev_flags & u64::from(sys::UBLK_F_QUIESCE) != 0 {
            match ctrl.quiesce_dev(30_000) {
                Ok(_) => {
                    std::mem::forget(one);
                    return Ok(HandoverMethod::Quiesce);
                }
                // The device now refuses new requests (they wait queued):
                // drain and go, so that a successor takes them.
                Err(e) => tracing::error!(error = %e, "QUIESCE_DEV failed; draining instead"),
            }
        } else if dev_flags & u64::from(sys::UBLK_F_USER_RECOVERY_REISSUE) == 0 {
            return Err(Refusal::Rule(
                "the device was created without USER_RECOVERY_REISSUE: the requests its worker holds when it exits would fail; detach and attach the volume instead".into(),
            ));
        }
        let queues = self.ask_queues();
        if !queues.hold(Duration::from_secs(30)) {
            let cfg = self.config().clone();
            if !queues.apply(&cfg) {
                tracing::error!("a queue did not take the config back within 30 s");
            }
            return Err(Refusal::Rule(
                "requests did not finish within 30 s; the worker keeps serving".into(),
            ));
        }
        std::mem::forget(one);
        Ok(HandoverMethod::Drain)
    }

    /// Shares the image's extents with `dest` at one moment of the volume's
    /// I/O ([`protocol::Request::Snapshot`]); returns how long the queues
    /// were held. Refused on `direct`, whose map must own its extents alone.
    pub fn snapshot(&self, dest: &File) -> Result<Duration, Refusal> {
        // Most dirty data reaches the disk before the hold, so the FICLONE
        // inside it (which writes back what is still dirty) has little left.
        self.data.sync_data().map_err(|source| Refusal::Io {
            op: "fdatasync the image",
            source,
        })?;
        let held = Instant::now();
        self.with_queues_held(|| {
            if self.config().policy == Policy::Direct {
                return Err(Refusal::Rule(protocol::SNAPSHOT_OF_DIRECT.into()));
            }
            rustix::fs::ioctl_ficlone(dest, &self.image).map_err(|e| {
                if blockplane_system::image::cannot_share(e) {
                    Refusal::Rule(format!(
                        "the image's filesystem cannot share its extents with a snapshot (FICLONE: {e})"
                    ))
                } else {
                    Refusal::Io {
                        op: "FICLONE",
                        source: e.into(),
                    }
                }
            })
        })?;
        Ok(held.elapsed())
    }

    /// Begins a copy of one moment of the volume into `dest` where the
    /// filesystem cannot share extents ([`protocol::Request::CopyMoment`]):
    /// the queues are held once, with no request inside, while writes start
    /// keeping their chunks' old bytes (see [`moment`]); a thread of its own
    /// copies the rest, its progress in [`Self::copy_state`]. Returns how
    /// long the queues were held.
    pub fn start_copy(
        self: &Arc<Self>,
        dest: File,
        pace: Duration,
        gate: Option<std::path::PathBuf>,
    ) -> Result<Duration, Refusal> {
        if self.copy_running() {
            return Err(Refusal::Rule(
                "a copy of one moment already runs in this worker: one at a time".into(),
            ));
        }
        // A fill writes zeros without keeping chunks.
        if self
            .fill_state()
            .is_some_and(|f| f.state == FillState::Running)
        {
            return Err(Refusal::Rule(
                "an allocate runs in this worker: a copy of one moment waits for its end".into(),
            ));
        }
        let io = |op| move |source| Refusal::Io { op, source };
        let size = self.state.lock().expect("state poisoned").size_bytes;
        dest.set_len(size).map_err(io("size the moment's file"))?;
        let src = self.data.try_clone().map_err(io("dup"))?;
        let moment = Arc::new(moment::Moment::new(src, dest, size));
        let held = Instant::now();
        self.with_queues_held(|| {
            if self.config().policy == Policy::Direct {
                return Err(Refusal::Rule(protocol::SNAPSHOT_OF_DIRECT.into()));
            }
            self.config().moment = Some(moment.clone());
            Ok(())
        })?;
        let held = held.elapsed();
        *self.copy.lock().expect("copy poisoned") = Some(Fill {
            state: FillState::Running,
            done_bytes: 0,
            total_bytes: size,
            error: None,
        });
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("moment-copy".into())
            .spawn(move || {
                // As the queue threads: it writes while the device it serves
                // may be what writeback waits on.
                if let Err(e) = rustix::process::configure_io_flusher_behavior(true) {
                    tracing::warn!(error = %e, "PR_SET_IO_FLUSHER refused for the copy's thread");
                }
                let out = moment.run(pace, gate.as_ref(), |done| {
                    if let Some(c) = me.copy.lock().expect("copy poisoned").as_mut() {
                        c.done_bytes = done;
                    }
                });
                me.end_copy(out);
            });
        if let Err(source) = spawned {
            self.end_copy(Err(format!("start the copy's thread: {source}")));
            return Err(io("start the copy's thread")(source));
        }
        Ok(held)
    }

    /// Whether a copy of one moment runs.
    fn copy_running(&self) -> bool {
        self.copy_state()
            .is_some_and(|c| c.state == FillState::Running)
    }

    /// Asks a running copy to stop; writes stop keeping chunks at once.
    pub fn cancel_copy(&self) {
        if let Some(m) = &self.config().moment {
            m.cancel();
        }
    }

    /// The last copy of one moment: running, or how it ended.
    pub fn copy_state(&self) -> Option<Fill> {
        self.copy.lock().expect("copy poisoned").clone()
    }

    /// Takes the moment off the queues, then records how its copy ended.
    fn end_copy(&self, out: Result<bool, String>) {
        if let Err(e) = self.reconfigure(|c| c.moment = None) {
            tracing::error!(error = %e, "the queues kept a finished moment");
        }
        let (state, error) = match out {
            Ok(true) => (FillState::Done, None),
            Ok(false) => (FillState::Cancelled, None),
            Err(e) => (FillState::Failed, Some(e)),
        };
        tracing::info!(?state, ?error, "copy of one moment ended");
        if let Some(c) = self.copy.lock().expect("copy poisoned").as_mut() {
            c.state = state;
            c.error = error;
        }
    }

    /// Starts making the image `full`: the file paths stop punching it, then
    /// a thread of its own writes zeros over its holes and unwritten extents
    /// (see [`Self::fill`]), so the control socket keeps answering meanwhile.
    /// A fill already running goes on; its progress is in [`Self::fill_state`].
    pub fn start_allocate(self: &Arc<Self>, pace: Duration) -> Result<(), Refusal> {
        if self.spec.read_only {
            return Err(Refusal::Rule(protocol::CANNOT_FILL_READ_ONLY.into()));
        }
        if self
            .fill_state()
            .is_some_and(|f| f.state == FillState::Running)
        {
            return Ok(());
        }
        if self.copy_running() {
            return Err(Refusal::Rule(
                "a snapshot's copy of one moment runs in this worker: an allocate waits for its end"
                    .into(),
            ));
        }
        let size = self.state.lock().expect("state poisoned").size_bytes;
        let todo = extent::unwritten_ranges(self.image.as_fd(), 0, size).map_err(|source| {
            Refusal::Io {
                op: "FS_IOC_FIEMAP",
                source,
            }
        })?;
        let kept = self.config().keep_allocated;
        self.reconfigure(|c| c.keep_allocated = true)?;
        self.fill_cancel.store(false, Relaxed);
        *self.fill.lock().expect("fill poisoned") = Some(Fill {
            state: FillState::Running,
            done_bytes: 0,
            total_bytes: todo.iter().map(|(a, b)| b - a).sum(),
            error: None,
        });
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("allocate".into())
            .spawn(move || {
                let out = me.fill(&todo, pace);
                me.end_fill(out, kept);
            });
        if let Err(source) = spawned {
            let e = Refusal::Io {
                op: "start the allocate thread",
                source,
            };
            self.end_fill(Err(Refusal::Rule(e.to_string())), kept);
            return Err(e);
        }
        Ok(())
    }

    /// Asks a running fill to stop after its current stretch.
    pub fn cancel_allocate(&self) {
        self.fill_cancel.store(true, Relaxed);
    }

    /// The last fill: running, or how it ended.
    pub fn fill_state(&self) -> Option<Fill> {
        self.fill.lock().expect("fill poisoned").clone()
    }

    /// Writes zeros over `todo`, one stretch of at most [`ALLOCATE_STEP`]
    /// bytes at a time with the queues held, so no write of the volume lands
    /// in a stretch while it is zeroed, pausing `pace` after each (a test
    /// fault). `Ok(false)`: cancelled.
    fn fill(&self, todo: &[(u64, u64)], pace: Duration) -> Result<bool, Refusal> {
        let data = self
            .data
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| Refusal::Io { op: "dup", source })?;
        for &(a, b) in todo {
            let mut at = a;
            while at < b {
                if self.fill_cancel.load(Relaxed) {
                    return Ok(false);
                }
                let to = b.min(at + ALLOCATE_STEP);
                self.with_queues_held(|| {
                    // A direct map exists only over a written image.
                    if self.policy() == Policy::Direct {
                        return Ok(());
                    }
                    blockplane_system::image::allocate_range(&data, at, to).map_err(|source| {
                        Refusal::Io {
                            op: "write zeros",
                            source,
                        }
                    })
                })?;
                if let Some(f) = self.fill.lock().expect("fill poisoned").as_mut() {
                    f.done_bytes += to - at;
                }
                std::thread::sleep(pace);
                at = to;
            }
        }
        self.data.sync_data().map_err(|source| Refusal::Io {
            op: "fdatasync the image",
            source,
        })?;
        Ok(true)
    }

    /// Records how a fill ended. One that did not finish leaves the image as
    /// it was declared: punched again if it was (`kept` false).
    fn end_fill(&self, out: Result<bool, Refusal>, kept: bool) {
        let (state, error) = match out {
            Ok(true) => (FillState::Done, None),
            Ok(false) => (FillState::Cancelled, None),
            Err(e) => (FillState::Failed, Some(e.to_string())),
        };
        if state != FillState::Done
            && !kept
            && let Err(e) = self.reconfigure(|c| c.keep_allocated = false)
        {
            tracing::error!(error = %e, "cannot go back to punching after an unfinished fill");
        }
        tracing::info!(?state, ?error, "allocate ended");
        if let Some(f) = self.fill.lock().expect("fill poisoned").as_mut() {
            f.state = state;
            f.error = error;
        }
    }

    /// Counters merged with every queue's report.
    pub fn stats(&self) -> protocol::WorkerStats {
        self.stats.snapshot(&self.ask_queues().reports())
    }

    /// Rule 3, where this worker's own earlier pin is not the owner's flag.
    fn refuse_rule_3(&self) -> Result<(), Refusal> {
        let pinned_by_us = self
            .state
            .lock()
            .expect("state poisoned")
            .pinned
            .is_some_and(|p| !p.was_immutable);
        if !pinned_by_us {
            blockplane_system::dispatch::rule_3(self.image.as_fd(), self.read_only())?;
        }
        Ok(())
    }

    /// Maps and pins the image and opens its raw devices (entering `direct`).
    /// `decided`: the map the control plane decided `direct` from, checked
    /// under the pin instead of read again before it.
    fn enter_direct(&self, decided: Option<ExtentMap>) -> Result<Arc<DirectPath>, Refusal> {
        let size = self.state.lock().expect("state poisoned").size_bytes;
        let earlier = self.state.lock().expect("state poisoned").pinned;
        let (map, pin) = match earlier {
            // Pinned by an earlier worker of this volume: keep what it knew of
            // the owner's flag, and check the map as it is now.
            Some(p) => {
                let map = ExtentMap::build(self.image.as_fd(), size)?;
                extent::drop_page_cache(self.image.as_fd()).map_err(|source| Refusal::Io {
                    op: "drop page cache",
                    source,
                })?;
                (map, p)
            }
            None => {
                self.refuse_rule_3()?;
                extent::map_and_pin(self.image.as_fd(), size, decided)?
            }
        };
        let devices = match self.open_raw_devices(&map) {
            Ok(d) => d,
            Err(e) => {
                if earlier.is_none() {
                    let _ = extent::unpin(self.image.as_fd(), pin);
                }
                return Err(e);
            }
        };
        self.state.lock().expect("state poisoned").pinned = Some(pin);
        if let Some(w) = self.watch() {
            w.mark(self.image.as_fd(), true);
        }
        Ok(Arc::new(DirectPath { map, devices }))
    }

    /// The watch on opens of the image, started the first time it is asked for.
    fn watch(&self) -> Option<&watch::Watch> {
        self.watch
            .get_or_init(|| self.me.upgrade().and_then(|me| watch::Watch::start(&me)))
            .as_ref()
    }

    /// Another process is opening the image (the watch asks, before the open
    /// goes on). On `direct`, with the pin cleared, its extents may move from
    /// now on: the volume leaves the map first.
    pub fn image_opened(&self, pid: i32) {
        let unpinned = || !extent::is_immutable(self.image.as_fd()).unwrap_or(false);
        if self.policy() != Policy::Direct || !unpinned() {
            return;
        }
        let reason = format!(
            "direct-map rule 5: the image's pin was cleared and {} opened it, so its extents may move; serving on nowait",
            watch::describe(pid)
        );
        self.leave_map(reason, unpinned);
    }

    fn open_raw_devices(&self, map: &ExtentMap) -> Result<Vec<File>, Refusal> {
        // Read-only may be switched off again live: a volume created writable
        // opens its raw devices writable.
        let write = !self.spec.read_only;
        map.devices
            .iter()
            .map(|d| {
                // Not O_EXCL: the filesystem on it is mounted (rule 7).
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(write)
                    .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
                    .open(&d.node)
                    .map_err(|e| match e.raw_os_error() {
                        Some(libc::EBUSY) | Some(libc::EPERM) if write => Refusal::Rule(format!(
                            "direct-map rule 7: the kernel refuses writes to {} while its filesystem is mounted (bdev_allow_write_mounted=0?): {e}",
                            d.node.display()
                        )),
                        _ => Refusal::Io {
                            op: "open the raw device",
                            source: e,
                        },
                    })
            })
            .collect()
    }

    /// Leaves `direct`: flushes the raw devices, unpins, and drops the page
    /// cache again so the file path reads what the raw device holds.
    fn leave_direct(&self) -> Result<(), Refusal> {
        let direct = self.config().direct.clone();
        if let Some(d) = direct {
            for dev in &d.devices {
                dev.sync_all().map_err(|source| Refusal::Io {
                    op: "flush the raw device",
                    source,
                })?;
            }
        }
        let pin = self.state.lock().expect("state poisoned").pinned.take();
        if let Some(p) = pin {
            extent::unpin(self.image.as_fd(), p).map_err(|source| Refusal::Io {
                op: "clear FS_IMMUTABLE_FL",
                source,
            })?;
        }
        if let Some(Some(w)) = self.watch.get() {
            w.mark(self.image.as_fd(), false);
        }
        extent::drop_page_cache(self.image.as_fd()).map_err(|source| Refusal::Io {
            op: "drop page cache",
            source,
        })
    }

    /// Switches the policy while I/O runs: holds every queue until the
    /// requests inside finish, changes the path, and sends each queue the new
    /// config, on which the held requests continue.
    pub fn switch(&self, to: Policy, reason: String) -> Result<(), Refusal> {
        let _one = self.changing.lock().expect("changing poisoned");
        self.switch_held(to, reason)
    }

    /// [`Self::switch`], its caller holding `changing`.
    fn switch_held(&self, to: Policy, reason: String) -> Result<(), Refusal> {
        let from = self.policy();
        if from == to {
            self.state.lock().expect("state poisoned").dispatch_reason = reason;
            return Ok(());
        }
        if to == Policy::Direct {
            if self.config().moment.is_some() {
                return Err(Refusal::Rule(protocol::COPY_RUNS_DIRECT.into()));
            }
            // Refuse early, before holding any I/O.
            self.refuse_rule_3()?;
        }
        let queues = self.ask_queues();
        let outcome = if !queues.hold(Duration::from_secs(30)) {
            Err(Refusal::Rule(
                "requests did not finish within 30 s; policy unchanged".into(),
            ))
        } else {
            self.change_path(from, to)
        };
        let cfg = {
            let mut c = self.config();
            if let Ok(direct) = &outcome {
                c.policy = to;
                c.direct = direct.clone();
            }
            c.clone()
        };
        if outcome.is_ok() {
            self.state.lock().expect("state poisoned").dispatch_reason = reason;
        }
        if !queues.apply(&cfg) {
            tracing::error!("a queue did not take the new config within 30 s");
        }
        outcome.map(|_| ())
    }

    /// The direct path to serve with after the change.
    fn change_path(&self, from: Policy, to: Policy) -> Result<Option<Arc<DirectPath>>, Refusal> {
        match (from, to) {
            (_, Policy::Direct) => {
                // Written data reaches the disk before the map is read.
                self.data.sync_data().map_err(|source| Refusal::Io {
                    op: "fdatasync the image",
                    source,
                })?;
                self.enter_direct(None).map(Some)
            }
            (Policy::Direct, _) => self.leave_direct().map(|()| None),
            _ => Ok(None),
        }
    }

    /// The direct path in force, if any.
    fn direct_path(&self) -> Option<Arc<DirectPath>> {
        self.config().direct.clone()
    }

    /// Rule 5: re-reads the map of a `direct` volume; on drift (or a pin
    /// cleared), leaves the direct path at once for `nowait` and records why.
    pub fn check_drift(&self) {
        let Some(current) = self.direct_path() else {
            return;
        };
        let size = current.map.size;
        let now = ExtentMap::build(self.image.as_fd(), size);
        let drift = match now {
            Ok(m) => current.map.differences(&m),
            Err(e) => Some(e.to_string()),
        };
        let reason = match drift {
            Some(what) => format!(
                "direct-map rule 5: the image's extents changed ({what}); serving on nowait"
            ),
            None if !extent::is_immutable(self.image.as_fd()).unwrap_or(true) => {
                "direct-map rule 5: the image's pin (FS_IMMUTABLE_FL) was cleared, so its extents may move; serving on nowait".into()
            }
            None => return,
        };
        self.leave_map(reason, || true);
    }

    /// Leaves the direct path for `nowait` at once, recording `reason`,
    /// unless a switch got there first or `still` no longer holds.
    fn leave_map(&self, reason: String, still: impl Fn() -> bool) {
        let _one = self.changing.lock().expect("changing poisoned");
        if self.policy() != Policy::Direct || !still() {
            return;
        }
        tracing::error!(%reason, "the direct map cannot be trusted: leaving the direct path");
        self.state.lock().expect("state poisoned").degraded = Some(reason.clone());
        if let Err(e) = self.switch_held(Policy::Nowait, reason) {
            tracing::error!(error = %e, "could not leave the direct path");
        }
        // The service learns of it from the state file.
        if let Some(dev_id) = self.dev_id.get() {
            control::write_state_file(self, *dev_id);
        }
    }
}

/// The image for the data path: the same open file, with O_DIRECT where the
/// filesystem takes it. Not a fresh open: a pinned (immutable) image cannot be
/// opened for writing, and a recovering worker finds it pinned.
fn data_fd(image: &File) -> std::io::Result<File> {
    let data = image.try_clone()?;
    let flags = rustix::fs::fcntl_getfl(&data)?;
    if let Err(e) = rustix::fs::fcntl_setfl(&data, flags | rustix::fs::OFlags::DIRECT) {
        tracing::warn!(error = %e, "the image's filesystem refuses O_DIRECT; buffered I/O");
    }
    Ok(data)
}

/// `blockplane worker --spec JSON`: serves until told to stop (exit 0) or
/// until the device is taken away (exit 1).
pub fn main(spec_json: &str) -> ExitCode {
    let spec: WorkerSpec = match serde_json::from_str(spec_json) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("blockplane worker: bad spec: {e}");
            return ExitCode::from(2);
        }
    };
    init_logging(&spec);
    tracing::info!(
        volume_id = %spec.volume_id,
        recover_dev_id = spec.recover_dev_id,
        handover = spec.handover,
        "worker starting"
    );
    match run(spec) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = %e, "worker failed");
            eprintln!("blockplane worker: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A handover's new worker, started: says so on [`protocol::GO_FD`] and
/// waits until the old worker has let go. `false`: called off.
fn await_go() -> std::io::Result<bool> {
    use std::io::{Read, Write};
    // SAFETY: the control plane passes a handover's socket on GO_FD;
    // nothing else owns it.
    let mut go = unsafe { std::os::unix::net::UnixStream::from_raw_fd(protocol::GO_FD) };
    go.write_all(&[protocol::GO_READY])?;
    let mut word = [0u8; 1];
    Ok(go.read(&mut word)? == 1 && word[0] == protocol::GO_TAKE)
}

fn init_logging(spec: &WorkerSpec) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(spec.run_dir.join("worker.log"));
    let filter = tracing_subscriber::EnvFilter::try_from_env("BLOCKPLANE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false);
    let _ = match log {
        Ok(f) => builder.with_writer(Mutex::new(f)).try_init(),
        Err(_) => builder.with_writer(std::io::stderr).try_init(),
    };
}

fn run(spec: WorkerSpec) -> Result<ExitCode, Box<dyn std::error::Error>> {
    device::private_mount_namespace()?;
    tracing::debug!("start: mount namespace private");
    // SAFETY: the control plane hands the image over on this fd; nothing else owns it.
    let image = unsafe { File::from_raw_fd(IMAGE_FD) };
    // Held until the worker ends: the device serves only while it is held.
    let _lock = if spec.image_lock {
        // SAFETY: as IMAGE_FD, for the image lock.
        let lock = unsafe { OwnedFd::from_raw_fd(LOCK_FD) };
        blockplane_system::image::retake_lock(&lock).map_err(|e| {
            format!(
                "cannot take the lock on image {}: {e}; another process (another blockplane instance?) holds it, so this worker will not serve it",
                spec.image_path
            )
        })?;
        Some(lock)
    } else {
        None
    };
    let data = data_fd(&image)?;
    let stats = Stats::open(
        &spec.run_dir.join(protocol::STATS_FILE),
        spec.queues as usize,
    )?;
    let limiter = qos::Limiter::for_limits(spec.qos, usize::from(spec.queues))?;
    let zero = File::open("/dev/zero")?;
    // A handover is no crash: only a worker that replaces a dead one counts.
    if spec.recover_dev_id.is_some() && !spec.handover {
        stats.count_restart();
    }
    let shared = Arc::new_cyclic(|me| Shared {
        config: Mutex::new(QueueConfig {
            policy: Policy::Nowait,
            direct: None,
            read_only: spec.read_only || spec.refuse_writes,
            qos: limiter,
            keep_allocated: spec.allocation == Allocation::Full,
            moment: None,
        }),
        changing: Mutex::new(()),
        queues: OnceLock::new(),
        state: Mutex::new(WorkerState {
            dispatch_reason: spec.dispatch_reason.clone(),
            pinned: spec.pinned,
            degraded: None,
            size_bytes: spec.size_bytes,
        }),
        fill: Mutex::new(None),
        fill_cancel: AtomicBool::new(false),
        copy: Mutex::new(None),
        me: me.clone(),
        dev_id: OnceLock::new(),
        watch: OnceLock::new(),
        stats,
        image,
        data,
        zero,
        spec,
    });
    if shared.spec.handover && !await_go()? {
        tracing::info!("the handover was called off before this worker took the device; it exits");
        return Ok(ExitCode::SUCCESS);
    }
    let start = Policy::from_requested(shared.spec.dispatch);
    if start == Policy::Direct {
        let decided = match shared.spec.decided_map {
            true => Some(protocol::take_decided_map(&shared.spec.run_dir)?),
            false => None,
        };
        let path = shared.enter_direct(decided)?;
        shared.config().direct = Some(path);
    } else if let Some(p) = shared.spec.pinned {
        // A crashed direct worker's pin, on a volume now asked on the file path.
        extent::unpin(shared.image.as_fd(), p)?;
        shared.state.lock().expect("state poisoned").pinned = None;
    }
    shared.config().policy = start;
    tracing::debug!("start: policy entered");
    device::serve(shared)
}
