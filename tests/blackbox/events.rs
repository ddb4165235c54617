//! `GET /v1/events/stream`: the events of a scripted sequence, in order.

use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::harness::Service;

/// Opens the stream and returns a reader of its lines.
async fn open_stream(s: &Service, query: &str) -> BufReader<tokio::net::UnixStream> {
    let mut sock = tokio::net::UnixStream::connect(&s.sock).await.unwrap();
    sock.write_all(
        format!(
            "GET /v1/events/stream{query} HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut r = BufReader::new(sock);
    let mut line = String::new();
    r.read_line(&mut line).await.unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    r
}

/// Reads SSE events `(id, kind)` until `n` arrived (chunked framing lines are skipped).
async fn read_events(
    r: &mut BufReader<tokio::net::UnixStream>,
    n: usize,
) -> Vec<(i64, String, serde_json::Value)> {
    let mut out = Vec::new();
    let (mut id, mut kind) = (0i64, String::new());
    while out.len() < n {
        let mut line = String::new();
        let got = tokio::time::timeout(Duration::from_secs(20), r.read_line(&mut line)).await;
        let got = got.expect("events arrive").unwrap();
        assert!(got > 0, "stream closed");
        let line = line.trim_end();
        if let Some(v) = line.strip_prefix("id: ") {
            id = v.parse().unwrap();
        } else if let Some(v) = line.strip_prefix("event: ") {
            kind = v.to_string();
        } else if let Some(v) = line.strip_prefix("data: ") {
            out.push((id, kind.clone(), serde_json::from_str(v).unwrap()));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stream_delivers_a_scripted_sequence_in_order() {
    let s = Service::start().await;
    s.image("before", 4).await;
    let mut all = open_stream(&s, "").await;
    // Script: image, volume, a refused change, delete.
    s.image("ev", 8).await;
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "ev", "image": "ev", "backend": "loop"}),
        )
        .await;
    assert_eq!(v.status.as_u16(), 201);
    let mut one = open_stream(&s, "?volume=ev").await;
    assert_eq!(s.delete("/v1/volumes/ev").await.status.as_u16(), 204);
    let got = read_events(&mut all, 5).await;
    let kinds: Vec<&str> = got.iter().map(|(_, k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "image_created",
            "volume_created",
            "volume_attached",
            "volume_detaching",
            "volume_deleted"
        ]
    );
    assert!(
        got.windows(2).all(|w| w[0].0 < w[1].0),
        "ids increase: {got:?}"
    );
    assert!(
        got.iter()
            .all(|(id, kind, data)| data["id"] == *id && data["kind"] == kind.as_str())
    );
    // The volume's own stream started after its attach: only the delete.
    let mine = read_events(&mut one, 2).await;
    assert_eq!(
        mine.iter().map(|(_, k, _)| k.as_str()).collect::<Vec<_>>(),
        ["volume_detaching", "volume_deleted"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn open_streams_end_at_once_when_the_service_stops() {
    let mut s = Service::start().await;
    let mut a = open_stream(&s, "").await;
    let b = open_stream(&s, "").await;
    s.image("one", 4).await;
    read_events(&mut a, 1).await;
    let reader = |mut r: BufReader<tokio::net::UnixStream>| {
        tokio::spawn(async move {
            // To the end of the stream: chunked framing ends it with "0".
            let mut last = String::new();
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                    return last;
                }
                if !line.trim().is_empty() {
                    last = line.trim().to_string();
                }
            }
        })
    };
    let (ra, rb) = (reader(a), reader(b));
    let at = std::time::Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        let st = s.signal(rustix::process::Signal::TERM);
        (st, s)
    })
    .await
    .unwrap()
    .0;
    let took = at.elapsed();
    assert!(status.success(), "SIGTERM exits 0: {status}");
    // The keep-alive comes every 15 s and the drain waits up to 30 s: an
    // open stream that held the stop up would take that long.
    assert!(
        took < Duration::from_secs(8),
        "two open event streams held SIGTERM up for {took:?}"
    );
    for r in [ra, rb] {
        let last = tokio::time::timeout(Duration::from_secs(5), r)
            .await
            .expect("the stream ended")
            .unwrap();
        assert_eq!(last, "0", "the stream ended cleanly (last chunk)");
    }
}
