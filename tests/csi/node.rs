//! Node service: stage and publish block and mount volumes, write through
//! them, take them down again; idempotency, read-only, mount flags, stats,
//! and the error codes.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::Duration;

use blockplane_csi::proto::node_service_capability::{Type as CapType, rpc};
use blockplane_csi::proto::volume_capability::access_mode::Mode;
use blockplane_csi::proto::volume_usage::Unit;
use blockplane_csi::proto::{
    NodeGetCapabilitiesRequest, NodeGetInfoRequest, NodeGetVolumeStatsRequest,
    NodeGetVolumeStatsResponse, NodeStageVolumeRequest,
};
use tonic::Code;

use crate::{Csi, MIB, NODE, TOPOLOGY_KEY, assert_code, block, mount, mount_at, with_mode};

async fn stats(
    csi: &Csi,
    volume_id: &str,
    path: &Path,
) -> Result<NodeGetVolumeStatsResponse, tonic::Status> {
    csi.node
        .clone()
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: volume_id.into(),
            volume_path: path.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .map(|r| r.into_inner())
}

fn usage(s: &NodeGetVolumeStatsResponse, unit: Unit) -> (i64, i64, i64) {
    let u = s
        .usage
        .iter()
        .find(|u| u.unit == unit as i32)
        .unwrap_or_else(|| panic!("no {unit:?} usage in {s:?}"));
    (u.available, u.total, u.used)
}

#[tokio::test]
async fn info_and_capabilities() {
    let csi = Csi::start().await;
    let info = csi
        .node
        .clone()
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, NODE);
    assert_eq!(info.max_volumes_per_node, 0);
    assert_eq!(
        info.accessible_topology.unwrap().segments[TOPOLOGY_KEY],
        NODE
    );
    let mut caps: Vec<i32> = csi
        .node
        .clone()
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .map(|c| match c.r#type.unwrap() {
            CapType::Rpc(r) => r.r#type,
        })
        .collect();
    caps.sort();
    assert_eq!(
        caps,
        vec![
            rpc::Type::StageUnstageVolume as i32,
            rpc::Type::GetVolumeStats as i32,
            rpc::Type::ExpandVolume as i32,
            rpc::Type::VolumeCondition as i32,
            rpc::Type::SingleNodeMultiWriter as i32,
        ]
    );
}

#[tokio::test]
async fn a_mount_volume_lives_its_whole_life_and_keeps_its_data() {
    let csi = Csi::start().await;
    let cap = mount("ext4", &[]);
    let v = csi.create("life", 32 * MIB, cap.clone()).await;
    let id = &v.volume_id;
    let dev = csi.device(id).await;
    let staging = csi.staging("life");
    let target = csi.target("life");
    // Stage: a new ext4 on the device, mounted at the staging path; twice is fine.
    csi.stage(id, &staging, cap.clone()).await.unwrap();
    csi.stage(id, &staging, cap.clone()).await.unwrap();
    let m = mount_at(&staging).expect("staged");
    assert_eq!(m.fstype, "ext4");
    assert_eq!(m.source, dev);
    // Publish: the staged filesystem at the target; twice is fine.
    csi.publish(id, &staging, &target, cap.clone(), false)
        .await
        .unwrap();
    csi.publish(id, &staging, &target, cap.clone(), false)
        .await
        .unwrap();
    let t = mount_at(&target).expect("published");
    assert_eq!(t.dev, m.dev);
    assert!(!t.read_only());
    std::fs::write(target.join("hello.txt"), b"written through CSI").unwrap();
    rustix::fs::sync();
    // Stats: bytes and inodes of the filesystem.
    let st = stats(&csi, id, &target).await.unwrap();
    let (avail, total, used) = usage(&st, Unit::Bytes);
    assert!(total > 20 * MIB && total <= 32 * MIB, "{st:?}");
    assert!(used > 0 && avail > 0 && avail + used <= total, "{st:?}");
    let (iavail, itotal, iused) = usage(&st, Unit::Inodes);
    assert!(
        itotal > 0 && iused >= 11 && iavail + iused == itotal,
        "{st:?}"
    );
    let cond = st.volume_condition.unwrap();
    assert!(!cond.abnormal, "{cond:?}");
    // A file held open under the target keeps it published, and the
    // refusal names who holds it; let go, and unpublish goes on.
    let held = std::fs::File::open(target.join("hello.txt")).unwrap();
    let s = assert_code(csi.unpublish(id, &target).await, Code::FailedPrecondition);
    let me = format!("(pid {})", std::process::id());
    assert!(s.message().contains("still in use"), "{}", s.message());
    assert!(s.message().contains(&me), "{}", s.message());
    assert!(mount_at(&target).is_some(), "a refused unpublish unmounted");
    drop(held);
    // Unpublish removes the target; twice is fine.
    csi.unpublish(id, &target).await.unwrap();
    assert!(!target.exists());
    csi.unpublish(id, &target).await.unwrap();
    csi.unstage(id, &staging).await.unwrap();
    assert!(mount_at(&staging).is_none());
    csi.unstage(id, &staging).await.unwrap();
    // Stage again: the filesystem is mounted, not made anew.
    csi.stage(id, &staging, cap.clone()).await.unwrap();
    csi.publish(id, &staging, &target, cap.clone(), false)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(target.join("hello.txt")).unwrap(),
        b"written through CSI"
    );
    csi.unpublish(id, &target).await.unwrap();
    csi.unstage(id, &staging).await.unwrap();
    csi.delete(id).await.unwrap();
    csi.delete(id).await.unwrap();
    assert!(csi.svc.my_loop_devices().is_empty());
}

