//! DH-HMAC-CHAP secrets, the shared keys with which the kernel's NVMe target
//! ([`crate::nvmet`]) and initiator ([`crate::fabrics`]) authenticate each
//! other, in the one text form both take: `DHHC-1:<hh>:<base64(key ‖
//! crc32)>:`, where `hh` names a transformation of the key (`00` none, `01`
//! SHA-256, `02` SHA-384, `03` SHA-512), the key is 32, 48 or 64 bytes and
//! the CRC is zlib's CRC-32 of the key, little-endian (the kernel's
//! `nvme_auth_extract_key` checks all of it; so does [`Secret::parse`], so
//! that a bad secret is refused here with the rule it breaks rather than by
//! the kernel, which would print it to its log).
//!
//! A secret is held in memory that is wiped when it is dropped, has no
//! `Display`, no serde, and a `Debug` that does not show it: the only way to
//! its text is [`Secret::expose`], for writing it into the kernel.

use std::fmt;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use zeroize::Zeroizing;

/// What every secret starts with: the format's name and version.
const PREFIX: &str = "DHHC-1:";

/// The key lengths the kernel accepts, in bytes, before the CRC.
const KEY_LENGTHS: [usize; 3] = [32, 48, 64];

/// The bytes of the CRC trailer.
const CRC_BYTES: usize = 4;

/// The most base64 characters of a secret: a 64-byte key and its CRC.
const MAX_BASE64: usize = (64 + CRC_BYTES).div_ceil(3) * 4;

/// zlib's CRC-32 (reflected, polynomial 0xEDB88320, initial and final
/// inversion): the kernel computes `~crc32(~0, key, len)`, which is this.
const CRC32: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);

/// Base64 of the standard alphabet, written with padding, read with or
/// without it, as the kernel's `base64_decode` reads it.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why a secret could not be made or was refused. The messages say which
/// rule failed and never quote the secret.
#[derive(Debug, thiserror::Error)]
pub enum DhchapError {
    /// The kernel gave no random bytes for a new secret.
    #[error("cannot draw random bytes for a new DH-HMAC-CHAP secret: {0}")]
    Random(#[source] std::io::Error),
    /// The text does not start with `DHHC-1:`.
    #[error("a DH-HMAC-CHAP secret starts with \"DHHC-1:\" and this one does not")]
    Prefix,
    /// The hash id after the prefix is not two digits from `00` to `03`.
    #[error(
        "a DH-HMAC-CHAP secret's hash id (after \"DHHC-1:\") is two digits, 00 to 03, followed by ':'; this one's is not"
    )]
    HashId,
    /// The text does not end with `:`.
    #[error("a DH-HMAC-CHAP secret ends with ':' after its base64 key; this one does not")]
    Trailer,
    /// The key is not base64 of the standard alphabet.
    #[error("a DH-HMAC-CHAP secret's key is not valid base64 (standard alphabet)")]
    Base64,
    /// The key decodes to a length the kernel refuses.
    #[error(
        "a DH-HMAC-CHAP secret's key decodes to {bytes} bytes; the kernel takes 36, 52 or 68 (a key of 32, 48 or 64 bytes and its CRC)"
    )]
    Length {
        /// The decoded length (the key and its CRC), or more than the
        /// longest when the text is too long to decode.
        bytes: usize,
    },
    /// The CRC trailer does not match the key: a mistyped or cut secret.
    #[error("a DH-HMAC-CHAP secret's CRC does not match its key (mistyped or damaged)")]
    Crc,
}

