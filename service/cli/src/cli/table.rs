//! Text layouts for people: tables and lists of fields.

/// Left-aligned columns, two spaces apart.
pub fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        out.truncate(out.trim_end().len());
        out + "\n"
    };
    let mut out = line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out += &line(r);
    }
    out
}

/// One `name  value` line per field, the values aligned.
pub fn fields(pairs: Vec<(&str, String)>) -> String {
    let w = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    pairs
        .into_iter()
        .map(|(k, v)| format!("{k:<w$}  {v}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let t = table(&["A", "BB"], vec![vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "A    BB\nxxx  y\n");
    }
}
