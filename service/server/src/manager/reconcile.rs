//! Start-up reconciliation: make SQLite and the kernel agree again after the
//! service stopped or was killed at any point.
//!
//! Every volume row is matched with the kernel by the mark its device carries:
//! a live device serving the same image is re-adopted; a vanished one is
//! re-attached, or the volume goes `error` with the reason; a volume caught
//! half-deleted is finished off. Marked devices with no row are removed.

use crate::fault::Slow;
use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::OwnedMutexGuard;

use super::Manager;
use super::blocking::blocking;
use super::error::Result;
use super::house::House;
use super::volumes::params;
use crate::backend::{
    Attachment, BackendError, Change, OrphanPolicy, Probe, ProbeRequest, VolumeBackend,
};
use crate::store::{ImageRow, VolumeRow};
use blockplane_api::model::{Backend, VolumeState};
use blockplane_system::extent;
use blockplane_system::image::Access;

/// How many volumes reconciliation works on at once. After a pod is killed,
/// every device a worker served waits for its new worker, and a recovery
/// waiting for a slot adds a whole recovery to its device's stall (with 8
/// at once, 36 such devices recover in five turns, the last device waiting
/// through all five). So every volume of a host of up to this many goes at once;
/// beyond, recoveries queue in turn. The bound keeps a host of thousands
/// from starting as many workers in the same instant (each holds a blocking
/// thread while it starts, and the runtime has 512).
const RECONCILE_AT_ONCE: usize = 64;

/// Whether the volume's device, as recorded, is served by a worker (a ublk
/// volume's, or a dm volume's private one): after a pod is killed, such a
/// device holds its users' I/O until a new worker recovers it.
fn waits_for_a_worker(v: &VolumeRow) -> bool {
    v.attachment
        .as_ref()
        .is_some_and(|a| a.ublk().is_some() || a.dm().is_some_and(|d| d.private_ublk.is_some()))
}

/// The lock on a volume's image, taken again at reconciliation: `None` when
/// the image could not be opened, an error when another process holds it.
type ImageLock = Option<Result<OwnedFd>>;

/// What reconciliation did with one volume.
enum Outcome {
    Adopted,
    Reattached,
    Failed,
    FinishedDelete,
    /// Deleted meanwhile, or a delete that could not be finished yet.
    Gone,
}

/// What reconciliation did, for the log.
#[derive(Debug, Default)]
pub struct Report {
    pub adopted: usize,
    pub reattached: usize,
    pub failed: usize,
    pub finished_deletes: usize,
    pub orphans_removed: usize,
}

impl Manager {
    /// What a start owes before the API serves: copies a crash interrupted
    /// failed, stale backup moments removed, and every volume locked and
    /// marked `recovering`. The volumes themselves are reconciled by
    /// [`Recovery::run`], beside the API.
    pub async fn recovery(self: &Arc<Self>) -> Result<Recovery> {
        self.house.fail_interrupted_copies().await?;
        self.house.remove_backup_moments().await?;
        self.backups.recover_standbys().await?;
        let me = self.clone();
        tokio::spawn(async move { me.backups.recover_backup_target().await });
        let mut held = Vec::new();
        for row in self.house.store.volumes().await? {
            let lock = self.house.locks.volumes.lock(&row.name).await;
            held.push(Held { row, lock });
        }
        // A device waiting for a worker stalls its users until it is
        // recovered; one that never stopped (loop, dm kernel or direct) can
        // wait its turn.
        held.sort_by_key(|h| !waits_for_a_worker(&h.row));
        self.volumes.recovering.begin(held.iter().map(|h| h.row.id));
        Ok(Recovery {
            manager: self.clone(),
            held,
        })
    }

    /// Reconciles every volume, then removes orphan devices: a start's
    /// [`Manager::recovery`] and [`Recovery::run`] at once.
    #[cfg(test)]
    pub async fn reconcile(self: &Arc<Self>) -> Result<Report> {
        self.recovery().await?.run().await
    }
}

