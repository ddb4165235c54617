//! The stats sampler: once a second it reads every attached volume's
//! counters (off the async threads; a ublk worker's from its stats file,
//! asking the worker only when they moved, so an idle one sleeps on) and keeps 15 minutes of samples: rates
//! and the history charts and `volume top` show come from them, and the
//! latest reading serves `/metrics`, so a scrape never waits on a device.
//! About 150 KB per volume at most; history starts at attach or service
//! start, whichever is later. This file keeps the readings; [`super::look`]
//! takes them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use time::OffsetDateTime;
use uuid::Uuid;

use blockplane_api::model::{
    HISTORY_SECS, HistoryPoint, OpPoint, OpRates, Rate, Rates, VolumeStats,
};

/// Samples kept per volume: the history, plus the one its first interval
/// starts from.
const KEEP: usize = HISTORY_SECS as usize + 1;

/// One op's counters in a sample.
#[derive(Debug, Clone, Copy, Default)]
struct OpSample {
    ops: u64,
    bytes: u64,
    /// Requests timed, and their summed time in microseconds (`None` where
    /// the backend does not time this op).
    timed: Option<(u64, f64)>,
}

/// What one sample keeps: when, and the counters of each op.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    wall: OffsetDateTime,
    ops: [OpSample; 4],
    in_flight: u64,
}

impl Sample {
    fn of(stats: &VolumeStats, at: Instant) -> Self {
        let timed = |i: usize| -> Option<(u64, f64)> {
            if let Some(h) = stats.histograms.as_ref().and_then(|h| h.get(i)) {
                return Some((h.count, h.sum_us));
            }
            let k = stats.kernel.as_ref()?;
            let ms = [
                k.read_ticks_ms,
                k.write_ticks_ms,
                k.flush_ticks_ms,
                k.discard_ticks_ms,
            ][i];
            Some((stats.ops()[i].ops, ms as f64 * 1000.0))
        };
        let mut ops = [OpSample::default(); 4];
        for (i, o) in ops.iter_mut().enumerate() {
            let s = stats.ops()[i];
            *o = OpSample {
                ops: s.ops,
                bytes: s.bytes,
                timed: timed(i),
            };
        }
        Self {
            at,
            wall: OffsetDateTime::now_utc(),
            ops,
            in_flight: stats.in_flight,
        }
    }

    /// What happened between `base` and this sample.
    fn since(&self, base: &Sample) -> HistoryPoint {
        let dt = self.at.duration_since(base.at).as_secs_f64().max(1e-3);
        let point = |i: usize| {
            let (now, then) = (&self.ops[i], &base.ops[i]);
            let latency_us = match (now.timed, then.timed) {
                (Some((n, t)), Some((n0, t0))) if n > n0 && t >= t0 => {
                    Some((t - t0) / (n - n0) as f64)
                }
                _ => None,
            };
            OpPoint {
                iops: now.ops.saturating_sub(then.ops) as f64 / dt,
                bytes_per_sec: now.bytes.saturating_sub(then.bytes) as f64 / dt,
                latency_us,
            }
        };
        HistoryPoint {
            at: self.wall,
            secs: dt,
            read: point(0),
            write: point(1),
            flush: point(2),
            discard: point(3),
            in_flight: self.in_flight,
        }
    }
}

#[derive(Debug, Default)]
struct Series {
    samples: VecDeque<Sample>,
    /// Shared, so that a look at it (the next sampling, a scrape) copies
    /// no counters or histograms.
    latest: Option<Arc<VolumeStats>>,
    /// Errors counted but not yet reported, and when they last were.
    unreported_errors: [u64; 4],
    last_error_event: Option<Instant>,
}

/// Errors of each op (read, write, flush, discard), zero where not counted.
fn errors(s: &VolumeStats) -> [u64; 4] {
    s.ops().map(|o| o.errors.unwrap_or(0))
}

/// At most one I/O-error event per volume this often.
const ERROR_EVENT_EVERY: Duration = Duration::from_secs(10);

/// Samples of every attached volume.
#[derive(Debug, Default)]
pub struct Sampler {
    series: Mutex<HashMap<Uuid, Series>>,
}

impl Sampler {
    /// Keeps a reading; returns the I/O errors (per op) to report now, if any.
    pub(super) fn record(&self, id: Uuid, stats: VolumeStats) -> Option<[u64; 4]> {
        let mut all = self.series.lock().expect("sampler poisoned");
        let s = all.entry(id).or_default();
        let now = Instant::now();
        s.samples.push_back(Sample::of(&stats, now));
        while s.samples.len() > KEEP {
            s.samples.pop_front();
        }
        // A volume's first reading counts from zero: errors that came
        // before the sampler first saw it (right after attach) are news too.
        let before = s.latest.as_deref().map(errors).unwrap_or_default();
        let after = errors(&stats);
        for i in 0..4 {
            s.unreported_errors[i] += after[i].saturating_sub(before[i]);
        }
        s.latest = Some(Arc::new(stats));
        let due = s
            .last_error_event
            .is_none_or(|t| now.duration_since(t) >= ERROR_EVENT_EVERY);
        if s.unreported_errors.iter().any(|e| *e > 0) && due {
            s.last_error_event = Some(now);
            return Some(std::mem::take(&mut s.unreported_errors));
        }
        None
    }

    pub(super) fn retain(&self, live: &HashSet<Uuid>) {
        self.series
            .lock()
            .expect("sampler poisoned")
            .retain(|id, _| live.contains(id));
    }

    /// The latest reading of every sampled volume.
    pub fn latest(&self) -> HashMap<Uuid, Arc<VolumeStats>> {
        self.series
            .lock()
            .expect("sampler poisoned")
            .iter()
            .filter_map(|(id, s)| s.latest.clone().map(|l| (*id, l)))
            .collect()
    }

    /// The latest reading of one volume.
    pub(super) fn latest_of(&self, id: Uuid) -> Option<Arc<VolumeStats>> {
        let all = self.series.lock().expect("sampler poisoned");
        all.get(&id)?.latest.clone()
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
                iops: now.ops[i].ops.saturating_sub(base.ops[i].ops) as f64 / dt,
                bytes_per_sec: now.ops[i].bytes.saturating_sub(base.ops[i].bytes) as f64 / dt,
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

    /// The last `seconds` of a volume's history, oldest first (empty when it
    /// has fewer than two samples).
    pub fn history(&self, id: Uuid, seconds: u32) -> Vec<HistoryPoint> {
        let all = self.series.lock().expect("sampler poisoned");
        let Some(s) = all.get(&id) else {
            return Vec::new();
        };
        let skip = s.samples.len().saturating_sub(seconds as usize + 1);
        let recent: Vec<&Sample> = s.samples.iter().skip(skip).collect();
        recent.windows(2).map(|w| w[1].since(w[0])).collect()
    }
}
