//! The `blockplane` CLI against a real service.

use std::process::Output;

use crate::harness::{Opts, Service, bin};

pub fn cli(s: &Service, args: &[&str]) -> Output {
    std::process::Command::new(bin())
        .arg("--api")
        .arg(format!("unix:{}", s.sock.display()))
        .args(args)
        .env_remove("BLOCKPLANE_TOKEN")
        .output()
        .unwrap()
}

/// Runs the CLI with a terminal as its stdin, `typed` already typed into it.
fn cli_at_terminal(s: &Service, args: &[&str], typed: &str) -> Output {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty only writes the two new descriptors, owned right after.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both are open and owned by nothing else.
    let (mut master, slave) = unsafe {
        (
            std::fs::File::from_raw_fd(master),
            std::os::fd::OwnedFd::from_raw_fd(slave),
        )
    };
    std::io::Write::write_all(&mut master, typed.as_bytes()).unwrap();
    std::process::Command::new(bin())
        .arg("--api")
        .arg(format!("unix:{}", s.sock.display()))
        .args(args)
        .env_remove("BLOCKPLANE_TOKEN")
        .stdin(std::process::Stdio::from(slave))
        .output()
        .unwrap()
}

fn ok(s: &Service, args: &[&str]) -> String {
    let out = cli(s, args);
    assert!(
        out.status.success(),
        "blockplane {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(s: &Service, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    serde_json::from_str(&ok(s, &a)).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_whole_life_of_a_volume_from_the_command_line() {
    let s = Service::start().await;
    let path = s.images.join("c.img").display().to_string();
    let out = ok(
        &s,
        &[
            "image",
            "create",
            "cimg",
            &path,
            "--size",
            "16M",
            "--allocation",
            "full",
        ],
    );
    assert!(out.contains("cimg") && out.contains("16.0 MiB"), "{out}");
    let images = json(&s, &["image", "ls"]);
    assert_eq!(images[0]["name"], "cimg");
    assert!(
        ok(&s, &["image", "ls"])
            .lines()
            .next()
            .unwrap()
            .starts_with("NAME")
    );

    let v = json(
        &s,
        &[
            "volume",
            "create",
            "cvol",
            "--image",
            "cimg",
            "--backend",
            "loop",
        ],
    );
    assert_eq!(v["state"], "attached");
    let dev = v["device"].as_str().unwrap().to_string();
    let table = ok(&s, &["volume", "ls"]);
    assert!(table.contains("cvol") && table.contains(&dev), "{table}");
    assert!(ok(&s, &["volume", "show", "cvol"]).contains(&dev));
    std::fs::write(&dev, vec![1u8; 65536]).unwrap();
    let stats = json(&s, &["volume", "stats", "cvol"]);
    assert!(stats["write"]["bytes"].as_u64().unwrap() >= 65536);
    let text = ok(&s, &["volume", "stats", "cvol"]);
    assert!(text.contains("write"), "{text}");
    // What the page cache holds of the device and the image is shown.
    assert!(stats["page_cache"].is_object(), "{stats}");
    assert!(
        text.contains("page cache, device") && text.contains("page cache, image"),
        "{text}"
    );

    let grown = json(&s, &["image", "resize", "cimg", "--size", "32M"]);
    assert_eq!(grown["image"]["size_bytes"], 32 << 20);
    assert_eq!(grown["volumes"][0]["name"], "cvol");
    assert_eq!(grown["volumes"][0]["size_bytes"], 32 << 20);
    assert!(ok(&s, &["host"]).contains("backend loop"));
    assert!(ok(&s, &["events", "--volume", "cvol"]).contains("volume_attached"));

    // Errors: non-zero exit with the API's message.
    let out = cli(&s, &["volume", "set", "cvol", "--dispatch", "nowait"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("dispatch cannot change live on backend loop") && err.contains("not_live"),
        "{err}"
    );
    let out = cli(&s, &["image", "rm", "cimg"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("image_in_use"));
    // The kernel's loop driver cannot be kept out of the ranges allocate
    // would zero: refused while attached, done once detached.
    let out = cli(&s, &["image", "allocate", "cimg"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("device_busy") && err.contains("loop"), "{err}");

    // `volume rm` refuses a volume written in its last second: the test's
    // writes must have left the sampler's window first, however late the
    // page cache wrote them back.
    crate::eventually(
        std::time::Duration::from_secs(60),
        "the volume to be idle",
        async || s.get("/v1/volumes/cvol/usage").await.body["busy"] == false,
    )
    .await;
    assert!(ok(&s, &["volume", "rm", "cvol"]).contains("deleted"));
    assert!(!crate::harness::serves_from(&dev, s.dir.path()));
    // It waits for the background allocate's end; nothing runs to cancel after.
    let allocated = json(&s, &["image", "allocate", "cimg"]);
    assert_eq!(allocated["allocation"], "full", "{allocated}");
    assert_eq!(allocated["allocate"]["state"], "done", "{allocated}");
    let out = cli(&s, &["image", "allocate", "cimg", "--cancel"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("allocate_conflict") && err.contains("no allocate runs"),
        "{err}"
    );
    ok(&s, &["image", "rm", "cimg", "--delete-file"]);
    assert!(!std::path::Path::new(&path).exists());
    let out = cli(&s, &["volume", "show", "cvol"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("volume 'cvol' not found"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_sends_the_token() {
    let s = Service::start_with(Opts {
        token: Some("tok".into()),
        ..Default::default()
    })
    .await;
    let out = cli(&s, &["host"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unauthorized"), "{err}");
    assert!(
        err.contains("--token") && err.contains("BLOCKPLANE_TOKEN"),
        "a 401 says how to give the token: {err}"
    );
    let out = std::process::Command::new(bin())
        .args(["--api", &format!("unix:{}", s.sock.display()), "host"])
        .env("BLOCKPLANE_TOKEN", "tok")
        .output()
        .unwrap();
    assert!(out.status.success());
}

#[tokio::test(flavor = "multi_thread")]
async fn no_service_is_a_clear_error() {
    let out = std::process::Command::new(bin())
        .args(["--api", "unix:/nonexistent/blockplane.sock", "volume", "ls"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect to the blockplane API"));
}

#[tokio::test(flavor = "multi_thread")]
async fn volume_top_shows_each_attached_volume_s_last_second() {
    let s = Service::start().await;
    let v = s.loop_volume("busy", 8).await;
    s.loop_volume("idle", 8).await;
    let dev = v["device"].as_str().unwrap().to_string();
    // Writes until the screens are taken, however long that is.
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let w = writing.clone();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        while w.load(std::sync::atomic::Ordering::Relaxed) {
            let mut f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
            f.write_all(&vec![7u8; 1 << 20]).unwrap();
            f.sync_all().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    });
    // `volume top` shows each volume's last second of history: wait until
    // the sampler has one for both, busy's with its writes.
    let last_write = async |name: &str| {
        let h = s
            .get(&format!("/v1/volumes/{name}/stats/history?seconds=2"))
            .await;
        h.body["points"]
            .as_array()
            .and_then(|p| p.last())
            .map(|p| p["write"]["bytes_per_sec"].as_f64().unwrap_or(0.0))
    };
    crate::eventually(
        std::time::Duration::from_secs(30),
        "a second of history for both volumes, busy's with writes",
        async || {
            last_write("busy").await.is_some_and(|w| w > 0.0) && last_write("idle").await.is_some()
        },
    )
    .await;
    let out = ok(&s, &["volume", "top", "--count", "2"]);
    writing.store(false, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    let screens: Vec<&str> = out.split(" UTC ").collect();
    assert_eq!(
        screens.len(),
        3,
        "two screens, each with its clock time: {out}"
    );
    let last = screens[2];
    let header = last.lines().nth(1).unwrap_or_default();
    assert!(
        header.starts_with("VOLUME") && header.contains("W_AWAIT"),
        "{out}"
    );
    let row = |name: &str| -> Vec<String> {
        last.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("a row for {name}: {out}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    let busy = row("busy");
    let idle = row("idle");
    let w_s: f64 = busy[4]
        .parse()
        .unwrap_or_else(|_| panic!("W/S of busy: {out}"));
    assert!(w_s > 0.0, "busy writes show: {out}");
    assert!(
        busy[8].parse::<f64>().is_ok(),
        "busy has a write latency: {out}"
    );
    assert_eq!(idle[4], "0.0", "idle writes nothing: {out}");
    assert_eq!(idle[8], "-", "no writes, no latency: {out}");
    assert!(
        !out.contains('\x1b'),
        "no screen clearing into a pipe: {out:?}"
    );

    let frames = ok(&s, &["--json", "volume", "top", "--count", "1"]);
    let frame: serde_json::Value = serde_json::from_str(frames.trim()).unwrap();
    let names: Vec<&str> = frame
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["volume"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["busy", "idle"], "{frames}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sizes_are_read_as_people_write_them_and_refusals_say_what_is_accepted() {
    let s = Service::start().await;
    for (name, size, bytes) in [
        ("half", "1.5M", 3 << 19),
        ("bin", "2Mi", 2 << 20),
        ("dec", "4096KB", 4_096_000),
    ] {
        let path = s.images.join(format!("{name}.img")).display().to_string();
        let img = json(&s, &["image", "create", name, &path, "--size", size]);
        assert_eq!(img["size_bytes"], bytes, "{size}: {img}");
    }
    for bad in ["-1", "1.5X", "0.1K"] {
        let path = s.images.join("bad.img").display().to_string();
        let out = cli(&s, &["image", "create", "bad", &path, "--size", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} is refused");
        assert!(
            err.contains(&format!("'{bad}' is not a size"))
                && err.contains("binary: 1024")
                && err.contains("decimal: 1000"),
            "{bad}: the refusal says what is accepted: {err}"
        );
    }
    assert!(
        !s.images.join("bad.img").exists(),
        "a refusal makes nothing"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_refuses_an_empty_change_and_reads_events_since_a_time() {
    let s = Service::start().await;
    s.loop_volume("v", 8).await;
    let out = cli(&s, &["volume", "set", "v"]);
    assert!(!out.status.success(), "a set with no change is refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--dispatch") && err.contains("--no-qos"),
        "{err}"
    );

    let host = ok(&s, &["host"]);
    assert!(
        !host.lines().any(|l| l.trim() == "available"),
        "no stray header line: {host}"
    );
    assert!(host.contains("CAPABILITY"), "{host}");

    let events = json(&s, &["events"]);
    let last = events.as_array().unwrap().last().unwrap()["at"]
        .as_str()
        .unwrap()
        .to_string();
    s.image("later", 4).await;
    let after = json(&s, &["events", "--since", &last]);
    let kinds: Vec<&str> = after
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["image_created"], "only what came after {last}");
}

#[tokio::test(flavor = "multi_thread")]
async fn image_snapshot_and_clone_wait_for_a_copy_showing_progress_unless_told_not_to() {
    let fs = crate::harness::LoopFs::new(&["mkfs.ext4", "-q", "-F"], 256 << 20);
    let s = Service::start_with(Opts {
        extra_roots: vec![fs.mnt.clone()],
        env: vec![("BLOCKPLANE_TEST_FAULT".into(), "slow_copy".into())],
        ..Default::default()
    })
    .await;
    let base = fs.mnt.join("base.img");
    ok(
        &s,
        &[
            "image",
            "create",
            "base",
            base.to_str().unwrap(),
            "--size",
            "64M",
        ],
    );
    let f = std::fs::OpenOptions::new().write(true).open(&base).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &vec![0x3c; 48 << 20], 0).unwrap();
    f.sync_all().unwrap();

    let out = cli(&s, &["--json", "image", "snapshot", "base", "base-s"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("copying image 'base-s': "), "{err}");
    let snap: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(snap["state"], "ready", "{snap}");
    assert_eq!(snap["method"], "copy", "{snap}");
    assert_eq!(snap["read_only"], true, "{snap}");
    let shown = ok(&s, &["image", "show", "base-s"]);
    assert!(
        shown.contains("snapshot of") && shown.contains("copy"),
        "{shown}"
    );

    // The clone's copy waits at the copy gate (`slow_copy`), so it is still
    // copying when deleted, however loaded the host.
    let gate = s.shut_copy_gate();
    let cpath = fs.mnt.join("c.img");
    let clone = json(
        &s,
        &[
            "image",
            "clone",
            "base-s",
            "c",
            cpath.to_str().unwrap(),
            "--no-wait",
        ],
    );
    assert_eq!(clone["state"], "copying", "{clone}");
    assert_eq!(clone["read_only"], false, "{clone}");
    ok(&s, &["image", "rm", "c"]);
    assert!(!cpath.exists(), "the partial clone was left");
    std::fs::remove_file(&gate).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn volumes_name_their_image_and_keep_its_id_in_json() {
    let s = Service::start().await;
    let v = s.loop_volume("named", 8).await;
    let img = s.get("/v1/images/named-img").await.body;
    let (image_id, path) = (img["id"].as_str().unwrap(), img["path"].as_str().unwrap());
    let show = ok(&s, &["volume", "show", "named"]);
    let line = show
        .lines()
        .find(|l| l.starts_with("image "))
        .unwrap_or_else(|| panic!("an image line: {show}"));
    assert!(
        line.contains("named-img") && line.contains(path) && !line.contains(image_id),
        "the image by name and path: {show}"
    );
    assert_eq!(
        json(&s, &["volume", "show", "named"])["image_id"],
        image_id,
        "the id stays in the JSON"
    );
    let list = ok(&s, &["volume", "ls"]);
    let header = list.lines().next().unwrap();
    assert!(header.contains("IMAGE"), "{list}");
    let row = list.lines().find(|l| l.starts_with("named ")).unwrap();
    assert!(
        row.contains("named-img") && !row.contains(image_id),
        "{list}"
    );
    let vid = v["id"].as_str().unwrap();
    assert!(
        !ok(&s, &["events"]).contains(vid),
        "event lines name the volume, not its id"
    );
    let image = ok(&s, &["image", "show", "named-img"]);
    assert!(
        image.contains("named") && !image.contains(vid),
        "an image names its volume: {image}"
    );
    let stats = ok(&s, &["volume", "stats", "named"]);
    assert!(
        stats.lines().next().unwrap().contains("named") && !stats.contains(vid),
        "stats name their volume: {stats}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_help_lists_only_server_flags_and_client_flags_stay_where_they_work() {
    let help = |args: &[&str]| {
        let out = std::process::Command::new(bin())
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let serve = help(&["serve", "--help"]);
    for client_only in ["--api", "--json"] {
        assert!(
            !serve.contains(client_only),
            "serve --help lists the client flag {client_only}: {serve}"
        );
    }
    assert!(
        serve.contains("--listen") && serve.contains("--token-file"),
        "{serve}"
    );
    for client in [
        vec!["--help"],
        vec!["volume", "ls", "--help"],
        vec!["events", "--help"],
    ] {
        let h = help(&client);
        assert!(
            h.contains("--api") && h.contains("--json") && h.contains("--token"),
            "{client:?}: {h}"
        );
    }
    let out = std::process::Command::new(bin())
        .args(["--json", "serve"])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a client flag given to serve is refused"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--json") && err.contains("serve"), "{err}");
    // Client flags work before and after the command.
    let s = Service::start().await;
    s.loop_volume("f", 8).await;
    let sock = format!("unix:{}", s.sock.display());
    for args in [
        vec!["--api", &sock, "--json", "volume", "ls"],
        vec!["volume", "ls", "--api", &sock, "--json"],
        vec!["volume", "--json", "ls", "--api", &sock],
    ] {
        let out = std::process::Command::new(bin())
            .args(&args)
            .env_remove("BLOCKPLANE_TOKEN")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(list[0]["name"], "f", "{args:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn events_show_sizes_for_people_and_follow_the_stream() {
    let s = Service::start().await;
    s.image("sized", 24).await;
    let out = ok(&s, &["events"]);
    let line = out
        .lines()
        .find(|l| l.contains("image_created"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("24.0 MiB (25165824 bytes)"),
        "the size for people, the exact count beside it: {line}"
    );

    let mut follow = std::process::Command::new(bin())
        .args(["--api", &format!("unix:{}", s.sock.display())])
        .args(["events", "--follow", "--limit", "1"])
        .env_remove("BLOCKPLANE_TOKEN")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = follow.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stdout).lines() {
            if tx.send(l.unwrap()).is_err() {
                break;
            }
        }
    });
    let wait_for = |what: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut seen = Vec::new();
        while let Ok(l) =
            rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
        {
            if l.contains(what) {
                return l;
            }
            seen.push(l);
        }
        panic!("no line with {what} within 10 s: {seen:?}");
    };
    wait_for("image_created");
    // What happens after the command started shows while it runs.
    s.image("later", 4).await;
    let l = wait_for("'later'");
    assert!(l.contains("4.0 MiB (4194304 bytes)"), "{l}");
    assert!(follow.try_wait().unwrap().is_none(), "it keeps following");
    let _ = follow.kill();
    let _ = follow.wait();
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_volume_in_use_is_refused_without_force_saying_why() {
    let s = Service::start().await;
    let v = s.loop_volume("held", 8).await;
    let dev = v["device"].as_str().unwrap().to_string();
    let mut holder = std::process::Command::new("sleep")
        .arg("60")
        .stdin(std::fs::File::open(&dev).unwrap())
        .spawn()
        .unwrap();
    let usage = json(&s, &["volume", "show", "held"]);
    assert_eq!(usage["name"], "held");
    let u = s.get("/v1/volumes/held/usage").await.body;
    assert_eq!(u["busy"], true, "{u}");
    assert_eq!(u["openers"][0]["command"], "sleep", "{u}");
    assert_eq!(u["openers"][0]["pid"], holder.id(), "{u}");

    let out = cli(&s, &["volume", "rm", "held"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a volume held open is not deleted");
    assert!(
        err.contains("volume 'held' is in use")
            && err.contains(&format!("open by sleep (pid {})", holder.id()))
            && err.contains("--force"),
        "{err}"
    );
    assert_eq!(s.get("/v1/volumes/held").await.status, 200, "still there");
    assert!(crate::harness::serves_from(&dev, s.dir.path()));
    // At a terminal it asks for the name; another answer deletes nothing.
    let out = cli_at_terminal(&s, &["volume", "rm", "held"], "helt\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("Type its name") && err.contains("not deleted"),
        "{err}"
    );
    assert_eq!(s.get("/v1/volumes/held").await.status, 200, "still there");
    let _ = holder.kill();
    let _ = holder.wait();

    // Closed again, but written a moment ago: the last seconds' I/O says it
    // is in use (once the sampler follows the volume: two readings).
    while s
        .get("/v1/volumes/held/stats/history?seconds=10")
        .await
        .body["points"]
        .as_array()
        .map_or(0, Vec::len)
        < 2
    {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
        f.write_all(&vec![5u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
    }
    // The sampler's next second sees the writes (however late it runs).
    crate::eventually(
        std::time::Duration::from_secs(30),
        "the writes to show in the usage",
        async || s.get("/v1/volumes/held/usage").await.body["iops"] != 0.0,
    )
    .await;
    let out = cli(&s, &["volume", "delete", "held"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a volume written a second ago is not deleted"
    );
    assert!(
        err.contains("IOPS") && err.contains("over the last") && !err.contains("open by"),
        "{err}"
    );

    assert!(ok(&s, &["volume", "rm", "held", "--force"]).contains("deleted"));
    assert!(!crate::harness::serves_from(&dev, s.dir.path()));
    // Written a moment ago, at a terminal: the name typed deletes it.
    s.loop_volume("typed", 8).await;
    let tdev = s.get("/v1/volumes/typed").await.body["device"]
        .as_str()
        .unwrap()
        .to_string();
    crate::eventually(
        std::time::Duration::from_secs(30),
        "the writes to typed to show in its usage",
        async || {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().write(true).open(&tdev).unwrap();
            f.write_all(&vec![5u8; 1 << 20]).unwrap();
            f.sync_all().unwrap();
            drop(f);
            s.get("/v1/volumes/typed/usage").await.body["iops"] != 0.0
        },
    )
    .await;
    let out = cli_at_terminal(&s, &["volume", "rm", "typed"], "typed\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("volume 'typed' is in use") && err.contains("IOPS"),
        "it asked, saying why: {err}"
    );
    assert_eq!(s.get("/v1/volumes/typed").await.status, 404);
    // An idle volume goes without a question.
    let quiet = s.loop_volume("quiet", 8).await;
    let u = s.get("/v1/volumes/quiet/usage").await.body;
    assert_eq!(u["busy"], false, "{u}");
    assert!(
        ok(&s, &["volume", "rm", "quiet"]).contains("deleted"),
        "{quiet}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn image_add_says_the_allocation_it_recorded_and_why_and_takes_a_declared_one() {
    use std::os::unix::fs::PermissionsExt;
    let s = Service::start().await;
    let written = s.images.join("w.img");
    std::fs::write(&written, vec![1u8; 1 << 20]).unwrap();
    let holey = s.images.join("h.img");
    std::fs::File::create(&holey)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    for p in [&written, &holey] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let out = ok(&s, &["image", "add", "w", written.to_str().unwrap()]);
    assert!(
        out.contains("allocation reason: FIEMAP shows every byte"),
        "{out}"
    );
    assert_eq!(json(&s, &["image", "show", "w"])["allocation"], "full");
    let add_h = |allocation| {
        let h = holey.to_str().unwrap();
        ["image", "add", "h", h, "--allocation", allocation]
    };
    let refused = cli(&s, &add_h("full"));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("cannot be registered as full"),
        "{err}"
    );
    let a = json(&s, &add_h("sparse"));
    assert_eq!(a["allocation"], "sparse", "{a}");
}

#[tokio::test(flavor = "multi_thread")]
async fn backups_from_the_command_line_wait_showing_progress() {
    let target = tempfile::tempdir().unwrap();
    let s = Service::start_with(Opts {
        extra_args: vec![
            "--backup-target".into(),
            target.path().display().to_string(),
        ],
        env: vec![("BLOCKPLANE_TEST_FAULT".into(), "slow_backup".into())],
        ..Default::default()
    })
    .await;
    let base = s.images.join("base.img");
    ok(
        &s,
        &[
            "image",
            "create",
            "base",
            base.to_str().unwrap(),
            "--size",
            "64M",
        ],
    );
    let f = std::fs::OpenOptions::new().write(true).open(&base).unwrap();
    let data: Vec<u8> = (0..48u32 << 20).map(|i| (i % 253) as u8 | 1).collect();
    std::os::unix::fs::FileExt::write_all_at(&f, &data, 0).unwrap();
    f.sync_all().unwrap();

    let out = cli(&s, &["--json", "image", "backup", "base", "one"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("backing image 'base' up as 'one': "), "{err}");
    let b: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(b["state"], "done", "{b}");
    assert_eq!(b["stored_bytes"], 48 << 20, "{b}");
    let listed = ok(&s, &["backup", "ls", "--image", "base"]);
    assert!(
        listed
            .lines()
            .any(|l| l.contains("one") && l.contains("done")),
        "{listed}"
    );
    let shown = ok(&s, &["backup", "show", "one"]);
    assert!(
        shown.contains("uploaded") && shown.contains("48.0 MiB"),
        "{shown}"
    );

    let rpath = s.images.join("r.img");
    let out = cli(
        &s,
        &[
            "--json",
            "image",
            "restore",
            "r",
            rpath.to_str().unwrap(),
            "--from",
            "one",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["state"], "ready", "{r}");
    assert_eq!(r["method"], "restore", "{r}");
    assert!(std::fs::read(&rpath).unwrap() == std::fs::read(&base).unwrap());

    let verified = ok(&s, &["backup", "verify", "one"]);
    assert!(
        verified
            .lines()
            .any(|l| l.split_whitespace().eq(["ok", "true"]))
            && verified
                .lines()
                .any(|l| l.split_whitespace().eq(["chunks", "12"])),
        "{verified}"
    );
    assert!(ok(&s, &["backup", "rm", "one"]).contains("backup removed"));
    // The delete's own gc or this one removed the backup's 12 chunks.
    let gc = ok(&s, &["backup", "gc"]);
    assert!(gc.contains("chunks kept"), "{gc}");
    let left = std::fs::read_dir(target.path().join("chunks"))
        .unwrap()
        .flatten()
        .map(|d| std::fs::read_dir(d.path()).unwrap().count())
        .sum::<usize>();
    assert_eq!(left, 0, "{gc}");
    assert!(!ok(&s, &["backup", "ls"]).contains("one"));
}

/// `export` and `remote` on a host where neither can work (no export
/// address, no nvmet): each refusal is the API's, with its code and the
/// exit code of any refusal; a secret given in a file is never echoed;
/// the lists are empty tables, and `host` says this host's NQN and that
/// it exports nothing.
#[tokio::test(flavor = "multi_thread")]
async fn exports_and_remote_volumes_from_the_command_line_refuse_what_this_host_cannot() {
    let s = Service::start().await;
    s.loop_volume("xvol", 16).await;
    let host_nqn = "nqn.2014-08.org.nvmexpress:uuid:7d0c0f52-64d3-4bb4-8f7c-3c0a3c9b1e21";

    let out = cli(&s, &["export", "put", "xvol", "--host", host_nqn]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("export_unavailable") && err.contains("--export-address"),
        "{err}"
    );
    let out = cli(&s, &["export", "show", "xvol"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("export_not_found"));
    let table = ok(&s, &["export", "ls"]);
    assert_eq!(table.lines().count(), 1, "{table}");
    assert!(
        table.starts_with("VOLUME") && table.contains("CONNECTED"),
        "{table}"
    );
    assert_eq!(json(&s, &["export", "ls"]), serde_json::json!([]));

    let table = ok(&s, &["remote", "ls"]);
    assert_eq!(table.lines().count(), 1, "{table}");
    assert!(
        table.starts_with("NAME") && table.contains("NQN"),
        "{table}"
    );
    assert_eq!(json(&s, &["remote", "ls"]), serde_json::json!([]));

    // A key that looks like one but is not: refused before any connect,
    // naming the field and never showing the key.
    let key = "DHHC-1:00:c2VjcmV0LWtleS10aGF0LWlzLW5vdC12YWxpZA==:";
    let secret = s.dir.path().join("secret");
    std::fs::write(&secret, format!("{key}\n")).unwrap();
    let secret_arg = secret.display().to_string();
    let create = |extra: &[&str]| {
        let mut args = vec![
            "remote",
            "create",
            "far",
            "--address",
            "127.0.0.1",
            "--nqn",
            "nqn.2026-12.dev.blockplane:elsewhere:vol",
        ];
        args.extend_from_slice(extra);
        cli(&s, &args)
    };
    let out = create(&["--secret-file", &secret_arg]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid_key") && err.contains("secret"),
        "{err}"
    );
    assert!(
        !err.contains("c2VjcmV0") && !String::from_utf8_lossy(&out.stdout).contains("c2VjcmV0")
    );
    // Standard input holds one secret, not two.
    let out = create(&["--secret-file", "-", "--ctrl-secret-file", "-"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot both be `-`"));
    // A missing file is the CLI's own refusal, before any call.
    let out = create(&["--secret-file", "/nonexistent/secret"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read the secret file"));
    assert_eq!(json(&s, &["remote", "ls"]), serde_json::json!([]));
    let out = cli(&s, &["remote", "show", "far"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("remote_not_found"));

    let fabric = &json(&s, &["host"])["fabric"];
    let text = ok(&s, &["host"]);
    assert!(
        text.contains(fabric["host_nqn"].as_str().unwrap()),
        "{text}"
    );
    assert!(
        text.contains("export addresses") && text.contains("none (exports are refused"),
        "{text}"
    );
    assert!(
        text.contains("nvme/tcp export") && text.contains("no export address"),
        "{text}"
    );
}

/// `move` on a host with no remote volume: the list is an empty table (and
/// `[]`), each refusal is the API's with its code and the exit code of
/// any refusal, and a rate limit the CLI cannot read is its own refusal,
/// before any call. A cold move (`move pull`) from a host that does not
/// answer is refused and leaves nothing.
#[tokio::test(flavor = "multi_thread")]
async fn moves_from_the_command_line_refuse_what_is_not_there() {
    let s = Service::start().await;
    let table = ok(&s, &["move", "ls"]);
    assert_eq!(table.lines().count(), 1, "{table}");
    assert!(
        table.starts_with("ID") && table.contains("PROGRESS") && table.contains("RATE LIMIT"),
        "{table}"
    );
    assert_eq!(json(&s, &["move", "ls"]), serde_json::json!([]));

    let path = s.images.join("near.img").display().to_string();
    let start = |extra: &[&str]| {
        let mut args = vec![
            "move",
            "start",
            "far",
            "--image",
            "near",
            "--path",
            &path,
            "--source-api",
            "http://127.0.0.1:1",
        ];
        args.extend_from_slice(extra);
        cli(&s, &args)
    };
    let out = start(&["--rate-limit", "50M", "--wait"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("remote_not_found"));
    let out = start(&["--rate-limit", "fast"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a size"));
    assert!(!std::path::Path::new(&path).exists());

    // A cold move whose exporting host does not answer never starts, and
    // leaves nothing here.
    let out = cli(
        &s,
        &[
            "move",
            "pull",
            "far",
            "--source-api",
            "http://127.0.0.1:1",
            "--image",
            "near",
            "--path",
            &path,
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("remote_unreachable") && err.contains("did not show volume 'far'"),
        "{err}"
    );
    assert!(!std::path::Path::new(&path).exists());
    assert_eq!(json(&s, &["remote", "ls"]), serde_json::json!([]));
    assert_eq!(json(&s, &["move", "ls"]), serde_json::json!([]));
    let dir = s.images.display().to_string();
    let out = cli(
        &s,
        &[
            "move",
            "drain",
            "--source-api",
            "http://127.0.0.1:1",
            "--dir",
            &dir,
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("remote_unreachable") && err.contains("did not list its volumes"),
        "{err}"
    );
    assert_eq!(json(&s, &["move", "ls"]), serde_json::json!([]));

    let id = "6f1c3a52-0d7e-4c39-9a51-2b8d5f0e7c11";
    for args in [
        &["move", "show", id][..],
        &["move", "show", "not-a-move"],
        &["move", "set", id, "--rate-limit", "1M"],
        &["move", "cancel", id],
        &["move", "drain-show", id],
        &["move", "drain-set", id, "--rate-limit", "1M"],
    ] {
        let out = cli(&s, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        let code = match args[1].starts_with("drain") {
            true => "drain_not_found",
            false => "move_not_found",
        };
        assert!(err.contains(code), "{args:?}: {err}");
    }
}
