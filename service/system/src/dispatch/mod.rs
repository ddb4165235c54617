//! The dispatch decision: which data path a volume takes, and why.
//!
//! One place for the choice (`auto` is `direct` when the image passes every
//! direct-map rule; else `kernel` on dm, a private loop device under its
//! table, and `nowait` on ublk), its reason, the "auto keeps direct"
//! shortcut of a live change, and the rule-3 check (an image the owner made
//! immutable is refused). The backends (ublk, dm) and the ublk worker all
//! import it, so it sits below both, next to [`crate::extent`], which it
//! builds on.
//!
//! A decision for `direct` carries the extent map it was made from. That map
//! travels with the attach to whoever pins the image (the dm backend, or the
//! ublk worker through its run dir) and is not built again before the pin:
//! [`crate::extent::map_and_pin`] pins, re-reads the map under the pin and
//! refuses when it differs from the decision's. Nothing can move the image's
//! blocks once it is pinned, so the map compared there is the one served.

mod reason;

use std::os::fd::BorrowedFd;

use crate::extent::{self, ExtentMap, MapError};
use blockplane_api::model::{ActiveDispatch, Backend, DispatchPolicy};
use serde::{Deserialize, Serialize};

pub use reason::{KERNEL_HOW, On, Reason};

/// The data path a worker serves a volume on: what a decision tells a
/// ublk worker (the protocol carries this type, not the API's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataPath {
    /// io_uring with `RWF_NOWAIT`, falling back to a blocking path on `EAGAIN`.
    Nowait,
    /// A pool of threads doing blocking syscalls.
    Threaded,
    /// The image's extent map, straight to its disk.
    Direct,
}

impl DataPath {
    /// The path a worker serves `policy` on. A decision gives a worker only
    /// `nowait`, `threaded` or `direct`; `auto` and `kernel` (no worker has
    /// that path) are served `nowait`, as workers always did.
    pub fn serving(policy: DispatchPolicy) -> Self {
        match policy {
            DispatchPolicy::Threaded => DataPath::Threaded,
            DispatchPolicy::Direct => DataPath::Direct,
            DispatchPolicy::Nowait | DispatchPolicy::Auto | DispatchPolicy::Kernel => {
                DataPath::Nowait
            }
        }
    }

    /// Its word on the wire, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DataPath::Nowait => "nowait",
            DataPath::Threaded => "threaded",
            DataPath::Direct => "direct",
        }
    }
}

/// The policy decided for a volume, why, and (for `direct`) the map the
/// decision was made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Never `Auto`.
    pub dispatch: DispatchPolicy,
    /// Why (in words, the volume's `dispatch_reason`).
    pub reason: Reason,
    /// The image's extent map, read for this decision (`direct` only).
    pub map: Option<ExtentMap>,
}

impl Decision {
    /// The path a ublk worker serves this decision on.
    pub fn data_path(&self) -> DataPath {
        DataPath::serving(self.dispatch)
    }

    /// A decision that needs no map (every policy but `direct`).
    pub fn new(dispatch: DispatchPolicy, reason: Reason) -> Self {
        Self {
            dispatch,
            reason,
            map: None,
        }
    }
}

/// What a decision is asked about: an image of `size` bytes, the policy
/// asked, whether the volume refuses writes, and what serves it.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The image.
    pub image: BorrowedFd<'a>,
    /// Its size in bytes.
    pub size: u64,
    /// The policy asked.
    pub policy: DispatchPolicy,
    /// The volume refuses writes (rule 3 does not apply).
    pub refuse_writes: bool,
    /// What serves it.
    pub path: &'a Path,
}

/// A volume a live change is asked of, as it runs now.
#[derive(Debug, Clone, Copy)]
pub struct Running<'a> {
    /// It is on `direct`.
    pub direct: bool,
    /// Why it runs what it runs.
    pub reason: &'a Reason,
    /// It has a QoS limit.
    pub qos: bool,
}

