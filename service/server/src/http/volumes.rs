//! `/v1/volumes`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use super::error::ApiError;
use super::extract::{ApiJson, ApiQuery};
use super::{AppState, detached};
use crate::manager::Created;
use blockplane_api::model::{
    CreateVolumeRequest, ErrorBody, Handover, PatchVolumeRequest, StatsHistory, StatsHistoryQuery,
    UnlockVolumeRequest, Volume, VolumeStats, VolumeUsage,
};

/// Create a volume: a block device for an image. Idempotent by name.
#[utoipa::path(
    post, path = "/v1/volumes", tag = "volumes",
    request_body = CreateVolumeRequest,
    responses(
        (status = 201, description = "Created; the device exists", body = Volume),
        (status = 200, description = "A volume of this name and spec exists already", body = Volume),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 403, description = "The image's file is no longer acceptable, or no key slot of an encrypted image opens with the key given (`key_rejected`)", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "Same name with another spec, the image is in use, its copy runs or failed (`image_not_ready`), or a copy reads it and the volume is writable (`copy_source_busy`)", body = ErrorBody),
        (status = 422, description = "A backend, policy or setting this host cannot run, an invalid field, a writable volume on a read-only snapshot (`image_read_only`), an encrypted image without a key (`key_required`), a key for a plain one (`not_encrypted`), or no dm-crypt here (`encryption_unavailable`)", body = ErrorBody),
        (status = 500, description = "cryptsetup failed to open the plaintext device (`crypt_failed`)", body = ErrorBody),
    )
)]
pub async fn create_volume(
    State(m): State<AppState>,
    ApiJson(req): ApiJson<CreateVolumeRequest>,
) -> Result<(StatusCode, Json<Volume>), ApiError> {
    match detached(async move { m.volumes().create_volume(req).await }).await? {
        Created::New(v) => Ok((StatusCode::CREATED, Json(v))),
        Created::Existing(v) => Ok((StatusCode::OK, Json(v))),
    }
}

/// List volumes.
#[utoipa::path(
    get, path = "/v1/volumes", tag = "volumes",
    responses((status = 200, description = "All volumes, by name", body = Vec<Volume>))
)]
pub async fn list_volumes(State(m): State<AppState>) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    let json = m.volumes().volumes_json().await?;
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json,
    )
        .into_response())
}

/// Show one volume.
#[utoipa::path(
    get, path = "/v1/volumes/{id}", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name")),
    responses(
        (status = 200, description = "The volume", body = Volume),
        (status = 404, description = "No such volume", body = ErrorBody),
    )
)]
pub async fn get_volume(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(m.volumes().volume(&id).await?))
}

/// Change a volume live: dispatch policy, QoS, read-only.
#[utoipa::path(
    patch, path = "/v1/volumes/{id}", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name")),
    request_body = PatchVolumeRequest,
    responses(
        (status = 200, description = "The changed volume", body = Volume),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 409, description = "The volume has no device to change", body = ErrorBody),
        (status = 422, description = "A field that cannot change live on this backend", body = ErrorBody),
    )
)]
pub async fn patch_volume(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PatchVolumeRequest>,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(
        detached(async move { m.volumes().patch_volume(&id, req).await }).await?,
    ))
}

/// Delete a volume; returns once its device is gone.
#[utoipa::path(
    delete, path = "/v1/volumes/{id}", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name")),
    responses(
        (status = 204, description = "The device is gone"),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 409, description = "The device is mounted or held open", body = ErrorBody),
    )
)]
pub async fn delete_volume(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    detached(async move { m.volumes().delete_volume(&id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A volume's I/O counters.
#[utoipa::path(
    get, path = "/v1/volumes/{id}/stats", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name")),
    responses(
        (status = 200, description = "Counters", body = VolumeStats),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 409, description = "The volume has no device", body = ErrorBody),
    )
)]
pub async fn volume_stats(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<VolumeStats>, ApiError> {
    Ok(Json(m.volumes().volume_stats(&id).await?))
}

/// A volume's last seconds, one point a second, oldest first: rates, mean
/// latency and requests in flight, as charts and `blockplane volume top`
/// show them. The service keeps 15 minutes per attached volume, from attach
/// or its own start.
#[utoipa::path(
    get, path = "/v1/volumes/{id}/stats/history", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name"), StatsHistoryQuery),
    responses(
        (status = 200, description = "The history (empty until two samples exist)", body = StatsHistory),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 422, description = "`seconds` outside 1..=900", body = ErrorBody),
    )
)]
pub async fn volume_history(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<StatsHistoryQuery>,
) -> Result<Json<StatsHistory>, ApiError> {
    Ok(Json(m.volumes().volume_history(&id, q).await?))
}

