//! Garbage collection: chunks no backup needs, tombstones no running backup
//! needs, stale leases. The rules, and why they are safe, are in the crate
//! doc.

use std::collections::HashSet;

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path;
use time::OffsetDateTime;
use uuid::Uuid;

use serde::{Deserialize, Serialize};

use crate::backup::Lease;
use crate::error::{Error, Result};
use crate::lease::Held;
use crate::manifest::{Manifest, id_of, is_hash};
use crate::target::{Listed, Target};
use crate::terms::{CLOCK_MARGIN, GC_LOCK_STALE, LEASE_STALE};

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

/// Where a test holds a gc (after it read the manifests, before it lists
/// the tombstones): told when it gets there, it waits to be let go.
pub(crate) struct Pause {
    pub reached: tokio::sync::oneshot::Sender<()>,
    pub resume: tokio::sync::oneshot::Receiver<()>,
}

/// Deletes chunks no manifest references, safe against backups running at
/// the same time (the crate doc has the rules). Also deletes tombstones no
/// longer needed and stale leases. One gc runs on a target at a time: while
/// another service's (or this one's) holds the target's gc lock, this one
/// is refused ([`Error::GcBusy`]) and deletes nothing. `owner` names this
/// service in the lock, as in a backup's lease.
pub async fn gc(target: &Target, owner: &str) -> Result<GcReport> {
    collect(target, owner, None).await
}

/// [`gc`], held at `pause` when one is given.
pub(crate) async fn collect(
    target: &Target,
    owner: &str,
    pause: Option<Pause>,
) -> Result<GcReport> {
    let lock = GcLock::take(target, owner).await?;
    let result = run(target, &lock, pause).await;
    lock.release(target).await;
    result
}

async fn run(target: &Target, lock: &GcLock, pause: Option<Pause>) -> Result<GcReport> {
    // G: the target's clock as the gc began.
    let now = lock.began;

    // The order matters (crate doc): chunks, leases, manifests, tombstones.
    let chunks: Vec<Listed> = target
        .list("chunks")
        .await?
        .into_iter()
        .filter(|c| is_hash(&c.name))
        .collect();
    let leases = read_leases(target).await?;
    let referenced = read_manifests(target).await?;
    if let Some(p) = pause {
        let _ = p.reached.send(());
        let _ = p.resume.await;
    }
    let tombstones: Vec<(Uuid, Listed)> = target
        .list("deleted")
        .await?
        .into_iter()
        .filter_map(|l| id_of(&l.name).map(|id| (id, l)))
        .collect();

    let (live, stale) = split_leases(&chunks, &leases, now);
    // L: the earliest start of a running backup, on the target's clock.
    let since = live.iter().map(|l| started(l)).min();
    // A backup that started after the leases were listed is unseen, but it
    // started after `now`: tombstones from then on are kept for it.
    let tombstones_since = since.map_or(now, |s| s.min(now));

    let protected = named_by_tombstones(target, &tombstones, tombstones_since).await?;

    let mut report = GcReport {
        running_backups: live.len() as u64,
        ..GcReport::default()
    };
    // A chunk of G's own second or later is left to the next gc: S3 tells
    // a chunk's time to the second at the delete, so only a time before
    // G's second shows that it was not written again since it was listed.
    let doomed: Vec<Listed> = chunks
        .iter()
        .filter(|c| {
            let keep = referenced.contains(&c.name)
                || protected.contains(&c.name)
                || since.is_some_and(|s| c.last_modified >= s)
                || c.last_modified >= now;
            !keep
        })
        .cloned()
        .collect();
    for bytes in delete_chunks(target, lock, doomed, now).await? {
        report.chunks_deleted += 1;
        report.bytes_deleted += bytes;
    }
    report.chunks_kept = chunks.len() as u64 - report.chunks_deleted;

    let old_tombstones = tombstones
        .iter()
        .filter(|(_, t)| t.last_modified < tombstones_since)
        .map(|(_, t)| t.path.clone())
        .collect();
    lock.check(target)?;
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

/// The leases of running backups, and the stale ones a crash left. Live
/// when recent by either clock: the earlier of the two decides, so an
/// object dated ahead (a skewed writer) cannot make leases stale.
fn split_leases<'a>(
    chunks: &[Listed],
    leases: &'a [LeaseSeen],
    now: OffsetDateTime,
) -> (Vec<&'a LeaseSeen>, Vec<&'a LeaseSeen>) {
    let newest = chunks
        .iter()
        .map(|c| c.last_modified)
        .chain(leases.iter().map(|l| l.listed.last_modified))
        .max();
    let reference = newest.map_or(now, |n| n.min(now));
    leases
        .iter()
        .partition(|l| l.listed.last_modified >= reference - LEASE_STALE)
}

