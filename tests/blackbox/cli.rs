//! The `blockplane` CLI against a real service.

use std::process::Output;

use crate::harness::{BIN, Opts, Service};

fn cli(s: &Service, args: &[&str]) -> Output {
    std::process::Command::new(BIN)
        .arg("--api")
        .arg(format!("unix:{}", s.sock.display()))
        .args(args)
        .env_remove("BLOCKPLANE_TOKEN")
        .output()
        .unwrap()
}

fn ok(s: &Service, args: &[&str]) -> String {
    let out = cli(s, args);
    assert!(
        out.status.success(),
        "blockplane {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(s: &Service, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    serde_json::from_str(&ok(s, &a)).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_whole_life_of_a_volume_from_the_command_line() {
    let s = Service::start().await;
    let path = s.images.join("c.img").display().to_string();
    let out = ok(
        &s,
        &[
            "image",
            "create",
            "cimg",
            &path,
            "--size",
            "16M",
            "--allocation",
            "full",
        ],
    );
    assert!(out.contains("cimg") && out.contains("16.0 MiB"), "{out}");
    let images = json(&s, &["image", "ls"]);
    assert_eq!(images[0]["name"], "cimg");
    assert!(
        ok(&s, &["image", "ls"])
            .lines()
            .next()
            .unwrap()
            .starts_with("NAME")
    );

    let v = json(
        &s,
        &[
            "volume",
            "create",
            "cvol",
            "--image",
            "cimg",
            "--backend",
            "loop",
        ],
    );
    assert_eq!(v["state"], "attached");
    let dev = v["device"].as_str().unwrap().to_string();
    let table = ok(&s, &["volume", "ls"]);
    assert!(table.contains("cvol") && table.contains(&dev), "{table}");
    assert!(ok(&s, &["volume", "show", "cvol"]).contains(&dev));
    std::fs::write(&dev, vec![1u8; 65536]).unwrap();
    let stats = json(&s, &["volume", "stats", "cvol"]);
    assert!(stats["write"]["bytes"].as_u64().unwrap() >= 65536);
    assert!(ok(&s, &["volume", "stats", "cvol"]).contains("write"));

    let grown = json(&s, &["image", "resize", "cimg", "--size", "32M"]);
    assert_eq!(grown["image"]["size_bytes"], 32 << 20);
    assert_eq!(grown["volumes"][0]["name"], "cvol");
    assert_eq!(grown["volumes"][0]["size_bytes"], 32 << 20);
    assert!(ok(&s, &["host"]).contains("backend loop"));
    assert!(ok(&s, &["events", "--volume", "cvol"]).contains("volume_attached"));

    // Errors: non-zero exit with the API's message.
    let out = cli(&s, &["volume", "set", "cvol", "--dispatch", "nowait"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("dispatch cannot change live on backend loop") && err.contains("not_live"),
        "{err}"
    );
    let out = cli(&s, &["image", "rm", "cimg"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("image_in_use"));
    // The kernel's loop driver cannot be kept out of the ranges allocate
    // would zero: refused while attached, done once detached.
    let out = cli(&s, &["image", "allocate", "cimg"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("device_busy") && err.contains("loop"), "{err}");

    assert!(ok(&s, &["volume", "rm", "cvol"]).contains("deleted"));
    assert!(!crate::harness::serves_from(&dev, s.dir.path()));
    // It waits for the background allocate's end; nothing runs to cancel after.
    let allocated = json(&s, &["image", "allocate", "cimg"]);
    assert_eq!(allocated["allocation"], "full", "{allocated}");
    assert_eq!(allocated["allocate"]["state"], "done", "{allocated}");
    let out = cli(&s, &["image", "allocate", "cimg", "--cancel"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("allocate_conflict") && err.contains("no allocate runs"),
        "{err}"
    );
    ok(&s, &["image", "rm", "cimg", "--delete-file"]);
    assert!(!std::path::Path::new(&path).exists());
    let out = cli(&s, &["volume", "show", "cvol"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("volume 'cvol' not found"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_sends_the_token() {
    let s = Service::start_with(Opts {
        token: Some("tok".into()),
        ..Default::default()
    })
    .await;
    let out = cli(&s, &["host"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unauthorized"));
    let out = std::process::Command::new(BIN)
        .args(["--api", &format!("unix:{}", s.sock.display()), "host"])
        .env("BLOCKPLANE_TOKEN", "tok")
        .output()
        .unwrap();
    assert!(out.status.success());
}

#[tokio::test(flavor = "multi_thread")]
async fn no_service_is_a_clear_error() {
    let out = std::process::Command::new(BIN)
        .args(["--api", "unix:/nonexistent/blockplane.sock", "volume", "ls"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect to the blockplane API"));
}
