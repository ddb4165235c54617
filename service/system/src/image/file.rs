//! Image files: opening one checked, creating (empty, sized or as a clone),
//! growing and removing one, and what `fstat` says of it.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{AtFlags, FallocateFlags, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;

use blockplane_api::model::Allocation;

use super::fill::write_zeros;
use super::identity::{birth_of, reopen, same_birth};
use super::{ImageFileError, ImagePath, ImageRoots, Result, io_error};

/// How an image file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// For reading only: a read-only volume's image.
    ReadOnly,
    /// For reading and writing.
    ReadWrite,
}

impl Access {
    /// Read-only when `read_only`, else read-write: how a volume's image
    /// is opened.
    pub fn read_only_if(read_only: bool) -> Self {
        if read_only {
            Access::ReadOnly
        } else {
            Access::ReadWrite
        }
    }
}

/// Whether every byte of a file is written ([`ImageFile::written`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// No hole, no UNWRITTEN extent.
    All,
    /// The first stretch that holds no written data.
    Not(crate::extent::Unwritten),
    /// Its filesystem does not answer FIEMAP, so it cannot be told.
    Unknown,
}

/// An open image file and what `fstat` said of it when opened.
#[derive(Debug)]
pub struct ImageFile {
    pub(super) path: ImagePath,
    pub(super) fd: OwnedFd,
    stat: Stat,
    birth: Option<String>,
}

impl ImageFile {
    fn from_fd(path: ImagePath, fd: OwnedFd) -> Result<Self> {
        let stat = fstat(&fd, &path)?;
        let birth = birth_of(&fd);
        Ok(Self {
            path,
            fd,
            stat,
            birth,
        })
    }

    /// The normalized absolute path it was opened by.
    pub fn path(&self) -> &ImagePath {
        &self.path
    }

    /// The open file descriptor.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Gives up the file descriptor.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// `(st_dev, st_ino)`: the file's identity.
    pub fn identity(&self) -> (u64, u64) {
        (self.stat.st_dev, self.stat.st_ino)
    }

    /// When the inode was born (see [`birth_of`]): with [`Self::identity`],
    /// tells this file from a later one that reuses its inode number.
    pub fn birth(&self) -> Option<&str> {
        self.birth.as_deref()
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.stat.st_size as u64
    }

    /// Bytes allocated on disk.
    pub fn allocated(&self) -> u64 {
        self.stat.st_blocks as u64 * 512
    }

    /// The filesystem the file is on.
    pub fn filesystem(&self) -> Result<String> {
        let fs =
            rustix::fs::fstatfs(&self.fd).map_err(|e| io_error(&self.path, "statfs", e.into()))?;
        Ok(crate::extent::filesystem_name(fs.f_type as i64).to_string())
    }

    /// Bytes of the file that are holes: what [`Self::allocate`] takes.
    pub fn hole_bytes(&self) -> Result<u64> {
        crate::extent::hole_bytes(self.fd.as_fd(), self.size())
            .map_err(|e| io_error(&self.path, "FS_IOC_FIEMAP", e))
    }

    /// Bytes the file's filesystem has free (`statvfs`, as an unprivileged
    /// writer sees it).
    pub fn free_bytes(&self) -> Result<u64> {
        let vfs = rustix::fs::fstatvfs(&self.fd)
            .map_err(|e| io_error(&self.path, "statvfs", e.into()))?;
        Ok(vfs.f_bavail * vfs.f_frsize)
    }

    /// Bytes of the file that are holes or unwritten extents: what
    /// [`Self::allocate`] writes.
    pub fn unwritten_bytes(&self) -> Result<u64> {
        let todo = crate::extent::unwritten_ranges(self.fd.as_fd(), 0, self.size())
            .map_err(|e| io_error(&self.path, "FS_IOC_FIEMAP", e))?;
        Ok(todo.iter().map(|(a, b)| b - a).sum())
    }

