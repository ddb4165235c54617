//! The HTTP API (axum). Handlers only parse and render: each turns a request
//! into one call on the [`Manager`] and its result into a
//! response. Routes and the OpenAPI document come from the same
//! `#[utoipa::path]` annotations (utoipa-axum), so they cannot drift apart.

mod backups;
pub mod error;
mod events;
mod exports;
mod extract;
mod images;
mod moves;
mod schedules;
mod system;
mod volumes;
pub mod wire;

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

use blockplane_api::model::ErrorCode;

use crate::config::Limits;
use crate::manager::{self, Manager};
use error::ApiError;

/// Handlers' state: the manager, whose `pub(crate)` operations are the
/// API's, one per route. No trait stands between them: one implementation
/// and no test that swaps it, so the list would be written twice for
/// nothing (the router is where the operations are composed).
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
        (name = "backups", description = "Images backed up off the host, and restored"),
        (name = "exports", description = "Volumes served to other hosts over NVMe/TCP"),
        (name = "remotes", description = "Other hosts' exports, connected here"),
        (name = "moves", description = "Remote volumes' data brought to this host, live"),
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

/// States in `CreateImageRequest`'s schema the rules between its fields
/// that utoipa's derive cannot: a top-level `allocation` is declared only
/// when registering, so it never comes with a `create`, a `clone_from` or a
/// `restore_from`; a `restore_from` makes the file from its backup alone, so
/// it never comes with a `create` or a `clone_from`; `create.encryption` is for a new file, never a clone (which keeps its
/// source's header); and an encrypted file holds its LUKS2 header before its
/// data, so its `create.size_bytes` is at least header + 1 MiB (`null` is
/// absent, as serde reads it). Without them a client, or the fuzzer, sends a
/// schema-valid request that is refused by a rule it could not see.
/// The object schema `name` of the document's components.
fn object_schema<'a>(
    openapi: &'a mut utoipa::openapi::OpenApi,
    name: &str,
) -> &'a mut utoipa::openapi::schema::Object {
    use utoipa::openapi::{RefOr, Schema};
    let schemas = openapi
        .components
        .as_mut()
        .map(|c| &mut c.schemas)
        .expect("the document has components");
    let Some(RefOr::T(Schema::Object(s))) = schemas.get_mut(name) else {
        panic!("{name} is an object schema in the document");
    };
    s
}

/// The rules of exports and remote volumes on the request alone that a
/// field's own schema cannot say: an export's hosts are NQNs; it names at
/// least one with DH-HMAC-CHAP, and none (with `insecure_loopback`) without
/// authentication; a read-only export is refused (the kernel's target
/// cannot serve one); a remote volume's dispatch and QoS are its exporting
/// host's, refused when given.
struct FabricRules;

/// Adds `rules`, a list of schemas, to schema `name`'s `allOf`. Every
/// rule of a schema goes there, under one key: the extensions are a hash
/// map, so two keys would serialize in either order and the committed
/// document would change from build to build.
fn add_all_of(openapi: &mut utoipa::openapi::OpenApi, name: &str, rules: serde_json::Value) {
    let serde_json::Value::Array(rules) = rules else {
        panic!("{name}: rules are a list");
    };
    let all = object_schema(openapi, name)
        .extensions
        .get_or_insert_with(Default::default)
        .entry("allOf".to_string())
        .or_insert_with(|| serde_json::json!([]));
    all.as_array_mut().expect("allOf is a list").extend(rules);
}

impl Modify for FabricRules {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let mut add = |name: &str, rules| add_all_of(openapi, name, rules);
        add(
            "ExportRequest",
            serde_json::json!([
                {"properties": {
                    "hosts": {"items": {
                        "pattern": blockplane_api::model::NQN_PATTERN,
                        "maxLength": 223,
                    }},
                    "read_only": {"enum": [false]},
                }},
                {"anyOf": [
                    {"required": ["hosts"], "properties": {
                        "auth": {"enum": ["dhchap"]},
                        "hosts": {"minItems": 1},
                    }},
                    {"required": ["auth", "insecure_loopback"], "properties": {
                        "auth": {"enum": ["none"]},
                        "hosts": {"maxItems": 0},
                        "insecure_loopback": {"enum": [true]},
                    }},
                ]},
            ]),
        );
        add(
            "PatchRemoteRequest",
            serde_json::json!([{"properties": {"dispatch": {"type": "null"}, "qos": {"type": "null"}}}]),
        );
    }
}

/// The rules of labels (`blockplane_api::model::labels`) where requests
/// carry them: an image's at its create (at most 32), a patch's (a value,
/// or `null` to remove), and a schedule's selector, which names its images
/// instead of `image` (one of the two, and at least one label).
struct LabelRules;

