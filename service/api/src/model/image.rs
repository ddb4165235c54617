//! Images: the files volumes are served from, their creation, growth,
//! allocation, snapshots and clones (`/v1/images`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::key::{CreateEncryption, ImageEncryption};

/// How the bytes of a newly created image file are laid out on disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Allocation {
    /// `ftruncate` only: blocks are allocated on first write. Volumes on the
    /// file paths (`nowait`, `threaded`) punch holes for DISCARD and zero
    /// ranges for WRITE_ZEROES, giving the space back.
    #[default]
    Sparse,
    /// `fallocate` plus zeros written, so no extent stays unwritten (direct-map
    /// ready). Kept so under every policy: DISCARD leaves the blocks allocated
    /// and WRITE_ZEROES writes zeros, so the image stays eligible for `direct`.
    Full,
}

impl Allocation {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Allocation::Sparse => "sparse",
            Allocation::Full => "full",
        }
    }
}

/// `POST /v1/images`: register an existing file, or create one when `create` is given.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateImageRequest {
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
    /// Absolute path under one of the service's image roots: no NUL, at most
    /// 4095 bytes, each file name at most 255 bytes (UTF-8). JSON Schema
    /// counts characters, not bytes, so the pattern states the part of that
    /// rule it can check exactly: an ASCII path (names of up to 255
    /// characters), or a path of up to 16 names of up to 63 characters of
    /// any kind. Every path it matches passes the byte limits.
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^(?:(?:/[\\x01-\\x2e\\x30-\\x7f]{0,255})+|(?:/[^/\\x00]{0,63}){1,16})$",
            min_length = 1,
            max_length = 4095
        )
    )]
    pub path: String,
    /// Create the file instead of registering an existing one.
    #[serde(default)]
    pub create: Option<CreateImageFile>,
    /// Make the file a writable clone of this image (id or name): its
    /// extents shared (`reflink`) where the filesystem can, else copied in
    /// the background (202, state `copying`). With `create`, the clone is
    /// then grown to its `size_bytes` (not below the source's size: 422
    /// `shrink_refused`), the new range laid out as its `allocation`.
    #[serde(default)]
    pub clone_from: Option<String>,
    /// Make the file from this backup (id, or name when one backup has it)
    /// on the service's backup target: 202 with state `copying` while its
    /// chunks are fetched and each one's hash is checked, then `ready`; a
    /// chunk missing or corrupt fails it (`failed`, naming the chunk) and
    /// removes the file, so it is never served half made. The file is sparse
    /// where the backup had holes. Not with `create`, `clone_from` or
    /// `allocation` (422 `invalid_field`).
    #[serde(default)]
    pub restore_from: Option<String>,
    /// Make a standby of this image's backups (its id or name, as the
    /// backups on the service's backup target name it; usually another
    /// host's image): the file is made from its newest backup as
    /// `restore_from` does (202, `copying`), then follows each newer one,
    /// fetching only the chunks that changed (`standby` in the answer says
    /// which backup it holds and how far behind it is). It takes no volume,
    /// backup, snapshot, clone, grow or allocate (409 `image_is_standby`)
    /// until `POST /v1/images/{id}/activate`. Not with `create`,
    /// `clone_from`, `restore_from` or `allocation` (422 `invalid_field`).
    #[serde(default)]
    pub standby_of: Option<String>,
    /// Registering only (neither `create` nor `clone_from`; 422
    /// `invalid_field` with either): the allocation to record instead of
    /// the one FIEMAP finds. `full` is checked against the file: a hole or
    /// an unwritten extent is refused (422 `allocation_mismatch`, naming the
    /// first one; nothing is recorded). `sparse` is recorded as asked, so
    /// discards through `nowait`/`threaded` punch even a fully written file.
    /// Without it, a file FIEMAP shows fully written is recorded `full`,
    /// any other `sparse` (`null` where the filesystem has no FIEMAP);
    /// `allocation_reason` in the answer says which and why.
    #[serde(default)]
    pub allocation: Option<Allocation>,
    /// Its labels (none by default): at most 32, each key
    /// `[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?`, each value empty or
    /// `[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?`.
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
}

/// `PATCH /v1/images/{id}`: what to change; what is left out stays.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PatchImageRequest {
    /// Labels to set (a value) or remove (`null`), merged into the image's
    /// as a JSON merge patch does; the others stay. The result has at most
    /// 32 (422 `too_many_labels` otherwise, and nothing changes).
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, Option<String>>,
}

/// `POST /v1/images/{id}/snapshots`: a read-only copy of an image, next to it.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    /// The snapshot's image name, also its file's name in the source's
    /// directory: `[a-z0-9][a-z0-9._-]{0,62}`
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

/// `GET /v1/images` filters.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
pub struct ListImagesQuery {
    /// Only the snapshots of this image (id or name).
    #[serde(default)]
    pub snapshot_of: Option<String>,
    /// Only the images with this label: `key=value`, or `key` for any
    /// value.
    #[serde(default)]
    pub label: Option<String>,
}

