//! `blockplane dashboard`: a port-forward from a local TCP address to the API,
//! so that a browser can open the dashboard of a service that listens only on
//! its unix socket. Every request goes through unchanged (the browser's own
//! `Authorization` header included) on a fresh upstream connection, and
//! answers stream back as they come, so the event stream is never buffered.
//!
//! The socket gives full control of the host's volumes to whoever reaches it.
//! Without a token the forward therefore listens on loopback only and answers
//! only requests addressed to a loopback name (a page on another site cannot
//! reach it through DNS rebinding); with `--token` it may listen anywhere and
//! requires that token on every request but the dashboard's static files.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use subtle::ConstantTimeEq;

use blockplane_api::model::{ErrorBody, ErrorCode, ErrorDetail};
use blockplane_client::Endpoint;

/// Why the forward could not start.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The listen address is not `HOST:PORT`.
    #[error("invalid listen address '{0}': use HOST:PORT, e.g. 127.0.0.1:8080")]
    Listen(String),
    /// An address other than loopback without a token.
    #[error(
        "refusing to listen on {0} without a token: whoever reaches the API socket controls this host's volumes; listen on a loopback address (127.0.0.1, [::1]), or set --token/BLOCKPLANE_TOKEN so that every request must carry it"
    )]
    NotLoopback(SocketAddr),
    /// The address cannot be listened on.
    #[error("listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// Accepting connections failed.
    #[error("serving on {addr}: {source}")]
    Serve {
        /// The address.
        addr: SocketAddr,
        /// How it failed.
        #[source]
        source: std::io::Error,
    },
}

/// What to forward where.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The local address browsers connect to.
    pub listen: SocketAddr,
    /// The API.
    pub upstream: Endpoint,
    /// When set, every request but the dashboard's files must carry it.
    pub token: Option<String>,
}

impl ProxyConfig {
    /// Parses and checks the listen address against the token rule.
    pub fn new(
        listen: &str,
        upstream: Endpoint,
        token: Option<String>,
    ) -> Result<Self, ProxyError> {
        let addr: SocketAddr = listen
            .parse()
            .map_err(|_| ProxyError::Listen(listen.to_string()))?;
        let token = token.filter(|t| !t.is_empty());
        if token.is_none() && !addr.ip().is_loopback() {
            return Err(ProxyError::NotLoopback(addr));
        }
        Ok(Self {
            listen: addr,
            upstream,
            token,
        })
    }
}

/// Binds the listen address, calls `ready` with the bound address (the port
/// may have been 0), then forwards until the process ends.
pub async fn run(cfg: ProxyConfig, ready: impl FnOnce(SocketAddr)) -> Result<(), ProxyError> {
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ProxyError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ProxyError::Bind {
        addr: cfg.listen,
        source,
    })?;
    ready(addr);
    // No graceful drain: a forward keeps no state, and an open event stream
    // would hold a drain forever.
    axum::serve(listener, app(cfg))
        .await
        .map_err(|source| ProxyError::Serve { addr, source })
}

/// The forward as a router (every path, every method).
pub fn app(cfg: ProxyConfig) -> Router {
    Router::new().fallback(forward).with_state(Arc::new(cfg))
}

/// Headers that describe one connection, not the message: never forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Headers the Connection header names are per-connection too.
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    for n in HOP_BY_HOP
        .iter()
        .copied()
        .chain(named.iter().map(String::as_str))
    {
        h.remove(n);
    }
}

fn error(status: StatusCode, code: ErrorCode, message: String) -> Response {
    let body = ErrorBody {
        error: ErrorDetail { code, message },
    };
    (status, axum::Json(body)).into_response()
}

/// Whether the request names this host by a loopback name or address.
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        // [v6]:port
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(n, _)| n),
    };
    name.eq_ignore_ascii_case("localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn token_ok(headers: &HeaderMap, expected: &str) -> bool {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Constant time: the comparison must not tell how much matched.
    bool::from(presented.as_bytes().ct_eq(expected.as_bytes()))
}

