//! SQLite persistence (sqlx): images, volumes and events, and the exports
//! and remote volumes ([`fabric`]).
//!
//! One real database file under the data dir, in WAL mode. Reads use a pool of
//! connections; every write goes through a single-connection pool and starts
//! with `BEGIN IMMEDIATE`, so writers queue in the process instead of meeting
//! `SQLITE_BUSY`, and a read-modify-write sees no interleaved writer.
//!
//! A write that fails (a full disk) must not poison the writer: transactions
//! are plain `BEGIN IMMEDIATE`/`COMMIT`/`ROLLBACK` statements, and a connection
//! whose begin, commit or rollback failed is closed rather than reused, so the
//! next write starts on a fresh one. The last write failure is kept for
//! `/healthz` until a write succeeds again.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize, de::DeserializeOwned};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{Row, Sqlite, SqliteConnection};
use time::OffsetDateTime;
use time::format_description::FormatItem;
use time::macros::format_description;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::attachment::Attachment;
use blockplane_api::model::{
    Allocation, Backend, CopyMethod, CreateVolumeRequest, DispatchPolicy, Event, ImageEncryption,
    ImageState, Labels, Qos, VolumeState,
};
use blockplane_backup::Manifest;

mod fabric;
mod schedules;
pub use fabric::{DrainRow, ExportHostRow, ExportRow, MoveRow, RemoteAttachment, RemoteRow};
pub use schedules::{RunCounts, ScheduleRow, ScheduleTarget};

/// The schema migrations this build knows (`migrations/`), applied at open.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// How many images and volumes the registry holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rows {
    pub images: u64,
    pub volumes: u64,
}

impl Rows {
    fn total(self) -> u64 {
        self.images + self.volumes
    }
}

/// Told the new [`Rows`] of every commit that adds or removes an image or
/// a volume (blocking code: it runs on a blocking thread).
pub type RowsHook = Arc<dyn Fn(Rows) + Send + Sync>;

/// A [`RowsHook`] and the counts it was last told.
struct RowsWatch {
    hook: RowsHook,
    last: std::sync::Mutex<Rows>,
}

impl std::fmt::Debug for RowsWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowsWatch")
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

/// A storage failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed a statement (a full disk among others).
    #[error("database: {0}")]
    Sqlx(#[from] sqlx::Error),
    /// The schema could not be brought up to date.
    #[error("database migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A value read back is not one the service writes.
    #[error("database holds a malformed {what}: {detail}")]
    Corrupt {
        /// What kind of value.
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
}

/// SQLite's primary result code for a full disk.
const SQLITE_FULL: i64 = 13;

impl StoreError {
    /// Whether the database could not be written because its filesystem is full.
    pub fn is_full(&self) -> bool {
        match self {
            StoreError::Sqlx(sqlx::Error::Database(e)) => e
                .code()
                .and_then(|c| c.parse::<i64>().ok())
                .is_some_and(|c| c & 0xff == SQLITE_FULL),
            _ => false,
        }
    }
}

type Result<T> = std::result::Result<T, StoreError>;

/// Fixed-width UTC timestamps, so text order is time order.
const TS: &[FormatItem<'static>] =
    format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z");

/// Formats a time as stored.
pub fn ts(t: OffsetDateTime) -> String {
    t.to_offset(time::UtcOffset::UTC)
        .format(TS)
        .expect("formatting a valid time")
}

fn parse_ts(s: &str) -> Result<OffsetDateTime> {
    time::PrimitiveDateTime::parse(s, TS)
        .map(|t| t.assume_utc())
        .map_err(|e| StoreError::Corrupt {
            what: "timestamp",
            detail: format!("{s}: {e}"),
        })
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("serializing a model value")
}

fn from_json<T: DeserializeOwned>(what: &'static str, s: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| StoreError::Corrupt {
        what,
        detail: e.to_string(),
    })
}

fn uuid(what: &'static str, s: &str) -> Result<Uuid> {
    Uuid::parse_str(s).map_err(|e| StoreError::Corrupt {
        what,
        detail: format!("{s}: {e}"),
    })
}

/// An allocation as the `images` table spells it.
fn allocation_str(a: Allocation) -> &'static str {
    match a {
        Allocation::Sparse => "sparse",
        Allocation::Full => "full",
    }
}

fn opt_uuid(what: &'static str, s: Option<String>) -> Result<Option<Uuid>> {
    s.map(|s| uuid(what, &s)).transpose()
}

