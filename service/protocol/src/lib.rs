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
//!
//! The crate is the contract alone, so each side links only what it speaks:
//! the server does not link the worker (libublk, io-uring), and the worker
//! does not link the public API. Its words ([`terms`]) are its own; the
//! server converts the API's at its end.
//!
//! - [`spec`]: the launch spec and the descriptors a worker is handed;
//! - [`messages`]: the requests and answers of the control socket;
//! - [`talk`]: one connection's handshake, request and answer, both sides;
//! - [`run_dir`]: the files a worker leaves in its run dir (state, decided
//!   map) and [`stats_file`], the counters it keeps there.

pub mod messages;
pub mod run_dir;
pub mod spec;
pub mod stats_file;
pub mod talk;
pub mod terms;

pub use blockplane_system::dispatch::Reason;
pub use messages::{
    Answer, CANNOT_FILL_READ_ONLY, COPY_RUNS_DIRECT, COPY_RUNS_HANDOVER, ErrorCode, Fill,
    FillState, Latency, PROTOCOL, Peer, Request, SNAPSHOT_OF_DIRECT, Status, WorkerStats,
};
pub use run_dir::{DECIDED_MAP, STATE_FILE, StateFile, put_decided_map, take_decided_map};
pub use spec::{GO_FD, GO_READY, GO_TAKE, IMAGE_FD, LOCK_FD, WorkerSpec};
pub use stats_file::{STATS_FILE, completed_per_queue, read_counters};
pub use talk::{TalkError, converse, read_request, serve_connection, talk, worker_spec};
pub use terms::{
    Allocation, DataPath, HandoverMethod, Histogram, LATENCY_BOUNDS_US, Limits, OpCounts,
};
