//! The controller: owns the service's state and is the only thing that changes
//! it. The API layer parses requests into calls on [`Manager`] and maps its
//! [`Error`]s to HTTP; the manager keeps SQLite and the kernel in step, one
//! image or volume at a time, with every change recorded as an event.

mod copies;
mod events;
#[cfg(test)]
mod fake;
pub mod holds;
mod images;
pub mod locks;
pub mod ops;
mod reconcile;
#[cfg(test)]
mod rules;
mod sampler;
mod volumes;

use std::sync::Arc;

use tokio::sync::Mutex;
use uuid::Uuid;

use crate::backend::{BackendError, BackendEvent, VolumeBackend};
use crate::store::{Store, StoreError};
use blockplane_api::model::{self, Backend, Capability, Host, HostBackends, HostPolicies};
use blockplane_system::image::{ImageFileError, ImageRoots};
use locks::KeyedLocks;
pub use ops::Operations;

/// Why the manager refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {what} name '{name}': names match [a-z0-9][a-z0-9._-]{{0,62}}")]
    InvalidName { what: &'static str, name: String },
    #[error("invalid {field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("image '{0}' not found")]
    ImageNotFound(String),
    #[error("volume '{0}' not found")]
    VolumeNotFound(String),
    #[error("no orphan device '{0}' (orphans are listed in GET /v1/host)")]
    OrphanNotFound(String),
    #[error("volume '{name}' would exceed this host's cap of {max} volumes (--max-volumes)")]
    VolumeLimit { name: String, max: usize },
    #[error("image name '{name}' is taken by image {id}")]
    ImageNameTaken { name: String, id: Uuid },
    #[error("'{path}' is already registered as image '{name}' ({id})")]
    AlreadyRegistered {
        path: String,
        name: String,
        id: Uuid,
    },
    #[error("image '{name}' is used by volume(s) {volumes} (an image serves one volume at a time)")]
    ImageInUse { name: String, volumes: String },
    #[error(
        "image '{name}' ({size} bytes) would bring the images of {root} to {provisioned} bytes, more than {ratio} times its filesystem's {fs_size} bytes (--max-overcommit)"
    )]
    Overcommit {
        name: String,
        size: u64,
        root: String,
        provisioned: u64,
        ratio: f64,
        fs_size: u64,
    },
    #[error("image '{name}' file changed: {reason}")]
    ImageReplaced { name: String, reason: String },
    #[error(
        "image '{name}' ({path}) is locked by {holder}: another blockplane (another data dir) serves it; delete that volume first"
    )]
    ImageLocked {
        name: String,
        path: String,
        holder: String,
    },
    #[error(
        "image '{name}': {what} needs {needed} bytes and its filesystem has {free} free; nothing was changed"
    )]
    SpaceShort {
        name: String,
        what: &'static str,
        needed: u64,
        free: u64,
    },
    #[error("image '{name}' is a read-only snapshot of {source_id}: {reason}")]
    ImageReadOnly {
        name: String,
        source_id: String,
        reason: String,
    },
    #[error("image '{name}' is {state}: {reason}")]
    ImageNotReady {
        name: String,
        state: &'static str,
        reason: String,
    },
    #[error("image '{name}' is served by {backend} volume '{volume}': {reason}")]
    SnapshotAttached {
        name: String,
        volume: String,
        backend: &'static str,
        reason: &'static str,
    },
    #[error(
        "image '{name}': the copy to image '{copy}' reads it, so it cannot {what} until that copy is ready (or stopped by deleting '{copy}')"
    )]
    CopySource {
        name: String,
        copy: String,
        what: String,
    },
    #[error("image '{name}' cannot be allocated: {reason}")]
    NotAllocatable { name: String, reason: String },
    #[error("image '{name}': {reason}")]
    AllocateConflict { name: String, reason: String },
    #[error("image '{name}' is {current} bytes; resize only grows (asked {asked})")]
    Shrink {
        name: String,
        current: u64,
        asked: u64,
    },
    #[error("volume '{name}' already exists with a different spec ({differences})")]
    VolumeExists { name: String, differences: String },
    #[error("volume '{name}' is {state}: {reason}")]
    VolumeState {
        name: String,
        state: &'static str,
        reason: String,
    },
    #[error("volume '{name}': {source}")]
    Volume {
        name: String,
        #[source]
        source: BackendError,
    },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    ImageFile(#[from] ImageFileError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the registry cannot be written: {0}")]
    StoreUnwritable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result of the manager's operations.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An image refused because volumes use it, named by their names.
    fn image_in_use(image: String, users: &[(Uuid, String)]) -> Self {
        Error::ImageInUse {
            name: image,
            volumes: users
                .iter()
                .map(|(_, name)| format!("'{name}'"))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// Whether a create made something new or found it already there.
#[derive(Debug)]
pub enum Created<T> {
    New(T),
    Existing(T),
}

/// The points of a volume's create, delete and live changes after which a test can
/// inject a fault (env `BLOCKPLANE_TEST_FAULT`), to prove restart and cleanup
/// work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// The volume row is recorded, no device exists yet.
    Insert,
    /// The device exists, the row does not say so yet.
    Attach,
    /// The device is gone, the row is still there.
    Detach,
    /// A live change (a PATCH, or a volume following its image's resize) is
    /// made on the device, the row does not say so yet.
    Change,
}

/// An injected fault: SIGKILL the service, or fail the operation, at a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Kill(After),
    Fail(After),
    /// Every image create takes 3 s more once its file is made
    /// (`slow_image_create`): a request that outlasts a timeout, holds a
    /// concurrency slot or is in flight at SIGTERM, whatever the disk.
    SlowImageCreate,
    /// Each 16 MiB stretch an allocate zeroes (in the service or a ublk
    /// worker) takes 100 ms more (`slow_allocate`): its progress and cancel,
    /// whatever the disk.
    SlowAllocate,
    /// Each 16 MiB stretch a snapshot's or clone's background copy copies
    /// takes 100 ms more (`slow_copy`): its progress, cancel and a crash
    /// during it, whatever the disk.
    SlowCopy,
}

impl Fault {
    /// Parses `kill_after_insert`, `kill_after_attach`, `kill_after_detach`,
    /// `kill_after_change`, `fail_after_attach`, `slow_image_create`,
    /// `slow_allocate`, `slow_copy`.
    pub fn parse(s: &str) -> Option<Self> {
        if s == "slow_image_create" {
            return Some(Fault::SlowImageCreate);
        }
        if s == "slow_allocate" {
            return Some(Fault::SlowAllocate);
        }
        if s == "slow_copy" {
            return Some(Fault::SlowCopy);
        }
        let (action, stage) = s.split_once("_after_")?;
        let stage = match stage {
            "insert" => After::Insert,
            "attach" => After::Attach,
            "detach" => After::Detach,
            "change" => After::Change,
            _ => return None,
        };
        match action {
            "kill" => Some(Fault::Kill(stage)),
            "fail" => Some(Fault::Fail(stage)),
            _ => None,
        }
    }
}

/// What the manager needs of the service's configuration.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Runtime files (worker run dirs).
    pub run_dir: std::path::PathBuf,
    /// Queues of a ublk or dm volume created without a number.
    pub default_queues: u16,
    /// Volumes this host may have.
    pub max_volumes: usize,
    /// Provisioned bytes of an image root over its filesystem's size, at most.
    pub max_overcommit: Option<f64>,
    /// A test fault to inject.
    pub fault: Option<Fault>,
}

