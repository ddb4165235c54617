//! The crate's one error type.

use std::fmt;

use uuid::Uuid;

use crate::terms::CHUNK_SIZE;

/// A result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which backup an error is about, for its message: `'NAME' (ID)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupRef {
    /// The backup's id.
    pub id: Uuid,
    /// The backup's name.
    pub name: String,
}

impl fmt::Display for BackupRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "'{}' ({})", self.name, self.id)
    }
}

/// What went wrong with a backup target or a backup on it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The target's specification or credentials are wrong.
    #[error("backup target: {0}")]
    Config(String),
    /// The reachability check failed.
    #[error("backup target {target} is unreachable: {reason}")]
    Unreachable {
        /// The target, as [`crate::Target::describe`] says.
        target: String,
        /// Why.
        reason: String,
    },
    /// An operation on the target failed.
    #[error("backup target {target}: {action}: {}", chain(.error))]
    Target {
        /// The target, as [`crate::Target::describe`] says.
        target: String,
        /// What was being done, naming the object.
        action: String,
        /// The store's error. The message has its whole chain of causes
        /// (the library's top error alone says "error sending request").
        error: object_store::Error,
    },
    /// An operation on the target went unanswered past the timeout: the
    /// target is hung (a directory on a mount that no longer answers, an S3
    /// endpoint that takes connections and never answers).
    #[error(
        "backup target {target}: {action}: no answer in {secs} s, the target is hung (the operation is abandoned; on a directory a thread stays blocked in it until the mount answers)"
    )]
    Hung {
        /// The target, as [`crate::Target::describe`] says.
        target: String,
        /// What was being done, naming the object.
        action: String,
        /// The timeout, in seconds.
        secs: u64,
    },
    /// No manifest for the id: no finished backup of that id is on the target.
    #[error("backup {0} is not on the target (no finished backup has that id)")]
    BackupNotFound(Uuid),
    /// A manifest for the id is already on the target; backups are never overwritten.
    #[error(
        "backup {0} already has a manifest on the target; a finished backup is never overwritten"
    )]
    BackupExists(Uuid),
    /// A manifest fails its checks: format, checksum or consistency.
    #[error("backup {id}: the manifest is corrupt: {reason}")]
    ManifestCorrupt {
        /// The backup's id (from the object's name).
        id: Uuid,
        /// Which rule it breaks.
        reason: String,
    },
    /// A chunk a manifest names is not on the target.
    #[error(
        "backup {backup}: chunk {index} at offset {offset} (blake3 {hash}) is missing from the target",
        offset = .index * CHUNK_SIZE
    )]
    ChunkMissing {
        /// The backup.
        backup: BackupRef,
        /// The chunk's index (its offset over [`CHUNK_SIZE`]).
        index: u64,
        /// The chunk's BLAKE3 hash, as the manifest names it.
        hash: String,
    },
    /// A chunk's bytes do not hash to its name, or it has the wrong length.
    #[error(
        "backup {backup}: chunk {index} at offset {offset} (blake3 {hash}) is corrupt: its bytes hash to {found}",
        offset = .index * CHUNK_SIZE
    )]
    ChunkCorrupt {
        /// The backup.
        backup: BackupRef,
        /// The chunk's index (its offset over [`CHUNK_SIZE`]).
        index: u64,
        /// The chunk's BLAKE3 hash, as the manifest names it.
        hash: String,
        /// The BLAKE3 hash of the bytes the target has (and their length when that differs).
        found: String,
    },
    /// Reading or writing the image file failed.
    #[error("backup {backup}: {action}: {source}")]
    Image {
        /// The backup.
        backup: BackupRef,
        /// What was being done.
        action: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A standby refuses to apply `next` onto the `held` backup it holds:
    /// they are not two backups of one image, in order, cut alike.
    #[error("standby holding backup {held}: backup {next} cannot be applied onto it: {reason}")]
    StandbyMismatch {
        /// The backup the standby file holds.
        held: BackupRef,
        /// The backup that was to be applied.
        next: BackupRef,
        /// Which rule it breaks.
        reason: String,
    },
    /// Reading or writing a standby's journal failed, or the journal was
    /// not the new, empty file an apply writes into.
    #[error("standby journal: {action}: {source}")]
    Journal {
        /// What was being done, naming the backup where known.
        action: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A running backup could not refresh its lease for so long that a
    /// garbage collection may take it for a crashed one; its chunks are no
    /// longer safe, so it stops without a manifest.
    #[error(
        "backup {backup}: its lease on {target} was last refreshed {secs} s ago; a gc may treat it as stale after {stale} s, so the backup stops",
        stale = crate::terms::LEASE_STALE.as_secs()
    )]
    LeaseLost {
        /// The backup.
        backup: BackupRef,
        /// The target.
        target: String,
        /// Seconds since the last successful refresh.
        secs: u64,
    },
    /// Garbage collection will not delete anything: it cannot tell which
    /// chunks an object it must read references.
    #[error("gc on {target} refused: {reason}")]
    GcRefused {
        /// The target.
        target: String,
        /// Why, naming the object.
        reason: String,
    },
    /// Another gc holds the target's gc lock.
    #[error(
        "gc on {target} refused: another gc is running there ({holder}); try again when it ends"
    )]
    GcBusy {
        /// The target.
        target: String,
        /// Who holds the lock, and since when.
        holder: String,
    },
}

/// An error and its causes, `: `-joined, each only when it adds to the one
/// before (libraries often repeat their cause in their own message).
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = c.source();
    }
    out
}

/// A task's result; a panic in it is raised again here, since only a bug
/// panics and no task is aborted while awaited.
pub(crate) fn joined<T>(r: std::result::Result<T, tokio::task::JoinError>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}
