//! Taking a backup: the lease, the data ranges of the image read a chunk at
//! a time, the chunks the target lacks uploaded, the manifest written last.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use blockplane_system::image::AllocateJob;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::error::{BackupRef, Error, Result, joined};
use crate::lease::Held;
use crate::manifest::{self, ChunkRef, FORMAT, ImageMeta, Manifest, SourceMeta};
use crate::target::{Holding, Target};
use crate::terms::{CHUNK_SIZE, LEASE_STALE};

/// Chunk uploads in flight at once; with the chunk being read, the memory a
/// backup holds is at most this many chunks plus one.
pub const UPLOAD_CONCURRENCY: usize = 4;

/// What a backup is of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupMeta {
    /// The new backup's id (its manifest's name).
    pub id: Uuid,
    /// The backup's name.
    pub name: String,
    /// The image.
    pub image: ImageMeta,
    /// Where it is taken; `source.service` owns the lease.
    pub source: SourceMeta,
    /// The moment the data is of.
    pub created_at: OffsetDateTime,
}

/// The counts of a backup, readable while it runs (its progress in bytes
/// is the job's `done_bytes` and `total_bytes`).
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes put to the target.
    pub uploaded_bytes: AtomicU64,
    /// Bytes of chunks found stored already.
    pub deduplicated_bytes: AtomicU64,
}

/// A running backup's lease, `leases/<id>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The backup's id.
    pub backup: Uuid,
    /// The service instance running it.
    pub owner: String,
    /// When it started by its host's clock, before it listed the manifests
    /// it deduplicates against: for people and for [`crate::release_leases`]
    /// (the same host's clock); gc does not trust it.
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    /// When its first put reached the target, by the target's clock: what
    /// gc keeps chunks from. `None` in the lease's first put (gc then takes
    /// that put's own time) and in leases of blockplane before 0.24.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub started_on_target: Option<OffsetDateTime>,
}

/// Backs `file` up: an open image, read with pread; its size is
/// `meta.image.size_bytes`.
///
/// Puts the lease, reads the manifests it deduplicates against, reads the
/// data ranges only (`SEEK_DATA`/`SEEK_HOLE`; a chunk partly in a hole reads
/// zeros there; a chunk of all zeros is skipped like a hole), hashes each
/// chunk with BLAKE3, uploads those the target lacks (at most
/// [`UPLOAD_CONCURRENCY`] at once), then writes the manifest, then deletes
/// the lease.
///
/// `job.total_bytes` is the bytes of the chunks holding data, `done_bytes`
/// advances per chunk; `job.pace` is slept after each chunk; `job.cancel` is
/// checked before each chunk: cancelled → the lease deleted, no manifest,
/// `Ok(None)`. On error: the lease deleted (best effort), no manifest, `Err`.
pub async fn backup(
    target: &Target,
    meta: BackupMeta,
    file: File,
    job: Arc<AllocateJob>,
    counters: Arc<Counters>,
) -> Result<Option<Manifest>> {
    let lease_path = target.lease_path(meta.id);
    if target.head(&target.manifest_path(meta.id)).await?.is_some() {
        return Err(Error::BackupExists(meta.id));
    }
    let mut lease = Lease {
        backup: meta.id,
        owner: meta.source.service.clone(),
        started_at: OffsetDateTime::now_utc(),
        started_on_target: None,
    };
    let body = |l: &Lease| Bytes::from(serde_json::to_vec(l).expect("a lease always serializes"));
    // The second put names the first's time on the target's clock, before
    // anything is listed: gc keeps what this backup puts from then on,
    // however this host's clock runs.
    let (held, began) = Held::take(target, &lease_path, body(&lease), LEASE_STALE).await?;
    lease.started_on_target = Some(began);
    let held = match held.replace(target, &lease_path, body(&lease)).await {
        Ok(h) => h,
        Err(e) => {
            let _ = target.delete(&lease_path).await;
            return Err(e);
        }
    };
    let result = run(target, &meta, file, &job, &counters, &held).await;
    held.stop().await;
    if let Err(e) = target.delete(&lease_path).await {
        // A lease left behind only delays gc: it goes stale, and the
        // service deletes its own at its next start.
        tracing::warn!(backup = %meta.id, target = target.describe(), error = %e, "the lease of a finished backup could not be deleted");
    }
    match &result {
        Ok(Some(m)) => tracing::info!(
            backup = %m.id, target = target.describe(), stored = m.stored_bytes,
            uploaded = m.uploaded_bytes, deduplicated = m.deduplicated_bytes, "backup finished"
        ),
        Ok(None) => {
            tracing::info!(backup = %meta.id, target = target.describe(), "backup cancelled")
        }
        Err(e) => {
            tracing::warn!(backup = %meta.id, target = target.describe(), error = %e, "backup failed")
        }
    }
    result
}

