//! Background jobs on images: an allocate (`images.rs`) and the copy of a
//! snapshot or clone (`copies.rs`). Each runs an [`AllocateJob`] (its
//! progress, pace and cancel) while requests go on. This module keeps their
//! list, refuses a change of an image a running job depends on (a second
//! allocate included), stops them and shows their progress; a kind of job
//! supplies only which image it depends on and how it says no.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use super::error::{Error, Result};
use crate::store::ImageRow;
use blockplane_system::image::AllocateJob;

/// What a kind of job supplies to [`Jobs`].
pub(super) trait Job: Send + 'static {
    /// Whether the job, running on image `own`, needs `image`'s bytes to
    /// stay as they are (it writes or reads them).
    fn depends_on(&self, own: Uuid, image: Uuid) -> bool;
    /// The refusal of `what` of `image` while the job runs.
    fn refusal(&self, image: &ImageRow, what: &str) -> Error;
}

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum JobState {
    Running,
    Done,
    Cancelled,
    Failed,
}

/// How a job ended, as its work reports it.
pub(super) struct Ended {
    pub state: JobState,
    pub error: Option<String>,
}

impl Ended {
    /// How a job whose work gave `out` ended: done when `finished` says its
    /// work completed, cancelled when it stopped early, failed on an error
    /// or when its end could not be `recorded` (`what` of image `name`, for
    /// the log).
    pub fn of<T>(
        out: Result<T>,
        finished: impl FnOnce(&T) -> bool,
        recorded: std::result::Result<(), crate::store::StoreError>,
        what: &str,
        name: &str,
    ) -> Ended {
        let state = match &out {
            Ok(v) if finished(v) => JobState::Done,
            Ok(_) => JobState::Cancelled,
            Err(_) => JobState::Failed,
        };
        match recorded {
            Ok(()) => Ended {
                state,
                error: out.err().map(|e| e.to_string()),
            },
            Err(e) => {
                tracing::error!(image = %name, error = %e, "could not record the end of {what}");
                Ended {
                    state: JobState::Failed,
                    error: Some(format!("recording the end: {e}")),
                }
            }
        }
    }
}

/// An image's last job, as the API shows it.
pub(super) struct Progress {
    pub state: JobState,
    pub done_bytes: u64,
    pub total_bytes: u64,
    pub error: Option<String>,
    pub started_at: OffsetDateTime,
}

struct Run<J> {
    kind: J,
    job: Arc<AllocateJob>,
    state: JobState,
    error: Option<String>,
    started_at: OffsetDateTime,
}

fn progress_of<J>(r: &Run<J>) -> Progress {
    Progress {
        state: r.state,
        done_bytes: r.job.done_bytes.load(Relaxed),
        total_bytes: r.job.total_bytes.load(Relaxed),
        error: r.error.clone(),
        started_at: r.started_at,
    }
}

type Runs<J> = Arc<Mutex<HashMap<Uuid, Run<J>>>>;

/// The jobs of one kind, by the image each runs on. An image's last job
/// stays, ended, until [`Jobs::forget`] (in memory: a restart forgets it).
pub(super) struct Jobs<J> {
    runs: Runs<J>,
}

impl<J> Default for Jobs<J> {
    fn default() -> Self {
        Self {
            runs: Arc::default(),
        }
    }
}

/// How long [`Jobs::stop`] waits: one stretch, and the end being recorded.
const STOP_WAIT: Duration = Duration::from_secs(60);

fn lock<J>(runs: &Runs<J>) -> MutexGuard<'_, HashMap<Uuid, Run<J>>> {
    runs.lock().expect("job list poisoned")
}

impl<J: Job> Jobs<J> {
    /// Runs `work` in the background as image `id`'s job, with `total` bytes
    /// to do, `pace` after each stretch and a `gate` to wait at (test
    /// faults); it ends as `work` says.
    pub fn start<Fut>(
        &self,
        id: Uuid,
        kind: J,
        (pace, gate): (Duration, Option<std::path::PathBuf>),
        total: u64,
        work: impl FnOnce(Arc<AllocateJob>) -> Fut,
    ) where
        Fut: Future<Output = Ended> + Send + 'static,
    {
        let job = Arc::new(AllocateJob {
            pace,
            gate,
            ..Default::default()
        });
        job.total_bytes.store(total, Relaxed);
        let run = Run {
            kind,
            job: job.clone(),
            state: JobState::Running,
            error: None,
            started_at: OffsetDateTime::now_utc(),
        };
        lock(&self.runs).insert(id, run);
        let (runs, work) = (self.runs.clone(), work(job));
        tokio::spawn(async move {
            let ended = work.await;
            if let Some(run) = lock(&runs).get_mut(&id) {
                run.state = ended.state;
                run.error = ended.error;
            }
        });
    }

    /// Refuses `what` of `image` while a job that depends on it runs.
    pub fn refuse(&self, image: &ImageRow, what: &str) -> Result<()> {
        let runs = lock(&self.runs);
        let running = runs
            .iter()
            .filter(|(_, r)| r.state == JobState::Running)
            .find(|(own, r)| r.kind.depends_on(**own, image.id));
        match running {
            Some((_, r)) => Err(r.kind.refusal(image, what)),
            None => Ok(()),
        }
    }

    fn running(&self, id: Uuid) -> Option<Arc<AllocateJob>> {
        lock(&self.runs)
            .get(&id)
            .filter(|r| r.state == JobState::Running)
            .map(|r| r.job.clone())
    }

    /// Stops image `id`'s running job after its current stretch and waits
    /// until it ended (a minute at most). `false`: none ran.
    pub async fn stop(&self, id: Uuid) -> bool {
        let Some(job) = self.running(id) else {
            return false;
        };
        job.cancel.store(true, Relaxed);
        let until = tokio::time::Instant::now() + STOP_WAIT;
        while self.running(id).is_some() && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Asks every running job to stop, without waiting.
    pub fn stop_all(&self) {
        for run in lock(&self.runs).values() {
            run.job.cancel.store(true, Relaxed);
        }
    }

    /// Image `id`'s last job.
    pub fn progress(&self, id: Uuid) -> Option<Progress> {
        lock(&self.runs).get(&id).map(progress_of)
    }

    /// Every job, running or ended, as `view` makes it of its kind and
    /// progress (for listings of jobs that are not images' own).
    pub fn list<T>(&self, view: impl Fn(Uuid, &J, Progress) -> T) -> Vec<T> {
        lock(&self.runs)
            .iter()
            .map(|(id, r)| view(*id, &r.kind, progress_of(r)))
            .collect()
    }

    /// Forgets image `id`'s last job (the image is gone), unless it still runs.
    pub fn forget(&self, id: Uuid) {
        let mut runs = lock(&self.runs);
        if runs.get(&id).is_some_and(|r| r.state != JobState::Running) {
            runs.remove(&id);
        }
    }
}
