//! Step cost of fully sharded experts (FSEP, LAER-MoE; our reference §1.2), on the same terms
//! as [`super::step_cost_sparse`].
//!
//! **Experts materialised per rank** (`C`, LAER's `--expert_capacity_per_device`): LAER's
//! runs pick `C` so that the `N·C` slots give every expert about 8 copies (`C = 2` for 8
//! experts and `C = 4` for 16 experts on 32 GPUs; our reference §1.2, §1.7), so we take
//! `C = clamp(⌈8·E/N⌉, 1, slots_per_gpu)` ([`slots_per_gpu`]): more would only add gather
//! bytes, fewer would starve the balancing of hot experts.
//!
//! Every expert's weights and Adam state are cut into `S` shards; `copies` (= f) nodes hold
//! each shard (`1` in LAER). Per MoE layer and step, every rank materialises the
//! `C = slots_per_gpu` experts its layout assigns to it:
//!
//! * **gather** (twice: before the forward, and again before the backward, as FSDP/LAER free
//!   the unsharded weights in between): a rank receives the shards it does not hold,
//!   `C · P_w · (1 − h/S)` bytes, `P_w` = one expert's weights, `h/S` = the share of shards it
//!   holds itself (`h = copies·S/ranks` shard copies per rank, at most all `S`); the holders
//!   send the same total, `ranks/holder_ranks` times a receiver's volume each;
//! * **gradient return** (once, the backward's reverse all-to-all): each rank sends its `C`
//!   experts' gradient shards to their primary holders, `C · P_g · (1 − h/S)`, summed there
//!   over replicas (reduce-scatter); the primaries receive `ranks/holder_ranks` times that;
//! * **copy update** (`copies > 1` only): each primary forwards the reduced gradient shard of
//!   every expert to the `copies − 1` other holders, which apply the same Adam step (identical
//!   states, no optimizer-state traffic): `(copies − 1) · E · P_g / holder_ranks` per rank.
//!
//! A volume `V` of one rank goes to its peers uniformly, so the share `(ranks − G)/(ranks − 1)`
//! crosses nodes; the intra- and inter-node links work in parallel, as in the token
//! all-to-all. The expert replicas' gradient all-reduce of the replicated layout disappears
//! (the reduce-scatter replaces it); the dense all-reduce stays. Not modelled: overlap of the
//! next layer's gather with compute (LAER prefetches; our terms add without overlap, like the
//! rest of the model), and the planner's own time (LAER re-plans in a background process).

use super::{HardwareProfile, ModelProfile, SparseStepInput, StepCost, step_cost_sparse};
use anyhow::{Result, bail};

/// The sharded storage a step runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FsepShape {
    /// Shard indices `S` of every expert.
    pub shards: usize,
    /// Copies of each shard (LAER: 1).
    pub copies: usize,
    /// Ranks on nodes that hold at least one shard copy (the senders of the gathers).
    pub holder_ranks: usize,
}

/// The shard traffic of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardTraffic {
    /// Seconds of every MoE layer's gathers, gradient return and copy updates.
    pub shard_s: f64,
    /// Bytes the busiest rank moves (the larger of sent and received) per step.
    pub bytes_per_rank: f64,
}

/// The gathers', gradient return's and copy updates' time on `gpus` ranks (module docs).
pub fn shard_traffic(
    hw: &HardwareProfile,
    model: &ModelProfile,
    gpus: usize,
    shape: &FsepShape,
) -> Result<ShardTraffic> {
    if gpus == 0 || shape.shards == 0 || shape.copies == 0 {
        bail!("FSEP needs ranks, shards and copies (got {gpus}, {shape:?})");
    }
    if shape.holder_ranks == 0 || shape.holder_ranks > gpus {
        bail!(
            "FSEP holder ranks must be in 1..={gpus} (got {})",
            shape.holder_ranks
        );
    }
    let (s, ranks) = (shape.shards as f64, gpus as f64);
    let held_share = (shape.copies as f64 * s / ranks / s).min(1.0);
    let remote = 1.0 - held_share;
    let c = slots_per_gpu(model, gpus) as f64;
    let p_w = (model.expert_params() * model.bytes_per_param_weights) as f64;
    let p_g = model.expert_grad_bytes() as f64;
    let fan_in = ranks / shape.holder_ranks as f64;
    // Per layer, per rank: max(sent, received) of each pass.
    let gather = c * p_w * remote * fan_in.max(1.0);
    let grad = c * p_g * remote * fan_in.max(1.0);
    let update = (shape.copies - 1) as f64 * model.experts as f64 * p_g / shape.holder_ranks as f64;
    let per_layer = 2.0 * gather + grad + update;
    let bytes_per_rank = model.moe_layers as f64 * per_layer;
    Ok(ShardTraffic {
        shard_s: link_s(hw, gpus, bytes_per_rank),
        bytes_per_rank,
    })
}

/// Experts each of `gpus` ranks materialises per MoE layer (module docs): about 8 copies per
/// expert, within the profile's slots.
pub fn slots_per_gpu(model: &ModelProfile, gpus: usize) -> usize {
    (8 * model.experts)
        .div_ceil(gpus.max(1))
        .clamp(1, model.slots_per_gpu.max(1))
}

/// Seconds for one rank to exchange `bytes` uniformly with its peers: the off-node share over
/// the inter-node link, the rest over the intra-node link, in parallel.
pub fn link_s(hw: &HardwareProfile, gpus: usize, bytes: f64) -> f64 {
    if gpus < 2 {
        return 0.0;
    }
    let g = hw.gpus_per_node.min(gpus);
    let off_node = (gpus - g) as f64 / (gpus - 1) as f64;
    (bytes * off_node / hw.rank_inter_bandwidth())
        .max(bytes * (1.0 - off_node) / hw.rank_intra_bandwidth())
}

/// The dense gradients' ring all-reduce alone (what stays of the replicated layout's
/// gradient all-reduce; the experts' is replaced by the shard reduce-scatter).
pub fn dense_allreduce_s(hw: &HardwareProfile, model: &ModelProfile, gpus: usize) -> f64 {
    if gpus < 2 {
        return 0.0;
    }
    let v = 2.0 * (gpus - 1) as f64 / gpus as f64 * model.dense_grad_bytes() as f64;
    let bw = if hw.node_of(gpus - 1) > 0 {
        hw.rank_inter_bandwidth()
    } else {
        hw.rank_intra_bandwidth()
    };
    v / bw
}

/// An FSEP step: the token side of [`step_cost_sparse`] on the materialised layout `input`
/// (unpadded dispatch), its expert all-reduce replaced by the shard traffic of `shape`.
/// `grad_allreduce_s` is then the dense all-reduce only; `total_s` includes the shard time.
pub fn step_cost(
    hw: &HardwareProfile,
    model: &ModelProfile,
    input: &SparseStepInput,
    shape: &FsepShape,
) -> Result<(StepCost, ShardTraffic)> {
    let base = step_cost_sparse(hw, model, input)?;
    let traffic = shard_traffic(hw, model, input.gpus, shape)?;
    let dense = dense_allreduce_s(hw, model, input.gpus);
    let total_s = base.total_s - base.grad_allreduce_s + dense + traffic.shard_s;
    let c = StepCost {
        total_s,
        grad_allreduce_s: dense,
        tokens_per_s: (model.sequences_per_step(input.gpus) * model.seq_len) as f64 / total_s,
        ..base
    };
    Ok((c, traffic))
}
