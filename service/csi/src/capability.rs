//! Volume capabilities: which access types and modes the driver serves, and
//! how a request's capability reads.

use super::mount::{FILESYSTEMS, MountOptions};
use super::proto::VolumeCapability;
use super::proto::volume_capability::AccessType;
use super::proto::volume_capability::access_mode::Mode;

/// How a volume is presented to a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// The raw block device.
    Block,
    /// A filesystem of `fstype`, mounted with `options`.
    Mount {
        fstype: String,
        options: MountOptions,
    },
}

/// A capability the driver can serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capability {
    pub access: Access,
    /// The access mode allows no writes (`SINGLE_NODE_READER_ONLY`).
    pub read_only: bool,
    /// The access mode allows one publication at a time
    /// (`SINGLE_NODE_SINGLE_WRITER`, Kubernetes' ReadWriteOncePod).
    pub single_publication: bool,
}

/// The filesystem used when a mount capability names none.
pub const DEFAULT_FS: &str = "ext4";

/// The access modes the driver serves: blockplane volumes are local to one
/// node, so every single-node mode and no multi-node one.
pub const MODES: [Mode; 4] = [
    Mode::SingleNodeWriter,
    Mode::SingleNodeReaderOnly,
    Mode::SingleNodeSingleWriter,
    Mode::SingleNodeMultiWriter,
];

/// Reads a capability; `Err` says why the driver cannot serve it.
pub fn parse(cap: &VolumeCapability) -> Result<Capability, String> {
    let mode = cap
        .access_mode
        .map(|m| Mode::try_from(m.mode).unwrap_or(Mode::Unknown))
        .unwrap_or(Mode::Unknown);
    if mode == Mode::Unknown {
        return Err("the capability has no access mode".into());
    }
    if !MODES.contains(&mode) {
        return Err(format!(
            "access mode {} is not supported: blockplane volumes are local to one node",
            mode.as_str_name()
        ));
    }
    let access = match &cap.access_type {
        None => return Err("the capability has no access type (block or mount)".into()),
        Some(AccessType::Block(_)) => Access::Block,
        Some(AccessType::Mount(m)) => {
            let fstype = if m.fs_type.is_empty() {
                DEFAULT_FS.to_string()
            } else {
                m.fs_type.clone()
            };
            if !FILESYSTEMS.contains(&fstype.as_str()) {
                return Err(format!(
                    "filesystem '{fstype}' is not supported (one of {})",
                    FILESYSTEMS.join(", ")
                ));
            }
            if !m.volume_mount_group.is_empty() {
                return Err("volume_mount_group is not supported".into());
            }
            Access::Mount {
                fstype,
                options: MountOptions::parse(&m.mount_flags)?,
            }
        }
    };
    Ok(Capability {
        access,
        read_only: mode == Mode::SingleNodeReaderOnly,
        single_publication: mode == Mode::SingleNodeSingleWriter,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(access: AccessType, mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: Some(access),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    #[test]
    fn single_node_block_and_mount_are_served() {
        let b = parse(&cap(
            AccessType::Block(BlockVolume {}),
            Mode::SingleNodeWriter,
        ))
        .unwrap();
        assert_eq!(b.access, Access::Block);
        assert!(!b.read_only);
        let m = parse(&cap(
            AccessType::Mount(MountVolume::default()),
            Mode::SingleNodeReaderOnly,
        ))
        .unwrap();
        assert!(m.read_only);
        assert!(matches!(m.access, Access::Mount { ref fstype, .. } if fstype == "ext4"));
    }

    #[test]
    fn multi_node_modes_and_other_filesystems_are_refused() {
        let e = parse(&cap(
            AccessType::Block(BlockVolume {}),
            Mode::MultiNodeMultiWriter,
        ))
        .unwrap_err();
        assert!(e.contains("MULTI_NODE_MULTI_WRITER"), "{e}");
        let e = parse(&cap(
            AccessType::Mount(MountVolume {
                fs_type: "btrfs".into(),
                ..Default::default()
            }),
            Mode::SingleNodeWriter,
        ))
        .unwrap_err();
        assert!(e.contains("btrfs"), "{e}");
        let none = VolumeCapability {
            access_type: None,
            access_mode: Some(AccessMode { mode: 1 }),
        };
        assert!(parse(&none).is_err());
    }
}
