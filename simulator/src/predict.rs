//! `lzsim predict`: replays a real `lzrun local --metrics-out RUN_DIR` run through the
//! simulator's `lazarus` system (the job state machine `lzrun`'s controller drives; for a
//! `--expert-mode fsep` run, `laer` with one copy of every shard and `lazarus-fsep` with more)
//! with a calibrated hardware profile (`lzrun calibrate`), and compares what was measured with what
//! the simulator predicts.
//!
//! # What is read
//!
//! `RUN_DIR/run.json` (the model, nodes, seed, steps, `f`, slots, checkpoint and rebalance
//! settings, the fault schedule and the launch timeline), `summary.json`, `steps.csv` and
//! `reconfigurations.jsonl`, and `routing.csv` when present. A missing or malformed file is a
//! [`RunDirError`] naming it.
//!
//! # How the run becomes a replay
//!
//! * The model profile is the run's model: every layer an MoE layer, `d_ff` per expert, two
//!   matrices per FFN, the LM head tied to the embedding, f32 weights (4 bytes) and
//!   f32 AdamW state (12 bytes per parameter), `batch` sequences per rank, the run's slots per
//!   node and `f`.
//! * A run with a global batch (`lzrun local --global-batch B --micro-batch M`: `run.json`'s
//!   `global_batch` and `micro_batch`, else `rules.global_batch`; absent in older runs) gives
//!   the profile its [`ModelProfile::global_batch`]: a step of `n` members trains `B` samples
//!   (as `steps.csv`'s `samples` records) and every per-rank term of its cost (dense and
//!   expert compute, routed tokens, all-to-all volumes) is the busiest member's share,
//!   `⌈K/n⌉·M` sequences with `K = B/M` (its micro-batch rounds: a member with fewer
//!   micro-batches runs the last round without data), instead of `batch`; so with `B = 16,
//!   M = 4` a 3-member step computes twice what a 4-member one does (on a calibrated host's
//!   shared cores, `max(1, n/cores)` times that, as for any step). The calibrated per-peer
//!   term (`step_per_peer_s`: the collectives' latency on loopback) is paid once per round,
//!   as every round runs the expert all-to-alls; the per-step term once per step. Recorded
//!   `step_ms` are not used by the prediction (only by the measured breakdown below), so
//!   nothing there is normalised by a batch.
//! * The initial nodes are added at time 0; the fault schedule becomes step events
//!   ([`crate::replay::StepEvent`]): a kill of launch index `i` or of a trace name removes that
//!   node once step `after_step` completed, a join adds a node that is ready `node_boot_s`
//!   later (joins while the job waits for nodes fire at once, as in `lzrun local`).
//! * Expert loads are the run's own (`routing.csv`: every step record's routed tokens per
//!   layer and expert): the job machine's routing history gets exactly what `lzrun`'s got,
//!   each time a step is counted (again after a rollback), and the cost model prices each
//!   step with its recorded loads; a run without `routing.csv` (older versions) is replayed
//!   with uniform loads. Checkpoints
//!   every `checkpoint.every_steps`, rebalances as configured, lazy scale-out wait 0 (as
//!   `lzrun` plans newcomers at once), a pause taking effect one step after the next
//!   boundary (`pause_lag_steps = 1`: `lzrun`'s members read a pause request when a step
//!   starts), stop after `steps` steps.
//! * Predicted wall time = the launcher's start (`job_start_s + job_start_per_node_s · N`) +
//!   the replay + the launcher's stop (`job_stop_s`); both are part of the predicted `idle`.
//!
//! # The measured time breakdown (seconds)
//!
//! * a step's wall time is the time since the previous step record when it follows the
//!   previous step on the same plan, else (the first step, the first after a reconfiguration)
//!   its own `step_ms` (the same rule as `lzrun calibrate`'s step times);
//! * `compute`: the wall time of the record that counts for each step (its last), less the
//!   checkpoint share below; `lost`: the same for records a later record of the same step
//!   replaced (rolled back by a restore, or redone);
//! * `checkpoint`: workers write their parts between steps, so a checkpoint shows as a longer
//!   step after it: for each step that follows a checkpoint (step index a multiple of the
//!   interval, right after the previous step on the same plan), its excess over the mean step
//!   of the same membership (steps that follow another and no checkpoint);
//! * `reconfigure`: in-place recoveries' `detect + replan + migrate` and joins' and
//!   rebalances' `replan + migrate` (their detection is the members finishing the step in
//!   flight, which counts as compute); `restore`: checkpoint restores' `detect + replan +
//!   migrate`; each reconfiguration's `resume_ms` is the first step after it, counted as
//!   compute;
//! * `idle`: the rest of the wall time (the launcher's start and stop, waiting for nodes).
//!
//! The predicted breakdown maps the simulator's: `compute`, `lost`, `checkpoint`,
//! `reconfigure` (+ `rebalance`), `restore` (= `restart`: detection, restore and checkpoint
//! read), `idle` (+ the launcher's start and stop).

use crate::cost::{self, HardwareProfile, ModelProfile};
use crate::replay::systems::SystemKind;
use crate::replay::{self, ReplayConfig, RunResult, Sample, StepEvent};
use crate::workload::{RecordedRouting, Workload};
use lazarus_planner::data::GlobalBatch;
use lazarus_traces::zipf::ZipfLoads;
use lazarus_traces::{NodeOp, Trace, TraceEvent};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Why a run directory cannot be predicted. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("run directory {0}: no such directory")]
    NotADirectory(PathBuf),
    #[error(
        "{0}: missing (is the run directory made by `lzrun local --metrics-out DIR` of this \
         version, which writes run.json, summary.json, steps.csv and reconfigurations.jsonl?)"
    )]
    Missing(PathBuf),
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {msg}")]
    Malformed { path: PathBuf, msg: String },
}

