//! The volumes a starting service has not matched with the kernel yet.
//!
//! The API answers from the start, and reconciliation runs beside it: a host
//! with hundreds of volumes must not be dark while their workers come back.
//! Until reconciliation reaches a volume, the volume shows `recovering`, and
//! a change to it waits: reconciliation took every volume's lock before the
//! first request could.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use uuid::Uuid;

/// The volumes still to be reconciled, for the API's views.
#[derive(Debug, Default)]
pub(super) struct Recovering {
    pending: Mutex<HashSet<Uuid>>,
    /// Set once the start's reconciliation is over, orphans included.
    finished: AtomicBool,
    /// Bumped at every change, so that a cached view of the volumes is
    /// rebuilt when one is reconciled.
    generation: AtomicU64,
}

impl Recovering {
    /// Marks `ids` as not reconciled yet.
    pub(super) fn begin(&self, ids: impl IntoIterator<Item = Uuid>) {
        self.pending
            .lock()
            .expect("recovering poisoned")
            .extend(ids);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Volume `id` is reconciled (or gone).
    pub(super) fn done(&self, id: Uuid) {
        self.pending
            .lock()
            .expect("recovering poisoned")
            .remove(&id);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether volume `id` waits for reconciliation.
    pub(super) fn contains(&self, id: Uuid) -> bool {
        self.pending
            .lock()
            .expect("recovering poisoned")
            .contains(&id)
    }

    /// How many volumes wait for reconciliation.
    pub(super) fn count(&self) -> usize {
        self.pending.lock().expect("recovering poisoned").len()
    }

    /// The start's reconciliation is over: volumes, then orphan devices.
    pub(super) fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    /// Whether the start's reconciliation is over.
    pub(super) fn finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Changes with every volume marked or reconciled.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}
