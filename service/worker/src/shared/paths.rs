//! Switching the data path live: entering and leaving `direct` (the pin,
//! the map, the raw devices), and the drift checks that may force it off.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::Duration;

use blockplane_protocol::{self as protocol, Reason};
use blockplane_system::extent::{self, ExtentMap};

use super::Shared;
use crate::direct_path::DirectPath;
use crate::refusal::Refusal;
use blockplane_protocol::DataPath;

impl Shared {
    /// Enters the policy the spec starts on, before the device serves: a
    /// first start's `direct` checks the map the control plane decided
    /// from; a start on a file path lifts a crashed direct worker's pin.
    pub fn begin(&self) -> Result<(), Refusal> {
        let start = self.spec.dispatch;
        if start == DataPath::Direct {
            let decided =
                match self.spec.decided_map {
                    true => Some(protocol::take_decided_map(&self.spec.run_dir).map_err(
                        |source| Refusal::Io {
                            op: "read the decided map",
                            source,
                        },
                    )?),
                    false => None,
                };
            let path = self.enter_direct(decided)?;
            self.config().direct = Some(path);
        } else if let Some(p) = self.spec.pinned {
            extent::unpin(self.image.as_fd(), p).map_err(|source| Refusal::Io {
                op: "unpin",
                source,
            })?;
            self.state.lock().expect("state poisoned").pinned = None;
        }
        self.config().policy = start;
        Ok(())
    }

    /// Rule 3, where this worker's own earlier pin is not the owner's flag.
    pub(super) fn refuse_rule_3(&self) -> Result<(), Refusal> {
        let pinned_by_us = self
            .state
            .lock()
            .expect("state poisoned")
            .pinned
            .is_some_and(|p| !p.was_immutable);
        if !pinned_by_us {
            blockplane_system::dispatch::rule_3(self.image.as_fd(), self.read_only())?;
        }
        Ok(())
    }

    /// Maps and pins the image and opens its raw devices (entering `direct`).
    /// `decided`: the map the control plane decided `direct` from, checked
    /// under the pin instead of read again before it.
    pub(super) fn enter_direct(
        &self,
        decided: Option<ExtentMap>,
    ) -> Result<Arc<DirectPath>, Refusal> {
        let size = self.state.lock().expect("state poisoned").size_bytes;
        let earlier = self.state.lock().expect("state poisoned").pinned;
        let (map, pin) = match earlier {
            // Pinned by an earlier worker of this volume: keep what it knew of
            // the owner's flag, and check the map as it is now.
            Some(p) => {
                let map = ExtentMap::build(self.image.as_fd(), size)?;
                extent::drop_page_cache(self.image.as_fd()).map_err(|source| Refusal::Io {
                    op: "drop page cache",
                    source,
                })?;
                (map, p)
            }
            None => {
                self.refuse_rule_3()?;
                extent::map_and_pin(self.image.as_fd(), size, decided)?
            }
        };
        let devices = match self.open_raw_devices(&map) {
            Ok(d) => d,
            Err(e) => {
                if earlier.is_none() {
                    let _ = extent::unpin(self.image.as_fd(), pin);
                }
                return Err(e);
            }
        };
        self.state.lock().expect("state poisoned").pinned = Some(pin);
        if let Some(w) = self.watch() {
            w.mark(self.image.as_fd(), true);
        }
        Ok(Arc::new(DirectPath { map, devices }))
    }

    pub(super) fn open_raw_devices(&self, map: &ExtentMap) -> Result<Vec<File>, Refusal> {
        // Read-only may be switched off again live: a volume created writable
        // opens its raw devices writable.
        let write = !self.spec.read_only;
        map.devices
            .iter()
            .map(|d| {
                // Not O_EXCL: the filesystem on it is mounted (rule 7).
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(write)
                    .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
                    .open(&d.node)
                    .map_err(|e| match e.raw_os_error() {
                        Some(libc::EBUSY) | Some(libc::EPERM) if write => Refusal::Rule(format!(
                            "direct-map rule 7: the kernel refuses writes to {} while its filesystem is mounted (bdev_allow_write_mounted=0?): {e}",
                            d.node.display()
                        )),
                        _ => Refusal::Io {
                            op: "open the raw device",
                            source: e,
                        },
                    })
            })
            .collect()
    }

