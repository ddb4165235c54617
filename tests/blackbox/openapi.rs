//! The committed OpenAPI document is the generated one (run with UPDATE=1 to
//! rewrite it), and the service serves the same.

use crate::harness::{BIN, Service, openapi_path};

#[tokio::test(flavor = "multi_thread")]
async fn committed_spec_matches_generated_and_served() {
    let out = std::process::Command::new(BIN)
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
