//! The `blockplane` command line: `serve` runs the service; every other
//! command is a client of its API (tables for people, `--json` for scripts,
//! a non-zero exit with the API's message on error).

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use hyper::Method;
use serde_json::{Value, json};

use blockplane_api::client::{Endpoint, Transport, encode_segment};
use blockplane_api::model::{human_size, parse_size};
use blockplane_server::config::{ServeArgs, default_data_dir, default_socket};
use blockplane_server::logging::{self, LogFormat};
use blockplane_server::proxy::ProxyConfig;

/// blockplane: image files as fast, safe block devices.
///
/// The client flags (--api, --token, --json) go before the command or with
/// any client command; `serve` has flags of its own only.
#[derive(Debug, Parser)]
#[command(name = "blockplane", version, about)]
pub struct Cli {
    /// Given before the command (not global here: see [`main`]).
    #[command(flatten)]
    client: ClientArgs,
    #[command(subcommand)]
    command: Command,
}

/// How a client reaches the API. Global within each client command, so that
/// they may follow its subcommands too.
#[derive(Debug, Clone, Default, clap::Args)]
struct ApiArgs {
    /// API address: unix:/path.sock or http://host:port [default: the local service's socket].
    #[arg(long, global = true, env = "BLOCKPLANE_API")]
    api: Option<String>,
    /// Bearer token for the API.
    #[arg(long, global = true, env = "BLOCKPLANE_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

/// The flags of the commands that print the API's answers.
#[derive(Debug, Clone, Default, clap::Args)]
struct ClientArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// Print the API's JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
}

impl ClientArgs {
    /// These flags given with the command, over those given before it.
    fn or(&self, before: &ClientArgs) -> ClientArgs {
        ClientArgs {
            api: self.api.or(&before.api),
            json: self.json || before.json,
        }
    }
}

impl ApiArgs {
    fn or(&self, before: &ApiArgs) -> ApiArgs {
        ApiArgs {
            api: self.api.clone().or_else(|| before.api.clone()),
            token: self.token.clone().or_else(|| before.token.clone()),
        }
    }
}

