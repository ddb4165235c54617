//! The CSI driver: `blockplane csi` serves the CSI v1 Identity, Controller
//! and Node services over a unix socket, for the blockplane service of its
//! own node, through blockplane's public API only.
//!
//! Volumes are local: on every node of a cluster the driver runs beside that
//! node's blockplane, the external-provisioner runs in node-deployment mode,
//! and each volume is accessible from its node alone (topology key
//! [`TOPOLOGY_KEY`]). A CSI volume is a blockplane image file (under an image
//! root) and a blockplane volume serving it, both named after the CSI name
//! (module `naming`).
//!
//! Modules: `identity`, `controller` and `node` are the three services,
//! over the `driver` they share; [`proto`] holds the generated messages;
//! `errors` maps every failure, and the API's answers, to a gRPC code;
//! [`mount`] holds the mount and filesystem helpers; `api` is the typed
//! client with the volume named in its errors; `capability` reads volume
//! capabilities; `snapshots` makes snapshots and clones; `inflight` allows
//! one call per volume at a time; `health` says a volume's condition.

mod api;
mod authority;
mod capability;
mod capacity;
mod controller;
mod driver;
mod errors;
mod health;
mod identity;
mod inflight;
mod listing;
pub mod mount;
mod naming;
mod node;
pub mod proto;
mod reach;
mod snapshot_metadata;
mod snapshots;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;

use api::Api;
use blockplane_client::{Client, Endpoint};
use driver::Driver;
use inflight::InFlight;

/// The driver's default name (the `provisioner` of its StorageClasses).
pub const DRIVER_NAME: &str = "csi.blockplane.io";

pub use driver::TOPOLOGY_KEY;

/// Flags of `blockplane csi` (the API address and token are the global
/// `--api` and `--token`).
#[derive(Debug, Clone, clap::Args)]
pub struct CsiArgs {
    /// Where to serve CSI: unix:///path/csi.sock (or unix:/path, or a path).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// This node's name (Kubernetes: spec.nodeName); volumes are created for
    /// it and its topology is `blockplane.io/node=<node-id>`.
    #[arg(long, env = "BLOCKPLANE_NODE_ID")]
    pub node_id: String,
    /// The driver's name, as StorageClasses and the CSIDriver object name it.
    #[arg(long, env = "BLOCKPLANE_CSI_DRIVER_NAME", default_value = DRIVER_NAME)]
    pub driver_name: String,
    /// The image root to create image files under [default: the API's first
    /// image root]. GetCapacity reports its free space, read here with
    /// statvfs, so it must be visible to the driver at the same path.
    #[arg(long, env = "BLOCKPLANE_CSI_IMAGE_ROOT")]
    pub image_root: Option<PathBuf>,
    /// This node's blockplane API as the other nodes' drivers reach it
    /// (`HOST:PORT`, TCP; the service's token comes from the node-stage
    /// Secret): needed by a StorageClass with `reach: network` [default:
    /// none, such classes are refused].
    #[arg(long, env = "BLOCKPLANE_NODE_API")]
    pub node_api: Option<String>,
}

/// What keeps `blockplane csi` from serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// No node id was given.
    #[error("--node-id is empty")]
    NoNodeId,
    /// A node id that cannot be part of a volume id.
    #[error(
        "--node-id '{0}' is too long or contains '/': a node id has at most {max} bytes so that volume ids fit the CSI limit of {limit}",
        max = naming::MAX_NODE_ID,
        limit = naming::MAX_VOLUME_ID
    )]
    BadNodeId(String),
    /// A CSI endpoint that is not a unix socket.
    #[error("--endpoint '{0}': only unix sockets are served (unix:///path/csi.sock)")]
    Endpoint(String),
    /// An API address the client cannot use.
    #[error("API address: {0}")]
    Api(#[from] blockplane_client::Error),
    /// The CSI socket cannot be made.
    #[error("socket {path}: {source}")]
    Socket {
        /// The socket's path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The socket path of a `unix://` endpoint.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, ServeError> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if path.starts_with('/') {
        Ok(PathBuf::from(path))
    } else {
        Err(ServeError::Endpoint(endpoint.to_string()))
    }
}

fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    let err = |source| ServeError::Socket {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    // A socket left by a previous run (the sidecars reconnect to the path).
    if std::fs::symlink_metadata(path)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    {
        std::fs::remove_file(path).map_err(err)?;
    }
    UnixListener::bind(path).map_err(err)
}

/// Serves CSI until SIGTERM or SIGINT.
pub async fn serve(args: CsiArgs, api: &str, token: Option<String>) -> Result<(), ServeError> {
    if args.node_id.is_empty() {
        return Err(ServeError::NoNodeId);
    }
    if args.node_id.len() > naming::MAX_NODE_ID || args.node_id.contains('/') {
        return Err(ServeError::BadNodeId(args.node_id));
    }
    let path = socket_path(&args.endpoint)?;
    let client = Client::new(Endpoint::parse(api)?, token);
    let driver = Arc::new(Driver {
        name: args.driver_name,
        node_id: args.node_id,
        api: Api::new(client),
        image_root: args.image_root,
        node_api: args.node_api,
        controller_calls: InFlight::default(),
        node_calls: InFlight::default(),
    });
    let listener = bind(&path)?;
    tracing::info!(
        socket = %path.display(),
        api,
        node = %driver.node_id,
        driver = %driver.name,
        "serving CSI"
    );
    tonic::transport::Server::builder()
        .add_service(proto::identity_server::IdentityServer::from_arc(Arc::new(
            identity::IdentityService::new(driver.clone()),
        )))
        .add_service(proto::controller_server::ControllerServer::from_arc(
            Arc::new(controller::ControllerService::new(driver.clone())),
        ))
        .add_service(proto::node_server::NodeServer::from_arc(Arc::new(
            node::NodeService::new(driver.clone()),
        )))
        .add_service(
            proto::snapshot_metadata_server::SnapshotMetadataServer::from_arc(Arc::new(
                snapshot_metadata::SnapshotMetadataService::new(driver.clone()),
            )),
        )
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener).map(|conn| conn.map(authority::Filtered::new)),
            shutdown(),
        )
        .await?;
    let _ = std::fs::remove_file(&path);
    tracing::info!("CSI driver stopped");
    Ok(())
}

async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
