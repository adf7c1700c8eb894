//! What a run reports: log lines, the summary, the metrics files.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};
use lazarus_executor::metrics::{self, RecoveryRecord, StepRecord};
use lazarus_executor::model::MoeConfig;

use crate::args::{Format, JobArgs};

/// Collects what a run reports and prints it.
pub struct Report {
    format: Format,
    steps: u64,
    records: Vec<StepRecord>,
    reconfigs: Vec<RecoveryRecord>,
    consumed: u64,
    start: Instant,
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
        }
    }

    pub fn say(&self, line: &str) {
        self.format.say(line);
    }

    pub fn step(&mut self, r: StepRecord) {
        self.consumed += r.samples;
        self.say(&metrics::log_line(&r, self.steps, self.consumed));
        self.records.push(r);
    }

    pub fn reconfigured(&mut self, r: RecoveryRecord) {
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
            git_commit(),
        );
        if let Some(dir) = &a.metrics_out {
            metrics::write_metrics(dir, &summary, &self.records, &self.reconfigs)
                .with_context(|| format!("writing metrics to {}", dir.display()))?;
        }
        match self.format {
            Format::Json => println!("{}", serde_json::to_string(&summary)?),
            Format::Text => {
                println!(
                    "done: {} steps, loss {:.4} → {:.4}, {} in-place recoveries {:?} ms, {} checkpoint restores, {} joins, {} rebalances, {:.0} tokens/s",
                    summary.steps,
                    summary.initial_loss,
                    summary.final_loss,
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
                );
                if let Some(dir) = &a.metrics_out {
                    println!("metrics in {}", dir.display());
                }
                if let Some(dir) = &a.out {
                    println!("replica checksums in {}", dir.display());
                }
            }
        }
        Ok(())
    }

    /// The loss table of `lzrun local`: the mean loss over the workers at every step.
    pub fn print_mean_loss_per_step(&self) {
        let mut by_step: BTreeMap<u64, f64> = BTreeMap::new();
        for r in &self.records {
            by_step.insert(r.step, r.loss);
        }
        println!("mean loss per step over the workers:");
        for (step, loss) in by_step {
            println!("step {step:>4}  mean loss {loss:.4}");
        }
    }
}

/// The commit of the checkout the binary runs in, or "unknown".
fn git_commit() -> String {
    Command::new("git")
        .args(["rev-parse", "HEAD"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}