/// Takes the backup under its held `lease`: its chunks stored, then its
/// manifest written. `Ok(None)`: cancelled, no manifest.
async fn run(
    target: &Target,
    meta: &BackupMeta,
    file: File,
    job: &Arc<AllocateJob>,
    counters: &Arc<Counters>,
    lease: &Held,
) -> Result<Option<Manifest>> {
    let store = Store::new(target, job, counters);
    let Some(chunks) = store_chunks(target, meta, file, job, lease, &store).await? else {
        return Ok(None);
    };
    // The manifest must never outlive a chunk it names.
    target.settle().await?;
    // Checked last before the manifest: a cancel or a lost lease after this
    // is too late, and a delete of the backup is what undoes it.
    if job.cancel.load(Relaxed) {
        return Ok(None);
    }
    check_lease(lease, &BackupRef::of(meta), target)?;

    let manifest = manifest_of(meta, chunks, &store);
    target
        .put(&target.manifest_path(meta.id), manifest.to_bytes())
        .await?;
    Ok(Some(manifest))
}

/// Reads the image's data chunks and has `store` keep each one the target
/// needs, waiting for every upload: the chunks the manifest is to name, in
/// order. `Ok(None)`: cancelled.
async fn store_chunks(
    target: &Target,
    meta: &BackupMeta,
    file: File,
    job: &AllocateJob,
    lease: &Held,
    store: &Store,
) -> Result<Option<Vec<ChunkRef>>> {
    let bref = BackupRef::of(meta);
    let size = meta.image.size_bytes;
    // Only chunks a manifest listed now references may be left out: gc
    // keeps those for as long as this lease is live (see the crate doc).
    // Each is still looked at on the target once before it is trusted.
    let referenced = referenced_by_manifests(target).await?;
    // The chunks this run stored, found intact, or has a task for.
    let mut covered = HashSet::new();

    let file = Arc::new(file);
    let indexes = to_read(&file, size, job).await.map_err(image_error(
        &bref,
        "finding the image's data ranges".to_string(),
    ))?;
    let mut chunks = Vec::new();
    let mut uploads = JoinSet::new();
    for index in indexes {
        if !may_go_on(job, lease, &bref, target, &mut uploads).await? {
            return Ok(None);
        }
        let len = chunk_len(size, index);
        let Some((hash, data)) = read_at(&file, &bref, index, len).await? else {
            job.done_bytes.fetch_add(len, Relaxed);
            between_chunks(job).await;
            continue;
        };
        chunks.push(ChunkRef {
            index,
            hash: hash.clone(),
            bytes: len,
        });
        if !covered.insert(hash.clone()) {
            // Covered by this run's own task for the same bytes, which must
            // succeed before the manifest is written.
            store.reused(len);
        } else {
            let (store, reused) = (store.clone(), referenced.contains(&hash));
            uploads.spawn(async move { store.chunk(hash, data, reused).await });
        }
        between_chunks(job).await;
    }
    if !all_uploaded(&mut uploads, job).await? {
        return Ok(None);
    }
    Ok(Some(chunks))
}

/// Reads chunk `index` (of `len` bytes) of the image with [`read_chunk`]
/// (`None`: all zeros), on the blocking pool: a pread must not hold up the
/// runtime's threads.
async fn read_at(
    file: &Arc<File>,
    bref: &BackupRef,
    index: u64,
    len: u64,
) -> Result<Option<(String, Bytes)>> {
    let f = Arc::clone(file);
    joined(tokio::task::spawn_blocking(move || read_chunk(&f, index * CHUNK_SIZE, len)).await)
        .map_err(image_error(
            bref,
            format!(
                "reading chunk {index} of the image at offset {}",
                index * CHUNK_SIZE
            ),
        ))
}

/// How an error of the image's file becomes the backup's: `action` says
/// what was being done when it came.
fn image_error(bref: &BackupRef, action: String) -> impl FnOnce(std::io::Error) -> Error {
    let bref = bref.clone();
    move |source| Error::Image {
        backup: bref,
        action,
        source,
    }
}

