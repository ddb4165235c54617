//! `/v1/volumes` on the loop backend: real devices, real data, real counters.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;

use hyper::StatusCode;
use serde_json::{Value, json};

use crate::eventually;
use crate::harness::{Service, assert_error, backing_file, serves_from};

/// A 1 MiB pattern that differs at every 4 KiB.
fn pattern(seed: u8) -> Vec<u8> {
    (0..1 << 20)
        .map(|i: usize| (i / 4096) as u8 ^ seed ^ (i as u8))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn data_written_through_the_device_lands_in_the_image() {
    let s = Service::start().await;
    let v = s.loop_volume("data", 16).await;
    let dev = v["device"].as_str().unwrap().to_string();
    assert_eq!(v["state"], "attached");
    assert_eq!(v["backend"], "loop");
    assert_eq!(v["dispatch"], "kernel");
    assert_eq!(v["direct_io"], true, "ext4 supports direct I/O");
    let image_path = s.get("/v1/images/data-img").await.body["path"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(backing_file(&dev).as_deref(), Some(image_path.as_str()));

    // Write through the device with O_DIRECT, then flush.
    let data = pattern(7);
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&dev)
            .unwrap();
        let mut buf = AlignedBuf::new(data.len());
        buf.as_mut().copy_from_slice(&data);
        f.seek(SeekFrom::Start(4 << 20)).unwrap();
        f.write_all(buf.as_ref()).unwrap();
        f.sync_all().unwrap();
    }
    // The bytes are in the image file at the same offset.
    let mut img = std::fs::File::open(&image_path).unwrap();
    img.seek(SeekFrom::Start(4 << 20)).unwrap();
    let mut back = vec![0u8; data.len()];
    img.read_exact(&mut back).unwrap();
    assert!(back == data, "image content differs from what was written");

    // Read back through the device.
    let mut f = std::fs::File::open(&dev).unwrap();
    f.seek(SeekFrom::Start(4 << 20)).unwrap();
    let mut through = vec![0u8; data.len()];
    f.read_exact(&mut through).unwrap();
    assert!(through == data);
    drop(f);

    let st = s.get("/v1/volumes/data/stats").await;
    assert_eq!(st.status, StatusCode::OK, "{}", st.body);
    assert!(
        st.body["write"]["ops"].as_u64().unwrap() >= 1,
        "{}",
        st.body
    );
    assert!(
        st.body["write"]["bytes"].as_u64().unwrap() >= 1 << 20,
        "{}",
        st.body
    );
    assert!(
        st.body["read"]["bytes"].as_u64().unwrap() >= 1 << 20,
        "{}",
        st.body
    );
    assert_eq!(
        st.body["write"]["errors"],
        Value::Null,
        "the kernel does not count errors"
    );

    let d = s.delete("/v1/volumes/data").await;
    assert_eq!(d.status, StatusCode::NO_CONTENT);
    assert!(
        !serves_from(&dev, s.dir.path()),
        "device unbound after delete"
    );
    assert!(s.my_loop_devices().is_empty());
    assert_error(&s.get("/v1/volumes/data").await, 404, "volume_not_found");
    let ev = s.get("/v1/events?volume=").await;
    assert_eq!(ev.status, StatusCode::NOT_FOUND);
    let ev = s
        .get(&format!("/v1/events?volume={}", v["id"].as_str().unwrap()))
        .await;
    let kinds: Vec<_> = ev
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        kinds,
        [
            "volume_created",
            "volume_attached",
            "volume_detaching",
            "volume_deleted"
        ]
    );
    let attached = s
        .get(&format!(
            "/v1/events?volume={}&kind=volume_attached",
            v["id"].as_str().unwrap()
        ))
        .await;
    let attached = attached.body.as_array().unwrap();
    assert_eq!(attached.len(), 1, "one event of that kind: {attached:?}");
    assert_eq!(attached[0]["kind"], "volume_attached");
}

