//! `/v1/backup-schedules`: images backed up on a schedule.

use hyper::Method;

use super::client::Client;
use super::error::Error;
use super::path::encode_segment;
use blockplane_api::model::{
    BackupSchedule, CreateBackupScheduleRequest, PatchBackupScheduleRequest,
};

fn schedule_path(schedule: &str) -> String {
    format!("/v1/backup-schedules/{}", encode_segment(schedule))
}

impl Client {
    /// `POST /v1/backup-schedules`.
    pub async fn create_schedule(
        &self,
        req: &CreateBackupScheduleRequest,
    ) -> Result<BackupSchedule, Error> {
        self.send(Method::POST, "/v1/backup-schedules", req).await
    }

    /// `GET /v1/backup-schedules`.
    pub async fn schedules(&self) -> Result<Vec<BackupSchedule>, Error> {
        self.get("/v1/backup-schedules").await
    }

    /// `GET /v1/backup-schedules/{id}`.
    pub async fn schedule(&self, schedule: &str) -> Result<BackupSchedule, Error> {
        self.get(&schedule_path(schedule)).await
    }

    /// `PATCH /v1/backup-schedules/{id}`.
    pub async fn patch_schedule(
        &self,
        schedule: &str,
        req: &PatchBackupScheduleRequest,
    ) -> Result<BackupSchedule, Error> {
        self.send(Method::PATCH, &schedule_path(schedule), req)
            .await
    }

    /// `DELETE /v1/backup-schedules/{id}`.
    pub async fn delete_schedule(&self, schedule: &str) -> Result<(), Error> {
        self.empty(Method::DELETE, &schedule_path(schedule)).await
    }
}
