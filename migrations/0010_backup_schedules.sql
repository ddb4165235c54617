-- Step 27: backup schedules. An image backed up on a cron schedule, its
-- backups pruned by a retention policy (NULL: none) after each run. The
-- image is named by id without a foreign key: a schedule outlives a
-- forgotten image, and its runs fail naming it until it is deleted.
CREATE TABLE backup_schedules (
    id              TEXT PRIMARY KEY NOT NULL,
    name            TEXT NOT NULL UNIQUE,
    image_id        TEXT NOT NULL,
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
    created_at      TEXT NOT NULL
);
