//! Hardware and model profiles: the constants the cost model runs on.
//!
//! Built-in profiles are TOML files under `simulator/profiles/`, embedded with
//! `include_str!`; every constant there carries a comment saying where it comes from. A
//! profile can also be read from any TOML file with the same fields ([`hardware`],
//! [`model`]). Unknown fields are rejected (typos would otherwise silently keep a default).

use crate::limits;
use anyhow::{Context, Result, bail};
use lazarus_planner::data::GlobalBatch;
use lazarus_planner::{ClusterSpec, ModelSpec};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::path::Path;

/// Built-in hardware profiles: `(name, TOML text)`.
const BUILTIN_HARDWARE: &[(&str, &str)] = &[
    (
        "rtx3090-100g",
        include_str!("../../profiles/hardware/rtx3090-100g.toml"),
    ),
    (
        "h200-400g",
        include_str!("../../profiles/hardware/h200-400g.toml"),
    ),
];

/// Built-in model profiles: `(name, TOML text)`.
const BUILTIN_MODELS: &[(&str, &str)] = &[
    ("gpt-s", include_str!("../../profiles/model/gpt-s.toml")),
    ("gpt-m", include_str!("../../profiles/model/gpt-m.toml")),
    ("gpt-l", include_str!("../../profiles/model/gpt-l.toml")),
    (
        "deepseek-v3",
        include_str!("../../profiles/model/deepseek-v3.toml"),
    ),
];

/// A cluster's hardware. Bandwidths are per direction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    pub name: String,
    /// GPUs per node (the failure unit). Rank `r` lives on node `r / gpus_per_node`.
    pub gpus_per_node: usize,
    /// How many simulated nodes share one physical NIC (the paper's testbed: 2 GPUs, each a
    /// simulated node, behind one 100 Gbps NIC). Defaults to 1.
    #[serde(default = "one_usize")]
    pub nic_shared_by_nodes: usize,
    /// FLOP/s one GPU achieves on the model's matmuls (peak × derating; see the profile).
    pub gpu_flops_effective: f64,
    pub gpu_memory_bytes: u64,
    /// Per GPU, between GPUs of the same node (NVLink / PCIe).
    pub intra_node_bandwidth_bytes_per_s: f64,
    /// Per node, over the network (all of the node's NICs together, at line rate).
    pub inter_node_bandwidth_bytes_per_s: f64,
    /// Fraction of line rate NCCL achieves, applied to both links.
    pub network_efficiency: f64,
    /// Aggregate bandwidth to the checkpoint store available to the job.
    pub checkpoint_bandwidth_bytes_per_s: f64,
    /// Time until queued collectives time out after a node failure.
    pub failure_detection_timeout_s: f64,
    /// Time to rebuild the communicators after a membership change.
    pub communicator_rebuild_s: f64,
    /// Time to relaunch the training processes, checkpoint loading excluded.
    pub process_restart_s: f64,
    /// Time from a node-add event until the node is usable.
    pub node_boot_s: f64,
    // --- Optional host terms, written by `lzrun calibrate` (absent in the built-in profiles,
    // which then cost exactly as before). See the `cost` module docs, "Calibrated profiles".
    /// Every node's ranks run on one host with this many cores (`lzrun local`): with more ranks
    /// than cores, each rank's compute (and `step_overhead_s`) takes `ranks / host_cores` times
    /// longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cores: Option<f64>,
    /// Per-step time of a rank besides its matmul FLOPs (optimizer, framework).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_overhead_s: Option<f64>,
    /// What every further rank adds to a step (collective messages, synchronisation):
    /// `step_per_peer_s · (ranks − 1)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_per_peer_s: Option<f64>,
    /// Failure detection that grows with the step time, in steps: detection takes
    /// `failure_detection_timeout_s + failure_detection_steps · step time` (on one host the
    /// messages that carry a failure wait for the cores the training steps keep busy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_detection_steps: Option<f64>,
    /// Detection, in steps, of every failure after the job's first (`failure_detection_steps`
    /// then times the first only). `lzrun local` sees the first failure of a job 2–4 steps
    /// after the kill and later ones within about one (results/sim-vs-real/README.md). Absent
    /// (profiles written before it was measured): `failure_detection_steps` for every failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_detection_steps_later: Option<f64>,
    /// The controller's replan, added to every reconfiguration and restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replan_s: Option<f64>,
    /// Expert-state migration bandwidth of a node (default: the node's network bandwidth,
    /// [`HardwareProfile::node_inter_bandwidth`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_transfer_bandwidth_bytes_per_s: Option<f64>,
    /// A launcher's start: from its launch to the first step, `job_start_s +
    /// job_start_per_node_s · nodes` (`lzsim predict` adds it to the replay's time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_start_s: Option<f64>,
    /// See `job_start_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_start_per_node_s: Option<f64>,
    /// A launcher's stop: from the last step to its exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_stop_s: Option<f64>,
}

