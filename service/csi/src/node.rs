//! The CSI Node service: makes this node's volumes usable by workloads.
//!
//! - Block: staging does nothing; publishing bind-mounts the device node onto
//!   the target file.
//! - Mount: staging creates a filesystem when the device holds none (ext4 or
//!   xfs) and mounts it at the staging path; publishing bind-mounts the
//!   staging path onto the target directory with the mount-point flags.
//!
//! Each call is idempotent: it first looks at what is mounted where, and a
//! repeated call that finds its work done answers OK (ALREADY_EXISTS when
//! something else is there). One call runs per volume at a time.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::mount::MountFlags;
use tonic::{Request, Response, Status};

use super::capability::{self, Access, Capability};
use super::driver::Driver;
use super::errors::{CsiError, require};
use super::health;
use super::mount::{self, Contents, MountOptions};
use super::naming::VolumeId;
use super::proto::node_server::Node;
use super::proto::node_service_capability::{self, rpc};
use super::proto::volume_usage::Unit;
use super::proto::{
    NodeExpandVolumeRequest, NodeExpandVolumeResponse, NodeGetCapabilitiesRequest,
    NodeGetCapabilitiesResponse, NodeGetInfoRequest, NodeGetInfoResponse,
    NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse, NodePublishVolumeRequest,
    NodePublishVolumeResponse, NodeServiceCapability, NodeStageVolumeRequest,
    NodeStageVolumeResponse, NodeUnpublishVolumeRequest, NodeUnpublishVolumeResponse,
    NodeUnstageVolumeRequest, NodeUnstageVolumeResponse, VolumeUsage,
};
use super::reach;
use blockplane_api::model;
use blockplane_system::mountinfo;

/// The Node service.
#[derive(Debug)]
pub struct NodeService {
    d: Arc<Driver>,
}

impl NodeService {
    /// The Node service of `driver`.
    pub fn new(d: Arc<Driver>) -> Self {
        Self { d }
    }

    /// The volume id of a node call, and whether it is this node's own
    /// (`false`: another node's, reachable over the network or refused
    /// there, [`reach`]).
    fn locate(&self, volume_id: &str) -> Result<(VolumeId, bool), CsiError> {
        let id = VolumeId::parse(volume_id).ok_or_else(|| CsiError::NotFound {
            volume: volume_id.to_string(),
            reason: "no such volume (not an id this driver hands out)".into(),
        })?;
        let own = id.node == self.d.node_id;
        Ok((id, own))
    }

    /// The volume id of a node call, which must name a volume of this node.
    fn own(&self, volume_id: &str) -> Result<VolumeId, CsiError> {
        let id = VolumeId::parse(volume_id).ok_or_else(|| CsiError::NotFound {
            volume: volume_id.to_string(),
            reason: "no such volume (not an id this driver hands out)".into(),
        })?;
        if id.node != self.d.node_id {
            return Err(CsiError::OtherNode {
                volume: volume_id.to_string(),
                owner: id.node,
                node: self.d.node_id.clone(),
            });
        }
        Ok(id)
    }

    /// Unmounts everything at `path` (and removes `path` when the driver
    /// made it), in turn with the volume's other node calls. No API call:
    /// this must work for a volume blockplane no longer has, or while the
    /// service restarts.
    async fn unmount(&self, volume: String, path: PathBuf, remove: bool) -> Result<(), CsiError> {
        let key = volume.clone();
        self.d
            .node_calls
            .run(&key, async move {
                blocking(&volume.clone(), move || {
                    mount::unmount_all(&volume, &path)?;
                    if remove {
                        mount::remove_target(&volume, &path)?;
                    }
                    Ok(())
                })
                .await
            })
            .await
    }
}

fn missing(call: &'static str, field: &'static str) -> Status {
    CsiError::Missing { call, field }.into()
}

