//! Encryption keys: what opens an encrypted image (LUKS2). Write-only: a
//! key is read from a request and handed to the kernel, never echoed in an
//! answer, an event, a log line or the registry.

use serde::{Deserialize, Serialize};

/// The most characters of a key (at most 1 KiB of UTF-8).
pub const MAX_KEY_CHARS: usize = 256;

/// A LUKS2 key (passphrase): 1 to 256 characters, used as its UTF-8 bytes.
/// Its `Debug` form hides it, so a logged request never shows it.
#[derive(Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(transparent)]
pub struct Key(String);

/// The document's one schema of a key: a write-only password string of
/// 1 to [`MAX_KEY_CHARS`] characters.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for Key {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Password)))
            .min_length(Some(1))
            .max_length(Some(MAX_KEY_CHARS))
            .write_only(true)
            .description(Some(
                "A LUKS2 key (passphrase): 1 to 256 characters, used as its UTF-8 bytes. \
                 Never in an answer, an event, a log line or the registry.",
            ))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for Key {}

impl Key {
    /// A key of `text`.
    pub fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The bytes given to cryptsetup.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// Why it breaks the rule on keys, if it does.
    pub fn refusal(&self) -> Option<String> {
        let chars = self.0.chars().count();
        (chars == 0 || chars > MAX_KEY_CHARS)
            .then(|| format!("a key has 1 to {MAX_KEY_CHARS} characters, this one {chars}"))
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(hidden)")
    }
}

/// `create.encryption` of `POST /v1/images`: format the new file as LUKS2.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateEncryption {
    /// The key of its first key slot (slot 0). Never shown again.
    pub key: Key,
}

/// An encrypted image's LUKS2 header, as the service last read it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageEncryption {
    /// Always `luks2`.
    pub format: String,
    /// The payload's cipher, e.g. `aes-xts-plain64`.
    pub cipher: String,
    /// Bytes of the file before the payload (the header and key slots): a
    /// volume's device is this much smaller than its image.
    pub header_bytes: u64,
    /// The key slots in use.
    pub key_slots: Vec<u32>,
}

/// Bytes of the device served from `file_bytes` of an image encrypted as
/// `encryption` (`None`: plain): the file less the header. The one place
/// that says how a volume's size follows from its image's.
pub fn device_bytes(encryption: Option<&ImageEncryption>, file_bytes: u64) -> u64 {
    file_bytes.saturating_sub(encryption.map_or(0, |e| e.header_bytes))
}

/// `POST /v1/volumes/{id}/unlock`: the key of a `locked` volume's image.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct UnlockVolumeRequest {
    /// A key that opens a key slot of the volume's image.
    pub key: Key,
}

/// `POST /v1/images/{id}/keys`: a new key slot, authorized by a key that
/// opens one already.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AddKeyRequest {
    /// A key that opens a key slot of the image now.
    pub key: Key,
    /// The key of the new slot.
    pub new_key: Key,
}

/// `DELETE /v1/images/{id}/keys/{slot}`: the key that authorizes removing
/// a slot (one that opens a slot of the image, that one or another).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RemoveKeyRequest {
    /// A key that opens a key slot of the image now.
    pub key: Key,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_never_shows_in_debug_output() {
        let k = Key::new("s3cret");
        assert!(!format!("{k:?}").contains("s3cret"));
        assert!(k.refusal().is_none());
        assert!(Key::new("").refusal().is_some());
        assert!(Key::new("é".repeat(257)).refusal().is_some());
        assert!(Key::new("é".repeat(256)).refusal().is_none());
    }
}
