//! The client commands: each becomes calls of the typed client and its
//! answer a [`View`] to print. A failure is printed, with the API's code and
//! status when it answered one, and becomes the exit code.

use std::path::Path;
use std::process::ExitCode;

use blockplane_api::model::{
    ActivateImageRequest, AddKeyRequest, AllocatedQuery, Allocation, ChangesQuery, ColdMoveRequest,
    CreateBackupRequest, CreateEncryption, CreateImageFile, CreateImageRequest,
    CreateRemoteRequest, CreateSnapshotRequest, CreateVolumeRequest, DEFAULT_MAX_IO_BYTES,
    DeleteExportQuery, DeleteImageQuery, DrainRequest, EventQuery, ExportRequest, Image,
    ImageRanges, ListImagesQuery, PatchDrainRequest, PatchImageRequest, PatchMoveRequest,
    PatchRemoteRequest, PatchVolumeRequest, RemoveKeyRequest, ResizeImageRequest, StartMoveRequest,
};
use blockplane_client::{self as client, Client, Endpoint};

use super::args::{BackupCmd, Cli, Command, ExportCmd, ImageCmd, MoveCmd, RemoteCmd, VolumeCmd};
use super::busy::refuse_if_busy;
use super::local::api_address;
use super::output::{fail, print};
use super::progress::{wait_allocate, wait_backup, wait_copy, wait_move};
use super::render::View;
use super::{events, top};

/// Runs a client command.
pub async fn run(cli: Cli) -> ExitCode {
    let flags = cli
        .command
        .client()
        .map(|c| c.or(&cli.client))
        .unwrap_or_else(|| cli.client.clone());
    let api = api_address(flags.api.api.as_deref());
    let token = match flags.api.token() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::from(2);
        }
    };
    let client = match Endpoint::parse(&api) {
        Ok(e) => Client::new(e, token),
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::from(2);
        }
    };
    let as_json = flags.json;
    let view = match &cli.command {
        Command::Host { .. } => client.host().await.map(View::Host).map_err(|e| fail(&e)),
        Command::Events {
            follow,
            volume,
            since,
            limit,
            ..
        } => {
            let query = EventQuery {
                volume: volume.clone(),
                since: since.clone(),
                kind: None,
                limit: *limit,
            };
            if *follow {
                return events::follow(&client, &query, as_json).await;
            }
            client
                .events(&query)
                .await
                .map(View::Events)
                .map_err(|e| fail(&e))
        }
        Command::Volume {
            cmd: VolumeCmd::Top { count },
            ..
        } => return top::top(&client, *count, as_json).await,
        Command::Upgrade { volumes, all, .. } => {
            return super::upgrade::upgrade(&client, volumes, *all, as_json).await;
        }
        Command::Image { cmd, .. } => image(&client, cmd).await,
        Command::Backup { cmd: Some(cmd), .. } => backup(&client, cmd).await,
        Command::Volume { cmd, .. } => volume(&client, cmd).await,
        Command::Export { cmd, .. } => export(&client, cmd).await,
        Command::Remote { cmd, .. } => remote(&client, cmd).await,
        Command::Move { cmd, .. } => moves(&client, cmd).await,
        Command::Serve(_)
        | Command::Openapi
        | Command::Worker { .. }
        | Command::Csi { .. }
        | Command::Backup { .. }
        | Command::Dashboard { .. } => unreachable!("handled without the API"),
    };
    let view = match view {
        Ok(view) => view,
        Err(code) => return code,
    };
    let text = if as_json {
        view.json()
    } else {
        view.text(&view.names(&client).await)
    };
    print(&text);
    ExitCode::SUCCESS
}

