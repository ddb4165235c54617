//! The host, its orphan devices, the service's health and its metrics.

use hyper::Method;
use uuid::Uuid;

use super::client::Client;
use super::error::Error;
use blockplane_api::model::{Health, Host};

impl Client {
    /// `GET /v1/host`: what this host can run.
    pub async fn host(&self) -> Result<Host, Error> {
        self.get("/v1/host").await
    }

    /// `DELETE /v1/host/orphans/{volume_id}`: removes a device of this
    /// service that belongs to no volume.
    pub async fn delete_orphan(&self, volume_id: Uuid) -> Result<(), Error> {
        self.empty(Method::DELETE, &format!("/v1/host/orphans/{volume_id}"))
            .await
    }

    /// `GET /healthz`.
    pub async fn health(&self) -> Result<Health, Error> {
        self.get("/healthz").await
    }

    /// `GET /metrics`: the Prometheus text exposition.
    pub async fn metrics(&self) -> Result<String, Error> {
        let (_, bytes) = self.exchange(Method::GET, "/metrics", None).await?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}
