//! Exports: a volume served to other hosts over NVMe/TCP by the kernel's
//! own target (nvmet, configured through configfs). One subsystem per
//! volume, its one namespace the volume's device (the plaintext of an
//! encrypted one), on every address the operator named
//! (`--export-address`), each allowed host authenticated both ways with
//! DH-HMAC-CHAP.
//!
//! The registry says what should be exported; [`Exports::follow`] makes the
//! kernel serve it, and runs again after every recorded change (a switch,
//! a grow, a handover, a recovery): whatever moved the volume, the export
//! follows it from the registry, so no other part needs to know exports
//! exist. Configfs outlives the service, so a restart adopts what the
//! kernel serves; a reboot makes it again from the registry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use time::OffsetDateTime;
use uuid::Uuid;

use super::blocking::blocking;
use super::encryption;
use super::error::Result;
use super::fabric_error::ExportError;
use super::house::House;
use crate::store::{ExportHostRow, ExportRow, VolumeRow};
use blockplane_api::model::{
    Export, ExportAuth, ExportHost, ExportHostKeys, ExportMove, ExportRequest, ExportState,
    VolumeState,
};
use blockplane_system::dhchap::Secret;
use blockplane_system::nvmet::{self, ListenAddr, NvmetError, SubsystemSpec, Target};

/// What the kernel was last made to serve for one export.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Served {
    device: String,
    size_bytes: u64,
    read_only: bool,
    hosts: Vec<String>,
}

/// The exports' part: the house, where exports listen, and what the kernel
/// serves of each.
#[derive(Clone)]
pub struct Exports {
    house: Arc<House>,
    addresses: Arc<Vec<ListenAddr>>,
    /// By volume id; an export missing here is converged at the next
    /// follow.
    served: Arc<Mutex<HashMap<Uuid, Served>>>,
    /// Held while hosts' keys are read and written to the kernel: a
    /// rotation is never undone by a follow that read the old keys.
    keys: Arc<tokio::sync::Mutex<()>>,
}

/// The subsystem NQN of an export: this service's instance and the volume.
pub(super) fn export_nqn(instance: &str, volume: &str) -> String {
    format!("{}{volume}", nqn_prefix(instance))
}

/// Every subsystem this service makes starts so: another service's (or
/// another tool's) subsystems are never taken for its own.
fn nqn_prefix(instance: &str) -> String {
    format!("nqn.2026-12.dev.blockplane:{instance}:")
}

/// The device an export serves: the plaintext of an encrypted volume, the
/// backend's device otherwise; `None` while the volume has no device.
pub(super) fn served_device(v: &VolumeRow) -> Option<(String, u64)> {
    if !matches!(v.state, VolumeState::Attached | VolumeState::Degraded) {
        return None;
    }
    let a = v.attachment.as_ref()?;
    let device = match &v.crypt {
        Some(layer) => encryption::plaintext_device(layer),
        None => a.device.clone(),
    };
    Some((device, a.size_bytes))
}

impl Exports {
    /// The exports' part over `house`, listening on `addresses`.
    pub(super) fn new(house: Arc<House>, addresses: Vec<ListenAddr>) -> Self {
        Self {
            house,
            addresses: Arc::new(addresses),
            served: Arc::default(),
            keys: Arc::default(),
        }
    }

    /// Where exports listen, as `ip:port`.
    pub(crate) fn addresses(&self) -> Vec<String> {
        self.addresses.iter().map(ToString::to_string).collect()
    }

