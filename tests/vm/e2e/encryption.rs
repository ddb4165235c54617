//! Encrypted images in the VM: the plaintext through dm-crypt over each
//! backend's device, never in the image file; a live switch, a grow and a
//! read-only toggle under it; a restart that keeps it, and a lost
//! plaintext device (as a reboot leaves it) locked until its key unlocks it.

use std::process::{Command, Stdio};

use serde_json::{Value, json};

use crate::{Scratch, Vm, direct_write, fio_ok, fio_verify, run, sh};

const KEY: &str = "vm-test-key";

/// What the tests write through the plaintext device and look for in the file.
const PATTERN: &str = "BLOCKPLANE-PLAINTEXT-PATTERN-0123456789";

/// Creates an encrypted image of `mib` MiB on `k`; panics unless 201.
async fn encrypted_image(vm: &Vm, name: &str, k: Scratch, mib: u64, allocation: &str) -> Value {
    let path = vm.root(k).join(format!("{name}.img"));
    let a =
        vm.s.post(
            "/v1/images",
            json!({"name": name, "path": path,
                   "create": {"size_bytes": mib << 20, "allocation": allocation,
                              "encryption": {"key": KEY}}}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    a.body
}

/// Writes 1 MiB of [`PATTERN`] at the start of `dev`, bypassing the cache.
fn write_pattern(dev: &str) {
    let block = PATTERN.repeat((1 << 20) / PATTERN.len() + 1);
    let src = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(src.path(), &block.as_bytes()[..1 << 20]).unwrap();
    let out = run(
        "dd",
        &[
            &format!("if={}", src.path().display()),
            &format!("of={dev}"),
            "bs=1M",
            "count=1",
            "oflag=direct",
            "conv=fsync",
        ],
    );
    assert!(
        out.status.success(),
        "dd to {dev}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether the first MiB of `path` (a device or a file) holds the pattern.
fn holds_pattern(path: &str, whole: bool) -> bool {
    let mut args = vec![format!("if={path}"), "bs=1M".into(), "iflag=direct".into()];
    if !whole {
        args.push("count=1".into());
    }
    // dd reads past the page cache; grep searches (a debug build's own
    // search of a whole image took most of a minute under the emulator).
    let mut dd = Command::new("dd")
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let found = Command::new("grep")
        .args(["-q", "-a", "-F", PATTERN])
        .stdin(dd.stdout.take().unwrap())
        .status()
        .unwrap();
    // grep -q stops at the first match: dd may then end on a closed pipe.
    let read = dd.wait_with_output().unwrap();
    if found.success() {
        return true;
    }
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    assert_eq!(found.code(), Some(1), "grep failed on {path}");
    false
}

/// Whether `key` opens a key slot of the LUKS2 header on `dev`.
fn opens(dev: &str, key: &str) -> bool {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), key).unwrap();
    let key_file = format!("--key-file={}", file.path().display());
    run("cryptsetup", &["open", "--test-passphrase", &key_file, dev])
        .status
        .success()
}

/// Checks a volume on an encrypted image: its device is the plaintext,
/// what is written there reads back and is not in the image file.
fn check_plaintext(v: &Value, image_path: &str) {
    let dev = v["device"].as_str().unwrap();
    assert!(dev.starts_with("/dev/mapper/blockplane-crypt-"), "{v}");
    assert_eq!(v["encrypted"], true, "{v}");
    assert!(v["backing_device"].as_str().is_some(), "{v}");
    write_pattern(dev);
    assert!(
        holds_pattern(dev, false),
        "the plaintext does not read back"
    );
    assert!(
        !holds_pattern(image_path, true),
        "the plaintext is in the image file {image_path}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_backend_and_policy_serves_an_encrypted_image_and_keeps_it_so_across_changes() {
    let vm = Vm::start().await;
    let cases = [
        ("lp", "loop", "auto", Scratch::Xfs, "sparse"),
        ("ub", "ublk", "nowait", Scratch::Xfs, "sparse"),
        ("dd", "dm", "direct", Scratch::Ext4, "full"),
        ("dn", "dm", "nowait", Scratch::Xfs, "full"),
    ];
    let mut devices = Vec::new();
    for (name, backend, dispatch, k, allocation) in cases {
        let img = encrypted_image(&vm, name, k, 48, allocation).await;
        let path = img["path"].as_str().unwrap().to_string();
        // A wrong key changes nothing.
        let before = vm.snapshot().await;
        let a =
            vm.s.post(
                "/v1/volumes",
                json!({"name": name, "image": name, "backend": backend,
                       "dispatch": dispatch, "key": "not the key"}),
            )
            .await;
        assert_eq!(a.status.as_u16(), 403, "{}", a.body);
        assert_eq!(a.body["error"]["code"], "key_rejected", "{}", a.body);
        assert_eq!(
            vm.snapshot().await,
            before,
            "{name}: a wrong key changed something"
        );

        let v = vm
            .volume(json!({"name": name, "image": name, "backend": backend,
                           "dispatch": dispatch, "key": KEY}))
            .await;
        assert_eq!(v["size_bytes"], 32u64 << 20, "{name}: {v}");
        check_plaintext(&v, &path);
        let dev = v["device"].as_str().unwrap().to_string();
        devices.push(dev.clone());
        let size = sh("blockdev", &["--getsize64", &dev]);
        assert_eq!(size.trim(), (32u64 << 20).to_string(), "{name}");

        // fio across a live switch (the device under the cipher changes its
        // path; the plaintext device stays).
        let switch = match (backend, dispatch) {
            ("ublk", _) => Some("threaded"),
            ("dm", "direct") => Some("nowait"),
            ("dm", _) => Some("direct"),
            _ => None,
        };
        let fio = fio_verify(&dev, "4M", &[]);
        if let Some(to) = switch {
            let after = vm.set_dispatch(name, to).await;
            assert_eq!(
                after["device"], v["device"],
                "{name}: the plaintext device moved"
            );
        }
        fio_ok(fio);
        assert!(!holds_pattern(&path, true), "{name}: plaintext in the file");
    }

    // Keys rotate under I/O on a direct-mapped volume (its file is pinned:
    // the header is written through the device): the new key opens the
    // image, the old one no more.
    let dd = vm.s.get("/v1/volumes/dd").await.body;
    let fio = fio_verify(dd["device"].as_str().unwrap(), "4M", &[]);
    let a =
        vm.s.post(
            "/v1/images/dd/keys",
            json!({"key": KEY, "new_key": "rotated"}),
        )
        .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    assert_eq!(a.body["slot"], 1, "{}", a.body);
    let a =
        vm.s.delete_with("/v1/images/dd/keys/0", json!({"key": "rotated"}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    assert_eq!(a.body["encryption"]["key_slots"], json!([1]), "{}", a.body);
    let a =
        vm.s.delete_with("/v1/images/dd/keys/1", json!({"key": "rotated"}))
            .await;
    assert_eq!(a.status.as_u16(), 409, "{}", a.body);
    assert_eq!(a.body["error"]["code"], "last_key_slot", "{}", a.body);
    fio_ok(fio);
    let backing = dd["backing_device"].as_str().unwrap();
    assert!(
        opens(backing, "rotated"),
        "the new key does not open the image"
    );
    assert!(
        !opens(backing, KEY),
        "the removed key still opens the image"
    );

    // Read-only live: the plaintext device refuses writes too.
    let a =
        vm.s.patch("/v1/volumes/ub", json!({"read_only": true}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    let dev = a.body["device"].as_str().unwrap().to_string();
    let out = direct_write(&dev);
    assert!(
        !out.status.success(),
        "a write to the read-only plaintext device succeeded"
    );
    let a =
        vm.s.patch("/v1/volumes/ub", json!({"read_only": false}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    write_pattern(&dev);

    // A grow reaches the plaintext device (loop follows live).
    let a =
        vm.s.post("/v1/images/lp/resize", json!({"size_bytes": 64u64 << 20}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    let v = vm.s.get("/v1/volumes/lp").await.body;
    assert_eq!(v["size_bytes"], 48u64 << 20, "{v}");
    let size = sh("blockdev", &["--getsize64", v["device"].as_str().unwrap()]);
    assert_eq!(size.trim(), (48u64 << 20).to_string());

    // A snapshot holds the same header: encrypted, opened by the same key.
    encrypted_image(&vm, "sn", Scratch::Xfs, 24, "sparse").await;
    let a =
        vm.s.post("/v1/images/sn/snapshots", json!({"name": "sn-snap"}))
            .await;
    assert_eq!(a.status.as_u16(), 201, "{}", a.body);
    assert_eq!(a.body["encryption"]["key_slots"], json!([0]), "{}", a.body);
    let snap = vm
        .volume(
            json!({"name": "snap", "image": "sn-snap", "backend": "loop",
                       "read_only": true, "key": KEY}),
        )
        .await;
    assert_eq!(snap["encrypted"], true, "{snap}");
    vm.delete("snap").await;

    for ((name, ..), dev) in cases.iter().zip(&devices) {
        vm.delete(name).await;
        assert!(
            !std::path::Path::new(dev).exists(),
            "{dev} outlived its volume"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_keeps_the_plaintext_and_a_lost_one_is_locked_until_its_key_unlocks_it() {
    let mut vm = Vm::start().await;
    let img = encrypted_image(&vm, "rs", Scratch::Xfs, 48, "sparse").await;
    let path = img["path"].as_str().unwrap().to_string();
    let v = vm
        .volume(json!({"name": "rs", "image": "rs", "backend": "ublk", "key": KEY}))
        .await;
    check_plaintext(&v, &path);
    let dev = v["device"].as_str().unwrap().to_string();

    // A restart: the kernel holds the key, the plaintext stays.
    assert!(vm.s.signal(rustix::process::Signal::TERM).success());
    vm.s.restart().await;
    let after = vm.s.get("/v1/volumes/rs").await.body;
    assert_eq!(after["state"], "attached", "{after}");
    assert_eq!(after["device"], v["device"], "{after}");
    assert!(holds_pattern(&dev, false));

    // The plaintext device gone behind the service's back, as after a
    // reboot: the volume is locked, and says how to unlock it.
    assert!(vm.s.signal(rustix::process::Signal::TERM).success());
    let name = dev.trim_start_matches("/dev/mapper/");
    sh("cryptsetup", &["close", name]);
    vm.s.restart().await;
    let locked = vm.s.get("/v1/volumes/rs").await.body;
    assert_eq!(locked["state"], "locked", "{locked}");
    assert_eq!(locked["device"], Value::Null, "{locked}");
    assert!(
        locked["state_reason"].as_str().unwrap().contains("unlock"),
        "{locked}"
    );
    let a =
        vm.s.post("/v1/volumes/rs/unlock", json!({"key": "not the key"}))
            .await;
    assert_eq!(a.status.as_u16(), 403, "{}", a.body);
    assert!(!std::path::Path::new(&dev).exists());
    let a =
        vm.s.post("/v1/volumes/rs/unlock", json!({"key": KEY}))
            .await;
    assert_eq!(a.status.as_u16(), 200, "{}", a.body);
    assert_eq!(a.body["state"], "attached", "{}", a.body);
    assert_eq!(a.body["device"], v["device"], "{}", a.body);
    assert!(
        holds_pattern(&dev, false),
        "the data did not survive the lock"
    );
    vm.delete("rs").await;
}
