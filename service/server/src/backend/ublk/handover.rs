//! Handing a live ublk device over to a new worker of the service's own
//! build (`POST /v1/volumes/{id}/handover`), the device and its number kept:
//!
//! 1. the new worker starts while the old one serves, from the spec the old
//!    one would be replaced with after a crash (policy, pin, read-only, QoS,
//!    size, queues) and the same stats file, so the counters go on; it says
//!    when it is ready and waits ([`blockplane_protocol::GO_FD`]). One that does not
//!    start calls the handover off: the old worker serves on;
//! 2. the old worker lets go ([`Request::Handover`]): with `UBLK_F_QUIESCE`
//!    the kernel lets the requests inside finish and keeps new ones queued;
//!    without it the worker holds its queues until no request is inside its
//!    data path and exits, and the kernel requeues what it held
//!    (`USER_RECOVERY_REISSUE`). A worker from before the handover
//!    (protocol 1) is stopped with SIGKILL, as in a crash;
//! 3. once it has exited, the new worker takes the device with
//!    START/END_USER_RECOVERY: the device's stall is steps 2 and 3 only;
//! 4. if the new worker fails then, the supervisor recovers the device as
//!    after a crash (a restarted worker) and an event says so.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::supervise::{Spawned, Started};
use super::{TALK_TIMEOUT, UblkBackend, io};
use crate::backend::wire;
use crate::backend::{BackendError, BackendEvent, HandedOver, WorkerInfo};
use crate::fault::HandoverFaults;
use blockplane_api::model::HandoverMethod;
use blockplane_protocol::{Answer, GO_READY, GO_TAKE, Request, WorkerSpec};

/// How long an old worker has to exit once it let go (or a protocol-1 one
/// once killed).
const EXIT_WAIT: Duration = Duration::from_secs(30);

/// How long a failed handover waits for the supervisor's recovery, to say
/// in its answer what serves the device now.
const RECOVERY_WAIT: Duration = Duration::from_secs(90);

/// Clears a worker's `handing_over` flag when the handover ends, however.
struct Handing(Arc<AtomicBool>);

impl Drop for Handing {
    fn drop(&mut self) {
        self.0.store(false, Relaxed);
    }
}

/// The worker a handover replaces, as the backend knows it: what it says
/// of itself, and the handles its successor starts with.
struct Outgoing {
    info: WorkerInfo,
    dev_id: u32,
    protocol: u32,
    spec: WorkerSpec,
    image: OwnedFd,
    lock: Option<OwnedFd>,
    handing_over: Arc<AtomicBool>,
}

impl Outgoing {
    /// How events and answers name it.
    fn name(&self) -> String {
        format!(
            "worker {} ({})",
            self.info.pid,
            self.info.build.as_deref().unwrap_or("unknown")
        )
    }
}

/// The test faults of a handover, as edits of the new worker's spec.
fn spec_faults(faults: HandoverFaults) -> impl FnOnce(&mut serde_json::Value) {
    move |json: &mut serde_json::Value| {
        if faults.new_worker_fails {
            // A spec this build refuses: the new worker exits at once.
            json["injected_test_fault"] = true.into();
        }
        if faults.recovery_fails {
            // No such device: the new worker fails once it takes over.
            json["recover_dev_id"] = (u64::from(u32::MAX) - 1).into();
        }
    }
}

