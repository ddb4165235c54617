//! Image files: where they may live and how they are opened, created, grown and
//! removed.
//!
//! Every open goes through [`ImageRoots`]: the path must be absolute, free of
//! `..`, under a configured root, and is resolved with `openat2` beneath that
//! root's directory fd with `RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`, so neither a
//! symlink (in any component, swapped in at any time) nor a mount made after start
//! can lead outside. Files are first opened `O_PATH` and checked before a real
//! open of that same inode, so a FIFO or device node is never opened for I/O.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use rustix::fs::{AtFlags, FallocateFlags, FileType, Mode, OFlags, ResolveFlags, Stat};

use blockplane_api::model::Allocation;

/// Why an image path or file was refused, or an operation on it failed.
#[derive(Debug, thiserror::Error)]
pub enum ImageFileError {
    #[error(
        "image path '{path}' is not absolute; images are absolute paths under an image root ({roots})"
    )]
    NotAbsolute { path: String, roots: String },
    #[error("image path '{path}' contains '..'; paths must be written without parent references")]
    DotDot { path: String },
    #[error("image path '{path}' contains a NUL byte, which no file name can hold")]
    Nul { path: String },
    #[error("image path '{path}' has a file name of {len} bytes; names are at most {NAME_MAX}")]
    NameTooLong { path: String, len: usize },
    #[error("image path '{path}…' is {len} bytes long; paths are at most {}", PATH_MAX - 1)]
    PathTooLong { path: String, len: usize },
    #[error("image path '{path}' is outside every image root ({roots})")]
    OutsideRoots { path: String, roots: String },
    #[error(
        "image path '{path}' goes through a symlink; images are opened without following symlinks"
    )]
    Symlink { path: String },
    #[error(
        "image path '{path}' crosses a mount point below its image root '{root}'; images must be on the image root's own filesystem"
    )]
    OtherFilesystem { path: String, root: String },
    #[error("image file '{path}' does not exist")]
    NotFound { path: String },
    #[error("the directory that would hold '{path}' does not exist")]
    ParentMissing { path: String },
    #[error("'{path}' is {kind}, not a regular file")]
    NotRegular { path: String, kind: &'static str },
    #[error(
        "'{path}' has {links} hard links; an image must have exactly one so no path outside the image roots reaches its data"
    )]
    HardLinks { path: String, links: u64 },
    #[error("'{path}' is owned by uid {owner}, not by the service's uid {service}")]
    ForeignOwner {
        path: String,
        owner: u32,
        service: u32,
    },
    #[error("'{path}' is writable by group or others (mode {mode:04o}); make it 0600 or 0640")]
    LooseMode { path: String, mode: u32 },
    #[error("'{path}' has size {size}; an image's size must be a positive multiple of 512 bytes")]
    BadSize { path: String, size: u64 },
    #[error("image '{path}': {size} bytes is more than the filesystem allows for a file")]
    TooLarge { path: String, size: u64 },
    #[error("'{path}' already exists; leave out 'create' to register an existing file")]
    Exists { path: String },
    #[error("'{path}' now names another file than the registered image; it was not removed")]
    Replaced { path: String },
    #[error("image '{path}': the filesystem is full ({op})")]
    NoSpace { path: String, op: &'static str },
    #[error("image '{path}': {op} failed: {source}")]
    Io {
        path: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

type Result<T> = std::result::Result<T, ImageFileError>;

impl ImageFileError {
    /// `op` on the file at `path` failed: `NoSpace` for ENOSPC, else `Io`.
    fn from_errno(path: &ImagePath, op: &'static str, e: io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOSPC) => ImageFileError::NoSpace {
                path: path.display(),
                op,
            },
            _ => io_error(path, op, e),
        }
    }
}

/// One configured image root: its canonical path and a directory fd held from
/// start, so a mount over the root's path later does not move it.
#[derive(Debug)]
struct Root {
    path: PathBuf,
    dir: OwnedFd,
}

/// The directories images may live under.
#[derive(Debug)]
pub struct ImageRoots {
    roots: Vec<Root>,
}