impl Recovery {
    /// Reconciles every volume it holds, several at once, then removes
    /// orphan devices. Each volume stops being `recovering`, and its lock
    /// is released, as soon as it is done.
    pub async fn run(self) -> Result<Report> {
        let manager = self.manager;
        // Several volumes at once: after a pod is killed, each ublk device
        // stalls its users until its new worker recovers it, so the last
        // one's wait must not be the sum of all the others'. Every volume's
        // outcome is awaited before an error is returned: none is left half
        // done by a sibling's failure.
        let outcomes: Vec<Result<Outcome>> = futures_util::stream::iter(self.held)
            .map(|held| {
                let manager = manager.clone();
                async move {
                    let id = held.row.id;
                    let outcome = manager.house.reconcile_volume(held).await;
                    manager.volumes.recovering.done(id);
                    outcome
                }
            })
            .buffer_unordered(RECONCILE_AT_ONCE)
            .collect()
            .await;
        let mut report = Report::default();
        for outcome in outcomes {
            match outcome? {
                Outcome::Adopted => report.adopted += 1,
                Outcome::Reattached => report.reattached += 1,
                Outcome::Failed => report.failed += 1,
                Outcome::FinishedDelete => report.finished_deletes += 1,
                Outcome::Gone => {}
            }
        }
        report.orphans_removed = manager.house.remove_orphans().await?;
        manager.volumes.recovering.finish();
        Ok(report)
    }
}

/// A volume's row read at the start, with its lock, held until
/// reconciliation is done with it.
pub(super) struct Held {
    pub(super) row: VolumeRow,
    pub(super) lock: OwnedMutexGuard<()>,
}

/// The reconciliation a starting service owes: every volume's row, each
/// locked, taken before the API serves. [`Recovery::run`] does it.
pub struct Recovery {
    pub(super) manager: std::sync::Arc<super::Manager>,
    pub(super) held: Vec<Held>,
}

impl Recovery {
    /// How many volumes it holds.
    pub fn volumes(&self) -> usize {
        self.held.len()
    }
}

/// The start's steps that need the house alone: a volume adopted or its
/// delete finished, and orphans removed.
impl House {
    /// A device adopted after a crash may carry a live change its row never
    /// recorded (the service died between changing the device and the
    /// commit, whose answer the client never got). The row says what should
    /// be: its live settings are applied again.
    async fn reapply_settings(
        &self,
        backend: &Arc<dyn VolumeBackend>,
        v: &VolumeRow,
        mut att: Attachment,
    ) -> Attachment {
        if v.backend == Backend::Loop {
            return att;
        }
        let asked = blockplane_system::dispatch::active_of(v.dispatch);
        let mut changes = Vec::new();
        if asked.is_some_and(|d| d != att.dispatch) {
            changes.push(Change::Dispatch(v.dispatch));
        }
        if att.read_only != v.read_only {
            changes.push(Change::ReadOnly(v.read_only));
        }
        // A worker does not report its limits: send the row's (a dm
        // volume's too: its private worker holds them, and a limit set or
        // removed moves it between direct and nowait under auto).
        if matches!(v.backend, Backend::Ublk | Backend::Dm) {
            changes.push(Change::Qos(v.qos));
        }
        for change in changes {
            let (b, a) = (backend.clone(), att.clone());
            if !matches!(
                blocking(move || b.check_change(&a, change)).await,
                Ok(Ok(()))
            ) {
                continue;
            }
            match self.reconfigure(backend, v, &att, change).await {
                Ok(a) => att = a,
                Err(e) => {
                    tracing::warn!(volume = %v.name, error = %e, ?change, "could not apply the recorded setting again after adoption")
                }
            }
        }
        att
    }

    /// A volume caught half-deleted: its device is detached and its row
    /// forgotten, or, if the detach fails, left for a `DELETE` to retry.
    async fn finish_delete(&self, v: &VolumeRow) -> Result<Outcome> {
        match self.detach(v).await {
            Ok(()) => {
                self.forget_volume(v).await?;
                Ok(Outcome::FinishedDelete)
            }
            Err(e) => {
                tracing::warn!(volume = %v.name, error = %e, "could not finish a delete; retry with DELETE");
                Ok(Outcome::Gone)
            }
        }
    }

