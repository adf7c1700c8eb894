//! What `lzrun local --metrics-out DIR` writes, and the per-step log line.
//!
//! The launcher collects one [`StepRecord`] per completed step and one [`RecoveryRecord`] per
//! reconfiguration (in-place recovery, checkpoint restore, join, rebalance), both in the order
//! they happened, then [`summarize`]s them and [`write_metrics`]:
//!
//! | file | content |
//! |---|---|
//! | `summary.json` | [`Summary`], pretty-printed, trailing newline |
//! | `timeseries.csv` | [`timeseries`] rows, **exactly the columns of the simulator's `timeseries.csv`** (`lzsim replay`): [`TIMESERIES_COLUMNS`], so notebooks can overlay simulated and measured runs |
//! | `steps.csv` | the [`StepRecord`]s ([`STEP_COLUMNS`]) |
//! | `reconfigurations.jsonl` | one [`RecoveryRecord`] per line |
//! | `routing.csv` | each step record's routed tokens per MoE layer and expert ([`routing_csv`]) |
//!
//! Every file is written to `NAME.tmp` in the same directory and renamed into place, so a
//! reader never sees a half-written file. The CSV files always have their header line, even
//! without rows. Losses that are not finite (a diverged run) are written as `NaN` in CSV and
//! `null` in JSON, and read back as NaN.
//!
//! [`log_line`] formats a Megatron-style progress line for the launcher's stdout.
//!
//! Throughput that compares across runs and with the literature (issue 31 item 5): every step
//! record has its tokens per second of step time, its data wait (the slowest member's time
//! getting its batch) and its model-FLOPs utilisation ([`mfu`]: Megatron/PaLM model FLOPs,
//! [`crate::model::model_flops_per_token`], over the devices' peak; unknown without a peak);
//! the summary has their step-time-weighted means.
use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

/// [`RecoveryRecord::kind`] of an in-place recovery (survivors keep training on a new plan).
pub const KIND_IN_PLACE: &str = "in-place";
/// [`RecoveryRecord::kind`] of a fallback to the last checkpoint.
pub const KIND_CHECKPOINT: &str = "checkpoint";
/// [`RecoveryRecord::kind`] of a node joining.
pub const KIND_JOIN: &str = "join";
/// [`RecoveryRecord::kind`] of a rebalance (new placement without a membership change).
pub const KIND_REBALANCE: &str = "rebalance";

/// The columns of `timeseries.csv`, in order (those of the simulator's `Sample`).
pub const TIMESERIES_COLUMNS: [&str; 7] = [
    "t_s",
    "live_nodes",
    "used_nodes",
    "state",
    "steps",
    "samples",
    "throughput_samples_per_s",
];

/// The columns of `steps.csv`, in order (the fields of [`StepRecord`]).
pub const STEP_COLUMNS: [&str; 21] = [
    "step",
    "t_s",
    "loss",
    "tokens",
    "samples",
    "live_nodes",
    "used_nodes",
    "plan_version",
    "step_ms",
    "expert_ms_max",
    "expert_ms_mean",
    "expert_tokens_max",
    "expert_tokens_mean",
    "sent_bytes",
    "copy_bytes",
    "tokens_per_s",
    "data_wait_ms",
    "mfu",
    "data_cursor",
    "eval_loss",
    "eval_ppl",
];

/// `timeseries.csv` state of a training row.
pub const STATE_TRAINING: &str = "training";

/// The `timeseries.csv` state of a reconfiguration kind: `in-place` → `recovering`,
/// `checkpoint` → `restoring`, `join` → `joining`, `rebalance` → `rebalancing`; any other kind
/// → `reconfiguring`.
pub fn state_of_kind(kind: &str) -> &'static str {
    match kind {
        KIND_IN_PLACE => "recovering",
        KIND_CHECKPOINT => "restoring",
        KIND_JOIN => "joining",
        KIND_REBALANCE => "rebalancing",
        _ => "reconfiguring",
    }
}

/// JSON writes non-finite floats as `null`; read `null` (or an empty CSV field) back as NaN.
fn nan_if_missing<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// A measure a file written before it existed does not have: NaN, "not measured", rather than
/// a 0 that would read as a measurement.
fn not_measured() -> f64 {
    f64::NAN
}

/// Tokens per second of one step: its tokens (all members) over its `step_ms` (the slowest
/// member's, as the collectives make every member wait for it); 0 when `step_ms` is not
/// positive.
pub fn step_tokens_per_s(tokens: u64, step_ms: f64) -> f64 {
    if step_ms > 0.0 {
        tokens as f64 / (step_ms / 1000.0)
    } else {
        0.0
    }
}

/// Model-FLOPs utilisation: the model FLOP/s the tokens per second stand for
/// (`flops_per_token`, [`crate::model::model_flops_per_token`]) over the peak FLOP/s of the
/// devices that trained them (`peak_flops`, all of them together). NaN when the peak is not a
/// positive finite number (unknown).
pub fn mfu(tokens_per_s: f64, flops_per_token: f64, peak_flops: f64) -> f64 {
    if peak_flops.is_finite() && peak_flops > 0.0 {
        tokens_per_s * flops_per_token / peak_flops
    } else {
        f64::NAN
    }
}

