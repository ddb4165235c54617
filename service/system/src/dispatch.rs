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

use std::os::fd::BorrowedFd;

use crate::extent::{self, ExtentMap, MapError};
use blockplane_api::model::{ActiveDispatch, DispatchPolicy};

/// The policy decided for a volume, why, and (for `direct`) the map the
/// decision was made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Never `Auto`.
    pub dispatch: DispatchPolicy,
    /// Why, in the words the volume reports as its dispatch reason.
    pub reason: String,
    /// The image's extent map, read for this decision (`direct` only).
    pub map: Option<ExtentMap>,
}

impl Decision {
    /// A decision that needs no map (every policy but `direct`).
    pub fn new(dispatch: DispatchPolicy, reason: impl Into<String>) -> Self {
        Self {
            dispatch,
            reason: reason.into(),
            map: None,
        }
    }
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

/// Why no policy could be decided.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// `direct` was asked and the image breaks a direct-map rule.
    #[error("{0}")]
    Refused(String),
    /// The policy needs a private ublk device and ublk is not available.
    #[error("{0}")]
    NeedsUblk(String),
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

/// How dm's `kernel` path serves, in its reasons.
pub const KERNEL_HOW: &str =
    "a linear table over a private loop device with direct I/O: no worker on the data path";

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

/// Why `direct`, when asked, in the words of `path`.
fn asked_direct(path: &Path) -> &'static str {
    match path {
        Path::Ublk { .. } => "the image passes every direct-map rule",
        Path::Dm { .. } => "linear table over the image's extents",
    }
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

/// Decides the policy for `asked` on an image of `size` bytes. The map is
/// read once, only for `direct` and `auto`.
pub fn decide(
    image: BorrowedFd<'_>,
    size: u64,
    asked: DispatchPolicy,
    refuse_writes: bool,
    path: &Path,
) -> Result<Decision, DispatchError> {
    // How each path serves: (auto direct, the other policies).
    let (auto_direct, other_how) = match path {
        Path::Ublk { .. } => ("", ""),
        Path::Dm { .. } => (
            " (linear table over its extents)",
            " (linear table over a private ublk device)",
        ),
    };
    let direct = |reason: String, map| Decision {
        dispatch: DispatchPolicy::Direct,
        reason,
        map: Some(map),
    };
    Ok(match asked {
        DispatchPolicy::Direct => {
            let map =
                direct_map(image, size, refuse_writes, path).map_err(DispatchError::Refused)?;
            direct(format!("asked: direct ({})", asked_direct(path)), map)
        }
        DispatchPolicy::Auto => match direct_map(image, size, refuse_writes, path) {
            Ok(map) => direct(
                format!("auto: the image passes every direct-map rule{auto_direct}"),
                map,
            ),
            Err(e) => {
                if let (Path::Dm { .. }, None) = (path, kernel_missing(image, path)) {
                    return Ok(Decision::new(
                        DispatchPolicy::Kernel,
                        format!("auto chose kernel: {e} ({KERNEL_HOW})"),
                    ));
                }
                can_serve_off_direct(&format!("auto fell back to nowait ({e}), which"), path)?;
                Decision::new(DispatchPolicy::Nowait, format!("auto chose nowait: {e}"))
            }
        },
        DispatchPolicy::Kernel => match kernel_missing(image, path) {
            Some(why) => return Err(DispatchError::Refused(why)),
            None => Decision::new(
                DispatchPolicy::Kernel,
                format!("asked: kernel ({KERNEL_HOW})"),
            ),
        },
        other => {
            can_serve_off_direct(&format!("dispatch '{}'", other.as_str()), path)?;
            let detail = match (other, path) {
                (DispatchPolicy::Threaded, Path::Ublk { threads }) => {
                    format!(" (io-wq, at most {threads} blocking workers per queue)")
                }
                _ => other_how.to_string(),
            };
            Decision::new(other, format!("asked: {}{detail}", other.as_str()))
        }
    })
}

/// Decides a live change of a volume's policy to `asked`. Two shortcuts read
/// no map: `auto` asked of a volume on `direct` keeps it there with the
/// reason in force (rule 5's checks watch it meanwhile), and `direct` is
/// checked by whoever pins the image (the worker, the dm switch), under the
/// pin, where the map cannot move (on a volume already direct, nothing moves).
#[allow(clippy::too_many_arguments)]
pub fn decide_change(
    image: BorrowedFd<'_>,
    size: u64,
    asked: DispatchPolicy,
    refuse_writes: bool,
    path: &Path,
    on_direct: bool,
    reason_in_force: &str,
) -> Result<Decision, DispatchError> {
    match asked {
        DispatchPolicy::Auto if on_direct => {
            Ok(Decision::new(DispatchPolicy::Direct, reason_in_force))
        }
        DispatchPolicy::Direct => Ok(Decision::new(
            DispatchPolicy::Direct,
            format!("asked: direct ({})", asked_direct(path)),
        )),
        _ => decide(image, size, asked, refuse_writes, path),
    }
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
    let reason = match (dm.dispatch, why_not_direct(&dm)) {
        (DispatchPolicy::Direct, _) => "auto: backend dm, direct: the image passes every direct-map rule (linear table over its extents, the fastest path)".to_string(),
        (DispatchPolicy::Kernel, Some(why)) => format!(
            "auto: backend dm, kernel: {why} ({KERNEL_HOW}; the fastest path for an image no backend maps direct)"
        ),
        (DispatchPolicy::Kernel, None) => {
            format!("{}; backend auto chose dm, the one backend with it", dm.reason)
        }
        (_, why) => return Err(why.unwrap_or(&dm.reason).to_string()),
    };
    Ok(Decision { reason, ..dm })
}

/// The rule that kept an `auto` decision off `direct` (`None`: it is
/// `direct`, or a policy asked by name).
pub fn why_not_direct(d: &Decision) -> Option<&str> {
    match d.reason.strip_prefix("auto chose kernel: ") {
        Some(r) => r
            .strip_suffix(')')
            .and_then(|r| r.strip_suffix(KERNEL_HOW))
            .and_then(|r| r.strip_suffix(" ("))
            .or(Some(r)),
        None => d.reason.strip_prefix("auto chose nowait: "),
    }
}

/// The decision of the backend `backend: auto` took when dm did not map the
/// image `direct` (`why_not_dm`), with that reason added; once, when the
/// backend's own reason already gives the same rule (a hole keeps both off
/// `direct`).
pub fn auto_off_dm(d: Decision, backend: &str, why_not_dm: &str) -> Decision {
    let why = if d.reason.contains(why_not_dm) {
        "either, by the same rule".to_string()
    } else {
        format!("({why_not_dm})")
    };
    Decision {
        reason: format!(
            "{}; backend auto chose {backend}: dm would not map it direct {why}",
            d.reason
        ),
        ..d
    }
}

/// The reason of a dm volume under `auto` that runs `nowait` for its QoS
/// limit (and goes back to `direct` or `kernel` when the last limit is
/// removed).
pub const QOS_NOWAIT: &str = "auto chose nowait: a QoS limit is set, which only a worker enforces (dm direct and kernel have none); back to the kernel's path when the last limit is removed";

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
    Ok(Some(Decision::new(DispatchPolicy::Nowait, QOS_NOWAIT)))
}