fn one_usize() -> usize {
    1
}

fn two_u64() -> u64 {
    2
}

fn yes() -> bool {
    true
}

impl HardwareProfile {
    /// Achieved bytes/s of one rank to ranks on *other* nodes: the node's NIC bandwidth split
    /// over its GPUs and over the simulated nodes sharing the NIC, times the efficiency.
    pub fn rank_inter_bandwidth(&self) -> f64 {
        self.inter_node_bandwidth_bytes_per_s * self.network_efficiency
            / (self.gpus_per_node * self.nic_shared_by_nodes) as f64
    }

    /// Achieved bytes/s of one rank to ranks on the *same* node.
    pub fn rank_intra_bandwidth(&self) -> f64 {
        self.intra_node_bandwidth_bytes_per_s * self.network_efficiency
    }

    /// Achieved bytes/s of one whole node to other nodes (all its GPUs sending at once).
    pub fn node_inter_bandwidth(&self) -> f64 {
        self.inter_node_bandwidth_bytes_per_s * self.network_efficiency
            / self.nic_shared_by_nodes as f64
    }

    /// How many times longer a rank's compute takes on `ranks` ranks sharing the host's cores:
    /// `max(1, ranks / host_cores)`, 1 without `host_cores`.
    pub fn compute_share(&self, ranks: usize) -> f64 {
        self.host_cores.map_or(1.0, |c| (ranks as f64 / c).max(1.0))
    }

    /// The fixed and per-peer step costs of `ranks` ranks (0 without them):
    /// `compute_share · step_overhead_s + step_per_peer_s · (ranks − 1)`.
    pub fn step_fixed_s(&self, ranks: usize) -> f64 {
        self.compute_share(ranks) * self.step_overhead_s.unwrap_or(0.0)
            + self.step_per_peer_s.unwrap_or(0.0) * ranks.saturating_sub(1) as f64
    }

    /// Failure detection in steps of the job's first failure (`later` false) or of a later
    /// one: `failure_detection_steps`, or `failure_detection_steps_later` (the former when it
    /// is absent); 0 without either.
    pub fn detection_steps(&self, later: bool) -> f64 {
        let first = self.failure_detection_steps.unwrap_or(0.0);
        if later {
            self.failure_detection_steps_later.unwrap_or(first)
        } else {
            first
        }
    }

    /// Launcher start for `nodes` nodes (0 without the fields).
    pub fn job_start_s(&self, nodes: usize) -> f64 {
        self.job_start_s.unwrap_or(0.0) + self.job_start_per_node_s.unwrap_or(0.0) * nodes as f64
    }