fn malformed(path: &Path, msg: impl std::fmt::Display) -> RunDirError {
    RunDirError::Malformed {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

/// The model config of an `lzrun` run (`lazarus_executor::model::MoeConfig`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RunModel {
    pub vocab: u64,
    pub d_model: u64,
    pub n_layers: usize,
    pub n_heads: u64,
    pub d_ff: u64,
    pub experts: usize,
    pub top_k: usize,
    pub seq_len: u64,
    pub batch: u64,
    /// The Hugging Face family's architecture (`lzrun --model-config`, issue 32); absent for
    /// the GPT-style model and in older runs.
    #[serde(default)]
    pub hf: Option<RunHf>,
}

/// The fields of `MoeConfig::hf` (`lazarus_executor::model::HfModel`) the profile needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RunHf {
    pub n_kv_heads: u64,
    pub head_dim: u64,
    pub tie_word_embeddings: bool,
    /// Intermediate size of the shared expert MLP (0: none).
    pub shared_ff: u64,
    /// DeepSeek-V3's multi-head latent attention (absent: grouped-query attention).
    #[serde(default)]
    pub mla: Option<RunMla>,
    /// Blocks with a dense MLP instead of an MoE layer (`model.n_layers` counts the MoE ones).
    #[serde(default)]
    pub dense_layers: Vec<usize>,
    /// Their MLP's intermediate size.
    #[serde(default)]
    pub dense_ff: u64,
}

/// The fields of `lazarus_executor::model::Mla` the profile needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RunMla {
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

impl RunMla {
    /// Weights of one layer's attention products and the mean width of its two score
    /// products (`QKᵀ` is `heads·(nope + rope)` wide, `AV` `heads·v`), as
    /// `lazarus_executor::model::model_flops_per_token` counts them.
    fn attention(&self, d: u64, heads: u64) -> (u64, u64) {
        let qk = self.qk_nope_head_dim + self.qk_rope_head_dim;
        let q = self
            .q_lora_rank
            .map_or(d * heads * qk, |r| d * r + r * heads * qk);
        let params = q
            + d * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            + heads * self.v_head_dim * d;
        (params, heads * (qk + self.v_head_dim) / 2)
    }
}

/// A fault of `lzrun`'s schedule (`lazarus_executor::faults::Fault`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub enum Fault {
    Kill {
        node: usize,
    },
    KillName {
        name: String,
    },
    Join {
        name: Option<String>,
    },
    /// `lzrun local --kill-controller` or `--storm`: not modelled (no node is lost).
    KillController,
    /// A SIGSTOPped worker (`--storm`): the node is lost, found by the heartbeat timeout.
    FreezeWorker {
        node: usize,
    },
    /// A SIGSTOPped agent (`--storm`): the node is lost, found by the heartbeat timeout.
    FreezeAgent {
        node: usize,
    },
    /// A full checkpoint disk for `steps` steps (`--storm`): not modelled.
    DiskFull {
        steps: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FaultEvent {
    pub after_step: u64,
    pub fault: Fault,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Faults {
    pub source: String,
    #[serde(default)]
    pub trace: Option<String>,
    #[serde(default)]
    pub time_scale_s_per_step: Option<f64>,
    pub events: Vec<FaultEvent>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CheckpointSettings {
    pub every_steps: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Timeline {
    /// Launch-relative seconds of the first step record (the origin of `steps.csv`'s `t_s`).
    pub first_step_s: Option<f64>,
}

/// `run.json` (the fields `predict` uses).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RunConfig {
    pub format: String,
    pub model: RunModel,
    pub expert_state_bytes: u64,
    pub nodes: usize,
    pub initial_names: Vec<String>,
    pub seed: u64,
    pub steps: u64,
    /// `lzrun --global-batch B` (absent in runs of older versions, `null` with
    /// `--batch-per-node`): B sequences per step, whatever the membership.
    #[serde(default)]
    pub global_batch: Option<u64>,
    /// `--micro-batch M` of a global batch.
    #[serde(default)]
    pub micro_batch: Option<u64>,
    pub fault_tolerance: usize,
    pub slots_per_node: usize,
    pub checkpoint: Option<CheckpointSettings>,
    pub rebalance_every_steps: u64,
    pub faults: Faults,
    pub timeline: Timeline,
    /// The job machine's configuration; only how the experts are stored is read (absent in
    /// runs of versions before FSEP: replicated).
    #[serde(default)]
    pub rules: RunRules,
}

/// The fields of `run.json`'s `rules` (`lazarus_planner::job::JobConfig`) that `predict` uses.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct RunRules {
    /// `lzrun --expert-mode fsep`: experts fully sharded over the members.
    #[serde(default)]
    pub sharded_experts: bool,
    /// Copies of every shard (`--shard-copies`; absent: 1).
    #[serde(default)]
    pub shard_copies: Option<usize>,
    /// The job machine's global batch (what the top-level `global_batch` and `micro_batch`
    /// say; read when they are absent).
    #[serde(default)]
    pub global_batch: Option<GlobalBatch>,
    /// `lzrun --recovery` (absent in runs of versions before issue 42: the replan).
    #[serde(default)]
    pub recovery: crate::replay::RecoveryPolicy,
}

impl RunConfig {
    /// The simulator system that runs like this run: `lazarus` for replicated experts; for
    /// sharded ones `laer` with one copy per shard (any loss restores) and `lazarus-fsep`
    /// with more (in-place repair).
    pub fn system(&self) -> SystemKind {
        match (self.rules.sharded_experts, self.shard_copies()) {
            (false, _) => SystemKind::Lazarus,
            (true, 1) => SystemKind::Laer,
            (true, _) => SystemKind::LazarusFsep,
        }
    }

    /// Copies of every shard of a sharded run (1 when not given).
    pub fn shard_copies(&self) -> usize {
        self.rules.shard_copies.unwrap_or(1).max(1)
    }

    /// The run's global batch: `global_batch` and `micro_batch` (the micro-batch defaulting
    /// as `lzrun` does: the model's `batch` when it divides B, else B), else the job
    /// machine's (`rules.global_batch`); `None`: every worker trained `model.batch`.
    pub fn global_batch(&self) -> Result<Option<GlobalBatch>, String> {
        let Some(b) = self.global_batch else {
            if self.micro_batch.is_some() {
                return Err("micro_batch without global_batch".into());
            }
            return Ok(self.rules.global_batch);
        };
        let micro = self
            .micro_batch
            .unwrap_or(if b.is_multiple_of(self.model.batch.max(1)) {
                self.model.batch
            } else {
                b
            });
        GlobalBatch::new(b, micro)
            .map(Some)
            .map_err(|e| format!("global_batch {b}, micro_batch {micro}: {e}"))
    }
}

/// `summary.json` (the fields `predict` uses).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RunSummary {
    pub steps: u64,
    pub recoveries: u64,
    pub fallbacks: u64,
    pub joins: u64,
    pub rebalances: u64,
    pub wall_s: f64,
}

/// A row of `steps.csv`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct StepRow {
    pub step: u64,
    pub t_s: f64,
    pub samples: u64,
    pub used_nodes: usize,
    pub plan_version: u64,
    pub step_ms: f64,
}

