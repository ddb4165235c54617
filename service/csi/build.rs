//! Generates the CSI gRPC code from `proto/csi.proto`: `protox` parses the
//! proto in Rust (no `protoc` on the build machine), `tonic-prost-build`
//! writes the messages and the server and client stubs.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    let fds = protox::compile(["csi.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        // The client serves the test suite (tests/csi) and tools.
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
