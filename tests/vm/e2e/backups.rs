//! Backups of live volumes: a ublk and a dm volume on xfs (which shares
//! extents) backed up while a sequence writer and fio `--verify` write to
//! them; the restore holds one moment (every write completed before the
//! request, none begun after the answer, none torn), and an ext4 written
//! and fsynced during a backup mounts from the restore after its journal is
//! replayed. On ext4, which cannot share extents, the worker copies the
//! moment first (copy-before-write); a writable loop volume there, whose
//! writes no worker sees, is refused with the snapshot's remedy.

use std::time::Instant;

use serde_json::{Value, json};

use crate::harness::assert_error;
use crate::snapshots::{
    LoopDev, Mounted, assert_files_kept, check_sequence, file_writer, held_us, longest_writes,
    writes_under,
};
use crate::{Scratch, Vm, fio_ok, sh};

/// A VM whose service backs up to a directory on the guest's plain ext4
/// disk (the guest's tmpfs is its memory).
async fn vm_with_target() -> (Vm, tempfile::TempDir) {
    let plain = std::env::var("SCRATCH_PLAIN").expect("SCRATCH_PLAIN: run in the VM");
    let target = tempfile::Builder::new()
        .prefix("bp-target")
        .tempdir_in(plain)
        .unwrap();
    let vm = Vm::start_with_args(&["--backup-target", target.path().to_str().unwrap()]).await;
    (vm, target)
}

