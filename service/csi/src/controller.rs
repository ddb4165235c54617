//! The CSI Controller service: creates, deletes, grows and lists this node's
//! volumes through the blockplane API (an image file, then a volume serving
//! it), snapshots them and makes volumes from snapshots and volumes
//! ([`super::snapshots`]), and reports the free space under the image root.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::capability::{self, Access};
use super::capacity::{fits, size_for};
use super::driver::{Driver, TOPOLOGY_KEY};
use super::errors::{CsiError, require};
use super::health;
use super::listing::page;
use super::mount;
use super::naming::{self, VolumeId};
use super::proto::controller_get_volume_response::VolumeStatus;
use super::proto::controller_server::Controller;
use super::proto::controller_service_capability::{self, rpc};
use super::proto::list_volumes_response::{Entry, VolumeStatus as ListVolumeStatus};
use super::proto::validate_volume_capabilities_response::Confirmed;
use super::proto::{
    CapacityRange, ControllerExpandVolumeRequest, ControllerExpandVolumeResponse,
    ControllerGetCapabilitiesRequest, ControllerGetCapabilitiesResponse,
    ControllerGetVolumeRequest, ControllerGetVolumeResponse, ControllerModifyVolumeRequest,
    ControllerModifyVolumeResponse, ControllerServiceCapability, CreateSnapshotRequest,
    CreateSnapshotResponse, CreateVolumeRequest, CreateVolumeResponse, DeleteSnapshotRequest,
    DeleteSnapshotResponse, DeleteVolumeRequest, DeleteVolumeResponse, GetCapacityRequest,
    GetCapacityResponse, ListSnapshotsRequest, ListSnapshotsResponse, ListVolumesRequest,
    ListVolumesResponse, Topology, ValidateVolumeCapabilitiesRequest,
    ValidateVolumeCapabilitiesResponse, Volume,
};
use super::reach::{self, Reach};
use super::snapshots::{self, Source};
use blockplane_api::model::{
    self, Allocation, BackendChoice, DispatchPolicy, ImageState, Qos, parse_wire,
};
use blockplane_system::mountinfo;

/// The Controller service.
#[derive(Debug)]
pub struct ControllerService {
    d: Arc<Driver>,
}

impl ControllerService {
    /// The Controller service of `driver`.
    pub fn new(d: Arc<Driver>) -> Self {
        Self { d }
    }
}

/// What a StorageClass's parameters ask of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub backend: BackendChoice,
    pub dispatch: DispatchPolicy,
    pub allocation: Allocation,
    pub qos: Option<Qos>,
    /// `encrypted: "true"`: LUKS2, with the key from the request's secret
    /// [`KEY_SECRET`].
    pub encrypted: bool,
    /// `reach: network`: reachable from every node ([`reach`]).
    pub reach: Reach,
}

/// The entry of a Secret (provisioner and node-stage) that holds an
/// encrypted volume's key.
pub const KEY_SECRET: &str = "key";

/// The LUKS2 header the service puts before an encrypted image's data: an
/// encrypted volume's image is this much larger than the capacity asked.
const ENCRYPTION_HEADER_BYTES: u64 = 16 << 20;

