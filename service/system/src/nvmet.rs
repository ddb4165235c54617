//! The kernel's NVMe-over-Fabrics target (`nvmet`, with the `nvmet-tcp`
//! transport), configured through configfs under `/sys/kernel/config/nvmet`:
//! the kernel serves the bytes; this module only writes and reads its
//! configuration, as nvmetcli and blktests do.
//!
//! The tree, and what this module makes in it:
//!
//! - `hosts/<host NQN>/` — a host that may connect, with its DH-HMAC-CHAP
//!   keys ([`Target::ensure_host`]);
//! - `subsystems/<NQN>/` — one export: `attr_allow_any_host` (0 unless
//!   asked: the kernel authenticates only the hosts of a subsystem that
//!   lists them), `allowed_hosts/` (links to hosts), and `namespaces/1/`,
//!   whose `device_path` is the block device served
//!   ([`Target::ensure_subsystem`]);
//! - `ports/<id>/` — a TCP listener (`addr_*`), and `subsystems/`, links to
//!   the subsystems served on it ([`Target::ensure_port`]).
//!
//! The order of the writes is the kernel's ([`Target::ensure_subsystem`]
//! says which and why); every name that becomes a path is checked first
//! ([`check_nqn`]). The configuration is the kernel's, not the process's:
//! it outlives the service, which reads it back at start
//! ([`Target::subsystems`]) rather than assuming it gone.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::dhchap::Secret;
use crate::kmod;

/// Where configfs is mounted.
pub const CONFIGFS: &str = "/sys/kernel/config";

/// The target's tree in configfs.
pub const ROOT: &str = "/sys/kernel/config/nvmet";

/// The target's tree in debugfs (kernels built with
/// `CONFIG_NVME_TARGET_DEBUGFS`): a directory per subsystem, one per
/// controller in it.
pub const DEBUGFS: &str = "/sys/kernel/debug/nvmet";

/// The NVMe/TCP port IANA assigned, taken when an address names none.
pub const DEFAULT_PORT: u16 = 4420;

/// The longest NQN, in bytes (`NVMF_NQN_SIZE`).
pub const NQN_MAX: usize = 223;

/// The discovery subsystem's NQN, which the kernel keeps for itself.
const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// The one namespace of an export.
const NSID: &str = "1";

/// statfs's `f_type` of configfs (`CONFIGFS_MAGIC`).
const CONFIGFS_MAGIC: i64 = 0x6265_6570;

/// The HMAC of DH-HMAC-CHAP: SHA-256, the one every host must offer.
const DHCHAP_HASH: &str = "hmac(sha256)";

/// No Diffie-Hellman exchange in DH-HMAC-CHAP. The exchange gives the
/// authentication forward secrecy, which matters for a secret that could
/// be guessed from a recorded exchange or for a TLS channel keyed from the
/// exchange; blockplane's secrets are 32 random bytes and its channel is
/// not keyed from it, so the exchange would cost every (re)connect a
/// modular exponentiation for nothing.
const DHCHAP_DHGROUP: &str = "null";

/// The longest `attr_serial` (`NVMET_SN_MAX_SIZE`) and `attr_model` the
/// kernel takes, in bytes.
const SERIAL_MAX: usize = 20;
const MODEL_MAX: usize = 40;

/// A part of the kernel the target needs that this host lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// configfs: not in the kernel, or not mounted and not mountable.
    Configfs,
    /// The `nvmet` module (the NVMe target).
    Nvmet,
    /// The `nvmet-tcp` module (the target's TCP transport).
    NvmetTcp,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Part::Configfs => {
                "configfs (the kernel's configuration filesystem at /sys/kernel/config)"
            }
            Part::Nvmet => "the nvmet kernel module (the NVMe target)",
            Part::NvmetTcp => "the nvmet-tcp kernel module (the NVMe target's TCP transport)",
        })
    }
}

/// What the target refused, or why it could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum NvmetError {
    /// The host lacks a part of the kernel the target needs.
    #[error("{what} is missing: {detail}")]
    Missing {
        /// Which part.
        what: Part,
        /// Why it is taken to be missing (what `modprobe` or `mount` said).
        detail: String,
    },
    /// A name that would become a path is not an NQN this module takes.
    #[error("{} is not a usable NQN: {why}", shown(.nqn))]
    BadNqn {
        /// The name given.
        nqn: String,
        /// The rule it breaks.
        why: &'static str,
    },
    /// A field of a subsystem's spec the kernel would refuse.
    #[error("subsystem {nqn}: its {field} {why}")]
    BadSpec {
        /// The subsystem.
        nqn: String,
        /// The field (`serial`, `model`, `device`).
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A subsystem names a host that has no `hosts/` entry yet.
    #[error(
        "subsystem {nqn} allows host {host}, which the target does not know: ensure the host first"
    )]
    NoSuchHost {
        /// The subsystem.
        nqn: String,
        /// The host NQN.
        host: String,
    },
    /// A subsystem names a port that does not exist.
    #[error(
        "subsystem {nqn} is to be served on port {port}, which does not exist: ensure the port first"
    )]
    NoSuchPort {
        /// The subsystem.
        nqn: String,
        /// The port.
        port: PortId,
    },
    /// The subsystem does not exist.
    #[error("there is no subsystem {nqn}")]
    NoSuchSubsystem {
        /// The subsystem.
        nqn: String,
    },
    /// The port serves a subsystem, so the kernel refuses to change its
    /// address (EACCES on `addr_*`).
    #[error("port {port} serves a subsystem, so the kernel refuses to change its address ({path})")]
    PortInUse {
        /// The port.
        port: PortId,
        /// The attribute refused.
        path: PathBuf,
    },
    /// The port's address is taken by another listener (EADDRINUSE when
    /// the first subsystem is linked and the kernel binds it).
    #[error("port {port} cannot listen on {addr}: the address is in use by another listener")]
    AddressInUse {
        /// The port.
        port: PortId,
        /// Its address, as configfs has it.
        addr: String,
    },
    /// The port's address is not one of this host's (EADDRNOTAVAIL).
    #[error("port {port} cannot listen on {addr}: no interface of this host has that address")]
    AddressNotHere {
        /// The port.
        port: PortId,
        /// Its address, as configfs has it.
        addr: String,
    },
    /// Linking a subsystem into a port failed because the kernel could not
    /// enable the port (EINVAL: its transport is not loaded, or its address
    /// is incomplete).
    #[error(
        "port {port} cannot be enabled for subsystem {nqn}: the kernel refused its transport or address (is nvmet-tcp loaded?)"
    )]
    PortRefused {
        /// The port.
        port: PortId,
        /// The subsystem being linked.
        nqn: String,
    },
    /// The namespace's device cannot change while it is enabled (EBUSY);
    /// this module disables it first, so another writer raced it.
    #[error(
        "namespace {path} is enabled, so the kernel refuses to change its device (another writer?)"
    )]
    NamespaceBusy {
        /// The attribute refused.
        path: PathBuf,
    },
    /// The kernel could not serve the device (enabling the namespace
    /// failed: no such device, or one opened exclusively elsewhere).
    #[error("subsystem {nqn}: the kernel cannot serve {} as its namespace: {source}", .device.display())]
    DeviceRefused {
        /// The subsystem.
        nqn: String,
        /// The device.
        device: PathBuf,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
    /// The device is read-only, and the kernel opens a namespace's device
    /// for writing (EACCES on `enable`): the 6.12 target has no read-only
    /// namespace.
    #[error("subsystem {nqn}: the kernel cannot serve {} as its namespace: it opens the device for writing, and the device is read-only", .device.display())]
    DeviceReadOnly {
        /// The subsystem.
        nqn: String,
        /// The device.
        device: PathBuf,
    },
    /// A size re-read was asked of a disabled namespace (EINVAL).
    #[error("subsystem {nqn}: its namespace is not enabled, so there is no size to re-read")]
    NamespaceDisabled {
        /// The subsystem.
        nqn: String,
    },
    /// The kernel cannot clear a host's controller key once set (it parses
    /// every write as a key), and none was given.
    #[error(
        "host {host} has a controller key the kernel cannot clear: remove the host from every subsystem and remove it, then ensure it again"
    )]
    CtrlKeyStays {
        /// The host NQN.
        host: String,
    },
    /// Any other failure of a configfs or debugfs call.
    #[error("cannot {op} {}: {source}", .path.display())]
    Io {
        /// The call (`mkdir`, `rmdir`, `write`, `read`, `link`, `unlink`, `chmod`).
        op: &'static str,
        /// Its path.
        path: PathBuf,
        /// The kernel's errno.
        #[source]
        source: io::Error,
    },
}

