-- Facts about this database itself. `instance` names this service instance in
-- the marks it puts on kernel devices, so two services on one host (each with
-- its own data dir) never take each other's devices for orphans.
CREATE TABLE meta (
    key     TEXT PRIMARY KEY NOT NULL,
    value   TEXT NOT NULL
);
INSERT INTO meta (key, value) VALUES ('instance', lower(hex(randomblob(4))));

-- Images: registered backing files. (dev, ino) is the file's identity, so one
-- file cannot be registered twice under two names or paths.
CREATE TABLE images (
    id          TEXT PRIMARY KEY NOT NULL,
    name        TEXT NOT NULL UNIQUE,
    path        TEXT NOT NULL UNIQUE,
    dev         INTEGER NOT NULL,
    ino         INTEGER NOT NULL,
    size_bytes  INTEGER NOT NULL,
    allocated_bytes INTEGER NOT NULL,
    allocation  TEXT CHECK (allocation IN ('sparse', 'full')),
    filesystem  TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL,
    UNIQUE (dev, ino)
);

-- Volumes: the create request as asked (spec, JSON, normalized, immutable: it
-- decides whether a repeated create is the same), the live settings PATCH
-- changes (dispatch, read_only, qos), and the observed state (state, and
-- attachment: what the backend said of the live device, JSON).
CREATE TABLE volumes (
    id              TEXT PRIMARY KEY NOT NULL,
    name            TEXT NOT NULL UNIQUE,
    image_id        TEXT NOT NULL REFERENCES images (id) ON DELETE RESTRICT,
    spec            TEXT NOT NULL,
    backend         TEXT NOT NULL CHECK (backend IN ('loop', 'ublk', 'dm')),
    dispatch        TEXT NOT NULL CHECK (dispatch IN ('auto', 'nowait', 'threaded', 'direct')),
    read_only       INTEGER NOT NULL,
    qos             TEXT,
    state           TEXT NOT NULL
                    CHECK (state IN ('attaching', 'attached', 'degraded', 'detaching', 'error')),
    state_reason    TEXT,
    attachment      TEXT,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL
);
CREATE INDEX volumes_image ON volumes (image_id);

-- Events: every state change, with time and reason. No foreign keys: the
-- history of a deleted volume or image stays readable.
CREATE TABLE events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at          TEXT NOT NULL,
    volume_id   TEXT,
    image_id    TEXT,
    kind        TEXT NOT NULL,
    message     TEXT NOT NULL
);
CREATE INDEX events_volume ON events (volume_id, id);
CREATE INDEX events_at ON events (at);
