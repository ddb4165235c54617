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

/// A dm node mapping one whole device linearly: a handle that stays while
/// the device under it is replaced (a table reload), as a remote volume's
/// node over its NVMe namespace.
pub mod linear {
    use std::path::{Path, PathBuf};

    use devicemapper::{DM, DevId, DmFlags, DmName, DmOptions, DmUuid};

    use super::{CONTROL, DmCallError};

    fn dm() -> Result<DM, DmCallError> {
        DM::new().map_err(|e| DmCallError::new("open", CONTROL, e))
    }

    fn name_of(name: &str) -> Result<&DmName, DmCallError> {
        DmName::new(name).map_err(|e| DmCallError::new("name", name, e))
    }

    fn table(device: &Path, sectors: u64) -> Vec<super::Target> {
        vec![(
            0,
            sectors,
            "linear".to_string(),
            format!("{} 0", device.display()),
        )]
    }

    fn flags(read_only: bool) -> DmOptions {
        DmOptions::default().set_flags(match read_only {
            true => DmFlags::DM_READONLY,
            false => DmFlags::empty(),
        })
    }

    /// Makes node `name` (dm uuid `uuid`) over `sectors` of `device`;
    /// nothing is left when it fails.
    pub fn create(
        name: &str,
        uuid: &str,
        device: &Path,
        sectors: u64,
        read_only: bool,
    ) -> Result<(), DmCallError> {
        let dm = dm()?;
        let id = DevId::Name(name_of(name)?);
        let dm_uuid = DmUuid::new(uuid).map_err(|e| DmCallError::new("uuid", uuid, e))?;
        dm.device_create(name_of(name)?, Some(dm_uuid), DmOptions::default())
            .map_err(|e| DmCallError::new("DM_DEV_CREATE", name, e))?;
        let made = dm
            .table_load(&id, &table(device, sectors), flags(read_only))
            .map_err(|e| DmCallError::new("DM_TABLE_LOAD", name, e))
            .and_then(|_| {
                dm.device_suspend(&id, DmOptions::default())
                    .map_err(|e| DmCallError::new("resume", name, e))
            });
        if let Err(e) = made {
            let _ = dm.device_remove(&id, DmOptions::default());
            return Err(e);
        }
        Ok(())
    }

    /// Maps node `name` onto `sectors` of `device` now: suspended (its
    /// in-flight I/O finished), loaded, resumed. A failure before the
    /// resume leaves the old table live.
    pub fn reload(
        name: &str,
        device: &Path,
        sectors: u64,
        read_only: bool,
    ) -> Result<(), DmCallError> {
        let dm = dm()?;
        let id = DevId::Name(name_of(name)?);
        dm.device_suspend(&id, DmOptions::default().set_flags(DmFlags::DM_SUSPEND))
            .map_err(|e| DmCallError::new("suspend", name, e))?;
        if let Err(e) = dm.table_load(&id, &table(device, sectors), flags(read_only)) {
            let _ = dm.table_clear(&id);
            let _ = dm.device_suspend(&id, DmOptions::default());
            return Err(DmCallError::new("DM_TABLE_LOAD", name, e));
        }
        dm.device_suspend(&id, DmOptions::default())
            .map_err(|e| DmCallError::new("resume", name, e))?;
        Ok(())
    }

    /// Removes node `name`; `Ok(false)` when there was none. An open node
    /// is refused with EBUSY ([`super::errno`]).
    pub fn remove(name: &str) -> Result<bool, DmCallError> {
        match dm()?.device_remove(&DevId::Name(name_of(name)?), DmOptions::default()) {
            Ok(_) => Ok(true),
            Err(e) if super::errno(&e) == Some(libc::ENXIO) => Ok(false),
            Err(e) => Err(DmCallError::new("DM_DEV_REMOVE", name, e)),
        }
    }

    /// The device node of `name`, if it exists: `/dev/mapper/<name>` where
    /// udev (or someone) made it, else the kernel's `/dev/dm-<minor>`.
    pub fn device(name: &str) -> Result<Option<PathBuf>, DmCallError> {
        let info = match dm()?.device_info(&DevId::Name(name_of(name)?)) {
            Ok(info) => info,
            Err(e) if super::errno(&e) == Some(libc::ENXIO) => return Ok(None),
            Err(e) => return Err(DmCallError::new("DM_DEV_STATUS", name, e)),
        };
        let mapper = Path::new("/dev/mapper").join(name);
        if mapper.exists() {
            return Ok(Some(mapper));
        }
        Ok(Some(PathBuf::from(format!(
            "/dev/dm-{}",
            info.device().minor
        ))))
    }
}