impl NvmetError {
    fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        NvmetError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A name for a message: escaped, and cut after 80 characters.
fn shown(name: &str) -> String {
    let mut s: String = name.chars().take(80).collect();
    if s.len() < name.len() {
        s.push('…');
    }
    format!("{s:?}")
}

/// Checks that `nqn` may name a host or subsystem here: at most 223 bytes,
/// starting `nqn.`, printable ASCII without space, `/` (it becomes a
/// configfs directory name) or `,` (the initiator's option string
/// separates its fields with commas). NVMe allows UTF-8 in NQNs; blockplane
/// makes its own and takes hosts' from operators, so it keeps to the
/// subset every tool prints and parses alike.
pub fn check_nqn(nqn: &str) -> Result<(), NvmetError> {
    let bad = |why| {
        Err(NvmetError::BadNqn {
            nqn: nqn.to_string(),
            why,
        })
    };
    if nqn.len() > NQN_MAX {
        return bad("it is longer than 223 bytes");
    }
    if !nqn.starts_with("nqn.") {
        return bad("it does not start with \"nqn.\"");
    }
    if nqn.contains('/') {
        return bad("it contains '/'");
    }
    if nqn.contains(',') {
        return bad("it contains ',', which separates the initiator's options");
    }
    if !nqn.bytes().all(|b| b.is_ascii_graphic()) {
        return bad(
            "it contains a byte that is not printable ASCII (a space, NUL, control or non-ASCII character)",
        );
    }
    Ok(())
}

/// [`check_nqn`], and not the discovery subsystem's NQN, which the kernel
/// refuses as a subsystem's name.
fn check_subsystem_nqn(nqn: &str) -> Result<(), NvmetError> {
    check_nqn(nqn)?;
    if nqn == DISCOVERY_NQN {
        return Err(NvmetError::BadNqn {
            nqn: nqn.to_string(),
            why: "it is the discovery subsystem's NQN",
        });
    }
    Ok(())
}

/// An address to listen on (the target) or connect to (the initiator):
/// an IP address and a TCP port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenAddr {
    /// The IP address.
    pub ip: IpAddr,
    /// The TCP port.
    pub port: u16,
}

impl ListenAddr {
    /// Whether the address is a loopback one (reachable from this host
    /// only).
    pub fn is_loopback(&self) -> bool {
        self.ip.is_loopback()
    }

    /// Its configfs `addr_adrfam`.
    fn adrfam(&self) -> &'static str {
        match self.ip {
            IpAddr::V4(_) => "ipv4",
            IpAddr::V6(_) => "ipv6",
        }
    }
}

impl fmt::Display for ListenAddr {
    /// `1.2.3.4:4420`, `[::1]:4420`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        SocketAddr::new(self.ip, self.port).fmt(f)
    }
}

/// A listen address that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("{} is not a listen address: give IP:PORT, [IPv6]:PORT, or an IP alone for port 4420 (port 0 is not one)", shown(.text))]
pub struct ListenAddrError {
    /// The text given.
    pub text: String,
}

/// An IP address alone: `1.2.3.4`, `::1`, or an IPv6 address in brackets.
fn bare_ip(s: &str) -> Result<IpAddr, std::net::AddrParseError> {
    match s.strip_prefix('[').and_then(|v6| v6.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().map(IpAddr::V6),
        None => s.parse::<IpAddr>(),
    }
}

impl FromStr for ListenAddr {
    type Err = ListenAddrError;

    /// `1.2.3.4:4420`, `[::1]:4420`, or an IP alone (`1.2.3.4`, `::1`,
    /// `[::1]`) for port 4420.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let addr = match s.parse::<SocketAddr>() {
            Ok(sa) => ListenAddr {
                ip: sa.ip(),
                port: sa.port(),
            },
            Err(_) => match bare_ip(s) {
                Ok(ip) => ListenAddr {
                    ip,
                    port: DEFAULT_PORT,
                },
                Err(_) => return Err(ListenAddrError { text: s.into() }),
            },
        };
        if addr.port == 0 {
            return Err(ListenAddrError { text: s.into() });
        }
        Ok(addr)
    }
}

