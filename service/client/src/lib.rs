//! The API's client. [`Client`] calls every operation of the API with the
//! model's types and answers them typed; an error answer is
//! [`Error::Refused`] with its status, [`ErrorCode`](blockplane_api::model::ErrorCode)
//! and message. [`Transport`] carries the requests, one connection each,
//! over the unix socket or TCP.
//!
//! The operations live in one module per part of the API: images, volumes,
//! backups, events, exports and remotes, moves, and the rest (host, orphans,
//! health, metrics).

mod backups;
mod client;
mod endpoint;
mod error;
mod events;
mod exports;
mod images;
mod moves;
mod path;
mod schedules;
mod system;
mod transport;
mod volumes;

pub use client::Client;
pub use endpoint::Endpoint;
pub use error::Error;
pub use events::EventStream;
pub use path::encode_segment;
pub use transport::{Answer, Transport};
