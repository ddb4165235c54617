//! Snapshots and clones: images made from another image, sharing its extents
//! (`FICLONE`) where the filesystem can, else copied in the background, a
//! job as an allocate is (`jobs`: progress, pace, cancel).

use crate::fault::{After, Slow};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use uuid::Uuid;

use super::blocking::blocking;
use super::error::{Error, Result};
use super::house::House;
use super::image_jobs::Images;
use super::images::new_file_row;
use super::jobs::Ended;
use super::moments::CopyClaim;
use super::names::validate_name;
use super::runs::CopyRun;
use super::undo::Undo;
use super::volumes::volume_error;
use crate::backend::{Attachment, Change, MomentCopy, SnapshotDest, VolumeBackend};
use crate::store::{ImageRow, VolumeRow};
use blockplane_api::model::Labels;
use blockplane_api::model::{
    self, ActiveDispatch, Allocation, Backend, CopyMethod, CreateImageFile, DispatchPolicy, Image,
    ImageState,
};
use blockplane_system::image::{Access, AllocateJob, CloneStart, ImageFile, ImagePath};

/// One moment of a serving volume's image, in a new file
/// ([`Images::share_with_serving`]).
pub(super) struct SharedMoment {
    pub file: ImageFile,
    /// How long the volume's I/O was held, in words.
    pub held: String,
    /// The volume whose worker copies the moment into the file, which is
    /// complete once [`Copier::follow`] says so; `None`: the file shares
    /// the moment's extents and is complete.
    pub copier: Option<Copier>,
}

/// A volume's worker copying one moment into a new file (copy-before-write).
pub(super) struct Copier {
    volume: VolumeRow,
    attachment: crate::backend::Attachment,
    backend: Arc<dyn VolumeBackend>,
    /// The volume's place in [`super::moments::MomentCopies`], given back when the copier
    /// is dropped.
    _claim: CopyClaim,
}

/// Asks volume `v`'s worker to stop the copy of one moment it runs, and
/// waits for its end; a worker that cannot be asked is only logged.
async fn stop_copy(
    backend: &Arc<dyn VolumeBackend>,
    att: &crate::backend::Attachment,
    v: &VolumeRow,
) {
    let job = Arc::new(AllocateJob::default());
    job.cancel.store(true, Relaxed);
    let (b, a, id) = (backend.clone(), att.clone(), v.id);
    if let Ok(Err(e)) = blocking(move || b.follow_copy(&a, id, &job)).await {
        tracing::warn!(volume = %v.name, error = %e, "a copy of one moment did not stop cleanly");
    }
}

impl Copier {
    /// Waits for the copy's end, its progress in `job` (whose cancel stops
    /// it): `Ok(true)` the file holds the moment.
    pub(super) async fn follow(&self, job: Arc<AllocateJob>) -> Result<bool> {
        let (b, a, id) = (
            self.backend.clone(),
            self.attachment.clone(),
            self.volume.id,
        );
        let out = blocking(move || b.follow_copy(&a, id, &job))
            .await
            .and_then(|r| r.map_err(|e| volume_error(&self.volume.name, e)));
        if out.is_err() {
            // Lost track of it (a worker that did not answer in time): it
            // must not go on copying for nothing.
            self.stop().await;
        }
        out
    }

    /// Asks the worker to stop the copy and waits for its end (nothing will
    /// use its file).
    pub(super) async fn stop(&self) {
        stop_copy(&self.backend, &self.attachment, &self.volume).await
    }

    /// The volume, for messages.
    pub(super) fn volume(&self) -> &str {
        &self.volume.name
    }
}

/// How long a volume's I/O was held while its image's extents were shared,
/// `how` naming what held it, in words (the tests read this text).
pub(super) fn held_text(volume: &str, how: &str, held: std::time::Duration) -> String {
    format!(
        "volume '{volume}' ({how}) held its I/O for {} µs",
        held.as_micros()
    )
}

/// Why a volume that went away meanwhile stops a snapshot.
const VOLUME_CHANGED: &str =
    "the volume was detached or deleted while the snapshot waited for it; try again";