/// A port of the target: a directory `ports/<id>` (a 16-bit number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortId(pub u16);

impl fmt::Display for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What an export is to be: the target converges on it
/// ([`Target::ensure_subsystem`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubsystemSpec {
    /// The subsystem's NQN.
    pub nqn: String,
    /// Its serial number (`attr_serial`, at most 20 printable ASCII
    /// bytes), written only when the subsystem is made.
    pub serial: String,
    /// Its model (`attr_model`, at most 40 printable ASCII bytes), written
    /// only when the subsystem is made.
    pub model: String,
    /// The block device namespace 1 serves.
    pub device: PathBuf,
    /// Namespace 1's UUID (`device_uuid`): what the initiator's
    /// `/sys/block/nvmeXnY/uuid` shows, to tell the namespace by.
    pub uuid: uuid::Uuid,
    /// The host NQNs allowed to connect, exactly (each made with
    /// [`Target::ensure_host`] first); none with `allow_any_host`.
    pub hosts: Vec<String>,
    /// Any host that reaches a port may connect, without authentication
    /// (an export on loopback only, asked for by name).
    pub allow_any_host: bool,
    /// The ports it is served on, exactly (each made with
    /// [`Target::ensure_port`] first).
    pub ports: Vec<PortId>,
}

/// A namespace as configfs has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceState {
    /// Its namespace id.
    pub nsid: u32,
    /// Its `device_path`, if set.
    pub device: Option<PathBuf>,
    /// Its `device_uuid`, if it reads as one.
    pub uuid: Option<uuid::Uuid>,
    /// Whether it is enabled (served).
    pub enabled: bool,
}

/// A subsystem as configfs has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubsystemState {
    /// Its NQN.
    pub nqn: String,
    /// Whether any host may connect (never, for one made here).
    pub allow_any_host: bool,
    /// Its namespaces, by nsid.
    pub namespaces: Vec<NamespaceState>,
    /// The hosts in its `allowed_hosts`, sorted.
    pub hosts: Vec<String>,
    /// The ports that link to it, sorted.
    pub ports: Vec<PortId>,
}

impl SubsystemState {
    /// Namespace 1, the one an export has.
    pub fn namespace(&self) -> Option<&NamespaceState> {
        self.namespaces.iter().find(|n| n.nsid == 1)
    }
}

/// A port as configfs has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortState {
    /// Its id.
    pub id: PortId,
    /// Its address, when it is a TCP port with an IP address and port;
    /// `None` for another transport or an address not yet written.
    pub addr: Option<ListenAddr>,
    /// The subsystems linked into it (served on it), sorted.
    pub subsystems: Vec<String>,
}

/// What [`Target::remove_host`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRemoval {
    /// The host's entry is gone.
    Removed,
    /// There was no entry.
    Absent,
    /// Subsystems still allow it, so it stays; these are they.
    InUse {
        /// The subsystems whose `allowed_hosts` link to it.
        subsystems: Vec<String>,
    },
}

/// The kernel's NVMe target, at its configfs tree.
#[derive(Debug, Clone)]
pub struct Target {
    root: PathBuf,
    debug: Option<PathBuf>,
}

impl Target {
    /// The host's target. Loads `nvmet` and `nvmet-tcp` with `modprobe`
    /// where they are not loaded, and mounts configfs at
    /// `/sys/kernel/config` where it is not mounted (a container's own
    /// sysfs has it unmounted, and configfs is one tree for the whole
    /// host, so mounting it shows the host's configuration, not a new
    /// one). Nothing else is mounted: debugfs, which says who is connected
    /// ([`Target::connected_hosts`]), is read only where the host mounted
    /// it. Fails with [`NvmetError::Missing`] naming the part missing.
    pub fn open() -> Result<Target, NvmetError> {
        // nvmet first: where configfs is itself a module, nvmet loads it.
        let nvmet_there = Path::new(ROOT).is_dir() || kmod::is_loaded("nvmet");
        if !nvmet_there {
            kmod::load("nvmet").map_err(|detail| NvmetError::Missing {
                what: Part::Nvmet,
                detail,
            })?;
        }
        kmod::load("nvmet-tcp").map_err(|detail| NvmetError::Missing {
            what: Part::NvmetTcp,
            detail,
        })?;
        mount_configfs()?;
        if !Path::new(ROOT).is_dir() {
            return Err(NvmetError::Missing {
                what: Part::Nvmet,
                detail: format!("{ROOT} does not exist with configfs mounted"),
            });
        }
        Ok(Target {
            root: ROOT.into(),
            debug: Some(DEBUGFS.into()),
        })
    }

    /// A target whose configfs tree is at `root` (tests; a configfs
    /// mounted elsewhere), with no debugfs to read.
    pub fn at(root: impl Into<PathBuf>) -> Target {
        Target {
            root: root.into(),
            debug: None,
        }
    }

    /// The same target, reading who is connected from the nvmet
    /// directory of debugfs at `dir`.
    pub fn with_debugfs(self, dir: impl Into<PathBuf>) -> Target {
        Target {
            debug: Some(dir.into()),
            ..self
        }
    }

