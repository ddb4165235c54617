//! Exports and remote volumes, as far as this host can check them: it has
//! no NVMe target, so every refusal must name what is missing and change
//! nothing. The kernel's side is tested in the VM (`tests/vm/e2e/exports.rs`).

use serde_json::json;

use crate::harness::{Opts, Service, assert_error};

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001";

/// A well-formed key (the nvme-cli documentation's) that no target issued.
const KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

async fn exporting() -> Service {
    Service::start_with(Opts {
        extra_args: vec!["--export-address".into(), "127.0.0.1:4420".into()],
        ..Default::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn the_host_nqn_is_made_once_and_kept_and_exports_are_off_by_default() {
    let mut s = Service::start().await;
    let host = s.get("/v1/host").await.body;
    let nqn = host["fabric"]["host_nqn"].as_str().unwrap().to_string();
    assert!(nqn.starts_with("nqn.2014-08.org.nvmexpress:uuid:"), "{nqn}");
    assert_eq!(host["fabric"]["export_addresses"], json!([]));
    assert_eq!(host["fabric"]["target"]["available"], false);
    assert!(
        host["fabric"]["target"]["reason"]
            .as_str()
            .unwrap()
            .contains("--export-address"),
        "{host}"
    );
    s.signal(rustix::process::Signal::TERM);
    s.restart().await;
    let again = s.get("/v1/host").await.body;
    assert_eq!(again["fabric"]["host_nqn"], nqn.as_str());

    // Nothing is exported unless the operator names an address.
    s.loop_volume("v", 4).await;
    let a = s
        .put("/v1/volumes/v/export", json!({"hosts": [HOST]}))
        .await;
    assert_error(&a, 422, "export_unavailable");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--export-address"),
        "{}",
        a.body
    );
    assert_error(
        &s.get("/v1/volumes/v/export").await,
        404,
        "export_not_found",
    );
    assert_error(
        &s.get("/v1/volumes/nope/export").await,
        404,
        "volume_not_found",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_export_requests_are_refused_by_rule_and_change_nothing() {
    let s = exporting().await;
    s.loop_volume("v", 4).await;
    let put = |body| s.put("/v1/volumes/v/export", body);
    assert_error(&put(json!({"hosts": []})).await, 422, "auth_required");
    assert_error(
        &put(json!({"hosts": ["not-an-nqn"]})).await,
        422,
        "invalid_fabric_name",
    );
    assert_error(
        &put(json!({"hosts": ["nqn.2014-08.org.nvmexpress:uuid:a/b"]})).await,
        422,
        "invalid_fabric_name",
    );
    assert_error(&put(json!({"auth": "none"})).await, 422, "auth_required");
    assert_error(
        &put(json!({"hosts": [HOST], "read_only": true})).await,
        422,
        "export_read_only",
    );
    assert_error(&put(json!({"hosts": [[HOST]]})).await, 400, "invalid_body");
    assert_error(&put(json!({"hosts": HOST})).await, 400, "invalid_body");
    // A valid request, on a host whose kernel has no NVMe target: refused
    // naming what is missing.
    let a = put(json!({"hosts": [HOST]})).await;
    assert_error(&a, 422, "export_unavailable");
    let message = a.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("nvmet") || message.contains("configfs"),
        "{message}"
    );
    assert_error(
        &s.get("/v1/volumes/v/export").await,
        404,
        "export_not_found",
    );
    assert_eq!(s.get("/v1/exports").await.body, json!([]));
    assert_error(
        &s.post(&format!("/v1/export-hosts/{HOST}/rotate"), json!({}))
            .await,
        404,
        "export_host_not_found",
    );
    // The volume is not held by what was refused.
    assert_eq!(s.delete("/v1/volumes/v").await.status.as_u16(), 204);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_export_without_authentication_needs_loopback_and_the_flag() {
    let s = Service::start_with(Opts {
        extra_args: vec!["--export-address".into(), "10.255.255.1:4420".into()],
        ..Default::default()
    })
    .await;
    s.loop_volume("v", 4).await;
    let a = s
        .put(
            "/v1/volumes/v/export",
            json!({"auth": "none", "insecure_loopback": true}),
        )
        .await;
    assert_error(&a, 422, "auth_required");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not loopback"),
        "{}",
        a.body
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_remote_requests_are_refused_without_echoing_a_key() {
    let s = Service::start().await;
    let create = |body| s.post("/v1/remotes", body);
    let good = json!({"name": "r", "address": "10.255.255.1:4420",
                      "nqn": "nqn.2026-12.dev.blockplane:0000:v", "secret": KEY});
    let with = |k: &str, v: serde_json::Value| {
        let mut b = good.clone();
        b[k] = v;
        b
    };
    let a = create(with("secret", json!("DHHC-1:00:c2VjcmV0LXRoYXQtbGVha3M=:"))).await;
    assert_error(&a, 422, "invalid_key");
    assert!(
        !a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("c2VjcmV0"),
        "{}",
        a.body
    );
    assert_error(
        &create(with("address", json!("nowhere"))).await,
        422,
        "invalid_fabric_name",
    );
    assert_error(
        &create(with("nqn", json!("nqn"))).await,
        422,
        "invalid_fabric_name",
    );
    assert_error(
        &create(with("name", json!("Bad Name"))).await,
        422,
        "invalid_name",
    );
    // A valid request, on a host without the initiator or nothing at the
    // address: refused, and nothing stays.
    let a = create(good.clone()).await;
    assert!([422, 403].contains(&a.status.as_u16()), "{}", a.body);
    assert!(
        !a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("DHHC-1"),
        "{}",
        a.body
    );
    assert_eq!(s.get("/v1/remotes").await.body, json!([]));
    assert_error(&s.get("/v1/remotes/r").await, 404, "remote_not_found");
    assert_error(
        &s.patch("/v1/remotes/r", json!({"read_only": true})).await,
        404,
        "remote_not_found",
    );
    assert_error(&s.delete("/v1/remotes/r").await, 404, "remote_not_found");
}
