//! Backends: how a volume becomes a kernel block device.
//!
//! Each backend is a small, blocking interface (the manager calls it from
//! `spawn_blocking`) over one kernel mechanism. A backend owns nothing in
//! SQLite: what it needs to find its device again is the [`Attachment`] it
//! returns, which the manager stores with the volume.

pub mod dm;
pub mod loopdev;
pub mod ublk;
mod wire;

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use uuid::Uuid;

pub use crate::attachment::{Attachment, DeviceState, DmAttachment, UblkAttachment};
use blockplane_api::model::{
    Allocation, Backend as BackendKind, BackendCapability, DispatchPolicy, HandoverMethod, OpStats,
    Qos, VolumeState, VolumeStats,
};
use blockplane_protocol::{Request, WorkerStats};
pub use blockplane_system::dispatch::Decision;
use blockplane_system::dispatch::{self, DispatchError, Reason};
pub use blockplane_system::image::AllocateJob;

use crate::fault::HandoverFaults;

/// What went wrong in a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("backend {backend} is not available on this host: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("{what} is not supported by backend {backend}: {reason}")]
    Unsupported {
        backend: &'static str,
        what: String,
        reason: String,
    },
    #[error("{field} cannot change live on backend {backend}: {reason}")]
    NotLive {
        backend: &'static str,
        field: &'static str,
        reason: String,
    },
    #[error("{reason}")]
    Refused { reason: String },
    #[error("device {device} is busy: {reason}")]
    Busy { device: String, reason: String },
    #[error("{op} on {device} failed: {source}")]
    Io {
        op: &'static str,
        device: String,
        #[source]
        source: io::Error,
    },
}

impl BackendError {
    /// An I/O failure of `op` on `device`.
    pub fn io(op: &'static str, device: impl Into<String>, source: io::Error) -> Self {
        BackendError::Io {
            op,
            device: device.into(),
            source,
        }
    }
}

impl From<DispatchError> for BackendError {
    fn from(e: DispatchError) -> Self {
        match e {
            DispatchError::Refused(reason) => BackendError::Refused { reason },
            // Only dm's paths off `direct` need a private ublk device.
            DispatchError::NeedsUblk(reason) => BackendError::Unavailable {
                backend: "dm",
                reason,
            },
            // Only dm has paths without a worker.
            DispatchError::LimitNeedsWorker(reason) => BackendError::NotLive {
                backend: "dm",
                field: "dispatch",
                reason,
            },
        }
    }
}

/// How a volume is to be served: its spec, as the backends need it.
#[derive(Debug, Clone)]
pub struct VolumeParams {
    /// Path of the image, for messages only.
    pub image_path: String,
    pub size_bytes: u64,
    /// Created read-only: the image is opened read-only.
    pub read_only: bool,
    /// Writes are refused now: `read_only`, or the switch set live since.
    pub refuse_writes: bool,
    pub dispatch: DispatchPolicy,
    pub queues: u16,
    pub queue_depth: u16,
    pub max_io_bytes: u32,
    pub qos: Option<Qos>,
    /// The image's allocation (`sparse` for a registered file): whether the
    /// file paths may punch it.
    pub allocation: Allocation,
}

/// Everything a backend needs to bring a volume up.
#[derive(Debug)]
pub struct AttachRequest {
    pub volume_id: Uuid,
    /// The image, opened read-write (or read-only for read-only volumes) by the
    /// manager through the image roots; the backend never resolves paths.
    pub image_fd: OwnedFd,
    pub params: VolumeParams,
    /// What [`VolumeBackend::validate`] decided, if it was asked first.
    pub decision: Option<Decision>,
    /// A duplicate of the OFD lock the manager holds on the image (see
    /// `manager::holds`): a backend whose device another process serves (a
    /// ublk worker) hands it to that process, so the lock lasts as long as
    /// the device serves, whether or not this service lives.
    pub image_lock: Option<OwnedFd>,
}

