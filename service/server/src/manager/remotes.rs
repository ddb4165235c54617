//! Remote volumes: another host's export, connected here by the kernel's
//! NVMe/TCP initiator with this service's host NQN and the export's keys.
//!
//! The device users get is a dm node (`blockplane-remote-<id>`) mapping
//! the NVMe namespace linearly, not `/dev/nvmeXnY` itself: a node whose
//! table can be reloaded lets what is under a consumer change (a move of
//! the data to this host, step 26) without the consumer closing it.
//! Everything a remote volume's data path is (its dispatch, its limits, its
//! image) is decided on the exporting host, and refused here with where to
//! ask instead.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use super::blocking::blocking;
use super::error::Result;
use super::fabric_error::RemoteError;
use super::house::House;
use super::names::validate_name;
use crate::store::{RemoteAttachment, RemoteRow};
use blockplane_api::model::{
    CreateRemoteRequest, MoveState, PatchRemoteRequest, Remote, RemoteState,
};
use blockplane_system::dhchap::Secret;
use blockplane_system::dm;
use blockplane_system::fabrics::{self, Connect, ControllerState, FabricsError, Timeouts};
use blockplane_system::nvmet::{self, ListenAddr};

/// How long the kernel may take to show a connected controller's
/// namespace (it scans asynchronously after the connect returns).
const NAMESPACE_WAIT: Duration = Duration::from_secs(30);

/// The remote volumes' part: the house and this service's identity as an
/// NVMe host.
#[derive(Clone)]
pub struct Remotes {
    house: Arc<House>,
    host_nqn: Arc<str>,
    host_id: Uuid,
}

/// The dm node of a remote volume.
fn dm_name(id: Uuid) -> String {
    format!("blockplane-remote-{id}")
}

impl Remotes {
    /// The remote volumes' part over `house`, connecting as `host_nqn`.
    pub(super) fn new(house: Arc<House>, host_nqn: String, host_id: Uuid) -> Self {
        Self {
            house,
            host_nqn: host_nqn.into(),
            host_id,
        }
    }

    /// This service's host NQN.
    pub(crate) fn host_nqn(&self) -> &str {
        &self.host_nqn
    }

