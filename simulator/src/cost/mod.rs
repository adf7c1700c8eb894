//! The simulator's cost model: how long a training step, a checkpoint, a restart and a
//! reconfiguration take, from a hardware profile, a model profile, a replica layout and the
//! experts' loads. Pure functions, no state, no I/O (profiles aside, see the `profile` module).
//!
//! # Step time
//!
//! [`step_cost`] adds four terms, **without overlap** (a simplification: real systems overlap
//! some communication with compute, so absolute times are upper-bound-ish; the comparison
//! between dispatch schemes is the point):
//!
//! `total = dense_compute + expert_compute + all_to_all + grad_allreduce`.
//!
//! Not modelled: the optimizer step (memory-bound Adam over the rank's parameters), data
//! loading, kernel-launch and collective latencies, gradient accumulation; memory capacity is
//! not checked (the caller keeps replicas within `slots_per_gpu`).
//!
//! **Global batch.** With [`ModelProfile::global_batch`] (`B` sequences per step in
//! micro-batches of `M`), every per-rank term below is evaluated at the busiest rank's share
//! of the step's ranks, `batch_per_gpu = ⌈(B/M)/ranks⌉·M` ([`ModelProfile::at_ranks`]: its
//! micro-batch rounds, the data-less ones of ranks with fewer micro-batches counted as work),
//! a step trains `B` samples, and the calibrated per-peer cost (`step_per_peer_s`, the
//! collectives' latency) is paid once per micro-batch round ([`ModelProfile::rounds`]: every
//! round runs the expert all-to-alls).
//!
//! **Routing.** Every rank routes `A = batch_per_gpu · seq_len · top_k` token→expert
//! assignments per MoE layer, split over experts by the layer's load shares with a
//! largest-remainder apportionment (`T_e = ⌊A·load_e/Σload⌋`, leftovers to the largest
//! remainders, ties to the lower expert): `Σ_e T_e = A` exactly. **Every rank routes the same
//! distribution** (`T[e][rank] = T_e`): a simplification — the SmartMoE trace shows a rank's
//! distribution within total-variation 0.015 of the global one after warm-up (measured on its
//! per-rank counts), so per-rank skew is small next to per-expert skew.
//!
//! **Dense compute** (same on every rank):
//! `tokens_per_gpu · (6·dense_matmul_params + 12·layers·seq_len·width) / gpu_flops_effective`
//! — forward `2·params` FLOPs per token, backward twice that, plus the attention-score matmuls
//! (see [`ModelProfile::dense_train_flops_per_token`]). No tensor or pipeline parallelism:
//! every rank runs the whole dense part data-parallel.
//!
//! **Expert compute**, per MoE layer, the slowest rank (the all-to-all waits for it):
//! `max_rank processed_tokens · 6·expert_params / gpu_flops_effective`, summed over layers.
//!
//! **All-to-all**, per MoE layer: each rank's remote tokens sent and received, times
//! `d_model · bytes_per_param_weights` bytes, times 4 (dispatch and combine, forward and
//! backward; combine mirrors dispatch so `max(sent, received)` is the same for both). A rank's
//! time is `max(sent, received) / bandwidth`, separately for peers on the same node
//! ([`HardwareProfile::rank_intra_bandwidth`]) and on other nodes
//! ([`HardwareProfile::rank_inter_bandwidth`]: the node's NIC bandwidth split over its GPUs
//! and over the simulated nodes sharing the NIC), the two links working in parallel; the
//! layer costs its slowest rank. Latency, message-size effects and the all-gather of the
//! counts `T` (negligible per the paper, §6.5.1) are ignored; with `top_k > 1` every
//! assignment travels separately (no per-node deduplication).
//!
//! * [`Dispatch::Unpadded`] (Lazarus, §4.2): `lazarus_planner::dispatch::plan(T, R)` for each
//!   layer; a rank processes `Σ_e cap[e][rank]` tokens (`cap ≈ p_e·R[e][rank]`) and sends /
//!   receives exactly the plan's remote counts. Above [`ANALYTIC_DISPATCH_ABOVE_GPUS`] ranks
//!   the plan (`O(R²)` per layer) is replaced by its fractional version, computed in
//!   `O(E·R)`: `cap[e][j] = t_e·R[e][j]/r_e`, overflow `O = max(0, T − cap)`, residual
//!   `P = max(0, cap − T)`, and the overflow split proportionally to the residuals,
//!   `O_i·P_j/S` — Algorithm 1 without its integer rounding (each count is off by < 1 token).
//!   Because local tokens are kept first, a rank's remote volume does not depend on how the
//!   overflow is split, so with one GPU per node the two paths agree up to rounding. A plan's
//!   layout in runs of equal nodes ([`LayerRuns`], [`step_cost_runs`]) is evaluated once per
//!   run, with the same result bit for bit.
//! * [`Dispatch::Padded`] (DeepSpeed-MoE standard EP, §4.1/§6.3): tokens of rank `r` for
//!   expert `e` go to the replicas of `e` inside `r`'s EP group (split evenly when the group
//!   holds `k_e > 1` of them). The send buffer has one block per expert slot of the group,
//!   every block padded to the capacity `C = max_e ⌈T_e / k_e⌉` — the largest count routed to
//!   any single expert (§4.1; DeepSpeed's no-drop mode takes the max over the group). A rank
//!   sends `slots_p · C` tokens to every peer `p` of its group and receives `slots_r · C`
//!   from each, and **computes on the padded buffer** (`|group| · slots_r · C` tokens), as
//!   DeepSpeed runs the experts on the whole `[experts, capacity, d]` tensor.
//! * [`Dispatch::Dropless`] (Megatron-Core / DeepSeek-V3 style dropless expert parallelism:
//!   token permutation and grouped GEMMs, no capacity factor): the same EP groups and the same
//!   routing as `Padded`, without the padding. Rank `r` sends `T_e · c_pe / k_e` tokens of
//!   expert `e` to each replica holder `p` of its group; `p` computes exactly what it
//!   receives, `|group| · Σ_e T_e · c_pe / k_e`. The busiest rank is the one holding the
//!   hottest experts (no load balancing beyond what the router does), not a padded block.
//!
//! **Gradient all-reduce.** Ring all-reduces, each member sending and receiving
//! `2(m−1)/m · bytes` (the nccl-tests "bus bandwidth" model): the dense gradients
//! (`dense_params · bytes_per_param_weights`) over all ranks, and, per layer and expert, that
//! expert's gradients over the `m_e` distinct ranks holding it (nothing when `m_e = 1`;
//! several replicas on one rank are summed locally first). An all-reduce whose members span
//! nodes is charged to the inter-node link, otherwise to the intra-node link. All these
//! collectives share each rank's links, so the time is the **busiest rank's total bytes** over
//! its bandwidth, not the slowest single collective: the experts' all-reduces run
//! concurrently but every rank takes part in one per replica it holds, so a max over experts
//! would undercount by the number of replicas per rank.
//!
//! # Calibrated profiles (`lzrun calibrate`)
//!
//! A profile measured on one host running every node as a process (`lzrun local`) carries
//! optional host terms; the built-in profiles have none, and cost exactly as without them:
//!
//! * `host_cores`: the ranks share the host's cores. The dense compute (the same on every
//!   rank) is multiplied by [`HardwareProfile::compute_share`] = `max(1, ranks / host_cores)`;
//!   a layer's expert compute is the host's total expert work over its cores, at least the
//!   busiest rank's (`max(max_r processed_r, Σ_r processed_r / host_cores)`), not the busiest
//!   rank's times the share: on shared cores a rank waiting for the all-to-all leaves its core
//!   to the others, so an uneven layout costs its total, not its maximum;
//! * `step_overhead_s` (per rank, also shared) and `step_per_peer_s · (ranks − 1)` are added as
//!   `host_overhead_s` ([`HardwareProfile::step_fixed_s`]): on loopback TCP with small messages
//!   a step's communication is latency and synchronisation, not bytes over bandwidth;
//! * `state_transfer_bandwidth_bytes_per_s` replaces the NIC share in [`migration_s`];
//! * `replan_s` is added to every reconfiguration and restore by the engine, and
//!   `failure_detection_steps` steps of the job's current step time to every failure
//!   detection — of the job's first failure; `failure_detection_steps_later` for every later
//!   one (`lzrun local` sees a job's first failure 2–4 steps after the kill and later ones
//!   within about one; see `HardwareProfile::detection_steps`);
//! * `job_start_s`, `job_start_per_node_s`, `job_stop_s` are the launcher's start and stop,
//!   which `lzsim predict` adds around the replay.
//!
//! # Pauses
//! [`checkpoint_save_s`] / [`checkpoint_load_s`]: the full checkpoint (dense state once +
//! every expert's state once, [`ModelProfile::checkpoint_bytes`]) over the checkpoint store's
//! bandwidth (capped by the writers' own network bandwidth). [`restart_s`]: process restart +
//! checkpoint load. [`reconfigure_s`]: failure detection + communicator rebuild; migration
//! ([`migration_s`]) is added by the caller.

