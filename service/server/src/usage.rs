//! Whether a volume is in use: the processes holding its device open, its
//! mounts, and its I/O of the last seconds (from the stats history).

use std::os::unix::fs::{FileTypeExt, MetadataExt};

use blockplane_api::model::{DeviceOpener, HistoryPoint, Volume, VolumeUsage, human_size};

/// Seconds of history a volume's recent I/O is judged on.
pub const RECENT_SECS: u32 = 5;

/// The processes with the block device `rdev` open, but those in `except`,
/// by pid.
pub fn openers(rdev: u64, except: &[u32]) -> Vec<DeviceOpener> {
    blockplane_system::holders::holding(except, |fd| {
        std::fs::metadata(fd).is_ok_and(|m| m.file_type().is_block_device() && m.rdev() == rdev)
    })
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
        reasons.push(format!(
            "open by {}",
            blockplane_system::holders::describe(&openers)
        ));
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