/// A path accepted by [`ImageRoots::resolve`]: an image root and the normalized
/// path beneath it.
#[derive(Debug, Clone)]
pub struct ImagePath {
    root: usize,
    rel: PathBuf,
    abs: PathBuf,
}

impl ImagePath {
    /// The absolute, normalized path.
    pub fn display(&self) -> String {
        self.abs.display().to_string()
    }
}

impl fmt::Display for ImagePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.abs.display().fmt(f)
    }
}

impl ImageRoots {
    /// Opens the given root directories (creating none): each must exist.
    pub fn open(paths: &[PathBuf]) -> io::Result<Self> {
        let mut roots = Vec::new();
        for p in paths {
            let canonical = p.canonicalize().map_err(|e| {
                io::Error::new(e.kind(), format!("image root {}: {e}", p.display()))
            })?;
            let dir = rustix::fs::open(
                &canonical,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| io::Error::other(format!("image root {}: {e}", canonical.display())))?;
            roots.push(Root {
                path: canonical,
                dir,
            });
        }
        Ok(Self { roots })
    }

    /// The canonical root paths.
    pub fn paths(&self) -> Vec<String> {
        self.roots
            .iter()
            .map(|r| r.path.display().to_string())
            .collect()
    }

    /// Size and free space of each root's filesystem (space an unprivileged
    /// writer may use, as `df` shows it): `(root, size, free)`.
    pub fn space(&self) -> Vec<(String, u64, u64)> {
        self.roots
            .iter()
            .map(|r| {
                let fs = rustix::fs::fstatvfs(&r.dir).ok();
                (
                    r.path.display().to_string(),
                    fs.as_ref().map_or(0, |f| f.f_blocks * f.f_frsize),
                    fs.as_ref().map_or(0, |f| f.f_bavail * f.f_frsize),
                )
            })
            .collect()
    }

    fn roots_list(&self) -> String {
        self.paths().join(", ")
    }

    /// Checks a user-supplied path against the roots, without touching the filesystem.
    pub fn resolve(&self, path: &str) -> Result<ImagePath> {
        check_shape(path)?;
        let p = Path::new(path);
        if !p.is_absolute() {
            return Err(ImageFileError::NotAbsolute {
                path: path.into(),
                roots: self.roots_list(),
            });
        }
        let mut abs = PathBuf::from("/");
        for c in p.components() {
            match c {
                Component::RootDir | Component::CurDir => {}
                Component::ParentDir => {
                    return Err(ImageFileError::DotDot { path: path.into() });
                }
                Component::Normal(n) => abs.push(n),
                Component::Prefix(_) => unreachable!("no prefixes on unix"),
            }
        }
        for (i, root) in self.roots.iter().enumerate() {
            if let Ok(rel) = abs.strip_prefix(&root.path)
                && rel.components().next().is_some()
            {
                return Ok(ImagePath {
                    root: i,
                    rel: rel.to_path_buf(),
                    abs,
                });
            }
        }
        Err(ImageFileError::OutsideRoots {
            path: path.into(),
            roots: self.roots_list(),
        })
    }

    fn openat2(&self, path: &ImagePath, rel: &Path, flags: OFlags, mode: Mode) -> Result<OwnedFd> {
        let root = &self.roots[path.root];
        rustix::fs::openat2(
            &root.dir,
            rel,
            flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
            ResolveFlags::BENEATH
                | ResolveFlags::NO_SYMLINKS
                | ResolveFlags::NO_MAGICLINKS
                | ResolveFlags::NO_XDEV,
        )
        .map_err(|e| self.resolve_error(path, e.into(), "open"))
    }

