//! Changed-block tracking: which ranges of an image hold data, and which
//! differ between two images that share their history (two snapshots of
//! one image), for backup tools that copy only what changed.
//!
//! Both answers start from the files' extents (`FS_IOC_FIEMAP`, synced):
//! - a stretch that is a hole or unwritten in a file reads as zeroes;
//! - where two files map a stretch to the same physical blocks (reflinked
//!   copies on xfs or btrfs share exactly what nobody wrote since), the
//!   bytes are the same without reading them;
//! - everything else is read from both files and compared block by block,
//!   so an answer is exact at [`BLOCK`] granularity: a block is reported
//!   changed if and only if its bytes differ.
//!
//! So two reflinked snapshots cost a read of what was written between
//! them, and two full copies (ext4) cost a read of both. [`Cost`] says
//! which bytes took which path, and a page ends once it has compared
//! [`COMPARE_BUDGET`] bytes, so that no page reads without bound before
//! its caller hears of it.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};

use crate::extent::{FIEMAP_EXTENT_UNWRITTEN, FsExtent, fiemap_range, written_ranges};

/// The granularity of every answer: ranges start and end on a multiple of
/// it (the last may end at the image's end).
pub const BLOCK: u64 = 4096;

/// Bytes read from each file per comparison step.
const READ_STEP: usize = 1 << 20;

/// Device bytes a page of a delta compares at most before it ends (with
/// `next` where the next page starts), whatever its range count.
pub const COMPARE_BUDGET: u64 = 1 << 30;

/// The extent flags under which two extents at the same physical address
/// hold the same bytes (`LAST`, `UNWRITTEN`, `MERGED`, `SHARED`). Any other
/// (not yet placed, unknown, encoded, encrypted, packed, inline, or one a
/// later kernel adds) makes the stretch compared, never taken as shared.
const PLAIN: u32 = 0x1 | FIEMAP_EXTENT_UNWRITTEN | 0x1000 | 0x2000;

/// Where the device's bytes are in an image file: an encrypted image's
/// payload starts after its header, and ranges are the device's, not the
/// file's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// File offset of the device's byte 0.
    pub data_start: u64,
    /// The device's length in bytes.
    pub size: u64,
}

/// One range of the device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Where it starts.
    pub offset: u64,
    /// How long it is.
    pub length: u64,
}

impl Range {
    fn end(&self) -> u64 {
        self.offset + self.length
    }
}

/// What an answer cost, in device bytes by path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Known by the extent maps alone: holes, unwritten or shared blocks.
    pub mapped_bytes: u64,
    /// Read from both files and compared.
    pub compared_bytes: u64,
}

/// A page of ranges from a starting offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranges {
    /// In ascending order, none touching the next.
    pub ranges: Vec<Range>,
    /// Where the next page starts, when this one stopped at its limit.
    pub next: Option<u64>,
    /// What finding them cost.
    pub cost: Cost,
}

/// The ranges of the device that were ever written (neither holes nor
/// unwritten extents, which a plain image reads as zeroes), from `from`, at
/// most `max` of them.
pub fn allocated(file: &File, layout: Layout, from: u64, max: usize) -> io::Result<Ranges> {
    let from = align_down(from);
    let mut out = Pages::new(max);
    let cost = Cost::default();
    if from < layout.size {
        for e in data_extents(file, layout, from)? {
            out.push(Range {
                offset: align_down(e.offset),
                length: align_up(e.end(), layout.size) - align_down(e.offset),
            });
            if out.full() {
                break;
            }
        }
    }
    let mut page = out.finish(cost);
    page.cost.mapped_bytes = page.next.unwrap_or(layout.size).saturating_sub(from);
    Ok(page)
}

/// The ranges of the device whose bytes differ between `base` and
/// `target`, from `from`, at most `max` of them, comparing at most
/// [`COMPARE_BUDGET`] bytes. The device is `target`'s `layout`; `base` may
/// be shorter (what it lacks reads as zeroes). Physical addresses are
/// compared only between files of one filesystem.
pub fn delta(
    base: &File,
    target: &File,
    base_start: u64,
    layout: Layout,
    from: u64,
    max: usize,
) -> io::Result<Ranges> {
    delta_within(base, target, base_start, layout, from, max, COMPARE_BUDGET)
}

