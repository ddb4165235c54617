//! Standby images: a second service (its own data dir and registry) on the
//! same backup target keeps an image that follows another service's image
//! through its backups, fetching only what changed and holding one whole
//! backup at every moment, until it is activated and takes a volume.

use std::time::Duration;

use hyper::StatusCode;
use serde_json::{Value, json};

use crate::backups::{S3Service, backup, dir_target, image_with, service_to, write_pattern};
use crate::eventually;
use crate::harness::{Service, assert_error};
use blockplane_test_support::s3::S3Server as S3;

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 4 * MIB;
/// A condition ends every wait long before.
const WAIT: Duration = Duration::from_secs(300);

/// Makes `name` on `s` a standby of image `source`, and waits for its
/// first copy: its view, ready.
async fn standby(s: &Service, name: &str, source: &str) -> Value {
    let path = s.images.join(format!("{name}.img"));
    let a = s
        .post(
            "/v1/images",
            json!({"name": name, "path": path, "standby_of": source}),
        )
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(a.body["state"], "copying", "{}", a.body);
    let mut last = Value::Null;
    eventually(WAIT, &format!("standby {name}'s first copy"), async || {
        last = s.get(&format!("/v1/images/{name}")).await.body;
        last["state"] != "copying"
    })
    .await;
    assert_eq!(last["state"], "ready", "{last}\n{}", s.log_text());
    last
}

/// Tells standby `name` to check now, then waits until it holds backup
/// `id` with no apply running: its view.
async fn follows_to(s: &Service, name: &str, id: &Value) -> Value {
    let c = s
        .post(&format!("/v1/images/{name}/standby/check"), json!({}))
        .await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);
    let mut last = Value::Null;
    eventually(
        WAIT,
        &format!("standby {name} to hold backup {id}"),
        async || {
            last = s.get(&format!("/v1/images/{name}")).await.body;
            last["standby"]["backup_id"] == *id && last["standby"]["applying"] == false
        },
    )
    .await;
    last
}

/// The `standby_applied` events' messages, oldest first.
async fn applied(s: &Service) -> Vec<String> {
    s.get("/v1/events?limit=1000")
        .await
        .body
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "standby_applied")
        .map(|e| e["message"].as_str().unwrap().to_string())
        .collect()
}

