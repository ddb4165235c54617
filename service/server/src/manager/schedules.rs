//! Backup schedules: an image backed up at the times of a cron expression
//! (UTC), each run a backup as `POST /v1/images/{id}/backups` makes, its
//! backups pruned by the schedule's retention policy once the run's backup
//! is done.
//!
//! The follower ([`Backups::run_schedules`], each second) starts the runs
//! that are due and follows the one running. A run is due at its cron time
//! plus the schedule's spread (a fixed offset, so that schedules of one time
//! do not all start together); the next is the cron's first time after the
//! run started, so the runs a stopped service missed are one run at its
//! start, not one per miss. A run whose image has a backup running already
//! is skipped; one that cannot start, or whose backup fails, counts a
//! failure. Times come from the manager's clock, which a test moves.

use croner::Cron;
use time::{Duration, OffsetDateTime};
use uuid::Uuid;

use super::backups::retention_of;
use super::error::{Error, Result};
use super::labels::check_labels;
use super::target::Backups;
use crate::store::{RunCounts, ScheduleRow, ScheduleTarget};
use blockplane_api::model::{
    self, BackupSchedule, BackupState, CreateBackupScheduleRequest, PatchBackupScheduleRequest,
    ScheduleRun, ScheduleRunResult, selects,
};

/// The longest spread of a schedule's runs after its cron times.
const MAX_SPREAD_SECS: u64 = 300;

/// A schedule's cron expression, parsed.
struct Times {
    cron: Cron,
    /// The schedule's name and the expression, for its errors.
    schedule: String,
    text: String,
}

impl Times {
    /// `cron` of schedule `schedule`, or why it is not a cron expression
    /// with a time after `now` (the manager's clock, as every time here).
    fn parse(schedule: &str, cron: &str, now: OffsetDateTime) -> Result<Self> {
        let times = Self {
            cron: cron.parse().map_err(|e: croner::errors::CronError| {
                Self::invalid(schedule, cron, e.to_string())
            })?,
            schedule: schedule.to_string(),
            text: cron.to_string(),
        };
        // An expression that never matches (Feb 30) has no next time.
        times.next_run(0, now)?;
        Ok(times)
    }

    fn invalid(schedule: &str, cron: &str, reason: String) -> Error {
        Error::InvalidCron {
            schedule: schedule.to_string(),
            cron: cron.to_string(),
            reason,
        }
    }

    /// Its first time strictly after `t`.
    fn after(&self, t: OffsetDateTime) -> Option<OffsetDateTime> {
        let from = chrono::DateTime::from_timestamp(t.unix_timestamp(), 0)?;
        let next = self.cron.find_next_occurrence(&from, false).ok()?;
        OffsetDateTime::from_unix_timestamp(next.timestamp()).ok()
    }

    /// When the schedule runs next, from `now`: its next time, plus its
    /// spread.
    fn next_run(&self, spread_secs: u32, now: OffsetDateTime) -> Result<OffsetDateTime> {
        let at = self.after(now).ok_or_else(|| {
            Self::invalid(
                &self.schedule,
                &self.text,
                "it matches no time after now".into(),
            )
        })?;
        Ok(at + Duration::seconds(i64::from(spread_secs)))
    }

    /// The time between its next two times after `t`: its period.
    fn period(&self, t: OffsetDateTime) -> Duration {
        match self.after(t).and_then(|a| Some((a, self.after(a)?))) {
            Some((a, b)) => b - a,
            None => Duration::ZERO,
        }
    }
}

/// The fixed offset of schedule `id`'s runs after their cron times: up to
/// [`MAX_SPREAD_SECS`], a tenth of its period at most, from its id (so the
/// same after every restart).
fn spread(id: Uuid, period: Duration) -> u32 {
    let cap = (period.whole_seconds().max(0) as u64 / 10).min(MAX_SPREAD_SECS);
    let seed = u64::from_le_bytes(id.as_bytes()[..8].try_into().expect("8 bytes"));
    (seed % (cap + 1)) as u32
}

