//! The kernel's NVMe-over-Fabrics initiator (`nvme-fabrics`, with the
//! `nvme-tcp` transport): connecting to another host's export, finding the
//! block device it gives, rotating its secrets, disconnecting.
//!
//! A connection is one write of an option string to `/dev/nvme-fabrics`
//! and a read of the controller it made, as nvme-cli does through libnvme,
//! but without a program: the string holds the DH-HMAC-CHAP secrets, which
//! a program would have in its arguments (`/proc/PID/cmdline`) or its debug
//! log. Here the string is built in wiped memory and written once.
//!
//! The kernel keeps the controller after a connection is lost: it
//! reconnects every `reconnect_delay` seconds until `ctrl_loss_tmo`, and
//! the device stays ([`Timeouts`]). With native multipath (Debian's
//! default) the device is the subsystem's head, `/dev/nvme<S>n<H>`, where
//! `S` is the kernel's number for the subsystem (not the controller's) and
//! `H` a counter, not the namespace id ([`namespace_device`]).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

use crate::dhchap::Secret;
use crate::kmod;
use crate::nvmet::{ListenAddr, NvmetError, check_nqn};

/// The initiator's control device.
pub const FABRICS_DEV: &str = "/dev/nvme-fabrics";

/// The controllers, one directory each (`nvme<instance>`).
pub const SYS_CLASS_NVME: &str = "/sys/class/nvme";

/// The most bytes the kernel takes in one write to `/dev/nvme-fabrics`
/// (a page).
const OPTIONS_MAX: usize = 4096;

/// How often [`wait_namespace`] looks.
const WAIT_STEP: Duration = Duration::from_millis(50);

/// How the kernel treats a lost connection.
///
/// The default, and why:
///
/// - `keep_alive_tmo_s: 5` (the kernel's own): a target that stops
///   answering is noticed within 5 s and the reconnect loop starts.
/// - `reconnect_delay_s: 2` (the kernel's is 10): a network blip heals
///   within about 2 s of the network's return, not 10; a connect attempt
///   every 2 s to a host that is away costs nothing worth saving.
/// - `ctrl_loss_tmo_s: 600` (the kernel's own): how long a lost export is
///   waited for before the kernel gives up, deletes the controller and
///   fails its I/O — long enough for the exporting host to reboot and
///   blockplane to re-create its exports from the registry, finite so that
///   an export that is gone ends in an error rather than a hang. A
///   negative value reconnects forever: never the default.
/// - `fast_io_fail_tmo_s: -1` (off, the kernel's own): I/O waits, queued,
///   for as long as the controller reconnects, and fails only when it is
///   deleted. A fast-fail time would hand I/O errors to the consumer's
///   filesystem during an outage the controller then survives (a reboot of
///   the exporting host takes longer than any time short enough to help),
///   and the filesystem would be damaged or read-only for nothing; what the
///   consumer needs is its I/O kept, then an error once the export is truly
///   lost. The cost: for up to `ctrl_loss_tmo_s`, I/O (and a dm suspend
///   above the device) waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Seconds between reconnect attempts (at least 1).
    pub reconnect_delay_s: u32,
    /// Seconds after a loss before the kernel gives up and deletes the
    /// controller; negative: never.
    pub ctrl_loss_tmo_s: i32,
    /// Seconds after a loss before queued I/O fails while reconnects go
    /// on; -1: not before the controller is deleted.
    pub fast_io_fail_tmo_s: i32,
    /// Seconds of silence before the target is taken to be lost (at least
    /// 1).
    pub keep_alive_tmo_s: u32,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            reconnect_delay_s: 2,
            ctrl_loss_tmo_s: 600,
            fast_io_fail_tmo_s: -1,
            keep_alive_tmo_s: 5,
        }
    }
}

/// One connection to make.
#[derive(Debug, Clone, Copy)]
pub struct Connect<'a> {
    /// The exporting host's listen address.
    pub address: ListenAddr,
    /// The export's subsystem NQN.
    pub nqn: &'a str,
    /// This host's NQN.
    pub host_nqn: &'a str,
    /// This host's id. The kernel pairs it with `host_nqn` for good: a
    /// second connection with the same NQN and another id is refused, so
    /// keep the two together.
    pub host_id: uuid::Uuid,
    /// The host's DH-HMAC-CHAP secret, which it proves it has.
    pub secret: Option<&'a Secret>,
    /// The controller's secret, which the target proves it has
    /// (bidirectional authentication); only with `secret`.
    pub ctrl_secret: Option<&'a Secret>,
    /// How a lost connection is treated.
    pub timeouts: Timeouts,
}

