//! A refusal that names a way out gives only ways that work for the volume
//! or image it names: each test makes the refusal, reads the remedies its
//! message gives, applies each one and sees the refused operation go
//! through. (The image lock's remedy, deleting the other instance's volume,
//! is applied by `instances::a_second_instance_cannot_attach_an_image_the_first_serves`;
//! `--insecure-tcp` on loopback by `auth::insecure_tcp_on_loopback_works_and_the_socket_is_private`.)

use std::os::unix::fs::{FileExt, PermissionsExt};
use std::time::Duration;

use hyper::StatusCode;
use serde_json::{Value, json};

use crate::eventually;
use crate::harness::{LoopFs, Opts, Service, assert_error};
use crate::snapshots::loop_volume;

const EXT4: &[&str] = &["mkfs.ext4", "-q", "-F"];

/// A service with `fs` as a second image root and `fault` set, if any.
async fn service_on(fs: &LoopFs, fault: Option<&str>) -> Service {
    Service::start_with(Opts {
        extra_roots: vec![fs.mnt.clone()],
        env: fault
            .map(|f| ("BLOCKPLANE_TEST_FAULT".to_string(), f.to_string()))
            .into_iter()
            .collect(),
        ..Default::default()
    })
    .await
}

/// A sparse image `name` of `mib` MiB on `fs` with `data_mib` MiB of data
/// from 1 MiB on.
async fn image_of(s: &Service, fs: &LoopFs, name: &str, mib: u64, data_mib: u64) {
    let path = fs.mnt.join(format!("{name}.img"));
    let a = s
        .post(
            "/v1/images",
            json!({"name": name, "path": path, "create": {"size_bytes": mib << 20}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let chunk = vec![0x5a; 1 << 20];
    for off in 0..data_mib {
        f.write_all_at(&chunk, (1 + off) << 20).unwrap();
    }
    f.sync_all().unwrap();
}

/// A 64 MiB sparse image `name` on `fs` with 8 MiB of data.
async fn image_on(s: &Service, fs: &LoopFs, name: &str) {
    image_of(s, fs, name, 64, 8).await;
}

fn message(a: &blockplane_client::Answer) -> String {
    a.body["error"]["message"].as_str().unwrap().to_string()
}

/// Polls an image until it is no longer `copying`; its last view.
async fn wait_ready(s: &Service, image: &str) -> Value {
    let path = format!("/v1/images/{image}");
    eventually(Duration::from_secs(120), "the copy to end", async || {
        s.get(&path).await.body["state"] != "copying"
    })
    .await;
    s.get(&path).await.body
}

/// On ext4 (no shared extents) a snapshot under a writable loop volume is
/// refused; every remedy the refusal names is applied, each on an image and
/// volume of its own, and the snapshot then succeeds.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_refused_under_a_writable_loop_volume_names_only_remedies_that_work() {
    let fs = LoopFs::new(EXT4, 512 << 20);
    let s = service_on(&fs, None).await;
    let refused = async |n: u32| {
        let (image, vol) = (format!("src{n}"), format!("v{n}"));
        image_on(&s, &fs, &image).await;
        let v = loop_volume(&s, &vol, &image, false).await;
        assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
        let a = s
            .post(
                &format!("/v1/images/{image}/snapshots"),
                json!({"name": format!("{image}-s")}),
            )
            .await;
        assert_error(&a, 409, "volume_attached_snapshot_unsupported");
        (image, vol, message(&a))
    };
    let (_, vol, m) = refused(0).await;
    let mut applied = 0;
    if m.contains("PATCH") {
        let (image, vol, _) = refused(1).await;
        let p = s
            .patch(&format!("/v1/volumes/{vol}"), json!({"read_only": true}))
            .await;
        assert_eq!(
            p.status,
            StatusCode::OK,
            "the remedy in \"{m}\": {}",
            p.body
        );
        snapshot_goes_through(&s, &image).await;
        applied += 1;
    }
    if m.contains(&format!("DELETE /v1/volumes/{vol}")) {
        let (image, vol, _) = refused(2).await;
        let d = s.delete(&format!("/v1/volumes/{vol}")).await;
        assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
        snapshot_goes_through(&s, &image).await;
        applied += 1;
        if m.contains("\"read_only\": true") {
            // Deleted, then created again read-only: it serves meanwhile.
            let (image, vol, _) = refused(3).await;
            let d = s.delete(&format!("/v1/volumes/{vol}")).await;
            assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.body);
            let v = loop_volume(&s, &vol, &image, true).await;
            assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
            snapshot_goes_through(&s, &image).await;
            applied += 1;
        }
    }
    assert!(
        applied > 0,
        "the refusal names no remedy this test knows: {m}"
    );
}

async fn snapshot_goes_through(s: &Service, image: &str) {
    let a = s
        .post(
            &format!("/v1/images/{image}/snapshots"),
            json!({"name": format!("{image}-s")}),
        )
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    let end = wait_ready(s, &format!("{image}-s")).await;
    assert_eq!(end["state"], "ready", "{end}");
}

/// An allocate refused under a loop volume names the operations that let it
/// run; applied (the volume deleted, the image allocated, the volume created
/// again), it does.
#[tokio::test(flavor = "multi_thread")]
async fn an_allocate_refused_under_a_loop_volume_runs_after_its_remedy() {
    let fs = LoopFs::new(EXT4, 512 << 20);
    let s = service_on(&fs, None).await;
    image_on(&s, &fs, "sp").await;
    let v = loop_volume(&s, "av", "sp", false).await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let a = s.post("/v1/images/sp/allocate", json!(null)).await;
    assert_error(&a, 409, "device_busy");
    let m = message(&a);
    assert!(
        m.contains("DELETE /v1/volumes/av") && m.contains("POST /v1/images/sp/allocate"),
        "the refusal names the operations of its remedy: {m}"
    );
    assert_eq!(
        s.delete("/v1/volumes/av").await.status,
        StatusCode::NO_CONTENT
    );
    let a = s.post("/v1/images/sp/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    eventually(Duration::from_secs(60), "the allocate to end", async || {
        s.get("/v1/images/sp").await.body["allocate"]["state"] != "running"
    })
    .await;
    let g = s.get("/v1/images/sp").await.body;
    assert_eq!(g["allocation"], "full", "{g}");
    let v = loop_volume(&s, "av", "sp", false).await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
}

