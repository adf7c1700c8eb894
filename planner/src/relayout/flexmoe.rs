//! FlexMoE-style incremental re-layout (Nie et al., SIGMOD 2023), as ported into LAER-MoE's
//! `solver.flexmoe_method`: small rounds that each move at most one copy per
//! node from the coldest replicated expert to the hottest one.
//!
//! Starting from the current layout, while the balance ratio `max_d load_d / min_d load_d`
//! (tokens computed per device under [`Evaluator`]'s dispatch model) is above 1 and fewer than
//! `max_rounds` rounds have run:
//! - per-copy load of expert `e` is `w_e / copies_e` (`w_e = Σ_d traffic[d][e]`);
//! - *hot* = the expert with the highest per-copy load, *cold* = the one with the lowest among
//!   experts with more than one copy (ties: lower id; the port asks for more copies than
//!   nodes, which never holds from a layout with one copy of every expert per node);
//! - in every node, one copy of *cold* on the node's most loaded device that holds it becomes a
//!   copy of *hot* (nodes without a copy of *cold* are skipped);
//! - the round is kept if it improves the modelled step time, or improves the ratio without
//!   worsening the step time; otherwise it is undone and the search stops.
//!
//! ## Decisions
//! - **Acceptance.** LAER's port keeps a round when "the cost or the ratio improves", which can
//!   accept a round that balances compute but slows the step (more inter-node traffic). We also
//!   require the step time not to get worse, so the result is never slower than `current` under
//!   the model — the property a baseline should have to be a fair comparison.
//! - **In-place swap.** The hot copy takes the cold copy's slot, so no device ever overflows and
//!   the port's "swap a third expert to make room" case never arises.
//! - **Device choice.** "Most loaded" uses the device loads at the start of the round (ties:
//!   lower device index).
//! - **Ratio with an idle device.** A device computing nothing makes the ratio infinite; an
//!   all-zero load (no traffic) counts as perfectly balanced (ratio 1).
//! - `current` must hold every expert at least once ([`PlanError::ZeroReplicas`] otherwise);
//!   *cold* stops losing copies at one, so every expert keeps at least one copy.

use super::{Evaluator, LinkModel, Topology};
use crate::error::PlanError;
use crate::place::LayerPlacement;
use std::cmp::Ordering;

/// `max / min` of the device loads (see the module docs for the degenerate cases).
fn balance_ratio(loads: &[f64]) -> f64 {
    let max = loads.iter().copied().fold(0.0f64, f64::max);
    let min = loads.iter().copied().fold(f64::INFINITY, f64::min);
    if max <= 0.0 {
        1.0
    } else if min <= 0.0 {
        f64::INFINITY
    } else {
        max / min
    }
}

/// Exact order of per-copy loads `a.0 / a.1` vs `b.0 / b.1` (copies ≥ 1).
fn cmp_per_copy(a: (u64, u64), b: (u64, u64)) -> Ordering {
    (u128::from(a.0) * u128::from(b.1)).cmp(&(u128::from(b.0) * u128::from(a.1)))
}