#[tokio::test]
async fn a_block_volume_is_its_device_node_at_the_target() {
    let csi = Csi::start().await;
    let v = csi.create("raw", 8 * MIB, block()).await;
    let id = &v.volume_id;
    let dev = csi.device(id).await;
    let staging = csi.staging("raw");
    let target = csi.target("raw");
    csi.stage(id, &staging, block()).await.unwrap();
    csi.stage(id, &staging, block()).await.unwrap();
    csi.publish(id, &staging, &target, block(), false)
        .await
        .unwrap();
    csi.publish(id, &staging, &target, block(), false)
        .await
        .unwrap();
    let md = std::fs::metadata(&target).unwrap();
    assert!(md.file_type().is_block_device());
    assert_eq!(md.rdev(), std::fs::metadata(&dev).unwrap().rdev());
    // Write through the target, read it back through the device node.
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&target)
            .unwrap();
        f.seek(SeekFrom::Start(MIB as u64)).unwrap();
        f.write_all(&pattern).unwrap();
        f.sync_all().unwrap();
    }
    let mut back = vec![0u8; pattern.len()];
    let mut f = std::fs::File::open(&dev).unwrap();
    f.seek(SeekFrom::Start(MIB as u64)).unwrap();
    f.read_exact(&mut back).unwrap();
    assert_eq!(back, pattern);
    drop(f);
    let st = stats(&csi, id, &target).await.unwrap();
    let (_, total, _) = usage(&st, Unit::Bytes);
    assert_eq!(total, 8 * MIB);
    assert!(!st.usage.iter().any(|u| u.unit == Unit::Inodes as i32));
    csi.unpublish(id, &target).await.unwrap();
    assert!(!target.exists(), "the target file is removed");
    csi.unpublish(id, &target).await.unwrap();
    csi.unstage(id, &staging).await.unwrap();
    csi.delete(id).await.unwrap();
}

