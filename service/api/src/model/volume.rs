//! Volumes: one kernel block device serving one image (`/v1/volumes`).

use serde::{Deserialize, Deserializer, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::backend::{ActiveDispatch, Backend, BackendChoice, CopyMode, DispatchPolicy};
use super::key::Key;
use super::qos::Qos;

/// `POST /v1/volumes`. Create is idempotent by name: the same spec again returns the
/// existing volume (200), a different spec is a conflict (409).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// `[a-z0-9][a-z0-9._-]{0,62}`
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^[a-z0-9][a-z0-9._-]{0,62}$",
            min_length = 1,
            max_length = 63
        )
    )]
    pub name: String,
    /// Image id or name.
    pub image: String,
    /// The backend to make the device with; `auto` picks the fastest path
    /// this host has for the image (dm `direct` where dm maps it).
    #[serde(default = "default_backend")]
    pub backend: BackendChoice,
    /// How a ublk or dm volume's I/O reaches its image.
    #[serde(default = "default_dispatch")]
    pub dispatch: DispatchPolicy,
    /// Create the device read-only (it can never be made writable live).
    #[serde(default)]
    pub read_only: bool,
    /// Hardware queues of the block device, each served by its own thread.
    /// Omitted: one per online CPU (at most 8, or the service's `--queues`)
    /// for ublk and dm, 1 for loop.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 64))]
    pub queues: Option<u16>,
    /// Depth of each queue.
    #[serde(default = "default_queue_depth")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 4096))]
    pub queue_depth: u16,
    /// Largest request the device accepts, bytes: one of
    /// [`MAX_IO_BYTES_CHOICES`] (described in `max_io_bytes_schema`).
    #[serde(default = "default_max_io_bytes")]
    #[cfg_attr(feature = "openapi", schema(schema_with = max_io_bytes_schema))]
    pub max_io_bytes: u32,
    /// I/O limits, enforced by a worker: ublk's, or a dm volume's private
    /// one (dm `direct` under `auto` starts on `nowait`; `direct` asked by
    /// name refuses them, 422). `null` for none; `loop` refuses them.
    #[serde(default)]
    pub qos: Option<Qos>,
    /// The key of an encrypted image (one that opens a key slot of it):
    /// the volume serves its plaintext through dm-crypt. Required for an
    /// encrypted image (422 `key_required`), refused for a plain one (422
    /// `not_encrypted`); a key no slot opens is 403 `key_rejected` and
    /// changes nothing. Never stored: not part of the recorded spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<Key>,
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
#[cfg(feature = "openapi")]
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

/// Life-cycle state of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// On an encrypted image: the backend's device serves the ciphertext,
    /// but the plaintext device is gone (the host rebooted, or it was closed
    /// behind the service's back) until the key is given again
    /// (`POST /v1/volumes/{id}/unlock`).
    Locked,
    /// The service started and has not matched the volume with the kernel
    /// yet: its device, if a worker served it, waits for a new one. Never
    /// stored; changes to the volume wait until it is done.
    Recovering,
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
            VolumeState::Locked => "locked",
            VolumeState::Recovering => "recovering",
        }
    }
}

/// A volume: one kernel block device serving one image.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Volume {
    /// Stable id.
    pub id: Uuid,
    /// Unique name: `[a-z0-9][a-z0-9._-]{0,62}`.
    pub name: String,
    /// The id of the image it serves.
    pub image_id: Uuid,
    /// The backend its device is made with.
    pub backend: Backend,
    /// The data path in effect now.
    pub dispatch: ActiveDispatch,
    /// The policy asked for (create or last PATCH).
    pub requested_dispatch: DispatchPolicy,
    /// Why `dispatch` is what it is.
    pub dispatch_reason: String,
    /// Its life-cycle state.
    pub state: VolumeState,
    /// Why the volume is in its state, when that needs saying (`degraded`, `error`).
    pub state_reason: Option<String>,
    /// Device node, e.g. `/dev/loop3`; `null` while there is none. On an
    /// encrypted image, the plaintext: `/dev/mapper/blockplane-crypt-<id>`.
    pub device: Option<String>,
    /// Whether it serves an encrypted image through dm-crypt.
    #[serde(default)]
    pub encrypted: bool,
    /// On an encrypted image, the backend's device under the plaintext one
    /// (it serves the ciphertext: the image file as it is); `null` otherwise.
    #[serde(default)]
    pub backing_device: Option<String>,
    /// Size of the device, bytes.
    pub size_bytes: u64,
    /// Whether the device refuses writes.
    pub read_only: bool,
    /// Hardware queues of the device.
    pub queues: u16,
    /// Depth of each queue.
    pub queue_depth: u16,
    /// Largest request the device accepts, bytes.
    pub max_io_bytes: u32,
    /// I/O limits; `null` for none.
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
    /// The build of the worker serving the device (ublk volumes, and dm
    /// volumes on `nowait`/`threaded`, whose private ublk device has one):
    /// `<version>+<build>` as in `GET /v1/host`, or `unknown` for a worker
    /// from before workers said; `null` when no worker serves it.
    pub worker_version: Option<String>,
    /// Whether that worker is another build than the service's (`true` for
    /// `unknown`): `POST /v1/volumes/{id}/handover` (`blockplane upgrade`)
    /// moves it to the service's; `null` when no worker serves it.
    pub worker_older: Option<bool>,
    /// Whether the service watches that worker, to recover its device if it
    /// dies (`null` when no worker serves it). When `false` the volume is
    /// `degraded` and `state_reason` says why.
    #[serde(default)]
    pub worker_supervised: Option<bool>,
    /// The image grew, but the kernel could not resize the device live
    /// (ublk without UPDATE_SIZE): the new size applies at the next attach.
    pub resize_pending: bool,
    /// What an operator should look at while the volume serves, e.g. page
    /// cache held under a direct-I/O data path (empty otherwise; each also
    /// came as an event).
    #[serde(default)]
    pub warnings: Vec<String>,
    /// When it was created.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    /// When it last changed.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub updated_at: OffsetDateTime,
}

/// `PATCH /v1/volumes/{id}`: live changes. Absent fields stay as they are.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PatchVolumeRequest {
    /// The dispatch policy to switch to (ublk and dm).
    #[serde(default)]
    pub dispatch: Option<DispatchPolicy>,
    /// An object sets limits, `null` removes them.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Qos>))]
    pub qos: Option<Option<Qos>>,
    /// Refuse (`true`) or allow (`false`) writes (ublk and dm).
    #[serde(default)]
    pub read_only: Option<bool>,
}

/// Tells a present `null` (`Some(None)`) from an absent field (`None`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}
