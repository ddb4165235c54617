//! Standby images: a file that holds the bytes of one backup (`held`) of an
//! image, brought forward in place to a newer backup (`next`) of the same
//! image, fetching only the chunks that differ, through a redo journal.
//!
//! # Method
//!
//! [`Delta::between`] compares the two manifests chunk by chunk: a chunk
//! of `next` whose hash or length differs from `held`'s at its index, or
//! that `held` lacks, is fetched; a chunk `held` has and `next` lacks
//! becomes zeros. [`apply`] then works in two phases:
//!
//! 1. **Journal.** Each chunk to fetch is fetched, its BLAKE3 hash and
//!    length checked as [`restore`](crate::restore()) does, and appended to the
//!    journal file as a record; then one record per range to zero; then a
//!    trailer holding the whole `next` manifest. The journal is fsynced.
//!    The image file is not touched in this phase.
//! 2. **Replay.** The journal is read back and checked, the image's length
//!    set to `next`'s, each record written at its offset (a zero range is
//!    punched out, or written as zeros where the filesystem cannot punch),
//!    and the image fsynced. Replay is [`recover`] itself.
//!
//! # The journal
//!
//! All integers are little-endian.
//!
//! ```text
//! journal  = record* trailer trailer_len:u64 magic:"BPSTJNL1"
//! record   = 'D' offset:u64 length:u64 bytes[length]   (a chunk of next)
//!          | 'Z' offset:u64 length:u64                 (a range of zeros)
//! trailer  = JSON {"next": <next's manifest>, "records": <how many>,
//!                  "blake3": <hex BLAKE3 of every byte before the trailer>}
//! ```
//!
//! A journal is *complete* when its last 16 bytes are a trailer length and
//! the magic, the trailer parses, the manifest in it carries its own right
//! checksum, and the records before it hash to the trailer's BLAKE3 and
//! number its count. Anything else — too short, no magic, a trailer cut
//! off, a record torn or lost — is incomplete.
//!
//! # Why the file is never a mix of two backups
//!
//! The image is written only by replay, and replay only runs on a complete
//! journal, which names exactly what the image becomes: `next`'s length,
//! and `next`'s bytes over every range where they differ from `held`'s
//! (elsewhere `held` and `next` are the same bytes already). Replay sets
//! the length and writes disjoint ranges with fixed contents, so running
//! it again, whole or after any part of it, gives the same file. What a
//! crash at each point leaves:
//!
//! - **During phase 1, or before its fsync returned:** the image holds
//!   `held`, untouched. The journal lacks its trailer, or a write of it
//!   did not reach the disk and its checksum fails: [`recover`] says
//!   `None`, and the caller deletes the journal.
//! - **During phase 2:** the image is part `held`, part `next`, but the
//!   journal is complete and on disk: [`recover`] replays all of it, and
//!   the image holds `next`.
//! - **After phase 2, before the caller deletes the journal:** [`recover`]
//!   replays it again, changing nothing, and says `next`.
//!
//! So once [`recover`] has run at start, the file holds `held` or `next`.
//! This rests on the caller: it runs [`recover`] before using the file;
//! the journal's name is durable before [`apply`] runs (fsync its
//! directory after creating it: a journal that vanishes in a crash during
//! phase 2 leaves a mix no one can finish); and it records that the file
//! holds `next` before deleting the journal.
//!
//! # Cost
//!
//! The changed bytes are written twice, once to the journal and once to
//! the image, and read back once more from the journal (twice: to check
//! it, then to replay it). The journal needs that much free space where
//! it lives: the bytes fetched ([`Delta::fetch_bytes`]), 17 bytes a record
//! and the trailer (about the size of `next`'s manifest). Zeroing costs
//! 17 bytes a range in the journal and a punch in the image.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use blockplane_system::image::AllocateJob;
use bytes::Bytes;
use rustix::fs::FallocateFlags;
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

use crate::error::{BackupRef, Error, Result, joined};
use crate::manifest::{ChunkRef, Manifest};
use crate::restore::Prefetch;
use crate::target::Target;

/// The journal's last 8 bytes; "standby journal, format 1".
const MAGIC: &[u8; 8] = b"BPSTJNL1";
/// A record's header: its kind, offset and length.
const HEADER: u64 = 17;
/// The trailer's length and the magic, at the journal's end.
const TAIL: u64 = 16;
/// A data record.
const DATA: u8 = b'D';
/// A zero record.
const ZERO: u8 = b'Z';
/// A trailer longer than this is taken for garbage, not read: a manifest
/// is ~100 bytes a chunk, so this is ample for any image.
const MAX_TRAILER: u64 = 1 << 30;
/// Bytes read or zeroed at a time by replay's checks and zero writes.
const IO_STEP: usize = 1 << 20;