/// The chunks the manifests of backups deleted since `since` named (their
/// tombstones say which): a backup that began before the delete may
/// still leave them out as found.
async fn named_by_tombstones(
    target: &Target,
    tombstones: &[(Uuid, Listed)],
    since: OffsetDateTime,
) -> Result<HashSet<String>> {
    let recent: Vec<(Uuid, Path)> = tombstones
        .iter()
        .filter(|(_, t)| t.last_modified >= since)
        .map(|(id, t)| (*id, t.path.clone()))
        .collect();
    // Streams of owned items, so the future stays `Send` for any lifetime
    // (borrowed items make `tokio::spawn` of it fail to type-check).
    Ok(futures_util::stream::iter(recent)
        .map(|(id, path)| async move { read_chunks_of(target, id, &path).await })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?
        .into_iter()
        .flatten()
        .collect())
}

/// Deletes `doomed` while `lock` holds; the bytes of each chunk deleted
/// (one written again since it was listed stays).
async fn delete_chunks(
    target: &Target,
    lock: &GcLock,
    doomed: Vec<Listed>,
    now: OffsetDateTime,
) -> Result<Vec<u64>> {
    let deleted = futures_util::stream::iter(doomed)
        .map(|c| async move {
            lock.check(target)?;
            delete_chunk(target, &c, now).await
        })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(deleted.into_iter().flatten().collect())
}

/// Deletes the leases and gc locks `owner` put before `started_before`;
/// their number.
/// Called at service start with the process's start: a restarted service
/// ran no backup before it started, so those leases are from a crash, and
/// a backup it started since keeps its own.
pub async fn release_leases(
    target: &Target,
    owner: &str,
    started_before: OffsetDateTime,
) -> Result<u64> {
    let leases = read_leases(target).await?;
    let mine: Vec<Path> = leases
        .iter()
        .filter(|l| {
            l.lease
                .as_ref()
                .is_some_and(|lease| lease.owner == owner && lease.started_at < started_before)
        })
        .map(|l| l.listed.path.clone())
        .collect();
    let gcs: Vec<Path> = read_gc_locks(target)
        .await?
        .into_iter()
        .filter(|(_, lock)| {
            lock.as_ref()
                .is_some_and(|l| l.owner == owner && l.started_at < started_before)
        })
        .map(|(listed, _)| listed.path)
        .collect();
    let n = delete_all(target, mine).await?;
    Ok(n + delete_all(target, gcs).await?)
}

