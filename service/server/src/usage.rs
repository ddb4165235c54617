//! Whether a volume is in use: the processes holding its device open, its
//! mounts, and its I/O of the last seconds (from the stats history).

use std::os::unix::fs::{FileTypeExt, MetadataExt};

use blockplane_api::model::{DeviceOpener, HistoryPoint, Volume, VolumeUsage, human_size};

/// Seconds of history a volume's recent I/O is judged on.
pub const RECENT_SECS: u32 = 5;

/// The processes with the block device `rdev` open, but those in `except`,
/// by pid. Processes that end or hide meanwhile are skipped.
pub fn openers(rdev: u64, except: &[u32]) -> Vec<DeviceOpener> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out: Vec<DeviceOpener> = procs
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| !except.contains(pid))
        .filter(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.flatten().any(|fd| {
                    std::fs::metadata(fd.path())
                        .is_ok_and(|m| m.file_type().is_block_device() && m.rdev() == rdev)
                })
            })
        })
        .map(|pid| DeviceOpener {
            pid,
            command: std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default(),
        })
        .collect();
    out.sort_by_key(|o| o.pid);
    out
}

/// `v`'s usage now, from its device and its `recent` history points.
pub fn of(v: &Volume, recent: &[HistoryPoint]) -> VolumeUsage {
    let rdev = v
        .device
        .as_deref()
        .and_then(|d| std::fs::metadata(d).ok())
        .filter(|m| m.file_type().is_block_device())
        .map(|m| m.rdev());
    // The service itself and the volume's own worker hold devices open as
    // part of serving them.
    let except = [Some(std::process::id()), v.worker_pid];
    let except: Vec<u32> = except.into_iter().flatten().collect();
    let openers = rdev.map(|r| openers(r, &except)).unwrap_or_default();
    let mounts: Vec<String> = rdev
        .and_then(|r| blockplane_system::mountinfo::mounts_of_device(r).ok())
        .unwrap_or_default()
        .into_iter()
        .map(|p| p.display().to_string())
        .collect();
    let n = recent.len().max(1) as f64;
    let sum = |f: fn(&HistoryPoint) -> f64| recent.iter().map(f).sum::<f64>() / n;
    let iops = sum(|p| p.read.iops + p.write.iops + p.flush.iops + p.discard.iops);
    let bytes_per_sec = sum(|p| p.read.bytes_per_sec + p.write.bytes_per_sec);
    let in_flight = recent.last().map(|p| p.in_flight).unwrap_or(0);
    let mut reasons = Vec::new();
    if !openers.is_empty() {
        let who: Vec<String> = openers
            .iter()
            .map(|o| format!("{} (pid {})", o.command, o.pid))
            .collect();
        reasons.push(format!("open by {}", who.join(", ")));
    }
    if !mounts.is_empty() {
        reasons.push(format!("mounted at {}", mounts.join(", ")));
    }
    if iops > 0.0 {
        reasons.push(format!(
            "{iops:.0} IOPS, {}/s over the last {} s",
            human_size(bytes_per_sec as u64),
            recent.len()
        ));
    }
    if in_flight > 0 {
        reasons.push(format!("{in_flight} requests in flight"));
    }
    VolumeUsage {
        volume_id: v.id,
        name: v.name.clone(),
        device: v.device.clone(),
        busy: !reasons.is_empty(),
        openers,
        mounts,
        recent_secs: RECENT_SECS,
        iops,
        bytes_per_sec,
        in_flight,
        reasons,
    }
}
