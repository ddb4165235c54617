//! The rows of volumes that leave their host: exports, the hosts allowed to
//! them with their keys, and remote volumes.

use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqliteRow;
use sqlx::{Executor, Row, Sqlite};
use time::OffsetDateTime;
use uuid::Uuid;

use super::{Result, Store, StoreError, WriteTx, enum_from_str, enum_str, parse_ts, ts, uuid};
use blockplane_api::model::{
    ColdExport, ExportAuth, ExportMove, ExportState, MoveState, RemoteState,
};
use blockplane_system::dhchap::Secret;

/// A volume's export as stored.
#[derive(Debug, Clone)]
pub struct ExportRow {
    pub volume_id: Uuid,
    /// The subsystem's NQN.
    pub nqn: String,
    /// Asked read-only (a read-only volume is served so whatever this says).
    pub read_only: bool,
    pub auth: ExportAuth,
    /// What the kernel was last seen to do with it.
    pub state: ExportState,
    pub state_reason: Option<String>,
    /// The host NQNs allowed, by name.
    pub hosts: Vec<String>,
    /// What the host moving the volume's data last said of the move.
    pub moving: Option<ExportMove>,
    pub created_at: OffsetDateTime,
}

/// A host allowed to this service's exports, with its keys.
#[derive(Debug, Clone)]
pub struct ExportHostRow {
    pub host_nqn: String,
    /// The key the host proves.
    pub key: Secret,
    /// The key the target proves to it.
    pub ctrl_key: Secret,
}

/// A remote volume as stored.
#[derive(Debug, Clone)]
pub struct RemoteRow {
    pub id: Uuid,
    pub name: String,
    /// `ip:port` of the exporting host.
    pub address: String,
    pub nqn: String,
    pub secret: Option<Secret>,
    pub ctrl_secret: Option<Secret>,
    pub read_only: bool,
    pub state: RemoteState,
    pub state_reason: Option<String>,
    pub attachment: Option<RemoteAttachment>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

/// What the kernel made of a remote volume, as last observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteAttachment {
    /// The NVMe controller's instance (`/sys/class/nvme/nvme<N>`).
    pub controller: u32,
    /// The namespace's device, `/dev/nvmeXnY`.
    pub nvme_device: String,
    /// The dm node over it.
    pub dm_name: String,
    /// That node's device: `/dev/mapper/<dm_name>` where udev made it,
    /// else `/dev/dm-<minor>`.
    pub device: String,
    /// Its size, bytes.
    pub size_bytes: u64,
}

fn secret(what: &'static str, s: &str) -> Result<Secret> {
    Secret::parse(s).map_err(|e| StoreError::Corrupt {
        what,
        detail: e.to_string(),
    })
}

impl ExportRow {
    fn from_row(r: &SqliteRow, hosts: Vec<String>) -> Result<Self> {
        Ok(Self {
            volume_id: uuid("export volume id", r.try_get("volume_id")?)?,
            nqn: r.try_get("nqn")?,
            read_only: r.try_get("read_only")?,
            auth: enum_from_str("export auth", r.try_get("auth")?)?,
            state: enum_from_str("export state", r.try_get("state")?)?,
            state_reason: r.try_get("state_reason")?,
            hosts,
            moving: r
                .try_get::<Option<String>, _>("moving")?
                .map(|m| super::from_json("export move", &m))
                .transpose()?,
            created_at: parse_ts(r.try_get("created_at")?)?,
        })
    }
}