impl AttachRequest {
    /// The decision this attach goes by: the one [`VolumeBackend::validate`]
    /// made (with the map it read), or one made now (a re-attach at
    /// reconciliation comes without one).
    pub fn take_decision(&mut self, path: &dispatch::Path) -> Result<Decision, BackendError> {
        match self.decision.take() {
            Some(d) => Ok(d),
            None => Ok(dispatch::decide(&dispatch::Ask {
                image: self.image_fd.as_fd(),
                size: self.params.size_bytes,
                policy: self.params.dispatch,
                refuse_writes: self.params.refuse_writes,
                path,
            })?),
        }
    }
}

/// What a backend gets to find (and take back under supervision) a volume's
/// device after a restart.
#[derive(Debug)]
pub struct ProbeRequest {
    pub volume_id: Uuid,
    /// `(st_dev, st_ino)` of the image, which the device must still serve.
    pub identity: (u64, u64),
    /// The image, when the manager could open it.
    pub image: Option<OwnedFd>,
    pub params: VolumeParams,
    /// What was recorded of the device.
    pub stored: Option<Attachment>,
    /// The manager's lock on the image, when it could take it (not when the
    /// device's own worker holds it, having outlived the last service).
    pub image_lock: Option<OwnedFd>,
}

/// What reconciliation does with a marked device that has no volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrphanPolicy {
    /// Remove it (it can only be a leftover of a crash mid-delete).
    Remove,
    /// Report it in `/v1/host` and leave it until an explicit DELETE.
    Report,
}

/// Something a backend noticed on its own (a worker died and was replaced, a
/// map drifted), for the manager to record.
#[derive(Debug, Clone)]
pub struct BackendEvent {
    pub volume_id: Uuid,
    pub kind: &'static str,
    pub message: String,
    /// The device as it is now, if it changed.
    pub attachment: Option<Attachment>,
    /// The volume's new state, if it changed.
    pub state: Option<VolumeState>,
}

/// Where backends send their events.
#[derive(Debug, Clone)]
pub struct EventSink(std::sync::mpsc::Sender<BackendEvent>);

impl EventSink {
    /// A sink and the receiver the manager reads.
    pub fn channel() -> (Self, std::sync::mpsc::Receiver<BackendEvent>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (Self(tx), rx)
    }

    /// Sends (dropped if the manager is gone).
    pub fn send(&self, e: BackendEvent) {
        let _ = self.0.send(e);
    }
}

/// What a backend found when asked about a volume's device.
#[derive(Debug)]
pub enum Probe {
    /// The device is there and serves the image.
    Alive(Box<Attachment>),
    /// No device of this volume exists.
    Gone,
}

/// A device that carries a blockplane mark, found by scanning the kernel.
#[derive(Debug, Clone)]
pub struct Marked {
    pub volume_id: Uuid,
    pub device: String,
}

/// A live change asked of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Dispatch(DispatchPolicy),
    Qos(Option<Qos>),
    ReadOnly(bool),
}

impl Change {
    /// The API field this change sets.
    pub fn field(&self) -> &'static str {
        match self {
            Change::Dispatch(_) => "dispatch",
            Change::Qos(_) => "qos",
            Change::ReadOnly(_) => "read_only",
        }
    }
}

/// Where a snapshot of a serving volume's image goes: the empty file the
/// manager made ([`blockplane_system::image::ImageRoots::create_for_moment`]), by path
/// and `(dev, ino)`, which whoever opens it checks.
#[derive(Debug, Clone)]
pub struct SnapshotDest {
    pub path: std::path::PathBuf,
    pub identity: (u64, u64),
}

/// A copy of one moment ([`VolumeBackend::copy_moment`]): where it goes,
/// and the test faults that pace or hold it (`slow_copy`, `gate_copy`;
/// none outside tests).
#[derive(Debug, Clone)]
pub struct MomentCopy {
    pub dest: SnapshotDest,
    /// A pause after each chunk.
    pub pace: std::time::Duration,
    /// The copy waits while this file exists.
    pub gate: Option<std::path::PathBuf>,
}

/// The worker process serving a volume's device (ublk), as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub pid: u32,
    /// Its build (`blockplane_system::build`); `None` for a worker from
    /// before workers said (protocol 1).
    pub build: Option<String>,
    /// Why a crash of it would not be recovered now (`None`: it would).
    pub unsupervised: Option<Unsupervised>,
}