/// How `next` differs from `held`, chunk by chunk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    /// Chunks of `next` whose hash (or length) differs from `held`'s chunk
    /// at the same index, or that `held` lacks: fetched.
    pub fetch: Vec<ChunkRef>,
    /// (offset, length) ranges `held` has data in and `next` does not
    /// (within `next`'s size): they become zeros. Adjacent ranges are
    /// merged.
    pub zero: Vec<(u64, u64)>,
}

impl Delta {
    /// The delta from `held` to `next`, two backups of one image cut in
    /// chunks of one size ([`apply`] refuses others). Both list their
    /// chunks by ascending index, so one merge pass finds it.
    pub fn between(held: &Manifest, next: &Manifest) -> Delta {
        let size = next.image.size_bytes;
        let mut delta = Delta::default();
        let mut zero_out = |c: &ChunkRef| {
            let start = held.offset(c);
            // Past `next`'s size the file is cut off anyway.
            let end = start.saturating_add(c.bytes).min(size);
            if start >= end {
                return;
            }
            match delta.zero.last_mut() {
                Some((o, l)) if *o + *l == start => *l += end - start,
                _ => delta.zero.push((start, end - start)),
            }
        };
        let mut fetch = Vec::new();
        let mut old = held.chunks.iter().peekable();
        for c in &next.chunks {
            while let Some(h) = old.next_if(|h| h.index < c.index) {
                zero_out(h);
            }
            let same = old
                .next_if(|h| h.index == c.index)
                .is_some_and(|h| h.hash == c.hash && h.bytes == c.bytes);
            if !same {
                fetch.push(c.clone());
            }
        }
        for h in old {
            zero_out(h);
        }
        delta.fetch = fetch;
        delta
    }

    /// Bytes to fetch.
    pub fn fetch_bytes(&self) -> u64 {
        self.fetch.iter().map(|c| c.bytes).sum()
    }

    /// Bytes to zero.
    pub fn zero_bytes(&self) -> u64 {
        self.zero.iter().map(|(_, l)| l).sum()
    }
}

/// What an [`apply`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Chunks fetched (into the journal).
    pub chunks: u64,
    /// Bytes of the chunks fetched.
    pub fetched_bytes: u64,
    /// Bytes made zeros in the image (0 unless the apply finished).
    pub zeroed_bytes: u64,
    /// Whether it stopped before the journal was complete: the image is
    /// untouched, and the part-written journal is the caller's to remove.
    pub cancelled: bool,
}

/// The journal's trailer.
#[derive(Serialize, Deserialize)]
struct Trailer {
    /// The manifest the image holds once the journal is replayed.
    next: Manifest,
    /// How many records come before the trailer.
    records: u64,
    /// Hex BLAKE3 of every byte before the trailer.
    blake3: String,
}

