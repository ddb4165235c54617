//! CSI driver tests, in csi-sanity's categories (Identity, Controller, Node,
//! Expand). Each test starts a real `blockplane serve` (the black-box
//! harness: temp data dir, real SQLite, real loop devices) and a real
//! `blockplane csi` beside it, and drives the driver over its unix socket
//! with a tonic client generated from the same proto. Mounts, mkfs and
//! filesystem growth are real too: these tests need root.

// A test crate: its `pub` items serve its own modules, not readers of an API.
#![allow(missing_docs)]

use blockplane_test_support::wait::{eventually, in_vm};
use blockplane_test_support::{drift, harness};

mod controller;
mod expand;
mod identity;
mod modify;
mod node;
mod snapshot_metadata;
mod snapshots;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blockplane_csi::proto::controller_client::ControllerClient;
use blockplane_csi::proto::identity_client::IdentityClient;
use blockplane_csi::proto::node_client::NodeClient;
use blockplane_csi::proto::snapshot_metadata_client::SnapshotMetadataClient;
use blockplane_csi::proto::volume_capability::access_mode::Mode;
use blockplane_csi::proto::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use blockplane_csi::proto::{
    CapacityRange, CreateVolumeRequest, DeleteVolumeRequest, ListVolumesRequest,
    ListVolumesResponse, NodePublishVolumeRequest, NodeStageVolumeRequest,
    NodeUnpublishVolumeRequest, NodeUnstageVolumeRequest, Volume, VolumeCapability,
};
use harness::{Opts, Service};
use tonic::Code;
use tonic::transport::Channel;

/// The node id every test driver serves.
pub const NODE: &str = "test-node";
/// The driver's topology key.
pub const TOPOLOGY_KEY: &str = "blockplane.io/node";
/// One MiB.
pub const MIB: i64 = 1 << 20;

/// A blockplane service and a CSI driver for it, with clients of the
/// driver's three services. Dropping it unmounts whatever the test left
/// under its directory, stops the driver, then the service.
pub struct Csi {
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
    pub snapshot_metadata: SnapshotMetadataClient<Channel>,
    /// Where staging and target paths live.
    pub dir: PathBuf,
    pub sock: PathBuf,
    driver: Option<Child>,
    /// The driver's extra arguments, for a restart.
    extra: Vec<String>,
    log: PathBuf,
    /// Declared last: dropped after the driver and the mounts are gone.
    pub svc: Service,
}

impl Csi {
    /// A service with default options and a driver for node [`NODE`].
    pub async fn start() -> Self {
        Self::start_with(Opts::default(), &[]).await
    }

    /// A service with `opts` and a driver with `extra` arguments.
    pub async fn start_with(mut opts: Opts, extra: &[&str]) -> Self {
        opts.extra_args
            .extend(harness::CHEAP_KEYS.iter().map(|a| a.to_string()));
        let svc = Service::start_with(opts).await;
        let dir = svc.dir.path().join("csi");
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("csi.sock");
        let log = svc.dir.path().join("driver.log");
        let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        let mut driver = spawn_driver(&svc, &sock, &log, &extra);
        let channel = connect(&sock, &mut driver, &log).await;
        Self {
            identity: IdentityClient::new(channel.clone()),
            controller: ControllerClient::new(channel.clone()),
            snapshot_metadata: SnapshotMetadataClient::new(channel.clone()),
            node: NodeClient::new(channel),
            dir,
            sock,
            driver: Some(driver),
            extra,
            log,
            svc,
        }
    }

    /// Kills the driver (SIGKILL: it keeps no state to save) and starts a
    /// new one with the same arguments, as a DaemonSet's restarted pod
    /// would; the clients then talk to the new one.
    pub async fn restart_driver(&mut self) {
        if let Some(mut d) = self.driver.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        // The old socket file would look like a listening driver.
        let _ = std::fs::remove_file(&self.sock);
        let mut driver = spawn_driver(&self.svc, &self.sock, &self.log, &self.extra);
        let channel = connect(&self.sock, &mut driver, &self.log).await;
        self.identity = IdentityClient::new(channel.clone());
        self.controller = ControllerClient::new(channel.clone());
        self.snapshot_metadata = SnapshotMetadataClient::new(channel.clone());
        self.node = NodeClient::new(channel);
        self.driver = Some(driver);
    }

