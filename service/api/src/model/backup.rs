//! Backups: an image's bytes at one moment, stored off the host on the
//! service's backup target as content-addressed chunks and a manifest
//! (`/v1/images/{id}/backups`, `/v1/backups`), and restored into a new image
//! (`restore_from` of `POST /v1/images`) by this service or any other
//! pointed at the same target.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

/// `POST /v1/images/{id}/backups`: back an image up.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateBackupRequest {
    /// A name for people, unique among the image's backups on the target:
    /// `[a-z0-9][a-z0-9._-]{0,62}`
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^[a-z0-9][a-z0-9._-]{0,62}$",
            min_length = 1,
            max_length = 63
        )
    )]
    pub name: String,
}

/// Where a backup is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum BackupState {
    /// Its chunks are being stored (`done_bytes` of `total_bytes`); it has
    /// no manifest yet, so nothing can restore it.
    Running,
    /// Its manifest is on the target: it can be restored.
    Done,
    /// It stopped on an error (`error`); nothing of it can be restored, and
    /// the chunks it stored are collected unless another backup uses them.
    Failed,
    /// Stopped by `DELETE /v1/backups/{id}` (or the service's stop).
    Cancelled,
}

impl BackupState {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            BackupState::Running => "running",
            BackupState::Done => "done",
            BackupState::Failed => "failed",
            BackupState::Cancelled => "cancelled",
        }
    }
}

/// A backup: finished ones are read from the target's manifests, so every
/// service pointed at it lists the same; a running, failed or cancelled one
/// is this service's own since it started.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Backup {
    /// Stable id.
    pub id: Uuid,
    /// Its name.
    pub name: String,
    /// Where it is.
    pub state: BackupState,
    /// The image backed up (it may be gone, or another service's).
    pub image_id: Uuid,
    /// That image's name when it was backed up.
    pub image_name: String,
    /// The image's size: a restore makes a file this large.
    pub size_bytes: u64,
    /// The image was encrypted (LUKS2): its header is in the backup, and
    /// the restored image opens with the same keys.
    pub encrypted: bool,
    /// The moment its bytes are of.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    /// When its manifest was stored (`done` only).
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub finished_at: Option<OffsetDateTime>,
    /// Chunks holding data (chunks of zeros are not stored).
    pub chunks: u64,
    /// Bytes of those chunks.
    pub stored_bytes: u64,
    /// Bytes this backup put on the target (chunks it lacked).
    pub uploaded_bytes: u64,
    /// Bytes of chunks the target had already (from this image's earlier
    /// backups or another image's), not put again.
    pub deduplicated_bytes: u64,
    /// Data bytes read so far (`running`).
    #[serde(default)]
    pub done_bytes: Option<u64>,
    /// Data bytes to read (`running`).
    #[serde(default)]
    pub total_bytes: Option<u64>,
    /// Why it failed.
    #[serde(default)]
    pub error: Option<String>,
    /// The host and service that made it.
    pub source_host: String,
    /// The blockplane version that made it.
    pub blockplane_version: String,
}

/// `GET /v1/backups` filters.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
pub struct ListBackupsQuery {
    /// Only the backups of this image: its id, or its name (a registered
    /// image's, else the name it had when backed up).
    #[serde(default)]
    pub image: Option<String>,
}

/// A chunk a verify or restore found wrong.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BadChunk {
    /// Its index in the image (its offset over the chunk size).
    pub index: u64,
    /// Its offset in the image, bytes.
    pub offset: u64,
    /// Its BLAKE3 hash, the name it is stored under.
    pub hash: String,
}

/// What `POST /v1/backups/{id}/verify` found: every chunk read back and its
/// hash checked, nothing written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BackupVerify {
    /// The backup.
    pub backup_id: Uuid,
    /// Every chunk is there and hashes right.
    pub ok: bool,
    /// Chunks checked.
    pub chunks: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Chunks the target lacks.
    pub missing: Vec<BadChunk>,
    /// Chunks whose bytes do not hash to their name.
    pub corrupt: Vec<BadChunk>,
}

/// What a garbage collection of the target did (`POST /v1/backups/gc`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BackupGc {
    /// Chunks a manifest, or a backup running on any service, may need.
    pub chunks_kept: u64,
    /// Chunks removed: no manifest referenced them.
    pub chunks_deleted: u64,
    /// Their bytes.
    pub bytes_deleted: u64,
    /// Backups running on the target while it ran (their chunks were kept).
    pub running_backups: u64,
}

/// A retention policy: which of an image's finished backups to keep, as
/// Proxmox Backup Server's prune decides: the last N, then the newest
/// backup of each of the last N days, ISO weeks, months and years that have
/// one (UTC), a period an earlier rule kept a backup in not counted again.
/// A backup no rule keeps is deleted. At least one count must be above 0,
/// and none above [`MAX_KEEP`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RetentionPolicy {
    /// The newest backups to keep, whatever their dates.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(maximum = 10000))]
    pub keep_last: u32,
    /// Days whose newest backup is kept.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(maximum = 10000))]
    pub keep_daily: u32,
    /// ISO weeks whose newest backup is kept.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(maximum = 10000))]
    pub keep_weekly: u32,
    /// Months whose newest backup is kept.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(maximum = 10000))]
    pub keep_monthly: u32,
    /// Years whose newest backup is kept.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(maximum = 10000))]
    pub keep_yearly: u32,
}

/// `POST /v1/images/{id}/backups/prune`: the policy, and whether to delete.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PruneBackupsRequest {
    /// What to keep.
    pub retention: RetentionPolicy,
    /// Only say what would be kept and deleted; delete nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// The most a prune's `keep_*` count can ask for (the schema's `maximum`).
pub const MAX_KEEP: u32 = 10_000;

/// The rule of a prune that kept a backup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RetentionRule {
    /// `keep_last`.
    Last,
    /// `keep_daily`.
    Daily,
    /// `keep_weekly`.
    Weekly,
    /// `keep_monthly`.
    Monthly,
    /// `keep_yearly`.
    Yearly,
}

/// One backup a prune decided on.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PrunedBackup {
    /// The backup.
    pub id: Uuid,
    /// Its name.
    pub name: String,
    /// The moment its bytes are of: what the rules count by.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    /// The rule that kept it (kept ones only).
    #[serde(default)]
    pub kept_by: Option<RetentionRule>,
}

/// What a prune kept and deleted (or, on a dry run, would delete), newest
/// first. Only finished backups are pruned: a running one is left alone.
/// The deleted backups' chunks are freed by the gc that follows (as after
/// `DELETE /v1/backups/{id}`), unless another backup uses them.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BackupPrune {
    /// The image whose backups were pruned, as asked.
    pub image: String,
    /// Nothing was deleted: `deleted` is what would have been.
    pub dry_run: bool,
    /// The backups kept, each with its rule.
    pub kept: Vec<PrunedBackup>,
    /// The backups deleted from the target (or that would be).
    pub deleted: Vec<PrunedBackup>,
}
