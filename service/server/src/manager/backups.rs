//! Backups off the host: an image's bytes at one moment, stored on the
//! service's backup target by `blockplane_backup` (chunks and a manifest),
//! listed from the target so every service pointed at it sees the same, and
//! restored into a new image in the background, a job as a copy is.
//!
//! The moment: an image no writable volume serves is read as it is, its
//! writers refused until the backup ends (a writable volume, a grow, an
//! allocate); an image a writable volume serves is first shared into a
//! hidden file by the volume's backend at one moment of its I/O (as a
//! snapshot is), which needs a filesystem that shares extents, else the
//! backup is refused with the remedy a snapshot gets.

use crate::fault::Slow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use time::OffsetDateTime;
use uuid::Uuid;

use super::blocking::blocking;
use super::copies::{Copier, SharedMoment};
use super::error::{Error, Result};
use super::house::House;
use super::image_jobs::Images;
use super::images::new_file_row;
use super::jobs::{Ended, JobState};
use super::names::validate_name;
use super::runs::{BackupRun, CopyRun};
use super::target::Backups;
use super::undo::Undo;
use crate::backend::VolumeBackend;
use crate::store::{ImageRow, VolumeRow};
use blockplane_api::model::Labels;
use blockplane_api::model::{
    self, Backend, Backup, BackupGc, BackupState, BackupVerify, BadChunk, Image, ImageState,
};
use blockplane_backup::{BackupMeta, Counters, Manifest, Target};
use blockplane_system::image::{Access, AllocateJob, CloneStart, ImageFile, ImagePath};

/// The hidden file that holds a backup's moment of an image a writable
/// volume serves, next to the image (removed when the backup ends, and at
/// the next start if the service died first).
fn moment_path(image: &ImageRow, backup: Uuid) -> std::path::PathBuf {
    let file = std::path::Path::new(&image.path);
    file.with_file_name(format!("{MOMENT_PREFIX}{backup}"))
}

/// The name a moment file starts with.
const MOMENT_PREFIX: &str = ".blockplane-backup-";

/// A backup as the API shows it, from its manifest.
fn done_view(m: &Manifest) -> Backup {
    Backup {
        id: m.id,
        name: m.name.clone(),
        state: BackupState::Done,
        image_id: m.image.id,
        image_name: m.image.name.clone(),
        size_bytes: m.image.size_bytes,
        encrypted: m.image.encrypted,
        created_at: m.created_at,
        finished_at: Some(m.finished_at),
        chunks: m.chunks.len() as u64,
        stored_bytes: m.stored_bytes,
        uploaded_bytes: m.uploaded_bytes,
        deduplicated_bytes: m.deduplicated_bytes,
        done_bytes: None,
        total_bytes: None,
        error: None,
        source_host: m.source.host.clone(),
        blockplane_version: m.blockplane_version.clone(),
    }
}

/// A chunk as the API names it.
fn bad_chunk(m: &Manifest, c: &blockplane_backup::ChunkRef) -> BadChunk {
    BadChunk {
        index: c.index,
        offset: c.index * m.chunk_size,
        hash: c.hash.clone(),
    }
}

/// This host's name, for the manifests it writes.
fn host_name() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// The row of `name`, restored from backup `m` into `file` at `path`:
/// sparse and `copying` until the restore ends.
fn restore_row(
    name: &str,
    path: &ImagePath,
    file: &ImageFile,
    m: &blockplane_backup::Manifest,
) -> Result<ImageRow> {
    Ok(ImageRow {
        size_bytes: m.image.size_bytes,
        allocated_bytes: 0,
        allocation: Some(blockplane_api::model::Allocation::Sparse),
        restored_from: Some(m.id),
        state: ImageState::Copying,
        ..new_file_row(name, path, file)?
    })
}

/// What a backup reads, as [`Images::backup_source`] found it.
struct BackupSource {
    /// The file read.
    file: ImageFile,
    /// The hidden moment file's path (`None`: the image's own file).
    moment: Option<ImagePath>,
    /// How long a volume's I/O was held for the moment, in words.
    held: Option<String>,
    /// The serving volume's worker, when it copies the moment.
    copier: Option<Copier>,
}

impl BackupSource {
    /// How the backup reads its image, for its event.
    fn how(&self) -> String {
        match (&self.held, &self.copier) {
            (Some(held), Some(_)) => format!(
                "its moment copied into a hidden file first, each chunk a write reaches copied before it (this filesystem cannot share extents); {held}"
            ),
            (Some(held), None) => format!("its moment shared into a hidden file (reflink); {held}"),
            (None, _) => {
                "read from its file; writable volumes, grows and allocates of it wait for its end"
                    .to_string()
            }
        }
    }
}

