//! Where tests and benches find the third-party traces (Bamboo spot traces, the SmartMoE gate
//! trace) that are never copied into this repository.
//!
//! The directory is `$LAZARUS_TRACES` when that variable is set, else `shared/traces/` beside
//! the workspace (`<workspace>/../shared/traces`). A clone without that directory still
//! passes its tests: the ones that need a trace print one `skipped: …` line and return.
//!
//! ```
//! // In a test: skip (one line on stderr) when the trace is not there.
//! let Some(p3) = lazarus_traces::shared::or_skip("bamboo/traces/p3-trace.csv") else {
//!     return;
//! };
//! assert!(p3.is_file());
//! ```
use std::path::PathBuf;

/// The environment variable naming the directory that stands for `../shared/traces`.
pub const ENV_VAR: &str = "LAZARUS_TRACES";

/// The shared-traces directory: `$LAZARUS_TRACES`, else `<workspace>/../shared/traces`.
pub fn dir() -> PathBuf {
    match std::env::var_os(ENV_VAR) {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        // Every crate of the workspace sits one level below its root, like this one.
        _ => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces")),
    }
}

/// The file `rel` (relative to [`dir`], e.g. `bamboo/traces/p3-trace.csv`) if it exists.
pub fn path(rel: &str) -> Option<PathBuf> {
    let p = dir().join(rel);
    p.exists().then_some(p)
}

/// [`path`], printing one `skipped: <file> not found (set LAZARUS_TRACES)` line on stderr
/// when the file is absent: for tests and benches that need a third-party trace. The line is
/// written to the process's stderr directly, so the test harness's output capture does not
/// hide it.
pub fn or_skip(rel: &str) -> Option<PathBuf> {
    use std::io::Write;
    let p = path(rel);
    if p.is_none() {
        let line = format!(
            "skipped: {} not found (set {ENV_VAR})\n",
            dir().join(rel).display()
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
    p
}