/// Parses StorageClass parameters: `backend`, `dispatch`, `allocation`
/// (the API's values) and `qos.iops`, `qos.bytes_per_sec`, `qos.burst_iops`,
/// `qos.burst_bytes` (byte counts take units: `100M`). Keys of Kubernetes
/// (`csi.storage.k8s.io/...`) are not ours and are skipped; any other key is
/// refused, so that a typo does not go unnoticed.
pub fn parse_params(volume: &str, params: &HashMap<String, String>) -> Result<Params, CsiError> {
    let invalid = |reason: String| CsiError::Invalid {
        volume: volume.to_string(),
        reason,
    };
    let mut p = Params {
        backend: BackendChoice::Auto,
        dispatch: DispatchPolicy::Auto,
        allocation: Allocation::Sparse,
        qos: None,
        encrypted: false,
        reach: Reach::Node,
    };
    let mut qos = Qos::default();
    let mut keys: Vec<&String> = params.keys().collect();
    keys.sort();
    for k in keys {
        let v = params[k].trim();
        let number = |bytes: bool| -> Result<u64, CsiError> {
            let n = if bytes {
                blockplane_api::model::parse_size(v).ok()
            } else {
                v.parse().ok()
            };
            n.filter(|n| *n > 0)
                .ok_or_else(|| invalid(format!("parameter {k}='{v}' is not a positive number")))
        };
        match k.as_str() {
            "backend" => {
                p.backend = parse_wire(v).ok_or_else(|| {
                    invalid(format!(
                        "parameter backend='{v}' is not one of auto, loop, ublk, dm"
                    ))
                })?
            }
            "dispatch" => p.dispatch = parse_wire(v).ok_or_else(|| {
                invalid(format!(
                    "parameter dispatch='{v}' is not one of auto, nowait, threaded, direct, kernel"
                ))
            })?,
            "allocation" => {
                p.allocation = parse_wire(v).ok_or_else(|| {
                    invalid(format!("parameter allocation='{v}' is not sparse or full"))
                })?
            }
            "encrypted" => {
                p.encrypted = match v {
                    "true" => true,
                    "false" => false,
                    _ => {
                        return Err(invalid(format!(
                            "parameter encrypted='{v}' is not true or false"
                        )));
                    }
                }
            }
            reach::PARAM => p.reach = Reach::parse(v).map_err(&invalid)?,
            "qos.iops" => qos.iops = Some(number(false)?),
            "qos.bytes_per_sec" => qos.bytes_per_sec = Some(number(true)?),
            "qos.burst_iops" => qos.burst_iops = Some(number(false)?),
            "qos.burst_bytes" => qos.burst_bytes = Some(number(true)?),
            k if k.starts_with("csi.storage.k8s.io/") => {}
            other => {
                return Err(invalid(format!(
                    "unknown parameter '{other}' (known: backend, dispatch, allocation, encrypted, reach, qos.iops, qos.bytes_per_sec, qos.burst_iops, qos.burst_bytes)"
                )));
            }
        }
    }
    if qos != Qos::default() {
        p.qos = Some(qos);
    }
    Ok(p)
}

/// What a VolumeAttributesClass may change on a live volume
/// (ControllerModifyVolume's `mutable_parameters`, and CreateVolume's, applied
/// at creation): the dispatch policy and each QoS limit, `0` lifting one. A
/// key left out changes nothing (the CSI spec: no change from an absent key).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mutable {
    pub dispatch: Option<DispatchPolicy>,
    /// Per limit, `Some(0)` lifts it.
    pub iops: Option<u64>,
    pub bytes_per_sec: Option<u64>,
    pub burst_iops: Option<u64>,
    pub burst_bytes: Option<u64>,
}

/// The keys [`parse_mutable`] takes.
pub const MUTABLE_KEYS: &str =
    "dispatch, qos.iops, qos.bytes_per_sec, qos.burst_iops, qos.burst_bytes";

/// Parses mutable parameters; refuses an unknown key, one that cannot change
/// on a live volume (`backend`, `allocation`) and a bad value, naming it.
pub fn parse_mutable(volume: &str, params: &HashMap<String, String>) -> Result<Mutable, CsiError> {
    let invalid = |reason: String| CsiError::Invalid {
        volume: volume.to_string(),
        reason,
    };
    let mut m = Mutable::default();
    let mut keys: Vec<&String> = params.keys().collect();
    keys.sort();
    for k in keys {
        let v = params[k].trim();
        let limit = |bytes: bool| -> Result<Option<u64>, CsiError> {
            let n = if bytes {
                blockplane_api::model::parse_size(v).ok()
            } else {
                v.parse().ok()
            };
            n.map(Some).ok_or_else(|| {
                invalid(format!(
                    "mutable parameter {k}='{v}' is not a number (0 lifts the limit)"
                ))
            })
        };
        match k.as_str() {
            "dispatch" => {
                m.dispatch = Some(parse_wire(v).ok_or_else(|| {
                    invalid(format!(
                        "mutable parameter dispatch='{v}' is not one of auto, nowait, threaded, direct, kernel"
                    ))
                })?)
            }
            "qos.iops" => m.iops = limit(false)?,
            "qos.bytes_per_sec" => m.bytes_per_sec = limit(true)?,
            "qos.burst_iops" => m.burst_iops = limit(false)?,
            "qos.burst_bytes" => m.burst_bytes = limit(true)?,
            "backend" | "allocation" => {
                return Err(invalid(format!(
                    "parameter {k} cannot change on a live volume (it decides the device, or the image file, made at creation): set it in the StorageClass"
                )));
            }
            other => {
                return Err(invalid(format!(
                    "unknown mutable parameter '{other}' (known: {MUTABLE_KEYS})"
                )));
            }
        }
    }
    Ok(m)
}

impl Mutable {
    /// `now` with this call's limits applied (`0` lifts one), or `None` when
    /// no limit is left; `now` itself when the call names none.
    pub fn qos_over(&self, now: Option<Qos>) -> Option<Qos> {
        let mut q = now.unwrap_or_default();
        let set = |field: &mut Option<u64>, to: Option<u64>| {
            if let Some(n) = to {
                *field = (n > 0).then_some(n);
            }
        };
        set(&mut q.iops, self.iops);
        set(&mut q.bytes_per_sec, self.bytes_per_sec);
        set(&mut q.burst_iops, self.burst_iops);
        set(&mut q.burst_bytes, self.burst_bytes);
        (q != Qos::default()).then_some(q)
    }

