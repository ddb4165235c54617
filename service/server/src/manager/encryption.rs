//! Encrypted images: formatting a new file as LUKS2, checking a volume's
//! key, and the dm-crypt layer a volume on one serves its plaintext through,
//! over whatever device its backend made (loop, ublk or dm: all kernel
//! devices, so each policy keeps its path under the cipher).
//!
//! Keys pass through here and into `blockplane_system::crypt`'s pipes only:
//! they are in no error, event, log line or row.

use std::os::fd::OwnedFd;

use blockplane_api::model::{
    AddKeyRequest, Image, ImageEncryption, Key, KeySlotAdded, RemoveKeyRequest, Volume, VolumeState,
};
use blockplane_system::crypt::{self, CryptError};
use blockplane_system::image::Access;
use uuid::Uuid;

use super::blocking::blocking;
use super::error::{Error, Result};
use super::house::House;
use super::image_jobs::Images;
use super::volume_part::Volumes;
use crate::attachment::Attachment;
use crate::store::{CryptLayer, ImageRow, VolumeRow};

/// Bytes of an encrypted image before its payload: LUKS2's default header
/// and key slot area, fixed so that a create knows it before formatting.
pub(super) const HEADER_BYTES: u64 = 16 << 20;

/// The least payload an encrypted image may have.
const MIN_PAYLOAD_BYTES: u64 = 1 << 20;

/// The least size of an encrypted image: its header and the least payload
/// (also stated in the API's schema).
pub(crate) const MIN_ENCRYPTED_BYTES: u64 = HEADER_BYTES + MIN_PAYLOAD_BYTES;

/// The dm name of a volume's plaintext device.
pub(super) fn crypt_name(volume_id: Uuid) -> String {
    format!("blockplane-crypt-{volume_id}")
}

/// What a failure of cryptsetup on image `image` is, for the API.
pub(super) fn crypt_error(image: &str, e: CryptError) -> Error {
    match e {
        CryptError::WrongKey => Error::KeyRejected {
            image: image.to_string(),
        },
        CryptError::Missing(e) => Error::EncryptionUnavailable {
            image: image.to_string(),
            reason: format!("cryptsetup cannot run here ({e}); install Debian's cryptsetup-bin"),
        },
        CryptError::Unsupported { version, offset } => Error::LuksUnsupported {
            image: image.to_string(),
            what: crypt::version_name(version),
            offset,
        },
        CryptError::Unreadable { offset, message } => Error::LuksUnreadable {
            image: image.to_string(),
            offset,
            reason: message,
        },
        e => Error::Crypt {
            image: image.to_string(),
            source: e,
        },
    }
}

/// The header of the LUKS2 file `fd` as the API shows it, or `None` when it
/// has no LUKS magic. Fails closed: a LUKS1 header, a LUKS2 one cryptsetup
/// cannot read, or a LUKS2 file on a host whose cryptsetup cannot run is an
/// error, never `None`, since a volume on an image without encryption
/// serves the file's bytes (here its ciphertext) as writable data.
pub(super) fn encryption_of(image: &str, fd: &OwnedFd) -> Result<Option<ImageEncryption>> {
    use std::os::fd::AsFd;
    let Some(layout) = crypt::header(fd.as_fd()).map_err(|e| crypt_error(image, e))? else {
        return Ok(None);
    };
    Ok(Some(ImageEncryption {
        format: "luks2".into(),
        cipher: layout.cipher,
        header_bytes: layout.payload_offset,
        key_slots: layout.key_slots,
    }))
}

/// A change of an encrypted image's key slots.
enum SlotChange {
    Add { key: Key, new_key: Key },
    Remove { slot: u32, key: Key },
}

