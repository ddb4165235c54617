//! `/v1/volumes/{id}/export`, `/v1/exports` and `/v1/remotes`: volumes that
//! leave their host over NVMe/TCP.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use super::error::ApiError;
use super::extract::{ApiJson, ApiQuery};
use super::{AppState, detached};
use crate::manager::Created;
use blockplane_api::model::{
    CreateRemoteRequest, DeleteExportQuery, ErrorBody, Export, ExportHostKeys, ExportMove,
    ExportRequest, PatchRemoteRequest, Remote,
};

/// Export a volume over NVMe/TCP, or change which hosts its export
/// allows. The answer carries each allowed host's keys (`secret`,
/// `ctrl_secret`): give them to that host's `POST /v1/remotes`.
#[utoipa::path(
    put, path = "/v1/volumes/{id}/export", tag = "exports",
    params(("id" = String, Path, description = "Volume id or name")),
    request_body = ExportRequest,
    responses(
        (status = 200, description = "The export, with each host's keys", body = Export),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 422, description = "No export address or NVMe target here (`export_unavailable`), a host NQN outside its rule (`invalid_fabric_name`), or no authentication where it is required (`auth_required`)", body = ErrorBody),
        (status = 500, description = "The kernel's target refused the export (`device_error`)", body = ErrorBody),
    )
)]
pub async fn put_export(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExportRequest>,
) -> Result<Json<Export>, ApiError> {
    Ok(Json(
        detached(async move { m.exports().put(&id, req).await }).await?,
    ))
}

/// Show a volume's export (without keys), with the hosts connected now.
#[utoipa::path(
    get, path = "/v1/volumes/{id}/export", tag = "exports",
    params(("id" = String, Path, description = "Volume id or name")),
    responses(
        (status = 200, description = "The export", body = Export),
        (status = 404, description = "No such volume, or it has no export (`export_not_found`)", body = ErrorBody),
    )
)]
pub async fn get_export(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Export>, ApiError> {
    Ok(Json(m.exports().get(&id).await?))
}

/// Remove a volume's export; refused while a host is connected, or may be
/// (`force=true` removes it anyway, and its hosts' I/O fails).
#[utoipa::path(
    delete, path = "/v1/volumes/{id}/export", tag = "exports",
    params(("id" = String, Path, description = "Volume id or name"), DeleteExportQuery),
    responses(
        (status = 204, description = "The export is gone"),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 404, description = "No such volume, or it has no export (`export_not_found`)", body = ErrorBody),
        (status = 409, description = "A host is connected, or the kernel cannot say that none is (`host_connected`)", body = ErrorBody),
        (status = 422, description = "No NVMe target here (`export_unavailable`)", body = ErrorBody),
    )
)]
pub async fn delete_export(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<DeleteExportQuery>,
) -> Result<StatusCode, ApiError> {
    detached(async move { m.exports().delete(&id, q.force).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Rotate a host's keys, for every export that allows it: the kernel takes
/// them without dropping the host's connections. Give them to the host's
/// remote volumes (`PATCH /v1/remotes/{id}`) before it reconnects.
#[utoipa::path(
    post, path = "/v1/export-hosts/{host_nqn}/rotate", tag = "exports",
    params(("host_nqn" = String, Path, description = "The host's NQN")),
    responses(
        (status = 200, description = "The host's new keys", body = ExportHostKeys),
        (status = 404, description = "No export allows that host (`export_host_not_found`)", body = ErrorBody),
        (status = 422, description = "No NVMe target here (`export_unavailable`)", body = ErrorBody),
    )
)]
pub async fn rotate_host_keys(
    State(m): State<AppState>,
    Path(host_nqn): Path<String>,
) -> Result<Json<ExportHostKeys>, ApiError> {
    Ok(Json(
        detached(async move { m.exports().rotate(&host_nqn).await }).await?,
    ))
}

/// List this service's exports.
#[utoipa::path(
    get, path = "/v1/exports", tag = "exports",
    responses((status = 200, description = "Every export, by NQN", body = Vec<Export>))
)]
pub async fn list_exports(State(m): State<AppState>) -> Result<Json<Vec<Export>>, ApiError> {
    Ok(Json(m.exports().list().await?))
}