    fn row_of(&self, id_or_name: &str) -> impl Future<Output = Result<RemoteRow>> + '_ {
        let key = id_or_name.to_string();
        async move {
            self.house
                .store
                .remote(&key)
                .await?
                .ok_or_else(|| RemoteError::NotFound(key).into())
        }
    }

    /// `POST /v1/remotes`: connects to an export; idempotent by name.
    pub(crate) async fn create(&self, req: CreateRemoteRequest) -> Result<super::Created<Remote>> {
        validate_name("remote volume", &req.name)?;
        let _name = self.house.locks.volumes.lock(&req.name).await;
        let row = self.checked(&req)?;
        if let Some(existing) = self.house.store.remote(&req.name).await? {
            if existing.address == row.address && existing.nqn == row.nqn {
                return Ok(super::Created::Existing(self.view(existing).await?));
            }
            return Err(RemoteError::Exists {
                name: existing.name,
                address: existing.address,
                nqn: existing.nqn,
            }
            .into());
        }
        if let Some(other) = self
            .house
            .store
            .remotes()
            .await?
            .into_iter()
            .find(|r| r.nqn == row.nqn)
        {
            return Err(RemoteError::SameExport {
                name: row.name,
                nqn: row.nqn,
                other: other.name,
            }
            .into());
        }
        // Recorded first: a crash while connecting leaves a row the next
        // start connects or forgets, never a connection nobody knows.
        let mut tx = self.house.store.begin().await?;
        tx.insert_remote(&row).await?;
        tx.commit().await?;
        match self.attach(&row).await {
            Ok(attachment) => {
                let row = self
                    .record_attached(row, attachment, "remote_attached")
                    .await?;
                Ok(super::Created::New(self.view(row).await?))
            }
            Err(e) => {
                // Refused or failed: nothing stays, as if never asked (a
                // connection made before a later step failed goes too).
                let (r, host_nqn) = (row.clone(), self.host_nqn.clone());
                if let Err(left) = blocking(move || detach(&r, &host_nqn)).await? {
                    tracing::warn!(remote = %row.name, error = %left, "a failed connect left something behind");
                }
                let mut tx = self.house.store.begin().await?;
                tx.delete_remote(row.id).await?;
                tx.commit().await?;
                Err(e)
            }
        }
    }

    /// A request's row, every field checked; nothing of it is echoed
    /// when a secret is malformed.
    fn checked(&self, req: &CreateRemoteRequest) -> Result<RemoteRow> {
        let invalid = |field, reason: String| RemoteError::Invalid {
            name: req.name.clone(),
            field,
            reason,
        };
        let address: ListenAddr = req
            .address
            .parse()
            .map_err(|e: nvmet::ListenAddrError| invalid("address", e.to_string()))?;
        nvmet::check_nqn(&req.nqn).map_err(|e| invalid("nqn", e.to_string()))?;
        let secret = |field, s: &Option<String>| {
            s.as_deref()
                .map(Secret::parse)
                .transpose()
                .map_err(|e| RemoteError::BadKey {
                    name: req.name.clone(),
                    field,
                    reason: e.to_string(),
                })
        };
        let now = OffsetDateTime::now_utc();
        Ok(RemoteRow {
            id: Uuid::new_v4(),
            name: req.name.clone(),
            address: address.to_string(),
            nqn: req.nqn.clone(),
            secret: secret("secret", &req.secret)?,
            ctrl_secret: secret("ctrl_secret", &req.ctrl_secret)?,
            read_only: req.read_only,
            state: RemoteState::Connecting,
            state_reason: None,
            attachment: None,
            created_at: now,
            updated_at: now,
        })
    }

    /// Connects (or finds this service's connection to) the export, waits
    /// for its namespace, and makes (or points) the dm node over it.
    async fn attach(&self, row: &RemoteRow) -> Result<RemoteAttachment> {
        let (row, host_nqn, host_id) = (row.clone(), self.host_nqn.clone(), self.host_id);
        blocking(move || attach(&row, &host_nqn, host_id)).await?
    }

    async fn record_attached(
        &self,
        mut row: RemoteRow,
        attachment: RemoteAttachment,
        kind: &str,
    ) -> Result<RemoteRow> {
        let message = format!(
            "remote volume '{}' serves {} of {} at {} through {}",
            row.name, attachment.nvme_device, row.nqn, row.address, attachment.device
        );
        row.state = RemoteState::Attached;
        row.state_reason = None;
        row.attachment = Some(attachment);
        row.updated_at = OffsetDateTime::now_utc();
        let mut tx = self.house.store.begin().await?;
        tx.update_remote(&row).await?;
        tx.event(Some(row.id), None, kind, &message).await?;
        tx.commit().await?;
        Ok(row)
    }

    /// The running move of `row`, if one runs: it owns the node's table.
    async fn moving(&self, row: &RemoteRow) -> Result<Option<Uuid>> {
        Ok(self
            .house
            .store
            .move_of_remote(row.id)
            .await?
            .filter(|m| !m.state.ended())
            .map(|m| m.id))
    }

    /// `GET /v1/remotes`.
    pub(crate) async fn list(&self) -> Result<Vec<Remote>> {
        let mut out = Vec::new();
        for row in self.house.store.remotes().await? {
            out.push(self.view(row).await?);
        }
        Ok(out)
    }

    /// `GET /v1/remotes/{id}`.
    pub(crate) async fn get(&self, id_or_name: &str) -> Result<Remote> {
        let row = self.row_of(id_or_name).await?;
        self.view(row).await
    }

    /// A remote volume as the API shows it, its state as the kernel says
    /// now.
    async fn view(&self, row: RemoteRow) -> Result<Remote> {
        let controllers = blocking(fabrics::controllers).await?.unwrap_or_default();
        let (state, reason) = live_state(&row, &controllers);
        let a = row.attachment.as_ref();
        let moved = self.house.store.move_of_remote(row.id).await?;
        Ok(Remote {
            move_id: moved.as_ref().map(|m| m.id),
            volume: moved
                .filter(|_| row.state == RemoteState::Moved)
                .and_then(|m| m.volume_id),
            id: row.id,
            name: row.name.clone(),
            address: row.address.clone(),
            nqn: row.nqn.clone(),
            state,
            state_reason: reason,
            device: a.map(|a| a.device.clone()),
            nvme_device: a.map(|a| a.nvme_device.clone()),
            size_bytes: a.map_or(0, |a| a.size_bytes),
            read_only: row.read_only,
            created_at: row.created_at,
        })
    }

    /// `PATCH /v1/remotes/{id}`: read-only, live; what the exporting host
    /// decides is refused.
    pub(crate) async fn patch(
        &self,
        id_or_name: &str,
        patch: PatchRemoteRequest,
    ) -> Result<Remote> {
        let row = self.row_of(id_or_name).await?;
        let _name = self.house.locks.volumes.lock(&row.name).await;
        let mut row = self.row_of(&row.id.to_string()).await?;
        let refuse = |what, rule| {
            Err(RemoteError::NotForRemote {
                name: row.name.clone(),
                what,
                rule,
            }
            .into())
        };
        if patch.dispatch.is_some() {
            return refuse(
                "dispatch",
                "its data path is its exporting host's: PATCH the volume there",
            );
        }
        if patch.qos.is_some() {
            return refuse(
                "qos",
                "its limits are its exporting host's: PATCH the volume there",
            );
        }
        let secret = patch
            .secret
            .as_deref()
            .map(Secret::parse)
            .transpose()
            .map_err(|e| RemoteError::BadKey {
                name: row.name.clone(),
                field: "secret",
                reason: e.to_string(),
            })?;
        if let Some(secret) = secret {
            row = self.take_key(row, secret).await?;
        }
        let Some(read_only) = patch.read_only.filter(|r| *r != row.read_only) else {
            return self.view(row).await;
        };
        if let Some(m) = self.moving(&row).await? {
            return Err(RemoteError::Moving {
                name: row.name.clone(),
                what: "read_only",
                id: m,
            }
            .into());
        }
        if row.state == RemoteState::Moved {
            return Err(RemoteError::NotForRemote {
                name: row.name.clone(),
                what: "read_only",
                rule: "its data moved here: PATCH the volume it serves instead",
            }
            .into());
        }
        if let Some(a) = row.attachment.clone() {
            let name = row.name.clone();
            blocking(move || {
                dm::linear::reload(
                    &a.dm_name,
                    Path::new(&a.nvme_device),
                    a.size_bytes / 512,
                    read_only,
                )
            })
            .await?
            .map_err(|source| RemoteError::Dm { name, source })?;
        }
        row.read_only = read_only;
        row.updated_at = OffsetDateTime::now_utc();
        let mut tx = self.house.store.begin().await?;
        tx.update_remote(&row).await?;
        let message = format!("remote volume '{}' read_only={read_only}", row.name);
        tx.event(Some(row.id), None, "remote_changed", &message)
            .await?;
        tx.commit().await?;
        self.view(row).await
    }

    /// Gives the live connection its new key (the kernel re-authenticates
    /// at once, without a disconnect), then records it for the next
    /// connect.
    async fn take_key(&self, mut row: RemoteRow, secret: Secret) -> Result<RemoteRow> {
        if let Some(a) = row.attachment.clone() {
            let (name, s) = (row.name.clone(), secret.clone());
            blocking(move || fabrics::set_secret(a.controller, &s))
                .await?
                .map_err(|source| RemoteError::Fabrics { name, source })?;
        }
        row.secret = Some(secret);
        let mut tx = self.house.store.begin().await?;
        tx.set_remote_keys(&row).await?;
        let message = format!("remote volume '{}' took its new key", row.name);
        tx.event(Some(row.id), None, "remote_key_changed", &message)
            .await?;
        tx.commit().await?;
        Ok(row)
    }

    /// `DELETE /v1/remotes/{id}`: removes the node and disconnects;
    /// refused while the node is open.
    pub(crate) async fn delete(&self, id_or_name: &str) -> Result<()> {
        let row = self.row_of(id_or_name).await?;
        let _name = self.house.locks.volumes.lock(&row.name).await;
        let row = self.row_of(&row.id.to_string()).await?;
        if let Some(id) = self.moving(&row).await? {
            return Err(RemoteError::Moving {
                name: row.name,
                what: "its connection",
                id,
            }
            .into());
        }
        let (r, host_nqn) = (row.clone(), self.host_nqn.clone());
        blocking(move || detach(&r, &host_nqn)).await??;
        let mut tx = self.house.store.begin().await?;
        tx.delete_remote(row.id).await?;
        let message = format!(
            "remote volume '{}' is disconnected from {} at {}",
            row.name, row.nqn, row.address
        );
        tx.event(Some(row.id), None, "remote_deleted", &message)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Follows what the kernel does to each remote volume, once (the
    /// sampler calls it every second): a namespace that grew on the
    /// exporting host grows the dm node; a connection lost, back or gone
    /// changes the state, each with an event.
    pub(crate) async fn follow_once(&self) -> Result<()> {
        let controllers = blocking(fabrics::controllers).await?.unwrap_or_default();
        for row in self.house.store.remotes().await? {
            let (state, reason) = live_state(&row, &controllers);
            let Some(a) = row.attachment.clone() else {
                continue;
            };
            let nvme = PathBuf::from(&a.nvme_device);
            let size = blocking(move || device_size(&nvme)).await?.ok();
            // A move owns the node's table until it ends.
            let moving = self.moving(&row).await?.is_some() || row.state == RemoteState::Moved;
            let grown =
                size.filter(|s| state == RemoteState::Attached && !moving && *s != a.size_bytes);
            if state == row.state && reason == row.state_reason && grown.is_none() {
                continue;
            }
            let _name = self.house.locks.volumes.lock(&row.name).await;
            let mut row = self.row_of(&row.id.to_string()).await?;
            let mut message = format!(
                "remote volume '{}' is {}{}",
                row.name,
                state_text(state),
                reason
                    .as_ref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            );
            if let (Some(size), Some(mut a)) = (grown, row.attachment.clone()) {
                let (name, ro) = (row.name.clone(), row.read_only);
                let moved = a.clone();
                blocking(move || {
                    dm::linear::reload(
                        &moved.dm_name,
                        Path::new(&moved.nvme_device),
                        size / 512,
                        ro,
                    )
                })
                .await?
                .map_err(|source| RemoteError::Dm { name, source })?;
                message = format!(
                    "remote volume '{}' grew from {} to {size} bytes with its export",
                    row.name, a.size_bytes
                );
                a.size_bytes = size;
                row.attachment = Some(a);
            }
            (row.state, row.state_reason) = (state, reason);
            row.updated_at = OffsetDateTime::now_utc();
            let mut tx = self.house.store.begin().await?;
            tx.update_remote(&row).await?;
            tx.event(Some(row.id), None, "remote_state", &message)
                .await?;
            tx.commit().await?;
        }
        Ok(())
    }

    /// At start: adopts this service's connections the kernel kept, and
    /// connects again those a reboot lost. One that cannot connect stays,
    /// with its state `error` and why.
    pub(crate) async fn reconcile(&self) -> Result<()> {
        for row in self.house.store.remotes().await? {
            let _name = self.house.locks.volumes.lock(&row.name).await;
            // Past a move's switch the remote device no longer holds every
            // write: it is never connected under the node again.
            let switched = self
                .house
                .store
                .move_of_remote(row.id)
                .await?
                .is_some_and(|m| m.state == MoveState::Releasing);
            if row.state == RemoteState::Moved || switched {
                continue;
            }
            match self.attach(&row).await {
                Ok(a)
                    if row.attachment.as_ref() == Some(&a)
                        && row.state == RemoteState::Attached => {}
                Ok(a) => {
                    self.record_attached(row, a, "remote_adopted").await?;
                }
                Err(e) => {
                    let mut row = row;
                    row.state = RemoteState::Error;
                    row.state_reason = Some(e.to_string());
                    row.updated_at = OffsetDateTime::now_utc();
                    let mut tx = self.house.store.begin().await?;
                    tx.update_remote(&row).await?;
                    tx.event(Some(row.id), None, "remote_error", &e.to_string())
                        .await?;
                    tx.commit().await?;
                }
            }
        }
        Ok(())
    }
}

fn state_text(s: RemoteState) -> &'static str {
    match s {
        RemoteState::Connecting => "connecting",
        RemoteState::Attached => "attached",
        RemoteState::Reconnecting => "reconnecting",
        RemoteState::Error => "error",
        RemoteState::Moved => "moved here",
    }
}

