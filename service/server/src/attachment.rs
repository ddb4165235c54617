//! A volume's device as its backend made it: what the manager stores with
//! the volume (JSON in its SQLite row) and what a restarted service finds
//! the device again by. Below the backends, which make it, and the store,
//! which keeps it.
//!
//! What is particular to a backend is one [`DeviceState`]. The row keeps
//! the shape it always had (optional `direct_io`, `ublk` and `dm` parts), so
//! rows written before this type read back, and a row written now reads in
//! a service of the version before.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use blockplane_api::model::ActiveDispatch;
use blockplane_system::blockstat::BlockStat;
use blockplane_system::dispatch::Reason;
use blockplane_system::extent::Pin;

/// A live device, as the backend describes it; stored with the volume so a
/// restarted service can find and check it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Row", into = "Row")]
pub struct Attachment {
    /// Device node, e.g. `/dev/loop3`.
    pub device: String,
    /// The kernel's name for it (`/sys/block/<name>`), e.g. `loop3`.
    pub kernel_name: String,
    pub major: u32,
    pub minor: u32,
    pub dispatch: ActiveDispatch,
    /// Why that path (in words only in the API and events).
    pub dispatch_reason: Reason,
    pub size_bytes: u64,
    pub read_only: bool,
    /// When the counters in `baseline` were read (the attach).
    pub attached_at: OffsetDateTime,
    /// Kernel block statistics at attach: the device may have counted I/O of an
    /// earlier user.
    pub baseline: Option<BlockStat>,
    /// What only this backend's devices have.
    pub kind: DeviceState,
    /// The image grew but the device could not follow live (ublk without
    /// UPDATE_SIZE): the new size applies at the next attach.
    pub resize_pending: bool,
}

/// What only one backend's devices have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceState {
    /// A loop device.
    Loop {
        /// Whether the loop driver does direct I/O.
        direct_io: bool,
    },
    /// A ublk device and its worker.
    Ublk(UblkAttachment),
    /// A device-mapper device and its table.
    Dm(DmAttachment),
}

impl Attachment {
    /// The ublk device and worker, on a ublk volume.
    pub fn ublk(&self) -> Option<&UblkAttachment> {
        match &self.kind {
            DeviceState::Ublk(u) => Some(u),
            _ => None,
        }
    }

    /// The dm device and table, on a dm volume.
    pub fn dm(&self) -> Option<&DmAttachment> {
        match &self.kind {
            DeviceState::Dm(d) => Some(d),
            _ => None,
        }
    }

    /// Whether the loop driver does direct I/O, on a loop volume.
    pub fn direct_io(&self) -> Option<bool> {
        match self.kind {
            DeviceState::Loop { direct_io } => Some(direct_io),
            _ => None,
        }
    }
}

/// What the control plane keeps of a dm volume's device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DmAttachment {
    pub name: String,
    pub uuid: String,
    /// The live table: `(start, length, target, params)` in sectors.
    pub table: Vec<(u64, u64, String, String)>,
    /// The image's pin while direct-mapped.
    pub pinned: Option<Pin>,
    /// `major:minor` of the private ublk device on the nowait/threaded path.
    pub private_ublk: Option<String>,
    /// Why the volume left the direct path on its own (extent drift).
    pub degraded: Option<String>,
}

/// What the control plane keeps of a ublk volume's device and worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UblkAttachment {
    pub dev_id: u32,
    pub pid: u32,
    /// The image's pin while direct-mapped.
    pub pinned: Option<Pin>,
    /// Bytes of I/O buffers the worker holds.
    pub buffer_bytes: u64,
    /// Queues the device has (none recorded before they were).
    #[serde(default)]
    pub queues: Option<u16>,
    /// The worker uses requests' pages in place (UBLK_F_AUTO_BUF_REG).
    #[serde(default)]
    pub zero_copy: bool,
    /// Why the volume left the direct path on its own (extent drift).
    pub degraded: Option<String>,
}

/// An attachment as its row holds it: the backend's part as optional
/// fields, at most one set.
#[derive(Serialize, Deserialize)]
struct Row {
    device: String,
    kernel_name: String,
    major: u32,
    minor: u32,
    dispatch: ActiveDispatch,
    /// The reason in words: what a service before typed reasons reads.
    dispatch_reason: String,
    /// The reason (rows written before it have the words alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dispatch_why: Option<Reason>,
    direct_io: Option<bool>,
    size_bytes: u64,
    read_only: bool,
    #[serde(with = "time::serde::rfc3339")]
    attached_at: OffsetDateTime,
    baseline: Option<BlockStat>,
    #[serde(default)]
    ublk: Option<UblkAttachment>,
    #[serde(default)]
    dm: Option<DmAttachment>,
    #[serde(default)]
    resize_pending: bool,
}

impl From<Row> for Attachment {
    fn from(r: Row) -> Self {
        let kind = match (r.ublk, r.dm) {
            (Some(u), _) => DeviceState::Ublk(u),
            (None, Some(d)) => DeviceState::Dm(d),
            // Only loop devices were stored without a part of their own.
            (None, None) => DeviceState::Loop {
                direct_io: r.direct_io.unwrap_or(false),
            },
        };
        Self {
            device: r.device,
            kernel_name: r.kernel_name,
            major: r.major,
            minor: r.minor,
            dispatch: r.dispatch,
            dispatch_reason: Reason::carried(r.dispatch_why, &r.dispatch_reason),
            size_bytes: r.size_bytes,
            read_only: r.read_only,
            attached_at: r.attached_at,
            baseline: r.baseline,
            kind,
            resize_pending: r.resize_pending,
        }
    }
}

