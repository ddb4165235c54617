//! The kernel's per-device block statistics (`/sys/block/<dev>/stat`), shared by
//! the backends whose data path is in the kernel (loop, dm).

use std::io;

use serde::{Deserialize, Serialize};

use blockplane_api::model::{KernelBlockStats, OpStats};

/// One reading of `/sys/block/<dev>/stat` (see the kernel's
/// Documentation/block/stat.rst for the field order).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockStat {
    /// Reads completed.
    pub read_ios: u64,
    /// Reads merged with one already queued.
    pub read_merges: u64,
    /// 512-byte sectors read.
    pub read_sectors: u64,
    /// Milliseconds reads spent waiting, summed over reads.
    pub read_ticks: u64,
    /// Writes completed.
    pub write_ios: u64,
    /// Writes merged with one already queued.
    pub write_merges: u64,
    /// 512-byte sectors written.
    pub write_sectors: u64,
    /// Milliseconds writes spent waiting, summed over writes.
    pub write_ticks: u64,
    /// Requests issued to the device and not yet completed (a gauge).
    pub in_flight: u64,
    /// Milliseconds the device had requests in flight.
    pub io_ticks: u64,
    /// Milliseconds requests spent waiting, summed over all requests.
    pub time_in_queue: u64,
    /// Discards completed (kernel 4.18 and later).
    pub discard_ios: u64,
    /// Discards merged with one already queued.
    pub discard_merges: u64,
    /// 512-byte sectors discarded.
    pub discard_sectors: u64,
    /// Milliseconds discards spent waiting, summed over discards.
    pub discard_ticks: u64,
    /// Flushes completed (kernel 5.5 and later).
    pub flush_ios: u64,
    /// Milliseconds flushes spent waiting, summed over flushes.
    pub flush_ticks: u64,
}

impl BlockStat {
    /// Reads the statistics of the block device `name` (e.g. `loop3`, `dm-0`).
    pub fn read(name: &str) -> io::Result<Self> {
        let text = std::fs::read_to_string(format!("/sys/block/{name}/stat"))?;
        Self::parse(&text).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("/sys/block/{name}/stat: unexpected format"),
            )
        })
    }

    /// Parses the whitespace-separated counters; kernels before 4.18 (no discard
    /// fields) and 5.5 (no flush fields) leave the missing ones at zero.
    pub fn parse(text: &str) -> Option<Self> {
        let v: Vec<u64> = text
            .split_whitespace()
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        if v.len() < 11 {
            return None;
        }
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        Some(Self {
            read_ios: at(0),
            read_merges: at(1),
            read_sectors: at(2),
            read_ticks: at(3),
            write_ios: at(4),
            write_merges: at(5),
            write_sectors: at(6),
            write_ticks: at(7),
            in_flight: at(8),
            io_ticks: at(9),
            time_in_queue: at(10),
            discard_ios: at(11),
            discard_merges: at(12),
            discard_sectors: at(13),
            discard_ticks: at(14),
            flush_ios: at(15),
            flush_ticks: at(16),
        })
    }

    /// Counters accumulated since `base` was read. A device re-created by the
    /// kernel restarts at zero; then the whole current reading counts.
    pub fn since(&self, base: &BlockStat) -> BlockStat {
        if self.read_ios < base.read_ios || self.write_ios < base.write_ios {
            return *self;
        }
        BlockStat {
            read_ios: self.read_ios - base.read_ios,
            read_merges: self.read_merges.saturating_sub(base.read_merges),
            read_sectors: self.read_sectors.saturating_sub(base.read_sectors),
            read_ticks: self.read_ticks.saturating_sub(base.read_ticks),
            write_ios: self.write_ios - base.write_ios,
            write_merges: self.write_merges.saturating_sub(base.write_merges),
            write_sectors: self.write_sectors.saturating_sub(base.write_sectors),
            write_ticks: self.write_ticks.saturating_sub(base.write_ticks),
            in_flight: self.in_flight,
            io_ticks: self.io_ticks.saturating_sub(base.io_ticks),
            time_in_queue: self.time_in_queue.saturating_sub(base.time_in_queue),
            discard_ios: self.discard_ios.saturating_sub(base.discard_ios),
            discard_merges: self.discard_merges.saturating_sub(base.discard_merges),
            discard_sectors: self.discard_sectors.saturating_sub(base.discard_sectors),
            discard_ticks: self.discard_ticks.saturating_sub(base.discard_ticks),
            flush_ios: self.flush_ios.saturating_sub(base.flush_ios),
            flush_ticks: self.flush_ticks.saturating_sub(base.flush_ticks),
        }
    }

    /// Per-op counters in the API's shape. The kernel does not count errors.
    pub fn ops(&self) -> [OpStats; 4] {
        let op = |ios, sectors: u64| OpStats {
            ops: ios,
            bytes: sectors * 512,
            errors: None,
        };
        [
            op(self.read_ios, self.read_sectors),
            op(self.write_ios, self.write_sectors),
            op(self.flush_ios, 0),
            op(self.discard_ios, self.discard_sectors),
        ]
    }

    /// The counters the API shape has no other place for.
    pub fn kernel(&self) -> KernelBlockStats {
        KernelBlockStats {
            read_merges: self.read_merges,
            write_merges: self.write_merges,
            discard_merges: self.discard_merges,
            read_ticks_ms: self.read_ticks,
            write_ticks_ms: self.write_ticks,
            discard_ticks_ms: self.discard_ticks,
            flush_ticks_ms: self.flush_ticks,
            io_ticks_ms: self.io_ticks,
            time_in_queue_ms: self.time_in_queue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_seventeen_fields_and_subtracts_a_baseline() {
        let a = BlockStat::parse("10 1 80 5 20 2 160 7 0 9 12 3 0 24 1 4 2\n").unwrap();
        assert_eq!(a.read_sectors, 80);
        assert_eq!(a.flush_ticks, 2);
        let b = BlockStat::parse("15 1 120 6 30 2 240 8 1 10 14 3 0 24 1 5 2").unwrap();
        let d = b.since(&a);
        assert_eq!((d.read_ios, d.write_sectors, d.flush_ios), (5, 80, 1));
        assert_eq!(d.in_flight, 1);
        assert_eq!(b.since(&b).read_ios, 0);
    }

    #[test]
    fn a_reset_device_counts_from_zero() {
        let old = BlockStat::parse("100 0 800 0 100 0 800 0 0 0 0").unwrap();
        let now = BlockStat::parse("3 0 24 0 1 0 8 0 0 0 0").unwrap();
        assert_eq!(now.since(&old).read_ios, 3);
    }

    #[test]
    fn refuses_garbage() {
        assert!(BlockStat::parse("1 2 x").is_none());
        assert!(BlockStat::parse("1 2 3").is_none());
    }
}
