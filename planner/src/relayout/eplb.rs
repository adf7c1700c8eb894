//! DeepSeek's expert-parallel load balancer (EPLB) as a re-layout baseline, re-implemented from
//! its description (`deepseek-ai/EPLB`, `eplb.py` at `d52c72d`).
//!
//! EPLB is **stateless**: it ignores the current layout and rebuilds one from the expert loads
//! `w_e = Σ_d traffic[d][e]` alone, in three steps:
//! 1. *groups → nodes* (hierarchical mode only): contiguous groups of experts are packed onto
//!    nodes with cardinality-limited LPT, the same number of groups per node;
//! 2. *replicate*: inside each node (or over the whole cluster in global mode) every expert gets
//!    one copy, then each spare slot goes to `argmax_e w_e / cnt_e` ([`replicate`]);
//! 3. *copies → devices*: the copies, each weighing `w_e / cnt_e`, are packed onto the devices
//!    of their node, exactly `slots_per_device` per device.
//!
//! Rows of the returned [`LayerPlacement`] are devices; the slots of a device keep EPLB's
//! physical order (the order in which copies were packed onto it), so `grid().concat()` is
//! EPLB's `phy2log` row.
//!
//! ## Decisions where EPLB leaves freedom
//! - **Ties.** EPLB sorts with `torch.sort` (not stable) and takes `max` over `float32`
//!   quotients. We compare per-copy loads exactly (cross-multiplication in `u128`), break
//!   equal loads by the lower index (expert id in `replicate`, item index in the packing), and
//!   equal pack weights by the lower pack index (as Python's `min` does). Pack weights are
//!   summed in `f64`. On inputs without exact ties the result is EPLB's; with ties it is one of
//!   the results EPLB could give.
//! - **One item per pack.** Like EPLB, packing `n` items into `n` packs is the identity (item
//!   `i` → pack `i`), not an LPT pass; this fixes which node gets which group when
//!   `groups == nodes` and which device gets which copy when `slots_per_device == 1`.
//! - **Hierarchical preconditions.** EPLB itself falls back to the global policy when
//!   `groups % nodes != 0` and asserts `experts % groups == 0`. We fall back to the global
//!   policy in both cases ([`EplbMode::Hierarchical`] uses `groups = nodes`, so it is global
//!   whenever `experts % nodes != 0`), so every valid topology gets a layout.
//! - **Replica floor.** Every expert gets exactly one copy before spares are handed out, so an
//!   expert may end with fewer copies than a fault-tolerance threshold `f` would ask for — that
//!   is EPLB's behaviour and part of what the comparison shows.

use super::Topology;
use crate::error::PlanError;
use crate::migrate::{cost_matrix, min_cost_assignment};
use crate::place::LayerPlacement;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;

/// Which EPLB policy to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EplbMode {
    /// Replicate over all slots of the cluster, then pack the copies onto devices.
    Global,
    /// Groups of experts pinned to nodes (`groups = nodes`, contiguous groups of
    /// `experts / nodes`), replication and packing inside each node. All copies of an expert
    /// sit on one node. Falls back to [`EplbMode::Global`] when `experts % nodes != 0`.
    Hierarchical,
}

/// A non-negative rational `num / den` (`den ≥ 1`), ordered exactly.
#[derive(Debug, Clone, Copy)]
struct Ratio {
    num: u64,
    den: u64,
}

impl Ratio {
    fn cmp(self, other: Ratio) -> Ordering {
        (u128::from(self.num) * u128::from(other.den))
            .cmp(&(u128::from(other.num) * u128::from(self.den)))
    }
    fn as_f64(self) -> f64 {
        self.num as f64 / self.den as f64
    }
}

/// Expert loads `w_e = Σ_d traffic[d][e]` (saturating).
fn expert_loads(traffic: &[Vec<u64>], experts: usize) -> Vec<u64> {
    let mut w = vec![0u64; experts];
    for row in traffic {
        for (acc, &t) in w.iter_mut().zip(row) {
            *acc = acc.saturating_add(t);
        }
    }
    w
}

