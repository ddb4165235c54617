//! An image's map onto raw devices: built under rules 1, 2 and 4, compared
//! for rule 5, and split per request by the data path.

use std::os::fd::BorrowedFd;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::fiemap::fiemap;
use super::rules::{MapError, check_extents, check_filesystem};
use super::stack::{DevNum, Layer};

/// A stretch of the image mapped onto a raw device (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Offset in the image.
    pub logical: u64,
    /// Length.
    pub len: u64,
    /// Index into [`ExtentMap::devices`].
    pub device: usize,
    /// Offset on that device.
    pub physical: u64,
}

/// A raw block device a map points into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawDevice {
    /// Its device number.
    pub dev: DevNum,
    /// Its node under /dev, which the direct path opens.
    pub node: PathBuf,
}

/// An image's validated map onto raw devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtentMap {
    /// The image's size: the map covers `[0, size)`.
    pub size: u64,
    /// The device the filesystem is on (before translation).
    pub fs_device: DevNum,
    /// The raw devices the segments point into.
    pub devices: Vec<RawDevice>,
    /// Sorted by `logical`, contiguous, covering `[0, size)`.
    pub segments: Vec<Segment>,
}

/// One piece of an I/O request, on one raw device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index into [`ExtentMap::devices`].
    pub device: usize,
    /// Offset on that device.
    pub physical: u64,
    /// Length.
    pub len: u64,
    /// Offset of this piece within the request.
    pub offset_in_request: u64,
}

/// The pieces of one request, in order (see [`ExtentMap::pieces`]).
#[derive(Debug, Clone)]
pub struct Pieces<'a> {
    segments: &'a [Segment],
    start: u64,
    at: u64,
    end: u64,
}

impl Iterator for Pieces<'_> {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.at >= self.end {
            return None;
        }
        let (s, rest) = self.segments.split_first()?;
        let within = self.at - s.logical;
        let n = (s.len - within).min(self.end - self.at);
        let piece = Piece {
            device: s.device,
            physical: s.physical + within,
            len: n,
            offset_in_request: self.at - self.start,
        };
        self.at += n;
        self.segments = rest;
        Some(piece)
    }
}

impl ExtentMap {
    /// Builds the map of an image of `size` bytes under rules 1, 2 and 4.
    pub fn build(fd: BorrowedFd<'_>, size: u64) -> Result<Self, MapError> {
        check_filesystem(fd)?;
        let st = rustix::fs::fstat(fd).map_err(|e| MapError::io("fstat", e.into()))?;
        let extents = fiemap(fd, true).map_err(|e| MapError::io("FS_IOC_FIEMAP", e))?;
        check_extents(&extents, size)?;
        let fs_device = DevNum::from_dev(st.st_dev);
        let layer = Layer::resolve(fs_device, 0)?;
        let mut devices = Vec::new();
        let mut segments = Vec::new();
        for e in extents.iter().filter(|e| e.logical < size) {
            let len = e.len.min(size - e.logical);
            for (dev, physical, piece_len, at) in layer.translate(e.physical, len)? {
                let device = match devices.iter().position(|d: &RawDevice| d.dev == dev) {
                    Some(i) => i,
                    None => {
                        let node = dev.node().map_err(|err| MapError::Device {
                            dev: dev.to_string(),
                            reason: err.to_string(),
                        })?;
                        devices.push(RawDevice { dev, node });
                        devices.len() - 1
                    }
                };
                push_merged(
                    &mut segments,
                    Segment {
                        logical: e.logical + at,
                        len: piece_len,
                        device,
                        physical,
                    },
                );
            }
        }
        Ok(Self {
            size,
            fs_device,
            devices,
            segments,
        })
    }

    /// Splits `[offset, offset + len)` of the image at segment boundaries,
    /// without allocating (the data path calls it per request). Returns
    /// `None` if any part lies beyond the map.
    pub fn pieces(&self, offset: u64, len: u64) -> Option<Pieces<'_>> {
        let end = offset.checked_add(len)?;
        if end > self.size {
            return None;
        }
        let first = self
            .segments
            .partition_point(|s| s.logical + s.len <= offset);
        // Segments are contiguous (rule 2: no holes); they must reach the end.
        self.segments.last().filter(|s| s.logical + s.len >= end)?;
        Some(Pieces {
            segments: &self.segments[first..],
            start: offset,
            at: offset,
            end,
        })
    }

    /// Describes how `other` differs from this map (rule 5), or `None`.
    pub fn differences(&self, other: &ExtentMap) -> Option<String> {
        if self == other {
            return None;
        }
        if self.size != other.size {
            return Some(format!("size changed from {} to {}", self.size, other.size));
        }
        if self.devices != other.devices {
            return Some("the underlying devices changed".into());
        }
        let moved = self
            .segments
            .iter()
            .zip(&other.segments)
            .find(|(a, b)| a != b)
            .map(|(a, _)| a.logical)
            .unwrap_or(0);
        Some(format!(
            "the extent at byte {moved} moved ({} segments before, {} now)",
            self.segments.len(),
            other.segments.len()
        ))
    }
}

