//! The command line's definition (clap): the commands, their flags and
//! what each flag takes.

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use serde::de::DeserializeOwned;

use blockplane_api::model::{
    Allocation, BackendChoice, DispatchPolicy, ExportAuth, Qos, parse_size, parse_wire,
};
use blockplane_server::config::ServeArgs;
use blockplane_server::logging::LogFormat;

/// blockplane: image files as fast, safe block devices.
///
/// The client flags (--api, --token, --json) go before the command or with
/// any client command; `serve` has flags of its own only.
#[derive(Debug, Parser)]
#[command(name = "blockplane", version, about)]
pub struct Cli {
    /// Given before the command (not global here: see [`super::main`]).
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// How a client reaches the API. Global within each client command, so that
/// they may follow its subcommands too.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ApiArgs {
    /// API address: unix:/path.sock or http://host:port [default: the local service's socket].
    #[arg(long, global = true, env = "BLOCKPLANE_API")]
    pub api: Option<String>,
    /// Bearer token for the API.
    #[arg(long, global = true, env = "BLOCKPLANE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the bearer token (a mounted Secret): the token then
    /// appears in no argument and no environment.
    #[arg(
        long,
        global = true,
        env = "BLOCKPLANE_TOKEN_FILE",
        conflicts_with = "token"
    )]
    pub token_file: Option<std::path::PathBuf>,
}

/// The flags of the commands that print the API's answers.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClientArgs {
    #[command(flatten)]
    pub api: ApiArgs,
    /// Print the API's JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

impl ClientArgs {
    /// These flags given with the command, over those given before it.
    pub fn or(&self, before: &ClientArgs) -> ClientArgs {
        ClientArgs {
            api: self.api.or(&before.api),
            json: self.json || before.json,
        }
    }
}

impl ApiArgs {
    /// These flags given with the command, over those given before it.
    pub fn or(&self, before: &ApiArgs) -> ApiArgs {
        ApiArgs {
            api: self.api.clone().or_else(|| before.api.clone()),
            token: self.token.clone().or_else(|| before.token.clone()),
            token_file: self
                .token_file
                .clone()
                .or_else(|| before.token_file.clone()),
        }
    }

    /// The token: `--token`, else the content of `--token-file` (one line).
    pub fn token(&self) -> Result<Option<String>, String> {
        if let Some(t) = &self.token {
            return Ok(Some(t.clone()));
        }
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--token-file {}: {e}", path.display()))?;
        let token = text.trim_end_matches(['\n', '\r']);
        if token.is_empty() {
            return Err(format!(
                "--token-file {}: the file is empty",
                path.display()
            ));
        }
        Ok(Some(token.to_string()))
    }
}