/// A loop volume's read-only flag cannot change live, nor can a volume
/// created read-only become writable: each refusal's remedy (delete it,
/// create it again as wanted) gives a device that is read-only or writable.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_change_refused_on_a_loop_volume_is_made_by_its_remedy() {
    let s = Service::start().await;
    for (created_ro, want_ro, code) in [(false, true, "not_live"), (true, false, "not_live")] {
        let image = format!("ro-{created_ro}");
        s.image(&image, 4).await;
        let v = loop_volume(&s, "rv", &image, created_ro).await;
        assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
        let a = s
            .patch("/v1/volumes/rv", json!({"read_only": want_ro}))
            .await;
        assert_error(&a, 422, code);
        let m = message(&a);
        assert!(
            m.contains("delete") && m.contains(&format!("\"read_only\": {want_ro}")),
            "the refusal says how to get a volume with read_only {want_ro}: {m}"
        );
        assert_eq!(
            s.delete("/v1/volumes/rv").await.status,
            StatusCode::NO_CONTENT
        );
        let v = loop_volume(&s, "rv", &image, want_ro).await;
        assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
        let dev = v.body["device"]
            .as_str()
            .unwrap()
            .trim_start_matches("/dev/")
            .to_string();
        let ro = std::fs::read_to_string(format!("/sys/block/{dev}/ro")).unwrap();
        assert_eq!(ro.trim(), if want_ro { "1" } else { "0" }, "{}", v.body);
        assert_eq!(
            s.delete("/v1/volumes/rv").await.status,
            StatusCode::NO_CONTENT
        );
    }
}

