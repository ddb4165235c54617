//! One moment of the volume's I/O: its extents shared with a new file
//! (`FICLONE`), or copied into it by copy-before-write ([`crate::moment`]).

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockplane_protocol::{self as protocol, Fill, FillState};

use super::Shared;
use crate::moment;
use crate::refusal::Refusal;
use blockplane_protocol::DataPath;

impl Shared {
    /// Shares the image's extents with `dest` at one moment of the volume's
    /// I/O ([`protocol::Request::Snapshot`]); returns how long the queues
    /// were held. Refused on `direct`, whose map must own its extents alone.
    pub fn snapshot(&self, dest: &File) -> Result<Duration, Refusal> {
        // Most dirty data reaches the disk before the hold, so the FICLONE
        // inside it (which writes back what is still dirty) has little left.
        self.data.sync_data().map_err(|source| Refusal::Io {
            op: "fdatasync the image",
            source,
        })?;
        let held = Instant::now();
        self.with_queues_held(|| {
            if self.config().policy == DataPath::Direct {
                return Err(Refusal::Rule(protocol::SNAPSHOT_OF_DIRECT.into()));
            }
            rustix::fs::ioctl_ficlone(dest, &self.image).map_err(|e| {
                if blockplane_system::image::cannot_share(e) {
                    Refusal::Rule(format!(
                        "the image's filesystem cannot share its extents with a snapshot (FICLONE: {e})"
                    ))
                } else {
                    Refusal::Io {
                        op: "FICLONE",
                        source: e.into(),
                    }
                }
            })
        })?;
        Ok(held.elapsed())
    }

    /// Begins a copy of one moment of the volume into `dest` where the
    /// filesystem cannot share extents ([`protocol::Request::CopyMoment`]):
    /// the queues are held once, with no request inside, while writes start
    /// keeping their chunks' old bytes (see [`moment`]); a thread of its own
    /// copies the rest, its progress in [`Self::copy_state`]. Returns how
    /// long the queues were held.
    pub fn start_copy(
        self: &Arc<Self>,
        dest: File,
        pace: Duration,
        gate: Option<std::path::PathBuf>,
    ) -> Result<Duration, Refusal> {
        if self.copy_running() {
            return Err(Refusal::Rule(
                "a copy of one moment already runs in this worker: one at a time".into(),
            ));
        }
        // A fill writes zeros without keeping chunks.
        if self
            .fill_state()
            .is_some_and(|f| f.state == FillState::Running)
        {
            return Err(Refusal::Rule(
                "an allocate runs in this worker: a copy of one moment waits for its end".into(),
            ));
        }
        let io = |op| move |source| Refusal::Io { op, source };
        let size = self.state.lock().expect("state poisoned").size_bytes;
        dest.set_len(size).map_err(io("size the moment's file"))?;
        let src = self.data.try_clone().map_err(io("dup"))?;
        let moment = Arc::new(moment::Moment::new(src, dest, size));
        let held = Instant::now();
        self.with_queues_held(|| {
            if self.config().policy == DataPath::Direct {
                return Err(Refusal::Rule(protocol::SNAPSHOT_OF_DIRECT.into()));
            }
            self.config().moment = Some(moment.clone());
            Ok(())
        })?;
        let held = held.elapsed();
        *self.jobs.copy.lock().expect("copy poisoned") = Some(Fill {
            state: FillState::Running,
            done_bytes: 0,
            total_bytes: size,
            error: None,
        });
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("moment-copy".into())
            .spawn(move || {
                // As the queue threads: it writes while the device it serves
                // may be what writeback waits on.
                if let Err(e) = rustix::process::configure_io_flusher_behavior(true) {
                    tracing::warn!(error = %e, "PR_SET_IO_FLUSHER refused for the copy's thread");
                }
                let out = moment.run(pace, gate.as_ref(), |done| {
                    if let Some(c) = me.jobs.copy.lock().expect("copy poisoned").as_mut() {
                        c.done_bytes = done;
                    }
                });
                me.end_copy(out);
            });
        if let Err(source) = spawned {
            self.end_copy(Err(format!("start the copy's thread: {source}")));
            return Err(io("start the copy's thread")(source));
        }
        Ok(held)
    }

    /// Whether a copy of one moment runs.
    pub(super) fn copy_running(&self) -> bool {
        self.copy_state()
            .is_some_and(|c| c.state == FillState::Running)
    }

    /// Asks a running copy to stop; writes stop keeping chunks at once.
    pub fn cancel_copy(&self) {
        if let Some(m) = &self.config().moment {
            m.cancel();
        }
    }

    /// The last copy of one moment: running, or how it ended.
    pub fn copy_state(&self) -> Option<Fill> {
        self.jobs.copy.lock().expect("copy poisoned").clone()
    }

    /// Takes the moment off the queues, then records how its copy ended.
    pub(super) fn end_copy(&self, out: Result<bool, String>) {
        if let Err(e) = self.reconfigure(|c| c.moment = None) {
            tracing::error!(error = %e, "the queues kept a finished moment");
        }
        let (state, error) = match out {
            Ok(true) => (FillState::Done, None),
            Ok(false) => (FillState::Cancelled, None),
            Err(e) => (FillState::Failed, Some(e)),
        };
        tracing::info!(?state, ?error, "copy of one moment ended");
        if let Some(c) = self.jobs.copy.lock().expect("copy poisoned").as_mut() {
            c.state = state;
            c.error = error;
        }
    }
}
