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

/// Loads `targets` as node `name`'s table and makes it live: the new table
/// is loaded first (its constructor may take a while, and the device keeps
/// serving meanwhile), then the node is suspended (its in-flight I/O
/// finished) and resumed on it. A failed load leaves the old table live.
pub fn swap(name: &str, targets: &[Target], read_only: bool) -> Result<(), DmCallError> {
    let dm_name = DmName::new(name).map_err(|e| DmCallError::new("name", name, e))?;
    let dm = DM::new().map_err(|e| DmCallError::new("open", CONTROL, e))?;
    let id = DevId::Name(dm_name);
    let flags = match read_only {
        true => DmFlags::DM_READONLY,
        false => DmFlags::empty(),
    };
    if let Err(e) = dm.table_load(&id, targets, DmOptions::default().set_flags(flags)) {
        let _ = dm.table_clear(&id);
        return Err(DmCallError::new("DM_TABLE_LOAD", name, e));
    }
    dm.device_suspend(&id, DmOptions::default().set_flags(DmFlags::DM_SUSPEND))
        .map_err(|e| DmCallError::new("suspend", name, e))?;
    dm.device_suspend(&id, DmOptions::default())
        .map_err(|e| DmCallError::new("resume", name, e))?;
    Ok(())
}

/// The status line of node `name`'s first target (`DM_TABLE_STATUS`
/// without the table flag: what the target reports of itself).
pub fn status(name: &str) -> Result<Option<Target>, DmCallError> {
    let dm_name = DmName::new(name).map_err(|e| DmCallError::new("name", name, e))?;
    let dm = DM::new().map_err(|e| DmCallError::new("open", CONTROL, e))?;
    let (_, targets) = dm
        .table_status(&DevId::Name(dm_name), DmOptions::default())
        .map_err(|e| DmCallError::new("DM_TABLE_STATUS", name, e))?;
    Ok(targets.into_iter().next())
}

/// dm-raid's `raid1` with two legs, the kernel's mirror a move runs on:
/// leg 0 holds the data, leg 1 is rebuilt from it in the background while
/// every write goes to both. md's raid1 under it acknowledges a write only
/// once it is on a leg that is in sync, so no acknowledged write exists
/// only on the leg being rebuilt.
pub mod raid1 {
    use std::path::Path;

    use super::Target;

    /// A raid1 table of two legs over `sectors`, at `rate_kib` KiB/s per
    /// leg (none: md's host-wide limits, the rebuild slowed to their
    /// minimum while the consumer does I/O). A rate is both the set's
    /// minimum and maximum: md throttles only above the minimum, so a
    /// maximum below md's default minimum (1000 KiB/s) would not hold, and
    /// a rate the consumer's I/O may slow is not one the operator asked
    /// for.
    ///
    /// `rebuild` makes leg 1 rebuilt from leg 0 from its first sector:
    /// for a new set. Without it, a set whose metadata legs (`metas`) hold
    /// its superblocks goes on from where they say the rebuild is; without
    /// metadata legs the kernel would take both legs as in sync.
    pub fn table(
        sectors: u64,
        legs: [&Path; 2],
        metas: Option<[&Path; 2]>,
        rate_kib: Option<u64>,
        rebuild: bool,
    ) -> Vec<Target> {
        // chunk size 0 (raid1 has none), then the optional pairs.
        let mut params = vec!["0".to_string()];
        if rebuild {
            params.extend(["rebuild".into(), "1".into()]);
        }
        if let Some(kib) = rate_kib {
            params.extend([
                "min_recovery_rate".into(),
                kib.to_string(),
                "max_recovery_rate".into(),
                kib.to_string(),
            ]);
        }
        let meta = |i: usize| match metas {
            Some(m) => m[i].display().to_string(),
            None => "-".into(),
        };
        let line = format!(
            "{} {} 2 {} {} {} {}",
            params.len(),
            params.join(" "),
            meta(0),
            legs[0].display(),
            meta(1),
            legs[1].display()
        );
        vec![(0, sectors, "raid".into(), format!("raid1 {line}"))]
    }

    /// Each leg's metadata device and data device, in table order, as a
    /// raid1 table's parameters name them (`-`: no metadata device);
    /// `None` when `params` is not a two-leg raid1 table.
    pub fn devices(params: &str) -> Option<[(String, String); 2]> {
        let mut f = params.split_whitespace();
        if f.next()? != "raid1" {
            return None;
        }
        let n: usize = f.next()?.parse().ok()?;
        let mut f = f.skip(n);
        if f.next()? != "2" {
            return None;
        }
        let mut leg = || Some((f.next()?.to_string(), f.next()?.to_string()));
        Some([leg()?, leg()?])
    }

