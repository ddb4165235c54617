//! The answers of the client commands as printed: tables and fields for
//! people, the API's JSON with `--json`.

use std::fmt::Display;

use blockplane_api::model::{
    Backup, BackupGc, BackupPrune, BackupSchedule, BackupVerify, Capability, ColdExport, Drain,
    Event, Export, Host, Image, ImageRanges, ImageStandby, Move, MoveState, Remote,
    ResizeImageResponse, SupervisionState, Volume, VolumeStats, human_size,
};
use blockplane_client::Client;
use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::names::Names;
use super::table::{fields, table};

/// What a client command answered.
#[derive(Debug)]
pub enum View {
    Host(Host),
    Image(Image),
    Images(Vec<Image>),
    Volume(Volume),
    Volumes(Vec<Volume>),
    Resize(ResizeImageResponse),
    Stats(VolumeStats),
    Events(Vec<Event>),
    Backup(Backup),
    Backups(Vec<Backup>),
    Verify(BackupVerify),
    Gc(BackupGc),
    Prune(BackupPrune),
    Schedule(BackupSchedule),
    Schedules(Vec<BackupSchedule>),
    /// An export; its hosts' keys, where the answer has them, printed only
    /// when `show_keys` (they are secrets, and a terminal is seen and
    /// scrolled back).
    Export {
        export: Export,
        show_keys: bool,
    },
    Exports(Vec<Export>),
    Remote(Remote),
    Remotes(Vec<Remote>),
    Move(Move),
    Moves(Vec<Move>),
    Drain(Drain),
    /// A snapshot's ranges, every page joined.
    Ranges(ImageRanges),
    /// An answer without a body, and what to say of it.
    Done(&'static str),
}

impl View {
    /// The names this view shows in place of ids.
    pub async fn names(&self, client: &Client) -> Names {
        match self {
            View::Volume(_) | View::Volumes(_) => Names::images(client).await,
            View::Image(_) | View::Resize(_) | View::Stats(_) | View::Remote(_) | View::Move(_) => {
                Names::volumes(client).await
            }
            _ => Names::default(),
        }
    }

    /// The answer as the API's JSON, pretty; nothing for an empty answer.
    pub fn json(&self) -> String {
        match self {
            View::Host(h) => json_pretty(h),
            View::Image(i) => json_pretty(i),
            View::Images(l) => json_pretty(l),
            View::Volume(v) => json_pretty(v),
            View::Volumes(l) => json_pretty(l),
            View::Resize(r) => json_pretty(r),
            View::Stats(s) => json_pretty(s),
            View::Events(l) => json_pretty(l),
            View::Backup(b) => json_pretty(b),
            View::Backups(l) => json_pretty(l),
            View::Verify(v) => json_pretty(v),
            View::Gc(g) => json_pretty(g),
            View::Prune(p) => json_pretty(p),
            View::Schedule(x) => json_pretty(x),
            View::Schedules(l) => json_pretty(l),
            View::Export { export, .. } => json_pretty(export),
            View::Exports(l) => json_pretty(l),
            View::Remote(r) => json_pretty(r),
            View::Remotes(l) => json_pretty(l),
            View::Move(m) => json_pretty(m),
            View::Moves(l) => json_pretty(l),
            View::Drain(d) => json_pretty(d),
            View::Ranges(r) => json_pretty(r),
            View::Done(_) => String::new(),
        }
    }

    /// The answer for people.
    pub fn text(&self, names: &Names) -> String {
        match self {
            View::Done(msg) => format!("{msg}\n"),
            View::Host(h) => host(h),
            View::Image(i) => image(i, names),
            View::Resize(r) => {
                let mut out = image(&r.image, names);
                for v in &r.volumes {
                    out += &format!("volume {}: {}\n", v.name, v.message);
                }
                out
            }
            View::Images(l) => images(l),
            View::Volume(v) => volume(v, names),
            View::Volumes(l) => volumes(l, names),
            View::Stats(s) => stats(s, names),
            View::Backup(b) => backup(b),
            View::Backups(l) => backups(l),
            View::Verify(v) => verify(v),
            View::Export {
                export: e,
                show_keys,
            } => export(e, *show_keys),
            View::Exports(l) => exports(l),
            View::Remote(r) => remote(r, names),
            View::Remotes(l) => remotes(l),
            View::Move(m) => move_(m, names),
            View::Moves(l) => moves(l),
            View::Drain(d) => drain(d),
            View::Ranges(r) => ranges(r),
            View::Gc(g) => fields(vec![
                ("chunks deleted", g.chunks_deleted.to_string()),
                ("bytes deleted", human_size(g.bytes_deleted)),
                ("chunks kept", g.chunks_kept.to_string()),
                ("backups running", g.running_backups.to_string()),
            ]),
            View::Prune(p) => prune(p),
            View::Schedule(x) => schedule(x),
            View::Schedules(l) => schedules(l),
            View::Events(l) => table(
                &["ID", "AT", "KIND", "MESSAGE"],
                l.iter()
                    .map(|e| {
                        vec![
                            e.id.to_string(),
                            at(e.at),
                            e.kind.clone(),
                            e.message.clone(),
                        ]
                    })
                    .collect(),
            ),
        }
    }
}

/// `value`, or `-` when there is none.
pub fn dash<T: Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".into(), |v| v.to_string())
}

