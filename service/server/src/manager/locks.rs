//! Per-key async locks: operations on one name or id queue behind each other,
//! operations on different keys run in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// Who may change an image or a volume now: one change at a time of each.
#[derive(Default)]
pub(super) struct Locks {
    /// Serialises image registration (name and file identity checks + insert).
    pub registration: AsyncMutex<()>,
    /// Keyed by image id.
    pub images: KeyedLocks,
    /// Keyed by volume name: create, delete and live changes of one volume queue.
    pub volumes: KeyedLocks,
}

/// A set of locks, one per key, made on demand and dropped when unused.
#[derive(Debug, Default)]
pub struct KeyedLocks {
    locks: Mutex<HashMap<String, Weak<AsyncMutex<()>>>>,
}

impl KeyedLocks {
    /// Waits for and takes the lock of `key`.
    pub async fn lock(&self, key: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.locks.lock().expect("lock table poisoned");
            locks.retain(|_, l| l.strong_count() > 0);
            match locks.get(key).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(AsyncMutex::new(()));
                    locks.insert(key.to_string(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn one_key_is_exclusive_and_keys_are_independent() {
        let locks = Arc::new(KeyedLocks::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (locks, inside) = (locks.clone(), inside.clone());
            tasks.push(tokio::spawn(async move {
                let _g = locks.lock("a").await;
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
            }));
        }
        let _b = locks.lock("b").await;
        for t in tasks {
            t.await.unwrap();
        }
    }
}
