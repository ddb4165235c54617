//! The registry across starts: the mark beside it, the schema check before
//! anything is written, and the copy taken before migrations change it.
//!
//! `blockplane.db` can be lost with no device left to show it (no volume
//! attached): truncated, replaced by an empty file or by another data dir's
//! registry. `registry.mark`, a small file beside it rewritten atomically
//! whenever an image or a volume is added or removed ([`keep_mark`]), names
//! the instance this data dir served and how many rows it held; a start on a
//! registry that holds none of them ([`lost_rows`]) is refused like one with
//! devices left (`ServeError::LostRegistry`).
//!
//! A registry a newer blockplane migrated (an applied migration this build
//! does not have) is refused before anything is written, naming both
//! versions and the way back ([`refuse_newer`]). A registry this build
//! migrates is first copied beside itself, as `blockplane.db.before-NNNN`
//! (NNNN: the first migration it lacked), the newest [`KEPT_COPIES`] kept
//! ([`copy_before_migrating`]).

use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqliteConnectOptions;

use crate::store::{MIGRATOR, Rows, Store, StoreError};

/// The mark's file name, in the data dir.
pub const MARK_FILE: &str = "registry.mark";
/// How many pre-migration copies are kept: the newest.
pub const KEPT_COPIES: usize = 3;

/// Why the registry cannot be served as it is.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A newer blockplane migrated it (a downgrade).
    #[error(
        "the registry {db} has schema version {theirs} ({description}), newer than this blockplane {version} knows (its newest is {ours}): a newer blockplane migrated it. \
         Start that blockplane again; or, to go back to this one, restore {way_back} as {db} (what changed since is lost) and start again. Nothing was changed"
    )]
    Newer {
        /// The registry file.
        db: String,
        /// Its newest applied migration.
        theirs: i64,
        /// That migration's description, as recorded.
        description: String,
        /// This build's newest migration.
        ours: i64,
        /// This build's version.
        version: &'static str,
        /// What to restore.
        way_back: String,
    },
    /// The copy before a migration could not be made.
    #[error("copy the registry {db} to {copy} before migrating it: {source}")]
    Copy {
        /// The registry file.
        db: String,
        /// The copy.
        copy: String,
        /// Why not.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The mark could not be written.
    #[error("registry mark {path}: {source}")]
    Mark {
        /// The mark file.
        path: String,
        /// Why not.
        #[source]
        source: io::Error,
    },
    /// The registry could not be read.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What the mark records of the registry a data dir served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    /// The registry's instance id.
    pub instance: String,
    /// Its images.
    pub images: u64,
    /// Its volumes.
    pub volumes: u64,
}

impl Mark {
    /// The mark in `data_dir`, if there is a readable one.
    pub fn read(data_dir: &Path) -> Option<Mark> {
        let path = data_dir.join(MARK_FILE);
        let text = std::fs::read(&path).ok()?;
        match serde_json::from_slice(&text) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "unreadable registry mark; ignored");
                None
            }
        }
    }

    /// Replaces the mark in `data_dir` (a new file, mode 0600, renamed over
    /// the old one: never half written).
    fn write(&self, data_dir: &Path) -> io::Result<()> {
        let tmp = data_dir.join(format!("{MARK_FILE}.tmp"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec(self).expect("a mark serializes"))?;
        f.sync_all()?;
        std::fs::rename(&tmp, data_dir.join(MARK_FILE))?;
        std::fs::File::open(data_dir)?.sync_all()
    }
}

/// What an existing registry file holds, read without writing to it.
#[derive(Debug, Default)]
pub struct Found {
    /// Its instance id, if it has one.
    pub instance: Option<String>,
    /// Its images and volumes.
    pub rows: Rows,
    /// Its applied migrations: version and description.
    pub applied: Vec<(i64, String)>,
}

/// Reads `db` read-only, leaving every file as it was (a missing or empty
/// file holds nothing).
pub async fn look(db: &Path) -> Result<Found, StoreError> {
    if std::fs::metadata(db).is_err() {
        return Ok(Found::default());
    }
    // With no WAL to read, the database file is the whole registry: read it
    // as immutable, so that SQLite makes no -wal or -shm file beside it.
    let wal = PathBuf::from(format!("{}-wal", db.display()));
    let wal_holds = std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0);
    let options = SqliteConnectOptions::from_str("sqlite://")?
        .filename(db)
        .read_only(true)
        .immutable(!wal_holds)
        .create_if_missing(false);
    let mut conn = sqlx::ConnectOptions::connect(&options).await?;
    let found = read_found(&mut conn).await;
    sqlx::Connection::close(conn).await?;
    found
}

