//! `blockplane serve`: open the data dir, listen while reconciling, drain
//! on SIGTERM.
//!
//! Stopping the service never touches devices: volumes keep serving I/O and
//! the next start re-adopts them.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

use crate::backend::EventSink;
use crate::backend::dm::DmBackend;
use crate::backend::loopdev::LoopBackend;
use crate::backend::ublk::{UblkBackend, UblkConfig};
use crate::config::{Limits, ListenAddr, ServeConfig};
use crate::fault::Faults;
use crate::manager::{Backends, Manager, ManagerConfig};
use crate::store::Store;
use blockplane_system::image::ImageRoots;

/// Why the service could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The data dir, or a file in it, cannot be made, made private or opened.
    #[error("data dir {path}: {source}")]
    DataDir {
        /// The dir or file.
        path: String,
        /// Why not.
        #[source]
        source: io::Error,
    },
    /// Another service holds the data dir's lock.
    #[error("another blockplane is serving data dir {0}")]
    Locked(String),
    /// An image root cannot be opened.
    #[error("image roots: {0}")]
    Roots(#[source] io::Error),
    /// An image root and the data dir overlap.
    #[error(
        "image root {root} {relation} the data dir {data_dir}: the registry and runtime files could be registered as images; use image roots apart from the data dir (or its own images/ directory)"
    )]
    RootHoldsDataDir {
        /// The image root.
        root: String,
        /// The data dir.
        data_dir: String,
        /// How they overlap (`contains`, `lies inside`).
        relation: &'static str,
    },
    /// The registry is not the one the data dir served: it is new or empty
    /// while devices blockplane made serve, or it lacks every row the
    /// registry's mark counts.
    #[error(
        "the registry {db} {state}, but {lost}. Starting would serve a registry that knows nothing of them. \
         To recover, restore {db} (with its -wal file) from a backup and start again; \
         or start once with --accept-new-registry to begin on it as it is (empty if it is missing): devices are left running and listed as orphans in GET /v1/host"
    )]
    LostRegistry {
        /// The registry file.
        db: String,
        /// What it is (`is missing or empty`, ...).
        state: &'static str,
        /// What it lacks, in words: the devices that serve, the rows the mark counts.
        lost: String,
    },
    /// The registry is a newer blockplane's, or its mark or copy failed.
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    /// The ublk backend cannot start.
    #[error("ublk backend: {0}")]
    Ublk(#[source] io::Error),
    /// The registry cannot be opened or read.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The registry and the kernel could not be brought in step at start.
    #[error("reconciliation: {0}")]
    Reconcile(#[from] crate::manager::Error),
    /// The backup target cannot be opened.
    #[error("backup target: {0}")]
    BackupTarget(#[from] blockplane_backup::Error),
    /// `BLOCKPLANE_TEST_FAULT` is set, and this build cannot inject it.
    #[error(transparent)]
    Faults(#[from] crate::fault::FaultError),
    /// A listen address cannot be bound.
    #[error("listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// Why not.
        #[source]
        source: io::Error,
    },
}

fn private_dir(path: &Path) -> Result<(), ServeError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|source| ServeError::DataDir {
            path: path.display().to_string(),
            source,
        })
}

/// Makes the data dir, or sets one that already exists to 0700: it holds
/// the registry, which others must not read.
fn private_data_dir(path: &Path) -> Result<(), ServeError> {
    private_dir(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(|source| {
        ServeError::DataDir {
            path: path.display().to_string(),
            source,
        }
    })
}

/// Makes the database file (and its WAL files, when present) mode 0600
/// before SQLite opens it: SQLite gives new WAL files the database's mode.
fn private_database(db: &Path) -> Result<(), ServeError> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |path: &Path, source| ServeError::DataDir {
        path: path.display().to_string(),
        source,
    };
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(db)
        .map_err(|e| err(db, e))?;
    for suffix in ["", "-wal", "-shm"] {
        let f = std::path::PathBuf::from(format!("{}{suffix}", db.display()));
        match std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            r => r.map_err(|e| err(&f, e))?,
        }
    }
    Ok(())
}

