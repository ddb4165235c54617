//! `/v1/events`: the event log, as a list and as a live stream of
//! server-sent events.

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, StatusCode};

use super::client::Client;
use super::error::Error;
use super::path::with_query;
use blockplane_api::model::{Event, EventQuery, EventStreamQuery};

impl Client {
    /// `GET /v1/events`: recorded events, oldest first.
    pub async fn events(&self, query: &EventQuery) -> Result<Vec<Event>, Error> {
        self.get(&with_query("/v1/events".into(), query)).await
    }

    /// `GET /v1/events/stream`: events as the service records them, until
    /// it stops.
    pub async fn event_stream(&self, query: &EventStreamQuery) -> Result<EventStream, Error> {
        let path = with_query("/v1/events/stream".into(), query);
        let request = format!("GET {path}");
        let resp = self.transport.request(Method::GET, &path, None).await?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp.into_body().collect().await?.to_bytes();
            return Err(Error::answer(request, status, &bytes));
        }
        Ok(EventStream {
            request,
            status,
            body: resp.into_body(),
            buf: Vec::new(),
        })
    }
}

/// An open `GET /v1/events/stream`.
#[derive(Debug)]
pub struct EventStream {
    request: String,
    status: StatusCode,
    body: Incoming,
    /// What arrived of the blocks not yet read.
    buf: Vec<u8>,
}

impl EventStream {
    /// The next event; `None` once the stream ends (the service stopped).
    pub async fn next(&mut self) -> Option<Result<Event, Error>> {
        loop {
            while let Some(block) = next_block(&mut self.buf) {
                // Blocks without data are comments: the keep-alives.
                if let Some(data) = data_of(&block) {
                    return Some(
                        serde_json::from_str(&data).map_err(|source| Error::Unexpected {
                            request: self.request.clone(),
                            status: self.status,
                            source,
                        }),
                    );
                }
            }
            match self.body.frame().await? {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Err(e) => return Some(Err(Error::Http(e))),
            }
        }
    }
}

/// Takes the first complete block (the lines up to a blank line) off `buf`.
fn next_block(buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let end = buf.windows(2).position(|w| w == b"\n\n")?;
    let mut block: Vec<u8> = buf.drain(..end + 2).collect();
    block.truncate(end);
    Some(block)
}

/// The `data` of a block, its lines joined as the SSE format says; `None`
/// when it has none.
fn data_of(block: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(block);
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_at_blank_lines_and_comments_have_no_data() {
        let mut buf = b"id: 1\nevent: k\ndata: {\"a\":\ndata: 1}\n\n:\n\nid: 2".to_vec();
        let first = next_block(&mut buf).unwrap();
        assert_eq!(data_of(&first).as_deref(), Some("{\"a\":\n1}"));
        let keep_alive = next_block(&mut buf).unwrap();
        assert_eq!(data_of(&keep_alive), None);
        assert_eq!(next_block(&mut buf), None, "a block still arriving");
        assert_eq!(buf, b"id: 2");
    }
}