    /// The PATCH that brings `v` to these values: empty when it has them
    /// already (a repeated call changes nothing).
    pub fn patch(&self, v: &model::Volume) -> model::PatchVolumeRequest {
        let qos = self.qos_over(v.qos);
        model::PatchVolumeRequest {
            dispatch: self.dispatch.filter(|d| *d != v.requested_dispatch),
            qos: (qos != v.qos).then_some(qos),
            read_only: None,
        }
    }

    /// Applies these values to a StorageClass's, for CreateVolume.
    pub fn apply(&self, p: &mut Params) {
        if let Some(d) = self.dispatch {
            p.dispatch = d;
        }
        p.qos = self.qos_over(p.qos);
    }
}

fn rpc_cap(t: rpc::Type) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(controller_service_capability::Type::Rpc(
            controller_service_capability::Rpc { r#type: t as i32 },
        )),
    }
}

impl ControllerService {
    fn csi_volume(&self, v: &model::Volume) -> Volume {
        Volume {
            capacity_bytes: v.size_bytes as i64,
            volume_id: VolumeId::new(&self.d.node_id, &v.name).to_string(),
            volume_context: Default::default(),
            content_source: None,
            accessible_topology: vec![self.d.topology()],
        }
    }

    /// Parses a volume id of this node; `Ok(None)` for ids that cannot be
    /// this driver's.
    fn own_id(&self, id: &str, expand: bool) -> Result<Option<VolumeId>, CsiError> {
        let Some(vid) = VolumeId::parse(id) else {
            return Ok(None);
        };
        if vid.node != self.d.node_id {
            let (volume, owner, node) = (id.to_string(), vid.node, self.d.node_id.clone());
            return Err(if expand {
                CsiError::ExpandElsewhere {
                    volume,
                    owner,
                    node,
                }
            } else {
                CsiError::OtherNode {
                    volume,
                    owner,
                    node,
                }
            });
        }
        Ok(Some(vid))
    }

