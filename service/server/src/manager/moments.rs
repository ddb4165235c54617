//! The volumes whose worker copies one moment now: one copy at a time
//! each, so that a job follows only its own.

use std::sync::Arc;

use uuid::Uuid;

use super::error::{Error, Result};
use crate::store::{ImageRow, VolumeRow};

/// The volumes whose worker copies one moment now, and into what.
#[derive(Default, Clone)]
pub(super) struct MomentCopies(Arc<std::sync::Mutex<std::collections::HashMap<Uuid, String>>>);

impl MomentCopies {
    /// Claims volume `v` for a copy into `into`; 409 while another runs.
    pub(super) fn claim(&self, src: &ImageRow, v: &VolumeRow, into: &str) -> Result<CopyClaim> {
        let mut running = self.0.lock().expect("moment copies poisoned");
        if let Some(other) = running.get(&v.id) {
            return Err(Error::MomentCopyRunning {
                name: src.name.clone(),
                volume: v.name.clone(),
                into: other.clone(),
            });
        }
        running.insert(v.id, into.to_string());
        Ok(CopyClaim {
            copies: self.clone(),
            volume: v.id,
        })
    }
}

/// A volume claimed in [`MomentCopies`] until dropped.
pub(super) struct CopyClaim {
    copies: MomentCopies,
    volume: Uuid,
}

impl Drop for CopyClaim {
    fn drop(&mut self) {
        self.copies
            .0
            .lock()
            .expect("moment copies poisoned")
            .remove(&self.volume);
    }
}
