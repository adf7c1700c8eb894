//! `laer` and `lazarus-fsep`: fully sharded experts (FSEP) in the replay, on the same engine
//! and cost model as the other systems.
//!
//! * `laer` — LAER-MoE (our reference §1): every expert cut into `S` shards (`S` = the GPUs at
//!   the (re)start), one copy each. Each step materialises the layout's experts by shard
//!   all-to-alls ([`crate::cost::fsep`]); the layout is re-planned for every load change at no
//!   pause (re-layout is free in FSEP), with the planner's load-proportional allocation (Eq. 1
//!   with `f = 1`, the same min–max-per-copy apportionment as LAER's priority queue) and spread
//!   placement, dispatched without padding. Not resilient: a lost node loses its shards of
//!   every expert → checkpoint restore and an offline reshard onto the ready nodes (the
//!   restart's checkpoint load is the reshard: every rank reads its new shards). New nodes:
//!   checkpoint and restart on all of them (LAER's `N` is fixed at launch).
//! * `lazarus-fsep` — the same step cost plus `f` copies of every shard (`f` = the model
//!   profile's, or `--f`), placed by [`lazarus_planner::fsep::place`]. On a node loss the
//!   planner's [`repair`] rebuilds the lost copies in place (the bytes go through the cost
//!   model's migration time, after the communicator rebuild) unless every copy of some shard is
//!   gone → checkpoint restore. New nodes join in place (a communicator rebuild, no shard
//!   moves: they compute from the next step, and later repairs may place copies on them).
//!
//! **Why not the job state machine.** `lazarus` is driven by [`lazarus_planner::job`]. The
//! machine now knows sharded plans too (`JobConfig::sharded_experts` with `shard_copies`: a lost
//! member is repaired in place by [`repair`] while every shard keeps a copy — what `lzrun
//! --expert-mode fsep --shard-copies f` runs), but its step accounting is per member and per
//! step, while these systems re-plan the layout at every load change of the replay, for free,
//! and count steps in bulk. Until the replay drives the machine for sharded plans (left: the
//! machine would also need the per-load-change free re-layout), this system applies the same
//! rules (in place iff every shard keeps a copy, restore otherwise, lazy scale-out after the
//! engine's wait) with the same planner functions ([`place`], [`repair`]) making every
//! decision. One difference: `lzrun` still restores when a node joins a sharded job, while this
//! system lets it join in place (no shard moves), so `lzsim predict` of an FSEP run with a join
//! under-predicts its restores.

use super::{Ctx, Decision, Layout, Migration, NodeId, Replicas, System};
use crate::cost::fsep::{FsepShape, ShardTraffic};
use crate::cost::{self, Dispatch, HardwareProfile, ModelProfile, StepCost};
use anyhow::Result;
use lazarus_planner::fsep::{FsepSpec, RepairOutcome, ShardPlacement, min_capacity, place, repair};
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

/// An FSEP layout on `nodes` with `placement`.
fn layout(ctx: &Ctx, nodes: Vec<NodeId>, copies: usize, placement: ShardPlacement) -> Layout {
    let n = nodes.len();
    Layout {
        nodes,
        // The cost model re-materialises per load change; this is never read for FSEP.
        replicas: Replicas::Ranked(Vec::new()),
        dispatch: Dispatch::Unpadded,
        ep_groups: None,
        // No expert lives anywhere between steps: only shards do.
        // Shared on purpose: every node holds the same (nothing replicated).
        holdings: {
            let none = std::sync::Arc::new(vec![Vec::new(); ctx.model.moe_layers]);
            (0..n).map(|_| std::sync::Arc::clone(&none)).collect()
        },
        plan: None,
        fsep: Some(Box::new(FsepLayout { copies, placement })),
    }
}

/// A fresh start on `ready`: `S` = their GPUs, `copies` (clamped to the nodes) per shard on
/// the balanced room. `None` when no node is ready or the slots cannot hold every expert.
fn start(ctx: &Ctx, ready: &[NodeId], copies: usize) -> Option<Layout> {
    let n = ready.len();
    if n == 0 || n * ctx.hw.gpus_per_node * ctx.model.slots_per_gpu < ctx.model.experts {
        return None;
    }
    let shards = n * ctx.hw.gpus_per_node;
    let copies = copies.min(n);
    let placement = place(&FsepSpec::balanced(n, shards, copies)).ok()?;
    Some(layout(ctx, ready.to_vec(), copies, placement))
}

/// `laer`: FSEP with one copy per shard; see the [module docs](self).
#[derive(Debug, Default)]
pub struct Laer;

