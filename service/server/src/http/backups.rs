//! `/v1/images/{id}/backups` and `/v1/backups`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use super::error::ApiError;
use super::extract::{ApiJson, ApiQuery};
use super::{AppState, detached};
use blockplane_api::model::{
    Backup, BackupGc, BackupPrune, BackupVerify, CreateBackupRequest, ErrorBody, ListBackupsQuery,
    PruneBackupsRequest,
};

/// Back an image up: its bytes at this moment, stored on the service's
/// backup target as content-addressed chunks (only those the target lacks
/// are uploaded; holes and zeros are not stored) and a manifest written
/// last, so an unfinished backup is never listed as `done`.
///
/// The moment: an image no writable volume serves is read as it is, and its
/// writers (a writable volume, a grow, an allocate) are refused until the
/// backup ends (`backup_source_busy`); an image a writable volume serves is
/// put in a hidden file at one moment of the volume's I/O, as a snapshot
/// is (a reflink, or the worker's copy-before-write where the filesystem
/// cannot share extents; a writable loop volume there is refused, 409
/// `volume_attached_snapshot_unsupported` with the remedy). 202 with the
/// backup `running`; `GET /v1/backups/{id}` shows its progress; events
/// `backup_started`, then `backup_done`, `backup_failed` or
/// `backup_cancelled`.
#[utoipa::path(
    post, path = "/v1/images/{id}/backups", tag = "backups",
    params(("id" = String, Path, description = "Image id or name")),
    request_body = CreateBackupRequest,
    responses(
        (status = 202, description = "Backup started (`state` `running`)", body = Backup),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "No backup target (`no_backup_target`), the name is taken among the image's backups (`name_taken`), a backup of it runs (`backup_running`), it is not ready, an allocate or a copy runs on it, or a writable loop volume serves it on a filesystem that cannot share extents (`volume_attached_snapshot_unsupported`)", body = ErrorBody),
        (status = 422, description = "Invalid name", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn backup_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateBackupRequest>,
) -> Result<(StatusCode, Json<Backup>), ApiError> {
    let backup = detached(async move { m.backups().backup_image(&id, &req.name).await }).await?;
    Ok((StatusCode::ACCEPTED, Json(backup)))
}

/// List backups: every backup on the target with a manifest (made by any
/// service pointed at it), and this service's running, failed or cancelled
/// ones since it started; oldest first. A manifest that fails its checksum
/// is left out (the service's log names it; `verify` of it answers 502).
#[utoipa::path(
    get, path = "/v1/backups", tag = "backups",
    params(ListBackupsQuery),
    responses(
        (status = 200, description = "The backups", body = Vec<Backup>),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 409, description = "No backup target (`no_backup_target`)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn list_backups(
    State(m): State<AppState>,
    ApiQuery(q): ApiQuery<ListBackupsQuery>,
) -> Result<Json<Vec<Backup>>, ApiError> {
    Ok(Json(m.backups().list(q.image.as_deref()).await?))
}

/// Show one backup.
#[utoipa::path(
    get, path = "/v1/backups/{id}", tag = "backups",
    params(("id" = String, Path, description = "Backup id, or name when one backup has it")),
    responses(
        (status = 200, description = "The backup", body = Backup),
        (status = 404, description = "No such backup (`backup_not_found`)", body = ErrorBody),
        (status = 409, description = "No backup target, or several backups have that name (`backup_ambiguous`)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn get_backup(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Backup>, ApiError> {
    Ok(Json(m.backups().backup(&id).await?))
}

/// Delete a backup from the target, or cancel a running one (it writes no
/// manifest). A deleted backup's chunks are removed by the garbage
/// collection that follows, unless another backup uses them.
#[utoipa::path(
    delete, path = "/v1/backups/{id}", tag = "backups",
    params(("id" = String, Path, description = "Backup id, or name when one backup has it")),
    responses(
        (status = 204, description = "Deleted, or cancelled (a backup that wrote its manifest before the cancel landed is deleted)"),
        (status = 404, description = "No such backup (`backup_not_found`)", body = ErrorBody),
        (status = 409, description = "No backup target, several backups have that name (`backup_ambiguous`), or a cancelled backup has not stopped yet within a minute (`backup_running`: ask again)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn delete_backup(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    detached(async move { m.backups().delete_backup(&id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Verify a backup without restoring it: every chunk is read back from the
/// target and its BLAKE3 hash checked; missing and corrupt chunks are named.
#[utoipa::path(
    post, path = "/v1/backups/{id}/verify", tag = "backups",
    params(("id" = String, Path, description = "Backup id, or name when one backup has it")),
    responses(
        (status = 200, description = "What was found (`ok` false: a chunk is missing or corrupt)", body = BackupVerify),
        (status = 404, description = "No such backup (`backup_not_found`)", body = ErrorBody),
        (status = 409, description = "No backup target, several backups have that name, or the backup is not done (`backup_not_done`)", body = ErrorBody),
        (status = 502, description = "Its manifest fails its checksum (`backup_corrupt`)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn verify_backup(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<BackupVerify>, ApiError> {
    Ok(Json(
        detached(async move { m.backups().verify_backup(&id).await }).await?,
    ))
}

/// Collect the target's garbage: chunks no manifest references (of deleted,
/// failed or cancelled backups). Safe while backups run, on this service or
/// another: chunks a running backup may reference are kept. One gc runs on
/// a target at a time, whichever service runs it.
#[utoipa::path(
    post, path = "/v1/backups/gc", tag = "backups",
    responses(
        (status = 200, description = "What was removed and kept", body = BackupGc),
        (status = 409, description = "No backup target (`no_backup_target`), or another gc is collecting it (`backup_gc_busy`)", body = ErrorBody),
        (status = 502, description = "A manifest on the target cannot be read, so gc will not guess what it references (`backup_corrupt`)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn collect_backups(State(m): State<AppState>) -> Result<Json<BackupGc>, ApiError> {
    Ok(Json(
        detached(async move { m.backups().collect_backups().await }).await?,
    ))
}

/// Prune an image's backups by a retention policy, as Proxmox Backup
/// Server's prune does: the last N, then the newest backup of each of the
/// last N days, ISO weeks, months and years that have one (UTC); a period
/// an earlier rule kept a backup in is not counted again. Every finished
/// backup no rule keeps is deleted from the target (`backup_deleted` event
/// each), and a gc follows; running backups are left alone. `dry_run` only
/// says what would go. A prune that fails midway has deleted what its
/// events name; asking again finishes it.
#[utoipa::path(
    post, path = "/v1/images/{id}/backups/prune", tag = "backups",
    params(("id" = String, Path, description = "Image id or name (a registered image's, else the name its backups were made of)")),
    request_body = PruneBackupsRequest,
    responses(
        (status = 200, description = "What was kept, with the rule, and deleted (or would be)", body = BackupPrune),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such image, and no backup of one by that name (`image_not_found`)", body = ErrorBody),
        (status = 409, description = "No backup target (`no_backup_target`)", body = ErrorBody),
        (status = 422, description = "Every keep_* is 0: the prune would delete every backup (`retention_keeps_nothing`)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn prune_backups(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PruneBackupsRequest>,
) -> Result<Json<BackupPrune>, ApiError> {
    Ok(Json(
        detached(async move { m.backups().prune_backups(&id, &req).await }).await?,
    ))
}
