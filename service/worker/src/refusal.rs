//! Why a worker refused a change, and its code on the control socket.

use blockplane_protocol as protocol;
use blockplane_system::extent;

/// Why a worker refused a change.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error(transparent)]
    Map(#[from] extent::MapError),
    #[error("{0}")]
    Rule(String),
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl Refusal {
    /// Its code on the control socket.
    pub fn code(&self) -> protocol::ErrorCode {
        match self {
            Refusal::Map(extent::MapError::Io { .. }) | Refusal::Io { .. } => {
                protocol::ErrorCode::IoError
            }
            Refusal::Map(_) | Refusal::Rule(_) => protocol::ErrorCode::Refused,
        }
    }
}
