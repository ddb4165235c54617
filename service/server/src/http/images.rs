//! `/v1/images`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use super::error::ApiError;
use super::extract::{ApiJson, ApiQuery};
use super::{AppState, detached};
use blockplane_api::model::{
    ActivateImageRequest, ActivatedImage, AddKeyRequest, AllocatedQuery, ChangesQuery,
    CreateImageRequest, CreateSnapshotRequest, DeleteImageQuery, ErrorBody, Image, ImageRanges,
    ImageState, KeySlotAdded, ListImagesQuery, PatchImageRequest, RemoveKeyRequest,
    ResizeImageRequest, ResizeImageResponse,
};

/// 201 for an image that is ready, 202 for one whose copy runs.
fn created(image: Image) -> (StatusCode, Json<Image>) {
    let status = if image.state == ImageState::Copying {
        StatusCode::ACCEPTED
    } else {
        StatusCode::CREATED
    };
    (status, Json(image))
}

/// Register an existing image file, create one, or clone an image
/// (`clone_from`): a writable image whose file shares the source's extents
/// (`method` `reflink`, 201) where the filesystem can, else is copied in the
/// background (`copy`, 202 with `state` `copying` and `copied_bytes`; events
/// `image_copy_started` then `image_copied` or `image_copy_failed`; volumes
/// are refused until it is `ready`; DELETE stops it and removes its file).
#[utoipa::path(
    post, path = "/v1/images", tag = "images",
    request_body = CreateImageRequest,
    responses(
        (status = 201, description = "Image recorded", body = Image),
        (status = 202, description = "Clone or restore recorded, its copy runs in the background (`state` `copying`)", body = Image),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 403, description = "Path outside the image roots, through a symlink, with '..', or owned by another user", body = ErrorBody),
        (status = 404, description = "No such file (or directory to create it in), or no backup `restore_from` names (`backup_not_found`)", body = ErrorBody),
        (status = 409, description = "Name taken, file to create exists, the clone's source is not ready, a writable loop volume serves it and it must be copied: no shared extents, and no worker sees the loop driver's writes (`volume_attached_snapshot_unsupported`); for a restore: no backup target (`no_backup_target`), a backup without a manifest (`backup_not_done`) or a name several backups have (`backup_ambiguous`)", body = ErrorBody),
        (status = 422, description = "Not a usable image file (type, size, links, mode), invalid name, registered already, or a clone's `create.size_bytes` below its source's size (`shrink_refused`); a file with a LUKS header that is not LUKS2 (`luks_version_unsupported`), or a LUKS2 one cryptsetup cannot read (`luks_header_unreadable`): never registered as plain; a LUKS2 file or an encrypted create on a host whose cryptsetup cannot run (`encryption_unavailable`)", body = ErrorBody),
        (status = 502, description = "The backup's manifest fails its checksum (`backup_corrupt`)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
        (status = 507, description = "The image root's filesystem is full, or too small for a clone's copy or a restore's data (refused before it starts)", body = ErrorBody),
    )
)]
pub async fn create_image(
    State(m): State<AppState>,
    ApiJson(req): ApiJson<CreateImageRequest>,
) -> Result<(StatusCode, Json<Image>), ApiError> {
    let image = detached(async move { m.create_image(req).await }).await?;
    Ok(created(image))
}

/// Snapshot an image: a read-only image (`snapshot_of`, `read_only`) whose
/// file, named as the snapshot, sits next to the source's. Its bytes are the
/// source's when the request arrived: an attached volume's completed
/// writes included, none after and none in part (a ublk or dm volume's I/O
/// is held while its worker shares the extents; a volume on `direct` moves
/// to `nowait` first, for good). Extents shared (`method`
/// `reflink`, 201) where the filesystem can and the source is not pinned by
/// a direct map (a pinned image is always copied); else copied in the
/// background (`copy`, 202, as a clone's copy): under a writable ublk or dm
/// volume, by its worker, which holds the volume's I/O once and then copies
/// each chunk before a write changes it (copy-before-write). Volumes on it
/// must be read-only; it cannot grow or be allocated.
#[utoipa::path(
    post, path = "/v1/images/{id}/snapshots", tag = "images",
    params(("id" = String, Path, description = "Source image id or name")),
    request_body = CreateSnapshotRequest,
    responses(
        (status = 201, description = "Snapshot made (reflink)", body = Image),
        (status = 202, description = "Snapshot recorded, its copy runs in the background (`state` `copying`)", body = Image),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "Name taken, a file of that name exists next to the source, the source is not ready or an allocate runs on it, or a writable loop volume serves it and it must be copied: no shared extents, and no worker sees the loop driver's writes (`volume_attached_snapshot_unsupported`)", body = ErrorBody),
        (status = 422, description = "Invalid name", body = ErrorBody),
        (status = 507, description = "The filesystem lacks the space for the copy (refused before it starts), or the overcommit ratio would be passed", body = ErrorBody),
    )
)]
pub async fn snapshot_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateSnapshotRequest>,
) -> Result<(StatusCode, Json<Image>), ApiError> {
    let image = detached(async move { m.images().snapshot_image(&id, &req.name).await }).await?;
    Ok(created(image))
}