/// EPLB's `replicate_experts`: one copy of each expert, then each of the `slots − E` spare
/// slots to `argmax_e w_e / cnt_e` (exact comparison, ties to the lower expert id).
///
/// Returns `(phy2log, counts)`: the expert of each copy in creation order (experts `0..E`
/// first, then the spares in the order they were added) and the copies per expert.
///
/// # Panics
/// If `slots < weights.len()`.
pub fn replicate(weights: &[u64], slots: usize) -> (Vec<usize>, Vec<usize>) {
    let experts = weights.len();
    assert!(
        slots >= experts,
        "{slots} slots cannot hold {experts} experts"
    );
    let mut counts = vec![1usize; experts];
    let mut phy2log: Vec<usize> = (0..experts).collect();
    for _ in experts..slots {
        let per_copy = |e: usize| Ratio {
            num: weights[e],
            den: counts[e] as u64,
        };
        // First maximum wins: ties go to the lower id.
        let hot = (1..experts).fold(0, |best, e| {
            if per_copy(e).cmp(per_copy(best)) == Ordering::Greater {
                e
            } else {
                best
            }
        });
        phy2log.push(hot);
        counts[hot] += 1;
    }
    debug_assert_eq!(phy2log.len(), slots);
    debug_assert_eq!(counts.iter().sum::<usize>(), slots);
    (phy2log, counts)
}

/// EPLB's `balanced_packing`: `n` items into `packs` packs of exactly `n / packs` items each.
/// Items in order of weight, heaviest first (ties: lower index first), each into the lightest
/// pack that still has room (ties: lower pack index). With one item per pack the result is the
/// identity, as in EPLB. Returns `(pack, rank within pack)` per item.
fn balanced_packing(weights: &[Ratio], packs: usize) -> Vec<(usize, usize)> {
    let n = weights.len();
    assert!(
        packs > 0 && n.is_multiple_of(packs),
        "{n} items into {packs} packs"
    );
    let per_pack = n / packs;
    if per_pack == 1 {
        return (0..n).map(|i| (i, 0)).collect();
    }
    let mut order: Vec<usize> = (0..n).collect();
    // Stable sort: equal weights keep ascending index order.
    order.sort_by(|&a, &b| weights[b].cmp(weights[a]));
    let mut load = vec![0.0f64; packs];
    let mut items = vec![0usize; packs];
    let mut out = vec![(usize::MAX, usize::MAX); n];
    for i in order {
        let pack = (0..packs)
            .filter(|&p| items[p] < per_pack)
            .fold(None, |best: Option<usize>, p| match best {
                Some(b) if load[b] <= load[p] => Some(b),
                _ => Some(p),
            })
            .expect("a pack with room exists while items remain");
        out[i] = (pack, items[pack]);
        load[pack] += weights[i].as_f64();
        items[pack] += 1;
    }
    debug_assert!(items.iter().all(|&c| c == per_pack));
    out
}

/// Checks the inputs shared by every EPLB entry point and returns the expert loads.
fn loads_checked(
    topo: Topology,
    traffic: &[Vec<u64>],
    experts: usize,
) -> Result<Vec<u64>, PlanError> {
    topo.validate()?;
    if experts == 0 {
        return Err(PlanError::NoExperts(0));
    }
    if traffic.len() != topo.devices {
        return Err(PlanError::LayerNodeMismatch {
            layer: 0,
            expected: topo.devices,
            got: traffic.len(),
        });
    }
    if let Some(row) = traffic.iter().find(|r| r.len() != experts) {
        return Err(PlanError::LoadCount {
            expected: experts,
            got: row.len(),
        });
    }
    let slots = topo.devices * topo.slots_per_device;
    if experts > slots {
        return Err(PlanError::TooFewSlots { experts, slots });
    }
    Ok(expert_loads(traffic, experts))
}

