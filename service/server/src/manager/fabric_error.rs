//! Why an export or a remote volume was refused or failed: the errors of
//! the exports' and remote volumes' parts, apart from them so that the
//! manager's one error type can carry them without importing the parts.

use blockplane_system::dhchap::DhchapError;
use blockplane_system::dm::DmCallError;
use blockplane_system::fabrics::FabricsError;
use blockplane_system::nvmet::NvmetError;

/// Why an export was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("volume '{0}' has no export")]
    NotFound(String),
    #[error("no export allows host '{0}'")]
    HostNotFound(String),
    #[error("volume '{volume}' cannot be exported: {reason}")]
    Unavailable { volume: String, reason: String },
    #[error("volume '{volume}': {rule}")]
    AuthRequired { volume: String, rule: &'static str },
    #[error(
        "volume '{volume}': {what}: the kernel's NVMe target serves a namespace read-write only (it cannot enable one on a read-only device, and a device made read-only under it still takes its hosts' writes); make the remote volume read-only on the consuming host instead (PATCH /v1/remotes/{{id}} read_only)"
    )]
    ReadOnly { volume: String, what: &'static str },
    #[error("volume '{volume}': host NQN '{nqn}' is not valid: {reason}")]
    BadHost {
        volume: String,
        nqn: String,
        reason: String,
    },
    #[error(
        "volume '{volume}' is exported as {nqn}: remove its export first (DELETE /v1/volumes/{volume}/export)"
    )]
    Exported { volume: String, nqn: String },
    #[error(
        "volume '{volume}': host(s) {hosts} are connected to its export: disconnect them first (DELETE their remote volume)"
    )]
    HostsConnected { volume: String, hosts: String },
    #[error(
        "volume '{volume}': hosts are connected to this service's export addresses (from {peers}) and the kernel does not say to which export: disconnect them first (DELETE their remote volume), or remove the export with ?force=true, which ends its hosts' I/O with errors"
    )]
    MaybeConnected { volume: String, peers: String },
    #[error("volume '{volume}': the kernel's NVMe target refused the export: {source}")]
    Kernel {
        volume: String,
        #[source]
        source: NvmetError,
    },
    #[error("making the keys of host '{nqn}': {source}")]
    Keys {
        nqn: String,
        #[source]
        source: DhchapError,
    },
}

/// Why a remote volume was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("remote volume '{0}' not found")]
    NotFound(String),
    #[error(
        "remote volume '{name}' exists with another address or NQN ({address}, {nqn}): delete it first or pick another name"
    )]
    Exists {
        name: String,
        address: String,
        nqn: String,
    },
    #[error(
        "remote volume '{name}': {nqn} is connected here already as remote volume '{other}': use that one"
    )]
    SameExport {
        name: String,
        nqn: String,
        other: String,
    },
    #[error("remote volume '{name}': {field} is not a DH-HMAC-CHAP key: {reason}")]
    BadKey {
        name: String,
        field: &'static str,
        reason: String,
    },
    #[error("remote volume '{name}': invalid {field}: {reason}")]
    Invalid {
        name: String,
        field: &'static str,
        reason: String,
    },
    #[error("remote volume '{name}': {what} does not apply to a remote volume: {rule}")]
    NotForRemote {
        name: String,
        what: &'static str,
        rule: &'static str,
    },
    #[error(
        "remote volume '{name}': {what} cannot change while move {id} runs (its table is the move's): cancel the move or wait for its end"
    )]
    Moving {
        name: String,
        what: &'static str,
        id: uuid::Uuid,
    },
    #[error("remote volume '{name}' cannot connect from this host: {source}")]
    Unavailable {
        name: String,
        #[source]
        source: FabricsError,
    },
    #[error("remote volume '{name}': {source}")]
    Refused {
        name: String,
        #[source]
        source: FabricsError,
    },
    #[error("remote volume '{name}': {source}")]
    Unreachable {
        name: String,
        #[source]
        source: FabricsError,
    },
    #[error("remote volume '{name}': {source}")]
    Fabrics {
        name: String,
        #[source]
        source: FabricsError,
    },
    #[error(
        "remote volume '{name}': the kernel showed no namespace of {nqn} within {secs} s of the connect"
    )]
    NoNamespace {
        name: String,
        nqn: String,
        secs: u64,
    },
    #[error(
        "remote volume '{name}': its device {device} is open (mounted or held by a process); close it first"
    )]
    Busy { name: String, device: String },
    #[error("remote volume '{name}': device-mapper: {source}")]
    Dm {
        name: String,
        #[source]
        source: DmCallError,
    },
}

impl RemoteError {
    /// A failed connect, sorted by whose fault it is.
    pub(super) fn connect(name: &str, source: FabricsError) -> Self {
        let name = name.to_string();
        match &source {
            FabricsError::Missing { .. } => Self::Unavailable { name, source },
            FabricsError::AuthRefused { .. }
            | FabricsError::SecretRequired { .. }
            | FabricsError::NotAllowed { .. } => Self::Refused { name, source },
            FabricsError::Unreachable { .. } => Self::Unreachable { name, source },
            _ => Self::Fabrics { name, source },
        }
    }
}

/// Why a move was refused or stopped.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error("move '{0}' not found")]
    NotFound(String),
    #[error(
        "remote volume '{remote}' is {state}: only an attached remote volume's data can move here"
    )]
    NotAttached { remote: String, state: &'static str },
    #[error("remote volume '{remote}': move {id} runs already: wait for it, or cancel it")]
    Running { remote: String, id: uuid::Uuid },
    #[error("remote volume '{remote}': invalid {field}: {reason}")]
    Invalid {
        remote: String,
        field: &'static str,
        reason: String,
    },
    #[error(
        "remote volume '{remote}': {nqn} is not a blockplane export, so no host can be told to let it go: only a blockplane volume moves"
    )]
    NotBlockplane { remote: String, nqn: String },
    #[error(
        "move {id} is part of drain {drain}: its rate limit is its share of the drain's (PATCH /v1/drains/{drain})"
    )]
    InDrain { id: uuid::Uuid, drain: uuid::Uuid },
    #[error("{subject}: {reason}")]
    Source { subject: String, reason: String },
    #[error(
        "{subject}: volume '{volume}' is encrypted on its host, and its data would rest here in plaintext: give a key to encrypt the local image with"
    )]
    SourceEncrypted { subject: String, volume: String },
    #[error(
        "remote volume '{0}' exists here: a cold move connects one of its own under the image's name"
    )]
    RemoteNameTaken(String),
    #[error("drain '{0}' not found")]
    DrainNotFound(String),
    #[error("drain: invalid {field}: {reason}")]
    InvalidDrain { field: &'static str, reason: String },
    #[error("move {id} is {state}: {rule}")]
    Ended {
        id: uuid::Uuid,
        state: &'static str,
        rule: &'static str,
    },
    #[error("move {id} of remote volume '{remote}': its metadata legs: {source}")]
    Metadata {
        id: uuid::Uuid,
        remote: String,
        #[source]
        source: crate::backend::BackendError,
    },
    #[error("move {id} of remote volume '{remote}': device-mapper: {source}")]
    Dm {
        id: uuid::Uuid,
        remote: String,
        #[source]
        source: DmCallError,
    },
}