impl RemoteRow {
    fn from_row(r: &SqliteRow) -> Result<Self> {
        let opt_secret = |col: &str| -> Result<Option<Secret>> {
            r.try_get::<Option<String>, _>(col)?
                .map(|s| secret("remote secret", &s))
                .transpose()
        };
        Ok(Self {
            id: uuid("remote id", r.try_get("id")?)?,
            name: r.try_get("name")?,
            address: r.try_get("address")?,
            nqn: r.try_get("nqn")?,
            secret: opt_secret("secret")?,
            ctrl_secret: opt_secret("ctrl_secret")?,
            read_only: r.try_get("read_only")?,
            state: enum_from_str("remote state", r.try_get("state")?)?,
            state_reason: r.try_get("state_reason")?,
            attachment: r
                .try_get::<Option<String>, _>("attachment")?
                .map(|a| super::from_json("remote attachment", &a))
                .transpose()?,
            created_at: parse_ts(r.try_get("created_at")?)?,
            updated_at: parse_ts(r.try_get("updated_at")?)?,
        })
    }
}

/// Every export, with its hosts.
async fn exports<'c>(db: impl Executor<'c, Database = Sqlite> + Copy) -> Result<Vec<ExportRow>> {
    let grants = sqlx::query("SELECT volume_id, host_nqn FROM export_grants ORDER BY host_nqn")
        .fetch_all(db)
        .await?;
    sqlx::query("SELECT * FROM exports ORDER BY nqn")
        .fetch_all(db)
        .await?
        .iter()
        .map(|r| {
            let id: String = r.try_get("volume_id")?;
            let hosts = grants
                .iter()
                .filter(|g| g.try_get::<String, _>("volume_id").ok().as_ref() == Some(&id))
                .map(|g| g.try_get("host_nqn"))
                .collect::<std::result::Result<_, _>>()?;
            ExportRow::from_row(r, hosts)
        })
        .collect()
}

impl Store {
    /// This service's host NQN and host id (made with the database).
    pub async fn host_identity(&self) -> Result<(String, Uuid)> {
        let meta = |key: &'static str| {
            sqlx::query("SELECT value FROM meta WHERE key = ?")
                .bind(key)
                .fetch_one(&self.readers)
        };
        let nqn: String = meta("host_nqn").await?.try_get("value")?;
        let id: String = meta("host_id").await?.try_get("value")?;
        Ok((nqn, uuid("host id", &id)?))
    }

    /// Every export, by NQN.
    pub async fn exports(&self) -> Result<Vec<ExportRow>> {
        exports(&self.readers).await
    }

    /// The export of a volume, if it has one.
    pub async fn export(&self, volume_id: Uuid) -> Result<Option<ExportRow>> {
        Ok(self
            .exports()
            .await?
            .into_iter()
            .find(|e| e.volume_id == volume_id))
    }

    /// The hosts allowed to any export, with their keys.
    pub async fn export_hosts(&self) -> Result<Vec<ExportHostRow>> {
        sqlx::query("SELECT * FROM export_hosts ORDER BY host_nqn")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(|r| {
                Ok(ExportHostRow {
                    host_nqn: r.try_get("host_nqn")?,
                    key: secret("export host key", r.try_get("key")?)?,
                    ctrl_key: secret("export host key", r.try_get("ctrl_key")?)?,
                })
            })
            .collect()
    }

    /// Every remote volume, by name.
    pub async fn remotes(&self) -> Result<Vec<RemoteRow>> {
        sqlx::query("SELECT * FROM remotes ORDER BY name")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(RemoteRow::from_row)
            .collect()
    }

    /// The remote volume with this id or name.
    pub async fn remote(&self, id_or_name: &str) -> Result<Option<RemoteRow>> {
        sqlx::query("SELECT * FROM remotes WHERE id = ?1 OR name = ?1")
            .bind(id_or_name)
            .fetch_optional(&self.readers)
            .await?
            .as_ref()
            .map(RemoteRow::from_row)
            .transpose()
    }
}

