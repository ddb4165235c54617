//! Controller service: create, delete, validate, list, capacity, and the
//! error codes of each.

use std::collections::HashMap;

use blockplane_csi::proto::controller_service_capability::{Type as CapType, rpc};
use blockplane_csi::proto::volume_capability::access_mode::Mode;
use blockplane_csi::proto::volume_content_source::{self, SnapshotSource};
use blockplane_csi::proto::{
    CapacityRange, ControllerGetCapabilitiesRequest, GetCapacityRequest, ListVolumesRequest,
    Topology, TopologyRequirement, ValidateVolumeCapabilitiesRequest, VolumeContentSource,
};
use serde_json::json;
use tonic::Code;

use crate::{Csi, MIB, NODE, TOPOLOGY_KEY, assert_code, block, create_req, mount, with_mode};

fn topology(node: &str) -> Topology {
    Topology {
        segments: [(TOPOLOGY_KEY.to_string(), node.to_string())].into(),
    }
}

#[tokio::test]
async fn capabilities_are_create_delete_list_capacity_expand_snapshot_clone_modify_condition() {
    let csi = Csi::start().await;
    let caps = csi
        .controller
        .clone()
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let mut got: Vec<i32> = caps
        .into_iter()
        .map(|c| match c.r#type.unwrap() {
            CapType::Rpc(r) => r.r#type,
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            rpc::Type::CreateDeleteVolume as i32,
            rpc::Type::ListVolumes as i32,
            rpc::Type::GetCapacity as i32,
            rpc::Type::CreateDeleteSnapshot as i32,
            rpc::Type::ListSnapshots as i32,
            rpc::Type::CloneVolume as i32,
            rpc::Type::ExpandVolume as i32,
            rpc::Type::VolumeCondition as i32,
            rpc::Type::GetVolume as i32,
            rpc::Type::SingleNodeMultiWriter as i32,
            rpc::Type::ModifyVolume as i32,
        ]
    );
}

#[tokio::test]
async fn create_makes_an_image_file_and_a_volume_on_this_node() {
    let csi = Csi::start().await;
    let v = csi
        .create(
            "pvc-0b1c6b4e-8a4f-4a8e-9c1d-0123456789ab",
            10 * MIB,
            mount("", &[]),
        )
        .await;
    let name = "csi-pvc-0b1c6b4e-8a4f-4a8e-9c1d-0123456789ab";
    assert_eq!(v.volume_id, format!("{NODE}/{name}"));
    assert_eq!(v.capacity_bytes, 10 * MIB);
    assert_eq!(v.accessible_topology, vec![topology(NODE)]);
    // Through the API: an image file under the image root, and a loop volume on it.
    let image = csi.svc.get(&format!("/v1/images/{name}")).await.body;
    assert_eq!(
        image["path"],
        json!(csi.svc.images.join(format!("{name}.img")))
    );
    assert_eq!(image["size_bytes"], json!(10 * MIB));
    assert_eq!(image["allocation"], json!("sparse"));
    let vol = csi.bp_volume(&v.volume_id).await;
    assert_eq!(vol["backend"], json!("loop"));
    assert_eq!(vol["state"], json!("attached"));
    assert!(vol["device"].as_str().unwrap().starts_with("/dev/loop"));
    assert_eq!(harness_devices(&csi).len(), 1);
    csi.delete(&v.volume_id).await.unwrap();
    assert!(!csi.svc.images.join(format!("{name}.img")).exists());
    assert_eq!(csi.svc.get("/v1/images").await.body, json!([]));
    assert!(harness_devices(&csi).is_empty());
}

fn harness_devices(csi: &Csi) -> Vec<String> {
    csi.svc.my_loop_devices()
}

/// What a refused create must not leave: images, volumes, devices, files
/// (the event log does record the attempt).
async fn leftovers(
    csi: &Csi,
) -> (
    serde_json::Value,
    serde_json::Value,
    Vec<String>,
    Vec<String>,
) {
    let mut files: Vec<String> = std::fs::read_dir(&csi.svc.images)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    (
        csi.svc.get("/v1/images").await.body,
        csi.svc.get("/v1/volumes").await.body,
        csi.svc.my_loop_devices(),
        files,
    )
}

