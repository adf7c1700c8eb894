//! Whole-model plans: one allocation and placement per MoE layer, on one shared set of plan
//! nodes, plus the plan-node → physical-node map.
//!
//! ## Aligning layers
//! Allocation and placement are per layer (loads differ per layer, Fig. 2), but a node failure
//! hits every layer at once, and the model recovers only if *every* layer does. Under MRO a
//! layer fails exactly when one of its node blocks dies entirely. If each layer were mapped onto
//! the physical nodes independently, those fatal events would be spread over many different
//! node sets and the model-level probability would approach the *product* of the layers'.
//! [`plan_model`] instead lays out every layer's blocks on the same plan nodes, in the same
//! order — ascending block size from node 0, which is what MRO's rank order yields. Then a
//! small block of one layer sits inside the corresponding (larger or equal) block of another,
//! and "block B dead" implies "block B' ⊇ B dead": most fatal events coincide and the model's
//! probability stays close to its weakest layer's (it equals it when the layers' block sizes
//! match). [`Alignment::Independent`] keeps the per-layer shuffle for comparison; the test
//! `aligned_layers_beat_independent_mapping` and the README quantify the gain.

use crate::allocate::{AllocPolicy, Allocation, allocate};
use crate::error::PlanError;
use crate::migrate::{
    Holders, MappingMethod, MigrateError, MigrationPlan, PhysicalNode, map_layers_held,
};
use crate::place::{LayerPlacement, MroPlacer, PlacePolicy, place};
use crate::spec::{ClusterSpec, ModelSpec};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// How the layers' plan nodes are laid over each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Alignment {
    /// Every layer's blocks on the same plan nodes (the default).
    Aligned,
    /// Each layer's nodes shuffled independently (seeded) — the baseline that ignores layers.
    Independent { seed: u64 },
}

/// A whole-model plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelPlan {
    /// Increases by one with every new plan the controller issues.
    pub version: u64,
    pub cluster: ClusterSpec,
    pub model: ModelSpec,
    pub alloc: AllocPolicy,
    pub place: PlacePolicy,
    pub allocations: Vec<Allocation>,
    /// Per layer, over plan nodes `0..N`.
    pub layers: Vec<LayerPlacement>,
    /// Physical node id playing each plan node (identity until a migration mapping sets it).
    pub node_map: Vec<u32>,
}

impl ModelPlan {
    /// `[plan node][layer]` = expert ids in that node's slots: the shape
    /// [`crate::migrate::map_nodes`] takes.
    pub fn plan_node_contents(&self) -> Vec<Vec<Vec<u32>>> {
        (0..self.cluster.nodes)
            .map(|q| self.layers.iter().map(|l| l.grid()[q].to_vec()).collect())
            .collect()
    }

    /// `R[e][rank]` of layer `layer` for the dispatcher ([`crate::dispatch::plan`]): ranks are
    /// GPUs, numbered `plan_node · gpus_per_node + gpu`, and a node's slots are split over its
    /// GPUs by [`ClusterSpec::gpu_of_slot`].
    pub fn replicas_per_rank(&self, layer: usize) -> Vec<Vec<u32>> {
        let g = self.cluster.gpus_per_node.max(1);
        let mut r = vec![vec![0u32; self.cluster.nodes * g]; self.model.experts];
        for (node, slots) in self.layers[layer].grid().iter().enumerate() {
            for (slot, &e) in slots.iter().enumerate() {
                r[e as usize][node * g + self.cluster.gpu_of_slot(slot)] += 1;
            }
        }
        r
    }

    /// Replicas per expert of each layer.
    pub fn replicas(&self) -> Vec<Vec<usize>> {
        self.allocations
            .iter()
            .map(|a| a.replicas.clone())
            .collect()
    }
}

