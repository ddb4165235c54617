//! Volume operations: create (idempotent by name), inspect, change live, delete.

use std::collections::HashMap;
use std::sync::Arc;

use time::OffsetDateTime;
use uuid::Uuid;

use super::Created;
use super::blocking::blocking;
use super::error::{Error, Result};
use super::house::House;
use super::image_jobs::Images;
use super::names::validate_name;
use super::undo::{Step, Undo};
use super::volume_part::Volumes;
use crate::backend::{
    AttachRequest, Attachment, BackendError, Change, Decision, SpecCheck, VolumeBackend,
    VolumeParams,
};
use crate::fault::{After, Slow};
use crate::store::{CryptLayer, ImageRow, VolumeRow};
use blockplane_api::model::{
    ActiveDispatch, Backend, BackendChoice, CopyMode, CreateVolumeRequest, DispatchPolicy,
    HISTORY_SECS, Key, MAX_IO_BYTES_CHOICES, MAX_QOS, PatchVolumeRequest, Qos, StatsHistory,
    StatsHistoryQuery, Volume, VolumeState, VolumeStats, VolumeUsage,
};
use blockplane_system::image::{Access, ImageFile};
use blockplane_system::{crypt, dispatch};

pub use crate::config::MAX_QUEUES;
/// Largest queue depth a volume may ask for (the ublk driver's limit).
pub const MAX_QUEUE_DEPTH: u16 = 4096;

fn check_spec(req: &CreateVolumeRequest) -> Result<()> {
    if let Some(q) = req.queues
        && !(1..=MAX_QUEUES).contains(&q)
    {
        return Err(Error::InvalidField {
            field: "queues",
            reason: format!("{q} is outside 1..={MAX_QUEUES} (volume '{}')", req.name),
        });
    }
    if !(1..=MAX_QUEUE_DEPTH).contains(&req.queue_depth) {
        return Err(Error::InvalidField {
            field: "queue_depth",
            reason: format!(
                "{} is outside 1..={MAX_QUEUE_DEPTH} (volume '{}')",
                req.queue_depth, req.name
            ),
        });
    }
    let m = req.max_io_bytes;
    if !MAX_IO_BYTES_CHOICES.contains(&m) {
        return Err(Error::InvalidField {
            field: "max_io_bytes",
            reason: format!(
                "{m} is not a power of two from 4096 to 1048576 (volume '{}')",
                req.name
            ),
        });
    }
    check_qos(&req.name, req.qos.as_ref())
}

fn check_qos(volume: &str, qos: Option<&Qos>) -> Result<()> {
    let Some(q) = qos else { return Ok(()) };
    for (field, v) in [
        ("qos.iops", q.iops),
        ("qos.bytes_per_sec", q.bytes_per_sec),
        ("qos.burst_iops", q.burst_iops),
        ("qos.burst_bytes", q.burst_bytes),
    ] {
        if v == Some(0) {
            return Err(Error::InvalidField {
                field,
                reason: format!("0 would stop all I/O of volume '{volume}'; use null for no limit"),
            });
        }
        if let Some(v) = v.filter(|v| *v > MAX_QOS) {
            return Err(Error::InvalidField {
                field,
                reason: format!(
                    "{v} is above the largest limit, {MAX_QOS} (volume '{volume}'); use null for no limit"
                ),
            });
        }
    }
    Ok(())
}

/// Why a volume created read-only cannot be made writable: the rule, which
/// only this module applies (the backends and the worker guard against a
/// request that breaks it, as a bug).
const CREATED_READ_ONLY: &str = "the volume was created read-only and holds its image read-only; delete it and create it again with \"read_only\": false";

/// QoS that sets no limit is no QoS: every backend takes it (`null` is
/// what a refusal of a limit says to give for none).
fn limits_of(qos: Option<Qos>) -> Option<Qos> {
    qos.filter(|q| *q != Qos::default())
}

