//! `/v1/events`: the event log, as a list and as a live stream.

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::{Stream, StreamExt};
use tokio::sync::watch;

use super::AppState;
use super::error::ApiError;
use super::extract::ApiQuery;
use blockplane_api::model::{ErrorBody, Event, EventQuery, EventStreamQuery};

/// Set once the service is stopping: open event streams end at once, so an
/// open dashboard never holds up a shutdown.
#[derive(Debug, Clone)]
pub struct Stopping(pub watch::Receiver<bool>);

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
    Ok(Json(m.events().list(q).await?))
}

/// New events as they happen, as Server-Sent Events (`id` = event id,
/// `event` = kind, `data` = the event as JSON). Resumes after the
/// `Last-Event-ID` header or `after`, else starts with the next event.
#[utoipa::path(
    get, path = "/v1/events/stream", tag = "system",
    params(EventStreamQuery),
    responses(
        (status = 200, description = "A stream of events, in order", content_type = "text/event-stream", body = Event),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 404, description = "No such volume", body = ErrorBody),
    )
)]
pub async fn event_stream(
    State(m): State<AppState>,
    Extension(Stopping(mut stopping)): Extension<Stopping>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventStreamQuery>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let resume = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok());
    let feed = m.events().subscribe(q, resume).await?;
    let stream = futures_util::stream::unfold(feed, |mut feed| async move {
        match feed.next().await {
            Ok(ev) => {
                let sse = SseEvent::default()
                    .id(ev.id.to_string())
                    .event(ev.kind.clone())
                    .data(serde_json::to_string(&ev).expect("events serialize"));
                Some((Ok(sse), feed))
            }
            Err(e) => {
                tracing::warn!(error = %e, "event stream ends");
                None
            }
        }
    });
    let stream = stream.take_until(async move {
        let _ = stopping.wait_for(|s| *s).await;
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
