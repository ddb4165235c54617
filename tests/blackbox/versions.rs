//! Which build serves: the service's version and build in `/v1/host`, the
//! CLI and `/metrics`, a replaced executable seen (and not run), and the
//! handover's refusals where no worker serves a volume (loop volumes: the
//! host has no ublk).

use std::process::Output;

use crate::builds::{copy_as_build, install};
use crate::cli::cli;
use crate::harness::{Opts, Service, assert_error, bin};

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn versions_are_shown_by_the_api_the_cli_and_metrics() {
    let s = Service::start().await;
    let host = s.get("/v1/host").await.body;
    let build = &host["build"];
    let version = build["version"].as_str().unwrap();
    // The build read from the binary itself: version, then its identity.
    assert_eq!(
        version,
        blockplane_system::build::of_file(std::path::Path::new(bin())).unwrap()
    );
    assert!(
        version.starts_with(&format!("{}+", host["version"].as_str().unwrap())),
        "{host}"
    );
    assert_eq!(build["executable_replaced"], false, "{host}");
    assert_eq!(build["executable_version"], version, "{host}");
    let out = cli(&s, &["host"]);
    assert!(text(&out).contains(version), "{}", text(&out));
    // A loop volume has no worker: no version, nothing older.
    let v = s.loop_volume("lv", 8).await;
    assert_eq!(v["worker_version"], serde_json::Value::Null, "{v}");
    assert_eq!(v["worker_older"], serde_json::Value::Null, "{v}");
    let ls = text(&cli(&s, &["volume", "ls"]));
    let header = ls.lines().next().unwrap();
    assert!(header.trim_end().ends_with("WORKER"), "{ls}");
    let row = ls.lines().find(|l| l.starts_with("lv ")).unwrap();
    assert!(row.trim_end().ends_with('-'), "{ls}");
    let metrics = s.get_text("/metrics").await;
    assert!(
        metrics.contains(&format!("blockplane_build_info{{version=\"{version}\"}} 1")),
        "{metrics}"
    );
    assert!(
        metrics.contains("# TYPE blockplane_worker_info gauge"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("blockplane_worker_info{"),
        "a loop volume has no worker: {metrics}"
    );
}

/// The service started from a file that is then replaced (a package
/// upgrade) says so, and runs on its own build.
#[tokio::test]
async fn a_replaced_executable_is_seen_and_the_service_keeps_its_own_build() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blockplane");
    let old = copy_as_build(std::path::Path::new(bin()), &path, None);
    let s = Service::start_with(Opts {
        bin: Some(path.clone()),
        ..Default::default()
    })
    .await;
    let host = own_build(&s, &old, &path).await;
    assert_eq!(host["build"]["executable_replaced"], false, "{host}");
    let staged = dir.path().join("blockplane.new");
    let new = copy_as_build(&path, &staged, Some("another-build"));
    assert_ne!(new, old);
    assert!(new.contains("+another-build."), "{new}");
    install(&staged, &path);
    assert_eq!(
        crate::builds::exe_of(u64::from(s.pid())),
        format!("{} (deleted)", path.display())
    );
    let host = own_build(&s, &old, &path).await;
    assert_eq!(host["build"]["executable_version"], new.as_str(), "{host}");
    assert_eq!(host["build"]["executable_replaced"], true, "{host}");
    let out = cli(&s, &["host"]);
    assert!(
        text(&out).contains(&format!("now holds build {new}")),
        "{}",
        text(&out)
    );
    // Nothing to hand over on a host of loop volumes; the note says why the
    // volumes would not move to the new file's build anyway.
    s.loop_volume("lv", 8).await;
    let out = cli(&s, &["upgrade"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("nothing to hand over"),
        "{}",
        text(&out)
    );
    assert!(
        text(&out).contains("restart the service first"),
        "{}",
        text(&out)
    );
}

/// A loop volume has no worker to replace: refused (422), nothing changed;
/// an unknown volume is 404; the CLI names the volume and why.
#[tokio::test]
async fn a_handover_where_no_worker_serves_is_refused_and_changes_nothing() {
    let s = Service::start().await;
    s.loop_volume("lv", 8).await;
    let before = s.snapshot().await;
    let a = s
        .post("/v1/volumes/lv/handover", serde_json::json!(null))
        .await;
    assert_error(&a, 422, "unsupported");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("volume 'lv'") && msg.contains("loop") && msg.contains("no worker"),
        "{msg}"
    );
    let a = s
        .post("/v1/volumes/nope/handover", serde_json::json!(null))
        .await;
    assert_error(&a, 404, "volume_not_found");
    assert_eq!(s.snapshot().await, before);
    let out = cli(&s, &["upgrade", "lv"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("volume 'lv' has no worker to hand over (backend loop"),
        "{}",
        text(&out)
    );
    assert_eq!(s.snapshot().await, before);
}

/// `/v1/host` of `s`, checked to say the service runs build `old` from `path`.
async fn own_build(s: &Service, old: &str, path: &std::path::Path) -> serde_json::Value {
    let host = s.get("/v1/host").await.body;
    assert_eq!(host["build"]["version"], old, "{host}");
    assert_eq!(
        host["build"]["executable"],
        path.to_str().unwrap(),
        "{host}"
    );
    host
}