    /// `PUT /v1/volumes/{id}/export`: exports a volume, or changes which
    /// hosts its export allows; answers each host's keys.
    pub(crate) async fn put(&self, id_or_name: &str, req: ExportRequest) -> Result<Export> {
        let v = self.house.volume_row(id_or_name).await?;
        let _volume = self.house.locks.volumes.lock(&v.name).await;
        let v = self.house.volume_row(&v.id.to_string()).await?;
        self.check_request(&v.name, &req)?;
        if req.read_only || v.read_only {
            return Err(ExportError::ReadOnly {
                volume: v.name.clone(),
                what: "a read-only export, or an export of a read-only volume, is refused",
            }
            .into());
        }
        let target = self.target(&v.name).await?;
        let known = self.house.store.export_hosts().await?;
        let mut new_hosts = Vec::new();
        for nqn in &req.hosts {
            if !known.iter().any(|h| &h.host_nqn == nqn) {
                new_hosts.push(new_host(nqn)?);
            }
        }
        let previous = self.house.store.export(v.id).await?;
        let row = ExportRow {
            volume_id: v.id,
            nqn: export_nqn(&self.house.settings.instance, &v.name),
            read_only: req.read_only,
            auth: req.auth,
            state: ExportState::Waiting,
            state_reason: None,
            hosts: sorted(&req.hosts),
            moving: previous.as_ref().and_then(|p| p.moving.clone()),
            created_at: previous
                .as_ref()
                .map_or_else(OffsetDateTime::now_utc, |p| p.created_at),
        };
        // Recorded before the kernel serves it: a crash between leaves a
        // row the next start converges, never a subsystem nobody knows.
        let mut tx = self.house.store.begin().await?;
        for h in &new_hosts {
            tx.insert_export_host(h).await?;
        }
        tx.put_export(&row).await?;
        tx.forget_unused_export_hosts().await?;
        let dropped: Vec<String> = previous
            .iter()
            .flat_map(|p| p.hosts.iter())
            .filter(|h| !row.hosts.contains(h))
            .cloned()
            .collect();
        let (kind, verb) = match previous {
            Some(_) => ("volume_export_changed", "now allows"),
            None => ("volume_exported", "is exported to"),
        };
        let message = format!(
            "volume '{}' {verb} {} as {}",
            v.name,
            hosts_text(&row.hosts),
            row.nqn
        );
        tx.event(Some(v.id), Some(v.image_id), kind, &message)
            .await?;
        tx.commit().await?;
        self.converge(&target, &v, &row).await?;
        // A host no longer allowed keeps a session it has (the kernel
        // checks the list at connect); its entry goes once no export
        // allows it.
        if !dropped.is_empty() {
            self.forget_unused(&target, &v.name, dropped).await?;
        }
        let mut shown = self.view(&v, Some(&target)).await?;
        let keys = self.house.store.export_hosts().await?;
        for host in &mut shown.hosts {
            if let Some(k) = keys.iter().find(|k| k.host_nqn == host.host_nqn) {
                host.secret = Some(k.key.expose().to_string());
                host.ctrl_secret = Some(k.ctrl_key.expose().to_string());
            }
        }
        Ok(shown)
    }

    /// The rules of a request, checked before anything changes.
    fn check_request(&self, volume: &str, req: &ExportRequest) -> Result<()> {
        if self.addresses.is_empty() {
            return Err(ExportError::Unavailable {
                volume: volume.to_string(),
                reason: "the service has no export address (start it with --export-address)"
                    .to_string(),
            }
            .into());
        }
        for nqn in &req.hosts {
            nvmet::check_nqn(nqn).map_err(|e| ExportError::BadHost {
                volume: volume.to_string(),
                nqn: nqn.clone(),
                reason: e.to_string(),
            })?;
        }
        let refuse = |rule| {
            Err(ExportError::AuthRequired {
                volume: volume.to_string(),
                rule,
            }
            .into())
        };
        match req.auth {
            ExportAuth::Dhchap if req.hosts.is_empty() => {
                refuse("an export names at least one host NQN (`hosts`)")
            }
            ExportAuth::None if !req.insecure_loopback => refuse(
                "an export without authentication needs `insecure_loopback: true`, and only loopback export addresses",
            ),
            ExportAuth::None if !self.addresses.iter().all(ListenAddr::is_loopback) => refuse(
                "an export without authentication is refused while an export address is not loopback",
            ),
            ExportAuth::None if !req.hosts.is_empty() => {
                refuse("an export without authentication allows any host: give no `hosts`")
            }
            _ => Ok(()),
        }
    }

    /// The kernel's target, or why this host has none.
    async fn target(&self, volume: &str) -> Result<Target> {
        blocking(Target::open).await?.map_err(|e| {
            ExportError::Unavailable {
                volume: volume.to_string(),
                reason: e.to_string(),
            }
            .into()
        })
    }

