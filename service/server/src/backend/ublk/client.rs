//! Talking to a volume's worker on its control socket: one request, its
//! answer as the backend's error or the device as the worker describes it,
//! and the live changes recorded for a replacement worker.

use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use super::{ALLOCATE_POLL, TALK_TIMEOUT, UblkBackend, io};
use crate::backend::wire;
use crate::backend::{
    AllocateJob, Attachment, BackendError, DeviceState, MomentCopy, SnapshotDest, UblkAttachment,
};
use blockplane_api::model::{Backend, LatencyStats, NowaitStats, Percentiles, VolumeStats};
use blockplane_protocol::{
    self as protocol, Answer, ErrorCode, FillState, Peer, Request, Status, TalkError, WorkerSpec,
};
use blockplane_system::blockstat::BlockStat;

impl UblkBackend {
    pub(super) fn attachment(&self, s: &Status) -> Result<Attachment, BackendError> {
        let name = format!("ublkb{}", s.dev_id);
        let dev = std::fs::read_to_string(format!("/sys/block/{name}/dev"))
            .map_err(|e| io("read sysfs of", &s.device, e))?;
        let (major, minor) = dev
            .trim()
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| io("parse dev of", &s.device, io::Error::other(dev.clone())))?;
        // The device's size is the kernel's: without UPDATE_SIZE it keeps its
        // old size while the worker serves a grown image, and a replacement
        // worker (started with the grown size) no longer knows the resize
        // is pending: a device smaller than its worker's image says so.
        let device_size = std::fs::read_to_string(format!("/sys/block/{name}/size"))
            .ok()
            .and_then(|n| n.trim().parse::<u64>().ok())
            .map_or(s.size_bytes, |sectors| sectors * 512);
        Ok(Attachment {
            device: s.device.clone(),
            kernel_name: name,
            major,
            minor,
            dispatch: wire::active(s.dispatch),
            dispatch_reason: s.reason(),
            size_bytes: device_size,
            read_only: s.read_only,
            attached_at: OffsetDateTime::now_utc(),
            baseline: None,
            kind: DeviceState::Ublk(UblkAttachment {
                dev_id: s.dev_id,
                pid: s.pid,
                pinned: s.pinned,
                buffer_bytes: s.buffer_bytes,
                queues: (s.queues > 0).then_some(s.queues),
                zero_copy: s.zero_copy,
                degraded: s.degraded.clone(),
            }),
            resize_pending: s.resize_pending || device_size < s.size_bytes,
        })
    }

    pub(super) fn socket(&self, volume_id: Uuid) -> PathBuf {
        self.run_dir(volume_id).join("ctl.sock")
    }

    pub(super) fn ask(&self, volume_id: Uuid, req: &Request) -> Result<Status, BackendError> {
        self.ask_within(volume_id, req, TALK_TIMEOUT)
    }

    fn ask_within(
        &self,
        volume_id: Uuid,
        req: &Request,
        timeout: Duration,
    ) -> Result<Status, BackendError> {
        self.ask_with_peer_within(volume_id, req, timeout)
            .map(|(_, s)| s)
    }

    /// [`Self::ask`], and what the worker said of itself in the handshake.
    pub(super) fn ask_with_peer(
        &self,
        volume_id: Uuid,
        req: &Request,
    ) -> Result<(Peer, Status), BackendError> {
        self.ask_with_peer_within(volume_id, req, TALK_TIMEOUT)
    }

    fn ask_with_peer_within(
        &self,
        volume_id: Uuid,
        req: &Request,
        timeout: Duration,
    ) -> Result<(Peer, Status), BackendError> {
        match self.converse(volume_id, req, timeout)? {
            (peer, Answer::Status(s)) => Ok((peer, *s)),
            (_, other) => Err(unexpected(volume_id, &other)),
        }
    }

    /// One request to a worker; a refusal or failure it answers, or a
    /// socket that does not answer, as the backend's error.
    pub(super) fn talk(
        &self,
        volume_id: Uuid,
        req: &Request,
        timeout: Duration,
    ) -> Result<Answer, BackendError> {
        self.converse(volume_id, req, timeout).map(|(_, a)| a)
    }

    /// [`Self::talk`], and what the worker said of itself in the handshake.
    fn converse(
        &self,
        volume_id: Uuid,
        req: &Request,
        timeout: Duration,
    ) -> Result<(Peer, Answer), BackendError> {
        let worker = || format!("volume {volume_id}");
        match protocol::converse(&self.socket(volume_id), req, timeout) {
            Ok((_, Answer::Error { code, message })) => Err(match code {
                ErrorCode::Refused => BackendError::Refused { reason: message },
                ErrorCode::IoError | ErrorCode::BadRequest | ErrorCode::Unknown => {
                    io("worker", worker(), io::Error::other(message))
                }
            }),
            Ok(answer) => Ok(answer),
            // Never sent: the worker's version has no such request.
            Err(e @ TalkError::NotUnderstood { .. }) => Err(BackendError::Refused {
                reason: format!("volume {volume_id}: {e}"),
            }),
            Err(e) => Err(io("worker", worker(), io::Error::other(e.to_string()))),
        }
    }

    /// Asks a worker to share its image's extents with `dest` with its
    /// queues held ([`Request::Snapshot`]); how long they were held.
    pub(super) fn snapshot_worker(
        &self,
        volume_id: Uuid,
        dest: &SnapshotDest,
    ) -> Result<Duration, BackendError> {
        let req = Request::Snapshot {
            dest: dest.path.clone(),
            dev: dest.identity.0,
            ino: dest.identity.1,
        };
        // The worker may wait up to 30 s for its queues before the clone.
        match self.talk(volume_id, &req, TALK_TIMEOUT + Duration::from_secs(30))? {
            Answer::Snapshot { held_us } => Ok(Duration::from_micros(held_us)),
            other => Err(unexpected(volume_id, &other)),
        }
    }

    /// Asks a worker to begin copying one moment into `dest`
    /// ([`Request::CopyMoment`]); how long its queues were held.
    pub(super) fn begin_copy(
        &self,
        volume_id: Uuid,
        copy: &MomentCopy,
    ) -> Result<Duration, BackendError> {
        let req = Request::CopyMoment {
            dest: copy.dest.path.clone(),
            dev: copy.dest.identity.0,
            ino: copy.dest.identity.1,
            pace_ms: copy.pace.as_millis() as u64,
            gate: copy.gate.clone(),
        };
        match self.talk(volume_id, &req, TALK_TIMEOUT + Duration::from_secs(30))? {
            Answer::Snapshot { held_us } => Ok(Duration::from_micros(held_us)),
            other => Err(unexpected(volume_id, &other)),
        }
    }

    /// Follows a worker's copy of one moment until it ends
    /// ([`Status::copy`]): see [`Self::follow`].
    pub(super) fn follow_worker_copy(
        &self,
        volume_id: Uuid,
        job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        let status = self.ask(volume_id, &Request::Status {})?;
        self.follow(volume_id, job, status, Background::Copy)
    }

    /// The worker's counters and latencies in the API's shape.
    pub(super) fn worker_stats(
        &self,
        volume_id: Uuid,
        att: &Attachment,
    ) -> Result<VolumeStats, BackendError> {
        let ws = match self.talk(volume_id, &Request::Stats {}, TALK_TIMEOUT)? {
            Answer::Stats(s) => *s,
            other => return Err(unexpected(volume_id, &other)),
        };
        let p = |l: &protocol::Latency| Percentiles {
            p50: l.p50,
            p90: l.p90,
            p99: l.p99,
            p999: l.p999,
            max: l.max,
            count: l.count,
        };
        Ok(VolumeStats {
            volume_id,
            backend: Backend::Ublk,
            dispatch: att.dispatch,
            read: wire::op_stats(ws.read),
            write: wire::op_stats(ws.write),
            flush: wire::op_stats(ws.flush),
            discard: wire::op_stats(ws.discard),
            in_flight: ws.in_flight,
            since: OffsetDateTime::from_unix_timestamp_nanos(i128::from(ws.since_ms) * 1_000_000)
                .unwrap_or(att.attached_at),
            kernel: None,
            latency_us: Some(LatencyStats {
                read: p(&ws.latency[0]),
                write: p(&ws.latency[1]),
                flush: p(&ws.latency[2]),
                discard: p(&ws.latency[3]),
            }),
            nowait: Some(nowait_stats(&ws)),
            qos_throttled: Some(ws.qos_throttled),
            worker_restarts: Some(ws.worker_restarts),
            rates: None,
            page_cache: None,
            histograms: Some(ws.histograms.iter().map(wire::histogram).collect()),
        })
    }

    /// The sampler's reading: the counters from the worker's stats file
    /// (no request, so an idle worker is not woken); only when they moved
    /// since `previous`, or requests are in flight (the kernel's count, or
    /// the last reading's), the worker is asked for a full reading with its
    /// latency histograms. Unmoved counters mean unchanged histograms:
    /// those only change when a request completes, which counts.
    pub(super) fn sample_worker(
        &self,
        volume_id: Uuid,
        att: &Attachment,
        previous: Option<&VolumeStats>,
    ) -> Result<VolumeStats, BackendError> {
        let file = blockplane_protocol::read_counters(
            &self
                .run_dir(volume_id)
                .join(blockplane_protocol::STATS_FILE),
        );
        let unmoved = match (previous, &file) {
            (Some(p), Ok(f)) => {
                p.in_flight == 0 && kernel_idle(&att.kernel_name) && same_counters(p, f)
            }
            _ => false,
        };
        match previous {
            Some(p) if unmoved => Ok(VolumeStats {
                dispatch: att.dispatch,
                ..p.clone()
            }),
            _ => self.worker_stats(volume_id, att),
        }
    }

    /// A live change for a worker: asked, then recorded in the spec a
    /// replacement worker starts from, so a crash loses none of it (a
    /// volume made read-only must not come back writable, nor the reverse).
    pub(super) fn tell(&self, volume_id: Uuid, req: Request) -> Result<Status, BackendError> {
        let s = self.ask(volume_id, &req)?;
        self.record(volume_id, |spec| match req {
            Request::SetDispatch {
                dispatch,
                reason,
                why,
            } => {
                spec.dispatch = dispatch;
                spec.dispatch_reason = reason;
                spec.dispatch_why = why;
            }
            Request::SetReadOnly { read_only } => spec.refuse_writes = read_only,
            Request::SetQos { qos } => spec.qos = qos,
            Request::Resize { size_bytes, .. } => spec.size_bytes = size_bytes,
            Request::Hello(_)
            | Request::Status {}
            | Request::Stats {}
            | Request::Allocate { .. }
            | Request::CancelAllocate {}
            | Request::Snapshot { .. }
            | Request::CopyMoment { .. }
            | Request::CancelCopy {}
            | Request::Shutdown {}
            | Request::Handover { .. } => {}
        });
        Ok(s)
    }

    /// Changes the spec a replacement worker of `volume_id` would start with
    /// (so a restart keeps what the running worker was told).
    pub(super) fn record(&self, volume_id: Uuid, change: impl FnOnce(&mut WorkerSpec)) {
        if let Some(w) = self
            .workers
            .lock()
            .expect("workers poisoned")
            .get_mut(&volume_id)
        {
            change(&mut w.spec);
        }
    }

    /// Makes a worker's image `full` (a volume's own, or a dm volume's
    /// private one): starts its fill (or adopts one a restarted service left
    /// running), reports progress into `job` and asks the worker to stop when
    /// `job.cancel` is set. Returns when the fill ended: `Ok(true)` done (a
    /// replacement worker keeps the image `full`), `Ok(false)` cancelled.
    pub(super) fn fill_image(
        &self,
        volume_id: Uuid,
        job: &AllocateJob,
    ) -> Result<bool, BackendError> {
        let pace_ms = job.pace.as_millis() as u64;
        let status = self.ask(volume_id, &Request::Allocate { pace_ms })?;
        let done = self.follow(volume_id, job, status, Background::Fill)?;
        if done {
            self.record(volume_id, |spec| {
                spec.allocation = protocol::Allocation::Full
            });
        }
        Ok(done)
    }

    /// Follows a worker's fill or copy from `status` until it ends,
    /// reporting progress into `job` and asking the worker to stop when
    /// `job.cancel` is set: `Ok(true)` done, `Ok(false)` cancelled.
    fn follow(
        &self,
        volume_id: Uuid,
        job: &AllocateJob,
        mut status: Status,
        what: Background,
    ) -> Result<bool, BackendError> {
        let failed = |why: String| {
            io(
                what.op(),
                format!("volume {volume_id}"),
                io::Error::other(why),
            )
        };
        let mut cancel_sent = false;
        loop {
            let Some(p) = what.of(status) else {
                return Err(failed(what.replaced().into()));
            };
            job.done_bytes.store(p.done_bytes, Relaxed);
            job.total_bytes.store(p.total_bytes, Relaxed);
            match p.state {
                FillState::Running => {}
                FillState::Done => return Ok(true),
                FillState::Cancelled => return Ok(false),
                FillState::Failed => {
                    return Err(failed(p.error.unwrap_or_else(|| "unknown".into())));
                }
            }
            if job.cancel.load(Relaxed) && !cancel_sent {
                status = self.ask(volume_id, &what.cancel())?;
                cancel_sent = true;
                continue;
            }
            std::thread::sleep(ALLOCATE_POLL);
            status = self.ask(volume_id, &Request::Status {})?;
        }
    }
}

