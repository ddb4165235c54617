//! The dashboard's files (served without a token, and only they) and the
//! `blockplane dashboard` port-forward to the API socket. The pages
//! themselves are tested in a browser: tests/dashboard/.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use blockplane_client::{Endpoint, Transport};
use hyper::{Method, StatusCode};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use crate::harness::{Opts, Service, assert_error, bin, check_against_openapi};

const TOKEN: &str = "dashboard-token";

/// One raw HTTP/1.1 request on a new connection; the answer's status, headers
/// (lowercase names) and body, read to the end.
async fn raw<S: AsyncRead + AsyncWrite + Unpin>(
    mut conn: S,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, String) {
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req += "Host: localhost\r\n";
    }
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut text = Vec::new();
    conn.read_to_end(&mut text).await.unwrap();
    let text = String::from_utf8_lossy(&text).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status.parse().unwrap(), headers, body.to_string())
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

async fn unix(s: &Service) -> tokio::net::UnixStream {
    tokio::net::UnixStream::connect(&s.sock).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_dashboard_files_load_without_a_token_and_nothing_else_does() {
    let s = Service::start_with(Opts {
        token: Some(TOKEN.into()),
        ..Default::default()
    })
    .await;
    for a in blockplane_server::ASSETS {
        let (status, h, body) = raw(unix(&s).await, "GET", a.path, &[]).await;
        assert_eq!(status, 200, "{}", a.path);
        assert_eq!(
            header(&h, "content-type"),
            Some(a.content_type),
            "{}",
            a.path
        );
        assert_eq!(body.as_bytes(), a.body, "{}", a.path);
        assert!(
            header(&h, "content-security-policy").is_some_and(|c| c.contains("default-src 'none'")),
            "{}",
            a.path
        );
        let (status, _, _) = raw(unix(&s).await, "HEAD", a.path, &[]).await;
        assert_eq!(status, 200, "HEAD {}", a.path);
    }
    let (_, _, html) = raw(unix(&s).await, "GET", "/", &[]).await;
    assert!(html.contains(r#"<script type="module" src="/dashboard/app.js">"#));

    // Everything else still needs the token: the API, other paths under
    // /dashboard/, and other methods on the files' paths.
    let anon = Transport::new(Endpoint::Unix(s.sock.clone()), None);
    for (method, path) in [
        (Method::GET, "/v1/volumes"),
        (Method::GET, "/v1/events/stream"),
        (Method::GET, "/dashboard/nope.js"),
        (Method::GET, "/dashboard/"),
        (Method::GET, "/index.html"),
        (Method::POST, "/"),
        (Method::DELETE, "/dashboard/app.js"),
    ] {
        let (status, body) = anon.send_raw(method.clone(), path, None).await.unwrap();
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}: {body}");
    }
    // The pages are not part of the API's document.
    let doc = s.get("/openapi.json").await.body;
    for path in doc["paths"].as_object().unwrap().keys() {
        assert!(
            !blockplane_server::is_asset(path) && !path.starts_with("/dashboard"),
            "{path}"
        );
    }
}

/// A running `blockplane dashboard`, stopped on drop.
struct Forward {
    child: Child,
    url: String,
    addr: String,
}

impl Forward {
    fn start(s: &Service, extra: &[&str], token: Option<&str>) -> Self {
        Self::start_to(&format!("unix:{}", s.sock.display()), extra, token)
    }

    fn start_to(api: &str, extra: &[&str], token: Option<&str>) -> Self {
        let mut c = Command::new(bin());
        c.arg("--api")
            .arg(api)
            .arg("dashboard")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .args(extra)
            .env_remove("BLOCKPLANE_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(t) = token {
            c.env("BLOCKPLANE_TOKEN", t);
        }
        let mut child = c.spawn().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        let addr = url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        Self { child, url, addr }
    }

    async fn conn(&self) -> tokio::net::TcpStream {
        tokio::net::TcpStream::connect(&self.addr).await.unwrap()
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_port_forward_carries_requests_and_streams_events() {
    let s = Service::start_with(Opts {
        token: Some(TOKEN.into()),
        ..Default::default()
    })
    .await;
    let f = Forward::start(&s, &[], None);
    assert!(f.url.starts_with("http://127.0.0.1:"), "{}", f.url);

    // The page loads without a token; the API answers as on the socket.
    let (status, _, html) = raw(f.conn().await, "GET", "/", &[]).await;
    assert_eq!(status, 200);
    assert!(html.contains("/dashboard/app.js"));
    let anon = Transport::new(Endpoint::Tcp(f.addr.clone()), None);
    let a = anon.send(Method::GET, "/v1/host", None).await.unwrap();
    check_against_openapi(&Method::GET, "/v1/host", &a);
    assert_error(&a, 401, "unauthorized");
    let c = Transport::new(Endpoint::Tcp(f.addr.clone()), Some(TOKEN.into()));
    let a = c.send(Method::GET, "/v1/host", None).await.unwrap();
    check_against_openapi(&Method::GET, "/v1/host", &a);
    assert_eq!(a.status, StatusCode::OK);

    // The event stream flows through as events happen: it never ends, so a
    // forward that buffered answers would deliver nothing.
    let mut stream = f.conn().await;
    stream
        .write_all(
            format!(
                "GET /v1/events/stream HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\nAccept: text/event-stream\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut lines = BufReader::new(stream);
    let mut first = String::new();
    lines.read_line(&mut first).await.unwrap();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");

    // Request bodies go through too.
    let path = s.images.join("fw.img");
    let a = c
        .send(
            Method::POST,
            "/v1/images",
            Some(&json!({"name": "fw", "path": path, "create": {"size_bytes": 4 << 20}})),
        )
        .await
        .unwrap();
    check_against_openapi(&Method::POST, "/v1/images", &a);
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);

    let got = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut l = String::new();
            assert!(lines.read_line(&mut l).await.unwrap() > 0, "stream closed");
            if l.trim_end() == "event: image_created" {
                return;
            }
        }
    })
    .await;
    assert!(got.is_ok(), "the event did not come through the forward");

    // Without a token of its own the forward answers only loopback names, so a
    // page of another site cannot reach it by DNS rebinding.
    let (status, _, body) = raw(f.conn().await, "GET", "/", &[("Host", "evil.example:80")]).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("forbidden_host"), "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_port_forward_guards_itself() {
    // Beyond loopback only with a token.
    let out = Command::new(bin())
        .args([
            "--api",
            "unix:/nonexistent.sock",
            "dashboard",
            "--listen",
            "0.0.0.0:0",
        ])
        .env_remove("BLOCKPLANE_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to listen on 0.0.0.0:0 without a token"),
        "{err}"
    );

    // With a token, the forward itself requires it (but not for the files).
    let s = Service::start().await;
    let f = Forward::start(&s, &[], Some("forward-token"));
    let anon = Transport::new(Endpoint::Tcp(f.addr.clone()), None);
    let a = anon.send(Method::GET, "/v1/volumes", None).await.unwrap();
    assert_error(&a, 401, "unauthorized");
    let (status, _, _) = raw(f.conn().await, "GET", "/dashboard/app.js", &[]).await;
    assert_eq!(status, 200);
    let c = Transport::new(Endpoint::Tcp(f.addr.clone()), Some("forward-token".into()));
    let a = c.send(Method::GET, "/v1/volumes", None).await.unwrap();
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);

    // An API that is not there is a 502 that says where it looked.
    let f = Forward::start_to("unix:/nonexistent/blockplane.sock", &[], None);
    let anon = Transport::new(Endpoint::Tcp(f.addr.clone()), None);
    let a = anon.send(Method::GET, "/v1/volumes", None).await.unwrap();
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert_eq!(a.body["error"]["code"], "api_unreachable");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("unix:/nonexistent/blockplane.sock"), "{msg}");
    // The pages still load (from the forward's own copy), to say so.
    for (path, kind) in [("/", "text/html"), ("/dashboard/app.js", "text/javascript")] {
        let (status, h, body) = raw(f.conn().await, "GET", path, &[]).await;
        assert_eq!(status, 200, "{path} with the API down: {body}");
        assert!(
            header(&h, "content-type").unwrap().starts_with(kind),
            "{path}: {h:?}"
        );
        assert!(!body.contains("api_unreachable"), "{path}: {body}");
    }
}
