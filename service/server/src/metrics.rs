//! `GET /metrics`: Prometheus text (0.0.4) via `prometheus-client`.
//!
//! API request counts and durations are kept here as they happen. Per-volume
//! and per-image figures are a snapshot the manager gathers at scrape time
//! (from the stats sampler's cache: a scrape never waits on a device), encoded
//! by a [`Collector`].
//!
//! Counters: volume counters come from the kernel (loop, dm) or the worker's
//! mapped counters file (ublk), so they survive a control-plane restart; the
//! API request counters count this process's requests and start at zero when
//! it starts (their HELP says so).

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use blockplane_api::model::{
    LATENCY_BOUNDS_US, LatencyHistogram, PageCache, RootCapacity, VolumeStats,
};

/// Labels of the API request metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    /// The matched route template, e.g. `/v1/volumes/{id}`.
    pub route: String,
    pub method: String,
    pub status: String,
}

/// API request metrics, recorded by a middleware.
#[derive(Debug, Clone)]
pub struct ApiMetrics {
    requests: Family<ApiLabels, Counter>,
    duration: Family<ApiLabels, Histogram>,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
            }),
        }
    }
}

impl ApiMetrics {
    /// Records one answered request.
    pub fn record(&self, labels: ApiLabels, took: Duration) {
        self.requests.get_or_create(&labels).inc();
        self.duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }
}

/// One volume in a scrape.
#[derive(Debug, Clone)]
pub struct VolumeSample {
    pub name: String,
    pub backend: String,
    pub dispatch: String,
    /// The sampler's latest reading, shared (a scrape copies none).
    pub stats: std::sync::Arc<VolumeStats>,
    /// What the page cache holds of its device and image, looked at now.
    pub page_cache: Option<PageCache>,
    /// The page-cache warning is in force (see `manager::pagecache`).
    pub page_cache_warned: bool,
    /// It serves an encrypted image through dm-crypt.
    pub encrypted: bool,
}

/// The worker serving one volume in a scrape.
#[derive(Debug, Clone)]
pub struct WorkerSample {
    pub volume: String,
    pub backend: String,
    /// Its build (`unknown`: from before workers said).
    pub version: String,
    /// Another build than the service's.
    pub older: bool,
}

/// One image in a scrape.
#[derive(Debug, Clone)]
pub struct ImageSample {
    pub name: String,
    pub size_bytes: u64,
    pub allocated_bytes: u64,
}

/// Everything a scrape shows besides the API metrics.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub volumes: Vec<VolumeSample>,
    pub images: Vec<ImageSample>,
    /// Volumes per state (every state listed, zeros included).
    pub states: Vec<(String, u64)>,
    /// Each image root's filesystem.
    pub roots: Vec<RootCapacity>,
    /// The service's build (`blockplane_system::build`).
    pub build: String,
    /// The worker of each volume that has one.
    pub workers: Vec<WorkerSample>,
    /// Backups, when the service has a backup target.
    pub backups: Option<BackupSample>,
    /// The ublk worker supervisor, when the service has the ublk backend.
    pub supervisor: Option<SupervisorSample>,
    /// Exports per state (every state listed, zeros included).
    pub export_states: Vec<(String, u64)>,
    /// Hosts connected to each export, by volume: only the exports whose
    /// connected hosts the kernel says.
    pub export_hosts_connected: Vec<(String, u64)>,
    /// Remote volumes per state (every state listed, zeros included).
    pub remote_states: Vec<(String, u64)>,
    /// Each volume's latency histogram with its buckets (asked for with
    /// `?volume_histograms=true`); otherwise a volume's histogram carries
    /// only its `+Inf` bucket, sum and count.
    pub volume_histograms: bool,
}

/// What a scrape shows of the ublk worker supervisor.
#[derive(Debug, Default)]
pub struct SupervisorSample {
    /// It runs (watches every worker).
    pub running: bool,
    /// Times it stopped or could not start since the service started.
    pub restarts: u64,
    /// Workers it does not watch now although it runs.
    pub unsupervised: u64,
}

