//! Direct-map rules 1 and 2 (the filesystem, the extents) and the refusals
//! of every rule ([`MapError`]).

use std::io;
use std::os::fd::BorrowedFd;

use super::fiemap::{FIEMAP_EXTENT_LAST, FIEMAP_EXTENT_UNWRITTEN, FsExtent};

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

/// Why an image cannot be direct-mapped (or its map could not be read).
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// Rule 1: the filesystem is not ext4 or xfs.
    #[error(
        "direct-map rule 1: the image is on {fs}, not on a block-mapped, non-copy-on-write filesystem (ext4 or xfs)"
    )]
    Filesystem {
        /// Its name ([`filesystem_name`]).
        fs: String,
    },
    /// Rule 2: `[start, end)` has no extent.
    #[error(
        "direct-map rule 2: the image has a hole at bytes {start}..{end} (a sparse image, or blocks punched by discards through a volume served nowait/threaded on a sparse image or before blockplane kept full images allocated, or by another program); {remedy}",
        remedy = REALLOCATE
    )]
    Hole {
        /// Where the hole starts (bytes).
        start: u64,
        /// Where it ends.
        end: u64,
    },
    /// Rule 2: an extent is allocated but unwritten (reads as zeroes).
    #[error(
        "direct-map rule 2: the extent at byte {logical} is UNWRITTEN (allocated, never written: fallocate'd, or zeroed with FALLOC_FL_ZERO_RANGE by a volume served nowait/threaded on a sparse image or before blockplane kept full images allocated, or by another program); {remedy}",
        remedy = REALLOCATE
    )]
    Unwritten {
        /// The extent's offset in the file.
        logical: u64,
    },
    /// Rule 2: an extent carries a flag that makes it unusable.
    #[error("direct-map rule 2: the extent at byte {logical} is {what}")]
    BadExtent {
        /// The extent's offset in the file.
        logical: u64,
        /// The flag, by name and meaning.
        what: &'static str,
    },
    /// Rule 2: an extent is not 512-byte aligned (in the file or on disk).
    #[error("direct-map rule 2: the extent at byte {logical} is not 512-byte aligned")]
    Unaligned {
        /// The extent's offset in the file.
        logical: u64,
    },
    /// Rule 2: the kernel's extent list has no last extent, so it may be
    /// incomplete.
    #[error("direct-map rule 2: the extent list does not end with FIEMAP_EXTENT_LAST")]
    NoLast,
    /// Rule 3: the owner set `FS_IMMUTABLE_FL`, so blockplane's pin could
    /// not be told from theirs.
    #[error(
        "direct-map rule 3: the image is immutable by its owner's choice and can back only read-only volumes on the file paths"
    )]
    ImmutableByUser,
    /// Rule 4: a device-mapper device under the filesystem has a target
    /// other than `linear`.
    #[error(
        "direct-map rule 4: the filesystem's device {dev} is a device-mapper '{target}' target; only 'linear' tables can be mapped through"
    )]
    Target {
        /// The dm device (number and name).
        dev: String,
        /// Its target type.
        target: String,
    },
    /// Rule 4: the device stack under the filesystem could not be resolved
    /// (also: the map changed while pinning).
    #[error("direct-map rule 4: cannot resolve the filesystem's device {dev}: {reason}")]
    Device {
        /// The device that could not be resolved.
        dev: String,
        /// Why.
        reason: String,
    },
    /// A system call failed while reading or pinning the map.
    #[error("direct map: {op}: {source}")]
    Io {
        /// The call.
        op: &'static str,
        /// Its error.
        #[source]
        source: io::Error,
    },
}

impl MapError {
    pub(super) fn io(op: &'static str, source: io::Error) -> Self {
        MapError::Io { op, source }
    }
}

/// Checks rule 1: the filesystem under `fd` is block-mapped and not
/// copy-on-write (ext4 or xfs).
pub(super) fn check_filesystem(fd: BorrowedFd<'_>) -> Result<(), MapError> {
    let fs = rustix::fs::fstatfs(fd).map_err(|e| MapError::io("statfs", e.into()))?;
    let fs_name = filesystem_name(fs.f_type as i64);
    if !matches!(fs_name, "ext4" | "xfs") {
        return Err(MapError::Filesystem {
            fs: fs_name.to_string(),
        });
    }
    Ok(())
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
    use std::io::Write;
    use std::os::fd::AsFd;

    use super::*;
    use crate::extent::ExtentMap;
    use crate::extent::testfs::temp_file_on;

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
    fn tmpfs_is_refused_under_rule_one() {
        let (_d, mut f, _) = temp_file_on("/dev/shm", "t.img");
        f.write_all(&[1u8; 4096]).unwrap();
        let e = ExtentMap::build(f.as_fd(), 4096).unwrap_err();
        assert!(
            e.to_string().contains("rule 1") && e.to_string().contains("tmpfs"),
            "{e}"
        );
    }
}
