//! How CSI names and volume ids map to blockplane objects.
//!
//! A CSI volume named `N` is a blockplane image and a volume that both carry
//! one blockplane name: `csi-N` when that is a valid blockplane name (the
//! external-provisioner's `pvc-<uuid>` always is), else `csi_<prefix>_<digest>`
//! with a SHA-256 digest of `N`, so that any CSI name (up to 128 bytes, any
//! characters) maps to one blockplane name and different names never meet.
//! The `csi-`/`csi_` prefix marks what the driver owns: ListVolumes shows only
//! those, and the driver never touches another volume.
//!
//! A CSI snapshot named `S` is a read-only blockplane image (a snapshot of
//! the volume's image) named the same way, `blockplane_name(S)`, and its id
//! is a [`VolumeId`] as well: snapshot and volume names share one namespace
//! of images, so a snapshot cannot take a volume's name (ALREADY_EXISTS) and
//! the driver tells them apart by the image's `snapshot_of`.
//!
//! The CSI volume id is `<node-id>/<blockplane name>`: blockplane volumes are
//! local to one node, and the node in the id lets a driver refuse a volume of
//! another node instead of answering "not found" (which DeleteVolume would
//! take as "already deleted").

use sha2::{Digest, Sha256};

/// Longest blockplane name.
const MAX_NAME: usize = 63;
/// Longest volume id the CSI spec allows.
pub const MAX_VOLUME_ID: usize = 128;
/// Longest node id the driver accepts, so that every volume id fits.
pub const MAX_NODE_ID: usize = MAX_VOLUME_ID - MAX_NAME - 1;

/// Whether `s` is a valid blockplane name (`[a-z0-9][a-z0-9._-]{0,62}`).
pub fn is_valid_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAME
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

/// Whether a blockplane name is one the driver created.
pub fn is_driver_name(s: &str) -> bool {
    is_valid_name(s) && (s.starts_with("csi-") || s.starts_with("csi_"))
}

/// The blockplane name (of both the image and the volume) for a CSI name.
pub fn blockplane_name(csi_name: &str) -> String {
    let direct = format!("csi-{csi_name}");
    if is_valid_name(&direct) {
        return direct;
    }
    // A readable prefix for people, a digest for uniqueness.
    let prefix: String = csi_name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .take(24)
        .collect();
    let digest = Sha256::digest(csi_name.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("csi_{prefix}_{hex}")
}

/// A parsed CSI volume id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeId {
    /// The node whose blockplane holds the volume.
    pub node: String,
    /// The blockplane name of the image and the volume.
    pub name: String,
}

impl VolumeId {
    /// The id of blockplane volume `name` on `node`.
    pub fn new(node: &str, name: &str) -> Self {
        Self {
            node: node.to_string(),
            name: name.to_string(),
        }
    }

    /// Parses an id this driver handed out; `None` for any other string
    /// (which can name no volume of this driver).
    pub fn parse(id: &str) -> Option<Self> {
        let (node, name) = id.rsplit_once('/')?;
        (!node.is_empty() && is_driver_name(name)).then(|| Self::new(node, name))
    }
}

impl std::fmt::Display for VolumeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.node, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provisioner_names_map_directly() {
        let n = blockplane_name("pvc-0b1c6b4e-8a4f-4a8e-9c1d-0123456789ab");
        assert_eq!(n, "csi-pvc-0b1c6b4e-8a4f-4a8e-9c1d-0123456789ab");
        assert!(is_driver_name(&n));
    }

    #[test]
    fn other_names_map_to_a_digest_and_never_meet() {
        let a = blockplane_name("Sanity-CreateVolume-ABC");
        let b = blockplane_name("sanity-createvolume-abc");
        let c = blockplane_name("Sanity-CreateVolume-ABd");
        assert!(a.starts_with("csi_sanity-createvolume-ab"), "{a}");
        assert_eq!(b, "csi-sanity-createvolume-abc");
        assert_ne!(a, c);
        assert!(is_driver_name(&a) && is_driver_name(&c));
        let long = blockplane_name(&"x".repeat(128));
        assert!(is_valid_name(&long) && long.len() <= 63, "{long}");
        assert_eq!(long, blockplane_name(&"x".repeat(128)));
    }

    #[test]
    fn volume_ids_round_trip_and_refuse_strangers() {
        let id = VolumeId::new("node-1.example", "csi-pvc-1");
        assert_eq!(id.to_string(), "node-1.example/csi-pvc-1");
        assert_eq!(VolumeId::parse(&id.to_string()), Some(id));
        assert_eq!(VolumeId::parse("csi-pvc-1"), None);
        assert_eq!(VolumeId::parse("node/user-volume"), None);
        assert_eq!(VolumeId::parse("/csi-pvc-1"), None);
        assert_eq!(VolumeId::parse("reallyfakevolumeid"), None);
    }
}
