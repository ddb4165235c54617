//! Test faults: a SIGKILL, a failure or a slowdown injected at a named
//! point (env `BLOCKPLANE_TEST_FAULT`), so that the black-box and kernel
//! tests can prove restart, cleanup, progress and cancel.
//!
//! Only a build with the `test-faults` feature has them (the test command
//! enables it, release builds leave it out): a service must never kill
//! itself because of its environment. A build without it that finds the
//! variable set refuses to start, so that a test run built without faults
//! fails instead of passing without its fault.

use std::time::Duration;

/// The variable that names the fault.
const VAR: &str = "BLOCKPLANE_TEST_FAULT";

/// The points of a volume's create, delete and live changes after which a
/// test can kill the service or fail the operation (inside a backend's
/// attach: [`After::Create`] only kills; [`After::Add`] fails a ublk attach
/// by killing its worker alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// The volume row is recorded, no device exists yet.
    Insert,
    /// Inside an attach: the kernel has the volume's device, not yet bound
    /// or started (a loop device not yet bound to the image; a ublk device
    /// its worker added, not started: the worker dies there under this
    /// fault, and the service with it, or for `fail_after_add` alone).
    Add,
    /// Inside a dm attach: the dm device is created, its table not loaded.
    Create,
    /// The device exists, the row does not say so yet.
    Attach,
    /// The device is gone, the row is still there.
    Detach,
    /// A live change (a PATCH, or a volume following its image's resize) is
    /// made on the device, the row does not say so yet.
    Change,
    /// The first change of a PATCH of several is made on the device, the
    /// next not yet.
    FirstChange,
}

/// What a test can slow down, to watch it whatever the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slow {
    /// Every image create takes 3 s more once its file is made
    /// (`slow_image_create`): a request that outlasts a timeout, holds a
    /// concurrency slot or is in flight at SIGTERM.
    ImageCreate,
    /// Each 16 MiB stretch an allocate zeroes (in the service or a ublk
    /// worker) takes 100 ms more (`slow_allocate`): its progress and cancel.
    Allocate,
    /// Each 16 MiB stretch a snapshot's or clone's background copy copies
    /// takes 100 ms more, and a copy of a file waits after a stretch while
    /// the copy gate (`copy-gate` in the run dir) exists (`slow_copy`): its
    /// progress, cancel and a crash during it, met while it surely runs.
    Copy,
    /// A worker that hands its device over waits 3 s before it exits
    /// (`slow_handover`): a kill of it during a handover.
    Handover,
    /// Every volume create waits 3 s once its row is recorded, and every
    /// delete once it is recorded `detaching` (`slow_volume_change`): the
    /// registry's disk fills up between the records of one change.
    VolumeChange,
    /// Each chunk a backup stores takes 100 ms more (`slow_backup`): its
    /// progress, cancel, a gc and a crash during it.
    Backup,
    /// A backup waits after each chunk while `<run dir>/backup-gate` exists
    /// (`gate_backup`): a test holds it mid-way as long as it needs.
    BackupGate,
    /// A copy of one moment of a serving volume (copy-before-write) waits
    /// after each chunk while `<run dir>/copy-gate` exists (`gate_copy`):
    /// a test writes to chunks it has not copied yet.
    CopyGate,
    /// A start's reconciliation waits before each volume while
    /// `<run dir>/reconcile-gate` exists (`gate_reconcile`): a test looks at
    /// the API while volumes are `recovering`.
    ReconcileGate,
}

/// What the ublk worker supervisor suffers while `<data dir>/run/supervisor-gate`
/// exists (a test removes the file to end it): each failure it must log,
/// retry and show (`GET /v1/host`, `/metrics`, the volume's state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SupervisorFault {
    /// Starting the supervisor thread fails (`fail_supervisor_start`).
    Start,
    /// The supervisor's wait for events fails with EIO (`fail_supervisor_wait`).
    Wait,
    /// The supervisor thread panics (`panic_supervisor`).
    Panic,
    /// `pidfd_open` of a worker fails with EMFILE (`emfile_pidfd`).
    PidfdOpen,
    /// Starting the thread that recovers a dead worker fails
    /// (`fail_recovery_spawn`).
    RecoverySpawn,
}

/// One injected fault.
#[cfg(feature = "test-faults")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL the service at a point.
    Kill(After),
    /// Fail the operation at a point.
    Fail(After),
    Slow(Slow),
    /// The new worker of a handover is started with a spec it refuses
    /// (`fail_handover_start`), so it exits at once.
    HandoverStartFails,
    /// The new worker of a handover fails once the old one let go
    /// (`fail_handover_recovery`): told to recover a device that is not.
    HandoverRecoveryFails,
    /// The ublk worker supervisor fails while its gate file exists.
    Supervisor(SupervisorFault),
}

