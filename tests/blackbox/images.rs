//! `/v1/images`: registration, creation, growth, removal, and every refusal.

use std::os::unix::fs::{PermissionsExt, symlink};

use hyper::{Method, StatusCode};
use serde_json::json;

use crate::harness::{Service, assert_error, device_size};

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
    assert_eq!(a.body["allocation"], serde_json::Value::Null);
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
            blockplane::client::Answer {
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
    assert_error(&s.delete("/v1/images/g-img").await, 409, "image_in_use");
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
