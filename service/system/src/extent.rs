//! Direct maps: an image's extents, checked against the direct-map safety
//! rules (all seven are stated in `docs/architecture.md`) and translated to
//! the raw block device beneath its filesystem, so I/O can bypass the
//! filesystem.
//!
//! Rules checked here (each refusal names its rule):
//! 1. the filesystem is block-mapped and not copy-on-write: ext4 or xfs;
//! 2. every extent from `FS_IOC_FIEMAP` (with `FIEMAP_FLAG_SYNC`) is plain,
//!    512-aligned, with no holes, and the last one carries `LAST`;
//! 3. the file is pinned with `FS_IMMUTABLE_FL` while mapped ([`Pin`]);
//! 4. the filesystem's device is resolved through sysfs, and through
//!    device-mapper `linear` tables (only) down to a raw device;
//! 5. the map is re-read and compared ([`ExtentMap::differences`]);
//! 6. the image's page cache is written back and dropped ([`drop_page_cache`]).
//!
//! Rule 7 (opening the raw disk while its filesystem is mounted) is checked
//! where the raw device is opened: the dm backend and the ublk worker.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Allocated but never written: reads as zeroes, refused by rule 2.
pub const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
/// The remedy named by rule 2's refusals of holes and unwritten extents.
const REALLOCATE: &str = "`POST /v1/images/{id}/allocate` (`blockplane image allocate NAME`) writes zeros over them and makes the image `full`";
/// Flags that make an extent unusable for a direct map, with their names.
/// UNWRITTEN is its own refusal ([`MapError::Unwritten`]).
const BAD_FLAGS: [(u32, &str); 9] = [
    (0x2, "UNKNOWN (location not known)"),
    (0x4, "DELALLOC (not yet allocated)"),
    (0x8, "ENCODED (compressed or otherwise encoded)"),
    (0x80, "DATA_ENCRYPTED (encrypted on disk)"),
    (0x100, "NOT_ALIGNED (not block-aligned)"),
    (0x200, "DATA_INLINE (stored in metadata)"),
    (0x400, "DATA_TAIL (packed with other files)"),
    (0x2000, "SHARED (shared with another file, e.g. reflinked)"),
    (0x4000_0000, "unknown flag"),
];
const EXTENTS_PER_CALL: usize = 256;

/// Why an image cannot be direct-mapped (or its map could not be read).
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error(
        "direct-map rule 1: the image is on {fs}, not on a block-mapped, non-copy-on-write filesystem (ext4 or xfs)"
    )]
    Filesystem { fs: String },
    #[error(
        "direct-map rule 2: the image has a hole at bytes {start}..{end} (a sparse image, or blocks punched by discards through a volume served nowait/threaded on a sparse image or before blockplane kept full images allocated, or by another program); {remedy}",
        remedy = REALLOCATE
    )]
    Hole { start: u64, end: u64 },
    #[error(
        "direct-map rule 2: the extent at byte {logical} is UNWRITTEN (allocated, never written: fallocate'd, or zeroed with FALLOC_FL_ZERO_RANGE by a volume served nowait/threaded on a sparse image or before blockplane kept full images allocated, or by another program); {remedy}",
        remedy = REALLOCATE
    )]
    Unwritten { logical: u64 },
    #[error("direct-map rule 2: the extent at byte {logical} is {what}")]
    BadExtent { logical: u64, what: &'static str },
    #[error("direct-map rule 2: the extent at byte {logical} is not 512-byte aligned")]
    Unaligned { logical: u64 },
    #[error("direct-map rule 2: the extent list does not end with FIEMAP_EXTENT_LAST")]
    NoLast,
    #[error(
        "direct-map rule 3: the image is immutable by its owner's choice and can back only read-only volumes on the file paths"
    )]
    ImmutableByUser,
    #[error(
        "direct-map rule 4: the filesystem's device {dev} is a device-mapper '{target}' target; only 'linear' tables can be mapped through"
    )]
    Target { dev: String, target: String },
    #[error("direct-map rule 4: cannot resolve the filesystem's device {dev}: {reason}")]
    Device { dev: String, reason: String },
    #[error("direct map: {op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl MapError {
    fn io(op: &'static str, source: io::Error) -> Self {
        MapError::Io { op, source }
    }
}

