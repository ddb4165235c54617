//! The API's data model: request and response bodies of `/v1`, shared by the
//! server, the CLI and the tests. Nothing here does I/O.

use serde::{Deserialize, Deserializer, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;
use uuid::Uuid;

/// How the bytes of a newly created image file are laid out on disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Allocation {
    /// `ftruncate` only: blocks are allocated on first write. Volumes on the
    /// file paths (`nowait`, `threaded`) punch holes for DISCARD and zero
    /// ranges for WRITE_ZEROES, giving the space back.
    #[default]
    Sparse,
    /// `fallocate` plus zeros written, so no extent stays unwritten (direct-map
    /// ready). Kept so under every policy: DISCARD leaves the blocks allocated
    /// and WRITE_ZEROES writes zeros, so the image stays eligible for `direct`.
    Full,
}

/// `POST /v1/images`: register an existing file, or create one when `create` is given.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateImageRequest {
    /// `[a-z0-9][a-z0-9._-]{0,62}`
    #[schema(
        pattern = "^[a-z0-9][a-z0-9._-]{0,62}$",
        min_length = 1,
        max_length = 63
    )]
    pub name: String,
    /// Absolute path under one of the service's image roots: no NUL, at most
    /// 4095 bytes, each file name at most 255 bytes (UTF-8 bytes, where the
    /// length bounds here count characters).
    #[schema(pattern = "^/[^\\x00]*$", min_length = 1, max_length = 4095)]
    pub path: String,
    /// Create the file instead of registering an existing one.
    #[serde(default)]
    pub create: Option<CreateImageFile>,
    /// Make the file a writable clone of this image (id or name): its
    /// extents shared (`reflink`) where the filesystem can, else copied in
    /// the background (202, state `copying`). With `create`, the clone is
    /// then grown to its `size_bytes` (not below the source's size: 422
    /// `shrink_refused`), the new range laid out as its `allocation`.
    #[serde(default)]
    pub clone_from: Option<String>,
}

/// `POST /v1/images/{id}/snapshots`: a read-only copy of an image, next to it.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    /// The snapshot's image name, also its file's name in the source's
    /// directory: `[a-z0-9][a-z0-9._-]{0,62}`
    #[schema(
        pattern = "^[a-z0-9][a-z0-9._-]{0,62}$",
        min_length = 1,
        max_length = 63
    )]
    pub name: String,
}

/// `GET /v1/images` filters.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListImagesQuery {
    /// Only the snapshots of this image (id or name).
    #[serde(default)]
    pub snapshot_of: Option<String>,
}

/// How a snapshot's or clone's bytes were made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CopyMethod {
    /// `FICLONE`: the file shares the source's extents (xfs with reflink,
    /// btrfs); instant, and the blocks are copied only when one side writes.
    Reflink,
    /// `copy_file_range` of the source's data, in the background.
    Copy,
}

/// Whether an image's file is complete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImageState {
    /// Complete: volumes may use it.
    #[default]
    Ready,
    /// A background copy is filling it (`copied_bytes` of
    /// `copy_total_bytes`); volumes are refused until it is `ready`.
    Copying,
    /// The copy did not finish (`state_reason` says why); the partial file
    /// was removed. Delete the image and snapshot or clone again.
    Failed,
}

/// Size and layout of an image file to create.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateImageFile {
    /// Size in bytes: a positive multiple of 512, at most 1 PiB.
    #[schema(minimum = 512, maximum = 1125899906842624_u64, multiple_of = 512)]
    pub size_bytes: u64,
    /// Defaults to `sparse`.
    #[serde(default = "default_allocation")]
    pub allocation: Allocation,
}

fn default_allocation() -> Allocation {
    Allocation::Sparse
}

