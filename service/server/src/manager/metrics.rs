//! `GET /metrics`: the registry's and the sampler's view of the volumes,
//! images and image roots, rendered by `crate::metrics`.

use std::sync::atomic::Ordering::Relaxed;

use super::Manager;
use super::error::Result;
use crate::store::VolumeRow;
use blockplane_api::model;

impl Manager {
    /// Counts one answered API request (for `GET /metrics`).
    pub(crate) fn record_request(
        &self,
        labels: crate::metrics::ApiLabels,
        took: std::time::Duration,
    ) {
        self.volumes.api.requests.record(labels, took);
    }

    /// `GET /metrics`: the exposition text; each volume's latency buckets
    /// only with `volume_histograms`.
    pub(crate) async fn metrics(&self, volume_histograms: bool) -> Result<String> {
        let (readings, backups) = (&self.volumes.readings, &self.backups.state);
        let latest = readings.stats.latest();
        let rows = self.house.store.volumes().await?;
        let caches = readings.page_caches(&self.house.store, &rows).await?;
        let mut volumes = Vec::new();
        let mut workers = Vec::new();
        for v in &rows {
            if let (Some(version), Some(older)) = self.house.worker_build(v) {
                workers.push(crate::metrics::WorkerSample {
                    volume: v.name.clone(),
                    backend: v.backend.as_str().to_string(),
                    version,
                    older,
                });
            }
            if let Some(stats) = latest.get(&v.id) {
                volumes.push(crate::metrics::VolumeSample {
                    name: v.name.clone(),
                    backend: v.backend.as_str().to_string(),
                    dispatch: stats.dispatch.as_str().to_string(),
                    stats: stats.clone(),
                    page_cache: caches.get(&v.id).copied(),
                    page_cache_warned: !readings.page_cache.warnings(v.id).is_empty(),
                    encrypted: v.crypt.is_some(),
                });
            }
        }
        let (export_states, export_hosts_connected) = self.export_samples().await?;
        let remotes = self.remotes.list().await?;
        let images = self.images.list().await?;
        let ages = self
            .backups
            .backup_ages(images.iter().map(|i| (i.id, i.name.as_str())));
        let standbys = super::standbys::standby_samples(&images);
        let schedules = match backups.target {
            Some(_) => self.backups.schedule_samples().await?,
            None => Vec::new(),
        };
        let images = images
            .into_iter()
            .map(|i| crate::metrics::ImageSample {
                name: i.name,
                size_bytes: i.size_bytes,
                allocated_bytes: i.allocated_bytes,
            })
            .collect();
        Ok(crate::metrics::render(
            &self.volumes.api.requests,
            crate::metrics::Snapshot {
                roots: self.images.root_usage().await?,
                build: blockplane_system::build::current().to_string(),
                workers,
                volumes,
                images,
                states: state_counts(&rows),
                export_states,
                export_hosts_connected,
                remote_states: counts(
                    &[
                        model::RemoteState::Connecting,
                        model::RemoteState::Attached,
                        model::RemoteState::Reconnecting,
                        model::RemoteState::Error,
                        model::RemoteState::Moved,
                    ],
                    remotes.iter().map(|r| r.state),
                    model::RemoteState::as_str,
                ),
                supervisor: self.supervisor_sample(),
                volume_histograms,
                backups: backups
                    .target
                    .as_ref()
                    .map(|_| crate::metrics::BackupSample {
                        ages,
                        schedules,
                        standbys,
                        uploaded_bytes: backups.uploaded_bytes.load(Relaxed),
                        deduplicated_bytes: backups.deduplicated_bytes.load(Relaxed),
                    }),
            },
        ))
    }

    /// Exports per state, and the hosts connected to each export whose
    /// connected hosts the kernel says.
    async fn export_samples(&self) -> Result<(Vec<(String, u64)>, Vec<(String, u64)>)> {
        // Listing exports opens the kernel's target, which loads nvmet where
        // it is not loaded: a service that exports nothing leaves the
        // kernel alone at every scrape.
        let exports = if self.house.store.exports().await?.is_empty() {
            Vec::new()
        } else {
            self.exports.list().await?
        };
        let states = counts(
            &[
                model::ExportState::Serving,
                model::ExportState::Waiting,
                model::ExportState::Error,
            ],
            exports.iter().map(|e| e.state),
            model::ExportState::as_str,
        );
        let connected = exports
            .iter()
            // An export without authentication lists no hosts: who is
            // connected to it is not in its answer.
            .filter(|e| !e.hosts.is_empty())
            .filter_map(|e| {
                let known: Option<Vec<bool>> = e.hosts.iter().map(|h| h.connected).collect();
                known.map(|k| {
                    (
                        e.volume_name.clone(),
                        k.iter().filter(|c| **c).count() as u64,
                    )
                })
            })
            .collect();
        Ok((states, connected))
    }

    /// The ublk supervisor's state, where this host has one.
    fn supervisor_sample(&self) -> Option<crate::metrics::SupervisorSample> {
        let s = self
            .house
            .backend(model::Backend::Ublk)
            .and_then(|b| b.supervision())?;
        Some(crate::metrics::SupervisorSample {
            running: matches!(s.state, crate::backend::SupervisorState::Running { .. }),
            restarts: s.restarts,
            unsupervised: s.unsupervised,
        })
    }
}

/// How many of `have` are in each state of `all`, every state named (zero
/// included), so that a state's series never goes missing.
fn counts<S: Copy + PartialEq>(
    all: &[S],
    have: impl Iterator<Item = S> + Clone,
    name: fn(S) -> &'static str,
) -> Vec<(String, u64)> {
    all.iter()
        .map(|s| {
            let n = have.clone().filter(|h| h == s).count();
            (name(*s).to_string(), n as u64)
        })
        .collect()
}

/// How many volumes are in each state, every state named (zero included).
fn state_counts(rows: &[VolumeRow]) -> Vec<(String, u64)> {
    counts(
        &[
            model::VolumeState::Attaching,
            model::VolumeState::Attached,
            model::VolumeState::Degraded,
            model::VolumeState::Detaching,
            model::VolumeState::Error,
        ],
        rows.iter().map(|v| v.state),
        model::VolumeState::as_str,
    )
}