    /// Makes the kernel serve `row` for volume `v` as the registry says, and
    /// records what it did.
    async fn converge(&self, target: &Target, v: &VolumeRow, row: &ExportRow) -> Result<()> {
        let Some((device, size_bytes)) = served_device(v) else {
            return self.record_state(row, ExportState::Waiting, None).await;
        };
        let want = Served {
            device: device.clone(),
            size_bytes,
            read_only: row.read_only || v.read_only,
            hosts: row.hosts.clone(),
        };
        let before = self.served_now(v.id);
        if before.as_ref() == Some(&want) && row.state == ExportState::Serving {
            return Ok(());
        }
        let keys_held = self.keys.lock().await;
        let keys = self.house.store.export_hosts().await?;
        let spec = SubsystemSpec {
            nqn: row.nqn.clone(),
            serial: v.id.simple().to_string()[..20].to_string(),
            model: "blockplane".to_string(),
            device: device.into(),
            uuid: v.id,
            hosts: row.hosts.clone(),
            allow_any_host: row.auth == ExportAuth::None,
            ports: Vec::new(),
        };
        let grown = before.is_some_and(|b| b.size_bytes != size_bytes);
        let (target, addresses) = (target.clone(), self.addresses.clone());
        let applied = blocking(move || serve(&target, &addresses, spec, &keys, grown)).await?;
        drop(keys_held);
        match applied {
            Ok(()) => {
                self.served
                    .lock()
                    .expect("served lock poisoned")
                    .insert(v.id, want);
                self.record_state(row, ExportState::Serving, None).await
            }
            Err(e) => {
                self.served
                    .lock()
                    .expect("served lock poisoned")
                    .remove(&v.id);
                let e = ExportError::Kernel {
                    volume: v.name.clone(),
                    source: e,
                };
                self.record_state(row, ExportState::Error, Some(e.to_string()))
                    .await?;
                Err(e.into())
            }
        }
    }

    fn served_now(&self, id: Uuid) -> Option<Served> {
        self.served
            .lock()
            .expect("served lock poisoned")
            .get(&id)
            .cloned()
    }