/// An image: a regular file under an image root that volumes are served from.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Image {
    pub id: Uuid,
    pub name: String,
    pub path: String,
    pub size_bytes: u64,
    /// Bytes the filesystem has allocated to the file (`st_blocks * 512`).
    pub allocated_bytes: u64,
    /// The filesystem the file lives on, from `statfs` (e.g. `ext4`, `xfs`).
    pub filesystem: String,
    /// How blockplane created the file; `null` for registered files.
    pub allocation: Option<Allocation>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    /// Ids of the volumes that use this image.
    pub volumes: Vec<Uuid>,
    /// The last `POST /v1/images/{id}/allocate` since the service started:
    /// running with its progress, or how it ended; `null` when there was none.
    #[serde(default)]
    pub allocate: Option<ImageAllocate>,
    /// `copying` while a background copy fills it, `failed` if that did
    /// not finish; `ready` otherwise.
    #[serde(default)]
    pub state: ImageState,
    /// Why it is `failed`.
    #[serde(default)]
    pub state_reason: Option<String>,
    /// Id of the image this is a read-only snapshot of.
    #[serde(default)]
    pub snapshot_of: Option<Uuid>,
    /// Id of the image this is a writable clone of.
    #[serde(default)]
    pub cloned_from: Option<Uuid>,
    /// Volumes on it must be read-only (a snapshot); it cannot grow or be
    /// allocated.
    #[serde(default)]
    pub read_only: bool,
    /// How a snapshot's or clone's bytes were made; `null` for others.
    #[serde(default)]
    pub method: Option<CopyMethod>,
    /// Bytes copied so far while `copying` (`null` otherwise).
    #[serde(default)]
    pub copied_bytes: Option<u64>,
    /// Bytes of data the copy has to copy, while `copying`.
    #[serde(default)]
    pub copy_total_bytes: Option<u64>,
    /// What the create or grow that answered this should make you check,
    /// e.g. a sparse image larger than its root's free space (empty
    /// otherwise).
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// An image's allocate (`POST /v1/images/{id}/allocate`), running or ended.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ImageAllocate {
    pub state: AllocateState,
    /// Bytes of holes and unwritten extents written with zeros so far.
    pub done_bytes: u64,
    /// Bytes of holes and unwritten extents it found to write.
    pub total_bytes: u64,
    /// Why it failed (`failed` only).
    pub error: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub started_at: OffsetDateTime,
}

/// Where an allocate is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AllocateState {
    /// Writing zeros; `GET /v1/images/{id}` shows the progress.
    Running,
    /// Done: the image is `full` and passes direct-map rule 2.
    Done,
    /// Stopped by an error; the image keeps its allocation as declared
    /// (allocate again).
    Failed,
    /// Stopped by `DELETE /v1/images/{id}/allocate` (or the service's stop);
    /// the image keeps its allocation as declared (allocate again).
    Cancelled,
}

/// `POST /v1/images/{id}/resize`: grow an image (attached volumes follow).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeImageRequest {
    /// New size in bytes: a multiple of 512, at most 1 PiB, not smaller than
    /// the current size.
    #[schema(minimum = 512, maximum = 1125899906842624_u64, multiple_of = 512)]
    pub size_bytes: u64,
}

/// What `POST /v1/images/{id}/resize` did.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ResizeImageResponse {
    pub image: Image,
    /// How each attached volume followed.
    pub volumes: Vec<VolumeResize>,
}

/// How one attached volume followed an image's growth.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct VolumeResize {
    pub volume_id: Uuid,
    pub name: String,
    /// The device's size now.
    pub size_bytes: u64,
    /// The device keeps its old size until the next attach.
    pub resize_pending: bool,
    pub message: String,
}

/// Query of `DELETE /v1/images/{id}`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteImageQuery {
    /// Also unlink the file (default false: only forget the registration).
    #[serde(default)]
    pub delete_file: bool,
}

/// The kernel mechanism that exposes a volume as a block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The kernel loop driver.
    Loop,
    /// A ublk device served by a blockplane worker.
    Ublk,
    /// A device-mapper device whose table is the data path.
    Dm,
}

impl Backend {
    /// Every backend, in order of preference for `backend: auto`.
    pub const PREFERENCE: [Backend; 3] = [Backend::Ublk, Backend::Dm, Backend::Loop];

    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Loop => "loop",
            Backend::Ublk => "ublk",
            Backend::Dm => "dm",
        }
    }
}

/// The backend asked for at create time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// The best backend this host supports.
    Auto,
    Loop,
    Ublk,
    Dm,
}