    /// Whether every byte of the file is written, from FIEMAP after a sync;
    /// if not, its first stretch that holds no data (a hole or UNWRITTEN
    /// extents: what direct-map rule 2 refuses).
    pub fn written(&self) -> Result<Written> {
        match crate::extent::first_unwritten(self.fd.as_fd(), self.size()) {
            Ok(None) => Ok(Written::All),
            Ok(Some(u)) => Ok(Written::Not(u)),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOTTY)) => {
                Ok(Written::Unknown)
            }
            Err(e) => Err(io_error(&self.path, "FS_IOC_FIEMAP", e)),
        }
    }

    /// Writes the file's dirty pages to disk, so a copy or reflink of it
    /// holds every write that completed.
    pub fn sync(&self) -> Result<()> {
        rustix::fs::fsync(&self.fd).map_err(|e| io_error(&self.path, "fsync", e.into()))
    }

    /// Re-reads size and allocation.
    pub fn refresh(&mut self) -> Result<()> {
        self.stat = fstat(&self.fd, &self.path)?;
        Ok(())
    }

    /// Grows the file to `size` bytes; with `Full`, the new range is allocated and
    /// written with zeros so no extent stays unwritten; then synced.
    pub fn grow(&mut self, size: u64, alloc: Allocation) -> Result<()> {
        check_size(&self.path, size)?;
        grow_fd(&self.fd, size, alloc).map_err(|(op, e)| match e.raw_os_error() {
            Some(libc::ENOSPC) => ImageFileError::NoSpace {
                path: self.path.display(),
                op,
            },
            Some(libc::EFBIG) | Some(libc::EINVAL) => ImageFileError::TooLarge {
                path: self.path.display(),
                size,
            },
            _ => io_error(&self.path, op, e),
        })?;
        self.refresh()
    }
}

impl ImageRoots {
    /// Opens an existing image file after checking it is a plain, private,
    /// singly-linked regular file of a usable size.
    pub fn open_file(&self, path: &ImagePath, access: Access) -> Result<ImageFile> {
        let probe = self.openat2(path, &path.rel, OFlags::PATH, Mode::empty())?;
        let stat = fstat(&probe, path)?;
        check_file(path, &stat)?;
        // Reopen the very inode checked above: /proc/self/fd of an O_PATH fd is a
        // magic link to it, so nothing can be swapped in between.
        let fd =
            reopen(&probe, access == Access::ReadWrite).map_err(|e| io_error(path, "reopen", e))?;
        let file = ImageFile::from_fd(path.clone(), fd)?;
        if (file.stat.st_dev, file.stat.st_ino) != (stat.st_dev, stat.st_ino) {
            return Err(io_error(
                path,
                "reopen",
                io::Error::other("file changed while being opened"),
            ));
        }
        Ok(file)
    }

    /// Size and allocation of the file at `path`, if it is still the file with
    /// identity `(dev, ino)` born at `birth`; never opens it for I/O.
    pub fn stat_if_same(
        &self,
        path: &str,
        identity: (u64, u64),
        birth: Option<&str>,
    ) -> Option<(u64, u64)> {
        let path = self.resolve(path).ok()?;
        let fd = self
            .openat2(&path, &path.rel, OFlags::PATH, Mode::empty())
            .ok()?;
        let st = rustix::fs::fstat(&fd).ok()?;
        ((st.st_dev, st.st_ino) == identity && same_birth(birth, birth_of(&fd).as_deref()))
            .then_some((st.st_size as u64, st.st_blocks as u64 * 512))
    }

    /// Creates a new image file (mode 0600) of `size` bytes; on any failure the
    /// half-made file is removed.
    pub fn create_file(&self, path: &ImagePath, size: u64, alloc: Allocation) -> Result<ImageFile> {
        check_size(path, size)?;
        self.create_then(path, |file| file.grow(size, alloc))
    }

