//! Reading a backup back: restore into a file, or verify every chunk
//! without writing anything.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use blockplane_system::image::AllocateJob;
use bytes::Bytes;
use tokio::task::JoinHandle;

use crate::error::{BackupRef, Error, Result, joined};
use crate::manifest::{ChunkRef, Manifest};
use crate::target::Target;

/// Chunks fetched ahead at once: at most this many chunks in memory.
pub const FETCH_CONCURRENCY: usize = 4;

/// What [`verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Chunks checked.
    pub chunks: u64,
    /// Bytes of the chunks checked.
    pub bytes: u64,
    /// Chunks not on the target.
    pub missing: Vec<ChunkRef>,
    /// Chunks whose bytes do not hash to their name, or have the wrong length.
    pub corrupt: Vec<ChunkRef>,
    /// Whether the job was cancelled before every chunk was checked.
    pub cancelled: bool,
}

impl VerifyReport {
    /// Whether every chunk was checked and each is present and intact.
    pub fn ok(&self) -> bool {
        !self.cancelled && self.missing.is_empty() && self.corrupt.is_empty()
    }
}

/// Restores `manifest` into `file`: a new, empty file opened read-write
/// (one that holds data is refused). Its length is set first, so chunks
/// that are not stored stay holes; then each chunk is fetched, its BLAKE3
/// hash and length checked, and written at its offset. `job.total_bytes`
/// is `stored_bytes` and `done_bytes` advances per chunk; `job.pace` is
/// slept after each; `job.cancel` is checked before each (→ `Ok(false)`,
/// the file left part-written for the caller to remove). The file is
/// fsynced at the end → `Ok(true)`.
///
/// A chunk not on the target is [`Error::ChunkMissing`]; one with other
/// bytes [`Error::ChunkCorrupt`].
pub async fn restore(
    target: &Target,
    manifest: &Manifest,
    file: File,
    job: Arc<AllocateJob>,
) -> Result<bool> {
    let bref = manifest.backup_ref();
    let image_err = |action: String| {
        let bref = bref.clone();
        move |source| Error::Image {
            backup: bref,
            action,
            source,
        }
    };
    let file = Arc::new(file);
    let size = manifest.image.size_bytes;
    let f = Arc::clone(&file);
    joined(tokio::task::spawn_blocking(move || prepare(&f, size)).await)
        .map_err(image_err("preparing the file to restore into".to_string()))?;
    job.total_bytes.store(manifest.stored_bytes, Relaxed);
    job.done_bytes.store(0, Relaxed);

    let mut fetch = Prefetch::new(target, &manifest.chunks);
    for chunk in &manifest.chunks {
        if job.cancel.load(Relaxed) {
            return Ok(false);
        }
        let data = fetch.next().await?.intact(&bref, chunk)?;
        let offset = manifest.offset(chunk);
        let f = Arc::clone(&file);
        joined(tokio::task::spawn_blocking(move || f.write_all_at(&data, offset)).await).map_err(
            image_err(format!("writing chunk {} at offset {offset}", chunk.index)),
        )?;
        job.done_bytes.fetch_add(chunk.bytes, Relaxed);
        if !job.pace.is_zero() {
            tokio::time::sleep(job.pace).await;
        }
    }
    let f = Arc::clone(&file);
    joined(tokio::task::spawn_blocking(move || f.sync_all()).await)
        .map_err(image_err("syncing the restored file".to_string()))?;
    Ok(true)
}