    /// Node of rank `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.gpus_per_node
    }

    /// The planner's cluster for `nodes` nodes of this hardware running `model`: the node's
    /// slots are `slots_per_gpu × gpus_per_node`.
    pub fn cluster_spec(&self, model: &ModelProfile, nodes: usize) -> ClusterSpec {
        ClusterSpec::new(nodes, model.slots_per_gpu * self.gpus_per_node)
            .with_gpus_per_node(self.gpus_per_node)
    }

    fn validate(&self) -> Result<()> {
        positive_count("gpus_per_node", self.gpus_per_node)?;
        at_most(
            "gpus_per_node",
            self.gpus_per_node,
            limits::MAX_GPUS_PER_NODE,
        )?;
        positive_count("nic_shared_by_nodes", self.nic_shared_by_nodes)?;
        positive("gpu_flops_effective", self.gpu_flops_effective)?;
        positive_count("gpu_memory_bytes", self.gpu_memory_bytes)?;
        positive(
            "intra_node_bandwidth_bytes_per_s",
            self.intra_node_bandwidth_bytes_per_s,
        )?;
        positive(
            "inter_node_bandwidth_bytes_per_s",
            self.inter_node_bandwidth_bytes_per_s,
        )?;
        positive("network_efficiency", self.network_efficiency)?;
        if self.network_efficiency > 1.0 {
            bail!(
                "field `network_efficiency` must be in (0, 1], got {}",
                self.network_efficiency
            );
        }
        positive(
            "checkpoint_bandwidth_bytes_per_s",
            self.checkpoint_bandwidth_bytes_per_s,
        )?;
        non_negative(
            "failure_detection_timeout_s",
            self.failure_detection_timeout_s,
        )?;
        non_negative("communicator_rebuild_s", self.communicator_rebuild_s)?;
        non_negative("process_restart_s", self.process_restart_s)?;
        non_negative("node_boot_s", self.node_boot_s)?;
        if let Some(c) = self.host_cores {
            positive("host_cores", c)?;
        }
        if let Some(b) = self.state_transfer_bandwidth_bytes_per_s {
            positive("state_transfer_bandwidth_bytes_per_s", b)?;
        }
        for (field, v) in [
            ("step_overhead_s", self.step_overhead_s),
            ("step_per_peer_s", self.step_per_peer_s),
            ("replan_s", self.replan_s),
            ("failure_detection_steps", self.failure_detection_steps),
            (
                "failure_detection_steps_later",
                self.failure_detection_steps_later,
            ),
            ("job_start_s", self.job_start_s),
            ("job_start_per_node_s", self.job_start_per_node_s),
            ("job_stop_s", self.job_stop_s),
        ] {
            if let Some(v) = v {
                non_negative(field, v)?;
            }
        }
        Ok(())
    }
}

