//! The device-mapper ioctls the dm backend makes (through the
//! `devicemapper` crate): names and uuids, creating, reloading and removing
//! a volume's device, and listing the devices that carry blockplane's uuid.

use std::io;
use std::path::Path;

use devicemapper::{DM, DevId, DmError, DmFlags, DmName, DmOptions, DmUuid};
use uuid::Uuid;

use super::table::Target;
use crate::backend::BackendError;
use blockplane_system::dispatch;
use blockplane_system::dm::{CONTROL, DmCallError, errno};
use blockplane_system::extent::DevNum;

pub(super) fn dm_name(volume_id: Uuid) -> String {
    format!("blockplane-{volume_id}")
}

/// The volume a device named by [`dm_name`] belongs to.
pub(super) fn volume_of_name(name: &str) -> Option<Uuid> {
    Uuid::parse_str(name.strip_prefix("blockplane-")?).ok()
}

pub(super) fn dm_uuid(instance: &str, volume_id: Uuid) -> String {
    format!("blockplane-{instance}-{volume_id}")
}

/// A dm device carrying blockplane's DM uuid of another instance than this
/// one: what a lost registry leaves (or another service on the host).
#[derive(Debug, Clone)]
pub struct ForeignDevice {
    /// Its node, `/dev/dm-N`, as a volume's `device` names it.
    pub device: String,
    /// Its DM name.
    pub name: String,
    pub instance: String,
    pub volume_id: Uuid,
}

/// A dm device carrying blockplane's uuid, `blockplane-<instance>-<volume-id>`.
pub(super) struct Carried {
    pub(super) name: String,
    pub(super) instance: String,
    pub(super) volume_id: Uuid,
    pub(super) dev: DevNum,
}

/// Every dm device whose uuid is blockplane's (none without device-mapper).
pub(super) fn blockplane_devices() -> Result<Vec<Carried>, BackendError> {
    let Ok(dm) = DM::new() else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (name, _, _) in dm
        .list_devices()
        .map_err(|e| dm_error("DM_LIST_DEVICES", CONTROL, e))?
    {
        let Ok(info) = dm.device_info(&DevId::Name(&name)) else {
            continue;
        };
        let Some(uuid) = info.uuid().map(|u| u.to_string()) else {
            continue;
        };
        // The volume id is the last 36 characters, the instance what precedes it.
        let Some(rest) = uuid.strip_prefix("blockplane-") else {
            continue;
        };
        let Some((owner, id)) = rest
            .len()
            .checked_sub(37)
            .and_then(|at| Some((rest.get(..at)?, rest.get(at + 1..)?)))
        else {
            continue;
        };
        let Ok(volume_id) = Uuid::parse_str(id) else {
            continue;
        };
        let d = info.device();
        out.push(Carried {
            name: name.to_string(),
            instance: owner.to_string(),
            volume_id,
            dev: DevNum {
                major: d.major,
                minor: d.minor,
            },
        });
    }
    Ok(out)
}

/// The dm devices whose uuid (`blockplane-<instance>-<volume-id>`) names
/// another instance than `instance`. They are only listed, never touched.
pub fn foreign_devices(instance: &str) -> Result<Vec<ForeignDevice>, BackendError> {
    Ok(blockplane_devices()?
        .into_iter()
        .filter(|c| c.instance != instance)
        .map(|c| ForeignDevice {
            device: format!("/dev/{}", kernel_name(c.dev)),
            name: c.name,
            instance: c.instance,
            volume_id: c.volume_id,
        })
        .collect())
}

fn dm() -> Result<DM, BackendError> {
    DM::new().map_err(|e| BackendError::io("open", CONTROL, io::Error::other(e.to_string())))
}

fn dm_error(op: &'static str, device: &str, e: DmError) -> BackendError {
    call_error(DmCallError::new(op, device, e))
}

fn call_error(e: DmCallError) -> BackendError {
    BackendError::io(e.op, e.device.clone(), e.to_io())
}

