//! Room kept beside the registry for the writes that finish what a device
//! change began. A create records its row, makes the device, then records
//! the device; a delete records `detaching`, removes the device, then drops
//! the row. A filesystem that fills up in between would fail that last
//! write and leave a row without its device, or a device its row does not
//! name. So a file of [`ROOM`] bytes is kept in the data dir: such a write
//! that fails for a full disk frees it and runs once more. The room is taken
//! again once the filesystem has it (a volume create or delete, and
//! `/healthz`, try).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// Bytes kept: a few dozen pages of WAL, many times what one record takes.
const ROOM: u64 = 256 << 10;

/// The room, held or spent.
#[derive(Debug)]
pub struct Reserve {
    path: PathBuf,
    held: AtomicBool,
}

impl Reserve {
    /// The room in `data_dir` (taken now if the filesystem has it).
    pub fn new(data_dir: &Path) -> Self {
        let me = Self {
            path: data_dir.join("reserve"),
            held: AtomicBool::new(false),
        };
        me.take();
        me
    }

    /// Takes the room, unless held or the filesystem lacks it.
    pub fn take(&self) {
        if self.held.load(Relaxed) {
            return;
        }
        let made = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&self.path)
            .and_then(|f| {
                rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, ROOM)?;
                f.sync_all()
            });
        match made {
            Ok(()) => self.held.store(true, Relaxed),
            Err(e) => {
                tracing::debug!(error = %e, path = %self.path.display(), "no room to keep yet");
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }

    /// Frees the room for one write; whether there was any to free.
    pub fn free(&self) -> bool {
        self.held.swap(false, Relaxed) && std::fs::remove_file(&self.path).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_is_a_file_freed_once_and_taken_again() {
        let dir = tempfile::tempdir().unwrap();
        let r = Reserve::new(dir.path());
        let file = dir.path().join("reserve");
        assert_eq!(std::fs::metadata(&file).unwrap().len(), ROOM);
        assert!(r.free());
        assert!(!file.exists());
        assert!(!r.free(), "nothing left to free");
        r.take();
        assert!(file.exists());
    }
}
