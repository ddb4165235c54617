//! The page cache held for a file or a block device: how much of it is
//! cached ([`cached`]) and dropping it ([`drop_cached`]).
//!
//! A direct write to a file or device that holds cached pages pays for
//! invalidating them (`generic_file_direct_write` invalidates whenever the
//! mapping has pages), and a filesystem's direct-I/O path may write back and
//! wait on each request; a `blkid` probe or an operator's buffered `dd` is
//! enough to leave such pages behind. Neither call here reads or writes the
//! bytes of the file: `cachestat(2)` and `mincore(2)` only look at the page
//! cache, `posix_fadvise` only drops clean pages after `fdatasync` wrote the
//! dirty ones back.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

/// What the page cache holds of one file or device, in pages of
/// [`page_size`] bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStat {
    /// Pages cached.
    pub cached: u64,
    /// Of them, dirty (0 from the `mincore` fallback, which cannot tell).
    pub dirty: u64,
    /// How the figure was read.
    pub source: CacheSource,
}

impl CacheStat {
    /// The cached pages, in bytes.
    pub fn cached_bytes(&self) -> u64 {
        self.cached.saturating_mul(page_size())
    }
}

/// How a [`CacheStat`] was read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CacheSource {
    /// `cachestat(2)` (Linux 6.5 and later).
    #[default]
    Cachestat,
    /// `mmap` and `mincore(2)`, for a regular file on a kernel without
    /// `cachestat`.
    Mincore,
}

/// The size of a page, bytes.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as u64 } else { 4096 }
}

/// The pages the page cache holds of the file or device open at `fd`:
/// `cachestat(2)`, or where the kernel lacks it (before 6.5) and `fd` is a
/// regular file, `mincore(2)` over a read-only mapping of it.
/// `Unsupported` for a block device on a kernel without `cachestat`.
pub fn cached(fd: BorrowedFd<'_>) -> io::Result<CacheStat> {
    match cachestat(fd) {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => mincore(fd),
        r => r,
    }
}

/// Opens `path` (a block device node or an image file) read-only to ask
/// about its page cache. Opening reads nothing: no byte of the volume is
/// touched (`O_NONBLOCK` so a device node never waits for media).
pub fn open(path: &std::path::Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
}

/// [`cached`] of the file or device at `path`.
pub fn cached_at(path: &std::path::Path) -> io::Result<CacheStat> {
    cached(open(path)?.as_fd())
}

/// Writes back and drops the cached pages of the file or device open at
/// `fd` (`fdatasync`, then `POSIX_FADV_DONTNEED` over all of it). Works on a
/// read-only descriptor; pages mapped or under writeback by someone else
/// may stay.
pub fn drop_cached(fd: BorrowedFd<'_>) -> io::Result<()> {
    rustix::fs::fdatasync(fd)?;
    rustix::fs::fadvise(fd, 0, None, rustix::fs::Advice::DontNeed)?;
    Ok(())
}

/// Drops the clean cached pages of the file or device at `path`
/// (`POSIX_FADV_DONTNEED` alone): dirty pages are sent on their way to disk
/// and stay, and nothing waits for them. The hygiene drops at attach and at
/// a switch use it: an `fdatasync` there would wait on a whole image's
/// writeback (an allocate filling it, say) inside the API call, and on a
/// device it is a flush through the volume's own data path.
pub fn drop_clean_at(path: &std::path::Path) -> io::Result<()> {
    drop_clean(open(path)?.as_fd())
}

/// Drops the clean cached pages of an open file ([`drop_clean_at`]'s).
pub fn drop_clean(fd: BorrowedFd<'_>) -> io::Result<()> {
    rustix::fs::fadvise(fd, 0, None, rustix::fs::Advice::DontNeed)?;
    Ok(())
}

/// `cachestat(2)`'s syscall number: the same on every architecture (it was
/// added after the tables were unified), but libc names it only for some
/// targets, and rustix does not wrap the call (it lists it as not
/// implemented), so it is called by number.
const SYS_CACHESTAT: libc::c_long = 451;

/// `struct cachestat_range` (include/uapi/linux/mman.h).
#[repr(C)]
struct CachestatRange {
    off: u64,
    /// 0: to the end of the file.
    len: u64,
}

