//! A small HTTP client for the API, over the unix socket or TCP, used by the
//! CLI (and the black-box tests).

use std::path::PathBuf;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Where the API is.
#[derive(Debug, Clone)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port`.
    Tcp(String),
}

impl Endpoint {
    /// Parses `unix:/path`, `http://host:port` or `host:port`.
    pub fn parse(s: &str) -> Result<Self, ClientError> {
        if let Some(path) = s.strip_prefix("unix:") {
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
        if hostport.contains(':') && !hostport.contains('/') {
            Ok(Endpoint::Tcp(hostport.to_string()))
        } else {
            Err(ClientError::Endpoint(s.to_string()))
        }
    }
}

/// A failure to talk to the API (not an error answer from it).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid API address '{0}': use unix:/path.sock or http://host:port")]
    Endpoint(String),
    #[error("cannot connect to the blockplane API at {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("the API answered {status} with a body that is not JSON: {body}")]
    NotJson { status: StatusCode, body: String },
}

/// An API client.
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
}

/// One answer: status and JSON body (`Null` when empty).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Value,
}

impl Client {
    /// A client for `endpoint`, sending `token` as a bearer token when given.
    pub fn new(endpoint: Endpoint, token: Option<String>) -> Self {
        Self { endpoint, token }
    }

    /// Sends one request on a fresh connection; the answer's body is JSON.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Answer, ClientError> {
        let (status, bytes) = self.exchange(method, path, body).await?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|_| ClientError::NotJson {
                status,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            })?
        };
        Ok(Answer { status, body })
    }

    /// Sends one request; the answer's body as text (e.g. `/metrics`).
    pub async fn send_raw(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, String), ClientError> {
        let (status, bytes) = self.exchange(method, path, body).await?;
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }

    /// Sends one request; the answer's status and its body as it arrives
    /// (an event stream).
    pub async fn open(
        &self,
        method: Method,
        path: &str,
    ) -> Result<(StatusCode, hyper::body::Incoming), ClientError> {
        let resp = self.request(method, path, None).await?;
        Ok((resp.status(), resp.into_body()))
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let resp = self.request(method, path, body).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes))
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ClientError> {
        let (host, mut sender) = match &self.endpoint {
            Endpoint::Unix(p) => {
                let stream = tokio::net::UnixStream::connect(p).await.map_err(|source| {
                    ClientError::Connect {
                        endpoint: format!("unix:{}", p.display()),
                        source,
                    }
                })?;
                ("localhost".to_string(), handshake(stream).await?)
            }
            Endpoint::Tcp(hp) => {
                let stream = tokio::net::TcpStream::connect(hp).await.map_err(|source| {
                    ClientError::Connect {
                        endpoint: hp.clone(),
                        source,
                    }
                })?;
                (hp.clone(), handshake(stream).await?)
            }
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host);
        if let Some(t) = &self.token {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let payload = match body {
            Some(v) => {
                req = req.header(hyper::header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(v).expect("serializing JSON"))
            }
            None => Bytes::new(),
        };
        Ok(sender.send_request(req.body(Full::new(payload))?).await?)
    }
}

async fn handshake<S>(
    stream: S,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, ClientError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// Percent-encodes one URL path segment or query value (names are
/// `[a-z0-9._-]`, so this is a safeguard rather than a need).
pub fn encode_segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
