//! Waiting for the service's background work (an image's allocate, a
//! snapshot's, clone's or restore's copy, a backup, a move), its progress
//! on stderr.

use blockplane_api::model::{
    AllocateState, Backup, BackupState, Image, ImageState, Move, MoveState, human_size,
};
use blockplane_client::Client;

use super::render::{dash, move_progress, rate};

/// Follows an image's allocate until it ends: the image when done, why
/// not otherwise.
pub async fn wait_allocate(client: &Client, image: &str, started: Image) -> Result<Image, String> {
    follow_image(client, image, started, |i| match &i.allocate {
        Some(a) if a.state == AllocateState::Running => {
            eprintln!(
                "allocating image '{image}': {} of {}",
                human_size(a.done_bytes),
                human_size(a.total_bytes)
            );
            None
        }
        Some(a) if a.state == AllocateState::Done => Some(Ok(())),
        a => Some(Err(format!(
            "the allocate of image '{image}' ended {}{}; the image stays as it was declared (allocate again)",
            a.as_ref().map_or("unseen", |a| a.state.as_str()),
            a.as_ref()
                .and_then(|a| a.error.as_deref())
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ))),
    })
    .await
}

/// Follows a snapshot's or clone's copy until the image is ready: the image
/// when ready, why not otherwise.
pub async fn wait_copy(client: &Client, image: &str, started: Image) -> Result<Image, String> {
    follow_image(client, image, started, |i| match i.state {
        ImageState::Copying => {
            eprintln!(
                "copying image '{image}': {} of {}",
                dash(i.copied_bytes.map(human_size)),
                dash(i.copy_total_bytes.map(human_size))
            );
            None
        }
        ImageState::Ready => Some(Ok(())),
        ImageState::Failed => Some(Err(format!(
            "the copy of image '{image}' ended {}: {}",
            i.state.as_str(),
            i.state_reason.as_deref().unwrap_or("no reason given")
        ))),
    })
    .await
}

/// Reads an image once a second until `step` says it is done (`Some`): the
/// image's last view, or `step`'s reason.
async fn follow_image(
    client: &Client,
    image: &str,
    mut last: Image,
    step: impl Fn(&Image) -> Option<Result<(), String>>,
) -> Result<Image, String> {
    loop {
        if let Some(end) = step(&last) {
            return end.map(|()| last);
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        last = client.image(image).await.map_err(|e| e.to_string())?;
    }
}

/// Follows a backup until it ends: the backup when done, why not otherwise.
pub async fn wait_backup(client: &Client, id: &str, mut last: Backup) -> Result<Backup, String> {
    loop {
        match last.state {
            BackupState::Running => eprintln!(
                "backing image '{}' up as '{}': {} of {}",
                last.image_name,
                last.name,
                dash(last.done_bytes.map(human_size)),
                dash(last.total_bytes.map(human_size))
            ),
            BackupState::Done => return Ok(last),
            state => {
                return Err(format!(
                    "backup '{}' of image '{}' ended {}: {}",
                    last.name,
                    last.image_name,
                    state.as_str(),
                    last.error.as_deref().unwrap_or("no reason given")
                ));
            }
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        last = client.backup(id).await.map_err(|e| e.to_string())?;
    }
}

/// Follows a move until its data is here and the exporting host let its
/// volume go: the move when done, why not otherwise. The move goes on in
/// the service whether this follows it or not.
pub async fn wait_move(client: &Client, mut last: Move) -> Result<Move, String> {
    let id = last.id.to_string();
    // A line is printed when it changes: a release the exporting host
    // refuses is retried for as long as it takes.
    let mut said = String::new();
    loop {
        let line = match last.state {
            MoveState::Syncing => format!(
                "moving remote '{}' into image '{}': {}, {}",
                last.remote_name,
                last.image,
                move_progress(&last),
                rate(last.rate_bytes_per_sec)
            ),
            MoveState::Releasing => {
                let why = last.state_reason.as_deref().map(|r| format!(" ({r})"));
                format!(
                    "moved remote '{}' into image '{}': the exporting host is told to let its volume go{}",
                    last.remote_name,
                    last.image,
                    why.unwrap_or_default()
                )
            }
            MoveState::Done => return Ok(last),
            state => {
                return Err(format!(
                    "the move of remote '{}' ended {}: {}",
                    last.remote_name,
                    state.as_str(),
                    last.state_reason.as_deref().unwrap_or("no reason given")
                ));
            }
        };
        if line != said {
            eprintln!("{line}");
            said = line;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        last = client.get_move(&id).await.map_err(|e| e.to_string())?;
    }
}
