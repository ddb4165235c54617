//! One supervisor for every worker: a single thread waits, in one epoll
//! set, on each worker's pidfd and on an inotify watch of each run dir, and
//! sleeps until something happens. A worker that ends unasked is recovered
//! on a short-lived thread of its own (one slow recovery does not hold up
//! noticing another crash); a worker that leaves the direct path on its own
//! rewrites its state file, which is how the supervisor learns it is
//! degraded, without asking. Nothing here wakes on a timer.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Once;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use rustix::event::{EventfdFlags, epoll};
use rustix::fs::inotify;
use uuid::Uuid;

use super::{UblkBackend, supervise::STATE_FILE};
use crate::backend::BackendEvent;
use crate::manager::SupervisorFault;
use blockplane_api::model::{DispatchPolicy, VolumeState};
use blockplane_worker::protocol::{self, Answer, Request};

/// The epoll key of the wake-up eventfd.
const WAKE: u64 = u64::MAX;
/// The epoll key of the inotify descriptor.
const RUN_DIRS: u64 = u64::MAX - 1;

/// The supervisor's handle, shared by every clone of the backend.
pub(super) struct Supervisor {
    /// Written to when the set of workers changed (one started, replaced,
    /// recovered or stopped).
    wake: OwnedFd,
    started: Once,
}

impl Supervisor {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            wake: rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            started: Once::new(),
        })
    }

    /// Makes the supervisor look at the workers again.
    fn poke(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

/// What the supervisor knows of one volume's worker.
struct Watched {
    pid: u32,
    /// Its epoll key.
    key: u64,
    /// `None`: the process was gone before it could be watched.
    pidfd: Option<OwnedFd>,
    /// Ended, and handed to a thread that recovers it (or finds it stopped
    /// or replaced): not watched again until the workers map names another
    /// pid.
    ended: bool,
    /// The run dir's inotify watch.
    wd: Option<i32>,
}

/// The supervisor's own state, on its thread.
struct Set {
    epoll: OwnedFd,
    inotify: OwnedFd,
    watched: HashMap<Uuid, Watched>,
    /// The last degraded reason reported per volume (outlives its workers,
    /// as the run dir does).
    degraded: HashMap<Uuid, Option<String>>,
    /// Workers no longer supervised (stopped, or replaced by a handover)
    /// that have not ended yet: watched only to be reaped.
    leaving: HashMap<u64, OwnedFd>,
    next_key: u64,
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

    /// Makes the supervisor look at the workers map again.
    pub(super) fn supervisor_poke(&self) {
        self.supervisor.poke();
    }

    /// Watches a worker just recorded in the workers map: starts the one
    /// supervisor thread of every worker on first use, then makes it look
    /// at the map again. A worker that dies unasked is replaced by a new
    /// one that recovers its device.
    pub(super) fn supervise(&self) {
        self.supervisor.started.call_once(|| {
            let backend = self.handle();
            if self.injects(SupervisorFault::Start) {
                return;
            }
            let _ = std::thread::Builder::new()
                .name("supervise".into())
                .spawn(move || {
                    if let Err(e) = backend.supervise_all() {
                        tracing::error!(error = %e, "the worker supervisor ended: crashed workers are not recovered");
                    }
                });
        });
        self.supervisor.poke();
    }

    fn supervise_all(&self) -> std::io::Result<()> {
        let mut set = Set {
            epoll: epoll::create(epoll::CreateFlags::CLOEXEC)?,
            inotify: inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?,
            watched: HashMap::new(),
            degraded: HashMap::new(),
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
        let mut events = Vec::with_capacity(64);
        loop {
            if self.injects(SupervisorFault::Panic) {
                panic!("test fault: the worker supervisor panics");
            }
            self.sync(&mut set);
            events.clear();
            let waited = if self.injects(SupervisorFault::Wait) {
                Err(rustix::io::Errno::IO)
            } else {
                epoll::wait(
                    &set.epoll,
                    rustix::buffer::spare_capacity(&mut events),
                    None,
                )
            };
            match waited {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
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
            set.degraded.remove(&id);
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
            let pidfd = if self.injects(SupervisorFault::PidfdOpen) {
                Err(rustix::io::Errno::MFILE)
            } else {
                rustix::process::pidfd_open(
                    rustix::process::Pid::from_raw(pid as i32).expect("pid > 0"),
                    rustix::process::PidfdFlags::empty(),
                )
            }
            .ok();
            if let Some(fd) = &pidfd
                && epoll::add(
                    &set.epoll,
                    fd,
                    epoll::EventData::new_u64(key),
                    epoll::EventFlags::IN,
                )
                .is_err()
            {
                tracing::error!(%id, pid, "cannot watch the worker's pidfd");
            }
            let gone_already = pidfd.is_none();
            set.watched.insert(
                id,
                Watched {
                    pid,
                    key,
                    pidfd,
                    ended: false,
                    wd,
                },
            );
            // A worker found degraded (adopted after a restart, or it
            // degraded before it was watched) is news too.
            self.check_degraded(set, id);
            if gone_already {
                self.ended(set, key);
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
        let pid = w.pid;
        let backend = self.handle();
        if self.injects(SupervisorFault::RecoverySpawn) {
            return;
        }
        let _ = std::thread::Builder::new()
            .name(format!("recover-{}", &volume_id.to_string()[..8]))
            .spawn(move || {
                backend.after_end(volume_id, pid);
                backend.supervisor.poke();
            });
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
            self.check_degraded(set, id);
        }
    }

    /// Reports a volume whose worker's state file says it became degraded
    /// (once per reason), and records that a replacement starts on nowait.
    fn check_degraded(&self, set: &mut Set, volume_id: Uuid) {
        let Some(private) = self.worker_of(volume_id, |w| w.private) else {
            return;
        };
        if private {
            return;
        }
        let now = self.state_file(volume_id).and_then(|s| s.degraded);
        let last = set.degraded.entry(volume_id).or_default();
        if *last == now {
            return;
        }
        *last = now.clone();
        let Some(reason) = now else { return };
        // A replacement worker starts where this one is now.
        self.record(volume_id, |spec| spec.dispatch = DispatchPolicy::Nowait);
        // The event carries the attachment as the worker has it now: asked
        // off this thread, so a slow worker holds up no other.
        let backend = self.handle();
        let _ = std::thread::Builder::new()
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
    }
}
