//! `/v1/images`: registration, creation, growth, removal, and every refusal.

use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::harness::{Opts, Service, assert_error, device_size};

fn make_file(path: &std::path::Path, size: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn register_show_list_and_forget() {
    let s = Service::start().await;
    let path = s.images.join("a.img");
    make_file(&path, 8 << 20);
    let a = s
        .post("/v1/images", json!({"name": "a", "path": path}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let id = a.body["id"].as_str().unwrap().to_string();
    assert_eq!(a.body["size_bytes"], 8 << 20);
    assert_eq!(a.body["path"], path.display().to_string());
    assert_eq!(a.body["filesystem"], "ext4");
    // `set_len` only: one hole, so FIEMAP makes it sparse.
    assert_eq!(a.body["allocation"], "sparse", "{}", a.body);
    assert_eq!(a.body["volumes"], json!([]));

    for key in [id.as_str(), "a"] {
        let g = s.get(&format!("/v1/images/{key}")).await;
        assert_eq!(g.status, StatusCode::OK);
        assert_eq!(g.body["id"], id.as_str());
    }
    let l = s.get("/v1/images").await;
    assert_eq!(l.body.as_array().unwrap().len(), 1);

    let d = s.delete("/v1/images/a").await;
    assert_eq!(d.status, StatusCode::NO_CONTENT);
    assert!(path.exists(), "delete without delete_file keeps the file");
    assert_error(&s.get("/v1/images/a").await, 404, "image_not_found");
    let ev = s.get("/v1/events").await;
    let kinds: Vec<_> = ev
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kinds, ["image_registered", "image_deleted"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn create_sparse_and_full() {
    let s = Service::start().await;
    let sparse = s.images.join("sparse.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "sparse", "path": sparse, "create": {"size_bytes": 32 << 20}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(a.body["allocation"], "sparse");
    assert!(a.body["allocated_bytes"].as_u64().unwrap() < 1 << 20);
    let mode = std::fs::metadata(&sparse).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let full = s.images.join("full.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "full", "path": full, "create": {"size_bytes": 32 << 20, "allocation": "full"}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert!(a.body["allocated_bytes"].as_u64().unwrap() >= 32 << 20);
    // Written zeros, not unwritten extents: filefrag shows no "unwritten".
    let out = std::process::Command::new("filefrag")
        .arg("-v")
        .arg(&full)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("unwritten"),
        "{text}"
    );

    // Delete with the file.
    let d = s
        .call(Method::DELETE, "/v1/images/full?delete_file=true", None)
        .await;
    assert_eq!(d.status, StatusCode::NO_CONTENT);
    assert!(!full.exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn registration_refusals_change_nothing() {
    let s = Service::start().await;
    let root = s.images.clone();
    let good = root.join("good.img");
    make_file(&good, 1 << 20);
    assert_eq!(
        s.post("/v1/images", json!({"name": "good", "path": good}))
            .await
            .status,
        StatusCode::CREATED
    );

    // Fixtures for the refusals.
    let outside = s.dir.path().join("outside.img");
    make_file(&outside, 1 << 20);
    symlink(&outside, root.join("link.img")).unwrap();
    std::fs::create_dir(root.join("realdir")).unwrap();
    make_file(&root.join("realdir/inner.img"), 1 << 20);
    symlink(root.join("realdir"), root.join("linkdir")).unwrap();
    std::fs::create_dir(root.join("adir")).unwrap();
    make_file(&root.join("empty.img"), 0);
    make_file(&root.join("odd.img"), 1000);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    make_file(&root.join("linked.img"), 1 << 20);
    std::fs::hard_link(
        root.join("linked.img"),
        s.dir.path().join("hardlink-outside.img"),
    )
    .unwrap();
    make_file(&root.join("loose.img"), 1 << 20);
    std::fs::set_permissions(
        root.join("loose.img"),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    make_file(&root.join("exists.img"), 1 << 20);

    let p = |rel: &str| root.join(rel).display().to_string();
    let cases: Vec<(serde_json::Value, u16, &str)> = vec![
        (
            json!({"name": "x", "path": "/etc/passwd"}),
            403,
            "path_outside_roots",
        ),
        (
            json!({"name": "x", "path": outside}),
            403,
            "path_outside_roots",
        ),
        (
            json!({"name": "x", "path": "relative.img"}),
            403,
            "path_outside_roots",
        ),
        (
            json!({"name": "x", "path": format!("{}/realdir/../good.img", root.display())}),
            403,
            "path_parent_reference",
        ),
        (
            json!({"name": "x", "path": p("link.img")}),
            403,
            "path_symlink",
        ),
        (
            json!({"name": "x", "path": p("linkdir/inner.img")}),
            403,
            "path_symlink",
        ),
        (
            json!({"name": "x", "path": p("missing.img")}),
            404,
            "file_not_found",
        ),
        (
            json!({"name": "x", "path": p("nodir/new.img"), "create": {"size_bytes": 1048576}}),
            404,
            "directory_not_found",
        ),
        (
            json!({"name": "good", "path": p("exists.img")}),
            409,
            "name_taken",
        ),
        (
            json!({"name": "x", "path": p("exists.img"), "create": {"size_bytes": 1048576}}),
            409,
            "file_exists",
        ),
        (
            json!({"name": "x", "path": p("adir")}),
            422,
            "not_regular_file",
        ),
        (
            json!({"name": "x", "path": p("fifo")}),
            422,
            "not_regular_file",
        ),
        (
            json!({"name": "x", "path": p("empty.img")}),
            422,
            "invalid_size",
        ),
        (
            json!({"name": "x", "path": p("odd.img")}),
            422,
            "invalid_size",
        ),
        (
            json!({"name": "x", "path": p("new.img"), "create": {"size_bytes": 1000}}),
            422,
            "invalid_size",
        ),
        (
            json!({"name": "x", "path": p("new.img"), "create": {"size_bytes": 0}}),
            422,
            "invalid_size",
        ),
        (
            json!({"name": "x", "path": good}),
            422,
            "already_registered",
        ),
        (
            json!({"name": "Bad_Name", "path": p("exists.img")}),
            422,
            "invalid_name",
        ),
        (
            json!({"name": "x", "path": p("linked.img")}),
            422,
            "hard_links",
        ),
        (
            json!({"name": "x", "path": p("loose.img")}),
            422,
            "loose_permissions",
        ),
        (json!({"name": "x"}), 400, "invalid_body"),
        (
            json!({"name": "x", "path": p("exists.img"), "surprise": 1}),
            400,
            "invalid_body",
        ),
        (
            json!({"name": "x", "path": p("new.img"), "create": {"size_bytes": "big"}}),
            400,
            "invalid_body",
        ),
        (
            json!({"name": "x", "path": p("new.img"), "create": {"size_bytes": 1048576, "allocation": "thick"}}),
            400,
            "invalid_body",
        ),
        (
            json!({"name": "x", "path": p("exists.img"), "allocation": "thick"}),
            400,
            "invalid_body",
        ),
        (
            json!({"name": "x", "path": p("new.img"), "allocation": "full",
                   "create": {"size_bytes": 1048576, "allocation": "full"}}),
            422,
            "invalid_field",
        ),
        (
            json!({"name": "x", "path": p("new.img"), "allocation": "sparse", "clone_from": "good"}),
            422,
            "invalid_field",
        ),
        // `set_len` only: a hole where `full` says there is none.
        (
            json!({"name": "x", "path": p("exists.img"), "allocation": "full"}),
            422,
            "allocation_mismatch",
        ),
    ];
    let before = s.snapshot().await;
    for (body, status, code) in cases {
        let a = s.post("/v1/images", body.clone()).await;
        assert_error(&a, status, code);
        assert_eq!(
            s.snapshot().await,
            before,
            "refusal of {body} changed something"
        );
    }

    // Bodies that are not JSON at all, or not declared as JSON.
    let raw = |ct: Option<&'static str>, body: &'static str| {
        let sock = s.sock.clone();
        async move {
            use http_body_util::{BodyExt, Full};
            let stream = tokio::net::UnixStream::connect(sock).await.unwrap();
            let (mut tx, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            let mut req = hyper::Request::post("/v1/images").header("host", "x");
            if let Some(ct) = ct {
                req = req.header("content-type", ct);
            }
            let resp = tx
                .send_request(req.body(Full::new(hyper::body::Bytes::from(body))).unwrap())
                .await
                .unwrap();
            let status = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            blockplane_client::Answer {
                status,
                body: serde_json::from_slice(&bytes).unwrap(),
            }
        }
    };
    let a = raw(Some("application/json"), "{not json").await;
    crate::harness::check_against_openapi(&Method::POST, "/v1/images", &a);
    assert_error(&a, 400, "invalid_body");
    let a = raw(None, "{}").await;
    assert_error(&a, 415, "unsupported_media_type");
    assert_eq!(s.snapshot().await, before);
}

#[tokio::test(flavor = "multi_thread")]
async fn grow_follows_to_attached_loop_volumes() {
    let s = Service::start().await;
    let v = s.loop_volume("g", 16).await;
    let dev = v["device"].as_str().unwrap().to_string();
    assert_eq!(device_size(&dev), 16 << 20);

    let before = s.snapshot().await;
    assert_error(
        &s.post("/v1/images/g-img/resize", json!({"size_bytes": 8 << 20}))
            .await,
        422,
        "shrink_refused",
    );
    assert_error(
        &s.post(
            "/v1/images/g-img/resize",
            json!({"size_bytes": (32 << 20) + 100}),
        )
        .await,
        422,
        "invalid_field",
    );
    assert_error(
        &s.post("/v1/images/nope/resize", json!({"size_bytes": 32 << 20}))
            .await,
        404,
        "image_not_found",
    );
    assert_error(
        &s.post("/v1/images/g-img/resize", json!({"size": 1})).await,
        400,
        "invalid_body",
    );
    assert_eq!(s.snapshot().await, before);

    let a = s
        .post("/v1/images/g-img/resize", json!({"size_bytes": 48 << 20}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["image"]["size_bytes"], 48 << 20);
    assert!(
        a.body["image"]["allocated_bytes"].as_u64().unwrap() >= 48 << 20,
        "full images grow fully allocated"
    );
    assert_eq!(a.body["volumes"][0]["size_bytes"], 48 << 20);
    assert_eq!(a.body["volumes"][0]["resize_pending"], false);
    assert_eq!(device_size(&dev), 48 << 20, "the loop device follows");
    let v = s.get("/v1/volumes/g").await;
    assert_eq!(v.body["size_bytes"], 48 << 20);
    let ev = s.get("/v1/events?volume=g").await;
    assert!(
        ev.body
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "volume_resized")
    );

    // In use: cannot be forgotten.
    let before = s.snapshot().await;
    let in_use = s.delete("/v1/images/g-img").await;
    assert_error(&in_use, 409, "image_in_use");
    assert_eq!(
        in_use.body["error"]["message"],
        "image 'g-img' is used by volume(s) 'g' (an image serves one volume at a time)",
        "the refusal names the volume, not its id"
    );
    assert_error(
        &s.call(Method::DELETE, "/v1/images/g-img?delete_file=yes", None)
            .await,
        400,
        "invalid_query",
    );
    assert_eq!(s.snapshot().await, before);
}

/// Makes a new file at `dest` (mode 0600, `size` bytes) that reuses inode
/// number `ino`, which must be free: ext4 hands out the lowest free inode of
/// the parent's group, so fillers take the numbers before it until one gets
/// it. Panics if none does within 512 tries.
fn new_file_on_inode(dir: &std::path::Path, ino: u64, dest: &std::path::Path, size: u64) {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let fillers = dir.parent().unwrap();
    for i in 0..512 {
        let p = dir.join(format!("candidate-{i}"));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&p)
            .unwrap();
        if f.metadata().unwrap().ino() == ino {
            f.set_len(size).unwrap();
            std::fs::rename(&p, dest).unwrap();
            return;
        }
        // Keep the number taken (outside the image root) so the next file moves on.
        std::fs::rename(&p, fillers.join(format!("filler-{i}"))).unwrap();
    }
    panic!("no new file got inode {ino} in 512 tries");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_file_on_a_removed_images_inode_is_not_the_image() {
    use std::os::unix::fs::MetadataExt;
    let s = Service::start().await;
    s.image("a", 4).await;
    let path = s.images.join("a.img");
    let ino = std::fs::metadata(&path).unwrap().ino();
    std::fs::remove_file(&path).unwrap();
    new_file_on_inode(&s.images, ino, &path, 1 << 20);
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino);
    let a = s
        .post("/v1/images/a/resize", json!({"size_bytes": 16u64 << 20}))
        .await;
    assert_error(&a, 409, "image_replaced");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("a.img"),
        "{}",
        a.body
    );
    // The new file was not touched, nor reported as the image.
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    assert_eq!(s.get("/v1/images/a").await.body["size_bytes"], 4u64 << 20);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_file_on_a_renamed_over_images_inode_registers() {
    use std::os::unix::fs::MetadataExt;
    let s = Service::start().await;
    s.image("a", 4).await;
    let path = s.images.join("a.img");
    let ino = std::fs::metadata(&path).unwrap().ino();
    // Another file renamed over the image frees its inode number.
    let other = s.images.join("other.img");
    std::fs::write(&other, vec![0u8; 1 << 20]).unwrap();
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::rename(&other, &path).unwrap();
    let fresh = s.images.join("fresh.img");
    new_file_on_inode(&s.images, ino, &fresh, 1 << 20);
    let a = s
        .post("/v1/images", json!({"name": "fresh", "path": fresh}))
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
}

/// A 0600 file of `mib` MiB under the root, all of it written with data.
fn written_file(path: &std::path::Path, mib: usize) {
    std::fs::write(path, vec![0x5a; mib << 20]).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A 0600 file of `mib` MiB under the root, allocated by `fallocate` and
/// never written: every extent UNWRITTEN.
fn fallocated_file(path: &std::path::Path, mib: usize) {
    make_file(path, 0);
    let falloc = std::process::Command::new("fallocate")
        .args(["--length", &format!("{mib}MiB")])
        .arg(path)
        .status()
        .unwrap();
    assert!(falloc.success());
}

/// The message of the last `image_registered` event.
async fn registered_event(s: &Service) -> String {
    let ev = s.get("/v1/events?limit=1000").await.body;
    ev.as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["kind"] == "image_registered")
        .map(|e| e["message"].as_str().unwrap().to_string())
        .unwrap_or_default()
}

/// Registers the file at `path` as `name`, declaring `allocation` if
/// given; asserts the 201 and answers the recorded allocation and why.
async fn register(
    s: &Service,
    name: &str,
    path: &std::path::Path,
    allocation: Option<&str>,
) -> (Value, String) {
    let mut body = json!({"name": name, "path": path});
    if let Some(a) = allocation {
        body["allocation"] = json!(a);
    }
    let a = s.post("/v1/images", body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let why = a.body["allocation_reason"].as_str().unwrap_or_default();
    (a.body["allocation"].clone(), why.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registered_file_is_full_only_when_fiemap_shows_every_byte_written() {
    use std::os::unix::fs::FileExt;
    let s = Service::start().await;
    let written = s.images.join("written.img");
    written_file(&written, 4);
    let holey = s.images.join("holey.img");
    make_file(&holey, 4 << 20);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&holey)
        .unwrap();
    f.write_all_at(&[0xa5; 1 << 20], 0).unwrap();
    let prealloc = s.images.join("prealloc.img");
    fallocated_file(&prealloc, 4);

    // Written (not yet synced: FIEMAP syncs first), so kept allocated.
    let (allocation, why) = register(&s, "written", &written, None).await;
    assert_eq!(allocation, "full", "{why}");
    assert!(
        why.contains("every byte") && why.contains("recorded full"),
        "{why}"
    );
    assert!(rule_two(&written).is_ok());
    let g = s.get("/v1/images/written").await;
    assert_eq!(g.body["allocation"], "full", "{}", g.body);
    assert_eq!(g.body["allocation_reason"], Value::Null, "{}", g.body);
    let ev = registered_event(&s).await;
    assert!(ev.contains("allocation full: FIEMAP shows"), "{ev}");

    // A hole after the first MiB.
    let (allocation, why) = register(&s, "holey", &holey, None).await;
    assert_eq!(allocation, "sparse", "{why}");
    assert!(
        why.contains("a hole at bytes 1048576..4194304")
            && why.contains("/v1/images/holey/allocate"),
        "{why}"
    );

    // Allocated, never written: rule 2 refuses it, so it is no more `full`
    // than a hole is.
    let (allocation, why) = register(&s, "prealloc", &prealloc, None).await;
    assert_eq!(allocation, "sparse", "{why}");
    assert!(
        why.contains("unwritten extents (allocated, never written) at bytes 0..4194304"),
        "{why}"
    );
    assert!(rule_two(&prealloc).unwrap_err().contains("UNWRITTEN"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declared_allocation_is_recorded_and_full_is_checked_first() {
    let s = Service::start().await;
    let holey = s.images.join("holey.img");
    make_file(&holey, 4 << 20);
    let prealloc = s.images.join("prealloc.img");
    fallocated_file(&prealloc, 4);
    let written = s.images.join("written.img");
    written_file(&written, 4);
    let other = s.images.join("other.img");
    written_file(&other, 4);

    // `full` on a file with a hole or unwritten extents: refused, naming the
    // image, the file, the first such range and the remedies.
    let before = s.snapshot().await;
    for (name, path, what) in [
        ("holey", &holey, "a hole at bytes 0..4194304"),
        (
            "prealloc",
            &prealloc,
            "unwritten extents (allocated, never written) at bytes 0..4194304",
        ),
    ] {
        let a = s
            .post(
                "/v1/images",
                json!({"name": name, "path": path, "allocation": "full"}),
            )
            .await;
        assert_error(&a, 422, "allocation_mismatch");
        crate::harness::check_against_openapi(&Method::POST, "/v1/images", &a);
        let m = a.body["error"]["message"].as_str().unwrap();
        for part in [
            &format!("image '{name}' ({})", path.display()),
            what,
            &format!("POST /v1/images/{name}/allocate"),
            "nothing was recorded",
        ] {
            assert!(m.contains(part), "{part:?} not in {m}");
        }
        assert_eq!(
            s.snapshot().await,
            before,
            "refusal of {name} changed something"
        );
    }

    // `sparse` on a fully written file: recorded as asked.
    let (allocation, why) = register(&s, "written", &written, Some("sparse")).await;
    assert_eq!(allocation, "sparse", "{why}");
    assert!(why.starts_with("declared sparse"), "{why}");
    // `full` on a fully written file: checked, recorded.
    let (allocation, why) = register(&s, "other", &other, Some("full")).await;
    assert_eq!(allocation, "full", "{why}");
    assert!(
        why.starts_with("declared full, and FIEMAP shows every byte"),
        "{why}"
    );
    let l = s.get("/v1/images").await.body;
    let recorded: Vec<_> = l
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap(),
                i["allocation"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(recorded.len(), 2, "{l}");
    assert!(recorded.contains(&("written", "sparse")), "{l}");
    assert!(recorded.contains(&("other", "full")), "{l}");
}

/// Rule 2 as the direct path checks it, on the file at `path`.
fn rule_two(path: &std::path::Path) -> Result<(), String> {
    use std::os::fd::AsFd;
    let f = std::fs::File::open(path).unwrap();
    let size = f.metadata().unwrap().len();
    let extents = blockplane_system::extent::fiemap(f.as_fd(), true).unwrap();
    blockplane_system::extent::check_extents(&extents, size).map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn allocate_fills_holes_and_unwritten_extents_and_keeps_the_data() {
    use std::os::unix::fs::FileExt;
    let s = Service::start().await;
    let path = s.images.join("punched.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "punched", "path": path, "create": {"size_bytes": 32 << 20}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let id = a.body["id"].as_str().unwrap().to_string();
    // Data at 4 MiB, an unwritten (fallocated) stretch at 16 MiB, holes elsewhere.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xa5; 1 << 20], 4 << 20).unwrap();
    f.sync_all().unwrap();
    let falloc = std::process::Command::new("fallocate")
        .args(["--keep-size", "--offset", "16MiB", "--length", "4MiB"])
        .arg(&path)
        .status()
        .unwrap();
    assert!(falloc.success());
    let before = rule_two(&path).unwrap_err();
    assert!(before.contains("hole"), "{before}");

    let a = s
        .post(&format!("/v1/images/{id}/allocate"), json!(null))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    let a = wait_allocate(&s, "punched").await;
    assert_eq!(a["allocate"]["state"], "done", "{a}");
    assert_eq!(a["allocation"], "full", "{a}");
    assert!(a["allocated_bytes"].as_u64().unwrap() >= 32 << 20, "{a}");
    rule_two(&path).unwrap();
    let out = std::process::Command::new("filefrag")
        .arg("-v")
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("unwritten"),
        "{text}"
    );
    // The data stays; everything else reads as zeros.
    let all = std::fs::read(&path).unwrap();
    assert_eq!(all.len(), 32 << 20);
    let data = (4 << 20)..(5 << 20);
    assert!(all[data.clone()].iter().all(|&b| b == 0xa5));
    assert!(
        all.iter()
            .enumerate()
            .all(|(i, &b)| data.contains(&i) || b == 0)
    );
    let g = s.get("/v1/images/punched").await;
    assert_eq!(g.body["allocation"], "full", "{}", g.body);
    // Again: nothing left to do, same end.
    let a = s.post("/v1/images/punched/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    let a = wait_allocate(&s, "punched").await;
    assert_eq!(a["allocate"]["state"], "done", "{a}");
    assert_eq!(a["allocate"]["total_bytes"], 0, "{a}");
    let ev = s.get("/v1/events?limit=50").await;
    assert!(
        ev.body.to_string().contains("image_allocated"),
        "{}",
        ev.body
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn allocate_refusals_are_precise_and_change_nothing() {
    // A 16 MiB ext4 filesystem as a second image root: too small for a
    // 64 MiB sparse image's holes.
    let fs = crate::harness::LoopFs::new(&["mkfs.ext4", "-q", "-F"], 16 << 20);
    let small = fs.mnt.clone();
    let s = Service::start_with(crate::harness::Opts {
        extra_roots: vec![small.clone()],
        ..Default::default()
    })
    .await;

    let a = s.post("/v1/images/nosuch/allocate", json!(null)).await;
    assert_error(&a, 404, "image_not_found");
    assert!(a.body.to_string().contains("nosuch"), "{}", a.body);

    let big = small.join("big.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "big", "path": big, "create": {"size_bytes": 64 << 20}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let allocated = std::fs::metadata(&big).unwrap().blocks();
    let a = s.post("/v1/images/big/allocate", json!(null)).await;
    assert_error(&a, 507, "no_space");
    let m = a.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("'big'") && m.contains("67108864"), "{m}");
    // Nothing was written or started, and the image is still sparse.
    assert_eq!(std::fs::metadata(&big).unwrap().blocks(), allocated);
    let g = s.get("/v1/images/big").await;
    assert_eq!(g.body["allocation"], "sparse", "{}", g.body);
    assert_eq!(g.body["allocate"], serde_json::Value::Null, "{}", g.body);
    let ev = s.get("/v1/events?limit=100").await;
    assert!(
        !ev.body.to_string().contains("image_allocate_started"),
        "{}",
        ev.body
    );
    let a = s.delete("/v1/images/big/allocate").await;
    assert_error(&a, 409, "allocate_conflict");
}

/// Polls an image until its allocate is no longer running; its last view.
async fn wait_allocate(s: &Service, image: &str) -> serde_json::Value {
    for _ in 0..600 {
        let g = s.get(&format!("/v1/images/{image}")).await;
        assert_eq!(g.status, StatusCode::OK, "{}", g.body);
        if g.body["allocate"]["state"] != "running" {
            return g.body;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the allocate of image '{image}' still runs after 60 s");
}

/// Waits until an image's running allocate wrote something (its first
/// stretch: the rest takes at least 100 ms a stretch more).
async fn wait_progress(s: &Service, image: &str) {
    for _ in 0..500 {
        let g = s.get(&format!("/v1/images/{image}")).await;
        if g.body["allocate"]["done_bytes"].as_u64().unwrap() > 0 {
            assert_eq!(g.body["allocate"]["state"], "running", "{}", g.body);
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the allocate of image '{image}' wrote nothing in 5 s");
}

/// A service whose allocates pause 100 ms per 16 MiB stretch, with a sparse
/// 256 MiB image `slow` that has 1 MiB of data at 100 MiB.
async fn slow_allocate_service() -> (Service, std::path::PathBuf) {
    use std::os::unix::fs::FileExt;
    let s = Service::start_with(crate::harness::Opts {
        env: vec![("BLOCKPLANE_TEST_FAULT".into(), "slow_allocate".into())],
        ..Default::default()
    })
    .await;
    let path = s.images.join("slow.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "slow", "path": path, "create": {"size_bytes": 256 << 20}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0x5a; 1 << 20], 100 << 20).unwrap();
    f.sync_all().unwrap();
    (s, path)
}

/// `slow`'s data is there and every other byte reads as zero (slices
/// compared whole: a byte loop takes seconds in a debug build).
fn data_kept(path: &std::path::Path) {
    let all = std::fs::read(path).unwrap();
    let mut want = vec![0u8; all.len()];
    want[(100 << 20)..(101 << 20)].fill(0x5a);
    assert!(all == want, "the image's bytes changed");
}

#[tokio::test(flavor = "multi_thread")]
async fn allocate_runs_in_the_background_with_progress_and_one_at_a_time() {
    let (s, path) = slow_allocate_service().await;
    let a = s.post("/v1/images/slow/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(a.body["allocate"]["state"], "running", "{}", a.body);
    assert_eq!(a.body["allocation"], "sparse", "{}", a.body);
    // While it runs: a second allocate, a resize, a forget and a volume are
    // refused, naming the image and the way out.
    let again = s.post("/v1/images/slow/allocate", json!(null)).await;
    assert_error(&again, 409, "allocate_conflict");
    let m = again.body["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("'slow'") && m.contains("DELETE /v1/images/slow/allocate"),
        "{m}"
    );
    let r = s
        .post("/v1/images/slow/resize", json!({"size_bytes": 512 << 20}))
        .await;
    assert_error(&r, 409, "allocate_conflict");
    let d = s.delete("/v1/images/slow").await;
    assert_error(&d, 409, "allocate_conflict");
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "v", "image": "slow", "backend": "loop"}),
        )
        .await;
    assert_error(&v, 409, "allocate_conflict");
    // Progress shows, growing, short of the total.
    let total = (256 - 1) << 20;
    let mut seen = Vec::new();
    for _ in 0..100 {
        let g = s.get("/v1/images/slow").await;
        let done = g.body["allocate"]["done_bytes"].as_u64().unwrap();
        assert_eq!(g.body["allocate"]["total_bytes"], total, "{}", g.body);
        if g.body["allocate"]["state"] != "running" {
            break;
        }
        seen.push(done);
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }
    assert!(
        seen.iter().any(|&d| d > 0 && d < total) && seen.windows(2).all(|w| w[0] <= w[1]),
        "progress {seen:?}"
    );
    let end = wait_allocate(&s, "slow").await;
    assert_eq!(end["allocate"]["state"], "done", "{end}");
    assert_eq!(end["allocate"]["done_bytes"], total, "{end}");
    assert_eq!(end["allocation"], "full", "{end}");
    rule_two(&path).unwrap();
    data_kept(&path);
    let ev = s.get("/v1/events?limit=100").await.body.to_string();
    let started = ev.find("image_allocate_started").expect(&ev);
    let ended = ev.find("\"image_allocated\"").expect(&ev);
    assert!(started < ended, "{ev}");
}

#[tokio::test(flavor = "multi_thread")]
async fn allocate_cancel_or_a_crash_leaves_the_image_as_declared() {
    let (mut s, path) = slow_allocate_service().await;
    let a = s.post("/v1/images/slow/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    wait_progress(&s, "slow").await;
    let c = s.delete("/v1/images/slow/allocate").await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);
    assert_eq!(c.body["allocate"]["state"], "cancelled", "{}", c.body);
    assert_eq!(c.body["allocation"], "sparse", "{}", c.body);
    let done = c.body["allocate"]["done_bytes"].as_u64().unwrap();
    assert!(done > 0 && done < (255 << 20), "{}", c.body);
    // Stopped: nothing more is written, holes remain, the data stays.
    let blocks = std::fs::metadata(&path).unwrap().blocks();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(std::fs::metadata(&path).unwrap().blocks(), blocks);
    assert!(rule_two(&path).unwrap_err().contains("hole"));
    data_kept(&path);
    let ev = s.get("/v1/events?limit=100").await.body.to_string();
    assert!(ev.contains("image_allocate_cancelled"), "{ev}");
    let again = s.delete("/v1/images/slow/allocate").await;
    assert_error(&again, 409, "allocate_conflict");
    // A stop (SIGTERM) mid-way cancels it: the service exits without
    // finishing the fill, holes remain.
    let a = s.post("/v1/images/slow/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    wait_progress(&s, "slow").await;
    let st = s.signal(rustix::process::Signal::TERM);
    assert!(st.success(), "{st}");
    assert!(rule_two(&path).unwrap_err().contains("hole"));
    data_kept(&path);
    s.restart().await;
    // Again, and the service is killed mid-way: the image is as declared,
    // and allocating once more finishes the job.
    let a = s.post("/v1/images/slow/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    wait_progress(&s, "slow").await;
    s.kill();
    s.restart().await;
    let g = s.get("/v1/images/slow").await;
    assert_eq!(g.body["allocation"], "sparse", "{}", g.body);
    assert_eq!(g.body["allocate"], serde_json::Value::Null, "{}", g.body);
    assert!(rule_two(&path).unwrap_err().contains("hole"));
    let a = s.post("/v1/images/slow/allocate", json!(null)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    let end = wait_allocate(&s, "slow").await;
    assert_eq!(end["allocate"]["state"], "done", "{end}");
    assert_eq!(end["allocation"], "full", "{end}");
    rule_two(&path).unwrap();
    data_kept(&path);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sparse_image_beyond_the_free_space_is_reported_and_overcommit_is_refused_past_its_ratio()
{
    let s = Service::start_with(Opts {
        extra_args: vec!["--max-overcommit".into(), "1.0".into()],
        ..Default::default()
    })
    .await;
    let root = |h: &Value| h["image_root_capacity"][0].clone();
    let r0 = root(&s.get("/v1/host").await.body);
    assert_eq!(r0["max_overcommit"], 1.0, "{r0}");
    let (fs_size, free) = (
        r0["size_bytes"].as_u64().unwrap(),
        r0["free_bytes"].as_u64().unwrap(),
    );
    assert!(fs_size > 0 && free > 0 && free <= fs_size, "{r0}");

    // Larger than the free space, within the ratio: made, and said.
    let big = (free + (1 << 30)) / 512 * 512;
    let a = s
        .post(
            "/v1/images",
            json!({"name": "big", "path": s.images.join("big.img"),
                   "create": {"size_bytes": big, "allocation": "sparse"}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let w = a.body["warnings"][0].as_str().unwrap_or_default();
    assert!(w.contains("'big'") && w.contains("ENOSPC"), "{}", a.body);
    let ev = s.get("/v1/events?limit=1000").await.body;
    assert!(
        ev.as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "image_overcommitted"),
        "an event says it too"
    );
    let r1 = root(&s.get("/v1/host").await.body);
    assert_eq!(r1["images"], 1);
    assert_eq!(r1["provisioned_bytes"], big);

    // Past the ratio: refused before any file is made, and a grow too.
    let before = s.snapshot().await;
    let over = (fs_size - big + (1 << 30)) / 512 * 512;
    let a = s
        .post(
            "/v1/images",
            json!({"name": "over", "path": s.images.join("over.img"),
                   "create": {"size_bytes": over}}),
        )
        .await;
    assert_error(&a, 507, "overcommit_refused");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("'over'") && msg.contains("--max-overcommit"),
        "{msg}"
    );
    assert!(!s.images.join("over.img").exists(), "nothing was made");
    let g = s
        .post("/v1/images/big/resize", json!({"size_bytes": big + over}))
        .await;
    assert_error(&g, 507, "overcommit_refused");
    assert_eq!(s.snapshot().await, before, "the refusals changed nothing");
    let text = s.get_text("/metrics").await;
    assert!(
        text.contains(&format!(
            "blockplane_image_root_provisioned_bytes{{root=\"{}\"}} {big}",
            r1["path"].as_str().unwrap()
        )),
        "{text}"
    );
}

/// A full grow that runs out of space part-way (ext4's fallocate may leave
/// the file longer, with blocks allocated) is 507 `no_space` and leaves the
/// file as it was (its size and data blocks) and the rest unchanged.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_grow_that_runs_out_of_space_changes_nothing() {
    use std::os::unix::fs::MetadataExt;
    let fs = crate::harness::LoopFs::new(&["mkfs.ext4", "-q", "-F"], 16 << 20);
    let s = Service::start_with(crate::harness::Opts {
        extra_roots: vec![fs.mnt.clone()],
        ..Default::default()
    })
    .await;
    let path = fs.mnt.join("full.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "full", "path": path, "create": {"size_bytes": 4 << 20, "allocation": "full"}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let file = |p: &std::path::Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.len(), m.blocks())
    };
    let (before, on_disk) = (s.snapshot().await, file(&path));
    let a = s
        .post("/v1/images/full/resize", json!({"size_bytes": 64 << 20}))
        .await;
    assert_error(&a, 507, "no_space");
    let after = file(&path);
    // Its size, and its blocks but for one of ext4's extent tree (4 KiB,
    // metadata that truncating keeps).
    assert!(
        after.0 == on_disk.0 && after.1 <= on_disk.1 + 8,
        "the refused grow changed the file: (size, 512-byte blocks) {after:?}, was {on_disk:?}"
    );
    assert_eq!(s.snapshot().await, before);
}