/// The controller a connection made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControllerId {
    /// The kernel's number for it: `/dev/nvme<instance>`,
    /// `/sys/class/nvme/nvme<instance>`.
    pub instance: u32,
    /// The controller id the target gave it.
    pub cntlid: u16,
}

/// A controller's state (`/sys/class/nvme/nvmeN/state`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControllerState {
    /// Being set up.
    New,
    /// Connected: I/O flows.
    Live,
    /// Being reset.
    Resetting,
    /// Lost, and reconnecting: I/O waits.
    Connecting,
    /// Being deleted.
    Deleting,
    /// Being deleted, with no more I/O to it.
    DeletingNoIo,
    /// Given up on.
    Dead,
    /// A state this build does not know.
    Other(String),
}

impl ControllerState {
    fn parse(text: &str) -> Self {
        match text {
            "new" => Self::New,
            "live" => Self::Live,
            "resetting" => Self::Resetting,
            "connecting" => Self::Connecting,
            "deleting" => Self::Deleting,
            "deleting (no IO)" => Self::DeletingNoIo,
            "dead" => Self::Dead,
            other => Self::Other(other.to_string()),
        }
    }

    /// Whether the controller is going or gone (deleting or dead).
    pub fn is_gone(&self) -> bool {
        matches!(self, Self::Deleting | Self::DeletingNoIo | Self::Dead)
    }
}

impl fmt::Display for ControllerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::New => "new",
            Self::Live => "live",
            Self::Resetting => "resetting",
            Self::Connecting => "connecting",
            Self::Deleting => "deleting",
            Self::DeletingNoIo => "deleting (no IO)",
            Self::Dead => "dead",
            Self::Other(s) => s,
        })
    }
}

/// A controller as sysfs has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerInfo {
    /// Its instance (`nvme<instance>`).
    pub instance: u32,
    /// Its transport: `tcp`, `rdma`, `loop`, `pcie` (a local drive).
    pub transport: String,
    /// The subsystem's NQN.
    pub subsys_nqn: String,
    /// The NQN this host connected with.
    pub host_nqn: String,
    /// The target's address, for a fabrics controller whose address reads
    /// as an IP and port.
    pub address: Option<ListenAddr>,
    /// Its state.
    pub state: ControllerState,
}

/// What the initiator refused, or why it could not be asked. No message
/// carries a secret: they name the address, the NQNs and the kernel's
/// errno.
#[derive(Debug, thiserror::Error)]
pub enum FabricsError {
    /// A module the initiator needs is not loaded and could not be.
    #[error("the {module} kernel module (the NVMe-oF initiator) is missing: {detail}")]
    Missing {
        /// `nvme-fabrics` or `nvme-tcp`.
        module: &'static str,
        /// What `modprobe` said.
        detail: String,
    },
    /// An NQN that may not be used.
    #[error(transparent)]
    BadNqn(NvmetError),
    /// Options the kernel would refuse, found before asking it.
    #[error("cannot connect to {nqn} at {address}: {why}")]
    BadOptions {
        /// The export's address.
        address: ListenAddr,
        /// The export's NQN.
        nqn: String,
        /// What is wrong.
        why: &'static str,
    },
    /// Nothing answered at the address (refused, unreachable, timed out).
    #[error("cannot connect to {nqn} at {address}: nothing answers there ({source})")]
    Unreachable {
        /// The export's address.
        address: ListenAddr,
        /// The export's NQN.
        nqn: String,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
    /// DH-HMAC-CHAP failed (EKEYREJECTED): the target did not accept this
    /// host's secret, or this host did not accept the target's answer to
    /// its controller secret — a wrong secret on either side.
    #[error(
        "{address} and {host_nqn} failed to authenticate each other for {nqn}: a wrong host or controller secret ({source})"
    )]
    AuthRefused {
        /// The export's address.
        address: ListenAddr,
        /// The export's NQN.
        nqn: String,
        /// This host's NQN.
        host_nqn: String,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
    /// The target requires authentication of this host and no secret was
    /// given (ENOKEY).
    #[error(
        "{address} requires {host_nqn} to authenticate for {nqn}, and no secret was given ({source})"
    )]
    SecretRequired {
        /// The export's address.
        address: ListenAddr,
        /// The export's NQN.
        nqn: String,
        /// This host's NQN.
        host_nqn: String,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
    /// The target refused the connect itself (EIO): this host is not among
    /// the subsystem's allowed hosts, or the subsystem is not served at
    /// that address. The kernel says which only in its log.
    #[error(
        "{address} refused {host_nqn} for {nqn}: the host is not allowed there, or the subsystem is not served there ({source})"
    )]
    NotAllowed {
        /// The export's address.
        address: ListenAddr,
        /// The export's NQN.
        nqn: String,
        /// This host's NQN.
        host_nqn: String,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
    /// A controller for the same export, address and host exists already.
    #[error("{host_nqn} is already connected to {nqn} at {address}")]
    AlreadyConnected {
        /// The export's address.
        address: ListenAddr,
        /// The export's NQN.
        nqn: String,
        /// This host's NQN.
        host_nqn: String,
    },
    /// The kernel refused the options (EINVAL, or EPERM for a secret it
    /// cannot parse): a host id other than the one this host NQN connected
    /// with before, or an option this kernel does not know.
    #[error(
        "the kernel refused the options to connect {host_nqn} to {nqn} at {address} (a host id other than the one this host NQN uses, or an option this kernel lacks; its log says which) ({source})"
    )]
    Invalid {
        /// The export's address.
        address: ListenAddr,
        /// The export's NQN.
        nqn: String,
        /// This host's NQN.
        host_nqn: String,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
    /// The controller does not exist (any more).
    #[error("there is no NVMe controller nvme{instance}")]
    NoController {
        /// Its instance.
        instance: u32,
    },
    /// The controller is being deleted or is dead: no namespace will come.
    #[error("NVMe controller nvme{instance} is {state}: it will give no device")]
    ControllerGone {
        /// Its instance.
        instance: u32,
        /// Its state.
        state: ControllerState,
    },
    /// The kernel's answer could not be read.
    #[error("{}: unexpected answer {answer:?}", .path.display())]
    Answer {
        /// Where it was read.
        path: PathBuf,
        /// What it was.
        answer: String,
    },
    /// Any other failure of a call on the device or sysfs.
    #[error("cannot {op} {}: {source}", .path.display())]
    Io {
        /// The call (`open`, `write`, `read`, `stat`, `chmod`).
        op: &'static str,
        /// Its path.
        path: PathBuf,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
}

impl FabricsError {
    fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        FabricsError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The option string of one connection, in wiped memory allocated once at
/// the kernel's limit (so that no growth leaves a copy behind), with a
/// `Debug` that shows none of it.
struct Options(Zeroizing<String>);

impl fmt::Debug for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Options(<{} bytes, redacted>)", self.0.len())
    }
}