/// The ids of the client flags given before the command.
pub const CLIENT_FLAGS: [&str; 4] = ["api", "token", "token_file", "json"];

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
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
    /// Volumes served to other hosts over NVMe/TCP (the service's
    /// --export-address), each host authenticated with DH-HMAC-CHAP.
    Export {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        cmd: ExportCmd,
    },
    /// Remote volumes: other hosts' exports, connected here over NVMe/TCP.
    Remote {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        cmd: RemoteCmd,
    },
    /// Moves: a remote volume's data brought to this host, live. Its
    /// consumer keeps its device while the kernel copies the data into a
    /// new local image; then the exporting host lets its volume go.
    Move {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        cmd: MoveCmd,
    },
    /// Hand volumes over to new workers of the service's build, live: the
    /// devices stay, I/O goes on. Every volume whose worker is another build
    /// (after the service itself was upgraded and restarted), one at a time;
    /// stops at the first failure.
    Upgrade {
        #[command(flatten)]
        client: ClientArgs,
        /// Only these volumes (ids or names), whatever their worker's build.
        volumes: Vec<String>,
        /// Also the volumes whose worker already runs the service's build.
        #[arg(long, conflicts_with = "volumes")]
        all: bool,
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
    ///
    /// With a subcommand instead: the backups of images on the service's
    /// backup target.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Backup {
        /// The data dir whose registry to copy [default: as `serve`].
        #[arg(long, env = "BLOCKPLANE_DATA_DIR")]
        data_dir: Option<std::path::PathBuf>,
        /// Where to write the copy (must not exist).
        #[arg(required = true)]
        file: Option<std::path::PathBuf>,
        #[command(subcommand)]
        cmd: Option<BackupCmd>,
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

/// `image` commands.
#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Register an existing file.
    Add {
        /// The image's name (letters, digits, '.', '_', '-').
        name: String,
        /// The file, under one of the service's image roots.
        path: String,
        /// Record this allocation instead of what FIEMAP shows: full (checked:
        /// refused if the file has a hole or an unwritten extent) or sparse
        /// (discards punch). Without it, a fully written file is full.
        #[arg(long, value_parser = wire::<Allocation>(&["sparse", "full"]))]
        allocation: Option<Allocation>,
        /// A label, KEY=VALUE (repeat for more): a backup schedule's
        /// --selector and `image ls --label` name images by them.
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = label)]
        labels: Vec<(String, String)>,
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
        #[arg(long, default_value = "sparse", value_parser = wire::<Allocation>(&["sparse", "full"]))]
        allocation: Allocation,
        /// Encrypt it (LUKS2), with the key read from --key-file: volumes on
        /// it then need that key. Its first 16 MiB hold the header.
        #[arg(long, requires = "key_file")]
        encrypt: bool,
        /// A file holding the key (its bytes, a trailing newline dropped);
        /// `-` reads standard input. Never give a key as an argument: any
        /// user of the host can read a process's arguments.
        #[arg(long, requires = "encrypt")]
        key_file: Option<std::path::PathBuf>,
        /// A label, KEY=VALUE (repeat for more): a backup schedule's
        /// --selector and `image ls --label` name images by them.
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = label)]
        labels: Vec<(String, String)>,
    },
    /// Set or remove an image's labels: KEY=VALUE sets one, KEY- removes
    /// it; the others stay.
    Label {
        /// Image id or name.
        image: String,
        /// KEY=VALUE or KEY-, one or more.
        #[arg(required = true, value_name = "KEY=VALUE|KEY-")]
        changes: Vec<String>,
    },
    /// Add a key slot to an encrypted image (rotation: add the new key,
    /// then remove the old one's slot with `image key-rm`).
    KeyAdd {
        /// Image id or name.
        image: String,
        /// A file holding a key that opens a slot now (`-`: standard input).
        #[arg(long)]
        key_file: std::path::PathBuf,
        /// A file holding the new slot's key.
        #[arg(long)]
        new_key_file: std::path::PathBuf,
    },
    /// Remove a key slot of an encrypted image (never its last).
    KeyRm {
        /// Image id or name.
        image: String,
        /// The slot (`image show` lists them).
        slot: u32,
        /// A file holding a key that opens a slot now (`-`: standard input).
        #[arg(long)]
        key_file: std::path::PathBuf,
    },
    /// List images.
    #[command(visible_alias = "list")]
    Ls {
        /// Only those with this label: KEY=VALUE, or KEY for any value.
        #[arg(long)]
        label: Option<String>,
    },
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
    /// Back an image up to the service's backup target: its bytes at this
    /// moment, only the chunks the target lacks uploaded (this waits for the
    /// end, showing progress on stderr).
    Backup {
        /// Image id or name.
        image: String,
        /// The backup's name, unique among the image's backups.
        name: String,
        /// Answer once started (follow it with `backup show`).
        #[arg(long)]
        no_wait: bool,
    },
    /// Restore a backup into a new image NAME at PATH (every chunk's hash
    /// checked; this waits for the end, showing progress on stderr).
    Restore {
        /// The new image's name.
        name: String,
        /// Its file (must not exist), under one of the service's image roots.
        path: String,
        /// The backup (id, or name when one backup has it): `backup ls`.
        #[arg(long)]
        from: String,
        /// Answer once started (follow it with `image show`).
        #[arg(long)]
        no_wait: bool,
    },
    /// Make image NAME at PATH a standby of image SOURCE's backups (its
    /// id or name, as `backup ls` shows it; usually another host's): its
    /// newest backup restored, then each newer one applied as it appears
    /// (only changed chunks fetched; the file holds one whole backup
    /// throughout). It takes no volume until `image activate`.
    Standby {
        /// The new image's name.
        name: String,
        /// Its file (must not exist), under one of the service's image roots.
        path: String,
        /// The image whose backups it follows.
        #[arg(long = "of", value_name = "SOURCE")]
        source: String,
        /// Answer once started (follow it with `image show`).
        #[arg(long)]
        no_wait: bool,
    },
    /// The ranges of a snapshot's device that hold data or, with --base,
    /// the ranges whose bytes differ from another snapshot of the same
    /// image: what a backup, or an incremental one, must read.
    Ranges {
        /// Snapshot id or name.
        image: String,
        /// The snapshot to compare with.
        #[arg(long)]
        base: Option<String>,
    },
    /// Check a standby's source for newer backups now, starting an apply
    /// of the newest (the service checks every minute on its own).
    StandbyCheck {
        /// Image id or name.
        image: String,
    },
    /// Activate a standby: an ordinary image from now on, holding the
    /// backup it holds now (printed), which volumes may use.
    Activate {
        /// Image id or name.
        image: String,
        /// Stop an apply that runs instead of refusing.
        #[arg(long)]
        force: bool,
    },
    /// Forget an image.
    #[command(visible_alias = "delete")]
    Rm {
        /// Image id or name.
        image: String,
        /// Also delete the file.
        #[arg(long)]
        delete_file: bool,
        /// Crypto-erase an encrypted image first: destroy its key slots, so
        /// no key opens the file or any copy of its blocks again.
        #[arg(long)]
        erase: bool,
    },
}