    /// The driver's log so far.
    pub fn driver_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A staging directory (the CO creates it).
    pub fn staging(&self, name: &str) -> PathBuf {
        let p = self.dir.join("staging").join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// A target path whose parent exists (the driver creates the target).
    pub fn target(&self, name: &str) -> PathBuf {
        let parent = self.dir.join("pods").join(name);
        std::fs::create_dir_all(&parent).unwrap();
        parent.join("volume")
    }

    /// Creates a volume with `required` bytes (panics on error).
    /// Without parameters a volume gets the host's best path for its sparse
    /// image: dm `kernel` (a table over a private loop device) in the test
    /// VM, loop on a host kernel without dm; checked here, so that the VM
    /// lane really tests the driver over what a user gets by default.
    pub async fn create(&self, name: &str, required: i64, cap: VolumeCapability) -> Volume {
        let v = self
            .create_with(name, required, cap, &[])
            .await
            .unwrap_or_else(|e| panic!("CreateVolume {name}: {e:?}\n{}", self.driver_log()));
        let (backend, node) = if in_vm() {
            ("dm", "/dev/dm-")
        } else {
            ("loop", "/dev/loop")
        };
        let bp = self.bp_volume(&v.volume_id).await;
        assert_eq!(bp["backend"], backend, "{name}: {bp}");
        assert!(
            bp["device"].as_str().unwrap().starts_with(node),
            "{name}: {bp}"
        );
        v
    }

    /// CreateVolume with StorageClass parameters.
    pub async fn create_with(
        &self,
        name: &str,
        required: i64,
        cap: VolumeCapability,
        params: &[(&str, &str)],
    ) -> Result<Volume, tonic::Status> {
        self.controller
            .clone()
            .create_volume(create_req(name, required, cap, params))
            .await
            .map(|r| {
                r.into_inner()
                    .volume
                    .expect("CreateVolume answered no volume")
            })
    }

    /// CreateVolume with StorageClass parameters and the provisioner's
    /// secret entries.
    pub async fn create_with_secrets(
        &self,
        name: &str,
        required: i64,
        cap: VolumeCapability,
        params: &[(&str, &str)],
        secrets: &[(&str, &str)],
    ) -> Result<Volume, tonic::Status> {
        let mut req = create_req(name, required, cap, params);
        req.secrets = to_map(secrets);
        self.controller.clone().create_volume(req).await.map(|r| {
            r.into_inner()
                .volume
                .expect("CreateVolume answered no volume")
        })
    }

    /// DeleteVolume.
    pub async fn delete(&self, volume_id: &str) -> Result<(), tonic::Status> {
        self.controller
            .clone()
            .delete_volume(DeleteVolumeRequest {
                volume_id: volume_id.into(),
                secrets: HashMap::new(),
            })
            .await
            .map(drop)
    }

    /// ListVolumes, one page of every entry.
    pub async fn list_volumes(&self) -> ListVolumesResponse {
        self.controller
            .clone()
            .list_volumes(ListVolumesRequest::default())
            .await
            .expect("ListVolumes")
            .into_inner()
    }

    /// NodeStageVolume.
    pub async fn stage(
        &self,
        volume_id: &str,
        staging: &Path,
        cap: VolumeCapability,
    ) -> Result<(), tonic::Status> {
        self.node
            .clone()
            .node_stage_volume(NodeStageVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(drop)
    }

    /// NodeStageVolume with the node-stage secret's entries.
    pub async fn stage_with_secrets(
        &self,
        volume_id: &str,
        staging: &Path,
        cap: VolumeCapability,
        secrets: &[(&str, &str)],
    ) -> Result<(), tonic::Status> {
        self.node
            .clone()
            .node_stage_volume(NodeStageVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap),
                secrets: to_map(secrets),
                ..Default::default()
            })
            .await
            .map(drop)
    }

    /// NodeUnstageVolume.
    pub async fn unstage(&self, volume_id: &str, staging: &Path) -> Result<(), tonic::Status> {
        self.node
            .clone()
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .map(drop)
    }

