//! Whether a volume is in use, and by what (`/v1/volumes/{id}/usage`).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A process that holds a volume's device open.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceOpener {
    /// The process id.
    pub pid: u32,
    /// The process's command name (`/proc/PID/comm`).
    pub command: String,
}

/// `GET /v1/volumes/{id}/usage`: whether a volume is in use now and by
/// what, so that a delete can say so and ask for more than a click.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeUsage {
    /// The volume's id.
    pub volume_id: Uuid,
    /// The volume's name.
    pub name: String,
    /// Its device node; `null` while there is none.
    pub device: Option<String>,
    /// Open by a process, mounted, with requests in flight, or with I/O in
    /// the last `recent_secs` seconds.
    pub busy: bool,
    /// Processes holding the device open, from `/proc/*/fd` (the service's
    /// own ublk worker is not listed).
    pub openers: Vec<DeviceOpener>,
    /// Where the device is mounted, in the service's mount namespace.
    pub mounts: Vec<String>,
    /// Seconds of history `iops` and `bytes_per_sec` are the mean of.
    pub recent_secs: u32,
    /// Requests a second, over the last `recent_secs`.
    pub iops: f64,
    /// Bytes a second, over the last `recent_secs`.
    pub bytes_per_sec: f64,
    /// Requests in flight at the last sample.
    pub in_flight: u64,
    /// Why the volume is busy, one sentence per cause; empty when idle.
    pub reasons: Vec<String>,
}
