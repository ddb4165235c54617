//! Standby images: an image of this host that holds the bytes of one
//! backup of another host's image (its source), whole, and follows that
//! image's newer backups on the shared backup target, fetching only the
//! chunks that changed, until it is activated into an ordinary image.
//!
//! - Made by `POST /v1/images` with `standby_of`: its source's newest
//!   backup restored as any restore is (`copying`, then `ready`).
//! - Followed by the follower, which lists the target for each standby
//!   every `--standby-check-secs` (and at once when told,
//!   `POST /v1/images/{id}/standby/check`), and applies a newer backup
//!   in the background as a copy job: the chunks that differ from the one
//!   it holds are journalled, then written in place
//!   (`blockplane_backup::standby`), so the file holds one backup or the
//!   next, never a mix. The manifest it holds is kept in the registry
//!   (`standby_held`): the next apply is a difference against it, and the
//!   source's retention may delete it from the target meanwhile.
//! - Until activated it takes no volume and no change of its bytes
//!   ([`super::copies`]' `refuse_unready` says `image_is_standby`).
//! - A journal a crash left is replayed (complete) or dropped (incomplete)
//!   at the next start, before the API serves, and before any later apply
//!   or activation.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use super::blocking::blocking;
use super::error::{Error, Result};
use super::house::House;
use super::image_jobs::Images;
use super::jobs::{Ended, JobState};
use super::names::validate_name;
use super::runs::CopyRun;
use super::target::Backups;
use crate::fault::Slow;
use crate::store::ImageRow;
use blockplane_api::model::{
    self, ActivateImageRequest, ActivatedImage, Image, ImageStandby, ImageState, Labels,
};
use blockplane_backup::standby::{Applied, Delta};
use blockplane_backup::{Manifest, Target};
use blockplane_system::image::Access;

/// What the follower last found for one standby.
#[derive(Debug, Clone, Default)]
pub(super) struct Follow {
    /// When, by the manager's clock.
    checked_at: Option<OffsetDateTime>,
    /// When, by the monotonic clock that paces the checks.
    checked: Option<tokio::time::Instant>,
    /// The newest backup of the source on the target, when there was one.
    newest: Option<Uuid>,
    /// Bytes of chunks that backup has and the one held lacks.
    behind_bytes: u64,
    /// Why the last check or apply failed.
    error: Option<String>,
    /// Told to check at its next turn, not at its time.
    due: bool,
    /// The backup the last apply started brings it to.
    applying: Option<Uuid>,
}

impl House {
    /// Where standby applies keep their journals: the service's run
    /// directory, not an image root.
    pub(super) fn standby_journals(&self) -> PathBuf {
        self.settings.ublk_run_root.with_file_name("standby")
    }

    /// The journal of standby image `id`'s apply.
    pub(super) fn standby_journal(&self, id: Uuid) -> PathBuf {
        self.standby_journals().join(format!("{id}.journal"))
    }
}

impl Images {
    /// What a standby image's view says of it: the backup it holds (from
    /// the registry), the follower's last check, whether an apply runs.
    pub(super) async fn standby_view(&self, row: &ImageRow, source: Uuid) -> Result<ImageStandby> {
        let held = self.house.store.standby_held(row.id).await?;
        let follow = self.follow_of(row.id);
        let applying = self.applying(row.id);
        let ready = row.state == ImageState::Ready;
        let now = self.house.settings.clock.now();
        let held_now = held.as_ref().filter(|_| ready);
        Ok(ImageStandby {
            source_image_id: source,
            source_image_name: held
                .as_ref()
                .map_or_else(String::new, |m| m.image.name.clone()),
            backup_id: held_now.map(|m| m.id),
            backup_name: held_now.map(|m| m.name.clone()),
            backup_created_at: held_now.map(|m| m.created_at),
            lag_seconds: held_now.map(|m| (now - m.created_at).as_seconds_f64().max(0.0)),
            newest_backup_id: follow.newest,
            behind_bytes: follow.behind_bytes,
            applying: applying && ready,
            checked_at: follow.checked_at,
            error: follow.error,
        })
    }

    /// Whether a copy job (a standby's apply) runs on image `id`.
    fn applying(&self, id: Uuid) -> bool {
        self.jobs
            .copies
            .progress(id)
            .is_some_and(|p| p.state == JobState::Running)
    }

