//! One supervisor for every worker: a single thread waits, in one epoll
//! set, on each worker's pidfd and on an inotify watch of each run dir, and
//! sleeps until something happens. A worker that ends unasked is recovered
//! on a short-lived thread of its own (one slow recovery does not hold up
//! noticing another crash); a worker that leaves the direct path on its own
//! rewrites its state file, which is how the supervisor learns it is
//! degraded, without asking.
//!
//! The supervisor cannot fail silently. Its thread restarts itself after an
//! error or a panic (with a backoff), a start that fails is tried again, a
//! worker whose pidfd cannot be opened for a reason other than its death
//! (`ESRCH`; EMFILE and its kin say nothing of the process) is watched again
//! later, and a recovery thread that cannot start is started again. Each of
//! those is logged, and kept in [`Supervisor`]'s status, which `GET /v1/host`,
//! `/metrics` and each volume's state show. It wakes on a timer only while
//! something waits to be tried again.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use rustix::event::{EventfdFlags, epoll};
use rustix::fs::inotify;
use rustix::io::Errno;
use uuid::Uuid;

use super::UblkBackend;
use crate::backend::{BackendEvent, Stopped, SupervisorState, SupervisorStatus, Unsupervised};
use crate::fault::SupervisorFault;
use blockplane_api::model::VolumeState;
use blockplane_protocol::{self as protocol, Answer, Request, STATE_FILE};

/// The epoll key of the wake-up eventfd.
const WAKE: u64 = u64::MAX;
/// The epoll key of the inotify descriptor.
const RUN_DIRS: u64 = u64::MAX - 1;
/// The longest wait before something that failed is tried again.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A supervisor that ran this long before it stopped starts its backoff
/// afresh.
const RAN_WELL: Duration = Duration::from_secs(60);

/// The wait before try `attempt` (1, 2, ...) of something that failed:
/// 100 ms, doubling, at most [`MAX_BACKOFF`].
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(100)
        .saturating_mul(1 << attempt.saturating_sub(1).min(16))
        .min(MAX_BACKOFF)
}

/// The supervisor's handle, shared by every clone of the backend.
pub(super) struct Supervisor {
    /// Written to when the set of workers changed (one started, replaced,
    /// recovered or stopped).
    wake: OwnedFd,
    status: Mutex<Status>,
}

/// What the supervisor's thread, the API and the recovery threads share.
struct Status {
    state: SupervisorState,
    /// Its thread lives (supervising, or waiting to restart itself).
    thread: bool,
    /// Times it stopped or failed to start since the service started.
    restarts: u64,
    /// Starts of its thread that failed in a row, and when the next may be
    /// tried.
    start_failures: u32,
    next_start: Instant,
    /// Workers not supervised now, and why (the supervisor's own state
    /// aside).
    unsupervised: HashMap<Uuid, Unsupervised>,
    /// Volumes whose dead worker a recovery thread is replacing now (one at
    /// a time per volume, across a restart of the supervisor).
    recovering: HashSet<Uuid>,
    /// The last degraded reason reported per volume (outlives its workers,
    /// as the run dir does, and the supervisor's restarts).
    degraded: HashMap<Uuid, Option<String>>,
}

impl Supervisor {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            wake: rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            status: Mutex::new(Status {
                state: SupervisorState::Starting {
                    since: SystemTime::now(),
                },
                thread: false,
                restarts: 0,
                start_failures: 0,
                next_start: Instant::now(),
                unsupervised: HashMap::new(),
                recovering: HashSet::new(),
                degraded: HashMap::new(),
            }),
        })
    }

    /// Makes the supervisor look at the workers again.
    fn poke(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// The status (a panic elsewhere does not hide it).
    fn status(&self) -> MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records why a worker is not supervised (`None`: it is again).
    fn set_unsupervised(&self, volume_id: Uuid, why: Option<Unsupervised>) {
        let mut st = self.status();
        match why {
            Some(w) => st.unsupervised.insert(volume_id, w),
            None => st.unsupervised.remove(&volume_id),
        };
    }
}

