//! A dm device a restarted service finds: known again by its table (a
//! direct map checked against the image, a private loop device, or a
//! private worker adopted or started again), or removed when unloaded.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use time::OffsetDateTime;
use uuid::Uuid;

use super::ioctl::{self, dm_name, kernel_name};
use super::table::{direct_table, over};
use super::{DmBackend, DmVolume, Under, Watch};
use crate::backend::loopdev::PrivateLoop;
use crate::backend::{BackendError, BackendEvent, Probe, ProbeRequest, VolumeParams};
use blockplane_api::model::{ActiveDispatch, DispatchPolicy};
use blockplane_system::dispatch::{self, Reason};
use blockplane_system::extent::{self, DevNum, ExtentMap, Pin};

impl DmBackend {
    /// Removes the device an attach created and died before loading a table
    /// into (it serves nothing), and what that attach had made before: the
    /// private worker, or the image's pin. A writable volume's image pinned
    /// is this service's pin (rule 3 maps no image its owner made
    /// immutable); a read-only one's may be the owner's, and stays.
    pub(super) fn remove_unloaded(
        &self,
        volume_id: Uuid,
        params: &VolumeParams,
        image: OwnedFd,
    ) -> Result<(), BackendError> {
        tracing::warn!(%volume_id, "removing a dm device whose attach never loaded its table");
        ioctl::remove(volume_id)?;
        let _ = self.ublk.stop(volume_id);
        if !params.read_only && extent::is_immutable(image.as_fd()).unwrap_or(false) {
            let ours = Pin {
                was_immutable: false,
            };
            extent::unpin(image.as_fd(), ours)
                .map_err(|e| BackendError::io("unpin", params.image_path.clone(), e))?;
        }
        Ok(())
    }

    /// Serves a dm volume's private ublk device again after its worker died
    /// while no service ran (a pod or a cgroup killed whole): the device
    /// waits quiesced, its I/O held, and a new worker recovers it (the ublk
    /// backend finds it in the volume's run dir). The table, over `target`
    /// (its `major:minor offset`), stays; only if the recovered device is
    /// another one is it loaded over that one.
    pub(super) fn recover_private(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        target: &str,
        policy: DispatchPolicy,
    ) -> Result<(), BackendError> {
        let reason = v.reason.clone();
        let dev = self
            .start_lower(volume_id, v, &v.image, policy, &reason)?
            .dev;
        if target.split_whitespace().next() != Some(dev.to_string().as_str()) {
            let table = over(dev, v.params.size_bytes);
            v.table = match self.reload(volume_id, v.read_only, table) {
                Ok(t) => t,
                Err(e) => {
                    let _ = self.ublk.stop(volume_id);
                    return Err(e);
                }
            };
        }
        v.dispatch = policy;
        v.under.ublk = Some(dev);
        self.events.send(BackendEvent {
            volume_id,
            kind: "worker_restarted",
            message: format!(
                "its private ublk worker was gone at start; a new worker serves /dev/{} again",
                kernel_name(dev)
            ),
            attachment: None,
            state: None,
        });
        Ok(())
    }

    /// A device a restarted service finds for volume `req`, known again
    /// ([`Probe::Alive`]) or gone: no device, or an unloaded one, removed.
    pub(super) fn adopt(&self, mut req: ProbeRequest) -> Result<Probe, BackendError> {
        let volume_id = req.volume_id;
        if ioctl::devnum(volume_id).is_none() {
            // Maybe a private worker outlived its dm device: let it go.
            let _ = self.ublk.stop(volume_id);
            return Ok(Probe::Gone);
        }
        let Some(image) = req.image.take() else {
            return Err(BackendError::Busy {
                device: dm_name(volume_id),
                reason: "its image cannot be opened, so the map cannot be checked".into(),
            });
        };
        let (read_only, live) = ioctl::live_table(volume_id)?;
        if live.is_empty() {
            self.remove_unloaded(volume_id, &req.params, image)?;
            return Ok(Probe::Gone);
        }
        let mut v = found(&mut req, image, read_only, &live);
        match &live[..] {
            [(_, _, _, target)] if let Some(lo) = self.private_loop_of(volume_id, target) => {
                // Kernel: the loop device, bound to the image, carries the
                // volume's mark; it needs nothing but to be known again.
                v.dispatch = DispatchPolicy::Kernel;
                v.under.loop_dev = Some(lo);
            }
            [(_, _, _, target)] if is_ublk(target) => self.adopt_worker(&req, &mut v, target)?,
            _ => adopt_direct(&req, &mut v, &live)?,
        }
        Ok(Probe::Alive(Box::new(self.register(volume_id, v)?)))
    }