/// A heap buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        Self { ptr, len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: allocated with len bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn as_ref(&self) -> &[u8] {
        // SAFETY: allocated with len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr,
                std::alloc::Layout::from_size_align(self.len, 4096).unwrap(),
            )
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn read_only_volume_refuses_writes() {
    let s = Service::start().await;
    s.image("ro-img", 8).await;
    let a = s
        .post(
            "/v1/volumes",
            json!({"name": "ro", "image": "ro-img", "backend": "loop", "read_only": true}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(a.body["read_only"], true);
    let dev = a.body["device"].as_str().unwrap();
    assert_eq!(
        std::fs::read_to_string(format!("/sys/block/{}/ro", &dev[5..]))
            .unwrap()
            .trim(),
        "1"
    );
    // Depending on the kernel, the open or the write is refused.
    let refused = std::fs::OpenOptions::new()
        .write(true)
        .open(dev)
        .and_then(|mut f| f.write_all(&[0u8; 4096]).and_then(|_| f.sync_all()));
    let err = refused.expect_err("a write to a read-only volume must fail");
    assert!(
        matches!(
            err.raw_os_error(),
            Some(libc::EROFS | libc::EPERM | libc::EACCES)
        ),
        "{err}"
    );
    let mut buf = [0u8; 512];
    std::fs::File::open(dev)
        .unwrap()
        .read_exact(&mut buf)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn create_is_idempotent_by_name() {
    let s = Service::start().await;
    s.image("i1", 8).await;
    s.image("i2", 8).await;
    let spec = json!({"name": "v", "image": "i1", "backend": "loop"});
    let a = s.post("/v1/volumes", spec.clone()).await;
    assert_eq!(a.status, StatusCode::CREATED);
    // The same spec, spelled with defaults and the image id: the same volume.
    let image_id = s.get("/v1/images/i1").await.body["id"].clone();
    let same = json!({"name": "v", "image": image_id, "backend": "loop", "dispatch": "auto",
                      "read_only": false, "queues": 1, "queue_depth": 128, "qos": null});
    let b = s.post("/v1/volumes", same).await;
    assert_eq!(b.status, StatusCode::OK, "{}", b.body);
    assert_eq!(b.body["id"], a.body["id"]);
    // Another spec under the same name.
    let before = s.snapshot().await;
    let c = s
        .post(
            "/v1/volumes",
            json!({"name": "v", "image": "i2", "backend": "loop"}),
        )
        .await;
    assert_error(&c, 409, "volume_exists");
    assert!(
        c.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("image"),
        "{}",
        c.body
    );
    let c = s
        .post(
            "/v1/volumes",
            json!({"name": "v", "image": "i1", "backend": "loop", "read_only": true}),
        )
        .await;
    assert_error(&c, 409, "volume_exists");
    assert_eq!(s.snapshot().await, before);
    assert_eq!(s.my_loop_devices().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn volume_refusals_change_nothing() {
    let s = Service::start().await;
    s.image("img", 8).await;
    s.loop_volume("taken", 8).await;
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            json!({"name": "x", "image": "img", "backend": "ublk"}),
            422,
            "backend_unavailable",
        ),
        (
            json!({"name": "x", "image": "img", "backend": "dm"}),
            422,
            "backend_unavailable",
        ),
        (
            json!({"name": "x", "image": "img", "backend": "loop", "dispatch": "nowait"}),
            422,
            "unsupported",
        ),
        (
            json!({"name": "x", "image": "img", "backend": "loop", "queues": 4}),
            422,
            "unsupported",
        ),
        (
            json!({"name": "x", "image": "img", "backend": "loop", "queue_depth": 64}),
            422,
            "unsupported",
        ),
        (
            json!({"name": "x", "image": "img", "backend": "loop", "qos": {"iops": 100}}),
            422,
            "unsupported",
        ),
        (
            json!({"name": "x", "image": "img", "qos": {"iops": 0}}),
            422,
            "invalid_field",
        ),
        (
            json!({"name": "x", "image": "img", "queues": 0}),
            422,
            "invalid_field",
        ),
        (
            json!({"name": "x", "image": "img", "queue_depth": 5000}),
            422,
            "invalid_field",
        ),
        (json!({"name": "X!", "image": "img"}), 422, "invalid_name"),
        (
            json!({"name": "x", "image": "nope"}),
            404,
            "image_not_found",
        ),
        (
            json!({"name": "x", "image": "taken-img"}),
            409,
            "image_in_use",
        ),
        (
            json!({"name": "x", "image": "img", "backend": "nvme"}),
            400,
            "invalid_body",
        ),
        (
            json!({"name": "x", "image": "img", "colour": "blue"}),
            400,
            "invalid_body",
        ),
        (json!({"name": "x"}), 400, "invalid_body"),
        (
            json!({"name": "x", "image": "img", "queues": -1}),
            400,
            "invalid_body",
        ),
    ];
    let before = s.snapshot().await;
    for (body, status, code) in cases {
        let a = s.post("/v1/volumes", body.clone()).await;
        assert_error(&a, status, code);
        assert_eq!(
            s.snapshot().await,
            before,
            "refusal of {body} changed something"
        );
    }
    let host = s.get("/v1/host").await.body;
    let a = s
        .post(
            "/v1/volumes",
            json!({"name": "x", "image": "img", "backend": "ublk"}),
        )
        .await;
    let reason = host["backends"]["ublk"]["reason"].as_str().unwrap();
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(reason),
        "{}",
        a.body
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn live_changes_a_loop_volume_cannot_make_are_refused() {
    let s = Service::start().await;
    s.loop_volume("p", 8).await;
    let before = s.snapshot().await;
    for (body, status, code, field) in [
        (json!({"dispatch": "nowait"}), 422, "not_live", "dispatch"),
        (json!({"read_only": true}), 422, "not_live", "read_only"),
        (json!({"qos": {"iops": 10}}), 422, "not_live", "qos"),
        (json!({"queues": 2}), 400, "invalid_body", "queues"),
    ] {
        let a = s.patch("/v1/volumes/p", body).await;
        assert_error(&a, status, code);
        assert!(
            a.body["error"]["message"].as_str().unwrap().contains(field),
            "{}",
            a.body
        );
        assert_eq!(s.snapshot().await, before);
    }
    assert_error(
        &s.patch("/v1/volumes/none", json!({})).await,
        404,
        "volume_not_found",
    );
    // No-op changes are fine and change nothing.
    let a = s
        .patch("/v1/volumes/p", json!({"read_only": false, "qos": null}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(s.snapshot().await, before);
}

/// What a refused PATCH must leave as it was: the service's view (volumes,
/// events, devices, files), the volume's counters and the kernel's read-only
/// flag of its device.
async fn patch_state(
    s: &Service,
    name: &str,
    dev: &str,
) -> (crate::harness::Snapshot, Value, String) {
    let mut stats = s.get(&format!("/v1/volumes/{name}/stats")).await.body;
    // Windows of rates move with the clock, not with the volume; the page
    // cache with what the host reads (the snapshot reads the image).
    stats["rates"] = Value::Null;
    stats["page_cache"] = Value::Null;
    let ro = std::fs::read_to_string(format!("/sys/block/{}/ro", dev.trim_start_matches("/dev/")))
        .unwrap();
    (s.snapshot().await, stats, ro)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_patch_whose_second_change_is_refused_changes_nothing() {
    let s = Service::start().await;
    let w = s.loop_volume("w", 8).await;
    s.image("r-img", 8).await;
    let r = s
        .post(
            "/v1/volumes",
            json!({"name": "r", "image": "r-img", "backend": "loop", "read_only": true}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = r.body;
    // First a change that passes (or a no-op), then one that is refused.
    for (name, vol, body, status, code, rule) in [
        (
            "w",
            &w,
            json!({"dispatch": "auto", "read_only": true}),
            422,
            "not_live",
            "read_only",
        ),
        (
            "w",
            &w,
            json!({"qos": null, "dispatch": "nowait"}),
            422,
            "not_live",
            "dispatch",
        ),
        (
            "w",
            &w,
            json!({"dispatch": "auto", "qos": {"iops": 0}}),
            422,
            "invalid_field",
            "qos.iops",
        ),
        (
            "r",
            &r,
            json!({"dispatch": "auto", "read_only": false}),
            422,
            "not_live",
            "created read-only",
        ),
        (
            "r",
            &r,
            json!({"qos": null, "read_only": false}),
            422,
            "not_live",
            "created read-only",
        ),
    ] {
        let dev = vol["device"].as_str().unwrap();
        let before = patch_state(&s, name, dev).await;
        let a = s.patch(&format!("/v1/volumes/{name}"), body.clone()).await;
        assert_error(&a, status, code);
        let msg = a.body["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(name) && msg.contains(rule),
            "PATCH {body} of '{name}': {msg}"
        );
        assert_eq!(
            patch_state(&s, name, dev).await,
            before,
            "PATCH {body} of '{name}' changed the volume"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn thirty_two_concurrent_creates_of_one_name_make_one_device() {
    let s = std::sync::Arc::new(Service::start().await);
    s.image("shared", 8).await;
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.post(
                "/v1/volumes",
                json!({"name": "one", "image": "shared", "backend": "loop"}),
            )
            .await
        }));
    }
    let mut created = 0;
    let mut ids = std::collections::HashSet::new();
    for t in tasks {
        let a = t.await.unwrap();
        match a.status.as_u16() {
            201 => created += 1,
            200 | 409 => {}
            other => panic!("unexpected {other}: {}", a.body),
        }
        if a.status.is_success() {
            ids.insert(a.body["id"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(created, 1);
    assert_eq!(ids.len(), 1);
    assert_eq!(s.my_loop_devices().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn thirty_two_concurrent_creates_of_different_names() {
    let s = std::sync::Arc::new(Service::start().await);
    for i in 0..32 {
        s.image(&format!("m{i}"), 1).await;
    }
    let mut tasks = Vec::new();
    for i in 0..32 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.post(
                "/v1/volumes",
                json!({"name": format!("vol{i}"), "image": format!("m{i}"), "backend": "loop"}),
            )
            .await
        }));
    }
    let mut devices = std::collections::HashSet::new();
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        devices.insert(a.body["device"].as_str().unwrap().to_string());
    }
    assert_eq!(devices.len(), 32);
    assert_eq!(s.my_loop_devices().len(), 32);
    let log = s.log_text();
    assert!(
        !log.contains("database is locked") && !log.contains("SQLITE_BUSY"),
        "{log}"
    );
    // And 32 concurrent deletes.
    let mut tasks = Vec::new();
    for i in 0..32 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.delete(&format!("/v1/volumes/vol{i}")).await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status, StatusCode::NO_CONTENT);
    }
    assert!(s.my_loop_devices().is_empty());
}

/// How long a test waits for a transient holder of a device to let go.
const WAIT_FREE: std::time::Duration = std::time::Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn a_mounted_volume_is_not_deleted_under_its_user() {
    let s = Service::start().await;
    let v = s.loop_volume("busy", 8).await;
    let dev = v["device"].as_str().unwrap().to_string();
    // Hold the device exclusively, as a mount would.
    let holder = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(&dev)
        .unwrap();
    let before = s.snapshot().await;
    let a = s.delete("/v1/volumes/busy").await;
    assert_error(&a, 409, "device_busy");
    let after = s.get("/v1/volumes/busy").await;
    assert_eq!(after.body["state"], "attached");
    assert!(serves_from(&dev, s.dir.path()));
    assert_eq!(s.snapshot().await, before);
    drop(holder);
    // A plain opener (no O_EXCL) is only found out by the kernel deferring the
    // unbind: the delete is refused and undone, the device keeps working.
    let mut opener = std::fs::File::open(&dev).unwrap();
    let a = s.delete("/v1/volumes/busy").await;
    assert_error(&a, 409, "device_busy");
    assert_eq!(s.get("/v1/volumes/busy").await.body["state"], "attached");
    let mut buf = vec![0u8; 4096];
    opener.read_exact(&mut buf).unwrap();
    drop(opener);
    assert!(
        serves_from(&dev, s.dir.path()),
        "closing the last opener must not unbind it (autoclear undone)"
    );
    // Others on the host may hold the device for a moment (a udev probe,
    // another test's service looking at loop devices): the delete is
    // asked once nobody holds it, as a user would after unmounting.
    eventually(WAIT_FREE, "nobody to hold the device", async || {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(&dev)
            .is_ok()
    })
    .await;
    assert_eq!(
        s.delete("/v1/volumes/busy").await.status,
        StatusCode::NO_CONTENT
    );
    assert!(!serves_from(&dev, s.dir.path()));
}

#[tokio::test(flavor = "multi_thread")]
async fn host_reports_what_this_machine_runs() {
    let s = Service::start().await;
    let h = s.get("/v1/host").await.body;
    assert_eq!(h["backends"]["loop"]["available"], true);
    assert_eq!(h["default_backend"], "loop");
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(h["kernel"], kernel.trim());
    for b in ["ublk", "dm"] {
        if h["backends"][b]["available"] == false {
            assert!(
                h["backends"][b]["reason"]
                    .as_str()
                    .is_some_and(|r| !r.is_empty())
            );
        }
    }
    // backend auto picks the host's default.
    s.image("auto-img", 4).await;
    let a = s
        .post("/v1/volumes", json!({"name": "auto", "image": "auto-img"}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(a.body["backend"], h["default_backend"]);
}

/// What a refusal must leave unchanged is all of it: the snapshot the
/// refusal tests compare differs after each change a refusal could make
/// with every name staying the same (a file's mode, size or bytes alone, a
/// file in the data dir, a registry row the API does not show, an event's
/// text).
#[tokio::test(flavor = "multi_thread")]
async fn the_refusal_snapshot_sees_modes_sizes_contents_rows_and_events() {
    use sqlx::Connection;
    use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
    let s = Service::start().await;
    s.loop_volume("v", 4).await;
    let img = s.images.join("v-img.img");
    let sql = async |q: &'static str| {
        let db = s.data.join("blockplane.db");
        let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
            .await
            .unwrap();
        sqlx::query(q).execute(&mut c).await.unwrap();
        c.close().await.unwrap();
    };
    let base = s.snapshot().await;
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o640)).unwrap();
    assert_ne!(s.snapshot().await, base, "a file's mode changed");
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(s.snapshot().await, base, "the mode is back");

    // One byte changed, the mtime set back: only the bytes differ.
    let m = std::fs::metadata(&img).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.write_all_at(&[1], 4096).unwrap();
    f.sync_all().unwrap();
    let times = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: m.atime(),
            tv_nsec: m.atime_nsec() as _,
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: m.mtime(),
            tv_nsec: m.mtime_nsec() as _,
        },
    };
    rustix::fs::utimensat(rustix::fs::CWD, &img, &times, rustix::fs::AtFlags::empty()).unwrap();
    assert_ne!(s.snapshot().await, base, "a file's bytes changed");
    f.write_all_at(&[0], 4096).unwrap();
    f.sync_all().unwrap();
    rustix::fs::utimensat(rustix::fs::CWD, &img, &times, rustix::fs::AtFlags::empty()).unwrap();
    assert_eq!(s.snapshot().await, base, "the bytes are back");

    f.set_len(m.len() + 4096).unwrap();
    assert_ne!(s.snapshot().await, base, "a file's size changed");
    f.set_len(m.len()).unwrap();
    let base = s.snapshot().await;

    let stray = s.data.join("stray");
    std::fs::write(&stray, b"x").unwrap();
    assert_ne!(s.snapshot().await, base, "a file appeared in the data dir");
    std::fs::remove_file(&stray).unwrap();
    assert_eq!(s.snapshot().await, base);

    sql("INSERT INTO meta (key, value) VALUES ('stray', 'x')").await;
    let base = s.snapshot().await;
    sql("UPDATE meta SET value = 'y' WHERE key = 'stray'").await;
    let changed = s.snapshot().await;
    assert_ne!(changed, base, "a registry row changed");
    sql("UPDATE events SET message = message || '!' WHERE id = (SELECT max(id) FROM events)").await;
    assert_ne!(s.snapshot().await, changed, "an event's text changed");
}