/// EPLB's layout for `traffic` (`[device][expert]` tokens). Stateless: no current layout.
///
/// # Errors
/// An invalid topology, a traffic matrix that is not `devices × experts`, no experts, or more
/// experts than slots.
pub fn eplb(
    topo: Topology,
    traffic: &[Vec<u64>],
    experts: usize,
    mode: EplbMode,
) -> Result<LayerPlacement, PlanError> {
    let w = loads_checked(topo, traffic, experts)?;
    let groups = match mode {
        EplbMode::Global => 1,
        EplbMode::Hierarchical => topo.nodes(),
    };
    Ok(rebalance(topo, &w, groups))
}

/// EPLB's hierarchical policy with an explicit number of contiguous expert groups (EPLB's
/// `num_groups`); `groups` must be a multiple of the node count and divide `experts`,
/// otherwise the global policy is used (see the module docs). `weights[e]` is expert `e`'s load.
///
/// # Errors
/// An invalid topology, no experts, more experts than slots, or `groups == 0`.
pub fn eplb_hierarchical_groups(
    topo: Topology,
    weights: &[u64],
    groups: usize,
) -> Result<LayerPlacement, PlanError> {
    topo.validate()?;
    let experts = weights.len();
    if experts == 0 {
        return Err(PlanError::NoExperts(0));
    }
    if groups == 0 {
        return Err(PlanError::NoNodes(0));
    }
    let slots = topo.devices * topo.slots_per_device;
    if experts > slots {
        return Err(PlanError::TooFewSlots { experts, slots });
    }
    Ok(rebalance(topo, weights, groups))
}

/// The hierarchical policy (global when `groups` does not fit, see the module docs). Inputs are
/// validated by the callers.
fn rebalance(topo: Topology, w: &[u64], groups: usize) -> LayerPlacement {
    let experts = w.len();
    let (groups, nodes) =
        if groups > 0 && experts.is_multiple_of(groups) && groups.is_multiple_of(topo.nodes()) {
            (groups, topo.nodes())
        } else {
            (1, 1)
        };
    let group_size = experts / groups;
    let groups_per_node = groups / nodes;
    let experts_per_node = experts / nodes;
    let devices_per_node = topo.devices / nodes;
    let slots_per_node = devices_per_node * topo.slots_per_device;

    // Step 1: groups → nodes. Node k owns the "node-major" block of experts
    // `k·E/M .. (k+1)·E/M`, its groups in packing-rank order.
    let group_loads: Vec<Ratio> = w
        .chunks(group_size)
        .map(|g| Ratio {
            num: g.iter().fold(0u64, |a, &x| a.saturating_add(x)),
            den: 1,
        })
        .collect();
    let mut node_major = vec![usize::MAX; experts]; // node-major position → expert id
    for (g, (pack, rank)) in balanced_packing(&group_loads, nodes)
        .into_iter()
        .enumerate()
    {
        let base = (pack * groups_per_node + rank) * group_size;
        for j in 0..group_size {
            node_major[base + j] = g * group_size + j;
        }
    }
    debug_assert!(node_major.iter().all(|&e| e < experts));

    let mut grid = vec![Vec::with_capacity(topo.slots_per_device); topo.devices];
    for (k, members) in node_major.chunks(experts_per_node).enumerate() {
        // Step 2: replicate inside the node, with the node's fixed slot budget.
        let local_w: Vec<u64> = members.iter().map(|&e| w[e]).collect();
        let (phy2local, counts) = replicate(&local_w, slots_per_node);
        // Step 3: copies → the node's devices.
        let per_copy: Vec<Ratio> = phy2local
            .iter()
            .map(|&i| Ratio {
                num: local_w[i],
                den: counts[i] as u64,
            })
            .collect();
        let mut placed = vec![vec![u32::MAX; topo.slots_per_device]; devices_per_node];
        for (copy, (dev, rank)) in balanced_packing(&per_copy, devices_per_node)
            .into_iter()
            .enumerate()
        {
            placed[dev][rank] = members[phy2local[copy]] as u32;
        }
        for (j, row) in placed.into_iter().enumerate() {
            grid[k * devices_per_node + j] = row;
        }
    }
    LayerPlacement::from_grid(grid, experts, None).expect("EPLB fills every slot")
}