    /// Its configfs tree.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn host_dir(&self, host: &str) -> PathBuf {
        self.root.join("hosts").join(host)
    }

    fn subsystem_dir(&self, nqn: &str) -> PathBuf {
        self.root.join("subsystems").join(nqn)
    }

    fn namespace_dir(&self, nqn: &str) -> PathBuf {
        self.subsystem_dir(nqn).join("namespaces").join(NSID)
    }

    fn port_dir(&self, port: PortId) -> PathBuf {
        self.root.join("ports").join(port.0.to_string())
    }

    /// The link that serves `nqn` on `port`.
    fn port_link(&self, port: PortId, nqn: &str) -> PathBuf {
        self.port_dir(port).join("subsystems").join(nqn)
    }

    /// The TCP port listening on `addr`: one already there whose
    /// `addr_trtype`, `addr_adrfam`, `addr_traddr` and `addr_trsvcid` say
    /// so, else a new one at the lowest free id from 1, its address
    /// written before anything links into it (the kernel refuses a change
    /// of address once a subsystem is linked, and the first link is what
    /// binds the listener).
    pub fn ensure_port(&self, addr: &ListenAddr) -> Result<PortId, NvmetError> {
        let ports = self.ports()?;
        if let Some(p) = ports.iter().find(|p| p.addr.as_ref() == Some(addr)) {
            return Ok(p.id);
        }
        let mut taken: Vec<u16> = ports.iter().map(|p| p.id.0).collect();
        loop {
            let Some(id) = (1..=u16::MAX).find(|i| !taken.contains(i)) else {
                return Err(NvmetError::io(
                    "mkdir",
                    &self.root.join("ports"),
                    io::Error::other("every port id is taken"),
                ));
            };
            let port = PortId(id);
            let dir = self.port_dir(port);
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                // Made meanwhile by another writer: the next id.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    taken.push(id);
                    continue;
                }
                Err(e) => return Err(NvmetError::io("mkdir", &dir, e)),
            }
            let written = self.write_port_addr(port, addr);
            if let Err(e) = written {
                // Nothing links to a port just made: it goes, rather than
                // stay as a port without an address.
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
            return Ok(port);
        }
    }

    fn write_port_addr(&self, port: PortId, addr: &ListenAddr) -> Result<(), NvmetError> {
        let dir = self.port_dir(port);
        for (name, value) in [
            ("addr_trtype", "tcp".to_string()),
            ("addr_adrfam", addr.adrfam().to_string()),
            ("addr_traddr", addr.ip.to_string()),
            ("addr_trsvcid", addr.port.to_string()),
        ] {
            let path = dir.join(name);
            write_attr(&path, value.as_bytes()).map_err(|e| {
                if e.raw_os_error() == Some(libc::EACCES) && rustix::process::geteuid().is_root() {
                    NvmetError::PortInUse { port, path }
                } else {
                    NvmetError::io("write", &path, e)
                }
            })?;
        }
        Ok(())
    }

    /// Makes `hosts/<host_nqn>` if missing, private to root, and writes
    /// its keys: `key`, which the host proves it has, and `ctrl_key`, which
    /// the target proves it has (bidirectional authentication), with
    /// HMAC-SHA-256 and no DH group. Writing a new key is rotation: the
    /// kernel checks it at the host's next authentication, and sessions
    /// already made stay. A `ctrl_key` of `None` where one is set is
    /// [`NvmetError::CtrlKeyStays`]: the kernel has no way to clear it.
    pub fn ensure_host(
        &self,
        host_nqn: &str,
        key: &Secret,
        ctrl_key: Option<&Secret>,
    ) -> Result<(), NvmetError> {
        check_nqn(host_nqn)?;
        let dir = self.host_dir(host_nqn);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(NvmetError::io("mkdir", &dir, e)),
        }
        // The key files are 0644 and print the key: the directory is
        // closed to all but root before any key is in it.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| NvmetError::io("chmod", &dir, e))?;
        self.write(&dir.join("dhchap_hash"), DHCHAP_HASH.as_bytes())?;
        self.write(&dir.join("dhchap_dhgroup"), DHCHAP_DHGROUP.as_bytes())?;
        self.write(&dir.join("dhchap_key"), key.expose().as_bytes())?;
        let ctrl_path = dir.join("dhchap_ctrl_key");
        match ctrl_key {
            Some(k) => self.write(&ctrl_path, k.expose().as_bytes()),
            None => {
                // Read only to learn whether one is set; wiped after.
                let now = zeroize::Zeroizing::new(
                    std::fs::read(&ctrl_path).map_err(|e| NvmetError::io("read", &ctrl_path, e))?,
                );
                if now.iter().any(|b| !b.is_ascii_whitespace()) {
                    return Err(NvmetError::CtrlKeyStays {
                        host: host_nqn.to_string(),
                    });
                }
                Ok(())
            }
        }
    }

    /// Removes `hosts/<host_nqn>` unless a subsystem's `allowed_hosts`
    /// still links to it (configfs would refuse; this says which do).
    /// Sessions the host has stay until their subsystem stops serving it.
    pub fn remove_host(&self, host_nqn: &str) -> Result<HostRemoval, NvmetError> {
        check_nqn(host_nqn)?;
        let dir = self.host_dir(host_nqn);
        if !dir.exists() {
            return Ok(HostRemoval::Absent);
        }
        let mut subsystems = Vec::new();
        for nqn in self.names(&self.root.join("subsystems"))? {
            let link = self
                .subsystem_dir(&nqn)
                .join("allowed_hosts")
                .join(host_nqn);
            if link.symlink_metadata().is_ok() {
                subsystems.push(nqn);
            }
        }
        if !subsystems.is_empty() {
            return Ok(HostRemoval::InUse { subsystems });
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(HostRemoval::Removed),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(HostRemoval::Absent),
            Err(e) => Err(NvmetError::io("rmdir", &dir, e)),
        }
    }

    /// Makes the subsystem what `spec` says, from whatever configfs holds
    /// (nothing, a half-made one, an older one), in the kernel's order:
    ///
    /// 1. the subsystem, if missing, with `attr_allow_any_host=0` first
    ///    (the kernel authenticates only hosts of a subsystem that lists
    ///    them) and its serial and model (only at creation: the kernel
    ///    refuses them once a host has identified it); then
    ///    `attr_allow_any_host` as `allow_any_host` says;
    /// 2. `allowed_hosts` made exactly `hosts` (a host removed keeps its
    ///    session until it reconnects: the kernel checks the list at
    ///    connect only);
    /// 3. namespace 1: `device_path`, then `device_uuid`, then `enable=1`
    ///    last (the kernel refuses a device change while enabled, so one
    ///    enabled on another device or UUID is disabled, rewritten and
    ///    enabled again — and the I/O its hosts have in flight or send
    ///    meanwhile fails with EIO, as the 6.12 VM probe saw: a device that
    ///    must change under a consumer should be one whose table changes,
    ///    a dm node, rather than a new `device_path`);
    /// 4. links from exactly `ports`, new ones before old ones go. The first
    ///    link into a port starts its listener, in the network namespace
    ///    of this process (an address of another namespace is
    ///    [`NvmetError::AddressNotHere`]). Unlinking a port ends that
    ///    port's sessions of this subsystem: where the port still listens
    ///    (another subsystem keeps it), the hosts' reconnects are told the
    ///    subsystem is not there and they delete their controllers at once
    ///    (the VM probe, 6.12); where the port stops listening, they
    ///    reconnect until their loss timeout.
    pub fn ensure_subsystem(&self, spec: &SubsystemSpec) -> Result<(), NvmetError> {
        let nqn = spec.nqn.as_str();
        check_subsystem_nqn(nqn)?;
        check_text(nqn, "serial", &spec.serial, SERIAL_MAX)?;
        check_text(nqn, "model", &spec.model, MODEL_MAX)?;
        check_device(nqn, &spec.device)?;
        for host in &spec.hosts {
            check_nqn(host)?;
            if !self.host_dir(host).is_dir() {
                return Err(NvmetError::NoSuchHost {
                    nqn: nqn.into(),
                    host: host.clone(),
                });
            }
        }
        for &port in &spec.ports {
            if !self.port_dir(port).is_dir() {
                return Err(NvmetError::NoSuchPort {
                    nqn: nqn.into(),
                    port,
                });
            }
        }

        let dir = self.subsystem_dir(nqn);
        match std::fs::create_dir(&dir) {
            Ok(()) => {
                let made = self
                    .write(&dir.join("attr_allow_any_host"), b"0")
                    .and_then(|()| self.write(&dir.join("attr_serial"), spec.serial.as_bytes()))
                    .and_then(|()| self.write(&dir.join("attr_model"), spec.model.as_bytes()));
                if let Err(e) = made {
                    // Nothing links to it yet: it goes, so that the next
                    // try makes it (and writes its serial) afresh.
                    let _ = std::fs::remove_dir(&dir);
                    return Err(e);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(NvmetError::io("mkdir", &dir, e)),
        }
        // The kernel refuses a host link while any host may connect, and
        // the reverse: the links go before the flag turns on, and come
        // after it turns off.
        let any = dir.join("attr_allow_any_host");
        let want: &[u8] = if spec.allow_any_host { b"1" } else { b"0" };
        if spec.allow_any_host {
            self.converge_hosts(&dir, &[])?;
        }
        if read_attr(&any)?.as_bytes() != want {
            self.write(&any, want)?;
        }
        self.converge_hosts(&dir, &spec.hosts)?;
        self.converge_namespace(spec)?;
        self.converge_ports(nqn, &spec.ports)
    }

    fn converge_hosts(&self, dir: &Path, hosts: &[String]) -> Result<(), NvmetError> {
        let allowed = dir.join("allowed_hosts");
        let now = self.names(&allowed)?;
        for host in now.iter().filter(|h| !hosts.contains(h)) {
            let link = allowed.join(host);
            unlink(&link)?;
        }
        for host in hosts.iter().filter(|h| !now.contains(h)) {
            let link = allowed.join(host);
            symlink(&self.host_dir(host), &link)?;
        }
        Ok(())
    }

    fn converge_namespace(&self, spec: &SubsystemSpec) -> Result<(), NvmetError> {
        let nqn = spec.nqn.as_str();
        let ns = self.namespace_dir(nqn);
        match std::fs::create_dir(&ns) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(NvmetError::io("mkdir", &ns, e)),
        }
        let state = read_namespace(&ns, 1)?;
        let want_device = spec.device.as_path();
        let same_device = state.device.as_deref() == Some(want_device);
        let same_uuid = state.uuid == Some(spec.uuid);
        if state.enabled && same_device && same_uuid {
            return Ok(());
        }
        if state.enabled {
            self.write(&ns.join("enable"), b"0")?;
        }
        let busy = |path: PathBuf| {
            move |e: io::Error| {
                if e.raw_os_error() == Some(libc::EBUSY) {
                    NvmetError::NamespaceBusy { path }
                } else {
                    NvmetError::io("write", &path, e)
                }
            }
        };
        if !same_device {
            let path = ns.join("device_path");
            write_attr(&path, want_device.as_os_str().as_bytes()).map_err(busy(path))?;
        }
        if !same_uuid {
            let path = ns.join("device_uuid");
            let text = spec.uuid.hyphenated().to_string();
            write_attr(&path, text.as_bytes()).map_err(busy(path))?;
        }
        write_attr(&ns.join("enable"), b"1").map_err(|source| {
            if source.raw_os_error() == Some(libc::EACCES) {
                NvmetError::DeviceReadOnly {
                    nqn: nqn.into(),
                    device: spec.device.clone(),
                }
            } else {
                NvmetError::DeviceRefused {
                    nqn: nqn.into(),
                    device: spec.device.clone(),
                    source,
                }
            }
        })
    }

    fn converge_ports(&self, nqn: &str, ports: &[PortId]) -> Result<(), NvmetError> {
        let now = self.ports_of(nqn)?;
        for &port in ports.iter().filter(|p| !now.contains(p)) {
            let link = self.port_link(port, nqn);
            let Err(e) = std::os::unix::fs::symlink(self.subsystem_dir(nqn), &link) else {
                continue;
            };
            let addr = || {
                self.port_addr(port)
                    .map_or_else(|| "its address".to_string(), |a| a.to_string())
            };
            // The first link into a port binds its listener: the errors of
            // the bind come back from the link.
            let refused = match e.raw_os_error() {
                // Linked meanwhile by another writer.
                Some(libc::EEXIST) => continue,
                Some(libc::EADDRINUSE) => NvmetError::AddressInUse { port, addr: addr() },
                Some(libc::EADDRNOTAVAIL) => NvmetError::AddressNotHere { port, addr: addr() },
                Some(libc::EINVAL) => NvmetError::PortRefused {
                    port,
                    nqn: nqn.into(),
                },
                _ => NvmetError::io("link", &link, e),
            };
            return Err(refused);
        }
        for &port in now.iter().filter(|p| !ports.contains(p)) {
            unlink(&self.port_link(port, nqn))?;
        }
        Ok(())
    }

    /// Has the kernel re-read the size of the subsystem's device
    /// (`revalidate_size`), after the device grew: a changed size is sent
    /// to every connected host as a namespace-changed event.
    pub fn revalidate(&self, nqn: &str) -> Result<(), NvmetError> {
        check_subsystem_nqn(nqn)?;
        let path = self.namespace_dir(nqn).join("revalidate_size");
        write_attr(&path, b"1").map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => NvmetError::NoSuchSubsystem { nqn: nqn.into() },
            Some(libc::EINVAL) => NvmetError::NamespaceDisabled { nqn: nqn.into() },
            _ => NvmetError::io("write", &path, e),
        })
    }

    /// Removes the subsystem, in the reverse of the order it was made:
    /// its port links (which ends its hosts' sessions: see
    /// [`Target::ensure_subsystem`], step 4), its namespaces (disabled, then
    /// removed), its `allowed_hosts` links, then itself. The ports and
    /// hosts stay ([`Target::remove_port_if_unused`],
    /// [`Target::remove_host`]). One already gone is not an error.
    pub fn remove_subsystem(&self, nqn: &str) -> Result<(), NvmetError> {
        check_subsystem_nqn(nqn)?;
        let dir = self.subsystem_dir(nqn);
        if !dir.exists() {
            return Ok(());
        }
        for port in self.ports_of(nqn)? {
            unlink(&self.port_link(port, nqn))?;
        }
        let namespaces = dir.join("namespaces");
        for ns in self.names(&namespaces)? {
            let ns = namespaces.join(ns);
            // The rmdir disables it too; the write first drains it as
            // the kernel's own order does, and a failure of it leaves
            // the rmdir to say what is wrong.
            let _ = write_attr(&ns.join("enable"), b"0");
            rmdir(&ns)?;
        }
        let allowed = dir.join("allowed_hosts");
        for host in self.names(&allowed)? {
            unlink(&allowed.join(host))?;
        }
        rmdir(&dir)
    }

    /// Removes the port unless a subsystem is linked into it: `true` when
    /// it is gone (or was), `false` when it still serves one.
    pub fn remove_port_if_unused(&self, port: PortId) -> Result<bool, NvmetError> {
        let dir = self.port_dir(port);
        if !dir.exists() {
            return Ok(true);
        }
        if !self.names(&dir.join("subsystems"))?.is_empty() {
            return Ok(false);
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(NvmetError::io("rmdir", &dir, e)),
        }
    }

    /// Every subsystem configfs holds, blockplane's or not, sorted by NQN:
    /// what the kernel serves, for reconciliation at start.
    pub fn subsystems(&self) -> Result<Vec<SubsystemState>, NvmetError> {
        let mut served: BTreeMap<String, Vec<PortId>> = BTreeMap::new();
        for port in self.ports()? {
            for nqn in port.subsystems {
                served.entry(nqn).or_default().push(port.id);
            }
        }
        let mut out = Vec::new();
        for nqn in self.names(&self.root.join("subsystems"))? {
            let dir = self.subsystem_dir(&nqn);
            let namespaces_dir = dir.join("namespaces");
            let mut namespaces = Vec::new();
            for ns in self.names(&namespaces_dir)? {
                let Ok(nsid) = ns.parse() else { continue };
                namespaces.push(read_namespace(&namespaces_dir.join(&ns), nsid)?);
            }
            namespaces.sort_by_key(|n| n.nsid);
            let mut ports = served.remove(&nqn).unwrap_or_default();
            ports.sort();
            out.push(SubsystemState {
                allow_any_host: read_attr(&dir.join("attr_allow_any_host"))? == "1",
                namespaces,
                hosts: self.names(&dir.join("allowed_hosts"))?,
                ports,
                nqn,
            });
        }
        Ok(out)
    }

    /// Every port configfs holds, sorted by id.
    pub fn ports(&self) -> Result<Vec<PortState>, NvmetError> {
        let mut out = Vec::new();
        for name in self.names(&self.root.join("ports"))? {
            let Ok(id) = name.parse() else { continue };
            let id = PortId(id);
            out.push(PortState {
                id,
                addr: self.port_addr(id),
                subsystems: self.names(&self.port_dir(id).join("subsystems"))?,
            });
        }
        out.sort_by_key(|p| p.id);
        Ok(out)
    }

    /// Every host configfs holds, sorted.
    pub fn hosts(&self) -> Result<Vec<String>, NvmetError> {
        self.names(&self.root.join("hosts"))
    }

    /// The port's address, when it is a TCP port whose address reads as
    /// one.
    fn port_addr(&self, port: PortId) -> Option<ListenAddr> {
        let dir = self.port_dir(port);
        let attr = |name: &str| read_attr(&dir.join(name)).ok();
        if attr("addr_trtype")? != "tcp" {
            return None;
        }
        let addr = ListenAddr {
            ip: attr("addr_traddr")?.parse().ok()?,
            port: attr("addr_trsvcid")?.parse().ok()?,
        };
        (attr("addr_adrfam")? == addr.adrfam()).then_some(addr)
    }

    /// The ports that link to subsystem `nqn`, sorted.
    fn ports_of(&self, nqn: &str) -> Result<Vec<PortId>, NvmetError> {
        Ok(self
            .ports()?
            .into_iter()
            .filter(|p| p.subsystems.iter().any(|s| s == nqn))
            .map(|p| p.id)
            .collect())
    }

    /// The host NQNs of the controllers connected to subsystem `nqn`
    /// (sorted, each once), read from debugfs
    /// (`/sys/kernel/debug/nvmet/<nqn>/ctrl<id>/hostnqn`). `None` when the
    /// kernel offers no way to tell: debugfs not mounted at
    /// `/sys/kernel/debug` (this module does not mount it), a kernel built
    /// without `CONFIG_NVME_TARGET_DEBUGFS` (Debian's 6.12 and 7.3 both
    /// are: the VM probe found no `/sys/kernel/debug/nvmet` on either, so
    /// there this is always `None`), or a subsystem with no
    /// debugfs directory. configfs itself never says who is connected.
    pub fn connected_hosts(&self, nqn: &str) -> Result<Option<Vec<String>>, NvmetError> {
        check_subsystem_nqn(nqn)?;
        let Some(debug) = &self.debug else {
            return Ok(None);
        };
        if !debug.is_dir() {
            return Ok(None);
        }
        let dir = debug.join(nqn);
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // No subsystem, no hosts; a subsystem without a
                // directory is one the kernel does not report on.
                return Ok((!self.subsystem_dir(nqn).exists()).then(Vec::new));
            }
            Err(e) => return Err(NvmetError::io("read", &dir, e)),
        };
        let mut hosts = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| NvmetError::io("read", &dir, e))?;
            let name = entry.file_name();
            if !name.as_bytes().starts_with(b"ctrl") {
                continue;
            }
            let path = entry.path().join("hostnqn");
            match std::fs::read_to_string(&path) {
                Ok(h) => hosts.push(h.trim().to_string()),
                // A controller that went meanwhile.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(NvmetError::io("read", &path, e)),
            }
        }
        hosts.sort();
        hosts.dedup();
        Ok(Some(hosts))
    }

    /// The names in a configfs directory, sorted; none when it is absent.
    fn names(&self, dir: &Path) -> Result<Vec<String>, NvmetError> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(NvmetError::io("read", dir, e)),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| NvmetError::io("read", dir, e))?;
            if let Ok(name) = entry.file_name().into_string() {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn write(&self, path: &Path, value: &[u8]) -> Result<(), NvmetError> {
        write_attr(path, value).map_err(|e| NvmetError::io("write", path, e))
    }
}