/// An `image` command: each verb with more than a call to make is a step of
/// its own.
async fn image(client: &Client, cmd: &ImageCmd) -> Result<View, ExitCode> {
    let api = |e: client::Error| fail(&e);
    match cmd {
        ImageCmd::Add {
            name,
            path,
            allocation,
            labels,
        } => image_add(client, name, path, *allocation, labels).await,
        ImageCmd::Create {
            name,
            path,
            size,
            allocation,
            encrypt: _,
            key_file,
            labels,
        } => {
            let file = (*size, *allocation);
            image_create(client, name, path, file, key_file.as_deref(), labels).await
        }
        ImageCmd::Label { image, changes } => image_label(client, image, changes).await,
        ImageCmd::KeyAdd {
            image,
            key_file,
            new_key_file,
        } => image_key_add(client, image, key_file, new_key_file).await,
        ImageCmd::KeyRm {
            image,
            slot,
            key_file,
        } => image_key_rm(client, image, *slot, key_file).await,
        ImageCmd::Ls { label } => {
            let query = ListImagesQuery {
                label: label.clone(),
                ..ListImagesQuery::default()
            };
            Ok(View::Images(client.images(&query).await.map_err(api)?))
        }
        ImageCmd::Show { image } => Ok(View::Image(client.image(image).await.map_err(api)?)),
        ImageCmd::Resize { image, size } => {
            let req = ResizeImageRequest { size_bytes: *size };
            let resized = client.resize_image(image, &req).await.map_err(api)?;
            Ok(View::Resize(resized))
        }
        ImageCmd::Allocate {
            image,
            no_wait,
            cancel,
        } => image_allocate(client, image, *cancel, *no_wait).await,
        ImageCmd::Snapshot { src, name, no_wait } => {
            image_snapshot(client, src, name, *no_wait).await
        }
        ImageCmd::Clone {
            src,
            name,
            path,
            no_wait,
        } => image_clone(client, src, name, path, *no_wait).await,
        ImageCmd::Backup {
            image,
            name,
            no_wait,
        } => image_backup(client, image, name, *no_wait).await,
        ImageCmd::Restore {
            name,
            path,
            from,
            no_wait,
        } => image_restore(client, name, path, from, *no_wait).await,
        ImageCmd::Standby {
            name,
            path,
            source,
            no_wait,
        } => {
            let req = CreateImageRequest {
                standby_of: Some(source.clone()),
                ..image_request(name, path)
            };
            let started = client.create_image(&req).await.map_err(api)?;
            copied(client, name, started, *no_wait).await
        }
        ImageCmd::Ranges { image, base } => image_ranges(client, image, base.as_deref()).await,
        ImageCmd::StandbyCheck { image } => {
            Ok(View::Image(client.check_standby(image).await.map_err(api)?))
        }
        ImageCmd::Activate { image, force } => {
            let req = ActivateImageRequest { force: *force };
            let done = client.activate_image(image, &req).await.map_err(api)?;
            eprintln!(
                "activated: holds backup '{}' ({}) taken at {}{}",
                done.backup_name,
                done.backup_id,
                done.backup_created_at,
                if done.stopped_apply {
                    "; the apply that ran was stopped"
                } else {
                    ""
                }
            );
            Ok(View::Image(done.image))
        }
        ImageCmd::Rm {
            image,
            delete_file,
            erase,
        } => image_rm(client, image, *delete_file, *erase).await,
    }
}

/// The request to register image `name` at `path` as it is: each verb that
/// makes an image sets the one field that says how.
fn image_request(name: &str, path: &str) -> CreateImageRequest {
    CreateImageRequest {
        name: name.into(),
        path: path.into(),
        create: None,
        clone_from: None,
        restore_from: None,
        standby_of: None,
        allocation: None,
        labels: Default::default(),
    }
}

/// `image label`: each `KEY=VALUE` set, each `KEY-` removed, in one patch.
async fn image_label(client: &Client, image: &str, changes: &[String]) -> Result<View, ExitCode> {
    let mut labels = std::collections::BTreeMap::new();
    for c in changes {
        match (c.split_once('='), c.strip_suffix('-')) {
            (Some((k, v)), _) => labels.insert(k.to_string(), Some(v.to_string())),
            (None, Some(k)) => labels.insert(k.to_string(), None),
            (None, None) => {
                eprintln!("error: '{c}' is neither KEY=VALUE (set) nor KEY- (remove)");
                return Err(ExitCode::from(2));
            }
        };
    }
    let req = PatchImageRequest { labels };
    let patched = client
        .patch_image(image, &req)
        .await
        .map_err(|e| fail(&e))?;
    Ok(View::Image(patched))
}