/// A backup's and a restore's steps that need the house alone.
impl House {
    /// At start, before any backup: removes the moment files that backups
    /// left next to their images when the service died during them. Only a
    /// regular file named exactly as a moment (the prefix and a uuid), under
    /// the image roots and through no symlink, registered as no image.
    pub(super) async fn remove_backup_moments(&self) -> Result<()> {
        use std::os::unix::fs::MetadataExt;
        let rows = self.store.images().await?;
        let registered: std::collections::HashSet<&str> =
            rows.iter().map(|r| r.path.as_str()).collect();
        let dirs: std::collections::BTreeSet<&std::path::Path> = rows
            .iter()
            .filter_map(|r| std::path::Path::new(&r.path).parent())
            .collect();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name();
                let is_moment = name
                    .to_str()
                    .and_then(|n| n.strip_prefix(MOMENT_PREFIX))
                    .is_some_and(|id| Uuid::parse_str(id).is_ok());
                let full = e.path().display().to_string();
                if !is_moment || registered.contains(full.as_str()) {
                    continue;
                }
                // `file_type` does not follow a symlink; `resolve` refuses one
                // anywhere in the path, and `remove_file` removes only the
                // file seen here.
                let (Ok(meta), Ok(path)) = (e.metadata(), self.roots.resolve(&full)) else {
                    continue;
                };
                if e.file_type().is_ok_and(|t| t.is_file())
                    && self
                        .roots
                        .remove_file(&path, meta.dev(), meta.ino(), None)
                        .is_ok()
                {
                    tracing::warn!(file = %full, "removed a backup's moment left by a service that stopped during it");
                }
            }
        }
        Ok(())
    }

    /// Who holds this service's leases: its instance and host (a copy of
    /// its registry elsewhere has the same instance).
    fn lease_owner(&self) -> String {
        format!("{}@{}", self.settings.instance, host_name())
    }

    /// What backup `id` of `src` says of itself, read from `file`.
    fn backup_meta(&self, id: Uuid, name: &str, src: &ImageRow, file: &ImageFile) -> BackupMeta {
        BackupMeta {
            id,
            name: name.to_string(),
            image: blockplane_backup::ImageMeta {
                id: src.id,
                name: src.name.clone(),
                size_bytes: file.size(),
                encrypted: src.encryption.is_some(),
            },
            source: blockplane_backup::SourceMeta {
                host: host_name(),
                path: src.path.clone(),
                service: self.lease_owner(),
            },
            created_at: self.settings.clock.now(),
        }
    }

    /// Records a restore's end as [`Self::end_copy`] does a copy's.
    async fn end_restore(
        &self,
        row: &ImageRow,
        m: &Manifest,
        job: &AllocateJob,
        took: std::time::Duration,
        out: Result<(bool, u64, Option<model::ImageEncryption>)>,
    ) -> Ended {
        let done = job.done_bytes.load(Relaxed);
        let recorded = async {
            let mut tx = self.store.begin().await?;
            match &out {
                Ok((true, allocated, encryption)) => {
                    tx.set_image_encryption(row.id, encryption.as_ref()).await?;
                    tx.set_image_state(row.id, ImageState::Ready, None, *allocated)
                        .await?;
                    tx.event(
                        None,
                        Some(row.id),
                        "image_restored",
                        &format!(
                            "image '{}': restored from backup '{}' ({}), {} checked and written in {:.1} s; ready",
                            row.name,
                            m.name,
                            m.id,
                            model::size_text(done),
                            took.as_secs_f64()
                        ),
                    )
                    .await?;
                }
                Ok((false, ..)) => {
                    tx.event(
                        None,
                        Some(row.id),
                        "image_copy_cancelled",
                        &format!("image '{}': restore stopped after {}", row.name, model::size_text(done)),
                    )
                    .await?;
                }
                Err(e) => {
                    let reason = format!(
                        "the restore from backup '{}' ({}) failed after {done} bytes: {e}; its partial file was removed",
                        m.name, m.id
                    );
                    self.fail_copy(&mut tx, row, &reason).await?;
                }
            }
            tx.commit().await
        }
        .await;
        Ended::of(out, |(done, ..)| *done, recorded, "a restore", &row.name)
    }

    /// Shares a loop volume's image into `path` at one moment: the loop
    /// driver's writes wait on the file's lock while `FICLONE` runs.
    /// Refused where the filesystem cannot share extents.
    async fn share_loop_moment(
        self: &Arc<Self>,
        src: &ImageRow,
        path: &ImagePath,
        v: &crate::store::VolumeRow,
    ) -> Result<SharedMoment> {
        let (file, start, _, took) = self.clone_file(src, path, None).await?;
        if start != CloneStart::Reflinked {
            let (dev, ino) = file.identity();
            let _ = self.roots.remove_file(path, dev, ino, file.birth());
            let backend = self.backend(Backend::Loop).expect("the volume's backend");
            return Err(Error::SnapshotAttached {
                name: src.name.clone(),
                volume: v.name.clone(),
                backend: "loop",
                reason: super::copies::copy_under_writes(v, backend.as_ref()),
            });
        }
        let held =
            super::copies::held_text(&v.name, "loop: the filesystem's lock on the file", took);
        Ok(SharedMoment {
            file,
            held,
            copier: None,
        })
    }
}