fn enum_str<T: Serialize>(v: T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn enum_from_str<T: DeserializeOwned>(what: &'static str, s: &str) -> Result<T> {
    from_json(what, &format!("\"{s}\""))
}

/// A registered image as stored.
#[derive(Debug, Clone)]
pub struct ImageRow {
    pub id: Uuid,
    pub name: String,
    pub path: String,
    pub dev: u64,
    pub ino: u64,
    /// The file's birth (see [`blockplane_system::image::birth_of`]); `None` for rows
    /// recorded before births were kept.
    pub birth: Option<String>,
    pub size_bytes: u64,
    pub allocated_bytes: u64,
    pub allocation: Option<Allocation>,
    pub filesystem: String,
    pub created_at: OffsetDateTime,
    /// The source of a snapshot, and of a clone.
    pub snapshot_of: Option<Uuid>,
    pub cloned_from: Option<Uuid>,
    /// The backup it was restored from.
    pub restored_from: Option<Uuid>,
    /// Volumes on it must be read-only (a snapshot).
    pub read_only: bool,
    pub method: Option<CopyMethod>,
    pub state: ImageState,
    pub state_reason: Option<String>,
    /// Its LUKS2 header as last read; `None` for a plain image.
    pub encryption: Option<ImageEncryption>,
    /// Its labels.
    pub labels: Labels,
    /// The image whose backups it follows, while it is a standby (the
    /// source's id, as the target's manifests name it).
    pub standby_of: Option<Uuid>,
}

impl ImageRow {
    /// Bytes of a volume's device on this image: the file, less an
    /// encrypted image's header.
    pub fn device_bytes(&self) -> u64 {
        blockplane_api::model::device_bytes(self.encryption.as_ref(), self.size_bytes)
    }

    fn from_row(r: &SqliteRow) -> Result<Self> {
        let allocation: Option<String> = r.try_get("allocation")?;
        Ok(Self {
            id: uuid("image id", r.try_get("id")?)?,
            name: r.try_get("name")?,
            path: r.try_get("path")?,
            dev: r.try_get::<i64, _>("dev")? as u64,
            ino: r.try_get::<i64, _>("ino")? as u64,
            birth: r.try_get("birth")?,
            size_bytes: r.try_get::<i64, _>("size_bytes")? as u64,
            allocated_bytes: r.try_get::<i64, _>("allocated_bytes")? as u64,
            allocation: allocation
                .map(|a| enum_from_str("allocation", &a))
                .transpose()?,
            filesystem: r.try_get("filesystem")?,
            created_at: parse_ts(r.try_get("created_at")?)?,
            snapshot_of: opt_uuid("snapshot_of", r.try_get("snapshot_of")?)?,
            cloned_from: opt_uuid("cloned_from", r.try_get("cloned_from")?)?,
            restored_from: opt_uuid("restored_from", r.try_get("restored_from")?)?,
            read_only: r.try_get("read_only")?,
            method: r
                .try_get::<Option<String>, _>("method")?
                .map(|m| enum_from_str("method", &m))
                .transpose()?,
            state: enum_from_str("image state", r.try_get("state")?)?,
            state_reason: r.try_get("state_reason")?,
            encryption: r
                .try_get::<Option<String>, _>("encryption")?
                .map(|e| from_json("image encryption", &e))
                .transpose()?,
            labels: from_json("image labels", r.try_get("labels")?)?,
            standby_of: opt_uuid("standby_of", r.try_get("standby_of")?)?,
        })
    }
}

/// The dm-crypt layer of a volume on an encrypted image: the device its
/// plaintext is served as, over the backend's device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CryptLayer {
    /// The dm name (`/dev/mapper/<name>`).
    pub name: String,
    /// Bytes of the image before the payload: the plaintext device is the
    /// backend's device less these.
    pub header_bytes: u64,
}

/// A volume as stored: how it was created, its live settings, and what was
/// last observed of its device.
#[derive(Debug, Clone)]
pub struct VolumeRow {
    pub id: Uuid,
    pub name: String,
    pub image_id: Uuid,
    /// The create request, normalized (image given by id).
    pub spec: CreateVolumeRequest,
    pub backend: Backend,
    pub dispatch: DispatchPolicy,
    pub read_only: bool,
    pub qos: Option<Qos>,
    pub state: VolumeState,
    pub state_reason: Option<String>,
    pub attachment: Option<Attachment>,
    /// Its dm-crypt layer, on an encrypted image.
    pub crypt: Option<CryptLayer>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

impl VolumeRow {
    /// Bytes of the device the volume's consumer sees over a backend
    /// device of `backend_bytes`: less the header under a dm-crypt layer.
    pub fn device_bytes(&self, backend_bytes: u64) -> u64 {
        backend_bytes.saturating_sub(self.crypt.as_ref().map_or(0, |c| c.header_bytes))
    }

    fn from_row(r: &SqliteRow) -> Result<Self> {
        let qos: Option<String> = r.try_get("qos")?;
        let attachment: Option<String> = r.try_get("attachment")?;
        Ok(Self {
            id: uuid("volume id", r.try_get("id")?)?,
            name: r.try_get("name")?,
            image_id: uuid("image id", r.try_get("image_id")?)?,
            spec: from_json("volume spec", r.try_get("spec")?)?,
            backend: enum_from_str("backend", r.try_get("backend")?)?,
            dispatch: enum_from_str("dispatch", r.try_get("dispatch")?)?,
            read_only: r.try_get("read_only")?,
            qos: qos.map(|q| from_json("qos", &q)).transpose()?,
            state: enum_from_str("state", r.try_get("state")?)?,
            state_reason: r.try_get("state_reason")?,
            attachment: attachment
                .map(|a| from_json("attachment", &a))
                .transpose()?,
            crypt: r
                .try_get::<Option<String>, _>("crypt")?
                .map(|c| from_json("volume crypt", &c))
                .transpose()?,
            created_at: parse_ts(r.try_get("created_at")?)?,
            updated_at: parse_ts(r.try_get("updated_at")?)?,
        })
    }
}

fn event_from_row(r: &SqliteRow) -> Result<Event> {
    let opt_uuid = |col: &str| -> Result<Option<Uuid>> {
        let v: Option<String> = r.try_get(col)?;
        v.map(|s| uuid("event subject", &s)).transpose()
    };
    Ok(Event {
        id: r.try_get("id")?,
        at: parse_ts(r.try_get("at")?)?,
        volume_id: opt_uuid("volume_id")?,
        image_id: opt_uuid("image_id")?,
        kind: r.try_get("kind")?,
        message: r.try_get("message")?,
    })
}

/// What to list of the event log.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    pub volume_id: Option<Uuid>,
    pub since: Option<OffsetDateTime>,
    pub kind: Option<String>,
    pub limit: u32,
}