impl UblkBackend {
    /// Replaces the worker of `volume_id` (a ublk volume's or a dm volume's
    /// private one) by one of this service's build; see the module.
    pub(super) fn replace_worker(
        &self,
        volume_id: Uuid,
        faults: HandoverFaults,
    ) -> Result<HandedOver, BackendError> {
        let old = self.outgoing(volume_id)?;
        let (spec, recorded) = self.successor_spec(volume_id, &old);
        let started = Instant::now();

        // 1. The new worker starts while the old one serves.
        let (ours, mut spawned) = self.start_successor(volume_id, &old, spec, faults)?;
        let prepared = started.elapsed();

        // 2. The old worker lets go, and exits.
        old.handing_over.store(true, Relaxed);
        let handing = Handing(old.handing_over.clone());
        let method = match self.let_go(volume_id, &old, faults) {
            Ok(method) => method,
            // Nothing changed: the worker serves on; the new one, told
            // nothing, exits.
            Err(e) => {
                drop(ours);
                let _ = spawned.child.wait();
                return Err(e);
            }
        };
        let wait = match method {
            HandoverMethod::Stop => Duration::ZERO,
            HandoverMethod::Quiesce | HandoverMethod::Drain => EXIT_WAIT + faults.pace,
        };
        let let_go = started.elapsed();
        end_process(old.info.pid, wait);
        let exited = started.elapsed();

        // 3. The new worker takes the device. A word it does not get (it
        // died) shows below as a worker that does not serve.
        let _ = std::fs::remove_file(spawned.run_dir.join("ctl.sock"));
        let _ = (&ours).write_all(&[GO_TAKE]);
        drop(ours);
        let Started { pid, status, peer } = match self.until_serving(spawned) {
            Ok(s) => s,
            Err(e) => {
                // The device waits for a server: the supervisor recovers it.
                drop(handing);
                return Err(self.failed_after_let_go(volume_id, &old, method, &e));
            }
        };
        // Where a handover's time goes: the new worker's start (the device
        // serves meanwhile), then the stall: the old worker letting go, its
        // exit, the new one's recovery.
        let ms = |d: Duration| d.as_millis() as u64;
        tracing::info!(
            %volume_id,
            prepared_ms = ms(prepared),
            let_go_ms = ms(let_go),
            exited_ms = ms(exited),
            serving_ms = ms(started.elapsed()),
            "handover steps"
        );
        let current = WorkerInfo {
            pid,
            build: peer.build.clone(),
            unsupervised: None,
        };
        self.serves_now(volume_id, pid, recorded, peer);
        // Only now: the old worker's exit is no crash to recover from.
        drop(handing);
        Ok(HandedOver {
            attachment: Some(self.attachment(&status)?),
            previous: old.info,
            current,
            method,
            took: started.elapsed(),
        })
    }

    /// A handover whose new worker did not serve after the old one let go:
    /// the supervisor recovers the device, and the failure is recorded and
    /// returned with what became of it.
    fn failed_after_let_go(
        &self,
        volume_id: Uuid,
        old: &Outgoing,
        method: HandoverMethod,
        e: &BackendError,
    ) -> BackendError {
        let now = self.recovered_after(volume_id, old.info.pid);
        let message = format!(
            "handover of /dev/ublkb{} from {} failed after it let go ({}): {e}; {now}",
            old.dev_id,
            old.name(),
            method.as_str(),
        );
        self.handover_failed(volume_id, &message);
        io(
            "hand over",
            format!("volume {volume_id}"),
            io::Error::other(message),
        )
    }

    /// Starts the successor of `old` from `spec`, which says when it is
    /// ready (the device waits for no exec) and then waits for the word to
    /// take the device over, on the stream returned. One that does not
    /// start calls the handover off.
    fn start_successor(
        &self,
        volume_id: Uuid,
        old: &Outgoing,
        spec: WorkerSpec,
        faults: HandoverFaults,
    ) -> Result<(UnixStream, Spawned), BackendError> {
        let vol = || format!("volume {volume_id}");
        let (ours, theirs) = UnixStream::pair().map_err(|e| io("socketpair", vol(), e))?;
        let mut spawned = self.spawn_worker(
            spec,
            &old.image,
            old.lock.as_ref(),
            None,
            Some(&OwnedFd::from(theirs)),
            spec_faults(faults),
        )?;
        if ready(&ours) {
            return Ok((ours, spawned));
        }
        let _ = spawned.child.kill();
        let _ = spawned.child.wait();
        let message = format!(
            "handover of /dev/ublkb{} called off: the new worker did not start ({}); {} serves on",
            old.dev_id,
            super::supervise::last_error_line(&spawned.run_dir),
            old.name()
        );
        self.handover_failed(volume_id, &message);
        Err(io("hand over", vol(), io::Error::other(message)))
    }

    /// The worker of this service that serves `volume_id`, with handles of
    /// its own on the image and the lock for its successor.
    fn outgoing(&self, volume_id: Uuid) -> Result<Outgoing, BackendError> {
        let workers = self.workers.lock().expect("workers poisoned");
        let w = workers.get(&volume_id).ok_or_else(|| {
            io(
                "hand over",
                format!("volume {volume_id}"),
                io::Error::other("no worker of this service serves it"),
            )
        })?;
        let dup = |e| io("dup", "the image", e);
        let lock = match &w.lock {
            Some(l) => Some(l.try_clone().map_err(dup)?),
            None => None,
        };
        Ok(Outgoing {
            info: w.info(),
            dev_id: w.dev_id,
            protocol: w.peer.protocol,
            spec: w.spec.clone(),
            image: w.image.try_clone().map_err(dup)?,
            lock,
            handing_over: w.handing_over.clone(),
        })
    }

