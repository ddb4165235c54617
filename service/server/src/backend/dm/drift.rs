//! Rule 5 on dm: a direct volume's map re-read every few seconds, and the
//! move to `nowait` on drift.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use uuid::Uuid;

use super::DmBackend;
use super::ioctl::{self};
use crate::backend::BackendEvent;
use blockplane_api::model::{DispatchPolicy, VolumeState};
use blockplane_system::dispatch::Reason;
use blockplane_system::extent::ExtentMap;

impl DmBackend {
    /// Rule 5 for one volume: re-read the map; on drift leave `direct` at once.
    pub(super) fn check_drift(&self, volume_id: Uuid) {
        let mut volumes = self.volumes.lock().expect("dm volumes poisoned");
        let Some(v) = volumes.get_mut(&volume_id) else {
            return;
        };
        let Some((map, _)) = &v.under.direct else {
            return;
        };
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
        if let Some((_, pin)) = v.under.direct.as_mut() {
            pin.was_immutable = true;
        }
        let outcome = self.switch(volume_id, v, DispatchPolicy::Nowait, reason.clone());
        let (kind, state, message) = match outcome {
            Ok(()) => {
                v.watch.degraded = Some(reason.to_string());
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

    pub(super) fn start_checks(&self, volume_id: Uuid, stop: Arc<AtomicBool>) {
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
}
