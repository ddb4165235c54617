//! The control socket's words: one JSON request, one JSON answer per line.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use blockplane_system::dispatch::Reason;
use blockplane_system::extent::Pin;

use crate::terms::{Allocation, DataPath, HandoverMethod, Histogram, Limits, OpCounts};

/// The control socket protocol this build speaks: 1 was the line protocol
/// before versions (no handshake, no handover); 2 adds [`Request::Hello`]
/// and [`Request::Handover`], and a worker's build in [`Status::build`]; 3
/// adds [`Request::CopyMoment`] and [`Request::CancelCopy`]; 4 carries the
/// dispatch reason as a type beside its words ([`Reason`]: `why` in
/// [`Request::SetDispatch`], `dispatch_why` in [`Status`] and the spec).
pub const PROTOCOL: u32 = 4;

/// Why a worker of a volume created read-only cannot fill its image.
pub const CANNOT_FILL_READ_ONLY: &str = "the volume was created read-only: its worker holds the image read-only and cannot write zeros into it; detach it first";

/// Why a worker refuses a handover while it copies one moment.
pub const COPY_RUNS_HANDOVER: &str = "a snapshot's copy of one moment runs in this worker: its writes keep the moment's chunks, so a handover waits for the copy's end (or its cancel)";

/// Why a worker refuses `direct` while it copies one moment.
pub const COPY_RUNS_DIRECT: &str = "a snapshot's copy of one moment runs on this volume: its writes keep the moment's chunks on the file path, so direct waits for the copy's end";

/// Why a worker on `direct` refuses a snapshot.
pub const SNAPSHOT_OF_DIRECT: &str = "a direct volume's image must own its extents alone (direct-map rule: no SHARED extents): move the volume off direct before sharing them with a snapshot";

/// A request on the control socket. Fields a build does not know are
/// refused ([`serve_connection`](crate::serve_connection)): where a field's presence would change a
/// request's meaning, an older worker must not act on the rest of it. (The
/// requests without fields are struct variants all the same, `Status {}`:
/// serde lets a unit variant ignore fields.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The handshake, a connection's first line (protocol 2): the
    /// protocol and build of the asking side. Answered [`Answer::Hello`];
    /// the request follows on the same connection. The one request read
    /// leniently: a later protocol may say more of itself here.
    Hello(Peer),
    /// Identity and state.
    Status {},
    /// Counters and latency percentiles.
    Stats {},
    /// Switch the dispatch policy while I/O runs.
    SetDispatch {
        /// The data path.
        dispatch: DataPath,
        /// Why, in words (what a worker of protocol 3 or older keeps).
        reason: String,
        /// Why, reported back as the volume's dispatch reason (protocol 4;
        /// never sent to an older worker: [`Request::for_peer`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        why: Option<Reason>,
    },
    /// Refuse writes, or take them again (a volume created writable only).
    SetReadOnly {
        /// Refuse writes.
        read_only: bool,
    },
    /// Change the QoS limits live.
    SetQos {
        /// The new limits (none: unlimited).
        qos: Option<Limits>,
    },
    /// Grow the image (the worker holds it, pinned if direct) and the device.
    Resize {
        /// The new size (not below the current one).
        size_bytes: u64,
        /// `full`: the new range is allocated and written with zeros.
        allocation: Allocation,
    },
    /// Start making the image `full` (see `POST /v1/images/{id}/allocate`):
    /// never punched from now on, and its holes and unwritten extents
    /// written with zeros, range by range with the queues held, on a thread
    /// of its own (the socket keeps answering). Answers at once with the
    /// status; a fill already running is adopted, not started twice. Its
    /// progress and end are in [`Status::allocate`].
    Allocate {
        /// A pause after each stretch, ms (the service's test fault
        /// `slow_allocate`; 0 otherwise).
        #[serde(default)]
        pace_ms: u64,
    },
    /// Stop a running fill after its current range. The image goes back to
    /// being punched if it was before ([`FillState::Cancelled`]).
    CancelAllocate {},
    /// Share the image's extents with `dest` (`FICLONE`) at one moment of
    /// the volume's I/O: every queue held, no request inside, so the new
    /// file holds every write completed before and none after or in part.
    /// `dest` must be the empty file `(dev, ino)` the control plane made; a
    /// worker on `direct` refuses (a shared extent is what a direct map must
    /// never have: the control plane moves it off first). Answers
    /// [`Answer::Snapshot`].
    Snapshot {
        /// The empty file to share the extents with.
        dest: PathBuf,
        /// Its `st_dev`, checked before the clone.
        dev: u64,
        /// Its `st_ino`, checked before the clone.
        ino: u64,
    },
    /// Copy one moment of the volume into `dest` where the image's
    /// filesystem cannot share extents (protocol 3): every queue held once,
    /// no request inside, while writes start keeping the old bytes of each
    /// chunk they touch first (copy-before-write); a thread of the worker's
    /// own copies the rest. `dest` must be the empty file `(dev, ino)` the
    /// control plane made. Answers [`Answer::Snapshot`] once the moment is
    /// taken; the copy's progress and end are in [`Status::copy`]. Refused
    /// on `direct`, and while another copy runs.
    CopyMoment {
        /// The empty file to copy the moment into.
        dest: PathBuf,
        /// Its `st_dev`, checked before the copy.
        dev: u64,
        /// Its `st_ino`, checked before the copy.
        ino: u64,
        /// A pause after each chunk, ms (the service's test fault
        /// `slow_copy`; 0 otherwise).
        #[serde(default)]
        pace_ms: u64,
        /// While this file exists the copy waits (the service's test fault
        /// `gate_copy`).
        #[serde(default)]
        gate: Option<PathBuf>,
    },
    /// Stop a running copy of one moment (protocol 3): it ends
    /// [`FillState::Cancelled`] and writes stop keeping chunks.
    CancelCopy {},
    /// Stop and delete the device (in-flight I/O ends with errors), unpin the
    /// image, exit.
    Shutdown {},
    /// Let go of the device for a successor, keeping it (protocol 2): with
    /// `UBLK_F_QUIESCE` the kernel quiesces it (the requests inside finish,
    /// new ones wait), else every queue is held until no request is inside
    /// the data path and the worker exits, its held requests requeued by the
    /// kernel (`USER_RECOVERY_REISSUE`). The image stays pinned if it is;
    /// the stats file stays for the successor. Answers
    /// [`Answer::HandedOver`], then the worker exits (0). A refusal
    /// ([`ErrorCode::Refused`]: a fill runs, the device cannot be recovered
    /// without failing requests) leaves it serving.
    Handover {
        /// A pause once the device is let go, before the worker exits, ms
        /// (the service's test fault `slow_handover`; 0 otherwise).
        #[serde(default)]
        pace_ms: u64,
    },
}

