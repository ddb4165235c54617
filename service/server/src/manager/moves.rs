//! Moves: a remote volume's data brought to this host while its consumer
//! keeps the device it opened.
//!
//! The consumer's device is the remote volume's dm node. A move makes a
//! local image and a dm volume on it (the local leg), then changes that
//! node's table three times, each a load then a suspend and resume:
//!
//! 1. `linear` over the NVMe namespace (the remote leg): as step 25 made it;
//! 2. dm-raid `raid1` of the remote leg and the local volume (on two
//!    metadata legs of its own, [`super::move_metadata`]), the local leg
//!    rebuilt from the remote one by the kernel in the background while
//!    every write goes to both. md's raid1 acknowledges a write only once a
//!    leg that is in sync holds it, and until the rebuild ends that is the
//!    remote leg alone: nothing acknowledged exists only on the local leg;
//! 3. `linear` over the local volume, once dm-raid says both legs are in
//!    sync and idle.
//!
//! Then the connection goes and the exporting host is told to let its
//! export and volume go. The registry records each step before or after
//! the kernel makes it such that a restart reads the node's live table
//! and goes on from there ([`Manager::follow_moves`]): the kernel's mirror
//! keeps running while this service is down.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use time::OffsetDateTime;
use uuid::Uuid;

use super::blocking::blocking;
use super::error::{Error, Result};
use super::fabric_error::MoveError;
use super::{Created, Manager};
use crate::store::{MoveRow, RemoteRow};
use blockplane_api::model::{
    Allocation, BackendChoice, ColdExport, CreateEncryption, CreateImageFile, CreateImageRequest,
    CreateVolumeRequest, DEFAULT_MAX_IO_BYTES, DEFAULT_QUEUE_DEPTH, DeleteExportQuery,
    DeleteImageQuery, DispatchPolicy, ExportAuth, ExportMove, Key, Move, MoveState,
    PatchMoveRequest, PatchVolumeRequest, RemoteState, StartMoveRequest,
};
use blockplane_client::{Client, Endpoint};
use blockplane_system::dm::{self, raid1};
use blockplane_system::fabrics;

/// How long a move's disconnect waits for the namespace's /dev node to go.
const HEAD_GONE: std::time::Duration = std::time::Duration::from_secs(30);

/// The smallest rate limit: dm-raid counts in KiB/s.
pub(super) const MIN_RATE: u64 = 1024;

/// What the remote volume's node maps now, read from its live table.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    /// The remote leg alone (before the mirror, or after a reboot lost it).
    Remote,
    /// The mirror, with what dm-raid says of it.
    Mirror(raid1::Status),
    /// The local volume alone: the switch is made.
    Local,
    /// No node, or a table this move did not make.
    Other(String),
}

/// Where a move comes from besides its remote volume.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Origin {
    /// A cold move: what it did to the exporting host's export.
    pub(super) cold: Option<ColdExport>,
    /// The drain it is part of.
    pub(super) drain: Option<Uuid>,
}

/// What a step of a move leaves to do once the remote volume's lock is
/// let go.
enum Then {
    Nothing,
    /// Delete the local volume and image of a move that ended short.
    UndoLocal,
    /// Tell the exporting host to let go; first put the local volume on
    /// its fastest path when the step has just disconnected.
    Release {
        disconnected: bool,
    },
}

impl Manager {
    /// `POST /v1/remotes/{id}/move`: makes the local image and volume and
    /// mirrors the remote volume's node onto them; the copy then runs in
    /// the kernel, followed once a second.
    pub(crate) async fn start_move(
        self: &Arc<Self>,
        remote: &str,
        req: StartMoveRequest,
    ) -> Result<Move> {
        self.begin_move(remote, req, Origin::default()).await
    }