impl Images {
    /// Refuses a backup of `src` now: not ready, an allocate or a copy of
    /// it runs, or a backup of it runs already.
    fn backupable(&self, src: &ImageRow) -> Result<()> {
        self.house.refuse_unready(src, "be backed up")?;
        self.jobs.allocations.refuse(src, "be backed up")?;
        self.jobs.copies.refuse(src, "be backed up")?;
        let running = self.jobs.backups.list(|id, run, p| {
            (p.state == JobState::Running && run.meta.image.id == src.id).then_some(id)
        });
        if let Some(Some(id)) = running.into_iter().find(Option::is_some) {
            return Err(Error::BackupRunning {
                name: src.name.clone(),
                backup: id,
            });
        }
        Ok(())
    }

    /// What backup `id` reads: one moment of `writable`'s I/O in a hidden
    /// file beside the image (`undo` removes it if a later step fails), or
    /// the image's own file when no volume writes it.
    async fn backup_source(
        &self,
        src: &ImageRow,
        id: Uuid,
        name: &str,
        writable: Option<(VolumeRow, Arc<dyn VolumeBackend>)>,
        undo: &mut Undo,
    ) -> Result<BackupSource> {
        let Some((v, backend)) = writable else {
            let (me, s) = (self.clone(), src.clone());
            let file = blocking(move || me.house.open_image(&s, Access::ReadOnly)).await??;
            return Ok(BackupSource {
                file,
                moment: None,
                held: None,
                copier: None,
            });
        };
        let path = self
            .house
            .roots
            .resolve(&moment_path(src, id).display().to_string())?;
        let m = if backend.kind() == Backend::Loop {
            self.house.share_loop_moment(src, &path, &v).await?
        } else {
            self.share_with_serving(src, &path, v, backend, name, None)
                .await?
        };
        let ((dev, ino), birth) = (m.file.identity(), m.file.birth().map(str::to_string));
        let (me, p) = (self.clone(), path.clone());
        undo.push("remove the backup's moment file", move || {
            let _ = me.house.roots.remove_file(&p, dev, ino, birth.as_deref());
        });
        Ok(BackupSource {
            file: m.file,
            moment: Some(path),
            held: Some(m.held),
            copier: m.copier,
        })
    }

    /// This service's backups without a manifest (running, failed,
    /// cancelled), as the API shows them.
    fn local_backups(&self) -> Vec<Backup> {
        self.jobs.backups.list(|id, run, p| {
            let m = &run.meta;
            Backup {
                id,
                name: m.name.clone(),
                state: match p.state {
                    JobState::Running => BackupState::Running,
                    JobState::Done => BackupState::Done,
                    JobState::Cancelled => BackupState::Cancelled,
                    JobState::Failed => BackupState::Failed,
                },
                image_id: m.image.id,
                image_name: m.image.name.clone(),
                size_bytes: m.image.size_bytes,
                encrypted: m.image.encrypted,
                created_at: m.created_at,
                finished_at: None,
                chunks: 0,
                stored_bytes: 0,
                uploaded_bytes: run.counters.uploaded_bytes.load(Relaxed),
                deduplicated_bytes: run.counters.deduplicated_bytes.load(Relaxed),
                done_bytes: (p.state == JobState::Running).then_some(p.done_bytes),
                total_bytes: (p.state == JobState::Running).then_some(p.total_bytes),
                error: p.error,
                source_host: m.source.host.clone(),
                blockplane_version: env!("CARGO_PKG_VERSION").to_string(),
            }
        })
    }

