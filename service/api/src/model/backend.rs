//! How a volume's device is made and how its I/O reaches the image: the
//! kernel backends, the dispatch policies and the ublk copy modes.

use serde::{Deserialize, Serialize};

/// The kernel mechanism that exposes a volume as a block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The kernel loop driver.
    Loop,
    /// A ublk device served by a blockplane worker.
    Ublk,
    /// A device-mapper device whose table is the data path.
    Dm,
}

impl Backend {
    /// Every backend, in order of preference for `backend: auto`.
    pub const PREFERENCE: [Backend; 3] = [Backend::Ublk, Backend::Dm, Backend::Loop];

    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Loop => "loop",
            Backend::Ublk => "ublk",
            Backend::Dm => "dm",
        }
    }
}

/// The backend asked for at create time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// The fastest path this host has for the volume: dm `direct` for an
    /// image dm maps (with `dispatch: auto` and no QoS), else the first
    /// available of ublk, dm, loop.
    Auto,
    /// [`Backend::Loop`].
    Loop,
    /// [`Backend::Ublk`].
    Ublk,
    /// [`Backend::Dm`].
    Dm,
}

impl BackendChoice {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Loop => "loop",
            BackendChoice::Ublk => "ublk",
            BackendChoice::Dm => "dm",
        }
    }
}

/// How a ublk or dm volume's I/O reaches its image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DispatchPolicy {
    /// `direct` when the image passes every direct-map rule, else `nowait`.
    Auto,
    /// io_uring with `RWF_NOWAIT`, falling back to a blocking path on `EAGAIN`.
    Nowait,
    /// A pool of worker threads doing blocking syscalls, one work item per command.
    Threaded,
    /// The image's extent map, straight to the underlying disk.
    Direct,
    /// dm only: a linear table over a private kernel loop device with direct
    /// I/O, so no worker is on the data path; what `auto` takes on dm for an
    /// image that cannot be mapped `direct` (a sparse one).
    Kernel,
}

impl DispatchPolicy {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DispatchPolicy::Auto => "auto",
            DispatchPolicy::Nowait => "nowait",
            DispatchPolicy::Threaded => "threaded",
            DispatchPolicy::Direct => "direct",
            DispatchPolicy::Kernel => "kernel",
        }
    }
}

/// The data path a volume runs on now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ActiveDispatch {
    /// [`DispatchPolicy::Nowait`].
    Nowait,
    /// [`DispatchPolicy::Threaded`].
    Threaded,
    /// [`DispatchPolicy::Direct`].
    Direct,
    /// The kernel's own path: loop volumes (see `direct_io`) and dm volumes
    /// on [`DispatchPolicy::Kernel`].
    Kernel,
}

impl ActiveDispatch {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ActiveDispatch::Nowait => "nowait",
            ActiveDispatch::Threaded => "threaded",
            ActiveDispatch::Direct => "direct",
            ActiveDispatch::Kernel => "kernel",
        }
    }
}

/// How a ublk worker gets at a request's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CopyMode {
    /// Copied between the request and the worker's buffer.
    Copy,
    /// The request's pages, registered on the queue's ring by the kernel.
    ZeroCopy,
}

impl CopyMode {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            CopyMode::Copy => "copy",
            CopyMode::ZeroCopy => "zero_copy",
        }
    }
}
