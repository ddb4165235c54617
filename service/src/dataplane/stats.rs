//! A worker's counters and latency histograms.
//!
//! Counters live in a small file the worker maps shared (`stats` in its run
//! dir): they survive a worker crash, so the worker that recovers the device
//! keeps counting from where the last one stopped. Latency histograms
//! (hdrhistogram) live in the worker's memory, one set per queue, and restart
//! empty with a new worker.

use std::fs::OpenOptions;
use std::io;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use hdrhistogram::Histogram;

use super::protocol::{Latency, WorkerStats};
use crate::metrics::{LATENCY_BOUNDS_US, LatencyHistogram};
use crate::model::OpStats;

const MAGIC: u64 = 0x6270_7374_6174_7331; // "bpstats1"

/// Kinds of requests counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read = 0,
    Write = 1,
    Flush = 2,
    /// DISCARD and WRITE_ZEROES.
    Discard = 3,
}

/// One op's counters.
#[repr(C)]
#[derive(Debug, Default)]
pub struct OpCounters {
    pub ops: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
}

/// The shared counters (layout fixed: the file is read back by later workers).
#[repr(C)]
#[derive(Debug, Default)]
pub struct Counters {
    magic: AtomicU64,
    pub since_ms: AtomicU64,
    pub ops: [OpCounters; 4],
    pub nowait_submitted: AtomicU64,
    pub nowait_completed_inline: AtomicU64,
    pub nowait_eagain_fallbacks: AtomicU64,
    pub qos_throttled: AtomicU64,
    pub worker_restarts: AtomicU64,
}

/// The counters, mapped from the worker's stats file.
pub struct SharedCounters {
    ptr: *mut Counters,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for SharedCounters {}
// SAFETY: as above.
unsafe impl Sync for SharedCounters {}

impl SharedCounters {
    /// Maps `path`, creating it (zeroed, counting from now) if new or unreadable.
    pub fn open(path: &Path) -> io::Result<Self> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let len = std::mem::size_of::<Counters>();
        if f.metadata()?.len() != len as u64 {
            f.set_len(0)?;
            f.set_len(len as u64)?;
        }
        // SAFETY: a shared mapping of a file of exactly `len` bytes.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &f,
                0,
            )?
        }
        .cast::<Counters>();
        let me = Self { ptr };
        if me.magic.load(Relaxed) != MAGIC {
            me.since_ms.store(now_ms(), Relaxed);
            me.magic.store(MAGIC, Relaxed);
        }
        Ok(me)
    }
}

impl std::ops::Deref for SharedCounters {
    type Target = Counters;
    fn deref(&self) -> &Counters {
        // SAFETY: mapped for the life of self; all fields are atomics.
        unsafe { &*self.ptr }
    }
}

