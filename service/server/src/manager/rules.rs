//! The manager's rules, without root: a real SQLite registry in a temporary
//! directory, real image files under a real root, and the in-memory
//! [`FakeBackend`] in place of the kernel.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::json;
use uuid::Uuid;

use super::error::Error;
use super::fake::{Call, FakeBackend};
use super::{Backends, Created, Manager, ManagerConfig};
use crate::backend::{Attachment, BackendError, Change, EventSink, OrphanPolicy, VolumeBackend};
use crate::fault::Faults;
use crate::store::{EventFilter, Store, VolumeRow};
use blockplane_api::model::{
    Backend, CreateImageRequest, CreateVolumeRequest, DispatchPolicy, PatchVolumeRequest, Qos,
    VolumeState,
};
use blockplane_system::dispatch::{On, Reason};
use blockplane_system::image::ImageRoots;

/// A manager over a fresh registry and image root, with one fake backend.
struct Bed {
    dir: tempfile::TempDir,
    store: Store,
    fake: Arc<FakeBackend>,
    m: Arc<Manager>,
}

impl Bed {
    async fn new(policy: OrphanPolicy) -> Self {
        Self::of(Backend::Ublk, policy).await
    }

    /// A bed whose one fake backend is `kind`.
    async fn of(kind: Backend, policy: OrphanPolicy) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("images")).unwrap();
        let store = Store::open(&dir.path().join("blockplane.db"))
            .await
            .unwrap();
        let fake = Arc::new(FakeBackend::new(kind, policy));
        let m = manager(&dir, &store, &fake, 8).await;
        Self {
            dir,
            store,
            fake,
            m,
        }
    }

    /// The service stops and starts again over the same registry and
    /// devices: the old manager is gone (its image locks with it), a new one
    /// reconciles.
    async fn restart(&mut self) -> super::reconcile::Report {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while Arc::strong_count(&self.m) > 1 && std::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(Arc::strong_count(&self.m), 1, "the old manager lingers");
        // Its backend-event thread holds its house, and with it the old
        // volumes' image locks, until it sees the channel closed: a
        // reconcile meanwhile could not lock an image again (a vanished
        // device then fails to reattach, seen under CI's load).
        let house = Arc::downgrade(&self.m.house);
        self.m = manager(&self.dir, &self.store, &self.fake, 8).await;
        while house.strong_count() > 0 && std::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(house.strong_count(), 0, "the old house lingers");
        self.m.reconcile().await.unwrap()
    }

    /// A bed whose image `img` serves volume `v`, created with `extra`;
    /// and the volume's row as created.
    async fn with_volume(extra: serde_json::Value) -> (Self, VolumeRow) {
        let bed = Self::new(OrphanPolicy::Remove).await;
        bed.image("img").await;
        bed.create("v", "img", extra).await.unwrap();
        let row = bed.row("v").await.unwrap();
        (bed, row)
    }

    /// Volume `v` is as `before`: its row, its device, and no call made on
    /// it since its attach.
    async fn assert_unchanged(&self, before: &VolumeRow) {
        assert_eq!(settings(&self.row("v").await.unwrap()), settings(before));
        assert_eq!(self.fake.device(before.id), before.attachment);
        assert_eq!(self.calls(before.id), vec![Call::Attach(before.id)]);
    }

    /// A PATCH of `v` is refused on `field` and leaves it as `before`.
    async fn assert_patch_refused(
        &self,
        patch: serde_json::Value,
        field: &str,
        before: &VolumeRow,
    ) {
        let e = self.patch("v", patch).await.unwrap_err();
        assert!(is_volume_error(&e, "v", field), "{e}");
        self.assert_unchanged(before).await;
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("images").canonicalize().unwrap()
    }

    /// Creates a 1 MiB image file `name` under the root.
    async fn image(&self, name: &str) {
        let path = self.root().join(format!("{name}.img"));
        let req: CreateImageRequest = serde_json::from_value(json!({
            "name": name,
            "path": path.to_str().unwrap(),
            "create": {"size_bytes": 1 << 20}
        }))
        .unwrap();
        self.m.create_image(req).await.unwrap();
    }

    /// Creates volume `name` on image `image`; `extra` adds fields.
    async fn create(
        &self,
        name: &str,
        image: &str,
        extra: serde_json::Value,
    ) -> super::error::Result<Created<blockplane_api::model::Volume>> {
        let mut req = json!({"name": name, "image": image, "backend": "ublk"});
        req.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let req: CreateVolumeRequest = serde_json::from_value(req).unwrap();
        self.m.volumes().create_volume(req).await
    }

    async fn patch(
        &self,
        name: &str,
        patch: serde_json::Value,
    ) -> super::error::Result<blockplane_api::model::Volume> {
        let patch: PatchVolumeRequest = serde_json::from_value(patch).unwrap();
        self.m.volumes().patch_volume(name, patch).await
    }

    async fn row(&self, name: &str) -> Option<VolumeRow> {
        self.store.volume(name).await.unwrap()
    }

    /// The kinds of a volume's events, oldest first.
    async fn events(&self, volume: Uuid) -> Vec<String> {
        self.store
            .events(&EventFilter {
                volume_id: Some(volume),
                since: None,
                kind: None,
                limit: 1000,
            })
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }

    /// The fake's calls about one volume.
    fn calls(&self, volume: Uuid) -> Vec<Call> {
        self.fake
            .calls()
            .into_iter()
            .filter(|c| match c {
                Call::Attach(id) | Call::Detach(id) | Call::Reconfigure(id, _) => *id == volume,
            })
            .collect()
    }
}

