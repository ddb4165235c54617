//! The controller: owns the service's state and is the only thing that changes
//! it. The API layer parses requests into calls on [`Manager`] and maps its
//! [`Error`]s to HTTP; the manager keeps SQLite and the kernel in step, one
//! image or volume at a time, with every change recorded as an event.

mod backend_events;
mod backups;
mod blocking;
mod cold_moves;
mod copies;
mod drains;
pub(crate) mod encryption;
mod error;
mod events;
mod exports;
mod fabric_error;
#[cfg(test)]
mod fake;
mod handover;
mod holds;
mod host;
mod house;
mod image_jobs;
mod images;
mod jobs;
mod labels;
mod locks;
mod look;
mod metrics;
mod moments;
mod move_metadata;
mod moves;
mod names;
pub mod orphans;
mod pagecache;
mod ranges;
mod reconcile;
mod recovery;
mod remotes;
mod reserve;
#[cfg(test)]
mod rules;
mod runs;
mod sampler;
mod schedules;
mod standbys;
mod target;
mod undo;
mod volume_part;
mod volumes;

use std::sync::Arc;

use crate::backend::{BackendEvent, VolumeBackend};
use crate::fault::Faults;
use crate::store::Store;
use blockplane_system::image::ImageRoots;
pub use error::{Error, Result};
pub use exports::Exports;
pub use fabric_error::{ExportError, MoveError, RemoteError};
use house::{House, Settings};
use image_jobs::{ImageJobs, Images};
pub use remotes::Remotes;
use volume_part::Volumes;

/// Whether a create made something new or found it already there.
#[derive(Debug)]
pub enum Created<T> {
    New(T),
    Existing(T),
}

/// What the manager needs of the service's configuration.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Runtime files (worker run dirs).
    pub run_dir: std::path::PathBuf,
    /// Queues of a ublk or dm volume created without a number.
    pub default_queues: u16,
    /// Volumes this host may have.
    pub max_volumes: usize,
    /// Provisioned bytes of an image root over its filesystem's size, at most.
    pub max_overcommit: Option<f64>,
    /// How hard new key slots are to guess (`--key-unlock-ms`).
    pub kdf: blockplane_system::crypt::Kdf,
    /// Where backups go (`--backup-target`), opened; `None`: backups are
    /// refused.
    pub backup_target: Option<blockplane_backup::Target>,
    /// How often standby images look for newer backups
    /// (`--standby-check-secs`); `None`: only when told.
    pub standby_check: Option<std::time::Duration>,
    /// The test fault to inject (none outside tests).
    pub faults: Faults,
    /// The wall clock backups are dated and schedules run by (a test's
    /// own in tests).
    pub clock: crate::fault::Clock,
    /// Where exports listen (`--export-address`); none: exports are refused.
    pub export_addresses: Vec<blockplane_system::nvmet::ListenAddr>,
    /// The bearer token to call other hosts' APIs with (a move tells its
    /// exporting host to let go): this service's own, since hosts that move
    /// volumes between them share one.
    pub peer_token: Option<String>,
}

/// The controller: the house every part stands on, and the parts that keep
/// their own state beside it.
pub struct Manager {
    /// What every operation reads: the registry, the image roots, the
    /// backends, the settings, the locks and image holds, the reserve.
    house: Arc<House>,
    /// The images' part: the house and what runs on images (allocates,
    /// copies, moment copies, backups).
    images: Images,
    /// The backups' part: the backup target and this service's backups.
    backups: target::Backups,
    /// The volumes' part: their readings, the volumes a start has not
    /// reconciled yet, and what the API reads often.
    volumes: Volumes,
    /// The exports' part: volumes served to other hosts over NVMe/TCP.
    exports: Exports,
    /// The remote volumes' part: other hosts' exports connected here.
    remotes: Remotes,
    /// The token moves call other hosts' APIs with.
    peer_token: Option<String>,
    /// The moves whose start request has not made their mirror yet, and
    /// the drains whose start has not started every move: the follower
    /// leaves them (a drain's shares) to it.
    starting: std::sync::Mutex<std::collections::HashSet<uuid::Uuid>>,
    /// Where moves' mirrors keep their metadata legs.
    move_metadata: move_metadata::MoveMetadata,
}

