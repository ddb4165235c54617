-- Step 26: cold moves. A move started for another host's volume that no
-- consumer here uses records what it did to that host's export to connect
-- (NULL for a live move of a remote volume): undone if the move stops.
ALTER TABLE moves ADD COLUMN cold TEXT CHECK (cold IN ('made', 'host_added', 'host_allowed'));
