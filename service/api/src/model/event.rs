//! The event log (`/v1/events`, `/v1/events/stream`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

/// A recorded state change.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Event {
    /// Increasing; usable as a cursor.
    pub id: i64,
    /// When it was recorded.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub at: OffsetDateTime,
    /// The volume it is about, if any.
    pub volume_id: Option<Uuid>,
    /// The image it is about, if any.
    pub image_id: Option<Uuid>,
    /// e.g. `volume_attached`, `dispatch_changed`.
    pub kind: String,
    /// What happened, naming the object and the reason; for people.
    pub message: String,
}

/// Query of `GET /v1/events`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct EventQuery {
    /// Only events of this volume (id or name; a deleted volume's id still works).
    pub volume: Option<String>,
    /// Only events after this time (RFC 3339).
    #[cfg_attr(feature = "openapi", param(format = DateTime))]
    pub since: Option<String>,
    /// Only events of this kind (e.g. `worker_restarted`).
    pub kind: Option<String>,
    /// At most this many, the newest (default 100, at most 1000), oldest first.
    #[cfg_attr(feature = "openapi", param(minimum = 1, maximum = 1000))]
    pub limit: Option<u32>,
}

/// Query of `GET /v1/events/stream`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct EventStreamQuery {
    /// Only events of this volume (id or name).
    pub volume: Option<String>,
    /// Start after this event id (the `Last-Event-ID` header wins).
    pub after: Option<i64>,
}