    /// Creates a new image file (mode 0600) at `path` for a copy of `src`:
    /// with `src`'s extents shared (`FICLONE`, [`CloneStart::Reflinked`])
    /// where the filesystem can and `src` is not pinned immutable, else
    /// empty, for [`ImageFile::copy_from`]. On any other failure the new
    /// file is removed.
    pub fn create_clone(
        &self,
        path: &ImagePath,
        src: &ImageFile,
    ) -> Result<(ImageFile, CloneStart)> {
        // A direct map may serve a pinned image: its blocks must never
        // become shared, or a write through the map would change the copy.
        if crate::extent::is_immutable(src.fd.as_fd()).unwrap_or(false) {
            let file = self.create_then(path, |_| Ok(()))?;
            return Ok((file, CloneStart::Copy { private: true }));
        }
        let mut start = CloneStart::Copy { private: false };
        let file = self.create_then(path, |file| {
            match rustix::fs::ioctl_ficlone(&file.fd, &src.fd) {
                Ok(()) => {
                    start = CloneStart::Reflinked;
                    file.refresh()
                }
                // No shared extents here, or a source made immutable
                // since the check above (EPERM): copy instead.
                Err(e) if cannot_share(e) || e == Errno::PERM => Ok(()),
                Err(e) => Err(ImageFileError::from_errno(file.path(), "FICLONE", e.into())),
            }
        })?;
        Ok((file, start))
    }

    /// Creates an empty image file at `path` for a serving volume's worker
    /// to put one moment of its image in, and says whether the filesystem
    /// shares extents: `true`, the worker shares them (`FICLONE` with its
    /// queues held: the server's `VolumeBackend::snapshot`); `false`, it
    /// copies the moment (`VolumeBackend::copy_moment`). A probe clones one
    /// empty unnamed file into another in the same directory to find out,
    /// so the volume is never touched for a clone that cannot be made.
    pub fn create_for_moment(&self, path: &ImagePath) -> Result<(ImageFile, bool)> {
        let (parent, _) = self.open_parent(path)?;
        let unnamed = || {
            rustix::fs::openat(
                &parent,
                ".",
                OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
        };
        let shares = match (unnamed(), unnamed()) {
            (Ok(a), Ok(b)) => rustix::fs::ioctl_ficlone(&a, &b).is_ok(),
            // No unnamed files here: no way to know, so no.
            _ => false,
        };
        self.create_then(path, |_| Ok(())).map(|f| (f, shares))
    }

    /// Creates `path` (`O_EXCL`, mode 0600) and runs `fill` on it; removes
    /// it again when `fill` fails.
    pub(super) fn create_then(
        &self,
        path: &ImagePath,
        fill: impl FnOnce(&mut ImageFile) -> Result<()>,
    ) -> Result<ImageFile> {
        let (parent, name) = self.open_parent(path)?;
        let fd = rustix::fs::openat(
            &parent,
            &name,
            OFlags::CREATE
                | OFlags::EXCL
                | OFlags::RDWR
                | OFlags::NOFOLLOW
                | OFlags::CLOEXEC
                | OFlags::NOCTTY,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| self.resolve_error(path, e.into(), "create"))?;
        let mut file = ImageFile::from_fd(path.clone(), fd)?;
        if let Err(e) = fill(&mut file) {
            let _ = rustix::fs::unlinkat(&parent, &name, AtFlags::empty());
            return Err(e);
        }
        Ok(file)
    }

    /// Unlinks an image file, but only if the name still refers to `(dev, ino)`
    /// born at `birth`.
    pub fn remove_file(
        &self,
        path: &ImagePath,
        dev: u64,
        ino: u64,
        birth: Option<&str>,
    ) -> Result<()> {
        let (parent, name) = self.open_parent(path)?;
        let probe = rustix::fs::openat(
            &parent,
            &name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| self.resolve_error(path, e.into(), "stat"))?;
        let st = fstat(&probe, path)?;
        if (st.st_dev, st.st_ino) != (dev, ino) || !same_birth(birth, birth_of(&probe).as_deref()) {
            return Err(ImageFileError::Replaced {
                path: path.display(),
            });
        }
        rustix::fs::unlinkat(&parent, &name, AtFlags::empty())
            .map_err(|e| self.resolve_error(path, e.into(), "unlink"))
    }
}

/// Whether a `FICLONE` that failed with `errno` failed because the
/// filesystem cannot share extents between the two files (ext4, files on two
/// filesystems, a kernel without it), rather than on these files: the one
/// rule for a clone that falls back to a copy and a snapshot that is refused.
pub fn cannot_share(errno: Errno) -> bool {
    matches!(
        errno,
        Errno::OPNOTSUPP | Errno::XDEV | Errno::INVAL | Errno::NOTTY
    )
}

/// How [`ImageRoots::create_clone`] started a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneStart {
    /// Done: the new file shares the source's extents.
    Reflinked,
    /// The new file is empty: [`ImageFile::copy_from`] fills it.
    Copy {
        /// None of its blocks may be shared with the source (a pinned
        /// source, whose direct map must own its blocks alone).
        private: bool,
    },
}