#[tokio::test]
async fn create_is_idempotent_by_name_and_refuses_another_spec() {
    let csi = Csi::start().await;
    let params = [("backend", "loop"), ("allocation", "full")];
    let a = csi
        .create_with("vol-a", 4 * MIB, block(), &params)
        .await
        .unwrap();
    let again = csi
        .create_with("vol-a", 4 * MIB, block(), &params)
        .await
        .unwrap();
    assert_eq!(a, again);
    // A range the existing size fits is the same volume too.
    let mut req = create_req("vol-a", MIB, block(), &params);
    req.capacity_range = Some(CapacityRange {
        required_bytes: MIB,
        limit_bytes: 8 * MIB,
    });
    let fits = csi.controller.clone().create_volume(req).await.unwrap();
    assert_eq!(fits.into_inner().volume.unwrap(), a);
    // Another size, another allocation, another backend, QoS: another spec.
    let s = assert_code(
        csi.create_with("vol-a", 8 * MIB, block(), &params).await,
        Code::AlreadyExists,
    );
    assert!(s.message().contains("size"), "{}", s.message());
    let s = assert_code(
        csi.create_with("vol-a", 4 * MIB, block(), &[("backend", "loop")])
            .await,
        Code::AlreadyExists,
    );
    assert!(s.message().contains("allocation"), "{}", s.message());
    assert_code(
        csi.create_with(
            "vol-a",
            4 * MIB,
            block(),
            &[
                ("backend", "loop"),
                ("allocation", "full"),
                ("qos.iops", "10"),
            ],
        )
        .await,
        Code::AlreadyExists,
    );
    // Only one volume and one image came of it.
    assert_eq!(
        csi.svc
            .get("/v1/volumes")
            .await
            .body
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        csi.svc
            .get("/v1/images")
            .await
            .body
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn capacity_is_rounded_up_to_the_granule_and_honours_the_limit() {
    let csi = Csi::start().await;
    let create = |name: &str, required: i64, limit: i64| {
        let mut req = create_req(name, required, block(), &[]);
        req.capacity_range = Some(CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        });
        let mut c = csi.controller.clone();
        async move {
            c.create_volume(req)
                .await
                .map(|r| r.into_inner().volume.unwrap().capacity_bytes)
        }
    };
    assert_eq!(create("r1", 1000, 0).await.unwrap(), MIB);
    assert_eq!(create("r2", 2 * MIB + 1, 0).await.unwrap(), 3 * MIB);
    // 1 MiB would pass the limit: the next multiple of 512 does not.
    assert_eq!(create("r3", 3000, 4096).await.unwrap(), 3072);
    assert_eq!(create("r4", 0, 5 * MIB + 7).await.unwrap(), 5 * MIB);
    assert_code(create("r5", 1000, 1020).await, Code::OutOfRange);
    assert_code(create("r6", 2 * MIB, MIB).await, Code::OutOfRange);
    // The device has the size the driver reported.
    let dev = csi.device(&format!("{NODE}/csi-r3")).await;
    assert_eq!(crate::harness::device_size(&dev), 3072);
}

#[tokio::test]
async fn bad_requests_are_refused_and_leave_nothing() {
    let csi = Csi::start().await;
    let before = leftovers(&csi).await;
    let mut c = csi.controller.clone();
    assert_code(
        c.create_volume(create_req("", MIB, block(), &[])).await,
        Code::InvalidArgument,
    );
    let mut no_caps = create_req("x", MIB, block(), &[]);
    no_caps.volume_capabilities.clear();
    assert_code(c.create_volume(no_caps).await, Code::InvalidArgument);
    let s = assert_code(
        c.create_volume(create_req(
            "x",
            MIB,
            with_mode(block(), Mode::MultiNodeMultiWriter),
            &[],
        ))
        .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("local to one node"), "{}", s.message());
    assert_code(
        c.create_volume(create_req("x", MIB, mount("btrfs", &[]), &[]))
            .await,
        Code::InvalidArgument,
    );
    let s = assert_code(
        c.create_volume(create_req("x", MIB, block(), &[("sise", "1G")]))
            .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("sise"), "{}", s.message());
    assert_code(
        c.create_volume(create_req("x", MIB, block(), &[("backend", "nbd")]))
            .await,
        Code::InvalidArgument,
    );
    let mut snap = create_req("x", MIB, block(), &[]);
    snap.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(SnapshotSource {
            snapshot_id: "s".into(),
        })),
    });
    // A snapshot id this driver never handed out names no snapshot.
    assert_code(c.create_volume(snap).await, Code::NotFound);
    // Another node's topology: not here.
    let mut elsewhere = create_req("x", MIB, block(), &[]);
    elsewhere.accessibility_requirements = Some(TopologyRequirement {
        requisite: vec![topology("node-b")],
        preferred: vec![topology("node-b")],
    });
    assert_code(c.create_volume(elsewhere).await, Code::ResourceExhausted);
    assert_eq!(leftovers(&csi).await, before);
    // This node among the requisite topologies is fine.
    let mut here = create_req("x", MIB, block(), &[]);
    here.accessibility_requirements = Some(TopologyRequirement {
        requisite: vec![topology("node-b"), topology(NODE)],
        preferred: vec![topology(NODE)],
    });
    c.create_volume(here).await.unwrap();
}

