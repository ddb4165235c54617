//! Accepting gRPC clients that name the socket path as the `:authority`.
//!
//! Over a unix socket, grpc-core (Python, C++) sends the %-encoded socket
//! path as the HTTP/2 `:authority`, and grpc-java the raw path. Neither is an
//! authority (RFC 3986 §3.2), and the `h2` crate under tonic answers such a
//! request with RST_STREAM before any handler sees it; it has no switch to
//! relax that. kubelet and the CSI sidecars (grpc-go) send `localhost`.
//!
//! So every connection's client-to-server bytes pass through [`Filtered`],
//! which decodes each header block and re-encodes it, with an `:authority`
//! that is not a valid authority replaced by `localhost`. All blocks are
//! re-encoded, not only the ones that change, because HPACK's dynamic table
//! is shared state: the server's decoder must see one encoder's blocks only.
//! The server-to-client direction passes through untouched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may set: re-encoded blocks are
/// cut to it, so they fit whatever the server advertises.
const MAX_FRAME: usize = 16_384;
/// HPACK's default dynamic table size, which the server keeps (it never
/// advertises another): the client's encoder cannot use more.
const TABLE_SIZE: usize = 4096;
/// What a refused authority becomes.
const LOCALHOST: &[u8] = b"localhost";

/// A connection whose header blocks from the client are rewritten as the
/// module says.
pub struct Filtered<S> {
    inner: S,
    rewrite: Rewriter,
    /// Bytes read from the client and not yet rewritten (a partial frame).
    raw: BytesMut,
    /// Rewritten bytes not yet handed to the server.
    ready: BytesMut,
    eof: bool,
}

impl<S> Filtered<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewrite: Rewriter::new(),
            raw: BytesMut::with_capacity(MAX_FRAME + FRAME_HEADER),
            ready: BytesMut::new(),
            eof: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Filtered<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // A partial frame at the end goes on as it came: the server
                // reports the truncation.
                let rest = this.raw.split();
                this.ready.unsplit(rest);
                if this.ready.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            this.rewrite
                .feed(&mut this.raw, &mut this.ready)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if !this.ready.is_empty() {
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                this.eof = true;
            }
            this.raw.extend_from_slice(rb.filled());
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Filtered<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Filtered<tokio::net::UnixStream> {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Why a client's byte stream could not be rewritten; the connection ends.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("CSI connection: a header block does not decode as HPACK: {0:?}")]
    Hpack(loona_hpack::decoder::DecoderError),
    #[error("CSI connection: a HEADERS frame's padding or priority exceeds the frame")]
    BadFrame,
    #[error("CSI connection: a CONTINUATION frame does not continue a header block")]
    StrayContinuation,
}

/// A header block being collected across HEADERS and CONTINUATION frames.
struct Pending {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// The client-to-server half of one connection: frames in, frames out.
struct Rewriter {
    preface_seen: bool,
    decoder: loona_hpack::Decoder<'static>,
    encoder: loona_hpack::Encoder<'static>,
    pending: Option<Pending>,
}

impl Rewriter {
    fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        let mut encoder = loona_hpack::Encoder::new();
        encoder.set_max_table_size(TABLE_SIZE);
        Self {
            preface_seen: false,
            decoder,
            encoder,
            pending: None,
        }
    }

    /// Moves every whole frame of `raw` to `out`, rewriting header blocks.
    fn feed(&mut self, raw: &mut BytesMut, out: &mut BytesMut) -> Result<(), RewriteError> {
        if !self.preface_seen {
            if raw.len() < PREFACE.len() {
                return Ok(());
            }
            // Anything else is not HTTP/2 with prior knowledge; it goes on
            // as it came, for the server to refuse.
            self.preface_seen = true;
            out.unsplit(raw.split_to(PREFACE.len()));
        }
        while raw.len() >= FRAME_HEADER {
            let len = u32::from_be_bytes([0, raw[0], raw[1], raw[2]]) as usize;
            if raw.len() < FRAME_HEADER + len {
                break;
            }
            let frame = raw.split_to(FRAME_HEADER + len);
            let (kind, flags) = (frame[3], frame[4]);
            let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
            let payload = &frame[FRAME_HEADER..];
            match kind {
                HEADERS => {
                    let (priority, fragment) = headers_payload(flags, payload)?;
                    self.pending = Some(Pending {
                        stream,
                        end_stream: flags & END_STREAM != 0,
                        priority,
                        block: fragment.to_vec(),
                    });
                }
                CONTINUATION => match &mut self.pending {
                    Some(p) if p.stream == stream => p.block.extend_from_slice(payload),
                    _ => return Err(RewriteError::StrayContinuation),
                },
                _ => {
                    out.unsplit(frame);
                    continue;
                }
            }
            if flags & END_HEADERS != 0 {
                let p = self.pending.take().expect("a block is being collected");
                self.emit(p, out)?;
            }
        }
        Ok(())
    }