#[cfg(feature = "test-faults")]
impl Fault {
    /// Parses `kill_after_insert`, `kill_after_add`, `kill_after_create`,
    /// `kill_after_attach`, `kill_after_detach`, `kill_after_change`,
    /// `kill_after_first_change`, `fail_after_<the same but create>`,
    /// `slow_image_create`, `slow_allocate`, `slow_copy`, `slow_backup`, `gate_backup`, `gate_copy`, `gate_reconcile`,
    /// `slow_volume_change`, `slow_handover`, `fail_handover_start`,
    /// `fail_handover_recovery`, `fail_supervisor_start`, `fail_supervisor_wait`,
    /// `panic_supervisor`, `emfile_pidfd`, `fail_recovery_spawn`.
    fn parse(s: &str) -> Option<Self> {
        let slow = match s {
            "slow_image_create" => Some(Slow::ImageCreate),
            "slow_allocate" => Some(Slow::Allocate),
            "slow_copy" => Some(Slow::Copy),
            "slow_backup" => Some(Slow::Backup),
            "gate_backup" => Some(Slow::BackupGate),
            "gate_copy" => Some(Slow::CopyGate),
            "gate_reconcile" => Some(Slow::ReconcileGate),
            "slow_handover" => Some(Slow::Handover),
            "fail_handover_start" => return Some(Fault::HandoverStartFails),
            "fail_handover_recovery" => return Some(Fault::HandoverRecoveryFails),
            "slow_volume_change" => Some(Slow::VolumeChange),
            "fail_supervisor_start" => return Some(Fault::Supervisor(SupervisorFault::Start)),
            "fail_supervisor_wait" => return Some(Fault::Supervisor(SupervisorFault::Wait)),
            "panic_supervisor" => return Some(Fault::Supervisor(SupervisorFault::Panic)),
            "emfile_pidfd" => return Some(Fault::Supervisor(SupervisorFault::PidfdOpen)),
            "fail_recovery_spawn" => {
                return Some(Fault::Supervisor(SupervisorFault::RecoverySpawn));
            }
            _ => None,
        };
        if let Some(slow) = slow {
            return Some(Fault::Slow(slow));
        }
        let (action, stage) = s.split_once("_after_")?;
        let stage = match stage {
            "insert" => After::Insert,
            "add" => After::Add,
            "create" => After::Create,
            "attach" => After::Attach,
            "detach" => After::Detach,
            "change" => After::Change,
            "first_change" => After::FirstChange,
            _ => return None,
        };
        match action {
            "kill" => Some(Fault::Kill(stage)),
            // Inside a dm attach only a kill is injected.
            "fail" if stage != After::Create => Some(Fault::Fail(stage)),
            _ => None,
        }
    }
}

/// Why the service refuses to start with the test fault it was given.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// This build has no test faults.
    #[error(
        "{VAR}={0} is set, but this build of blockplane has no test faults: the cargo feature `test-faults` of package blockplane adds them (--features blockplane/test-faults)"
    )]
    NotBuilt(String),
    /// This build has no test clock.
    #[error(
        "{CLOCK_VAR}={0} is set, but this build of blockplane has no test faults, so no test clock: the cargo feature `test-faults` of package blockplane adds it (--features blockplane/test-faults)"
    )]
    ClockNotBuilt(String),
    /// The variable names no fault.
    #[error(
        "{VAR}={0} names no test fault (kill_after_{{insert,add,create,attach,detach,change,first_change}}, fail_after_{{insert,add,attach,detach,change,first_change}}, slow_image_create, slow_allocate, slow_copy, slow_backup, gate_backup, gate_copy, gate_reconcile, slow_volume_change, slow_handover, fail_handover_start, fail_handover_recovery, fail_supervisor_start, fail_supervisor_wait, panic_supervisor, emfile_pidfd, fail_recovery_spawn)"
    )]
    Unknown(String),
}

/// An operation failed at point `.0` because a test asked it to.
#[derive(Debug, thiserror::Error)]
#[error("injected test fault at {0:?}")]
pub struct Injected(pub After);