impl Options {
    fn new() -> Self {
        Options(Zeroizing::new(String::with_capacity(OPTIONS_MAX)))
    }

    /// Appends `key=value`; `false`, with nothing appended, when that would
    /// pass the kernel's limit (and so the buffer's capacity).
    fn push(&mut self, key: &str, value: &str) -> bool {
        let comma = usize::from(!self.0.is_empty());
        if self.0.len() + comma + key.len() + 1 + value.len() > OPTIONS_MAX {
            return false;
        }
        if comma == 1 {
            self.0.push(',');
        }
        self.0.push_str(key);
        self.0.push('=');
        self.0.push_str(value);
        true
    }

    fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// The option string of `c`, checked.
fn options(c: &Connect<'_>) -> Result<Options, FabricsError> {
    check_nqn(c.nqn).map_err(FabricsError::BadNqn)?;
    check_nqn(c.host_nqn).map_err(FabricsError::BadNqn)?;
    let bad = |why| FabricsError::BadOptions {
        address: c.address,
        nqn: c.nqn.to_string(),
        why,
    };
    let t = c.timeouts;
    if t.reconnect_delay_s == 0 {
        return Err(bad("reconnect_delay must be at least 1 s"));
    }
    if t.keep_alive_tmo_s == 0 {
        return Err(bad("keep_alive_tmo must be at least 1 s"));
    }
    if t.fast_io_fail_tmo_s < -1 {
        return Err(bad("fast_io_fail_tmo is -1 (off) or a number of seconds"));
    }
    if c.ctrl_secret.is_some() && c.secret.is_none() {
        return Err(bad(
            "a controller secret is sent only with a host secret (bidirectional authentication)",
        ));
    }
    let mut o = Options::new();
    let mut ok = o.push("transport", "tcp")
        && o.push("traddr", &c.address.ip.to_string())
        && o.push("trsvcid", &c.address.port.to_string())
        && o.push("nqn", c.nqn)
        && o.push("hostnqn", c.host_nqn)
        && o.push("hostid", &c.host_id.hyphenated().to_string())
        && o.push("reconnect_delay", &t.reconnect_delay_s.to_string())
        && o.push("ctrl_loss_tmo", &t.ctrl_loss_tmo_s.to_string())
        && o.push("fast_io_fail_tmo", &t.fast_io_fail_tmo_s.to_string())
        && o.push("keep_alive_tmo", &t.keep_alive_tmo_s.to_string());
    if let Some(s) = c.secret {
        ok = ok && o.push("dhchap_secret", s.expose());
    }
    if let Some(s) = c.ctrl_secret {
        ok = ok && o.push("dhchap_ctrl_secret", s.expose());
    }
    if !ok {
        return Err(bad("the options are longer than the kernel takes"));
    }
    Ok(o)
}

/// Whether this host can connect to exports: the initiator's modules
/// load (they are loaded when they can), or why not.
pub fn available() -> Result<(), FabricsError> {
    load_modules()
}

/// Loads `nvme-fabrics` (if `/dev/nvme-fabrics` is missing) and `nvme-tcp`.
fn load_modules() -> Result<(), FabricsError> {
    if !Path::new(FABRICS_DEV).exists() {
        kmod::load("nvme-fabrics").map_err(|detail| FabricsError::Missing {
            module: "nvme-fabrics",
            detail,
        })?;
    }
    kmod::load("nvme-tcp").map_err(|detail| FabricsError::Missing {
        module: "nvme-tcp",
        detail,
    })
}

/// Connects to an export: one controller, whose instance and id the
/// kernel answers. The kernel connects and authenticates before it
/// answers, so this blocks for as long as that takes (a target that does
/// not answer: the TCP connect's own time-out). The secrets' sysfs
/// attributes are closed to all but root as soon as the controller exists
/// where the kernel made them readable by others.
pub fn connect(c: &Connect<'_>) -> Result<ControllerId, FabricsError> {
    let opts = options(c)?;
    load_modules()?;
    let dev = Path::new(FABRICS_DEV);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev)
        .map_err(|e| FabricsError::io("open", dev, e))?;
    // One write: the kernel parses each write as a whole option string,
    // and refuses a second on the same descriptor.
    let len = opts.as_bytes().len();
    let n = f.write(opts.as_bytes()).map_err(|e| connect_error(c, e))?;
    drop(opts);
    if n != len {
        return Err(FabricsError::io(
            "write",
            dev,
            io::Error::from(io::ErrorKind::WriteZero),
        ));
    }
    let mut buf = [0u8; 256];
    let len = f
        .read(&mut buf)
        .map_err(|e| FabricsError::io("read", dev, e))?;
    let answer = String::from_utf8_lossy(&buf[..len]);
    let id = parse_connected(&answer).ok_or_else(|| FabricsError::Answer {
        path: dev.to_path_buf(),
        answer: answer.to_string(),
    })?;
    if c.secret.is_some()
        && let Err(e) = close_secrets(id.instance)
    {
        // A connection whose secrets any user can read is not kept.
        let _ = disconnect(id.instance);
        return Err(e);
    }
    Ok(id)
}

