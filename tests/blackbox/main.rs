//! Black-box tests: each starts the real `blockplane` binary on a temp data dir
//! and talks to it over HTTP (every answer checked against
//! openapi/openapi.json), with real SQLite and real /dev/loopN devices. They
//! need root (loop devices).

// A test crate: its `pub` items serve its own modules, not readers of an API.
#![allow(missing_docs)]

use blockplane_test_support::wait::eventually;
use blockplane_test_support::{builds, harness, leaks};

mod attacks;
mod auth;
mod backups;
mod cli;
mod dashboard;
mod encryption;
mod events;
mod exports;
mod images;
mod instances;
mod limits;
mod lost_registry;
mod metrics;
mod openapi;
mod registry;
mod remedies;
mod restart;
mod schedules;
mod schema;
mod snapshots;
mod soak;
mod standbys;
mod versions;
mod volumes;
