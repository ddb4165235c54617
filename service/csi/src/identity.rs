//! The CSI Identity service: who the driver is, what it offers, and whether
//! it can work (its node's blockplane API answers).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::driver::Driver;
use super::proto::identity_server::Identity;
use super::proto::plugin_capability::{self, service, volume_expansion};
use super::proto::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};

/// The Identity service.
#[derive(Debug)]
pub struct IdentityService {
    d: Arc<Driver>,
}

impl IdentityService {
    /// The Identity service of `driver`.
    pub fn new(d: Arc<Driver>) -> Self {
        Self { d }
    }
}

fn service_cap(t: service::Type) -> PluginCapability {
    PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _req: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.d.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: [("node".to_string(), self.d.node_id.clone())].into(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![
                service_cap(service::Type::ControllerService),
                // Volumes are reachable from their own node only.
                service_cap(service::Type::VolumeAccessibilityConstraints),
                // Changed-block tracking of snapshots, for backup tools.
                service_cap(service::Type::SnapshotMetadataService),
                // Images grow while their devices serve I/O.
                PluginCapability {
                    r#type: Some(plugin_capability::Type::VolumeExpansion(
                        plugin_capability::VolumeExpansion {
                            r#type: volume_expansion::Type::Online as i32,
                        },
                    )),
                },
            ],
        }))
    }

    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        // The driver itself is always up; it is ready when its node's
        // blockplane answers, without which no call can succeed.
        let ready = self.d.api.healthy().await;
        if !ready {
            tracing::warn!("probe: the blockplane API does not answer");
        }
        Ok(Response::new(ProbeResponse { ready: Some(ready) }))
    }
}