/// A block device number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DevNum {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for DevNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

impl DevNum {
    /// From a `st_dev` / `st_rdev` value.
    pub fn from_dev(dev: u64) -> Self {
        Self {
            major: rustix::fs::major(dev),
            minor: rustix::fs::minor(dev),
        }
    }

    fn sys(&self) -> PathBuf {
        PathBuf::from(format!("/sys/dev/block/{self}"))
    }

    fn sys_read(&self, attr: &str) -> io::Result<String> {
        std::fs::read_to_string(self.sys().join(attr)).map(|s| s.trim().to_string())
    }

    /// The device's node under /dev (from its uevent's DEVNAME: devtmpfs names
    /// nodes so, with or without udev).
    pub fn node(&self) -> io::Result<PathBuf> {
        let uevent = self.sys_read("uevent")?;
        uevent
            .lines()
            .find_map(|l| l.strip_prefix("DEVNAME="))
            .map(|n| PathBuf::from("/dev").join(n))
            .ok_or_else(|| io::Error::other(format!("no DEVNAME for block device {self}")))
    }

    /// Size in bytes.
    pub fn size(&self) -> io::Result<u64> {
        self.sys_read("size")?
            .parse::<u64>()
            .map(|s| s * 512)
            .map_err(io::Error::other)
    }
}

/// One extent as `FS_IOC_FIEMAP` reports it (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsExtent {
    pub logical: u64,
    pub physical: u64,
    pub len: u64,
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

/// The stretches of `[from, to)` that rule 2 refuses for want of written
/// data: holes and UNWRITTEN extents (both read as zeroes), sorted, merged.
pub fn unwritten_ranges(fd: BorrowedFd<'_>, from: u64, to: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut add = |a: u64, b: u64| {
        let (a, b) = (a.max(from), b.min(to));
        if a >= b {
            return;
        }
        match out.last_mut() {
            Some(last) if last.1 >= a => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    };
    let mut written_to = from;
    for e in fiemap_range(fd, from, to, true)? {
        let end = e.logical + e.len;
        if e.logical > written_to {
            add(written_to, e.logical);
        }
        if e.flags & FIEMAP_EXTENT_UNWRITTEN != 0 {
            add(e.logical, end);
        }
        written_to = written_to.max(end);
    }
    add(written_to, to);
    Ok(out)
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

/// Checks rule 2 over `[0, size)`.
pub fn check_extents(extents: &[FsExtent], size: u64) -> Result<(), MapError> {
    let mut expect = 0u64;
    for e in extents {
        if e.logical >= size {
            break;
        }
        if e.logical > expect {
            return Err(MapError::Hole {
                start: expect,
                end: e.logical,
            });
        }
        if e.flags & FIEMAP_EXTENT_UNWRITTEN != 0 {
            return Err(MapError::Unwritten { logical: e.logical });
        }
        if let Some((_, what)) = BAD_FLAGS.iter().find(|(bit, _)| e.flags & bit != 0) {
            return Err(MapError::BadExtent {
                logical: e.logical,
                what,
            });
        }
        if e.logical % 512 != 0 || e.physical % 512 != 0 || e.len % 512 != 0 {
            return Err(MapError::Unaligned { logical: e.logical });
        }
        expect = expect.max(e.logical + e.len);
    }
    if expect < size {
        return Err(MapError::Hole {
            start: expect,
            end: size,
        });
    }
    if extents
        .last()
        .is_none_or(|e| e.flags & FIEMAP_EXTENT_LAST == 0)
    {
        return Err(MapError::NoLast);
    }
    Ok(())
}

/// A stretch of the image mapped onto a raw device (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Offset in the image.
    pub logical: u64,
    pub len: u64,
    /// Index into [`ExtentMap::devices`].
    pub device: usize,
    /// Offset on that device.
    pub physical: u64,
}