/// Test faults of a handover (none outside tests): `slow_handover`,
/// `fail_handover_start` and `fail_handover_recovery`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandoverFaults {
    /// The old worker's pause once it let go, before it exits.
    pub pace: Duration,
    /// The new worker is started with a spec it refuses, so it exits at once.
    pub new_worker_fails: bool,
    /// The new worker is told to recover a device that does not exist, so
    /// it fails once the old one has let go.
    pub recovery_fails: bool,
}

/// The variable that names the test clock's file.
const CLOCK_VAR: &str = "BLOCKPLANE_TEST_CLOCK";

/// The wall clock the manager dates and schedules by (backups' moments,
/// backup schedules' runs). A test build reads it, when `BLOCKPLANE_TEST_CLOCK`
/// names a file, from that file (an RFC 3339 time, read at every look), so
/// that a test moves days on in seconds; a build without `test-faults`
/// refuses the variable, as it refuses a fault.
#[derive(Debug, Clone, Default)]
pub struct Clock {
    #[cfg(feature = "test-faults")]
    file: Option<std::path::PathBuf>,
}

impl Clock {
    /// The clock `BLOCKPLANE_TEST_CLOCK` names (unset or empty: the system's).
    pub fn from_env() -> std::result::Result<Self, FaultError> {
        let value = std::env::var_os(CLOCK_VAR).unwrap_or_default();
        if value.is_empty() {
            return Ok(Self::default());
        }
        #[cfg(feature = "test-faults")]
        return Ok(Self {
            file: Some(value.into()),
        });
        #[cfg(not(feature = "test-faults"))]
        Err(FaultError::ClockNotBuilt(
            value.to_string_lossy().into_owned(),
        ))
    }

    /// Now: the system's time, or the test clock's (its file unreadable or
    /// not a time: the system's, and a warning).
    pub fn now(&self) -> time::OffsetDateTime {
        #[cfg(feature = "test-faults")]
        if let Some(file) = &self.file {
            let text = std::fs::read_to_string(file).unwrap_or_default();
            match time::OffsetDateTime::parse(
                text.trim(),
                &time::format_description::well_known::Rfc3339,
            ) {
                Ok(t) => return t,
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "the test clock is not a time")
                }
            }
        }
        time::OffsetDateTime::now_utc()
    }
}

/// The test fault a service injects: none in a build without `test-faults`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    #[cfg(feature = "test-faults")]
    fault: Option<Fault>,
}

impl Faults {
    /// The fault `BLOCKPLANE_TEST_FAULT` names (unset or empty: none).
    pub fn from_env() -> std::result::Result<Self, FaultError> {
        let value = std::env::var_os(VAR).map(|v| v.to_string_lossy().into_owned());
        Self::named(value.as_deref().unwrap_or(""))
    }

    /// The fault `value` names; empty: none.
    fn named(value: &str) -> std::result::Result<Self, FaultError> {
        if value.is_empty() {
            return Ok(Self::default());
        }
        #[cfg(feature = "test-faults")]
        return match Fault::parse(value) {
            Some(fault) => Ok(Self { fault: Some(fault) }),
            None => Err(FaultError::Unknown(value.to_string())),
        };
        #[cfg(not(feature = "test-faults"))]
        Err(FaultError::NotBuilt(value.to_string()))
    }

    /// Injects the fault of point `at`, if that is the one asked for: kills
    /// the service, or fails the operation.
    pub fn point(&self, at: After) -> Result<(), Injected> {
        #[cfg(feature = "test-faults")]
        match self.fault {
            Some(Fault::Kill(s)) if s == at => {
                tracing::warn!(?at, "test fault: killing the service");
                let _ = rustix::process::kill_process(
                    rustix::process::getpid(),
                    rustix::process::Signal::KILL,
                );
            }
            Some(Fault::Fail(s)) if s == at => {
                return Err(Injected(at));
            }
            _ => {}
        }
        #[cfg(not(feature = "test-faults"))]
        let _ = at;
        Ok(())
    }

    /// Whether a test asked to kill the service at `at` (a backend's point,
    /// which may have something to do first).
    pub fn kills_at(&self, at: After) -> bool {
        #[cfg(feature = "test-faults")]
        return self.fault == Some(Fault::Kill(at));
        #[cfg(not(feature = "test-faults"))]
        {
            let _ = at;
            false
        }
    }

    /// Kills the service if a test asked for it at `at` (a point inside a
    /// backend's attach).
    pub fn kill_point(&self, at: After) {
        if self.kills_at(at) {
            let _ = self.point(at);
        }
    }