#[tokio::test]
async fn api_refusals_map_to_grpc_codes_and_leave_nothing() {
    let csi = Csi::start().await;
    let before = leftovers(&csi).await;
    // 422 backend_unavailable (this host has no ublk): the host's state.
    let host = csi.svc.get("/v1/host").await.body;
    if host["backends"]["ublk"]["available"] == json!(false) {
        let s = assert_code(
            csi.create_with("u", MIB, block(), &[("backend", "ublk")])
                .await,
            Code::FailedPrecondition,
        );
        assert!(
            s.message().contains("backend_unavailable"),
            "{}",
            s.message()
        );
    }
    // 422 unsupported (QoS on loop): the request's argument.
    let s = assert_code(
        csi.create_with(
            "q",
            MIB,
            block(),
            &[("backend", "loop"), ("qos.iops", "100")],
        )
        .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("QoS"), "{}", s.message());
    // The image made for each refused volume is gone again.
    assert_eq!(leftovers(&csi).await, before);
    // 409 file_exists: a stray file where the image would go.
    std::fs::write(csi.svc.images.join("csi-stray.img"), b"not mine").unwrap();
    let s = assert_code(
        csi.create_with("stray", MIB, block(), &[]).await,
        Code::AlreadyExists,
    );
    assert!(s.message().contains("file_exists"), "{}", s.message());
    assert_eq!(
        std::fs::read(csi.svc.images.join("csi-stray.img")).unwrap(),
        b"not mine"
    );
}

#[tokio::test]
async fn the_api_being_down_is_unavailable() {
    let mut csi = Csi::start().await;
    csi.svc.kill();
    let s = assert_code(
        csi.create_with("x", MIB, block(), &[]).await,
        Code::Unavailable,
    );
    assert!(s.message().contains("cannot connect"), "{}", s.message());
    assert_code(
        csi.delete(&format!("{NODE}/csi-x")).await,
        Code::Unavailable,
    );
}

