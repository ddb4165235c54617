//! TODO

use serde::{Deserialize, Serialize};

/// Every error response: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Stable snake_case identifier, for programs.
    pub code: String,
    /// What was refused and why, naming the object; for people.
    pub message: String,
}
