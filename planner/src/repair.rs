//! Repair-first recovery: keep the layout in force on the survivors and re-create only what
//! the event made necessary (issue 42).
//!
//! The paper's rule (§4.3, [`crate::replan`]) re-runs Eq. 1 on the routing window's current
//! loads and re-places the whole model after every failure and join; the mapping can then keep
//! only what the new allocation still wants. At 16,384 nodes that moved about 131,000 expert
//! states per node loss, where the node itself held `c · L` (32 · 58 = 1,856). [`repair_held`]
//! instead:
//!
//! * keeps every survivor's rows as they are (nothing moves that does not have to);
//! * for each `(layer, expert)` that lost replicas, re-creates one **now** when the expert sits
//!   on fewer than `min(f, N)` distinct nodes (the floor that makes the next `f − 1` failures
//!   survivable), or when its per-replica load would exceed `(1 + load_slack)` × the layer's
//!   busiest per-replica load before the event (so the step's busiest rank, a sum of its
//!   slots' per-replica loads, grows by at most that factor per slot); at most as many as the
//!   expert lost;
//! * puts each re-created replica in a newcomer's free slot if there is one, else in the slot
//!   of the **most over-replicated** expert (lowest per-replica load once it gives one up,
//!   keeping it on `min(f, N)` distinct nodes), preferring a node that already took a repair
//!   of this layer in this event, so that a lost node's experts gather on one survivor and the
//!   layout keeps MRO's overlapping rows where it can;
//! * fills a newcomer's remaining slots with the experts of the highest per-replica load
//!   (Eq. 1's proportional rule applied one replica at a time), each expert once per node.
//!
//! The full replan still happens, later, as a background re-optimisation (the job machine's
//! rebalance, through the asynchronous migration where configured): see
//! [`crate::job::RecoveryPolicy`].

use crate::allocate::Allocation;
use crate::migrate::{Holders, MappingMethod, MigrateError, MigrationPlan, check_rows};
use crate::model::ModelPlan;
use crate::place::LayerPlacement;
use crate::spec::{ClusterSpec, ModelSpec};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// A slot of a newcomer not yet given an expert.
const FREE: u32 = u32::MAX;

/// The default [`RepairOptions::load_slack`]: a re-created replica is needed only where an
/// expert's per-replica load would more than double the busiest replica's before the event.
/// At frontier scale (thousands of replicas per expert) a node loss raises a per-replica load
/// by well under 1 %, so only the floor forces copies; in a 4–8-node job it lets a step run
/// up to 2× slower until the background re-optimisation lands, rather than copy every lost
/// replica at once.
pub const DEFAULT_LOAD_SLACK: f64 = 1.0;

/// What a repair may spend and how it is costed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RepairOptions {
    /// See [`DEFAULT_LOAD_SLACK`]; 0 re-creates every lost replica whose expert is now busier
    /// per replica than the busiest replica before the event.
    pub load_slack: f64,
    /// Parameters + optimizer state of one expert replica, for the migration's bytes.
    pub bytes_per_expert: u64,
}

impl Default for RepairOptions {
    fn default() -> Self {
        Self {
            load_slack: DEFAULT_LOAD_SLACK,
            bytes_per_expert: 0,
        }
    }
}

/// Counts of one repair, summed over layers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepairStats {
    /// Replicas re-created because their expert fell below `min(f, N)` distinct nodes.
    pub floor_copies: u64,
    /// Replicas re-created to keep the per-replica load within the bound.
    pub load_copies: u64,
    /// Lost replicas left for the background re-optimisation.
    pub deferred: u64,
    /// Newcomer slots filled with hot experts.
    pub join_copies: u64,
    /// Survivor slots given up by over-replicated experts to a re-created replica.
    pub evicted: u64,
    /// Fewest distinct nodes any expert of any layer sits on after the repair.
    pub min_distinct: usize,
}

