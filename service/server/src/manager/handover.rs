//! `POST /v1/volumes/{id}/handover`: a volume's worker replaced by one of
//! the service's own build while the device serves (the backends do it:
//! `backend/ublk/handover.rs`), and which build serves each volume.

use time::OffsetDateTime;

use super::blocking::blocking;
use super::error::Result;
use super::volume_part::Volumes;
use super::volumes::volume_error;
use crate::backend::DeviceState;
use blockplane_api::model::{Handover, VolumeState};

impl Volumes {
    /// `POST /v1/volumes/{id}/handover`.
    pub(crate) async fn handover_volume(&self, id_or_name: &str) -> Result<Handover> {
        let v = self.house().volume_row(id_or_name).await?;
        let _volume = self.house().locks.volumes.lock(&v.name).await;
        let mut v = self.house().volume_row(&v.id.to_string()).await?;
        let (Some(att), Some(backend)) = (v.attachment.clone(), self.house().backend(v.backend))
        else {
            return Err(self.house().not_live(&v));
        };
        if !matches!(v.state, VolumeState::Attached | VolumeState::Degraded) {
            return Err(self.house().not_live(&v));
        }
        backend
            .check_handover(&att, v.id)
            .map_err(|e| volume_error(&v.name, e))?;
        let image = self.house().image_row(&v.image_id.to_string()).await?;
        let what = format!("have volume '{}' handed over to a new worker", v.name);
        self.images.jobs.allocations.refuse(&image, &what)?;
        self.images.jobs.copies.refuse(&image, &what)?;
        self.images.jobs.backups.refuse(&image, &what)?;
        let (b, a, id, faults) = (
            backend.clone(),
            att.clone(),
            v.id,
            self.house().settings.faults.handover(),
        );
        let done = blocking(move || b.handover(&a, id, faults))
            .await?
            .map_err(|e| volume_error(&v.name, e))?;
        let device = att.device.clone();
        if let Some(mut now) = done.attachment {
            // Drift seen by the old worker still stands.
            if let (DeviceState::Ublk(new), DeviceState::Ublk(old)) = (&mut now.kind, &att.kind) {
                new.degraded = old.degraded.clone();
            }
            v.attachment = Some(now);
        }
        v.updated_at = OffsetDateTime::now_utc();
        let took_ms = u64::try_from(done.took.as_millis()).unwrap_or(u64::MAX);
        let (from, to) = (
            super::house::version_of(&done.previous),
            super::house::version_of(&done.current),
        );
        let mut tx = self.house().store.begin().await?;
        tx.update_volume(&v).await?;
        tx.event(
            Some(v.id),
            Some(v.image_id),
            "worker_handed_over",
            &format!(
                "volume '{}': worker {} ({from}) handed {device} over to worker {} ({to}) by {} in {took_ms} ms",
                v.name,
                done.previous.pid,
                done.current.pid,
                done.method.as_str(),
            ),
        )
        .await?;
        tx.commit().await?;
        tracing::info!(volume = %v.name, from = done.previous.pid, to = done.current.pid, method = done.method.as_str(), took_ms, "worker handed over");
        Ok(Handover {
            volume: self.volume_view(&v).await?,
            previous_worker_pid: done.previous.pid,
            previous_worker_version: from,
            worker_pid: done.current.pid,
            worker_version: to,
            method: done.method,
            took_ms,
        })
    }
}
