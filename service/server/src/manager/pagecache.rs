//! Page-cache hygiene: what the host's page cache holds of each volume's
//! device and image (in its stats and `/metrics`), dropped when a device
//! comes up and at every live switch of its data path, and a warning (an
//! event, and the volume's `warnings`) while a volume that does direct I/O
//! holds more than [`WARN_BYTES`] of it.
//!
//! Pages cached under a direct-I/O data path make every direct write
//! invalidate them, and a filesystem's direct-I/O path may write back and
//! wait on each request: a `blkid` probe or a buffered `dd` of the device is
//! enough to make a benchmark's rounds bimodal. Nothing here reads or writes
//! a byte of a volume: the device node and the image are opened read-only,
//! and `cachestat(2)`, `mincore(2)`, `fdatasync` and `POSIX_FADV_DONTNEED`
//! look at or drop the cache only. This file reads the cache and keeps the
//! warnings; [`super::look`] looks, once a second.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::attachment::{Attachment, DeviceState};
use blockplane_api::model::PageCache;
use blockplane_system::pagecache;

/// Cached bytes (device and image together) above which a direct-I/O volume
/// is warned about: more than a `blkid` probe's few hundred KiB leave.
pub const WARN_BYTES: u64 = 4 << 20;

/// The sampler looks at every volume's page cache this often (not every
/// second: two opens and two syscalls per volume).
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(10);

/// What the page cache holds of `device` and `image` now (`null` for what
/// could not be read).
pub fn read(device: &str, image: &str) -> PageCache {
    let bytes = |p: &str| {
        pagecache::cached_at(Path::new(p))
            .ok()
            .map(|c| c.cached_bytes())
    };
    PageCache {
        device_bytes: bytes(device),
        image_bytes: bytes(image),
    }
}

/// Drops the clean cached pages of `device` and `image`; a failure is
/// logged, never fatal (the volume serves all the same).
pub fn drop(volume: &str, device: &str, image: &str) {
    for path in [device, image] {
        if let Err(e) = pagecache::drop_clean_at(Path::new(path)) {
            tracing::warn!(volume, path, error = %e, "could not drop the page cache");
        }
    }
}

/// Whether the volume's data path reaches its image with direct I/O: ublk
/// and dm on every policy, loop when its driver does direct I/O.
pub fn direct_io(att: &Attachment) -> bool {
    !matches!(att.kind, DeviceState::Loop { direct_io: false })
}

/// The warning for `cache` under a direct-I/O volume, if it is above
/// [`WARN_BYTES`]. The device's pages do not count while a filesystem is
/// mounted on it: its metadata lives in them, as it should.
pub fn warning(name: &str, att: &Attachment, cache: &PageCache, mounted: bool) -> Option<String> {
    let dev = match mounted {
        true => 0,
        false => cache.device_bytes.unwrap_or(0),
    };
    let img = cache.image_bytes.unwrap_or(0);
    (direct_io(att) && dev + img > WARN_BYTES).then(|| {
        format!(
            "volume '{name}': the page cache holds {} KiB of its device {} and {} KiB of its image, \
             above {} KiB under a direct-I/O data path: every direct write invalidates them \
             (buffered reads of the device, e.g. blkid or dd, leave them); \
             a policy switch or re-attach drops them, or `blockdev --flushbufs`",
            dev >> 10,
            att.device,
            img >> 10,
            WARN_BYTES >> 10
        )
    })
}

/// The last check of each volume.
#[derive(Debug, Default)]
pub struct Watch {
    inner: Mutex<WatchState>,
}

#[derive(Debug, Default)]
struct WatchState {
    last_check: Option<Instant>,
    volumes: HashMap<Uuid, Checked>,
    /// Bumped whenever a volume's warnings change, which no commit marks
    /// (a warning's end sends no event): the volume list's cache keys on it.
    warnings_changed: u64,
}

#[derive(Debug, Clone)]
struct Checked {
    cache: PageCache,
    /// The warning in force (its event was sent), until the cache drops
    /// below the threshold.
    warning: Option<String>,
}

impl Watch {
    /// The warnings in force for a volume.
    pub fn warnings(&self, id: Uuid) -> Vec<String> {
        let s = self.inner.lock().expect("page cache watch poisoned");
        s.volumes
            .get(&id)
            .and_then(|c| c.warning.clone())
            .into_iter()
            .collect()
    }

    /// How many times any volume's warnings changed so far.
    pub fn warnings_generation(&self) -> u64 {
        self.inner
            .lock()
            .expect("page cache watch poisoned")
            .warnings_changed
    }

    /// The page cache of every volume at the last check.
    pub fn latest(&self) -> HashMap<Uuid, PageCache> {
        let s = self.inner.lock().expect("page cache watch poisoned");
        s.volumes.iter().map(|(id, c)| (*id, c.cache)).collect()
    }