fn bytes_of(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[tokio::test]
async fn a_standby_follows_five_backups_byte_for_byte_and_activates_into_a_volume() {
    let t = dir_target();
    let target = t.path().to_str().unwrap();
    let a = service_to(target, &[]).await;
    let b = service_to(target, &[]).await;
    let src = image_with(&a, "db", 40 * MIB, &[(0, 3 * CHUNK), (6 * CHUNK, CHUNK)], 3).await;
    let one = backup(&a, "db", "one").await;
    let moment = bytes_of(&src);

    let s = standby(&b, "db-standby", "db").await;
    let path = std::path::PathBuf::from(s["path"].as_str().unwrap());
    assert_eq!(s["standby"]["backup_id"], one["id"], "{s}");
    assert_eq!(s["standby"]["source_image_name"], "db", "{s}");
    assert!(
        bytes_of(&path) == moment,
        "the first copy differs from backup one"
    );

    // Four more backups, each changing the image otherwise: a chunk
    // overwritten, a new chunk, a chunk zeroed (a hole in the next
    // backup), and a grow with data in the new range.
    for name in ["two", "three", "four", "five"] {
        match name {
            "two" => write_pattern(&src, &[(CHUNK + 512, 4096)], 5),
            "three" => write_pattern(&src, &[(8 * CHUNK, CHUNK)], 6),
            "four" => {
                let f = std::fs::OpenOptions::new().write(true).open(&src).unwrap();
                std::os::unix::fs::FileExt::write_all_at(&f, &vec![0; CHUNK as usize], 0).unwrap();
                f.sync_all().unwrap();
            }
            _ => {
                let r = a
                    .post("/v1/images/db/resize", json!({"size_bytes": 48 * MIB}))
                    .await;
                assert_eq!(r.status, StatusCode::OK, "{}", r.body);
                write_pattern(&src, &[(44 * MIB, MIB)], 7);
            }
        }
        let next = backup(&a, "db", name).await;
        let moment = bytes_of(&src);
        let s = follows_to(&b, "db-standby", &next["id"]).await;
        assert_eq!(s["standby"]["behind_bytes"], 0, "{s}");
        assert_eq!(s["size_bytes"], moment.len() as u64, "{s}");
        let got = bytes_of(&path);
        let first = got.iter().zip(&moment).position(|(a, b)| a != b);
        assert!(
            got == moment,
            "the standby differs from backup {name}: first at {first:?}, lengths {} and {}",
            got.len(),
            moment.len(),
        );
    }
    // Only what changed was fetched: one chunk per backup, none for the
    // zeroed one.
    let fetched = applied(&b).await;
    assert_eq!(fetched.len(), 4, "{fetched:?}");
    for (msg, chunks) in fetched.iter().zip([1, 1, 0, 1]) {
        assert!(msg.contains(&format!(": {chunks} chunks (")), "{msg}");
    }

    // Until activated it takes nothing that would change its bytes.
    let v = b
        .post(
            "/v1/volumes",
            json!({"name": "v", "image": "db-standby", "backend": "loop"}),
        )
        .await;
    assert_error(&v, 409, "image_is_standby");
    let bk = b
        .post("/v1/images/db-standby/backups", json!({"name": "x"}))
        .await;
    assert_error(&bk, 409, "image_is_standby");
    let g = b
        .post(
            "/v1/images/db-standby/resize",
            json!({"size_bytes": 64 * MIB}),
        )
        .await;
    assert_error(&g, 409, "image_is_standby");
    let m = b.get_text("/metrics").await;
    assert!(
        m.contains("blockplane_standby_lag_seconds{image=\"db-standby\"}")
            && m.contains("blockplane_standby_behind_bytes{image=\"db-standby\"} 0"),
        "{m}"
    );
    let not = a.post("/v1/images/db/activate", json!({})).await;
    assert_error(&not, 409, "not_a_standby");

    let started = std::time::Instant::now();
    let act = b.post("/v1/images/db-standby/activate", json!({})).await;
    assert_eq!(act.status, StatusCode::OK, "{}", act.body);
    assert_eq!(act.body["backup_name"], "five", "{}", act.body);
    let activated = started.elapsed();
    assert!(act.body["image"]["standby"].is_null(), "{}", act.body);
    let v = b
        .post(
            "/v1/volumes",
            json!({"name": "v", "image": "db-standby", "backend": "loop"}),
        )
        .await;
    assert_eq!(v.status, StatusCode::CREATED, "{}", v.body);
    // Measured, not asserted: what "in seconds" comes to.
    eprintln!(
        "STANDBY-ACTIVATION: activated in {:.3} s, a volume on it {:.3} s later",
        activated.as_secs_f64(),
        (started.elapsed() - activated).as_secs_f64()
    );
    let again = b.post("/v1/images/db-standby/activate", json!({})).await;
    assert_error(&again, 409, "not_a_standby");
}

/// Nobody tells it: the follower looks at the target on its own, every
/// `--standby-check-secs`, and applies the newer backup it finds.
#[tokio::test]
async fn the_follower_finds_and_applies_a_newer_backup_on_its_own() {
    let t = dir_target();
    let target = t.path().to_str().unwrap();
    let a = service_to(target, &[]).await;
    let b = service_to(target, &[("BLOCKPLANE_STANDBY_CHECK_SECS", "1")]).await;
    let src = image_with(&a, "db", 16 * MIB, &[(0, CHUNK)], 3).await;
    backup(&a, "db", "one").await;
    let s = standby(&b, "db-standby", "db").await;
    let path = std::path::PathBuf::from(s["path"].as_str().unwrap());
    write_pattern(&src, &[(2 * CHUNK, 4096)], 4);
    let two = backup(&a, "db", "two").await;
    let mut last = Value::Null;
    eventually(WAIT, "the follower to apply backup two", async || {
        last = b.get("/v1/images/db-standby").await.body;
        last["standby"]["backup_id"] == two["id"] && last["standby"]["applying"] == false
    })
    .await;
    assert!(last["standby"]["checked_at"].is_string(), "{last}");
    assert!(
        bytes_of(&path) == bytes_of(&src),
        "the standby differs from backup two"
    );
}

#[tokio::test]
async fn a_standby_killed_mid_apply_or_activated_by_force_holds_one_whole_backup() {
    let t = dir_target();
    let target = t.path().to_str().unwrap();
    let a = service_to(target, &[]).await;
    let mut b = service_to(target, &[("BLOCKPLANE_TEST_FAULT", "slow_copy")]).await;
    let src = image_with(&a, "db", 48 * MIB, &[(0, 8 * CHUNK)], 3).await;
    backup(&a, "db", "one").await;
    let one = bytes_of(&src);
    let s = standby(&b, "db-standby", "db").await;
    let path = std::path::PathBuf::from(s["path"].as_str().unwrap());
    write_pattern(&src, &[(0, 8 * CHUNK)], 4);
    let two = backup(&a, "db", "two").await;
    let moment_two = bytes_of(&src);

    // Killed while its journal is written (held at the copy gate after its
    // first chunk): the file was never touched.
    let gate = b.shut_copy_gate();
    let c = b
        .post("/v1/images/db-standby/standby/check", json!({}))
        .await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);
    eventually(WAIT, "the apply to fetch a chunk", async || {
        b.get("/v1/images/db-standby").await.body["copied_bytes"]
            .as_u64()
            .unwrap_or(0)
            > 0
    })
    .await;
    b.kill();
    b.spawn(&[("BLOCKPLANE_TEST_FAULT", "slow_copy")]);
    b.wait_ready().await;
    let s = b.get("/v1/images/db-standby").await.body;
    assert_eq!(s["standby"]["backup_name"], "one", "{s}");
    assert!(bytes_of(&path) == one, "a killed apply left a mix");
    let kinds: Vec<String> = b
        .get("/v1/events?limit=1000")
        .await
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect();
    assert!(
        kinds.iter().any(|k| k == "standby_apply_dropped"),
        "{kinds:?}"
    );

    // The restarted service's follower applies backup two again, held at
    // the gate. Activation refuses while it runs; forced, it stops the
    // apply, and the image holds backup one, whole.
    let _ = b
        .post("/v1/images/db-standby/standby/check", json!({}))
        .await;
    eventually(WAIT, "the apply to run again", async || {
        let s = b.get("/v1/images/db-standby").await.body;
        s["standby"]["applying"] == true && s["copied_bytes"].as_u64().unwrap_or(0) > 0
    })
    .await;
    let busy = b.post("/v1/images/db-standby/activate", json!({})).await;
    assert_error(&busy, 409, "standby_applying");
    let act = b
        .post("/v1/images/db-standby/activate", json!({"force": true}))
        .await;
    assert_eq!(act.status, StatusCode::OK, "{}", act.body);
    assert_eq!(act.body["stopped_apply"], true, "{}", act.body);
    assert_eq!(act.body["backup_name"], "one", "{}", act.body);
    assert!(
        bytes_of(&path) == one,
        "the activated image is not backup one"
    );

    // A second standby, the gate open, follows to backup two.
    std::fs::remove_file(&gate).unwrap();
    let s2 = standby(&b, "db-standby-2", "db").await;
    assert_eq!(s2["standby"]["backup_id"], two["id"], "{s2}");
    let p2 = std::path::PathBuf::from(s2["path"].as_str().unwrap());
    assert!(
        bytes_of(&p2) == moment_two,
        "the second standby is not backup two"
    );
}