impl Request {
    /// A switch to `dispatch`, for `reason`.
    pub fn set_dispatch(dispatch: DataPath, reason: &Reason) -> Self {
        Request::SetDispatch {
            dispatch,
            reason: reason.to_string(),
            why: Some(reason.clone()),
        }
    }

    /// This request as a worker of `protocol` reads it: without the fields
    /// later protocols added, which it would refuse (where a field changes
    /// a request's meaning the request is newer as a whole: [`Self::since`]).
    pub fn for_peer(&self, protocol: u32) -> Self {
        match self {
            Request::SetDispatch {
                dispatch, reason, ..
            } if protocol < 4 => Request::SetDispatch {
                dispatch: *dispatch,
                reason: reason.clone(),
                why: None,
            },
            other => other.clone(),
        }
    }

    /// The first protocol version that has this request: a worker of an
    /// older one is never sent it.
    pub fn since(&self) -> u32 {
        match self {
            Request::Hello(_) | Request::Handover { .. } => 2,
            Request::CopyMoment { .. } | Request::CancelCopy {} => 3,
            _ => 1,
        }
    }

    /// The request's `op`, for messages.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello(_) => "hello",
            Request::Status {} => "status",
            Request::Stats {} => "stats",
            Request::SetDispatch { .. } => "set_dispatch",
            Request::SetReadOnly { .. } => "set_read_only",
            Request::SetQos { .. } => "set_qos",
            Request::Resize { .. } => "resize",
            Request::Allocate { .. } => "allocate",
            Request::CancelAllocate {} => "cancel_allocate",
            Request::Snapshot { .. } => "snapshot",
            Request::CopyMoment { .. } => "copy_moment",
            Request::CancelCopy {} => "cancel_copy",
            Request::Shutdown {} => "shutdown",
            Request::Handover { .. } => "handover",
        }
    }
}

/// What one side of the control socket says of itself in the handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    /// The highest protocol it speaks.
    pub protocol: u32,
    /// Its build; `None` for a worker from before the handshake.
    pub build: Option<String>,
}

impl Peer {
    /// A worker from before the handshake: protocol 1, build unknown.
    pub fn before_handshake() -> Self {
        Self {
            protocol: 1,
            build: None,
        }
    }

    /// This build.
    pub fn this_build() -> Self {
        Self {
            protocol: PROTOCOL,
            build: Some(blockplane_system::build::current().to_string()),
        }
    }
}

