//! DM tables: the `linear` targets of each data path.

pub use blockplane_system::dm::Target;
use blockplane_system::extent::{DevNum, ExtentMap};

/// `linear` targets over the raw devices, one per mapped segment.
pub fn direct_table(map: &ExtentMap) -> Vec<Target> {
    map.segments
        .iter()
        .map(|s| {
            (
                s.logical / 512,
                s.len / 512,
                "linear".to_string(),
                format!("{} {}", map.devices[s.device].dev, s.physical / 512),
            )
        })
        .collect()
}

/// One `linear` target over a whole device.
pub(super) fn over(dev: DevNum, size_bytes: u64) -> Vec<Target> {
    vec![(
        0,
        size_bytes / 512,
        "linear".to_string(),
        format!("{dev} 0"),
    )]
}
