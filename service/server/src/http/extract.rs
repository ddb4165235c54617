//! Extractors whose rejections are the API's JSON errors (axum's own answer in
//! plain text).

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::Deserialize;
use serde::de::{DeserializeOwned, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

use super::error::ApiError;
use blockplane_api::model::ErrorCode;

/// A JSON body; malformed JSON, wrong types and unknown fields are 400.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // Parse as a value first: serde would also accept a struct written as
        // a JSON array (`[null, null]`); the API takes objects only.
        let value = match axum::Json::<UniqueKeys>::from_request(req, state).await {
            Ok(axum::Json(UniqueKeys(v))) => v,
            Err(rejection) => return Err(json_rejection(rejection)),
        };
        if !value.is_object() {
            return Err(ApiError::BadRequest {
                status: StatusCode::BAD_REQUEST,
                code: ErrorCode::InvalidBody,
                message: "the request body must be a JSON object".into(),
            });
        }
        // Nor inside it (`"qos": [null, null]`): outside the fields that
        // are lists ([`LISTS`]), an array is always an object written as
        // one.
        if let Some(at) = first_array(&value, String::new()) {
            return Err(ApiError::BadRequest {
                status: StatusCode::BAD_REQUEST,
                code: ErrorCode::InvalidBody,
                message: format!(
                    "the request body holds an array at {at}; the API's bodies hold objects and plain values only"
                ),
            });
        }
        serde_json::from_value(value)
            .map(ApiJson)
            .map_err(|e| ApiError::BadRequest {
                status: StatusCode::BAD_REQUEST,
                code: ErrorCode::InvalidBody,
                message: format!("Failed to deserialize the JSON body into the target type: {e}"),
            })
    }
}

/// The request fields that are lists (of plain values), as JSON pointers:
/// an export's host NQNs, a drain's volumes.
const LISTS: &[&str] = &["/hosts", "/volumes"];

/// Where `v` holds an array, as a JSON pointer below `at`, outside
/// [`LISTS`] (and inside them, an array in the list).
fn first_array(v: &serde_json::Value, at: String) -> Option<String> {
    match v {
        serde_json::Value::Array(items) if LISTS.contains(&at.as_str()) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| first_array(item, format!("{at}/{i}"))),
        serde_json::Value::Array(_) => Some(if at.is_empty() { "/".into() } else { at }),
        serde_json::Value::Object(m) => m
            .iter()
            .find_map(|(k, v)| first_array(v, format!("{at}/{k}"))),
        _ => None,
    }
}

/// A JSON value whose objects repeat no key: `serde_json::Value` would keep
/// the last of `{"name":"a","name":"b"}` silently, and two parsers of the same
/// body could then disagree on what it asked.
struct UniqueKeys(serde_json::Value);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueKeysVisitor).map(UniqueKeys)
    }
}

struct UniqueKeysVisitor;

impl<'de> Visitor<'de> for UniqueKeysVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(integral(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(UniqueKeys(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(items.into())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(A::Error::custom(format!("duplicate key '{key}'")));
            }
            let UniqueKeys(v) = map.next_value()?;
            object.insert(key, v);
        }
        Ok(object.into())
    }
}

/// The largest integer an `f64` holds exactly: 2^53 - 1.
const MAX_EXACT: f64 = 9_007_199_254_740_991.0;

/// A number as the API reads it: JSON has one number type, and `7068.0` or
/// `7.068e3` is the integer 7068 (as JSON Schema says), so an integral value
/// becomes an integer for the integer fields. Beyond 2^53 the digits written
/// may not be the value parsed, so such a number stays a float and an
/// integer field refuses it.
fn integral(v: f64) -> serde_json::Value {
    if v.fract() == 0.0 && v.abs() <= MAX_EXACT {
        if v < 0.0 {
            (v as i64).into()
        } else {
            (v as u64).into()
        }
    } else {
        v.into()
    }
}

fn json_rejection(r: JsonRejection) -> ApiError {
    let (status, code) = match &r {
        JsonRejection::MissingJsonContentType(_) => (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::UnsupportedMediaType,
        ),
        JsonRejection::BytesRejection(_) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            (StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::BodyTooLarge)
        }
        _ => (StatusCode::BAD_REQUEST, ErrorCode::InvalidBody),
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
        code: ErrorCode::InvalidQuery,
        message: r.body_text(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> serde_json::Value {
        serde_json::from_str::<UniqueKeys>(body).unwrap().0
    }

    #[test]
    fn integral_numbers_written_as_floats_are_integers() {
        let v =
            parse(r#"{"a": 7068.0, "b": 7.068e3, "c": -2.0, "d": -0.0, "e": 9007199254740991.0}"#);
        assert_eq!(v["a"].as_u64(), Some(7068));
        assert_eq!(v["b"].as_u64(), Some(7068));
        assert_eq!(v["c"].as_i64(), Some(-2));
        assert_eq!(v["d"].as_u64(), Some(0));
        assert_eq!(v["e"].as_u64(), Some(9_007_199_254_740_991));
        // Fractions stay fractions, and beyond 2^53 a float is not trusted
        // to be the integer written.
        let v = parse(r#"{"a": 7068.5, "b": 9007199254740993.0, "c": 1e300}"#);
        assert!(v["a"].is_f64() && v["b"].is_f64() && v["c"].is_f64(), "{v}");
        #[derive(Deserialize)]
        struct Size {
            size_bytes: u64,
        }
        let s: Size = serde_json::from_value(parse(r#"{"size_bytes": 7068.0}"#)).unwrap();
        assert_eq!(s.size_bytes, 7068);
        assert!(serde_json::from_value::<Size>(parse(r#"{"size_bytes": 1.5}"#)).is_err());
    }
}
