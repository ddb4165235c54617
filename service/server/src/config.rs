//! `blockplane serve` configuration: flags, `BLOCKPLANE_*` environment
//! variables (clap reads both; flags win), an optional TOML config file, then
//! defaults, in that order of precedence.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::logging::LogFormat;

/// Configuration errors, reported before anything starts.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read or parsed.
    #[error("config file {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A listen address is neither `unix:/path` nor `HOST:PORT`.
    #[error("invalid listen address '{0}': use unix:/path/to.sock or HOST:PORT")]
    Listen(String),
    /// A TCP listener without a token (and not `--insecure-tcp` on loopback).
    #[error(
        "refusing to listen on TCP {0} without a token: set --token/BLOCKPLANE_TOKEN, or --insecure-tcp on a loopback address"
    )]
    TcpWithoutToken(SocketAddr),
    /// `--insecure-tcp` on an address other than loopback.
    #[error("--insecure-tcp only allows loopback addresses; {0} is not one")]
    InsecureNotLoopback(SocketAddr),
    /// The token file cannot be read.
    #[error("token file {path}: {reason}")]
    TokenFile {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The token given is empty.
    #[error("the token is empty")]
    EmptyToken,
    /// `--backup-target` or its credentials cannot be used.
    #[error("--backup-target: {0}")]
    BackupTarget(#[from] blockplane_backup::Error),
    /// The key slots' cost is given in a way that cannot be used.
    #[error("key slot cost: {0}")]
    Kdf(String),
    /// An export address is not `IP[:PORT]`.
    #[error("--export-address '{address}': {reason}")]
    ExportAddress {
        /// As given.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Flags of `blockplane serve`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// TOML file with any of: data_dir, listen, image_roots, token, token_file, insecure_tcp, log_format.
    #[arg(long, env = "BLOCKPLANE_CONFIG")]
    pub config: Option<PathBuf>,
    /// SQLite database and runtime files [default: /var/lib/blockplane as root, else ~/.local/share/blockplane].
    #[arg(long, env = "BLOCKPLANE_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where to listen, repeatable: unix:/path.sock or HOST:PORT [default: unix:<data-dir>/blockplane.sock].
    #[arg(long = "listen", env = "BLOCKPLANE_LISTEN", value_delimiter = ',')]
    pub listen: Vec<String>,
    /// A directory images may live under, repeatable [default: <data-dir>/images].
    #[arg(
        long = "image-root",
        env = "BLOCKPLANE_IMAGE_ROOT",
        value_delimiter = ','
    )]
    pub image_roots: Vec<PathBuf>,
    /// Bearer token every request but /healthz must carry (prefer the env variable or --token-file: flags show in ps).
    #[arg(long, env = "BLOCKPLANE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// File holding the bearer token.
    #[arg(long, env = "BLOCKPLANE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Allow a TCP listener without a token, on a loopback address only.
    #[arg(long, env = "BLOCKPLANE_INSECURE_TCP")]
    pub insecure_tcp: bool,
    /// Log format.
    #[arg(long, env = "BLOCKPLANE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Blocking io-wq workers of each ublk queue for the `threaded` policy [default: 4].
    #[arg(long, env = "BLOCKPLANE_WORKER_THREADS")]
    pub worker_threads: Option<u16>,
    /// Queues of a ublk volume that does not ask for a number [default: one
    /// per online CPU, at most 8].
    #[arg(long, env = "BLOCKPLANE_QUEUES")]
    pub queues: Option<u16>,
    /// Seconds between re-reads of direct-mapped images' extents [default: 60].
    #[arg(long, env = "BLOCKPLANE_EXTENT_CHECK_SECS")]
    pub extent_check_secs: Option<u32>,
    /// Milliseconds one unlock of an encrypted image's key slot should take
    /// on this host (cryptsetup's --iter-time, sizing argon2id): longer makes
    /// a key harder to guess by trying, and every attach slower [default: 2000].
    #[arg(long, env = "BLOCKPLANE_KEY_UNLOCK_MS")]
    pub key_unlock_ms: Option<u32>,
    /// A fixed argon2id time cost for new key slots instead of a timed one
    /// (with --key-kdf-memory-kib; at least 4): the same cost on every host,
    /// and no benchmark before each new key.
    #[arg(long, env = "BLOCKPLANE_KEY_KDF_ITERATIONS")]
    pub key_kdf_iterations: Option<u32>,
    /// The fixed argon2id memory of new key slots, KiB (with
    /// --key-kdf-iterations; 32 to 4194304).
    #[arg(long, env = "BLOCKPLANE_KEY_KDF_MEMORY_KIB")]
    pub key_kdf_memory_kib: Option<u32>,
    /// Where backups go: a directory (an absolute path, or `file:///path`:
    /// a local disk or an NFS mount), or S3-compatible storage
    /// (`s3://BUCKET/PREFIX?endpoint=URL&region=REGION`) [default: none,
    /// backups are refused].
    #[arg(long, env = "BLOCKPLANE_BACKUP_TARGET")]
    pub backup_target: Option<String>,
    /// Where volumes' exports listen for NVMe/TCP hosts, repeatable:
    /// `IP[:PORT]` (port 4420 when left out) [default: none, exports are
    /// refused].
    #[arg(
        long = "export-address",
        env = "BLOCKPLANE_EXPORT_ADDRESS",
        value_delimiter = ','
    )]
    pub export_address: Vec<String>,
    /// A file with the S3 target's credentials (`access_key_id = …`,
    /// `secret_access_key = …`, optional `session_token = …`), readable by
    /// the service's user only [default: AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN from the environment].
    #[arg(long, env = "BLOCKPLANE_BACKUP_CREDENTIALS")]
    pub backup_credentials: Option<PathBuf>,
    /// Seconds one operation on the backup target may go unanswered before
    /// the target is taken for hung and the backup, restore, verify or gc
    /// fails naming it; on S3 also the window in which a failed request
    /// (503 SlowDown, a lost connection) is tried again with backoff
    /// [default: 300].
    #[arg(long, env = "BLOCKPLANE_BACKUP_TIMEOUT_SECS")]
    pub backup_timeout_secs: Option<u64>,
    /// Seconds between two looks at the backup target for each standby
    /// image's newer backups; 0: only when told (`POST
    /// /v1/images/{id}/standby/check`) [default: 60].
    #[arg(long, env = "BLOCKPLANE_STANDBY_CHECK_SECS")]
    pub standby_check_secs: Option<u64>,
    /// Largest request body, bytes [default: 65536].
    #[arg(long, env = "BLOCKPLANE_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Seconds a connection has to send a request's headers (idle keep-alive included) [default: 10].
    #[arg(long, env = "BLOCKPLANE_HEADER_TIMEOUT_SECS")]
    pub header_timeout_secs: Option<u64>,
    /// Seconds a request may take before it is answered 408 (the event stream excepted) [default: 120].
    #[arg(long, env = "BLOCKPLANE_REQUEST_TIMEOUT_SECS")]
    pub request_timeout_secs: Option<u64>,
    /// Requests handled at once; more are answered 503 at once [default: 256].
    #[arg(long, env = "BLOCKPLANE_MAX_CONCURRENT_REQUESTS")]
    pub max_concurrent_requests: Option<usize>,
    /// Event streams open at once [default: 64].
    #[arg(long, env = "BLOCKPLANE_MAX_EVENT_STREAMS")]
    pub max_event_streams: Option<usize>,
    /// Volumes this host may have [default: 1024].
    #[arg(long, env = "BLOCKPLANE_MAX_VOLUMES")]
    pub max_volumes: Option<usize>,
    /// Refuse an image create or grow that would make the images of an
    /// image root add up to more than RATIO times its filesystem's size
    /// (e.g. 1.5) [default: no limit; a sparse image larger than the free
    /// space is still reported].
    #[arg(long, env = "BLOCKPLANE_MAX_OVERCOMMIT", value_parser = parse_ratio)]
    pub max_overcommit: Option<f64>,
    /// Start with a new, empty registry although the kernel serves devices
    /// blockplane made (a lost or emptied blockplane.db, or a new data dir):
    /// they are left running and reported as orphans.
    #[arg(long, env = "BLOCKPLANE_ACCEPT_NEW_REGISTRY")]
    pub accept_new_registry: bool,
}

