//! What the three services share: the driver's name, its node, the API of
//! that node, where image files go, and the calls in flight.

use std::path::PathBuf;

use super::api::Api;
use super::errors::CsiError;
use super::inflight::InFlight;
use super::proto;

/// The topology key whose value is the node a volume lives on.
pub const TOPOLOGY_KEY: &str = "blockplane.io/node";

/// State shared by the three services.
#[derive(Debug)]
pub(crate) struct Driver {
    /// The driver's name.
    pub name: String,
    /// The node this driver serves.
    pub node_id: String,
    /// The blockplane API of this node.
    pub api: Api,
    /// Where image files are created (`None`: the API's first image root).
    pub image_root: Option<PathBuf>,
    /// This node's API as other nodes reach it (`--node-api`), for volumes
    /// reachable from every node.
    pub node_api: Option<String>,
    /// Controller calls in flight, by blockplane name.
    pub controller_calls: InFlight,
    /// Node calls in flight, by volume id.
    pub node_calls: InFlight,
}

impl Driver {
    /// The topology segment of this node.
    pub fn topology(&self) -> proto::Topology {
        proto::Topology {
            segments: [(TOPOLOGY_KEY.to_string(), self.node_id.clone())].into(),
        }
    }

    /// The image root to create files under.
    pub async fn image_root(&self, volume: &str) -> Result<PathBuf, CsiError> {
        if let Some(r) = &self.image_root {
            return Ok(r.clone());
        }
        let host = self.api.host().await?;
        host.image_roots
            .first()
            .map(PathBuf::from)
            .ok_or_else(|| CsiError::Precondition {
                volume: volume.into(),
                reason: "the blockplane service has no image root".into(),
            })
    }
}