/// The error of a connect the kernel refused with `e`.
fn connect_error(c: &Connect<'_>, e: io::Error) -> FabricsError {
    let address = c.address;
    let nqn = c.nqn.to_string();
    let host_nqn = c.host_nqn.to_string();
    match e.raw_os_error() {
        Some(
            libc::ECONNREFUSED
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::ETIMEDOUT
            | libc::ECONNRESET
            | libc::EADDRNOTAVAIL,
        ) => FabricsError::Unreachable {
            address,
            nqn,
            source: e,
        },
        Some(libc::EKEYREJECTED | libc::EKEYEXPIRED) => FabricsError::AuthRefused {
            address,
            nqn,
            host_nqn,
            source: e,
        },
        Some(libc::ENOKEY) => FabricsError::SecretRequired {
            address,
            nqn,
            host_nqn,
            source: e,
        },
        Some(libc::EIO) => FabricsError::NotAllowed {
            address,
            nqn,
            host_nqn,
            source: e,
        },
        Some(libc::EALREADY) => FabricsError::AlreadyConnected {
            address,
            nqn,
            host_nqn,
        },
        // EPERM: a secret the kernel could not parse, which a checked
        // Secret never is.
        Some(libc::EINVAL | libc::EPERM) => FabricsError::Invalid {
            address,
            nqn,
            host_nqn,
            source: e,
        },
        _ => FabricsError::io("write", Path::new(FABRICS_DEV), e),
    }
}

/// `instance=N,cntlid=M` (and a newline): the kernel's answer to a
/// connect.
fn parse_connected(answer: &str) -> Option<ControllerId> {
    let mut instance = None;
    let mut cntlid = None;
    for field in answer.trim_end().split(',') {
        match field.split_once('=')? {
            ("instance", v) => instance = Some(v.parse().ok()?),
            ("cntlid", v) => cntlid = Some(v.parse().ok()?),
            _ => {}
        }
    }
    Some(ControllerId {
        instance: instance?,
        cntlid: cntlid?,
    })
}

fn controller_dir(instance: u32) -> PathBuf {
    Path::new(SYS_CLASS_NVME).join(format!("nvme{instance}"))
}