/// How a ublk or dm volume's I/O reaches its image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DispatchPolicy {
    /// `direct` when the image passes every direct-map rule, else `nowait`.
    Auto,
    /// io_uring with `RWF_NOWAIT`, falling back to a blocking path on `EAGAIN`.
    Nowait,
    /// A pool of worker threads doing blocking syscalls, one work item per command.
    Threaded,
    /// The image's extent map, straight to the underlying disk.
    Direct,
}

impl DispatchPolicy {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DispatchPolicy::Auto => "auto",
            DispatchPolicy::Nowait => "nowait",
            DispatchPolicy::Threaded => "threaded",
            DispatchPolicy::Direct => "direct",
        }
    }
}

/// The data path a volume runs on now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActiveDispatch {
    Nowait,
    Threaded,
    Direct,
    /// The kernel's own path (loop volumes): see `direct_io`.
    Kernel,
}

impl ActiveDispatch {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ActiveDispatch::Nowait => "nowait",
            ActiveDispatch::Threaded => "threaded",
            ActiveDispatch::Direct => "direct",
            ActiveDispatch::Kernel => "kernel",
        }
    }
}

/// Per-volume I/O limits (token buckets; reads and writes together). `null`
/// fields are unlimited; a limit is 1 to 2^53 - 1 ([`MAX_QOS`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Qos {
    #[serde(default)]
    #[schema(minimum = 1, maximum = 9007199254740991_u64)]
    pub iops: Option<u64>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 9007199254740991_u64)]
    pub bytes_per_sec: Option<u64>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 9007199254740991_u64)]
    pub burst_iops: Option<u64>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 9007199254740991_u64)]
    pub burst_bytes: Option<u64>,
}

/// The largest QoS limit: 2^53 - 1, the largest integer every JSON parser
/// carries exactly (RFC 8259 section 6), and the buckets count in `f64`.
pub const MAX_QOS: u64 = (1 << 53) - 1;

/// `POST /v1/volumes`. Create is idempotent by name: the same spec again returns the
/// existing volume (200), a different spec is a conflict (409).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// `[a-z0-9][a-z0-9._-]{0,62}`
    #[schema(
        pattern = "^[a-z0-9][a-z0-9._-]{0,62}$",
        min_length = 1,
        max_length = 63
    )]
    pub name: String,
    /// Image id or name.
    pub image: String,
    #[serde(default = "default_backend")]
    pub backend: BackendChoice,
    #[serde(default = "default_dispatch")]
    pub dispatch: DispatchPolicy,
    #[serde(default)]
    pub read_only: bool,
    /// Hardware queues of the block device, each served by its own thread.
    /// Omitted: one per online CPU (at most 8, or the service's `--queues`)
    /// for ublk and dm, 1 for loop.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 64)]
    pub queues: Option<u16>,
    /// Depth of each queue.
    #[serde(default = "default_queue_depth")]
    #[schema(minimum = 1, maximum = 4096)]
    pub queue_depth: u16,
    /// Largest request the device accepts, bytes: one of
    /// [`MAX_IO_BYTES_CHOICES`] (described in `max_io_bytes_schema`).
    #[serde(default = "default_max_io_bytes")]
    #[schema(schema_with = max_io_bytes_schema)]
    pub max_io_bytes: u32,
    #[serde(default)]
    pub qos: Option<Qos>,
}

impl CreateVolumeRequest {
    /// The queue count of a recorded volume (recorded specs always carry one).
    pub fn queue_count(&self) -> u16 {
        self.queues.unwrap_or(1)
    }
}

fn default_backend() -> BackendChoice {
    BackendChoice::Auto
}
fn default_dispatch() -> DispatchPolicy {
    DispatchPolicy::Auto
}
/// Default depth of each queue of a volume.
pub const DEFAULT_QUEUE_DEPTH: u16 = 128;
/// Default largest request of a volume, bytes.
pub const DEFAULT_MAX_IO_BYTES: u32 = 256 << 10;
fn default_max_io_bytes() -> u32 {
    DEFAULT_MAX_IO_BYTES
}
fn default_queue_depth() -> u16 {
    DEFAULT_QUEUE_DEPTH
}