    /// The device serves: it is recorded as attached (its recorded live
    /// settings applied again) and its image lock kept.
    async fn adopt(
        &self,
        v: &mut VolumeRow,
        backend: &Arc<dyn VolumeBackend>,
        att: Attachment,
        image_lock: ImageLock,
    ) -> Result<Outcome> {
        self.stop_orphan_copy(backend, v, &att).await;
        let mut att = self.reapply_settings(backend, v, att).await;
        // Same device as recorded: keep when and from what its counters count.
        if let Some(old) = v.attachment.as_ref().filter(|o| o.device == att.device) {
            att.attached_at = old.attached_at;
            att.baseline = old.baseline;
        }
        let unchanged = v.state == VolumeState::Attached
            && v.attachment.as_ref() == Some(&att)
            && v.crypt
                .as_ref()
                .is_none_or(|l| blockplane_system::crypt::is_open(&l.name));
        if !unchanged {
            self.record_attached(v, att, "volume_adopted").await?;
        }
        match (image_lock, backend.image_lock(v.id)) {
            (Some(Ok(fd)), _) | (_, Some(fd)) => self.holds.keep(v.id, fd),
            (Some(Err(e)), None) => {
                tracing::warn!(volume = %v.name, error = %e, "adopted, but its image is locked elsewhere")
            }
            (None, None) => {}
        }
        Ok(Outcome::Adopted)
    }

