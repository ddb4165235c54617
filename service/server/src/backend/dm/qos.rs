//! QoS on dm: the private worker enforces a limit, so a limit moves a
//! volume without one onto it under `auto`, and the last limit's removal
//! takes it back.

use uuid::Uuid;

use super::ioctl::volume_of_name;
use super::{DmBackend, DmVolume, ask};
use crate::backend::wire;
use crate::backend::{Attachment, BackendError, DeviceState};
use blockplane_api::model::{DispatchPolicy, Qos};
use blockplane_protocol::Request;
use blockplane_system::dispatch::{self, Reason};

/// A QoS limit refused live, in the answer's terms.
pub(super) fn qos_not_live(e: dispatch::DispatchError) -> BackendError {
    let (dispatch::DispatchError::Refused(reason)
    | dispatch::DispatchError::NeedsUblk(reason)
    | dispatch::DispatchError::LimitNeedsWorker(reason)) = e;
    BackendError::NotLive {
        backend: "dm",
        field: "qos",
        reason,
    }
}

impl DmBackend {
    /// Sets a volume's QoS limit, enforced by its private worker: on
    /// `direct` under `auto` a limit moves it to `nowait` (the worker starts
    /// with the limit); removing the last limit of a volume that moved for
    /// one brings it back to `direct` when the image still qualifies. On
    /// error the volume keeps its limit and path.
    pub(super) fn set_qos(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        qos: Option<Qos>,
    ) -> Result<(), BackendError> {
        let no_worker = matches!(v.dispatch, DispatchPolicy::Direct | DispatchPolicy::Kernel);
        let old = v.params.qos;
        if qos.is_some() {
            let moved = dispatch::qos_on_dm(v.params.dispatch, no_worker, &self.path())
                .map_err(qos_not_live)?;
            v.params.qos = qos;
            let done = match moved {
                Some(d) => self.switch(volume_id, v, d.dispatch, d.reason),
                None => self
                    .ublk
                    .change(
                        volume_id,
                        Request::SetQos {
                            qos: wire::limits(qos),
                        },
                    )
                    .map(|_| ()),
            };
            if done.is_err() {
                v.params.qos = old;
            }
            return done;
        }
        if no_worker {
            v.params.qos = None;
            return Ok(());
        }
        self.ublk.change(volume_id, Request::SetQos { qos: None })?;
        v.params.qos = None;
        let path = self.path();
        let asked = ask(v, v.params.dispatch, &path);
        let Some(back) = dispatch::after_last_limit(old.is_some(), &v.reason, &asked)? else {
            return Ok(());
        };
        let Reason::LastLimitRemoved { .. } = back.reason else {
            // Stays on the worker: say why, no longer the limit.
            return self.switch(volume_id, v, back.dispatch, back.reason);
        };
        let to = back.dispatch;
        if let Err(e) = self.switch(volume_id, v, to, back.reason) {
            // The pin (or the loop driver) refused it: serve on, saying so.
            tracing::warn!(volume = %volume_id, error = %e, "could not leave the worker after the last QoS limit");
            let why = Reason::BackRefused {
                to,
                error: e.to_string(),
            };
            self.switch(volume_id, v, v.dispatch, why)?;
        }
        Ok(())
    }

    /// What the user of the volume `att` belongs to asked: its policy and
    /// its limit (`None`: not a volume of this service).
    pub(super) fn asked(&self, att: &Attachment) -> Option<(DispatchPolicy, Option<Qos>)> {
        let DeviceState::Dm(dm) = &att.kind else {
            return None;
        };
        let v = self.volumes.lock().expect("dm volumes poisoned");
        v.get(&volume_of_name(&dm.name)?)
            .map(|v| (v.params.dispatch, v.params.qos))
    }
}