/// The kernel's name of a block device (`dm-3`), from sysfs.
pub(super) fn kernel_name(dev: DevNum) -> String {
    std::fs::read_link(format!("/sys/dev/block/{dev}"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| format!("dm-{}", dev.minor))
}

/// Why device-mapper cannot serve here (`None`: it can).
pub(super) fn unavailable() -> Option<String> {
    if !Path::new(CONTROL).exists() {
        return Some("device-mapper is not available (no /dev/mapper/control)".into());
    }
    match DM::new().and_then(|dm| dm.version()) {
        Ok(_) => None,
        Err(e) => Some(format!("device-mapper does not answer: {e}")),
    }
}

/// Target types the kernel has loaded (DM_LIST_VERSIONS).
pub(super) fn targets() -> Vec<String> {
    DM::new()
        .and_then(|dm| dm.list_versions())
        .map(|v| v.into_iter().map(|(name, ..)| name).collect())
        .unwrap_or_default()
}

/// Creates (`create`) or reloads a device's table: suspend, then
/// `prepare` (which returns the new table), load it, `before_resume`,
/// resume. Any failure leaves the old table live (or no device, when
/// creating).
pub(super) fn swap(
    instance: &str,
    volume_id: Uuid,
    create: bool,
    read_only: bool,
    prepare: impl FnOnce() -> Result<Vec<Target>, BackendError>,
    before_resume: impl FnOnce() -> Result<(), BackendError>,
) -> Result<Vec<Target>, BackendError> {
    let dm = dm()?;
    let name_s = dm_name(volume_id);
    let name = DmName::new(&name_s)
        .map_err(|e| BackendError::io("name", &name_s, io::Error::other(e.to_string())))?;
    let id = DevId::Name(name);
    if create {
        let uuid_s = dm_uuid(instance, volume_id);
        let uuid = DmUuid::new(&uuid_s)
            .map_err(|e| BackendError::io("uuid", &uuid_s, io::Error::other(e.to_string())))?;
        dm.device_create(name, Some(uuid), DmOptions::default())
            .map_err(|e| dm_error("DM_DEV_CREATE", &name_s, e))?;
    } else {
        // In-flight bios finish before the suspend returns.
        dm.device_suspend(&id, DmOptions::default().set_flags(DmFlags::DM_SUSPEND))
            .map_err(|e| dm_error("suspend", &name_s, e))?;
    }
    let undo = |dm: &DM| {
        if create {
            let _ = dm.device_remove(&id, DmOptions::default());
        } else {
            let _ = dm.table_clear(&id);
            let _ = dm.device_suspend(&id, DmOptions::default());
        }
    };
    let table = match prepare() {
        Ok(t) => t,
        Err(e) => {
            undo(&dm);
            return Err(e);
        }
    };
    let flags = if read_only {
        DmFlags::DM_READONLY
    } else {
        DmFlags::empty()
    };
    if let Err(e) = dm.table_load(&id, &table, DmOptions::default().set_flags(flags)) {
        undo(&dm);
        return Err(match errno(&e) {
            Some(libc::EBUSY) => BackendError::Refused {
                reason: format!(
                    "direct-map rule 7: device-mapper cannot open the disk under the image's filesystem, which is mounted directly on it (EBUSY); {}",
                    dispatch::RULE_7_WAY_OUT
                ),
            },
            _ => dm_error("DM_TABLE_LOAD", &name_s, e),
        });
    }
    if let Err(e) = before_resume() {
        undo(&dm);
        return Err(e);
    }
    dm.device_suspend(&id, DmOptions::default())
        .map_err(|e| dm_error("resume", &name_s, e))?;
    Ok(table)
}

/// Removes a volume's dm device (none is not an error).
pub(super) fn remove(volume_id: Uuid) -> Result<(), BackendError> {
    let name_s = dm_name(volume_id);
    let Ok(name) = DmName::new(&name_s) else {
        return Ok(());
    };
    match dm()?.device_remove(&DevId::Name(name), DmOptions::default()) {
        Ok(_) => Ok(()),
        Err(e) if errno(&e) == Some(libc::ENXIO) => Ok(()),
        Err(e) if errno(&e) == Some(libc::EBUSY) => Err(BackendError::Busy {
            device: name_s,
            reason: "it is open (mounted or held by a process); close it first".into(),
        }),
        Err(e) => Err(dm_error("DM_DEV_REMOVE", &name_s, e)),
    }
}

/// `(major, minor)` of the dm device, if it exists.
pub(super) fn devnum(volume_id: Uuid) -> Option<DevNum> {
    let name_s = dm_name(volume_id);
    let name = DmName::new(&name_s).ok()?;
    let info = dm().ok()?.device_info(&DevId::Name(name)).ok()?;
    let d = info.device();
    Some(DevNum {
        major: d.major,
        minor: d.minor,
    })
}

/// A volume's live table and whether it is loaded read-only.
pub(super) fn live_table(volume_id: Uuid) -> Result<(bool, Vec<Target>), BackendError> {
    let live = blockplane_system::dm::table(&dm_name(volume_id)).map_err(call_error)?;
    Ok((live.read_only, live.targets))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_name_gives_its_volume_back() {
        let id = Uuid::new_v4();
        assert_eq!(volume_of_name(&dm_name(id)), Some(id));
        assert_eq!(volume_of_name("blockplane-not-a-uuid"), None);
        assert_eq!(volume_of_name(&id.to_string()), None);
    }
}