    /// Removes devices that carry this instance's mark but belong to no volume
    /// (dm devices are only reported: see `Manager::host`).
    async fn remove_orphans(&self) -> Result<usize> {
        let known: HashSet<_> = self.store.volumes().await?.iter().map(|v| v.id).collect();
        let mut removed = 0;
        for backend in self
            .backends
            .iter()
            .filter(|b| b.orphan_policy() == OrphanPolicy::Remove)
        {
            let b = backend.clone();
            let marked = match blocking(move || b.marked()).await? {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(backend = backend.kind().as_str(), error = %e, "cannot scan for orphan devices");
                    continue;
                }
            };
            for m in marked.into_iter().filter(|m| !known.contains(&m.volume_id)) {
                let b = backend.clone();
                let id = m.volume_id;
                let outcome = blocking(move || b.detach(id, None)).await?;
                let mut tx = self.store.begin().await?;
                match outcome {
                    Ok(()) => {
                        removed += 1;
                        tx.event(
                            Some(m.volume_id),
                            None,
                            "orphan_removed",
                            &format!(
                                "removed {}: it carried the mark of volume {}, which has no record",
                                m.device, m.volume_id
                            ),
                        )
                        .await?;
                    }
                    Err(e) => {
                        tx.event(
                            Some(m.volume_id),
                            None,
                            "orphan_found",
                            &format!("{} carries the mark of unknown volume {} and could not be removed: {e}", m.device, m.volume_id),
                        )
                        .await?;
                    }
                }
                tx.commit().await?;
            }
        }
        Ok(removed)
    }

    /// Matches one volume's row with the kernel, under the volume's lock
    /// (taken when the start began).
    async fn reconcile_volume(self: &Arc<Self>, held: Held) -> Result<Outcome> {
        let _volume = held.lock;
        if self.settings.faults.slows(Slow::ReconcileGate) {
            let gate = self.settings.ublk_run_root.with_file_name("reconcile-gate");
            while gate.exists() {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
        let Some(mut v) = self.store.volume(&held.row.id.to_string()).await? else {
            return Ok(Outcome::Gone);
        };
        if v.state == VolumeState::Detaching {
            return self.finish_delete(&v).await;
        }
        let Some(image) = self.store.image(&v.image_id.to_string()).await? else {
            let reason = format!("its image {} is not registered", v.image_id);
            self.record_error(&mut v, reason).await?;
            return Ok(Outcome::Failed);
        };
        let Some(backend) = self.backend(v.backend) else {
            let reason = super::house::not_built_reason(v.backend);
            self.record_error(&mut v, reason).await?;
            return Ok(Outcome::Failed);
        };
        tracing::debug!(volume = %v.name, "reconcile: probing its device");
        let (probe, image_lock) = self.probe_volume(&v, &image, &backend).await?;
        tracing::debug!(volume = %v.name, alive = matches!(probe, Ok(Probe::Alive(_))), "reconcile: probed");
        match probe {
            Ok(Probe::Alive(att)) => self.adopt(&mut v, &backend, *att, image_lock).await,
            Ok(Probe::Gone) => self.reattach(&mut v, &image, image_lock).await,
            Err(e) => {
                self.record_error(&mut v, e.to_string()).await?;
                Ok(Outcome::Failed)
            }
        }
    }

    /// Asks the backend whether the volume's device still serves, with the
    /// image opened and its lock taken again.
    async fn probe_volume(
        self: &Arc<Self>,
        v: &VolumeRow,
        image: &ImageRow,
        backend: &Arc<dyn VolumeBackend>,
    ) -> Result<(std::result::Result<Probe, BackendError>, ImageLock)> {
        // A direct-mapped image is pinned: it opens read-only only.
        let opened = {
            let (me, image, a) = (
                self.clone(),
                image.clone(),
                Access::read_only_if(v.spec.read_only),
            );
            blocking(move || {
                me.open_image(&image, a)
                    .or_else(|_| me.open_image(&image, Access::ReadOnly))
            })
            .await?
        };
        // The lock a serving volume holds on its image, taken again. Held
        // elsewhere, it is either another blockplane's or the one this
        // volume's ublk worker kept while no service lived (the backend
        // finds that one when it probes the worker).
        let image_lock = opened.as_ref().ok().map(|f| self.lock_image(image, f));
        let req = ProbeRequest {
            volume_id: v.id,
            identity: (image.dev, image.ino),
            params: params(v, image, image.size_bytes),
            image: opened.ok().map(|f| f.into_fd()),
            stored: v.attachment.clone(),
            image_lock: match &image_lock {
                Some(Ok(fd)) => fd.try_clone().ok(),
                _ => None,
            },
        };
        let prober = backend.clone();
        let probe = blocking(move || prober.probe(req)).await?;
        Ok((probe, image_lock))
    }

    /// The device vanished: the volume is attached again, or goes `error`
    /// with the reason.
    async fn reattach(
        self: &Arc<Self>,
        v: &mut VolumeRow,
        image: &ImageRow,
        image_lock: ImageLock,
    ) -> Result<Outcome> {
        let opened = {
            let (me, image, a) = (
                self.clone(),
                image.clone(),
                Access::read_only_if(v.spec.read_only),
            );
            let ublk = v.backend == Backend::Ublk;
            blocking(move || match me.open_image(&image, a) {
                // Pinned by the volume's direct worker, which died while no
                // service ran: the backend lifts that pin (and reopens the
                // image for writing) when it recovers the device.
                Err(e) if ublk => match me.open_image(&image, Access::ReadOnly) {
                    Ok(f) if extent::is_immutable(f.fd().as_fd()).unwrap_or(false) => Ok(f),
                    _ => Err(e),
                },
                r => r,
            })
            .await?
        };
        let attached = match opened {
            Ok(file) => {
                // Taken again if it failed: the probe may have stopped its
                // holder (a dm volume's stray worker).
                let lock = match image_lock {
                    Some(Ok(lock)) => Ok(lock),
                    _ => self.lock_image(image, &file),
                };
                match lock {
                    Ok(lock) => self
                        .attach(v, image, file, &lock, None)
                        .await
                        .map(|att| (att, lock)),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        match attached {
            Ok((att, lock)) => {
                self.holds.keep(v.id, lock);
                self.record_attached(v, att, "volume_reattached").await?;
                Ok(Outcome::Reattached)
            }
            Err(e) => {
                self.record_error(
                    v,
                    format!("its device vanished and could not be re-attached: {e}"),
                )
                .await?;
                Ok(Outcome::Failed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::waits_for_a_worker;
    use crate::attachment::{Attachment, DeviceState, tests::OLD_ROWS};
    use crate::store::tests::{image_row, volume_row};
    use blockplane_api::model::{Backend, DispatchPolicy};

    /// The recorded device decides, not the policy asked: a worker's own
    /// ublk device or a dm table over a private one waits for a new worker
    /// after a pod kill; the loop driver, a direct map and a volume with no
    /// device do not.
    #[test]
    fn a_volume_waits_for_a_worker_when_its_recorded_device_has_one() {
        let image = image_row("img");
        let [lp, ub, dm] = OLD_ROWS.map(|r| serde_json::from_str::<Attachment>(r).unwrap());
        let mut direct = dm.clone();
        if let DeviceState::Dm(d) = &mut direct.kind {
            d.private_ublk = None;
        }
        let cases = [
            (Backend::Loop, Some(lp), false),
            (Backend::Ublk, Some(ub), true),
            (Backend::Dm, Some(dm), true),
            (Backend::Dm, Some(direct), false),
            (Backend::Ublk, None, false),
        ];
        for (backend, attachment, waits) in cases {
            let mut v = volume_row("v", &image, backend, DispatchPolicy::Nowait);
            v.attachment = attachment;
            assert_eq!(
                waits_for_a_worker(&v),
                waits,
                "{backend:?}: {:?}",
                v.attachment
            );
        }
    }
}
