//! `FS_IOC_FIEMAP`: where a file's extents are, and which stretches of it
//! read as zeroes (holes and unwritten extents).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_FLAG_SYNC: u32 = 0x1;
pub(super) const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Allocated but never written: reads as zeroes, refused by rule 2.
pub const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
const EXTENTS_PER_CALL: usize = 256;

/// One extent as `FS_IOC_FIEMAP` reports it (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsExtent {
    /// Offset in the file.
    pub logical: u64,
    /// Offset on the filesystem's device.
    pub physical: u64,
    /// Length.
    pub len: u64,
    /// `FIEMAP_EXTENT_*` flags.
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

#[repr(C)]
struct Fiemap {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
    fm_extents: [FiemapExtent; EXTENTS_PER_CALL],
}

/// Reads every extent of the file; with `sync`, dirty data is written (and so
/// allocated) first.
pub fn fiemap(fd: BorrowedFd<'_>, sync: bool) -> io::Result<Vec<FsExtent>> {
    fiemap_range(fd, 0, u64::MAX, sync)
}

/// Reads the extents that overlap `[from, to)`.
pub fn fiemap_range(
    fd: BorrowedFd<'_>,
    from: u64,
    to: u64,
    sync: bool,
) -> io::Result<Vec<FsExtent>> {
    let mut out = Vec::new();
    let mut start = from;
    loop {
        if start >= to {
            return Ok(out);
        }
        let mut fm = Box::new(Fiemap {
            fm_start: start,
            fm_length: to - start,
            fm_flags: if sync { FIEMAP_FLAG_SYNC } else { 0 },
            fm_mapped_extents: 0,
            fm_extent_count: EXTENTS_PER_CALL as u32,
            fm_reserved: 0,
            fm_extents: [FiemapExtent::default(); EXTENTS_PER_CALL],
        });
        // SAFETY: FS_IOC_FIEMAP reads the header and fills up to fm_extent_count extents.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_FIEMAP, &mut *fm as *mut Fiemap) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = fm.fm_mapped_extents as usize;
        if n == 0 {
            return Ok(out);
        }
        for e in &fm.fm_extents[..n] {
            out.push(FsExtent {
                logical: e.fe_logical,
                physical: e.fe_physical,
                len: e.fe_length,
                flags: e.fe_flags,
            });
        }
        let last = out.last().expect("n > 0");
        if last.flags & FIEMAP_EXTENT_LAST != 0 {
            return Ok(out);
        }
        start = last.logical + last.len;
    }
}

/// The stretches of `[from, to)` that hold written data (extents not
/// UNWRITTEN), after a sync, sorted, merged where they touch.
pub fn written_ranges(fd: BorrowedFd<'_>, from: u64, to: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for e in fiemap_range(fd, from, to, true)? {
        let (a, b) = (e.logical.max(from), (e.logical + e.len).min(to));
        if e.flags & FIEMAP_EXTENT_UNWRITTEN != 0 || a >= b {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.1 >= a => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    Ok(out)
}

/// The stretches of `[from, to)` that rule 2 refuses for want of written
/// data: holes and UNWRITTEN extents (both read as zeroes), sorted, merged.
/// The gaps between [`written_ranges`].
pub fn unwritten_ranges(fd: BorrowedFd<'_>, from: u64, to: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut at = from;
    for (a, b) in written_ranges(fd, from, to)? {
        if a > at {
            out.push((at, a));
        }
        at = b;
    }
    if at < to {
        out.push((at, to));
    }
    Ok(out)
}

/// The first stretch of a file that holds no written data (a hole, an
/// UNWRITTEN extent, or both side by side), as [`first_unwritten`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unwritten {
    /// Where it starts (bytes).
    pub start: u64,
    /// Where it ends.
    pub end: u64,
    /// Part of it has no extent.
    pub hole: bool,
    /// Part of it is UNWRITTEN extents.
    pub unwritten: bool,
    /// Bytes of the whole file that hold no written data.
    pub total: u64,
}

impl Unwritten {
    /// What the stretch is, for messages.
    pub fn what(&self) -> &'static str {
        match (self.hole, self.unwritten) {
            (true, true) => "a hole and unwritten extents",
            (false, true) => "unwritten extents (allocated, never written)",
            _ => "a hole",
        }
    }
}

