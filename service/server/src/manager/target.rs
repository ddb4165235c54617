//! The backups' part of the manager: the service's backup target and what
//! it keeps of its backups while it runs (the backups running are jobs on
//! images, [`super::image_jobs`]), over the images' part; its steps, in
//! [`super::backups`], make, list, verify, collect and restore them.

use std::collections::HashMap;
use std::sync::Arc;

use time::OffsetDateTime;
use uuid::Uuid;

use super::house::House;
use super::image_jobs::Images;
use blockplane_backup::Target;

/// The service's backup target and what it keeps of its backups.
pub(super) struct BackupState {
    /// `--backup-target`, opened; `None`: backups are refused.
    pub(super) target: Option<Target>,
    /// Each image's last backup with a manifest, by image id (filled from
    /// the target at start, then by this service's backups): `/metrics`
    /// reports its age.
    pub(super) last_done: std::sync::Mutex<HashMap<Uuid, OffsetDateTime>>,
    /// Bytes this service's backups put on the target, and found there.
    pub(super) uploaded_bytes: std::sync::atomic::AtomicU64,
    pub(super) deduplicated_bytes: std::sync::atomic::AtomicU64,
    /// One gc at a time: two at once could each keep what the other's
    /// listing missed (`blockplane_backup::gc`).
    pub(super) gc: tokio::sync::Mutex<()>,
    /// One prune at a time on this service: two at once would decide on
    /// the same list and delete what the other keeps.
    pub(super) prunes: tokio::sync::Mutex<()>,
    /// One change to the schedules at a time: the follower's runs, and
    /// the API's creates, changes and deletes.
    pub(super) schedules: tokio::sync::Mutex<()>,
    /// When this process started: its leases from before are a crash's.
    pub(super) started: OffsetDateTime,
    /// The file a backup waits at while it exists (the test fault
    /// `gate_backup`).
    pub(super) gate: std::path::PathBuf,
    /// How often the follower looks for each standby's newer backups;
    /// `None`: only when told.
    pub(super) standby_check: Option<std::time::Duration>,
}

impl BackupState {
    /// Backups to `target`, when the service has one; `run_dir` holds the
    /// test fault's gate.
    fn new(
        target: Option<Target>,
        run_dir: &std::path::Path,
        standby_check: Option<std::time::Duration>,
    ) -> Self {
        Self {
            standby_check,
            target,
            gate: run_dir.join("backup-gate"),
            started: OffsetDateTime::now_utc(),
            last_done: std::sync::Mutex::default(),
            uploaded_bytes: std::sync::atomic::AtomicU64::default(),
            deduplicated_bytes: std::sync::atomic::AtomicU64::default(),
            gc: tokio::sync::Mutex::default(),
            prunes: tokio::sync::Mutex::default(),
            schedules: tokio::sync::Mutex::default(),
        }
    }
}

/// The backups' part: the images' part it reads and restores images
/// through, and the backup target's state. Cheap to clone, so a backup
/// that runs on after its request holds this part alone.
#[derive(Clone)]
pub struct Backups {
    pub(super) images: Images,
    pub(super) state: Arc<BackupState>,
}

impl Backups {
    /// What every step reads: the images' part's house, the one house.
    pub(super) fn house(&self) -> &House {
        &self.images.house
    }

    /// Backups to `target` over `images`, when the service has a target;
    /// `run_dir` holds the test fault's gate;
    /// standbys look for newer backups every `standby_check`.
    pub(super) fn new(
        images: Images,
        target: Option<Target>,
        run_dir: &std::path::Path,
        standby_check: Option<std::time::Duration>,
    ) -> Self {
        Self {
            images,
            state: Arc::new(BackupState::new(target, run_dir, standby_check)),
        }
    }
}
