//! Identity service.

use blockplane_csi::proto::plugin_capability::{Type, service, volume_expansion};
use blockplane_csi::proto::{GetPluginCapabilitiesRequest, GetPluginInfoRequest, ProbeRequest};

use crate::Csi;

#[tokio::test]
async fn plugin_info_names_the_driver_and_its_version() {
    let csi = Csi::start().await;
    let info = csi
        .identity
        .clone()
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "csi.blockplane.io");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
}

#[tokio::test]
async fn a_driver_name_can_be_chosen() {
    let csi = Csi::start_with(Default::default(), &["--driver-name", "blk.example.com"]).await;
    let info = csi
        .identity
        .clone()
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "blk.example.com");
}

#[tokio::test]
async fn capabilities_offer_the_controller_topology_and_online_expansion() {
    let csi = Csi::start().await;
    let caps = csi
        .identity
        .clone()
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let mut services = Vec::new();
    let mut expansion = Vec::new();
    for c in caps {
        match c.r#type.unwrap() {
            Type::Service(s) => services.push(s.r#type),
            Type::VolumeExpansion(e) => expansion.push(e.r#type),
        }
    }
    services.sort();
    assert_eq!(
        services,
        vec![
            service::Type::ControllerService as i32,
            service::Type::VolumeAccessibilityConstraints as i32,
            service::Type::SnapshotMetadataService as i32
        ]
    );
    assert_eq!(expansion, vec![volume_expansion::Type::Online as i32]);
}

#[tokio::test]
async fn probe_is_ready_while_the_api_answers() {
    let mut csi = Csi::start().await;
    let ready = |csi: &Csi| {
        let mut c = csi.identity.clone();
        async move { c.probe(ProbeRequest {}).await.unwrap().into_inner().ready }
    };
    assert_eq!(ready(&csi).await, Some(true));
    csi.svc.kill();
    // The driver answers, and says it cannot work.
    assert_eq!(ready(&csi).await, Some(false));
    csi.svc.restart().await;
    assert_eq!(ready(&csi).await, Some(true));
}

/// grpc-core clients (Python here) send the %-encoded socket path as the
/// HTTP/2 `:authority` by default; the driver must answer them, not reset
/// the stream.
#[tokio::test]
async fn a_python_grpc_client_on_its_defaults_is_answered() {
    let csi = Csi::start().await;
    let python = std::env::var("BLOCKPLANE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = r#"
import sys, grpc
raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
for target in ("unix://" + sys.argv[1], "unix:" + sys.argv[1]):
    with grpc.insecure_channel(target) as ch:
        for i in range(3):
            info = ch.unary_unary("/csi.v1.Identity/GetPluginInfo", **raw)(b"", timeout=10)
            probe = ch.unary_unary("/csi.v1.Identity/Probe", **raw)(b"", timeout=10)
            print(target, info.hex(), probe.hex())
"#;
    let out = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(&csi.sock)
        .output()
        .await
        .expect("python with grpcio (set BLOCKPLANE_TEST_PYTHON)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python grpc client failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 6, "{stdout}");
    let name = hex(b"csi.blockplane.io");
    for line in lines {
        let [_, info, probe] = line.split(' ').collect::<Vec<_>>()[..] else {
            panic!("unexpected line {line}");
        };
        assert!(
            info.contains(&name),
            "GetPluginInfo names the driver: {line}"
        );
        // ProbeResponse { ready: true }: field 1, a BoolValue holding true.
        assert_eq!(probe, "0a020801", "Probe says ready: {line}");
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