/// Why writable volume `v` stops a copy, and the ways out its backend
/// offers: read-only through a PATCH only where the volume can switch live.
pub(super) fn copy_under_writes(v: &VolumeRow, backend: &dyn VolumeBackend) -> String {
    let live = v
        .attachment
        .as_ref()
        .is_some_and(|att| backend.check_change(att, Change::ReadOnly(true)).is_ok());
    let n = &v.name;
    let way = if live {
        format!(
            "make volume '{n}' read-only (PATCH /v1/volumes/{n} {{\"read_only\": true}}) or delete it (DELETE /v1/volumes/{n}; its image stays), then try again"
        )
    } else {
        format!(
            "delete volume '{n}' (DELETE /v1/volumes/{n}; its image stays), and create it again with \"read_only\": true if it must go on serving, then try again"
        )
    };
    format!(
        "this filesystem cannot share extents, so the snapshot or clone would be a copy taking time while the volume writes: it would not be one moment's state; {way}"
    )
}

/// A copy's new file, as [`Images::make_copy_file`] made it.
struct CopyFile {
    file: ImageFile,
    /// How it was started: shared, or to fill by a copy.
    start: CloneStart,
    /// The open source, when a copy in the service fills the file.
    copy_from: Option<ImageFile>,
    /// How long a volume's I/O was held, in words.
    held: Option<String>,
    /// The serving volume's worker, when it copies one moment.
    copier: Option<Copier>,
}

impl CopyFile {
    /// The file shares the source's extents and is complete.
    fn reflinked(&self) -> bool {
        self.copy_from.is_none() && self.copier.is_none()
    }
}

/// Refuses a copy the service would fill (`src_file` into `file`) while a
/// volume writes the source, or where the source's data (and a full
/// grow's new range) cannot fit.
fn copy_has_room(
    src: &ImageRow,
    name: &str,
    attached: &[(VolumeRow, Arc<dyn VolumeBackend>)],
    file: &ImageFile,
    src_file: &ImageFile,
    grow: Option<(u64, Allocation)>,
) -> Result<()> {
    if let Some((v, b)) = attached.iter().find(|(v, _)| !v.read_only) {
        return Err(Error::SnapshotAttached {
            name: src.name.clone(),
            volume: v.name.clone(),
            backend: b.kind().as_str(),
            reason: copy_under_writes(v, b.as_ref()),
        });
    }
    let grown = match grow {
        Some((size, Allocation::Full)) => size - src_file.size(),
        _ => 0,
    };
    let (needed, free) = (src_file.allocated() + grown, file.free_bytes()?);
    if needed > free {
        return Err(Error::SpaceShort {
            name: name.to_string(),
            what: "copying its source's data",
            needed,
            free,
        });
    }
    Ok(())
}

/// The row of `name`, a copy of `src` of `size` bytes in `made`'s file.
fn copy_row(
    src: &ImageRow,
    name: &str,
    path: &ImagePath,
    size: u64,
    made: &CopyFile,
    snapshot: bool,
    grow: Option<(u64, Allocation)>,
) -> Result<ImageRow> {
    let reflinked = made.reflinked();
    Ok(ImageRow {
        size_bytes: size,
        allocation: match grow {
            // A full source grown sparse has holes now.
            Some((_, Allocation::Sparse)) if src.allocation == Some(Allocation::Full) => {
                Some(Allocation::Sparse)
            }
            _ => src.allocation,
        },
        snapshot_of: snapshot.then_some(src.id),
        cloned_from: (!snapshot).then_some(src.id),
        read_only: snapshot,
        method: Some(if reflinked {
            CopyMethod::Reflink
        } else {
            CopyMethod::Copy
        }),
        state: if reflinked {
            ImageState::Ready
        } else {
            ImageState::Copying
        },
        // The same bytes, so the same header and keys.
        encryption: src.encryption.clone(),
        ..new_file_row(name, path, &made.file)?
    })
}

/// The kind of a copy's event, and how it was made, in words.
fn copy_event(name: &str, snapshot: bool, made: &CopyFile) -> (&'static str, String) {
    match (&made.copy_from, &made.copier) {
        (None, None) => (
            if snapshot {
                "image_snapshotted"
            } else {
                "image_cloned"
            },
            match &made.held {
                Some(held) => format!("extents shared (reflink); {held}"),
                None => "extents shared (reflink)".to_string(),
            },
        ),
        (_, Some(c)) => (
            "image_copy_started",
            format!(
                "one moment of volume '{}' copied in the background, each chunk a write reaches copied before the write (this filesystem cannot share extents); GET /v1/images/{name} shows its progress, DELETE /v1/images/{name} stops it; {}",
                c.volume(),
                made.held.as_deref().unwrap_or_default()
            ),
        ),
        (Some(src_file), None) => (
            "image_copy_started",
            format!(
                "copying {} bytes of data in the background; GET /v1/images/{name} shows its progress, DELETE /v1/images/{name} stops it",
                src_file.allocated()
            ),
        ),
    }
}