/// A raw block device a map points into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawDevice {
    pub dev: DevNum,
    pub node: PathBuf,
}

/// An image's validated map onto raw devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtentMap {
    pub size: u64,
    /// The device the filesystem is on (before translation).
    pub fs_device: DevNum,
    pub devices: Vec<RawDevice>,
    /// Sorted by `logical`, contiguous, covering `[0, size)`.
    pub segments: Vec<Segment>,
}

/// One piece of an I/O request, on one raw device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub device: usize,
    pub physical: u64,
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
        let fs = rustix::fs::fstatfs(fd).map_err(|e| MapError::io("statfs", e.into()))?;
        let fs_name = filesystem_name(fs.f_type as i64);
        if !matches!(fs_name, "ext4" | "xfs") {
            return Err(MapError::Filesystem {
                fs: fs_name.to_string(),
            });
        }
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

/// A block device as rule 4 sees it: raw, or a dm device made only of linear
/// targets over other layers.
#[derive(Debug)]
enum Layer {
    Raw(DevNum),
    Linear(DevNum, Vec<LinearTarget>),
}

/// `start len linear dev offset`, in bytes.
#[derive(Debug)]
struct LinearTarget {
    start: u64,
    len: u64,
    below: Layer,
    offset: u64,
}

const MAX_DEPTH: usize = 8;

impl Layer {
    fn resolve(dev: DevNum, depth: usize) -> Result<Self, MapError> {
        let err = |reason: String| MapError::Device {
            dev: dev.to_string(),
            reason,
        };
        if depth > MAX_DEPTH {
            return Err(err("device-mapper stack deeper than 8".into()));
        }
        if !dev.sys().exists() {
            return Err(err("not in /sys/dev/block".into()));
        }
        let Ok(name) = dev.sys_read("dm/name") else {
            return Ok(Layer::Raw(dev));
        };
        let table = dm_table(&name).map_err(|e| err(format!("reading dm table of {name}: {e}")))?;
        let mut targets = Vec::new();
        for (start, len, kind, params) in table {
            if kind != "linear" {
                return Err(MapError::Target {
                    dev: format!("{dev} ({name})"),
                    target: kind,
                });
            }
            let mut p = params.split_whitespace();
            let (Some(below), Some(offset)) =
                (p.next(), p.next().and_then(|o| o.parse::<u64>().ok()))
            else {
                return Err(err(format!("unexpected linear parameters '{params}'")));
            };
            let below = parse_devnum(below)
                .ok_or_else(|| err(format!("unexpected device '{below}' in table")))?;
            targets.push(LinearTarget {
                start: start * 512,
                len: len * 512,
                below: Layer::resolve(below, depth + 1)?,
                offset: offset * 512,
            });
        }
        Ok(Layer::Linear(dev, targets))
    }

    /// Maps `[physical, physical + len)` of this layer to raw devices:
    /// `(device, offset on it, length, offset within the input range)`.
    fn translate(&self, physical: u64, len: u64) -> Result<Vec<(DevNum, u64, u64, u64)>, MapError> {
        match self {
            Layer::Raw(dev) => Ok(vec![(*dev, physical, len, 0)]),
            Layer::Linear(dev, targets) => {
                let mut out = Vec::new();
                let mut at = physical;
                let end = physical + len;
                while at < end {
                    let t = targets
                        .iter()
                        .find(|t| t.start <= at && at < t.start + t.len)
                        .ok_or_else(|| MapError::Device {
                            dev: dev.to_string(),
                            reason: format!("byte {at} is outside its table"),
                        })?;
                    let n = (t.start + t.len - at).min(end - at);
                    for (d, p, l, within) in t.below.translate(t.offset + (at - t.start), n)? {
                        out.push((d, p, l, at - physical + within));
                    }
                    at += n;
                }
                Ok(out)
            }
        }
    }
}

fn parse_devnum(s: &str) -> Option<DevNum> {
    let (ma, mi) = s.split_once(':')?;
    Some(DevNum {
        major: ma.parse().ok()?,
        minor: mi.parse().ok()?,
    })
}

