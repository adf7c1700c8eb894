//! Human durations on the command line: `80m`, `45s`, `1.5h`, `250ms`, `2d`.

use anyhow::{Context, bail};

/// Milliseconds in `text` (`ms`, `s`, `m`, `h`, `d` suffix; a bare number is seconds).
pub fn parse_ms(text: &str) -> anyhow::Result<u64> {
    let t = text.trim();
    let (num, unit_ms) = if let Some(x) = t.strip_suffix("ms") {
        (x, 1.0)
    } else if let Some(x) = t.strip_suffix('s') {
        (x, 1e3)
    } else if let Some(x) = t.strip_suffix('m') {
        (x, 60e3)
    } else if let Some(x) = t.strip_suffix('h') {
        (x, 3600e3)
    } else if let Some(x) = t.strip_suffix('d') {
        (x, 86400e3)
    } else {
        (t, 1e3)
    };
    let v: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("{text:?} is not a duration (e.g. 80m, 45s, 1.5h, 250ms)"))?;
    if !(v.is_finite() && v >= 0.0) {
        bail!("{text:?} is not a non-negative duration");
    }
    Ok((v * unit_ms).round() as u64)
}

/// `A..B` of durations (e.g. `0m..80m`).
pub fn parse_range_ms(text: &str) -> anyhow::Result<(u64, u64)> {
    let (a, b) = text
        .split_once("..")
        .with_context(|| format!("{text:?} is not a range like 0m..80m"))?;
    let (a, b) = (parse_ms(a)?, parse_ms(b)?);
    if b <= a {
        bail!("the range {text:?} is empty");
    }
    Ok((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_ms("80m").unwrap(), 4_800_000);
        assert_eq!(parse_ms("45s").unwrap(), 45_000);
        assert_eq!(parse_ms("1.5h").unwrap(), 5_400_000);
        assert_eq!(parse_ms("250ms").unwrap(), 250);
        assert_eq!(parse_ms("30").unwrap(), 30_000);
        assert!(parse_ms("-1m").is_err());
        assert!(parse_ms("abc").is_err());
        assert_eq!(parse_range_ms("0m..80m").unwrap(), (0, 4_800_000));
        assert!(parse_range_ms("5m..1m").is_err());
    }
}
