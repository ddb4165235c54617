//! Backup schedules on a clock the test moves (`BLOCKPLANE_TEST_CLOCK`, a
//! test build's): runs at their times, ten days of them pruned by a
//! retention policy with each kept backup restoring byte-equal, the runs a
//! stopped service missed made once at its start, and the refusals; a
//! schedule that names its images by labels.

use std::time::Duration;

use hyper::StatusCode;
use serde_json::{Value, json};

use crate::backups::{dir_target, image_with, restore, service_to, write_pattern};
use crate::eventually;
use crate::harness::{Service, assert_error};

const MIB: u64 = 1 << 20;

/// Each wait ends when the schedule's run is recorded, a second or two on
/// the service's clock tick; this bounds a loaded machine.
const WAIT: Duration = Duration::from_secs(120);

/// The service's clock: a file holding an RFC 3339 time.
pub(crate) struct Clock(tempfile::NamedTempFile);

impl Clock {
    pub(crate) fn at(t: &str) -> Self {
        let c = Self(tempfile::NamedTempFile::new().unwrap());
        c.set(t);
        c
    }

    pub(crate) fn set(&self, t: &str) {
        // Written whole and renamed over: the service never reads half a time.
        let tmp = self.0.path().with_extension("new");
        std::fs::write(&tmp, t).unwrap();
        std::fs::rename(&tmp, self.0.path()).unwrap();
    }

    pub(crate) fn path(&self) -> &str {
        self.0.path().to_str().unwrap()
    }
}

/// Waits until schedule `name`'s last run started at `at` and ended; its
/// view.
pub(crate) async fn run_at(s: &Service, name: &str, at: &str) -> Value {
    let mut last = Value::Null;
    eventually(WAIT, &format!("{name}'s run at {at}"), async || {
        last = s.get(&format!("/v1/backup-schedules/{name}")).await.body;
        last["last_run"]["at"] == at && last["last_run"]["result"] != "running"
    })
    .await;
    last
}

/// The names in a list answer, in its order.
fn names(l: &Value) -> Vec<String> {
    l.as_array()
        .unwrap_or_else(|| panic!("{l}"))
        .iter()
        .map(|b| b["name"].as_str().unwrap().to_string())
        .collect()
}

/// The names of image `image`'s backups, oldest first.
async fn backup_names(s: &Service, image: &str) -> Vec<String> {
    names(&s.get(&format!("/v1/backups?image={image}")).await.body)
}

/// A service backing up to a new directory target on a clock at March
/// 1st, 2026, 00:00 UTC: the clock, the target, the service.
async fn on_a_clock() -> (Clock, tempfile::TempDir, Service) {
    let clock = Clock::at("2026-03-01T00:00:00Z");
    let t = dir_target();
    let s = service_to(
        t.path().to_str().unwrap(),
        &[("BLOCKPLANE_TEST_CLOCK", clock.path())],
    )
    .await;
    (clock, t, s)
}

