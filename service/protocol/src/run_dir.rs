//! The files a worker keeps in its run dir beside its control socket: its
//! state (which the service watches) and the extent map a first start is
//! to check. The counters are in [`stats_file`](crate::stats_file).

use std::path::Path;

use serde::{Deserialize, Serialize};

use blockplane_system::extent::{ExtentMap, Pin};

/// The state file's name in a worker's run dir.
pub const STATE_FILE: &str = "state.json";

/// What [`STATE_FILE`] holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateFile {
    /// The worker's process id.
    pub pid: u32,
    /// The ublk device it serves (`/dev/ublkbN`).
    pub dev_id: u32,
    /// The image's pin for a direct map, which a replacement worker keeps.
    pub pinned: Option<Pin>,
    /// Why the worker left the direct path on its own, while it serves so:
    /// the file is rewritten when this changes, which is how the service
    /// learns of it (it watches the run dir) without asking.
    #[serde(default)]
    pub degraded: Option<String>,
}

impl StateFile {
    /// The state in `run_dir`, if there is a readable one.
    pub fn read(run_dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(run_dir.join(STATE_FILE)).ok()?).ok()
    }

    /// Writes it into `run_dir` atomically (a reader sees the old state or
    /// the new one, whole).
    pub fn write(&self, run_dir: &Path) -> std::io::Result<()> {
        let tmp = run_dir.join("state.json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, run_dir.join(STATE_FILE))
    }
}

/// The file in a worker's run dir with the map of [`WorkerSpec::decided_map`](crate::WorkerSpec::decided_map).
pub const DECIDED_MAP: &str = "decided-map.json";

/// Writes the map a worker's start is to check (see [`WorkerSpec::decided_map`](crate::WorkerSpec::decided_map)).
pub fn put_decided_map(run_dir: &Path, map: &ExtentMap) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(run_dir.join(DECIDED_MAP))?;
    serde_json::to_writer(&mut f, map).map_err(std::io::Error::other)
}

/// Reads (and removes) the map written by [`put_decided_map`].
pub fn take_decided_map(run_dir: &Path) -> std::io::Result<ExtentMap> {
    let path = run_dir.join(DECIDED_MAP);
    let map = serde_json::from_slice(&std::fs::read(&path)?).map_err(std::io::Error::other)?;
    std::fs::remove_file(&path)?;
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decided_map_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let map = ExtentMap {
            size: 4096,
            fs_device: blockplane_system::extent::DevNum { major: 7, minor: 1 },
            devices: Vec::new(),
            segments: Vec::new(),
        };
        put_decided_map(dir.path(), &map).unwrap();
        assert_eq!(take_decided_map(dir.path()).unwrap(), map);
        // Gone once taken: a replacement worker never checks a stale one.
        assert!(take_decided_map(dir.path()).is_err());
    }
}
