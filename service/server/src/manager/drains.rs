//! Drains: several of another host's volumes brought here at once, under
//! one rate limit (`/v1/drains`).
//!
//! A drain is a set of moves ([`super::moves`], [`super::cold_moves`]) and
//! a limit they share: each move that copies gets an even share (at least
//! the kernel's smallest rate), set again whenever the number that copy
//! changes. The mirror's metadata legs make a new share cost nothing: the
//! copy goes on from where it is.

use std::path::Path;
use std::sync::Arc;

use time::OffsetDateTime;
use uuid::Uuid;

use super::Manager;
use super::error::Result;
use super::fabric_error::MoveError;
use super::moves::{MIN_RATE, Origin};
use crate::store::{DrainRow, MoveRow};
use blockplane_api::model::{
    ColdMoveRequest, Drain, DrainRequest, Move, MoveState, PatchDrainRequest, RemoteState,
    StartMoveRequest, Volume,
};
use blockplane_client::{Client, Endpoint};

impl Manager {
    /// `POST /v1/drains`: a move of each volume asked (every volume of the
    /// exporting host when none is): live for one this host has connected,
    /// cold otherwise. All start, or none: a refusal cancels those started.
    pub(crate) async fn start_drain(self: &Arc<Self>, req: DrainRequest) -> Result<Drain> {
        let invalid = |field, reason: String| MoveError::InvalidDrain { field, reason };
        let endpoint =
            Endpoint::parse(&req.source_api).map_err(|e| invalid("source_api", e.to_string()))?;
        let client = Client::new(endpoint, self.peer_token.clone());
        let mut volumes = Vec::new();
        if req.volumes.is_empty() {
            volumes = client.volumes().await.map_err(|e| MoveError::Source {
                subject: "drain".into(),
                reason: format!("the exporting host's API did not list its volumes: {e}"),
            })?;
        } else {
            for name in &req.volumes {
                volumes.push(client.volume(name).await.map_err(|e| MoveError::Source {
                    subject: "drain".into(),
                    reason: format!("the exporting host's API did not show volume '{name}': {e}"),
                })?);
            }
        }
        if volumes.is_empty() {
            return Err(MoveError::Source {
                subject: "drain".into(),
                reason: "the exporting host has no volume".into(),
            }
            .into());
        }
        let rate = req.rate_limit_bytes_per_sec;
        if rate != 0 && rate < MIN_RATE {
            return Err(invalid(
                "rate_limit_bytes_per_sec",
                format!("{rate} is below {MIN_RATE} (0 means no limit)"),
            )
            .into());
        }
        let encrypted: Vec<&str> = volumes
            .iter()
            .filter(|v| v.encrypted)
            .map(|v| v.name.as_str())
            .collect();
        if !encrypted.is_empty() {
            return Err(MoveError::SourceEncrypted {
                subject: "drain (it has no keys: move each encrypted volume alone, POST /v1/moves)"
                    .into(),
                volume: encrypted.join("', '"),
            }
            .into());
        }
        let drain = DrainRow {
            id: Uuid::new_v4(),
            source_api: req.source_api.clone(),
            rate_limit: rate,
            created_at: OffsetDateTime::now_utc(),
        };
        let mut tx = self.house.store.begin().await?;
        tx.put_drain(&drain).await?;
        tx.commit().await?;
        // Its moves' shares are this start's to set until all have started.
        self.starting
            .lock()
            .expect("starting poisoned")
            .insert(drain.id);
        let started = self
            .start_drain_moves(&req, &drain, &volumes, &client)
            .await;
        self.starting
            .lock()
            .expect("starting poisoned")
            .remove(&drain.id);
        started?;
        self.drain_view(drain).await
    }