/// `/dev/mapper/<name>`.
fn dm_device(name: &str) -> PathBuf {
    Path::new("/dev/mapper").join(name)
}

/// The state of a remote volume as the kernel says: its controller's.
fn live_state(
    row: &RemoteRow,
    controllers: &[fabrics::ControllerInfo],
) -> (RemoteState, Option<String>) {
    if row.state == RemoteState::Moved {
        return (RemoteState::Moved, None);
    }
    let Some(a) = row.attachment.as_ref() else {
        return (row.state, row.state_reason.clone());
    };
    let Some(c) = controllers
        .iter()
        .find(|c| c.instance == a.controller && c.subsys_nqn == row.nqn)
    else {
        return (
            RemoteState::Error,
            Some(format!(
                "its connection to {} at {} is gone (lost past the loss timeout of {} s, or removed): delete it and connect again",
                row.nqn,
                row.address,
                Timeouts::default().ctrl_loss_tmo_s
            )),
        );
    };
    match &c.state {
        ControllerState::Live => (RemoteState::Attached, None),
        ControllerState::Connecting | ControllerState::Resetting | ControllerState::New => (
            RemoteState::Reconnecting,
            Some(format!(
                "the connection to {} is {}: I/O waits until it is back, or fails after the loss timeout",
                row.address, c.state
            )),
        ),
        other => (
            RemoteState::Error,
            Some(format!("its controller nvme{} is {other}", c.instance)),
        ),
    }
}

