//! The direct path: the image's map and the raw devices it is served from.

use std::fs::File;

use blockplane_system::extent::ExtentMap;

/// The direct path: the image's map and its raw devices, opened O_DIRECT.
pub(crate) struct DirectPath {
    pub map: ExtentMap,
    pub devices: Vec<File>,
}
