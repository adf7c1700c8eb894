//! Human durations on the command line: `80m`, `45s`, `1.5h`, `250ms`, `2d`.
//!
//! Every duration is bounded by [`MAX_DURATION_MS`]: the replay engine's work grows with the
//! simulated time, so an unbounded `--end 99999999999h` (or a trace event at 10^11 ms) ran for
//! days. Periods (sampling, ticks, failure intervals) must also be positive: a zero period
//! either sampled nothing or would step forever.

use anyhow::{Context, bail};

/// The longest duration any argument takes, and the longest simulated time: one year. Real
/// failure traces span hours to days; a simulated year of the default scenario takes minutes.
pub const MAX_DURATION_MS: u64 = 365 * 86_400_000;
/// [`MAX_DURATION_MS`] as the command line spells it.
pub const MAX_DURATION_TEXT: &str = "365d";

/// Milliseconds in `text` (`ms`, `s`, `m`, `h`, `d` suffix; a bare number is seconds), at
/// most [`MAX_DURATION_MS`]. `arg` names the argument in the error (`--end`).
pub fn parse_ms(arg: &str, text: &str) -> anyhow::Result<u64> {
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
    let v: f64 = num.trim().parse().with_context(|| {
        format!("{arg} {text:?} is not a duration (e.g. 80m, 45s, 1.5h, 250ms)")
    })?;
    if !(v.is_finite() && v >= 0.0) {
        bail!("{arg} {text:?} is not a non-negative duration");
    }
    let ms = (v * unit_ms).round();
    // Compared as f64: the product may be beyond u64, where `as` would saturate silently.
    if ms > MAX_DURATION_MS as f64 {
        bail!(
            "{arg} {text:?} is longer than the limit of {MAX_DURATION_TEXT} (one year of \
             simulated time)"
        );
    }
    Ok(ms as u64)
}

/// Like [`parse_ms`], for a period: at least 1 ms (a zero period samples nothing or steps
/// forever).
pub fn parse_period_ms(arg: &str, text: &str) -> anyhow::Result<u64> {
    let ms = parse_ms(arg, text)?;
    if ms == 0 {
        bail!("{arg} {text:?} must be at least 1ms");
    }
    Ok(ms)
}

/// `A..B` of durations (e.g. `0m..80m`), each at most [`MAX_DURATION_MS`].
pub fn parse_range_ms(arg: &str, text: &str) -> anyhow::Result<(u64, u64)> {
    let (a, b) = text
        .split_once("..")
        .with_context(|| format!("{arg} {text:?} is not a range like 0m..80m"))?;
    let (a, b) = (parse_ms(arg, a)?, parse_ms(arg, b)?);
    if b <= a {
        bail!("{arg} {text:?}: the range is empty");
    }
    Ok((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let p = |t| parse_ms("--x", t);
        assert_eq!(p("80m").unwrap(), 4_800_000);
        assert_eq!(p("45s").unwrap(), 45_000);
        assert_eq!(p("1.5h").unwrap(), 5_400_000);
        assert_eq!(p("250ms").unwrap(), 250);
        assert_eq!(p("30").unwrap(), 30_000);
        assert_eq!(p("0s").unwrap(), 0);
        assert!(p("-1m").is_err());
        assert!(p("abc").is_err());
        assert_eq!(parse_range_ms("--w", "0m..80m").unwrap(), (0, 4_800_000));
        assert!(parse_range_ms("--w", "5m..1m").is_err());
    }

    #[test]
    fn durations_are_bounded_and_periods_positive() {
        assert_eq!(parse_ms("--end", "365d").unwrap(), MAX_DURATION_MS);
        let e = parse_ms("--end", "99999999999h").unwrap_err().to_string();
        assert!(
            e.starts_with("--end \"99999999999h\" is longer than the limit of 365d"),
            "{e}"
        );
        assert!(parse_ms("--end", "1e300d").is_err());
        assert!(parse_range_ms("--window", "0m..366d").is_err());
        let e = parse_period_ms("--sample-every", "0s")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "--sample-every \"0s\" must be at least 1ms");
        // Rounds to zero milliseconds: as useless as zero.
        assert!(parse_period_ms("--tick", "0.1ms").is_err());
        assert_eq!(parse_period_ms("--tick", "1ms").unwrap(), 1);
    }
}