    /// Re-encodes a whole header block and writes it as HEADERS, then
    /// CONTINUATION frames of at most [`MAX_FRAME`] bytes.
    fn emit(&mut self, p: Pending, out: &mut BytesMut) -> Result<(), RewriteError> {
        let mut headers = self.decoder.decode(&p.block).map_err(RewriteError::Hpack)?;
        for (name, value) in &mut headers {
            if name == b":authority" && http::uri::Authority::try_from(value.as_slice()).is_err() {
                *value = LOCALHOST.to_vec();
            }
        }
        let block = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let head = p.priority.as_ref().map_or(&[][..], |b| &b[..]);
        let first = block.len().min(MAX_FRAME - head.len());
        let mut flags = if p.end_stream { END_STREAM } else { 0 };
        if p.priority.is_some() {
            flags |= PRIORITY;
        }
        let (first_part, mut rest) = block.split_at(first);
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        put_frame(out, HEADERS, flags, p.stream, &[head, first_part]);
        while !rest.is_empty() {
            let (part, tail) = rest.split_at(rest.len().min(MAX_FRAME));
            rest = tail;
            let flags = if rest.is_empty() { END_HEADERS } else { 0 };
            put_frame(out, CONTINUATION, flags, p.stream, &[part]);
        }
        Ok(())
    }
}

/// A HEADERS frame's priority fields and header block fragment, without its
/// padding (RFC 9113 §6.2).
fn headers_payload(flags: u8, payload: &[u8]) -> Result<(Option<[u8; 5]>, &[u8]), RewriteError> {
    let mut body = payload;
    if flags & PADDED != 0 {
        let (&pad, rest) = body.split_first().ok_or(RewriteError::BadFrame)?;
        let keep = rest
            .len()
            .checked_sub(pad as usize)
            .ok_or(RewriteError::BadFrame)?;
        body = &rest[..keep];
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        let (fields, rest) = body.split_at_checked(5).ok_or(RewriteError::BadFrame)?;
        priority = Some(fields.try_into().expect("five bytes"));
        body = rest;
    }
    Ok((priority, body))
}

