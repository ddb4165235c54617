//! The CSI SnapshotMetadata service: changed-block tracking for backup
//! tools, which call it through the external-snapshot-metadata sidecar.
//! GetMetadataAllocated lists the ranges of a snapshot that hold data;
//! GetMetadataDelta lists the ranges whose bytes differ between two
//! snapshots of one volume. Both page through the blockplane API
//! (`GET /v1/images/{id}/allocated` and `/changes`), one stream message per
//! page, so a long answer never sits in memory whole.
//!
//! A snapshot lives on the node that made it, like a volume: a request for
//! another node's snapshot is refused with FAILED_PRECONDITION naming that
//! node (the sidecar's Service routes a caller to its own node's driver;
//! `docs/kubernetes.md`).

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::driver::Driver;
use super::errors::{CsiError, require};
use super::naming::VolumeId;
use super::proto::snapshot_metadata_server::SnapshotMetadata;
use super::proto::{
    BlockMetadata, BlockMetadataType, GetMetadataAllocatedRequest, GetMetadataAllocatedResponse,
    GetMetadataDeltaRequest, GetMetadataDeltaResponse,
};
use blockplane_api::model::{AllocatedQuery, ChangesQuery, ImageRanges, MAX_RANGES};
use uuid::Uuid;

/// Pages in flight between the API and a slow reader of the stream.
const PAGES_AHEAD: usize = 2;

/// The SnapshotMetadata service.
#[derive(Debug)]
pub struct SnapshotMetadataService {
    d: Arc<Driver>,
}

impl SnapshotMetadataService {
    /// The SnapshotMetadata service of `driver`.
    pub fn new(d: Arc<Driver>) -> Self {
        Self { d }
    }

    /// The blockplane image of a snapshot id of this node.
    fn own_snapshot(&self, id: &str) -> Result<String, CsiError> {
        let vid = VolumeId::parse(id).ok_or_else(|| CsiError::NotFound {
            volume: id.to_string(),
            reason: format!("snapshot '{id}' is not one of this driver's"),
        })?;
        if vid.node != self.d.node_id {
            return Err(CsiError::OtherNode {
                volume: id.to_string(),
                owner: vid.node,
                node: self.d.node_id.clone(),
            });
        }
        Ok(vid.name)
    }
}

/// The arguments every request carries, checked.
struct Window {
    offset: u64,
    limit: u32,
}

impl Window {
    fn parse(snapshot: &str, starting_offset: i64, max_results: i32) -> Result<Self, CsiError> {
        let invalid = |reason: String| CsiError::Invalid {
            volume: snapshot.to_string(),
            reason,
        };
        // The spec's code for a negative offset, as for one past the end.
        let offset = u64::try_from(starting_offset).map_err(|_| CsiError::OutOfRange {
            volume: snapshot.to_string(),
            reason: format!("starting_offset {starting_offset} is negative"),
        })?;
        let limit = match max_results {
            0 => MAX_RANGES,
            n if n < 0 => return Err(invalid(format!("max_results {n} is negative"))),
            n => (n as u32).min(MAX_RANGES),
        };
        Ok(Self { offset, limit })
    }
}

/// One page as the spec's message parts: the capacity and the ranges.
fn blocks(page: &ImageRanges) -> (i64, Vec<BlockMetadata>) {
    let ranges = page
        .ranges
        .iter()
        .map(|r| BlockMetadata {
            byte_offset: r.offset as i64,
            size_bytes: r.length as i64,
        })
        .collect();
    (page.size_bytes as i64, ranges)
}

/// An offset that exceeds the device's size: OUT_OF_RANGE, as the spec
/// asks. The size itself is where nothing is left: an empty answer, which
/// a caller resuming after the last range gets.
fn past_end(snapshot: &str, offset: u64, page: &ImageRanges) -> Result<(), CsiError> {
    if offset > page.size_bytes {
        return Err(CsiError::OutOfRange {
            volume: snapshot.to_string(),
            reason: format!(
                "starting_offset {offset} exceeds the snapshot's size, {} bytes",
                page.size_bytes
            ),
        });
    }
    Ok(())
}

/// The images a stream's first page answered for. Later pages ask for them
/// by id, so that a snapshot deleted and made again under its name during
/// a stream ends it (NOT_FOUND) instead of mixing two files' ranges.
#[derive(Debug, Clone, Copy)]
struct Pinned {
    image: Uuid,
    base: Option<Uuid>,
}

impl Pinned {
    /// The name or id to ask for: the id once the first page named it.
    fn image(pinned: Option<Self>, name: &str) -> String {
        pinned.map_or_else(|| name.to_string(), |p| p.image.to_string())
    }

