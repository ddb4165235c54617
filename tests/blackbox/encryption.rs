//! Encrypted images on this host (no device-mapper here, so no dm-crypt: the
//! VM tests open their plaintext): LUKS2 created in the file, keys checked
//! and refused, crypto-erase, and the key kept out of every record — the
//! registry, the event log, the service's log, and the arguments and
//! environment of every process the service starts.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;

use crate::harness::{Opts, Service, assert_error};

/// A key no other text of the run contains.
fn unique_key() -> String {
    format!("key-{}", uuid::Uuid::new_v4().simple())
}

/// Whether `key` opens a key slot of the LUKS2 file `path`, as cryptsetup
/// itself says (the key on its standard input).
fn opens(path: &std::path::Path, key: &str) -> bool {
    let mut c = Command::new("cryptsetup")
        .args(["open", "--test-passphrase", "--key-file=-"])
        .arg(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("cryptsetup runs");
    c.stdin.take().unwrap().write_all(key.as_bytes()).unwrap();
    c.wait().unwrap().success()
}

/// Every process whose parent is `pid`, with its command line and
/// environment as /proc shows them.
fn children_of(pid: u32) -> Vec<(String, Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let dir = e.path();
        let Ok(stat) = std::fs::read_to_string(dir.join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: comm may hold spaces, so from its end.
        let Some(after) = stat.rsplit_once(") ") else {
            continue;
        };
        let ppid: u32 = after
            .1
            .split(' ')
            .nth(1)
            .unwrap_or("0")
            .parse()
            .unwrap_or(0);
        if ppid != pid {
            continue;
        }
        let comm = after
            .0
            .rsplit_once(" (")
            .map(|c| c.1.to_string())
            .unwrap_or_default();
        let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
        let environ = std::fs::read(dir.join("environ")).unwrap_or_default();
        out.push((comm, cmdline, environ));
    }
    out
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_encrypted_image_takes_only_its_key_and_no_record_keeps_it() {
    let s = Service::start_with(Opts {
        // Each key check takes about half a second here: long enough for
        // the scan of the service's children to see it.
        extra_args: vec!["--key-unlock-ms".into(), "500".into()],
        ..Default::default()
    })
    .await;
    let key = unique_key();
    let path = s.images.join("secret.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "secret", "path": path,
                   "create": {"size_bytes": 64u64 << 20, "encryption": {"key": key}}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let e = &a.body["encryption"];
    assert_eq!(e["format"], "luks2", "{}", a.body);
    assert_eq!(e["header_bytes"], 16u64 << 20, "{}", a.body);
    assert_eq!(e["key_slots"], json!([0]), "{}", a.body);
    assert!(
        opens(&path, &key),
        "cryptsetup does not open the file with its key"
    );
    assert!(!opens(&path, "another key"));

    // Refusals, each naming the image and changing nothing.
    let plain = s.image("plain", 4).await;
    let before = s.snapshot().await;
    let v = |extra: serde_json::Value| {
        let mut body = json!({"name": "v", "image": "secret", "backend": "loop"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let a = s.post("/v1/volumes", v(json!({}))).await;
    assert_error(&a, 422, "key_required");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'secret'")
    );
    // Watch the service's children while it checks a wrong key.
    let pid = s.pid();
    let watch = tokio::spawn(async move {
        let mut seen = Vec::new();
        for _ in 0..2000 {
            for (comm, cmdline, environ) in children_of(pid) {
                if comm == "cryptsetup" {
                    seen.push((cmdline, environ));
                }
            }
            if !seen.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen
    });
    let a = s
        .post("/v1/volumes", v(json!({"key": "a wrong key"})))
        .await;
    assert_error(&a, 403, "key_rejected");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'secret'")
    );
    let seen = watch.await.unwrap();
    assert!(
        !seen.is_empty(),
        "no cryptsetup child was seen while a key was checked"
    );
    for (cmdline, environ) in &seen {
        assert!(
            !contains(cmdline, "a wrong key"),
            "the key is in cryptsetup's arguments"
        );
        assert!(
            !contains(environ, "a wrong key"),
            "the key is in cryptsetup's environment"
        );
    }
    let a = s
        .post(
            "/v1/volumes",
            json!({"name": "v", "image": plain["id"], "backend": "loop", "key": key}),
        )
        .await;
    assert_error(&a, 422, "not_encrypted");
    let a = s
        .delete(&format!(
            "/v1/images/{}?erase=true",
            plain["id"].as_str().unwrap()
        ))
        .await;
    assert_error(&a, 422, "not_encrypted");
    assert_eq!(s.snapshot().await, before, "a refusal changed something");

    // The right key: this host has no device-mapper, so dm-crypt cannot
    // open the plaintext; the refusal says so and leaves no device.
    let a = s.post("/v1/volumes", v(json!({"key": key}))).await;
    if a.status == 201 {
        let device = a.body["device"].as_str().unwrap();
        assert!(
            device.starts_with("/dev/mapper/blockplane-crypt-"),
            "{}",
            a.body
        );
        assert_eq!(a.body["encrypted"], true);
        assert_eq!(s.delete("/v1/volumes/v").await.status, 204);
    } else {
        assert_error(&a, 422, "encryption_unavailable");
        assert!(s.my_loop_devices().is_empty(), "{:?}", s.my_loop_devices());
    }

    // No record keeps the key.
    for file in ["blockplane.db", "blockplane.db-wal"] {
        let bytes = std::fs::read(s.data.join(file)).unwrap_or_default();
        assert!(!contains(&bytes, &key), "the key is in {file}");
    }
    let events = s.get("/v1/events?limit=1000").await.body.to_string();
    assert!(!events.contains(&key), "the key is in the event log");
    assert!(
        !s.log_text().contains(&key),
        "the key is in the service's log"
    );
    assert!(
        !s.log_text().contains("a wrong key"),
        "a key is in the service's log"
    );

    // Crypto-erase: the file stays, and no key opens it.
    assert_eq!(s.delete("/v1/images/secret?erase=true").await.status, 204);
    assert!(path.exists());
    assert!(
        !opens(&path, &key),
        "the erased file still opens with its key"
    );
    let events = s.get("/v1/events?limit=1000").await.body;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "image_erased"),
        "{events}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_luks2_file_registers_as_encrypted_and_a_too_small_or_cloned_one_is_refused() {
    let s = Service::start_with(Opts {
        extra_args: vec!["--key-unlock-ms".into(), "100".into()],
        ..Default::default()
    })
    .await;
    let path = s.images.join("made-elsewhere.img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(32 << 20).unwrap();
    drop(f);
    let mut c = Command::new("cryptsetup")
        .args([
            "luksFormat",
            "--type",
            "luks2",
            "--batch-mode",
            "--iter-time",
            "100",
        ])
        .args(["--key-file=-"])
        .arg(&path)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(b"elsewhere").unwrap();
    assert!(c.wait().unwrap().success());
    let a = s
        .post("/v1/images", json!({"name": "elsewhere", "path": path}))
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(a.body["encryption"]["format"], "luks2", "{}", a.body);
    assert_eq!(a.body["encryption"]["key_slots"], json!([0]), "{}", a.body);

    let before = s.snapshot().await;
    let a = s
        .post(
            "/v1/images",
            json!({"name": "tiny", "path": s.images.join("tiny.img"),
                   "create": {"size_bytes": 8u64 << 20, "encryption": {"key": "k"}}}),
        )
        .await;
    assert_error(&a, 422, "invalid_field");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("header"),
        "{}",
        a.body
    );
    // A clone keeps its source's header: encryption is for a new file only.
    let a = s
        .post(
            "/v1/images",
            json!({"name": "copy", "path": s.images.join("copy.img"), "clone_from": "elsewhere",
                   "create": {"size_bytes": 32u64 << 20, "encryption": {"key": "k"}}}),
        )
        .await;
    assert_error(&a, 422, "invalid_field");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("clone"),
        "{}",
        a.body
    );
    assert_eq!(s.snapshot().await, before);
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_rotate_in_the_file_and_the_last_slot_stays() {
    let s = Service::start_with(Opts {
        extra_args: vec!["--key-unlock-ms".into(), "100".into()],
        ..Default::default()
    })
    .await;
    let path = s.images.join("rot.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "rot", "path": path,
                   "create": {"size_bytes": 24u64 << 20, "encryption": {"key": "old"}}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    s.image("plain", 4).await;

    let before = s.snapshot().await;
    let a = s
        .post(
            "/v1/images/rot/keys",
            json!({"key": "wrong", "new_key": "new"}),
        )
        .await;
    assert_error(&a, 403, "key_rejected");
    let a = s
        .post(
            "/v1/images/plain/keys",
            json!({"key": "old", "new_key": "new"}),
        )
        .await;
    assert_error(&a, 422, "not_encrypted");
    let a = s
        .delete_with("/v1/images/rot/keys/3", json!({"key": "old"}))
        .await;
    assert_error(&a, 404, "key_slot_not_found");
    let a = s
        .delete_with("/v1/images/rot/keys/0", json!({"key": "old"}))
        .await;
    assert_error(&a, 409, "last_key_slot");
    assert_eq!(s.snapshot().await, before, "a refusal changed something");

    let a = s
        .post(
            "/v1/images/rot/keys",
            json!({"key": "old", "new_key": "new"}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(a.body["slot"], 1);
    assert_eq!(a.body["image"]["encryption"]["key_slots"], json!([0, 1]));
    assert!(opens(&path, "new") && opens(&path, "old"));
    // A wrong key removes nothing.
    let a = s
        .delete_with("/v1/images/rot/keys/0", json!({"key": "wrong"}))
        .await;
    assert_error(&a, 403, "key_rejected");
    let a = s
        .delete_with("/v1/images/rot/keys/0", json!({"key": "new"}))
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["encryption"]["key_slots"], json!([1]));
    assert!(opens(&path, "new"), "the new key does not open the image");
    assert!(
        !opens(&path, "old"),
        "the removed key still opens the image"
    );
    let kinds: Vec<String> = s
        .get("/v1/events?limit=1000")
        .await
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect();
    assert!(kinds.contains(&"image_key_added".to_string()), "{kinds:?}");
    assert!(
        kinds.contains(&"image_key_removed".to_string()),
        "{kinds:?}"
    );
}

/// Formats the file `path` (made `size` bytes first) as LUKS `version`
/// (`luks1` or `luks2`) with cryptsetup itself, opened by `key`.
fn luks_format(path: &std::path::Path, size: u64, version: &str, key: &str) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    drop(f);
    let mut c = Command::new("cryptsetup")
        .args(["luksFormat", "--type", version, "--batch-mode"])
        .args(["--pbkdf-force-iterations", "1000", "--pbkdf", "pbkdf2"])
        .args(["--key-file=-"])
        .arg(path)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(key.as_bytes()).unwrap();
    assert!(c.wait().unwrap().success(), "cryptsetup luksFormat failed");
}

/// Overwrites `len` bytes of `path` at `offset` with a pattern.
fn scribble(path: &std::path::Path, offset: u64, len: usize, byte: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![byte; len], offset).unwrap();
    f.sync_all().unwrap();
}

fn message(a: &blockplane_client::Answer) -> String {
    a.body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_luks1_file_is_refused_by_its_own_code_and_nothing_is_registered() {
    let s = Service::start().await;
    let path = s.images.join("old.img");
    luks_format(&path, 32 << 20, "luks1", "old key");
    let before = s.snapshot().await;
    let a = s
        .post("/v1/images", json!({"name": "old", "path": path}))
        .await;
    assert_error(&a, 422, "luks_version_unsupported");
    let m = message(&a);
    assert!(m.contains("'old'") && m.contains("LUKS1"), "{m}");
    assert!(m.contains("LUKS2"), "the rule is not named: {m}");
    assert_eq!(s.snapshot().await, before, "a refusal changed something");
    assert_eq!(s.get("/v1/images").await.body, json!([]));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_luks2_file_with_both_json_areas_damaged_is_refused_and_one_with_a_copy_left_registers() {
    let s = Service::start().await;
    // cryptsetup's default LUKS2 header: 16 KiB each, the primary at 0
    // and the secondary after it; each a 4 KiB binary header and its JSON.
    let path = s.images.join("broken.img");
    luks_format(&path, 32 << 20, "luks2", "k");
    scribble(&path, 4096, 12 << 10, b'x');
    scribble(&path, (16 << 10) + 4096, 12 << 10, b'x');
    let before = s.snapshot().await;
    let a = s
        .post("/v1/images", json!({"name": "broken", "path": path}))
        .await;
    assert_error(&a, 422, "luks_header_unreadable");
    let m = message(&a);
    assert!(m.contains("'broken'"), "{m}");
    assert!(
        m.contains("never served as plain"),
        "the rule is not named: {m}"
    );
    assert_eq!(s.snapshot().await, before, "a refusal changed something");

    // The primary header destroyed, magic and all: the secondary copy says
    // what it is, and cryptsetup reads it.
    let path = s.images.join("half.img");
    luks_format(&path, 32 << 20, "luks2", "k");
    scribble(&path, 0, 16 << 10, 0);
    let a = s
        .post("/v1/images", json!({"name": "half", "path": path}))
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(a.body["encryption"]["format"], "luks2", "{}", a.body);
}

/// A service started in a mount namespace of its own where cryptsetup
/// cannot run (`/dev/null` bound over it): a host without the program.
async fn service_without_cryptsetup(dir: &std::path::Path) -> Service {
    use std::os::unix::fs::PermissionsExt;
    let wrapper = dir.join("no-cryptsetup");
    // `unshare` and `sh` exec, so the service keeps this process's id.
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec unshare --mount --propagation private /bin/sh -c 'mount --bind /dev/null /usr/sbin/cryptsetup && exec \"$0\" \"$@\"' {} \"$@\"\n",
            crate::harness::bin()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    Service::start_with(Opts {
        bin: Some(wrapper),
        ..Default::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_without_cryptsetup_registers_plain_files_and_refuses_encrypted_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let s = service_without_cryptsetup(tmp.path()).await;
    let plain = s.images.join("plain.img");
    std::fs::File::create(&plain)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let a = s
        .post("/v1/images", json!({"name": "plain", "path": plain}))
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(a.body["encryption"], serde_json::Value::Null, "{}", a.body);

    // Made here by the test, which sees the host's cryptsetup.
    let luks = s.images.join("sealed.img");
    luks_format(&luks, 32 << 20, "luks2", "k");
    let before = s.snapshot().await;
    let a = s
        .post("/v1/images", json!({"name": "sealed", "path": luks}))
        .await;
    assert_error(&a, 422, "encryption_unavailable");
    let m = message(&a);
    assert!(
        m.contains("'sealed'") && m.contains("cryptsetup-bin"),
        "{m}"
    );
    let a = s
        .post(
            "/v1/images",
            json!({"name": "new", "path": s.images.join("new.img"),
                   "create": {"size_bytes": 32u64 << 20, "encryption": {"key": "k"}}}),
        )
        .await;
    assert_error(&a, 422, "encryption_unavailable");
    assert!(message(&a).contains("cryptsetup-bin"), "{}", a.body);
    assert_eq!(s.snapshot().await, before, "a refusal changed something");
}

/// Backs up `image` to the service's target and restores it as `name`:
/// the restored image's last view once it is no longer copying.
async fn backup_and_restore(s: &Service, image: &str, name: &str) -> serde_json::Value {
    let a = s
        .post(
            &format!("/v1/images/{image}/backups"),
            json!({"name": format!("{image}-b")}),
        )
        .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let id = a.body["id"].as_str().unwrap().to_string();
    let mut b = serde_json::Value::Null;
    crate::eventually(Duration::from_secs(120), "the backup", async || {
        b = s.get(&format!("/v1/backups/{id}")).await.body;
        b["state"] != "running"
    })
    .await;
    assert_eq!(b["state"], "done", "{b}");
    let a = s
        .post(
            "/v1/images",
            json!({"name": name, "path": s.images.join(format!("{name}.img")), "restore_from": id}),
        )
        .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let mut i = serde_json::Value::Null;
    crate::eventually(Duration::from_secs(120), "the restore", async || {
        i = s.get(&format!("/v1/images/{name}")).await.body;
        i["state"] != "copying"
    })
    .await;
    i
}

/// A service whose backup target is a new directory (kept with it).
async fn service_with_target() -> (Service, tempfile::TempDir) {
    let target = tempfile::Builder::new()
        .prefix("bp-target")
        .tempdir_in("/tmp")
        .unwrap();
    let s = Service::start_with(Opts {
        extra_args: vec![
            "--backup-target".into(),
            target.path().to_str().unwrap().into(),
            "--key-unlock-ms".into(),
            "100".into(),
        ],
        ..Default::default()
    })
    .await;
    (s, target)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_of_an_encrypted_backup_without_its_header_fails_and_leaves_no_file() {
    let (s, _target) = service_with_target().await;
    // Backed up encrypted, its header lost since: restored, it would be
    // ciphertext served as plain.
    let sealed = s.images.join("sealed.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "sealed", "path": sealed,
                   "create": {"size_bytes": 24u64 << 20, "encryption": {"key": "k"}}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    scribble(&sealed, 16 << 20, 1 << 20, 0x5a);
    scribble(&sealed, 0, 16 << 20, 0);
    let i = backup_and_restore(&s, "sealed", "sealed-back").await;
    assert_eq!(i["state"], "failed", "{i}");
    let reason = i["state_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("encrypted") && reason.contains("no LUKS header"),
        "{reason}"
    );
    assert!(!s.images.join("sealed-back.img").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_of_a_plain_backup_that_holds_a_luks_header_fails_and_leaves_no_file() {
    let (s, _target) = service_with_target().await;
    // Backed up plain, a LUKS2 header written in it since (by whatever used
    // its device): restored, it would need a key its source never did.
    let open = s.images.join("open.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "open", "path": open, "create": {"size_bytes": 24u64 << 20}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let elsewhere = tempfile::tempdir().unwrap();
    let made = elsewhere.path().join("luks.img");
    luks_format(&made, 24 << 20, "luks2", "k");
    let header = std::fs::read(&made).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&open).unwrap();
        f.write_all_at(&header[..16 << 20], 0).unwrap();
        f.sync_all().unwrap();
    }
    let i = backup_and_restore(&s, "open", "open-back").await;
    assert_eq!(i["state"], "failed", "{i}");
    let reason = i["state_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("not encrypted") && reason.contains("LUKS header"),
        "{reason}"
    );
    assert!(!s.images.join("open-back.img").exists());
}

/// Each key slot's argon2id `(time cost, memory KiB)` in the LUKS2 file
/// `path`, by slot number, as cryptsetup reads the header.
fn slot_costs(path: &std::path::Path) -> Vec<(u64, u64)> {
    let out = Command::new("cryptsetup")
        .args(["luksDump", "--dump-json-metadata"])
        .arg(path)
        .output()
        .expect("cryptsetup runs");
    assert!(out.status.success(), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut slots: Vec<(u32, (u64, u64))> = doc["keyslots"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, slot)| {
            let kdf = &slot["kdf"];
            assert_eq!(kdf["type"], "argon2id", "slot {n}: {kdf}");
            let cost = |k: &str| kdf[k].as_u64().unwrap();
            (n.parse().unwrap(), (cost("time"), cost("memory")))
        })
        .collect();
    slots.sort();
    slots.into_iter().map(|(_, c)| c).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fixed_key_cost_is_every_new_slots_and_half_of_one_refuses_to_start() {
    let fixed = ["--key-kdf-iterations", "5", "--key-kdf-memory-kib", "64"];
    let s = Service::start_with(Opts {
        extra_args: fixed.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
    .await;
    let path = s.images.join("fixed.img");
    let a = s
        .post(
            "/v1/images",
            json!({"name": "fixed", "path": path,
                   "create": {"size_bytes": 24u64 << 20, "encryption": {"key": "one"}}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let a = s
        .post(
            "/v1/images/fixed/keys",
            json!({"key": "one", "new_key": "two"}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(slot_costs(&path), vec![(5, 64), (5, 64)]);
    assert!(opens(&path, "two"));

    // A cost given by halves, or both timed and fixed, is refused before
    // anything starts.
    let dir = tempfile::tempdir().unwrap();
    for (args, names) in [
        (&["--key-kdf-iterations", "5"][..], "give both"),
        (
            &[
                "--key-unlock-ms",
                "100",
                "--key-kdf-iterations",
                "5",
                "--key-kdf-memory-kib",
                "64",
            ][..],
            "one or the other",
        ),
        (
            &["--key-kdf-iterations", "3", "--key-kdf-memory-kib", "64"][..],
            "below argon2id's least, 4",
        ),
    ] {
        let out = Command::new(crate::harness::bin())
            .arg("serve")
            .arg("--data-dir")
            .arg(dir.path())
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(names), "{args:?}: {err}");
    }
    assert!(!dir.path().join("blockplane.db").exists(), "nothing starts");
}
