//! `/v1/volumes/{id}/export`, `/v1/exports` and `/v1/remotes`: volumes that
//! leave their host over NVMe/TCP.

use hyper::Method;

use super::client::Client;
use super::error::Error;
use super::path::{encode_segment, with_query};
use blockplane_api::model::{
    CreateRemoteRequest, DeleteExportQuery, Export, ExportHostKeys, ExportMove, ExportRequest,
    PatchRemoteRequest, Remote,
};

fn export_path(volume: &str) -> String {
    format!("/v1/volumes/{}/export", encode_segment(volume))
}

fn remote_path(remote: &str) -> String {
    format!("/v1/remotes/{}", encode_segment(remote))
}

impl Client {
    /// `PUT /v1/volumes/{id}/export`: the export, with each host's keys.
    pub async fn put_export(&self, volume: &str, req: &ExportRequest) -> Result<Export, Error> {
        self.send(Method::PUT, &export_path(volume), req).await
    }

    /// `GET /v1/volumes/{id}/export`.
    pub async fn export(&self, volume: &str) -> Result<Export, Error> {
        self.get(&export_path(volume)).await
    }

    /// `PUT /v1/volumes/{id}/export/move`: what the host moving the
    /// volume's data says of the move.
    pub async fn note_export_move(&self, volume: &str, word: &ExportMove) -> Result<Export, Error> {
        self.send(Method::PUT, &format!("{}/move", export_path(volume)), word)
            .await
    }

    /// `DELETE /v1/volumes/{id}/export`.
    pub async fn delete_export(&self, volume: &str) -> Result<(), Error> {
        self.empty(Method::DELETE, &export_path(volume)).await
    }

    /// `DELETE /v1/volumes/{id}/export` with its query (`force`: removed
    /// even while hosts are, or may be, connected).
    pub async fn delete_export_with(
        &self,
        volume: &str,
        query: &DeleteExportQuery,
    ) -> Result<(), Error> {
        self.empty(Method::DELETE, &with_query(export_path(volume), query))
            .await
    }

    /// `GET /v1/exports`.
    pub async fn exports(&self) -> Result<Vec<Export>, Error> {
        self.get("/v1/exports").await
    }

    /// `POST /v1/export-hosts/{host_nqn}/rotate`: the host's new keys.
    pub async fn rotate_host_keys(&self, host_nqn: &str) -> Result<ExportHostKeys, Error> {
        let path = format!("/v1/export-hosts/{}/rotate", encode_segment(host_nqn));
        self.send(Method::POST, &path, &serde_json::json!({})).await
    }

    /// `POST /v1/remotes`: idempotent by name.
    pub async fn create_remote(&self, req: &CreateRemoteRequest) -> Result<Remote, Error> {
        self.send(Method::POST, "/v1/remotes", req).await
    }

    /// `GET /v1/remotes`.
    pub async fn remotes(&self) -> Result<Vec<Remote>, Error> {
        self.get("/v1/remotes").await
    }

    /// `GET /v1/remotes/{id}`.
    pub async fn remote(&self, remote: &str) -> Result<Remote, Error> {
        self.get(&remote_path(remote)).await
    }

    /// `PATCH /v1/remotes/{id}`.
    pub async fn patch_remote(
        &self,
        remote: &str,
        req: &PatchRemoteRequest,
    ) -> Result<Remote, Error> {
        self.send(Method::PATCH, &remote_path(remote), req).await
    }

    /// `DELETE /v1/remotes/{id}`.
    pub async fn delete_remote(&self, remote: &str) -> Result<(), Error> {
        self.empty(Method::DELETE, &remote_path(remote)).await
    }
}
