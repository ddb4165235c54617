//! Changed-block tracking: the ranges of a snapshot that hold data, and the
//! ranges that differ between two snapshots of one image
//! (`GET /v1/images/{id}/allocated`, `GET /v1/images/{id}/changes`), which
//! the CSI driver's SnapshotMetadata service pages through.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The most ranges one answer holds, and the default.
pub const MAX_RANGES: u32 = 10_000;

/// Query of `GET /v1/images/{id}/allocated`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct AllocatedQuery {
    /// The device's byte to start from (rounded down to a 4096-byte block);
    /// default 0. Page on with the answer's `next_offset`.
    #[serde(default)]
    pub offset: u64,
    /// At most this many ranges (1 to 10000; default 10000).
    #[cfg_attr(feature = "openapi", param(minimum = 1, maximum = 10000))]
    pub limit: Option<u32>,
}

/// Query of `GET /v1/images/{id}/changes`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct ChangesQuery {
    /// The snapshot to compare with (id or name): a snapshot of the same
    /// image, usually an older one.
    pub base: String,
    /// The device's byte to start from (rounded down to a 4096-byte block);
    /// default 0. Page on with the answer's `next_offset`.
    #[serde(default)]
    pub offset: u64,
    /// At most this many ranges (1 to 10000; default 10000).
    #[cfg_attr(feature = "openapi", param(minimum = 1, maximum = 10000))]
    pub limit: Option<u32>,
}

/// One range of a device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ByteRange {
    /// Where it starts.
    pub offset: u64,
    /// How long it is.
    pub length: u64,
}

/// A page of a snapshot's ranges. Offsets are the device's (an encrypted
/// image's plaintext, without its header), in whole 4096-byte blocks but
/// for the last, which may end at `size_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageRanges {
    /// The snapshot answered for.
    pub image_id: Uuid,
    /// Its name.
    pub image_name: String,
    /// For `/changes`: the snapshot compared with.
    pub base_id: Option<Uuid>,
    /// The device's length: what a volume on the snapshot serves.
    pub size_bytes: u64,
    /// The granularity of the ranges.
    pub block_bytes: u64,
    /// In ascending order, none touching the next. For `/allocated`: what
    /// was ever written (the rest reads as zeroes on a plain image). For
    /// `/changes`: every block whose bytes differ from the base's, and
    /// only those.
    pub ranges: Vec<ByteRange>,
    /// Where the next page starts; absent on the last page. A page of
    /// `/changes` ends once it has compared 1 GiB, whatever its range
    /// count, so it may hold fewer than `limit`, even none.
    pub next_offset: Option<u64>,
    /// Bytes of this page's stretch known from the files' extent maps
    /// alone: holes, unwritten extents, and blocks the two files share
    /// (reflinked snapshots on xfs or btrfs).
    pub mapped_bytes: u64,
    /// Bytes of this page's stretch read from both files and compared
    /// (everything else: full copies, and blocks written between the two).
    pub compared_bytes: u64,
}
