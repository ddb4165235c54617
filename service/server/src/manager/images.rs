//! Image operations: register, create, list, grow, forget.

use crate::fault::{After, Slow};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use time::OffsetDateTime;
use uuid::Uuid;

use super::Manager;
use super::blocking::blocking;
use super::error::{Error, Result};
use super::house::House;
use super::image_jobs::Images;
use super::jobs::{Ended, JobState};
use super::names::validate_name;
use super::runs::AllocateRun;
use super::undo::Undo;
use super::volumes::volume_error;
use crate::backend::{Attachment, BackendError, VolumeBackend};
use crate::store::{ImageRow, VolumeRow};
use blockplane_api::model::{
    AllocateState, Allocation, CreateImageFile, CreateImageRequest, DeleteImageQuery, Image,
    ImageAllocate, ImageEncryption, ImageState, Labels, ResizeImageResponse, RootCapacity,
    VolumeResize, VolumeState, size_text,
};
use blockplane_system::extent::Unwritten;
use blockplane_system::image::{Access, ImageFile, ImagePath, Written};

impl Manager {
    /// `POST /v1/images`: the request read into its [`Origin`], then that
    /// origin's steps.
    pub(crate) async fn create_image(
        self: &std::sync::Arc<Self>,
        req: CreateImageRequest,
    ) -> Result<Image> {
        super::labels::check_labels(&format!("image '{}'", req.name), &req.labels)?;
        match Origin::of(&req)? {
            Origin::Restore { backup } => {
                self.backups
                    .restore_image(&backup, &req.name, &req.path, req.labels)
                    .await
            }
            Origin::Standby { source } => {
                self.backups
                    .standby_image(&source, &req.name, &req.path, req.labels)
                    .await
            }
            Origin::Clone { source, grow } => {
                self.images
                    .clone_image(&source, &req.name, &req.path, grow, req.labels)
                    .await
            }
            Origin::File(file) => {
                self.images
                    .add_image(&req.name, &req.path, file, req.labels)
                    .await
            }
        }
    }
}

/// A volume's backend that cannot fill its image while serving (loop),
/// its refusal given the remedy: delete volume `volume`, allocate image
/// `image`, create the volume again.
fn delete_to_allocate(e: BackendError, volume: &str, image: &str) -> BackendError {
    match e {
        BackendError::Busy { device, reason } => BackendError::Busy {
            device,
            reason: format!(
                "{reason}; to allocate it, delete volume '{volume}' (DELETE /v1/volumes/{volume}; its image stays), allocate (POST /v1/images/{image}/allocate), then create the volume again"
            ),
        },
        e => e,
    }
}

/// Where a new image's bytes come from: the request's optional fields read
/// once, here, into one of these; the rules that pair them live in
/// [`Origin::of`] alone.
enum Origin {
    /// A file of the host: registered, or made new.
    File(NewFile),
    /// A writable clone of `source`, grown to `grow`'s size when given.
    Clone {
        source: String,
        grow: Option<CreateImageFile>,
    },
    /// A backup's bytes, restored into a new file.
    Restore { backup: String },
    /// The newest backup of image `source`, restored into a new file that
    /// then follows that image's newer backups.
    Standby { source: String },
}

/// How [`Images::add_image`] gets its file.
enum NewFile {
    /// An existing file, its allocation as declared (or as found).
    Register { allocation: Option<Allocation> },
    /// A new file, made to this spec.
    Create(CreateImageFile),
}

impl Origin {
    /// The origin `req` asks for, or why its fields do not go together.
    fn of(req: &CreateImageRequest) -> Result<Self> {
        let refused = |field: &'static str, why: &str| Error::InvalidField {
            field,
            reason: format!("image '{}': {why}", req.name),
        };
        if let Some(declared) = req.allocation
            && (req.create.is_some()
                || req.clone_from.is_some()
                || req.restore_from.is_some()
                || req.standby_of.is_some())
        {
            return Err(refused(
                "allocation",
                &format!(
                    "a top-level \"allocation\" ({}) is declared only when registering an existing file; with \"create\" give it as \"create\": {{\"allocation\"}}",
                    declared.as_str()
                ),
            ));
        }
        if req.clone_from.is_some() && req.create.as_ref().is_some_and(|c| c.encryption.is_some()) {
            return Err(refused(
                "create.encryption",
                "a clone holds its source's bytes, header and keys included (encrypted when its source is); encryption is given only for a new file",
            ));
        }
        if req.restore_from.is_some() && (req.create.is_some() || req.clone_from.is_some()) {
            return Err(refused(
                "restore_from",
                "a restore makes its file from the backup (its size and bytes); \"create\" and \"clone_from\" are not given with it",
            ));
        }
        if req.standby_of.is_some()
            && (req.create.is_some() || req.clone_from.is_some() || req.restore_from.is_some())
        {
            return Err(refused(
                "standby_of",
                "a standby makes its file from its source's newest backup (its size and bytes); \"create\", \"clone_from\" and \"restore_from\" are not given with it",
            ));
        }
        if let Some(source) = &req.standby_of {
            return Ok(Origin::Standby {
                source: source.clone(),
            });
        }
        Ok(match (&req.restore_from, &req.clone_from, &req.create) {
            (Some(backup), ..) => Origin::Restore {
                backup: backup.clone(),
            },
            (None, Some(source), grow) => Origin::Clone {
                source: source.clone(),
                grow: grow.clone(),
            },
            (None, None, Some(spec)) => Origin::File(NewFile::Create(spec.clone())),
            (None, None, None) => Origin::File(NewFile::Register {
                allocation: req.allocation,
            }),
        })
    }
}