#[tokio::test]
async fn xfs_with_mount_flags_and_a_read_only_publish() {
    let csi = Csi::start().await;
    // mkfs.xfs wants at least 300 MiB; the image is sparse.
    let cap = mount("xfs", &["noatime", "nodiscard"]);
    let v = csi.create("xfs", 320 * MIB, cap.clone()).await;
    let id = &v.volume_id;
    let staging = csi.staging("xfs");
    let target = csi.target("xfs");
    csi.stage(id, &staging, cap.clone()).await.unwrap();
    let m = mount_at(&staging).unwrap();
    assert_eq!(m.fstype, "xfs");
    assert!(m.options.split(',').any(|o| o == "noatime"), "{m:?}");
    let pub_cap = mount("xfs", &["nosuid", "nodev", "noexec"]);
    csi.publish(id, &staging, &target, pub_cap.clone(), true)
        .await
        .unwrap();
    let t = mount_at(&target).unwrap();
    assert!(t.read_only(), "{t:?}");
    for flag in ["nosuid", "nodev", "noexec"] {
        assert!(t.options.split(',').any(|o| o == flag), "{flag}: {t:?}");
    }
    let e = std::fs::write(target.join("x"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    // The staging mount stays writable: only the target is read-only.
    assert!(!mount_at(&staging).unwrap().read_only());
    // The same target read-write is another publication.
    assert_code(
        csi.publish(id, &staging, &target, pub_cap.clone(), false)
            .await,
        Code::AlreadyExists,
    );
    csi.publish(id, &staging, &target, pub_cap, true)
        .await
        .unwrap();
    // A reader-only access mode makes the staging mount read-only too.
    csi.unpublish(id, &target).await.unwrap();
    csi.unstage(id, &staging).await.unwrap();
    let ro = with_mode(cap, Mode::SingleNodeReaderOnly);
    csi.stage(id, &staging, ro.clone()).await.unwrap();
    assert!(mount_at(&staging).unwrap().read_only());
    csi.publish(id, &staging, &target, ro, false).await.unwrap();
    assert!(mount_at(&target).unwrap().read_only());
}

#[tokio::test]
async fn a_read_only_block_publish_is_a_read_only_bind_mount() {
    let csi = Csi::start().await;
    let v = csi.create("robl", 4 * MIB, block()).await;
    let staging = csi.staging("robl");
    let target = csi.target("robl");
    csi.stage(&v.volume_id, &staging, block()).await.unwrap();
    csi.publish(&v.volume_id, &staging, &target, block(), true)
        .await
        .unwrap();
    // The kernel does not stop writes to a device node through a read-only
    // mount; kubelet hands the container the device read-only itself. The
    // driver's part is a read-only mount, and refusing to make it writable.
    assert!(mount_at(&target).unwrap().read_only());
    assert_code(
        csi.publish(&v.volume_id, &staging, &target, block(), false)
            .await,
        Code::AlreadyExists,
    );
    csi.publish(&v.volume_id, &staging, &target, block(), true)
        .await
        .unwrap();
}

#[tokio::test]
async fn what_the_device_holds_decides_mkfs() {
    let csi = Csi::start().await;
    // Something that is not a filesystem is never formatted over.
    let v = csi.create("swap", 16 * MIB, mount("ext4", &[])).await;
    let dev = csi.device(&v.volume_id).await;
    let st = std::process::Command::new("mkswap")
        .arg(&dev)
        .output()
        .unwrap();
    assert!(st.status.success(), "{st:?}");
    let staging = csi.staging("swap");
    let s = assert_code(
        csi.stage(&v.volume_id, &staging, mount("ext4", &[])).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("swap"), "{}", s.message());
    assert!(mount_at(&staging).is_none());
    // A filesystem of another type than asked is not replaced either.
    let x = csi.create("other-fs", 16 * MIB, mount("ext4", &[])).await;
    let xstaging = csi.staging("other-fs");
    csi.stage(&x.volume_id, &xstaging, mount("ext4", &[]))
        .await
        .unwrap();
    csi.unstage(&x.volume_id, &xstaging).await.unwrap();
    let s = assert_code(
        csi.stage(&x.volume_id, &xstaging, mount("xfs", &[])).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("ext4"), "{}", s.message());
    // Mount options the filesystem does not know are the caller's mistake.
    assert_code(
        csi.stage(&x.volume_id, &xstaging, mount("ext4", &["no_such_option"]))
            .await,
        Code::InvalidArgument,
    );
    assert!(mount_at(&xstaging).is_none());
}

#[tokio::test]
async fn node_calls_refuse_bad_requests_with_the_specs_codes() {
    let csi = Csi::start().await;
    let v = csi.create("bad", 16 * MIB, mount("ext4", &[])).await;
    let id = v.volume_id.as_str();
    let staging = csi.staging("bad");
    let target = csi.target("bad");
    let cap = mount("ext4", &[]);
    // Missing fields.
    assert_code(
        csi.stage("", &staging, cap.clone()).await,
        Code::InvalidArgument,
    );
    assert_code(
        csi.stage(id, Path::new(""), cap.clone()).await,
        Code::InvalidArgument,
    );
    let no_cap = NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        ..Default::default()
    };
    assert_code(
        csi.node.clone().node_stage_volume(no_cap).await,
        Code::InvalidArgument,
    );
    assert_code(
        csi.publish(id, &staging, Path::new(""), cap.clone(), false)
            .await,
        Code::InvalidArgument,
    );
    assert_code(
        csi.unpublish(id, Path::new("")).await,
        Code::InvalidArgument,
    );
    assert_code(csi.unstage("", &staging).await, Code::InvalidArgument);
    assert_code(
        csi.stage(
            id,
            &staging,
            with_mode(cap.clone(), Mode::MultiNodeMultiWriter),
        )
        .await,
        Code::InvalidArgument,
    );
    // Volumes that do not exist, or not here.
    let gone = format!("{NODE}/csi-gone");
    assert_code(
        csi.stage(&gone, &staging, cap.clone()).await,
        Code::NotFound,
    );
    assert_code(
        csi.publish(&gone, &staging, &target, cap.clone(), false)
            .await,
        Code::NotFound,
    );
    assert_code(
        csi.stage("reallyfakevolumeid", &staging, cap.clone()).await,
        Code::NotFound,
    );
    assert_code(stats(&csi, &gone, &target).await, Code::NotFound);
    let s = assert_code(
        csi.stage("node-b/csi-bad", &staging, cap.clone()).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("node-b"), "{}", s.message());
    // Publishing a mount volume that is not staged.
    assert_code(
        csi.publish(id, &staging, &target, cap.clone(), false).await,
        Code::FailedPrecondition,
    );
    // Stats of a path the volume is not at.
    csi.stage(id, &staging, cap.clone()).await.unwrap();
    assert_code(
        stats(&csi, id, &csi.dir.join("no/such/path")).await,
        Code::NotFound,
    );
    assert_code(stats(&csi, id, &csi.dir).await, Code::NotFound);
    assert_code(stats(&csi, id, Path::new("")).await, Code::InvalidArgument);
    // Another volume's staging path is taken.
    let w = csi.create("bad2", 16 * MIB, cap.clone()).await;
    assert_code(
        csi.stage(&w.volume_id, &staging, cap.clone()).await,
        Code::AlreadyExists,
    );
    // Unstaging a volume blockplane no longer has still unmounts: nothing
    // else could.
    csi.unstage(&gone, &csi.staging("never")).await.unwrap();
}

#[tokio::test]
async fn overlapping_calls_for_one_volume_are_aborted() {
    let csi = Csi::start().await;
    let v = csi.create("busy", 16 * MIB, mount("ext4", &[])).await;
    let staging = csi.staging("busy");
    let other = csi.create("calm", 4 * MIB, block()).await;
    // Freeze the service: the first stage waits on the API, holding the volume.
    let pid = rustix::process::Pid::from_raw(csi.service_pid()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
    let frozen = Frozen(pid);
    // kill() returns before every thread has stopped; on a loaded host one
    // that was running can still answer a request (CI saw the first stage
    // get its device and finish, and the second then hang on the API).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !all_stopped(csi.service_pid()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the service did not stop in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first = {
        let (mut node, id, staging) = (csi.node.clone(), v.volume_id.clone(), staging.clone());
        tokio::spawn(async move {
            node.node_stage_volume(NodeStageVolumeRequest {
                volume_id: id,
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(mount("ext4", &[])),
                ..Default::default()
            })
            .await
        })
    };
    // Wait until the first call has taken the volume (it logs, then takes
    // the volume's slot without yielding): a fixed pause lost the race on a
    // loaded machine. The second must then be refused at once (its own
    // deadline turns a hang into a failure).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !csi.driver_log().contains("NodeStageVolume volume=csi-busy") {
        assert!(
            std::time::Instant::now() < deadline,
            "the first stage never reached the driver:\n{}",
            csi.driver_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !csi.driver_log()
            .contains("creating a filesystem volume=\"test-node/csi-busy\""),
        "the first stage went past the frozen API:\n{}",
        csi.driver_log()
    );
    let mut second = tonic::Request::new(NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(mount("ext4", &[])),
        ..Default::default()
    });
    second.set_timeout(Duration::from_secs(5));
    let aborted = csi.node.clone().node_stage_volume(second).await.map(drop);
    let s = assert_code(aborted, Code::Aborted);
    assert!(s.message().contains("in progress"), "{}", s.message());
    assert_code(csi.unstage(&v.volume_id, &staging).await, Code::Aborted);
    // Other volumes are not held up by it (their calls need no API here).
    csi.unstage(&other.volume_id, &csi.staging("calm"))
        .await
        .unwrap();
    drop(frozen);
    tokio::time::timeout(Duration::from_secs(60), first)
        .await
        .expect("the first stage finished")
        .unwrap()
        .unwrap();
    assert!(mount_at(&staging).is_some());
    csi.stage(&v.volume_id, &staging, mount("ext4", &[]))
        .await
        .unwrap();
}

