-- Step 26: cold moves and drains. A move started for another host's volume
-- that no consumer here uses records what it did to that host's export to
-- connect (NULL for a live move of a remote volume): undone if the move
-- stops. A drain moves several of a host's volumes at once under one rate
-- limit, shared among its moves that copy.
ALTER TABLE moves ADD COLUMN cold TEXT CHECK (cold IN ('made', 'host_added', 'host_allowed'));

CREATE TABLE drains (
    id          TEXT PRIMARY KEY NOT NULL,
    source_api  TEXT NOT NULL,
    rate_limit  INTEGER NOT NULL CHECK (rate_limit >= 0),
    created_at  TEXT NOT NULL
);
ALTER TABLE moves ADD COLUMN drain_id TEXT REFERENCES drains (id);