/// A worker's job that runs on a thread of its own, followed by its status.
#[derive(Clone, Copy)]
enum Background {
    /// [`Request::Allocate`].
    Fill,
    /// [`Request::CopyMoment`].
    Copy,
}

impl Background {
    fn op(self) -> &'static str {
        match self {
            Background::Fill => "allocate",
            Background::Copy => "copy",
        }
    }

    fn of(self, status: Status) -> Option<protocol::Fill> {
        match self {
            Background::Fill => status.allocate,
            Background::Copy => status.copy,
        }
    }

    fn cancel(self) -> Request {
        match self {
            Background::Fill => Request::CancelAllocate {},
            Background::Copy => Request::CancelCopy {},
        }
    }

    /// Why its status is gone: another worker answers.
    fn replaced(self) -> &'static str {
        match self {
            Background::Fill => "the worker was replaced while it filled the image; allocate again",
            Background::Copy => {
                "the worker was replaced while it copied the moment, so its writes no longer keep it; snapshot again"
            }
        }
    }
}

/// A worker's answer of the wrong kind for its request.
fn unexpected(volume_id: Uuid, answer: &Answer) -> BackendError {
    io(
        "worker",
        format!("volume {volume_id}"),
        io::Error::other(format!("unexpected answer {answer:?}")),
    )
}

