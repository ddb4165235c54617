//! The paths of the API's operations: path segments percent-encoded, query
//! strings from the model's query types.

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Serialize;

/// What stays as it is in a path segment: RFC 3986's unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Percent-encodes one URL path segment (names are `[a-z0-9._-]`, so this is
/// a safeguard rather than a need).
pub fn encode_segment(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// `path` with `query` as its query string (none when every field is absent).
pub(crate) fn with_query<Q: Serialize>(path: String, query: &Q) -> String {
    let qs = serde_urlencoded::to_string(query).expect("the model's queries are flat");
    if qs.is_empty() {
        path
    } else {
        format!("{path}?{qs}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockplane_api::model::EventQuery;

    #[test]
    fn queries_leave_out_absent_fields() {
        let q = EventQuery {
            volume: Some("v 1".into()),
            since: None,
            kind: Some("worker_restarted".into()),
            limit: Some(3),
        };
        assert_eq!(
            with_query("/v1/events".into(), &q),
            "/v1/events?volume=v+1&kind=worker_restarted&limit=3"
        );
        assert_eq!(
            with_query("/v1/events".into(), &EventQuery::default()),
            "/v1/events"
        );
    }
}
