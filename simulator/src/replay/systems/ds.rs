//! `ds` and `ds-ft` (paper §6.3), and the same rules on dropless EP: `dropless` and
//! `dropless-ft` (Megatron-Core style, [`crate::cost::Dispatch::Dropless`]).
//!
//! * `ds` — DeepSpeed-MoE with checkpoint/restart: static EP (EP size from the model profile),
//!   padded all-to-all; any failure of a node in use restarts from the last checkpoint on the
//!   largest multiple of the EP size among ready nodes. New nodes are taken lazily by saving a
//!   checkpoint and restarting on more nodes (our reading of "tries to use all nodes it can").
//! * `ds-ft` — DS plus Lazarus's reconfiguration module: if every expert still has a replica
//!   on a surviving node in use, the EP groups are reassigned in place on the largest multiple
//!   of the EP size of those survivors, fetching missing expert states from their owners (the
//!   planner's migration mapping chooses which survivor takes which EP position and which are
//!   dropped: optimal up to 256 nodes, then the `scalable` mapping, which is optimal when the
//!   nodes fall into few classes of equal contents, as EP nodes do); otherwise restart from
//!   the checkpoint. It never brings back nodes it
//!   dropped or new nodes without a restart (§6.3), so it does not scale out.

use super::{Ctx, Decision, Layout, Migration, NodeId, System, ep};
use crate::cost::Dispatch;
use lazarus_planner::migrate::{Held, Holders, MappingMethod, lost_experts_of, map_nodes_held};

pub struct Ds {
    fault_tolerant: bool,
    dispatch: Dispatch,
}

impl Ds {
    /// DeepSpeed-MoE (padded EP).
    pub fn new(fault_tolerant: bool) -> Self {
        Self {
            fault_tolerant,
            dispatch: Dispatch::Padded,
        }
    }

    /// `dropless` / `dropless-ft`: the same rules on dropless EP (Megatron-Core style: one
    /// replica per expert per EP group, static placement, no padding).
    pub fn dropless(fault_tolerant: bool) -> Self {
        Self {
            fault_tolerant,
            dispatch: Dispatch::Dropless,
        }
    }
}

impl System for Ds {
    fn start(&mut self, ctx: &Ctx, ready: &[NodeId], _loads: &[Vec<u64>]) -> Option<Layout> {
        let n = ep::usable_nodes(ctx.hw, ctx.model, ready.len());
        (n > 0).then(|| ep::layout(ctx.hw, ctx.model, ready[..n].to_vec(), self.dispatch))
    }

    fn on_failure(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        dead: &[NodeId],
        _ready: &[NodeId],
        _loads: &[Vec<u64>],
    ) -> Decision {
        if !self.fault_tolerant {
            return Decision::RestartFromCheckpoint;
        }
        // The survivors' holdings by reference: nodes at the same group position share one
        // list per layer, which a `PhysicalNode` each would copy (a million lists per failure
        // at 16,384 nodes).
        let (ids, held): (Vec<NodeId>, Vec<Held<'_>>) = current
            .nodes
            .iter()
            .zip(&current.holdings)
            .filter(|(id, _)| !dead.contains(id))
            .map(|(&id, h)| (id, Held::Lists(h.as_slice())))
            .unzip();
        let model = ctx.model;
        let lists = held.iter().map(|h| match h {
            Held::Lists(l) => *l,
            Held::Row(_) => unreachable!("lists only"),
        });
        if !lost_experts_of(lists, model.moe_layers, model.experts).is_empty() {
            return Decision::RestartFromCheckpoint;
        }
        let keep = ep::usable_nodes(ctx.hw, model, ids.len());
        if keep == 0 {
            return Decision::RestartFromCheckpoint;
        }
        let (contents, of) = ep::plan_nodes_shared(ctx.hw, model, keep, ids.len() - keep);
        let plan_nodes: Vec<&[Vec<u32>]> = of.iter().map(|&i| contents[i].as_slice()).collect();
        let survivors = Holders::Rows {
            ids: &ids,
            held: &held,
            layers: &[],
        };
        let Ok(m) = map_nodes_held(
            &plan_nodes,
            survivors,
            model.experts,
            MappingMethod::Scalable,
            model.bytes_per_expert_state,
        ) else {
            return Decision::RestartFromCheckpoint;
        };
        let nodes: Vec<NodeId> = m.plan_to_physical[..keep].to_vec();
        Decision::Reconfigure {
            layout: Box::new(ep::layout(ctx.hw, model, nodes, self.dispatch)),
            migration: Migration {
                replicas: m.new_replicas,
                bytes: m.bytes,
                max_sent_bytes: m.max_sent_bytes,
                max_recv_bytes: m.max_recv_bytes,
            },
        }
    }

    fn wants_scale_out(&self, ctx: &Ctx, current: &Layout, ready: &[NodeId]) -> bool {
        !self.fault_tolerant
            && ep::usable_nodes(ctx.hw, ctx.model, ready.len()) > current.nodes.len()
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
