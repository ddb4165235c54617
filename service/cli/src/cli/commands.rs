//! The client commands: each becomes calls of the typed client and its
//! answer a [`View`] to print. A failure is printed, with the API's code and
//! status when it answered one, and becomes the exit code.

use std::process::ExitCode;

use blockplane_api::model::{
    CreateImageFile, CreateImageRequest, CreateSnapshotRequest, CreateVolumeRequest,
    DEFAULT_MAX_IO_BYTES, DeleteImageQuery, EventQuery, ListImagesQuery, PatchVolumeRequest,
    ResizeImageRequest,
};
use blockplane_client::{self as client, Client, Endpoint};

use super::args::{BackupCmd, Cli, Command, ImageCmd, VolumeCmd};
use super::busy::refuse_if_busy;
use super::local::api_address;
use super::output::{fail, print};
use super::progress::{wait_allocate, wait_backup, wait_copy};
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
    let client = match Endpoint::parse(&api) {
        Ok(e) => Client::new(e, flags.api.token.clone()),
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

/// An `image` command.
async fn image(client: &Client, cmd: &ImageCmd) -> Result<View, ExitCode> {
    let api = |e: client::Error| fail(&e);
    let waited = |msg: String| {
        eprintln!("blockplane: {msg}");
        ExitCode::FAILURE
    };
    let create = |name: &str, path: &str, create, clone_from: Option<&str>| CreateImageRequest {
        name: name.into(),
        path: path.into(),
        create,
        clone_from: clone_from.map(str::to_string),
        restore_from: None,
        allocation: None,
    };
    Ok(match cmd {
        ImageCmd::Add {
            name,
            path,
            allocation,
        } => {
            let req = CreateImageRequest {
                allocation: *allocation,
                ..create(name, path, None, None)
            };
            View::Image(client.create_image(&req).await.map_err(api)?)
        }
        ImageCmd::Create {
            name,
            path,
            size,
            allocation,
            encrypt: _,
            key_file,
        } => {
            let encryption = match key_file {
                Some(path) => Some(blockplane_api::model::CreateEncryption {
                    key: read_key(path)?,
                }),
                None => None,
            };
            let file = CreateImageFile {
                size_bytes: *size,
                allocation: *allocation,
                encryption,
            };
            let req = create(name, path, Some(file), None);
            View::Image(client.create_image(&req).await.map_err(api)?)
        }
        ImageCmd::KeyAdd {
            image,
            key_file,
            new_key_file,
        } => {
            let req = blockplane_api::model::AddKeyRequest {
                key: read_key(key_file)?,
                new_key: read_key(new_key_file)?,
            };
            let added = client.add_image_key(image, &req).await.map_err(api)?;
            eprintln!("key slot {} added", added.slot);
            View::Image(added.image)
        }
        ImageCmd::KeyRm {
            image,
            slot,
            key_file,
        } => {
            let req = blockplane_api::model::RemoveKeyRequest {
                key: read_key(key_file)?,
            };
            View::Image(
                client
                    .remove_image_key(image, *slot, &req)
                    .await
                    .map_err(api)?,
            )
        }
        ImageCmd::Ls => View::Images(
            client
                .images(&ListImagesQuery::default())
                .await
                .map_err(api)?,
        ),
        ImageCmd::Show { image } => View::Image(client.image(image).await.map_err(api)?),
        ImageCmd::Resize { image, size } => {
            let req = ResizeImageRequest { size_bytes: *size };
            View::Resize(client.resize_image(image, &req).await.map_err(api)?)
        }
        ImageCmd::Allocate {
            image,
            cancel: true,
            ..
        } => View::Image(client.cancel_allocate(image).await.map_err(api)?),
        ImageCmd::Allocate { image, no_wait, .. } => {
            let started = client.allocate_image(image).await.map_err(api)?;
            if *no_wait {
                View::Image(started)
            } else {
                View::Image(
                    wait_allocate(client, image, started)
                        .await
                        .map_err(waited)?,
                )
            }
        }
        ImageCmd::Snapshot { src, name, no_wait } => {
            let req = CreateSnapshotRequest { name: name.clone() };
            let started = client.snapshot_image(src, &req).await.map_err(api)?;
            if *no_wait {
                View::Image(started)
            } else {
                View::Image(wait_copy(client, name, started).await.map_err(waited)?)
            }
        }
        ImageCmd::Clone {
            src,
            name,
            path,
            no_wait,
        } => {
            let req = create(name, path, None, Some(src));
            let started = client.create_image(&req).await.map_err(api)?;
            if *no_wait {
                View::Image(started)
            } else {
                View::Image(wait_copy(client, name, started).await.map_err(waited)?)
            }
        }
        ImageCmd::Backup {
            image,
            name,
            no_wait,
        } => {
            let req = blockplane_api::model::CreateBackupRequest { name: name.clone() };
            let started = client.backup_image(image, &req).await.map_err(api)?;
            if *no_wait {
                View::Backup(started)
            } else {
                let id = started.id.to_string();
                View::Backup(wait_backup(client, &id, started).await.map_err(waited)?)
            }
        }
        ImageCmd::Restore {
            name,
            path,
            from,
            no_wait,
        } => {
            let req = CreateImageRequest {
                restore_from: Some(from.clone()),
                ..create(name, path, None, None)
            };
            let started = client.create_image(&req).await.map_err(api)?;
            if *no_wait {
                View::Image(started)
            } else {
                View::Image(wait_copy(client, name, started).await.map_err(waited)?)
            }
        }
        ImageCmd::Rm {
            image,
            delete_file,
            erase,
        } => {
            let query = DeleteImageQuery {
                delete_file: *delete_file,
                erase: *erase,
            };
            client.delete_image(image, &query).await.map_err(api)?;
            View::Done("image removed")
        }
    })
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
    })
}

/// A key from `path` (`-`: standard input), one trailing newline dropped
/// (what `echo` and editors add).
fn read_key(path: &std::path::Path) -> Result<blockplane_api::model::Key, ExitCode> {
    let read = if path == std::path::Path::new("-") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map(|_| s)
    } else {
        std::fs::read_to_string(path)
    };
    let text = read.map_err(|e| {
        eprintln!(
            "blockplane: cannot read the key file {}: {e}",
            path.display()
        );
        ExitCode::from(2)
    })?;
    let text = text.strip_suffix('\n').unwrap_or(&text);
    Ok(blockplane_api::model::Key::new(
        text.strip_suffix('\r').unwrap_or(text),
    ))
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
