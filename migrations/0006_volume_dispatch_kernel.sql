-- A volume may ask for dispatch `kernel` by name (dm: a linear table over a
-- private loop device, no worker), at create or by PATCH, as the API and the
-- CSI driver take it: the CHECK on the requested `dispatch` lists every
-- policy the API spells (`DispatchPolicy`). Before, a PATCH to `kernel`
-- moved the device and then failed to record it.

-- SQLite cannot change a CHECK: the table is made again, as in 0004.
CREATE TABLE volumes_new (
    id              TEXT PRIMARY KEY NOT NULL,
    name            TEXT NOT NULL UNIQUE,
    image_id        TEXT NOT NULL REFERENCES images (id) ON DELETE RESTRICT,
    spec            TEXT NOT NULL,
    backend         TEXT NOT NULL CHECK (backend IN ('loop', 'ublk', 'dm')),
    dispatch        TEXT NOT NULL
                    CHECK (dispatch IN ('auto', 'nowait', 'threaded', 'direct', 'kernel')),
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
                         state_reason, attachment, created_at, updated_at, crypt)
    SELECT id, name, image_id, spec, backend, dispatch, read_only, qos, state,
           state_reason, attachment, created_at, updated_at, crypt
    FROM volumes;
DROP TABLE volumes;
ALTER TABLE volumes_new RENAME TO volumes;
CREATE INDEX volumes_image ON volumes (image_id);
