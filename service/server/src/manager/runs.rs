//! What each kind of background job on an image is to the job registry
//! ([`super::jobs`]): which images it holds and how it refuses a change to
//! them. The services that start them (images, copies, backups) keep the
//! rest.

use std::sync::Arc;

use uuid::Uuid;

use super::error::Error;
use super::jobs::Job;
use crate::store::ImageRow;
use blockplane_backup::{BackupMeta, Counters};

/// An allocate (see [`super::image_jobs::Images::allocate_image`]): it writes its image.
pub(super) struct AllocateRun;

impl Job for AllocateRun {
    fn depends_on(&self, own: Uuid, image: Uuid) -> bool {
        own == image
    }

    /// 409 while an allocate runs on the image: it must not change under it.
    fn refusal(&self, image: &ImageRow, what: &str) -> Error {
        Error::AllocateConflict {
            name: image.name.clone(),
            reason: format!(
                "an allocate runs on it, so it cannot {what} now; wait for its end (GET /v1/images/{}) or stop it (DELETE /v1/images/{}/allocate)",
                image.name, image.name
            ),
        }
    }
}

/// A copy into a new image: it reads its source, which must not change
/// until it ends.
pub(super) struct CopyRun {
    pub(super) source: Uuid,
    pub(super) name: String,
}

impl CopyRun {
    /// A restore into image `name`: it reads no image of this service.
    pub(super) fn restore(name: String) -> Self {
        Self {
            source: Uuid::nil(),
            name,
        }
    }
}

impl Job for CopyRun {
    fn depends_on(&self, _own: Uuid, image: Uuid) -> bool {
        image == self.source
    }

    /// 409 `copy_source_busy` while a copy reads the image: its bytes must
    /// not change under it.
    fn refusal(&self, image: &ImageRow, what: &str) -> Error {
        Error::CopySource {
            name: image.name.clone(),
            copy: self.name.clone(),
            what: what.to_string(),
        }
    }
}

/// A running (or ended) backup of this service: what the list shows of it
/// before it has a manifest, or when it never got one.
pub(super) struct BackupRun {
    pub(super) meta: BackupMeta,
    pub(super) counters: Arc<Counters>,
    /// It reads the image's own file: its writers wait for its end.
    pub(super) reads_image: bool,
}

impl Job for BackupRun {
    fn depends_on(&self, _own: Uuid, image: Uuid) -> bool {
        self.reads_image && image == self.meta.image.id
    }

    /// 409 `backup_source_busy` while a backup reads the image itself.
    fn refusal(&self, image: &ImageRow, what: &str) -> Error {
        Error::BackupSource {
            name: image.name.clone(),
            backup: self.meta.name.clone(),
            id: self.meta.id,
            what: what.to_string(),
        }
    }
}