/// Slots as `0, 1`.
fn slot_list(slots: &[u32]) -> String {
    slots
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The path a volume's plaintext device has.
pub(super) fn plaintext_device(layer: &CryptLayer) -> String {
    crypt::device_of(&layer.name).display().to_string()
}

/// Refuses a change of `row`'s key slots that cannot be made: the image is
/// not encrypted, a key is malformed, the slot to remove is not there or is
/// the last, or the image is a snapshot (its slots are part of its bytes).
fn slots_changeable(row: &ImageRow, change: &SlotChange) -> Result<()> {
    let Some(encryption) = &row.encryption else {
        return Err(Error::NotEncrypted {
            image: row.name.clone(),
            what: "it has no key slots".into(),
        });
    };
    for (field, key) in match change {
        SlotChange::Add { key, new_key } => vec![("key", key), ("new_key", new_key)],
        SlotChange::Remove { key, .. } => vec![("key", key)],
    } {
        if let Some(reason) = key.refusal() {
            return Err(Error::InvalidField { field, reason });
        }
    }
    if let SlotChange::Remove { slot, .. } = *change {
        if !encryption.key_slots.contains(&slot) {
            return Err(Error::KeySlotNotFound {
                image: row.name.clone(),
                slot,
                slots: slot_list(&encryption.key_slots),
            });
        }
        if encryption.key_slots.len() == 1 {
            return Err(Error::LastKeySlot {
                image: row.name.clone(),
                slot,
            });
        }
    }
    if row.read_only {
        return Err(Error::ImageReadOnly {
            name: row.name.clone(),
            source_id: row.snapshot_of.map(|s| s.to_string()).unwrap_or_default(),
            reason: "its key slots are part of its bytes, which a snapshot keeps as they were"
                .into(),
        });
    }
    Ok(())
}

/// The LUKS2 steps that need the house alone: a header written, checked
/// or erased, and the dm-crypt layer opened and closed.
impl House {
    /// Refuses, before anything is made, an encrypted create of `size`
    /// bytes that leaves no room for a payload after the header.
    pub(super) fn check_encrypted_size(&self, image: &str, size: u64) -> Result<()> {
        if size < MIN_ENCRYPTED_BYTES {
            return Err(Error::InvalidField {
                field: "create.size_bytes",
                reason: format!(
                    "image '{image}': an encrypted image holds its {HEADER_BYTES}-byte LUKS2 header before its data, so it needs at least {} bytes (asked {size})",
                    MIN_ENCRYPTED_BYTES
                ),
            });
        }
        Ok(())
    }

    /// Formats the new file `fd` of image `image` as LUKS2 with `key` in
    /// slot 0; its header as read back.
    pub(super) async fn format_image(
        &self,
        image: &str,
        fd: OwnedFd,
        key: &Key,
    ) -> Result<(OwnedFd, ImageEncryption)> {
        use std::os::fd::AsFd;
        let (name, key, kdf) = (image.to_string(), key.clone(), self.settings.kdf);
        blocking(move || {
            crypt::format(fd.as_fd(), key.as_bytes(), HEADER_BYTES, kdf)
                .map_err(|e| crypt_error(&name, e))?;
            let encryption = encryption_of(&name, &fd)?.ok_or_else(|| {
                Error::Internal(format!("image '{name}': no LUKS2 header after formatting"))
            })?;
            Ok((fd, encryption))
        })
        .await?
    }

    /// The dm-crypt layer a new volume on `image` gets, once its key is
    /// checked against the file `fd` (nothing is opened yet): `None` for a
    /// plain image. Refuses a missing key, a key for a plain image, and a
    /// key that opens no slot.
    pub(super) async fn crypt_layer_for(
        &self,
        image: &ImageRow,
        fd: OwnedFd,
        key: Option<&Key>,
        volume_id: Uuid,
    ) -> Result<Option<CryptLayer>> {
        let Some(encryption) = &image.encryption else {
            if key.is_some() {
                return Err(Error::NotEncrypted {
                    image: image.name.clone(),
                    what: "a volume on it takes no \"key\"".into(),
                });
            }
            return Ok(None);
        };
        let Some(key) = key else {
            return Err(Error::KeyRequired {
                image: image.name.clone(),
            });
        };
        if let Some(reason) = key.refusal() {
            return Err(Error::InvalidField {
                field: "key",
                reason,
            });
        }
        let (name, key) = (image.name.clone(), key.clone());
        blocking(move || {
            use std::os::fd::AsFd;
            crypt::check_key(fd.as_fd(), key.as_bytes()).map_err(|e| crypt_error(&name, e))
        })
        .await??;
        Ok(Some(CryptLayer {
            name: crypt_name(volume_id),
            header_bytes: encryption.header_bytes,
        }))
    }

    /// Opens a volume's plaintext over the device its backend made.
    pub(super) async fn open_crypt(
        &self,
        layer: &CryptLayer,
        image: &str,
        att: &Attachment,
        key: &Key,
    ) -> Result<()> {
        let (name, image, device, key, read_only) = (
            layer.name.clone(),
            image.to_string(),
            att.device.clone(),
            key.clone(),
            att.read_only,
        );
        blocking(move || {
            crypt::open(
                std::path::Path::new(&device),
                &name,
                key.as_bytes(),
                read_only,
            )
            .map(drop)
            .map_err(|e| match e {
                CryptError::Failed { message, .. } if message.contains("device-mapper") => {
                    Error::EncryptionUnavailable {
                        image,
                        reason: format!(
                            "dm-crypt cannot run on this host: {}",
                            message.lines().next().unwrap_or_default()
                        ),
                    }
                }
                e => crypt_error(&image, e),
            })
        })
        .await?
    }

    /// Closes a volume's plaintext device, if it is open.
    pub(super) async fn close_crypt(&self, v: &VolumeRow) -> Result<()> {
        let Some(layer) = &v.crypt else {
            return Ok(());
        };
        let (name, volume) = (layer.name.clone(), v.name.clone());
        blocking(move || {
            crypt::close(&name).map_err(|e| Error::Crypt {
                image: format!("of volume '{volume}'"),
                source: e,
            })
        })
        .await?
    }

    /// Destroys every key slot of an encrypted image (crypto-erase).
    pub(super) async fn erase_image(&self, row: &ImageRow) -> Result<ImageEncryption> {
        let file = self.open_image(row, blockplane_system::image::Access::ReadWrite)?;
        let name = row.name.clone();
        blocking(move || {
            use std::os::fd::AsFd;
            let fd = file.into_fd();
            crypt::erase(fd.as_fd()).map_err(|e| crypt_error(&name, e))?;
            encryption_of(&name, &fd)?.ok_or_else(|| {
                Error::Internal(format!("image '{name}': no LUKS2 header after erasing"))
            })
        })
        .await?
    }

    /// What holds an encrypted image's header for writing: the backend's
    /// device of the volume serving it, or else the file.
    async fn header_holder(&self, row: &ImageRow) -> Result<OwnedFd> {
        for (id, _) in self.store.volumes_of_image(row.id).await? {
            let Some(v) = self.store.volume(&id.to_string()).await? else {
                continue;
            };
            let Some(att) = &v.attachment else {
                continue;
            };
            if v.read_only {
                return Err(Error::VolumeState {
                    name: v.name.clone(),
                    state: v.state.as_str(),
                    reason: format!(
                        "it serves image '{}' read-only, so its key slots cannot be written; make it writable or delete it first",
                        row.name
                    ),
                });
            }
            let device = att.device.clone();
            return std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&device)
                .map(OwnedFd::from)
                .map_err(|e| Error::Crypt {
                    image: row.name.clone(),
                    source: CryptError::Failed {
                        op: "open",
                        message: format!("{device}: {e}"),
                    },
                });
        }
        Ok(self
            .open_image(row, blockplane_system::image::Access::ReadWrite)?
            .into_fd())
    }
}

