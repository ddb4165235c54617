//! Test faults: a SIGKILL, a failure or a slowdown injected at a named
//! point (env `BLOCKPLANE_TEST_FAULT`), so that the black-box and kernel
//! tests can prove restart, cleanup, progress and cancel.

use super::{Error, Manager, Result};

/// The points of a volume's create, delete and live changes after which a test can
/// inject a fault (env `BLOCKPLANE_TEST_FAULT`), to prove restart and cleanup
/// work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// The volume row is recorded, no device exists yet.
    Insert,
    /// The device exists, the row does not say so yet.
    Attach,
    /// The device is gone, the row is still there.
    Detach,
    /// A live change (a PATCH, or a volume following its image's resize) is
    /// made on the device, the row does not say so yet.
    Change,
}

/// An injected fault: SIGKILL the service, or fail the operation, at a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Kill(After),
    Fail(After),
    /// Every image create takes 3 s more once its file is made
    /// (`slow_image_create`): a request that outlasts a timeout, holds a
    /// concurrency slot or is in flight at SIGTERM, whatever the disk.
    SlowImageCreate,
    /// Each 16 MiB stretch an allocate zeroes (in the service or a ublk
    /// worker) takes 100 ms more (`slow_allocate`): its progress and cancel,
    /// whatever the disk.
    SlowAllocate,
    /// Each 16 MiB stretch a snapshot's or clone's background copy copies
    /// takes 100 ms more (`slow_copy`): its progress, cancel and a crash
    /// during it, whatever the disk.
    SlowCopy,
}

impl Fault {
    /// Parses `kill_after_insert`, `kill_after_attach`, `kill_after_detach`,
    /// `kill_after_change`, `fail_after_attach`, `slow_image_create`,
    /// `slow_allocate`, `slow_copy`.
    pub fn parse(s: &str) -> Option<Self> {
        if s == "slow_image_create" {
            return Some(Fault::SlowImageCreate);
        }
        if s == "slow_allocate" {
            return Some(Fault::SlowAllocate);
        }
        if s == "slow_copy" {
            return Some(Fault::SlowCopy);
        }
        let (action, stage) = s.split_once("_after_")?;
        let stage = match stage {
            "insert" => After::Insert,
            "attach" => After::Attach,
            "detach" => After::Detach,
            "change" => After::Change,
            _ => return None,
        };
        match action {
            "kill" => Some(Fault::Kill(stage)),
            "fail" => Some(Fault::Fail(stage)),
            _ => None,
        }
    }
}

impl Manager {
    /// Applies the injected fault of this stage, if any.
    pub(super) fn fault_point(&self, at: After) -> Result<()> {
        match self.fault {
            Some(Fault::Kill(s)) if s == at => {
                tracing::warn!(?at, "test fault: killing the service");
                let _ = rustix::process::kill_process(
                    rustix::process::getpid(),
                    rustix::process::Signal::KILL,
                );
                Ok(())
            }
            Some(Fault::Fail(s)) if s == at => {
                Err(Error::Internal(format!("injected test fault at {at:?}")))
            }
            _ => Ok(()),
        }
    }
}
