//! The HTTP API (axum). Handlers only parse and render: each turns a request
//! into one call on the [`Manager`] and its result into a response. Routes and
//! the OpenAPI document come from the same `#[utoipa::path]` annotations
//! (utoipa-axum), so they cannot drift apart.

pub mod error;
mod events;
mod extract;
mod images;
mod system;
mod volumes;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::manager::{self, Manager};
use error::ApiError;

/// Handlers' state: the controller.
pub type AppState = Arc<Manager>;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "blockplane",
        description = "Image files as fast, safe block devices: loop, ublk and dm volumes with live-switchable dispatch policies.",
        license(name = "Apache-2.0")
    ),
    tags(
        (name = "images", description = "Backing image files"),
        (name = "volumes", description = "Block devices serving images"),
        (name = "system", description = "Host, events, health"),
    ),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(images::create_image, images::list_images))
        .routes(routes!(images::get_image, images::delete_image))
        .routes(routes!(images::resize_image))
        .routes(routes!(volumes::create_volume, volumes::list_volumes))
        .routes(routes!(
            volumes::get_volume,
            volumes::patch_volume,
            volumes::delete_volume
        ))
        .routes(routes!(volumes::volume_stats))
        .routes(routes!(system::host))
        .routes(routes!(system::delete_orphan))
        .routes(routes!(events::events))
        .routes(routes!(events::event_stream))
        .routes(routes!(system::healthz))
        .routes(routes!(system::metrics))
}

/// The routes and their OpenAPI document, with what every operation can answer.
fn split() -> (Router<AppState>, utoipa::openapi::OpenApi) {
    let (router, mut doc) = routes().split_for_parts();
    for item in doc.paths.paths.values_mut() {
        for op in [
            &mut item.get,
            &mut item.post,
            &mut item.patch,
            &mut item.put,
            &mut item.delete,
        ]
        .into_iter()
        .flatten()
        {
            if !op.responses.responses.contains_key("500") {
                let r = utoipa::openapi::ResponseBuilder::new()
                    .description("Internal failure (database, device I/O); the message says what")
                    .content(
                        "application/json",
                        utoipa::openapi::ContentBuilder::new()
                            .schema(Some(utoipa::openapi::Ref::from_schema_name("ErrorBody")))
                            .build(),
                    )
                    .build();
                op.responses.responses.insert("500".into(), r.into());
            }
        }
    }
    (router, doc)
}

/// The OpenAPI document of this API.
pub fn openapi() -> utoipa::openapi::OpenApi {
    split().1
}

/// The OpenAPI document as served and committed (pretty JSON, trailing newline).
pub fn openapi_json() -> String {
    openapi_json_of(&openapi())
}

/// The complete service: API routes, `/openapi.json`, the dashboard's files,
/// JSON fallbacks, auth.
pub fn router(manager: Arc<Manager>, token: Option<String>) -> Router {
    let (api, doc) = split();
    let doc = Arc::new(openapi_json_of(&doc));
    // The dashboard is not part of the API: plain routes, not in the document.
    let api = api.merge(crate::dashboard::routes());
    api.route(
        "/openapi.json",
        axum::routing::get(move || {
            let doc = doc.clone();
            async move { ([(header::CONTENT_TYPE, "application/json")], (*doc).clone()) }
        }),
    )
    .fallback(no_route)
    .method_not_allowed_fallback(no_method)
    .layer(axum::middleware::from_fn_with_state(
        Arc::new(token),
        require_token,
    ))
    .layer(axum::middleware::from_fn_with_state(
        manager.clone(),
        count_request,
    ))
    .layer(tower_http::trace::TraceLayer::new_for_http())
    .with_state(manager)
}

fn openapi_json_of(doc: &utoipa::openapi::OpenApi) -> String {
    let mut s = doc
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    s.push('\n');
    s
}

async fn no_route(req: Request) -> ApiError {
    ApiError::NoRoute {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {} {}", req.method(), req.uri().path()),
    }
}

async fn no_method(req: Request) -> ApiError {
    ApiError::NoRoute {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{} is not allowed on {}", req.method(), req.uri().path()),
    }
}

/// Counts every answered request by route template, method and status.
async fn count_request(State(m): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "(no route)".into());
    let method = req.method().to_string();
    let started = std::time::Instant::now();
    let resp = next.run(req).await;
    m.api_metrics.record(
        crate::metrics::ApiLabels {
            route,
            method,
            status: resp.status().as_u16().to_string(),
        },
        started.elapsed(),
    );
    resp
}

/// With a token configured, every request but `/healthz` and the dashboard's
/// static files must carry it.
async fn require_token(
    State(token): State<Arc<Option<String>>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(expected) = token.as_deref() else {
        return next.run(req).await;
    };
    if req.uri().path() == "/healthz" || is_public_asset(&req) {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Compare in constant time: the comparison must not tell how much matched.
    if bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
        next.run(req).await
    } else {
        ApiError::Unauthorized.into_response()
    }
}

/// A read of one of the dashboard's files. They hold no data, and the page must
/// load before the user has typed the token into its login field; every API
/// call the page then makes carries the token like any other client's.
pub(crate) fn is_public_asset(req: &Request) -> bool {
    matches!(*req.method(), Method::GET | Method::HEAD)
        && crate::dashboard::is_asset(req.uri().path())
}

/// Runs a changing operation on its own task, so a client that hangs up midway
/// cannot leave it half done.
async fn detached<T: Send + 'static>(
    op: impl Future<Output = manager::Result<T>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::spawn(op)
        .await
        .map_err(|e| {
            ApiError::Manager(manager::Error::Internal(format!(
                "operation task failed: {e}"
            )))
        })?
        .map_err(ApiError::from)
}