    /// Forgets what the follower found of image `id` (it is deleted).
    pub(super) fn forget_follow(&self, id: Uuid) {
        self.jobs.standbys.lock().expect("poisoned").remove(&id);
    }

    fn follow_of(&self, id: Uuid) -> Follow {
        self.jobs
            .standbys
            .lock()
            .expect("poisoned")
            .get(&id)
            .cloned()
            .unwrap_or_default()
    }

    fn set_follow(&self, id: Uuid, f: impl FnOnce(&mut Follow)) {
        f(self
            .jobs
            .standbys
            .lock()
            .expect("poisoned")
            .entry(id)
            .or_default());
    }
}

/// The newest backup of image `source` (its id, or its name when every
/// backup of that name is of one image) on `target`, for standby `image`.
async fn newest_named(target: &Target, image: &str, source: &str) -> Result<Manifest> {
    let all = blockplane_backup::list(target).await?;
    let of: Vec<Manifest> = all
        .into_iter()
        .filter(|m| m.image.id.to_string() == source || m.image.name == source)
        .collect();
    let ids: BTreeSet<Uuid> = of.iter().map(|m| m.image.id).collect();
    if ids.len() > 1 {
        return Err(Error::StandbySourceAmbiguous {
            image: image.to_string(),
            source_image: source.to_string(),
            ids: ids
                .iter()
                .map(Uuid::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    newest(of).ok_or_else(|| Error::StandbySourceNotFound {
        image: image.to_string(),
        source_image: source.to_string(),
    })
}

/// The newest of `backups` by the moment their data is of (then by end).
fn newest(backups: Vec<Manifest>) -> Option<Manifest> {
    backups
        .into_iter()
        .max_by_key(|m| (m.created_at, m.finished_at))
}

impl Backups {
    /// `POST /v1/images` with `standby_of`: a new image made from the
    /// source's newest backup, which then follows its newer ones.
    pub(super) async fn standby_image(
        &self,
        source: &str,
        name: &str,
        path: &str,
        labels: Labels,
    ) -> Result<Image> {
        validate_name("image", name)?;
        let target = self.backup_target("make a standby")?;
        let m = newest_named(&target, name, source).await?;
        let source_id = m.image.id;
        let image = self
            .restore_into(target, m, name, path, labels, Some(source_id))
            .await?;
        self.images.set_follow(image.id, |f| f.due = true);
        Ok(image)
    }

    /// `POST /v1/images/{id}/standby/check`: lists the target for the
    /// standby's newer backups now, and starts an apply of the newest when
    /// it holds an older one.
    pub(crate) async fn check_standby(&self, id_or_name: &str) -> Result<Image> {
        let row = self.house().image_row(id_or_name).await?;
        if row.standby_of.is_none() {
            return Err(Error::NotAStandby(row.name));
        }
        self.house().refuse_unready_copy(&row, "be checked")?;
        self.check_one(&row).await?;
        self.images.image(&row.id.to_string()).await
    }

    /// The follower: each second, checks the standbys whose time has come
    /// (or that were told to), one after another. Runs as long as the
    /// service does.
    pub(super) async fn follow_standbys(&self) {
        if self.state.target.is_none() {
            return;
        }
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let rows = match self.house().store.standby_images().await {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "listing standby images failed");
                    continue;
                }
            };
            for row in rows {
                if row.state != ImageState::Ready {
                    continue;
                }
                let f = self.images.follow_of(row.id);
                let due = f.due
                    || self
                        .state
                        .standby_check
                        .is_some_and(|every| f.checked.is_none_or(|at| at.elapsed() >= every));
                if !due {
                    continue;
                }
                if let Err(e) = self.check_one(&row).await {
                    tracing::warn!(image = %row.name, error = %e, "a standby's check failed");
                }
            }
        }
    }

    /// [`Self::check`], its failure recorded in the view (and its time,
    /// so that the follower waits its interval before the next try).
    async fn check_one(&self, row: &ImageRow) -> Result<()> {
        let out = self.check(row).await;
        if let Err(e) = &out {
            let now = (
                self.house().settings.clock.now(),
                tokio::time::Instant::now(),
            );
            self.images.set_follow(row.id, |f| {
                (f.checked_at, f.checked, f.due) = (Some(now.0), Some(now.1), false);
                f.error = Some(e.to_string());
            });
        }
        out
    }

    /// Lists the target for `row`'s source's newest backup, records what
    /// it found, and starts an apply when that backup is newer than the
    /// one held. An apply running already is left alone.
    async fn check(&self, row: &ImageRow) -> Result<()> {
        let target = self.backup_target("follow a standby")?;
        let Some(source) = row.standby_of else {
            return Ok(());
        };
        let held = {
            // Under the image's lock, as an apply starts: a journal is
            // settled only while no apply writes one.
            let _image = self.house().locks.images.lock(&row.id.to_string()).await;
            if self.applying(row.id) {
                return Ok(());
            }
            self.recover_journal(row).await?;
            self.held(row).await?
        };
        let listed = blockplane_backup::list(&target)
            .await
            .map(|all| newest(all.into_iter().filter(|m| m.image.id == source).collect()));
        let now = (
            self.house().settings.clock.now(),
            tokio::time::Instant::now(),
        );
        let newest = listed?;
        let (newer, behind) = match &newest {
            Some(n) if n.id != held.id && n.created_at > held.created_at => {
                (Some(n.clone()), Delta::between(&held, n).fetch_bytes())
            }
            _ => (None, 0),
        };
        self.images.set_follow(row.id, |f| {
            (f.checked_at, f.checked, f.due) = (Some(now.0), Some(now.1), false);
            f.newest = newest.as_ref().map(|m| m.id);
            f.behind_bytes = behind;
            f.error = None;
        });
        match newer {
            Some(next) => self.start_apply(row, target, held, next).await,
            None => Ok(()),
        }
    }

    /// What the file holds now that the registry keeps of it: its LUKS2
    /// header (a newer backup may have changed its key slots) and its
    /// allocated bytes.
    async fn found(&self, row: &ImageRow) -> Result<(Option<model::ImageEncryption>, u64)> {
        let (me, r) = (self.clone(), row.clone());
        blocking(move || -> Result<_> {
            let file = me.house().open_image(&r, Access::ReadOnly)?;
            let encryption = super::encryption::encryption_of(&r.name, file.fd())?;
            Ok((encryption, file.allocated()))
        })
        .await?
    }

    /// Whether an apply runs on image `id`.
    fn applying(&self, id: Uuid) -> bool {
        self.images.applying(id)
    }

    /// The manifest of the backup standby `row` holds.
    async fn held(&self, row: &ImageRow) -> Result<Manifest> {
        self.house()
            .store
            .standby_held(row.id)
            .await?
            .ok_or_else(|| {
                Error::Internal(format!(
                    "standby image '{}' has no record of the backup it holds",
                    row.name
                ))
            })
    }

    /// The journal of standby `id`'s apply.
    fn journal_path(&self, id: Uuid) -> PathBuf {
        self.house().standby_journal(id)
    }

    /// Starts applying `next` onto `row`, which holds `held`: under the
    /// image's lock, once the row says it is still a ready standby and no
    /// activation took it.
    async fn start_apply(
        &self,
        row: &ImageRow,
        target: Target,
        held: Manifest,
        next: Manifest,
    ) -> Result<()> {
        let _image = self.house().locks.images.lock(&row.id.to_string()).await;
        let row = self.house().image_row(&row.id.to_string()).await?;
        if row.standby_of.is_none() || row.state != ImageState::Ready || self.applying(row.id) {
            return Ok(());
        }
        // A journal a failed apply kept is settled before another starts:
        // truncated, it would leave the file a mix nobody can finish.
        self.recover_journal(&row).await?;
        // Another check's apply may have ended since this one read what
        // the file holds: the difference would be from the wrong base.
        if self.held(&row).await?.id != held.id {
            return Ok(());
        }
        let delta = Delta::between(&held, &next);
        let journal = self.journal_path(row.id);
        let (me, r, j) = (self.clone(), row.clone(), journal.clone());
        let (image, journal_file) =
            blocking(move || me.apply_files(&r, &j, Journal::New)).await??;
        let mut tx = self.house().store.begin().await?;
        tx.event(
            None,
            Some(row.id),
            "standby_apply_started",
            &format!(
                "standby image '{}': applying backup '{}' ({}) of image '{}' taken at {} over backup '{}' ({}) taken at {}: {} of changed chunks to fetch, {} to zero; it holds backup '{}' whole until the apply ends",
                row.name,
                next.name,
                next.id,
                next.image.name,
                next.created_at,
                held.name,
                held.id,
                held.created_at,
                model::size_text(delta.fetch_bytes()),
                model::size_text(delta.zero_bytes()),
                held.name
            ),
        )
        .await?;
        tx.commit().await?;
        let pace = self.house().settings.faults.pace(Slow::Copy);
        // Held at the copy gate too, as a slowed copy is: a test acts on
        // an apply still running whatever the host's load.
        let gate = self
            .house()
            .settings
            .faults
            .slows(Slow::Copy)
            .then(|| self.house().copy_gate());
        self.images
            .set_follow(row.id, |f| f.applying = Some(next.id));
        let me = self.clone();
        self.images.jobs.copies.start(
            row.id,
            CopyRun::restore(row.name.clone()),
            (pace, gate),
            delta.fetch_bytes(),
            move |job| async move {
                let started = std::time::Instant::now();
                let out = blockplane_backup::standby::apply(
                    &target,
                    &held,
                    &next,
                    image,
                    journal_file,
                    job.clone(),
                )
                .await
                .map_err(Error::from);
                me.end_apply(&row, &held, &next, out, started.elapsed())
                    .await
            },
        );
        Ok(())
    }

    /// Records how an apply ended. Done: the registry holds `next` from
    /// here, then the journal goes. Stopped before its journal was whole:
    /// the file was not touched; the journal goes. Failed: the journal
    /// decides, as at a start ([`Self::recover_journal`]).
    async fn end_apply(
        &self,
        row: &ImageRow,
        held: &Manifest,
        next: &Manifest,
        out: Result<Applied>,
        took: Duration,
    ) -> Ended {
        let journal = self.journal_path(row.id);
        let recorded = async {
            match &out {
                Ok(a) if !a.cancelled => {
                    let found = self.found(row).await;
                    let mut tx = self.house().store.begin().await?;
                    tx.set_standby_held(row.id, next).await?;
                    record_found(&mut tx, row, found).await?;
                    tx.event(
                        None,
                        Some(row.id),
                        "standby_applied",
                        &format!(
                            "standby image '{}' holds backup '{}' ({}) of image '{}' taken at {}: {} chunks ({}) fetched and {} zeroed in {:.1} s",
                            row.name,
                            next.name,
                            next.id,
                            next.image.name,
                            next.created_at,
                            a.chunks,
                            model::size_text(a.fetched_bytes),
                            model::size_text(a.zeroed_bytes),
                            took.as_secs_f64()
                        ),
                    )
                    .await?;
                    tx.commit().await?;
                    let _ = std::fs::remove_file(&journal);
                    self.images.set_follow(row.id, |f| {
                        if f.newest == Some(next.id) {
                            f.behind_bytes = 0;
                        }
                    });
                }
                Ok(_) => {
                    let _ = std::fs::remove_file(&journal);
                    let mut tx = self.house().store.begin().await?;
                    tx.event(
                        None,
                        Some(row.id),
                        "standby_apply_stopped",
                        &format!(
                            "standby image '{}': the apply of backup '{}' ({}) stopped before its journal was whole; the file was not touched and holds backup '{}' ({})",
                            row.name, next.name, next.id, held.name, held.id
                        ),
                    )
                    .await?;
                    tx.commit().await?;
                }
                Err(e) => {
                    let reason = format!(
                        "the apply of backup '{}' ({}) failed: {e}",
                        next.name, next.id
                    );
                    self.images
                        .set_follow(row.id, |f| f.error = Some(reason.clone()));
                    let mut tx = self.house().store.begin().await?;
                    tx.event(
                        None,
                        Some(row.id),
                        "standby_apply_failed",
                        &format!("standby image '{}': {reason}", row.name),
                    )
                    .await?;
                    tx.commit().await?;
                    if let Err(e) = self.recover_journal(row).await {
                        tracing::error!(image = %row.name, error = %e, "a standby's journal could not be replayed after its apply failed; the next check or start tries again");
                    }
                }
            }
            Ok::<_, crate::store::StoreError>(())
        }
        .await;
        Ended::of(
            out,
            |a| !a.cancelled,
            recorded,
            "a standby's apply",
            &row.name,
        )
    }

    /// A standby's image file, writable, and its apply's journal: made new
    /// (its directory synced, so that its name outlives a crash in the
    /// replay: a mix nobody can finish otherwise), or the one an apply left.
    fn apply_files(&self, r: &ImageRow, j: &Path, which: Journal) -> Result<(File, File)> {
        let file = self.house().open_image(r, Access::ReadWrite)?;
        let image = File::from(file.fd().try_clone().map_err(|e| {
            Error::Internal(format!("standby image '{}': dup of its file: {e}", r.name))
        })?);
        let dir = self.house().standby_journals();
        let mut open = std::fs::OpenOptions::new();
        open.read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32);
        let opened = match which {
            Journal::New => make_dir_durable(&dir)
                .and_then(|()| open.write(true).create_new(true).open(j))
                .and_then(|journal| {
                    File::open(&dir)?.sync_all()?;
                    Ok(journal)
                }),
            Journal::Left => open.open(j),
        };
        let journal = opened.map_err(|e| {
            Error::Internal(format!(
                "standby image '{}': opening its journal {}: {e}",
                r.name,
                j.display()
            ))
        })?;
        Ok((image, journal))
    }

    /// Settles a journal an apply left (a crash, or a failed apply): a
    /// whole one is replayed and the registry then holds its backup; a
    /// torn one is dropped (the file was never touched by it). Nothing
    /// when there is none. Its file goes only once the registry agrees.
    async fn recover_journal(&self, row: &ImageRow) -> Result<()> {
        let journal = self.journal_path(row.id);
        if !journal.exists() {
            return Ok(());
        }
        let held = self.held(row).await?;
        let (me, r, j) = (self.clone(), row.clone(), journal.clone());
        let replayed = blocking(move || -> Result<Option<Manifest>> {
            let (image, journal) = me.apply_files(&r, &j, Journal::Left)?;
            blockplane_backup::standby::recover(&journal, &image).map_err(|e| {
                Error::Internal(format!(
                    "standby image '{}': settling its journal {}: {e}",
                    r.name,
                    j.display()
                ))
            })
        })
        .await??;
        let found = match &replayed {
            Some(_) => Some(self.found(row).await),
            None => None,
        };
        let mut tx = self.house().store.begin().await?;
        match &replayed {
            Some(m) => {
                tx.set_standby_held(row.id, m).await?;
                if let Some(found) = found {
                    record_found(&mut tx, row, found).await?;
                }
                tx.event(
                    None,
                    Some(row.id),
                    "standby_apply_recovered",
                    &format!(
                        "standby image '{}': an apply ended before its file was whole; its journal was whole and is replayed: it holds backup '{}' ({}) taken at {}",
                        row.name, m.name, m.id, m.created_at
                    ),
                )
                .await?;
            }
            None => {
                tx.event(
                    None,
                    Some(row.id),
                    "standby_apply_dropped",
                    &format!(
                        "standby image '{}': an apply ended before its journal was whole, so it never touched the file; it holds backup '{}' ({}) as before",
                        row.name, held.name, held.id
                    ),
                )
                .await?;
            }
        }
        tx.commit().await?;
        let _ = std::fs::remove_file(&journal);
        Ok(())
    }

    /// At start, before the API serves: settles every standby's journal a
    /// crash left. A standby whose journal cannot be read is logged and
    /// keeps its journal; its checks and activation try again.
    pub(super) async fn recover_standbys(&self) -> Result<()> {
        for row in self.house().store.images().await? {
            if row.standby_of.is_none() || row.state != ImageState::Ready {
                continue;
            }
            if let Err(e) = self.recover_journal(&row).await {
                tracing::error!(image = %row.name, error = %e, "a standby's journal could not be settled");
                self.images
                    .set_follow(row.id, |f| f.error = Some(e.to_string()));
            }
        }
        Ok(())
    }

    /// `POST /v1/images/{id}/activate`: the standby becomes an ordinary
    /// image holding the backup it holds now. Refused while an apply runs
    /// unless `force`, which stops it (an apply stopped before its journal
    /// is whole leaves the file as it was; one that is replaying finishes
    /// first, and the newer backup is what is held).
    pub(crate) async fn activate_image(
        &self,
        id_or_name: &str,
        req: ActivateImageRequest,
    ) -> Result<ActivatedImage> {
        let row = self.house().image_row(id_or_name).await?;
        if row.standby_of.is_none() {
            return Err(Error::NotAStandby(row.name));
        }
        self.house().refuse_unready_copy(&row, "be activated")?;
        let _image = self.house().locks.images.lock(&row.id.to_string()).await;
        let row = self.house().image_row(&row.id.to_string()).await?;
        if row.standby_of.is_none() {
            return Err(Error::NotAStandby(row.name));
        }
        let stopped_apply = self.applying(row.id);
        if stopped_apply {
            if !req.force {
                let f = self.images.follow_of(row.id);
                return Err(Error::StandbyApplying {
                    name: row.name,
                    backup: f.applying.unwrap_or_default(),
                });
            }
            self.images.jobs.copies.stop(row.id).await;
            if self.applying(row.id) {
                return Err(Error::Internal(format!(
                    "standby image '{}': its apply did not stop within a minute; nothing changed",
                    row.name
                )));
            }
        }
        self.recover_journal(&row).await?;
        let held = self.held(&row).await?;
        let lag = (self.house().settings.clock.now() - held.created_at).as_seconds_f64();
        let mut tx = self.house().store.begin().await?;
        tx.end_standby(row.id).await?;
        tx.event(
            None,
            Some(row.id),
            "image_standby_activated",
            &format!(
                "image '{}' is activated: an ordinary image now, holding backup '{}' ({}) of image '{}' taken at {} ({:.0} s before this activation){}; volumes may use it",
                row.name,
                held.name,
                held.id,
                held.image.name,
                held.created_at,
                lag.max(0.0),
                if stopped_apply {
                    "; the apply that ran was stopped"
                } else {
                    ""
                }
            ),
        )
        .await?;
        tx.commit().await?;
        self.images.forget_follow(row.id);
        Ok(ActivatedImage {
            image: self.images.image(&row.id.to_string()).await?,
            backup_id: held.id,
            backup_name: held.name,
            backup_created_at: held.created_at,
            stopped_apply,
        })
    }
}

