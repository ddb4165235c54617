//! The stats sampler: once a second it reads every attached volume's
//! counters (off the async threads; a ublk worker's from its stats file,
//! asking the worker only when they moved, so an idle one sleeps on) and keeps 15 minutes of history: rates
//! and the history charts and `volume top` show come from it, and the
//! latest reading serves `/metrics`, so a scrape never waits on a device.
//! The history is kept as the steps between samples, each a few bytes
//! (varints, idle ops left out: about 5 bytes a second for an idle volume,
//! at most about 60 for a busy one with all four ops timed); the newest
//! sample is kept whole. History starts at attach or service start,
//! whichever is later. This file keeps the readings; [`super::look`]
//! takes them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use time::OffsetDateTime;
use uuid::Uuid;

use blockplane_api::model::{
    HISTORY_SECS, HistoryPoint, OpPoint, OpRates, Rate, Rates, VolumeStats,
};

/// Steps kept per volume: the history.
const KEEP: usize = HISTORY_SECS as usize;

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
}

/// What one op did between two samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct OpStep {
    ops: u64,
    bytes: u64,
    /// Requests timed and their time, microseconds (`None` where the
    /// backend does not time the op, or its timing started again).
    timed: Option<(u64, u64)>,
}

impl OpStep {
    fn idle(&self) -> bool {
        self.ops == 0 && self.bytes == 0 && self.timed.is_none_or(|(n, _)| n == 0)
    }
}

/// What happened between two samples: one point of the history.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Step {
    /// Microseconds between the samples.
    micros: u64,
    ops: [OpStep; 4],
    /// Requests in flight at the later sample.
    in_flight: u64,
}

impl Step {
    /// From `base` to `end` (counters that went back count nothing).
    fn between(base: &Sample, end: &Sample) -> Self {
        let mut ops = [OpStep::default(); 4];
        for (i, o) in ops.iter_mut().enumerate() {
            let (now, then) = (&end.ops[i], &base.ops[i]);
            *o = OpStep {
                ops: now.ops.saturating_sub(then.ops),
                bytes: now.bytes.saturating_sub(then.bytes),
                timed: match (now.timed, then.timed) {
                    (Some((n, t)), Some((n0, t0))) if n >= n0 && t >= t0 => {
                        Some((n - n0, (t.round() - t0.round()) as u64))
                    }
                    _ => None,
                },
            };
        }
        Self {
            micros: end.at.saturating_duration_since(base.at).as_micros() as u64,
            ops,
            in_flight: end.in_flight,
        }
    }

    /// The history point of this step, which ended at `wall`.
    fn point(&self, wall: OffsetDateTime) -> HistoryPoint {
        let dt = (self.micros as f64 / 1e6).max(1e-3);
        let point = |o: &OpStep| OpPoint {
            iops: o.ops as f64 / dt,
            bytes_per_sec: o.bytes as f64 / dt,
            latency_us: o
                .timed
                .filter(|(n, _)| *n > 0)
                .map(|(n, t)| t as f64 / n as f64),
        };
        HistoryPoint {
            at: wall,
            secs: dt,
            read: point(&self.ops[0]),
            write: point(&self.ops[1]),
            flush: point(&self.ops[2]),
            discard: point(&self.ops[3]),
            in_flight: self.in_flight,
        }
    }

    /// Appends this step to `out`: a byte saying which ops did anything
    /// (low four bits) and which of those are timed (high four), the
    /// interval and the requests in flight, then each such op's counts, all
    /// LEB128. Returns the bytes written (at most 1 + 2 * 10 + 4 * 40).
    fn encode(&self, out: &mut VecDeque<u8>) -> usize {
        let before = out.len();
        let mut head = 0u8;
        for (i, o) in self.ops.iter().enumerate() {
            if !o.idle() {
                head |= 1 << i;
                if o.timed.is_some() {
                    head |= 1 << (4 + i);
                }
            }
        }
        out.push_back(head);
        put(out, self.micros);
        put(out, self.in_flight);
        for o in self.ops.iter().filter(|o| !o.idle()) {
            put(out, o.ops);
            put(out, o.bytes);
            if let Some((n, t)) = o.timed {
                // The timed count is the op count but where the timing
                // started again (a new worker): zigzag of the difference.
                let d = n.wrapping_sub(o.ops) as i64;
                put(out, ((d << 1) ^ (d >> 63)) as u64);
                put(out, t);
            }
        }
        out.len() - before
    }

    /// Reads one step that [`Step::encode`] wrote.
    fn decode(bytes: &mut impl Iterator<Item = u8>) -> Self {
        let head = bytes.next().unwrap_or(0);
        let mut step = Step {
            micros: get(bytes),
            in_flight: get(bytes),
            ..Default::default()
        };
        for (i, o) in step.ops.iter_mut().enumerate() {
            if head & (1 << i) == 0 {
                continue;
            }
            o.ops = get(bytes);
            o.bytes = get(bytes);
            if head & (1 << (4 + i)) != 0 {
                let z = get(bytes);
                let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
                o.timed = Some((o.ops.wrapping_add(d as u64), get(bytes)));
            }
        }
        step
    }
}