/// [`delta`], with the bytes a page may compare given.
fn delta_within(
    base: &File,
    target: &File,
    base_start: u64,
    layout: Layout,
    from: u64,
    max: usize,
    budget: u64,
) -> io::Result<Ranges> {
    let from = align_down(from);
    let mut out = Pages::new(max);
    let mut cost = Cost::default();
    if from >= layout.size {
        return Ok(out.finish(cost));
    }
    let base_layout = Layout {
        data_start: base_start,
        size: layout.size,
    };
    let one_fs = base.metadata()?.dev() == target.metadata()?.dev();
    let mut a = Extents::new(data_pieces(base, base_layout, from)?);
    let mut b = Extents::new(data_pieces(target, layout, from)?);
    let mut cmp = Compare::new(base, base_start, target, layout);
    let mut at = from;
    while at < layout.size && !out.full() {
        if cost.compared_bytes >= budget {
            // `at` ends a compared stretch, rounded up to a block: every
            // block before it is answered, none after.
            return Ok(out.finish_at(at, cost));
        }
        let (pa, end_a) = a.at(at, layout.size);
        let (pb, end_b) = b.at(at, layout.size);
        let end = end_a.min(end_b);
        // Unwritten reads as zeroes, as a hole does.
        let same = match (pa.filter(|p| !p.zero()), pb.filter(|p| !p.zero())) {
            (None, None) => true,
            (Some(x), Some(y)) => one_fs && x.shares(y, at),
            _ => false,
        };
        if same {
            cost.mapped_bytes += end - at;
        } else {
            // Whole blocks: a stretch may start or end inside one.
            let lo = align_down(at);
            let hi = align_up(end, layout.size);
            cost.compared_bytes += end - at;
            cmp.differing(lo, hi, &mut out)?;
            at = hi;
            continue;
        }
        at = end;
    }
    Ok(out.finish(cost))
}

/// A file's extents over the device's window from `from`, in device
/// offsets, clipped to it.
fn data_pieces(file: &File, layout: Layout, from: u64) -> io::Result<Vec<Piece>> {
    let lo = layout.data_start + from;
    let hi = layout.data_start + layout.size;
    let raw = fiemap_range(file.as_fd(), lo, hi, true)?;
    Ok(raw
        .into_iter()
        .filter_map(|e| Piece::clip(e, lo, hi, layout.data_start))
        .collect())
}

/// The extents that hold data (not unwritten), merged where they touch, in
/// device offsets.
fn data_extents(file: &File, layout: Layout, from: u64) -> io::Result<Vec<Range>> {
    let lo = layout.data_start + from;
    let hi = layout.data_start + layout.size;
    Ok(written_ranges(file.as_fd(), lo, hi)?
        .into_iter()
        .map(|(a, b)| Range {
            offset: a - layout.data_start,
            length: b - a,
        })
        .collect())
}

/// One extent, in device offsets.
#[derive(Debug, Clone, Copy)]
struct Piece {
    offset: u64,
    len: u64,
    physical: u64,
    flags: u32,
}

impl Piece {
    fn clip(e: FsExtent, lo: u64, hi: u64, data_start: u64) -> Option<Piece> {
        let start = e.logical.max(lo);
        let end = (e.logical + e.len).min(hi);
        (start < end).then(|| Piece {
            offset: start - data_start,
            len: end - start,
            physical: e.physical + (start - e.logical),
            flags: e.flags,
        })
    }

    fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// Allocated but never written: reads as zeroes.
    fn zero(&self) -> bool {
        self.flags & FIEMAP_EXTENT_UNWRITTEN != 0
    }

    /// Whether two written pieces of one filesystem hold the same bytes
    /// from `at` on (as far as both reach) without reading them: the same
    /// physical blocks.
    fn shares(&self, other: &Piece, at: u64) -> bool {
        (self.flags | other.flags) & !PLAIN == 0
            && self.physical + (at - self.offset) == other.physical + (at - other.offset)
    }
}

