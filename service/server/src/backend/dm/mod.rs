//! The `dm` backend: a device-mapper device whose node never changes while
//! its table decides the data path.
//!
//! * `direct`: `linear` targets built from the image's extent map, so the
//!   kernel remaps every bio straight to the disk (no userspace on the data
//!   path), under the direct-map rules: the image is pinned while mapped and
//!   its map is re-read periodically (rule 5): on drift the device is
//!   suspended and resumed on the `nowait` path at once.
//! * `kernel`: one `linear` target over a private loop device with direct
//!   I/O (kernel only, like `direct`, for an image that cannot be mapped:
//!   what `auto` takes for a sparse image).
//! * `nowait` / `threaded`: one `linear` target over a private ublk device
//!   served by a blockplane worker with that policy.
//!
//! Switching is suspend, load, resume (starting or stopping the private loop
//! device or ublk worker around it). Names derive from the volume id (`blockplane-<uuid>`),
//! the DM uuid also names this service instance, so a restart finds its
//! devices and never mistakes another instance's for its own. DM ioctls go
//! through the `devicemapper` crate; nothing depends on udev.

mod ioctl;
mod table;

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use super::loopdev::{self, PrivateLoop};
use super::{
    AllocateJob, AttachRequest, Attachment, BackendError, BackendEvent, Change, Decision,
    DeviceState, DmAttachment, EventSink, HandedOver, Marked, MomentCopy, OrphanPolicy,
    PrivateDevices, Probe, ProbeRequest, SnapshotDest, SpecCheck, VolumeBackend, VolumeParams,
    WorkerInfo,
};
use crate::backend::wire;
use crate::fault::{After, Faults, HandoverFaults};
use blockplane_api::model::{
    ActiveDispatch, Allocation, Backend, BackendCapability, DispatchPolicy, Qos, VolumeState,
    VolumeStats,
};
use blockplane_protocol::{CANNOT_FILL_READ_ONLY, Request};
use blockplane_system::blockstat::BlockStat;
use blockplane_system::dispatch::{self, Ask, Reason, Running};
use blockplane_system::extent::{self, DevNum, ExtentMap, Pin};
pub use ioctl::foreign_devices;
use ioctl::{blockplane_devices, dm_name, dm_uuid, kernel_name, volume_of_name};
pub use table::Target;
use table::{direct_table, over};

/// What the dm backend keeps per volume.
struct DmVolume {
    /// A handle on the image: to map, pin, unpin and grow it.
    image: OwnedFd,
    /// A duplicate of the image lock, for each private worker: the same open
    /// file description as the manager's, so the worker's lock is that one,
    /// not a second that would conflict with it.
    lock: Option<OwnedFd>,
    params: VolumeParams,
    /// The path in force (never `Auto`).
    dispatch: DispatchPolicy,
    reason: Reason,
    read_only: bool,
    /// The map and pin while `direct`.
    direct: Option<(ExtentMap, Pin)>,
    /// The private ublk device while `nowait`/`threaded`.
    private_ublk: Option<DevNum>,
    /// The private loop device while `kernel`.
    private_loop: Option<PrivateLoop>,
    table: Vec<Target>,
    degraded: Option<String>,
    /// The image grew but the private ublk device could not (no UPDATE_SIZE).
    resize_pending: bool,
    attached_at: OffsetDateTime,
    baseline: Option<BlockStat>,
    stop_checks: Arc<AtomicBool>,
    /// A copy of one moment runs on the private worker: the volume stays on
    /// it until the copy ends (`Some`), and goes back to `kernel` then
    /// with this reason when it was there before (`Some(Some(_))`).
    copying: Option<Option<Reason>>,
}

/// Why a dm volume keeps its path while a copy of one moment runs.
const COPY_HOLDS_PATH: &str = "a snapshot's copy of one moment runs on this volume's private worker, whose writes keep the moment's chunks: a change of path waits for the copy's end (GET /v1/images shows its progress)";

/// What serves a volume off `direct`, just started: its number (the table's
/// target) and, for `kernel`, the loop device with the handle that keeps it
/// bound until a table holds it.
struct Lower {
    dev: DevNum,
    private_loop: Option<(PrivateLoop, std::fs::File)>,
}

/// What a decision for volume `v` is asked: `policy`, served on `path`.
fn ask<'a>(v: &'a DmVolume, policy: DispatchPolicy, path: &'a dispatch::Path) -> Ask<'a> {
    Ask {
        image: v.image.as_fd(),
        size: v.params.size_bytes,
        policy,
        refuse_writes: v.read_only,
        path,
    }
}

/// A QoS limit refused live, in the answer's terms.
fn qos_not_live(e: dispatch::DispatchError) -> BackendError {
    let (dispatch::DispatchError::Refused(reason)
    | dispatch::DispatchError::NeedsUblk(reason)
    | dispatch::DispatchError::LimitNeedsWorker(reason)) = e;
    BackendError::NotLive {
        backend: "dm",
        field: "qos",
        reason,
    }
}

/// The dm backend.
pub struct DmBackend {
    instance: String,
    ublk: Arc<dyn PrivateDevices>,
    volumes: Arc<Mutex<HashMap<Uuid, DmVolume>>>,
    events: EventSink,
    check_secs: u32,
    faults: Faults,
}

impl DmBackend {
    /// A dm backend for this instance, with `ublk` serving its private
    /// devices (`faults`: the test faults inside its attach).
    pub fn new(
        instance: String,
        ublk: Arc<dyn PrivateDevices>,
        events: EventSink,
        check_secs: u32,
        faults: Faults,
    ) -> Self {
        Self {
            instance,
            ublk,
            volumes: Arc::default(),
            events,
            check_secs,
            faults,
        }
    }
    /// The dispatch decision's view of this backend.
    fn path(&self) -> dispatch::Path {
        dispatch::Path::Dm {
            ublk_missing: self.ublk.missing(),
            loop_missing: loopdev::unavailable(),
        }
    }

