//! The registry under hostile conditions: a full disk, backups and clean
//! shutdown, concurrency against limits and deletes, impossible paths, log
//! injection, HTTP-layer errors, and the loop devices volumes leave behind.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{Opts, Service, assert_error, bin};

/// Unmounts a filesystem the test mounted (lazily: a killed service may hold it).
struct Unmount(Mutex<Option<PathBuf>>);

impl Drop for Unmount {
    fn drop(&mut self) {
        if let Some(p) = self.0.lock().unwrap().take() {
            let _ = Command::new("umount").arg("-l").arg(&p).status();
        }
    }
}

/// Makes a file of `mib` MiB under the service's image root, mode 0600.
fn image_file(s: &Service, name: &str, mib: u64) -> PathBuf {
    let path = s.images.join(name);
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(mib << 20).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// A service started with `opts` whose data dir is a 4 MiB tmpfs, which
/// `mounted` unmounts when dropped.
async fn on_a_small_tmpfs(opts: Opts, mounted: &Unmount) -> Service {
    Service::start_prepared(opts, |data| {
        std::fs::create_dir_all(data).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs"])
            .arg(data)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount a tmpfs on {}", data.display());
        *mounted.0.lock().unwrap() = Some(data.to_path_buf());
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_is_507_and_unhealthy_and_writes_resume_when_space_returns() {
    // Declared first so it is dropped last, after the service.
    let mounted = Unmount(Mutex::new(None));
    let s = on_a_small_tmpfs(Opts::default(), &mounted).await;
    let first = image_file(&s, "first.img", 1);
    let a = s
        .post("/v1/images", json!({"name": "first", "path": first}))
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);

    // Fill the data dir's filesystem.
    let filler = s.data.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![0x5a; 64 << 10];
        loop {
            if let Err(e) = f.write_all(&chunk) {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                break;
            }
        }
        let _ = f.write_all(&[0; 1]);
    }
    let second = image_file(&s, "second.img", 1);
    let a = s
        .post("/v1/images", json!({"name": "second", "path": second}))
        .await;
    assert_error(&a, 507, "storage_full");
    let h = s.get("/healthz").await;
    assert_error(&h, 503, "store_unwritable");
    // Reads still work, and the refused write left nothing.
    let list = s.get("/v1/images").await;
    assert_eq!(list.body.as_array().unwrap().len(), 1, "{}", list.body);

    // Space returns: writes work again without a restart.
    std::fs::remove_file(&filler).unwrap();
    let h = s.get("/healthz").await;
    assert_eq!(h.status.as_u16(), 200, "{}", h.body);
    let a = s
        .post("/v1/images", json!({"name": "second", "path": second}))
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    let v = s
        .post(
            "/v1/volumes",
            json!({"name": "after-full", "image": "second", "backend": "loop"}),
        )
        .await;
    assert_eq!(v.status.as_u16(), 201, "{}", v.body);
    let d = s.delete("/v1/volumes/after-full").await;
    assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    drop(s);
}

/// Fills the filesystem of `dir` with a file of its own; returns its path.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let filler = dir.join("filler");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&filler)
        .unwrap();
    let chunk = vec![0x5a; 64 << 10];
    while let Ok(()) = f.write_all(&chunk) {}
    while let Ok(()) = f.write_all(&[0; 1]) {}
    filler
}

/// Waits until volume `name` is listed in state `state`.
async fn until_listed(s: &Service, name: &str, state: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let vols = s.get("/v1/volumes").await.body;
        if vols
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == name && v["state"] == state)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "volume {name} never listed {state}: {vols}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The service's volume rows and its loop devices agree: each row is
/// attached on a device bound to its image, and each device of the service
/// is a row's. Returns the names of the volumes.
async fn rows_and_devices_agree(s: &Service, when: &str) -> Vec<String> {
    let vols = s.get("/v1/volumes").await;
    assert_eq!(vols.status.as_u16(), 200, "{when}: {}", vols.body);
    let mut named = Vec::new();
    let mut names = Vec::new();
    for v in vols.body.as_array().unwrap() {
        assert_eq!(
            v["state"], "attached",
            "{when}: a row without its device: {v}"
        );
        let dev = v["device"].as_str().unwrap().to_string();
        assert!(
            crate::harness::serves_from(&dev, &s.images),
            "{when}: {dev} of {} serves no image of this service",
            v["name"]
        );
        named.push(dev);
        names.push(v["name"].as_str().unwrap().to_string());
    }
    let mut held = s.my_loop_devices();
    held.sort();
    named.sort();
    assert_eq!(
        held, named,
        "{when}: devices (left) not named by a row (right)"
    );
    names.sort();
    names
}

/// Issue 26 item 6: a volume create and delete on a data dir that fills up
/// (a 4 MiB tmpfs, filled by the test). A create or delete the full disk
/// refuses at its first record (507 `storage_full`) changes nothing; one
/// whose disk fills after that first record (while it waits, test fault
/// `slow_volume_change`) still records its device change (the room kept
/// beside the registry for it), so no device is left without its row nor a
/// row without its device. Reads work throughout, and writes resume when
/// space returns, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_registry_disk_leaves_no_device_without_its_row_nor_a_row_without_its_device() {
    // Declared first so it is dropped last, after the service.
    let mounted = Unmount(Mutex::new(None));
    let opts = Opts {
        env: vec![("BLOCKPLANE_TEST_FAULT".into(), "slow_volume_change".into())],
        ..Default::default()
    };
    let s = on_a_small_tmpfs(opts, &mounted).await;
    for name in ["kept", "fresh", "late"] {
        s.image(name, 1).await;
    }
    let create = |name: &str| {
        s.post(
            "/v1/volumes",
            json!({"name": name, "image": name, "backend": "loop"}),
        )
    };
    let a = create("kept").await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);

    // The disk fills up between the create's row and its device.
    let (a, filler) = tokio::join!(create("fresh"), async {
        until_listed(&s, "fresh", "attaching").await;
        fill(&s.data)
    });
    assert_eq!(a.status.as_u16(), 201, "{}\n{}", a.body, s.log_text());
    assert_eq!(
        rows_and_devices_agree(&s, "a create whose disk filled up").await,
        ["fresh", "kept"]
    );

    // Full from the start (the room that create spent is taken too):
    // refused, nothing made or lost.
    fill(&s.data);
    assert_error(&create("late").await, 507, "storage_full");
    assert_error(&s.delete("/v1/volumes/kept").await, 507, "storage_full");
    assert_eq!(
        rows_and_devices_agree(&s, "a create and a delete on a full disk").await,
        ["fresh", "kept"]
    );
    assert_eq!(s.get("/v1/images").await.status.as_u16(), 200);
    assert_error(&s.get("/healthz").await, 503, "store_unwritable");

    // Space returns; the disk fills up again in the middle of a delete.
    std::fs::remove_file(&filler).unwrap();
    let h = s.get("/healthz").await;
    assert_eq!(h.status.as_u16(), 200, "{}", h.body);
    let (d, filler) = tokio::join!(s.delete("/v1/volumes/fresh"), async {
        until_listed(&s, "fresh", "detaching").await;
        fill(&s.data)
    });
    assert_eq!(d.status.as_u16(), 204, "{}\n{}", d.body, s.log_text());
    assert_eq!(
        rows_and_devices_agree(&s, "a delete whose disk filled up").await,
        ["kept"]
    );

    // Space returns: writes work again, no restart.
    std::fs::remove_file(&filler).unwrap();
    let a = create("late").await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    for name in ["late", "kept"] {
        let d = s.delete(&format!("/v1/volumes/{name}")).await;
        assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    }
    assert!(rows_and_devices_agree(&s, "all deleted").await.is_empty());
    drop(s);
}

