//! `lazarus` (paper §3–§5): Eq. 1 allocation + MRO placement on every ready node, flexible
//! (unpadded) dispatch, in-place reconfiguration after failures with the planner's optimal
//! migration mapping, checkpoint fallback only when some expert lost every replica, periodic
//! rebalance, and lazy scale-out. `f` is relaxed by the planner when slots run short.

use super::{Ctx, Decision, Layout, Migration, NodeId, System};
use crate::cost::Dispatch;
use lazarus_planner::migrate::{MappingMethod, MigrationPlan, PhysicalNode, lost_experts};
use lazarus_planner::{
    Alignment, AllocPolicy, ModelPlan, PlacePolicy, ReplanOptions, plan_model, replan,
};

#[derive(Default)]
pub struct Lazarus;

/// The cost model's view of a planner plan.
fn layout_of(ctx: &Ctx, mut plan: ModelPlan) -> Layout {
    // `replan` plans per node; the GPU split of each node's slots is a view on it.
    plan.cluster.gpus_per_node = ctx.hw.gpus_per_node;
    Layout {
        nodes: plan.node_map.clone(),
        replicas_per_rank: (0..plan.layers.len())
            .map(|l| plan.replicas_per_rank(l))
            .collect(),
        dispatch: Dispatch::Unpadded,
        ep_groups: None,
        holdings: plan.plan_node_contents(),
        plan: Some(plan),
    }
}

fn migration(m: &MigrationPlan) -> Migration {
    Migration {
        replicas: m.new_replicas,
        bytes: m.bytes,
        max_sent_bytes: m.max_sent_bytes,
        max_recv_bytes: m.max_recv_bytes,
    }
}

impl Lazarus {
    /// Replans on `physical` and maps the plan onto it; `None` when no plan fits (fewer slots
    /// than experts) or some needed expert has no holder.
    fn reconfigure(
        &self,
        ctx: &Ctx,
        physical: &[PhysicalNode],
        loads: &[Vec<u64>],
        version: u64,
    ) -> Option<Decision> {
        let options = ReplanOptions {
            alloc: AllocPolicy::Lazarus,
            place: PlacePolicy::Mro,
            mapping: MappingMethod::Optimal,
            bytes_per_expert: ctx.model.bytes_per_expert_state,
        };
        let (plan, m) = replan(
            physical,
            ctx.model.slots_per_gpu * ctx.hw.gpus_per_node,
            &ctx.model.planner_spec(),
            loads,
            &options,
            version,
        )
        .ok()?;
        Some(Decision::Reconfigure {
            layout: Box::new(layout_of(ctx, plan)),
            migration: migration(&m),
        })
    }
}

fn physical_nodes(current: &Layout) -> Vec<PhysicalNode> {
    current
        .nodes
        .iter()
        .zip(&current.holdings)
        .map(|(&id, h)| PhysicalNode {
            id,
            holdings: h.clone(),
        })
        .collect()
}

/// Appends the ready nodes the job does not use yet, holding nothing.
fn add_spares(physical: &mut Vec<PhysicalNode>, current: &Layout, ready: &[NodeId]) {
    for &id in ready {
        if !current.nodes.contains(&id) {
            physical.push(PhysicalNode {
                id,
                holdings: Vec::new(),
            });
        }
    }
}

fn version(current: &Layout) -> u64 {
    current.plan.as_ref().map_or(0, |p| p.version)
}

impl System for Lazarus {
    fn start(&mut self, ctx: &Ctx, ready: &[NodeId], loads: &[Vec<u64>]) -> Option<Layout> {
        if ready.is_empty() {
            return None;
        }
        let cluster = ctx.hw.cluster_spec(ctx.model, ready.len());
        let mut plan = plan_model(
            &cluster,
            &ctx.model.planner_spec(),
            loads,
            AllocPolicy::Lazarus,
            PlacePolicy::Mro,
            Alignment::Aligned,
        )
        .ok()?;
        plan.node_map = ready.to_vec();
        Some(layout_of(ctx, plan))
    }

    fn on_failure(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        dead: &[NodeId],
        ready: &[NodeId],
        loads: &[Vec<u64>],
    ) -> Decision {
        let mut physical: Vec<PhysicalNode> = physical_nodes(current)
            .into_iter()
            .filter(|n| !dead.contains(&n.id))
            .collect();
        if !lost_experts(&physical, ctx.model.moe_layers, ctx.model.experts).is_empty() {
            return Decision::RestartFromCheckpoint;
        }
        // Spare ready nodes join the new plan too: the job is reconfiguring anyway.
        add_spares(&mut physical, current, ready);
        self.reconfigure(ctx, &physical, loads, version(current))
            .unwrap_or(Decision::RestartFromCheckpoint)
    }

    fn wants_scale_out(&self, _ctx: &Ctx, current: &Layout, ready: &[NodeId]) -> bool {
        ready.len() > current.nodes.len()
    }

    fn scale_out(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        ready: &[NodeId],
        loads: &[Vec<u64>],
    ) -> Decision {
        let mut physical = physical_nodes(current);
        add_spares(&mut physical, current, ready);
        self.reconfigure(ctx, &physical, loads, version(current))
            .unwrap_or(Decision::Keep)
    }

    fn rebalance(&mut self, ctx: &Ctx, current: &Layout, loads: &[Vec<u64>]) -> Decision {
        self.reconfigure(ctx, &physical_nodes(current), loads, version(current))
            .unwrap_or(Decision::Keep)
    }
}