/// `image add`: an existing file registered, with the allocation given
/// (`None`: the service reads it off the file).
async fn image_add(
    client: &Client,
    name: &str,
    path: &str,
    allocation: Option<Allocation>,
    labels: &[(String, String)],
) -> Result<View, ExitCode> {
    let req = CreateImageRequest {
        allocation,
        labels: labels.iter().cloned().collect(),
        ..image_request(name, path)
    };
    let added = client.create_image(&req).await.map_err(|e| fail(&e))?;
    Ok(View::Image(added))
}

/// `image create`: a new file of `size` bytes, encrypted with the key in
/// `key_file` when one is given (clap lets one through only with
/// `--encrypt`).
async fn image_create(
    client: &Client,
    name: &str,
    path: &str,
    (size, allocation): (u64, Allocation),
    key_file: Option<&Path>,
    labels: &[(String, String)],
) -> Result<View, ExitCode> {
    let encryption = match key_file {
        Some(path) => Some(CreateEncryption {
            key: read_key(path)?,
        }),
        None => None,
    };
    let file = CreateImageFile {
        size_bytes: size,
        allocation,
        encryption,
    };
    let req = CreateImageRequest {
        create: Some(file),
        labels: labels.iter().cloned().collect(),
        ..image_request(name, path)
    };
    let created = client.create_image(&req).await.map_err(|e| fail(&e))?;
    Ok(View::Image(created))
}

/// `image key-add`: a slot for the key in `new_key_file`, opened with the
/// key in `key_file`; the slot's number goes to stderr so that the view on
/// stdout stays the image's.
async fn image_key_add(
    client: &Client,
    image: &str,
    key_file: &Path,
    new_key_file: &Path,
) -> Result<View, ExitCode> {
    let req = AddKeyRequest {
        key: read_key(key_file)?,
        new_key: read_key(new_key_file)?,
    };
    let added = client
        .add_image_key(image, &req)
        .await
        .map_err(|e| fail(&e))?;
    eprintln!("key slot {} added", added.slot);
    Ok(View::Image(added.image))
}

/// `image key-rm`: key slot `slot` removed, with the key in `key_file`
/// proving the right to.
async fn image_key_rm(
    client: &Client,
    image: &str,
    slot: u32,
    key_file: &Path,
) -> Result<View, ExitCode> {
    let req = RemoveKeyRequest {
        key: read_key(key_file)?,
    };
    let image = client
        .remove_image_key(image, slot, &req)
        .await
        .map_err(|e| fail(&e))?;
    Ok(View::Image(image))
}

/// `image allocate`: the image's running allocate stopped when `cancel`;
/// else one started, then followed to its end unless `no_wait`.
async fn image_allocate(
    client: &Client,
    image: &str,
    cancel: bool,
    no_wait: bool,
) -> Result<View, ExitCode> {
    if cancel {
        let stopped = client.cancel_allocate(image).await.map_err(|e| fail(&e))?;
        return Ok(View::Image(stopped));
    }
    let started = client.allocate_image(image).await.map_err(|e| fail(&e))?;
    if no_wait {
        return Ok(View::Image(started));
    }
    let done = wait_allocate(client, image, started)
        .await
        .map_err(waited)?;
    Ok(View::Image(done))
}

/// `image snapshot`: snapshot `name` of `src`.
async fn image_snapshot(
    client: &Client,
    src: &str,
    name: &str,
    no_wait: bool,
) -> Result<View, ExitCode> {
    let req = CreateSnapshotRequest { name: name.into() };
    let started = client
        .snapshot_image(src, &req)
        .await
        .map_err(|e| fail(&e))?;
    copied(client, name, started, no_wait).await
}