/// List images (or only the snapshots of one).
#[utoipa::path(
    get, path = "/v1/images", tag = "images",
    params(ListImagesQuery),
    responses(
        (status = 200, description = "The images, by name", body = Vec<Image>),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 404, description = "`snapshot_of` names no image", body = ErrorBody),
    )
)]
pub async fn list_images(
    State(m): State<AppState>,
    ApiQuery(q): ApiQuery<ListImagesQuery>,
) -> Result<Json<Vec<Image>>, ApiError> {
    let mut images = match q.snapshot_of {
        Some(source) => m.images().snapshots_of(&source).await?,
        None => m.images().list().await?,
    };
    if let Some(label) = &q.label {
        images.retain(|i| blockplane_api::model::has_label(&i.labels, label));
    }
    Ok(Json(images))
}

/// Show one image.
#[utoipa::path(
    get, path = "/v1/images/{id}", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    responses(
        (status = 200, description = "The image", body = Image),
        (status = 404, description = "No such image", body = ErrorBody),
    )
)]
pub async fn get_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Image>, ApiError> {
    Ok(Json(m.images().image(&id).await?))
}

/// Change an image's labels: each key given with a value is set, each
/// given `null` removed, the others kept (a JSON merge patch of
/// `labels`); all or nothing, an `image_labels_changed` event when they
/// change. Labels name images for a backup schedule's `selector` and for
/// `GET /v1/images?label=`.
#[utoipa::path(
    patch, path = "/v1/images/{id}", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    request_body = PatchImageRequest,
    responses(
        (status = 200, description = "The image, its labels changed", body = Image),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 422, description = "A key or value not spelled as a label's (`invalid_label`), or more than 32 labels after the patch (`too_many_labels`)", body = ErrorBody),
    )
)]
pub async fn patch_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PatchImageRequest>,
) -> Result<Json<Image>, ApiError> {
    Ok(Json(
        detached(async move { m.patch_image(&id, &req).await }).await?,
    ))
}

/// Forget an image (and optionally delete its file). An image whose copy
/// runs or failed: the copy stops and its file is removed whatever
/// `delete_file` says.
#[utoipa::path(
    delete, path = "/v1/images/{id}", tag = "images",
    params(("id" = String, Path, description = "Image id or name"), DeleteImageQuery),
    responses(
        (status = 204, description = "Forgotten"),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "A volume uses the image", body = ErrorBody),
        (status = 422, description = "`erase` of a plain image", body = ErrorBody),
        (status = 500, description = "cryptsetup failed to erase", body = ErrorBody),
    )
)]
pub async fn delete_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<DeleteImageQuery>,
) -> Result<StatusCode, ApiError> {
    detached(async move { m.images().delete_image(&id, q).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Grow an image; attached volumes follow.
#[utoipa::path(
    post, path = "/v1/images/{id}/resize", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    request_body = ResizeImageRequest,
    responses(
        (status = 200, description = "The grown image, and how each attached volume followed", body = ResizeImageResponse),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "The file was replaced, the image's copy runs or failed (`image_not_ready`), or a copy reads it (`copy_source_busy`)", body = ErrorBody),
        (status = 422, description = "Shrink, a size that is not a multiple of 512, or a read-only snapshot (`image_read_only`)", body = ErrorBody),
        (status = 507, description = "The filesystem is full", body = ErrorBody),
    )
)]
pub async fn resize_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ResizeImageRequest>,
) -> Result<Json<ResizeImageResponse>, ApiError> {
    Ok(Json(
        detached(async move { m.images().resize_image(&id, req.size_bytes).await }).await?,
    ))
}

