//! The API's client. [`Client`] calls every operation of the API with the
//! model's types and answers them typed; an error answer is
//! [`Error::Refused`] with its status, [`ErrorCode`](blockplane_api::model::ErrorCode)
//! and message. [`Transport`] carries the requests, one connection each,
//! over the unix socket or TCP.
//!
//! The operations live in one module per part of the API: images, volumes,
//! events, and the rest (host, orphans, health, metrics).

mod backups;
mod endpoint;
mod error;
pub mod events;
mod images;
mod path;
mod system;
mod transport;
mod volumes;

use hyper::body::Bytes;
use hyper::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use endpoint::Endpoint;
pub use error::Error;
pub use path::encode_segment;
pub use transport::{Answer, Transport};

/// A typed client of the API.
#[derive(Debug, Clone)]
pub struct Client {
    transport: Transport,
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
    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call(Method::GET, path, None).await
    }

    /// A request with `body` whose 2xx answer is a `T`.
    async fn send<T: DeserializeOwned, B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: &B,
    ) -> Result<T, Error> {
        self.call(method, path, Some(transport::json(body))).await
    }

    /// A request answered with no body (204).
    async fn empty(&self, method: Method, path: &str) -> Result<(), Error> {
        self.exchange(method, path, None).await.map(drop)
    }

    /// A request whose 2xx answer is a `T`.
    async fn call<T: DeserializeOwned>(
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
    async fn exchange(
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
