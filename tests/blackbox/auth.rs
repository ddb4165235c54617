//! Listeners and the bearer token.

use std::os::unix::fs::PermissionsExt;

use blockplane_api::client::{Endpoint, Transport};
use hyper::{Method, StatusCode};

use crate::harness::{BIN, Opts, Service, assert_error, check_against_openapi};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_token_everything_but_healthz_needs_it() {
    let token = "s3cret-token-value";
    let addr = format!("127.0.0.1:{}", free_port());
    let s = Service::start_with(Opts {
        token: Some(token.into()),
        tcp: Some(addr.clone()),
        ..Default::default()
    })
    .await;
    for endpoint in [Endpoint::Unix(s.sock.clone()), Endpoint::Tcp(addr.clone())] {
        let anon = Transport::new(endpoint.clone(), None);
        let wrong = Transport::new(endpoint.clone(), Some("wrong".into()));
        let right = Transport::new(endpoint.clone(), Some(token.into()));
        for path in [
            "/v1/host",
            "/v1/images",
            "/v1/volumes",
            "/v1/events",
            "/openapi.json",
            "/nope",
        ] {
            for c in [&anon, &wrong] {
                let a = c.send(Method::GET, path, None).await.unwrap();
                check_against_openapi(&Method::GET, path, &a);
                assert_error(&a, 401, "unauthorized");
            }
            let a = right.send(Method::GET, path, None).await.unwrap();
            check_against_openapi(&Method::GET, path, &a);
            assert_ne!(a.status, StatusCode::UNAUTHORIZED, "{path}");
        }
        let a = anon
            .send(Method::POST, "/v1/images", Some(&serde_json::json!({})))
            .await
            .unwrap();
        check_against_openapi(&Method::POST, "/v1/images", &a);
        assert_error(&a, 401, "unauthorized");
        let h = anon.send(Method::GET, "/healthz", None).await.unwrap();
        check_against_openapi(&Method::GET, "/healthz", &h);
        assert_eq!(h.status, StatusCode::OK);
    }
    assert!(
        !s.log_text().contains(token),
        "the token must never be logged"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tcp_without_a_token_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(BIN)
            .arg("serve")
            .arg("--data-dir")
            .arg(dir.path())
            .args(args)
            .env_remove("BLOCKPLANE_TOKEN")
            .output()
            .unwrap()
    };
    let out = run(&["--listen", "127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("without a token"));
    let out = run(&["--listen", "0.0.0.0:1", "--insecure-tcp"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
    assert!(!dir.path().join("blockplane.db").exists(), "nothing starts");
}

#[tokio::test(flavor = "multi_thread")]
async fn insecure_tcp_on_loopback_works_and_the_socket_is_private() {
    let addr = format!("127.0.0.1:{}", free_port());
    let s = Service::start_with(Opts {
        tcp: Some(addr.clone()),
        extra_args: vec!["--insecure-tcp".into()],
        ..Default::default()
    })
    .await;
    let a = Transport::new(Endpoint::Tcp(addr), None)
        .send(Method::GET, "/v1/host", None)
        .await
        .unwrap();
    assert_eq!(a.status, StatusCode::OK);
    let mode = std::fs::metadata(&s.sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    let mode = std::fs::metadata(&s.data).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_routes_and_methods_answer_json() {
    let s = Service::start().await;
    assert_error(&s.get("/v2/whatever").await.clone(), 404, "no_route");
    let a = s.call(Method::PUT, "/v1/images", None).await;
    assert_error(&a, 405, "no_route");
}
