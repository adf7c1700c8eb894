//! Feeds arbitrary bytes (as lossy UTF-8) to all five trace parsers. Parsing must never
//! panic; whatever parses must survive a CSV round trip and the slicing/fitting operations.
//!
//! Run from `traces/`: `cargo +nightly fuzz run parse`.
#![no_main]

use lazarus_traces::{FitMode, TraceFormat, detect_format, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = parse(&text, detect_format(&text));
    for format in TraceFormat::ALL {
        let Ok(trace) = parse(&text, format) else {
            continue;
        };
        let again = parse(&trace.to_bamboo_csv(), TraceFormat::BambooCsv)
            .expect("a trace's own CSV must parse");
        assert_eq!(again, trace);
        let end = trace.duration_ms().saturating_add(1);
        let window = trace.window(end / 3, end);
        for mode in FitMode::ALL {
            for max in [1, 3] {
                let fitted = window.fit(max, mode);
                assert!(fitted.max_live() <= max);
            }
        }
    }
});
