//! `GET /v1/host`: what this host can run (its backends and dispatch
//! policies), its image roots' capacity and the orphan devices.

use std::sync::Arc;

use super::Manager;
use super::blocking::blocking;
use super::error::Result;
use crate::backend::{SupervisorState, SupervisorStatus};
use blockplane_api::model::{
    self, Backend, Capability, Host, HostBackends, HostPolicies, ServiceBuild,
};
use blockplane_system::build;

impl Manager {
    /// `GET /healthz`: refused when the registry cannot be written (the
    /// space held in reserve is given back first, so a full disk can still
    /// take the answer's record).
    pub(crate) async fn check_writable(&self) -> Result<()> {
        self.reserve.take();
        self.store
            .check_writable()
            .await
            .map_err(super::error::Error::StoreUnwritable)
    }

    /// Availability of a backend, including ones this build does not carry yet.
    pub(super) fn capability(&self, kind: Backend) -> model::BackendCapability {
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
    pub(crate) async fn host(self: &Arc<Self>) -> Result<Host> {
        let me = self.clone();
        let mut host = blocking(move || me.capabilities()).await?;
        host.orphans = self.orphans().await?;
        host.image_root_capacity = self.root_usage().await?;
        Ok(host)
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
            build: service_build(),
            backends,
            policies,
            image_roots: self.roots.paths(),
            image_root_capacity: Vec::new(),
            default_backend,
            orphans: Vec::new(),
            backup_target: self
                .backups
                .target
                .as_ref()
                .map(|t| t.describe().to_string()),
            supervision: self
                .backend(Backend::Ublk)
                .and_then(|b| b.supervision())
                .map(|s| supervision(&s)),
            reconciled: self.recovering.finished(),
            recovering_volumes: self.recovering.count(),
        }
    }
}

/// The API's view of the worker supervisor's status.
pub(super) fn supervision(s: &SupervisorStatus) -> model::Supervision {
    let (state, since, reason) = match &s.state {
        SupervisorState::Starting { since } => (model::SupervisionState::Starting, since, None),
        SupervisorState::Running { since } => (model::SupervisionState::Running, since, None),
        SupervisorState::Restarting { since, reason } => (
            model::SupervisionState::Restarting,
            since,
            Some(reason.to_string()),
        ),
    };
    model::Supervision {
        state,
        reason,
        since: time::OffsetDateTime::from(*since),
        restarts: s.restarts,
        unsupervised_workers: s.unsupervised,
    }
}

/// The build this process runs, and the one at the path it started from.
fn service_build() -> ServiceBuild {
    let version = build::current().to_string();
    // After a package replaced the file, the link names the path it had,
    // marked deleted.
    let link = std::fs::read_link("/proc/self/exe").unwrap_or_default();
    let link = link.to_string_lossy();
    let path = link.strip_suffix(" (deleted)").unwrap_or(&link).to_string();
    let at_path = build::of_file(std::path::Path::new(&path)).ok();
    ServiceBuild {
        executable_replaced: at_path.as_deref() != Some(version.as_str()),
        executable: path,
        executable_version: at_path,
        version,
    }
}

/// Why a backend this manager lacks is unavailable.
pub(super) fn not_built_reason(kind: Backend) -> String {
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
