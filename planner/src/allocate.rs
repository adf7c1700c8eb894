//! Replica allocation: how many replicas each expert of one layer gets.
//!
//! All policies return counts in **original expert-id order**, summing to exactly the number of
//! slots `N·c`, with every expert at or above the effective threshold (see [`effective_f`]).

use crate::error::PlanError;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;
use std::str::FromStr;

/// Which allocation rule to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocPolicy {
    /// Lazarus Eq. 1 (§4.1): proportional to load, floor, at least `f`, last expert takes the rest.
    Lazarus,
    /// DeepSeek EPLB's replication step: start every expert at `f`, then repeatedly give one more
    /// replica to the expert with the highest load per replica.
    Eplb,
    /// Standard expert parallelism: the same count for every expert.
    Uniform,
}

impl AllocPolicy {
    pub const ALL: [AllocPolicy; 3] = [Self::Lazarus, Self::Eplb, Self::Uniform];
    pub fn name(self) -> &'static str {
        match self {
            Self::Lazarus => "lazarus",
            Self::Eplb => "eplb",
            Self::Uniform => "uniform",
        }
    }
}

impl fmt::Display for AllocPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AllocPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!("unknown allocation policy {s:?} (expected lazarus, eplb or uniform)")
            })
    }
}

/// The replica counts of one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Replicas per expert, original expert-id order.
    pub replicas: Vec<usize>,
    /// The threshold actually enforced (≤ the requested `f`, see [`effective_f`]).
    pub f_effective: usize,
}

/// The fault-tolerance threshold that can actually be honoured with `total_slots` slots.
///
/// The paper only says `f` is not enforced when slots run short (§4.1, §6.5). Our rule:
/// `f_eff = min(f, ⌊N·c / E⌋)` — the largest threshold every expert can meet — and never below
/// 1: with fewer slots than experts (`N·c < E`) some expert could not be placed at all, which is
/// an error (the caller must fall back to a checkpoint or wait for nodes).
pub fn effective_f(total_slots: usize, experts: usize, f: usize) -> Result<usize, PlanError> {
    if experts == 0 {
        return Err(PlanError::NoExperts(experts));
    }
    if f == 0 {
        return Err(PlanError::ZeroF(f));
    }
    if total_slots < experts {
        return Err(PlanError::TooFewSlots {
            experts,
            slots: total_slots,
        });
    }
    Ok(f.min(total_slots / experts))
}

/// Allocates `total_slots` replicas over the experts of one layer.
pub fn allocate(
    policy: AllocPolicy,
    loads: &[u64],
    total_slots: usize,
    f: usize,
) -> Result<Allocation, PlanError> {
    let f_eff = effective_f(total_slots, loads.len(), f)?;
    let replicas = match policy {
        AllocPolicy::Lazarus => lazarus_eq1(loads, total_slots, f_eff),
        AllocPolicy::Eplb => eplb_greedy(loads, total_slots, f_eff),
        AllocPolicy::Uniform => uniform(loads, total_slots),
    };
    debug_assert_eq!(replicas.iter().sum::<usize>(), total_slots);
    assert!(
        replicas.iter().all(|&r| r >= f_eff),
        "allocation below threshold"
    );
    Ok(Allocation {
        replicas,
        f_effective: f_eff,
    })
}

/// Experts sorted ascending by load, ties by id (the order Eq. 1 uses).
pub fn ascending_order(loads: &[u64]) -> Vec<usize> {
    ascending_order_by(loads)
}

/// Indices sorted ascending by `key`, ties by index (the paper's "rank" order).
pub fn ascending_order_by<K: Ord + Copy>(key: &[K]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..key.len()).collect();
    order.sort_by_key(|&e| (key[e], e));
    order
}

/// Eq. 1, in exact integer arithmetic:
/// `r_e = max(⌊t_e / Σ_{e'≥e} t_e' · (N·c − Σ_{e'<e} r_e')⌋, f)` over experts sorted ascending.
///
/// Decision where the paper is silent: if every remaining expert has load 0, the remaining
/// slots are split evenly (`⌊S/count⌋`, the last expert taking the rest).
///
/// Because experts are visited least-loaded first, each one takes at most its even share of
/// the remaining slots, so at least `f` slots remain for every later expert whenever
/// `N·c ≥ E·f`; the last expert's share is 1 and it takes everything left, so `Σr = N·c`.
fn lazarus_eq1(loads: &[u64], total_slots: usize, f: usize) -> Vec<usize> {
    let order = ascending_order(loads);
    let mut replicas = vec![0usize; loads.len()];
    let mut load_left: u128 = loads.iter().map(|&t| t as u128).sum();
    let mut slots_left = total_slots as u128;
    let n = order.len();
    for (i, &e) in order.iter().enumerate() {
        let t = loads[e] as u128;
        let share = if i + 1 == n {
            slots_left
        } else {
            (t * slots_left)
                .checked_div(load_left)
                .unwrap_or(slots_left / (n - i) as u128)
        };
        let r = share.max(f as u128).min(slots_left);
        replicas[e] = r as usize;
        slots_left -= r;
        load_left -= t;
    }
    replicas
}

