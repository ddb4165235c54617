//! blockplane: a storage virtualization service for Linux hosts. It records
//! backing image files in SQLite and serves each volume as a kernel block
//! device (loop, ublk or dm), with a dispatch policy that can change live.
//!
//! The control plane ([`api`] → [`manager`] → [`store`] and [`backend`])
//! never touches a volume's bytes.

pub mod api;
pub mod attachment;
pub mod backend;
pub mod blockstat;
pub mod cli;
pub mod client;
pub mod config;
pub mod csi;
pub mod dashboard;
pub mod dataplane;
pub mod dispatch;
pub mod extent;
pub mod image;
pub mod manager;
pub mod metrics;
pub mod model;
pub mod proxy;
pub mod server;
pub mod store;
pub mod usage;