/// A worker's state as it reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// The worker's process id.
    pub pid: u32,
    /// The ublk device's id.
    pub dev_id: u32,
    /// `/dev/ublkbN`.
    pub device: String,
    /// The policy in force.
    pub dispatch: DataPath,
    /// Why that policy, in words.
    pub dispatch_reason: String,
    /// Why that policy (protocol 4; a worker before it reports words only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_why: Option<Reason>,
    /// Set while the image carries FS_IMMUTABLE_FL for a direct map.
    pub pinned: Option<Pin>,
    /// The device's size as the worker serves it.
    pub size_bytes: u64,
    /// Writes are refused now.
    pub read_only: bool,
    /// Bytes of I/O buffers the worker holds (queues x depth x max I/O; 0
    /// with zero copy).
    pub buffer_bytes: u64,
    /// Queues the device has (the kernel caps the count asked at its CPUs).
    #[serde(default)]
    pub queues: u16,
    /// Requests' pages are used in place (UBLK_F_AUTO_BUF_REG), not copied.
    #[serde(default)]
    pub zero_copy: bool,
    /// The kernel's ublk feature bits.
    pub features: u64,
    /// UBLK_F_* flags the device was created with.
    pub dev_flags: u64,
    /// Set when the direct map's extents drifted and the worker left the direct path.
    pub degraded: Option<String>,
    /// The kernel could not take a new size live (no UPDATE_SIZE): it applies
    /// at the next attach.
    pub resize_pending: bool,
    /// The last fill started by [`Request::Allocate`] (none yet: `None`).
    #[serde(default)]
    pub allocate: Option<Fill>,
    /// The last copy started by [`Request::CopyMoment`] (protocol 3; none
    /// yet: `None`).
    #[serde(default)]
    pub copy: Option<Fill>,
    /// The worker's build (protocol 2; `None` from an older worker).
    #[serde(default)]
    pub build: Option<String>,
}

impl Status {
    /// Why the worker runs its policy: the type, or what the words of a
    /// worker before protocol 4 say.
    pub fn reason(&self) -> Reason {
        Reason::carried(self.dispatch_why.clone(), &self.dispatch_reason)
    }
}

/// Where a worker's fill ([`Request::Allocate`]) or copy of one moment
/// ([`Request::CopyMoment`]) is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fill {
    /// Running, or how it ended.
    pub state: FillState,
    /// Bytes of holes and unwritten extents written with zeros so far.
    pub done_bytes: u64,
    /// Bytes of holes and unwritten extents found when it started.
    pub total_bytes: u64,
    /// Why it failed ([`FillState::Failed`]).
    pub error: Option<String>,
}

/// A fill's or a copy's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FillState {
    /// Writing zeros, or copying, now.
    Running,
    /// A fill: every hole and unwritten extent is written, the image is
    /// `full`. A copy: the file holds the moment, flushed.
    Done,
    /// Stopped by an error ([`Fill::error`]).
    Failed,
    /// Stopped by [`Request::CancelAllocate`] or [`Request::CancelCopy`].
    Cancelled,
}

/// Latency percentiles of one kind of request, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// The median.
    pub p50: u64,
    /// The 90th percentile.
    pub p90: u64,
    /// The 99th percentile.
    pub p99: u64,
    /// The 99.9th percentile.
    pub p999: u64,
    /// The slowest request.
    pub max: u64,
    /// Requests measured.
    pub count: u64,
}

/// What `Stats` answers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// Reads.
    pub read: OpCounts,
    /// Writes.
    pub write: OpCounts,
    /// Flushes.
    pub flush: OpCounts,
    /// Discards and write-zeroes.
    pub discard: OpCounts,
    /// Requests inside the queues now (a gauge).
    pub in_flight: u64,
    /// Unix milliseconds since which the counters count.
    pub since_ms: u64,
    /// Latency of reads, writes, flushes and discards, in that order.
    pub latency: [Latency; 4],
    /// Per-op histograms over [`LATENCY_BOUNDS_US`](crate::LATENCY_BOUNDS_US).
    pub histograms: Vec<Histogram>,
    /// Submissions with RWF_NOWAIT.
    pub nowait_submitted: u64,
    /// Of those, completed without blocking.
    pub nowait_completed_inline: u64,
    /// Of those, answered EAGAIN and resubmitted on the blocking path.
    pub nowait_eagain_fallbacks: u64,
    /// Times an op type stopped asking NOWAIT for a while.
    #[serde(default)]
    pub nowait_pauses: u64,
    /// Submissions made without NOWAIT while their op type was paused.
    #[serde(default)]
    pub nowait_bypassed: u64,
    /// Requests that waited for the QoS limits.
    pub qos_throttled: u64,
    /// Workers that took the device over after an earlier one ended, since
    /// the counters started.
    pub worker_restarts: u64,
}

/// Why a worker refused or failed a request: a stable word on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A rule refused it; nothing changed.
    Refused,
    /// An I/O error (the kernel, the image, a raw device) failed it.
    IoError,
    /// The request could not be read.
    BadRequest,
    /// A code this build does not know (a worker of a newer version).
    #[serde(other)]
    Unknown,
}

/// An answer on the control socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    /// The answer to [`Request::Status`] and to every change.
    Status(Box<Status>),
    /// The answer to [`Request::Stats`].
    Stats(Box<WorkerStats>),
    /// The answer to [`Request::Hello`]: the worker's protocol and build.
    Hello(Peer),
    /// A [`Request::Snapshot`] made: how long the queues were held, µs.
    Snapshot {
        /// Microseconds the queues were held.
        held_us: u64,
    },
    /// A [`Request::Handover`] done: the device waits for its successor;
    /// the worker exits.
    HandedOver {
        /// How it let go ([`HandoverMethod::Quiesce`] or `Drain`).
        method: HandoverMethod,
    },
    /// Refused or failed; `message` names the rule.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// What happened, for the operator.
        message: String,
    },
}
