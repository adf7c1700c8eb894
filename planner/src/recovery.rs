//! Recovery probability: the chance that, after `k` simultaneous failures drawn uniformly among
//! the `N` nodes (or `k` failure domains among `D`), the surviving nodes still hold at least one
//! replica of every expert — of one layer, or of every layer of the model.
//!
//! Three methods:
//! * [`mro_closed_form`]: exact, for MRO plans, from the block sizes alone (§10 of our reference).
//! * [`exact`]: exact enumeration of all `C(N,k)` failure sets with node bitmasks, for any plan.
//! * [`monte_carlo`]: seeded sampling with a 95 % Wilson score interval, for any size.
//!
//! All of them reduce a plan to its *critical node sets*: the distinct sets `S_e` of nodes
//! holding each expert, keeping only the minimal ones (if `S_a ⊆ S_b`, `S_b` survives whenever
//! `S_a` does). A failure set `F` is recoverable iff no critical set lies inside `F`.

use crate::error::PlanError;
use crate::place::LayerPlacement;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// 97.5 % quantile of the standard normal, for two-sided 95 % intervals.
const Z_95: f64 = 1.959_963_984_540_054;

/// Largest number of failure sets [`exact`] will enumerate before asking for Monte Carlo.
pub const EXACT_ENUMERATION_LIMIT: f64 = 2e8;

/// A recovery probability: exact, or estimated with a 95 % confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecoveryEstimate {
    pub probability: f64,
    /// Present for Monte Carlo estimates.
    pub ci_low: Option<f64>,
    pub ci_high: Option<f64>,
    pub trials: Option<u64>,
}

impl RecoveryEstimate {
    pub fn exact(probability: f64) -> Self {
        Self {
            probability,
            ci_low: None,
            ci_high: None,
            trials: None,
        }
    }
}