/// Why a volume left `direct` for a snapshot or clone named `copy` of its
/// image (the reason it then runs `nowait` with).
pub fn left_direct_for_copy(copy: &str) -> String {
    format!(
        "left direct for nowait: image '{copy}' was made from this volume's image and shares its extents, which a direct map must own alone (direct-map rule: no SHARED extents)"
    )
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

    /// A regular file on the test host's /tmp (tmpfs or not ext4/xfs): the
    /// map cannot be built, which exercises every fallback.
    fn image() -> std::fs::File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 20).unwrap();
        f
    }

    #[test]
    fn auto_falls_back_to_nowait_with_the_rule_and_direct_is_refused() {
        use std::os::fd::AsFd;
        let f = image();
        let fd = f.as_fd();
        let ublk = Path::Ublk { threads: 4 };
        let d = decide(fd, 1 << 20, DispatchPolicy::Auto, false, &ublk).unwrap();
        assert_eq!(d.dispatch, DispatchPolicy::Nowait);
        assert!(d.reason.starts_with("auto chose nowait: "), "{}", d.reason);
        assert!(d.map.is_none());
        assert!(matches!(
            decide(fd, 1 << 20, DispatchPolicy::Direct, false, &ublk),
            Err(DispatchError::Refused(_))
        ));
        let t = decide(fd, 1 << 20, DispatchPolicy::Threaded, false, &ublk).unwrap();
        assert_eq!(
            t.reason,
            "asked: threaded (io-wq, at most 4 blocking workers per queue)"
        );
        // dm: off direct, kernel when the loop driver serves, else ublk.
        let dm = Path::Dm {
            ublk_missing: Some("no ublk_drv".into()),
            loop_missing: None,
        };
        let k = decide(fd, 1 << 20, DispatchPolicy::Auto, false, &dm).unwrap();
        if direct_io_capable(fd) {
            assert_eq!(k.dispatch, DispatchPolicy::Kernel, "{}", k.reason);
            assert!(k.reason.starts_with("auto chose kernel: "), "{}", k.reason);
        } else {
            assert!(matches!(
                decide(fd, 1 << 20, DispatchPolicy::Kernel, false, &dm),
                Err(DispatchError::Refused(m)) if m.contains("O_DIRECT")
            ));
        }
        assert!(matches!(
            decide(fd, 1 << 20, DispatchPolicy::Kernel, false, &ublk),
            Err(DispatchError::Refused(m)) if m == KERNEL_ON_UBLK
        ));
        let dm = Path::Dm {
            ublk_missing: Some("no ublk_drv".into()),
            loop_missing: Some("no /dev/loop-control".into()),
        };
        assert!(matches!(
            decide(fd, 1 << 20, DispatchPolicy::Auto, false, &dm),
            Err(DispatchError::NeedsUblk(m)) if m.contains("no ublk_drv")
        ));
        let dm = Path::Dm {
            ublk_missing: None,
            loop_missing: None,
        };
        let n = decide(fd, 1 << 20, DispatchPolicy::Nowait, false, &dm).unwrap();
        assert_eq!(
            n.reason,
            "asked: nowait (linear table over a private ublk device)"
        );
    }

    #[test]
    fn a_change_keeps_direct_or_leaves_it_to_the_pin() {
        use std::os::fd::AsFd;
        let f = image();
        let ublk = Path::Ublk { threads: 4 };
        let change = |asked, on_direct| {
            decide_change(
                f.as_fd(),
                1 << 20,
                asked,
                false,
                &ublk,
                on_direct,
                "in force",
            )
        };
        // auto on direct: kept, with the reason in force, though this image
        // would fail the rules now.
        let d = change(DispatchPolicy::Auto, true).unwrap();
        assert_eq!(
            (d.dispatch, d.reason.as_str()),
            (DispatchPolicy::Direct, "in force")
        );
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
                d.reason,
                "asked: direct (the image passes every direct-map rule)"
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
        let d = auto_on_dm(Decision::new(DispatchPolicy::Direct, "x")).unwrap();
        assert_eq!(d.dispatch, DispatchPolicy::Direct);
        assert!(
            d.reason.starts_with("auto: backend dm, direct"),
            "{}",
            d.reason
        );
        // kernel: dm too, under auto or by name (no other backend has it).
        assert!(auto_tries_dm(DispatchPolicy::Kernel, false));
        let raw = Decision::new(
            DispatchPolicy::Kernel,
            format!("auto chose kernel: direct-map rule 2: a hole (how) ({KERNEL_HOW})"),
        );
        assert_eq!(
            why_not_direct(&raw),
            Some("direct-map rule 2: a hole (how)")
        );
        let k = auto_on_dm(raw).unwrap();
        assert_eq!(
            k.reason,
            format!(
                "auto: backend dm, kernel: direct-map rule 2: a hole (how) ({KERNEL_HOW}; the fastest path for an image no backend maps direct)"
            )
        );
        let why = auto_on_dm(Decision::new(
            DispatchPolicy::Nowait,
            "auto chose nowait: direct-map rule 2: a hole",
        ))
        .unwrap_err();
        assert_eq!(why, "direct-map rule 2: a hole");
        let u = auto_off_dm(
            Decision::new(DispatchPolicy::Nowait, "ublk's"),
            "ublk",
            &why,
        );
        assert_eq!(
            u.reason,
            "ublk's; backend auto chose ublk: dm would not map it direct (direct-map rule 2: a hole)"
        );
        let same = auto_off_dm(
            Decision::new(
                DispatchPolicy::Nowait,
                "auto chose nowait: direct-map rule 2: a hole",
            ),
            "ublk",
            &why,
        );
        assert_eq!(
            same.reason,
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
            (d.dispatch, d.reason.as_str()),
            (DispatchPolicy::Nowait, QOS_NOWAIT)
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