/// What is to be tried again for one worker, and when.
#[derive(Debug, Clone, Copy)]
struct Retry {
    what: Pending,
    at: Instant,
    attempt: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    /// Opening or watching its pidfd failed for a reason that says nothing
    /// of the process.
    Watch,
    /// It ended, and the thread that recovers it could not start.
    Recovery,
}

/// What the supervisor knows of one volume's worker.
struct Watched {
    pid: u32,
    /// Its epoll key.
    key: u64,
    /// `None`: gone before it could be watched, or not watched yet
    /// (`retry`).
    pidfd: Option<OwnedFd>,
    /// Ended, and handed to a thread that recovers it (or finds it stopped
    /// or replaced): not watched again until the workers map names another
    /// pid.
    ended: bool,
    /// The run dir's inotify watch.
    wd: Option<i32>,
    /// Something that failed, to try again.
    retry: Option<Retry>,
}

/// The supervisor's own state, on its thread.
struct Set {
    epoll: OwnedFd,
    inotify: OwnedFd,
    watched: HashMap<Uuid, Watched>,
    /// Workers no longer supervised (stopped, or replaced by a handover)
    /// that have not ended yet: watched only to be reaped.
    leaving: HashMap<u64, OwnedFd>,
    next_key: u64,
}

impl Set {
    /// How long until the next retry is due (none: no wait bound).
    fn next_retry(&self) -> Option<rustix::event::Timespec> {
        let at = self
            .watched
            .values()
            .filter_map(|w| w.retry.map(|r| r.at))
            .min()?;
        Some(
            rustix::event::Timespec::try_from(at.saturating_duration_since(Instant::now()))
                .unwrap_or(rustix::event::Timespec {
                    tv_sec: 5,
                    tv_nsec: 0,
                }),
        )
    }
}

impl Set {
    /// Stops supervising `w`: a process still running is only reaped when
    /// it ends.
    fn let_go(&mut self, w: &Watched) {
        let Some(fd) = w.pidfd.as_ref().filter(|_| !w.ended) else {
            return;
        };
        match fd.try_clone() {
            Ok(dup) => {
                let _ = epoll::delete(&self.epoll, fd);
                if epoll::add(
                    &self.epoll,
                    &dup,
                    epoll::EventData::new_u64(w.key),
                    epoll::EventFlags::IN,
                )
                .is_ok()
                {
                    self.leaving.insert(w.key, dup);
                }
            }
            Err(_) => {
                let _ = epoll::delete(&self.epoll, fd);
            }
        }
    }
}

/// Stops watching an ended worker and reaps it when it is this service's
/// child (a worker adopted after a restart is not: its parent is init).
fn reap(epoll: &OwnedFd, pidfd: &OwnedFd) {
    let _ = epoll::delete(epoll, pidfd);
    let _ = rustix::process::waitid(
        rustix::process::WaitId::PidFd(pidfd.as_fd()),
        rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOHANG,
    );
}

impl UblkBackend {
    /// A handle on this backend for another thread.
    fn handle(&self) -> UblkBackend {
        UblkBackend {
            cfg: self.cfg.clone(),
            exe: self.exe.clone(),
            workers: self.workers.clone(),
            events: self.events.clone(),
            supervisor: self.supervisor.clone(),
        }
    }

    /// Whether a test asked the supervisor to suffer `what` now (its
    /// fault armed, and `<data dir>/run/supervisor-gate` present).
    fn injects(&self, what: SupervisorFault) -> bool {
        let on = self.cfg.faults.supervisor(what)
            && self.cfg.run_root.with_file_name("supervisor-gate").exists();
        if on {
            tracing::warn!(?what, "test fault: the worker supervisor fails");
        }
        on
    }

    /// Makes the supervisor look at the workers map again (and starts it,
    /// if it does not run).
    pub(super) fn supervisor_poke(&self) {
        self.ensure_supervisor();
        self.supervisor.poke();
    }

    /// Watches a worker just recorded in the workers map: starts the one
    /// supervisor thread of every worker if it does not run, then makes it
    /// look at the map again. A worker that dies unasked is replaced by a
    /// new one that recovers its device.
    pub(super) fn supervise(&self) {
        self.supervisor_poke();
    }