/// One completed training step, as seen by the launcher.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// 0-based step index. A step can appear twice: redone after a failure, or again after a
    /// rollback to a checkpoint.
    pub step: u64,
    /// Wall seconds since training start when the step completed on all live workers.
    #[serde(deserialize_with = "nan_if_missing")]
    pub t_s: f64,
    /// Mean loss over the workers.
    #[serde(deserialize_with = "nan_if_missing")]
    pub loss: f64,
    /// Tokens processed, over all workers.
    pub tokens: u64,
    /// Sequences processed, over all workers.
    pub samples: u64,
    /// Nodes alive during the step.
    pub live_nodes: usize,
    /// Nodes that hold experts in the plan the step ran on.
    pub used_nodes: usize,
    /// Version of the plan the step ran on.
    pub plan_version: u64,
    /// Step time in milliseconds, max over the workers.
    #[serde(deserialize_with = "nan_if_missing")]
    pub step_ms: f64,
    /// CPU milliseconds a worker spent computing its experts: the largest and the mean over the
    /// workers (their ratio is the step's compute imbalance; the wall step is the same on
    /// every worker, as the collectives synchronise them).
    #[serde(default, deserialize_with = "nan_if_missing")]
    pub expert_ms_max: f64,
    #[serde(default, deserialize_with = "nan_if_missing")]
    pub expert_ms_mean: f64,
    /// Token rows a worker ran through its experts: the largest and the mean over the workers.
    #[serde(default)]
    pub expert_tokens_max: u64,
    #[serde(default, deserialize_with = "nan_if_missing")]
    pub expert_tokens_mean: f64,
    /// Bytes all workers sent to each other during the step (every collective: routed
    /// tokens, FSEP's shard gathers, gradient reductions).
    #[serde(default)]
    pub sent_bytes: u64,
    /// Bytes of replica copies the workers send in the background for a re-layout without a
    /// pause (replicated experts, `--migration async`), counted on the first step after the
    /// copies started; not part of `sent_bytes`.
    #[serde(default)]
    pub copy_bytes: u64,
    /// Routed tokens `[layer][expert]` summed over the workers (the job machine's routing
    /// history of the step); written to `routing.csv`, not `steps.csv` ([`routing_csv`]).
    #[serde(skip)]
    pub routing: Vec<Vec<u64>>,
    /// A global batch: the sequences each member trained; written to `samples.csv`
    /// ([`samples_csv`]).
    #[serde(skip)]
    pub trained: Vec<lazarus_planner::job::MemberSamples>,
    /// The step's tokens over its `step_ms` ([`step_tokens_per_s`]). Read as NaN from a file
    /// written before it was recorded (also `data_wait_ms`, `mfu`).
    #[serde(default = "not_measured", deserialize_with = "nan_if_missing")]
    pub tokens_per_s: f64,
    /// Milliseconds the slowest member spent getting its batch in this step (part of
    /// `step_ms`): the step's data wait.
    #[serde(default = "not_measured", deserialize_with = "nan_if_missing")]
    pub data_wait_ms: f64,
    /// Model-FLOPs utilisation of the step as a fraction ([`mfu`]): NaN (`NaN` in CSV, `null`
    /// in JSON) when the devices' peak is unknown (`lzrun --peak-tflops`).
    #[serde(default = "not_measured", deserialize_with = "nan_if_missing")]
    pub mfu: f64,
    /// A global batch: the position of the step's first sequence in the global sample order
    /// (empty without one); the step trained positions `data_cursor..data_cursor + samples`.
    #[serde(default)]
    pub data_cursor: Option<u64>,
    /// The held-out loss after the step's update (`--eval-data`: the cross-entropy over the
    /// fixed eval set), `None` (an empty CSV field) when the step was not evaluated; NaN when
    /// it was not finite or the workers disagreed. A file written before it reads as `None`.
    #[serde(default)]
    pub eval_loss: Option<f64>,
    /// The held-out perplexity, `exp(eval_loss)` ([`eval_ppl`]).
    #[serde(default)]
    pub eval_ppl: Option<f64>,
}

/// The perplexity of a cross-entropy loss (nats per token): `exp(loss)`.
pub fn eval_ppl(loss: f64) -> f64 {
    loss.exp()
}

/// One reconfiguration of the running job.
///
/// `at_step` is the first step that had not completed when the reconfiguration began (steps
/// `< at_step` were done); `resume_step` is the step training resumes with afterwards (equal to
/// `at_step` for an in-place recovery, the checkpoint's step for a restore).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryRecord {
    /// [`KIND_IN_PLACE`], [`KIND_CHECKPOINT`], [`KIND_JOIN`] or [`KIND_REBALANCE`].
    pub kind: String,
    /// First step not completed when the reconfiguration began.
    pub at_step: u64,
    /// Step training resumed with.
    pub resume_step: u64,
    /// Live nodes before.
    pub nodes_before: usize,
    /// Live nodes after.
    pub nodes_after: usize,
    /// Expert replica transfers.
    pub transfers: usize,
    /// Bytes moved by the transfers.
    pub bytes: u64,
    /// Failure to detection, ms.
    #[serde(deserialize_with = "nan_if_missing")]
    pub detect_ms: f64,
    /// Computing the new plan, ms.
    #[serde(deserialize_with = "nan_if_missing")]
    pub replan_ms: f64,
    /// Moving expert state, ms.
    #[serde(deserialize_with = "nan_if_missing")]
    pub migrate_ms: f64,
    /// Restarting the step loop, ms.
    #[serde(deserialize_with = "nan_if_missing")]
    pub resume_ms: f64,
    /// End to end, ms.
    #[serde(deserialize_with = "nan_if_missing")]
    pub total_ms: f64,
    /// Plan version training resumed with.
    pub plan_version: u64,
    /// Nodes that became members for the first time (joined) with this reconfiguration,
    /// whatever its kind: a join may ride on a failure's replan or on a checkpoint restore.
    #[serde(default)]
    pub joined: usize,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Distinct steps completed: max step + 1 (0 without records).
    pub steps: u64,
    /// Loss of the first step this run trained: step 0, or the checkpoint's step of a resumed
    /// run (NaN, `null` in JSON, if none).
    #[serde(deserialize_with = "nan_if_missing")]
    pub initial_loss: f64,
    /// Loss of the last record (NaN if none).
    #[serde(deserialize_with = "nan_if_missing")]
    pub final_loss: f64,
    /// In-place recoveries.
    pub recoveries: usize,
    /// Checkpoint restores.
    pub fallbacks: usize,
    /// Nodes that joined the job after it started (with any kind of reconfiguration; see
    /// [`RecoveryRecord::joined`]).
    pub joins: usize,
    /// Times the expert layout changed without a membership change: blocking rebalances (a
    /// `rebalance` reconfiguration: pause, replan, migrate) plus layout switches made while
    /// training (`--migration async` replica copies, `--relayout laer`), which are no
    /// reconfiguration and were not counted before. A switch is seen as a plan version the
    /// steps trained on that no reconfiguration started.
    pub rebalances: usize,
    /// The layout switches made while training, of `rebalances`.
    #[serde(default)]
    pub layout_switches: usize,
    /// `total_ms` of every in-place recovery, in order.
    pub recovery_ms: Vec<f64>,
    /// Every reconfiguration, in order.
    pub reconfigurations: Vec<RecoveryRecord>,
    /// Wall seconds of the run.
    pub wall_s: f64,
    /// Tokens of all records (redone steps included) per wall second.
    pub tokens_per_s: f64,
    /// Live nodes of the last record (0 if none).
    pub final_live_nodes: usize,
    /// Plan version of the last record, or of the last reconfiguration if later.
    pub plan_version: u64,
    /// The run's configuration, as the launcher describes it.
    pub config: serde_json::Value,
    /// Seed of the run.
    pub seed: u64,
    /// Commit of the checkout that ran.
    pub git_commit: String,
    /// Tokens per second of step time: the records' tokens over their summed `step_ms` (the
    /// step-time-weighted mean of their `tokens_per_s`). Unlike `tokens_per_s` it leaves out
    /// what is not a step (start-up, reconfigurations, the end), so runs with different faults
    /// compare. 0 without step time.
    #[serde(default = "not_measured", deserialize_with = "nan_if_missing")]
    pub step_tokens_per_s: f64,
    /// Mean `data_wait_ms` of the records (NaN, `null`, without records).
    #[serde(default = "not_measured", deserialize_with = "nan_if_missing")]
    pub mean_data_wait_ms: f64,
    /// Step-time-weighted mean `mfu` of the records that have one (NaN, `null`, when none has:
    /// the peak was unknown).
    #[serde(default = "not_measured", deserialize_with = "nan_if_missing")]
    pub mfu: f64,
    /// Model FLOPs per trained token the MFU counts ([`crate::model::model_flops_per_token`];
    /// `None`: the launcher did not say).
    #[serde(default)]
    pub model_flops_per_token: Option<f64>,
    /// Peak TFLOP/s of one device the MFU was computed against (`None`: unknown, no MFU).
    #[serde(default)]
    pub peak_tflops: Option<f64>,
    /// Held-out loss and perplexity of the first evaluated record (`None`, absent from the
    /// JSON, without `--eval-data`; `null` when not finite).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_eval_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_eval_ppl: Option<f64>,
    /// Held-out loss and perplexity of the last evaluated record (the job evaluates after its
    /// last step, so this is the final model's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_eval_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_eval_ppl: Option<f64>,
}