/// What serves the volume off the direct path, which words its reasons use,
/// and which extra rules its direct path has.
#[derive(Debug, Clone)]
pub enum Path {
    /// A ublk worker: `direct` splits requests over the raw devices itself.
    Ublk {
        /// Threads of the `threaded` policy.
        threads: u16,
    },
    /// A dm device: `direct` is a linear table (rule 7 applies); `kernel` a
    /// linear table over a private loop device; the other policies need a
    /// private ublk device.
    Dm {
        /// Why ublk cannot serve here (`None`: it can).
        ublk_missing: Option<String>,
        /// Why the kernel loop driver cannot serve here (`None`: it can).
        loop_missing: Option<String>,
    },
}

impl Path {
    /// What serves, as reasons name it.
    pub fn on(&self) -> On {
        match self {
            Path::Ublk { threads } => On::Ublk { threads: *threads },
            Path::Dm { .. } => On::Dm,
        }
    }
}

/// Why no policy could be decided.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// `direct` was asked and the image breaks a direct-map rule.
    #[error("{0}")]
    Refused(String),
    /// The policy needs a private ublk device and ublk is not available.
    #[error("{0}")]
    NeedsUblk(String),
    /// dm's `direct` or `kernel` was asked of a volume with a QoS limit,
    /// which only a worker enforces.
    #[error("{0}")]
    LimitNeedsWorker(String),
}

/// Rule 3: a writable volume's image must not carry `FS_IMMUTABLE_FL` set by
/// its owner (the pin must be blockplane's own, so unpinning is safe).
pub fn rule_3(image: BorrowedFd<'_>, refuse_writes: bool) -> Result<(), MapError> {
    if !refuse_writes && extent::is_immutable(image).unwrap_or(false) {
        return Err(MapError::ImmutableByUser);
    }
    Ok(())
}

/// Rule 7 (dm only): device-mapper claims the disks it maps, which the kernel
/// refuses (EBUSY) while a filesystem is mounted directly on one. That is the
/// case when the image's filesystem sits on the raw device itself.
pub fn rule_7(map: &ExtentMap) -> Result<(), String> {
    match map.devices.iter().find(|d| d.dev == map.fs_device) {
        Some(d) => Err(format!(
            "direct-map rule 7: device-mapper cannot open {} while the image's filesystem is mounted directly on it (EBUSY); {RULE_7_WAY_OUT}",
            d.node.display()
        )),
        None => Ok(()),
    }
}

/// What an operator can do about rule 7.
pub const RULE_7_WAY_OUT: &str = "dm needs that filesystem on a dm device (LVM or a linear wrapper). backend \"ublk\" with dispatch \"direct\" has no such limit";

/// The map of an image that passes every direct-map rule of `path`.
fn direct_map(
    image: BorrowedFd<'_>,
    size: u64,
    refuse_writes: bool,
    path: &Path,
) -> Result<ExtentMap, String> {
    rule_3(image, refuse_writes).map_err(|e| e.to_string())?;
    let map = ExtentMap::build(image, size).map_err(|e| e.to_string())?;
    if let Path::Dm { .. } = path {
        rule_7(&map)?;
    }
    Ok(map)
}

/// Why a ublk volume has no `kernel` path.
pub const KERNEL_ON_UBLK: &str = "dispatch 'kernel' is dm's (a private loop device under its table); a ublk volume's worker serves every request: ask backend 'dm'";

/// Why `kernel` cannot serve `image` on `path`, if it cannot: ublk has no
/// such path; dm needs the loop driver, and direct I/O on the image's
/// filesystem (buffered, every write would land in the page cache twice).
pub fn kernel_missing(image: BorrowedFd<'_>, path: &Path) -> Option<String> {
    match path {
        Path::Ublk { .. } => Some(KERNEL_ON_UBLK.into()),
        Path::Dm {
            loop_missing: Some(why),
            ..
        } => Some(format!(
            "dispatch 'kernel' needs the kernel loop driver: {why}"
        )),
        Path::Dm { .. } if !direct_io_capable(image) => Some(
            "dispatch 'kernel' needs direct I/O on the image, and its filesystem refuses O_DIRECT"
                .into(),
        ),
        Path::Dm { .. } => None,
    }
}