/// The database.
#[derive(Debug, Clone)]
pub struct Store {
    readers: SqlitePool,
    writer: SqlitePool,
    /// Woken after every commit that added events (the event stream waits on it).
    events_added: Arc<Notify>,
    /// Bumped by every commit: readers that cache a view of the database
    /// compare it to know whether their view is current.
    generation: Arc<AtomicU64>,
    /// Why the last write failed, until a write succeeds again.
    write_failure: Arc<std::sync::Mutex<Option<String>>>,
    /// The directory of the database file.
    dir: Arc<std::path::PathBuf>,
    /// Told of row count changes ([`Store::on_rows`]), with the last counts
    /// it was told.
    rows_hook: Arc<std::sync::OnceLock<RowsWatch>>,
    /// Every volume row, as of a generation: the sampler, `/metrics` and the
    /// lists read them all, every second on a host with a thousand volumes.
    volume_rows: Arc<std::sync::Mutex<Option<RowsAt>>>,
}

/// Rows as read at a generation.
type RowsAt = (u64, Vec<VolumeRow>);

/// Free space below which the database counts as unwritable: a commit
/// appends a few 4 KiB pages to the WAL.
const MIN_FREE_BYTES: u64 = 64 << 10;

impl Store {
    /// Opens (creating if needed) the database file and applies migrations.
    pub async fn open(path: &Path) -> Result<Self> {
        let options = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // Durable against power loss too: the volume of writes is tiny.
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await?;
        MIGRATOR.run(&writer).await?;
        let readers = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options.read_only(true))
            .await?;
        Ok(Self {
            readers,
            writer,
            events_added: Arc::default(),
            generation: Arc::default(),
            write_failure: Arc::default(),
            dir: Arc::new(path.parent().unwrap_or(Path::new(".")).to_path_buf()),
            rows_hook: Arc::default(),
            volume_rows: Arc::default(),
        })
    }

    /// How many images and volumes there are.
    pub async fn rows(&self) -> Result<Rows> {
        query::rows(&self.readers).await
    }

    /// Calls `hook` with the new counts of every commit that adds or removes
    /// an image or a volume, from now on (one hook per store).
    pub async fn on_rows(&self, hook: RowsHook) -> Result<()> {
        let now = self.rows().await?;
        let _ = self.rows_hook.set(RowsWatch {
            hook,
            last: std::sync::Mutex::new(now),
        });
        Ok(())
    }

    /// The counts the rows hook was last told.
    fn told_rows(&self) -> Option<Rows> {
        let watch = self.rows_hook.get()?;
        Some(*watch.last.lock().expect("rows lock poisoned"))
    }

    /// Tells the rows hook `rows`, on a blocking thread (it writes a file).
    async fn tell_rows(&self, rows: Rows) {
        let hooks = self.rows_hook.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(watch) = hooks.get() {
                *watch.last.lock().expect("rows lock poisoned") = rows;
                (watch.hook)(rows);
            }
        })
        .await;
    }

    /// Folds the WAL into the database file and closes every connection, so
    /// that after a clean stop `blockplane.db` alone holds the registry.
    pub async fn close(&self) -> Result<()> {
        self.readers.close().await;
        let checkpoint = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .fetch_one(&self.writer)
            .await;
        self.writer.close().await;
        let row = checkpoint?;
        // (busy, frames in the WAL, frames checkpointed)
        let busy: i64 = row.try_get(0)?;
        if busy != 0 {
            return Err(StoreError::Corrupt {
                what: "checkpoint",
                detail: "the WAL could not be checkpointed: a reader holds it".into(),
            });
        }
        Ok(())
    }

    /// Writes a consistent copy of the database to `target` (which must not
    /// exist) with `VACUUM INTO`, while other processes may be using it.
    pub async fn backup(db: &Path, target: &Path) -> Result<()> {
        let options = SqliteConnectOptions::from_str("sqlite://")?
            .filename(db)
            .create_if_missing(false)
            .busy_timeout(Duration::from_secs(10));
        let mut conn = sqlx::ConnectOptions::connect(&options).await?;
        let target = target.to_str().ok_or_else(|| StoreError::Corrupt {
            what: "backup path",
            detail: format!("{} is not UTF-8", target.display()),
        })?;
        let done = sqlx::query("VACUUM INTO ?")
            .bind(target)
            .execute(&mut conn)
            .await;
        sqlx::Connection::close(conn).await?;
        done?;
        Ok(())
    }

    /// Whether the database can be written: its filesystem has room, and
    /// the last write did not fail or a probe write now works (the probe only
    /// runs after a failure).
    pub async fn check_writable(&self) -> std::result::Result<(), String> {
        let free = rustix::fs::statvfs(self.dir.as_path())
            .map(|st| {
                // root may use the blocks reserved for it, as the service does.
                let blocks = if rustix::process::geteuid().is_root() {
                    st.f_bfree
                } else {
                    st.f_bavail
                };
                blocks.saturating_mul(st.f_frsize)
            })
            .map_err(|e| format!("statvfs {}: {e}", self.dir.display()))?;
        if free < MIN_FREE_BYTES {
            return Err(format!(
                "the filesystem of {} is full ({free} bytes free)",
                self.dir.display()
            ));
        }
        if self.write_failure().is_none() {
            return Ok(());
        }
        let probe = async {
            let mut tx = self.begin().await?;
            // Rewrites a row as it is: a real write that changes nothing.
            sqlx::query("UPDATE meta SET value = value WHERE key = 'instance'")
                .execute(tx.conn())
                .await?;
            tx.commit().await
        };
        match probe.await {
            Ok(()) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn write_failure(&self) -> Option<String> {
        self.write_failure
            .lock()
            .expect("write failure lock poisoned")
            .clone()
    }

    fn record_write(&self, outcome: std::result::Result<(), &sqlx::Error>) {
        *self
            .write_failure
            .lock()
            .expect("write failure lock poisoned") = outcome.err().map(|e| e.to_string());
    }

    /// The id of this service instance (8 hex digits, made with the database).
    pub async fn instance(&self) -> Result<String> {
        let row = sqlx::query("SELECT value FROM meta WHERE key = 'instance'")
            .fetch_one(&self.readers)
            .await?;
        Ok(row.try_get("value")?)
    }

    /// Starts a write transaction (`BEGIN IMMEDIATE` on the one writer connection).
    pub async fn begin(&self) -> Result<WriteTx> {
        let mut conn = self.writer.acquire().await?;
        if let Err(e) = sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await {
            conn.close_on_drop();
            self.record_write(Err(&e));
            return Err(e.into());
        }
        Ok(WriteTx {
            conn: Some(conn),
            store: self.clone(),
            wrote_events: false,
            wrote_rows: false,
        })
    }

    /// The number of commits so far (see the field).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Resolves after the next commit that adds events.
    pub fn events_added(&self) -> Arc<Notify> {
        self.events_added.clone()
    }

    /// Events after `id` (oldest first, at most `limit`), optionally of one volume.
    pub async fn events_after(
        &self,
        id: i64,
        volume_id: Option<Uuid>,
        limit: u32,
    ) -> Result<Vec<Event>> {
        let rows = sqlx::query(
            "SELECT * FROM events WHERE id > ?1 AND (?2 IS NULL OR volume_id = ?2) ORDER BY id LIMIT ?3",
        )
        .bind(id)
        .bind(volume_id.map(|v| v.to_string()))
        .bind(limit as i64)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    /// The id of the newest event (0 when there is none).
    pub async fn last_event_id(&self) -> Result<i64> {
        let row = sqlx::query("SELECT COALESCE(MAX(id), 0) AS id FROM events")
            .fetch_one(&self.readers)
            .await?;
        Ok(row.try_get("id")?)
    }

    /// All images, by name.
    pub async fn images(&self) -> Result<Vec<ImageRow>> {
        sqlx::query("SELECT * FROM images ORDER BY name")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(ImageRow::from_row)
            .collect()
    }

    /// The standby images (those that follow another image's backups).
    pub async fn standby_images(&self) -> Result<Vec<ImageRow>> {
        sqlx::query("SELECT * FROM images WHERE standby_of IS NOT NULL ORDER BY name")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(ImageRow::from_row)
            .collect()
    }

    /// The image with this id or name.
    pub async fn image(&self, id_or_name: &str) -> Result<Option<ImageRow>> {
        query::image(&self.readers, id_or_name).await
    }

    /// The manifest of the backup standby image `id` holds, once it holds one.
    pub async fn standby_held(&self, id: Uuid) -> Result<Option<Manifest>> {
        sqlx::query("SELECT manifest FROM standby_held WHERE image_id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.readers)
            .await?
            .map(|r| from_json("a standby's manifest", &r.try_get::<String, _>("manifest")?))
            .transpose()
    }

    /// All volumes, by name.
    pub async fn volumes(&self) -> Result<Vec<VolumeRow>> {
        let generation = self.generation();
        if let Some((g, rows)) = self.volume_rows.lock().expect("rows poisoned").as_ref()
            && *g == generation
        {
            return Ok(rows.clone());
        }
        let rows: Vec<VolumeRow> = sqlx::query("SELECT * FROM volumes ORDER BY name")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(VolumeRow::from_row)
            .collect::<Result<_>>()?;
        // Stamped with the generation read before the query: a commit since
        // makes the next reader query again.
        *self.volume_rows.lock().expect("rows poisoned") = Some((generation, rows.clone()));
        Ok(rows)
    }

    /// How many volumes there are.
    pub async fn volume_count(&self) -> Result<usize> {
        query::volume_count(&self.readers).await
    }

    /// The volume with this id or name.
    pub async fn volume(&self, id_or_name: &str) -> Result<Option<VolumeRow>> {
        query::volume(&self.readers, id_or_name).await
    }

    /// Ids and names of the volumes using an image, by name.
    pub async fn volumes_of_image(&self, image_id: Uuid) -> Result<Vec<(Uuid, String)>> {
        query::volumes_of_image(&self.readers, image_id).await
    }

    /// Events, oldest first: the newest `limit` that match.
    pub async fn events(&self, f: &EventFilter) -> Result<Vec<Event>> {
        let rows = sqlx::query(
            "SELECT * FROM (SELECT * FROM events
               WHERE (?1 IS NULL OR volume_id = ?1) AND (?2 IS NULL OR at > ?2)
                 AND (?3 IS NULL OR kind = ?3)
               ORDER BY id DESC LIMIT ?4)
             ORDER BY id",
        )
        .bind(f.volume_id.map(|v| v.to_string()))
        .bind(f.since.map(ts))
        .bind(f.kind.as_deref())
        .bind(f.limit as i64)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(event_from_row).collect()
    }
}

/// The reads that both the readers and a write transaction make, each written
/// once over any executor: the pool, or the transaction's connection (which
/// sees the transaction's own writes).
mod query {
    use sqlx::sqlite::SqliteRow;
    use sqlx::{Executor, Row, Sqlite};
    use uuid::Uuid;

    use super::{ImageRow, Result, Rows, VolumeRow, uuid};

    /// The image with this id or name.
    pub async fn image<'c>(
        db: impl Executor<'c, Database = Sqlite>,
        id_or_name: &str,
    ) -> Result<Option<ImageRow>> {
        let sql = "SELECT * FROM images WHERE id = ?1 OR name = ?1";
        by_id_or_name(db, sql, id_or_name, ImageRow::from_row).await
    }

    /// The volume with this id or name.
    pub async fn volume<'c>(
        db: impl Executor<'c, Database = Sqlite>,
        id_or_name: &str,
    ) -> Result<Option<VolumeRow>> {
        let sql = "SELECT * FROM volumes WHERE id = ?1 OR name = ?1";
        by_id_or_name(db, sql, id_or_name, VolumeRow::from_row).await
    }

    /// The row `sql` selects by its one parameter (an id or name, each
    /// unique), if any.
    async fn by_id_or_name<'c, T>(
        db: impl Executor<'c, Database = Sqlite>,
        sql: &'static str,
        id_or_name: &str,
        from_row: fn(&SqliteRow) -> Result<T>,
    ) -> Result<Option<T>> {
        sqlx::query(sql)
            .bind(id_or_name)
            .fetch_optional(db)
            .await?
            .as_ref()
            .map(from_row)
            .transpose()
    }

    /// How many volumes there are.
    pub async fn volume_count<'c>(db: impl Executor<'c, Database = Sqlite>) -> Result<usize> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM volumes")
            .fetch_one(db)
            .await?;
        Ok(row.try_get::<i64, _>("n")? as usize)
    }

    /// How many images and volumes there are.
    pub async fn rows<'c>(db: impl Executor<'c, Database = Sqlite>) -> Result<Rows> {
        let row = sqlx::query(
            "SELECT (SELECT COUNT(*) FROM images) AS images, (SELECT COUNT(*) FROM volumes) AS volumes",
        )
        .fetch_one(db)
        .await?;
        Ok(Rows {
            images: row.try_get::<i64, _>("images")? as u64,
            volumes: row.try_get::<i64, _>("volumes")? as u64,
        })
    }

    /// Ids and names of the volumes using an image, by name.
    pub async fn volumes_of_image<'c>(
        db: impl Executor<'c, Database = Sqlite>,
        image_id: Uuid,
    ) -> Result<Vec<(Uuid, String)>> {
        sqlx::query("SELECT id, name FROM volumes WHERE image_id = ? ORDER BY name")
            .bind(image_id.to_string())
            .fetch_all(db)
            .await?
            .iter()
            .map(|r| Ok((uuid("volume id", r.try_get("id")?)?, r.try_get("name")?)))
            .collect()
    }
}