#[tokio::test]
async fn a_standby_follows_through_s3_compatible_storage() {
    let s3 = S3::start();
    let (a, _ca) = s3.service("dr", &s3.secret_access_key, &[], &[]).await;
    let (b, _cb) = s3.service("dr", &s3.secret_access_key, &[], &[]).await;
    let src = image_with(&a, "db", 24 * MIB, &[(0, 4 * CHUNK)], 9).await;
    backup(&a, "db", "one").await;
    let s = standby(&b, "db-standby", "db").await;
    let path = std::path::PathBuf::from(s["path"].as_str().unwrap());
    assert!(bytes_of(&path) == bytes_of(&src), "the first copy differs");
    write_pattern(&src, &[(2 * CHUNK, 512)], 2);
    let two = backup(&a, "db", "two").await;
    follows_to(&b, "db-standby", &two["id"]).await;
    assert!(
        bytes_of(&path) == bytes_of(&src),
        "the standby differs from backup two"
    );
    let fetched = applied(&b).await;
    assert!(fetched[0].contains(": 1 chunks ("), "{fetched:?}");
    let act = b.post("/v1/images/db-standby/activate", json!({})).await;
    assert_eq!(act.status, StatusCode::OK, "{}", act.body);
    assert_eq!(act.body["backup_id"], two["id"], "{}", act.body);
}

