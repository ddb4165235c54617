//! The one place where errors become HTTP: every error the API can return goes
//! through [`ApiError::status_and_code`], which names its status and its
//! stable `code`; the message is the error's own text.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::backend::BackendError;
use crate::manager::Error;
use blockplane_api::model::{ErrorBody, ErrorDetail};
use blockplane_system::image::ImageFileError;

/// An error response.
#[derive(Debug)]
pub enum ApiError {
    /// A refusal or failure of the manager.
    Manager(Error),
    /// The request itself is malformed (body, query, content type).
    BadRequest {
        status: StatusCode,
        code: &'static str,
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

fn backend(e: &BackendError) -> (StatusCode, &'static str) {
    match e {
        BackendError::Unavailable { .. } => {
            (StatusCode::UNPROCESSABLE_ENTITY, "backend_unavailable")
        }
        BackendError::Unsupported { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "unsupported"),
        BackendError::NotLive { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "not_live"),
        BackendError::Refused { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "refused"),
        BackendError::Busy { .. } => (StatusCode::CONFLICT, "device_busy"),
        BackendError::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "device_error"),
    }
}

fn image_file(e: &ImageFileError) -> (StatusCode, &'static str) {
    use ImageFileError as E;
    match e {
        E::NotAbsolute { .. } | E::OutsideRoots { .. } => {
            (StatusCode::FORBIDDEN, "path_outside_roots")
        }
        E::DotDot { .. } => (StatusCode::FORBIDDEN, "path_parent_reference"),
        E::Nul { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "path_contains_nul"),
        E::NameTooLong { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "file_name_too_long"),
        E::PathTooLong { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "path_too_long"),
        E::Symlink { .. } => (StatusCode::FORBIDDEN, "path_symlink"),
        E::OtherFilesystem { .. } => (StatusCode::FORBIDDEN, "path_crosses_mount"),
        E::ForeignOwner { .. } => (StatusCode::FORBIDDEN, "foreign_owner"),
        E::NotFound { .. } => (StatusCode::NOT_FOUND, "file_not_found"),
        E::ParentMissing { .. } => (StatusCode::NOT_FOUND, "directory_not_found"),
        E::NotRegular { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "not_regular_file"),
        E::HardLinks { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "hard_links"),
        E::LooseMode { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "loose_permissions"),
        E::BadSize { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_size"),
        E::TooLarge { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "too_large"),
        E::Exists { .. } => (StatusCode::CONFLICT, "file_exists"),
        E::Replaced { .. } => (StatusCode::CONFLICT, "image_replaced"),
        E::NoSpace { .. } => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
        E::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "io_error"),
    }
}

impl ApiError {
    /// The status and stable code of this error.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            ApiError::BadRequest { status, code, .. } => (*status, code),
            ApiError::Unauthorized => (S::UNAUTHORIZED, "unauthorized"),
            ApiError::NoRoute { status, .. } => (*status, "no_route"),
            ApiError::Manager(e) => match e {
                Error::InvalidName { .. } => (S::UNPROCESSABLE_ENTITY, "invalid_name"),
                Error::InvalidField { .. } => (S::UNPROCESSABLE_ENTITY, "invalid_field"),
                Error::ImageNotFound(_) => (S::NOT_FOUND, "image_not_found"),
                Error::VolumeNotFound(_) => (S::NOT_FOUND, "volume_not_found"),
                Error::OrphanNotFound(_) => (S::NOT_FOUND, "orphan_not_found"),
                Error::VolumeLimit { .. } => (S::UNPROCESSABLE_ENTITY, "volume_limit"),
                Error::ImageNameTaken { .. } => (S::CONFLICT, "name_taken"),
                Error::AlreadyRegistered { .. } => (S::UNPROCESSABLE_ENTITY, "already_registered"),
                Error::ImageInUse { .. } => (S::CONFLICT, "image_in_use"),
                Error::ImageReplaced { .. } => (S::CONFLICT, "image_replaced"),
                Error::Overcommit { .. } => (S::INSUFFICIENT_STORAGE, "overcommit_refused"),
                Error::ImageLocked { .. } => (S::CONFLICT, "image_locked"),
                Error::Shrink { .. } => (S::UNPROCESSABLE_ENTITY, "shrink_refused"),
                Error::SpaceShort { .. } => (S::INSUFFICIENT_STORAGE, "no_space"),
                Error::NotAllocatable { .. } => (S::UNPROCESSABLE_ENTITY, "not_allocatable"),
                Error::AllocateConflict { .. } => (S::CONFLICT, "allocate_conflict"),
                Error::ImageReadOnly { .. } => (S::UNPROCESSABLE_ENTITY, "image_read_only"),
                Error::ImageNotReady { .. } => (S::CONFLICT, "image_not_ready"),
                Error::CopySource { .. } => (S::CONFLICT, "copy_source_busy"),
                Error::SnapshotAttached { .. } => {
                    (S::CONFLICT, "volume_attached_snapshot_unsupported")
                }
                Error::VolumeExists { .. } => (S::CONFLICT, "volume_exists"),
                Error::VolumeState { .. } => (S::CONFLICT, "volume_state"),
                Error::Volume { source, .. } | Error::Backend(source) => backend(source),
                Error::ImageFile(e) => image_file(e),
                Error::Store(e) if e.is_full() => (S::INSUFFICIENT_STORAGE, "storage_full"),
                Error::Store(_) => (S::INTERNAL_SERVER_ERROR, "database_error"),
                Error::StoreUnwritable(_) => (S::SERVICE_UNAVAILABLE, "store_unwritable"),
                Error::Internal(_) => (S::INTERNAL_SERVER_ERROR, "internal"),
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
            tracing::error!(%status, code, %message, "request failed");
        } else {
            tracing::debug!(%status, code, %message, "request refused");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: code.to_string(),
                message,
            },
        };
        let mut resp = (status, Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
