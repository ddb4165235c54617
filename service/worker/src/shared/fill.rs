//! Making a serving image `full`: its holes and unwritten extents written
//! with zeros range by range, the queues held for each, on a thread of its
//! own.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use blockplane_protocol::{self as protocol, Fill, FillState};
use blockplane_system::extent::{self};
// Bytes zeroed at a time by a fill, the queues held meanwhile.
use blockplane_system::image::ALLOCATE_STEP;

use super::Shared;
use crate::refusal::Refusal;
use blockplane_protocol::DataPath;

impl Shared {
    /// Starts making the image `full`: the file paths stop punching it, then
    /// a thread of its own writes zeros over its holes and unwritten extents
    /// (see [`Self::fill`]), so the control socket keeps answering meanwhile.
    /// A fill already running goes on; its progress is in [`Self::fill_state`].
    pub fn start_allocate(self: &Arc<Self>, pace: Duration) -> Result<(), Refusal> {
        if self.spec.read_only {
            return Err(Refusal::Rule(protocol::CANNOT_FILL_READ_ONLY.into()));
        }
        if self
            .fill_state()
            .is_some_and(|f| f.state == FillState::Running)
        {
            return Ok(());
        }
        if self.copy_running() {
            return Err(Refusal::Rule(
                "a snapshot's copy of one moment runs in this worker: an allocate waits for its end"
                    .into(),
            ));
        }
        let size = self.state.lock().expect("state poisoned").size_bytes;
        let todo = extent::unwritten_ranges(self.image.as_fd(), 0, size).map_err(|source| {
            Refusal::Io {
                op: "FS_IOC_FIEMAP",
                source,
            }
        })?;
        let kept = self.config().keep_allocated;
        self.reconfigure(|c| c.keep_allocated = true)?;
        self.jobs.fill_cancel.store(false, Relaxed);
        *self.jobs.fill.lock().expect("fill poisoned") = Some(Fill {
            state: FillState::Running,
            done_bytes: 0,
            total_bytes: todo.iter().map(|(a, b)| b - a).sum(),
            error: None,
        });
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("allocate".into())
            .spawn(move || {
                let out = me.fill(&todo, pace);
                me.end_fill(out, kept);
            });
        if let Err(source) = spawned {
            let e = Refusal::Io {
                op: "start the allocate thread",
                source,
            };
            self.end_fill(Err(Refusal::Rule(e.to_string())), kept);
            return Err(e);
        }
        Ok(())
    }

    /// Asks a running fill to stop after its current stretch.
    pub fn cancel_allocate(&self) {
        self.jobs.fill_cancel.store(true, Relaxed);
    }

    /// The last fill: running, or how it ended.
    pub fn fill_state(&self) -> Option<Fill> {
        self.jobs.fill.lock().expect("fill poisoned").clone()
    }

    /// Writes zeros over `todo`, one stretch of at most [`ALLOCATE_STEP`]
    /// bytes at a time with the queues held, so no write of the volume lands
    /// in a stretch while it is zeroed, pausing `pace` after each (a test
    /// fault). `Ok(false)`: cancelled.
    pub(super) fn fill(&self, todo: &[(u64, u64)], pace: Duration) -> Result<bool, Refusal> {
        let data = self
            .data
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| Refusal::Io { op: "dup", source })?;
        for &(a, b) in todo {
            let mut at = a;
            while at < b {
                if self.jobs.fill_cancel.load(Relaxed) {
                    return Ok(false);
                }
                let to = b.min(at + ALLOCATE_STEP);
                self.with_queues_held(|| {
                    // A direct map exists only over a written image.
                    if self.policy() == DataPath::Direct {
                        return Ok(());
                    }
                    blockplane_system::image::allocate_range(&data, at, to).map_err(|source| {
                        Refusal::Io {
                            op: "write zeros",
                            source,
                        }
                    })
                })?;
                if let Some(f) = self.jobs.fill.lock().expect("fill poisoned").as_mut() {
                    f.done_bytes += to - at;
                }
                std::thread::sleep(pace);
                at = to;
            }
        }
        self.data.sync_data().map_err(|source| Refusal::Io {
            op: "fdatasync the image",
            source,
        })?;
        Ok(true)
    }

    /// Records how a fill ended. One that did not finish leaves the image as
    /// it was declared: punched again if it was (`kept` false).
    pub(super) fn end_fill(&self, out: Result<bool, Refusal>, kept: bool) {
        let (state, error) = match out {
            Ok(true) => (FillState::Done, None),
            Ok(false) => (FillState::Cancelled, None),
            Err(e) => (FillState::Failed, Some(e.to_string())),
        };
        if state != FillState::Done
            && !kept
            && let Err(e) = self.reconfigure(|c| c.keep_allocated = false)
        {
            tracing::error!(error = %e, "cannot go back to punching after an unfinished fill");
        }
        tracing::info!(?state, ?error, "allocate ended");
        if let Some(f) = self.jobs.fill.lock().expect("fill poisoned").as_mut() {
            f.state = state;
            f.error = error;
        }
    }
}
