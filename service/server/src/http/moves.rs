//! `/v1/remotes/{id}/move` and `/v1/moves`: a remote volume's data brought
//! to this host while its consumer keeps its device, or another host's
//! volume that no consumer here uses.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use super::error::ApiError;
use super::extract::ApiJson;
use super::{AppState, detached};
use blockplane_api::model::{
    ColdMoveRequest, Drain, DrainRequest, ErrorBody, Move, PatchDrainRequest, PatchMoveRequest,
    StartMoveRequest,
};

/// Bring a remote volume's data to this host, live: this host orchestrates
/// the move. Its node mirrors the remote device and a new local volume
/// while the kernel copies the one onto the other, then maps the local
/// volume alone; the exporting host is then told (at `source_api`) to let
/// its export and volume go. Follow it at `GET /v1/moves/{id}`.
#[utoipa::path(
    post, path = "/v1/remotes/{id}/move", tag = "moves",
    params(("id" = String, Path, description = "Remote volume id or name")),
    request_body = StartMoveRequest,
    responses(
        (status = 202, description = "The move, copying", body = Move),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such remote volume (`remote_not_found`)", body = ErrorBody),
        (status = 409, description = "The remote volume is not attached, or a move of it runs (`move_refused`); the image name or file is taken (`name_taken`, `file_exists`)", body = ErrorBody),
        (status = 422, description = "A rate limit or export outside its rule (`invalid_move`); an exporting host that does not show the volume (`remote_unreachable`); an encrypted volume without `key` (`key_required`); an image path outside the rules of paths", body = ErrorBody),
    )
)]
pub async fn start_move(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<StartMoveRequest>,
) -> Result<(StatusCode, Json<Move>), ApiError> {
    let started = detached(async move { m.start_move(&id, req).await }).await?;
    Ok((StatusCode::ACCEPTED, Json(started)))
}

/// Bring another host's volume here, cold: no consumer here uses it. This
/// host asks the exporting host (at `source_api`) to export the volume to
/// it, or to allow it on its export, connects a remote volume of its own
/// named after the image, and moves it as a live move does; when the move
/// ends that remote volume goes, and what was done to the export is undone
/// unless the move is `done`. Follow it at `GET /v1/moves/{id}`.
#[utoipa::path(
    post, path = "/v1/moves", tag = "moves",
    request_body = ColdMoveRequest,
    responses(
        (status = 202, description = "The move, copying", body = Move),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 409, description = "The image name or file is taken, or a remote volume has the image's name (`name_taken`, `file_exists`)", body = ErrorBody),
        (status = 422, description = "An exporting host that does not show the volume or will not export it to this host (`remote_unreachable`); an encrypted volume without `key` (`key_required`); a rate limit outside its rule (`invalid_move`); an image path outside the rules of paths", body = ErrorBody),
    )
)]
pub async fn start_cold_move(
    State(m): State<AppState>,
    ApiJson(req): ApiJson<ColdMoveRequest>,
) -> Result<(StatusCode, Json<Move>), ApiError> {
    let started = detached(async move { m.start_cold_move(req).await }).await?;
    Ok((StatusCode::ACCEPTED, Json(started)))
}

/// List moves, newest first.
#[utoipa::path(
    get, path = "/v1/moves", tag = "moves",
    responses((status = 200, description = "Every move this host orchestrated", body = Vec<Move>))
)]
pub async fn list_moves(State(m): State<AppState>) -> Result<Json<Vec<Move>>, ApiError> {
    Ok(Json(m.moves().await?))
}

