//! Handing a volume over to a new worker (`POST /v1/volumes/{id}/handover`,
//! `blockplane upgrade`): the device stays, its server changes.

use serde::{Deserialize, Serialize};

use super::volume::Volume;

/// How the old worker let go of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum HandoverMethod {
    /// `UBLK_F_QUIESCE` (kernel 6.16+, on a device created with it): the
    /// kernel let the requests inside finish, queued the new ones and
    /// released the worker's queues.
    Quiesce,
    /// The worker held its queues until no request was inside its data path,
    /// then exited; the kernel requeued the requests it held
    /// (`UBLK_F_USER_RECOVERY_REISSUE`) for the new worker.
    Drain,
    /// A worker from before the handover (protocol 1) was stopped with
    /// SIGKILL, as in a crash; the kernel reissued what it held.
    Stop,
}

impl HandoverMethod {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoverMethod::Quiesce => "quiesce",
            HandoverMethod::Drain => "drain",
            HandoverMethod::Stop => "stop",
        }
    }
}

/// `POST /v1/volumes/{id}/handover`: the volume on its new worker.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Handover {
    /// The volume as it is now, served by the new worker.
    pub volume: Volume,
    /// The worker that served it before.
    pub previous_worker_pid: u32,
    /// Its build (`unknown`: a worker from before versions).
    pub previous_worker_version: String,
    /// The worker that serves it now.
    pub worker_pid: u32,
    /// Its build: the service's.
    pub worker_version: String,
    /// How the old worker let go.
    pub method: HandoverMethod,
    /// Milliseconds from asking the old worker to let go to the new one
    /// serving: at most how long the device's I/O waited.
    pub took_ms: u64,
}
