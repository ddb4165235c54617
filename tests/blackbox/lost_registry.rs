//! A registry that is not the one the data dir served is refused, with no
//! device left to show it (its mark beside it counts the rows it lost); and
//! only devices that carry blockplane's mark count as a lost registry's.

use std::process::Command;
use std::time::{Duration, Instant};

use hyper::{Method, StatusCode};
use rustix::process::Signal;
use serde_json::{Value, json};

use crate::harness::{Opts, Service, bin, serves_from};

/// Starts the service again and waits until it refuses (exits, saying why)
/// or serves. The log of this start if it refused; panics naming `started`
/// and what it serves if it serves.
pub async fn refusal(s: &mut Service, started: &str) -> String {
    let before = s.log_text().len();
    s.spawn(&[]);
    let client =
        blockplane_client::Transport::new(blockplane_client::Endpoint::Unix(s.sock.clone()), None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !s.log_text()[before..].contains("blockplane: ") {
        if let Ok(a) = client.send(Method::GET, "/v1/images", None).await
            && a.status == StatusCode::OK
        {
            panic!(
                "{started}: it serves {} image(s)",
                a.body.as_array().map_or(0, Vec::len)
            );
        }
        assert!(
            Instant::now() < deadline,
            "{started}: neither refused nor served in 20 s:\n{}",
            s.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = s.wait_exit(Duration::from_secs(20));
    assert!(!status.success(), "{started}: exited {status}");
    s.log_text()[before..].to_string()
}

async fn image_count(s: &Service) -> usize {
    s.get("/v1/images").await.body.as_array().unwrap().len()
}

/// The files of the data dir that say which registry it holds, as bytes.
fn registry_files(s: &Service) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&s.data)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("blockplane.db") || n.starts_with("registry.mark"))
        .map(|n| {
            let bytes = std::fs::read(s.data.join(&n)).unwrap();
            (n, bytes)
        })
        .collect();
    out.sort();
    out
}

fn empty_registry(s: &Service) {
    std::fs::File::create(s.data.join("blockplane.db")).unwrap();
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(s.data.join(format!("blockplane.db{suffix}")));
    }
}

/// 40 images registered and no volume attached, so no device is left to show
/// a lost registry: `blockplane.db` truncated to 0 bytes, or replaced by
/// another data dir's (empty) registry, is refused, naming what the data
/// dir's mark says it held, and changes nothing. Both ways out work: a
/// backup restored (of this registry, even with fewer rows than the mark)
/// starts, and so does `--accept-new-registry`, after which the emptied
/// registry is the one the data dir serves.
#[tokio::test(flavor = "multi_thread")]
async fn an_emptied_registry_with_no_device_attached_is_refused() {
    let mut s = Service::start().await;
    for i in 0..40 {
        s.image(&format!("img-{i:02}"), 1).await;
    }
    let backup = s.dir.path().join("backup.db");
    let out = Command::new(bin())
        .arg("backup")
        .arg("--data-dir")
        .arg(&s.data)
        .arg(&backup)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    s.image("after-backup", 1).await;
    assert!(s.signal(Signal::TERM).success());

    // Truncated.
    empty_registry(&s);
    let files = registry_files(&s);
    let log = refusal(&mut s, "started on a registry truncated to 0 bytes").await;
    let line = log
        .lines()
        .find(|l| l.starts_with("blockplane: "))
        .unwrap_or_else(|| panic!("no refusal:\n{log}"));
    for what in [
        "is missing or empty",
        "registry.mark says this data dir served blockplane instance",
        "with 41 image(s) and 0 volume(s)",
        "this one holds none of them",
        "restore",
        "--accept-new-registry",
    ] {
        assert!(line.contains(what), "{what:?} not in: {line}");
    }
    assert_eq!(registry_files(&s), files, "the refused start changed files");

    // Replaced by another data dir's registry, empty.
    let mut other = Service::start().await;
    assert!(other.signal(Signal::TERM).success());
    std::fs::copy(
        other.data.join("blockplane.db"),
        s.data.join("blockplane.db"),
    )
    .unwrap();
    let files = registry_files(&s);
    let log = refusal(&mut s, "started on another data dir's registry").await;
    assert!(
        log.contains("is not the one this data dir served")
            && log.contains("this one is instance")
            && log.contains("with 0 image(s) and 0 volume(s)"),
        "{log}"
    );
    assert_eq!(registry_files(&s), files, "the refused start changed files");

    // A backup of this registry is this registry, with fewer rows.
    std::fs::copy(&backup, s.data.join("blockplane.db")).unwrap();
    s.restart().await;
    assert_eq!(image_count(&s).await, 40);
    assert!(s.signal(Signal::TERM).success());

    // Begun empty on request; from then on the empty one is this data dir's.
    empty_registry(&s);
    s.opts.extra_args.push("--accept-new-registry".into());
    s.restart().await;
    assert_eq!(image_count(&s).await, 0);
    assert!(s.signal(Signal::TERM).success());
    s.opts.extra_args.clear();
    s.restart().await;
    assert_eq!(image_count(&s).await, 0);
}

/// A loop device an operator made (`losetup`) over a file under an image
/// root carries no blockplane mark: it does not refuse a first start, is
/// listed in `GET /v1/host` as an orphan that carries no mark, and is left
/// alone, through a restart too.
#[tokio::test(flavor = "multi_thread")]
async fn an_operators_own_loop_device_blocks_no_start_and_is_left_alone() {
    let mut dev = String::new();
    let mut s = Service::start_prepared(Opts::default(), |data| {
        let file = data.parent().unwrap().join("images/operators.img");
        std::fs::write(&file, vec![0u8; 4 << 20]).unwrap();
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    })
    .await;
    for _ in 0..2 {
        let host = s.get("/v1/host").await.body;
        let o: Vec<&Value> = host["orphans"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["device"] == dev.as_str())
            .collect();
        assert_eq!(o.len(), 1, "{host}");
        assert_eq!(o[0]["backend"], "loop");
        assert_eq!(o[0]["instance"], Value::Null);
        assert_eq!(o[0]["removable"], false);
        assert!(
            o[0]["reason"]
                .as_str()
                .unwrap()
                .contains("carries no blockplane mark"),
            "{}",
            o[0]
        );
        assert!(serves_from(&dev, &s.images), "{dev} was touched");
        assert_eq!(s.get("/v1/volumes").await.body, json!([]));
        assert!(s.signal(Signal::TERM).success());
        s.restart().await;
    }
}