impl RepairStats {
    /// Replicas copied in all.
    pub fn copies(&self) -> u64 {
        self.floor_copies + self.load_copies + self.join_copies
    }
}

/// Why a repair could not be made: the caller falls back to the full replan (or, for a lost
/// expert, to a checkpoint).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RepairError {
    #[error("node {node} reports {got} replicas in layer {layer}, its rows have {slots} slots")]
    Shape {
        node: u32,
        layer: usize,
        got: usize,
        slots: usize,
    },
    #[error(
        "no slot can take a copy of expert {expert} of layer {layer} without leaving another below the floor"
    )]
    NoDonor { layer: usize, expert: usize },
    #[error("the previous plan has {plan} layers, the model {model}")]
    LayerCount { plan: usize, model: usize },
    #[error(transparent)]
    Migrate(#[from] MigrateError),
}

/// A repaired plan: plan node `p` is `holders.id(p)` (the mapping is the identity, so every
/// transfer goes into a slot whose content changed), with the migration that realises it.
#[derive(Debug, Clone, PartialEq)]
pub struct Repaired {
    pub plan: ModelPlan,
    pub migration: MigrationPlan,
    pub stats: RepairStats,
}

/// Repairs `previous` for the nodes `holders` (survivors holding rows of it, in rank order,
/// and blank newcomers): see the [module docs](self). `loads[l][e]` are the routing window's
/// loads (all zero: every expert weighs the same). The plan's version is `previous.version + 1`
/// unless `version` says otherwise.
///
/// # Errors
/// [`RepairError`]: a survivor whose holdings are not a full row, a floor no slot can restore,
/// or an expert no node holds ([`MigrateError::ExpertLost`]).
pub fn repair_held(
    holders: Holders<'_>,
    previous: &ModelPlan,
    model: &ModelSpec,
    loads: &[Vec<u64>],
    options: &RepairOptions,
    version: u64,
) -> Result<Repaired, RepairError> {
    check_rows(holders)?;
    let layers = model.layers;
    if previous.layers.len() != layers {
        return Err(RepairError::LayerCount {
            plan: previous.layers.len(),
            model: layers,
        });
    }
    let n = holders.len();
    let c = previous.cluster.slots_per_node;
    let floor = model.f.min(n);
    let repaired: Vec<Result<RepairedLayer, RepairError>> = (0..layers)
        .into_par_iter()
        .map(|l| {
            let before = previous.allocations.get(l).map(|a| a.replicas.as_slice());
            let loads = loads.get(l).map_or(&[][..], Vec::as_slice);
            repair_layer(
                holders,
                l,
                c,
                model.experts,
                floor,
                loads,
                before,
                options.load_slack,
            )
        })
        .collect();
    let mut placements = Vec::with_capacity(layers);
    let mut allocations = Vec::with_capacity(layers);
    let mut stats = RepairStats {
        min_distinct: usize::MAX,
        ..RepairStats::default()
    };
    for r in repaired {
        let (p, counts, s) = r?;
        placements.push(p);
        allocations.push(Allocation {
            replicas: counts,
            f_effective: floor,
        });
        stats.floor_copies += s.floor_copies;
        stats.load_copies += s.load_copies;
        stats.deferred += s.deferred;
        stats.join_copies += s.join_copies;
        stats.evicted += s.evicted;
        stats.min_distinct = stats.min_distinct.min(s.min_distinct);
    }
    let migration = crate::migrate::map_layers_held(
        &placements,
        holders,
        model.experts,
        MappingMethod::Identity,
        options.bytes_per_expert,
    )?;
    let mut cluster = ClusterSpec::new(n, c);
    cluster.gpus_per_node = previous.cluster.gpus_per_node;
    let plan = ModelPlan {
        version,
        cluster,
        model: *model,
        alloc: previous.alloc,
        place: previous.place,
        allocations,
        layers: placements,
        node_map: (0..n).map(|p| holders.id(p)).collect(),
    };
    Ok(Repaired {
        plan,
        migration,
        stats,
    })
}