/// `struct cachestat` (include/uapi/linux/mman.h).
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// `cachestat(fd, {0, 0}, &out, 0)`: the whole file's page cache.
fn cachestat(fd: BorrowedFd<'_>) -> io::Result<CacheStat> {
    let range = CachestatRange { off: 0, len: 0 };
    let mut out = Cachestat::default();
    // SAFETY: the fd is borrowed open for the call; both pointers are to
    // live, properly laid out structs the kernel reads and writes only
    // during it.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            fd.as_raw_fd() as libc::c_uint,
            &range as *const CachestatRange,
            &mut out as *mut Cachestat,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(CacheStat {
        cached: out.nr_cache,
        dirty: out.nr_dirty,
        source: CacheSource::Cachestat,
    })
}

/// The fallback: map the regular file read-only and ask `mincore` which of
/// its pages are resident. The mapping is never read, so nothing is faulted
/// in.
fn mincore(fd: BorrowedFd<'_>) -> io::Result<CacheStat> {
    let st = rustix::fs::fstat(fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "no cachestat(2) on this kernel, and mincore needs a regular file",
        ));
    }
    let len = st.st_size as usize;
    let none = CacheStat {
        cached: 0,
        dirty: 0,
        source: CacheSource::Mincore,
    };
    if len == 0 {
        return Ok(none);
    }
    let page = page_size() as usize;
    // SAFETY: a fresh shared read-only mapping of an open file at an address
    // the kernel picks; nothing else refers to it, and it is unmapped below.
    let addr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ,
            rustix::mm::MapFlags::SHARED,
            fd,
            0,
        )
    }?;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: addr..addr+len is the mapping made above; vec has one byte per
    // page of it.
    let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    let err = io::Error::last_os_error();
    // SAFETY: the mapping made above, not used after this.
    unsafe { rustix::mm::munmap(addr, len) }?;
    if rc != 0 {
        return Err(err);
    }
    Ok(CacheStat {
        cached: vec.iter().filter(|b| *b & 1 != 0).count() as u64,
        ..none
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, Write};

    use super::*;

    /// Filesystems whose pages are the file itself (`shmem`): `cachestat`
    /// counts them, but neither a sync nor `POSIX_FADV_DONTNEED` can drop
    /// them, so a test of the drop cannot run there.
    /// (libc names no `RAMFS_MAGIC`: include/uapi/linux/magic.h's value.)
    const NO_DROPPABLE_CACHE: [(libc::c_long, &str); 2] =
        [(libc::TMPFS_MAGIC, "tmpfs"), (0x8584_58f6, "ramfs")];

    /// A directory on a filesystem with a page cache whose clean pages can be
    /// dropped: the temp dir, else `/var/tmp`, else the directory of the test
    /// binary (the target dir). A temp dir on tmpfs (Debian 13's default
    /// `/tmp`) is passed over, never a reason to pass without testing: where
    /// none of them will do, the test fails saying what each one is.
    fn cacheable_dir() -> std::path::PathBuf {
        let exe_dir = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|p| p.to_path_buf()));
        let candidates = [
            Some(std::env::temp_dir()),
            Some(std::path::PathBuf::from("/var/tmp")),
            exe_dir,
        ];
        let mut tried = Vec::new();
        for dir in candidates.into_iter().flatten() {
            let fstype = match rustix::fs::statfs(&dir) {
                Ok(st) => st.f_type,
                Err(e) => {
                    tried.push(format!("{}: {e}", dir.display()));
                    continue;
                }
            };
            if let Some((_, name)) = NO_DROPPABLE_CACHE.iter().find(|(m, _)| *m == fstype) {
                tried.push(format!("{}: {name}", dir.display()));
                continue;
            }
            match tempfile::tempdir_in(&dir) {
                Ok(_) => {
                    if !tried.is_empty() {
                        eprintln!(
                            "page-cache test files in {} (passed over: {})",
                            dir.display(),
                            tried.join("; ")
                        );
                    }
                    return dir;
                }
                Err(e) => tried.push(format!("{}: not writable: {e}", dir.display())),
            }
        }
        panic!(
            "no directory on a filesystem with a droppable page cache for the page-cache tests \
             (tried {}): point TMPDIR at a directory on a disk filesystem (ext4, xfs, ...)",
            tried.join("; ")
        );
    }

    /// A 4 MiB file on a filesystem with a page cache ([`cacheable_dir`]),
    /// written, synced and dropped.
    fn written_file() -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir_in(cacheable_dir()).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("cache.img"))
            .unwrap();
        f.write_all(&vec![7u8; 4 << 20]).unwrap();
        drop_cached(f.as_fd()).unwrap();
        (dir, f)
    }

    /// Whether the kernel has `cachestat(2)`: only ENOSYS says it has not
    /// (6.5 added it); any other error fails the test rather than skip it.
    fn has_cachestat(f: &File) -> bool {
        match cachestat(f.as_fd()) {
            Ok(_) => true,
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => false,
            Err(e) => panic!("cachestat(2) of a regular file: {e}"),
        }
    }

    fn read_all(f: &mut File) {
        f.rewind().unwrap();
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).unwrap();
        assert_eq!(buf.len(), 4 << 20);
    }

    #[test]
    fn a_buffered_read_shows_pages_and_a_drop_removes_them_both_ways() {
        let pages = (4 << 20) / page_size();
        let (_dir, mut f) = written_file();
        let have_cachestat = has_cachestat(&f);
        for (name, read) in [
            (
                "cachestat",
                cachestat as fn(BorrowedFd<'_>) -> io::Result<CacheStat>,
            ),
            ("mincore", mincore),
            ("cached", cached),
        ] {
            if name == "cachestat" && !have_cachestat {
                eprintln!("kernel without cachestat(2): that path skipped");
                continue;
            }
            drop_cached(f.as_fd()).unwrap();
            let before = read(f.as_fd()).unwrap();
            assert!(before.cached < pages / 8, "{name} after a drop: {before:?}");
            read_all(&mut f);
            let after = read(f.as_fd()).unwrap();
            assert!(
                after.cached >= pages * 9 / 10,
                "{name} after a buffered read of {pages} pages: {after:?}"
            );
            drop_cached(f.as_fd()).unwrap();
            let dropped = read(f.as_fd()).unwrap();
            assert!(dropped.cached < pages / 8, "{name} after drop: {dropped:?}");
        }
    }

    #[test]
    fn cachestat_counts_dirty_pages_and_the_drop_writes_them_back() {
        let (_dir, mut f) = written_file();
        if !has_cachestat(&f) {
            // No dirty count to test: what is left to check is that the
            // answer says where it came from.
            assert_eq!(cached(f.as_fd()).unwrap().source, CacheSource::Mincore);
            eprintln!("kernel without cachestat(2): only the mincore fallback was checked");
            return;
        }
        f.rewind().unwrap();
        f.write_all(&[1u8; 1 << 20]).unwrap();
        let dirty = cachestat(f.as_fd()).unwrap();
        assert!(dirty.dirty > 0, "{dirty:?}");
        assert!(dirty.cached_bytes() >= 1 << 20, "{dirty:?}");
        drop_cached(f.as_fd()).unwrap();
        let after = cachestat(f.as_fd()).unwrap();
        assert_eq!(after.dirty, 0, "{after:?}");
        assert!(after.cached_bytes() < 256 << 10, "{after:?}");
    }

    #[test]
    fn a_clean_drop_removes_read_pages() {
        let (dir, mut f) = written_file();
        drop_cached(f.as_fd()).unwrap();
        read_all(&mut f);
        let path = dir.path().join("cache.img");
        assert!(cached_at(&path).unwrap().cached_bytes() >= 2 << 20);
        drop_clean_at(&path).unwrap();
        let after = cached_at(&path).unwrap();
        assert!(after.cached_bytes() < 512 << 10, "{after:?}");
    }

    #[test]
    fn mincore_of_an_empty_file_is_zero_and_of_a_fifo_is_unsupported() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("empty");
        File::create(&p).unwrap();
        assert_eq!(mincore(open(&p).unwrap().as_fd()).unwrap().cached, 0);
        let fifo = dir.path().join("fifo");
        rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, rustix::fs::Mode::RWXU).unwrap();
        let e = mincore(open(&fifo).unwrap().as_fd()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
    }
}
