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

pub use file::{Access, CloneStart, ImageFile, MAX_IMAGE_BYTES, cannot_share, grow_fd};
pub use fill::{ALLOCATE_STEP, AllocateJob, FALLOC_FL_WRITE_ZEROES, allocate_range};
pub use identity::{birth_of, reopen, same_birth};
pub use lock::{retake_lock, set_ofd_lock};
pub use roots::{ImagePath, ImageRoots};
use roots::{NAME_MAX, PATH_MAX};

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