/// A write transaction. Dropping it without [`WriteTx::commit`] rolls back.
pub struct WriteTx {
    /// `None` once committed.
    conn: Option<PoolConnection<Sqlite>>,
    store: Store,
    wrote_events: bool,
    /// An image or a volume was added or removed.
    wrote_rows: bool,
}

impl WriteTx {
    fn conn(&mut self) -> &mut SqliteConnection {
        self.conn.as_mut().expect("transaction is open")
    }

    /// Commits (and wakes event-stream readers if events were added).
    pub async fn commit(mut self) -> Result<()> {
        let hooked = self.wrote_rows && self.store.rows_hook.get().is_some();
        let rows = match hooked {
            true => Some(query::rows(self.conn()).await?),
            false => None,
        };
        // Growing counts are told before the commit, shrinking ones after:
        // what the hook was told is never less than what the database holds.
        let grows = rows
            .zip(self.store.told_rows())
            .is_some_and(|(now, last)| now.total() >= last.total());
        let mut conn = self.conn.take().expect("transaction is open");
        // Told while the connection is held, so hooks see commits in order.
        if let Some(now) = rows.filter(|_| grows) {
            self.store.tell_rows(now).await;
        }
        if let Err(e) = sqlx::query("COMMIT").execute(&mut *conn).await {
            // Closing the connection rolls back whatever SQLite still holds open.
            conn.close_on_drop();
            self.store.record_write(Err(&e));
            return Err(e.into());
        }
        if let Some(now) = rows.filter(|_| !grows) {
            self.store.tell_rows(now).await;
        }
        drop(conn);
        self.store.record_write(Ok(()));
        self.store.generation.fetch_add(1, Ordering::AcqRel);
        if self.wrote_events {
            self.store.events_added.notify_waiters();
        }
        Ok(())
    }