    /// The spec the successor of `old` starts from, and the one a
    /// replacement of it after a crash would: the spec `old` would be
    /// replaced with after a crash, from what it recorded (the volume's
    /// lock keeps that from changing).
    fn successor_spec(&self, volume_id: Uuid, old: &Outgoing) -> (WorkerSpec, WorkerSpec) {
        let mut spec = old.spec.clone();
        let state = self.state_file(volume_id);
        spec.recover_dev_id = Some(state.as_ref().map_or(old.dev_id, |s| s.dev_id));
        spec.pinned = state.and_then(|s| s.pinned);
        spec.decided_map = false;
        let recorded = spec.clone();
        spec.handover = true;
        (spec, recorded)
    }

    /// Asks `old` to let the device go, and how it did; a worker from
    /// before the handover, or one that died or answered nonsense, is
    /// stopped like one from before it. A refusal changes nothing.
    fn let_go(
        &self,
        volume_id: Uuid,
        old: &Outgoing,
        faults: HandoverFaults,
    ) -> Result<HandoverMethod, BackendError> {
        if old.protocol < 2 {
            return Ok(HandoverMethod::Stop);
        }
        let req = Request::Handover {
            pace_ms: faults.pace.as_millis() as u64,
        };
        match self.talk(volume_id, &req, TALK_TIMEOUT + Duration::from_secs(30)) {
            Ok(Answer::HandedOver { method }) => Ok(wire::handover(method)),
            Err(e @ BackendError::Refused { .. }) => Err(e),
            other => {
                tracing::warn!(%volume_id, pid = old.info.pid, answer = ?other, "the worker did not hand over; stopping it");
                Ok(HandoverMethod::Stop)
            }
        }
    }

    /// The event of a handover that failed, `message` saying what serves.
    fn handover_failed(&self, volume_id: Uuid, message: &str) {
        self.events.send(BackendEvent {
            volume_id,
            kind: "worker_handover_failed",
            message: message.to_string(),
            attachment: None,
            state: None,
        });
    }

    /// Waits for the supervisor to replace dead worker `old` of
    /// `volume_id`; what serves the device then, in words.
    fn recovered_after(&self, volume_id: Uuid, old: u32) -> String {
        let deadline = Instant::now() + RECOVERY_WAIT;
        loop {
            match self.worker_of(volume_id, |w| w.info()) {
                None => {
                    return "its device could not be recovered (see the volume's events)".into();
                }
                Some(w) if w.pid != old => {
                    return format!(
                        "worker {} ({}) recovered the device, as after a crash",
                        w.pid,
                        w.build.as_deref().unwrap_or("unknown")
                    );
                }
                Some(_) if Instant::now() > deadline => {
                    return format!(
                        "no worker recovered the device within {RECOVERY_WAIT:?} (see the volume's events)"
                    );
                }
                Some(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// Whether a handover's new worker said on `go` that it is ready (it
/// closes `go` when it fails first).
fn ready(go: &UnixStream) -> bool {
    let mut word = [0u8; 1];
    go.set_read_timeout(Some(super::START_TIMEOUT)).is_ok()
        && matches!((&*go).read(&mut word), Ok(1) if word[0] == GO_READY)
}

/// Waits up to `within` for process `pid` to exit, then kills it and waits
/// for that.
fn end_process(pid: u32, within: Duration) {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return;
    };
    let Ok(pidfd) = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) else {
        return; // gone already
    };
    let exited = |t: Duration| {
        let mut fds = [rustix::event::PollFd::new(
            &pidfd,
            rustix::event::PollFlags::IN,
        )];
        let t = rustix::event::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: i64::from(t.subsec_nanos()),
        };
        matches!(rustix::event::poll(&mut fds, Some(&t)), Ok(n) if n > 0)
    };
    if exited(within) {
        return;
    }
    tracing::warn!(pid, "the old worker did not exit; killing it");
    let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL);
    let _ = exited(Duration::from_secs(10));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_worker_is_ready_only_when_it_says_so() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        (&theirs).write_all(&[GO_READY]).unwrap();
        assert!(ready(&ours));
        // It died before it was ready: end of file, or anything else.
        drop(theirs);
        assert!(!ready(&ours));
        let (ours, theirs) = UnixStream::pair().unwrap();
        (&theirs).write_all(b"x").unwrap();
        assert!(!ready(&ours));
    }
}
