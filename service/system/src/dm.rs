//! Device-mapper as the kernel answers it: a device's live table
//! (`DM_TABLE_STATUS`), read here for both its readers, the device stack
//! under an image's filesystem ([`crate::extent`], rule 4) and the dm
//! backend, which compares a volume's live table with the one it expects;
//! and the errno a failed DM call carries.

use std::io;

use devicemapper::{DM, DevId, DmFlags, DmName, DmOptions};

/// The device-mapper control node every DM ioctl goes through.
pub const CONTROL: &str = "/dev/mapper/control";

/// One line of a DM table: start and length in sectors, target type,
/// parameters.
pub type Target = (u64, u64, String, String);

/// A dm device's live table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// The table is loaded read-only (`DM_READONLY`).
    pub read_only: bool,
    /// Its targets, in order.
    pub targets: Vec<Target>,
}

/// A DM call that failed: which, on what, and the errno where the kernel
/// gave one, so callers can tell ENXIO or EBUSY from other failures.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct DmCallError {
    /// The call (`open`, `name`, an ioctl's name).
    pub op: &'static str,
    /// The device (or [`CONTROL`]) it was made on.
    pub device: String,
    message: String,
    errno: Option<i32>,
}

impl DmCallError {
    /// `op` on `device` failed with `e`.
    pub fn new(op: &'static str, device: &str, e: devicemapper::DmError) -> Self {
        Self {
            op,
            device: device.to_string(),
            errno: errno(&e),
            message: e.to_string(),
        }
    }

    /// As an `io::Error`: the kernel's errno where it gave one.
    pub fn to_io(&self) -> io::Error {
        match self.errno {
            Some(n) => io::Error::from_raw_os_error(n),
            None => io::Error::other(self.message.clone()),
        }
    }
}

/// The errno of a failed DM ioctl (`None` for failures before the ioctl).
pub fn errno(e: &devicemapper::DmError) -> Option<i32> {
    match e {
        devicemapper::DmError::Core(devicemapper::errors::Error::Ioctl(_, _, _, errno)) => {
            Some(**errno as i32)
        }
        _ => None,
    }
}

/// The live table of the dm device called `name`.
pub fn table(name: &str) -> Result<Table, DmCallError> {
    let dm_name = DmName::new(name).map_err(|e| DmCallError::new("name", name, e))?;
    let dm = DM::new().map_err(|e| DmCallError::new("open", CONTROL, e))?;
    let (info, targets) = dm
        .table_status(
            &DevId::Name(dm_name),
            DmOptions::default().set_flags(DmFlags::DM_STATUS_TABLE),
        )
        .map_err(|e| DmCallError::new("DM_TABLE_STATUS", name, e))?;
    Ok(Table {
        read_only: info.flags().contains(DmFlags::DM_READONLY),
        targets,
    })
}
