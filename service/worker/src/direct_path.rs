//! The data paths a worker serves on, and the direct path's open devices.

use std::fs::File;

use blockplane_protocol::DataPath;
use blockplane_system::extent::ExtentMap;

/// The data path in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Policy {
    Nowait = 0,
    Threaded = 1,
    Direct = 2,
}

impl Policy {
    /// The policy for a requested data path.
    pub fn from_requested(d: DataPath) -> Self {
        match d {
            DataPath::Nowait => Policy::Nowait,
            DataPath::Threaded => Policy::Threaded,
            DataPath::Direct => Policy::Direct,
        }
    }

    /// In the API's terms.
    pub fn active(self) -> DataPath {
        match self {
            Policy::Nowait => DataPath::Nowait,
            Policy::Threaded => DataPath::Threaded,
            Policy::Direct => DataPath::Direct,
        }
    }
}

/// The direct path: the image's map and its raw devices, opened O_DIRECT.
pub(crate) struct DirectPath {
    pub map: ExtentMap,
    pub devices: Vec<File>,
}