/// A DH-HMAC-CHAP secret in its text form, checked.
#[derive(Clone)]
pub struct Secret(Zeroizing<String>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// A new secret: 32 random bytes from the kernel, hash id `00`.
    ///
    /// Why `00` (the key used as it is) rather than a transformed one:
    /// the kernel needs no transformation, and with one both sides first
    /// mix the key with an NQN (the host's for the host key, the
    /// subsystem's for the controller key), so a secret would be good for
    /// one name only; untransformed, one secret works whatever NQN the
    /// export or the consumer ends up with.
    pub fn generate() -> Result<Secret, DhchapError> {
        let mut raw = Zeroizing::new([0u8; 32 + CRC_BYTES]);
        let (key, crc) = raw.split_at_mut(32);
        getrandom::fill(key).map_err(|e| DhchapError::Random(e.into()))?;
        crc.copy_from_slice(&CRC32.checksum(key).to_le_bytes());
        Ok(Secret(encode(0, &raw[..])))
    }

    /// Checks `text` against every rule the kernel applies (prefix, hash
    /// id, base64, length, CRC) and keeps a copy of it.
    pub fn parse(text: &str) -> Result<Secret, DhchapError> {
        let rest = text.strip_prefix(PREFIX).ok_or(DhchapError::Prefix)?;
        let hash = rest.as_bytes();
        if hash.len() < 3 || !matches!(hash[..3], [b'0', b'0'..=b'3', b':']) {
            return Err(DhchapError::HashId);
        }
        let b64 = rest[3..].strip_suffix(':').ok_or(DhchapError::Trailer)?;
        if b64.len() > MAX_BASE64 {
            return Err(DhchapError::Length {
                bytes: b64.len() / 4 * 3,
            });
        }
        let mut raw = Zeroizing::new([0u8; MAX_BASE64 / 4 * 3]);
        let n = BASE64
            .decode_slice(b64, &mut raw[..])
            .map_err(|_| DhchapError::Base64)?;
        let key_len = n.wrapping_sub(CRC_BYTES);
        if !KEY_LENGTHS.contains(&key_len) {
            return Err(DhchapError::Length { bytes: n });
        }
        let (key, crc) = raw[..n].split_at(key_len);
        if CRC32.checksum(key).to_le_bytes() != crc {
            return Err(DhchapError::Crc);
        }
        let mut copy = Zeroizing::new(String::with_capacity(text.len()));
        copy.push_str(text);
        Ok(Secret(copy))
    }

    /// The secret's text, for writing into the kernel (configfs, sysfs,
    /// `/dev/nvme-fabrics`) and nowhere else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// `DHHC-1:<hash>:<base64(raw)>:`, built in place in wiped memory: the
/// base64 goes through a wiped buffer, and the string is allocated once at
/// its final size, so no copy of the secret is left behind by a growth.
fn encode(hash: u8, raw: &[u8]) -> Zeroizing<String> {
    let mut b64 = Zeroizing::new([0u8; MAX_BASE64]);
    let n = BASE64
        .encode_slice(raw, &mut b64[..])
        .expect("the buffer holds the longest key");
    let b64 = std::str::from_utf8(&b64[..n]).expect("base64 is ASCII");
    let mut text = Zeroizing::new(String::with_capacity(PREFIX.len() + 3 + n + 1));
    text.push_str(PREFIX);
    text.push_str(&format!("{hash:02}:"));
    text.push_str(b64);
    text.push(':');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example key of nvme-cli's `nvme-gen-dhchap-key` documentation,
    /// whose CRC the research checked against zlib's.
    const DOC_KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

    fn raw_of(text: &str) -> Vec<u8> {
        let b64 = &text[10..text.len() - 1];
        BASE64.decode(b64).unwrap()
    }

    #[test]
    fn a_generated_secret_parses_back_and_is_new_each_time() {
        let a = Secret::generate().unwrap();
        let b = Secret::generate().unwrap();
        assert_ne!(a.expose(), b.expose());
        assert!(a.expose().starts_with("DHHC-1:00:"), "{a:?}");
        assert!(a.expose().ends_with(':'));
        assert_eq!(raw_of(a.expose()).len(), 36);
        let again = Secret::parse(a.expose()).unwrap();
        assert_eq!(again.expose(), a.expose());
        assert_eq!(a.clone().expose(), a.expose());
    }

    #[test]
    fn the_nvme_cli_documentation_key_is_accepted() {
        let s = Secret::parse(DOC_KEY).unwrap();
        assert_eq!(s.expose(), DOC_KEY);
        // Its CRC, as the research found it: 0xa70d69fa.
        let raw = raw_of(DOC_KEY);
        assert_eq!(raw[32..], 0xa70d_69fa_u32.to_le_bytes());
    }

    #[test]
    fn every_hash_id_and_key_length_the_kernel_takes_is_accepted() {
        for hash in 0..=3u8 {
            for len in KEY_LENGTHS {
                let mut raw = vec![0x5a; len];
                raw.extend(CRC32.checksum(&raw).to_le_bytes());
                let text = encode(hash, &raw);
                let s = Secret::parse(&text)
                    .unwrap_or_else(|e| panic!("hash {hash}, {len} bytes: {e}"));
                assert_eq!(s.expose(), text.as_str());
                // The kernel reads base64 without its padding too.
                let bare = format!("{}:", text.trim_end_matches(':').trim_end_matches('='));
                Secret::parse(&bare).unwrap_or_else(|e| panic!("{len} bytes unpadded: {e}"));
            }
        }
    }

    #[test]
    fn a_flipped_byte_fails_the_crc() {
        let mut raw = raw_of(DOC_KEY);
        raw[7] ^= 0x01;
        let e = Secret::parse(&encode(0, &raw)).unwrap_err();
        assert!(matches!(e, DhchapError::Crc), "{e}");
        let mut raw = raw_of(DOC_KEY);
        raw[34] ^= 0x80;
        let e = Secret::parse(&encode(0, &raw)).unwrap_err();
        assert!(matches!(e, DhchapError::Crc), "{e}");
    }

    #[test]
    fn wrong_lengths_fail() {
        for len in [0, 1, 16, 31, 33, 47, 63, 65, 128] {
            let mut raw = vec![7; len];
            raw.extend(CRC32.checksum(&raw).to_le_bytes());
            let text = format!("DHHC-1:00:{}:", BASE64.encode(&raw));
            let e = Secret::parse(&text).unwrap_err();
            assert!(
                matches!(e, DhchapError::Length { bytes } if bytes == len + 4 || len == 128),
                "{len}: {e}"
            );
        }
        let e = Secret::parse("DHHC-1:00::").unwrap_err();
        assert!(matches!(e, DhchapError::Length { bytes: 0 }), "{e}");
    }

    #[test]
    fn each_malformed_part_is_named() {
        let body = &DOC_KEY[10..];
        for (text, want) in [
            (format!("DHHC-2:00:{body}"), "starts with"),
            (format!("dhhc-1:00:{body}"), "starts with"),
            (format!("DHHC-1:04:{body}"), "hash id"),
            (format!("DHHC-1:1:{body}"), "hash id"),
            (format!("DHHC-1:000:{body}"), "hash id"),
            (format!("DHHC-1:0a:{body}"), "hash id"),
            ("DHHC-1:00".to_string(), "hash id"),
            (DOC_KEY.trim_end_matches(':').to_string(), "ends with"),
            (format!("{DOC_KEY}\n"), "ends with"),
            (DOC_KEY.replace('G', "-"), "base64"),
            (DOC_KEY.replace('G', "="), "base64"),
        ] {
            let e = Secret::parse(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn the_secret_is_in_no_debug_output_or_error() {
        let s = Secret::parse(DOC_KEY).unwrap();
        let shown = format!("{s:?} {:?} {s:#?}", Some(&s));
        assert!(!shown.contains("ia6z"), "{shown}");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        let g = Secret::generate().unwrap();
        let body = &g.expose()[10..20];
        assert!(!format!("{g:?}").contains(body));
        // An error about a secret quotes none of it.
        let mut raw = raw_of(DOC_KEY);
        raw[0] ^= 1;
        let bad = encode(0, &raw);
        for text in [bad.as_str(), &DOC_KEY.replace('G', "-")] {
            let e = Secret::parse(text).unwrap_err();
            let said = format!("{e} {e:?}");
            assert!(!said.contains(&text[10..20]), "{said}");
        }
    }
}