/// What a loop volume cannot do, backend ublk can; the refusal offers ublk
/// only where this host has it (applied, it is not refused as unavailable),
/// and the other way out it names (dispatch `auto`, no QoS) works.
#[tokio::test(flavor = "multi_thread")]
async fn loop_refusals_offer_backend_ublk_only_where_it_serves() {
    let s = Service::start().await;
    s.image("u", 4).await;
    let ublk_here = s.get("/v1/host").await.body["backends"]["ublk"]["available"] == true;
    for (extra, way_out) in [
        (json!({"queues": 4}), json!({})),
        (json!({"queue_depth": 16}), json!({})),
        (json!({"max_io_bytes": 4096}), json!({})),
        (json!({"qos": {"iops": 100}}), json!({"qos": null})),
        (json!({"dispatch": "nowait"}), json!({"dispatch": "auto"})),
    ] {
        let mut body = json!({"name": "lv", "image": "u", "backend": "loop"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let a = s.post("/v1/volumes", body.clone()).await;
        assert_error(&a, 422, "unsupported");
        let m = message(&a);
        let offers_ublk = [
            "use backend ublk",
            "backend: \"ublk\"",
            "\"backend\": \"ublk\"",
        ]
        .iter()
        .any(|o| m.contains(o));
        if offers_ublk {
            let mut ublk = body.clone();
            ublk["backend"] = json!("ublk");
            let u = s.post("/v1/volumes", ublk).await;
            assert_ne!(
                u.body["error"]["code"], "backend_unavailable",
                "{extra}: the refusal offered backend ublk ({m}), which this host lacks: {}",
                u.body
            );
            if u.status == StatusCode::CREATED {
                assert_eq!(
                    s.delete("/v1/volumes/lv").await.status,
                    StatusCode::NO_CONTENT
                );
            }
        } else {
            assert!(
                !ublk_here,
                "{extra}: ublk serves here, and the refusal does not say: {m}"
            );
        }
        // Without what loop cannot do, the volume is made.
        let mut plain = body.clone();
        for k in extra.as_object().unwrap().keys() {
            plain.as_object_mut().unwrap().remove(k);
        }
        plain
            .as_object_mut()
            .unwrap()
            .extend(way_out.as_object().unwrap().clone());
        let v = s.post("/v1/volumes", plain).await;
        assert_eq!(v.status, StatusCode::CREATED, "{extra}: {}", v.body);
        assert_eq!(
            s.delete("/v1/volumes/lv").await.status,
            StatusCode::NO_CONTENT
        );
    }
}

/// A QoS limit of 0 (or past the largest) is refused with "use null for no
/// limit"; a null there is taken, at create and in a PATCH, on any backend.
#[tokio::test(flavor = "multi_thread")]
async fn a_qos_limit_refused_as_zero_takes_the_null_its_refusal_names() {
    let s = Service::start().await;
    s.image("q", 4).await;
    let a = s
        .post(
            "/v1/volumes",
            json!({"name": "qv", "image": "q", "qos": {"iops": 0}}),
        )
        .await;
    assert_error(&a, 422, "invalid_field");
    assert!(message(&a).contains("use null for no limit"), "{}", a.body);
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "qv", "image": "q", "qos": {"iops": null}}),
        )
        .await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    let p = s
        .patch(
            "/v1/volumes/qv",
            json!({"qos": {"iops": 9007199254740992u64}}),
        )
        .await;
    assert_error(&p, 422, "invalid_field");
    assert!(message(&p).contains("use null for no limit"), "{}", p.body);
    let p = s
        .patch("/v1/volumes/qv", json!({"qos": {"iops": null}}))
        .await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.body);
}

/// While an allocate runs, what would change the image is refused naming
/// two ways out: stop it, or wait for its end. Each works.
#[tokio::test(flavor = "multi_thread")]
async fn operations_refused_during_an_allocate_go_through_after_either_remedy() {
    let fs = LoopFs::new(EXT4, 1 << 30);
    // Allocates take 100 ms more a 16 MiB stretch: 1.6 s for 256 MiB.
    let s = service_on(&fs, Some("slow_allocate")).await;
    for (i, stop) in [true, false].into_iter().enumerate() {
        let name = format!("al{i}");
        let path = fs.mnt.join(format!("{name}.img"));
        let a = s
            .post(
                "/v1/images",
                json!({"name": name, "path": path, "create": {"size_bytes": 256 << 20}}),
            )
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        let a = s
            .post(&format!("/v1/images/{name}/allocate"), json!(null))
            .await;
        assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
        let grow = json!({"size_bytes": 320 << 20});
        let r = s
            .post(&format!("/v1/images/{name}/resize"), grow.clone())
            .await;
        assert_error(&r, 409, "allocate_conflict");
        let m = message(&r);
        assert!(
            m.contains(&format!("DELETE /v1/images/{name}/allocate"))
                && m.contains(&format!("GET /v1/images/{name}")),
            "{m}"
        );
        if stop {
            let c = s.delete(&format!("/v1/images/{name}/allocate")).await;
            assert_eq!(c.status, StatusCode::OK, "{}", c.body);
        } else {
            let path = format!("/v1/images/{name}");
            eventually(
                Duration::from_secs(120),
                "the allocate to end",
                async || s.get(&path).await.body["allocate"]["state"] != "running",
            )
            .await;
        }
        let r = s.post(&format!("/v1/images/{name}/resize"), grow).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "after {}: {}",
            if stop { "stopping it" } else { "its end" },
            r.body
        );
    }
    // Stopping an allocate when none runs says how to start one; it works.
    let c = s.delete("/v1/images/al0/allocate").await;
    assert_error(&c, 409, "allocate_conflict");
    let m = message(&c);
    assert!(m.contains("POST /v1/images/al0/allocate"), "{m}");
    let a = s.post("/v1/images/al0/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    let c = s.delete("/v1/images/al0/allocate").await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);
}