/// What a scrape shows of backups.
#[derive(Debug, Default)]
pub struct BackupSample {
    /// Seconds since each image's last backup with a manifest, by image.
    pub ages: Vec<(String, f64)>,
    /// The backup schedules.
    pub schedules: Vec<ScheduleSample>,
    /// Each standby image holding a backup: its name, seconds since the
    /// moment that backup is of, and bytes behind its source's newest.
    pub standbys: Vec<(String, f64, u64)>,
    /// Bytes this service's backups put on the target.
    pub uploaded_bytes: u64,
    /// Bytes of chunks they found on the target already.
    pub deduplicated_bytes: u64,
}

/// A backup schedule, for its gauges.
#[derive(Debug, Clone)]
pub struct ScheduleSample {
    /// Its name.
    pub name: String,
    /// Seconds since a run of it last ended with its backup done, or since
    /// it was made when none has.
    pub age_secs: f64,
    /// Seconds between two of its cron times.
    pub period_secs: u64,
    /// Runs failed since the last that succeeded.
    pub failures: u32,
    /// Whether it runs.
    pub enabled: bool,
}

const OPS: [&str; 4] = ["read", "write", "flush", "discard"];

fn labels<'a>(v: &'a VolumeSample, op: Option<&'a str>) -> Vec<(&'static str, &'a str)> {
    let mut l = vec![
        ("volume", v.name.as_str()),
        ("backend", v.backend.as_str()),
        ("dispatch", v.dispatch.as_str()),
    ];
    if let Some(op) = op {
        l.push(("op", op));
    }
    l
}

/// The latency buckets of the histograms, seconds, `+Inf` last.
fn bounds_secs() -> impl Iterator<Item = f64> {
    LATENCY_BOUNDS_US
        .iter()
        .map(|b| *b as f64 / 1e6)
        .chain(std::iter::once(f64::INFINITY))
}

/// A histogram's exposition: every bucket, or the `+Inf` one alone.
fn encode_histogram(
    mut m: prometheus_client::encoding::MetricEncoder,
    h: &LatencyHistogram,
    buckets: bool,
) -> Result<(), std::fmt::Error> {
    let all: Vec<(f64, u64)> = if buckets {
        // Per bucket: the encoder adds them up.
        bounds_secs().zip(h.buckets.iter().copied()).collect()
    } else {
        vec![(f64::INFINITY, h.count)]
    };
    m.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        h.sum_us / 1e6,
        h.count,
        &all,
        None,
    )
}

impl Snapshot {
    /// Request latency at the ublk workers: every volume's sum and count
    /// (its buckets only where asked), and the buckets of all volumes
    /// added up by backend, dispatch and op, whose size does not grow with
    /// the volumes.
    fn latency(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = enc.encode_descriptor(
            "blockplane_volume_latency_seconds",
            "Request latency at the ublk worker, since the worker started: the +Inf bucket, sum and count per volume and op (their ratio is the mean); every bucket only in a scrape of /metrics?volume_histograms=true",
            None,
            MetricType::Histogram,
        )?;
        let mut host: std::collections::BTreeMap<(&str, &str), Vec<LatencyHistogram>> =
            Default::default();
        for v in &self.volumes {
            let Some(hists) = &v.stats.histograms else {
                continue;
            };
            let sums = host
                .entry((v.backend.as_str(), v.dispatch.as_str()))
                .or_insert_with(|| vec![LatencyHistogram::default(); OPS.len()]);
            for (i, op) in OPS.iter().enumerate() {
                let Some(h) = hists.get(i) else { continue };
                let sum = &mut sums[i];
                if sum.buckets.len() < h.buckets.len() {
                    sum.buckets.resize(h.buckets.len(), 0);
                }
                for (s, b) in sum.buckets.iter_mut().zip(&h.buckets) {
                    *s += b;
                }
                sum.sum_us += h.sum_us;
                sum.count += h.count;
                let l = labels(v, Some(op));
                encode_histogram(family.encode_family(&l)?, h, self.volume_histograms)?;
            }
        }
        let mut family = enc.encode_descriptor(
            "blockplane_latency_seconds",
            "Request latency at the ublk workers, since each started: every volume's histogram added up, per backend, dispatch and op",
            None,
            MetricType::Histogram,
        )?;
        for ((backend, dispatch), hists) in &host {
            for (h, op) in hists.iter().zip(OPS) {
                let l = [("backend", *backend), ("dispatch", *dispatch), ("op", op)];
                encode_histogram(family.encode_family(&l)?, h, true)?;
            }
        }
        Ok(())
    }

