//! blockplane's HTTP API as types: the request and answer bodies of `/v1`
//! and the stable codes of its errors ([`model`]). The vocabulary every
//! other crate speaks: the service serves these types, the client
//! (`blockplane-client`) sends them. No I/O here, so a crate that only
//! names the model pulls in no runtime.

pub mod model;