/// Make an image eligible for `direct` again: write zeros over its holes and
/// unwritten extents (left by discards punched through a volume served
/// `nowait`/`threaded` on a sparse image, or by another program) and make it
/// `full`, so the file paths never punch it again. Runs in the background:
/// answers 202 at once with the image, its `allocate` `running`; `GET
/// /v1/images/{id}` shows `done_bytes` of `total_bytes`, and the events
/// `image_allocate_started`, then `image_allocated` (now `full`),
/// `image_allocate_failed` or `image_allocate_cancelled` tell its end (the
/// last two leave the image as declared; allocate again to finish). Refused
/// before anything is written when the image's filesystem lacks the space for
/// the holes, or while one runs. An attached ublk or dm volume keeps serving:
/// its worker zeroes one 16 MiB stretch at a time with its queues held, so
/// none of the volume's writes lands in a stretch being zeroed; a loop volume
/// is refused (detach it first). While it runs the image cannot grow, be
/// forgotten or get a volume (409). A service stop cancels it.
#[utoipa::path(
    post, path = "/v1/images/{id}/allocate", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    responses(
        (status = 202, description = "Started: the image, its `allocate` `running`", body = Image),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "An allocate already runs, the file was replaced, another blockplane holds it, or an attached volume's backend cannot keep its writes out (loop) or holds it read-only, the image's copy runs or failed (`image_not_ready`), or a copy reads it (`copy_source_busy`)", body = ErrorBody),
        (status = 422, description = "The image is not on ext4 or xfs (it can never be direct-mapped), or is a read-only snapshot (`image_read_only`)", body = ErrorBody),
        (status = 507, description = "The filesystem has less free space than the image's holes need", body = ErrorBody),
    )
)]
pub async fn allocate_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Image>), ApiError> {
    let image = detached(async move { m.images().allocate_image(&id).await }).await?;
    Ok((StatusCode::ACCEPTED, Json(image)))
}

/// Check a standby image's source for newer backups now (the follower
/// checks every minute on its own): lists the backup target, records the
/// newest backup and the bytes the standby is behind it, and starts an
/// apply of it in the background when it is newer than the one held
/// (`standby.applying`, then the events `standby_applied`,
/// `standby_apply_failed` or `standby_apply_stopped`). An apply journals
/// the changed chunks first, then writes them in place: the image holds
/// one whole backup throughout, never a mix of two.
#[utoipa::path(
    post, path = "/v1/images/{id}/standby/check", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    responses(
        (status = 200, description = "Checked: the image, its `standby` as found", body = Image),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "Not a standby (`not_a_standby`), its first copy runs or failed (`image_not_ready`), or the service has no backup target (`no_backup_target`)", body = ErrorBody),
        (status = 503, description = "The backup target cannot be reached (`backup_target_unavailable`)", body = ErrorBody),
    )
)]
pub async fn check_standby(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Image>, ApiError> {
    Ok(Json(
        detached(async move { m.backups().check_standby(&id).await }).await?,
    ))
}

/// Activate a standby image: it stops following its source's backups and
/// becomes an ordinary image holding the backup it holds now (named in the
/// answer), which volumes may use at once; event `image_standby_activated`.
/// Refused while an apply runs (`standby_applying`) unless `force`, which
/// stops it: an apply still journalling leaves the file as it was; one
/// already writing in place finishes first, and the newer backup is held.
#[utoipa::path(
    post, path = "/v1/images/{id}/activate", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    request_body = ActivateImageRequest,
    responses(
        (status = 200, description = "Activated: the image and the backup it holds", body = ActivatedImage),
        (status = 400, description = "Malformed request (bad JSON, a wrong type, a field it does not take)", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "Not a standby (`not_a_standby`), its first copy runs or failed (`image_not_ready`), or an apply runs and `force` was not given (`standby_applying`)", body = ErrorBody),
    )
)]
pub async fn activate_image(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ActivateImageRequest>,
) -> Result<Json<ActivatedImage>, ApiError> {
    Ok(Json(
        detached(async move { m.backups().activate_image(&id, req).await }).await?,
    ))
}

/// Stop an image's running allocate after its current 16 MiB stretch.
/// Answers once it stopped: the image as it was declared (not `full`), its
/// `allocate` `cancelled`; the zeros already written stay (harmless), and
/// allocating again finishes the job.
#[utoipa::path(
    delete, path = "/v1/images/{id}/allocate", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    responses(
        (status = 200, description = "Stopped: the image, its `allocate` `cancelled` (or `done`/`failed` if it ended first)", body = Image),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "No allocate runs on the image", body = ErrorBody),
    )
)]
pub async fn cancel_allocate(
    State(m): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Image>, ApiError> {
    Ok(Json(
        detached(async move { m.images().cancel_allocate(&id).await }).await?,
    ))
}

/// Add a key slot to an encrypted image (key rotation: add the new key,
/// then remove the old one's slot).
///
/// Authorized by a key that opens a slot now. While a volume serves the
/// image, the header is written through the backend's device (a
/// direct-mapped file is pinned), so the volume keeps serving. Neither key
/// is stored.
#[utoipa::path(
    post, path = "/v1/images/{id}/keys", tag = "images",
    params(("id" = String, Path, description = "Image id or name")),
    request_body = AddKeyRequest,
    responses(
        (status = 201, description = "Added: the slot, and the image with its header read again", body = KeySlotAdded),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 403, description = "No key slot opens with `key` (`key_rejected`)", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "A read-only volume serves it (`volume_state`)", body = ErrorBody),
        (status = 422, description = "A plain image (`not_encrypted`), a snapshot (`image_read_only`), or an invalid key", body = ErrorBody),
        (status = 500, description = "cryptsetup failed (`crypt_failed`)", body = ErrorBody),
    )
)]
pub async fn add_image_key(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<AddKeyRequest>,
) -> Result<(StatusCode, Json<KeySlotAdded>), ApiError> {
    let added = detached(async move { m.images().add_image_key(&id, req).await }).await?;
    Ok((StatusCode::CREATED, Json(added)))
}