impl Modify for LabelRules {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use blockplane_api::model::{LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, MAX_LABELS};
        let labels = |extra: serde_json::Value| {
            let mut l = serde_json::json!({
                "propertyNames": {"pattern": LABEL_KEY_PATTERN, "maxLength": 63},
                "additionalProperties": {"pattern": LABEL_VALUE_PATTERN, "maxLength": 63},
            });
            l.as_object_mut()
                .expect("an object")
                .extend(extra.as_object().expect("an object").clone());
            l
        };
        let mut add = |name: &str, rules| add_all_of(openapi, name, rules);
        add(
            "CreateImageRequest",
            serde_json::json!([{"properties": {
                "labels": labels(serde_json::json!({"maxProperties": MAX_LABELS})),
            }}]),
        );
        add(
            "PatchImageRequest",
            serde_json::json!([{"properties": {"labels": labels(serde_json::json!({}))}}]),
        );
        add(
            "CreateBackupScheduleRequest",
            serde_json::json!([
                {"properties": {
                    "selector": labels(serde_json::json!({"maxProperties": MAX_LABELS})),
                }},
                {"anyOf": [
                    {"required": ["image"], "properties": {
                        "image": {"type": "string"},
                        "selector": {"type": "null"},
                    }},
                    {"required": ["selector"], "properties": {
                        "image": {"type": "null"},
                        "selector": {"type": "object", "minProperties": 1},
                    }},
                ]},
            ]),
        );
    }
}

struct CrossFieldRules;

impl Modify for CrossFieldRules {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let both = |other: &str, kind: &str| {
            serde_json::json!({
                "required": ["allocation", other],
                "properties": {
                    "allocation": {"type": "string"},
                    other: {"type": kind},
                },
            })
        };
        let encrypted_create = |size: serde_json::Value| {
            serde_json::json!({
                "type": "object",
                "required": ["encryption"],
                "properties": {"encryption": {"type": "object"}, "size_bytes": size},
            })
        };
        let encrypted_clone = serde_json::json!({
            "required": ["clone_from", "create"],
            "properties": {
                "clone_from": {"type": "string"},
                "create": encrypted_create(serde_json::json!({})),
            },
        });
        let encrypted_too_small = serde_json::json!({
            "required": ["create"],
            "properties": {
                "create": encrypted_create(
                    serde_json::json!({"exclusiveMaximum": crate::manager::encryption::MIN_ENCRYPTED_BYTES})
                ),
            },
        });
        // A restore makes its file from the backup alone, and a standby
        // from its source's newest backup alone.
        let with = |from: &str, other: &str, kind: &str| {
            serde_json::json!({
                "required": [from, other],
                "properties": {
                    from: {"type": "string"},
                    other: {"type": kind},
                },
            })
        };
        let restore_with = |other: &str, kind: &str| with("restore_from", other, kind);
        let standby_with = |other: &str, kind: &str| with("standby_of", other, kind);
        add_all_of(
            openapi,
            "CreateImageRequest",
            serde_json::json!([{"not": {"anyOf": [
                both("create", "object"),
                both("clone_from", "string"),
                both("restore_from", "string"),
                encrypted_clone,
                encrypted_too_small,
                restore_with("create", "object"),
                restore_with("clone_from", "string"),
                standby_with("create", "object"),
                standby_with("clone_from", "string"),
                standby_with("restore_from", "string"),
                standby_with("allocation", "string"),
            ]}}]),
        );
        // A retention policy keeps something: one keep_* count above 0.
        let keeps = [
            "keep_last",
            "keep_daily",
            "keep_weekly",
            "keep_monthly",
            "keep_yearly",
        ]
        .map(|k| serde_json::json!({"required": [k], "properties": {k: {"minimum": 1}}}));
        object_schema(openapi, "RetentionPolicy")
            .extensions
            .get_or_insert_with(Default::default)
            .insert("anyOf".to_string(), serde_json::json!(keeps));
    }
}

fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(images::create_image, images::list_images))
        .routes(routes!(
            images::get_image,
            images::patch_image,
            images::delete_image
        ))
        .routes(routes!(images::resize_image))
        .routes(routes!(images::allocate_image, images::cancel_allocate))
        .routes(routes!(images::check_standby))
        .routes(routes!(images::activate_image))
        .routes(routes!(images::snapshot_image))
        .routes(routes!(images::image_allocated))
        .routes(routes!(images::image_changes))
        .routes(routes!(images::add_image_key))
        .routes(routes!(images::remove_image_key))
        .routes(routes!(backups::backup_image))
        .routes(routes!(backups::list_backups))
        .routes(routes!(backups::get_backup, backups::delete_backup))
        .routes(routes!(backups::verify_backup))
        .routes(routes!(backups::collect_backups))
        .routes(routes!(backups::prune_backups))
        .routes(routes!(
            schedules::create_schedule,
            schedules::list_schedules
        ))
        .routes(routes!(
            schedules::get_schedule,
            schedules::patch_schedule,
            schedules::delete_schedule
        ))
        .routes(routes!(volumes::create_volume, volumes::list_volumes))
        .routes(routes!(
            volumes::get_volume,
            volumes::patch_volume,
            volumes::delete_volume
        ))
        .routes(routes!(volumes::volume_stats))
        .routes(routes!(volumes::volume_history))
        .routes(routes!(volumes::volume_usage))
        .routes(routes!(volumes::handover_volume))
        .routes(routes!(volumes::unlock_volume))
        .routes(routes!(
            exports::put_export,
            exports::get_export,
            exports::delete_export
        ))
        .routes(routes!(exports::note_export_move))
        .routes(routes!(exports::list_exports))
        .routes(routes!(exports::rotate_host_keys))
        .routes(routes!(exports::create_remote, exports::list_remotes))
        .routes(routes!(
            exports::get_remote,
            exports::patch_remote,
            exports::delete_remote
        ))
        .routes(routes!(moves::start_move))
        .routes(routes!(moves::list_moves, moves::start_cold_move))
        .routes(routes!(moves::get_move, moves::patch_move))
        .routes(routes!(moves::cancel_move))
        .routes(routes!(moves::start_drain))
        .routes(routes!(moves::get_drain, moves::patch_drain))
        .routes(routes!(system::host))
        .routes(routes!(system::delete_orphan))
        .routes(routes!(events::events))
        .routes(routes!(events::event_stream))
        .routes(routes!(system::healthz))
        .routes(routes!(system::metrics))
}

/// The routes and their OpenAPI document, with what every operation can
/// answer whatever its handler: auth, limits and internal failures.
fn split() -> (Router<AppState>, utoipa::openapi::OpenApi) {
    let (router, mut doc) = routes().split_for_parts();
    // After the routes: their schemas are in the document only now.
    CrossFieldRules.modify(&mut doc);
    FabricRules.modify(&mut doc);
    LabelRules.modify(&mut doc);
    for (path, item) in doc.paths.paths.iter_mut() {
        for (writes, op) in [
            (false, &mut item.get),
            (true, &mut item.post),
            (true, &mut item.patch),
            (true, &mut item.put),
            (true, &mut item.delete),
        ]
        .into_iter()
        .filter_map(|(w, op)| op.as_mut().map(|op| (w, op)))
        {
            let mut common = vec![
                (
                    "408",
                    "No answer within the request timeout (a started operation still completes), or a body that arrived below the minimum rate",
                ),
                (
                    "500",
                    "Internal failure (database, device I/O); the message says what",
                ),
                (
                    "503",
                    "Too many requests or event streams at once; retry shortly",
                ),
            ];
            if writes {
                common.push((
                    "507",
                    "The data dir's filesystem is full: the registry could not record the change; retry when there is space",
                ));
            }
            if path != "/healthz" {
                common.push((
                    "401",
                    "Missing or wrong bearer token (when the service has one)",
                ));
            }
            if op.request_body.is_some() {
                common.push(("413", "The body is larger than the service accepts"));
                common.push(("415", "The body is not declared as application/json"));
            }
            for (status, description) in common {
                if !op.responses.responses.contains_key(status) {
                    let r = utoipa::openapi::ResponseBuilder::new()
                        .description(description)
                        .content(
                            "application/json",
                            utoipa::openapi::ContentBuilder::new()
                                .schema(Some(utoipa::openapi::Ref::from_schema_name("ErrorBody")))
                                .build(),
                        )
                        .build();
                    op.responses.responses.insert(status.into(), r.into());
                }
            }
        }
    }
    add_links(&mut doc);
    (router, doc)
}