/// How a snapshot's or clone's bytes were made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CopyMethod {
    /// `FICLONE`: the file shares the source's extents (xfs with reflink,
    /// btrfs); instant, and the blocks are copied only when one side writes.
    Reflink,
    /// `copy_file_range` of the source's data, in the background.
    Copy,
    /// Fetched from a backup's chunks (`restored_from`), in the background.
    Restore,
}

impl CopyMethod {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            CopyMethod::Reflink => "reflink",
            CopyMethod::Copy => "copy",
            CopyMethod::Restore => "restore",
        }
    }
}

/// Whether an image's file is complete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ImageState {
    /// Complete: volumes may use it.
    #[default]
    Ready,
    /// A background copy is filling it (`copied_bytes` of
    /// `copy_total_bytes`); volumes are refused until it is `ready`.
    Copying,
    /// The copy did not finish (`state_reason` says why); the partial file
    /// was removed. Delete the image and snapshot or clone again.
    Failed,
}

impl ImageState {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ImageState::Ready => "ready",
            ImageState::Copying => "copying",
            ImageState::Failed => "failed",
        }
    }
}

/// Size and layout of an image file to create.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateImageFile {
    /// Size in bytes: a positive multiple of 512, at most 1 PiB.
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 512, maximum = 1125899906842624_u64, multiple_of = 512)
    )]
    pub size_bytes: u64,
    /// Defaults to `sparse`.
    #[serde(default = "default_allocation")]
    pub allocation: Allocation,
    /// Format the file as LUKS2 (dm-crypt) with this key: every volume on it
    /// then needs a key (`key` of `POST /v1/volumes`) and serves the
    /// plaintext, `image.encryption.header_bytes` smaller than the file.
    /// `null`: plain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<CreateEncryption>,
}

fn default_allocation() -> Allocation {
    Allocation::Sparse
}

/// An image: a regular file under an image root that volumes are served from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Image {
    /// Stable id.
    pub id: Uuid,
    /// Unique name: `[a-z0-9][a-z0-9._-]{0,62}`.
    pub name: String,
    /// The file, an absolute path under an image root.
    pub path: String,
    /// Size of the file, bytes.
    pub size_bytes: u64,
    /// Bytes the filesystem has allocated to the file (`st_blocks * 512`).
    pub allocated_bytes: u64,
    /// The filesystem the file lives on, from `statfs` (e.g. `ext4`, `xfs`).
    pub filesystem: String,
    /// How blockplane created the file, or what it recorded when the file
    /// was registered: `full` when FIEMAP showed every byte written (or it
    /// was declared and checked so), `sparse` otherwise or when declared.
    /// `null` for a file registered before registrations were checked, or
    /// on a filesystem without FIEMAP; served as `sparse`.
    pub allocation: Option<Allocation>,
    /// Why a registration recorded `allocation` as it did (what FIEMAP
    /// showed, or that it was declared). In the registration's answer only
    /// (and its `image_registered` event); `null` in every other answer.
    #[serde(default)]
    pub allocation_reason: Option<String>,
    /// When it was registered or created.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    /// Ids of the volumes that use this image.
    pub volumes: Vec<Uuid>,
    /// The last `POST /v1/images/{id}/allocate` since the service started:
    /// running with its progress, or how it ended; `null` when there was none.
    #[serde(default)]
    pub allocate: Option<ImageAllocate>,
    /// `copying` while a background copy fills it, `failed` if that did
    /// not finish; `ready` otherwise.
    #[serde(default)]
    pub state: ImageState,
    /// Why it is `failed`.
    #[serde(default)]
    pub state_reason: Option<String>,
    /// Id of the image this is a read-only snapshot of.
    #[serde(default)]
    pub snapshot_of: Option<Uuid>,
    /// Id of the image this is a writable clone of.
    #[serde(default)]
    pub cloned_from: Option<Uuid>,
    /// Volumes on it must be read-only (a snapshot); it cannot grow or be
    /// allocated.
    #[serde(default)]
    pub read_only: bool,
    /// How a snapshot's, clone's or restore's bytes were made; `null` for
    /// others.
    #[serde(default)]
    pub method: Option<CopyMethod>,
    /// Id of the backup this image was restored from.
    #[serde(default)]
    pub restored_from: Option<Uuid>,
    /// Bytes copied so far while `copying` (`null` otherwise).
    #[serde(default)]
    pub copied_bytes: Option<u64>,
    /// Bytes of data the copy has to copy, while `copying`.
    #[serde(default)]
    pub copy_total_bytes: Option<u64>,
    /// Its LUKS2 header, when it is encrypted (created with
    /// `create.encryption`, or a LUKS2 file registered); `null` when plain.
    #[serde(default)]
    pub encryption: Option<ImageEncryption>,
    /// Its labels, by key.
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    /// While it is a standby of another image's backups: what it holds and
    /// how far behind it is; `null` for an ordinary image.
    #[serde(default)]
    pub standby: Option<ImageStandby>,
    /// What the create or grow that answered this should make you check,
    /// e.g. a sparse image larger than its root's free space (empty
    /// otherwise).
    #[serde(default)]
    pub warnings: Vec<String>,
}