/// A copy's steps that need the house alone: its moment held, its end
/// recorded, its failure and its recovery.
impl House {
    /// Moves a serving volume `v` off `direct` before image `copy` shares
    /// its extents, and records it (an explicit `direct` cannot hold any
    /// more; `auto` still decides, now without direct).
    async fn off_direct(
        &self,
        backend: &Arc<dyn VolumeBackend>,
        mut v: VolumeRow,
        copy: &str,
    ) -> Result<(VolumeRow, Attachment)> {
        let att = v.attachment.clone().expect("a serving volume has a device");
        if att.dispatch != ActiveDispatch::Direct {
            return Ok((v, att));
        }
        let (b, a, id) = (backend.clone(), att, v.id);
        let reason = blockplane_system::dispatch::Reason::LeftDirectForCopy {
            copy: copy.to_string(),
        };
        let att = blocking(move || b.leave_direct(&a, id, reason))
            .await?
            .map_err(|e| volume_error(&v.name, e))?;
        self.settings.faults.point(After::Change)?;
        let asked = match v.dispatch {
            DispatchPolicy::Direct => DispatchPolicy::Nowait,
            d => d,
        };
        self.record_changes(&mut v, att.clone(), &[Change::Dispatch(asked)])
            .await?;
        Ok((v, att))
    }

    /// Holds `v`'s I/O for one moment while its worker shares the image's
    /// extents with `dest` (`shares`), or starts copying that moment into
    /// it; how long I/O was held.
    async fn hold_moment(
        &self,
        backend: &Arc<dyn VolumeBackend>,
        v: &VolumeRow,
        att: &Attachment,
        dest: SnapshotDest,
        shares: bool,
    ) -> Result<Duration> {
        let (b, a, id) = (backend.clone(), att.clone(), v.id);
        let held = if shares {
            blocking(move || b.snapshot(&a, id, &dest)).await?
        } else {
            let copy = MomentCopy {
                dest,
                pace: self.settings.faults.pace(Slow::Copy),
                gate: self
                    .settings
                    .faults
                    .slows(Slow::CopyGate)
                    .then(|| self.copy_gate()),
            };
            let out = blocking(move || b.copy_moment(&a, id, &copy)).await?;
            if out.is_err() {
                // It may have begun before the answer was lost.
                stop_copy(backend, att, v).await;
            }
            out
        };
        held.map_err(|e| volume_error(&v.name, e))
    }

    /// 507 unless the new file's filesystem has room for the source's data
    /// (and a full grow's new range): a copy of one moment writes it there.
    async fn check_moment_room(
        &self,
        src: &ImageRow,
        file: &ImageFile,
        name: &str,
        grow: Option<(u64, Allocation)>,
    ) -> Result<()> {
        let path = src.path.clone();
        let data = blocking(move || rustix::fs::lstat(path.as_str()))
            .await?
            .map(|st| st.st_blocks as u64 * 512)
            .unwrap_or(src.allocated_bytes);
        let grown = match grow {
            Some((size, Allocation::Full)) => size.saturating_sub(src.size_bytes),
            _ => 0,
        };
        let (needed, free) = (data + grown, file.free_bytes()?);
        if needed > free {
            return Err(Error::SpaceShort {
                name: name.to_string(),
                what: "copying one moment of its source's data",
                needed,
                free,
            });
        }
        Ok(())
    }

    /// The file a copy waits at while it exists (the test faults
    /// `gate_copy`, for a copy of one moment, and `slow_copy`, for a copy
    /// of a file): `copy-gate` in the service's run dir.
    pub(super) fn copy_gate(&self) -> std::path::PathBuf {
        self.settings.ublk_run_root.with_file_name("copy-gate")
    }

    /// Grows a clone whose extents are shared to `grow`'s size (its new
    /// range laid out as asked); removes it when it cannot.
    fn grow_clone(
        &self,
        path: &ImagePath,
        file: &mut ImageFile,
        grow: Option<(u64, Allocation)>,
    ) -> Result<()> {
        let Some((size, allocation)) = grow else {
            return Ok(());
        };
        file.grow(size, allocation).map_err(|e| {
            let (dev, ino) = file.identity();
            let _ = self.roots.remove_file(path, dev, ino, file.birth());
            e.into()
        })
    }

