//! `/v1/volumes`: volumes, their live changes, statistics and usage.

use hyper::Method;

use super::client::Client;
use super::error::Error;
use super::path::{encode_segment, with_query};
use blockplane_api::model::{
    CreateVolumeRequest, Handover, PatchVolumeRequest, StatsHistory, StatsHistoryQuery,
    UnlockVolumeRequest, Volume, VolumeStats, VolumeUsage,
};

fn volume_path(volume: &str) -> String {
    format!("/v1/volumes/{}", encode_segment(volume))
}

impl Client {
    /// `GET /v1/volumes`.
    pub async fn volumes(&self) -> Result<Vec<Volume>, Error> {
        self.get("/v1/volumes").await
    }

    /// `GET /v1/volumes/{id}`: the volume of that id or name.
    pub async fn volume(&self, volume: &str) -> Result<Volume, Error> {
        self.get(&volume_path(volume)).await
    }

    /// `POST /v1/volumes`: idempotent by name (the same spec again answers
    /// the existing volume).
    pub async fn create_volume(&self, req: &CreateVolumeRequest) -> Result<Volume, Error> {
        self.send(Method::POST, "/v1/volumes", req).await
    }

    /// `PATCH /v1/volumes/{id}`: live changes.
    pub async fn patch_volume(
        &self,
        volume: &str,
        req: &PatchVolumeRequest,
    ) -> Result<Volume, Error> {
        self.send(Method::PATCH, &volume_path(volume), req).await
    }

    /// `DELETE /v1/volumes/{id}`.
    pub async fn delete_volume(&self, volume: &str) -> Result<(), Error> {
        self.empty(Method::DELETE, &volume_path(volume)).await
    }

    /// `POST /v1/volumes/{id}/unlock`: a `locked` volume's plaintext device
    /// opened again with its image's key.
    pub async fn unlock_volume(
        &self,
        volume: &str,
        req: &UnlockVolumeRequest,
    ) -> Result<Volume, Error> {
        let path = format!("{}/unlock", volume_path(volume));
        self.send(Method::POST, &path, req).await
    }

    /// `POST /v1/volumes/{id}/handover`: a new worker of the service's build
    /// takes the volume's device over.
    pub async fn handover_volume(&self, volume: &str) -> Result<Handover, Error> {
        let path = format!("{}/handover", volume_path(volume));
        self.call(Method::POST, &path, None).await
    }

    /// `GET /v1/volumes/{id}/stats`.
    pub async fn volume_stats(&self, volume: &str) -> Result<VolumeStats, Error> {
        self.get(&format!("{}/stats", volume_path(volume))).await
    }

    /// `GET /v1/volumes/{id}/stats/history`: the volume's last seconds.
    pub async fn volume_history(
        &self,
        volume: &str,
        query: &StatsHistoryQuery,
    ) -> Result<StatsHistory, Error> {
        let path = format!("{}/stats/history", volume_path(volume));
        self.get(&with_query(path, query)).await
    }

    /// `GET /v1/volumes/{id}/usage`: whether the volume is in use, and by what.
    pub async fn volume_usage(&self, volume: &str) -> Result<VolumeUsage, Error> {
        self.get(&format!("{}/usage", volume_path(volume))).await
    }
}