/// An MoE transformer. Parameter counts ignore biases, norms and position embeddings
/// (< 0.3 % of the parameters of every built-in model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    pub name: String,
    /// Transformer blocks.
    pub layers: usize,
    /// Blocks whose FFN is an MoE layer (the rest have a dense FFN).
    pub moe_layers: usize,
    pub d_model: u64,
    /// FFN hidden size of one routed expert.
    pub ffn_hidden: u64,
    /// FFN hidden size of the dense blocks; defaults to `ffn_hidden`.
    #[serde(default)]
    pub dense_ffn_hidden: Option<u64>,
    /// Weight matrices per FFN: 2 (GeLU MLP) or 3 (SwiGLU). Defaults to 2.
    #[serde(default = "two_u64")]
    pub ffn_matrices: u64,
    /// Attention parameters per block; defaults to `4·d²` (Q, K, V, O).
    #[serde(default)]
    pub attention_params_per_layer: Option<u64>,
    /// Per-token width of the attention-score matmuls (`heads·(d_qk + d_v)/2`); defaults to
    /// `d_model`.
    #[serde(default)]
    pub attention_score_width: Option<u64>,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Always-active experts per MoE layer (replicated, counted as dense). Defaults to 0.
    #[serde(default)]
    pub shared_experts: u64,
    pub top_k: usize,
    pub vocab: u64,
    /// Input embedding and LM head share one matrix. Defaults to true.
    #[serde(default = "yes")]
    pub tied_embeddings: bool,
    pub seq_len: u64,
    /// Sequences per GPU per step (without `global_batch`).
    pub batch_per_gpu: u64,
    /// A constant global batch (`lzrun --global-batch B --micro-batch M`; TOML
    /// `global_batch = { sequences = B, micro = M }`): every step trains `B` sequences whatever
    /// the ranks, cut into `K = B/M` micro-batches that the ranks share
    /// ([`lazarus_planner::data::share`]); every rank takes part in `⌈K/ranks⌉` micro-batch
    /// rounds ([`ModelProfile::rounds`]), so the busiest rank's work, which sets the
    /// synchronous step time, is `⌈K/ranks⌉·M` sequences ([`ModelProfile::sequences_per_rank`]);
    /// `batch_per_gpu` is then unused. Absent: every rank trains `batch_per_gpu` sequences (the global batch follows
    /// the ranks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<GlobalBatch>,
    /// Bytes per weight, gradient and activation element (fp16/bf16: 2).
    pub bytes_per_param_weights: u64,
    /// Bytes of weights + optimizer state per parameter (mixed-precision Adam: 14).
    pub bytes_per_param_state: u64,
    /// Weights + optimizer state of one expert replica (what migration moves).
    pub bytes_per_expert_state: u64,
    /// Expert-parallel group size of the standard-EP baselines (DS, DS(FT)).
    pub ep_size: usize,
    /// Expert-replica slots per GPU per MoE layer.
    pub slots_per_gpu: usize,
    /// Lazarus's minimum replicas per expert.
    pub f: usize,
}

impl ModelProfile {
    /// Parameters of one routed expert: `ffn_matrices · d · ffn_hidden` (2·d·ffn for GPT).
    pub fn expert_params(&self) -> u64 {
        self.ffn_matrices * self.d_model * self.ffn_hidden
    }

    /// Attention parameters of one block: the override, else `4·d²`.
    pub fn attention_params_per_layer(&self) -> u64 {
        self.attention_params_per_layer
            .unwrap_or(4 * self.d_model * self.d_model)
    }

    /// Dense (non-expert) parameters of one MoE block: attention + shared experts + the
    /// gate's `d·E` router.
    pub fn dense_params_per_moe_layer(&self) -> u64 {
        self.attention_params_per_layer()
            + self.shared_experts * self.expert_params()
            + self.d_model * self.experts as u64
    }

    /// Parameters of one dense (non-MoE) block: attention + a dense FFN.
    pub fn params_per_dense_layer(&self) -> u64 {
        self.attention_params_per_layer()
            + self.ffn_matrices * self.d_model * self.dense_ffn_hidden.unwrap_or(self.ffn_hidden)
    }

    /// Embedding parameters: `vocab·d`, twice when the LM head is untied.
    pub fn embedding_params(&self) -> u64 {
        let n = if self.tied_embeddings { 1 } else { 2 };
        n * self.vocab * self.d_model
    }

    /// Dense blocks' and MoE blocks' non-expert parameters, without embeddings.
    fn non_embedding_dense_params(&self) -> u64 {
        (self.layers - self.moe_layers) as u64 * self.params_per_dense_layer()
            + self.moe_layers as u64 * self.dense_params_per_moe_layer()
    }

    /// Parameters every rank replicates (data-parallel): everything but routed experts.
    pub fn dense_params(&self) -> u64 {
        self.non_embedding_dense_params() + self.embedding_params()
    }

    /// Routed-expert parameters of the whole model (one copy of each expert).
    pub fn routed_expert_params(&self) -> u64 {
        (self.moe_layers * self.experts) as u64 * self.expert_params()
    }

    pub fn total_params(&self) -> u64 {
        self.dense_params() + self.routed_expert_params()
    }

