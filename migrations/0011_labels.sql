-- Step 27: labels on images, and backup schedules that name their images
-- by a selector of labels instead of one image.
--
-- An image's labels, a JSON object of strings ('{}': none).
ALTER TABLE images ADD COLUMN labels TEXT NOT NULL DEFAULT '{}';

-- A schedule names one image (image_id) or a selector (a JSON object of
-- labels every image it backs up has); never both, never neither. SQLite
-- cannot drop a NOT NULL, so the table is made again. A selector's run
-- backs its images up one after another: `pending` holds the ids still to
-- do (a JSON array), `run_done`, `run_failed` and `run_skipped` count
-- what the run's backups came to so far.
CREATE TABLE backup_schedules_new (
    id              TEXT PRIMARY KEY NOT NULL,
    name            TEXT NOT NULL UNIQUE,
    image_id        TEXT,
    selector        TEXT,
    cron            TEXT NOT NULL,
    retention       TEXT,
    enabled         INTEGER NOT NULL CHECK (enabled IN (0, 1)),
    spread_secs     INTEGER NOT NULL CHECK (spread_secs >= 0),
    next_run_at     TEXT NOT NULL,
    last_run_at     TEXT,
    last_backup_id  TEXT,
    last_result     TEXT CHECK (last_result IN ('running', 'done', 'failed', 'skipped')),
    last_message    TEXT,
    last_success_at TEXT,
    failures        INTEGER NOT NULL DEFAULT 0 CHECK (failures >= 0),
    created_at      TEXT NOT NULL,
    pending         TEXT NOT NULL DEFAULT '[]',
    run_done        INTEGER NOT NULL DEFAULT 0 CHECK (run_done >= 0),
    run_failed      INTEGER NOT NULL DEFAULT 0 CHECK (run_failed >= 0),
    run_skipped     INTEGER NOT NULL DEFAULT 0 CHECK (run_skipped >= 0),
    CHECK ((image_id IS NULL) <> (selector IS NULL))
);
INSERT INTO backup_schedules_new (id, name, image_id, cron, retention, enabled, spread_secs,
                                  next_run_at, last_run_at, last_backup_id, last_result,
                                  last_message, last_success_at, failures, created_at)
    SELECT id, name, image_id, cron, retention, enabled, spread_secs, next_run_at,
           last_run_at, last_backup_id, last_result, last_message, last_success_at,
           failures, created_at
    FROM backup_schedules;
DROP TABLE backup_schedules;
ALTER TABLE backup_schedules_new RENAME TO backup_schedules;
