//! Human durations on the command line: `80m`, `45s`, `1.5h`, `250ms`, `2d`, and ranges of them
//! (`0m..80m`) — the syntax of `lzsim replay --window/--end` and of `lzrun local --window`,
//! parsed once here for both.
//!
//! Every duration is bounded by [`MAX_DURATION_MS`]: the replay engine's work grows with the
//! simulated time, so an unbounded `--end 99999999999h` (or a trace event at 10^11 ms) ran for
//! days. Periods (sampling, ticks, failure intervals) must also be positive: a zero period
//! either sampled nothing or would step forever.
//!
//! ```
//! use lazarus_traces::duration::{parse_ms, parse_range_ms};
//! assert_eq!(parse_ms("--end", "1.5h").unwrap(), 5_400_000);
//! assert_eq!(parse_range_ms("--window", "8m..1h").unwrap(), (480_000, 3_600_000));
//! let e = parse_range_ms("--window", "5m..1m").unwrap_err();
//! assert_eq!(e.to_string(), "--window \"5m..1m\": the range is empty");
//! ```

/// The longest duration any argument takes, and the longest simulated time: one year. Real
/// failure traces span hours to days; a simulated year of the default scenario takes minutes.
pub const MAX_DURATION_MS: u64 = 365 * 86_400_000;
/// [`MAX_DURATION_MS`] as the command line spells it.
pub const MAX_DURATION_TEXT: &str = "365d";

/// Why a duration argument was refused. Each variant names the argument (`arg`, e.g.
/// `--window`) and the text as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a number with an optional unit.
    #[error("{arg} {text:?} is not a duration (e.g. 80m, 45s, 1.5h, 250ms)")]
    NotADuration {
        /// The argument.
        arg: String,
        /// The text as given.
        text: String,
    },
    /// Negative, NaN or infinite.
    #[error("{arg} {text:?} is not a non-negative duration")]
    Negative {
        /// The argument.
        arg: String,
        /// The text as given.
        text: String,
    },
    /// Longer than [`MAX_DURATION_MS`].
    #[error(
        "{arg} {text:?} is longer than the limit of {MAX_DURATION_TEXT} (one year of simulated \
         time)"
    )]
    TooLong {
        /// The argument.
        arg: String,
        /// The text as given.
        text: String,
    },
    /// A period that rounds to 0 ms.
    #[error("{arg} {text:?} must be at least 1ms")]
    ZeroPeriod {
        /// The argument.
        arg: String,
        /// The text as given.
        text: String,
    },
    /// No `..` between two durations.
    #[error("{arg} {text:?} is not a range like 0m..80m")]
    NotARange {
        /// The argument.
        arg: String,
        /// The text as given.
        text: String,
    },
    /// `B <= A`.
    #[error("{arg} {text:?}: the range is empty")]
    EmptyRange {
        /// The argument.
        arg: String,
        /// The text as given.
        text: String,
    },
}

/// Milliseconds in `text` (`ms`, `s`, `m`, `h`, `d` suffix; a bare number is seconds), at
/// most [`MAX_DURATION_MS`]. `arg` names the argument in the error (`--end`).
pub fn parse_ms(arg: &str, text: &str) -> Result<u64, DurationError> {
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
    let (arg, text) = (arg.to_owned(), text.to_owned());
    let Ok(v) = num.trim().parse::<f64>() else {
        return Err(DurationError::NotADuration { arg, text });
    };
    if !(v.is_finite() && v >= 0.0) {
        return Err(DurationError::Negative { arg, text });
    }
    let ms = (v * unit_ms).round();
    // Compared as f64: the product may be beyond u64, where `as` would saturate silently.
    if ms > MAX_DURATION_MS as f64 {
        return Err(DurationError::TooLong { arg, text });
    }
    Ok(ms as u64)
}

/// Like [`parse_ms`], for a period: at least 1 ms (a zero period samples nothing or steps
/// forever).
pub fn parse_period_ms(arg: &str, text: &str) -> Result<u64, DurationError> {
    match parse_ms(arg, text)? {
        0 => Err(DurationError::ZeroPeriod {
            arg: arg.to_owned(),
            text: text.to_owned(),
        }),
        ms => Ok(ms),
    }
}

/// `A..B` of durations (e.g. `0m..80m`), each at most [`MAX_DURATION_MS`], `A < B`: the
/// half-open window `[A, B)` of [`Trace::window`](crate::Trace::window).
pub fn parse_range_ms(arg: &str, text: &str) -> Result<(u64, u64), DurationError> {
    let Some((a, b)) = text.split_once("..") else {
        return Err(DurationError::NotARange {
            arg: arg.to_owned(),
            text: text.to_owned(),
        });
    };
    let (a, b) = (parse_ms(arg, a)?, parse_ms(arg, b)?);
    if b <= a {
        return Err(DurationError::EmptyRange {
            arg: arg.to_owned(),
            text: text.to_owned(),
        });
    }
    Ok((a, b))
}

/// `ms` the way [`parse_ms`] reads it back: whole seconds as `480s`, anything else as `250ms`.
pub fn format_ms(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
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
        assert_eq!(
            parse_range_ms("--w", "80m").unwrap_err().to_string(),
            "--w \"80m\" is not a range like 0m..80m"
        );
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
        let e = parse_period_ms("--sample-every", "0s").unwrap_err();
        assert_eq!(e.to_string(), "--sample-every \"0s\" must be at least 1ms");
        // Rounds to zero milliseconds: as useless as zero.
        assert!(parse_period_ms("--tick", "0.1ms").is_err());
        assert_eq!(parse_period_ms("--tick", "1ms").unwrap(), 1);
    }

    #[test]
    fn formatted_durations_read_back() {
        for ms in [0, 250, 1000, 480_000, 7_200_001] {
            assert_eq!(parse_ms("--x", &format_ms(ms)).unwrap(), ms);
        }
        assert_eq!(format_ms(480_000), "480s");
    }
}
