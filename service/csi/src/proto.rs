//! The generated CSI v1 messages, and server and client stubs.

#![allow(missing_docs, clippy::all, clippy::pedantic)]
tonic::include_proto!("csi.v1");
