//! A worker's launch: the spec on its command line and the descriptors it
//! is handed.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use blockplane_system::dispatch::Reason;
use blockplane_system::extent::Pin;

use crate::terms::{Allocation, DataPath, Limits};

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
    /// The data path to start on.
    pub dispatch: DataPath,
    /// Why that policy, in words.
    pub dispatch_reason: String,
    /// Why that policy (reported back as the volume's dispatch reason;
    /// protocol 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_why: Option<Reason>,
    /// Queues to ask the kernel for (each on a thread of its own).
    pub queues: u16,
    /// Requests in flight per queue.
    pub queue_depth: u16,
    /// Largest request, bytes (the device's max sectors * 512).
    pub max_io_bytes: u32,
    /// Threads of the `threaded` policy's pool.
    pub threads: u16,
    /// IOPS and bandwidth limits (none: unlimited).
    pub qos: Option<Limits>,
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
    /// from ([`DECIDED_MAP`](crate::DECIDED_MAP); a map can be too large for a command line):
    /// the worker pins the image and checks it still maps that way, instead
    /// of reading the map before the pin too. Only a first start has one.
    #[serde(default)]
    pub decided_map: bool,
    /// With `recover_dev_id`: the device is taken over from a worker that
    /// handed it over ([`Request::Handover`](crate::Request::Handover)), not from one that crashed,
    /// so `worker_restarts` does not count it; the worker waits on
    /// [`GO_FD`] for the word to take it.
    #[serde(default)]
    pub handover: bool,
}

impl WorkerSpec {
    /// Why the worker starts on its policy: the type, or what the words of
    /// a spec before protocol 4 say.
    pub fn reason(&self) -> Reason {
        Reason::carried(self.dispatch_why.clone(), &self.dispatch_reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            dispatch: DataPath::Nowait,
            dispatch_reason: "asked".into(),
            dispatch_why: None,
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
}