    /// Whether a test asked the ublk supervisor to suffer `what` (while its
    /// gate file exists: the caller looks).
    pub fn supervisor(&self, what: SupervisorFault) -> bool {
        #[cfg(feature = "test-faults")]
        return self.fault == Some(Fault::Supervisor(what));
        #[cfg(not(feature = "test-faults"))]
        {
            let _ = what;
            false
        }
    }

    /// Whether a test asked for `what` to be slow.
    pub fn slows(&self, what: Slow) -> bool {
        #[cfg(feature = "test-faults")]
        return self.fault == Some(Fault::Slow(what));
        #[cfg(not(feature = "test-faults"))]
        {
            let _ = what;
            false
        }
    }

    /// What a handover is to inject.
    pub fn handover(&self) -> HandoverFaults {
        HandoverFaults {
            pace: if self.slows(Slow::Handover) {
                Duration::from_secs(3)
            } else {
                Duration::ZERO
            },
            #[cfg(feature = "test-faults")]
            new_worker_fails: self.fault == Some(Fault::HandoverStartFails),
            #[cfg(not(feature = "test-faults"))]
            new_worker_fails: false,
            #[cfg(feature = "test-faults")]
            recovery_fails: self.fault == Some(Fault::HandoverRecoveryFails),
            #[cfg(not(feature = "test-faults"))]
            recovery_fails: false,
        }
    }

    /// Waits 3 s if a test asked for `what` to be slow.
    pub async fn pause(&self, what: Slow) {
        if self.slows(what) {
            tracing::warn!(?what, "test fault: pausing 3 s");
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
    }

    /// The pause after each 16 MiB stretch of an allocate or a copy.
    pub fn pace(&self, what: Slow) -> Duration {
        if self.slows(what) {
            Duration::from_millis(100)
        } else {
            Duration::ZERO
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_fault_when_unset_or_empty() {
        assert!(!Faults::named("").unwrap().slows(Slow::Copy));
    }

    #[cfg(feature = "test-faults")]
    #[test]
    fn every_fault_is_named_and_an_unknown_name_refused() {
        for (name, fault) in [
            ("kill_after_insert", Fault::Kill(After::Insert)),
            ("kill_after_attach", Fault::Kill(After::Attach)),
            ("kill_after_add", Fault::Kill(After::Add)),
            ("kill_after_create", Fault::Kill(After::Create)),
            ("kill_after_first_change", Fault::Kill(After::FirstChange)),
            ("fail_after_first_change", Fault::Fail(After::FirstChange)),
            ("fail_after_add", Fault::Fail(After::Add)),
            ("kill_after_detach", Fault::Kill(After::Detach)),
            ("kill_after_change", Fault::Kill(After::Change)),
            ("fail_after_attach", Fault::Fail(After::Attach)),
            ("slow_image_create", Fault::Slow(Slow::ImageCreate)),
            ("slow_allocate", Fault::Slow(Slow::Allocate)),
            ("slow_copy", Fault::Slow(Slow::Copy)),
            ("slow_handover", Fault::Slow(Slow::Handover)),
            ("fail_handover_start", Fault::HandoverStartFails),
            ("fail_handover_recovery", Fault::HandoverRecoveryFails),
            ("slow_volume_change", Fault::Slow(Slow::VolumeChange)),
            (
                "fail_supervisor_start",
                Fault::Supervisor(SupervisorFault::Start),
            ),
            (
                "fail_supervisor_wait",
                Fault::Supervisor(SupervisorFault::Wait),
            ),
            (
                "panic_supervisor",
                Fault::Supervisor(SupervisorFault::Panic),
            ),
            (
                "emfile_pidfd",
                Fault::Supervisor(SupervisorFault::PidfdOpen),
            ),
            (
                "fail_recovery_spawn",
                Fault::Supervisor(SupervisorFault::RecoverySpawn),
            ),
        ] {
            assert_eq!(Faults::named(name).unwrap().fault, Some(fault), "{name}");
        }
        for bad in [
            "kill_after_lunch",
            "slow",
            "stop_after_attach",
            "fail_after_create",
        ] {
            let e = Faults::named(bad).unwrap_err();
            assert!(matches!(e, FaultError::Unknown(_)), "{bad}: {e}");
        }
    }

    #[cfg(not(feature = "test-faults"))]
    #[test]
    fn a_build_without_faults_refuses_one() {
        let e = Faults::named("kill_after_attach").unwrap_err();
        assert!(matches!(e, FaultError::NotBuilt(_)), "{e}");
        assert!(e.to_string().contains("--features blockplane/test-faults"));
    }
}