/// Most queues a volume may have.
pub const MAX_QUEUES: u16 = 64;
/// The per-CPU default stops here: more queues than this buy nothing but memory.
const MAX_DEFAULT_QUEUES: u16 = 8;

/// One queue per online CPU, at most [`MAX_DEFAULT_QUEUES`].
fn per_cpu_queues() -> u16 {
    std::thread::available_parallelism()
        .map(|n| n.get().min(usize::from(MAX_DEFAULT_QUEUES)) as u16)
        .unwrap_or(1)
}

/// Limits that protect the service from its clients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Largest request body (`--max-body-bytes`).
    pub max_body_bytes: usize,
    /// Time a connection has to send a request's headers (`--header-timeout-secs`).
    pub header_timeout: std::time::Duration,
    /// Time a request may take before it is answered 408 (`--request-timeout-secs`).
    pub request_timeout: std::time::Duration,
    /// Requests handled at once (`--max-concurrent-requests`).
    pub max_concurrent_requests: usize,
    /// Event streams open at once (`--max-event-streams`).
    pub max_event_streams: usize,
    /// Volumes this host may have (`--max-volumes`).
    pub max_volumes: usize,
    /// Provisioned bytes of a root over its filesystem's size, at most.
    pub max_overcommit: Option<f64>,
}