/// Whether the image's filesystem serves direct I/O: the same inode opened
/// again with `O_DIRECT` (a filesystem without it refuses the open).
pub fn direct_io_capable(image: BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", image.as_raw_fd()))
        .is_ok()
}

/// Refuses a path off `direct` that `path` cannot serve here (dm without
/// ublk for its private device); `what` names what asked for it.
pub fn can_serve_off_direct(what: &str, path: &Path) -> Result<(), DispatchError> {
    match path {
        Path::Dm {
            ublk_missing: Some(why),
            ..
        } => Err(DispatchError::NeedsUblk(format!(
            "{what} needs a private ublk device, and ublk is not available: {why}; only dispatch 'direct' works here"
        ))),
        _ => Ok(()),
    }
}

/// Decides the policy for `ask`. The map is read once, only for `direct`
/// and `auto`.
pub fn decide(ask: &Ask<'_>) -> Result<Decision, DispatchError> {
    let Ask {
        image,
        size,
        policy,
        refuse_writes,
        path,
    } = *ask;
    let on = path.on();
    let direct = |reason, map| Decision {
        dispatch: DispatchPolicy::Direct,
        reason,
        map: Some(map),
    };
    let asked = |policy| Decision::new(policy, Reason::Asked { policy, on });
    Ok(match policy {
        DispatchPolicy::Direct => {
            let map =
                direct_map(image, size, refuse_writes, path).map_err(DispatchError::Refused)?;
            direct(Reason::Asked { policy, on }, map)
        }
        DispatchPolicy::Auto => match direct_map(image, size, refuse_writes, path) {
            Ok(map) => direct(Reason::AutoDirect { on }, map),
            Err(rule) => {
                if let (Path::Dm { .. }, None) = (path, kernel_missing(image, path)) {
                    let to = DispatchPolicy::Kernel;
                    return Ok(Decision::new(to, Reason::AutoFellBack { to, rule }));
                }
                can_serve_off_direct(&format!("auto fell back to nowait ({rule}), which"), path)?;
                let to = DispatchPolicy::Nowait;
                Decision::new(to, Reason::AutoFellBack { to, rule })
            }
        },
        DispatchPolicy::Kernel => match kernel_missing(image, path) {
            Some(why) => return Err(DispatchError::Refused(why)),
            None => asked(policy),
        },
        other => {
            can_serve_off_direct(&format!("dispatch '{}'", other.as_str()), path)?;
            asked(other)
        }
    })
}

/// Decides a live change of a volume running as `now` to `ask`. Two
/// shortcuts read no map: `auto` asked of a volume on `direct` keeps it
/// there with the reason in force (rule 5's checks watch it meanwhile), and
/// `direct` is checked by whoever pins the image (the worker, the dm
/// switch), under the pin, where the map cannot move (on a volume already
/// direct, nothing moves). On dm a QoS limit keeps `auto` on its worker,
/// which enforces it, and refuses `direct` and `kernel` ([`with_limit`]).
pub fn decide_change(ask: &Ask<'_>, now: &Running<'_>) -> Result<Decision, DispatchError> {
    if now.qos {
        with_limit(ask.policy, ask.path)?;
    }
    let d = match ask.policy {
        DispatchPolicy::Auto if now.direct => {
            Decision::new(DispatchPolicy::Direct, now.reason.clone())
        }
        DispatchPolicy::Direct => Decision::new(
            DispatchPolicy::Direct,
            Reason::Asked {
                policy: DispatchPolicy::Direct,
                on: ask.path.on(),
            },
        ),
        _ => decide(ask)?,
    };
    let keeps_worker = ask.policy == DispatchPolicy::Auto
        && now.qos
        && matches!(ask.path, Path::Dm { .. })
        && matches!(d.dispatch, DispatchPolicy::Direct | DispatchPolicy::Kernel);
    Ok(match keeps_worker {
        true => Decision::new(DispatchPolicy::Nowait, Reason::QosNowait),
        false => d,
    })
}

