//! Snapshots and clones for the Controller service.
//!
//! A CSI snapshot named `S` is a read-only blockplane snapshot image named
//! [`naming::blockplane_name`]`(S)` of the source volume's image, its file
//! next to the source's; its id is `<node-id>/<name>` like a volume's. A
//! volume made from a snapshot or from another volume is a blockplane clone
//! of that image (`clone_from`), grown to the requested capacity, then a
//! volume serving it as for any other CreateVolume.
//!
//! Copies: where the image root shares extents (xfs with reflink, btrfs) a
//! snapshot or clone is instant. Elsewhere the service copies in the
//! background; a snapshot is then answered with `ready_to_use` false (the
//! snapshotter polls CreateSnapshot until it is true), and a volume whose
//! clone is still copying is answered ABORTED, which the external-provisioner
//! treats as "in progress" and retries with the same name, finding the
//! same clone.

use std::sync::Arc;

use super::driver::Driver;
use super::errors::CsiError;
use super::naming::{self, VolumeId};
use super::proto::list_snapshots_response::Entry;
use super::proto::volume_content_source::Type as SourceType;
use super::proto::{
    CapacityRange, ListSnapshotsRequest, ListSnapshotsResponse, Snapshot, VolumeContentSource,
};
use blockplane_api::model::{self, ImageState};

/// What a new volume is made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A snapshot this driver made.
    Snapshot(VolumeId),
    /// Another volume of this driver.
    Volume(VolumeId),
}

impl Source {
    /// The blockplane image the clone is made from.
    pub fn image(&self) -> &str {
        match self {
            Source::Snapshot(id) | Source::Volume(id) => &id.name,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Source::Snapshot(_) => "snapshot",
            Source::Volume(_) => "volume",
        }
    }
}

/// Reads a CreateVolume content source. An id that cannot be this driver's
/// names nothing: NOT_FOUND, as the spec asks for a missing source.
pub fn parse_source(
    node: &str,
    volume: &str,
    cs: &VolumeContentSource,
) -> Result<Source, CsiError> {
    let (id, snapshot) = match &cs.r#type {
        Some(SourceType::Snapshot(s)) => (s.snapshot_id.as_str(), true),
        Some(SourceType::Volume(v)) => (v.volume_id.as_str(), false),
        None => {
            return Err(CsiError::Invalid {
                volume: volume.to_string(),
                reason: "volume_content_source names neither a snapshot nor a volume".into(),
            });
        }
    };
    let kind = if snapshot { "snapshot" } else { "volume" };
    let vid = VolumeId::parse(id).ok_or_else(|| CsiError::NotFound {
        volume: volume.to_string(),
        reason: format!("source {kind} '{id}' is not one of this driver's"),
    })?;
    // As a topology that excludes this node: RESOURCE_EXHAUSTED, on which
    // the external-provisioner lets the scheduler pick another node.
    if vid.node != node {
        return Err(CsiError::Topology {
            volume: volume.to_string(),
            reason: format!(
                "source {kind} '{id}' lives on node '{}'; this driver creates volumes on node '{node}' only (volumes are local)",
                vid.node
            ),
        });
    }
    Ok(if snapshot {
        Source::Snapshot(vid)
    } else {
        Source::Volume(vid)
    })
}

/// The source image of a clone, checked to be what the request names: a
/// snapshot for a snapshot source, a writable image for a volume source.
pub async fn source_image(
    d: &Driver,
    volume: &str,
    source: &Source,
) -> Result<model::Image, CsiError> {
    let not_found = || CsiError::NotFound {
        volume: volume.to_string(),
        reason: format!(
            "source {} '{}' does not exist",
            source.kind(),
            source.image()
        ),
    };
    let image = d.api.image(source.image()).await?.ok_or_else(not_found)?;
    let is_snapshot = image.snapshot_of.is_some();
    if is_snapshot != matches!(source, Source::Snapshot(_)) {
        return Err(not_found());
    }
    Ok(image)
}

/// The size of a clone of a `source`-byte image: the requested capacity
/// (rounded as for any volume) and never less than the source; with nothing
/// required, the source's size. A range whose limit is below the source is
/// OUT_OF_RANGE, as the spec says for a volume smaller than its snapshot.
pub fn clone_size(
    volume: &str,
    range: Option<&CapacityRange>,
    source: u64,
) -> Result<u64, CsiError> {
    let required = range.map_or(0, |r| r.required_bytes.max(0));
    let size = if required == 0 {
        source
    } else {
        super::capacity::size_for(volume, range)?.max(source)
    };
    let limit = range.map_or(0, |r| r.limit_bytes.max(0) as u64);
    if limit > 0 && size > limit {
        return Err(CsiError::OutOfRange {
            volume: volume.to_string(),
            reason: format!(
                "its source is {source} bytes, more than limit_bytes {limit} (a volume cannot be smaller than its source)"
            ),
        });
    }
    Ok(size)
}