/// Connects `row`'s export (or finds this service's connection to it),
/// then its namespace, then the dm node over it.
fn attach(row: &RemoteRow, host_nqn: &str, host_id: Uuid) -> Result<RemoteAttachment> {
    let address: ListenAddr =
        row.address
            .parse()
            .map_err(|e: nvmet::ListenAddrError| RemoteError::Invalid {
                name: row.name.clone(),
                field: "address",
                reason: e.to_string(),
            })?;
    let fab = |source| RemoteError::Fabrics {
        name: row.name.clone(),
        source,
    };
    let existing = fabrics::controllers()
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.subsys_nqn == row.nqn && c.host_nqn == host_nqn && !c.state.is_gone());
    let controller = match existing {
        Some(c) => c.instance,
        None => {
            fabrics::connect(&Connect {
                address,
                nqn: &row.nqn,
                host_nqn,
                host_id,
                secret: row.secret.as_ref(),
                ctrl_secret: row.ctrl_secret.as_ref(),
                timeouts: Timeouts::default(),
            })
            .map_err(|e| RemoteError::connect(&row.name, e))?
            .instance
        }
    };
    let fabrics::Namespace {
        path: nvme,
        size_bytes,
    } = match fabrics::wait_namespace(controller, NAMESPACE_WAIT).map_err(fab)? {
        Some(ns) => ns,
        None => {
            let _ = fabrics::disconnect(controller);
            return Err(RemoteError::NoNamespace {
                name: row.name.clone(),
                nqn: row.nqn.clone(),
                secs: NAMESPACE_WAIT.as_secs(),
            }
            .into());
        }
    };
    let name = dm_name(row.id);
    let dm = |source| RemoteError::Dm {
        name: row.name.clone(),
        source,
    };
    let sectors = size_bytes / 512;
    if dm::linear::device(&name).map_err(dm)?.is_some() {
        // A move's mirror stays: its remote leg is this namespace already.
        let mirrored = dm::table(&name)
            .map_err(dm)?
            .targets
            .first()
            .is_some_and(|t| t.2 == "raid");
        if !mirrored {
            dm::linear::reload(&name, &nvme, sectors, row.read_only).map_err(dm)?;
        }
    } else {
        let uuid = format!("bp-remote-{}", row.id);
        dm::linear::create(&name, &uuid, &nvme, sectors, row.read_only).map_err(dm)?;
    }
    let device = dm::linear::device(&name).map_err(dm)?.ok_or_else(|| {
        fab(FabricsError::Io {
            op: "find",
            path: dm_device(&name),
            source: std::io::Error::from_raw_os_error(libc::ENXIO),
        })
    })?;
    Ok(RemoteAttachment {
        controller,
        nvme_device: nvme.display().to_string(),
        dm_name: name,
        device: device.display().to_string(),
        size_bytes,
    })
}

