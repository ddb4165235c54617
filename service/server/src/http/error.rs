//! The one place where errors become HTTP: every error the API can return goes
//! through [`ApiError::status_and_code`], which names its status and its
//! stable `code`; the message is the error's own text.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::backend::BackendError;
use crate::manager::{Error, ExportError, MoveError, RemoteError};
use blockplane_api::model::{ErrorBody, ErrorCode, ErrorDetail};
use blockplane_system::image::ImageFileError;

/// An error response.
#[derive(Debug)]
pub enum ApiError {
    /// A refusal or failure of the manager.
    Manager(Error),
    /// The request itself is malformed (body, query, content type).
    BadRequest {
        status: StatusCode,
        code: ErrorCode,
        message: String,
    },
    /// Missing or wrong bearer token.
    Unauthorized,
    /// No such route or method.
    NoRoute { status: StatusCode, message: String },
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError::Manager(e)
    }
}

fn backend(e: &BackendError) -> (StatusCode, ErrorCode) {
    use ErrorCode as C;
    match e {
        BackendError::Unavailable { .. } => {
            (StatusCode::UNPROCESSABLE_ENTITY, C::BackendUnavailable)
        }
        BackendError::Unsupported { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::Unsupported),
        BackendError::NotLive { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::NotLive),
        BackendError::Refused { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::Refused),
        BackendError::Busy { .. } => (StatusCode::CONFLICT, C::DeviceBusy),
        BackendError::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, C::DeviceError),
    }
}

/// A backup target's answer: what it lacks is 404, what it holds damaged
/// 502, the target away or refusing 503; the image's own file 500.
fn backup(e: &blockplane_backup::Error) -> (StatusCode, ErrorCode) {
    use blockplane_backup::Error as E;
    match e {
        E::BackupNotFound(_) => (StatusCode::NOT_FOUND, ErrorCode::BackupNotFound),
        E::BackupExists(_) => (StatusCode::CONFLICT, ErrorCode::NameTaken),
        E::GcBusy { .. } => (StatusCode::CONFLICT, ErrorCode::BackupGcBusy),
        E::ManifestCorrupt { .. }
        | E::ChunkMissing { .. }
        | E::ChunkCorrupt { .. }
        | E::StandbyMismatch { .. }
        | E::GcRefused { .. } => (StatusCode::BAD_GATEWAY, ErrorCode::BackupCorrupt),
        E::Unreachable { .. } | E::Target { .. } | E::Hung { .. } | E::LeaseLost { .. } => (
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::BackupTargetUnavailable,
        ),
        E::Config(_) | E::Image { .. } | E::Journal { .. } => {
            (StatusCode::INTERNAL_SERVER_ERROR, ErrorCode::IoError)
        }
    }
}

fn export(e: &ExportError) -> (StatusCode, ErrorCode) {
    use ErrorCode as C;
    use ExportError as E;
    match e {
        E::NotFound(_) => (StatusCode::NOT_FOUND, C::ExportNotFound),
        E::HostNotFound(_) => (StatusCode::NOT_FOUND, C::ExportHostNotFound),
        E::Unavailable { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::ExportUnavailable),
        E::AuthRequired { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::AuthRequired),
        E::ReadOnly { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::ExportReadOnly),
        E::BadHost { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::InvalidFabricName),
        E::Exported { .. } => (StatusCode::CONFLICT, C::VolumeExported),
        E::HostsConnected { .. } | E::MaybeConnected { .. } => {
            (StatusCode::CONFLICT, C::HostConnected)
        }
        E::Kernel { .. } | E::Keys { .. } => (StatusCode::INTERNAL_SERVER_ERROR, C::DeviceError),
    }
}

