//! An in-memory backend for unit tests of the manager's rules: no root, no
//! devices. Its "kernel" is a map of live devices by volume id, which a test
//! can change behind the manager's back (a device that vanished, one left by
//! a crash); every call that would change a device is recorded, in order.

use std::collections::{BTreeMap, HashSet};
use std::os::fd::OwnedFd;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use time::OffsetDateTime;
use uuid::Uuid;

use crate::attachment::{DeviceState, DmAttachment, UblkAttachment};
use crate::backend::{
    AttachRequest, Attachment, BackendError, Change, Decision, Marked, OrphanPolicy, Probe,
    ProbeRequest, SpecCheck, VolumeBackend,
};
use blockplane_api::model::{
    ActiveDispatch, Allocation, Backend, BackendCapability, DispatchPolicy, VolumeStats,
};
use blockplane_system::dispatch::{self, Reason};

/// A call that changes a device, as the fake recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Attach(Uuid),
    Detach(Uuid),
    Reconfigure(Uuid, Change),
}

/// An in-memory backend that says it is `kind`.
pub struct FakeBackend {
    kind: Backend,
    policy: OrphanPolicy,
    state: Mutex<State>,
    /// Signalled when a probe starts, for [`FakeBackend::probes_meet`].
    probed: Condvar,
}

#[derive(Default)]
struct State {
    devices: BTreeMap<Uuid, Attachment>,
    calls: Vec<Call>,
    /// Fields (`Change::field`) that `check_change` refuses.
    refused: HashSet<&'static str>,
    /// Fields whose `reconfigure` fails, after `check_change` passed.
    failing: HashSet<&'static str>,
    /// Policies `validate` refuses.
    unsupported: Vec<DispatchPolicy>,
    /// What `validate` decides for `dispatch: auto`, and why (`None`: it
    /// decides nothing).
    auto: Option<(DispatchPolicy, Reason)>,
    next_minor: u32,
    /// Probes running now, and the most that ever ran at once.
    probing: usize,
    most_probing: usize,
    /// Each probe waits until this many run at once (0: none waits).
    probes_meet: usize,
}

impl FakeBackend {
    /// A fake of `kind` that removes orphans (`policy`) or reports them.
    pub fn new(kind: Backend, policy: OrphanPolicy) -> Self {
        Self {
            kind,
            policy,
            state: Mutex::default(),
            probed: Condvar::new(),
        }
    }

    /// The next probes wait until `n` of them run at once (for 10 s at most:
    /// a caller that probes one at a time is then only slow, and
    /// [`FakeBackend::most_probing`] says so); later ones do not wait.
    pub fn probes_meet(&self, n: usize) {
        self.state().probes_meet = n;
    }

    /// The most probes that ever ran at once.
    pub fn most_probing(&self) -> usize {
        self.state().most_probing
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("fake backend poisoned")
    }

    /// Every device-changing call so far, oldest first.
    pub fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    /// The live device of `volume`, as the fake's kernel has it.
    pub fn device(&self, volume: Uuid) -> Option<Attachment> {
        self.state().devices.get(&volume).cloned()
    }

    /// Makes a device vanish, or appear, behind the manager's back.
    pub fn set_device(&self, volume: Uuid, att: Option<Attachment>) {
        let mut s = self.state();
        match att {
            Some(a) => s.devices.insert(volume, a),
            None => s.devices.remove(&volume),
        };
    }

    /// `check_change` refuses changes of `field` from now on.
    pub fn refuse(&self, field: &'static str) {
        self.state().refused.insert(field);
    }

    /// `reconfigure` fails for changes of `field` from now on.
    pub fn fail(&self, field: &'static str) {
        self.state().failing.insert(field);
    }

    /// `validate` refuses `dispatch` from now on.
    pub fn refuse_policy(&self, dispatch: DispatchPolicy) {
        self.state().unsupported.push(dispatch);
    }

    /// `validate` decides `dispatch` for `auto` from now on, for `reason`.
    pub fn decide_auto(&self, dispatch: DispatchPolicy, reason: Reason) {
        self.state().auto = Some((dispatch, reason));
    }

    /// A device as this fake makes one.
    pub fn attachment(
        &self,
        size_bytes: u64,
        dispatch: DispatchPolicy,
        read_only: bool,
    ) -> Attachment {
        let minor = {
            let mut s = self.state();
            s.next_minor += 1;
            s.next_minor
        };
        Attachment {
            device: format!("/dev/fake{minor}"),
            kernel_name: format!("fake{minor}"),
            major: 259,
            minor,
            dispatch: active(self.kind, dispatch),
            dispatch_reason: Reason::Words {
                words: "as asked (fake)".into(),
            },
            size_bytes,
            read_only,
            attached_at: OffsetDateTime::now_utc(),
            baseline: None,
            kind: device_state(self.kind, minor),
            resize_pending: false,
        }
    }
}

/// The backend's part of a fake device: nothing a test reads, only its kind.
fn device_state(kind: Backend, minor: u32) -> DeviceState {
    match kind {
        Backend::Loop => DeviceState::Loop { direct_io: true },
        Backend::Ublk => DeviceState::Ublk(UblkAttachment {
            dev_id: minor,
            pid: 0,
            pinned: None,
            buffer_bytes: 0,
            queues: None,
            zero_copy: false,
            degraded: None,
        }),
        Backend::Dm => DeviceState::Dm(DmAttachment {
            name: format!("fake{minor}"),
            uuid: format!("fake-{minor}"),
            table: Vec::new(),
            pinned: None,
            private_ublk: None,
            degraded: None,
        }),
    }
}