/// `C(n, k)` as f64 (exact below 2^53, relative error ~1e-15 above).
pub fn binomial(n: usize, k: usize) -> f64 {
    if k > n {
        return 0.0;
    }
    let k = k.min(n - k);
    (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
}

/// Exact recovery probability of an MRO plan with disjoint node blocks `block_sizes` among
/// `nodes` nodes, under `failed` uniform failures: the probability that the `R = N − k` alive
/// nodes hit every block. Computed as `Σ_j ways(j)·C(N − ΣL, R − j) / C(N, R)` where `ways(j)`
/// counts the ways to pick `j` alive nodes inside the blocks with at least one per block — the
/// same number as §10's inclusion–exclusion ([`mro_inclusion_exclusion`]) without its `2^G`
/// terms or its cancellation.
pub fn mro_closed_form(block_sizes: &[usize], nodes: usize, failed: usize) -> f64 {
    let in_blocks: usize = block_sizes.iter().sum();
    assert!(in_blocks <= nodes, "blocks exceed the cluster");
    if failed > nodes {
        return 0.0;
    }
    let alive = nodes - failed;
    let mut ways = vec![1.0f64]; // ways[j]: j alive nodes chosen inside processed blocks
    for &len in block_sizes {
        let mut next = vec![0.0; ways.len() + len];
        for (j, &w) in ways.iter().enumerate() {
            if w == 0.0 {
                continue;
            }
            for a in 1..=len {
                next[j + a] += w * binomial(len, a);
            }
        }
        ways = next;
    }
    let rest = nodes - in_blocks;
    let hits: f64 = ways
        .iter()
        .enumerate()
        .filter(|&(j, _)| j <= alive)
        .map(|(j, &w)| w * binomial(rest, alive - j))
        .sum();
    (hits / binomial(nodes, alive)).clamp(0.0, 1.0)
}

/// The §10 formula literally: `Σ_{J⊆blocks} (−1)^{|J|} C(N − Σ_{i∈J} L_i, R) / C(N, R)`.
/// Exponential in the number of blocks (at most 24 here); kept as the reference form.
pub fn mro_inclusion_exclusion(block_sizes: &[usize], nodes: usize, failed: usize) -> f64 {
    assert!(block_sizes.len() <= 24, "too many blocks for 2^G terms");
    let alive = nodes.saturating_sub(failed);
    let total = binomial(nodes, alive);
    let g = block_sizes.len();
    let mut p = 0.0;
    for subset in 0u32..(1 << g) {
        let removed: usize = (0..g)
            .filter(|i| subset >> i & 1 == 1)
            .map(|i| block_sizes[i])
            .sum();
        let sign = if subset.count_ones() % 2 == 0 {
            1.0
        } else {
            -1.0
        };
        if removed <= nodes {
            p += sign * binomial(nodes - removed, alive) / total;
        }
    }
    p
}

/// A set of nodes as 64-bit words.
type NodeSet = Vec<u64>;

fn words_for(nodes: usize) -> usize {
    nodes.div_ceil(64).max(1)
}

fn is_subset(a: &[u64], b: &[u64]) -> bool {
    a.iter().zip(b).all(|(x, y)| x & !y == 0)
}

/// The minimal critical node sets of a model (one or more layers on the same node numbering).
/// Recovery ⇔ every returned set keeps at least one live node.
pub fn critical_sets(layers: &[LayerPlacement]) -> Result<Vec<NodeSet>, PlanError> {
    let first = layers.first().ok_or(PlanError::NoLayers(0))?;
    let nodes = first.nodes();
    let w = words_for(nodes);
    let mut sets: Vec<NodeSet> = Vec::new();
    for (l, layer) in layers.iter().enumerate() {
        if layer.nodes() != nodes {
            return Err(PlanError::LayerNodeMismatch {
                layer: l,
                expected: nodes,
                got: layer.nodes(),
            });
        }
        for s in layer.node_sets() {
            let mut m = vec![0u64; w];
            for n in s {
                m[n / 64] |= 1 << (n % 64);
            }
            sets.push(m);
        }
    }
    sets.sort_by_key(|m| (m.iter().map(|x| x.count_ones()).sum::<u32>(), m.clone()));
    sets.dedup();
    let mut minimal: Vec<NodeSet> = Vec::new();
    for m in sets {
        if !minimal.iter().any(|k| is_subset(k, &m)) {
            minimal.push(m);
        }
    }
    Ok(minimal)
}

fn check_failed(failed: usize, units: usize, unit: &'static str) -> Result<(), PlanError> {
    if failed > units {
        return Err(PlanError::TooManyFailures {
            failed,
            units,
            unit,
        });
    }
    Ok(())
}

/// Exact enumeration works on `u64` bitmasks of at most 64 failure units and gives up beyond
/// [`EXACT_ENUMERATION_LIMIT`] failure sets.
fn check_enumerable(units: usize, failed: usize, unit: &'static str) -> Result<(), PlanError> {
    if units > 64 {
        return Err(PlanError::TooManyNodesForExact(units));
    }
    check_failed(failed, units, unit)?;
    let count = binomial(units, failed);
    if count > EXACT_ENUMERATION_LIMIT {
        return Err(PlanError::EnumerationTooLarge {
            n: units,
            k: failed,
            count,
            limit: EXACT_ENUMERATION_LIMIT,
        });
    }
    Ok(())
}

/// Visits every `k`-subset of `n ≤ 64` bits (Gosper's hack), stopping early if `f` says so.
fn for_each_subset(n: usize, k: usize, mut f: impl FnMut(u64)) {
    if k == 0 {
        f(0);
        return;
    }
    if k > n {
        return;
    }
    let limit: u64 = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
    let mut s: u64 = if k == 64 { u64::MAX } else { (1u64 << k) - 1 };
    loop {
        f(s);
        // Next larger integer with the same popcount.
        let c = s & s.wrapping_neg();
        let r = s.wrapping_add(c);
        if r == 0 || r > limit {
            return;
        }
        s = (((r ^ s) >> 2) / c) | r;
        if s > limit {
            return;
        }
    }
}

/// Exact recovery probability of `layers` under `failed` uniformly random node failures, by
/// enumerating all `C(N, k)` failure sets (N ≤ 64). Returns `(recoverable sets, all sets)` so
/// callers can form an exact fraction.
pub fn exact_counts(layers: &[LayerPlacement], failed: usize) -> Result<(u64, u64), PlanError> {
    let critical = critical_sets(layers)?;
    let nodes = layers[0].nodes();
    check_enumerable(nodes, failed, "nodes")?;
    let masks: Vec<u64> = critical.iter().map(|m| m[0]).collect();
    let (mut ok, mut all) = (0u64, 0u64);
    for_each_subset(nodes, failed, |dead| {
        all += 1;
        // Critical sets are sorted smallest first, the likeliest to die: early exits are cheap.
        if masks.iter().all(|m| m & !dead != 0) {
            ok += 1;
        }
    });
    Ok((ok, all))
}

/// Exact recovery probability for `failed` uniformly random node failures (see [`exact_counts`]).
pub fn exact(layers: &[LayerPlacement], failed: usize) -> Result<f64, PlanError> {
    let (ok, all) = exact_counts(layers, failed)?;
    Ok(ok as f64 / all as f64)
}

/// Nodes of each failure domain, as node sets; `domain_of_node` is dense `0..domains`.
fn domain_sets(domain_of_node: &[usize], domains: usize) -> Vec<NodeSet> {
    let w = words_for(domain_of_node.len());
    let mut sets = vec![vec![0u64; w]; domains];
    for (n, &d) in domain_of_node.iter().enumerate() {
        sets[d][n / 64] |= 1 << (n % 64);
    }
    sets
}

fn survives(critical: &[NodeSet], dead: &[u64]) -> bool {
    critical
        .iter()
        .all(|m| m.iter().zip(dead).any(|(x, d)| x & !d != 0))
}

/// Exact recovery probability when `failed` of the failure domains (e.g. racks), drawn uniformly,
/// fail with all their nodes. `domain_of_node` must be dense `0..D` (see
/// [`crate::spec::ClusterSpec::domains`]); D ≤ 64.
pub fn exact_domains(
    layers: &[LayerPlacement],
    domain_of_node: &[usize],
    failed: usize,
) -> Result<f64, PlanError> {
    let critical = critical_sets(layers)?;
    let nodes = layers[0].nodes();
    if domain_of_node.len() != nodes {
        return Err(PlanError::DomainCount {
            nodes,
            got: domain_of_node.len(),
        });
    }
    let domains = domain_of_node.iter().max().map_or(0, |d| d + 1);
    check_enumerable(domains, failed, "failure domains")?;
    let dsets = domain_sets(domain_of_node, domains);
    let w = words_for(nodes);
    let (mut ok, mut all) = (0u64, 0u64);
    let mut dead = vec![0u64; w];
    for_each_subset(domains, failed, |subset| {
        dead.iter_mut().for_each(|x| *x = 0);
        for (d, set) in dsets.iter().enumerate() {
            if subset >> d & 1 == 1 {
                dead.iter_mut().zip(set).for_each(|(x, s)| *x |= s);
            }
        }
        all += 1;
        if survives(&critical, &dead) {
            ok += 1;
        }
    });
    Ok(ok as f64 / all as f64)
}

/// Largest number of failure sets [`exact_small_k`] will list.
pub const SMALL_K_LIMIT: f64 = 2e7;

/// Exact recovery probability under `failed` uniform node failures for **any** number of nodes,
/// by listing only the failure sets that contain a critical set (those have at most `failed`
/// nodes, so few exist when `failed` is small — the `k = f` check of a re-layout). Errors when
/// that list would exceed [`SMALL_K_LIMIT`].
pub fn exact_small_k(layers: &[LayerPlacement], failed: usize) -> Result<f64, PlanError> {
    let nodes = layers.first().ok_or(PlanError::NoLayers(0))?.nodes();
    check_failed(failed, nodes, "nodes")?;
    let critical: Vec<Vec<usize>> = critical_sets(layers)?
        .into_iter()
        .map(|m| {
            (0..nodes)
                .filter(|&n| m[n / 64] >> (n % 64) & 1 == 1)
                .collect::<Vec<usize>>()
        })
        .filter(|s| s.len() <= failed)
        .collect();
    recovery_from_small_sets(nodes, failed, critical.iter().map(Vec::as_slice))
}

/// The listing core of [`exact_small_k`]: the recovery probability under `failed` uniform node
/// failures when an expert dies exactly when all nodes of one of `sets` fail. Sets larger than
/// `failed` cannot die and are ignored; duplicates and non-minimal sets are harmless.
pub fn recovery_from_small_sets<'a>(
    nodes: usize,
    failed: usize,
    sets: impl Iterator<Item = &'a [usize]>,
) -> Result<f64, PlanError> {
    check_failed(failed, nodes, "nodes")?;
    let critical: Vec<&[usize]> = sets.filter(|s| s.len() <= failed).collect();
    let listed: f64 = critical
        .iter()
        .map(|s| binomial(nodes - s.len(), failed - s.len()))
        .sum();
    if listed > SMALL_K_LIMIT {
        return Err(PlanError::EnumerationTooLarge {
            n: nodes,
            k: failed,
            count: listed,
            limit: SMALL_K_LIMIT,
        });
    }
    let mut bad: std::collections::BTreeSet<Vec<usize>> = std::collections::BTreeSet::new();
    for s in &critical {
        let rest: Vec<usize> = (0..nodes).filter(|n| !s.contains(n)).collect();
        let need = failed - s.len();
        // Every way to complete `s` to a failure set of size `failed`.
        let mut idx: Vec<usize> = (0..need).collect();
        loop {
            let mut f: Vec<usize> = s
                .iter()
                .copied()
                .chain(idx.iter().map(|&i| rest[i]))
                .collect();
            f.sort_unstable();
            bad.insert(f);
            let mut i = need;
            while i > 0 && idx[i - 1] == rest.len() - need + i - 1 {
                i -= 1;
            }
            if i == 0 {
                break;
            }
            idx[i - 1] += 1;
            for j in i..need {
                idx[j] = idx[j - 1] + 1;
            }
        }
    }
    Ok(1.0 - bad.len() as f64 / binomial(nodes, failed))
}

