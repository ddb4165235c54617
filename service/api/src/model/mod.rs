//! The API's data model: request and response bodies of `/v1`, shared by the
//! server, the CLI, the CSI driver and the tests. Nothing here does I/O.
//!
//! One module per concept; every type is re-exported here, so users name
//! them `blockplane_api::model::X` whatever module they live in.

mod backend;
mod backup;
mod error;
mod event;
mod export;
mod handover;
mod host;
mod image;
mod key;
mod labels;
mod moves;
mod qos;
mod ranges;
mod schedule;
mod size;
mod stats;
mod usage;
mod volume;
mod wire;

pub use backend::*;
pub use backup::*;
pub use error::*;
pub use event::*;
pub use export::*;
pub use handover::*;
pub use host::*;
pub use image::*;
pub use key::*;
pub use labels::*;
pub use moves::*;
pub use qos::*;
pub use ranges::*;
pub use schedule::*;
pub use size::*;
pub use stats::*;
pub use usage::*;
pub use volume::*;
pub use wire::*;