async fn manager(
    dir: &tempfile::TempDir,
    store: &Store,
    fake: &Arc<FakeBackend>,
    max_volumes: usize,
) -> Arc<Manager> {
    manager_over(dir, store, vec![fake.clone()], max_volumes).await
}

/// A manager over the backends `list` (the host has those and no others).
async fn manager_over(
    dir: &tempfile::TempDir,
    store: &Store,
    list: Vec<Arc<dyn VolumeBackend>>,
    max_volumes: usize,
) -> Arc<Manager> {
    let roots = ImageRoots::open(&[dir.path().join("images")]).unwrap();
    // The sink goes at once: the fake notices nothing on its own.
    let (_, events) = EventSink::channel();
    Manager::new(
        store.clone(),
        roots,
        Backends { list, events },
        ManagerConfig {
            run_dir: dir.path().join("run"),
            default_queues: 1,
            max_volumes,
            max_overcommit: None,
            kdf: blockplane_system::crypt::Kdf::Timed { unlock_ms: 100 },
            backup_target: None,
            standby_check: None,
            faults: Faults::default(),
            clock: crate::fault::Clock::default(),
            export_addresses: Vec::new(),
            peer_token: None,
        },
    )
    .await
    .unwrap()
}

/// What a refused request must leave as it was: the row's settings and
/// state, and the device.
type Settings = (
    DispatchPolicy,
    bool,
    Option<Qos>,
    VolumeState,
    Option<Attachment>,
);

fn settings(v: &VolumeRow) -> Settings {
    (
        v.dispatch,
        v.read_only,
        v.qos,
        v.state,
        v.attachment.clone(),
    )
}

fn is_volume_error(e: &Error, volume: &str, field: &str) -> bool {
    matches!(e, Error::Volume { name, source: BackendError::NotLive { field: f, .. } }
        if name == volume && *f == field)
}

#[tokio::test]
async fn create_again_with_the_same_spec_returns_the_volume_and_attaches_once() {
    let bed = Bed::new(OrphanPolicy::Remove).await;
    bed.image("img").await;
    let first = bed.create("v", "img", json!({})).await.unwrap();
    let Created::New(first) = first else {
        panic!("the first create made nothing new")
    };
    let again = bed.create("v", "img", json!({})).await.unwrap();
    let Created::Existing(again) = again else {
        panic!("the second create made a new volume")
    };
    assert_eq!(first.id, again.id);
    assert_eq!(again.device, first.device);
    assert_eq!(bed.calls(first.id), vec![Call::Attach(first.id)]);
    assert_eq!(
        bed.events(first.id).await,
        ["volume_created", "volume_attached"]
    );
}