/// `backup` commands: images' backups on the service's backup target.
#[derive(Debug, Subcommand)]
pub enum BackupCmd {
    /// List backups (any service's on the target, and this one's running).
    #[command(visible_alias = "list")]
    Ls {
        /// Only this image's (id or name).
        #[arg(long)]
        image: Option<String>,
    },
    /// Show one backup.
    Show {
        /// Backup id, or name when one backup has it.
        backup: String,
    },
    /// Delete a backup from the target (or cancel a running one); its
    /// chunks go unless another backup uses them.
    #[command(visible_alias = "delete")]
    Rm {
        /// Backup id, or name when one backup has it.
        backup: String,
    },
    /// Read every chunk of a backup back and check its hash, restoring
    /// nothing; exits 1 when one is missing or corrupt.
    Verify {
        /// Backup id, or name when one backup has it.
        backup: String,
    },
    /// Remove the target's chunks no backup needs.
    Gc,
    /// Delete an image's backups a retention policy does not keep: the last
    /// N, then the newest of each of the last N days, ISO weeks, months and
    /// years (UTC), as Proxmox Backup Server's prune.
    Prune {
        /// Image id or name.
        image: String,
        #[command(flatten)]
        keep: KeepArgs,
        /// Only say what would be kept and deleted.
        #[arg(long)]
        dry_run: bool,
    },
    /// List the backup schedules, with their next and last runs.
    Schedules,
    /// Back an image up on a schedule (cron, UTC), pruning its backups by
    /// the --keep-* policy after each run (none: every backup is kept).
    ScheduleCreate {
        /// The schedule's name ([a-z0-9][a-z0-9-]{0,39}).
        name: String,
        /// Image id or name.
        #[arg(
            long,
            required_unless_present = "selector",
            conflicts_with = "selector"
        )]
        image: Option<String>,
        /// Back up every image with this label when a run starts, one
        /// after another: KEY=VALUE (repeat: images with every one).
        #[arg(long = "selector", value_name = "KEY=VALUE", value_parser = label)]
        selector: Vec<(String, String)>,
        /// Five fields (minute hour day-of-month month day-of-week), or
        /// @hourly, @daily, @weekly, @monthly, @yearly.
        #[arg(long)]
        cron: String,
        #[command(flatten)]
        keep: KeepArgs,
        /// Made paused.
        #[arg(long)]
        paused: bool,
    },
    /// Show a backup schedule.
    ScheduleShow {
        /// Schedule id or name.
        schedule: String,
    },
    /// Change a backup schedule: its cron, its --keep-* policy (given
    /// whole), or pause and resume it.
    ScheduleSet {
        /// Schedule id or name.
        schedule: String,
        /// A new cron expression.
        #[arg(long)]
        cron: Option<String>,
        #[command(flatten)]
        keep: KeepArgs,
        /// Pause it.
        #[arg(long, conflicts_with = "resume")]
        pause: bool,
        /// Resume it (at its next time from now).
        #[arg(long)]
        resume: bool,
    },
    /// Delete a backup schedule (its backups stay).
    ScheduleRm {
        /// Schedule id or name.
        schedule: String,
    },
}

