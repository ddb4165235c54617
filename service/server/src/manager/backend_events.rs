//! What the backends notice on their own (a worker restarted, a map
//! drifted), recorded as events and volume state.

use std::sync::Arc;

use super::error::Result;
use super::house::House;
use crate::backend::BackendEvent;
use blockplane_api::model;

impl House {
    /// Records one backend event: the volume's attachment and state as the
    /// backend reports them, and the event.
    async fn apply_backend_event(&self, ev: &BackendEvent) -> Result<()> {
        let Some(v) = self.store.volume(&ev.volume_id.to_string()).await? else {
            return Ok(());
        };
        let _volume = self.locks.volumes.lock(&v.name).await;
        let Some(mut v) = self.store.volume(&ev.volume_id.to_string()).await? else {
            return Ok(());
        };
        tracing::info!(volume = %v.name, kind = ev.kind, message = %ev.message, "backend event");
        if let Some(mut att) = ev.attachment.clone() {
            if let Some(old) = &v.attachment {
                att.attached_at = old.attached_at;
                // A switch the backend made itself: as after one asked for.
                if old.dispatch != att.dispatch {
                    super::look::drop_page_cache(&self.store, &v, &att).await;
                }
            }
            v.attachment = Some(att);
        }
        if let Some(state) = ev.state {
            v.state = state;
            v.state_reason = Some(ev.message.clone());
            if state == model::VolumeState::Error {
                v.attachment = None;
            }
        }
        v.updated_at = time::OffsetDateTime::now_utc();
        let mut tx = self.store.begin().await?;
        tx.update_volume(&v).await?;
        tx.event(
            Some(v.id),
            Some(v.image_id),
            ev.kind,
            &format!("volume '{}': {}", v.name, ev.message),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records what backends notice on their own (worker restarts, drift) as
    /// events and volume state, on a thread of its own.
    pub(super) fn record_backend_events(
        self: Arc<Self>,
        rx: std::sync::mpsc::Receiver<BackendEvent>,
    ) {
        let rt = tokio::runtime::Handle::current();
        std::thread::spawn(move || {
            while let Ok(ev) = rx.recv() {
                if let Err(e) = rt.block_on(self.apply_backend_event(&ev)) {
                    tracing::error!(volume = %ev.volume_id, error = %e, "cannot record a backend event");
                }
            }
        });
    }
}