pub mod fsep;
mod profile;
mod runs;
mod same;
#[cfg(test)]
mod tests;

#[allow(unused_imports)] // until the simulator uses them (integration)
pub use profile::{
    HardwareProfile, ModelProfile, hardware, hardware_names, model, model_from_toml, model_names,
};

pub use runs::{LayerRuns, expand_runs, step_cost_runs};

use anyhow::{Result, bail};
use lazarus_planner::dispatch;
use rayon::prelude::*;

/// Above this many ranks, [`Dispatch::Unpadded`] uses the analytic (fractional) dispatch
/// instead of calling `dispatch::plan` (whose `O(R²)` send/receive matrices cost ~25 ms per
/// layer at 1K ranks).
pub const ANALYTIC_DISPATCH_ABOVE_GPUS: usize = 256;

/// How tokens reach expert replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dispatch {
    /// Standard expert parallelism (DS, DS(FT)): within an EP group, capacity-padded.
    Padded,
    /// Lazarus's flexible dispatcher: any replica anywhere, no padding.
    Unpadded,
    /// Dropless standard EP (Megatron-Core style): inside an EP group, no padding.
    Dropless,
}

/// One step's layout and loads.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// GPUs in use (ranks); rank `r` is on node `r / gpus_per_node`.
    pub gpus: usize,
    /// `[moe_layer][expert][rank]` replica counts — `ModelPlan::replicas_per_rank` for
    /// Lazarus, or a standard-EP layout (e.g. [`uniform_ep_layout`]) for DS.
    pub replicas_per_rank: &'a [Vec<Vec<u32>>],
    /// `[moe_layer][expert]` relative token loads (any scale; only shares matter).
    pub loads: &'a [Vec<u64>],
    pub dispatch: Dispatch,
    /// [`Dispatch::Padded`] only: the ranks of each EP group, a partition of `0..gpus`
    /// (tokens stay inside their group). Ignored for [`Dispatch::Unpadded`].
    pub ep_groups: Option<&'a [Vec<usize>]>,
}

/// Duration of one training step and its parts (seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    pub total_s: f64,
    pub dense_compute_s: f64,
    pub expert_compute_s: f64,
    pub all_to_all_s: f64,
    pub grad_allreduce_s: f64,
    /// Calibrated host terms ([`HardwareProfile::step_fixed_s`]; 0 for the built-in profiles).
    pub host_overhead_s: f64,
    /// Sequences per step: `gpus × batch_per_gpu`, or the global batch.
    pub samples: u64,
    pub tokens_per_s: f64,
}

impl StepCost {
    pub fn samples_per_s(&self) -> f64 {
        self.samples as f64 / self.total_s
    }
}

/// `[moe_layer][expert]` → the `(rank, count)` pairs of the ranks holding replicas of the
/// expert (count > 0, ranks ascending): the sparse form of `replicas_per_rank`. At 16,384
/// ranks the dense form is 58 × 256 × 16,384 counts (about 1 GB per layout); this one has one
/// pair per replica at most.
pub type SparseReplicas = Vec<Vec<Vec<(u32, u32)>>>;