impl Drop for SharedCounters {
    fn drop(&mut self) {
        // SAFETY: unmapping what open() mapped.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), std::mem::size_of::<Counters>()) };
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Latency histograms of one queue, per op, in microseconds.
pub struct QueueLatency {
    hist: Mutex<[Histogram<u64>; 4]>,
}

impl Default for QueueLatency {
    fn default() -> Self {
        let h = || Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds");
        Self {
            hist: Mutex::new([h(), h(), h(), h()]),
        }
    }
}

impl QueueLatency {
    /// Records one request's latency.
    pub fn record(&self, op: Op, micros: u64) {
        if let Ok(mut h) = self.hist.lock() {
            h[op as usize].saturating_record(micros.max(1));
        }
    }
}

/// Everything a worker counts.
pub struct Stats {
    pub counters: SharedCounters,
    pub queues: Vec<QueueLatency>,
    pub in_flight: AtomicU64,
}

impl Stats {
    /// Counters from `path`, histograms for `queues` queues.
    pub fn open(path: &Path, queues: usize) -> io::Result<Self> {
        Ok(Self {
            counters: SharedCounters::open(path)?,
            queues: (0..queues).map(|_| QueueLatency::default()).collect(),
            in_flight: AtomicU64::new(0),
        })
    }

    /// Counts a completed request: `res` is its result (bytes or -errno).
    pub fn complete(&self, queue: usize, op: Op, bytes: u64, res: i32, micros: u64) {
        let c = &self.counters.ops[op as usize];
        c.ops.fetch_add(1, Relaxed);
        if res < 0 {
            c.errors.fetch_add(1, Relaxed);
        } else {
            c.bytes.fetch_add(bytes, Relaxed);
        }
        if let Some(q) = self.queues.get(queue) {
            q.record(op, micros);
        }
    }

    /// A snapshot for the control plane.
    pub fn snapshot(&self) -> WorkerStats {
        let c = &self.counters;
        let op = |i: usize| OpStats {
            ops: c.ops[i].ops.load(Relaxed),
            bytes: c.ops[i].bytes.load(Relaxed),
            errors: Some(c.ops[i].errors.load(Relaxed)),
        };
        let mut latency = [Latency::default(); 4];
        let mut histograms = Vec::with_capacity(4);
        for (i, l) in latency.iter_mut().enumerate() {
            let mut merged =
                Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).expect("valid bounds");
            for q in &self.queues {
                if let Ok(h) = q.hist.lock() {
                    let _ = merged.add(&h[i]);
                }
            }
            *l = Latency {
                p50: merged.value_at_quantile(0.5),
                p90: merged.value_at_quantile(0.9),
                p99: merged.value_at_quantile(0.99),
                p999: merged.value_at_quantile(0.999),
                max: merged.max(),
                count: merged.len(),
            };
            histograms.push(buckets(&merged));
        }
        WorkerStats {
            read: op(0),
            write: op(1),
            flush: op(2),
            discard: op(3),
            in_flight: self.in_flight.load(Relaxed),
            since_ms: c.since_ms.load(Relaxed),
            latency,
            histograms,
            nowait_submitted: c.nowait_submitted.load(Relaxed),
            nowait_completed_inline: c.nowait_completed_inline.load(Relaxed),
            nowait_eagain_fallbacks: c.nowait_eagain_fallbacks.load(Relaxed),
            qos_throttled: c.qos_throttled.load(Relaxed),
            worker_restarts: c.worker_restarts.load(Relaxed),
        }
    }
}

/// Per-bucket counts over the metrics bounds (the last counts the rest).
fn buckets(h: &Histogram<u64>) -> LatencyHistogram {
    let mut out = Vec::with_capacity(LATENCY_BOUNDS_US.len() + 1);
    let mut below = 0u64;
    for b in LATENCY_BOUNDS_US {
        let upto = h.count_between(0, b);
        out.push(upto.saturating_sub(below));
        below = upto;
    }
    out.push(h.len().saturating_sub(below));
    LatencyHistogram {
        buckets: out,
        sum_us: h.mean() * h.len() as f64,
        count: h.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_survive_a_new_mapping_and_percentiles_merge_queues() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stats");
        let s = Stats::open(&path, 2).unwrap();
        s.complete(0, Op::Write, 4096, 4096, 100);
        s.complete(1, Op::Write, 4096, 4096, 300);
        s.complete(1, Op::Read, 512, -5, 50);
        let since = s.snapshot().since_ms;
        drop(s);
        // A new worker maps the same file: the counters are still there.
        let s = Stats::open(&path, 1).unwrap();
        let snap = s.snapshot();
        assert_eq!(snap.write.ops, 2);
        assert_eq!(snap.write.bytes, 8192);
        assert_eq!(
            (snap.read.ops, snap.read.errors, snap.read.bytes),
            (1, Some(1), 0)
        );
        assert_eq!(snap.since_ms, since);
        assert_eq!(
            snap.latency[1].count, 0,
            "histograms restart with the worker"
        );
        s.complete(0, Op::Write, 4096, 4096, 100);
        s.complete(0, Op::Write, 4096, 4096, 900);
        let l = s.snapshot().latency[1];
        assert_eq!(l.count, 2);
        assert!(l.p50 >= 99 && l.p50 <= 101 && l.max >= 895, "{l:?}");
        let h = &s.snapshot().histograms[1];
        assert_eq!(h.count, 2);
        assert_eq!(h.buckets.iter().sum::<u64>(), 2);
        // 100 us lands in the (50, 100] bucket, 900 us in (500, 1000].
        assert_eq!((h.buckets[1], h.buckets[4]), (1, 1), "{h:?}");
    }
}