/// A run's backup name: the schedule's and the UTC time, as the backup
/// names' pattern takes them (`nightly-20261207t030000z`).
fn backup_name(schedule: &str, at: OffsetDateTime) -> String {
    let at = at.to_offset(time::UtcOffset::UTC);
    format!(
        "{schedule}-{:04}{:02}{:02}t{:02}{:02}{:02}z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    )
}

/// Keeps what a run's step came to as its message: the first failure's
/// once there is one (the reason an operator needs), else the latest.
fn note(row: &mut ScheduleRow, failed: bool, text: String) {
    let first_failure = failed && row.run.failed == 1;
    if first_failure || row.run.failed == 0 {
        row.last_message = Some(text);
    }
}

/// How a run whose backups came to `run` ended.
fn run_result(run: RunCounts) -> ScheduleRunResult {
    if run.failed > 0 {
        ScheduleRunResult::Failed
    } else if run.done > 0 {
        ScheduleRunResult::Done
    } else {
        ScheduleRunResult::Skipped
    }
}

/// Whether `name` is a schedule's name: `[a-z0-9][a-z0-9-]{0,39}`.
fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 40
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

impl Backups {
    /// A schedule's view, its image's name looked up.
    async fn schedule_view(&self, row: &ScheduleRow) -> Result<BackupSchedule> {
        let (image_id, selector) = match &row.target {
            ScheduleTarget::Image(id) => (Some(*id), None),
            ScheduleTarget::Selector(s) => (None, Some(s.clone())),
        };
        let image = match image_id {
            Some(id) => self.house().store.image(&id.to_string()).await?,
            None => None,
        };
        let now = self.house().settings.clock.now();
        let period = Times::parse(&row.name, &row.cron, now)
            .map(|t| t.period(now))
            .unwrap_or(Duration::ZERO);
        Ok(BackupSchedule {
            id: row.id,
            name: row.name.clone(),
            image_id,
            image_name: image.map(|i| i.name),
            selector,
            cron: row.cron.clone(),
            retention: row.retention,
            enabled: row.enabled,
            next_run_at: row.next_run_at,
            spread_secs: row.spread_secs,
            period_secs: period.whole_seconds().max(0) as u64,
            last_run: row.last_run_at.map(|at| ScheduleRun {
                at,
                backup_id: row.last_backup_id,
                result: row.last_result.unwrap_or(ScheduleRunResult::Failed),
                message: row.last_message.clone(),
                backups_done: row.run.done,
                backups_failed: row.run.failed,
                backups_skipped: row.run.skipped,
                images_pending: row.pending.len() as u32,
            }),
            last_success_at: row.last_success_at,
            consecutive_failures: row.failures,
            created_at: row.created_at,
        })
    }

    async fn schedule_row(&self, id_or_name: &str) -> Result<ScheduleRow> {
        self.house()
            .store
            .schedule(id_or_name)
            .await?
            .ok_or_else(|| Error::ScheduleNotFound(id_or_name.to_string()))
    }

    /// `POST /v1/backup-schedules`.
    pub(crate) async fn create_schedule(
        &self,
        req: &CreateBackupScheduleRequest,
    ) -> Result<BackupSchedule> {
        if !valid_name(&req.name) {
            return Err(Error::InvalidField {
                field: "name",
                reason: format!(
                    "'{}' is not [a-z0-9][a-z0-9-]{{0,39}} (a schedule's name)",
                    req.name
                ),
            });
        }
        let (target, what) = match (&req.image, &req.selector) {
            (Some(image), None) => {
                let image = self.house().image_row(image).await?;
                (
                    ScheduleTarget::Image(image.id),
                    format!("image '{}'", image.name),
                )
            }
            (None, Some(selector)) if !selector.is_empty() => {
                let owner = format!("backup schedule '{}'", req.name);
                check_labels(&owner, selector)?;
                (
                    ScheduleTarget::Selector(selector.clone()),
                    format!(
                        "the images labelled {}",
                        blockplane_api::model::labels_text(selector)
                    ),
                )
            }
            (image, _) => {
                return Err(Error::InvalidField {
                    field: if image.is_some() { "selector" } else { "image" },
                    reason: format!(
                        "backup schedule '{}' names its images by one of \"image\" or a non-empty \"selector\", not both or neither",
                        req.name
                    ),
                });
            }
        };
        let times = Times::parse(&req.name, &req.cron, self.house().settings.clock.now())?;
        if let Some(r) = &req.retention {
            retention_of(&format!("backup schedule '{}' of {what}", req.name), r)?;
        }
        self.backup_target("schedule backups")?;
        let _one = self.state.schedules.lock().await;
        if let Some(taken) = self.house().store.schedule(&req.name).await? {
            return Err(Error::ScheduleNameTaken {
                name: req.name.clone(),
                id: taken.id,
            });
        }
        let now = self.house().settings.clock.now();
        let id = Uuid::new_v4();
        let spread_secs = spread(id, times.period(now));
        let row = ScheduleRow {
            id,
            name: req.name.clone(),
            target,
            cron: req.cron.clone(),
            retention: req.retention,
            enabled: req.enabled,
            spread_secs,
            next_run_at: times.next_run(spread_secs, now)?,
            last_run_at: None,
            last_backup_id: None,
            last_result: None,
            last_message: None,
            last_success_at: None,
            failures: 0,
            created_at: now,
            pending: Vec::new(),
            run: RunCounts::default(),
        };
        let mut tx = self.house().store.begin().await?;
        tx.put_schedule(&row).await?;
        tx.event(
            None,
            row.target.image(),
            "backup_schedule_created",
            &format!(
                "{what}: backup schedule '{}' made ({}), next run at {}",
                row.name,
                row.cron,
                crate::store::ts(row.next_run_at)
            ),
        )
        .await?;
        tx.commit().await?;
        self.schedule_view(&row).await
    }

    /// `GET /v1/backup-schedules`.
    pub(crate) async fn schedules(&self) -> Result<Vec<BackupSchedule>> {
        let mut out = Vec::new();
        for row in self.house().store.schedules().await? {
            out.push(self.schedule_view(&row).await?);
        }
        Ok(out)
    }

    /// `GET /v1/backup-schedules/{id}`.
    pub(crate) async fn schedule(&self, id_or_name: &str) -> Result<BackupSchedule> {
        let row = self.schedule_row(id_or_name).await?;
        self.schedule_view(&row).await
    }

    /// `PATCH /v1/backup-schedules/{id}`: a new cron or a schedule resumed
    /// runs next at the cron's next time from now.
    pub(crate) async fn patch_schedule(
        &self,
        id_or_name: &str,
        req: &PatchBackupScheduleRequest,
    ) -> Result<BackupSchedule> {
        let _one = self.state.schedules.lock().await;
        let mut row = self.schedule_row(id_or_name).await?;
        let cron = req.cron.clone().unwrap_or_else(|| row.cron.clone());
        let times = Times::parse(&row.name, &cron, self.house().settings.clock.now())?;
        if let Some(r) = &req.retention {
            retention_of(&format!("backup schedule '{}'", row.name), r)?;
        }
        let resumed = req.enabled == Some(true) && !row.enabled;
        if cron != row.cron || resumed {
            row.next_run_at = times.next_run(row.spread_secs, self.house().settings.clock.now())?;
        }
        row.cron = cron;
        if let Some(r) = req.retention {
            row.retention = Some(r);
        }
        if let Some(enabled) = req.enabled {
            row.enabled = enabled;
        }
        let mut tx = self.house().store.begin().await?;
        tx.put_schedule(&row).await?;
        tx.event(
            None,
            row.target.image(),
            "backup_schedule_changed",
            &format!(
                "backup schedule '{}': {} ({}), next run at {}",
                row.name,
                if row.enabled { "runs" } else { "paused" },
                row.cron,
                crate::store::ts(row.next_run_at)
            ),
        )
        .await?;
        tx.commit().await?;
        self.schedule_view(&row).await
    }

    /// `DELETE /v1/backup-schedules/{id}`: its backups stay, a running one
    /// runs on.
    pub(crate) async fn delete_schedule(&self, id_or_name: &str) -> Result<()> {
        let _one = self.state.schedules.lock().await;
        let row = self.schedule_row(id_or_name).await?;
        let mut tx = self.house().store.begin().await?;
        tx.delete_schedule(row.id).await?;
        tx.event(
            None,
            row.target.image(),
            "backup_schedule_deleted",
            &format!("backup schedule '{}' deleted; its backups stay", row.name),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Starts every schedule's run that is due, and follows each run's
    /// backup to its end (then the prune): once; the sampler calls it each
    /// second. Nothing without a backup target.
    pub(crate) async fn run_schedules(&self) -> Result<()> {
        if self.state.target.is_none() {
            return Ok(());
        }
        let _one = self.state.schedules.lock().await;
        for row in self.house().store.schedules().await? {
            let now = self.house().settings.clock.now();
            if row.last_result == Some(ScheduleRunResult::Running) {
                self.follow_run(row, now).await?;
            } else if row.enabled && row.next_run_at <= now {
                self.start_run(row, now).await?;
            }
        }
        Ok(())
    }

    /// Starts schedule `row`'s run at `now`: its images listed (its one
    /// image, or those its selector names now, by name), then the first
    /// one's backup.
    async fn start_run(&self, mut row: ScheduleRow, now: OffsetDateTime) -> Result<()> {
        let times = Times::parse(&row.name, &row.cron, now)?;
        row.pending = match &row.target {
            ScheduleTarget::Image(id) => vec![*id],
            ScheduleTarget::Selector(selector) => self
                .house()
                .store
                .images()
                .await?
                .into_iter()
                .filter(|i| selects(selector, &i.labels))
                .map(|i| i.id)
                .collect(),
        };
        row.run = RunCounts::default();
        row.last_run_at = Some(now);
        // Running from its first record: a reader never sees this run's
        // time with the last run's result.
        row.last_result = Some(ScheduleRunResult::Running);
        row.last_backup_id = None;
        row.last_message = None;
        row.next_run_at = times.next_run(row.spread_secs, now)?;
        let mut tx = self.house().store.begin().await?;
        tx.put_schedule(&row).await?;
        tx.event(
            None,
            row.target.image(),
            "backup_schedule_started",
            &format!(
                "backup schedule '{}': a run of {} image(s) starts; next run at {}",
                row.name,
                row.pending.len(),
                crate::store::ts(row.next_run_at)
            ),
        )
        .await?;
        tx.commit().await?;
        self.next_backup(row, now).await
    }

    /// Starts the backup of the run's next image that has none running;
    /// ends the run when none is left.
    async fn next_backup(&self, mut row: ScheduleRow, now: OffsetDateTime) -> Result<()> {
        while !row.pending.is_empty() {
            let image = row.pending.remove(0);
            let name = backup_name(&row.name, now);
            match self.backup_image(&image.to_string(), &name).await {
                Ok(b) => {
                    row.last_backup_id = Some(b.id);
                    let mut tx = self.house().store.begin().await?;
                    tx.put_schedule(&row).await?;
                    tx.commit().await?;
                    return Ok(());
                }
                Err(e @ Error::BackupRunning { .. }) => {
                    row.run.skipped += 1;
                    note(&mut row, false, e.to_string());
                }
                Err(e) => {
                    row.run.failed += 1;
                    note(&mut row, true, e.to_string());
                }
            }
        }
        self.end_run(row, now).await
    }

    /// Follows the backup of schedule `row`'s running run: at its end, the
    /// image's prune, then the run's next image.
    async fn follow_run(&self, mut row: ScheduleRow, now: OffsetDateTime) -> Result<()> {
        let Some(id) = row.last_backup_id else {
            return self.next_backup(row, now).await;
        };
        match self.backup(&id.to_string()).await {
            Ok(b) if b.state == BackupState::Running => return Ok(()),
            Ok(b) if b.state == BackupState::Done => {
                row.run.done += 1;
                let text = match row.retention {
                    None => format!("backup '{}' done", b.name),
                    Some(retention) => {
                        let req = model::PruneBackupsRequest {
                            retention,
                            dry_run: false,
                        };
                        match self.prune_backups(&b.image_id.to_string(), &req).await {
                            Ok(p) => format!(
                                "backup '{}' done; the prune kept {} and deleted {}",
                                b.name,
                                p.kept.len(),
                                p.deleted.len()
                            ),
                            Err(e) => format!("backup '{}' done; the prune failed: {e}", b.name),
                        }
                    }
                };
                note(&mut row, false, text);
            }
            Ok(b) => {
                row.run.failed += 1;
                let text = format!(
                    "backup '{}' {}: {}",
                    b.name,
                    b.state.as_str(),
                    b.error.as_deref().unwrap_or("no reason given")
                );
                note(&mut row, true, text);
            }
            Err(Error::BackupNotFound(_)) => {
                row.run.failed += 1;
                note(
                    &mut row,
                    true,
                    format!(
                        "backup {id} is gone: the service stopped before it was done, or it was deleted"
                    ),
                );
            }
            // The target cannot say now: the next look.
            Err(e) => return Err(e),
        }
        self.next_backup(row, now).await
    }

    /// Records schedule `row`'s run as ended, with the event its result
    /// names: `failed` when one of its backups failed (counting toward the
    /// failures in a row), `done` when one was done, else `skipped`.
    async fn end_run(&self, mut row: ScheduleRow, now: OffsetDateTime) -> Result<()> {
        let result = run_result(row.run);
        row.last_result = Some(result);
        let kind = match result {
            ScheduleRunResult::Failed => {
                row.failures += 1;
                "backup_schedule_failed"
            }
            ScheduleRunResult::Done => {
                row.failures = 0;
                row.last_success_at = Some(now);
                "backup_schedule_done"
            }
            ScheduleRunResult::Skipped | ScheduleRunResult::Running => "backup_schedule_skipped",
        };
        let total = row.run.done + row.run.failed + row.run.skipped;
        let what = match (&row.target, row.last_message.as_deref()) {
            (ScheduleTarget::Selector(_), _) if total == 0 => {
                "no image has its selector's labels".to_string()
            }
            (ScheduleTarget::Image(_), Some(m)) => m.to_string(),
            (_, m) => format!(
                "{} done, {} failed, {} skipped{}",
                row.run.done,
                row.run.failed,
                row.run.skipped,
                m.map(|m| format!("; {m}")).unwrap_or_default()
            ),
        };
        row.last_message = Some(what);
        let message = format!(
            "backup schedule '{}': {}; next run at {}",
            row.name,
            row.last_message.as_deref().unwrap_or_default(),
            crate::store::ts(row.next_run_at)
        );
        if result == ScheduleRunResult::Failed {
            tracing::warn!(schedule = %row.name, "{message}");
        }
        let mut tx = self.house().store.begin().await?;
        tx.put_schedule(&row).await?;
        tx.event(None, row.target.image(), kind, &message).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Each schedule's name, seconds since its last success (or since it
    /// was made, when none), period and failures since, for `GET /metrics`.
    pub(super) async fn schedule_samples(&self) -> Result<Vec<crate::metrics::ScheduleSample>> {
        let now = self.house().settings.clock.now();
        Ok(self
            .schedules()
            .await?
            .into_iter()
            .map(|s| crate::metrics::ScheduleSample {
                age_secs: (now - s.last_success_at.unwrap_or(s.created_at))
                    .as_seconds_f64()
                    .max(0.0),
                period_secs: s.period_secs,
                failures: s.consecutive_failures,
                enabled: s.enabled,
                name: s.name,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    const NOW: OffsetDateTime = datetime!(2026-12-07 12:00 UTC);

    #[test]
    fn the_next_time_is_strictly_after_and_in_utc() {
        let t = Times::parse("n", "0 3 * * *", NOW).unwrap();
        assert_eq!(
            t.after(datetime!(2026-12-07 02:59:59 UTC)).unwrap(),
            datetime!(2026-12-07 03:00 UTC)
        );
        assert_eq!(
            t.after(datetime!(2026-12-07 03:00 UTC)).unwrap(),
            datetime!(2026-12-08 03:00 UTC)
        );
        assert_eq!(t.period(datetime!(2026-12-07 00:00 UTC)), Duration::days(1));
        let weekly = Times::parse("w", "@weekly", NOW).unwrap();
        assert_eq!(
            weekly.period(datetime!(2026-12-07 00:00 UTC)),
            Duration::weeks(1)
        );
    }

    #[test]
    fn runs_missed_while_down_are_one_run() {
        // Due at 03:00 on the 1st; the service comes back on the 4th at
        // 12:00: one run now, the next on the 5th.
        let t = Times::parse("n", "0 3 * * *", NOW).unwrap();
        let due = datetime!(2026-12-01 03:00 UTC);
        let back = datetime!(2026-12-04 12:00 UTC);
        assert!(due <= back);
        assert_eq!(
            t.next_run(0, back).unwrap(),
            datetime!(2026-12-05 03:00 UTC)
        );
    }

    #[test]
    fn bad_expressions_are_refused_naming_the_schedule() {
        for bad in ["", "61 * * * *", "* * *", "0 3 30 2 *", "every day"] {
            let e = Times::parse("nightly", bad, NOW).err().unwrap();
            assert!(e.to_string().contains("nightly"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_spread_is_fixed_and_bounded_by_the_period() {
        let id = Uuid::new_v4();
        assert_eq!(spread(id, Duration::days(1)), spread(id, Duration::days(1)));
        for _ in 0..100 {
            let id = Uuid::new_v4();
            assert!(spread(id, Duration::days(1)) <= 300);
            assert!(spread(id, Duration::minutes(1)) <= 6);
        }
    }

    #[test]
    fn backup_names_fit_the_pattern() {
        let name = backup_name(&"a".repeat(40), datetime!(2026-12-07 03:00:05 +02:00));
        assert_eq!(name, format!("{}-20261207t010005z", "a".repeat(40)));
        assert!(name.len() <= 63);
        assert!(valid_name("nightly-1") && !valid_name("Nightly") && !valid_name("-x"));
        assert!(!valid_name(&"a".repeat(41)));
    }
}
