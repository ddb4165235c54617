//! The `loop` backend: the kernel loop driver, configured by ioctl.
//!
//! Devices are bound with `LOOP_CONFIGURE`, which sets the backing file, flags,
//! size limit and name in one call, so no half-configured device is ever visible.
//! The name field (`lo_file_name`) carries a mark, `bp:<instance>:<volume-id>`,
//! by which a restarted service finds its devices (and only its own: another
//! service on the host has another instance id). (The `loopdev-3` crate binds with
//! `LOOP_SET_FD` + `LOOP_SET_STATUS64` and cannot set that field, hence the few
//! ioctls below.)
//!
//! [`PrivateLoop`] is the same driver under a dm volume's table (its
//! `kernel` path): bound by the same call, with the volume's mark, autoclear
//! and direct I/O.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use time::OffsetDateTime;
use uuid::Uuid;

use super::{
    AttachRequest, Attachment, BackendError, Change, Decision, DeviceState, Marked, Probe,
    ProbeRequest, SpecCheck, VolumeBackend,
};
use crate::fault::{After, Faults};
use blockplane_api::model::{
    ActiveDispatch, Allocation, Backend, BackendCapability, DispatchPolicy, VolumeStats,
};
use blockplane_system::blockstat::BlockStat;
use blockplane_system::dispatch::{self, Reason};
use blockplane_system::extent::DevNum;

const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_REMOVE: libc::c_ulong = 0x4C81;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

const CONTROL: &str = "/dev/loop-control";

/// `struct loop_info64` from `<linux/loop.h>`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` from `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

impl LoopInfo64 {
    fn zeroed() -> Self {
        // SAFETY: plain-old-data of integers and byte arrays.
        unsafe { std::mem::zeroed() }
    }

    fn name(&self) -> &str {
        let end = self
            .lo_file_name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(LO_NAME_SIZE);
        std::str::from_utf8(&self.lo_file_name[..end]).unwrap_or("")
    }

    /// The volume whose mark of `instance` this device carries.
    fn volume_id(&self, instance: &str) -> Option<Uuid> {
        self.name()
            .strip_prefix("bp:")
            .and_then(|rest| rest.strip_prefix(instance))
            .and_then(|rest| rest.strip_prefix(':'))
            .and_then(|id| Uuid::parse_str(id).ok())
    }
}

/// The instance and volume of a mark `bp:<instance>:<volume-id>`.
fn parse_mark(name: &str) -> Option<(String, Uuid)> {
    let (instance, id) = name.strip_prefix("bp:")?.split_once(':')?;
    Some((instance.to_string(), Uuid::parse_str(id).ok()?))
}

/// A bound loop device over a file under an image root.
#[derive(Debug, Clone)]
pub struct LoopUnderRoot {
    pub device: String,
    /// As the kernel reports it (` (deleted)` appended once unlinked).
    pub backing_file: String,
    /// The instance and volume of its blockplane mark, if it carries one.
    pub mark: Option<(String, Uuid)>,
}

/// Every bound loop device whose backing file lies under one of `roots`,
/// whatever made it: the devices a blockplane over those roots may have made.
pub fn bound_under(roots: &[String]) -> io::Result<Vec<LoopUnderRoot>> {
    let mut out = Vec::new();
    for dev in LoopDev::all_bound()? {
        let Ok(backing) = dev.sys("loop/backing_file") else {
            continue;
        };
        if !roots
            .iter()
            .any(|r| Path::new(&backing).starts_with(r) && backing.len() > r.len())
        {
            continue;
        }
        let mark = match dev.status() {
            Ok(Some(info)) => parse_mark(info.name()),
            _ => None,
        };
        out.push(LoopUnderRoot {
            device: dev.node(),
            backing_file: backing,
            mark,
        });
    }
    Ok(out)
}