/// Why the ublk worker supervisor stopped, or could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// Its thread could not be started.
    StartFailed(String),
    /// It failed (its epoll set, or its wait).
    Failed(String),
    /// It panicked.
    Panicked(String),
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stopped::StartFailed(e) => write!(f, "its thread could not start: {e}"),
            Stopped::Failed(e) => write!(f, "it failed: {e}"),
            Stopped::Panicked(e) => write!(f, "it panicked: {e}"),
        }
    }
}

/// Whether the supervisor of ublk workers runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SupervisorState {
    /// Not started yet (the service is starting).
    Starting { since: std::time::SystemTime },
    /// It watches every worker.
    Running { since: std::time::SystemTime },
    /// It stopped or could not start, and is tried again.
    Restarting {
        since: std::time::SystemTime,
        reason: Stopped,
    },
}

/// The supervisor's state for `GET /v1/host` and `/metrics`.
#[derive(Debug, Clone)]
pub struct SupervisorStatus {
    pub state: SupervisorState,
    /// Times it stopped or failed to start since the service started.
    pub restarts: u64,
    /// Workers it does not watch now, the supervisor running.
    pub unsupervised: u64,
}

/// Why one worker is not supervised: a crash of it would not be recovered
/// now. Each is tried again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsupervised {
    /// The supervisor itself does not run.
    SupervisorDown(Stopped),
    /// Its pidfd could not be opened or watched, for a reason that says
    /// nothing of the process (EMFILE, ENFILE, ENOMEM...).
    CannotWatch { pid: u32, error: String },
    /// It died, and the thread that recovers it could not start: its I/O
    /// waits.
    RecoveryNotStarted { pid: u32, error: String },
}

impl std::fmt::Display for Unsupervised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsupervised::SupervisorDown(why) => write!(
                f,
                "the worker supervisor does not run ({why}); it is restarted, and a crash of the worker meanwhile is recovered only once it runs"
            ),
            Unsupervised::CannotWatch { pid, error } => write!(
                f,
                "worker {pid} cannot be watched ({error}); it serves on, and is watched again soon"
            ),
            Unsupervised::RecoveryNotStarted { pid, error } => write!(
                f,
                "worker {pid} died and its recovery could not start ({error}); its I/O waits, and the recovery is started again soon"
            ),
        }
    }
}

/// A volume's device handed over to a new worker ([`VolumeBackend::handover`]).
#[derive(Debug)]
pub struct HandedOver {
    /// The volume's device as it is now (`None`: its record is unchanged,
    /// e.g. a dm device over a private ublk device).
    pub attachment: Option<Attachment>,
    pub previous: WorkerInfo,
    pub current: WorkerInfo,
    pub method: HandoverMethod,
    /// From asking the old worker to let go to the new one serving.
    pub took: std::time::Duration,
}

