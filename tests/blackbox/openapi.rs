//! The committed OpenAPI document is the generated one (run with UPDATE=1 to
//! rewrite it), the service serves the same, and it states the rules the
//! service enforces on a request.

use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::harness::{Service, assert_error, bin, openapi_path};

#[tokio::test(flavor = "multi_thread")]
async fn committed_spec_matches_generated_and_served() {
    let out = std::process::Command::new(bin())
        .arg("openapi")
        .output()
        .unwrap();
    assert!(out.status.success());
    let generated = String::from_utf8(out.stdout).unwrap();
    let path = openapi_path();
    if std::env::var_os("UPDATE").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "openapi/openapi.json differs from the generated document; run `UPDATE=1 cargo test --test blackbox openapi` and commit it"
    );
    let s = Service::start().await;
    let served = s.get("/openapi.json").await;
    assert_eq!(served.status, hyper::StatusCode::OK);
    let committed: serde_json::Value = serde_json::from_str(&committed).unwrap();
    assert_eq!(served.body, committed);
}

/// The schema of a request body's property in the served document.
fn property<'a>(doc: &'a Value, schema: &str, prop: &str) -> &'a Value {
    &doc["components"]["schemas"][schema]["properties"][prop]
}

/// The served document states the rules the service enforces on a request
/// alone (a fuzzer that trusts the document sends nothing refused for a rule
/// it does not state), and the service refuses just past each bound.
#[tokio::test(flavor = "multi_thread")]
async fn served_document_states_the_rules_the_service_enforces() {
    let s = Service::start().await;
    let doc = s.get("/openapi.json").await.body;
    let name = "^[a-z0-9][a-z0-9._-]{0,62}$";
    for schema in ["CreateImageRequest", "CreateVolumeRequest"] {
        let n = property(&doc, schema, "name");
        assert_eq!(n["pattern"], name, "{schema}.name: {n}");
        assert_eq!((&n["minLength"], &n["maxLength"]), (&json!(1), &json!(63)));
    }
    for (schema, prop, min, max) in [
        ("CreateVolumeRequest", "queues", 1u64, 64u64),
        ("CreateVolumeRequest", "queue_depth", 1, 4096),
        ("CreateImageFile", "size_bytes", 512, 1 << 50),
        ("ResizeImageRequest", "size_bytes", 512, 1 << 50),
        ("Qos", "iops", 1, (1 << 53) - 1),
        ("Qos", "bytes_per_sec", 1, (1 << 53) - 1),
        ("Qos", "burst_iops", 1, (1 << 53) - 1),
        ("Qos", "burst_bytes", 1, (1 << 53) - 1),
    ] {
        let p = property(&doc, schema, prop);
        assert_eq!(
            (&p["minimum"], &p["maximum"]),
            (&json!(min), &json!(max)),
            "{schema}.{prop}: {p}"
        );
    }
    for schema in ["CreateImageFile", "ResizeImageRequest"] {
        assert_eq!(property(&doc, schema, "size_bytes")["multipleOf"], 512);
    }
    let powers: Vec<u64> = (12..=20).map(|b| 1 << b).collect();
    assert_eq!(
        property(&doc, "CreateVolumeRequest", "max_io_bytes")["enum"],
        json!(powers)
    );
    let params = doc["paths"]["/v1/events"]["get"]["parameters"]
        .as_array()
        .unwrap();
    let param = |n: &str| &params.iter().find(|p| p["name"] == n).unwrap()["schema"];
    assert_eq!(
        (&param("limit")["minimum"], &param("limit")["maximum"]),
        (&json!(1), &json!(1000))
    );
    assert_eq!(param("since")["format"], "date-time");

    // Each bound is where the service's refusals start.
    for (limit, status) in [(0, 422), (1, 200), (1000, 200), (1001, 422)] {
        let a = s.get(&format!("/v1/events?limit={limit}")).await;
        assert_eq!(a.status.as_u16(), status, "limit={limit}: {}", a.body);
    }
    s.loop_volume("v", 4).await;
    let too_big = json!({"qos": {"iops": 1u64 << 53}});
    assert_error(
        &s.patch("/v1/volumes/v", too_big).await,
        422,
        "invalid_field",
    );
    let a = s
        .post(
            "/v1/volumes",
            json!({"name": "w", "image": "v-img", "backend": "loop", "queues": 65}),
        )
        .await;
    assert_error(&a, 422, "invalid_field");
    let a = s
        .post(
            "/v1/images/v-img/resize",
            json!({"size_bytes": (1u64 << 50) + 512}),
        )
        .await;
    assert_error(&a, 422, "invalid_field");
}

