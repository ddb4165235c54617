//! Which processes hold something open: the `/proc/PID/fd` links (and each
//! process's working directory), read the way `fuser` reads them. Used to
//! say who keeps a device busy (the API's volume usage) and who keeps a
//! mount from being unmounted (the CSI node).

use std::path::Path;

use blockplane_api::model::DeviceOpener;

/// The processes (but those in `except`) with at least one open file, or
/// a working directory, for which `held` is true. `held` gets the
/// `/proc/PID/fd/N` (or `/proc/PID/cwd`) link: `metadata` of it follows to
/// the open file, `read_link` gives its path. Processes that end or hide
/// meanwhile are skipped. Sorted by pid.
pub fn holding(except: &[u32], held: impl Fn(&Path) -> bool) -> Vec<DeviceOpener> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out: Vec<DeviceOpener> = procs
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| !except.contains(pid))
        .filter(|pid| {
            held(Path::new(&format!("/proc/{pid}/cwd")))
                || std::fs::read_dir(format!("/proc/{pid}/fd"))
                    .is_ok_and(|fds| fds.flatten().any(|fd| held(&fd.path())))
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

/// `holders` as "fio (pid 12), bash (pid 40)".
pub fn describe(holders: &[DeviceOpener]) -> String {
    holders
        .iter()
        .map(|o| format!("{} (pid {})", o.command, o.pid))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_this_process_holds_open_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("held");
        let f = std::fs::File::create(&path).unwrap();
        let under = |link: &Path| std::fs::read_link(link).is_ok_and(|p| p == path);
        let me = std::process::id();
        let found = holding(&[], under);
        assert!(found.iter().any(|o| o.pid == me), "{found:?}");
        assert!(describe(&found).contains(&format!("(pid {me})")));
        assert!(holding(&[me], under).iter().all(|o| o.pid != me));
        drop(f);
        assert!(holding(&[], under).iter().all(|o| o.pid != me));
    }
}