/// The backends a manager serves volumes with, built by its caller (the
/// server builds the kernel's; a test, fakes), and the receiving end of the
/// [`crate::backend::EventSink`] they were given.
pub struct Backends {
    /// One per kind at most; a kind missing is a backend this build lacks.
    pub list: Vec<Arc<dyn VolumeBackend>>,
    /// What the backends notice on their own (worker restarts, drift).
    pub events: std::sync::mpsc::Receiver<BackendEvent>,
}

impl Manager {
    /// A manager over `store` and `roots`, serving volumes with `backends`.
    pub async fn new(
        store: Store,
        roots: ImageRoots,
        backends: Backends,
        cfg: ManagerConfig,
    ) -> Result<Arc<Self>> {
        let instance = store.instance().await?;
        let (host_nqn, host_id) = store.host_identity().await?;
        let house = Arc::new(House {
            store,
            roots,
            backends: backends.list,
            settings: Settings {
                faults: cfg.faults,
                clock: cfg.clock,
                max_volumes: cfg.max_volumes,
                max_overcommit: cfg.max_overcommit,
                kdf: cfg.kdf,
                default_queues: cfg.default_queues,
                instance,
                ublk_run_root: cfg.run_dir.join("ublk"),
            },
            locks: locks::Locks::default(),
            holds: holds::ImageHolds::default(),
            reserve: reserve::Reserve::new(cfg.run_dir.parent().unwrap_or(&cfg.run_dir)),
        });
        let images = Images {
            house: house.clone(),
            jobs: Arc::new(ImageJobs::default()),
        };
        let me = Arc::new(Self {
            exports: Exports::new(house.clone(), cfg.export_addresses),
            remotes: Remotes::new(house.clone(), host_nqn, host_id),
            peer_token: cfg.peer_token,
            starting: Default::default(),
            move_metadata: move_metadata::MoveMetadata::new(&cfg.run_dir, &house.settings.instance),
            house,
            backups: target::Backups::new(
                images.clone(),
                cfg.backup_target,
                &cfg.run_dir,
                cfg.standby_check,
            ),
            volumes: Volumes::new(images.clone()),
            images,
        });
        me.house.clone().record_backend_events(backends.events);
        Ok(me)
    }

    /// The volumes' part: volumes created, changed, shown and deleted.
    pub fn volumes(&self) -> &Volumes {
        &self.volumes
    }

    /// The images' part: images listed, viewed, copied, allocated, resized,
    /// deleted and their key slots changed.
    pub fn images(&self) -> &Images {
        &self.images
    }

    /// The backups' part: backups made, listed, verified and collected.
    pub fn backups(&self) -> &target::Backups {
        &self.backups
    }

    /// The exports' part: volumes exported, shown and unexported.
    pub fn exports(&self) -> &Exports {
        &self.exports
    }

    /// The remote volumes' part: other hosts' exports connected, shown,
    /// changed and disconnected.
    pub fn remotes(&self) -> &Remotes {
        &self.remotes
    }

    /// The database (the server checkpoints it at stop).
    pub fn store(&self) -> &Store {
        &self.house.store
    }

    /// Samples every attached volume once a second, for as long as the
    /// service runs, and starts the standby images' follower beside it.
    pub fn start_sampler(self: &Arc<Self>) {
        standbys::start_follower(&self.backups);
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                if let Err(e) = me.volumes.readings.sample_once(&me.house).await {
                    tracing::debug!(error = %e, "stats sampling failed");
                }
                if let Err(e) = me.remotes.follow_once().await {
                    tracing::warn!(error = %e, "following remote volumes failed");
                }
                if let Err(e) = me.follow_moves().await {
                    tracing::warn!(error = %e, "following moves failed");
                }
                if let Err(e) = me.backups.run_schedules().await {
                    tracing::warn!(error = %e, "running backup schedules failed");
                }
            }
        });
    }
}
