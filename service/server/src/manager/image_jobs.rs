//! The images' part of the manager: what runs in the background on images
//! (allocates, copies, copies of one moment, backups) and the struct whose
//! steps — in `images.rs`, `copies.rs` and `backups.rs` — make, copy,
//! allocate and list images over the house. Its jobs are its own: no other
//! part starts one, and a change of an image asks them before it is made.

use std::sync::Arc;

use super::house::House;
use super::jobs::Jobs;
use super::moments::MomentCopies;
use super::runs::{AllocateRun, BackupRun, CopyRun};

/// What runs in the background on images.
#[derive(Default)]
pub(super) struct ImageJobs {
    /// Each image's last allocate since the service started (in memory: a
    /// restart leaves the image as declared, to be allocated again).
    pub(super) allocations: Jobs<AllocateRun>,
    /// The background copies of snapshots and clones, by the image made.
    pub(super) copies: Jobs<CopyRun>,
    /// The volumes whose worker copies one moment now, and into what: one
    /// copy at a time each, so a job follows only its own.
    pub(super) moments: MomentCopies,
    /// This service's backups since it started, by backup id.
    pub(super) backups: Jobs<BackupRun>,
    /// What the standby images' follower last found, by image id (their
    /// applies are copies, in `copies`).
    pub(super) standbys:
        std::sync::Mutex<std::collections::HashMap<uuid::Uuid, super::standbys::Follow>>,
}

/// The images' part: the house, and the jobs on images. Cheap to clone (two
/// `Arc`s), so a job that runs on after its request holds this part alone.
#[derive(Clone)]
pub struct Images {
    pub(super) house: Arc<House>,
    pub(super) jobs: Arc<ImageJobs>,
}

impl Images {
    /// Asks every running allocate, copy and backup to stop (the service is
    /// stopping: an allocated image stays as declared, to be allocated
    /// again; a copy is found `copying` at the next start and failed there).
    pub fn stop_jobs(&self) {
        self.jobs.allocations.stop_all();
        self.jobs.copies.stop_all();
        self.jobs.backups.stop_all();
    }
}
