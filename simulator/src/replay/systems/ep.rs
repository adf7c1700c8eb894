//! Standard expert-parallel layouts (DeepSpeed-MoE style) used by `ds` and `ds-ft`.
//!
//! `ep_size` GPUs form an EP group holding every expert once: the GPU at position `p` of a
//! group holds experts `p·E/EP .. (p+1)·E/EP` (paper §6.2). A cluster runs `G` groups, so each
//! expert has `G` replicas (uniform replication), and tokens stay inside their group.

use super::{Layout, NodeId, Replicas};
use crate::cost::{Dispatch, HardwareProfile, ModelProfile};
use std::sync::Arc;

/// How many whole nodes a layout on `available` nodes can use: the largest count whose GPUs
/// form whole EP groups.
pub fn usable_nodes(hw: &HardwareProfile, model: &ModelProfile, available: usize) -> usize {
    (0..=available)
        .rev()
        .find(|&n| n > 0 && (n * hw.gpus_per_node).is_multiple_of(model.ep_size))
        .unwrap_or(0)
}

/// The EP layout on exactly `nodes` (whose GPU count must be a multiple of `ep_size`): the
/// cost model's [`crate::cost::uniform_ep_layout`], built sparse (tested equal).
pub fn layout(
    hw: &HardwareProfile,
    model: &ModelProfile,
    nodes: Vec<NodeId>,
    dispatch: Dispatch,
) -> Layout {
    let g = hw.gpus_per_node;
    let gpus = nodes.len() * g;
    let ep = model.ep_size;
    assert!(
        gpus > 0 && gpus.is_multiple_of(ep),
        "a whole number of EP groups"
    );
    let per_rank = model.experts / ep;
    let groups = gpus / ep;
    // Expert `e` sits at position `e / per_rank` of every group.
    let layer: Vec<Vec<(u32, u32)>> = (0..model.experts)
        .map(|e| {
            if per_rank == 0 || e >= ep * per_rank {
                return Vec::new();
            }
            (0..groups)
                .map(|grp| ((grp * ep + e / per_rank) as u32, 1))
                .collect()
        })
        .collect();
    // A node's holdings depend on its first rank's position in its group only: nodes at the
    // same position share one copy (a few distinct ones instead of 2,048 × 58 lists).
    let mut at_position: Vec<Option<Arc<Vec<Vec<u32>>>>> = vec![None; ep];
    let holdings: Vec<Arc<Vec<Vec<u32>>>> =
        (0..nodes.len())
            .map(|n| {
                let shared = &mut at_position[(n * g) % ep];
                Arc::clone(shared.get_or_insert_with(|| {
                    Arc::new(vec![node_held(hw, model, n); model.moe_layers])
                }))
            })
            .collect();
    Layout {
        nodes,
        replicas: Replicas::Uniform {
            rows: layer,
            layers: model.moe_layers,
        },
        dispatch,
        ep_groups: Some(
            (0..groups)
                .map(|grp| (grp * ep..(grp + 1) * ep).collect())
                .collect(),
        ),
        holdings,
        plan: None,
        fsep: None,
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
    let mut out: Vec<Vec<Vec<u32>>> = (0..nodes)
        .map(|n| vec![node_held(hw, model, n); model.moe_layers])
        .collect();
    out.extend(std::iter::repeat_n(
        vec![Vec::new(); model.moe_layers],
        spare,
    ));
    out
}

/// [`plan_nodes`] with the lists shared: `(contents, of)`, where plan node `q` holds
/// `contents[of[q]]` (one per group position, and one blank), instead of a million lists at
/// 16,384 nodes. Tested equal to [`plan_nodes`].
pub fn plan_nodes_shared(
    hw: &HardwareProfile,
    model: &ModelProfile,
    nodes: usize,
    spare: usize,
) -> (Vec<Vec<Vec<u32>>>, Vec<usize>) {
    let mut contents: Vec<Vec<Vec<u32>>> = vec![vec![Vec::new(); model.moe_layers]];
    let mut at: std::collections::HashMap<Vec<u32>, usize> = Default::default();
    let mut of: Vec<usize> = (0..nodes)
        .map(|n| {
            let held = node_held(hw, model, n);
            *at.entry(held).or_insert_with_key(|held| {
                contents.push(vec![held.clone(); model.moe_layers]);
                contents.len() - 1
            })
        })
        .collect();
    of.extend(std::iter::repeat_n(0, spare));
    (contents, of)
}

/// Expert ids that node `n` of an EP layout holds in each layer, ascending: expert `e` sits
/// at position `e / (E / ep_size)` of every group.
fn node_held(hw: &HardwareProfile, model: &ModelProfile, n: usize) -> Vec<u32> {
    let (g, ep) = (hw.gpus_per_node, model.ep_size);
    let per_rank = model.experts / ep;
    let mut held: Vec<u32> = (n * g..(n + 1) * g)
        .flat_map(|rank| {
            let pos = rank % ep;
            (pos * per_rank..(pos + 1) * per_rank).map(|e| e as u32)
        })
        .collect();
    held.sort_unstable();
    held
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{self, sparse_replicas, uniform_ep_layout};

    /// A layout's one table for every layer costs a step exactly as the same table repeated
    /// per layer, for padded and dropless dispatch.
    #[test]
    fn uniform_rows_cost_what_the_repeated_rows_cost() {
        let hw = cost::hardware("h200-400g").unwrap();
        let model = cost::model("deepseek-v3").unwrap();
        let nodes = ep_nodes(&hw, &model);
        let loads: Vec<Vec<u64>> = (0..model.moe_layers as u64)
            .map(|l| {
                (0..model.experts as u64)
                    .map(|e| 1 + (e * 7919 + l * 104_729) % 977)
                    .collect()
            })
            .collect();
        for dispatch in [Dispatch::Padded, Dispatch::Dropless] {
            let uniform = layout(&hw, &model, (0..nodes as NodeId).collect(), dispatch);
            assert!(matches!(uniform.replicas, Replicas::Uniform { .. }));
            let repeated = Layout {
                replicas: Replicas::Ranked(uniform.replicas.ranked(hw.gpus_per_node).into_owned()),
                ..uniform.clone()
            };
            let cost_of = |l: &Layout| {
                super::super::fsep::layout_step_cost(&hw, &model, l, &loads)
                    .unwrap()
                    .0
            };
            let (a, b) = (cost_of(&uniform), cost_of(&repeated));
            assert_eq!(a.total_s.to_bits(), b.total_s.to_bits(), "{dispatch:?}");
            assert_eq!(a, b);
        }
    }

    /// The sparse layout is the cost model's dense EP layout, and each node holds what its
    /// ranks hold.
    #[test]
    fn sparse_layout_equals_the_dense_one() {
        let hw = cost::hardware("h200-400g").unwrap();
        let model = cost::model("deepseek-v3").unwrap();
        let nodes = ep_nodes(&hw, &model);
        let l = layout(
            &hw,
            &model,
            (0..nodes as NodeId).collect(),
            Dispatch::Padded,
        );
        let dense = uniform_ep_layout(&model, nodes * hw.gpus_per_node).unwrap();
        assert_eq!(
            *l.replicas.ranked(hw.gpus_per_node),
            sparse_replicas(&dense.replicas_per_rank)
        );
        assert_eq!(l.ep_groups.as_ref(), Some(&dense.ep_groups));
        let g = hw.gpus_per_node;
        for (n, held) in l.holdings.iter().enumerate() {
            for (layer, ids) in held.iter().enumerate() {
                let want: Vec<u32> = (0..model.experts as u32)
                    .flat_map(|e| {
                        let c: u32 = dense.replicas_per_rank[layer][e as usize][n * g..(n + 1) * g]
                            .iter()
                            .sum();
                        std::iter::repeat_n(e, c as usize)
                    })
                    .collect();
                assert_eq!(ids, &want, "node {n} layer {layer}");
            }
        }
    }

    /// The shared plan nodes are the plan nodes.
    #[test]
    fn shared_plan_nodes_equal_the_copies() {
        let hw = cost::hardware("h200-400g").unwrap();
        let model = cost::model("deepseek-v3").unwrap();
        for (nodes, spare) in [(8, 0), (16, 3), (24, 7)] {
            let (contents, of) = plan_nodes_shared(&hw, &model, nodes, spare);
            let shared: Vec<Vec<Vec<u32>>> = of.iter().map(|&i| contents[i].clone()).collect();
            assert_eq!(shared, plan_nodes(&hw, &model, nodes, spare));
            assert!(contents.len() <= 1 + model.ep_size / hw.gpus_per_node);
        }
    }

    /// Two EP groups' worth of nodes.
    fn ep_nodes(hw: &HardwareProfile, model: &ModelProfile) -> usize {
        2 * model.ep_size.div_ceil(hw.gpus_per_node)
    }
}