fn remote(e: &RemoteError) -> (StatusCode, ErrorCode) {
    use ErrorCode as C;
    use RemoteError as E;
    match e {
        E::NotFound(_) => (StatusCode::NOT_FOUND, C::RemoteNotFound),
        E::Exists { .. } | E::SameExport { .. } => (StatusCode::CONFLICT, C::RemoteExists),
        E::Invalid { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::InvalidFabricName),
        E::BadKey { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::InvalidKey),
        E::NotForRemote { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::NotForRemote),
        E::Unavailable { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::InitiatorUnavailable),
        E::Refused { .. } => (StatusCode::FORBIDDEN, C::RemoteRefused),
        // Whether another host answers is state, not a server failure.
        E::Unreachable { .. } | E::NoNamespace { .. } => {
            (StatusCode::UNPROCESSABLE_ENTITY, C::RemoteUnreachable)
        }
        E::Busy { .. } => (StatusCode::CONFLICT, C::DeviceBusy),
        E::Moving { .. } => (StatusCode::CONFLICT, C::MoveRefused),
        E::Fabrics { .. } | E::Dm { .. } => (StatusCode::INTERNAL_SERVER_ERROR, C::DeviceError),
    }
}

fn moves(e: &MoveError) -> (StatusCode, ErrorCode) {
    use ErrorCode as C;
    use MoveError as E;
    match e {
        E::NotFound(_) => (StatusCode::NOT_FOUND, C::MoveNotFound),
        E::DrainNotFound(_) => (StatusCode::NOT_FOUND, C::DrainNotFound),
        // What the exporting host answers is its state, not the request's.
        E::Source { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::RemoteUnreachable),
        E::SourceEncrypted { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::KeyRequired),
        E::RemoteNameTaken(_) => (StatusCode::CONFLICT, C::NameTaken),
        E::NotAttached { .. } | E::Running { .. } | E::InDrain { .. } => {
            (StatusCode::CONFLICT, C::MoveRefused)
        }
        E::Invalid { .. } | E::NotBlockplane { .. } | E::InvalidDrain { .. } => {
            (StatusCode::UNPROCESSABLE_ENTITY, C::InvalidMove)
        }
        E::Ended { .. } => (StatusCode::CONFLICT, C::MoveEnded),
        E::Dm { .. } | E::Metadata { .. } => (StatusCode::INTERNAL_SERVER_ERROR, C::DeviceError),
    }
}

fn image_file(e: &ImageFileError) -> (StatusCode, ErrorCode) {
    use ErrorCode as C;
    use ImageFileError as E;
    match e {
        E::NotAbsolute { .. } | E::OutsideRoots { .. } => {
            (StatusCode::FORBIDDEN, C::PathOutsideRoots)
        }
        E::DotDot { .. } => (StatusCode::FORBIDDEN, C::PathParentReference),
        E::Nul { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::PathContainsNul),
        E::NameTooLong { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::FileNameTooLong),
        E::PathTooLong { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::PathTooLong),
        E::Symlink { .. } => (StatusCode::FORBIDDEN, C::PathSymlink),
        E::OtherFilesystem { .. } => (StatusCode::FORBIDDEN, C::PathCrossesMount),
        E::ForeignOwner { .. } => (StatusCode::FORBIDDEN, C::ForeignOwner),
        E::NotFound { .. } => (StatusCode::NOT_FOUND, C::FileNotFound),
        E::ParentMissing { .. } => (StatusCode::NOT_FOUND, C::DirectoryNotFound),
        E::NotRegular { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::NotRegularFile),
        E::HardLinks { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::HardLinks),
        E::LooseMode { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::LoosePermissions),
        E::BadSize { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::InvalidSize),
        E::TooLarge { .. } => (StatusCode::UNPROCESSABLE_ENTITY, C::TooLarge),
        E::Exists { .. } => (StatusCode::CONFLICT, C::FileExists),
        E::Replaced { .. } => (StatusCode::CONFLICT, C::ImageReplaced),
        E::NoSpace { .. } => (StatusCode::INSUFFICIENT_STORAGE, C::NoSpace),
        E::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, C::IoError),
    }
}

