//! Cold moves: another host's volume that no consumer here uses, brought
//! here (`POST /v1/moves`).
//!
//! The engine is a live move's ([`super::moves`]): this host asks the
//! exporting host to let it connect (exporting the volume, or allowing this
//! host on its export), connects a remote volume of its own under the
//! image's name, and moves it. Nobody opens that remote volume's node, so
//! no consumer sees a remote phase. When the move ends, the remote volume
//! goes: once `done` the data is the local volume's alone (and the export
//! went with the exporting host's volume); otherwise what the move did to
//! the export is undone first.

use std::sync::Arc;

use super::error::Result;
use super::fabric_error::MoveError;
use super::moves::Origin;
use super::{Created, Manager};
use crate::store::MoveRow;
use blockplane_api::model::{
    ColdExport, ColdMoveRequest, CreateRemoteRequest, DeleteExportQuery, Export, ExportAuth,
    ExportRequest, Move, MoveState, StartMoveRequest,
};
use blockplane_client::{Client, Endpoint};

impl Manager {
    /// `POST /v1/moves`: connects to the exporting host's volume and moves
    /// it here. Whatever was done on either host before a refusal is
    /// undone.
    pub(crate) async fn start_cold_move(self: &Arc<Self>, req: ColdMoveRequest) -> Result<Move> {
        self.cold_move(req, None).await
    }

    /// A cold move, part of `drain` when given.
    pub(super) async fn cold_move(
        self: &Arc<Self>,
        req: ColdMoveRequest,
        drain: Option<uuid::Uuid>,
    ) -> Result<Move> {
        let invalid = |field, reason: String| MoveError::Invalid {
            remote: req.image.clone(),
            field,
            reason,
        };
        super::names::validate_name("image", &req.image)?;
        let endpoint =
            Endpoint::parse(&req.source_api).map_err(|e| invalid("source_api", e.to_string()))?;
        if self.house.store.remote(&req.image).await?.is_some() {
            return Err(MoveError::RemoteNameTaken(req.image.clone()).into());
        }
        let client = Client::new(endpoint, self.peer_token.clone());
        let source = client
            .volume(&req.volume)
            .await
            .map_err(|e| MoveError::Source {
                subject: format!("cold move into image '{}'", req.image),
                reason: format!(
                    "the exporting host's API did not show volume '{}': {e}",
                    req.volume
                ),
            })?;
        if source.encrypted && req.key.is_none() {
            return Err(MoveError::SourceEncrypted {
                subject: format!("cold move into image '{}'", req.image),
                volume: source.name,
            }
            .into());
        }
        let host = self.remotes.host_nqn().to_string();
        let (export, cold) = allow_here(&client, &source.name, &host)
            .await
            .map_err(|reason| MoveError::Source {
                subject: format!("cold move into image '{}'", req.image),
                reason,
            })?;
        let connected = self.connect_cold(&req, &export, &host).await;
        let remote = match connected {
            Ok(remote) => remote,
            Err(e) => {
                undo_export(&client, &source.name, cold, &host).await.ok();
                return Err(e);
            }
        };
        let start = StartMoveRequest {
            image: req.image.clone(),
            path: req.path.clone(),
            source_api: req.source_api.clone(),
            keep_source_image: req.keep_source_image,
            rate_limit_bytes_per_sec: req.rate_limit_bytes_per_sec,
            key: req.key.clone(),
        };
        let origin = Origin {
            cold: Some(cold),
            drain,
        };
        match self.begin_move(&remote, start, origin).await {
            Ok(m) => Ok(m),
            Err(e) => {
                if let Err(e) = self.remotes.delete(&remote).await {
                    tracing::warn!(remote = %remote, error = %e, "a cold move's remote volume stays");
                }
                undo_export(&client, &source.name, cold, &host).await.ok();
                Err(e)
            }
        }
    }

    /// The remote volume of a cold move, connected with the keys the
    /// exporting host answered; its id.
    async fn connect_cold(
        &self,
        req: &ColdMoveRequest,
        export: &Export,
        host: &str,
    ) -> Result<String> {
        let invalid = |reason: String| MoveError::Source {
            subject: format!("cold move into image '{}'", req.image),
            reason,
        };
        let keys = export
            .hosts
            .iter()
            .find(|h| h.host_nqn == host)
            .ok_or_else(|| {
                invalid("the exporting host's export does not allow this host".into())
            })?;
        let address = export.addresses.first().ok_or_else(|| {
            invalid("the exporting host exports on no address (--export-address)".into())
        })?;
        let created = self
            .remotes
            .create(CreateRemoteRequest {
                name: req.image.clone(),
                address: address.clone(),
                nqn: export.nqn.clone(),
                secret: keys.secret.clone(),
                ctrl_secret: keys.ctrl_secret.clone(),
                read_only: false,
            })
            .await?;
        match created {
            Created::New(r) => Ok(r.id.to_string()),
            Created::Existing(r) => Err(invalid(format!(
                "remote volume '{}' connects that export already",
                r.name
            ))
            .into()),
        }
    }

