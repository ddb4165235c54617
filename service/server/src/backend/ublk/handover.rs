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

use super::supervise::Started;
use super::{TALK_TIMEOUT, UblkBackend, io};
use crate::backend::wire;
use crate::backend::{BackendError, BackendEvent, HandedOver, WorkerInfo};
use crate::fault::HandoverFaults;
use blockplane_api::model::HandoverMethod;
use blockplane_protocol::{Answer, GO_READY, GO_TAKE, Request};

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

impl UblkBackend {
    /// Replaces the worker of `volume_id` (a ublk volume's or a dm volume's
    /// private one) by one of this service's build; see the module.
    pub(super) fn replace_worker(
        &self,
        volume_id: Uuid,
        faults: HandoverFaults,
    ) -> Result<HandedOver, BackendError> {
        let vol = || format!("volume {volume_id}");
        let (previous, dev_id, protocol, mut spec, image, lock, flag) = {
            let workers = self.workers.lock().expect("workers poisoned");
            let w = workers.get(&volume_id).ok_or_else(|| {
                io(
                    "hand over",
                    vol(),
                    io::Error::other("no worker of this service serves it"),
                )
            })?;
            let dup = |e| io("dup", "the image", e);
            let lock = match &w.lock {
                Some(l) => Some(l.try_clone().map_err(dup)?),
                None => None,
            };
            (
                w.info(),
                w.dev_id,
                w.peer.protocol,
                w.spec.clone(),
                w.image.try_clone().map_err(dup)?,
                lock,
                w.handing_over.clone(),
            )
        };
        // The spec it would be replaced with after a crash, from what the
        // old worker recorded (the volume's lock keeps it from changing).
        let state = self.state_file(volume_id);
        spec.recover_dev_id = Some(state.as_ref().map_or(dev_id, |s| s.dev_id));
        spec.pinned = state.and_then(|s| s.pinned);
        spec.decided_map = false;
        // What a replacement of the new worker after a crash starts from.
        let recorded = spec.clone();
        spec.handover = true;
        let edit = |json: &mut serde_json::Value| {
            if faults.new_worker_fails {
                // A spec this build refuses: the new worker exits at once.
                json["injected_test_fault"] = true.into();
            }
            if faults.recovery_fails {
                // No such device: the new worker fails once it takes over.
                json["recover_dev_id"] = (u64::from(u32::MAX) - 1).into();
            }
        };
        let started = Instant::now();
        let old = format!(
            "worker {} ({})",
            previous.pid,
            previous.build.as_deref().unwrap_or("unknown")
        );

        // 1. The new worker starts while the old one serves, and says when
        // it is ready: the device waits for no exec.
        let (ours, theirs) = UnixStream::pair().map_err(|e| io("socketpair", vol(), e))?;
        let mut spawned = self.spawn_worker(
            spec,
            &image,
            lock.as_ref(),
            None,
            Some(&OwnedFd::from(theirs)),
            edit,
        )?;
        if !ready(&ours) {
            let _ = spawned.child.kill();
            let _ = spawned.child.wait();
            let message = format!(
                "handover of /dev/ublkb{dev_id} called off: the new worker did not start ({}); {old} serves on",
                super::supervise::last_error_line(&spawned.run_dir)
            );
            self.handover_failed(volume_id, &message);
            return Err(io("hand over", vol(), io::Error::other(message)));
        }
        let prepared = started.elapsed();

        // 2. The old worker lets go, and exits.
        flag.store(true, Relaxed);
        let handing = Handing(flag);
        let method = if protocol >= 2 {
            let req = Request::Handover {
                pace_ms: faults.pace.as_millis() as u64,
            };
            match self.talk(volume_id, &req, TALK_TIMEOUT + Duration::from_secs(30)) {
                Ok(Answer::HandedOver { method }) => wire::handover(method),
                // Nothing changed: the worker serves on; the new one, told
                // nothing, exits.
                Err(e @ BackendError::Refused { .. }) => {
                    drop(ours);
                    let _ = spawned.child.wait();
                    return Err(e);
                }
                other => {
                    // It died, or answered nonsense: stopped below like one
                    // from before the handover.
                    tracing::warn!(%volume_id, pid = previous.pid, answer = ?other, "the worker did not hand over; stopping it");
                    HandoverMethod::Stop
                }
            }
        } else {
            HandoverMethod::Stop
        };
        let wait = match method {
            HandoverMethod::Stop => Duration::ZERO,
            HandoverMethod::Quiesce | HandoverMethod::Drain => EXIT_WAIT + faults.pace,
        };
        let let_go = started.elapsed();
        end_process(previous.pid, wait);
        let exited = started.elapsed();

        // 3. The new worker takes the device. A word it does not get (it
        // died) shows below as a worker that does not serve.
        let _ = std::fs::remove_file(spawned.run_dir.join("ctl.sock"));
        let _ = (&ours).write_all(&[GO_TAKE]);
        drop(ours);
        match self.until_serving(spawned) {
            Ok(Started { pid, status, peer }) => {
                // Where a handover's time goes: the new worker's start (the
                // device serves meanwhile), then the stall: the old worker
                // letting go, its exit, the new one's recovery.
                tracing::info!(
                    %volume_id,
                    prepared_ms = prepared.as_millis() as u64,
                    let_go_ms = let_go.as_millis() as u64,
                    exited_ms = exited.as_millis() as u64,
                    serving_ms = started.elapsed().as_millis() as u64,
                    "handover steps"
                );
                let current = WorkerInfo {
                    pid,
                    build: peer.build.clone(),
                    unsupervised: None,
                };
                self.serves_now(volume_id, pid, recorded, peer);
                drop(handing);
                Ok(HandedOver {
                    attachment: Some(self.attachment(&status)?),
                    previous,
                    current,
                    method,
                    took: started.elapsed(),
                })
            }
            Err(e) => {
                // The device waits for a server: the supervisor recovers it.
                drop(handing);
                let now = self.recovered_after(volume_id, previous.pid);
                let message = format!(
                    "handover of /dev/ublkb{dev_id} from {old} failed after it let go ({}): {e}; {now}",
                    method.as_str(),
                );
                self.handover_failed(volume_id, &message);
                Err(io("hand over", vol(), io::Error::other(message)))
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
