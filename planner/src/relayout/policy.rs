//! All re-layout policies behind one call, and the anti-thrashing schedule.

use super::eplb::{EplbMode, eplb, eplb_remap};
use super::flexmoe::flexmoe;
use super::laer::{LaerParams, laer};
use super::{LayoutMigration, LinkModel, Score, Topology, migration};
use crate::error::PlanError;
use crate::migrate::{MappingMethod, PhysicalNode, map_nodes, min_cost_assignment};
use crate::place::{Grid, LayerPlacement};
use crate::{Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, plan_model};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A re-layout policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum RelayoutPolicy {
    /// Never change the layout.
    Static,
    /// Lazarus: Eq. 1 + MRO from scratch, mapped onto nodes and devices with the fewest moves.
    Lazarus,
    /// DeepSeek EPLB (stateless).
    Eplb { mode: EplbMode },
    /// EPLB, then its device rows permuted onto the devices that already hold them.
    EplbRemap { mode: EplbMode },
    /// FlexMoE-style incremental rounds.
    FlexMoe { max_rounds: usize },
    /// Ours: LAER-style incremental search with migration cost and resilience constraints.
    Laer(LaerParams),
}

impl RelayoutPolicy {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Lazarus => "lazarus",
            Self::Eplb {
                mode: EplbMode::Global,
            } => "eplb",
            Self::Eplb {
                mode: EplbMode::Hierarchical,
            } => "eplb-hier",
            Self::EplbRemap {
                mode: EplbMode::Global,
            } => "eplb-remap",
            Self::EplbRemap {
                mode: EplbMode::Hierarchical,
            } => "eplb-hier-remap",
            Self::FlexMoe { .. } => "flexmoe",
            Self::Laer(_) => "laer",
        }
    }
}

impl fmt::Display for RelayoutPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RelayoutPolicy {
    type Err = String;
    /// `static`, `lazarus`, `eplb`, `eplb-hier`, `eplb-remap`, `eplb-hier-remap`, `flexmoe`,
    /// `laer` (with default parameters).
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "static" => Self::Static,
            "lazarus" => Self::Lazarus,
            "eplb" => Self::Eplb {
                mode: EplbMode::Global,
            },
            "eplb-hier" => Self::Eplb {
                mode: EplbMode::Hierarchical,
            },
            "eplb-remap" => Self::EplbRemap {
                mode: EplbMode::Global,
            },
            "eplb-hier-remap" => Self::EplbRemap {
                mode: EplbMode::Hierarchical,
            },
            "flexmoe" => Self::FlexMoe { max_rounds: 10 },
            "laer" => Self::Laer(LaerParams::default()),
            _ => {
                return Err(format!(
                    "unknown policy {s:?} (expected static, lazarus, eplb, eplb-hier, eplb-remap, eplb-hier-remap, flexmoe or laer)"
                ));
            }
        })
    }
}

/// One decision: the new layout, what it moves, and the scores before and after.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RelayoutDecision {
    pub layout: LayerPlacement,
    pub migration: LayoutMigration,
    pub before: Score,
    pub after: Score,
}

/// Runs `policy` on one layer. `f` is used by Lazarus (allocation threshold); LAER takes its own
/// from its parameters, and also checks its actions against `long_traffic` when given.
pub fn relayout(
    policy: &RelayoutPolicy,
    topo: Topology,
    link: LinkModel,
    traffic: &[Vec<u64>],
    long_traffic: Option<&[Vec<u64>]>,
    current: &LayerPlacement,
    f: usize,
) -> Result<RelayoutDecision, PlanError> {
    let (layout, migration) =
        relayout_moves(policy, topo, link, traffic, long_traffic, current, f)?;
    let mut scorer = super::Scorer::default();
    Ok(RelayoutDecision {
        migration,
        before: scorer.score(topo, link, traffic, current)?,
        after: scorer.score(topo, link, traffic, &layout)?,
        layout,
    })
}

/// [`relayout`] without the scores before and after: the new layout and what it moves (a
/// replay that scores each layout under its own traffic needs no more).
pub fn relayout_moves(
    policy: &RelayoutPolicy,
    topo: Topology,
    link: LinkModel,
    traffic: &[Vec<u64>],
    long_traffic: Option<&[Vec<u64>]>,
    current: &LayerPlacement,
    f: usize,
) -> Result<(LayerPlacement, LayoutMigration), PlanError> {
    let layout = match policy {
        RelayoutPolicy::Static => current.clone(),
        RelayoutPolicy::Lazarus => lazarus_replan(topo, traffic, current, f)?,
        RelayoutPolicy::Eplb { mode } => eplb(topo, traffic, current.experts(), *mode)?,
        RelayoutPolicy::EplbRemap { mode } => eplb_remap(topo, traffic, current, *mode)?,
        RelayoutPolicy::FlexMoe { max_rounds } => {
            flexmoe(topo, link, traffic, current, *max_rounds)?
        }
        RelayoutPolicy::Laer(p) => laer(topo, link, traffic, long_traffic, current, p)?.layout,
    };
    let moved = migration(current, &layout, &link)?;
    Ok((layout, moved))
}