    /// Records how a copy ended: `ready` with an `image_copied` event; on a
    /// failure its partial file is removed and the image `failed`; when
    /// cancelled (a DELETE of the image, or the service's stop) whoever
    /// cancelled it removes it.
    async fn end_copy(
        &self,
        row: &ImageRow,
        job: &AllocateJob,
        took: std::time::Duration,
        out: Result<(bool, u64)>,
    ) -> Ended {
        let done = job.done_bytes.load(Relaxed);
        let recorded = async {
            let mut tx = self.store.begin().await?;
            match &out {
                Ok((true, allocated)) => {
                    tx.set_image_state(row.id, ImageState::Ready, None, *allocated)
                        .await?;
                    tx.event(
                        None,
                        Some(row.id),
                        "image_copied",
                        &format!(
                            "image '{}': copy done, {} in {:.1} s; ready",
                            row.name,
                            model::size_text(done),
                            took.as_secs_f64()
                        ),
                    )
                    .await?;
                }
                Ok((false, _)) => {
                    tx.event(
                        None,
                        Some(row.id),
                        "image_copy_cancelled",
                        &format!(
                            "image '{}': copy stopped after {}",
                            row.name,
                            model::size_text(done)
                        ),
                    )
                    .await?;
                }
                Err(e) => {
                    let reason = format!(
                        "the copy failed after {done} bytes: {e}; its partial file was removed"
                    );
                    self.fail_copy(&mut tx, row, &reason).await?;
                }
            }
            tx.commit().await
        }
        .await;
        Ended::of(out, |(done, _)| *done, recorded, "a copy", &row.name)
    }

    /// At adoption: a copy of one moment that an adopted worker still runs
    /// was begun by a service that died (its image is failed and its file
    /// removed at start), so nothing will use it; it is stopped, so the
    /// volume's writes stop paying for it and its next snapshot may begin.
    pub(super) async fn stop_orphan_copy(
        &self,
        backend: &Arc<dyn VolumeBackend>,
        v: &VolumeRow,
        att: &crate::backend::Attachment,
    ) {
        if !matches!(v.backend, Backend::Ublk | Backend::Dm) {
            return;
        }
        let job = Arc::new(AllocateJob::default());
        job.cancel.store(true, Relaxed);
        let (b, a, id) = (backend.clone(), att.clone(), v.id);
        // No copy (an error: none to follow) or one that ended: nothing to do.
        if let Ok(Ok(false)) = blocking(move || b.follow_copy(&a, id, &job)).await {
            tracing::warn!(volume = %v.name, "stopped a copy of one moment its service began before it died");
        }
    }

    /// At start, before anything is served: an image still `copying` was
    /// left by a service that stopped or died during its copy. Its partial
    /// file is removed and it is `failed`, never served as `ready`.
    pub(super) async fn fail_interrupted_copies(&self) -> Result<()> {
        for row in self.store.images().await? {
            if row.state != ImageState::Copying {
                continue;
            }
            let reason = "the service stopped during its copy; its partial file was removed (delete the image, then snapshot or clone again)";
            let mut tx = self.store.begin().await?;
            self.fail_copy(&mut tx, &row, reason).await?;
            tx.commit().await?;
            tracing::warn!(image = %row.name, "an interrupted copy was removed");
        }
        Ok(())
    }

    /// Removes an unfinished copy's file (if it is still that file) and
    /// records the image `failed` for `reason`, with an event.
    pub(super) async fn fail_copy(
        &self,
        tx: &mut crate::store::WriteTx,
        row: &ImageRow,
        reason: &str,
    ) -> std::result::Result<(), crate::store::StoreError> {
        if let Ok(path) = self.roots.resolve(&row.path) {
            let _ = self
                .roots
                .remove_file(&path, row.dev, row.ino, row.birth.as_deref());
        }
        tx.set_image_state(row.id, ImageState::Failed, Some(reason), 0)
            .await?;
        tx.event(
            None,
            Some(row.id),
            "image_copy_failed",
            &format!("image '{}': {reason}", row.name),
        )
        .await
    }

