-- Encryption at rest. `images.encryption` is an encrypted image's LUKS2
-- header as the service last read it (JSON: format, cipher, header_bytes,
-- key_slots); NULL for a plain image. `volumes.crypt` is the dm-crypt layer a
-- volume on an encrypted image serves its plaintext through (JSON: name,
-- header_bytes); NULL for a plain one. A volume is `locked` when its
-- backend's device serves but its plaintext device is gone (after a reboot)
-- until its key is given again. No key is ever stored.
ALTER TABLE images ADD COLUMN encryption TEXT;

-- SQLite cannot change a CHECK: the table is made again with `locked`.
CREATE TABLE volumes_new (
    id              TEXT PRIMARY KEY NOT NULL,
    name            TEXT NOT NULL UNIQUE,
    image_id        TEXT NOT NULL REFERENCES images (id) ON DELETE RESTRICT,
    spec            TEXT NOT NULL,
    backend         TEXT NOT NULL CHECK (backend IN ('loop', 'ublk', 'dm')),
    dispatch        TEXT NOT NULL CHECK (dispatch IN ('auto', 'nowait', 'threaded', 'direct')),
    read_only       INTEGER NOT NULL,
    qos             TEXT,
    state           TEXT NOT NULL
                    CHECK (state IN ('attaching', 'attached', 'degraded', 'detaching', 'error',
                                     'locked')),
    state_reason    TEXT,
    attachment      TEXT,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL,
    crypt           TEXT
);
INSERT INTO volumes_new (id, name, image_id, spec, backend, dispatch, read_only, qos, state,
                         state_reason, attachment, created_at, updated_at)
    SELECT id, name, image_id, spec, backend, dispatch, read_only, qos, state,
           state_reason, attachment, created_at, updated_at
    FROM volumes;
DROP TABLE volumes;
ALTER TABLE volumes_new RENAME TO volumes;
CREATE INDEX volumes_image ON volumes (image_id);