    /// Dense parameters that take part in a matmul per token: all but the input-embedding
    /// lookup (the LM head is a `d × vocab` matmul, tied or not).
    pub fn dense_matmul_params(&self) -> u64 {
        self.non_embedding_dense_params() + self.vocab * self.d_model
    }

    /// Sequences the busiest of `ranks` ranks trains per step: `batch_per_gpu`, or with a
    /// [`global_batch`](Self::global_batch) its micro-batch rounds times the micro-batch,
    /// `⌈K/ranks⌉·M` (ranks with fewer micro-batches run the last round without data).
    pub fn sequences_per_rank(&self, ranks: usize) -> u64 {
        match &self.global_batch {
            Some(b) => b.rounds(ranks) * b.micro,
            None => self.batch_per_gpu,
        }
    }

    /// Sequences trained per step on `ranks` ranks: `ranks · batch_per_gpu`, or the global
    /// batch `B` whatever `ranks`.
    pub fn sequences_per_step(&self, ranks: usize) -> u64 {
        match &self.global_batch {
            Some(b) => b.sequences,
            None => ranks as u64 * self.batch_per_gpu,
        }
    }

    /// Micro-batch rounds of a step on `ranks` ranks: `⌈K/ranks⌉` with a global batch, else 1.
    pub fn rounds(&self, ranks: usize) -> u64 {
        self.global_batch.map_or(1, |b| b.rounds(ranks))
    }

