//! The `ublk` backend, control-plane side: one worker process per volume
//! (`blockplane worker`, see [`crate::dataplane`]), started detached so it
//! outlives the control plane, supervised through a pidfd, recovered when it
//! dies, and found again after a control-plane restart through its run dir
//! (`<data-dir>/run/ublk/<volume-id>/`: `ctl.sock`, `state.json`, `stats`,
//! `worker.log`, and `instance`, the service instance that made it: a run dir
//! of another instance, left by a lost registry, is never taken for an orphan
//! of this one and stopped).

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libublk::ctrl::UblkCtrl;
use libublk::sys;
use time::OffsetDateTime;
use uuid::Uuid;

use super::{
    AttachRequest, Attachment, BackendError, BackendEvent, Change, Decision, EventSink, Marked,
    Probe, ProbeRequest, SpecCheck, UblkAttachment, VolumeBackend,
};
use crate::dataplane::protocol::{
    self, Answer, ErrorCode, FillState, IMAGE_FD, LOCK_FD, Request, Status, WorkerSpec, worker_spec,
};
use crate::dispatch;
use crate::extent::{self, ExtentMap};
use crate::model::{
    ActiveDispatch, Allocation, Backend, BackendCapability, DispatchPolicy, LatencyStats,
    NowaitStats, Percentiles, UblkFeatures, VolumeState, VolumeStats,
};

const CONTROL: &str = "/dev/ublk-control";
const TALK_TIMEOUT: Duration = Duration::from_secs(60);
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a worker's fill is asked how far it got.
const ALLOCATE_POLL: Duration = Duration::from_millis(200);

/// Names of the ublk feature bits, in bit order.
const FEATURE_NAMES: [&str; 21] = [
    "SUPPORT_ZERO_COPY",
    "URING_CMD_COMP_IN_TASK",
    "NEED_GET_DATA",
    "USER_RECOVERY",
    "USER_RECOVERY_REISSUE",
    "UNPRIVILEGED_DEV",
    "CMD_IOCTL_ENCODE",
    "USER_COPY",
    "ZONED",
    "USER_RECOVERY_FAIL_IO",
    "UPDATE_SIZE",
    "AUTO_BUF_REG",
    "QUIESCE",
    "PER_IO_DAEMON",
    "BUF_REG_OFF_DAEMON",
    "BATCH_IO",
    "INTEGRITY",
    "SAFE_STOP_DEV",
    "NO_AUTO_PART_SCAN",
    "SHMEM_ZC",
    "IO_DESC_SIZE",
];

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
}

/// A worker this control plane supervises.
struct Worker {
    pid: u32,
    dev_id: u32,
    /// A duplicate of the image fd, for a replacement worker and for unpinning.
    image: OwnedFd,
    /// A duplicate of the worker's image lock ([`LOCK_FD`]), for a
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
}

/// The ublk backend.
pub struct UblkBackend {
    cfg: UblkConfig,
    exe: PathBuf,
    workers: Arc<Mutex<HashMap<Uuid, Worker>>>,
    events: EventSink,
}

/// Refusals and failures that name what the kernel or the rules said.
fn io(op: &'static str, dev: impl Into<String>, e: io::Error) -> BackendError {
    BackendError::io(op, dev, e)
}

impl UblkBackend {
    /// A backend that runs workers from this executable.
    pub fn new(cfg: UblkConfig, events: EventSink) -> io::Result<Self> {
        Ok(Self {
            cfg,
            exe: std::env::current_exe()?,
            workers: Arc::default(),
            events,
        })
    }

    fn unavailable() -> Option<String> {
        if !Path::new(CONTROL).exists() {
            return Some("ublk_drv is not loaded (no /dev/ublk-control)".into());
        }
        None
    }

    fn run_dir(&self, volume_id: Uuid) -> PathBuf {
        self.cfg.run_root.join(volume_id.to_string())
    }

    fn state_file(&self, volume_id: Uuid) -> Option<crate::dataplane::ControlState> {
        read_state(&self.run_dir(volume_id))
    }

    /// Marks a run dir as this instance's (see [`run_dir_instance`]).
    fn claim_run_dir(&self, run_dir: &Path) -> Result<(), BackendError> {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(run_dir.join(INSTANCE_FILE))
            .and_then(|mut f| io::Write::write_all(&mut f, self.cfg.instance.as_bytes()))
            .map_err(|e| io("mark run dir", run_dir.display().to_string(), e))
    }