/// One repaired layer: the placement, its replica counts and what the repair did.
type RepairedLayer = (LayerPlacement, Vec<usize>, RepairStats);

/// One layer of [`repair_held`]: the placement, its replica counts and what it did.
#[allow(clippy::too_many_arguments)]
fn repair_layer(
    holders: Holders<'_>,
    l: usize,
    c: usize,
    experts: usize,
    floor: usize,
    loads: &[u64],
    before: Option<&[usize]>,
    load_slack: f64,
) -> Result<RepairedLayer, RepairError> {
    let n = holders.len();
    let mut cells = vec![FREE; n * c];
    let mut blank: Vec<usize> = Vec::new();
    let mut counts = vec![0usize; experts];
    let mut distinct = vec![0usize; experts];
    let mut last_row = vec![usize::MAX; experts];
    for p in 0..n {
        match holders.ids(p, l) {
            Some(ids) if ids.len() == c => {
                cells[p * c..(p + 1) * c].copy_from_slice(ids);
                for &e in ids {
                    let e = e as usize;
                    if e >= experts {
                        return Err(MigrateError::ExpertOutOfRange {
                            layer: l as u32,
                            expert: e as u32,
                            experts,
                        }
                        .into());
                    }
                    counts[e] += 1;
                    if last_row[e] != p {
                        last_row[e] = p;
                        distinct[e] += 1;
                    }
                }
            }
            None | Some([]) => blank.push(p),
            Some(ids) => {
                return Err(RepairError::Shape {
                    node: holders.id(p),
                    layer: l,
                    got: ids.len(),
                    slots: c,
                });
            }
        }
    }
    if let Some(e) = (0..experts).find(|&e| counts[e] == 0) {
        return Err(MigrateError::ExpertLost {
            layer: l as u32,
            expert: e as u32,
        }
        .into());
    }
    // Weights: the window's loads, or equal weights before any routing was seen.
    let weight: Vec<f64> = if loads.len() == experts && loads.iter().any(|&t| t > 0) {
        loads.iter().map(|&t| t as f64).collect()
    } else {
        vec![1.0; experts]
    };
    let before: Vec<usize> = match before {
        Some(b) if b.len() == experts => b.to_vec(),
        _ => counts.clone(),
    };
    let busiest_before = (0..experts)
        .filter(|&e| before[e] > 0)
        .map(|e| weight[e] / before[e] as f64)
        .fold(0.0f64, f64::max);
    let bound = (1.0 + load_slack.max(0.0)) * busiest_before;

    // What must be re-created now: floors first (by expert), then load copies, busiest first.
    let mut floor_needs: Vec<usize> = Vec::new();
    let mut load_needs: Vec<(f64, usize)> = Vec::new();
    let mut stats = RepairStats::default();
    for e in 0..experts {
        let lost = before[e].saturating_sub(counts[e]);
        let under = floor.saturating_sub(distinct[e]);
        floor_needs.extend(std::iter::repeat_n(e, under));
        let mut have = counts[e] + under;
        let mut extra = 0;
        while extra + under < lost && weight[e] / have as f64 > bound {
            load_needs.push((weight[e] / have as f64, e));
            have += 1;
            extra += 1;
        }
        stats.deferred += lost.saturating_sub(under + extra) as u64;
    }
    load_needs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));

    let row_has =
        |cells: &[u32], p: usize, e: usize| cells[p * c..(p + 1) * c].contains(&(e as u32));
    let mut repaired_rows: Vec<usize> = Vec::new();
    let needs = floor_needs
        .iter()
        .map(|&e| (e, true))
        .chain(load_needs.iter().map(|&(_, e)| (e, false)));
    for (e, is_floor) in needs {
        // A newcomer's free slot first: nothing evicted.
        let free = blank.iter().find_map(|&p| {
            if row_has(&cells, p, e) {
                return None;
            }
            cells[p * c..(p + 1) * c]
                .iter()
                .position(|&x| x == FREE)
                .map(|s| p * c + s)
        });
        let slot = match free {
            Some(i) => Some(i),
            None => donor_slot(
                &cells,
                c,
                e,
                is_floor,
                floor,
                bound,
                &weight,
                &counts,
                &distinct,
                &repaired_rows,
            ),
        };
        let Some(i) = slot else {
            if is_floor {
                return Err(RepairError::NoDonor {
                    layer: l,
                    expert: e,
                });
            }
            stats.deferred += 1;
            continue;
        };
        let p = i / c;
        let old = cells[i];
        if old != FREE {
            let d = old as usize;
            counts[d] -= 1;
            if cells[p * c..(p + 1) * c]
                .iter()
                .filter(|&&x| x == old)
                .count()
                == 1
            {
                distinct[d] -= 1;
            }
            stats.evicted += 1;
        }
        cells[i] = e as u32;
        counts[e] += 1;
        distinct[e] += 1;
        if is_floor {
            stats.floor_copies += 1;
        } else {
            stats.load_copies += 1;
        }
        if !repaired_rows.contains(&p) {
            repaired_rows.push(p);
        }
    }

    // Newcomers' remaining slots: the highest per-replica load first, each expert once per
    // node where the row has room for that (ties: fewer replicas, then the lower id).
    for &p in &blank {
        for s in 0..c {
            let i = p * c + s;
            if cells[i] != FREE {
                continue;
            }
            let pick = |allow_dup: bool| {
                (0..experts)
                    .filter(|&e| allow_dup || !row_has(&cells, p, e))
                    .max_by(|&a, &b| {
                        let (la, lb) = (weight[a] / counts[a] as f64, weight[b] / counts[b] as f64);
                        la.total_cmp(&lb)
                            .then(counts[b].cmp(&counts[a]))
                            .then(b.cmp(&a))
                    })
            };
            let e = pick(false).or_else(|| pick(true)).expect("experts > 0");
            if !row_has(&cells, p, e) {
                distinct[e] += 1;
            }
            cells[i] = e as u32;
            counts[e] += 1;
            stats.join_copies += 1;
        }
    }
    debug_assert!(
        (0..experts).all(|e| distinct[e] >= floor.min(counts[e])),
        "layer {l}: a floor was missed"
    );
    stats.min_distinct = distinct.iter().copied().min().unwrap_or(0);
    let grid: Vec<Vec<u32>> = cells.chunks_exact(c).map(<[u32]>::to_vec).collect();
    let placement = LayerPlacement::from_grid(grid, experts, Some(&counts))
        .expect("a repaired grid is a valid placement");
    Ok((placement, counts, stats))
}

