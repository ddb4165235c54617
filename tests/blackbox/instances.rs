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

/// A ublk worker takes its image lock (fd 4) again before it serves: handed
/// an image another process holds locked, it refuses to start, before it
/// touches ublk, with a line that names the image and the lock (the line the
/// service reports when a worker will not start).
#[test]
fn a_worker_refuses_to_start_on_an_image_locked_elsewhere() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;

    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("s.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    let open = || {
        std::fs::File::options()
            .read(true)
            .write(true)
            .open(&image)
            .unwrap()
    };
    // Above fds 3 and 4, so both dup2s below make new, inheritable descriptors.
    let opened = open();
    let handed = rustix::io::fcntl_dupfd_cloexec(&opened, 10).unwrap();
    let raw = handed.as_raw_fd();
    // Another process's lock: a POSIX one, which conflicts with OFD locks too
    // (and lasts until this process closes any descriptor of the file).
    let holder = open();
    rustix::fs::fcntl_lock(
        &holder,
        rustix::fs::FlockOperation::NonBlockingLockExclusive,
    )
    .unwrap();
    let spec = json!({
        "volume_id": uuid::Uuid::new_v4(),
        "run_dir": run_dir,
        "image_path": image,
        "size_bytes": 1 << 20,
        "read_only": false,
        "dispatch": "nowait",
        "dispatch_reason": "test",
        "queues": 1,
        "queue_depth": 32,
        "max_io_bytes": 1 << 17,
        "threads": 1,
        "extent_check_secs": 0,
        "image_lock": true
    });
    let mut cmd = std::process::Command::new(crate::harness::bin());
    cmd.args(["worker", "--spec", &spec.to_string()]);
    // SAFETY: only dup2 between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for target in [3, 4] {
                if libc::dup2(raw, target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the worker started: {stderr}");
    assert!(
        stderr.contains("cannot take the lock on image")
            && stderr.contains(&image.display().to_string()),
        "{stderr}"
    );
    drop((holder, opened));
}