/// The controller.
pub struct Manager {
    store: Store,
    roots: ImageRoots,
    backends: Vec<Arc<dyn VolumeBackend>>,
    /// Serialises image registration (name and file identity checks + insert).
    image_registration: Mutex<()>,
    image_locks: KeyedLocks,
    /// OFD locks on the images of this service's volumes.
    holds: holds::ImageHolds,
    /// Keyed by volume name: create, delete and live changes of one volume queue.
    volume_locks: KeyedLocks,
    /// Once-a-second readings of every attached volume.
    sampler: sampler::Sampler,
    /// `GET /v1/volumes` as JSON, with the store generation it was made at.
    volumes_cache: std::sync::Mutex<Option<(u64, bytes::Bytes)>>,
    /// API request counts and durations.
    api_metrics: crate::metrics::ApiMetrics,
    fault: Option<Fault>,
    max_volumes: usize,
    max_overcommit: Option<f64>,
    default_queues: u16,
    /// This service's instance id, in the marks it puts on devices.
    instance: String,
    /// Where ublk workers' run dirs live.
    ublk_run_root: std::path::PathBuf,
    /// Each image's last allocate since the service started (in memory: a
    /// restart leaves the image as declared, to be allocated again).
    allocations: std::sync::Mutex<std::collections::HashMap<Uuid, images::AllocateRun>>,
    /// The background copies of snapshots and clones running now, by image.
    copies: std::sync::Mutex<std::collections::HashMap<Uuid, copies::CopyRun>>,
}

