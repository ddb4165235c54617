//! The pin (rule 3: `FS_IMMUTABLE_FL` while mapped), and readying a map in
//! the order the rules need: map, pin, map again and compare (rule 5), drop
//! the page cache (rule 6).

use std::io;
use std::os::fd::BorrowedFd;

use serde::{Deserialize, Serialize};

use super::map::ExtentMap;
use super::rules::MapError;

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
    crate::pagecache::drop_cached(fd)
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

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;

    use super::*;
    use crate::extent::testfs::{TestFs, temp_file_on};

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
