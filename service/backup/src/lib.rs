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
//!   `{ "backup": uuid, "owner": string, "started_at": rfc3339,
//!   "started_on_target": rfc3339 }`: put at its start, read back for the
//!   time the target gave it, put again naming that time
//!   (`started_on_target`), put again every [`LEASE_REFRESH`] while it
//!   runs, deleted at its end (success, failure or cancel).
//! - `deleted/<uuid>.json`: a tombstone, the manifest of a deleted backup.
//!   Deleting puts the tombstone, then deletes the manifest.
//! - `gc/lock-<uuid>.json`: a running gc's lock
//!   `{ "gc": uuid, "owner": string, "started_at": rfc3339 }`, put again
//!   every [`GC_LOCK_STALE`]/20 while it runs; its first time on the
//!   target is the gc's clock, G.
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
//! A referenced chunk is not taken on trust: once per backup it is looked
//! at on the target (`Target::holds_chunk`). On S3, one HEAD: its size, and
//! its entity tag against the MD5 of the bytes in hand (a single-part put's
//! tag is the MD5 of its bytes; a tag of another form, multipart or
//! SSE-KMS, is not, and then presence and size decide): 256 HEAD requests
//! per GiB of unchanged data, and no GET. On a directory, whose entity tag
//! is of the inode and time, the file is read back and compared: one local
//! (or NFS) read of what is reused. A chunk missing, of another length or
//! of other bytes is put again, which mends every earlier backup that
//! names it; the backup is never `done` over a hole.
//!
//! One gc runs on a target at a time. [`gc`] puts its lock, reads the
//! time the target gave it, G, and lists the other locks: a live one (put
//! within [`GC_LOCK_STALE`] of G) means another gc runs, and this one takes
//! its lock back and is refused ([`Error::GcBusy`]); stale ones are a
//! crashed gc's and are deleted. (Two gcs that start together may both be
//! refused; never both run. No conditional put is needed.) A gc that cannot
//! put its lock again for half of [`GC_LOCK_STALE`] stops before its next
//! delete. Then it lists, in this order: (1) the chunks, with their
//! `last_modified`; (2) the leases; (3) the manifests, then the
//! tombstones. Then:
//!
//! - A lease is *live* when its `last_modified` is within [`LEASE_STALE`]
//!   of the newest `last_modified` in the chunk and lease listings, or of
//!   G. Other leases are *stale* (their backup crashed, or lost the target
//!   for so long that it stopped itself) and are deleted. (So a crashed
//!   backup's lease that is the newest object stays live until something
//!   newer is written or its service restarts and releases it: gc then
//!   deletes less, never more.)
//! - L is the earliest start of the live leases, on the target's clock:
//!   a lease's `started_on_target`, else (its first put, or a lease of
//!   blockplane before 0.24) the earlier of its own `last_modified` and its
//!   `started_at` less [`CLOCK_MARGIN`]; with no live lease there is no L.
//!   A live lease that does not parse gives the earliest L possible. Every
//!   time gc compares is the target's: a backing-up host's clock, however
//!   far off, changes nothing.
//! - A chunk is kept when a manifest references it; or when L exists and
//!   its `last_modified` ≥ L; or when a tombstone whose `last_modified` ≥
//!   min(L, G) (G alone without L) references it; or when its
//!   `last_modified` ≥ G (the next gc decides). Every other chunk is
//!   deleted — unless a HEAD just before the delete finds it written
//!   again since it was listed: a time ≥ G, or another entity tag. (S3's
//!   HEAD gives whole seconds, truncated, as does G: a chunk put again
//!   within G's own second still reads ≥ G, where the MD5 entity tag of
//!   the same bytes would not tell it apart.)
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
//! orphan chunk, in which a backup would have to put that chunk again. Two
//! gcs at once are not covered by this reasoning (one may delete a
//! tombstone the other has yet to read), which is why the lock allows one.
//!
//! A backup that cannot refresh its lease for half of [`LEASE_STALE`]
//! stops refreshing and fails ([`Error::LeaseLost`]) before it writes a
//! manifest, since a gc may treat its lease as stale after [`LEASE_STALE`].
//! A service at its start deletes the leases it owns
//! ([`release_leases`]): it runs no backup then, so they are a crash's.
//!
//! # Standby images
//!
//! A standby is a file holding one backup's bytes, kept current by
//! [`standby::apply`]ing each newer backup of the same image onto it in
//! place: only the chunks that differ ([`standby::Delta`]) are fetched,
//! into a redo journal first, and the file is touched only once that
//! journal is complete and synced. After a crash, [`standby::recover`]
//! replays a complete journal or discards an incomplete one, so the file
//! holds one backup or the other, never a mix. The method, the journal's
//! format and its cost are in [`standby`].

mod backup;
mod config;
mod error;
mod gc;
mod lease;
mod manifest;
mod restore;
pub mod retention;
pub mod standby;
mod target;
mod terms;

#[cfg(test)]
mod tests;

pub use backup::{BackupMeta, Counters, Lease, UPLOAD_CONCURRENCY, backup};
pub use config::{Credentials, DEFAULT_REGION, TargetConfig};
pub use error::{BackupRef, Error, Result};
pub use gc::{GcReport, gc, release_leases};
pub use manifest::{
    ChunkRef, FORMAT, ImageMeta, Manifest, SourceMeta, delete, list, list_all, manifest,
};
pub use restore::{FETCH_CONCURRENCY, VerifyReport, restore, verify};
pub use target::{DEFAULT_TIMEOUT, Target};
pub use terms::{CHUNK_SIZE, CLOCK_MARGIN, GC_LOCK_STALE, LEASE_REFRESH, LEASE_STALE};