/// Refuses `asked` of a volume with a QoS limit where no worker would
/// enforce it: dm's `direct` (a linear table) and `kernel` (the loop
/// driver).
pub fn with_limit(asked: DispatchPolicy, path: &Path) -> Result<(), DispatchError> {
    let how = match (path, asked) {
        (Path::Dm { .. }, DispatchPolicy::Kernel) => "kernel (the loop driver)",
        (Path::Dm { .. }, DispatchPolicy::Direct) => "direct (a linear table)",
        _ => return Ok(()),
    };
    Err(DispatchError::LimitNeedsWorker(format!(
        "the volume has a QoS limit, which only a worker enforces, and dm {how} has none; remove the limit first (\"qos\": null)"
    )))
}

/// The path a dm volume on its worker for a copy goes back on after it:
/// `kernel`, for `reason`, unless a limit set meanwhile keeps it on the
/// worker, which enforces it.
pub fn after_copy(reason: Reason, qos: bool) -> Decision {
    match qos {
        true => Decision::new(DispatchPolicy::Nowait, Reason::QosNowait),
        false => Decision::new(DispatchPolicy::Kernel, reason),
    }
}

/// Decides where a dm volume goes when its last QoS limit is removed
/// (`had_limit`: it had one until now; `running`: why it runs its path):
/// `None` where nothing moved it for a limit (a named policy, or `auto` that
/// never left the kernel's path for one) and it stays; else, under `auto`,
/// back to the kernel's path (`direct` or `kernel`), saying the limit's
/// removal took it there, or on its worker, saying why.
pub fn after_last_limit(
    had_limit: bool,
    running: &Reason,
    ask: &Ask<'_>,
) -> Result<Option<Decision>, DispatchError> {
    let moved_for_limit = had_limit || *running == Reason::QosNowait;
    if !moved_for_limit || ask.policy != DispatchPolicy::Auto {
        return Ok(None);
    }
    let back = decide(ask)?;
    Ok(Some(match back.dispatch {
        DispatchPolicy::Direct | DispatchPolicy::Kernel => Decision {
            reason: Reason::LastLimitRemoved {
                back: Box::new(back.reason),
            },
            ..back
        },
        _ => back,
    }))
}

/// Whether `backend: auto` tries dm first: for `dispatch: auto` with no
/// QoS, where dm `direct` (a linear table, no userspace on the data path) is
/// the fastest path blockplane has, and `kernel` the fastest for an image it
/// cannot map; and for `kernel` by name, which only dm has. A named policy keeps the backend it
/// always had (ublk first): `direct` because ublk's has no rule 7, the
/// others because ublk serves them without dm's extra layer.
pub fn auto_tries_dm(asked: DispatchPolicy, qos: bool) -> bool {
    asked == DispatchPolicy::Kernel || (asked == DispatchPolicy::Auto && !qos)
}

/// What `backend: auto` makes of dm's decision: dm when it maps the image
/// `direct`, or serves it on `kernel` (no worker either: faster than ublk's
/// worker on an image that cannot be mapped, by the bench), with the reason
/// saying the backend was chosen too; else why not (the rule that kept dm
/// off both).
pub fn auto_on_dm(dm: Decision) -> Result<Decision, String> {
    let reason = match (dm.dispatch, dm.reason.rule_off_direct()) {
        (DispatchPolicy::Direct, _) => Reason::BackendDmDirect,
        (DispatchPolicy::Kernel, Some(rule)) => Reason::BackendDmKernel {
            rule: rule.to_string(),
        },
        (DispatchPolicy::Kernel, None) => Reason::BackendDmOnly {
            asked: Box::new(dm.reason.clone()),
        },
        (_, Some(rule)) => return Err(rule.to_string()),
        (_, None) => return Err(dm.reason.to_string()),
    };
    Ok(Decision { reason, ..dm })
}

