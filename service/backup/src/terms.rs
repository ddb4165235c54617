//! The fixed terms of backups on a target: the chunk an image is cut into,
//! and how long a backup's lease or gc's lock lives without being put
//! again. Every module reads them here; none of them decides one.

use std::time::Duration;

/// The bytes of a chunk (all but possibly an image's last).
pub const CHUNK_SIZE: u64 = 4 << 20;

/// A lease not written for this long is a crashed backup's.
pub const LEASE_STALE: Duration = Duration::from_secs(10 * 60);

/// How often a running backup puts its lease again.
pub const LEASE_REFRESH: Duration = refresh_of(LEASE_STALE);

/// How far the clock of a backup of blockplane before 0.24 may be off the
/// target's: gc keeps chunks from this long before such a backup's start.
/// A newer backup's lease names its start on the target's clock.
pub const CLOCK_MARGIN: Duration = Duration::from_secs(2 * 60);

/// A gc lock not written for this long is a crashed gc's.
pub const GC_LOCK_STALE: Duration = Duration::from_secs(2 * 60);

/// How often a lease of that staleness is put again: twenty times within
/// it, so a few failed puts in a row do not lose it.
pub(crate) const fn refresh_of(stale: Duration) -> Duration {
    Duration::from_secs(stale.as_secs() / 20)
}
