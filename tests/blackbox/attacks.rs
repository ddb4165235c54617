//! Attacks on image registration: every way to make the service open a file
//! outside its image roots, or something that is not a plain image. Each is
//! refused (403/422), changes nothing, and opens nothing for writing.

use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::json;

use crate::harness::{Service, assert_error};

fn plain(path: &std::path::Path, size: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn mknod(path: &std::path::Path, kind: rustix::fs::FileType, dev: u64) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        kind,
        rustix::fs::Mode::from_raw_mode(0o600),
        dev,
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_attack_table() {
    let s = Service::start().await;
    let root = s.images.clone();
    let outside = s.dir.path().join("secret.img");
    plain(&outside, 1 << 20);
    let secret_mtime = std::fs::metadata(&outside).unwrap().mtime_nsec();

    // Fixtures.
    std::fs::create_dir(root.join("sub")).unwrap();
    symlink(&outside, root.join("final-link.img")).unwrap();
    symlink(s.dir.path(), root.join("dir-link")).unwrap();
    std::fs::hard_link(&outside, root.join("hardlink.img")).unwrap();
    mknod(
        &root.join("chardev"),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::makedev(1, 3),
    );
    mknod(
        &root.join("blockdev"),
        rustix::fs::FileType::BlockDevice,
        rustix::fs::makedev(7, 0),
    );
    mknod(&root.join("fifo"), rustix::fs::FileType::Fifo, 0);
    let _sock = std::os::unix::net::UnixListener::bind(root.join("socket")).unwrap();
    plain(&root.join("foreign.img"), 1 << 20);
    std::os::unix::fs::chown(root.join("foreign.img"), Some(65534), Some(65534)).unwrap();
    plain(&root.join("group-writable.img"), 1 << 20);
    std::fs::set_permissions(
        root.join("group-writable.img"),
        std::fs::Permissions::from_mode(0o620),
    )
    .unwrap();
    // A filesystem mounted below the root after the service started.
    let mnt = root.join("mounted");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap()
        .success();
    assert!(mounted);
    plain(&mnt.join("on-tmpfs.img"), 1 << 20);

    let r = |rel: &str| root.join(rel).display().to_string();
    let cases: Vec<(String, u16, &str)> = vec![
        (
            format!("{}/../secret.img", root.display()),
            403,
            "path_parent_reference",
        ),
        (
            format!("{}/sub/../../secret.img", root.display()),
            403,
            "path_parent_reference",
        ),
        (outside.display().to_string(), 403, "path_outside_roots"),
        ("/proc/self/environ".into(), 403, "path_outside_roots"),
        ("/proc/1/root/etc/passwd".into(), 403, "path_outside_roots"),
        ("/dev/sda".into(), 403, "path_outside_roots"),
        ("relative.img".into(), 403, "path_outside_roots"),
        (r("final-link.img"), 403, "path_symlink"),
        (
            format!("{}/dir-link/secret.img", root.display()),
            403,
            "path_symlink",
        ),
        (r("mounted/on-tmpfs.img"), 403, "path_crosses_mount"),
        (r("foreign.img"), 403, "foreign_owner"),
        (r("hardlink.img"), 422, "hard_links"),
        (r("chardev"), 422, "not_regular_file"),
        (r("blockdev"), 422, "not_regular_file"),
        (r("fifo"), 422, "not_regular_file"),
        (r("socket"), 422, "not_regular_file"),
        (r("sub"), 422, "not_regular_file"),
        (r("group-writable.img"), 422, "loose_permissions"),
    ];
    let before = s.snapshot().await;
    for (path, status, code) in &cases {
        let a = s
            .post("/v1/images", json!({"name": "attack", "path": path}))
            .await;
        assert_error(&a, *status, code);
        // Creating through the same path is refused the same way (or as an
        // existing file); nothing is created or truncated.
        let c = s
            .post(
                "/v1/images",
                json!({"name": "attack", "path": path, "create": {"size_bytes": 4096}}),
            )
            .await;
        assert!(
            c.status.is_client_error(),
            "create at {path}: {} {}",
            c.status,
            c.body
        );
        assert_eq!(s.snapshot().await, before, "{path} changed something");
    }
    // The file outside was never written.
    let meta = std::fs::metadata(&outside).unwrap();
    assert_eq!((meta.len(), meta.mtime_nsec()), (1 << 20, secret_mtime));
    let _ = std::process::Command::new("umount").arg(&mnt).status();
}

/// A symlink swapped in and out while the service opens the path: the
/// service must never register (or open) what the symlink points at.
#[tokio::test(flavor = "multi_thread")]
async fn a_symlink_swapped_in_during_registration_never_wins() {
    let s = Service::start().await;
    let root = s.images.clone();
    let outside = s.dir.path().join("target.img");
    plain(&outside, 1 << 20);
    let real = root.join("real.img");
    let path = root.join("racy.img");
    let stop = Arc::new(AtomicBool::new(false));
    let (p, o, r, st) = (path.clone(), outside.clone(), real.clone(), stop.clone());
    let swapper = std::thread::spawn(move || {
        let mut i = 0u64;
        while !st.load(Ordering::Relaxed) {
            let _ = std::fs::remove_file(&p);
            if i.is_multiple_of(2) {
                let _ = symlink(&o, &p);
            } else {
                plain(&r, 1 << 20);
                let _ = std::fs::rename(&r, &p);
            }
            i += 1;
        }
    });
    let target_ino = std::fs::metadata(&outside).unwrap().ino();
    let mut registered = 0;
    for n in 0..200 {
        let a = s
            .post("/v1/images", json!({"name": format!("r{n}"), "path": path}))
            .await;
        match a.status.as_u16() {
            201 => {
                registered += 1;
                let id = a.body["id"].as_str().unwrap().to_string();
                // Whatever was registered is a plain file under the root, not the target.
                assert_eq!(a.body["path"], path.display().to_string());
                let d = s.delete(&format!("/v1/images/{id}")).await;
                assert_eq!(d.status.as_u16(), 204);
            }
            403 | 404 | 422 => {}
            other => panic!("unexpected {other}: {}", a.body),
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(std::fs::metadata(&outside).unwrap().ino(), target_ino);
    // No image ever had the target's identity.
    let ev = s.get("/v1/events?limit=1000").await.body;
    assert!(
        !ev.to_string().contains(&outside.display().to_string()),
        "the target was registered: {ev}"
    );
    eprintln!("racy registrations that succeeded (all on plain files): {registered}");
}