/// One kernel mechanism for serving volumes.
pub trait VolumeBackend: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Whether it can run here, and why not.
    fn capability(&self) -> BackendCapability;

    /// Refuses, before anything is recorded, a spec this backend cannot serve
    /// on this image; decides the dispatch policy where there is one to decide.
    fn validate(
        &self,
        spec: &SpecCheck,
        image: &OwnedFd,
        size: u64,
    ) -> Result<Option<Decision>, BackendError>;

    /// Creates the device. On error, nothing of it is left behind.
    fn attach(&self, req: AttachRequest) -> Result<Attachment, BackendError>;

    /// Refuses, without side effects, to remove a device that is in use
    /// (mounted or held open exclusively).
    fn check_detach(&self, volume_id: Uuid) -> Result<(), BackendError>;

    /// Flushes and removes the device of `volume_id` (found by its mark, so a
    /// device whose attachment was never recorded can be removed too). No
    /// device is not an error.
    fn detach(&self, volume_id: Uuid, att: Option<&Attachment>) -> Result<(), BackendError>;

    /// Looks for a volume's device in the kernel and takes it back.
    fn probe(&self, req: ProbeRequest) -> Result<Probe, BackendError>;

    /// Every device of this backend that carries this instance's mark.
    fn marked(&self) -> Result<Vec<Marked>, BackendError>;

    /// What to do with marked devices that have no volume.
    fn orphan_policy(&self) -> OrphanPolicy {
        OrphanPolicy::Remove
    }

    /// Current counters.
    fn stats(&self, volume_id: Uuid, att: &Attachment) -> Result<VolumeStats, BackendError>;

    /// Current counters for the stats sampler, which reads every volume once
    /// a second: `previous` is its last reading. A backend whose full read
    /// wakes a process (a ublk worker) answers from what it can read without
    /// waking it when nothing moved since.
    fn sample(
        &self,
        volume_id: Uuid,
        att: &Attachment,
        _previous: Option<&VolumeStats>,
    ) -> Result<VolumeStats, BackendError> {
        self.stats(volume_id, att)
    }

    /// Whether this backend grows the image file itself (its worker holds the
    /// image, pinned when direct-mapped) rather than following a file the
    /// manager grew.
    fn grows_image(&self) -> bool {
        false
    }

    /// The lock on the image that a process serving the volume's device holds
    /// (a duplicate of it), found by [`Self::probe`]: what the manager keeps
    /// for an adopted volume when it could not take the lock itself.
    fn image_lock(&self, _volume_id: Uuid) -> Option<OwnedFd> {
        None
    }

    /// Makes the device follow its image's new size (growing the file first
    /// when [`VolumeBackend::grows_image`]).
    fn resize(
        &self,
        att: &Attachment,
        size_bytes: u64,
        allocation: Allocation,
        volume_id: Uuid,
    ) -> Result<Attachment, BackendError>;

    /// Refuses, without side effects and before anything is written, a
    /// volume whose image [`VolumeBackend::allocate`] cannot fill while it
    /// serves. A backend that cannot keep its writes out of the ranges it
    /// zeroes refuses (the default).
    fn check_allocate(&self, att: &Attachment, _volume_id: Uuid) -> Result<(), BackendError> {
        Err(BackendError::Busy {
            device: att.device.clone(),
            reason: format!(
                "the {} backend serves the image in the kernel, where blockplane cannot keep its writes out of the ranges it would zero",
                self.kind().as_str()
            ),
        })
    }

    /// Makes the volume's image `full` while it serves (`POST
    /// /v1/images/{id}/allocate`): the data path stops punching it, and its
    /// holes and unwritten extents are written with zeros without racing the
    /// volume's own writes. Blocks until done, reporting into `job`:
    /// `Ok(true)` done, `Ok(false)` stopped by `job.cancel` (the image is
    /// punched again if it was before). The default refuses as
    /// [`VolumeBackend::check_allocate`] does; a backend that passes it
    /// implements this.
    fn allocate(
        &self,
        att: &Attachment,
        volume_id: Uuid,
        _job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        self.check_allocate(att, volume_id).map(|()| false)
    }

    /// Moves a volume on `direct` to `nowait` for `reason` (its image is
    /// about to share extents, which a direct map must never serve). A
    /// backend without `direct` refuses (the default).
    fn leave_direct(
        &self,
        att: &Attachment,
        _volume_id: Uuid,
        _reason: Reason,
    ) -> Result<Attachment, BackendError> {
        Err(self.cannot_snapshot(att))
    }

    /// Shares the image's extents with `dest` at one moment of the volume's
    /// I/O: held, with no request inside, so the snapshot holds every write
    /// completed before and none after or in part. Returns how long I/O was
    /// held. Refused on `direct` ([`VolumeBackend::leave_direct`] first),
    /// and by a backend that cannot hold its I/O (the default).
    fn snapshot(
        &self,
        att: &Attachment,
        _volume_id: Uuid,
        _dest: &SnapshotDest,
    ) -> Result<std::time::Duration, BackendError> {
        Err(self.cannot_snapshot(att))
    }

    /// Begins a copy of one moment of the volume's I/O into the empty file
    /// `dest`, where the image's filesystem cannot share extents: held once,
    /// with no request inside, while writes start keeping the old bytes of
    /// what they overwrite (copy-before-write); the rest is copied in the
    /// background ([`VolumeBackend::follow_copy`]). Returns how long I/O was
    /// held. Refused on `direct`, and by a backend whose writes no worker sees
    /// (the default).
    fn copy_moment(
        &self,
        att: &Attachment,
        _volume_id: Uuid,
        _copy: &MomentCopy,
    ) -> Result<std::time::Duration, BackendError> {
        Err(self.cannot_snapshot(att))
    }

    /// Follows a copy [`VolumeBackend::copy_moment`] began until it ends,
    /// reporting progress into `job` and cancelling it when `job.cancel` is
    /// set: `Ok(true)` the file holds the moment, `Ok(false)` cancelled.
    fn follow_copy(
        &self,
        att: &Attachment,
        _volume_id: Uuid,
        _job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        Err(self.cannot_snapshot(att))
    }

    /// Why this backend refuses [`VolumeBackend::snapshot`], with the ways
    /// out it offers the volume (read-only only where it can switch live).
    fn cannot_snapshot(&self, att: &Attachment) -> BackendError {
        let way = if self.check_change(att, Change::ReadOnly(true)).is_ok() {
            "make the volume read-only (PATCH read_only) or delete it first"
        } else {
            "delete the volume first (its image stays)"
        };
        BackendError::Busy {
            device: att.device.clone(),
            reason: format!(
                "the {} backend cannot hold a volume's I/O for a snapshot; {way}",
                self.kind().as_str()
            ),
        }
    }

    /// The worker process serving the volume's device, if one does.
    fn worker(&self, _volume_id: Uuid) -> Option<WorkerInfo> {
        None
    }

    /// Whether the supervisor of this backend's workers runs (`None`: it
    /// has no workers); starts it first if it should run and does not.
    fn supervision(&self) -> Option<SupervisorStatus> {
        None
    }

    /// Refuses, without side effects, a handover of a volume whose device
    /// has no worker to replace (the default: the kernel serves it).
    fn check_handover(&self, _att: &Attachment, _volume_id: Uuid) -> Result<(), BackendError> {
        Err(BackendError::Unsupported {
            backend: self.kind().as_str(),
            what: "a handover to a new worker".into(),
            reason: format!(
                "the kernel serves a {} volume itself: there is no worker to replace",
                self.kind().as_str()
            ),
        })
    }

    /// Replaces the worker serving the volume's device by one of the
    /// service's own build while the device serves (`POST
    /// /v1/volumes/{id}/handover`), after [`Self::check_handover`] passed.
    /// An error after the old worker let go leaves the device served by a
    /// restarted worker and says so in an event.
    fn handover(
        &self,
        att: &Attachment,
        volume_id: Uuid,
        _faults: HandoverFaults,
    ) -> Result<HandedOver, BackendError> {
        self.check_handover(att, volume_id)?;
        Err(BackendError::Refused {
            reason: "this backend has no handover".into(),
        })
    }

    /// Refuses, without side effects, a live change this backend cannot make.
    fn check_change(&self, att: &Attachment, change: Change) -> Result<(), BackendError>;

    /// Applies a live change (after [`VolumeBackend::check_change`] passed).
    fn reconfigure(
        &self,
        att: &Attachment,
        change: Change,
        volume_id: Uuid,
    ) -> Result<Attachment, BackendError>;
}

