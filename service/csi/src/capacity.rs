//! CSI capacity ranges as image sizes: what size a range asks for, and
//! whether a size fits one (used by creates, clones, restores and expands).

use super::errors::CsiError;
use super::proto::CapacityRange;

/// Image sizes are rounded up to this: aligned for every filesystem and
/// every backend (the API itself takes multiples of 512).
pub const GRANULE: u64 = 1 << 20;
/// The size of a volume whose request names no capacity.
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// The image size for a capacity range: `required_bytes` rounded up to
/// [`GRANULE`] (to 512 bytes when the granule would pass `limit_bytes`);
/// [`DEFAULT_SIZE`] (within the limit) when nothing is required.
pub fn size_for(volume: &str, range: Option<&CapacityRange>) -> Result<u64, CsiError> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    let out_of_range = |reason: String| CsiError::OutOfRange {
        volume: volume.to_string(),
        reason,
    };
    if required < 0 || limit < 0 {
        return Err(out_of_range(format!(
            "capacity range {required}..{limit} has a negative bound"
        )));
    }
    let (required, limit) = (required as u64, limit as u64);
    if limit > 0 && required > limit {
        return Err(out_of_range(format!(
            "required_bytes {required} is more than limit_bytes {limit}"
        )));
    }
    if required == 0 {
        if limit == 0 {
            return Ok(DEFAULT_SIZE);
        }
        let size = DEFAULT_SIZE.min(limit / GRANULE * GRANULE);
        let size = if size == 0 { limit / 512 * 512 } else { size };
        return if size == 0 {
            Err(out_of_range(format!(
                "limit_bytes {limit} is less than the smallest volume (512 bytes)"
            )))
        } else {
            Ok(size)
        };
    }
    let size = required.div_ceil(GRANULE) * GRANULE;
    if limit == 0 || size <= limit {
        return Ok(size);
    }
    let size = required.div_ceil(512) * 512;
    if size <= limit {
        Ok(size)
    } else {
        Err(out_of_range(format!(
            "no multiple of 512 bytes lies in {required}..={limit}"
        )))
    }
}

/// Whether a capacity range admits `size`.
pub fn fits(size: u64, range: Option<&CapacityRange>) -> bool {
    range.is_none_or(|r| {
        size >= r.required_bytes.max(0) as u64
            && (r.limit_bytes <= 0 || size <= r.limit_bytes as u64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(required: i64, limit: i64) -> Option<CapacityRange> {
        Some(CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        })
    }

    #[test]
    fn sizes_round_up_to_the_granule_within_the_limit() {
        let s = |r, l| size_for("v", range(r, l).as_ref());
        assert_eq!(size_for("v", None).unwrap(), DEFAULT_SIZE);
        assert_eq!(s(1, 0).unwrap(), GRANULE);
        assert_eq!(s(GRANULE as i64, 0).unwrap(), GRANULE);
        assert_eq!(s(GRANULE as i64 + 1, 0).unwrap(), 2 * GRANULE);
        // The granule would pass the limit: 512-byte granularity instead.
        assert_eq!(s(1000, 4096).unwrap(), 1024);
        assert_eq!(s(0, 10 * GRANULE as i64 + 5).unwrap(), 10 * GRANULE);
        assert_eq!(s(0, 1000).unwrap(), 512);
        assert_eq!(s(2 << 30, 0).unwrap(), 2 << 30);
        for (r, l) in [(1000, 1020), (10, 5), (-1, 0), (0, 100)] {
            let e = s(r, l).unwrap_err();
            assert_eq!(e.code(), tonic::Code::OutOfRange, "{r}..{l}: {e}");
        }
    }
}