    /// A move of remote volume `remote`, from `origin`.
    pub(super) async fn begin_move(
        self: &Arc<Self>,
        remote: &str,
        req: StartMoveRequest,
        origin: Origin,
    ) -> Result<Move> {
        let row = self.remote_row(remote).await?;
        let mut m = {
            let _remote = self.house.locks.volumes.lock(&row.name).await;
            let row = self.remote_row(&row.id.to_string()).await?;
            let source_volume = self.check_move(&row, &req).await?;
            let a = row.attachment.clone().ok_or(MoveError::NotAttached {
                remote: row.name.clone(),
                state: "not connected",
            })?;
            let now = OffsetDateTime::now_utc();
            let m = MoveRow {
                id: Uuid::new_v4(),
                remote_id: row.id,
                remote_name: row.name.clone(),
                image: req.image.clone(),
                path: req.path.clone(),
                volume_id: None,
                source_api: req.source_api.clone(),
                source_volume,
                keep_source_image: req.keep_source_image,
                rate_limit: req.rate_limit_bytes_per_sec,
                state: MoveState::Syncing,
                state_reason: None,
                synced_bytes: 0,
                total_bytes: a.size_bytes,
                rate: 0,
                created_at: now,
                updated_at: now,
                finished_at: None,
                cold: origin.cold,
                drain_id: origin.drain,
            };
            // Recorded first (the registry allows one running move per
            // remote volume): a crash before the mirror leaves a move the
            // next start fails cleanly, never a local image nobody
            // accounts for. Until the mirror is made the follower leaves
            // it to this request.
            self.starting
                .lock()
                .expect("starting poisoned")
                .insert(m.id);
            let message = format!(
                "move {} of remote volume '{}' started: its data goes into image '{}' ({}) here",
                m.id, row.name, m.image, m.path
            );
            if let Err(e) = self.record_move(&m, "move_started", &message).await {
                self.starting
                    .lock()
                    .expect("starting poisoned")
                    .remove(&m.id);
                return Err(e);
            }
            m
        };
        let made = self.make_mirror(&mut m, req.key).await;
        self.starting
            .lock()
            .expect("starting poisoned")
            .remove(&m.id);
        made?;
        self.move_view(m).await
    }

    /// The local leg (an image and a dm volume on it, made without the
    /// remote volume's lock: the volume's own name lock may be the same),
    /// then the mirror, under the lock again; a failure ends the move
    /// `failed` with nothing of it left.
    async fn make_mirror(self: &Arc<Self>, m: &mut MoveRow, key: Option<Key>) -> Result<()> {
        match self.make_local_leg(m, m.total_bytes, key).await {
            Ok(volume) => m.volume_id = Some(volume),
            Err(e) => {
                self.fail_move(m, &format!("its local image could not be made: {e}"))
                    .await?;
                return Err(e);
            }
        }
        let message = format!("move {}: volume '{}' serves the local leg", m.id, m.image);
        self.record_move(m, "move_local_leg", &message).await?;
        let mirrored = {
            let _remote = self.house.locks.volumes.lock(&m.remote_name).await;
            match self.remote_row(&m.remote_id.to_string()).await {
                Ok(row) => self.mirror(&row, m).await,
                Err(e) => Err(e),
            }
        };
        if let Err(e) = mirrored {
            let reason = format!("the mirror could not be made: {e}");
            self.fail_move(m, &reason).await?;
            self.undo_local_leg(m).await;
            return Err(e);
        }
        let message = format!(
            "move {}: remote volume '{}' mirrors its remote device and volume '{}'; the local leg is being copied",
            m.id, m.remote_name, m.image
        );
        self.record_move(m, "move_syncing", &message).await
    }

    /// The remote volume called so.
    pub(super) async fn remote_row(&self, id_or_name: &str) -> Result<RemoteRow> {
        self.house.store.remote(id_or_name).await?.ok_or_else(|| {
            super::fabric_error::RemoteError::NotFound(id_or_name.to_string()).into()
        })
    }