/// `image clone`: image `name` at `path`, a copy of `src`.
async fn image_clone(
    client: &Client,
    src: &str,
    name: &str,
    path: &str,
    no_wait: bool,
) -> Result<View, ExitCode> {
    let req = CreateImageRequest {
        clone_from: Some(src.into()),
        ..image_request(name, path)
    };
    let started = client.create_image(&req).await.map_err(|e| fail(&e))?;
    copied(client, name, started, no_wait).await
}

/// `image backup`: backup `name` of `image` started, then followed to its
/// end unless `no_wait`.
async fn image_backup(
    client: &Client,
    image: &str,
    name: &str,
    no_wait: bool,
) -> Result<View, ExitCode> {
    let req = CreateBackupRequest { name: name.into() };
    let started = client
        .backup_image(image, &req)
        .await
        .map_err(|e| fail(&e))?;
    if no_wait {
        return Ok(View::Backup(started));
    }
    let id = started.id.to_string();
    let done = wait_backup(client, &id, started).await.map_err(waited)?;
    Ok(View::Backup(done))
}

/// `image restore`: image `name` at `path`, the bytes of backup `from`.
async fn image_restore(
    client: &Client,
    name: &str,
    path: &str,
    from: &str,
    no_wait: bool,
) -> Result<View, ExitCode> {
    let req = CreateImageRequest {
        restore_from: Some(from.into()),
        standby_of: None,
        ..image_request(name, path)
    };
    let started = client.create_image(&req).await.map_err(|e| fail(&e))?;
    copied(client, name, started, no_wait).await
}

/// `image rm`: the image forgotten, its file deleted or erased too when
/// asked.
async fn image_rm(
    client: &Client,
    image: &str,
    delete_file: bool,
    erase: bool,
) -> Result<View, ExitCode> {
    let query = DeleteImageQuery { delete_file, erase };
    client
        .delete_image(image, &query)
        .await
        .map_err(|e| fail(&e))?;
    Ok(View::Done("image removed"))
}

/// The image a snapshot, clone or restore makes, one step for the three
/// as they share the service's copy job: as it started when `no_wait`,
/// else once its copy has ended (progress on stderr).
async fn copied(
    client: &Client,
    name: &str,
    started: Image,
    no_wait: bool,
) -> Result<View, ExitCode> {
    if no_wait {
        return Ok(View::Image(started));
    }
    let done = wait_copy(client, name, started).await.map_err(waited)?;
    Ok(View::Image(done))
}

/// Prints why following a job in the service failed; the command fails.
fn waited(msg: String) -> ExitCode {
    eprintln!("blockplane: {msg}");
    ExitCode::FAILURE
}

