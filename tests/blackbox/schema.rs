//! The registry's schema across versions: a registry an older blockplane
//! made is copied beside itself before this one migrates it; one a newer
//! blockplane migrated is refused and left as it was.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::str::FromStr;

use rustix::process::Signal;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};

use crate::harness::{Opts, Service, repo};
use crate::lost_registry::refusal;

/// The migrations this build has (`migrations/*.sql`).
fn our_migrations() -> usize {
    std::fs::read_dir(repo().join("migrations"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "sql"))
        .count()
}

async fn connect(db: &Path, read_only: bool) -> sqlx::SqliteConnection {
    SqliteConnectOptions::from_str("sqlite://")
        .unwrap()
        .filename(db)
        .read_only(read_only)
        .connect()
        .await
        .unwrap()
}

/// Applied migrations of a registry, and the columns of its `images`.
async fn schema_of(db: &Path) -> (Vec<i64>, Vec<String>) {
    let mut c = connect(db, true).await;
    let applied = sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
        .fetch_all(&mut c)
        .await
        .unwrap();
    let columns = sqlx::query_scalar("SELECT name FROM pragma_table_info('images')")
        .fetch_all(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    (applied, columns)
}

/// Every file of the data dir, with its mode and bytes.
fn data_dir_files(data: &Path) -> Vec<(String, u32, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(data)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| {
            let mode = e.metadata().unwrap().mode() & 0o7777;
            let n = e.file_name().to_string_lossy().into_owned();
            (n, mode, std::fs::read(e.path()).unwrap())
        })
        .collect();
    out.sort();
    out
}

/// A registry whose schema a newer blockplane migrated (one applied
/// migration this build lacks, with the table it made): the start is refused
/// in one line naming both versions and how to go back, and the data dir is
/// left byte for byte as it was (no copy, no WAL, the same mark).
#[tokio::test(flavor = "multi_thread")]
async fn a_registry_a_newer_blockplane_migrated_is_refused_and_left_unchanged() {
    let mut s = Service::start().await;
    s.image("kept", 1).await;
    assert!(s.signal(Signal::TERM).success());
    let db = s.data.join("blockplane.db");
    let mut c = connect(&db, false).await;
    sqlx::query("CREATE TABLE from_the_future (x INTEGER)")
        .execute(&mut c)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (9999, 'from the future', 1, x'00', 0)",
    )
    .execute(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    let files = data_dir_files(&s.data);

    let log = refusal(&mut s, "started on a newer schema").await;
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("blockplane: "))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    for what in [
        "schema version 9999 (from the future)".to_string(),
        "newer than this blockplane".to_string(),
        format!("its newest is {}", our_migrations()),
        "restore a backup taken before the upgrade".to_string(),
        "Nothing was changed".to_string(),
    ] {
        assert!(lines[0].contains(&what), "{what:?} not in: {}", lines[0]);
    }
    assert!(
        data_dir_files(&s.data) == files,
        "the refused start changed the data dir"
    );
}

/// A registry made by an older blockplane (only the first migration
/// applied, one image in it): the new one starts, serves the image, and has
/// first copied the registry as it was beside it
/// (`blockplane.db.before-0002`, mode 0600, the old schema). A later start
/// with nothing to migrate makes no copy.
#[tokio::test(flavor = "multi_thread")]
async fn a_migration_is_preceded_by_a_copy_of_the_registry() {
    let old = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let file = root.path().canonicalize().unwrap().join("old.img");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let meta = std::fs::metadata(&file).unwrap();
    let db = old.path().join("blockplane.db");
    let mut c = SqliteConnectOptions::from_str("sqlite://")
        .unwrap()
        .filename(&db)
        .create_if_missing(true)
        .connect()
        .await
        .unwrap();
    sqlx::migrate!("../../migrations")
        .run_to(1, &mut c)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO images (id, name, path, dev, ino, size_bytes, allocated_bytes, allocation,
                             filesystem, created_at, updated_at)
         VALUES ('4f0c8a4e-98f5-4a40-9d27-1a1f1c5b7a01', 'old', ?, ?, ?, 1048576, 1048576,
                 'full', 'ext4', '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:00.000000Z')",
    )
    .bind(file.to_str().unwrap())
    .bind(meta.dev() as i64)
    .bind(meta.ino() as i64)
    .execute(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    let (applied, columns) = schema_of(&db).await;
    assert_eq!(applied, [1]);

    let mut s = Service::start_prepared(
        Opts {
            extra_roots: vec![root.path().to_path_buf()],
            ..Default::default()
        },
        |data| {
            std::fs::create_dir_all(data).unwrap();
            std::fs::copy(&db, data.join("blockplane.db")).unwrap();
        },
    )
    .await;
    let images = s.get("/v1/images").await.body;
    assert_eq!(images.as_array().unwrap().len(), 1, "{images}");
    assert_eq!(images[0]["name"], "old");
    let copy = s.data.join("blockplane.db.before-0002");
    assert!(copy.exists(), "no copy before migrating:\n{}", s.log_text());
    let mode = std::fs::metadata(&copy).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600, "the copy's mode");
    assert_eq!(
        schema_of(&copy).await,
        (applied, columns),
        "the copy is the registry as it was"
    );
    let (now, _) = schema_of(&s.data.join("blockplane.db")).await;
    assert_eq!(now.len(), our_migrations());

    assert!(s.signal(Signal::TERM).success());
    s.restart().await;
    let copies: Vec<String> = std::fs::read_dir(&s.data)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".before-"))
        .collect();
    assert_eq!(copies, ["blockplane.db.before-0002"]);
}