    /// Starts the supervisor thread unless it lives, or a start failed
    /// lately (it is tried again after a backoff: at the next worker, API
    /// read or stats tick).
    pub(super) fn ensure_supervisor(&self) {
        let mut st = self.supervisor.status();
        if st.thread || Instant::now() < st.next_start {
            return;
        }
        let backend = self.handle();
        let spawned = if self.injects(SupervisorFault::Start) {
            Err(std::io::Error::other(
                "test fault: no thread for the supervisor",
            ))
        } else {
            std::thread::Builder::new()
                .name("supervise".into())
                .spawn(move || backend.run_supervisor())
        };
        match spawned {
            Ok(_) => {
                st.thread = true;
                st.start_failures = 0;
            }
            Err(e) => {
                st.start_failures += 1;
                let wait = backoff(st.start_failures);
                st.next_start = Instant::now() + wait;
                st.restarts += 1;
                let reason = Stopped::StartFailed(e.to_string());
                tracing::error!(%reason, attempt = st.start_failures, retry_in = ?wait, "the worker supervisor could not start: crashed workers are not recovered until it runs");
                let since = match &st.state {
                    SupervisorState::Restarting { since, .. } => *since,
                    _ => SystemTime::now(),
                };
                st.state = SupervisorState::Restarting { since, reason };
            }
        }
    }

    /// Whether the supervisor runs, and how many workers it does not watch
    /// (starting it first, if it should run and does not).
    pub(super) fn supervisor_status(&self) -> SupervisorStatus {
        self.ensure_supervisor();
        let st = self.supervisor.status();
        SupervisorStatus {
            state: st.state.clone(),
            restarts: st.restarts,
            unsupervised: st.unsupervised.len() as u64,
        }
    }

    /// Why the worker of `volume_id` is not supervised now (`None`: it is).
    pub(super) fn unsupervised(&self, volume_id: Uuid) -> Option<Unsupervised> {
        let st = self.supervisor.status();
        match &st.state {
            SupervisorState::Running { .. } => st.unsupervised.get(&volume_id).cloned(),
            SupervisorState::Starting { .. } => None,
            SupervisorState::Restarting { reason, .. } => {
                Some(Unsupervised::SupervisorDown(reason.clone()))
            }
        }
    }