/// A ratio above zero, e.g. `1.5`.
fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("'{s}' is not a ratio above 0 (e.g. 1.0 or 1.5)")),
    }
}

/// The config file's keys (all optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    data_dir: Option<PathBuf>,
    #[serde(default)]
    listen: Vec<String>,
    #[serde(default)]
    image_roots: Vec<PathBuf>,
    token: Option<String>,
    token_file: Option<PathBuf>,
    insecure_tcp: Option<bool>,
    log_format: Option<LogFormat>,
    worker_threads: Option<u16>,
    queues: Option<u16>,
    extent_check_secs: Option<u32>,
    key_unlock_ms: Option<u32>,
    key_kdf_iterations: Option<u32>,
    key_kdf_memory_kib: Option<u32>,
    backup_target: Option<String>,
    #[serde(default)]
    export_address: Vec<String>,
    backup_credentials: Option<PathBuf>,
    backup_timeout_secs: Option<u64>,
    standby_check_secs: Option<u64>,
    max_body_bytes: Option<usize>,
    header_timeout_secs: Option<u64>,
    request_timeout_secs: Option<u64>,
    max_concurrent_requests: Option<usize>,
    max_event_streams: Option<usize>,
    max_volumes: Option<usize>,
    max_overcommit: Option<f64>,
}

/// A place to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A unix socket at this path (`unix:/path`).
    Unix(PathBuf),
    /// A TCP address (`HOST:PORT`).
    Tcp(SocketAddr),
}

impl ListenAddr {
    /// Parses `unix:/path` or `HOST:PORT`.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(ConfigError::Listen(s.into()));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        s.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| ConfigError::Listen(s.into()))
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// The resolved configuration of a running service.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The registry and runtime files.
    pub data_dir: PathBuf,
    /// Where the API listens.
    pub listen: Vec<ListenAddr>,
    /// The directories images may live under.
    pub image_roots: Vec<PathBuf>,
    /// The bearer token every API request must carry, when set.
    pub token: Option<String>,
    /// How the service logs.
    pub log_format: LogFormat,
    /// Blocking io-wq workers of each ublk queue for the `threaded` policy.
    pub worker_threads: u16,
    /// Queues of a ublk volume created without a number.
    pub queues: u16,
    /// Seconds between re-reads of direct-mapped images' extents.
    pub extent_check_secs: u32,
    /// The cost of new key slots (`--key-unlock-ms`, or
    /// `--key-kdf-iterations` with `--key-kdf-memory-kib`).
    pub kdf: blockplane_system::crypt::Kdf,
    /// Where backups go (`--backup-target`); `None`: backups are refused.
    pub backup_target: Option<blockplane_backup::TargetConfig>,
    /// How long an operation on the backup target may go unanswered
    /// (`--backup-timeout-secs`).
    pub backup_timeout: std::time::Duration,
    /// How often standby images look for newer backups
    /// (`--standby-check-secs`); `None`: only when told.
    pub standby_check: Option<std::time::Duration>,
    /// What protects the service from its clients.
    pub limits: Limits,
    /// Start on a new registry even when devices blockplane made exist.
    pub accept_new_registry: bool,
    /// Where exports listen (`--export-address`); none: exports are refused.
    pub export_addresses: Vec<blockplane_system::nvmet::ListenAddr>,
}