/// Whether every thread of process `pid` is stopped (state `T`).
fn all_stopped(pid: i32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .all(|t| {
            std::fs::read_to_string(t.path().join("stat")).is_ok_and(|st| {
                st.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
            })
        })
}

/// Resumes a stopped process when dropped, also when a test fails.
struct Frozen(rustix::process::Pid);

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = rustix::process::kill_process(self.0, rustix::process::Signal::CONT);
    }
}

#[tokio::test]
async fn a_single_writer_volume_is_published_once() {
    let csi = Csi::start().await;
    for (name, cap) in [("one-fs", mount("ext4", &[])), ("one-raw", block())] {
        let single = with_mode(cap.clone(), Mode::SingleNodeSingleWriter);
        let v = csi.create(name, 16 * MIB, single.clone()).await;
        let staging = csi.staging(name);
        let (t1, t2) = (
            csi.target(&format!("{name}-1")),
            csi.target(&format!("{name}-2")),
        );
        csi.stage(&v.volume_id, &staging, single.clone())
            .await
            .unwrap();
        csi.publish(&v.volume_id, &staging, &t1, single.clone(), false)
            .await
            .unwrap();
        csi.publish(&v.volume_id, &staging, &t1, single.clone(), false)
            .await
            .unwrap();
        let s = assert_code(
            csi.publish(&v.volume_id, &staging, &t2, single.clone(), false)
                .await,
            Code::FailedPrecondition,
        );
        assert!(
            s.message().contains(&t1.display().to_string()),
            "{}",
            s.message()
        );
        assert!(!t2.exists(), "{name}: a refused publish leaves no target");
        // Once unpublished there, it can be published elsewhere.
        csi.unpublish(&v.volume_id, &t1).await.unwrap();
        csi.publish(&v.volume_id, &staging, &t2, single.clone(), false)
            .await
            .unwrap();
        csi.unpublish(&v.volume_id, &t2).await.unwrap();
        // The multi-writer mode allows both at once.
        let multi = with_mode(cap, Mode::SingleNodeMultiWriter);
        csi.publish(&v.volume_id, &staging, &t1, multi.clone(), false)
            .await
            .unwrap();
        csi.publish(&v.volume_id, &staging, &t2, multi, false)
            .await
            .unwrap();
    }
}