/// Refuses image roots that contain the data dir, or lie inside it other than
/// its own `images/` directory: the database, its WAL, the lock and the
/// workers' state could otherwise be registered (and served) as images.
fn check_roots_apart(data_dir: &Path, roots: &[String]) -> Result<(), ServeError> {
    let data = data_dir
        .canonicalize()
        .map_err(|source| ServeError::DataDir {
            path: data_dir.display().to_string(),
            source,
        })?;
    let images = data.join("images");
    for root in roots.iter().map(Path::new) {
        let relation = if data.starts_with(root) {
            "contains"
        } else if root.starts_with(&data) && !root.starts_with(&images) {
            "lies inside"
        } else {
            continue;
        };
        return Err(ServeError::RootHoldsDataDir {
            root: root.display().to_string(),
            data_dir: data.display().to_string(),
            relation,
        });
    }
    Ok(())
}

/// Takes an exclusive lock on the data dir for the life of the process.
fn lock_data_dir(dir: &Path) -> Result<OwnedFd, ServeError> {
    let path = dir.join("lock");
    let fd = rustix::fs::open(
        &path,
        rustix::fs::OFlags::CREATE | rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .map_err(|e| ServeError::DataDir {
        path: path.display().to_string(),
        source: e.into(),
    })?;
    rustix::fs::flock(&fd, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(|_| ServeError::Locked(dir.display().to_string()))?;
    Ok(fd)
}

/// Raises the soft limit on open files to the hard one, and warns when even
/// that may not hold `max_volumes` volumes. The service keeps descriptors per
/// volume (a worker's pidfd, a dm or loop volume's image) and may serve
/// `--max-volumes` of them (1,024 by default), while a shell or a service
/// manager starts it with a soft limit of 1,024 (systemd's hard limit is
/// 524,288; the kernel's own default 4,096). Workers inherit the new limit.
fn raise_open_files_limit(max_volumes: usize) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => limit.current = limit.maximum,
            Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
        }
    }
    // Two descriptors a volume and a margin for clients, SQLite and the
    // listeners: a rough bound, for a warning only.
    let want = (max_volumes as u64).saturating_mul(2) + 256;
    match limit.current {
        Some(n) if n < want => tracing::warn!(
            open_files = n,
            max_volumes,
            "the open-files limit (RLIMIT_NOFILE, hard limit included) may not hold --max-volumes volumes: raise it (LimitNOFILE= in the unit) or lower --max-volumes"
        ),
        n => tracing::info!(open_files = ?n, "open-files limit"),
    }
}

enum Bound {
    Unix(UnixListener),
    Tcp(TcpListener),
}

async fn bind(addr: &ListenAddr) -> Result<Bound, ServeError> {
    let err = |source| ServeError::Listen {
        addr: addr.to_string(),
        source,
    };
    match addr {
        ListenAddr::Tcp(a) => Ok(Bound::Tcp(TcpListener::bind(a).await.map_err(err)?)),
        ListenAddr::Unix(path) => {
            if let Some(parent) = path.parent() {
                private_dir(parent)?;
            }
            // A socket left by a killed service is stale unless someone answers on it.
            if let Ok(meta) = std::fs::symlink_metadata(path) {
                use std::os::unix::fs::FileTypeExt;
                if !meta.file_type().is_socket() {
                    return Err(err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "path exists and is not a socket",
                    )));
                }
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        "another process answers on this socket",
                    )));
                }
                std::fs::remove_file(path).map_err(err)?;
            }
            let listener = UnixListener::bind(path).map_err(err)?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(err)?;
            Ok(Bound::Unix(listener))
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining requests"),
        _ = int.recv() => tracing::info!("SIGINT: draining requests"),
    }
}

