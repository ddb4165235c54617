//! One call at a time per volume. The CSI spec asks a plugin to answer
//! ABORTED to a call for a volume that another call is still working on (the
//! CO retries later), rather than queueing or running both.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};

use super::errors::CsiError;

/// Keys of the volumes with a call in flight.
#[derive(Debug, Clone, Default)]
pub struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
}

/// Held while a call works on a volume; dropping it ends the call.
#[derive(Debug)]
pub struct Guard {
    keys: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl InFlight {
    /// Takes `key` for one call, or [`CsiError::InFlight`] when another call holds it.
    pub fn try_lock(&self, key: &str) -> Result<Guard, CsiError> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if !keys.insert(key.to_string()) {
            return Err(CsiError::InFlight {
                volume: key.to_string(),
            });
        }
        Ok(Guard {
            keys: self.keys.clone(),
            key: key.to_string(),
        })
    }

    /// Runs `work` for `key` on its own task, holding the key until the work
    /// ends. A CO that gives up on a call (its deadline passed) drops the
    /// handler; the work goes on, and retries answer ABORTED until it is done,
    /// instead of racing a half-finished create or mount.
    pub async fn run<T, F>(&self, key: &str, work: F) -> Result<T, CsiError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, CsiError>> + Send + 'static,
    {
        let guard = self.try_lock(key)?;
        let task = tokio::spawn(async move {
            let out = work.await;
            drop(guard);
            out
        });
        task.await.map_err(|e| CsiError::Internal {
            volume: key.to_string(),
            reason: format!("the call's task failed: {e}"),
        })?
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_call_for_a_volume_is_aborted_until_the_first_ends() {
        let f = InFlight::default();
        let g = f.try_lock("a").unwrap();
        let e = f.try_lock("a").unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted);
        assert!(e.to_string().contains("'a'"), "{e}");
        let other = f.try_lock("b").unwrap();
        drop(g);
        f.try_lock("a").unwrap();
        drop(other);
    }

    #[tokio::test]
    async fn work_goes_on_when_the_caller_gives_up() {
        let f = InFlight::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let f2 = f.clone();
        let call = tokio::spawn(async move {
            f2.run("v", async move {
                let _ = rx.await;
                Ok(())
            })
            .await
        });
        tokio::task::yield_now().await;
        while f.try_lock("v").is_ok() {
            tokio::task::yield_now().await;
        }
        call.abort();
        let _ = call.await;
        // The caller is gone, the work is not: the volume stays busy.
        assert_eq!(f.try_lock("v").unwrap_err().code(), tonic::Code::Aborted);
        tx.send(()).unwrap();
        for _ in 0..1000 {
            if f.try_lock("v").is_ok() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the key was not released after the work ended");
    }
}