impl Images {
    /// Adds or removes a key slot, on the image file, or on the backend's
    /// device while a volume serves it (a direct-mapped file is pinned and
    /// cannot be written; the device writes the same bytes). Records the
    /// header as read back, with an event.
    async fn change_key_slots(&self, id_or_name: &str, change: SlotChange) -> Result<(u32, Image)> {
        let row = self.house.image_row(id_or_name).await?;
        let _image = self.house.locks.images.lock(&row.id.to_string()).await;
        let row = self.house.image_row(&row.id.to_string()).await?;
        self.jobs.backups.refuse(&row, "change its key slots")?;
        self.house.refuse_unready(&row, "change its key slots")?;
        slots_changeable(&row, &change)?;
        let header = self.house.header_holder(&row).await?;
        let adding = matches!(change, SlotChange::Add { .. });
        let (name, kdf) = (row.name.clone(), self.house.settings.kdf);
        let (slot, encryption) = blocking(move || {
            use std::os::fd::AsFd;
            let slot = match &change {
                SlotChange::Add { key, new_key } => {
                    crypt::add_key(header.as_fd(), key.as_bytes(), new_key.as_bytes(), kdf)
                }
                SlotChange::Remove { slot, key } => {
                    crypt::remove_key(header.as_fd(), *slot, key.as_bytes()).map(|()| *slot)
                }
            }
            .map_err(|e| crypt_error(&name, e))?;
            let encryption = encryption_of(&name, &header)?.ok_or_else(|| {
                Error::Internal(format!(
                    "image '{name}': no LUKS2 header after a key change"
                ))
            })?;
            Ok::<_, Error>((slot, encryption))
        })
        .await??;
        let (kind, verb) = match adding {
            true => ("image_key_added", "added"),
            false => ("image_key_removed", "removed"),
        };
        let mut tx = self.house.store.begin().await?;
        tx.set_image_encryption(row.id, Some(&encryption)).await?;
        tx.event(
            None,
            Some(row.id),
            kind,
            &format!(
                "image '{}': key slot {slot} {verb}; its slots now {}",
                row.name,
                slot_list(&encryption.key_slots)
            ),
        )
        .await?;
        tx.commit().await?;
        tracing::info!(image = %row.name, slot, verb, "key slots changed");
        let row = self.house.image_row(&row.id.to_string()).await?;
        Ok((slot, self.image_view(row).await?))
    }