/// JSON has one number type: `8388608.0` is the integer 8388608 (JSON Schema
/// says so too), so an integer field takes it; a fraction is refused.
#[tokio::test(flavor = "multi_thread")]
async fn integral_numbers_written_with_a_fraction_are_integers() {
    let s = Service::start().await;
    let path = s.images.join("f.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "f", "path": path, "create": {"size_bytes": 8388608.0}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(a.body["size_bytes"], 8 << 20);
    let a = s
        .post("/v1/images/f/resize", json!({"size_bytes": 1.6777216e7}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["image"]["size_bytes"], 16 << 20);
    let a = s
        .post(
            "/v1/volumes",
            json!({"name": "v", "image": "f", "backend": "loop", "queues": 1.0, "queue_depth": 128.0, "max_io_bytes": 262144.0}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(
        (&a.body["queue_depth"], &a.body["max_io_bytes"]),
        (&json!(128), &json!(262144))
    );

    // A fraction, or a float past 2^53 (whose digits may not be the value
    // parsed), is not an integer.
    let before = s.snapshot().await;
    for size in [json!(25165824.5), json!(9007199254740993.0)] {
        let a = s
            .post("/v1/images/f/resize", json!({"size_bytes": size}))
            .await;
        assert_error(&a, 400, "invalid_body");
        assert!(
            a.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("floating point"),
            "{}",
            a.body
        );
    }
    assert_eq!(s.snapshot().await, before);
}

/// Every `since` the document allows (a date-time) is answered, even one
/// whose UTC falls outside the years 0000-9999 (it once panicked the handler).
#[tokio::test(flavor = "multi_thread")]
async fn events_since_any_date_time_is_answered() {
    let s = Service::start().await;
    s.image("a", 1).await;
    for since in [
        "9999-12-31T23:59:59-23:59",
        "0000-01-01T00:00:00%2B23:59",
        "2000-01-01T00:00:00Z",
    ] {
        let a = s.get(&format!("/v1/events?since={since}")).await;
        assert_eq!(a.status, StatusCode::OK, "since={since}: {}", a.body);
        let n = a.body.as_array().unwrap().len();
        assert_eq!(
            n,
            usize::from(!since.starts_with("9999")),
            "since={since}: {}",
            a.body
        );
    }
    assert!(!s.log_text().contains("panicked"), "{}", s.log_text());
}

/// Whether `value` matches the schema of `CreateImageRequest.path` in `doc`.
fn path_schema_takes(doc: &Value, value: &str) -> bool {
    let mut schema = property(doc, "CreateImageRequest", "path").clone();
    schema["$schema"] = json!("https://json-schema.org/draft/2020-12/schema");
    jsonschema::validator_for(&schema)
        .expect("the path schema compiles")
        .is_valid(&json!(value))
}

/// An image path's byte limits (names of 255 bytes, paths of 4095) are in
/// its schema: every path the schema takes passes them, so the service
/// accepts it; one the service refuses for its length the schema refuses
/// too. Just inside and just past each bound, in ASCII and in characters of
/// two and four bytes.
#[tokio::test(flavor = "multi_thread")]
async fn the_schema_of_an_image_path_states_its_byte_limits() {
    let s = Service::start().await;
    let doc = s.get("/openapi.json").await.body;
    let root = s.images.display().to_string();
    let mut n = 0;
    let mut create = async |path: &str| {
        n += 1;
        s.post(
            "/v1/images",
            json!({"name": format!("p{n}"), "path": path, "create": {"size_bytes": 4096}}),
        )
        .await
    };
    for name in [
        "a".repeat(251) + ".img",
        "\u{e9}".repeat(63),
        "\u{1f600}".repeat(63),
    ] {
        let path = format!("{root}/{name}");
        assert!(
            path_schema_takes(&doc, &path),
            "{name}: the schema refuses it"
        );
        let a = create(&path).await;
        assert_eq!(a.status, StatusCode::CREATED, "{name}: {}", a.body);
    }
    for (name, code) in [
        ("a".repeat(252) + ".img", "file_name_too_long"),
        ("\u{1f600}".repeat(64), "file_name_too_long"),
        ("\u{e9}".repeat(128), "file_name_too_long"),
    ] {
        let path = format!("{root}/{name}");
        assert!(
            !path_schema_takes(&doc, &path),
            "a name of {} bytes: the schema takes it",
            name.len()
        );
        assert_error(&create(&path).await, 422, code);
    }
    // Paths: 4095 bytes at most.
    let ascii = format!("{root}/{}", vec!["d".repeat(200); 21].join("/"));
    let wide = format!("{root}/{}", vec!["\u{1f600}".repeat(50); 21].join("/"));
    for path in [ascii, wide] {
        assert!(
            !path_schema_takes(&doc, &path),
            "a path of {} bytes: the schema takes it",
            path.len()
        );
        assert_error(&create(&path).await, 422, "path_too_long");
    }
}

/// serde reads a struct from a JSON array too (`"qos": [null, null]` was a
/// QoS of no limits, answered 200): the schema says object, so the service
/// refuses an array anywhere in a body with 400 and changes nothing. No
/// request body of the document holds an array, so none is ever valid.
#[tokio::test(flavor = "multi_thread")]
async fn an_object_written_as_an_array_is_400() {
    let s = Service::start().await;
    let doc = s.get("/openapi.json").await.body;
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in [
        "CreateImageRequest",
        "CreateImageFile",
        "ResizeImageRequest",
        "CreateSnapshotRequest",
        "CreateVolumeRequest",
        "PatchVolumeRequest",
        "Qos",
    ] {
        let text = schemas[name].to_string();
        assert!(!text.contains("\"array\""), "{name} has an array: {text}");
    }
    s.loop_volume("v", 4).await;
    s.image("free", 4).await;
    let path = s.images.join("new.img");
    let before = s.snapshot().await;
    for (method, uri, body) in [
        (Method::PATCH, "/v1/volumes/v", json!({"qos": [null, null]})),
        (
            Method::PATCH,
            "/v1/volumes/v",
            json!({"qos": [5, null, null, null]}),
        ),
        (
            Method::POST,
            "/v1/volumes",
            json!({"name": "w", "image": "free", "qos": [null]}),
        ),
        (
            Method::POST,
            "/v1/images",
            json!({"name": "n", "path": path, "create": [1048576]}),
        ),
        (Method::POST, "/v1/images/free/resize", json!([8388608])),
    ] {
        let a = s.call(method.clone(), uri, Some(body.clone())).await;
        assert_error(&a, 400, "invalid_body");
        assert_eq!(s.snapshot().await, before, "{method} {uri} {body}");
    }
}
