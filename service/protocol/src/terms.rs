//! The protocol's own words for what it carries: a data path, an image's
//! allocation, QoS limits, counters and latency histograms.
//!
//! They are spelled on the wire as the API's words of the same meaning were
//! in protocols 1 to 3 (the tests below pin that), but they are not the
//! API's types: the public API and this protocol change apart. The server
//! converts between them at its one end (`backend/wire.rs`), but for the
//! data path, which the decider gives in the protocol's word
//! ([`DataPath::serving`]).

use serde::{Deserialize, Serialize};

/// The data path a worker serves a volume on: the decider's own word for
/// it (`blockplane_system::dispatch`), which decides it, spelled on the wire
/// as protocols 1 to 3 spelled it (the test below pins that).
pub use blockplane_system::dispatch::DataPath;

/// How an image's blocks are laid out, which decides what DISCARD and
/// WRITE_ZEROES may do to them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Allocation {
    /// Blocks come on first write; DISCARD punches them out again.
    #[default]
    Sparse,
    /// Every block allocated and written: never punched, so the image stays
    /// eligible for `direct`.
    Full,
}

/// How a worker let go of its device for a successor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandoverMethod {
    /// `UBLK_F_QUIESCE`: the kernel drained the queues.
    Quiesce,
    /// The worker held its queues until none had a request inside.
    Drain,
}

impl HandoverMethod {
    /// Its word on the wire, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoverMethod::Quiesce => "quiesce",
            HandoverMethod::Drain => "drain",
        }
    }
}

/// I/O limits, token buckets over reads and writes together; a `None`
/// field is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Requests a second.
    #[serde(default)]
    pub iops: Option<u64>,
    /// Bytes a second.
    #[serde(default)]
    pub bytes_per_sec: Option<u64>,
    /// Requests that may go at once after a quiet spell (default: `iops`).
    #[serde(default)]
    pub burst_iops: Option<u64>,
    /// Bytes that may go at once after a quiet spell (default: `bytes_per_sec`).
    #[serde(default)]
    pub burst_bytes: Option<u64>,
}

/// Counters of one kind of request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    /// Requests completed.
    pub ops: u64,
    /// Bytes they moved.
    pub bytes: u64,
    /// Requests that failed (a worker always counts them; optional on the
    /// wire as protocols 1 to 3 wrote it).
    pub errors: Option<u64>,
}

/// Upper bounds of a worker's latency histogram buckets, microseconds.
pub const LATENCY_BOUNDS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000,
];

/// One op's latency histogram: per-bucket counts over
/// [`LATENCY_BOUNDS_US`] (the last entry counts everything above), and the
/// sum of the latencies in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    /// Requests per bucket, the last above every bound.
    pub buckets: Vec<u64>,
    /// Their latencies added up, microseconds.
    pub sum_us: f64,
    /// Requests measured.
    pub count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json<T: Serialize>(t: &T) -> String {
        serde_json::to_string(t).unwrap()
    }

    /// The words are those protocol 3 was spoken with (workers of earlier
    /// builds still answer in them): a rename here is a protocol change.
    #[test]
    fn the_words_are_spelled_as_protocol_3_spelled_them() {
        let paths = [DataPath::Nowait, DataPath::Threaded, DataPath::Direct];
        let words: Vec<String> = paths.iter().map(json).collect();
        assert_eq!(words, [r#""nowait""#, r#""threaded""#, r#""direct""#]);
        assert_eq!(
            (json(&Allocation::Sparse), json(&Allocation::Full)),
            (r#""sparse""#.into(), r#""full""#.into())
        );
        assert_eq!(
            (json(&HandoverMethod::Quiesce), json(&HandoverMethod::Drain)),
            (r#""quiesce""#.into(), r#""drain""#.into())
        );
        let limits = Limits {
            iops: Some(1),
            bytes_per_sec: Some(2),
            burst_iops: None,
            burst_bytes: Some(4),
        };
        assert_eq!(
            json(&limits),
            r#"{"iops":1,"bytes_per_sec":2,"burst_iops":null,"burst_bytes":4}"#
        );
        assert_eq!(
            serde_json::from_str::<Limits>(r#"{"iops":10}"#).unwrap(),
            Limits {
                iops: Some(10),
                ..Limits::default()
            }
        );
        assert_eq!(
            json(&OpCounts {
                ops: 1,
                bytes: 2,
                errors: Some(3)
            }),
            r#"{"ops":1,"bytes":2,"errors":3}"#
        );
        assert_eq!(
            json(&Histogram {
                buckets: vec![1, 2],
                sum_us: 3.5,
                count: 3
            }),
            r#"{"buckets":[1,2],"sum_us":3.5,"count":3}"#
        );
    }
}