/// [`eplb`] followed by the post-pass EPLB's maintainers suggest (EPLB issue #25): the new
/// layout's device rows are permuted onto the physical devices so that the fewest expert
/// states move — a min-cost assignment with `cost[q][p]` = distinct experts of new row `q`
/// that device `p` does not hold in `current`, the count [`super::migration`] charges. Balance
/// is unchanged (same multiset of device rows) and the migration is never larger than
/// [`eplb`]'s (the identity is one of the candidate assignments).
///
/// # Errors
/// As [`eplb`], plus a `current` layout that is not `devices × slots_per_device`.
pub fn eplb_remap(
    topo: Topology,
    traffic: &[Vec<u64>],
    current: &LayerPlacement,
    mode: EplbMode,
) -> Result<LayerPlacement, PlanError> {
    let fresh = eplb(topo, traffic, current.experts(), mode)?;
    if current.nodes() != topo.devices {
        return Err(PlanError::LayerNodeMismatch {
            layer: 0,
            expected: topo.devices,
            got: current.nodes(),
        });
    }
    if current.slots_per_node() != topo.slots_per_device {
        return Err(PlanError::RaggedGrid {
            node: 0,
            expected: topo.slots_per_device,
            got: current.slots_per_node(),
        });
    }
    let (plan, physical) = super::device_rows(&fresh, current);
    let cost = cost_matrix(&plan, &physical, current.experts())
        .expect("rows of two layouts with the same shape and experts");
    let perm = min_cost_assignment(&cost);
    let out = fresh.permute_nodes(&perm);
    debug_assert_eq!(out.replicas(), fresh.replicas());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(num: u64, den: u64) -> Ratio {
        Ratio { num, den }
    }

    #[test]
    fn replicate_is_dhondt() {
        let (phy, cnt) = replicate(&[10, 3, 6], 6);
        // Spares: 10 (expert 0), then 6 (expert 2), then 10/2 = 5 (expert 0).
        assert_eq!(phy, vec![0, 1, 2, 0, 2, 0]);
        assert_eq!(cnt, vec![3, 1, 2]);
    }

    #[test]
    fn replicate_ties_to_lower_id() {
        let (phy, cnt) = replicate(&[4, 4, 2], 5);
        assert_eq!(phy, vec![0, 1, 2, 0, 1]);
        assert_eq!(cnt, vec![2, 2, 1]);
    }

    #[test]
    fn packing_is_cardinality_lpt() {
        let w = [r(5, 1), r(4, 1), r(3, 1), r(3, 1), r(2, 1), r(1, 1)];
        let p = balanced_packing(&w, 2);
        // 5→A, 4→B, 3(2)→B (7), 3(3)→A (8), 2→B (9), 1→A (9).
        assert_eq!(p, vec![(0, 0), (1, 0), (1, 1), (0, 1), (1, 2), (0, 2)]);
    }

    #[test]
    fn packing_one_per_pack_is_identity() {
        let w = [r(1, 1), r(9, 1), r(5, 1)];
        assert_eq!(balanced_packing(&w, 3), vec![(0, 0), (1, 0), (2, 0)]);
    }

    #[test]
    fn exact_ratio_order() {
        assert_eq!(r(1, 3).cmp(r(2, 6)), Ordering::Equal);
        assert_eq!(r(u64::MAX, 2).cmp(r(u64::MAX - 1, 2)), Ordering::Greater);
    }
}