    /// Records a change of an export's state, with an event; nothing when
    /// it stays.
    async fn record_state(
        &self,
        row: &ExportRow,
        state: ExportState,
        reason: Option<String>,
    ) -> Result<()> {
        if row.state == state && row.state_reason == reason {
            return Ok(());
        }
        let message = match (&state, &reason) {
            (_, Some(why)) => why.clone(),
            (ExportState::Serving, None) => format!("{} serves", row.nqn),
            (_, None) => format!("{} waits for its volume's device", row.nqn),
        };
        let mut tx = self.house.store.begin().await?;
        tx.set_export_state(row.volume_id, state, reason.as_deref())
            .await?;
        tx.event(Some(row.volume_id), None, "export_state", &message)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// `POST /v1/export-hosts/{host_nqn}/rotate`: a new key for a host (its
    /// controller key stays, [`ExportHostKeys`] says why), in the kernel
    /// first (its sessions stay: the kernel checks keys when a
    /// host authenticates), then the registry; a crash between leaves the
    /// registry's old keys, which the next start writes back.
    pub(crate) async fn rotate(&self, host_nqn: &str) -> Result<ExportHostKeys> {
        let _keys = self.keys.lock().await;
        let old = self
            .house
            .store
            .export_hosts()
            .await?
            .into_iter()
            .find(|h| h.host_nqn == host_nqn)
            .ok_or_else(|| ExportError::HostNotFound(host_nqn.to_string()))?;
        let fresh = ExportHostRow {
            key: new_host(host_nqn)?.key,
            ..old.clone()
        };
        let target = self.target(host_nqn).await?;
        let (t, h) = (target.clone(), fresh.clone());
        blocking(move || t.ensure_host(&h.host_nqn, &h.key, Some(&h.ctrl_key)))
            .await?
            .map_err(|source| ExportError::Kernel {
                volume: host_nqn.to_string(),
                source,
            })?;
        let exports: Vec<String> = self
            .house
            .store
            .exports()
            .await?
            .into_iter()
            .filter(|e| e.hosts.iter().any(|h| h == host_nqn))
            .map(|e| e.nqn)
            .collect();
        let recorded = async {
            let mut tx = self.house.store.begin().await?;
            tx.set_export_host_keys(&fresh).await?;
            let message = format!(
                "the keys of host '{host_nqn}' were rotated (exports {})",
                exports.join(", ")
            );
            tx.event(None, None, "export_host_keys_rotated", &message)
                .await?;
            tx.commit().await
        };
        if let Err(e) = recorded.await {
            // The registry keeps the old keys: so does the kernel.
            let t = target.clone();
            let _ =
                blocking(move || t.ensure_host(&old.host_nqn, &old.key, Some(&old.ctrl_key))).await;
            return Err(e.into());
        }
        Ok(ExportHostKeys {
            host_nqn: host_nqn.to_string(),
            secret: fresh.key.expose().to_string(),
            exports,
        })
    }

    /// `GET /v1/volumes/{id}/export`.
    pub(crate) async fn get(&self, id_or_name: &str) -> Result<Export> {
        let v = self.house.volume_row(id_or_name).await?;
        // The row first: a volume without an export does not load the
        // kernel's target to say so.
        let row = self.export_of(&v).await?;
        let target = blocking(Target::open).await?.ok();
        self.shown(&v, row, target.as_ref()).await
    }

    /// `GET /v1/exports`: every export, by NQN.
    pub(crate) async fn list(&self) -> Result<Vec<Export>> {
        let rows = self.house.store.exports().await?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let target = blocking(Target::open).await?.ok();
        let mut out = Vec::new();
        for row in rows {
            let v = self.house.volume_row(&row.volume_id.to_string()).await?;
            out.push(self.shown(&v, row, target.as_ref()).await?);
        }
        Ok(out)
    }

    async fn view(&self, v: &VolumeRow, target: Option<&Target>) -> Result<Export> {
        let row = self.export_of(v).await?;
        self.shown(v, row, target).await
    }

    /// An export as the API shows it, without keys, with the hosts the
    /// kernel says are connected.
    async fn shown(
        &self,
        v: &VolumeRow,
        row: ExportRow,
        target: Option<&Target>,
    ) -> Result<Export> {
        let connected = match target {
            Some(t) => match connected(t, &row.nqn, &self.addresses).await? {
                Connected::Hosts(h) => Some(h),
                Connected::Nobody => Some(Vec::new()),
                Connected::Unknown(_) => None,
            },
            None => None,
        };
        Ok(Export {
            volume_id: v.id,
            volume_name: v.name.clone(),
            nqn: row.nqn,
            addresses: self.addresses(),
            read_only: row.read_only || v.read_only,
            auth: row.auth,
            hosts: row
                .hosts
                .iter()
                .map(|h| ExportHost {
                    host_nqn: h.clone(),
                    connected: connected.as_ref().map(|c| c.contains(h)),
                    secret: None,
                    ctrl_secret: None,
                })
                .collect(),
            state: row.state,
            state_reason: row.state_reason,
            moving: row.moving,
            created_at: row.created_at,
        })
    }

    /// Volume `v`'s export row; refused when it has none.
    async fn export_of(&self, v: &VolumeRow) -> Result<ExportRow> {
        Ok(self
            .house
            .store
            .export(v.id)
            .await?
            .ok_or_else(|| ExportError::NotFound(v.name.clone()))?)
    }

    /// `PUT /v1/volumes/{id}/export/move`: what the host moving the
    /// volume's data says of the move, recorded with an event at each new
    /// state; a word older than the one recorded changes nothing.
    pub(crate) async fn note_move(&self, id_or_name: &str, word: ExportMove) -> Result<Export> {
        let v = self.house.volume_row(id_or_name).await?;
        let _volume = self.house.locks.volumes.lock(&v.name).await;
        let row = self.export_of(&v).await?;
        let last = row.moving.as_ref();
        if last.is_none_or(|l| l.at < word.at) {
            let mut tx = self.house.store.begin().await?;
            tx.set_export_move(v.id, &word).await?;
            if last.is_none_or(|l| l.state != word.state || l.move_id != word.move_id) {
                let message = format!(
                    "volume '{}': move {} of its data to host {} is {} ({} of {} bytes copied)",
                    v.name,
                    word.move_id,
                    word.host_nqn,
                    word.state.as_str(),
                    word.synced_bytes,
                    word.total_bytes
                );
                tx.event(Some(v.id), None, "export_move", &message).await?;
            }
            tx.commit().await?;
        }
        self.get(&v.id.to_string()).await
    }

    /// `DELETE /v1/volumes/{id}/export`: refused while a host is connected,
    /// or may be (`force` says to remove it anyway).
    pub(crate) async fn delete(&self, id_or_name: &str, force: bool) -> Result<()> {
        let v = self.house.volume_row(id_or_name).await?;
        let _volume = self.house.locks.volumes.lock(&v.name).await;
        let row = self.export_of(&v).await?;
        let target = self.target(&v.name).await?;
        match connected(&target, &row.nqn, &self.addresses).await? {
            Connected::Hosts(hosts) if !hosts.is_empty() => {
                return Err(ExportError::HostsConnected {
                    volume: v.name.clone(),
                    hosts: hosts.join(", "),
                }
                .into());
            }
            Connected::Unknown(peers) if !force => {
                let peers: Vec<String> = peers.iter().map(ToString::to_string).collect();
                return Err(ExportError::MaybeConnected {
                    volume: v.name.clone(),
                    peers: peers.join(", "),
                }
                .into());
            }
            _ => {}
        }
        let (t, nqn) = (target.clone(), row.nqn.clone());
        blocking(move || t.remove_subsystem(&nqn))
            .await?
            .map_err(|source| ExportError::Kernel {
                volume: v.name.clone(),
                source,
            })?;
        self.served
            .lock()
            .expect("served lock poisoned")
            .remove(&v.id);
        let mut tx = self.house.store.begin().await?;
        tx.delete_export(v.id).await?;
        let message = format!("volume '{}' is no longer exported ({})", v.name, row.nqn);
        tx.event(Some(v.id), Some(v.image_id), "volume_unexported", &message)
            .await?;
        tx.commit().await?;
        self.forget_unused(&target, &v.name, row.hosts).await
    }

    /// Removes the kernel's entries of the hosts in `was` that no export
    /// allows any more, and the ports no subsystem uses: hosts and ports
    /// are shared by every subsystem on the host, so only those this
    /// service made.
    async fn forget_unused(&self, target: &Target, volume: &str, was: Vec<String>) -> Result<()> {
        let kept: Vec<String> = self
            .house
            .store
            .export_hosts()
            .await?
            .into_iter()
            .map(|h| h.host_nqn)
            .collect();
        let gone: Vec<String> = was.into_iter().filter(|h| !kept.contains(h)).collect();
        let (t, addresses) = (target.clone(), self.addresses.clone());
        blocking(move || {
            for host in &gone {
                t.remove_host(host)?;
            }
            for port in t.ports()? {
                if port.addr.is_some_and(|a| addresses.contains(&a)) {
                    t.remove_port_if_unused(port.id)?;
                }
            }
            Ok(())
        })
        .await?
        .map_err(|source| {
            ExportError::Kernel {
                volume: volume.to_string(),
                source,
            }
            .into()
        })
    }

    /// Makes the kernel serve every export as the registry says: at start
    /// (adopting what configfs kept, making what a reboot lost, removing
    /// this instance's subsystems the registry does not know) and after
    /// every recorded change.
    pub(crate) async fn follow(&self) -> Result<()> {
        let rows = self.house.store.exports().await?;
        if rows.is_empty() && self.served_now_empty() {
            return Ok(());
        }
        let Ok(target) = blocking(Target::open).await? else {
            return Ok(());
        };
        for row in rows {
            let v = self.house.volume_row(&row.volume_id.to_string()).await?;
            // Under the volume's lock, read again: a PUT or DELETE of the
            // export, or a change of the volume, is not undone by a follow
            // that read before it.
            let _volume = self.house.locks.volumes.lock(&v.name).await;
            let Some(row) = self.house.store.export(v.id).await? else {
                continue;
            };
            let v = self.house.volume_row(&v.id.to_string()).await?;
            if let Err(e) = self.converge(&target, &v, &row).await {
                tracing::warn!(volume = %v.name, error = %e, "export does not serve");
            }
        }
        Ok(())
    }

    fn served_now_empty(&self) -> bool {
        self.served.lock().expect("served lock poisoned").is_empty()
    }

    /// Removes the subsystems of this instance the registry does not know
    /// (a registry restored from an older copy): another instance's, or
    /// another tool's, are never touched.
    async fn remove_unknown(&self) -> Result<()> {
        let Ok(target) = blocking(Target::open).await? else {
            return Ok(());
        };
        let known: Vec<String> = self
            .house
            .store
            .exports()
            .await?
            .into_iter()
            .map(|e| e.nqn)
            .collect();
        let prefix = nqn_prefix(&self.house.settings.instance);
        let t = target.clone();
        let removed = blocking(move || -> std::result::Result<Vec<String>, NvmetError> {
            let mut removed = Vec::new();
            for s in t.subsystems()? {
                if s.nqn.starts_with(&prefix) && !known.contains(&s.nqn) {
                    t.remove_subsystem(&s.nqn)?;
                    removed.push(s.nqn);
                }
            }
            Ok(removed)
        })
        .await?;
        match removed {
            Ok(removed) => {
                for nqn in removed {
                    tracing::warn!(%nqn, "removed an export of this service the registry does not know");
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing the kernel's exports failed"),
        }
        Ok(())
    }

    /// Runs [`Exports::follow`] now and after every commit that records
    /// events, for as long as the service runs; first removes the exports
    /// of this instance the registry does not know.
    pub(crate) fn start_following(&self) {
        let me = self.clone();
        let added = self.house.store.events_added();
        tokio::spawn(async move {
            if let Err(e) = me.remove_unknown().await {
                tracing::warn!(error = %e, "reconciling exports failed");
            }
            loop {
                let next = added.notified();
                tokio::pin!(next);
                next.as_mut().enable();
                if let Err(e) = me.follow().await {
                    tracing::warn!(error = %e, "following exports failed");
                }
                next.await;
            }
        });
    }
}

/// The one rule on read-only and exports: the kernel's target cannot serve
/// a namespace read-only, so neither a read-only export nor an exported
/// volume made read-only is allowed.
pub(super) fn refuse_read_only(volume: &str, export: Option<&ExportRow>) -> Result<()> {
    match export {
        Some(_) => Err(ExportError::ReadOnly {
            volume: volume.to_string(),
            what: "an exported volume cannot be made read-only",
        }
        .into()),
        None => Ok(()),
    }
}

/// A host's new keys: one it proves, one the target proves to it.
fn new_host(nqn: &str) -> Result<ExportHostRow> {
    let keys = || {
        Secret::generate().map_err(|source| ExportError::Keys {
            nqn: nqn.to_string(),
            source,
        })
    };
    Ok(ExportHostRow {
        host_nqn: nqn.to_string(),
        key: keys()?,
        ctrl_key: keys()?,
    })
}

/// Serves one subsystem: its ports, its hosts with their keys, then the
/// subsystem itself; re-reads the namespace's size after a grow.
fn serve(
    target: &Target,
    addresses: &[ListenAddr],
    mut spec: SubsystemSpec,
    keys: &[ExportHostRow],
    grown: bool,
) -> std::result::Result<(), NvmetError> {
    for a in addresses {
        spec.ports.push(target.ensure_port(a)?);
    }
    for host in &spec.hosts {
        if let Some(k) = keys.iter().find(|k| &k.host_nqn == host) {
            target.ensure_host(host, &k.key, Some(&k.ctrl_key))?;
        }
    }
    target.ensure_subsystem(&spec)?;
    if grown {
        target.revalidate(&spec.nqn)?;
    }
    Ok(())
}

/// Who is connected to an export.
enum Connected {
    /// These hosts, as the kernel says (its nvmet debugfs).
    Hosts(Vec<String>),
    /// Nobody: no connection to any export address at all.
    Nobody,
    /// Someone, from these addresses, to some export of this service: the
    /// kernel does not say to which.
    Unknown(Vec<std::net::IpAddr>),
}

/// Who is connected to subsystem `nqn`: the kernel's own answer where it
/// gives one; else the TCP connections to the export addresses, which
/// tell nobody from someone but not to which export.
async fn connected(target: &Target, nqn: &str, addresses: &[ListenAddr]) -> Result<Connected> {
    let (t, nqn, addresses) = (target.clone(), nqn.to_string(), addresses.to_vec());
    blocking(move || {
        if let Ok(Some(hosts)) = t.connected_hosts(&nqn) {
            return Connected::Hosts(hosts);
        }
        let mut peers: Vec<_> = addresses
            .iter()
            .flat_map(|a| blockplane_system::tcp::peers_of(a).unwrap_or_default())
            .collect();
        peers.sort();
        peers.dedup();
        match peers.is_empty() {
            true => Connected::Nobody,
            false => Connected::Unknown(peers),
        }
    })
    .await
}

fn sorted(hosts: &[String]) -> Vec<String> {
    let mut h = hosts.to_vec();
    h.sort();
    h.dedup();
    h
}

fn hosts_text(hosts: &[String]) -> String {
    match hosts.is_empty() {
        true => "any host (no authentication, loopback only)".to_string(),
        false => hosts.join(", "),
    }
}
