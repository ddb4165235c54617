//! Garbage collection: chunks no backup needs, tombstones no running backup
//! needs, stale leases. The rules, and why they are safe, are in the crate
//! doc.

use std::collections::HashSet;

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::backup::Lease;
use crate::manifest::{Manifest, id_of, is_hash};
use crate::target::Listed;
use crate::{CLOCK_MARGIN, Error, LEASE_STALE, Result, Target};

/// Objects read or deleted at once.
const CONCURRENCY: usize = 16;

/// What [`gc`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Chunks left on the target.
    pub chunks_kept: u64,
    /// Chunks deleted.
    pub chunks_deleted: u64,
    /// Bytes of the chunks deleted.
    pub bytes_deleted: u64,
    /// Backups running (live leases) while it ran.
    pub running_backups: u64,
    /// Tombstones deleted.
    pub tombstones_deleted: u64,
    /// Stale leases deleted.
    pub leases_deleted: u64,
}

/// A lease as listed: the object, and its contents when they parse.
struct LeaseSeen {
    listed: Listed,
    lease: Option<Lease>,
}

/// Deletes chunks no manifest references, safe against backups running at
/// the same time (the crate doc has the rules). Also deletes tombstones no
/// longer needed and stale leases.
pub async fn gc(target: &Target) -> Result<GcReport> {
    let now = target_now(target).await?;

    // The order matters (crate doc): chunks, leases, manifests, tombstones.
    let chunks: Vec<Listed> = target
        .list("chunks")
        .await?
        .into_iter()
        .filter(|c| is_hash(&c.name))
        .collect();
    let leases = read_leases(target).await?;
    let referenced = read_manifests(target).await?;
    let tombstones: Vec<(Uuid, Listed)> = target
        .list("deleted")
        .await?
        .into_iter()
        .filter_map(|l| id_of(&l.name).map(|id| (id, l)))
        .collect();

    // Live when recent by either clock: the earlier of the two decides, so
    // an object dated ahead (a skewed writer) cannot make leases stale.
    let newest = chunks
        .iter()
        .map(|c| c.last_modified)
        .chain(leases.iter().map(|l| l.listed.last_modified))
        .max();
    let reference = newest.map_or(now, |n| n.min(now));
    let (live, stale): (Vec<&LeaseSeen>, Vec<&LeaseSeen>) = leases
        .iter()
        .partition(|l| l.listed.last_modified >= reference - LEASE_STALE);
    // L: the earliest start of a running backup, less the margin for its
    // clock against the target's. A live lease that does not parse could
    // be of any start: everything is protected.
    let since = live
        .iter()
        .map(|l| match &l.lease {
            Some(lease) => lease.started_at - CLOCK_MARGIN,
            None => OffsetDateTime::UNIX_EPOCH,
        })
        .min();
    // A backup that started after the leases were listed is unseen, but it
    // started after `now`: tombstones from then on are kept for it.
    let tombstones_since = since.map_or(now, |s| s.min(now));

    let recent: Vec<(Uuid, Path)> = tombstones
        .iter()
        .filter(|(_, t)| t.last_modified >= tombstones_since)
        .map(|(id, t)| (*id, t.path.clone()))
        .collect();
    // Streams of owned items, so the future stays `Send` for any lifetime
    // (borrowed items make `tokio::spawn` of it fail to type-check).
    let protected: HashSet<String> = futures_util::stream::iter(recent)
        .map(|(id, path)| async move { read_chunks_of(target, id, &path).await })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?
        .into_iter()
        .flatten()
        .collect();

    let mut report = GcReport {
        running_backups: live.len() as u64,
        ..GcReport::default()
    };
    let doomed: Vec<Listed> = chunks
        .iter()
        .filter(|c| {
            let keep = referenced.contains(&c.name)
                || protected.contains(&c.name)
                || since.is_some_and(|s| c.last_modified >= s);
            !keep
        })
        .cloned()
        .collect();
    let deleted = futures_util::stream::iter(doomed)
        .map(|c| async move { delete_chunk(target, &c).await })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?;
    for bytes in deleted.into_iter().flatten() {
        report.chunks_deleted += 1;
        report.bytes_deleted += bytes;
    }
    report.chunks_kept = chunks.len() as u64 - report.chunks_deleted;

    let old_tombstones = tombstones
        .iter()
        .filter(|(_, t)| t.last_modified < tombstones_since)
        .map(|(_, t)| t.path.clone())
        .collect();
    report.tombstones_deleted = delete_all(target, old_tombstones).await?;
    let stale = stale.iter().map(|l| l.listed.path.clone()).collect();
    report.leases_deleted = delete_all(target, stale).await?;

    tracing::info!(
        target = target.describe(),
        chunks_kept = report.chunks_kept,
        chunks_deleted = report.chunks_deleted,
        bytes_deleted = report.bytes_deleted,
        running_backups = report.running_backups,
        "backup gc finished"
    );
    Ok(report)
}

