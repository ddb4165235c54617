//! `/v1/backup-schedules`: images backed up on a schedule, pruned by a
//! retention policy.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use super::error::ApiError;
use super::extract::ApiJson;
use super::{AppState, detached};
use blockplane_api::model::{
    BackupSchedule, CreateBackupScheduleRequest, ErrorBody, PatchBackupScheduleRequest,
};

/// Back an image up on a schedule: at each time of a cron expression (UTC)
/// plus the schedule's fixed spread, a backup as
/// `POST /v1/images/{id}/backups` makes, named `<schedule>-<UTC time>`;
/// once it is done, the image's backups are pruned by the schedule's
/// retention policy (as `POST /v1/images/{id}/backups/prune`). Runs missed
/// while the service was down run once at its start. A run whose image has
/// a backup running is `skipped`. Events `backup_schedule_started`,
/// `backup_schedule_done`, `backup_schedule_skipped`,
/// `backup_schedule_failed`.
#[utoipa::path(
    post, path = "/v1/backup-schedules", tag = "backups",
    request_body = CreateBackupScheduleRequest,
    responses(
        (status = 201, description = "The schedule, with its next run", body = BackupSchedule),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such image (`image_not_found`)", body = ErrorBody),
        (status = 409, description = "No backup target (`no_backup_target`), or the name is another schedule's (`name_taken`)", body = ErrorBody),
        (status = 422, description = "Not a cron expression, or one that matches no time (`invalid_cron`); a retention policy that keeps nothing (`retention_keeps_nothing`); an invalid name", body = ErrorBody),
    )
)]
pub async fn create_schedule(
    State(m): State<AppState>,
    ApiJson(req): ApiJson<CreateBackupScheduleRequest>,
) -> Result<(StatusCode, Json<BackupSchedule>), ApiError> {
    let s = detached(async move { m.backups().create_schedule(&req).await }).await?;
    Ok((StatusCode::CREATED, Json(s)))
}

/// List the backup schedules, by name, each with its next run, its last
/// run and its last success.
#[utoipa::path(
    get, path = "/v1/backup-schedules", tag = "backups",
    responses((status = 200, description = "The schedules", body = Vec<BackupSchedule>))
)]
pub async fn list_schedules(
    State(m): State<AppState>,
) -> Result<Json<Vec<BackupSchedule>>, ApiError> {
    Ok(Json(m.backups().schedules().await?))
}

/// Show a backup schedule.
#[utoipa::path(
    get, path = "/v1/backup-schedules/{id}", tag = "backups",
    params(("id" = String, Path, description = "Schedule id or name")),
    responses(
        (status = 200, description = "The schedule", body = BackupSchedule),
        (status = 404, description = "No such schedule (`schedule_not_found`)", body = ErrorBody),
    )
)]
pub async fn get_schedule(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<BackupSchedule>, ApiError> {
    Ok(Json(m.backups().schedule(&id).await?))
}

/// Change a backup schedule: its cron expression, its retention policy, or
/// pause and resume it. A new expression, or a resume, runs next at its
/// next time from now (a resumed schedule does not run for what it missed).
#[utoipa::path(
    patch, path = "/v1/backup-schedules/{id}", tag = "backups",
    params(("id" = String, Path, description = "Schedule id or name")),
    request_body = PatchBackupScheduleRequest,
    responses(
        (status = 200, description = "The schedule as it now is", body = BackupSchedule),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such schedule (`schedule_not_found`)", body = ErrorBody),
        (status = 422, description = "Not a cron expression (`invalid_cron`); a retention policy that keeps nothing (`retention_keeps_nothing`)", body = ErrorBody),
    )
)]
pub async fn patch_schedule(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PatchBackupScheduleRequest>,
) -> Result<Json<BackupSchedule>, ApiError> {
    Ok(Json(
        detached(async move { m.backups().patch_schedule(&id, &req).await }).await?,
    ))
}

/// Delete a backup schedule. Its backups stay; a backup of it that runs
/// runs on to its end.
#[utoipa::path(
    delete, path = "/v1/backup-schedules/{id}", tag = "backups",
    params(("id" = String, Path, description = "Schedule id or name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such schedule (`schedule_not_found`)", body = ErrorBody),
    )
)]
pub async fn delete_schedule(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    detached(async move { m.backups().delete_schedule(&id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}
