//! Why a volume runs the data path it runs: decided by [`super::decide`] or
//! by whoever moved it since (a QoS limit, a copy, drift), kept as a type
//! while the service reasons with it, and put in words ([`Reason`]'s
//! `Display`, the volume's `dispatch_reason`) only for the API and events.
//!
//! The words are those reasons had when they were strings, so answers and
//! events read as before. A reason stored or reported in words alone (a row
//! or a worker from before reasons were typed) is read once into a type by
//! [`Reason::from_words`], where a rule depends on it, and kept as words
//! ([`Reason::Words`]) otherwise.

use std::fmt;

use blockplane_api::model::{Backend, DispatchPolicy};
use serde::{Deserialize, Serialize};

/// How dm's `kernel` path serves, in its reasons.
pub const KERNEL_HOW: &str =
    "a linear table over a private loop device with direct I/O: no worker on the data path";

/// What serves a volume's requests off the direct path, as its reasons name
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum On {
    /// A ublk worker with `threads` threads for `threaded`.
    Ublk {
        /// Threads of the `threaded` policy.
        threads: u16,
    },
    /// A dm table.
    Dm,
}

/// Why a volume runs the path it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum Reason {
    /// The user asked this policy by name.
    Asked {
        /// The policy asked (never `auto`).
        policy: DispatchPolicy,
        /// What serves it.
        on: On,
    },
    /// `auto`: the image passes every direct-map rule.
    AutoDirect {
        /// What maps it.
        on: On,
    },
    /// `auto`: the image breaks direct-map rule `rule`, so the volume takes
    /// `to` (`kernel` on dm where the loop driver serves, else `nowait`).
    AutoFellBack {
        /// The path taken.
        to: DispatchPolicy,
        /// The rule broken, in its own words.
        rule: String,
    },
    /// `backend: auto` chose dm, which maps the image `direct`.
    BackendDmDirect,
    /// `backend: auto` chose dm's `kernel` path for an image that breaks
    /// `rule` on every backend.
    BackendDmKernel {
        /// The rule that kept dm off `direct`.
        rule: String,
    },
    /// `backend: auto` chose dm, the one backend with the policy asked.
    BackendDmOnly {
        /// dm's own reason.
        asked: Box<Reason>,
    },
    /// `backend: auto` chose `backend` because dm would not map the image
    /// `direct` (`why_not_dm`).
    BackendOffDm {
        /// The chosen backend's reason.
        chosen: Box<Reason>,
        /// The backend chosen.
        backend: Backend,
        /// Why dm did not take it, in words.
        why_not_dm: String,
    },
    /// dm under `auto` runs `nowait` for its QoS limit, and goes back to the
    /// kernel's path when the last limit is removed.
    QosNowait,
    /// dm under `auto` went back to the kernel's path when its last QoS limit
    /// was removed; `back` is the decision it went back by.
    LastLimitRemoved {
        /// `AutoDirect`, or `AutoFellBack` to `kernel`.
        back: Box<Reason>,
    },
    /// dm under `auto` could not leave the worker for `to` after its last QoS
    /// limit: `error`.
    BackRefused {
        /// The path it could not go back to.
        to: DispatchPolicy,
        /// Why, in words.
        error: String,
    },
    /// dm on `kernel` moved to its worker while its image's holes are filled.
    FillOnWorker,
    /// dm on `kernel` moved to its worker while its image is copied.
    CopyOnWorker,
    /// dm back on `kernel` after a copy whose start a restarted service did
    /// not see.
    KernelAfterCopy,
    /// dm could not go back to `kernel` after a copy: `error`.
    CopyReturnRefused {
        /// Why, in words.
        error: String,
    },
    /// The volume left `direct` because image `copy` now shares its
    /// extents.
    LeftDirectForCopy {
        /// The snapshot or clone.
        copy: String,
    },
    /// Rule 5: the image's extents changed (`what`) under a direct map.
    ExtentsChanged {
        /// The difference, in words.
        what: String,
        /// Whether a private ublk device serves now (dm).
        on_private: bool,
    },
    /// Rule 5: the image's pin was cleared, so its extents may move; `by`
    /// names the process that opened it, if one did.
    PinCleared {
        /// The process, as the watch describes it.
        by: Option<String>,
    },
    /// The kernel loop driver serves (the loop backend).
    Loop {
        /// Whether with direct I/O.
        direct_io: bool,
    },
    /// Words stored or reported before reasons were typed: shown as they
    /// are, never read by a rule.
    Words {
        /// The words.
        words: String,
    },
}

