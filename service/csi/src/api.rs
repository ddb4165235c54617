//! The blockplane API as the driver uses it: typed calls over the service's
//! own [`Client`] (unix socket or TCP, bearer token). The driver changes
//! blockplane only through these public endpoints.

use hyper::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::errors::CsiError;
use blockplane_api::client::{Answer, Transport, encode_segment};
use blockplane_api::model::{
    Allocation, CreateVolumeRequest, ErrorCode, Host, Image, ResizeImageResponse, Volume,
};

/// A typed client of the blockplane API.
#[derive(Debug, Clone)]
pub struct Api {
    client: Transport,
}

impl Api {
    /// An API client.
    pub fn new(client: Transport) -> Self {
        Self { client }
    }

    async fn call(
        &self,
        volume: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Answer, CsiError> {
        self.client
            .send(method, path, body.as_ref())
            .await
            .map_err(|source| CsiError::Unreachable {
                volume: volume.to_string(),
                source,
            })
    }

    fn refused(volume: &str, request: String, a: &Answer) -> CsiError {
        CsiError::Api {
            volume: volume.to_string(),
            request,
            status: a.status,
            code: ErrorCode::from_wire(a.body["error"]["code"].as_str().unwrap_or("unknown")),
            message: a.body["error"]["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| a.body.to_string()),
        }
    }

    fn parse<T: DeserializeOwned>(volume: &str, request: &str, a: Answer) -> Result<T, CsiError> {
        serde_json::from_value(a.body).map_err(|e| CsiError::Internal {
            volume: volume.to_string(),
            reason: format!("cannot read the answer of blockplane API {request}: {e}"),
        })
    }

    /// Sends a request; a 2xx answer is parsed as `T`, `404` is `None` when
    /// `missing_ok`, anything else an error.
    async fn fetch<T: DeserializeOwned>(
        &self,
        volume: &str,
        method: Method,
        path: String,
        body: Option<Value>,
        missing_ok: bool,
    ) -> Result<Option<T>, CsiError> {
        let request = format!("{method} {path}");
        let a = self.call(volume, method, &path, body).await?;
        if a.status.is_success() {
            Self::parse(volume, &request, a).map(Some)
        } else if a.status == StatusCode::NOT_FOUND && missing_ok {
            Ok(None)
        } else {
            Err(Self::refused(volume, request, &a))
        }
    }

    /// `GET /v1/volumes/{name}`; `None` when there is none.
    pub async fn volume(&self, name: &str) -> Result<Option<Volume>, CsiError> {
        self.fetch(
            name,
            Method::GET,
            format!("/v1/volumes/{}", encode_segment(name)),
            None,
            true,
        )
        .await
    }

    /// `GET /v1/volumes`.
    pub async fn volumes(&self) -> Result<Vec<Volume>, CsiError> {
        Ok(self
            .fetch("*", Method::GET, "/v1/volumes".into(), None, false)
            .await?
            .unwrap_or_default())
    }

    /// `GET /v1/images/{name}`; `None` when there is none.
    pub async fn image(&self, name: &str) -> Result<Option<Image>, CsiError> {
        self.fetch(
            name,
            Method::GET,
            format!("/v1/images/{}", encode_segment(name)),
            None,
            true,
        )
        .await
    }

    /// `GET /v1/host`.
    pub async fn host(&self) -> Result<Host, CsiError> {
        self.fetch("*", Method::GET, "/v1/host".into(), None, false)
            .await?
            .ok_or_else(|| CsiError::Internal {
                volume: "*".into(),
                reason: "GET /v1/host answered nothing".into(),
            })
    }

    /// `POST /v1/images` with `create`: a new image file of `size_bytes`
    /// laid out as `allocation`; with `clone_from`, a writable clone of that
    /// image grown to `size_bytes` (201 ready, or 202 `copying`).
    pub async fn create_image(
        &self,
        name: &str,
        path: &str,
        size_bytes: u64,
        allocation: Allocation,
        clone_from: Option<&str>,
    ) -> Result<Image, CsiError> {
        let mut body = json!({
            "name": name,
            "path": path,
            "create": {"size_bytes": size_bytes, "allocation": allocation},
        });
        if let Some(source) = clone_from {
            body["clone_from"] = json!(source);
        }
        self.fetch(name, Method::POST, "/v1/images".into(), Some(body), false)
            .await?
            .ok_or_else(|| CsiError::Internal {
                volume: name.into(),
                reason: "POST /v1/images answered nothing".into(),
            })
    }

    /// `GET /v1/images`.
    pub async fn images(&self) -> Result<Vec<Image>, CsiError> {
        Ok(self
            .fetch("*", Method::GET, "/v1/images".into(), None, false)
            .await?
            .unwrap_or_default())
    }

    /// `POST /v1/images/{source}/snapshots`: a read-only snapshot `name` of
    /// image `source` (201 ready, or 202 `copying`).
    pub async fn snapshot_image(&self, source: &str, name: &str) -> Result<Image, CsiError> {
        self.fetch(
            name,
            Method::POST,
            format!("/v1/images/{}/snapshots", encode_segment(source)),
            Some(json!({"name": name})),
            false,
        )
        .await?
        .ok_or_else(|| CsiError::Internal {
            volume: name.into(),
            reason: "POST /v1/images/{id}/snapshots answered nothing".into(),
        })
    }

    /// `POST /v1/volumes` (idempotent by name in the API too).
    pub async fn create_volume(&self, req: &CreateVolumeRequest) -> Result<Volume, CsiError> {
        let body = serde_json::to_value(req).map_err(|e| CsiError::Internal {
            volume: req.name.clone(),
            reason: format!("cannot encode the volume request: {e}"),
        })?;
        self.fetch(
            &req.name,
            Method::POST,
            "/v1/volumes".into(),
            Some(body),
            false,
        )
        .await?
        .ok_or_else(|| CsiError::Internal {
            volume: req.name.clone(),
            reason: "POST /v1/volumes answered nothing".into(),
        })
    }

    /// `DELETE /v1/volumes/{name}`; `false` when there was none.
    pub async fn delete_volume(&self, name: &str) -> Result<bool, CsiError> {
        self.delete(name, format!("/v1/volumes/{}", encode_segment(name)))
            .await
    }

    /// `DELETE /v1/images/{name}?delete_file=true`; `false` when there was none.
    pub async fn delete_image(&self, name: &str) -> Result<bool, CsiError> {
        self.delete(
            name,
            format!("/v1/images/{}?delete_file=true", encode_segment(name)),
        )
        .await
    }

    async fn delete(&self, volume: &str, path: String) -> Result<bool, CsiError> {
        let a = self.call(volume, Method::DELETE, &path, None).await?;
        match a.status {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            _ => Err(Self::refused(volume, format!("DELETE {path}"), &a)),
        }
    }

    /// `POST /v1/images/{name}/resize`.
    pub async fn resize_image(
        &self,
        name: &str,
        size_bytes: u64,
    ) -> Result<ResizeImageResponse, CsiError> {
        self.fetch(
            name,
            Method::POST,
            format!("/v1/images/{}/resize", encode_segment(name)),
            Some(json!({"size_bytes": size_bytes})),
            false,
        )
        .await?
        .ok_or_else(|| CsiError::Internal {
            volume: name.into(),
            reason: "POST /v1/images/{id}/resize answered nothing".into(),
        })
    }

    /// Whether `GET /healthz` answers 200.
    pub async fn healthy(&self) -> bool {
        self.client
            .send(Method::GET, "/healthz", None)
            .await
            .is_ok_and(|a| a.status == StatusCode::OK)
    }
}