/// Plans every layer: allocation from `loads[layer]`, placement, then alignment.
pub fn plan_model(
    cluster: &ClusterSpec,
    model: &ModelSpec,
    loads: &[Vec<u64>],
    alloc: AllocPolicy,
    place_policy: PlacePolicy,
    alignment: Alignment,
) -> Result<ModelPlan, PlanError> {
    cluster.validate()?;
    model.validate()?;
    if loads.len() != model.layers {
        return Err(PlanError::LayerCount {
            expected: model.layers,
            got: loads.len(),
        });
    }
    if cluster.total_slots() < model.experts {
        return Err(PlanError::TooFewSlots {
            experts: model.experts,
            slots: cluster.total_slots(),
        });
    }
    // Allocations first (layers in parallel: pure and independent), kept in layer order up to
    // the first layer that fails (its error is reported unless an earlier layer's placement
    // fails).
    let allocated: Vec<Result<Allocation, PlanError>> = loads
        .par_iter()
        .map(|layer_loads| {
            if layer_loads.len() != model.experts {
                return Err(PlanError::LoadCount {
                    expected: model.experts,
                    got: layer_loads.len(),
                });
            }
            allocate(alloc, layer_loads, cluster.total_slots(), model.f)
        })
        .collect();
    let mut allocations = Vec::with_capacity(model.layers);
    let mut failed = None;
    for a in allocated {
        match a {
            Ok(a) => allocations.push(a),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    // Layers with equal sorted replica counts share one MRO construction (see `MroPlacer`),
    // which a placer keeps from one layer to the next. So runs of consecutive layers with
    // equal sorted counts are placed by one placer each, and the runs in parallel: a placer
    // gives `place`'s result whatever it holds, so the placements are the sequential ones.
    let sorted: Vec<Vec<usize>> = allocations
        .par_iter()
        .map(|a| {
            let mut r = a.replicas.clone();
            r.sort_unstable();
            r
        })
        .collect();
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for l in 0..allocations.len() {
        match runs.last_mut() {
            Some(run) if sorted[l] == sorted[l - 1] => run.end = l + 1,
            _ => runs.push(l..l + 1),
        }
    }
    let place_layer = |mro: &mut MroPlacer, l: usize| -> Result<LayerPlacement, PlanError> {
        let a: &Allocation = &allocations[l];
        // Random placement: a different (seeded) arrangement per layer.
        let policy = match place_policy {
            PlacePolicy::Random { seed } => PlacePolicy::Random {
                seed: seed.wrapping_add(l as u64),
            },
            p => p,
        };
        let mut p = match policy {
            PlacePolicy::Mro => mro.place(&a.replicas, cluster.nodes, cluster.slots_per_node)?,
            _ => place(policy, &a.replicas, cluster.nodes, cluster.slots_per_node)?,
        };
        if let Alignment::Independent { seed } = alignment {
            let mut perm: Vec<usize> = (0..cluster.nodes).collect();
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed.wrapping_add(l as u64));
            perm.shuffle(&mut rng);
            p = p.permute_nodes(&perm);
        }
        Ok(p)
    };
    let placed: Vec<Vec<Result<LayerPlacement, PlanError>>> = runs
        .par_iter()
        .map(|run| {
            let mut mro = MroPlacer::default();
            run.clone().map(|l| place_layer(&mut mro, l)).collect()
        })
        .collect();
    // The first failing layer's error, as the sequential loop reported.
    let layers = placed
        .into_iter()
        .flatten()
        .collect::<Result<Vec<LayerPlacement>, PlanError>>()?;
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(ModelPlan {
        version: 0,
        cluster: cluster.clone(),
        model: *model,
        alloc,
        place: place_policy,
        allocations,
        layers,
        node_map: (0..cluster.nodes as u32).collect(),
    })
}

impl ModelPlan {
    /// What each physical node holds once this plan is in force: `[PhysicalNode]` in plan-node
    /// order, ready to be the `physical` input of the next [`replan`].
    pub fn physical_nodes(&self) -> Vec<PhysicalNode> {
        self.plan_node_contents()
            .into_iter()
            .zip(&self.node_map)
            .map(|(holdings, &id)| PhysicalNode { id, holdings })
            .collect()
    }
}

/// Why a replan failed: a planning error, or a migration error (notably
/// [`MigrateError::ExpertLost`], which means the caller must restore from a checkpoint).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReplanError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Migrate(#[from] MigrateError),
}

/// What a reconfiguration needs besides the nodes and loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplanOptions {
    pub alloc: AllocPolicy,
    pub place: PlacePolicy,
    pub mapping: MappingMethod,
    /// Parameters + optimizer state of one expert replica (e.g. 63 MB for GPT-S, §5.4).
    pub bytes_per_expert: u64,
}

/// Reconfiguration (§4.3, §5): a fresh whole-model plan for exactly the usable `physical`
/// nodes (survivors of a failure, plus any new empty nodes on scale-out), then the mapping of
/// its plan nodes onto those physical nodes that moves the fewest expert states. The returned
/// plan's `node_map` and `version` (`previous_version + 1`) are set.
pub fn replan(
    physical: &[PhysicalNode],
    slots_per_node: usize,
    model: &ModelSpec,
    loads: &[Vec<u64>],
    options: &ReplanOptions,
    previous_version: u64,
) -> Result<(ModelPlan, MigrationPlan), ReplanError> {
    replan_held(
        Holders::Nodes(physical),
        slots_per_node,
        model,
        loads,
        options,
        previous_version,
    )
}

/// [`replan`] with the holdings given by reference (see [`Holders`]): the same result as for
/// the equal [`PhysicalNode`]s.
pub fn replan_held(
    physical: Holders<'_>,
    slots_per_node: usize,
    model: &ModelSpec,
    loads: &[Vec<u64>],
    options: &ReplanOptions,
    previous_version: u64,
) -> Result<(ModelPlan, MigrationPlan), ReplanError> {
    let cluster = ClusterSpec::new(physical.len(), slots_per_node);
    let mut plan = plan_model(
        &cluster,
        model,
        loads,
        options.alloc,
        options.place,
        Alignment::Aligned,
    )?;
    let migration = map_layers_held(
        &plan.layers,
        physical,
        model.experts,
        options.mapping,
        options.bytes_per_expert,
    )?;
    plan.node_map = migration.plan_to_physical.clone();
    plan.version = previous_version + 1;
    Ok((plan, migration))
}