fn mark(instance: &str, volume_id: Uuid) -> [u8; LO_NAME_SIZE] {
    let text = format!("bp:{instance}:{volume_id}");
    let mut name = [0u8; LO_NAME_SIZE];
    let n = text.len().min(LO_NAME_SIZE - 1);
    name[..n].copy_from_slice(&text.as_bytes()[..n]);
    name
}

/// `ioctl(fd, req, arg)`, with `-1` turned into the errno.
///
/// # Safety
/// `arg` must be what the kernel expects for `req`.
unsafe fn ioctl(fd: &impl AsRawFd, req: libc::c_ulong, arg: usize) -> io::Result<libc::c_int> {
    // SAFETY: upheld by the caller.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), req, arg) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn get_status(dev: &File) -> io::Result<LoopInfo64> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 fills a loop_info64.
    unsafe {
        ioctl(
            dev,
            LOOP_GET_STATUS64,
            &mut info as *mut LoopInfo64 as usize,
        )?
    };
    Ok(info)
}

fn open_control() -> Result<File, BackendError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(CONTROL)
        .map_err(|e| BackendError::io("open", CONTROL, e))
}

/// Removes an unbound loop device that a volume had, so that volumes coming
/// and going do not leave a trail of `/dev/loopN` nodes behind. Best effort:
/// the kernel refuses (EBUSY) while anyone has the device open or has bound
/// it again, and the device is then theirs.
fn remove_unbound(dev: &LoopDev) {
    let removed = open_control().and_then(|ctl| {
        // SAFETY: LOOP_CTL_REMOVE takes the device index.
        unsafe { ioctl(&ctl, LOOP_CTL_REMOVE, dev.index as usize) }
            .map_err(|e| BackendError::io("LOOP_CTL_REMOVE", dev.node(), e))
    });
    if let Err(e) = removed {
        tracing::debug!(device = %dev.node(), error = %e, "unbound loop device kept");
    }
}

/// One `/dev/loopN`.
struct LoopDev {
    index: u32,
}

impl LoopDev {
    fn name(&self) -> String {
        format!("loop{}", self.index)
    }

    fn node(&self) -> String {
        format!("/dev/loop{}", self.index)
    }

    fn sys(&self, attr: &str) -> io::Result<String> {
        std::fs::read_to_string(format!("/sys/block/loop{}/{attr}", self.index))
            .map(|s| s.trim().to_string())
    }

    /// Whether a backing file is bound (`/sys/block/loopN/loop` exists only then).
    fn is_bound(&self) -> bool {
        Path::new(&format!("/sys/block/loop{}/loop", self.index)).exists()
    }

    fn major_minor(&self) -> io::Result<(u32, u32)> {
        let dev = self.sys("dev")?;
        let (ma, mi) = dev
            .split_once(':')
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad dev"))?;
        let parse = |s: &str| {
            s.parse::<u32>()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
        };
        Ok((parse(ma)?, parse(mi)?))
    }

    /// Opens the node, making it if `/dev` is not a devtmpfs that already has it.
    fn open(&self, write: bool, exclusive: bool) -> io::Result<File> {
        let node = self.node();
        if !Path::new(&node).exists() {
            let (ma, mi) = self.major_minor()?;
            rustix::fs::mknodat(
                rustix::fs::CWD,
                node.as_str(),
                rustix::fs::FileType::BlockDevice,
                rustix::fs::Mode::from_raw_mode(0o660),
                rustix::fs::makedev(ma, mi),
            )
            .or_else(|e| match e {
                rustix::io::Errno::EXIST => Ok(()),
                e => Err(e),
            })?;
        }
        let mut flags = libc::O_CLOEXEC;
        if exclusive {
            flags |= libc::O_EXCL;
        }
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(flags)
            .open(node)
    }

    /// Opens the node read-write with `O_EXCL`, which the kernel refuses while the
    /// device is mounted or otherwise claimed.
    fn open_exclusive(&self) -> Result<File, BackendError> {
        let node = self.node();
        self.open(true, true).map_err(|e| match e.raw_os_error() {
            Some(libc::EBUSY) => BackendError::Busy {
                device: node.clone(),
                reason: super::CLAIMED.into(),
            },
            _ => BackendError::io("open", &node, e),
        })
    }

