//! The volumes' part of the manager: what it keeps of the volumes beyond
//! their rows (the once-a-second readings, the volumes a start has not
//! reconciled yet, the list the API reads often, kept ready), over the
//! images' part it claims images through. Its steps, the volume operations
//! of the API among them, are `impl Volumes` in `volumes.rs`,
//! `handover.rs` and `encryption.rs`.

use std::sync::Arc;

use super::house::House;
use super::image_jobs::Images;
use super::look::Readings;
use super::recovery::Recovering;

/// The store's, the page-cache warnings' and the recovery's generations: a
/// view made at them is current while none has moved.
pub(super) type Generations = (u64, u64, u64);

/// What the API reads often, kept ready for it.
#[derive(Default)]
pub(super) struct ApiViews {
    /// `GET /v1/volumes` as JSON, with the store, warnings and recovery
    /// generations it was made at.
    pub(super) volumes: std::sync::Mutex<Option<(Generations, bytes::Bytes)>>,
    /// API request counts and durations.
    pub(super) requests: crate::metrics::ApiMetrics,
}

/// The volumes' part. Cheap to clone, so a step that runs on after its
/// request holds this part alone.
#[derive(Clone)]
pub struct Volumes {
    pub(super) images: Images,
    /// The once-a-second look at every attached volume.
    pub(super) readings: Arc<Readings>,
    /// The volumes a start has not reconciled yet.
    pub(super) recovering: Arc<Recovering>,
    /// What the API reads often, kept ready.
    pub(super) api: Arc<ApiViews>,
}

impl Volumes {
    /// What every step reads: the images' part's house, the one house.
    pub(super) fn house(&self) -> &House {
        &self.images.house
    }

    /// The volumes' part over `images`, with nothing read or kept yet.
    pub(super) fn new(images: Images) -> Self {
        Self {
            images,
            readings: Arc::default(),
            recovering: Arc::default(),
            api: Arc::default(),
        }
    }
}