/// Grows an open image to `size` bytes (never shrinks); `Full` allocates and
/// zero-writes the new range. Fails with the step that failed.
pub fn grow_fd(
    fd: &OwnedFd,
    size: u64,
    alloc: Allocation,
) -> std::result::Result<(), (&'static str, io::Error)> {
    let old = rustix::fs::fstat(fd)
        .map_err(|e| ("fstat", e.into()))?
        .st_size as u64;
    if size < old {
        return Err((
            "grow",
            io::Error::other(format!("new size {size} is below the current size {old}")),
        ));
    }
    let grown = match alloc {
        Allocation::Sparse => rustix::fs::ftruncate(fd, size).map_err(|e| ("ftruncate", e.into())),
        // What does not fit is refused before any block is taken (a failed
        // fallocate's blocks of the extent tree would stay after the
        // truncate below).
        Allocation::Full => rustix::fs::fstatvfs(fd)
            .map_err(|e| ("fstatvfs", e.into()))
            .and_then(|v| {
                if v.f_bavail.saturating_mul(v.f_frsize) < size - old {
                    Err(("free space", io::Error::from_raw_os_error(libc::ENOSPC)))
                } else {
                    Ok(())
                }
            })
            .and_then(|()| {
                rustix::fs::fallocate(fd, FallocateFlags::empty(), old, size - old)
                    .map_err(|e| ("fallocate", e.into()))
            })
            .and_then(|()| write_zeros(fd, old, size).map_err(|e| ("write zeros", e))),
    };
    if grown.is_err() {
        // A fallocate that ran out of space part-way may leave the file
        // longer, its blocks taken: a refused grow must change nothing, and
        // nobody has seen the new size yet.
        let _ = rustix::fs::ftruncate(fd, old);
    }
    grown?;
    rustix::fs::fsync(fd).map_err(|e| ("fsync", e.into()))
}

fn fstat(fd: impl AsFd, path: &ImagePath) -> Result<Stat> {
    rustix::fs::fstat(fd).map_err(|e| io_error(path, "fstat", e.into()))
}

/// The largest image blockplane makes or grows: 1 PiB.
pub const MAX_IMAGE_BYTES: u64 = 1 << 50;

fn check_size(path: &ImagePath, size: u64) -> Result<()> {
    if size > MAX_IMAGE_BYTES {
        return Err(ImageFileError::TooLarge {
            path: path.display(),
            size,
        });
    }
    if size == 0 || !size.is_multiple_of(512) {
        return Err(ImageFileError::BadSize {
            path: path.display(),
            size,
        });
    }
    Ok(())
}

fn check_file(path: &ImagePath, st: &Stat) -> Result<()> {
    let p = path.display();
    let kind = match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => None,
        FileType::Directory => Some("a directory"),
        // O_PATH|O_NOFOLLOW opens a final symlink itself rather than failing.
        FileType::Symlink => return Err(ImageFileError::Symlink { path: p }),
        FileType::Fifo => Some("a FIFO"),
        FileType::Socket => Some("a socket"),
        FileType::CharacterDevice => Some("a character device"),
        FileType::BlockDevice => Some("a block device"),
        FileType::Unknown => Some("of an unknown type"),
    };
    if let Some(kind) = kind {
        return Err(ImageFileError::NotRegular { path: p, kind });
    }
    let service = rustix::process::geteuid().as_raw();
    if st.st_uid != service {
        return Err(ImageFileError::ForeignOwner {
            path: p,
            owner: st.st_uid,
            service,
        });
    }
    if st.st_mode & 0o022 != 0 {
        return Err(ImageFileError::LooseMode {
            path: p,
            mode: st.st_mode & 0o7777,
        });
    }
    if st.st_nlink != 1 {
        return Err(ImageFileError::HardLinks {
            path: p,
            links: st.st_nlink,
        });
    }
    check_size(path, st.st_size as u64)
}