    /// Starts what serves `policy` off `direct` for a volume, over `image`
    /// (a handle on the volume's): its private loop device for `kernel`, its
    /// private worker otherwise. Nothing reaches it until a table names it.
    fn start_lower(
        &self,
        volume_id: Uuid,
        v: &DmVolume,
        image: &OwnedFd,
        policy: DispatchPolicy,
        reason: &Reason,
    ) -> Result<Lower, BackendError> {
        if policy != DispatchPolicy::Kernel {
            let image = image
                .try_clone()
                .map_err(|e| BackendError::io("dup", "image", e))?;
            let image_lock = match &v.lock {
                Some(l) => Some(
                    l.try_clone()
                        .map_err(|e| BackendError::io("dup", "image lock", e))?,
                ),
                None => None,
            };
            let att = self.ublk.start(AttachRequest {
                volume_id,
                image_fd: image,
                image_lock,
                params: VolumeParams {
                    dispatch: policy,
                    refuse_writes: v.read_only,
                    ..v.params.clone()
                },
                decision: Some(Decision::new(policy, reason.clone())),
            })?;
            return Ok(Lower {
                dev: DevNum {
                    major: att.major,
                    minor: att.minor,
                },
                private_loop: None,
            });
        }
        extent::drop_page_cache(image.as_fd())
            .map_err(|e| BackendError::io("drop page cache", "image", e))?;
        let (lo, handle) = PrivateLoop::bind(
            &self.instance,
            volume_id,
            image,
            v.params.size_bytes,
            v.read_only,
        )?;
        Ok(Lower {
            dev: lo.dev,
            private_loop: Some((lo, handle)),
        })
    }

    /// Records `lower` as what serves the volume, now that its table is
    /// loaded (dm holds the loop device: its handle can go).
    fn keep_lower(v: &mut DmVolume, lower: Lower) {
        match lower.private_loop {
            Some((lo, handle)) => {
                drop(handle);
                v.private_loop = Some(lo);
                v.private_ublk = None;
            }
            None => {
                v.private_ublk = Some(lower.dev);
                v.private_loop = None;
            }
        }
    }

    /// Undoes a lower started for a table that never loaded.
    fn undo_lower(&self, volume_id: Uuid, lower: Lower) {
        match lower.private_loop {
            // Its handle was its only opener: closing it unbinds it.
            Some((lo, handle)) => {
                drop(handle);
                lo.release();
            }
            None => drop(self.ublk.stop(volume_id)),
        }
    }

