//! Run directories: `config.json` (resolved configuration, seed, git commit), and per system
//! `summary.json`, `timeseries.csv`, `events.jsonl`; plus comparison plots. Files are written
//! to a temporary name and renamed, so an interrupted run never leaves a half-written file, and
//! an existing non-empty directory is refused unless `overwrite` is set.

use super::RunResult;
use anyhow::{Context, Result, bail};
use std::fs;
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically (temporary file + rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    {
        let mut f =
            fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        f.sync_all().ok();
    }
    fs::rename(&tmp, path).with_context(|| format!("cannot rename to {}", path.display()))
}

/// Creates `dir`, refusing to reuse a non-empty one unless `overwrite`.
pub fn prepare_dir(dir: &Path, overwrite: bool) -> Result<()> {
    if dir.exists() {
        let non_empty = fs::read_dir(dir)
            .with_context(|| format!("cannot read {}", dir.display()))?
            .next()
            .is_some();
        if non_empty && !overwrite {
            bail!(
                "output directory {} exists and is not empty (pass --overwrite to replace its files)",
                dir.display()
            );
        }
    }
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

/// The commit of the checkout this binary was built in (the git repository around the
/// executable, e.g. `target/release/lzsim`; not the working directory's), or "unknown".
pub fn git_commit() -> String {
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| std::path::PathBuf::from("."));
    std::process::Command::new("git")
        .arg("-C")
        .arg(exe_dir)
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

/// Writes one system's files under `dir/<system>/`.
pub fn write_system(dir: &Path, result: &RunResult) -> Result<()> {
    let sub = dir.join(result.summary.system.name());
    fs::create_dir_all(&sub).with_context(|| format!("cannot create {}", sub.display()))?;
    let mut summary = serde_json::to_vec_pretty(&result.summary)?;
    summary.push(b'\n');
    write_atomic(&sub.join("summary.json"), &summary)?;
    let mut csv = csv::Writer::from_writer(Vec::new());
    for row in &result.timeseries {
        csv.serialize(row)?;
    }
    write_atomic(&sub.join("timeseries.csv"), &csv.into_inner()?)?;
    let mut events = Vec::new();
    for e in &result.events {
        serde_json::to_writer(&mut events, e)?;
        events.push(b'\n');
    }
    write_atomic(&sub.join("events.jsonl"), &events)?;
    Ok(())
}