/// Journals then applies `next` onto `image`, a file holding exactly
/// `held`'s bytes, opened read-write; `journal` is a new, empty file
/// opened read-write whose name the caller has made durable (see the
/// module doc). The image is touched only once the journal is complete
/// and synced, then fsynced itself.
///
/// Refused ([`Error::StandbyMismatch`]) when `next` is of another image,
/// cut in chunks of another size, or older than `held`. When `next` is
/// `held`, nothing is done and the journal is left as it is.
///
/// `job.total_bytes` is [`Delta::fetch_bytes`] and `done_bytes` advances
/// per chunk fetched; `job.pace` is slept after each, and `job.gate` holds
/// it there as it holds a backup; `job.cancel` is checked before each
/// chunk and before the trailer (→ [`Applied::cancelled`], the image
/// untouched). Once the journal is complete the apply finishes whatever
/// the flag says: replay is short and must not be left half done.
///
/// A chunk not on the target is [`Error::ChunkMissing`], one of other
/// bytes [`Error::ChunkCorrupt`], both before the image is touched.
pub async fn apply(
    target: &Target,
    held: &Manifest,
    next: &Manifest,
    image: File,
    journal: File,
    job: Arc<AllocateJob>,
) -> Result<Applied> {
    check_follows(held, next)?;
    let mut applied = Applied::default();
    if held.id == next.id {
        return Ok(applied);
    }
    // Recover reads the manifest back from the trailer and believes it only
    // with its checksum: one without would journal, then never replay.
    let want = next.compute_checksum();
    if next.checksum != want {
        return Err(Error::ManifestCorrupt {
            id: next.id,
            reason: format!(
                "its checksum is '{}' but its contents hash to '{want}'",
                next.checksum
            ),
        });
    }
    let bref = next.backup_ref();
    let (image, journal) = (Arc::new(image), Arc::new(journal));
    {
        let (i, j) = (Arc::clone(&image), Arc::clone(&journal));
        let (held, next) = (held.clone(), bref.clone());
        joined(tokio::task::spawn_blocking(move || check_files(&i, &j, &held, &next)).await)?;
    }

    let delta = Delta::between(held, next);
    job.total_bytes.store(delta.fetch_bytes(), Relaxed);
    job.done_bytes.store(0, Relaxed);
    let mut out = JournalWriter::new(Arc::clone(&journal));
    let mut fetch = Prefetch::new(target, &delta.fetch);
    for chunk in &delta.fetch {
        if job.cancel.load(Relaxed) {
            applied.cancelled = true;
            return Ok(applied);
        }
        let data = fetch.next().await?.intact(&bref, chunk)?;
        out.data(next.offset(chunk), data)
            .await
            .map_err(|source| Error::Journal {
                action: format!(
                    "writing chunk {} of backup {bref} into the journal",
                    chunk.index
                ),
                source,
            })?;
        applied.chunks += 1;
        applied.fetched_bytes += chunk.bytes;
        job.done_bytes.fetch_add(chunk.bytes, Relaxed);
        between_chunks(&job).await;
    }
    // The last moment a stop leaves the image untouched.
    if job.cancel.load(Relaxed) {
        applied.cancelled = true;
        return Ok(applied);
    }
    out.finish(&delta.zero, next)
        .await
        .map_err(|source| Error::Journal {
            action: format!("completing the journal of backup {bref}"),
            source,
        })?;

    // Phase 2: the very replay a start after a crash would do.
    let (i, j) = (Arc::clone(&image), Arc::clone(&journal));
    let replayed = joined(tokio::task::spawn_blocking(move || recover(&j, &i)).await)?;
    if replayed.as_ref().map(|m| m.id) != Some(next.id) {
        return Err(Error::Journal {
            action: format!("reading back the journal of backup {bref}"),
            source: io::Error::new(
                io::ErrorKind::InvalidData,
                "the journal just written and synced reads back incomplete; the image is untouched",
            ),
        });
    }
    applied.zeroed_bytes = delta.zero_bytes();
    Ok(applied)
}

/// At start: given a journal a crashed [`apply`] left, replays it onto
/// `image` when it is complete and returns the manifest the file now holds
/// (`Some(next)`); returns `Ok(None)` when it is incomplete or torn (the
/// caller deletes it; the image was never touched by it). Replaying a
/// journal already replayed, wholly or in part, is harmless. Blocking
/// (call from `spawn_blocking`).
pub fn recover(journal: &File, image: &File) -> Result<Option<Manifest>> {
    let Some((next, records)) = read_complete(journal).map_err(|source| Error::Journal {
        action: "reading the journal".to_string(),
        source,
    })?
    else {
        return Ok(None);
    };
    replay(journal, image, &next, &records)?;
    Ok(Some(next))
}

/// Refuses a `next` that cannot follow `held` on a standby.
fn check_follows(held: &Manifest, next: &Manifest) -> Result<()> {
    let refuse = |reason: String| {
        Err(Error::StandbyMismatch {
            held: held.backup_ref(),
            next: next.backup_ref(),
            reason,
        })
    };
    if held.image.id != next.image.id {
        return refuse(format!(
            "they are of different images, '{}' ({}) and '{}' ({}); a standby follows one image",
            held.image.name, held.image.id, next.image.name, next.image.id
        ));
    }
    if held.chunk_size != next.chunk_size {
        return refuse(format!(
            "they are cut in chunks of {} and {} bytes; only chunks of one size compare",
            held.chunk_size, next.chunk_size
        ));
    }
    if next.created_at < held.created_at {
        return refuse(format!(
            "it is of {}, older than the {} of the backup held; a standby only moves forward",
            rfc3339(next.created_at),
            rfc3339(held.created_at)
        ));
    }
    Ok(())
}

fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}

