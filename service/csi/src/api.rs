//! The blockplane API as the driver calls it: the typed [`Client`], with the
//! volume each call is for added to its errors, and a missing object read
//! as `None` (or `false`) where the driver expects one may be gone. The
//! driver changes blockplane only through these public endpoints.

use hyper::StatusCode;

use super::errors::CsiError;
use blockplane_api::model::{
    AllocatedQuery, ChangesQuery, CreateImageRequest, CreateRemoteRequest, CreateSnapshotRequest,
    CreateVolumeRequest, DeleteExportQuery, DeleteImageQuery, ErrorCode, Event, EventQuery, Export,
    ExportRequest, Host, Image, ImageRanges, ListImagesQuery, PatchVolumeRequest, Remote,
    ResizeImageRequest, ResizeImageResponse, UnlockVolumeRequest, Volume,
};
use blockplane_client::{self as client, Client};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The blockplane API, its errors naming the volume they are for.
#[derive(Debug, Clone)]
pub struct Api {
    client: Client,
}

/// The name errors of calls for no one volume carry.
const ANY: &str = "*";

impl Api {
    /// An API client.
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// The volume of that name; `None` when there is none.
    pub async fn volume(&self, name: &str) -> Result<Option<Volume>, CsiError> {
        found(name, self.client.volume(name).await)
    }

    /// Every volume.
    pub async fn volumes(&self) -> Result<Vec<Volume>, CsiError> {
        self.client.volumes().await.named(ANY)
    }

    /// The image of that name; `None` when there is none.
    pub async fn image(&self, name: &str) -> Result<Option<Image>, CsiError> {
        found(name, self.client.image(name).await)
    }

    /// Every image.
    pub async fn images(&self) -> Result<Vec<Image>, CsiError> {
        let all = ListImagesQuery::default();
        self.client.images(&all).await.named(ANY)
    }

    /// A page of the ranges of snapshot image `image` that hold data; errors
    /// name `snapshot`, its CSI id.
    pub async fn image_allocated(
        &self,
        snapshot: &str,
        image: &str,
        q: &AllocatedQuery,
    ) -> Result<ImageRanges, CsiError> {
        self.client.image_allocated(image, q).await.named(snapshot)
    }

    /// A page of the ranges of snapshot image `image` whose bytes differ
    /// from `q.base`'s; errors name `snapshot`, its CSI id.
    pub async fn image_changes(
        &self,
        snapshot: &str,
        image: &str,
        q: &ChangesQuery,
    ) -> Result<ImageRanges, CsiError> {
        self.client.image_changes(image, q).await.named(snapshot)
    }

    /// The host.
    pub async fn host(&self) -> Result<Host, CsiError> {
        self.client.host().await.named(ANY)
    }

    /// Creates image `req.name` (`ready`, or `copying` for a clone).
    pub async fn create_image(&self, req: &CreateImageRequest) -> Result<Image, CsiError> {
        self.client.create_image(req).await.named(&req.name)
    }

    /// Snapshots image `source` as `req.name` (`ready`, or `copying`).
    pub async fn snapshot_image(
        &self,
        source: &str,
        req: &CreateSnapshotRequest,
    ) -> Result<Image, CsiError> {
        self.client
            .snapshot_image(source, req)
            .await
            .named(&req.name)
    }

    /// Creates volume `req.name` (idempotent by name in the API too).
    pub async fn create_volume(&self, req: &CreateVolumeRequest) -> Result<Volume, CsiError> {
        self.client.create_volume(req).await.named(&req.name)
    }

    /// Opens a locked encrypted volume's plaintext device with its key (on
    /// a volume serving it already, checks the key).
    pub async fn unlock_volume(
        &self,
        name: &str,
        req: &UnlockVolumeRequest,
    ) -> Result<Volume, CsiError> {
        self.client.unlock_volume(name, req).await.named(name)
    }

    /// Changes the live volume of that name (every change checked before
    /// any is made).
    pub async fn patch_volume(
        &self,
        name: &str,
        req: &PatchVolumeRequest,
    ) -> Result<Volume, CsiError> {
        self.client.patch_volume(name, req).await.named(name)
    }

    /// Deletes the volume of that name; `false` when there was none.
    pub async fn delete_volume(&self, name: &str) -> Result<bool, CsiError> {
        found(name, self.client.delete_volume(name).await).map(|d| d.is_some())
    }