async fn forward(State(cfg): State<Arc<ProxyConfig>>, req: Request) -> Response {
    match &cfg.token {
        None if !loopback_host(req.headers()) => {
            return error(
                StatusCode::FORBIDDEN,
                ErrorCode::ForbiddenHost,
                "this port-forward answers only requests for localhost, 127.0.0.1 or [::1]; \
                 start it with --token to serve other names"
                    .into(),
            );
        }
        Some(t) if !crate::http::is_public_asset(&req) && !token_ok(req.headers(), t) => {
            let mut r = error(
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                "this request needs the header 'Authorization: Bearer <token>' with the token the dashboard port-forward was started with".into(),
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
        _ => {}
    }
    // With the service down, the dashboard's own files come from this
    // binary, so the browser gets the pages (which then say the API is
    // unreachable) rather than a JSON error in place of a page.
    let local = crate::dashboard::asset(req.uri().path()).filter(|_| {
        matches!(
            *req.method(),
            axum::http::Method::GET | axum::http::Method::HEAD
        )
    });
    match send(&cfg.upstream, req).await {
        Ok(resp) => resp,
        Err(_) if local.is_some() => crate::dashboard::serve(local.expect("checked")),
        Err(e) => error(StatusCode::BAD_GATEWAY, ErrorCode::ApiUnreachable, e),
    }
}

/// Sends one request to the API on a new connection and returns its answer,
/// whose body streams from that connection.
async fn send(upstream: &Endpoint, req: Request) -> Result<Response, String> {
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = path.parse().map_err(|e| format!("request path: {e}"))?;
    parts.version = hyper::Version::HTTP_11;
    let (host, mut sender) = match upstream {
        Endpoint::Unix(p) => {
            let s = tokio::net::UnixStream::connect(p).await.map_err(|e| {
                format!(
                    "cannot connect to the blockplane API at unix:{}: {e}",
                    p.display()
                )
            })?;
            ("localhost".to_string(), handshake(s).await?)
        }
        Endpoint::Tcp(hp) => {
            let s = tokio::net::TcpStream::connect(hp)
                .await
                .map_err(|e| format!("cannot connect to the blockplane API at {hp}: {e}"))?;
            (hp.clone(), handshake(s).await?)
        }
    };
    parts.headers.insert(
        header::HOST,
        HeaderValue::from_str(&host).map_err(|e| format!("upstream host: {e}"))?,
    );
    let resp = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(|e| format!("the blockplane API did not answer: {e}"))?;
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)))
}

async fn handshake<S>(stream: S) -> Result<hyper::client::conn::http1::SendRequest<Body>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP to the blockplane API: {e}"))?;
    // The connection lives as long as the answer's body is read.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(h: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(header::HOST, HeaderValue::from_str(h).unwrap());
        m
    }

    #[test]
    fn only_loopback_names_pass_without_a_token() {
        for ok in [
            "localhost",
            "localhost:8080",
            "127.0.0.1:80",
            "127.1.2.3",
            "[::1]:8080",
            "LOCALHOST:1",
        ] {
            assert!(loopback_host(&host(ok)), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "10.0.0.1:80",
            "[::2]:1",
            "localhost.evil:1",
        ] {
            assert!(!loopback_host(&host(bad)), "{bad}");
        }
        assert!(!loopback_host(&HeaderMap::new()));
    }

    #[test]
    fn non_loopback_needs_a_token() {
        let up = Endpoint::Unix("/nonexistent.sock".into());
        assert!(matches!(
            ProxyConfig::new("0.0.0.0:8080", up.clone(), None),
            Err(ProxyError::NotLoopback(_))
        ));
        assert!(matches!(
            ProxyConfig::new("0.0.0.0:8080", up.clone(), Some(String::new())),
            Err(ProxyError::NotLoopback(_))
        ));
        assert!(ProxyConfig::new("0.0.0.0:8080", up.clone(), Some("t".into())).is_ok());
        assert!(ProxyConfig::new("127.0.0.1:0", up.clone(), None).is_ok());
        assert!(matches!(
            ProxyConfig::new("localhost", up, None),
            Err(ProxyError::Listen(_))
        ));
    }

    #[test]
    fn hop_by_hop_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-per-hop"),
        );
        h.insert("x-per-hop", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(header::AUTHORIZATION));
    }
}
