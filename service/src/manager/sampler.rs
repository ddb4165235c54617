//! The stats sampler: once a second it reads every attached volume's
//! counters (off the async threads), keeps a minute of samples for rates, and
//! the latest reading for `/metrics`, so a scrape never waits on a device.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::{Manager, blocking};
use crate::model::{OpRates, OpStats, Rate, Rates, VolumeState, VolumeStats};

/// Samples kept per volume: a minute at one per second, plus one.
const KEEP: usize = 62;

/// What one sample keeps: when, and ops and bytes of each op.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    ops: [(u64, u64); 4],
}

impl Sample {
    fn of(stats: &VolumeStats, at: Instant) -> Self {
        let c = |o: &OpStats| (o.ops, o.bytes);
        Self {
            at,
            ops: [
                c(&stats.read),
                c(&stats.write),
                c(&stats.flush),
                c(&stats.discard),
            ],
        }
    }
}

#[derive(Debug, Default)]
struct Series {
    samples: VecDeque<Sample>,
    latest: Option<VolumeStats>,
}

/// Samples of every attached volume.
#[derive(Debug, Default)]
pub struct Sampler {
    series: Mutex<HashMap<Uuid, Series>>,
}

impl Sampler {
    fn record(&self, id: Uuid, stats: VolumeStats) {
        let mut all = self.series.lock().expect("sampler poisoned");
        let s = all.entry(id).or_default();
        s.samples.push_back(Sample::of(&stats, Instant::now()));
        while s.samples.len() > KEEP {
            s.samples.pop_front();
        }
        s.latest = Some(stats);
    }

    fn retain(&self, live: &[Uuid]) {
        self.series
            .lock()
            .expect("sampler poisoned")
            .retain(|id, _| live.contains(id));
    }

    /// The latest reading of every sampled volume.
    pub fn latest(&self) -> HashMap<Uuid, VolumeStats> {
        self.series
            .lock()
            .expect("sampler poisoned")
            .iter()
            .filter_map(|(id, s)| s.latest.clone().map(|l| (*id, l)))
            .collect()
    }

    /// Rates ending at `now_stats` (read just now) over 1, 10 and 60 s.
    pub fn rates(&self, id: Uuid, now_stats: &VolumeStats) -> Option<Rates> {
        let all = self.series.lock().expect("sampler poisoned");
        let samples = &all.get(&id)?.samples;
        let now = Sample::of(now_stats, Instant::now());
        let window = |secs: u64| -> Option<OpRates> {
            // The oldest sample within the window (at least one earlier than now).
            let target = now.at.checked_sub(Duration::from_secs(secs))?;
            let base = samples
                .iter()
                .find(|s| s.at >= target)
                .or_else(|| samples.back())
                .filter(|s| s.at < now.at)?;
            let dt = now.at.duration_since(base.at).as_secs_f64();
            if dt <= 0.0 {
                return None;
            }
            let r = |i: usize| Rate {
                iops: now.ops[i].0.saturating_sub(base.ops[i].0) as f64 / dt,
                bytes_per_sec: now.ops[i].1.saturating_sub(base.ops[i].1) as f64 / dt,
            };
            Some(OpRates {
                read: r(0),
                write: r(1),
                flush: r(2),
                discard: r(3),
                window_secs: dt,
            })
        };
        Some(Rates {
            last_1s: window(1)?,
            last_10s: window(10)?,
            last_60s: window(60)?,
        })
    }
}

impl Manager {
    /// Samples every attached volume once a second, for as long as the service runs.
    pub fn start_sampler(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                if let Err(e) = me.sample_once().await {
                    tracing::debug!(error = %e, "stats sampling failed");
                }
            }
        });
    }

    async fn sample_once(&self) -> super::Result<()> {
        let volumes = self.store.volumes().await?;
        let mut live = Vec::new();
        for v in volumes {
            let (Some(att), Some(backend)) = (v.attachment.clone(), self.backend(v.backend)) else {
                continue;
            };
            if !matches!(v.state, VolumeState::Attached | VolumeState::Degraded) {
                continue;
            }
            live.push(v.id);
            let id = v.id;
            if let Ok(stats) = blocking(move || backend.stats(id, &att)).await? {
                self.sampler.record(id, stats);
            }
        }
        self.sampler.retain(&live);
        Ok(())
    }
}
