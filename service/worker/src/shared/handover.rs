//! Letting the device go to a successor worker, keeping it.

use std::time::Duration;

use blockplane_protocol::{self as protocol, FillState, HandoverMethod};
use libublk::ctrl::UblkCtrl;
use libublk::sys;

use super::Shared;
use crate::refusal::Refusal;

impl Shared {
    /// Lets go of the device for a successor ([`protocol::Request::Handover`]),
    /// for good: no change runs after it (the change lock is never given
    /// back) and the worker is to exit. With `UBLK_F_QUIESCE` the kernel lets
    /// the requests inside finish, keeps new ones queued and ends the queues;
    /// without it every queue is held until no request is inside the data
    /// path, and the requests it holds are requeued by the kernel when the
    /// worker exits (which needs `USER_RECOVERY_REISSUE`: without it they
    /// would fail). A refusal leaves the worker serving.
    pub fn hand_over(&self, ctrl: &UblkCtrl, dev_flags: u64) -> Result<HandoverMethod, Refusal> {
        let one = self.queues.changing.lock().expect("changing poisoned");
        if self
            .fill_state()
            .is_some_and(|f| f.state == FillState::Running)
        {
            return Err(Refusal::Rule(
                "an allocate runs in this worker: a handover waits for its end (or its cancel)"
                    .into(),
            ));
        }
        if self.copy_running() {
            return Err(Refusal::Rule(protocol::COPY_RUNS_HANDOVER.into()));
        }
        if dev_flags & u64::from(sys::UBLK_F_QUIESCE) != 0 {
            match ctrl.quiesce_dev(30_000) {
                Ok(_) => {
                    std::mem::forget(one);
                    return Ok(HandoverMethod::Quiesce);
                }
                // The device now refuses new requests (they wait queued):
                // drain and go, so that a successor takes them.
                Err(e) => tracing::error!(error = %e, "QUIESCE_DEV failed; draining instead"),
            }
        } else if dev_flags & u64::from(sys::UBLK_F_USER_RECOVERY_REISSUE) == 0 {
            return Err(Refusal::Rule(
                "the device was created without USER_RECOVERY_REISSUE: the requests its worker holds when it exits would fail; detach and attach the volume instead".into(),
            ));
        }
        let queues = self.ask_queues();
        if !queues.hold(Duration::from_secs(30)) {
            let cfg = self.config().clone();
            if !queues.apply(&cfg) {
                tracing::error!("a queue did not take the config back within 30 s");
            }
            return Err(Refusal::Rule(
                "requests did not finish within 30 s; the worker keeps serving".into(),
            ));
        }
        std::mem::forget(one);
        Ok(HandoverMethod::Drain)
    }
}