    /// 409 `image_not_ready` unless the image's file is complete; 409
    /// `image_is_standby` while it follows another image's backups (its
    /// bytes are the next apply's, until it is activated).
    pub(super) fn refuse_unready(&self, row: &ImageRow, what: &str) -> Result<()> {
        self.refuse_unready_copy(row, what)?;
        match row.standby_of {
            Some(source_image) => Err(Error::ImageIsStandby {
                name: row.name.clone(),
                source_image,
                what: what.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// 409 `image_not_ready` while the image's copy runs or after it failed.
    pub(super) fn refuse_unready_copy(&self, row: &ImageRow, what: &str) -> Result<()> {
        let (state, reason) = match row.state {
            ImageState::Ready => return Ok(()),
            ImageState::Copying => (
                "copying",
                format!(
                    "its copy runs, so it cannot {what} until it is ready (GET /v1/images/{} shows its progress)",
                    row.name
                ),
            ),
            ImageState::Failed => (
                "failed",
                format!(
                    "it cannot {what}: {}",
                    row.state_reason.as_deref().unwrap_or("its copy failed")
                ),
            ),
        };
        Err(Error::ImageNotReady {
            name: row.name.clone(),
            state,
            reason,
        })
    }

    /// 422 `image_read_only` for a change of a read-only image's bytes.
    pub(super) fn refuse_read_only(&self, row: &ImageRow, what: &str) -> Result<()> {
        if !row.read_only {
            return Ok(());
        }
        Err(Error::ImageReadOnly {
            name: row.name.clone(),
            source_id: row
                .snapshot_of
                .map_or_else(|| "another image".to_string(), |s| s.to_string()),
            reason: what.to_string(),
        })
    }

    /// Syncs `src` and makes a new file at `path` from it: its extents
    /// shared where the filesystem can (then grown to `grow`), else empty
    /// for a copy. Returns the new file, how it started, the open source,
    /// and how long the clone took (a loop volume's writes wait on the
    /// file's lock meanwhile: that is its pause).
    pub(super) async fn clone_file(
        self: &Arc<Self>,
        src: &ImageRow,
        path: &ImagePath,
        grow: Option<(u64, Allocation)>,
    ) -> Result<(ImageFile, CloneStart, ImageFile, std::time::Duration)> {
        let (me, s, p) = (self.clone(), src.clone(), path.clone());
        blocking(move || -> Result<_> {
            let src_file = me.open_image(&s, Access::ReadOnly)?;
            src_file.sync()?;
            let started = std::time::Instant::now();
            let (mut file, start) = me.roots.create_clone(&p, &src_file)?;
            let took = started.elapsed();
            if start == CloneStart::Reflinked {
                me.grow_clone(&p, &mut file, grow)?;
            }
            Ok((file, start, src_file, took))
        })
        .await?
    }
}

impl Images {
    /// `POST /v1/images` with `clone_from`: a writable image at `path` made
    /// from `source`, grown to `grow`'s size (its new range laid out as
    /// asked) when given.
    pub(super) async fn clone_image(
        &self,
        source: &str,
        name: &str,
        path: &str,
        grow: Option<CreateImageFile>,
        labels: Labels,
    ) -> Result<Image> {
        validate_name("image", name)?;
        let src = self.house.image_row(source).await?;
        self.copy_image(src, name, path, false, grow, labels).await
    }

    /// Makes the new file (reflink, or empty for a copy, refused with 507
    /// when the source's data cannot fit), records it, and starts the copy.
    async fn copy_image(
        &self,
        src: ImageRow,
        name: &str,
        path: &str,
        snapshot: bool,
        grow: Option<CreateImageFile>,
        labels: Labels,
    ) -> Result<Image> {
        let path = self.house.roots.resolve(path)?;
        let _registering = self.house.claim_name(name).await?;
        let _source = self.house.locks.images.lock(&src.id.to_string()).await;
        let src = self.house.image_row(&src.id.to_string()).await?;
        let size = self.copyable(&src, name, snapshot, grow.as_ref())?;
        let grow = grow.map(|g| (g.size_bytes, g.allocation));
        let attached = self.house.attached_volumes(src.id).await?;
        let warnings = self
            .check_provisioning(name, &path.display(), size, true)
            .await?;
        let mut undo = Undo::default();
        let made = self
            .make_copy_file(&src, &path, name, &attached, grow, &mut undo)
            .await?;
        // From here the copy of one moment may run: any refusal stops it
        // before the file is undone.
        let recorded = async {
            if let Some(src_file) = &made.copy_from {
                copy_has_room(&src, name, &attached, &made.file, src_file, grow)?;
            }
            let row = ImageRow {
                labels: labels.clone(),
                ..copy_row(&src, name, &path, size, &made, snapshot, grow)?
            };
            let (event, how) = copy_event(name, snapshot, &made);
            let kind = if snapshot {
                "a read-only snapshot"
            } else {
                "a writable clone"
            };
            let mut tx = self.house.store.begin().await?;
            tx.insert_image(&row).await?;
            tx.event(
                None,
                Some(row.id),
                event,
                &format!(
                    "image '{name}' ({}) is {kind} of image '{}': {how}",
                    row.path, src.name
                ),
            )
            .await?;
            for w in &warnings {
                tx.event(None, Some(row.id), "image_overcommitted", w)
                    .await?;
            }
            tx.commit().await?;
            Ok::<_, Error>(row)
        }
        .await;
        let row = match recorded {
            Ok(row) => row,
            Err(e) => {
                if let Some(c) = &made.copier {
                    c.stop().await;
                }
                return Err(e);
            }
        };
        undo.commit();
        tracing::info!(image = %row.name, source = %src.name, reflinked = made.reflinked(), "image copy recorded");
        if let Some(c) = made.copier {
            self.start_moment_copy(&row, src.id, made.file, c, grow);
        } else if let Some(src_file) = made.copy_from {
            let private = made.start == CloneStart::Copy { private: true };
            self.start_copy(&row, src.id, made.file, src_file, private, grow);
        }
        let mut image = self.image_view(row).await?;
        image.warnings = warnings;
        Ok(image)
    }

    /// The size of a copy of `src` (grown to `grow`'s when given), or why
    /// `src` cannot be copied now: not ready, an allocate runs on it, or the
    /// copy would be smaller than it.
    fn copyable(
        &self,
        src: &ImageRow,
        name: &str,
        snapshot: bool,
        grow: Option<&CreateImageFile>,
    ) -> Result<u64> {
        let what = if snapshot {
            "be snapshotted"
        } else {
            "be cloned"
        };
        self.house.refuse_unready(src, what)?;
        self.jobs.allocations.refuse(src, what)?;
        let size = grow.map_or(src.size_bytes, |g| g.size_bytes);
        if size < src.size_bytes {
            return Err(Error::Shrink {
                name: name.to_string(),
                current: src.size_bytes,
                asked: size,
            });
        }
        Ok(size)
    }

    /// The copy's new file at `path`, shared or filled from `src`; `undo`
    /// removes it if a later step fails.
    async fn make_copy_file(
        &self,
        src: &ImageRow,
        path: &ImagePath,
        name: &str,
        attached: &[(VolumeRow, Arc<dyn VolumeBackend>)],
        grow: Option<(u64, Allocation)>,
        undo: &mut Undo,
    ) -> Result<CopyFile> {
        // What may write the source meanwhile. A writable ublk or dm volume
        // holds its queues while its worker shares the extents (below). A loop
        // volume writes the file with direct I/O or through its page cache:
        // every write that completed is in the file or written back by the
        // sync and the FICLONE, which the filesystem's locking orders after it.
        let serving = attached
            .iter()
            .find(|(v, b)| b.kind() != Backend::Loop && !v.read_only)
            .cloned();
        let made = match serving {
            Some((v, backend)) => {
                let m = self
                    .share_with_serving(src, path, v, backend, name, grow)
                    .await?;
                CopyFile {
                    file: m.file,
                    start: CloneStart::Reflinked,
                    copy_from: None,
                    held: Some(m.held),
                    copier: m.copier,
                }
            }
            None => {
                let (file, start, src_file, took) = self.house.clone_file(src, path, grow).await?;
                let copy_from = (start != CloneStart::Reflinked).then_some(src_file);
                // A loop volume's writes wait on the file's lock while the
                // reflink runs: that is its pause.
                let held = attached
                    .iter()
                    .find(|(v, _)| !v.read_only)
                    .filter(|_| copy_from.is_none())
                    .map(|(v, _)| {
                        held_text(&v.name, "loop: the filesystem's lock on the file", took)
                    });
                CopyFile {
                    file,
                    start,
                    copy_from,
                    held,
                    copier: None,
                }
            }
        };
        let ((dev, ino), birth) = (made.file.identity(), made.file.birth().map(str::to_string));
        let (me, path) = (self.clone(), path.clone());
        undo.push("remove the copy's file", move || {
            let _ = me
                .house
                .roots
                .remove_file(&path, dev, ino, birth.as_deref());
        });
        Ok(made)
    }

    /// Puts one moment of `src`, which writable volume `v` serves, in a new
    /// file at `path`: every write completed before the request, none begun
    /// after the answer. Where the filesystem shares extents, the backend
    /// holds the volume's I/O while they are shared, and the file is
    /// complete; where it cannot, the backend holds it once while the
    /// volume's worker begins a copy-before-write, and the file fills in the
    /// background ([`SharedMoment::copier`]). A volume on `direct` is moved
    /// to `nowait` first, for good (its map must own its extents alone),
    /// recorded with a `dispatch_changed` event. A grow (a clone's) applies
    /// once the file is complete.
    pub(super) async fn share_with_serving(
        &self,
        src: &ImageRow,
        path: &ImagePath,
        v: VolumeRow,
        backend: Arc<dyn VolumeBackend>,
        name: &str,
        grow: Option<(u64, Allocation)>,
    ) -> Result<SharedMoment> {
        let refused = |v: &VolumeRow, reason: String| Error::SnapshotAttached {
            name: src.name.clone(),
            volume: v.name.clone(),
            backend: v.backend.as_str(),
            reason,
        };
        let _volume = self.house.locks.volumes.lock(&v.name).await;
        let v = match self.house.store.volume(&v.id.to_string()).await? {
            Some(now) if now.attachment.is_some() => now,
            _ => return Err(refused(&v, VOLUME_CHANGED.into())),
        };
        let (me, p) = (self.clone(), path.clone());
        let (file, shares) = blocking(move || me.house.roots.create_for_moment(&p)).await??;
        let identity = file.identity();
        let birth = file.birth().map(str::to_string);
        let remove = || {
            let _ = self
                .house
                .roots
                .remove_file(path, identity.0, identity.1, birth.as_deref());
        };
        let claim = match shares {
            true => None,
            false => {
                let checked = self.house.check_moment_room(src, &file, name, grow).await;
                let claim = checked.and_then(|()| {
                    self.jobs
                        .moments
                        .claim(src, &v, &path.display().to_string())
                });
                Some(claim.inspect_err(|_| remove())?)
            }
        };
        let dest = SnapshotDest {
            path: path.display().into(),
            identity,
        };
        let (v, att, held) = self
            .take_moment(&backend, v, name, dest, shares)
            .await
            .inspect_err(|_| remove())?;
        let copier = claim.map(|claim| Copier {
            volume: v,
            attachment: att,
            backend,
            _claim: claim,
        });
        match self.moment_file(file, path, shares, grow).await {
            Ok(file) => Ok(SharedMoment { file, held, copier }),
            Err(e) => {
                if let Some(c) = &copier {
                    c.stop().await;
                }
                remove();
                Err(e)
            }
        }
    }

    /// Takes serving volume `v` off `direct` and has its backend hold its
    /// I/O for the moment written into `dest`: the volume and attachment
    /// after, and how long I/O was held, in words.
    async fn take_moment(
        &self,
        backend: &Arc<dyn VolumeBackend>,
        v: VolumeRow,
        name: &str,
        dest: SnapshotDest,
        shares: bool,
    ) -> Result<(VolumeRow, Attachment, String)> {
        let (v, att) = self.house.off_direct(backend, v, name).await?;
        let held = self
            .house
            .hold_moment(backend, &v, &att, dest, shares)
            .await?;
        tracing::info!(volume = %v.name, held_us = held.as_micros(), shares, "I/O held for a moment");
        let how = format!("{} {}", v.backend.as_str(), att.dispatch.as_str());
        let held = held_text(&v.name, &how, held);
        Ok((v, att, held))
    }

    /// The moment's file once the worker sized it (a copy) or shared its
    /// extents (grown to `grow` then).
    async fn moment_file(
        &self,
        file: ImageFile,
        path: &ImagePath,
        shares: bool,
        grow: Option<(u64, Allocation)>,
    ) -> Result<ImageFile> {
        let (me, p) = (self.clone(), path.clone());
        blocking(move || -> Result<ImageFile> {
            let mut file = file;
            file.refresh()?;
            if shares {
                me.house.grow_clone(&p, &mut file, grow)?;
            }
            Ok(file)
        })
        .await
        .and_then(|r| r)
    }

    /// Runs the copy into `file` on a blocking thread, then records its end.
    fn start_copy(
        &self,
        row: &ImageRow,
        source: Uuid,
        mut file: ImageFile,
        src: ImageFile,
        private: bool,
        grow: Option<(u64, Allocation)>,
    ) {
        let pace = self.house.settings.faults.pace(Slow::Copy);
        let kind = CopyRun {
            source,
            name: row.name.clone(),
        };
        // A slowed copy is also held at the copy gate while it exists, so a
        // test can act on a copy still running whatever the host's load.
        let gate = self
            .house
            .settings
            .faults
            .slows(Slow::Copy)
            .then(|| self.house.copy_gate());
        let (me, row) = (self.clone(), row.clone());
        let total = src.allocated();
        self.jobs
            .copies
            .start(row.id, kind, (pace, gate), total, move |job| async move {
                let started = std::time::Instant::now();
                let j = job.clone();
                let out = blocking(move || {
                    let done = file.copy_from(&src, &j, private)?;
                    if let (true, Some((size, alloc))) = (done, grow) {
                        file.grow(size, alloc)?;
                    }
                    Ok((done, file.allocated()))
                })
                .await
                .and_then(|r: Result<(bool, u64)>| r);
                me.house.end_copy(&row, &job, started.elapsed(), out).await
            });
    }

    /// Follows a serving volume's copy of one moment into `file` as a job,
    /// grows the file when it is complete, then records its end.
    fn start_moment_copy(
        &self,
        row: &ImageRow,
        source: Uuid,
        mut file: ImageFile,
        copier: Copier,
        grow: Option<(u64, Allocation)>,
    ) {
        let kind = CopyRun {
            source,
            name: row.name.clone(),
        };
        let (me, row) = (self.clone(), row.clone());
        let total = row.size_bytes;
        self.jobs.copies.start(
            row.id,
            kind,
            (std::time::Duration::ZERO, None),
            total,
            move |job| async move {
                let started = std::time::Instant::now();
                let out = async {
                    let done = copier.follow(job.clone()).await?;
                    blocking(move || {
                        file.refresh()?;
                        if let (true, Some((size, alloc))) = (done, grow) {
                            file.grow(size, alloc)?;
                        }
                        Ok((done, file.allocated()))
                    })
                    .await?
                }
                .await;
                me.house.end_copy(&row, &job, started.elapsed(), out).await
            },
        );
    }

    /// A volume may use the image: it is `ready`, and the volume is
    /// read-only when the image is.
    pub(super) fn check_volume_image(
        &self,
        image: &ImageRow,
        volume: &str,
        read_only: bool,
    ) -> Result<()> {
        self.house
            .refuse_unready(image, &format!("get volume '{volume}'"))?;
        if read_only {
            return Ok(());
        }
        self.jobs
            .copies
            .refuse(image, &format!("get writable volume '{volume}'"))?;
        self.jobs
            .backups
            .refuse(image, &format!("get writable volume '{volume}'"))?;
        self.house.refuse_read_only(
            image,
            &format!("volume '{volume}' on it must be created with \"read_only\": true"),
        )
    }

    /// `POST /v1/images/{id}/snapshots`: a read-only image made from
    /// `source`, its file named `name` in the source's directory.
    pub(crate) async fn snapshot_image(&self, source: &str, name: &str) -> Result<Image> {
        validate_name("image", name)?;
        let src = self.house.image_row(source).await?;
        let dir = std::path::Path::new(&src.path)
            .parent()
            .unwrap_or(std::path::Path::new("/"));
        let path = dir.join(name).display().to_string();
        // A snapshot starts without labels: a schedule's selector that
        // names its source does not back the snapshot up too.
        self.copy_image(src, name, &path, true, None, Labels::new())
            .await
    }

    /// `GET /v1/images?snapshot_of=`: the snapshots of an image (by id or
    /// name; an id also finds those of a forgotten image).
    pub(crate) async fn snapshots_of(&self, source: &str) -> Result<Vec<Image>> {
        let id = match self.house.store.image(source).await? {
            Some(row) => row.id,
            None => Uuid::parse_str(source).map_err(|_| Error::ImageNotFound(source.into()))?,
        };
        Ok(self
            .list()
            .await?
            .into_iter()
            .filter(|i| i.snapshot_of == Some(id))
            .collect())
    }
}