    /// Every loop device with a backing file bound.
    fn all_bound() -> io::Result<Vec<LoopDev>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir("/sys/block")? {
            let name = entry?.file_name();
            let Some(index) = name
                .to_str()
                .and_then(|n| n.strip_prefix("loop"))
                .and_then(|n| n.parse().ok())
            else {
                continue;
            };
            let dev = LoopDev { index };
            if dev.is_bound() {
                out.push(dev);
            }
        }
        Ok(out)
    }

    /// The status of a bound device, or `None` if it was unbound meanwhile.
    fn status(&self) -> io::Result<Option<LoopInfo64>> {
        let f = self.open(false, false)?;
        match get_status(&f) {
            Ok(info) => Ok(Some(info)),
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn describe(&self) -> io::Result<Attachment> {
        let (major, minor) = self.major_minor()?;
        let direct_io = self.sys("loop/dio")? == "1";
        let size_bytes = self.sys("size")?.parse::<u64>().unwrap_or(0) * 512;
        let read_only = self.sys("ro")? == "1";
        Ok(Attachment {
            device: self.node(),
            kernel_name: self.name(),
            major,
            minor,
            dispatch: ActiveDispatch::Kernel,
            dispatch_reason: Reason::Loop { direct_io },
            size_bytes,
            read_only,
            attached_at: OffsetDateTime::now_utc(),
            baseline: None,
            kind: DeviceState::Loop { direct_io },
            resize_pending: false,
        })
    }
}

/// The kernel loop driver.
#[derive(Debug)]
pub struct LoopBackend {
    /// This service instance's id, part of every mark.
    instance: String,
    faults: Faults,
}

impl LoopBackend {
    /// A loop backend marking devices as `instance`'s (`faults`: the test
    /// faults inside its attach).
    pub fn new(instance: String, faults: Faults) -> Self {
        Self { instance, faults }
    }

    fn unavailable() -> Option<String> {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(CONTROL)
        {
            Ok(_) => None,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Some("the loop driver is not loaded (no /dev/loop-control)".into())
            }
            Err(e) => Some(format!("cannot open {CONTROL}: {e}")),
        }
    }

    /// The loop driver's queue depth (module parameter `hw_queue_depth`).
    fn queue_depth() -> u16 {
        std::fs::read_to_string("/sys/module/loop/parameters/hw_queue_depth")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(128)
    }

    /// What a loop volume's device is bound with.
    fn info(&self, req: &AttachRequest, direct_io: bool) -> LoopInfo64 {
        let mut info = LoopInfo64::zeroed();
        info.lo_sizelimit = req.params.size_bytes;
        info.lo_file_name = mark(&self.instance, req.volume_id);
        if req.params.read_only {
            info.lo_flags |= LO_FLAGS_READ_ONLY;
        }
        if direct_io {
            info.lo_flags |= LO_FLAGS_DIRECT_IO;
        }
        info
    }

    /// LOOP_CLR_FD on a device others hold open only sets autoclear; clear it
    /// again so the refused delete leaves the device as it was. `Ok` if the
    /// device turned out to be gone meanwhile.
    fn undo_clear(&self, dev: &LoopDev, volume_id: Uuid) -> Result<(), BackendError> {
        let node = dev.node();
        let restored = dev.open(false, false).and_then(|f| {
            let mut info = get_status(&f)?;
            if info.volume_id(&self.instance) != Some(volume_id) {
                // Unbound and taken by someone else since: ours is gone.
                return Err(io::Error::from_raw_os_error(libc::ENXIO));
            }
            info.lo_flags &= !LO_FLAGS_AUTOCLEAR;
            // SAFETY: LOOP_SET_STATUS64 reads a loop_info64.
            unsafe { ioctl(&f, LOOP_SET_STATUS64, &mut info as *mut LoopInfo64 as usize) }.map(drop)
        });
        match restored {
            Ok(()) => Err(BackendError::Busy {
                device: node,
                reason:
                    "another process has it open; close it first (the device was left attached)"
                        .into(),
            }),
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(()),
            Err(e) => Err(BackendError::io("restore autoclear on", node, e)),
        }
    }

    fn find(&self, volume_id: Uuid) -> io::Result<Option<(LoopDev, LoopInfo64)>> {
        for dev in LoopDev::all_bound()? {
            // A device unbound meanwhile (ENXIO, or its node gone) is not ours.
            let Ok(Some(info)) = dev.status() else {
                continue;
            };
            if info.volume_id(&self.instance) == Some(volume_id) {
                return Ok(Some((dev, info)));
            }
        }
        Ok(None)
    }
}

