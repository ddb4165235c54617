//! A worker's counters file (`stats` in its run dir): its layout, written
//! by the worker's queue threads through a shared mapping, and its reader,
//! for the service, which reads it without asking the worker (idle, or
//! dead: the file outlives it).
//!
//! The layout is fixed: a [`Header`], then one [`QueueCounters`] block per
//! queue, each written by its queue's thread alone. A later worker maps the
//! same file and counts on.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::messages::WorkerStats;
use crate::terms::OpCounts;

/// The header's first word in a file of this layout.
pub const MAGIC: u64 = 0x6270_7374_6174_7332; // "bpstats2": per-queue blocks

/// The stats file's name in a worker's run dir.
pub const STATS_FILE: &str = "stats";

/// Kinds of requests counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// READ.
    Read = 0,
    /// WRITE.
    Write = 1,
    /// FLUSH.
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
    /// Requests completed.
    pub ops: AtomicU64,
    /// Bytes moved by those that succeeded.
    pub bytes: AtomicU64,
    /// Requests that failed.
    pub errors: AtomicU64,
}

/// The file's header (layout fixed: the file is read back by later workers).
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct Header {
    /// [`MAGIC`], written last when the file is laid out.
    pub magic: AtomicU64,
    /// Unix milliseconds since which the counters count.
    pub since_ms: AtomicU64,
    /// Workers that took the device over after an earlier one ended.
    pub worker_restarts: AtomicU64,
    /// Queue blocks after the header.
    pub queues: AtomicU64,
}

/// One queue's counters, written by its thread only. Aligned apart so that
/// two queues never write the same cache line.
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct QueueCounters {
    /// Per [`Op`], in its order.
    pub ops: [OpCounters; 4],
    /// Submissions with RWF_NOWAIT.
    pub nowait_submitted: AtomicU64,
    /// Of those, completed without blocking.
    pub nowait_completed_inline: AtomicU64,
    /// Of those, answered EAGAIN and resubmitted on the blocking path.
    pub nowait_eagain_fallbacks: AtomicU64,
    /// Times an op type stopped asking NOWAIT (its fallback share was high).
    pub nowait_pauses: AtomicU64,
    /// Submissions made without NOWAIT while their op type was paused.
    pub nowait_bypassed: AtomicU64,
    /// Requests that waited for the QoS limits.
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
    let op = |i: usize| OpCounts {
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
