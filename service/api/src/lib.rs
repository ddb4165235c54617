//! blockplane's HTTP API as types: the request and answer bodies of `/v1`
//! and the stable codes of its errors ([`model`]), and the one client that
//! speaks them ([`client`]). The service serves these types; the CLI and the
//! CSI driver call it with them.

pub mod client;
pub mod model;