    /// The dispatch decision's view of this backend.
    fn path(&self) -> dispatch::Path {
        dispatch::Path::Ublk {
            threads: self.cfg.threads,
        }
    }

    /// Starts a worker and waits until its device serves; returns its status.
    /// `lock` (an image lock, when `spec.image_lock`) goes to the worker as
    /// [`LOCK_FD`].
    fn start_worker(
        &self,
        mut spec: WorkerSpec,
        image: &OwnedFd,
        lock: Option<&OwnedFd>,
        decided: Option<&ExtentMap>,
    ) -> Result<(u32, Status), BackendError> {
        let run_dir = &spec.run_dir.clone();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(run_dir)
            .map_err(|e| io("create run dir", run_dir.display().to_string(), e))?;
        self.claim_run_dir(run_dir)?;
        if let Some(map) = decided {
            protocol::put_decided_map(run_dir, map)
                .map_err(|e| io("write the decided map", run_dir.display().to_string(), e))?;
        }
        spec.decided_map = decided.is_some();
        let _ = std::fs::remove_file(run_dir.join("ctl.sock"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(run_dir.join("worker.out"))
            .map_err(|e| io("open worker output", run_dir.display().to_string(), e))?;
        let raw = image.as_raw_fd();
        let raw_lock = lock.map(|l| l.as_raw_fd());
        let mut cmd = Command::new(&self.exe);
        cmd.arg("worker")
            .arg("--spec")
            .arg(serde_json::to_string(&spec).expect("spec serializes"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(|e| io("dup", "worker output", e))?)
            .stderr(out);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Its own session: signals to the control plane's group do not
                // reach it, and it outlives the control plane.
                libc::setsid();
                // Above the target numbers first (close-on-exec copies), so
                // neither dup2 overwrites the other's source, and each target
                // loses close-on-exec even where it was the source's number.
                let moved = [Some(raw), raw_lock]
                    .map(|fd| fd.map(|fd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 16)));
                for (fd, target) in moved.into_iter().zip([IMAGE_FD, LOCK_FD]) {
                    if let Some(fd) = fd
                        && (fd < 0 || libc::dup2(fd, target) < 0)
                    {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| io("start worker", self.exe.display().to_string(), e))?;
        let pid = child.id();
        let socket = run_dir.join("ctl.sock");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Answer::Status(s)) = protocol::talk(&socket, &Request::Status, TALK_TIMEOUT) {
                // Reaped by a thread so the worker never lingers as a zombie.
                std::thread::spawn(move || drop(child.wait()));
                return Ok((pid, *s));
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(BackendError::io(
                    "start worker",
                    format!("volume {}", spec.volume_id),
                    io::Error::other(format!(
                        "worker exited ({status}): {}",
                        last_error_line(run_dir)
                    )),
                ));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BackendError::io(
                    "start worker",
                    format!("volume {}", spec.volume_id),
                    io::Error::other(format!(
                        "no answer within {START_TIMEOUT:?}: {}",
                        last_error_line(run_dir)
                    )),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn attachment(&self, s: &Status) -> Result<Attachment, BackendError> {
        let name = format!("ublkb{}", s.dev_id);
        let dev = std::fs::read_to_string(format!("/sys/block/{name}/dev"))
            .map_err(|e| io("read sysfs of", &s.device, e))?;
        let (major, minor) = dev
            .trim()
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| io("parse dev of", &s.device, io::Error::other(dev.clone())))?;
        // The device's size is the kernel's: without UPDATE_SIZE it keeps its
        // old size while the worker serves a grown image, and a replacement
        // worker (started with the grown size) no longer knows the resize
        // is pending: a device smaller than its worker's image says so.
        let device_size = std::fs::read_to_string(format!("/sys/block/{name}/size"))
            .ok()
            .and_then(|n| n.trim().parse::<u64>().ok())
            .map_or(s.size_bytes, |sectors| sectors * 512);
        Ok(Attachment {
            device: s.device.clone(),
            kernel_name: name,
            major,
            minor,
            dispatch: s.dispatch,
            dispatch_reason: s.dispatch_reason.clone(),
            direct_io: None,
            size_bytes: device_size,
            read_only: s.read_only,
            attached_at: OffsetDateTime::now_utc(),
            baseline: None,
            ublk: Some(UblkAttachment {
                dev_id: s.dev_id,
                pid: s.pid,
                pinned: s.pinned,
                buffer_bytes: s.buffer_bytes,
                queues: (s.queues > 0).then_some(s.queues),
                zero_copy: s.zero_copy,
                degraded: s.degraded.clone(),
            }),
            dm: None,
            resize_pending: s.resize_pending || device_size < s.size_bytes,
        })
    }

    fn socket(&self, volume_id: Uuid) -> PathBuf {
        self.run_dir(volume_id).join("ctl.sock")
    }

    fn ask(&self, volume_id: Uuid, req: &Request) -> Result<Status, BackendError> {
        self.ask_within(volume_id, req, TALK_TIMEOUT)
    }

    fn ask_within(
        &self,
        volume_id: Uuid,
        req: &Request,
        timeout: Duration,
    ) -> Result<Status, BackendError> {
        match self.talk(volume_id, req, timeout)? {
            Answer::Status(s) => Ok(*s),
            other => Err(unexpected(volume_id, &other)),
        }
    }

    /// One request to a worker; a refusal or failure it answers, or a
    /// socket that does not answer, as the backend's error.
    fn talk(
        &self,
        volume_id: Uuid,
        req: &Request,
        timeout: Duration,
    ) -> Result<Answer, BackendError> {
        let worker = || format!("volume {volume_id}");
        match protocol::talk(&self.socket(volume_id), req, timeout) {
            Ok(Answer::Error { code, message }) => Err(match code {
                ErrorCode::Refused => BackendError::Refused { reason: message },
                ErrorCode::IoError | ErrorCode::BadRequest | ErrorCode::Unknown => {
                    io("worker", worker(), io::Error::other(message))
                }
            }),
            Ok(answer) => Ok(answer),
            Err(e) => Err(io("worker", worker(), io::Error::other(e.to_string()))),
        }
    }

    /// Changes the spec a replacement worker of `volume_id` would start with
    /// (so a restart keeps what the running worker was told).
    fn record(&self, volume_id: Uuid, change: impl FnOnce(&mut WorkerSpec)) {
        if let Some(w) = self
            .workers
            .lock()
            .expect("workers poisoned")
            .get_mut(&volume_id)
        {
            change(&mut w.spec);
        }
    }

    /// Watches a worker: when it dies unasked, a new worker recovers its device.
    fn supervise(&self, volume_id: Uuid) {
        let workers = self.workers.clone();
        let events = self.events.clone();
        let exe = self.exe.clone();
        let backend = UblkBackend {
            cfg: self.cfg.clone(),
            exe,
            workers: workers.clone(),
            events: events.clone(),
        };
        let _ = std::thread::Builder::new()
            .name(format!("supervise-{}", &volume_id.to_string()[..8]))
            .spawn(move || backend.supervise_loop(volume_id));
    }

    fn supervise_loop(&self, volume_id: Uuid) {
        let mut last_degraded: Option<String> = None;
        loop {
            let (pid, stopping, forget, private) = {
                let w = self.workers.lock().expect("workers poisoned");
                let Some(w) = w.get(&volume_id) else { return };
                (w.pid, w.stopping.clone(), w.forget.clone(), w.private)
            };
            let pidfd = rustix::process::pidfd_open(
                rustix::process::Pid::from_raw(pid as i32).expect("pid > 0"),
                rustix::process::PidfdFlags::empty(),
            )
            .ok();
            // Wait for the worker to end, looking at its status meanwhile.
            loop {
                if forget.load(Relaxed) {
                    return;
                }
                let ended = match &pidfd {
                    Some(fd) => {
                        let mut fds =
                            [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
                        let t = rustix::event::Timespec {
                            tv_sec: 2,
                            tv_nsec: 0,
                        };
                        matches!(rustix::event::poll(&mut fds, Some(&t)), Ok(n) if n > 0)
                    }
                    None => true,
                };
                if ended {
                    break;
                }
                if !private
                    && let Ok(Answer::Status(s)) = protocol::talk(
                        &self.socket(volume_id),
                        &Request::Status,
                        Duration::from_secs(5),
                    )
                    && s.degraded != last_degraded
                {
                    last_degraded = s.degraded.clone();
                    if s.degraded.is_some() {
                        // A replacement worker starts where this one is now.
                        self.record(volume_id, |spec| spec.dispatch = DispatchPolicy::Nowait);
                    }
                    if let (Some(reason), Ok(att)) = (&s.degraded, self.attachment(&s)) {
                        self.events.send(BackendEvent {
                            volume_id,
                            kind: "volume_degraded",
                            message: reason.clone(),
                            attachment: Some(att),
                            state: Some(VolumeState::Degraded),
                        });
                    }
                }
            }
            if stopping.load(Relaxed) || forget.load(Relaxed) {
                return;
            }
            self.recover_after_crash(volume_id, pid);
        }
    }

    /// Starts a replacement worker that recovers the device of a dead one.
    fn recover_after_crash(&self, volume_id: Uuid, old_pid: u32) {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (mut spec, image, lock, private) = {
                let w = self.workers.lock().expect("workers poisoned");
                let Some(w) = w.get(&volume_id) else { return };
                let Ok(image) = w.image.try_clone() else {
                    return;
                };
                let lock = match w.lock.as_ref().map(OwnedFd::try_clone) {
                    Some(Ok(l)) => Some(l),
                    Some(Err(_)) => return,
                    None => None,
                };
                (w.spec.clone(), image, lock, w.private)
            };
            let state = self.state_file(volume_id);
            let dev_id = state.as_ref().map(|s| s.dev_id).unwrap_or(u32::MAX);
            spec.recover_dev_id = Some(dev_id);
            spec.pinned = state.and_then(|s| s.pinned);
            match self.start_worker(spec.clone(), &image, lock.as_ref(), None) {
                Ok((pid, status)) => {
                    if let Some(w) = self
                        .workers
                        .lock()
                        .expect("workers poisoned")
                        .get_mut(&volume_id)
                    {
                        w.pid = pid;
                        w.spec = spec;
                    }
                    // A private device's volume is its dm device: leave that be.
                    let att = if private {
                        None
                    } else {
                        self.attachment(&status).ok()
                    };
                    self.events.send(BackendEvent {
                        volume_id,
                        kind: "worker_restarted",
                        message: format!(
                            "worker {old_pid} died; worker {pid} recovered /dev/ublkb{} (attempt {attempt})",
                            status.dev_id
                        ),
                        attachment: att,
                        state: None,
                    });
                    return;
                }
                Err(e) if attempt < 10 => {
                    tracing::warn!(%volume_id, attempt, error = %e, "recovery failed; retrying");
                    std::thread::sleep(Duration::from_millis(200 * attempt));
                }
                Err(e) => {
                    self.events.send(BackendEvent {
                        volume_id,
                        kind: "worker_recovery_failed",
                        message: format!(
                            "worker {old_pid} died and its device could not be recovered: {e}"
                        ),
                        attachment: None,
                        state: Some(VolumeState::Error),
                    });
                    self.workers
                        .lock()
                        .expect("workers poisoned")
                        .remove(&volume_id);
                    return;
                }
            }
        }
    }

    /// Deletes a ublk device whose server is gone (or will not stop).
    fn delete_device(dev_id: u32) {
        if let Ok(ctrl) = UblkCtrl::new_simple(dev_id as i32) {
            let _ = ctrl.kill_dev();
            let _ = ctrl.del_dev();
        }
    }

    fn device_state(dev_id: u32) -> Option<u32> {
        let ctrl = UblkCtrl::new_simple(dev_id as i32).ok()?;
        ctrl.read_dev_info().ok()?;
        Some(u32::from(ctrl.dev_info().state))
    }
}

/// A worker's answer of the wrong kind for its request.
fn unexpected(volume_id: Uuid, answer: &Answer) -> BackendError {
    io(
        "worker",
        format!("volume {volume_id}"),
        io::Error::other(format!("unexpected answer {answer:?}")),
    )
}

fn last_error_line(run_dir: &Path) -> String {
    let text = std::fs::read_to_string(run_dir.join("worker.log")).unwrap_or_default()
        + &std::fs::read_to_string(run_dir.join("worker.out")).unwrap_or_default();
    text.lines()
        .rev()
        .find(|l| l.contains("ERROR") || l.contains("error") || l.contains("worker:"))
        .unwrap_or("no log")
        .to_string()
}

fn feature_names(mask: u64) -> Vec<String> {
    (0..64)
        .filter(|b| mask & (1u64 << b) != 0)
        .map(|b| {
            FEATURE_NAMES
                .get(b)
                .map(|s| s.to_string())
                .unwrap_or(format!("BIT_{b}"))
        })
        .collect()
}

/// The file in a run dir naming the service instance that made it.
const INSTANCE_FILE: &str = "instance";

fn read_state(run_dir: &Path) -> Option<crate::dataplane::ControlState> {
    serde_json::from_slice(&std::fs::read(run_dir.join("state.json")).ok()?).ok()
}

/// The instance that made a run dir (`None`: unmarked, made before run dirs
/// carried one).
fn run_dir_instance(run_dir: &Path) -> Option<String> {
    std::fs::read_to_string(run_dir.join(INSTANCE_FILE)).ok()
}

/// A worker's run dir that belongs to another service instance (or to none):
/// what a lost registry leaves in a kept data dir.
#[derive(Debug, Clone)]
pub struct ForeignWorker {
    pub volume_id: Uuid,
    /// The instance in its run dir, if marked.
    pub instance: Option<String>,
    /// `/dev/ublkbN`, when its state file names one.
    pub device: Option<String>,
    /// The worker, while it runs.
    pub pid: Option<u32>,
    /// The image the worker serves, from its command line.
    pub image_path: Option<String>,
}

/// Run dirs under `run_root` not marked as `instance`'s whose worker still
/// runs or whose device still exists. They are only read, never stopped.
pub fn foreign_workers(run_root: &Path, instance: &str) -> Vec<ForeignWorker> {
    let Ok(dir) = std::fs::read_dir(run_root) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let volume_id = Uuid::parse_str(&e.file_name().to_string_lossy()).ok()?;
            let run_dir = e.path();
            let marked = run_dir_instance(&run_dir);
            if marked.as_deref() == Some(instance) {
                return None;
            }
            let state = read_state(&run_dir)?;
            let pid = Some(state.pid).filter(|p| is_our_worker(*p, volume_id));
            let device = format!("/dev/ublkb{}", state.dev_id);
            let exists = Path::new(&device).exists();
            if pid.is_none() && !exists {
                return None;
            }
            Some(ForeignWorker {
                volume_id,
                instance: marked,
                device: exists.then_some(device),
                image_path: pid.and_then(worker_image_path),
                pid,
            })
        })
        .collect()
}

/// A duplicate of descriptor `fd` of worker `pid`.
fn worker_fd(pid: u32, fd: i32) -> Result<OwnedFd, BackendError> {
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid as i32).expect("pid > 0"),
        rustix::process::PidfdFlags::empty(),
    )
    .map_err(|e| io("pidfd_open", format!("worker {pid}"), e.into()))?;
    rustix::process::pidfd_getfd(&pidfd, fd, rustix::process::PidfdGetfdFlags::empty())
        .map_err(|e| io("pidfd_getfd", format!("worker {pid}"), e.into()))
}

