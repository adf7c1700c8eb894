//! Standard expert-parallel layouts (DeepSpeed-MoE style) used by `ds` and `ds-ft`.
//!
//! `ep_size` GPUs form an EP group holding every expert once: the GPU at position `p` of a
//! group holds experts `p·E/EP .. (p+1)·E/EP` (paper §6.2). A cluster runs `G` groups, so each
//! expert has `G` replicas (uniform replication), and tokens stay inside their group.

use super::{Layout, NodeId};
use crate::cost::{Dispatch, HardwareProfile, ModelProfile, uniform_ep_layout};

/// How many whole nodes a layout on `available` nodes can use: the largest count whose GPUs
/// form whole EP groups.
pub fn usable_nodes(hw: &HardwareProfile, model: &ModelProfile, available: usize) -> usize {
    (0..=available)
        .rev()
        .find(|&n| n > 0 && (n * hw.gpus_per_node).is_multiple_of(model.ep_size))
        .unwrap_or(0)
}

/// The EP layout on exactly `nodes` (whose GPU count must be a multiple of `ep_size`), from
/// the cost model's [`crate::cost::uniform_ep_layout`].
pub fn layout(hw: &HardwareProfile, model: &ModelProfile, nodes: Vec<NodeId>) -> Layout {
    let g = hw.gpus_per_node;
    let ep = uniform_ep_layout(model, nodes.len() * g).expect("a whole number of EP groups");
    let holdings: Vec<Vec<Vec<u32>>> = (0..nodes.len())
        .map(|n| {
            ep.replicas_per_rank
                .iter()
                .map(|layer| {
                    (0..model.experts as u32)
                        .flat_map(|e| {
                            let count: u32 = layer[e as usize][n * g..(n + 1) * g].iter().sum();
                            std::iter::repeat_n(e, count as usize)
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    Layout {
        nodes,
        replicas_per_rank: ep.replicas_per_rank,
        dispatch: Dispatch::Padded,
        ep_groups: Some(ep.ep_groups),
        holdings,
        plan: None,
    }
}

/// Plan-node contents of the EP layout on `nodes` plan nodes, padded with `spare` empty plan
/// nodes: the shape `lazarus_planner::migrate::map_nodes` takes, so the planner picks which
/// survivors keep which EP position (and which are dropped) with the fewest transfers.
pub fn plan_nodes(
    hw: &HardwareProfile,
    model: &ModelProfile,
    nodes: usize,
    spare: usize,
) -> Vec<Vec<Vec<u32>>> {
    let mut out = layout(hw, model, (0..nodes as NodeId).collect()).holdings;
    out.extend(std::iter::repeat_n(
        vec![Vec::new(); model.moe_layers],
        spare,
    ));
    out
}
