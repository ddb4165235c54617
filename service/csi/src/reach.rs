//! Where a volume can be used from. A volume lives on the node that made it
//! (its id names that node); with the StorageClass parameter
//! `reach: network` it is also reachable from every other node, over
//! NVMe/TCP: the owner's service exports it to the consuming node's host
//! NQN, and the consuming node's service connects it as a remote volume
//! (`docs/exports.md`).
//!
//! How the consuming node's driver reaches the owner's service: CreateVolume
//! (run by the owner's driver) puts the owner's API address (`--node-api`)
//! and export address in the volume's context, which the CO hands to every
//! NodeStageVolume; the API's bearer token comes from the node-stage Secret
//! (entry [`TOKEN_SECRET`]), as an encrypted volume's key does. Unstage
//! disconnects the remote volume and leaves the grant on the owner:
//! NodeUnstageVolume carries neither the context nor the secret, and the
//! owner's DeleteVolume removes the export with the volume.

use std::collections::HashMap;
use std::path::PathBuf;

use super::api::Api;
use super::driver::Driver;
use super::errors::CsiError;
use super::naming::VolumeId;
use blockplane_api::model::{CreateRemoteRequest, ExportAuth, ExportRequest, Host};
use blockplane_client::{Client, Endpoint};

/// The StorageClass parameter.
pub const PARAM: &str = "reach";

/// The node-stage Secret's entry with the owner's API token.
pub const TOKEN_SECRET: &str = "token";

/// Context keys CreateVolume sets on a network-reachable volume.
const CONTEXT_REACH: &str = "blockplane.io/reach";
const CONTEXT_API: &str = "blockplane.io/owner-api";
const CONTEXT_EXPORT: &str = "blockplane.io/export-address";

/// Where a volume can be used from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reach {
    /// Its own node only (topology `blockplane.io/node`).
    #[default]
    Node,
    /// Every node: others over NVMe/TCP.
    Network,
}

impl Reach {
    /// The parameter's value, or why not.
    pub fn parse(v: &str) -> Result<Self, String> {
        match v {
            "node" => Ok(Self::Node),
            "network" => Ok(Self::Network),
            _ => Err(format!("parameter {PARAM}='{v}' is not node or network")),
        }
    }
}

/// The context of a network-reachable volume made on this node: where
/// other nodes' drivers find its owner. Refused when this node cannot
/// export (no `--node-api`, no export address, no NVMe target).
pub fn context(d: &Driver, volume: &str, host: &Host) -> Result<HashMap<String, String>, CsiError> {
    let refuse = |reason: String| CsiError::Precondition {
        volume: volume.to_string(),
        reason: format!("its StorageClass asks for {PARAM}: network, and {reason}"),
    };
    let api = d.node_api.clone().ok_or_else(|| {
        refuse("this node's driver has no --node-api (BLOCKPLANE_NODE_API): the address other nodes reach its blockplane API at".into())
    })?;
    let fabric = host
        .fabric
        .as_ref()
        .ok_or_else(|| refuse("this node's blockplane service predates exports".into()))?;
    let export = fabric
        .export_addresses
        .first()
        .ok_or_else(|| refuse("this node's blockplane service has no --export-address".into()))?;
    if !fabric.target.available {
        return Err(refuse(format!(
            "this node cannot export: {}",
            fabric.target.reason.as_deref().unwrap_or("no NVMe target")
        )));
    }
    Ok([
        (CONTEXT_REACH.to_string(), "network".to_string()),
        (CONTEXT_API.to_string(), api),
        (CONTEXT_EXPORT.to_string(), export.clone()),
    ]
    .into())
}

/// Makes another node's volume a device here: the owner's service exports
/// it to this node's host NQN, this node's service connects it. Answers the
/// remote volume's device. Idempotent: a repeated stage finds both done.
pub async fn connect(
    d: &Driver,
    id: &VolumeId,
    context: &HashMap<String, String>,
    secrets: &HashMap<String, String>,
) -> Result<PathBuf, CsiError> {
    let volume = id.to_string();
    if context.get(CONTEXT_REACH).map(String::as_str) != Some("network") {
        return Err(CsiError::OtherNode {
            volume,
            owner: id.node.clone(),
            node: d.node_id.clone(),
        });
    }
    let precondition = |reason: String| CsiError::Precondition {
        volume: volume.clone(),
        reason,
    };
    let (Some(api), Some(export_address)) = (context.get(CONTEXT_API), context.get(CONTEXT_EXPORT))
    else {
        return Err(precondition(format!(
            "its volume context lacks {CONTEXT_API} or {CONTEXT_EXPORT}: it was not made by a network StorageClass"
        )));
    };
    let token = secrets.get(TOKEN_SECRET).ok_or_else(|| {
        precondition(format!(
            "it lives on node '{}' and NodeStageVolume got no secret entry '{TOKEN_SECRET}' (that node's blockplane API token): name a Secret holding it in the StorageClass's csi.storage.k8s.io/node-stage-secret-name and -namespace",
            id.node
        ))
    })?;
    if let Some(dev) = d.api.remote(&id.name).await?.and_then(|r| r.device) {
        return Ok(PathBuf::from(dev));
    }
    let endpoint = Endpoint::parse(api)
        .map_err(|e| precondition(format!("its owner's API address '{api}' is not one: {e}")))?;
    let owner = Api::new(Client::new(endpoint, Some(token.clone())));
    let host_nqn = d
        .api
        .host()
        .await?
        .fabric
        .map(|f| f.host_nqn)
        .ok_or_else(|| precondition("this node's blockplane service predates exports".into()))?;
    let mut hosts = owner
        .export(&id.name)
        .await?
        .map(|e| e.hosts.into_iter().map(|h| h.host_nqn).collect::<Vec<_>>())
        .unwrap_or_default();
    if !hosts.contains(&host_nqn) {
        hosts.push(host_nqn.clone());
    }
    let export = owner
        .put_export(
            &id.name,
            &ExportRequest {
                hosts,
                auth: ExportAuth::Dhchap,
                ..Default::default()
            },
        )
        .await?;
    let keys = export
        .hosts
        .iter()
        .find(|h| h.host_nqn == host_nqn)
        .ok_or_else(|| precondition(format!("its owner's export does not list {host_nqn}")))?;
    let remote = d
        .api
        .create_remote(&CreateRemoteRequest {
            name: id.name.clone(),
            address: export_address.clone(),
            nqn: export.nqn.clone(),
            secret: keys.secret.clone(),
            ctrl_secret: keys.ctrl_secret.clone(),
            read_only: false,
        })
        .await?;
    remote.device.map(PathBuf::from).ok_or_else(|| {
        precondition(format!(
            "its remote volume has no device ({:?})",
            remote.state
        ))
    })
}

/// The device of another node's volume connected here, if it is.
pub async fn device(d: &Driver, id: &VolumeId) -> Result<Option<PathBuf>, CsiError> {
    Ok(d.api
        .remote(&id.name)
        .await?
        .and_then(|r| r.device.map(PathBuf::from)))
}

/// Disconnects another node's volume from this node, if it is connected.
pub async fn disconnect(d: &Driver, id: &VolumeId) -> Result<(), CsiError> {
    d.api.delete_remote(&id.name).await?;
    Ok(())
}
