-- Restores: an image made from a backup on the backup target. `restored_from`
-- is the backup's id (a backup may be another host's, so it names no row
-- here). Its file is filled in the background like a copy: `state` is
-- `copying` meanwhile and `failed` when a chunk was missing or corrupt (its
-- partial file removed), so a half-restored image is never `ready`.
ALTER TABLE images ADD COLUMN restored_from TEXT;