    /// Runs a restore into `fd` (`file`'s, read again at the end), then records its end: `ready` (with its
    /// LUKS2 header read, when it has one), or `failed` with the file removed
    /// (also when its bytes have a LUKS header and the manifest says the
    /// image was not encrypted, or the other way round).
    fn start_restore(
        &self,
        row: &ImageRow,
        target: Target,
        m: Manifest,
        file: ImageFile,
        fd: std::fs::File,
    ) {
        let pace = self.house.settings.faults.pace(Slow::Copy);
        let kind = CopyRun::restore(row.name.clone());
        let (me, row) = (self.clone(), row.clone());
        let total = m.stored_bytes;
        self.jobs.copies
            .start(row.id, kind, (pace, None), total, move |job| async move {
                let started = std::time::Instant::now();
                let out = blockplane_backup::restore(&target, &m, fd, job.clone())
                    .await
                    .map_err(Error::from);
                let out = match out {
                    Ok(true) => {
                        let (name, backup) = (row.name.clone(), m.name.clone());
                        let (backup_id, encrypted) = (m.id, m.image.encrypted);
                        blocking(move || -> Result<_> {
                            use std::os::fd::AsFd;
                            let mut file = file;
                            file.refresh()?;
                            // The restored image takes its encryption from
                            // its bytes, as a registration does; bytes that
                            // disagree with the manifest would turn an
                            // encrypted image's ciphertext into a plain
                            // volume's data, or lock a plain one behind a
                            // key its source never had.
                            let luks = blockplane_system::crypt::is_luks(file.fd().as_fd())
                                .map_err(|e| super::encryption::crypt_error(&name, e))?;
                            if luks != encrypted {
                                return Err(Error::RestoredEncryption {
                                    image: name,
                                    backup,
                                    backup_id,
                                    expected: if encrypted {
                                        "an encrypted image"
                                    } else {
                                        "an image that is not encrypted"
                                    },
                                    found: if luks {
                                        "hold a LUKS header (registered as it is, the image would need a key its source never did)"
                                    } else {
                                        "hold no LUKS header (served, its ciphertext would pass for plain data)"
                                    },
                                });
                            }
                            let encryption = super::encryption::encryption_of(&name, file.fd())?;
                            Ok((true, file.allocated(), encryption))
                        })
                        .await
                        .and_then(|r| r)
                    }
                    Ok(false) => Ok((false, 0, None)),
                    Err(e) => Err(e),
                };
                me.house.end_restore(&row, &m, &job, started.elapsed(), out).await
            });
    }
}

impl Backups {
    /// The backup target, or 409 `no_backup_target` naming the flag that
    /// sets one.
    pub(super) fn backup_target(&self, what: &str) -> Result<Target> {
        self.state
            .target
            .clone()
            .ok_or_else(|| Error::NoBackupTarget(what.to_string()))
    }