/// Lazarus's rebalance at device granularity: Eq. 1 + MRO for the nodes (`c` = the node's
/// slots), each node's slots split over its devices in order, plan nodes mapped onto physical
/// nodes with the optimal (Hungarian) mapping, then each node's device rows onto its devices
/// with the same assignment at device level — so a full replan moves only what it must.
pub fn lazarus_replan(
    topo: Topology,
    traffic: &[Vec<u64>],
    current: &LayerPlacement,
    f: usize,
) -> Result<LayerPlacement, PlanError> {
    topo.validate()?;
    let experts = current.experts();
    let loads: Vec<u64> = (0..experts)
        .map(|e| traffic.iter().map(|r| r[e]).sum())
        .collect();
    let nodes = topo.nodes();
    let per_node = topo.devices_per_node * topo.slots_per_device;
    let cluster = ClusterSpec::new(nodes, per_node).with_gpus_per_node(topo.devices_per_node);
    let model = ModelSpec {
        experts,
        layers: 1,
        f,
    };
    let plan = plan_model(
        &cluster,
        &model,
        &[loads],
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )?;
    // Node-level mapping onto the current holdings.
    // A node's devices are consecutive rows, so its slots are one run of cells.
    let node_rows = |grid: Grid<'_>| -> Vec<Vec<u32>> {
        grid.cells()
            .chunks(topo.devices_per_node * grid.slots())
            .map(<[u32]>::to_vec)
            .collect()
    };
    let plan_nodes: Vec<Vec<Vec<u32>>> = plan.layers[0]
        .grid()
        .iter()
        .map(|row| vec![row.to_vec()])
        .collect();
    let physical: Vec<PhysicalNode> = node_rows(current.grid())
        .into_iter()
        .enumerate()
        .map(|(n, row)| PhysicalNode {
            id: n as u32,
            holdings: vec![row],
        })
        .collect();
    let m = map_nodes(&plan_nodes, &physical, experts, MappingMethod::Optimal, 1)
        .map_err(|_| PlanError::ZeroReplicas { expert: 0 })?;
    let mut grid = vec![Vec::new(); topo.devices];
    for (q, &p) in m.plan_to_physical.iter().enumerate() {
        let p = p as usize;
        let row = &plan.layers[0].grid()[q];
        // Device split of the plan node (slots sorted by expert id, contiguous per device).
        let split: Vec<Vec<u32>> = row
            .chunks(topo.slots_per_device)
            .map(<[u32]>::to_vec)
            .collect();
        let devs: Vec<usize> =
            (p * topo.devices_per_node..(p + 1) * topo.devices_per_node).collect();
        // Device-level assignment inside the node: fewest experts each device lacks.
        let cost: Vec<Vec<u64>> = split
            .iter()
            .map(|want| {
                devs.iter()
                    .map(|&d| {
                        let mut w = want.clone();
                        w.dedup();
                        w.iter().filter(|e| !current.grid()[d].contains(e)).count() as u64
                    })
                    .collect()
            })
            .collect();
        for (i, j) in min_cost_assignment(&cost).into_iter().enumerate() {
            grid[devs[j]] = split[i].clone();
        }
    }
    LayerPlacement::from_grid(grid, experts, Some(&plan.allocations[0].replicas))
}

/// When to re-layout: never during warm-up, only every `period_steps`, and only when the load
/// ratio exceeds `imbalance_threshold` (hysteresis against thrashing on noise).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub warmup_steps: u64,
    pub period_steps: u64,
    /// Act only when max/mean device load exceeds this (1.0: always).
    pub imbalance_threshold: f64,
}

impl Schedule {
    /// Should a re-layout run at `step`, given the current layout's load ratio?
    pub fn due(&self, step: u64, load_ratio: f64) -> bool {
        step >= self.warmup_steps
            && self.period_steps > 0
            && step.is_multiple_of(self.period_steps)
            && load_ratio > self.imbalance_threshold
    }
}