/// Image names of a service.
async fn image_names(s: &Service) -> Vec<String> {
    let a = s.get("/v1/images").await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    a.body
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect()
}

/// Starts a service whose data dir holds `db` as its `blockplane.db`.
async fn service_on(db: &Path) -> Service {
    Service::start_prepared(Opts::default(), |data| {
        std::fs::create_dir_all(data).unwrap();
        std::fs::copy(db, data.join("blockplane.db")).unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_leaves_the_whole_registry_in_blockplane_db() {
    let mut s = Service::start().await;
    s.image("kept-one", 1).await;
    s.image("kept-two", 1).await;
    let st = s.signal(rustix::process::Signal::TERM);
    assert!(st.success(), "{st}\n{}", s.log_text());
    let wal = s.data.join("blockplane.db-wal");
    let wal_len = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    assert_eq!(
        wal_len, 0,
        "the WAL still holds {wal_len} bytes after SIGTERM"
    );
    // The .db file alone is the registry.
    let copy = s.dir.path().join("only-the-db");
    std::fs::copy(s.data.join("blockplane.db"), &copy).unwrap();
    let restored = service_on(&copy).await;
    assert_eq!(image_names(&restored).await, ["kept-one", "kept-two"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_online_backup_restores_into_a_fresh_data_dir() {
    let s = Service::start().await;
    s.image("backed-up", 1).await;
    s.loop_volume("bk-vol", 1).await;
    let backup = s.dir.path().join("backup.db");
    let run = |file: &Path| {
        Command::new(bin())
            .arg("backup")
            .arg("--data-dir")
            .arg(&s.data)
            .arg(file)
            .output()
            .unwrap()
    };
    // While the service runs and holds its lock.
    let out = run(&backup);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(mode(&backup), 0o600);
    // It never overwrites.
    let again = run(&backup);
    assert!(
        !again.status.success(),
        "a second backup overwrote the first"
    );
    // Writes after the backup are not in it.
    s.image("after-backup", 1).await;

    let d = s.delete("/v1/volumes/bk-vol").await;
    assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    let restored = service_on(&backup).await;
    assert_eq!(
        image_names(&restored).await,
        ["backed-up", "bk-vol-img"],
        "{}",
        restored.log_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn max_volumes_holds_under_twelve_parallel_creates() {
    let s = Arc::new(
        Service::start_with(Opts {
            extra_args: vec!["--max-volumes".into(), "3".into()],
            ..Default::default()
        })
        .await,
    );
    for i in 0..12 {
        s.image(&format!("cap-{i}"), 1).await;
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..12 {
        let s = s.clone();
        tasks.spawn(async move {
            s.post(
                "/v1/volumes",
                json!({"name": format!("capv-{i}"), "image": format!("cap-{i}"), "backend": "loop"}),
            )
            .await
        });
    }
    let (mut created, mut refused) = (0, 0);
    while let Some(a) = tasks.join_next().await {
        let a = a.unwrap();
        match a.status.as_u16() {
            201 => created += 1,
            _ => {
                assert_error(&a, 422, "volume_limit");
                refused += 1;
            }
        }
    }
    let listed = s.get("/v1/volumes").await.body.as_array().unwrap().len();
    assert_eq!(
        (created, refused, listed),
        (3, 9, 3),
        "12 parallel creates under --max-volumes 3"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_root_that_holds_the_data_dir_refuses_to_start() {
    let dir = tempfile::Builder::new()
        .prefix("bp")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("data");
    for root in [dir.path().to_path_buf(), data.clone()] {
        let mut child = Command::new(bin())
            .arg("serve")
            .arg("--data-dir")
            .arg(&data)
            .arg("--image-root")
            .arg(&root)
            .arg("--listen")
            .arg(format!("unix:{}", dir.path().join("s.sock").display()))
            .env_remove("BLOCKPLANE_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        let st = status.unwrap_or_else(|| {
            panic!(
                "started with image root {} holding its data dir {}",
                root.display(),
                data.display()
            )
        });
        assert!(!st.success());
        assert!(err.contains("data dir"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn data_dir_and_database_modes_are_fixed_at_start() {
    let mut s = Service::start_prepared(Opts::default(), |data| {
        std::fs::create_dir_all(data).unwrap();
        std::fs::set_permissions(data, std::fs::Permissions::from_mode(0o755)).unwrap();
    })
    .await;
    let db = s.data.join("blockplane.db");
    assert_eq!(
        (mode(&s.data), mode(&db)),
        (0o700, 0o600),
        "data dir, blockplane.db"
    );
    s.signal(rustix::process::Signal::TERM);
    std::fs::set_permissions(&s.data, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    s.restart().await;
    let mut modes = vec![mode(&s.data), mode(&db)];
    for f in ["blockplane.db-wal", "blockplane.db-shm"] {
        if let Ok(m) = std::fs::metadata(s.data.join(f)) {
            modes.push(m.permissions().mode() & 0o7777);
        }
    }
    assert!(
        modes[0] == 0o700 && modes[1..].iter().all(|m| *m == 0o600),
        "after a restart on a 0755 dir and a 0644 database: {:?}",
        modes.iter().map(|m| format!("{m:o}")).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_an_image_racing_a_create_on_it_is_never_500() {
    let s = Service::start().await;
    for i in 0..40 {
        let image = format!("race-{i}");
        s.image(&image, 1).await;
        let volume = format!("racev-{i}");
        let image_path = format!("/v1/images/{image}");
        let (d, c) = tokio::join!(
            s.delete(&image_path),
            s.post(
                "/v1/volumes",
                json!({"name": volume, "image": image, "backend": "loop"})
            )
        );
        match c.status.as_u16() {
            201 => {
                assert_error(&d, 409, "image_in_use");
                let r = s.delete(&format!("/v1/volumes/{volume}")).await;
                assert_eq!(r.status.as_u16(), 204, "{}", r.body);
                let r = s.delete(&format!("/v1/images/{image}")).await;
                assert_eq!(r.status.as_u16(), 204, "{}", r.body);
            }
            _ => {
                assert_error(&c, 404, "image_not_found");
                assert_eq!(d.status.as_u16(), 204, "{}", d.body);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn impossible_paths_are_4xx_with_precise_codes() {
    let s = Service::start().await;
    let before = s.snapshot().await;
    let root = s.images.display().to_string();
    let long_name = "n".repeat(256);
    let long_path = format!("{root}/{}/x.img", vec!["d".repeat(200); 21].join("/"));
    let cases = [
        (format!("{root}/a\u{0}b.img"), "path_contains_nul"),
        (format!("{root}/{long_name}.img"), "file_name_too_long"),
        (long_path, "path_too_long"),
    ];
    for (path, code) in &cases {
        for create in [false, true] {
            let mut body = json!({"name": "bad", "path": path});
            if create {
                body["create"] = json!({"size_bytes": 1 << 20});
            }
            let a = s.post("/v1/images", body).await;
            assert_error(&a, 422, code);
        }
    }
    assert_eq!(s.snapshot().await, before);
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_the_file_of_a_replaced_image_is_409() {
    let s = Service::start().await;
    s.image("replaced", 1).await;
    let path = s.images.join("replaced.img");
    let other = image_file(&s, "other.img", 1);
    std::fs::rename(&other, &path).unwrap();
    let a = s.delete("/v1/images/replaced?delete_file=true").await;
    assert_error(&a, 409, "image_replaced");
    assert!(
        path.exists(),
        "the file that replaced the image was removed"
    );
    assert_eq!(s.get("/v1/images/replaced").await.status.as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_newline_in_a_path_cannot_forge_a_log_line() {
    let s = Service::start().await;
    let path = format!("{}/evil\nFORGED-LINE level=INFO.img", s.images.display());
    let a = s
        .post(
            "/v1/images",
            json!({"name": "evil", "path": path, "create": {"size_bytes": 1 << 20}}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    let missing = format!("{}/gone\rFORGED-LINE\n.img", s.images.display());
    let a = s
        .post("/v1/images", json!({"name": "gone", "path": missing}))
        .await;
    assert_error(&a, 404, "file_not_found");
    let d = s.delete("/v1/images/evil?delete_file=true").await;
    assert_eq!(d.status.as_u16(), 204, "{}", d.body);
    let log = s.log_text();
    assert!(
        log.contains("FORGED-LINE"),
        "the path was not logged:\n{log}"
    );
    let forged: Vec<&str> = log
        .split(['\n', '\r'])
        .filter(|l| l.starts_with("FORGED-LINE"))
        .collect();
    assert!(forged.is_empty(), "forged log lines: {forged:?}");
}

/// One request written as raw bytes; the status, the content type and the body.
async fn raw(s: &Service, request: &[u8]) -> (u16, String, String) {
    let mut c = tokio::net::UnixStream::connect(&s.sock).await.unwrap();
    // The service may answer and close before it has read everything.
    let _ = c.write_all(request).await;
    let mut buf = Vec::new();
    let mut chunk = [0; 8192];
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(10), c.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => break,
        }
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let ctype = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type:")
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default();
    (status, ctype, body.to_string())
}

fn assert_json_error(what: &str, (status, ctype, body): &(u16, String, String), want: u16) {
    assert_eq!(*status, want, "{what}: {body}");
    assert_eq!(ctype, "application/json", "{what}: {body:?}");
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: {e}: {body:?}"));
    assert!(
        v["error"]["code"].as_str().is_some_and(|c| !c.is_empty())
            && v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn http_layer_errors_have_the_json_error_shape() {
    let s = Service::start().await;
    let a = raw(
        &s,
        b"GET /v1/images/%FF HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_json_error("GET /v1/images/%FF", &a, 400);
    let uri = format!("/v1/images/{}", "u".repeat(70_000));
    let a = raw(
        &s,
        format!("GET {uri} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert_json_error("a 70 000-byte URI", &a, 414);
    let big = "h".repeat(512 << 10);
    let a = raw(
        &s,
        format!("GET /v1/images HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    assert_json_error("a 512 KiB header", &a, 431);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_bearer_scheme_is_matched_in_any_case() {
    let s = Service::start_with(Opts {
        token: Some("s3cret-token".into()),
        ..Default::default()
    })
    .await;
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let (status, _, body) = raw(
            &s,
            format!(
                "GET /v1/images HTTP/1.1\r\nHost: x\r\nAuthorization: {scheme} s3cret-token\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "scheme '{scheme}': {body}");
    }
    let a = raw(
        &s,
        b"GET /v1/images HTTP/1.1\r\nHost: x\r\nAuthorization: bearer wrong\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_json_error("a wrong token", &a, 401);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicated_json_key_is_400() {
    let s = Service::start().await;
    let before = s.snapshot().await;
    let path = s.images.join("dup.img").display().to_string();
    let body = format!(
        r#"{{"name":"dup-a","name":"dup-b","path":{},"create":{{"size_bytes":1048576,"size_bytes":2097152}}}}"#,
        serde_json::to_string(&path).unwrap()
    );
    let a = raw(
        &s,
        format!(
            "POST /v1/images HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    assert_json_error("a duplicated key", &a, 400);
    assert!(a.2.contains("duplicate"), "{}", a.2);
    assert_eq!(s.snapshot().await, before);
}

#[tokio::test(flavor = "multi_thread")]
async fn detached_loop_devices_are_removed() {
    let s = Service::start().await;
    for i in 0..3 {
        let v = s.loop_volume(&format!("gone-{i}"), 1).await;
        let dev = v["device"].as_str().unwrap().to_string();
        let d = s.delete(&format!("/v1/volumes/gone-{i}")).await;
        assert_eq!(d.status.as_u16(), 204, "{}", d.body);
        // Looked at once deleted: another test may take the index since (then
        // it is bound, or for a moment unbound: a service killed inside its
        // attach, restart::killed_inside_the_attach_before_the_device_is_bound).
        let sys = Path::new("/sys/block").join(dev.trim_start_matches("/dev/"));
        assert!(
            !sys.exists() || sys.join("loop/backing_file").exists(),
            "{dev} is left behind, unbound"
        );
    }
}
