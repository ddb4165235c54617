//! What the control plane and a worker say to each other: the worker's launch
//! spec, and one JSON request / one JSON answer per line on the worker's
//! control socket. Both sides use these types; nothing else crosses.
//!
//! **Versions.** A connection starts with a handshake: the service sends
//! [`Request::Hello`] naming the protocol it speaks ([`PROTOCOL`]) and its
//! build, the worker answers [`Answer::Hello`] with its own, then the one
//! request and its answer follow on the same connection. A worker from
//! before the handshake (protocol 1) answers the hello as an unreadable
//! request: the service then asks again without it, and sends it only the
//! requests protocol 1 has ([`Request::since`]). Requests and the spec deny
//! fields they do not know, so a message of a newer version is refused with
//! the reason, never half read; answers only ever gain fields, which an
//! older reader may skip.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use blockplane_api::model::{
    ActiveDispatch, Allocation, DispatchPolicy, HandoverMethod, OpStats, Qos,
};
use blockplane_system::extent::{ExtentMap, Pin};

/// The control socket protocol this build speaks: 1 was the line protocol
/// before versions (no handshake, no handover); 2 adds [`Request::Hello`]
/// and [`Request::Handover`], and a worker's build in [`Status::build`]; 3
/// adds [`Request::CopyMoment`] and [`Request::CancelCopy`].
pub const PROTOCOL: u32 = 3;

/// The file descriptor number the image is handed to a worker on.
pub const IMAGE_FD: i32 = 3;

/// The file descriptor number the control plane's image lock is handed to a
/// worker on (when [`WorkerSpec::image_lock`]): an open file description
/// that holds an OFD lock on the image, shared with the control plane, so
/// the lock lasts while either of them lives.
pub const LOCK_FD: i32 = 4;

/// The file descriptor number a handover's new worker gets a socket on
/// (when [`WorkerSpec::handover`]): it writes [`GO_READY`] once it is
/// started and waits for [`GO_TAKE`] before it touches the device, so the
/// old worker lets go only when its successor is ready, and the device waits
/// for no exec. End of file instead: the handover was called off.
pub const GO_FD: i32 = 5;

/// A handover's new worker is ready to take the device (on [`GO_FD`]).
pub const GO_READY: u8 = b'r';

/// The old worker let go: take the device (on [`GO_FD`]).
pub const GO_TAKE: u8 = b'g';

/// How a worker is to serve its volume (passed as JSON on its command line).
/// A field this build does not know is refused: the worker then exits with
/// the reason rather than serving without it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// The volume served.
    pub volume_id: Uuid,
    /// The worker's directory: control socket, stats file, log, state.
    pub run_dir: PathBuf,
    /// For messages only: the worker never resolves paths.
    pub image_path: String,
    /// The device's size.
    pub size_bytes: u64,
    /// Created read-only: the image is held read-only and the device carries
    /// the read-only attribute, so it can never be made writable live.
    pub read_only: bool,
    /// Writes are refused: the read-only switch as last set (live or at
    /// create). A replacement worker starts with it.
    #[serde(default)]
    pub refuse_writes: bool,
    /// The policy to start with (never `Auto`: the control plane decides).
    pub dispatch: DispatchPolicy,
    /// Why that policy (reported back as the volume's `dispatch_reason`).
    pub dispatch_reason: String,
    /// Queues to ask the kernel for (each on a thread of its own).
    pub queues: u16,
    /// Requests in flight per queue.
    pub queue_depth: u16,
    /// Largest request, bytes (the device's max sectors * 512).
    pub max_io_bytes: u32,
    /// Threads of the `threaded` policy's pool.
    pub threads: u16,
    /// IOPS and bandwidth limits (none: unlimited).
    pub qos: Option<Qos>,
    /// Recover this existing (quiesced) ublk device instead of adding one.
    pub recover_dev_id: Option<u32>,
    /// The image was pinned by an earlier worker of this volume.
    pub pinned: Option<Pin>,
    /// Seconds between re-reads of a direct map (rule 5).
    pub extent_check_secs: u32,
    /// The image's allocation: a `full` image is never punched on the file
    /// paths (DISCARD leaves its blocks, WRITE_ZEROES writes zeros), so it
    /// stays eligible for `direct`; a `sparse` one is.
    #[serde(default)]
    pub allocation: Allocation,
    /// The image lock is on [`LOCK_FD`]: the worker takes it (again) before
    /// it serves and refuses to start when another open file description
    /// holds the image.
    #[serde(default)]
    pub image_lock: bool,
    /// The run dir holds the extent map the control plane decided `direct`
    /// from ([`DECIDED_MAP`]; a map can be too large for a command line):
    /// the worker pins the image and checks it still maps that way, instead
    /// of reading the map before the pin too. Only a first start has one.
    #[serde(default)]
    pub decided_map: bool,
    /// With `recover_dev_id`: the device is taken over from a worker that
    /// handed it over ([`Request::Handover`]), not from one that crashed,
    /// so `worker_restarts` does not count it; the worker waits on
    /// [`GO_FD`] for the word to take it.
    #[serde(default)]
    pub handover: bool,
}