#[tokio::test]
async fn ten_days_of_runs_keep_what_the_policy_says_and_a_stopped_service_runs_once() {
    let (clock, _target, mut s) = on_a_clock().await;
    let path = image_with(&s, "w", 16 * MIB, &[(0, 8 * MIB)], 2).await;

    // Refused, each changing nothing.
    for (body, status, code) in [
        (
            json!({"name": "n", "image": "w", "cron": "0 25 * * *"}),
            422,
            "invalid_cron",
        ),
        (
            json!({"name": "n", "image": "w", "cron": "0 3 30 2 *"}),
            422,
            "invalid_cron",
        ),
        (
            json!({"name": "n", "image": "w", "cron": "@daily", "retention": {}}),
            422,
            "retention_keeps_nothing",
        ),
        (
            json!({"name": "n", "image": "nobody", "cron": "@daily"}),
            404,
            "image_not_found",
        ),
    ] {
        let a = s.post("/v1/backup-schedules", body.clone()).await;
        assert_error(&a, status, code);
    }
    assert_eq!(s.get("/v1/backup-schedules").await.body, json!([]));
    let a = s.get("/v1/backup-schedules/nightly").await;
    assert_error(&a, 404, "schedule_not_found");

    let a = s
        .post(
            "/v1/backup-schedules",
            json!({"name": "nightly", "image": "w", "cron": "0 3 * * *",
                   "retention": {"keep_daily": 3, "keep_weekly": 2}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let spread = a.body["spread_secs"].as_u64().unwrap();
    assert!(spread <= 300, "{}", a.body);
    assert_eq!(a.body["period_secs"], 86400, "{}", a.body);
    let next = time::OffsetDateTime::parse(
        a.body["next_run_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert_eq!(
        next.unix_timestamp(),
        time::macros::datetime!(2026-03-01 03:00 UTC).unix_timestamp() + spread as i64,
        "{}",
        a.body
    );
    let again = s
        .post(
            "/v1/backup-schedules",
            json!({"name": "nightly", "image": "w", "cron": "@daily"}),
        )
        .await;
    assert_error(&again, 409, "name_taken");

    // Ten nights, March 1st (a Sunday) to the 10th (a Tuesday), each of
    // the image as that day left it. 03:10 is past the spread.
    let mut moments = Vec::new();
    for day in 1..=10u8 {
        write_pattern(&path, &[(8 * MIB, 4 * MIB)], 2 * day + 2);
        let at = format!("2026-03-{day:02}T03:10:00Z");
        clock.set(&at);
        let v = run_at(&s, "nightly", &at).await;
        assert_eq!(v["last_run"]["result"], "done", "{v}");
        assert_eq!(v["consecutive_failures"], 0, "{v}");
        // The run names its backup once it has ended.
        let last = backup_names(&s, "w").await;
        let backup = s
            .get(&format!("/v1/backups/{}", last.last().unwrap()))
            .await
            .body;
        assert_eq!(v["last_run"]["backup_id"], backup["id"], "{v}");
        moments.push(std::fs::read(&path).unwrap());
    }
    // Daily 3: the 10th, 9th, 8th. Weekly 2: ISO week 11 (9th-15th) and
    // week 10 (2nd-8th) are kept already; week 9 (the 1st) is the one left.
    let kept = [1u8, 8, 9, 10];
    let name = |day: u8| format!("nightly-202603{day:02}t031000z");
    assert_eq!(
        backup_names(&s, "w").await,
        kept.iter().map(|d| name(*d)).collect::<Vec<_>>()
    );
    for day in kept {
        let r = restore(&s, &name(day), &format!("r{day}")).await;
        assert!(
            std::fs::read(&r).unwrap() == moments[usize::from(day) - 1],
            "the backup of March {day} restored wrong"
        );
    }
    let metrics = s.get_text("/metrics").await;
    assert!(
        metrics.contains("blockplane_backup_schedule_period_seconds{schedule=\"nightly\"} 86400"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("blockplane_backup_schedule_last_success_age_seconds{schedule=\"nightly\"}"),
        "{metrics}"
    );

    // Stopped from the 10th to the 14th: one run at the start, not four.
    s.kill();
    clock.set("2026-03-14T12:00:00Z");
    s.restart().await;
    let v = run_at(&s, "nightly", "2026-03-14T12:00:00Z").await;
    assert_eq!(v["last_run"]["result"], "done", "{v}");
    assert_eq!(v["consecutive_failures"], 0, "{v}");
    let events = s.get("/v1/events?limit=1000").await.body;
    let runs = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "backup_schedule_started")
        .count();
    assert_eq!(runs, 11, "ten nights and one run for the four missed");
    // The prune after it: the 14th is the newest day, in week 11 with
    // the 9th and 10th.
    let mut kept: Vec<String> = [1u8, 8, 9, 10].iter().map(|d| name(*d)).collect();
    kept.push("nightly-20260314t120000z".into());
    assert_eq!(backup_names(&s, "w").await, kept);
    assert!(
        v["next_run_at"]
            .as_str()
            .unwrap()
            .starts_with("2026-03-15T03:0"),
        "{v}"
    );

    // Paused, it does not run; deleted, its backups stay.
    let a = s
        .patch("/v1/backup-schedules/nightly", json!({"enabled": false}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    clock.set("2026-03-16T03:10:00Z");
    let before = backup_names(&s, "w").await;
    let a = s.delete("/v1/backup-schedules/nightly").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.body);
    assert_eq!(backup_names(&s, "w").await, before);
}

/// The names of the images `GET /v1/images?label=` lists for `filter`.
async fn labelled(s: &Service, filter: &str) -> Vec<String> {
    names(&s.get(&format!("/v1/images?label={filter}")).await.body)
}

#[tokio::test]
async fn a_selector_backs_up_each_labelled_image_in_turn_and_prunes_each() {
    let (clock, _target, mut s) = on_a_clock().await;
    let mut paths = Vec::new();
    for (name, seed) in [("a", 2u8), ("b", 4), ("c", 6)] {
        paths.push(image_with(&s, name, 8 * MIB, &[(0, 4 * MIB)], seed).await);
    }
    // Labels at a create, and by a patch that sets and removes.
    let path = s.images.join("d.img");
    let d = s
        .post(
            "/v1/images",
            json!({"name": "d", "path": path, "create": {"size_bytes": MIB},
                   "labels": {"tier": "silver", "team.example/app": "db"}}),
        )
        .await;
    assert_eq!(d.status, StatusCode::CREATED, "{}", d.body);
    assert_eq!(d.body["labels"]["tier"], "silver", "{}", d.body);
    for (image, tier) in [("a", "gold"), ("b", "gold"), ("c", "silver")] {
        let p = s
            .patch(
                &format!("/v1/images/{image}"),
                json!({"labels": {"tier": tier, "old": "x"}}),
            )
            .await;
        assert_eq!(p.status, StatusCode::OK, "{}", p.body);
        let p = s
            .patch(
                &format!("/v1/images/{image}"),
                json!({"labels": {"old": null}}),
            )
            .await;
        assert_eq!(p.body["labels"], json!({"tier": tier}), "{}", p.body);
    }
    assert_eq!(labelled(&s, "tier=gold").await, ["a", "b"]);
    assert_eq!(labelled(&s, "tier").await, ["a", "b", "c", "d"]);
    assert_eq!(labelled(&s, "team.example/app=db").await, ["d"]);

    // Refused, each changing nothing.
    let before = s.get("/v1/images/a").await.body;
    let bad = s
        .patch("/v1/images/a", json!({"labels": {"Tier": "gold"}}))
        .await;
    assert_error(&bad, 422, "invalid_label");
    let bad = s
        .patch("/v1/images/a", json!({"labels": {"tier": "-gold"}}))
        .await;
    assert_error(&bad, 422, "invalid_label");
    let many: serde_json::Map<String, Value> =
        (0..32).map(|i| (format!("k{i}"), json!("v"))).collect();
    let bad = s.patch("/v1/images/a", json!({"labels": many})).await;
    assert_error(&bad, 422, "too_many_labels");
    assert!(
        bad.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'a'"),
        "{}",
        bad.body
    );
    assert_eq!(s.get("/v1/images/a").await.body, before);
    for (body, code) in [
        (
            json!({"name": "g", "image": "a", "selector": {"tier": "gold"}, "cron": "@daily"}),
            "invalid_field",
        ),
        (json!({"name": "g", "cron": "@daily"}), "invalid_field"),
        (
            json!({"name": "g", "selector": {}, "cron": "@daily"}),
            "invalid_field",
        ),
        (
            json!({"name": "g", "selector": {"Tier": "gold"}, "cron": "@daily"}),
            "invalid_label",
        ),
    ] {
        let a = s.post("/v1/backup-schedules", body).await;
        assert_error(&a, 422, code);
    }
    assert_eq!(s.get("/v1/backup-schedules").await.body, json!([]));

    let a = s
        .post(
            "/v1/backup-schedules",
            json!({"name": "gold", "selector": {"tier": "gold"}, "cron": "0 3 * * *",
                   "retention": {"keep_last": 2}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(a.body["selector"], json!({"tier": "gold"}), "{}", a.body);
    assert_eq!(a.body["image_id"], Value::Null, "{}", a.body);
    let nobody = s
        .post(
            "/v1/backup-schedules",
            json!({"name": "bronze", "selector": {"tier": "bronze"}, "cron": "0 3 * * *"}),
        )
        .await;
    assert_eq!(nobody.status, StatusCode::CREATED, "{}", nobody.body);

    // Three nights; c is labelled gold before the third, and its run
    // takes it: the selector is read when a run starts.
    let name = |day: u8| format!("gold-202603{day:02}t031000z");
    for day in 1..=3u8 {
        if day == 3 {
            let p = s
                .patch("/v1/images/c", json!({"labels": {"tier": "gold"}}))
                .await;
            assert_eq!(p.status, StatusCode::OK, "{}", p.body);
        }
        let at = format!("2026-03-{day:02}T03:10:00Z");
        clock.set(&at);
        let v = run_at(&s, "gold", &at).await;
        let images = if day == 3 { 3 } else { 2 };
        assert_eq!(v["last_run"]["result"], "done", "{v}");
        assert_eq!(v["last_run"]["backups_done"], images, "{v}");
        assert_eq!(v["last_run"]["backups_failed"], 0, "{v}");
        assert_eq!(v["last_run"]["images_pending"], 0, "{v}");
        let v = run_at(&s, "bronze", &at).await;
        assert_eq!(v["last_run"]["result"], "skipped", "{v}");
        assert!(
            v["last_run"]["message"]
                .as_str()
                .unwrap()
                .contains("no image has"),
            "{v}"
        );
    }
    // keep_last 2 of each image's own backups.
    for (image, days) in [("a", [2u8, 3].as_slice()), ("b", &[2, 3]), ("c", &[3])] {
        assert_eq!(
            backup_names(&s, image).await,
            days.iter().map(|d| name(*d)).collect::<Vec<_>>(),
            "{image}"
        );
    }
    assert_eq!(backup_names(&s, "d").await, Vec::<String>::new());
    // In turn: each image's backup starts once the one before is done.
    let events = s.get("/v1/events?limit=1000").await.body;
    let steps: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["message"].as_str().unwrap().contains(&name(3)))
        .filter_map(|e| match e["kind"].as_str().unwrap() {
            k @ ("backup_started" | "backup_done") => Some(k),
            _ => None,
        })
        .collect();
    assert_eq!(
        steps,
        ["backup_started", "backup_done"].repeat(3),
        "{events}"
    );
    // Each image's backup has the run's name: by id.
    let cs = s.get("/v1/backups?image=c").await.body;
    let r = restore(&s, cs[0]["id"].as_str().unwrap(), "rc").await;
    assert!(std::fs::read(&r).unwrap() == std::fs::read(&paths[2]).unwrap());

    // Labels are the registry's: a restart keeps them.
    s.kill();
    s.restart().await;
    assert_eq!(labelled(&s, "tier=gold").await, ["a", "b", "c"]);
}