/// Starts the follower beside the API: no request waits on its listings.
pub(super) fn start_follower(backups: &Backups) {
    let me = backups.clone();
    tokio::spawn(async move { me.follow_standbys().await });
}

/// For `/metrics`: each standby's lag (seconds since the moment its
/// backup is of) and bytes behind, by image name.
pub(super) fn standby_samples(images: &[Image]) -> Vec<(String, f64, u64)> {
    images
        .iter()
        .filter_map(|i| {
            let s = i.standby.as_ref()?;
            Some((i.name.clone(), s.lag_seconds?, s.behind_bytes))
        })
        .collect()
}

/// Which journal [`Backups::apply_files`] opens.
#[derive(Debug, Clone, Copy)]
enum Journal {
    /// A new one, for an apply that starts.
    New,
    /// The one an apply left, to settle.
    Left,
}

/// Makes `dir` (and its parents) and syncs its parent, so that its name
/// outlives a crash: the journals in it must.
fn make_dir_durable(dir: &std::path::Path) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    if let Some(parent) = dir.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// Records what [`Backups::found`] read of a standby's file; a file that
/// could not be read keeps what the registry had, and says why in the log.
async fn record_found(
    tx: &mut crate::store::WriteTx,
    row: &ImageRow,
    found: Result<(Option<model::ImageEncryption>, u64)>,
) -> std::result::Result<(), crate::store::StoreError> {
    match found {
        Ok((encryption, allocated)) => {
            tx.set_image_encryption(row.id, encryption.as_ref()).await?;
            tx.set_image_state(row.id, ImageState::Ready, None, allocated)
                .await
        }
        Err(e) => {
            tracing::warn!(image = %row.name, error = %e, "a standby's header and allocation could not be read after an apply");
            Ok(())
        }
    }
}