fn active(kind: Backend, d: DispatchPolicy) -> ActiveDispatch {
    match kind {
        Backend::Loop => ActiveDispatch::Kernel,
        _ => dispatch::active_of(d).unwrap_or(ActiveDispatch::Nowait),
    }
}

fn refused(what: &str) -> BackendError {
    BackendError::Refused {
        reason: format!("the fake refuses {what}"),
    }
}

impl VolumeBackend for FakeBackend {
    fn kind(&self) -> Backend {
        self.kind
    }

    fn capability(&self) -> BackendCapability {
        BackendCapability {
            available: true,
            reason: None,
            features: None,
            targets: None,
            native_loop_target: None,
        }
    }

    fn validate(
        &self,
        spec: &SpecCheck,
        _image: &OwnedFd,
        _size: u64,
    ) -> Result<Option<Decision>, BackendError> {
        if self.state().unsupported.contains(&spec.dispatch) {
            return Err(BackendError::Unsupported {
                backend: self.kind.as_str(),
                what: format!("dispatch {}", spec.dispatch.as_str()),
                reason: "the fake refuses it".into(),
            });
        }
        Ok(match (&self.state().auto, spec.dispatch) {
            (Some((d, why)), DispatchPolicy::Auto) => Some(Decision::new(*d, why.clone())),
            _ => None,
        })
    }

    fn attach(&self, req: AttachRequest) -> Result<Attachment, BackendError> {
        let p = &req.params;
        let mut att = self.attachment(p.size_bytes, p.dispatch, p.refuse_writes);
        // A decision made at validate is the one the device goes by.
        if let Some(d) = &req.decision {
            att.dispatch = active(self.kind, d.dispatch);
            att.dispatch_reason = d.reason.clone();
        }
        let mut s = self.state();
        s.calls.push(Call::Attach(req.volume_id));
        s.devices.insert(req.volume_id, att.clone());
        Ok(att)
    }

    fn check_detach(&self, _volume_id: Uuid) -> Result<(), BackendError> {
        Ok(())
    }

    fn detach(&self, volume_id: Uuid, _att: Option<&Attachment>) -> Result<(), BackendError> {
        let mut s = self.state();
        s.calls.push(Call::Detach(volume_id));
        s.devices.remove(&volume_id);
        Ok(())
    }

    fn probe(&self, req: ProbeRequest) -> Result<Probe, BackendError> {
        let mut s = self.state();
        s.probing += 1;
        s.most_probing = s.most_probing.max(s.probing);
        self.probed.notify_all();
        let until = Instant::now() + Duration::from_secs(10);
        while s.probing < s.probes_meet && Instant::now() < until {
            let left = until.saturating_duration_since(Instant::now());
            s = self
                .probed
                .wait_timeout(s, left)
                .expect("fake backend poisoned")
                .0;
        }
        // Met, or given up: the ones still waiting go on (the last to come
        // leaves at once, and must not leave the others short of it), and
        // later probes (a re-attach's) do not wait.
        s.probes_meet = 0;
        self.probed.notify_all();
        let found = s.devices.get(&req.volume_id).cloned();
        s.probing -= 1;
        Ok(match found {
            Some(att) => Probe::Alive(Box::new(att)),
            None => Probe::Gone,
        })
    }

    fn marked(&self) -> Result<Vec<Marked>, BackendError> {
        Ok(self
            .state()
            .devices
            .iter()
            .map(|(id, att)| Marked {
                volume_id: *id,
                device: att.device.clone(),
            })
            .collect())
    }

    fn orphan_policy(&self) -> OrphanPolicy {
        self.policy
    }

    fn stats(&self, _volume_id: Uuid, _att: &Attachment) -> Result<VolumeStats, BackendError> {
        Err(refused("stats"))
    }

    fn resize(
        &self,
        att: &Attachment,
        size_bytes: u64,
        _allocation: Allocation,
        _volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        Ok(Attachment {
            size_bytes,
            ..att.clone()
        })
    }

    fn check_change(&self, _att: &Attachment, change: Change) -> Result<(), BackendError> {
        if self.state().refused.contains(change.field()) {
            return Err(BackendError::NotLive {
                backend: self.kind.as_str(),
                field: change.field(),
                reason: "the fake refuses it".into(),
            });
        }
        Ok(())
    }

    fn reconfigure(
        &self,
        _att: &Attachment,
        change: Change,
        volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        let mut s = self.state();
        s.calls.push(Call::Reconfigure(volume_id, change));
        // What `check_change` refuses fails here too, as on a real device.
        if s.failing.contains(change.field()) || s.refused.contains(change.field()) {
            return Err(refused(change.field()));
        }
        let kind = self.kind;
        let att = s
            .devices
            .get_mut(&volume_id)
            .ok_or_else(|| refused("a change of a volume with no device"))?;
        match change {
            Change::Dispatch(d) => att.dispatch = active(kind, d),
            Change::ReadOnly(ro) => att.read_only = ro,
            Change::Qos(_) => {}
        }
        Ok(att.clone())
    }
}
