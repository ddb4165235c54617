//! The one place the API's words meet the worker protocol's: each crossing
//! is a function here, so the public API and the protocol change apart and
//! a change to one shows up here as a conversion to write, never silently
//! on the wire. The one crossing not here is the data path a worker is
//! told: the decider gives it in the protocol's word
//! ([`blockplane_system::dispatch::Decision::data_path`]).

use blockplane_api::model::{
    ActiveDispatch, Allocation, HandoverMethod, LatencyHistogram, OpStats, Qos,
};
use blockplane_protocol as protocol;

/// The path a worker serves on, in the API's words.
pub(crate) fn active(p: protocol::DataPath) -> ActiveDispatch {
    match p {
        protocol::DataPath::Nowait => ActiveDispatch::Nowait,
        protocol::DataPath::Threaded => ActiveDispatch::Threaded,
        protocol::DataPath::Direct => ActiveDispatch::Direct,
    }
}

/// An image's allocation, for a worker.
pub(crate) fn allocation(a: Allocation) -> protocol::Allocation {
    match a {
        Allocation::Sparse => protocol::Allocation::Sparse,
        Allocation::Full => protocol::Allocation::Full,
    }
}

/// QoS limits, for a worker.
pub(crate) fn limits(q: Option<Qos>) -> Option<protocol::Limits> {
    q.map(|q| protocol::Limits {
        iops: q.iops,
        bytes_per_sec: q.bytes_per_sec,
        burst_iops: q.burst_iops,
        burst_bytes: q.burst_bytes,
    })
}

/// A worker's counters of one op, in the API's words.
pub(crate) fn op_stats(c: protocol::OpCounts) -> OpStats {
    OpStats {
        ops: c.ops,
        bytes: c.bytes,
        errors: c.errors,
    }
}

/// A worker's latency histogram, in the API's words (its bounds are the
/// API's: a test below holds them equal).
pub(crate) fn histogram(h: &protocol::Histogram) -> LatencyHistogram {
    LatencyHistogram {
        buckets: h.buckets.clone(),
        sum_us: h.sum_us,
        count: h.count,
    }
}

/// How a worker let go of its device, in the API's words.
pub(crate) fn handover(m: protocol::HandoverMethod) -> HandoverMethod {
    match m {
        protocol::HandoverMethod::Quiesce => HandoverMethod::Quiesce,
        protocol::HandoverMethod::Drain => HandoverMethod::Drain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockplane_api::model::DispatchPolicy;
    use serde::Serialize;

    fn json<T: Serialize>(t: &T) -> String {
        serde_json::to_string(t).unwrap()
    }

    /// Workers of earlier builds spoke the API's words on the wire: every
    /// converted value must still be spelled as the API spells it.
    #[test]
    fn every_crossing_keeps_the_words_of_the_wire() {
        for d in [
            DispatchPolicy::Nowait,
            DispatchPolicy::Threaded,
            DispatchPolicy::Direct,
        ] {
            let path = protocol::DataPath::serving(d);
            assert_eq!(json(&path), json(&d));
            assert_eq!(json(&active(path)), json(&d));
        }
        for a in [Allocation::Sparse, Allocation::Full] {
            assert_eq!(json(&allocation(a)), json(&a));
        }
        let q = Qos {
            iops: Some(1),
            bytes_per_sec: None,
            burst_iops: Some(3),
            burst_bytes: Some(4),
        };
        assert_eq!(json(&limits(Some(q))), json(&Some(q)));
        let c = protocol::OpCounts {
            ops: 1,
            bytes: 2,
            errors: Some(3),
        };
        assert_eq!(json(&op_stats(c)), json(&c));
        let h = protocol::Histogram {
            buckets: vec![1, 2],
            sum_us: 3.5,
            count: 3,
        };
        assert_eq!(json(&histogram(&h)), json(&h));
        for m in [
            protocol::HandoverMethod::Quiesce,
            protocol::HandoverMethod::Drain,
        ] {
            assert_eq!(json(&handover(m)), json(&m));
        }
        assert_eq!(
            protocol::LATENCY_BOUNDS_US,
            blockplane_api::model::LATENCY_BOUNDS_US
        );
    }
}