/// Makes the controller's secret attributes readable by root only where
/// they are not: they print the secret. Debian's 6.12 and 7.3 make them
/// 0600 already (the VM probe); mainline's source declares them 0644, so a
/// kernel that does gets them closed here. An attribute the kernel lacks
/// (no authentication built in) is nothing to close.
fn close_secrets(instance: u32) -> Result<(), FabricsError> {
    let dir = controller_dir(instance);
    for name in ["dhchap_secret", "dhchap_ctrl_secret"] {
        let path = dir.join(name);
        let mode = match std::fs::metadata(&path) {
            Ok(m) => m.permissions().mode(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(FabricsError::io("stat", &path, e)),
        };
        if mode & 0o077 != 0 {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| FabricsError::io("chmod", &path, e))?;
        }
    }
    Ok(())
}

/// Every NVMe controller of this host (fabrics or local), sorted by
/// instance: to adopt this host's own connections at start and to report
/// their state. A controller that goes while it is read is left out.
pub fn controllers() -> Result<Vec<ControllerInfo>, FabricsError> {
    let root = Path::new(SYS_CLASS_NVME);
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        // No NVMe driver loaded: no controllers.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(FabricsError::io("read", root, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| FabricsError::io("read", root, e))?;
        let Some(instance) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("nvme"))
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        if let Some(info) = controller(instance)? {
            out.push(info);
        }
    }
    out.sort_by_key(|c| c.instance);
    Ok(out)
}

/// One controller, or `None` when it is not there (any more).
pub fn controller(instance: u32) -> Result<Option<ControllerInfo>, FabricsError> {
    let dir = controller_dir(instance);
    let attr = |name: &str| -> Result<Option<String>, FabricsError> {
        let path = dir.join(name);
        match std::fs::read_to_string(&path) {
            Ok(s) => Ok(Some(s.trim_end().to_string())),
            // Gone meanwhile (ENOENT), or being deleted (ENODEV).
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(FabricsError::io("read", &path, e)),
        }
    };
    let (Some(transport), Some(subsys_nqn), Some(state)) =
        (attr("transport")?, attr("subsysnqn")?, attr("state")?)
    else {
        return Ok(None);
    };
    Ok(Some(ControllerInfo {
        instance,
        host_nqn: attr("hostnqn")?.unwrap_or_default(),
        address: attr("address")?.as_deref().and_then(parse_address),
        state: ControllerState::parse(&state),
        transport,
        subsys_nqn,
    }))
}

/// The target's address in a controller's sysfs `address`:
/// `traddr=10.0.0.1,trsvcid=4420` and, on some kernels, more fields
/// (`host_traddr=`, `host_iface=`, `src_addr=`), which are not the target's.
fn parse_address(text: &str) -> Option<ListenAddr> {
    let mut ip: Option<IpAddr> = None;
    let mut port: Option<u16> = None;
    for field in text.trim().split(',') {
        match field.split_once('=') {
            Some(("traddr", v)) => ip = v.parse().ok(),
            Some(("trsvcid", v)) => port = v.parse().ok(),
            _ => {}
        }
    }
    Some(ListenAddr {
        ip: ip?,
        port: port?,
    })
}

/// The block device the controller's subsystem gives: `/dev/nvme<S>n<H>`
/// under native multipath (the head, from the hidden path device
/// `nvme<S>c<instance>n<H>` in the controller's directory), or
/// `/dev/nvme<instance>n<H>` without it. Namespace 1 where the controller
/// has several; `None` while the kernel has not scanned it yet (scanning
/// follows the connect asynchronously).
pub fn namespace_device(instance: u32) -> Result<Option<PathBuf>, FabricsError> {
    let dir = controller_dir(instance);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(FabricsError::NoController { instance });
        }
        Err(e) => return Err(FabricsError::io("read", &dir, e)),
    };
    let mut found: Vec<(bool, String)> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| FabricsError::io("read", &dir, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(head) = head_of(&name, instance) else {
            continue;
        };
        let nsid = std::fs::read_to_string(entry.path().join("nsid")).unwrap_or_default();
        found.push((nsid.trim() != "1", head));
    }
    // Namespace 1 first, then by name.
    found.sort();
    Ok(found
        .into_iter()
        .map(|(_, head)| Path::new("/dev").join(head))
        .next())
}

