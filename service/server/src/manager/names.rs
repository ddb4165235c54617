//! The names users choose for images and volumes.

use super::error::{Error, Result};

/// Checks a user-chosen name against `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn validate_name(what: &'static str, name: &str) -> Result<()> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName {
            what,
            name: name.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "0", "vol-1", "a.b_c-d", &"a".repeat(63)] {
            validate_name("volume", ok).unwrap();
        }
        for bad in [
            "",
            "-a",
            ".a",
            "A",
            "a/b",
            "a b",
            "é",
            &"a".repeat(64),
            "_x",
        ] {
            assert!(validate_name("volume", bad).is_err(), "{bad}");
        }
    }
}