/// Builds the summary of a run; see the field docs of [`Summary`].
pub fn summarize(
    records: &[StepRecord],
    reconfigs: &[RecoveryRecord],
    wall_s: f64,
    config: serde_json::Value,
    seed: u64,
    git_commit: String,
) -> Summary {
    let count = |kind: &str| reconfigs.iter().filter(|r| r.kind == kind).count();
    let switches = layout_switches(records, reconfigs);
    let tokens: u64 = records.iter().map(|r| r.tokens).sum();
    let last = records.last();
    // Means weighted by step time: a slow step weighs what it cost.
    let timed = records.iter().filter(|r| r.step_ms > 0.0);
    let step_ms: f64 = timed.clone().map(|r| r.step_ms).sum();
    let step_tokens: u64 = timed.clone().map(|r| r.tokens).sum();
    let with_mfu = timed.filter(|r| r.mfu.is_finite());
    let mfu_ms: f64 = with_mfu.clone().map(|r| r.step_ms).sum();
    let first_eval = records.iter().find(|r| r.eval_loss.is_some());
    let last_eval = records.iter().rev().find(|r| r.eval_loss.is_some());
    let waits: Vec<f64> = records
        .iter()
        .map(|r| r.data_wait_ms)
        .filter(|w| w.is_finite())
        .collect();
    Summary {
        steps: records.iter().map(|r| r.step).max().map_or(0, |m| m + 1),
        initial_loss: records.first().map_or(f64::NAN, |r| r.loss),
        final_loss: last.map_or(f64::NAN, |r| r.loss),
        recoveries: count(KIND_IN_PLACE),
        fallbacks: count(KIND_CHECKPOINT),
        joins: reconfigs.iter().map(|r| r.joined).sum(),
        rebalances: count(KIND_REBALANCE) + switches,
        layout_switches: switches,
        recovery_ms: reconfigs
            .iter()
            .filter(|r| r.kind == KIND_IN_PLACE)
            .map(|r| r.total_ms)
            .collect(),
        reconfigurations: reconfigs.to_vec(),
        wall_s,
        tokens_per_s: if wall_s > 0.0 {
            tokens as f64 / wall_s
        } else {
            0.0
        },
        final_live_nodes: last.map_or(0, |r| r.live_nodes),
        plan_version: last
            .map(|r| r.plan_version)
            .into_iter()
            .chain(reconfigs.last().map(|r| r.plan_version))
            .max()
            .unwrap_or(0),
        config,
        seed,
        git_commit,
        step_tokens_per_s: step_tokens_per_s(step_tokens, step_ms),
        mean_data_wait_ms: if waits.is_empty() {
            f64::NAN
        } else {
            waits.iter().sum::<f64>() / waits.len() as f64
        },
        mfu: if mfu_ms > 0.0 {
            with_mfu.map(|r| r.mfu * r.step_ms).sum::<f64>() / mfu_ms
        } else {
            f64::NAN
        },
        model_flops_per_token: None,
        peak_tflops: None,
        first_eval_loss: first_eval.and_then(|r| r.eval_loss),
        first_eval_ppl: first_eval.and_then(|r| r.eval_ppl),
        final_eval_loss: last_eval.and_then(|r| r.eval_loss),
        final_eval_ppl: last_eval.and_then(|r| r.eval_ppl),
    }
}

/// Layout switches made while training: plan versions the steps trained on that no
/// reconfiguration record started (a switch changes the plan version within an epoch, without
/// a reconfiguration). The first record's version is not one (the run may have started on a
/// plan whose record another controller reported).
fn layout_switches(records: &[StepRecord], reconfigs: &[RecoveryRecord]) -> usize {
    let started: std::collections::BTreeSet<u64> =
        reconfigs.iter().map(|r| r.plan_version).collect();
    let mut seen = std::collections::BTreeSet::new();
    if let Some(first) = records.first() {
        seen.insert(first.plan_version);
    }
    records
        .iter()
        .filter(|r| !started.contains(&r.plan_version) && seen.insert(r.plan_version))
        .count()
}

/// One row of `timeseries.csv`: the columns of the simulator's `Sample`, in its order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleRow {
    /// Seconds since training start.
    pub t_s: f64,
    /// Live nodes.
    pub live_nodes: usize,
    /// Nodes holding experts.
    pub used_nodes: usize,
    /// `training`, or a reconfiguration state ([`state_of_kind`]).
    pub state: String,
    /// Training progress: steps completed (rolled back by a checkpoint restore).
    pub steps: u64,
    /// Samples of the completed steps (rolled back with them).
    pub samples: u64,
    /// Samples per second of this step (0 for reconfiguration rows).
    pub throughput_samples_per_s: f64,
}

/// Index of the record before which `rc`'s row goes, searching from `cursor`: the first record
/// of step `rc.resume_step` that comes after all steps `< rc.at_step` have completed (so a
/// rollback's row goes before the redone steps, not before their first run); `records.len()`
/// if there is none (the run ended during or right after the reconfiguration).
fn placement(
    records: &[StepRecord],
    prefix_done: &[u64],
    cursor: usize,
    rc: &RecoveryRecord,
) -> usize {
    (cursor..records.len())
        .find(|&i| records[i].step == rc.resume_step && prefix_done[i] >= rc.at_step)
        .unwrap_or(records.len())
}