/// A line of `reconfigurations.jsonl`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ReconfigRow {
    pub kind: String,
    pub detect_ms: f64,
    pub replan_ms: f64,
    pub migrate_ms: f64,
}

/// A recorded run.
#[derive(Debug, Clone)]
pub struct RunDir {
    pub config: RunConfig,
    pub summary: RunSummary,
    pub steps: Vec<StepRow>,
    pub reconfigs: Vec<ReconfigRow>,
    /// `routing.csv`: each step record's routed tokens, in the order of `steps.csv` (`None`: a
    /// run of a version that did not record them).
    pub routing: Option<Vec<StepRouting>>,
}

/// One step record's routed tokens: `(step, [layer][expert])`.
pub type StepRouting = (u64, Vec<Vec<u64>>);

/// Reads `routing.csv` (`lazarus_executor::metrics::routing_csv`): header
/// `record,step,layer,e0,…`, one row per MoE layer of each step record.
fn parse_routing(
    path: &Path,
    text: &str,
    layers: usize,
    experts: usize,
) -> Result<Vec<StepRouting>, RunDirError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let header = lines.next().map_or("", |(_, l)| l);
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    if cols.len() < 3 || cols[..3] != ["record", "step", "layer"] {
        return Err(malformed(
            path,
            format!("header {header:?}, expected record,step,layer,e0,…"),
        ));
    }
    if cols.len() > 3 && cols.len() - 3 != experts {
        return Err(malformed(
            path,
            format!(
                "{} expert columns, the model has {experts} experts",
                cols.len() - 3
            ),
        ));
    }
    // record → (step, layers in order)
    let mut out: Vec<(u64, u64, Vec<Vec<u64>>)> = Vec::new();
    for (i, line) in lines {
        let bad = |msg: String| malformed(path, format!("line {}: {msg}", i + 1));
        let v: Vec<u64> = line
            .split(',')
            .map(|x| x.trim().parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|e| bad(e.to_string()))?;
        if v.len() != 3 + experts {
            return Err(bad(format!("{} fields, expected {}", v.len(), 3 + experts)));
        }
        let (record, step, layer) = (v[0], v[1], v[2]);
        match out.last_mut() {
            Some((r, s, rows)) if *r == record => {
                if *s != step || layer as usize != rows.len() {
                    return Err(bad(format!("record {record}: step or layer out of order")));
                }
                rows.push(v[3..].to_vec());
            }
            last => {
                if last.is_some_and(|(r, _, _)| *r >= record) || layer != 0 {
                    return Err(bad(format!("record {record}: records out of order")));
                }
                out.push((record, step, vec![v[3..].to_vec()]));
            }
        }
    }
    if let Some((r, _, rows)) = out.iter().find(|(_, _, rows)| rows.len() != layers) {
        return Err(malformed(
            path,
            format!(
                "record {r} has {} layers, the model has {layers}",
                rows.len()
            ),
        ));
    }
    Ok(out.into_iter().map(|(_, s, rows)| (s, rows)).collect())
}

