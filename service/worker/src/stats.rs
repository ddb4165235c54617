//! A worker's counters and latency histograms.
//!
//! Nothing here is shared between queue threads while requests run. Each
//! queue has its own block of counters in a small file the worker maps shared
//! (`stats` in its run dir), written by that queue's thread alone: they
//! survive a worker crash, so the worker that recovers the device keeps
//! counting from where the last one stopped. Each queue thread also owns its
//! latency histograms (hdrhistogram, [`QueueLatency`]), which it hands over
//! when asked and which restart empty with a new worker. A read merges them.

use std::fs::OpenOptions;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use hdrhistogram::Histogram;

use blockplane_protocol::stats_file::{Header, MAGIC, Op, QueueCounters};
use blockplane_protocol::{self as protocol, LATENCY_BOUNDS_US, Latency, OpCounts, WorkerStats};

/// The counters, mapped from the worker's stats file: a header, then one
/// block per queue.
pub struct Stats {
    ptr: *mut u8,
    len: usize,
    queues: usize,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for Stats {}
// SAFETY: as above.
unsafe impl Sync for Stats {}

impl Stats {
    /// Maps `path` for `queues` queues, creating it (zeroed, counting from
    /// now) if new, unreadable or laid out for another queue count.
    pub fn open(path: &Path, queues: usize) -> io::Result<Self> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let len = size_of::<Header>() + queues * size_of::<QueueCounters>();
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
        .cast::<u8>();
        let me = Self { ptr, len, queues };
        let h = me.header();
        if h.magic.load(Relaxed) != MAGIC || h.queues.load(Relaxed) != queues as u64 {
            for q in 0..queues {
                // SAFETY: a fresh block: zero it as a whole.
                unsafe { std::ptr::write(me.queue_ptr(q), QueueCounters::default()) };
            }
            h.worker_restarts.store(0, Relaxed);
            h.queues.store(queues as u64, Relaxed);
            h.since_ms.store(now_ms(), Relaxed);
            h.magic.store(MAGIC, Relaxed);
        }
        Ok(me)
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a header; all its fields are atomics.
        unsafe { &*self.ptr.cast::<Header>() }
    }

    fn queue_ptr(&self, q: usize) -> *mut QueueCounters {
        assert!(q < self.queues, "queue {q} of {}", self.queues);
        // SAFETY: within the mapping (len covers every queue's block).
        unsafe {
            self.ptr
                .add(size_of::<Header>() + q * size_of::<QueueCounters>())
                .cast()
        }
    }

    /// Queue `q`'s counters, for its thread to write.
    pub fn queue(&self, q: usize) -> &QueueCounters {
        // SAFETY: mapped for the life of self; all fields are atomics.
        unsafe { &*self.queue_ptr(q) }
    }

    /// Counts a worker that took over after a crash.
    pub fn count_restart(&self) {
        self.header().worker_restarts.fetch_add(1, Relaxed);
    }