    /// The image with this id or name, read inside the transaction.
    pub async fn image(&mut self, id_or_name: &str) -> Result<Option<ImageRow>> {
        query::image(self.conn(), id_or_name).await
    }

    /// The image registered for a file identity (a row without a birth
    /// matches any) or path, if any.
    pub async fn image_by_file(
        &mut self,
        dev: u64,
        ino: u64,
        birth: Option<&str>,
        path: &str,
    ) -> Result<Option<ImageRow>> {
        sqlx::query(
            "SELECT * FROM images
             WHERE (dev = ?1 AND ino = ?2 AND (birth IS NULL OR birth IS ?3)) OR path = ?4",
        )
        .bind(dev as i64)
        .bind(ino as i64)
        .bind(birth)
        .bind(path)
        .fetch_optional(self.conn())
        .await?
        .as_ref()
        .map(ImageRow::from_row)
        .transpose()
    }

    /// Records a new image.
    pub async fn insert_image(&mut self, i: &ImageRow) -> Result<()> {
        sqlx::query(
            "INSERT INTO images (id, name, path, dev, ino, birth, size_bytes, allocated_bytes,
                                 allocation, filesystem, created_at, updated_at,
                                 snapshot_of, cloned_from, read_only, method, state,
                                 state_reason, encryption, restored_from, labels, standby_of)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(i.id.to_string())
        .bind(&i.name)
        .bind(&i.path)
        .bind(i.dev as i64)
        .bind(i.ino as i64)
        .bind(&i.birth)
        .bind(i.size_bytes as i64)
        .bind(i.allocated_bytes as i64)
        .bind(i.allocation.map(allocation_str))
        .bind(&i.filesystem)
        .bind(ts(i.created_at))
        .bind(ts(i.created_at))
        .bind(i.snapshot_of.map(|u| u.to_string()))
        .bind(i.cloned_from.map(|u| u.to_string()))
        .bind(i.read_only)
        .bind(i.method.map(enum_str))
        .bind(enum_str(i.state))
        .bind(&i.state_reason)
        .bind(i.encryption.as_ref().map(json))
        .bind(i.restored_from.map(|u| u.to_string()))
        .bind(json(&i.labels))
        .bind(i.standby_of.map(|u| u.to_string()))
        .execute(self.conn())
        .await?;
        self.wrote_rows = true;
        Ok(())
    }