    /// Lets go of the lower the loaded table no longer names.
    fn stop_lower(
        &self,
        volume_id: Uuid,
        ublk: Option<DevNum>,
        lo: Option<PrivateLoop>,
    ) -> Result<(), BackendError> {
        if let Some(lo) = lo {
            lo.release();
        }
        if ublk.is_some() {
            self.ublk.stop(volume_id)?;
        }
        Ok(())
    }
    fn describe(&self, volume_id: Uuid, v: &DmVolume) -> Result<Attachment, BackendError> {
        let dev = ioctl::devnum(volume_id).ok_or_else(|| {
            BackendError::io(
                "find",
                dm_name(volume_id),
                io::Error::from_raw_os_error(libc::ENXIO),
            )
        })?;
        let kernel_name = kernel_name(dev);
        // /dev/mapper/<name> only exists where udev (or someone) made it.
        let mapper = format!("/dev/mapper/{}", dm_name(volume_id));
        let device = if Path::new(&mapper).exists() {
            mapper
        } else {
            format!("/dev/{kernel_name}")
        };
        let size_bytes = std::fs::read_to_string(format!("/sys/block/{kernel_name}/size"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(|s| s * 512)
            .unwrap_or(v.params.size_bytes);
        Ok(Attachment {
            device,
            kernel_name,
            major: dev.major,
            minor: dev.minor,
            dispatch: dispatch::active_of(v.dispatch).unwrap_or(ActiveDispatch::Nowait),
            dispatch_reason: v.reason.clone(),
            size_bytes,
            read_only: v.read_only,
            attached_at: v.attached_at,
            baseline: v.baseline,
            kind: DeviceState::Dm(DmAttachment {
                name: dm_name(volume_id),
                uuid: dm_uuid(&self.instance, volume_id),
                table: v.table.clone(),
                pinned: v.direct.as_ref().map(|(_, p)| *p),
                private_ublk: v.private_ublk.map(|d| d.to_string()),
                degraded: v.degraded.clone(),
            }),
            resize_pending: v.resize_pending,
        })
    }

    /// Removes the device an attach created and died before loading a table
    /// into (it serves nothing), and what that attach had made before: the
    /// private worker, or the image's pin. A writable volume's image pinned
    /// is this service's pin (rule 3 maps no image its owner made
    /// immutable); a read-only one's may be the owner's, and stays.
    fn remove_unloaded(
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
    fn recover_private(
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
        v.private_ublk = Some(dev);
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

    /// Puts a volume on its private worker for a snapshot, whose I/O only a
    /// worker can hold (the loop driver cannot hold still); the reason to
    /// go back to `kernel` with after it, when it was there.
    fn onto_worker(&self, volume_id: Uuid) -> Result<Option<Reason>, BackendError> {
        self.with_volume(volume_id, |v| match v.dispatch {
            DispatchPolicy::Direct => Err(BackendError::Refused {
                reason: blockplane_protocol::SNAPSHOT_OF_DIRECT.into(),
            }),
            DispatchPolicy::Kernel => {
                let reason = v.reason.clone();
                self.switch(volume_id, v, DispatchPolicy::Nowait, Reason::CopyOnWorker)?;
                Ok(Some(reason))
            }
            _ => Ok(None),
        })
    }

    /// After a snapshot: back to `kernel` when [`Self::onto_worker`] moved
    /// the volume off it; on a refusal it serves on, on the worker, saying so.
    fn back_to_kernel(&self, volume_id: Uuid, kernel: Option<Reason>) -> Result<(), BackendError> {
        let Some(reason) = kernel else {
            return Ok(());
        };
        self.with_volume(volume_id, |v| {
            let back = dispatch::after_copy(reason, v.params.qos.is_some());
            if let Err(e) = self.switch(volume_id, v, back.dispatch, back.reason) {
                tracing::warn!(volume = %volume_id, error = %e, "could not go back to kernel after a copy");
                v.reason = Reason::CopyReturnRefused {
                    error: e.to_string(),
                };
            }
            Ok(())
        })
    }

    /// Moves a volume to `to`, with the device suspended only around the table
    /// swap. On error the volume stays as it was.
    fn switch(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        to: DispatchPolicy,
        reason: Reason,
    ) -> Result<(), BackendError> {
        let from = v.dispatch;
        if v.copying.is_some() && from != to {
            return Err(BackendError::Refused {
                reason: COPY_HOLDS_PATH.into(),
            });
        }
        let on_worker = |p| matches!(p, DispatchPolicy::Nowait | DispatchPolicy::Threaded);
        match (from == DispatchPolicy::Direct, to == DispatchPolicy::Direct) {
            // Nothing moves (a worker is told, below: it reports the reason).
            _ if from == to && !on_worker(from) => {}
            (false, false) if on_worker(from) && on_worker(to) => {
                // Both on the private worker: it switches by itself.
                self.ublk.change(
                    volume_id,
                    Request::set_dispatch(wire::data_path(to), &reason),
                )?;
            }
            (false, false) => {
                // Between the loop device and the worker: start the new one,
                // swap tables, let the old one go.
                let lower = self.start_lower(volume_id, v, &v.image, to, &reason)?;
                let table = over(lower.dev, v.params.size_bytes);
                match self.reload(volume_id, v.read_only, table) {
                    Ok(table) => {
                        v.table = table;
                        let old = (v.private_ublk.take(), v.private_loop.take());
                        Self::keep_lower(v, lower);
                        self.stop_lower(volume_id, old.0, old.1)?;
                    }
                    Err(e) => {
                        self.undo_lower(volume_id, lower);
                        return Err(e);
                    }
                }
            }
            (true, false) if !v.read_only && blockplane_system::image::is_read_only(&v.image) => {
                self.leave_direct_reopened(volume_id, v, to, &reason)?;
            }
            (true, false) => {
                // Start the lower first (nothing reaches it until the table
                // points at it); unpin only once the new table is loaded, while
                // the device is still suspended: neither can write through a
                // pinned image, and the linear table must not serve an
                // unpinned one.
                let lower = self.start_lower(volume_id, v, &v.image, to, &reason)?;
                let pin = v.direct.as_ref().map(|(_, p)| *p);
                let image = &v.image;
                let dev = lower.dev;
                let swapped = ioctl::swap(
                    &self.instance,
                    volume_id,
                    false,
                    v.read_only,
                    || Ok(over(dev, v.params.size_bytes)),
                    || {
                        if let Some(p) = pin {
                            extent::unpin(image.as_fd(), p)
                                .map_err(|e| BackendError::io("unpin", "image", e))?;
                        }
                        extent::drop_page_cache(image.as_fd())
                            .map_err(|e| BackendError::io("drop page cache", "image", e))
                    },
                );
                match swapped {
                    Ok(table) => {
                        v.table = table;
                        v.direct = None;
                        Self::keep_lower(v, lower);
                    }
                    Err(e) => {
                        self.undo_lower(volume_id, lower);
                        return Err(e);
                    }
                }
            }
            (false, true) => {
                // Suspended, in-flight bios have finished on the worker: map
                // and pin (FIEMAP with sync), load the linear table, resume.
                let image = &v.image;
                let (size, read_only) = (v.params.size_bytes, v.read_only);
                let mut mapped = None;
                let swapped =
                    ioctl::swap(
                        &self.instance,
                        volume_id,
                        false,
                        read_only,
                        || {
                            let refused = |e: extent::MapError| BackendError::Refused {
                                reason: e.to_string(),
                            };
                            dispatch::rule_3(image.as_fd(), read_only).map_err(refused)?;
                            let (map, pin) = extent::map_and_pin(image.as_fd(), size, None)
                                .map_err(|e| BackendError::Refused {
                                    reason: e.to_string(),
                                })?;
                            let table = direct_table(&map);
                            mapped = Some((map, pin));
                            Ok(table)
                        },
                        || Ok(()),
                    );
                match swapped {
                    Ok(table) => {
                        v.direct = mapped;
                        v.table = table;
                        // Nothing references the lower any more.
                        let old = (v.private_ublk.take(), v.private_loop.take());
                        self.stop_lower(volume_id, old.0, old.1)?;
                    }
                    Err(e) => {
                        if let Some((_, pin)) = mapped {
                            let _ = extent::unpin(image.as_fd(), pin);
                        }
                        return Err(e);
                    }
                }
            }
            (true, true) => unreachable!("direct to direct is the first arm"),
        }
        v.dispatch = to;
        v.reason = reason;
        Ok(())
    }

    /// Sets a volume's QoS limit, enforced by its private worker: on
    /// `direct` under `auto` a limit moves it to `nowait` (the worker starts
    /// with the limit); removing the last limit of a volume that moved for
    /// one brings it back to `direct` when the image still qualifies. On
    /// error the volume keeps its limit and path.
    fn set_qos(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        qos: Option<Qos>,
    ) -> Result<(), BackendError> {
        let no_worker = matches!(v.dispatch, DispatchPolicy::Direct | DispatchPolicy::Kernel);
        let old = v.params.qos;
        let moved_for_qos = old.is_some() || v.reason == Reason::QosNowait;
        if qos.is_some() {
            let moved = dispatch::qos_on_dm(v.params.dispatch, no_worker, &self.path())
                .map_err(qos_not_live)?;
            v.params.qos = qos;
            let done = match moved {
                Some(d) => self.switch(volume_id, v, d.dispatch, d.reason),
                None => self
                    .ublk
                    .change(
                        volume_id,
                        Request::SetQos {
                            qos: wire::limits(qos),
                        },
                    )
                    .map(|_| ()),
            };
            if done.is_err() {
                v.params.qos = old;
            }
            return done;
        }
        if no_worker {
            v.params.qos = None;
            return Ok(());
        }
        self.ublk.change(volume_id, Request::SetQos { qos: None })?;
        v.params.qos = None;
        if !(moved_for_qos && v.params.dispatch == DispatchPolicy::Auto) {
            return Ok(());
        }
        let back = dispatch::after_last_limit(&ask(v, DispatchPolicy::Auto, &self.path()))?;
        let Reason::LastLimitRemoved { .. } = back.reason else {
            // Stays on the worker: say why, no longer the limit.
            return self.switch(volume_id, v, back.dispatch, back.reason);
        };
        let to = back.dispatch;
        if let Err(e) = self.switch(volume_id, v, to, back.reason) {
            // The pin (or the loop driver) refused it: serve on, saying so.
            tracing::warn!(volume = %volume_id, error = %e, "could not leave the worker after the last QoS limit");
            let why = Reason::BackRefused {
                to,
                error: e.to_string(),
            };
            self.switch(volume_id, v, v.dispatch, why)?;
        }
        Ok(())
    }

    /// What the user of the volume `att` belongs to asked: its policy and
    /// its limit (`None`: not a volume of this service).
    fn asked(&self, att: &Attachment) -> Option<(DispatchPolicy, Option<Qos>)> {
        let DeviceState::Dm(dm) = &att.kind else {
            return None;
        };
        let v = self.volumes.lock().expect("dm volumes poisoned");
        v.get(&volume_of_name(&dm.name)?)
            .map(|v| (v.params.dispatch, v.params.qos))
    }

    /// Leaves `direct` for the private worker on `to` when the volume holds
    /// its image read-only but is writable: adopted by a restarted service,
    /// which could open the pinned image for reading only, and a worker on
    /// that handle would fail every write. A writable handle exists only once
    /// unpinned, and the linear table must not serve an unpinned image: so,
    /// all under the suspend, unpin, reopen for writing, start the worker on
    /// that handle and load the table over it. The volume keeps the writable
    /// handle. On error it stays as it was, pinned again.
    fn leave_direct_reopened(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        to: DispatchPolicy,
        reason: &Reason,
    ) -> Result<(), BackendError> {
        let pin = v.direct.as_ref().map(|(_, p)| *p);
        let mut started = None;
        let swapped = ioctl::swap(
            &self.instance,
            volume_id,
            false,
            v.read_only,
            || {
                let image = &v.image;
                if let Some(p) = pin {
                    extent::unpin(image.as_fd(), p)
                        .map_err(|e| BackendError::io("unpin", "image", e))?;
                }
                let writable = blockplane_system::image::reopen(image, true)
                    .map_err(|e| BackendError::io("reopen for writing", "image", e))?;
                extent::drop_page_cache(writable.as_fd())
                    .map_err(|e| BackendError::io("drop page cache", "image", e))?;
                let lower = self.start_lower(volume_id, v, &writable, to, reason)?;
                let table = over(lower.dev, v.params.size_bytes);
                started = Some((lower, writable));
                Ok(table)
            },
            || Ok(()),
        );
        match swapped {
            Ok(table) => {
                let (lower, writable) = started.expect("a table loaded is over a started lower");
                v.image = writable;
                v.table = table;
                v.direct = None;
                Self::keep_lower(v, lower);
                Ok(())
            }
            Err(e) => {
                if let Some((lower, _)) = started {
                    self.undo_lower(volume_id, lower);
                }
                if pin.is_some_and(|p| !p.was_immutable) {
                    let _ = extent::pin(v.image.as_fd());
                }
                Err(e)
            }
        }
    }

    /// Rule 5 for one volume: re-read the map; on drift leave `direct` at once.
    fn check_drift(&self, volume_id: Uuid) {
        let mut volumes = self.volumes.lock().expect("dm volumes poisoned");
        let Some(v) = volumes.get_mut(&volume_id) else {
            return;
        };
        let Some((map, _)) = &v.direct else { return };
        let now = ExtentMap::build(v.image.as_fd(), map.size);
        let drift = match now {
            Ok(m) => map.differences(&m),
            Err(e) => Some(e.to_string()),
        };
        let Some(what) = drift else { return };
        tracing::error!(%volume_id, %what, "dm direct map drifted: moving to nowait");
        let reason = Reason::ExtentsChanged {
            what,
            on_private: true,
        };
        // The pin is gone (someone cleared it to move blocks): do not restore it.
        if let Some((_, pin)) = v.direct.as_mut() {
            pin.was_immutable = true;
        }
        let outcome = self.switch(volume_id, v, DispatchPolicy::Nowait, reason.clone());
        let (kind, state, message) = match outcome {
            Ok(()) => {
                v.degraded = Some(reason.to_string());
                ("volume_degraded", VolumeState::Degraded, reason.to_string())
            }
            Err(e) => {
                // No ublk to fall back to: stop the mapping rather than write
                // to blocks the image no longer owns.
                let _ = ioctl::remove(volume_id);
                (
                    "volume_error",
                    VolumeState::Error,
                    format!("{reason}; the fallback failed ({e}): the device was removed"),
                )
            }
        };
        let att = self.describe(volume_id, v).ok();
        self.events.send(BackendEvent {
            volume_id,
            kind,
            message,
            attachment: att,
            state: Some(state),
        });
    }

    /// Records a volume that is live in the kernel and starts its extent
    /// checks; returns its attachment.
    fn register(&self, volume_id: Uuid, v: DmVolume) -> Result<Attachment, BackendError> {
        let att = self.describe(volume_id, &v)?;
        let stop = v.stop_checks.clone();
        self.volumes
            .lock()
            .expect("dm volumes poisoned")
            .insert(volume_id, v);
        self.start_checks(volume_id, stop);
        Ok(att)
    }

    fn start_checks(&self, volume_id: Uuid, stop: Arc<AtomicBool>) {
        let me = DmBackend {
            instance: self.instance.clone(),
            ublk: self.ublk.clone(),
            volumes: self.volumes.clone(),
            events: self.events.clone(),
            check_secs: self.check_secs,
            faults: self.faults,
        };
        let every = Duration::from_secs(u64::from(self.check_secs.max(1)));
        let _ = std::thread::Builder::new()
            .name(format!("dm-check-{}", &volume_id.to_string()[..8]))
            .spawn(move || {
                while !stop.load(Relaxed) {
                    std::thread::sleep(every);
                    if !stop.load(Relaxed) {
                        me.check_drift(volume_id);
                    }
                }
            });
    }

    /// Loads `table` in place of the live one (suspend, load, resume).
    fn reload(
        &self,
        volume_id: Uuid,
        read_only: bool,
        table: Vec<Target>,
    ) -> Result<Vec<Target>, BackendError> {
        ioctl::swap(
            &self.instance,
            volume_id,
            false,
            read_only,
            || Ok(table),
            || Ok(()),
        )
    }

    fn with_volume<T>(
        &self,
        volume_id: Uuid,
        f: impl FnOnce(&mut DmVolume) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let mut volumes = self.volumes.lock().expect("dm volumes poisoned");
        let v = volumes.get_mut(&volume_id).ok_or_else(|| {
            BackendError::io(
                "find",
                dm_name(volume_id),
                io::Error::other("not supervised by this service"),
            )
        })?;
        f(v)
    }
}

impl VolumeBackend for DmBackend {
    fn kind(&self) -> Backend {
        Backend::Dm
    }

    fn capability(&self) -> BackendCapability {
        let reason = ioctl::unavailable();
        let targets = reason.is_none().then(ioctl::targets);
        BackendCapability {
            available: reason.is_none(),
            reason,
            features: None,
            native_loop_target: targets.as_ref().map(|t| t.iter().any(|n| n == "loop")),
            targets,
        }
    }

    fn validate(
        &self,
        spec: &SpecCheck,
        image: &OwnedFd,
        size: u64,
    ) -> Result<Option<Decision>, BackendError> {
        if let Some(reason) = ioctl::unavailable() {
            return Err(BackendError::Unavailable {
                backend: "dm",
                reason,
            });
        }
        if spec.qos.is_some() {
            // A limit is enforced by the private worker: `auto` starts there.
            let no_worker = matches!(
                spec.dispatch,
                DispatchPolicy::Direct | DispatchPolicy::Kernel | DispatchPolicy::Auto
            );
            let moved = dispatch::qos_on_dm(spec.dispatch, no_worker, &self.path()).map_err(
                |e| match e {
                    dispatch::DispatchError::Refused(reason) => BackendError::Unsupported {
                        backend: "dm",
                        what: "qos".into(),
                        reason,
                    },
                    e => e.into(),
                },
            )?;
            if let Some(d) = moved {
                return Ok(Some(d));
            }
        }
        spec.decide(image, size, &self.path()).map(Some)
    }

    fn attach(&self, mut req: AttachRequest) -> Result<Attachment, BackendError> {
        let decision = req.take_decision(&self.path())?;
        let mut v = DmVolume {
            image: req.image_fd,
            lock: req.image_lock,
            params: req.params.clone(),
            dispatch: decision.dispatch,
            reason: decision.reason.clone(),
            read_only: req.params.refuse_writes,
            direct: None,
            private_ublk: None,
            private_loop: None,
            table: Vec::new(),
            degraded: None,
            resize_pending: false,
            attached_at: OffsetDateTime::now_utc(),
            baseline: None,
            stop_checks: Arc::default(),
            copying: None,
        };
        let volume_id = req.volume_id;
        // A device left by a crash of this service mid-create: start clean.
        let _ = ioctl::remove(volume_id);
        let mut lower = None;
        let table = if decision.dispatch == DispatchPolicy::Direct {
            let (map, pin) =
                extent::map_and_pin(v.image.as_fd(), v.params.size_bytes, decision.map).map_err(
                    |e| BackendError::Refused {
                        reason: e.to_string(),
                    },
                )?;
            let table = direct_table(&map);
            v.direct = Some((map, pin));
            table
        } else {
            let started =
                self.start_lower(volume_id, &v, &v.image, decision.dispatch, &decision.reason)?;
            let table = over(started.dev, v.params.size_bytes);
            lower = Some(started);
            table
        };
        let created = ioctl::swap(
            &self.instance,
            volume_id,
            true,
            v.read_only,
            || {
                // The device exists, its table is not loaded (a test fault).
                self.faults.kill_point(After::Create);
                Ok(table)
            },
            || Ok(()),
        );
        v.table = match created {
            Ok(t) => t,
            Err(e) => {
                // Nothing of the volume is left: no pin, no private device.
                if let Some((_, pin)) = &v.direct {
                    drop(extent::unpin(v.image.as_fd(), *pin));
                }
                if let Some(lower) = lower {
                    self.undo_lower(volume_id, lower);
                }
                return Err(e);
            }
        };
        if let Some(lower) = lower {
            Self::keep_lower(&mut v, lower);
        }
        if let Some(dev) = ioctl::devnum(volume_id) {
            v.baseline = BlockStat::read(&kernel_name(dev)).ok();
        }
        self.register(volume_id, v)
    }

    fn check_detach(&self, volume_id: Uuid) -> Result<(), BackendError> {
        let Some(dev) = ioctl::devnum(volume_id) else {
            return Ok(());
        };
        let node = format!("/dev/{}", kernel_name(dev));
        super::refuse_if_claimed(node)
    }

    fn detach(&self, volume_id: Uuid, att: Option<&Attachment>) -> Result<(), BackendError> {
        ioctl::remove(volume_id)?;
        let v = self
            .volumes
            .lock()
            .expect("dm volumes poisoned")
            .remove(&volume_id);
        let _ = self.ublk.stop(volume_id);
        match v {
            Some(v) => {
                v.stop_checks.store(true, Relaxed);
                if let Some(lo) = v.private_loop {
                    lo.release();
                }
                if let Some((_, pin)) = v.direct {
                    extent::unpin(v.image.as_fd(), pin)
                        .map_err(|e| BackendError::io("unpin", "image", e))?;
                }
            }
            None => {
                if let Some(pin) = att.and_then(|a| a.dm()).and_then(|d| d.pinned) {
                    tracing::warn!(%volume_id, ?pin, "image pinned by a dm volume this service does not hold; clear FS_IMMUTABLE_FL by hand if needed");
                }
            }
        }
        Ok(())
    }

    fn image_lock(&self, volume_id: Uuid) -> Option<OwnedFd> {
        let volumes = self.volumes.lock().expect("dm volumes poisoned");
        volumes.get(&volume_id)?.lock.as_ref()?.try_clone().ok()
    }

    fn probe(&self, req: ProbeRequest) -> Result<Probe, BackendError> {
        let volume_id = req.volume_id;
        if ioctl::devnum(volume_id).is_none() {
            // Maybe a private worker outlived its dm device: let it go.
            let _ = self.ublk.stop(volume_id);
            return Ok(Probe::Gone);
        }
        let Some(image) = req.image else {
            return Err(BackendError::Busy {
                device: dm_name(volume_id),
                reason: "its image cannot be opened, so the map cannot be checked".into(),
            });
        };
        let name_s = dm_name(volume_id);
        let (read_only, live) = ioctl::live_table(volume_id)?;
        if live.is_empty() {
            self.remove_unloaded(volume_id, &req.params, image)?;
            return Ok(Probe::Gone);
        }
        let stored = req.stored.as_ref().and_then(|a| a.dm().cloned());
        // The device serves the size its table covers: the image's row may be
        // older (the service died in a resize between growing the device and
        // recording it) or its file larger (died before the table grew).
        let mut params = req.params.clone();
        params.size_bytes = live.iter().map(|t| t.1).sum::<u64>() * 512;
        // An image larger than its device is a resize still to apply (the
        // private device cannot grow without UPDATE_SIZE), even when the
        // service died before recording it.
        let grown = rustix::fs::fstat(&image).is_ok_and(|st| st.st_size as u64 > params.size_bytes);
        let mut v = DmVolume {
            image,
            lock: req.image_lock,
            params,
            dispatch: req.params.dispatch,
            reason: req.stored.as_ref().map_or_else(
                || Reason::Words {
                    words: String::new(),
                },
                |a| a.dispatch_reason.clone(),
            ),
            read_only,
            direct: None,
            private_ublk: None,
            private_loop: None,
            table: live.clone(),
            degraded: stored.as_ref().and_then(|d| d.degraded.clone()),
            resize_pending: grown || req.stored.as_ref().is_some_and(|a| a.resize_pending),
            attached_at: req
                .stored
                .as_ref()
                .map(|a| a.attached_at)
                .unwrap_or_else(OffsetDateTime::now_utc),
            baseline: req.stored.as_ref().and_then(|a| a.baseline),
            stop_checks: Arc::default(),
            copying: None,
        };
        let over_ublk = live.len() == 1
            && live[0].3.split_whitespace().next().is_some_and(|d| {
                std::fs::read_link(format!("/sys/dev/block/{d}")).is_ok_and(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("ublkb"))
                })
            });
        let over_loop = match &live[..] {
            [(_, _, _, target)] => target
                .split_whitespace()
                .next()
                .and_then(|dev| PrivateLoop::find(&self.instance, volume_id, dev)),
            _ => None,
        };
        if let Some(lo) = over_loop {
            // Kernel: the loop device, bound to the image, carries the
            // volume's mark; it needs nothing but to be known again.
            v.dispatch = DispatchPolicy::Kernel;
            v.private_loop = Some(lo);
        } else if over_ublk {
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
                    v.private_ublk = Some(DevNum {
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
                    self.recover_private(volume_id, &mut v, &live[0].3, policy)
                        .map_err(|e| BackendError::Busy {
                            device: name_s.clone(),
                            reason: format!(
                                "its private ublk worker is gone and a new one could not serve its device: {e}"
                            ),
                        })?;
                }
            }
        } else {
            // Direct: the live table must be the image's map as it is now.
            let map = ExtentMap::build(v.image.as_fd(), v.params.size_bytes).map_err(|e| {
                BackendError::Refused {
                    reason: e.to_string(),
                }
            })?;
            let expected = direct_table(&map);
            if expected != live {
                return Err(BackendError::Busy {
                    device: name_s,
                    reason: "its table no longer matches the image's extents (rule 5); delete and re-create the volume".into(),
                });
            }
            let pin = stored.and_then(|d| d.pinned).unwrap_or(Pin {
                was_immutable: false,
            });
            v.dispatch = DispatchPolicy::Direct;
            v.direct = Some((map, pin));
        }
        Ok(Probe::Alive(Box::new(self.register(volume_id, v)?)))
    }

    fn orphan_policy(&self) -> OrphanPolicy {
        OrphanPolicy::Report
    }

    fn marked(&self) -> Result<Vec<Marked>, BackendError> {
        Ok(blockplane_devices()?
            .into_iter()
            .filter(|c| c.instance == self.instance)
            .map(|c| Marked {
                volume_id: c.volume_id,
                device: c.name,
            })
            .collect())
    }

    /// The dm device's counters (the kernel's); off `direct`, with what its
    /// private worker counts that the kernel cannot: the `nowait` path,
    /// QoS delays and worker restarts (since that worker started).
    fn stats(&self, volume_id: Uuid, att: &Attachment) -> Result<VolumeStats, BackendError> {
        let mut stats = super::kernel_stats(volume_id, Backend::Dm, att)?;
        if att.dispatch != ActiveDispatch::Direct
            && let Some(w) = self.ublk.counters(volume_id)
        {
            stats.nowait = Some(super::ublk::nowait_stats(&w));
            stats.qos_throttled = Some(w.qos_throttled);
            stats.worker_restarts = Some(w.worker_restarts);
        }
        Ok(stats)
    }

    fn grows_image(&self) -> bool {
        true
    }

    fn check_allocate(&self, _att: &Attachment, volume_id: Uuid) -> Result<(), BackendError> {
        if self.with_volume(volume_id, |v| Ok(v.dispatch == DispatchPolicy::Direct))? {
            Ok(())
        } else {
            self.with_volume(volume_id, |v| match v.params.read_only {
                true => Err(BackendError::Refused {
                    reason: CANNOT_FILL_READ_ONLY.into(),
                }),
                false => Ok(()),
            })
        }
    }

    fn allocate(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        let direct = self.with_volume(volume_id, |v| match v.dispatch {
            DispatchPolicy::Direct => Ok(true),
            // The worker fills while it serves; the loop driver cannot.
            DispatchPolicy::Kernel => self
                .switch(volume_id, v, DispatchPolicy::Nowait, Reason::FillOnWorker)
                .map(|()| false),
            _ => Ok(false),
        })?;
        // A direct table maps only a written image: nothing to fill. Otherwise
        // the private worker does it, outside the volumes' lock.
        let done = direct || self.ublk.fill(volume_id, job)?;
        if done {
            self.with_volume(volume_id, |v| {
                v.params.allocation = Allocation::Full;
                Ok(())
            })?;
        }
        Ok(done)
    }

    fn resize(
        &self,
        _att: &Attachment,
        size_bytes: u64,
        allocation: Allocation,
        volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        self.with_volume(volume_id, |v| {
            if v.dispatch == DispatchPolicy::Direct {
                // Unpin, grow, map and pin again, swap tables: the device is
                // suspended only for the swap; the old table stays valid for the
                // old range meanwhile (the grown part is new blocks).
                let (_, pin) = v.direct.take().expect("direct volumes have a map");
                extent::unpin(v.image.as_fd(), pin)
                    .map_err(|e| BackendError::io("unpin", "image", e))?;
                // Re-adopted volumes hold the pinned image read-only: once
                // unpinned, the same inode can be opened for writing.
                let writable = blockplane_system::image::reopen(&v.image, true)
                    .map_err(|e| BackendError::io("reopen", "image", e))?;
                let grown = blockplane_system::image::grow_fd(&writable, size_bytes, allocation)
                    .map_err(|(op, e)| BackendError::io(op, "image", e));
                let (map, pin) = extent::map_and_pin(
                    v.image.as_fd(),
                    if grown.is_ok() {
                        size_bytes
                    } else {
                        v.params.size_bytes
                    },
                    None,
                )
                .map_err(|e| BackendError::Refused {
                    reason: e.to_string(),
                })?;
                grown?;
                let table = direct_table(&map);
                v.table = self.reload(volume_id, v.read_only, table)?;
                v.direct = Some((map, pin));
            } else if let Some(lo) = v.private_loop {
                // Grow the file, then the loop device over it, then the table.
                let writable = blockplane_system::image::reopen(&v.image, true)
                    .map_err(|e| BackendError::io("reopen", "image", e))?;
                blockplane_system::image::grow_fd(&writable, size_bytes, allocation)
                    .map_err(|(op, e)| BackendError::io(op, "image", e))?;
                lo.set_size(size_bytes)?;
                v.table = self.reload(volume_id, v.read_only, over(lo.dev, size_bytes))?;
            } else {
                let att = self.ublk.change(
                    volume_id,
                    Request::Resize {
                        size_bytes,
                        allocation: wire::allocation(allocation),
                    },
                )?;
                if att.resize_pending {
                    // The image grew; the private device cannot (no UPDATE_SIZE):
                    // the table keeps its size until the next attach.
                    v.resize_pending = true;
                    return self.describe(volume_id, v);
                }
                let table = over(
                    DevNum {
                        major: att.major,
                        minor: att.minor,
                    },
                    size_bytes,
                );
                v.table = self.reload(volume_id, v.read_only, table)?;
            }
            v.params.size_bytes = size_bytes;
            self.describe(volume_id, v)
        })
    }

    fn leave_direct(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        reason: Reason,
    ) -> Result<Attachment, BackendError> {
        self.with_volume(volume_id, |v| {
            if v.dispatch == DispatchPolicy::Direct {
                dispatch::can_serve_off_direct("leaving direct", &self.path())?;
                self.switch(volume_id, v, DispatchPolicy::Nowait, reason)?;
                v.degraded = None;
            }
            self.describe(volume_id, v)
        })
    }

    fn snapshot(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        dest: &SnapshotDest,
    ) -> Result<Duration, BackendError> {
        // The linear table passes bios through to the private device: holding
        // its worker's queues holds the volume's I/O.
        let kernel = self.onto_worker(volume_id)?;
        let copied = self.ublk.snapshot_image(volume_id, dest);
        self.back_to_kernel(volume_id, kernel)?;
        copied
    }

    fn copy_moment(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        copy: &MomentCopy,
    ) -> Result<Duration, BackendError> {
        // Every write passes through the private worker, which keeps the
        // moment's chunks; the volume stays on it until the copy ends.
        self.with_volume(volume_id, |v| match v.copying {
            Some(_) => Err(BackendError::Refused {
                reason: COPY_HOLDS_PATH.into(),
            }),
            None => Ok(()),
        })?;
        let kernel = self.onto_worker(volume_id)?;
        match self.ublk.copy_image(volume_id, copy) {
            Ok(held) => {
                self.with_volume(volume_id, |v| {
                    v.copying = Some(kernel);
                    Ok(())
                })?;
                Ok(held)
            }
            Err(e) => {
                self.back_to_kernel(volume_id, kernel)?;
                Err(e)
            }
        }
    }

    fn follow_copy(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        let out = self.ublk.follow_copy(volume_id, job);
        // After a restart the copy's start is known only by the reason
        // it left `kernel` with.
        let kernel = self.with_volume(volume_id, |v| {
            let recorded = v.copying.take().flatten();
            Ok(recorded
                .or_else(|| (v.reason == Reason::CopyOnWorker).then_some(Reason::KernelAfterCopy)))
        });
        let back = kernel.and_then(|k| self.back_to_kernel(volume_id, k));
        // The copy's own error first.
        let done = out?;
        back.map(|()| done)
    }

    fn worker(&self, volume_id: Uuid) -> Option<WorkerInfo> {
        self.ublk.worker(volume_id)
    }

    fn check_handover(&self, _att: &Attachment, volume_id: Uuid) -> Result<(), BackendError> {
        let private = self
            .volumes
            .lock()
            .expect("dm volumes poisoned")
            .get(&volume_id)
            .map(|v| (v.private_ublk.is_some(), v.dispatch));
        match private {
            Some((true, _)) => self.ublk.check_handover(volume_id),
            Some((false, on)) => Err(BackendError::Unsupported {
                backend: "dm",
                what: "a handover to a new worker".into(),
                reason: match on {
                    DispatchPolicy::Kernel => "on kernel the loop driver serves the volume: no worker serves it",
                    _ => "on direct the kernel maps the volume straight to the disk: no worker serves it",
                }
                .into(),
            }),
            None => Err(BackendError::io(
                "hand over",
                dm_name(volume_id),
                io::Error::other("this service does not hold the volume"),
            )),
        }
    }

    fn handover(
        &self,
        att: &Attachment,
        volume_id: Uuid,
        faults: HandoverFaults,
    ) -> Result<HandedOver, BackendError> {
        self.check_handover(att, volume_id)?;
        // The dm device and its table stay: the private device keeps its number.
        let done = self.ublk.hand_over(volume_id, faults)?;
        Ok(HandedOver {
            attachment: None,
            ..done
        })
    }

    fn check_change(&self, att: &Attachment, change: Change) -> Result<(), BackendError> {
        match change {
            Change::Qos(Some(_)) => {
                let asked = self.asked(att).map_or(DispatchPolicy::Auto, |a| a.0);
                let no_worker = matches!(
                    att.dispatch,
                    ActiveDispatch::Direct | ActiveDispatch::Kernel
                );
                dispatch::qos_on_dm(asked, no_worker, &self.path())
                    .map(|_| ())
                    .map_err(qos_not_live)
            }
            Change::Dispatch(to) if self.asked(att).is_some_and(|a| a.1.is_some()) => {
                Ok(dispatch::with_limit(to, &self.path())?)
            }
            Change::Dispatch(DispatchPolicy::Kernel) => {
                let DeviceState::Dm(dm) = &att.kind else {
                    return Ok(());
                };
                let Some(id) = volume_of_name(&dm.name) else {
                    return Ok(());
                };
                self.with_volume(id, |v| {
                    match dispatch::kernel_missing(v.image.as_fd(), &self.path()) {
                        Some(reason) => Err(BackendError::NotLive {
                            backend: "dm",
                            field: "dispatch",
                            reason,
                        }),
                        None => Ok(()),
                    }
                })
            }
            Change::Dispatch(to @ (DispatchPolicy::Nowait | DispatchPolicy::Threaded))
                if matches!(
                    att.dispatch,
                    ActiveDispatch::Direct | ActiveDispatch::Kernel
                ) =>
            {
                Ok(dispatch::can_serve_off_direct(
                    &format!("dispatch '{}'", to.as_str()),
                    &self.path(),
                )?)
            }
            _ => Ok(()),
        }
    }

    fn reconfigure(
        &self,
        _att: &Attachment,
        change: Change,
        volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        self.with_volume(volume_id, |v| {
            match change {
                Change::Dispatch(asked) => {
                    let d = dispatch::decide_change(
                        &ask(v, asked, &self.path()),
                        &Running {
                            direct: v.dispatch == DispatchPolicy::Direct,
                            reason: &v.reason,
                            qos: v.params.qos.is_some(),
                        },
                    )?;
                    self.switch(volume_id, v, d.dispatch, d.reason)?;
                    v.params.dispatch = asked;
                    v.degraded = None;
                }
                Change::ReadOnly(ro) => {
                    if !ro && v.params.read_only {
                        return Err(BackendError::NotLive {
                            backend: "dm",
                            field: "read_only",
                            reason: super::WRITABLE_OVER_READ_ONLY.into(),
                        });
                    }
                    if v.private_ublk.is_some() {
                        self.ublk
                            .change(volume_id, Request::SetReadOnly { read_only: ro })?;
                    }
                    let table = v.table.clone();
                    v.table = self.reload(volume_id, ro, table)?;
                    v.read_only = ro;
                }
                Change::Qos(qos) => self.set_qos(volume_id, v, qos)?,
            }
            self.describe(volume_id, v)
        })
    }
}
