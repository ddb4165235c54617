-- Step 26: a remote volume's data moves to this host while its consumer
-- keeps its device. A remote volume whose data moved here is 'moved'
-- (SQLite cannot change a CHECK in place, so its table is rebuilt), and
-- each move is recorded: what it copies into, who to tell at its end, and
-- where it is.

CREATE TABLE remotes_next (
    id          TEXT PRIMARY KEY NOT NULL,
    name        TEXT NOT NULL UNIQUE,
    address     TEXT NOT NULL,
    nqn         TEXT NOT NULL,
    secret      TEXT,
    ctrl_secret TEXT,
    read_only   INTEGER NOT NULL,
    state       TEXT NOT NULL
                CHECK (state IN ('connecting', 'attached', 'reconnecting', 'error', 'moved')),
    state_reason TEXT,
    attachment  TEXT,
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL
);
INSERT INTO remotes_next SELECT id, name, address, nqn, secret, ctrl_secret, read_only, state,
    state_reason, attachment, created_at, updated_at FROM remotes;
DROP TABLE remotes;
ALTER TABLE remotes_next RENAME TO remotes;

-- Moves outlive their remote volume's row (their history stays), so
-- remote_id is not a foreign key.
CREATE TABLE moves (
    id                TEXT PRIMARY KEY NOT NULL,
    remote_id         TEXT NOT NULL,
    remote_name       TEXT NOT NULL,
    image             TEXT NOT NULL,
    path              TEXT NOT NULL,
    volume_id         TEXT,
    source_api        TEXT NOT NULL,
    source_volume     TEXT NOT NULL,
    keep_source_image INTEGER NOT NULL,
    rate_limit        INTEGER NOT NULL CHECK (rate_limit >= 0),
    state             TEXT NOT NULL
                      CHECK (state IN ('syncing', 'releasing', 'done', 'cancelled', 'failed')),
    state_reason      TEXT,
    synced_bytes      INTEGER NOT NULL,
    total_bytes       INTEGER NOT NULL,
    rate              INTEGER NOT NULL,
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL,
    finished_at       TEXT
);
-- One running move per remote volume, decided by the registry.
CREATE UNIQUE INDEX moves_running ON moves (remote_id)
    WHERE state IN ('syncing', 'releasing');

-- What the host orchestrating a move of an exported volume last said of it
-- (JSON: the move's id, that host's NQN, its state and progress): the
-- exporting host shows it with the export.
ALTER TABLE exports ADD COLUMN moving TEXT;
