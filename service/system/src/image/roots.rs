//! Image roots and safe path resolution: a path is accepted only under a
//! configured root, and opened with `openat2` beneath that root's directory
//! fd, so no symlink or later mount leads outside.

use std::fmt;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};

use super::{ImageFileError, Result};

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
    pub(super) rel: PathBuf,
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

    pub(super) fn openat2(
        &self,
        path: &ImagePath,
        rel: &Path,
        flags: OFlags,
        mode: Mode,
    ) -> Result<OwnedFd> {
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

    pub(super) fn resolve_error(
        &self,
        path: &ImagePath,
        e: io::Error,
        op: &'static str,
    ) -> ImageFileError {
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

    pub(super) fn open_parent(&self, path: &ImagePath) -> Result<(OwnedFd, PathBuf)> {
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

/// The longest file name Linux filesystems take (bytes).
pub(super) const NAME_MAX: usize = 255;

/// Linux's limit on a path, its terminating NUL included (bytes).
pub(super) const PATH_MAX: usize = 4096;

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
