//! Identity service.

use blockplane::csi::proto::plugin_capability::{Type, service, volume_expansion};
use blockplane::csi::proto::{GetPluginCapabilitiesRequest, GetPluginInfoRequest, ProbeRequest};

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
            service::Type::VolumeAccessibilityConstraints as i32
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
