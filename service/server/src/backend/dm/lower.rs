//! What serves a dm volume off `direct`: its private loop device
//! (`kernel`) or its private ublk worker (`nowait`, `threaded`), started
//! before a table names it and stopped once none does.

use std::os::fd::{AsFd, OwnedFd};

use uuid::Uuid;

use super::{DmBackend, DmVolume};
use crate::backend::loopdev::PrivateLoop;
use crate::backend::{AttachRequest, BackendError, Decision, VolumeParams};
use blockplane_api::model::DispatchPolicy;
use blockplane_system::dispatch::Reason;
use blockplane_system::extent::{self, DevNum};

/// What serves a volume off `direct`, just started: its number (the table's
/// target) and, for `kernel`, the loop device with the handle that keeps it
/// bound until a table holds it.
pub(super) struct Lower {
    pub(super) dev: DevNum,
    pub(super) private_loop: Option<(PrivateLoop, std::fs::File)>,
}

impl DmBackend {
    /// Starts what serves `policy` off `direct` for a volume, over `image`
    /// (a handle on the volume's): its private loop device for `kernel`, its
    /// private worker otherwise. Nothing reaches it until a table names it.
    pub(super) fn start_lower(
        &self,
        volume_id: Uuid,
        v: &DmVolume,
        image: &OwnedFd,
        policy: DispatchPolicy,
        reason: &Reason,
    ) -> Result<Lower, BackendError> {
        if policy != DispatchPolicy::Kernel {
            let image = image
                .try_clone()
                .map_err(|e| BackendError::io("dup", "image", e))?;
            let image_lock = match &v.lock {
                Some(l) => Some(
                    l.try_clone()
                        .map_err(|e| BackendError::io("dup", "image lock", e))?,
                ),
                None => None,
            };
            let att = self.ublk.start(AttachRequest {
                volume_id,
                image_fd: image,
                image_lock,
                params: VolumeParams {
                    dispatch: policy,
                    refuse_writes: v.read_only,
                    ..v.params.clone()
                },
                decision: Some(Decision::new(policy, reason.clone())),
            })?;
            return Ok(Lower {
                dev: DevNum {
                    major: att.major,
                    minor: att.minor,
                },
                private_loop: None,
            });
        }
        extent::drop_page_cache(image.as_fd())
            .map_err(|e| BackendError::io("drop page cache", "image", e))?;
        let (lo, handle) = PrivateLoop::bind(
            &self.instance,
            volume_id,
            image,
            v.params.size_bytes,
            v.read_only,
        )?;
        Ok(Lower {
            dev: lo.dev,
            private_loop: Some((lo, handle)),
        })
    }

    /// Records `lower` as what serves the volume, now that its table is
    /// loaded (dm holds the loop device: its handle can go).
    pub(super) fn keep_lower(v: &mut DmVolume, lower: Lower) {
        match lower.private_loop {
            Some((lo, handle)) => {
                drop(handle);
                v.under.loop_dev = Some(lo);
                v.under.ublk = None;
            }
            None => {
                v.under.ublk = Some(lower.dev);
                v.under.loop_dev = None;
            }
        }
    }

    /// Undoes a lower started for a table that never loaded.
    pub(super) fn undo_lower(&self, volume_id: Uuid, lower: Lower) {
        match lower.private_loop {
            // Its handle was its only opener: closing it unbinds it.
            Some((lo, handle)) => {
                drop(handle);
                lo.release();
            }
            None => drop(self.ublk.stop(volume_id)),
        }
    }

    /// Lets go of the lower the loaded table no longer names.
    pub(super) fn stop_lower(
        &self,
        volume_id: Uuid,
        ublk: Option<DevNum>,
        lo: Option<PrivateLoop>,
    ) -> Result<(), BackendError> {
        if let Some(lo) = lo {
            lo.release();
        }
        if ublk.is_some() {
            self.ublk.stop(volume_id)?;
        }
        Ok(())
    }
}
