//! The once-a-second look at every attached volume: the manager's side of
//! the sampler ([`super::sampler`], the readings it keeps) and of the
//! page-cache watch ([`super::pagecache`], the warnings it keeps). Their
//! state is theirs; this file feeds them from the registry and the devices.

use std::collections::{HashMap, HashSet};

use uuid::Uuid;

use super::blocking::blocking;
use super::house::House;
use super::{pagecache, sampler};
use crate::attachment::Attachment;
use crate::store::{Store, VolumeRow};
use blockplane_api::model::{Backend, PageCache, VolumeState};
use blockplane_system::mountinfo;

/// The once-a-second look at every attached volume: its readings (rates,
/// history) and its page cache (warnings).
#[derive(Default)]
pub(super) struct Readings {
    /// Each volume's readings of the last 15 minutes.
    pub(super) stats: sampler::Sampler,
    /// The page cache of each volume at the sampler's last look.
    pub(super) page_cache: pagecache::Watch,
}

impl Readings {
    /// Reads every attached volume's stats, reports new I/O errors, and
    /// looks at the page caches when that is due.
    pub(super) async fn sample_once(&self, house: &House) -> super::error::Result<()> {
        let volumes = house.store.volumes().await?;
        let mut live = Vec::new();
        for v in volumes.iter().cloned() {
            let (Some(att), Some(backend)) = (v.attachment.clone(), house.backend(v.backend))
            else {
                continue;
            };
            if matches!(v.state, VolumeState::Attached | VolumeState::Degraded) {
                let previous = self.stats.latest_of(v.id);
                live.push((v, att, backend, previous));
            }
        }
        // One blocking task reads every volume, not one task each: an idle
        // host with a thousand volumes wakes once a second, not a thousand times.
        let ublk = house.backend(Backend::Ublk);
        let (live, read) = blocking(move || {
            // A supervisor that could not start is tried again (after its
            // backoff) at least once a second.
            if let Some(b) = ublk {
                b.supervision();
            }
            let read: Vec<_> = live
                .iter()
                .map(|(v, att, backend, previous)| backend.sample(v.id, att, previous.as_deref()))
                .collect();
            (live, read)
        })
        .await?;
        for ((v, ..), stats) in live.iter().zip(read) {
            if let Ok(stats) = stats
                && let Some([r, w, f, d]) = self.stats.record(v.id, stats)
            {
                let mut tx = house.store.begin().await?;
                tx.event(
                    Some(v.id),
                    Some(v.image_id),
                    "volume_io_errors",
                    &format!(
                        "volume '{}': I/O errors since the last report: {r} read, {w} write, {f} flush, {d} discard (the volume's device reported them to its users)",
                        v.name
                    ),
                )
                .await?;
                tx.commit().await?;
            }
        }
        let live: HashSet<Uuid> = live.iter().map(|(v, ..)| v.id).collect();
        self.stats.retain(&live);
        self.watch_page_cache(house, &volumes).await
    }
    /// From the sampler, at most every [`pagecache::CHECK_EVERY`]: reads the page
    /// cache of every attached volume, sends a `volume_page_cache` event
    /// when a direct-I/O volume's rises above [`pagecache::WARN_BYTES`] (once, until it
    /// falls back under), and keeps the readings for `/metrics`.
    pub(super) async fn watch_page_cache(
        &self,
        house: &House,
        volumes: &[VolumeRow],
    ) -> super::error::Result<()> {
        if !self.page_cache.due() {
            return Ok(());
        }
        let images: HashMap<Uuid, String> = house
            .store
            .images()
            .await?
            .into_iter()
            .map(|i| (i.id, i.path))
            .collect();
        let live: Vec<(VolumeRow, Attachment, String)> = volumes
            .iter()
            .filter(|v| matches!(v.state, VolumeState::Attached | VolumeState::Degraded))
            .filter_map(|v| {
                let att = v.attachment.clone()?;
                let image = images.get(&v.image_id)?.clone();
                Some((v.clone(), att, image))
            })
            .collect();
        let ids: HashSet<Uuid> = live.iter().map(|(v, _, _)| v.id).collect();
        let read_all = live
            .iter()
            .map(|(_, att, image)| (att.device.clone(), image.clone()))
            .collect::<Vec<_>>();
        let (caches, mounted) = blocking(move || {
            let mounted: HashSet<(u32, u32)> = mountinfo::mounts()
                .unwrap_or_default()
                .into_iter()
                .map(|m| m.dev)
                .collect();
            let caches = read_all
                .iter()
                .map(|(d, i)| pagecache::read(d, i))
                .collect::<Vec<_>>();
            (caches, mounted)
        })
        .await?;
        for ((v, att, _), cache) in live.iter().zip(caches) {
            let on = mounted.contains(&(att.major, att.minor));
            let warning = pagecache::warning(&v.name, att, &cache, on);
            if let Some(msg) = self.page_cache.newly_warned(v.id, &warning) {
                tracing::warn!(volume = %v.name, "{msg}");
                let mut tx = house.store.begin().await?;
                tx.event(Some(v.id), Some(v.image_id), "volume_page_cache", &msg)
                    .await?;
                tx.commit().await?;
            }
            self.page_cache.record(v.id, cache, warning);
        }
        self.page_cache.retain(&ids);
        Ok(())
    }

    /// The page caches the watch read last, with the volumes of `rows` it
    /// has not looked at yet (attached since its last look) read now, so
    /// that `/metrics` has the same series for every attached volume.
    pub(super) async fn page_caches(
        &self,
        store: &Store,
        rows: &[VolumeRow],
    ) -> super::error::Result<HashMap<Uuid, PageCache>> {
        let mut out = self.page_cache.latest();
        for v in rows {
            if !out.contains_key(&v.id)
                && let Some(cache) = page_cache(store, v).await?
            {
                out.insert(v.id, cache);
            }
        }
        Ok(out)
    }
}

/// The page cache of `v`'s device and image now (`None` without a
/// device).
pub(super) async fn page_cache(
    store: &Store,
    v: &VolumeRow,
) -> super::error::Result<Option<PageCache>> {
    let Some(att) = &v.attachment else {
        return Ok(None);
    };
    let Some(image) = store.image(&v.image_id.to_string()).await? else {
        return Ok(None);
    };
    let device = att.device.clone();
    Ok(Some(
        blocking(move || pagecache::read(&device, &image.path)).await?,
    ))
}

/// Drops the page cache of `v`'s device `att` and its image: called
/// where an attach or a live switch of the data path completes.
pub(super) async fn drop_page_cache(store: &Store, v: &VolumeRow, att: &Attachment) {
    let image = match store.image(&v.image_id.to_string()).await {
        Ok(Some(i)) => i.path,
        _ => return,
    };
    let (name, device) = (v.name.clone(), att.device.clone());
    let _ = blocking(move || pagecache::drop(&name, &device, &image)).await;
}