/// Appends `x` as LEB128.
fn put(out: &mut VecDeque<u8>, mut x: u64) {
    loop {
        let byte = (x & 0x7f) as u8;
        x >>= 7;
        if x == 0 {
            out.push_back(byte);
            return;
        }
        out.push_back(byte | 0x80);
    }
}

/// Reads a LEB128 value.
fn get(bytes: &mut impl Iterator<Item = u8>) -> u64 {
    let mut x = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(b) = bytes.next() else { break };
        x |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
    }
    x
}

/// A volume's history: its steps, oldest first, encoded back to back.
#[derive(Debug, Default)]
struct Steps {
    bytes: VecDeque<u8>,
    /// Each step's length in `bytes`.
    lens: VecDeque<u8>,
}

impl Steps {
    fn push(&mut self, step: &Step) {
        let n = step.encode(&mut self.bytes);
        self.lens.push_back(n as u8);
        while self.lens.len() > KEEP {
            let n = self.lens.pop_front().unwrap_or(0) as usize;
            self.bytes.drain(..n);
        }
    }

    /// The steps, newest first, each read as it comes.
    fn newest_first(&self) -> impl Iterator<Item = Step> + '_ {
        let mut end = self.bytes.len();
        self.lens.iter().rev().map(move |len| {
            let start = end - *len as usize;
            let step = Step::decode(&mut self.bytes.range(start..end).copied());
            end = start;
            step
        })
    }

    /// The last `n` steps, oldest first.
    fn last(&self, n: usize) -> Vec<Step> {
        let mut steps: Vec<Step> = self.newest_first().take(n).collect();
        steps.reverse();
        steps
    }
}

#[derive(Debug, Default)]
struct Series {
    /// The newest sample, whole.
    newest: Option<Sample>,
    /// The steps up to it.
    steps: Steps,
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
        let sample = Sample::of(&stats, now);
        if let Some(prev) = &s.newest {
            s.steps.push(&Step::between(prev, &sample));
        }
        s.newest = Some(sample);
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
        let series = all.get(&id)?;
        let newest = series.newest.as_ref()?;
        let now = Sample::of(now_stats, Instant::now());
        let window = |secs| window(newest, series.steps.newest_first(), &now, secs);
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
        let Some(newest) = &s.newest else {
            return Vec::new();
        };
        history(newest.wall, &s.steps.last(seconds as usize))
    }
}

/// Rates from the oldest sample within the last `secs` before `now` (at
/// least one earlier than `now`) to `now`: the steps since it added up.
fn window(
    newest: &Sample,
    newest_first: impl Iterator<Item = Step>,
    now: &Sample,
    secs: u64,
) -> Option<OpRates> {
    let target = now.at.checked_sub(Duration::from_secs(secs))?;
    let mut sum = Step::between(newest, now);
    let mut base = newest.at;
    for step in newest_first {
        let Some(earlier) = base.checked_sub(Duration::from_micros(step.micros)) else {
            break;
        };
        if earlier < target {
            break;
        }
        base = earlier;
        for (s, o) in sum.ops.iter_mut().zip(&step.ops) {
            s.ops += o.ops;
            s.bytes += o.bytes;
        }
    }
    if base >= now.at {
        return None;
    }
    let dt = now.at.duration_since(base).as_secs_f64();
    if dt <= 0.0 {
        return None;
    }
    let r = |i: usize| Rate {
        iops: sum.ops[i].ops as f64 / dt,
        bytes_per_sec: sum.ops[i].bytes as f64 / dt,
    };
    Some(OpRates {
        read: r(0),
        write: r(1),
        flush: r(2),
        discard: r(3),
        window_secs: dt,
    })
}