#[tokio::test]
async fn create_again_with_another_spec_is_refused_and_changes_nothing() {
    let (bed, before) = Bed::with_volume(json!({})).await;
    let e = bed
        .create("v", "img", json!({"dispatch": "threaded"}))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::VolumeExists { name, differences } if name == "v" && differences.contains("dispatch")),
        "{e}"
    );
    bed.assert_unchanged(&before).await;
}

#[tokio::test]
async fn delete_removes_the_device_and_the_row_then_answers_not_found() {
    let (bed, before) = Bed::with_volume(json!({})).await;
    let id = before.id;
    bed.m.volumes().delete_volume("v").await.unwrap();
    assert!(bed.row("v").await.is_none());
    assert!(bed.fake.device(id).is_none());
    let e = bed.m.volumes().delete_volume("v").await.unwrap_err();
    assert!(matches!(&e, Error::VolumeNotFound(n) if n == "v"), "{e}");
    assert_eq!(bed.calls(id), vec![Call::Attach(id), Call::Detach(id)]);
    assert_eq!(
        bed.events(id).await,
        [
            "volume_created",
            "volume_attached",
            "volume_detaching",
            "volume_deleted"
        ]
    );
    // Its image is free for another volume again.
    bed.create("w", "img", json!({})).await.unwrap();
}

#[tokio::test]
async fn bad_names_are_refused_before_anything_is_recorded() {
    let bed = Bed::new(OrphanPolicy::Remove).await;
    bed.image("img").await;
    for bad in ["", "Vol", "-v", "a/b", &"v".repeat(64)] {
        let e = bed.create(bad, "img", json!({})).await.unwrap_err();
        assert!(
            matches!(&e, Error::InvalidName { what: "volume", name } if name == bad),
            "{bad}: {e}"
        );
    }
    assert!(bed.store.volumes().await.unwrap().is_empty());
    assert!(bed.fake.calls().is_empty());
}

#[tokio::test]
async fn an_image_serves_one_volume_at_a_time() {
    let bed = Bed::new(OrphanPolicy::Remove).await;
    bed.image("img").await;
    bed.create("first", "img", json!({})).await.unwrap();
    let e = bed.create("second", "img", json!({})).await.unwrap_err();
    assert!(
        matches!(&e, Error::ImageInUse { name, volumes } if name == "img" && volumes == "'first'"),
        "{e}"
    );
    assert!(bed.row("second").await.is_none());
    assert_eq!(bed.fake.calls().len(), 1, "{:?}", bed.fake.calls());
}

#[tokio::test]
async fn a_policy_the_backend_refuses_records_nothing() {
    let bed = Bed::new(OrphanPolicy::Remove).await;
    bed.image("img").await;
    bed.fake.refuse_policy(DispatchPolicy::Direct);
    let e = bed
        .create("v", "img", json!({"dispatch": "direct"}))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Volume { name, source: BackendError::Unsupported { .. } } if name == "v"),
        "{e}"
    );
    assert!(bed.row("v").await.is_none());
    assert!(bed.fake.calls().is_empty());
    // Refused before the image was taken: another spec gets it.
    bed.create("v", "img", json!({})).await.unwrap();
}

#[tokio::test]
async fn the_volume_cap_holds() {
    let mut bed = Bed::new(OrphanPolicy::Remove).await;
    bed.m = manager(&bed.dir, &bed.store, &bed.fake, 1).await;
    bed.image("a").await;
    bed.image("b").await;
    bed.create("one", "a", json!({})).await.unwrap();
    let e = bed.create("two", "b", json!({})).await.unwrap_err();
    assert!(
        matches!(&e, Error::VolumeLimit { name, max: 1 } if name == "two"),
        "{e}"
    );
    assert!(bed.row("two").await.is_none());
    assert_eq!(bed.fake.calls().len(), 1);
}