    /// Checks an existing volume against a repeated CreateVolume: the same
    /// capacity range and parameters give the same volume.
    async fn compatible(
        d: &Driver,
        csi_name: &str,
        v: &model::Volume,
        range: Option<&CapacityRange>,
        p: &Params,
        source: Option<&model::Image>,
    ) -> Result<(), CsiError> {
        let image = d.api.image(&v.name).await?;
        let size = image.as_ref().map_or(v.size_bytes, |i| i.device_bytes());
        let mut diffs = Vec::new();
        if !fits(size, range) {
            diffs.push(format!(
                "its size {size} is outside the requested capacity range"
            ));
        }
        if p.backend != BackendChoice::Auto && v.backend.as_str() != backend_str(p.backend) {
            diffs.push(format!(
                "it runs on backend {}, asked {}",
                v.backend.as_str(),
                backend_str(p.backend)
            ));
        }
        if v.requested_dispatch != p.dispatch {
            diffs.push(format!(
                "its dispatch is {}, asked {}",
                v.requested_dispatch.as_str(),
                p.dispatch.as_str()
            ));
        }
        if let Some(i) = &image
            && i.allocation != Some(p.allocation)
        {
            diffs.push(format!(
                "its image allocation is {:?}, asked {:?}",
                i.allocation, p.allocation
            ));
        }
        if v.qos != p.qos {
            diffs.push(format!("its QoS is {:?}, asked {:?}", v.qos, p.qos));
        }
        if v.encrypted != p.encrypted {
            diffs.push(format!(
                "it is {}encrypted, asked {}encrypted",
                if v.encrypted { "" } else { "not " },
                if p.encrypted { "" } else { "not " }
            ));
        }
        let made_from = image.as_ref().and_then(|i| i.cloned_from);
        if made_from != source.map(|s| s.id) {
            diffs.push(format!(
                "its content source is {}, asked {}",
                made_from.map_or("none".into(), |id| id.to_string()),
                source.map_or("none".into(), |s| format!("'{}'", s.name))
            ));
        }
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(CsiError::Incompatible {
                volume: csi_name.to_string(),
                reason: format!(
                    "exists as blockplane volume '{}' with another spec: {}",
                    v.name,
                    diffs.join("; ")
                ),
            })
        }
    }

    async fn create(
        d: Arc<Driver>,
        req: CreateVolumeRequest,
        name: String,
        params: Params,
        size: u64,
        source: Option<Source>,
    ) -> Result<model::Volume, CsiError> {
        let range = req.capacity_range.as_ref();
        let key = req.secrets.get(KEY_SECRET).map(model::Key::new);
        if params.encrypted && key.is_none() {
            return Err(CsiError::Precondition {
                volume: req.name.clone(),
                reason: format!(
                    "its StorageClass asks for encryption (encrypted: \"true\") and CreateVolume got no secret entry '{KEY_SECRET}': name a Secret holding it in the StorageClass's csi.storage.k8s.io/provisioner-secret-name and -namespace"
                ),
            });
        }
        let src = match &source {
            Some(s) => Some(snapshots::source_image(&d, &req.name, s).await?),
            None => None,
        };
        if let Some(v) = d.api.volume(&name).await? {
            Self::compatible(&d, &req.name, &v, range, &params, src.as_ref()).await?;
            return Ok(v);
        }
        let size = match &src {
            Some(s) => snapshots::clone_size(&req.name, range, s.size_bytes)?,
            None => size,
        };
        if !Self::leftover_is_ours(&d, &req.name, &name, src.as_ref()).await? {
            let size = size
                + if params.encrypted {
                    ENCRYPTION_HEADER_BYTES
                } else {
                    0
                };
            let key = key.clone().filter(|_| params.encrypted);
            Self::new_image(&d, &req.name, &name, size, &params, key, src.as_ref()).await?;
        }
        let vreq = model::CreateVolumeRequest {
            name: name.clone(),
            image: name.clone(),
            backend: params.backend,
            dispatch: params.dispatch,
            read_only: false,
            queues: None,
            queue_depth: model::DEFAULT_QUEUE_DEPTH,
            max_io_bytes: model::DEFAULT_MAX_IO_BYTES,
            qos: params.qos,
            // A clone of an encrypted volume is encrypted too, with its keys.
            key: key.filter(|_| {
                params.encrypted || src.as_ref().is_some_and(|s| s.encryption.is_some())
            }),
        };
        match d.api.create_volume(&vreq).await {
            Ok(v) => {
                tracing::info!(volume = %name, device = ?v.device, size, "volume created");
                Ok(v)
            }
            Err(e) => {
                // Leave nothing behind a refused create.
                if let Err(cleanup) = d.api.delete_image(&name).await {
                    tracing::warn!(image = %name, error = %cleanup, "could not remove the image of a failed create");
                }
                Err(e)
            }
        }
    }

    /// Whether image `name`, left by an earlier call, is this create's clone
    /// copied (`true`); one still copying is a pending answer. An image
    /// without its volume is what an interrupted create leaves: it is
    /// removed, to start again from nothing.
    async fn leftover_is_ours(
        d: &Driver,
        volume: &str,
        name: &str,
        src: Option<&model::Image>,
    ) -> Result<bool, CsiError> {
        let Some(image) = d.api.image(name).await? else {
            return Ok(false);
        };
        if !image.volumes.is_empty() {
            return Err(CsiError::Precondition {
                volume: volume.to_string(),
                reason: format!(
                    "image '{name}' is used by volumes {:?} of other names",
                    image.volumes
                ),
            });
        }
        let ours = src.is_some_and(|s| image.cloned_from == Some(s.id));
        match image.state {
            ImageState::Copying if ours => Err(snapshots::pending(volume, &image)),
            ImageState::Ready if ours => Ok(true),
            _ => {
                tracing::info!(image = %name, "removing the image of an interrupted create");
                d.api.delete_image(name).await?;
                Ok(false)
            }
        }
    }

    /// Creates image `name` of `size` bytes (the header on top of the
    /// capacity asked, when encrypted with `key`) under the driver's image
    /// root, or a clone of `src`; a clone still copying is a pending answer.
    async fn new_image(
        d: &Driver,
        volume: &str,
        name: &str,
        size: u64,
        params: &Params,
        key: Option<model::Key>,
        src: Option<&model::Image>,
    ) -> Result<(), CsiError> {
        let root = d.image_root(volume).await?;
        let path = root.join(format!("{name}.img")).display().to_string();
        let image = d
            .api
            .create_image(&model::CreateImageRequest {
                name: name.to_string(),
                path,
                create: Some(model::CreateImageFile {
                    size_bytes: size,
                    allocation: params.allocation,
                    encryption: key.map(|key| model::CreateEncryption { key }),
                }),
                clone_from: src.map(|s| s.name.clone()),
                restore_from: None,
                standby_of: None,
                allocation: None,
                labels: Default::default(),
            })
            .await?;
        if image.state == ImageState::Copying {
            return Err(snapshots::pending(volume, &image));
        }
        Ok(())
    }
}