impl ApiError {
    /// The status and stable code of this error.
    pub fn status_and_code(&self) -> (StatusCode, ErrorCode) {
        use ErrorCode as C;
        use StatusCode as S;
        match self {
            ApiError::BadRequest { status, code, .. } => (*status, code.clone()),
            ApiError::Unauthorized => (S::UNAUTHORIZED, C::Unauthorized),
            ApiError::NoRoute { status, .. } => (*status, C::NoRoute),
            ApiError::Manager(e) => match e {
                Error::InvalidName { .. } => (S::UNPROCESSABLE_ENTITY, C::InvalidName),
                Error::InvalidField { .. } => (S::UNPROCESSABLE_ENTITY, C::InvalidField),
                Error::ImageNotFound(_) => (S::NOT_FOUND, C::ImageNotFound),
                Error::VolumeNotFound(_) => (S::NOT_FOUND, C::VolumeNotFound),
                Error::OrphanNotFound(_) => (S::NOT_FOUND, C::OrphanNotFound),
                Error::VolumeLimit { .. } => (S::UNPROCESSABLE_ENTITY, C::VolumeLimit),
                Error::ImageNameTaken { .. } => (S::CONFLICT, C::NameTaken),
                Error::AlreadyRegistered { .. } => (S::UNPROCESSABLE_ENTITY, C::AlreadyRegistered),
                Error::ImageInUse { .. } => (S::CONFLICT, C::ImageInUse),
                Error::ImageReplaced { .. } => (S::CONFLICT, C::ImageReplaced),
                Error::Overcommit { .. } => (S::INSUFFICIENT_STORAGE, C::OvercommitRefused),
                Error::ImageLocked { .. } => (S::CONFLICT, C::ImageLocked),
                Error::Shrink { .. } => (S::UNPROCESSABLE_ENTITY, C::ShrinkRefused),
                Error::SpaceShort { .. } => (S::INSUFFICIENT_STORAGE, C::NoSpace),
                Error::NotAllocatable { .. } => (S::UNPROCESSABLE_ENTITY, C::NotAllocatable),
                Error::AllocationMismatch { .. } => {
                    (S::UNPROCESSABLE_ENTITY, C::AllocationMismatch)
                }
                Error::AllocateConflict { .. } => (S::CONFLICT, C::AllocateConflict),
                Error::ImageReadOnly { .. } => (S::UNPROCESSABLE_ENTITY, C::ImageReadOnly),
                Error::ImageNotReady { .. } => (S::CONFLICT, C::ImageNotReady),
                Error::CopySource { .. } | Error::MomentCopyRunning { .. } => {
                    (S::CONFLICT, C::CopySourceBusy)
                }
                Error::BackupSource { .. } => (S::CONFLICT, C::BackupSourceBusy),
                Error::NoBackupTarget(_) => (S::CONFLICT, C::NoBackupTarget),
                Error::BackupRunning { .. } => (S::CONFLICT, C::BackupRunning),
                Error::BackupNameTaken { .. } => (S::CONFLICT, C::NameTaken),
                Error::BackupNotFound(_) | Error::StandbySourceNotFound { .. } => {
                    (S::NOT_FOUND, C::BackupNotFound)
                }
                Error::StandbySourceAmbiguous { .. } => (S::CONFLICT, C::BackupAmbiguous),
                Error::ImageIsStandby { .. } => (S::CONFLICT, C::ImageIsStandby),
                Error::NotAStandby(_) => (S::CONFLICT, C::NotAStandby),
                Error::NotASnapshot(_) => (S::UNPROCESSABLE_ENTITY, C::NotASnapshot),
                Error::SnapshotsOfDifferentImages { .. } => {
                    (S::UNPROCESSABLE_ENTITY, C::SnapshotsOfDifferentImages)
                }
                Error::StandbyApplying { .. } => (S::CONFLICT, C::StandbyApplying),
                Error::BackupAmbiguous { .. } => (S::CONFLICT, C::BackupAmbiguous),
                Error::BackupNotDone { .. } => (S::CONFLICT, C::BackupNotDone),
                Error::RetentionKeepsNothing(_) => {
                    (S::UNPROCESSABLE_ENTITY, C::RetentionKeepsNothing)
                }
                Error::InvalidCron { .. } => (S::UNPROCESSABLE_ENTITY, C::InvalidCron),
                Error::ScheduleNotFound(_) => (S::NOT_FOUND, C::ScheduleNotFound),
                Error::InvalidLabel { .. } => (S::UNPROCESSABLE_ENTITY, C::InvalidLabel),
                Error::TooManyLabels { .. } => (S::UNPROCESSABLE_ENTITY, C::TooManyLabels),
                Error::ScheduleNameTaken { .. } => (S::CONFLICT, C::NameTaken),
                Error::Backup(e) => backup(e),
                Error::Export(e) => export(e),
                Error::Remote(e) => remote(e),
                Error::Move(e) => moves(e),
                Error::SnapshotAttached { .. } => {
                    (S::CONFLICT, C::VolumeAttachedSnapshotUnsupported)
                }
                Error::KeyRequired { .. } => (S::UNPROCESSABLE_ENTITY, C::KeyRequired),
                Error::KeyRejected { .. } => (S::FORBIDDEN, C::KeyRejected),
                Error::NotEncrypted { .. } => (S::UNPROCESSABLE_ENTITY, C::NotEncrypted),
                Error::KeySlotNotFound { .. } => (S::NOT_FOUND, C::KeySlotNotFound),
                Error::LastKeySlot { .. } => (S::CONFLICT, C::LastKeySlot),
                Error::EncryptionUnavailable { .. } => {
                    (S::UNPROCESSABLE_ENTITY, C::EncryptionUnavailable)
                }
                Error::LuksUnsupported { .. } => {
                    (S::UNPROCESSABLE_ENTITY, C::LuksVersionUnsupported)
                }
                Error::LuksUnreadable { .. } => (S::UNPROCESSABLE_ENTITY, C::LuksHeaderUnreadable),
                // The backup's bytes disagree with its own manifest.
                Error::RestoredEncryption { .. } => (S::BAD_GATEWAY, C::BackupCorrupt),
                Error::Crypt { .. } => (S::INTERNAL_SERVER_ERROR, C::CryptFailed),
                Error::VolumeExists { .. } => (S::CONFLICT, C::VolumeExists),
                Error::VolumeState { .. } => (S::CONFLICT, C::VolumeState),
                Error::Volume { source, .. } | Error::Backend(source) => backend(source),
                Error::ImageFile(e) => image_file(e),
                Error::Store(e) if e.is_full() => (S::INSUFFICIENT_STORAGE, C::StorageFull),
                Error::Store(_) => (S::INTERNAL_SERVER_ERROR, C::DatabaseError),
                Error::StoreUnwritable(_) => (S::SERVICE_UNAVAILABLE, C::StoreUnwritable),
                Error::Internal(_) => (S::INTERNAL_SERVER_ERROR, C::Internal),
            },
        }
    }

    fn message(&self) -> String {
        match self {
            ApiError::Manager(e) => e.to_string(),
            ApiError::BadRequest { message, .. } | ApiError::NoRoute { message, .. } => {
                message.clone()
            }
            ApiError::Unauthorized => {
                "this request needs the header 'Authorization: Bearer <token>' with the service's token"
                    .into()
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let message = self.message();
        if status.is_server_error() {
            tracing::error!(%status, %code, %message, "request failed");
        } else {
            tracing::debug!(%status, %code, %message, "request refused");
        }
        let body = ErrorBody {
            error: ErrorDetail { code, message },
        };
        let mut resp = (status, Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