/// The decision of `backend`, which `backend: auto` took when dm did not
/// map the image `direct` (`why_not_dm`), with that reason added.
pub fn auto_off_dm(d: Decision, backend: Backend, why_not_dm: &str) -> Decision {
    Decision {
        reason: Reason::BackendOffDm {
            chosen: Box::new(d.reason.clone()),
            backend,
            why_not_dm: why_not_dm.to_string(),
        },
        ..d
    }
}

/// Why a dm volume whose user asked `direct` by name takes no QoS limit.
pub const QOS_PINNED_DIRECT: &str = "QoS needs a worker to enforce it, and dm dispatch 'direct', asked by name, has none (a linear table sends each request straight to the disk); ask dispatch 'auto' (nowait while a limit is set) or 'nowait'";

/// Why a dm volume whose user asked `kernel` by name takes no QoS limit.
pub const QOS_PINNED_KERNEL: &str = "QoS needs a worker to enforce it, and dm dispatch 'kernel', asked by name, has none (the loop driver serves each request); ask dispatch 'auto' (nowait while a limit is set) or 'nowait'";

/// Where a dm volume's QoS limit is enforced, for a volume whose user asked
/// `asked` and that runs without a worker (`direct` or `kernel`:
/// `no_worker`) or not: `Ok(None)` by the worker it has; `Ok(Some(nowait))`
/// by a private worker it moves to (under `auto`); refused on a `direct` or
/// `kernel` asked by name, or where no private worker can be made.
pub fn qos_on_dm(
    asked: DispatchPolicy,
    no_worker: bool,
    path: &Path,
) -> Result<Option<Decision>, DispatchError> {
    if !no_worker {
        return Ok(None);
    }
    match asked {
        DispatchPolicy::Direct => return Err(DispatchError::Refused(QOS_PINNED_DIRECT.into())),
        DispatchPolicy::Kernel => return Err(DispatchError::Refused(QOS_PINNED_KERNEL.into())),
        _ => {}
    }
    can_serve_off_direct("QoS on dm (enforced by a private ublk worker)", path)?;
    Ok(Some(Decision::new(
        DispatchPolicy::Nowait,
        Reason::QosNowait,
    )))
}

/// The path a named policy runs (`None` for `auto`, which decides it).
pub fn active_of(asked: DispatchPolicy) -> Option<ActiveDispatch> {
    match asked {
        DispatchPolicy::Auto => None,
        DispatchPolicy::Nowait => Some(ActiveDispatch::Nowait),
        DispatchPolicy::Threaded => Some(ActiveDispatch::Threaded),
        DispatchPolicy::Direct => Some(ActiveDispatch::Direct),
        DispatchPolicy::Kernel => Some(ActiveDispatch::Kernel),
    }
}

