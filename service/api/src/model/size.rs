//! Sizes as people write and read them.

/// What [`parse_size`] accepts, for its refusals and the help texts.
pub const SIZE_FORMS: &str = "a whole number of bytes, or a number (fractions allowed, e.g. 1.5G) \
with a unit: K, M, G, T or Ki, Mi, Gi, Ti or KiB, MiB, GiB, TiB (binary: 1024) or KB, MB, GB, TB \
(decimal: 1000)";

/// Parses a size as people write it: `4096`, `64K`, `1.5G`, `1Gi`, `1GiB`
/// (binary multiples), `1GB` (decimal, 10^9). Refuses what is not a whole
/// number of bytes, saying what is accepted.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let refuse = |why: &str| format!("'{s}' is not a size ({why}); give {SIZE_FORMS}");
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return Err(refuse("no number"));
    }
    let mult: u128 = match unit.trim() {
        "" | "B" => 1,
        "K" | "k" | "Ki" | "KiB" => 1 << 10,
        "M" | "Mi" | "MiB" => 1 << 20,
        "G" | "Gi" | "GiB" => 1 << 30,
        "T" | "Ti" | "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        u => return Err(refuse(&format!("unknown unit '{u}'"))),
    };
    // Exact: digits as an integer over 10^(fraction digits).
    let scale = 10u128.pow(frac.len() as u32);
    let digits: u128 = format!("{whole}{frac}")
        .parse()
        .map_err(|_| refuse("too many digits"))?;
    let bytes = digits
        .checked_mul(mult)
        .ok_or_else(|| refuse("too large"))?;
    if bytes % scale != 0 {
        return Err(refuse("not a whole number of bytes"));
    }
    u64::try_from(bytes / scale).map_err(|_| refuse("too large"))
}

/// A byte count for people, in binary units with one decimal: `1.5 GiB`
/// (`512 B` under 1 KiB). The one formatter of sizes for the CLI and event
/// messages alike.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

/// [`human_size`] with the exact count beside it, for messages that may be
/// read by scripts too: `1.5 GiB (1610612736 bytes)`.
pub fn size_text(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{} ({bytes} bytes)", human_size(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("1Gi"), Ok(1 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("2.5 MB"), Ok(2_500_000));
        assert_eq!(parse_size("0.5K"), Ok(512));
        assert_eq!(size_text(3 << 29), "1.5 GiB (1610612736 bytes)");
        assert_eq!(size_text(512), "512 bytes");
        assert_eq!(human_size(0), "0 B");
        for bad in ["4X", "G", "99999999999T", "-1", "0.1K", "1.2.3G", "", "."] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains("binary: 1024") && e.contains(bad), "{bad}: {e}");
        }
    }
}