/// Whether the kernel has no request in flight on block device `name`
/// (unknown counts as busy).
fn kernel_idle(name: &str) -> bool {
    BlockStat::read(name).is_ok_and(|s| s.in_flight == 0)
}

/// What a worker's `nowait` path did, in the API's shape.
pub(crate) fn nowait_stats(ws: &protocol::WorkerStats) -> NowaitStats {
    NowaitStats {
        submitted: ws.nowait_submitted,
        completed_inline: ws.nowait_completed_inline,
        eagain_fallbacks: ws.nowait_eagain_fallbacks,
        pauses: ws.nowait_pauses,
        bypassed: ws.nowait_bypassed,
    }
}

/// The counters of a reading are those in the stats file.
fn same_counters(s: &VolumeStats, f: &protocol::WorkerStats) -> bool {
    let nowait = s.nowait.as_ref();
    [s.read, s.write, s.flush, s.discard]
        == [f.read, f.write, f.flush, f.discard].map(wire::op_stats)
        && s.worker_restarts == Some(f.worker_restarts)
        && s.qos_throttled == Some(f.qos_throttled)
        && nowait.map(|n| (n.submitted, n.eagain_fallbacks, n.pauses, n.bypassed))
            == Some((
                f.nowait_submitted,
                f.nowait_eagain_fallbacks,
                f.nowait_pauses,
                f.nowait_bypassed,
            ))
        && nowait.map(|n| n.completed_inline) == Some(f.nowait_completed_inline)
}
