//! The `ublk` backend, control-plane side: one worker process per volume
//! (`blockplane worker`, speaking [`blockplane_protocol`]), started detached so it
//! outlives the control plane, supervised through a pidfd, recovered when it
//! dies, and found again after a control-plane restart through its run dir
//! (`<data-dir>/run/ublk/<volume-id>/`: `ctl.sock`, `state.json`, `stats`,
//! `worker.log`, and `instance`, the service instance that made it: a run dir
//! of another instance, left by a lost registry, is never taken for an orphan
//! of this one and stopped).

mod client;
mod handover;
mod kernel;
mod supervise;
mod supervisor;

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libublk::sys;
use uuid::Uuid;

use super::{
    AllocateJob, AttachRequest, Attachment, BackendError, Change, Decision, EventSink, HandedOver,
    Marked, MomentCopy, PrivateDevices, Probe, ProbeRequest, SnapshotDest, SpecCheck,
    VolumeBackend, WorkerInfo,
};
use blockplane_api::model::{
    ActiveDispatch, Allocation, Backend, BackendCapability, DispatchPolicy, UblkFeatures,
    VolumeStats,
};
use blockplane_protocol::{
    self as protocol, CANNOT_FILL_READ_ONLY, Peer, Request, WorkerSpec, WorkerStats,
};
use blockplane_system::dispatch::{self, Ask, Reason, Running};
use blockplane_system::extent;

use crate::backend::wire;
use crate::fault::HandoverFaults;
pub(crate) use client::nowait_stats;
pub use supervise::foreign_workers;
use supervise::{is_our_worker, run_dir_instance};

const TALK_TIMEOUT: Duration = Duration::from_secs(60);
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a worker's fill is asked how far it got.
const ALLOCATE_POLL: Duration = Duration::from_millis(200);

/// Backend settings from the service's configuration.
#[derive(Debug, Clone)]
pub struct UblkConfig {
    /// Where worker run dirs live.
    pub run_root: PathBuf,
    /// Threads in each worker's `threaded` pool.
    pub threads: u16,
    /// Seconds between re-reads of direct maps.
    pub extent_check_secs: u32,
    /// This service's instance id, written into every run dir it makes.
    pub instance: String,
    /// The test faults inside an attach.
    pub faults: crate::fault::Faults,
}

/// A worker this control plane supervises.
pub(super) struct Worker {
    pid: u32,
    dev_id: u32,
    /// A duplicate of the image fd, for a replacement worker and for unpinning.
    image: OwnedFd,
    /// A duplicate of the worker's image lock ([`LOCK_FD`](blockplane_protocol::LOCK_FD)), for a
    /// replacement worker: held here, the lock outlives the worker's crash.
    lock: Option<OwnedFd>,
    spec: WorkerSpec,
    /// Set while the control plane itself stops the worker.
    stopping: Arc<AtomicBool>,
    /// Set when the supervisor should end.
    forget: Arc<AtomicBool>,
    /// The private device of a dm volume: its events carry no attachment
    /// (the volume's device is the dm device).
    private: bool,
    /// What the worker said of itself in its handshake (a worker from
    /// before the handshake: protocol 1, build unknown).
    peer: Peer,
    /// Set while a handover replaces the worker: its end is no crash.
    handing_over: Arc<AtomicBool>,
}

impl Worker {
    /// Worker `pid`, serving device `dev_id`: what the backend keeps of it,
    /// with handles on its image and lock for a replacement.
    fn new(
        pid: u32,
        dev_id: u32,
        peer: Peer,
        image: OwnedFd,
        lock: Option<OwnedFd>,
        spec: WorkerSpec,
        private: bool,
    ) -> Self {
        Self {
            pid,
            dev_id,
            image,
            lock,
            spec,
            stopping: Arc::default(),
            forget: Arc::default(),
            private,
            peer,
            handing_over: Arc::default(),
        }
    }

