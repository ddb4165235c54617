//! A live change of a dm volume's data path: suspend, load, resume,
//! with the private device started or stopped around it; and the moves
//! onto the private worker a copy needs, and back.

use std::os::fd::AsFd;

use uuid::Uuid;

use super::ioctl::{self};
use super::table::{direct_table, over};
use super::{COPY_HOLDS_PATH, DmBackend, DmVolume};
use crate::backend::BackendError;
use blockplane_api::model::DispatchPolicy;
use blockplane_protocol::Request;
use blockplane_system::dispatch::{self, DataPath, Reason};
use blockplane_system::extent::{self};

impl DmBackend {
    /// Puts a volume on its private worker for a snapshot, whose I/O only a
    /// worker can hold (the loop driver cannot hold still); the reason to
    /// go back to `kernel` with after it, when it was there.
    pub(super) fn onto_worker(&self, volume_id: Uuid) -> Result<Option<Reason>, BackendError> {
        self.with_volume(volume_id, |v| match v.dispatch {
            DispatchPolicy::Direct => Err(BackendError::Refused {
                reason: blockplane_protocol::SNAPSHOT_OF_DIRECT.into(),
            }),
            DispatchPolicy::Kernel => {
                let reason = v.reason.clone();
                self.switch(volume_id, v, DispatchPolicy::Nowait, Reason::CopyOnWorker)?;
                Ok(Some(reason))
            }
            _ => Ok(None),
        })
    }

    /// After a snapshot: back to `kernel` when [`Self::onto_worker`] moved
    /// the volume off it; on a refusal it serves on, on the worker, saying so.
    pub(super) fn back_to_kernel(
        &self,
        volume_id: Uuid,
        kernel: Option<Reason>,
    ) -> Result<(), BackendError> {
        let Some(reason) = kernel else {
            return Ok(());
        };
        self.with_volume(volume_id, |v| {
            let back = dispatch::after_copy(reason, v.params.qos.is_some());
            if let Err(e) = self.switch(volume_id, v, back.dispatch, back.reason) {
                tracing::warn!(volume = %volume_id, error = %e, "could not go back to kernel after a copy");
                v.reason = Reason::CopyReturnRefused {
                    error: e.to_string(),
                };
            }
            Ok(())
        })
    }

    /// Moves a volume to `to`, with the device suspended only around the table
    /// swap. On error the volume stays as it was.
    pub(super) fn switch(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        to: DispatchPolicy,
        reason: Reason,
    ) -> Result<(), BackendError> {
        let from = v.dispatch;
        if v.copying.is_some() && from != to {
            return Err(BackendError::Refused {
                reason: COPY_HOLDS_PATH.into(),
            });
        }
        let on_worker = |p| matches!(p, DispatchPolicy::Nowait | DispatchPolicy::Threaded);
        match (from == DispatchPolicy::Direct, to == DispatchPolicy::Direct) {
            // Nothing moves (a worker is told, below: it reports the reason).
            _ if from == to && !on_worker(from) => {}
            (false, false) if on_worker(from) && on_worker(to) => {
                // Both on the private worker: it switches by itself.
                self.ublk.change(
                    volume_id,
                    Request::set_dispatch(DataPath::serving(to), &reason),
                )?;
            }
            (false, false) => self.change_lower(volume_id, v, to, &reason)?,
            (true, false) if !v.read_only && blockplane_system::image::is_read_only(&v.image) => {
                self.leave_direct_reopened(volume_id, v, to, &reason)?;
            }
            (true, false) => self.leave_direct_for(volume_id, v, to, &reason)?,
            (false, true) => self.go_direct(volume_id, v)?,
            (true, true) => unreachable!("direct to direct is the first arm"),
        }
        v.dispatch = to;
        v.reason = reason;
        Ok(())
    }

