//! The admin dashboard: plain HTML, CSS and JavaScript modules under
//! `service/server/dashboard/`, embedded in the binary and served at `/` and
//! `/dashboard/*`. The pages hold no data of their own: they are a client of
//! the public API and call it with the user's token, so these files are the
//! only routes that answer without one (see `api::require_token`).

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::IntoResponse;
use axum::routing::get;

/// One embedded file.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    /// The URL path it is served at.
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static [u8],
}

macro_rules! asset {
    ($path:literal, $file:literal, $type:literal) => {
        Asset {
            path: $path,
            content_type: $type,
            body: include_bytes!(concat!("../dashboard/", $file)),
        }
    };
}

/// Every file of the dashboard. Hash routes (`/#/volumes/...`) keep the pages
/// on `/`, so nothing else needs serving.
pub const ASSETS: &[Asset] = &[
    asset!("/", "index.html", "text/html; charset=utf-8"),
    asset!(
        "/dashboard/style.css",
        "style.css",
        "text/css; charset=utf-8"
    ),
    asset!("/dashboard/icon.svg", "icon.svg", "image/svg+xml"),
    asset!(
        "/dashboard/app.js",
        "app.js",
        "text/javascript; charset=utf-8"
    ),
    asset!(
        "/dashboard/api.js",
        "api.js",
        "text/javascript; charset=utf-8"
    ),
    asset!(
        "/dashboard/chart.js",
        "chart.js",
        "text/javascript; charset=utf-8"
    ),
    asset!(
        "/dashboard/format.js",
        "format.js",
        "text/javascript; charset=utf-8"
    ),
    asset!(
        "/dashboard/pages.js",
        "pages.js",
        "text/javascript; charset=utf-8"
    ),
];

/// Whether `path` is one of the dashboard's files.
pub fn is_asset(path: &str) -> bool {
    asset(path).is_some()
}

/// Only this origin's own scripts, styles and API: the page loads nothing from
/// elsewhere, and no other site may frame it.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The embedded file served at `path`, if any.
pub fn asset(path: &str) -> Option<Asset> {
    ASSETS.iter().find(|a| a.path == path).copied()
}

/// One file, with the headers every dashboard file carries.
pub fn serve(a: Asset) -> axum::response::Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(a.content_type),
            ),
            // A new binary serves new files: always revalidate.
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            ),
        ],
        a.body,
    )
        .into_response()
}

/// The routes serving [`ASSETS`] (GET and HEAD).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let mut r = Router::new();
    for a in ASSETS {
        let a = *a;
        r = r.route(a.path, get(move || async move { serve(a) }));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(a: &Asset) -> &'static str {
        std::str::from_utf8(a.body).expect("assets are UTF-8")
    }

    /// Every file the page or a module refers to is served, so a renamed file
    /// fails here rather than in a browser.
    #[test]
    fn every_reference_is_an_asset() {
        for a in ASSETS {
            let t = text(a);
            let mut refs: Vec<&str> = Vec::new();
            for (open, close) in [("src=\"", '"'), ("href=\"", '"'), ("from './", '\'')] {
                let mut rest = t;
                while let Some(i) = rest.find(open) {
                    rest = &rest[i + open.len()..];
                    let end = rest.find(close).expect("closed reference");
                    refs.push(&rest[..end]);
                    rest = &rest[end..];
                }
            }
            for r in refs {
                if r.starts_with('#') || r.is_empty() {
                    continue;
                }
                let path = if r.starts_with('/') {
                    r.to_string()
                } else {
                    format!("/dashboard/{r}")
                };
                assert!(
                    is_asset(&path),
                    "{} refers to {r}, which is not served",
                    a.path
                );
            }
        }
    }

    /// Nothing is fetched from another origin at run time.
    #[test]
    fn no_remote_references() {
        for a in ASSETS {
            let t = text(a);
            for needle in ["http://", "https://", "//cdn", "@import"] {
                let ok = t.match_indices(needle).all(|(i, _)| {
                    // The SVG namespace is a name, not a fetch.
                    t[i..].starts_with("http://www.w3.org/2000/svg")
                });
                assert!(ok, "{} mentions {needle}", a.path);
            }
        }
    }
}