/// The first stretch of `[0, size)` that rule 2 refuses for want of written
/// data ([`unwritten_ranges`]), with what it is; `None` when every byte is
/// written.
pub fn first_unwritten(fd: BorrowedFd<'_>, size: u64) -> io::Result<Option<Unwritten>> {
    let ranges = unwritten_ranges(fd, 0, size)?;
    let Some(&(start, end)) = ranges.first() else {
        return Ok(None);
    };
    let mut in_extents = 0;
    let mut unwritten = false;
    for e in fiemap_range(fd, start, end, false)? {
        let (a, b) = (e.logical.max(start), (e.logical + e.len).min(end));
        if a < b {
            in_extents += b - a;
            unwritten |= e.flags & FIEMAP_EXTENT_UNWRITTEN != 0;
        }
    }
    Ok(Some(Unwritten {
        start,
        end,
        hole: in_extents < end - start,
        unwritten,
        total: ranges.iter().map(|(a, b)| b - a).sum(),
    }))
}

/// Bytes of `[0, size)` that are holes: what allocating the image takes
/// from its filesystem's free space.
pub fn hole_bytes(fd: BorrowedFd<'_>, size: u64) -> io::Result<u64> {
    let mut holes = 0;
    let mut covered = 0u64;
    for e in fiemap_range(fd, 0, size, true)? {
        if e.logical >= size {
            break;
        }
        holes += e.logical.saturating_sub(covered);
        covered = covered.max((e.logical + e.len).min(size));
    }
    Ok(holes + size.saturating_sub(covered))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::extent::ExtentMap;
    use crate::extent::testfs::{TestFs, temp_file_on};

    #[test]
    fn unwritten_ranges_are_the_holes_and_unwritten_extents_and_allocating_them_passes_rule_two() {
        use std::os::unix::fs::FileExt;
        for fs in ["ext4", "xfs"] {
            let t = TestFs::new(fs);
            let (_d, f, _) = temp_file_on(&t.mnt(), "punched.img");
            let k = 64 << 10;
            f.set_len(8 * k).unwrap();
            f.write_all_at(&vec![7u8; k as usize], 2 * k).unwrap();
            f.sync_all().unwrap();
            let keep = rustix::fs::FallocateFlags::KEEP_SIZE;
            rustix::fs::fallocate(&f, keep, 4 * k, 2 * k).unwrap();
            // Hole, data, hole + unwritten + hole (merged).
            let ranges = unwritten_ranges(f.as_fd(), 0, 8 * k).unwrap();
            assert_eq!(ranges, vec![(0, 2 * k), (3 * k, 8 * k)], "{fs}");
            assert_eq!(hole_bytes(f.as_fd(), 8 * k).unwrap(), 5 * k, "{fs}");
            let fd = std::os::fd::OwnedFd::from(f.try_clone().unwrap());
            crate::image::allocate_range(&fd, 0, 8 * k).unwrap();
            assert_eq!(unwritten_ranges(f.as_fd(), 0, 8 * k).unwrap(), vec![]);
            assert_eq!(hole_bytes(f.as_fd(), 8 * k).unwrap(), 0);
            ExtentMap::build(f.as_fd(), 8 * k).unwrap();
            let mut all = vec![0u8; 8 * k as usize];
            f.read_exact_at(&mut all, 0).unwrap();
            let data = (2 * k as usize)..(3 * k as usize);
            assert!(all[data.clone()].iter().all(|&b| b == 7), "{fs}");
            assert!(
                all.iter()
                    .enumerate()
                    .all(|(i, &b)| data.contains(&i) || b == 0),
                "{fs}"
            );
        }
    }

    #[test]
    fn first_unwritten_names_the_first_stretch_without_data_and_what_it_is() {
        use std::os::unix::fs::FileExt;
        let k = 64 << 10;
        let keep = rustix::fs::FallocateFlags::KEEP_SIZE;
        for fs in ["ext4", "xfs"] {
            let t = TestFs::new(fs);
            let (_d, f, _) = temp_file_on(&t.mnt(), "first.img");
            f.write_all_at(&vec![7u8; 4 * k as usize], 0).unwrap();
            f.sync_all().unwrap();
            assert_eq!(first_unwritten(f.as_fd(), 4 * k).unwrap(), None, "{fs}");
            rustix::fs::fallocate(&f, keep, 4 * k, 2 * k).unwrap();
            f.set_len(8 * k).unwrap();
            let u = first_unwritten(f.as_fd(), 8 * k).unwrap().unwrap();
            assert_eq!((u.start, u.end, u.total), (4 * k, 8 * k, 4 * k), "{fs}");
            assert_eq!(u.what(), "a hole and unwritten extents", "{fs}");
            let (_d2, g, _) = temp_file_on(&t.mnt(), "prealloc.img");
            rustix::fs::fallocate(&g, rustix::fs::FallocateFlags::empty(), 0, 4 * k).unwrap();
            let u = first_unwritten(g.as_fd(), 4 * k).unwrap().unwrap();
            assert_eq!(
                (u.start, u.end, u.hole, u.unwritten),
                (0, 4 * k, false, true),
                "{fs}"
            );
        }
    }
}