/// The survivor slot a re-created replica of `e` takes: the most over-replicated expert's
/// (lowest per-replica load once it gives one up) on a node that does not hold `e`, keeping
/// that expert on `floor` distinct nodes; rows that already took a repair in this event first.
/// A load copy only takes a slot whose expert stays within `bound` and below `e`'s load.
#[allow(clippy::too_many_arguments)]
fn donor_slot(
    cells: &[u32],
    c: usize,
    e: usize,
    is_floor: bool,
    floor: usize,
    bound: f64,
    weight: &[f64],
    counts: &[usize],
    distinct: &[usize],
    repaired_rows: &[usize],
) -> Option<usize> {
    let experts = counts.len();
    let needy_load = weight[e] / counts[e].max(1) as f64;
    let mut donors: Vec<(f64, usize)> = (0..experts)
        .filter(|&d| d != e && counts[d] >= 2)
        .map(|d| (weight[d] / (counts[d] - 1) as f64, d))
        .filter(|&(after, _)| is_floor || (after <= bound && after < needy_load))
        .collect();
    donors.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let n = cells.len() / c;
    for (_, d) in donors {
        let takes = |p: usize| -> Option<usize> {
            let row = &cells[p * c..(p + 1) * c];
            if row.contains(&(e as u32)) {
                return None;
            }
            let copies = row.iter().filter(|&&x| x == d as u32).count();
            if copies == 0 || (copies == 1 && distinct[d] <= floor) {
                return None;
            }
            row.iter().position(|&x| x == d as u32).map(|s| p * c + s)
        };
        if let Some(i) = repaired_rows.iter().find_map(|&p| takes(p)) {
            return Some(i);
        }
        if let Some(i) = (0..n).find_map(takes) {
            return Some(i);
        }
    }
    None
}

