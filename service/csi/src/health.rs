//! A volume's condition as the CO sees it (the `VOLUME_CONDITION`
//! capabilities). The controller's view is the volume's health: abnormal
//! while it is `degraded` or `error`, or while its worker is replaced over
//! and over (a restart loop, read from the volume's `worker_restarted`
//! events). The node's view is whether the device serves.

use std::collections::HashMap;
use std::time::Duration;

use super::proto::VolumeCondition;
use blockplane_api::model::{self, Event, VolumeState};
use uuid::Uuid;

/// How far back worker replacements count toward a restart loop.
pub const RESTART_WINDOW: Duration = Duration::from_secs(600);
/// Replacements within [`RESTART_WINDOW`] that make a restart loop: one is
/// a worker that crashed and was recovered; three in ten minutes is a
/// worker that will crash again.
pub const RESTART_LOOP: usize = 3;

/// The event kind of a worker replaced after it died.
pub const RESTARTED: &str = "worker_restarted";

/// The worker replacements among `events` (those of [`RESTART_WINDOW`]),
/// by volume id.
pub fn restarts(events: &[Event]) -> HashMap<Uuid, Vec<&Event>> {
    let mut by: HashMap<Uuid, Vec<&Event>> = HashMap::new();
    for e in events.iter().filter(|e| e.kind == RESTARTED) {
        if let Some(id) = e.volume_id {
            by.entry(id).or_default().push(e);
        }
    }
    by
}

/// The controller's condition of `v`, given its worker replacements of the
/// last [`RESTART_WINDOW`] (oldest first).
pub fn of_volume(v: &model::Volume, restarts: &[&Event]) -> VolumeCondition {
    let state = v.state.as_str();
    if matches!(v.state, VolumeState::Degraded | VolumeState::Error) {
        return VolumeCondition {
            abnormal: true,
            message: format!(
                "blockplane volume '{}' is {state}: {}",
                v.name,
                v.state_reason.as_deref().unwrap_or("no reason recorded")
            ),
        };
    }
    if let Some(last) = restarts.last().filter(|_| restarts.len() >= RESTART_LOOP) {
        return VolumeCondition {
            abnormal: true,
            message: format!(
                "blockplane volume '{}' is {state}, but its worker was replaced {} times in the last {} minutes; the last time: {}",
                v.name,
                restarts.len(),
                RESTART_WINDOW.as_secs() / 60,
                last.message
            ),
        };
    }
    VolumeCondition {
        abnormal: false,
        message: format!("blockplane volume '{}' is {state}", v.name),
    }
}

/// The node's condition of `v`: abnormal unless its device serves.
pub fn of_device(v: &model::Volume) -> VolumeCondition {
    let abnormal =
        v.device.is_none() || !matches!(v.state, VolumeState::Attached | VolumeState::Degraded);
    let message = match &v.state_reason {
        Some(r) => format!("{}: {r}", v.state.as_str()),
        None => v.state.as_str().to_string(),
    };
    VolumeCondition { abnormal, message }
}