async fn read_found(conn: &mut sqlx::SqliteConnection) -> Result<Found, StoreError> {
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table'")
            .fetch_all(&mut *conn)
            .await?;
    let has = |t: &str| tables.iter().any(|n| n == t);
    let mut found = Found::default();
    if has("meta") {
        found.instance = sqlx::query_scalar("SELECT value FROM meta WHERE key = 'instance'")
            .fetch_optional(&mut *conn)
            .await?;
    }
    if has("images") && has("volumes") {
        let (images, volumes): (i64, i64) =
            sqlx::query_as("SELECT (SELECT COUNT(*) FROM images), (SELECT COUNT(*) FROM volumes)")
                .fetch_one(&mut *conn)
                .await?;
        found.rows = Rows {
            images: images as u64,
            volumes: volumes as u64,
        };
    }
    if has("_sqlx_migrations") {
        found.applied = sqlx::query_as(
            "SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version",
        )
        .fetch_all(&mut *conn)
        .await?;
    }
    Ok(found)
}

/// `blockplane.db.before-NNNN`: the copy taken before migration NNNN.
fn copy_path(db: &Path, version: i64) -> PathBuf {
    PathBuf::from(format!("{}.before-{version:04}", db.display()))
}

/// Refuses a registry that a newer blockplane migrated: it has applied a
/// migration this build does not have, so this build would misread it.
pub fn refuse_newer(db: &Path, found: &Found) -> Result<(), RegistryError> {
    let unknown: Vec<&(i64, String)> = found
        .applied
        .iter()
        .filter(|(v, _)| !MIGRATOR.version_exists(*v))
        .collect();
    let (Some(first), Some(newest)) = (unknown.first(), unknown.last()) else {
        return Ok(());
    };
    let copy = copy_path(db, first.0);
    let way_back = if copy.exists() {
        format!(
            "{} (the copy taken before migration {})",
            copy.display(),
            first.0
        )
    } else {
        "a backup taken before the upgrade (blockplane backup)".to_string()
    };
    Err(RegistryError::Newer {
        db: db.display().to_string(),
        theirs: newest.0,
        description: newest.1.clone(),
        ours: MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0),
        version: env!("CARGO_PKG_VERSION"),
        way_back,
    })
}

/// Why `found` is not the registry the data dir's mark says it served: the
/// mark counts rows, and the registry holds none of them (it is new, empty
/// or another instance's). `None` when it is that registry, or when there is
/// no mark or the mark counts no rows. A registry of the same instance with
/// fewer rows (a backup restored) is that registry.
pub fn lost_rows(data_dir: &Path, found: &Found) -> Option<String> {
    let mark = Mark::read(data_dir)?;
    if mark.images + mark.volumes == 0 {
        return None;
    }
    if found.instance.as_deref() == Some(mark.instance.as_str()) {
        if found.rows.images < mark.images || found.rows.volumes < mark.volumes {
            tracing::warn!(
                images = found.rows.images,
                volumes = found.rows.volumes,
                marked_images = mark.images,
                marked_volumes = mark.volumes,
                "the registry holds fewer rows than its last run recorded (a backup restored?)"
            );
        }
        return None;
    }
    let this = match &found.instance {
        Some(i) => format!(
            "this one is instance {i}'s, with {} image(s) and {} volume(s)",
            found.rows.images, found.rows.volumes
        ),
        None => "this one holds none of them".to_string(),
    };
    Some(format!(
        "{} says this data dir served blockplane instance {} with {} image(s) and {} volume(s), and {this}",
        data_dir.join(MARK_FILE).display(),
        mark.instance,
        mark.images,
        mark.volumes
    ))
}

/// Before this build migrates `db` (an existing registry lacking some of its
/// migrations), copies it beside itself with `VACUUM INTO` (mode 0600), as
/// `blockplane.db.before-NNNN`, and keeps only the newest [`KEPT_COPIES`]
/// such copies. Returns the copy, if one was made.
pub async fn copy_before_migrating(
    db: &Path,
    found: &Found,
) -> Result<Option<PathBuf>, RegistryError> {
    if found.applied.is_empty() {
        return Ok(None);
    }
    let Some(first) = MIGRATOR
        .iter()
        .map(|m| m.version)
        .find(|v| !found.applied.iter().any(|(a, _)| a == v))
    else {
        return Ok(None);
    };
    let copy = copy_path(db, first);
    let tmp = PathBuf::from(format!("{}.tmp", copy.display()));
    let failed = |source: Box<dyn std::error::Error + Send + Sync>| RegistryError::Copy {
        db: db.display().to_string(),
        copy: copy.display().to_string(),
        source,
    };
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(failed(e.into())),
        _ => {}
    }
    // Made here, empty and private, for VACUUM INTO to fill.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| failed(e.into()))?;
    let made = async {
        Store::backup(db, &tmp).await?;
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, &copy)?;
        if let Some(dir) = db.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    };
    if let Err(e) = made.await {
        let _ = std::fs::remove_file(&tmp);
        return Err(failed(e));
    }
    tracing::info!(
        copy = %copy.display(),
        from = found.applied.last().map(|(v, _)| *v).unwrap_or(0),
        to = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0),
        "copied the registry before migrating it"
    );
    prune_copies(db);
    Ok(Some(copy))
}

