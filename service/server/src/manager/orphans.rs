//! Orphan devices: devices blockplane made that no volume of this service
//! owns, found for `GET /v1/host`, at start, and before a new registry is
//! accepted; the removable ones removed on request.

use uuid::Uuid;

use super::Manager;
use super::blocking::blocking;
use super::error::{Error, Result};
use super::holds;
use super::house::House;
use blockplane_api::model::{self, Backend};

/// The orphans' keeper: it reads the house and nothing else of the manager
/// ([`Manager::orphans`]).
pub struct Orphans<'a> {
    house: &'a House,
}

impl Manager {
    /// The devices blockplane made that no volume of this service owns.
    pub fn orphans(&self) -> Orphans<'_> {
        Orphans { house: &self.house }
    }
}

impl Orphans<'_> {
    /// Devices blockplane made that no volume of this service owns: marked
    /// devices of backends that report rather than remove them, and loop
    /// devices over files under an image root (another instance's mark, or
    /// none) that no live process holds locked. Only the first kind can be
    /// removed through the API.
    pub(super) async fn list(&self) -> Result<Vec<model::Orphan>> {
        let known: std::collections::HashSet<_> = self
            .house
            .store
            .volumes()
            .await?
            .iter()
            .map(|v| v.id)
            .collect();
        let mut out = Vec::new();
        for b in self
            .house
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
                            instance: Some(self.house.settings.instance.clone()),
                            pid: None,
                            removable: true,
                        }),
                );
            }
        }
        let roots = self.house.roots.paths();
        let instance = self.house.settings.instance.clone();
        let run_root = self.house.settings.ublk_run_root.clone();
        let unowned =
            blocking(move || unowned_devices(&roots, &run_root, &instance, &known)).await?;
        out.extend(unowned);
        Ok(out)
    }

    /// `DELETE /v1/host/orphans/{volume_id}`: removes an orphan device on request.
    pub(crate) async fn delete(&self, volume_id: &str) -> Result<()> {
        let orphan = self
            .list()
            .await?
            .into_iter()
            .filter(|o| o.removable)
            .find(|o| {
                o.volume_id.is_some_and(|id| id.to_string() == volume_id) || o.device == volume_id
            })
            .ok_or_else(|| Error::OrphanNotFound(volume_id.to_string()))?;
        let b = self
            .house
            .backend(orphan.backend)
            .expect("orphans come from built backends");
        let id = orphan
            .volume_id
            .expect("removable orphans carry a volume id");
        blocking(move || b.detach(id, None)).await??;
        let mut tx = self.house.store.begin().await?;
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
}

/// Devices blockplane made that no volume of `instance` owns and that no
/// service removes: what a lost registry, or a blockplane stopped for good,
/// leaves behind. Loop devices (see [`unowned_loop_devices`]), ublk workers
/// whose run dir under `ublk_run_root` another instance (or none) marked, and
/// dm devices carrying the uuid of another instance that no live service
/// holds ([`crate::liveness`]). `instance` empty: every one.
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
        Ok(found) => out.extend(found.into_iter().filter(|d| !crate::liveness::is_live(&d.instance)).map(|d| model::Orphan {
            backend: Backend::Dm,
            volume_id: Some(d.volume_id),
            reason: format!(
                "dm device {} carries the DM uuid of blockplane instance {} (volume {}), not this one's, and no live service is that instance: {lost}",
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
