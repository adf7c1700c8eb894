//! The training systems compared by `lzsim replay`, one module each. They share the engine
//! ([`super::engine`]) and the cost model ([`crate::cost`]). The baselines (`ds`, `ds-ft`)
//! answer the engine's questions through [`System`]; `lazarus`, `laer` and `lazarus-fsep` are
//! the planner's job state machine ([`lazarus::Driver`]; the last two with sharded experts,
//! whose step cost is [`fsep`]'s), fed the engine's happenings, whose actions the engine
//! performs.

pub mod ds;
pub mod ep;
pub mod fsep;
pub mod lazarus;

use crate::cost::{Dispatch, HardwareProfile, ModelProfile};
use lazarus_planner::ModelPlan;
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// Physical node id: the index of the trace's node name in order of first appearance.
pub type NodeId = u32;

/// What the job runs on.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Nodes in use, in plan-node order (rank `r` lives on `nodes[r / gpus_per_node]`).
    pub nodes: Vec<NodeId>,
    /// The replicas of every MoE layer: the cost model's input.
    pub replicas: Replicas,
    pub dispatch: Dispatch,
    /// Padded dispatch only: ranks of each EP group.
    pub ep_groups: Option<Vec<Vec<usize>>>,
    /// `[node index][moe_layer]` = expert ids held (what survives a failure). Empty when
    /// `plan` is set: a plan's holdings are its grid rows, read by [`Layout::held`] (a
    /// node-major copy of the plan cost about 15 MB per reconfiguration at 2,048 nodes).
    /// Nodes with equal holdings may share one copy (standard EP: one per group position).
    pub holdings: Vec<std::sync::Arc<Vec<Vec<u32>>>>,
    /// Lazarus: the planner's plan.
    pub plan: Option<ModelPlan>,
    /// `laer`, `lazarus-fsep`: the sharded expert storage ([`fsep`]); `None` for the others.
    pub fsep: Option<Box<fsep::FsepLayout>>,
}

impl Layout {
    /// `[moe_layer]` = expert ids held by the node at index `i` of `nodes`.
    pub fn held(&self, i: usize) -> Vec<Vec<u32>> {
        match &self.plan {
            Some(plan) if self.holdings.is_empty() => {
                plan.layers.iter().map(|l| l.grid()[i].to_vec()).collect()
            }
            _ => self.holdings[i].as_ref().clone(),
        }
    }

    /// [`Self::held`] of every node, in `nodes` order. A plan's grid is read layer by layer,
    /// sequentially, instead of one row of each layer per node.
    pub fn held_all(&self) -> Vec<Vec<Vec<u32>>> {
        match &self.plan {
            Some(plan) if self.holdings.is_empty() => {
                let mut all: Vec<Vec<Vec<u32>>> = (0..self.nodes.len())
                    .map(|_| Vec::with_capacity(plan.layers.len()))
                    .collect();
                for layer in &plan.layers {
                    for (held, row) in all.iter_mut().zip(layer.grid()) {
                        held.push(row.to_vec());
                    }
                }
                all
            }
            _ => self.holdings.iter().map(|h| h.as_ref().clone()).collect(),
        }
    }

    pub fn gpus(&self, hw: &HardwareProfile) -> usize {
        self.nodes.len() * hw.gpus_per_node
    }
}

/// A layout's replica table.
#[derive(Debug, Clone, PartialEq)]
pub enum Replicas {
    /// `[moe_layer][expert]` → `(rank, replicas)` ([`crate::cost::SparseReplicas`]).
    Ranked(crate::cost::SparseReplicas),
    /// A plan's layers in runs of equal nodes ([`crate::cost::LayerRuns`]): one row per run,
    /// about 250 per layer at 2,048 nodes instead of 65,536 pairs.
    Runs(Vec<crate::cost::LayerRuns>),
    /// The same `[expert]` → `(rank, replicas)` rows in each of `layers` MoE layers (standard
    /// EP), held once instead of `layers` times.
    Uniform {
        rows: Vec<Vec<(u32, u32)>>,
        layers: usize,
    },
}

impl Replicas {
    /// The ranked form, `gpus_per_node` ranks per node (a copy for runs).
    pub fn ranked(
        &self,
        gpus_per_node: usize,
    ) -> std::borrow::Cow<'_, crate::cost::SparseReplicas> {
        match self {
            Replicas::Ranked(r) => std::borrow::Cow::Borrowed(r),
            Replicas::Runs(layers) => {
                std::borrow::Cow::Owned(crate::cost::expand_runs(layers, gpus_per_node))
            }
            Replicas::Uniform { rows, layers } => {
                std::borrow::Cow::Owned(vec![rows.clone(); *layers])
            }
        }
    }

    /// The rows of every layer as the cost model reads them; `None` for runs (see
    /// [`crate::cost::step_cost_runs`]).
    pub fn rows(&self) -> Option<crate::cost::LayerRows<'_>> {
        match self {
            Replicas::Ranked(r) => Some(crate::cost::LayerRows::Each(r)),
            Replicas::Uniform { rows, layers } => Some(crate::cost::LayerRows::Same {
                rows,
                layers: *layers,
            }),
            Replicas::Runs(_) => None,
        }
    }

    /// Whether both place the same replica counts on the same ranks. Runs that differ may
    /// still do (equal ranks from slot rows in another order), so they are compared ranked.
    pub fn same_ranks(&self, other: &Replicas, gpus_per_node: usize) -> bool {
        self == other || self.ranked(gpus_per_node) == other.ranked(gpus_per_node)
    }
}