/// Refuses an image file that is not `held`'s size (not the file the
/// caller thinks) and a journal that holds anything (perhaps a crashed
/// apply's, which only [`recover`] may judge).
fn check_files(image: &File, journal: &File, held: &Manifest, next: &BackupRef) -> Result<()> {
    let image_err = |source| Error::Image {
        backup: held.backup_ref(),
        action: "checking the standby file holds it".to_string(),
        source,
    };
    let len = image.metadata().map_err(image_err)?.len();
    if len != held.image.size_bytes {
        return Err(image_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the file is {len} bytes where the backup's image is {}",
                held.image.size_bytes
            ),
        )));
    }
    let journal_err = |source| Error::Journal {
        action: format!("starting to journal backup {next}"),
        source,
    };
    let jlen = journal.metadata().map_err(journal_err)?.len();
    if jlen != 0 {
        return Err(journal_err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "the journal already holds {jlen} bytes; an apply writes into a new, empty one (a crashed apply's is for recover)"
            ),
        )));
    }
    Ok(())
}

/// The pace between two chunks, then a wait while the job is
/// [held at its gate](AllocateJob::held_at_gate), as a backup does.
async fn between_chunks(job: &AllocateJob) {
    if !job.pace.is_zero() {
        tokio::time::sleep(job.pace).await;
    }
    while job.held_at_gate() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn header(kind: u8, offset: u64, len: u64) -> [u8; HEADER as usize] {
    let mut h = [0; HEADER as usize];
    h[0] = kind;
    h[1..9].copy_from_slice(&offset.to_le_bytes());
    h[9..17].copy_from_slice(&len.to_le_bytes());
    h
}

/// Appends records to a journal, hashing what it writes.
struct JournalWriter {
    file: Arc<File>,
    /// Where the next record goes.
    at: u64,
    hasher: blake3::Hasher,
    records: u64,
}

impl JournalWriter {
    fn new(file: Arc<File>) -> Self {
        JournalWriter {
            file,
            at: 0,
            hasher: blake3::Hasher::new(),
            records: 0,
        }
    }

    /// A data record: `data` goes at `offset` of the image.
    async fn data(&mut self, offset: u64, data: Bytes) -> io::Result<()> {
        let len = data.len() as u64;
        let head = header(DATA, offset, len);
        let (file, at) = (Arc::clone(&self.file), self.at);
        // The hasher goes with the bytes onto the blocking thread: hashing
        // 4 MiB is no work for the runtime's threads.
        let mut hasher = std::mem::take(&mut self.hasher);
        self.hasher = joined(
            tokio::task::spawn_blocking(move || {
                file.write_all_at(&head, at)?;
                file.write_all_at(&data, at + HEADER)?;
                hasher.update(&head);
                hasher.update(&data);
                Ok::<_, io::Error>(hasher)
            })
            .await,
        )?;
        self.at += HEADER + len;
        self.records += 1;
        Ok(())
    }

    /// The zero records, the trailer naming `next`, its length and the
    /// magic, in one write; then the fsync that makes the journal complete.
    async fn finish(mut self, zero: &[(u64, u64)], next: &Manifest) -> io::Result<()> {
        let mut buf = Vec::with_capacity(zero.len() * HEADER as usize);
        for &(offset, len) in zero {
            buf.extend_from_slice(&header(ZERO, offset, len));
        }
        self.hasher.update(&buf);
        self.records += zero.len() as u64;
        let trailer = Trailer {
            next: next.clone(),
            records: self.records,
            blake3: self.hasher.finalize().to_hex().to_string(),
        };
        let json = serde_json::to_vec(&trailer).map_err(io::Error::other)?;
        buf.extend_from_slice(&json);
        buf.extend_from_slice(&(json.len() as u64).to_le_bytes());
        buf.extend_from_slice(MAGIC);
        let (file, at) = (self.file, self.at);
        joined(
            tokio::task::spawn_blocking(move || {
                file.write_all_at(&buf, at)?;
                file.sync_all()
            })
            .await,
        )
    }
}

/// A record of a complete journal.
struct Record {
    /// A zero range, else data.
    zero: bool,
    /// Where it goes in the image.
    offset: u64,
    len: u64,
    /// Where a data record's bytes are in the journal.
    at: u64,
}

/// The manifest and records of a complete journal, or `None` when it is
/// incomplete or torn. Everything is checked before anything is returned,
/// so a replay never starts on a journal it would have to give up.
fn read_complete(journal: &File) -> io::Result<Option<(Manifest, Vec<Record>)>> {
    let len = journal.metadata()?.len();
    if len < TAIL {
        return Ok(None);
    }
    let mut tail = [0u8; TAIL as usize];
    journal.read_exact_at(&mut tail, len - TAIL)?;
    let (tlen, magic) = tail.split_at(8);
    if magic != MAGIC {
        return Ok(None);
    }
    let mut tlen_bytes = [0u8; 8];
    tlen_bytes.copy_from_slice(tlen);
    let tlen = u64::from_le_bytes(tlen_bytes);
    if tlen > len - TAIL || tlen > MAX_TRAILER {
        return Ok(None);
    }
    let body = len - TAIL - tlen;
    let mut json = vec![0u8; tlen as usize];
    journal.read_exact_at(&mut json, body)?;
    let Ok(trailer) = serde_json::from_slice::<Trailer>(&json) else {
        return Ok(None);
    };
    // The trailer is outside the records' hash: the manifest's own
    // checksum covers the manifest, and the count and hash are checked
    // against the records below.
    if trailer.next.checksum != trailer.next.compute_checksum() {
        return Ok(None);
    }

    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; IO_STEP];
    let mut at = 0;
    while at < body {
        let n = (body - at).min(IO_STEP as u64) as usize;
        journal.read_exact_at(&mut buf[..n], at)?;
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    if hasher.finalize().to_hex().as_str() != trailer.blake3 {
        return Ok(None);
    }

    // The records hash right, so they are as an apply wrote them; a record
    // that breaks a rule now is a bug, not a crash, and replay must not
    // guess.
    let next = trailer.next;
    let size = next.image.size_bytes;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut records = Vec::new();
    let mut at = 0;
    while at < body {
        if body - at < HEADER {
            return Err(bad(format!("a record header at {at} is cut short")));
        }
        let mut h = [0u8; HEADER as usize];
        journal.read_exact_at(&mut h, at)?;
        let mut word = [0u8; 8];
        word.copy_from_slice(&h[1..9]);
        let offset = u64::from_le_bytes(word);
        word.copy_from_slice(&h[9..17]);
        let rlen = u64::from_le_bytes(word);
        if offset.checked_add(rlen).is_none_or(|end| end > size) {
            return Err(bad(format!(
                "the record at {at} covers {rlen} bytes at {offset}, past the image's {size}"
            )));
        }
        let zero = match h[0] {
            ZERO => true,
            DATA if rlen <= next.chunk_size && rlen <= body - at - HEADER => false,
            DATA => {
                return Err(bad(format!(
                    "the data record at {at} holds {rlen} bytes, more than a chunk or the journal"
                )));
            }
            k => return Err(bad(format!("the record at {at} is of kind {k}"))),
        };
        records.push(Record {
            zero,
            offset,
            len: rlen,
            at: at + HEADER,
        });
        at += HEADER + if zero { 0 } else { rlen };
    }
    // The count is in the trailer, outside the hash: a count that is off
    // is a trailer torn, not a bug.
    if records.len() as u64 != trailer.records {
        return Ok(None);
    }
    Ok(Some((next, records)))
}

/// Makes `image` hold `next`: its length, then every record, then an fsync.
/// Idempotent: each step sets bytes to fixed values.
fn replay(journal: &File, image: &File, next: &Manifest, records: &[Record]) -> Result<()> {
    let image_err = |action: String| {
        move |source| Error::Image {
            backup: next.backup_ref(),
            action,
            source,
        }
    };
    image
        .set_len(next.image.size_bytes)
        .map_err(image_err("setting the standby file's length".to_string()))?;
    let mut buf = Vec::new();
    for r in records {
        if r.zero {
            zero_range(image, r.offset, r.len).map_err(image_err(format!(
                "zeroing {} bytes at offset {}",
                r.len, r.offset
            )))?;
            continue;
        }
        buf.resize(r.len as usize, 0);
        journal
            .read_exact_at(&mut buf, r.at)
            .map_err(|source| Error::Journal {
                action: format!(
                    "reading the {} bytes for offset {} of backup {}",
                    r.len,
                    r.offset,
                    next.backup_ref()
                ),
                source,
            })?;
        image
            .write_all_at(&buf, r.offset)
            .map_err(image_err(format!(
                "writing {} bytes at offset {}",
                r.len, r.offset
            )))?;
    }
    image
        .sync_all()
        .map_err(image_err("syncing the standby file".to_string()))
}

/// Makes a range zeros: punched out, so the standby stays as sparse as a
/// restore; written as zeros where the filesystem cannot punch.
fn zero_range(image: &File, offset: u64, len: u64) -> io::Result<()> {
    match rustix::fs::fallocate(
        image,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        len,
    ) {
        Ok(()) => Ok(()),
        // EINVAL too: some filesystems answer it for a mode they lack.
        Err(Errno::OPNOTSUPP | Errno::INVAL) => {
            let zeros = vec![0u8; IO_STEP];
            let mut at = offset;
            let end = offset + len;
            while at < end {
                let n = (end - at).min(IO_STEP as u64) as usize;
                image.write_all_at(&zeros[..n], at)?;
                at += n as u64;
            }
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}