/// Accepts connections until told to stop, then lets open ones finish.
/// Each connection must send a request's headers within the header timeout
/// (slow or idle clients are cut off: a half-sent request is answered 408,
/// an idle keep-alive connection is just closed); HTTP/1.1.
async fn serve_listener<L>(
    mut listener: L,
    app: axum::Router,
    mut stop: watch::Receiver<bool>,
    limits: Limits,
) where
    L: axum::serve::Listener,
    L::Io: Unpin + AsFd,
{
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    loop {
        tokio::select! {
            (io, _addr) = listener.accept() => {
                // hyper closes a connection whose headers are late without a
                // word; a copy of the socket lets us answer 408 first, and
                // lets the header timer see bytes waiting unread.
                let socket = rustix::io::fcntl_dupfd_cloexec(io.as_fd(), 0).ok().map(Arc::new);
                let mut http = http.clone();
                if let Some(socket) = &socket {
                    http.timer(HeaderTimer(socket.clone()));
                }
                let io = Tracked::new(io);
                let partial = io.partial.clone();
                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                let io = crate::http::wire::JsonParseErrors::new(io);
                let conn = http.serve_connection(hyper_util::rt::TokioIo::new(io), svc);
                let conn = graceful.watch(conn);
                let timeout = limits.header_timeout;
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                        if e.is_timeout()
                            && partial.load(Ordering::Relaxed)
                            && let Some(socket) = &socket
                        {
                            answer_header_timeout(socket, timeout);
                        }
                    }
                    if let Some(socket) = socket {
                        linger_close(socket).await;
                    }
                });
            }
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    graceful.shutdown().await;
}

/// The header timer of one connection: it ends a connection whose request
/// headers are late only when nothing it sent waits unread in its socket.
/// After the process could not run for a while (stopped, frozen, starved)
/// the runtime may wake a connection for its expired timer before it has
/// seen the socket readable, and hyper would then drop a request that
/// arrived in time; looking at the socket itself (`FIONREAD`) lets such a
/// request be read and answered.
#[derive(Clone)]
struct HeaderTimer(Arc<OwnedFd>);

/// How long an expired header timer waits again for bytes it found unread.
const UNREAD_RECHECK: Duration = Duration::from_millis(100);

impl hyper::rt::Timer for HeaderTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(std::time::Instant::now() + duration)
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(HeaderSleep {
            sleep: Box::pin(tokio::time::sleep_until(deadline.into())),
            socket: self.0.clone(),
        })
    }
}

/// A [`HeaderTimer`]'s sleep.
struct HeaderSleep {
    sleep: Pin<Box<tokio::time::Sleep>>,
    socket: Arc<OwnedFd>,
}

impl std::future::Future for HeaderSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            std::task::ready!(self.sleep.as_mut().poll(cx));
            let unread = rustix::io::ioctl_fionread(self.socket.as_fd()).unwrap_or(0);
            if unread == 0 {
                return Poll::Ready(());
            }
            // hyper reads the bytes once the runtime sees them; look again
            // after that.
            let again = tokio::time::Instant::now() + UNREAD_RECHECK;
            self.sleep.as_mut().reset(again);
        }
    }
}

impl hyper::rt::Sleep for HeaderSleep {}

