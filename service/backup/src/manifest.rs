//! The manifest of a finished backup, its checksum, and the catalogue of
//! backups on a target: list, read, delete.

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::target::Target;
use crate::terms::CHUNK_SIZE;

/// The manifest format this crate writes and reads.
pub const FORMAT: u32 = 1;

/// Manifests read at once when listing.
const LIST_CONCURRENCY: usize = 8;

/// The image a backup is of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageMeta {
    /// The image's id.
    pub id: Uuid,
    /// The image's name.
    pub name: String,
    /// The image's size; a restore makes a file of this size.
    pub size_bytes: u64,
    /// Whether the image holds LUKS2 ciphertext (backed up as it is).
    pub encrypted: bool,
}

/// Where a backup was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceMeta {
    /// The host's name.
    pub host: String,
    /// The image file's path there.
    pub path: String,
    /// The service instance's id; a running backup's lease names it as owner.
    pub service: String,
}

/// One chunk of a backup: `bytes` of the image at `index * chunk_size`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// The chunk's place in the image (its offset over the chunk size).
    pub index: u64,
    /// The BLAKE3 hash of its bytes, 64 lowercase hex digits; its name on the target.
    pub hash: String,
    /// Its length: the chunk size, except possibly for the image's last chunk.
    pub bytes: u64,
}

/// A finished backup, stored as `backups/<id>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The backup's id.
    pub id: Uuid,
    /// The backup's name.
    pub name: String,
    /// The image it is of.
    pub image: ImageMeta,
    /// Where it was taken.
    pub source: SourceMeta,
    /// The moment the data is of.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When the backup finished.
    #[serde(with = "time::serde::rfc3339")]
    pub finished_at: OffsetDateTime,
    /// The build that wrote it.
    pub blockplane_version: String,
    /// [`CHUNK_SIZE`].
    pub chunk_size: u64,
    /// The chunks holding data, by ascending index; a missing index is all
    /// zeros (a hole).
    pub chunks: Vec<ChunkRef>,
    /// The sum of the chunks' bytes.
    pub stored_bytes: u64,
    /// Bytes this backup put to the target.
    pub uploaded_bytes: u64,
    /// Bytes of chunks it found stored already.
    pub deduplicated_bytes: u64,
    /// `blake3:<hex>` of the manifest serialized (compact JSON) with this
    /// field empty.
    pub checksum: String,
}

impl Manifest {
    /// The checksum this manifest should carry: `blake3:<hex>` of it
    /// serialized with `checksum` empty.
    pub fn compute_checksum(&self) -> String {
        let mut copy = self.clone();
        copy.checksum = String::new();
        let json = serde_json::to_vec(&copy).expect("a manifest always serializes");
        format!("blake3:{}", blake3::hash(&json).to_hex())
    }

    /// Sets [`Manifest::checksum`].
    pub fn seal(&mut self) {
        self.checksum = self.compute_checksum();
    }

    /// The manifest as stored: pretty JSON, for people reading the target.
    pub(crate) fn to_bytes(&self) -> Bytes {
        let mut v = serde_json::to_vec_pretty(self).expect("a manifest always serializes");
        v.push(b'\n');
        Bytes::from(v)
    }

    /// Reads a stored manifest of backup `id`, checking its format,
    /// checksum and consistency.
    pub fn from_bytes(id: Uuid, data: &[u8]) -> Result<Manifest> {
        let m = Manifest::from_bytes_unchecked(id, data)?;
        let corrupt = |reason: String| Error::ManifestCorrupt { id, reason };
        if m.format != FORMAT {
            return Err(corrupt(format!(
                "format {} is not {FORMAT}, the only format this build reads",
                m.format
            )));
        }
        let want = m.compute_checksum();
        if m.checksum != want {
            return Err(corrupt(format!(
                "its checksum is '{}' but its contents hash to '{want}' (changed after it was written)",
                m.checksum
            )));
        }
        if m.id != id {
            return Err(corrupt(format!(
                "it names backup {} but is stored as {id}",
                m.id
            )));
        }
        m.check_consistent().map_err(corrupt)?;
        Ok(m)
    }

    /// Parses without the checks: what a garbage collection reads a
    /// manifest's chunks from, since it must keep them even when the
    /// manifest has been altered.
    pub(crate) fn from_bytes_unchecked(id: Uuid, data: &[u8]) -> Result<Manifest> {
        serde_json::from_slice(data).map_err(|e| Error::ManifestCorrupt {
            id,
            reason: format!("it is not a manifest: {e}"),
        })
    }