/// A file ready to record as a new image.
struct Made {
    file: ImageFile,
    /// Made now, laid out so; `None`: registered.
    created: Option<Allocation>,
    /// The row's allocation (`None`: a registered file of unknown layout).
    allocation: Option<Allocation>,
    /// Why a registered file's allocation is what it is.
    reason: Option<String>,
    encryption: Option<ImageEncryption>,
}

impl Made {
    /// The image's row, `name` at `path`.
    fn row(&self, name: &str, path: &ImagePath) -> Result<ImageRow> {
        Ok(ImageRow {
            allocation: self.allocation,
            encryption: self.encryption.clone(),
            ..new_file_row(name, path, &self.file)?
        })
    }
}

/// The row of a new image `name` whose file at `path` is `file`: ready,
/// writable, its size and blocks as the file has them, made from nothing
/// (each origin says what differs).
pub(super) fn new_file_row(name: &str, path: &ImagePath, file: &ImageFile) -> Result<ImageRow> {
    let (dev, ino) = file.identity();
    Ok(ImageRow {
        id: Uuid::new_v4(),
        name: name.to_string(),
        path: path.display(),
        dev,
        ino,
        birth: file.birth().map(str::to_string),
        size_bytes: file.size(),
        allocated_bytes: file.allocated(),
        allocation: None,
        filesystem: file.filesystem()?,
        created_at: OffsetDateTime::now_utc(),
        snapshot_of: None,
        cloned_from: None,
        restored_from: None,
        read_only: false,
        method: None,
        state: ImageState::Ready,
        state_reason: None,
        encryption: None,
        labels: Labels::new(),
        standby_of: None,
    })
}

/// What registering a file records as its allocation, and why: `declared`
/// (a `full` checked against the file first), else what FIEMAP shows
/// (`written`): every byte written is `full`, so discards through
/// `nowait`/`threaded` keep it as it is; anything else `sparse`. `None`
/// when the filesystem cannot say.
fn registered_allocation(
    name: &str,
    path: &str,
    size: u64,
    fs: &str,
    written: Written,
    declared: Option<Allocation>,
) -> Result<(Option<Allocation>, String)> {
    const KEPT: &str = "it is kept allocated: discards through nowait/threaded write zeros instead of punching, so they never cost it direct";
    let all = || {
        format!(
            "FIEMAP shows every byte of its {} written (no hole, no unwritten extent)",
            size_text(size)
        )
    };
    let missing = |u: &Unwritten| {
        format!(
            "FIEMAP shows {} at bytes {}..{} ({} of its {} hold no written data)",
            u.what(),
            u.start,
            u.end,
            size_text(u.total),
            size_text(size)
        )
    };
    let no_fiemap = format!(
        "its filesystem ({fs}) does not answer FIEMAP, so whether every byte is written cannot be told"
    );
    let mismatch = |reason: String| Error::AllocationMismatch {
        name: name.to_string(),
        path: path.to_string(),
        reason,
    };
    Ok(match (declared, written) {
        (Some(Allocation::Sparse), _) => (
            Some(Allocation::Sparse),
            "declared sparse: discards through nowait/threaded punch holes, giving the space back"
                .into(),
        ),
        (Some(Allocation::Full), Written::All) => (
            Some(Allocation::Full),
            format!("declared full, and {}: {KEPT}", all()),
        ),
        (Some(Allocation::Full), Written::Not(u)) => {
            return Err(mismatch(format!(
                "{}; register it without \"allocation\" (it is recorded sparse) and run POST /v1/images/{name}/allocate (blockplane image allocate {name}), or write zeros over those bytes before registering (fallocate alone leaves them unwritten)",
                missing(&u)
            )));
        }
        (Some(Allocation::Full), Written::Unknown) => {
            return Err(mismatch(format!(
                "{no_fiemap}; register it without \"allocation\" (recorded null, served as sparse)"
            )));
        }
        (None, Written::All) => (
            Some(Allocation::Full),
            format!(
                "{}: recorded full, so {KEPT}; declare \"allocation\": \"sparse\" to have discards punch",
                all()
            ),
        ),
        (None, Written::Not(u)) => (
            Some(Allocation::Sparse),
            format!(
                "{}: recorded sparse, so discards through nowait/threaded punch; POST /v1/images/{name}/allocate writes zeros over those bytes and makes it full",
                missing(&u)
            ),
        ),
        (None, Written::Unknown) => (
            None,
            format!("{no_fiemap}: recorded null, served as sparse (discards punch)"),
        ),
    })
}