    /// Between the loop device and the worker: start the new one, swap
    /// tables, let the old one go.
    fn change_lower(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        to: DispatchPolicy,
        reason: &Reason,
    ) -> Result<(), BackendError> {
        let lower = self.start_lower(volume_id, v, &v.image, to, reason)?;
        let table = over(lower.dev, v.params.size_bytes);
        match self.reload(volume_id, v.read_only, table) {
            Ok(table) => {
                v.table = table;
                let old = (v.under.ublk.take(), v.under.loop_dev.take());
                Self::keep_lower(v, lower);
                self.stop_lower(volume_id, old.0, old.1)?;
            }
            Err(e) => {
                self.undo_lower(volume_id, lower);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Leaves `direct` for `to`: the lower starts first (nothing reaches it
    /// until the table points at it); the image is unpinned only once the
    /// new table is loaded, while the device is still suspended: neither
    /// can write through a pinned image, and the linear table must not
    /// serve an unpinned one.
    fn leave_direct_for(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        to: DispatchPolicy,
        reason: &Reason,
    ) -> Result<(), BackendError> {
        let lower = self.start_lower(volume_id, v, &v.image, to, reason)?;
        let pin = v.under.direct.as_ref().map(|(_, p)| *p);
        let image = &v.image;
        let dev = lower.dev;
        let swapped = ioctl::swap(
            &self.instance,
            volume_id,
            false,
            v.read_only,
            || Ok(over(dev, v.params.size_bytes)),
            || {
                if let Some(p) = pin {
                    extent::unpin(image.as_fd(), p)
                        .map_err(|e| BackendError::io("unpin", "image", e))?;
                }
                extent::drop_page_cache(image.as_fd())
                    .map_err(|e| BackendError::io("drop page cache", "image", e))
            },
        );
        match swapped {
            Ok(table) => {
                v.table = table;
                v.under.direct = None;
                Self::keep_lower(v, lower);
            }
            Err(e) => {
                self.undo_lower(volume_id, lower);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Onto `direct`: suspended, the in-flight bios have finished on the
    /// lower; map and pin (FIEMAP with sync), load the linear table, resume.
    fn go_direct(&self, volume_id: Uuid, v: &mut DmVolume) -> Result<(), BackendError> {
        let image = &v.image;
        let (size, read_only) = (v.params.size_bytes, v.read_only);
        let mut mapped = None;
        let swapped = ioctl::swap(
            &self.instance,
            volume_id,
            false,
            read_only,
            || {
                let refused = |e: extent::MapError| BackendError::Refused {
                    reason: e.to_string(),
                };
                dispatch::rule_3(image.as_fd(), read_only).map_err(refused)?;
                let (map, pin) = extent::map_and_pin(image.as_fd(), size, None).map_err(|e| {
                    BackendError::Refused {
                        reason: e.to_string(),
                    }
                })?;
                let table = direct_table(&map);
                mapped = Some((map, pin));
                Ok(table)
            },
            || Ok(()),
        );
        match swapped {
            Ok(table) => {
                v.under.direct = mapped;
                v.table = table;
                // Nothing references the lower any more.
                let old = (v.under.ublk.take(), v.under.loop_dev.take());
                self.stop_lower(volume_id, old.0, old.1)?;
            }
            Err(e) => {
                if let Some((_, pin)) = mapped {
                    let _ = extent::unpin(image.as_fd(), pin);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Leaves `direct` for the private worker on `to` when the volume holds
    /// its image read-only but is writable: adopted by a restarted service,
    /// which could open the pinned image for reading only, and a worker on
    /// that handle would fail every write. A writable handle exists only once
    /// unpinned, and the linear table must not serve an unpinned image: so,
    /// all under the suspend, unpin, reopen for writing, start the worker on
    /// that handle and load the table over it. The volume keeps the writable
    /// handle. On error it stays as it was, pinned again.
    pub(super) fn leave_direct_reopened(
        &self,
        volume_id: Uuid,
        v: &mut DmVolume,
        to: DispatchPolicy,
        reason: &Reason,
    ) -> Result<(), BackendError> {
        let pin = v.under.direct.as_ref().map(|(_, p)| *p);
        let mut started = None;
        let swapped = ioctl::swap(
            &self.instance,
            volume_id,
            false,
            v.read_only,
            || {
                let image = &v.image;
                if let Some(p) = pin {
                    extent::unpin(image.as_fd(), p)
                        .map_err(|e| BackendError::io("unpin", "image", e))?;
                }
                let writable = blockplane_system::image::reopen(image, true)
                    .map_err(|e| BackendError::io("reopen for writing", "image", e))?;
                extent::drop_page_cache(writable.as_fd())
                    .map_err(|e| BackendError::io("drop page cache", "image", e))?;
                let lower = self.start_lower(volume_id, v, &writable, to, reason)?;
                let table = over(lower.dev, v.params.size_bytes);
                started = Some((lower, writable));
                Ok(table)
            },
            || Ok(()),
        );
        match swapped {
            Ok(table) => {
                let (lower, writable) = started.expect("a table loaded is over a started lower");
                v.image = writable;
                v.table = table;
                v.under.direct = None;
                Self::keep_lower(v, lower);
                Ok(())
            }
            Err(e) => {
                if let Some((lower, _)) = started {
                    self.undo_lower(volume_id, lower);
                }
                if pin.is_some_and(|p| !p.was_immutable) {
                    let _ = extent::pin(v.image.as_fd());
                }
                Err(e)
            }
        }
    }
}