    /// The private loop device a one-target table over `target` names, if
    /// it is this volume's.
    fn private_loop_of(&self, volume_id: Uuid, target: &str) -> Option<PrivateLoop> {
        let dev = target.split_whitespace().next()?;
        PrivateLoop::find(&self.instance, volume_id, dev)
    }

    /// Nowait or threaded: the private worker adopted, or started again
    /// when it is gone.
    fn adopt_worker(
        &self,
        req: &ProbeRequest,
        v: &mut DmVolume,
        target: &str,
    ) -> Result<(), BackendError> {
        let volume_id = req.volume_id;
        let probe = self.ublk.adopt(ProbeRequest {
            volume_id,
            identity: req.identity,
            image: v.image.try_clone().ok(),
            params: req.params.clone(),
            stored: None,
            image_lock: v.lock.as_ref().and_then(|l| l.try_clone().ok()),
        })?;
        match probe {
            Probe::Alive(worker) => {
                v.dispatch = dispatch::policy_of(worker.dispatch);
                // The worker's, which a crash mid-change may leave newer
                // than the stored one (the QoS move reads it).
                v.reason = worker.dispatch_reason.clone();
                v.under.ublk = Some(DevNum {
                    major: worker.major,
                    minor: worker.minor,
                });
                // The worker's lock, if it kept one through a service crash.
                if v.lock.is_none() {
                    v.lock = self.ublk.held_lock(volume_id);
                }
            }
            Probe::Gone => {
                let policy = match req.stored.as_ref().map(|a| a.dispatch) {
                    Some(ActiveDispatch::Threaded) => DispatchPolicy::Threaded,
                    _ => DispatchPolicy::Nowait,
                };
                self.recover_private(volume_id, v, target, policy)
                    .map_err(|e| BackendError::Busy {
                        device: dm_name(volume_id),
                        reason: format!(
                            "its private ublk worker is gone and a new one could not serve its device: {e}"
                        ),
                    })?;
            }
        }
        Ok(())
    }
}

/// The volume as its live table and its record say, before its path is
/// known: the size its table covers (the image's row may be older: the
/// service died in a resize between growing the device and recording it),
/// and a resize still to apply when the image is larger than its device
/// (the private device cannot grow without UPDATE_SIZE, or the service died
/// before recording it).
fn found(
    req: &mut ProbeRequest,
    image: OwnedFd,
    read_only: bool,
    live: &[(u64, u64, String, String)],
) -> DmVolume {
    let stored = req.stored.as_ref();
    let mut params = req.params.clone();
    params.size_bytes = live.iter().map(|t| t.1).sum::<u64>() * 512;
    let grown = rustix::fs::fstat(&image).is_ok_and(|st| st.st_size as u64 > params.size_bytes);
    DmVolume {
        image,
        lock: req.image_lock.take(),
        params,
        dispatch: req.params.dispatch,
        reason: stored.map_or_else(
            || Reason::Words {
                words: String::new(),
            },
            |a| a.dispatch_reason.clone(),
        ),
        read_only,
        under: Under::default(),
        table: live.to_vec(),
        resize_pending: grown || stored.is_some_and(|a| a.resize_pending),
        watch: Watch {
            attached_at: stored.map_or_else(OffsetDateTime::now_utc, |a| a.attached_at),
            baseline: stored.and_then(|a| a.baseline),
            stop_checks: Arc::default(),
            degraded: stored.and_then(|a| a.dm()).and_then(|d| d.degraded.clone()),
        },
        copying: None,
    }
}

/// Whether a table's target is a ublk device (the private worker's).
fn is_ublk(target: &str) -> bool {
    target.split_whitespace().next().is_some_and(|d| {
        std::fs::read_link(format!("/sys/dev/block/{d}")).is_ok_and(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("ublkb"))
        })
    })
}

/// Direct: the live table must be the image's map as it is now.
fn adopt_direct(
    req: &ProbeRequest,
    v: &mut DmVolume,
    live: &[(u64, u64, String, String)],
) -> Result<(), BackendError> {
    let map = ExtentMap::build(v.image.as_fd(), v.params.size_bytes).map_err(|e| {
        BackendError::Refused {
            reason: e.to_string(),
        }
    })?;
    if direct_table(&map) != live {
        return Err(BackendError::Busy {
            device: dm_name(req.volume_id),
            reason: "its table no longer matches the image's extents (rule 5); delete and re-create the volume".into(),
        });
    }
    let pin = req
        .stored
        .as_ref()
        .and_then(|a| a.dm())
        .and_then(|d| d.pinned)
        .unwrap_or(Pin {
            was_immutable: false,
        });
    v.dispatch = DispatchPolicy::Direct;
    v.under.direct = Some((map, pin));
    Ok(())
}