impl System for Laer {
    fn start(&mut self, ctx: &Ctx, ready: &[NodeId], _loads: &[Vec<u64>]) -> Option<Layout> {
        start(ctx, ready, 1)
    }

    /// Every node holds shards of every expert: any loss needs the checkpoint.
    fn on_failure(
        &mut self,
        _ctx: &Ctx,
        _current: &Layout,
        _dead: &[NodeId],
        _ready: &[NodeId],
        _loads: &[Vec<u64>],
    ) -> Decision {
        Decision::RestartFromCheckpoint
    }

    fn wants_scale_out(&self, _ctx: &Ctx, current: &Layout, ready: &[NodeId]) -> bool {
        ready.len() > current.nodes.len()
    }

    fn scale_out(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        ready: &[NodeId],
        _loads: &[Vec<u64>],
    ) -> Decision {
        if self.wants_scale_out(ctx, current, ready) {
            Decision::CheckpointAndRestart
        } else {
            Decision::Keep
        }
    }
}

/// `lazarus-fsep`: FSEP with `f` copies per shard and in-place repair; see the
/// [module docs](self).
#[derive(Debug, Default)]
pub struct LazarusFsep;

/// The repair decision for `dead` (physical ids) on `current`.
pub fn repair_decision(ctx: &Ctx, current: &Layout, dead: &[NodeId]) -> Decision {
    let Some(fsep) = &current.fsep else {
        return Decision::RestartFromCheckpoint;
    };
    let dead_pos: Vec<u32> = dead
        .iter()
        .filter_map(|id| current.nodes.iter().position(|n| n == id))
        .map(|p| p as u32)
        .collect();
    let p = &fsep.placement;
    let alive = p.nodes() - dead_pos.len();
    if alive == 0 {
        return Decision::RestartFromCheckpoint;
    }
    // Room: the balanced share of the survivors, and never less than a survivor holds now.
    let copies = fsep.copies.min(alive);
    let held = p
        .load()
        .iter()
        .enumerate()
        .filter(|(i, _)| !dead_pos.contains(&(*i as u32)))
        .map(|(_, &l)| l)
        .max()
        .unwrap_or(0);
    let capacity = min_capacity(alive, p.shards(), copies).max(held);
    match repair(p, fsep.copies, &dead_pos, capacity) {
        Ok(RepairOutcome::InPlace(r)) => {
            let bytes_per_shard = shard_bytes(ctx.model, p.shards());
            let (max_sent, max_recv) = r.max_sent_received();
            let nodes: Vec<NodeId> = r
                .survivors
                .iter()
                .map(|&i| current.nodes[i as usize])
                .collect();
            Decision::Reconfigure {
                layout: Box::new(layout(ctx, nodes, fsep.copies, r.placement)),
                migration: Migration {
                    replicas: r.transfers.len() as u64,
                    bytes: r.transfers.len() as u64 * bytes_per_shard,
                    max_sent_bytes: max_sent as u64 * bytes_per_shard,
                    max_recv_bytes: max_recv as u64 * bytes_per_shard,
                },
            }
        }
        Ok(RepairOutcome::RestoreCheckpoint { .. }) | Err(_) => Decision::RestartFromCheckpoint,
    }
}

impl System for LazarusFsep {
    fn start(&mut self, ctx: &Ctx, ready: &[NodeId], _loads: &[Vec<u64>]) -> Option<Layout> {
        start(ctx, ready, ctx.model.f)
    }

    fn on_failure(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        dead: &[NodeId],
        _ready: &[NodeId],
        _loads: &[Vec<u64>],
    ) -> Decision {
        repair_decision(ctx, current, dead)
    }

    fn wants_scale_out(&self, _ctx: &Ctx, current: &Layout, ready: &[NodeId]) -> bool {
        ready.len() > current.nodes.len()
    }

    /// New nodes join in place: shards stay, the newcomers compute from the next step.
    fn scale_out(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        ready: &[NodeId],
        _loads: &[Vec<u64>],
    ) -> Decision {
        let Some(fsep) = &current.fsep else {
            return Decision::Keep;
        };
        let mut nodes = current.nodes.clone();
        nodes.extend(
            ready
                .iter()
                .copied()
                .filter(|id| !current.nodes.contains(id)),
        );
        if nodes.len() == current.nodes.len() {
            return Decision::Keep;
        }
        let Ok(placement) = ShardPlacement::new(nodes.len(), fsep.placement.all_holders().to_vec())
        else {
            return Decision::Keep;
        };
        Decision::Reconfigure {
            layout: Box::new(layout(ctx, nodes, fsep.copies, placement)),
            migration: Migration::default(),
        }
    }
}

#[cfg(test)]
mod tests;
