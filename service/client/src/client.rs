//! [`Client`]: the requests the operations' modules make, each answered
//! typed or as the API's error.

use hyper::body::Bytes;
use hyper::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::endpoint::Endpoint;
use super::error::Error;
use super::transport::{self, Transport};

/// A typed client of the API.
#[derive(Debug, Clone)]
pub struct Client {
    pub(crate) transport: Transport,
}

impl Client {
    /// A client of the API at `endpoint`, sending `token` as a bearer token
    /// when given.
    pub fn new(endpoint: Endpoint, token: Option<String>) -> Self {
        Self {
            transport: Transport::new(endpoint, token),
        }
    }

    /// A GET whose 2xx answer is a `T`.
    pub(crate) async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call(Method::GET, path, None).await
    }

    /// A request with `body` whose 2xx answer is a `T`.
    pub(crate) async fn send<T: DeserializeOwned, B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: &B,
    ) -> Result<T, Error> {
        self.call(method, path, Some(transport::json(body))).await
    }

    /// A request answered with no body (204).
    pub(crate) async fn empty(&self, method: Method, path: &str) -> Result<(), Error> {
        self.exchange(method, path, None).await.map(drop)
    }

    /// A request whose 2xx answer is a `T`.
    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, Error> {
        let (status, bytes) = self.exchange(method.clone(), path, body).await?;
        serde_json::from_slice(&bytes).map_err(|source| Error::Unexpected {
            request: format!("{method} {path}"),
            status,
            source,
        })
    }

    /// One request; its 2xx answer's status and body, else its error.
    pub(crate) async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), Error> {
        let (status, bytes) = self.transport.exchange(method.clone(), path, body).await?;
        if status.is_success() {
            Ok((status, bytes))
        } else {
            Err(Error::answer(format!("{method} {path}"), status, &bytes))
        }
    }
}
