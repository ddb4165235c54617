//! Listeners and the bearer token.

use std::os::unix::fs::PermissionsExt;

use blockplane_client::{Endpoint, Transport};
use hyper::{Method, StatusCode};

use crate::harness::{
    Opts, Service, assert_error, bin, check_against_openapi, free_port, openapi_path,
};

/// Every operation of the committed OpenAPI document, as `(METHOD, path)`
/// with each path parameter filled in: read from the document, so that a new
/// operation is tried without anyone listing it here.
fn documented_operations() -> Vec<(Method, String)> {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(openapi_path()).unwrap()).unwrap();
    let mut out = Vec::new();
    for (template, item) in doc["paths"].as_object().unwrap() {
        let path = template
            .split('/')
            .map(|s| if s.starts_with('{') { "x" } else { s })
            .collect::<Vec<_>>()
            .join("/");
        for m in item.as_object().unwrap().keys() {
            if let Ok(method) = m.to_ascii_uppercase().parse::<Method>()
                && ["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&method.as_str())
            {
                out.push((method, path.clone()));
            }
        }
    }
    assert!(
        out.len() >= 20,
        "the document lists its operations: {out:?}"
    );
    out
}

/// The status line's code of one request sent on a connection of its own
/// (only the head of the answer is read: an event stream never ends).
async fn status_of(endpoint: &Endpoint, method: &Method, path: &str, token: Option<&str>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
    impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}
    let mut c: Box<dyn Io> = match endpoint {
        Endpoint::Unix(p) => Box::new(tokio::net::UnixStream::connect(p).await.unwrap()),
        Endpoint::Tcp(a) => Box::new(tokio::net::TcpStream::connect(a).await.unwrap()),
    };
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let body = if matches!(*method, Method::POST | Method::PATCH | Method::PUT) {
        "{}"
    } else {
        ""
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    c.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(std::time::Duration::from_secs(30), c.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: no answer in 30 s"))
            .unwrap();
        assert!(n > 0, "{method} {path}: closed without an answer");
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{method} {path}: no status line in {text:?}"))
}

/// On both listeners, every operation the OpenAPI document lists (and its
/// HEAD where it is a GET), the event stream and `/metrics` included, is
/// 401 without the token and with a wrong one, and not 401 with the right
/// one; so are `/openapi.json` and an unknown route. Only `/healthz` and the
/// dashboard's own files answer without it.
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
    let mut requests = documented_operations();
    requests.extend([
        (Method::GET, "/openapi.json".to_string()),
        (Method::GET, "/nope".to_string()),
        (Method::DELETE, "/nope".to_string()),
    ]);
    let heads: Vec<(Method, String)> = requests
        .iter()
        .filter(|(m, _)| *m == Method::GET)
        .map(|(_, p)| (Method::HEAD, p.clone()))
        .collect();
    requests.extend(heads);
    for endpoint in [Endpoint::Unix(s.sock.clone()), Endpoint::Tcp(addr.clone())] {
        let anon = Transport::new(endpoint.clone(), None);
        let wrong = Transport::new(endpoint.clone(), Some("wrong".into()));
        for (method, path) in &requests {
            if path == "/healthz" {
                continue;
            }
            for (who, c, t) in [
                ("no token", &anon, None),
                ("a wrong token", &wrong, Some("wrong")),
            ] {
                let st = status_of(&endpoint, method, path, t).await;
                assert_eq!(st, 401, "{method} {path} with {who} on {endpoint:?}");
                if *method == Method::HEAD {
                    continue;
                }
                // The 401 is the API's JSON error, as the document says.
                let body = matches!(*method, Method::POST | Method::PATCH | Method::PUT)
                    .then(|| serde_json::json!({}));
                let a = c.send(method.clone(), path, body.as_ref()).await.unwrap();
                check_against_openapi(method, path, &a);
                assert_error(&a, 401, "unauthorized");
            }
            let st = status_of(&endpoint, method, path, Some(token)).await;
            assert_ne!(st, 401, "{method} {path} with the token on {endpoint:?}");
        }
        let h = anon.send(Method::GET, "/healthz", None).await.unwrap();
        check_against_openapi(&Method::GET, "/healthz", &h);
        assert_eq!(h.status, StatusCode::OK);
        for asset in ["/", "/dashboard/app.js"] {
            assert_eq!(status_of(&endpoint, &Method::GET, asset, None).await, 200);
        }
    }
    assert!(
        !s.log_text().contains(token),
        "the token must never be logged"
    );
}

/// Every API call the dashboard's scripts make is an operation of the
/// document, so the test above tries it without a token.
#[tokio::test(flavor = "multi_thread")]
async fn every_api_call_of_the_dashboard_is_a_documented_operation() {
    let ops = documented_operations();
    let dir = crate::harness::repo().join("service/server/dashboard");
    let mut calls = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        if e.path().extension().is_none_or(|x| x != "js") {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap();
        // `api('METHOD', 'path' or `path`...)` and `fetch('path'...)`.
        for (marker, method) in [("api('", None), ("fetch('", Some("GET"))] {
            for (i, _) in text.match_indices(marker) {
                let rest = &text[i + marker.len()..];
                let (method, rest) = match method {
                    Some(m) => (m.to_string(), &text[i + marker.len() - 1..]),
                    None => {
                        let (m, rest) = rest.split_once('\'').unwrap();
                        (m.to_string(), rest.trim_start_matches([',', ' ']))
                    }
                };
                let quote = rest.chars().next().unwrap();
                if !matches!(quote, '\'' | '`') {
                    continue; // a path made elsewhere: `fetch(path, ...)` in api()
                }
                let path = rest[1..].split(quote).next().unwrap();
                let path = path.split('?').next().unwrap();
                // `${...}` stands for a path parameter.
                let mut p = String::new();
                let mut parts = path.split("${");
                p.push_str(parts.next().unwrap());
                for part in parts {
                    p.push('x');
                    p.push_str(part.split_once('}').map_or("", |(_, r)| r));
                }
                calls.push((method, p, e.file_name().to_string_lossy().into_owned()));
            }
        }
    }
    assert!(
        calls.len() >= 20,
        "the dashboard's calls were found: {calls:?}"
    );
    for (method, path, file) in &calls {
        assert!(
            ops.iter().any(|(m, p)| m.as_str() == method && p == path),
            "{file}: {method} {path} is not an operation of openapi.json"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tcp_without_a_token_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(bin())
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

/// An answer given before the request's body is read (401 here: nothing is
/// read for a client without the token) reaches a client that sends its
/// body after the headers, as HTTP clients and proxies do: the service stops
/// writing but reads on until the client is done, so the body's write
/// neither fails nor resets the connection over the answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_before_the_body_reaches_a_client_still_sending_it() {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    use std::io::{Read, Write};
    let s = Service::start_with(Opts {
        token: Some("s3cret-token-value".into()),
        ..Default::default()
    })
    .await;
    let body = br#"{"dispatch": null, "qos": null, "read_only": null}"#;
    let mut c = std::os::unix::net::UnixStream::connect(&s.sock).unwrap();
    write!(
        c,
        "PATCH /v1/volumes/x HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    // The service has answered and ended its side of the connection.
    let mut fds = [PollFd::new(&c, PollFlags::RDHUP)];
    let limit = Timespec {
        tv_sec: 60,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&limit)).unwrap();
    assert!(
        fds[0].revents().contains(PollFlags::RDHUP),
        "the service never ended the refused connection"
    );
    c.write_all(body)
        .expect("the body's write failed: the service closed the socket with the answer unread");
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 401 "), "{answer}");
}