/// Mounts configfs at [`CONFIGFS`] unless it is mounted there.
fn mount_configfs() -> Result<(), NvmetError> {
    let missing = |detail: String| NvmetError::Missing {
        what: Part::Configfs,
        detail,
    };
    match rustix::fs::statfs(CONFIGFS) {
        #[allow(clippy::unnecessary_cast)] // f_type's type differs by architecture
        Ok(fs) if fs.f_type as i64 == CONFIGFS_MAGIC => Ok(()),
        Ok(_) => rustix::mount::mount(
            "configfs",
            CONFIGFS,
            "configfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .map_err(|e| {
            missing(format!(
                "{CONFIGFS} is not a configfs mount, and mounting one there failed: {e}"
            ))
        }),
        Err(e) => Err(missing(format!(
            "{CONFIGFS} cannot be looked at ({e}): the kernel has no configfs"
        ))),
    }
}

/// Checks a text attribute: printable ASCII, at most `max` bytes.
fn check_text(nqn: &str, field: &'static str, text: &str, max: usize) -> Result<(), NvmetError> {
    let why = if text.is_empty() {
        "is empty".to_string()
    } else if text.len() > max {
        format!("is {} bytes; the kernel takes at most {max}", text.len())
    } else if !text.bytes().all(|b| b == b' ' || b.is_ascii_graphic()) {
        "has a byte that is not printable ASCII".to_string()
    } else {
        return Ok(());
    };
    Err(NvmetError::BadSpec {
        nqn: nqn.into(),
        field,
        why,
    })
}