    /// The supervisor thread: supervises until an error or a panic, says
    /// so, and supervises again after a backoff, for as long as the service
    /// runs.
    fn run_supervisor(&self) {
        let mut failures = 0;
        loop {
            let began = Instant::now();
            let stopped = match std::panic::catch_unwind(AssertUnwindSafe(|| self.supervise_all()))
            {
                Ok(Err(e)) => Stopped::Failed(e.to_string()),
                Err(panic) => Stopped::Panicked(
                    panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "no message".into()),
                ),
            };
            if began.elapsed() > RAN_WELL {
                failures = 0;
            }
            failures += 1;
            let wait = backoff(failures);
            tracing::error!(reason = %stopped, attempt = failures, restart_in = ?wait, "the worker supervisor stopped: crashed workers are not recovered until it restarts");
            {
                let mut st = self.supervisor.status();
                st.restarts += 1;
                st.state = SupervisorState::Restarting {
                    since: SystemTime::now(),
                    reason: stopped,
                };
            }
            std::thread::sleep(wait);
        }
    }

    fn supervise_all(&self) -> std::io::Result<std::convert::Infallible> {
        let mut set = self.new_set()?;
        // A new set: each worker's watch is taken again.
        self.supervisor.status().unsupervised.clear();
        let mut events = Vec::with_capacity(64);
        let mut announced = false;
        loop {
            if self.injects(SupervisorFault::Panic) {
                panic!("test fault: the worker supervisor panics");
            }
            self.sync(&mut set);
            self.retry_due(&mut set);
            if !announced {
                // It runs once it has looked at every worker.
                announced = true;
                let mut st = self.supervisor.status();
                if !matches!(st.state, SupervisorState::Running { .. }) {
                    tracing::info!(restarts = st.restarts, "the worker supervisor runs");
                }
                st.state = SupervisorState::Running {
                    since: SystemTime::now(),
                };
            }
            events.clear();
            let timeout = set.next_retry();
            let waited = if self.injects(SupervisorFault::Wait) {
                Err(Errno::IO)
            } else {
                epoll::wait(
                    &set.epoll,
                    rustix::buffer::spare_capacity(&mut events),
                    timeout.as_ref(),
                )
            };
            match waited {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => {
                    return Err(std::io::Error::other(format!(
                        "epoll_wait: {}",
                        std::io::Error::from(e)
                    )));
                }
            }
            for ev in &events {
                match ev.data.u64() {
                    WAKE => {
                        let mut buf = [0u8; 8];
                        let _ = rustix::io::read(&self.supervisor.wake, &mut buf);
                    }
                    RUN_DIRS => self.state_files_changed(&mut set),
                    key => match set.leaving.remove(&key) {
                        Some(fd) => reap(&set.epoll, &fd),
                        None => self.ended(&mut set, key),
                    },
                }
            }
        }
    }

    /// An empty set, woken by the wake-up eventfd and by changes in the run
    /// dirs.
    fn new_set(&self) -> std::io::Result<Set> {
        let set = Set {
            epoll: epoll::create(epoll::CreateFlags::CLOEXEC)?,
            inotify: inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?,
            watched: HashMap::new(),
            leaving: HashMap::new(),
            next_key: 0,
        };
        epoll::add(
            &set.epoll,
            &self.supervisor.wake,
            epoll::EventData::new_u64(WAKE),
            epoll::EventFlags::IN,
        )?;
        epoll::add(
            &set.epoll,
            &set.inotify,
            epoll::EventData::new_u64(RUN_DIRS),
            epoll::EventFlags::IN,
        )?;
        Ok(set)
    }

    /// Brings the set in line with the workers map: new and replaced
    /// workers watched, stopped and forgotten ones dropped.
    fn sync(&self, set: &mut Set) {
        let now: Vec<(Uuid, u32)> = {
            let workers = self.workers.lock().expect("workers poisoned");
            workers
                .iter()
                .filter(|(_, w)| !w.forget.load(Relaxed))
                .map(|(id, w)| (*id, w.pid))
                .collect()
        };
        let gone: Vec<Uuid> = set
            .watched
            .keys()
            .filter(|id| !now.iter().any(|(v, _)| v == *id))
            .copied()
            .collect();
        for id in gone {
            let w = set.watched.remove(&id).expect("listed");
            set.let_go(&w);
            if let Some(wd) = w.wd {
                let _ = inotify::remove_watch(&set.inotify, wd);
            }
            let mut st = self.supervisor.status();
            st.degraded.remove(&id);
            st.unsupervised.remove(&id);
        }
        for (id, pid) in now {
            if set.watched.get(&id).is_some_and(|w| w.pid == pid) {
                continue;
            }
            let wd = match set.watched.remove(&id) {
                Some(old) => {
                    set.let_go(&old);
                    old.wd
                }
                None => inotify::add_watch(
                    &set.inotify,
                    self.run_dir(id),
                    inotify::WatchFlags::MOVED_TO | inotify::WatchFlags::CLOSE_WRITE,
                )
                .ok(),
            };
            let key = set.next_key;
            set.next_key += 1;
            set.watched.insert(
                id,
                Watched {
                    pid,
                    key,
                    pidfd: None,
                    ended: false,
                    wd,
                    retry: None,
                },
            );
            self.supervisor.set_unsupervised(id, None);
            // A worker found degraded (adopted after a restart, or it
            // degraded before it was watched) is news too.
            self.check_degraded(id);
            self.watch(set, id);
        }
    }

    /// Opens and watches the pidfd of `volume_id`'s worker. Only `ESRCH`
    /// says it is gone (then it is recovered); any other failure (EMFILE,
    /// ENFILE, ENOMEM...) leaves it not supervised, tried again after a
    /// backoff.
    fn watch(&self, set: &mut Set, volume_id: Uuid) {
        let Some(w) = set.watched.get_mut(&volume_id) else {
            return;
        };
        let pid = w.pid;
        let opened = if self.injects(SupervisorFault::PidfdOpen) {
            Err(Errno::MFILE)
        } else {
            rustix::process::pidfd_open(
                rustix::process::Pid::from_raw(pid as i32).expect("pid > 0"),
                rustix::process::PidfdFlags::empty(),
            )
        };
        let failed = match opened {
            Ok(fd) => match epoll::add(
                &set.epoll,
                &fd,
                epoll::EventData::new_u64(w.key),
                epoll::EventFlags::IN,
            ) {
                Ok(()) => {
                    w.pidfd = Some(fd);
                    None
                }
                Err(e) => Some(format!("epoll_ctl: {}", std::io::Error::from(e))),
            },
            Err(Errno::SRCH) => {
                let key = w.key;
                w.retry = None;
                self.supervisor.set_unsupervised(volume_id, None);
                self.ended(set, key);
                return;
            }
            Err(e) => Some(format!("pidfd_open: {}", std::io::Error::from(e))),
        };
        match failed {
            None => {
                if let Some(r) = w.retry.take() {
                    tracing::info!(%volume_id, pid, attempts = r.attempt, "the worker is watched again");
                }
                self.supervisor.set_unsupervised(volume_id, None);
            }
            Some(error) => {
                let attempt = w.retry.map_or(1, |r| r.attempt + 1);
                let wait = backoff(attempt);
                if attempt == 1 {
                    tracing::error!(%volume_id, pid, %error, retry_in = ?wait, "cannot watch the worker (it is not taken for dead): a crash of it is not recovered until it is watched");
                } else {
                    tracing::debug!(%volume_id, pid, %error, attempt, "still cannot watch the worker");
                }
                w.retry = Some(Retry {
                    what: Pending::Watch,
                    at: Instant::now() + wait,
                    attempt,
                });
                self.supervisor
                    .set_unsupervised(volume_id, Some(Unsupervised::CannotWatch { pid, error }));
            }
        }
    }

    /// Tries again what failed and is due.
    fn retry_due(&self, set: &mut Set) {
        let now = Instant::now();
        let due: Vec<(Uuid, Pending)> = set
            .watched
            .iter()
            .filter_map(|(id, w)| w.retry.filter(|r| r.at <= now).map(|r| (*id, r.what)))
            .collect();
        for (id, what) in due {
            match what {
                Pending::Watch => self.watch(set, id),
                Pending::Recovery => self.start_recovery(set, id),
            }
        }
    }

    /// The worker under epoll key `key` ended: stopped, handed over, or
    /// crashed; the last is recovered, on a thread of its own.
    fn ended(&self, set: &mut Set, key: u64) {
        let Some((&volume_id, w)) = set.watched.iter_mut().find(|(_, w)| w.key == key) else {
            return;
        };
        if w.ended {
            return;
        }
        w.ended = true;
        if let Some(fd) = &w.pidfd {
            reap(&set.epoll, fd);
        }
        self.start_recovery(set, volume_id);
    }

    /// Starts the thread that recovers the ended worker of `volume_id`
    /// (unless one runs already); one that cannot start is tried again
    /// after a backoff, and the volume says so meanwhile.
    fn start_recovery(&self, set: &mut Set, volume_id: Uuid) {
        let Some(w) = set.watched.get_mut(&volume_id) else {
            return;
        };
        let pid = w.pid;
        if !self.supervisor.status().recovering.insert(volume_id) {
            // A recovery thread from before a restart of the supervisor
            // still works on it.
            w.retry = None;
            return;
        }
        let backend = self.handle();
        let spawned = if self.injects(SupervisorFault::RecoverySpawn) {
            Err(std::io::Error::other(
                "test fault: no thread for the recovery",
            ))
        } else {
            std::thread::Builder::new()
                .name(format!("recover-{}", &volume_id.to_string()[..8]))
                .spawn(move || {
                    let done = Recovering(&backend, volume_id);
                    backend.after_end(volume_id, pid);
                    drop(done);
                    backend.supervisor.poke();
                })
        };
        match spawned {
            Ok(_) => {
                if let Some(r) = w.retry.take() {
                    tracing::info!(%volume_id, pid, attempts = r.attempt, "the worker's recovery started");
                }
                self.supervisor.set_unsupervised(volume_id, None);
            }
            Err(e) => {
                self.supervisor.status().recovering.remove(&volume_id);
                let attempt = w.retry.map_or(1, |r| r.attempt + 1);
                let wait = backoff(attempt);
                let error = e.to_string();
                if attempt == 1 {
                    tracing::error!(%volume_id, pid, %error, retry_in = ?wait, "the worker died and the thread that recovers it could not start: its I/O waits until it does");
                } else {
                    tracing::debug!(%volume_id, pid, %error, attempt, "the worker's recovery still cannot start");
                }
                w.retry = Some(Retry {
                    what: Pending::Recovery,
                    at: Instant::now() + wait,
                    attempt,
                });
                self.supervisor.set_unsupervised(
                    volume_id,
                    Some(Unsupervised::RecoveryNotStarted { pid, error }),
                );
            }
        }
    }

    /// What `supervise_loop` did once a worker's pidfd fired.
    fn after_end(&self, volume_id: Uuid, pid: u32) {
        let flags = self.worker_of(volume_id, |w| (w.stopping.clone(), w.forget.clone()));
        let Some((stopping, forget)) = flags else {
            return;
        };
        if stopping.load(Relaxed) || forget.load(Relaxed) {
            return;
        }
        // A handover ends its worker on purpose: it starts the next one,
        // or, when it could not, leaves the dead one's device to us.
        while self.worker_of(volume_id, |w| w.handing_over.load(Relaxed)) == Some(true) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.worker_of(volume_id, |w| w.pid) == Some(pid) {
            self.recover_after_crash(volume_id, pid);
        }
    }

    /// Reads the inotify events: a state file rewritten may carry news.
    fn state_files_changed(&self, set: &mut Set) {
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
        let mut changed = Vec::new();
        {
            let mut reader = inotify::Reader::new(&set.inotify, &mut buf);
            while let Ok(ev) = reader.next() {
                if ev
                    .file_name()
                    .is_some_and(|n| n.to_bytes() == STATE_FILE.as_bytes())
                {
                    changed.push(ev.wd());
                }
            }
        }
        let ids: Vec<Uuid> = set
            .watched
            .iter()
            .filter(|(_, w)| w.wd.is_some_and(|wd| changed.contains(&wd)))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.check_degraded(id);
        }
    }

    /// Reports a volume whose worker's state file says it became degraded
    /// (once per reason), and records that a replacement starts on nowait.
    fn check_degraded(&self, volume_id: Uuid) {
        let Some(private) = self.worker_of(volume_id, |w| w.private) else {
            return;
        };
        if private {
            return;
        }
        let now = self.state_file(volume_id).and_then(|s| s.degraded);
        {
            let mut st = self.supervisor.status();
            let last = st.degraded.entry(volume_id).or_default();
            if *last == now {
                return;
            }
            *last = now.clone();
        }
        let Some(reason) = now else { return };
        // A replacement worker starts where this one is now.
        self.record(volume_id, |spec| spec.dispatch = protocol::DataPath::Nowait);
        // The event carries the attachment as the worker has it now: asked
        // off this thread, so a slow worker holds up no other.
        let backend = self.handle();
        let spawned = std::thread::Builder::new()
            .name(format!("degraded-{}", &volume_id.to_string()[..8]))
            .spawn(move || {
                let status = protocol::talk(
                    &backend.socket(volume_id),
                    &Request::Status {},
                    Duration::from_secs(5),
                );
                let attachment = match status {
                    Ok(Answer::Status(s)) => backend.attachment(&s).ok(),
                    _ => None,
                };
                if let Some(att) = attachment {
                    backend.events.send(BackendEvent {
                        volume_id,
                        kind: "volume_degraded",
                        message: reason,
                        attachment: Some(att),
                        state: Some(VolumeState::Degraded),
                    });
                }
            });
        if let Err(e) = spawned {
            // The volume's state says degraded at the next start; the
            // event is lost.
            tracing::error!(%volume_id, error = %e, "could not report the volume degraded: no thread");
        }
    }
}

/// Marks a volume's recovery done when its thread ends, however it ends.
struct Recovering<'a>(&'a UblkBackend, Uuid);

impl Drop for Recovering<'_> {
    fn drop(&mut self) {
        self.0.supervisor.status().recovering.remove(&self.1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_100_ms_to_at_most_5_s() {
        let waits: Vec<u128> = (1..=8).map(|n| backoff(n).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }
}