    /// Merges every queue's counters with what each queue thread reported.
    pub fn snapshot(&self, reports: &[QueueReport]) -> WorkerStats {
        let sum = |f: &dyn Fn(&QueueCounters) -> &AtomicU64| -> u64 {
            (0..self.queues)
                .map(|q| f(self.queue(q)).load(Relaxed))
                .sum()
        };
        let op = |i: usize| OpCounts {
            ops: sum(&|c| &c.ops[i].ops),
            bytes: sum(&|c| &c.ops[i].bytes),
            errors: Some(sum(&|c| &c.ops[i].errors)),
        };
        let mut latency = [Latency::default(); 4];
        let mut histograms = Vec::with_capacity(4);
        for (i, l) in latency.iter_mut().enumerate() {
            let mut merged = QueueLatency::histogram();
            for r in reports {
                let _ = merged.add(&r.latency.0[i]);
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
        let h = self.header();
        WorkerStats {
            read: op(0),
            write: op(1),
            flush: op(2),
            discard: op(3),
            in_flight: reports.iter().map(|r| r.in_flight).sum(),
            since_ms: h.since_ms.load(Relaxed),
            latency,
            histograms,
            nowait_submitted: sum(&|c| &c.nowait_submitted),
            nowait_completed_inline: sum(&|c| &c.nowait_completed_inline),
            nowait_eagain_fallbacks: sum(&|c| &c.nowait_eagain_fallbacks),
            nowait_pauses: sum(&|c| &c.nowait_pauses),
            nowait_bypassed: sum(&|c| &c.nowait_bypassed),
            qos_throttled: sum(&|c| &c.qos_throttled),
            worker_restarts: h.worker_restarts.load(Relaxed),
        }
    }
}

impl Drop for Stats {
    fn drop(&mut self) {
        // SAFETY: unmapping what open() mapped.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Latency histograms of one queue, per op, in microseconds; owned by the
/// queue's thread.
#[derive(Clone)]
pub struct QueueLatency([Histogram<u64>; 4]);

impl Default for QueueLatency {
    fn default() -> Self {
        let h = Self::histogram;
        Self([h(), h(), h(), h()])
    }
}

impl QueueLatency {
    fn histogram() -> Histogram<u64> {
        Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds")
    }

    /// Records one request's latency.
    #[inline]
    pub fn record(&mut self, op: Op, micros: u64) {
        self.0[op as usize].saturating_record(micros.max(1));
    }
}

/// What a queue thread hands over for a stats read.
#[derive(Clone, Default)]
pub struct QueueReport {
    pub latency: QueueLatency,
    pub in_flight: u64,
}

/// Per-bucket counts over the metrics bounds (the last counts the rest).
fn buckets(h: &Histogram<u64>) -> protocol::Histogram {
    let mut out = Vec::with_capacity(LATENCY_BOUNDS_US.len() + 1);
    let mut below = 0u64;
    for b in LATENCY_BOUNDS_US {
        let upto = h.count_between(0, b);
        out.push(upto.saturating_sub(below));
        below = upto;
    }
    out.push(h.len().saturating_sub(below));
    protocol::Histogram {
        buckets: out,
        sum_us: h.mean() * h.len() as f64,
        count: h.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockplane_protocol::{completed_per_queue, read_counters};

    #[test]
    fn counters_survive_a_new_mapping_and_percentiles_merge_queues() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stats");
        let s = Stats::open(&path, 2).unwrap();
        let (mut l0, mut l1) = (QueueLatency::default(), QueueLatency::default());
        s.queue(0).complete(Op::Write, 4096, 4096);
        l0.record(Op::Write, 100);
        s.queue(1).complete(Op::Write, 4096, 4096);
        l1.record(Op::Write, 300);
        s.queue(1).complete(Op::Read, 512, -5);
        let since = s.snapshot(&[]).since_ms;
        drop(s);
        // A new worker maps the same file: the counters are still there.
        let s = Stats::open(&path, 2).unwrap();
        s.count_restart();
        let snap = s.snapshot(&[]);
        assert_eq!(snap.write.ops, 2);
        assert_eq!(snap.write.bytes, 8192);
        assert_eq!(
            (snap.read.ops, snap.read.errors, snap.read.bytes),
            (1, Some(1), 0)
        );
        assert_eq!((snap.since_ms, snap.worker_restarts), (since, 1));
        assert_eq!(snap.latency[1].count, 0, "histograms live with the queues");
        l0.record(Op::Write, 900);
        let reports = [
            QueueReport {
                latency: l0,
                in_flight: 1,
            },
            QueueReport {
                latency: l1,
                in_flight: 2,
            },
        ];
        let snap = s.snapshot(&reports);
        let l = snap.latency[1];
        assert_eq!((l.count, snap.in_flight), (3, 3));
        assert!(l.p50 >= 299 && l.p50 <= 301 && l.max >= 895, "{l:?}");
        let h = &snap.histograms[1];
        assert_eq!(h.count, 3);
        assert_eq!(h.buckets.iter().sum::<u64>(), 3);
        // 100 us lands in the (50, 100] bucket, 300 in (250, 500], 900 in (500, 1000].
        assert_eq!((h.buckets[1], h.buckets[4]), (1, 1), "{h:?}");
        s.queue(0).nowait_submitted.store(7, Relaxed);
        s.queue(1).qos_throttled.store(3, Relaxed);
        // Read from the file, without the queue threads: the same counters.
        let from_file = read_counters(&path).unwrap();
        let snap = s.snapshot(&[]);
        assert_eq!(
            (
                from_file.read,
                from_file.write,
                from_file.flush,
                from_file.discard
            ),
            (snap.read, snap.write, snap.flush, snap.discard)
        );
        assert_eq!(
            (
                from_file.since_ms,
                from_file.worker_restarts,
                from_file.nowait_submitted,
                from_file.qos_throttled
            ),
            (since, 1, 7, 3)
        );
        drop(s);
        assert_eq!(
            completed_per_queue(&path).unwrap(),
            [[0, 1, 0, 0], [1, 1, 0, 0]],
            "per queue: reads, writes, flushes, discards"
        );
        // Another queue count is another layout: counting starts again.
        let s = Stats::open(&path, 3).unwrap();
        assert_eq!(s.snapshot(&[]).write.ops, 0);
    }
}