/// Connect another host's export: a remote volume. Idempotent by name.
#[utoipa::path(
    post, path = "/v1/remotes", tag = "remotes",
    request_body = CreateRemoteRequest,
    responses(
        (status = 201, description = "Connected; the device exists", body = Remote),
        (status = 200, description = "A remote volume of this name, address and NQN exists already", body = Remote),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 403, description = "The exporting host refused this host: not allowed, or keys that do not match (`remote_refused`)", body = ErrorBody),
        (status = 409, description = "The name is taken by another remote volume (`remote_exists`)", body = ErrorBody),
        (status = 422, description = "An invalid name, address or NQN (`invalid_name`, `invalid_fabric_name`), a key that is not one (`invalid_key`), no NVMe/TCP initiator here (`initiator_unavailable`), or nothing answered at the address or no namespace came (`remote_unreachable`)", body = ErrorBody),
    )
)]
pub async fn create_remote(
    State(m): State<AppState>,
    ApiJson(req): ApiJson<CreateRemoteRequest>,
) -> Result<(StatusCode, Json<Remote>), ApiError> {
    match detached(async move { m.remotes().create(req).await }).await? {
        Created::New(r) => Ok((StatusCode::CREATED, Json(r))),
        Created::Existing(r) => Ok((StatusCode::OK, Json(r))),
    }
}

/// List remote volumes.
#[utoipa::path(
    get, path = "/v1/remotes", tag = "remotes",
    responses((status = 200, description = "All remote volumes, by name", body = Vec<Remote>))
)]
pub async fn list_remotes(State(m): State<AppState>) -> Result<Json<Vec<Remote>>, ApiError> {
    Ok(Json(m.remotes().list().await?))
}

/// Show a remote volume, its state as the kernel says now.
#[utoipa::path(
    get, path = "/v1/remotes/{id}", tag = "remotes",
    params(("id" = String, Path, description = "Remote volume id or name")),
    responses(
        (status = 200, description = "The remote volume", body = Remote),
        (status = 404, description = "No such remote volume (`remote_not_found`)", body = ErrorBody),
    )
)]
pub async fn get_remote(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Remote>, ApiError> {
    Ok(Json(m.remotes().get(&id).await?))
}

/// Change a remote volume live: read-only. Its dispatch and limits are
/// its exporting host's, and refused here (`not_for_remote`).
#[utoipa::path(
    patch, path = "/v1/remotes/{id}", tag = "remotes",
    params(("id" = String, Path, description = "Remote volume id or name")),
    request_body = PatchRemoteRequest,
    responses(
        (status = 200, description = "The changed remote volume", body = Remote),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such remote volume (`remote_not_found`)", body = ErrorBody),
        (status = 422, description = "What only the exporting host changes (`not_for_remote`), or a key that is not one (`invalid_key`)", body = ErrorBody),
    )
)]
pub async fn patch_remote(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PatchRemoteRequest>,
) -> Result<Json<Remote>, ApiError> {
    Ok(Json(
        detached(async move { m.remotes().patch(&id, req).await }).await?,
    ))
}

/// Disconnect a remote volume; refused while its device is open.
#[utoipa::path(
    delete, path = "/v1/remotes/{id}", tag = "remotes",
    params(("id" = String, Path, description = "Remote volume id or name")),
    responses(
        (status = 204, description = "Disconnected; the device is gone"),
        (status = 404, description = "No such remote volume (`remote_not_found`)", body = ErrorBody),
        (status = 409, description = "The device is mounted or held open (`device_busy`)", body = ErrorBody),
    )
)]
pub async fn delete_remote(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    detached(async move { m.remotes().delete(&id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Record what the host moving a volume's data says of the move (that
/// host calls it at each step); shown with the export.
#[utoipa::path(
    put, path = "/v1/volumes/{id}/export/move", tag = "exports",
    params(("id" = String, Path, description = "Volume id or name")),
    request_body = ExportMove,
    responses(
        (status = 200, description = "The export, with the move", body = Export),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such volume, or it has no export (`export_not_found`)", body = ErrorBody),
    )
)]
pub async fn note_export_move(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExportMove>,
) -> Result<Json<Export>, ApiError> {
    Ok(Json(
        detached(async move { m.exports().note_move(&id, req).await }).await?,
    ))
}