/// Starts a backup of `image`: the 202's backup.
async fn start_backup(vm: &Vm, image: &Value, name: &str) -> Value {
    let a =
        vm.s.post(
            &format!("/v1/images/{}/backups", image["id"].as_str().unwrap()),
            json!({"name": name}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 202, "{}\n{}", a.body, vm.s.log_text());
    a.body
}

/// Waits until backup `b` ended; panics unless it is done.
async fn backup_done(vm: &Vm, b: &Value) -> Value {
    let id = b["id"].as_str().unwrap();
    vm.ended(&format!("/v1/backups/{id}"), "running", "done")
        .await
}

/// Restores backup `b` into image `name` on `k`; panics unless it becomes
/// ready. Its file.
async fn restored(vm: &Vm, b: &Value, name: &str, k: Scratch) -> String {
    let path = vm.root(k).join(format!("{name}.img"));
    let a =
        vm.s.post(
            "/v1/images",
            json!({"name": name, "path": path, "restore_from": b["id"]}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 202, "{}", a.body);
    vm.ended(&format!("/v1/images/{name}"), "copying", "ready")
        .await;
    path.display().to_string()
}

/// A live volume backed up under the sequence writer and fio: the restore
/// holds one moment. Returns the line the bench notes read.
async fn live_round(vm: &Vm, backend: &str, dispatch: &str, on: Scratch) -> String {
    let name = format!("bk-{backend}-{dispatch}");
    let alloc = if dispatch == "direct" {
        "full"
    } else {
        "sparse"
    };
    let src = vm.image(&name, on, 1024, alloc).await;
    let v = vm
        .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": dispatch}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    // fio over 64 MiB: the backup stores what it touched, and only the
    // verify is asserted.
    let (mut fio, writer) = writes_under(&dev, 64 << 20).await;
    let last = writer.completed() - 1;
    let t0 = Instant::now();
    let b = start_backup(vm, &src, "live").await;
    let t1 = Instant::now();
    assert!(
        fio.try_wait().unwrap().is_none(),
        "fio ended before the backup's moment: it did not run during it"
    );
    // Writes go on after the answer: none of them may be in the backup.
    writer.wait_for(writer.completed() + 128).await;
    let times = writer.finish();
    fio_ok(fio);
    let done = backup_done(vm, &b).await;
    let held = held_us(vm, &src, &src, "backup_started").await;
    if dispatch == "direct" {
        let v = vm.s.get(&format!("/v1/volumes/{name}")).await.body;
        assert_eq!(
            v["dispatch"], "nowait",
            "a direct map must leave shared extents: {v}"
        );
    }
    let path = restored(vm, &done, &format!("{name}-r"), Scratch::Ext4).await;
    let later = check_sequence(&path, last, &times, t1);
    let (during, outside) = longest_writes(&times, t0, t1);
    eprintln!(
        "{name}: sequence of {} writes, last before the request {last}, {later} later ones in the backup; {} chunks, {} bytes stored",
        times.len(),
        done["chunks"],
        done["stored_bytes"]
    );
    vm.delete(&name).await;
    format!(
        "BACKUP-PAUSE backend={backend} dispatch={dispatch} fs={on:?} held_us={held} max_write_ms_during={:.1} max_write_ms_outside={:.1}",
        during.as_secs_f64() * 1e3,
        outside.as_secs_f64() * 1e3
    )
}

/// ext4 on a live volume, files written and fsynced during a backup: the
/// restore mounts (journal replay), holds every file fsynced before the
/// request, and checks clean.
async fn filesystem_round(vm: &Vm, backend: &str, dispatch: &str, on: Scratch) {
    let name = format!("fsbk-{backend}-{dispatch}");
    let src = vm.image(&name, on, 256, "sparse").await;
    let v = vm
        .volume(json!({"name": name, "image": name, "backend": backend, "dispatch": dispatch}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let mnt = vm.root(Scratch::Tmpfs).join(format!("mnt-{name}"));
    let again = vm.root(Scratch::Tmpfs).join(format!("mnt-{name}-r"));
    sh("mkfs.ext4", &["-q", "-F", &dev]);
    let mounted = Mounted::new(&dev, &mnt, &[]);
    let writer = file_writer(&mnt);
    writer.wait_for(8).await;
    let synced = writer.completed();
    let b = start_backup(vm, &src, "fs").await;
    writer.wait_for(synced + 8).await;
    assert!(writer.running(), "{name}: the file writer died");
    writer.finish();
    let done = backup_done(vm, &b).await;
    let path = restored(vm, &done, &format!("{name}-r"), Scratch::Plain).await;
    let lo = LoopDev::new(std::path::Path::new(&path));
    let restored_mounted = Mounted::new(&lo.0, &again, &[]);
    assert_files_kept(&again, synced, &format!("{name}: the restore"));
    restored_mounted.unmount();
    sh("e2fsck", &["-fn", &lo.0]);
    drop(lo);
    mounted.unmount();
    vm.delete(&name).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_ublk_and_dm_volume_back_up_one_moment_and_restore_a_filesystem_that_mounts() {
    let (vm, _target) = vm_with_target().await;
    let mut lines = Vec::new();
    // dm `nowait` serves through a private ublk worker, which holds the
    // moment as ublk's does; a `direct` volume's move to `nowait` for a
    // shared extent is the snapshot's, tested with the snapshots. On ext4
    // the worker copies the moment before the backup reads it.
    for (backend, dispatch, on) in [
        ("ublk", "nowait", Scratch::Xfs),
        ("dm", "nowait", Scratch::Ext4),
    ] {
        let started = Instant::now();
        lines.push(live_round(&vm, backend, dispatch, on).await);
        eprintln!(
            "{backend} {dispatch}: live round in {:?}",
            started.elapsed()
        );
    }
    for (backend, dispatch, on) in [
        ("ublk", "threaded", Scratch::Ext4),
        ("dm", "nowait", Scratch::Xfs),
    ] {
        let started = Instant::now();
        filesystem_round(&vm, backend, dispatch, on).await;
        eprintln!(
            "{backend} {dispatch}: filesystem round in {:?}",
            started.elapsed()
        );
    }
    eprintln!("{}", lines.join("\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_writable_loop_volume_on_ext4_is_refused_a_backup_with_the_remedy_and_nothing_changes() {
    let (vm, _target) = vm_with_target().await;
    // The loop driver cannot hold its I/O, and no worker sees its writes.
    let name = "e-loop";
    let src = vm.image(name, Scratch::Ext4, 64, "sparse").await;
    let v = vm
        .volume(json!({"name": name, "image": name, "backend": "loop"}))
        .await;
    crate::direct_write_ok(v["device"].as_str().unwrap());
    let before = vm.snapshot().await;
    let a =
        vm.s.post(
            &format!("/v1/images/{}/backups", src["id"].as_str().unwrap()),
            json!({"name": "one"}),
        )
        .await;
    assert_error(&a, 409, "volume_attached_snapshot_unsupported");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(name), "the refusal names the volume: {msg}");
    assert!(msg.contains("DELETE /v1/volumes/"), "the remedy: {msg}");
    assert_eq!(vm.snapshot().await, before, "a refusal changed something");
    // The remedy works: without the writable volume, the backup reads the
    // image and a read-only volume may serve meanwhile.
    vm.delete(name).await;
    let ro = vm
        .volume(json!({"name": name, "image": name, "backend": "loop", "read_only": true}))
        .await;
    assert_eq!(ro["read_only"], true, "{ro}");
    let b = start_backup(&vm, &src, "one").await;
    backup_done(&vm, &b).await;
    vm.delete(name).await;
}

/// A VM whose service backs up to a directory held mid-way: each backup
/// waits after each chunk while the gate file exists (`gate_backup`).
async fn vm_with_gated_target() -> (Vm, tempfile::TempDir) {
    let plain = std::env::var("SCRATCH_PLAIN").expect("SCRATCH_PLAIN: run in the VM");
    let target = tempfile::Builder::new()
        .prefix("bp-target")
        .tempdir_in(plain)
        .unwrap();
    let vm = Vm::start_with_env_and_args(
        &[("BLOCKPLANE_TEST_FAULT", "gate_backup")],
        &["--backup-target", target.path().to_str().unwrap()],
    )
    .await;
    (vm, target)
}

/// Holds a backup of `image` after its first chunk (no writable volume
/// serves it: it reads the image's file), sends `writer` (`what` it is), and
/// asserts 409 `backup_source_busy` naming the backup with nothing changed
/// (the service's state, devices, dm tables and files). Then lets the
/// backup end, `done`.
async fn refused_while_backed_up(
    vm: &Vm,
    image: &Value,
    what: &str,
    writer: impl AsyncFnOnce() -> blockplane_client::Answer,
) {
    let gate = vm.s.data.join("run/backup-gate");
    std::fs::create_dir_all(gate.parent().unwrap()).unwrap();
    std::fs::write(&gate, b"").unwrap();
    let b = start_backup(vm, image, "held").await;
    let id = b["id"].as_str().unwrap().to_string();
    crate::eventually(
        std::time::Duration::from_secs(120),
        "the backup to read its first chunk",
        async || {
            vm.s.get(&format!("/v1/backups/{id}")).await.body["done_bytes"]
                .as_u64()
                .unwrap_or(0)
                > 0
        },
    )
    .await;
    // The backup reads the image through the page cache, which the
    // service's sampler then reports on a direct-I/O volume (a warning that
    // comes and goes with the sampler's clock, not with the refusal): drop
    // it, and wait until no volume warns, before the state is taken.
    sh("sysctl", &["-q", "vm.drop_caches=1"]);
    crate::eventually(
        std::time::Duration::from_secs(120),
        "no page-cache warning on a volume",
        async || {
            vm.s.get("/v1/volumes")
                .await
                .body
                .as_array()
                .unwrap()
                .iter()
                .all(|v| v["warnings"].as_array().is_none_or(|w| w.is_empty()))
        },
    )
    .await;
    let before = vm.snapshot().await;
    let a = writer().await;
    assert_error(&a, 409, "backup_source_busy");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&id),
        "{what}: the refusal names the backup: {msg}"
    );
    assert_eq!(
        vm.snapshot().await,
        before,
        "{what} was refused but changed something"
    );
    std::fs::remove_file(&gate).unwrap();
    backup_done(vm, &b).await;
}

/// A 16 MiB image `name` on xfs with data in each of its four chunks (a
/// backup skips holes: an empty image would end at once).
async fn image_with_data(vm: &Vm, name: &str) -> Value {
    let img = vm.image(name, Scratch::Xfs, 16, "sparse").await;
    crate::snapshots::write_range(img["path"].as_str().unwrap(), 0, &vec![0x5au8; 16 << 20]);
    img
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_refuses_a_handover_of_a_read_only_volume_and_nothing_changes() {
    let (vm, _target) = vm_with_gated_target().await;
    let img = image_with_data(&vm, "bh").await;
    vm.volume(json!({"name": "bh", "image": "bh", "backend": "ublk", "read_only": true}))
        .await;
    refused_while_backed_up(&vm, &img, "a handover", async || {
        vm.s.post("/v1/volumes/bh/handover", json!({})).await
    })
    .await;
    vm.delete("bh").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_refuses_a_patch_to_writable_and_nothing_changes() {
    let (vm, _target) = vm_with_gated_target().await;
    let img = image_with_data(&vm, "bw").await;
    // Made read-only live (one created read-only never turns writable).
    vm.volume(json!({"name": "bw", "image": "bw", "backend": "ublk"}))
        .await;
    let a =
        vm.s.patch("/v1/volumes/bw", json!({"read_only": true}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    refused_while_backed_up(&vm, &img, "PATCH read_only false", async || {
        vm.s.patch("/v1/volumes/bw", json!({"read_only": false}))
            .await
    })
    .await;
    let a =
        vm.s.patch("/v1/volumes/bw", json!({"read_only": false}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "after the backup: {}", a.body);
    vm.delete("bw").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_refuses_an_unlock_of_a_writable_volume_and_nothing_changes() {
    let (mut vm, _target) = vm_with_gated_target().await;
    let path = vm.root(Scratch::Xfs).join("bu.img");
    let a =
        vm.s.post(
            "/v1/images",
            json!({"name": "bu", "path": path,
                   "create": {"size_bytes": 24u64 << 20, "encryption": {"key": "bu-key"}}}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    let img = a.body;
    let v = vm
        .volume(json!({"name": "bu", "image": "bu", "backend": "ublk", "key": "bu-key"}))
        .await;
    // Its plaintext device gone behind the service's back, as after a
    // reboot: the writable volume is locked.
    assert!(vm.s.signal(rustix::process::Signal::TERM).success());
    let dev = v["device"].as_str().unwrap();
    sh(
        "cryptsetup",
        &["close", dev.trim_start_matches("/dev/mapper/")],
    );
    vm.s.restart().await;
    let locked = vm.s.get("/v1/volumes/bu").await.body;
    assert_eq!(locked["state"], "locked", "{locked}");
    refused_while_backed_up(&vm, &img, "an unlock", async || {
        vm.s.post("/v1/volumes/bu/unlock", json!({"key": "bu-key"}))
            .await
    })
    .await;
    let a =
        vm.s.post("/v1/volumes/bu/unlock", json!({"key": "bu-key"}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "after the backup: {}", a.body);
    vm.delete("bu").await;
}

/// A standby of a live ublk volume's backups (on this same service, which
/// is what a second host's service does over the shared target) follows a
/// second backup taken under the file writer, refuses a volume until it is
/// activated, and once activated serves a filesystem that mounts with
/// every file the second backup's moment had synced, and checks clean.
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_of_a_live_ublk_volumes_backups_mounts_after_activation() {
    let (vm, _target) = vm_with_target().await;
    let name = "sb-src";
    let src = vm.image(name, Scratch::Xfs, 128, "sparse").await;
    let v = vm
        .volume(json!({"name": name, "image": name, "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let dev = v["device"].as_str().unwrap().to_string();
    let mnt = vm.root(Scratch::Tmpfs).join("mnt-sb-src");
    sh("mkfs.ext4", &["-q", "-F", &dev]);
    let mounted = Mounted::new(&dev, &mnt, &[]);
    let writer = file_writer(&mnt);
    writer.wait_for(8).await;
    let b = start_backup(&vm, &src, "one").await;
    backup_done(&vm, &b).await;

    let path = vm.root(Scratch::Plain).join("sb.img");
    let a =
        vm.s.post(
            "/v1/images",
            json!({"name": "sb", "path": path, "standby_of": name}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 202, "{}", a.body);
    vm.ended("/v1/images/sb", "copying", "ready").await;

    writer.wait_for(writer.completed() + 8).await;
    let synced = writer.completed();
    let b = start_backup(&vm, &src, "two").await;
    writer.wait_for(synced + 8).await;
    assert!(writer.running(), "the file writer died");
    writer.finish();
    let two = backup_done(&vm, &b).await;
    let c = vm.s.post("/v1/images/sb/standby/check", json!({})).await;
    assert_eq!(c.status.as_u16(), 200, "{}", c.body);
    crate::eventually(
        std::time::Duration::from_secs(300),
        "the standby to hold backup two",
        async || {
            let s = vm.s.get("/v1/images/sb").await.body;
            s["standby"]["backup_id"] == two["id"] && s["standby"]["applying"] == false
        },
    )
    .await;
    let refused =
        vm.s.post(
            "/v1/volumes",
            json!({"name": "sb", "image": "sb", "backend": "ublk"}),
        )
        .await;
    assert_error(&refused, 409, "image_is_standby");

    let act = vm.s.post("/v1/images/sb/activate", json!({})).await;
    assert_eq!(act.status.as_u16(), 200, "{}", act.body);
    assert_eq!(act.body["backup_id"], two["id"], "{}", act.body);
    let sv = vm
        .volume(json!({"name": "sb", "image": "sb", "backend": "ublk", "dispatch": "nowait"}))
        .await;
    let sdev = sv["device"].as_str().unwrap().to_string();
    let again = vm.root(Scratch::Tmpfs).join("mnt-sb");
    let standby_mounted = Mounted::new(&sdev, &again, &[]);
    assert_files_kept(&again, synced, "the activated standby");
    standby_mounted.unmount();
    sh("e2fsck", &["-fn", &sdev]);
    vm.delete("sb").await;
    mounted.unmount();
    vm.delete(name).await;
}
