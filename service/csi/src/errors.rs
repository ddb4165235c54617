//! The driver's errors and the one place where they, and the blockplane API's
//! error answers, become gRPC status codes ([`api_code`] for the API,
//! [`CsiError::code`] for everything).

use hyper::StatusCode;
use tonic::Code;

use blockplane_api::model::ErrorCode;
use blockplane_client as client;

/// Why a CSI call failed. Each message names the volume (or path) and the
/// rule that refused it.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// A required field is empty.
    #[error("{call}: {field} is required")]
    Missing {
        call: &'static str,
        field: &'static str,
    },
    /// A field the driver cannot accept.
    #[error("volume '{volume}': {reason}")]
    Invalid { volume: String, reason: String },
    /// The volume (or the path the call names) does not exist here.
    #[error("volume '{volume}': {reason}")]
    NotFound { volume: String, reason: String },
    /// The volume id names a volume of another node's blockplane.
    #[error(
        "volume '{volume}' lives on node '{owner}'; this driver serves node '{node}' (blockplane volumes are local to one node)"
    )]
    OtherNode {
        volume: String,
        owner: String,
        node: String,
    },
    /// ControllerExpandVolume for another node's volume. Every node's
    /// external-resizer sees every resize (it has no node-deployment mode),
    /// so this is answered with a retryable code and left to the owner's.
    #[error(
        "volume '{volume}' lives on node '{owner}'; this driver serves node '{node}': the resizer there expands it"
    )]
    ExpandElsewhere {
        volume: String,
        owner: String,
        node: String,
    },
    /// Another call for the same volume is still running.
    #[error("volume '{volume}': another operation on it is in progress; retry later")]
    InFlight { volume: String },
    /// A volume of that name (or a mount at that path) exists with another spec.
    #[error("volume '{volume}': {reason}")]
    Incompatible { volume: String, reason: String },
    /// The volume is not in a state the call needs.
    #[error("volume '{volume}': {reason}")]
    Precondition { volume: String, reason: String },
    /// A capacity the driver cannot give.
    #[error("volume '{volume}': {reason}")]
    OutOfRange { volume: String, reason: String },
    /// The accessibility requirements exclude this node.
    #[error("volume '{volume}': {reason}")]
    Topology { volume: String, reason: String },
    /// A ListVolumes or ListSnapshots token this driver did not hand out.
    #[error("{call}: starting_token '{token}' is not one this driver returned")]
    BadToken { call: &'static str, token: String },
    /// A clone's background copy still runs: the CO retries CreateVolume.
    #[error("volume '{volume}': {reason}")]
    Pending { volume: String, reason: String },
    /// The blockplane API refused or failed a request.
    #[error("volume '{volume}': blockplane API {request} answered {status} {code}: {message}")]
    Api {
        volume: String,
        request: String,
        status: StatusCode,
        code: ErrorCode,
        message: String,
    },
    /// The blockplane API could not be reached.
    #[error("volume '{volume}': {source}")]
    Unreachable {
        volume: String,
        #[source]
        source: client::Error,
    },
    /// A mount, unmount or file operation failed.
    #[error("volume '{volume}': {op} {path}: {source}")]
    Io {
        volume: String,
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A filesystem tool (mkfs, blkid, resize2fs, xfs_growfs) failed.
    #[error("volume '{volume}': {tool} failed ({status}): {output}")]
    Tool {
        volume: String,
        tool: String,
        status: String,
        output: String,
    },
    /// The driver's own bug or an answer it cannot read.
    #[error("volume '{volume}': {reason}")]
    Internal { volume: String, reason: String },
}

/// Fails with [`CsiError::Missing`] when a required field of `call` is empty.
pub fn require(call: &'static str, field: &'static str, empty: bool) -> Result<(), CsiError> {
    if empty {
        Err(CsiError::Missing { call, field })
    } else {
        Ok(())
    }
}

impl CsiError {
    /// The gRPC code of this error.
    pub fn code(&self) -> Code {
        match self {
            CsiError::Missing { .. } | CsiError::Invalid { .. } => Code::InvalidArgument,
            CsiError::NotFound { .. } => Code::NotFound,
            CsiError::OtherNode { .. } | CsiError::Precondition { .. } => Code::FailedPrecondition,
            CsiError::ExpandElsewhere { .. } | CsiError::InFlight { .. } => Code::Aborted,
            CsiError::BadToken { .. } | CsiError::Pending { .. } => Code::Aborted,
            CsiError::Incompatible { .. } => Code::AlreadyExists,
            CsiError::OutOfRange { .. } => Code::OutOfRange,
            CsiError::Topology { .. } => Code::ResourceExhausted,
            CsiError::Api { status, code, .. } => api_code(*status, code),
            CsiError::Unreachable { .. } => Code::Unavailable,
            CsiError::Io { source, .. } => match source.raw_os_error() {
                Some(libc::EBUSY) => Code::FailedPrecondition,
                Some(libc::ENOENT) => Code::NotFound,
                _ => Code::Internal,
            },
            CsiError::Tool { .. } | CsiError::Internal { .. } => Code::Internal,
        }
    }
}

impl From<CsiError> for tonic::Status {
    fn from(e: CsiError) -> Self {
        let code = e.code();
        let message = e.to_string();
        if matches!(code, Code::Internal | Code::Unavailable) {
            tracing::error!(?code, %message, "CSI call failed");
        } else {
            tracing::info!(?code, %message, "CSI call refused");
        }
        tonic::Status::new(code, message)
    }
}

/// The gRPC code for an error answer of the blockplane API: its HTTP status
/// and its stable `code`.
pub fn api_code(status: StatusCode, code: &ErrorCode) -> Code {
    use ErrorCode as C;
    match status.as_u16() {
        404 => Code::NotFound,
        // A conflict with something that exists by that name is ALREADY_EXISTS;
        // a conflict with the object's state (a device in use, an image that a
        // volume uses, a volume without a device) is a precondition.
        409 => match code {
            C::DeviceBusy
            | C::ImageInUse
            | C::VolumeState
            | C::ImageReplaced
            | C::ImageNotReady
            | C::CopySourceBusy
            | C::VolumeAttachedSnapshotUnsupported => Code::FailedPrecondition,
            _ => Code::AlreadyExists,
        },
        // 422 is a request the API understood and cannot carry out: a field
        // out of its range is the caller's argument; a backend, policy or file
        // this host cannot use is the host's state.
        422 => match code {
            C::InvalidName
            | C::InvalidField
            | C::InvalidSize
            | C::ShrinkRefused
            | C::SnapshotsOfDifferentImages
            | C::Unsupported => Code::InvalidArgument,
            // An id that names a volume, not a snapshot.
            C::NotASnapshot => Code::NotFound,
            _ => Code::FailedPrecondition,
        },
        503 => Code::Unavailable,
        507 => Code::ResourceExhausted,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        // 400 and 415 mean the driver sent a malformed request: its own bug.
        _ => Code::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_answers_map_to_the_codes_the_spec_names() {
        use ErrorCode as C;
        let s = |n| StatusCode::from_u16(n).unwrap();
        assert_eq!(api_code(s(404), &C::VolumeNotFound), Code::NotFound);
        assert_eq!(api_code(s(409), &C::VolumeExists), Code::AlreadyExists);
        assert_eq!(api_code(s(409), &C::NameTaken), Code::AlreadyExists);
        assert_eq!(api_code(s(409), &C::DeviceBusy), Code::FailedPrecondition);
        assert_eq!(api_code(s(409), &C::ImageInUse), Code::FailedPrecondition);
        assert_eq!(
            api_code(s(409), &C::VolumeAttachedSnapshotUnsupported),
            Code::FailedPrecondition
        );
        assert_eq!(api_code(s(422), &C::InvalidField), Code::InvalidArgument);
        assert_eq!(api_code(s(422), &C::Unsupported), Code::InvalidArgument);
        assert_eq!(
            api_code(s(422), &C::BackendUnavailable),
            Code::FailedPrecondition
        );
        assert_eq!(api_code(s(503), &C::Overloaded), Code::Unavailable);
        assert_eq!(api_code(s(507), &C::NoSpace), Code::ResourceExhausted);
        assert_eq!(api_code(s(500), &C::Internal), Code::Internal);
        assert_eq!(api_code(s(400), &C::InvalidBody), Code::Internal);
        // A newer service's code is mapped by its status.
        let newer = C::Unknown("from_the_future".into());
        assert_eq!(api_code(s(409), &newer), Code::AlreadyExists);
    }
}