/// When a running backup began, on the target's clock: what its lease
/// says (put there before the backup listed anything), else (its first put,
/// or a lease of blockplane before 0.24) its time by its host's clock less
/// [`CLOCK_MARGIN`], or the lease's own time if earlier. A live lease that
/// does not parse could be of any start: everything is protected.
fn started(l: &LeaseSeen) -> OffsetDateTime {
    match &l.lease {
        Some(Lease {
            started_on_target: Some(t),
            ..
        }) => *t,
        Some(lease) => (lease.started_at - CLOCK_MARGIN).min(l.listed.last_modified),
        None => OffsetDateTime::UNIX_EPOCH,
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

/// Deletes a chunk listed with a time before `began` (G, gc's start on the
/// target's clock) unless it was written again since it was listed (a
/// backup that started after the leases were listed re-put it); the bytes
/// deleted.
pub(crate) async fn delete_chunk(
    target: &Target,
    c: &Listed,
    began: OffsetDateTime,
) -> Result<Option<u64>> {
    let Some(now) = target.head(&c.path).await? else {
        return Ok(None);
    };
    // A put since the listing came after G. S3 gives a HEAD's time in whole
    // seconds, truncated, and G is one too: such a put reads as G's second
    // or later even within it, where its entity tag (the MD5 of the same
    // bytes) and a time compared to the second would not tell it apart. A
    // directory's entity tag (inode and mtime) tells it too.
    let rewritten = now.last_modified >= began
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

/// A gc lock, `gc/lock-<uuid>.json`.
#[derive(Debug, Serialize, Deserialize)]
struct GcLockBody {
    /// The gc's own id (the object's name).
    gc: Uuid,
    /// The service instance running it.
    owner: String,
    /// When it started by its host's clock (for people, and for
    /// [`release_leases`] on the same host).
    #[serde(with = "time::serde::rfc3339")]
    started_at: OffsetDateTime,
}

/// The target's gc lock, held: one object per gc, put again while it runs.
/// A gc that finds another's live lock beside its own takes its own back
/// and is refused; two that start together may both be refused, never both
/// run. The lock needs no conditional put, which not every S3-compatible
/// server has.
struct GcLock {
    held: Held,
    path: Path,
    /// G: when the lock was put, on the target's clock.
    began: OffsetDateTime,
}

impl GcLock {
    async fn take(target: &Target, owner: &str) -> Result<GcLock> {
        let id = Uuid::new_v4();
        let path = target.path(&format!("gc/{LOCK_PREFIX}{id}.json"));
        let body = GcLockBody {
            gc: id,
            owner: owner.to_string(),
            started_at: OffsetDateTime::now_utc(),
        };
        let body = Bytes::from(serde_json::to_vec(&body).expect("a gc lock always serializes"));
        let (held, began) = Held::take(target, &path, body, GC_LOCK_STALE).await?;
        let lock = GcLock { held, path, began };
        let others = match read_gc_locks(target).await {
            Ok(all) => all,
            Err(e) => {
                lock.release(target).await;
                return Err(e);
            }
        };
        let (live, stale): (Vec<_>, Vec<_>) = others
            .into_iter()
            .filter(|(l, _)| l.path != lock.path)
            .partition(|(l, _)| l.last_modified >= began - GC_LOCK_STALE);
        if let Some((l, body)) = live.first() {
            lock.release(target).await;
            let who = body
                .as_ref()
                .map_or("a service".to_string(), |b| format!("service {}", b.owner));
            return Err(Error::GcBusy {
                target: target.describe().to_string(),
                holder: format!(
                    "{who}, its lock {} last put at {}",
                    l.path,
                    l.last_modified
                        .format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default()
                ),
            });
        }
        // A crashed gc's: it stopped itself before it went stale.
        let stale = stale.into_iter().map(|(l, _)| l.path).collect();
        if let Err(e) = delete_all(target, stale).await {
            tracing::warn!(target = target.describe(), error = %e, "a stale gc lock could not be deleted");
        }
        Ok(lock)
    }

    /// Fails once the lock has gone unrefreshed for half of
    /// [`GC_LOCK_STALE`], before another gc may take it for a crashed one's.
    fn check(&self, target: &Target) -> Result<()> {
        match self.held.lost() {
            Some(secs) => Err(Error::GcRefused {
                target: target.describe().to_string(),
                reason: format!(
                    "its lock {} was last put {secs} s ago, and another gc may take it for stale after {} s: it stops",
                    self.path,
                    GC_LOCK_STALE.as_secs()
                ),
            }),
            None => Ok(()),
        }
    }

    async fn release(self, target: &Target) {
        self.held.stop().await;
        if let Err(e) = target.delete(&self.path).await {
            // It goes stale, and its service deletes it at its next start.
            tracing::warn!(target = target.describe(), lock = %self.path, error = %e, "a gc lock could not be deleted");
        }
    }
}

/// The name every gc lock's begins with, under `gc/`.
const LOCK_PREFIX: &str = "lock-";

/// Every gc lock, with its contents when they parse.
async fn read_gc_locks(target: &Target) -> Result<Vec<(Listed, Option<GcLockBody>)>> {
    let listed: Vec<Listed> = target
        .list("gc")
        .await?
        .into_iter()
        .filter(|l| l.name.starts_with(LOCK_PREFIX))
        .collect();
    futures_util::stream::iter(listed)
        .map(|l| async move {
            let body = target
                .get(&l.path)
                .await?
                .and_then(|b| serde_json::from_slice::<GcLockBody>(&b).ok());
            Ok::<_, Error>((l, body))
        })
        .buffer_unordered(CONCURRENCY)
        .try_collect()
        .await
}
