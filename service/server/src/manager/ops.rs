//! Every operation the service offers, as one trait: the API's handlers parse
//! a request and make one call on it, and nothing else of the service's state
//! is theirs to reach (the store, the backends, the sampler stay behind it).
//!
//! It lives with the manager because its answers and refusals are the
//! manager's ([`Error`], [`Created`], [`EventFeed`]): above the manager, it
//! would have to import them back. [`Manager`] implements it; a test can
//! drive the API with any other implementation.
//!
//! Operations that change state, or hand the manager to blocking tasks, take
//! `self: Arc<Self>`; reads take `&self`.

use std::sync::Arc;
use std::time::Duration;

use super::events::EventFeed;
use super::{Created, Manager, Result};
use crate::metrics::ApiLabels;
use blockplane_api::model::{
    AddKeyRequest, Backup, BackupGc, BackupVerify, CreateImageRequest, CreateVolumeRequest,
    DeleteImageQuery, Event, EventQuery, EventStreamQuery, Handover, Host, Image, Key,
    KeySlotAdded, PatchVolumeRequest, RemoveKeyRequest, ResizeImageResponse, StatsHistory,
    StatsHistoryQuery, Volume, VolumeStats, VolumeUsage,
};

/// The service's operations, one per API route (`id` is an id or a name).
#[async_trait::async_trait]
pub trait Operations: Send + Sync {
    /// `POST /v1/images`: registers a file, or creates one.
    async fn create_image(self: Arc<Self>, req: CreateImageRequest) -> Result<Image>;
    /// `GET /v1/images`.
    async fn images(&self) -> Result<Vec<Image>>;
    /// `POST /v1/images/{id}/snapshots`: a read-only image of `id` now.
    async fn snapshot_image(self: Arc<Self>, id: &str, name: &str) -> Result<Image>;
    /// `GET /v1/images?snapshot_of=`: the snapshots of one image.
    async fn snapshots_of(&self, source: &str) -> Result<Vec<Image>>;
    /// `GET /v1/images/{id}`.
    async fn image(&self, id: &str) -> Result<Image>;
    /// `POST /v1/images/{id}/resize`: grows the file, then its volume.
    async fn resize_image(
        self: Arc<Self>,
        id: &str,
        size_bytes: u64,
    ) -> Result<ResizeImageResponse>;
    /// `POST /v1/images/{id}/allocate`: starts filling the image's holes.
    async fn allocate_image(self: Arc<Self>, id: &str) -> Result<Image>;
    /// `DELETE /v1/images/{id}/allocate`: stops a running allocate.
    async fn cancel_allocate(&self, id: &str) -> Result<Image>;
    /// `DELETE /v1/images/{id}`: forgets the image, and its file if asked.
    async fn delete_image(self: Arc<Self>, id: &str, q: DeleteImageQuery) -> Result<()>;
    /// `POST /v1/images/{id}/keys`: a new key slot of an encrypted image.
    async fn add_image_key(self: Arc<Self>, id: &str, req: AddKeyRequest) -> Result<KeySlotAdded>;
    /// `DELETE /v1/images/{id}/keys/{slot}`: a key slot removed.
    async fn remove_image_key(
        self: Arc<Self>,
        id: &str,
        slot: u32,
        req: RemoveKeyRequest,
    ) -> Result<Image>;

