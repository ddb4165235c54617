//! The data plane: a worker process (`blockplane worker`, started by the
//! control plane) that serves one volume's ublk device. It never touches
//! SQLite: it gets its image as an open fd and its spec on the command line,
//! and answers on a control socket in its run dir.
//!
//! Each queue thread owns what its requests touch; the control thread
//! changes it by message (`mailbox`). Policies switch live: the control
//! thread holds every queue, waits for the requests inside to finish, changes
//! what must change (the image's pin and map when entering or leaving
//! `direct`), and sends each queue its new config, which lets the held
//! requests continue on the new path.

mod control;
mod device;
mod direct_path;
mod gate;
mod io;
mod mailbox;
mod moment;
mod qos;
mod refusal;
mod shared;
mod stats;
mod watch;

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::ExitCode;
use std::sync::Mutex;

use blockplane_protocol as protocol;
use protocol::{IMAGE_FD, LOCK_FD, WorkerSpec};
use shared::{Opened, Shared};
use stats::Stats;

/// The image for the data path: the same open file, with O_DIRECT where the
/// filesystem takes it. Not a fresh open: a pinned (immutable) image cannot be
/// opened for writing, and a recovering worker finds it pinned.
fn data_fd(image: &File) -> std::io::Result<File> {
    let data = image.try_clone()?;
    let flags = rustix::fs::fcntl_getfl(&data)?;
    if let Err(e) = rustix::fs::fcntl_setfl(&data, flags | rustix::fs::OFlags::DIRECT) {
        tracing::warn!(error = %e, "the image's filesystem refuses O_DIRECT; buffered I/O");
    }
    Ok(data)
}

/// `blockplane worker --spec JSON`: serves until told to stop (exit 0) or
/// until the device is taken away (exit 1).
pub fn main(spec_json: &str) -> ExitCode {
    let spec: WorkerSpec = match serde_json::from_str(spec_json) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("blockplane worker: bad spec: {e}");
            return ExitCode::from(2);
        }
    };
    init_logging(&spec);
    tracing::info!(
        volume_id = %spec.volume_id,
        recover_dev_id = spec.recover_dev_id,
        handover = spec.handover,
        "worker starting"
    );
    match run(spec) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = %e, "worker failed");
            eprintln!("blockplane worker: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A handover's new worker, started: says so on [`protocol::GO_FD`] and
/// waits until the old worker has let go. `false`: called off.
fn await_go() -> std::io::Result<bool> {
    use std::io::{Read, Write};
    // SAFETY: the control plane passes a handover's socket on GO_FD;
    // nothing else owns it.
    let mut go = unsafe { std::os::unix::net::UnixStream::from_raw_fd(protocol::GO_FD) };
    go.write_all(&[protocol::GO_READY])?;
    let mut word = [0u8; 1];
    Ok(go.read(&mut word)? == 1 && word[0] == protocol::GO_TAKE)
}

fn init_logging(spec: &WorkerSpec) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(spec.run_dir.join("worker.log"));
    let filter = tracing_subscriber::EnvFilter::try_from_env("BLOCKPLANE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false);
    let _ = match log {
        Ok(f) => builder.with_writer(Mutex::new(f)).try_init(),
        Err(_) => builder.with_writer(std::io::stderr).try_init(),
    };
}

fn run(spec: WorkerSpec) -> Result<ExitCode, Box<dyn std::error::Error>> {
    device::private_mount_namespace()?;
    tracing::debug!("start: mount namespace private");
    // SAFETY: the control plane hands the image over on this fd; nothing else owns it.
    let image = unsafe { File::from_raw_fd(IMAGE_FD) };
    // Held until the worker ends: the device serves only while it is held.
    let _lock = if spec.image_lock {
        // SAFETY: as IMAGE_FD, for the image lock.
        let lock = unsafe { OwnedFd::from_raw_fd(LOCK_FD) };
        blockplane_system::image::retake_lock(&lock).map_err(|e| {
            format!(
                "cannot take the lock on image {}: {e}; another process (another blockplane instance?) holds it, so this worker will not serve it",
                spec.image_path
            )
        })?;
        Some(lock)
    } else {
        None
    };
    let data = data_fd(&image)?;
    let stats = Stats::open(
        &spec.run_dir.join(protocol::STATS_FILE),
        spec.queues as usize,
    )?;
    let limiter = qos::Limiter::for_limits(spec.qos, usize::from(spec.queues))?;
    let zero = File::open("/dev/zero")?;
    // A handover is no crash: only a worker that replaces a dead one counts.
    if spec.recover_dev_id.is_some() && !spec.handover {
        stats.count_restart();
    }
    let shared = Shared::new(
        spec,
        Opened {
            image,
            data,
            zero,
            stats,
            limiter,
        },
    );
    if shared.spec.handover && !await_go()? {
        tracing::info!("the handover was called off before this worker took the device; it exits");
        return Ok(ExitCode::SUCCESS);
    }
    shared.begin()?;
    tracing::debug!("start: policy entered");
    device::serve(shared)
}
