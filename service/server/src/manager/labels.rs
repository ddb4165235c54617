//! Labels on images: the one check of a set of labels (an image's, or a
//! schedule's selector), and `PATCH /v1/images/{id}`, which merges labels
//! into an image's.

use blockplane_api::model::{
    Image, Labels, MAX_LABELS, PatchImageRequest, label_key_problem, label_value_problem,
};

use super::Manager;
use super::error::{Error, Result};

/// Checks `labels` of `owner` (`image 'db'`, `backup schedule 'nightly'`)
/// against the rules of a label and their count.
pub(super) fn check_labels(owner: &str, labels: &Labels) -> Result<()> {
    if labels.len() > MAX_LABELS {
        return Err(Error::InvalidLabel {
            owner: owner.to_string(),
            part: "set",
            text: String::new(),
            problem: "has more than 32 labels",
        });
    }
    check_pairs(owner, labels.iter().map(|(k, v)| (k, Some(v))))
}

/// Checks each key, and each value given, of `owner`'s labels.
fn check_pairs<'a>(
    owner: &str,
    pairs: impl IntoIterator<Item = (&'a String, Option<&'a String>)>,
) -> Result<()> {
    let refuse = |part, text: &str, problem| Error::InvalidLabel {
        owner: owner.to_string(),
        part,
        text: text.to_string(),
        problem,
    };
    for (k, v) in pairs {
        if let Some(p) = label_key_problem(k) {
            return Err(refuse("key", k, p));
        }
        if let Some((v, p)) = v.and_then(|v| Some((v, label_value_problem(v)?))) {
            return Err(refuse("value", v, p));
        }
    }
    Ok(())
}

/// `labels` with `patch` merged in: a value set, `None` removed.
fn merged(
    mut labels: Labels,
    patch: &std::collections::BTreeMap<String, Option<String>>,
) -> Labels {
    for (k, v) in patch {
        match v {
            Some(v) => labels.insert(k.clone(), v.clone()),
            None => labels.remove(k),
        };
    }
    labels
}

impl Manager {
    /// `PATCH /v1/images/{id}`: its labels merged with the patch's, all or
    /// nothing, with an `image_labels_changed` event when they change.
    pub(crate) async fn patch_image(
        &self,
        id_or_name: &str,
        req: &PatchImageRequest,
    ) -> Result<Image> {
        let house = &self.house;
        let row = house.image_row(id_or_name).await?;
        check_pairs(
            &format!("image '{}'", row.name),
            req.labels.iter().map(|(k, v)| (k, v.as_ref())),
        )?;
        let _image = house.locks.images.lock(&row.id.to_string()).await;
        let row = house.image_row(&row.id.to_string()).await?;
        let labels = merged(row.labels.clone(), &req.labels);
        if labels.len() > MAX_LABELS {
            return Err(Error::TooManyLabels {
                image: row.name,
                count: labels.len(),
            });
        }
        if labels != row.labels {
            let mut tx = house.store.begin().await?;
            tx.set_image_labels(row.id, &labels).await?;
            tx.event(
                None,
                Some(row.id),
                "image_labels_changed",
                &format!(
                    "image '{}': labels now {{{}}}",
                    row.name,
                    blockplane_api::model::labels_text(&labels)
                ),
            )
            .await?;
            tx.commit().await?;
        }
        self.images
            .image_view(house.image_row(&row.id.to_string()).await?)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_patch_sets_and_removes() {
        let labels = Labels::from([("a".into(), "1".into()), ("b".into(), "2".into())]);
        let patch = [
            ("a".to_string(), None),
            ("c".to_string(), Some("3".to_string())),
        ]
        .into_iter()
        .collect();
        let got = merged(labels, &patch);
        assert_eq!(
            got,
            Labels::from([("b".into(), "2".into()), ("c".into(), "3".into())])
        );
    }

    #[test]
    fn the_check_names_the_owner_and_the_label() {
        let bad = Labels::from([("Tier".into(), "gold".into())]);
        let e = check_labels("image 'db'", &bad).unwrap_err().to_string();
        assert!(e.contains("image 'db'") && e.contains("'Tier'"), "{e}");
        let many: Labels = (0..33).map(|i| (format!("k{i}"), String::new())).collect();
        assert!(check_labels("image 'db'", &many).is_err());
        let ok: Labels = (0..32).map(|i| (format!("k{i}"), "v".into())).collect();
        check_labels("image 'db'", &ok).unwrap();
    }
}
