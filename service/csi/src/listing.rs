//! Paging of CSI list calls (ListVolumes, ListSnapshots).

use super::errors::CsiError;
use super::naming;

/// One page of `items` sorted by name: at most `max_entries` (0: all) after
/// the name `token`. The token is the last name of the previous page, so
/// that an item deleted between pages does not shift the next page.
pub fn page<T>(
    call: &'static str,
    mut items: Vec<T>,
    name: impl Fn(&T) -> &str,
    max_entries: i32,
    token: &str,
) -> Result<(Vec<T>, String), CsiError> {
    if max_entries < 0 {
        return Err(CsiError::Invalid {
            volume: "*".into(),
            reason: format!("{call}: max_entries {max_entries} is negative"),
        });
    }
    if !token.is_empty() && !naming::is_driver_name(token) {
        return Err(CsiError::BadToken {
            call,
            token: token.to_string(),
        });
    }
    items.retain(|i| name(i) > token);
    items.sort_by(|a, b| name(a).cmp(name(b)));
    let max = if max_entries == 0 {
        usize::MAX
    } else {
        max_entries as usize
    };
    let next = if items.len() > max {
        items.truncate(max);
        items
            .last()
            .map(|i| name(i).to_string())
            .unwrap_or_default()
    } else {
        String::new()
    };
    Ok((items, next))
}
