//! A volume's I/O counters, rates, latency and history
//! (`/v1/volumes/{id}/stats`, `/v1/volumes/{id}/stats/history`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::backend::{ActiveDispatch, Backend};

/// Counters of one kind of request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OpStats {
    /// Requests completed.
    pub ops: u64,
    /// Bytes they moved.
    pub bytes: u64,
    /// `null` where the backend cannot count errors (the kernel's block statistics do not).
    pub errors: Option<u64>,
}

/// `GET /v1/volumes/{id}/stats`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeStats {
    /// The volume's id.
    pub volume_id: Uuid,
    /// The volume's backend.
    pub backend: Backend,
    /// The data path in effect now.
    pub dispatch: ActiveDispatch,
    /// Reads.
    pub read: OpStats,
    /// Writes.
    pub write: OpStats,
    /// Flushes.
    pub flush: OpStats,
    /// Discards.
    pub discard: OpStats,
    /// Requests issued to the device and not yet completed.
    pub in_flight: u64,
    /// When these counters started counting.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub since: OffsetDateTime,
    /// Loop and dm volumes: the kernel's block-layer statistics, as read.
    pub kernel: Option<KernelBlockStats>,
    /// ublk volumes: latency per op, from the worker's histograms (since the
    /// worker started).
    pub latency_us: Option<LatencyStats>,
    /// ublk volumes, and dm volumes off `direct` (from their private
    /// worker, since it started): what the `nowait` path did.
    pub nowait: Option<NowaitStats>,
    /// ublk volumes, and dm volumes off `direct`: requests delayed by QoS.
    pub qos_throttled: Option<u64>,
    /// ublk volumes, and dm volumes off `direct`: workers replaced after a
    /// crash.
    pub worker_restarts: Option<u64>,
    /// Rates over the last 1, 10 and 60 seconds (from the service's 1 s
    /// sampler; `null` until it has two samples of the volume).
    pub rates: Option<Rates>,
    /// What the host's page cache holds of the volume's device and image,
    /// read when these stats were (`null` from a service before it said).
    pub page_cache: Option<PageCache>,
    /// ublk volumes: latency histograms for `/metrics` (not part of the API).
    #[serde(skip)]
    pub histograms: Option<Vec<LatencyHistogram>>,
}

impl VolumeStats {
    /// Read, write, flush and discard, in that order (the order of every
    /// per-op array).
    pub fn ops(&self) -> [&OpStats; 4] {
        [&self.read, &self.write, &self.flush, &self.discard]
    }
}

/// Bytes of a volume's block device and of its image file held in the
/// host's page cache (`cachestat(2)`, or `mincore(2)` for the image on a
/// kernel before 6.5). Pages cached under a volume whose data path does
/// direct I/O make each direct write invalidate them, and a filesystem may
/// write back and wait on each request: see the `volume_page_cache` event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PageCache {
    /// Bytes of the block device node (e.g. `/dev/ublkb0`) cached, as a
    /// buffered read of the device (`blkid`, `dd`) leaves them; `null` where
    /// the kernel cannot say (no `cachestat(2)`, before 6.5).
    pub device_bytes: Option<u64>,
    /// Bytes of the image file cached; `null` when it could not be read.
    pub image_bytes: Option<u64>,
}

/// Requests and bytes per second of one op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Rate {
    /// Requests a second.
    pub iops: f64,
    /// Bytes a second.
    pub bytes_per_sec: f64,
}

/// Rates of each op over one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OpRates {
    /// Reads.
    pub read: Rate,
    /// Writes.
    pub write: Rate,
    /// Flushes.
    pub flush: Rate,
    /// Discards.
    pub discard: Rate,
    /// The window actually covered, seconds (shorter while the sampler warms up).
    pub window_secs: f64,
}

/// Rates over the last 1, 10 and 60 seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Rates {
    /// Over the last second.
    pub last_1s: OpRates,
    /// Over the last 10 seconds.
    pub last_10s: OpRates,
    /// Over the last 60 seconds.
    pub last_60s: OpRates,
}

/// Seconds of history the service keeps per attached volume (one sample a
/// second, from attach or service start, whichever is later).
pub const HISTORY_SECS: u32 = 900;

/// Query of `GET /v1/volumes/{id}/stats/history`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct StatsHistoryQuery {
    /// The last this many seconds (default 300, at most 900).
    #[cfg_attr(feature = "openapi", param(minimum = 1, maximum = 900))]
    pub seconds: Option<u32>,
}