/// Why a worker of a volume created read-only cannot fill its image.
pub const CANNOT_FILL_READ_ONLY: &str = "the volume was created read-only: its worker holds the image read-only and cannot write zeros into it; detach it first";

/// Why a worker refuses a handover while it copies one moment.
pub const COPY_RUNS_HANDOVER: &str = "a snapshot's copy of one moment runs in this worker: its writes keep the moment's chunks, so a handover waits for the copy's end (or its cancel)";

/// Why a worker refuses `direct` while it copies one moment.
pub const COPY_RUNS_DIRECT: &str = "a snapshot's copy of one moment runs on this volume: its writes keep the moment's chunks on the file path, so direct waits for the copy's end";

/// Why a worker on `direct` refuses a snapshot.
pub const SNAPSHOT_OF_DIRECT: &str = "a direct volume's image must own its extents alone (direct-map rule: no SHARED extents): move the volume off direct before sharing them with a snapshot";

/// The file in a worker's run dir with the map of [`WorkerSpec::decided_map`].
pub const DECIDED_MAP: &str = "decided-map.json";

/// Writes the map a worker's start is to check (see [`WorkerSpec::decided_map`]).
pub fn put_decided_map(run_dir: &Path, map: &ExtentMap) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(run_dir.join(DECIDED_MAP))?;
    serde_json::to_writer(&mut f, map).map_err(std::io::Error::other)
}

/// Reads (and removes) the map written by [`put_decided_map`].
pub fn take_decided_map(run_dir: &Path) -> std::io::Result<ExtentMap> {
    let path = run_dir.join(DECIDED_MAP);
    let map = serde_json::from_slice(&std::fs::read(&path)?).map_err(std::io::Error::other)?;
    std::fs::remove_file(&path)?;
    Ok(map)
}

/// A request on the control socket. Fields a build does not know are
/// refused ([`serve_connection`]): where a field's presence would change a
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
        /// The policy (never `Auto`).
        dispatch: DispatchPolicy,
        /// Why, reported back as the volume's `dispatch_reason`.
        reason: String,
    },
    /// Refuse writes, or take them again (a volume created writable only).
    SetReadOnly {
        /// Refuse writes.
        read_only: bool,
    },
    /// Change the QoS limits live.
    SetQos {
        /// The new limits (none: unlimited).
        qos: Option<Qos>,
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
    pub dispatch: ActiveDispatch,
    /// Why that policy.
    pub dispatch_reason: String,
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
    pub read: OpStats,
    /// Writes.
    pub write: OpStats,
    /// Flushes.
    pub flush: OpStats,
    /// Discards and write-zeroes.
    pub discard: OpStats,
    /// Requests inside the queues now (a gauge).
    pub in_flight: u64,
    /// Unix milliseconds since which the counters count.
    pub since_ms: u64,
    /// Latency of reads, writes, flushes and discards, in that order.
    pub latency: [Latency; 4],
    /// Per-op histograms over `model::LATENCY_BOUNDS_US`.
    pub histograms: Vec<blockplane_api::model::LatencyHistogram>,
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

/// Why talking to a worker failed.
#[derive(Debug, thiserror::Error)]
pub enum TalkError {
    /// Connecting, writing or reading failed.
    #[error("worker control socket {path}: {source}")]
    Io {
        /// The socket.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The answer was not JSON of an [`Answer`].
    #[error("worker answered something unreadable: {0}")]
    Garbled(String),
    /// The worker's protocol has no such request: it was not sent.
    #[error(
        "the worker speaks protocol {protocol} (build {build}), which has no request '{op}' (protocol {since} and later)"
    )]
    NotUnderstood {
        /// The request's op.
        op: &'static str,
        /// The first protocol that has it.
        since: u32,
        /// The worker's protocol.
        protocol: u32,
        /// The worker's build.
        build: String,
    },
}

/// The `--spec` argument of process `pid`, if it is a blockplane worker (read
/// as plain JSON: a worker of another version may have other fields).
pub fn worker_spec(pid: u32) -> Option<serde_json::Value> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = cmdline.split(|b| *b == 0);
    args.find(|a| *a == b"worker")?;
    args.find(|a| *a == b"--spec")?;
    serde_json::from_slice(args.next()?).ok()
}

