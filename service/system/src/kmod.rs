//! Loading a kernel module the NVMe target or initiator needs, with Debian's
//! `modprobe` and fixed arguments (the module's name, a constant of its
//! caller). Hosts load blockplane's modules at boot
//! (`deploy/modules-load.d/blockplane.conf`); this is for a host that did
//! not, so that the refusal, when there is one, says what is missing.

use std::path::Path;
use std::process::{Command, Stdio};

/// The program, looked up on this `PATH` only.
const PROGRAM: &str = "modprobe";
const PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// Whether `module` (as `modprobe` spells it, `nvmet-tcp`) is loaded: its
/// directory in `/sys/module`, where the kernel spells it `nvmet_tcp`.
pub(crate) fn is_loaded(module: &str) -> bool {
    Path::new("/sys/module")
        .join(module.replace('-', "_"))
        .exists()
}

/// Loads `module` unless it is loaded already. The error is what
/// `modprobe` said, or why it could not run, in words for an operator.
pub(crate) fn load(module: &'static str) -> Result<(), String> {
    if is_loaded(module) {
        return Ok(());
    }
    let out = Command::new(PROGRAM)
        .arg(module)
        .env_clear()
        .env("PATH", PATH)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run {PROGRAM} to load {module}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
    Err(if said.is_empty() {
        format!("{PROGRAM} {module} failed ({})", out.status)
    } else {
        format!("{PROGRAM} {module} failed: {said}")
    })
}
