//! What a run reports: log lines, the summary, the metrics files.
//!
//! Lines go to standard output through [`print_line`], not `println!`, which panicked when
//! the reader went away (`lzrun local | head -3`) or the disk was full. The first failed write
//! is remembered ([`stdout_failure`]): later lines are not attempted, the job is stopped at the
//! next notice, and `main` ends quietly (exit 0) on a closed pipe or reports the error (exit 2).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{Context, Result};
use lazarus_executor::metrics::{self, RecoveryRecord, StepRecord};
use lazarus_executor::model::MoeConfig;

use crate::args::{Format, JobArgs};

/// Standard output could not be written. Holds the I/O error's kind and text (not the error,
/// which cannot be cloned) so every later write can return the same failure.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot write to standard output: {message}")]
pub struct StdoutError {
    kind: io::ErrorKind,
    message: String,
}

impl StdoutError {
    /// The reader went away: it has what it wanted, which is no error.
    pub fn is_broken_pipe(&self) -> bool {
        self.kind == io::ErrorKind::BrokenPipe
    }
}

static STDOUT_FAILED: OnceLock<StdoutError> = OnceLock::new();

/// Writes `text` and a newline to standard output, unless an earlier write failed.
pub fn print_line(text: &str) -> Result<(), StdoutError> {
    if let Some(e) = STDOUT_FAILED.get() {
        return Err(e.clone());
    }
    let mut out = io::stdout().lock();
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(|e| {
            STDOUT_FAILED
                .get_or_init(|| StdoutError {
                    kind: e.kind(),
                    message: e.to_string(),
                })
                .clone()
        })
}

/// The first failed write to standard output, if any.
pub fn stdout_failure() -> Option<StdoutError> {
    STDOUT_FAILED.get().cloned()
}

/// Collects what a run reports and prints it.
pub struct Report {
    format: Format,
    steps: u64,
    records: Vec<StepRecord>,
    reconfigs: Vec<RecoveryRecord>,
    consumed: u64,
    start: Instant,
    /// Launch-relative seconds at which the first step record arrived: the origin of the
    /// records' `t_s` (for `run.json`).
    first_step_s: Option<f64>,
    /// Launch-relative seconds at which each reconfiguration record arrived, with its kind.
    reconfig_arrivals: Vec<(f64, String)>,
    /// [`git_commit`] at the launch: the checkout may move on during a long run.
    git_commit: String,
    /// The loss of step 0 as the controller kept it (across a fail-over), for a report that
    /// has no record of step 0.
    initial_loss: Option<f64>,
}

impl Report {
    pub fn new(format: Format, steps: u64) -> Self {
        Self {
            format,
            steps,
            records: Vec::new(),
            reconfigs: Vec::new(),
            consumed: 0,
            start: Instant::now(),
            first_step_s: None,
            reconfig_arrivals: Vec::new(),
            git_commit: git_commit(),
            initial_loss: None,
        }
    }

    /// The loss of step 0 as the controller kept it.
    pub fn set_initial_loss(&mut self, loss: f64) {
        self.initial_loss = Some(loss);
    }

    /// The commit of the checkout at the launch ([`git_commit`]).
    pub fn git_commit(&self) -> &str {
        &self.git_commit
    }

    /// When the run started (the origin of the launch-relative times in `run.json`).
    pub fn started(&self) -> Instant {
        self.start
    }

    /// The launch-relative times the report took (for `run.json`): when the first step record
    /// arrived, and when each reconfiguration record did.
    pub fn arrivals(&self) -> (Option<f64>, &[(f64, String)]) {
        (self.first_step_s, &self.reconfig_arrivals)
    }

    pub fn say(&self, line: &str) {
        self.format.say(line);
    }

    pub fn step(&mut self, r: StepRecord) {
        if self.first_step_s.is_none() {
            self.first_step_s = Some(self.start.elapsed().as_secs_f64());
        }
        self.consumed += r.samples;
        self.say(&metrics::log_line(&r, self.steps, self.consumed));
        self.records.push(r);
    }

    pub fn reconfigured(&mut self, r: RecoveryRecord) {
        let at = self.start.elapsed().as_secs_f64();
        self.reconfig_arrivals.push((at, r.kind.clone()));
        let line = serde_json::json!({ "reconfiguration": &r });
        self.say(&line.to_string());
        self.reconfigs.push(r);
    }

    /// Summary, metrics files, final output.
    pub fn finish(&self, a: &JobArgs, config: &MoeConfig) -> Result<()> {
        let summary = metrics::summarize(
            &self.records,
            &self.reconfigs,
            self.start.elapsed().as_secs_f64(),
            serde_json::to_value(config)?,
            config.seed,
            self.git_commit.clone(),
        );
        let mut summary = summary;
        if summary.initial_loss.is_nan()
            && let Some(loss) = self.initial_loss
        {
            summary.initial_loss = loss;
        }
        if let Some(dir) = &a.metrics_out {
            metrics::write_metrics(dir, &summary, &self.records, &self.reconfigs)
                .with_context(|| format!("writing metrics to {}", dir.display()))?;
        }
        match self.format {
            Format::Json => print_line(&serde_json::to_string(&summary)?)?,
            Format::Text => {
                // Without the loss of step 0 (a state saved before it was kept) say nothing
                // rather than "NaN".
                let loss = if summary.initial_loss.is_nan() {
                    format!("final loss {:.4}", summary.final_loss)
                } else {
                    format!(
                        "loss {:.4} → {:.4}",
                        summary.initial_loss, summary.final_loss
                    )
                };
                print_line(&format!(
                    "done: {} steps, {loss}, {} in-place recoveries {:?} ms, {} checkpoint restores, {} joins, {} rebalances, {:.0} tokens/s",
                    summary.steps,
                    summary.recoveries,
                    summary
                        .recovery_ms
                        .iter()
                        .map(|m| m.round() as u64)
                        .collect::<Vec<_>>(),
                    summary.fallbacks,
                    summary.joins,
                    summary.rebalances,
                    summary.tokens_per_s
                ))?;
                if let Some(dir) = &a.metrics_out {
                    print_line(&format!("metrics in {}", dir.display()))?;
                }
                if let Some(dir) = &a.out {
                    print_line(&format!("replica checksums in {}", dir.display()))?;
                }
            }
        }
        Ok(())
    }

    /// The loss table of `lzrun local`: the mean loss over the workers at every step.
    pub fn print_mean_loss_per_step(&self) -> Result<(), StdoutError> {
        let mut by_step: BTreeMap<u64, f64> = BTreeMap::new();
        for r in &self.records {
            by_step.insert(r.step, r.loss);
        }
        let mut table = String::from("mean loss per step over the workers:");
        for (step, loss) in by_step {
            let _ = write!(table, "\nstep {step:>4}  mean loss {loss:.4}");
        }
        print_line(&table)
    }
}

/// The commit of the checkout this binary was built in (the git repository around the
/// executable, e.g. `target/debug/lzrun`; not the working directory's), or "unknown".
pub fn git_commit() -> String {
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    Command::new("git")
        .arg("-C")
        .arg(exe_dir)
        .args(["rev-parse", "HEAD"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}