    /// Whether a check is due (and if so, marks it started).
    pub(super) fn due(&self) -> bool {
        let mut s = self.inner.lock().expect("page cache watch poisoned");
        let now = Instant::now();
        if s.last_check
            .is_some_and(|t| now.duration_since(t) < CHECK_EVERY)
        {
            return false;
        }
        s.last_check = Some(now);
        true
    }

    /// The warning to send as an event before `warning` is recorded: when
    /// it is new (none while one already sent is in force). Changes
    /// nothing, so that the event is written before the volume shows the
    /// warning: whoever sees a warning finds its event.
    pub(super) fn newly_warned(&self, id: Uuid, warning: &Option<String>) -> Option<String> {
        let s = self.inner.lock().expect("page cache watch poisoned");
        let was = s.volumes.get(&id).is_some_and(|c| c.warning.is_some());
        warning.clone().filter(|_| !was)
    }

    /// Keeps a reading and the warning it gives, which the volume then shows.
    pub(super) fn record(&self, id: Uuid, cache: PageCache, warning: Option<String>) {
        let mut s = self.inner.lock().expect("page cache watch poisoned");
        let was = s.volumes.get(&id).and_then(|c| c.warning.clone());
        if was != warning {
            s.warnings_changed += 1;
        }
        s.volumes.insert(id, Checked { cache, warning });
    }

    pub(super) fn retain(&self, live: &HashSet<Uuid>) {
        let mut s = self.inner.lock().expect("page cache watch poisoned");
        let before = s.volumes.len();
        s.volumes.retain(|id, _| live.contains(id));
        if s.volumes.len() != before {
            s.warnings_changed += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn att(kind: DeviceState) -> Attachment {
        Attachment {
            device: "/dev/ublkb0".into(),
            kernel_name: "ublkb0".into(),
            major: 259,
            minor: 0,
            dispatch: blockplane_api::model::ActiveDispatch::Nowait,
            dispatch_reason: blockplane_system::dispatch::Reason::Words {
                words: String::new(),
            },
            size_bytes: 1 << 20,
            read_only: false,
            attached_at: time::OffsetDateTime::now_utc(),
            baseline: None,
            kind,
            resize_pending: false,
        }
    }

    fn cache(dev: u64, img: u64) -> PageCache {
        PageCache {
            device_bytes: Some(dev),
            image_bytes: Some(img),
        }
    }

    #[test]
    fn only_a_direct_io_volume_above_the_threshold_is_warned() {
        let buffered = att(DeviceState::Loop { direct_io: false });
        let direct = att(DeviceState::Loop { direct_io: true });
        let big = cache(WARN_BYTES, 4096);
        assert!(warning("v", &buffered, &big, false).is_none());
        let w = warning("v", &direct, &big, false).unwrap();
        assert!(w.contains("volume 'v'") && w.contains("/dev/ublkb0"), "{w}");
        assert!(warning("v", &direct, &cache(WARN_BYTES, 0), false).is_none());
        // A mounted filesystem's metadata is the device's cache: not warned.
        assert!(warning("v", &direct, &big, true).is_none());
        assert!(warning("v", &direct, &cache(0, WARN_BYTES + 1), true).is_some());
    }

    /// One check of the sampler: the event to send, then the reading kept.
    pub(super) fn check(
        w: &Watch,
        id: Uuid,
        cache: PageCache,
        warning: Option<String>,
    ) -> Option<String> {
        let send = w.newly_warned(id, &warning);
        w.record(id, cache, warning);
        send
    }

    #[test]
    fn the_event_is_sent_once_until_the_cache_falls_back_under() {
        let w = Watch::default();
        let id = Uuid::new_v4();
        // The event is decided before the warning shows.
        assert_eq!(w.newly_warned(id, &Some("a".into())), Some("a".into()));
        assert!(w.warnings(id).is_empty());
        assert_eq!(check(&w, id, cache(0, 0), None), None);
        assert!(w.warnings(id).is_empty());
        assert_eq!(
            check(&w, id, cache(9, 0), Some("a".into())),
            Some("a".into())
        );
        assert_eq!(check(&w, id, cache(9, 0), Some("b".into())), None);
        assert_eq!(w.warnings(id), vec!["b".to_string()]);
        let warned = w.warnings_generation();
        assert_eq!(check(&w, id, cache(0, 0), None), None);
        assert!(w.warnings(id).is_empty());
        // Its end sends no event, but the volume list must see it.
        assert_ne!(w.warnings_generation(), warned, "a warning's end");
        let unwarned = w.warnings_generation();
        assert_eq!(check(&w, id, cache(1, 0), None), None);
        assert_eq!(w.warnings_generation(), unwarned, "no change, no bump");
        assert_eq!(
            check(&w, id, cache(9, 0), Some("c".into())),
            Some("c".into())
        );
        w.retain(&HashSet::new());
        assert!(w.latest().is_empty());
    }

    #[test]
    fn a_check_is_due_at_most_every_interval() {
        let w = Watch::default();
        assert!(w.due());
        assert!(!w.due());
    }
}