    /// A move of each of `volumes`, each at its share of `drain`'s limit;
    /// the ones started are cancelled at the first refusal.
    async fn start_drain_moves(
        self: &Arc<Self>,
        req: &DrainRequest,
        drain: &DrainRow,
        volumes: &[Volume],
        client: &Client,
    ) -> Result<()> {
        let share = share(drain.rate_limit, volumes.len());
        let origin = Origin {
            cold: None,
            drain: Some(drain.id),
        };
        let mut started: Vec<Move> = Vec::new();
        for v in volumes {
            let path = Path::new(&req.dir)
                .join(format!("{}.img", v.name))
                .display()
                .to_string();
            let live = self.connected_remote(client, &v.name).await;
            let moved = match live {
                Some(remote) => {
                    let start = StartMoveRequest {
                        image: v.name.clone(),
                        path,
                        source_api: req.source_api.clone(),
                        keep_source_image: req.keep_source_images,
                        rate_limit_bytes_per_sec: share,
                        key: None,
                    };
                    self.begin_move(&remote, start, origin).await
                }
                None => {
                    let cold = ColdMoveRequest {
                        source_api: req.source_api.clone(),
                        volume: v.name.clone(),
                        image: v.name.clone(),
                        path,
                        keep_source_image: req.keep_source_images,
                        rate_limit_bytes_per_sec: share,
                        key: None,
                    };
                    self.cold_move(cold, Some(drain.id)).await
                }
            };
            match moved {
                Ok(m) => started.push(m),
                Err(e) => {
                    for m in &started {
                        if let Err(e) = self.cancel_move(&m.id.to_string()).await {
                            tracing::warn!(move_id = %m.id, error = %e, "a refused drain's move runs on");
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The remote volume here, attached, that connects the exporting
    /// host's export of `volume`, if one does.
    async fn connected_remote(&self, client: &Client, volume: &str) -> Option<String> {
        let export = client.export(volume).await.ok()?;
        let remotes = self.house.store.remotes().await.ok()?;
        remotes
            .into_iter()
            .find(|r| r.nqn == export.nqn && r.state == RemoteState::Attached)
            .map(|r| r.id.to_string())
    }

    /// `GET /v1/drains/{id}`.
    pub(crate) async fn get_drain(&self, id: &str) -> Result<Drain> {
        let d = self.drain_of(id).await?;
        self.drain_view(d).await
    }

    /// `PATCH /v1/drains/{id}`: the limit its moves share, live.
    pub(crate) async fn patch_drain(&self, id: &str, patch: PatchDrainRequest) -> Result<Drain> {
        let mut d = self.drain_of(id).await?;
        let rate = patch.rate_limit_bytes_per_sec;
        if rate != 0 && rate < MIN_RATE {
            return Err(MoveError::InvalidDrain {
                field: "rate_limit_bytes_per_sec",
                reason: format!("{rate} is below {MIN_RATE} (0 means no limit)"),
            }
            .into());
        }
        d.rate_limit = rate;
        let mut tx = self.house.store.begin().await?;
        tx.put_drain(&d).await?;
        tx.commit().await?;
        let moves = self.house.store.moves().await?;
        self.share_drain(&d, &moves).await;
        self.drain_view(d).await
    }

    /// Gives each drain's copying moves their share of its limit (the
    /// follower calls it every second with every move): set again only
    /// where it changed, as the number of moves that copy changes.
    pub(super) async fn share_drains(&self, moves: &[MoveRow]) -> Result<()> {
        let mut drains: Vec<Uuid> = moves
            .iter()
            .filter(|m| m.state == MoveState::Syncing)
            .filter_map(|m| m.drain_id)
            .collect();
        drains.sort();
        drains.dedup();
        for id in drains {
            if self
                .starting
                .lock()
                .expect("starting poisoned")
                .contains(&id)
            {
                continue;
            }
            if let Some(d) = self.house.store.drain(id).await? {
                self.share_drain(&d, moves).await;
            }
        }
        Ok(())
    }

    async fn share_drain(&self, d: &DrainRow, moves: &[MoveRow]) {
        let copying: Vec<&MoveRow> = moves
            .iter()
            .filter(|m| m.drain_id == Some(d.id) && m.state == MoveState::Syncing)
            .collect();
        let share = share(d.rate_limit, copying.len());
        for m in copying.into_iter().filter(|m| m.rate_limit != share) {
            if let Err(e) = self.set_move_rate(m.id, share).await {
                tracing::debug!(move_id = %m.id, drain = %d.id, error = %e, "a drain's share was not set");
            }
        }
    }

    async fn drain_of(&self, id: &str) -> Result<DrainRow> {
        let not_found = || MoveError::DrainNotFound(id.to_string());
        let uuid = Uuid::parse_str(id).map_err(|_| not_found())?;
        Ok(self.house.store.drain(uuid).await?.ok_or_else(not_found)?)
    }

    async fn drain_view(&self, d: DrainRow) -> Result<Drain> {
        let mut moves = Vec::new();
        for m in self.house.store.moves().await? {
            if m.drain_id == Some(d.id) {
                moves.push(self.get_move(&m.id.to_string()).await?);
            }
        }
        Ok(Drain {
            id: d.id,
            source_api: d.source_api,
            rate_limit_bytes_per_sec: d.rate_limit,
            synced_bytes: moves.iter().map(|m| m.synced_bytes).sum(),
            total_bytes: moves.iter().map(|m| m.total_bytes).sum(),
            moves,
            created_at: d.created_at,
        })
    }
}

/// Each of `n` copying moves' share of a drain's `limit` (0: none): even,
/// and never below the kernel's smallest rate.
fn share(limit: u64, n: usize) -> u64 {
    match (limit, n as u64) {
        (0, _) | (_, 0) => limit,
        (limit, n) => (limit / n).max(MIN_RATE),
    }
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn a_drain_shares_its_limit_evenly_and_never_below_a_kib() {
        assert_eq!(share(0, 3), 0);
        assert_eq!(share(3 << 20, 3), 1 << 20);
        assert_eq!(share(3 << 20, 0), 3 << 20);
        assert_eq!(share(4096, 8), 1024);
        assert_eq!(share(10 << 20, 4), (10 << 20) / 4);
    }
}
