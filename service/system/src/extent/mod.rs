//! Direct maps: an image's extents, checked against the direct-map safety
//! rules (all seven are stated in `docs/direct-map.md`) and translated to
//! the raw block device beneath its filesystem, so I/O can bypass the
//! filesystem.
//!
//! Rules checked here (each refusal names its rule):
//! 1. the filesystem is block-mapped and not copy-on-write: ext4 or xfs;
//! 2. every extent from `FS_IOC_FIEMAP` (with `FIEMAP_FLAG_SYNC`) is plain,
//!    512-aligned, with no holes, and the last one carries `LAST`;
//! 3. the file is pinned with `FS_IMMUTABLE_FL` while mapped ([`Pin`]);
//! 4. the filesystem's device is resolved through sysfs, and through
//!    device-mapper `linear` tables (only) down to a raw device;
//! 5. the map is re-read and compared ([`ExtentMap::differences`]);
//! 6. the image's page cache is written back and dropped ([`drop_page_cache`]).
//!
//! Rule 7 (opening the raw disk while its filesystem is mounted) is checked
//! where the raw device is opened: the dm backend and the ublk worker.
//!
//! One module per concern: `fiemap` reads the extents, `rules` holds rules
//! 1 and 2 and every refusal, `stack` resolves the device stack under the
//! filesystem (rule 4), `map` builds the map and splits requests over it,
//! and `pin` pins the image and readies the map (rules 3, 5, 6).

mod fiemap;
mod map;
mod pin;
mod rules;
mod stack;
#[cfg(test)]
pub(crate) mod testfs;

pub use fiemap::{
    FIEMAP_EXTENT_UNWRITTEN, FsExtent, Unwritten, fiemap, fiemap_range, first_unwritten,
    hole_bytes, unwritten_ranges, written_ranges,
};
pub use map::{ExtentMap, Piece, Pieces, RawDevice, Segment};
pub use pin::{Pin, drop_page_cache, is_immutable, map_and_pin, pin, unpin};
pub use rules::{MapError, check_extents, filesystem_name};
pub use stack::DevNum;