/// The backends a manager serves volumes with, built by its caller (the
/// server builds the kernel's; a test, fakes), and the receiving end of the
/// [`crate::backend::EventSink`] they were given.
pub struct Backends {
    /// One per kind at most; a kind missing is a backend this build lacks.
    pub list: Vec<Arc<dyn VolumeBackend>>,
    /// What the backends notice on their own (worker restarts, drift).
    pub events: std::sync::mpsc::Receiver<BackendEvent>,
}

impl Manager {
    /// A manager over `store` and `roots`, serving volumes with `backends`.
    pub async fn new(
        store: Store,
        roots: ImageRoots,
        backends: Backends,
        cfg: ManagerConfig,
    ) -> Result<Arc<Self>> {
        let instance = store.instance().await?;
        let me = Arc::new(Self {
            store,
            roots,
            backends: backends.list,
            instance,
            image_registration: Mutex::new(()),
            image_locks: KeyedLocks::default(),
            holds: holds::ImageHolds::default(),
            volume_locks: KeyedLocks::default(),
            sampler: sampler::Sampler::default(),
            volumes_cache: std::sync::Mutex::default(),
            api_metrics: crate::metrics::ApiMetrics::default(),
            fault: cfg.fault,
            max_volumes: cfg.max_volumes,
            max_overcommit: cfg.max_overcommit,
            default_queues: cfg.default_queues,
            ublk_run_root: cfg.run_dir.join("ublk"),
            allocations: std::sync::Mutex::default(),
            copies: std::sync::Mutex::default(),
        });
        me.clone().record_backend_events(backends.events);
        Ok(me)
    }

    /// Records what backends notice on their own (worker restarts, drift) as
    /// events and volume state, on a thread of its own.
    fn record_backend_events(self: Arc<Self>, rx: std::sync::mpsc::Receiver<BackendEvent>) {
        let rt = tokio::runtime::Handle::current();
        std::thread::spawn(move || {
            while let Ok(ev) = rx.recv() {
                if let Err(e) = rt.block_on(self.apply_backend_event(&ev)) {
                    tracing::error!(volume = %ev.volume_id, error = %e, "cannot record a backend event");
                }
            }
        });
    }