/// Binds a free loop device over `image` with `info`; `opened` sees the
/// device once it is open and before it is bound. Returns the device and the
/// handle it was bound through: one bound with autoclear unbinds when its
/// last opener closes, so keep the handle until another opener holds it.
fn bind(
    image: &OwnedFd,
    info: LoopInfo64,
    mut opened: impl FnMut(&LoopDev),
) -> Result<(LoopDev, File), BackendError> {
    let ctl = open_control()?;
    // LOOP_CTL_GET_FREE only names a free index; another process may bind it
    // first (EBUSY), so take the next one.
    for _ in 0..64 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns an index.
        let index = unsafe { ioctl(&ctl, LOOP_CTL_GET_FREE, 0) }
            .map_err(|e| BackendError::io("LOOP_CTL_GET_FREE", CONTROL, e))?
            as u32;
        let dev = LoopDev { index };
        let node = dev.node();
        let f = match dev.open(true, false) {
            Ok(f) => f,
            // Removed by another detach between GET_FREE and the open.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENXIO)) => {
                continue;
            }
            Err(e) => return Err(BackendError::io("open", &node, e)),
        };
        opened(&dev);
        let mut config = LoopConfig {
            fd: image.as_raw_fd() as u32,
            block_size: 0,
            info,
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads a loop_config.
        match unsafe { ioctl(&f, LOOP_CONFIGURE, &mut config as *mut LoopConfig as usize) } {
            Ok(_) => return Ok((dev, f)),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => continue,
            Err(e) => return Err(BackendError::io("LOOP_CONFIGURE", node, e)),
        }
    }
    Err(BackendError::Busy {
        device: CONTROL.into(),
        reason: "every free loop device was taken by another process before it could be bound"
            .into(),
    })
}

/// Sets a bound device's size limit to `size_bytes`: the kernel recomputes
/// its capacity from it (as LOOP_SET_CAPACITY would) and tells the disk.
/// Returns the size the device now has.
fn set_size(dev: &LoopDev, size_bytes: u64) -> Result<u64, BackendError> {
    let node = dev.node();
    let f = dev
        .open(true, false)
        .map_err(|e| BackendError::io("open", &node, e))?;
    let mut info = get_status(&f).map_err(|e| BackendError::io("LOOP_GET_STATUS64", &node, e))?;
    info.lo_sizelimit = size_bytes;
    // SAFETY: LOOP_SET_STATUS64 reads a loop_info64.
    unsafe { ioctl(&f, LOOP_SET_STATUS64, &mut info as *mut LoopInfo64 as usize) }
        .map_err(|e| BackendError::io("LOOP_SET_STATUS64", &node, e))?;
    Ok(dev
        .sys("size")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(|s| s * 512)
        .unwrap_or(size_bytes))
}

/// Why the loop driver cannot serve here, if it cannot.
pub fn unavailable() -> Option<String> {
    LoopBackend::unavailable()
}

/// A dm volume's private loop device (its `kernel` path): bound with direct
/// I/O and autoclear, so it unbinds itself when dm, its only opener, lets it
/// go; marked as the volume's, so the loop backend's orphan scan counts it
/// as a known volume's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrivateLoop {
    index: u32,
    /// Its device number, which the dm table names.
    pub dev: DevNum,
}