    /// Records the backup a standby image holds now: its id (as the
    /// image's `restored_from`) and its manifest, the next apply's base.
    pub async fn set_standby_held(&mut self, id: Uuid, held: &Manifest) -> Result<()> {
        sqlx::query(
            "UPDATE images SET restored_from = ?, size_bytes = ?, updated_at = ? WHERE id = ?",
        )
        .bind(held.id.to_string())
        .bind(held.image.size_bytes as i64)
        .bind(ts(OffsetDateTime::now_utc()))
        .bind(id.to_string())
        .execute(self.conn())
        .await?;
        sqlx::query(
            "INSERT INTO standby_held (image_id, manifest) VALUES (?, ?)
             ON CONFLICT (image_id) DO UPDATE SET manifest = excluded.manifest",
        )
        .bind(id.to_string())
        .bind(json(held))
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Makes a standby image an ordinary one: it follows no source and
    /// keeps no manifest (its `restored_from` still names what it holds).
    pub async fn end_standby(&mut self, id: Uuid) -> Result<()> {
        sqlx::query("UPDATE images SET standby_of = NULL, updated_at = ? WHERE id = ?")
            .bind(ts(OffsetDateTime::now_utc()))
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        sqlx::query("DELETE FROM standby_held WHERE image_id = ?")
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Records an image's labels.
    pub async fn set_image_labels(&mut self, id: Uuid, labels: &Labels) -> Result<()> {
        sqlx::query("UPDATE images SET labels = ?, updated_at = ? WHERE id = ?")
            .bind(json(labels))
            .bind(ts(OffsetDateTime::now_utc()))
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Records where an image's copy is (its end, or a restart that found
    /// it half done), with its allocated bytes.
    pub async fn set_image_state(
        &mut self,
        id: Uuid,
        state: ImageState,
        reason: Option<&str>,
        allocated: u64,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE images SET state = ?, state_reason = ?, allocated_bytes = ?, updated_at = ?
             WHERE id = ?",
        )
        .bind(enum_str(state))
        .bind(reason)
        .bind(allocated as i64)
        .bind(ts(OffsetDateTime::now_utc()))
        .bind(id.to_string())
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Records an image's new size.
    pub async fn update_image_size(&mut self, id: Uuid, size: u64, allocated: u64) -> Result<()> {
        sqlx::query(
            "UPDATE images SET size_bytes = ?, allocated_bytes = ?, updated_at = ? WHERE id = ?",
        )
        .bind(size as i64)
        .bind(allocated as i64)
        .bind(ts(OffsetDateTime::now_utc()))
        .bind(id.to_string())
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Records an image's allocation (after `allocate`), with its allocated bytes.
    pub async fn set_image_allocation(
        &mut self,
        id: Uuid,
        allocation: Allocation,
        allocated: u64,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE images SET allocation = ?, allocated_bytes = ?, updated_at = ? WHERE id = ?",
        )
        .bind(allocation_str(allocation))
        .bind(allocated as i64)
        .bind(ts(OffsetDateTime::now_utc()))
        .bind(id.to_string())
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Records an image's LUKS2 header as read now (`None`: plain).
    pub async fn set_image_encryption(
        &mut self,
        id: Uuid,
        encryption: Option<&ImageEncryption>,
    ) -> Result<()> {
        sqlx::query("UPDATE images SET encryption = ?, updated_at = ? WHERE id = ?")
            .bind(encryption.map(json))
            .bind(ts(OffsetDateTime::now_utc()))
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Forgets an image.
    pub async fn delete_image(&mut self, id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM images WHERE id = ?")
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        self.wrote_rows = true;
        Ok(())
    }

    /// Ids and names of the volumes using an image, read inside the transaction.
    pub async fn volumes_of_image(&mut self, image_id: Uuid) -> Result<Vec<(Uuid, String)>> {
        query::volumes_of_image(self.conn(), image_id).await
    }

    /// How many volumes there are, read inside the transaction.
    pub async fn volume_count(&mut self) -> Result<usize> {
        query::volume_count(self.conn()).await
    }

    /// Records a new volume.
    pub async fn insert_volume(&mut self, v: &VolumeRow) -> Result<()> {
        sqlx::query(
            "INSERT INTO volumes (id, name, image_id, spec, backend, dispatch, read_only, qos,
                                  state, state_reason, attachment, created_at, updated_at,
                                  crypt)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(v.id.to_string())
        .bind(&v.name)
        .bind(v.image_id.to_string())
        // A key is never recorded, whoever left it in the spec.
        .bind(json(&CreateVolumeRequest {
            key: None,
            ..v.spec.clone()
        }))
        .bind(v.backend.as_str())
        .bind(v.dispatch.as_str())
        .bind(v.read_only)
        .bind(v.qos.as_ref().map(json))
        .bind(v.state.as_str())
        .bind(&v.state_reason)
        .bind(v.attachment.as_ref().map(json))
        .bind(ts(v.created_at))
        .bind(ts(v.updated_at))
        .bind(v.crypt.as_ref().map(json))
        .execute(self.conn())
        .await?;
        self.wrote_rows = true;
        Ok(())
    }

    /// Records a volume's live settings and observed state (everything but its
    /// identity and create spec).
    pub async fn update_volume(&mut self, v: &VolumeRow) -> Result<()> {
        sqlx::query(
            "UPDATE volumes SET dispatch = ?, read_only = ?, qos = ?, state = ?,
                    state_reason = ?, attachment = ?, updated_at = ?
             WHERE id = ?",
        )
        .bind(v.dispatch.as_str())
        .bind(v.read_only)
        .bind(v.qos.as_ref().map(json))
        .bind(v.state.as_str())
        .bind(&v.state_reason)
        .bind(v.attachment.as_ref().map(json))
        .bind(ts(v.updated_at))
        .bind(v.id.to_string())
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Forgets a volume.
    pub async fn delete_volume(&mut self, id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM volumes WHERE id = ?")
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        self.wrote_rows = true;
        Ok(())
    }

    /// Appends to the event log.
    pub async fn event(
        &mut self,
        volume_id: Option<Uuid>,
        image_id: Option<Uuid>,
        kind: &str,
        message: &str,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO events (at, volume_id, image_id, kind, message) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(ts(OffsetDateTime::now_utc()))
        .bind(volume_id.map(|v| v.to_string()))
        .bind(image_id.map(|v| v.to_string()))
        .bind(kind)
        .bind(message)
        .execute(self.conn())
        .await?;
        self.wrote_events = true;
        Ok(())
    }
}

impl Drop for WriteTx {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        // Roll back before the connection serves the next writer; it goes back
        // to the pool only when that worked (a failed rollback closes it).
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    if sqlx::query("ROLLBACK").execute(&mut *conn).await.is_err() {
                        conn.close_on_drop();
                    }
                });
            }
            Err(_) => conn.close_on_drop(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn timestamps_are_fixed_width_and_round_trip() {
        let t = time::macros::datetime!(2026-11-30 01:02:03.5 UTC);
        let s = ts(t);
        assert_eq!(s, "2026-11-30T01:02:03.500000Z");
        assert_eq!(parse_ts(&s).unwrap(), t);
    }

    #[tokio::test]
    async fn concurrent_writers_never_see_busy() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db.sqlite")).await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..32 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut tx = store.begin().await.unwrap();
                tx.event(None, None, "test", &format!("event {i}"))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let events = store
            .events(&EventFilter {
                limit: 100,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(events.len(), 32);
        assert!(events.windows(2).all(|w| w[0].id < w[1].id));
    }

    /// Every dispatch policy the API takes, spelled as it is stored. The
    /// match fails to compile when a policy is added, until it is listed
    /// here (and the registry's CHECK takes it: a new migration).
    fn every_policy() -> Vec<DispatchPolicy> {
        use DispatchPolicy as D;
        let all = vec![D::Auto, D::Nowait, D::Threaded, D::Direct, D::Kernel];
        for d in &all {
            match d {
                D::Auto | D::Nowait | D::Threaded | D::Direct | D::Kernel => {}
            }
        }
        all
    }

    /// A registered image's row, as a test inserts it: `/images/NAME.img`.
    pub(crate) fn image_row(name: &str) -> ImageRow {
        ImageRow {
            id: Uuid::new_v4(),
            name: name.into(),
            path: format!("/images/{name}.img"),
            dev: 1,
            ino: 2,
            birth: None,
            size_bytes: 4096,
            allocated_bytes: 4096,
            allocation: None,
            filesystem: "ext4".into(),
            created_at: OffsetDateTime::now_utc(),
            snapshot_of: None,
            cloned_from: None,
            restored_from: None,
            read_only: false,
            method: None,
            state: ImageState::Ready,
            state_reason: None,
            encryption: None,
            labels: Labels::new(),
            standby_of: None,
        }
    }

    pub(crate) fn volume_row(
        name: &str,
        image: &ImageRow,
        backend: Backend,
        d: DispatchPolicy,
    ) -> VolumeRow {
        let spec = serde_json::json!({
            "name": name,
            "image": image.id.to_string(),
            "backend": backend.as_str(),
            "dispatch": d.as_str(),
        });
        // Whole microseconds: as stored.
        let now = time::macros::datetime!(2026-12-06 07:30:00.123456 UTC);
        VolumeRow {
            id: Uuid::new_v4(),
            name: name.into(),
            image_id: image.id,
            spec: serde_json::from_value(spec).unwrap(),
            backend,
            dispatch: d,
            read_only: false,
            qos: None,
            state: VolumeState::Attached,
            state_reason: None,
            attachment: None,
            crypt: None,
            created_at: now,
            updated_at: now,
        }
    }

    /// A volume asks for any policy the API takes, `kernel` included, at
    /// create (insert) and by PATCH (update), and reads back as asked: the
    /// registry refuses none of them.
    #[tokio::test]
    async fn every_dispatch_policy_is_recorded_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("blockplane.db"))
            .await
            .unwrap();
        let image = image_row("img");
        let mut tx = store.begin().await.unwrap();
        tx.insert_image(&image).await.unwrap();
        tx.commit().await.unwrap();
        for asked in every_policy() {
            let name = format!("created-{}", asked.as_str());
            let v = volume_row(&name, &image, Backend::Dm, asked);
            let mut tx = store.begin().await.unwrap();
            tx.insert_volume(&v)
                .await
                .unwrap_or_else(|e| panic!("insert dispatch {}: {e}", asked.as_str()));
            tx.commit().await.unwrap();
            let read = store.volume(&name).await.unwrap().unwrap();
            assert_eq!(read.dispatch, asked);
            assert_eq!(read.spec.dispatch, asked);
        }
        let mut v = volume_row("patched", &image, Backend::Dm, DispatchPolicy::Nowait);
        let mut tx = store.begin().await.unwrap();
        tx.insert_volume(&v).await.unwrap();
        tx.commit().await.unwrap();
        for asked in every_policy() {
            v.dispatch = asked;
            let mut tx = store.begin().await.unwrap();
            tx.update_volume(&v)
                .await
                .unwrap_or_else(|e| panic!("update to dispatch {}: {e}", asked.as_str()));
            tx.commit().await.unwrap();
            let read = store.volume("patched").await.unwrap().unwrap();
            assert_eq!(read.dispatch, asked);
        }
    }

    /// A registry of the schema before this build's newest migrations (up
    /// to 0005), holding a volume that uses every column (a dm-crypt layer,
    /// `locked`): the volumes table is rebuilt around it, and the row reads
    /// back as it was, its image's foreign key, its index and the table's
    /// other CHECKs kept; then it may ask for `kernel`.
    #[tokio::test]
    async fn a_volume_row_keeps_every_column_across_the_rebuild_of_its_table() {
        use sqlx::{ConnectOptions, Connection};
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("blockplane.db");
        let image = image_row("img");
        let mut old = volume_row("v", &image, Backend::Dm, DispatchPolicy::Direct);
        old.read_only = true;
        old.qos = Some(Qos {
            iops: Some(100),
            ..Default::default()
        });
        old.state = VolumeState::Locked;
        old.state_reason = Some("its key is needed".into());
        old.crypt = Some(CryptLayer {
            name: "blockplane-crypt-v".into(),
            header_bytes: 16 << 20,
        });
        {
            let mut c = SqliteConnectOptions::from_str("sqlite://")
                .unwrap()
                .filename(&db)
                .create_if_missing(true)
                .foreign_keys(true)
                .connect()
                .await
                .unwrap();
            MIGRATOR.run_to(5, &mut c).await.unwrap();
            sqlx::query(
                "INSERT INTO images (id, name, path, dev, ino, size_bytes, allocated_bytes,
                                     filesystem, created_at, updated_at)
                 VALUES (?, 'img', '/images/img.img', 1, 2, 4096, 4096, 'ext4', ?, ?)",
            )
            .bind(image.id.to_string())
            .bind(ts(old.created_at))
            .bind(ts(old.created_at))
            .execute(&mut c)
            .await
            .unwrap();
            sqlx::query(
                "INSERT INTO volumes (id, name, image_id, spec, backend, dispatch, read_only,
                                      qos, state, state_reason, attachment, created_at,
                                      updated_at, crypt)
                 VALUES (?, 'v', ?, ?, 'dm', 'direct', 1, ?, 'locked', ?, NULL, ?, ?, ?)",
            )
            .bind(old.id.to_string())
            .bind(image.id.to_string())
            .bind(json(&old.spec))
            .bind(old.qos.as_ref().map(json))
            .bind(&old.state_reason)
            .bind(ts(old.created_at))
            .bind(ts(old.updated_at))
            .bind(old.crypt.as_ref().map(json))
            .execute(&mut c)
            .await
            .unwrap();
            c.close().await.unwrap();
        }
        let store = Store::open(&db).await.unwrap();
        let read = store.volume("v").await.unwrap().unwrap();
        assert_eq!(
            format!("{read:?}"),
            format!("{old:?}"),
            "the row after the rebuild"
        );
        let mut c = store.writer.acquire().await.unwrap();
        let broken: Vec<(String,)> =
            sqlx::query_as("SELECT \"table\" FROM pragma_foreign_key_check")
                .fetch_all(&mut *c)
                .await
                .unwrap();
        assert!(broken.is_empty(), "{broken:?}");
        let fks: Vec<(String, String)> =
            sqlx::query_as("SELECT \"table\", \"from\" FROM pragma_foreign_key_list('volumes')")
                .fetch_all(&mut *c)
                .await
                .unwrap();
        assert_eq!(fks, [("images".to_string(), "image_id".to_string())]);
        let indexes: Vec<(String,)> = sqlx::query_as(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'volumes'
             AND name NOT LIKE 'sqlite_autoindex_%'",
        )
        .fetch_all(&mut *c)
        .await
        .unwrap();
        assert_eq!(indexes, [("volumes_image".to_string(),)]);
        // The image is still kept while a volume uses it.
        let e = sqlx::query("DELETE FROM images WHERE id = ?")
            .bind(image.id.to_string())
            .execute(&mut *c)
            .await;
        assert!(e.is_err(), "an image with a volume was deleted");
        // The other CHECKs still refuse what the service never writes.
        for update in [
            "UPDATE volumes SET dispatch = 'bogus'",
            "UPDATE volumes SET backend = 'nbd'",
            "UPDATE volumes SET state = 'lost'",
        ] {
            let e = sqlx::query(update).execute(&mut *c).await;
            assert!(e.is_err(), "{update}: taken");
        }
        drop(c);
        let mut v = read;
        v.dispatch = DispatchPolicy::Kernel;
        let mut tx = store.begin().await.unwrap();
        tx.update_volume(&v).await.unwrap();
        tx.commit().await.unwrap();
        let read = store.volume("v").await.unwrap().unwrap();
        assert_eq!(read.dispatch, DispatchPolicy::Kernel);
    }
}