    /// NodePublishVolume.
    pub async fn publish(
        &self,
        volume_id: &str,
        staging: &Path,
        target: &Path,
        cap: VolumeCapability,
        readonly: bool,
    ) -> Result<(), tonic::Status> {
        self.node
            .clone()
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap),
                readonly,
                ..Default::default()
            })
            .await
            .map(drop)
    }

    /// NodeUnpublishVolume.
    pub async fn unpublish(&self, volume_id: &str, target: &Path) -> Result<(), tonic::Status> {
        self.node
            .clone()
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume_id.into(),
                target_path: target.display().to_string(),
            })
            .await
            .map(drop)
    }

    /// The blockplane volume behind a CSI volume id, from the API.
    pub async fn bp_volume(&self, volume_id: &str) -> serde_json::Value {
        let name = volume_id.rsplit_once('/').unwrap().1;
        let a = self.svc.get(&format!("/v1/volumes/{name}")).await;
        assert_eq!(a.status, 200, "{}", a.body);
        a.body
    }

    /// The device node of a CSI volume.
    pub async fn device(&self, volume_id: &str) -> String {
        self.bp_volume(volume_id).await["device"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// The pid of the blockplane service process.
    pub fn service_pid(&self) -> i32 {
        self.svc.pid() as i32
    }
}

impl Drop for Csi {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = self.driver_log();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!(
                "----- driver log -----\n{}",
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        }
        if let Some(mut d) = self.driver.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        unmount_under(&self.dir);
        self.svc.stop_and_clean();
        if in_vm() {
            // The guest runs one test at a time: a dm device left now is
            // this test's, and would stop the next one's service.
            for e in std::fs::read_dir("/sys/block")
                .into_iter()
                .flatten()
                .flatten()
            {
                if let Some(name) = harness::remove_blockplane_dm(&e.file_name().to_string_lossy())
                {
                    eprintln!("removed {name}, left by the test");
                }
            }
        }
    }
}

/// Unmounts everything mounted under `dir`, deepest first.
pub fn unmount_under(dir: &Path) {
    let mut points: Vec<PathBuf> = blockplane_system::mountinfo::mounts()
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        // A plain unmount lets the device go at once; a lazy one only when
        // the kernel gets to it, and the volume's removal after it would
        // find its device still claimed (a dm device then outlives the
        // test and the next test's service refuses to start beside it).
        if rustix::mount::unmount(&p, rustix::mount::UnmountFlags::empty()).is_err() {
            let _ = rustix::mount::unmount(&p, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// Starts `blockplane csi` for node [`NODE`] against `svc`, listening on
/// `sock`, its output appended to `log`.
fn spawn_driver(svc: &Service, sock: &Path, log: &Path, extra: &[String]) -> Child {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let mut cmd = Command::new(harness::bin());
    cmd.arg("--api")
        .arg(format!("unix:{}", svc.sock.display()))
        .arg("csi")
        .arg("--endpoint")
        .arg(format!("unix://{}", sock.display()));
    // A test with two nodes names each; the rest serve NODE.
    if !extra.iter().any(|a| a == "--node-id") {
        cmd.args(["--node-id", NODE]);
    }
    cmd.args(extra)
        .env_remove("BLOCKPLANE_TOKEN")
        .env("BLOCKPLANE_LOG", "info,blockplane=debug")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    if let Some(t) = &svc.opts.token {
        cmd.env("BLOCKPLANE_TOKEN", t);
    }
    cmd.spawn().expect("start blockplane csi")
}

async fn connect(sock: &Path, driver: &mut Child, log: &Path) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if sock.exists() {
            let path = sock.to_path_buf();
            let ch = tonic::transport::Endpoint::from_static("http://csi.local")
                .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                    let path = path.clone();
                    async move {
                        tokio::net::UnixStream::connect(path)
                            .await
                            .map(hyper_util::rt::TokioIo::new)
                    }
                }))
                .await;
            if let Ok(ch) = ch {
                return ch;
            }
        }
        if let Some(st) = driver.try_wait().unwrap() {
            panic!(
                "blockplane csi exited with {st}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "blockplane csi did not listen in 20 s:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A CreateVolume request.
/// Pairs as the map a CSI request carries.
fn to_map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn create_req(
    name: &str,
    required: i64,
    cap: VolumeCapability,
    params: &[(&str, &str)],
) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap],
        parameters: to_map(params),
        ..Default::default()
    }
}

/// A single-node-writer block capability.
pub fn block() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

/// A single-node-writer mount capability.
pub fn mount(fs: &str, flags: &[&str]) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|s| s.to_string()).collect(),
            volume_mount_group: String::new(),
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

/// `cap` with another access mode.
pub fn with_mode(mut cap: VolumeCapability, mode: Mode) -> VolumeCapability {
    cap.access_mode = Some(AccessMode { mode: mode as i32 });
    cap
}

/// Asserts a call failed with `code` and a message that names something.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code) -> tonic::Status {
    match r {
        Ok(v) => panic!("expected {code:?}, got OK: {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{}", s.message());
            assert!(!s.message().is_empty());
            s
        }
    }
}

/// The mount at `path`, if any.
pub fn mount_at(path: &Path) -> Option<blockplane_system::mountinfo::MountEntry> {
    blockplane_system::mountinfo::mount_at(path).unwrap()
}