/// The ids of the client flags given before the command.
const CLIENT_FLAGS: [&str; 3] = ["api", "token", "json"];

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service.
    Serve(ServeArgs),
    /// What this host can run.
    Host {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Backing image files.
    Image {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        cmd: ImageCmd,
    },
    /// Block devices.
    Volume {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
    /// The event log.
    Events {
        #[command(flatten)]
        client: ClientArgs,
        /// Keep printing events as they happen, until interrupted (after
        /// the newest --limit, or those --since).
        #[arg(long)]
        follow: bool,
        /// Only this volume's events (id or name).
        #[arg(long)]
        volume: Option<String>,
        /// Only events after this time (RFC 3339, e.g. 2026-11-30T21:00:00Z).
        #[arg(long)]
        since: Option<String>,
        /// At most this many (newest).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Copy the registry to FILE (mode 0600; never overwrites), consistently,
    /// while the service runs or not. To restore, stop the service and put the
    /// copy in place as <data-dir>/blockplane.db, with no -wal or -shm file
    /// beside it.
    Backup {
        /// The data dir whose registry to copy [default: as `serve`].
        #[arg(long, env = "BLOCKPLANE_DATA_DIR")]
        data_dir: Option<std::path::PathBuf>,
        /// Where to write the copy (must not exist).
        file: std::path::PathBuf,
    },
    /// Serve the CSI driver (Kubernetes) for this node's blockplane.
    Csi {
        #[command(flatten)]
        args: blockplane_csi::CsiArgs,
        /// Log format.
        #[arg(
            long,
            env = "BLOCKPLANE_LOG_FORMAT",
            value_enum,
            default_value = "human"
        )]
        log_format: LogFormat,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Open the dashboard of a service that listens on its unix socket: forwards
    /// a local TCP address to the API given by --api; then browse to it. With
    /// --token/BLOCKPLANE_TOKEN the forward requires that token on every API
    /// request (the browser sends it; the forward never adds it).
    Dashboard {
        /// Where browsers connect: a loopback HOST:PORT, or any address when a
        /// token is set (every request must then carry it).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Print the OpenAPI document.
    #[command(hide = true)]
    Openapi,
    /// Serve one volume's ublk device (started by the service, not by hand).
    #[command(hide = true)]
    Worker {
        /// The worker spec, JSON.
        #[arg(long)]
        spec: String,
    },
}

#[derive(Debug, Subcommand)]
enum ImageCmd {
    /// Register an existing file.
    Add {
        /// The image's name (letters, digits, '.', '_', '-').
        name: String,
        /// The file, under one of the service's image roots.
        path: String,
    },
    /// Create a new file and register it.
    Create {
        /// The image's name (letters, digits, '.', '_', '-').
        name: String,
        /// The file to make (must not exist), under one of the service's image roots.
        path: String,
        /// Size: bytes, or 512M, 1.5G, 4GiB (binary, 1024) or 500MB, 2GB (decimal, 1000).
        #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
        size: u64,
        /// sparse, or full (allocated and zero-written: direct-map ready).
        #[arg(long, default_value = "sparse", value_parser = ["sparse", "full"])]
        allocation: String,
    },
    /// List images.
    #[command(visible_alias = "list")]
    Ls,
    /// Show one image.
    Show {
        /// Image id or name.
        image: String,
    },
    /// Grow an image (attached volumes follow).
    Resize {
        /// Image id or name.
        image: String,
        /// The new size, larger than today's: bytes, or 1G, 1.5GiB (binary) or 2GB (decimal).
        #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
        size: u64,
    },
    /// Write zeros over an image's holes and unwritten extents and make it
    /// `full`: eligible for `direct` again. Runs in the service; this waits
    /// for its end, showing progress on stderr.
    Allocate {
        /// Image id or name.
        image: String,
        /// Answer once started (follow it with `image show`).
        #[arg(long, conflicts_with = "cancel")]
        no_wait: bool,
        /// Stop the image's running allocate instead.
        #[arg(long)]
        cancel: bool,
    },
    /// Snapshot an image: a read-only image NAME next to SRC's file,
    /// extents shared where the filesystem can, else copied in the service
    /// (this waits for the copy, showing progress on stderr).
    Snapshot {
        /// The image to snapshot (id or name).
        src: String,
        /// The snapshot's name (letters, digits, '.', '_', '-').
        name: String,
        /// Answer once started (follow it with `image show`).
        #[arg(long)]
        no_wait: bool,
    },
    /// Clone an image: a writable image NAME at PATH made from SRC (shared
    /// extents, or a copy this waits for, showing progress on stderr).
    Clone {
        /// The image to clone (id or name).
        src: String,
        /// The clone's name (letters, digits, '.', '_', '-').
        name: String,
        /// The clone's file (must not exist), under one of the service's image roots.
        path: String,
        /// Answer once started (follow it with `image show`).
        #[arg(long)]
        no_wait: bool,
    },
    /// Forget an image.
    #[command(visible_alias = "delete")]
    Rm {
        /// Image id or name.
        image: String,
        /// Also delete the file.
        #[arg(long)]
        delete_file: bool,
    },
}

#[derive(Debug, Subcommand)]
enum VolumeCmd {
    /// Create a volume (idempotent by name).
    Create {
        /// The volume's name (letters, digits, '.', '_', '-').
        name: String,
        /// Image id or name (one image serves one volume).
        #[arg(long)]
        image: String,
        /// Kernel device kind: loop, ublk (our userspace server) or dm
        /// (device-mapper); auto picks the best this host has.
        #[arg(long, default_value = "auto", value_parser = ["auto", "loop", "ublk", "dm"])]
        backend: String,
        /// How a ublk or dm volume does its I/O: nowait (io_uring, NOWAIT
        /// first), threaded (blocking workers), direct (straight to the disk
        /// through the image's extent map); auto picks direct when the image
        /// allows it. Switchable live with `volume set`.
        #[arg(long, default_value = "auto", value_parser = ["auto", "nowait", "threaded", "direct"])]
        dispatch: String,
        /// Create the device read-only (it can never be made writable live).
        #[arg(long)]
        read_only: bool,
        /// Queues [default: the service's: one per CPU for ublk and dm, 1 for loop].
        #[arg(long)]
        queues: Option<u16>,
        /// Requests each queue holds at once.
        #[arg(long, default_value_t = 128)]
        queue_depth: u16,
        /// Largest request, bytes (power of two, 4K to 1M).
        #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
        max_io_bytes: Option<u64>,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// List volumes.
    #[command(visible_alias = "list")]
    Ls,
    /// Show one volume.
    Show {
        /// Volume id or name.
        volume: String,
    },
    /// Change a volume live (at least one change).
    #[command(group(clap::ArgGroup::new("change").required(true).multiple(true).args([
        "dispatch", "read_only", "qos_iops", "qos_bytes_per_sec", "qos_burst_iops",
        "qos_burst_bytes", "no_qos",
    ])))]
    Set {
        /// Volume id or name.
        volume: String,
        /// The dispatch policy to switch to, live (ublk and dm).
        #[arg(long, value_parser = ["auto", "nowait", "threaded", "direct"])]
        dispatch: Option<String>,
        /// Refuse (true) or allow (false) writes, live (ublk and dm).
        #[arg(long)]
        read_only: Option<bool>,
        #[command(flatten)]
        qos: QosArgs,
        /// Remove all QoS limits.
        #[arg(long, conflicts_with_all = ["qos_iops", "qos_bytes_per_sec", "qos_burst_iops", "qos_burst_bytes"])]
        no_qos: bool,
    },
    /// A volume's I/O counters.
    Stats {
        /// Volume id or name.
        volume: String,
    },
    /// Every attached volume's last second, refreshed each second (like
    /// `iostat -x 1`): IOPS, bandwidth, mean latency, requests in flight.
    Top {
        /// Stop after this many screens [default: run until interrupted].
        #[arg(long)]
        count: Option<u32>,
    },
    /// Delete a volume (its device goes away; the image stays). A volume
    /// in use (open by a process, mounted, or with I/O in its last seconds)
    /// is refused unless --force, or the volume's name typed at the prompt
    /// when stdin is a terminal.
    #[command(visible_alias = "delete")]
    Rm {
        /// Volume id or name.
        volume: String,
        /// Delete even while in use (what uses it then sees I/O errors).
        #[arg(long)]
        force: bool,
    },
}

impl Command {
    /// The client flags given with this command, for the API's clients.
    fn client(&self) -> Option<&ClientArgs> {
        match self {
            Command::Host { client }
            | Command::Image { client, .. }
            | Command::Volume { client, .. }
            | Command::Events { client, .. } => Some(client),
            _ => None,
        }
    }
}