/// Writes a 408 with the API's error body to a connection whose request
/// headers did not arrive in time. Best effort: the answer is small and the
/// socket's send buffer empty (nothing was written since the request began),
/// so one non-blocking write suffices; a client gone already gets nothing.
fn answer_header_timeout(socket: &OwnedFd, timeout: Duration) {
    let body = serde_json::to_string(&blockplane_api::model::ErrorBody {
        error: blockplane_api::model::ErrorDetail {
            code: blockplane_api::model::ErrorCode::RequestTimeout,
            message: format!(
                "the request's headers did not arrive within {} s (--header-timeout-secs)",
                timeout.as_secs()
            ),
        },
    })
    .expect("an error body serializes");
    let answer = format!(
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = rustix::io::write(socket, answer.as_bytes());
}

/// How long a closing connection waits for more of what its client sends.
const LINGER_WAIT: Duration = Duration::from_secs(2);

/// The most a closing connection reads and discards.
const LINGER_MAX_BYTES: usize = 1 << 20;

/// Closes a connection so that its client can read the last answer. An
/// answer given before the request's body was read (401 without the token,
/// 413, 408) ends the connection with the body's bytes still arriving;
/// closing a socket with bytes unread resets it, and the reset can destroy
/// the answer before the client reads it (a proxy whose write of the body
/// fails drops the answer too). So: stop writing, then read and discard
/// until the client closes, is silent for [`LINGER_WAIT`], or has sent
/// [`LINGER_MAX_BYTES`] (nginx's lingering close).
async fn linger_close(socket: Arc<OwnedFd>) {
    let _ = rustix::net::shutdown(&*socket, rustix::net::Shutdown::Write);
    let Ok(fd) =
        Arc::try_unwrap(socket).or_else(|shared| rustix::io::fcntl_dupfd_cloexec(&*shared, 0))
    else {
        return;
    };
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open and the same
    // descriptor until the AsyncFd is dropped.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    };
    let Ok(fd) = registered else {
        return;
    };
    let mut buf = vec![0u8; 64 << 10];
    let mut discarded = 0;
    while discarded < LINGER_MAX_BYTES {
        let Ok(Ok(mut ready)) = tokio::time::timeout(LINGER_WAIT, fd.readable()).await else {
            return;
        };
        match ready.try_io(|fd| rustix::io::read(fd.get_ref(), &mut buf).map_err(io::Error::from)) {
            Ok(Ok(0) | Err(_)) => return,
            Ok(Ok(n)) => discarded += n,
            Err(_would_block) => {}
        }
    }
}

/// A connection that notes whether a request has begun arriving: set when
/// bytes are read, cleared when an answer is written. A header timeout with
/// it set is a half-sent request; with it clear, an idle connection.
struct Tracked<IO> {
    io: IO,
    partial: Arc<AtomicBool>,
}

impl<IO> Tracked<IO> {
    fn new(io: IO) -> Self {
        Self {
            io,
            partial: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Tracked<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.partial.store(true, Ordering::Relaxed);
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Tracked<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.partial.store(false, Ordering::Relaxed);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.partial.store(false, Ordering::Relaxed);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Whether opening `db` would make a new registry: neither it nor its WAL
/// holds anything.
fn is_new_registry(db: &Path) -> bool {
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    size(db) == 0 && size(Path::new(&wal)) == 0
}

/// Refuses a registry that is not the one the data dir served: one that would
/// be new while devices blockplane made serve unowned (loop devices with a
/// blockplane mark over files under the image roots run unheld, ublk workers
/// of the data dir, dm devices of instances no live service holds: what a
/// lost registry leaves behind, which a new one would know nothing of), or
/// one that lacks every row the registry's mark counts (emptied with no
/// device attached).
fn refuse_lost_registry(
    db: &Path,
    data_dir: &Path,
    found: &crate::registry::Found,
    roots: &ImageRoots,
) -> Result<(), ServeError> {
    let new = is_new_registry(db);
    let rows = crate::registry::lost_rows(data_dir, found);
    let devices = match new || rows.is_some() {
        true => unowned_marked_devices(&data_dir.join("run"), roots),
        false => None,
    };
    let lost: Vec<String> = devices.into_iter().chain(rows).collect();
    if lost.is_empty() {
        return Ok(());
    }
    Err(ServeError::LostRegistry {
        db: db.display().to_string(),
        state: if new {
            "is missing or empty"
        } else {
            "is not the one this data dir served"
        },
        lost: lost.join("; and "),
    })
}

/// The devices blockplane made (they carry its mark) that no live service
/// owns, in words; `None` when there are none. A loop device someone else
/// made over a file under an image root carries no mark: it is listed as an
/// orphan once the service runs, but it is not what a lost registry leaves.
fn unowned_marked_devices(run_dir: &Path, roots: &ImageRoots) -> Option<String> {
    let found: Vec<_> = crate::manager::orphans::unowned_devices(
        &roots.paths(),
        &run_dir.join("ublk"),
        "",
        &std::collections::HashSet::new(),
    )
    .into_iter()
    .filter(|o| o.backend != blockplane_api::model::Backend::Loop || o.instance.is_some())
    .collect();
    if found.is_empty() {
        return None;
    }
    let devices = found
        .iter()
        .map(|o| {
            let worker = o
                .pid
                .map(|p| format!(", worker pid {p}"))
                .unwrap_or_default();
            format!(
                "{} {} ({}{worker})",
                o.backend.as_str(),
                o.device,
                o.backing_file.as_deref().unwrap_or("unknown file")
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Some(format!(
        "the kernel serves {} device(s) that blockplane made and no live service owns: {devices}",
        found.len()
    ))
}

/// The kernel's backends, marking their devices with `instance`: loop, ublk
/// (workers run under `<data-dir>/run/ublk`) and dm (its nowait/threaded
/// path a private ublk device), all reporting into one event sink.
fn kernel_backends(
    cfg: &ServeConfig,
    instance: String,
    faults: Faults,
) -> Result<Backends, ServeError> {
    let (events, receiver) = EventSink::channel();
    let ublk = Arc::new(
        UblkBackend::new(
            UblkConfig {
                run_root: cfg.data_dir.join("run").join("ublk"),
                threads: cfg.worker_threads,
                extent_check_secs: cfg.extent_check_secs,
                instance: instance.clone(),
                faults,
            },
            events.clone(),
        )
        .map_err(ServeError::Ublk)?,
    );
    let dm = DmBackend::new(
        instance.clone(),
        ublk.clone(),
        events,
        cfg.extent_check_secs,
        faults,
    );
    Ok(Backends {
        list: vec![
            Arc::new(LoopBackend::new(instance, faults)),
            ublk,
            Arc::new(dm),
        ],
        events: receiver,
    })
}

/// Runs the service until SIGTERM or SIGINT; then finishes in-flight requests
/// and returns. Devices are left as they are.
pub async fn serve(cfg: ServeConfig) -> Result<(), ServeError> {
    let faults = Faults::from_env()?;
    raise_open_files_limit(cfg.limits.max_volumes);
    let opened = open_data_dir(&cfg).await?;
    let backends = kernel_backends(&cfg, opened.instance.clone(), faults)?;
    let manager = Manager::new(
        opened.store,
        opened.roots,
        backends,
        manager_config(&cfg, faults)?,
    )
    .await?;

    // Every volume locked and marked `recovering` before the API serves;
    // reconciled beside it, so that the API answers at once however many
    // volumes the host has.
    let recovery = manager.recovery().await?;
    tracing::info!(volumes = recovery.volumes(), "reconciling with the kernel");
    let (stop_tx, stop_rx) = watch::channel(false);
    let app = crate::http::router(
        manager.clone(),
        cfg.token.clone(),
        cfg.limits,
        stop_rx.clone(),
    );
    let mut servers = start_listeners(&cfg, app, stop_rx).await?;
    // Only once the API serves: the workers' starts must not delay it.
    let reconciling = {
        let manager = manager.clone();
        beside(async move {
            let report = recovery.run().await?;
            tracing::info!(
                adopted = report.adopted,
                reattached = report.reattached,
                failed = report.failed,
                finished_deletes = report.finished_deletes,
                orphans_removed = report.orphans_removed,
                "reconciled with the kernel"
            );
            manager.remotes().reconcile().await?;
            manager.exports().start_following();
            manager.start_sampler();
            Ok(())
        })
    };

    // A reconciliation that fails (the registry cannot be read or written)
    // ends the service as a failed start did: it serves nothing it could
    // not match with the kernel.
    let failure = tokio::select! {
        _ = shutdown_signal() => None,
        Some(e) = reconciling => {
            tracing::error!(error = %e, "reconciliation failed; stopping");
            Some(e)
        }
    };
    let _ = stop_tx.send(true);
    // Their blocking fills would keep the runtime from ending.
    manager.images().stop_jobs();
    let drained = tokio::time::timeout(Duration::from_secs(30), async {
        while servers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("requests still running after 30 s; exiting anyway");
    }
    for addr in &cfg.listen {
        if let ListenAddr::Unix(path) = addr {
            let _ = std::fs::remove_file(path);
        }
    }
    close_registry(manager.store()).await;
    drop(opened.guards);
    tracing::info!("stopped; devices left running");
    match failure {
        Some(e) => Err(ServeError::Reconcile(e)),
        None => Ok(()),
    }
}

/// What a service holds while it runs: its data dir's lock, and the mark
/// that tells other services its instance is alive.
struct Guards {
    _lock: OwnedFd,
    _alive: Option<crate::liveness::Alive>,
}

/// The data dir opened for this service: its registry (refused unchanged
/// when a newer blockplane's, or not the one this data dir served), its
/// image roots, its instance.
struct Opened {
    store: Store,
    roots: ImageRoots,
    instance: String,
    guards: Guards,
}

/// Locks the data dir, checks its image roots and opens its registry,
/// migrated after a copy of it is kept.
async fn open_data_dir(cfg: &ServeConfig) -> Result<Opened, ServeError> {
    private_data_dir(&cfg.data_dir)?;
    let lock = lock_data_dir(&cfg.data_dir)?;
    let default_root = cfg.data_dir.join("images");
    if cfg.image_roots.contains(&default_root) {
        private_dir(&default_root)?;
    }
    let roots = ImageRoots::open(&cfg.image_roots).map_err(ServeError::Roots)?;
    check_roots_apart(&cfg.data_dir, &roots.paths())?;
    let db = cfg.data_dir.join("blockplane.db");
    // Read before anything writes it.
    let found = crate::registry::look(&db).await?;
    crate::registry::refuse_newer(&db, &found)?;
    if !cfg.accept_new_registry {
        refuse_lost_registry(&db, &cfg.data_dir, &found, &roots)?;
    }
    private_database(&db)?;
    crate::registry::copy_before_migrating(&db, &found).await?;
    let store = Store::open(&db).await?;
    let instance = store.instance().await?;
    // Other services tell this instance's devices from a lost one's by it.
    let alive = match crate::liveness::claim(&instance) {
        Ok(alive) => Some(alive),
        Err(e) => {
            tracing::warn!(%instance, error = %e, "another live service has this instance id (a copy of this registry in another data dir?): each takes the other's devices for its own");
            None
        }
    };
    crate::registry::keep_mark(&store, &cfg.data_dir).await?;
    Ok(Opened {
        store,
        roots,
        instance,
        guards: Guards {
            _lock: lock,
            _alive: alive,
        },
    })
}

/// What the manager needs of the configuration, the backup target opened.
fn manager_config(cfg: &ServeConfig, faults: Faults) -> Result<ManagerConfig, ServeError> {
    Ok(ManagerConfig {
        run_dir: cfg.data_dir.join("run"),
        default_queues: cfg.queues,
        max_volumes: cfg.limits.max_volumes,
        max_overcommit: cfg.limits.max_overcommit,
        kdf: cfg.kdf,
        backup_target: match &cfg.backup_target {
            Some(t) => Some(blockplane_backup::Target::open(t, cfg.backup_timeout)?),
            None => None,
        },
        standby_check: cfg.standby_check,
        faults,
        clock: crate::fault::Clock::from_env()?,
        export_addresses: cfg.export_addresses.clone(),
        peer_token: cfg.token.clone(),
    })
}

/// Binds every listen address, then serves `app` on each until `stop`:
/// answering on one listener means all are up.
async fn start_listeners(
    cfg: &ServeConfig,
    app: axum::Router,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinSet<()>, ServeError> {
    let mut bound = Vec::new();
    for addr in &cfg.listen {
        bound.push(bind(addr).await?);
        tracing::info!(listen = %addr, auth = cfg.token.is_some(), "listening");
    }
    let mut servers = tokio::task::JoinSet::new();
    for listener in bound {
        let (app, stop) = (app.clone(), stop.clone());
        let limits = cfg.limits;
        servers.spawn(async move {
            match listener {
                Bound::Unix(l) => serve_listener(l, app, stop, limits).await,
                Bound::Tcp(l) => serve_listener(l, app, stop, limits).await,
            }
        });
    }
    Ok(servers)
}

/// Runs `work` (the reconciliation) beside the API; resolves only when it
/// fails, with why.
fn beside(
    work: impl Future<Output = Result<(), crate::manager::Error>> + Send + 'static,
) -> impl Future<Output = Option<crate::manager::Error>> {
    let reconciling = tokio::spawn(work);
    async move {
        match reconciling.await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(e) => Some(crate::manager::Error::Internal(format!(
                "reconciliation ended: {e}"
            ))),
        }
    }
}

/// Checkpoints the registry into its .db file, so that a copy of it alone
/// is the registry. Bounded: a connection still busy must not keep the
/// process from exiting.
async fn close_registry(store: &Store) {
    match tokio::time::timeout(Duration::from_secs(10), store.close()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "could not checkpoint the database at stop"),
        Err(_) => tracing::warn!("the database was still busy after 10 s; not checkpointed"),
    }
}