    async fn apply_backend_event(&self, ev: &BackendEvent) -> Result<()> {
        let Some(v) = self.store.volume(&ev.volume_id.to_string()).await? else {
            return Ok(());
        };
        let _volume = self.volume_locks.lock(&v.name).await;
        let Some(mut v) = self.store.volume(&ev.volume_id.to_string()).await? else {
            return Ok(());
        };
        tracing::info!(volume = %v.name, kind = ev.kind, message = %ev.message, "backend event");
        if let Some(mut att) = ev.attachment.clone() {
            if let Some(old) = &v.attachment {
                att.attached_at = old.attached_at;
            }
            v.attachment = Some(att);
        }
        if let Some(state) = ev.state {
            v.state = state;
            v.state_reason = Some(ev.message.clone());
            if state == model::VolumeState::Error {
                v.attachment = None;
            }
        }
        v.updated_at = time::OffsetDateTime::now_utc();
        let mut tx = self.store.begin().await?;
        tx.update_volume(&v).await?;
        tx.event(
            Some(v.id),
            Some(v.image_id),
            ev.kind,
            &format!("volume '{}': {}", v.name, ev.message),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Applies the injected fault of this stage, if any.
    fn fault_point(&self, at: After) -> Result<()> {
        match self.fault {
            Some(Fault::Kill(s)) if s == at => {
                tracing::warn!(?at, "test fault: killing the service");
                let _ = rustix::process::kill_process(
                    rustix::process::getpid(),
                    rustix::process::Signal::KILL,
                );
                Ok(())
            }
            Some(Fault::Fail(s)) if s == at => {
                Err(Error::Internal(format!("injected test fault at {at:?}")))
            }
            _ => Ok(()),
        }
    }

    fn backend(&self, kind: Backend) -> Option<Arc<dyn VolumeBackend>> {
        self.backends.iter().find(|b| b.kind() == kind).cloned()
    }

    /// Availability of a backend, including ones this build does not carry yet.
    fn capability(&self, kind: Backend) -> model::BackendCapability {
        match self.backend(kind) {
            Some(b) => b.capability(),
            None => model::BackendCapability {
                available: false,
                reason: Some(not_built_reason(kind)),
                features: None,
                targets: None,
                native_loop_target: None,
            },
        }
    }

    /// What this host can run, and the devices of this instance no volume owns.
    async fn host(self: &Arc<Self>) -> Result<Host> {
        let me = self.clone();
        let mut host = blocking(move || me.capabilities()).await?;
        host.orphans = self.orphans().await?;
        host.image_root_capacity = self.root_usage().await?;
        Ok(host)
    }

    /// Devices blockplane made that no volume of this service owns: marked
    /// devices of backends that report rather than remove them, and loop
    /// devices over files under an image root (another instance's mark, or
    /// none) that no live process holds locked. Only the first kind can be
    /// removed through the API.
    async fn orphans(&self) -> Result<Vec<model::Orphan>> {
        let known: std::collections::HashSet<_> =
            self.store.volumes().await?.iter().map(|v| v.id).collect();
        let mut out = Vec::new();
        for b in self
            .backends
            .iter()
            .filter(|b| b.orphan_policy() == crate::backend::OrphanPolicy::Report)
        {
            let b2 = b.clone();
            if let Ok(marked) = blocking(move || b2.marked()).await? {
                out.extend(
                    marked
                        .into_iter()
                        .filter(|m| !known.contains(&m.volume_id))
                        .map(|m| model::Orphan {
                            backend: b.kind(),
                            volume_id: Some(m.volume_id),
                            reason: format!(
                                "carries this service's mark of volume {}, which has no record",
                                m.volume_id
                            ),
                            device: m.device,
                            backing_file: None,
                            instance: Some(self.instance.clone()),
                            pid: None,
                            removable: true,
                        }),
                );
            }
        }
        let roots = self.roots.paths();
        let instance = self.instance.clone();
        let run_root = self.ublk_run_root.clone();
        let unowned =
            blocking(move || unowned_devices(&roots, &run_root, &instance, &known)).await?;
        out.extend(unowned);
        Ok(out)
    }

    /// `DELETE /v1/host/orphans/{volume_id}`: removes an orphan device on request.
    async fn delete_orphan(&self, volume_id: &str) -> Result<()> {
        let orphan = self
            .orphans()
            .await?
            .into_iter()
            .filter(|o| o.removable)
            .find(|o| {
                o.volume_id.is_some_and(|id| id.to_string() == volume_id) || o.device == volume_id
            })
            .ok_or_else(|| Error::OrphanNotFound(volume_id.to_string()))?;
        let b = self
            .backend(orphan.backend)
            .expect("orphans come from built backends");
        let id = orphan
            .volume_id
            .expect("removable orphans carry a volume id");
        blocking(move || b.detach(id, None)).await??;
        let mut tx = self.store.begin().await?;
        tx.event(
            Some(id),
            None,
            "orphan_removed",
            &format!(
                "removed {} on request: it carried the mark of volume {id}, which has no record",
                orphan.device
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Backends and policies, without the orphans (blocking: probes the kernel).
    fn capabilities(&self) -> Host {
        let backends = HostBackends {
            loop_: self.capability(Backend::Loop),
            ublk: self.capability(Backend::Ublk),
            dm: self.capability(Backend::Dm),
        };
        let needs = |which: &[&model::BackendCapability], what: &str| {
            if which.iter().any(|c| c.available) {
                Capability {
                    available: true,
                    reason: None,
                }
            } else {
                let why: Vec<String> = which.iter().filter_map(|c| c.reason.clone()).collect();
                Capability {
                    available: false,
                    reason: Some(format!("{what}: {}", why.join("; "))),
                }
            }
        };
        let policies = HostPolicies {
            nowait: needs(&[&backends.ublk], "needs backend ublk"),
            threaded: needs(&[&backends.ublk], "needs backend ublk"),
            direct: needs(&[&backends.ublk, &backends.dm], "needs backend ublk or dm"),
        };
        let default_backend = Backend::PREFERENCE
            .into_iter()
            .find(|k| self.capability(*k).available);
        Host {
            kernel: rustix::system::uname()
                .release()
                .to_string_lossy()
                .into_owned(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            backends,
            policies,
            image_roots: self.roots.paths(),
            image_root_capacity: Vec::new(),
            default_backend,
            orphans: Vec::new(),
        }
    }
}

fn not_built_reason(kind: Backend) -> String {
    match kind {
        Backend::Ublk if !std::path::Path::new("/dev/ublk-control").exists() => {
            "ublk_drv is not loaded (no /dev/ublk-control)".into()
        }
        Backend::Dm if !std::path::Path::new("/dev/mapper/control").exists() => {
            "device-mapper is not available (no /dev/mapper/control)".into()
        }
        other => format!("this build of blockplane has no {} backend", other.as_str()),
    }
}

/// Checks a user-chosen name against `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn validate_name(what: &'static str, name: &str) -> Result<()> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName {
            what,
            name: name.to_string(),
        })
    }
}

/// Runs blocking work (ioctls, file creation) off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task failed: {e}")))
}

impl Manager {
    /// `GET /metrics`: the exposition text.
    async fn metrics(&self) -> Result<String> {
        let latest = self.sampler.latest();
        let rows = self.store.volumes().await?;
        let mut states: Vec<(String, u64)> = [
            model::VolumeState::Attaching,
            model::VolumeState::Attached,
            model::VolumeState::Degraded,
            model::VolumeState::Detaching,
            model::VolumeState::Error,
        ]
        .iter()
        .map(|s| (s.as_str().to_string(), 0))
        .collect();
        let mut volumes = Vec::new();
        for v in &rows {
            if let Some(entry) = states.iter_mut().find(|(s, _)| s == v.state.as_str()) {
                entry.1 += 1;
            }
            if let Some(stats) = latest.get(&v.id) {
                volumes.push(crate::metrics::VolumeSample {
                    name: v.name.clone(),
                    backend: v.backend.as_str().to_string(),
                    dispatch: stats.dispatch.as_str().to_string(),
                    stats: stats.clone(),
                });
            }
        }
        let images = self
            .images()
            .await?
            .into_iter()
            .map(|i| crate::metrics::ImageSample {
                name: i.name,
                size_bytes: i.size_bytes,
                allocated_bytes: i.allocated_bytes,
            })
            .collect();
        Ok(crate::metrics::render(
            &self.api_metrics,
            crate::metrics::Snapshot {
                roots: self.root_usage().await?,
                volumes,
                images,
                states,
            },
        ))
    }