/// Checks a device path: absolute, and without a newline (the kernel cuts
/// `device_path` at the first one) or NUL.
fn check_device(nqn: &str, device: &Path) -> Result<(), NvmetError> {
    let bytes = device.as_os_str().as_bytes();
    let why = if !device.is_absolute() {
        "is not an absolute path"
    } else if bytes.iter().any(|&b| b == b'\n' || b == 0) {
        "contains a newline or NUL"
    } else if bytes.len() >= libc::PATH_MAX as usize {
        "is longer than a path may be"
    } else {
        return Ok(());
    };
    Err(NvmetError::BadSpec {
        nqn: nqn.into(),
        field: "device",
        why: why.into(),
    })
}

/// A namespace directory's state.
fn read_namespace(dir: &Path, nsid: u32) -> Result<NamespaceState, NvmetError> {
    let path = read_attr(&dir.join("device_path"))?;
    // An unset path reads as empty or as "(null)", which no device is.
    let device = (path.starts_with('/')).then(|| PathBuf::from(path));
    Ok(NamespaceState {
        nsid,
        device,
        uuid: read_attr(&dir.join("device_uuid"))?.parse().ok(),
        enabled: read_attr(&dir.join("enable"))? == "1",
    })
}

/// An attribute's value, without the newline the kernel ends it with.
fn read_attr(path: &Path) -> Result<String, NvmetError> {
    let text = std::fs::read_to_string(path).map_err(|e| NvmetError::io("read", path, e))?;
    Ok(text.trim_end_matches(['\n', ' ']).to_string())
}