/// The head disk's name for a block device in controller `instance`'s
/// directory: `nvme<S>c<instance>n<H>` → `nvme<S>n<H>`; `nvme<instance>n<H>`
/// is its own (no multipath). Anything else (partitions, other entries) is
/// `None`.
fn head_of(name: &str, instance: u32) -> Option<String> {
    let rest = name.strip_prefix("nvme")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (subsys, rest) = rest.split_at(rest.find(|c: char| !c.is_ascii_digit())?);
    if !digits(subsys) {
        return None;
    }
    if let Some(rest) = rest.strip_prefix('c') {
        let (ctrl, head) = rest.split_once('n')?;
        (digits(ctrl) && digits(head) && ctrl.parse() == Ok(instance))
            .then(|| format!("nvme{subsys}n{head}"))
    } else {
        let head = rest.strip_prefix('n')?;
        (digits(head) && subsys.parse() == Ok(instance)).then(|| name.to_string())
    }
}

/// A namespace the kernel has registered for a controller: its head disk's
/// node and size, read together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// `/dev/nvme<S>n<H>` (or `/dev/nvme<instance>n<H>` without multipath).
    pub path: PathBuf,
    /// Its size in bytes, from sysfs.
    pub size_bytes: u64,
}

/// Waits up to `timeout` for the controller's namespace device
/// ([`namespace_device`]) to be a disk of this controller, registered, with
/// its `/dev` node and a size ([`registered`]). The kernel scans a new
/// controller's namespaces on a work queue after the connect returns, and
/// says nothing when it is done, so this looks every 50 ms: a bounded wait
/// for a kernel condition, not a retry. `None` at the timeout; an error as
/// soon as the controller is gone or going.
pub fn wait_namespace(instance: u32, timeout: Duration) -> Result<Option<Namespace>, FabricsError> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(dev) = namespace_device(instance)?
            && let Some(ns) = registered(&dev, instance)
        {
            return Ok(Some(ns));
        }
        match controller(instance)? {
            None => return Err(FabricsError::NoController { instance }),
            Some(c) if c.state.is_gone() => {
                return Err(FabricsError::ControllerGone {
                    instance,
                    state: c.state,
                });
            }
            Some(_) => {}
        }
        if Instant::now() >= end {
            return Ok(None);
        }
        std::thread::sleep(WAIT_STEP);
    }
}

/// `dev` as a [`Namespace`] when it is whole now: a disk the kernel has
/// registered under that name, in controller `instance`'s subsystem, whose
/// `/dev` node is that disk's, with a size. Under native multipath the head
/// disk is registered after the path device (once the path is live), so
/// the path can be in the controller's directory while the head is not a
/// disk yet; a head of that name from an earlier controller of the same
/// instance, being deleted, can still be in sysfs and `/dev` meanwhile; and
/// a disk can go between two looks, so its size is read last and the node
/// checked again after it.
fn registered(dev: &Path, instance: u32) -> Option<Namespace> {
    let name = dev.file_name()?;
    let sys = Path::new("/sys/class/block").join(name);
    let numbers = std::fs::read_to_string(sys.join("dev")).ok()?;
    let (major, minor) = numbers.trim().split_once(':')?;
    let rdev = libc::makedev(major.parse().ok()?, minor.parse().ok()?);
    let node_is_disk = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(dev).is_ok_and(|m| m.rdev() == rdev)
    };
    if !node_is_disk() || !in_subsystem_of(&sys, instance) {
        return None;
    }
    let sectors: u64 = std::fs::read_to_string(sys.join("size"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (sectors > 0 && node_is_disk()).then(|| Namespace {
        path: dev.to_path_buf(),
        size_bytes: sectors * 512,
    })
}

/// Whether the disk at sysfs `disk` hangs under controller `instance`: its
/// parent is the controller (no multipath), or a subsystem that links the
/// controller (a multipath head).
fn in_subsystem_of(disk: &Path, instance: u32) -> bool {
    let (Ok(disk), Ok(ctrl)) = (
        std::fs::canonicalize(disk),
        std::fs::canonicalize(controller_dir(instance)),
    ) else {
        return false;
    };
    let Some(parent) = disk.parent() else {
        return false;
    };
    parent == ctrl
        || std::fs::canonicalize(parent.join(format!("nvme{instance}"))).is_ok_and(|c| c == ctrl)
}

/// Disconnects the controller (`delete_controller`; the kernel returns
/// once it is deleted, failing the I/O still queued). One already gone is
/// not an error.
pub fn disconnect(instance: u32) -> Result<(), FabricsError> {
    let path = controller_dir(instance).join("delete_controller");
    match write_attr(&path, b"1") {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
        Err(e) => Err(FabricsError::io("write", &path, e)),
    }
}

/// Gives the controller a new host secret; the kernel re-authenticates
/// with it at once, without dropping the connection (write the target's
/// new key first: a re-authentication between the two fails).
pub fn set_secret(instance: u32, secret: &Secret) -> Result<(), FabricsError> {
    set_attr_secret(instance, "dhchap_secret", secret)
}

/// Gives the controller a new controller secret (what the target must
/// prove), as [`set_secret`] does.
pub fn set_ctrl_secret(instance: u32, secret: &Secret) -> Result<(), FabricsError> {
    set_attr_secret(instance, "dhchap_ctrl_secret", secret)
}

fn set_attr_secret(instance: u32, name: &str, secret: &Secret) -> Result<(), FabricsError> {
    let path = controller_dir(instance).join(name);
    write_attr(&path, secret.expose().as_bytes()).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => FabricsError::NoController { instance },
        _ => FabricsError::io("write", &path, e),
    })?;
    close_secrets(instance)
}