/// The values `max_io_bytes` may take: the powers of two from 4 KiB to 1 MiB.
pub const MAX_IO_BYTES_CHOICES: [u32; 9] = [
    4 << 10,
    8 << 10,
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
];

/// `max_io_bytes` as an enumeration: "a power of two" has no JSON Schema
/// keyword, and nine values say it exactly.
fn max_io_bytes_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .description(Some(
            "Largest request the device accepts, bytes: a power of two from 4 KiB to \
             1 MiB. Each queue holds depth x this much of I/O buffers.",
        ))
        .enum_values(Some(MAX_IO_BYTES_CHOICES))
        .default(Some(DEFAULT_MAX_IO_BYTES.into()))
        .build()
}

/// How a ublk worker gets at a request's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CopyMode {
    /// Copied between the request and the worker's buffer.
    Copy,
    /// The request's pages, registered on the queue's ring by the kernel.
    ZeroCopy,
}

/// Life-cycle state of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    /// Recorded; the device is being set up.
    Attaching,
    /// The device serves I/O.
    Attached,
    /// The device serves I/O, but not as asked (see `state_reason`).
    Degraded,
    /// The device is being torn down.
    Detaching,
    /// No device; `state_reason` says why.
    Error,
}

impl VolumeState {
    /// The API spelling (also the stored form).
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Attaching => "attaching",
            VolumeState::Attached => "attached",
            VolumeState::Degraded => "degraded",
            VolumeState::Detaching => "detaching",
            VolumeState::Error => "error",
        }
    }
}

/// A volume: one kernel block device serving one image.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Volume {
    pub id: Uuid,
    pub name: String,
    pub image_id: Uuid,
    pub backend: Backend,
    /// The data path in effect now.
    pub dispatch: ActiveDispatch,
    /// The policy asked for (create or last PATCH).
    pub requested_dispatch: DispatchPolicy,
    /// Why `dispatch` is what it is.
    pub dispatch_reason: String,
    pub state: VolumeState,
    /// Why the volume is in its state, when that needs saying (`degraded`, `error`).
    pub state_reason: Option<String>,
    /// Device node, e.g. `/dev/loop3`; `null` while there is none.
    pub device: Option<String>,
    pub size_bytes: u64,
    pub read_only: bool,
    pub queues: u16,
    pub queue_depth: u16,
    pub max_io_bytes: u32,
    pub qos: Option<Qos>,
    /// Loop volumes: whether the kernel loop driver does direct I/O on the image.
    pub direct_io: Option<bool>,
    /// ublk volumes: bytes of I/O buffers the worker holds (queues x depth x
    /// max_io_bytes in copy mode, 0 with zero copy).
    pub buffer_bytes: Option<u64>,
    /// ublk volumes: whether the worker copies each request's data through
    /// its own buffers (`copy`) or uses the request's pages in place
    /// (`zero_copy`, where the kernel has UBLK_F_AUTO_BUF_REG).
    pub copy_mode: Option<CopyMode>,
    /// ublk volumes: the worker process serving the device.
    pub worker_pid: Option<u32>,
    /// The image grew, but the kernel could not resize the device live
    /// (ublk without UPDATE_SIZE): the new size applies at the next attach.
    pub resize_pending: bool,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: OffsetDateTime,
}

/// `PATCH /v1/volumes/{id}`: live changes. Absent fields stay as they are.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchVolumeRequest {
    #[serde(default)]
    pub dispatch: Option<DispatchPolicy>,
    /// An object sets limits, `null` removes them.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<Qos>)]
    pub qos: Option<Option<Qos>>,
    #[serde(default)]
    pub read_only: Option<bool>,
}

/// Tells a present `null` (`Some(None)`) from an absent field (`None`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// Counters of one kind of request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
pub struct OpStats {
    pub ops: u64,
    pub bytes: u64,
    /// `null` where the backend cannot count errors (the kernel's block statistics do not).
    pub errors: Option<u64>,
}

