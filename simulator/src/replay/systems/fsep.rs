//! `laer` and `lazarus-fsep`: fully sharded experts (FSEP) in the replay, on the same engine
//! and cost model as the other systems. This module is their **cost model** only; every
//! decision — restore, in-place repair, join — is the planner's job machine's
//! ([`lazarus_planner::job`] with `JobConfig::sharded_experts`, the rules of its `sharded`
//! submodule, the same machine `lzrun --expert-mode fsep` drives), fed by
//! [`super::lazarus::Driver::sharded`] exactly as the `lazarus` system's.
//!
//! * `laer` — LAER-MoE (our reference §1): every expert cut into `S` shards (`S` = the nodes
//!   of the start or restore), one copy each (`shard_copies = 1`). A lost node loses its
//!   shards of every expert → checkpoint restore, re-cut over the ready nodes. A new node
//!   joins in place (the machine's rule for every sharded job).
//! * `lazarus-fsep` — the same with `f` copies of every shard (`f` = the model profile's, or
//!   `--f`), placed by [`lazarus_planner::fsep::place`]: a lost node is repaired in place
//!   while every shard kept a copy, new nodes join in place (shard copies re-placed over the
//!   new membership).
//!
//! What is modelled here: each step materialises the balanced layout of the step's loads by
//! shard all-to-alls ([`crate::cost::fsep`]), re-planned for every load change at no pause
//! (re-layout is free in FSEP), with the planner's load-proportional allocation (Eq. 1 with
//! `f = 1`, the same min–max-per-copy apportionment as LAER's priority queue) and spread
//! placement, dispatched without padding ([`layout_step_cost`]); a reconfiguration's shard
//! copies cost [`shard_bytes`] each through the migration time.

use super::{Layout, Replicas};
use crate::cost::fsep::{FsepShape, ShardTraffic};
use crate::cost::{self, Dispatch, HardwareProfile, ModelProfile, StepCost};
use anyhow::Result;
use lazarus_planner::fsep::ShardPlacement;
use lazarus_planner::{Alignment, AllocPolicy, ModelSpec, PlacePolicy, plan_model};

/// The sharded storage of a layout: `placement` over the layout's nodes (plan order).
#[derive(Debug, Clone, PartialEq)]
pub struct FsepLayout {
    /// Copies per shard the system wants (`placement` may hold fewer when nodes are short).
    pub copies: usize,
    pub placement: ShardPlacement,
}

impl FsepLayout {
    /// What the step cost depends on.
    pub fn shape(&self, gpus_per_node: usize) -> FsepShape {
        let holder_nodes = self.placement.load().iter().filter(|&&l| l > 0).count();
        FsepShape {
            shards: self.placement.shards(),
            copies: self.placement.holders(0).len(),
            holder_ranks: holder_nodes * gpus_per_node,
        }
    }
}

/// Bytes of one shard index: that slice of every expert's weights and Adam state in every
/// MoE layer.
pub fn shard_bytes(model: &ModelProfile, shards: usize) -> u64 {
    ((model.moe_layers * model.experts) as u64 * model.bytes_per_expert_state)
        .div_ceil(shards as u64)
}

/// The layout FSEP materialises for `loads` on `nodes` nodes: Eq. 1 with `f = 1` and spread
/// placement on [`cost::fsep::slots_per_gpu`] slots per GPU, in the cost model's sparse form
/// (`None` when the slots cannot hold every expert).
pub fn materialised(
    hw: &HardwareProfile,
    model: &ModelProfile,
    nodes: usize,
    loads: &[Vec<u64>],
) -> Option<cost::SparseReplicas> {
    let g = hw.gpus_per_node;
    let c = cost::fsep::slots_per_gpu(model, nodes * g);
    let cluster = lazarus_planner::ClusterSpec::new(nodes, c * g).with_gpus_per_node(g);
    let spec = ModelSpec {
        f: 1,
        ..model.planner_spec()
    };
    let plan = plan_model(
        &cluster,
        &spec,
        loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Spread,
        Alignment::Aligned,
    )
    .ok()?;
    let dense: Vec<Vec<Vec<u32>>> = (0..plan.layers.len())
        .map(|l| plan.replicas_per_rank(l))
        .collect();
    Some(cost::sparse_replicas(&dense))
}

/// The step cost of `layout` under `loads`: FSEP layouts re-materialise the balanced layout
/// for these loads (free re-layout) and pay the shard traffic; others are
/// [`cost::step_cost_sparse`] as before.
pub fn layout_step_cost(
    hw: &HardwareProfile,
    model: &ModelProfile,
    layout: &Layout,
    loads: &[Vec<u64>],
) -> Result<(StepCost, Option<ShardTraffic>)> {
    let gpus = layout.gpus(hw);
    let Some(fsep) = &layout.fsep else {
        let c = match &layout.replicas {
            Replicas::Runs(runs) if layout.dispatch == Dispatch::Unpadded => {
                cost::step_cost_runs(hw, model, layout.nodes.len(), runs, loads)?
            }
            replicas => {
                // Runs under another dispatch (not made by any system) are read ranked.
                let ranked;
                let rows = match replicas.rows() {
                    Some(rows) => rows,
                    None => {
                        ranked = replicas.ranked(hw.gpus_per_node);
                        cost::LayerRows::Each(&ranked)
                    }
                };
                cost::step_cost_sparse(
                    hw,
                    model,
                    &cost::SparseStepInput {
                        gpus,
                        replicas: rows,
                        loads,
                        dispatch: layout.dispatch,
                        ep_groups: layout.ep_groups.as_deref(),
                        equal_nodes: None,
                    },
                )?
            }
        };
        return Ok((c, None));
    };
    let replicas = materialised(hw, model, layout.nodes.len(), loads)
        .ok_or_else(|| anyhow::anyhow!("FSEP: the slots cannot hold every expert"))?;
    let (c, t) = cost::fsep::step_cost(
        hw,
        model,
        &cost::SparseStepInput {
            gpus,
            replicas: cost::LayerRows::Each(&replicas),
            loads,
            dispatch: Dispatch::Unpadded,
            ep_groups: None,
            equal_nodes: None,
        },
        &fsep.shape(hw.gpus_per_node),
    )?;
    Ok((c, Some(t)))
}

#[cfg(test)]
mod tests;