/// A retention policy's counts (0: the rule is left out).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct KeepArgs {
    /// The newest backups to keep.
    #[arg(long, default_value_t = 0)]
    pub keep_last: u32,
    /// Days whose newest backup is kept.
    #[arg(long, default_value_t = 0)]
    pub keep_daily: u32,
    /// ISO weeks whose newest backup is kept.
    #[arg(long, default_value_t = 0)]
    pub keep_weekly: u32,
    /// Months whose newest backup is kept.
    #[arg(long, default_value_t = 0)]
    pub keep_monthly: u32,
    /// Years whose newest backup is kept.
    #[arg(long, default_value_t = 0)]
    pub keep_yearly: u32,
}

impl KeepArgs {
    /// The policy, or `None` when every count is 0.
    pub fn policy(self) -> Option<blockplane_api::model::RetentionPolicy> {
        let p = blockplane_api::model::RetentionPolicy {
            keep_last: self.keep_last,
            keep_daily: self.keep_daily,
            keep_weekly: self.keep_weekly,
            keep_monthly: self.keep_monthly,
            keep_yearly: self.keep_yearly,
        };
        (p != blockplane_api::model::RetentionPolicy::default()).then_some(p)
    }
}

/// `volume` commands.
#[derive(Debug, Subcommand)]
pub enum VolumeCmd {
    /// Create a volume (idempotent by name).
    Create {
        /// The volume's name (letters, digits, '.', '_', '-').
        name: String,
        /// Image id or name (one image serves one volume).
        #[arg(long)]
        image: String,
        /// Kernel device kind: loop, ublk (our userspace server) or dm
        /// (device-mapper); auto picks the best this host has.
        #[arg(long, default_value = "auto", value_parser = wire::<BackendChoice>(&["auto", "loop", "ublk", "dm"]))]
        backend: BackendChoice,
        /// How a ublk or dm volume does its I/O: nowait (io_uring, NOWAIT
        /// first), threaded (blocking workers), direct (straight to the disk
        /// through the image's extent map), kernel (dm only: a private loop
        /// device); auto picks direct when the image allows it, else kernel
        /// on dm. Switchable live with `volume set`.
        #[arg(long, default_value = "auto", value_parser = wire::<DispatchPolicy>(&DISPATCH))]
        dispatch: DispatchPolicy,
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
        #[arg(long, value_parser = io_size, allow_hyphen_values = true)]
        max_io_bytes: Option<u32>,
        #[command(flatten)]
        qos: QosArgs,
        /// On an encrypted image: a file holding its key (its bytes, a
        /// trailing newline dropped); `-` reads standard input.
        #[arg(long)]
        key_file: Option<std::path::PathBuf>,
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
        #[arg(long, value_parser = wire::<DispatchPolicy>(&DISPATCH))]
        dispatch: Option<DispatchPolicy>,
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
    /// Open a locked encrypted volume's plaintext device again (after the
    /// host restarted) with its image's key.
    Unlock {
        /// Volume id or name.
        volume: String,
        /// A file holding the key (its bytes, a trailing newline dropped);
        /// `-` reads standard input.
        #[arg(long)]
        key_file: std::path::PathBuf,
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

/// `export` commands: a volume served to other hosts.
#[derive(Debug, Subcommand)]
pub enum ExportCmd {
    /// Export a volume, or change which hosts its export allows (each new
    /// host gets its own keys; a host allowed already keeps its own). The
    /// keys are secrets: printed only with --show-keys or --json.
    Put {
        /// Volume id or name.
        volume: String,
        /// A host NQN allowed to connect (the consuming service's `host
        /// nqn` in `blockplane host`); repeat for more hosts. The list
        /// replaces the export's.
        #[arg(long = "host", value_name = "NQN")]
        hosts: Vec<String>,
        /// How hosts authenticate: dhchap (a key each way), or none (any
        /// host that reaches the address: only on loopback export
        /// addresses, with --insecure-loopback).
        #[arg(long, default_value = "dhchap", value_parser = wire::<ExportAuth>(&["dhchap", "none"]))]
        auth: ExportAuth,
        /// Say yes to --auth none on loopback export addresses.
        #[arg(long)]
        insecure_loopback: bool,
        /// Print each host's keys (secret and ctrl secret), to give to that
        /// host's `remote create` in files.
        #[arg(long)]
        show_keys: bool,
    },
    /// Show a volume's export and which hosts are connected (no keys).
    Show {
        /// Volume id or name.
        volume: String,
    },
    /// List this service's exports.
    #[command(visible_alias = "list")]
    Ls,
    /// Remove a volume's export (the volume stays). Refused while a host is
    /// connected, or may be, unless --force.
    #[command(visible_alias = "delete")]
    Rm {
        /// Volume id or name.
        volume: String,
        /// Remove it even while hosts are (or may be) connected: their I/O
        /// to it fails.
        #[arg(long)]
        force: bool,
    },
}

/// `remote` commands: other hosts' exports used here.
#[derive(Debug, Subcommand)]
pub enum RemoteCmd {
    /// Connect another host's export as a remote volume NAME (idempotent by
    /// name). The keys are read from files, never taken as arguments: any
    /// user of the host can read a process's arguments.
    Create {
        /// The remote volume's name (lowercase letters, digits, '.', '_', '-').
        name: String,
        /// The exporting host's address: IP[:PORT] (port 4420 when left
        /// out), one of its `export addresses`.
        #[arg(long)]
        address: String,
        /// The export's NQN (`nqn` in its `export show`).
        #[arg(long)]
        nqn: String,
        /// A file holding this host's key, as the export's `export put
        /// --show-keys` printed it (a trailing newline dropped); `-` reads
        /// standard input. Leave it out for an export with --auth none.
        #[arg(long)]
        secret_file: Option<std::path::PathBuf>,
        /// A file holding the target's key (`ctrl secret`), as --secret-file;
        /// with it this host checks the exporting host too.
        #[arg(long, requires = "secret_file")]
        ctrl_secret_file: Option<std::path::PathBuf>,
        /// Refuse writes on this host.
        #[arg(long)]
        read_only: bool,
    },
    /// List remote volumes.
    #[command(visible_alias = "list")]
    Ls,
    /// Show one remote volume, its state as the kernel says now.
    Show {
        /// Remote volume id or name.
        remote: String,
    },
    /// Change a remote volume live. Its dispatch policy and QoS limits are
    /// its exporting host's: change them there.
    Set {
        /// Remote volume id or name.
        remote: String,
        /// Refuse (true) or allow (false) writes on this host.
        #[arg(long, required = true, action = clap::ArgAction::Set)]
        read_only: bool,
    },
    /// Disconnect a remote volume (its device goes away; the export on the
    /// exporting host stays). Refused while the device is open.
    #[command(visible_alias = "delete")]
    Rm {
        /// Remote volume id or name.
        remote: String,
    },
}

/// `move` commands: other hosts' volumes brought to this host.
#[derive(Debug, Subcommand)]
pub enum MoveCmd {
    /// Start moving a remote volume's data here, into a new image (--image
    /// at --path): the remote volume's device serves throughout, then
    /// serves the local volume. The exporting host is then told, with this
    /// service's own token, to let its export and volume go.
    Start {
        /// Remote volume id or name (attached).
        remote: String,
        /// The new image's name (lowercase letters, digits, '.', '_', '-').
        #[arg(long)]
        image: String,
        /// The new image's file (must not exist), under one of the
        /// service's image roots.
        #[arg(long)]
        path: String,
        /// The exporting host's API, http://host:port: told to let its
        /// export and volume go once the data is here.
        #[arg(long)]
        source_api: String,
        /// Keep the exporting host's image when its volume goes.
        #[arg(long)]
        keep_source_image: bool,
        /// Encrypt the local image (LUKS2) with the key in this file (`-`:
        /// standard input): required when the volume is encrypted on its
        /// host. Never give a key as an argument.
        #[arg(long)]
        key_file: Option<std::path::PathBuf>,
        /// Bytes per second the copy may read, at most: bytes, or 50M, 1.5G
        /// (binary) or 100MB (decimal), at least 1K (the kernel counts
        /// KiB/s); 0: no limit. Changeable live with `move set`.
        #[arg(long, default_value = "0", value_parser = parse_size, allow_hyphen_values = true, value_name = "BYTES_PER_SEC")]
        rate_limit: u64,
        /// Follow the move until its data is here, or until it fails or is
        /// cancelled, showing progress on stderr (the move goes on without
        /// it: `move show`).
        #[arg(long)]
        wait: bool,
    },
    /// Bring another host's volume here, cold (no consumer here uses it),
    /// into a new image (--image at --path): this service asks the
    /// exporting host to export the volume to it, connects, copies, and at
    /// the end serves the data from the local volume alone; the exporting
    /// host lets its export and volume go.
    Pull {
        /// The volume on the exporting host, by name or id.
        volume: String,
        /// The exporting host's API, http://host:port.
        #[arg(long)]
        source_api: String,
        /// The new image's name, also the local volume's.
        #[arg(long)]
        image: String,
        /// The new image's file (must not exist), under one of the
        /// service's image roots.
        #[arg(long)]
        path: String,
        /// Keep the exporting host's image when its volume goes.
        #[arg(long)]
        keep_source_image: bool,
        /// Encrypt the local image with the key in this file (as `move
        /// start`): required when the volume is encrypted on its host.
        #[arg(long)]
        key_file: Option<std::path::PathBuf>,
        /// Bytes per second the copy may read, at most (as `move start`).
        #[arg(long, default_value = "0", value_parser = parse_size, allow_hyphen_values = true, value_name = "BYTES_PER_SEC")]
        rate_limit: u64,
        /// Follow the move until it ends (as `move start`).
        #[arg(long)]
        wait: bool,
    },
    /// Bring several of another host's volumes here at once, under one
    /// rate limit (draining that host): each volume this host has
    /// connected moves live, any other cold, into an image named after it
    /// in --dir. All start, or none.
    Drain {
        /// The exporting host's API, http://host:port.
        #[arg(long)]
        source_api: String,
        /// The directory the images' files go into (each <volume>.img),
        /// under one of the service's image roots.
        #[arg(long)]
        dir: String,
        /// A volume to move (repeatable); none: every volume of the host.
        #[arg(long = "volume")]
        volumes: Vec<String>,
        /// Keep the exporting host's images when its volumes go.
        #[arg(long)]
        keep_source_images: bool,
        /// Bytes per second the copies may read in all, shared evenly among
        /// those copying (as `move start`); changeable live with `move
        /// drain-set`.
        #[arg(long, default_value = "0", value_parser = parse_size, allow_hyphen_values = true, value_name = "BYTES_PER_SEC")]
        rate_limit: u64,
    },
    /// Show a drain: its limit, its moves and their progress.
    DrainShow {
        /// Drain id.
        id: String,
    },
    /// Change the rate limit a drain's moves share, live.
    DrainSet {
        /// Drain id.
        id: String,
        /// Bytes per second its copies may read in all; 0: no limit.
        #[arg(long, value_parser = parse_size, allow_hyphen_values = true, value_name = "BYTES_PER_SEC")]
        rate_limit: u64,
    },
    /// List moves, newest first.
    #[command(visible_alias = "list")]
    Ls,
    /// Show one move: its state, bytes copied and rate.
    Show {
        /// Move id (`move ls`).
        id: String,
    },
    /// Change a copying move's rate limit, live.
    Set {
        /// Move id.
        id: String,
        /// Bytes per second the copy may read, at most (as `move start`);
        /// 0: no limit.
        #[arg(long, value_parser = parse_size, allow_hyphen_values = true, value_name = "BYTES_PER_SEC")]
        rate_limit: u64,
    },
    /// Cancel a copying move: the device serves the remote volume again
    /// (which holds every write) and the new image goes.
    Cancel {
        /// Move id.
        id: String,
    },
}

impl Command {
    /// The client flags given with this command, for the API's clients.
    pub fn client(&self) -> Option<&ClientArgs> {
        match self {
            Command::Host { client }
            | Command::Image { client, .. }
            | Command::Volume { client, .. }
            | Command::Export { client, .. }
            | Command::Remote { client, .. }
            | Command::Move { client, .. }
            | Command::Upgrade { client, .. }
            | Command::Events { client, .. } => Some(client),
            _ => None,
        }
    }
}

/// QoS limits of a ublk volume (token buckets over reads and writes together).
#[derive(Debug, clap::Args)]
pub struct QosArgs {
    /// IOPS limit.
    #[arg(long)]
    pub qos_iops: Option<u64>,
    /// Bandwidth limit, bytes/s: bytes, or 100M, 1.5G (binary) or 100MB (decimal).
    #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
    pub qos_bytes_per_sec: Option<u64>,
    /// IOPS bucket: requests that may go at once after a quiet spell [default: the IOPS limit].
    #[arg(long)]
    pub qos_burst_iops: Option<u64>,
    /// Bandwidth bucket: bytes that may go at once after a quiet spell [default: the bandwidth limit].
    #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
    pub qos_burst_bytes: Option<u64>,
}

impl QosArgs {
    /// The limits, when any is given.
    pub fn to_model(&self) -> Option<Qos> {
        let qos = Qos {
            iops: self.qos_iops,
            bytes_per_sec: self.qos_bytes_per_sec,
            burst_iops: self.qos_burst_iops,
            burst_bytes: self.qos_burst_bytes,
        };
        (qos != Qos::default()).then_some(qos)
    }
}

/// The values of a `--dispatch` flag.
const DISPATCH: [&str; 5] = ["auto", "nowait", "threaded", "direct", "kernel"];

/// A flag that takes one of `names`, the API's spellings of values of `T`
/// (listed in the help as they are).
fn wire<T>(names: &'static [&'static str]) -> impl TypedValueParser<Value = T>
where
    T: DeserializeOwned + Clone + Send + Sync + 'static,
{
    PossibleValuesParser::new(names.iter().copied())
        .map(|name| parse_wire(&name).expect("each possible value is an API spelling"))
}

/// A label as a flag spells it, `KEY=VALUE` (the service checks its
/// characters).
fn label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("'{s}' is not KEY=VALUE"))
}