    fn resolve_error(&self, path: &ImagePath, e: io::Error, op: &'static str) -> ImageFileError {
        let p = path.display();
        match e.raw_os_error() {
            Some(libc::ELOOP) => ImageFileError::Symlink { path: p },
            Some(libc::EXDEV) => ImageFileError::OtherFilesystem {
                path: p,
                root: self.roots[path.root].path.display().to_string(),
            },
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => ImageFileError::NotFound { path: p },
            Some(libc::EEXIST) => ImageFileError::Exists { path: p },
            Some(libc::ENOSPC) => ImageFileError::NoSpace { path: p, op },
            _ => ImageFileError::Io {
                path: p,
                op,
                source: e,
            },
        }
    }

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
                // No shared extents here (ext4, another filesystem, a
                // kernel without it): copy instead.
                Err(
                    rustix::io::Errno::OPNOTSUPP
                    | rustix::io::Errno::XDEV
                    | rustix::io::Errno::INVAL
                    | rustix::io::Errno::NOTTY
                    | rustix::io::Errno::PERM,
                ) => Ok(()),
                Err(e) => Err(ImageFileError::from_errno(file.path(), "FICLONE", e.into())),
            }
        })?;
        Ok((file, start))
    }

    /// Creates an empty image file at `path` for a serving volume's worker
    /// to share its image's extents with (`FICLONE` with its queues held:
    /// [`blockplane_server::backend::VolumeBackend::snapshot`]), or `None`, making
    /// nothing, where the filesystem cannot share extents: a probe clones
    /// one empty unnamed file into another in the same directory first, so
    /// the volume is never touched for a snapshot that cannot be made.
    pub fn create_for_reflink(&self, path: &ImagePath) -> Result<Option<ImageFile>> {
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
        if !shares {
            return Ok(None);
        }
        self.create_then(path, |_| Ok(())).map(Some)
    }

    /// Creates `path` (`O_EXCL`, mode 0600) and runs `fill` on it; removes
    /// it again when `fill` fails.
    fn create_then(
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

    fn open_parent(&self, path: &ImagePath) -> Result<(OwnedFd, PathBuf)> {
        let name = path.rel.file_name().map(PathBuf::from).unwrap_or_default();
        let dir = path.rel.parent().unwrap_or(Path::new(""));
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let parent = self
            .openat2(path, dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())
            .map_err(|e| match e {
                ImageFileError::NotFound { path } => ImageFileError::ParentMissing { path },
                e => e,
            })?;
        Ok((parent, name))
    }
}

/// How an image file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadOnly,
    ReadWrite,
}

/// An open image file and what `fstat` said of it when opened.
#[derive(Debug)]
pub struct ImageFile {
    path: ImagePath,
    fd: OwnedFd,
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
                    std::thread::sleep(job.pace);
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
                    std::thread::sleep(job.pace);
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

/// What tells a file from a later one that reuses its inode number: its
/// birth time (`statx` btime, `btime:SECS.NANOS`) or, on a filesystem that
/// keeps none, its inode generation (`FS_IOC_GETVERSION`, `gen:N`). `None`
/// when the filesystem has neither. Works on an `O_PATH` descriptor.
pub fn birth_of(fd: &OwnedFd) -> Option<String> {
    use rustix::fs::StatxFlags;
    if let Ok(stx) = rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BTIME)
        && stx.stx_mask & StatxFlags::BTIME.bits() != 0
    {
        return Some(format!(
            "btime:{}.{:09}",
            stx.stx_btime.tv_sec, stx.stx_btime.tv_nsec
        ));
    }
    // The ioctl needs a descriptor open for reading; `fd` may be `O_PATH`,
    // and only a regular file opens without side effects (a FIFO would block).
    if FileType::from_raw_mode(rustix::fs::fstat(fd).ok()?.st_mode) != FileType::RegularFile {
        return None;
    }
    let readable = reopen(fd, false).ok()?;
    let mut generation: libc::c_long = 0;
    // SAFETY: FS_IOC_GETVERSION writes one c_long through the pointer.
    let r = unsafe {
        libc::ioctl(
            readable.as_raw_fd(),
            libc::FS_IOC_GETVERSION,
            &mut generation as *mut libc::c_long,
        )
    };
    (r == 0).then(|| format!("gen:{generation}"))
}