#[tokio::test]
async fn an_interrupted_create_is_started_again() {
    let csi = Csi::start().await;
    // What a create cut short between the image and the volume leaves.
    let a = csi
        .svc
        .post(
            "/v1/images",
            json!({"name": "csi-half", "path": csi.svc.images.join("csi-half.img"),
                   "create": {"size_bytes": 2 * MIB}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let v = csi.create("half", 4 * MIB, block()).await;
    assert_eq!(v.capacity_bytes, 4 * MIB);
    let image = csi.svc.get("/v1/images/csi-half").await.body;
    assert_eq!(image["size_bytes"], json!(4 * MIB));
}

#[tokio::test]
async fn delete_is_idempotent_and_refuses_volumes_in_use() {
    let csi = Csi::start().await;
    let v = csi.create("del", 16 * MIB, mount("ext4", &[])).await;
    // In use: a mounted filesystem (the API sees the device held).
    let staging = csi.staging("del");
    csi.stage(&v.volume_id, &staging, mount("ext4", &[]))
        .await
        .unwrap();
    let s = assert_code(csi.delete(&v.volume_id).await, Code::FailedPrecondition);
    assert!(s.message().contains("mounted"), "{}", s.message());
    csi.unstage(&v.volume_id, &staging).await.unwrap();
    // In use: a bind-mounted device node (nothing holds the device open).
    let b = csi.create("del-block", 4 * MIB, block()).await;
    let bstage = csi.staging("del-block");
    let target = csi.target("del-block");
    csi.stage(&b.volume_id, &bstage, block()).await.unwrap();
    csi.publish(&b.volume_id, &bstage, &target, block(), false)
        .await
        .unwrap();
    let s = assert_code(csi.delete(&b.volume_id).await, Code::FailedPrecondition);
    assert!(
        s.message().contains(&target.display().to_string()),
        "{}",
        s.message()
    );
    csi.unpublish(&b.volume_id, &target).await.unwrap();
    csi.delete(&b.volume_id).await.unwrap();
    // Deleted, then deleted again; ids that name nothing are deleted already.
    csi.delete(&v.volume_id).await.unwrap();
    csi.delete(&v.volume_id).await.unwrap();
    csi.delete("reallyfakevolumeid").await.unwrap();
    csi.delete(&format!("{NODE}/csi-never-made")).await.unwrap();
    assert_code(csi.delete("").await, Code::InvalidArgument);
    // Another node's volume is not this driver's to delete.
    let s = assert_code(
        csi.delete("node-b/csi-pvc-1").await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("node-b"), "{}", s.message());
    assert_eq!(csi.svc.get("/v1/volumes").await.body, json!([]));
    assert_eq!(csi.svc.get("/v1/images").await.body, json!([]));
}

#[tokio::test]
async fn validate_confirms_what_the_driver_serves() {
    let csi = Csi::start().await;
    let v = csi.create("val", MIB, block()).await;
    let validate = |id: &str, caps, mutable: &[(&str, &str)]| {
        let mut c = csi.controller.clone();
        let req = ValidateVolumeCapabilitiesRequest {
            volume_id: id.into(),
            volume_capabilities: caps,
            mutable_parameters: mutable
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        };
        async move {
            c.validate_volume_capabilities(req)
                .await
                .map(|r| r.into_inner())
        }
    };
    let ok = validate(&v.volume_id, vec![block(), mount("xfs", &["noatime"])], &[])
        .await
        .unwrap();
    let confirmed = ok.confirmed.unwrap();
    assert_eq!(confirmed.volume_capabilities.len(), 2);
    let no = validate(
        &v.volume_id,
        vec![block(), with_mode(block(), Mode::MultiNodeReaderOnly)],
        &[],
    )
    .await
    .unwrap();
    assert!(no.confirmed.is_none());
    assert!(
        no.message.contains("MULTI_NODE_READER_ONLY"),
        "{}",
        no.message
    );
    // A VolumeAttributesClass's keys are confirmed; an unknown one named.
    let ok = validate(&v.volume_id, vec![block()], &[("qos.iops", "500")])
        .await
        .unwrap();
    assert_eq!(
        ok.confirmed.unwrap().mutable_parameters,
        HashMap::from([("qos.iops".to_string(), "500".to_string())])
    );
    let no = validate(&v.volume_id, vec![block()], &[("qos.iopz", "500")])
        .await
        .unwrap();
    assert!(no.confirmed.is_none());
    assert!(
        no.message.contains("unknown mutable parameter 'qos.iopz'"),
        "{}",
        no.message
    );
    assert_code(
        validate(&v.volume_id, vec![], &[]).await,
        Code::InvalidArgument,
    );
    assert_code(
        validate("", vec![block()], &[]).await,
        Code::InvalidArgument,
    );
    assert_code(
        validate(&format!("{NODE}/csi-nope"), vec![block()], &[]).await,
        Code::NotFound,
    );
    assert_code(validate("nope", vec![block()], &[]).await, Code::NotFound);
}

#[tokio::test]
async fn list_volumes_pages_through_the_drivers_volumes_only() {
    let csi = Csi::start().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            csi.create(&format!("list-{i}"), MIB, block())
                .await
                .volume_id,
        );
    }
    // A user's own volume is not the driver's.
    csi.svc.loop_volume("mine", 1).await;
    let list = |max: i32, token: &str| {
        let mut c = csi.controller.clone();
        let req = ListVolumesRequest {
            max_entries: max,
            starting_token: token.into(),
        };
        async move { c.list_volumes(req).await.map(|r| r.into_inner()) }
    };
    let all = list(0, "").await.unwrap();
    let got: Vec<String> = all
        .entries
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
        .collect();
    assert_eq!(got, ids);
    assert!(all.next_token.is_empty());
    for e in &all.entries {
        let v = e.volume.as_ref().unwrap();
        assert_eq!(v.capacity_bytes, MIB);
        assert_eq!(v.accessible_topology, vec![topology(NODE)]);
    }
    // Pages of two; the last volume of a page is deleted before the next page.
    let p1 = list(2, "").await.unwrap();
    assert_eq!(p1.entries.len(), 2);
    assert!(!p1.next_token.is_empty());
    csi.delete(&ids[1]).await.unwrap();
    let p2 = list(2, &p1.next_token).await.unwrap();
    let p2_ids: Vec<&str> = p2
        .entries
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.as_str())
        .collect();
    assert_eq!(p2_ids, vec![ids[2].as_str(), ids[3].as_str()]);
    let p3 = list(2, &p2.next_token).await.unwrap();
    assert_eq!(p3.entries.len(), 1);
    assert!(p3.next_token.is_empty());
    assert_code(list(2, "invalid-token").await, Code::Aborted);
    assert_code(list(-1, "").await, Code::InvalidArgument);
}

