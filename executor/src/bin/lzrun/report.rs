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
use lazarus_executor::device::{self, DeviceChoice, DeviceKind};
use lazarus_executor::metrics::{self, RecoveryRecord, StepRecord};
use lazarus_executor::model::{MoeConfig, Precision, model_flops_per_token};

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

impl Format {
    /// A log line: stdout for text, stderr for json (stdout then carries only the summary).
    /// Never panics: a failed stdout write is remembered ([`stdout_failure`]) and stops the
    /// job; a failed stderr write leaves no one to tell.
    pub fn say(self, line: &str) {
        match self {
            Format::Text => {
                let _ = print_line(line);
            }
            Format::Json => {
                let _ = writeln!(io::stderr(), "{line}");
            }
        }
    }
}

/// What a step's MFU is computed from (`--peak-tflops`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MfuBasis {
    /// Model FLOPs per trained token ([`lazarus_executor::model::model_flops_per_token`]).
    pub flops_per_token: f64,
    /// Peak TFLOP/s of one device; `None`: unknown, no MFU.
    pub peak_tflops: Option<f64>,
    /// Devices the members share (`lzrun local`: this machine's); `None`: one per member.
    pub devices: Option<usize>,
}

impl MfuBasis {
    /// The MFU of `r` (NaN when the peak is unknown).
    pub fn mfu(&self, r: &StepRecord) -> f64 {
        let Some(peak) = self.peak_tflops else {
            return f64::NAN;
        };
        let devices = self.devices.unwrap_or(r.used_nodes);
        metrics::mfu(
            r.tokens_per_s,
            self.flops_per_token,
            peak * 1e12 * devices as f64,
        )
    }
}

/// The MFU basis of a job training `config`, and the line that says what it rests on (none
/// when the peak is unknown). The peak is `peak_tflops` (`--peak-tflops`), else, for `lzrun
/// local` (`local`: its device choice) on CUDA with bf16 products, the datasheet peak of the
/// GPU ([`device::peak_bf16_tflops`]). `lzrun local` runs every node on this machine's
/// devices: its `--gpus-per-node` GPUs (each node's workers take ordinals 0..G), or the one
/// CPU; a controller's members each have their own.
pub fn mfu_basis(
    peak_tflops: Option<f64>,
    config: &MoeConfig,
    local: Option<&DeviceChoice>,
) -> (MfuBasis, Option<String>) {
    let devices = local.map(|c| match c.device {
        DeviceKind::Cuda => c.gpus_per_node,
        DeviceKind::Cpu => 1,
    });
    let (peak, source) = match peak_tflops {
        Some(p) => (Some(p), "--peak-tflops".to_owned()),
        None => match local.and_then(|c| datasheet_peak(c, config.precision)) {
            Some((p, name)) => (Some(p), format!("{name}, datasheet dense BF16 peak")),
            None => (None, String::new()),
        },
    };
    let basis = MfuBasis {
        flops_per_token: model_flops_per_token(config),
        peak_tflops: peak,
        devices,
    };
    let line = peak.map(|p| {
        let over = match devices {
            Some(1) => "1 device".to_owned(),
            Some(n) => format!("{n} devices"),
            None => "one device per member".to_owned(),
        };
        format!(
            "MFU: {:.4e} model FLOPs per token over {p} TFLOP/s ({source}) × {over}",
            basis.flops_per_token
        )
    });
    (basis, line)
}

/// The dense BF16 peak of the GPU `choice` computes on, and its name, when the products run
/// in bf16 there (an f32 run's peak is another figure, not in the table).
fn datasheet_peak(choice: &DeviceChoice, precision: Precision) -> Option<(f64, String)> {
    if choice.device != DeviceKind::Cuda || precision == Precision::F32 {
        return None;
    }
    let name = device::cuda_device_name(choice.ordinal).ok()?;
    device::peak_bf16_tflops(&name).map(|p| (p, name))
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
    /// What the steps' MFU is computed from (none: no MFU, no FLOPs count in the summary).
    mfu_basis: Option<MfuBasis>,
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
            mfu_basis: None,
        }
    }

    /// Computes every later step's MFU from `basis`.
    pub fn set_mfu_basis(&mut self, basis: MfuBasis) {
        self.mfu_basis = Some(basis);
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

    pub fn step(&mut self, mut r: StepRecord) {
        if let Some(b) = &self.mfu_basis {
            r.mfu = b.mfu(&r);
        }
        if self.first_step_s.is_none() {
            self.first_step_s = Some(self.start.elapsed().as_secs_f64());
        }
        // A global batch: the cursor says how many were consumed, across resumes too.
        self.consumed = r.data_cursor.unwrap_or(self.consumed) + r.samples;
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
        if let Some(b) = &self.mfu_basis {
            summary.model_flops_per_token = Some(b.flops_per_token);
            summary.peak_tflops = b.peak_tflops;
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
                // MFU only when the peak was known: no "NaN%".
                let mfu = if summary.mfu.is_finite() {
                    format!(", MFU {:.1}%", 100.0 * summary.mfu)
                } else {
                    String::new()
                };
                print_line(&format!(
                    "done: {} steps, {loss}, {} in-place recoveries {:?} ms, {} checkpoint restores, {} joins, {} rebalances, {:.0} tokens/s{mfu}",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tokens: u64, step_ms: f64, used_nodes: usize) -> StepRecord {
        StepRecord {
            step: 0,
            t_s: 0.0,
            loss: 1.0,
            tokens,
            samples: 0,
            live_nodes: used_nodes,
            used_nodes,
            plan_version: 1,
            step_ms,
            expert_ms_max: 0.0,
            expert_ms_mean: 0.0,
            expert_tokens_max: 0,
            expert_tokens_mean: 0.0,
            sent_bytes: 0,
            copy_bytes: 0,
            routing: Vec::new(),
            trained: Vec::new(),
            tokens_per_s: metrics::step_tokens_per_s(tokens, step_ms),
            data_wait_ms: 0.0,
            mfu: f64::NAN,
            data_cursor: None,
            eval_loss: None,
            eval_ppl: None,
        }
    }

    /// MFU is the model FLOP/s over the peak of the devices the step ran on: `lzrun local`'s
    /// nodes share this machine's (one CPU here), a controller's members have one each. A CPU
    /// has no default peak: no MFU, and nothing said about it.
    #[test]
    fn mfu_over_the_devices_the_members_ran_on() {
        let cfg = MoeConfig::tiny();
        let cpu = DeviceChoice::default();
        let (none, line) = mfu_basis(None, &cfg, Some(&cpu));
        assert_eq!((none.peak_tflops, line), (None, None));
        assert!(none.mfu(&record(1000, 500.0, 4)).is_nan());

        // 2000 tokens/s × 740352 FLOPs per token = 1.480704 GFLOP/s
        let (local, line) = mfu_basis(Some(0.001), &cfg, Some(&cpu));
        assert_eq!(local.devices, Some(1));
        assert!(
            line.unwrap()
                .contains("over 0.001 TFLOP/s (--peak-tflops) × 1 device")
        );
        let mfu = local.mfu(&record(1000, 500.0, 4));
        assert!((mfu - 1.480704).abs() < 1e-12, "{mfu}");

        let (controller, line) = mfu_basis(Some(0.001), &cfg, None);
        assert!(line.unwrap().contains("× one device per member"));
        let mfu = controller.mfu(&record(1000, 500.0, 4));
        assert!((mfu - 1.480704 / 4.0).abs() < 1e-12, "{mfu}");
    }
}