fn dm_table(name: &str) -> Result<Vec<(u64, u64, String, String)>, String> {
    use devicemapper::{DM, DevId, DmFlags, DmName, DmOptions};
    let dm = DM::new().map_err(|e| e.to_string())?;
    let name = DmName::new(name).map_err(|e| e.to_string())?;
    let (_, table) = dm
        .table_status(
            &DevId::Name(name),
            DmOptions::default().set_flags(DmFlags::DM_STATUS_TABLE),
        )
        .map_err(|e| e.to_string())?;
    Ok(table)
}

/// The image pinned with `FS_IMMUTABLE_FL` (rule 3): truncate, punch, reflink,
/// defragment and unlink fail while it is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    /// The flag was already set (the owner's choice): unpinning leaves it.
    pub was_immutable: bool,
}

/// Whether the file carries `FS_IMMUTABLE_FL`.
pub fn is_immutable(fd: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(rustix::fs::ioctl_getflags(fd)?.contains(rustix::fs::IFlags::IMMUTABLE))
}

/// Sets `FS_IMMUTABLE_FL`, remembering whether it was set before.
pub fn pin(fd: BorrowedFd<'_>) -> Result<Pin, MapError> {
    let flags =
        rustix::fs::ioctl_getflags(fd).map_err(|e| MapError::io("FS_IOC_GETFLAGS", e.into()))?;
    let was_immutable = flags.contains(rustix::fs::IFlags::IMMUTABLE);
    if !was_immutable {
        rustix::fs::ioctl_setflags(fd, flags | rustix::fs::IFlags::IMMUTABLE)
            .map_err(|e| MapError::io("set FS_IMMUTABLE_FL", e.into()))?;
    }
    Ok(Pin { was_immutable })
}

/// Clears `FS_IMMUTABLE_FL` unless it was set before [`pin`].
pub fn unpin(fd: BorrowedFd<'_>, pin: Pin) -> io::Result<()> {
    if pin.was_immutable {
        return Ok(());
    }
    let flags = rustix::fs::ioctl_getflags(fd)?;
    if flags.contains(rustix::fs::IFlags::IMMUTABLE) {
        rustix::fs::ioctl_setflags(fd, flags - rustix::fs::IFlags::IMMUTABLE)?;
    }
    Ok(())
}

/// Rule 6: writes back and drops the image's cached pages, so nothing read
/// through the page cache disagrees with the raw device.
pub fn drop_page_cache(fd: BorrowedFd<'_>) -> io::Result<()> {
    rustix::fs::fdatasync(fd)?;
    rustix::fs::fadvise(fd, 0, None, rustix::fs::Advice::DontNeed)?;
    Ok(())
}

/// Builds, pins and readies a map in the order the rules need: map and check
/// (with a sync), pin, map again (nothing can have moved it since the pin:
/// compare), drop the page cache. `decided`: the map a dispatch decision was
/// made from, taken as the first map instead of reading it again: the image
/// must still map that way once pinned.
pub fn map_and_pin(
    fd: BorrowedFd<'_>,
    size: u64,
    decided: Option<ExtentMap>,
) -> Result<(ExtentMap, Pin), MapError> {
    let first = match decided {
        Some(map) => map,
        None => ExtentMap::build(fd, size)?,
    };
    let pinned = pin(fd)?;
    let undo = |e: MapError| {
        let _ = unpin(fd, pinned);
        e
    };
    let map = ExtentMap::build(fd, size).map_err(undo)?;
    if let Some(diff) = first.differences(&map) {
        return Err(undo(MapError::Device {
            dev: map.fs_device.to_string(),
            reason: format!("the map changed while pinning: {diff}"),
        }));
    }
    drop_page_cache(fd).map_err(|e| undo(MapError::io("drop page cache", e)))?;
    Ok((map, pinned))
}