impl PrivateLoop {
    /// Binds one over `image` (`size_bytes` of it) for `volume_id`. The handle
    /// returned keeps it bound: drop it once a loaded table holds the device.
    pub fn bind(
        instance: &str,
        volume_id: Uuid,
        image: &OwnedFd,
        size_bytes: u64,
        read_only: bool,
    ) -> Result<(Self, File), BackendError> {
        let mut info = LoopInfo64::zeroed();
        info.lo_sizelimit = size_bytes;
        info.lo_file_name = mark(instance, volume_id);
        info.lo_flags = LO_FLAGS_DIRECT_IO | LO_FLAGS_AUTOCLEAR;
        if read_only {
            info.lo_flags |= LO_FLAGS_READ_ONLY;
        }
        let (dev, f) = bind(image, info, |_| {})?;
        let node = dev.node();
        // The driver falls back to buffered I/O when it cannot do direct I/O
        // on the file; `kernel` promises no page cache: refuse instead (the
        // handle dropped unbinds the device).
        if dev.sys("loop/dio").ok().as_deref() != Some("1") {
            return Err(BackendError::Refused {
                reason: format!(
                    "dispatch 'kernel': the loop driver would not do direct I/O on the image through {node} (its filesystem or block size); ask dispatch 'nowait'"
                ),
            });
        }
        let (major, minor) = dev
            .major_minor()
            .map_err(|e| BackendError::io("read sysfs of", &node, e))?;
        Ok((
            Self {
                index: dev.index,
                dev: DevNum { major, minor },
            },
            f,
        ))
    }

    /// The private loop device `volume_id` of `instance` has at `dev`, the
    /// `major:minor` its table names (`None`: not a loop device, or not
    /// that volume's).
    pub fn find(instance: &str, volume_id: Uuid, dev: &str) -> Option<Self> {
        let link = std::fs::read_link(format!("/sys/dev/block/{dev}")).ok()?;
        let index = link
            .file_name()?
            .to_str()?
            .strip_prefix("loop")?
            .parse()
            .ok()?;
        let ld = LoopDev { index };
        let info = ld.status().ok()??;
        if info.volume_id(instance) != Some(volume_id) {
            return None;
        }
        let (major, minor) = ld.major_minor().ok()?;
        Some(Self {
            index,
            dev: DevNum { major, minor },
        })
    }

    /// Grows (or shrinks) the device to `size_bytes`.
    pub fn set_size(&self, size_bytes: u64) -> Result<u64, BackendError> {
        set_size(&LoopDev { index: self.index }, size_bytes)
    }

    /// Lets the device go once no table holds it: dm closing it unbound it
    /// (autoclear), and its node is removed so volumes leave no trail.
    pub fn release(self) {
        let dev = LoopDev { index: self.index };
        if !dev.is_bound() {
            remove_unbound(&dev);
        }
    }
}

/// Binds a loop device over `file`, a small file of the service's own (a
/// move's metadata leg), for the dm table that will hold it: with
/// autoclear, so it unbinds itself when that table lets it go, and
/// buffered, since the file may be on a filesystem without direct I/O.
/// Its mark, `bpm:<instance>:<owner>`, is no volume's: no volume's scan
/// takes it for its own. The handle returned keeps it bound until a
/// loaded table holds it.
pub fn bind_service_file(
    instance: &str,
    owner: Uuid,
    file: &OwnedFd,
) -> Result<(DevNum, File), BackendError> {
    let mut info = LoopInfo64::zeroed();
    let text = format!("bpm:{instance}:{owner}");
    let n = text.len().min(LO_NAME_SIZE - 1);
    info.lo_file_name[..n].copy_from_slice(&text.as_bytes()[..n]);
    info.lo_flags = LO_FLAGS_AUTOCLEAR;
    let (dev, f) = bind(file, info, |_| {})?;
    let (major, minor) = dev
        .major_minor()
        .map_err(|e| BackendError::io("read sysfs of", dev.node(), e))?;
    Ok((DevNum { major, minor }, f))
}