#[tokio::test]
async fn a_volume_created_read_only_never_turns_writable() {
    let (bed, before) = Bed::with_volume(json!({"read_only": true})).await;
    assert!(before.attachment.as_ref().unwrap().read_only);
    bed.assert_patch_refused(json!({"read_only": false}), "read_only", &before)
        .await;
}

/// The bug of issue 16: a PATCH whose second change a rule of the manager's
/// refuses must not make its first one.
#[tokio::test]
async fn a_patch_whose_second_change_breaks_a_rule_changes_nothing() {
    let (bed, before) = Bed::with_volume(json!({"read_only": true})).await;
    bed.assert_patch_refused(
        json!({"dispatch": "threaded", "read_only": false}),
        "read_only",
        &before,
    )
    .await;
    assert_eq!(
        bed.events(before.id).await,
        ["volume_created", "volume_attached"]
    );
}

#[tokio::test]
async fn a_patch_whose_second_change_the_backend_refuses_changes_nothing() {
    let (bed, before) = Bed::with_volume(json!({})).await;
    bed.fake.refuse("read_only");
    bed.assert_patch_refused(
        json!({"dispatch": "threaded", "read_only": true}),
        "read_only",
        &before,
    )
    .await;
}

#[tokio::test]
async fn a_patch_whose_second_change_fails_is_undone() {
    let (bed, before) = Bed::with_volume(json!({})).await;
    bed.fake.fail("qos");
    let qos = Qos {
        iops: Some(100),
        ..Default::default()
    };
    let e = bed
        .patch("v", json!({"dispatch": "threaded", "qos": qos}))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Volume { name, source: BackendError::Refused { .. } } if name == "v"),
        "{e}"
    );
    let id = before.id;
    assert_eq!(
        bed.calls(id),
        vec![
            Call::Attach(id),
            Call::Reconfigure(id, Change::Dispatch(DispatchPolicy::Threaded)),
            Call::Reconfigure(id, Change::Qos(Some(qos))),
            // Back to what the row asks: `auto`, the default.
            Call::Reconfigure(id, Change::Dispatch(DispatchPolicy::Auto)),
        ]
    );
    assert_eq!(settings(&bed.row("v").await.unwrap()), settings(&before));
    assert_eq!(bed.fake.device(id), before.attachment);
}

#[tokio::test]
async fn a_patch_makes_every_change_and_records_each() {
    let (bed, _) = Bed::with_volume(json!({})).await;
    let v = bed
        .patch(
            "v",
            json!({"dispatch": "threaded", "read_only": true, "qos": null}),
        )
        .await
        .unwrap();
    assert_eq!(v.requested_dispatch, DispatchPolicy::Threaded);
    assert!(v.read_only);
    let row = bed.row("v").await.unwrap();
    assert_eq!(row.dispatch, DispatchPolicy::Threaded);
    assert!(row.read_only);
    // The row's device is the backend's.
    assert_eq!(bed.fake.device(row.id), row.attachment);
    assert!(row.attachment.as_ref().unwrap().read_only);
    assert_eq!(
        bed.events(row.id).await,
        [
            "volume_created",
            "volume_attached",
            "dispatch_changed",
            "read_only_changed"
        ]
    );
    // The same PATCH again is no change at all.
    bed.patch("v", json!({"dispatch": "threaded", "read_only": true}))
        .await
        .unwrap();
    assert_eq!(bed.calls(row.id).len(), 3);
}