    /// `POST /v1/images/{id}/keys`: a new key slot.
    pub(crate) async fn add_image_key(
        &self,
        id_or_name: &str,
        req: AddKeyRequest,
    ) -> Result<KeySlotAdded> {
        let (slot, image) = self
            .change_key_slots(
                id_or_name,
                SlotChange::Add {
                    key: req.key,
                    new_key: req.new_key,
                },
            )
            .await?;
        Ok(KeySlotAdded { slot, image })
    }

    /// `DELETE /v1/images/{id}/keys/{slot}`: a key slot removed (never the
    /// last one).
    pub(crate) async fn remove_image_key(
        &self,
        id_or_name: &str,
        slot: u32,
        req: RemoveKeyRequest,
    ) -> Result<Image> {
        let change = SlotChange::Remove { slot, key: req.key };
        Ok(self.change_key_slots(id_or_name, change).await?.1)
    }
}

impl Volumes {
    /// `POST /v1/volumes/{id}/unlock`: opens a `locked` volume's plaintext
    /// device again with its image's key. On a volume that serves its
    /// plaintext already, the key is checked and nothing else done.
    pub(crate) async fn unlock_volume(&self, id_or_name: &str, key: Key) -> Result<Volume> {
        let v = self.house().volume_row(id_or_name).await?;
        let _volume = self.house().locks.volumes.lock(&v.name).await;
        let mut v = self.house().volume_row(&v.id.to_string()).await?;
        let image = self.house().image_row(&v.image_id.to_string()).await?;
        let Some(layer) = v.crypt.clone() else {
            return Err(Error::NotEncrypted {
                image: image.name,
                what: format!("volume '{}' has no key to give", v.name),
            });
        };
        if let Some(reason) = key.refusal() {
            return Err(Error::InvalidField {
                field: "key",
                reason,
            });
        }
        // A writable volume unlocked writes again: not while a backup reads
        // its image (decided under this volume's lock).
        if v.state == VolumeState::Locked && !v.read_only {
            self.images
                .jobs
                .backups
                .refuse(&image, &format!("unlock writable volume '{}'", v.name))?;
        }
        let att = match (&v.attachment, v.state) {
            (Some(att), VolumeState::Locked | VolumeState::Attached | VolumeState::Degraded) => {
                att.clone()
            }
            _ => {
                return Err(Error::VolumeState {
                    name: v.name.clone(),
                    state: v.state.as_str(),
                    reason: "only a volume whose device serves can be unlocked".into(),
                });
            }
        };
        let file = self.house().open_image(&image, Access::ReadOnly)?;
        let (name, checked_key) = (image.name.clone(), key.clone());
        blocking(move || {
            use std::os::fd::AsFd;
            crypt::check_key(file.fd().as_fd(), checked_key.as_bytes())
                .map_err(|e| crypt_error(&name, e))
        })
        .await??;
        // Locked, or closed behind the service's back since it last looked.
        if !crypt::is_open(&layer.name) {
            self.house()
                .open_crypt(&layer, &image.name, &att, &key)
                .await?;
            self.house()
                .record_attached(&mut v, att, "volume_unlocked")
                .await?;
            tracing::info!(volume = %v.name, "volume unlocked");
        }
        self.volume_view(&v).await
    }
}