/// Deletes the leases `owner` put before `started_before`; their number.
/// Called at service start with the process's start: a restarted service
/// ran no backup before it started, so those leases are from a crash, and
/// a backup it started since keeps its own.
pub async fn release_leases(
    target: &Target,
    owner: &str,
    started_before: OffsetDateTime,
) -> Result<u64> {
    let leases = read_leases(target).await?;
    let mine = leases
        .iter()
        .filter(|l| {
            l.lease
                .as_ref()
                .is_some_and(|lease| lease.owner == owner && lease.started_at < started_before)
        })
        .map(|l| l.listed.path.clone())
        .collect();
    delete_all(target, mine).await
}

/// The target's clock: the time it gives an object put now. A target that
/// cannot be written to cannot be collected either.
async fn target_now(target: &Target) -> Result<OffsetDateTime> {
    let marker = target.path(&format!("gc/{}", Uuid::new_v4()));
    target.put(&marker, Bytes::from_static(b"gc\n")).await?;
    let head = target.head(&marker).await;
    if let Err(e) = target.delete(&marker).await {
        tracing::warn!(target = target.describe(), error = %e, "gc's clock marker could not be deleted");
    }
    match head? {
        Some(m) => Ok(m.last_modified),
        None => Err(Error::GcRefused {
            target: target.describe().to_string(),
            reason: format!("{marker}, just written to read the target's clock, is not there"),
        }),
    }
}

/// Every lease. One that does not parse is kept as such: gc
/// treats it as a live backup of unknown start, and nothing deletes it
/// until it goes stale.
async fn read_leases(target: &Target) -> Result<Vec<LeaseSeen>> {
    let listed = target.list("leases").await?;
    let read = futures_util::stream::iter(listed)
        .map(|l| async move {
            let Some(data) = target.get(&l.path).await? else {
                // Deleted since listed: its backup ended.
                return Ok(None);
            };
            let lease = serde_json::from_slice::<Lease>(&data)
                .inspect_err(|e| {
                    tracing::warn!(target = target.describe(), lease = %l.path, error = %e, "a lease does not parse");
                })
                .ok();
            Ok::<_, Error>(Some(LeaseSeen { listed: l, lease }))
        })
        .buffer_unordered(CONCURRENCY)
        .try_filter_map(|l| async move { Ok(l) })
        .try_collect::<Vec<_>>()
        .await?;
    Ok(read)
}

/// The chunks every manifest references. A manifest is read without its
/// checks (one altered since still names the chunks it needs); one that is
/// not JSON of a manifest stops the gc, since its chunks are unknown.
async fn read_manifests(target: &Target) -> Result<HashSet<String>> {
    let listed: Vec<(Uuid, Listed)> = target
        .list("backups")
        .await?
        .into_iter()
        .filter_map(|l| id_of(&l.name).map(|id| (id, l)))
        .collect();
    let read = futures_util::stream::iter(listed)
        .map(|(id, l)| async move { read_chunks_of(target, id, &l.path).await })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(read.into_iter().flatten().collect())
}

/// The chunk hashes a manifest or tombstone names; none when it is gone.
async fn read_chunks_of(target: &Target, id: Uuid, path: &Path) -> Result<Vec<String>> {
    let Some(data) = target.get(path).await? else {
        // A manifest deleted since listed has its tombstone, listed after;
        // a tombstone deleted since, another gc's work.
        return Ok(Vec::new());
    };
    match Manifest::from_bytes_unchecked(id, &data) {
        Ok(m) => Ok(m.chunks.into_iter().map(|c| c.hash).collect()),
        Err(e) => Err(Error::GcRefused {
            target: target.describe().to_string(),
            reason: format!(
                "{path} cannot be read, so which chunks it needs is unknown ({e}); repair it, or delete it if its backup is not wanted"
            ),
        }),
    }
}

/// Deletes a chunk unless it was written again since it was listed (a
/// backup that started after the leases were listed re-put it); the bytes
/// deleted.
pub(crate) async fn delete_chunk(target: &Target, c: &Listed) -> Result<Option<u64>> {
    let Some(now) = target.head(&c.path).await? else {
        return Ok(None);
    };
    // S3 gives a listing's times in milliseconds and a HEAD's in seconds:
    // compare whole seconds, and the entity tag, which a local directory
    // derives from the inode and mtime.
    let rewritten = now.last_modified.unix_timestamp() > c.last_modified.unix_timestamp()
        || (c.e_tag.is_some() && now.e_tag.is_some() && c.e_tag != now.e_tag);
    if rewritten {
        return Ok(None);
    }
    target.delete(&c.path).await?;
    Ok(Some(c.size))
}

async fn delete_all(target: &Target, paths: Vec<Path>) -> Result<u64> {
    let n = futures_util::stream::iter(paths)
        .map(|p| async move { target.delete(&p).await })
        .buffer_unordered(CONCURRENCY)
        .try_fold(0u64, |n, ()| async move { Ok(n + 1) })
        .await?;
    Ok(n)
}
