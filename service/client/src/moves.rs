//! `/v1/remotes/{id}/move` and `/v1/moves`: a remote volume's data brought
//! to this host while its consumer keeps its device, or another host's
//! volume that no consumer here uses.

use hyper::Method;

use super::client::Client;
use super::error::Error;
use super::path::encode_segment;
use blockplane_api::model::{
    ColdMoveRequest, Drain, DrainRequest, Move, PatchDrainRequest, PatchMoveRequest,
    StartMoveRequest,
};

fn move_path(id: &str) -> String {
    format!("/v1/moves/{}", encode_segment(id))
}

impl Client {
    /// `POST /v1/remotes/{id}/move`: the move, copying (follow it with
    /// [`Client::get_move`]).
    pub async fn start_move(&self, remote: &str, req: &StartMoveRequest) -> Result<Move, Error> {
        let path = format!("/v1/remotes/{}/move", encode_segment(remote));
        self.send(Method::POST, &path, req).await
    }

    /// `POST /v1/moves`: another host's volume brought here, cold; the
    /// move, copying.
    pub async fn cold_move(&self, req: &ColdMoveRequest) -> Result<Move, Error> {
        self.send(Method::POST, "/v1/moves", req).await
    }

    /// `POST /v1/drains`: several volumes brought here under one limit.
    pub async fn start_drain(&self, req: &DrainRequest) -> Result<Drain, Error> {
        self.send(Method::POST, "/v1/drains", req).await
    }

    /// `GET /v1/drains/{id}`.
    pub async fn drain(&self, id: &str) -> Result<Drain, Error> {
        self.get(&format!("/v1/drains/{}", encode_segment(id)))
            .await
    }

    /// `PATCH /v1/drains/{id}`: the limit its moves share, live.
    pub async fn patch_drain(&self, id: &str, req: &PatchDrainRequest) -> Result<Drain, Error> {
        let path = format!("/v1/drains/{}", encode_segment(id));
        self.send(Method::PATCH, &path, req).await
    }

    /// `GET /v1/moves`: newest first.
    pub async fn moves(&self) -> Result<Vec<Move>, Error> {
        self.get("/v1/moves").await
    }

    /// `GET /v1/moves/{id}` (named `get_`: `move` is a keyword).
    pub async fn get_move(&self, id: &str) -> Result<Move, Error> {
        self.get(&move_path(id)).await
    }

    /// `PATCH /v1/moves/{id}`: a copying move's rate limit, live.
    pub async fn patch_move(&self, id: &str, req: &PatchMoveRequest) -> Result<Move, Error> {
        self.send(Method::PATCH, &move_path(id), req).await
    }

    /// `POST /v1/moves/{id}/cancel`: the node serves the remote device
    /// again.
    pub async fn cancel_move(&self, id: &str) -> Result<Move, Error> {
        let path = format!("{}/cancel", move_path(id));
        self.call(Method::POST, &path, None).await
    }
}
