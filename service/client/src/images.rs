//! `/v1/images`: images, their growth, allocation, snapshots and clones.

use hyper::Method;

use super::client::Client;
use super::error::Error;
use super::path::{encode_segment, with_query};
use blockplane_api::model::{
    ActivateImageRequest, ActivatedImage, AddKeyRequest, AllocatedQuery, ChangesQuery,
    CreateImageRequest, CreateSnapshotRequest, DeleteImageQuery, Image, ImageRanges, KeySlotAdded,
    ListImagesQuery, PatchImageRequest, RemoveKeyRequest, ResizeImageRequest, ResizeImageResponse,
};

fn image_path(image: &str) -> String {
    format!("/v1/images/{}", encode_segment(image))
}

impl Client {
    /// `GET /v1/images`.
    pub async fn images(&self, query: &ListImagesQuery) -> Result<Vec<Image>, Error> {
        self.get(&with_query("/v1/images".into(), query)).await
    }

    /// `GET /v1/images/{id}`: the image of that id or name.
    pub async fn image(&self, image: &str) -> Result<Image, Error> {
        self.get(&image_path(image)).await
    }

    /// `POST /v1/images`: registers a file, creates one, or clones an image
    /// (`ready`, or `copying` while a background copy fills it).
    pub async fn create_image(&self, req: &CreateImageRequest) -> Result<Image, Error> {
        self.send(Method::POST, "/v1/images", req).await
    }

    /// `PATCH /v1/images/{id}`: its labels set and removed as `req` says.
    pub async fn patch_image(&self, image: &str, req: &PatchImageRequest) -> Result<Image, Error> {
        self.send(Method::PATCH, &image_path(image), req).await
    }

    /// `DELETE /v1/images/{id}`.
    pub async fn delete_image(&self, image: &str, query: &DeleteImageQuery) -> Result<(), Error> {
        self.empty(Method::DELETE, &with_query(image_path(image), query))
            .await
    }

    /// `POST /v1/images/{id}/keys`: a new key slot of an encrypted image.
    pub async fn add_image_key(
        &self,
        image: &str,
        req: &AddKeyRequest,
    ) -> Result<KeySlotAdded, Error> {
        let path = format!("{}/keys", image_path(image));
        self.send(Method::POST, &path, req).await
    }

    /// `DELETE /v1/images/{id}/keys/{slot}`: a key slot removed.
    pub async fn remove_image_key(
        &self,
        image: &str,
        slot: u32,
        req: &RemoveKeyRequest,
    ) -> Result<Image, Error> {
        let path = format!("{}/keys/{slot}", image_path(image));
        self.send(Method::DELETE, &path, req).await
    }

    /// `POST /v1/images/{id}/resize`: grows the image; attached volumes follow.
    pub async fn resize_image(
        &self,
        image: &str,
        req: &ResizeImageRequest,
    ) -> Result<ResizeImageResponse, Error> {
        let path = format!("{}/resize", image_path(image));
        self.send(Method::POST, &path, req).await
    }

    /// `POST /v1/images/{id}/allocate`: starts writing zeros over the image's
    /// holes; the image's `allocate` shows the progress.
    pub async fn allocate_image(&self, image: &str) -> Result<Image, Error> {
        let path = format!("{}/allocate", image_path(image));
        self.call(Method::POST, &path, None).await
    }

    /// `POST /v1/images/{id}/standby/check`: lists the backup target for
    /// a standby's newer backups now, starting an apply of the newest.
    pub async fn check_standby(&self, image: &str) -> Result<Image, Error> {
        let path = format!("{}/standby/check", image_path(image));
        self.call(Method::POST, &path, None).await
    }

    /// `POST /v1/images/{id}/activate`: a standby becomes an ordinary image.
    pub async fn activate_image(
        &self,
        image: &str,
        req: &ActivateImageRequest,
    ) -> Result<ActivatedImage, Error> {
        let path = format!("{}/activate", image_path(image));
        self.send(Method::POST, &path, req).await
    }

    /// `DELETE /v1/images/{id}/allocate`: stops the image's running allocate.
    pub async fn cancel_allocate(&self, image: &str) -> Result<Image, Error> {
        let path = format!("{}/allocate", image_path(image));
        self.call(Method::DELETE, &path, None).await
    }

    /// `POST /v1/images/{id}/snapshots`: a read-only snapshot of the image
    /// (`ready`, or `copying` while a background copy fills it).
    pub async fn snapshot_image(
        &self,
        image: &str,
        req: &CreateSnapshotRequest,
    ) -> Result<Image, Error> {
        let path = format!("{}/snapshots", image_path(image));
        self.send(Method::POST, &path, req).await
    }

    /// `GET /v1/images/{id}/allocated`: a page of the ranges of a
    /// snapshot's device that hold data.
    pub async fn image_allocated(
        &self,
        image: &str,
        query: &AllocatedQuery,
    ) -> Result<ImageRanges, Error> {
        let path = format!("{}/allocated", image_path(image));
        self.get(&with_query(path, query)).await
    }

    /// `GET /v1/images/{id}/changes`: a page of the ranges of a snapshot's
    /// device whose bytes differ from another snapshot's of the same image.
    pub async fn image_changes(
        &self,
        image: &str,
        query: &ChangesQuery,
    ) -> Result<ImageRanges, Error> {
        let path = format!("{}/changes", image_path(image));
        self.get(&with_query(path, query)).await
    }
}