    /// Likewise for the base of a delta.
    fn base(pinned: Option<Self>, name: &str) -> String {
        pinned
            .and_then(|p| p.base)
            .map_or_else(|| name.to_string(), |id| id.to_string())
    }
}

type PageStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Streams pages from `fetch(offset, pinned)` until the last, the first
/// one fetched before the call answers (so that a refusal is the call's
/// status, not a broken stream), the later ones of the images it named.
async fn stream_pages<T, F, Fut>(
    snapshot: String,
    offset: u64,
    fetch: F,
    message: fn(&ImageRanges) -> T,
) -> Result<PageStream<T>, Status>
where
    T: Send + 'static,
    F: Fn(u64, Option<Pinned>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<ImageRanges, CsiError>> + Send,
{
    let first = fetch(offset, None).await?;
    past_end(&snapshot, offset, &first)?;
    let pinned = Some(Pinned {
        image: first.image_id,
        base: first.base_id,
    });
    let (tx, rx) = mpsc::channel(PAGES_AHEAD);
    tokio::spawn(async move {
        let mut page = first;
        loop {
            let next = page.next_offset;
            if tx.send(Ok(message(&page))).await.is_err() {
                return; // The caller went away.
            }
            let Some(at) = next else { return };
            page = match fetch(at, pinned).await {
                Ok(p) => p,
                Err(e) => {
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
            };
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

#[tonic::async_trait]
impl SnapshotMetadata for SnapshotMetadataService {
    type GetMetadataAllocatedStream = PageStream<GetMetadataAllocatedResponse>;
    type GetMetadataDeltaStream = PageStream<GetMetadataDeltaResponse>;

    async fn get_metadata_allocated(
        &self,
        req: Request<GetMetadataAllocatedRequest>,
    ) -> Result<Response<Self::GetMetadataAllocatedStream>, Status> {
        let r = req.into_inner();
        require(
            "GetMetadataAllocated",
            "snapshot_id",
            r.snapshot_id.is_empty(),
        )?;
        let w = Window::parse(&r.snapshot_id, r.starting_offset, r.max_results)?;
        let image = self.own_snapshot(&r.snapshot_id)?;
        let (api, id, limit) = (self.d.api.clone(), r.snapshot_id.clone(), w.limit);
        let fetch = move |offset, pinned| {
            let (api, id, image) = (api.clone(), id.clone(), Pinned::image(pinned, &image));
            async move {
                let q = AllocatedQuery {
                    offset,
                    limit: Some(limit),
                };
                api.image_allocated(&id, &image, &q).await
            }
        };
        let s = stream_pages(r.snapshot_id, w.offset, fetch, |page| {
            let (capacity, block_metadata) = blocks(page);
            GetMetadataAllocatedResponse {
                block_metadata_type: BlockMetadataType::VariableLength as i32,
                volume_capacity_bytes: capacity,
                block_metadata,
            }
        })
        .await?;
        Ok(Response::new(s))
    }

    async fn get_metadata_delta(
        &self,
        req: Request<GetMetadataDeltaRequest>,
    ) -> Result<Response<Self::GetMetadataDeltaStream>, Status> {
        let r = req.into_inner();
        require(
            "GetMetadataDelta",
            "base_snapshot_id",
            r.base_snapshot_id.is_empty(),
        )?;
        require(
            "GetMetadataDelta",
            "target_snapshot_id",
            r.target_snapshot_id.is_empty(),
        )?;
        let w = Window::parse(&r.target_snapshot_id, r.starting_offset, r.max_results)?;
        let base = self.own_snapshot(&r.base_snapshot_id)?;
        let target = self.own_snapshot(&r.target_snapshot_id)?;
        let (api, id, limit) = (self.d.api.clone(), r.target_snapshot_id.clone(), w.limit);
        let fetch = move |offset, pinned| {
            let (api, id) = (api.clone(), id.clone());
            let (target, base) = (Pinned::image(pinned, &target), Pinned::base(pinned, &base));
            async move {
                let q = ChangesQuery {
                    base,
                    offset,
                    limit: Some(limit),
                };
                api.image_changes(&id, &target, &q).await
            }
        };
        let s = stream_pages(r.target_snapshot_id, w.offset, fetch, |page| {
            let (capacity, block_metadata) = blocks(page);
            GetMetadataDeltaResponse {
                block_metadata_type: BlockMetadataType::VariableLength as i32,
                volume_capacity_bytes: capacity,
                block_metadata,
            }
        })
        .await?;
        Ok(Response::new(s))
    }
}
