//! Workers: starting one (detached, its image and lock on fixed fds),
//! replacing one that died (the supervisor, [`super::supervisor`], notices),
//! and the run dirs that let a restarted service find it again.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use libublk::sys;
use uuid::Uuid;

use super::{START_TIMEOUT, TALK_TIMEOUT, UblkBackend, Worker, io, kernel};
use crate::backend::wire;
use crate::backend::{
    AttachRequest, Attachment, BackendError, BackendEvent, Decision, Probe, ProbeRequest,
    VolumeParams,
};
use crate::fault::After;
use blockplane_api::model::{DispatchPolicy, VolumeState};
use blockplane_protocol::{
    self as protocol, Answer, GO_FD, IMAGE_FD, LOCK_FD, Peer, Request, Status, WorkerSpec,
    worker_spec,
};
use blockplane_system::extent::{self, ExtentMap, Pin};

/// A worker process started, its device not yet known to serve.
pub(super) struct Spawned {
    pub child: std::process::Child,
    pub volume_id: Uuid,
    pub run_dir: PathBuf,
}

/// What a dead worker of a volume left for the next one.
struct LeftBehind {
    /// Its device, to recover.
    recover: Option<u32>,
    /// The pin of the owner's own flag, kept by the recovering worker.
    pinned: Option<Pin>,
}

/// A worker started and serving.
pub(super) struct Started {
    pub pid: u32,
    /// Its first answer.
    pub status: Status,
    /// What it said of itself in the handshake.
    pub peer: Peer,
}

impl UblkBackend {
    pub(super) fn run_dir(&self, volume_id: Uuid) -> PathBuf {
        self.cfg.run_root.join(volume_id.to_string())
    }