/// A week of nightly backups on one service, pruned to the last two, and a
/// standby on another that checks every other night: it is one backup
/// behind after each night, two on the nights it skips, and then the
/// backup it holds is one the source's retention has deleted from the
/// target. It still fetches only what changed (it keeps the manifest of
/// the backup it holds) and matches the source byte for byte.
#[tokio::test]
async fn a_standby_keeps_up_through_a_week_of_pruned_nightly_backups() {
    use crate::schedules::{Clock, run_at};
    let clock = Clock::at("2026-03-01T00:00:00Z");
    let t = dir_target();
    let target = t.path().to_str().unwrap();
    let a = service_to(target, &[("BLOCKPLANE_TEST_CLOCK", clock.path())]).await;
    // This standby looks only when told: the nights it skips are the
    // test's, not the follower's interval's.
    let b = service_to(
        target,
        &[
            ("BLOCKPLANE_TEST_CLOCK", clock.path()),
            ("BLOCKPLANE_STANDBY_CHECK_SECS", "0"),
        ],
    )
    .await;
    let src = image_with(&a, "db", 32 * MIB, &[(0, 2 * CHUNK)], 1).await;
    let s = a
        .post(
            "/v1/backup-schedules",
            json!({"name": "nightly", "image": "db", "cron": "0 3 * * *",
                   "retention": {"keep_last": 2}}),
        )
        .await;
    assert_eq!(s.status, StatusCode::CREATED, "{}", s.body);
    let mut path = None;
    let mut held: Option<Value> = None;
    for day in 1..=7u8 {
        // Each night a different chunk changes.
        write_pattern(&src, &[(u64::from(day) * CHUNK, 4096)], day);
        let at = format!("2026-03-{day:02}T03:10:00Z");
        clock.set(&at);
        let run = run_at(&a, "nightly", &at).await;
        assert_eq!(run["last_run"]["result"], "done", "{run}");
        let newest = run["last_run"]["backup_id"].clone();
        let moment = bytes_of(&src);
        if day == 1 {
            let s = standby(&b, "db-standby", "db").await;
            path = Some(std::path::PathBuf::from(s["path"].as_str().unwrap()));
            held = Some(newest);
            continue;
        }
        if day % 2 == 1 && day < 7 {
            continue;
        }
        let was = held.take().unwrap();
        if day % 2 == 0 && day >= 4 {
            // Two nights behind: the source's retention deleted it.
            let gone = a
                .get(&format!("/v1/backups/{}", was.as_str().unwrap()))
                .await;
            assert_error(&gone, 404, "backup_not_found");
        }
        let s = follows_to(&b, "db-standby", &newest).await;
        assert_eq!(s["standby"]["behind_bytes"], 0, "{s}");
        assert!(
            bytes_of(path.as_ref().unwrap()) == moment,
            "the standby differs from night {day}'s backup"
        );
        held = Some(newest);
    }
    // Each apply fetched only the chunks that changed since the one held:
    // one a night.
    let fetched = applied(&b).await;
    assert_eq!(fetched.len(), 4, "{fetched:?}");
    for (msg, chunks) in fetched.iter().zip([1, 2, 2, 1]) {
        assert!(msg.contains(&format!(": {chunks} chunks (")), "{msg}");
    }
}