/// What the dm backend needs of the ublk backend: the private ublk device a
/// dm volume's table points at off its direct path, named by the dm
/// volume's id. The ublk backend implements it.
pub trait PrivateDevices: Send + Sync {
    /// Why private devices cannot be made here (`None`: they can).
    fn missing(&self) -> Option<String>;

    /// Starts a volume's private device with `req.decision`'s policy.
    fn start(&self, req: AttachRequest) -> Result<Attachment, BackendError>;

    /// Takes back a volume's private device after a restart.
    fn adopt(&self, req: ProbeRequest) -> Result<Probe, BackendError>;

    /// A live change (`SetDispatch`, `SetReadOnly`, `Resize`), kept for a
    /// replacement worker; the private device as it is after it.
    fn change(&self, volume_id: Uuid, req: Request) -> Result<Attachment, BackendError>;

    /// Makes the image `full` while the private device serves (see
    /// [`VolumeBackend::allocate`]).
    fn fill(&self, volume_id: Uuid, job: &AllocateJob) -> Result<bool, BackendError>;

    /// The image lock the private device's worker kept through a restart.
    fn held_lock(&self, volume_id: Uuid) -> Option<OwnedFd>;

    /// Makes the private worker snapshot the image ([`VolumeBackend::snapshot`]).
    fn snapshot_image(
        &self,
        volume_id: Uuid,
        dest: &SnapshotDest,
    ) -> Result<std::time::Duration, BackendError>;