/// The reason words of a dm volume under `auto` on `nowait` for its QoS
/// limit (kept to read them back from a record: [`Reason::from_words`]).
const QOS_NOWAIT: &str = "auto chose nowait: a QoS limit is set, which only a worker enforces (dm direct and kernel have none); back to the kernel's path when the last limit is removed";
const FILL_ON_WORKER: &str = "auto chose nowait: the image's holes are being filled, which a worker does while it serves (the loop driver cannot)";
const COPY_ON_WORKER: &str = "auto chose nowait: the image is being copied, which a worker holds still for (the loop driver cannot); back to kernel after the copy";

impl Reason {
    /// A reason read from words: the reasons a rule reads back (the dm
    /// states a restarted service resumes from) become their type again,
    /// anything else stays words.
    pub fn from_words(words: &str) -> Self {
        match words {
            QOS_NOWAIT => Self::QosNowait,
            FILL_ON_WORKER => Self::FillOnWorker,
            COPY_ON_WORKER => Self::CopyOnWorker,
            _ => Self::Words {
                words: words.to_string(),
            },
        }
    }

    /// The reason a record or a message carries: its type (`why`), or what
    /// its `words` say where it has none (written before the type).
    pub fn carried(why: Option<Reason>, words: &str) -> Self {
        why.unwrap_or_else(|| Self::from_words(words))
    }

    /// The rule that kept an `auto` decision off `direct` (`None`: it is
    /// `direct`, or a policy asked by name).
    pub fn rule_off_direct(&self) -> Option<&str> {
        match self {
            Self::AutoFellBack { rule, .. } => Some(rule),
            _ => None,
        }
    }

    /// What follows "auto: … and " when a volume goes back after its last
    /// QoS limit.
    fn after_last_limit(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AutoDirect { on } => write!(
                f,
                "the image passes every direct-map rule{}",
                auto_direct_how(*on)
            ),
            Self::AutoFellBack { rule, .. } => write!(f, "kernel serves it: {rule} ({KERNEL_HOW})"),
            other => write!(f, "{other}"),
        }
    }
}

