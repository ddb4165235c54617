//! What the control plane and a worker say to each other: the worker's launch
//! spec, and one JSON request / one JSON answer per line on the worker's
//! control socket. Both sides use these types; nothing else crosses.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use blockplane_api::model::{ActiveDispatch, Allocation, DispatchPolicy, OpStats, Qos};
use blockplane_system::extent::{ExtentMap, Pin};

/// The file descriptor number the image is handed to a worker on.
pub const IMAGE_FD: i32 = 3;

/// The file descriptor number the control plane's image lock is handed to a
/// worker on (when [`WorkerSpec::image_lock`]): an open file description
/// that holds an OFD lock on the image, shared with the control plane, so
/// the lock lasts while either of them lives.
pub const LOCK_FD: i32 = 4;

/// How a worker is to serve its volume (passed as JSON on its command line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
}

/// Why a worker of a volume created read-only cannot fill its image.
pub const CANNOT_FILL_READ_ONLY: &str = "the volume was created read-only: its worker holds the image read-only and cannot write zeros into it; detach it first";

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

/// A request on the control socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Identity and state.
    Status,
    /// Counters and latency percentiles.
    Stats,
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
    CancelAllocate,
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
    /// Stop and delete the device (in-flight I/O ends with errors), unpin the
    /// image, exit.
    Shutdown,
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
}

/// Where a worker's fill ([`Request::Allocate`]) is.
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

/// A fill's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FillState {
    /// Writing zeros now.
    Running,
    /// Every hole and unwritten extent is written: the image is `full`.
    Done,
    /// Stopped by an error ([`Fill::error`]).
    Failed,
    /// Stopped by [`Request::CancelAllocate`].
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
    /// A [`Request::Snapshot`] made: how long the queues were held, µs.
    Snapshot {
        /// Microseconds the queues were held.
        held_us: u64,
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

/// Sends one request and reads one answer (a fresh connection each time).
pub fn talk(socket: &Path, req: &Request, timeout: Duration) -> Result<Answer, TalkError> {
    let io = |source| TalkError::Io {
        path: socket.display().to_string(),
        source,
    };
    let mut s = UnixStream::connect(socket).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let mut line = serde_json::to_string(req).expect("requests serialize");
    line.push('\n');
    s.write_all(line.as_bytes()).map_err(io)?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).map_err(io)?;
    serde_json::from_str(&answer).map_err(|e| TalkError::Garbled(format!("{e}: {answer:?}")))
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
