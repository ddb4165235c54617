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
        self.house.reserve.take();
        self.house
            .store
            .check_writable()
            .await
            .map_err(super::error::Error::StoreUnwritable)
    }

    /// What this host can run, and the devices of this instance no volume owns.
    pub(crate) async fn host(self: &Arc<Self>) -> Result<Host> {
        let me = self.clone();
        let mut host = blocking(move || me.capabilities()).await?;
        host.orphans = self.orphans().list().await?;
        host.image_root_capacity = self.images.root_usage().await?;
        Ok(host)
    }

    /// Backends and policies, without the orphans (blocking: probes the kernel).
    fn capabilities(&self) -> Host {
        let backends = HostBackends {
            loop_: self.house.capability(Backend::Loop),
            ublk: self.house.capability(Backend::Ublk),
            dm: self.house.capability(Backend::Dm),
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
            .find(|k| self.house.capability(*k).available);
        Host {
            kernel: rustix::system::uname()
                .release()
                .to_string_lossy()
                .into_owned(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            build: service_build(),
            backends,
            policies,
            image_roots: self.house.roots.paths(),
            image_root_capacity: Vec::new(),
            default_backend,
            orphans: Vec::new(),
            backup_target: self
                .backups
                .state
                .target
                .as_ref()
                .map(|t| t.describe().to_string()),
            supervision: self
                .house
                .backend(Backend::Ublk)
                .and_then(|b| b.supervision())
                .map(|s| supervision(&s)),
            reconciled: self.volumes.recovering.finished(),
            recovering_volumes: self.volumes.recovering.count(),
            fabric: Some(self.fabric()),
        }
    }

    /// This host as an NVMe/TCP party (blocking: may load the kernel's
    /// modules).
    fn fabric(&self) -> model::Fabric {
        let capability = |r: std::result::Result<(), String>| match r {
            Ok(()) => Capability {
                available: true,
                reason: None,
            },
            Err(why) => Capability {
                available: false,
                reason: Some(why),
            },
        };
        let addresses = self.exports.addresses();
        let target = match addresses.is_empty() {
            true => Err("no export address (--export-address)".to_string()),
            false => blockplane_system::nvmet::Target::open()
                .map(drop)
                .map_err(|e| e.to_string()),
        };
        model::Fabric {
            host_nqn: self.remotes.host_nqn().to_string(),
            export_addresses: addresses,
            target: capability(target),
            initiator: capability(
                blockplane_system::fabrics::available().map_err(|e| e.to_string()),
            ),
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
