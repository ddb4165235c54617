//! Host, events and health.

use axum::Json;
use axum::extract::State;

use super::AppState;
use super::error::ApiError;
use super::extract::ApiQuery;
use crate::model::{ErrorBody, Event, EventQuery, Health, Host};

/// Liveness; needs no token.
#[utoipa::path(
    get, path = "/healthz", tag = "system", security(()),
    responses((status = 200, description = "The service answers", body = Health))
)]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

/// What this host can run: kernel, backends and policies, and why not.
#[utoipa::path(
    get, path = "/v1/host", tag = "system",
    responses((status = 200, description = "Host capabilities", body = Host))
)]
pub async fn host(State(m): State<AppState>) -> Result<Json<Host>, ApiError> {
    Ok(Json(m.host().await?))
}

/// Remove an orphan device (one that carries this service's mark but
/// belongs to no volume); orphans are never touched otherwise.
#[utoipa::path(
    delete, path = "/v1/host/orphans/{volume_id}", tag = "system",
    params(("volume_id" = String, Path, description = "The volume id in the orphan's mark, or its device name")),
    responses(
        (status = 204, description = "Removed"),
        (status = 404, description = "No such orphan", body = ErrorBody),
        (status = 409, description = "The device is in use", body = ErrorBody),
    )
)]
pub async fn delete_orphan(
    State(m): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<axum::http::StatusCode, ApiError> {
    super::detached(async move { m.delete_orphan(&id).await }).await?;
    Ok(axum::http::StatusCode::NO_CONTENT)
}

/// The event log: every state change, with time and reason.
#[utoipa::path(
    get, path = "/v1/events", tag = "system",
    params(EventQuery),
    responses(
        (status = 200, description = "Events, oldest first", body = Vec<Event>),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 422, description = "Invalid since or limit", body = ErrorBody),
    )
)]
pub async fn events(
    State(m): State<AppState>,
    ApiQuery(q): ApiQuery<EventQuery>,
) -> Result<Json<Vec<Event>>, ApiError> {
    Ok(Json(m.events(q).await?))
}
