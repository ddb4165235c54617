//! `blockplane serve`: the control plane. The HTTP API (`http`) parses
//! requests and calls the `manager`, which owns the state: the SQLite
//! registry (`store`) and the kernel devices (`backend`). It never touches a
//! volume's bytes; the workers (`blockplane-worker`) do.
//!
//! What the binary needs is public: [`serve()`] and its [`config`], the
//! [`logging`] of every process, the dashboard's port-forward ([`proxy`]),
//! [`backup_registry`] and the OpenAPI document ([`openapi_json`]).

mod attachment;
mod backend;
pub mod config;
mod dashboard;
mod fault;
mod http;
mod liveness;
pub mod logging;
mod manager;
mod metrics;
pub mod proxy;
mod registry;
mod serve;
mod store;
mod usage;

pub use dashboard::{ASSETS, is_asset};
pub use http::openapi_json;
pub use serve::{ServeError, serve};
pub use store::StoreError;

/// Copies the registry `db` to `target` (a new file, mode 0600), consistent
/// while a service writes it: `blockplane backup`.
pub async fn backup_registry(
    db: &std::path::Path,
    target: &std::path::Path,
) -> Result<(), StoreError> {
    store::Store::backup(db, target).await
}
