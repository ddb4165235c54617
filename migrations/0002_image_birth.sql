-- no-transaction
-- An image file's identity gains its birth (statx btime, or the inode
-- generation where the filesystem keeps no birth time): a new file that
-- reuses a removed image's inode number is not that image. UNIQUE (dev, ino)
-- becomes UNIQUE (dev, ino, birth), which takes a rebuild of the table
-- (SQLite cannot alter a constraint); foreign keys are off meanwhile so the
-- volumes referencing images keep their rows. Rows from before keep a NULL
-- birth and match on (dev, ino) alone.
PRAGMA foreign_keys = OFF;
BEGIN IMMEDIATE;
CREATE TABLE images_new (
    id          TEXT PRIMARY KEY NOT NULL,
    name        TEXT NOT NULL UNIQUE,
    path        TEXT NOT NULL UNIQUE,
    dev         INTEGER NOT NULL,
    ino         INTEGER NOT NULL,
    birth       TEXT,
    size_bytes  INTEGER NOT NULL,
    allocated_bytes INTEGER NOT NULL,
    allocation  TEXT CHECK (allocation IN ('sparse', 'full')),
    filesystem  TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL,
    UNIQUE (dev, ino, birth)
);
INSERT INTO images_new (id, name, path, dev, ino, birth, size_bytes, allocated_bytes,
                        allocation, filesystem, created_at, updated_at)
    SELECT id, name, path, dev, ino, NULL, size_bytes, allocated_bytes,
           allocation, filesystem, created_at, updated_at FROM images;
DROP TABLE images;
ALTER TABLE images_new RENAME TO images;
COMMIT;
PRAGMA foreign_keys = ON;