/// The rows of `timeseries.csv`.
///
/// One row per [`StepRecord`] with state `training`: `t_s` of the record, `steps` = step + 1,
/// `samples` = cumulative samples of the steps up to it (a redone step replaces its earlier
/// run), `throughput_samples_per_s` = samples / (step_ms / 1000) (0 when `step_ms` is 0).
///
/// A reconfiguration gets its own row right before the first step after it, with its state
/// ([`state_of_kind`]) and throughput 0. "The first step after it" is the first record, not
/// before the previous reconfiguration's row, whose step is `resume_step` and that follows
/// records of all steps `< at_step`; without such a record the row goes at the end. The row
/// has `t_s` of the record before it (when the last step before the reconfiguration
/// completed; 0 if none), `live_nodes` = `nodes_after`, `used_nodes` of the next record
/// (`nodes_after` at the end), `steps` = `resume_step` and the samples of the steps before
/// `resume_step`: like the simulator, a checkpoint restore rolls the progress back.
pub fn timeseries(records: &[StepRecord], reconfigs: &[RecoveryRecord]) -> Vec<SampleRow> {
    // prefix_done[i]: steps known completed before record i (max step over records[..i] + 1).
    let mut prefix_done = Vec::with_capacity(records.len());
    let mut done = 0u64;
    for r in records {
        prefix_done.push(done);
        done = done.max(r.step + 1);
    }
    let mut places = Vec::with_capacity(reconfigs.len());
    let mut cursor = 0;
    for rc in reconfigs {
        cursor = placement(records, &prefix_done, cursor, rc);
        places.push(cursor);
    }

    // cumulative[s]: samples of steps 0..=s in the current history.
    let mut cumulative: Vec<u64> = Vec::new();
    let samples_before = |cumulative: &[u64], step: u64| -> u64 {
        if step == 0 {
            return 0;
        }
        let i = usize::try_from(step - 1).unwrap_or(usize::MAX);
        cumulative
            .get(i)
            .or(cumulative.last())
            .copied()
            .unwrap_or(0)
    };
    let reconfig_row = |rc: &RecoveryRecord, t_s: f64, used_nodes: usize, samples: u64| SampleRow {
        t_s,
        live_nodes: rc.nodes_after,
        used_nodes,
        state: state_of_kind(&rc.kind).to_string(),
        steps: rc.resume_step,
        samples,
        throughput_samples_per_s: 0.0,
    };

    let mut rows = Vec::with_capacity(records.len() + reconfigs.len());
    let mut next = 0;
    let mut last_t = 0.0;
    for (i, r) in records.iter().enumerate() {
        while next < reconfigs.len() && places[next] == i {
            let rc = &reconfigs[next];
            let samples = samples_before(&cumulative, rc.resume_step);
            rows.push(reconfig_row(rc, last_t, r.used_nodes, samples));
            next += 1;
        }
        let step = usize::try_from(r.step).unwrap_or(usize::MAX);
        let before = samples_before(&cumulative, r.step);
        if step < cumulative.len() {
            cumulative.truncate(step);
        } else {
            // missing records: carry the count over the gap
            let fill = cumulative.last().copied().unwrap_or(0);
            cumulative.resize(step, fill);
        }
        let total = before + r.samples;
        cumulative.push(total);
        rows.push(SampleRow {
            t_s: r.t_s,
            live_nodes: r.live_nodes,
            used_nodes: r.used_nodes,
            state: STATE_TRAINING.to_string(),
            steps: r.step + 1,
            samples: total,
            throughput_samples_per_s: if r.step_ms > 0.0 {
                r.samples as f64 / (r.step_ms / 1000.0)
            } else {
                0.0
            },
        });
        last_t = r.t_s;
    }
    for rc in &reconfigs[next..] {
        let samples = samples_before(&cumulative, rc.resume_step);
        rows.push(reconfig_row(rc, last_t, rc.nodes_after, samples));
    }
    rows
}

/// Why the metrics could not be written; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The output directory could not be created.
    #[error("cannot create metrics directory {}: {source}", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file could not be written or renamed into place.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file's content could not be encoded.
    #[error("cannot encode {}: {msg}", path.display())]
    Encode {
        /// The file.
        path: PathBuf,
        /// The encoder's message.
        msg: String,
    },
}

impl From<MetricsError> for std::io::Error {
    fn from(e: MetricsError) -> Self {
        match e {
            MetricsError::CreateDir { ref source, .. } | MetricsError::Write { ref source, .. } => {
                std::io::Error::new(source.kind(), e.to_string())
            }
            MetricsError::Encode { .. } => {
                std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
            }
        }
    }
}