impl VolumeBackend for LoopBackend {
    fn kind(&self) -> Backend {
        Backend::Loop
    }

    fn capability(&self) -> BackendCapability {
        let reason = Self::unavailable();
        BackendCapability {
            available: reason.is_none(),
            reason,
            features: None,
            targets: None,
            native_loop_target: None,
        }
    }

    fn validate(
        &self,
        spec: &SpecCheck,
        _image: &OwnedFd,
        _size: u64,
    ) -> Result<Option<Decision>, BackendError> {
        let unsupported = |what: String, reason: String| BackendError::Unsupported {
            backend: "loop",
            what,
            reason,
        };
        if let Some(reason) = Self::unavailable() {
            return Err(BackendError::Unavailable {
                backend: "loop",
                reason,
            });
        }
        if spec.dispatch != DispatchPolicy::Auto {
            return Err(unsupported(
                format!("dispatch '{}'", spec.dispatch.as_str()),
                "dispatch policies apply to backends ublk and dm; a loop volume uses the kernel loop driver (dispatch: auto)".into(),
            ));
        }
        let depth = Self::queue_depth();
        if spec.queues != 1 || spec.queue_depth != depth {
            return Err(unsupported(
                format!("queues {} x depth {}", spec.queues, spec.queue_depth),
                format!(
                    "the kernel loop driver has 1 queue of depth {depth} (module parameter hw_queue_depth)"
                ),
            ));
        }
        if spec.max_io_bytes != blockplane_api::model::DEFAULT_MAX_IO_BYTES {
            return Err(unsupported(
                format!("max_io_bytes {}", spec.max_io_bytes),
                "the kernel loop driver sets its own request size".into(),
            ));
        }
        if spec.qos.is_some() {
            return Err(unsupported(
                "qos".into(),
                "the kernel loop driver has no QoS".into(),
            ));
        }
        Ok(None)
    }

    fn attach(&self, req: AttachRequest) -> Result<Attachment, BackendError> {
        let direct_io = dispatch::direct_io_capable(req.image_fd.as_fd());
        let mut baseline = None;
        let (dev, f) = bind(&req.image_fd, self.info(&req, direct_io), |dev| {
            baseline = BlockStat::read(&dev.name()).ok();
            self.faults.kill_point(After::Add);
        })?;
        match dev.describe() {
            Ok(mut att) => {
                att.baseline = baseline;
                Ok(att)
            }
            Err(e) => {
                // SAFETY: LOOP_CLR_FD takes no argument.
                let _ = unsafe { ioctl(&f, LOOP_CLR_FD, 0) };
                Err(BackendError::io("read sysfs of", dev.node(), e))
            }
        }
    }

    fn check_detach(&self, volume_id: Uuid) -> Result<(), BackendError> {
        match self
            .find(volume_id)
            .map_err(|e| BackendError::io("scan", "/sys/block", e))?
        {
            Some((dev, _)) => dev.open_exclusive().map(drop),
            None => Ok(()),
        }
    }