/// A time as the API writes it (RFC 3339).
pub fn at(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).expect("the API's times are RFC 3339")
}

/// `value` as JSON on one line. Through serde_json's map, whose keys are
/// in alphabetical order: the order the CLI has always printed.
pub fn json_line<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .expect("the model serializes to JSON")
        .to_string()
}

/// `value` as pretty JSON, keys as in [`json_line`], and a newline.
pub fn json_pretty<T: Serialize>(value: &T) -> String {
    let value = serde_json::to_value(value).expect("the model serializes to JSON");
    serde_json::to_string_pretty(&value).expect("JSON serializes") + "\n"
}

fn host(h: &Host) -> String {
    let roots = h
        .image_root_capacity
        .iter()
        .map(|r| {
            format!(
                "{} ({} free of {})",
                r.path,
                human_size(r.free_bytes),
                human_size(r.size_bytes)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let mut f = vec![
        ("kernel", h.kernel.clone()),
        ("version", h.build.version.clone()),
        (
            "default backend",
            dash(h.default_backend.map(|b| b.as_str())),
        ),
        ("image roots", roots),
        (
            "worker supervisor",
            match &h.supervision {
                None => "-".to_string(),
                Some(s) => match (&s.state, &s.reason) {
                    (SupervisionState::Running, _) if s.unsupervised_workers > 0 => format!(
                        "running; {} worker(s) not watched (their volumes say why)",
                        s.unsupervised_workers
                    ),
                    (SupervisionState::Running, _) => "running".to_string(),
                    (SupervisionState::Starting, _) => "starting".to_string(),
                    (SupervisionState::Restarting, reason) => format!(
                        "NOT RUNNING, restarting: {}; a worker that dies meanwhile is not recovered",
                        dash(reason.as_ref())
                    ),
                },
            },
        ),
    ];
    if let Some(fabric) = &h.fabric {
        f.push(("host nqn", fabric.host_nqn.clone()));
        f.push((
            "export addresses",
            if fabric.export_addresses.is_empty() {
                "none (exports are refused: serve --export-address)".to_string()
            } else {
                fabric.export_addresses.join(", ")
            },
        ));
    }
    let mut out = fields(f);
    if !h.reconciled {
        out += &format!(
            "note: the service started and is still matching the kernel's devices: {} volume(s) recovering\n",
            h.recovering_volumes
        );
    }
    if h.build.executable_replaced {
        out += &format!(
            "note: {} now holds build {}: a restart of the service runs it, then `blockplane upgrade` moves the volumes to it\n",
            h.build.executable,
            h.build.executable_version.as_deref().unwrap_or("(none)")
        );
    }
    let cap = |available: bool, reason: &Option<String>| {
        if available {
            "yes".to_string()
        } else {
            format!("no: {}", dash(reason.as_ref()))
        }
    };
    let policy = |c: &Capability| cap(c.available, &c.reason);
    let b = &h.backends;
    let p = &h.policies;
    let mut rows = vec![
        vec![
            "backend loop".into(),
            cap(b.loop_.available, &b.loop_.reason),
        ],
        vec!["backend ublk".into(), cap(b.ublk.available, &b.ublk.reason)],
        vec!["backend dm".into(), cap(b.dm.available, &b.dm.reason)],
        vec!["policy nowait".into(), policy(&p.nowait)],
        vec!["policy threaded".into(), policy(&p.threaded)],
        vec!["policy direct".into(), policy(&p.direct)],
    ];
    if let Some(f) = &h.fabric {
        rows.push(vec!["nvme/tcp export".into(), policy(&f.target)]);
        rows.push(vec!["nvme/tcp remote".into(), policy(&f.initiator)]);
    }
    out += "\n";
    out += &table(&["CAPABILITY", "AVAILABLE HERE"], rows);
    out
}

fn image(i: &Image, names: &Names) -> String {
    let mut out = fields(vec![
        ("id", i.id.to_string()),
        ("name", i.name.clone()),
        ("path", i.path.clone()),
        ("size", human_size(i.size_bytes)),
        ("allocated", human_size(i.allocated_bytes)),
        ("filesystem", i.filesystem.clone()),
        ("allocation", dash(i.allocation.map(|a| a.as_str()))),
        (
            "state",
            match &i.state_reason {
                Some(why) => format!("{}: {why}", i.state.as_str()),
                None => i.state.as_str().into(),
            },
        ),
        ("read only", i.read_only.to_string()),
        ("labels", dash(pairs(&i.labels))),
        ("snapshot of", dash(i.snapshot_of)),
        ("cloned from", dash(i.cloned_from)),
        ("method", dash(i.method.map(|m| m.as_str()))),
        (
            "standby of",
            i.standby.as_ref().map_or_else(|| "-".into(), standby),
        ),
        (
            "encryption",
            match &i.encryption {
                None => "-".into(),
                Some(e) => format!(
                    "{} {}, key slots {}",
                    e.format,
                    e.cipher,
                    e.key_slots
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
        ),
        (
            "allocate",
            match &i.allocate {
                None => String::new(),
                Some(a) => format!(
                    "{}: {} of {}",
                    a.state.as_str(),
                    human_size(a.done_bytes),
                    human_size(a.total_bytes)
                ),
            },
        ),
        (
            "volumes",
            i.volumes
                .iter()
                .map(|id| names.volume(*id))
                .collect::<Vec<_>>()
                .join(", "),
        ),
        ("created", at(i.created_at)),
    ]);
    if let Some(why) = &i.allocation_reason {
        out += &format!("allocation reason: {why}\n");
    }
    for w in &i.warnings {
        out += &format!("warning: {w}\n");
    }
    out
}

fn backup(b: &Backup) -> String {
    let progress = match (b.done_bytes, b.total_bytes) {
        (Some(done), Some(total)) => format!(" ({} of {})", human_size(done), human_size(total)),
        _ => String::new(),
    };
    let mut f = vec![
        ("id", b.id.to_string()),
        ("name", b.name.clone()),
        ("state", format!("{}{progress}", b.state.as_str())),
        ("image", format!("{} ({})", b.image_name, b.image_id)),
        ("size", human_size(b.size_bytes)),
        ("encrypted", b.encrypted.to_string()),
        ("moment", at(b.created_at)),
        ("finished", dash(b.finished_at.map(at))),
        ("chunks", b.chunks.to_string()),
        ("stored", human_size(b.stored_bytes)),
        ("uploaded", human_size(b.uploaded_bytes)),
        ("deduplicated", human_size(b.deduplicated_bytes)),
        (
            "from",
            format!("{} (blockplane {})", b.source_host, b.blockplane_version),
        ),
    ];
    if let Some(e) = &b.error {
        f.push(("error", e.clone()));
    }
    fields(f)
}

fn backups(l: &[Backup]) -> String {
    table(
        &[
            "ID", "NAME", "IMAGE", "STATE", "MOMENT", "SIZE", "STORED", "UPLOADED",
        ],
        l.iter()
            .map(|b| {
                vec![
                    b.id.to_string(),
                    b.name.clone(),
                    b.image_name.clone(),
                    b.state.as_str().to_string(),
                    at(b.created_at),
                    human_size(b.size_bytes),
                    human_size(b.stored_bytes),
                    human_size(b.uploaded_bytes),
                ]
            })
            .collect(),
    )
}

fn verify(v: &BackupVerify) -> String {
    let mut out = fields(vec![
        ("backup", v.backup_id.to_string()),
        ("ok", v.ok.to_string()),
        ("chunks", v.chunks.to_string()),
        ("bytes", human_size(v.bytes)),
    ]);
    for (what, list) in [("missing", &v.missing), ("corrupt", &v.corrupt)] {
        for c in list {
            out += &format!(
                "{what}: chunk {} at offset {} (blake3 {})\n",
                c.index, c.offset, c.hash
            );
        }
    }
    out
}

/// A standby's line: what it follows and holds, and how far behind it is.
fn standby(s: &ImageStandby) -> String {
    let held = match (&s.backup_name, s.backup_id, s.lag_seconds) {
        (Some(name), Some(id), Some(lag)) => {
            format!("holds backup '{name}' ({id}), {lag:.0} s old")
        }
        _ => "holds no backup yet".into(),
    };
    let mut line = format!(
        "image '{}' ({}); {held}; {} behind{}",
        s.source_image_name,
        s.source_image_id,
        human_size(s.behind_bytes),
        if s.applying { "; applying" } else { "" }
    );
    if let Some(e) = &s.error {
        line.push_str(&format!("; last error: {e}"));
    }
    line
}

fn images(l: &[Image]) -> String {
    table(
        &["NAME", "SIZE", "ALLOCATED", "FS", "VOLUMES", "PATH"],
        l.iter()
            .map(|i| {
                vec![
                    i.name.clone(),
                    human_size(i.size_bytes),
                    human_size(i.allocated_bytes),
                    i.filesystem.clone(),
                    i.volumes.len().to_string(),
                    i.path.clone(),
                ]
            })
            .collect(),
    )
}

fn volume(v: &Volume, names: &Names) -> String {
    let queues = format!("{} x depth {}", v.queues, v.queue_depth);
    fields(vec![
        ("id", v.id.to_string()),
        ("name", v.name.clone()),
        ("image", names.image_of(v, true)),
        ("backend", v.backend.as_str().into()),
        (
            "dispatch",
            format!(
                "{} (asked {}): {}",
                v.dispatch.as_str(),
                v.requested_dispatch.as_str(),
                v.dispatch_reason
            ),
        ),
        (
            "state",
            match &v.state_reason {
                None => v.state.as_str().into(),
                Some(r) => format!("{}: {r}", v.state.as_str()),
            },
        ),
        (
            "device",
            match &v.backing_device {
                Some(under) => format!("{} (dm-crypt over {under})", dash(v.device.as_ref())),
                None => dash(v.device.as_ref()),
            },
        ),
        ("encrypted", v.encrypted.to_string()),
        ("size", human_size(v.size_bytes)),
        ("read only", v.read_only.to_string()),
        (
            "queues",
            match v.copy_mode {
                None => queues,
                Some(m) => format!("{queues}, {}", m.as_str()),
            },
        ),
        ("qos", dash(v.qos.as_ref().map(json_line))),
        ("direct io", dash(v.direct_io)),
        (
            "worker",
            match (v.worker_pid, &v.worker_version) {
                (_, None) => "-".into(),
                (pid, Some(version)) => format!(
                    "pid {}, build {version}{}",
                    dash(pid),
                    if v.worker_older == Some(true) {
                        " (older than the service's: `blockplane upgrade` moves it)"
                    } else {
                        ""
                    }
                ),
            },
        ),
        ("created", at(v.created_at)),
        ("updated", at(v.updated_at)),
    ])
}

fn volumes(l: &[Volume], names: &Names) -> String {
    table(
        &[
            "NAME", "IMAGE", "BACKEND", "DISPATCH", "STATE", "DEVICE", "SIZE", "RO", "WORKER",
        ],
        l.iter()
            .map(|v| {
                vec![
                    v.name.clone(),
                    names.image_of(v, false),
                    v.backend.as_str().into(),
                    v.dispatch.as_str().into(),
                    v.state.as_str().into(),
                    dash(v.device.as_ref()),
                    human_size(v.size_bytes),
                    v.read_only.to_string(),
                    match v.worker_older {
                        None => "-".into(),
                        Some(false) => "current".into(),
                        Some(true) => "OLDER".into(),
                    },
                ]
            })
            .collect(),
    )
}

fn stats(s: &VolumeStats, names: &Names) -> String {
    let mut out = fields(vec![
        ("volume", names.volume(s.volume_id)),
        ("dispatch", s.dispatch.as_str().into()),
        ("in flight", s.in_flight.to_string()),
        ("since", at(s.since)),
    ]);
    out += &table(
        &["OP", "OPS", "BYTES", "ERRORS"],
        ["read", "write", "flush", "discard"]
            .iter()
            .zip(s.ops())
            .map(|(op, o)| {
                vec![
                    op.to_string(),
                    o.ops.to_string(),
                    human_size(o.bytes),
                    dash(o.errors),
                ]
            })
            .collect(),
    );
    // The nowait path, where the volume has one (ublk workers).
    if let Some(n) = &s.nowait {
        out += &fields(vec![
            ("nowait submitted", n.submitted.to_string()),
            ("nowait inline", n.completed_inline.to_string()),
            ("nowait EAGAIN fallbacks", n.eagain_fallbacks.to_string()),
            ("nowait pauses", n.pauses.to_string()),
            ("nowait bypassed (paused)", n.bypassed.to_string()),
        ]);
    }
    // Pages cached under a direct-I/O path slow every direct write.
    if let Some(p) = &s.page_cache {
        let size = |b: Option<u64>| b.map_or_else(|| "-".to_string(), human_size);
        out += &fields(vec![
            ("page cache, device", size(p.device_bytes)),
            ("page cache, image", size(p.image_bytes)),
        ]);
    }
    out
}

/// Whether a host of an export is connected, in words.
fn connected_text(connected: Option<bool>) -> &'static str {
    match connected {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown (the kernel cannot say)",
    }
}

fn export(e: &Export, show_keys: bool) -> String {
    let mut f = vec![
        ("volume", format!("{} ({})", e.volume_name, e.volume_id)),
        ("nqn", e.nqn.clone()),
        ("addresses", e.addresses.join(", ")),
        (
            "state",
            match &e.state_reason {
                Some(why) => format!("{}: {why}", e.state.as_str()),
                None => e.state.as_str().into(),
            },
        ),
        ("auth", e.auth.as_str().into()),
        ("read only", e.read_only.to_string()),
        ("created", at(e.created_at)),
    ];
    if let Some(m) = &e.moving {
        f.push((
            "moving",
            format!(
                "to {} ({}): {}, {} of {} bytes copied",
                m.host_nqn,
                m.move_id,
                m.state.as_str(),
                m.synced_bytes,
                m.total_bytes
            ),
        ));
    }
    if e.hosts.is_empty() {
        f.push(("hosts", "any (no authentication)".into()));
    }
    let mut out = fields(f);
    if !e.hosts.is_empty() {
        out += "\n";
        out += &table(
            &["HOST NQN", "CONNECTED"],
            e.hosts
                .iter()
                .map(|h| vec![h.host_nqn.clone(), connected_text(h.connected).into()])
                .collect(),
        );
    }
    let keyed: Vec<_> = e
        .hosts
        .iter()
        .filter(|h| h.secret.is_some() || h.ctrl_secret.is_some())
        .collect();
    if keyed.is_empty() {
        return out;
    }
    if !show_keys {
        out += &format!(
            "note: each of the {} host(s) has its keys (secrets, not printed): the same command with --show-keys, or --json, prints them for that host's `remote create --secret-file --ctrl-secret-file`\n",
            keyed.len()
        );
        return out;
    }
    for h in keyed {
        out += &format!("\nkeys of {}\n", h.host_nqn);
        out += &fields(vec![
            ("secret", dash(h.secret.as_ref())),
            ("ctrl secret", dash(h.ctrl_secret.as_ref())),
        ]);
    }
    out
}

fn exports(l: &[Export]) -> String {
    table(
        &["VOLUME", "NQN", "STATE", "HOSTS", "CONNECTED", "ADDRESSES"],
        l.iter()
            .map(|e| {
                let known: Option<Vec<bool>> = e.hosts.iter().map(|h| h.connected).collect();
                vec![
                    e.volume_name.clone(),
                    e.nqn.clone(),
                    e.state.as_str().into(),
                    if e.hosts.is_empty() {
                        "any".into()
                    } else {
                        e.hosts.len().to_string()
                    },
                    match known {
                        Some(k) => k.iter().filter(|c| **c).count().to_string(),
                        None => "unknown".into(),
                    },
                    e.addresses.join(", "),
                ]
            })
            .collect(),
    )
}

fn remote(r: &Remote, names: &Names) -> String {
    fields(vec![
        ("id", r.id.to_string()),
        ("name", r.name.clone()),
        ("address", r.address.clone()),
        ("nqn", r.nqn.clone()),
        (
            "state",
            match &r.state_reason {
                Some(why) => format!("{}: {why}", r.state.as_str()),
                None => r.state.as_str().into(),
            },
        ),
        (
            "device",
            match &r.nvme_device {
                Some(under) => format!("{} (over {under})", dash(r.device.as_ref())),
                None => dash(r.device.as_ref()),
            },
        ),
        ("size", human_size(r.size_bytes)),
        ("read only", r.read_only.to_string()),
        ("move", dash(r.move_id)),
        ("local volume", dash(r.volume.map(|v| names.volume(v)))),
        ("created", at(r.created_at)),
    ])
}

fn remotes(l: &[Remote]) -> String {
    table(
        &["NAME", "ADDRESS", "NQN", "STATE", "DEVICE", "SIZE", "RO"],
        l.iter()
            .map(|r| {
                vec![
                    r.name.clone(),
                    r.address.clone(),
                    r.nqn.clone(),
                    r.state.as_str().into(),
                    dash(r.device.as_ref()),
                    human_size(r.size_bytes),
                    r.read_only.to_string(),
                ]
            })
            .collect(),
    )
}

/// A move's bytes copied of its total, as a percentage and in bytes.
pub fn move_progress(m: &Move) -> String {
    let pct = (u128::from(m.synced_bytes) * 100)
        .checked_div(u128::from(m.total_bytes))
        .map_or_else(|| "-".to_string(), |p| format!("{}%", p.min(100)));
    format!(
        "{pct} ({} of {})",
        human_size(m.synced_bytes),
        human_size(m.total_bytes)
    )
}

/// A rate in bytes per second.
pub fn rate(bytes_per_sec: u64) -> String {
    format!("{}/s", human_size(bytes_per_sec))
}

/// A move's rate limit; 0 is none.
fn rate_limit(bytes_per_sec: u64) -> String {
    match bytes_per_sec {
        0 => "none".into(),
        r => rate(r),
    }
}

/// A move's copy rate: only a copying move has one.
fn move_rate(m: &Move) -> String {
    match m.state {
        MoveState::Syncing => rate(m.rate_bytes_per_sec),
        _ => "-".into(),
    }
}

fn move_(m: &Move, names: &Names) -> String {
    fields(vec![
        ("id", m.id.to_string()),
        ("remote", format!("{} ({})", m.remote_name, m.remote)),
        (
            "kind",
            match m.cold {
                None => "live: the remote volume's device serves throughout".into(),
                Some(ColdExport::Made) => {
                    "cold: its own remote volume, to an export it made".into()
                }
                Some(ColdExport::HostAdded) => {
                    "cold: its own remote volume, this host added to the export".into()
                }
                Some(ColdExport::HostAllowed) => "cold: its own remote volume".into(),
            },
        ),
        ("drain", dash(m.drain.map(|d| d.to_string()))),
        ("image", m.image.clone()),
        ("local volume", dash(m.volume.map(|v| names.volume(v)))),
        (
            "state",
            match &m.state_reason {
                Some(why) => format!("{}: {why}", m.state.as_str()),
                None => m.state.as_str().into(),
            },
        ),
        ("progress", move_progress(m)),
        ("rate", move_rate(m)),
        ("rate limit", rate_limit(m.rate_limit_bytes_per_sec)),
        ("source api", m.source_api.clone()),
        ("source volume", m.source_volume.clone()),
        ("keep source image", m.keep_source_image.to_string()),
        ("started", at(m.created_at)),
        ("finished", dash(m.finished_at.map(at))),
    ])
}

fn drain(d: &Drain) -> String {
    let pct = (u128::from(d.synced_bytes) * 100)
        .checked_div(u128::from(d.total_bytes))
        .map_or_else(|| "-".to_string(), |p| format!("{}%", p.min(100)));
    let head = fields(vec![
        ("id", d.id.to_string()),
        ("source api", d.source_api.clone()),
        ("rate limit", rate_limit(d.rate_limit_bytes_per_sec)),
        (
            "progress",
            format!(
                "{pct} ({} of {})",
                human_size(d.synced_bytes),
                human_size(d.total_bytes)
            ),
        ),
    ]);
    format!("{head}\n{}", moves(&d.moves))
}

fn moves(l: &[Move]) -> String {
    table(
        &[
            "ID",
            "REMOTE",
            "IMAGE",
            "STATE",
            "PROGRESS",
            "RATE",
            "RATE LIMIT",
        ],
        l.iter()
            .map(|m| {
                vec![
                    m.id.to_string(),
                    m.remote_name.clone(),
                    m.image.clone(),
                    m.state.as_str().into(),
                    move_progress(m),
                    move_rate(m),
                    rate_limit(m.rate_limit_bytes_per_sec),
                ]
            })
            .collect(),
    )
}

/// A backup schedule's last run, in a few words.
fn last_run(s: &BackupSchedule) -> String {
    match &s.last_run {
        None => "-".into(),
        Some(r) => format!("{} {}", json_line(&r.result).trim_matches('"'), at(r.at)),
    }
}

fn schedule(s: &BackupSchedule) -> String {
    let keep = s.retention.map(|r| {
        [
            ("last", r.keep_last),
            ("daily", r.keep_daily),
            ("weekly", r.keep_weekly),
            ("monthly", r.keep_monthly),
            ("yearly", r.keep_yearly),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
    });
    fields(vec![
        ("name", s.name.clone()),
        ("id", s.id.to_string()),
        ("images", schedule_images(s)),
        ("cron", s.cron.clone()),
        ("keeps", keep.unwrap_or_else(|| "every backup".into())),
        ("enabled", s.enabled.to_string()),
        ("next run", at(s.next_run_at)),
        ("last run", last_run(s)),
        (
            "last message",
            dash(s.last_run.as_ref().and_then(|r| r.message.as_deref())),
        ),
        ("last success", dash(s.last_success_at.map(at))),
        ("failures since", s.consecutive_failures.to_string()),
    ])
}

/// What a schedule backs up: its image's name, or its selector.
fn schedule_images(s: &BackupSchedule) -> String {
    match &s.selector {
        Some(sel) => format!("labelled {}", pairs(sel).unwrap_or_default()),
        None => dash(s.image_name.as_deref()),
    }
}

/// Labels as `k=v,k2=v2`; `None` when there are none.
fn pairs(labels: &blockplane_api::model::Labels) -> Option<String> {
    (!labels.is_empty()).then(|| blockplane_api::model::labels_text(labels))
}

fn schedules(l: &[BackupSchedule]) -> String {
    table(
        &[
            "NAME", "IMAGE", "CRON", "ENABLED", "NEXT RUN", "LAST RUN", "FAILURES",
        ],
        l.iter()
            .map(|s| {
                vec![
                    s.name.clone(),
                    schedule_images(s),
                    s.cron.clone(),
                    s.enabled.to_string(),
                    at(s.next_run_at),
                    last_run(s),
                    s.consecutive_failures.to_string(),
                ]
            })
            .collect(),
    )
}

/// A snapshot's ranges: what they cover, how they were found, then each.
fn ranges(r: &ImageRanges) -> String {
    let covered: u64 = r.ranges.iter().map(|x| x.length).sum();
    let what = if r.base_id.is_some() {
        "differ"
    } else {
        "hold data"
    };
    let mut out = format!(
        "{} ranges of {} {what}: {} of {} (found from extent maps: {}, read and compared: {})\n",
        r.ranges.len(),
        r.image_name,
        human_size(covered),
        human_size(r.size_bytes),
        human_size(r.mapped_bytes),
        human_size(r.compared_bytes),
    );
    if !r.ranges.is_empty() {
        out += &table(
            &["OFFSET", "LENGTH"],
            r.ranges
                .iter()
                .map(|x| vec![x.offset.to_string(), x.length.to_string()])
                .collect(),
        );
    }
    out
}

/// A prune: each backup, newest first, kept (by its rule) or deleted.
fn prune(p: &BackupPrune) -> String {
    let deleted = if p.dry_run { "would delete" } else { "deleted" };
    let mut rows: Vec<(OffsetDateTime, Vec<String>)> = p
        .kept
        .iter()
        .map(|b| {
            // The rule as the API spells it: `last`, `daily`, ...
            let rule = b
                .kept_by
                .map(|r| format!("kept ({})", json_line(&r).trim_matches('"')));
            (b, rule.unwrap_or_else(|| "kept".into()))
        })
        .chain(p.deleted.iter().map(|b| (b, deleted.to_string())))
        .map(|(b, what)| {
            (
                b.created_at,
                vec![b.name.clone(), at(b.created_at), what, b.id.to_string()],
            )
        })
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.0));
    table(
        &["NAME", "CREATED", "DECISION", "ID"],
        rows.into_iter().map(|(_, r)| r).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockplane_api::model::{ExportAuth, ExportHost, ExportState};

    fn keyed_export() -> Export {
        Export {
            volume_id: uuid::Uuid::nil(),
            volume_name: "v".into(),
            nqn: "nqn.2026-12.dev.blockplane:i:v".into(),
            addresses: vec!["10.0.0.1:4420".into()],
            read_only: false,
            auth: ExportAuth::Dhchap,
            hosts: vec![ExportHost {
                host_nqn: "nqn.2014-08.org.nvmexpress:uuid:b".into(),
                connected: None,
                secret: Some("DHHC-1:00:host-key:".into()),
                ctrl_secret: Some("DHHC-1:00:ctrl-key:".into()),
            }],
            state: ExportState::Serving,
            state_reason: None,
            moving: None,
            created_at: OffsetDateTime::UNIX_EPOCH,
        }
    }

    /// Keys are secrets: a table shows them only when asked; --json gives
    /// the API's answer whole.
    #[test]
    fn an_export_s_keys_are_printed_only_when_asked() {
        let e = keyed_export();
        let hidden = View::Export {
            export: e.clone(),
            show_keys: false,
        }
        .text(&Names::default());
        assert!(
            !hidden.contains("host-key") && !hidden.contains("ctrl-key"),
            "{hidden}"
        );
        assert!(hidden.contains("--show-keys"), "{hidden}");
        assert!(
            hidden.contains("unknown (the kernel cannot say)"),
            "{hidden}"
        );
        let shown = View::Export {
            export: e.clone(),
            show_keys: true,
        }
        .text(&Names::default());
        assert!(shown.contains("DHHC-1:00:host-key:") && shown.contains("DHHC-1:00:ctrl-key:"));
        let json = View::Export {
            export: e,
            show_keys: false,
        }
        .json();
        assert!(json.contains("DHHC-1:00:host-key:"), "{json}");
    }

    fn copying_move() -> Move {
        Move {
            id: uuid::Uuid::nil(),
            remote: uuid::Uuid::nil(),
            remote_name: "far".into(),
            image: "near".into(),
            volume: None,
            source_api: "http://10.0.0.1:8080".into(),
            source_volume: "disk".into(),
            keep_source_image: false,
            state: MoveState::Syncing,
            state_reason: None,
            synced_bytes: 1 << 30,
            total_bytes: 4 << 30,
            rate_bytes_per_sec: 50 << 20,
            rate_limit_bytes_per_sec: 0,
            created_at: OffsetDateTime::UNIX_EPOCH,
            finished_at: None,
            cold: None,
            drain: None,
        }
    }

    /// A move list shows each move's progress in bytes and percent, its
    /// rate while it copies, and its limit.
    #[test]
    fn a_move_list_shows_progress_rate_and_limit() {
        let mut m = copying_move();
        let out = moves(std::slice::from_ref(&m));
        let row = out.lines().nth(1).unwrap();
        assert!(
            row.contains("25% (1.0 GiB of 4.0 GiB)") && row.contains("50.0 MiB/s"),
            "{out}"
        );
        assert!(row.trim_end().ends_with("none"), "{out}");
        m.state = MoveState::Done;
        m.synced_bytes = m.total_bytes;
        m.rate_limit_bytes_per_sec = 1 << 20;
        let out = moves(&[m]);
        let row = out.lines().nth(1).unwrap();
        assert!(
            row.contains("done") && row.contains("100% (4.0 GiB of 4.0 GiB)"),
            "{out}"
        );
        assert!(row.trim_end().ends_with("1.0 MiB/s"), "{out}");
        assert!(!row.contains("50.0 MiB/s"), "no rate once ended: {out}");
    }

    /// A move of nothing yet measured has no percentage rather than a
    /// division by zero.
    #[test]
    fn a_move_without_a_total_has_no_percentage() {
        let mut m = copying_move();
        m.total_bytes = 0;
        m.synced_bytes = 0;
        assert_eq!(move_progress(&m), "- (0 B of 0 B)");
    }

    /// A move's view says why it ended.
    #[test]
    fn a_failed_move_says_why() {
        let mut m = copying_move();
        m.state = MoveState::Failed;
        m.state_reason = Some("the local leg's writes failed".into());
        let out = View::Move(m).text(&Names::default());
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().next() == Some("state")
                    && l.ends_with("failed: the local leg's writes failed")),
            "{out}"
        );
        assert!(
            out.contains("far (00000000-0000-0000-0000-000000000000)"),
            "{out}"
        );
    }

    /// An export list counts connected hosts, or says it cannot.
    #[test]
    fn an_export_list_counts_connected_hosts_or_says_unknown() {
        let mut e = keyed_export();
        let unknown = exports(std::slice::from_ref(&e));
        assert!(
            unknown.lines().nth(1).unwrap().contains("unknown"),
            "{unknown}"
        );
        e.hosts[0].connected = Some(true);
        let one = exports(&[e]);
        let row = one.lines().nth(1).unwrap();
        assert!(row.contains(" 1 ") && !row.contains("unknown"), "{one}");
    }
}