fn read(path: &Path) -> Result<String, RunDirError> {
    if !path.is_file() {
        return Err(RunDirError::Missing(path.to_path_buf()));
    }
    std::fs::read_to_string(path).map_err(|source| RunDirError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl RunDir {
    /// Reads and checks a run directory.
    pub fn load(dir: &Path) -> Result<Self, RunDirError> {
        if !dir.is_dir() {
            return Err(RunDirError::NotADirectory(dir.to_path_buf()));
        }
        let path = dir.join("run.json");
        let config: RunConfig =
            serde_json::from_str(&read(&path)?).map_err(|e| malformed(&path, e))?;
        if config.format != "lzrun-run/1" {
            return Err(malformed(
                &path,
                format!("format {:?}, expected \"lzrun-run/1\"", config.format),
            ));
        }
        if config.nodes == 0 || config.initial_names.len() != config.nodes {
            return Err(malformed(
                &path,
                format!(
                    "{} initial nodes with {} names",
                    config.nodes,
                    config.initial_names.len()
                ),
            ));
        }
        if config.steps == 0 {
            return Err(malformed(&path, "steps is 0"));
        }
        if config.slots_per_node == 0 || config.fault_tolerance == 0 {
            return Err(malformed(
                &path,
                "slots_per_node and fault_tolerance must be >= 1",
            ));
        }
        config.global_batch().map_err(|e| malformed(&path, e))?;
        let path = dir.join("summary.json");
        let summary: RunSummary =
            serde_json::from_str(&read(&path)?).map_err(|e| malformed(&path, e))?;
        if !(summary.wall_s.is_finite() && summary.wall_s > 0.0) {
            return Err(malformed(&path, format!("wall_s is {}", summary.wall_s)));
        }
        let path = dir.join("steps.csv");
        let text = read(&path)?;
        let steps: Vec<StepRow> = csv::Reader::from_reader(text.as_bytes())
            .deserialize()
            .collect::<Result<_, _>>()
            .map_err(|e| malformed(&path, e))?;
        if steps.is_empty() {
            return Err(malformed(&path, "no step recorded"));
        }
        if let Some(r) = steps
            .iter()
            .find(|r| !(r.step_ms.is_finite() && r.step_ms >= 0.0))
        {
            return Err(malformed(
                &path,
                format!("step {} has step_ms {}", r.step, r.step_ms),
            ));
        }
        let path = dir.join("reconfigurations.jsonl");
        let text = read(&path)?;
        let reconfigs = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str::<ReconfigRow>(l)
                    .map_err(|e| malformed(&path, format!("line {}: {e}", i + 1)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let path = dir.join("routing.csv");
        let routing = if path.is_file() {
            let (layers, experts) = (config.model.n_layers, config.model.experts);
            Some(parse_routing(&path, &read(&path)?, layers, experts)?)
        } else {
            None
        };
        Ok(Self {
            config,
            summary,
            steps,
            reconfigs,
            routing,
        })
    }

    /// The simulator's model profile of the run's model (with the run's global batch).
    pub fn model_profile(&self) -> anyhow::Result<ModelProfile> {
        let m = &self.config.model;
        let global_batch = match self.config.global_batch().map_err(anyhow::Error::msg)? {
            Some(b) => format!(
                "global_batch = {{ sequences = {}, micro = {} }}\n",
                b.sequences, b.micro
            ),
            None => String::new(),
        };
        // A Hugging Face family: SwiGLU experts (3 matrices), grouped-query attention
        // (`d·(q + 2·kv) + q·d` weights, score width `heads·head_dim`) or DeepSeek's latent
        // attention ([`RunMla::attention`]), the shared expert as `shared_ff / d_ff`
        // always-active experts, the LM head untied unless tied.
        let arch = match &m.hf {
            Some(h) => {
                let (q, kv) = (m.n_heads * h.head_dim, h.n_kv_heads * h.head_dim);
                let (params, width) = match &h.mla {
                    Some(mla) => mla.attention(m.d_model, m.n_heads),
                    None => (m.d_model * (q + 2 * kv) + q * m.d_model, q),
                };
                format!(
                    "ffn_matrices = 3\nattention_params_per_layer = {params}\n\
                     attention_score_width = {width}\nshared_experts = {}\ntied_embeddings = {}\n",
                    h.shared_ff.div_ceil(m.d_ff.max(1)),
                    h.tie_word_embeddings
                )
            }
            None => "ffn_matrices = 2\nshared_experts = 0\ntied_embeddings = true\n".to_owned(),
        };
        // Dense blocks (a SwiGLU MLP of `dense_ff`) come before the MoE ones in the count.
        let (blocks, arch) = match &m.hf {
            Some(h) if !h.dense_layers.is_empty() => (
                m.n_layers + h.dense_layers.len(),
                format!("{arch}dense_ffn_hidden = {}\n", h.dense_ff),
            ),
            _ => (m.n_layers, arch),
        };
        let text = format!(
            "name = \"lzrun\"\nlayers = {blocks}\nmoe_layers = {l}\nd_model = {d}\nffn_hidden = {ff}\n\
             {arch}experts = {e}\ntop_k = {k}\nvocab = {v}\n\
             seq_len = {s}\nbatch_per_gpu = {b}\n\
             bytes_per_param_weights = 4\nbytes_per_param_state = 12\n\
             bytes_per_expert_state = {es}\nep_size = {e}\nslots_per_gpu = {slots}\nf = {f}\n\
             {global_batch}",
            l = m.n_layers,
            d = m.d_model,
            ff = m.d_ff,
            e = m.experts,
            k = m.top_k,
            v = m.vocab,
            s = m.seq_len,
            b = m.batch,
            es = self.config.expert_state_bytes,
            slots = self.config.slots_per_node,
            // lazarus-fsep takes its shard copies from the profile's f.
            f = if self.config.rules.sharded_experts {
                self.config.shard_copies()
            } else {
                self.config.fault_tolerance
            },
        );
        cost::model_from_toml(&text, "the model of run.json")
    }

    /// Node names in launch order: the initial nodes, then every join of the schedule (the
    /// executor names a join `n<index>` unless the trace names it).
    fn launch_names(&self) -> Vec<String> {
        let mut names = self.config.initial_names.clone();
        for ev in &self.config.faults.events {
            if let Fault::Join { name } = &ev.fault {
                let n = name.clone().unwrap_or_else(|| format!("n{}", names.len()));
                names.push(n);
            }
        }
        names
    }

    /// The fault schedule as step events (see the module docs).
    pub fn step_events(&self) -> Result<Vec<StepEvent>, RunDirError> {
        let names = self.launch_names();
        let mut out = Vec::new();
        for ev in &self.config.faults.events {
            let (op, node) = match &ev.fault {
                // Lost like a kill; the replay's detection delay is a kill's, not the
                // heartbeat timeout that finds a frozen process.
                Fault::Kill { node }
                | Fault::FreezeWorker { node }
                | Fault::FreezeAgent { node } => {
                    let name = names.get(*node).ok_or_else(|| RunDirError::Malformed {
                        path: PathBuf::from("run.json"),
                        msg: format!(
                            "the fault schedule kills node {node}, but only {} are launched",
                            names.len()
                        ),
                    })?;
                    (NodeOp::Remove, name.clone())
                }
                Fault::KillName { name } => (NodeOp::Remove, name.clone()),
                Fault::Join { .. } => (NodeOp::Add, String::new()),
                Fault::KillController | Fault::DiskFull { .. } => {
                    return Err(RunDirError::Malformed {
                        path: PathBuf::from("run.json"),
                        msg: format!(
                            "the fault schedule has a {} after step {}, which `lzsim predict` \
                             does not model (it predicts runs of kills, joins and traces)",
                            if ev.fault == Fault::KillController {
                                "controller kill"
                            } else {
                                "full checkpoint disk"
                            },
                            ev.after_step
                        ),
                    });
                }
            };
            out.push(StepEvent {
                after_step: ev.after_step,
                op,
                node,
            });
        }
        // Joins take their launch names in order.
        let mut joins = names[self.config.nodes..].iter();
        for e in out.iter_mut().filter(|e| e.op == NodeOp::Add) {
            e.node = joins.next().cloned().unwrap_or_default();
        }
        Ok(out)
    }

    /// Samples of the records that count (the last record of each step).
    pub fn counted_samples(&self) -> u64 {
        let mut last: BTreeMap<u64, u64> = BTreeMap::new();
        for r in &self.steps {
            last.insert(r.step, r.samples);
        }
        last.values().sum()
    }

    /// The measured time breakdown (module docs).
    pub fn measured_breakdown(&self) -> Breakdown {
        let mut last: BTreeMap<u64, usize> = BTreeMap::new();
        for (i, r) in self.steps.iter().enumerate() {
            last.insert(r.step, i);
        }
        let every = self.config.checkpoint.as_ref().map_or(0, |c| c.every_steps);
        // Wall seconds of each step: since the previous record when it follows the previous
        // step on the same plan, else its own step_ms; and whether a checkpoint precedes it.
        let dur: Vec<(f64, bool, bool)> = (0..self.steps.len())
            .map(|i| {
                let r = &self.steps[i];
                let follows = i > 0 && {
                    let p = &self.steps[i - 1];
                    p.step + 1 == r.step && p.plan_version == r.plan_version
                };
                let d = if follows {
                    r.t_s - self.steps[i - 1].t_s
                } else {
                    r.step_ms / 1e3
                };
                let after_ckpt = every > 0 && r.step > 0 && r.step.is_multiple_of(every);
                (d.max(0.0), follows, after_ckpt)
            })
            .collect();
        let mut base: BTreeMap<usize, (f64, usize)> = BTreeMap::new();
        for (r, &(d, follows, after_ckpt)) in self.steps.iter().zip(&dur) {
            if follows && !after_ckpt {
                let e = base.entry(r.used_nodes).or_default();
                e.0 += d;
                e.1 += 1;
            }
        }
        let mut b = Breakdown::default();
        for (i, (r, &(d, follows, after_ckpt))) in self.steps.iter().zip(&dur).enumerate() {
            let mut d = d;
            if follows
                && after_ckpt
                && let Some(&(sum, n)) = base.get(&r.used_nodes)
            {
                let excess = (d - sum / n as f64).max(0.0);
                b.checkpoint_s += excess;
                d -= excess;
            }
            if last.get(&r.step) == Some(&i) {
                b.compute_s += d;
            } else {
                b.lost_s += d;
            }
        }
        for r in &self.reconfigs {
            let s = (r.detect_ms + r.replan_ms + r.migrate_ms) / 1e3;
            match r.kind.as_str() {
                "in-place" => b.reconfigure_s += s,
                "checkpoint" => b.restore_s += s,
                "join" | "rebalance" => b.reconfigure_s += (r.replan_ms + r.migrate_ms) / 1e3,
                _ => {} // the start: part of the launcher's start (idle)
            }
        }
        let busy = b.compute_s + b.lost_s + b.checkpoint_s + b.reconfigure_s + b.restore_s;
        b.idle_s = (self.summary.wall_s - busy).max(0.0);
        b
    }

    /// What was measured.
    pub fn measured(&self) -> Outcome {
        Outcome {
            wall_s: self.summary.wall_s,
            steps: self.summary.steps,
            samples: self.counted_samples(),
            recoveries: self.summary.recoveries,
            fallbacks: self.summary.fallbacks,
            joins: self.summary.joins,
            rebalances: self.summary.rebalances,
            time: self.measured_breakdown(),
        }
    }
}

/// Seconds per activity; they add up to the wall time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Breakdown {
    pub compute_s: f64,
    pub checkpoint_s: f64,
    pub reconfigure_s: f64,
    pub restore_s: f64,
    pub lost_s: f64,
    pub idle_s: f64,
}

/// A run's totals, measured or predicted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub wall_s: f64,
    pub steps: u64,
    pub samples: u64,
    pub recoveries: u64,
    pub fallbacks: u64,
    pub joins: u64,
    pub rebalances: u64,
    pub time: Breakdown,
}

/// The compared quantities, in output order.
pub const KEYS: [&str; 13] = [
    "wall_s",
    "steps",
    "samples",
    "recoveries",
    "fallbacks",
    "joins",
    "rebalances",
    "compute_s",
    "checkpoint_s",
    "reconfigure_s",
    "restore_s",
    "lost_s",
    "idle_s",
];

impl Outcome {
    /// `(key, value)` in [`KEYS`] order.
    pub fn values(&self) -> Vec<(&'static str, f64)> {
        let t = &self.time;
        let v = [
            self.wall_s,
            self.steps as f64,
            self.samples as f64,
            self.recoveries as f64,
            self.fallbacks as f64,
            self.joins as f64,
            self.rebalances as f64,
            t.compute_s,
            t.checkpoint_s,
            t.reconfigure_s,
            t.restore_s,
            t.lost_s,
            t.idle_s,
        ];
        KEYS.into_iter().zip(v).collect()
    }

    fn json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (k, v) in self.values() {
            let value = if k.ends_with("_s") {
                serde_json::json!(round6(v))
            } else {
                serde_json::json!(v as u64)
            };
            m.insert(k.to_string(), value);
        }
        serde_json::Value::Object(m)
    }
}

/// Rounded to the microsecond (and relative errors to 1e-6), so the output does not depend
/// on the last bits of a sum's order.
fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// `(predicted − measured) / measured`; `None` when measured is 0 (0 when both are).
pub fn relative_error(measured: f64, predicted: f64) -> Option<f64> {
    if measured == 0.0 {
        (predicted == 0.0).then_some(0.0)
    } else {
        Some((predicted - measured) / measured)
    }
}

/// A prediction of a recorded run.
#[derive(Debug, Clone)]
pub struct Prediction {
    pub measured: Outcome,
    pub predicted: Outcome,
    /// The replay (its time series starts at the first step, `start_s` after the launch).
    pub replay: RunResult,
    /// The launcher's start the prediction adds before the replay.
    pub start_s: f64,
    /// Launch-relative seconds of the first step record of the run (if recorded).
    pub measured_first_step_s: Option<f64>,
}

/// Replays `run` on `hw` (see the module docs).
pub fn predict(run: &RunDir, hw: &HardwareProfile) -> anyhow::Result<Prediction> {
    let model = run.model_profile()?;
    let c = &run.config;
    let events: Vec<TraceEvent> = c
        .initial_names
        .iter()
        .map(|n| TraceEvent::add(0, n.clone()))
        .collect();
    let trace = Trace::new(events)?;
    let workload = match &run.routing {
        Some(records) => Workload::Recorded(RecordedRouting::new(
            model.moe_layers,
            model.experts,
            records.clone(),
        )),
        None => Workload::Zipf(ZipfLoads::new(0.0, model.experts, model.moe_layers, c.seed)),
    };
    let wall = run.summary.wall_s;
    // Far enough for any plausible replay, and bounded: a replay that never reaches the
    // run's steps (it waits for nodes the schedule never brings) stops there.
    let end_ms = ((wall * 100.0).clamp(60.0, 86_400.0) * 1e3) as u64;
    let cfg = ReplayConfig {
        hardware: hw.clone(),
        model,
        checkpoint_every_steps: c
            .checkpoint
            .as_ref()
            .map(|k| k.every_steps)
            .filter(|&k| k > 0),
        rebalance_every_steps: (c.rebalance_every_steps > 0).then_some(c.rebalance_every_steps),
        load_window_steps: 200,
        scale_out_wait_s: 0.0,
        node_boot_s: hw.node_boot_s,
        end_ms: Some(end_ms),
        sample_every_s: (wall / 200.0).max(1e-3),
        step_events: run.step_events()?,
        end_after_steps: Some(c.steps),
        pause_lag_steps: 1,
        recovery: c.rules.recovery,
    };
    let result = replay::run(&cfg, c.system(), &trace, &workload, true, None)?;
    let s = &result.summary;
    let start_s = hw.job_start_s(c.nodes);
    let stop_s = hw.job_stop_s.unwrap_or(0.0);
    let t = s.time;
    let predicted = Outcome {
        wall_s: start_s + s.duration_s + stop_s,
        steps: s.steps,
        samples: s.samples,
        recoveries: s.recoveries,
        fallbacks: s.fallbacks,
        joins: s.scale_outs,
        rebalances: s.rebalances,
        time: Breakdown {
            compute_s: t.compute,
            checkpoint_s: t.checkpoint,
            reconfigure_s: t.reconfigure + t.rebalance,
            restore_s: t.restart,
            lost_s: t.lost,
            idle_s: t.idle + start_s + stop_s,
        },
    };
    Ok(Prediction {
        measured: run.measured(),
        predicted,
        replay: result,
        start_s,
        measured_first_step_s: c.timeline.first_step_s,
    })
}

impl Prediction {
    /// `{"measured": {…}, "predicted": {…}, "relative_error": {…}}` (errors `null` where
    /// the measured value is 0 and the predicted one is not).
    pub fn json(&self) -> serde_json::Value {
        let mut err = serde_json::Map::new();
        for ((k, m), (_, p)) in self
            .measured
            .values()
            .into_iter()
            .zip(self.predicted.values())
        {
            let e = relative_error(m, p).map(round6);
            err.insert(k.to_string(), serde_json::json!(e));
        }
        serde_json::json!({
            "measured": self.measured.json(),
            "predicted": self.predicted.json(),
            "relative_error": serde_json::Value::Object(err),
        })
    }

    /// The side-by-side table.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<16} {:>12} {:>12} {:>9}",
            "", "measured", "predicted", "error"
        );
        for ((k, m), (_, p)) in self
            .measured
            .values()
            .into_iter()
            .zip(self.predicted.values())
        {
            if k == "compute_s" {
                let _ = writeln!(s, "time breakdown (s):");
            }
            let e =
                relative_error(m, p).map_or("-".to_string(), |e| format!("{:+.1} %", 100.0 * e));
            let label = if k.ends_with("_s") && k != "wall_s" {
                format!("  {}", k.trim_end_matches("_s"))
            } else {
                k.to_string()
            };
            if k.ends_with("_s") {
                let _ = writeln!(s, "{label:<16} {m:>12.3} {p:>12.3} {e:>9}");
            } else {
                let _ = writeln!(s, "{label:<16} {m:>12.0} {p:>12.0} {e:>9}");
            }
        }
        s
    }

    /// The replay's time series with `t_s` from the launch (the replay starts `start_s` in).
    pub fn predicted_timeseries(&self) -> Vec<Sample> {
        self.replay
            .timeseries
            .iter()
            .map(|x| Sample {
                t_s: round6(x.t_s + self.start_s),
                ..x.clone()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recorded `lzrun` runs and the profile calibrated with them: the fixtures of the
    /// workspace's cross-crate tests (`tests/fixtures/`, package `lazarus-tests`).
    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

    /// The recorded `run-kill-join` fixture (4 nodes of the tiny model, batch 8, 4 experts).
    fn fixture() -> RunDir {
        RunDir::load(&Path::new(FIXTURES).join("run-kill-join")).unwrap()
    }

    /// `ranks` ranks of one GPU each, expert `e` on rank `e mod ranks`, uniform loads.
    fn step(hw: &HardwareProfile, model: &ModelProfile, ranks: usize) -> cost::StepCost {
        let replicas: Vec<Vec<Vec<u32>>> = (0..model.moe_layers)
            .map(|_| {
                (0..model.experts)
                    .map(|e| (0..ranks).map(|r| u32::from(e % ranks == r)).collect())
                    .collect()
            })
            .collect();
        let loads = vec![vec![1u64; model.experts]; model.moe_layers];
        let input = cost::StepInput {
            gpus: ranks,
            replicas_per_rank: &replicas,
            loads: &loads,
            dispatch: cost::Dispatch::Unpadded,
            ep_groups: None,
        };
        cost::step_cost(hw, model, &input).unwrap()
    }

    /// One core per rank: only the busiest rank's share counts.
    fn dedicated_hw() -> HardwareProfile {
        let profile = Path::new(FIXTURES).join("lzrun-local-hardware.toml");
        let mut hw = cost::hardware(profile.to_str().unwrap()).unwrap();
        hw.host_cores = None;
        hw
    }

    #[test]
    fn predict_reads_the_global_batch_of_run_json_and_old_files_have_none() {
        let mut run = fixture();
        assert_eq!(
            run.config.global_batch, None,
            "a run.json of an older version"
        );
        assert_eq!(run.config.global_batch().unwrap(), None);
        assert_eq!(run.model_profile().unwrap().global_batch, None);
        run.config.global_batch = Some(16);
        run.config.micro_batch = Some(4);
        let want = GlobalBatch::new(16, 4).unwrap();
        assert_eq!(run.config.global_batch().unwrap(), Some(want));
        assert_eq!(run.model_profile().unwrap().global_batch, Some(want));
        // The micro-batch defaults as in `lzrun`: the model's batch (8) when it divides B.
        run.config.micro_batch = None;
        assert_eq!(run.config.global_batch().unwrap().unwrap().micro, 8);
        run.config.global_batch = Some(12);
        assert_eq!(run.config.global_batch().unwrap().unwrap().micro, 12);
        // The job machine's copy when the top-level keys are absent.
        run.config.global_batch = None;
        run.config.rules.global_batch = Some(want);
        assert_eq!(run.config.global_batch().unwrap(), Some(want));
        // Inconsistent numbers are an error naming them.
        run.config.global_batch = Some(10);
        run.config.micro_batch = Some(4);
        let e = run.config.global_batch().unwrap_err();
        assert!(e.contains("global_batch 10, micro_batch 4"), "{e}");
    }

    /// Issue 32: a run of a Hugging Face family (`model.hf` in run.json) is profiled with
    /// SwiGLU experts (`3·d·ff`), its grouped-query attention and shared expert, and its
    /// untied head; a GPT run (no `hf`) keeps the 2-matrix, `4·d²`, tied profile.
    #[test]
    fn predict_profiles_a_hugging_face_family_from_run_json() {
        let mut run = fixture();
        let gpt = run.model_profile().unwrap();
        assert_eq!(gpt.ffn_matrices, 2);
        assert_eq!(gpt.shared_experts, 0);
        assert!(gpt.tied_embeddings);
        let m = &mut run.config.model;
        let (d, ff, heads) = (m.d_model, m.d_ff, m.n_heads);
        m.hf = Some(RunHf {
            n_kv_heads: 1,
            head_dim: 8,
            tie_word_embeddings: false,
            shared_ff: 2 * ff,
            mla: None,
            dense_layers: Vec::new(),
            dense_ff: 0,
        });
        let p = run.model_profile().unwrap();
        assert_eq!(p.ffn_matrices, 3);
        assert_eq!(p.expert_params(), 3 * d * ff);
        assert_eq!(p.shared_experts, 2);
        assert!(!p.tied_embeddings);
        let (q, kv) = (heads * 8, 8);
        assert_eq!(p.attention_params_per_layer(), d * (q + 2 * kv) + q * d);
        // DeepSeek's latent attention, by hand: q 32·d + 32·heads·(8 + 4), kv_a d·(16 + 4),
        // kv_b 16·heads·(8 + 8), o heads·8·d; scores heads·(12 + 8)/2 wide.
        run.config.model.hf.as_mut().unwrap().mla = Some(RunMla {
            q_lora_rank: Some(32),
            kv_lora_rank: 16,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 4,
            v_head_dim: 8,
        });
        let p = run.model_profile().unwrap();
        assert_eq!(
            p.attention_params_per_layer(),
            32 * d + 32 * heads * 12 + d * 20 + 16 * heads * 16 + heads * 8 * d
        );
        assert_eq!(p.attention_score_width, Some(heads * 10));
        // A dense first block with an MLP of 64: one more block, not one more MoE layer.
        let hf = run.config.model.hf.as_mut().unwrap();
        hf.dense_layers = vec![0];
        hf.dense_ff = 64;
        let p = run.model_profile().unwrap();
        let moe = run.config.model.n_layers;
        assert_eq!((p.layers, p.moe_layers), (moe + 1, moe));
        assert_eq!(
            p.params_per_dense_layer(),
            p.attention_params_per_layer() + 3 * d * 64
        );
    }

    /// B = 16 in micro-batches of 4: 4 ranks train one round of 4 sequences, 3 ranks two
    /// rounds (8 sequences: the ranks with one micro-batch run the second without data), so
    /// a step of 3 costs twice the compute of a step of 4; 16 sequences either way. With
    /// `--batch-per-node` every rank trains `batch` = 8 whatever the ranks.
    #[test]
    fn predict_prices_a_global_batch_at_the_members_share() {
        let mut run = fixture();
        let hw = dedicated_hw();
        let per_node = run.model_profile().unwrap();
        run.config.global_batch = Some(16);
        run.config.micro_batch = Some(4);
        let global = run.model_profile().unwrap();

        assert_eq!(
            [4, 3, 2, 1, 16].map(|n| global.sequences_per_rank(n)),
            [4, 8, 8, 16, 4]
        );
        assert_eq!([4, 3, 1].map(|n| global.rounds(n)), [1, 2, 4]);
        assert_eq!(per_node.sequences_per_rank(3), 8);
        assert_eq!(per_node.rounds(3), 1);

        let (g4, g3) = (step(&hw, &global, 4), step(&hw, &global, 3));
        assert_eq!((g4.samples, g3.samples), (16, 16));
        assert_eq!(g3.dense_compute_s, 2.0 * g4.dense_compute_s);
        let ratio = g3.expert_compute_s / g4.expert_compute_s;
        // Twice the tokens per rank; with 3 ranks one holds two of the 4 experts, so the
        // busiest rank processes half the assignments instead of a quarter: up to 4×.
        assert!((2.0..=4.0).contains(&ratio), "expert compute ratio {ratio}");
        let compute = |c: &cost::StepCost| c.dense_compute_s + c.expert_compute_s;
        let r = compute(&g3) / compute(&g4);
        assert!((2.0..=4.0).contains(&r), "compute ratio {r}");
        // The 4-rank step of B = 16 (4 sequences per rank) is half the per-node batch of 8.
        let p4 = step(&hw, &per_node, 4);
        assert_eq!(p4.dense_compute_s, 2.0 * g4.dense_compute_s);

        // --batch-per-node: unchanged, 8 sequences per rank at any membership.
        let p3 = step(&hw, &per_node, 3);
        assert_eq!((p4.samples, p3.samples), (32, 24));
        assert_eq!(p3.dense_compute_s, p4.dense_compute_s);
        let tokens = 8 * per_node.seq_len;
        assert_eq!(per_node.tokens_per_gpu(), tokens);
        let dense = tokens as f64 * per_node.dense_train_flops_per_token() / hw.gpu_flops_effective;
        assert_eq!(p3.dense_compute_s, dense);
        // The global batch's tokens per second count B sequences.
        let t = (16 * global.seq_len) as f64 / g3.total_s;
        assert_eq!(g3.tokens_per_s, t);
    }

    /// On a calibrated host (2 shared cores, a per-peer latency): the busiest rank's share
    /// times `max(1, ranks/cores)` (3 ranks: 8 sequences × 1.5; 4 ranks: 4 × 2), and the
    /// per-peer latency once per micro-batch round (3 ranks: 2 rounds of 2 peers).
    #[test]
    fn predict_on_shared_cores_pays_the_peers_once_per_round() {
        let mut run = fixture();
        let mut hw = dedicated_hw();
        hw.host_cores = Some(2.0);
        let peer = hw.step_per_peer_s.unwrap();
        assert!(peer > 0.0);
        let per_node = run.model_profile().unwrap();
        run.config.global_batch = Some(16);
        run.config.micro_batch = Some(4);
        let global = run.model_profile().unwrap();
        let (g4, g3) = (step(&hw, &global, 4), step(&hw, &global, 3));
        let r = g3.dense_compute_s / g4.dense_compute_s;
        assert!((r - 1.5).abs() < 1e-12, "dense ratio {r}");
        let fixed = |n: usize| hw.step_fixed_s(n);
        assert!((g4.host_overhead_s - fixed(4)).abs() < 1e-15);
        assert!((g3.host_overhead_s - (fixed(3) + 2.0 * peer)).abs() < 1e-15);
        // Per node: one round whatever the ranks.
        let (p4, p3) = (step(&hw, &per_node, 4), step(&hw, &per_node, 3));
        assert_eq!(
            (p4.host_overhead_s, p3.host_overhead_s),
            (fixed(4), fixed(3))
        );
        let r = p4.dense_compute_s / p3.dense_compute_s;
        assert!((r - 2.0 / 1.5).abs() < 1e-12, "per-node ratio {r}");
    }

    /// The replay of a global-batch run counts B samples per step and prices a 3-member
    /// step above a 4-member one.
    #[test]
    fn predict_replays_a_global_batch_run_with_b_samples_per_step() {
        let mut run = fixture();
        run.config.global_batch = Some(16);
        run.config.micro_batch = Some(4);
        let hw = dedicated_hw();
        let p = predict(&run, &hw).unwrap();
        assert_eq!(p.predicted.steps, run.config.steps);
        assert_eq!(p.predicted.samples, 16 * p.predicted.steps);
    }

    #[test]
    fn relative_errors() {
        assert_eq!(relative_error(2.0, 3.0), Some(0.5));
        assert_eq!(relative_error(0.0, 0.0), Some(0.0));
        assert_eq!(relative_error(0.0, 1.0), None);
    }
}

/// One point of a throughput-over-time curve: seconds since the launch, samples per second,
/// samples trained so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub t_s: f64,
    pub throughput: f64,
    pub samples: f64,
}

/// A row of the run's `timeseries.csv` (the simulator's columns).
#[derive(Debug, Clone, Deserialize)]
struct MeasuredRow {
    t_s: f64,
    samples: u64,
    throughput_samples_per_s: f64,
}

/// The run's measured curve from `RUN_DIR/timeseries.csv`, shifted to launch-relative time by
/// `timeline.first_step_s` (the first row is the first step's completion).
pub fn measured_curve(dir: &Path, run: &RunDir) -> Result<Vec<Point>, RunDirError> {
    let path = dir.join("timeseries.csv");
    let text = read(&path)?;
    let rows: Vec<MeasuredRow> = csv::Reader::from_reader(text.as_bytes())
        .deserialize()
        .collect::<Result<_, _>>()
        .map_err(|e| malformed(&path, e))?;
    let origin = run.config.timeline.first_step_s.unwrap_or(0.0);
    Ok(rows
        .iter()
        .map(|r| Point {
            t_s: r.t_s + origin,
            throughput: r.throughput_samples_per_s,
            samples: r.samples as f64,
        })
        .collect())
}

impl Prediction {
    /// The predicted curve (launch-relative).
    pub fn predicted_curve(&self) -> Vec<Point> {
        self.predicted_timeseries()
            .iter()
            .map(|s| Point {
                t_s: s.t_s,
                throughput: s.throughput_samples_per_s,
                samples: s.samples as f64,
            })
            .collect()
    }
}

/// `overlay.svg`: measured and predicted throughput over time (top) and samples trained (bottom).
pub fn overlay_chart(
    path: &Path,
    title: &str,
    measured: &[Point],
    predicted: &[Point],
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    crate::plot::register_font();
    let root = SVGBackend::new(path, (1000, 720)).into_drawing_area();
    let e = |x: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("{}: {x:?}", path.display());
    root.fill(&WHITE).map_err(e)?;
    let (top, bottom) = root.split_vertically(360);
    let all = || measured.iter().chain(predicted);
    let t_max = all().map(|p| p.t_s).fold(1.0, f64::max) * 1.02;
    let thr_max = all().map(|p| p.throughput).fold(1.0, f64::max) * 1.15;
    let s_max = all().map(|p| p.samples).fold(1.0, f64::max) * 1.1;
    let series = [
        ("measured (lzrun local)", measured, crate::plot::COLORS[0]),
        (
            "predicted (lzsim predict)",
            predicted,
            crate::plot::COLORS[1],
        ),
    ];
    for (area, y_max, throughput) in [(&top, thr_max, true), (&bottom, s_max, false)] {
        let caption = if throughput {
            format!("throughput — {title}")
        } else {
            "samples trained".to_string()
        };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("seconds since launch")
            .y_desc(if throughput { "samples / s" } else { "samples" })
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(e)?;
        for (label, pts, color) in &series {
            let color = *color;
            chart
                .draw_series(LineSeries::new(
                    pts.iter()
                        .map(|p| (p.t_s, if throughput { p.throughput } else { p.samples })),
                    color.stroke_width(2),
                ))
                .map_err(e)?
                .label(*label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}
