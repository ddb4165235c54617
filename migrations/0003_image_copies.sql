-- Snapshots and clones: an image made from another one. `snapshot_of` is the
-- source of a read-only snapshot, `cloned_from` the source of a writable
-- clone (both keep the source's id after it is forgotten); `method` says how
-- the bytes were made (`reflink`: extents shared; `copy`: copied in the
-- background). `state` is `copying` while a copy runs, `failed` when it
-- could not finish (`state_reason` says why; its partial file is removed),
-- else `ready`. Only a `ready` image gets volumes.
ALTER TABLE images ADD COLUMN snapshot_of TEXT;
ALTER TABLE images ADD COLUMN cloned_from TEXT;
ALTER TABLE images ADD COLUMN read_only INTEGER NOT NULL DEFAULT 0;
ALTER TABLE images ADD COLUMN method TEXT CHECK (method IN ('reflink', 'copy'));
ALTER TABLE images ADD COLUMN state TEXT NOT NULL DEFAULT 'ready'
    CHECK (state IN ('ready', 'copying', 'failed'));
ALTER TABLE images ADD COLUMN state_reason TEXT;
CREATE INDEX images_snapshot_of ON images (snapshot_of);
