-- Volumes that leave their host (NVMe/TCP through the kernel's own target
-- and initiator).

-- This service as an NVMe host: the NQN and host id it connects with, made
-- once and kept (the kernel refuses one NQN with two ids). The id is a
-- random UUID (version 4 bits set).
INSERT INTO meta (key, value)
    SELECT 'host_id', id FROM (
        SELECT lower(substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-4' || substr(h, 14, 3) || '-'
               || substr('89ab', 1 + (abs(random()) % 4), 1) || substr(h, 18, 3) || '-'
               || substr(h, 21, 12)) AS id
        FROM (SELECT hex(randomblob(16)) AS h));
INSERT INTO meta (key, value)
    SELECT 'host_nqn', 'nqn.2014-08.org.nvmexpress:uuid:' || value FROM meta WHERE key = 'host_id';

-- Hosts allowed to connect to this service's exports, with their
-- DH-HMAC-CHAP keys: the kernel keeps one entry per host NQN, so one pair
-- of keys per host, whatever it is allowed to. The keys are secrets: this
-- file is the service's (0600 in a 0700 data dir) and they leave it only
-- into configfs and, once, in the answer to the grant.
CREATE TABLE export_hosts (
    host_nqn    TEXT PRIMARY KEY NOT NULL,
    key         TEXT NOT NULL,
    ctrl_key    TEXT NOT NULL,
    created_at  TEXT NOT NULL
);

-- Exports: one NVMe subsystem per volume.
CREATE TABLE exports (
    volume_id   TEXT PRIMARY KEY NOT NULL REFERENCES volumes (id) ON DELETE RESTRICT,
    nqn         TEXT NOT NULL UNIQUE,
    read_only   INTEGER NOT NULL,
    auth        TEXT NOT NULL CHECK (auth IN ('dhchap', 'none')),
    state       TEXT NOT NULL CHECK (state IN ('serving', 'waiting', 'error')),
    state_reason TEXT,
    created_at  TEXT NOT NULL
);

-- Which hosts each export allows.
CREATE TABLE export_grants (
    volume_id   TEXT NOT NULL REFERENCES exports (volume_id) ON DELETE CASCADE,
    host_nqn    TEXT NOT NULL REFERENCES export_hosts (host_nqn) ON DELETE RESTRICT,
    PRIMARY KEY (volume_id, host_nqn)
);

-- Remote volumes: another host's export, connected here. The keys are
-- kept to connect again after a reboot.
CREATE TABLE remotes (
    id          TEXT PRIMARY KEY NOT NULL,
    name        TEXT NOT NULL UNIQUE,
    address     TEXT NOT NULL,
    nqn         TEXT NOT NULL,
    secret      TEXT,
    ctrl_secret TEXT,
    read_only   INTEGER NOT NULL,
    state       TEXT NOT NULL
                CHECK (state IN ('connecting', 'attached', 'reconnecting', 'error')),
    state_reason TEXT,
    attachment  TEXT,
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL
);
