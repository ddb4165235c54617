//! Changed-block tracking for snapshots: which ranges of a snapshot hold
//! data, and which differ between two snapshots of one image. The bytes
//! are read by `blockplane_system::changes` on a blocking thread; this
//! module decides which images may be asked and where their devices start.

use std::fs::File;
use std::os::fd::AsFd;

use super::blocking::blocking;
use super::error::{Error, Result};
use super::image_jobs::Images;
use crate::store::ImageRow;
use blockplane_api::model::{AllocatedQuery, ByteRange, ChangesQuery, ImageRanges, MAX_RANGES};
use blockplane_system::changes::{self, BLOCK, Layout, Ranges};
use blockplane_system::image::Access;
use blockplane_system::pagecache;

impl Images {
    /// `GET /v1/images/{id}/allocated`: the ranges of a snapshot's device
    /// that hold data.
    pub(crate) async fn allocated(
        &self,
        id_or_name: &str,
        q: AllocatedQuery,
    ) -> Result<ImageRanges> {
        let max = limit(q.limit)?;
        let row = self.house.image_row(id_or_name).await?;
        self.answerable(&row)?;
        let file = self.snapshot_file(&row).await?;
        let layout = layout(&row);
        let page = blocking(move || changes::allocated(&file, layout, q.offset, max))
            .await?
            .map_err(|e| read_failed(&format!("image '{}'", row.name), &e))?;
        Ok(view(&row, None, layout, page))
    }

    /// `GET /v1/images/{id}/changes`: the ranges of a snapshot's device
    /// whose bytes differ from another snapshot's of the same image.
    pub(crate) async fn changes(&self, id_or_name: &str, q: ChangesQuery) -> Result<ImageRanges> {
        let max = limit(q.limit)?;
        let row = self.house.image_row(id_or_name).await?;
        let base = self.house.image_row(&q.base).await?;
        self.answerable(&row)?;
        self.answerable(&base)?;
        if row.snapshot_of != base.snapshot_of {
            let of = |r: &ImageRow| {
                r.snapshot_of
                    .map_or_else(|| "no image".to_string(), |id| id.to_string())
            };
            return Err(Error::SnapshotsOfDifferentImages {
                target: row.name.clone(),
                base: base.name.clone(),
                target_of: of(&row),
                base_of: of(&base),
            });
        }
        let target_file = self.snapshot_file(&row).await?;
        let base_file = self.snapshot_file(&base).await?;
        let (layout, base_start) = (layout(&row), layout(&base).data_start);
        let page = blocking(move || {
            let page = changes::delta(&base_file, &target_file, base_start, layout, q.offset, max);
            // The bytes compared were read through the page cache: a
            // direct-I/O volume on either snapshot must not find them there.
            for f in [&base_file, &target_file] {
                let _ = pagecache::drop_clean(f.as_fd());
            }
            page
        })
        .await?
        .map_err(|e| {
            // Either file may be the one that failed.
            let which = format!("images '{}' and '{}'", row.name, base.name);
            read_failed(&which, &e)
        })?;
        Ok(view(&row, Some(&base), layout, page))
    }

    /// Refuses an image whose ranges would not hold still or are not whole:
    /// anything but a read-only snapshot (a standby, which an apply
    /// rewrites, is none), or a snapshot still being copied.
    fn answerable(&self, row: &ImageRow) -> Result<()> {
        if !row.read_only || row.snapshot_of.is_none() {
            return Err(Error::NotASnapshot(row.name.clone()));
        }
        self.house.refuse_unready_copy(row, "have its ranges read")
    }

    async fn snapshot_file(&self, row: &ImageRow) -> Result<File> {
        let (house, r) = (self.house.clone(), row.clone());
        let file = blocking(move || house.open_image(&r, Access::ReadOnly)).await??;
        Ok(File::from(file.into_fd()))
    }
}

/// The query's limit, or why not.
fn limit(l: Option<u32>) -> Result<usize> {
    match l.unwrap_or(MAX_RANGES) {
        n @ 1..=MAX_RANGES => Ok(n as usize),
        n => Err(Error::InvalidField {
            field: "limit",
            reason: format!("limit {n} is not between 1 and {MAX_RANGES}"),
        }),
    }
}

/// Where an image's device lies in its file: after an encrypted image's
/// header.
fn layout(row: &ImageRow) -> Layout {
    let size = row.device_bytes();
    Layout {
        data_start: row.size_bytes - size,
        size,
    }
}

/// A read of `which` images' extents or bytes failed.
fn read_failed(which: &str, e: &std::io::Error) -> Error {
    Error::Internal(format!("{which}: reading extents and bytes failed: {e}"))
}

fn view(row: &ImageRow, base: Option<&ImageRow>, layout: Layout, page: Ranges) -> ImageRanges {
    ImageRanges {
        image_id: row.id,
        image_name: row.name.clone(),
        base_id: base.map(|b| b.id),
        size_bytes: layout.size,
        block_bytes: BLOCK,
        ranges: page
            .ranges
            .iter()
            .map(|r| ByteRange {
                offset: r.offset,
                length: r.length,
            })
            .collect(),
        next_offset: page.next,
        mapped_bytes: page.cost.mapped_bytes,
        compared_bytes: page.cost.compared_bytes,
    }
}