/// `GET /v1/volumes/{id}/stats`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct VolumeStats {
    pub volume_id: Uuid,
    pub backend: Backend,
    pub dispatch: ActiveDispatch,
    pub read: OpStats,
    pub write: OpStats,
    pub flush: OpStats,
    pub discard: OpStats,
    /// Requests issued to the device and not yet completed.
    pub in_flight: u64,
    /// When these counters started counting.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub since: OffsetDateTime,
    /// Loop and dm volumes: the kernel's block-layer statistics, as read.
    pub kernel: Option<KernelBlockStats>,
    /// ublk volumes: latency per op, from the worker's histograms (since the
    /// worker started).
    pub latency_us: Option<LatencyStats>,
    /// ublk volumes: what the `nowait` path did.
    pub nowait: Option<NowaitStats>,
    /// ublk volumes: requests delayed by QoS.
    pub qos_throttled: Option<u64>,
    /// ublk volumes: workers replaced after a crash.
    pub worker_restarts: Option<u64>,
    /// Rates over the last 1, 10 and 60 seconds (from the service's 1 s
    /// sampler; `null` until it has two samples of the volume).
    pub rates: Option<Rates>,
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

/// Requests and bytes per second of one op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct Rate {
    pub iops: f64,
    pub bytes_per_sec: f64,
}

/// Rates of each op over one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct OpRates {
    pub read: Rate,
    pub write: Rate,
    pub flush: Rate,
    pub discard: Rate,
    /// The window actually covered, seconds (shorter while the sampler warms up).
    pub window_secs: f64,
}

/// Rates over the last 1, 10 and 60 seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct Rates {
    pub last_1s: OpRates,
    pub last_10s: OpRates,
    pub last_60s: OpRates,
}

/// Seconds of history the service keeps per attached volume (one sample a
/// second, from attach or service start, whichever is later).
pub const HISTORY_SECS: u32 = 900;

/// Query of `GET /v1/volumes/{id}/stats/history`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StatsHistoryQuery {
    /// The last this many seconds (default 300, at most 900).
    #[param(minimum = 1, maximum = 900)]
    pub seconds: Option<u32>,
}

/// One op over one interval of a volume's history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct OpPoint {
    pub iops: f64,
    pub bytes_per_sec: f64,
    /// Mean time of the requests completed in the interval, microseconds:
    /// the worker's own timing (ublk) or the kernel's time in queue (loop,
    /// dm); `null` when none completed.
    pub latency_us: Option<f64>,
}

/// One interval (about a second) of a volume's history.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct HistoryPoint {
    /// The end of the interval.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub at: OffsetDateTime,
    /// Length of the interval, seconds.
    pub secs: f64,
    pub read: OpPoint,
    pub write: OpPoint,
    pub flush: OpPoint,
    pub discard: OpPoint,
    /// Requests in flight at the end of the interval.
    pub in_flight: u64,
}

/// `GET /v1/volumes/{id}/stats/history`: the volume's last seconds, oldest
/// first, from the service's 1 s sampler.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct StatsHistory {
    pub volume_id: Uuid,
    pub name: String,
    /// Seconds the service keeps (the most `seconds` can ask for).
    pub kept_secs: u32,
    /// Empty until the sampler has two readings of an attached volume.
    pub points: Vec<HistoryPoint>,
}

/// A process that holds a volume's device open.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
pub struct DeviceOpener {
    pub pid: u32,
    /// The process's command name (`/proc/PID/comm`).
    pub command: String,
}

/// `GET /v1/volumes/{id}/usage`: whether a volume is in use now and by
/// what, so that a delete can say so and ask for more than a click.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct VolumeUsage {
    pub volume_id: Uuid,
    pub name: String,
    pub device: Option<String>,
    /// Open by a process, mounted, with requests in flight, or with I/O in
    /// the last `recent_secs` seconds.
    pub busy: bool,
    /// Processes holding the device open, from `/proc/*/fd` (the service's
    /// own ublk worker is not listed).
    pub openers: Vec<DeviceOpener>,
    /// Where the device is mounted, in the service's mount namespace.
    pub mounts: Vec<String>,
    /// Seconds of history `iops` and `bytes_per_sec` are the mean of.
    pub recent_secs: u32,
    pub iops: f64,
    pub bytes_per_sec: f64,
    /// Requests in flight at the last sample.
    pub in_flight: u64,
    /// Why the volume is busy, one sentence per cause; empty when idle.
    pub reasons: Vec<String>,
}