    /// Makes the private worker begin a copy of one moment
    /// ([`VolumeBackend::copy_moment`]).
    fn copy_image(
        &self,
        volume_id: Uuid,
        copy: &MomentCopy,
    ) -> Result<std::time::Duration, BackendError>;

    /// Follows the private worker's copy ([`VolumeBackend::follow_copy`]).
    fn follow_copy(&self, volume_id: Uuid, job: &AllocateJob) -> Result<bool, BackendError>;

    /// Stops the private device and its worker (none is not an error).
    fn stop(&self, volume_id: Uuid) -> Result<(), BackendError>;

    /// The private device's worker, if one serves it.
    fn worker(&self, volume_id: Uuid) -> Option<WorkerInfo>;

    /// The counters of the private device's worker, from its stats file
    /// (the worker is not woken); `None` when no worker serves it.
    fn counters(&self, volume_id: Uuid) -> Option<WorkerStats>;

    /// Refuses a handover when no worker serves the private device.
    fn check_handover(&self, volume_id: Uuid) -> Result<(), BackendError>;

    /// Hands the private device over to a new worker
    /// ([`VolumeBackend::handover`]); the attachment returned is the private
    /// device's.
    fn hand_over(
        &self,
        volume_id: Uuid,
        faults: HandoverFaults,
    ) -> Result<HandedOver, BackendError>;
}

/// The parts of a volume spec a backend checks before anything is recorded.
#[derive(Debug, Clone)]
pub struct SpecCheck {
    pub dispatch: DispatchPolicy,
    pub queues: u16,
    pub queue_depth: u16,
    pub max_io_bytes: u32,
    pub qos: Option<Qos>,
    pub read_only: bool,
}

impl SpecCheck {
    /// The dispatch decision for this spec on `image`, in `path`'s terms.
    pub fn decide(
        &self,
        image: &OwnedFd,
        size: u64,
        path: &dispatch::Path,
    ) -> Result<Decision, BackendError> {
        Ok(dispatch::decide(&dispatch::Ask {
            image: image.as_fd(),
            size,
            policy: self.dispatch,
            refuse_writes: self.read_only,
            path,
        })?)
    }
}

/// A backend's guard, never the rule: the manager refuses to make a volume
/// created read-only writable (`manager::volumes`), so a backend asked to
/// is a bug, and it refuses rather than serve writes over such an image.
pub const WRITABLE_OVER_READ_ONLY: &str =
    "invariant: a volume created read-only never takes writes (the manager refuses this first)";

/// Why a claimed device cannot be removed.
pub(crate) const CLAIMED: &str = "it is mounted or held open exclusively; unmount it first";

/// Refuses when the block device `node` is mounted or held open exclusively:
/// the kernel answers EBUSY to an `O_EXCL` open of a claimed device.
pub(crate) fn refuse_if_claimed(node: String) -> Result<(), BackendError> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL | libc::O_CLOEXEC)
        .open(&node)
    {
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Err(BackendError::Busy {
            device: node,
            reason: CLAIMED.into(),
        }),
        _ => Ok(()),
    }
}

/// Stats in the API's shape from the kernel's counters since `att` was made.
pub(crate) fn kernel_stats(
    volume_id: Uuid,
    backend: BackendKind,
    att: &Attachment,
) -> Result<VolumeStats, BackendError> {
    let now = blockplane_system::blockstat::BlockStat::read(&att.kernel_name)
        .map_err(|e| BackendError::io("read statistics", &att.device, e))?;
    let delta = match &att.baseline {
        Some(base) => now.since(base),
        None => now,
    };
    let [read, write, flush, discard]: [OpStats; 4] = delta.ops();
    Ok(VolumeStats {
        volume_id,
        backend,
        dispatch: att.dispatch,
        read,
        write,
        flush,
        discard,
        in_flight: delta.in_flight,
        since: att.attached_at,
        kernel: Some(delta.kernel()),
        latency_us: None,
        nowait: None,
        qos_throttled: None,
        worker_restarts: None,
        rates: None,
        page_cache: None,
        histograms: None,
    })
}
