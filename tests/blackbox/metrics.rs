//! `GET /metrics`: parsed by the reference Prometheus parser (Python
//! `prometheus_client`), stable label sets, counters that survive a restart.

use std::collections::BTreeSet;
use std::io::Write;
use std::time::Duration;

use hyper::StatusCode;
use serde_json::Value;

use crate::eventually;
use crate::harness::{Service, repo};

/// The Python with `prometheus_client` (tests/run-all.sh makes a venv).
fn python() -> String {
    std::env::var("BLOCKPLANE_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Parses exposition text with prometheus_client's parser; returns
/// `[{name, type, samples: [{name, labels, value}]}]`.
fn parse(text: &str) -> Value {
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for f in text_string_to_metric_families(sys.stdin.read()):
    out.append({"name": f.name, "type": f.type,
                "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples]})
print(json.dumps(out))
"#;
    let mut child = std::process::Command::new(python())
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python for the Prometheus parser (set BLOCKPLANE_TEST_PYTHON)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client could not parse /metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn scrape(s: &Service) -> (String, Value) {
    let text = s.get_text("/metrics").await;
    let parsed = parse(&text);
    (text, parsed)
}

fn sample(parsed: &Value, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    parsed
        .as_array()?
        .iter()
        .flat_map(|f| f["samples"].as_array().unwrap().iter())
        .find_map(|s| {
            (s["name"] == name && labels.iter().all(|(k, v)| s["labels"][k] == *v))
                .then(|| s["value"].as_f64().unwrap())
        })
}

fn label_sets(parsed: &Value) -> BTreeSet<String> {
    parsed
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["name"].as_str().unwrap().starts_with("blockplane_volume"))
        .flat_map(|f| f["samples"].as_array().unwrap().iter())
        .map(|s| {
            let mut keys: Vec<&String> = s["labels"].as_object().unwrap().keys().collect();
            keys.sort();
            format!("{}{:?}", s["name"], keys)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_parse_keep_their_labels_and_survive_a_restart() {
    let mut s = Service::start().await;
    let v = s.loop_volume("m", 8).await;
    let dev = v["device"].as_str().unwrap().to_string();
    std::fs::write(&dev, vec![7u8; 1 << 20]).unwrap();
    let l = [
        ("volume", "m"),
        ("backend", "loop"),
        ("dispatch", "kernel"),
        ("op", "write"),
    ];
    // The sampler reads the volume once a second: until it has read the
    // write, its metrics are not there yet.
    eventually(
        Duration::from_secs(30),
        "the sampler to read the write",
        async || {
            let (_, p) = scrape(&s).await;
            sample(&p, "blockplane_volume_bytes_total", &l).is_some_and(|w| w >= (1 << 20) as f64)
        },
    )
    .await;
    let (text, first) = scrape(&s).await;
    let written =
        sample(&first, "blockplane_volume_bytes_total", &l).unwrap_or_else(|| panic!("{text}"));
    assert!(written >= (1 << 20) as f64, "{text}");
    assert_eq!(
        sample(&first, "blockplane_volumes", &[("state", "attached")]),
        Some(1.0)
    );
    // Nothing exported, nothing connected from elsewhere: every state
    // counted at zero, and no export to count hosts of.
    for state in ["serving", "waiting", "error"] {
        assert_eq!(
            sample(&first, "blockplane_exports", &[("state", state)]),
            Some(0.0),
            "{text}"
        );
    }
    for state in ["connecting", "attached", "reconnecting", "error", "moved"] {
        assert_eq!(
            sample(&first, "blockplane_remote_volumes", &[("state", state)]),
            Some(0.0),
            "{text}"
        );
    }
    assert_eq!(
        sample(&first, "blockplane_export_hosts_connected", &[]),
        None,
        "{text}"
    );
    assert_eq!(
        sample(&first, "blockplane_image_size_bytes", &[("image", "m-img")]),
        Some((8 << 20) as f64)
    );
    assert!(
        sample(&first, "blockplane_volume_kernel_avg_latency_seconds", &l).is_some(),
        "{text}"
    );
    assert!(
        sample(
            &first,
            "blockplane_api_requests_total",
            &[
                ("route", "/v1/volumes"),
                ("method", "POST"),
                ("status", "201")
            ]
        )
        .is_some(),
        "{text}"
    );
    let sets = label_sets(&first);

    // A restart: the device keeps its counters (a loop device's live in the
    // kernel; the service's own, a ublk worker's, are checked in the VM by
    // ublk::worker_counters_in_metrics_survive_a_worker_crash_and_a_restart),
    // the labels stay the same.
    s.kill();
    std::fs::write(&dev, vec![8u8; 1 << 20]).unwrap();
    s.restart().await;
    eventually(
        Duration::from_secs(30),
        "the restarted sampler to read the volume",
        async || {
            let (_, p) = scrape(&s).await;
            sample(&p, "blockplane_volume_bytes_total", &l).is_some()
        },
    )
    .await;
    let (text, second) = scrape(&s).await;
    let after =
        sample(&second, "blockplane_volume_bytes_total", &l).unwrap_or_else(|| panic!("{text}"));
    assert!(
        after >= written + (1 << 20) as f64,
        "counters never go backwards: {written} then {after}"
    );
    assert_eq!(
        label_sets(&second),
        sets,
        "label sets are stable across a restart"
    );
}

/// Waits until the sampler has read volume `name` once: its stats carry
/// rates from then on (ending at a reading made when asked).
async fn sampled(s: &Service, name: &str) {
    let path = format!("/v1/volumes/{name}/stats");
    eventually(Duration::from_secs(30), "a first sample", async || {
        s.get(&path).await.body["rates"].is_object()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_carry_rates_once_sampled() {
    let s = Service::start().await;
    let v = s.loop_volume("r", 8).await;
    let dev = v["device"].as_str().unwrap().to_string();
    sampled(&s, "r").await;
    std::fs::write(&dev, vec![1u8; 4 << 20]).unwrap();
    let st = s.get("/v1/volumes/r/stats").await;
    assert_eq!(st.status, StatusCode::OK);
    let r = &st.body["rates"];
    assert!(r.is_object(), "{}", st.body);
    assert!(
        r["last_10s"]["write"]["bytes_per_sec"].as_f64().unwrap() > 0.0,
        "{}",
        st.body
    );
    assert!(r["last_60s"]["window_secs"].as_f64().unwrap() > 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn history_keeps_each_second_with_rates_and_the_kernels_latency() {
    let s = Service::start().await;
    let v = s.loop_volume("h", 8).await;
    let attached = std::time::Instant::now();
    let dev = v["device"].as_str().unwrap().to_string();
    sampled(&s, "h").await;
    // The last close of the device writes its dirty pages back.
    std::fs::write(&dev, vec![1u8; 4 << 20]).unwrap();
    let mut found = Value::Null;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let h = s.get("/v1/volumes/h/stats/history?seconds=10").await;
        assert_eq!(h.status, StatusCode::OK, "{}", h.body);
        assert_eq!(h.body["name"], "h");
        assert_eq!(h.body["kept_secs"], 900);
        let points = h.body["points"].as_array().unwrap().clone();
        assert!(points.len() <= 10, "at most the seconds asked: {}", h.body);
        let times: Vec<&str> = points.iter().map(|p| p["at"].as_str().unwrap()).collect();
        assert!(
            times.windows(2).all(|w| w[0] < w[1]),
            "oldest first: {times:?}"
        );
        // A point spans the time between two readings: a second on an idle
        // host, more or less on a loaded one (a stalled sampler reads late,
        // then on its next second), never more than the volume has lived.
        let lived = attached.elapsed().as_secs_f64();
        for p in &points {
            let secs = p["secs"].as_f64().unwrap();
            assert!(
                secs > 0.0 && secs < lived,
                "a point spans two readings: {p}"
            );
        }
        if let Some(p) = points
            .iter()
            .find(|p| p["write"]["bytes_per_sec"].as_f64().unwrap() > 0.0)
        {
            found = p.clone();
            break;
        }
    }
    assert!(found.is_object(), "the write shows in the history");
    let lat = found["write"]["latency_us"].as_f64();
    assert!(
        lat.is_some_and(|l| l > 0.0),
        "a loop volume's latency comes from the kernel's time in queue: {found}"
    );
    assert_eq!(
        found["read"]["latency_us"],
        Value::Null,
        "no reads, no latency: {found}"
    );

    for (q, status, code) in [
        (
            "seconds=0",
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
        ),
        (
            "seconds=901",
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
        ),
        ("secs=5", StatusCode::BAD_REQUEST, "invalid_query"),
    ] {
        let a = s.get(&format!("/v1/volumes/h/stats/history?{q}")).await;
        assert_eq!(a.status, status, "{q}: {}", a.body);
        assert_eq!(a.body["error"]["code"], code, "{q}: {}", a.body);
    }
    let a = s.get("/v1/volumes/nope/stats/history").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.body);
}

/// Metric names an expression in `text` uses: `blockplane_...` words, without
/// the suffixes the exposition adds to a family's name.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("blockplane_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let mut name = &tail[..end];
        for suffix in ["_total", "_bucket", "_sum", "_count"] {
            name = name.strip_suffix(suffix).unwrap_or(name);
        }
        out.insert(name.to_string());
        rest = &tail[end..];
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_grafana_dashboard_and_the_alerts_name_only_metrics_the_service_exports() {
    // With a backup target and a backup done: the backup metrics too.
    let target = tempfile::tempdir().unwrap();
    let s = Service::start_with(crate::harness::Opts {
        extra_args: vec![
            "--backup-target".into(),
            target.path().display().to_string(),
        ],
        ..Default::default()
    })
    .await;
    s.loop_volume("g", 8).await;
    s.image("bk", 4).await;
    crate::backups::backup(&s, "bk", "one").await;
    let text = s.get_text("/metrics").await;
    // The host's latency histogram is always there (empty without ublk
    // volumes); each volume's buckets come where asked, and the same
    // families do (loop volumes have no histograms).
    assert!(
        text.contains("# TYPE blockplane_latency_seconds histogram"),
        "{text}"
    );
    let asked = s.get_text("/metrics?volume_histograms=true").await;
    assert_eq!(
        metric_names(&asked),
        metric_names(&text),
        "the same families with every volume's buckets"
    );
    let a = s.get("/metrics?histograms=true").await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.body);
    assert_eq!(a.body["error"]["code"], "invalid_query", "{}", a.body);
    let exported: BTreeSet<String> = parse(&text)
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect();
    let root = repo();
    for file in [
        "deploy/grafana/blockplane.json",
        "deploy/prometheus/alerts.yaml",
    ] {
        let body = std::fs::read_to_string(root.join(file)).unwrap();
        let used = metric_names(&body);
        assert!(used.len() >= 5, "{file} names metrics: {used:?}");
        let unknown: Vec<&String> = used.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics the service does not export: {unknown:?} (exported: {exported:?})"
        );
    }
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/blockplane.json")).unwrap(),
    )
    .unwrap();
    let titles: Vec<&str> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for want in ["IOPS", "Bandwidth", "Latency", "NOWAIT", "errors", "API"] {
        assert!(
            titles.iter().any(|t| t.contains(want)),
            "a panel for {want}: {titles:?}"
        );
    }
}

/// Reads `len` bytes of `path` through the page cache, as `blkid` or a
/// buffered `dd` of a device does.
fn buffered_read(path: &str, len: usize) {
    use std::io::Read;
    let mut buf = vec![0u8; len];
    std::fs::File::open(path)
        .unwrap()
        .read_exact(&mut buf)
        .unwrap();
}

fn page_cache(st: &Value, what: &str) -> u64 {
    st["page_cache"][what]
        .as_u64()
        .unwrap_or_else(|| panic!("page_cache.{what}: {st}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn page_cache_of_a_direct_io_volume_is_shown_warned_and_dropped_at_attach() {
    let s = Service::start().await;
    let v = s.loop_volume("pc", 32).await;
    assert_eq!(
        v["direct_io"], true,
        "a loop volume on the test's filesystem does direct I/O: {v}"
    );
    let dev = v["device"].as_str().unwrap().to_string();
    let img = s.get("/v1/images/pc-img").await.body;
    let path = img["path"].as_str().unwrap().to_string();
    let st = s.get("/v1/volumes/pc/stats").await.body;
    assert!(
        page_cache(&st, "device_bytes") < 1 << 20,
        "clean after attach: {st}"
    );
    // The kernel drops a device's cache when its last opener closes it: a
    // user that keeps it open (a VM, a long fio run) is what lets a probe's
    // or an operator's buffered reads stay behind.
    let holder = std::fs::File::open(&dev).unwrap();
    // An operator's buffered reads of the device and of the image.
    buffered_read(&dev, 16 << 20);
    buffered_read(&path, 16 << 20);
    let st = s.get("/v1/volumes/pc/stats").await.body;
    assert!(page_cache(&st, "device_bytes") >= 15 << 20, "{st}");
    assert!(page_cache(&st, "image_bytes") >= 15 << 20, "{st}");
    // The sampler's check (every 10 s): the warning, one event, the gauges.
    eventually(
        Duration::from_secs(40),
        "the page-cache warning",
        async || {
            let v = s.get("/v1/volumes/pc").await.body;
            v["warnings"].as_array().is_some_and(|w| {
                w.iter()
                    .any(|w| w.as_str().unwrap().contains("page cache holds"))
            })
        },
    )
    .await;
    let id = v["id"].as_str().unwrap();
    let events = s.get(&format!("/v1/events?volume={id}")).await.body;
    let warned: Vec<&Value> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "volume_page_cache")
        .collect();
    assert_eq!(warned.len(), 1, "{events}");
    let msg = warned[0]["message"].as_str().unwrap();
    assert!(msg.contains("volume 'pc'") && msg.contains(&dev), "{msg}");
    let (text, p) = scrape(&s).await;
    let l = [("volume", "pc")];
    assert!(
        sample(&p, "blockplane_volume_page_cache_device_bytes", &l)
            .is_some_and(|b| b >= (15 << 20) as f64),
        "{text}"
    );
    assert!(
        sample(&p, "blockplane_volume_page_cache_image_bytes", &l)
            .is_some_and(|b| b >= (15 << 20) as f64),
        "{text}"
    );

    // A new attach of the image drops what an earlier user left of it.
    drop(holder);
    assert_eq!(s.delete("/v1/volumes/pc").await.status.as_u16(), 204);
    buffered_read(&path, 16 << 20);
    let a = s
        .post(
            "/v1/volumes",
            serde_json::json!({"name": "pc", "image": "pc-img", "backend": "loop"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let st = s.get("/v1/volumes/pc/stats").await.body;
    assert!(
        page_cache(&st, "image_bytes") < 1 << 20,
        "dropped at attach: {st}"
    );
    assert!(page_cache(&st, "device_bytes") < 1 << 20, "{st}");
    assert!(
        a.body["warnings"].as_array().unwrap().is_empty(),
        "{}",
        a.body
    );
}

/// The supervisor of ublk workers runs from the start, and when it cannot
/// (its thread fails to start, under test fault `fail_supervisor_start`
/// while `<data dir>/run/supervisor-gate` exists) `GET /v1/host` and
/// `/metrics` say so and why, and it is started again once it can. No
/// ublk is needed: the supervisor starts with the service.
#[tokio::test(flavor = "multi_thread")]
async fn the_host_and_metrics_say_whether_the_worker_supervisor_runs() {
    use std::os::unix::fs::DirBuilderExt;
    let s = Service::start_with(Default::default()).await;
    let host = s.get("/v1/host").await.body;
    assert_eq!(host["supervision"]["state"], "running", "{host}");
    assert_eq!(host["supervision"]["reason"], Value::Null, "{host}");
    let (_, parsed) = scrape(&s).await;
    assert_eq!(
        sample(&parsed, "blockplane_worker_supervisor_running", &[]),
        Some(1.0)
    );
    assert_eq!(
        sample(&parsed, "blockplane_workers_unsupervised", &[]),
        Some(0.0)
    );
    drop(s);

    let mut gate = None;
    let s = Service::start_prepared(
        crate::harness::Opts {
            env: vec![(
                "BLOCKPLANE_TEST_FAULT".into(),
                "fail_supervisor_start".into(),
            )],
            ..Default::default()
        },
        |data| {
            let run = data.join("run");
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&run)
                .unwrap();
            let g = run.join("supervisor-gate");
            std::fs::write(&g, b"").unwrap();
            gate = Some(g);
        },
    )
    .await;
    let host = s.get("/v1/host").await.body;
    let sup = &host["supervision"];
    assert_eq!(sup["state"], "restarting", "{host}");
    assert!(
        sup["reason"]
            .as_str()
            .is_some_and(|r| r.contains("could not start")),
        "{host}"
    );
    let (text, parsed) = scrape(&s).await;
    assert_eq!(
        sample(&parsed, "blockplane_worker_supervisor_running", &[]),
        Some(0.0),
        "{text}"
    );
    eventually(Duration::from_secs(20), "a start tried again", async || {
        let (_, parsed) = scrape(&s).await;
        sample(&parsed, "blockplane_worker_supervisor_restarts_total", &[])
            .is_some_and(|n| n >= 2.0)
    })
    .await;
    assert!(
        s.log_text()
            .contains("the worker supervisor could not start"),
        "{}",
        s.log_text()
    );
    std::fs::remove_file(gate.unwrap()).unwrap();
    eventually(Duration::from_secs(20), "the supervisor runs", async || {
        s.get("/v1/host").await.body["supervision"]["state"] == "running"
    })
    .await;
    let (text, parsed) = scrape(&s).await;
    assert_eq!(
        sample(&parsed, "blockplane_worker_supervisor_running", &[]),
        Some(1.0),
        "{text}"
    );
}
