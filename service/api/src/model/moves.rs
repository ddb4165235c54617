//! Moves: a remote volume's data brought to this host while its consumer
//! keeps its device (`/v1/remotes/{id}/move`), or another host's volume
//! that no consumer here uses brought over (`POST /v1/moves`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

/// `POST /v1/remotes/{id}/move`: bring a remote volume's data here.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StartMoveRequest {
    /// Name of the image the data moves into, made by the move on this
    /// host (`[a-z0-9][a-z0-9._-]{0,62}`); a volume of the same name
    /// serves it once the move is done.
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^[a-z0-9][a-z0-9._-]{0,62}$",
            min_length = 1,
            max_length = 63
        )
    )]
    pub image: String,
    /// Where that image's file goes: an absolute path under one of this
    /// service's image roots; it must not exist.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 4095))]
    pub path: String,
    /// The exporting host's API (`http://host:port`), told once the data is
    /// here to let its export go and to delete its volume. This service
    /// calls it with its own bearer token: hosts that move volumes between
    /// them share one.
    #[cfg_attr(
        feature = "openapi",
        schema(
            min_length = 1,
            max_length = 255,
            pattern = "^(unix:.*|(http://)?[^/]*:[^/]*/*)$"
        )
    )]
    pub source_api: String,
    /// Keep the exporting host's image when its volume goes (default: the
    /// image is deleted with it).
    #[serde(default)]
    pub keep_source_image: bool,
    /// Bytes per second the background copy may read, at most (rounded up
    /// to KiB); 0 or absent: as fast as the kernel goes.
    #[serde(default)]
    pub rate_limit_bytes_per_sec: u64,
    /// Encrypt the local image (LUKS2) with this key, its first key slot:
    /// required when the exporting host's volume is encrypted, whose data
    /// would otherwise rest here in plaintext (422 `key_required`). Never
    /// stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<super::Key>,
}

/// `POST /v1/moves`: bring another host's volume here, cold: no consumer
/// here uses it. This host connects to the volume's export (asking the
/// exporting host to allow it, or to export the volume), copies it as a
/// live move does, and deletes the remote volume it made at the end: the
/// data is then served by the local volume alone.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ColdMoveRequest {
    /// The exporting host's API (`http://host:port`), called with this
    /// service's own bearer token: hosts that move volumes between them
    /// share one.
    #[cfg_attr(
        feature = "openapi",
        schema(
            min_length = 1,
            max_length = 255,
            pattern = "^(unix:.*|(http://)?[^/]*:[^/]*/*)$"
        )
    )]
    pub source_api: String,
    /// The volume on the exporting host, by name or id.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 63))]
    pub volume: String,
    /// Name of the image the data moves into, made here; also the name of
    /// the remote volume the move connects meanwhile, and of the local
    /// volume once the move is done (`[a-z0-9][a-z0-9._-]{0,62}`).
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^[a-z0-9][a-z0-9._-]{0,62}$",
            min_length = 1,
            max_length = 63
        )
    )]
    pub image: String,
    /// Where that image's file goes: an absolute path under one of this
    /// service's image roots; it must not exist.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 4095))]
    pub path: String,
    /// Keep the exporting host's image when its volume goes.
    #[serde(default)]
    pub keep_source_image: bool,
    /// Bytes per second the copy may read, at most; 0: no limit.
    #[serde(default)]
    pub rate_limit_bytes_per_sec: u64,
    /// The local image's key: required when the exporting host's volume is
    /// encrypted. Never stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<super::Key>,
}

/// `POST /v1/drains`: bring several of another host's volumes here at
/// once, under one rate limit (draining that host). A volume this host
/// has connected as a remote volume moves live under its consumer; any
/// other moves cold. Each goes into an image named after the volume, its
/// file in `dir`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DrainRequest {
    /// The exporting host's API (`http://host:port`), called with this
    /// service's own bearer token.
    #[cfg_attr(
        feature = "openapi",
        schema(
            min_length = 1,
            max_length = 255,
            pattern = "^(unix:.*|(http://)?[^/]*:[^/]*/*)$"
        )
    )]
    pub source_api: String,
    /// The volumes on the exporting host, by name; empty or absent: every
    /// volume it has.
    #[serde(default)]
    pub volumes: Vec<String>,
    /// The directory the images' files go into, under one of this
    /// service's image roots (each `<volume>.img`, which must not exist).
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 4000))]
    pub dir: String,
    /// Keep the exporting host's images when its volumes go.
    #[serde(default)]
    pub keep_source_images: bool,
    /// Bytes per second the drain's copies may read in all, shared evenly
    /// among the moves that copy (each at least 1 KiB/s); 0: no limit.
    #[serde(default)]
    pub rate_limit_bytes_per_sec: u64,
}

