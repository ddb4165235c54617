//! An image keeps its allocation: a `full` image served `nowait` or
//! `threaded` is never punched, so discard-heavy use leaves it eligible for
//! `direct`; a `sparse` one still gives space back; `allocate` makes a
//! punched image eligible again while its volume serves.

use serde_json::json;

use crate::{Scratch, Vm, fio_ok, fio_verify, run, sh};

/// `len` bytes of `dev` at `off`, read O_DIRECT.
fn read_at(dev: &str, off_mib: u64, len_mib: u64) -> Vec<u8> {
    let out = run(
        "dd",
        &[
            &format!("if={dev}"),
            "bs=1M",
            &format!("skip={off_mib}"),
            &format!("count={len_mib}"),
            "iflag=direct",
            "status=none",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn random_at(dev: &str, off_mib: u64, len_mib: u64) {
    sh(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={dev}"),
            "bs=1M",
            &format!("seek={off_mib}"),
            &format!("count={len_mib}"),
            "oflag=direct",
            "status=none",
        ],
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_image_stays_direct_eligible_through_discards_on_nowait_and_threaded() {
    let vm = Vm::start().await;
    // mkfs.xfs wants at least 300 MB; it discards the whole device.
    vm.image("keep", Scratch::Xfs, 304, "full").await;
    // dm's nowait is a linear table over a private ublk worker.
    for (backend, policy) in [("ublk", "nowait"), ("ublk", "threaded"), ("dm", "nowait")] {
        let name = format!("keep-{backend}-{policy}");
        let v = vm
            .volume(json!({"name": name, "image": "keep", "backend": backend, "dispatch": policy}))
            .await;
        assert_eq!(v["dispatch"], policy, "{v}");
        let dev = v["device"].as_str().unwrap().to_string();
        sh("mkfs.xfs", &["-q", "-f", &dev]);
        // WRITE_ZEROES over data reads back as zeros.
        random_at(&dev, 1, 2);
        assert!(read_at(&dev, 1, 2).iter().any(|&b| b != 0));
        sh("blkdiscard", &["-z", "-o", "1MiB", "-l", "2MiB", &dev]);
        assert!(
            read_at(&dev, 1, 2).iter().all(|&b| b == 0),
            "{policy}: zeroed range reads back zeros"
        );
        sh("blkdiscard", &["-o", "64MiB", "-l", "64MiB", &dev]);
        sh("blkdiscard", &["-z", "-o", "160MiB", "-l", "32MiB", &dev]);
        sh("blkdiscard", &[&dev]);
        let img = vm.s.get("/v1/images/keep").await.body;
        assert_eq!(img["allocation"], "full", "{img}");
        assert!(
            img["allocated_bytes"].as_u64().unwrap() >= 304 << 20,
            "{img}"
        );
        // Live to direct: no hole, no unwritten extent.
        let a =
            vm.s.patch(
                &format!("/v1/volumes/{name}"),
                json!({"dispatch": "direct"}),
            )
            .await;
        assert_eq!(a.status.as_u16(), 200, "{policy}: {}", a.body);
        assert_eq!(a.body["dispatch"], "direct", "{}", a.body);
        fio_ok(fio_verify(&dev, "24M", &[]));
        vm.delete(&name).await;
    }
    // `auto` picks direct for it.
    let v = vm
        .volume(json!({"name": "keep-auto", "image": "keep", "backend": "ublk"}))
        .await;
    assert_eq!(v["dispatch"], "direct", "{v}");
    vm.delete("keep-auto").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sparse_image_gives_space_back_and_allocate_makes_it_direct_eligible_under_io() {
    let vm = Vm::start().await;
    vm.image("thin", Scratch::Xfs, 64, "sparse").await;
    let v = vm
        .volume(json!({"name": "thin", "image": "thin", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    random_at(&dev, 0, 16);
    sh("sync", &[]);
    let allocated = |b: &serde_json::Value| b["allocated_bytes"].as_u64().unwrap();
    let before = allocated(&vm.s.get("/v1/images/thin").await.body);
    assert!(before >= 16 << 20, "{before}");
    // Discard punches: the file's allocated bytes drop.
    sh("blkdiscard", &["-o", "0", "-l", "16MiB", &dev]);
    let after = allocated(&vm.s.get("/v1/images/thin").await.body);
    assert!(
        after < 1 << 20,
        "discard gave space back: {before} -> {after}"
    );

    // Allocate while fio verify writes and reads it.
    let fio = fio_verify(&dev, "48M", &[]);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let a = vm.s.post("/v1/images/thin/allocate", json!(null)).await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    assert_eq!(a.body["allocation"], "full", "{}", a.body);
    fio_ok(fio);
    // From now on the volume does not punch: discards leave it eligible.
    sh("blkdiscard", &[&dev]);
    let a =
        vm.s.patch("/v1/volumes/thin", json!({"dispatch": "direct"}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    fio_ok(fio_verify(&dev, "24M", &[]));
    vm.delete("thin").await;
}