/// The volume and its device node; NOT_FOUND when blockplane has no such
/// volume, FAILED_PRECONDITION when it has no device now.
async fn device(d: &Driver, id: &VolumeId) -> Result<(model::Volume, PathBuf), CsiError> {
    let v = d
        .api
        .volume(&id.name)
        .await?
        .ok_or_else(|| CsiError::NotFound {
            volume: id.to_string(),
            reason: "no such volume".into(),
        })?;
    let dev = v.device.clone().ok_or_else(|| CsiError::Precondition {
        volume: id.to_string(),
        reason: format!(
            "has no device (state {}: {})",
            v.state.as_str(),
            v.state_reason.as_deref().unwrap_or("no reason given")
        ),
    })?;
    Ok((v, PathBuf::from(dev)))
}

/// Gives an encrypted volume its key from the node-stage secret: opens its
/// plaintext device again if it is locked (after the node restarted), and
/// checks the key otherwise. A plain volume needs none.
async fn unlock(d: &Driver, id: &VolumeId, key: Option<model::Key>) -> Result<(), CsiError> {
    let Some(v) = d.api.volume(&id.name).await? else {
        return Ok(());
    };
    if !v.encrypted {
        return Ok(());
    }
    let Some(key) = key else {
        return Err(CsiError::Precondition {
            volume: id.to_string(),
            reason: format!(
                "it is encrypted and NodeStageVolume got no secret entry '{}': name a Secret holding its key in the StorageClass's csi.storage.k8s.io/node-stage-secret-name and -namespace",
                super::controller::KEY_SECRET
            ),
        });
    };
    d.api
        .unlock_volume(&id.name, &model::UnlockVolumeRequest { key })
        .await?;
    Ok(())
}

/// Runs blocking work (mounts, filesystem tools) off the async threads.
async fn blocking<T: Send + 'static>(
    volume: &str,
    f: impl FnOnce() -> Result<T, CsiError> + Send + 'static,
) -> Result<T, CsiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CsiError::Internal {
            volume: volume.to_string(),
            reason: format!("blocking task failed: {e}"),
        })?
}

fn dev_of(rdev: u64) -> (u32, u32) {
    (rustix::fs::major(rdev), rustix::fs::minor(rdev))
}

fn rdev_of(volume: &str, device: &Path) -> Result<u64, CsiError> {
    mount::block_rdev(device)
        .map_err(|source| CsiError::Io {
            volume: volume.into(),
            op: "stat",
            path: device.display().to_string(),
            source,
        })?
        .ok_or_else(|| CsiError::Precondition {
            volume: volume.into(),
            reason: format!("{} is not a block device", device.display()),
        })
}

fn mount_table_err(volume: &str, path: &Path, source: std::io::Error) -> CsiError {
    CsiError::Io {
        volume: volume.into(),
        op: "read the mount table for",
        path: path.display().to_string(),
        source,
    }
}

/// Mounts the volume's filesystem at the staging path, creating the
/// filesystem first when the device holds nothing.
fn stage_mount(
    volume: &str,
    device: &Path,
    staging: &Path,
    fstype: &str,
    options: &MountOptions,
    read_only: bool,
) -> Result<(), CsiError> {
    let rdev = rdev_of(volume, device)?;
    mount::ensure_dir(volume, staging)?;
    if let Some(m) =
        mountinfo::mount_at(staging).map_err(|e| mount_table_err(volume, staging, e))?
    {
        if m.dev != dev_of(rdev) {
            return Err(CsiError::Incompatible {
                volume: volume.into(),
                reason: format!(
                    "staging path {} holds another filesystem ({} from {})",
                    staging.display(),
                    m.fstype,
                    m.source
                ),
            });
        }
        if m.read_only() != read_only {
            return Err(CsiError::Incompatible {
                volume: volume.into(),
                reason: format!(
                    "staged at {} {}, asked {}",
                    staging.display(),
                    if m.read_only() {
                        "read-only"
                    } else {
                        "read-write"
                    },
                    if read_only { "read-only" } else { "read-write" }
                ),
            });
        }
        return Ok(());
    }
    match mount::probe(volume, device)? {
        Contents::Empty => {
            tracing::info!(volume, device = %device.display(), fstype, "creating a filesystem");
            mount::mkfs(volume, device, fstype)?;
        }
        Contents::Filesystem(found) if found == fstype => {}
        Contents::Filesystem(found) => {
            return Err(CsiError::Precondition {
                volume: volume.into(),
                reason: format!(
                    "{} holds a {found} filesystem, the capability asks {fstype}",
                    device.display()
                ),
            });
        }
        Contents::Other(what) => {
            return Err(CsiError::Precondition {
                volume: volume.into(),
                reason: format!(
                    "{} holds {what}, not a filesystem; it is never formatted over",
                    device.display()
                ),
            });
        }
    }
    let mut opts = options.clone();
    if read_only {
        opts.flags |= MountFlags::RDONLY;
    }
    mount::mount_device(volume, device, staging, fstype, &opts)
}

