//! Limits that protect the service from its clients: each answers with its
//! own status and code, and changes nothing.

use std::time::{Duration, Instant};

use hyper::Method;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::eventually;
use crate::harness::{Opts, Service, assert_error, free_port, read_answer, unread_on_accepted};

fn with(args: &[&str]) -> Opts {
    Opts {
        extra_args: args.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_over_the_cap_is_413() {
    let s = Service::start_with(with(&["--max-body-bytes", "4096"])).await;
    let before = s.snapshot().await;
    let big = "x".repeat(8192);
    let a = s
        .call(
            Method::POST,
            "/v1/images",
            Some(json!({"name": big, "path": "/x"})),
        )
        .await;
    assert_error(&a, 413, "body_too_large");
    assert_eq!(s.snapshot().await, before);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_half_sent_request_is_answered_408_at_the_header_timeout() {
    let s = Service::start_with(with(&["--header-timeout-secs", "1"])).await;
    let mut c = tokio::net::UnixStream::connect(&s.sock).await.unwrap();
    c.write_all(b"GET /v1/host HTTP/1.1\r\nHo").await.unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the half-sent request was not cut off");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // The README promises 408 with the API's error body, and nothing else.
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer to a half-sent request: {text:?}"));
    assert!(head.starts_with("HTTP/1.1 408 "), "{text}");
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("within 1 s"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_connection_past_the_header_timeout_is_closed_without_an_answer() {
    let s = Service::start_with(with(&["--header-timeout-secs", "1"])).await;
    let mut c = tokio::net::UnixStream::connect(&s.sock).await.unwrap();
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the idle connection was not closed");
    // One answer, to the one request: no 408 for a request never begun.
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
    assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{text}");
}

/// A request that takes seconds: a fully allocated 2 GiB image (zeros written).
fn slow_create(s: &Service, name: &str) -> serde_json::Value {
    json!({"name": name, "path": s.images.join(format!("{name}.img")),
           "create": {"size_bytes": 64u64 << 20, "allocation": "full"}})
}

/// A service whose image creates take 3 s more (test fault), with `args`.
fn slow(args: &[&str]) -> Opts {
    Opts {
        env: vec![("BLOCKPLANE_TEST_FAULT".into(), "slow_image_create".into())],
        ..with(args)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_past_its_timeout_is_408_and_its_operation_still_completes() {
    let s = Service::start_with(slow(&["--request-timeout-secs", "1"])).await;
    let a = s.post("/v1/images", slow_create(&s, "slow")).await;
    assert_error(&a, 408, "request_timeout");
    // The operation ran on: the image appears.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let g = s.get("/v1/images/slow").await;
        if g.status.as_u16() == 200 {
            assert_eq!(g.body["size_bytes"], 64u64 << 20);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the timed-out create never completed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A delete may outlast the 1 s timeout on a slow disk: 204, or 408 and gone soon.
    let d = s.delete("/v1/images/slow?delete_file=true").await;
    assert!(matches!(d.status.as_u16(), 204 | 408), "{}", d.body);
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.get("/v1/images/slow").await.status.as_u16() != 404 {
        assert!(Instant::now() < deadline, "the image was never deleted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn past_the_concurrency_limit_requests_are_shed_with_503() {
    let s =
        std::sync::Arc::new(Service::start_with(slow(&["--max-concurrent-requests", "1"])).await);
    let s2 = s.clone();
    let slow = tokio::spawn(async move { s2.post("/v1/images", slow_create(&s2, "busy")).await });
    // Its file made, the create spends 3 s more in its handler, which holds
    // the one place.
    let file = s.images.join("busy.img");
    eventually(
        Duration::from_secs(60),
        "the slow create to begin",
        async || file.exists(),
    )
    .await;
    let a = s.get("/v1/volumes").await;
    assert_error(&a, 503, "overloaded");
    let done = slow.await.unwrap();
    assert_eq!(done.status.as_u16(), 201, "{}", done.body);
    assert_eq!(s.get("/v1/volumes").await.status.as_u16(), 200);
    assert_eq!(
        s.delete("/v1/images/busy?delete_file=true")
            .await
            .status
            .as_u16(),
        204
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn event_streams_have_their_own_limit() {
    let s = Service::start_with(with(&["--max-event-streams", "1"])).await;
    let open = || async {
        let mut c = tokio::net::UnixStream::connect(&s.sock).await.unwrap();
        c.write_all(b"GET /v1/events/stream HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut head = vec![0u8; 64];
        let n = c.read(&mut head).await.unwrap();
        (c, String::from_utf8_lossy(&head[..n]).into_owned())
    };
    let (first, head) = open().await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (_, head) = open().await;
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    // Requests are not affected by open streams.
    assert_eq!(s.get("/v1/host").await.status.as_u16(), 200);
    drop(first);
    eventually(
        Duration::from_secs(30),
        "the closed stream to give its place back",
        async || open().await.1.starts_with("HTTP/1.1 200"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_volume_cap_refuses_one_more_and_changes_nothing() {
    let s = Service::start_with(with(&["--max-volumes", "2"])).await;
    s.loop_volume("a", 4).await;
    s.loop_volume("b", 4).await;
    s.image("c-img", 4).await;
    let before = s.snapshot().await;
    let a = s
        .post(
            "/v1/volumes",
            json!({"name": "c", "image": "c-img", "backend": "loop"}),
        )
        .await;
    assert_error(&a, 422, "volume_limit");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-volumes")
    );
    assert_eq!(s.snapshot().await, before);
}

/// A service started with a soft limit of 256 open files (a shell's or a
/// service manager's default is 1,024) raises it to the hard limit, so that
/// `--max-volumes` (1,024) volumes, a descriptor or two each, fit.
#[tokio::test(flavor = "multi_thread")]
async fn a_low_open_files_limit_is_raised_to_the_hard_one() {
    let s = Service::start_with(Opts {
        open_files: Some(256),
        ..Default::default()
    })
    .await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", s.pid())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let nums: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(nums[0], nums[1], "soft limit not raised: {line}");
    assert_ne!(nums[0], "256", "{line}");
}

/// A connection to `port` that sent a POST's headers, announcing a body of
/// `len` bytes, and its first byte.
async fn body_begun(port: u16, len: usize) -> tokio::net::TcpStream {
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    c.write_all(
        format!("POST /v1/images HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n{{").as_bytes(),
    )
    .await
    .unwrap();
    c
}

/// 256 clients (the default concurrency limit) that send their headers and
/// then one body byte every 500 ms: once the service read them all,
/// `/healthz` and the API answer at once, and each trickler is cut off with
/// 408 `body_timeout` after the grace period (the header timeout, 10 s by
/// default), well before the 120 s request timeout.
#[tokio::test(flavor = "multi_thread")]
async fn slow_bodies_time_out_and_healthz_never_queues() {
    const CLIENTS: usize = 256;
    let port = free_port();
    let s = Service::start_with(on_tcp(port)).await;
    let started = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let mut c = body_begun(port, 4096).await;
        clients.push(tokio::spawn(async move {
            // Trickle until the service answers, then return what it said.
            let mut answer = Vec::new();
            let mut buf = [0u8; 1024];
            loop {
                tokio::select! {
                    n = c.read(&mut buf) => match n {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            answer.extend_from_slice(&buf[..n]);
                            if answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                                break;
                            }
                        }
                    },
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {
                        if c.write_all(b" ").await.is_err() {
                            // The service answered and closed between two
                            // reads: its answer is still in the socket.
                            let _ = tokio::time::timeout(
                                Duration::from_secs(5),
                                c.read_to_end(&mut answer),
                            )
                            .await;
                            break;
                        }
                    }
                }
                if started.elapsed() > Duration::from_secs(150) {
                    break;
                }
            }
            (started.elapsed(), String::from_utf8_lossy(&answer).into_owned())
        }));
    }
    all_read(port, CLIENTS).await;
    // Every trickler's request is in the service now; liveness must not care.
    let h = s.get("/healthz").await;
    assert_eq!(
        h.status.as_u16(),
        200,
        "/healthz queued behind tricklers: {}",
        h.body
    );
    let a = s.get("/v1/volumes").await;
    assert_eq!(
        a.status.as_u16(),
        200,
        "the API queued behind tricklers: {}",
        a.body
    );
    for c in clients {
        let (after, answer) = c.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("\"body_timeout\""), "{answer}");
        assert!(
            after < Duration::from_secs(30),
            "cut off only after {after:?}"
        );
    }
    assert!(
        s.get("/v1/images")
            .await
            .body
            .as_array()
            .unwrap()
            .is_empty()
    );
}

/// A service that also listens on a loopback TCP port (without a token), so
/// that a test can see what the kernel holds unread for it.
fn on_tcp(port: u16) -> Opts {
    Opts {
        tcp: Some(format!("127.0.0.1:{port}")),
        ..with(&["--insecure-tcp"])
    }
}

/// Waits until the service has read everything `clients` connections to
/// `port` sent it (their requests are in its hands, not the kernel's).
async fn all_read(port: u16, clients: usize) {
    eventually(
        Duration::from_secs(60),
        "the service to read every client's request",
        async || {
            let unread = unread_on_accepted(port);
            unread.len() >= clients && unread.iter().all(|&n| n == 0)
        },
    )
    .await;
}

/// 256 clients (the default concurrency limit) that each send one byte of a
/// 100-byte body and wait: once the service has read them all, a request
/// without a body and one with its whole body are both served at once (a
/// client still sending its body holds no place of the requests being
/// served), and each trickler is cut off with 408 `body_timeout` at its
/// body's deadline.
#[tokio::test(flavor = "multi_thread")]
async fn clients_trickling_their_bodies_hold_no_place_of_the_requests_served() {
    const CLIENTS: usize = 256;
    let port = free_port();
    let s = Service::start_with(on_tcp(port)).await;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let c = body_begun(port, 100).await;
        clients.push(c);
    }
    all_read(port, CLIENTS).await;
    let a = s.get("/v1/volumes").await;
    assert_eq!(
        a.status.as_u16(),
        200,
        "a request without a body waited behind tricklers: {}",
        a.body
    );
    let path = s.images.join("real.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "real", "path": path, "create": {"size_bytes": 1 << 20}}),
        )
        .await;
    assert_eq!(
        a.status.as_u16(),
        201,
        "a request with its body waited behind tricklers: {}",
        a.body
    );
    for mut c in clients {
        let answer = tokio::time::timeout(Duration::from_secs(60), read_answer(&mut c))
            .await
            .expect("a trickler was never cut off");
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("\"body_timeout\""), "{answer}");
    }
    let images = s.get("/v1/images").await.body;
    assert_eq!(images.as_array().unwrap().len(), 1, "{images}");
}

/// Ten kept-alive connections, each answered once, then the service is
/// stopped (SIGSTOP, as a frozen cgroup or a starved host would) for longer
/// than the header timeout while each sends its next request: once the
/// service runs again, every request waiting in its socket is read and
/// answered, not dropped by the header timer that expired meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn requests_sent_on_kept_alive_connections_during_a_stall_are_answered() {
    use rustix::process::{Pid, Signal, kill_process};
    let s = Service::start_with(with(&["--header-timeout-secs", "5"])).await;
    let req = b"GET /v1/host HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut conns = Vec::new();
    for _ in 0..10 {
        let mut c = tokio::net::UnixStream::connect(&s.sock).await.unwrap();
        c.write_all(req).await.unwrap();
        let a = read_answer(&mut c).await;
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
        conns.push(c);
    }
    let pid = Pid::from_raw(s.pid() as i32).unwrap();
    kill_process(pid, Signal::STOP).unwrap();
    let stat = format!("/proc/{}/stat", s.pid());
    eventually(Duration::from_secs(10), "the service to stop", async || {
        std::fs::read_to_string(&stat)
            .is_ok_and(|st| st.rsplit(')').next().unwrap().trim_start().starts_with('T'))
    })
    .await;
    for c in &mut conns {
        c.write_all(req).await.unwrap();
    }
    // The stall is the fault: it outlasts the header timeout (5 s) that
    // each connection's idle wait began before it.
    tokio::time::sleep(Duration::from_secs(7)).await;
    kill_process(pid, Signal::CONT).unwrap();
    let mut answers = Vec::new();
    for c in &mut conns {
        let a = tokio::time::timeout(Duration::from_secs(20), read_answer(c))
            .await
            .unwrap_or_default();
        answers.push(
            a.lines()
                .next()
                .unwrap_or("(closed, no answer)")
                .to_string(),
        );
    }
    let ok = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 200"))
        .count();
    assert_eq!(ok, 10, "answered after the stall: {answers:?}");
}
