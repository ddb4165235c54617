//! Error answers: the body every one of them has and the stable codes it
//! carries. [`ErrorCode`] is the one list of those codes: the service maps
//! its errors to it, clients match on it, and the OpenAPI document lists it.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Every error response: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Stable snake_case identifier, for programs.
    #[cfg_attr(feature = "openapi", schema(schema_with = error_code_schema))]
    pub code: ErrorCode,
    /// What was refused and why, naming the object; for people.
    pub message: String,
}

/// Declares [`ErrorCode`] from one list of variants and their wire
/// spellings, so that the enum, its spelling both ways and
/// [`ErrorCode::KNOWN`] cannot disagree.
macro_rules! error_codes {
    ($($(#[$doc:meta])* $variant:ident = $code:literal,)*) => {
        /// The stable `code` of an error answer. Serialized as its snake_case
        /// string; a code this build does not know (a newer service's) reads
        /// as [`ErrorCode::Unknown`] rather than failing.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
            /// A code not in this list, as the service spelled it.
            Unknown(String),
        }

        impl ErrorCode {
            /// Every code the service answers.
            pub const KNOWN: &[ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The wire spelling.
            pub fn as_str(&self) -> &str {
                match self {
                    $(ErrorCode::$variant => $code,)*
                    ErrorCode::Unknown(code) => code,
                }
            }

            /// The code spelled `code` on the wire.
            pub fn from_wire(code: &str) -> ErrorCode {
                match code {
                    $($code => ErrorCode::$variant,)*
                    other => ErrorCode::Unknown(other.to_string()),
                }
            }
        }
    };
}

error_codes! {
    // The request itself.
    /// 400: the request is not valid HTTP/1.1.
    InvalidRequest = "invalid_request",
    /// 400: the body is not a JSON object of the operation's fields.
    InvalidBody = "invalid_body",
    /// 400: an unknown query parameter or one of the wrong type.
    InvalidQuery = "invalid_query",
    /// 415: the body is not declared as `application/json`.
    UnsupportedMediaType = "unsupported_media_type",
    /// 413: the body is larger than the service accepts.
    BodyTooLarge = "body_too_large",
    /// 414: the URI is longer than the service accepts.
    UriTooLong = "uri_too_long",
    /// 431: the headers are larger than the service accepts.
    HeadersTooLarge = "headers_too_large",
    /// 404: no route has that path.
    NoRoute = "no_route",
    /// 405: the route does not take that method.
    MethodNotAllowed = "method_not_allowed",
    /// 401: the bearer token is missing or wrong.
    Unauthorized = "unauthorized",
    /// 503: too many requests or event streams at once.
    Overloaded = "overloaded",
    /// 408: no answer within the request timeout, or headers that did not
    /// arrive in time.
    RequestTimeout = "request_timeout",
    /// 408: the body arrived below the minimum rate.
    BodyTimeout = "body_timeout",
    /// Another HTTP error answered outside the API's handlers.
    HttpError = "http_error",

    // Names, fields and limits.
    /// 422: a name outside `[a-z0-9][a-z0-9._-]{0,62}`.
    InvalidName = "invalid_name",
    /// 422: a field outside its rule.
    InvalidField = "invalid_field",
    /// 422: an image size that is not a positive multiple of 512.
    InvalidSize = "invalid_size",
    /// 422: an image larger than its filesystem allows for a file.
    TooLarge = "too_large",
    /// 422: the service has as many volumes as it allows (`--max-volumes`).
    VolumeLimit = "volume_limit",
    /// 422: the file is registered as another image already.
    AlreadyRegistered = "already_registered",
    /// 422: a resize that would shrink the image.
    ShrinkRefused = "shrink_refused",
    /// 422: the image cannot be allocated.
    NotAllocatable = "not_allocatable",
    /// 422: a registration declared `full` and the file has a hole or an
    /// unwritten extent (or its filesystem cannot say).
    AllocationMismatch = "allocation_mismatch",
    /// 422: a write to a read-only image (a snapshot).
    ImageReadOnly = "image_read_only",
    /// 422: a volume on an encrypted image was asked without its key.
    KeyRequired = "key_required",
    /// 422: an encryption operation on a plain image.
    NotEncrypted = "not_encrypted",
    /// 422: the image cannot be encrypted or opened here (cryptsetup or
    /// dm-crypt missing, or too small for a LUKS2 header).
    EncryptionUnavailable = "encryption_unavailable",
    /// 403: no key slot of the encrypted image opens with the key given.
    KeyRejected = "key_rejected",
    /// 422: the file has a LUKS header of a version other than LUKS2
    /// (LUKS1): refused, never served as plain data.
    LuksVersionUnsupported = "luks_version_unsupported",
    /// 422: the file has a LUKS2 header cryptsetup cannot read (its metadata
    /// damaged in both copies): refused, never served as plain data.
    LuksHeaderUnreadable = "luks_header_unreadable",

    // What the request names does not exist.
    /// 404: no image of that id or name.
    ImageNotFound = "image_not_found",
    /// 404: no volume of that id or name.
    VolumeNotFound = "volume_not_found",
    /// 404: no orphan device of that volume id.
    OrphanNotFound = "orphan_not_found",
    /// 404: no file at the image's path.
    FileNotFound = "file_not_found",
    /// 404: no directory to create the image's file in.
    DirectoryNotFound = "directory_not_found",
    /// 404: the encrypted image has no key slot of that number.
    KeySlotNotFound = "key_slot_not_found",
    /// 404: no backup of that id or name on the backup target.
    BackupNotFound = "backup_not_found",
    /// 404: the volume has no export.
    ExportNotFound = "export_not_found",
    /// 404: no export allows a host of that NQN.
    ExportHostNotFound = "export_host_not_found",
    /// 404: no remote volume of that id or name.
    RemoteNotFound = "remote_not_found",

    // Conflicts with what exists.
    /// 409: another image has that name.
    NameTaken = "name_taken",
    /// 409: a volume of that name exists with another spec.
    VolumeExists = "volume_exists",
    /// 409: a volume uses the image.
    ImageInUse = "image_in_use",
    /// 409: the image's file was replaced behind the service's back.
    ImageReplaced = "image_replaced",
    /// 409: another blockplane (another data dir) serves the image.
    ImageLocked = "image_locked",
    /// 409: the image is still being copied, or its copy failed.
    ImageNotReady = "image_not_ready",
    /// 409: an allocate runs on the image already, or none runs to cancel.
    AllocateConflict = "allocate_conflict",
    /// 409: the image is the source of a copy in progress.
    CopySourceBusy = "copy_source_busy",
    /// 409: a snapshot of an image whose attached volume's backend cannot
    /// take one.
    VolumeAttachedSnapshotUnsupported = "volume_attached_snapshot_unsupported",
    /// 409: the volume is not in a state the operation needs.
    VolumeState = "volume_state",
    /// 409: the device is busy.
    DeviceBusy = "device_busy",
    /// 409: a file exists where the image's file is to be created.
    FileExists = "file_exists",
    /// 409: the image's last key slot, which cannot be removed (crypto-erase
    /// it with `DELETE /v1/images/{id}?erase=true` instead).
    LastKeySlot = "last_key_slot",
    /// 409: the service has no backup target (`--backup-target`).
    NoBackupTarget = "no_backup_target",
    /// 409: a backup reads the image's own file; its writers wait for its end.
    BackupSourceBusy = "backup_source_busy",
    /// 409: a backup of the image runs already.
    BackupRunning = "backup_running",
    /// 409: the backup has no manifest (running, failed or cancelled).
    BackupNotDone = "backup_not_done",
    /// 409: the image is a standby of another image's backups: it takes no
    /// volume and no change until it is activated.
    ImageIsStandby = "image_is_standby",
    /// 409: the image is not a standby, so it has nothing to activate or
    /// check.
    NotAStandby = "not_a_standby",
    /// 409: an apply of a newer backup runs on the standby (activate with
    /// `force` to stop it).
    StandbyApplying = "standby_applying",
    /// 422: changed ranges are answered for read-only snapshots only: a
    /// writable image's ranges change while they are read.
    NotASnapshot = "not_a_snapshot",
    /// 422: the two images of a `changes` query are not snapshots of one
    /// image, so their difference says nothing about a volume's changes.
    SnapshotsOfDifferentImages = "snapshots_of_different_images",
    /// 422: a retention policy that keeps nothing (every `keep_*` is 0).
    RetentionKeepsNothing = "retention_keeps_nothing",
    /// 422: a backup schedule's cron expression is not one, or matches no
    /// time.
    InvalidCron = "invalid_cron",
    /// 404: no backup schedule of that id or name.
    ScheduleNotFound = "schedule_not_found",
    /// 422: a label's key or value is not spelled as labels are, or an
    /// image would have more than 32.
    InvalidLabel = "invalid_label",
    /// 422: a patch of an image's labels would leave it more than 32.
    TooManyLabels = "too_many_labels",
    /// 409: another gc (of this service or another) is collecting the
    /// backup target; one runs there at a time.
    BackupGcBusy = "backup_gc_busy",
    /// 409: more than one backup has that name: give its id.
    BackupAmbiguous = "backup_ambiguous",
    /// 409: the volume is exported: remove its export first.
    VolumeExported = "volume_exported",
    /// 409: a host is connected to the export: disconnect it first.
    HostConnected = "host_connected",
    /// 409: a remote volume of that name exists with another address or NQN.
    RemoteExists = "remote_exists",

    // Exports and remote volumes.
    /// 422: this service cannot export (no `--export-address`, or no
    /// NVMe target in the kernel).
    ExportUnavailable = "export_unavailable",
    /// 422: an export without authentication off loopback, or without
    /// `insecure_loopback: true`.
    AuthRequired = "auth_required",
    /// 422: a read-only export, or an exported volume made read-only: the
    /// kernel's NVMe target serves namespaces read-write only.
    ExportReadOnly = "export_read_only",
    /// 422: a host NQN, an NQN or an address outside its rule.
    InvalidFabricName = "invalid_fabric_name",
    /// 422: a DH-HMAC-CHAP key that is not one: its base64 or its CRC-32.
    InvalidKey = "invalid_key",
    /// 422: what was asked does not apply to a remote volume (its exporting
    /// host decides it).
    NotForRemote = "not_for_remote",
    /// 422: this host cannot connect to exports (no NVMe/TCP initiator in
    /// the kernel).
    InitiatorUnavailable = "initiator_unavailable",
    /// 403: the exporting host refused this host: not allowed, or a key
    /// that does not match.
    RemoteRefused = "remote_refused",
    /// 422: the exporting host did not answer at that address, or served no
    /// namespace.
    RemoteUnreachable = "remote_unreachable",
    /// 404: no move has that id.
    MoveNotFound = "move_not_found",
    /// 404: no drain has that id.
    DrainNotFound = "drain_not_found",
    /// 409: the remote volume cannot start a move now (not attached, or a
    /// move of it runs), or a drain's move was asked a rate of its own.
    MoveRefused = "move_refused",
    /// 422: a move's or a drain's request outside its rule (its source
    /// API, its rate limit, an export that is not blockplane's).
    InvalidMove = "invalid_move",
    /// 409: the move has ended, or is past the step that can be undone.
    MoveEnded = "move_ended",

    // Backends and dispatch.
    /// 422: the backend cannot run on this host.
    BackendUnavailable = "backend_unavailable",
    /// 422: the backend does not support what was asked.
    Unsupported = "unsupported",
    /// 422: the change cannot be made while the volume is attached.
    NotLive = "not_live",
    /// 422: the backend refused the request.
    Refused = "refused",
    /// 500: the device failed.
    DeviceError = "device_error",

    // Image paths and files.
    /// 403: the path is not under one of the service's image roots.
    PathOutsideRoots = "path_outside_roots",
    /// 403: the path contains `..`.
    PathParentReference = "path_parent_reference",
    /// 422: the path contains a NUL byte.
    PathContainsNul = "path_contains_nul",
    /// 422: a file name of the path is longer than 255 bytes.
    FileNameTooLong = "file_name_too_long",
    /// 422: the path is longer than 4095 bytes.
    PathTooLong = "path_too_long",
    /// 403: the path goes through a symbolic link.
    PathSymlink = "path_symlink",
    /// 403: the path crosses into another filesystem.
    PathCrossesMount = "path_crosses_mount",
    /// 403: the file is not owned by the service's user.
    ForeignOwner = "foreign_owner",
    /// 422: the path names something other than a regular file.
    NotRegularFile = "not_regular_file",
    /// 422: the file has other hard links.
    HardLinks = "hard_links",
    /// 422: the file is writable by group or others.
    LoosePermissions = "loose_permissions",

    // Space.
    /// 507: the image's filesystem has no room for what was asked.
    NoSpace = "no_space",
    /// 507: the image would take the root past the service's overcommit limit.
    OvercommitRefused = "overcommit_refused",
    /// 507: the data dir's filesystem is full: the registry could not
    /// record the change.
    StorageFull = "storage_full",

    // Failures of the service.
    /// 500: a file operation failed.
    IoError = "io_error",
    /// 500: the registry failed.
    DatabaseError = "database_error",
    /// 500: cryptsetup failed on an encrypted image.
    CryptFailed = "crypt_failed",
    /// 503: the backup target cannot be reached, or refused the request.
    BackupTargetUnavailable = "backup_target_unavailable",
    /// 502: what the backup target holds is damaged (a manifest that fails
    /// its checksum, or one gc cannot read and so will not collect past).
    BackupCorrupt = "backup_corrupt",
    /// 503: the registry cannot be written.
    StoreUnwritable = "store_unwritable",
    /// 500: the service's own failure.
    Internal = "internal",

    // Answers of the dashboard's port-forward (`blockplane dashboard`).
    /// 403: a request for a host name other than loopback, without a token.
    ForbiddenHost = "forbidden_host",
    /// 502: the port-forward cannot reach the API.
    ApiUnreachable = "api_unreachable",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|code| ErrorCode::from_wire(&code))
    }
}

/// `code` as an enumeration of [`ErrorCode::KNOWN`].
#[cfg(feature = "openapi")]
fn error_code_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some("Stable snake_case identifier, for programs."))
        .enum_values(Some(ErrorCode::KNOWN.iter().map(ErrorCode::as_str)))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_read_back_as_written_and_unknown_ones_are_kept() {
        for code in ErrorCode::KNOWN {
            let json = serde_json::to_string(code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(&serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
        let newer: ErrorDetail =
            serde_json::from_str(r#"{"code": "from_the_future", "message": "m"}"#).unwrap();
        assert_eq!(newer.code, ErrorCode::Unknown("from_the_future".into()));
        assert_eq!(newer.code.to_string(), "from_the_future");
    }
}
