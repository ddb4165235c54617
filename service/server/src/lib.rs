//! `blockplane serve`: the control plane. The HTTP API ([`http`]) parses
//! requests and calls the [`manager`], which owns the state: the SQLite
//! registry ([`store`]) and the kernel devices ([`backend`]). It never
//! touches a volume's bytes; the workers (`blockplane-worker`) do.

pub mod attachment;
pub mod backend;
pub mod config;
pub mod dashboard;
pub mod http;
pub mod logging;
pub mod manager;
pub mod metrics;
pub mod proxy;
pub mod serve;
pub mod store;
pub mod usage;
