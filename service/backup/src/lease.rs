//! Leases on the target: an object put at the start of a backup or a gc,
//! put again while it runs, deleted at its end. Another service tells a
//! live one from a crashed one by the object's `last_modified`, on the
//! target's clock; the holder stops before the others may take it for
//! stale.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::path::Path;
use time::OffsetDateTime;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::target::Target;
use crate::terms::refresh_of;

/// A lease held: put again every `refresh` until stopped; it remembers when
/// it last succeeded.
pub(crate) struct Held {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    last_ok: Arc<Mutex<Instant>>,
    /// Past this unrefreshed, the lease may be taken for stale by others.
    stale: Duration,
}

impl Held {
    /// Puts `body` at `path`, reads the time the target gave it (when the
    /// lease began, on the target's clock: second-exact on S3, whose HEAD
    /// truncates, so never later than the put), and keeps it live: it is
    /// taken for stale after `stale` unrefreshed.
    pub(crate) async fn take(
        target: &Target,
        path: &Path,
        body: Bytes,
        stale: Duration,
    ) -> Result<(Held, OffsetDateTime)> {
        let since = Instant::now();
        target.put(path, body.clone()).await?;
        let began = match target.head(path).await {
            Ok(Some(m)) => m.last_modified,
            Ok(None) => {
                return Err(Error::Unreachable {
                    target: target.describe().to_string(),
                    reason: format!("{path}, just written, is not there"),
                });
            }
            Err(e) => {
                let _ = target.delete(path).await;
                return Err(e);
            }
        };
        let held = Held::start(target.clone(), path.clone(), body, since, stale);
        Ok((held, began))
    }

    /// Puts `body` at `path` again (replacing what [`Held::take`] put) and
    /// from then on; `self` is spent.
    pub(crate) async fn replace(self, target: &Target, path: &Path, body: Bytes) -> Result<Held> {
        let stale = self.stale;
        self.stop().await;
        let since = Instant::now();
        target.put(path, body.clone()).await?;
        Ok(Held::start(
            target.clone(),
            path.clone(),
            body,
            since,
            stale,
        ))
    }

    fn start(target: Target, path: Path, body: Bytes, since: Instant, stale: Duration) -> Held {
        let (stop, mut stopped) = oneshot::channel();
        let last_ok = Arc::new(Mutex::new(since));
        let last = Arc::clone(&last_ok);
        let every = refresh_of(stale);
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tokio::time::sleep(every) => {
                        // Past this another service may have taken the
                        // lease for stale; it must not come back (the
                        // holder fails on `lost`).
                        if last.lock().unwrap_or_else(|e| e.into_inner()).elapsed() > stale / 2 {
                            break;
                        }
                        // Not raced against the stop: a put still under way
                        // when the lease is deleted would bring it back.
                        match target.put(&path, body.clone()).await {
                            Ok(()) => *last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now(),
                            Err(e) => tracing::warn!(target = target.describe(), lease = %path, error = %e, "a lease could not be refreshed"),
                        }
                    }
                }
            }
        });
        Held {
            stop: Some(stop),
            task: Some(task),
            last_ok,
            stale,
        }
    }

    /// `Some(seconds since the last refresh)` once that is past half of
    /// the lease's staleness: well before another service may take it for
    /// a crashed one's, so the holder stops.
    pub(crate) fn lost(&self) -> Option<u64> {
        let since = self
            .last_ok
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed();
        (since > self.stale / 2).then_some(since.as_secs())
    }

    /// Stops refreshing, after a refresh under way has finished.
    pub(crate) async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Held {
    /// A holder dropped mid-way (its task aborted) stops refreshing too;
    /// its lease goes stale.
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}