    fn check_consistent(&self) -> std::result::Result<(), String> {
        if self.chunk_size != CHUNK_SIZE {
            return Err(format!(
                "its chunk size is {} where format {FORMAT} has {CHUNK_SIZE}",
                self.chunk_size
            ));
        }
        let size = self.image.size_bytes;
        let mut stored = 0u64;
        let mut last = None;
        for c in &self.chunks {
            if last.is_some_and(|l| c.index <= l) {
                return Err(format!(
                    "chunk {} is out of order (indexes must ascend)",
                    c.index
                ));
            }
            last = Some(c.index);
            if !is_hash(&c.hash) {
                return Err(format!(
                    "chunk {} has '{}', not a BLAKE3 hash",
                    c.index, c.hash
                ));
            }
            let start = c.index.checked_mul(CHUNK_SIZE).filter(|s| *s < size);
            let expect = start.map(|s| (size - s).min(CHUNK_SIZE));
            if expect != Some(c.bytes) {
                return Err(format!(
                    "chunk {} has {} bytes where an image of {size} bytes has {}",
                    c.index,
                    c.bytes,
                    expect.map_or("no such chunk".to_string(), |e| e.to_string())
                ));
            }
            stored += c.bytes;
        }
        if stored != self.stored_bytes {
            return Err(format!(
                "stored_bytes is {} but its chunks add up to {stored}",
                self.stored_bytes
            ));
        }
        Ok(())
    }

    /// The offset of a chunk in the image.
    pub fn offset(&self, chunk: &ChunkRef) -> u64 {
        chunk.index * self.chunk_size
    }

    pub(crate) fn backup_ref(&self) -> crate::error::BackupRef {
        crate::error::BackupRef {
            id: self.id,
            name: self.name.clone(),
        }
    }
}

/// Whether `s` is a BLAKE3 hash as chunks are named: 64 lowercase hex digits.
pub(crate) fn is_hash(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The id in an object name `<uuid>.json`.
pub(crate) fn id_of(name: &str) -> Option<Uuid> {
    name.strip_suffix(".json")
        .and_then(|s| Uuid::parse_str(s).ok())
}

/// Finished backups (manifests), oldest first (by `created_at`). A manifest
/// that fails its checks is left out with a warning.
pub async fn list(target: &Target) -> Result<Vec<Manifest>> {
    let mut out: Vec<Manifest> = list_all(target)
        .await?
        .into_iter()
        .filter_map(|r| match r {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!(target = target.describe(), error = %e, "a backup is left out of the list");
                None
            }
        })
        .collect();
    out.sort_by(|a, b| {
        (a.created_at, a.finished_at, a.id).cmp(&(b.created_at, b.finished_at, b.id))
    });
    Ok(out)
}

/// Every manifest on the target, each read and checked, a corrupt one as
/// its error; in no particular order. Errors of the target itself fail the
/// whole list.
pub async fn list_all(target: &Target) -> Result<Vec<Result<Manifest>>> {
    let ids: Vec<Uuid> = target
        .list("backups")
        .await?
        .iter()
        .filter_map(|l| id_of(&l.name))
        .collect();
    let read = futures_util::stream::iter(ids)
        .map(|id| async move {
            match target.get(&target.manifest_path(id)).await? {
                // Deleted since it was listed.
                None => Ok(None),
                Some(data) => Ok(Some(Manifest::from_bytes(id, &data))),
            }
        })
        .buffer_unordered(LIST_CONCURRENCY)
        .try_filter_map(|r| async move { Ok(r) })
        .try_collect::<Vec<_>>()
        .await?;
    Ok(read)
}

/// One manifest; [`Error::BackupNotFound`] when absent.
pub async fn manifest(target: &Target, id: Uuid) -> Result<Manifest> {
    match target.get(&target.manifest_path(id)).await? {
        Some(data) => Manifest::from_bytes(id, &data),
        None => Err(Error::BackupNotFound(id)),
    }
}

/// Deletes a backup: its manifest is put as a tombstone
/// (`deleted/<id>.json`), then the manifest is deleted. The chunks stay
/// until [`crate::gc`]. A corrupt manifest can be deleted too.
pub async fn delete(target: &Target, id: Uuid) -> Result<()> {
    let path = target.manifest_path(id);
    let Some(data) = target.get(&path).await? else {
        return Err(Error::BackupNotFound(id));
    };
    // The tombstone first: a backup running now may rely on this manifest's
    // chunks, and gc keeps them for it only while the tombstone is there.
    target.put(&target.tombstone_path(id), data).await?;
    target.delete(&path).await
}