/// QoS limits of a ublk volume (token buckets over reads and writes together).
#[derive(Debug, clap::Args)]
struct QosArgs {
    /// IOPS limit.
    #[arg(long)]
    qos_iops: Option<u64>,
    /// Bandwidth limit, bytes/s: bytes, or 100M, 1.5G (binary) or 100MB (decimal).
    #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
    qos_bytes_per_sec: Option<u64>,
    /// IOPS bucket: requests that may go at once after a quiet spell [default: the IOPS limit].
    #[arg(long)]
    qos_burst_iops: Option<u64>,
    /// Bandwidth bucket: bytes that may go at once after a quiet spell [default: the bandwidth limit].
    #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
    qos_burst_bytes: Option<u64>,
}

impl QosArgs {
    /// The `qos` object, when any limit is given.
    fn to_json(&self) -> Option<Value> {
        let Self {
            qos_iops,
            qos_bytes_per_sec,
            qos_burst_iops,
            qos_burst_bytes,
        } = self;
        let any = [qos_iops, qos_bytes_per_sec, qos_burst_iops, qos_burst_bytes]
            .iter()
            .any(|v| v.is_some());
        any.then(|| {
            json!({"iops": qos_iops, "bytes_per_sec": qos_bytes_per_sec,
                   "burst_iops": qos_burst_iops, "burst_bytes": qos_burst_bytes})
        })
    }
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    // Before the command the client flags are plain ones: global there, they
    // would reach `serve` and the other commands that are no API client.
    let mut cmd = Cli::command();
    for id in CLIENT_FLAGS {
        cmd = cmd.mut_arg(id, |a| a.global(false));
    }
    let matches = cmd.get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some((sub @ ("serve" | "worker" | "backup" | "openapi"), _)) = matches.subcommand()
        && let Some(flag) = CLIENT_FLAGS
            .iter()
            .find(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
    {
        eprintln!(
            "blockplane: --{flag} is a flag of the API's clients; `{sub}` does not take it (see blockplane {sub} --help)"
        );
        return ExitCode::from(2);
    }
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Worker { spec } => blockplane_worker::main(&spec),
        Command::Csi {
            args,
            log_format,
            api,
        } => csi(args, log_format, api.or(&cli.client.api)),
        Command::Backup { data_dir, file } => backup(data_dir, &file),
        Command::Dashboard { listen, api } => {
            let a = api.or(&cli.client.api);
            dashboard(a.api.as_deref(), a.token, &listen)
        }
        Command::Openapi => {
            let _ = std::io::Write::write_all(
                &mut std::io::stdout(),
                blockplane_server::openapi_json().as_bytes(),
            );
            ExitCode::SUCCESS
        }
        _ => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(run_client(cli))
        }
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    let cfg = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::from(2);
        }
    };
    logging::init(cfg.log_format);
    let rt = multi_thread_runtime();
    match rt.block_on(blockplane_server::serve(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "blockplane stopped");
            eprintln!("blockplane: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `blockplane backup`: SQLite's `VACUUM INTO`, a consistent snapshot even
/// while the service writes (it reads like any other reader of the WAL).
fn backup(data_dir: Option<std::path::PathBuf>, file: &std::path::Path) -> ExitCode {
    use std::os::unix::fs::OpenOptionsExt;
    let db = data_dir
        .unwrap_or_else(default_data_dir)
        .join("blockplane.db");
    if !db.is_file() {
        eprintln!("blockplane: no registry at {}", db.display());
        return ExitCode::FAILURE;
    }
    // Made here, empty, so the copy is private from its first byte and an
    // existing file is never replaced.
    if let Err(e) = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(file)
    {
        eprintln!("blockplane: backup file {}: {e}", file.display());
        return ExitCode::FAILURE;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(blockplane_server::backup_registry(&db, file)) {
        Ok(()) => {
            println!("backed up {} to {}", db.display(), file.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = std::fs::remove_file(file);
            eprintln!("blockplane: backup of {}: {e}", db.display());
            ExitCode::FAILURE
        }
    }
}

fn csi(args: blockplane_csi::CsiArgs, log_format: LogFormat, api: ApiArgs) -> ExitCode {
    logging::init(log_format);
    let address = api_address(api.api.as_deref());
    let rt = multi_thread_runtime();
    match rt.block_on(blockplane_csi::serve(args, &address, api.token)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "CSI driver stopped");
            eprintln!("blockplane csi: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The runtime for the long-running subcommands.
fn multi_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The API address given, or the local service's socket.
fn api_address(api: Option<&str>) -> String {
    api.map(str::to_string)
        .unwrap_or_else(|| format!("unix:{}", default_socket(&default_data_dir()).display()))
}

fn dashboard(api: Option<&str>, token: Option<String>, listen: &str) -> ExitCode {
    let api = api_address(api);
    let cfg = match Endpoint::parse(&api)
        .map_err(|e| e.to_string())
        .and_then(|up| ProxyConfig::new(listen, up, token).map_err(|e| e.to_string()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = multi_thread_runtime();
    let ready = |addr: std::net::SocketAddr| {
        // One line on stdout, flushed, so that scripts can wait for it.
        let line = format!("dashboard at http://{addr}/ (API {api})\n");
        let mut out = std::io::stdout();
        let _ = std::io::Write::write_all(&mut out, line.as_bytes());
        let _ = std::io::Write::flush(&mut out);
    };
    match rt.block_on(blockplane_server::proxy::run(cfg, ready)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blockplane: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run_client(cli: Cli) -> ExitCode {
    let flags = cli
        .command
        .client()
        .map(|c| c.or(&cli.client))
        .unwrap_or_else(|| cli.client.clone());
    let api = api_address(flags.api.api.as_deref());
    let client = match Endpoint::parse(&api) {
        Ok(e) => Transport::new(e, flags.api.token.clone()),
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::from(2);
        }
    };
    let as_json = flags.json;
    match &cli.command {
        Command::Volume {
            cmd: VolumeCmd::Top { count },
            ..
        } => return top(&client, *count, as_json).await,
        Command::Events {
            follow: true,
            volume,
            ..
        } => return follow_events(&client, &cli.command, volume.as_deref(), as_json).await,
        Command::Volume {
            cmd: VolumeCmd::Rm {
                volume,
                force: false,
            },
            ..
        } => {
            if let Err(code) = refuse_if_busy(&client, volume).await {
                return code;
            }
        }
        _ => {}
    }
    let (method, path, body, view) = request_for(&cli.command);
    let mut answer = match call(&client, method, &path, body.as_ref()).await {
        Ok(a) => a,
        Err(code) => return code,
    };
    let followed = match &cli.command {
        Command::Image {
            cmd:
                ImageCmd::Allocate {
                    image,
                    no_wait: false,
                    cancel: false,
                },
            ..
        } => Some(wait_allocate(&client, image, answer.body.clone()).await),
        Command::Image {
            cmd:
                ImageCmd::Snapshot {
                    name,
                    no_wait: false,
                    ..
                }
                | ImageCmd::Clone {
                    name,
                    no_wait: false,
                    ..
                },
            ..
        } => Some(wait_copy(&client, name, answer.body.clone()).await),
        _ => None,
    };
    match followed {
        Some(Ok(body)) => answer.body = body,
        Some(Err(msg)) => {
            eprintln!("blockplane: {msg}");
            return ExitCode::FAILURE;
        }
        None => {}
    }
    let text = if as_json {
        if answer.body.is_null() {
            String::new()
        } else {
            serde_json::to_string_pretty(&answer.body).unwrap_or_default() + "\n"
        }
    } else {
        render(view, &answer.body, &Names::for_view(&client, view).await)
    };
    // A closed stdout (`| head`) is not an error of ours.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    ExitCode::SUCCESS
}

/// One API call; a failure is printed and becomes the exit code.
async fn call(
    client: &Transport,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<blockplane_api::client::Answer, ExitCode> {
    let answer = match client.send(method, path, body).await {
        Ok(a) => a,
        Err(e) => {
            eprintln!("blockplane: {e}");
            return Err(ExitCode::FAILURE);
        }
    };
    if !answer.status.is_success() {
        let code = answer.body["error"]["code"].as_str().unwrap_or("unknown");
        let msg = answer.body["error"]["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| answer.body.to_string());
        let hint = if answer.status == hyper::StatusCode::UNAUTHORIZED {
            "; give the API's token with --token or BLOCKPLANE_TOKEN"
        } else {
            ""
        };
        eprintln!(
            "blockplane: {msg} ({code}, HTTP {}){hint}",
            answer.status.as_u16()
        );
        return Err(ExitCode::FAILURE);
    }
    Ok(answer)
}

/// `events --follow`: the events asked for, then each new one as the
/// service records it, one per line (one JSON object per line with --json),
/// until interrupted or the service stops.
async fn follow_events(
    client: &Transport,
    cmd: &Command,
    volume: Option<&str>,
    as_json: bool,
) -> ExitCode {
    use http_body_util::BodyExt;
    let print = |e: &Value| {
        let line = if as_json {
            e.to_string() + "\n"
        } else {
            event_line(e)
        };
        std::io::Write::write_all(&mut std::io::stdout(), line.as_bytes()).is_ok()
    };
    let (method, path, _, _) = request_for(cmd);
    let past = match call(client, method, &path, None).await {
        Ok(a) => a.body.as_array().cloned().unwrap_or_default(),
        Err(code) => return code,
    };
    for e in &past {
        if !print(e) {
            return ExitCode::SUCCESS;
        }
    }
    let mut q = Vec::new();
    if let Some(v) = volume {
        q.push(format!("volume={}", encode_segment(v)));
    }
    if let Some(id) = past.last().and_then(|e| e["id"].as_i64()) {
        q.push(format!("after={id}"));
    }
    let path = format!("/v1/events/stream?{}", q.join("&"));
    let mut body = match client.open(Method::GET, &path).await {
        Ok((status, body)) if status.is_success() => body,
        Ok((status, _)) => {
            eprintln!(
                "blockplane: the event stream answered HTTP {}",
                status.as_u16()
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Server-sent events: blocks of `field: value` lines, a blank line after each.
    let mut buf = String::new();
    while let Some(Ok(frame)) = body.frame().await {
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let data: String = block
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            if let Ok(e) = serde_json::from_str::<Value>(&data)
                && !print(&e)
            {
                return ExitCode::SUCCESS;
            }
        }
    }
    eprintln!("blockplane: the event stream ended (the service stopped)");
    ExitCode::FAILURE
}

/// `volume rm` without --force: a volume in use is deleted only when the
/// person at the terminal types its name; otherwise refused, saying why.
async fn refuse_if_busy(client: &Transport, volume: &str) -> Result<(), ExitCode> {
    use std::io::IsTerminal;
    let path = format!("/v1/volumes/{}/usage", encode_segment(volume));
    let usage = call(client, Method::GET, &path, None).await?.body;
    if usage["busy"] != json!(true) {
        return Ok(());
    }
    let name = s(&usage["name"]);
    let why = usage["reasons"]
        .as_array()
        .map(|r| r.iter().map(s).collect::<Vec<_>>().join("; "))
        .unwrap_or_default();
    if std::io::stdin().is_terminal() {
        eprint!("volume '{name}' is in use: {why}.\nType its name to delete it anyway: ");
        let mut typed = String::new();
        let _ = std::io::stdin().read_line(&mut typed);
        if typed.trim() == name {
            return Ok(());
        }
        eprintln!("blockplane: volume '{name}' not deleted (the name was not typed)");
    } else {
        eprintln!(
            "blockplane: volume '{name}' is in use: {why}; not deleted (give --force to delete it anyway)"
        );
    }
    Err(ExitCode::FAILURE)
}

/// `volume top`: a screen a second from each attached volume's last point
/// of history.
async fn top(client: &Transport, count: Option<u32>, as_json: bool) -> ExitCode {
    use std::io::IsTerminal;
    let clear = !as_json && std::io::stdout().is_terminal();
    let mut shown = 0;
    loop {
        let volumes = match call(client, Method::GET, "/v1/volumes", None).await {
            Ok(a) => a.body.as_array().cloned().unwrap_or_default(),
            Err(code) => return code,
        };
        let mut rows = Vec::new();
        for v in volumes
            .iter()
            .filter(|v| matches!(v["state"].as_str(), Some("attached" | "degraded")))
        {
            let path = format!(
                "/v1/volumes/{}/stats/history?seconds=1",
                encode_segment(&s(&v["id"]))
            );
            // A volume deleted meanwhile is not an error of the screen.
            let Ok(a) = client.send(Method::GET, &path, None).await else {
                continue;
            };
            let point = a.body["points"]
                .as_array()
                .and_then(|p| p.last().cloned())
                .unwrap_or(Value::Null);
            rows.push((v.clone(), point));
        }
        let text = if as_json {
            let frame: Vec<Value> = rows
                .iter()
                .map(|(v, p)| json!({"volume": v["name"], "point": p}))
                .collect();
            Value::Array(frame).to_string() + "\n"
        } else {
            top_screen(&rows, clear)
        };
        if std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes()).is_err() {
            return ExitCode::SUCCESS;
        }
        shown += 1;
        if count.is_some_and(|c| shown >= c) {
            return ExitCode::SUCCESS;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// One screen of `volume top`.
fn top_screen(rows: &[(Value, Value)], clear: bool) -> String {
    let rate = |p: &Value, op: &str, key: &str, div: f64| match p[op][key].as_f64() {
        Some(x) => format!("{:.1}", x / div),
        None => "-".into(),
    };
    let latency_ms = |p: &Value, op: &str| match p[op]["latency_us"].as_f64() {
        Some(us) => format!("{:.2}", us / 1000.0),
        None => "-".into(),
    };
    let body = rows
        .iter()
        .map(|(v, p)| {
            vec![
                s(&v["name"]),
                s(&v["backend"]),
                s(&v["dispatch"]),
                rate(p, "read", "iops", 1.0),
                rate(p, "write", "iops", 1.0),
                rate(p, "read", "bytes_per_sec", 1048576.0),
                rate(p, "write", "bytes_per_sec", 1048576.0),
                latency_ms(p, "read"),
                latency_ms(p, "write"),
                s(&p["in_flight"]),
            ]
        })
        .collect();
    let now = time::OffsetDateTime::now_utc();
    let mut out = String::new();
    if clear {
        out += "\x1b[H\x1b[2J";
    }
    out += &format!(
        "{:02}:{:02}:{:02} UTC  {} attached volume(s); rates over the last second, latency in ms\n",
        now.hour(),
        now.minute(),
        now.second(),
        rows.len()
    );
    out += &table(
        &[
            "VOLUME", "BACKEND", "DISPATCH", "R/S", "W/S", "RMIB/S", "WMIB/S", "R_AWAIT",
            "W_AWAIT", "INFLIGHT",
        ],
        body,
    );
    out + "\n"
}

/// Follows an image's allocate until it ends, its progress on stderr:
/// the image when done, why not otherwise.
async fn wait_allocate(client: &Transport, image: &str, body: Value) -> Result<Value, String> {
    follow_image(client, image, body, |b| {
        let a = &b["allocate"];
        match a["state"].as_str() {
            Some("running") => {
                eprintln!(
                    "allocating image '{image}': {} of {}",
                    human_bytes(&a["done_bytes"]),
                    human_bytes(&a["total_bytes"])
                );
                None
            }
            Some("done") => Some(Ok(())),
            other => Some(Err(format!(
                "the allocate of image '{image}' ended {}{}; the image stays as it was declared (allocate again)",
                other.unwrap_or("unseen"),
                a["error"]
                    .as_str()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ))),
        }
    })
    .await
}

/// Follows a snapshot's or clone's copy until the image is ready, its
/// progress on stderr: the image when ready, why not otherwise.
async fn wait_copy(client: &Transport, image: &str, body: Value) -> Result<Value, String> {
    follow_image(client, image, body, |b| match b["state"].as_str() {
        Some("copying") => {
            eprintln!(
                "copying image '{image}': {} of {}",
                human_bytes(&b["copied_bytes"]),
                human_bytes(&b["copy_total_bytes"])
            );
            None
        }
        Some("ready") => Some(Ok(())),
        other => Some(Err(format!(
            "the copy of image '{image}' ended {}: {}",
            other.unwrap_or("unseen"),
            b["state_reason"].as_str().unwrap_or("no reason given")
        ))),
    })
    .await
}

/// Reads an image once a second until `step` says it is done (`Some`):
/// the image's last view, or `step`'s reason.
async fn follow_image(
    client: &Transport,
    image: &str,
    mut body: Value,
    step: impl Fn(&Value) -> Option<Result<(), String>>,
) -> Result<Value, String> {
    let path = format!("/v1/images/{}", encode_segment(image));
    loop {
        if let Some(end) = step(&body) {
            return end.map(|()| body);
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        body = match client.send(Method::GET, &path, None).await {
            Ok(a) if a.status.is_success() => a.body,
            Ok(a) => return Err(format!("HTTP {}: {}", a.status.as_u16(), a.body)),
            Err(e) => return Err(e.to_string()),
        };
    }
}

/// How to show an answer to people.
#[derive(Debug, Clone, Copy)]
enum View {
    Host,
    Image,
    Images,
    Volume,
    Volumes,
    Resize,
    Stats,
    Events,
    Done(&'static str),
}

fn request_for(cmd: &Command) -> (Method, String, Option<Value>, View) {
    use Method as M;
    match cmd {
        Command::Serve(_)
        | Command::Openapi
        | Command::Worker { .. }
        | Command::Csi { .. }
        | Command::Backup { .. }
        | Command::Dashboard { .. } => {
            unreachable!("handled without the API")
        }
        Command::Host { .. } => (M::GET, "/v1/host".into(), None, View::Host),
        Command::Events {
            volume,
            since,
            limit,
            ..
        } => {
            let mut q = Vec::new();
            if let Some(v) = volume {
                q.push(format!("volume={}", encode_segment(v)));
            }
            if let Some(t) = since {
                q.push(format!("since={}", encode_segment(t)));
            }
            if let Some(l) = limit {
                q.push(format!("limit={l}"));
            }
            let qs = if q.is_empty() {
                String::new()
            } else {
                format!("?{}", q.join("&"))
            };
            (M::GET, format!("/v1/events{qs}"), None, View::Events)
        }
        Command::Image { cmd, .. } => match cmd {
            ImageCmd::Add { name, path } => (
                M::POST,
                "/v1/images".into(),
                Some(json!({"name": name, "path": path})),
                View::Image,
            ),
            ImageCmd::Create {
                name,
                path,
                size,
                allocation,
            } => (
                M::POST,
                "/v1/images".into(),
                Some(
                    json!({"name": name, "path": path, "create": {"size_bytes": size, "allocation": allocation}}),
                ),
                View::Image,
            ),
            ImageCmd::Ls => (M::GET, "/v1/images".into(), None, View::Images),
            ImageCmd::Show { image } => (
                M::GET,
                format!("/v1/images/{}", encode_segment(image)),
                None,
                View::Image,
            ),
            ImageCmd::Resize { image, size } => (
                M::POST,
                format!("/v1/images/{}/resize", encode_segment(image)),
                Some(json!({"size_bytes": size})),
                View::Resize,
            ),
            ImageCmd::Allocate { image, cancel, .. } => (
                if *cancel { M::DELETE } else { M::POST },
                format!("/v1/images/{}/allocate", encode_segment(image)),
                None,
                View::Image,
            ),
            ImageCmd::Snapshot { src, name, .. } => (
                M::POST,
                format!("/v1/images/{}/snapshots", encode_segment(src)),
                Some(json!({"name": name})),
                View::Image,
            ),
            ImageCmd::Clone {
                src, name, path, ..
            } => (
                M::POST,
                "/v1/images".into(),
                Some(json!({"name": name, "path": path, "clone_from": src})),
                View::Image,
            ),
            ImageCmd::Rm { image, delete_file } => (
                M::DELETE,
                format!(
                    "/v1/images/{}?delete_file={delete_file}",
                    encode_segment(image)
                ),
                None,
                View::Done("image removed"),
            ),
        },
        Command::Volume { cmd, .. } => match cmd {
            VolumeCmd::Create {
                name,
                image,
                backend,
                dispatch,
                read_only,
                queues,
                queue_depth,
                max_io_bytes,
                qos,
            } => {
                let mut body = json!({
                    "name": name, "image": image, "backend": backend, "dispatch": dispatch,
                    "read_only": read_only, "queue_depth": queue_depth,
                });
                if let Some(q) = queues {
                    body["queues"] = json!(q);
                }
                if let Some(m) = max_io_bytes {
                    body["max_io_bytes"] = json!(m);
                }
                if let Some(q) = qos.to_json() {
                    body["qos"] = q;
                }
                (M::POST, "/v1/volumes".into(), Some(body), View::Volume)
            }
            VolumeCmd::Ls => (M::GET, "/v1/volumes".into(), None, View::Volumes),
            VolumeCmd::Show { volume } => (
                M::GET,
                format!("/v1/volumes/{}", encode_segment(volume)),
                None,
                View::Volume,
            ),
            VolumeCmd::Set {
                volume,
                dispatch,
                read_only,
                qos,
                no_qos,
            } => {
                let mut patch = serde_json::Map::new();
                if let Some(d) = dispatch {
                    patch.insert("dispatch".into(), json!(d));
                }
                if let Some(ro) = read_only {
                    patch.insert("read_only".into(), json!(ro));
                }
                if *no_qos {
                    patch.insert("qos".into(), Value::Null);
                } else if let Some(q) = qos.to_json() {
                    patch.insert("qos".into(), q);
                }
                (
                    M::PATCH,
                    format!("/v1/volumes/{}", encode_segment(volume)),
                    Some(Value::Object(patch)),
                    View::Volume,
                )
            }
            VolumeCmd::Stats { volume } => (
                M::GET,
                format!("/v1/volumes/{}/stats", encode_segment(volume)),
                None,
                View::Stats,
            ),
            VolumeCmd::Top { .. } => unreachable!("a loop of calls, see `top`"),
            VolumeCmd::Rm { volume, .. } => (
                M::DELETE,
                format!("/v1/volumes/{}", encode_segment(volume)),
                None,
                View::Done("volume deleted"),
            ),
        },
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn human_bytes(v: &Value) -> String {
    v.as_u64().map(human_size).unwrap_or_else(|| s(v))
}

/// The images and volumes a view refers to by id, to show their names
/// instead; empty when not needed or not readable (ids are shown then).
#[derive(Debug, Default)]
struct Names {
    images: Vec<Value>,
    volumes: Vec<Value>,
}

impl Names {
    async fn for_view(client: &Transport, view: View) -> Self {
        let list = |path: &'static str| async move {
            match client.send(Method::GET, path, None).await {
                Ok(a) if a.status.is_success() => a.body.as_array().cloned().unwrap_or_default(),
                _ => Vec::new(),
            }
        };
        match view {
            View::Volume | View::Volumes => Names {
                images: list("/v1/images").await,
                ..Default::default()
            },
            View::Image | View::Resize | View::Stats => Names {
                volumes: list("/v1/volumes").await,
                ..Default::default()
            },
            _ => Names::default(),
        }
    }

    /// A volume's image as people know it: its name (and path, when
    /// `with_path`), else its id.
    fn image_of(&self, v: &Value, with_path: bool) -> String {
        match self.images.iter().find(|i| i["id"] == v["image_id"]) {
            Some(i) if with_path => format!("{} ({})", s(&i["name"]), s(&i["path"])),
            Some(i) => s(&i["name"]),
            None => s(&v["image_id"]),
        }
    }

    /// A volume's name, from its id; the id when unknown.
    fn volume(&self, id: &Value) -> String {
        self.volumes
            .iter()
            .find(|v| &v["id"] == id)
            .map_or_else(|| s(id), |v| s(&v["name"]))
    }
}

/// One event on one line, as `events --follow` prints them.
fn event_line(e: &Value) -> String {
    format!(
        "{}  {}  {}  {}\n",
        s(&e["id"]),
        s(&e["at"]),
        s(&e["kind"]),
        s(&e["message"])
    )
}

/// Left-aligned columns, two spaces apart.
fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        out.truncate(out.trim_end().len());
        out + "\n"
    };
    let mut out = line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out += &line(r);
    }
    out
}

fn fields(pairs: Vec<(&str, String)>) -> String {
    let w = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    pairs
        .into_iter()
        .map(|(k, v)| format!("{k:<w$}  {v}\n"))
        .collect()
}

fn render(view: View, b: &Value, names: &Names) -> String {
    let list = |v: &Value| v.as_array().cloned().unwrap_or_default();
    match view {
        View::Done(msg) => format!("{msg}\n"),
        View::Host => {
            let mut out = fields(vec![
                ("kernel", s(&b["kernel"])),
                ("version", s(&b["version"])),
                ("default backend", s(&b["default_backend"])),
                (
                    "image roots",
                    list(&b["image_root_capacity"])
                        .iter()
                        .map(|r| {
                            format!(
                                "{} ({} free of {})",
                                s(&r["path"]),
                                human_bytes(&r["free_bytes"]),
                                human_bytes(&r["size_bytes"])
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
            ]);
            let cap = |c: &Value| {
                if c["available"] == json!(true) {
                    "yes".to_string()
                } else {
                    format!("no: {}", s(&c["reason"]))
                }
            };
            let mut rows = Vec::new();
            for k in ["loop", "ublk", "dm"] {
                rows.push(vec![format!("backend {k}"), cap(&b["backends"][k])]);
            }
            for k in ["nowait", "threaded", "direct"] {
                rows.push(vec![format!("policy {k}"), cap(&b["policies"][k])]);
            }
            out += "\n";
            out += &table(&["CAPABILITY", "AVAILABLE HERE"], rows);
            out
        }
        View::Image => {
            let mut out = fields(vec![
                ("id", s(&b["id"])),
                ("name", s(&b["name"])),
                ("path", s(&b["path"])),
                ("size", human_bytes(&b["size_bytes"])),
                ("allocated", human_bytes(&b["allocated_bytes"])),
                ("filesystem", s(&b["filesystem"])),
                ("allocation", s(&b["allocation"])),
                (
                    "state",
                    match b["state_reason"].as_str() {
                        Some(why) => format!("{}: {why}", s(&b["state"])),
                        None => s(&b["state"]),
                    },
                ),
                ("read only", s(&b["read_only"])),
                ("snapshot of", s(&b["snapshot_of"])),
                ("cloned from", s(&b["cloned_from"])),
                ("method", s(&b["method"])),
                (
                    "allocate",
                    match b["allocate"]["state"].as_str() {
                        None => String::new(),
                        Some(st) => format!(
                            "{st}: {} of {}",
                            human_bytes(&b["allocate"]["done_bytes"]),
                            human_bytes(&b["allocate"]["total_bytes"])
                        ),
                    },
                ),
                (
                    "volumes",
                    list(&b["volumes"])
                        .iter()
                        .map(|id| names.volume(id))
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
                ("created", s(&b["created_at"])),
            ]);
            for w in list(&b["warnings"]) {
                out += &format!("warning: {}\n", s(&w));
            }
            out
        }
        View::Resize => {
            let mut out = render(View::Image, &b["image"], names);
            for v in list(&b["volumes"]) {
                out += &format!("volume {}: {}\n", s(&v["name"]), s(&v["message"]));
            }
            out
        }
        View::Images => table(
            &["NAME", "SIZE", "ALLOCATED", "FS", "VOLUMES", "PATH"],
            list(b)
                .iter()
                .map(|i| {
                    vec![
                        s(&i["name"]),
                        human_bytes(&i["size_bytes"]),
                        human_bytes(&i["allocated_bytes"]),
                        s(&i["filesystem"]),
                        list(&i["volumes"]).len().to_string(),
                        s(&i["path"]),
                    ]
                })
                .collect(),
        ),
        View::Volume => fields(vec![
            ("id", s(&b["id"])),
            ("name", s(&b["name"])),
            ("image", names.image_of(b, true)),
            ("backend", s(&b["backend"])),
            (
                "dispatch",
                format!(
                    "{} (asked {}): {}",
                    s(&b["dispatch"]),
                    s(&b["requested_dispatch"]),
                    s(&b["dispatch_reason"])
                ),
            ),
            (
                "state",
                match &b["state_reason"] {
                    Value::Null => s(&b["state"]),
                    r => format!("{}: {}", s(&b["state"]), s(r)),
                },
            ),
            ("device", s(&b["device"])),
            ("size", human_bytes(&b["size_bytes"])),
            ("read only", s(&b["read_only"])),
            (
                "queues",
                match &b["copy_mode"] {
                    Value::Null => format!("{} x depth {}", s(&b["queues"]), s(&b["queue_depth"])),
                    m => format!(
                        "{} x depth {}, {}",
                        s(&b["queues"]),
                        s(&b["queue_depth"]),
                        s(m)
                    ),
                },
            ),
            ("qos", s(&b["qos"])),
            ("direct io", s(&b["direct_io"])),
            ("created", s(&b["created_at"])),
            ("updated", s(&b["updated_at"])),
        ]),
        View::Volumes => table(
            &[
                "NAME", "IMAGE", "BACKEND", "DISPATCH", "STATE", "DEVICE", "SIZE", "RO",
            ],
            list(b)
                .iter()
                .map(|v| {
                    vec![
                        s(&v["name"]),
                        names.image_of(v, false),
                        s(&v["backend"]),
                        s(&v["dispatch"]),
                        s(&v["state"]),
                        s(&v["device"]),
                        human_bytes(&v["size_bytes"]),
                        s(&v["read_only"]),
                    ]
                })
                .collect(),
        ),
        View::Stats => {
            let mut out = fields(vec![
                ("volume", names.volume(&b["volume_id"])),
                ("dispatch", s(&b["dispatch"])),
                ("in flight", s(&b["in_flight"])),
                ("since", s(&b["since"])),
            ]);
            out += &table(
                &["OP", "OPS", "BYTES", "ERRORS"],
                ["read", "write", "flush", "discard"]
                    .iter()
                    .map(|op| {
                        vec![
                            op.to_string(),
                            s(&b[op]["ops"]),
                            human_bytes(&b[op]["bytes"]),
                            s(&b[op]["errors"]),
                        ]
                    })
                    .collect(),
            );
            // The nowait path, where the volume has one (ublk workers).
            let n = &b["nowait"];
            if n.is_object() {
                out += &fields(vec![
                    ("nowait submitted", s(&n["submitted"])),
                    ("nowait inline", s(&n["completed_inline"])),
                    ("nowait EAGAIN fallbacks", s(&n["eagain_fallbacks"])),
                    ("nowait pauses", s(&n["pauses"])),
                    ("nowait bypassed (paused)", s(&n["bypassed"])),
                ]);
            }
            out
        }
        View::Events => table(
            &["ID", "AT", "KIND", "MESSAGE"],
            list(b)
                .iter()
                .map(|e| vec![s(&e["id"]), s(&e["at"]), s(&e["kind"]), s(&e["message"])])
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
        assert_eq!(encode_segment("vol-1.x_y"), "vol-1.x_y");
    }

    /// Every flag and positional argument of every command says what it is.
    #[test]
    fn every_argument_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                if a.get_help().is_none() && !matches!(a.get_id().as_str(), "help" | "version") {
                    missing.push(format!("{path} {}", a.get_id()));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "blockplane", &mut missing);
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }

    #[test]
    fn tables_align() {
        let t = table(&["A", "BB"], vec![vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "A    BB\nxxx  y\n");
    }
}