/// Names the fields in which two create requests differ.
fn differences(a: &CreateVolumeRequest, b: &CreateVolumeRequest) -> String {
    let (a, b) = (
        serde_json::to_value(a).unwrap_or_default(),
        serde_json::to_value(b).unwrap_or_default(),
    );
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return String::new();
    };
    a.iter()
        .filter(|(k, v)| b.get(*k) != Some(v))
        .map(|(k, v)| {
            format!(
                "{k}: existing {v}, asked {}",
                b.get(k).cloned().unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The row of volume `id` of `image`, as asked by `req` (its recorded
/// `spec`), before its device is brought up.
fn attaching_row(
    id: Uuid,
    req: &CreateVolumeRequest,
    image: &ImageRow,
    spec: CreateVolumeRequest,
    backend: Backend,
    crypt: Option<CryptLayer>,
) -> VolumeRow {
    let now = OffsetDateTime::now_utc();
    VolumeRow {
        id,
        name: req.name.clone(),
        image_id: image.id,
        spec,
        backend,
        dispatch: req.dispatch,
        read_only: req.read_only,
        qos: req.qos,
        state: VolumeState::Attaching,
        state_reason: None,
        attachment: None,
        crypt,
        created_at: now,
        updated_at: now,
    }
}

/// The changes a PATCH asks for (only what differs from the volume's
/// settings), refused as a whole when one breaks a rule of the manager's.
fn changes(v: &VolumeRow, patch: &PatchVolumeRequest) -> Result<Vec<Change>> {
    let mut changes = Vec::new();
    if let Some(d) = patch.dispatch.filter(|d| *d != v.dispatch) {
        changes.push(Change::Dispatch(d));
    }
    if let Some(q) = patch.qos.map(limits_of).filter(|q| *q != v.qos) {
        check_qos(&v.name, q.as_ref())?;
        changes.push(Change::Qos(q));
    }
    if let Some(ro) = patch.read_only.filter(|ro| *ro != v.read_only) {
        if !ro && v.spec.read_only {
            return Err(volume_error(
                &v.name,
                BackendError::NotLive {
                    backend: v.backend.as_str(),
                    field: "read_only",
                    reason: CREATED_READ_ONLY.into(),
                },
            ));
        }
        changes.push(Change::ReadOnly(ro));
    }
    Ok(changes)
}

/// The change that takes `change` of `v` back.
fn undo(v: &VolumeRow, change: Change) -> Change {
    match change {
        Change::Dispatch(_) => Change::Dispatch(v.dispatch),
        Change::Qos(_) => Change::Qos(v.qos),
        Change::ReadOnly(ro) => Change::ReadOnly(!ro),
    }
}

/// A PATCH's live change stays on the device when the PATCH ends without
/// taking it back or recording it (a test fault after the changes, a
/// request cancelled mid-way, a panic), as it always did: the next
/// reconciliation puts the row's settings back on the device.
impl Step for Change {
    fn on_drop(self, what: &'static str) {
        tracing::debug!(step = what, "a live change left made, not undone");
    }
}

/// A volume's spec as backends take it.
pub(super) fn params(v: &VolumeRow, image: &ImageRow, size_bytes: u64) -> VolumeParams {
    VolumeParams {
        image_path: image.path.clone(),
        size_bytes,
        read_only: v.spec.read_only,
        refuse_writes: v.read_only,
        dispatch: v.dispatch,
        queues: v.spec.queue_count(),
        queue_depth: v.spec.queue_depth,
        max_io_bytes: v.spec.max_io_bytes,
        qos: v.qos,
        allocation: image.allocation.unwrap_or_default(),
    }
}

/// Names the volume in a backend's error.
pub(super) fn volume_error(name: &str, source: BackendError) -> Error {
    Error::Volume {
        name: name.to_string(),
        source,
    }
}

/// The backend and decision for a spec: dm when `backend: auto` tried it
/// (`dm`) and it maps the image `direct`, or serves it on `kernel` where
/// `preferred` cannot map it `direct` either; else `preferred`'s own
/// decision (with why dm did not, when it was tried).
fn choose_path(
    preferred: Arc<dyn VolumeBackend>,
    dm: Option<Arc<dyn VolumeBackend>>,
    check: &SpecCheck,
    file: &ImageFile,
) -> (
    Arc<dyn VolumeBackend>,
    std::result::Result<Option<Decision>, BackendError>,
) {
    let mut why_not_dm = None;
    let mut kernel = None;
    if let Some(dm) = dm {
        match dm.validate(check, file.fd(), file.size()) {
            // Off direct under auto: kernel, unless `preferred` maps the
            // image direct after all (ublk has no rule 7).
            Ok(Some(d))
                if d.dispatch == DispatchPolicy::Kernel
                    && check.dispatch == DispatchPolicy::Auto =>
            {
                why_not_dm = d.reason.rule_off_direct().map(str::to_string);
                kernel = Some((dm, d));
            }
            Ok(Some(d)) => match dispatch::auto_on_dm(d) {
                Ok(d) => return (dm, Ok(Some(d))),
                Err(why) => why_not_dm = Some(why),
            },
            Ok(None) => why_not_dm = Some("it decided no policy".into()),
            Err(e) => why_not_dm = Some(e.to_string()),
        }
    }
    let d = preferred.validate(check, file.fd(), file.size());
    if let Some((dm, k)) = kernel
        && !matches!(&d, Ok(Some(p)) if p.dispatch == DispatchPolicy::Direct)
    {
        let k = dispatch::auto_on_dm(k).expect("dm's kernel decision is dm's to take");
        return (dm, Ok(Some(k)));
    }
    let d = match (d, why_not_dm) {
        (Ok(Some(d)), Some(why)) => Ok(Some(dispatch::auto_off_dm(d, preferred.kind(), &why))),
        (d, _) => d,
    };
    (preferred, d)
}

/// A volume's steps that need the house alone: its backend and path
/// chosen, its device brought up, changed and taken down, and the
/// records of each.
impl House {
    fn choose_backend(&self, choice: BackendChoice) -> Result<Arc<dyn VolumeBackend>> {
        let kind = match choice {
            BackendChoice::Loop => Backend::Loop,
            BackendChoice::Ublk => Backend::Ublk,
            BackendChoice::Dm => Backend::Dm,
            BackendChoice::Auto => Backend::PREFERENCE
                .into_iter()
                .find(|k| self.capability(*k).available)
                .ok_or_else(|| BackendError::Unavailable {
                    backend: "auto",
                    reason: "no backend works on this host (loop, ublk and dm are all missing)"
                        .into(),
                })?,
        };
        let cap = self.capability(kind);
        match (self.backend(kind), cap.available) {
            (Some(b), true) => Ok(b),
            _ => Err(BackendError::Unavailable {
                backend: kind.as_str(),
                reason: cap.reason.unwrap_or_default(),
            }
            .into()),
        }
    }

    /// dm, when `backend: auto` should try it before `preferred` (the first
    /// available backend): dm is here, is not `preferred`, and the spec is
    /// one `auto` serves on dm `direct` (see [`dispatch::auto_tries_dm`]).
    fn auto_tries_dm(
        &self,
        req: &CreateVolumeRequest,
        preferred: &Arc<dyn VolumeBackend>,
    ) -> Option<Arc<dyn VolumeBackend>> {
        let tries = req.backend == BackendChoice::Auto
            && preferred.kind() != Backend::Dm
            && dispatch::auto_tries_dm(req.dispatch, req.qos.is_some())
            && self.capability(Backend::Dm).available;
        tries.then(|| self.backend(Backend::Dm)).flatten()
    }

    /// The backend and dispatch decision for `req` on the open image: dm
    /// first when `backend: auto` tries it, else `backend`'s own.
    async fn decide_path(
        &self,
        req: &CreateVolumeRequest,
        backend: Arc<dyn VolumeBackend>,
        queues: u16,
        file: ImageFile,
    ) -> Result<(ImageFile, Arc<dyn VolumeBackend>, Option<Decision>)> {
        let check = SpecCheck {
            dispatch: req.dispatch,
            queues,
            queue_depth: req.queue_depth,
            max_io_bytes: req.max_io_bytes,
            qos: req.qos,
            read_only: req.read_only,
        };
        let dm = self.auto_tries_dm(req, &backend);
        let (file, backend, decision) = blocking(move || {
            let (backend, d) = choose_path(backend, dm, &check, &file);
            (file, backend, d)
        })
        .await?;
        let decision = decision.map_err(|e| volume_error(&req.name, self.offer_ublk(e)))?;
        Ok((file, backend, decision))
    }

    /// Inserts the new volume's row (`attaching`) and its event. Checked
    /// where the insert commits: writers are serialized there, so parallel
    /// creates cannot all see room, and an image deleted since it was read
    /// is refused as gone (`asked` as the request named it) rather than
    /// failing the foreign key.
    async fn record_new_volume(
        &self,
        row: &VolumeRow,
        image: &ImageRow,
        asked: &str,
    ) -> Result<()> {
        let mut tx = self.store.begin().await?;
        if tx.volume_count().await? >= self.settings.max_volumes {
            return Err(Error::VolumeLimit {
                name: row.name.clone(),
                max: self.settings.max_volumes,
            });
        }
        if tx.image(&image.id.to_string()).await?.is_none() {
            return Err(Error::ImageNotFound(asked.to_string()));
        }
        tx.insert_volume(row).await?;
        tx.event(
            Some(row.id),
            Some(image.id),
            "volume_created",
            &format!(
                "volume '{}' recorded: backend {}, image '{}'",
                row.name,
                row.backend.as_str(),
                image.name
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Attaches the recorded volume's device (and opens its plaintext
    /// device with `key`, when encrypted) and records it attached. On any
    /// failure the device goes and the row with it, its reason recorded.
    async fn bring_up(
        &self,
        mut row: VolumeRow,
        image: &ImageRow,
        file: ImageFile,
        image_lock: std::os::fd::OwnedFd,
        decision: Option<Decision>,
        key: Option<&Key>,
    ) -> Result<VolumeRow> {
        let attached = match self.attach(&row, image, file, &image_lock, decision).await {
            Ok(att) => match (&row.crypt, key) {
                (Some(layer), Some(key)) => {
                    match self.open_crypt(layer, &image.name, &att, key).await {
                        Ok(()) => Ok(att),
                        Err(e) => {
                            let _ = self.detach(&row).await;
                            Err(e)
                        }
                    }
                }
                _ => Ok(att),
            },
            Err(e) => Err(e),
        };
        let att = match attached {
            Ok(att) => att,
            Err(e) => {
                self.forget_failed(&row, &e).await?;
                return Err(e);
            }
        };
        let recorded = match self.settings.faults.point(After::Attach) {
            Ok(()) => self.record_attached(&mut row, att, "volume_attached").await,
            Err(e) => Err(e.into()),
        };
        if let Err(e) = recorded {
            // Half-way: remove the device and the row, keep the reason.
            let _ = self.detach(&row).await;
            self.forget_failed(&row, &e).await?;
            return Err(e);
        }
        self.holds.keep(row.id, image_lock);
        tracing::info!(volume = %row.name, device = ?row.attachment.as_ref().map(|a| &a.device), "volume attached");
        Ok(row)
    }

    /// Deletes the row of a create that failed, recording why.
    async fn forget_failed(&self, row: &VolumeRow, e: &Error) -> Result<()> {
        self.finishing(move || async move {
            let mut tx = self.store.begin().await?;
            tx.delete_volume(row.id).await?;
            tx.event(
                Some(row.id),
                Some(row.image_id),
                "volume_create_failed",
                &format!("volume '{}' not created: {e}", row.name),
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// Brings up the device of a recorded volume on an opened image, whose
    /// lock (taken with `open_and_lock`) the caller keeps.
    pub(super) async fn attach(
        &self,
        v: &VolumeRow,
        image: &ImageRow,
        file: ImageFile,
        lock: &std::os::fd::OwnedFd,
        decision: Option<Decision>,
    ) -> Result<Attachment> {
        let backend = self.backend(v.backend).ok_or_else(|| {
            volume_error(
                &v.name,
                BackendError::Unavailable {
                    backend: v.backend.as_str(),
                    reason: super::house::not_built_reason(v.backend),
                },
            )
        })?;
        let req = AttachRequest {
            volume_id: v.id,
            params: params(v, image, file.size()),
            image_fd: file.into_fd(),
            decision,
            image_lock: Some(
                lock.try_clone()
                    .map_err(|e| volume_error(&v.name, BackendError::io("dup", "image lock", e)))?,
            ),
        };
        let name = v.name.clone();
        blocking(move || backend.attach(req))
            .await?
            .map_err(|e| volume_error(&name, e))
    }

    /// Removes a volume's device, if any: its plaintext device first, on an
    /// encrypted image.
    pub(super) async fn detach(&self, v: &VolumeRow) -> Result<()> {
        self.close_crypt(v).await?;
        let Some(backend) = self.backend(v.backend) else {
            return Ok(());
        };
        let (id, att, name) = (v.id, v.attachment.clone(), v.name.clone());
        blocking(move || backend.detach(id, att.as_ref()))
            .await?
            .map_err(|e| volume_error(&name, e))
    }

    /// Records a device as the volume's, state attached.
    pub(super) async fn record_attached(
        &self,
        v: &mut VolumeRow,
        att: Attachment,
        kind: &str,
    ) -> Result<()> {
        let locked = v.crypt.as_ref().filter(|l| !crypt::is_open(&l.name));
        let device = match (&v.crypt, locked) {
            (Some(l), None) => format!(
                "{} (dm-crypt over {})",
                super::encryption::plaintext_device(l),
                att.device
            ),
            (Some(l), Some(_)) => format!(
                "{}, locked: its plaintext device {} is not open",
                att.device,
                super::encryption::plaintext_device(l)
            ),
            (None, _) => att.device.clone(),
        };
        let msg = format!(
            "volume '{}' attached as {device} ({} bytes, dispatch {}: {})",
            v.name,
            v.device_bytes(att.size_bytes),
            att.dispatch.as_str(),
            att.dispatch_reason
        );
        // A new device may hold pages already (a probe of it, an earlier
        // user of the image): start clean.
        super::look::drop_page_cache(&self.store, v, &att).await;
        v.state_reason = locked.map(|l| {
            format!(
                "its plaintext device {} is not open (the host restarted, or it was closed): unlock it with its image's key (POST /v1/volumes/{}/unlock)",
                super::encryption::plaintext_device(l),
                v.name
            )
        });
        v.state = match locked {
            Some(_) => VolumeState::Locked,
            None => VolumeState::Attached,
        };
        v.attachment = Some(att);
        v.updated_at = OffsetDateTime::now_utc();
        let (v, msg) = (&*v, &msg);
        self.finishing(move || async move {
            let mut tx = self.store.begin().await?;
            tx.update_volume(v).await?;
            tx.event(Some(v.id), Some(v.image_id), kind, msg).await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// Records a volume as having no working device, with the reason.
    pub(super) async fn record_error(&self, v: &mut VolumeRow, reason: String) -> Result<()> {
        tracing::warn!(volume = %v.name, %reason, "volume in error");
        v.attachment = None;
        v.state = VolumeState::Error;
        v.state_reason = Some(reason.clone());
        v.updated_at = OffsetDateTime::now_utc();
        let mut tx = self.store.begin().await?;
        tx.update_volume(v).await?;
        tx.event(
            Some(v.id),
            Some(v.image_id),
            "volume_error",
            &format!("volume '{}': {reason}", v.name),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Deletes a volume's row once its device is gone, and lets its image go.
    pub(super) async fn forget_volume(&self, v: &VolumeRow) -> Result<()> {
        self.holds.release(v.id);
        self.finishing(move || async move {
            let mut tx = self.store.begin().await?;
            tx.delete_volume(v.id).await?;
            tx.event(
                Some(v.id),
                Some(v.image_id),
                "volume_deleted",
                &format!(
                    "volume '{}' deleted; device {} removed",
                    v.name,
                    v.attachment
                        .as_ref()
                        .map(|a| a.device.as_str())
                        .unwrap_or("(none)")
                ),
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await?;
        tracing::info!(volume = %v.name, "volume deleted");
        Ok(())
    }

    /// Makes one live change on the device.
    pub(super) async fn reconfigure(
        &self,
        backend: &Arc<dyn VolumeBackend>,
        v: &VolumeRow,
        att: &Attachment,
        change: Change,
    ) -> Result<Attachment> {
        // The plaintext device above refuses writes first, and takes them
        // again last.
        let plaintext = v.crypt.as_ref().map(|l| l.name.clone());
        let set_plaintext = |read_only: bool| {
            let name = plaintext.clone();
            async move {
                let Some(name) = name.filter(|n| crypt::is_open(n)) else {
                    return Ok(());
                };
                let device = crypt::device_of(&name).display().to_string();
                blocking(move || crypt::set_read_only(&name, read_only))
                    .await?
                    .map_err(|e| volume_error(&v.name, BackendError::io("BLKROSET", device, e)))
            }
        };
        if change == Change::ReadOnly(true) {
            set_plaintext(true).await?;
        }
        let (b, a, id) = (backend.clone(), att.clone(), v.id);
        let made = blocking(move || b.reconfigure(&a, change, id))
            .await?
            .map_err(|e| volume_error(&v.name, e));
        match (&made, change) {
            (Err(_), Change::ReadOnly(true)) => set_plaintext(false).await?,
            (Ok(_), Change::ReadOnly(false)) => set_plaintext(false).await?,
            _ => {}
        }
        made
    }

    /// Records changes made on the device, with an event each, in one commit.
    pub(super) async fn record_changes(
        &self,
        v: &mut VolumeRow,
        att: Attachment,
        made: &[Change],
    ) -> Result<()> {
        let mut events = Vec::new();
        for change in made {
            let (kind, msg) = match *change {
                Change::Dispatch(d) => {
                    let old = v.dispatch;
                    v.dispatch = d;
                    (
                        "dispatch_changed",
                        format!(
                            "dispatch {} -> {} (now {}: {})",
                            old.as_str(),
                            d.as_str(),
                            att.dispatch.as_str(),
                            att.dispatch_reason
                        ),
                    )
                }
                Change::Qos(q) => {
                    v.qos = q;
                    (
                        "qos_changed",
                        format!(
                            "qos set to {}",
                            serde_json::to_string(&q).unwrap_or_default()
                        ),
                    )
                }
                Change::ReadOnly(ro) => {
                    let old = v.read_only;
                    v.read_only = ro;
                    ("read_only_changed", format!("read_only {old} -> {ro}"))
                }
            };
            events.push((kind, format!("volume '{}': {msg}", v.name)));
        }
        // A limit set or removed may move a dm volume between direct and
        // nowait (auto): that move has its own event.
        let before = v.attachment.as_ref().map(|a| a.dispatch);
        let by_dispatch = made.iter().any(|c| matches!(c, Change::Dispatch(_)));
        let moved = before.filter(|d| *d != att.dispatch);
        if let Some(old) = moved.filter(|_| !by_dispatch) {
            events.push((
                "dispatch_moved",
                format!(
                    "volume '{}': {} -> {} for its QoS change ({})",
                    v.name,
                    old.as_str(),
                    att.dispatch.as_str(),
                    att.dispatch_reason
                ),
            ));
        }
        // Every switch of the data path starts it clean, whatever the backend.
        if by_dispatch || moved.is_some() {
            super::look::drop_page_cache(&self.store, v, &att).await;
        }
        v.attachment = Some(att);
        v.updated_at = OffsetDateTime::now_utc();
        let (v, events) = (&*v, &events);
        self.finishing(move || async move {
            let mut tx = self.store.begin().await?;
            tx.update_volume(v).await?;
            for (kind, msg) in events {
                tx.event(Some(v.id), Some(v.image_id), kind, msg).await?;
            }
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// A loop volume's refusal of what backend ublk does, offering ublk
    /// only where this host has it: a remedy given must work here.
    fn offer_ublk(&self, e: BackendError) -> BackendError {
        let offer = |reason: String, way: &str| {
            let ublk = self.capability(Backend::Ublk);
            if ublk.available {
                format!("{reason}; {way}")
            } else {
                format!(
                    "{reason}; backend ublk would, but it is not available on this host: {}",
                    ublk.reason.unwrap_or_default()
                )
            }
        };
        match e {
            BackendError::Unsupported {
                backend: "loop",
                what,
                reason,
            } => BackendError::Unsupported {
                backend: "loop",
                what,
                reason: offer(reason, "backend ublk does (\"backend\": \"ublk\")"),
            },
            BackendError::NotLive {
                backend: "loop",
                field: field @ ("qos" | "dispatch"),
                reason,
            } => BackendError::NotLive {
                backend: "loop",
                field,
                reason: offer(
                    reason,
                    "a volume created again with \"backend\": \"ublk\" can",
                ),
            },
            e => e,
        }
    }

    pub(super) fn not_live(&self, v: &VolumeRow) -> Error {
        Error::VolumeState {
            name: v.name.clone(),
            state: v.state.as_str(),
            reason: v
                .state_reason
                .clone()
                .unwrap_or_else(|| "it has no device to change".into()),
        }
    }
}

impl Images {
    /// The image, read again under its lock, if a new volume may have it:
    /// no other volume, no allocate running, and its rules for `req`.
    async fn claim_image(&self, image: &ImageRow, req: &CreateVolumeRequest) -> Result<ImageRow> {
        self.house.reserve.take();
        let users = self.house.store.volumes_of_image(image.id).await?;
        if !users.is_empty() {
            return Err(Error::image_in_use(image.name.clone(), &users));
        }
        self.jobs.allocations.refuse(image, "get a volume")?;
        let image = self.house.image_row(&image.id.to_string()).await?;
        self.check_volume_image(&image, &req.name, req.read_only)?;
        Ok(image)
    }
}

impl Volumes {
    fn view(&self, v: &VolumeRow, image_size: u64) -> Volume {
        let att = v.attachment.as_ref();
        let (worker_version, worker_older) = self.house().worker_build(v);
        let unsupervised = self.house().worker_of(v).map(|w| w.unsupervised);
        // A worker no one would recover if it died: the volume says so.
        let (state, state_reason) = match unsupervised.as_ref().and_then(Option::as_ref) {
            _ if self.recovering.contains(v.id) => (
                VolumeState::Recovering,
                Some("the service started and is matching it with the kernel: a device that a worker served waits for a new one".into()),
            ),
            Some(why) if matches!(v.state, VolumeState::Attached | VolumeState::Degraded) => (
                VolumeState::Degraded,
                Some(match &v.state_reason {
                    Some(r) => format!("its worker is not supervised: {why}; {r}"),
                    None => format!("its worker is not supervised: {why}"),
                }),
            ),
            _ => (v.state, v.state_reason.clone()),
        };
        let idle_dispatch = match v.backend {
            Backend::Loop => ActiveDispatch::Kernel,
            _ => dispatch::active_of(v.dispatch).unwrap_or(ActiveDispatch::Nowait),
        };
        Volume {
            id: v.id,
            name: v.name.clone(),
            image_id: v.image_id,
            backend: v.backend,
            dispatch: att.map(|a| a.dispatch).unwrap_or(idle_dispatch),
            requested_dispatch: v.dispatch,
            dispatch_reason: att
                .map_or_else(|| "no device".into(), |a| a.dispatch_reason.to_string()),
            state,
            state_reason,
            device: match (&v.crypt, att) {
                (_, None) => None,
                (Some(_), Some(_)) if v.state == VolumeState::Locked => None,
                (Some(layer), Some(_)) => Some(super::encryption::plaintext_device(layer)),
                (None, Some(a)) => Some(a.device.clone()),
            },
            encrypted: v.crypt.is_some(),
            backing_device: att.filter(|_| v.crypt.is_some()).map(|a| a.device.clone()),
            size_bytes: v.device_bytes(att.map(|a| a.size_bytes).unwrap_or(image_size)),
            read_only: v.read_only,
            // The device's count where known: the kernel caps it at its CPUs.
            queues: att
                .and_then(|a| a.ublk()?.queues)
                .unwrap_or(v.spec.queue_count()),
            queue_depth: v.spec.queue_depth,
            max_io_bytes: v.spec.max_io_bytes,
            qos: v.qos,
            direct_io: att.and_then(|a| a.direct_io()),
            buffer_bytes: att.and_then(|a| a.ublk().map(|u| u.buffer_bytes)),
            copy_mode: att.and_then(|a| {
                a.ublk().map(|u| match u.zero_copy {
                    true => CopyMode::ZeroCopy,
                    false => CopyMode::Copy,
                })
            }),
            worker_pid: att.and_then(|a| a.ublk().map(|u| u.pid)),
            worker_version,
            worker_older,
            worker_supervised: unsupervised.map(|u| u.is_none()),
            resize_pending: att.is_some_and(|a| a.resize_pending),
            warnings: self.readings.page_cache.warnings(v.id),
            created_at: v.created_at,
            updated_at: v.updated_at,
        }
    }

    pub(super) async fn volume_view(&self, v: &VolumeRow) -> Result<Volume> {
        let size = self
            .house()
            .store
            .image(&v.image_id.to_string())
            .await?
            .map(|i| i.size_bytes)
            .unwrap_or(0);
        Ok(self.view(v, size))
    }

    /// `GET /v1/volumes`.
    async fn list(&self) -> Result<Vec<Volume>> {
        let sizes: HashMap<Uuid, u64> = self
            .house()
            .store
            .images()
            .await?
            .into_iter()
            .map(|i| (i.id, i.size_bytes))
            .collect();
        Ok(self
            .house()
            .store
            .volumes()
            .await?
            .iter()
            .map(|v| self.view(v, sizes.get(&v.image_id).copied().unwrap_or(0)))
            .collect())
    }

    /// `GET /v1/volumes` as JSON, cached until the next commit or change of
    /// a volume's warnings: the list is what dashboards and orchestrators
    /// poll.
    pub(crate) async fn volumes_json(&self) -> Result<bytes::Bytes> {
        let generation = (
            self.house().store.generation(),
            self.readings.page_cache.warnings_generation(),
            self.recovering.generation(),
        );
        if let Some((g, json)) = self.api.volumes.lock().expect("cache poisoned").as_ref()
            && *g == generation
        {
            return Ok(json.clone());
        }
        let json =
            bytes::Bytes::from(serde_json::to_vec(&self.list().await?).expect("volumes serialize"));
        // Stamped with the generations read before the query: a commit (or
        // a warning) since makes the next reader rebuild it.
        *self.api.volumes.lock().expect("cache poisoned") = Some((generation, json.clone()));
        Ok(json)
    }

    /// `GET /v1/volumes/{id}`.
    pub(crate) async fn volume(&self, id_or_name: &str) -> Result<Volume> {
        let v = self.house().volume_row(id_or_name).await?;
        self.volume_view(&v).await
    }

    /// `POST /v1/volumes`: the same name and spec again returns the existing
    /// volume. Steps: the spec checked, the name found or free, the image
    /// claimed and opened, the path decided, the row recorded, the device
    /// brought up.
    pub(crate) async fn create_volume(
        &self,
        mut req: CreateVolumeRequest,
    ) -> Result<Created<Volume>> {
        // The key opens the image now; it is no part of the recorded spec.
        let key = req.key.take();
        validate_name("volume", &req.name)?;
        check_spec(&req)?;
        let req = CreateVolumeRequest {
            qos: limits_of(req.qos),
            ..req
        };
        let _volume = self.house().locks.volumes.lock(&req.name).await;
        let image = self.house().image_row(&req.image).await?;
        let mut spec = CreateVolumeRequest {
            image: image.id.to_string(),
            ..req.clone()
        };
        if let Some(existing) = self.existing_volume(&req.name, &mut spec).await? {
            return Ok(Created::Existing(existing));
        }
        let _image = self.house().locks.images.lock(&image.id.to_string()).await;
        let image = self.images.claim_image(&image, &req).await?;
        let backend = self.house().choose_backend(req.backend)?;
        let (file, image_lock) = {
            let (me, image, access) = (
                self.clone(),
                image.clone(),
                Access::read_only_if(req.read_only),
            );
            blocking(move || me.house().open_and_lock(&image, access)).await??
        };
        let id = Uuid::new_v4();
        let fd = file
            .fd()
            .try_clone()
            .map_err(|e| Error::Internal(format!("volume '{}': dup: {e}", req.name)))?;
        let crypt = self
            .house()
            .crypt_layer_for(&image, fd, key.as_ref(), id)
            .await?;
        // Loop has one queue; the others get one per CPU unless asked.
        let queues = req.queues.unwrap_or(match backend.kind() {
            Backend::Loop => 1,
            Backend::Ublk | Backend::Dm => self.house().settings.default_queues,
        });
        spec.queues = Some(queues);
        let (file, backend, decision) = self
            .house()
            .decide_path(&req, backend, queues, file)
            .await?;
        let row = attaching_row(id, &req, &image, spec, backend.kind(), crypt);
        self.house()
            .record_new_volume(&row, &image, &req.image)
            .await?;
        self.house().settings.faults.point(After::Insert)?;
        self.house().settings.faults.pause(Slow::VolumeChange).await;
        let row = self
            .house()
            .bring_up(row, &image, file, image_lock, decision, key.as_ref())
            .await?;
        Ok(Created::New(self.volume_view(&row).await?))
    }

    /// The volume already named so, when `spec` is its spec (its queue
    /// count filled in from it when `spec` asks none); refused when the
    /// name has another spec.
    async fn existing_volume(
        &self,
        name: &str,
        spec: &mut CreateVolumeRequest,
    ) -> Result<Option<Volume>> {
        let Some(existing) = self.house().store.volume(name).await? else {
            // A cheap early refusal; the count that holds under concurrency
            // is the one inside the transaction that inserts.
            if self.house().store.volume_count().await? >= self.house().settings.max_volumes {
                return Err(Error::VolumeLimit {
                    name: name.to_string(),
                    max: self.house().settings.max_volumes,
                });
            }
            return Ok(None);
        };
        // No queue count asked: whatever the volume got is the same spec.
        spec.queues = spec.queues.or(existing.spec.queues);
        if existing.spec == *spec {
            return Ok(Some(self.volume_view(&existing).await?));
        }
        Err(Error::VolumeExists {
            name: name.to_string(),
            differences: differences(&existing.spec, spec),
        })
    }

    /// `DELETE /v1/volumes/{id}`: returns once the device is gone.
    pub(crate) async fn delete_volume(&self, id_or_name: &str) -> Result<()> {
        let v = self.house().volume_row(id_or_name).await?;
        let _volume = self.house().locks.volumes.lock(&v.name).await;
        let mut v = self.house().volume_row(&v.id.to_string()).await?;
        if let Some(export) = self.house().store.export(v.id).await? {
            return Err(super::fabric_error::ExportError::Exported {
                volume: v.name.clone(),
                nqn: export.nqn,
            }
            .into());
        }
        self.house().reserve.take();
        if let Some(layer) = v.crypt.as_ref().filter(|l| crypt::is_open(&l.name)) {
            // dm-crypt holds the backend's device; the plaintext is what
            // users mount or open.
            let device = crypt::device_of(&layer.name).display().to_string();
            let name = v.name.clone();
            blocking(move || crate::backend::refuse_if_claimed(device))
                .await?
                .map_err(|e| volume_error(&name, e))?;
        } else if let Some(backend) = self.house().backend(v.backend) {
            let (id, name) = (v.id, v.name.clone());
            blocking(move || backend.check_detach(id))
                .await?
                .map_err(|e| volume_error(&name, e))?;
        }
        let before = (v.state, v.state_reason.clone());
        v.state = VolumeState::Detaching;
        v.updated_at = OffsetDateTime::now_utc();
        let mut tx = self.house().store.begin().await?;
        tx.update_volume(&v).await?;
        tx.event(
            Some(v.id),
            Some(v.image_id),
            "volume_detaching",
            &format!("volume '{}' is being deleted", v.name),
        )
        .await?;
        tx.commit().await?;
        self.house().settings.faults.pause(Slow::VolumeChange).await;
        if let Err(e) = self.house().detach(&v).await {
            (v.state, v.state_reason) = before;
            v.updated_at = OffsetDateTime::now_utc();
            let (v, why) = (&v, &e);
            self.house()
                .finishing(move || async move {
                    let mut tx = self.house().store.begin().await?;
                    tx.update_volume(v).await?;
                    tx.event(
                        Some(v.id),
                        Some(v.image_id),
                        "volume_delete_failed",
                        &format!("{why}"),
                    )
                    .await?;
                    tx.commit().await?;
                    Ok(())
                })
                .await?;
            return Err(e);
        }
        self.house().settings.faults.point(After::Detach)?;
        self.house().forget_volume(&v).await
    }

    /// `PATCH /v1/volumes/{id}`: every change is checked (the manager's rules,
    /// then the backend's) before any is made; if making one fails, those made
    /// before it are undone, and what could not be undone is recorded.
    pub(crate) async fn patch_volume(
        &self,
        id_or_name: &str,
        patch: PatchVolumeRequest,
    ) -> Result<Volume> {
        let v = self.house().volume_row(id_or_name).await?;
        let _volume = self.house().locks.volumes.lock(&v.name).await;
        let mut v = self.house().volume_row(&v.id.to_string()).await?;
        let changes = changes(&v, &patch)?;
        if changes.is_empty() {
            return self.volume_view(&v).await;
        }
        if changes.iter().any(|c| matches!(c, Change::ReadOnly(true))) {
            let export = self.house().store.export(v.id).await?;
            super::exports::refuse_read_only(&v.name, export.as_ref())?;
        }
        // A backup reading the image decided so under this volume's lock.
        if changes.iter().any(|c| matches!(c, Change::ReadOnly(false))) {
            let image = self.house().image_row(&v.image_id.to_string()).await?;
            self.images
                .jobs
                .backups
                .refuse(&image, &format!("make volume '{}' writable", v.name))?;
        }
        let (Some(att), Some(backend)) = (v.attachment.clone(), self.house().backend(v.backend))
        else {
            return Err(self.house().not_live(&v));
        };
        if !matches!(v.state, VolumeState::Attached | VolumeState::Degraded) {
            return Err(self.house().not_live(&v));
        }
        for change in &changes {
            backend
                .check_change(&att, *change)
                .map_err(|e| volume_error(&v.name, self.house().offer_ublk(e)))?;
        }
        let mut att = att;
        let mut made = Undo::<Change>::default();
        for change in &changes {
            let outcome = match self.house().reconfigure(&backend, &v, &att, *change).await {
                Ok(a) => {
                    att = a;
                    made.push_step(change.field(), *change);
                    // Between two changes of one PATCH (a test fault).
                    if made.len() == 1 && changes.len() > 1 {
                        self.house()
                            .settings
                            .faults
                            .point(After::FirstChange)
                            .map_err(Error::from)
                    } else {
                        Ok(())
                    }
                }
                Err(e) => Err(e),
            };
            if let Err(e) = outcome {
                let (house, backend, row) = (self.house(), &backend, &v);
                let (att, stays) = made
                    .unwind(att, |att, c| async move {
                        match house.reconfigure(backend, row, &att, undo(row, c)).await {
                            Ok(after) => Ok(after),
                            Err(e) => {
                                tracing::warn!(volume = %row.name, error = %e, "could not undo a live change");
                                Err((att, e))
                            }
                        }
                    })
                    .await;
                if !stays.is_empty() {
                    self.house().record_changes(&mut v, att, &stays).await?;
                }
                return Err(e);
            }
        }
        self.house().settings.faults.point(After::Change)?;
        let made = made.commit();
        self.house().record_changes(&mut v, att, &made).await?;
        self.volume_view(&v).await
    }

    /// `GET /v1/volumes/{id}/stats`.
    pub(crate) async fn volume_stats(&self, id_or_name: &str) -> Result<VolumeStats> {
        let v = self.house().volume_row(id_or_name).await?;
        let (Some(att), Some(backend)) = (v.attachment.clone(), self.house().backend(v.backend))
        else {
            return Err(self.house().not_live(&v));
        };
        let (id, name) = (v.id, v.name.clone());
        let mut stats = blocking(move || backend.stats(id, &att))
            .await?
            .map_err(|e| volume_error(&name, e))?;
        stats.rates = self.readings.stats.rates(v.id, &stats);
        stats.page_cache = super::look::page_cache(&self.house().store, &v).await?;
        Ok(stats)
    }

    /// `GET /v1/volumes/{id}/stats/history`.
    pub(crate) async fn volume_history(
        &self,
        id_or_name: &str,
        q: StatsHistoryQuery,
    ) -> Result<StatsHistory> {
        let seconds = q.seconds.unwrap_or(300);
        if !(1..=HISTORY_SECS).contains(&seconds) {
            return Err(Error::InvalidField {
                field: "seconds",
                reason: format!(
                    "{seconds} is outside 1..={HISTORY_SECS} (the service keeps {HISTORY_SECS} s)"
                ),
            });
        }
        let v = self.house().volume_row(id_or_name).await?;
        Ok(StatsHistory {
            volume_id: v.id,
            points: self.readings.stats.history(v.id, seconds),
            name: v.name,
            kept_secs: HISTORY_SECS,
        })
    }

    /// `GET /v1/volumes/{id}/usage`: who has the device open, its mounts,
    /// and its I/O of the last [`crate::usage::RECENT_SECS`] seconds.
    pub(crate) async fn volume_usage(&self, id_or_name: &str) -> Result<VolumeUsage> {
        let v = self.volume(id_or_name).await?;
        let recent = self.readings.stats.history(v.id, crate::usage::RECENT_SECS);
        // A walk of /proc: off the async workers.
        blocking(move || crate::usage::of(&v, &recent)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockplane_api::model::{CreateImageFile, ResizeImageRequest};
    use utoipa::PartialSchema;

    fn props<T: PartialSchema>() -> serde_json::Value {
        serde_json::to_value(T::schema()).unwrap()["properties"].clone()
    }

    /// The bounds written as literals in the schema attributes are the ones
    /// the service checks.
    #[test]
    fn schema_bounds_are_the_service_limits() {
        let bounds = |p: &serde_json::Value| (p["minimum"].as_u64(), p["maximum"].as_u64());
        let v = props::<CreateVolumeRequest>();
        assert_eq!(bounds(&v["queues"]), (Some(1), Some(MAX_QUEUES.into())));
        let depth = MAX_QUEUE_DEPTH;
        assert_eq!(bounds(&v["queue_depth"]), (Some(1), Some(depth.into())));
        assert_eq!(
            v["max_io_bytes"]["enum"],
            serde_json::json!(MAX_IO_BYTES_CHOICES)
        );
        for (name, p) in props::<Qos>().as_object().unwrap() {
            assert_eq!(bounds(p), (Some(1), Some(MAX_QOS)), "{name}");
        }
        let max = blockplane_system::image::MAX_IMAGE_BYTES;
        for p in [props::<CreateImageFile>(), props::<ResizeImageRequest>()] {
            assert_eq!(bounds(&p["size_bytes"]), (Some(512), Some(max)));
        }
    }
}