    /// One metric family with a value per volume and op.
    fn per_op(
        &self,
        enc: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        kind: MetricType,
        value: impl Fn(&VolumeSample, usize) -> Option<f64>,
    ) -> Result<(), std::fmt::Error> {
        let mut family = enc.encode_descriptor(name, help, None, kind)?;
        for v in &self.volumes {
            for (i, op) in OPS.iter().enumerate() {
                if let Some(x) = value(v, i) {
                    let l = labels(v, Some(op));
                    encode_value(kind, x, family.encode_family(&l)?)?;
                }
            }
        }
        Ok(())
    }

    /// One metric family with a value per volume.
    fn per_volume(
        &self,
        enc: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        kind: MetricType,
        value: impl Fn(&VolumeSample) -> Option<f64>,
    ) -> Result<(), std::fmt::Error> {
        let mut family = enc.encode_descriptor(name, help, None, kind)?;
        for v in &self.volumes {
            if let Some(x) = value(v) {
                let l = labels(v, None);
                encode_value(kind, x, family.encode_family(&l)?)?;
            }
        }
        Ok(())
    }
}

fn encode_value(
    kind: MetricType,
    x: f64,
    m: prometheus_client::encoding::MetricEncoder,
) -> Result<(), std::fmt::Error> {
    match kind {
        MetricType::Counter => ConstCounter::new(x as u64).encode(m),
        _ => ConstGauge::new(x).encode(m),
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use MetricType::{Counter as C, Gauge as G};
        self.per_op(
            &mut enc,
            "blockplane_volume_ops",
            "Requests completed, per op",
            C,
            |v, i| Some(v.stats.ops()[i].ops as f64),
        )?;
        self.per_op(
            &mut enc,
            "blockplane_volume_bytes",
            "Bytes transferred, per op",
            C,
            |v, i| Some(v.stats.ops()[i].bytes as f64),
        )?;
        self.per_op(
            &mut enc,
            "blockplane_volume_errors",
            "Requests that failed, per op (ublk volumes: the kernel counts no errors for loop and dm)",
            C,
            |v, i| v.stats.ops()[i].errors.map(|e| e as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_in_flight",
            "Requests in flight",
            G,
            |v| Some(v.stats.in_flight as f64),
        )?;
        // Loop and dm: the kernel keeps time in queue, not a distribution.
        self.per_op(
            &mut enc,
            "blockplane_volume_kernel_avg_latency_seconds",
            "Average time a request spent in the kernel's queue since attach (loop and dm: from /sys/block/<dev>/stat ticks / completed requests; not a percentile)",
            G,
            |v, i| {
                let k = v.stats.kernel.as_ref()?;
                let ms = [k.read_ticks_ms, k.write_ticks_ms, k.flush_ticks_ms, k.discard_ticks_ms][i];
                let ops = v.stats.ops()[i].ops;
                (ops > 0).then(|| ms as f64 / 1000.0 / ops as f64)
            },
        )?;
        self.latency(&mut enc)?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_nowait_submitted",
            "Submissions with RWF_NOWAIT (ublk nowait path)",
            C,
            |v| v.stats.nowait.map(|n| n.submitted as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_nowait_eagain_fallbacks",
            "RWF_NOWAIT submissions answered EAGAIN and resubmitted blocking",
            C,
            |v| v.stats.nowait.map(|n| n.eagain_fallbacks as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_nowait_pauses",
            "Times an op type stopped asking RWF_NOWAIT (high EAGAIN share)",
            C,
            |v| v.stats.nowait.map(|n| n.pauses as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_nowait_bypassed",
            "Submissions made without RWF_NOWAIT while their op type was paused",
            C,
            |v| v.stats.nowait.map(|n| n.bypassed as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_qos_throttled",
            "Requests delayed by QoS",
            C,
            |v| v.stats.qos_throttled.map(|n| n as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_page_cache_device_bytes",
            "Bytes of the volume's block device held in the page cache (at the sampler's last look, every 10 s)",
            G,
            |v| v.page_cache?.device_bytes.map(|n| n as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_page_cache_image_bytes",
            "Bytes of the volume's image file held in the page cache (at the sampler's last look, every 10 s)",
            G,
            |v| v.page_cache?.image_bytes.map(|n| n as f64),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_page_cache_warning",
            "1 while a direct-I/O volume holds page cache above the warning threshold (the volume_page_cache event), else 0",
            G,
            |v| Some(if v.page_cache_warned { 1.0 } else { 0.0 }),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_encrypted",
            "1 when the volume serves an encrypted image (LUKS2) through dm-crypt, else 0",
            G,
            |v| Some(if v.encrypted { 1.0 } else { 0.0 }),
        )?;
        self.per_volume(
            &mut enc,
            "blockplane_volume_worker_restarts",
            "ublk workers replaced after a crash",
            C,
            |v| v.stats.worker_restarts.map(|n| n as f64),
        )?;
        {
            let family = enc.encode_descriptor(
                "blockplane_worker_restarts",
                "ublk workers replaced after a crash, all volumes",
                None,
                C,
            )?;
            let total: u64 = self
                .volumes
                .iter()
                .filter_map(|v| v.stats.worker_restarts)
                .sum();
            ConstCounter::new(total).encode(family)?;
        }
        for (name, help, get) in [
            (
                "blockplane_image_size_bytes",
                "Image file size",
                (|i: &ImageSample| i.size_bytes) as fn(&ImageSample) -> u64,
            ),
            (
                "blockplane_image_allocated_bytes",
                "Bytes the filesystem allocated to the image",
                |i: &ImageSample| i.allocated_bytes,
            ),
        ] {
            let mut family = enc.encode_descriptor(name, help, None, G)?;
            for i in &self.images {
                ConstGauge::new(get(i) as f64)
                    .encode(family.encode_family(&[("image", i.name.as_str())])?)?;
            }
        }
        for (name, help, get) in [
            (
                "blockplane_image_root_size_bytes",
                "Size of an image root's filesystem",
                (|r: &RootCapacity| r.size_bytes) as fn(&RootCapacity) -> u64,
            ),
            (
                "blockplane_image_root_free_bytes",
                "Free bytes of an image root's filesystem (as df's Avail)",
                |r: &RootCapacity| r.free_bytes,
            ),
            (
                "blockplane_image_root_provisioned_bytes",
                "Sizes of the images under an image root, added up",
                |r: &RootCapacity| r.provisioned_bytes,
            ),
        ] {
            let mut family = enc.encode_descriptor(name, help, None, G)?;
            for r in &self.roots {
                ConstGauge::new(get(r) as f64)
                    .encode(family.encode_family(&[("root", r.path.as_str())])?)?;
            }
        }
        let mut family = enc.encode_descriptor(
            "blockplane_build_info",
            "The build this service runs (version: crate version + build identity), always 1",
            None,
            G,
        )?;
        ConstGauge::new(1.0).encode(family.encode_family(&[("version", self.build.as_str())])?)?;
        let mut family = enc.encode_descriptor(
            "blockplane_worker_info",
            "The build of the worker serving each ublk volume and dm volume on nowait/threaded, always 1; older=\"true\" when it is another build than the service's (blockplane upgrade moves it)",
            None,
            G,
        )?;
        for w in &self.workers {
            let older = if w.older { "true" } else { "false" };
            ConstGauge::new(1.0).encode(family.encode_family(&[
                ("volume", w.volume.as_str()),
                ("backend", w.backend.as_str()),
                ("version", w.version.as_str()),
                ("older", older),
            ])?)?;
        }
        if let Some(b) = &self.backups {
            let mut family = enc.encode_descriptor(
                "blockplane_image_last_backup_age_seconds",
                "Seconds since the image's last backup with a manifest on the backup target (images never backed up are absent)",
                None,
                G,
            )?;
            for (image, age) in &b.ages {
                ConstGauge::new(*age)
                    .encode(family.encode_family(&[("image", image.as_str())])?)?;
            }
            let mut family = enc.encode_descriptor(
                "blockplane_standby_lag_seconds",
                "Seconds since the moment of the backup a standby image holds: the data an activation now would lose",
                None,
                G,
            )?;
            for (image, lag, _) in &b.standbys {
                ConstGauge::new(*lag)
                    .encode(family.encode_family(&[("image", image.as_str())])?)?;
            }
            let mut family = enc.encode_descriptor(
                "blockplane_standby_behind_bytes",
                "Bytes of chunks the newest backup of a standby image's source has and the backup it holds lacks, at its last check",
                None,
                G,
            )?;
            for (image, _, behind) in &b.standbys {
                ConstGauge::new(*behind as i64)
                    .encode(family.encode_family(&[("image", image.as_str())])?)?;
            }
            let mut family = enc.encode_descriptor(
                "blockplane_backup_schedule_last_success_age_seconds",
                "Seconds since a run of the backup schedule last ended with its backup done, or since it was made when none has",
                None,
                G,
            )?;
            for s in &b.schedules {
                ConstGauge::new(s.age_secs)
                    .encode(family.encode_family(&[("schedule", s.name.as_str())])?)?;
            }
            let mut family = enc.encode_descriptor(
                "blockplane_backup_schedule_period_seconds",
                "Seconds between two of the backup schedule's cron times (0 while it is paused)",
                None,
                G,
            )?;
            for s in &b.schedules {
                let period = if s.enabled { s.period_secs as f64 } else { 0.0 };
                ConstGauge::new(period)
                    .encode(family.encode_family(&[("schedule", s.name.as_str())])?)?;
            }
            let mut family = enc.encode_descriptor(
                "blockplane_backup_schedule_consecutive_failures",
                "Runs of the backup schedule that failed since the last that succeeded",
                None,
                G,
            )?;
            for s in &b.schedules {
                ConstGauge::new(f64::from(s.failures))
                    .encode(family.encode_family(&[("schedule", s.name.as_str())])?)?;
            }
            for (name, help, x) in [
                (
                    "blockplane_backup_uploaded_bytes",
                    "Bytes this service's backups put on the backup target (since it started)",
                    b.uploaded_bytes,
                ),
                (
                    "blockplane_backup_deduplicated_bytes",
                    "Bytes of chunks this service's backups found on the target already, not put again (since it started)",
                    b.deduplicated_bytes,
                ),
            ] {
                ConstCounter::new(x).encode(enc.encode_descriptor(name, help, None, C)?)?;
            }
        }
        if let Some(sup) = &self.supervisor {
            ConstGauge::new(if sup.running { 1.0 } else { 0.0 }).encode(enc.encode_descriptor(
                "blockplane_worker_supervisor_running",
                "Whether the supervisor of ublk workers runs (1) or is restarting (0): while it does not, a worker that dies is not recovered (GET /v1/host says why)",
                None,
                G,
            )?)?;
            ConstCounter::new(sup.restarts).encode(enc.encode_descriptor(
                "blockplane_worker_supervisor_restarts",
                "Times the supervisor of ublk workers stopped or could not start (since this service process started)",
                None,
                C,
            )?)?;
            ConstGauge::new(sup.unsupervised as f64).encode(enc.encode_descriptor(
                "blockplane_workers_unsupervised",
                "ublk workers the running supervisor does not watch now (a pidfd it could not open, a recovery that could not start: each retried; the volume's state_reason says why)",
                None,
                G,
            )?)?;
        }
        for (name, help, counts) in [
            ("blockplane_volumes", "Volumes per state", &self.states),
            (
                "blockplane_exports",
                "Volumes exported over NVMe/TCP, per export state (serving, waiting: the volume has no device now, error: the kernel's target refused it)",
                &self.export_states,
            ),
            (
                "blockplane_remote_volumes",
                "Remote volumes (other hosts' exports connected here over NVMe/TCP), per state (connecting, attached, reconnecting: I/O waits, error: the connection is gone, moved: its data moved here)",
                &self.remote_states,
            ),
        ] {
            let mut family = enc.encode_descriptor(name, help, None, G)?;
            for (state, n) in counts {
                ConstGauge::new(*n as f64)
                    .encode(family.encode_family(&[("state", state.as_str())])?)?;
            }
        }
        let mut family = enc.encode_descriptor(
            "blockplane_export_hosts_connected",
            "Hosts connected now to a volume's export, as the kernel's NVMe target says; no sample where it cannot say (a kernel without nvmet's debugfs, or debugfs not mounted) nor for an export without authentication (its hosts are not listed)",
            None,
            G,
        )?;
        for (volume, n) in &self.export_hosts_connected {
            ConstGauge::new(*n as f64)
                .encode(family.encode_family(&[("volume", volume.as_str())])?)?;
        }
        Ok(())
    }
}

/// The exposition text of one scrape.
pub fn render(api: &ApiMetrics, snapshot: Snapshot) -> String {
    let mut registry = Registry::default();
    registry.register(
        "blockplane_api_requests",
        "API requests answered, by route, method and status (since this service process started)",
        api.requests.clone(),
    );
    registry.register(
        "blockplane_api_request_duration_seconds",
        "API request durations (since this service process started)",
        api.duration.clone(),
    );
    registry.register_collector(Box::new(snapshot));
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        .expect("encoding to a String");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exports and remote volumes: a count per state, zeros included, and
    /// connected hosts only for the exports whose hosts the kernel says.
    #[test]
    fn exports_and_remote_volumes_are_counted_by_state() {
        let states = |names: &[(&str, u64)]| {
            names
                .iter()
                .map(|(s, n)| (s.to_string(), *n))
                .collect::<Vec<_>>()
        };
        let text = render(
            &ApiMetrics::default(),
            Snapshot {
                export_states: states(&[("serving", 2), ("waiting", 0), ("error", 1)]),
                export_hosts_connected: vec![("v1".into(), 1)],
                remote_states: states(&[("attached", 1), ("error", 0)]),
                ..Default::default()
            },
        );
        for line in [
            "# TYPE blockplane_exports gauge",
            "blockplane_exports{state=\"serving\"} 2.0",
            "blockplane_exports{state=\"waiting\"} 0.0",
            "blockplane_exports{state=\"error\"} 1.0",
            "blockplane_export_hosts_connected{volume=\"v1\"} 1.0",
            "# TYPE blockplane_remote_volumes gauge",
            "blockplane_remote_volumes{state=\"attached\"} 1.0",
            "blockplane_remote_volumes{state=\"error\"} 0.0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        let samples = text
            .lines()
            .filter(|l| l.starts_with("blockplane_export_hosts_connected{"))
            .count();
        assert_eq!(samples, 1, "{text}");
    }

    /// A volume as the sampler reads one of `backend`: busy on every op,
    /// with every counter its backend has; named as the scale benchmark
    /// names them (`vol1`...), or as long as the CSI driver's names.
    fn volume_named(i: usize, backend: &str, long: bool) -> VolumeSample {
        use blockplane_api::model::{
            ActiveDispatch, Backend, KernelBlockStats, NowaitStats, OpStats,
        };
        let ublk = backend == "ublk";
        // ublk, and dm off direct: a worker's counters.
        let worker = backend != "loop";
        let op = OpStats {
            ops: 123_456_789,
            bytes: 123_456_789 * 4096,
            errors: ublk.then_some(0),
        };
        let hist = LatencyHistogram {
            buckets: (0..=LATENCY_BOUNDS_US.len() as u64)
                .map(|b| b * 1000)
                .collect(),
            sum_us: 1.5e9,
            count: 136_000,
        };
        VolumeSample {
            name: if long {
                format!("pvc-{i:08}-0000-4000-8000-000000000000")
            } else {
                format!("vol{}", i + 1)
            },
            backend: backend.into(),
            dispatch: if worker { "nowait" } else { "kernel" }.into(),
            stats: std::sync::Arc::new(VolumeStats {
                volume_id: uuid::Uuid::nil(),
                backend: match backend {
                    "ublk" => Backend::Ublk,
                    "dm" => Backend::Dm,
                    _ => Backend::Loop,
                },
                dispatch: if worker {
                    ActiveDispatch::Nowait
                } else {
                    ActiveDispatch::Kernel
                },
                read: op,
                write: op,
                flush: op,
                discard: op,
                in_flight: 3,
                since: time::OffsetDateTime::UNIX_EPOCH,
                kernel: (!ublk).then(|| KernelBlockStats {
                    read_ticks_ms: 1_000_000,
                    write_ticks_ms: 1_000_000,
                    flush_ticks_ms: 1_000_000,
                    discard_ticks_ms: 1_000_000,
                    ..Default::default()
                }),
                latency_us: None,
                nowait: worker.then(|| NowaitStats {
                    submitted: 123_456_789,
                    ..Default::default()
                }),
                qos_throttled: worker.then_some(0),
                worker_restarts: worker.then_some(0),
                rates: None,
                page_cache: None,
                histograms: ublk.then(|| vec![hist; 4]),
            }),
            page_cache: Some(PageCache {
                device_bytes: Some(4096),
                image_bytes: Some(1 << 30),
            }),
            page_cache_warned: false,
            encrypted: false,
        }
    }

    fn volume(i: usize, backend: &str) -> VolumeSample {
        volume_named(i, backend, false)
    }

    fn scrape(n: usize, backend: &str, volume_histograms: bool) -> String {
        scrape_named(n, backend, volume_histograms, false)
    }

    fn scrape_named(n: usize, backend: &str, volume_histograms: bool, long: bool) -> String {
        render(
            &ApiMetrics::default(),
            Snapshot {
                volumes: (0..n).map(|i| volume_named(i, backend, long)).collect(),
                workers: (0..n)
                    .filter(|_| backend != "loop")
                    .map(|i| WorkerSample {
                        volume: volume_named(i, backend, long).name,
                        backend: backend.into(),
                        version: "0.1.0+0123456789ab".into(),
                        older: false,
                    })
                    .collect(),
                volume_histograms,
                ..Default::default()
            },
        )
    }

    /// A thousand busy volumes named as the scale benchmark names them make
    /// a scrape of at most 2 MB (loop), 2.5 MB (dm on `nowait`) or 4 MB
    /// (ublk): a volume's latency histogram
    /// carries its buckets only where asked, and the host's histogram has
    /// them all added up. (Names as long as the CSI driver's add about 30
    /// bytes to each of a volume's lines.)
    #[test]
    fn a_scrape_of_a_thousand_volumes_stays_small() {
        for backend in ["loop", "dm", "ublk"] {
            for (long, asked) in [(false, false), (true, false), (false, true)] {
                let base = scrape_named(0, backend, asked, long).len();
                let one = scrape_named(1, backend, asked, long).len() - base;
                let took = std::time::Instant::now();
                let text = scrape_named(1000, backend, asked, long);
                // Made and rendered; a figure, not a check (build and host vary).
                let took = took.elapsed();
                eprintln!(
                    "{backend} (long names: {long}, volume_histograms: {asked}): {} bytes at 1000 volumes in {took:.1?}, {one} bytes for the first volume",
                    text.len()
                );
                // ublk volumes keep more counters (errors, NOWAIT, QoS,
                // restarts, the worker's build) and their latency's sum and
                // count: under 4 MB, from 11.2 MB with every bucket.
                // dm off direct keeps the worker's counters too, and no
                // latency: 2.5 MB.
                let most = match backend {
                    "ublk" => 4_000_000,
                    "dm" => 2_500_000,
                    _ => 2_000_000,
                };
                if !long && !asked {
                    assert!(text.len() <= most, "{backend}: {} bytes", text.len());
                }
            }
        }
        let text = scrape(2, "ublk", false);
        let name = volume(0, "ublk").name;
        let read = format!("volume=\"{name}\",backend=\"ublk\",dispatch=\"nowait\",op=\"read\"");
        for line in [
            format!("blockplane_volume_latency_seconds_sum{{{read}}} 1500.0"),
            format!("blockplane_volume_latency_seconds_count{{{read}}} 136000"),
            format!("blockplane_volume_latency_seconds_bucket{{{read},le=\"+Inf\"}} 136000"),
            // Two volumes' buckets added up: 2 * (0 + 1000) by 100 us.
            "blockplane_latency_seconds_bucket{backend=\"ublk\",dispatch=\"nowait\",op=\"read\",le=\"0.0001\"} 2000".into(),
            "blockplane_latency_seconds_count{backend=\"ublk\",dispatch=\"nowait\",op=\"write\"} 272000".into(),
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        let buckets = |t: &str| {
            t.lines()
                .filter(|l| l.starts_with("blockplane_volume_latency_seconds_bucket{"))
                .count()
        };
        assert_eq!(buckets(&text), 2 * 4, "{text}");
        let asked = scrape(2, "ublk", true);
        assert_eq!(
            buckets(&asked),
            2 * 4 * (LATENCY_BOUNDS_US.len() + 1),
            "{asked}"
        );
    }
}