/// Refuses a second publication of a volume whose access mode allows one:
/// any other mount of its device but the staging path is a publication.
fn check_single_publication(
    volume: &str,
    rdev: u64,
    staging: &Path,
    target: &Path,
) -> Result<(), CsiError> {
    let (staging, target) = (mountinfo::canonical(staging), mountinfo::canonical(target));
    let others: Vec<String> = mountinfo::mounts_of_device(rdev)
        .map_err(|e| mount_table_err(volume, &target, e))?
        .into_iter()
        .filter(|p| *p != staging && *p != target)
        .map(|p| p.display().to_string())
        .collect();
    if others.is_empty() {
        Ok(())
    } else {
        Err(CsiError::Precondition {
            volume: volume.into(),
            reason: format!(
                "access mode SINGLE_NODE_SINGLE_WRITER allows one publication, and it is published at {}",
                others.join(", ")
            ),
        })
    }
}

fn read_only_mismatch(volume: &str, target: &Path, is_ro: bool) -> CsiError {
    CsiError::Incompatible {
        volume: volume.into(),
        reason: format!(
            "published at {} {}, asked the other",
            target.display(),
            if is_ro { "read-only" } else { "read-write" }
        ),
    }
}

/// Bind-mounts the device node onto the target file.
fn publish_block(
    volume: &str,
    device: &Path,
    staging: &Path,
    target: &Path,
    cap: &Capability,
    read_only: bool,
) -> Result<(), CsiError> {
    let rdev = rdev_of(volume, device)?;
    match mount::block_rdev(target) {
        Ok(Some(r)) if r == rdev => {
            let m = mountinfo::mount_at(target).map_err(|e| mount_table_err(volume, target, e))?;
            let is_ro = m.is_some_and(|m| m.read_only());
            return if is_ro == read_only {
                Ok(())
            } else {
                Err(read_only_mismatch(volume, target, is_ro))
            };
        }
        Ok(Some(_)) => {
            return Err(CsiError::Incompatible {
                volume: volume.into(),
                reason: format!("target {} is another block device", target.display()),
            });
        }
        Ok(None) => {
            if mountinfo::mount_at(target)
                .map_err(|e| mount_table_err(volume, target, e))?
                .is_some()
            {
                return Err(CsiError::Incompatible {
                    volume: volume.into(),
                    reason: format!("something else is mounted at {}", target.display()),
                });
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(CsiError::Io {
                volume: volume.into(),
                op: "stat",
                path: target.display().to_string(),
                source,
            });
        }
    }
    if cap.single_publication {
        check_single_publication(volume, rdev, staging, target)?;
    }
    if let Some(parent) = target.parent() {
        mount::ensure_dir(volume, parent)?;
    }
    mount::ensure_file(volume, target)?;
    let flags = if read_only {
        MountFlags::RDONLY
    } else {
        MountFlags::empty()
    };
    mount::bind(volume, device, target, flags)
}

/// Bind-mounts the staged filesystem onto the target directory.
fn publish_mount(
    volume: &str,
    device: &Path,
    staging: &Path,
    target: &Path,
    cap: &Capability,
    read_only: bool,
) -> Result<(), CsiError> {
    let Access::Mount { options, .. } = &cap.access else {
        return Err(CsiError::Internal {
            volume: volume.into(),
            reason: "publish_mount called for a block capability".into(),
        });
    };
    let staged = mountinfo::mount_at(staging)
        .map_err(|e| mount_table_err(volume, staging, e))?
        .ok_or_else(|| CsiError::Precondition {
            volume: volume.into(),
            reason: format!(
                "not staged at {} (NodeStageVolume first)",
                staging.display()
            ),
        })?;
    if let Some(m) = mountinfo::mount_at(target).map_err(|e| mount_table_err(volume, target, e))? {
        if m.dev != staged.dev {
            return Err(CsiError::Incompatible {
                volume: volume.into(),
                reason: format!(
                    "target {} holds another filesystem ({} from {})",
                    target.display(),
                    m.fstype,
                    m.source
                ),
            });
        }
        return if m.read_only() == read_only {
            Ok(())
        } else {
            Err(read_only_mismatch(volume, target, m.read_only()))
        };
    }
    if cap.single_publication {
        check_single_publication(volume, rdev_of(volume, device)?, staging, target)?;
    }
    mount::ensure_dir(volume, target)?;
    let mut flags = options.mount_point_flags();
    if read_only {
        flags |= MountFlags::RDONLY;
    }
    mount::bind(volume, staging, target, flags)
}

/// Where the volume is at `path`: its block device node, or a mount of its
/// filesystem (then the mount's filesystem type).
enum AtPath {
    Block,
    Mounted(String),
}

fn volume_at(volume: &str, path: &Path, rdev: u64) -> Result<AtPath, CsiError> {
    let not_here = || CsiError::NotFound {
        volume: volume.into(),
        reason: format!("the volume is not at {}", path.display()),
    };
    match mount::block_rdev(path) {
        Ok(Some(r)) if r == rdev => return Ok(AtPath::Block),
        Ok(Some(_)) => return Err(not_here()),
        Ok(None) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CsiError::NotFound {
                volume: volume.into(),
                reason: format!("path {} does not exist", path.display()),
            });
        }
        Err(source) => {
            return Err(CsiError::Io {
                volume: volume.into(),
                op: "stat",
                path: path.display().to_string(),
                source,
            });
        }
    }
    match mountinfo::mount_at(path).map_err(|e| mount_table_err(volume, path, e))? {
        Some(m) if m.dev == dev_of(rdev) => Ok(AtPath::Mounted(m.fstype)),
        _ => Err(not_here()),
    }
}

