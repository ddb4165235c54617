//! Filling an image a stretch at a time under an [`AllocateJob`]: zeros over
//! its holes and unwritten extents (allocate, making it `full`), or a
//! source's data into a new file (copy).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use rustix::fs::FallocateFlags;

use super::{ImageFile, ImageFileError, Result, io_error};

/// `fallocate` mode that writes zeroes and leaves written extents (Linux
/// 6.17, `linux/falloc.h`; not in the `libc` crate yet). Older kernels, and
/// filesystems or disks without it, answer EOPNOTSUPP.
pub const FALLOC_FL_WRITE_ZEROES: i32 = 0x80;

/// Bytes an allocate zeroes at a time: between stretches it can stop, and a
/// worker lets its queues go on.
pub const ALLOCATE_STEP: u64 = 16 << 20;

/// A running `POST /v1/images/{id}/allocate`: how far it got, and the
/// request to stop it.
#[derive(Debug, Default)]
pub struct AllocateJob {
    /// Bytes of holes and unwritten extents written with zeros so far.
    pub done_bytes: AtomicU64,
    /// Bytes of holes and unwritten extents to write.
    pub total_bytes: AtomicU64,
    /// Set to stop it after the current stretch.
    pub cancel: AtomicBool,
    /// A pause after each stretch (the test fault `slow_allocate`: progress
    /// and cancel observable on any disk).
    pub pace: std::time::Duration,
    /// While this file exists the job waits after each stretch (the test
    /// faults `gate_backup` and `slow_copy`: a job held mid-way for as long
    /// as a test needs, until a condition rather than for a time).
    pub gate: Option<std::path::PathBuf>,
}

impl AllocateJob {
    /// Whether the job waits at its gate now: the gate file exists and the
    /// job is not cancelled. The one rule for every job that has a gate.
    pub fn held_at_gate(&self) -> bool {
        self.gate.as_deref().is_some_and(std::path::Path::exists) && !self.cancel.load(Relaxed)
    }