/// A `backup` command.
async fn backup(client: &Client, cmd: &BackupCmd) -> Result<View, ExitCode> {
    let api = |e: client::Error| fail(&e);
    Ok(match cmd {
        BackupCmd::Ls { image } => {
            let query = blockplane_api::model::ListBackupsQuery {
                image: image.clone(),
            };
            View::Backups(client.backups(&query).await.map_err(api)?)
        }
        BackupCmd::Show { backup } => View::Backup(client.backup(backup).await.map_err(api)?),
        BackupCmd::Rm { backup } => {
            client.delete_backup(backup).await.map_err(api)?;
            View::Done("backup removed")
        }
        BackupCmd::Verify { backup } => {
            let report = client.verify_backup(backup).await.map_err(api)?;
            if !report.ok {
                let view = View::Verify(report);
                print(&view.text(&Default::default()));
                return Err(ExitCode::FAILURE);
            }
            View::Verify(report)
        }
        BackupCmd::Gc => View::Gc(client.collect_backups().await.map_err(api)?),
        BackupCmd::Prune {
            image,
            keep,
            dry_run,
        } => {
            let req = blockplane_api::model::PruneBackupsRequest {
                // All zero: the service refuses it, naming the rule.
                retention: keep.policy().unwrap_or_default(),
                dry_run: *dry_run,
            };
            View::Prune(client.prune_backups(image, &req).await.map_err(api)?)
        }
        BackupCmd::Schedules => View::Schedules(client.schedules().await.map_err(api)?),
        BackupCmd::ScheduleCreate {
            name,
            image,
            selector,
            cron,
            keep,
            paused,
        } => {
            let req = blockplane_api::model::CreateBackupScheduleRequest {
                name: name.clone(),
                image: image.clone(),
                selector: (!selector.is_empty()).then(|| selector.iter().cloned().collect()),
                cron: cron.clone(),
                retention: keep.policy(),
                enabled: !paused,
            };
            View::Schedule(client.create_schedule(&req).await.map_err(api)?)
        }
        BackupCmd::ScheduleShow { schedule } => {
            View::Schedule(client.schedule(schedule).await.map_err(api)?)
        }
        BackupCmd::ScheduleSet {
            schedule,
            cron,
            keep,
            pause,
            resume,
        } => {
            let req = blockplane_api::model::PatchBackupScheduleRequest {
                cron: cron.clone(),
                retention: keep.policy(),
                enabled: match (pause, resume) {
                    (true, _) => Some(false),
                    (_, true) => Some(true),
                    _ => None,
                },
            };
            View::Schedule(client.patch_schedule(schedule, &req).await.map_err(api)?)
        }
        BackupCmd::ScheduleRm { schedule } => {
            client.delete_schedule(schedule).await.map_err(api)?;
            View::Done("schedule removed")
        }
    })
}

/// A key from `path` (`-`: standard input), one trailing newline dropped
/// (what `echo` and editors add).
fn read_key(path: &std::path::Path) -> Result<blockplane_api::model::Key, ExitCode> {
    let text = read_secret(path, "key file")?;
    Ok(blockplane_api::model::Key::new(text))
}

/// The secret held in file `path` (`-`: standard input), one trailing
/// newline dropped; `what` names the file in the refusal, which never
/// shows its content.
fn read_secret(path: &std::path::Path, what: &str) -> Result<String, ExitCode> {
    let read = if path == std::path::Path::new("-") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map(|_| s)
    } else {
        std::fs::read_to_string(path)
    };
    let mut text = read.map_err(|e| {
        eprintln!("blockplane: cannot read the {what} {}: {e}", path.display());
        ExitCode::from(2)
    })?;
    for end in ['\n', '\r'] {
        if text.ends_with(end) {
            text.pop();
        }
    }
    Ok(text)
}

/// A `volume` command.
async fn volume(client: &Client, cmd: &VolumeCmd) -> Result<View, ExitCode> {
    let api = |e: client::Error| fail(&e);
    Ok(match cmd {
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
            key_file,
        } => {
            let key = match key_file {
                Some(path) => Some(read_key(path)?),
                None => None,
            };
            let req = CreateVolumeRequest {
                name: name.clone(),
                image: image.clone(),
                backend: *backend,
                dispatch: *dispatch,
                read_only: *read_only,
                queues: *queues,
                queue_depth: *queue_depth,
                max_io_bytes: max_io_bytes.unwrap_or(DEFAULT_MAX_IO_BYTES),
                qos: qos.to_model(),
                key,
            };
            View::Volume(client.create_volume(&req).await.map_err(api)?)
        }
        VolumeCmd::Ls => View::Volumes(client.volumes().await.map_err(api)?),
        VolumeCmd::Show { volume } => View::Volume(client.volume(volume).await.map_err(api)?),
        VolumeCmd::Set {
            volume,
            dispatch,
            read_only,
            qos,
            no_qos,
        } => {
            let patch = PatchVolumeRequest {
                dispatch: *dispatch,
                qos: if *no_qos {
                    Some(None)
                } else {
                    qos.to_model().map(Some)
                },
                read_only: *read_only,
            };
            View::Volume(client.patch_volume(volume, &patch).await.map_err(api)?)
        }
        VolumeCmd::Stats { volume } => View::Stats(client.volume_stats(volume).await.map_err(api)?),
        VolumeCmd::Top { .. } => unreachable!("a loop of calls, see `top`"),
        VolumeCmd::Unlock { volume, key_file } => {
            let req = blockplane_api::model::UnlockVolumeRequest {
                key: read_key(key_file)?,
            };
            View::Volume(client.unlock_volume(volume, &req).await.map_err(api)?)
        }
        VolumeCmd::Rm { volume, force } => {
            if !force {
                refuse_if_busy(client, volume).await?;
            }
            client.delete_volume(volume).await.map_err(api)?;
            View::Done("volume deleted")
        }
    })
}