/// An encrypted StorageClass (`encrypted: "true"`): the key comes from the
/// provisioner secret at create and the node-stage secret at stage (as
/// Longhorn's does); either missing is FAILED_PRECONDITION naming the
/// StorageClass key that sets it, a wrong key PERMISSION_DENIED. A host
/// without dm-crypt refuses the create with the service's reason.
#[tokio::test]
async fn an_encrypted_volume_is_made_and_staged_only_with_its_secrets() {
    let csi = Csi::start().await;
    let cap = mount("ext4", &[]);
    let params = [("encrypted", "true")];
    let s = assert_code(
        csi.create_with("sealed", 32 * MIB, cap.clone(), &params)
            .await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("provisioner-secret-name"),
        "{}",
        s.message()
    );
    let secrets = [("key", "csi-secret-key")];
    let created = csi
        .create_with_secrets("sealed", 32 * MIB, cap.clone(), &params, &secrets)
        .await;
    if !crate::in_vm() {
        let s = assert_code(created, Code::FailedPrecondition);
        assert!(s.message().contains("dm-crypt"), "{}", s.message());
        assert!(csi.svc.my_loop_devices().is_empty());
        return;
    }
    let v = created.unwrap_or_else(|e| panic!("{e:?}\n{}", csi.driver_log()));
    assert_eq!(v.capacity_bytes, 32 * MIB, "the header comes on top");
    let bp = csi.bp_volume(&v.volume_id).await;
    assert_eq!(bp["encrypted"], true, "{bp}");
    let dev = bp["device"].as_str().unwrap().to_string();
    assert!(dev.starts_with("/dev/mapper/blockplane-crypt-"), "{bp}");
    let id = &v.volume_id;
    let staging = csi.staging("sealed");
    let s = assert_code(
        csi.stage(id, &staging, cap.clone()).await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("node-stage-secret-name"),
        "{}",
        s.message()
    );
    assert_code(
        csi.stage_with_secrets(id, &staging, cap.clone(), &[("key", "wrong")])
            .await,
        Code::PermissionDenied,
    );
    assert!(mount_at(&staging).is_none(), "a refused stage mounted");
    csi.stage_with_secrets(id, &staging, cap.clone(), &secrets)
        .await
        .unwrap();
    let m = mount_at(&staging).expect("staged");
    assert_eq!(m.fstype, "ext4");
    assert_eq!(m.source, dev, "the plaintext device is what is mounted");
    csi.unstage(id, &staging).await.unwrap();
    csi.delete(id).await.unwrap();
}

