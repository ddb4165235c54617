//! Volumes that leave their host: a volume exported over NVMe/TCP through
//! the kernel's target (`/v1/volumes/{id}/export`), and on the consuming
//! host, a remote volume connected to another host's export
//! (`/v1/remotes`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

/// How the hosts of an export prove who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ExportAuth {
    /// DH-HMAC-CHAP, both ways: each host proves its key to the target and
    /// the target its controller key to the host.
    #[default]
    Dhchap,
    /// None: any host that reaches the address connects. Refused unless
    /// every export address of the service is a loopback address and the
    /// request says `insecure_loopback: true`.
    None,
}

/// `PUT /v1/volumes/{id}/export`: export a volume, or change its export.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExportRequest {
    /// The host NQNs allowed to connect (each consuming service's
    /// `fabric.host_nqn` in `GET /v1/host`); empty only with `auth: none`.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Export it read-only: refused (`export_read_only`), as is an export
    /// of a read-only volume: the kernel's NVMe target serves namespaces
    /// read-write only. Make the remote volume read-only on the consuming
    /// host instead.
    #[serde(default)]
    pub read_only: bool,
    /// How hosts authenticate.
    #[serde(default)]
    pub auth: ExportAuth,
    /// Says yes to `auth: none` on loopback addresses.
    #[serde(default)]
    pub insecure_loopback: bool,
}

/// `DELETE /v1/volumes/{id}/export` query.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
pub struct DeleteExportQuery {
    /// Remove it even though hosts are (or may be) connected: their I/O
    /// to it fails.
    #[serde(default)]
    pub force: bool,
}

/// A host allowed to connect to an export.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExportHost {
    /// The host's NQN.
    pub host_nqn: String,
    /// Whether a controller of this host is connected now; `null` where the
    /// kernel cannot tell (it says so on kernels with nvmet's debugfs).
    pub connected: Option<bool>,
    /// The key the host proves (`DHHC-1:…`), only in the answer to a
    /// `PUT` of the export; absent everywhere else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// The key the target proves to the host, as `secret`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctrl_secret: Option<String>,
}

/// Whether an export serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ExportState {
    /// The kernel's target serves the volume's device on every address.
    Serving,
    /// The volume has no device now (it is not attached): the export
    /// serves again once it has.
    Waiting,
    /// The kernel refused the export; `state_reason` says why.
    Error,
}

/// A volume's export over NVMe/TCP.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Export {
    /// The exported volume's id.
    pub volume_id: Uuid,
    /// Its name.
    pub volume_name: String,
    /// The subsystem's NQN: what a remote volume connects to.
    pub nqn: String,
    /// Where it listens: `ip:port`, the service's export addresses.
    pub addresses: Vec<String>,
    /// Whether hosts may only read.
    pub read_only: bool,
    /// How hosts authenticate.
    pub auth: ExportAuth,
    /// The hosts allowed.
    pub hosts: Vec<ExportHost>,
    /// Whether it serves.
    pub state: ExportState,
    /// Why it is in its state, when that needs saying.
    pub state_reason: Option<String>,
    /// A move of the volume's data to another host, as that host last
    /// said.
    pub moving: Option<super::ExportMove>,
    /// When it was made.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// A subsystem or host NQN: `nqn.`, then printable ASCII but `/` and `,`
/// (a path separator, the initiator's option separator), 223 bytes in all.
pub const NQN_PATTERN: &str = "^nqn\\.[!-+\\-.0-~]{0,219}$";

/// `POST /v1/remotes`: connect to another host's export.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CreateRemoteRequest {
    /// Unique name: `[a-z0-9][a-z0-9._-]{0,62}`.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub name: String,
    /// The exporting host's address, `ip:port` (port 4420 when left out;
    /// an IPv6 address in brackets, its eight groups written out).
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^(((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])|\\[([0-9a-f]{1,4}:){7}[0-9a-f]{1,4}\\])(:([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?$"
        )
    )]
    pub address: String,
    /// The export's NQN (`nqn` of its `Export`).
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^nqn\\.[!-+\\-.0-~]{0,219}$", max_length = 223)
    )]
    pub nqn: String,
    /// This host's key, as the export's `PUT` answered it (`DHHC-1:`, a
    /// two-digit hash id, the base64 of a 32, 48 or 64-byte key and its
    /// CRC-32, `:`; a key failing its checksum is `invalid_key`); `null`
    /// for an export with `auth: none`.
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^DHHC-1:0[0-3]:([A-Za-z0-9+/]{48}|[A-Za-z0-9+/]{70}==|[A-Za-z0-9+/]{91}=):$"
        )
    )]
    pub secret: Option<String>,
    /// The target's key, as the export's `PUT` answered it.
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^DHHC-1:0[0-3]:([A-Za-z0-9+/]{48}|[A-Za-z0-9+/]{70}==|[A-Za-z0-9+/]{91}=):$"
        )
    )]
    pub ctrl_secret: Option<String>,
    /// Refuse writes on this host.
    #[serde(default)]
    pub read_only: bool,
}