/// The data dir used when none is configured.
pub fn default_data_dir() -> PathBuf {
    if rustix::process::geteuid().is_root() {
        return PathBuf::from("/var/lib/blockplane");
    }
    std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."))
        .join("blockplane")
}

/// The API socket in a data dir.
pub fn default_socket(data_dir: &Path) -> PathBuf {
    data_dir.join("blockplane.sock")
}

impl ServeArgs {
    /// Merges flags/env, the config file and defaults, and checks the result.
    pub fn resolve(self) -> Result<ServeConfig, ConfigError> {
        let file = FileConfig::read(self.config.as_deref())?;
        let limits = self.limits(&file);
        let data_dir = self
            .data_dir
            .or(file.data_dir)
            .unwrap_or_else(default_data_dir);
        let listen = listen_of(self.listen, file.listen, &data_dir)?;
        let image_roots = image_roots_of(self.image_roots, file.image_roots, &data_dir);
        let token = token_of(
            self.token.or(file.token),
            self.token_file.or(file.token_file),
        )?;
        let insecure_tcp = self.insecure_tcp || file.insecure_tcp.unwrap_or(false);
        check_tcp(&listen, token.is_some(), insecure_tcp)?;
        let export_addresses = export_addresses_of(match self.export_address.is_empty() {
            true => &file.export_address,
            false => &self.export_address,
        })?;
        Ok(ServeConfig {
            export_addresses,
            data_dir,
            listen,
            image_roots,
            token,
            log_format: self
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Human),
            worker_threads: self
                .worker_threads
                .or(file.worker_threads)
                .unwrap_or(4)
                .max(1),
            queues: self
                .queues
                .or(file.queues)
                .unwrap_or_else(per_cpu_queues)
                .clamp(1, MAX_QUEUES),
            extent_check_secs: self
                .extent_check_secs
                .or(file.extent_check_secs)
                .unwrap_or(60)
                .max(1),
            backup_target: backup_target_of(
                self.backup_target.or(file.backup_target),
                self.backup_credentials.or(file.backup_credentials),
            )?,
            standby_check: match self.standby_check_secs.or(file.standby_check_secs) {
                Some(0) => None,
                secs => Some(std::time::Duration::from_secs(secs.unwrap_or(60))),
            },
            backup_timeout: self
                .backup_timeout_secs
                .or(file.backup_timeout_secs)
                .map_or(blockplane_backup::DEFAULT_TIMEOUT, |s| {
                    std::time::Duration::from_secs(s.clamp(1, 3600))
                }),
            kdf: kdf_of(
                self.key_unlock_ms.or(file.key_unlock_ms),
                self.key_kdf_iterations.or(file.key_kdf_iterations),
                self.key_kdf_memory_kib.or(file.key_kdf_memory_kib),
            )?,
            limits,
            accept_new_registry: self.accept_new_registry,
        })
    }

    /// The service's limits, each from the command line, else the file,
    /// else its default.
    fn limits(&self, file: &FileConfig) -> Limits {
        Limits {
            max_body_bytes: self
                .max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(64 << 10),
            header_timeout: std::time::Duration::from_secs(
                self.header_timeout_secs
                    .or(file.header_timeout_secs)
                    .unwrap_or(10)
                    .max(1),
            ),
            request_timeout: std::time::Duration::from_secs(
                self.request_timeout_secs
                    .or(file.request_timeout_secs)
                    .unwrap_or(120)
                    .max(1),
            ),
            max_concurrent_requests: self
                .max_concurrent_requests
                .or(file.max_concurrent_requests)
                .unwrap_or(256)
                .max(1),
            max_event_streams: self
                .max_event_streams
                .or(file.max_event_streams)
                .unwrap_or(64)
                .max(1),
            max_volumes: self.max_volumes.or(file.max_volumes).unwrap_or(1024),
            max_overcommit: self.max_overcommit.or(file.max_overcommit),
        }
    }
}