/// Writes `bytes` to `path` through `path.tmp` and a rename; the temp file is removed on error.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), MetricsError> {
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    write_then_rename(&tmp, path, bytes).map_err(|source| {
        let _ = fs::remove_file(&tmp);
        MetricsError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

fn write_then_rename(tmp: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = fs::File::create(tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    fs::rename(tmp, path)
}

/// CSV with an explicit header line (present even without rows).
fn csv_bytes<T: Serialize>(
    path: &Path,
    header: &[&str],
    rows: &[T],
) -> Result<Vec<u8>, MetricsError> {
    let encode = |e: csv::Error| MetricsError::Encode {
        path: path.to_path_buf(),
        msg: e.to_string(),
    };
    let mut w = csv::WriterBuilder::new()
        .has_headers(false)
        .from_writer(Vec::new());
    w.write_record(header).map_err(encode)?;
    for row in rows {
        w.serialize(row).map_err(encode)?;
    }
    w.into_inner().map_err(|e| MetricsError::Encode {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

/// `routing.csv`: the routed tokens of every step record that carries them, the history the
/// job machine plans from. Header `record,step,layer,e0,…,e{E-1}`; one row per MoE layer of
/// each record, records in the order of `steps.csv` (`record` is the 0-based row of
/// `steps.csv`, so a step counted twice, before and after a rollback, has two blocks), each
/// count the tokens routed to that expert in that layer summed over the workers. The header is
/// `record,step,layer` when no record has routing.
pub fn routing_csv(records: &[StepRecord]) -> String {
    let experts = records
        .iter()
        .flat_map(|r| r.routing.iter())
        .map(Vec::len)
        .max()
        .unwrap_or(0);
    let mut s = String::from("record,step,layer");
    for e in 0..experts {
        let _ = write!(s, ",e{e}");
    }
    s.push('\n');
    for (i, r) in records.iter().enumerate() {
        for (l, counts) in r.routing.iter().enumerate() {
            let _ = write!(s, "{i},{},{l}", r.step);
            for e in 0..experts {
                let _ = write!(s, ",{}", counts.get(e).copied().unwrap_or(0));
            }
            s.push('\n');
        }
    }
    s
}

/// `samples.csv`: every sequence every member trained, one row each. Header
/// `record,step,member,rank,position,source,sequence`: `record` is the 0-based row of
/// `steps.csv` (a step counted again after a rollback to a checkpoint has a later block: the
/// final history is each step's last block), `member` the node's name (`n3`), `rank` its rank
/// in the plan of the step, `position` the place in the
/// global sample order, `source` the dataset of the blend (0 without a blend) and `sequence`
/// the training sequence of that dataset (`lazarus_executor::dataset::TrainData`). In one
/// epoch of a dataset each sequence is trained once.
pub fn samples_csv(records: &[StepRecord]) -> String {
    let mut s = String::from("record,step,member,rank,position,source,sequence\n");
    for (i, r) in records.iter().enumerate() {
        for m in &r.trained {
            for (k, (source, seq)) in m.sequences.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "{i},{},{},{},{},{source},{seq}",
                    r.step,
                    m.name,
                    m.rank,
                    m.first_position + k as u64
                );
            }
        }
    }
    s
}

/// Writes `summary.json`, `timeseries.csv`, `steps.csv`, `reconfigurations.jsonl` and
/// `routing.csv` (and `samples.csv` with a global batch) into `dir` (created if missing; existing files of these names are replaced),
/// each atomically.
pub fn write_metrics(
    dir: &Path,
    summary: &Summary,
    records: &[StepRecord],
    reconfigs: &[RecoveryRecord],
) -> Result<(), MetricsError> {
    fs::create_dir_all(dir).map_err(|source| MetricsError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let json_err = |path: &Path| {
        let path = path.to_path_buf();
        move |e: serde_json::Error| MetricsError::Encode {
            path,
            msg: e.to_string(),
        }
    };

    let path = dir.join("summary.json");
    let mut bytes = serde_json::to_vec_pretty(summary).map_err(json_err(&path))?;
    bytes.push(b'\n');
    write_atomic(&path, &bytes)?;

    let path = dir.join("timeseries.csv");
    let bytes = csv_bytes(&path, &TIMESERIES_COLUMNS, &timeseries(records, reconfigs))?;
    write_atomic(&path, &bytes)?;

    let path = dir.join("steps.csv");
    let bytes = csv_bytes(&path, &STEP_COLUMNS, records)?;
    write_atomic(&path, &bytes)?;

    let path = dir.join("routing.csv");
    write_atomic(&path, routing_csv(records).as_bytes())?;

    if records.iter().any(|r| !r.trained.is_empty()) {
        let path = dir.join("samples.csv");
        write_atomic(&path, samples_csv(records).as_bytes())?;
    }

    let path = dir.join("reconfigurations.jsonl");
    let mut bytes = Vec::new();
    for rc in reconfigs {
        serde_json::to_writer(&mut bytes, rc).map_err(json_err(&path))?;
        bytes.push(b'\n');
    }
    write_atomic(&path, &bytes)
}

/// `x` like Python's `'{:.6E}'.format(x)`: `4.123456E+00`, `NAN`, `INF`.
fn sci6(x: f64) -> String {
    if x.is_nan() {
        return "NAN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "INF" } else { "-INF" }.into();
    }
    let s = format!("{x:.6e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}E{sign}{:02}", exp.unsigned_abs())
}

/// A Megatron-style progress line for a completed step, e.g.
/// ` step       11/      19 | consumed samples:          384 | elapsed time per step (ms): 31.2 | lm loss: 4.123456E+00 | tokens per second: 8192.0 | data wait (ms): 0.25 | MFU: 12.5% | live nodes: 4 | plan version: 3 |`.
///
/// `step S/L` is step S of steps 0 to L: steps are counted from 0 everywhere (the loss table,
/// `steps.csv`, `--kill NODE@STEP`, "after step S"), so the last step of a 20-step run prints
/// `19/19`. Megatron's own line counts iterations from 1; this one used to as well, which made
/// its "iteration 6" the "step 5" of every other output. Tokens per second are the record's
/// `tokens_per_s`, the data wait its
/// `data_wait_ms`. `MFU` is left out when it is unknown (NaN: no peak for the device).
/// A step that was evaluated (`--eval-data`) adds `eval loss: X | eval ppl: Y |` after the
/// MFU, in the format of Megatron's validation line (`lm loss value: X | lm loss PPL: Y`).
pub fn log_line(r: &StepRecord, total_steps: u64, consumed_samples: u64) -> String {
    let mut s = String::with_capacity(240);
    let _ = write!(
        s,
        " step {:>8}/{:>8} | consumed samples: {:>12} | elapsed time per step (ms): {:.1} \
         | lm loss: {} | tokens per second: {:.1} | data wait (ms): {:.2} |",
        r.step,
        total_steps.saturating_sub(1),
        consumed_samples,
        r.step_ms,
        sci6(r.loss),
        r.tokens_per_s,
        r.data_wait_ms,
    );
    if r.mfu.is_finite() {
        let _ = write!(s, " MFU: {:.1}% |", 100.0 * r.mfu);
    }
    if let Some(loss) = r.eval_loss {
        let ppl = r.eval_ppl.unwrap_or_else(|| eval_ppl(loss));
        let _ = write!(s, " eval loss: {} | eval ppl: {} |", sci6(loss), sci6(ppl));
    }
    let _ = write!(
        s,
        " live nodes: {} | plan version: {} |",
        r.live_nodes, r.plan_version
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(step: u64, t_s: f64, loss: f64) -> StepRecord {
        StepRecord {
            step,
            t_s,
            loss,
            tokens: 1000,
            samples: 10,
            live_nodes: 4,
            used_nodes: 4,
            plan_version: 1,
            step_ms: 500.0,
            expert_ms_max: 0.0,
            expert_ms_mean: 0.0,
            expert_tokens_max: 0,
            expert_tokens_mean: 0.0,
            sent_bytes: 0,
            copy_bytes: 0,
            routing: Vec::new(),
            trained: Vec::new(),
            tokens_per_s: 2000.0,
            data_wait_ms: 1.5,
            mfu: 0.25,
            data_cursor: None,
            eval_loss: None,
            eval_ppl: None,
        }
    }

    fn rc(kind: &str, at_step: u64, resume_step: u64, total_ms: f64) -> RecoveryRecord {
        RecoveryRecord {
            kind: kind.into(),
            at_step,
            resume_step,
            nodes_before: 4,
            nodes_after: 3,
            transfers: 2,
            bytes: 4096,
            detect_ms: 1.0,
            replan_ms: 2.0,
            migrate_ms: 3.0,
            resume_ms: 4.0,
            total_ms,
            plan_version: 2,
            joined: usize::from(kind == KIND_JOIN),
        }
    }

    /// Issue 33 item 6.7: `rebalances 0` while the log showed layout switches made while
    /// training (async migration, LAER), and `0 joins` when nodes joined with a failure's
    /// replan. Switches are plan versions the steps trained on that no reconfiguration started;
    /// joins are the nodes each reconfiguration made members for the first time.
    #[test]
    fn every_counter_counts_what_happened() {
        let version = |step: u64, v: u64| StepRecord {
            plan_version: v,
            ..rec(step, step as f64, 4.0)
        };
        // v1 from the start; v2 a layout switch while training (no record); v3 an in-place
        // replan that also took in 2 newcomers; v4 a switch; v5 a blocking rebalance.
        let records = vec![
            version(0, 1),
            version(1, 2),
            version(2, 2),
            version(3, 3),
            version(4, 4),
            version(5, 4),
            version(6, 5),
        ];
        let mut start = rc("start", 0, 0, 0.0);
        start.plan_version = 1;
        let mut failure = rc(KIND_IN_PLACE, 3, 3, 10.0);
        failure.plan_version = 3;
        failure.joined = 2;
        let mut rebalance = rc(KIND_REBALANCE, 6, 6, 10.0);
        rebalance.plan_version = 5;
        let s = summarize(
            &records,
            &[start, failure, rebalance],
            1.0,
            serde_json::Value::Null,
            0,
            String::new(),
        );
        assert_eq!((s.recoveries, s.joins), (1, 2));
        assert_eq!((s.rebalances, s.layout_switches), (3, 2));
    }

    /// Steps 0..=3, a failure after step 3 that redoes step 3 in place (at_step 4, resume 3), then 4; a join before step 5; step 5.
    fn run() -> (Vec<StepRecord>, Vec<RecoveryRecord>) {
        let mut records: Vec<StepRecord> = (0..4)
            .map(|s| rec(s, s as f64 + 1.0, 5.0 - s as f64 * 0.1))
            .collect();
        let mut redo = rec(3, 5.5, 4.65);
        redo.live_nodes = 3;
        redo.plan_version = 2;
        records.push(redo);
        records.push(StepRecord {
            live_nodes: 3,
            plan_version: 2,
            ..rec(4, 6.5, 4.6)
        });
        records.push(StepRecord {
            live_nodes: 4,
            plan_version: 3,
            ..rec(5, 8.0, 4.5)
        });
        let mut join = rc(KIND_JOIN, 5, 5, 900.0);
        join.nodes_before = 3;
        join.nodes_after = 4;
        join.plan_version = 3;
        (records, vec![rc(KIND_IN_PLACE, 4, 3, 250.0), join])
    }

    #[test]
    fn summarize_with_redone_step() {
        let (records, reconfigs) = run();
        let cfg = serde_json::json!({"nodes": 4});
        let s = summarize(&records, &reconfigs, 10.0, cfg.clone(), 42, "abc".into());
        assert_eq!(s.steps, 6);
        assert_eq!(s.initial_loss, 5.0);
        assert_eq!(s.final_loss, 4.5);
        assert_eq!(
            (s.recoveries, s.fallbacks, s.joins, s.rebalances),
            (1, 0, 1, 0)
        );
        assert_eq!(s.recovery_ms, [250.0]);
        assert_eq!(s.reconfigurations, reconfigs);
        assert_eq!(s.tokens_per_s, 7000.0 / 10.0);
        // 7 records of 1000 tokens in 500 ms each
        assert_eq!(s.step_tokens_per_s, 2000.0);
        assert_eq!((s.mean_data_wait_ms, s.mfu), (1.5, 0.25));
        assert_eq!((s.final_live_nodes, s.plan_version), (4, 3));
        assert_eq!((s.config, s.seed, s.git_commit.as_str()), (cfg, 42, "abc"));

        let empty = summarize(&[], &[], 0.0, serde_json::Value::Null, 0, String::new());
        assert_eq!(empty.steps, 0);
        assert!(empty.initial_loss.is_nan() && empty.final_loss.is_nan());
        assert_eq!((empty.tokens_per_s, empty.step_tokens_per_s), (0.0, 0.0));
        assert!(empty.mean_data_wait_ms.is_nan() && empty.mfu.is_nan());
        // NaN goes to JSON as null and comes back as NaN
        let json = serde_json::to_string(&empty).unwrap();
        assert!(json.contains("\"initial_loss\":null"), "{json}");
        let back: Summary = serde_json::from_str(&json).unwrap();
        assert!(back.initial_loss.is_nan());
    }

    #[test]
    fn timeseries_columns_match_the_simulator() {
        let (records, reconfigs) = run();
        let rows = timeseries(&records, &reconfigs);
        let mut w = csv::Writer::from_writer(Vec::new());
        for row in &rows {
            w.serialize(row).unwrap();
        }
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        let header = text.lines().next().unwrap();
        assert_eq!(
            header,
            "t_s,live_nodes,used_nodes,state,steps,samples,throughput_samples_per_s"
        );
        assert_eq!(header, TIMESERIES_COLUMNS.join(","));
        // steps.csv header constant matches the struct
        let mut w = csv::Writer::from_writer(Vec::new());
        w.serialize(&records[0]).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        assert_eq!(text.lines().next().unwrap(), STEP_COLUMNS.join(","));
    }

    #[test]
    fn timeseries_rows_and_reconfiguration_rows() {
        let (records, reconfigs) = run();
        let rows = timeseries(&records, &reconfigs);
        let states: Vec<&str> = rows.iter().map(|r| r.state.as_str()).collect();
        assert_eq!(
            states,
            [
                "training",
                "training",
                "training",
                "training",
                "recovering",
                "training",
                "training",
                "joining",
                "training"
            ]
        );
        let recovering = &rows[4];
        assert_eq!(recovering.t_s, 4.0); // step 3's first run completed at 4 s
        assert_eq!(
            (recovering.live_nodes, recovering.steps, recovering.samples),
            (3, 3, 30)
        );
        assert_eq!(recovering.throughput_samples_per_s, 0.0);
        // redone step 3 replaces its first run in the progress
        assert_eq!((rows[3].steps, rows[3].samples), (4, 40));
        assert_eq!((rows[5].steps, rows[5].samples), (4, 40));
        assert_eq!((rows[6].steps, rows[6].samples), (5, 50));
        assert_eq!(
            (rows[7].t_s, rows[7].live_nodes, rows[7].steps),
            (6.5, 4, 5)
        );
        assert_eq!(rows[0].throughput_samples_per_s, 20.0); // 10 samples in 0.5 s
    }

    #[test]
    fn timeseries_checkpoint_rollback_row_before_the_redone_steps() {
        // steps 0..=6, failure during step 7, restore of the checkpoint at step 4, then 4..=5
        let mut records: Vec<StepRecord> = (0..7).map(|s| rec(s, s as f64, 1.0)).collect();
        records.extend((4..6).map(|s| rec(s, 10.0 + s as f64, 1.0)));
        let mut restore = rc(KIND_CHECKPOINT, 7, 4, 3000.0);
        restore.nodes_after = 2;
        // a rebalance at the very end, after the last step
        let reconfigs = vec![restore, rc(KIND_REBALANCE, 6, 6, 10.0)];
        let rows = timeseries(&records, &reconfigs);
        assert_eq!(rows.len(), 11);
        let restoring = &rows[7];
        assert_eq!(restoring.state, "restoring");
        assert_eq!((restoring.t_s, restoring.live_nodes), (6.0, 2));
        assert_eq!((restoring.steps, restoring.samples), (4, 40));
        assert_eq!((rows[8].steps, rows[8].samples), (5, 50));
        assert_eq!(rows[10].state, "rebalancing");
        assert_eq!(
            (rows[10].t_s, rows[10].steps, rows[10].samples),
            (15.0, 6, 60)
        );
        let s = summarize(
            &records,
            &reconfigs,
            16.0,
            serde_json::Value::Null,
            0,
            String::new(),
        );
        assert_eq!((s.steps, s.fallbacks, s.rebalances), (7, 1, 1));
        assert!(s.recovery_ms.is_empty());
        // nothing recorded: only the reconfiguration rows
        let rows = timeseries(&[], &reconfigs);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].t_s, rows[0].samples), (0.0, 0));
    }

    #[test]
    fn write_metrics_writes_five_files_atomically() {
        let dir = std::env::temp_dir().join(format!(
            "lazarus-metrics-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        let out = dir.join("nested").join("run");
        let (mut records, reconfigs) = run();
        records[1].loss = f64::NAN;
        records[0].routing = vec![vec![3, 0, 5], vec![1, 1, 6]];
        records[4].routing = vec![vec![2, 2, 4], vec![0, 8, 0]];
        let summary = summarize(
            &records,
            &reconfigs,
            10.0,
            serde_json::json!({"x": 1}),
            7,
            "c0ffee".into(),
        );
        write_metrics(&out, &summary, &records, &reconfigs).unwrap();
        // twice: files are replaced
        write_metrics(&out, &summary, &records, &reconfigs).unwrap();
        let mut names: Vec<String> = fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "reconfigurations.jsonl",
                "routing.csv",
                "steps.csv",
                "summary.json",
                "timeseries.csv"
            ]
        );
        // One row per layer of each record with routing; `record` is the row of steps.csv
        // (record 4 is the redone step 3).
        assert_eq!(
            fs::read_to_string(out.join("routing.csv")).unwrap(),
            "record,step,layer,e0,e1,e2\n0,0,0,3,0,5\n0,0,1,1,1,6\n4,3,0,2,2,4\n4,3,1,0,8,0\n"
        );
        assert_eq!(routing_csv(&records[1..2]), "record,step,layer\n");

        let text = fs::read_to_string(out.join("summary.json")).unwrap();
        assert!(
            text.ends_with("}\n") && text.contains("\n  \"steps\": 6"),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Summary>(&text).unwrap(), summary);

        let ts = fs::read_to_string(out.join("timeseries.csv")).unwrap();
        assert!(ts.starts_with(
            "t_s,live_nodes,used_nodes,state,steps,samples,throughput_samples_per_s\n"
        ));
        let rows: Vec<SampleRow> = csv::Reader::from_reader(ts.as_bytes())
            .deserialize()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(rows, timeseries(&records, &reconfigs));

        let steps: Vec<StepRecord> = csv::Reader::from_path(out.join("steps.csv"))
            .unwrap()
            .deserialize()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(steps.len(), records.len());
        assert!(steps[1].loss.is_nan());
        assert_eq!(steps[2], records[2]);

        let jsonl = fs::read_to_string(out.join("reconfigurations.jsonl")).unwrap();
        let back: Vec<RecoveryRecord> = jsonl
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(back, reconfigs);

        // no rows: the CSV headers are still there
        let empty = dir.join("empty");
        let s = summarize(&[], &[], 0.0, serde_json::Value::Null, 0, String::new());
        write_metrics(&empty, &s, &[], &[]).unwrap();
        assert_eq!(
            fs::read_to_string(empty.join("timeseries.csv")).unwrap(),
            format!("{}\n", TIMESERIES_COLUMNS.join(","))
        );
        assert_eq!(
            fs::read_to_string(empty.join("steps.csv")).unwrap(),
            format!("{}\n", STEP_COLUMNS.join(","))
        );
        assert_eq!(
            fs::read_to_string(empty.join("reconfigurations.jsonl")).unwrap(),
            ""
        );

        // a path that is a file: the error names it
        let err =
            write_metrics(&out.join("summary.json"), &summary, &records, &reconfigs).unwrap_err();
        assert!(err.to_string().contains("summary.json"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn log_line_format() {
        let r = StepRecord {
            step: 11,
            t_s: 3.0,
            loss: 4.123456,
            tokens: 256,
            samples: 32,
            live_nodes: 4,
            used_nodes: 4,
            plan_version: 3,
            step_ms: 31.25,
            expert_ms_max: 0.0,
            expert_ms_mean: 0.0,
            expert_tokens_max: 0,
            expert_tokens_mean: 0.0,
            sent_bytes: 0,
            copy_bytes: 0,
            routing: Vec::new(),
            trained: Vec::new(),
            tokens_per_s: step_tokens_per_s(256, 31.25),
            data_wait_ms: 0.25,
            mfu: 0.125,
            data_cursor: None,
            eval_loss: None,
            eval_ppl: None,
        };
        assert_eq!(
            log_line(&r, 20, 384),
            " step       11/      19 | consumed samples:          384 | elapsed time per \
             step (ms): 31.2 | lm loss: 4.123456E+00 | tokens per second: 8192.0 | data \
             wait (ms): 0.25 | MFU: 12.5% | live nodes: 4 | plan version: 3 |"
        );
        // No peak, no MFU: the field is left out, not printed as NaN.
        let unknown = StepRecord {
            mfu: f64::NAN,
            ..r.clone()
        };
        assert_eq!(
            log_line(&unknown, 20, 384),
            " step       11/      19 | consumed samples:          384 | elapsed time per \
             step (ms): 31.2 | lm loss: 4.123456E+00 | tokens per second: 8192.0 | data \
             wait (ms): 0.25 | live nodes: 4 | plan version: 3 |"
        );
        assert_eq!(sci6(0.000123), "1.230000E-04");
        assert_eq!(sci6(-12345.0), "-1.234500E+04");
        assert_eq!(sci6(0.0), "0.000000E+00");
        assert_eq!(sci6(1e100), "1.000000E+100");
        assert_eq!(sci6(f64::NAN), "NAN");
        let nan = StepRecord {
            loss: f64::NAN,
            step_ms: 0.0,
            tokens_per_s: step_tokens_per_s(256, 0.0),
            ..r
        };
        let line = log_line(&nan, 20, 384);
        assert!(line.contains("lm loss: NAN |") && line.contains("tokens per second: 0.0 |"));
    }

    /// Issue 31 item 5: the throughput numbers of a step and of a run. MFU is model FLOP/s over
    /// the devices' peak, unknown (NaN) without a peak; the run's means weigh a step by its
    /// time and skip steps without MFU.
    #[test]
    fn throughput_per_step_and_per_run() {
        assert_eq!(step_tokens_per_s(1000, 500.0), 2000.0);
        assert_eq!(step_tokens_per_s(1000, 0.0), 0.0);
        // 2000 tokens/s × 740352 FLOPs per token (tiny) over 1 TFLOP/s: 0.148 %
        let fpt = crate::model::model_flops_per_token(&crate::model::MoeConfig::tiny());
        assert!((mfu(2000.0, fpt, 1e12) - 0.001_480_704).abs() < 1e-12);
        for peak in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(mfu(2000.0, fpt, peak).is_nan(), "{peak}");
        }
        let slow = StepRecord {
            step_ms: 1500.0,
            tokens_per_s: step_tokens_per_s(1000, 1500.0),
            data_wait_ms: 4.5,
            mfu: 0.05,
            ..rec(1, 2.0, 1.0)
        };
        let unknown = StepRecord {
            mfu: f64::NAN,
            ..rec(2, 3.0, 1.0)
        };
        let s = summarize(
            &[rec(0, 1.0, 1.0), slow, unknown],
            &[],
            3.0,
            serde_json::Value::Null,
            0,
            String::new(),
        );
        assert_eq!(s.step_tokens_per_s, 3000.0 / 2.5);
        assert_eq!(s.mean_data_wait_ms, 2.5);
        // (0.25 × 500 + 0.05 × 1500) / 2000 ms; the step without MFU is left out
        assert!((s.mfu - 0.1).abs() < 1e-12, "{}", s.mfu);
        // A summary.json written before these fields reads them as unknown.
        let mut old = serde_json::to_value(&s).unwrap();
        for k in [
            "step_tokens_per_s",
            "mean_data_wait_ms",
            "mfu",
            "model_flops_per_token",
            "peak_tflops",
        ] {
            old.as_object_mut().unwrap().remove(k);
        }
        let back: Summary = serde_json::from_value(old).unwrap();
        assert!(back.step_tokens_per_s.is_nan() && back.mfu.is_nan());
        assert_eq!(back.peak_tflops, None);
    }

    /// steps.csv carries the throughput columns and reads back; a steps.csv written before
    /// them still reads, the missing measures as NaN ("not measured", not 0). Unknown MFU is
    /// written as `NaN` and an empty field reads as NaN too.
    #[test]
    fn steps_csv_throughput_columns_round_trip_and_old_files_read() {
        let known = rec(0, 1.0, 4.0);
        let unknown = StepRecord {
            mfu: f64::NAN,
            ..rec(1, 2.0, 3.9)
        };
        let path = Path::new("steps.csv");
        let bytes = csv_bytes(path, &STEP_COLUMNS, &[known.clone(), unknown.clone()]).unwrap();
        let text = String::from_utf8(bytes).unwrap();
        let mut lines = text.lines();
        assert!(
            lines.next().unwrap().ends_with(
                ",copy_bytes,tokens_per_s,data_wait_ms,mfu,data_cursor,eval_loss,eval_ppl"
            )
        );
        assert!(
            lines.next().unwrap().ends_with(",0,0,2000.0,1.5,0.25,,,"),
            "{text}"
        );
        assert!(
            lines.next().unwrap().ends_with(",2000.0,1.5,NaN,,,"),
            "{text}"
        );
        let back: Vec<StepRecord> = csv::Reader::from_reader(text.as_bytes())
            .deserialize()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(back[0], known);
        assert!(back[1].mfu.is_nan());
        assert_eq!((back[1].tokens_per_s, back[1].data_wait_ms), (2000.0, 1.5));

        // The header and a row of a steps.csv of the 15 columns before issue 31 item 5.
        let old = "step,t_s,loss,tokens,samples,live_nodes,used_nodes,plan_version,step_ms,\
                   expert_ms_max,expert_ms_mean,expert_tokens_max,expert_tokens_mean,sent_bytes,\
                   copy_bytes\n3,1.5,4.25,256,8,2,2,1,40.0,3.0,2.5,96,80.0,1024,0\n";
        let rows: Vec<StepRecord> = csv::Reader::from_reader(old.as_bytes())
            .deserialize()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            (rows[0].step, rows[0].tokens, rows[0].step_ms),
            (3, 256, 40.0)
        );
        assert!(rows[0].tokens_per_s.is_nan());
        assert!(rows[0].data_wait_ms.is_nan() && rows[0].mfu.is_nan());
        assert_eq!((rows[0].eval_loss, rows[0].eval_ppl), (None, None));
        // An empty field (a hand-edited file) is not a number either.
        let blank = text.replace(",NaN,,,\n", ",,,,\n");
        assert_ne!(blank, text);
        let rows: Vec<StepRecord> = csv::Reader::from_reader(blank.as_bytes())
            .deserialize()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(rows[1].mfu.is_nan() && rows[1].data_wait_ms == 1.5);
    }

    /// Issue 31 item 1: an evaluated step has its eval loss and perplexity in steps.csv (an
    /// empty field elsewhere, `NaN` for a diverged eval), in the log line and in the summary
    /// (the first and the last eval); a steps.csv written before the eval columns reads them
    /// as not evaluated.
    #[test]
    fn eval_columns_log_line_and_summary() {
        let evaluated = |step: u64, loss: f64| StepRecord {
            eval_loss: Some(loss),
            eval_ppl: Some(eval_ppl(loss)),
            ..rec(step, step as f64, 4.0)
        };
        let records = [
            rec(0, 0.0, 4.0),
            evaluated(1, 3.5),
            rec(2, 2.0, 4.0),
            evaluated(3, 3.25),
            evaluated(4, f64::NAN),
            rec(5, 5.0, 4.0),
        ];
        let path = Path::new("steps.csv");
        let text = String::from_utf8(csv_bytes(path, &STEP_COLUMNS, &records).unwrap()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        // The last two columns.
        assert!(lines[0].ends_with(",eval_loss,eval_ppl"), "{text}");
        assert!(lines[1].ends_with(",,"), "{text}");
        assert!(
            lines[2].ends_with(&format!(",3.5,{}", 3.5f64.exp())),
            "{text}"
        );
        assert!(lines[5].ends_with(",NaN,NaN"), "{text}");
        let back: Vec<StepRecord> = csv::Reader::from_reader(text.as_bytes())
            .deserialize()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(back[..4], records[..4]);
        assert!(back[4].eval_loss.is_some_and(f64::is_nan));

        let line = log_line(&records[1], 6, 16);
        assert!(
            line.ends_with(
                " | data wait (ms): 1.50 | MFU: 25.0% | eval loss: 3.500000E+00 | eval ppl: \
                 3.311545E+01 | live nodes: 4 | plan version: 1 |"
            ),
            "{line}"
        );
        assert!(!log_line(&records[0], 6, 8).contains("eval"));
        assert!(log_line(&records[4], 6, 8).contains("| eval loss: NAN | eval ppl: NAN |"));

        let s = summarize(
            &records,
            &[],
            6.0,
            serde_json::Value::Null,
            0,
            String::new(),
        );
        assert_eq!(s.first_eval_loss, Some(3.5));
        assert_eq!(s.first_eval_ppl, Some(3.5f64.exp()));
        assert!(s.final_eval_loss.is_some_and(f64::is_nan));
        let none = summarize(
            &records[..1],
            &[],
            1.0,
            serde_json::Value::Null,
            0,
            String::new(),
        );
        assert_eq!((none.first_eval_loss, none.final_eval_ppl), (None, None));
        let json = serde_json::to_value(&none).unwrap();
        assert!(json.get("final_eval_loss").is_none(), "{json}");
    }
}