/// OpenAPI links from the answers that give an image's or a volume's id (its
/// create, and the first of its list) to every operation on it, and from an
/// image's create to a loop volume on it: a client, or a fuzzer's stateful
/// phase, can follow them to ids that exist.
fn add_links(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::link::LinkBuilder;
    let ops_under = |doc: &utoipa::openapi::OpenApi, prefix: &str| -> Vec<String> {
        doc.paths
            .paths
            .iter()
            .filter(|(path, _)| path.starts_with(prefix))
            .flat_map(|(_, item)| {
                [&item.get, &item.post, &item.patch, &item.put, &item.delete]
                    .into_iter()
                    .flatten()
                    .filter_map(|op| op.operation_id.clone())
            })
            .collect()
    };
    for collection in ["/v1/images", "/v1/volumes"] {
        let targets = ops_under(doc, &format!("{collection}/{{id}}"));
        let Some(item) = doc.paths.paths.get_mut(collection) else {
            continue;
        };
        for (post, status, id) in [
            (true, "201", "$response.body#/id"),
            (true, "202", "$response.body#/id"),
            (false, "200", "$response.body#/0/id"),
        ] {
            let op = if post { &mut item.post } else { &mut item.get };
            let Some(RefOr::T(resp)) = op
                .as_mut()
                .and_then(|o| o.responses.responses.get_mut(status))
            else {
                continue;
            };
            for target in &targets {
                resp.links.insert(
                    target.clone(),
                    RefOr::T(
                        LinkBuilder::new()
                            .operation_id(target.clone())
                            .parameter("id", id)
                            .build(),
                    ),
                );
            }
        }
    }
    if let Some(RefOr::T(resp)) = doc
        .paths
        .paths
        .get_mut("/v1/images")
        .and_then(|i| i.post.as_mut())
        .and_then(|o| o.responses.responses.get_mut("201"))
    {
        resp.links.insert(
            "create_volume".into(),
            RefOr::T(
                LinkBuilder::new()
                    .operation_id("create_volume")
                    .request_body(Some(serde_json::json!({
                        "name": "linked",
                        "image": "$response.body#/id",
                        "backend": "loop"
                    })))
                    .description("A loop volume on the new image")
                    .build(),
            ),
        );
    }
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
/// JSON fallbacks, auth and limits. `stopping` turns true when the service
/// begins to stop.
pub fn router(
    ops: AppState,
    token: Option<String>,
    limits: Limits,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> Router {
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
    .layer(axum::middleware::from_fn(json_errors))
    .layer(axum::Extension(events::Stopping(stopping)))
    .layer(axum::extract::DefaultBodyLimit::max(limits.max_body_bytes))
    .layer(axum::middleware::from_fn_with_state(
        Arc::new(Admission::new(limits)),
        admit,
    ))
    // Before admission, which reads the body: a client without the token
    // gets nothing read.
    .layer(axum::middleware::from_fn_with_state(
        Arc::new(token),
        require_token,
    ))
    .layer(axum::middleware::from_fn_with_state(
        ops.clone(),
        count_request,
    ))
    .layer(tower_http::trace::TraceLayer::new_for_http())
    .with_state(ops)
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

/// Gives error answers made outside the API's handlers (axum's own
/// rejections, such as a path segment that is not UTF-8) the JSON error shape.
async fn json_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let text = axum::body::to_bytes(resp.into_body(), 64 << 10)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    ApiError::BadRequest {
        status,
        code: wire::code_of(status),
        message: if text.is_empty() {
            wire::message_of(status)
        } else {
            text
        },
    }
    .into_response()
}

/// How many requests and event streams may run at once, and for how long.
struct Admission {
    requests: Arc<tokio::sync::Semaphore>,
    streams: Arc<tokio::sync::Semaphore>,
    timeout: std::time::Duration,
    /// How long a request body may take before the minimum rate applies.
    body_grace: std::time::Duration,
    /// The largest body read.
    max_body_bytes: usize,
}

impl Admission {
    fn new(limits: Limits) -> Self {
        Self {
            requests: Arc::new(tokio::sync::Semaphore::new(limits.max_concurrent_requests)),
            streams: Arc::new(tokio::sync::Semaphore::new(limits.max_event_streams)),
            timeout: limits.request_timeout,
            body_grace: limits.header_timeout,
            max_body_bytes: limits.max_body_bytes,
        }
    }
}

/// Reads a request's whole body, which must arrive at the minimum rate
/// after its grace period (408 `body_timeout`) and be at most
/// `max_body_bytes` (413).
async fn read_body(a: &Admission, body: axum::body::Body) -> Result<axum::body::Bytes, ApiError> {
    use http_body_util::BodyExt;
    let timed_out = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let body = MinRateBody::new(body, a.body_grace, timed_out.clone());
    match http_body_util::Limited::new(body, a.max_body_bytes)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(_) if timed_out.load(std::sync::atomic::Ordering::Relaxed) => {
            Err(ApiError::BadRequest {
                status: StatusCode::REQUEST_TIMEOUT,
                code: ErrorCode::BodyTimeout,
                message: format!(
                    "the request body arrived slower than {MIN_BODY_BYTES_PER_SEC} bytes/s after the first {} s; nothing was done",
                    a.body_grace.as_secs()
                ),
            })
        }
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::BadRequest {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            code: ErrorCode::BodyTooLarge,
            message: format!(
                "the request body is larger than {} bytes (--max-body-bytes)",
                a.max_body_bytes
            ),
        }),
        Err(e) => Err(ApiError::BadRequest {
            status: StatusCode::BAD_REQUEST,
            code: ErrorCode::InvalidBody,
            message: format!("the request body could not be read: {e}"),
        }),
    }
}

