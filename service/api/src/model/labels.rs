//! Labels: `key: value` pairs an operator puts on an image (at its create,
//! or with `PATCH /v1/images/{id}`) so that one rule (a backup schedule's
//! selector, a list's filter) names many images at once. The rules of a
//! label live here alone; the schema states them with the patterns below.

use std::collections::BTreeMap;

/// An image's labels, by key.
pub type Labels = BTreeMap<String, String>;

/// A label's key: 1–63 characters of `[a-z0-9._/-]`, starting and ending
/// with a letter or digit (`tier`, `team.example/app`).
pub const LABEL_KEY_PATTERN: &str = "^[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?$";

/// A label's value: empty, or 1–63 characters of `[A-Za-z0-9._-]` starting
/// and ending with a letter or digit.
pub const LABEL_VALUE_PATTERN: &str = "^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$";

/// The most labels one image has.
pub const MAX_LABELS: usize = 32;

/// Why `key` is not a label's key, or `None` when it is one.
pub fn label_key_problem(key: &str) -> Option<&'static str> {
    shape_problem(key, |c| {
        c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'/' | b'-')
    })
    .or_else(|| key.is_empty().then_some("is empty"))
}

/// Why `value` is not a label's value, or `None` when it is one.
pub fn label_value_problem(value: &str) -> Option<&'static str> {
    shape_problem(value, |c| {
        c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-')
    })
}

/// The shape keys and values share: at most 63 bytes of `allowed`, the
/// first and last alphanumeric.
fn shape_problem(s: &str, allowed: impl Fn(u8) -> bool) -> Option<&'static str> {
    let b = s.as_bytes();
    if b.len() > 63 {
        return Some("is longer than 63 characters");
    }
    if !b.iter().all(|c| allowed(*c)) {
        return Some("has a character outside its set");
    }
    match (b.first(), b.last()) {
        (Some(f), Some(l)) if !f.is_ascii_alphanumeric() || !l.is_ascii_alphanumeric() => {
            Some("does not start and end with a letter or digit")
        }
        _ => None,
    }
}

/// Whether `labels` has the label a list's filter names: `key=value`, or
/// `key` with any value.
pub fn has_label(labels: &Labels, filter: &str) -> bool {
    match filter.split_once('=') {
        Some((k, v)) => labels.get(k).is_some_and(|have| have == v),
        None => labels.contains_key(filter),
    }
}

/// Labels as people and selectors spell them: `k=v,k2=v2` (empty when
/// there are none), the form `--label` and `--selector` take.
pub fn labels_text(labels: &Labels) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether `labels` has every pair of `selector`.
pub fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_follow_their_patterns() {
        for ok in ["tier", "a", "team.example/app", "x-1_2"] {
            assert_eq!(label_key_problem(ok), None, "{ok}");
        }
        for bad in ["", "-a", "a-", "Tier", "a b", &"k".repeat(64)] {
            assert!(label_key_problem(bad).is_some(), "{bad}");
        }
        for ok in ["", "gold", "Gold-2", "v1.2_3"] {
            assert_eq!(label_value_problem(ok), None, "{ok}");
        }
        for bad in ["-gold", "gold.", "a/b", "a b", &"v".repeat(64)] {
            assert!(label_value_problem(bad).is_some(), "{bad}");
        }
        assert_eq!(label_key_problem(&"k".repeat(63)), None);
    }

    #[test]
    fn a_selector_needs_every_pair() {
        let labels = Labels::from([("tier".into(), "gold".into()), ("app".into(), "db".into())]);
        let sel = |pairs: &[(&str, &str)]| -> Labels {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(selects(&sel(&[("tier", "gold")]), &labels));
        assert!(selects(&sel(&[("tier", "gold"), ("app", "db")]), &labels));
        assert!(!selects(&sel(&[("tier", "gold"), ("app", "web")]), &labels));
        assert!(!selects(&sel(&[("zone", "a")]), &labels));
        assert!(has_label(&labels, "tier=gold") && has_label(&labels, "tier"));
        assert!(!has_label(&labels, "tier=") && !has_label(&labels, "zone"));
    }
}