    /// This model as `ranks` ranks train it: with a global batch, a copy whose
    /// `batch_per_gpu` is the busiest rank's share ([`Self::sequences_per_rank`]), so every
    /// per-rank term of the cost model (tokens, routed assignments) follows the membership;
    /// without one, the model itself.
    pub fn at_ranks(&self, ranks: usize) -> Cow<'_, ModelProfile> {
        match &self.global_batch {
            Some(_) => Cow::Owned(ModelProfile {
                batch_per_gpu: self.sequences_per_rank(ranks),
                ..self.clone()
            }),
            None => Cow::Borrowed(self),
        }
    }

    /// Tokens one GPU processes per step: `batch_per_gpu · seq_len` (with a global batch,
    /// resolve the ranks first: [`Self::at_ranks`]).
    pub fn tokens_per_gpu(&self) -> u64 {
        self.batch_per_gpu * self.seq_len
    }

    /// Token→expert assignments one GPU routes per MoE layer per step: tokens × `top_k`.
    pub fn assignments_per_gpu(&self) -> u64 {
        self.tokens_per_gpu() * self.top_k as u64
    }

    /// Training FLOPs per token of the dense part: `6 · dense_matmul_params` (forward
    /// `2·params`, backward twice the forward) plus the attention-score matmuls,
    /// `12 · layers · seq_len · width` (forward `QKᵀ` and `AV`, `2·seq·width` each, ×3 for
    /// the backward; causal masking not exploited, as in Megatron-LM's FLOP formula).
    pub fn dense_train_flops_per_token(&self) -> f64 {
        let width = self.attention_score_width.unwrap_or(self.d_model);
        6.0 * self.dense_matmul_params() as f64
            + 12.0 * self.layers as f64 * self.seq_len as f64 * width as f64
    }

    /// Training FLOPs per token routed to one expert: `6 · expert_params`.
    pub fn expert_train_flops_per_assignment(&self) -> f64 {
        6.0 * self.expert_params() as f64
    }

    /// Bytes of one token's activation (`d` elements) on the wire.
    pub fn activation_bytes_per_token(&self) -> u64 {
        self.d_model * self.bytes_per_param_weights
    }

    /// Gradient bytes of the dense part (all-reduced every step).
    pub fn dense_grad_bytes(&self) -> u64 {
        self.dense_params() * self.bytes_per_param_weights
    }

    /// Gradient bytes of one expert replica.
    pub fn expert_grad_bytes(&self) -> u64 {
        self.expert_params() * self.bytes_per_param_weights
    }

    /// Weights + optimizer state of the dense part (one copy).
    pub fn dense_state_bytes(&self) -> u64 {
        self.dense_params() * self.bytes_per_param_state
    }

    /// A full checkpoint: the dense state once plus every routed expert's state once.
    pub fn checkpoint_bytes(&self) -> u64 {
        self.dense_state_bytes()
            + (self.moe_layers * self.experts) as u64 * self.bytes_per_expert_state
    }

    /// The planner's view of the model.
    pub fn planner_spec(&self) -> ModelSpec {
        ModelSpec {
            experts: self.experts,
            layers: self.moe_layers,
            f: self.f,
        }
    }

    fn validate(&self) -> Result<()> {
        positive_count("layers", self.layers)?;
        positive_count("moe_layers", self.moe_layers)?;
        at_most("moe_layers", self.moe_layers, limits::MAX_LAYERS)?;
        if self.moe_layers > self.layers {
            bail!(
                "field `moe_layers` ({}) exceeds `layers` ({})",
                self.moe_layers,
                self.layers
            );
        }
        positive_count("d_model", self.d_model)?;
        positive_count("ffn_hidden", self.ffn_hidden)?;
        if let Some(h) = self.dense_ffn_hidden {
            positive_count("dense_ffn_hidden", h)?;
        }
        if !(2..=3).contains(&self.ffn_matrices) {
            bail!(
                "field `ffn_matrices` must be 2 (MLP) or 3 (gated), got {}",
                self.ffn_matrices
            );
        }
        if let Some(a) = self.attention_params_per_layer {
            positive_count("attention_params_per_layer", a)?;
        }
        if let Some(w) = self.attention_score_width {
            positive_count("attention_score_width", w)?;
        }
        positive_count("experts", self.experts)?;
        at_most("experts", self.experts, limits::MAX_EXPERTS)?;
        positive_count("top_k", self.top_k)?;
        if self.top_k > self.experts {
            bail!(
                "field `top_k` ({}) exceeds `experts` ({})",
                self.top_k,
                self.experts
            );
        }
        positive_count("vocab", self.vocab)?;
        positive_count("seq_len", self.seq_len)?;
        positive_count("batch_per_gpu", self.batch_per_gpu)?;
        if let Some(b) = &self.global_batch {
            b.validate()
                .map_err(|e| anyhow::anyhow!("field `global_batch`: {e}"))?;
        }
        positive_count("bytes_per_param_weights", self.bytes_per_param_weights)?;
        positive_count("bytes_per_param_state", self.bytes_per_param_state)?;
        positive_count("bytes_per_expert_state", self.bytes_per_expert_state)?;
        positive_count("ep_size", self.ep_size)?;
        if !self.experts.is_multiple_of(self.ep_size) {
            bail!(
                "field `ep_size` ({}) must divide `experts` ({})",
                self.ep_size,
                self.experts
            );
        }
        positive_count("slots_per_gpu", self.slots_per_gpu)?;
        at_most(
            "slots_per_gpu",
            self.slots_per_gpu,
            limits::MAX_SLOTS_PER_NODE,
        )?;
        if self.slots_per_gpu < self.experts / self.ep_size {
            bail!(
                "field `slots_per_gpu` ({}) is below experts / ep_size ({}): standard EP would not fit",
                self.slots_per_gpu,
                self.experts / self.ep_size
            );
        }
        positive_count("f", self.f)?;
        at_most("f", self.f, limits::MAX_F)?;
        Ok(())
    }
}

fn positive(field: &str, v: f64) -> Result<()> {
    if !(v.is_finite() && v > 0.0) {
        bail!("field `{field}` must be a positive finite number, got {v}");
    }
    Ok(())
}

/// The command line's size limits ([`limits`]) hold for profiles too: a profile is as much
/// input as a flag.
fn at_most(field: &str, v: usize, max: usize) -> Result<()> {
    if v > max {
        bail!("field `{field}` must be at most {max}, got {v}");
    }
    Ok(())
}