    /// At start, in the background: releases the leases of backups this
    /// service ran when it died (they wrote no manifest: they did not
    /// happen; the next gc collects their chunks), and learns each image's
    /// last backup; again every 30 s until the target answers both. A
    /// target that is away meanwhile only logs: backups fail as they start,
    /// with its reason.
    pub(super) async fn recover_backup_target(&self) {
        let Some(target) = &self.state.target else {
            return;
        };
        let owner = self.house().lease_owner();
        let mut released = false;
        loop {
            if !released {
                match blockplane_backup::release_leases(target, &owner, self.state.started).await {
                    Ok(n) => {
                        released = true;
                        if n > 0 {
                            tracing::warn!(
                                leases = n,
                                target = target.describe(),
                                "released the leases of backups this service ran when it stopped; their chunks are collected by the next gc"
                            );
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the backup target is not reachable; trying again in 30 s")
                    }
                }
            }
            if released && self.learn_last_backups(target).await.is_ok() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
        }
    }

    /// Each image's last backup with a manifest, read from the target.
    async fn learn_last_backups(&self, target: &Target) -> Result<()> {
        let list = blockplane_backup::list(target).await?;
        let mut last = HashMap::new();
        for m in list {
            let at = last.entry(m.image.id).or_insert(m.finished_at);
            *at = (*at).max(m.finished_at);
        }
        *self.state.last_done.lock().expect("poisoned") = last;
        Ok(())
    }

    /// `POST /v1/images/{id}/backups`: starts a backup of the image's bytes
    /// at this moment; 202 with it `running`.
    pub(crate) async fn backup_image(&self, image: &str, name: &str) -> Result<Backup> {
        validate_name("backup", name)?;
        let target = self.backup_target("back an image up")?;
        let src = self.house().image_row(image).await?;
        // The target is asked before any lock is taken: a slow one delays
        // this request only.
        refuse_taken_name(&target, &src, name).await?;
        let _image = self.house().locks.images.lock(&src.id.to_string()).await;
        let src = self.house().image_row(&src.id.to_string()).await?;
        self.images.backupable(&src)?;
        let id = Uuid::new_v4();
        // Read-only volumes are held until the job refuses their return to
        // writable (their PATCH and unlock take the same lock), so the image
        // has no writer from the check to the end of the backup.
        let mut held_volumes = Vec::new();
        for (_, volume) in self.house().store.volumes_of_image(src.id).await? {
            held_volumes.push(self.house().locks.volumes.lock(&volume).await);
        }
        let writable = self
            .house()
            .attached_volumes(src.id)
            .await?
            .into_iter()
            .find(|(v, _)| !v.read_only);
        if writable.is_some() {
            // The snapshot path takes the volume's lock itself.
            held_volumes.clear();
        }
        let mut undo = Undo::default();
        let source = self
            .images
            .backup_source(&src, id, name, writable, &mut undo)
            .await?;
        let meta = self.house().backup_meta(id, name, &src, &source.file);
        let started = format!(
            "image '{}': backup '{name}' ({id}) to {} started: {}",
            src.name,
            target.describe(),
            source.how()
        );
        if let Err(e) = self
            .house()
            .record_image_event(src.id, "backup_started", &started)
            .await
        {
            if let Some(c) = &source.copier {
                c.stop().await;
            }
            return Err(e);
        }
        undo.commit();
        let reads_image = source.moment.is_none();
        let BackupSource {
            file,
            moment,
            copier,
            ..
        } = source;
        self.start_backup(target, meta, file, moment, reads_image, copier);
        drop(held_volumes);
        self.backup(&id.to_string()).await
    }

    /// Runs the backup on the runtime, then records its end.
    fn start_backup(
        &self,
        target: Target,
        meta: BackupMeta,
        file: ImageFile,
        moment: Option<ImagePath>,
        reads_image: bool,
        copier: Option<Copier>,
    ) {
        let counters = Arc::new(Counters::default());
        let run = BackupRun {
            meta: meta.clone(),
            counters: counters.clone(),
            reads_image,
        };
        let pace = self.house().settings.faults.pace(Slow::Backup);
        let gate = self
            .house()
            .settings
            .faults
            .slows(Slow::BackupGate)
            .then(|| self.state.gate.clone());
        let me = self.clone();
        let moment_identity = (file.identity(), file.birth().map(str::to_string));
        let fd: std::fs::File = file.into_fd().into();
        self.images
            .jobs
            .backups
            .start(meta.id, run, (pace, gate), 0, move |job| async move {
                let started = std::time::Instant::now();
                // A copied moment is complete first; its progress is the job's
                // until the backup's own begins. The copier goes once it
                // ends: the volume may copy another moment meanwhile.
                let copied =
                    match copier {
                        Some(c) => c.follow(job.clone()).await.map_err(|e| {
                            blockplane_backup::Error::Image {
                                backup: blockplane_backup::BackupRef {
                                    id: meta.id,
                                    name: meta.name.clone(),
                                },
                                action: format!("copy one moment of volume '{}'", c.volume()),
                                source: std::io::Error::other(e.to_string()),
                            }
                        }),
                        None => Ok(true),
                    };
                let out = match copied {
                    Ok(true) => {
                        blockplane_backup::backup(
                            &target,
                            meta.clone(),
                            fd,
                            job.clone(),
                            counters.clone(),
                        )
                        .await
                    }
                    Ok(false) => Ok(None),
                    Err(e) => Err(e),
                };
                if let Some(path) = &moment {
                    let ((dev, ino), birth) = &moment_identity;
                    let _ = me
                        .house()
                        .roots
                        .remove_file(path, *dev, *ino, birth.as_deref());
                }
                me.end_backup(&target, &meta, &job, &counters, started.elapsed(), out)
                    .await
            });
    }

    /// Records how a backup ended: an event, the counters, and the image's
    /// last backup.
    async fn end_backup(
        &self,
        target: &Target,
        meta: &BackupMeta,
        job: &AllocateJob,
        counters: &Counters,
        took: std::time::Duration,
        out: blockplane_backup::Result<Option<Manifest>>,
    ) -> Ended {
        let (uploaded, deduped) = (
            counters.uploaded_bytes.load(Relaxed),
            counters.deduplicated_bytes.load(Relaxed),
        );
        self.state.uploaded_bytes.fetch_add(uploaded, Relaxed);
        self.state.deduplicated_bytes.fetch_add(deduped, Relaxed);
        let who = format!(
            "image '{}': backup '{}' ({})",
            meta.image.name, meta.name, meta.id
        );
        let (state, kind, text, error) = match &out {
            Ok(Some(m)) => {
                self.state
                    .last_done
                    .lock()
                    .expect("poisoned")
                    .insert(meta.image.id, m.finished_at);
                (
                    JobState::Done,
                    "backup_done",
                    format!(
                        "{who} done in {:.1} s: {} chunks, {} stored, {} uploaded, {} already on {}",
                        took.as_secs_f64(),
                        m.chunks.len(),
                        model::size_text(m.stored_bytes),
                        model::size_text(uploaded),
                        model::size_text(deduped),
                        target.describe()
                    ),
                    None,
                )
            }
            Ok(None) => (
                JobState::Cancelled,
                "backup_cancelled",
                format!(
                    "{who} cancelled after {}; no manifest was written",
                    model::size_text(job.done_bytes.load(Relaxed))
                ),
                None,
            ),
            Err(e) => (
                JobState::Failed,
                "backup_failed",
                format!("{who} failed: {e}; no manifest was written, the image is as it was"),
                Some(e.to_string()),
            ),
        };
        let recorded = self.house().record_image_event(meta.image.id, kind, &text);
        if let Err(e) = recorded.await {
            tracing::error!(backup = %meta.id, error = %e, "could not record the end of a backup");
        }
        tracing::info!(backup = %meta.id, state = ?state, "{text}");
        Ended { state, error }
    }

    /// `GET /v1/backups`: the target's backups (any service's) and this
    /// service's without a manifest, oldest first; `image` by id, or by
    /// name (a registered image's id, else the name it was backed up as).
    pub(crate) async fn list(&self, image: Option<&str>) -> Result<Vec<Backup>> {
        let target = self.backup_target("list backups")?;
        let mut out: Vec<Backup> = blockplane_backup::list(&target)
            .await?
            .iter()
            .map(done_view)
            .collect();
        let listed: std::collections::HashSet<Uuid> = out.iter().map(|b| b.id).collect();
        out.extend(
            self.images
                .local_backups()
                .into_iter()
                .filter(|b| !listed.contains(&b.id) && b.state != BackupState::Done),
        );
        if let Some(image) = image {
            let id = match self.house().store.image(image).await? {
                Some(row) => Some(row.id),
                None => Uuid::parse_str(image).ok(),
            };
            out.retain(|b| Some(b.image_id) == id || (id.is_none() && b.image_name == image));
        }
        out.sort_by_key(|b| b.created_at);
        Ok(out)
    }

    /// `GET /v1/backups/{id}`: by id, or by name when one backup has it.
    /// This service's own backup without a manifest is found by id without
    /// the target: a backup that failed for want of it still shows why.
    pub(crate) async fn backup(&self, id_or_name: &str) -> Result<Backup> {
        if let Ok(id) = Uuid::parse_str(id_or_name)
            && let Some(local) = self
                .images
                .local_backups()
                .into_iter()
                .find(|b| b.id == id && b.state != BackupState::Done)
        {
            return Ok(local);
        }
        let all = self.list(None).await?;
        let by_id = Uuid::parse_str(id_or_name).ok();
        let mut found = all
            .into_iter()
            .filter(|b| Some(b.id) == by_id || b.name == id_or_name);
        match (found.next(), found.next()) {
            (Some(b), None) => Ok(b),
            (None, _) => Err(Error::BackupNotFound(id_or_name.to_string())),
            (Some(a), Some(b)) => Err(Error::BackupAmbiguous {
                name: id_or_name.to_string(),
                ids: format!("{} ({}), {} ({})", a.id, a.image_name, b.id, b.image_name),
            }),
        }
    }

    /// A finished backup's manifest, by id or name.
    async fn manifest(&self, target: &Target, id_or_name: &str) -> Result<Manifest> {
        let b = self.backup(id_or_name).await?;
        if b.state != BackupState::Done {
            return Err(Error::BackupNotDone {
                name: b.name,
                state: b.state.as_str(),
            });
        }
        Ok(blockplane_backup::manifest(target, b.id).await?)
    }

    /// `DELETE /v1/backups/{id}`: cancels a running backup of this service,
    /// or deletes a finished one from the target (its chunks are collected
    /// by the gc that follows, unless another backup uses them).
    pub(crate) async fn delete_backup(&self, id_or_name: &str) -> Result<()> {
        let target = self.backup_target("delete a backup")?;
        let b = self.backup(id_or_name).await?;
        let done = match b.state {
            BackupState::Running => {
                self.images.jobs.backups.stop(b.id).await;
                match self.images.jobs.backups.progress(b.id).map(|p| p.state) {
                    // It wrote its manifest before the cancel landed: a
                    // cancel asked is a delete then.
                    Some(JobState::Done) => true,
                    Some(JobState::Running) => {
                        return Err(Error::BackupRunning {
                            name: b.image_name.clone(),
                            backup: b.id,
                        });
                    }
                    _ => false,
                }
            }
            BackupState::Done => true,
            BackupState::Failed | BackupState::Cancelled => false,
        };
        if done {
            self.delete_done(&target, &b).await?;
            self.collect_after_deletes(target);
        }
        self.images.jobs.backups.forget(b.id);
        Ok(())
    }

    /// Deletes finished backup `b` from the target, with its event.
    async fn delete_done(&self, target: &Target, b: &Backup) -> Result<()> {
        blockplane_backup::delete(target, b.id).await?;
        let deleted = format!(
            "image '{}': backup '{}' ({}) deleted from {}",
            b.image_name,
            b.name,
            b.id,
            target.describe()
        );
        self.house()
            .record_image_event(b.image_id, "backup_deleted", &deleted)
            .await
    }

    /// After deletes, in the background: their chunks go, and the images'
    /// last backups may be older ones.
    fn collect_after_deletes(&self, target: Target) {
        let me = self.clone();
        tokio::spawn(async move {
            match me.collect_backups().await {
                Ok(_) => {}
                // That gc collects what it can see; what these deletes
                // left, the next gc.
                Err(Error::Backup(e @ blockplane_backup::Error::GcBusy { .. })) => {
                    tracing::info!(error = %e, "the gc after a backup's delete is left to the next gc");
                }
                Err(e) => tracing::warn!(error = %e, "the gc after a backup's delete failed"),
            }
            if let Err(e) = me.learn_last_backups(&target).await {
                tracing::warn!(error = %e, "the last backups could not be read again");
            }
        });
    }

    /// `POST /v1/images/{id}/backups/prune`: decides each finished backup
    /// of `image` by the policy ([`blockplane_backup::retention`]) and,
    /// unless a dry run, deletes those it does not keep. One prune at a time
    /// on this service: two at once would decide on the same list.
    pub(crate) async fn prune_backups(
        &self,
        image: &str,
        req: &model::PruneBackupsRequest,
    ) -> Result<model::BackupPrune> {
        use blockplane_backup::retention::{self, Decision, Rule};
        let policy = retention_of(&format!("image '{image}'"), &req.retention)?;
        let target = self.backup_target("prune backups")?;
        let _one = self.state.prunes.lock().await;
        let backups: Vec<Backup> = self
            .list(Some(image))
            .await?
            .into_iter()
            .filter(|b| b.state == BackupState::Done)
            .collect();
        if backups.is_empty() && self.house().store.image(image).await?.is_none() {
            return Err(Error::ImageNotFound(image.to_string()));
        }
        let created: Vec<OffsetDateTime> = backups.iter().map(|b| b.created_at).collect();
        let decisions = retention::select(&created, &policy);
        let entry = |b: &Backup, kept_by| model::PrunedBackup {
            id: b.id,
            name: b.name.clone(),
            created_at: b.created_at,
            kept_by,
        };
        let (mut kept, mut doomed) = (Vec::new(), Vec::new());
        for (b, d) in backups.iter().zip(decisions) {
            match d {
                Decision::Keep(rule) => kept.push(entry(
                    b,
                    Some(match rule {
                        Rule::Last => model::RetentionRule::Last,
                        Rule::Daily => model::RetentionRule::Daily,
                        Rule::Weekly => model::RetentionRule::Weekly,
                        Rule::Monthly => model::RetentionRule::Monthly,
                        Rule::Yearly => model::RetentionRule::Yearly,
                    }),
                )),
                Decision::Remove => doomed.push(b),
            }
        }
        let mut deleted = Vec::new();
        let mut failed = None;
        for b in doomed {
            if !req.dry_run
                && let Err(e) = self.delete_done(&target, b).await
            {
                failed = Some(e);
                break;
            }
            deleted.push(entry(b, None));
        }
        if !req.dry_run && !deleted.is_empty() {
            // Also after a delete that failed: the chunks of those before it
            // are garbage either way.
            self.collect_after_deletes(target);
        }
        if let Some(e) = failed {
            return Err(e);
        }
        kept.reverse();
        deleted.reverse();
        Ok(model::BackupPrune {
            image: image.to_string(),
            dry_run: req.dry_run,
            kept,
            deleted,
        })
    }

    /// `POST /v1/backups/gc`: removes the chunks no manifest references,
    /// keeping those a backup running on any service may need.
    pub(crate) async fn collect_backups(&self) -> Result<BackupGc> {
        let target = self.backup_target("collect chunks")?;
        let _one = self.state.gc.lock().await;
        let r = blockplane_backup::gc(&target, &self.house().lease_owner()).await?;
        tracing::info!(
            deleted = r.chunks_deleted,
            kept = r.chunks_kept,
            running = r.running_backups,
            "backup target collected"
        );
        Ok(BackupGc {
            chunks_kept: r.chunks_kept,
            chunks_deleted: r.chunks_deleted,
            bytes_deleted: r.bytes_deleted,
            running_backups: r.running_backups,
        })
    }

    /// `POST /v1/backups/{id}/verify`: reads every chunk of a backup back
    /// and checks its hash, writing nothing.
    pub(crate) async fn verify_backup(&self, id_or_name: &str) -> Result<BackupVerify> {
        let target = self.backup_target("verify a backup")?;
        let m = self.manifest(&target, id_or_name).await?;
        let job = Arc::new(AllocateJob::default());
        let r = blockplane_backup::verify(&target, &m, job).await?;
        Ok(BackupVerify {
            backup_id: m.id,
            ok: r.ok(),
            chunks: r.chunks,
            bytes: r.bytes,
            missing: r.missing.iter().map(|c| bad_chunk(&m, c)).collect(),
            corrupt: r.corrupt.iter().map(|c| bad_chunk(&m, c)).collect(),
        })
    }

    /// `POST /v1/images` with `restore_from`: a new image at `path` made
    /// from a backup's chunks in the background (202, `copying`).
    pub(super) async fn restore_image(
        &self,
        backup: &str,
        name: &str,
        path: &str,
        labels: Labels,
    ) -> Result<Image> {
        validate_name("image", name)?;
        let target = self.backup_target("restore a backup")?;
        // The target is read before the registration lock, which every
        // image create on the host takes.
        let m = self.manifest(&target, backup).await?;
        self.restore_into(target, m, name, path, labels, None).await
    }

    /// A new image `name` at `path` made from backup `m` in the background;
    /// a standby of `standby_of` (its source image) when given, which
    /// holds `m` once the copy is done.
    pub(super) async fn restore_into(
        &self,
        target: Target,
        m: Manifest,
        name: &str,
        path: &str,
        labels: Labels,
        standby_of: Option<Uuid>,
    ) -> Result<Image> {
        let path = self.house().roots.resolve(path)?;
        let _registering = self.house().claim_name(name).await?;
        let size = m.image.size_bytes;
        let warnings = self
            .images
            .check_provisioning(name, &path.display(), size, true)
            .await?;
        let (me, p) = (self.clone(), path.clone());
        let file = blocking(move || {
            me.house()
                .roots
                .create_file(&p, size, blockplane_api::model::Allocation::Sparse)
        })
        .await??;
        let mut undo = Undo::default();
        let ((dev, ino), birth) = (file.identity(), file.birth().map(str::to_string));
        let (me, p) = (self.clone(), path.clone());
        undo.push("remove the restore's file", move || {
            let _ = me.house().roots.remove_file(&p, dev, ino, birth.as_deref());
        });
        let fd = file
            .fd()
            .try_clone()
            .map_err(|e| Error::Internal(format!("image '{name}': dup of its new file: {e}")))?;
        let free = file.free_bytes()?;
        if m.stored_bytes > free {
            return Err(Error::SpaceShort {
                name: name.to_string(),
                what: "restoring its backup's data",
                needed: m.stored_bytes,
                free,
            });
        }
        let row = ImageRow {
            labels,
            standby_of,
            ..restore_row(name, &path, &file, &m)?
        };
        let (kind, what) = match standby_of {
            Some(_) => ("image_standby_started", "a standby of the backups of image"),
            None => (
                "image_restore_started",
                "being restored from a backup of image",
            ),
        };
        let recorded = async {
            let mut tx = self.house().store.begin().await?;
            tx.insert_image(&row).await?;
            if standby_of.is_some() {
                // Held once the copy is `ready`; the next apply's base.
                tx.set_standby_held(row.id, &m).await?;
            }
            tx.event(
                None,
                Some(row.id),
                kind,
                &format!(
                    "image '{name}' ({}) is {what} '{}': its backup '{}' ({}) of {} is copied first, {} of data from {}; GET /v1/images/{name} shows its progress, DELETE /v1/images/{name} stops it",
                    row.path,
                    m.image.name,
                    m.name,
                    m.id,
                    m.created_at,
                    model::size_text(m.stored_bytes),
                    target.describe()
                ),
            )
            .await?;
            for w in &warnings {
                tx.event(None, Some(row.id), "image_overcommitted", w).await?;
            }
            tx.commit().await
        }
        .await;
        recorded?;
        undo.commit();
        self.images.start_restore(&row, target, m, file, fd.into());
        let mut image = self.images.image_view(row).await?;
        image.warnings = warnings;
        Ok(image)
    }

    /// Seconds since each of `images`' last backup with a manifest, by
    /// image name, for `/metrics`.
    pub(super) fn backup_ages<'a>(
        &self,
        images: impl Iterator<Item = (Uuid, &'a str)>,
    ) -> Vec<(String, f64)> {
        let last = self.state.last_done.lock().expect("poisoned");
        let now = OffsetDateTime::now_utc();
        images
            .filter_map(|(id, name)| {
                last.get(&id)
                    .map(|at| (name.to_string(), (now - *at).as_seconds_f64().max(0.0)))
            })
            .collect()
    }
}

/// Refuses a backup named `name` of `src` when `target` holds one already.
/// The backup crate's policy for `r`, refused when a count is above
/// [`model::MAX_KEEP`] or none is above 0 (it would delete every backup);
/// `owner` (`image 'db'`) names whose policy it is in the refusal.
pub(super) fn retention_of(
    owner: &str,
    r: &model::RetentionPolicy,
) -> Result<blockplane_backup::retention::Retention> {
    for (field, n) in [
        ("keep_last", r.keep_last),
        ("keep_daily", r.keep_daily),
        ("keep_weekly", r.keep_weekly),
        ("keep_monthly", r.keep_monthly),
        ("keep_yearly", r.keep_yearly),
    ] {
        if n > model::MAX_KEEP {
            return Err(Error::InvalidField {
                field,
                reason: format!("{n} is above {} ({owner})", model::MAX_KEEP),
            });
        }
    }
    let policy = blockplane_backup::retention::Retention {
        last: r.keep_last,
        daily: r.keep_daily,
        weekly: r.keep_weekly,
        monthly: r.keep_monthly,
        yearly: r.keep_yearly,
    };
    if policy.keeps_nothing() {
        return Err(Error::RetentionKeepsNothing(owner.to_string()));
    }
    Ok(policy)
}

async fn refuse_taken_name(target: &Target, src: &ImageRow, name: &str) -> Result<()> {
    let taken = blockplane_backup::list(target)
        .await?
        .into_iter()
        .find(|m| m.image.id == src.id && m.name == name);
    match taken {
        Some(m) => Err(Error::BackupNameTaken {
            name: name.to_string(),
            image: src.name.clone(),
            id: m.id,
        }),
        None => Ok(()),
    }
}