    /// The database (the server checkpoints it at stop).
    pub fn store(&self) -> &Store {
        &self.store
    }
}

/// Devices blockplane made that no volume of `instance` owns and that no
/// service removes: what a lost registry, or a blockplane stopped for good,
/// leaves behind. Loop devices (see [`unowned_loop_devices`]), ublk workers
/// whose run dir under `ublk_run_root` another instance (or none) marked, and
/// dm devices carrying another instance's uuid. `instance` empty: every one.
pub fn unowned_devices(
    roots: &[String],
    ublk_run_root: &std::path::Path,
    instance: &str,
    known: &std::collections::HashSet<Uuid>,
) -> Vec<model::Orphan> {
    let lost = "its registry was lost or replaced";
    let mut out = unowned_loop_devices(roots, instance, known);
    out.extend(
        crate::backend::ublk::foreign_workers(ublk_run_root, instance)
            .into_iter()
            .filter(|w| !known.contains(&w.volume_id))
            .map(|w| model::Orphan {
                backend: Backend::Ublk,
                volume_id: Some(w.volume_id),
                device: w.device.unwrap_or_else(|| "(no device)".into()),
                backing_file: w.image_path,
                reason: match &w.instance {
                    Some(i) => format!(
                        "its worker's run dir names blockplane instance {i} (volume {}), not this one: {lost}",
                        w.volume_id
                    ),
                    None => format!(
                        "its worker's run dir (volume {}) names no instance and no volume owns it: {lost}",
                        w.volume_id
                    ),
                },
                instance: w.instance,
                pid: w.pid,
                removable: false,
            }),
    );
    match crate::backend::dm::foreign_devices(instance) {
        Ok(found) => out.extend(found.into_iter().map(|d| model::Orphan {
            backend: Backend::Dm,
            volume_id: Some(d.volume_id),
            reason: format!(
                "dm device {} carries the DM uuid of blockplane instance {} (volume {}), not this one's: {lost}",
                d.name, d.instance, d.volume_id
            ),
            device: d.device,
            backing_file: None,
            instance: Some(d.instance),
            pid: None,
            removable: false,
        })),
        Err(e) => tracing::warn!(error = %e, "cannot scan dm devices for orphans"),
    }
    out
}

/// Loop devices over files under `roots` that are neither a volume of
/// `instance` nor served by a live process holding the image's lock.
fn unowned_loop_devices(
    roots: &[String],
    instance: &str,
    known: &std::collections::HashSet<Uuid>,
) -> Vec<model::Orphan> {
    let found = match crate::backend::loopdev::bound_under(roots) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(error = %e, "cannot scan loop devices for orphans");
            return Vec::new();
        }
    };
    found
        .into_iter()
        .filter(|d| {
            !matches!(&d.mark, Some((i, id)) if i == instance && known.contains(id))
                && holds::held_elsewhere(std::path::Path::new(&d.backing_file)).is_none()
        })
        .map(|d| {
            let reason = match &d.mark {
                Some((i, id)) if i == instance => format!(
                    "carries this service's mark of volume {id}, which has no record"
                ),
                Some((i, id)) => format!(
                    "carries the mark of blockplane instance {i} (volume {id}), not this one's ({instance}), and no live process holds its image: its registry was lost or replaced"
                ),
                None => "its backing file is under an image root but it carries no blockplane mark and no live process holds the file".to_string(),
            };
            model::Orphan {
                backend: Backend::Loop,
                volume_id: d.mark.as_ref().map(|(_, id)| *id),
                device: d.device,
                backing_file: Some(d.backing_file),
                instance: d.mark.map(|(i, _)| i),
                pid: None,
                removable: false,
                reason,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "0", "vol-1", "a.b_c-d", &"a".repeat(63)] {
            validate_name("volume", ok).unwrap();
        }
        for bad in [
            "",
            "-a",
            ".a",
            "A",
            "a/b",
            "a b",
            "é",
            &"a".repeat(64),
            "_x",
        ] {
            assert!(validate_name("volume", bad).is_err(), "{bad}");
        }
    }
}
