-- Step 27: standby images. A standby holds the bytes of one backup of an
-- image of another host (its source, `standby_of`: that image's id as the
-- target's manifests name it) and follows that image's newer backups,
-- applying only the chunks that changed. `restored_from` names the backup it
-- holds once it is `ready`; `standby_held` keeps that backup's manifest,
-- since the next apply is a difference against it and the source's
-- retention may delete it from the target meanwhile. Activation clears both:
-- the image is then an ordinary one.
ALTER TABLE images ADD COLUMN standby_of TEXT;

CREATE TABLE standby_held (
    image_id TEXT PRIMARY KEY NOT NULL REFERENCES images (id) ON DELETE CASCADE,
    manifest TEXT NOT NULL
);