/// Checks every chunk of a backup is on the target and hashes right,
/// writing nothing; does not stop at the first bad chunk. Progress and
/// pace as [`restore`]; a cancel ends it with [`VerifyReport::cancelled`].
/// Only errors of the target itself are `Err`.
pub async fn verify(
    target: &Target,
    manifest: &Manifest,
    job: Arc<AllocateJob>,
) -> Result<VerifyReport> {
    job.total_bytes.store(manifest.stored_bytes, Relaxed);
    job.done_bytes.store(0, Relaxed);
    let mut report = VerifyReport::default();
    let mut fetch = Prefetch::new(target, &manifest.chunks);
    for chunk in &manifest.chunks {
        if job.cancel.load(Relaxed) {
            report.cancelled = true;
            break;
        }
        match fetch.next().await? {
            Fetched::Intact(_) => {}
            Fetched::Missing => report.missing.push(chunk.clone()),
            Fetched::Corrupt(_) => report.corrupt.push(chunk.clone()),
        }
        report.chunks += 1;
        report.bytes += chunk.bytes;
        job.done_bytes.fetch_add(chunk.bytes, Relaxed);
        if !job.pace.is_zero() {
            tokio::time::sleep(job.pace).await;
        }
    }
    Ok(report)
}

/// Refuses a file that holds data, then sizes it.
fn prepare(file: &File, size: u64) -> std::io::Result<()> {
    let len = file.metadata()?.len();
    if len > 0 {
        match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(0)) {
            Err(rustix::io::Errno::NXIO) => {}
            Ok(_) | Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "the file already holds {len} bytes; a restore writes into a new, empty file"
                    ),
                ));
            }
        }
    }
    file.set_len(size)
}

/// A chunk as the target gave it.
pub(crate) enum Fetched {
    Intact(Bytes),
    Missing,
    /// The hash of the bytes found (and their length when it is wrong).
    Corrupt(String),
}

impl Fetched {
    /// The bytes of `chunk` of `backup`; a chunk missing or corrupt is the
    /// error that names it.
    pub(crate) fn intact(self, backup: &BackupRef, chunk: &ChunkRef) -> Result<Bytes> {
        match self {
            Fetched::Intact(data) => Ok(data),
            Fetched::Missing => Err(Error::ChunkMissing {
                backup: backup.clone(),
                index: chunk.index,
                hash: chunk.hash.clone(),
            }),
            Fetched::Corrupt(found) => Err(Error::ChunkCorrupt {
                backup: backup.clone(),
                index: chunk.index,
                hash: chunk.hash.clone(),
                found,
            }),
        }
    }
}

/// Fetches and checks chunks in order, [`FETCH_CONCURRENCY`] ahead. Each
/// fetch is its own task, so they go on while the caller writes; dropping
/// the prefetch stops them.
pub(crate) struct Prefetch<'a> {
    target: &'a Target,
    chunks: &'a [ChunkRef],
    next: usize,
    pending: VecDeque<AbortOnDrop<Result<Fetched>>>,
}

impl<'a> Prefetch<'a> {
    pub(crate) fn new(target: &'a Target, chunks: &'a [ChunkRef]) -> Self {
        Prefetch {
            target,
            chunks,
            next: 0,
            pending: VecDeque::new(),
        }
    }

    /// The next chunk's fetch; called once per chunk, in order.
    pub(crate) async fn next(&mut self) -> Result<Fetched> {
        while self.pending.len() < FETCH_CONCURRENCY && self.next < self.chunks.len() {
            let chunk = self.chunks[self.next].clone();
            self.next += 1;
            let target = self.target.clone();
            self.pending
                .push_back(AbortOnDrop(tokio::spawn(fetch(target, chunk))));
        }
        let mut head = self
            .pending
            .pop_front()
            .expect("next is called once per chunk");
        joined((&mut head.0).await)
    }
}

async fn fetch(target: Target, chunk: ChunkRef) -> Result<Fetched> {
    let Some(data) = target.get(&target.chunk_path(&chunk.hash)).await? else {
        return Ok(Fetched::Missing);
    };
    let (found, data) = joined(
        tokio::task::spawn_blocking(move || (blake3::hash(&data).to_hex().to_string(), data)).await,
    );
    let len = data.len() as u64;
    Ok(if len != chunk.bytes {
        Fetched::Corrupt(format!("{found} ({len} bytes, not {})", chunk.bytes))
    } else if found != chunk.hash {
        Fetched::Corrupt(found)
    } else {
        Fetched::Intact(data)
    })
}

struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