/// Sheds load at once (503) past the concurrency limits, and answers 408
/// when a request runs past the request timeout or its body trickles in
/// below the minimum rate. A request's body is read whole before it is
/// counted: a client still sending its body holds its connection, not a
/// place meant for requests being served. `/healthz` is never counted nor
/// shed. Event streams are long by nature: they count against their own
/// limit and have no timeout. A timed out request's operation still
/// finishes (operations run detached).
async fn admit(State(a): State<Arc<Admission>>, req: Request, next: Next) -> Response {
    let overloaded = |what: &str| {
        ApiError::BadRequest {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: ErrorCode::Overloaded,
            message: format!("too many {what} at once; retry shortly"),
        }
        .into_response()
    };
    if req.uri().path() == "/v1/events/stream" {
        let Ok(permit) = a.streams.clone().try_acquire_owned() else {
            return overloaded("event streams");
        };
        // The permit lives as long as the stream's body.
        let (parts, body) = next.run(req).await.into_parts();
        let body = axum::body::Body::new(PermitBody {
            inner: body,
            _permit: permit,
        });
        return Response::from_parts(parts, body);
    }
    // Liveness must answer however busy the API is.
    if req.uri().path() == "/healthz" {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let body = match read_body(&a, body).await {
        Ok(body) => body,
        Err(refused) => return refused.into_response(),
    };
    let Ok(_permit) = a.requests.clone().try_acquire_owned() else {
        return overloaded("requests");
    };
    let req = Request::from_parts(parts, axum::body::Body::from(body));
    match tokio::time::timeout(a.timeout, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => ApiError::BadRequest {
            status: StatusCode::REQUEST_TIMEOUT,
            code: ErrorCode::RequestTimeout,
            message: format!(
                "no answer within {} s; an operation started by this request still completes (see GET /v1/events)",
                a.timeout.as_secs()
            ),
        }
        .into_response(),
    }
}

/// The slowest a request body may arrive, after its grace period.
pub const MIN_BODY_BYTES_PER_SEC: u64 = 1024;

/// A request body that fails once it falls behind a minimum rate: all of it
/// must have arrived by `grace + received / MIN_BODY_BYTES_PER_SEC` after the
/// first poll, so a client trickling bytes cannot hold its connection for
/// the whole request timeout.
struct MinRateBody {
    inner: axum::body::Body,
    started: tokio::time::Instant,
    grace: std::time::Duration,
    received: u64,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    timed_out: Arc<std::sync::atomic::AtomicBool>,
}

/// Why a [`MinRateBody`] failed.
#[derive(Debug, thiserror::Error)]
#[error("request body arrived below {MIN_BODY_BYTES_PER_SEC} bytes/s")]
struct BodyTooSlow;

impl MinRateBody {
    fn new(
        inner: axum::body::Body,
        grace: std::time::Duration,
        timed_out: Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        let started = tokio::time::Instant::now();
        Self {
            inner,
            started,
            grace,
            received: 0,
            deadline: Box::pin(tokio::time::sleep_until(started + grace)),
            timed_out,
        }
    }
}

impl http_body::Body for MinRateBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received += data.len() as u64;
                    let allowed = this.grace
                        + std::time::Duration::from_millis(
                            this.received * 1000 / MIN_BODY_BYTES_PER_SEC,
                        );
                    this.deadline.as_mut().reset(this.started + allowed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.timed_out
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    Poll::Ready(Some(Err(axum::Error::new(BodyTooSlow))))
                }
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that holds an admission permit until it is dropped.
struct PermitBody {
    inner: axum::body::Body,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl http_body::Body for PermitBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
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
    m.record_request(
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
        .and_then(bearer_credentials)
        .unwrap_or("");
    // Compare in constant time: the comparison must not tell how much matched.
    if bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
        next.run(req).await
    } else {
        ApiError::Unauthorized.into_response()
    }
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is
/// matched in any case and may be followed by several spaces (RFC 7235).
fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
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