/// Latency percentiles of one op, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
pub struct Percentiles {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    /// Requests measured.
    pub count: u64,
}

/// Latency of each op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
pub struct LatencyStats {
    pub read: Percentiles,
    pub write: Percentiles,
    pub flush: Percentiles,
    pub discard: Percentiles,
}

/// The `nowait` path's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
pub struct KernelBlockStats {
    pub read_merges: u64,
    pub write_merges: u64,
    pub discard_merges: u64,
    /// Milliseconds spent by reads, writes, discards and flushes in the queue.
    pub read_ticks_ms: u64,
    pub write_ticks_ms: u64,
    pub discard_ticks_ms: u64,
    pub flush_ticks_ms: u64,
    /// Milliseconds the device had I/O in flight.
    pub io_ticks_ms: u64,
    /// Weighted milliseconds of all requests in the queue.
    pub time_in_queue_ms: u64,
}

/// Whether a backend or policy can run on this host, and why not.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Capability {
    pub available: bool,
    /// Why it is not available (`null` when it is).
    pub reason: Option<String>,
}

/// The ublk driver's features as the kernel reports them.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct UblkFeatures {
    /// The raw `UBLK_U_CMD_GET_FEATURES` bitmask.
    pub mask: u64,
    /// Names of the known bits that are set.
    pub names: Vec<String>,
}

/// One backend's availability on this host.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct BackendCapability {
    pub available: bool,
    pub reason: Option<String>,
    /// ublk only.
    pub features: Option<UblkFeatures>,
    /// dm only: the target types the kernel has loaded (DM_LIST_VERSIONS).
    pub targets: Option<Vec<String>>,
    /// dm only: whether the kernel offers a native `loop` target (blockplane
    /// still maps with `linear` tables).
    pub native_loop_target: Option<bool>,
}

/// Backends on this host.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct HostBackends {
    #[serde(rename = "loop")]
    pub loop_: BackendCapability,
    pub ublk: BackendCapability,
    pub dm: BackendCapability,
}

/// Dispatch policies on this host.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct HostPolicies {
    pub nowait: Capability,
    pub threaded: Capability,
    pub direct: Capability,
}

/// `GET /v1/host`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Host {
    /// `uname -r`.
    pub kernel: String,
    /// blockplane's version.
    pub version: String,
    pub backends: HostBackends,
    pub policies: HostPolicies,
    /// The directories images may live under.
    pub image_roots: Vec<String>,
    /// Each image root's filesystem: size and free space.
    pub image_root_capacity: Vec<RootCapacity>,
    /// The backend `backend: auto` picks here.
    pub default_backend: Option<Backend>,
    /// Devices of this service with no volume: left alone until
    /// `DELETE /v1/host/orphans/{volume_id}`.
    pub orphans: Vec<Orphan>,
}

/// Size and free space of an image root's filesystem.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct RootCapacity {
    pub path: String,
    pub size_bytes: u64,
    /// Bytes free to an unprivileged writer (`df`'s "Avail").
    pub free_bytes: u64,
    /// Images registered under this root.
    pub images: u64,
    /// Their sizes added up: what their volumes may come to hold.
    pub provisioned_bytes: u64,
    /// What the filesystem allocated to them.
    pub allocated_bytes: u64,
    /// The service's limit on `provisioned_bytes / size_bytes`, if set
    /// (`--max-overcommit`).
    pub max_overcommit: Option<f64>,
}

/// A device blockplane made that belongs to no volume of this service.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Orphan {
    pub backend: Backend,
    /// The volume id in its mark, if it carries one.
    pub volume_id: Option<Uuid>,
    pub device: String,
    /// The file it serves, when known (loop devices, ublk devices whose
    /// worker runs).
    pub backing_file: Option<String>,
    /// The blockplane instance in its mark, if it carries one.
    pub instance: Option<String>,
    /// The worker serving it (ublk), while it runs.
    pub pid: Option<u32>,
    /// Why it is an orphan.
    pub reason: String,
    /// Whether `DELETE /v1/host/orphans/{volume_id}` removes it: only devices
    /// carrying this service's own mark; others are left to the operator.
    pub removable: bool,
}

