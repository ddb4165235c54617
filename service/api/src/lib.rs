//! blockplane's HTTP API as types: the request and answer bodies of `/v1`
//! ([`model`]) and the client that speaks them ([`client`]). The service
//! serves these types; the CLI and the CSI driver call it with them.

pub mod client;
pub mod model;