    /// One leg's health as dm-raid reports it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Health {
        /// `A`: alive and in sync.
        InSync,
        /// `a`: alive, being rebuilt (or waiting to be).
        Rebuilding,
        /// `D`: dead, failed by an I/O error.
        Dead,
        /// Anything else (`-`, `p`, …).
        Other(char),
    }

    /// What a raid1 target says of itself.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Status {
        /// Per leg, in table order.
        pub health: Vec<Health>,
        /// Sectors the rebuild (or resync) has done.
        pub done_sectors: u64,
        /// Sectors it has to do in all.
        pub total_sectors: u64,
        /// `recover`, `resync`, `idle`, `frozen`, …
        pub action: String,
    }

    impl Status {
        /// Every leg in sync and nothing running: leg 1 holds leg 0's data.
        pub fn synced(&self) -> bool {
            self.health.iter().all(|h| *h == Health::InSync) && self.action == "idle"
        }
    }

    /// Parses a raid target's status parameters:
    /// `raid1 <#devs> <health> <done>/<total> <action> …`; `None` when the
    /// target is not a raid1 (a linear table, for instance).
    pub fn parse(target_type: &str, params: &str) -> Option<Status> {
        if target_type != "raid" {
            return None;
        }
        let mut f = params.split_whitespace();
        if f.next()? != "raid1" {
            return None;
        }
        let _devs: usize = f.next()?.parse().ok()?;
        let health = f
            .next()?
            .chars()
            .map(|c| match c {
                'A' => Health::InSync,
                'a' => Health::Rebuilding,
                'D' => Health::Dead,
                other => Health::Other(other),
            })
            .collect();
        let (done, total) = f.next()?.split_once('/')?;
        Some(Status {
            health,
            done_sectors: done.parse().ok()?,
            total_sectors: total.parse().ok()?,
            action: f.next()?.to_string(),
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_table_rebuilds_leg_one_from_leg_zero() {
            let t = table(
                2048,
                [Path::new("/dev/nvme0n1"), Path::new("/dev/dm-3")],
                None,
                Some(4096),
                true,
            );
            assert_eq!(
                t,
                vec![(
                    0,
                    2048,
                    "raid".to_string(),
                    "raid1 7 0 rebuild 1 min_recovery_rate 4096 max_recovery_rate 4096 2 - /dev/nvme0n1 - /dev/dm-3"
                        .to_string()
                )]
            );
            let t = table(8, [Path::new("/a"), Path::new("/b")], None, None, true);
            assert_eq!(t[0].3, "raid1 3 0 rebuild 1 2 - /a - /b");
            let metas = Some([Path::new("7:2"), Path::new("7:3")]);
            let t = table(
                8,
                [Path::new("/a"), Path::new("/b")],
                metas,
                Some(64),
                false,
            );
            assert_eq!(
                t[0].3,
                "raid1 5 0 min_recovery_rate 64 max_recovery_rate 64 2 7:2 /a 7:3 /b"
            );
        }

        #[test]
        fn a_table_names_its_legs() {
            let t = table(
                8,
                [Path::new("259:1"), Path::new("252:3")],
                Some([Path::new("7:2"), Path::new("7:3")]),
                Some(64),
                true,
            );
            assert_eq!(
                devices(&t[0].3),
                Some([
                    ("7:2".to_string(), "259:1".to_string()),
                    ("7:3".to_string(), "252:3".to_string())
                ])
            );
            assert_eq!(
                devices("raid1 3 0 rebuild 1 2 - 259:1 - 252:3"),
                Some([
                    ("-".to_string(), "259:1".to_string()),
                    ("-".to_string(), "252:3".to_string())
                ])
            );
            assert_eq!(devices("259:1 0"), None);
            assert_eq!(devices("raid1 1 0 2 - 259:1"), None);
        }

        #[test]
        fn a_status_reads_progress_and_health() {
            let s = parse("raid", "raid1 2 Aa 1024/2097152 recover 0 0 -").unwrap();
            assert_eq!(s.health, vec![Health::InSync, Health::Rebuilding]);
            assert_eq!((s.done_sectors, s.total_sectors), (1024, 2097152));
            assert_eq!(s.action, "recover");
            assert!(!s.synced());
            let s = parse("raid", "raid1 2 AA 2097152/2097152 idle 0 0 -").unwrap();
            assert!(s.synced());
            let s = parse("raid", "raid1 2 DA 2097152/2097152 idle 0 0 -").unwrap();
            assert_eq!(s.health[0], Health::Dead);
            assert!(!s.synced());
            assert_eq!(parse("linear", "259:1 0"), None);
            assert_eq!(parse("raid", "raid1 2 Aa garbage recover"), None);
        }
    }
}