/// An image's steps that need the house alone: its lock, its record,
/// its growth and its allocate's end.
impl House {
    /// Writes a new image's row and its event (`image_created` or
    /// `image_registered`) in one transaction; refused when its file is
    /// already another image's.
    async fn record_new_image(
        &self,
        row: &ImageRow,
        created: bool,
        reason: Option<&str>,
    ) -> Result<()> {
        let mut tx = self.store.begin().await?;
        if let Some(other) = tx
            .image_by_file(row.dev, row.ino, row.birth.as_deref(), &row.path)
            .await?
        {
            return Err(Error::AlreadyRegistered {
                path: row.path.clone(),
                name: other.name,
                id: other.id,
            });
        }
        tx.insert_image(row).await?;
        let verb = if created { "created" } else { "registered" };
        tx.event(
            None,
            Some(row.id),
            &format!("image_{verb}"),
            &format!(
                "image '{}' {verb}: {}, {}, on {}{}{}",
                row.name,
                row.path,
                size_text(row.size_bytes),
                row.filesystem,
                row.encryption
                    .as_ref()
                    .map(|e| format!(", encrypted (LUKS2, {})", e.cipher))
                    .unwrap_or_default(),
                reason
                    .map(|why| format!(
                        "; allocation {}: {why}",
                        row.allocation.map_or("null", Allocation::as_str)
                    ))
                    .unwrap_or_default()
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records how an allocate ended: `full` and an `image_allocated` event
    /// when done; otherwise an event, and the image left as declared.
    async fn end_allocate(
        &self,
        row: &ImageRow,
        job: &blockplane_system::image::AllocateJob,
        needed: u64,
        out: Result<bool>,
    ) -> Ended {
        let (done, total) = (job.done_bytes.load(Relaxed), job.total_bytes.load(Relaxed));
        let stays = "it stays as declared and is not eligible for direct where holes remain; allocate again to finish";
        let recorded = async {
            let mut tx = self.store.begin().await?;
            let state = match &out {
                Ok(true) => {
                    let allocated = self.roots
                        .stat_if_same(&row.path, (row.dev, row.ino), row.birth.as_deref())
                        .map(|(_, allocated)| allocated)
                        .unwrap_or(row.allocated_bytes);
                    tx.set_image_allocation(row.id, Allocation::Full, allocated)
                        .await?;
                    tx.event(None, Some(row.id), "image_allocated", &format!(
                        "image '{}' allocated: {} of holes filled, {} of holes and unwritten extents written with zeros; now full",
                        row.name, size_text(needed), size_text(total)
                    ))
                    .await?;
                    JobState::Done
                }
                Ok(false) => {
                    tx.event(None, Some(row.id), "image_allocate_cancelled", &format!(
                        "image '{}': allocate cancelled after {} of {}; {stays}",
                        row.name, size_text(done), size_text(total)
                    ))
                    .await?;
                    JobState::Cancelled
                }
                Err(e) => {
                    tx.event(None, Some(row.id), "image_allocate_failed", &format!(
                        "image '{}': allocate failed after {} of {}: {e}; {stays}",
                        row.name, size_text(done), size_text(total)
                    ))
                    .await?;
                    JobState::Failed
                }
            };
            tx.commit().await?;
            Ok::<_, Error>(state)
        }
        .await;
        let (state, error) = match (recorded, out) {
            (Ok(state), Err(e)) => (state, Some(e.to_string())),
            (Ok(state), Ok(_)) => (state, None),
            (Err(e), _) => (JobState::Failed, Some(format!("recording the end: {e}"))),
        };
        Ended { state, error }
    }

    /// The image's volumes that have a device, with their backends.
    pub(super) async fn attached_volumes(
        &self,
        image_id: uuid::Uuid,
    ) -> Result<
        Vec<(
            crate::store::VolumeRow,
            std::sync::Arc<dyn crate::backend::VolumeBackend>,
        )>,
    > {
        let mut out = Vec::new();
        for (vid, _) in self.store.volumes_of_image(image_id).await? {
            if let Some(v) = self.store.volume(&vid.to_string()).await?
                && v.attachment.is_some()
                && matches!(v.state, VolumeState::Attached | VolumeState::Degraded)
                && let Some(b) = self.backend(v.backend)
            {
                out.push((v, b));
            }
        }
        Ok(out)
    }

    /// Grows volume `v`'s device `att` (and the image, on a backend that
    /// grows it) to `size`; the plaintext device follows the backend's
    /// (LUKS2's payload runs to the end of the device).
    async fn grow_device(
        &self,
        v: &VolumeRow,
        backend: Arc<dyn VolumeBackend>,
        att: Attachment,
        size: u64,
        allocation: Allocation,
    ) -> Result<std::result::Result<Attachment, BackendError>> {
        let id = v.id;
        let outcome = blocking(move || backend.resize(&att, size, allocation, id)).await?;
        Ok(match (outcome, &v.crypt) {
            (Ok(att), Some(layer))
                if !att.resize_pending && blockplane_system::crypt::is_open(&layer.name) =>
            {
                let name = layer.name.clone();
                blocking(move || blockplane_system::crypt::resize(&name))
                    .await?
                    .map(|()| att)
                    .map_err(|e| BackendError::Refused {
                        reason: format!("its plaintext device did not follow: {e}"),
                    })
            }
            (outcome, _) => outcome,
        })
    }

    /// Opens a registered image's file, as [`Self::open_image`], and takes
    /// the OFD lock a volume holds while it serves it.
    pub(super) fn open_and_lock(
        &self,
        row: &ImageRow,
        access: Access,
    ) -> Result<(blockplane_system::image::ImageFile, std::os::fd::OwnedFd)> {
        let file = match self.open_image(row, access) {
            Ok(file) => file,
            // Another instance's direct volume pins the image immutable, so a
            // writable open fails: the lock it holds is the reason to give.
            Err(e) => {
                return Err(self.locked_elsewhere(row).unwrap_or(e));
            }
        };
        let lock = self.lock_image(row, &file)?;
        Ok((file, lock))
    }

    /// 409 `image_locked` if another process holds the lock of the image.
    fn locked_elsewhere(&self, row: &ImageRow) -> Option<Error> {
        let file = self.open_image(row, Access::ReadOnly).ok()?;
        let held = super::holds::locked_by_other(&file)?;
        Some(Error::ImageLocked {
            name: row.name.clone(),
            path: row.path.clone(),
            holder: held.holder(),
        })
    }

    /// Takes the OFD lock on an opened image; 409 `image_locked` naming the
    /// holder when another process has it.
    pub(super) fn lock_image(
        &self,
        row: &ImageRow,
        file: &blockplane_system::image::ImageFile,
    ) -> Result<std::os::fd::OwnedFd> {
        super::holds::lock(file).map_err(|held| Error::ImageLocked {
            name: row.name.clone(),
            path: row.path.clone(),
            holder: held.holder(),
        })
    }

    /// Makes the new file (and its LUKS2 header, when encrypted); `undo`
    /// removes it if a later step fails.
    async fn make_file(
        self: &std::sync::Arc<Self>,
        name: &str,
        path: &ImagePath,
        spec: CreateImageFile,
        undo: &mut Undo,
    ) -> Result<Made> {
        let (me, p) = (self.clone(), path.clone());
        let mut file =
            blocking(move || me.roots.create_file(&p, spec.size_bytes, spec.allocation)).await??;
        let (dev, ino) = file.identity();
        let (me, p, birth) = (self.clone(), path.clone(), file.birth().map(str::to_string));
        undo.push("remove the new image file", move || {
            let _ = me.roots.remove_file(&p, dev, ino, birth.as_deref());
        });
        self.settings.faults.pause(Slow::ImageCreate).await;
        let mut encryption = None;
        if let Some(e) = &spec.encryption {
            let fd = file
                .fd()
                .try_clone()
                .map_err(|e| Error::Internal(format!("image '{name}': dup: {e}")))?;
            encryption = Some(self.format_image(name, fd, &e.key).await?.1);
            file.refresh()?;
        }
        Ok(Made {
            file,
            created: Some(spec.allocation),
            allocation: Some(spec.allocation),
            reason: None,
            encryption,
        })
    }

    /// Opens an existing file to register it: its bytes as they are, its
    /// LUKS2 header if it has one, its allocation as declared or as found.
    async fn open_to_register(
        self: &std::sync::Arc<Self>,
        name: &str,
        path: &ImagePath,
        declared: Option<Allocation>,
    ) -> Result<Made> {
        let (me, p, n) = (self.clone(), path.clone(), name.to_string());
        let (file, written, encryption) = blocking(move || -> Result<_> {
            let file = me.roots.open_file(&p, Access::ReadOnly)?;
            let written = file.written()?;
            let found = super::encryption::encryption_of(&n, file.fd())?;
            Ok((file, written, found))
        })
        .await??;
        let (allocation, reason) = registered_allocation(
            name,
            &path.display(),
            file.size(),
            &file.filesystem()?,
            written,
            declared,
        )?;
        Ok(Made {
            file,
            created: None,
            allocation,
            reason: Some(reason),
            encryption,
        })
    }

    /// Grows the image from `current` to `size_bytes` (the file here, or
    /// by the ublk worker that holds it), its volumes after it, and records
    /// the new size with `warnings`.
    async fn grow_image(
        self: &std::sync::Arc<Self>,
        row: &ImageRow,
        current: u64,
        size_bytes: u64,
        warnings: &[String],
    ) -> Result<Vec<VolumeResize>> {
        let allocation = row.allocation.unwrap_or(Allocation::Sparse);
        // A ublk worker holds its image (pinned while direct-mapped) and
        // grows it itself; otherwise the file is grown here first.
        let worker_grows = self
            .attached_volumes(row.id)
            .await?
            .iter()
            .any(|(_, b)| b.grows_image());
        if !worker_grows {
            let me = self.clone();
            let r = row.clone();
            blocking(move || -> Result<()> {
                let mut file = me.open_image(&r, Access::ReadWrite)?;
                file.grow(size_bytes, allocation)?;
                Ok(())
            })
            .await??;
        }
        let followed = self
            .volumes_follow_resize(row, size_bytes, allocation)
            .await?;
        let (size, allocated) = self
            .roots
            .stat_if_same(&row.path, (row.dev, row.ino), row.birth.as_deref())
            .unwrap_or((size_bytes, row.allocated_bytes));
        let mut tx = self.store.begin().await?;
        tx.update_image_size(row.id, size, allocated).await?;
        tx.event(
            None,
            Some(row.id),
            "image_resized",
            &format!(
                "image '{}' grown from {} to {}",
                row.name,
                size_text(current),
                size_text(size)
            ),
        )
        .await?;
        for w in warnings {
            tx.event(None, Some(row.id), "image_overcommitted", w)
                .await?;
        }
        tx.commit().await?;
        Ok(followed)
    }

    /// Writes the zeros: through each attached volume's backend, or, with
    /// none, from here with the image's OFD lock held (it keeps another
    /// instance's volume, and an attach here, off the file meanwhile).
    /// `Ok(false)`: cancelled.
    async fn run_allocate(
        self: &std::sync::Arc<Self>,
        row: &ImageRow,
        attached: Vec<(
            crate::store::VolumeRow,
            std::sync::Arc<dyn crate::backend::VolumeBackend>,
        )>,
        job: &std::sync::Arc<blockplane_system::image::AllocateJob>,
    ) -> Result<bool> {
        if attached.is_empty() {
            let (me, r, j) = (self.clone(), row.clone(), job.clone());
            return blocking(move || -> Result<bool> {
                let (mut file, _lock) = me.open_and_lock(&r, Access::ReadWrite)?;
                Ok(file.allocate(&j)?)
            })
            .await?;
        }
        for (v, backend) in attached {
            // The volume's lock only to read its attachment: its other
            // changes (a policy switch, a detach) go on while its worker fills.
            let att = {
                let _vol = self.locks.volumes.lock(&v.name).await;
                self.store
                    .volume(&v.id.to_string())
                    .await?
                    .and_then(|v| v.attachment)
            };
            let Some(att) = att else { continue };
            let (id, j) = (v.id, job.clone());
            let done = blocking(move || backend.allocate(&att, id, &j))
                .await?
                .map_err(|e| super::volumes::volume_error(&v.name, e))?;
            if !done {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Makes every attached volume of an image follow its new size. A volume
    /// whose backend grows the image fails the resize when it cannot.
    async fn volumes_follow_resize(
        self: &std::sync::Arc<Self>,
        image: &ImageRow,
        size: u64,
        allocation: Allocation,
    ) -> Result<Vec<VolumeResize>> {
        let mut out = Vec::new();
        for (v, backend) in self.attached_volumes(image.id).await? {
            let _vol = self.locks.volumes.lock(&v.name).await;
            let Some(mut v) = self.store.volume(&v.id.to_string()).await? else {
                continue;
            };
            let Some(att) = v.attachment.clone() else {
                continue;
            };
            let grows = backend.grows_image();
            let outcome = self.grow_device(&v, backend, att, size, allocation).await?;
            if outcome.is_ok() {
                self.settings.faults.point(After::Change)?;
            }
            let mut tx = self.store.begin().await?;
            match outcome {
                Ok(att) => {
                    let pending = att.resize_pending;
                    let msg = if pending {
                        format!(
                            "volume '{}': image grown to {}; the kernel cannot resize ublk devices live (no UPDATE_SIZE): the new size applies at the next attach",
                            v.name,
                            size_text(size)
                        )
                    } else {
                        format!(
                            "volume '{}' now {} on {}",
                            v.name,
                            size_text(v.device_bytes(att.size_bytes)),
                            att.device
                        )
                    };
                    out.push(VolumeResize {
                        volume_id: v.id,
                        name: v.name.clone(),
                        size_bytes: v.device_bytes(att.size_bytes),
                        resize_pending: pending,
                        message: msg.clone(),
                    });
                    v.attachment = Some(att);
                    v.updated_at = OffsetDateTime::now_utc();
                    tx.update_volume(&v).await?;
                    tx.event(Some(v.id), Some(image.id), "volume_resized", &msg)
                        .await?;
                    tx.commit().await?;
                }
                Err(e) => {
                    tx.event(
                        Some(v.id),
                        Some(image.id),
                        "volume_resize_failed",
                        &format!("volume '{}' keeps its old size: {e}", v.name),
                    )
                    .await?;
                    tx.commit().await?;
                    if grows {
                        return Err(super::volumes::volume_error(&v.name, e));
                    }
                    out.push(VolumeResize {
                        volume_id: v.id,
                        name: v.name.clone(),
                        size_bytes: v.attachment.as_ref().map(|a| a.size_bytes).unwrap_or(0),
                        resize_pending: true,
                        message: format!("keeps its old size: {e}"),
                    });
                }
            }
        }
        Ok(out)
    }
}

impl Images {
    /// Registers an existing file, or makes a new one, as image `name`: the
    /// name claimed, the file made or opened, its row and event written. A
    /// step that fails after the file was made leaves no file behind.
    async fn add_image(
        &self,
        name: &str,
        path: &str,
        file: NewFile,
        labels: Labels,
    ) -> Result<Image> {
        validate_name("image", name)?;
        let path = self.house.roots.resolve(path)?;
        let _registering = self.house.claim_name(name).await?;
        let mut undo = Undo::default();
        let (made, warnings) = match file {
            NewFile::Create(spec) => {
                let warnings = self.check_new_file(name, &path, &spec).await?;
                (
                    self.house.make_file(name, &path, spec, &mut undo).await?,
                    warnings,
                )
            }
            NewFile::Register { allocation } => (
                self.house.open_to_register(name, &path, allocation).await?,
                Vec::new(),
            ),
        };
        let row = ImageRow {
            labels,
            ..made.row(name, &path)?
        };
        self.house
            .record_new_image(&row, made.created.is_some(), made.reason.as_deref())
            .await?;
        undo.commit();
        tracing::info!(image = %row.name, path = %row.path, "image recorded");
        if !warnings.is_empty() {
            let mut tx = self.house.store.begin().await?;
            for w in &warnings {
                tx.event(None, Some(row.id), "image_overcommitted", w)
                    .await?;
            }
            tx.commit().await?;
        }
        let mut image = self.image_view(row).await?;
        image.warnings = warnings;
        image.allocation_reason = made.reason;
        Ok(image)
    }

    /// What a new file must pass before it is made: a key that can be used
    /// and a size that can hold its header, when encrypted; room under the
    /// root's overcommit limit (the warnings it gives when near it).
    async fn check_new_file(
        &self,
        name: &str,
        path: &ImagePath,
        spec: &CreateImageFile,
    ) -> Result<Vec<String>> {
        if let Some(encryption) = &spec.encryption {
            if let Some(reason) = encryption.key.refusal() {
                return Err(Error::InvalidField {
                    field: "create.encryption.key",
                    reason,
                });
            }
            self.house.check_encrypted_size(name, spec.size_bytes)?;
        }
        self.check_provisioning(
            name,
            &path.display(),
            spec.size_bytes,
            spec.allocation == Allocation::Sparse,
        )
        .await
    }

    /// Each image root: its filesystem's size and free space, and the
    /// images under it (their sizes and allocated bytes as they are now).
    pub(super) async fn root_usage(&self) -> Result<Vec<RootCapacity>> {
        let images = self.list().await?;
        Ok(self
            .house
            .roots
            .space()
            .into_iter()
            .map(|(path, size_bytes, free_bytes)| {
                let under: Vec<&Image> = images
                    .iter()
                    .filter(|i| std::path::Path::new(&i.path).starts_with(&path))
                    .collect();
                RootCapacity {
                    images: under.len() as u64,
                    provisioned_bytes: under.iter().map(|i| i.size_bytes).sum(),
                    allocated_bytes: under.iter().map(|i| i.allocated_bytes).sum(),
                    path,
                    size_bytes,
                    free_bytes,
                    max_overcommit: self.house.settings.max_overcommit,
                }
            })
            .collect())
    }

    /// Checks that `adding` more provisioned bytes for image `name` at
    /// `path` stay within `--max-overcommit`; returns what the caller should
    /// be told (a sparse image larger than the free space).
    pub(super) async fn check_provisioning(
        &self,
        name: &str,
        path: &str,
        adding: u64,
        sparse: bool,
    ) -> Result<Vec<String>> {
        let usage = self.root_usage().await?;
        let Some(root) = usage
            .iter()
            .find(|r| std::path::Path::new(path).starts_with(&r.path))
        else {
            return Ok(Vec::new());
        };
        let provisioned = root.provisioned_bytes + adding;
        if let Some(ratio) = self.house.settings.max_overcommit
            && provisioned as f64 > ratio * root.size_bytes as f64
        {
            return Err(Error::Overcommit {
                name: name.to_string(),
                size: adding,
                root: root.path.clone(),
                provisioned,
                ratio,
                fs_size: root.size_bytes,
            });
        }
        let mut warnings = Vec::new();
        if sparse && adding > root.free_bytes {
            warnings.push(format!(
                "image '{name}' is sparse and {} more than its filesystem's {} free ({}): writes through its volume fail with ENOSPC once the filesystem is full",
                size_text(adding), size_text(root.free_bytes), root.path
            ));
        }
        Ok(warnings)
    }

    pub(super) async fn image_view(&self, row: ImageRow) -> Result<Image> {
        let volumes = self
            .house
            .store
            .volumes_of_image(row.id)
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        self.image_view_of(row, volumes).await
    }

    /// [`Self::image_view`] with the image's volumes (ids, by name) already read.
    async fn image_view_of(&self, row: ImageRow, volumes: Vec<Uuid>) -> Result<Image> {
        let allocate = self.allocate_view(row.id);
        // A done allocate recorded `full` before it said so; the row may be
        // from before that: read it again, so `done` always comes with `full`.
        let row = match &allocate {
            Some(a) if a.state == AllocateState::Done => {
                self.house.image_row(&row.id.to_string()).await?
            }
            _ => row,
        };
        let (size_bytes, allocated_bytes) = self
            .house
            .roots
            .stat_if_same(&row.path, (row.dev, row.ino), row.birth.as_deref())
            .unwrap_or((row.size_bytes, row.allocated_bytes));
        // A copy's file grows to its size only once the copy starts.
        let size_bytes = size_bytes.max(row.size_bytes * u64::from(row.state != ImageState::Ready));
        // The row and the job are read one after the other: a copy that
        // ends in between still shows its count while the row says copying.
        let progress = self
            .jobs
            .copies
            .progress(row.id)
            .filter(|p| p.state == JobState::Running || row.state == ImageState::Copying)
            .map(|p| (p.done_bytes, p.total_bytes));
        let standby = match row.standby_of {
            Some(source) => Some(self.standby_view(&row, source).await?),
            None => None,
        };
        Ok(Image {
            standby,
            state: row.state,
            state_reason: row.state_reason,
            snapshot_of: row.snapshot_of,
            cloned_from: row.cloned_from,
            read_only: row.read_only,
            method: row.method.or(row
                .restored_from
                .map(|_| blockplane_api::model::CopyMethod::Restore)),
            restored_from: row.restored_from,
            copied_bytes: progress.map(|(done, _)| done),
            copy_total_bytes: progress.map(|(_, total)| total),
            id: row.id,
            name: row.name,
            path: row.path,
            size_bytes,
            allocated_bytes,
            filesystem: row.filesystem,
            allocation: row.allocation,
            allocation_reason: None,
            created_at: row.created_at,
            volumes,
            allocate,
            encryption: row.encryption,
            labels: row.labels,
            warnings: Vec::new(),
        })
    }

    /// `GET /v1/images`: every image, as the API shows it.
    pub(crate) async fn list(&self) -> Result<Vec<Image>> {
        // One query for every image's volumes, not one per image: /metrics
        // and the dashboard list every image, and a host has a thousand.
        // The rows come by name, as each image's volumes are listed.
        let mut users: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
        for v in self.house.store.volumes().await? {
            users.entry(v.image_id).or_default().push(v.id);
        }
        let mut out = Vec::new();
        for row in self.house.store.images().await? {
            let volumes = users.remove(&row.id).unwrap_or_default();
            out.push(self.image_view_of(row, volumes).await?);
        }
        Ok(out)
    }

    /// The image's size now, if it may grow to `size_bytes`: no job on it,
    /// ready and writable, a valid size, not smaller than it is.
    fn growable(&self, row: &ImageRow, size_bytes: u64) -> Result<u64> {
        self.jobs.allocations.refuse(row, "grow")?;
        self.house.refuse_unready(row, "grow")?;
        self.house.refuse_read_only(row, "it cannot grow")?;
        self.jobs.copies.refuse(row, "grow")?;
        self.jobs.backups.refuse(row, "grow")?;
        if size_bytes == 0
            || !size_bytes.is_multiple_of(512)
            || size_bytes > blockplane_system::image::MAX_IMAGE_BYTES
        {
            return Err(Error::InvalidField {
                field: "size_bytes",
                reason: format!(
                    "{size_bytes} is not a positive multiple of 512 up to {} (image '{}')",
                    blockplane_system::image::MAX_IMAGE_BYTES,
                    row.name
                ),
            });
        }
        let current = self
            .house
            .roots
            .stat_if_same(&row.path, (row.dev, row.ino), row.birth.as_deref())
            .map(|(size, _)| size)
            .unwrap_or(row.size_bytes);
        if size_bytes < current {
            return Err(Error::Shrink {
                name: row.name.clone(),
                current,
                asked: size_bytes,
            });
        }
        Ok(current)
    }

    /// The bytes of holes an allocate of `row` would fill, its filesystem's
    /// free bytes and the unwritten bytes it would write, or why it cannot
    /// start: a job runs on it, it is not ready or read-only, not on ext4
    /// or xfs, or its holes do not fit.
    async fn allocatable(&self, row: &ImageRow) -> Result<(u64, u64, u64)> {
        self.jobs.allocations.refuse(row, "start another")?;
        self.house.refuse_unready(row, "be allocated")?;
        self.house
            .refuse_read_only(row, "it cannot be allocated (that writes zeros into it)")?;
        self.jobs.copies.refuse(row, "be allocated")?;
        self.jobs.backups.refuse(row, "be allocated")?;
        if !matches!(row.filesystem.as_str(), "ext4" | "xfs") {
            return Err(Error::NotAllocatable {
                name: row.name.clone(),
                reason: format!(
                    "it is on {}; only images on ext4 or xfs can ever be direct-mapped (direct-map rule 1)",
                    row.filesystem
                ),
            });
        }
        let me = self.clone();
        let r = row.clone();
        let (needed, free, total) = blocking(move || -> Result<(u64, u64, u64)> {
            let file = me.house.open_image(&r, Access::ReadOnly)?;
            let (needed, free) = (file.hole_bytes()?, file.free_bytes()?);
            Ok((needed, free, file.unwritten_bytes()?))
        })
        .await??;
        if needed > free {
            return Err(Error::SpaceShort {
                name: row.name.clone(),
                what: "allocating its holes",
                needed,
                free,
            });
        }
        Ok((needed, free, total))
    }

    /// The image's last allocate as the API shows it.
    fn allocate_view(&self, id: Uuid) -> Option<ImageAllocate> {
        self.jobs.allocations.progress(id).map(|p| ImageAllocate {
            state: match p.state {
                JobState::Running => AllocateState::Running,
                JobState::Done => AllocateState::Done,
                JobState::Cancelled => AllocateState::Cancelled,
                JobState::Failed => AllocateState::Failed,
            },
            done_bytes: p.done_bytes,
            total_bytes: p.total_bytes,
            error: p.error,
            started_at: p.started_at,
        })
    }

    /// `GET /v1/images/{id}`.
    pub(crate) async fn image(&self, id_or_name: &str) -> Result<Image> {
        let row = self.house.image_row(id_or_name).await?;
        self.image_view(row).await
    }

    /// `POST /v1/images/{id}/resize`: grows the file, then every attached volume.
    pub(crate) async fn resize_image(
        &self,
        id_or_name: &str,
        size_bytes: u64,
    ) -> Result<ResizeImageResponse> {
        let row = self.house.image_row(id_or_name).await?;
        let _image = self.house.locks.images.lock(&row.id.to_string()).await;
        let row = self.house.image_row(&row.id.to_string()).await?;
        let current = self.growable(&row, size_bytes)?;
        let warnings = self
            .check_provisioning(
                &row.name,
                &row.path,
                size_bytes - current,
                row.allocation != Some(Allocation::Full),
            )
            .await?;
        let followed = if size_bytes > current {
            self.house
                .grow_image(&row, current, size_bytes, &warnings)
                .await?
        } else {
            Vec::new()
        };
        let mut image = self.image(&row.id.to_string()).await?;
        image.warnings = warnings;
        Ok(ResizeImageResponse {
            image,
            volumes: followed,
        })
    }

    /// `POST /v1/images/{id}/allocate`: starts writing zeros over the image's
    /// holes and unwritten extents in the background, so it passes direct-map
    /// rule 2 again, and makes it `full` (never punched from then on) when
    /// done. Refused before anything is written when its filesystem lacks the
    /// space for the holes, when an attached volume's backend cannot fill it
    /// while serving (loop), or when an allocate already runs. An attached
    /// volume's backend does the writing, keeping its own writes out of each
    /// range it zeroes (ublk, dm); otherwise the service does, holding the
    /// image's lock. Answers with the image, its `allocate` running.
    pub(crate) async fn allocate_image(&self, id_or_name: &str) -> Result<Image> {
        let row = self.house.image_row(id_or_name).await?;
        let _image = self.house.locks.images.lock(&row.id.to_string()).await;
        let row = self.house.image_row(&row.id.to_string()).await?;
        let (needed, free, total) = self.allocatable(&row).await?;
        let attached = self.house.attached_volumes(row.id).await?;
        for (v, backend) in &attached {
            if let Some(att) = &v.attachment {
                backend.check_allocate(att, v.id).map_err(|e| {
                    volume_error(&v.name, delete_to_allocate(e, &v.name, &row.name))
                })?;
            }
        }
        let mut tx = self.house.store.begin().await?;
        tx.event(
            None,
            Some(row.id),
            "image_allocate_started",
            &format!(
                "image '{}': allocate started ({} of holes to take from its filesystem, which has {} free); GET /v1/images/{} shows its progress, DELETE /v1/images/{}/allocate stops it",
                row.name, size_text(needed), size_text(free), row.name, row.name
            ),
        )
        .await?;
        tx.commit().await?;
        let pace = self.house.settings.faults.pace(Slow::Allocate);
        let (me, r) = (self.clone(), row.clone());
        self.jobs.allocations.start(
            row.id,
            AllocateRun,
            (pace, None),
            total,
            move |job| async move {
                let out = me.house.run_allocate(&r, attached, &job).await;
                me.house.end_allocate(&r, &job, needed, out).await
            },
        );
        self.image(&row.id.to_string()).await
    }

    /// `DELETE /v1/images/{id}/allocate`: stops a running allocate after its
    /// current stretch and answers once it stopped (the image as declared).
    pub(crate) async fn cancel_allocate(&self, id_or_name: &str) -> Result<Image> {
        let row = self.house.image_row(id_or_name).await?;
        if !self.jobs.allocations.stop(row.id).await {
            return Err(Error::AllocateConflict {
                reason: format!(
                    "no allocate runs on it (POST /v1/images/{}/allocate starts one)",
                    row.name
                ),
                name: row.name,
            });
        }
        self.image(&row.id.to_string()).await
    }

    /// `DELETE /v1/images/{id}`.
    pub(crate) async fn delete_image(&self, id_or_name: &str, q: DeleteImageQuery) -> Result<()> {
        let DeleteImageQuery { delete_file, erase } = q;
        let row = self.house.image_row(id_or_name).await?;
        // A copy stops first; its partial file goes with the image.
        self.jobs.copies.stop(row.id).await;
        let _image = self.house.locks.images.lock(&row.id.to_string()).await;
        // A standby's follower starts its applies under this lock: one it
        // started before the lock was taken stops too (an apply's end
        // takes no lock).
        self.jobs.copies.stop(row.id).await;
        let mut tx = self.house.store.begin().await?;
        let Some(row) = tx.image(&row.id.to_string()).await? else {
            return Err(Error::ImageNotFound(id_or_name.to_string()));
        };
        let delete_file = delete_file || row.state != ImageState::Ready;
        self.jobs.allocations.refuse(&row, "be forgotten")?;
        self.jobs.backups.refuse(&row, "be forgotten")?;
        let users = tx.volumes_of_image(row.id).await?;
        if !users.is_empty() {
            return Err(Error::image_in_use(row.name, &users));
        }
        if erase {
            if row.encryption.is_none() {
                return Err(Error::NotEncrypted {
                    image: row.name,
                    what: "there are no key slots to erase; delete it without \"erase\"".into(),
                });
            }
            // Before the row goes: a failed erase leaves the image listed.
            let erased = self.house.erase_image(&row).await?;
            tx.set_image_encryption(row.id, Some(&erased)).await?;
            tx.event(
                None,
                Some(row.id),
                "image_erased",
                &format!(
                    "image '{}' crypto-erased: every key slot of its LUKS2 header destroyed; no key opens {} again",
                    row.name, row.path
                ),
            )
            .await?;
        }
        if delete_file {
            let path = self.house.roots.resolve(&row.path)?;
            match self
                .house
                .roots
                .remove_file(&path, row.dev, row.ino, row.birth.as_deref())
            {
                Ok(()) | Err(blockplane_system::image::ImageFileError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        tx.delete_image(row.id).await?;
        let what = if delete_file {
            "deleted with its file"
        } else {
            "forgotten (file kept)"
        };
        tx.event(
            None,
            Some(row.id),
            "image_deleted",
            &format!("image '{}' {what}: {}", row.name, row.path),
        )
        .await?;
        tx.commit().await?;
        self.jobs.allocations.forget(row.id);
        self.jobs.copies.forget(row.id);
        if row.standby_of.is_some() {
            // A stopped or failed apply's journal, of a file no longer kept.
            let _ = std::fs::remove_file(self.house.standby_journal(row.id));
            self.forget_follow(row.id);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filesystem_without_fiemap_records_null_and_refuses_a_declared_full() {
        let (allocation, why) =
            registered_allocation("i", "/r/i.img", 1 << 20, "tmpfs", Written::Unknown, None)
                .unwrap();
        assert_eq!(allocation, None);
        assert!(
            why.contains("tmpfs") && why.contains("served as sparse"),
            "{why}"
        );
        let e = registered_allocation(
            "i",
            "/r/i.img",
            1 << 20,
            "tmpfs",
            Written::Unknown,
            Some(Allocation::Full),
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::AllocationMismatch { .. }), "{m}");
        assert!(
            m.contains("image 'i' (/r/i.img)") && m.contains("FIEMAP"),
            "{m}"
        );
        let (allocation, _) = registered_allocation(
            "i",
            "/r/i.img",
            1 << 20,
            "tmpfs",
            Written::Unknown,
            Some(Allocation::Sparse),
        )
        .unwrap();
        assert_eq!(allocation, Some(Allocation::Sparse));
    }
}