/// Writes a sysfs attribute in one `write(2)`.
fn write_attr(path: &Path, value: &[u8]) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    let n = f.write(value)?;
    if n != value.len() {
        return Err(io::Error::from(io::ErrorKind::WriteZero));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key that passes every check, as nvme-cli's documentation gives
    /// it: a test's own, never a real one.
    const KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

    fn conn<'a>(secret: Option<&'a Secret>, ctrl: Option<&'a Secret>) -> Connect<'a> {
        Connect {
            address: "10.0.0.1:4420".parse().unwrap(),
            nqn: "nqn.2024-01.io.blockplane:a:vol",
            host_nqn: "nqn.2024-01.io.blockplane:host:b",
            host_id: "12345678-9abc-4def-8123-456789abcdef".parse().unwrap(),
            secret,
            ctrl_secret: ctrl,
            timeouts: Timeouts::default(),
        }
    }

    #[test]
    fn the_option_string_holds_every_field_and_the_secret_only_there() {
        let key = Secret::parse(KEY).unwrap();
        let ctrl = Secret::generate().unwrap();
        let c = conn(Some(&key), Some(&ctrl));
        let o = options(&c).unwrap();
        let text = std::str::from_utf8(o.as_bytes()).unwrap();
        assert_eq!(
            text,
            format!(
                "transport=tcp,traddr=10.0.0.1,trsvcid=4420,\
                 nqn=nqn.2024-01.io.blockplane:a:vol,\
                 hostnqn=nqn.2024-01.io.blockplane:host:b,\
                 hostid=12345678-9abc-4def-8123-456789abcdef,\
                 reconnect_delay=2,ctrl_loss_tmo=600,fast_io_fail_tmo=-1,keep_alive_tmo=5,\
                 dhchap_secret={KEY},dhchap_ctrl_secret={}",
                ctrl.expose()
            )
        );
        // Its Debug, and the Connect's, show neither secret.
        for shown in [format!("{o:?}"), format!("{c:?}"), format!("{c:#?}")] {
            assert!(!shown.contains("ia6z"), "{shown}");
            assert!(!shown.contains(&ctrl.expose()[10..30]), "{shown}");
        }
        // Nor does any refusal of a connect.
        for errno in [
            libc::ECONNREFUSED,
            libc::EKEYREJECTED,
            libc::ENOKEY,
            libc::EIO,
            libc::EALREADY,
            libc::EINVAL,
            libc::ENOMEM,
        ] {
            let e = connect_error(&c, io::Error::from_raw_os_error(errno));
            let said = format!("{e} {e:?}");
            assert!(!said.contains("ia6z") && !said.contains("DHHC"), "{said}");
            assert!(
                said.contains("10.0.0.1:4420") || errno == libc::ENOMEM,
                "{said}"
            );
        }
        assert!(matches!(
            connect_error(&c, io::Error::from_raw_os_error(libc::ECONNREFUSED)),
            FabricsError::Unreachable { .. }
        ));
        // As the 6.12 VM probe saw them: a wrong host or controller
        // secret, no secret for a host with a key, an unlisted host.
        let kind = |errno| connect_error(&c, io::Error::from_raw_os_error(errno));
        assert!(matches!(
            kind(libc::EKEYREJECTED),
            FabricsError::AuthRefused { .. }
        ));
        assert!(matches!(
            kind(libc::ENOKEY),
            FabricsError::SecretRequired { .. }
        ));
        assert!(matches!(kind(libc::EIO), FabricsError::NotAllowed { .. }));
        assert!(matches!(
            kind(libc::EALREADY),
            FabricsError::AlreadyConnected { .. }
        ));
        assert!(matches!(
            kind(libc::ENETUNREACH),
            FabricsError::Unreachable { .. }
        ));
    }

    #[test]
    fn ipv6_addresses_and_no_secret_make_a_plain_string() {
        let mut c = conn(None, None);
        c.address = "[fd00::1]:4421".parse().unwrap();
        let o = options(&c).unwrap();
        let text = std::str::from_utf8(o.as_bytes()).unwrap();
        assert!(
            text.starts_with("transport=tcp,traddr=fd00::1,trsvcid=4421,"),
            "{text}"
        );
        assert!(!text.contains("dhchap"), "{text}");
    }

    #[test]
    fn options_the_kernel_would_refuse_are_refused_first() {
        let key = Secret::parse(KEY).unwrap();
        let e = options(&conn(None, Some(&key))).unwrap_err();
        assert!(e.to_string().contains("only with a host secret"), "{e}");
        assert!(!e.to_string().contains("ia6z"));
        let mut c = conn(None, None);
        c.timeouts.reconnect_delay_s = 0;
        assert!(matches!(options(&c), Err(FabricsError::BadOptions { .. })));
        let mut c = conn(None, None);
        c.timeouts.keep_alive_tmo_s = 0;
        assert!(matches!(options(&c), Err(FabricsError::BadOptions { .. })));
        let mut c = conn(None, None);
        c.timeouts.fast_io_fail_tmo_s = -2;
        assert!(matches!(options(&c), Err(FabricsError::BadOptions { .. })));
        let mut c = conn(None, None);
        c.nqn = "nqn.x,hostnqn=evil";
        assert!(matches!(options(&c), Err(FabricsError::BadNqn(_))));
        let mut c = conn(None, None);
        c.host_nqn = "host";
        assert!(matches!(options(&c), Err(FabricsError::BadNqn(_))));
    }

    #[test]
    fn the_buffer_never_grows_past_its_limit() {
        let mut o = Options::new();
        let cap = o.0.capacity();
        let long = "x".repeat(200);
        while o.push("k", &long) {}
        assert!(!o.push("k", &"y".repeat(OPTIONS_MAX)));
        assert!(o.0.len() <= OPTIONS_MAX);
        assert_eq!(o.0.capacity(), cap, "the buffer was reallocated");
    }

    #[test]
    fn the_connect_answer_is_read() {
        assert_eq!(
            parse_connected("instance=3,cntlid=1\n"),
            Some(ControllerId {
                instance: 3,
                cntlid: 1
            })
        );
        assert_eq!(
            parse_connected("instance=12,cntlid=65535"),
            Some(ControllerId {
                instance: 12,
                cntlid: 65535
            })
        );
        for bad in [
            "",
            "instance=3",
            "cntlid=1",
            "instance=x,cntlid=1",
            "garbage",
        ] {
            assert_eq!(parse_connected(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn sysfs_addresses_are_read() {
        let a = |s| parse_address(s).map(|a| a.to_string());
        assert_eq!(
            a("traddr=10.0.0.1,trsvcid=4420\n").as_deref(),
            Some("10.0.0.1:4420")
        );
        assert_eq!(
            a("traddr=10.0.0.1,trsvcid=4420,src_addr=10.0.0.2").as_deref(),
            Some("10.0.0.1:4420")
        );
        assert_eq!(
            a("traddr=10.0.0.1,trsvcid=4420,host_traddr=10.0.0.9,host_iface=veth0").as_deref(),
            Some("10.0.0.1:4420")
        );
        assert_eq!(
            a("traddr=fd00::1,trsvcid=4421").as_deref(),
            Some("[fd00::1]:4421")
        );
        assert_eq!(a("traddr=nn-0x1:pn-0x2,host_traddr=x"), None);
        assert_eq!(a(""), None);
        assert_eq!(a("trsvcid=4420"), None);
    }

    #[test]
    fn states_are_read() {
        for s in [
            "new",
            "live",
            "resetting",
            "connecting",
            "deleting",
            "deleting (no IO)",
            "dead",
            "whatever",
        ] {
            assert_eq!(ControllerState::parse(s).to_string(), s);
        }
        assert!(ControllerState::parse("dead").is_gone());
        assert!(ControllerState::parse("deleting (no IO)").is_gone());
        assert!(!ControllerState::parse("connecting").is_gone());
    }

    #[test]
    fn head_devices_are_named_from_their_paths() {
        // Native multipath: the path of subsystem 2, controller 5, head 1.
        assert_eq!(head_of("nvme2c5n1", 5).as_deref(), Some("nvme2n1"));
        assert_eq!(head_of("nvme0c0n12", 0).as_deref(), Some("nvme0n12"));
        // Another controller's path is not this one's.
        assert_eq!(head_of("nvme2c6n1", 5), None);
        // No multipath: the controller's own namespace.
        assert_eq!(head_of("nvme5n1", 5).as_deref(), Some("nvme5n1"));
        assert_eq!(head_of("nvme4n1", 5), None);
        for other in [
            "nvme5",
            "nvme5n1p1",
            "nvme2c5n",
            "device",
            "power",
            "nvme5n",
            "nvmec5n1",
        ] {
            assert_eq!(head_of(other, 5), None, "{other}");
        }
    }
}
