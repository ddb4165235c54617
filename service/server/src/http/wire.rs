//! Error answers made below the router. hyper answers a request it cannot
//! parse (a URI over 64 KiB: 414; headers over its buffer: 431; malformed:
//! 400) by itself, with an empty body and no hook to change it. [`JsonParseErrors`]
//! wraps each connection and gives exactly those answers the API's JSON error
//! body; everything else passes through untouched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use blockplane_api::model::{ErrorBody, ErrorCode, ErrorDetail};

/// The stable code of an error answer made outside the API's handlers.
pub fn code_of(status: StatusCode) -> ErrorCode {
    use ErrorCode as C;
    match status.as_u16() {
        400 => C::InvalidRequest,
        404 => C::NoRoute,
        405 => C::MethodNotAllowed,
        413 => C::BodyTooLarge,
        414 => C::UriTooLong,
        431 => C::HeadersTooLarge,
        s if s >= 500 => C::Internal,
        _ => C::HttpError,
    }
}

/// What an error answer made outside the API's handlers says.
pub fn message_of(status: StatusCode) -> String {
    match status.as_u16() {
        400 => "the request is not valid HTTP/1.1".into(),
        414 => "the request's URI is longer than the service accepts".into(),
        431 => "the request's headers are larger than the service accepts".into(),
        _ => status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string(),
    }
}

/// hyper's own answer to an unparsable request, if `buf` is exactly one:
/// a status line of 400, 414 or 431 and a head that ends the buffer and
/// declares an empty body. Every answer the router makes carries a body.
fn automatic_answer(buf: &[u8]) -> Option<StatusCode> {
    let status = match buf.get(..13)? {
        b"HTTP/1.1 400 " => StatusCode::BAD_REQUEST,
        b"HTTP/1.1 414 " => StatusCode::URI_TOO_LONG,
        b"HTTP/1.1 431 " => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        _ => return None,
    };
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let empty = buf
        .to_ascii_lowercase()
        .windows(20)
        .any(|w| w == b"\r\ncontent-length: 0\r");
    (head_end == buf.len() && empty).then_some(status)
}

/// The same answer with the JSON error body.
fn with_json_body(head: &[u8], status: StatusCode) -> Vec<u8> {
    let body = serde_json::to_vec(&ErrorBody {
        error: ErrorDetail {
            code: code_of(status),
            message: message_of(status),
        },
    })
    .expect("an error body serializes");
    let mut out = Vec::with_capacity(head.len() + body.len() + 64);
    for line in head.split(|b| *b == b'\n') {
        let lower = line.to_ascii_lowercase();
        if line.is_empty() || lower == b"\r" || lower.starts_with(b"content-length:") {
            continue;
        }
        out.extend_from_slice(line);
        out.push(b'\n');
    }
    out.extend_from_slice(
        format!(
            "content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(&body);
    out
}

/// A connection whose automatic parse-error answers get the JSON body.
pub struct JsonParseErrors<I> {
    io: I,
    /// A rewritten answer not yet fully written, and how much of it was.
    pending: Option<(Vec<u8>, usize)>,
}

impl<I> JsonParseErrors<I> {
    /// Wraps one accepted connection.
    pub fn new(io: I) -> Self {
        Self { io, pending: None }
    }
}

impl<I: AsyncWrite + Unpin> JsonParseErrors<I> {
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, done)) = &mut self.pending {
            let n = std::task::ready!(Pin::new(&mut self.io).poll_write(cx, &bytes[*done..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *done += n;
            if *done == bytes.len() {
                self.pending = None;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for JsonParseErrors<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for JsonParseErrors<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.poll_pending(cx))?;
        if let Some(status) = automatic_answer(buf) {
            self.pending = Some((with_json_body(buf, status), 0));
            // The caller's bytes are taken: they go out rewritten.
            let _ = self.poll_pending(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    // Not vectored: hyper then writes each head as one buffer, which is what
    // `automatic_answer` looks at.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_empty_parse_error_answers_are_rewritten() {
        let auto =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        assert_eq!(
            automatic_answer(auto),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        let out = String::from_utf8(with_json_body(auto, StatusCode::URI_TOO_LONG)).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{out}"
        );
        assert!(!head.contains("content-length: 0"), "{out}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "uri_too_long");
        // The router's own answers have bodies, or are not parse errors.
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 50\r\n\r\n";
        assert_eq!(automatic_answer(ours), None);
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(automatic_answer(ok), None);
    }
}
