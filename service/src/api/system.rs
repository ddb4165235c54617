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
pub async fn host(State(m): State<AppState>) -> Json<Host> {
    Json(
        tokio::task::spawn_blocking(move || m.host())
            .await
            .expect("host probe"),
    )
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