/// Recovery probability under `failed` uniform node failures of a repaired plan, against the
/// full replan's over the same nodes (`None` when the repaired plan survives any `failed`
/// failures: every expert sits on more than `failed` distinct nodes, `min_distinct`).
///
/// The repaired plan's is exact ([`crate::recovery::exact_small_k`]). The replan's is MRO's
/// closed form ([`crate::recovery::mro_closed_form`]) of Eq. 1's allocation on the same loads,
/// taken as the weakest layer's: with aligned layers the model's probability is close to it
/// (equal when the layers' blocks match), so this is the replan at its best.
///
/// # Errors
/// A planning error of the allocation, or a repaired plan too large to enumerate.
pub fn recovery_against_replan(
    plan: &ModelPlan,
    min_distinct: usize,
    loads: &[Vec<u64>],
    failed: usize,
) -> Result<Option<(f64, f64)>, crate::PlanError> {
    let nodes = plan.cluster.nodes;
    if min_distinct > failed || failed == 0 || failed >= nodes {
        return Ok(None);
    }
    let repaired = crate::recovery::exact_small_k(&plan.layers, failed)?;
    let total = plan.cluster.total_slots();
    let mut replan = 1.0f64;
    for l in 0..plan.model.layers {
        let zeros;
        let layer_loads = match loads.get(l) {
            Some(t) if t.len() == plan.model.experts => t.as_slice(),
            _ => {
                zeros = vec![0; plan.model.experts];
                &zeros
            }
        };
        let a = crate::allocate(plan.alloc, layer_loads, total, plan.model.f)?;
        let s = crate::mro_structure(&a.replicas, nodes, plan.cluster.slots_per_node);
        if s.spread_fallback {
            continue;
        }
        replan = replan.min(crate::recovery::mro_closed_form(
            &s.block_sizes,
            nodes,
            failed,
        ));
    }
    Ok(Some((repaired, replan)))
}

/// How much busier the busiest replica of `plan` is than the full replan's would be on the
/// same loads: the largest over layers of `max_e t_e / r_e` of the plan against the same of
/// Eq. 1's allocation over the plan's slots (1: as balanced as the replan; all-zero loads
/// count every expert equally). The step's busiest rank follows its busiest replicas, so this
/// is the slowdown a deferred re-optimisation costs until it lands.
///
/// # Errors
/// A planning error of the allocation.
pub fn load_ratio_against_replan(
    plan: &ModelPlan,
    loads: &[Vec<u64>],
) -> Result<f64, crate::PlanError> {
    let total = plan.cluster.total_slots();
    let experts = plan.model.experts;
    let mut ratio = 1.0f64;
    for (l, a) in plan.allocations.iter().enumerate() {
        let zeros;
        let t = match loads.get(l) {
            Some(t) if t.len() == experts && t.iter().any(|&x| x > 0) => t.as_slice(),
            _ => {
                zeros = vec![1; experts];
                &zeros
            }
        };
        let busiest = |r: &[usize]| {
            (0..experts)
                .filter(|&e| r[e] > 0)
                .map(|e| t[e] as f64 / r[e] as f64)
                .fold(0.0f64, f64::max)
        };
        let replan = crate::allocate(plan.alloc, t, total, plan.model.f)?;
        let best = busiest(&replan.replicas);
        if best > 0.0 {
            ratio = ratio.max(busiest(&a.replicas) / best);
        }
    }
    Ok(ratio)
}
