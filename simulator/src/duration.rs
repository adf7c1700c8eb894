//! Human durations on the command line: `80m`, `45s`, `1.5h`, `250ms`, `2d` (parsed by
//! [`lazarus_traces::duration`], which `lzrun local --window` shares; here with `anyhow` errors).
//!
//! Every duration is bounded by [`MAX_DURATION_MS`]: the replay engine's work grows with the
//! simulated time, so an unbounded `--end 99999999999h` (or a trace event at 10^11 ms) ran for
//! days. Periods (sampling, ticks, failure intervals) must also be positive: a zero period
//! either sampled nothing or would step forever.

use lazarus_traces::duration as parse;

pub use lazarus_traces::duration::{MAX_DURATION_MS, MAX_DURATION_TEXT};

/// Milliseconds in `text` (`ms`, `s`, `m`, `h`, `d` suffix; a bare number is seconds), at
/// most [`MAX_DURATION_MS`]. `arg` names the argument in the error (`--end`).
pub fn parse_ms(arg: &str, text: &str) -> anyhow::Result<u64> {
    Ok(parse::parse_ms(arg, text)?)
}

/// Like [`parse_ms`], for a period: at least 1 ms (a zero period samples nothing or steps
/// forever).
pub fn parse_period_ms(arg: &str, text: &str) -> anyhow::Result<u64> {
    Ok(parse::parse_period_ms(arg, text)?)
}

/// `A..B` of durations (e.g. `0m..80m`), each at most [`MAX_DURATION_MS`].
pub fn parse_range_ms(arg: &str, text: &str) -> anyhow::Result<(u64, u64)> {
    Ok(parse::parse_range_ms(arg, text)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The parser's own cases are tested in `lazarus_traces::duration`; these wrappers only
    // convert its errors and must keep their messages.
    #[test]
    fn wrappers_parse_and_keep_the_parsers_messages() {
        assert_eq!(parse_ms("--x", "80m").unwrap(), 4_800_000);
        assert_eq!(parse_range_ms("--w", "0m..80m").unwrap(), (0, 4_800_000));
        assert_eq!(parse_period_ms("--tick", "1ms").unwrap(), 1);
        let e = parse_period_ms("--sample-every", "0s").unwrap_err();
        assert_eq!(e.to_string(), "--sample-every \"0s\" must be at least 1ms");
        let e = parse_ms("--end", "99999999999h").unwrap_err().to_string();
        assert!(
            e.starts_with("--end \"99999999999h\" is longer than the limit of 365d"),
            "{e}"
        );
    }
}