fn non_negative(field: &str, v: f64) -> Result<()> {
    if !(v.is_finite() && v >= 0.0) {
        bail!("field `{field}` must be a finite number >= 0, got {v}");
    }
    Ok(())
}

fn positive_count<T: Copy + Default + PartialEq + std::fmt::Display>(
    field: &str,
    v: T,
) -> Result<()> {
    if v == T::default() {
        bail!("field `{field}` must be positive, got {v}");
    }
    Ok(())
}

/// Names of the built-in hardware profiles.
pub fn hardware_names() -> Vec<&'static str> {
    BUILTIN_HARDWARE.iter().map(|(n, _)| *n).collect()
}

/// Names of the built-in model profiles.
pub fn model_names() -> Vec<&'static str> {
    BUILTIN_MODELS.iter().map(|(n, _)| *n).collect()
}

/// A hardware profile: a built-in name (see [`hardware_names`]) or the path of a TOML file.
pub fn hardware(name_or_path: &str) -> Result<HardwareProfile> {
    let p: HardwareProfile = load("hardware", BUILTIN_HARDWARE, name_or_path)?;
    p.validate()
        .with_context(|| format!("hardware profile {name_or_path}"))?;
    Ok(p)
}

/// A model profile: a built-in name (see [`model_names`]) or the path of a TOML file.
pub fn model(name_or_path: &str) -> Result<ModelProfile> {
    let p: ModelProfile = load("model", BUILTIN_MODELS, name_or_path)?;
    p.validate()
        .with_context(|| format!("model profile {name_or_path}"))?;
    Ok(p)
}

/// A model profile from TOML text (`what` names it in errors).
pub fn model_from_toml(text: &str, what: &str) -> Result<ModelProfile> {
    let p: ModelProfile = toml::from_str(text).with_context(|| format!("model profile {what}"))?;
    p.validate()
        .with_context(|| format!("model profile {what}"))?;
    Ok(p)
}