/// An `export` command.
async fn export(client: &Client, cmd: &ExportCmd) -> Result<View, ExitCode> {
    let api = |e: client::Error| fail(&e);
    Ok(match cmd {
        ExportCmd::Put {
            volume,
            hosts,
            auth,
            insecure_loopback,
            show_keys,
        } => {
            let req = ExportRequest {
                hosts: hosts.clone(),
                read_only: false,
                auth: *auth,
                insecure_loopback: *insecure_loopback,
            };
            View::Export {
                export: client.put_export(volume, &req).await.map_err(api)?,
                show_keys: *show_keys,
            }
        }
        ExportCmd::Show { volume } => View::Export {
            export: client.export(volume).await.map_err(api)?,
            show_keys: false,
        },
        ExportCmd::Ls => View::Exports(client.exports().await.map_err(api)?),
        ExportCmd::Rm { volume, force } => {
            let query = DeleteExportQuery { force: *force };
            client
                .delete_export_with(volume, &query)
                .await
                .map_err(api)?;
            View::Done("export removed")
        }
    })
}

/// A `remote` command.
async fn remote(client: &Client, cmd: &RemoteCmd) -> Result<View, ExitCode> {
    let api = |e: client::Error| fail(&e);
    Ok(match cmd {
        RemoteCmd::Create {
            name,
            address,
            nqn,
            secret_file,
            ctrl_secret_file,
            read_only,
        } => {
            let stdin = Path::new("-");
            if secret_file.as_deref() == Some(stdin) && ctrl_secret_file.as_deref() == Some(stdin) {
                eprintln!(
                    "blockplane: --secret-file and --ctrl-secret-file cannot both be `-`: standard input holds one of them; give the other in a file"
                );
                return Err(ExitCode::from(2));
            }
            let secret = |file: &Option<std::path::PathBuf>, what| {
                file.as_deref().map(|p| read_secret(p, what)).transpose()
            };
            let req = CreateRemoteRequest {
                name: name.clone(),
                address: address.clone(),
                nqn: nqn.clone(),
                secret: secret(secret_file, "secret file")?,
                ctrl_secret: secret(ctrl_secret_file, "ctrl secret file")?,
                read_only: *read_only,
            };
            View::Remote(client.create_remote(&req).await.map_err(api)?)
        }
        RemoteCmd::Ls => View::Remotes(client.remotes().await.map_err(api)?),
        RemoteCmd::Show { remote } => View::Remote(client.remote(remote).await.map_err(api)?),
        RemoteCmd::Set { remote, read_only } => {
            let patch = PatchRemoteRequest {
                read_only: Some(*read_only),
                ..Default::default()
            };
            View::Remote(client.patch_remote(remote, &patch).await.map_err(api)?)
        }
        RemoteCmd::Rm { remote } => {
            client.delete_remote(remote).await.map_err(api)?;
            View::Done("remote volume disconnected")
        }
    })
}