/// Query of `GET /metrics`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct MetricsQuery {
    /// Every bucket of each volume's latency histogram
    /// (`blockplane_volume_latency_seconds`), about 7 KB more per ublk
    /// volume; without it (the default) each carries its `+Inf` bucket, sum
    /// and count, and `blockplane_latency_seconds` the buckets of all
    /// volumes added up.
    pub volume_histograms: Option<bool>,
}

/// One op over one interval of a volume's history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OpPoint {
    /// Requests a second.
    pub iops: f64,
    /// Bytes a second.
    pub bytes_per_sec: f64,
    /// Mean time of the requests completed in the interval, microseconds:
    /// the worker's own timing (ublk) or the kernel's time in queue (loop,
    /// dm); `null` when none completed.
    pub latency_us: Option<f64>,
}

/// One interval (about a second) of a volume's history.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HistoryPoint {
    /// The end of the interval.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub at: OffsetDateTime,
    /// Length of the interval, seconds.
    pub secs: f64,
    /// Reads.
    pub read: OpPoint,
    /// Writes.
    pub write: OpPoint,
    /// Flushes.
    pub flush: OpPoint,
    /// Discards.
    pub discard: OpPoint,
    /// Requests in flight at the end of the interval.
    pub in_flight: u64,
}

/// `GET /v1/volumes/{id}/stats/history`: the volume's last seconds, oldest
/// first, from the service's 1 s sampler.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StatsHistory {
    /// The volume's id.
    pub volume_id: Uuid,
    /// The volume's name.
    pub name: String,
    /// Seconds the service keeps (the most `seconds` can ask for).
    pub kept_secs: u32,
    /// Empty until the sampler has two readings of an attached volume.
    pub points: Vec<HistoryPoint>,
}

/// Latency percentiles of one op, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Percentiles {
    /// The median.
    pub p50: u64,
    /// The 90th percentile.
    pub p90: u64,
    /// The 99th percentile.
    pub p99: u64,
    /// The 99.9th percentile.
    pub p999: u64,
    /// The slowest.
    pub max: u64,
    /// Requests measured.
    pub count: u64,
}

/// Latency of each op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LatencyStats {
    /// Reads.
    pub read: Percentiles,
    /// Writes.
    pub write: Percentiles,
    /// Flushes.
    pub flush: Percentiles,
    /// Discards.
    pub discard: Percentiles,
}

/// The `nowait` path's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NowaitStats {
    /// Submissions with RWF_NOWAIT.
    pub submitted: u64,
    /// Of those, completed without blocking.
    pub completed_inline: u64,
    /// Of those, answered EAGAIN and resubmitted on the blocking path.
    pub eagain_fallbacks: u64,
    /// Times an op type (read or write) stopped asking NOWAIT for a while
    /// because most of its recent submissions answered EAGAIN.
    pub pauses: u64,
    /// Submissions made without NOWAIT while their op type was paused.
    pub bypassed: u64,
}

/// The raw counters of `/sys/block/<dev>/stat` (since the device's last attach).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct KernelBlockStats {
    /// Reads merged into a neighbour in the queue.
    pub read_merges: u64,
    /// Writes merged into a neighbour in the queue.
    pub write_merges: u64,
    /// Discards merged into a neighbour in the queue.
    pub discard_merges: u64,
    /// Milliseconds reads spent in the queue.
    pub read_ticks_ms: u64,
    /// Milliseconds writes spent in the queue.
    pub write_ticks_ms: u64,
    /// Milliseconds discards spent in the queue.
    pub discard_ticks_ms: u64,
    /// Milliseconds flushes spent in the queue.
    pub flush_ticks_ms: u64,
    /// Milliseconds the device had I/O in flight.
    pub io_ticks_ms: u64,
    /// Weighted milliseconds of all requests in the queue.
    pub time_in_queue_ms: u64,
}

/// Upper bounds of the worker latency histograms, microseconds.
pub const LATENCY_BOUNDS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000,
];

/// One op's latency histogram: per-bucket counts over [`LATENCY_BOUNDS_US`]
/// (the last entry counts everything above), sum in microseconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LatencyHistogram {
    /// Requests per bucket of [`LATENCY_BOUNDS_US`], the last above them all.
    pub buckets: Vec<u64>,
    /// Their latencies added up, microseconds.
    pub sum_us: f64,
    /// Requests measured.
    pub count: u64,
}