/// How `direct` serves under `auto`, in its reason.
fn auto_direct_how(on: On) -> &'static str {
    match on {
        On::Ublk { .. } => "",
        On::Dm => " (linear table over its extents)",
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Asked { policy, on } => {
                write!(f, "asked: {}", policy.as_str())?;
                match (policy, on) {
                    (DispatchPolicy::Direct, On::Ublk { .. }) => {
                        f.write_str(" (the image passes every direct-map rule)")
                    }
                    (DispatchPolicy::Direct, On::Dm) => {
                        f.write_str(" (linear table over the image's extents)")
                    }
                    (DispatchPolicy::Kernel, _) => write!(f, " ({KERNEL_HOW})"),
                    (DispatchPolicy::Threaded, On::Ublk { threads }) => write!(
                        f,
                        " (io-wq, at most {threads} blocking workers per queue)"
                    ),
                    (_, On::Dm) => f.write_str(" (linear table over a private ublk device)"),
                    (_, On::Ublk { .. }) => Ok(()),
                }
            }
            Self::AutoDirect { on } => write!(
                f,
                "auto: the image passes every direct-map rule{}",
                auto_direct_how(*on)
            ),
            Self::AutoFellBack {
                to: DispatchPolicy::Kernel,
                rule,
            } => write!(f, "auto chose kernel: {rule} ({KERNEL_HOW})"),
            Self::AutoFellBack { to, rule } => write!(f, "auto chose {}: {rule}", to.as_str()),
            Self::BackendDmDirect => f.write_str(
                "auto: backend dm, direct: the image passes every direct-map rule (linear table over its extents, the fastest path)",
            ),
            Self::BackendDmKernel { rule } => write!(
                f,
                "auto: backend dm, kernel: {rule} ({KERNEL_HOW}; the fastest path for an image no backend maps direct)"
            ),
            Self::BackendDmOnly { asked } => {
                write!(f, "{asked}; backend auto chose dm, the one backend with it")
            }
            Self::BackendOffDm {
                chosen,
                backend,
                why_not_dm,
            } => {
                write!(
                    f,
                    "{chosen}; backend auto chose {}: dm would not map it direct ",
                    backend.as_str()
                )?;
                // Once, when the chosen backend fell back by the same rule
                // (a hole keeps both off `direct`).
                if chosen.rule_off_direct() == Some(why_not_dm.as_str()) {
                    f.write_str("either, by the same rule")
                } else {
                    write!(f, "({why_not_dm})")
                }
            }
            Self::QosNowait => f.write_str(QOS_NOWAIT),
            Self::LastLimitRemoved { back } => {
                f.write_str("auto: the last QoS limit was removed, and ")?;
                back.after_last_limit(f)
            }
            Self::BackRefused { to, error } => write!(
                f,
                "auto chose nowait: back to {} refused: {error}",
                to.as_str()
            ),
            Self::FillOnWorker => f.write_str(FILL_ON_WORKER),
            Self::CopyOnWorker => f.write_str(COPY_ON_WORKER),
            Self::KernelAfterCopy => {
                f.write_str("auto chose kernel: back on the loop driver after a copy of one moment")
            }
            Self::CopyReturnRefused { error } => write!(
                f,
                "auto chose nowait: back to kernel after a copy refused: {error}"
            ),
            Self::LeftDirectForCopy { copy } => write!(
                f,
                "left direct for nowait: image '{copy}' was made from this volume's image and shares its extents, which a direct map must own alone (direct-map rule: no SHARED extents)"
            ),
            Self::ExtentsChanged { what, on_private } => {
                write!(
                    f,
                    "direct-map rule 5: the image's extents changed ({what}); serving on nowait"
                )?;
                if *on_private {
                    f.write_str(" through a private ublk device")?;
                }
                Ok(())
            }
            Self::PinCleared { by: None } => f.write_str(
                "direct-map rule 5: the image's pin (FS_IMMUTABLE_FL) was cleared, so its extents may move; serving on nowait",
            ),
            Self::PinCleared { by: Some(by) } => write!(
                f,
                "direct-map rule 5: the image's pin was cleared and {by} opened it, so its extents may move; serving on nowait"
            ),
            Self::Loop { direct_io: true } => {
                f.write_str("kernel loop driver with direct I/O on the image")
            }
            Self::Loop { direct_io: false } => f.write_str(
                "kernel loop driver with buffered I/O: the image's filesystem refused direct I/O",
            ),
            Self::Words { words } => f.write_str(words),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reasons a restarted service resumes from read back as their
    /// type, from the words a record of the version before holds.
    #[test]
    fn the_reasons_a_rule_reads_come_back_from_their_words() {
        for r in [
            Reason::QosNowait,
            Reason::FillOnWorker,
            Reason::CopyOnWorker,
        ] {
            assert_eq!(Reason::from_words(&r.to_string()), r);
        }
        assert_eq!(
            Reason::from_words("asked: nowait"),
            Reason::Words {
                words: "asked: nowait".into()
            }
        );
    }

    /// A reason keeps its type through the JSON a row and the wire hold.
    #[test]
    fn a_reason_survives_its_json() {
        let r = Reason::LastLimitRemoved {
            back: Box::new(Reason::AutoFellBack {
                to: DispatchPolicy::Kernel,
                rule: "direct-map rule 2: a hole".into(),
            }),
        };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Reason>(&json).unwrap(), r);
        assert_eq!(
            r.to_string(),
            format!(
                "auto: the last QoS limit was removed, and kernel serves it: direct-map rule 2: a hole ({KERNEL_HOW})"
            )
        );
    }
}