    /// Every rule a move's request meets before anything is made; the
    /// exporting host's volume name, read from the export's NQN.
    async fn check_move(&self, row: &RemoteRow, req: &StartMoveRequest) -> Result<String> {
        let invalid = |field, reason: String| MoveError::Invalid {
            remote: row.name.clone(),
            field,
            reason,
        };
        super::names::validate_name("image", &req.image)?;
        Endpoint::parse(&req.source_api).map_err(|e| invalid("source_api", e.to_string()))?;
        if req.rate_limit_bytes_per_sec != 0 && req.rate_limit_bytes_per_sec < MIN_RATE {
            return Err(invalid(
                "rate_limit_bytes_per_sec",
                format!(
                    "{} is below {MIN_RATE} (0 means no limit)",
                    req.rate_limit_bytes_per_sec
                ),
            )
            .into());
        }
        if let Some(m) = self.house.store.move_of_remote(row.id).await?
            && !m.state.ended()
        {
            return Err(MoveError::Running {
                remote: row.name.clone(),
                id: m.id,
            }
            .into());
        }
        if row.state != RemoteState::Attached {
            return Err(MoveError::NotAttached {
                remote: row.name.clone(),
                state: match row.state {
                    RemoteState::Moved => "moved here already",
                    RemoteState::Reconnecting => "reconnecting",
                    RemoteState::Connecting => "connecting",
                    _ => "in error",
                },
            }
            .into());
        }
        if row.read_only {
            return Err(invalid(
                "remote",
                "it is read-only here, and the mirror must write its local leg: make it writable for the move (PATCH /v1/remotes/{id} read_only=false)".into(),
            )
            .into());
        }
        // `nqn.2026-12.dev.blockplane:<instance>:<volume>`
        let volume = row
            .nqn
            .strip_prefix("nqn.2026-12.dev.blockplane:")
            .and_then(|rest| rest.split_once(':'))
            .map(|(_, v)| v.to_string())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| MoveError::NotBlockplane {
                remote: row.name.clone(),
                nqn: row.nqn.clone(),
            })?;
        // Asked now, so that a move that could not end never starts: the
        // exporting host answers, has the volume, and says whether it is
        // encrypted.
        let client = Client::new(
            Endpoint::parse(&req.source_api).map_err(|e| invalid("source_api", e.to_string()))?,
            self.peer_token.clone(),
        );
        let source = client
            .volume(&volume)
            .await
            .map_err(|e| MoveError::Source {
                subject: format!("remote volume '{}'", row.name),
                reason: format!("the exporting host's API did not show volume '{volume}': {e}"),
            })?;
        if source.encrypted && req.key.is_none() {
            return Err(MoveError::SourceEncrypted {
                subject: format!("remote volume '{}'", row.name),
                volume,
            }
            .into());
        }
        Ok(volume)
    }

    /// Makes the local image (sparse, the remote's size, encrypted with
    /// `key` when given) and a dm volume on it; its id.
    async fn make_local_leg(
        self: &Arc<Self>,
        m: &MoveRow,
        size: u64,
        key: Option<Key>,
    ) -> Result<Uuid> {
        self.create_image(CreateImageRequest {
            name: m.image.clone(),
            path: m.path.clone(),
            create: Some(CreateImageFile {
                // An encrypted image's data follows its LUKS2 header: the
                // plaintext must hold every byte of the remote.
                size_bytes: match key {
                    Some(_) => size + super::encryption::HEADER_BYTES,
                    None => size,
                },
                allocation: Allocation::Sparse,
                encryption: key.clone().map(|key| CreateEncryption { key }),
            }),
            clone_from: None,
            restore_from: None,
            standby_of: None,
            allocation: None,
            labels: Default::default(),
        })
        .await?;
        let created = self
            .volumes
            .create_volume(CreateVolumeRequest {
                name: m.image.clone(),
                image: m.image.clone(),
                backend: BackendChoice::Dm,
                dispatch: DispatchPolicy::Auto,
                read_only: false,
                queues: None,
                queue_depth: DEFAULT_QUEUE_DEPTH,
                max_io_bytes: DEFAULT_MAX_IO_BYTES,
                qos: None,
                key,
            })
            .await;
        match created {
            Ok(Created::New(v)) => Ok(v.id),
            Ok(Created::Existing(v)) => Err(Error::VolumeExists {
                name: v.name,
                differences: "a volume of that name exists: a move makes its own".into(),
            }),
            Err(e) => {
                let _ = self
                    .images
                    .delete_image(
                        &m.image,
                        DeleteImageQuery {
                            delete_file: true,
                            erase: false,
                        },
                    )
                    .await;
                Err(e)
            }
        }
    }

    /// Deletes the local volume and image of a move that will not finish.
    async fn undo_local_leg(&self, m: &MoveRow) {
        if let Some(v) = m.volume_id
            && let Err(e) = self.volumes.delete_volume(&v.to_string()).await
        {
            tracing::warn!(move_id = %m.id, error = %e, "a stopped move's local volume stays");
            return;
        }
        let q = DeleteImageQuery {
            delete_file: true,
            erase: false,
        };
        if let Err(e) = self.images.delete_image(&m.image, q).await {
            tracing::warn!(move_id = %m.id, error = %e, "a stopped move's local image stays");
        }
    }

    /// The local volume's device as `major:minor`, for a table: what the
    /// volume serves its users (an encrypted one's plaintext).
    async fn local_device(&self, m: &MoveRow) -> Result<String> {
        let id = m
            .volume_id
            .ok_or_else(|| Error::Internal(format!("move {} has no local volume yet", m.id)))?;
        let v = self.house.volume_row(&id.to_string()).await?;
        let (device, _) = super::exports::served_device(&v).ok_or_else(|| {
            Error::Internal(format!("move {}: volume '{}' has no device", m.id, v.name))
        })?;
        let rdev = std::fs::metadata(&device)
            .map_err(|e| Error::Internal(format!("move {}: {device}: {e}", m.id)))?
            .rdev();
        Ok(format!("{}:{}", libc::major(rdev), libc::minor(rdev)))
    }

    /// Loads a new mirror into the remote volume's node, on fresh metadata
    /// legs: the local leg rebuilt from its first sector.
    async fn mirror(&self, row: &RemoteRow, m: &MoveRow) -> Result<()> {
        let a = attachment(row)?;
        let local = self.local_device(m).await?;
        let (id, remote, rate) = (m.id, row.name.clone(), kib(m.rate_limit));
        let metadata = self.move_metadata.clone();
        blocking(move || {
            let legs = metadata.fresh(id).map_err(|source| MoveError::Metadata {
                id,
                remote: remote.clone(),
                source,
            })?;
            let [m0, m1] = legs.devs.map(|d| d.to_string());
            let table = raid1::table(
                a.size_bytes / 512,
                [Path::new(&a.nvme_device), Path::new(&local)],
                Some([Path::new(&m0), Path::new(&m1)]),
                rate,
                true,
            );
            // `legs` is dropped after the swap: the loaded table holds the
            // loop devices then, or they unbind.
            dm::swap(&a.dm_name, &table, false).map_err(|source| MoveError::Dm {
                id,
                remote,
                source,
            })
        })
        .await??;
        Ok(())
    }

    /// Loads the running mirror again with move `m`'s rate limit. On its
    /// metadata legs the rebuild goes on from where they say it is; a
    /// mirror without them (made before they were) is made anew, from the
    /// first sector. Whether the copy goes on.
    async fn set_rate(&self, row: &RemoteRow, m: &MoveRow) -> Result<bool> {
        let a = attachment(row)?;
        let (id, remote, rate) = (m.id, row.name.clone(), kib(m.rate_limit));
        let dm_name = a.dm_name.clone();
        let devices = blocking(move || dm::table(&dm_name))
            .await?
            .map_err(|source| MoveError::Dm {
                id,
                remote: remote.clone(),
                source,
            })?
            .targets
            .first()
            .and_then(|t| raid1::devices(&t.3));
        let Some([(m0, d0), (m1, d1)]) = devices.filter(|[(m0, _), _]| m0 != "-") else {
            self.mirror(row, m).await?;
            return Ok(false);
        };
        let table = raid1::table(
            a.size_bytes / 512,
            [Path::new(&d0), Path::new(&d1)],
            Some([Path::new(&m0), Path::new(&m1)]),
            rate,
            false,
        );
        blocking(move || dm::swap(&a.dm_name, &table, false))
            .await?
            .map_err(|source| MoveError::Dm { id, remote, source })?;
        Ok(true)
    }

    /// What the remote volume's node maps now.
    async fn node_of(&self, row: &RemoteRow, m: &MoveRow) -> Result<Node> {
        let Some(a) = row.attachment.clone() else {
            return Ok(Node::Other("no device".into()));
        };
        let local = match m.volume_id {
            Some(_) => Some(self.local_device(m).await?),
            None => None,
        };
        blocking(move || {
            let table = match dm::table(&a.dm_name) {
                Ok(t) => t,
                Err(e) => return Node::Other(e.to_string()),
            };
            match table.targets.first() {
                Some((_, _, kind, params)) if kind == "raid" => match dm::status(&a.dm_name) {
                    Ok(Some((_, _, kind, status))) => raid1::parse(&kind, &status)
                        .map(Node::Mirror)
                        .unwrap_or_else(|| Node::Other(status)),
                    Ok(None) => Node::Other(params.clone()),
                    Err(e) => Node::Other(e.to_string()),
                },
                Some((_, _, kind, params)) if kind == "linear" => {
                    let under = params.split_whitespace().next().unwrap_or_default();
                    if Some(under) == local.as_deref() {
                        Node::Local
                    } else {
                        Node::Remote
                    }
                }
                other => Node::Other(format!("{other:?}")),
            }
        })
        .await
    }

    /// Follows every running move once (the sampler calls it every
    /// second): records the copy's progress; once both legs are in sync,
    /// switches the node to the local leg and lets the exporting host go;
    /// fails a move whose local leg failed, back on the remote leg.
    pub(crate) async fn follow_moves(self: &Arc<Self>) -> Result<()> {
        let moves = self.house.store.moves().await?;
        for m in &moves {
            let starting = self
                .starting
                .lock()
                .expect("starting poisoned")
                .contains(&m.id);
            if m.state.ended() || starting {
                continue;
            }
            if let Err(e) = self.follow(m.id).await {
                tracing::warn!(move_id = %m.id, error = %e, "following a move failed");
            }
        }
        self.share_drains(&moves).await?;
        self.settle_cold_moves(&moves).await
    }

    /// One step of move `id`: what changes the node's table under the
    /// remote volume's lock, then what the step leaves to do without it
    /// (the local volume's own steps take its name's lock, which may be the
    /// same name).
    async fn follow(self: &Arc<Self>, id: Uuid) -> Result<()> {
        let then = {
            let Some(m) = self.house.store.move_row(id).await? else {
                return Ok(());
            };
            let _remote = self.house.locks.volumes.lock(&m.remote_name).await;
            let Some(mut m) = self.house.store.move_row(id).await? else {
                return Ok(());
            };
            match self.house.store.remote(&m.remote_id.to_string()).await? {
                _ if m.state.ended() => return Ok(()),
                Some(row) => self.step(row, &mut m).await?,
                None => {
                    self.fail_move(&mut m, "its remote volume is gone").await?;
                    Then::Nothing
                }
            }
        };
        let Some(m) = self.house.store.move_row(id).await? else {
            return Ok(());
        };
        match then {
            Then::Nothing => Ok(()),
            Then::UndoLocal => {
                self.undo_local_leg(&m).await;
                Ok(())
            }
            Then::Release { disconnected } => {
                if disconnected {
                    self.fastest_path(&m).await;
                }
                self.tell_source(m).await
            }
        }
    }

    /// One step of move `m` from what its node maps now, under the remote
    /// volume's lock.
    async fn step(&self, row: RemoteRow, m: &mut MoveRow) -> Result<Then> {
        if m.state == MoveState::Releasing {
            let disconnected = self.disconnect(row, m).await?;
            return Ok(Then::Release { disconnected });
        }
        if m.volume_id.is_none() {
            self.fail_move(m, "the service stopped before its local image was made")
                .await?;
            return Ok(Then::UndoLocal);
        }
        match self.node_of(&row, m).await? {
            Node::Mirror(s) if s.health.get(1) == Some(&raid1::Health::Dead) => {
                self.back_to_remote(&row, m, MoveState::Failed, "its local leg failed (an I/O error on this host's disk: full, or failing); the remote leg serves as before and holds every write")
                    .await?;
                Ok(Then::UndoLocal)
            }
            Node::Mirror(s) if s.health.first() == Some(&raid1::Health::Dead) => {
                // Past the loss timeout: the consumer's writes fail (md
                // never acknowledges one held only by the leg being
                // rebuilt), and the exporting host holds every write it
                // acknowledged. The node stays as it is for the operator.
                let reason = "its remote leg failed (the connection to the exporting host was lost past its loss timeout): the consumer's I/O fails; the exporting host holds every acknowledged write: connect it again as a new remote volume";
                self.fail_move(m, reason).await?;
                Ok(Then::Nothing)
            }
            Node::Mirror(s) if s.synced() => {
                self.switch(&row, m).await?;
                let disconnected = self.disconnect(row, m).await?;
                Ok(Then::Release { disconnected })
            }
            Node::Mirror(s) => {
                let done = s.done_sectors.min(s.total_sectors) * 512;
                let seconds = (OffsetDateTime::now_utc() - m.updated_at)
                    .as_seconds_f64()
                    .max(0.001);
                m.rate = (done.saturating_sub(m.synced_bytes) as f64 / seconds) as u64;
                m.synced_bytes = done;
                m.updated_at = OffsetDateTime::now_utc();
                let mut tx = self.house.store.begin().await?;
                tx.put_move(m).await?;
                tx.commit().await?;
                Ok(Then::Nothing)
            }
            Node::Local => {
                // Switched before a stop recorded it.
                m.synced_bytes = m.total_bytes;
                self.set_state(
                    m,
                    MoveState::Releasing,
                    None,
                    "move_switched",
                    "the node maps the local volume alone",
                )
                .await?;
                let disconnected = self.disconnect(row, m).await?;
                Ok(Then::Release { disconnected })
            }
            Node::Remote => {
                // The mirror is gone (a reboot): made again, the copy from
                // the start; the remote leg held every write meanwhile.
                self.mirror(&row, m).await?;
                m.synced_bytes = 0;
                let message = format!(
                    "move {}: the mirror was lost (a restart of the host) and is made again; the copy starts over",
                    m.id
                );
                self.record_move(m, "move_restarted", &message).await?;
                Ok(Then::Nothing)
            }
            Node::Other(what) => {
                self.fail_move(
                    m,
                    &format!("the remote volume's node maps what the move did not make: {what}"),
                )
                .await?;
                Ok(Then::Nothing)
            }
        }
    }

    /// Step 3: the node maps the local volume alone.
    async fn switch(&self, row: &RemoteRow, m: &mut MoveRow) -> Result<()> {
        let a = attachment(row)?;
        let local = self.local_device(m).await?;
        let table = vec![(
            0,
            a.size_bytes / 512,
            "linear".to_string(),
            format!("{local} 0"),
        )];
        let (id, remote) = (m.id, row.name.clone());
        blocking(move || dm::swap(&a.dm_name, &table, false))
            .await?
            .map_err(|source| MoveError::Dm { id, remote, source })?;
        m.synced_bytes = m.total_bytes;
        self.set_state(
            m,
            MoveState::Releasing,
            None,
            "move_switched",
            "both legs were in sync: the node maps the local volume alone",
        )
        .await
    }

    /// Step 4, under the remote volume's lock: the connection goes and the
    /// remote volume is `moved`, once; whether it was now.
    async fn disconnect(&self, mut row: RemoteRow, m: &MoveRow) -> Result<bool> {
        if row.state == RemoteState::Moved {
            return Ok(false);
        }
        if let Some(a) = row.attachment.clone() {
            let (controller, head) = (a.controller, a.nvme_device.clone());
            blocking(move || {
                fabrics::disconnect(controller)?;
                // The kernel removes the namespace's /dev node after the
                // controller: a connect made meanwhile that reuses the
                // instance would find the old node and lose it. Waited
                // for, bounded: the move is done either way.
                let end = std::time::Instant::now() + HEAD_GONE;
                while !head.is_empty()
                    && Path::new(&head).exists()
                    && std::time::Instant::now() < end
                {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Ok(())
            })
            .await?
            .map_err(|source| super::fabric_error::RemoteError::Fabrics {
                name: row.name.clone(),
                source,
            })?;
            row.attachment = Some(crate::store::RemoteAttachment {
                nvme_device: String::new(),
                ..a
            });
        }
        row.state = RemoteState::Moved;
        row.state_reason = None;
        row.updated_at = OffsetDateTime::now_utc();
        let mut tx = self.house.store.begin().await?;
        tx.update_remote(&row).await?;
        let message = format!(
            "remote volume '{}' is disconnected: its device serves volume '{}' here",
            row.name, m.image
        );
        tx.event(Some(row.id), None, "remote_moved", &message)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The local volume on `direct` where the direct-map rules allow it:
    /// the copy wrote every block of the sparse image, so they usually do.
    async fn fastest_path(&self, m: &MoveRow) {
        let Some(v) = m.volume_id else { return };
        let patch = PatchVolumeRequest {
            dispatch: Some(DispatchPolicy::Direct),
            qos: None,
            read_only: None,
        };
        if let Err(e) = self.volumes.patch_volume(&v.to_string(), patch).await {
            tracing::info!(move_id = %m.id, reason = %e, "the moved volume keeps its path");
        }
    }

    /// Step 4's end: the exporting host lets its export and volume go,
    /// done again every second until it holds (what is gone there already
    /// counts as done); the move is `done` then.
    async fn tell_source(&self, mut m: MoveRow) -> Result<()> {
        match self.let_go(&m).await {
            Ok(()) => {
                self.set_state(
                    &mut m,
                    MoveState::Done,
                    None,
                    "move_done",
                    "the exporting host let its export and volume go",
                )
                .await
            }
            Err(reason) if m.state_reason.as_deref() != Some(reason.as_str()) => {
                m.state_reason = Some(reason.clone());
                m.updated_at = OffsetDateTime::now_utc();
                let message = format!(
                    "move {}: the exporting host did not let go yet: {reason}",
                    m.id
                );
                self.record_move(&m, "move_release_waits", &message).await
            }
            Err(_) => Ok(()),
        }
    }

    /// Tells the exporting host to let its export go and delete its volume
    /// (and image, unless kept).
    async fn let_go(&self, m: &MoveRow) -> std::result::Result<(), String> {
        let endpoint = Endpoint::parse(&m.source_api).map_err(|e| e.to_string())?;
        let client = Client::new(endpoint, self.peer_token.clone());
        let gone = |r: std::result::Result<(), blockplane_client::Error>| match r {
            Err(blockplane_client::Error::Refused { status, .. }) if status.as_u16() == 404 => {
                Ok(())
            }
            other => other.map_err(|e| e.to_string()),
        };
        let volume = match client.volume(&m.source_volume).await {
            Ok(v) => v,
            Err(blockplane_client::Error::Refused { status, .. }) if status.as_u16() == 404 => {
                return Ok(());
            }
            Err(e) => return Err(e.to_string()),
        };
        // The exporting host refuses to delete an export while it cannot
        // tell that no host is connected to it (6.12's target does not say
        // which export a connection is to). One that admits this host
        // alone, by its key, has nobody connected once this host has
        // disconnected: forced then.
        let me = self.remotes.host_nqn();
        let force = match client.export(&m.source_volume).await {
            Ok(e) => e.auth == ExportAuth::Dhchap && e.hosts.iter().all(|h| h.host_nqn == me),
            Err(blockplane_client::Error::Refused { status, .. }) if status.as_u16() == 404 => {
                false
            }
            Err(e) => return Err(e.to_string()),
        };
        gone(
            client
                .delete_export_with(&m.source_volume, &DeleteExportQuery { force })
                .await,
        )?;
        gone(client.delete_volume(&m.source_volume).await)?;
        if !m.keep_source_image {
            let q = DeleteImageQuery {
                delete_file: true,
                erase: false,
            };
            gone(client.delete_image(&volume.image_id.to_string(), &q).await)?;
        }
        Ok(())
    }

    /// The node back on the remote leg alone (which holds every
    /// acknowledged write), the move ended so; its local image is the
    /// caller's to delete, without the remote volume's lock.
    async fn back_to_remote(
        &self,
        row: &RemoteRow,
        m: &mut MoveRow,
        state: MoveState,
        reason: &str,
    ) -> Result<()> {
        let a = attachment(row)?;
        let (id, remote) = (m.id, row.name.clone());
        blocking(move || {
            dm::linear::reload(
                &a.dm_name,
                Path::new(&a.nvme_device),
                a.size_bytes / 512,
                false,
            )
        })
        .await?
        .map_err(|source| MoveError::Dm { id, remote, source })?;
        let kind = match state {
            MoveState::Cancelled => "move_cancelled",
            _ => "move_failed",
        };
        self.set_state(m, state, Some(reason.to_string()), kind, reason)
            .await
    }

    /// `POST /v1/moves/{id}/cancel`: back on the remote leg, the local
    /// image gone; refused once the node maps the local volume alone.
    pub(crate) async fn cancel_move(&self, id: &str) -> Result<Move> {
        let m = self.move_of(id).await?;
        let m = {
            let _remote = self.house.locks.volumes.lock(&m.remote_name).await;
            let mut m = self.move_of(id).await?;
            let starting = self
                .starting
                .lock()
                .expect("starting poisoned")
                .contains(&m.id);
            match m.state {
                MoveState::Syncing if !starting => {
                    let row = self.remote_row(&m.remote_id.to_string()).await?;
                    self.back_to_remote(&row, &mut m, MoveState::Cancelled, "cancelled: the node serves the remote device again, which holds every write")
                        .await?;
                    m
                }
                MoveState::Syncing => {
                    return Err(MoveError::Ended {
                        id: m.id,
                        state: "starting",
                        rule: "its mirror is being made: cancel it once its start has answered",
                    }
                    .into());
                }
                MoveState::Releasing => {
                    return Err(MoveError::Ended {
                        id: m.id,
                        state: "releasing",
                        rule: "the node serves the local volume already and the connection is gone; the exporting host's release is retried until it holds",
                    }
                    .into());
                }
                s => {
                    return Err(MoveError::Ended {
                        id: m.id,
                        state: s.as_str(),
                        rule: "an ended move cannot be cancelled",
                    }
                    .into());
                }
            }
        };
        self.undo_local_leg(&m).await;
        self.move_view(m).await
    }

    /// `PATCH /v1/moves/{id}`: a new rate limit, live: the mirror's table
    /// loaded again with it, the copy going on from where it is.
    pub(crate) async fn patch_move(&self, id: &str, patch: PatchMoveRequest) -> Result<Move> {
        let m = self.move_of(id).await?;
        if let Some(drain) = m.drain_id {
            return Err(MoveError::InDrain { id: m.id, drain }.into());
        }
        self.set_move_rate(m.id, patch.rate_limit_bytes_per_sec)
            .await
    }

    /// Move `id`'s rate limit, live (a drain's share, or the operator's).
    pub(super) async fn set_move_rate(&self, id: Uuid, rate: u64) -> Result<Move> {
        let id = &id.to_string();
        let m = self.move_of(id).await?;
        let row = self.remote_row(&m.remote_id.to_string()).await?;
        let _remote = self.house.locks.volumes.lock(&row.name).await;
        let mut m = self.move_of(id).await?;
        if rate != 0 && rate < MIN_RATE {
            return Err(MoveError::Invalid {
                remote: row.name,
                field: "rate_limit_bytes_per_sec",
                reason: format!("{rate} is below {MIN_RATE} (0 means no limit)"),
            }
            .into());
        }
        if m.state != MoveState::Syncing {
            return Err(MoveError::Ended {
                id: m.id,
                state: m.state.as_str(),
                rule: "only a move that copies takes a rate limit",
            }
            .into());
        }
        if rate == m.rate_limit {
            return self.move_view(m).await;
        }
        m.rate_limit = rate;
        let goes_on = match self.node_of(&row, &m).await? {
            Node::Mirror(_) => self.set_rate(&row, &m).await?,
            _ => true,
        };
        if !goes_on {
            m.synced_bytes = 0;
        }
        let message = format!(
            "move {}: rate limit {}; the copy {}",
            m.id,
            match rate {
                0 => "none".to_string(),
                r => format!("{r} bytes/s"),
            },
            match goes_on {
                true => "goes on at it",
                false => "starts over at it (its mirror had no metadata legs)",
            }
        );
        m.updated_at = OffsetDateTime::now_utc();
        self.record_move(&m, "move_rate_limit", &message).await?;
        self.move_view(m).await
    }

    /// `GET /v1/moves`.
    pub(crate) async fn moves(&self) -> Result<Vec<Move>> {
        let mut out = Vec::new();
        for m in self.house.store.moves().await? {
            out.push(self.move_view(m).await?);
        }
        Ok(out)
    }

    /// `GET /v1/moves/{id}`.
    pub(crate) async fn get_move(&self, id: &str) -> Result<Move> {
        let m = self.move_of(id).await?;
        self.move_view(m).await
    }

    async fn move_of(&self, id: &str) -> Result<MoveRow> {
        let not_found = || Error::from(MoveError::NotFound(id.to_string()));
        let uuid = Uuid::parse_str(id).map_err(|_| not_found())?;
        self.house.store.move_row(uuid).await?.ok_or_else(not_found)
    }

    async fn move_view(&self, m: MoveRow) -> Result<Move> {
        Ok(Move {
            id: m.id,
            remote: m.remote_id,
            remote_name: m.remote_name,
            image: m.image,
            volume: m.volume_id,
            source_api: m.source_api,
            source_volume: m.source_volume,
            keep_source_image: m.keep_source_image,
            state: m.state,
            state_reason: m.state_reason,
            synced_bytes: m.synced_bytes,
            total_bytes: m.total_bytes,
            rate_bytes_per_sec: if m.state == MoveState::Syncing {
                m.rate
            } else {
                0
            },
            rate_limit_bytes_per_sec: m.rate_limit,
            created_at: m.created_at,
            finished_at: m.finished_at,
            cold: m.cold,
            drain: m.drain_id,
        })
    }

    /// Records `m` with an event, and tells the exporting host.
    async fn record_move(&self, m: &MoveRow, kind: &str, message: &str) -> Result<()> {
        let mut tx = self.house.store.begin().await?;
        tx.put_move(m).await?;
        tx.event(Some(m.remote_id), None, kind, message).await?;
        tx.commit().await?;
        self.tell_state(m);
        Ok(())
    }

    /// Tells the exporting host where move `m` is, in the background: its
    /// answer (or its silence, through a network cut) never holds the move
    /// up, and a word lost is replaced by the next one.
    fn tell_state(&self, m: &MoveRow) {
        let Ok(endpoint) = Endpoint::parse(&m.source_api) else {
            return;
        };
        let client = Client::new(endpoint, self.peer_token.clone());
        let word = ExportMove {
            move_id: m.id,
            host_nqn: self.remotes.host_nqn().to_string(),
            state: m.state,
            synced_bytes: m.synced_bytes,
            total_bytes: m.total_bytes,
            at: m.updated_at,
        };
        let (volume, id) = (m.source_volume.clone(), m.id);
        tokio::spawn(async move {
            if let Err(e) = client.note_export_move(&volume, &word).await {
                tracing::debug!(move_id = %id, error = %e, "the exporting host was not told");
            }
        });
    }

    /// Moves `m` to `state` (ended: with its end time), recorded with an
    /// event.
    async fn set_state(
        &self,
        m: &mut MoveRow,
        state: MoveState,
        reason: Option<String>,
        kind: &str,
        what: &str,
    ) -> Result<()> {
        let now = OffsetDateTime::now_utc();
        m.state = state;
        m.state_reason = reason;
        m.updated_at = now;
        if state.ended() {
            m.finished_at = Some(now);
        }
        if state.ended() || state == MoveState::Releasing {
            // No mirror of this move is made again.
            self.move_metadata.forget(m.id);
        }
        let message = format!(
            "move {} of remote volume '{}' is {}: {what}",
            m.id,
            m.remote_name,
            state.as_str()
        );
        self.record_move(m, kind, &message).await
    }

    /// Ends `m` as failed, with why.
    async fn fail_move(&self, m: &mut MoveRow, reason: &str) -> Result<()> {
        self.set_state(
            m,
            MoveState::Failed,
            Some(reason.to_string()),
            "move_failed",
            reason,
        )
        .await
    }
}

/// The remote volume's device: its node and the namespace under it.
fn attachment(row: &RemoteRow) -> Result<crate::store::RemoteAttachment> {
    row.attachment
        .clone()
        .ok_or_else(|| Error::Internal(format!("remote volume '{}' has no device", row.name)))
}

/// A rate limit in bytes/s as dm-raid's KiB/s (rounded up); none for 0.
fn kib(rate: u64) -> Option<u64> {
    (rate != 0).then(|| rate.div_ceil(1024))
}

#[cfg(test)]
mod tests {
    use super::kib;

    #[test]
    fn a_rate_limit_rounds_up_to_kib_and_zero_is_none() {
        assert_eq!(kib(0), None);
        assert_eq!(kib(1024), Some(1));
        assert_eq!(kib(1025), Some(2));
        assert_eq!(kib(64 << 20), Some(64 << 10));
    }
}