/// A request size: as [`parse_size`], within the API's field (`u32`).
fn io_size(s: &str) -> Result<u32, String> {
    u32::try_from(parse_size(s)?)
        .map_err(|_| format!("'{s}' is larger than any request a device takes (at most 1 MiB)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

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

    /// Each value a flag lists reads as the API's value of that name.
    #[test]
    fn listed_values_are_api_spellings() {
        let parse = |args: &str| Cli::try_parse_from(args.split(' ')).map_err(|e| e.to_string());
        for b in ["auto", "loop", "ublk", "dm"] {
            let args = format!("bp volume create v --image i --backend {b}");
            assert!(parse(&args).is_ok(), "{args}");
        }
        for d in DISPATCH {
            let args = format!("bp volume create v --image i --dispatch {d}");
            assert!(parse(&args).is_ok(), "{args}");
            let args = format!("bp volume set v --dispatch {d}");
            assert!(parse(&args).is_ok(), "{args}");
        }
        for a in ["sparse", "full"] {
            let args = format!("bp image create i /p --size 1M --allocation {a}");
            assert!(parse(&args).is_ok(), "{args}");
        }
        for a in ["dhchap", "none"] {
            let args = format!("bp export put v --host nqn.x --auth {a}");
            assert!(parse(&args).is_ok(), "{args}");
        }
        let big = parse("bp volume create v --image i --max-io-bytes 8G").unwrap_err();
        assert!(big.contains("at most 1 MiB"), "{big}");
    }

    /// `remote set` says what it changes: --read-only takes true or false,
    /// and nothing else is taken.
    #[test]
    fn remote_set_takes_an_explicit_read_only() {
        let parse = |args: &str| Cli::try_parse_from(args.split(' ')).map_err(|e| e.to_string());
        assert!(parse("bp remote set r --read-only true").is_ok());
        assert!(parse("bp remote set r --read-only false").is_ok());
        assert!(parse("bp remote set r").is_err());
        assert!(parse("bp remote set r --read-only").is_err());
    }

    /// A move's rate limit reads as other sizes do, suffixes and all; `move
    /// set` says what it changes.
    #[test]
    fn move_rate_limits_are_sizes() {
        let parse = |args: &str| Cli::try_parse_from(args.split(' ')).map_err(|e| e.to_string());
        let base = "bp move start r --image i --path /p --source-api http://10.0.0.1:8080";
        let limit = |args: &str| match parse(args).map(|c| c.command) {
            Ok(Command::Move {
                cmd: MoveCmd::Start { rate_limit, .. } | MoveCmd::Set { rate_limit, .. },
                ..
            }) => Ok(rate_limit),
            other => Err(format!("{other:?}")),
        };
        assert_eq!(limit(base), Ok(0));
        assert_eq!(limit(&format!("{base} --rate-limit 50M")), Ok(50 << 20));
        assert_eq!(
            limit(&format!("{base} --rate-limit 100MB")),
            Ok(100_000_000)
        );
        assert_eq!(limit("bp move set m --rate-limit 1.5G"), Ok(3 << 29));
        assert_eq!(limit("bp move set m --rate-limit 0"), Ok(0));
        let bad = parse(&format!("{base} --rate-limit 5X")).unwrap_err();
        assert!(bad.contains("unknown unit"), "{bad}");
        assert!(parse("bp move set m").is_err());
        assert!(parse("bp move start r --image i --path /p").is_err());
        assert!(parse(&format!("{base} --keep-source-image --wait")).is_ok());
    }

    /// Secrets come in files: no flag takes one as an argument, and the
    /// controller's key goes with the host's.
    #[test]
    fn remote_create_takes_secrets_only_from_files() {
        let parse = |args: &str| Cli::try_parse_from(args.split(' ')).map_err(|e| e.to_string());
        let base = "bp remote create r --address 10.0.0.1 --nqn nqn.x";
        assert!(parse(base).is_ok());
        assert!(parse(&format!("{base} --secret-file /s --ctrl-secret-file /c")).is_ok());
        assert!(parse(&format!("{base} --ctrl-secret-file /c")).is_err());
        assert!(parse(&format!("{base} --secret DHHC-1:00:x:")).is_err());
    }
}