/// Kubernetes' VolumeSnapshot of a claim in use on a node whose image root
/// is ext4, which cannot share extents: the snapshot is one moment all the
/// same (the volume's worker copies it, each chunk a write reaches copied
/// before the write), ready once copied, while a pod goes on writing files.
/// A claim restored from it mounts after its journal is replayed and holds
/// every file fsynced before CreateSnapshot. On the host, whose claims are
/// loop volumes, the snapshot is refused with a remedy instead.
#[tokio::test]
async fn a_snapshot_of_an_in_use_claim_on_ext4_is_one_moment_and_restores() {
    use blockplane_csi::proto::volume_content_source::{SnapshotSource, Type};
    use blockplane_csi::proto::{CreateSnapshotRequest, VolumeContentSource};
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let fs = crate::harness::LoopFs::new(&["mkfs.ext4", "-q", "-F"], 512 << 20);
    let root = fs.mnt.display().to_string();
    let csi = Csi::start_with(
        crate::harness::Opts {
            extra_roots: vec![fs.mnt.clone()],
            ..Default::default()
        },
        &["--image-root", &root],
    )
    .await;
    let cap = mount("ext4", &[]);
    let v = csi.create("claim", 64 * MIB, cap.clone()).await;
    let id = v.volume_id.clone();
    let (staging, target) = (csi.staging("claim"), csi.target("claim"));
    csi.stage(&id, &staging, cap.clone()).await.unwrap();
    csi.publish(&id, &staging, &target, cap.clone(), false)
        .await
        .unwrap();
    // The pod: files of 64 KiB, each fsynced with its directory before it
    // counts.
    let data = |j: u64| -> Vec<u8> {
        (0..8192u64)
            .flat_map(|k| (j.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ k).to_le_bytes())
            .collect()
    };
    let (done, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let pod = {
        let (done, stop, dir) = (done.clone(), stop.clone(), target.clone());
        std::thread::spawn(move || {
            let parent = std::fs::File::open(&dir).unwrap();
            let mut j = 0;
            while !stop.load(Ordering::Relaxed) {
                let f = std::fs::File::create(dir.join(format!("f{j}"))).unwrap();
                f.write_all_at(&data(j), 0).unwrap();
                f.sync_all().unwrap();
                parent.sync_all().unwrap();
                j += 1;
                done.store(j, Ordering::Release);
            }
        })
    };
    let wait_for = async |n: u64| {
        crate::eventually(Duration::from_secs(120), "the pod's writes", async || {
            done.load(Ordering::Acquire) >= n
        })
        .await
    };
    wait_for(8).await;
    let synced = done.load(Ordering::Acquire);
    let create_snapshot = async || {
        csi.controller
            .clone()
            .create_snapshot(CreateSnapshotRequest {
                source_volume_id: id.clone(),
                name: "snap".into(),
                secrets: Default::default(),
                parameters: Default::default(),
            })
            .await
    };
    let snapshot = async || {
        create_snapshot()
            .await
            .unwrap_or_else(|e| panic!("CreateSnapshot: {e:?}\n{}", csi.driver_log()))
            .into_inner()
            .snapshot
            .unwrap()
    };
    if !crate::in_vm() {
        // Here the claim is a loop volume: no worker sees its writes, so the
        // snapshot is refused, naming the claim's volume and a way out.
        let s = assert_code(create_snapshot().await, Code::FailedPrecondition);
        assert!(
            s.message().contains("cannot share extents"),
            "{}",
            s.message()
        );
        stop.store(true, Ordering::Relaxed);
        pod.join().unwrap();
        csi.unpublish(&id, &target).await.unwrap();
        csi.unstage(&id, &staging).await.unwrap();
        return;
    }
    let first = snapshot().await;
    wait_for(synced + 8).await;
    // The external-snapshotter asks again until the snapshot is ready.
    crate::eventually(
        Duration::from_secs(300),
        "the snapshot to be ready",
        async || snapshot().await.ready_to_use,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    pod.join().unwrap();
    let events = csi.svc.get("/v1/events?limit=1000").await.body;
    assert!(
        events
            .to_string()
            .contains("each chunk a write reaches copied before the write"),
        "the snapshot was no copy-before-write: {first:?} {events}"
    );
    // A claim from the snapshot: ABORTED while its own copy runs.
    let mut req = crate::create_req("restored", 64 * MIB, cap.clone(), &[]);
    req.volume_content_source = Some(VolumeContentSource {
        r#type: Some(Type::Snapshot(SnapshotSource {
            snapshot_id: first.snapshot_id.clone(),
        })),
    });
    let mut restored = None;
    crate::eventually(
        Duration::from_secs(300),
        "the restored claim",
        async || match csi.controller.clone().create_volume(req.clone()).await {
            Ok(r) => {
                restored = r.into_inner().volume;
                true
            }
            Err(e) if e.code() == Code::Aborted => false,
            Err(e) => panic!("CreateVolume from the snapshot: {e:?}"),
        },
    )
    .await;
    let rid = restored.unwrap().volume_id;
    let (rstaging, rtarget) = (csi.staging("restored"), csi.target("restored"));
    csi.stage(&rid, &rstaging, cap.clone()).await.unwrap();
    csi.publish(&rid, &rstaging, &rtarget, cap.clone(), false)
        .await
        .unwrap();
    for j in 0..synced {
        let got = std::fs::read(rtarget.join(format!("f{j}")))
            .unwrap_or_else(|e| panic!("file f{j}, fsynced before the snapshot: {e}"));
        assert!(
            got == data(j),
            "file f{j}, fsynced before the snapshot, differs"
        );
    }
    for (vid, st, t) in [(&rid, &rstaging, &rtarget), (&id, &staging, &target)] {
        csi.unpublish(vid, t).await.unwrap();
        csi.unstage(vid, st).await.unwrap();
    }
    csi.delete(&rid).await.unwrap();
}

