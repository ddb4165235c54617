//! Extractors whose rejections are the API's JSON errors (axum's own answer in
//! plain text).

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// A JSON body; malformed JSON, wrong types and unknown fields are 400.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // Parse as a value first: serde would also accept a struct written as
        // a JSON array (`[null, null]`); the API takes objects only.
        let value = match axum::Json::<serde_json::Value>::from_request(req, state).await {
            Ok(axum::Json(v)) => v,
            Err(rejection) => return Err(json_rejection(rejection)),
        };
        if !value.is_object() {
            return Err(ApiError::BadRequest {
                status: StatusCode::BAD_REQUEST,
                code: "invalid_body",
                message: "the request body must be a JSON object".into(),
            });
        }
        serde_json::from_value(value)
            .map(ApiJson)
            .map_err(|e| ApiError::BadRequest {
                status: StatusCode::BAD_REQUEST,
                code: "invalid_body",
                message: format!("Failed to deserialize the JSON body into the target type: {e}"),
            })
    }
}

fn json_rejection(r: JsonRejection) -> ApiError {
    let (status, code) = match &r {
        JsonRejection::MissingJsonContentType(_) => {
            (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
        }
        JsonRejection::BytesRejection(_) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
        }
        _ => (StatusCode::BAD_REQUEST, "invalid_body"),
    };
    ApiError::BadRequest {
        status,
        code,
        message: r.body_text(),
    }
}

/// A query string; unknown parameters and wrong types are 400.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(r) => Err(query_rejection(r)),
        }
    }
}

fn query_rejection(r: QueryRejection) -> ApiError {
    ApiError::BadRequest {
        status: StatusCode::BAD_REQUEST,
        code: "invalid_query",
        message: r.body_text(),
    }
}