fn backend_str(b: BackendChoice) -> &'static str {
    match b {
        BackendChoice::Auto => "auto",
        BackendChoice::Loop => "loop",
        BackendChoice::Ublk => "ublk",
        BackendChoice::Dm => "dm",
    }
}

/// Whether a topology is this node's.
fn is_node(t: &Topology, node: &str) -> bool {
    t.segments.get(TOPOLOGY_KEY).is_some_and(|n| n == node)
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = req.into_inner();
        require("CreateVolume", "name", req.name.is_empty())?;
        let csi_name = req.name.clone();
        let invalid = |reason: String| CsiError::Invalid {
            volume: csi_name.clone(),
            reason,
        };
        require(
            "CreateVolume",
            "volume_capabilities",
            req.volume_capabilities.is_empty(),
        )?;
        for cap in &req.volume_capabilities {
            capability::parse(cap).map_err(&invalid)?;
        }
        let source = req
            .volume_content_source
            .as_ref()
            .map(|cs| snapshots::parse_source(&self.d.node_id, &csi_name, cs))
            .transpose()?;
        if let Some(t) = &req.accessibility_requirements
            && !t.requisite.is_empty()
            && !t.requisite.iter().any(|t| is_node(t, &self.d.node_id))
        {
            return Err(CsiError::Topology {
                volume: csi_name,
                reason: format!(
                    "this driver creates volumes on node '{}' only ({TOPOLOGY_KEY}), which the requisite topologies exclude",
                    self.d.node_id
                ),
            }
            .into());
        }
        let mut params = parse_params(&csi_name, &req.parameters)?;
        parse_mutable(&csi_name, &req.mutable_parameters)?.apply(&mut params);
        let size = size_for(&csi_name, req.capacity_range.as_ref())?;
        let name = naming::blockplane_name(&csi_name);
        // Checked before anything is made: a class this node cannot serve
        // over the network changes nothing.
        let (volume_context, accessible_topology) = match params.reach {
            Reach::Node => (HashMap::new(), vec![self.d.topology()]),
            Reach::Network => {
                let host = self.d.api.host().await?;
                // Empty: the CO may take it as reachable from every node.
                (reach::context(&self.d, &csi_name, &host)?, Vec::new())
            }
        };
        tracing::info!(csi_name = %csi_name, volume = %name, size, ?params, "CreateVolume");
        let d = self.d.clone();
        let content_source = req.volume_content_source.clone();
        let v = self
            .d
            .controller_calls
            .run(
                &name.clone(),
                Self::create(d, req, name, params, size, source),
            )
            .await?;
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                content_source,
                volume_context,
                accessible_topology,
                ..self.csi_volume(&v)
            }),
        }))
    }

    async fn delete_volume(
        &self,
        req: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = req.into_inner();
        require("DeleteVolume", "volume_id", req.volume_id.is_empty())?;
        // An id that is not this driver's names no volume: deleted already.
        let Some(id) = self.own_id(&req.volume_id, false)? else {
            return Ok(Response::new(DeleteVolumeResponse {}));
        };
        tracing::info!(volume = %id.name, "DeleteVolume");
        let d = self.d.clone();
        let name = id.name.clone();
        self.d
            .controller_calls
            .run(&id.name, async move {
                if let Some(v) = d.api.volume(&name).await? {
                    // The API refuses to delete a device held open (a mounted
                    // filesystem); a bind-mounted device node holds nothing
                    // open, so look for both in the mount table.
                    if let Some(dev) = &v.device
                        && let Ok(Some(rdev)) = mount::block_rdev(dev.as_ref())
                    {
                        let used = mountinfo::mounts_of_device(rdev).unwrap_or_default();
                        if !used.is_empty() {
                            return Err(CsiError::Precondition {
                                volume: name.clone(),
                                reason: format!(
                                    "in use: {dev} is mounted at {}",
                                    used.iter()
                                        .map(|p| p.display().to_string())
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                ),
                            });
                        }
                    }
                    // A network-reachable volume's export goes with it.
                    // Forced: the CO deletes a volume no pod uses, so its
                    // other nodes have unstaged it, and the kernel cannot
                    // tell this export's connections from another's.
                    d.api.delete_export(&name).await?;
                    d.api.delete_volume(&name).await?;
                }
                d.api.delete_image(&name).await?;
                Ok(())
            })
            .await?;
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = req.into_inner();
        require(
            "ValidateVolumeCapabilities",
            "volume_id",
            req.volume_id.is_empty(),
        )?;
        require(
            "ValidateVolumeCapabilities",
            "volume_capabilities",
            req.volume_capabilities.is_empty(),
        )?;
        let not_found = || CsiError::NotFound {
            volume: req.volume_id.clone(),
            reason: "no such volume".into(),
        };
        let id = self.own_id(&req.volume_id, false)?.ok_or_else(not_found)?;
        if self.d.api.volume(&id.name).await?.is_none() {
            return Err(not_found().into());
        }
        let mut refusals = Vec::new();
        for cap in &req.volume_capabilities {
            if let Err(reason) = capability::parse(cap) {
                refusals.push(reason);
            }
        }
        if let Err(e) = parse_params(&id.name, &req.parameters) {
            refusals.push(e.to_string());
        }
        // The keys a VolumeAttributesClass may carry, read as
        // ControllerModifyVolume reads them.
        if let Err(e) = parse_mutable(&id.name, &req.mutable_parameters) {
            refusals.push(e.to_string());
        }
        let resp = if refusals.is_empty() {
            ValidateVolumeCapabilitiesResponse {
                confirmed: Some(Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: req.mutable_parameters,
                }),
                message: String::new(),
            }
        } else {
            ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: refusals.join("; "),
            }
        };
        Ok(Response::new(resp))
    }

    async fn list_volumes(
        &self,
        req: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let req = req.into_inner();
        let volumes: Vec<model::Volume> = self
            .d
            .api
            .volumes()
            .await?
            .into_iter()
            .filter(|v| naming::is_driver_name(&v.name))
            .collect();
        // One read of the recent replacements for every entry's count.
        let events = self
            .d
            .api
            .recent_events(None, health::RESTARTED, health::RESTART_WINDOW)
            .await?;
        let restarts = health::restarts(&events);
        let (volumes, next_token) = page(
            "ListVolumes",
            volumes,
            |v| v.name.as_str(),
            req.max_entries,
            &req.starting_token,
        )?;
        Ok(Response::new(ListVolumesResponse {
            entries: volumes
                .iter()
                .map(|v| Entry {
                    volume: Some(self.csi_volume(v)),
                    // VOLUME_CONDITION: each entry says its condition.
                    status: Some(ListVolumeStatus {
                        published_node_ids: Vec::new(),
                        volume_condition: Some(health::of_volume(
                            v,
                            restarts.get(&v.id).map_or(&[], Vec::as_slice),
                        )),
                    }),
                })
                .collect(),
            next_token,
        }))
    }

    async fn get_capacity(
        &self,
        req: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let req = req.into_inner();
        let none = || {
            Ok(Response::new(GetCapacityResponse {
                available_capacity: 0,
                maximum_volume_size: None,
                minimum_volume_size: None,
            }))
        };
        // Another node's capacity, or volumes this driver cannot create.
        if let Some(t) = &req.accessible_topology
            && !is_node(t, &self.d.node_id)
        {
            return none();
        }
        if req
            .volume_capabilities
            .iter()
            .any(|c| capability::parse(c).is_err())
        {
            return none();
        }
        parse_params("*", &req.parameters)?;
        let root = self.d.image_root("*").await?;
        // The API reports no free space, and the driver runs on the node
        // whose image root this is: statvfs it here.
        let stat = rustix::fs::statvfs(&root).map_err(|e| CsiError::Precondition {
            volume: "*".into(),
            reason: format!(
                "cannot statvfs the image root {} ({e}): the driver must see it at the same path as the service",
                root.display()
            ),
        })?;
        let available = stat.f_bavail.saturating_mul(stat.f_frsize);
        Ok(Response::new(GetCapacityResponse {
            available_capacity: available.min(i64::MAX as u64) as i64,
            maximum_volume_size: None,
            minimum_volume_size: Some(512),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: [
                rpc::Type::CreateDeleteVolume,
                rpc::Type::ListVolumes,
                rpc::Type::GetCapacity,
                rpc::Type::ExpandVolume,
                rpc::Type::SingleNodeMultiWriter,
                rpc::Type::CreateDeleteSnapshot,
                rpc::Type::ListSnapshots,
                rpc::Type::CloneVolume,
                rpc::Type::ModifyVolume,
                rpc::Type::GetVolume,
                rpc::Type::VolumeCondition,
            ]
            .into_iter()
            .map(rpc_cap)
            .collect(),
        }))
    }

    async fn create_snapshot(
        &self,
        req: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let req = req.into_inner();
        require("CreateSnapshot", "name", req.name.is_empty())?;
        require(
            "CreateSnapshot",
            "source_volume_id",
            req.source_volume_id.is_empty(),
        )?;
        if let Some(k) = req
            .parameters
            .keys()
            .find(|k| !k.starts_with("csi.storage.k8s.io/"))
        {
            return Err(CsiError::Invalid {
                volume: req.name.clone(),
                reason: format!("unknown snapshot parameter '{k}' (snapshots take none)"),
            }
            .into());
        }
        let source =
            self.own_id(&req.source_volume_id, false)?
                .ok_or_else(|| CsiError::NotFound {
                    volume: req.source_volume_id.clone(),
                    reason: "no such volume".into(),
                })?;
        let name = naming::blockplane_name(&req.name);
        tracing::info!(csi_name = %req.name, snapshot = %name, source = %source.name, "CreateSnapshot");
        let d = self.d.clone();
        let image = self
            .d
            .controller_calls
            .run(
                &name.clone(),
                snapshots::create(d, req.name, source.name.clone(), name),
            )
            .await?;
        Ok(Response::new(CreateSnapshotResponse {
            snapshot: Some(snapshots::csi_snapshot(
                &self.d.node_id,
                &image,
                &source.name,
            )),
        }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let req = req.into_inner();
        require("DeleteSnapshot", "snapshot_id", req.snapshot_id.is_empty())?;
        // An id that is not this driver's names no snapshot: deleted already.
        let Some(id) = self.own_id(&req.snapshot_id, false)? else {
            return Ok(Response::new(DeleteSnapshotResponse {}));
        };
        tracing::info!(snapshot = %id.name, "DeleteSnapshot");
        let d = self.d.clone();
        self.d
            .controller_calls
            .run(&id.name.clone(), snapshots::delete(d, id.name))
            .await?;
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        Ok(Response::new(
            snapshots::list(&self.d, &req.into_inner()).await?,
        ))
    }

    async fn controller_expand_volume(
        &self,
        req: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = req.into_inner();
        require(
            "ControllerExpandVolume",
            "volume_id",
            req.volume_id.is_empty(),
        )?;
        let Some(range) = req.capacity_range else {
            return Err(CsiError::Missing {
                call: "ControllerExpandVolume",
                field: "capacity_range",
            }
            .into());
        };
        let not_found = || CsiError::NotFound {
            volume: req.volume_id.clone(),
            reason: "no such volume".into(),
        };
        let id = self.own_id(&req.volume_id, true)?.ok_or_else(not_found)?;
        let size = size_for(&id.name, Some(&range))?;
        // A block volume has no filesystem to grow on the node.
        let node_expansion_required = !req
            .volume_capability
            .as_ref()
            .and_then(|c| capability::parse(c).ok())
            .is_some_and(|c| c.access == Access::Block);
        tracing::info!(volume = %id.name, size, "ControllerExpandVolume");
        let d = self.d.clone();
        let name = id.name.clone();
        let capacity = self
            .d
            .controller_calls
            .run(&id.name, async move {
                let v = d.api.volume(&name).await?.ok_or_else(|| CsiError::NotFound {
                    volume: name.clone(),
                    reason: "no such volume".into(),
                })?;
                let pending = |reason: String| CsiError::Precondition {
                    volume: name.clone(),
                    reason: format!(
                        "the image grew but the device keeps its old size until the volume is attached again: {reason}"
                    ),
                };
                if v.resize_pending {
                    return Err(pending(format!("device is {} bytes", v.size_bytes)));
                }
                if v.size_bytes >= size {
                    return Ok(v.size_bytes);
                }
                // An image gone since is the resize's own 404 to tell.
                let image = d.api.image(&name).await?;
                let grow = model::ResizeImageRequest {
                    size_bytes: image.map_or(size, |i| i.file_bytes_for(size)),
                };
                let answer = d.api.resize_image(&name, &grow).await?;
                if let Some(r) = answer.volumes.iter().find(|r| r.volume_id == v.id)
                    && r.resize_pending
                {
                    return Err(pending(r.message.clone()));
                }
                Ok(answer.image.device_bytes())
            })
            .await?;
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: capacity as i64,
            node_expansion_required,
        }))
    }

    async fn controller_get_volume(
        &self,
        req: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        let req = req.into_inner();
        require("ControllerGetVolume", "volume_id", req.volume_id.is_empty())?;
        let not_found = || CsiError::NotFound {
            volume: req.volume_id.clone(),
            reason: "no such volume".into(),
        };
        let id = self.own_id(&req.volume_id, false)?.ok_or_else(not_found)?;
        let v = self.d.api.volume(&id.name).await?.ok_or_else(not_found)?;
        let events = self
            .d
            .api
            .recent_events(Some(&id.name), health::RESTARTED, health::RESTART_WINDOW)
            .await?;
        let restarts = health::restarts(&events);
        let mine = restarts.get(&v.id).map_or(&[][..], Vec::as_slice);
        Ok(Response::new(ControllerGetVolumeResponse {
            volume: Some(self.csi_volume(&v)),
            status: Some(VolumeStatus {
                // No ControllerPublish: nothing is published by this service.
                published_node_ids: Vec::new(),
                volume_condition: Some(health::of_volume(&v, mine)),
            }),
        }))
    }

    async fn controller_modify_volume(
        &self,
        req: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        let req = req.into_inner();
        require(
            "ControllerModifyVolume",
            "volume_id",
            req.volume_id.is_empty(),
        )?;
        let not_found = || CsiError::NotFound {
            volume: req.volume_id.clone(),
            reason: "no such volume".into(),
        };
        // Another node's volume: ABORTED, as for an expansion, so that its
        // own node's resizer makes the change.
        let id = self.own_id(&req.volume_id, true)?.ok_or_else(not_found)?;
        let wanted = parse_mutable(&req.volume_id, &req.mutable_parameters)?;
        tracing::info!(volume = %id.name, ?wanted, "ControllerModifyVolume");
        let d = self.d.clone();
        let name = id.name.clone();
        self.d
            .controller_calls
            .run(&id.name, async move {
                let v = d
                    .api
                    .volume(&name)
                    .await?
                    .ok_or_else(|| CsiError::NotFound {
                        volume: name.clone(),
                        reason: "no such volume".into(),
                    })?;
                let patch = wanted.patch(&v);
                if patch.dispatch.is_none() && patch.qos.is_none() {
                    return Ok(());
                }
                // The API checks every change before it makes one: a refusal
                // (QoS on loop, a policy the backend lacks) changes nothing,
                // and is the spec's INVALID_ARGUMENT (parameters the volume
                // cannot support), not the host's state.
                d.api
                    .patch_volume(&name, &patch)
                    .await
                    .map(drop)
                    .map_err(|e| match e {
                        CsiError::Api {
                            status: hyper::StatusCode::UNPROCESSABLE_ENTITY,
                            message,
                            ..
                        } => CsiError::Invalid {
                            volume: name.clone(),
                            reason: message,
                        },
                        e => e,
                    })
            })
            .await?;
        Ok(Response::new(ControllerModifyVolumeResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_the_apis_and_typos_are_refused() {
        let m = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>()
        };
        let p = parse_params(
            "v",
            &m(&[
                ("backend", "ublk"),
                ("dispatch", "threaded"),
                ("allocation", "full"),
                ("qos.iops", "500"),
                ("qos.bytes_per_sec", "100M"),
                ("csi.storage.k8s.io/fstype", "xfs"),
            ]),
        )
        .unwrap();
        assert_eq!(p.backend, BackendChoice::Ublk);
        assert_eq!(p.dispatch, DispatchPolicy::Threaded);
        assert_eq!(p.allocation, Allocation::Full);
        let qos = p.qos.unwrap();
        assert_eq!((qos.iops, qos.bytes_per_sec), (Some(500), Some(100 << 20)));
        assert_eq!(parse_params("v", &m(&[])).unwrap().qos, None);
        for bad in [
            ("backend", "nbd"),
            ("qos.iops", "x"),
            ("qos.iops", "0"),
            ("sizee", "1"),
        ] {
            let e = parse_params("v", &m(&[bad])).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}");
            assert!(e.to_string().contains(bad.0), "{e}");
        }
    }

    #[test]
    fn mutable_parameters_merge_into_the_limits_and_zero_lifts_one() {
        let m = |kv: &[(&str, &str)]| {
            let p: HashMap<String, String> = kv
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            parse_mutable("v", &p)
        };
        let now = Some(Qos {
            iops: Some(100),
            bytes_per_sec: Some(1 << 20),
            ..Qos::default()
        });
        // An absent key changes nothing; a present one sets or lifts.
        assert_eq!(m(&[]).unwrap().qos_over(now), now);
        let q = m(&[("qos.iops", "0")]).unwrap().qos_over(now).unwrap();
        assert_eq!((q.iops, q.bytes_per_sec), (None, Some(1 << 20)));
        let none = m(&[("qos.iops", "0"), ("qos.bytes_per_sec", "0")]).unwrap();
        assert_eq!(none.qos_over(now), None);
        let q = m(&[("qos.burst_bytes", "4M")])
            .unwrap()
            .qos_over(None)
            .unwrap();
        assert_eq!(q.burst_bytes, Some(4 << 20));
        assert_eq!(
            m(&[("dispatch", "kernel")]).unwrap().dispatch,
            Some(DispatchPolicy::Kernel)
        );
        for bad in ["backend", "allocation", "qos.iopz"] {
            let e = m(&[(bad, "1")]).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }
}