/// Migration that a reconfiguration needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Migration {
    pub replicas: u64,
    pub bytes: u64,
    pub max_sent_bytes: u64,
    pub max_recv_bytes: u64,
}

/// How a system reacts to a detected failure or to new nodes.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Continue in place on `layout` after a pause of communicator rebuild + migration.
    Reconfigure {
        layout: Box<Layout>,
        migration: Migration,
    },
    /// Restart from the last checkpoint (progress since it is lost) on whatever the system
    /// chooses at restart time.
    RestartFromCheckpoint,
    /// Save a checkpoint, then restart on more nodes (no progress lost): DS scale-out.
    CheckpointAndRestart,
    /// Nothing to do.
    Keep,
}

/// Everything a system may consult; read-only.
pub struct Ctx<'a> {
    pub hw: &'a HardwareProfile,
    /// The model; its `f` is the fault-tolerance threshold Lazarus plans with.
    pub model: &'a ModelProfile,
}

/// One training system answering the engine's decision points (the baselines; `lazarus`'s
/// one-shot view for `lzsim reconfig` and cost estimates).
pub trait System {
    /// Layout for a (re)start on the `ready` nodes, or `None` when they are too few.
    fn start(&mut self, ctx: &Ctx, ready: &[NodeId], loads: &[Vec<u64>]) -> Option<Layout>;
    /// A failure killed `dead` (all in `current.nodes`); `ready` are all usable nodes now.
    fn on_failure(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        dead: &[NodeId],
        ready: &[NodeId],
        loads: &[Vec<u64>],
    ) -> Decision;
    /// Would the system use nodes it is not using now (checked when a node becomes ready)?
    fn wants_scale_out(&self, ctx: &Ctx, current: &Layout, ready: &[NodeId]) -> bool;
    /// Scale out at a step boundary (lazy, after the configured wait).
    fn scale_out(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        ready: &[NodeId],
        loads: &[Vec<u64>],
    ) -> Decision;
}

/// The systems `lzsim replay` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SystemKind {
    Ds,
    DsFt,
    Lazarus,
    /// Dropless standard EP (Megatron-Core style) with checkpoint restart.
    Dropless,
    /// Dropless standard EP with DS(FT)'s in-place recovery.
    DroplessFt,
    /// LAER-MoE: fully sharded experts, free re-layout, checkpoint restore on loss ([`fsep`]).
    Laer,
    /// Fully sharded experts with `f` copies of every shard and in-place repair ([`fsep`]).
    LazarusFsep,
}

impl SystemKind {
    /// The paper's three systems: what `all` selects.
    pub const ALL: [SystemKind; 3] = [Self::Lazarus, Self::DsFt, Self::Ds];
    /// Every system, the paper's and the dropless baselines.
    pub const KNOWN: [SystemKind; 7] = [
        Self::Lazarus,
        Self::DsFt,
        Self::Ds,
        Self::DroplessFt,
        Self::Dropless,
        Self::Laer,
        Self::LazarusFsep,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Self::Ds => "ds",
            Self::DsFt => "ds-ft",
            Self::Lazarus => "lazarus",
            Self::Dropless => "dropless",
            Self::DroplessFt => "dropless-ft",
            Self::Laer => "laer",
            Self::LazarusFsep => "lazarus-fsep",
        }
    }
    pub fn build(self) -> Box<dyn System> {
        match self {
            Self::Ds => Box::new(ds::Ds::new(false)),
            Self::DsFt => Box::new(ds::Ds::new(true)),
            Self::Dropless => Box::new(ds::Ds::dropless(false)),
            Self::DroplessFt => Box::new(ds::Ds::dropless(true)),
            Self::Lazarus => Box::new(lazarus::Lazarus),
            Self::Laer => Box::new(lazarus::Sharded { copies: Some(1) }),
            Self::LazarusFsep => Box::new(lazarus::Sharded { copies: None }),
        }
    }
}

impl fmt::Display for SystemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SystemKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::KNOWN
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown system {s:?} (expected lazarus, ds-ft, ds, dropless-ft, dropless, laer, lazarus-fsep or all)"
                )
            })
    }
}

/// Parses `lazarus,ds` or `all` (the paper's three; the dropless baselines are named).
pub fn parse_systems(text: &str) -> Result<Vec<SystemKind>, String> {
    if text.trim() == "all" {
        return Ok(SystemKind::ALL.to_vec());
    }
    let mut out: Vec<SystemKind> = Vec::new();
    for s in text.split(',') {
        let k: SystemKind = s.trim().parse()?;
        if !out.contains(&k) {
            out.push(k);
        }
    }
    Ok(out)
}