    /// The pid and build of this worker, for the API (its supervision
    /// filled in by [`UblkBackend::worker_info`]).
    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            pid: self.pid,
            build: self.peer.build.clone(),
            unsupervised: None,
        }
    }
}

/// The file workers are started from: the service's own executable, opened
/// when the service started, so that a package that replaces the file at
/// its path (a new build) changes nothing until the service itself
/// restarts: replacement workers and handovers run the service's build.
pub(super) struct Executable {
    /// The path the service was started from: the workers' `argv[0]`.
    path: PathBuf,
    /// The file, on a descriptor above the workers' fixed ones.
    fd: OwnedFd,
}

impl Executable {
    /// This process's executable file.
    fn open() -> io::Result<Self> {
        let path = std::env::current_exe()?;
        let file = std::fs::File::open("/proc/self/exe")?;
        // Above IMAGE_FD and LOCK_FD, which a worker's start dup2s over.
        let fd = rustix::io::fcntl_dupfd_cloexec(&file, 10)?;
        Ok(Self { path, fd })
    }

    /// What to execute: this descriptor, resolved by the kernel at exec
    /// before close-on-exec closes it (in the child, `/proc/self` is the
    /// child, which has it).
    fn program(&self) -> String {
        format!("/proc/self/fd/{}", self.fd.as_raw_fd())
    }
}

/// The ublk backend.
pub struct UblkBackend {
    cfg: UblkConfig,
    exe: Arc<Executable>,
    workers: Arc<Mutex<HashMap<Uuid, Worker>>>,
    events: EventSink,
    supervisor: Arc<supervisor::Supervisor>,
}

/// Refusals and failures that name what the kernel or the rules said
/// (`io` is also `std::io` here, for the submodules).
fn io(op: &'static str, dev: impl Into<String>, e: io::Error) -> BackendError {
    BackendError::io(op, dev, e)
}

impl UblkBackend {
    /// A backend that runs workers from this executable.
    pub fn new(cfg: UblkConfig, events: EventSink) -> io::Result<Self> {
        let backend = Self {
            cfg,
            exe: Arc::new(Executable::open()?),
            workers: Arc::default(),
            events,
            supervisor: Arc::new(supervisor::Supervisor::new()?),
        };
        // Started now, so that `GET /v1/host` says at once whether it runs
        // (a start that fails is tried again).
        backend.ensure_supervisor();
        Ok(backend)
    }

    /// The worker of `volume_id` (a ublk volume's, or a dm volume's private
    /// one), if this service supervises one.
    fn worker_info(&self, volume_id: Uuid) -> Option<WorkerInfo> {
        let info = {
            let workers = self.workers.lock().expect("workers poisoned");
            workers.get(&volume_id).map(Worker::info)
        };
        info.map(|mut i| {
            i.unsupervised = self.unsupervised(volume_id);
            i
        })
    }

    /// Refuses a handover of a volume no worker of this service serves.
    fn check_worker(&self, volume_id: Uuid) -> Result<(), BackendError> {
        match self.worker_info(volume_id) {
            Some(_) => Ok(()),
            None => Err(io(
                "hand over",
                format!("volume {volume_id}"),
                io::Error::other("no worker of this service serves it"),
            )),
        }
    }

    /// The dispatch decision's view of this backend.
    fn path(&self) -> dispatch::Path {
        dispatch::Path::Ublk {
            threads: self.cfg.threads,
        }
    }
}

impl VolumeBackend for UblkBackend {
    fn kind(&self) -> Backend {
        Backend::Ublk
    }

    fn capability(&self) -> BackendCapability {
        let reason = kernel::unavailable();
        let features = reason.is_none().then(|| {
            let mask = kernel::features();
            UblkFeatures {
                mask,
                names: kernel::feature_names(mask),
            }
        });
        BackendCapability {
            available: reason.is_none(),
            reason,
            features,
            targets: None,
            native_loop_target: None,
        }
    }

