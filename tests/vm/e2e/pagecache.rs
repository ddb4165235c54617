//! Page-cache hygiene on a ublk volume: the seeds' effect (buffered reads of
//! the device, as `blkid` does, leave pages a direct-I/O data path then
//! pays for) shown in stats, `/metrics`, the volume's warnings and an
//! event, and removed by a policy switch.

use std::time::Duration;

use serde_json::{Value, json};

use crate::{Scratch, Vm, eventually, sh};

fn device_bytes(st: &Value) -> u64 {
    st["page_cache"]["device_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("page_cache.device_bytes: {st}"))
}

/// The value of `name{volume="<volume>"}` in exposition text.
fn gauge(text: &str, name: &str, volume: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("volume=\"{volume}\"")))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

fn warned(v: &Value) -> bool {
    v["warnings"].as_array().is_some_and(|w| {
        w.iter()
            .any(|w| w.as_str().is_some_and(|w| w.contains("page cache holds")))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn buffered_reads_of_a_ublk_device_are_shown_warned_and_dropped_by_a_switch() {
    let vm = Vm::start().await;
    vm.image("pc", Scratch::Ext4, 32, "full").await;
    let v = vm
        .volume(json!({"name": "pc", "image": "pc", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let (dev, id) = (v["device"].as_str().unwrap(), v["id"].as_str().unwrap());
    let st = vm.s.get("/v1/volumes/pc/stats").await.body;
    assert!(device_bytes(&st) < 1 << 20, "clean after attach: {st}");
    // The kernel drops a device's cache at its last close: pages stay
    // behind a user that keeps it open (a VM, a long fio run), as here.
    let holder = std::fs::File::open(dev).unwrap();
    sh(
        "dd",
        &[&format!("if={dev}"), "of=/dev/null", "bs=4k", "count=4096"],
    );
    let st = vm.s.get("/v1/volumes/pc/stats").await.body;
    assert!(
        device_bytes(&st) >= 15 << 20,
        "after 16 MiB of buffered reads: {st}"
    );
    eventually(
        Duration::from_secs(40),
        "the page-cache warning",
        async || warned(&vm.s.get("/v1/volumes/pc").await.body),
    )
    .await;
    assert_eq!(
        vm.event_kinds(id)
            .await
            .iter()
            .filter(|k| *k == "volume_page_cache")
            .count(),
        1
    );
    // The gauges are the sampler's last look (every 10 s), which may have
    // been taken while dd still read: wait for a look after it.
    eventually(
        Duration::from_secs(40),
        "the device gauge after the reads",
        async || {
            let text = vm.s.get_text("/metrics").await;
            gauge(&text, "blockplane_volume_page_cache_device_bytes", "pc")
                .is_some_and(|b| b >= (15 << 20) as f64)
        },
    )
    .await;
    let text = vm.s.get_text("/metrics").await;
    assert_eq!(
        gauge(&text, "blockplane_volume_page_cache_warning", "pc"),
        Some(1.0),
        "{text}"
    );

    // A live switch of the data path drops them, the holder still open.
    vm.set_dispatch("pc", "threaded").await;
    let st = vm.s.get("/v1/volumes/pc/stats").await.body;
    assert!(device_bytes(&st) < 1 << 20, "dropped by the switch: {st}");
    eventually(
        Duration::from_secs(40),
        "the warning to clear",
        async || !warned(&vm.s.get("/v1/volumes/pc").await.body),
    )
    .await;
    drop(holder);
    vm.delete("pc").await;
}