impl From<Attachment> for Row {
    fn from(a: Attachment) -> Self {
        let (direct_io, ublk, dm) = match a.kind {
            DeviceState::Loop { direct_io } => (Some(direct_io), None, None),
            DeviceState::Ublk(u) => (None, Some(u), None),
            DeviceState::Dm(d) => (None, None, Some(d)),
        };
        Self {
            device: a.device,
            kernel_name: a.kernel_name,
            major: a.major,
            minor: a.minor,
            dispatch: a.dispatch,
            dispatch_reason: a.dispatch_reason.to_string(),
            dispatch_why: Some(a.dispatch_reason),
            direct_io,
            size_bytes: a.size_bytes,
            read_only: a.read_only,
            attached_at: a.attached_at,
            baseline: a.baseline,
            ublk,
            dm,
            resize_pending: a.resize_pending,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Rows as the service stored them before `DeviceState` (one per
    /// backend, from a run of the previous version): loop, ublk, dm on a
    /// private ublk device.
    pub(crate) const OLD_ROWS: [&str; 3] = [
        r#"{"device":"/dev/loop3","kernel_name":"loop3","major":7,"minor":3,"dispatch":"kernel","dispatch_reason":"loop: the kernel's loop driver","direct_io":true,"size_bytes":1048576,"read_only":false,"attached_at":"2026-11-30T10:00:00Z","baseline":null,"ublk":null,"dm":null,"resize_pending":false}"#,
        r#"{"device":"/dev/ublkb0","kernel_name":"ublkb0","major":259,"minor":0,"dispatch":"direct","dispatch_reason":"auto: the image passes every direct-map rule","direct_io":null,"size_bytes":1048576,"read_only":false,"attached_at":"2026-11-30T10:00:00Z","baseline":null,"ublk":{"dev_id":0,"pid":4242,"pinned":{"was_immutable":false},"buffer_bytes":0,"queues":2,"zero_copy":true,"degraded":null},"dm":null,"resize_pending":true}"#,
        r#"{"device":"/dev/dm-4","kernel_name":"dm-4","major":253,"minor":4,"dispatch":"nowait","dispatch_reason":"asked: nowait","direct_io":null,"size_bytes":1048576,"read_only":true,"attached_at":"2026-11-30T10:00:00Z","baseline":null,"ublk":null,"dm":{"name":"blockplane-x","uuid":"blockplane-i-x","table":[[0,2048,"linear","259:1 0"]],"pinned":null,"private_ublk":"259:1","degraded":null},"resize_pending":false}"#,
    ];

    #[test]
    fn rows_stored_in_the_old_shape_load_and_are_stored_the_same() {
        let [lp, ub, dm] = OLD_ROWS.map(|r| serde_json::from_str::<Attachment>(r).unwrap());
        assert_eq!(lp.kind, DeviceState::Loop { direct_io: true });
        assert_eq!(lp.direct_io(), Some(true));
        let u = ub.ublk().expect("a ublk row is a ublk device");
        assert_eq!((u.pid, u.queues, u.zero_copy), (4242, Some(2), true));
        assert!(ub.resize_pending && ub.dm().is_none() && ub.direct_io().is_none());
        let d = dm.dm().expect("a dm row is a dm device");
        assert_eq!(d.private_ublk.as_deref(), Some("259:1"));
        assert!(dm.ublk().is_none());
        // Their reasons are words: none is one a rule reads back.
        for att in [&lp, &ub, &dm] {
            assert!(
                matches!(att.dispatch_reason, Reason::Words { .. }),
                "{:?}",
                att.dispatch_reason
            );
        }
        // Written back, each row is what it was with the reason's type
        // beside its words: a service of the previous version reads it too
        // (its row skips fields it does not know).
        for (row, att) in OLD_ROWS.iter().zip([lp, ub, dm]) {
            let old: serde_json::Value = serde_json::from_str(row).unwrap();
            let mut new = serde_json::to_value(&att).unwrap();
            let why = new.as_object_mut().unwrap().remove("dispatch_why");
            assert_eq!(new, old);
            assert_eq!(
                why,
                Some(serde_json::to_value(&att.dispatch_reason).unwrap())
            );
        }
    }

    /// A reason a rule reads (dm on its worker for a QoS limit) comes back
    /// as its type from a row that holds it, and from the words of a row
    /// written before reasons were typed.
    #[test]
    fn a_rows_reason_comes_back_as_its_type() {
        let mut att: Attachment = serde_json::from_str(OLD_ROWS[2]).unwrap();
        att.dispatch_reason = Reason::QosNowait;
        let row = serde_json::to_value(&att).unwrap();
        assert_eq!(
            row["dispatch_why"],
            serde_json::json!({"why": "qos_nowait"})
        );
        let back: Attachment = serde_json::from_value(row.clone()).unwrap();
        assert_eq!(back.dispatch_reason, Reason::QosNowait);
        let mut words_only = row;
        words_only.as_object_mut().unwrap().remove("dispatch_why");
        let back: Attachment = serde_json::from_value(words_only).unwrap();
        assert_eq!(back.dispatch_reason, Reason::QosNowait);
    }
}
