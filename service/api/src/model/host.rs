//! What this host can run, its image roots and orphan devices (`/v1/host`),
//! and the service's liveness (`/healthz`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::backend::Backend;

/// Whether a backend or policy can run on this host, and why not.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Capability {
    /// Whether it can run here.
    pub available: bool,
    /// Why it is not available (`null` when it is).
    pub reason: Option<String>,
}

/// The ublk driver's features as the kernel reports them.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UblkFeatures {
    /// The raw `UBLK_U_CMD_GET_FEATURES` bitmask.
    pub mask: u64,
    /// Names of the known bits that are set.
    pub names: Vec<String>,
}

/// One backend's availability on this host.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BackendCapability {
    /// Whether it can run here.
    pub available: bool,
    /// Why it is not available (`null` when it is).
    pub reason: Option<String>,
    /// ublk only.
    pub features: Option<UblkFeatures>,
    /// dm only: the target types the kernel has loaded (DM_LIST_VERSIONS).
    pub targets: Option<Vec<String>>,
    /// dm only: whether the kernel offers a native `loop` target (blockplane
    /// still maps with `linear` tables).
    pub native_loop_target: Option<bool>,
}

/// Backends on this host.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HostBackends {
    /// The kernel loop driver.
    #[serde(rename = "loop")]
    pub loop_: BackendCapability,
    /// ublk, served by blockplane's workers.
    pub ublk: BackendCapability,
    /// device-mapper.
    pub dm: BackendCapability,
}

/// Dispatch policies on this host.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HostPolicies {
    /// io_uring with `RWF_NOWAIT` (ublk).
    pub nowait: Capability,
    /// Blocking worker threads (ublk).
    pub threaded: Capability,
    /// The image's extent map, straight to the disk (ublk, dm).
    pub direct: Capability,
}

/// `GET /v1/host`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Host {
    /// `uname -r`.
    pub kernel: String,
    /// blockplane's version (the crate's).
    pub version: String,
    /// The service's build, and the file at its path now.
    pub build: ServiceBuild,
    /// Each backend, and whether it can run here.
    pub backends: HostBackends,
    /// Each dispatch policy, and whether it can run here.
    pub policies: HostPolicies,
    /// The directories images may live under.
    pub image_roots: Vec<String>,
    /// Each image root's filesystem: size and free space.
    pub image_root_capacity: Vec<RootCapacity>,
    /// The backend `backend: auto` picks here for an image dm does not map
    /// `direct` (one it maps, with `dispatch: auto` and no QoS, gets dm).
    pub default_backend: Option<Backend>,
    /// Devices of this service with no volume: left alone until
    /// `DELETE /v1/host/orphans/{volume_id}`.
    pub orphans: Vec<Orphan>,
    /// Where backups go (`--backup-target`), without credentials: `dir:PATH`
    /// or `s3://BUCKET/PREFIX …`; `null`: backups are refused.
    #[serde(default)]
    pub backup_target: Option<String>,
    /// Whether the supervisor of ublk workers runs: the thread that
    /// recovers a worker that dies (`null`: this build has no ublk backend).
    #[serde(default)]
    pub supervision: Option<Supervision>,
    /// Whether the service's start has matched the registry with the
    /// kernel: every volume (until then, those not reached show
    /// `recovering`), then the orphan devices. The API answers meanwhile.
    #[serde(default = "reconciled_before_answering")]
    pub reconciled: bool,
    /// Volumes the service has not matched with the kernel since it started
    /// (each shows `recovering`).
    #[serde(default)]
    pub recovering_volumes: usize,
    /// This host as an NVMe/TCP party: its host NQN, its export addresses
    /// and what the kernel can do (`null` from a service before exports).
    #[serde(default)]
    pub fabric: Option<super::Fabric>,
}

/// A service before `reconciled` answered only once it had reconciled.
fn reconciled_before_answering() -> bool {
    true
}

/// Whether the supervisor of ublk workers runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SupervisionState {
    /// Not started yet: the service is starting.
    Starting,
    /// It watches every worker: one that dies is recovered.
    Running,
    /// It stopped or could not start (`reason`), and is started again after
    /// a backoff; meanwhile a worker that dies is not recovered.
    Restarting,
}

/// The supervisor of ublk workers (`GET /v1/host`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Supervision {
    /// Whether it runs.
    pub state: SupervisionState,
    /// Why it does not run (`null` while it runs).
    pub reason: Option<String>,
    /// Since when it is in this state.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub since: OffsetDateTime,
    /// Times it stopped or could not start since the service started.
    pub restarts: u64,
    /// Workers it does not watch now although it runs (a pidfd it could not
    /// open, a recovery that could not start: both tried again); each such
    /// volume says why in its `state_reason`.
    pub unsupervised_workers: u64,
}

/// The build the service runs, and the file at the path it was started
/// from: a package upgrade replaces that file while the service runs on.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceBuild {
    /// `<version>+<build>`: the crate version, then the git commit it was
    /// built from (when built from a checkout) and the linker's build-id.
    /// Workers of the same build report the same string.
    pub version: String,
    /// The path the service was started from.
    pub executable: String,
    /// The build of the file at that path now (`null`: none, or unreadable).
    pub executable_version: Option<String>,
    /// The file at the path is another build than the one running (or is
    /// gone): a restart of the service runs what is there. New workers (replacements, handovers)
    /// still run the service's own build, started from the file it started
    /// from, which it keeps open.
    pub executable_replaced: bool,
}

/// Size and free space of an image root's filesystem.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RootCapacity {
    /// The image root.
    pub path: String,
    /// Size of its filesystem, bytes.
    pub size_bytes: u64,
    /// Bytes free to an unprivileged writer (`df`'s "Avail").
    pub free_bytes: u64,
    /// Images registered under this root.
    pub images: u64,
    /// Their sizes added up: what their volumes may come to hold.
    pub provisioned_bytes: u64,
    /// What the filesystem allocated to them.
    pub allocated_bytes: u64,
    /// The service's limit on `provisioned_bytes / size_bytes`, if set
    /// (`--max-overcommit`).
    pub max_overcommit: Option<f64>,
}

/// A device blockplane made that belongs to no volume of this service.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Orphan {
    /// The kind of device.
    pub backend: Backend,
    /// The volume id in its mark, if it carries one.
    pub volume_id: Option<Uuid>,
    /// Its device node, e.g. `/dev/loop3`.
    pub device: String,
    /// The file it serves, when known (loop devices, ublk devices whose
    /// worker runs).
    pub backing_file: Option<String>,
    /// The blockplane instance in its mark, if it carries one.
    pub instance: Option<String>,
    /// The worker serving it (ublk), while it runs.
    pub pid: Option<u32>,
    /// Why it is an orphan.
    pub reason: String,
    /// Whether `DELETE /v1/host/orphans/{volume_id}` removes it: only devices
    /// carrying this service's own mark; others are left to the operator.
    pub removable: bool,
}

/// `GET /healthz`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// Always `ok` when the service answers.
    pub status: String,
}