    fn validate(
        &self,
        spec: &SpecCheck,
        image: &OwnedFd,
        size: u64,
    ) -> Result<Option<Decision>, BackendError> {
        if let Some(reason) = kernel::unavailable() {
            return Err(BackendError::Unavailable {
                backend: "ublk",
                reason,
            });
        }
        let features = kernel::features();
        if features & u64::from(sys::UBLK_F_USER_RECOVERY) == 0 {
            return Err(BackendError::Unavailable {
                backend: "ublk",
                reason: format!(
                    "the kernel's ublk driver lacks USER_RECOVERY (features {features:#x}); workers could not be replaced without losing I/O"
                ),
            });
        }
        spec.decide(image, size, &self.path()).map(Some)
    }

    fn attach(&self, req: AttachRequest) -> Result<Attachment, BackendError> {
        self.attach_worker(req, false)
    }

    fn check_detach(&self, volume_id: Uuid) -> Result<(), BackendError> {
        let Some(state) = self.state_file(volume_id) else {
            return Ok(());
        };
        let node = format!("/dev/ublkb{}", state.dev_id);
        super::refuse_if_claimed(node)
    }

    fn detach(&self, volume_id: Uuid, att: Option<&Attachment>) -> Result<(), BackendError> {
        let worker = self
            .workers
            .lock()
            .expect("workers poisoned")
            .remove(&volume_id);
        if let Some(w) = &worker {
            w.stopping.store(true, Relaxed);
            w.forget.store(true, Relaxed);
        }
        let state = self.state_file(volume_id);
        let pid = worker
            .as_ref()
            .map(|w| w.pid)
            .or(state.as_ref().map(|s| s.pid));
        // Ask the worker to stop the device: in-flight I/O ends with errors.
        let asked = self.ask(volume_id, &Request::Shutdown {}).is_ok();
        if let Some(pid) = pid.filter(|p| is_our_worker(*p, volume_id)) {
            let deadline = Instant::now() + Duration::from_secs(if asked { 30 } else { 0 });
            while is_our_worker(pid, volume_id) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if is_our_worker(pid, volume_id) {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(pid as i32).expect("pid > 0"),
                    rustix::process::Signal::KILL,
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let dev_id = worker
            .as_ref()
            .map(|w| w.dev_id)
            .or(state.as_ref().map(|s| s.dev_id))
            .or(att.and_then(|a| a.ublk().map(|u| u.dev_id)));
        if let Some(id) = dev_id
            && kernel::device_state(id).is_some()
        {
            kernel::delete_device(id);
        }
        // The worker unpins on a clean stop; after a crash, unpin here.
        let pinned = state
            .as_ref()
            .and_then(|s| s.pinned)
            .or(att.and_then(|a| a.ublk().and_then(|u| u.pinned)));
        if let (Some(pin), Some(w)) = (pinned, &worker)
            && let Err(e) = extent::unpin(w.image.as_fd(), pin)
        {
            tracing::warn!(%volume_id, error = %e, "could not clear the image's immutable flag");
        }
        let _ = std::fs::remove_dir_all(self.run_dir(volume_id));
        Ok(())
    }

    fn probe(&self, req: ProbeRequest) -> Result<Probe, BackendError> {
        self.probe_worker(req, false)
    }

    fn image_lock(&self, volume_id: Uuid) -> Option<OwnedFd> {
        let workers = self.workers.lock().expect("workers poisoned");
        workers.get(&volume_id)?.lock.as_ref()?.try_clone().ok()
    }

    fn marked(&self) -> Result<Vec<Marked>, BackendError> {
        let Ok(dir) = std::fs::read_dir(&self.cfg.run_root) else {
            return Ok(Vec::new());
        };
        Ok(dir
            .flatten()
            .filter(|e| run_dir_instance(&e.path()).as_deref() == Some(self.cfg.instance.as_str()))
            .filter_map(|e| Uuid::parse_str(&e.file_name().to_string_lossy()).ok())
            .map(|volume_id| Marked {
                volume_id,
                device: self
                    .state_file(volume_id)
                    .map(|s| format!("/dev/ublkb{}", s.dev_id))
                    .unwrap_or_else(|| "(no device)".into()),
            })
            .collect())
    }

    fn stats(&self, volume_id: Uuid, att: &Attachment) -> Result<VolumeStats, BackendError> {
        self.worker_stats(volume_id, att)
    }

    fn sample(
        &self,
        volume_id: Uuid,
        att: &Attachment,
        previous: Option<&VolumeStats>,
    ) -> Result<VolumeStats, BackendError> {
        self.sample_worker(volume_id, att, previous)
    }

    fn grows_image(&self) -> bool {
        true
    }

    fn resize(
        &self,
        att: &Attachment,
        size_bytes: u64,
        allocation: Allocation,
        volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        let s = self.tell(
            volume_id,
            Request::Resize {
                size_bytes,
                allocation: wire::allocation(allocation),
            },
        )?;
        let mut out = self.attachment(&s)?;
        out.attached_at = att.attached_at;
        Ok(out)
    }

    fn check_allocate(&self, _att: &Attachment, volume_id: Uuid) -> Result<(), BackendError> {
        match self
            .workers
            .lock()
            .expect("workers poisoned")
            .get(&volume_id)
        {
            None => Err(io(
                "find",
                format!("volume {volume_id}"),
                io::Error::other("no worker of this service serves it"),
            )),
            Some(w) if w.spec.read_only => Err(BackendError::Refused {
                reason: CANNOT_FILL_READ_ONLY.into(),
            }),
            Some(_) => Ok(()),
        }
    }

    fn allocate(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        self.fill_image(volume_id, job)
    }

    fn leave_direct(
        &self,
        att: &Attachment,
        volume_id: Uuid,
        reason: Reason,
    ) -> Result<Attachment, BackendError> {
        let status = self.tell(
            volume_id,
            Request::set_dispatch(protocol::DataPath::Nowait, &reason),
        )?;
        let mut out = self.attachment(&status)?;
        out.attached_at = att.attached_at;
        Ok(out)
    }

    fn snapshot(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        dest: &SnapshotDest,
    ) -> Result<Duration, BackendError> {
        self.snapshot_worker(volume_id, dest)
    }

    fn copy_moment(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        copy: &MomentCopy,
    ) -> Result<Duration, BackendError> {
        self.begin_copy(volume_id, copy)
    }

    fn follow_copy(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        self.follow_worker_copy(volume_id, job)
    }

    fn worker(&self, volume_id: Uuid) -> Option<WorkerInfo> {
        self.worker_info(volume_id)
    }

    fn supervision(&self) -> Option<super::SupervisorStatus> {
        Some(self.supervisor_status())
    }

    fn check_handover(&self, _att: &Attachment, volume_id: Uuid) -> Result<(), BackendError> {
        self.check_worker(volume_id)
    }

    fn handover(
        &self,
        att: &Attachment,
        volume_id: Uuid,
        faults: HandoverFaults,
    ) -> Result<HandedOver, BackendError> {
        let mut done = self.replace_worker(volume_id, faults)?;
        if let Some(new) = done.attachment.as_mut() {
            new.attached_at = att.attached_at;
        }
        Ok(done)
    }

    fn check_change(&self, att: &Attachment, change: Change) -> Result<(), BackendError> {
        match change {
            Change::Dispatch(d @ (DispatchPolicy::Direct | DispatchPolicy::Auto)) => {
                let w = self.workers.lock().expect("workers poisoned");
                let Some(w) = w
                    .values()
                    .find(|w| Some(w.dev_id) == att.ublk().map(|u| u.dev_id))
                else {
                    return Ok(());
                };
                if d == DispatchPolicy::Direct && att.dispatch != ActiveDispatch::Direct {
                    dispatch::decide(&Ask {
                        image: w.image.as_fd(),
                        size: att.size_bytes,
                        policy: d,
                        refuse_writes: att.read_only,
                        path: &self.path(),
                    })?;
                }
                Ok(())
            }
            Change::Dispatch(DispatchPolicy::Kernel) => Err(BackendError::NotLive {
                backend: "ublk",
                field: "dispatch",
                reason: dispatch::KERNEL_ON_UBLK.into(),
            }),
            _ => Ok(()),
        }
    }

    fn reconfigure(
        &self,
        att: &Attachment,
        change: Change,
        volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        let status = match change {
            Change::Dispatch(asked) => {
                let image = self
                    .workers
                    .lock()
                    .expect("workers poisoned")
                    .get(&volume_id)
                    .and_then(|w| w.image.try_clone().ok())
                    .ok_or_else(|| {
                        io(
                            "reconfigure",
                            &att.device,
                            io::Error::other("no supervised worker"),
                        )
                    })?;
                let decision = dispatch::decide_change(
                    &Ask {
                        image: image.as_fd(),
                        size: att.size_bytes,
                        policy: asked,
                        refuse_writes: att.read_only,
                        path: &self.path(),
                    },
                    // The worker enforces a limit on every path: none keeps it.
                    &Running {
                        direct: att.dispatch == ActiveDispatch::Direct,
                        reason: &att.dispatch_reason,
                        qos: false,
                    },
                )?;
                self.tell(
                    volume_id,
                    Request::set_dispatch(decision.data_path(), &decision.reason),
                )?
            }
            Change::ReadOnly(read_only) => {
                self.tell(volume_id, Request::SetReadOnly { read_only })?
            }
            Change::Qos(qos) => self.tell(
                volume_id,
                Request::SetQos {
                    qos: wire::limits(qos),
                },
            )?,
        };
        let mut out = self.attachment(&status)?;
        out.attached_at = att.attached_at;
        Ok(out)
    }
}

impl PrivateDevices for UblkBackend {
    fn missing(&self) -> Option<String> {
        let cap = self.capability();
        (!cap.available).then(|| cap.reason.unwrap_or_default())
    }

    fn start(&self, req: AttachRequest) -> Result<Attachment, BackendError> {
        self.attach_worker(req, true)
    }

    fn adopt(&self, req: ProbeRequest) -> Result<Probe, BackendError> {
        self.probe_worker(req, true)
    }

    fn change(&self, volume_id: Uuid, req: Request) -> Result<Attachment, BackendError> {
        self.attachment(&self.tell(volume_id, req)?)
    }

    fn fill(&self, volume_id: Uuid, job: &AllocateJob) -> Result<bool, BackendError> {
        self.fill_image(volume_id, job)
    }

    fn held_lock(&self, volume_id: Uuid) -> Option<OwnedFd> {
        self.image_lock(volume_id)
    }

    fn snapshot_image(
        &self,
        volume_id: Uuid,
        dest: &SnapshotDest,
    ) -> Result<Duration, BackendError> {
        self.snapshot_worker(volume_id, dest)
    }

    fn copy_image(&self, volume_id: Uuid, copy: &MomentCopy) -> Result<Duration, BackendError> {
        self.begin_copy(volume_id, copy)
    }

    fn follow_copy(&self, volume_id: Uuid, job: &AllocateJob) -> Result<bool, BackendError> {
        self.follow_worker_copy(volume_id, job)
    }

    fn stop(&self, volume_id: Uuid) -> Result<(), BackendError> {
        self.detach(volume_id, None)
    }

    fn worker(&self, volume_id: Uuid) -> Option<WorkerInfo> {
        self.worker_info(volume_id)
    }

    fn counters(&self, volume_id: Uuid) -> Option<WorkerStats> {
        self.worker_info(volume_id)?;
        blockplane_protocol::read_counters(
            &self
                .run_dir(volume_id)
                .join(blockplane_protocol::STATS_FILE),
        )
        .ok()
    }

    fn check_handover(&self, volume_id: Uuid) -> Result<(), BackendError> {
        self.check_worker(volume_id)
    }

    fn hand_over(
        &self,
        volume_id: Uuid,
        faults: HandoverFaults,
    ) -> Result<HandedOver, BackendError> {
        self.replace_worker(volume_id, faults)
    }
}