/// The image path in a worker's `--spec` argument.
fn worker_image_path(pid: u32) -> Option<String> {
    worker_spec(pid)?["image_path"].as_str().map(str::to_string)
}

/// Pid alive and running a blockplane worker of this volume.
fn is_our_worker(pid: u32, volume_id: Uuid) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            let c = String::from_utf8_lossy(&c);
            c.contains("worker") && c.contains(&volume_id.to_string())
        })
        .unwrap_or(false)
}

impl VolumeBackend for UblkBackend {
    fn kind(&self) -> Backend {
        Backend::Ublk
    }

    fn capability(&self) -> BackendCapability {
        let reason = Self::unavailable();
        let features = reason.is_none().then(|| {
            let mask = crate::dataplane::kernel_features();
            UblkFeatures {
                mask,
                names: feature_names(mask),
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
        if let Some(reason) = Self::unavailable() {
            return Err(BackendError::Unavailable {
                backend: "ublk",
                reason,
            });
        }
        let features = crate::dataplane::kernel_features();
        if features & u64::from(sys::UBLK_F_USER_RECOVERY) == 0 {
            return Err(BackendError::Unavailable {
                backend: "ublk",
                reason: format!(
                    "the kernel's ublk driver lacks USER_RECOVERY (features {features:#x}); workers could not be replaced without losing I/O"
                ),
            });
        }
        let decision = dispatch::decide(
            image.as_fd(),
            size,
            spec.dispatch,
            spec.read_only,
            &self.path(),
        )?;
        Ok(Some(decision))
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
        let asked = self.ask(volume_id, &Request::Shutdown).is_ok();
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
            .or(att.and_then(|a| a.ublk.as_ref().map(|u| u.dev_id)));
        if let Some(id) = dev_id
            && Self::device_state(id).is_some()
        {
            Self::delete_device(id);
        }
        // The worker unpins on a clean stop; after a crash, unpin here.
        let pinned = state
            .as_ref()
            .and_then(|s| s.pinned)
            .or(att.and_then(|a| a.ublk.as_ref().and_then(|u| u.pinned)));
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
        let ws = match self.talk(volume_id, &Request::Stats, TALK_TIMEOUT)? {
            Answer::Stats(s) => *s,
            other => return Err(unexpected(volume_id, &other)),
        };
        let p = |l: &protocol::Latency| Percentiles {
            p50: l.p50,
            p90: l.p90,
            p99: l.p99,
            p999: l.p999,
            max: l.max,
            count: l.count,
        };
        Ok(VolumeStats {
            volume_id,
            backend: Backend::Ublk,
            dispatch: att.dispatch,
            read: ws.read,
            write: ws.write,
            flush: ws.flush,
            discard: ws.discard,
            in_flight: ws.in_flight,
            since: OffsetDateTime::from_unix_timestamp_nanos(i128::from(ws.since_ms) * 1_000_000)
                .unwrap_or(att.attached_at),
            kernel: None,
            latency_us: Some(LatencyStats {
                read: p(&ws.latency[0]),
                write: p(&ws.latency[1]),
                flush: p(&ws.latency[2]),
                discard: p(&ws.latency[3]),
            }),
            nowait: Some(NowaitStats {
                submitted: ws.nowait_submitted,
                completed_inline: ws.nowait_completed_inline,
                eagain_fallbacks: ws.nowait_eagain_fallbacks,
                pauses: ws.nowait_pauses,
                bypassed: ws.nowait_bypassed,
            }),
            qos_throttled: Some(ws.qos_throttled),
            worker_restarts: Some(ws.worker_restarts),
            rates: None,
            histograms: Some(ws.histograms.clone()),
        })
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
        let mut out = self.resize_private(volume_id, size_bytes, allocation)?;
        out.attached_at = att.attached_at;
        Ok(out)
    }

    fn check_allocate(&self, _att: &Attachment, volume_id: Uuid) -> Result<(), BackendError> {
        self.check_allocate_private(volume_id)
    }

    fn allocate(
        &self,
        _att: &Attachment,
        volume_id: Uuid,
        job: &super::AllocateJob,
    ) -> Result<bool, BackendError> {
        self.allocate_private(volume_id, job)
    }

    fn check_change(&self, att: &Attachment, change: Change) -> Result<(), BackendError> {
        match change {
            Change::Dispatch(d @ (DispatchPolicy::Direct | DispatchPolicy::Auto)) => {
                let w = self.workers.lock().expect("workers poisoned");
                let Some(w) = w
                    .values()
                    .find(|w| Some(w.dev_id) == att.ublk.as_ref().map(|u| u.dev_id))
                else {
                    return Ok(());
                };
                if d == DispatchPolicy::Direct && att.dispatch != ActiveDispatch::Direct {
                    dispatch::decide(
                        w.image.as_fd(),
                        att.size_bytes,
                        d,
                        att.read_only,
                        &self.path(),
                    )?;
                }
                Ok(())
            }
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
                let Decision {
                    dispatch, reason, ..
                } = dispatch::decide_change(
                    image.as_fd(),
                    att.size_bytes,
                    asked,
                    att.read_only,
                    &self.path(),
                    att.dispatch == ActiveDispatch::Direct,
                    &att.dispatch_reason,
                )?;
                let s = self.ask(volume_id, &Request::SetDispatch { dispatch, reason })?;
                self.record(volume_id, |spec| spec.dispatch = dispatch);
                s
            }
            Change::ReadOnly(read_only) => self.set_read_only(volume_id, read_only)?,
            Change::Qos(qos) => {
                let s = self.ask(volume_id, &Request::SetQos { qos })?;
                self.record(volume_id, |spec| spec.qos = qos);
                s
            }
        };
        let mut out = self.attachment(&status)?;
        out.attached_at = att.attached_at;
        Ok(out)
    }
}

impl UblkBackend {
    /// Starts the private ublk device of a dm volume.
    pub fn attach_private(&self, req: AttachRequest) -> Result<Attachment, BackendError> {
        self.attach_worker(req, true)
    }

    /// Takes back the private worker of a dm volume after a restart.
    pub fn probe_private(&self, req: ProbeRequest) -> Result<Probe, BackendError> {
        self.probe_worker(req, true)
    }

    /// Switches a private worker's policy (the dm table does not change).
    pub fn switch_private(
        &self,
        volume_id: Uuid,
        dispatch: DispatchPolicy,
        reason: String,
    ) -> Result<(), BackendError> {
        self.ask(volume_id, &Request::SetDispatch { dispatch, reason })?;
        self.record(volume_id, |spec| spec.dispatch = dispatch);
        Ok(())
    }

    /// Sets a private worker's read-only switch.
    pub fn set_read_only_private(
        &self,
        volume_id: Uuid,
        read_only: bool,
    ) -> Result<(), BackendError> {
        self.set_read_only(volume_id, read_only).map(drop)
    }

    /// Sets a worker's read-only switch, and records it for a replacement
    /// worker (a volume made read-only must not come back writable after a
    /// crash, nor the reverse).
    fn set_read_only(&self, volume_id: Uuid, read_only: bool) -> Result<Status, BackendError> {
        let s = self.ask(volume_id, &Request::SetReadOnly { read_only })?;
        self.record(volume_id, |spec| spec.refuse_writes = read_only);
        Ok(s)
    }

    /// Grows a worker's image and device (a volume's own, or a dm volume's
    /// private one).
    pub fn resize_private(
        &self,
        volume_id: Uuid,
        size_bytes: u64,
        allocation: Allocation,
    ) -> Result<Attachment, BackendError> {
        let s = self.ask(
            volume_id,
            &Request::Resize {
                size_bytes,
                allocation,
            },
        )?;
        self.record(volume_id, |spec| spec.size_bytes = size_bytes);
        self.attachment(&s)
    }

    /// Refuses, before an allocate starts, a worker that cannot write its
    /// image (created read-only) or is not this service's.
    pub fn check_allocate_private(&self, volume_id: Uuid) -> Result<(), BackendError> {
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
                reason: "the volume was created read-only: its worker holds the image read-only and cannot write zeros into it; detach it first".into(),
            }),
            Some(_) => Ok(()),
        }
    }

    /// Makes a worker's image `full` (a volume's own, or a dm volume's
    /// private one): starts its fill (or adopts one a restarted service left
    /// running), reports progress into `job` and asks the worker to stop when
    /// `job.cancel` is set. Returns when the fill ended: `Ok(true)` done (a
    /// replacement worker keeps the image `full`), `Ok(false)` cancelled.
    pub fn allocate_private(
        &self,
        volume_id: Uuid,
        job: &super::AllocateJob,
    ) -> Result<bool, BackendError> {
        let failed = |why: String| {
            io(
                "allocate",
                format!("volume {volume_id}"),
                io::Error::other(why),
            )
        };
        let pace_ms = job.pace.as_millis() as u64;
        let mut status = self.ask(volume_id, &Request::Allocate { pace_ms })?;
        let mut cancel_sent = false;
        loop {
            let Some(fill) = status.allocate else {
                return Err(failed(
                    "the worker was replaced while it filled the image; allocate again".into(),
                ));
            };
            job.done_bytes.store(fill.done_bytes, Relaxed);
            job.total_bytes.store(fill.total_bytes, Relaxed);
            match fill.state {
                FillState::Running => {}
                FillState::Done => {
                    self.record(volume_id, |spec| spec.allocation = Allocation::Full);
                    return Ok(true);
                }
                FillState::Cancelled => return Ok(false),
                FillState::Failed => {
                    return Err(failed(fill.error.unwrap_or_else(|| "unknown".into())));
                }
            }
            if job.cancel.load(Relaxed) && !cancel_sent {
                status = self.ask(volume_id, &Request::CancelAllocate)?;
                cancel_sent = true;
                continue;
            }
            std::thread::sleep(ALLOCATE_POLL);
            status = self.ask(volume_id, &Request::Status)?;
        }
    }

    fn attach_worker(&self, req: AttachRequest, private: bool) -> Result<Attachment, BackendError> {
        // The decision validate made (with its map), or one made now.
        let decision = match req.decision {
            Some(d) => d,
            None => dispatch::decide(
                req.image_fd.as_fd(),
                req.params.size_bytes,
                req.params.dispatch,
                req.params.refuse_writes,
                &self.path(),
            )?,
        };
        let run_dir = self.run_dir(req.volume_id);
        // A device left by a dead worker of this volume: recover it, so the
        // data in flight when it died is reissued, not lost.
        let earlier = self.state_file(req.volume_id);
        let recover = earlier
            .as_ref()
            .filter(|s| !is_our_worker(s.pid, req.volume_id))
            .and_then(|s| match Self::device_state(s.dev_id) {
                Some(st) if st == sys::UBLK_S_DEV_QUIESCED => Some(s.dev_id),
                Some(_) => {
                    Self::delete_device(s.dev_id);
                    None
                }
                None => None,
            });
        let spec = WorkerSpec {
            volume_id: req.volume_id,
            run_dir: run_dir.clone(),
            image_path: req.params.image_path.clone(),
            size_bytes: req.params.size_bytes,
            read_only: req.params.read_only,
            refuse_writes: req.params.refuse_writes,
            dispatch: decision.dispatch,
            dispatch_reason: decision.reason,
            queues: req.params.queues,
            queue_depth: req.params.queue_depth,
            max_io_bytes: req.params.max_io_bytes,
            threads: self.cfg.threads,
            qos: req.params.qos,
            recover_dev_id: recover,
            pinned: if recover.is_some() {
                earlier.and_then(|s| s.pinned)
            } else {
                None
            },
            extent_check_secs: self.cfg.extent_check_secs,
            allocation: req.params.allocation,
            image_lock: req.image_lock.is_some(),
            decided_map: false,
        };
        // Only the first start checks the decided map; a replacement
        // worker finds the image pinned and reads its map under that pin.
        let decided = decision
            .map
            .filter(|_| decision.dispatch == DispatchPolicy::Direct);
        let (pid, status) = self.start_worker(
            spec.clone(),
            &req.image_fd,
            req.image_lock.as_ref(),
            decided.as_ref(),
        )?;
        let att = self.attachment(&status)?;
        self.workers.lock().expect("workers poisoned").insert(
            req.volume_id,
            Worker {
                pid,
                dev_id: status.dev_id,
                image: req.image_fd,
                lock: req.image_lock,
                spec,
                stopping: Arc::default(),
                forget: Arc::default(),
                private,
            },
        );
        self.supervise(req.volume_id);
        Ok(att)
    }

    fn probe_worker(&self, req: ProbeRequest, private: bool) -> Result<Probe, BackendError> {
        let (volume_id, identity) = (req.volume_id, req.identity);
        let Some(state) = self.state_file(volume_id) else {
            return Ok(Probe::Gone);
        };
        if !is_our_worker(state.pid, volume_id) {
            // Dead worker: attach recovers a quiesced device.
            return Ok(Probe::Gone);
        }
        let status = self.ask(volume_id, &Request::Status)?;
        // A handle on the image, to recover the worker later: the manager's, or
        // a duplicate of the worker's own.
        let image = match req.image {
            Some(fd) => fd,
            None => worker_fd(state.pid, IMAGE_FD)?,
        };
        // Its image lock, which it kept while no service lived: a duplicate
        // to hold here (and hand to a replacement). A worker started without
        // one (by an older service) gets the manager's for its replacement.
        let lock = if worker_spec(state.pid).is_some_and(|s| s["image_lock"] == true) {
            Some(worker_fd(state.pid, LOCK_FD)?)
        } else {
            req.image_lock
        };
        let st = rustix::fs::fstat(&image)
            .map_err(|e| io("fstat image of", format!("worker {}", state.pid), e.into()))?;
        if (st.st_dev, st.st_ino) != identity {
            return Err(BackendError::Busy {
                device: status.device.clone(),
                reason: "its worker serves another file than the registered image".into(),
            });
        }
        // A row of this registry owns it: mark it ours (a run dir made before
        // run dirs carried their instance has no mark yet).
        self.claim_run_dir(&self.run_dir(volume_id))?;
        let mut att = self.attachment(&status)?;
        if let Some(old) = &req.stored {
            att.attached_at = old.attached_at;
        }
        let p = &req.params;
        let spec = WorkerSpec {
            volume_id,
            run_dir: self.run_dir(volume_id),
            image_path: p.image_path.clone(),
            size_bytes: status.size_bytes,
            read_only: p.read_only,
            refuse_writes: status.read_only,
            dispatch: dispatch::policy_of(status.dispatch),
            dispatch_reason: status.dispatch_reason.clone(),
            queues: p.queues,
            queue_depth: p.queue_depth,
            max_io_bytes: p.max_io_bytes,
            threads: self.cfg.threads,
            qos: p.qos,
            recover_dev_id: None,
            pinned: status.pinned,
            extent_check_secs: self.cfg.extent_check_secs,
            allocation: p.allocation,
            image_lock: lock.is_some(),
            decided_map: false,
        };
        self.workers.lock().expect("workers poisoned").insert(
            volume_id,
            Worker {
                pid: state.pid,
                dev_id: state.dev_id,
                image,
                lock,
                spec,
                stopping: Arc::default(),
                forget: Arc::default(),
                private,
            },
        );
        self.supervise(volume_id);
        Ok(Probe::Alive(Box::new(att)))
    }
}