/// Remove a key slot of an encrypted image: its key opens the image no
/// more. The last slot is never removed (crypto-erase the image instead).
#[utoipa::path(
    delete, path = "/v1/images/{id}/keys/{slot}", tag = "images",
    params(
        ("id" = String, Path, description = "Image id or name"),
        ("slot" = u32, Path, description = "The key slot (`image.encryption.key_slots`)", maximum = 31),
    ),
    request_body = RemoveKeyRequest,
    responses(
        (status = 200, description = "Removed: the image with its header read again", body = Image),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 403, description = "No key slot opens with `key` (`key_rejected`)", body = ErrorBody),
        (status = 404, description = "No such image, or no such slot (`key_slot_not_found`)", body = ErrorBody),
        (status = 409, description = "Its last slot (`last_key_slot`), or a read-only volume serves it (`volume_state`)", body = ErrorBody),
        (status = 422, description = "A plain image (`not_encrypted`), a snapshot (`image_read_only`), or an invalid key", body = ErrorBody),
        (status = 500, description = "cryptsetup failed (`crypt_failed`)", body = ErrorBody),
    )
)]
pub async fn remove_image_key(
    State(m): State<AppState>,
    Path((id, slot)): Path<(String, u32)>,
    ApiJson(req): ApiJson<RemoveKeyRequest>,
) -> Result<Json<Image>, ApiError> {
    Ok(Json(
        detached(async move { m.images().remove_image_key(&id, slot, req).await }).await?,
    ))
}

/// The ranges of a snapshot's device that were ever written (the rest
/// reads as zeroes on a plain image), from `offset`, a page of at most
/// `limit`: what a backup of the
/// snapshot must read. Found from the file's extent map without reading
/// its bytes. Offsets are the device's: an encrypted image's plaintext.
#[utoipa::path(
    get, path = "/v1/images/{id}/allocated", tag = "images",
    params(("id" = String, Path, description = "Snapshot id or name"), AllocatedQuery),
    responses(
        (status = 200, description = "A page of ranges; `next_offset` where the next starts", body = ImageRanges),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 404, description = "No such image", body = ErrorBody),
        (status = 409, description = "The snapshot's copy runs or failed (`image_not_ready`), it is a standby (`image_is_standby`), or its file was replaced", body = ErrorBody),
        (status = 422, description = "Not a read-only snapshot (`not_a_snapshot`), or a `limit` outside 1..10000 (`invalid_field`)", body = ErrorBody),
    )
)]
pub async fn image_allocated(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<AllocatedQuery>,
) -> Result<Json<ImageRanges>, ApiError> {
    Ok(Json(m.images().allocated(&id, q).await?))
}

/// The ranges of a snapshot's device whose bytes differ from `base`'s,
/// another snapshot of the same image, from `offset`, a page of at most
/// `limit`: what an incremental backup must read. Exact to the 4096-byte
/// block: a block is listed if and only if its bytes differ. Blocks the
/// two files share (reflinked snapshots on xfs or btrfs) and holes in both
/// are known from the extent maps; everything else is read from both and
/// compared (`mapped_bytes` and `compared_bytes` say how much took which
/// path). A page also ends once it has compared 1 GiB, with `next_offset`
/// set, so it may hold fewer ranges than `limit`, even none.
#[utoipa::path(
    get, path = "/v1/images/{id}/changes", tag = "images",
    params(("id" = String, Path, description = "Snapshot id or name"), ChangesQuery),
    responses(
        (status = 200, description = "A page of ranges; `next_offset` where the next starts", body = ImageRanges),
        (status = 400, description = "Malformed query (`base` is required)", body = ErrorBody),
        (status = 404, description = "No such image (either)", body = ErrorBody),
        (status = 409, description = "A snapshot's copy runs or failed (`image_not_ready`), it is a standby (`image_is_standby`), or its file was replaced", body = ErrorBody),
        (status = 422, description = "Either is not a read-only snapshot (`not_a_snapshot`), they are snapshots of different images (`snapshots_of_different_images`), or a `limit` outside 1..10000 (`invalid_field`)", body = ErrorBody),
    )
)]
pub async fn image_changes(
    State(m): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ChangesQuery>,
) -> Result<Json<ImageRanges>, ApiError> {
    Ok(Json(m.images().changes(&id, q).await?))
}