fn push_merged(segments: &mut Vec<Segment>, s: Segment) {
    if let Some(last) = segments.last_mut()
        && last.device == s.device
        && last.logical + last.len == s.logical
        && last.physical + last.len == s.physical
    {
        last.len += s.len;
        return;
    }
    segments.push(s);
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::AsFd;
    use std::os::unix::fs::OpenOptionsExt;

    use super::*;
    use crate::extent::drop_page_cache;
    use crate::extent::testfs::{TestFs, run, temp_file_on};

    #[test]
    fn pieces_split_at_segment_boundaries() {
        let map = ExtentMap {
            size: 12288,
            fs_device: DevNum { major: 1, minor: 1 },
            devices: vec![],
            segments: vec![
                Segment {
                    logical: 0,
                    len: 4096,
                    device: 0,
                    physical: 100_000,
                },
                Segment {
                    logical: 4096,
                    len: 8192,
                    device: 0,
                    physical: 900_000,
                },
            ],
        };
        let p: Vec<Piece> = map.pieces(2048, 4096).unwrap().collect();
        assert_eq!(
            p,
            vec![
                Piece {
                    device: 0,
                    physical: 102_048,
                    len: 2048,
                    offset_in_request: 0
                },
                Piece {
                    device: 0,
                    physical: 900_000,
                    len: 2048,
                    offset_in_request: 2048
                },
            ]
        );
        assert_eq!(map.pieces(8192, 4096).unwrap().count(), 1);
        assert!(map.pieces(8192, 8192).is_none(), "beyond the end");
    }

    /// Reads what the raw device holds where the map says the image is, and
    /// compares it with the file's content: the map is the truth.
    #[test]
    fn a_written_image_maps_onto_the_raw_device_byte_for_byte() {
        for fs in ["ext4", "xfs"] {
            let t = TestFs::new(fs);
            written_image_maps_byte_for_byte(&t);
        }
    }

    fn written_image_maps_byte_for_byte(t: &TestFs) {
        let (_d, mut f, _) = temp_file_on(&t.mnt(), "full.img");
        let size = 3 << 20;
        let data: Vec<u8> = (0..size)
            .map(|i| (i * 7 / 4096) as u8 ^ (i as u8))
            .collect();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        let map = ExtentMap::build(f.as_fd(), size as u64).unwrap();
        assert_eq!(map.segments.iter().map(|s| s.len).sum::<u64>(), size as u64);
        assert_eq!(map.devices.len(), 1);
        assert_eq!(map.devices[0].node.display().to_string(), t.dev);
        drop_page_cache(f.as_fd()).unwrap();
        let pieces: Vec<Piece> = map.pieces(0, size as u64).unwrap().collect();
        let mut back = vec![0u8; size];
        for p in pieces {
            let mut dev = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&map.devices[p.device].node)
                .unwrap();
            // O_DIRECT wants aligned memory: a vector of page-aligned pages.
            #[repr(C, align(4096))]
            #[derive(Clone, Copy)]
            struct Page([u8; 4096]);
            let mut pages = vec![Page([0; 4096]); (p.len as usize).div_ceil(4096)];
            // SAFETY: the pages are contiguous plain bytes.
            let buf = unsafe {
                std::slice::from_raw_parts_mut(pages.as_mut_ptr().cast::<u8>(), p.len as usize)
            };
            dev.seek(SeekFrom::Start(p.physical)).unwrap();
            dev.read_exact(buf).unwrap();
            let at = p.offset_in_request as usize;
            back[at..at + p.len as usize].copy_from_slice(buf);
        }
        assert!(
            back == data,
            "the raw device does not hold the image's bytes where the map says"
        );
    }

    #[test]
    fn sparse_unwritten_and_shared_images_are_refused_under_rule_two() {
        let t = TestFs::new("xfs");
        let (_d, f, _) = temp_file_on(&t.mnt(), "sparse.img");
        f.set_len(1 << 20).unwrap();
        let e = ExtentMap::build(f.as_fd(), 1 << 20).unwrap_err();
        assert!(matches!(e, MapError::Hole { .. }), "{e}");
        let (_d, f, _) = temp_file_on(&t.mnt(), "unwritten.img");
        rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, 1 << 20).unwrap();
        let e = ExtentMap::build(f.as_fd(), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("UNWRITTEN"), "{e}");
        // A reflinked copy shares its extents with the original.
        let (_d, mut f, p) = temp_file_on(&t.mnt(), "orig.img");
        f.write_all(&[5u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        let copy = format!("{}.copy", p.display());
        run("cp", &["--reflink=always", p.to_str().unwrap(), &copy]);
        let e = ExtentMap::build(f.as_fd(), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("SHARED"), "{e}");
    }
}
