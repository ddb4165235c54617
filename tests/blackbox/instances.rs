//! Two blockplane services on one host: different data dirs, one image root.

use rustix::process::Signal;
use serde_json::json;

use crate::harness::{Opts, Service, assert_error, loop_devices};

/// Loop devices whose backing file is `path`.
fn devices_over(path: &std::path::Path) -> Vec<String> {
    let path = path.display().to_string();
    loop_devices()
        .into_iter()
        .filter(|(_, backing)| *backing == path)
        .map(|(dev, _)| dev)
        .collect()
}

/// The first service's volume holds an OFD lock on its image: the second
/// service's attach is 409 `image_locked` naming the first's pid and changes
/// nothing; the lock is taken again when the first re-adopts its volume after
/// a restart, and released when the volume is deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_instance_cannot_attach_an_image_the_first_serves() {
    let mut first = Service::start().await;
    first.loop_volume("v", 8).await;
    let path = first.images.join("v-img.img");
    let second = Service::start_with(Opts {
        extra_roots: vec![first.images.clone()],
        ..Default::default()
    })
    .await;
    let r = second
        .post("/v1/images", json!({"name": "shared", "path": path}))
        .await;
    assert_eq!(r.status.as_u16(), 201, "{}", r.body);
    let attach = json!({"name": "w", "image": "shared", "backend": "loop"});

    let before = second.snapshot().await;
    let a = second.post("/v1/volumes", attach.clone()).await;
    assert_error(&a, 409, "image_locked");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("process {}", first.pid())), "{msg}");
    assert!(msg.contains("v-img.img"), "{msg}");
    assert_eq!(second.snapshot().await, before);
    assert_eq!(devices_over(&path).len(), 1, "{:?}", devices_over(&path));

    // A restarted first service takes the lock again when it re-adopts.
    assert!(first.signal(Signal::TERM).success());
    first.restart().await;
    let a = second.post("/v1/volumes", attach.clone()).await;
    assert_error(&a, 409, "image_locked");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("process {}", first.pid())), "{msg}");
    assert_eq!(devices_over(&path).len(), 1);

    // Deleting the volume lets the image go.
    assert_eq!(first.delete("/v1/volumes/v").await.status.as_u16(), 204);
    let a = second.post("/v1/volumes", attach).await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    assert_eq!(devices_over(&path).len(), 1);
    assert_eq!(second.delete("/v1/volumes/w").await.status.as_u16(), 204);
}