/// A claim of a `reach: network` class, made on node A, used by a pod on
/// node B, which has none of its data: B's driver has A's service export
/// it to B (A's API over TCP, with the token from the node-stage Secret),
/// connects it as a remote volume and stages it; what B writes is A's.
/// B's unstage disconnects it; A's DeleteVolume removes the export with the
/// volume. On a host without an NVMe target, what can be checked there:
/// the class is refused, naming what is missing, and nothing is made.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_on_a_node_without_the_data_runs_on_its_network_claim() {
    use blockplane_test_support::hosts::{A_IP, Hosts};

    const TOKEN: &str = "csi-network-reach-token-0123456789";
    let network = [("reach", "network"), ("backend", "ublk")];
    let cap = mount("ext4", &[]);

    // No --node-api, then no --export-address: refused before anything.
    let alone = Csi::start_with(Default::default(), &["--node-id", "alone"]).await;
    let r = alone
        .create_with("nonet", 32 * MIB, cap.clone(), &network)
        .await;
    let s = assert_code(r, Code::FailedPrecondition);
    assert!(s.message().contains("--node-api"), "{}", s.message());
    drop(alone);
    let alone = Csi::start_with(
        Default::default(),
        &["--node-id", "alone", "--node-api", "127.0.0.1:7400"],
    )
    .await;
    let r = alone
        .create_with("nonet", 32 * MIB, cap.clone(), &network)
        .await;
    let s = assert_code(r, Code::FailedPrecondition);
    assert!(s.message().contains("--export-address"), "{}", s.message());
    assert_eq!(
        alone.svc.get("/v1/volumes").await.body,
        serde_json::json!([])
    );
    drop(alone);
    if !crate::in_vm() {
        eprintln!("no NVMe target on this host: the cross-node claim runs in the VM lanes");
        return;
    }

    let hosts = Hosts::new();
    let api = format!("{A_IP}:7400");
    let a = Csi::start_with(
        crate::harness::Opts {
            netns: Some(hosts.a.clone()),
            token: Some(TOKEN.into()),
            tcp: Some(api.clone()),
            extra_args: vec!["--export-address".into(), format!("{A_IP}:4420")],
            ..Default::default()
        },
        &["--node-id", "node-a", "--node-api", &api],
    )
    .await;
    let b = Csi::start_with(Default::default(), &["--node-id", "node-b"]).await;

    let v = a
        .create_with("shared", 64 * MIB, cap.clone(), &network)
        .await
        .unwrap_or_else(|e| panic!("CreateVolume: {e:?}\n{}", a.driver_log()));
    assert!(v.accessible_topology.is_empty(), "{v:?}");
    assert_eq!(v.volume_context["blockplane.io/reach"], "network", "{v:?}");
    let stage = |csi: &Csi, secrets: &[(&str, &str)]| {
        let req = NodeStageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: csi.staging("shared").display().to_string(),
            volume_capability: Some(cap.clone()),
            volume_context: v.volume_context.clone(),
            secrets: secrets
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        };
        let mut node = csi.node.clone();
        async move { node.node_stage_volume(req).await.map(drop) }
    };

    // Without the owner's token: refused, nothing made on either node.
    let s = assert_code(stage(&b, &[]).await, Code::FailedPrecondition);
    assert!(s.message().contains("token"), "{}", s.message());
    assert_eq!(b.svc.get("/v1/remotes").await.body, serde_json::json!([]));

    // B stages, publishes and writes: its data lands on A.
    stage(&b, &[("token", TOKEN)])
        .await
        .unwrap_or_else(|e| panic!("NodeStageVolume on B: {e:?}\n{}", b.driver_log()));
    let remotes = b.svc.get("/v1/remotes").await.body;
    assert_eq!(remotes.as_array().unwrap().len(), 1, "{remotes}");
    assert_eq!(remotes[0]["state"], "attached", "{remotes}");
    let target = b.target("shared");
    b.publish(
        &v.volume_id,
        &b.staging("shared"),
        &target,
        cap.clone(),
        false,
    )
    .await
    .unwrap();
    let text = "written on node-b, kept on node-a\n";
    {
        let mut f = std::fs::File::create(target.join("hello")).unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f.sync_all().unwrap();
    }
    b.unpublish(&v.volume_id, &target).await.unwrap();
    b.unstage(&v.volume_id, &b.staging("shared")).await.unwrap();
    assert_eq!(b.svc.get("/v1/remotes").await.body, serde_json::json!([]));

    // A, the owner, reads it from its own device.
    let staging = a.staging("shared");
    a.stage(&v.volume_id, &staging, cap.clone()).await.unwrap();
    let target = a.target("shared");
    a.publish(&v.volume_id, &staging, &target, cap.clone(), false)
        .await
        .unwrap();
    let mut got = String::new();
    std::fs::File::open(target.join("hello"))
        .unwrap()
        .read_to_string(&mut got)
        .unwrap();
    assert_eq!(got, text);
    a.unpublish(&v.volume_id, &target).await.unwrap();
    a.unstage(&v.volume_id, &staging).await.unwrap();

    // DeleteVolume on A takes the export with the volume.
    a.delete(&v.volume_id).await.unwrap();
    assert_eq!(a.svc.get("/v1/exports").await.body, serde_json::json!([]));
    assert_eq!(a.svc.get("/v1/volumes").await.body, serde_json::json!([]));
    drop(b);
    drop(a);
    drop(hosts);
}
