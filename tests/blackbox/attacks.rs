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

/// Size and fill byte of the file a symlink swapped in points at, and of the
/// plain files swapped with it: different, so whatever the service opened can
/// be told apart by the size it reports and by the data a volume reads.
const TARGET: (u64, u8) = (2 << 20, b'T');
const REAL: (u64, u8) = (1 << 20, b'R');

fn filled(path: &std::path::Path, (size, byte): (u64, u8)) {
    std::fs::write(path, vec![byte; size as usize]).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A symlink swapped in and out while the service opens the path: the
/// service must never register (or open) what the symlink points at. The
/// target sits under the root (a relative link), so only the refusal of
/// symlinks stops it: `RESOLVE_BENEATH` alone would follow it. The test runs
/// until the race was hit (the service met the symlink) often enough, and
/// checks each registered image's size and, through a loop volume, its data.
#[tokio::test(flavor = "multi_thread")]
async fn a_symlink_swapped_in_during_registration_never_wins() {
    let s = Service::start().await;
    let root = s.images.clone();
    let target = root.join("target.img");
    filled(&target, TARGET);
    let target_ino = std::fs::metadata(&target).unwrap().ino();
    let path = root.join("racy.img");
    // One plain file (one inode, one content) and a symlink take turns at the
    // path, each made aside and renamed over it, each staying for a moment.
    // `hold` parks the plain file at the path (and `parked` says it is there)
    // while a registered file's data is read back through the path.
    let stop = Arc::new(AtomicBool::new(false));
    let hold = Arc::new(AtomicBool::new(false));
    let parked = Arc::new(AtomicBool::new(false));
    let (p, st, h, pk) = (path.clone(), stop.clone(), hold.clone(), parked.clone());
    let (real, link) = (root.join("real.tmp"), root.join("link.tmp"));
    filled(&real, REAL);
    let swapper = std::thread::spawn(move || {
        while !st.load(Ordering::Relaxed) {
            std::fs::rename(&real, &p).unwrap();
            std::thread::sleep(Duration::from_micros(300));
            while h.load(Ordering::Relaxed) {
                pk.store(true, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
            pk.store(false, Ordering::Relaxed);
            std::fs::rename(&p, &real).unwrap();
            symlink("target.img", &link).unwrap();
            std::fs::rename(&link, &p).unwrap();
            std::thread::sleep(Duration::from_micros(300));
        }
    });
    // Answers given while the path was a symlink (the race hit), plain files
    // registered, and registered files whose data a volume read back.
    let (mut symlink_hits, mut registered, mut data_checked) = (0, 0, 0);
    let mut n = 0;
    while (symlink_hits < 20 || registered < 20 || data_checked < 3) && n < 3000 {
        n += 1;
        let a = s
            .post("/v1/images", json!({"name": format!("r{n}"), "path": path}))
            .await;
        match (a.status.as_u16(), a.body["error"]["code"].as_str()) {
            (201, _) => {
                registered += 1;
                assert_eq!(
                    a.body["size_bytes"], REAL.0,
                    "registration {n} opened the symlink's target: {}",
                    a.body
                );
                hold.store(true, Ordering::Relaxed);
                while !parked.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                data_checked += check_data(&s, &format!("r{n}"), target_ino).await;
                hold.store(false, Ordering::Relaxed);
                while parked.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let d = s.delete(&format!("/v1/images/r{n}")).await;
                assert_eq!(d.status.as_u16(), 204, "{}", d.body);
            }
            (403, Some("path_symlink")) => symlink_hits += 1,
            // The plain file was replaced (unlinked) while being opened and
            // checked: refused as gone or as not singly linked.
            (404, Some("file_not_found")) | (422, Some("hard_links")) => {}
            (other, _) => panic!("unexpected {other}: {}", a.body),
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    eprintln!(
        "{n} registrations: {symlink_hits} met the symlink and were refused, \
         {registered} registered a plain file, {data_checked} of those read back through a volume"
    );
    assert!(
        symlink_hits >= 20 && registered >= 20 && data_checked >= 3,
        "the race was not exercised enough in {n} tries"
    );
    assert_eq!(std::fs::metadata(&target).unwrap().ino(), target_ino);
    let left = s.get("/v1/images").await.body;
    assert_eq!(left, json!([]), "images left");
}

/// Attaches a loop volume to image `name` and checks that the device reads
/// the plain file's bytes and is not backed by the target's inode. Returns 1
/// if checked, 0 if the path had been swapped again before the attach (the
/// service then refuses: the file is no longer the registered one).
async fn check_data(s: &Service, name: &str, target_ino: u64) -> usize {
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": name, "image": name, "backend": "loop"}),
        )
        .await;
    if v.status.as_u16() != 201 {
        assert!(v.status.is_client_error(), "{}", v.body);
        return 0;
    }
    let dev = v.body["device"].as_str().unwrap().to_string();
    let data = std::fs::read(&dev).unwrap();
    let inode = std::process::Command::new("losetup")
        .args(["--noheadings", "--output", "BACK-INO"])
        .arg(&dev)
        .output()
        .unwrap();
    let inode: u64 = String::from_utf8_lossy(&inode.stdout)
        .trim()
        .parse()
        .unwrap();
    let d = s.delete(&format!("/v1/volumes/{name}")).await;
    assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    assert_ne!(inode, target_ino, "{name}: the volume reads the target");
    assert!(
        data.len() as u64 == REAL.0 && data.iter().all(|b| *b == REAL.1),
        "{name}: the volume reads {} bytes starting {:?}, not the plain file",
        data.len(),
        &data[..16.min(data.len())]
    );
    1
}