/// Writes an attribute in one `write(2)`, as configfs takes it: the
/// kernel parses each write whole.
fn write_attr(path: &Path, value: &[u8]) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    let n = f.write(value)?;
    if n != value.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("the kernel took {n} of {} bytes", value.len()),
        ));
    }
    Ok(())
}

fn symlink(target: &Path, link: &Path) -> Result<(), NvmetError> {
    match std::os::unix::fs::symlink(target, link) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(NvmetError::io("link", link, e)),
    }
}

fn unlink(link: &Path) -> Result<(), NvmetError> {
    match std::fs::remove_file(link) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NvmetError::io("unlink", link, e)),
    }
}

fn rmdir(dir: &Path) -> Result<(), NvmetError> {
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NvmetError::io("rmdir", dir, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6a1e3d9c-1234-4a5b-9c0d-0123456789ab";

    #[test]
    fn nqns_are_checked_before_they_become_paths() {
        check_nqn(HOST).unwrap();
        check_nqn("nqn.2024-01.io.blockplane:host-a:vol-1").unwrap();
        let longest = format!("nqn.{}", "a".repeat(NQN_MAX - 4));
        check_nqn(&longest).unwrap();
        for (nqn, why) in [
            (format!("{longest}a"), "223 bytes"),
            ("iqn.2024-01.io.blockplane:x".into(), "\"nqn.\""),
            ("".into(), "\"nqn.\""),
            ("nqn.2024-01.io.blockplane:../x".into(), "'/'"),
            ("nqn.2024-01.io.blockplane:a/b".into(), "'/'"),
            ("nqn.2024-01.io.blockplane:a,b".into(), "','"),
            ("nqn.2024-01.io.blockplane:a b".into(), "printable"),
            ("nqn.2024-01.io.blockplane:a\0b".into(), "printable"),
            ("nqn.2024-01.io.blockplane:a\nb".into(), "printable"),
            ("nqn.2024-01.io.blockplane:é".into(), "printable"),
        ] {
            let e = check_nqn(&nqn).unwrap_err();
            assert!(matches!(e, NvmetError::BadNqn { .. }), "{e}");
            assert!(e.to_string().contains(why), "{nqn:?}: {e}");
        }
        let e = check_subsystem_nqn(DISCOVERY_NQN).unwrap_err();
        assert!(e.to_string().contains("discovery"), "{e}");
        // A long name is cut in the message, and escaped.
        let e = check_nqn(&"x\n".repeat(500)).unwrap_err().to_string();
        assert!(e.len() < 300 && !e.contains('\n'), "{e}");
    }

    #[test]
    fn listen_addresses_parse_and_print() {
        for (text, ip, port, shown) in [
            ("1.2.3.4:4420", "1.2.3.4", 4420, "1.2.3.4:4420"),
            ("10.0.0.1:5000", "10.0.0.1", 5000, "10.0.0.1:5000"),
            ("[::1]:4420", "::1", 4420, "[::1]:4420"),
            ("[fd00::7]:4421", "fd00::7", 4421, "[fd00::7]:4421"),
            ("1.2.3.4", "1.2.3.4", 4420, "1.2.3.4:4420"),
            ("::1", "::1", 4420, "[::1]:4420"),
            ("[::1]", "::1", 4420, "[::1]:4420"),
            ("0.0.0.0", "0.0.0.0", 4420, "0.0.0.0:4420"),
        ] {
            let a: ListenAddr = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(a.ip, ip.parse::<IpAddr>().unwrap(), "{text}");
            assert_eq!(a.port, port, "{text}");
            assert_eq!(a.to_string(), shown);
            assert_eq!(shown.parse::<ListenAddr>().unwrap(), a);
        }
        for text in [
            "",
            "host:4420",
            "1.2.3.4:",
            "1.2.3.4:0",
            "1.2.3.4:70000",
            "::1:4420:x",
            "[1.2.3.4]",
            "1.2.3",
        ] {
            let e = text.parse::<ListenAddr>().unwrap_err();
            assert!(
                e.to_string().contains("not a listen address"),
                "{text}: {e}"
            );
        }
        assert!("127.0.0.1".parse::<ListenAddr>().unwrap().is_loopback());
        assert!("[::1]:1".parse::<ListenAddr>().unwrap().is_loopback());
        assert!(!"10.0.0.1".parse::<ListenAddr>().unwrap().is_loopback());
        assert_eq!("10.0.0.1".parse::<ListenAddr>().unwrap().adrfam(), "ipv4");
        assert_eq!("::1".parse::<ListenAddr>().unwrap().adrfam(), "ipv6");
    }

    #[test]
    fn paths_are_built_under_the_root() {
        let t = Target::at("/cfg/nvmet");
        let nqn = "nqn.2024-01.io.blockplane:i:v";
        assert_eq!(t.root(), Path::new("/cfg/nvmet"));
        assert_eq!(t.host_dir(HOST), Path::new("/cfg/nvmet/hosts").join(HOST));
        assert_eq!(
            t.subsystem_dir(nqn),
            Path::new("/cfg/nvmet/subsystems/nqn.2024-01.io.blockplane:i:v")
        );
        assert_eq!(
            t.namespace_dir(nqn),
            Path::new("/cfg/nvmet/subsystems/nqn.2024-01.io.blockplane:i:v/namespaces/1")
        );
        assert_eq!(t.port_dir(PortId(3)), Path::new("/cfg/nvmet/ports/3"));
        assert_eq!(
            t.port_link(PortId(3), nqn),
            Path::new("/cfg/nvmet/ports/3/subsystems/nqn.2024-01.io.blockplane:i:v")
        );
        assert_eq!(PortId(12).to_string(), "12");
    }

    #[test]
    fn a_bad_name_is_refused_before_any_path_is_touched() {
        // A root that does not exist: only the checks can answer.
        let t = Target::at("/nonexistent/nvmet");
        let bad = "nqn.x/../../../etc";
        assert!(matches!(
            t.remove_subsystem(bad),
            Err(NvmetError::BadNqn { .. })
        ));
        assert!(matches!(t.remove_host(bad), Err(NvmetError::BadNqn { .. })));
        assert!(matches!(t.revalidate(bad), Err(NvmetError::BadNqn { .. })));
        assert!(matches!(
            t.connected_hosts(bad),
            Err(NvmetError::BadNqn { .. })
        ));
        let key = Secret::generate().unwrap();
        assert!(matches!(
            t.ensure_host(bad, &key, None),
            Err(NvmetError::BadNqn { .. })
        ));
        let spec = SubsystemSpec {
            nqn: "nqn.2024-01.io.blockplane:i:v".into(),
            serial: "0123456789abcdef".into(),
            model: "blockplane".into(),
            device: "/dev/loop0".into(),
            uuid: uuid::Uuid::nil(),
            hosts: vec![bad.into()],
            allow_any_host: false,
            ports: vec![],
        };
        assert!(matches!(
            t.ensure_subsystem(&spec),
            Err(NvmetError::BadNqn { .. })
        ));
        for (spec, field) in [
            (
                SubsystemSpec {
                    serial: "s".repeat(21),
                    ..spec.clone()
                },
                "serial",
            ),
            (
                SubsystemSpec {
                    serial: String::new(),
                    ..spec.clone()
                },
                "serial",
            ),
            (
                SubsystemSpec {
                    model: "m\u{7f}".into(),
                    ..spec.clone()
                },
                "model",
            ),
            (
                SubsystemSpec {
                    device: "dev/loop0".into(),
                    ..spec.clone()
                },
                "device",
            ),
            (
                SubsystemSpec {
                    device: "/dev/loop0\n".into(),
                    ..spec.clone()
                },
                "device",
            ),
        ] {
            let e = t.ensure_subsystem(&spec).unwrap_err();
            assert!(
                matches!(e, NvmetError::BadSpec { field: f, .. } if f == field),
                "{field}: {e}"
            );
        }
        // Nothing to tell without debugfs.
        assert!(t.connected_hosts(&spec.nqn).unwrap().is_none());
    }

    #[test]
    fn missing_parts_are_named() {
        let e = NvmetError::Missing {
            what: Part::NvmetTcp,
            detail: "modprobe nvmet-tcp failed: not found".into(),
        };
        assert!(
            e.to_string().starts_with("the nvmet-tcp kernel module"),
            "{e}"
        );
        assert!(Part::Configfs.to_string().contains("configfs"));
        assert!(Part::Nvmet.to_string().contains("nvmet kernel module"));
    }
}
