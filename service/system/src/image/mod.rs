//! Image files: where they may live and how they are opened, created, grown and
//! removed.
//!
//! Every open goes through [`ImageRoots`]: the path must be absolute, free of
//! `..`, under a configured root, and is resolved with `openat2` beneath that
//! root's directory fd with `RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`, so neither a
//! symlink (in any component, swapped in at any time) nor a mount made after start
//! can lead outside. Files are first opened `O_PATH` and checked before a real
//! open of that same inode, so a FIFO or device node is never opened for I/O.
//!
//! One module per concern: `roots` resolves paths safely beneath the roots,
//! `file` opens, creates, checks, grows and removes image files, `identity`
//! tells a file from a later one on the same inode, `lock` takes the OFD
//! locks, and `fill` writes zeros over holes (allocate) and copies a
//! source's data, a stretch at a time.

mod file;
mod fill;
mod identity;
mod lock;
mod roots;

use std::io;

pub use file::{Access, CloneStart, ImageFile, MAX_IMAGE_BYTES, Written, cannot_share, grow_fd};
pub use fill::{ALLOCATE_STEP, AllocateJob, FALLOC_FL_WRITE_ZEROES, allocate_range};
pub use identity::{birth_of, is_read_only, reopen, same_birth};
pub use lock::{retake_lock, set_ofd_lock};
pub use roots::{ImagePath, ImageRoots};
use roots::{NAME_MAX, PATH_MAX};

/// Why an image path or file was refused, or an operation on it failed.
/// Every variant names the path as the request wrote it, or (once resolved)
/// as [`ImagePath::display`] normalizes it.
#[derive(Debug, thiserror::Error)]
pub enum ImageFileError {
    /// The path is relative.
    #[error(
        "image path '{path}' is not absolute; images are absolute paths under an image root ({roots})"
    )]
    NotAbsolute {
        /// The path.
        path: String,
        /// The image roots, for the message.
        roots: String,
    },
    /// The path has a `..` component.
    #[error("image path '{path}' contains '..'; paths must be written without parent references")]
    DotDot {
        /// The path.
        path: String,
    },
    /// The path has a NUL byte.
    #[error("image path '{path}' contains a NUL byte, which no file name can hold")]
    Nul {
        /// The path.
        path: String,
    },
    /// A component is longer than a file name can be.
    #[error("image path '{path}' has a file name of {len} bytes; names are at most {NAME_MAX}")]
    NameTooLong {
        /// The path.
        path: String,
        /// The long component's length in bytes.
        len: usize,
    },
    /// The path is longer than the kernel takes.
    #[error("image path '{path}…' is {len} bytes long; paths are at most {}", PATH_MAX - 1)]
    PathTooLong {
        /// The path's start.
        path: String,
        /// Its whole length in bytes.
        len: usize,
    },
    /// The path is under no image root.
    #[error("image path '{path}' is outside every image root ({roots})")]
    OutsideRoots {
        /// The path.
        path: String,
        /// The image roots, for the message.
        roots: String,
    },
    /// A component of the path is a symlink.
    #[error(
        "image path '{path}' goes through a symlink; images are opened without following symlinks"
    )]
    Symlink {
        /// The path.
        path: String,
    },
    /// The path crosses a mount point below its root.
    #[error(
        "image path '{path}' crosses a mount point below its image root '{root}'; images must be on the image root's own filesystem"
    )]
    OtherFilesystem {
        /// The path.
        path: String,
        /// Its image root.
        root: String,
    },
    /// No file at the path.
    #[error("image file '{path}' does not exist")]
    NotFound {
        /// The path.
        path: String,
    },
    /// The directory the path names the file in does not exist.
    #[error("the directory that would hold '{path}' does not exist")]
    ParentMissing {
        /// The path.
        path: String,
    },
    /// The file is not a regular file.
    #[error("'{path}' is {kind}, not a regular file")]
    NotRegular {
        /// The path.
        path: String,
        /// What it is instead (`a directory`, `a FIFO`, ...).
        kind: &'static str,
    },
    /// The file has more than one hard link.
    #[error(
        "'{path}' has {links} hard links; an image must have exactly one so no path outside the image roots reaches its data"
    )]
    HardLinks {
        /// The path.
        path: String,
        /// Its number of links.
        links: u64,
    },
    /// The file is owned by another uid than the service's.
    #[error("'{path}' is owned by uid {owner}, not by the service's uid {service}")]
    ForeignOwner {
        /// The path.
        path: String,
        /// The file's owner.
        owner: u32,
        /// The service's effective uid.
        service: u32,
    },
    /// The file is writable by group or others.
    #[error("'{path}' is writable by group or others (mode {mode:04o}); make it 0600 or 0640")]
    LooseMode {
        /// The path.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The size is zero or not a multiple of 512 bytes.
    #[error("'{path}' has size {size}; an image's size must be a positive multiple of 512 bytes")]
    BadSize {
        /// The path.
        path: String,
        /// The size in bytes.
        size: u64,
    },
    /// The size is more than [`MAX_IMAGE_BYTES`] or the filesystem allows.
    #[error("image '{path}': {size} bytes is more than the filesystem allows for a file")]
    TooLarge {
        /// The path.
        path: String,
        /// The size in bytes.
        size: u64,
    },
    /// A file to be created exists already.
    #[error("'{path}' already exists; leave out 'create' to register an existing file")]
    Exists {
        /// The path.
        path: String,
    },
    /// The path names another file than the one registered (another inode,
    /// or one born later), so it is left alone.
    #[error("'{path}' now names another file than the registered image; it was not removed")]
    Replaced {
        /// The path.
        path: String,
    },
    /// The filesystem ran out of space (ENOSPC).
    #[error("image '{path}': the filesystem is full ({op})")]
    NoSpace {
        /// The path.
        path: String,
        /// The step that found it full.
        op: &'static str,
    },
    /// Any other failure of a system call on the file.
    #[error("image '{path}': {op} failed: {source}")]
    Io {
        /// The path.
        path: String,
        /// The step that failed.
        op: &'static str,
        /// Its error.
        #[source]
        source: io::Error,
    },
}

pub(crate) type Result<T> = std::result::Result<T, ImageFileError>;

impl ImageFileError {
    /// `op` on the file at `path` failed: `NoSpace` for ENOSPC, else `Io`.
    pub(crate) fn from_errno(path: &ImagePath, op: &'static str, e: io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOSPC) => ImageFileError::NoSpace {
                path: path.display(),
                op,
            },
            _ => io_error(path, op, e),
        }
    }
}

pub(crate) fn io_error(path: &ImagePath, op: &'static str, source: io::Error) -> ImageFileError {
    ImageFileError::Io {
        path: path.display(),
        op,
        source,
    }
}