impl Image {
    /// Bytes of a volume's device on this image: the file, less an
    /// encrypted image's header.
    pub fn device_bytes(&self) -> u64 {
        super::key::device_bytes(self.encryption.as_ref(), self.size_bytes)
    }

    /// The file size at which this image's volumes are `device_bytes` long.
    pub fn file_bytes_for(&self, device_bytes: u64) -> u64 {
        device_bytes + (self.size_bytes - self.device_bytes())
    }
}

/// A standby image: the backup of its source it holds (complete, never a
/// mix of two), the newest one the target has, and its apply.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageStandby {
    /// The id of the image whose backups it follows.
    pub source_image_id: Uuid,
    /// That image's name, as its newest backup names it.
    pub source_image_name: String,
    /// The backup it holds (`null` until its first copy is done).
    pub backup_id: Option<Uuid>,
    /// That backup's name.
    pub backup_name: Option<String>,
    /// The moment that backup's data is of.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub backup_created_at: Option<OffsetDateTime>,
    /// Seconds since that moment: the data it would lose if activated now.
    pub lag_seconds: Option<f64>,
    /// The newest backup of the source on the target at the last check.
    pub newest_backup_id: Option<Uuid>,
    /// Bytes of chunks that newest backup has and the one held lacks:
    /// what the next apply fetches (0 when it holds the newest).
    pub behind_bytes: u64,
    /// Whether an apply runs now (`copied_bytes` of `copy_total_bytes`).
    pub applying: bool,
    /// When the target was last listed for newer backups.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub checked_at: Option<OffsetDateTime>,
    /// Why the last check or apply failed (`null` when it did not); it
    /// still holds its backup whole.
    pub error: Option<String>,
}

/// `POST /v1/images/{id}/activate`: a standby becomes an ordinary image.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ActivateImageRequest {
    /// Stop an apply that runs (its journal dropped: the image keeps the
    /// backup it held) instead of refusing with 409 `standby_applying`.
    #[serde(default)]
    pub force: bool,
}

/// The answer to an activation: the image, and the backup whose bytes it
/// holds.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ActivatedImage {
    /// The image, ordinary now.
    pub image: Image,
    /// The backup it holds.
    pub backup_id: Uuid,
    /// That backup's name.
    pub backup_name: String,
    /// The moment its data is of.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub backup_created_at: OffsetDateTime,
    /// Whether an apply was stopped for it (`force`).
    pub stopped_apply: bool,
}

/// An image's allocate (`POST /v1/images/{id}/allocate`), running or ended.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageAllocate {
    /// Where it is.
    pub state: AllocateState,
    /// Bytes of holes and unwritten extents written with zeros so far.
    pub done_bytes: u64,
    /// Bytes of holes and unwritten extents it found to write.
    pub total_bytes: u64,
    /// Why it failed (`failed` only).
    pub error: Option<String>,
    /// When it started.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub started_at: OffsetDateTime,
}

/// Where an allocate is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AllocateState {
    /// Writing zeros; `GET /v1/images/{id}` shows the progress.
    Running,
    /// Done: the image is `full` and passes direct-map rule 2.
    Done,
    /// Stopped by an error; the image keeps its allocation as declared
    /// (allocate again).
    Failed,
    /// Stopped by `DELETE /v1/images/{id}/allocate` (or the service's stop);
    /// the image keeps its allocation as declared (allocate again).
    Cancelled,
}

impl AllocateState {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            AllocateState::Running => "running",
            AllocateState::Done => "done",
            AllocateState::Failed => "failed",
            AllocateState::Cancelled => "cancelled",
        }
    }
}

/// `POST /v1/images/{id}/resize`: grow an image (attached volumes follow).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResizeImageRequest {
    /// New size in bytes: a multiple of 512, at most 1 PiB, not smaller than
    /// the current size.
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 512, maximum = 1125899906842624_u64, multiple_of = 512)
    )]
    pub size_bytes: u64,
}

/// What `POST /v1/images/{id}/resize` did.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ResizeImageResponse {
    /// The image, grown.
    pub image: Image,
    /// How each attached volume followed.
    pub volumes: Vec<VolumeResize>,
}

/// How one attached volume followed an image's growth.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeResize {
    /// The volume's id.
    pub volume_id: Uuid,
    /// The volume's name.
    pub name: String,
    /// The device's size now.
    pub size_bytes: u64,
    /// The device keeps its old size until the next attach.
    pub resize_pending: bool,
    /// What became of the device, for people.
    pub message: String,
}

/// Query of `DELETE /v1/images/{id}`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct DeleteImageQuery {
    /// Also unlink the file (default false: only forget the registration).
    #[serde(default)]
    pub delete_file: bool,
    /// Crypto-erase an encrypted image first: destroy every key slot of its
    /// header, so no key opens the file or any copy of its blocks that
    /// survives (422 `not_encrypted` on a plain image). The file is kept
    /// unless `delete_file`.
    #[serde(default)]
    pub erase: bool,
}

/// What `POST /v1/images/{id}/keys` made.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct KeySlotAdded {
    /// The new slot's number.
    pub slot: u32,
    /// The image, its header read again.
    pub image: Image,
}