fn rpc_cap(t: rpc::Type) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(node_service_capability::Type::Rpc(
            node_service_capability::Rpc { r#type: t as i32 },
        )),
    }
}

fn parse_cap(volume: &str, cap: &super::proto::VolumeCapability) -> Result<Capability, Status> {
    capability::parse(cap).map_err(|reason| {
        CsiError::Invalid {
            volume: volume.into(),
            reason,
        }
        .into()
    })
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        req: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = req.into_inner();
        require("NodeStageVolume", "volume_id", req.volume_id.is_empty())?;
        require(
            "NodeStageVolume",
            "staging_target_path",
            req.staging_target_path.is_empty(),
        )?;
        let Some(cap) = req.volume_capability.as_ref() else {
            return Err(missing("NodeStageVolume", "volume_capability"));
        };
        let cap = parse_cap(&req.volume_id, cap)?;
        let (id, own) = self.locate(&req.volume_id)?;
        tracing::info!(volume = %id.name, staging = %req.staging_target_path, ?cap, own, "NodeStageVolume");
        let d = self.d.clone();
        let staging = PathBuf::from(req.staging_target_path);
        let key = req
            .secrets
            .get(super::controller::KEY_SECRET)
            .map(model::Key::new);
        let (context, secrets) = (req.volume_context, req.secrets);
        self.d
            .node_calls
            .run(&req.volume_id, async move {
                let dev = match own {
                    true => {
                        unlock(&d, &id, key).await?;
                        device(&d, &id).await?.1
                    }
                    false => reach::connect(&d, &id, &context, &secrets).await?,
                };
                match cap.access {
                    // Nothing to prepare: publishing binds the device node.
                    Access::Block => Ok(()),
                    Access::Mount { fstype, options } => {
                        let name = id.to_string();
                        blocking(&id.to_string(), move || {
                            stage_mount(&name, &dev, &staging, &fstype, &options, cap.read_only)
                        })
                        .await
                    }
                }
            })
            .await?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        req: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = req.into_inner();
        require("NodeUnstageVolume", "volume_id", req.volume_id.is_empty())?;
        require(
            "NodeUnstageVolume",
            "staging_target_path",
            req.staging_target_path.is_empty(),
        )?;
        tracing::info!(volume = %req.volume_id, staging = %req.staging_target_path, "NodeUnstageVolume");
        let other = VolumeId::parse(&req.volume_id).filter(|id| id.node != self.d.node_id);
        self.unmount(req.volume_id.clone(), req.staging_target_path.into(), false)
            .await?;
        // Another node's volume: this node's connection to it goes too.
        if let Some(id) = other {
            let d = self.d.clone();
            self.d
                .node_calls
                .run(
                    &req.volume_id,
                    async move { reach::disconnect(&d, &id).await },
                )
                .await?;
        }
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = req.into_inner();
        require("NodePublishVolume", "volume_id", req.volume_id.is_empty())?;
        require(
            "NodePublishVolume",
            "target_path",
            req.target_path.is_empty(),
        )?;
        let Some(cap) = req.volume_capability.as_ref() else {
            return Err(missing("NodePublishVolume", "volume_capability"));
        };
        // The driver stages every volume (STAGE_UNSTAGE_VOLUME).
        require(
            "NodePublishVolume",
            "staging_target_path",
            req.staging_target_path.is_empty(),
        )?;
        let cap = parse_cap(&req.volume_id, cap)?;
        let (id, own) = self.locate(&req.volume_id)?;
        let read_only = req.readonly || cap.read_only;
        tracing::info!(volume = %id.name, target = %req.target_path, read_only, "NodePublishVolume");
        let d = self.d.clone();
        let staging = PathBuf::from(req.staging_target_path);
        let target = PathBuf::from(req.target_path);
        self.d
            .node_calls
            .run(&req.volume_id, async move {
                let dev = match own {
                    true => device(&d, &id).await?.1,
                    false => {
                        reach::device(&d, &id)
                            .await?
                            .ok_or_else(|| CsiError::Precondition {
                                volume: id.to_string(),
                                reason: "it lives on another node and is not staged here".into(),
                            })?
                    }
                };
                let name = id.to_string();
                blocking(&id.to_string(), move || match cap.access {
                    Access::Block => publish_block(&name, &dev, &staging, &target, &cap, read_only),
                    Access::Mount { .. } => {
                        publish_mount(&name, &dev, &staging, &target, &cap, read_only)
                    }
                })
                .await
            })
            .await?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = req.into_inner();
        require("NodeUnpublishVolume", "volume_id", req.volume_id.is_empty())?;
        require(
            "NodeUnpublishVolume",
            "target_path",
            req.target_path.is_empty(),
        )?;
        tracing::info!(volume = %req.volume_id, target = %req.target_path, "NodeUnpublishVolume");
        // The driver created the target; it removes it (spec).
        self.unmount(req.volume_id, req.target_path.into(), true)
            .await?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = req.into_inner();
        require("NodeGetVolumeStats", "volume_id", req.volume_id.is_empty())?;
        require(
            "NodeGetVolumeStats",
            "volume_path",
            req.volume_path.is_empty(),
        )?;
        let id = self.own(&req.volume_id)?;
        // Read-only: no in-flight lock, so stats never abort a real call.
        let v = self
            .d
            .api
            .volume(&id.name)
            .await?
            .ok_or_else(|| CsiError::NotFound {
                volume: id.to_string(),
                reason: "no such volume".into(),
            })?;
        let cond = health::of_device(&v);
        let Some(dev) = v.device.clone() else {
            return Ok(Response::new(NodeGetVolumeStatsResponse {
                usage: vec![],
                volume_condition: Some(cond),
            }));
        };
        let name = id.to_string();
        let path = PathBuf::from(req.volume_path);
        let usage = blocking(&id.to_string(), move || {
            let rdev = rdev_of(&name, Path::new(&dev))?;
            let i = |n: u64| n.min(i64::MAX as u64) as i64;
            Ok(match volume_at(&name, &path, rdev)? {
                AtPath::Block => vec![VolumeUsage {
                    available: 0,
                    total: i(mount::device_size(&name, &path)?),
                    used: 0,
                    unit: Unit::Bytes as i32,
                }],
                AtPath::Mounted(_) => {
                    let [ba, bt, bu, ia, it, iu] = mount::fs_usage(&name, &path)?;
                    vec![
                        VolumeUsage {
                            available: i(ba),
                            total: i(bt),
                            used: i(bu),
                            unit: Unit::Bytes as i32,
                        },
                        VolumeUsage {
                            available: i(ia),
                            total: i(it),
                            used: i(iu),
                            unit: Unit::Inodes as i32,
                        },
                    ]
                }
            })
        })
        .await?;
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(cond),
        }))
    }

    async fn node_expand_volume(
        &self,
        req: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = req.into_inner();
        require("NodeExpandVolume", "volume_id", req.volume_id.is_empty())?;
        require(
            "NodeExpandVolume",
            "volume_path",
            req.volume_path.is_empty(),
        )?;
        let id = self.own(&req.volume_id)?;
        let required = req
            .capacity_range
            .as_ref()
            .map_or(0, |r| r.required_bytes.max(0) as u64);
        tracing::info!(volume = %id.name, path = %req.volume_path, required, "NodeExpandVolume");
        let d = self.d.clone();
        let path = PathBuf::from(req.volume_path);
        let size = self
            .d
            .node_calls
            .run(&req.volume_id, async move {
                let (_, dev) = device(&d, &id).await?;
                let name = id.to_string();
                blocking(&id.to_string(), move || {
                    let rdev = rdev_of(&name, &dev)?;
                    let at = volume_at(&name, &path, rdev)?;
                    let size = mount::device_size(&name, &dev)?;
                    if size < required {
                        return Err(CsiError::Precondition {
                            volume: name,
                            reason: format!(
                                "the device is {size} bytes, {required} required: ControllerExpandVolume first (or the device follows at its next attach)"
                            ),
                        });
                    }
                    if let AtPath::Mounted(fstype) = at {
                        mount::grow_fs(&name, &dev, &path, &fstype)?;
                    }
                    Ok(size)
                })
                .await
            })
            .await?;
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: size.min(i64::MAX as u64) as i64,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: [
                rpc::Type::StageUnstageVolume,
                rpc::Type::GetVolumeStats,
                rpc::Type::ExpandVolume,
                rpc::Type::VolumeCondition,
                rpc::Type::SingleNodeMultiWriter,
            ]
            .into_iter()
            .map(rpc_cap)
            .collect(),
        }))
    }

    async fn node_get_info(
        &self,
        _req: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.d.node_id.clone(),
            // Loop, ublk and dm devices are not a scarce resource of the node.
            max_volumes_per_node: 0,
            accessible_topology: Some(self.d.topology()),
        }))
    }
}