    pub(super) fn state_file(&self, volume_id: Uuid) -> Option<blockplane_protocol::StateFile> {
        blockplane_protocol::StateFile::read(&self.run_dir(volume_id))
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

    /// Starts a worker and waits until its device serves; returns its status.
    /// `lock` (an image lock, when `spec.image_lock`) goes to the worker as
    /// [`LOCK_FD`].
    pub(super) fn start_worker(
        &self,
        spec: WorkerSpec,
        image: &OwnedFd,
        lock: Option<&OwnedFd>,
        decided: Option<&ExtentMap>,
    ) -> Result<Started, BackendError> {
        self.start_worker_as(spec, image, lock, decided, |_| {})
    }

    /// [`Self::start_worker`], with the spec's JSON changed by `edit` first
    /// (a test fault's spec that a worker refuses).
    pub(super) fn start_worker_as(
        &self,
        spec: WorkerSpec,
        image: &OwnedFd,
        lock: Option<&OwnedFd>,
        decided: Option<&ExtentMap>,
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> Result<Started, BackendError> {
        let spawned = self.spawn_worker(spec, image, lock, decided, None, edit)?;
        self.until_serving(spawned)
    }

    /// Starts a worker process, not waiting for it. `go` (a handover's, see
    /// [`protocol::GO_FD`]) goes to it as `GO_FD`; with it the old worker's
    /// control socket is left for the old worker, which still serves.
    pub(super) fn spawn_worker(
        &self,
        mut spec: WorkerSpec,
        image: &OwnedFd,
        lock: Option<&OwnedFd>,
        decided: Option<&ExtentMap>,
        go: Option<&OwnedFd>,
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> Result<Spawned, BackendError> {
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
        if go.is_none() {
            let _ = std::fs::remove_file(run_dir.join("ctl.sock"));
        }
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(run_dir.join("worker.out"))
            .map_err(|e| io("open worker output", run_dir.display().to_string(), e))?;
        let mut json = serde_json::to_value(&spec).expect("spec serializes");
        edit(&mut json);
        // The service's own file, whatever the path holds now.
        let mut cmd = Command::new(self.exe.program());
        cmd.arg0(&self.exe.path)
            .arg("worker")
            .arg("--spec")
            .arg(json.to_string())
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(|e| io("dup", "worker output", e))?)
            .stderr(out);
        pass_fds(
            &mut cmd,
            [
                Some(image.as_raw_fd()),
                lock.map(|l| l.as_raw_fd()),
                go.map(|g| g.as_raw_fd()),
            ],
        );
        tracing::debug!(volume_id = %spec.volume_id, "starting a worker");
        let child = cmd
            .spawn()
            .map_err(|e| io("start worker", self.exe.path.display().to_string(), e))?;
        tracing::debug!(volume_id = %spec.volume_id, pid = child.id(), "worker started");
        Ok(Spawned {
            child,
            volume_id: spec.volume_id,
            run_dir: run_dir.clone(),
        })
    }

    /// Waits until a spawned worker's device serves; its status.
    pub(super) fn until_serving(&self, spawned: Spawned) -> Result<Started, BackendError> {
        let Spawned {
            mut child,
            volume_id,
            run_dir,
        } = spawned;
        let pid = child.id();
        let socket = run_dir.join("ctl.sock");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok((peer, Answer::Status(s))) =
                protocol::converse(&socket, &Request::Status {}, TALK_TIMEOUT)
            {
                // Reaped by the supervisor when it ends (no thread waits
                // on it meanwhile).
                drop(child);
                return Ok(Started {
                    pid,
                    status: *s,
                    peer,
                });
            }

            if let Ok(Some(status)) = child.try_wait() {
                // A worker that died after adding its device under the same
                // test fault: the service dies with it, before cleaning up.
                self.cfg.faults.kill_point(After::Add);
                return Err(BackendError::io(
                    "start worker",
                    format!("volume {volume_id}"),
                    io::Error::other(format!(
                        "worker exited ({status}): {}",
                        last_error_line(&run_dir)
                    )),
                ));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BackendError::io(
                    "start worker",
                    format!("volume {volume_id}"),
                    io::Error::other(format!(
                        "no answer within {START_TIMEOUT:?}: {}",
                        last_error_line(&run_dir)
                    )),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Records worker `pid`, started from `spec`, as the one serving
    /// `volume_id` now.
    pub(super) fn serves_now(&self, volume_id: Uuid, pid: u32, spec: WorkerSpec, peer: Peer) {
        if let Some(w) = self
            .workers
            .lock()
            .expect("workers poisoned")
            .get_mut(&volume_id)
        {
            w.pid = pid;
            w.spec = spec;
            w.peer = peer;
        }
        self.supervisor_poke();
    }

    /// `f` of the worker of `volume_id`, if there is one.
    pub(super) fn worker_of<T>(&self, volume_id: Uuid, f: impl FnOnce(&Worker) -> T) -> Option<T> {
        self.workers
            .lock()
            .expect("workers poisoned")
            .get(&volume_id)
            .map(f)
    }

    /// Starts a replacement worker that recovers the device of a dead one.
    pub(super) fn recover_after_crash(&self, volume_id: Uuid, old_pid: u32) {
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Duplicates of its image and lock for the new worker: one that
            // fails (EMFILE...) fails this attempt, as a start would.
            let held = {
                let w = self.workers.lock().expect("workers poisoned");
                let Some(w) = w.get(&volume_id) else { return };
                w.image
                    .try_clone()
                    .and_then(|image| {
                        let lock = w.lock.as_ref().map(OwnedFd::try_clone).transpose()?;
                        Ok((w.spec.clone(), image, lock, w.private))
                    })
                    .map_err(|e| {
                        io(
                            "dup the image and its lock of",
                            format!("volume {volume_id}"),
                            e,
                        )
                    })
            };
            let started = held.and_then(|(mut spec, image, lock, private)| {
                let state = self.state_file(volume_id);
                let dev_id = state.as_ref().map(|s| s.dev_id).unwrap_or(u32::MAX);
                spec.recover_dev_id = Some(dev_id);
                spec.pinned = state.and_then(|s| s.pinned);
                self.start_worker(spec.clone(), &image, lock.as_ref(), None)
                    .map(|started| (started, spec, private))
            });
            match started {
                Ok((Started { pid, status, peer }, spec, private)) => {
                    self.serves_now(volume_id, pid, spec, peer);
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

    pub(super) fn attach_worker(
        &self,
        mut req: AttachRequest,
        private: bool,
    ) -> Result<Attachment, BackendError> {
        let left = self.left_behind(&mut req)?;
        let mut decision = req.take_decision(&self.path())?;
        // Only the first start checks the decided map; a replacement
        // worker finds the image pinned and reads its map under that pin.
        let decided = match decision.dispatch {
            DispatchPolicy::Direct => decision.map.take(),
            _ => None,
        };
        let spec = self.first_spec(&req, decision, left);
        let started = self.start_worker(
            spec.clone(),
            &req.image_fd,
            req.image_lock.as_ref(),
            decided.as_ref(),
        );
        let Started { pid, status, peer } =
            started.inspect_err(|_| self.remove_unstarted(req.volume_id))?;
        let att = self.attachment(&status)?;
        let worker = Worker::new(
            pid,
            status.dev_id,
            peer,
            req.image_fd,
            req.image_lock,
            spec,
            private,
        );
        self.workers
            .lock()
            .expect("workers poisoned")
            .insert(req.volume_id, worker);
        self.supervise();
        Ok(att)
    }

    /// What a dead worker of this volume left: its device to recover (so
    /// the data in flight when it died is reissued, not lost) and, with it,
    /// the pin of the owner's own flag. A pin of its own is lifted here.
    fn left_behind(&self, req: &mut AttachRequest) -> Result<LeftBehind, BackendError> {
        let earlier = self.state_file(req.volume_id);
        let dead = earlier
            .as_ref()
            .filter(|s| !is_our_worker(s.pid, req.volume_id));
        // Still LIVE is a server that died just now: the kernel quiesces its
        // device soon after (on 6.12 its monitor looks every 5 s), and the
        // new worker's START_USER_RECOVERY waits for that.
        let recover = dead.and_then(|s| match kernel::device_state(s.dev_id) {
            Some(sys::UBLK_S_DEV_QUIESCED | sys::UBLK_S_DEV_LIVE) => Some(s.dev_id),
            Some(_) => {
                kernel::delete_device(s.dev_id);
                None
            }
            None => None,
        });
        let mut pinned = dead.and_then(|s| s.pinned);
        if let Some(pin) = pinned.filter(|p| !p.was_immutable) {
            // A direct worker that died with no service to replace it (its
            // pod or cgroup killed whole) left its pin, which keeps the
            // image from opening for writing and reads as the owner's flag
            // to the decision. Nothing serves its device meanwhile (gone, or
            // quiesced): lift the pin, decide afresh, and let the new worker
            // map and pin again (under the decided map: nothing moved in
            // between).
            extent::unpin(req.image_fd.as_fd(), pin)
                .map_err(|e| io("unpin", req.params.image_path.clone(), e))?;
            pinned = None;
            // Opened while pinned, the manager's handle is read-only.
            if !req.params.read_only && blockplane_system::image::is_read_only(&req.image_fd) {
                req.image_fd = blockplane_system::image::reopen(&req.image_fd, true)
                    .map_err(|e| io("reopen for writing", req.params.image_path.clone(), e))?;
            }
        }
        // The owner's own flag (a read-only volume) stays, as the recovering
        // worker's to keep.
        Ok(LeftBehind {
            recover,
            pinned: pinned.filter(|_| recover.is_some()),
        })
    }

    /// The spec of a volume's first worker (not a replacement's).
    fn first_spec(&self, req: &AttachRequest, decision: Decision, left: LeftBehind) -> WorkerSpec {
        WorkerSpec {
            volume_id: req.volume_id,
            run_dir: self.run_dir(req.volume_id),
            image_path: req.params.image_path.clone(),
            size_bytes: req.params.size_bytes,
            read_only: req.params.read_only,
            refuse_writes: req.params.refuse_writes,
            dispatch: decision.data_path(),
            dispatch_reason: decision.reason.to_string(),
            dispatch_why: Some(decision.reason),
            queues: req.params.queues,
            queue_depth: req.params.queue_depth,
            max_io_bytes: req.params.max_io_bytes,
            threads: self.cfg.threads,
            qos: wire::limits(req.params.qos),
            recover_dev_id: left.recover,
            pinned: left.pinned,
            extent_check_secs: self.cfg.extent_check_secs,
            allocation: wire::allocation(req.params.allocation),
            image_lock: req.image_lock.is_some(),
            decided_map: false,
            handover: false,
        }
    }

    /// After a start that failed: deletes the device its worker added but
    /// never started (named in the run dir: the worker writes it there at
    /// once), now that the worker is gone.
    fn remove_unstarted(&self, volume_id: Uuid) {
        let Some(s) = self.state_file(volume_id) else {
            return;
        };
        if !is_our_worker(s.pid, volume_id)
            && kernel::device_state(s.dev_id) == Some(sys::UBLK_S_DEV_DEAD)
        {
            tracing::warn!(%volume_id, dev_id = s.dev_id, "deleting the ublk device a failed worker added and never started");
            kernel::delete_device(s.dev_id);
        }
    }

    pub(super) fn probe_worker(
        &self,
        req: ProbeRequest,
        private: bool,
    ) -> Result<Probe, BackendError> {
        let (volume_id, identity) = (req.volume_id, req.identity);
        let Some(state) = self.state_file(volume_id) else {
            return Ok(Probe::Gone);
        };
        if !is_our_worker(state.pid, volume_id) {
            // Dead worker: attach recovers a quiesced device.
            return Ok(Probe::Gone);
        }
        let (peer, status) = self.ask_with_peer(volume_id, &Request::Status {})?;
        // A handle on the image, to recover the worker later: a duplicate of
        // the worker's own, which is open for writing even when the image is
        // pinned now (the manager's then is not), or else the manager's.
        let image = match (worker_fd(state.pid, IMAGE_FD), req.image) {
            (Ok(fd), _) | (Err(_), Some(fd)) => fd,
            (Err(e), None) => return Err(e),
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
        let spec = self.adopted_spec(volume_id, &req.params, &status, lock.is_some());
        let worker = Worker::new(state.pid, state.dev_id, peer, image, lock, spec, private);
        self.workers
            .lock()
            .expect("workers poisoned")
            .insert(volume_id, worker);
        self.supervise();
        Ok(Probe::Alive(Box::new(att)))
    }

    /// The spec a replacement of an adopted worker starts from: what the
    /// worker says it serves now (`status`), with the volume's `params`.
    fn adopted_spec(
        &self,
        volume_id: Uuid,
        p: &VolumeParams,
        status: &Status,
        image_lock: bool,
    ) -> WorkerSpec {
        WorkerSpec {
            volume_id,
            run_dir: self.run_dir(volume_id),
            image_path: p.image_path.clone(),
            size_bytes: status.size_bytes,
            read_only: p.read_only,
            refuse_writes: status.read_only,
            dispatch: status.dispatch,
            dispatch_reason: status.dispatch_reason.clone(),
            dispatch_why: Some(status.reason()),
            queues: p.queues,
            queue_depth: p.queue_depth,
            max_io_bytes: p.max_io_bytes,
            threads: self.cfg.threads,
            qos: wire::limits(p.qos),
            recover_dev_id: None,
            pinned: status.pinned,
            extent_check_secs: self.cfg.extent_check_secs,
            allocation: wire::allocation(p.allocation),
            image_lock,
            decided_map: false,
            handover: false,
        }
    }
}

pub(super) fn last_error_line(run_dir: &Path) -> String {
    let text = std::fs::read_to_string(run_dir.join("worker.log")).unwrap_or_default()
        + &std::fs::read_to_string(run_dir.join("worker.out")).unwrap_or_default();
    text.lines()
        .rev()
        .find(|l| l.contains("ERROR") || l.contains("error") || l.contains("worker:"))
        .unwrap_or("no log")
        .to_string()
}

/// The file in a run dir naming the service instance that made it.
const INSTANCE_FILE: &str = "instance";

/// The instance that made a run dir (`None`: unmarked, made before run dirs
/// carried one).
pub(super) fn run_dir_instance(run_dir: &Path) -> Option<String> {
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
            let state = blockplane_protocol::StateFile::read(&run_dir)?;
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
pub(super) fn is_our_worker(pid: u32, volume_id: Uuid) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            let c = String::from_utf8_lossy(&c);
            c.contains("worker") && c.contains(&volume_id.to_string())
        })
        .unwrap_or(false)
}

/// Has `cmd`'s child start a session of its own (signals to the control
/// plane's group do not reach it, and it outlives the control plane) with
/// `passed` (the image, its lock, the go stream) at the worker's fd numbers.
fn pass_fds(cmd: &mut Command, passed: [Option<RawFd>; 3]) {
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            // Above the target numbers first (close-on-exec copies), so
            // no dup2 overwrites another's source, and each target
            // loses close-on-exec even where it was the source's number.
            let moved = passed.map(|fd| fd.map(|fd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 16)));
            for (fd, target) in moved.into_iter().zip([IMAGE_FD, LOCK_FD, GO_FD]) {
                if let Some(fd) = fd
                    && (fd < 0 || libc::dup2(fd, target) < 0)
                {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}