/// Wilson score interval (95 %) for `successes` out of `trials`.
pub fn wilson_interval(successes: u64, trials: u64) -> (f64, f64) {
    if trials == 0 {
        return (0.0, 1.0);
    }
    let n = trials as f64;
    let p = successes as f64 / n;
    let z2 = Z_95 * Z_95;
    let denom = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denom;
    let half = Z_95 * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// Monte Carlo estimate with a seeded portable generator (xoshiro256++): each trial draws a
/// uniform `k`-subset of units (nodes, or failure domains when `domain_of_node` is given) by a
/// partial Fisher–Yates shuffle. Same seed → same estimate. Any N.
pub fn monte_carlo(
    layers: &[LayerPlacement],
    domain_of_node: Option<&[usize]>,
    failed: usize,
    trials: u64,
    seed: u64,
) -> Result<RecoveryEstimate, PlanError> {
    if trials == 0 {
        return Err(PlanError::ZeroTrials);
    }
    let critical = critical_sets(layers)?;
    let nodes = layers[0].nodes();
    let w = words_for(nodes);
    let (unit_sets, unit): (Vec<NodeSet>, &'static str) = match domain_of_node {
        Some(d) => {
            if d.len() != nodes {
                return Err(PlanError::DomainCount {
                    nodes,
                    got: d.len(),
                });
            }
            let domains = d.iter().max().map_or(0, |x| x + 1);
            (domain_sets(d, domains), "failure domains")
        }
        None => (
            (0..nodes)
                .map(|n| {
                    let mut m = vec![0u64; w];
                    m[n / 64] |= 1 << (n % 64);
                    m
                })
                .collect(),
            "nodes",
        ),
    };
    let units = unit_sets.len();
    check_failed(failed, units, unit)?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut idx: Vec<usize> = (0..units).collect();
    let mut dead = vec![0u64; w];
    let mut ok = 0u64;
    for _ in 0..trials {
        dead.iter_mut().for_each(|x| *x = 0);
        for i in 0..failed {
            let j = rng.random_range(i..units);
            idx.swap(i, j);
            dead.iter_mut()
                .zip(&unit_sets[idx[i]])
                .for_each(|(x, s)| *x |= s);
        }
        if survives(&critical, &dead) {
            ok += 1;
        }
    }
    let (lo, hi) = wilson_interval(ok, trials);
    Ok(RecoveryEstimate {
        probability: ok as f64 / trials as f64,
        ci_low: Some(lo),
        ci_high: Some(hi),
        trials: Some(trials),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gosper_counts_subsets() {
        for (n, k) in [(5, 2), (10, 0), (6, 6), (64, 1), (20, 3)] {
            let mut c = 0u64;
            for_each_subset(n, k, |s| {
                assert_eq!(s.count_ones() as usize, k);
                c += 1;
            });
            assert_eq!(c as f64, binomial(n, k), "n={n} k={k}");
        }
    }

    #[test]
    fn closed_form_matches_inclusion_exclusion() {
        for blocks in [
            vec![2, 2, 2],
            vec![1, 3],
            vec![2, 3],
            vec![4],
            vec![1, 1, 1, 1],
        ] {
            for n in blocks.iter().sum::<usize>()..12 {
                for k in 0..=n {
                    let a = mro_closed_form(&blocks, n, k);
                    let b = mro_inclusion_exclusion(&blocks, n, k);
                    assert!((a - b).abs() < 1e-12, "{blocks:?} n={n} k={k}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn wilson_contains_p() {
        let (lo, hi) = wilson_interval(50, 100);
        assert!(lo < 0.5 && hi > 0.5 && hi - lo < 0.2);
        assert_eq!(wilson_interval(0, 10).0, 0.0);
    }
}