/// Whether a file born at `now` is the one recorded as born at `recorded`.
/// A record without a birth (made before births were kept, or on a
/// filesystem with none) matches on `(dev, ino)` alone.
pub fn same_birth(recorded: Option<&str>, now: Option<&str>) -> bool {
    recorded.is_none() || recorded == now
}

/// Takes the lock again on a descriptor handed over already locked (a ublk
/// worker's [`blockplane_worker::protocol::LOCK_FD`]): exclusive if it is open
/// for writing, shared if not, as `manager::holds::lock` took it. Succeeds when this open
/// file description holds it already; fails (`EAGAIN`) when another does.
pub fn retake_lock(fd: &OwnedFd) -> io::Result<()> {
    let mode = rustix::fs::fcntl_getfl(fd)?;
    let kind = if mode.contains(rustix::fs::OFlags::RDWR) {
        libc::F_WRLCK
    } else {
        libc::F_RDLCK
    };
    set_ofd_lock(fd, kind)
}

/// Sets an OFD lock of `kind` (`F_WRLCK`, `F_RDLCK`) on the whole file,
/// without waiting (`EAGAIN` when another open file description holds one).
pub fn set_ofd_lock(fd: &OwnedFd, kind: libc::c_int) -> io::Result<()> {
    // SAFETY: a zeroed flock is valid; the whole file (l_len 0), l_pid 0 as
    // OFD locks require.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_OFD_SETLK reads one flock through the pointer.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl as *const libc::flock) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Opens the very inode behind `fd` again (through /proc/self/fd), for
/// writing if asked.
pub fn reopen(fd: &OwnedFd, write: bool) -> io::Result<OwnedFd> {
    let flags = if write { OFlags::RDWR } else { OFlags::RDONLY };
    rustix::fs::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        flags | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(Into::into)
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
    match alloc {
        Allocation::Sparse => {
            rustix::fs::ftruncate(fd, size).map_err(|e| ("ftruncate", e.into()))?
        }
        Allocation::Full => {
            rustix::fs::fallocate(fd, FallocateFlags::empty(), old, size - old)
                .map_err(|e| ("fallocate", e.into()))?;
            write_zeros(fd, old, size).map_err(|e| ("write zeros", e))?;
        }
    }
    rustix::fs::fsync(fd).map_err(|e| ("fsync", e.into()))
}

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

fn write_zeros(fd: &OwnedFd, from: u64, to: u64) -> io::Result<()> {
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

/// How [`ImageRoots::create_clone`] started a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneStart {
    /// Done: the new file shares the source's extents.
    Reflinked,
    /// The new file is empty: [`ImageFile::copy_from`] fills it, `private`
    /// when none of its blocks may be shared with the source.
    Copy { private: bool },
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

fn fstat(fd: impl AsFd, path: &ImagePath) -> Result<Stat> {
    rustix::fs::fstat(fd).map_err(|e| io_error(path, "fstat", e.into()))
}

fn io_error(path: &ImagePath, op: &'static str, source: io::Error) -> ImageFileError {
    ImageFileError::Io {
        path: path.display(),
        op,
        source,
    }
}

/// The longest file name Linux filesystems take (bytes).
const NAME_MAX: usize = 255;
/// Linux's limit on a path, its terminating NUL included (bytes).
const PATH_MAX: usize = 4096;

/// Refuses paths no system call could take, before one fails on them.
fn check_shape(path: &str) -> Result<()> {
    if path.contains('\0') {
        return Err(ImageFileError::Nul { path: path.into() });
    }
    if path.len() >= PATH_MAX {
        // The path itself would make the message as long: its start names it.
        let mut cut = 200;
        while !path.is_char_boundary(cut) {
            cut -= 1;
        }
        return Err(ImageFileError::PathTooLong {
            path: path[..cut].into(),
            len: path.len(),
        });
    }
    if let Some(name) = path.split('/').find(|n| n.len() > NAME_MAX) {
        return Err(ImageFileError::NameTooLong {
            path: path.into(),
            len: name.len(),
        });
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

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
