//! Backups of image files on a target — a local directory (or NFS mount)
//! or S3-compatible object storage — as content-addressed chunks plus a
//! manifest; and their restore, verification and garbage collection.
//!
//! # Layout on the target
//!
//! Everything lives under the target's prefix:
//!
//! - `chunks/<first 2 hex digits>/<64-hex BLAKE3>`: a chunk's bytes,
//!   uncompressed. Content addressed, so putting one again is harmless.
//! - `backups/<uuid>.json`: a finished backup's [`Manifest`]. Written last,
//!   only once every chunk it names is stored: an incomplete backup never
//!   has one.
//! - `leases/<uuid>.json`: a running backup's lease
//!   `{ "backup": uuid, "owner": string, "started_at": rfc3339 }`: put at
//!   its start, put again every [`LEASE_REFRESH`] while it runs, deleted at
//!   its end (success, failure or cancel).
//! - `deleted/<uuid>.json`: a tombstone, the manifest of a deleted backup.
//!   Deleting puts the tombstone, then deletes the manifest.
//! - `gc/<uuid>`: for a moment during a gc, an object whose time is the
//!   target's clock.
//!
//! An image is cut into [`CHUNK_SIZE`] chunks. A manifest lists the chunks
//! holding data by ascending index; an index it leaves out is all zeros (a
//! hole, or data that reads as zeros). It carries a checksum of itself, so
//! a manifest changed after it was written is [`Error::ManifestCorrupt`].
//!
//! # Deduplication and garbage collection
//!
//! A backup deduplicates only against chunks *referenced by a manifest it
//! listed after putting its lease*, plus those it uploaded itself in this
//! run. Any other chunk is uploaded, even when a copy is stored already
//! (an orphan from a cancelled or deleted backup): putting it again is
//! idempotent and makes its `last_modified` new.
//!
//! [`gc`] reads the target's clock, G (it puts `gc/<uuid>` and reads the
//! object's `last_modified` back), then lists, in this order: (1) the
//! chunks, with their `last_modified`; (2) the leases; (3) the manifests,
//! then the tombstones. Then:
//!
//! - A lease is *live* when its `last_modified` is within [`LEASE_STALE`]
//!   of the newest `last_modified` in the chunk and lease listings, or of
//!   G. Other leases are *stale* (their backup crashed, or lost the target
//!   for so long that it stopped itself) and are deleted. (So a crashed
//!   backup's lease that is the newest object stays live until something
//!   newer is written or its service restarts and releases it: gc then
//!   deletes less, never more.)
//! - L is the earliest `started_at` of the live leases less
//!   [`CLOCK_MARGIN`] (for the backup's clock against the target's); with
//!   no live lease there is no L. A live lease that does not parse gives
//!   the earliest L possible.
//! - A chunk is kept when a manifest references it; or when L exists and
//!   its `last_modified` ≥ L; or when a tombstone whose `last_modified` ≥
//!   min(L, G) (G alone without L) references it. Every other chunk is
//!   deleted — unless it was written again since it was listed (its time
//!   or entity tag changed), which is checked just before each delete.
//! - Tombstones whose `last_modified` < min(L, G) are deleted (those older
//!   than G when there is no L).
//!
//! Why this is safe: a running backup B references only chunks that a
//! manifest referenced when B started, and chunks B put itself.
//!
//! - If gc saw B's lease: a manifest B listed that is still there keeps
//!   its chunks by reference; one deleted since has a tombstone put after
//!   B started, so at or after L, which keeps them. The chunks B put are
//!   newer than B's start, so at or after L; or, put after gc listed the
//!   chunks, not listed at all or found rewritten before the delete.
//! - If gc did not see B's lease, B either ended before gc listed the
//!   leases — then its manifest, written before, is listed after and keeps
//!   its chunks — or started after that listing, so after G. Then the
//!   chunks it puts come after the chunk listing (not listed, or found
//!   rewritten); and of the manifests it lists, one gc listed too keeps
//!   its chunks, one deleted before gc listed the manifests has a
//!   tombstone newer than G that keeps them, and one made after gc listed
//!   the manifests holds chunks its own backup put or took from an older
//!   manifest, where the same reasoning applies again.
//!
//! What is left is the moment between the check and the delete of an
//! orphan chunk, in which a backup would have to put that chunk again. A
//! gc run at the same time as another gc is not covered: run one at a time.
//!
//! A backup that cannot refresh its lease for half of [`LEASE_STALE`]
//! stops refreshing and fails ([`Error::LeaseLost`]) before it writes a
//! manifest, since a gc may treat its lease as stale after [`LEASE_STALE`].
//! A service at its start deletes the leases it owns
//! ([`release_leases`]): it runs no backup then, so they are a crash's.

mod backup;
mod config;
mod error;
mod gc;
mod manifest;
mod restore;
mod target;

#[cfg(test)]
mod tests;

use std::time::Duration;

pub use backup::{BackupMeta, Counters, Lease, UPLOAD_CONCURRENCY, backup};
pub use config::{Credentials, DEFAULT_REGION, TargetConfig};
pub use error::{BackupRef, Error, Result};
pub use gc::{GcReport, gc, release_leases};
pub use manifest::{
    ChunkRef, FORMAT, ImageMeta, Manifest, SourceMeta, delete, list, list_all, manifest,
};
pub use restore::{FETCH_CONCURRENCY, VerifyReport, restore, verify};
pub use target::Target;

/// The bytes of a chunk (all but possibly an image's last).
pub const CHUNK_SIZE: u64 = 4 << 20;

/// A lease not written for this long is a crashed backup's.
pub const LEASE_STALE: Duration = Duration::from_secs(10 * 60);

/// How often a running backup puts its lease again.
pub const LEASE_REFRESH: Duration = Duration::from_secs(30);

/// How far a backup's clock may be off the target's: gc keeps chunks
/// from this long before a running backup's start.
pub const CLOCK_MARGIN: Duration = Duration::from_secs(2 * 60);

/// A task's result; a panic in it is raised again here, since only a bug
/// panics and no task is aborted while awaited.
fn joined<T>(r: std::result::Result<T, tokio::task::JoinError>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}