#[tokio::test]
async fn capacity_is_the_free_space_under_the_image_root() {
    let csi = Csi::start().await;
    let capacity = |req: GetCapacityRequest| {
        let mut c = csi.controller.clone();
        async move {
            c.get_capacity(req)
                .await
                .map(|r| r.into_inner().available_capacity)
        }
    };
    let free = capacity(GetCapacityRequest::default()).await.unwrap();
    let st = rustix::fs::statvfs(&csi.svc.images).unwrap();
    let expect = (st.f_bavail * st.f_frsize) as i64;
    // Other processes write to the same filesystem meanwhile.
    assert!(
        (free - expect).abs() < 256 * MIB,
        "GetCapacity {free}, statvfs {expect}"
    );
    let here = GetCapacityRequest {
        volume_capabilities: vec![mount("ext4", &[])],
        parameters: HashMap::from([("backend".to_string(), "loop".to_string())]),
        accessible_topology: Some(topology(NODE)),
    };
    assert!(capacity(here).await.unwrap() > 0);
    let elsewhere = GetCapacityRequest {
        accessible_topology: Some(topology("node-b")),
        ..Default::default()
    };
    assert_eq!(capacity(elsewhere).await.unwrap(), 0);
    let multi = GetCapacityRequest {
        volume_capabilities: vec![with_mode(block(), Mode::MultiNodeMultiWriter)],
        ..Default::default()
    };
    assert_eq!(capacity(multi).await.unwrap(), 0);
    let typo = GetCapacityRequest {
        parameters: HashMap::from([("bakend".to_string(), "loop".to_string())]),
        ..Default::default()
    };
    assert_code(capacity(typo).await, Code::InvalidArgument);
}