    /// `POST /v1/volumes`: idempotent by name and spec.
    async fn create_volume(self: Arc<Self>, req: CreateVolumeRequest) -> Result<Created<Volume>>;
    /// `GET /v1/volumes`, as JSON.
    async fn volumes_json(&self) -> Result<bytes::Bytes>;
    /// `GET /v1/volumes/{id}`.
    async fn volume(&self, id: &str) -> Result<Volume>;
    /// `PATCH /v1/volumes/{id}`: all of it or none of it.
    async fn patch_volume(self: Arc<Self>, id: &str, patch: PatchVolumeRequest) -> Result<Volume>;
    /// `DELETE /v1/volumes/{id}`: returns once the device is gone.
    async fn delete_volume(self: Arc<Self>, id: &str) -> Result<()>;
    /// `POST /v1/volumes/{id}/handover`: a new worker of the service's
    /// build takes the device over.
    async fn handover_volume(self: Arc<Self>, id: &str) -> Result<Handover>;
    /// `POST /v1/volumes/{id}/unlock`: a `locked` volume's plaintext device
    /// opened again with its image's key.
    async fn unlock_volume(self: Arc<Self>, id: &str, key: Key) -> Result<Volume>;
    /// `GET /v1/volumes/{id}/stats`.
    async fn volume_stats(&self, id: &str) -> Result<VolumeStats>;
    /// `GET /v1/volumes/{id}/stats/history`.
    async fn volume_history(&self, id: &str, q: StatsHistoryQuery) -> Result<StatsHistory>;
    /// `GET /v1/volumes/{id}/usage`: whether the volume is in use now.
    async fn volume_usage(&self, id: &str) -> Result<VolumeUsage>;

    /// `POST /v1/images/{id}/backups`: starts a backup of the image now.
    async fn backup_image(self: Arc<Self>, id: &str, name: &str) -> Result<Backup>;
    /// `GET /v1/backups`: the target's backups and this service's running
    /// ones, of one image when `image` is given.
    async fn backups(&self, image: Option<&str>) -> Result<Vec<Backup>>;
    /// `GET /v1/backups/{id}`.
    async fn backup(&self, id: &str) -> Result<Backup>;
    /// `DELETE /v1/backups/{id}`: cancels or deletes a backup.
    async fn delete_backup(self: Arc<Self>, id: &str) -> Result<()>;
    /// `POST /v1/backups/{id}/verify`: checks every chunk of a backup.
    async fn verify_backup(&self, id: &str) -> Result<BackupVerify>;
    /// `POST /v1/backups/gc`: removes chunks no backup needs.
    async fn collect_backups(&self) -> Result<BackupGc>;

    /// `GET /v1/host`: capabilities and orphans.
    async fn host(self: Arc<Self>) -> Result<Host>;
    /// `DELETE /v1/host/orphans/{volume_id}`.
    async fn delete_orphan(&self, volume_id: &str) -> Result<()>;
    /// `GET /healthz`: refused when the registry cannot be written.
    async fn check_writable(&self) -> Result<()>;
    /// `GET /metrics`: the exposition text.
    async fn metrics(&self) -> Result<String>;
    /// Counts one answered API request (for `GET /metrics`).
    fn record_request(&self, labels: ApiLabels, took: Duration);

    /// `GET /v1/events`: a page of history.
    async fn events(&self, q: EventQuery) -> Result<Vec<Event>>;
    /// `GET /v1/events/stream`: replays from `resume` (else `q.after`, else
    /// now), then follows.
    async fn subscribe_events(&self, q: EventStreamQuery, resume: Option<i64>)
    -> Result<EventFeed>;
}

#[async_trait::async_trait]
impl Operations for Manager {
    async fn create_image(self: Arc<Self>, req: CreateImageRequest) -> Result<Image> {
        Manager::create_image(&self, req).await
    }
    async fn images(&self) -> Result<Vec<Image>> {
        Manager::images(self).await
    }
    async fn snapshot_image(self: Arc<Self>, id: &str, name: &str) -> Result<Image> {
        Manager::snapshot_image(&self, id, name).await
    }
    async fn snapshots_of(&self, source: &str) -> Result<Vec<Image>> {
        Manager::snapshots_of(self, source).await
    }
    async fn image(&self, id: &str) -> Result<Image> {
        Manager::image(self, id).await
    }
    async fn resize_image(
        self: Arc<Self>,
        id: &str,
        size_bytes: u64,
    ) -> Result<ResizeImageResponse> {
        Manager::resize_image(&self, id, size_bytes).await
    }
    async fn allocate_image(self: Arc<Self>, id: &str) -> Result<Image> {
        Manager::allocate_image(&self, id).await
    }
    async fn cancel_allocate(&self, id: &str) -> Result<Image> {
        Manager::cancel_allocate(self, id).await
    }
    async fn delete_image(self: Arc<Self>, id: &str, q: DeleteImageQuery) -> Result<()> {
        Manager::delete_image(&self, id, q).await
    }
    async fn add_image_key(self: Arc<Self>, id: &str, req: AddKeyRequest) -> Result<KeySlotAdded> {
        Manager::add_image_key(&self, id, req).await
    }
    async fn remove_image_key(
        self: Arc<Self>,
        id: &str,
        slot: u32,
        req: RemoveKeyRequest,
    ) -> Result<Image> {
        Manager::remove_image_key(&self, id, slot, req).await
    }

