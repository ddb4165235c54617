//! A move's metadata legs: two small files in the service's run directory,
//! each under a loop device, on which dm-raid keeps the mirror's
//! superblocks and its write-intent bitmap.
//!
//! Without them md keeps the rebuild's progress and each leg's health in
//! memory only, and that costs three things: a local leg failing by an I/O
//! error blocks every write (md cannot record the failure, so it waits for
//! someone who could), a table reloaded with a new rate limit rebuilds from
//! the first sector, and a table reloaded without `rebuild` takes the legs
//! as in sync. With them the failed leg is recorded and dropped while the
//! remote leg serves, and a reload goes on from the recorded progress.
//!
//! They are made anew (zeroed) for every mirror a move makes: a mirror made
//! after a reboot copies from the start, since the consumer wrote to the
//! remote leg alone meanwhile and no bitmap saw it.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use uuid::Uuid;

use crate::backend::BackendError;
use crate::backend::loopdev;
use blockplane_system::extent::DevNum;

/// Each metadata leg's size: dm-raid's superblock and a bitmap of its
/// default region size (4 MiB regions: a 16 TiB volume's bitmap is 512
/// KiB). LVM's raid metadata volumes are one extent, 4 MiB, too.
const LEG_BYTES: u64 = 4 << 20;

/// Where moves' metadata files are made, and whose marks their loop
/// devices carry.
#[derive(Debug, Clone)]
pub(crate) struct MoveMetadata {
    dir: PathBuf,
    instance: String,
}

/// A move's two metadata legs, bound: the remote leg's first, the local
/// leg's second, as the table names them. Dropped, the loop devices
/// unbind unless a loaded table holds them.
pub(crate) struct MetadataLegs {
    /// Their device numbers, for the table.
    pub(crate) devs: [DevNum; 2],
    _held: [File; 2],
}

impl MoveMetadata {
    /// Metadata files go into `run_dir/moves`; loop devices carry
    /// `instance`'s mark.
    pub(crate) fn new(run_dir: &Path, instance: &str) -> Self {
        Self {
            dir: run_dir.join("moves"),
            instance: instance.to_string(),
        }
    }

    fn file(&self, id: Uuid, leg: usize) -> PathBuf {
        self.dir.join(format!("{id}.meta{leg}"))
    }

    /// Two zeroed metadata legs for move `id`, bound to loop devices. A
    /// previous mirror's files are replaced, never reused: a loop device
    /// still bound to one keeps its old inode.
    pub(crate) fn fresh(&self, id: Uuid) -> Result<MetadataLegs, BackendError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| BackendError::io("create", self.dir.display().to_string(), e))?;
        let bind = |leg: usize| -> Result<(DevNum, File), BackendError> {
            let path = self.file(id, leg);
            let shown = path.display().to_string();
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(BackendError::io("remove", &shown, e));
                }
                _ => {}
            }
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| BackendError::io("create", &shown, e))?;
            f.set_len(LEG_BYTES)
                .map_err(|e| BackendError::io("size", &shown, e))?;
            loopdev::bind_service_file(&self.instance, id, &OwnedFd::from(f))
        };
        let (d0, f0) = bind(0)?;
        let (d1, f1) = bind(1)?;
        Ok(MetadataLegs {
            devs: [d0, d1],
            _held: [f0, f1],
        })
    }

    /// Deletes move `id`'s metadata files once the move needs them no
    /// more. A loop device a table still holds keeps its inode until the
    /// table lets it go (and then unbinds itself).
    pub(crate) fn forget(&self, id: Uuid) {
        for leg in 0..2 {
            let path = self.file(id, leg);
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(move_id = %id, path = %path.display(), error = %e, "a move's metadata file stays");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_has_two_files_of_its_own() {
        let m = MoveMetadata::new(Path::new("/var/lib/blockplane/run"), "0a1b2c3d");
        let id = Uuid::nil();
        assert_eq!(
            m.file(id, 1),
            Path::new("/var/lib/blockplane/run/moves/00000000-0000-0000-0000-000000000000.meta1")
        );
        assert_ne!(m.file(id, 0), m.file(id, 1));
    }
}