/// Removes all but the newest [`KEPT_COPIES`] pre-migration copies of `db`.
fn prune_copies(db: &Path) {
    let (Some(dir), Some(name)) = (db.parent(), db.file_name()) else {
        return;
    };
    let prefix = format!("{}.before-", name.to_string_lossy());
    let mut copies: Vec<(i64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let version = n.strip_prefix(&prefix)?.parse().ok()?;
            Some((version, e.path()))
        })
        .collect();
    copies.sort();
    let extra = copies.len().saturating_sub(KEPT_COPIES);
    for (_, old) in copies.into_iter().take(extra) {
        match std::fs::remove_file(&old) {
            Ok(()) => tracing::info!(copy = %old.display(), "removed an old pre-migration copy"),
            Err(e) => {
                tracing::warn!(copy = %old.display(), error = %e, "cannot remove an old pre-migration copy")
            }
        }
    }
}

/// Writes the mark of `store`'s registry in `data_dir` now, and again
/// after every commit that adds or removes an image or a volume.
pub async fn keep_mark(store: &Store, data_dir: &Path) -> Result<(), RegistryError> {
    let instance = store.instance().await?;
    let rows = store.rows().await?;
    let dir = data_dir.to_path_buf();
    let mark = move |rows: Rows| Mark {
        instance: instance.clone(),
        images: rows.images,
        volumes: rows.volumes,
    };
    mark(rows)
        .write(&dir)
        .map_err(|source| RegistryError::Mark {
            path: dir.join(MARK_FILE).display().to_string(),
            source,
        })?;
    store
        .on_rows(Arc::new(move |rows| {
            if let Err(e) = mark(rows).write(&dir) {
                tracing::warn!(error = %e, "cannot update the registry mark");
            }
        }))
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_or_empty_file_holds_nothing_and_a_registry_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("blockplane.db");
        let nothing = look(&db).await.unwrap();
        assert!(nothing.instance.is_none() && nothing.applied.is_empty());
        std::fs::write(&db, b"").unwrap();
        assert!(look(&db).await.unwrap().instance.is_none());
        std::fs::remove_file(&db).unwrap();
        let store = Store::open(&db).await.unwrap();
        let instance = store.instance().await.unwrap();
        store.close().await.unwrap();
        let found = look(&db).await.unwrap();
        assert_eq!(found.instance.as_deref(), Some(instance.as_str()));
        assert_eq!(found.rows, Rows::default());
        assert_eq!(found.applied.len(), MIGRATOR.iter().count());
        refuse_newer(&db, &found).unwrap();
        assert!(copy_before_migrating(&db, &found).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn the_mark_follows_every_row_change() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("blockplane.db"))
            .await
            .unwrap();
        keep_mark(&store, dir.path()).await.unwrap();
        let mark = Mark::read(dir.path()).unwrap();
        assert_eq!((mark.images, mark.volumes), (0, 0));
        assert_eq!(mark.instance, store.instance().await.unwrap());
        let mut tx = store.begin().await.unwrap();
        tx.event(None, None, "test", "no row").await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(Mark::read(dir.path()).unwrap(), mark);
        let image = crate::store::tests::image_row("one");
        let mut tx = store.begin().await.unwrap();
        tx.insert_image(&image).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(Mark::read(dir.path()).unwrap().images, 1);
        let mut tx = store.begin().await.unwrap();
        tx.delete_image(image.id).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(Mark::read(dir.path()).unwrap().images, 0);
    }

    #[test]
    fn only_the_newest_copies_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("blockplane.db");
        for v in [2, 3, 10, 4, 7] {
            std::fs::write(copy_path(&db, v), b"").unwrap();
        }
        std::fs::write(dir.path().join("blockplane.db.before-0001.tmp"), b"").unwrap();
        prune_copies(&db);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "blockplane.db.before-0001.tmp",
                "blockplane.db.before-0004",
                "blockplane.db.before-0007",
                "blockplane.db.before-0010"
            ]
        );
    }
}
