//! What a worker's control thread and its queue threads share ([`Shared`]),
//! and the control thread's changes to it, one file per job:
//! - [`paths`]: switching the data path live, entering and leaving `direct`,
//!   and the drift checks that may force it off;
//! - [`fill`]: making the image `full` while it serves;
//! - [`snapshot`]: one moment of the volume's I/O, shared or copied;
//! - [`handover`]: letting the device go to a successor.
//!
//! Each change holds every queue with no request inside (or sends them a
//! new config) through [`Shared::reconfigure`] and
//! [`Shared::with_queues_held`], the one way a change reaches the queues.

mod fill;
mod handover;
mod paths;
mod snapshot;

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use blockplane_protocol::{self as protocol, Allocation, Fill, Reason, StateFile, WorkerSpec};
use blockplane_system::extent::{self, Pin};

use crate::mailbox::{self, QueueConfig, Queues};
use crate::qos;
use crate::refusal::Refusal;
use crate::stats::Stats;
use crate::watch;
use blockplane_protocol::DataPath;

/// What changes under the control thread, besides the policy.
#[derive(Debug, Clone)]
pub(crate) struct WorkerState {
    pub dispatch_reason: Reason,
    pub pinned: Option<Pin>,
    pub degraded: Option<String>,
    pub size_bytes: u64,
}

/// What the control thread and the queue threads share. Queue threads read
/// the spec, the stats mapping and the data fd; the rest is the control
/// thread's, sent to the queues as a [`QueueConfig`] (which, while a
/// snapshot's copy runs, holds its [`Moment`](crate::moment::Moment), whose chunk states
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
    /// The queues and what they serve with.
    queues: QueueControl,
    pub state: Mutex<WorkerState>,
    /// The jobs that run beside the data path.
    jobs: Jobs,
    /// This, for the threads it starts.
    me: Weak<Shared>,
    /// The device's id, once the state file first names it.
    dev_id: OnceLock<u32>,
    /// Opens of the image by other processes, watched from the first time
    /// the volume is `direct` (`None`: the kernel gives no such watch).
    watch: OnceLock<Option<watch::Watch>>,
}

/// The queues' side of the shared state: their mailboxes, the config in
/// force on them, and the lock that makes changes to it one at a time.
struct QueueControl {
    /// The config in force on every queue (the control thread's copy).
    config: Mutex<QueueConfig>,
    /// One change at a time (the control socket and the drift checks).
    changing: Mutex<()>,
    /// The queues' mailboxes, once the device has its queues.
    mailboxes: OnceLock<Queues>,
}

/// A worker's jobs beside the data path: a fill and a copy of one moment.
#[derive(Default)]
struct Jobs {
    /// The last fill of [`Shared::start_allocate`].
    fill: Mutex<Option<Fill>>,
    /// Set to stop a running fill.
    fill_cancel: AtomicBool,
    /// The last copy of one moment ([`Shared::start_copy`]).
    copy: Mutex<Option<Fill>>,
}

/// What a worker opened before it serves: the pieces [`Shared::new`] puts
/// together.
pub(crate) struct Opened {
    /// The image as handed over.
    pub image: File,
    /// The image for the data path.
    pub data: File,
    /// `/dev/zero`.
    pub zero: File,
    /// The counters' mapping.
    pub stats: Stats,
    /// The QoS limiter of the spec's limits (none: unlimited).
    pub limiter: Option<Arc<qos::Limiter>>,
}

impl Shared {
    /// The shared state of a worker about to serve `spec`, on the file path
    /// until [`Shared::begin`] enters the spec's.
    pub fn new(spec: WorkerSpec, opened: Opened) -> Arc<Self> {
        let Opened {
            image,
            data,
            zero,
            stats,
            limiter,
        } = opened;
        Arc::new_cyclic(|me| Shared {
            queues: QueueControl {
                config: Mutex::new(QueueConfig {
                    policy: DataPath::Nowait,
                    direct: None,
                    read_only: spec.read_only || spec.refuse_writes,
                    qos: limiter,
                    keep_allocated: spec.allocation == Allocation::Full,
                    moment: None,
                }),
                changing: Mutex::new(()),
                mailboxes: OnceLock::new(),
            },
            state: Mutex::new(WorkerState {
                dispatch_reason: spec.reason(),
                pinned: spec.pinned,
                degraded: None,
                size_bytes: spec.size_bytes,
            }),
            jobs: Jobs::default(),
            me: me.clone(),
            dev_id: OnceLock::new(),
            watch: OnceLock::new(),
            stats,
            image,
            data,
            zero,
            spec,
        })
    }

    /// Takes the device's queues' mailboxes, once; `false` if it had them.
    pub fn adopt_queues(&self, queues: Queues) -> bool {
        self.queues.mailboxes.set(queues).is_ok()
    }

    /// Writes `state.json` atomically: this worker serves (or has just
    /// added) device `dev_id`, which it notes for the drift checks' rewrites.
    pub fn write_state_file(&self, dev_id: u32) {
        let _ = self.dev_id.set(dev_id);
        let (pinned, degraded) = {
            let st = self.state.lock().expect("state poisoned");
            (st.pinned, st.degraded.clone())
        };
        let state = StateFile {
            pid: std::process::id(),
            dev_id,
            pinned,
            degraded,
        };
        if let Err(e) = state.write(&self.spec.run_dir) {
            tracing::error!(error = %e, "cannot write state.json");
        }
    }

    pub(super) fn config(&self) -> MutexGuard<'_, QueueConfig> {
        self.queues.config.lock().expect("config poisoned")
    }

    /// The policy in force.
    pub fn policy(&self) -> DataPath {
        self.config().policy
    }

    /// Whether writes are refused now.
    pub fn read_only(&self) -> bool {
        self.config().read_only
    }

    pub(super) fn queues(&self) -> &[Arc<mailbox::Mailbox>] {
        self.queues
            .mailboxes
            .get()
            .map(|q| q.0.as_slice())
            .unwrap_or_default()
    }

    pub(super) fn ask_queues(&self) -> Queues {
        Queues(self.queues().to_vec())
    }

    /// Changes what the queues serve with (read-only, QoS) and waits until
    /// every queue has it.
    pub fn reconfigure(&self, change: impl FnOnce(&mut QueueConfig)) -> Result<(), Refusal> {
        let _one = self.queues.changing.lock().expect("changing poisoned");
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
    pub(super) fn with_queues_held<T>(
        &self,
        f: impl FnOnce() -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let _one = self.queues.changing.lock().expect("changing poisoned");
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

    /// Counters merged with every queue's report.
    pub fn stats(&self) -> protocol::WorkerStats {
        self.stats.snapshot(&self.ask_queues().reports())
    }

    /// The watch on opens of the image, started the first time it is asked for.
    pub(super) fn watch(&self) -> Option<&watch::Watch> {
        self.watch
            .get_or_init(|| {
                let me = self.me.upgrade()?;
                watch::Watch::start(move |pid| me.image_opened(pid))
            })
            .as_ref()
    }

    /// Another process is opening the image (the watch asks, before the open
    /// goes on). On `direct`, with the pin cleared, its extents may move from
    /// now on: the volume leaves the map first.
    pub fn image_opened(&self, pid: i32) {
        let unpinned = || !extent::is_immutable(self.image.as_fd()).unwrap_or(false);
        if self.policy() != DataPath::Direct || !unpinned() {
            return;
        }
        let reason = Reason::PinCleared {
            by: Some(watch::describe(pid)),
        };
        self.leave_map(reason, unpinned);
    }
}