/// One connection to a worker's control socket.
struct Conn {
    reader: BufReader<UnixStream>,
    path: String,
}

impl Conn {
    fn open(socket: &Path, timeout: Duration) -> Result<Self, TalkError> {
        let path = socket.display().to_string();
        let io = |source| TalkError::Io {
            path: path.clone(),
            source,
        };
        let s = UnixStream::connect(socket).map_err(io)?;
        s.set_read_timeout(Some(timeout)).map_err(io)?;
        s.set_write_timeout(Some(timeout)).map_err(io)?;
        Ok(Self {
            reader: BufReader::new(s),
            path,
        })
    }

    /// Sends `req`, reads one answer.
    fn ask(&mut self, req: &Request) -> Result<Answer, TalkError> {
        let io = |source| TalkError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_string(req).expect("requests serialize");
        line.push('\n');
        self.reader
            .get_mut()
            .write_all(line.as_bytes())
            .map_err(io)?;
        let mut answer = String::new();
        self.reader.read_line(&mut answer).map_err(io)?;
        serde_json::from_str(&answer).map_err(|e| TalkError::Garbled(format!("{e}: {answer:?}")))
    }
}

/// Refuses a request the worker's protocol does not have.
fn understood(req: &Request, peer: &Peer) -> Result<(), TalkError> {
    if req.since() > peer.protocol {
        return Err(TalkError::NotUnderstood {
            op: req.op(),
            since: req.since(),
            protocol: peer.protocol,
            build: peer.build.clone().unwrap_or_else(|| "unknown".into()),
        });
    }
    Ok(())
}