/// A drain: several moves under one rate limit.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Drain {
    /// Stable id.
    pub id: Uuid,
    /// The exporting host's API.
    pub source_api: String,
    /// The rate limit its copies share; 0: none.
    pub rate_limit_bytes_per_sec: u64,
    /// Bytes copied so far, over its moves.
    pub synced_bytes: u64,
    /// Bytes to copy in all.
    pub total_bytes: u64,
    /// Its moves, each with its share of the limit.
    pub moves: Vec<Move>,
    /// When it started.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// `PATCH /v1/drains/{id}`: change the rate limit a drain's moves share.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PatchDrainRequest {
    /// Bytes per second its copies may read in all; 0: no limit.
    pub rate_limit_bytes_per_sec: u64,
}

/// What a cold move did to the exporting host's export to connect to it:
/// undone when the move does not end `done` (when it does, the export goes
/// with the volume).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ColdExport {
    /// The volume had no export: the move made it (deleted if it stops).
    Made,
    /// The export did not allow this host: the move added it (removed if
    /// it stops).
    HostAdded,
    /// The export allowed this host already: nothing to undo.
    HostAllowed,
}

/// `PATCH /v1/moves/{id}`: change a running move's rate limit. The mirror
/// is loaded again with it, and the copy goes on from the progress its
/// metadata legs record.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PatchMoveRequest {
    /// Bytes per second the background copy may read, at most; 0: no limit.
    pub rate_limit_bytes_per_sec: u64,
}

/// Where a move is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum MoveState {
    /// The consumer's node mirrors the remote device and the local volume;
    /// the local leg is being copied from the remote one, every write goes
    /// to both.
    Syncing,
    /// The local leg holds everything: the node maps the local volume
    /// alone; the exporting host is being told to let its volume go.
    Releasing,
    /// The data is here: the node serves the local volume, and the
    /// exporting host has let its export and volume go.
    Done,
    /// Cancelled: the node serves the remote device again, the local
    /// image is gone.
    Cancelled,
    /// Stopped by a fault (`state_reason`): the node serves the remote
    /// device again where it still can, and nothing acknowledged is lost.
    Failed,
}

impl MoveState {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            MoveState::Syncing => "syncing",
            MoveState::Releasing => "releasing",
            MoveState::Done => "done",
            MoveState::Cancelled => "cancelled",
            MoveState::Failed => "failed",
        }
    }

    /// Whether the move has ended (done, cancelled or failed).
    pub fn ended(self) -> bool {
        matches!(
            self,
            MoveState::Done | MoveState::Cancelled | MoveState::Failed
        )
    }
}

/// A move of a remote volume's data to this host.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Move {
    /// Stable id.
    pub id: Uuid,
    /// The remote volume whose data moves (its node is the consumer's
    /// device throughout).
    pub remote: Uuid,
    /// That remote volume's name.
    pub remote_name: String,
    /// The local image the data moves into.
    pub image: String,
    /// The local volume serving that image (the node's local leg), once
    /// made.
    pub volume: Option<Uuid>,
    /// The exporting host's API.
    pub source_api: String,
    /// The volume on the exporting host.
    pub source_volume: String,
    /// Whether the exporting host keeps its image.
    pub keep_source_image: bool,
    /// Where the move is.
    pub state: MoveState,
    /// Why, when that needs saying.
    pub state_reason: Option<String>,
    /// Bytes of the local leg copied so far.
    pub synced_bytes: u64,
    /// Bytes to copy in all.
    pub total_bytes: u64,
    /// The copy's rate over the last second, bytes per second.
    pub rate_bytes_per_sec: u64,
    /// The rate limit; 0: none.
    pub rate_limit_bytes_per_sec: u64,
    /// When it started.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When it ended.
    #[serde(with = "time::serde::rfc3339::option")]
    pub finished_at: Option<OffsetDateTime>,
    /// A cold move (`POST /v1/moves`): what it did to the exporting host's
    /// export. Its remote volume is its own, deleted when it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold: Option<ColdExport>,
    /// The drain it is part of (`GET /v1/drains/{id}`): its rate limit is
    /// its share of the drain's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<Uuid>,
}

/// What the host orchestrating a move says of it to the exporting host
/// (`PUT /v1/volumes/{id}/export/move`), shown with the export there.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExportMove {
    /// The move's id on the orchestrating host.
    pub move_id: Uuid,
    /// The orchestrating host's NQN (where the data goes).
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^nqn\\.[!-+\\-.0-~]{0,219}$", max_length = 223)
    )]
    pub host_nqn: String,
    /// Where the move is.
    pub state: MoveState,
    /// Bytes copied so far.
    pub synced_bytes: u64,
    /// Bytes to copy in all.
    pub total_bytes: u64,
    /// When the orchestrating host said so: an older word never replaces a
    /// newer one.
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
}