/// A dm volume asks for `kernel` by name, by PATCH and at create: the
/// answer, the row and the device agree on it (the device had moved before
/// the row was written, so a refused row left them apart); a restarted
/// service adopts it with nothing to change back, and moves it back to the
/// kernel when the device is elsewhere.
#[tokio::test]
async fn a_dm_volume_asks_for_kernel_by_name_and_its_row_says_so() {
    use blockplane_api::model::ActiveDispatch;
    let mut bed = Bed::of(Backend::Dm, OrphanPolicy::Remove).await;
    bed.image("img").await;
    bed.create("v", "img", json!({"backend": "dm", "dispatch": "nowait"}))
        .await
        .unwrap();
    let v = bed.patch("v", json!({"dispatch": "kernel"})).await.unwrap();
    assert_eq!(v.requested_dispatch, DispatchPolicy::Kernel);
    assert_eq!(v.dispatch, ActiveDispatch::Kernel);
    let row = bed.row("v").await.unwrap();
    assert_eq!(row.dispatch, DispatchPolicy::Kernel);
    assert_eq!(bed.fake.device(row.id), row.attachment);
    assert_eq!(
        bed.events(row.id).await,
        ["volume_created", "volume_attached", "dispatch_changed"]
    );

    bed.image("img2").await;
    let Created::New(w) = bed
        .create("w", "img2", json!({"backend": "dm", "dispatch": "kernel"}))
        .await
        .unwrap()
    else {
        panic!("the create made nothing new")
    };
    assert_eq!(w.requested_dispatch, DispatchPolicy::Kernel);
    assert_eq!(w.dispatch, ActiveDispatch::Kernel);
    assert_eq!(bed.row("w").await.unwrap().dispatch, DispatchPolicy::Kernel);

    let report = bed.restart().await;
    assert_eq!(
        (report.adopted, report.reattached, report.failed),
        (2, 0, 0)
    );
    for name in ["v", "w"] {
        let after = bed.row(name).await.unwrap();
        assert_eq!(after.dispatch, DispatchPolicy::Kernel, "{name}");
        assert_eq!(
            after.attachment.as_ref().map(|a| a.dispatch),
            Some(ActiveDispatch::Kernel),
            "{name}"
        );
    }
    // Adopted as they are: only the limits are sent again (a dm volume's
    // private worker would hold them), no dispatch.
    let (v, w) = (row.id, w.id);
    assert_eq!(
        bed.calls(v),
        [
            Call::Attach(v),
            Call::Reconfigure(v, Change::Dispatch(DispatchPolicy::Kernel)),
            Call::Reconfigure(v, Change::Qos(None)),
        ]
    );
    assert_eq!(
        bed.calls(w),
        [Call::Attach(w), Call::Reconfigure(w, Change::Qos(None))]
    );

    // The service died between moving `v` to a worker and recording it:
    // the next start moves it back to the kernel, as its row asks.
    let mut moved = bed.fake.device(v).unwrap();
    moved.dispatch = ActiveDispatch::Nowait;
    bed.fake.set_device(v, Some(moved));
    bed.restart().await;
    assert_eq!(
        bed.calls(v)[3..],
        [
            Call::Reconfigure(v, Change::Dispatch(DispatchPolicy::Kernel)),
            Call::Reconfigure(v, Change::Qos(None))
        ]
    );
    let device = bed.fake.device(v).unwrap();
    assert_eq!(device.dispatch, ActiveDispatch::Kernel);
    let row = bed.row("v").await.unwrap();
    assert_eq!(row.dispatch, DispatchPolicy::Kernel);
    assert_eq!(row.attachment, Some(device));
}

#[tokio::test]
async fn a_patch_with_a_zero_limit_is_refused_before_the_backend_hears_of_it() {
    let (bed, before) = Bed::with_volume(json!({})).await;
    let e = bed
        .patch("v", json!({"dispatch": "threaded", "qos": {"iops": 0}}))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            Error::InvalidField {
                field: "qos.iops",
                ..
            }
        ),
        "{e}"
    );
    bed.assert_unchanged(&before).await;
}

#[tokio::test]
async fn reconcile_adopts_a_matching_device_without_touching_it() {
    let (mut bed, before) = Bed::with_volume(json!({})).await;
    let report = bed.restart().await;
    assert_eq!(
        (report.adopted, report.reattached, report.failed),
        (1, 0, 0)
    );
    // A ublk worker does not report its limits: the row's are sent again.
    assert_eq!(
        bed.calls(before.id),
        vec![
            Call::Attach(before.id),
            Call::Reconfigure(before.id, Change::Qos(None))
        ]
    );
    assert_eq!(settings(&bed.row("v").await.unwrap()), settings(&before));
    assert_eq!(
        bed.events(before.id).await,
        ["volume_created", "volume_attached"]
    );
}

