//! HTTP/1.1 to the API, one request per connection, over the unix socket or
//! TCP, with the bearer token when there is one. [`Transport::send`] and
//! [`Transport::send_raw`] speak untyped JSON and text, for the tests that
//! check the wire itself; programs use the typed [`Client`](crate::Client).

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use super::endpoint::Endpoint;
use super::error::Error;

/// Carries requests to the API.
#[derive(Debug, Clone)]
pub struct Transport {
    endpoint: Endpoint,
    token: Option<String>,
}

/// One answer: status and JSON body (`Null` when empty).
#[derive(Debug, Clone)]
pub struct Answer {
    /// The answer's status.
    pub status: StatusCode,
    /// The answer's body.
    pub body: Value,
}

impl Transport {
    /// A transport to `endpoint`, sending `token` as a bearer token when given.
    pub fn new(endpoint: Endpoint, token: Option<String>) -> Self {
        Self { endpoint, token }
    }

    /// Sends one request; the answer's body is JSON, whatever its status.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Answer, Error> {
        let (status, bytes) = self.exchange(method, path, body.map(json)).await?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|_| Error::NotJson {
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
    ) -> Result<(StatusCode, String), Error> {
        let (status, bytes) = self.exchange(method, path, body.map(json)).await?;
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }

    /// Sends one request with a JSON `body`; the answer's status and whole body.
    pub(crate) async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), Error> {
        let resp = self.request(method, path, body).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes))
    }

    /// Sends one request with a JSON `body`; the answer with its body as it
    /// arrives (an event stream).
    pub(crate) async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Response<Incoming>, Error> {
        let (host, mut sender) =
            match &self.endpoint {
                Endpoint::Unix(p) => {
                    let stream = tokio::net::UnixStream::connect(p).await.map_err(|source| {
                        Error::Connect {
                            endpoint: format!("unix:{}", p.display()),
                            source,
                        }
                    })?;
                    ("localhost".to_string(), handshake(stream).await?)
                }
                Endpoint::Tcp(hp) => {
                    let stream = tokio::net::TcpStream::connect(hp).await.map_err(|source| {
                        Error::Connect {
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
            Some(bytes) => {
                req = req.header(hyper::header::CONTENT_TYPE, "application/json");
                Bytes::from(bytes)
            }
            None => Bytes::new(),
        };
        Ok(sender.send_request(req.body(Full::new(payload))?).await?)
    }
}

/// A JSON body.
pub(crate) fn json<T: serde::Serialize + ?Sized>(body: &T) -> Vec<u8> {
    serde_json::to_vec(body).expect("the model serializes to JSON")
}

async fn handshake<S>(
    stream: S,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}