/// `POST /v1/export-hosts/{host_nqn}/rotate`: a host's new key, for every
/// export that allows it. The kernel takes it without dropping the host's
/// connections; give it to the host's remote volumes
/// (`PATCH /v1/remotes/{id}` with `secret`) before it reconnects, or its
/// next connect is refused. The controller key stays: the kernel
/// re-authenticates a live connection at each key written, with both
/// keys, so changing both would fail between the two writes.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExportHostKeys {
    /// The host's NQN.
    pub host_nqn: String,
    /// The key the host proves (`DHHC-1:…`), new.
    pub secret: String,
    /// The NQNs of the exports that allow it.
    pub exports: Vec<String>,
}

/// `PATCH /v1/remotes/{id}`: what changes live on a remote volume.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PatchRemoteRequest {
    /// Refuse writes on this host (`false`: allow them again).
    #[serde(default)]
    pub read_only: Option<bool>,
    /// This host's new key, after the exporting host rotated it: the
    /// connection re-authenticates with it, without a disconnect.
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^DHHC-1:0[0-3]:([A-Za-z0-9+/]{48}|[A-Za-z0-9+/]{70}==|[A-Za-z0-9+/]{91}=):$"
        )
    )]
    pub secret: Option<String>,
    /// Refused: a remote volume's data path is its exporting host's.
    #[serde(default)]
    pub dispatch: Option<serde_json::Value>,
    /// Refused: a remote volume's limits are its exporting host's.
    #[serde(default)]
    pub qos: Option<serde_json::Value>,
}

/// A remote volume's life-cycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum RemoteState {
    /// Being connected.
    Connecting,
    /// Connected; its device serves.
    Attached,
    /// The connection is lost and the kernel reconnects: I/O waits.
    Reconnecting,
    /// The connection is gone (past the loss timeout, or refused).
    Error,
    /// Its data moved to this host (a move): its device serves the local
    /// volume `volume`, nothing crosses the network any more.
    Moved,
}

/// A volume of another host, connected over NVMe/TCP.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Remote {
    /// Stable id.
    pub id: Uuid,
    /// Unique name.
    pub name: String,
    /// The exporting host's address.
    pub address: String,
    /// The export's NQN.
    pub nqn: String,
    /// Its state.
    pub state: RemoteState,
    /// Why, when that needs saying.
    pub state_reason: Option<String>,
    /// The device to use: a dm node (`blockplane-remote-<id>`) over the
    /// NVMe namespace, `/dev/mapper/…` where udev made it, else
    /// `/dev/dm-N`; it stays while the connection under it changes.
    pub device: Option<String>,
    /// The NVMe namespace under it (`/dev/nvmeXnY`).
    pub nvme_device: Option<String>,
    /// Size, bytes (as the exporting host serves it).
    pub size_bytes: u64,
    /// Whether this host refuses writes to it.
    pub read_only: bool,
    /// The move bringing its data here, or that brought it.
    pub move_id: Option<Uuid>,
    /// The local volume its device serves once its data moved here.
    pub volume: Option<Uuid>,
    /// When it was made.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// This host as an NVMe/TCP party (`GET /v1/host`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Fabric {
    /// This service's host NQN: what an exporting host allows
    /// (`hosts` of an `ExportRequest`). Made once and kept.
    pub host_nqn: String,
    /// Where this service's exports listen (`--export-address`); empty:
    /// exports are refused.
    pub export_addresses: Vec<String>,
    /// Whether the kernel's NVMe target can serve here, and why not.
    pub target: super::Capability,
    /// Whether the kernel's NVMe/TCP initiator can connect here, and why not.
    pub initiator: super::Capability,
}

impl ExportAuth {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ExportAuth::Dhchap => "dhchap",
            ExportAuth::None => "none",
        }
    }
}

impl ExportState {
    /// The API spelling (also the metrics' `state` label).
    pub fn as_str(self) -> &'static str {
        match self {
            ExportState::Serving => "serving",
            ExportState::Waiting => "waiting",
            ExportState::Error => "error",
        }
    }
}

impl RemoteState {
    /// The API spelling (also the metrics' `state` label).
    pub fn as_str(self) -> &'static str {
        match self {
            RemoteState::Connecting => "connecting",
            RemoteState::Attached => "attached",
            RemoteState::Reconnecting => "reconnecting",
            RemoteState::Error => "error",
            RemoteState::Moved => "moved",
        }
    }
}