/// Whether a volume is in use now: processes holding its device open, its
/// mounts, requests in flight and its I/O of the last seconds. Clients ask
/// before a delete (the dashboard then wants the name typed; the CLI wants
/// `--force`); the delete itself refuses only a mounted or exclusively held
/// device.
#[utoipa::path(
    get, path = "/v1/volumes/{id}/usage", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name")),
    responses(
        (status = 200, description = "The volume's use now", body = VolumeUsage),
        (status = 404, description = "No such volume", body = ErrorBody),
    )
)]
pub async fn volume_usage(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<VolumeUsage>, ApiError> {
    Ok(Json(m.volumes().volume_usage(&id).await?))
}

/// Hand a volume over to a new worker of the service's build, live.
///
/// The device and its number stay, no request fails, its
/// policy (and pinned direct map), read-only, QoS, queues and counters go
/// on. With `UBLK_F_QUIESCE` (kernel 6.16+) the kernel quiesces the old
/// worker; otherwise it drains its queues and exits, and the kernel
/// requeues what it held for the new one. ublk volumes, and dm volumes on
/// `nowait`/`threaded` (their private ublk device's worker). `blockplane
/// upgrade` does it for every volume on an older build, one at a time.
#[utoipa::path(
    post, path = "/v1/volumes/{id}/handover", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name")),
    responses(
        (status = 200, description = "Handed over: the volume on its new worker", body = Handover),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 409, description = "The volume has no device (`volume_state`), an allocate (`allocate_conflict`) or a copy (`copy_source_busy`) of its image runs", body = ErrorBody),
        (status = 422, description = "No worker serves the volume (`unsupported`: loop, dm on direct), or its worker refused (`refused`)", body = ErrorBody),
        (status = 500, description = "The handover failed after the old worker let go: the device is served by a restarted worker (the message and a `worker_handover_failed` event say which)", body = ErrorBody),
    )
)]
pub async fn handover_volume(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Handover>, ApiError> {
    Ok(Json(
        detached(async move { m.volumes().handover_volume(&id).await }).await?,
    ))
}

/// Unlock a `locked` volume: open its plaintext device again with its
/// image's key (after the host restarted, the kernel holds no key).
///
/// On a volume that serves its plaintext already, the key is checked and
/// nothing else is done. The key is never stored.
#[utoipa::path(
    post, path = "/v1/volumes/{id}/unlock", tag = "volumes",
    params(("id" = String, Path, description = "Volume id or name")),
    request_body = UnlockVolumeRequest,
    responses(
        (status = 200, description = "Its plaintext device serves", body = Volume),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 403, description = "No key slot of its image opens with the key (`key_rejected`), or its image's file is no longer acceptable", body = ErrorBody),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 409, description = "Its device does not serve (`volume_state`: delete and create it again with the key)", body = ErrorBody),
        (status = 422, description = "A plain volume (`not_encrypted`), an invalid key, or no dm-crypt here (`encryption_unavailable`)", body = ErrorBody),
        (status = 500, description = "cryptsetup failed to open the plaintext device (`crypt_failed`)", body = ErrorBody),
    )
)]
pub async fn unlock_volume(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<UnlockVolumeRequest>,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(
        detached(async move { m.volumes().unlock_volume(&id, req.key).await }).await?,
    ))
}