/// A clone that is not `ready` yet: ABORTED (retry) while it copies; a
/// failed copy is refused with its reason (the caller removes it first).
pub fn pending(volume: &str, image: &model::Image) -> CsiError {
    CsiError::Pending {
        volume: volume.to_string(),
        reason: format!(
            "its clone '{}' is being copied ({} of {} bytes); CreateVolume again once it is ready",
            image.name,
            image.copied_bytes.unwrap_or(0),
            image.copy_total_bytes.unwrap_or(0)
        ),
    }
}

/// Makes (or finds) the snapshot image `name` of the image `source`:
/// CreateSnapshot is idempotent by name. A snapshot of that name of another
/// source is ALREADY_EXISTS; one whose copy failed is made again.
pub async fn create(
    d: Arc<Driver>,
    csi_name: String,
    source: String,
    name: String,
) -> Result<model::Image, CsiError> {
    // A snapshot's image is no volume (the spec has no snapshot of a
    // snapshot): as missing.
    let src = d
        .api
        .image(&source)
        .await?
        .filter(|i| i.snapshot_of.is_none())
        .ok_or_else(|| CsiError::NotFound {
            volume: csi_name.clone(),
            reason: format!("source volume '{source}' does not exist"),
        })?;
    if let Some(existing) = d.api.image(&name).await? {
        if existing.snapshot_of != Some(src.id) {
            return Err(CsiError::Incompatible {
                volume: csi_name,
                reason: format!(
                    "snapshot name taken: blockplane image '{name}' is not a snapshot of volume '{source}'"
                ),
            });
        }
        if existing.state != ImageState::Failed {
            return Ok(existing);
        }
        tracing::info!(snapshot = %name, reason = ?existing.state_reason, "taking a failed snapshot again");
        d.api.delete_image(&name).await?;
    }
    let req = model::CreateSnapshotRequest { name: name.clone() };
    let image = d.api.snapshot_image(&source, &req).await?;
    tracing::info!(snapshot = %name, %source, method = ?image.method, state = ?image.state, "snapshot created");
    Ok(image)
}

/// Deletes snapshot `name`; an image of that name that is not a snapshot is
/// not one (a volume's image is never deleted here).
pub async fn delete(d: Arc<Driver>, name: String) -> Result<(), CsiError> {
    if let Some(image) = d.api.image(&name).await?
        && image.snapshot_of.is_some()
    {
        d.api.delete_image(&name).await?;
        tracing::info!(snapshot = %name, "snapshot deleted");
    }
    Ok(())
}

/// The CSI snapshot of a snapshot image whose source is image `source`
/// (empty once the source volume was deleted: its name is gone with it).
pub fn csi_snapshot(node: &str, image: &model::Image, source: &str) -> Snapshot {
    Snapshot {
        size_bytes: image.size_bytes as i64,
        snapshot_id: VolumeId::new(node, &image.name).to_string(),
        source_volume_id: if source.is_empty() {
            String::new()
        } else {
            VolumeId::new(node, source).to_string()
        },
        // Microseconds: what the service stores, so that the answer to the
        // create and every later one give the same time.
        creation_time: Some(prost_types::Timestamp {
            seconds: image.created_at.unix_timestamp(),
            nanos: (image.created_at.microsecond() * 1000) as i32,
        }),
        ready_to_use: image.state == ImageState::Ready,
        group_snapshot_id: String::new(),
    }
}

/// ListSnapshots: this driver's snapshots, filtered by snapshot id or by
/// source volume id (an id that cannot be this node's matches nothing), in
/// pages as ListVolumes.
pub async fn list(
    d: &Driver,
    req: &ListSnapshotsRequest,
) -> Result<ListSnapshotsResponse, CsiError> {
    let own = |id: &str| VolumeId::parse(id).filter(|v| v.node == d.node_id);
    let want_snapshot = (!req.snapshot_id.is_empty()).then(|| own(&req.snapshot_id));
    let want_source = (!req.source_volume_id.is_empty()).then(|| own(&req.source_volume_id));
    if matches!(want_snapshot, Some(None)) || matches!(want_source, Some(None)) {
        return Ok(ListSnapshotsResponse::default());
    }
    let images = d.api.images().await?;
    let names: std::collections::HashMap<_, _> =
        images.iter().map(|i| (i.id, i.name.as_str())).collect();
    let snapshots: Vec<(&model::Image, &str)> = images
        .iter()
        .filter(|i| naming::is_driver_name(&i.name))
        .filter_map(|i| Some((i, *names.get(&i.snapshot_of?).unwrap_or(&""))))
        .filter(|(i, _)| {
            want_snapshot
                .as_ref()
                .is_none_or(|w| w.as_ref().is_some_and(|w| w.name == i.name))
        })
        .filter(|(_, s)| {
            want_source
                .as_ref()
                .is_none_or(|w| w.as_ref().is_some_and(|w| w.name == *s))
        })
        .collect();
    let (page, next_token) = super::listing::page(
        "ListSnapshots",
        snapshots,
        |(i, _)| i.name.as_str(),
        req.max_entries,
        &req.starting_token,
    )?;
    Ok(ListSnapshotsResponse {
        entries: page
            .into_iter()
            .map(|(i, s)| Entry {
                snapshot: Some(csi_snapshot(&d.node_id, i, s)),
            })
            .collect(),
        next_token,
    })
}