/// Show a move: its state, bytes copied of total and rate.
#[utoipa::path(
    get, path = "/v1/moves/{id}", tag = "moves",
    params(("id" = String, Path, description = "Move id")),
    responses(
        (status = 200, description = "The move", body = Move),
        (status = 404, description = "No such move (`move_not_found`)", body = ErrorBody),
    )
)]
pub async fn get_move(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Move>, ApiError> {
    Ok(Json(m.get_move(&id).await?))
}

/// Change a copying move's rate limit, live: the copy goes on at it from
/// where it is (the mirror's metadata legs record its progress).
#[utoipa::path(
    patch, path = "/v1/moves/{id}", tag = "moves",
    params(("id" = String, Path, description = "Move id")),
    request_body = PatchMoveRequest,
    responses(
        (status = 200, description = "The move with its new limit", body = Move),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such move (`move_not_found`)", body = ErrorBody),
        (status = 409, description = "The move no longer copies (`move_ended`), or is part of a drain, whose limit it shares (`move_refused`)", body = ErrorBody),
        (status = 422, description = "A rate limit below 1024 bytes/s other than 0 (`invalid_move`)", body = ErrorBody),
    )
)]
pub async fn patch_move(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PatchMoveRequest>,
) -> Result<Json<Move>, ApiError> {
    Ok(Json(
        detached(async move { m.patch_move(&id, req).await }).await?,
    ))
}

/// Cancel a copying move: the node serves the remote device again (which
/// holds every write) and the local image goes.
#[utoipa::path(
    post, path = "/v1/moves/{id}/cancel", tag = "moves",
    params(("id" = String, Path, description = "Move id")),
    responses(
        (status = 200, description = "The cancelled move", body = Move),
        (status = 404, description = "No such move (`move_not_found`)", body = ErrorBody),
        (status = 409, description = "The move has ended, or its node maps the local volume already (`move_ended`)", body = ErrorBody),
    )
)]
pub async fn cancel_move(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Move>, ApiError> {
    Ok(Json(
        detached(async move { m.cancel_move(&id).await }).await?,
    ))
}

/// Bring several of another host's volumes here at once under one rate
/// limit (draining that host): a volume this host has connected moves
/// live, any other cold, each into an image named after it in `dir`. The
/// copying moves share the limit evenly, set again as their number
/// changes. All start, or none.
#[utoipa::path(
    post, path = "/v1/drains", tag = "moves",
    request_body = DrainRequest,
    responses(
        (status = 202, description = "The drain, its moves copying", body = Drain),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 409, description = "A remote volume cannot move now (`move_refused`); an image name or file is taken (`name_taken`, `file_exists`)", body = ErrorBody),
        (status = 422, description = "An exporting host that does not show the volumes (`remote_unreachable`); an encrypted volume (`key_required`); a rate limit outside its rule (`invalid_move`); a path outside the rules of paths", body = ErrorBody),
    )
)]
pub async fn start_drain(
    State(m): State<AppState>,
    ApiJson(req): ApiJson<DrainRequest>,
) -> Result<(StatusCode, Json<Drain>), ApiError> {
    let started = detached(async move { m.start_drain(req).await }).await?;
    Ok((StatusCode::ACCEPTED, Json(started)))
}

/// Show a drain: its limit, its moves and their progress.
#[utoipa::path(
    get, path = "/v1/drains/{id}", tag = "moves",
    params(("id" = String, Path, description = "Drain id")),
    responses(
        (status = 200, description = "The drain", body = Drain),
        (status = 404, description = "No such drain (`drain_not_found`)", body = ErrorBody),
    )
)]
pub async fn get_drain(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Drain>, ApiError> {
    Ok(Json(m.get_drain(&id).await?))
}

/// Change the rate limit a drain's moves share, live: each copying move's
/// share is set at once, and the copies go on from where they are.
#[utoipa::path(
    patch, path = "/v1/drains/{id}", tag = "moves",
    params(("id" = String, Path, description = "Drain id")),
    request_body = PatchDrainRequest,
    responses(
        (status = 200, description = "The drain with its new limit", body = Drain),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such drain (`drain_not_found`)", body = ErrorBody),
        (status = 422, description = "A rate limit below 1024 bytes/s other than 0 (`invalid_move`)", body = ErrorBody),
    )
)]
pub async fn patch_drain(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PatchDrainRequest>,
) -> Result<Json<Drain>, ApiError> {
    Ok(Json(
        detached(async move { m.patch_drain(&id, req).await }).await?,
    ))
}