/// A `move` command.
async fn moves(client: &Client, cmd: &MoveCmd) -> Result<View, ExitCode> {
    let api = |e: client::Error| fail(&e);
    Ok(match cmd {
        MoveCmd::Start {
            remote,
            image,
            path,
            source_api,
            keep_source_image,
            key_file,
            rate_limit,
            wait,
        } => {
            let req = StartMoveRequest {
                image: image.clone(),
                path: path.clone(),
                source_api: source_api.clone(),
                keep_source_image: *keep_source_image,
                rate_limit_bytes_per_sec: *rate_limit,
                key: key_file.as_deref().map(read_key).transpose()?,
            };
            let started = client.start_move(remote, &req).await.map_err(api)?;
            if *wait {
                View::Move(wait_move(client, started).await.map_err(waited)?)
            } else {
                View::Move(started)
            }
        }
        MoveCmd::Pull {
            volume,
            source_api,
            image,
            path,
            keep_source_image,
            key_file,
            rate_limit,
            wait,
        } => {
            let req = ColdMoveRequest {
                source_api: source_api.clone(),
                volume: volume.clone(),
                image: image.clone(),
                path: path.clone(),
                keep_source_image: *keep_source_image,
                rate_limit_bytes_per_sec: *rate_limit,
                key: key_file.as_deref().map(read_key).transpose()?,
            };
            let started = client.cold_move(&req).await.map_err(api)?;
            if *wait {
                View::Move(wait_move(client, started).await.map_err(waited)?)
            } else {
                View::Move(started)
            }
        }
        MoveCmd::Drain {
            source_api,
            dir,
            volumes,
            keep_source_images,
            rate_limit,
        } => {
            let req = DrainRequest {
                source_api: source_api.clone(),
                volumes: volumes.clone(),
                dir: dir.clone(),
                keep_source_images: *keep_source_images,
                rate_limit_bytes_per_sec: *rate_limit,
            };
            View::Drain(client.start_drain(&req).await.map_err(api)?)
        }
        MoveCmd::DrainShow { id } => View::Drain(client.drain(id).await.map_err(api)?),
        MoveCmd::DrainSet { id, rate_limit } => {
            let patch = PatchDrainRequest {
                rate_limit_bytes_per_sec: *rate_limit,
            };
            View::Drain(client.patch_drain(id, &patch).await.map_err(api)?)
        }
        MoveCmd::Ls => View::Moves(client.moves().await.map_err(api)?),
        MoveCmd::Show { id } => View::Move(client.get_move(id).await.map_err(api)?),
        MoveCmd::Set { id, rate_limit } => {
            let patch = PatchMoveRequest {
                rate_limit_bytes_per_sec: *rate_limit,
            };
            View::Move(client.patch_move(id, &patch).await.map_err(api)?)
        }
        MoveCmd::Cancel { id } => View::Move(client.cancel_move(id).await.map_err(api)?),
    })
}

/// Every page of a snapshot's ranges, as one answer.
async fn image_ranges(client: &Client, image: &str, base: Option<&str>) -> Result<View, ExitCode> {
    let mut offset = 0;
    let mut all: Option<ImageRanges> = None;
    loop {
        let page = match base {
            Some(b) => {
                let q = ChangesQuery {
                    base: b.to_string(),
                    offset,
                    limit: None,
                };
                client.image_changes(image, &q).await
            }
            None => {
                let q = AllocatedQuery {
                    offset,
                    limit: None,
                };
                client.image_allocated(image, &q).await
            }
        }
        .map_err(|e| fail(&e))?;
        let next = page.next_offset;
        match all.as_mut() {
            None => all = Some(page),
            Some(a) => {
                // A range may go on where the last page stopped: one range.
                for r in page.ranges {
                    match a.ranges.last_mut() {
                        Some(last) if last.offset + last.length == r.offset => {
                            last.length += r.length
                        }
                        _ => a.ranges.push(r),
                    }
                }
                a.mapped_bytes += page.mapped_bytes;
                a.compared_bytes += page.compared_bytes;
            }
        }
        match next {
            Some(n) => offset = n,
            None => break,
        }
    }
    let mut all = all.expect("at least one page");
    all.next_offset = None;
    Ok(View::Ranges(all))
}
