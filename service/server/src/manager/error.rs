//! Why the manager refused or failed an operation: one error type, which
//! the API maps to HTTP statuses and codes (`http::error`).

use uuid::Uuid;

use crate::backend::BackendError;
use crate::store::StoreError;
use blockplane_system::image::ImageFileError;

/// Why the manager refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {what} name '{name}': names match [a-z0-9][a-z0-9._-]{{0,62}}")]
    InvalidName { what: &'static str, name: String },
    #[error("invalid {field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("image '{0}' not found")]
    ImageNotFound(String),
    #[error("volume '{0}' not found")]
    VolumeNotFound(String),
    #[error("no orphan device '{0}' (orphans are listed in GET /v1/host)")]
    OrphanNotFound(String),
    #[error("volume '{name}' would exceed this host's cap of {max} volumes (--max-volumes)")]
    VolumeLimit { name: String, max: usize },
    #[error("image name '{name}' is taken by image {id}")]
    ImageNameTaken { name: String, id: Uuid },
    #[error("'{path}' is already registered as image '{name}' ({id})")]
    AlreadyRegistered {
        path: String,
        name: String,
        id: Uuid,
    },
    #[error("image '{name}' is used by volume(s) {volumes} (an image serves one volume at a time)")]
    ImageInUse { name: String, volumes: String },
    #[error(
        "image '{name}' ({size} bytes) would bring the images of {root} to {provisioned} bytes, more than {ratio} times its filesystem's {fs_size} bytes (--max-overcommit)"
    )]
    Overcommit {
        name: String,
        size: u64,
        root: String,
        provisioned: u64,
        ratio: f64,
        fs_size: u64,
    },
    #[error("image '{name}' file changed: {reason}")]
    ImageReplaced { name: String, reason: String },
    #[error(
        "image '{name}' ({path}) is locked by {holder}: another blockplane (another data dir) serves it; delete that volume first"
    )]
    ImageLocked {
        name: String,
        path: String,
        holder: String,
    },
    #[error(
        "image '{name}': {what} needs {needed} bytes and its filesystem has {free} free; nothing was changed"
    )]
    SpaceShort {
        name: String,
        what: &'static str,
        needed: u64,
        free: u64,
    },
    #[error("image '{name}' is a read-only snapshot of {source_id}: {reason}")]
    ImageReadOnly {
        name: String,
        source_id: String,
        reason: String,
    },
    #[error("image '{name}' is {state}: {reason}")]
    ImageNotReady {
        name: String,
        state: &'static str,
        reason: String,
    },
    #[error("image '{name}' is served by {backend} volume '{volume}': {reason}")]
    SnapshotAttached {
        name: String,
        volume: String,
        backend: &'static str,
        reason: String,
    },
    #[error(
        "image '{name}': the copy to image '{copy}' reads it, so it cannot {what} until that copy is ready (or stopped by deleting '{copy}')"
    )]
    CopySource {
        name: String,
        copy: String,
        what: String,
    },
    #[error(
        "image '{name}': volume '{volume}' is copying one moment of it into '{into}' (copy-before-write), and copies one at a time; try again once that copy ends"
    )]
    MomentCopyRunning {
        name: String,
        volume: String,
        into: String,
    },
    #[error(
        "image '{name}': backup '{backup}' ({id}) reads its file, so it cannot {what} until that backup ends (or is cancelled with DELETE /v1/backups/{id})"
    )]
    BackupSource {
        name: String,
        backup: String,
        id: Uuid,
        what: String,
    },
    #[error(
        "this service has no backup target, so it cannot {0}: start it with --backup-target DIR or s3://BUCKET/PREFIX (docs/operations.md, Backups)"
    )]
    NoBackupTarget(String),
    #[error(
        "image '{name}': backup {backup} of it runs already; wait for its end (GET /v1/backups/{backup}) or cancel it (DELETE /v1/backups/{backup})"
    )]
    BackupRunning { name: String, backup: Uuid },
    #[error("backup name '{name}' is taken by backup {id} of image '{image}'")]
    BackupNameTaken {
        name: String,
        image: String,
        id: Uuid,
    },
    #[error("backup '{0}' not found on the backup target")]
    BackupNotFound(String),
    #[error(
        "image '{image}': no backup on the backup target is of an image '{source_image}' (by id or name); a standby follows an image that has backups there"
    )]
    StandbySourceNotFound { image: String, source_image: String },
    #[error(
        "image '{image}': the backups on the target name several images '{source_image}' ({ids}); give the id of the one to follow"
    )]
    StandbySourceAmbiguous {
        image: String,
        source_image: String,
        ids: String,
    },
    #[error(
        "image '{name}' is a standby of image {source_image}'s backups, so it cannot {what} until it is activated (POST /v1/images/{name}/activate)"
    )]
    ImageIsStandby {
        name: String,
        source_image: Uuid,
        what: String,
    },
    #[error(
        "image '{0}' is not a standby (it follows no image's backups): there is nothing to activate or check"
    )]
    NotAStandby(String),
    #[error(
        "image '{0}' is not a read-only snapshot: changed ranges are answered for snapshots only, since a writable image's ranges change while they are read"
    )]
    NotASnapshot(String),
    #[error(
        "images '{target}' and '{base}' are not snapshots of one image ({target} is of {target_of}, {base} of {base_of}): their difference says nothing about a volume's changes"
    )]
    SnapshotsOfDifferentImages {
        target: String,
        base: String,
        target_of: String,
        base_of: String,
    },
    #[error(
        "image '{name}': an apply of backup {backup} runs, so it is not activated now; wait for its end (GET /v1/images/{name}), or give \"force\": true to stop it and activate with the backup it holds"
    )]
    StandbyApplying { name: String, backup: Uuid },
    #[error("backup name '{name}' is that of several backups ({ids}): give its id")]
    BackupAmbiguous { name: String, ids: String },
    #[error(
        "backup '{name}' is {state}: only a done backup (with its manifest) can be restored or verified"
    )]
    BackupNotDone { name: String, state: &'static str },
    #[error(
        "a retention policy for {0} with no keep_* count above 0 would delete every backup of it: give at least one (keep_last, keep_daily, keep_weekly, keep_monthly, keep_yearly)"
    )]
    RetentionKeepsNothing(String),
    #[error(
        "backup schedule '{schedule}': '{cron}' is not a cron expression of five fields (minute hour day-of-month month day-of-week, or @hourly, @daily, @weekly, @monthly, @yearly): {reason}"
    )]
    InvalidCron {
        schedule: String,
        cron: String,
        reason: String,
    },
    #[error("backup schedule '{0}' not found")]
    ScheduleNotFound(String),
    #[error(
        "{owner}: label {part} '{text}' {problem} (keys [a-z0-9]([a-z0-9._/-]{{0,61}}[a-z0-9])?, values empty or [A-Za-z0-9]([A-Za-z0-9._-]{{0,61}}[A-Za-z0-9])?, at most 32)"
    )]
    InvalidLabel {
        owner: String,
        part: &'static str,
        text: String,
        problem: &'static str,
    },
    #[error(
        "image '{image}': the patch would leave it {count} labels, more than 32; nothing was changed"
    )]
    TooManyLabels { image: String, count: usize },
    #[error("backup schedule name '{name}' is taken by schedule {id}")]
    ScheduleNameTaken { name: String, id: Uuid },
    #[error(transparent)]
    Backup(#[from] blockplane_backup::Error),
    #[error(transparent)]
    Export(#[from] super::fabric_error::ExportError),
    #[error(transparent)]
    Remote(#[from] super::fabric_error::RemoteError),
    #[error(transparent)]
    Move(#[from] super::fabric_error::MoveError),
    #[error("image '{name}' cannot be allocated: {reason}")]
    NotAllocatable { name: String, reason: String },
    #[error("image '{name}' ({path}) cannot be registered as full: {reason}; nothing was recorded")]
    AllocationMismatch {
        name: String,
        path: String,
        reason: String,
    },
    #[error("image '{name}': {reason}")]
    AllocateConflict { name: String, reason: String },
    #[error("image '{name}' is {current} bytes; resize only grows (asked {asked})")]
    Shrink {
        name: String,
        current: u64,
        asked: u64,
    },
    #[error(
        "image '{image}' is encrypted (LUKS2): a volume on it needs its \"key\"; nothing was changed"
    )]
    KeyRequired { image: String },
    #[error("image '{image}': no key slot opens with the key given; nothing was changed")]
    KeyRejected { image: String },
    #[error("image '{image}' has no key slot {slot} (its slots: {slots})")]
    KeySlotNotFound {
        image: String,
        slot: u32,
        slots: String,
    },
    #[error(
        "image '{image}': key slot {slot} is its last; removing it would leave no key that opens the image (crypto-erase it with DELETE /v1/images/{image}?erase=true instead)"
    )]
    LastKeySlot { image: String, slot: u32 },
    #[error("image '{image}' is not encrypted: {what}")]
    NotEncrypted { image: String, what: String },
    #[error("image '{image}': encryption is not available: {reason}")]
    EncryptionUnavailable { image: String, reason: String },
    /// A LUKS header of a version other than 2: served as plain, its
    /// ciphertext would pass for data.
    #[error(
        "image '{image}' has a {what} header (its magic at byte {offset}): blockplane opens LUKS2 only and never serves a file with a LUKS header as plain data; convert it with `cryptsetup convert --type luks2` while nothing uses it, then register it again"
    )]
    LuksUnsupported {
        image: String,
        what: String,
        offset: u64,
    },
    /// A LUKS2 magic whose header cryptsetup cannot read.
    #[error(
        "image '{image}' has a LUKS2 header (its magic at byte {offset}) that cryptsetup cannot read ({reason}): a file with a LUKS header is never served as plain data; restore its header (`cryptsetup luksHeaderRestore` from a header backup), then register it again"
    )]
    LuksUnreadable {
        image: String,
        offset: u64,
        reason: String,
    },
    /// A restore whose bytes disagree with its backup's manifest about
    /// being encrypted.
    #[error(
        "image '{image}': backup '{backup}' ({backup_id}) is of {expected}, but the restored bytes {found}; a restore keeps its source's encryption, so it was not made ready"
    )]
    RestoredEncryption {
        image: String,
        backup: String,
        backup_id: Uuid,
        expected: &'static str,
        found: &'static str,
    },
    #[error("image '{image}': {source}")]
    Crypt {
        image: String,
        #[source]
        source: blockplane_system::crypt::CryptError,
    },
    #[error("volume '{name}' already exists with a different spec ({differences})")]
    VolumeExists { name: String, differences: String },
    #[error("volume '{name}' is {state}: {reason}")]
    VolumeState {
        name: String,
        state: &'static str,
        reason: String,
    },
    #[error("volume '{name}': {source}")]
    Volume {
        name: String,
        #[source]
        source: BackendError,
    },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    ImageFile(#[from] ImageFileError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the registry cannot be written: {0}")]
    StoreUnwritable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// A failure a test injected fails the operation as an internal error.
impl From<crate::fault::Injected> for Error {
    fn from(e: crate::fault::Injected) -> Self {
        Error::Internal(e.to_string())
    }
}

/// Result of the manager's operations.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An image refused because volumes use it, named by their names.
    pub(super) fn image_in_use(image: String, users: &[(Uuid, String)]) -> Self {
        Error::ImageInUse {
            name: image,
            volumes: users
                .iter()
                .map(|(_, name)| format!("'{name}'"))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}