/// Parses a built-in by name, else reads `name_or_path` as a file. A string that is neither
/// a built-in nor an existing file is reported with the list of built-ins.
fn load<T: serde::de::DeserializeOwned>(
    kind: &str,
    builtins: &[(&str, &str)],
    name_or_path: &str,
) -> Result<T> {
    if let Some((name, text)) = builtins.iter().find(|(n, _)| *n == name_or_path) {
        return toml::from_str(text)
            .with_context(|| format!("built-in {kind} profile {name} is malformed"));
    }
    let path = Path::new(name_or_path);
    if !path.is_file() {
        let names: Vec<&str> = builtins.iter().map(|(n, _)| *n).collect();
        bail!(
            "unknown {kind} profile {name_or_path:?}: not a built-in ({}) and not a file",
            names.join(", ")
        );
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {kind} profile {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("{kind} profile {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_load_and_validate() {
        for n in hardware_names() {
            let h = hardware(n).unwrap();
            assert_eq!(h.name, n);
        }
        for n in model_names() {
            let m = model(n).unwrap();
            assert_eq!(m.name, n);
        }
    }

    #[test]
    fn parameter_counts_match_the_papers() {
        // Table 1: 521M, 1.3B, 1.7B; DeepSeek-V3: 671B.
        let cases = [
            ("gpt-s", 521e6, 0.01),
            ("gpt-m", 1.3e9, 0.01),
            ("gpt-l", 1.7e9, 0.01),
            ("deepseek-v3", 671e9, 0.001),
        ];
        for (name, want, tol) in cases {
            let m = model(name).unwrap();
            let got = m.total_params() as f64;
            assert!(
                (got / want - 1.0).abs() < tol,
                "{name}: {got} params vs {want}"
            );
        }
    }

    #[test]
    fn expert_state_is_fourteen_bytes_per_param() {
        // §5.4: 63 MB (GPT-S) and 112 MB (GPT-L) per expert, which are MiB exactly.
        let s = model("gpt-s").unwrap();
        let l = model("gpt-l").unwrap();
        assert_eq!(s.bytes_per_expert_state, 63 << 20);
        assert_eq!(l.bytes_per_expert_state, 112 << 20);
        for n in model_names() {
            let m = model(n).unwrap();
            assert_eq!(
                m.bytes_per_expert_state,
                m.expert_params() * m.bytes_per_param_state,
                "{n}"
            );
        }
    }

    #[test]
    fn derived_quantities() {
        let m = model("gpt-s").unwrap();
        assert_eq!(m.expert_params(), 2 * 768 * 3072);
        assert_eq!(m.attention_params_per_layer(), 4 * 768 * 768);
        assert_eq!(m.tokens_per_gpu(), 4096);
        assert_eq!(m.assignments_per_gpu(), 4096);
        assert_eq!(m.activation_bytes_per_token(), 1536);
        assert_eq!(m.dense_matmul_params(), m.dense_params()); // tied: head = embedding
        let d = model("deepseek-v3").unwrap();
        assert_eq!(d.assignments_per_gpu(), 8 * 4096 * 8);
        assert_eq!(
            d.dense_matmul_params() + d.vocab * d.d_model,
            d.dense_params()
        );
        let spec = d.planner_spec();
        assert_eq!((spec.experts, spec.layers, spec.f), (256, 58, 2));
        let h = hardware("h200-400g").unwrap();
        assert_eq!(h.cluster_spec(&d, 4).total_slots(), 4 * 8 * 4);
        assert!((h.rank_inter_bandwidth() - 40e9).abs() < 1.0);
        let r = hardware("rtx3090-100g").unwrap();
        // 12.5 GB/s × 0.57 shared by the two GPUs of a server.
        assert!((r.rank_inter_bandwidth() - 3.5625e9).abs() < 1.0);
    }

    #[test]
    fn errors_name_the_problem() {
        let e = format!("{:#}", hardware("nope").unwrap_err());
        assert!(e.contains("rtx3090-100g") && e.contains("h200-400g"), "{e}");
        let e = format!("{:#}", model("gpt-xl").unwrap_err());
        assert!(e.contains("gpt-s") && e.contains("deepseek-v3"), "{e}");

        let dir = std::env::temp_dir().join(format!("lzsim-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Missing field.
        let bad = dir.join("bad.toml");
        let text = BUILTIN_HARDWARE[0]
            .1
            .replace("network_efficiency = 0.57", "");
        std::fs::write(&bad, text).unwrap();
        let e = format!("{:#}", hardware(bad.to_str().unwrap()).unwrap_err());
        assert!(
            e.contains("bad.toml") && e.contains("network_efficiency"),
            "{e}"
        );
        // Wrong type.
        let text = BUILTIN_MODELS[0]
            .1
            .replace("d_model = 768", "d_model = \"768\"");
        std::fs::write(&bad, text).unwrap();
        let e = format!("{:#}", model(bad.to_str().unwrap()).unwrap_err());
        assert!(e.contains("bad.toml") && e.contains("d_model"), "{e}");
        // Out of range.
        let text = BUILTIN_HARDWARE[0]
            .1
            .replace("network_efficiency = 0.57", "network_efficiency = 1.5");
        std::fs::write(&bad, text).unwrap();
        let e = format!("{:#}", hardware(bad.to_str().unwrap()).unwrap_err());
        assert!(
            e.contains("bad.toml") && e.contains("network_efficiency"),
            "{e}"
        );
        // A good file loads like the built-in.
        let good = dir.join("good.toml");
        std::fs::write(&good, BUILTIN_MODELS[2].1).unwrap();
        assert_eq!(
            model(good.to_str().unwrap()).unwrap(),
            model("gpt-l").unwrap()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
