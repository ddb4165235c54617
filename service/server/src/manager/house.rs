//! The house every part of the manager stands on: the registry, the image
//! roots, the backends, what the operator configured, and the locks, holds
//! and reserve that keep one change at a time safe. A part that keeps state
//! of its own (the readings, the jobs, the backups) keeps it beside the
//! house, not in it; a new part is handed the house rather than added to it.

use std::future::Future;
use std::sync::Arc;

use super::error::{Error, Result};
use super::{holds, locks, reserve};
use crate::backend::{VolumeBackend, WorkerInfo};
use crate::fault::Faults;
use crate::store::{ImageRow, Store, VolumeRow};
use blockplane_api::model::{self, Backend};
use blockplane_system::image::{Access, ImageRoots};
use uuid::Uuid;

/// What every manager operation reads.
pub(super) struct House {
    pub(super) store: Store,
    pub(super) roots: ImageRoots,
    pub(super) backends: Vec<Arc<dyn VolumeBackend>>,
    /// What the operator configured, fixed for the manager's life.
    pub(super) settings: Settings,
    /// Who may change an image or a volume now.
    pub(super) locks: locks::Locks,
    /// OFD locks on the images of this service's volumes.
    pub(super) holds: holds::ImageHolds,
    /// Room for the writes that finish a device change on a full disk.
    pub(super) reserve: reserve::Reserve,
}

/// What the operator configured the manager with ([`super::ManagerConfig`],
/// and the store's instance id), fixed for its life.
pub(super) struct Settings {
    /// The test fault to inject (none outside tests).
    pub(super) faults: Faults,
    /// The wall clock backups are dated and schedules run by.
    pub(super) clock: crate::fault::Clock,
    /// Volumes this host may have.
    pub(super) max_volumes: usize,
    /// Provisioned bytes of an image root over its filesystem's size, at most.
    pub(super) max_overcommit: Option<f64>,
    /// How hard new key slots are to guess.
    pub(super) kdf: blockplane_system::crypt::Kdf,
    /// Queues a new ublk volume gets when it asks for none.
    pub(super) default_queues: u16,
    /// This service's instance id, in the marks it puts on devices.
    pub(super) instance: String,
    /// Where ublk workers' run dirs live.
    pub(super) ublk_run_root: std::path::PathBuf,
}

impl House {
    /// The backend of this kind, when this build has it.
    pub(super) fn backend(&self, kind: Backend) -> Option<Arc<dyn VolumeBackend>> {
        self.backends.iter().find(|b| b.kind() == kind).cloned()
    }

    /// Runs `write`, the record of what the kernel already has (a device
    /// made, changed or removed): if the registry's filesystem is full, once
    /// more after freeing the room kept for it ([`reserve`]).
    pub(super) async fn finishing<F: Future<Output = Result<()>>>(
        &self,
        write: impl Fn() -> F,
    ) -> Result<()> {
        match write().await {
            Err(Error::Store(e)) if e.is_full() && self.reserve.free() => {
                tracing::warn!(error = %e, "the registry's filesystem is full: spending the room kept to record a device change");
                write().await
            }
            other => other,
        }
    }

    /// Takes the registration lock, which every image create on the host
    /// takes, for a new image named `name`: refused when the name is taken.
    pub(super) async fn claim_name(&self, name: &str) -> Result<tokio::sync::MutexGuard<'_, ()>> {
        let registering = self.locks.registration.lock().await;
        if let Some(existing) = self.store.image(name).await? {
            return Err(Error::ImageNameTaken {
                name: name.to_string(),
                id: existing.id,
            });
        }
        Ok(registering)
    }

    /// Records an event about image `image_id` in a transaction of its own.
    pub(super) async fn record_image_event(
        &self,
        image_id: Uuid,
        kind: &str,
        message: &str,
    ) -> Result<()> {
        let mut tx = self.store.begin().await?;
        tx.event(None, Some(image_id), kind, message).await?;
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn image_row(&self, id_or_name: &str) -> Result<ImageRow> {
        self.store
            .image(id_or_name)
            .await?
            .ok_or_else(|| Error::ImageNotFound(id_or_name.to_string()))
    }
    /// Opens a registered image's file and checks it is still the same file.
    pub(super) fn open_image(
        &self,
        row: &ImageRow,
        access: Access,
    ) -> Result<blockplane_system::image::ImageFile> {
        let path = self.roots.resolve(&row.path)?;
        let file = self.roots.open_file(&path, access)?;
        if file.identity() != (row.dev, row.ino)
            || !blockplane_system::image::same_birth(row.birth.as_deref(), file.birth())
        {
            return Err(Error::ImageReplaced {
                name: row.name.clone(),
                reason: format!(
                    "{} is no longer the registered file (inode {} on device {}, born {}); re-register it",
                    row.path,
                    row.ino,
                    row.dev,
                    row.birth.as_deref().unwrap_or("at an unrecorded time")
                ),
            });
        }
        Ok(file)
    }
    pub(super) async fn volume_row(&self, id_or_name: &str) -> Result<VolumeRow> {
        self.store
            .volume(id_or_name)
            .await?
            .ok_or_else(|| Error::VolumeNotFound(id_or_name.to_string()))
    }

    /// Availability of a backend, including ones this build does not carry yet.
    pub(super) fn capability(&self, kind: Backend) -> model::BackendCapability {
        match self.backend(kind) {
            Some(b) => b.capability(),
            None => model::BackendCapability {
                available: false,
                reason: Some(not_built_reason(kind)),
                features: None,
                targets: None,
                native_loop_target: None,
            },
        }
    }

    /// The worker serving `v`'s device, if one does.
    pub(super) fn worker_of(&self, v: &VolumeRow) -> Option<WorkerInfo> {
        self.backend(v.backend)?.worker(v.id)
    }

    /// `worker_version` and `worker_older` of a volume's view.
    pub(super) fn worker_build(&self, v: &VolumeRow) -> (Option<String>, Option<bool>) {
        match self.worker_of(v) {
            Some(w) => {
                let older = w.build.as_deref() != Some(blockplane_system::build::current());
                (Some(version_of(&w)), Some(older))
            }
            None => (None, None),
        }
    }
}

/// Why a backend this manager lacks is unavailable.
pub(super) fn not_built_reason(kind: Backend) -> String {
    match kind {
        Backend::Ublk if !std::path::Path::new("/dev/ublk-control").exists() => {
            "ublk_drv is not loaded (no /dev/ublk-control)".into()
        }
        Backend::Dm if !std::path::Path::new("/dev/mapper/control").exists() => {
            "device-mapper is not available (no /dev/mapper/control)".into()
        }
        other => format!("this build of blockplane has no {} backend", other.as_str()),
    }
}

/// How the API names a worker's build: `unknown` for one from before
/// workers said.
pub(super) fn version_of(w: &WorkerInfo) -> String {
    w.build.clone().unwrap_or_else(|| "unknown".into())
}