/// The sparse form of dense `[moe_layer][expert][rank]` counts.
pub fn sparse_replicas(dense: &[Vec<Vec<u32>>]) -> SparseReplicas {
    dense
        .iter()
        .map(|layer| {
            layer
                .iter()
                .map(|row| {
                    row.iter()
                        .enumerate()
                        .filter(|(_, c)| **c > 0)
                        .map(|(r, &c)| (r as u32, c))
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// The replica rows of every MoE layer, `[moe_layer][expert]` → `(rank, count)`.
#[derive(Debug, Clone, Copy)]
pub enum LayerRows<'a> {
    /// One table per MoE layer ([`SparseReplicas`]).
    Each(&'a [Vec<Vec<(u32, u32)>>]),
    /// The same table for each of `layers` MoE layers (standard EP: every layer places its
    /// experts alike), held once.
    Same {
        rows: &'a [Vec<(u32, u32)>],
        layers: usize,
    },
}

impl<'a> LayerRows<'a> {
    pub fn len(self) -> usize {
        match self {
            LayerRows::Each(each) => each.len(),
            LayerRows::Same { layers, .. } => layers,
        }
    }

    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// Layer `l`'s rows (`l < len()`).
    pub fn layer(self, l: usize) -> &'a [Vec<(u32, u32)>] {
        match self {
            LayerRows::Each(each) => &each[l],
            LayerRows::Same { rows, .. } => rows,
        }
    }
}

/// [`StepInput`] with sparse replicas ([`SparseReplicas`]): what the replay's layouts hold.
#[derive(Debug, Clone, Copy)]
pub struct SparseStepInput<'a> {
    /// GPUs in use (ranks); rank `r` is on node `r / gpus_per_node`.
    pub gpus: usize,
    /// `[moe_layer][expert]` → `(rank, count)`, ranks ascending, counts > 0.
    pub replicas: LayerRows<'a>,
    pub loads: &'a [Vec<u64>],
    pub dispatch: Dispatch,
    pub ep_groups: Option<&'a [Vec<usize>]>,
    /// Optional, [`Dispatch::Unpadded`] above [`ANALYTIC_DISPATCH_ABOVE_GPUS`] ranks only:
    /// `[moe_layer][node]` = the first node of the run of consecutive nodes whose replicas in
    /// that layer equal this node's (itself when they differ from the previous node's). Equal
    /// nodes have equal per-rank traffic, which is then computed once per run; the result is
    /// the same with or without it (tested).
    pub equal_nodes: Option<&'a [Vec<u32>]>,
}

/// The duration of one training step; see the module docs for every term.
pub fn step_cost(
    hw: &HardwareProfile,
    model: &ModelProfile,
    input: &StepInput,
) -> Result<StepCost> {
    check_shapes(model, input)?;
    let sparse = sparse_replicas(input.replicas_per_rank);
    step_cost_sparse(
        hw,
        model,
        &SparseStepInput {
            gpus: input.gpus,
            replicas: LayerRows::Each(&sparse),
            loads: input.loads,
            dispatch: input.dispatch,
            ep_groups: input.ep_groups,
            equal_nodes: None,
        },
    )
}

/// [`step_cost`] of sparse replicas: the same terms, in time proportional to the replicas
/// (plus ranks × groups for padded dispatch) instead of experts × ranks.
pub fn step_cost_sparse(
    hw: &HardwareProfile,
    model: &ModelProfile,
    input: &SparseStepInput,
) -> Result<StepCost> {
    let gpus = input.gpus;
    // A global batch: every per-rank term at this membership's share (module docs).
    let model = &*model.at_ranks(gpus);
    // The shapes are checked first (each layer's rows inside its own evaluation below, in
    // parallel), then the EP groups: errors are reported in that order.
    check_layer_counts(model, gpus, input.replicas.len(), input.loads)?;
    // Standard EP (the same rows in every layer), padded: per kind of EP group, not per rank.
    if let (LayerRows::Same { rows, layers }, Dispatch::Padded, Some(groups)) =
        (input.replicas, input.dispatch, input.ep_groups)
        && let Some(cost) = same::padded_same(hw, model, gpus, rows, layers, input.loads, groups)
    {
        return cost;
    }
    let groups = match (input.dispatch, input.ep_groups) {
        (Dispatch::Padded | Dispatch::Dropless, None) => Err(anyhow::anyhow!(
            "padded and dropless dispatch need the EP groups"
        )),
        (Dispatch::Padded | Dispatch::Dropless, Some(g)) => {
            check_partition(g, gpus).map(|()| Some(g))
        }
        (Dispatch::Unpadded, _) => Ok(None),
    };
    let group_of: Vec<usize> = match groups {
        Ok(Some(g)) => {
            let mut of = vec![0usize; gpus];
            for (gi, group) in g.iter().enumerate() {
                for &r in group {
                    of[r] = gi;
                }
            }
            of
        }
        _ => Vec::new(),
    };

    let (inter_bw, intra_bw) = (hw.rank_inter_bandwidth(), hw.rank_intra_bandwidth());
    // Layers are independent: each is evaluated on its own (in parallel: a new layout at
    // 2,048 nodes costs tens of milliseconds per step-cost evaluation), and their terms are
    // summed below in layer order, so the result does not depend on the thread count.
    // `layer_terms`: one layer's (processed, link time), on a traffic buffer of the thread.
    let layer_terms = |layer: usize,
                       replicas: &[Vec<(u32, u32)>],
                       loads: &[u64],
                       groups: Option<&[Vec<usize>]>,
                       traffic: &mut Traffic|
     -> Result<(f64, f64)> {
        let t = routed_tokens(loads, model.assignments_per_gpu())
            .map_err(|e| anyhow::anyhow!("MoE layer {layer}: {e}"))?;
        traffic.clear();
        let res = match groups {
            Some(g) if input.dispatch == Dispatch::Dropless => {
                dropless_layer(&t, replicas, g, &group_of, traffic)
            }
            Some(g) => padded_layer(&t, replicas, g, &group_of, traffic),
            None if gpus > ANALYTIC_DISPATCH_ABOVE_GPUS => {
                let equal = input.equal_nodes.and_then(|eq| eq.get(layer));
                analytic_layer(&t, replicas, equal.map(Vec::as_slice), traffic)
            }
            None => planned_layer(&t, replicas, traffic),
        };
        res.map_err(|e| anyhow::anyhow!("MoE layer {layer}: {e}"))?;
        let max_processed = traffic.processed.iter().copied().fold(0.0, f64::max);
        // Ranks sharing a host's cores: the layer takes the host's total expert work
        // over its cores (a rank that waits frees its core for the others), at least
        // the busiest rank's.
        let processed = match hw.host_cores {
            Some(cores) => max_processed.max(traffic.processed.iter().sum::<f64>() / cores),
            None => max_processed,
        };
        Ok((processed, traffic.max_link_time(inter_bw, intra_bw)))
    };
    // Outer error: the layer's shape; `None`: not evaluated (the groups are invalid).
    type Terms = Result<Option<Result<(f64, f64)>>>;
    let layer_terms: Vec<Terms> = (0..input.replicas.len())
        .into_par_iter()
        .map(|l| (l, (input.replicas.layer(l), &input.loads[l])))
        .map_init(
            || Traffic::new(hw, gpus),
            |traffic, (layer, (replicas, loads))| -> Terms {
                check_layer(model, layer, replicas, loads, |l, e, row| {
                    check_sparse_row(gpus, l, e, row)
                })?;
                let Ok(groups) = &groups else {
                    return Ok(None);
                };
                Ok(Some(layer_terms(layer, replicas, loads, *groups, traffic)))
            },
        )
        .collect();
    // The first layer whose shape is wrong, then the groups, as the sequential checks did.
    let layer_terms: Vec<Option<Result<(f64, f64)>>> =
        layer_terms.into_iter().collect::<Result<_>>()?;
    groups?;
    assemble(
        hw,
        model,
        gpus,
        layer_terms,
        grad_allreduce_s(hw, model, gpus, input.replicas),
    )
}

/// The step's total from each layer's (busiest rank's processed assignments, busiest link's
/// time per token-byte) in layer order and the gradient all-reduce time; the first failing
/// layer's error, as a sequential loop would report it.
fn assemble(
    hw: &HardwareProfile,
    model: &ModelProfile,
    gpus: usize,
    layer_terms: impl IntoIterator<Item = Option<Result<(f64, f64)>>>,
    grad_allreduce_s: f64,
) -> Result<StepCost> {
    let flops = hw.gpu_flops_effective;
    let act = model.activation_bytes_per_token() as f64;
    let mut expert_compute_s = 0.0;
    let mut all_to_all_s = 0.0;
    for terms in layer_terms {
        let (processed, link_time) = terms.expect("evaluated: the groups are valid")?;
        expert_compute_s += processed * model.expert_train_flops_per_assignment() / flops;
        all_to_all_s += 4.0 * act * link_time;
    }

    let share = hw.compute_share(gpus);
    let dense_compute_s =
        share * model.tokens_per_gpu() as f64 * model.dense_train_flops_per_token() / flops;
    // A global batch's micro-batch rounds each pay the collectives' per-peer latency.
    let extra_rounds = model.rounds(gpus) - 1;
    let host_overhead_s = hw.step_fixed_s(gpus)
        + extra_rounds as f64 * hw.step_per_peer_s.unwrap_or(0.0) * gpus.saturating_sub(1) as f64;
    let total_s =
        dense_compute_s + expert_compute_s + all_to_all_s + grad_allreduce_s + host_overhead_s;
    Ok(StepCost {
        total_s,
        dense_compute_s,
        expert_compute_s,
        all_to_all_s,
        grad_allreduce_s,
        host_overhead_s,
        samples: model.sequences_per_step(gpus),
        tokens_per_s: (model.sequences_per_step(gpus) * model.seq_len) as f64 / total_s,
    })
}

/// Per-rank token counts of one layer (fractional for the analytic path).
struct Traffic {
    /// Node of each rank (precomputed: the analytic path looks it up `E·R` times a layer).
    node: Vec<usize>,
    /// Ranks on each node, the first of them, and whether every node's ranks are consecutive
    /// (the analytic path's equal-nodes copy needs it).
    node_size: Vec<usize>,
    first_rank: Vec<usize>,
    contiguous: bool,
    processed: Vec<f64>,
    sent_inter: Vec<f64>,
    recv_inter: Vec<f64>,
    sent_intra: Vec<f64>,
    recv_intra: Vec<f64>,
}

impl Traffic {
    fn new(hw: &HardwareProfile, n: usize) -> Self {
        let node: Vec<usize> = (0..n).map(|r| hw.node_of(r)).collect();
        let nodes = node.iter().max().map_or(0, |&m| m + 1);
        let mut node_size = vec![0usize; nodes];
        let mut first_rank = vec![usize::MAX; nodes];
        let mut contiguous = true;
        for (j, &n) in node.iter().enumerate() {
            if node_size[n] == 0 {
                first_rank[n] = j;
            } else if first_rank[n] + node_size[n] != j {
                contiguous = false;
            }
            node_size[n] += 1;
        }
        Traffic {
            node,
            node_size,
            first_rank,
            contiguous,
            processed: vec![0.0; n],
            sent_inter: vec![0.0; n],
            recv_inter: vec![0.0; n],
            sent_intra: vec![0.0; n],
            recv_intra: vec![0.0; n],
        }
    }

    fn clear(&mut self) {
        for v in [
            &mut self.processed,
            &mut self.sent_inter,
            &mut self.recv_inter,
            &mut self.sent_intra,
            &mut self.recv_intra,
        ] {
            v.fill(0.0);
        }
    }

    /// Adds `count` tokens from `src` to `dst` (remote only).
    fn send(&mut self, src: usize, dst: usize, count: f64) {
        if self.node[src] == self.node[dst] {
            self.sent_intra[src] += count;
            self.recv_intra[dst] += count;
        } else {
            self.sent_inter[src] += count;
            self.recv_inter[dst] += count;
        }
    }

    /// Slowest rank's time per token-byte: `max_r max(inter, intra)` where each link's time
    /// is `max(sent, received) / bandwidth`.
    fn max_link_time(&self, inter_bw: f64, intra_bw: f64) -> f64 {
        (0..self.processed.len())
            .map(|r| {
                let inter = self.sent_inter[r].max(self.recv_inter[r]) / inter_bw;
                let intra = self.sent_intra[r].max(self.recv_intra[r]) / intra_bw;
                inter.max(intra)
            })
            .fold(0.0, f64::max)
    }
}

/// `T_e`: `total` assignments split over experts by `loads` (largest remainder, ties to the
/// lower expert); sums to `total` exactly.
pub fn routed_tokens(loads: &[u64], total: u64) -> Result<Vec<u64>> {
    let sum: u128 = loads.iter().map(|&l| u128::from(l)).sum();
    if sum == 0 {
        bail!("all expert loads are zero");
    }
    let mut out = Vec::with_capacity(loads.len());
    let mut rem = Vec::with_capacity(loads.len());
    let mut assigned = 0u64;
    for (e, &l) in loads.iter().enumerate() {
        let x = u128::from(total) * u128::from(l);
        let f = (x / sum) as u64;
        assigned += f;
        out.push(f);
        rem.push((x % sum, e));
    }
    let deficit = (total - assigned) as usize; // < number of experts
    rem.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, e) in &rem[..deficit] {
        out[e] += 1;
    }
    Ok(out)
}

/// Lazarus dispatch through the planner's exact integer plan.
fn planned_layer(t: &[u64], replicas: &[Vec<(u32, u32)>], traffic: &mut Traffic) -> Result<()> {
    let gpus = traffic.processed.len();
    let tokens: Vec<Vec<u64>> = t.iter().map(|&te| vec![te; gpus]).collect();
    let dense: Vec<Vec<u32>> = replicas
        .iter()
        .map(|row| {
            let mut d = vec![0u32; gpus];
            for &(r, c) in row {
                d[r as usize] = c;
            }
            d
        })
        .collect();
    let plan = dispatch::plan(&tokens, &dense)?;
    for (src, row) in plan.send_counts.iter().enumerate() {
        for (dst, &c) in row.iter().enumerate() {
            if c == 0 {
                continue;
            }
            traffic.processed[dst] += c as f64;
            if src != dst {
                traffic.send(src, dst, c as f64);
            }
        }
    }
    Ok(())
}

/// Lazarus dispatch, fractional (Algorithm 1 without rounding).
///
/// Cost `O(R + E·holders)` per layer: a rank holding no replica of `e` overflows all its
/// `T_e` tokens, and how they split between its own node and the network depends only on its
/// node (all of it leaves, except the share that lands on holders of the same node), so
/// non-holders are accumulated per node, touching only the holders' nodes, and spread over
/// the node's ranks once per layer; holders (few per expert) are corrected individually.
///
/// `equal_nodes` ([`SparseStepInput::equal_nodes`]): `[node]` = the first node of its run of
/// nodes with equal replicas. Every per-rank and per-node term depends only on the node's own
/// replicas and on per-expert totals (`r_e`, the overflow sum `S`), so the ranks of a node
/// that follows an equal one get exactly (bit for bit) the values of that node's ranks: they
/// are copied, and only `S`, which sums over every holder in rank order, still visits them.
/// A hint that does not fit (wrong length, a node pointing forward or at a node that is not
/// first of its run, different rank counts) is ignored.
fn analytic_layer(
    t: &[u64],
    replicas: &[Vec<(u32, u32)>],
    equal_nodes: Option<&[u32]>,
    traffic: &mut Traffic,
) -> Result<()> {
    let gpus = traffic.processed.len();
    let nodes = traffic.node_size.len();
    let node_size = &traffic.node_size;
    let rep: Vec<usize> = match equal_nodes {
        Some(eq)
            if traffic.contiguous
                && eq.len() == nodes
                && eq.iter().enumerate().all(|(n, &f)| {
                    let f = f as usize;
                    f <= n && eq[f] as usize == f && node_size[f] == node_size[n]
                }) =>
        {
            eq.iter().map(|&f| f as usize).collect()
        }
        _ => (0..nodes).collect(),
    };
    // Holders on nodes evaluated themselves (first of their run).
    let mut holders: Vec<(usize, f64)> = Vec::new();
    // Per-node sums of the current expert, kept on the holders' nodes only (`touched`) and
    // reset there after each expert: the work per expert is O(holders), not O(nodes).
    let (mut p_node, mut o_node) = (vec![0.0; nodes], vec![0.0; nodes]);
    let mut held_on = vec![0usize; nodes];
    let mut touched: Vec<usize> = Vec::new();
    // Sent by every non-holding rank of a node, summed over experts: all of `T_e` leaves the
    // node (`uniform_inter`, the same for every node) except the share `P_node / S` that lands
    // on the node's own holders, moved from inter to intra on those nodes.
    let (mut nh_intra, mut nh_inter) = (vec![0.0; nodes], vec![0.0; nodes]);
    let mut uniform_inter = 0.0;
    for (e, (&te, r_row)) in t.iter().zip(replicas).enumerate() {
        if te == 0 {
            continue;
        }
        if r_row.is_empty() {
            bail!("expert {e} receives {te} tokens per rank but has no replica");
        }
        // Replica counts are integers: their sum in `u64` is the `f64` sum in rank order
        // exactly (every partial sum is an integer below 2⁵³), without a chain of float adds.
        let r_e = r_row.iter().map(|&(_, r)| u64::from(r)).sum::<u64>() as f64;
        let te = te as f64;
        let per_replica = te * gpus as f64 / r_e;
        holders.clear();
        touched.clear();
        // Overflow of every non-holding rank of every node: te per rank; then every holder's
        // overflow, in rank order. Only the holders of evaluated nodes are kept.
        let mut s = te * (gpus - r_row.len()) as f64;
        for &(j, r) in r_row {
            let r = f64::from(r);
            let c = per_replica * r;
            if te > c {
                s += te - c;
            }
            let j = j as usize;
            let n = traffic.node[j];
            if rep[n] != n {
                continue;
            }
            holders.push((j, r));
            if held_on[n] == 0 {
                touched.push(n);
            }
            held_on[n] += 1;
        }
        for &n in &touched {
            o_node[n] = te * (node_size[n] - held_on[n]) as f64;
        }
        for &(j, r) in &holders {
            let c = per_replica * r;
            traffic.processed[j] += c;
            let n = traffic.node[j];
            if te > c {
                o_node[n] += te - c;
            } else {
                p_node[n] += c - te;
            }
        }
        if s > 0.0 {
            // Sender i's overflow goes to the receivers in proportion to their residuals
            // (O_i·P_j/S), so the share landing on its own node is P_node / S (a sender's own
            // residual is zero); a receiver's inflow from its own node is P_j·O_node/S.
            uniform_inter += te;
            for &n in &touched {
                let same = p_node[n] / s;
                nh_intra[n] += te * same;
                nh_inter[n] -= te * same;
            }
            for &(j, r) in &holders {
                let c = per_replica * r;
                let n = traffic.node[j];
                let same = p_node[n] / s;
                // Undo the non-holder share that the per-node sums will give this rank.
                traffic.sent_intra[j] -= te * same;
                traffic.sent_inter[j] -= te * (1.0 - same);
                if te > c {
                    traffic.sent_intra[j] += (te - c) * same;
                    traffic.sent_inter[j] += (te - c) * (1.0 - same);
                } else {
                    let from_node = (o_node[n] / s).min(1.0);
                    traffic.recv_intra[j] += (c - te) * from_node;
                    traffic.recv_inter[j] += (c - te) * (1.0 - from_node);
                }
            }
        }
        for &n in &touched {
            p_node[n] = 0.0;
            o_node[n] = 0.0;
            held_on[n] = 0;
        }
    }
    for j in 0..gpus {
        let n = traffic.node[j];
        let f = rep[n];
        if f == n {
            traffic.sent_intra[j] += nh_intra[n];
            traffic.sent_inter[j] += uniform_inter + nh_inter[n];
        } else {
            // The same GPU of the first node of the run, final already (`f < n`).
            let src = traffic.first_rank[f] + (j - traffic.first_rank[n]);
            traffic.processed[j] = traffic.processed[src];
            traffic.sent_intra[j] = traffic.sent_intra[src];
            traffic.sent_inter[j] = traffic.sent_inter[src];
            traffic.recv_intra[j] = traffic.recv_intra[src];
            traffic.recv_inter[j] = traffic.recv_inter[src];
        }
    }
    Ok(())
}

/// DeepSpeed-style padded expert parallelism inside each EP group: every expert's block is
/// padded to the group's capacity (the hottest expert's tokens per replica).
fn padded_layer(
    t: &[u64],
    replicas: &[Vec<(u32, u32)>],
    groups: &[Vec<usize>],
    group_of: &[usize],
    traffic: &mut Traffic,
) -> Result<()> {
    let gpus = traffic.processed.len();
    let mut capacity = vec![0u64; groups.len()];
    let mut k = vec![0u64; groups.len()];
    let mut slots = vec![0.0f64; gpus];
    for (&te, row) in t.iter().zip(replicas) {
        for &(r, c) in row {
            slots[r as usize] += f64::from(c);
        }
        if te == 0 {
            continue;
        }
        if !count_per_group(&mut k, row, group_of) {
            return Err(missing_replica(t, replicas, groups, group_of));
        }
        for (&kg, cap) in k.iter().zip(&mut capacity) {
            *cap = (*cap).max(te.div_ceil(kg));
        }
    }
    // Every member `r` sends `slots[p] · c` to every other member `p`. Summed per node this is
    // O(group) instead of O(group²) (64² pairs per group and layer at 2,048 GPUs). Every term
    // is an integer below 2⁵³ (slot counts times a token capacity), so the sums are exact in
    // any order: the result is bit for bit the pairwise loop's (`padded_layer_pairwise` in
    // the tests).
    let mut node_slots: Vec<(usize, f64, f64)> = Vec::new();
    for (group, &capacity) in groups.iter().zip(&capacity) {
        let c = capacity as f64;
        let g = group.len() as f64;
        // (node, slots on it, members on it) for the group's nodes: a group spans few nodes.
        node_slots.clear();
        let mut total = 0.0;
        for &p in group {
            let n = traffic.node[p];
            match node_slots.iter_mut().find(|e| e.0 == n) {
                Some(e) => {
                    e.1 += slots[p];
                    e.2 += 1.0;
                }
                None => node_slots.push((n, slots[p], 1.0)),
            }
            total += slots[p];
        }
        debug_assert!(
            g * total * c < EXACT_F64_INTEGER,
            "padded traffic exceeds exact f64 integers"
        );
        for &r in group {
            let n = traffic.node[r];
            let &(_, on_node, members) = node_slots
                .iter()
                .find(|e| e.0 == n)
                .expect("every member's node was summed");
            traffic.processed[r] += g * slots[r] * c;
            traffic.sent_intra[r] += (on_node - slots[r]) * c;
            traffic.sent_inter[r] += (total - on_node) * c;
            traffic.recv_intra[r] += slots[r] * c * (members - 1.0);
            traffic.recv_inter[r] += slots[r] * c * (g - members);
        }
    }
    Ok(())
}

/// 2⁵³: below it every integer is an `f64`, so sums of integer-valued terms are exact.
const EXACT_F64_INTEGER: f64 = 9_007_199_254_740_992.0;

/// The error of an expert with tokens but no replica in some group: the first such group, then
/// its first such expert.
fn missing_replica(
    t: &[u64],
    replicas: &[Vec<(u32, u32)>],
    groups: &[Vec<usize>],
    group_of: &[usize],
) -> anyhow::Error {
    for (gi, group) in groups.iter().enumerate() {
        for (e, (&te, row)) in t.iter().zip(replicas).enumerate() {
            if te > 0 && !row.iter().any(|&(r, _)| group_of[r as usize] == gi) {
                return anyhow::anyhow!(
                    "expert {e} has no replica in EP group {gi} (ranks {group:?})"
                );
            }
        }
    }
    anyhow::anyhow!("an expert has no replica in some EP group")
}

/// Dropless standard EP inside each EP group ([`Dispatch::Dropless`]): `own[p]`, the tokens
/// `p` takes from each member of its group, is `Σ_e T_e · c_pe / k_e`; every other member
/// sends it that many, over the intra-node link when they share a node.
fn dropless_layer(
    t: &[u64],
    replicas: &[Vec<(u32, u32)>],
    groups: &[Vec<usize>],
    group_of: &[usize],
    traffic: &mut Traffic,
) -> Result<()> {
    let gpus = traffic.processed.len();
    let mut k = vec![0u64; groups.len()];
    let mut own = vec![0.0f64; gpus];
    for (&te, row) in t.iter().zip(replicas) {
        if te == 0 {
            continue;
        }
        if !count_per_group(&mut k, row, group_of) {
            return Err(missing_replica(t, replicas, groups, group_of));
        }
        for &(r, c) in row {
            own[r as usize] += te as f64 * f64::from(c) / k[group_of[r as usize]] as f64;
        }
    }
    // Per group: the tokens its members take, in all and per node.
    let mut node_own: std::collections::HashMap<usize, (f64, f64)> = Default::default();
    for group in groups {
        node_own.clear();
        let mut total = 0.0;
        for &p in group {
            let entry = node_own.entry(traffic.node[p]).or_insert((0.0, 0.0));
            entry.0 += own[p];
            entry.1 += 1.0;
            total += own[p];
        }
        let g = group.len() as f64;
        for &r in group {
            let (on_node, members) = node_own[&traffic.node[r]];
            traffic.processed[r] += g * own[r];
            traffic.sent_intra[r] += on_node - own[r];
            traffic.sent_inter[r] += total - on_node;
            traffic.recv_intra[r] += own[r] * (members - 1.0);
            traffic.recv_inter[r] += own[r] * (g - members);
        }
    }
    Ok(())
}

/// Gradient all-reduce time of one step: the busiest rank's dense + expert all-reduce bytes
/// over its links (see the module docs).
fn grad_allreduce_s(
    hw: &HardwareProfile,
    model: &ModelProfile,
    gpus: usize,
    replicas: LayerRows,
) -> f64 {
    let ring = |m: usize, bytes: f64| 2.0 * (m - 1) as f64 / m as f64 * bytes;
    let expert_bytes = model.expert_grad_bytes() as f64;
    if let LayerRows::Same { rows, layers } = replicas {
        // Every rank's dense term, then each layer's additions (`same` sums them per kind).
        let (mut inter, mut intra) = (0.0f64, 0.0f64);
        if gpus >= 2 {
            let v = ring(gpus, model.dense_grad_bytes() as f64);
            if hw.node_of(gpus - 1) > 0 {
                inter += v;
            } else {
                intra += v;
            }
        }
        return same::grad_allreduce_same(hw, gpus, (inter, intra), rows, layers, |m| {
            ring(m, expert_bytes)
        });
    }
    let mut inter = vec![0.0; gpus];
    let mut intra = vec![0.0; gpus];
    if gpus >= 2 {
        let v = ring(gpus, model.dense_grad_bytes() as f64);
        let target = if hw.node_of(gpus - 1) > 0 {
            &mut inter
        } else {
            &mut intra
        };
        target.iter_mut().for_each(|x| *x += v);
    }
    for row in (0..replicas.len()).flat_map(|l| replicas.layer(l)) {
        let m = row.len();
        if m < 2 {
            continue;
        }
        let v = ring(m, expert_bytes);
        // Rows are checked ascending (`check_sparse_row`) and a rank's node grows with the
        // rank, so a row spans nodes exactly when its first and last holders' nodes differ.
        let spans = hw.node_of(row[0].0 as usize) != hw.node_of(row[m - 1].0 as usize);
        let target = if spans { &mut inter } else { &mut intra };
        for &(j, _) in row {
            target[j as usize] += v;
        }
    }
    let (inter_bw, intra_bw) = (hw.rank_inter_bandwidth(), hw.rank_intra_bandwidth());
    (0..gpus)
        .map(|r| (inter[r] / inter_bw).max(intra[r] / intra_bw))
        .fold(0.0, f64::max)
}

/// One expert's replicas per EP group (`row` as `(rank, count)`) into `k`; false when some
/// group holds none.
fn count_per_group(k: &mut [u64], row: &[(u32, u32)], group_of: &[usize]) -> bool {
    k.fill(0);
    for &(r, c) in row {
        k[group_of[r as usize]] += u64::from(c);
    }
    !k.contains(&0)
}

fn check_shapes(model: &ModelProfile, input: &StepInput) -> Result<()> {
    let gpus = input.gpus;
    check_layers(
        model,
        gpus,
        input.replicas_per_rank,
        input.loads,
        |l, e, row| {
            if row.len() != gpus {
                bail!(
                    "MoE layer {l}, expert {e}: {} rank columns, expected {gpus}",
                    row.len()
                );
            }
            Ok(())
        },
    )
}

/// One sparse replica row (`layer`, `expert`): positive counts on ranks below `gpus`, ranks
/// ascending.
fn check_sparse_row(gpus: usize, l: usize, e: usize, row: &[(u32, u32)]) -> Result<()> {
    let mut last: Option<u32> = None;
    for &(r, c) in row {
        if r as usize >= gpus || c == 0 || last.is_some_and(|x| x >= r) {
            bail!(
                "MoE layer {l}, expert {e}: replica ({r}, {c}) is not a positive count \
                 on a rank below {gpus} in ascending order"
            );
        }
        last = Some(r);
    }
    Ok(())
}

/// What the dense and the sparse step inputs share: at least one GPU, a replica table and a
/// load row for every MoE layer, with an entry per expert; `check_row(layer, expert, row)`
/// checks one expert's replicas.
fn check_layers<R>(
    model: &ModelProfile,
    gpus: usize,
    replicas: &[Vec<R>],
    loads: &[Vec<u64>],
    check_row: impl Fn(usize, usize, &R) -> Result<()>,
) -> Result<()> {
    check_layer_counts(model, gpus, replicas.len(), loads)?;
    for (l, (layer, loads)) in replicas.iter().zip(loads).enumerate() {
        check_layer(model, l, layer, loads, &check_row)?;
    }
    Ok(())
}

/// The parts of [`check_layers`] that do not look into the layers.
fn check_layer_counts(
    model: &ModelProfile,
    gpus: usize,
    replica_layers: usize,
    loads: &[Vec<u64>],
) -> Result<()> {
    if gpus == 0 {
        bail!("a step needs at least one GPU");
    }
    if replica_layers != model.moe_layers {
        bail!(
            "replicas have {replica_layers} layers, the model has {} MoE layers",
            model.moe_layers
        );
    }
    if loads.len() != model.moe_layers {
        bail!(
            "loads has {} layers, the model has {} MoE layers",
            loads.len(),
            model.moe_layers
        );
    }
    Ok(())
}

/// [`check_layers`] of layer `l`.
fn check_layer<R>(
    model: &ModelProfile,
    l: usize,
    layer: &[R],
    loads: &[u64],
    check_row: impl Fn(usize, usize, &R) -> Result<()>,
) -> Result<()> {
    if layer.len() != model.experts || loads.len() != model.experts {
        bail!(
            "MoE layer {l}: {} replica rows and {} loads, the model has {} experts",
            layer.len(),
            loads.len(),
            model.experts
        );
    }
    for (e, row) in layer.iter().enumerate() {
        check_row(l, e, row)?;
    }
    Ok(())
}

fn check_partition(groups: &[Vec<usize>], gpus: usize) -> Result<()> {
    let mut seen = vec![false; gpus];
    for (gi, g) in groups.iter().enumerate() {
        for &r in g {
            if r >= gpus {
                bail!("EP group {gi} names rank {r}, but only {gpus} GPUs are in use");
            }
            if std::mem::replace(&mut seen[r], true) {
                bail!("rank {r} is in more than one EP group");
            }
        }
    }
    if let Some(r) = seen.iter().position(|s| !s) {
        bail!("rank {r} is in no EP group");
    }
    Ok(())
}

/// A standard expert-parallel layout (DeepSpeed-MoE): `gpus / ep_size` groups of `ep_size`
/// consecutive ranks; inside a group, the rank at position `i` holds experts
/// `i·E/ep .. (i+1)·E/ep`, the same in every MoE layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpLayout {
    /// `[moe_layer][expert][rank]`.
    pub replicas_per_rank: Vec<Vec<Vec<u32>>>,
    pub ep_groups: Vec<Vec<usize>>,
}

/// The GPUs standard EP can use out of `available`: the largest multiple of `ep_size`.
pub fn usable_ep_gpus(model: &ModelProfile, available: usize) -> usize {
    available / model.ep_size * model.ep_size
}

/// The standard EP layout on `gpus` ranks (a positive multiple of `ep_size`).
pub fn uniform_ep_layout(model: &ModelProfile, gpus: usize) -> Result<EpLayout> {
    let ep = model.ep_size;
    if gpus == 0 || !gpus.is_multiple_of(ep) {
        bail!("standard EP needs a positive multiple of ep_size = {ep} GPUs, got {gpus}");
    }
    let per_rank = model.experts / ep;
    let mut layer = vec![vec![0u32; gpus]; model.experts];
    for rank in 0..gpus {
        let pos = rank % ep;
        for row in &mut layer[pos * per_rank..(pos + 1) * per_rank] {
            row[rank] = 1;
        }
    }
    Ok(EpLayout {
        replicas_per_rank: vec![layer; model.moe_layers],
        ep_groups: (0..gpus / ep)
            .map(|g| (g * ep..(g + 1) * ep).collect())
            .collect(),
    })
}

/// Bandwidth to the checkpoint store: the store's, capped by the writers' network bandwidth.
fn checkpoint_bandwidth(hw: &HardwareProfile, gpus: usize) -> f64 {
    hw.checkpoint_bandwidth_bytes_per_s
        .min(gpus.max(1) as f64 * hw.rank_inter_bandwidth())
}

/// Seconds to write a full checkpoint (dense state once + every expert's state once) from
/// `gpus` GPUs. Training is assumed to block while it is written.
pub fn checkpoint_save_s(hw: &HardwareProfile, model: &ModelProfile, gpus: usize) -> f64 {
    model.checkpoint_bytes() as f64 / checkpoint_bandwidth(hw, gpus)
}

/// Seconds to read a full checkpoint into `gpus` GPUs. The dense state is read once (then
/// broadcast over the much faster training network, not charged).
pub fn checkpoint_load_s(hw: &HardwareProfile, model: &ModelProfile, gpus: usize) -> f64 {
    model.checkpoint_bytes() as f64 / checkpoint_bandwidth(hw, gpus)
}

/// Seconds to migrate expert states when the busiest node sends `max_sent_bytes` and the
/// busiest receives `max_recv_bytes` (bytes per node, the migration plan's unit). Across
/// nodes a node uses its whole NIC share ([`HardwareProfile::node_inter_bandwidth`]);
/// `same_node` transfers use one GPU's intra-node link.
pub fn migration_s(
    hw: &HardwareProfile,
    max_sent_bytes: u64,
    max_recv_bytes: u64,
    same_node: bool,
) -> f64 {
    let bw = if same_node {
        hw.rank_intra_bandwidth()
    } else {
        hw.state_transfer_bandwidth_bytes_per_s
            .unwrap_or_else(|| hw.node_inter_bandwidth())
    };
    max_sent_bytes.max(max_recv_bytes) as f64 / bw
}

/// Seconds to restart from a checkpoint on `gpus` GPUs: process restart + checkpoint load.
/// Failure detection is not included (add [`HardwareProfile::failure_detection_timeout_s`]
/// for a restart caused by a failure).
pub fn restart_s(hw: &HardwareProfile, model: &ModelProfile, gpus: usize) -> f64 {
    hw.process_restart_s + checkpoint_load_s(hw, model, gpus)
}

/// Seconds of a checkpoint-free reconfiguration, migration excluded: detection timeout +
/// communicator rebuild (§1.3) (+ the calibrated replan time, when the profile has one).
pub fn reconfigure_s(hw: &HardwareProfile) -> f64 {
    hw.failure_detection_timeout_s + hw.communicator_rebuild_s + hw.replan_s.unwrap_or(0.0)
}