/// The points of `steps`, the last of which ended at `wall`.
fn history(wall: OffsetDateTime, steps: &[Step]) -> Vec<HistoryPoint> {
    let mut end = wall;
    let mut points: Vec<HistoryPoint> = steps
        .iter()
        .rev()
        .map(|step| {
            let p = step.point(end);
            end -= Duration::from_micros(step.micros);
            p
        })
        .collect();
    points.reverse();
    points
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant, wall: OffsetDateTime, k: u64, timed: bool) -> Sample {
        let mut ops = [OpSample::default(); 4];
        for (i, o) in ops.iter_mut().enumerate() {
            let i = i as u64;
            *o = OpSample {
                ops: k * k * (i + 1),
                bytes: k * k * 4096 * (i + 1),
                timed: timed.then_some((k * k * (i + 1), (k * k * 37 * (i + 1)) as f64)),
            };
        }
        // Reads stop after a while: an idle op is left out of its steps.
        if k > 5 {
            ops[0] = OpSample {
                ops: 25,
                bytes: 25 * 4096,
                timed: timed.then_some((25, 25.0 * 37.0)),
            };
        }
        Sample {
            at,
            wall,
            ops,
            in_flight: k % 3,
        }
    }

    /// Steps read back as they were written, every field, including a
    /// timed count that is not the op count and counts past 2^63.
    #[test]
    fn steps_round_trip() {
        let steps = [
            Step::default(),
            Step {
                micros: 1_000_123,
                in_flight: 7,
                ops: [
                    OpStep {
                        ops: 5,
                        bytes: 20480,
                        timed: Some((3, 999)),
                    },
                    OpStep {
                        ops: 1,
                        bytes: u64::MAX,
                        timed: Some((9, u64::MAX)),
                    },
                    OpStep::default(),
                    OpStep {
                        ops: 2,
                        bytes: 1 << 40,
                        timed: None,
                    },
                ],
            },
        ];
        let mut all = Steps::default();
        for s in &steps {
            all.push(s);
        }
        assert_eq!(all.last(10), steps);
        assert_eq!(all.last(1), steps[1..]);
    }

    /// The history made from steps is the one the samples say: rates, mean
    /// latency, in flight and each point's end; the oldest steps go first.
    #[test]
    fn history_from_steps_is_the_samples() {
        let (t0, w0) = (Instant::now(), OffsetDateTime::now_utc());
        let samples: Vec<Sample> = (0..20u64)
            .map(|k| {
                let d = Duration::from_millis(1000 * k + 7 * (k % 4));
                sample(t0 + d, w0 + d, k, k != 12)
            })
            .collect();
        let mut steps = Steps::default();
        for w in samples.windows(2) {
            steps.push(&Step::between(&w[0], &w[1]));
        }
        let points = history(samples[19].wall, &steps.last(5));
        assert_eq!(points.len(), 5);
        for (p, w) in points.iter().zip(samples[14..].windows(2)) {
            let dt = w[1].at.duration_since(w[0].at).as_secs_f64();
            assert!((p.secs - dt).abs() < 1e-6, "{p:?}");
            assert!((p.at - w[1].wall).abs() < time::Duration::milliseconds(1));
            let want = (w[1].ops[1].ops - w[0].ops[1].ops) as f64 / dt;
            assert!((p.write.iops - want).abs() < 1e-6, "{p:?}");
            assert_eq!(p.read.iops, 0.0);
            assert_eq!(p.write.latency_us, Some(37.0));
            assert_eq!(p.in_flight, w[1].in_flight);
        }
        // No timing in one sample: no latency either side of it.
        let all = history(samples[19].wall, &steps.last(KEEP));
        assert_eq!(all.len(), 19);
        assert_eq!(
            (all[11].write.latency_us, all[12].write.latency_us),
            (None, None)
        );
        assert_eq!(all[13].write.latency_us, Some(37.0));
    }

    /// A window's rates are from the oldest sample in it to now, as the
    /// samples say, whichever samples the steps came from.
    #[test]
    fn rates_from_steps_are_the_samples() {
        let (t0, w0) = (Instant::now(), OffsetDateTime::now_utc());
        let at = |ms: u64| (t0 + Duration::from_millis(ms), w0);
        let samples: Vec<Sample> = (0..80u64)
            .map(|k| {
                let (t, w) = at(1000 * k + 3 * (k % 5));
                sample(t, w, k, true)
            })
            .collect();
        let mut steps = Steps::default();
        for w in samples.windows(2) {
            steps.push(&Step::between(&w[0], &w[1]));
        }
        let newest = &samples[79];
        let (t, w) = at(79_400);
        let now = sample(t, w, 80, true);
        for secs in [1, 10, 60] {
            let r = window(newest, steps.newest_first(), &now, secs).unwrap();
            let target = now.at - Duration::from_secs(secs);
            let base = samples.iter().find(|s| s.at >= target).unwrap();
            let dt = now.at.duration_since(base.at).as_secs_f64();
            assert!((r.window_secs - dt).abs() < 1e-6, "{secs}: {r:?}");
            let want = (now.ops[1].ops - base.ops[1].ops) as f64 / dt;
            assert!((r.write.iops - want).abs() < 1e-6, "{secs}: {r:?}");
            let want = (now.ops[3].bytes - base.ops[3].bytes) as f64 / dt;
            assert!(
                (r.discard.bytes_per_sec - want).abs() < 1e-3,
                "{secs}: {r:?}"
            );
        }
        // Nothing earlier than now: no rate.
        assert!(window(&now, std::iter::empty(), &now, 1).is_none());
    }

    /// 15 minutes of an idle volume are a few KiB; of a busy one, well under
    /// the 64 KiB a volume may cost the service.
    #[test]
    fn a_volumes_history_stays_small() {
        let idle = Step {
            micros: 1_000_000,
            ..Default::default()
        };
        let busy_op = OpStep {
            ops: 300_000,
            bytes: 300_000 * 4096,
            timed: Some((300_000, 300_000 * 120)),
        };
        let busy = Step {
            micros: 1_000_000,
            ops: [busy_op; 4],
            in_flight: 64,
        };
        for (step, most) in [(idle, 5), (busy, 70)] {
            let mut steps = Steps::default();
            for _ in 0..KEEP + 100 {
                steps.push(&step);
            }
            assert_eq!(steps.lens.len(), KEEP);
            let per_step = steps.bytes.len() / KEEP;
            assert!(per_step <= most, "{per_step} bytes a step");
            assert_eq!(steps.last(1)[0], step);
        }
    }
}