/// A walk over one file's pieces in ascending order.
struct Extents {
    pieces: Vec<Piece>,
    next: usize,
}

impl Extents {
    fn new(pieces: Vec<Piece>) -> Self {
        Self { pieces, next: 0 }
    }

    /// The piece covering `at` (None in a hole) and where that piece or
    /// hole ends. Calls come with `at` ascending.
    fn at(&mut self, at: u64, size: u64) -> (Option<&Piece>, u64) {
        while self.next < self.pieces.len() && self.pieces[self.next].end() <= at {
            self.next += 1;
        }
        match self.pieces.get(self.next) {
            Some(p) if p.offset <= at => (Some(p), p.end()),
            Some(p) => (None, p.offset),
            None => (None, size),
        }
    }
}

/// Reads two files side by side and reports the blocks that differ.
struct Compare<'a> {
    base: &'a File,
    base_start: u64,
    target: &'a File,
    layout: Layout,
    a: Vec<u8>,
    b: Vec<u8>,
}

impl<'a> Compare<'a> {
    fn new(base: &'a File, base_start: u64, target: &'a File, layout: Layout) -> Self {
        Self {
            base,
            base_start,
            target,
            layout,
            a: vec![0; READ_STEP],
            b: vec![0; READ_STEP],
        }
    }

    /// Pushes the blocks of `[lo, hi)` whose bytes differ.
    fn differing(&mut self, lo: u64, hi: u64, out: &mut Pages) -> io::Result<()> {
        let mut at = lo;
        while at < hi && !out.full() {
            let n = ((hi - at) as usize).min(READ_STEP);
            read_full(self.base, self.base_start + at, &mut self.a[..n])?;
            read_full(self.target, self.layout.data_start + at, &mut self.b[..n])?;
            for (i, (x, y)) in self.a[..n]
                .chunks(BLOCK as usize)
                .zip(self.b[..n].chunks(BLOCK as usize))
                .enumerate()
            {
                if x != y {
                    let offset = at + i as u64 * BLOCK;
                    out.push(Range {
                        offset,
                        length: (offset + BLOCK).min(self.layout.size) - offset,
                    });
                }
            }
            at += n as u64;
        }
        Ok(())
    }
}

/// Fills `buf` from `offset`; what lies past the file's end reads as zeroes.
fn read_full(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Ranges gathered up to a limit, merged as they come. One range more than
/// the limit is kept until the end, so that the last range handed out is
/// known to be whole (the next one does not touch it).
struct Pages {
    ranges: Vec<Range>,
    max: usize,
}

impl Pages {
    fn new(max: usize) -> Self {
        Self {
            ranges: Vec::new(),
            max: max.max(1),
        }
    }

    fn push(&mut self, r: Range) {
        match self.ranges.last_mut() {
            Some(last) if last.end() >= r.offset => {
                last.length = last.length.max(r.end() - last.offset);
            }
            _ => self.ranges.push(r),
        }
    }

    fn full(&self) -> bool {
        self.ranges.len() > self.max
    }

    /// The page, ended at `at` before its limit: the next starts there.
    fn finish_at(self, at: u64, cost: Cost) -> Ranges {
        let mut page = self.finish(cost);
        if page.next.is_none() {
            page.next = Some(at);
        }
        page
    }

    fn finish(mut self, cost: Cost) -> Ranges {
        let next = if self.ranges.len() > self.max {
            self.ranges.truncate(self.max);
            self.ranges.last().map(Range::end)
        } else {
            None
        };
        Ranges {
            ranges: self.ranges,
            next,
            cost,
        }
    }
}

fn align_down(v: u64) -> u64 {
    v - v % BLOCK
}

fn align_up(v: u64, size: u64) -> u64 {
    v.div_ceil(BLOCK).saturating_mul(BLOCK).min(size)
}

#[cfg(test)]
#[path = "changes_tests.rs"]
mod tests;
