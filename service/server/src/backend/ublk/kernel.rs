//! The ublk driver's control interface, as the control plane uses it:
//! whether the driver is there, its feature bits by name, and the state and
//! removal of a device whose worker is gone.

use std::path::Path;

use libublk::ctrl::UblkCtrl;

const CONTROL: &str = "/dev/ublk-control";

/// Names of the ublk feature bits, in bit order.
const FEATURE_NAMES: [&str; 21] = [
    "SUPPORT_ZERO_COPY",
    "URING_CMD_COMP_IN_TASK",
    "NEED_GET_DATA",
    "USER_RECOVERY",
    "USER_RECOVERY_REISSUE",
    "UNPRIVILEGED_DEV",
    "CMD_IOCTL_ENCODE",
    "USER_COPY",
    "ZONED",
    "USER_RECOVERY_FAIL_IO",
    "UPDATE_SIZE",
    "AUTO_BUF_REG",
    "QUIESCE",
    "PER_IO_DAEMON",
    "BUF_REG_OFF_DAEMON",
    "BATCH_IO",
    "INTEGRITY",
    "SAFE_STOP_DEV",
    "NO_AUTO_PART_SCAN",
    "SHMEM_ZC",
    "IO_DESC_SIZE",
];

/// Why ublk cannot serve here (`None`: it can).
pub(super) fn unavailable() -> Option<String> {
    if !Path::new(CONTROL).exists() {
        return Some("ublk_drv is not loaded (no /dev/ublk-control)".into());
    }
    None
}

/// The kernel's ublk feature bits (`UBLK_U_CMD_GET_FEATURES`; 0 where the
/// driver is missing or too old to say).
pub(super) fn features() -> u64 {
    UblkCtrl::get_features().unwrap_or(0)
}

/// Deletes a ublk device whose server is gone (or will not stop).
pub(super) fn delete_device(dev_id: u32) {
    if let Ok(ctrl) = UblkCtrl::new_simple(dev_id as i32) {
        let _ = ctrl.kill_dev();
        let _ = ctrl.del_dev();
    }
}

/// The kernel's state of device `dev_id` (`None`: no such device).
pub(super) fn device_state(dev_id: u32) -> Option<u32> {
    let ctrl = UblkCtrl::new_simple(dev_id as i32).ok()?;
    ctrl.read_dev_info().ok()?;
    Some(u32::from(ctrl.dev_info().state))
}

/// The names of the feature bits set in `mask`.
pub(super) fn feature_names(mask: u64) -> Vec<String> {
    (0..64)
        .filter(|b| mask & (1u64 << b) != 0)
        .map(|b| {
            FEATURE_NAMES
                .get(b)
                .map(|s| s.to_string())
                .unwrap_or(format!("BIT_{b}"))
        })
        .collect()
}