    /// Leaves `direct`: flushes the raw devices, unpins, and drops the page
    /// cache again so the file path reads what the raw device holds.
    pub(crate) fn leave_direct(&self) -> Result<(), Refusal> {
        let direct = self.config().direct.clone();
        if let Some(d) = direct {
            for dev in &d.devices {
                dev.sync_all().map_err(|source| Refusal::Io {
                    op: "flush the raw device",
                    source,
                })?;
            }
        }
        let pin = self.state.lock().expect("state poisoned").pinned.take();
        if let Some(p) = pin {
            extent::unpin(self.image.as_fd(), p).map_err(|source| Refusal::Io {
                op: "clear FS_IMMUTABLE_FL",
                source,
            })?;
        }
        if let Some(Some(w)) = self.watch.get() {
            w.mark(self.image.as_fd(), false);
        }
        extent::drop_page_cache(self.image.as_fd()).map_err(|source| Refusal::Io {
            op: "drop page cache",
            source,
        })
    }

    /// Switches the policy while I/O runs: holds every queue until the
    /// requests inside finish, changes the path, and sends each queue the new
    /// config, on which the held requests continue.
    pub fn switch(&self, to: DataPath, reason: Reason) -> Result<(), Refusal> {
        let _one = self.queues.changing.lock().expect("changing poisoned");
        self.switch_held(to, reason)
    }

    /// [`Self::switch`], its caller holding `changing`.
    pub(super) fn switch_held(&self, to: DataPath, reason: Reason) -> Result<(), Refusal> {
        let from = self.policy();
        if from == to {
            self.state.lock().expect("state poisoned").dispatch_reason = reason;
            return Ok(());
        }
        if to == DataPath::Direct {
            if self.config().moment.is_some() {
                return Err(Refusal::Rule(protocol::COPY_RUNS_DIRECT.into()));
            }
            // Refuse early, before holding any I/O.
            self.refuse_rule_3()?;
        }
        let queues = self.ask_queues();
        let outcome = if !queues.hold(Duration::from_secs(30)) {
            Err(Refusal::Rule(
                "requests did not finish within 30 s; policy unchanged".into(),
            ))
        } else {
            self.change_path(from, to)
        };
        let cfg = {
            let mut c = self.config();
            if let Ok(direct) = &outcome {
                c.policy = to;
                c.direct = direct.clone();
            }
            c.clone()
        };
        if outcome.is_ok() {
            self.state.lock().expect("state poisoned").dispatch_reason = reason;
        }
        if !queues.apply(&cfg) {
            tracing::error!("a queue did not take the new config within 30 s");
        }
        outcome.map(|_| ())
    }

    /// The direct path to serve with after the change.
    pub(super) fn change_path(
        &self,
        from: DataPath,
        to: DataPath,
    ) -> Result<Option<Arc<DirectPath>>, Refusal> {
        match (from, to) {
            (_, DataPath::Direct) => {
                // Written data reaches the disk before the map is read.
                self.data.sync_data().map_err(|source| Refusal::Io {
                    op: "fdatasync the image",
                    source,
                })?;
                self.enter_direct(None).map(Some)
            }
            (DataPath::Direct, _) => self.leave_direct().map(|()| None),
            _ => Ok(None),
        }
    }

    /// The direct path in force, if any.
    pub(super) fn direct_path(&self) -> Option<Arc<DirectPath>> {
        self.config().direct.clone()
    }

    /// Rule 5: re-reads the map of a `direct` volume; on drift (or a pin
    /// cleared), leaves the direct path at once for `nowait` and records why.
    pub fn check_drift(&self) {
        let Some(current) = self.direct_path() else {
            return;
        };
        let size = current.map.size;
        let now = ExtentMap::build(self.image.as_fd(), size);
        let drift = match now {
            Ok(m) => current.map.differences(&m),
            Err(e) => Some(e.to_string()),
        };
        let reason = match drift {
            Some(what) => Reason::ExtentsChanged {
                what,
                on_private: false,
            },
            None if !extent::is_immutable(self.image.as_fd()).unwrap_or(true) => {
                Reason::PinCleared { by: None }
            }
            None => return,
        };
        self.leave_map(reason, || true);
    }

    /// Leaves the direct path for `nowait` at once, recording `reason`,
    /// unless a switch got there first or `still` no longer holds.
    pub(super) fn leave_map(&self, reason: Reason, still: impl Fn() -> bool) {
        let _one = self.queues.changing.lock().expect("changing poisoned");
        if self.policy() != DataPath::Direct || !still() {
            return;
        }
        tracing::error!(%reason, "the direct map cannot be trusted: leaving the direct path");
        self.state.lock().expect("state poisoned").degraded = Some(reason.to_string());
        if let Err(e) = self.switch_held(DataPath::Nowait, reason) {
            tracing::error!(error = %e, "could not leave the direct path");
        }
        // The service learns of it from the state file.
        if let Some(dev_id) = self.dev_id.get() {
            self.write_state_file(*dev_id);
        }
    }
}