/// The chunks of `file` (of `size` bytes) that hold data, their bytes
/// counted as the job's total.
async fn to_read(file: &Arc<File>, size: u64, job: &AllocateJob) -> std::io::Result<Vec<u64>> {
    let f = Arc::clone(file);
    let indexes = joined(tokio::task::spawn_blocking(move || data_chunks(&f, size)).await)?;
    job.total_bytes
        .store(indexes.iter().map(|&i| chunk_len(size, i)).sum(), Relaxed);
    job.done_bytes.store(0, Relaxed);
    Ok(indexes)
}

/// Waits for every upload to end (`false`: cancelled meanwhile).
async fn all_uploaded(uploads: &mut JoinSet<Result<()>>, job: &AllocateJob) -> Result<bool> {
    while !uploads.is_empty() {
        if !next_upload(uploads, job).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether the backup goes on to its next chunk: not cancelled, its lease
/// still live, and room for one more upload (waiting for one to end).
async fn may_go_on(
    job: &AllocateJob,
    lease: &Held,
    bref: &BackupRef,
    target: &Target,
    uploads: &mut JoinSet<Result<()>>,
) -> Result<bool> {
    if job.cancel.load(Relaxed) {
        return Ok(false);
    }
    check_lease(lease, bref, target)?;
    while uploads.len() >= UPLOAD_CONCURRENCY {
        if !next_upload(uploads, job).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The pace between two chunks (a test's slow backup), then a wait while
/// the job is [held at its gate](AllocateJob::held_at_gate).
async fn between_chunks(job: &AllocateJob) {
    if !job.pace.is_zero() {
        tokio::time::sleep(job.pace).await;
    }
    while job.held_at_gate() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The sealed manifest of backup `meta`, naming `chunks`.
fn manifest_of(meta: &BackupMeta, chunks: Vec<ChunkRef>, store: &Store) -> Manifest {
    let mut manifest = Manifest {
        format: FORMAT,
        id: meta.id,
        name: meta.name.clone(),
        image: meta.image.clone(),
        source: meta.source.clone(),
        created_at: meta.created_at,
        finished_at: OffsetDateTime::now_utc(),
        blockplane_version: blockplane_system::build::current().to_string(),
        chunk_size: CHUNK_SIZE,
        stored_bytes: chunks.iter().map(|c| c.bytes).sum(),
        chunks,
        uploaded_bytes: store.uploaded.load(Relaxed),
        deduplicated_bytes: store.deduplicated.load(Relaxed),
        checksum: String::new(),
    };
    manifest.seal();
    manifest
}

impl BackupRef {
    /// How errors name backup `meta`.
    fn of(meta: &BackupMeta) -> Self {
        Self {
            id: meta.id,
            name: meta.name.clone(),
        }
    }
}

/// What a chunk's task needs: where it goes and what it counts.
#[derive(Clone)]
struct Store {
    target: Target,
    job: Arc<AllocateJob>,
    counters: Arc<Counters>,
    uploaded: Arc<AtomicU64>,
    deduplicated: Arc<AtomicU64>,
}

impl Store {
    /// Chunks of `job` stored on `target`, counted in `counters`.
    fn new(target: &Target, job: &Arc<AllocateJob>, counters: &Arc<Counters>) -> Self {
        Self {
            target: target.clone(),
            job: Arc::clone(job),
            counters: Arc::clone(counters),
            uploaded: Arc::new(AtomicU64::new(0)),
            deduplicated: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Makes the chunk `hash` of `data` stored on the target: a chunk
    /// earlier backups name (`reused`) is left as it is when the target
    /// holds it intact ([`Target::holds_chunk`]), and put again when it is
    /// missing or damaged, which mends those backups too; any other chunk
    /// is put.
    async fn chunk(self, hash: String, data: Bytes, reused: bool) -> Result<()> {
        let len = data.len() as u64;
        let path = self.target.chunk_path(&hash);
        if reused {
            match self.target.holds_chunk(&path, &data).await? {
                Holding::Intact => {
                    self.reused(len);
                    return Ok(());
                }
                lost => tracing::warn!(
                    target = self.target.describe(), chunk = %path, found = ?lost,
                    "a chunk earlier backups name is not intact on the target: it is stored again"
                ),
            }
        }
        self.target.put_chunk(&path, data).await?;
        self.uploaded.fetch_add(len, Relaxed);
        self.counters.uploaded_bytes.fetch_add(len, Relaxed);
        self.job.done_bytes.fetch_add(len, Relaxed);
        Ok(())
    }

    /// Counts `len` bytes left out as stored already.
    fn reused(&self, len: u64) {
        self.deduplicated.fetch_add(len, Relaxed);
        self.counters.deduplicated_bytes.fetch_add(len, Relaxed);
        self.job.done_bytes.fetch_add(len, Relaxed);
    }
}

/// Waits for one upload to end, or for a cancel (looked at every 50 ms: an
/// upload to a slow target must not keep a cancelled backup waiting).
/// `false` when cancelled; the uploads left are aborted when dropped.
async fn next_upload(uploads: &mut JoinSet<Result<()>>, job: &AllocateJob) -> Result<bool> {
    loop {
        if job.cancel.load(Relaxed) {
            return Ok(false);
        }
        tokio::select! {
            r = uploads.join_next() => {
                if let Some(r) = r {
                    joined(r)?;
                }
                return Ok(true);
            }
            () = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
        }
    }
}

/// The hashes of every chunk the finished backups on the target reference.
/// A manifest that fails its checks is left out: its chunks are uploaded
/// again rather than trusted.
async fn referenced_by_manifests(target: &Target) -> Result<HashSet<String>> {
    let mut set = HashSet::new();
    for m in manifest::list_all(target).await? {
        match m {
            Ok(m) => set.extend(m.chunks.into_iter().map(|c| c.hash)),
            Err(e) => {
                tracing::warn!(target = target.describe(), error = %e, "a backup is not deduplicated against");
            }
        }
    }
    Ok(set)
}

/// The length of chunk `index` of an image of `size` bytes.
pub(crate) fn chunk_len(size: u64, index: u64) -> u64 {
    (size - index * CHUNK_SIZE).min(CHUNK_SIZE)
}

/// The indexes of the chunks of `[0, size)` that hold any data range.
fn data_chunks(file: &File, size: u64) -> std::io::Result<Vec<u64>> {
    use rustix::fs::SeekFrom;
    use rustix::io::Errno;
    let len = file.metadata()?.len();
    if len < size {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the image file has {len} bytes, fewer than the image's size of {size}"),
        ));
    }
    let mut out: Vec<u64> = Vec::new();
    let mut off = 0;
    while off < size {
        let data = match rustix::fs::seek(file, SeekFrom::Data(off)) {
            Ok(d) => d,
            // No data at or after `off`.
            Err(Errno::NXIO) => break,
            // A filesystem without SEEK_DATA: all of it is data.
            Err(Errno::INVAL | Errno::OPNOTSUPP) => {
                return Ok((0..size.div_ceil(CHUNK_SIZE)).collect());
            }
            Err(e) => return Err(e.into()),
        };
        if data >= size {
            break;
        }
        let hole = match rustix::fs::seek(file, SeekFrom::Hole(data)) {
            Ok(h) => h.min(size),
            Err(Errno::NXIO) => size,
            Err(e) => return Err(e.into()),
        };
        for i in data / CHUNK_SIZE..=(hole - 1) / CHUNK_SIZE {
            if out.last().is_none_or(|&l| l < i) {
                out.push(i);
            }
        }
        off = hole;
    }
    Ok(out)
}

/// Reads a chunk; `None` when it is all zeros, else its BLAKE3 hash and bytes.
fn read_chunk(file: &File, offset: u64, len: u64) -> std::io::Result<Option<(String, Bytes)>> {
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, offset)?;
    // Or-ing a block without an early exit lets the compiler vectorize it.
    if buf
        .chunks(4096)
        .all(|b| b.iter().fold(0, |a, &x| a | x) == 0)
    {
        return Ok(None);
    }
    let hash = blake3::hash(&buf).to_hex().to_string();
    Ok(Some((hash, Bytes::from(buf))))
}

/// Fails once the lease has gone unrefreshed for half of [`LEASE_STALE`]:
/// well before a gc may take it for a crashed backup's.
fn check_lease(lease: &Held, backup: &BackupRef, target: &Target) -> Result<()> {
    match lease.lost() {
        Some(secs) => Err(Error::LeaseLost {
            backup: backup.clone(),
            target: target.describe().to_string(),
            secs,
        }),
        None => Ok(()),
    }
}