impl WriteTx {
    /// Records an export (new or changed) and exactly its hosts.
    pub async fn put_export(&mut self, e: &ExportRow) -> Result<()> {
        sqlx::query(
            "INSERT INTO exports (volume_id, nqn, read_only, auth, state, state_reason, created_at)
             VALUES (?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT (volume_id) DO UPDATE SET read_only = excluded.read_only,
                 auth = excluded.auth, state = excluded.state,
                 state_reason = excluded.state_reason",
        )
        .bind(e.volume_id.to_string())
        .bind(&e.nqn)
        .bind(e.read_only)
        .bind(enum_str(e.auth))
        .bind(enum_str(e.state))
        .bind(&e.state_reason)
        .bind(ts(e.created_at))
        .execute(self.conn())
        .await?;
        sqlx::query("DELETE FROM export_grants WHERE volume_id = ?")
            .bind(e.volume_id.to_string())
            .execute(self.conn())
            .await?;
        for host in &e.hosts {
            sqlx::query("INSERT INTO export_grants (volume_id, host_nqn) VALUES (?, ?)")
                .bind(e.volume_id.to_string())
                .bind(host)
                .execute(self.conn())
                .await?;
        }
        Ok(())
    }

    /// Records what the kernel does with an export.
    pub async fn set_export_state(
        &mut self,
        volume_id: Uuid,
        state: ExportState,
        reason: Option<&str>,
    ) -> Result<()> {
        sqlx::query("UPDATE exports SET state = ?, state_reason = ? WHERE volume_id = ?")
            .bind(enum_str(state))
            .bind(reason)
            .bind(volume_id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Records what the host moving `volume_id`'s data said of the move.
    pub async fn set_export_move(&mut self, volume_id: Uuid, m: &ExportMove) -> Result<()> {
        sqlx::query("UPDATE exports SET moving = ? WHERE volume_id = ?")
            .bind(super::json(m))
            .bind(volume_id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Forgets a volume's export, and the hosts no export allows any more.
    pub async fn delete_export(&mut self, volume_id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM exports WHERE volume_id = ?")
            .bind(volume_id.to_string())
            .execute(self.conn())
            .await?;
        self.forget_unused_export_hosts().await
    }

    /// Forgets the hosts (and their keys) no export allows any more.
    pub async fn forget_unused_export_hosts(&mut self) -> Result<()> {
        sqlx::query(
            "DELETE FROM export_hosts
             WHERE host_nqn NOT IN (SELECT host_nqn FROM export_grants)",
        )
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Records a host allowed to exports, with its keys (once: a host's keys
    /// stay until no export allows it).
    pub async fn insert_export_host(&mut self, h: &ExportHostRow) -> Result<()> {
        sqlx::query(
            "INSERT INTO export_hosts (host_nqn, key, ctrl_key, created_at) VALUES (?, ?, ?, ?)",
        )
        .bind(&h.host_nqn)
        .bind(h.key.expose())
        .bind(h.ctrl_key.expose())
        .bind(ts(OffsetDateTime::now_utc()))
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Records a host's new keys.
    pub async fn set_export_host_keys(&mut self, h: &ExportHostRow) -> Result<()> {
        sqlx::query("UPDATE export_hosts SET key = ?, ctrl_key = ? WHERE host_nqn = ?")
            .bind(h.key.expose())
            .bind(h.ctrl_key.expose())
            .bind(&h.host_nqn)
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Records a remote volume's new keys.
    pub async fn set_remote_keys(&mut self, r: &RemoteRow) -> Result<()> {
        sqlx::query("UPDATE remotes SET secret = ?, ctrl_secret = ? WHERE id = ?")
            .bind(r.secret.as_ref().map(Secret::expose))
            .bind(r.ctrl_secret.as_ref().map(Secret::expose))
            .bind(r.id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Records a new remote volume.
    pub async fn insert_remote(&mut self, r: &RemoteRow) -> Result<()> {
        sqlx::query(
            "INSERT INTO remotes (id, name, address, nqn, secret, ctrl_secret, read_only, state,
                                  state_reason, attachment, created_at, updated_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(r.id.to_string())
        .bind(&r.name)
        .bind(&r.address)
        .bind(&r.nqn)
        .bind(r.secret.as_ref().map(Secret::expose))
        .bind(r.ctrl_secret.as_ref().map(Secret::expose))
        .bind(r.read_only)
        .bind(enum_str(r.state))
        .bind(&r.state_reason)
        .bind(r.attachment.as_ref().map(super::json))
        .bind(ts(r.created_at))
        .bind(ts(r.updated_at))
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Records a remote volume's settings and observed state.
    pub async fn update_remote(&mut self, r: &RemoteRow) -> Result<()> {
        sqlx::query(
            "UPDATE remotes SET read_only = ?, state = ?, state_reason = ?, attachment = ?,
                    updated_at = ?
             WHERE id = ?",
        )
        .bind(r.read_only)
        .bind(enum_str(r.state))
        .bind(&r.state_reason)
        .bind(r.attachment.as_ref().map(super::json))
        .bind(ts(r.updated_at))
        .bind(r.id.to_string())
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Forgets a remote volume.
    pub async fn delete_remote(&mut self, id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM remotes WHERE id = ?")
            .bind(id.to_string())
            .execute(self.conn())
            .await?;
        Ok(())
    }
}

/// A move of a remote volume's data to this host, as stored.
#[derive(Debug, Clone)]
pub struct MoveRow {
    pub id: Uuid,
    pub remote_id: Uuid,
    pub remote_name: String,
    /// The local image the data moves into, and its file.
    pub image: String,
    pub path: String,
    /// The local volume over it, once made.
    pub volume_id: Option<Uuid>,
    pub source_api: String,
    pub source_volume: String,
    pub keep_source_image: bool,
    /// Bytes per second the copy may read; 0: no limit.
    pub rate_limit: u64,
    pub state: MoveState,
    pub state_reason: Option<String>,
    pub synced_bytes: u64,
    pub total_bytes: u64,
    /// The copy's last measured rate, bytes per second.
    pub rate: u64,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
    pub finished_at: Option<OffsetDateTime>,
    /// A cold move: what it did to the exporting host's export.
    pub cold: Option<ColdExport>,
    /// The drain it is part of: its rate limit is its share of the
    /// drain's.
    pub drain_id: Option<Uuid>,
}

/// A drain as stored: several moves under one rate limit.
#[derive(Debug, Clone)]
pub struct DrainRow {
    pub id: Uuid,
    pub source_api: String,
    /// Bytes per second its moves may read in all; 0: no limit.
    pub rate_limit: u64,
    pub created_at: OffsetDateTime,
}

impl MoveRow {
    fn from_row(r: &SqliteRow) -> Result<Self> {
        let count = |col: &str| -> Result<u64> { Ok(r.try_get::<i64, _>(col)?.max(0) as u64) };
        Ok(Self {
            id: uuid("move id", r.try_get("id")?)?,
            remote_id: uuid("move remote id", r.try_get("remote_id")?)?,
            remote_name: r.try_get("remote_name")?,
            image: r.try_get("image")?,
            path: r.try_get("path")?,
            volume_id: r
                .try_get::<Option<String>, _>("volume_id")?
                .map(|v| uuid("move volume id", &v))
                .transpose()?,
            source_api: r.try_get("source_api")?,
            source_volume: r.try_get("source_volume")?,
            keep_source_image: r.try_get("keep_source_image")?,
            rate_limit: count("rate_limit")?,
            state: enum_from_str("move state", r.try_get("state")?)?,
            state_reason: r.try_get("state_reason")?,
            synced_bytes: count("synced_bytes")?,
            total_bytes: count("total_bytes")?,
            rate: count("rate")?,
            created_at: parse_ts(r.try_get("created_at")?)?,
            updated_at: parse_ts(r.try_get("updated_at")?)?,
            finished_at: r
                .try_get::<Option<String>, _>("finished_at")?
                .map(|t| parse_ts(&t))
                .transpose()?,
            cold: r
                .try_get::<Option<String>, _>("cold")?
                .map(|c| enum_from_str("cold move export", &c))
                .transpose()?,
            drain_id: r
                .try_get::<Option<String>, _>("drain_id")?
                .map(|d| uuid("move drain id", &d))
                .transpose()?,
        })
    }
}

impl Store {
    /// Every move, newest first.
    pub async fn moves(&self) -> Result<Vec<MoveRow>> {
        sqlx::query("SELECT * FROM moves ORDER BY created_at DESC, id")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(MoveRow::from_row)
            .collect()
    }

    /// The move with this id.
    pub async fn move_row(&self, id: Uuid) -> Result<Option<MoveRow>> {
        sqlx::query("SELECT * FROM moves WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.readers)
            .await?
            .as_ref()
            .map(MoveRow::from_row)
            .transpose()
    }

    /// The drain with this id.
    pub async fn drain(&self, id: Uuid) -> Result<Option<DrainRow>> {
        let Some(r) = sqlx::query("SELECT * FROM drains WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.readers)
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(DrainRow {
            id: uuid("drain id", r.try_get("id")?)?,
            source_api: r.try_get("source_api")?,
            rate_limit: r.try_get::<i64, _>("rate_limit")?.max(0) as u64,
            created_at: parse_ts(r.try_get("created_at")?)?,
        }))
    }

    /// The latest move of remote volume `remote_id`.
    pub async fn move_of_remote(&self, remote_id: Uuid) -> Result<Option<MoveRow>> {
        sqlx::query("SELECT * FROM moves WHERE remote_id = ? ORDER BY created_at DESC LIMIT 1")
            .bind(remote_id.to_string())
            .fetch_optional(&self.readers)
            .await?
            .as_ref()
            .map(MoveRow::from_row)
            .transpose()
    }
}

impl WriteTx {
    /// Records a move, new or changed.
    pub async fn put_move(&mut self, m: &MoveRow) -> Result<()> {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        sqlx::query(
            "INSERT INTO moves (id, remote_id, remote_name, image, path, volume_id, source_api,
                                source_volume, keep_source_image, rate_limit, state, state_reason,
                                synced_bytes, total_bytes, rate, created_at, updated_at, finished_at,
                                cold, drain_id)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT (id) DO UPDATE SET volume_id = excluded.volume_id,
                rate_limit = excluded.rate_limit, state = excluded.state,
                state_reason = excluded.state_reason, synced_bytes = excluded.synced_bytes,
                total_bytes = excluded.total_bytes, rate = excluded.rate,
                updated_at = excluded.updated_at, finished_at = excluded.finished_at",
        )
        .bind(m.id.to_string())
        .bind(m.remote_id.to_string())
        .bind(&m.remote_name)
        .bind(&m.image)
        .bind(&m.path)
        .bind(m.volume_id.map(|v| v.to_string()))
        .bind(&m.source_api)
        .bind(&m.source_volume)
        .bind(m.keep_source_image)
        .bind(n(m.rate_limit))
        .bind(enum_str(m.state))
        .bind(&m.state_reason)
        .bind(n(m.synced_bytes))
        .bind(n(m.total_bytes))
        .bind(n(m.rate))
        .bind(ts(m.created_at))
        .bind(ts(m.updated_at))
        .bind(m.finished_at.map(ts))
        .bind(m.cold.map(enum_str))
        .bind(m.drain_id.map(|d| d.to_string()))
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// Records a drain, new or with a new rate limit.
    pub async fn put_drain(&mut self, d: &DrainRow) -> Result<()> {
        sqlx::query(
            "INSERT INTO drains (id, source_api, rate_limit, created_at) VALUES (?, ?, ?, ?)
             ON CONFLICT (id) DO UPDATE SET rate_limit = excluded.rate_limit",
        )
        .bind(d.id.to_string())
        .bind(&d.source_api)
        .bind(i64::try_from(d.rate_limit).unwrap_or(i64::MAX))
        .bind(ts(d.created_at))
        .execute(self.conn())
        .await?;
        Ok(())
    }
}
