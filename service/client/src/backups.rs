//! `/v1/backups` and `/v1/images/{id}/backups`: backups off the host.

use hyper::Method;

use super::client::Client;
use super::error::Error;
use super::path::{encode_segment, with_query};
use blockplane_api::model::{
    Backup, BackupGc, BackupPrune, BackupVerify, CreateBackupRequest, ListBackupsQuery,
    PruneBackupsRequest,
};

fn backup_path(backup: &str) -> String {
    format!("/v1/backups/{}", encode_segment(backup))
}

impl Client {
    /// `POST /v1/images/{id}/backups`: starts a backup of the image now.
    pub async fn backup_image(
        &self,
        image: &str,
        req: &CreateBackupRequest,
    ) -> Result<Backup, Error> {
        let path = format!("/v1/images/{}/backups", encode_segment(image));
        self.send(Method::POST, &path, req).await
    }

    /// `GET /v1/backups`.
    pub async fn backups(&self, query: &ListBackupsQuery) -> Result<Vec<Backup>, Error> {
        self.get(&with_query("/v1/backups".into(), query)).await
    }

    /// `GET /v1/backups/{id}`: the backup of that id or name.
    pub async fn backup(&self, backup: &str) -> Result<Backup, Error> {
        self.get(&backup_path(backup)).await
    }

    /// `DELETE /v1/backups/{id}`: deletes a backup, or cancels a running one.
    pub async fn delete_backup(&self, backup: &str) -> Result<(), Error> {
        self.empty(Method::DELETE, &backup_path(backup)).await
    }

    /// `POST /v1/backups/{id}/verify`: checks every chunk of a backup.
    pub async fn verify_backup(&self, backup: &str) -> Result<BackupVerify, Error> {
        let path = format!("{}/verify", backup_path(backup));
        self.call(Method::POST, &path, None).await
    }

    /// `POST /v1/backups/gc`: removes chunks no backup needs.
    pub async fn collect_backups(&self) -> Result<BackupGc, Error> {
        self.call(Method::POST, "/v1/backups/gc", None).await
    }

    /// `POST /v1/images/{id}/backups/prune`: deletes the image's backups the
    /// policy does not keep (none on a dry run).
    pub async fn prune_backups(
        &self,
        image: &str,
        req: &PruneBackupsRequest,
    ) -> Result<BackupPrune, Error> {
        let path = format!("/v1/images/{}/backups/prune", encode_segment(image));
        self.send(Method::POST, &path, req).await
    }
}
