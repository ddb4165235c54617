//! The names of the images and volumes an answer refers to by id, so that
//! tables show names people know.

use blockplane_api::model::{Image, ListImagesQuery, Volume};
use blockplane_client::Client;
use uuid::Uuid;

/// The images and volumes a view refers to by id; empty when not needed or
/// not readable (ids are shown then).
#[derive(Debug, Default)]
pub struct Names {
    images: Vec<Image>,
    volumes: Vec<Volume>,
}

impl Names {
    /// The images, for views of volumes.
    pub async fn images(client: &Client) -> Self {
        Names {
            images: client
                .images(&ListImagesQuery::default())
                .await
                .unwrap_or_default(),
            ..Default::default()
        }
    }

    /// The volumes, for views of images and statistics.
    pub async fn volumes(client: &Client) -> Self {
        Names {
            volumes: client.volumes().await.unwrap_or_default(),
            ..Default::default()
        }
    }

    /// A volume's image as people know it: its name (and path, when
    /// `with_path`), else its id.
    pub fn image_of(&self, v: &Volume, with_path: bool) -> String {
        match self.images.iter().find(|i| i.id == v.image_id) {
            Some(i) if with_path => format!("{} ({})", i.name, i.path),
            Some(i) => i.name.clone(),
            None => v.image_id.to_string(),
        }
    }

    /// A volume's name, from its id; the id when unknown.
    pub fn volume(&self, id: Uuid) -> String {
        self.volumes
            .iter()
            .find(|v| v.id == id)
            .map_or_else(|| id.to_string(), |v| v.name.clone())
    }
}