    /// After a stretch of a blocking job: its pace, then a wait while it is
    /// [held at its gate](Self::held_at_gate).
    fn between_stretches(&self) {
        if !self.pace.is_zero() {
            std::thread::sleep(self.pace);
        }
        while self.held_at_gate() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// Makes `[from, to)` of an open image written zeros wherever it is a hole
/// or unwritten (the ranges rule 2 refuses), leaving written data alone:
/// holes get blocks (`fallocate`), then zeros are written over those ranges
/// (`FALLOC_FL_WRITE_ZEROES` where the kernel has it, else plain writes).
/// Whoever calls it keeps writers of those ranges out meanwhile: a write
/// that lands between the map being read and the zeros being written would
/// be overwritten.
pub fn allocate_range(fd: &OwnedFd, from: u64, to: u64) -> io::Result<()> {
    for (a, b) in crate::extent::unwritten_ranges(fd.as_fd(), from, to)? {
        rustix::fs::fallocate(fd, FallocateFlags::KEEP_SIZE, a, b - a)?;
        let zeroed = rustix::fs::fallocate(
            fd,
            FallocateFlags::from_bits_retain(FALLOC_FL_WRITE_ZEROES as u32),
            a,
            b - a,
        );
        match zeroed {
            Ok(()) => {}
            Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::INVAL) => write_zeros(fd, a, b)?,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub(super) fn write_zeros(fd: &OwnedFd, from: u64, to: u64) -> io::Result<()> {
    // Page-aligned pages, so the writes work on an O_DIRECT file too.
    #[repr(C, align(4096))]
    #[derive(Clone, Copy)]
    struct Page([u8; 4096]);
    let pages = vec![Page([0; 4096]); 256];
    // SAFETY: the pages are contiguous plain bytes.
    let zeros =
        unsafe { std::slice::from_raw_parts(pages.as_ptr().cast::<u8>(), pages.len() * 4096) };
    let mut off = from;
    while off < to {
        let n = ((to - off) as usize).min(zeros.len());
        let written = rustix::io::pwrite(fd, &zeros[..n], off)?;
        off += written as u64;
    }
    Ok(())
}

impl ImageFile {
    /// Writes zeros over the file's holes and unwritten extents (see
    /// [`allocate_range`]; nothing else may write it meanwhile), one stretch
    /// of at most [`ALLOCATE_STEP`] bytes at a time, reporting into `job` and
    /// stopping between stretches when `job.cancel` is set (`Ok(false)`);
    /// then syncs.
    pub fn allocate(&mut self, job: &AllocateJob) -> Result<bool> {
        let todo = crate::extent::unwritten_ranges(self.fd.as_fd(), 0, self.size())
            .map_err(|e| io_error(&self.path, "FS_IOC_FIEMAP", e))?;
        job.total_bytes
            .store(todo.iter().map(|(a, b)| b - a).sum(), Relaxed);
        let fill = || -> io::Result<bool> {
            for (a, b) in todo {
                let mut at = a;
                while at < b {
                    if job.cancel.load(Relaxed) {
                        return Ok(false);
                    }
                    let to = b.min(at + ALLOCATE_STEP);
                    allocate_range(&self.fd, at, to)?;
                    job.done_bytes.fetch_add(to - at, Relaxed);
                    job.between_stretches();
                    at = to;
                }
            }
            rustix::fs::fsync(&self.fd)?;
            Ok(true)
        };
        let done = fill().map_err(|e| ImageFileError::from_errno(&self.path, "allocate", e))?;
        self.refresh()?;
        Ok(done)
    }

    /// Makes this (new, empty) file a copy of `src`: its size, then each of
    /// `src`'s data ranges (`SEEK_DATA`/`SEEK_HOLE`: holes stay holes) with
    /// `copy_file_range` (which shares extents where the filesystem can),
    /// or, when `private`, with reads and writes (never shared), at most
    /// [`ALLOCATE_STEP`] bytes at a time, reporting into `job`
    /// (`total_bytes`: the data to copy) and stopping between stretches
    /// when `job.cancel` is set (`Ok(false)`); then syncs. `src` must not
    /// change meanwhile.
    pub fn copy_from(&mut self, src: &ImageFile, job: &AllocateJob, private: bool) -> Result<bool> {
        let size = src.size();
        let ranges = data_ranges(&src.fd, size).map_err(|e| io_error(&src.path, "SEEK_DATA", e))?;
        job.total_bytes
            .store(ranges.iter().map(|(a, b)| b - a).sum(), Relaxed);
        let copy = || -> io::Result<bool> {
            rustix::fs::ftruncate(&self.fd, size)?;
            for (a, b) in ranges {
                let mut at = a;
                while at < b {
                    if job.cancel.load(Relaxed) {
                        return Ok(false);
                    }
                    let len = (b - at).min(ALLOCATE_STEP) as usize;
                    let n = if private {
                        copy_by_reading(&src.fd, &self.fd, at, len)?
                    } else {
                        let (mut from, mut to) = (at, at);
                        rustix::fs::copy_file_range(
                            &src.fd,
                            Some(&mut from),
                            &self.fd,
                            Some(&mut to),
                            len,
                        )?
                    };
                    if n == 0 {
                        return Err(io::Error::other(format!(
                            "the source ended at {at} bytes, short of {b}"
                        )));
                    }
                    job.done_bytes.fetch_add(n as u64, Relaxed);
                    job.between_stretches();
                    at += n as u64;
                }
            }
            rustix::fs::fsync(&self.fd)?;
            Ok(true)
        };
        let done = copy().map_err(|e| ImageFileError::from_errno(&self.path, "copy", e))?;
        self.refresh()?;
        Ok(done)
    }
}

/// Copies `len` bytes at `at` from `src` to `dst` through a buffer, so no
/// extent is shared; the bytes copied (short at the source's end).
fn copy_by_reading(src: &OwnedFd, dst: &OwnedFd, at: u64, len: usize) -> io::Result<usize> {
    let mut buf = vec![0u8; len.min(1 << 20)];
    let mut done = 0;
    while done < len {
        let want = (len - done).min(buf.len());
        let n = rustix::io::pread(src, &mut buf[..want], at + done as u64)?;
        if n == 0 {
            break;
        }
        let mut put = 0;
        while put < n {
            put += rustix::io::pwrite(dst, &buf[put..n], at + (done + put) as u64)?;
        }
        done += n;
    }
    Ok(done)
}

/// The `[start, end)` ranges of a file of `size` bytes that hold data, as
/// `SEEK_DATA`/`SEEK_HOLE` tell them.
fn data_ranges(fd: &OwnedFd, size: u64) -> io::Result<Vec<(u64, u64)>> {
    use rustix::fs::SeekFrom;
    let mut out = Vec::new();
    let mut at = 0;
    while at < size {
        let start = match rustix::fs::seek(fd, SeekFrom::Data(at)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = rustix::fs::seek(fd, SeekFrom::Hole(start))?.min(size);
        if end > start {
            out.push((start, end));
        }
        at = end.max(start + 1);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use blockplane_api::model::Allocation;

    use super::*;
    use crate::image::ImageRoots;

    /// A root in a temp dir with `src.img`: 8 MiB, 1 MiB of data at 3 MiB,
    /// holes elsewhere.
    fn root_with_source() -> (tempfile::TempDir, ImageRoots, ImageFile) {
        let dir = tempfile::tempdir().unwrap();
        let roots = ImageRoots::open(&[dir.path().to_path_buf()]).unwrap();
        let path = roots
            .resolve(&dir.path().join("src.img").display().to_string())
            .unwrap();
        let src = roots
            .create_file(&path, 8 << 20, Allocation::Sparse)
            .unwrap();
        std::fs::File::from(src.fd().try_clone().unwrap())
            .write_all_at(&[0x77; 1 << 20], 3 << 20)
            .unwrap();
        (dir, roots, src)
    }

    fn new_copy(dir: &tempfile::TempDir, roots: &ImageRoots, name: &str) -> ImageFile {
        let p = roots
            .resolve(&dir.path().join(name).display().to_string())
            .unwrap();
        roots.create_then(&p, |_| Ok(())).unwrap()
    }

    #[test]
    fn a_copy_keeps_the_data_and_the_holes_by_either_way() {
        let (dir, roots, src) = root_with_source();
        for (name, private) in [("shared", false), ("private", true)] {
            let mut dst = new_copy(&dir, &roots, name);
            let job = AllocateJob::default();
            assert!(dst.copy_from(&src, &job, private).unwrap());
            assert_eq!(job.total_bytes.load(Relaxed), 1 << 20);
            assert_eq!(job.done_bytes.load(Relaxed), 1 << 20);
            assert_eq!(dst.size(), 8 << 20);
            let copied = std::fs::read(dir.path().join(name)).unwrap();
            assert_eq!(copied, std::fs::read(dir.path().join("src.img")).unwrap());
            // Only the data took blocks: the holes stayed holes.
            assert!(dst.allocated() <= 2 << 20, "{name}: {}", dst.allocated());
        }
    }

    #[test]
    fn a_cancelled_copy_stops_before_its_first_stretch() {
        let (dir, roots, src) = root_with_source();
        let mut dst = new_copy(&dir, &roots, "dst");
        let job = AllocateJob::default();
        job.cancel.store(true, Relaxed);
        assert!(!dst.copy_from(&src, &job, false).unwrap());
        assert_eq!(job.done_bytes.load(Relaxed), 0);
    }
}