/// A recorded state change.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Event {
    /// Increasing; usable as a cursor.
    pub id: i64,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub at: OffsetDateTime,
    pub volume_id: Option<Uuid>,
    pub image_id: Option<Uuid>,
    /// e.g. `volume_attached`, `dispatch_changed`.
    pub kind: String,
    pub message: String,
}

/// Query of `GET /v1/events`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventQuery {
    /// Only events of this volume (id or name; a deleted volume's id still works).
    pub volume: Option<String>,
    /// Only events after this time (RFC 3339).
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// At most this many, the newest (default 100, at most 1000), oldest first.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
}

/// Query of `GET /v1/events/stream`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventStreamQuery {
    /// Only events of this volume (id or name).
    pub volume: Option<String>,
    /// Start after this event id (the `Last-Event-ID` header wins).
    pub after: Option<i64>,
}

/// `GET /healthz`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Health {
    /// Always `ok` when the service answers.
    pub status: String,
}

/// Every error response: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable snake_case identifier, for programs.
    pub code: String,
    /// What was refused and why, naming the object; for people.
    pub message: String,
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
    pub buckets: Vec<u64>,
    pub sum_us: f64,
    pub count: u64,
}

/// What [`parse_size`] accepts, for its refusals and the help texts.
pub const SIZE_FORMS: &str = "a whole number of bytes, or a number (fractions allowed, e.g. 1.5G) \
with a unit: K, M, G, T or Ki, Mi, Gi, Ti or KiB, MiB, GiB, TiB (binary: 1024) or KB, MB, GB, TB \
(decimal: 1000)";

/// Parses a size as people write it: `4096`, `64K`, `1.5G`, `1Gi`, `1GiB`
/// (binary multiples), `1GB` (decimal, 10^9). Refuses what is not a whole
/// number of bytes, saying what is accepted.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let refuse = |why: &str| format!("'{s}' is not a size ({why}); give {SIZE_FORMS}");
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return Err(refuse("no number"));
    }
    let mult: u128 = match unit.trim() {
        "" | "B" => 1,
        "K" | "k" | "Ki" | "KiB" => 1 << 10,
        "M" | "Mi" | "MiB" => 1 << 20,
        "G" | "Gi" | "GiB" => 1 << 30,
        "T" | "Ti" | "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        u => return Err(refuse(&format!("unknown unit '{u}'"))),
    };
    // Exact: digits as an integer over 10^(fraction digits).
    let scale = 10u128.pow(frac.len() as u32);
    let digits: u128 = format!("{whole}{frac}")
        .parse()
        .map_err(|_| refuse("too many digits"))?;
    let bytes = digits
        .checked_mul(mult)
        .ok_or_else(|| refuse("too large"))?;
    if bytes % scale != 0 {
        return Err(refuse("not a whole number of bytes"));
    }
    u64::try_from(bytes / scale).map_err(|_| refuse("too large"))
}

/// A byte count for people, in binary units with one decimal: `1.5 GiB`
/// (`512 B` under 1 KiB). The one formatter of sizes for the CLI and event
/// messages alike.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

/// [`human_size`] with the exact count beside it, for messages that may be
/// read by scripts too: `1.5 GiB (1610612736 bytes)`.
pub fn size_text(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{} ({bytes} bytes)", human_size(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("1Gi"), Ok(1 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("2.5 MB"), Ok(2_500_000));
        assert_eq!(parse_size("0.5K"), Ok(512));
        assert_eq!(size_text(3 << 29), "1.5 GiB (1610612736 bytes)");
        assert_eq!(size_text(512), "512 bytes");
        assert_eq!(human_size(0), "0 B");
        for bad in ["4X", "G", "99999999999T", "-1", "0.1K", "1.2.3G", "", "."] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains("binary: 1024") && e.contains(bad), "{bad}: {e}");
        }
    }
}