/// The name of a filesystem from its `statfs` magic number.
pub fn filesystem_name(magic: i64) -> &'static str {
    match magic as u32 {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0xCA45_1A4E => "bcachefs",
        0xF2F5_2010 => "f2fs",
        0x0102_1994 => "tmpfs",
        0x8584_58F6 => "ramfs",
        0x794C_7630 => "overlay",
        0x6969 => "nfs",
        0xFF53_4D42 => "cifs",
        0xFE53_4D42 => "smb2",
        0x6573_5546 => "fuse",
        0x0102_1997 => "9p",
        0x2FC1_2FC1 => "zfs",
        0x4D44 => "vfat",
        0x2011_BAB0 => "exfat",
        0x7366_746E => "ntfs3",
        0x00C3_6400 => "ceph",
        0x5346_4846 => "jfs",
        0x5265_4973 => "reiserfs",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(logical: u64, len: u64, flags: u32) -> FsExtent {
        FsExtent {
            logical,
            physical: 1 << 30 | logical,
            len,
            flags,
        }
    }

    #[test]
    fn rule_two_refuses_holes_bad_flags_and_missing_last() {
        let ok = [ext(0, 4096, 0), ext(4096, 4096, FIEMAP_EXTENT_LAST)];
        check_extents(&ok, 8192).unwrap();
        let hole = [ext(0, 4096, 0), ext(8192, 4096, FIEMAP_EXTENT_LAST)];
        assert!(matches!(
            check_extents(&hole, 12288),
            Err(MapError::Hole {
                start: 4096,
                end: 8192
            })
        ));
        let short = [ext(0, 4096, FIEMAP_EXTENT_LAST)];
        assert!(matches!(
            check_extents(&short, 8192),
            Err(MapError::Hole { .. })
        ));
        let unwritten = [ext(0, 4096, 0x800 | FIEMAP_EXTENT_LAST)];
        let e = check_extents(&unwritten, 4096).unwrap_err();
        assert!(
            e.to_string().contains("UNWRITTEN") && e.to_string().contains("rule 2"),
            "{e}"
        );
        // Both name the cause and the call that re-allocates.
        let hole = check_extents(&hole, 12288).unwrap_err();
        for e in [e, hole] {
            let m = e.to_string();
            assert!(
                m.contains("nowait/threaded") && m.contains("/v1/images/{id}/allocate"),
                "{m}"
            );
        }
        let shared = [ext(0, 4096, 0x2000 | FIEMAP_EXTENT_LAST)];
        assert!(
            check_extents(&shared, 4096)
                .unwrap_err()
                .to_string()
                .contains("SHARED")
        );
        let nolast = [ext(0, 4096, 0)];
        assert!(matches!(
            check_extents(&nolast, 4096),
            Err(MapError::NoLast)
        ));
        let odd = [FsExtent {
            logical: 0,
            physical: 100,
            len: 4096,
            flags: FIEMAP_EXTENT_LAST,
        }];
        assert!(matches!(
            check_extents(&odd, 4096),
            Err(MapError::Unaligned { .. })
        ));
        assert!(matches!(
            check_extents(&[], 4096),
            Err(MapError::Hole { .. })
        ));
    }

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

    #[test]
    fn linear_layers_translate_and_split() {
        let raw = DevNum { major: 8, minor: 0 };
        let layer = Layer::Linear(
            DevNum {
                major: 253,
                minor: 0,
            },
            vec![
                LinearTarget {
                    start: 0,
                    len: 1 << 20,
                    below: Layer::Raw(raw),
                    offset: 10 << 20,
                },
                LinearTarget {
                    start: 1 << 20,
                    len: 1 << 20,
                    below: Layer::Raw(raw),
                    offset: 50 << 20,
                },
            ],
        );
        let t = layer.translate((1 << 20) - 4096, 8192).unwrap();
        assert_eq!(
            t,
            vec![
                (raw, (11 << 20) - 4096, 4096, 0),
                (raw, 50 << 20, 4096, 4096),
            ]
        );
        assert!(layer.translate(2 << 20, 512).is_err());
    }

    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::AsFd;
    use std::os::unix::fs::OpenOptionsExt;

    fn temp_file_on(dir: &str, name: &str) -> (tempfile::TempDir, std::fs::File, PathBuf) {
        let d = tempfile::tempdir_in(dir).unwrap();
        let p = d.path().join(name);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        (d, f, p)
    }

    fn run(cmd: &str, args: &[&str]) -> String {
        let out = std::process::Command::new(cmd).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A real filesystem (mkfs.<fs>) on a loop device, mounted on a temp dir:
    /// its raw device is readable here, unlike the host's own disk.
    struct TestFs {
        dir: tempfile::TempDir,
        dev: String,
    }

    impl TestFs {
        fn new(fs: &str) -> Self {
            let dir = tempfile::tempdir_in("/var/tmp").unwrap();
            let backing = dir.path().join("fs.raw");
            std::fs::File::create(&backing)
                .unwrap()
                .set_len(400 << 20)
                .unwrap();
            let dev = run("losetup", &["-f", "--show", backing.to_str().unwrap()]);
            run(&format!("mkfs.{fs}"), &["-q", &dev]);
            let mnt = dir.path().join("mnt");
            std::fs::create_dir(&mnt).unwrap();
            run("mount", &[&dev, mnt.to_str().unwrap()]);
            Self { dir, dev }
        }

        fn mnt(&self) -> String {
            self.dir.path().join("mnt").display().to_string()
        }
    }

    impl Drop for TestFs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg(self.mnt())
                .status();
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.dev])
                .status();
        }
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
    fn tmpfs_is_refused_under_rule_one() {
        let (_d, mut f, _) = temp_file_on("/dev/shm", "t.img");
        f.write_all(&[1u8; 4096]).unwrap();
        let e = ExtentMap::build(f.as_fd(), 4096).unwrap_err();
        assert!(
            e.to_string().contains("rule 1") && e.to_string().contains("tmpfs"),
            "{e}"
        );
    }

    #[test]
    fn a_pinned_image_refuses_truncate_and_unlink_until_unpinned() {
        let t = TestFs::new("ext4");
        let (_d, mut f, p) = temp_file_on(&t.mnt(), "pin.img");
        f.write_all(&[1u8; 1 << 20]).unwrap();
        let (map, pinned) = map_and_pin(f.as_fd(), 1 << 20, None).unwrap();
        assert!(!pinned.was_immutable);
        assert!(!map.segments.is_empty());
        let e = std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        assert_eq!(
            f.set_len(4096).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
        assert_eq!(
            std::fs::remove_file(&p).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
        unpin(f.as_fd(), pinned).unwrap();
        assert!(!is_immutable(f.as_fd()).unwrap());
        // Immutable by the owner's choice: pin and unpin leave it set.
        let owner = pin(f.as_fd()).unwrap();
        let again = pin(f.as_fd()).unwrap();
        assert!(again.was_immutable);
        unpin(f.as_fd(), again).unwrap();
        assert!(is_immutable(f.as_fd()).unwrap());
        unpin(f.as_fd(), owner).unwrap();
        f.set_len(4096).unwrap();
    }

    #[test]
    fn a_decided_map_the_image_no_longer_has_is_refused_and_leaves_it_unpinned() {
        let t = TestFs::new("ext4");
        let (_d, mut f, _) = temp_file_on(&t.mnt(), "decided.img");
        f.write_all(&[1u8; 1 << 20]).unwrap();
        let decided = ExtentMap::build(f.as_fd(), 1 << 20).unwrap();
        // The map as a decision read it, and the image as it maps now, agree.
        let (map, pinned) = map_and_pin(f.as_fd(), 1 << 20, Some(decided.clone())).unwrap();
        assert_eq!(map, decided);
        unpin(f.as_fd(), pinned).unwrap();
        // Blocks moved between the decision and the pin.
        let mut stale = decided;
        stale.segments[0].physical += 4096;
        let e = map_and_pin(f.as_fd(), 1 << 20, Some(stale)).unwrap_err();
        assert!(e.to_string().contains("the map changed"), "{e}");
        assert!(!is_immutable(f.as_fd()).unwrap());
    }
}
