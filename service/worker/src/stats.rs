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

use super::protocol::{Latency, WorkerStats};
use blockplane_api::model::OpStats;
use blockplane_api::model::{LATENCY_BOUNDS_US, LatencyHistogram};

const MAGIC: u64 = 0x6270_7374_6174_7332; // "bpstats2": per-queue blocks

/// The stats file's name in a worker's run dir.
pub const STATS_FILE: &str = "stats";

/// Kinds of requests counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read = 0,
    Write = 1,
    Flush = 2,
    /// DISCARD and WRITE_ZEROES.
    Discard = 3,
}

/// Adds to a counter that only the calling thread writes: a plain load and
/// store, no locked instruction (readers may see it a moment late).
#[inline]
pub fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Relaxed).wrapping_add(n), Relaxed);
}

/// One op's counters.
#[repr(C)]
#[derive(Debug, Default)]
pub struct OpCounters {
    pub ops: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
}

/// The file's header (layout fixed: the file is read back by later workers).
#[repr(C, align(128))]
#[derive(Debug, Default)]
struct Header {
    magic: AtomicU64,
    since_ms: AtomicU64,
    worker_restarts: AtomicU64,
    queues: AtomicU64,
}

/// One queue's counters, written by its thread only. Aligned apart so that
/// two queues never write the same cache line.
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct QueueCounters {
    pub ops: [OpCounters; 4],
    pub nowait_submitted: AtomicU64,
    pub nowait_completed_inline: AtomicU64,
    pub nowait_eagain_fallbacks: AtomicU64,
    /// Times an op type stopped asking NOWAIT (its fallback share was high).
    pub nowait_pauses: AtomicU64,
    /// Submissions made without NOWAIT while their op type was paused.
    pub nowait_bypassed: AtomicU64,
    pub qos_throttled: AtomicU64,
}

impl QueueCounters {
    /// Counts a completed request: `res` is its result (bytes or -errno).
    #[inline]
    pub fn complete(&self, op: Op, bytes: u64, res: i32) {
        let c = &self.ops[op as usize];
        bump(&c.ops, 1);
        if res < 0 {
            bump(&c.errors, 1);
        } else {
            bump(&c.bytes, bytes);
        }
    }
}

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
        let op = |i: usize| OpStats {
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

/// A worker's stats file as read by another process: its bytes, checked.
///
/// Read with `read(2)`, not mapped: a new worker with another queue count
/// truncates the file, and a reader's mapping past the new end would fault
/// (SIGBUS) instead of failing. The worker's own mapping and this read see
/// the same page-cache pages, so the counters are current.
struct FileImage {
    bytes: Vec<u8>,
    queues: usize,
}

impl FileImage {
    fn read(path: &Path) -> io::Result<Self> {
        let bytes = std::fs::read(path)?;
        let mut me = Self { bytes, queues: 0 };
        if me.word(std::mem::offset_of!(Header, magic))? != MAGIC {
            return Err(io::Error::other(format!(
                "{}: not a stats file",
                path.display()
            )));
        }
        let queues = me.word(std::mem::offset_of!(Header, queues))? as usize;
        if size_of::<Header>() + queues * size_of::<QueueCounters>() > me.bytes.len() {
            return Err(io::Error::other(format!("{}: too short", path.display())));
        }
        me.queues = queues;
        Ok(me)
    }

    fn word(&self, at: usize) -> io::Result<u64> {
        self.bytes
            .get(at..at + 8)
            .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
            .ok_or_else(|| io::Error::other("stats file too short"))
    }

    /// Field at `offset` of queue `q`'s block (within bounds: checked at read).
    fn queue_word(&self, q: usize, offset: usize) -> u64 {
        let at = size_of::<Header>() + q * size_of::<QueueCounters>() + offset;
        self.word(at).expect("within the checked length")
    }

    /// Field at `offset` summed over the queues.
    fn sum(&self, offset: usize) -> u64 {
        (0..self.queues).map(|q| self.queue_word(q, offset)).sum()
    }
}

/// Offset of field `field` of op `op`'s counters in a queue's block.
fn op_offset(op: usize, field: usize) -> usize {
    std::mem::offset_of!(QueueCounters, ops) + op * size_of::<OpCounters>() + field * 8
}

/// Requests each queue completed so far (reads, writes, flushes, discards,
/// in that order), read from a worker's stats file at `path`: which queues a
/// load reached (the kernel tests pin writers to CPUs and check it).
pub fn completed_per_queue(path: &Path) -> io::Result<Vec<[u64; 4]>> {
    let f = FileImage::read(path)?;
    Ok((0..f.queues)
        .map(|q| std::array::from_fn(|op| f.queue_word(q, op_offset(op, 0))))
        .collect())
}

/// The counters in a worker's stats file at `path`, per-queue blocks
/// merged, read without asking the worker (which may be idle, or dead: the
/// file outlives it). No latency, histograms or in-flight gauge: those live
/// with the queue threads and need a `Stats` request.
pub fn read_counters(path: &Path) -> io::Result<WorkerStats> {
    let f = FileImage::read(path)?;
    let op = |i: usize| OpStats {
        ops: f.sum(op_offset(i, 0)),
        bytes: f.sum(op_offset(i, 1)),
        errors: Some(f.sum(op_offset(i, 2))),
    };
    use std::mem::offset_of;
    Ok(WorkerStats {
        read: op(0),
        write: op(1),
        flush: op(2),
        discard: op(3),
        since_ms: f.word(offset_of!(Header, since_ms))?,
        worker_restarts: f.word(offset_of!(Header, worker_restarts))?,
        nowait_submitted: f.sum(offset_of!(QueueCounters, nowait_submitted)),
        nowait_completed_inline: f.sum(offset_of!(QueueCounters, nowait_completed_inline)),
        nowait_eagain_fallbacks: f.sum(offset_of!(QueueCounters, nowait_eagain_fallbacks)),
        nowait_pauses: f.sum(offset_of!(QueueCounters, nowait_pauses)),
        nowait_bypassed: f.sum(offset_of!(QueueCounters, nowait_bypassed)),
        qos_throttled: f.sum(offset_of!(QueueCounters, qos_throttled)),
        ..WorkerStats::default()
    })
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