/// A copy reading its source refuses what would change the source until it
/// is ready, "or stopped by deleting" the copy: deleted, the change goes
/// through. A copy the service died during is failed, and its remedy (delete
/// it, snapshot again) gives a ready snapshot.
#[tokio::test(flavor = "multi_thread")]
async fn a_copys_source_and_a_failed_copy_take_their_remedies() {
    let fs = LoopFs::new(EXT4, 512 << 20);
    let mut s = service_on(&fs, Some("slow_copy")).await;
    // 96 MiB of data, the copy held at the copy gate (`slow_copy`) while it
    // exists: it still runs when the resize and the kill come, however
    // loaded the host.
    image_of(&s, &fs, "cs", 128, 96).await;
    let gate = s.shut_copy_gate();
    let a = s
        .post("/v1/images/cs/snapshots", json!({"name": "cs-s"}))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(a.body["state"], "copying", "{}", a.body);
    let grow = json!({"size_bytes": 192 << 20});
    let r = s.post("/v1/images/cs/resize", grow.clone()).await;
    assert_error(&r, 409, "copy_source_busy");
    assert!(message(&r).contains("deleting 'cs-s'"), "{}", r.body);
    assert_eq!(
        s.delete("/v1/images/cs-s").await.status,
        StatusCode::NO_CONTENT
    );
    let r = s.post("/v1/images/cs/resize", grow).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);

    let a = s
        .post("/v1/images/cs/snapshots", json!({"name": "cs-t"}))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    s.kill();
    s.restart().await;
    let g = s.get("/v1/images/cs-t").await.body;
    assert_eq!(g["state"], "failed", "{g}");
    let why = g["state_reason"].as_str().unwrap();
    assert!(why.contains("delete the image, then snapshot"), "{g}");
    assert_eq!(
        s.delete("/v1/images/cs-t").await.status,
        StatusCode::NO_CONTENT
    );
    let _ = std::fs::remove_file(&gate);
    let a = s
        .post("/v1/images/cs/snapshots", json!({"name": "cs-t"}))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    let end = wait_ready(&s, "cs-t").await;
    assert_eq!(end["state"], "ready", "{end}");
}

/// A file writable by group or others is refused with "make it 0600 or
/// 0640": either mode registers it.
#[tokio::test(flavor = "multi_thread")]
async fn a_loosely_permitted_file_registers_in_either_mode_its_refusal_names() {
    let s = Service::start().await;
    for mode in [0o600, 0o640] {
        let path = s.images.join(format!("loose-{mode:o}.img"));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(1 << 20).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let name = format!("loose-{mode:o}");
        let a = s
            .post("/v1/images", json!({"name": name, "path": path}))
            .await;
        assert_error(&a, 422, "loose_permissions");
        assert!(message(&a).contains("make it 0600 or 0640"), "{}", a.body);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        let a = s
            .post("/v1/images", json!({"name": name, "path": path}))
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "mode {mode:o}: {}", a.body);
    }
}

/// A loop volume whose device is mounted, or held open by another process,
/// is not deleted; the refusal's remedy (unmount it, close it) lets the
/// delete through.
#[tokio::test(flavor = "multi_thread")]
async fn a_delete_refused_for_a_mounted_or_open_device_goes_through_after_its_remedy() {
    let s = Service::start().await;
    let v = s.loop_volume("mv", 16).await;
    let dev = v["device"].as_str().unwrap().to_string();
    let made = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", &dev])
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let mnt = s.dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    assert!(
        std::process::Command::new("mount")
            .arg(&dev)
            .arg(&mnt)
            .status()
            .unwrap()
            .success()
    );
    let d = s.delete("/v1/volumes/mv").await;
    assert_error(&d, 409, "device_busy");
    assert!(message(&d).contains("unmount it first"), "{}", d.body);
    assert!(
        std::process::Command::new("umount")
            .arg(&mnt)
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(
        s.delete("/v1/volumes/mv").await.status,
        StatusCode::NO_CONTENT
    );

    let v = s.loop_volume("ov", 4).await;
    let dev = v["device"].as_str().unwrap().to_string();
    let held = std::fs::File::open(&dev).unwrap();
    let d = s.delete("/v1/volumes/ov").await;
    assert_error(&d, 409, "device_busy");
    assert!(message(&d).contains("close it first"), "{}", d.body);
    drop(held);
    assert_eq!(
        s.delete("/v1/volumes/ov").await.status,
        StatusCode::NO_CONTENT
    );
}