/// The handshake, then one request and its answer; what the worker said of
/// itself with it. A worker from before the handshake is asked again on a
/// fresh connection, with the request alone, if its protocol has it.
pub fn converse(
    socket: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<(Peer, Answer), TalkError> {
    let mut conn = Conn::open(socket, timeout)?;
    match conn.ask(&Request::Hello(Peer::this_build()))? {
        Answer::Hello(peer) => {
            understood(req, &peer)?;
            Ok((peer, conn.ask(req)?))
        }
        // Protocol 1 reads the hello as a request it does not know.
        Answer::Error {
            code: ErrorCode::BadRequest,
            ..
        } => {
            let peer = Peer::before_handshake();
            understood(req, &peer)?;
            Ok((peer, Conn::open(socket, timeout)?.ask(req)?))
        }
        other => Err(TalkError::Garbled(format!(
            "the answer to the handshake was {other:?}"
        ))),
    }
}

/// [`converse`], without what the worker said of itself.
pub fn talk(socket: &Path, req: &Request, timeout: Duration) -> Result<Answer, TalkError> {
    converse(socket, req, timeout).map(|(_, answer)| answer)
}

/// Reads one request line as this build's [`Request`], or the refusal to
/// answer: a request of a newer protocol (an unknown op or field) is
/// refused, never read in part.
pub fn read_request(line: &str) -> Result<Request, Answer> {
    serde_json::from_str(line).map_err(|e| Answer::Error {
        code: ErrorCode::BadRequest,
        message: format!(
            "unreadable request (this worker speaks protocol {PROTOCOL}, build {}): {e}",
            blockplane_system::build::current()
        ),
    })
}

/// Serves one connection of a control socket: the handshake if the client
/// starts with one, then one request, answered by `handle` (a refusal of an
/// unreadable line never reaches it).
pub fn serve_connection(
    conn: &UnixStream,
    handle: impl FnOnce(Request) -> Answer,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn);
    let mut writer = conn;
    let mut answer = |a: &Answer| {
        let mut out = serde_json::to_string(a).expect("answers serialize");
        out.push('\n');
        writer.write_all(out.as_bytes())
    };
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut req = read_request(&line);
    if let Ok(Request::Hello(_)) = req {
        answer(&Answer::Hello(Peer::this_build()))?;
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        req = read_request(&line);
    }
    match req {
        Ok(Request::Hello(_)) => answer(&Answer::Error {
            code: ErrorCode::BadRequest,
            message: "a second hello on one connection".into(),
        }),
        Ok(req) => answer(&handle(req)),
        Err(refused) => answer(&refused),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_are_one_json_line_each() {
        let r = Request::SetDispatch {
            dispatch: DispatchPolicy::Direct,
            reason: "asked".into(),
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"op":"set_dispatch","dispatch":"direct","reason":"asked"}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        let a = Answer::Error {
            code: ErrorCode::Refused,
            message: "direct-map rule 2".into(),
        };
        let s = serde_json::to_string(&a).unwrap();
        assert!(!s.contains('\n'));
        assert_eq!(serde_json::from_str::<Answer>(&s).unwrap(), a);
        // The codes are the words workers of earlier versions answer with.
        assert_eq!(
            s,
            r#"{"error":{"code":"refused","message":"direct-map rule 2"}}"#
        );
        for (code, word) in [
            (ErrorCode::IoError, "io_error"),
            (ErrorCode::BadRequest, "bad_request"),
        ] {
            assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{word}\""));
        }
        assert_eq!(
            serde_json::from_str::<ErrorCode>(r#""from_the_future""#).unwrap(),
            ErrorCode::Unknown
        );
        // A service from before the pace asks without it.
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"allocate"}"#).unwrap(),
            Request::Allocate { pace_ms: 0 }
        );
    }

    /// A worker of protocol 1 (before the handshake), as it answered: an
    /// unknown op is an unreadable request, a known one is answered.
    const V1_STATUS: &str = r#"{"status":{"pid":7,"dev_id":3,"device":"/dev/ublkb3","dispatch":"nowait","dispatch_reason":"asked","pinned":null,"size_bytes":4096,"read_only":false,"buffer_bytes":0,"queues":1,"zero_copy":false,"features":0,"dev_flags":0,"degraded":null,"resize_pending":false,"allocate":null}}"#;

    fn v1_worker(dir: &Path, connections: usize) -> std::thread::JoinHandle<Vec<String>> {
        let listener = std::os::unix::net::UnixListener::bind(dir.join("ctl.sock")).unwrap();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            for conn in listener.incoming().take(connections) {
                let conn = conn.unwrap();
                let mut line = String::new();
                BufReader::new(&conn).read_line(&mut line).unwrap();
                let op = serde_json::from_str::<serde_json::Value>(&line).unwrap()["op"]
                    .as_str()
                    .unwrap()
                    .to_string();
                let answer = match op.as_str() {
                    "status" => V1_STATUS.to_string(),
                    other => format!(
                        r#"{{"error":{{"code":"bad_request","message":"unreadable request: unknown variant `{other}`"}}}}"#
                    ),
                };
                seen.push(op);
                (&conn).write_all(format!("{answer}\n").as_bytes()).unwrap();
            }
            seen
        })
    }

    /// The service drives a worker from before the handshake: it is asked
    /// again without the hello, only what protocol 1 has, and its answers
    /// (without a build) read as this version's.
    #[test]
    fn a_worker_of_the_previous_protocol_is_still_driven() {
        let dir = tempfile::tempdir().unwrap();
        let worker = v1_worker(dir.path(), 3);
        let socket = dir.path().join("ctl.sock");
        let (peer, answer) =
            converse(&socket, &Request::Status {}, Duration::from_secs(5)).unwrap();
        assert_eq!(peer, Peer::before_handshake());
        let Answer::Status(status) = answer else {
            panic!("{answer:?}")
        };
        assert_eq!((status.dev_id, status.build), (3, None));
        // A request protocol 1 lacks is not sent at all.
        let e = converse(
            &socket,
            &Request::Handover { pace_ms: 0 },
            Duration::from_secs(5),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("speaks protocol 1 (build unknown), which has no request 'handover'"),
            "{e}"
        );
        assert_eq!(worker.join().unwrap(), ["hello", "status", "hello"]);
    }

    /// A worker of protocol 2 (a build from before copy-before-write, still
    /// serving after an upgrade without a handover) is never asked to copy
    /// a moment: the refusal names the request and the worker's protocol.
    #[test]
    fn a_protocol_2_worker_is_never_sent_a_copy_of_one_moment() {
        let old = Peer {
            protocol: 2,
            build: Some("0.1.0 (older)".into()),
        };
        let copy = Request::CopyMoment {
            dest: "/d".into(),
            dev: 1,
            ino: 2,
            pace_ms: 0,
            gate: None,
        };
        for req in [copy, Request::CancelCopy {}] {
            let e = understood(&req, &old).unwrap_err().to_string();
            assert!(
                e.contains(&format!("which has no request '{}'", req.op())),
                "{e}"
            );
        }
        assert!(understood(&Request::Handover { pace_ms: 0 }, &old).is_ok());
    }

    /// Lines written to a worker's side of a connection, and what it answered.
    fn serve(lines: &[&str]) -> (Vec<Answer>, Vec<Request>) {
        let (client, server) = UnixStream::pair().unwrap();
        let mut input = lines.join("\n");
        input.push('\n');
        (&client).write_all(input.as_bytes()).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let mut handled = Vec::new();
        serve_connection(&server, |req| {
            handled.push(req);
            Answer::Status(Box::new(
                serde_json::from_str::<Answer>(V1_STATUS)
                    .map(|a| match a {
                        Answer::Status(s) => *s,
                        _ => unreachable!(),
                    })
                    .unwrap(),
            ))
        })
        .unwrap();
        drop(server);
        let answers = BufReader::new(&client)
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
            .collect();
        (answers, handled)
    }

    #[test]
    fn a_connection_starts_with_the_handshake_or_is_served_as_protocol_1() {
        // Protocol 1: the request alone.
        let (answers, handled) = serve(&[r#"{"op":"set_qos","qos":{"iops":10}}"#]);
        assert_eq!(answers.len(), 1);
        assert!(matches!(answers[0], Answer::Status(_)));
        assert!(matches!(&handled[..], [Request::SetQos { qos: Some(q) }] if q.iops == Some(10)));
        // Protocol 2: the hello is answered with this build, then the request.
        let hello = serde_json::to_string(&Request::Hello(Peer::this_build())).unwrap();
        let (answers, handled) = serve(&[&hello, r#"{"op":"status"}"#]);
        assert_eq!(answers[0], Answer::Hello(Peer::this_build()));
        assert!(matches!(answers[1], Answer::Status(_)));
        assert_eq!(handled, [Request::Status {}]);
        // A later protocol's hello says more of itself: still a hello.
        let later = r#"{"op":"hello","protocol":3,"build":"0.2.0+x","features":["y"]}"#;
        let (answers, _) = serve(&[later, r#"{"op":"status"}"#]);
        assert_eq!(answers[0], Answer::Hello(Peer::this_build()));
    }

    /// A request of a newer version (an op, or a field, this build does not
    /// know) is refused with the reason; the handler never sees it.
    #[test]
    fn an_unknown_newer_request_is_refused_not_misread() {
        for (line, says) in [
            (
                r#"{"op":"set_read_only","read_only":true,"scope":"discards"}"#,
                "unknown field `scope`",
            ),
            (
                r#"{"op":"teleport","to":"elsewhere"}"#,
                "unknown variant `teleport`",
            ),
            (
                r#"{"op":"allocate","pace_ms":5,"zeroes":"fast"}"#,
                "unknown field `zeroes`",
            ),
            (
                r#"{"op":"status","verbose":true}"#,
                "unknown field `verbose`",
            ),
        ] {
            let (answers, handled) = serve(&[line]);
            assert!(
                handled.is_empty(),
                "{line} reached the handler: {handled:?}"
            );
            let [Answer::Error { code, message }] = &answers[..] else {
                panic!("{line}: {answers:?}")
            };
            assert_eq!(*code, ErrorCode::BadRequest, "{line}");
            assert!(message.contains(says), "{line}: {message}");
            assert!(
                message.contains(&format!("protocol {PROTOCOL}")),
                "{line}: {message}"
            );
        }
    }

    /// A spec with a field this build does not know is refused, not half read.
    #[test]
    fn a_spec_with_an_unknown_field_is_refused() {
        let spec = WorkerSpec {
            volume_id: Uuid::nil(),
            run_dir: "/run/x".into(),
            image_path: "/i".into(),
            size_bytes: 4096,
            read_only: false,
            refuse_writes: false,
            dispatch: DispatchPolicy::Nowait,
            dispatch_reason: "asked".into(),
            queues: 1,
            queue_depth: 1,
            max_io_bytes: 4096,
            threads: 1,
            qos: None,
            recover_dev_id: None,
            pinned: None,
            extent_check_secs: 1,
            allocation: Allocation::Sparse,
            image_lock: false,
            decided_map: false,
            handover: false,
        };
        let mut json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            serde_json::from_value::<WorkerSpec>(json.clone()).unwrap(),
            spec
        );
        json["from_the_future"] = true.into();
        let e = serde_json::from_value::<WorkerSpec>(json).unwrap_err();
        assert!(
            e.to_string().contains("unknown field `from_the_future`"),
            "{e}"
        );
    }

    #[test]
    fn a_decided_map_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let map = ExtentMap {
            size: 4096,
            fs_device: blockplane_system::extent::DevNum { major: 7, minor: 1 },
            devices: Vec::new(),
            segments: Vec::new(),
        };
        put_decided_map(dir.path(), &map).unwrap();
        assert_eq!(take_decided_map(dir.path()).unwrap(), map);
        // Gone once taken: a replacement worker never checks a stale one.
        assert!(take_decided_map(dir.path()).is_err());
    }
}
