//! The CSI driver.

/// The generated CSI v1 messages, and server and client stubs.
pub mod proto {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("csi.v1");
}
