//! Per-volume I/O limits.

use serde::{Deserialize, Serialize};

/// Per-volume I/O limits (token buckets; reads and writes together). `null`
/// fields are unlimited; a limit is 1 to 2^53 - 1 ([`MAX_QOS`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Qos {
    /// Requests a second.
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1, maximum = 9007199254740991_u64)
    )]
    pub iops: Option<u64>,
    /// Bytes a second.
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1, maximum = 9007199254740991_u64)
    )]
    pub bytes_per_sec: Option<u64>,
    /// Requests that may go at once after a quiet spell (default: `iops`).
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1, maximum = 9007199254740991_u64)
    )]
    pub burst_iops: Option<u64>,
    /// Bytes that may go at once after a quiet spell (default: `bytes_per_sec`).
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1, maximum = 9007199254740991_u64)
    )]
    pub burst_bytes: Option<u64>,
}

/// The largest QoS limit: 2^53 - 1, the largest integer every JSON parser
/// carries exactly (RFC 8259 section 6), and the buckets count in `f64`.
pub const MAX_QOS: u64 = (1 << 53) - 1;