impl FileConfig {
    /// The file at `path` (none: every setting's default), checked where a
    /// value parses further than TOML does.
    fn read(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let refused = |reason: String| ConfigError::File {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| refused(e.to_string()))?;
        let file: Self = toml::from_str(&text).map_err(|e| refused(e.to_string()))?;
        if let Some(r) = file.max_overcommit {
            parse_ratio(&r.to_string())
                .map_err(|reason| refused(format!("max_overcommit: {reason}")))?;
        }
        Ok(file)
    }
}

/// The cost of new key slots: timed unless a fixed cost is given whole,
/// and never both, since either would silently overrule the other.
fn kdf_of(
    unlock_ms: Option<u32>,
    iterations: Option<u32>,
    memory_kib: Option<u32>,
) -> Result<blockplane_system::crypt::Kdf, ConfigError> {
    use blockplane_system::crypt::Kdf;
    let refused = |reason: String| Err(ConfigError::Kdf(reason));
    match (unlock_ms, iterations, memory_kib) {
        (unlock_ms, None, None) => Ok(Kdf::Timed {
            unlock_ms: unlock_ms.unwrap_or(2000).clamp(1, 60_000),
        }),
        (Some(_), _, _) => refused(
            "--key-unlock-ms times the cost that --key-kdf-iterations and \
             --key-kdf-memory-kib fix: give one or the other"
                .into(),
        ),
        (None, Some(iterations), Some(memory_kib)) => {
            if iterations < Kdf::MIN_ITERATIONS {
                return refused(format!(
                    "--key-kdf-iterations {iterations} is below argon2id's least, {}",
                    Kdf::MIN_ITERATIONS
                ));
            }
            if !(Kdf::MIN_MEMORY_KIB..=Kdf::MAX_MEMORY_KIB).contains(&memory_kib) {
                return refused(format!(
                    "--key-kdf-memory-kib {memory_kib} is outside argon2id's {}..={}",
                    Kdf::MIN_MEMORY_KIB,
                    Kdf::MAX_MEMORY_KIB
                ));
            }
            Ok(Kdf::Fixed {
                iterations,
                memory_kib,
            })
        }
        (None, _, _) => refused(
            "--key-kdf-iterations and --key-kdf-memory-kib fix a cost together: give both".into(),
        ),
    }
}

/// The export addresses, parsed.
fn export_addresses_of(
    text: &[String],
) -> Result<Vec<blockplane_system::nvmet::ListenAddr>, ConfigError> {
    text.iter()
        .map(|a| {
            a.parse()
                .map_err(|e: blockplane_system::nvmet::ListenAddrError| {
                    ConfigError::ExportAddress {
                        address: a.clone(),
                        reason: e.to_string(),
                    }
                })
        })
        .collect()
}

