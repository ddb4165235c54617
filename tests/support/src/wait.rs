//! Waiting for a condition, never for a time; and where the tests run.

use std::time::{Duration, Instant};

/// Whether this runs inside the test VM (its kernel command line says so).
pub fn in_vm() -> bool {
    std::fs::read_to_string("/proc/cmdline").is_ok_and(|c| c.contains("blockplane_vm=1"))
}

/// Panics unless running inside the test VM.
pub fn require_vm() {
    assert!(
        in_vm(),
        "these tests need ublk_drv and dm-mod: run them with tests/vm/run-suite.sh"
    );
}

/// Polls `f` until it is true; panics naming `what` after `within`. It
/// polls every 50 ms on the host and every 200 ms in the VM, whose two
/// emulated CPUs the polling would otherwise take from what it waits for.
pub async fn eventually(within: Duration, what: &str, mut f: impl AsyncFnMut() -> bool) {
    let every = if in_vm() {
        Duration::from_millis(200)
    } else {
        Duration::from_millis(50)
    };
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(every).await;
    }
}
