//! Host, events and health.

use axum::Json;
use axum::extract::State;

use super::AppState;
use super::error::ApiError;
use super::extract::ApiQuery;
use blockplane_api::model::{ErrorBody, Health, Host, MetricsQuery};

/// Liveness, and whether the registry can be written; needs no token.
#[utoipa::path(
    get, path = "/healthz", tag = "system", security(()),
    responses(
        (status = 200, description = "The service answers", body = Health),
        (status = 503, description = "The database cannot be written (e.g. its filesystem is full; code store_unwritable), or too many requests at once (code overloaded)", body = ErrorBody),
    )
)]
pub async fn healthz(State(m): State<AppState>) -> Result<Json<Health>, ApiError> {
    m.check_writable().await?;
    Ok(Json(Health {
        status: "ok".into(),
    }))
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
    super::detached(async move { m.orphans().delete(&id).await }).await?;
    Ok(axum::http::StatusCode::NO_CONTENT)
}

/// Prometheus metrics (text format 0.0.4). A volume's latency histogram
/// carries its `+Inf` bucket, sum and count; its every bucket only with
/// `volume_histograms=true`.
#[utoipa::path(
    get, path = "/metrics", tag = "system",
    params(MetricsQuery),
    responses(
        (status = 200, description = "Metrics in the Prometheus text format", content_type = "text/plain; version=0.0.4", body = String),
        (status = 400, description = "Malformed query", body = ErrorBody),
    )
)]
pub async fn metrics(
    State(m): State<AppState>,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    let text = m.metrics(q.volume_histograms.unwrap_or(false)).await?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}