#[tokio::test]
async fn reconcile_applies_again_a_change_the_row_never_recorded() {
    // Asked, not `auto`: a policy the backend chose is not forced back.
    let (mut bed, before) = Bed::with_volume(json!({"dispatch": "nowait"})).await;
    let id = before.id;
    // The service died between changing the device and recording it.
    let mut changed = bed.fake.device(id).unwrap();
    changed.dispatch = blockplane_api::model::ActiveDispatch::Threaded;
    changed.read_only = true;
    bed.fake.set_device(id, Some(changed));
    bed.restart().await;
    let device = bed.fake.device(id).unwrap();
    assert_eq!(
        device.dispatch,
        blockplane_api::model::ActiveDispatch::Nowait
    );
    assert!(!device.read_only);
    let row = bed.row("v").await.unwrap();
    assert_eq!(row.attachment, Some(device));
    assert_eq!(row.dispatch, DispatchPolicy::Nowait);
    assert!(bed.calls(id).contains(&Call::Reconfigure(
        id,
        Change::Dispatch(DispatchPolicy::Nowait)
    )));
}

#[tokio::test]
async fn reconcile_attaches_again_a_volume_whose_device_vanished() {
    let (mut bed, before) = Bed::with_volume(json!({})).await;
    bed.fake.set_device(before.id, None);
    let report = bed.restart().await;
    assert_eq!(
        (report.adopted, report.reattached, report.failed),
        (0, 1, 0)
    );
    let row = bed.row("v").await.unwrap();
    assert_eq!(row.state, VolumeState::Attached);
    let device = bed.fake.device(row.id).expect("a new device");
    assert_ne!(
        Some(&device.device),
        before.attachment.as_ref().map(|a| &a.device)
    );
    assert_eq!(row.attachment, Some(device));
    assert_eq!(
        bed.calls(row.id),
        vec![Call::Attach(row.id), Call::Attach(row.id)]
    );
    assert_eq!(
        bed.events(row.id).await.last().map(String::as_str),
        Some("volume_reattached")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_works_on_several_volumes_at_once() {
    let (mut bed, first) = Bed::with_volume(json!({})).await;
    bed.image("img2").await;
    bed.create("v2", "img2", json!({})).await.unwrap();
    bed.image("img3").await;
    bed.create("v3", "img3", json!({})).await.unwrap();
    let third = bed.row("v3").await.unwrap();
    bed.fake.set_device(third.id, None);
    // Each probe waits for the other two: one at a time, the most is 1.
    bed.fake.probes_meet(3);
    let report = bed.restart().await;
    assert_eq!(
        bed.fake.most_probing(),
        3,
        "the volumes were probed one at a time"
    );
    assert_eq!(
        (report.adopted, report.reattached, report.failed),
        (2, 1, 0)
    );
    for name in ["v", "v2", "v3"] {
        assert_eq!(bed.row(name).await.unwrap().state, VolumeState::Attached);
    }
    assert!(bed.fake.device(first.id).is_some());
    assert!(bed.fake.device(third.id).is_some(), "v3 attached again");
}

#[tokio::test]
async fn reconcile_finishes_a_delete_caught_half_way() {
    let (mut bed, mut row) = Bed::with_volume(json!({})).await;
    row.state = VolumeState::Detaching;
    let mut tx = bed.store.begin().await.unwrap();
    tx.update_volume(&row).await.unwrap();
    tx.commit().await.unwrap();
    let report = bed.restart().await;
    assert_eq!(report.finished_deletes, 1);
    assert!(bed.row("v").await.is_none());
    assert!(bed.fake.device(row.id).is_none());
    assert_eq!(
        bed.calls(row.id),
        vec![Call::Attach(row.id), Call::Detach(row.id)]
    );
}

#[tokio::test]
async fn reconcile_removes_a_marked_device_with_no_volume() {
    let (mut bed, kept) = Bed::with_volume(json!({})).await;
    let orphan = Uuid::new_v4();
    let att = bed.fake.attachment(1 << 20, DispatchPolicy::Nowait, false);
    bed.fake.set_device(orphan, Some(att));
    let report = bed.restart().await;
    assert_eq!(report.orphans_removed, 1);
    assert!(bed.fake.device(orphan).is_none());
    assert!(bed.fake.device(kept.id).is_some());
    assert_eq!(bed.calls(orphan), vec![Call::Detach(orphan)]);
    assert_eq!(bed.events(orphan).await, ["orphan_removed"]);
}

#[tokio::test]
async fn reconcile_reports_an_orphan_under_the_report_policy_until_asked() {
    let mut bed = Bed::new(OrphanPolicy::Report).await;
    let orphan = Uuid::new_v4();
    let att = bed.fake.attachment(1 << 20, DispatchPolicy::Nowait, false);
    let device = att.device.clone();
    bed.fake.set_device(orphan, Some(att));
    let report = bed.restart().await;
    assert_eq!(report.orphans_removed, 0);
    assert!(bed.fake.device(orphan).is_some());
    let listed = bed.m.orphans().list().await.unwrap();
    assert!(
        listed
            .iter()
            .any(|o| o.volume_id == Some(orphan) && o.device == device && o.removable),
        "{listed:?}"
    );
    bed.m.orphans().delete(&orphan.to_string()).await.unwrap();
    assert!(bed.fake.device(orphan).is_none());
    assert_eq!(bed.calls(orphan), vec![Call::Detach(orphan)]);
}

#[tokio::test]
async fn the_event_feed_replays_from_its_start_then_follows_new_events() {
    let (bed, v) = Bed::with_volume(json!({})).await;
    let query = |after| blockplane_api::model::EventStreamQuery {
        volume: Some("v".into()),
        after,
    };
    let mut feed = bed
        .m
        .events()
        .subscribe(query(Some(0)), None)
        .await
        .unwrap();
    let mut replayed = Vec::new();
    for _ in 0..2 {
        replayed.push(feed.next().await.unwrap().kind);
    }
    assert_eq!(replayed, ["volume_created", "volume_attached"]);
    // From now on: only what comes next, and only of this volume.
    let mut now = bed.m.events().subscribe(query(None), None).await.unwrap();
    bed.image("other").await;
    bed.create("w", "other", json!({})).await.unwrap();
    bed.patch("v", json!({"dispatch": "threaded"}))
        .await
        .unwrap();
    let next = tokio::time::timeout(std::time::Duration::from_secs(5), now.next())
        .await
        .expect("the feed follows new events")
        .unwrap();
    assert_eq!(
        (next.kind.as_str(), next.volume_id),
        ("dispatch_changed", Some(v.id))
    );
    let unknown = blockplane_api::model::EventStreamQuery {
        volume: Some("gone".into()),
        after: None,
    };
    let e = bed.m.events().subscribe(unknown, None).await.err();
    assert!(matches!(&e, Some(Error::VolumeNotFound(n)) if n == "gone"));
}

/// A writable volume's image on a filesystem that cannot share extents
/// (this test's ext4 or tmpfs): its moment must be copied by the volume's
/// worker; a backend that refuses that (this fake, as the loop driver
/// would) leaves no file or row, and the refusal names the volume.
#[tokio::test]
async fn a_moment_copy_the_backend_refuses_changes_nothing() {
    let (bed, before) = Bed::with_volume(json!({})).await;
    let e = bed
        .m
        .images()
        .snapshot_image("img", "snap")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("'v'"), "{e}");
    assert!(!bed.root().join("snap").exists());
    assert!(bed.store.image("snap").await.unwrap().is_none());
    bed.assert_unchanged(&before).await;
}

/// What `backend: auto` picks on a host with `kinds` (fakes; the dm fake
/// decides `dm_auto` for `dispatch: auto`) for the spec `extra`: the
/// backend, the policy and the reason the volume reports.
async fn auto_picks(
    kinds: &[Backend],
    dm_auto: &(DispatchPolicy, Reason),
    extra: serde_json::Value,
) -> (Backend, String, String) {
    let bed = Bed::new(OrphanPolicy::Remove).await;
    bed.image("img").await;
    let fakes: Vec<Arc<FakeBackend>> = kinds
        .iter()
        .map(|k| Arc::new(FakeBackend::new(*k, OrphanPolicy::Remove)))
        .collect();
    for f in &fakes {
        match f.kind() {
            Backend::Dm => f.decide_auto(dm_auto.0, dm_auto.1.clone()),
            Backend::Ublk => f.decide_auto(
                DispatchPolicy::Nowait,
                Reason::AutoFellBack {
                    to: DispatchPolicy::Nowait,
                    rule: "ublk's rule".into(),
                },
            ),
            Backend::Loop => {}
        }
    }
    let list = fakes
        .iter()
        .map(|f| f.clone() as Arc<dyn VolumeBackend>)
        .collect();
    let m = manager_over(&bed.dir, &bed.store, list, 8).await;
    let mut req = json!({"name": "v", "image": "img", "backend": "auto"});
    req.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let v = match m
        .volumes()
        .create_volume(serde_json::from_value(req).unwrap())
        .await
    {
        Ok(Created::New(v)) => v,
        other => panic!("create: {other:?}"),
    };
    // Only the backend chosen made a device.
    for f in &fakes {
        assert_eq!(
            f.calls().len(),
            usize::from(f.kind() == v.backend),
            "{:?}: {:?}",
            f.kind(),
            f.calls()
        );
    }
    (
        v.backend,
        v.dispatch.as_str().to_string(),
        v.dispatch_reason,
    )
}

#[tokio::test]
async fn auto_takes_dm_direct_where_dm_maps_the_image_and_ublk_otherwise() {
    use Backend::{Dm, Loop, Ublk};
    let all = [Ublk, Dm, Loop];
    let maps = &(DispatchPolicy::Direct, Reason::AutoDirect { on: On::Dm });
    let hole = &(
        DispatchPolicy::Nowait,
        Reason::AutoFellBack {
            to: DispatchPolicy::Nowait,
            rule: "direct-map rule 2: a hole".into(),
        },
    );
    // A full image that dm maps: dm direct, and the reason says so.
    let (b, d, why) = auto_picks(&all, maps, json!({})).await;
    assert_eq!((b, d.as_str()), (Dm, "direct"), "{why}");
    assert!(why.starts_with("auto: backend dm, direct: "), "{why}");
    // dm would not map it: ublk's own choice, with dm's rule.
    let (b, d, why) = auto_picks(&all, hole, json!({})).await;
    assert_eq!((b, d.as_str()), (Ublk, "nowait"), "{why}");
    assert_eq!(
        why,
        "auto chose nowait: ublk's rule; backend auto chose ublk: dm would not map it direct (direct-map rule 2: a hole)"
    );
    // A named policy, QoS, or a named backend keeps what it always got.
    for extra in [
        json!({"dispatch": "nowait"}),
        json!({"dispatch": "direct"}),
        json!({"dispatch": "threaded"}),
        json!({"qos": {"iops": 100}}),
        json!({"backend": "ublk"}),
    ] {
        let (b, _, why) = auto_picks(&all, maps, extra.clone()).await;
        assert_eq!(b, Ublk, "{extra}: {why}");
        assert!(!why.contains("backend"), "{extra}: {why}");
    }
    let (b, _, _) = auto_picks(&all, hole, json!({"backend": "dm"})).await;
    assert_eq!(b, Dm);
    // No dm: ublk as before; no ublk and no dm: loop.
    let (b, d, why) = auto_picks(&[Ublk, Loop], maps, json!({})).await;
    assert_eq!(
        (b, d.as_str(), why.as_str()),
        (Ublk, "nowait", "auto chose nowait: ublk's rule")
    );
    let (b, _, _) = auto_picks(&[Loop], maps, json!({})).await;
    assert_eq!(b, Loop);
    // dm and no ublk: dm decides alone, as before.
    let (b, d, why) = auto_picks(&[Dm, Loop], maps, json!({})).await;
    assert_eq!((b, d.as_str()), (Dm, "direct"), "{why}");
    assert_eq!(why, maps.1.to_string());
}