    /// Deletes the image of that name and its file; `false` when there was none.
    pub async fn delete_image(&self, name: &str) -> Result<bool, CsiError> {
        let query = DeleteImageQuery {
            delete_file: true,
            erase: false,
        };
        let r = self.client.delete_image(name, &query).await;
        found(name, r).map(|d| d.is_some())
    }

    /// Grows the image of that name.
    pub async fn resize_image(
        &self,
        name: &str,
        req: &ResizeImageRequest,
    ) -> Result<ResizeImageResponse, CsiError> {
        self.client.resize_image(name, req).await.named(name)
    }

    /// The events of `kind` in the last `window` (at most the newest 1000),
    /// of the volume of that name or of every volume.
    pub async fn recent_events(
        &self,
        volume: Option<&str>,
        kind: &str,
        window: std::time::Duration,
    ) -> Result<Vec<Event>, CsiError> {
        let since = (OffsetDateTime::now_utc() - window)
            .format(&Rfc3339)
            .expect("an RFC 3339 time formats");
        let query = EventQuery {
            volume: volume.map(str::to_string),
            since: Some(since),
            kind: Some(kind.to_string()),
            limit: Some(1000),
        };
        self.client
            .events(&query)
            .await
            .named(volume.unwrap_or(ANY))
    }

    /// The export of the volume of that name; `None` when it has none.
    pub async fn export(&self, name: &str) -> Result<Option<Export>, CsiError> {
        match self.client.export(name).await {
            Err(client::Error::Refused {
                code: ErrorCode::ExportNotFound,
                ..
            }) => Ok(None),
            r => found(name, r),
        }
    }

    /// Exports the volume of that name to `req.hosts`; the answer carries
    /// their keys.
    pub async fn put_export(&self, name: &str, req: &ExportRequest) -> Result<Export, CsiError> {
        self.client.put_export(name, req).await.named(name)
    }

    /// Removes the export of the volume of that name, even with hosts
    /// connected; `false` when there was none.
    pub async fn delete_export(&self, name: &str) -> Result<bool, CsiError> {
        let q = DeleteExportQuery { force: true };
        match self.client.delete_export_with(name, &q).await {
            Err(client::Error::Refused {
                code: ErrorCode::ExportNotFound,
                ..
            }) => Ok(false),
            r => found(name, r).map(|d| d.is_some()),
        }
    }

    /// The remote volume of that name; `None` when there is none.
    pub async fn remote(&self, name: &str) -> Result<Option<Remote>, CsiError> {
        found(name, self.client.remote(name).await)
    }

    /// Connects a remote volume (idempotent by name in the API).
    pub async fn create_remote(&self, req: &CreateRemoteRequest) -> Result<Remote, CsiError> {
        self.client.create_remote(req).await.named(&req.name)
    }

    /// Disconnects the remote volume of that name; `false` when there was
    /// none.
    pub async fn delete_remote(&self, name: &str) -> Result<bool, CsiError> {
        found(name, self.client.delete_remote(name).await).map(|d| d.is_some())
    }

    /// Whether the service answers its health check.
    pub async fn healthy(&self) -> bool {
        self.client.health().await.is_ok()
    }
}

/// Names the volume a call was for in its error.
trait Named<T> {
    fn named(self, volume: &str) -> Result<T, CsiError>;
}

impl<T> Named<T> for Result<T, client::Error> {
    fn named(self, volume: &str) -> Result<T, CsiError> {
        self.map_err(|e| failed(volume, e))
    }
}

/// An answer, `None` for a 404.
fn found<T>(volume: &str, r: Result<T, client::Error>) -> Result<Option<T>, CsiError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(client::Error::Refused {
            status: StatusCode::NOT_FOUND,
            ..
        }) => Ok(None),
        Err(e) => Err(failed(volume, e)),
    }
}

/// A failed call for `volume`.
fn failed(volume: &str, e: client::Error) -> CsiError {
    let volume = volume.to_string();
    match e {
        client::Error::Refused {
            request,
            status,
            code,
            message,
        } => CsiError::Api {
            volume,
            request,
            status,
            code,
            message,
        },
        client::Error::Unexpected { .. } => CsiError::Internal {
            volume,
            reason: e.to_string(),
        },
        source => CsiError::Unreachable { volume, source },
    }
}