    async fn create_volume(self: Arc<Self>, req: CreateVolumeRequest) -> Result<Created<Volume>> {
        Manager::create_volume(&self, req).await
    }
    async fn volumes_json(&self) -> Result<bytes::Bytes> {
        Manager::volumes_json(self).await
    }
    async fn volume(&self, id: &str) -> Result<Volume> {
        Manager::volume(self, id).await
    }
    async fn patch_volume(self: Arc<Self>, id: &str, patch: PatchVolumeRequest) -> Result<Volume> {
        Manager::patch_volume(&self, id, patch).await
    }
    async fn delete_volume(self: Arc<Self>, id: &str) -> Result<()> {
        Manager::delete_volume(&self, id).await
    }
    async fn handover_volume(self: Arc<Self>, id: &str) -> Result<Handover> {
        Manager::handover_volume(&self, id).await
    }
    async fn unlock_volume(self: Arc<Self>, id: &str, key: Key) -> Result<Volume> {
        Manager::unlock_volume(&self, id, key).await
    }
    async fn volume_stats(&self, id: &str) -> Result<VolumeStats> {
        Manager::volume_stats(self, id).await
    }
    async fn volume_history(&self, id: &str, q: StatsHistoryQuery) -> Result<StatsHistory> {
        Manager::volume_history(self, id, q).await
    }
    async fn volume_usage(&self, id: &str) -> Result<VolumeUsage> {
        Manager::volume_usage(self, id).await
    }

    async fn host(self: Arc<Self>) -> Result<Host> {
        Manager::host(&self).await
    }
    async fn delete_orphan(&self, volume_id: &str) -> Result<()> {
        Manager::delete_orphan(self, volume_id).await
    }
    async fn check_writable(&self) -> Result<()> {
        self.reserve.take();
        self.store
            .check_writable()
            .await
            .map_err(super::Error::StoreUnwritable)
    }
    async fn metrics(&self) -> Result<String> {
        Manager::metrics(self).await
    }
    async fn backup_image(self: Arc<Self>, id: &str, name: &str) -> Result<Backup> {
        Manager::backup_image(&self, id, name).await
    }
    async fn backups(&self, image: Option<&str>) -> Result<Vec<Backup>> {
        Manager::backups(self, image).await
    }
    async fn backup(&self, id: &str) -> Result<Backup> {
        Manager::backup(self, id).await
    }
    async fn delete_backup(self: Arc<Self>, id: &str) -> Result<()> {
        Manager::delete_backup(&self, id).await
    }
    async fn verify_backup(&self, id: &str) -> Result<BackupVerify> {
        Manager::verify_backup(self, id).await
    }
    async fn collect_backups(&self) -> Result<BackupGc> {
        Manager::collect_backups(self).await
    }
    fn record_request(&self, labels: ApiLabels, took: Duration) {
        self.api_metrics.record(labels, took);
    }

    async fn events(&self, q: EventQuery) -> Result<Vec<Event>> {
        Manager::events(self, q).await
    }
    async fn subscribe_events(
        &self,
        q: EventStreamQuery,
        resume: Option<i64>,
    ) -> Result<EventFeed> {
        Manager::subscribe_events(self, q, resume).await
    }
}
