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

mod adopt;
mod drift;
mod ioctl;
mod lower;
mod qos;
mod switch;
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
    AllocateJob, AttachRequest, Attachment, BackendError, Change, Decision, DeviceState,
    DmAttachment, EventSink, HandedOver, Marked, MomentCopy, OrphanPolicy, PrivateDevices, Probe,
    ProbeRequest, SnapshotDest, SpecCheck, VolumeBackend, VolumeParams, WorkerInfo,
};
use crate::backend::wire;
use crate::fault::{After, Faults, HandoverFaults};
use blockplane_api::model::{
    ActiveDispatch, Allocation, Backend, BackendCapability, DispatchPolicy, VolumeStats,
};
use blockplane_protocol::{CANNOT_FILL_READ_ONLY, Request};
use blockplane_system::blockstat::BlockStat;
use blockplane_system::dispatch::{self, Ask, Reason, Running};
use blockplane_system::extent::{self, DevNum, ExtentMap, Pin};
pub use ioctl::foreign_devices;
use ioctl::{blockplane_devices, dm_name, dm_uuid, kernel_name, volume_of_name};
use qos::qos_not_live;
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
    /// What the table maps onto.
    under: Under,
    table: Vec<Target>,
    /// The image grew but the private ublk device could not (no UPDATE_SIZE).
    resize_pending: bool,
    /// Since the attach: when, its counters' start, its drift checks.
    watch: Watch,
    /// A copy of one moment runs on the private worker: the volume stays on
    /// it until the copy ends (`Some`), and goes back to `kernel` then
    /// with this reason when it was there before (`Some(Some(_))`).
    copying: Option<Option<Reason>>,
}

/// What a dm volume's table maps onto: by policy one of the three, but a
/// switch holds two for a moment (the new one started before the table
/// names it, the old one stopped once none does).
#[derive(Default)]
struct Under {
    /// The map and pin while `direct`.
    direct: Option<(ExtentMap, Pin)>,
    /// The private ublk device while `nowait`/`threaded`.
    ublk: Option<DevNum>,
    /// The private loop device while `kernel`.
    loop_dev: Option<PrivateLoop>,
}

/// A dm volume since its attach.
struct Watch {
    attached_at: OffsetDateTime,
    /// The device's counters when it was made (its stats count from there).
    baseline: Option<BlockStat>,
    /// Set to stop the drift checks' thread.
    stop_checks: Arc<AtomicBool>,
    /// What the drift checks found, until the path changes.
    degraded: Option<String>,
}

/// Why a dm volume keeps its path while a copy of one moment runs.
const COPY_HOLDS_PATH: &str = "a snapshot's copy of one moment runs on this volume's private worker, whose writes keep the moment's chunks: a change of path waits for the copy's end (GET /v1/images shows its progress)";

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
            attached_at: v.watch.attached_at,
            baseline: v.watch.baseline,
            kind: DeviceState::Dm(DmAttachment {
                name: dm_name(volume_id),
                uuid: dm_uuid(&self.instance, volume_id),
                table: v.table.clone(),
                pinned: v.under.direct.as_ref().map(|(_, p)| *p),
                private_ublk: v.under.ublk.map(|d| d.to_string()),
                degraded: v.watch.degraded.clone(),
            }),
            resize_pending: v.resize_pending,
        })
    }

    /// Records a volume that is live in the kernel and starts its extent
    /// checks; returns its attachment.
    fn register(&self, volume_id: Uuid, v: DmVolume) -> Result<Attachment, BackendError> {
        let att = self.describe(volume_id, &v)?;
        let stop = v.watch.stop_checks.clone();
        self.volumes
            .lock()
            .expect("dm volumes poisoned")
            .insert(volume_id, v);
        self.start_checks(volume_id, stop);
        Ok(att)
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
            under: Under::default(),
            table: Vec::new(),
            resize_pending: false,
            watch: Watch {
                attached_at: OffsetDateTime::now_utc(),
                baseline: None,
                stop_checks: Arc::default(),
                degraded: None,
            },
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
            v.under.direct = Some((map, pin));
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
                if let Some((_, pin)) = &v.under.direct {
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
            v.watch.baseline = BlockStat::read(&kernel_name(dev)).ok();
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
                v.watch.stop_checks.store(true, Relaxed);
                if let Some(lo) = v.under.loop_dev {
                    lo.release();
                }
                if let Some((_, pin)) = v.under.direct {
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
        self.adopt(req)
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
                let (_, pin) = v.under.direct.take().expect("direct volumes have a map");
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
                v.under.direct = Some((map, pin));
            } else if let Some(lo) = v.under.loop_dev {
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
                v.watch.degraded = None;
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
            .map(|v| (v.under.ublk.is_some(), v.dispatch));
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
                    v.watch.degraded = None;
                }
                Change::ReadOnly(ro) => {
                    if !ro && v.params.read_only {
                        return Err(BackendError::NotLive {
                            backend: "dm",
                            field: "read_only",
                            reason: super::WRITABLE_OVER_READ_ONLY.into(),
                        });
                    }
                    if v.under.ublk.is_some() {
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
