//! Backup schedules (`/v1/backup-schedules`): an image, or every image
//! with some labels, backed up on a cron schedule to the service's backup
//! target, each image's backups pruned by a retention policy after each
//! one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::backup::RetentionPolicy;

/// `POST /v1/backup-schedules`: back an image up on a schedule.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateBackupScheduleRequest {
    /// Its name, unique on this service; each backup it makes is named
    /// `<name>-<UTC time>` (`nightly-20261207t030000z`):
    /// `[a-z0-9][a-z0-9-]{0,39}`
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^[a-z0-9][a-z0-9-]{0,39}$", min_length = 1, max_length = 40)
    )]
    pub name: String,
    /// The image to back up: its id or name. Either this or `selector`.
    #[serde(default)]
    pub image: Option<String>,
    /// Back up every image that has all these labels when a run starts,
    /// one after another (1 to 32 labels, as an image's labels are
    /// spelled). Either this or `image`.
    #[serde(default)]
    pub selector: Option<BTreeMap<String, String>>,
    /// When, in UTC: a cron expression of five fields (minute, hour, day of
    /// month, month, day of week), or `@hourly`, `@daily`, `@weekly`,
    /// `@monthly`, `@yearly`.
    pub cron: String,
    /// What to keep of the image's backups after each run (none: every
    /// backup is kept).
    #[serde(default)]
    pub retention: Option<RetentionPolicy>,
    /// Whether it runs (default true).
    #[serde(default = "yes")]
    pub enabled: bool,
}

fn yes() -> bool {
    true
}

/// `PATCH /v1/backup-schedules/{id}`: what to change; what is left out
/// stays.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PatchBackupScheduleRequest {
    /// A new cron expression (its next run is computed from now).
    #[serde(default)]
    pub cron: Option<String>,
    /// A new retention policy.
    #[serde(default)]
    pub retention: Option<RetentionPolicy>,
    /// Pause (false) or resume (true) it; a resumed schedule runs at its
    /// next time from now, not for what it missed.
    #[serde(default)]
    pub enabled: Option<bool>,
}

/// How a schedule's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ScheduleRunResult {
    /// Its backup runs.
    Running,
    /// Its backup is done (and the prune ran, if the schedule has a policy:
    /// `message` says what it deleted, or why it could not).
    Done,
    /// Its backup could not start, or failed (`message` says why).
    Failed,
    /// Another backup of the image ran: this run made none.
    Skipped,
}

/// A schedule's last run.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ScheduleRun {
    /// When it started (the service's clock).
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub at: OffsetDateTime,
    /// The backup it started last.
    #[serde(default)]
    pub backup_id: Option<Uuid>,
    /// How it ended: `done` when every image's backup was done, `failed`
    /// when one failed or could not start, `skipped` when every image had
    /// a backup running already (or the selector matched none).
    pub result: ScheduleRunResult,
    /// Its images' backups done so far.
    pub backups_done: u32,
    /// Its images' backups that failed or could not start.
    pub backups_failed: u32,
    /// Its images skipped: each had a backup running already.
    pub backups_skipped: u32,
    /// Its images still to back up, after the one running.
    pub images_pending: u32,
    /// What happened, for people.
    #[serde(default)]
    pub message: Option<String>,
}

/// A backup schedule.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BackupSchedule {
    /// Stable id.
    pub id: Uuid,
    /// Its name.
    pub name: String,
    /// The image it backs up (`null` for a selector's schedule).
    #[serde(default)]
    pub image_id: Option<Uuid>,
    /// That image's name (`null` for a selector's schedule, and once the
    /// image is forgotten: its runs fail until the schedule is deleted).
    #[serde(default)]
    pub image_name: Option<String>,
    /// The labels of the images it backs up (`null` for one image's).
    #[serde(default)]
    pub selector: Option<BTreeMap<String, String>>,
    /// Its cron expression.
    pub cron: String,
    /// What it keeps after each run (`null`: every backup).
    #[serde(default)]
    pub retention: Option<RetentionPolicy>,
    /// Whether it runs.
    pub enabled: bool,
    /// When it runs next: the cron's next time plus this schedule's fixed
    /// offset (`spread_secs`). A run missed while the service was down runs
    /// once at its start.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub next_run_at: OffsetDateTime,
    /// Seconds after each cron time it starts, fixed per schedule (up to
    /// 5 minutes, a tenth of its period at most), so that schedules of one
    /// time do not all start together.
    pub spread_secs: u32,
    /// Seconds between two of its cron times (the alert on a schedule that
    /// has not succeeded in twice this reads it).
    pub period_secs: u64,
    /// Its last run.
    #[serde(default)]
    pub last_run: Option<ScheduleRun>,
    /// When a run of it last ended with its backup done.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub last_success_at: Option<OffsetDateTime>,
    /// Runs that failed since the last that succeeded.
    pub consecutive_failures: u32,
    /// When it was made.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
}