/// Max-heap entry for EPLB: the expert with the highest `load / replicas` first, ties to the
/// lower id. Compared exactly by cross-multiplication.
#[derive(PartialEq, Eq)]
struct PerReplica {
    load: u64,
    replicas: usize,
    expert: usize,
}

impl Ord for PerReplica {
    fn cmp(&self, other: &Self) -> Ordering {
        let a = self.load as u128 * other.replicas as u128;
        let b = other.load as u128 * self.replicas as u128;
        a.cmp(&b).then(other.expert.cmp(&self.expert))
    }
}

impl PartialOrd for PerReplica {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// EPLB's replication (DeepSeek `replicate_experts`): greedily add one replica to
/// `argmax load/replicas`. DeepSeek starts from one replica; we start from `f` so the threshold
/// holds.
fn eplb_greedy(loads: &[u64], total_slots: usize, f: usize) -> Vec<usize> {
    let mut replicas = vec![f; loads.len()];
    let mut heap: BinaryHeap<PerReplica> = loads
        .iter()
        .enumerate()
        .map(|(expert, &load)| PerReplica {
            load,
            replicas: f,
            expert,
        })
        .collect();
    for _ in 0..total_slots - f * loads.len() {
        let mut top = heap.pop().expect("at least one expert");
        top.replicas += 1;
        replicas[top.expert] = top.replicas;
        heap.push(top);
    }
    replicas
}

/// `⌊N·c / E⌋` each; the `N·c mod E` spare slots go to the most loaded experts (ties by id).
fn uniform(loads: &[u64], total_slots: usize) -> Vec<usize> {
    let e = loads.len();
    let mut replicas = vec![total_slots / e; e];
    let mut by_load: Vec<usize> = (0..e).collect();
    by_load.sort_by_key(|&x| (std::cmp::Reverse(loads[x]), x));
    for &x in by_load.iter().take(total_slots % e) {
        replicas[x] += 1;
    }
    replicas
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_eq1_reference_vector() {
        // Eq. 1 (§4.1) with N·c = 60 (10 GPUs × 6 slots), f = 2: a vector checked by hand.
        let a = allocate(AllocPolicy::Lazarus, &[1, 1, 1, 1, 2, 4, 10, 20], 60, 2).unwrap();
        assert_eq!(a.replicas, vec![2, 2, 2, 2, 2, 5, 15, 30]);
    }

    #[test]
    fn output_is_in_original_id_order() {
        let a = allocate(AllocPolicy::Lazarus, &[20, 1, 10, 1, 4, 1, 2, 1], 60, 2).unwrap();
        assert_eq!(a.replicas, vec![30, 2, 15, 2, 5, 2, 2, 2]);
    }

    #[test]
    fn eplb_and_uniform_small_cases() {
        let a = allocate(AllocPolicy::Eplb, &[1, 3], 4, 1).unwrap();
        assert_eq!(a.replicas, vec![1, 3]);
        let a = allocate(AllocPolicy::Eplb, &[10, 10, 1], 7, 2).unwrap();
        // After f: [2,2,2]; then 10/2 ties -> expert 0 gets 3rd.
        assert_eq!(a.replicas, vec![3, 2, 2]);
        let a = allocate(AllocPolicy::Uniform, &[5, 9, 1], 8, 1).unwrap();
        assert_eq!(a.replicas, vec![3, 3, 2]);
    }

    #[test]
    fn threshold_relaxed_when_slots_short_and_error_below_one_each() {
        // 10 slots, 8 experts, f = 2: only f = 1 is possible.
        let a = allocate(AllocPolicy::Lazarus, &[1; 8], 10, 2).unwrap();
        assert_eq!(a.f_effective, 1);
        assert_eq!(a.replicas.iter().sum::<usize>(), 10);
        assert!(a.replicas.iter().all(|&r| r >= 1));
        assert!(matches!(
            allocate(AllocPolicy::Lazarus, &[1; 8], 7, 2),
            Err(PlanError::TooFewSlots { .. })
        ));
    }

    #[test]
    fn all_zero_loads_split_evenly() {
        let a = allocate(AllocPolicy::Lazarus, &[0; 4], 10, 1).unwrap();
        assert_eq!(a.replicas, vec![2, 2, 3, 3]);
    }

    #[test]
    fn parse_policy() {
        assert_eq!("eplb".parse::<AllocPolicy>().unwrap(), AllocPolicy::Eplb);
        assert!("foo".parse::<AllocPolicy>().is_err());
    }
}