/// The policy a volume runs, as a policy to ask for (what a replacement
/// worker or an adopted device is recorded with).
pub fn policy_of(active: ActiveDispatch) -> DispatchPolicy {
    match active {
        ActiveDispatch::Direct => DispatchPolicy::Direct,
        ActiveDispatch::Threaded => DispatchPolicy::Threaded,
        ActiveDispatch::Kernel => DispatchPolicy::Kernel,
        ActiveDispatch::Nowait => DispatchPolicy::Nowait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// A regular file on the test host's /tmp (tmpfs or not ext4/xfs): the
    /// map cannot be built, which exercises every fallback.
    fn image() -> std::fs::File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 20).unwrap();
        f
    }

    /// The ask for `policy` of a writable 1 MiB `image` on `path`.
    fn ask<'a>(image: &'a std::fs::File, policy: DispatchPolicy, path: &'a Path) -> Ask<'a> {
        Ask {
            image: image.as_fd(),
            size: 1 << 20,
            policy,
            refuse_writes: false,
            path,
        }
    }

    #[test]
    fn auto_falls_back_to_nowait_with_the_rule_and_direct_is_refused() {
        let f = image();
        let ublk = Path::Ublk { threads: 4 };
        let d = decide(&ask(&f, DispatchPolicy::Auto, &ublk)).unwrap();
        assert_eq!(d.dispatch, DispatchPolicy::Nowait);
        assert!(
            matches!(&d.reason, Reason::AutoFellBack { to: DispatchPolicy::Nowait, rule } if rule.starts_with("direct-map rule ")),
            "{:?}",
            d.reason
        );
        assert!(d.map.is_none());
        assert!(matches!(
            decide(&ask(&f, DispatchPolicy::Direct, &ublk)),
            Err(DispatchError::Refused(_))
        ));
        let t = decide(&ask(&f, DispatchPolicy::Threaded, &ublk)).unwrap();
        assert_eq!(
            t.reason,
            Reason::Asked {
                policy: DispatchPolicy::Threaded,
                on: On::Ublk { threads: 4 }
            }
        );
        assert_eq!(
            t.reason.to_string(),
            "asked: threaded (io-wq, at most 4 blocking workers per queue)"
        );
        // dm: off direct, kernel when the loop driver serves, else ublk.
        let dm = Path::Dm {
            ublk_missing: Some("no ublk_drv".into()),
            loop_missing: None,
        };
        let k = decide(&ask(&f, DispatchPolicy::Auto, &dm)).unwrap();
        if direct_io_capable(f.as_fd()) {
            assert_eq!(k.dispatch, DispatchPolicy::Kernel, "{}", k.reason);
            assert!(
                matches!(
                    k.reason,
                    Reason::AutoFellBack {
                        to: DispatchPolicy::Kernel,
                        ..
                    }
                ),
                "{:?}",
                k.reason
            );
        } else {
            assert!(matches!(
                decide(&ask(&f, DispatchPolicy::Kernel, &dm)),
                Err(DispatchError::Refused(m)) if m.contains("O_DIRECT")
            ));
        }
        assert!(matches!(
            decide(&ask(&f, DispatchPolicy::Kernel, &ublk)),
            Err(DispatchError::Refused(m)) if m == KERNEL_ON_UBLK
        ));
        let dm = Path::Dm {
            ublk_missing: Some("no ublk_drv".into()),
            loop_missing: Some("no /dev/loop-control".into()),
        };
        assert!(matches!(
            decide(&ask(&f, DispatchPolicy::Auto, &dm)),
            Err(DispatchError::NeedsUblk(m)) if m.contains("no ublk_drv")
        ));
        let dm = Path::Dm {
            ublk_missing: None,
            loop_missing: None,
        };
        let n = decide(&ask(&f, DispatchPolicy::Nowait, &dm)).unwrap();
        assert_eq!(
            n.reason.to_string(),
            "asked: nowait (linear table over a private ublk device)"
        );
    }

    #[test]
    fn a_change_keeps_direct_or_leaves_it_to_the_pin() {
        let f = image();
        let ublk = Path::Ublk { threads: 4 };
        let in_force = Reason::AutoDirect { on: ublk.on() };
        let change = |policy, direct| {
            let now = Running {
                direct,
                reason: &in_force,
                qos: false,
            };
            decide_change(&ask(&f, policy, &ublk), &now)
        };
        // auto on direct: kept, with the reason in force, though this image
        // would fail the rules now.
        let d = change(DispatchPolicy::Auto, true).unwrap();
        assert_eq!((d.dispatch, &d.reason), (DispatchPolicy::Direct, &in_force));
        // auto off direct: decided (here: nowait, the rules fail).
        assert_eq!(
            change(DispatchPolicy::Auto, false).unwrap().dispatch,
            DispatchPolicy::Nowait
        );
        // direct: left to the pin, no map read here; its reason is the ask.
        for on_direct in [false, true] {
            let d = change(DispatchPolicy::Direct, on_direct).unwrap();
            assert_eq!((d.dispatch, d.map), (DispatchPolicy::Direct, None));
            assert_eq!(
                d.reason.to_string(),
                "asked: direct (the image passes every direct-map rule)"
            );
        }
    }

    /// On dm a QoS limit keeps `auto` on the worker that enforces it,
    /// where `auto` would otherwise go to `direct` or `kernel`.
    #[test]
    fn a_change_to_auto_keeps_a_dm_volume_with_a_limit_on_its_worker() {
        let f = image();
        let dm = Path::Dm {
            ublk_missing: None,
            loop_missing: None,
        };
        let in_force = Reason::QosNowait;
        for (direct, qos) in [(true, true), (false, true), (true, false)] {
            let now = Running {
                direct,
                reason: &in_force,
                qos,
            };
            let d = decide_change(&ask(&f, DispatchPolicy::Auto, &dm), &now).unwrap();
            if qos {
                assert_eq!(
                    (d.dispatch, d.reason),
                    (DispatchPolicy::Nowait, Reason::QosNowait)
                );
            } else {
                assert_eq!(d.dispatch, DispatchPolicy::Direct);
            }
        }
    }

    /// A limit refuses dm's paths without a worker, by name; ublk's worker
    /// enforces it on every path. After a copy a limit keeps the worker.
    #[test]
    fn a_limit_refuses_dms_paths_without_a_worker() {
        let f = image();
        let dm = Path::Dm {
            ublk_missing: None,
            loop_missing: None,
        };
        let ublk = Path::Ublk { threads: 4 };
        let now = Running {
            direct: false,
            reason: &Reason::QosNowait,
            qos: true,
        };
        for policy in [DispatchPolicy::Direct, DispatchPolicy::Kernel] {
            assert!(matches!(
                decide_change(&ask(&f, policy, &dm), &now),
                Err(DispatchError::LimitNeedsWorker(m)) if m.contains("remove the limit first")
            ));
            assert!(with_limit(policy, &ublk).is_ok());
        }
        assert!(with_limit(DispatchPolicy::Nowait, &dm).is_ok());
        let back = Reason::Asked {
            policy: DispatchPolicy::Kernel,
            on: On::Dm,
        };
        assert_eq!(
            after_copy(back.clone(), true),
            Decision::new(DispatchPolicy::Nowait, Reason::QosNowait)
        );
        assert_eq!(
            after_copy(back.clone(), false),
            Decision::new(DispatchPolicy::Kernel, back)
        );
    }

    /// Back from the last limit: the path `auto` decides, saying the
    /// limit's removal took it there; a named policy, or `auto` that never
    /// moved for a limit, stays.
    #[test]
    fn the_last_limit_removed_takes_auto_back_to_the_kernels_path() {
        let f = image();
        let dm = Path::Dm {
            ublk_missing: None,
            loop_missing: None,
        };
        let words = Reason::Words {
            words: String::new(),
        };
        let named = ask(&f, DispatchPolicy::Nowait, &dm);
        assert_eq!(after_last_limit(true, &words, &named).unwrap(), None);
        let auto = ask(&f, DispatchPolicy::Auto, &dm);
        assert_eq!(after_last_limit(false, &words, &auto).unwrap(), None);
        let d = after_last_limit(true, &words, &auto).unwrap().unwrap();
        if direct_io_capable(f.as_fd()) {
            assert_eq!(d.dispatch, DispatchPolicy::Kernel);
            let Reason::LastLimitRemoved { back } = &d.reason else {
                panic!("{:?}", d.reason)
            };
            assert!(matches!(**back, Reason::AutoFellBack { .. }), "{back:?}");
            assert!(
                d.reason.to_string().starts_with(
                    "auto: the last QoS limit was removed, and kernel serves it: direct-map rule "
                ),
                "{}",
                d.reason
            );
        }
    }

    #[test]
    fn backend_auto_takes_dm_only_for_direct_under_auto_without_qos() {
        assert!(auto_tries_dm(DispatchPolicy::Auto, false));
        assert!(!auto_tries_dm(DispatchPolicy::Auto, true));
        for named in [
            DispatchPolicy::Direct,
            DispatchPolicy::Nowait,
            DispatchPolicy::Threaded,
        ] {
            assert!(!auto_tries_dm(named, false), "{named:?}");
        }
        let d = auto_on_dm(Decision::new(
            DispatchPolicy::Direct,
            Reason::AutoDirect { on: On::Dm },
        ))
        .unwrap();
        assert_eq!(
            (d.dispatch, &d.reason),
            (DispatchPolicy::Direct, &Reason::BackendDmDirect)
        );
        // kernel: dm too, under auto or by name (no other backend has it).
        assert!(auto_tries_dm(DispatchPolicy::Kernel, false));
        let rule = "direct-map rule 2: a hole (how)".to_string();
        let raw = Decision::new(
            DispatchPolicy::Kernel,
            Reason::AutoFellBack {
                to: DispatchPolicy::Kernel,
                rule: rule.clone(),
            },
        );
        assert_eq!(raw.reason.rule_off_direct(), Some(rule.as_str()));
        let k = auto_on_dm(raw).unwrap();
        assert_eq!(k.reason, Reason::BackendDmKernel { rule: rule.clone() });
        assert_eq!(
            k.reason.to_string(),
            format!(
                "auto: backend dm, kernel: direct-map rule 2: a hole (how) ({KERNEL_HOW}; the fastest path for an image no backend maps direct)"
            )
        );
        let hole = "direct-map rule 2: a hole".to_string();
        let fell_back = Reason::AutoFellBack {
            to: DispatchPolicy::Nowait,
            rule: hole.clone(),
        };
        let why = auto_on_dm(Decision::new(DispatchPolicy::Nowait, fell_back.clone())).unwrap_err();
        assert_eq!(why, hole);
        let asked = Reason::Asked {
            policy: DispatchPolicy::Nowait,
            on: On::Ublk { threads: 4 },
        };
        let u = auto_off_dm(
            Decision::new(DispatchPolicy::Nowait, asked),
            Backend::Ublk,
            &why,
        );
        assert_eq!(
            u.reason.to_string(),
            "asked: nowait; backend auto chose ublk: dm would not map it direct (direct-map rule 2: a hole)"
        );
        let same = auto_off_dm(
            Decision::new(DispatchPolicy::Nowait, fell_back),
            Backend::Ublk,
            &why,
        );
        assert_eq!(
            same.reason.to_string(),
            "auto chose nowait: direct-map rule 2: a hole; backend auto chose ublk: dm would not map it direct either, by the same rule"
        );
    }

    #[test]
    fn qos_on_dm_moves_auto_off_direct_and_refuses_a_named_direct() {
        let dm = Path::Dm {
            ublk_missing: None,
            loop_missing: None,
        };
        // Off direct: the worker it has enforces it.
        for asked in [
            DispatchPolicy::Auto,
            DispatchPolicy::Nowait,
            DispatchPolicy::Threaded,
        ] {
            assert_eq!(qos_on_dm(asked, false, &dm).unwrap(), None, "{asked:?}");
        }
        // On direct under auto: to nowait, with the reason.
        let d = qos_on_dm(DispatchPolicy::Auto, true, &dm).unwrap().unwrap();
        assert_eq!(
            (d.dispatch, d.reason),
            (DispatchPolicy::Nowait, Reason::QosNowait)
        );
        // direct asked by name: refused, with the rule.
        assert!(matches!(
            qos_on_dm(DispatchPolicy::Direct, true, &dm),
            Err(DispatchError::Refused(m)) if m == QOS_PINNED_DIRECT
        ));
        // No ublk: no worker to move to.
        let no_ublk = Path::Dm {
            ublk_missing: Some("no /dev/ublk-control".into()),
            loop_missing: None,
        };
        assert!(matches!(
            qos_on_dm(DispatchPolicy::Auto, true, &no_ublk),
            Err(DispatchError::NeedsUblk(m)) if m.starts_with("QoS on dm") && m.contains("no /dev/ublk-control")
        ));
    }
}