/// Removes the dm node (refused while open) and disconnects.
fn detach(row: &RemoteRow, host_nqn: &str) -> Result<()> {
    let name = dm_name(row.id);
    match dm::linear::remove(&name) {
        Ok(_) => {}
        Err(e) if e.to_io().raw_os_error() == Some(libc::EBUSY) => {
            return Err(RemoteError::Busy {
                name: row.name.clone(),
                device: dm_device(&name).display().to_string(),
            }
            .into());
        }
        Err(source) => {
            return Err(RemoteError::Dm {
                name: row.name.clone(),
                source,
            }
            .into());
        }
    }
    let controllers = fabrics::controllers().unwrap_or_default();
    for c in controllers
        .iter()
        .filter(|c| c.subsys_nqn == row.nqn && c.host_nqn == host_nqn)
    {
        fabrics::disconnect(c.instance).map_err(|source| RemoteError::Fabrics {
            name: row.name.clone(),
            source,
        })?;
    }
    Ok(())
}

/// A block device's size in bytes, from sysfs.
fn device_size(dev: &Path) -> std::io::Result<u64> {
    let name = dev
        .file_name()
        .ok_or_else(|| std::io::Error::other("no device name"))?;
    let sectors = std::fs::read_to_string(Path::new("/sys/block").join(name).join("size"))?;
    sectors
        .trim()
        .parse::<u64>()
        .map(|s| s * 512)
        .map_err(std::io::Error::other)
}