fn put_frame(out: &mut BytesMut, kind: u8, flags: u8, stream: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.put_slice(&(len as u32).to_be_bytes()[1..]);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
    for p in parts {
        out.put_slice(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Headers = Vec<(Vec<u8>, Vec<u8>)>;

    fn request(authority: &str, path: &str) -> Headers {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
    }

    /// What a client sends: the preface, a SETTINGS frame, then each request
    /// as HEADERS cut into CONTINUATIONs of `cut` bytes, with the flags given.
    fn client_bytes(requests: &[Headers], cut: usize, extra_flags: u8) -> Vec<u8> {
        let mut enc = loona_hpack::Encoder::new();
        let mut out = BytesMut::from(PREFACE);
        put_frame(&mut out, 0x4, 0, 0, &[]);
        for (i, h) in requests.iter().enumerate() {
            let stream = 1 + 2 * i as u32;
            let block = enc.encode(h.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
            let chunks: Vec<&[u8]> = block.chunks(cut).collect();
            let mut head = Vec::new();
            let mut tail = Vec::new();
            if extra_flags & PADDED != 0 {
                head.push(3u8);
                tail.extend_from_slice(&[0, 0, 0]);
            }
            if extra_flags & PRIORITY != 0 {
                head.extend_from_slice(&[0, 0, 0, 0, 15]);
            }
            let last = chunks.len() == 1;
            let flags = extra_flags | if last { END_HEADERS } else { 0 };
            put_frame(&mut out, HEADERS, flags, stream, &[&head, chunks[0], &tail]);
            for (j, c) in chunks.iter().enumerate().skip(1) {
                let flags = if j + 1 == chunks.len() {
                    END_HEADERS
                } else {
                    0
                };
                put_frame(&mut out, CONTINUATION, flags, stream, &[c]);
            }
            put_frame(&mut out, 0x0, END_STREAM, stream, &[b"\0\0\0\0\0"]);
        }
        out.to_vec()
    }

    /// Runs `bytes` through a rewriter, `step` bytes at a time, and decodes
    /// the header blocks that come out as a server would.
    fn server_sees(bytes: &[u8], step: usize) -> (Vec<Headers>, Vec<(u8, u8)>) {
        let mut rw = Rewriter::new();
        let mut raw = BytesMut::new();
        let mut out = BytesMut::new();
        for piece in bytes.chunks(step) {
            raw.extend_from_slice(piece);
            rw.feed(&mut raw, &mut out).unwrap();
        }
        assert!(raw.is_empty(), "every whole frame went on");
        assert_eq!(&out[..PREFACE.len()], PREFACE);
        let mut frames = &out[PREFACE.len()..];
        let mut dec = loona_hpack::Decoder::new();
        let (mut blocks, mut kinds, mut block) = (Vec::new(), Vec::new(), Vec::new());
        while !frames.is_empty() {
            let len = u32::from_be_bytes([0, frames[0], frames[1], frames[2]]) as usize;
            let (kind, flags) = (frames[3], frames[4]);
            let payload = &frames[FRAME_HEADER..FRAME_HEADER + len];
            assert!(len <= MAX_FRAME);
            kinds.push((kind, flags));
            if kind == HEADERS || kind == CONTINUATION {
                let skip = if flags & PRIORITY != 0 { 5 } else { 0 };
                block.extend_from_slice(&payload[skip..]);
                if flags & END_HEADERS != 0 {
                    blocks.push(dec.decode(&std::mem::take(&mut block)).unwrap());
                }
            }
            frames = &frames[FRAME_HEADER + len..];
        }
        (blocks, kinds)
    }

    #[test]
    fn a_socket_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let sent = [
            request("%2Ftmp%2Fcsi.sock", "/csi.v1.Identity/GetPluginInfo"),
            // The client's dynamic table now holds its authority: the second
            // request may name it by index, and must still arrive rewritten.
            request("%2Ftmp%2Fcsi.sock", "/csi.v1.Identity/Probe"),
            request(
                "/var/lib/kubelet/plugins/csi.sock",
                "/csi.v1.Node/NodeGetInfo",
            ),
            request("localhost", "/csi.v1.Identity/Probe"),
            request("node-1:8080", "/csi.v1.Identity/Probe"),
        ];
        let (blocks, _) = server_sees(&client_bytes(&sent, 4096, 0), 7);
        let authority = |h: &Headers| {
            h.iter()
                .find(|(n, _)| n == b":authority")
                .map(|(_, v)| String::from_utf8(v.clone()).unwrap())
                .unwrap()
        };
        let seen: Vec<String> = blocks.iter().map(authority).collect();
        assert_eq!(
            seen,
            [
                "localhost",
                "localhost",
                "localhost",
                "localhost",
                "node-1:8080"
            ]
        );
        for (got, want) in blocks.iter().zip(&sent) {
            let others = |h: &Headers| -> Headers {
                h.iter()
                    .filter(|(n, _)| n != b":authority")
                    .cloned()
                    .collect()
            };
            assert_eq!(others(got), others(want), "other headers, in order");
        }
    }

    #[test]
    fn continuations_padding_and_priority_are_read_and_flags_kept() {
        let mut big = request("%2Fa.sock", "/csi.v1.Controller/CreateVolume");
        big.push((b"x-big".to_vec(), vec![b'v'; 40_000]));
        let bytes = client_bytes(&[big.clone()], 1000, PADDED | PRIORITY);
        let (blocks, kinds) = server_sees(&bytes, 1);
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0][3].1, b"localhost");
        assert_eq!(blocks[0][6], big[6]);
        // HEADERS keeps its priority, loses the padding, and the 40 KB block
        // comes out in frames of at most 16 KiB, END_HEADERS on the last.
        let headers: Vec<_> = kinds
            .iter()
            .filter(|(k, _)| *k == HEADERS || *k == CONTINUATION)
            .collect();
        assert_eq!(headers.len(), 3);
        assert_eq!(headers[0].1 & (PRIORITY | PADDED | END_HEADERS), PRIORITY);
        assert_eq!(headers[2], &(CONTINUATION, END_HEADERS));
    }

    #[test]
    fn a_continuation_without_headers_ends_the_connection() {
        let mut raw = BytesMut::from(PREFACE);
        put_frame(&mut raw, CONTINUATION, END_HEADERS, 1, &[b"\x82"]);
        let err = Rewriter::new()
            .feed(&mut raw, &mut BytesMut::new())
            .unwrap_err();
        assert!(matches!(err, RewriteError::StrayContinuation));
    }
}