/// FlexMoE's incremental rounds from `current` (rows = devices) under `traffic`
/// (`[device][expert]` tokens); at most `max_rounds` rounds (FlexMoE/LAER use 10).
///
/// # Errors
/// An invalid topology, a `current` layout or traffic matrix whose shape does not match it, or
/// an expert with no copy in `current`.
pub fn flexmoe(
    topo: Topology,
    link: LinkModel,
    traffic: &[Vec<u64>],
    current: &LayerPlacement,
    max_rounds: usize,
) -> Result<LayerPlacement, PlanError> {
    topo.validate()?;
    if current.nodes() == topo.devices && current.slots_per_node() != topo.slots_per_device {
        return Err(PlanError::RaggedGrid {
            node: 0,
            expected: topo.slots_per_device,
            got: current.slots_per_node(),
        });
    }
    let mut ev = Evaluator::new(topo, link, traffic, current)?;
    let experts = current.experts();
    let mut copies: Vec<u64> = current.replicas().iter().map(|&c| c as u64).collect();
    if let Some(expert) = copies.iter().position(|&c| c == 0) {
        return Err(PlanError::ZeroReplicas { expert });
    }
    let w: Vec<u64> = (0..experts)
        .map(|e| {
            traffic
                .iter()
                .fold(0u64, |acc, row| acc.saturating_add(row[e]))
        })
        .collect();
    let dpn = topo.devices_per_node;
    let mut grid: Vec<Vec<u32>> = current.grid().to_vec();

    let mut score = ev.score();
    let mut ratio = balance_ratio(&ev.device_load());
    let mut rounds = 0;
    while ratio > 1.0 && rounds < max_rounds {
        rounds += 1;
        let per_copy = |e: usize| (w[e], copies[e]);
        let hot = (1..experts).fold(0, |b, e| {
            if cmp_per_copy(per_copy(e), per_copy(b)) == Ordering::Greater {
                e
            } else {
                b
            }
        });
        let cold = (0..experts)
            // The LAER port requires more copies than nodes; from a layout with one copy of
            // every expert per node that never fires, so we only require that `cold` keeps
            // at least one copy (checked per node below).
            .filter(|&e| copies[e] > 1)
            .fold(None, |best: Option<usize>, e| match best {
                Some(b) if cmp_per_copy(per_copy(e), per_copy(b)) != Ordering::Less => Some(b),
                _ => Some(e),
            });
        let Some(cold) = cold else { break };
        if cold == hot || cmp_per_copy(per_copy(hot), per_copy(cold)) != Ordering::Greater {
            break; // Every per-copy load is equal: nothing to shift.
        }

        let loads = ev.device_load();
        // (device, slot) edits of this round, to undo.
        let mut edits: Vec<(usize, usize)> = Vec::new();
        for node in 0..topo.nodes() {
            if copies[cold] <= 1 {
                break;
            }
            let devs = node * dpn..(node + 1) * dpn;
            let target = devs.filter(|&d| grid[d].contains(&(cold as u32))).fold(
                None,
                |best: Option<usize>, d| match best {
                    Some(b) if loads[b] >= loads[d] => Some(b),
                    _ => Some(d),
                },
            );
            let Some(d) = target else { continue };
            let slot = grid[d]
                .iter()
                .position(|&e| e == cold as u32)
                .expect("the device holds cold");
            grid[d][slot] = hot as u32;
            copies[cold] -= 1;
            copies[hot] += 1;
            ev.adjust(cold, d, -1);
            ev.adjust(hot, d, 1);
            edits.push((d, slot));
        }
        if edits.is_empty() {
            break;
        }
        let new_score = ev.score();
        let new_ratio = balance_ratio(&ev.device_load());
        let faster = new_score.step_time_s < score.step_time_s;
        let better_balanced = new_ratio < ratio && new_score.step_time_s <= score.step_time_s;
        if faster || better_balanced {
            score = new_score;
            ratio = new_ratio;
        } else {
            for &(d, slot) in &edits {
                grid[d][slot] = cold as u32;
                ev.adjust(hot, d, -1);
                ev.adjust(cold, d, 1);
            }
            break;
        }
    }
    debug_assert!(copies.iter().all(|&c| c >= 1));
    LayerPlacement::from_grid(grid, experts, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_degenerate_cases() {
        assert_eq!(balance_ratio(&[0.0, 0.0]), 1.0);
        assert_eq!(balance_ratio(&[1.0, 0.0]), f64::INFINITY);
        assert_eq!(balance_ratio(&[2.0, 4.0]), 2.0);
    }

    #[test]
    fn per_copy_order_is_exact() {
        assert_eq!(cmp_per_copy((1, 3), (2, 6)), Ordering::Equal);
        assert_eq!(cmp_per_copy((5, 2), (2, 1)), Ordering::Greater);
    }
}