    /// Lets the remote volumes of cold moves that ended go (`moves` is
    /// every move, read once by the follower): first what the move did to
    /// the exporting host's export is undone (unless the move is `done`:
    /// the export went with the volume), then the remote volume is
    /// deleted. Retried at every follow until both hold.
    pub(super) async fn settle_cold_moves(&self, moves: &[MoveRow]) -> Result<()> {
        let remotes = self.house.store.remotes().await?;
        for m in moves {
            let Some(cold) = m.cold else { continue };
            if !m.state.ended() || !remotes.iter().any(|r| r.id == m.remote_id) {
                continue;
            }
            if m.state != MoveState::Done {
                let Ok(endpoint) = Endpoint::parse(&m.source_api) else {
                    continue;
                };
                let client = Client::new(endpoint, self.peer_token.clone());
                let host = self.remotes.host_nqn().to_string();
                if let Err(e) = undo_export(&client, &m.source_volume, cold, &host).await {
                    tracing::debug!(move_id = %m.id, error = %e, "the exporting host's export is not undone yet");
                    continue;
                }
            }
            if let Err(e) = self.remotes.delete(&m.remote_id.to_string()).await {
                tracing::warn!(move_id = %m.id, error = %e, "a cold move's remote volume stays");
            }
        }
        Ok(())
    }
}

/// Asks the exporting host to let this host connect to `volume`: exports
/// it to this host alone, or adds this host to its export; the export
/// with this host's keys, and what was done. Why not, in words.
async fn allow_here(
    client: &Client,
    volume: &str,
    host: &str,
) -> std::result::Result<(Export, ColdExport), String> {
    let (req, cold) = match client.export(volume).await {
        Ok(e) => {
            let mut hosts: Vec<String> = e.hosts.iter().map(|h| h.host_nqn.clone()).collect();
            let cold = if hosts.iter().any(|h| h == host) {
                ColdExport::HostAllowed
            } else {
                hosts.push(host.to_string());
                ColdExport::HostAdded
            };
            let req = ExportRequest {
                hosts,
                read_only: e.read_only,
                auth: e.auth,
                // Granted when the export was made; the same request.
                insecure_loopback: e.auth == ExportAuth::None,
            };
            (req, cold)
        }
        Err(blockplane_client::Error::Refused { status, .. }) if status.as_u16() == 404 => (
            ExportRequest {
                hosts: vec![host.to_string()],
                ..Default::default()
            },
            ColdExport::Made,
        ),
        Err(e) => {
            return Err(format!(
                "the exporting host's API did not show volume '{volume}''s export: {e}"
            ));
        }
    };
    match client.put_export(volume, &req).await {
        Ok(export) => Ok((export, cold)),
        Err(e) => Err(format!(
            "the exporting host would not export volume '{volume}' to this host: {e}"
        )),
    }
}

/// Undoes what a cold move did to the exporting host's export of
/// `volume`. A volume or export gone already counts as undone.
async fn undo_export(
    client: &Client,
    volume: &str,
    cold: ColdExport,
    host: &str,
) -> std::result::Result<(), blockplane_client::Error> {
    let gone = |r: std::result::Result<(), blockplane_client::Error>| match r {
        Err(blockplane_client::Error::Refused { status, .. }) if status.as_u16() == 404 => Ok(()),
        other => other,
    };
    match cold {
        ColdExport::HostAllowed => Ok(()),
        // Forced: this host's own connection goes next.
        ColdExport::Made => gone(
            client
                .delete_export_with(volume, &DeleteExportQuery { force: true })
                .await,
        ),
        ColdExport::HostAdded => {
            let e = match client.export(volume).await {
                Ok(e) => e,
                Err(e) => return gone(Err(e)),
            };
            let req = ExportRequest {
                hosts: e
                    .hosts
                    .iter()
                    .map(|h| h.host_nqn.clone())
                    .filter(|h| h != host)
                    .collect(),
                read_only: e.read_only,
                auth: e.auth,
                insecure_loopback: e.auth == ExportAuth::None,
            };
            gone(client.put_export(volume, &req).await.map(|_| ()))
        }
    }
}
