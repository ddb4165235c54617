//! The rows of backup schedules.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;
use time::OffsetDateTime;
use uuid::Uuid;

use super::{Result, Store, WriteTx, enum_from_str, enum_str, from_json, json, parse_ts, ts, uuid};
use blockplane_api::model::{Labels, RetentionPolicy, ScheduleRunResult};

/// What a schedule backs up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScheduleTarget {
    /// One image, by id.
    Image(Uuid),
    /// Every image with all these labels when a run starts.
    Selector(Labels),
}

impl ScheduleTarget {
    /// The image its events are about (none for a selector's).
    pub fn image(&self) -> Option<Uuid> {
        match self {
            ScheduleTarget::Image(id) => Some(*id),
            ScheduleTarget::Selector(_) => None,
        }
    }
}

/// What a run's backups came to so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunCounts {
    pub done: u32,
    pub failed: u32,
    pub skipped: u32,
}

/// A backup schedule as stored.
#[derive(Debug, Clone)]
pub struct ScheduleRow {
    pub id: Uuid,
    pub name: String,
    pub target: ScheduleTarget,
    pub cron: String,
    pub retention: Option<RetentionPolicy>,
    pub enabled: bool,
    pub spread_secs: u32,
    pub next_run_at: OffsetDateTime,
    /// The last run: when it started, its backup, how it ended, why.
    pub last_run_at: Option<OffsetDateTime>,
    pub last_backup_id: Option<Uuid>,
    pub last_result: Option<ScheduleRunResult>,
    pub last_message: Option<String>,
    pub last_success_at: Option<OffsetDateTime>,
    /// Runs failed since the last that succeeded.
    pub failures: u32,
    pub created_at: OffsetDateTime,
    /// The images the run still has to back up, in order.
    pub pending: Vec<Uuid>,
    /// The run's backups so far.
    pub run: RunCounts,
}

impl ScheduleRow {
    fn from_row(r: &SqliteRow) -> Result<Self> {
        let opt_ts = |col: &str| -> Result<Option<OffsetDateTime>> {
            r.try_get::<Option<String>, _>(col)?
                .map(|s| parse_ts(&s))
                .transpose()
        };
        let count = |col: &str| -> Result<u32> {
            Ok(r.try_get::<i64, _>(col)?.clamp(0, i64::from(u32::MAX)) as u32)
        };
        let image: Option<String> = r.try_get("image_id")?;
        let selector: Option<String> = r.try_get("selector")?;
        let target = match (image, selector) {
            (Some(id), _) => ScheduleTarget::Image(uuid("schedule image id", &id)?),
            (None, Some(sel)) => ScheduleTarget::Selector(from_json("schedule selector", &sel)?),
            // The table's CHECK forbids it.
            (None, None) => ScheduleTarget::Selector(Labels::new()),
        };
        Ok(Self {
            id: uuid("schedule id", r.try_get("id")?)?,
            name: r.try_get("name")?,
            target,
            cron: r.try_get("cron")?,
            retention: r
                .try_get::<Option<String>, _>("retention")?
                .map(|s| from_json("schedule retention", &s))
                .transpose()?,
            enabled: r.try_get("enabled")?,
            spread_secs: r
                .try_get::<i64, _>("spread_secs")?
                .clamp(0, i64::from(u32::MAX)) as u32,
            next_run_at: parse_ts(r.try_get("next_run_at")?)?,
            last_run_at: opt_ts("last_run_at")?,
            last_backup_id: r
                .try_get::<Option<String>, _>("last_backup_id")?
                .map(|s| uuid("schedule backup id", &s))
                .transpose()?,
            last_result: r
                .try_get::<Option<String>, _>("last_result")?
                .map(|s| enum_from_str("schedule run result", &s))
                .transpose()?,
            last_message: r.try_get("last_message")?,
            last_success_at: opt_ts("last_success_at")?,
            failures: count("failures")?,
            created_at: parse_ts(r.try_get("created_at")?)?,
            pending: from_json("schedule pending images", r.try_get("pending")?)?,
            run: RunCounts {
                done: count("run_done")?,
                failed: count("run_failed")?,
                skipped: count("run_skipped")?,
            },
        })
    }
}

impl Store {
    /// Every backup schedule, by name.
    pub async fn schedules(&self) -> Result<Vec<ScheduleRow>> {
        sqlx::query("SELECT * FROM backup_schedules ORDER BY name")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(ScheduleRow::from_row)
            .collect()
    }

    /// The schedule of this id or name.
    pub async fn schedule(&self, id_or_name: &str) -> Result<Option<ScheduleRow>> {
        sqlx::query("SELECT * FROM backup_schedules WHERE id = ? OR name = ?")
            .bind(id_or_name)
            .bind(id_or_name)
            .fetch_optional(&self.readers)
            .await?
            .as_ref()
            .map(ScheduleRow::from_row)
            .transpose()
    }
}

impl WriteTx {
    /// Records a schedule, new or changed.
    pub async fn put_schedule(&mut self, s: &ScheduleRow) -> Result<()> {
        let retention = s.retention.as_ref().map(json);
        let (image, selector) = match &s.target {
            ScheduleTarget::Image(id) => (Some(id.to_string()), None),
            ScheduleTarget::Selector(l) => (None, Some(json(l))),
        };
        sqlx::query(
            "INSERT INTO backup_schedules (id, name, image_id, selector, cron, retention, enabled,
                spread_secs, next_run_at, last_run_at, last_backup_id, last_result,
                last_message, last_success_at, failures, created_at, pending, run_done,
                run_failed, run_skipped)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT (id) DO UPDATE SET cron = excluded.cron,
                retention = excluded.retention, enabled = excluded.enabled,
                next_run_at = excluded.next_run_at, last_run_at = excluded.last_run_at,
                last_backup_id = excluded.last_backup_id, last_result = excluded.last_result,
                last_message = excluded.last_message, last_success_at = excluded.last_success_at,
                failures = excluded.failures, pending = excluded.pending,
                run_done = excluded.run_done, run_failed = excluded.run_failed,
                run_skipped = excluded.run_skipped",
        )
        .bind(s.id.to_string())
        .bind(&s.name)
        .bind(image)
        .bind(selector)
        .bind(&s.cron)
        .bind(retention)
        .bind(s.enabled)
        .bind(i64::from(s.spread_secs))
        .bind(ts(s.next_run_at))
        .bind(s.last_run_at.map(ts))
        .bind(s.last_backup_id.map(|b| b.to_string()))
        .bind(s.last_result.map(enum_str))
        .bind(&s.last_message)
        .bind(s.last_success_at.map(ts))
        .bind(i64::from(s.failures))
        .bind(ts(s.created_at))
        .bind(json(&s.pending))
        .bind(i64::from(s.run.done))
        .bind(i64::from(s.run.failed))
        .bind(i64::from(s.run.skipped))
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Deletes a schedule.
    pub async fn delete_schedule(&mut self, id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM backup_schedules WHERE id = ?")
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }
}