/// The listen addresses: the flags' when any are given, else the file's
/// (a list is taken whole, never merged), else the socket in `data_dir`.
fn listen_of(
    flags: Vec<String>,
    file: Vec<String>,
    data_dir: &Path,
) -> Result<Vec<ListenAddr>, ConfigError> {
    let text = if flags.is_empty() { file } else { flags };
    let mut listen = text
        .iter()
        .map(|s| ListenAddr::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    if listen.is_empty() {
        listen.push(ListenAddr::Unix(default_socket(data_dir)));
    }
    Ok(listen)
}

/// The image roots: the flags' when any are given, else the file's (a list
/// is taken whole, never merged), else `images` in `data_dir`.
fn image_roots_of(flags: Vec<PathBuf>, file: Vec<PathBuf>, data_dir: &Path) -> Vec<PathBuf> {
    let mut roots = if flags.is_empty() { file } else { flags };
    if roots.is_empty() {
        roots.push(data_dir.join("images"));
    }
    roots
}

/// The backup target `spec` names, its S3 credentials read from the file
/// `credentials` when given (else from the environment); no `spec`: none,
/// and backups are refused.
fn backup_target_of(
    spec: Option<String>,
    credentials: Option<PathBuf>,
) -> Result<Option<blockplane_backup::TargetConfig>, ConfigError> {
    match spec {
        Some(spec) => Ok(Some(blockplane_backup::TargetConfig::parse(
            &spec,
            credentials.as_deref(),
        )?)),
        None => Ok(None),
    }
}

/// The bearer token: given, or read from `file` (trimmed); never empty.
fn token_of(token: Option<String>, file: Option<PathBuf>) -> Result<Option<String>, ConfigError> {
    let token = match (token, file) {
        (Some(t), _) => Some(t),
        (None, Some(path)) => Some(
            std::fs::read_to_string(&path)
                .map_err(|e| ConfigError::TokenFile {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })?
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    };
    if token.as_deref() == Some("") {
        return Err(ConfigError::EmptyToken);
    }
    Ok(token)
}

/// TCP needs a bearer token, unless `insecure_tcp` allows it without one
/// on a loopback address.
fn check_tcp(listen: &[ListenAddr], token: bool, insecure_tcp: bool) -> Result<(), ConfigError> {
    for l in listen {
        if let ListenAddr::Tcp(addr) = l
            && !token
        {
            if !insecure_tcp {
                return Err(ConfigError::TcpWithoutToken(*addr));
            }
            if !addr.ip().is_loopback() {
                return Err(ConfigError::InsecureNotLoopback(*addr));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> ServeArgs {
        ServeArgs {
            data_dir: Some("/d".into()),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_put_socket_and_images_in_the_data_dir() {
        let c = args().resolve().unwrap();
        assert_eq!(
            c.listen,
            vec![ListenAddr::Unix("/d/blockplane.sock".into())]
        );
        assert_eq!(c.image_roots, vec![PathBuf::from("/d/images")]);
        assert_eq!(c.token, None);
    }

    #[test]
    fn tcp_needs_a_token_or_insecure_loopback() {
        let tcp = |addr: &str, token: Option<&str>, insecure| {
            ServeArgs {
                listen: vec![addr.into()],
                token: token.map(Into::into),
                insecure_tcp: insecure,
                ..args()
            }
            .resolve()
        };
        assert!(matches!(
            tcp("127.0.0.1:9", None, false),
            Err(ConfigError::TcpWithoutToken(_))
        ));
        assert!(matches!(
            tcp("0.0.0.0:9", None, true),
            Err(ConfigError::InsecureNotLoopback(_))
        ));
        assert!(tcp("127.0.0.1:9", None, true).is_ok());
        assert!(tcp("0.0.0.0:9", Some("t"), false).is_ok());
        assert!(matches!(
            tcp("nonsense", Some("t"), false),
            Err(ConfigError::Listen(_))
        ));
    }

    #[test]
    fn flags_beat_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "data_dir = \"/file\"\nimage_roots = [\"/r1\"]\ntoken = \"x\"\n",
        )
        .unwrap();
        let c = ServeArgs {
            config: Some(file.clone()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/file"));
        assert_eq!(c.image_roots, vec![PathBuf::from("/r1")]);
        assert_eq!(c.token.as_deref(), Some("x"));
        let c = ServeArgs {
            config: Some(file),
            data_dir: Some("/flag".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/flag"));
    }

    #[test]
    fn a_key_slots_cost_is_timed_or_fixed_whole_never_both() {
        use blockplane_system::crypt::Kdf;
        let kdf = |unlock_ms, iterations, memory_kib| {
            ServeArgs {
                key_unlock_ms: unlock_ms,
                key_kdf_iterations: iterations,
                key_kdf_memory_kib: memory_kib,
                ..args()
            }
            .resolve()
            .map(|c| c.kdf)
        };
        assert_eq!(
            kdf(None, None, None).unwrap(),
            Kdf::Timed { unlock_ms: 2000 }
        );
        assert_eq!(
            kdf(Some(300), None, None).unwrap(),
            Kdf::Timed { unlock_ms: 300 }
        );
        assert_eq!(
            kdf(None, Some(4), Some(32)).unwrap(),
            Kdf::Fixed {
                iterations: 4,
                memory_kib: 32
            }
        );
        for (unlock_ms, iterations, memory_kib, names) in [
            (Some(300), Some(4), Some(32), "one or the other"),
            (None, Some(4), None, "give both"),
            (None, None, Some(32), "give both"),
            (None, Some(3), Some(32), "iterations 3"),
            (None, Some(4), Some(31), "memory-kib 31"),
            (None, Some(4), Some((4 << 20) + 1), "memory-kib 4194305"),
        ] {
            match kdf(unlock_ms, iterations, memory_kib) {
                Err(ConfigError::Kdf(reason)) => assert!(reason.contains(names), "{reason}"),
                other => panic!("{unlock_ms:?} {iterations:?} {memory_kib:?}: {other:?}"),
            }
        }
    }
}