    fn detach(&self, volume_id: Uuid, _att: Option<&Attachment>) -> Result<(), BackendError> {
        let Some((dev, _)) = self
            .find(volume_id)
            .map_err(|e| BackendError::io("scan", "/sys/block", e))?
        else {
            return Ok(());
        };
        let node = dev.node();
        let f = dev.open_exclusive()?;
        // Write back what the page cache of the device holds, then unbind.
        f.sync_all()
            .map_err(|e| BackendError::io("flush", &node, e))?;
        // SAFETY: LOOP_CLR_FD takes no argument.
        unsafe { ioctl(&f, LOOP_CLR_FD, 0) }
            .map_err(|e| BackendError::io("LOOP_CLR_FD", &node, e))?;
        drop(f);
        // The kernel unbinds when the last opener closes: at once, unless another
        // process has the device open.
        let deadline = Instant::now() + Duration::from_secs(2);
        while dev.is_bound() {
            if Instant::now() > deadline {
                return self.undo_clear(&dev, volume_id);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        remove_unbound(&dev);
        Ok(())
    }

    fn probe(&self, req: ProbeRequest) -> Result<Probe, BackendError> {
        let (volume_id, identity) = (req.volume_id, req.identity);
        let found = self
            .find(volume_id)
            .map_err(|e| BackendError::io("scan", "/sys/block", e))?;
        let Some((dev, info)) = found else {
            return Ok(Probe::Gone);
        };
        if (info.lo_device, info.lo_inode) != identity {
            return Err(BackendError::Busy {
                device: dev.node(),
                reason: format!(
                    "it carries this volume's mark but serves another file (dev {} inode {})",
                    info.lo_device, info.lo_inode
                ),
            });
        }
        let att = dev
            .describe()
            .map_err(|e| BackendError::io("read sysfs of", dev.node(), e))?;
        Ok(Probe::Alive(Box::new(att)))
    }

    fn marked(&self) -> Result<Vec<Marked>, BackendError> {
        let mut out = Vec::new();
        for dev in LoopDev::all_bound().map_err(|e| BackendError::io("scan", "/sys/block", e))? {
            if let Ok(Some(info)) = dev.status()
                && let Some(volume_id) = info.volume_id(&self.instance)
            {
                out.push(Marked {
                    volume_id,
                    device: dev.node(),
                });
            }
        }
        Ok(out)
    }

    fn stats(&self, volume_id: Uuid, att: &Attachment) -> Result<VolumeStats, BackendError> {
        super::kernel_stats(volume_id, Backend::Loop, att)
    }

    fn resize(
        &self,
        att: &Attachment,
        size_bytes: u64,
        _allocation: Allocation,
        _volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        let index: u32 = att
            .kernel_name
            .strip_prefix("loop")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| {
                BackendError::io(
                    "resize",
                    &att.device,
                    io::Error::other("not a loop device name"),
                )
            })?;
        let mut out = att.clone();
        out.size_bytes = set_size(&LoopDev { index }, size_bytes)?;
        Ok(out)
    }

    fn check_change(&self, att: &Attachment, change: Change) -> Result<(), BackendError> {
        let reason = match change {
            Change::ReadOnly(ro) if ro == att.read_only => return Ok(()),
            Change::Qos(None) | Change::Dispatch(DispatchPolicy::Auto) => return Ok(()),
            Change::ReadOnly(ro) => format!(
                "the kernel loop driver cannot change read-only on a bound device (LOOP_SET_STATUS64 ignores LO_FLAGS_READ_ONLY); delete the volume and create it again with \"read_only\": {ro}"
            ),
            Change::Qos(Some(_)) => "the kernel loop driver has no QoS".into(),
            Change::Dispatch(_) => {
                "dispatch policies apply to backends ublk and dm; a loop volume uses the kernel loop driver".into()
            }
        };
        Err(BackendError::NotLive {
            backend: "loop",
            field: change.field(),
            reason,
        })
    }

    fn reconfigure(
        &self,
        att: &Attachment,
        change: Change,
        _volume_id: Uuid,
    ) -> Result<Attachment, BackendError> {
        // Only no-op changes pass check_change: nothing to do.
        self.check_change(att, change)?;
        Ok(att.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_round_trips_fits_and_names_its_instance() {
        let id = Uuid::new_v4();
        let mut info = LoopInfo64::zeroed();
        info.lo_file_name = mark("0a1b2c3d", id);
        assert_eq!(info.volume_id("0a1b2c3d"), Some(id));
        assert_eq!(
            info.volume_id("ffffffff"),
            None,
            "another instance's device"
        );
        assert!(info.name().len() < LO_NAME_SIZE);
        info.lo_file_name = [0; LO_NAME_SIZE];
        info.lo_file_name[..8].copy_from_slice(b"/tmp/img");
        assert_eq!(info.volume_id("0a1b2c3d"), None);
    }

    #[test]
    fn struct_sizes_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
