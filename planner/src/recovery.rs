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
/// same number as §10's inclusion–exclusion (kept literally as a test oracle,
/// `planner/tests/oracles/mro_inclusion_exclusion.rs`) without its `2^G` terms or its
/// cancellation.
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
    let nodes = layers.first().ok_or(PlanError::NoLayers(0))?.nodes();
    // Limits first: `critical_sets` is quadratic in the number of sets.
    check_enumerable(nodes, failed, "nodes")?;
    let critical = critical_sets(layers)?;
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
///
/// Beyond 64 nodes (no `u64` masks) it switches by itself to the exact methods that never list
/// all `C(N, k)` sets — the interval closed form or the small-set listing of [`recovery_auto`] —
/// and fails with [`PlanError::TooManyNodesForExact`] only when neither is affordable (checked
/// before the work).
pub fn exact(layers: &[LayerPlacement], failed: usize) -> Result<f64, PlanError> {
    let nodes = layers.first().ok_or(PlanError::NoLayers(0))?.nodes();
    if nodes > 64 {
        check_failed(failed, nodes, "nodes")?;
        let sets = small_critical_sets(layers, failed)?;
        return exact_small_sets(nodes, failed, sets)?
            .ok_or(PlanError::TooManyNodesForExact(nodes));
    }
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
    // `O(total slots)`; the listing limit is checked inside before any listing starts.
    let critical: Vec<Vec<usize>> = small_critical_sets(layers, failed)?
        .into_iter()
        .map(|s| s.into_iter().map(|n| n as usize).collect())
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

/// Monte Carlo estimate with a seeded portable generator (xoshiro256++). Node failures
/// (`domain_of_node = None`) go through [`FailureModel::monte_carlo`] (chunked, thread-count
/// independent, `O(k)` per trial at any N); failure domains draw a uniform `k`-subset of domains
/// by a partial Fisher–Yates shuffle. Same seed → same estimate. Any N.
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
    let nodes = layers.first().ok_or(PlanError::NoLayers(0))?.nodes();
    if domain_of_node.is_none() {
        // Node failures: the scalable sampler (small critical sets only, chunked and seeded).
        return FailureModel::new(layers, failed)?.monte_carlo(failed, trials, seed);
    }
    let critical = critical_sets(layers)?;
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

// ---------------------------------------------------------------------------------------------
// Recovery at frontier scale (16K+ nodes)
// ---------------------------------------------------------------------------------------------

/// Largest `max_failed` the interval closed form accepts: `C(N, k)` must stay finite in `f64`
/// (≈ 1e181 at N = 16,384, k = 64; 128 still fits at that N).
pub const INTERVAL_MAX_FAILED: usize = 128;

/// The node sets `S_e` (distinct nodes holding expert `e`, ascending) of every expert of every
/// layer that have **at most `max_size` nodes**, deduplicated and sorted. Only those can be
/// wiped out by `max_size` failures, so they are all a recovery question with `k ≤ max_size`
/// needs; non-minimal sets among them are harmless. `O(total slots)`: no pairwise subset test,
/// which is what makes [`critical_sets`] quadratic at scale.
pub fn small_critical_sets(
    layers: &[LayerPlacement],
    max_size: usize,
) -> Result<Vec<Vec<u32>>, PlanError> {
    let first = layers.first().ok_or(PlanError::NoLayers(0))?;
    let nodes = first.nodes();
    let mut out: Vec<Vec<u32>> = Vec::new();
    for (l, layer) in layers.iter().enumerate() {
        if layer.nodes() != nodes {
            return Err(PlanError::LayerNodeMismatch {
                layer: l,
                expected: nodes,
                got: layer.nodes(),
            });
        }
        let experts = layer.experts();
        // Pass 1: distinct nodes per expert (a node's slots are sorted, but count by last node
        // seen so that unsorted grids work too).
        let mut last = vec![usize::MAX; experts];
        let mut count = vec![0usize; experts];
        for (n, row) in layer.grid().iter().enumerate() {
            for &e in row {
                let e = e as usize;
                if last[e] != n {
                    last[e] = n;
                    count[e] += 1;
                }
            }
        }
        if count.iter().all(|&c| c > max_size) {
            continue;
        }
        // Pass 2: collect the small ones.
        let mut sets: Vec<Vec<u32>> = count
            .iter()
            .map(|&c| {
                if c <= max_size {
                    Vec::with_capacity(c)
                } else {
                    Vec::new()
                }
            })
            .collect();
        for (n, row) in layer.grid().iter().enumerate() {
            for &e in row {
                let e = e as usize;
                if count[e] <= max_size && sets[e].last() != Some(&(n as u32)) {
                    sets[e].push(n as u32);
                }
            }
        }
        out.extend(
            sets.into_iter()
                .zip(&count)
                .filter(|(_, c)| **c <= max_size)
                .map(|(s, _)| s),
        );
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The critical node intervals `[start, start + len)` of an **aligned MRO model plan**: every
/// layer's blocks laid out consecutively from plan node 0 ([`crate::model::plan_model`] with
/// [`crate::model::Alignment::Aligned`]). Under MRO a layer fails exactly when one of its blocks
/// dies (Lazarus §4.1, App. A.2: the representative of a group lives only in its block), and the
/// other experts' node sets contain their block, so these intervals are the model's critical
/// sets. Zero-length blocks are skipped.
pub fn mro_model_intervals(block_sizes: &[Vec<usize>]) -> Vec<(usize, usize)> {
    let mut iv: Vec<(usize, usize)> = Vec::new();
    for blocks in block_sizes {
        let mut start = 0;
        for &len in blocks {
            if len > 0 {
                iv.push((start, len));
            }
            start += len;
        }
    }
    iv.sort_unstable();
    iv.dedup();
    iv
}

/// Exact recovery probability, for every `k = 0..=max_failed` at once, when the critical sets
/// are node **intervals** `(start, len)` on `0..nodes`: the share of `k`-subsets of failed nodes
/// that contain no interval entirely.
///
/// Why it is fast: an interval longer than `k` cannot die, so only intervals of length
/// `≤ max_failed` matter. They are merged into maximal overlapping segments; inside a segment a
/// DP over positions tracks (failures so far, current run of consecutive failures), and a
/// position `b` forbids runs at least as long as the shortest interval ending at `b` — a run
/// that starts before the segment is irrelevant, since it kills an interval only if it covers
/// the interval, i.e. only if the part inside the segment does. Nodes outside every segment are
/// free (a binomial factor). Cost `O(Σ segment length · k²)` plus `O(#segments · k²)`, with no
/// dependence on how long the intervals that cannot die are.
///
/// # Errors
/// [`PlanError::TooManyFailures`] if `max_failed > nodes`; [`PlanError::EnumerationTooLarge`]
/// if `max_failed > INTERVAL_MAX_FAILED` (counts would overflow `f64`). An interval reaching past
/// `nodes` is reported as [`PlanError::NotMro`]. Both are checked before any work.
pub fn interval_recovery(
    nodes: usize,
    intervals: &[(usize, usize)],
    max_failed: usize,
) -> Result<Vec<f64>, PlanError> {
    check_failed(max_failed, nodes, "nodes")?;
    if max_failed > INTERVAL_MAX_FAILED {
        return Err(PlanError::EnumerationTooLarge {
            n: nodes,
            k: max_failed,
            count: binomial(nodes, max_failed),
            limit: binomial(nodes, INTERVAL_MAX_FAILED),
        });
    }
    if let Some(&(s, l)) = intervals.iter().find(|&&(s, l)| s + l > nodes) {
        return Err(PlanError::NotMro(format!(
            "interval [{s}, {}) reaches past {nodes} nodes",
            s + l
        )));
    }
    let k_max = max_failed;
    // An empty interval is dead from the start: nothing recovers.
    if intervals.iter().any(|&(_, l)| l == 0) {
        return Ok(vec![0.0; k_max + 1]);
    }
    let mut short: Vec<(usize, usize)> = intervals
        .iter()
        .copied()
        .filter(|&(_, l)| l <= k_max)
        .collect();
    short.sort_unstable();
    // ways[j]: failure sets of size j over the nodes processed so far that kill no interval.
    let mut ways = vec![0.0f64; k_max + 1];
    ways[0] = 1.0;
    let mut free = nodes;
    let mut i = 0;
    let mut seg_ways: Vec<f64> = Vec::new();
    let mut dp: Vec<f64> = Vec::new();
    let mut next: Vec<f64> = Vec::new();
    while i < short.len() {
        // One maximal segment of overlapping short intervals.
        let seg_start = short[i].0;
        let mut seg_end = short[i].0 + short[i].1;
        let mut j = i;
        while j < short.len() && short[j].0 < seg_end {
            seg_end = seg_end.max(short[j].0 + short[j].1);
            j += 1;
        }
        let len = seg_end - seg_start;
        // Shortest interval ending at each position of the segment (usize::MAX: none).
        let mut min_len = vec![usize::MAX; len];
        let mut cap = 0;
        for &(s, l) in &short[i..j] {
            let b = s + l - 1 - seg_start;
            min_len[b] = min_len[b].min(l);
            cap = cap.max(l);
        }
        // Runs at or beyond `cap` kill whatever interval ends here; track runs up to cap - 1
        // and one "≥ cap" bucket is never needed because such a run is always fatal at an end
        // position — but positions without an end let it grow, so keep a saturating bucket.
        let width = cap + 1; // run lengths 0..=cap (cap = saturated)
        let kk = k_max.min(len);
        dp.clear();
        dp.resize((kk + 1) * width, 0.0);
        dp[0] = 1.0;
        for &ml in &min_len {
            next.clear();
            next.resize((kk + 1) * width, 0.0);
            for f in 0..=kk {
                let row = &dp[f * width..(f + 1) * width];
                let alive: f64 = row.iter().sum();
                // This node alive: the run resets.
                next[f * width] += alive;
                if f < kk {
                    // This node failed: the run grows (saturating at cap).
                    for (run, &w) in row.iter().enumerate() {
                        if w == 0.0 {
                            continue;
                        }
                        let nr = (run + 1).min(cap);
                        if nr >= ml {
                            continue; // the interval ending here is entirely dead
                        }
                        next[(f + 1) * width + nr] += w;
                    }
                }
            }
            std::mem::swap(&mut dp, &mut next);
        }
        seg_ways.clear();
        seg_ways.extend((0..=kk).map(|f| dp[f * width..(f + 1) * width].iter().sum::<f64>()));
        convolve_truncated(&mut ways, &seg_ways);
        free -= len;
        i = j;
    }
    // Free nodes: any subset.
    let free_ways: Vec<f64> = (0..=k_max.min(free)).map(|f| binomial(free, f)).collect();
    convolve_truncated(&mut ways, &free_ways);
    Ok((0..=k_max)
        .map(|k| (ways[k] / binomial(nodes, k)).clamp(0.0, 1.0))
        .collect())
}

/// `a ← a * b` (polynomial product), keeping `a`'s length.
fn convolve_truncated(a: &mut [f64], b: &[f64]) {
    let n = a.len();
    let old = a.to_vec();
    a.iter_mut().for_each(|x| *x = 0.0);
    for (i, &x) in old.iter().enumerate() {
        if x == 0.0 {
            continue;
        }
        for (j, &y) in b.iter().enumerate().take(n - i) {
            a[i + j] += x * y;
        }
    }
}

/// Exact model-level recovery probability of an aligned MRO model plan (see
/// [`mro_model_intervals`]) for `k = 0..=max_failed` simultaneous uniform node failures.
/// `block_sizes[l]` are layer `l`'s MRO block sizes ([`crate::place::mro_structure`]).
pub fn mro_model_closed_form(
    block_sizes: &[Vec<usize>],
    nodes: usize,
    max_failed: usize,
) -> Result<Vec<f64>, PlanError> {
    interval_recovery(nodes, &mro_model_intervals(block_sizes), max_failed)
}

/// Exact model-level recovery curve `k = 0..=max_failed` of a [`crate::ModelPlan`] made by
/// `plan_model` with MRO placement and aligned layers (the default): the block sizes follow
/// from the allocations alone, so this never looks at the `N × c` grids.
///
/// # Errors
/// [`PlanError::NotMro`] when the plan is not MRO or a layer fell back to spread placement
/// (then use [`FailureModel`]); the errors of [`interval_recovery`].
pub fn model_plan_closed_form(
    plan: &crate::model::ModelPlan,
    max_failed: usize,
) -> Result<Vec<f64>, PlanError> {
    if plan.place != crate::place::PlacePolicy::Mro {
        return Err(PlanError::NotMro(format!("placement is {}", plan.place)));
    }
    let n = plan.cluster.nodes;
    let c = plan.cluster.slots_per_node;
    let mut blocks = Vec::with_capacity(plan.allocations.len());
    for (l, a) in plan.allocations.iter().enumerate() {
        let s = crate::place::mro_structure(&a.replicas, n, c);
        if s.spread_fallback {
            return Err(PlanError::NotMro(format!(
                "layer {l} fell back to spread placement"
            )));
        }
        blocks.push(s.block_sizes);
    }
    mro_model_closed_form(&blocks, n, max_failed)
}

/// Trials per Monte Carlo chunk. Chunk `i` draws from its own generator seeded from
/// `(seed, i)`, so the estimate depends on the seed and the trial count only — never on how
/// many threads ran the chunks.
const MC_CHUNK: u64 = 1 << 14;

/// A plan reduced to what `k ≤ max_failed` node failures can break: the node sets of at most
/// `max_failed` nodes ([`small_critical_sets`]), indexed by node. Build it once, then sample or
/// count failures cheaply at any cluster size.
#[derive(Debug, Clone)]
pub struct FailureModel {
    nodes: usize,
    max_failed: usize,
    /// Size of each small set.
    size: Vec<u32>,
    /// CSR: sets containing node `n` are `set_of[start[n]..start[n + 1]]`.
    start: Vec<u32>,
    set_of: Vec<u32>,
    sets: Vec<Vec<u32>>,
}

impl FailureModel {
    /// From a plan's layers (one node numbering).
    pub fn new(layers: &[LayerPlacement], max_failed: usize) -> Result<Self, PlanError> {
        let nodes = layers.first().ok_or(PlanError::NoLayers(0))?.nodes();
        check_failed(max_failed, nodes, "nodes")?;
        Ok(Self::from_sets(
            nodes,
            max_failed,
            small_critical_sets(layers, max_failed)?,
        ))
    }

    /// From explicit node sets (any sizes; larger than `max_failed` are dropped).
    ///
    /// # Panics
    /// If a set names a node `≥ nodes`.
    pub fn from_sets(nodes: usize, max_failed: usize, sets: Vec<Vec<u32>>) -> Self {
        let sets: Vec<Vec<u32>> = sets.into_iter().filter(|s| s.len() <= max_failed).collect();
        let mut start = vec![0u32; nodes + 1];
        for s in &sets {
            for &n in s {
                assert!((n as usize) < nodes, "node {n} out of range");
                start[n as usize + 1] += 1;
            }
        }
        for n in 0..nodes {
            start[n + 1] += start[n];
        }
        let mut fill = start.clone();
        let mut set_of = vec![0u32; start[nodes] as usize];
        for (i, s) in sets.iter().enumerate() {
            for &n in s {
                set_of[fill[n as usize] as usize] = i as u32;
                fill[n as usize] += 1;
            }
        }
        Self {
            nodes,
            max_failed,
            size: sets.iter().map(|s| s.len() as u32).collect(),
            start,
            set_of,
            sets,
        }
    }

    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The small node sets kept.
    pub fn sets(&self) -> &[Vec<u32>] {
        &self.sets
    }

    /// Does the model survive the failure of `dead` (distinct nodes, at most `max_failed`)?
    /// `hits` must be all zero on entry and is left all zero.
    fn survives_with(&self, dead: &[u32], hits: &mut [u32]) -> bool {
        let mut ok = true;
        for &n in dead {
            let n = n as usize;
            for &s in &self.set_of[self.start[n] as usize..self.start[n + 1] as usize] {
                hits[s as usize] += 1;
                if hits[s as usize] == self.size[s as usize] {
                    ok = false;
                }
            }
        }
        for &n in dead {
            let n = n as usize;
            for &s in &self.set_of[self.start[n] as usize..self.start[n + 1] as usize] {
                hits[s as usize] = 0;
            }
        }
        ok
    }

    /// [`Self::survives_with`] for callers with their own sampler: `dead` distinct and at most
    /// `max_failed`, `hits` one zero per set (left zero).
    pub(crate) fn survives_distinct(&self, dead: &[u32], hits: &mut [u32]) -> bool {
        self.survives_with(dead, hits)
    }

    /// Does the model survive these failed nodes (any number; duplicates ignored)?
    pub fn survives(&self, dead: &[u32]) -> bool {
        let mut d: Vec<u32> = dead.to_vec();
        d.sort_unstable();
        d.dedup();
        let mut is_dead = vec![false; self.nodes];
        d.iter()
            .filter(|&&n| (n as usize) < self.nodes)
            .for_each(|&n| is_dead[n as usize] = true);
        !self
            .sets
            .iter()
            .any(|s| s.iter().all(|&n| is_dead[n as usize]))
    }

    /// Seeded Monte Carlo estimate under `failed ≤ max_failed` uniform node failures, with a
    /// 95 % Wilson interval. Trials run in chunks of 16,384 on rayon's pool; chunk `i` uses
    /// xoshiro256++ seeded from `seed` and `i`, so the result is identical for the same seed
    /// whatever the number of threads. Each trial draws `failed` distinct nodes with Floyd's
    /// algorithm and counts, per small set, how many of its nodes died — `O(failed + sets hit)`
    /// per trial, independent of `N`.
    pub fn monte_carlo(
        &self,
        failed: usize,
        trials: u64,
        seed: u64,
    ) -> Result<RecoveryEstimate, PlanError> {
        use rayon::prelude::*;
        if trials == 0 {
            return Err(PlanError::ZeroTrials);
        }
        check_failed(failed, self.nodes, "nodes")?;
        if failed > self.max_failed {
            return Err(PlanError::TooManyFailures {
                failed,
                units: self.max_failed,
                unit: "failures (the model was built for fewer)",
            });
        }
        let chunks = trials.div_ceil(MC_CHUNK);
        let ok: u64 = (0..chunks)
            .into_par_iter()
            .map(|i| {
                let n_trials = MC_CHUNK.min(trials - i * MC_CHUNK);
                self.chunk(failed, n_trials, chunk_seed(seed, i))
            })
            .sum();
        let (lo, hi) = wilson_interval(ok, trials);
        Ok(RecoveryEstimate {
            probability: ok as f64 / trials as f64,
            ci_low: Some(lo),
            ci_high: Some(hi),
            trials: Some(trials),
        })
    }

    fn chunk(&self, failed: usize, trials: u64, seed: u64) -> u64 {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut hits = vec![0u32; self.sets.len()];
        let mut dead: Vec<u32> = Vec::with_capacity(failed);
        let n = self.nodes as u32;
        let mut ok = 0;
        for _ in 0..trials {
            // Floyd's algorithm: a uniform `failed`-subset in `failed` draws.
            dead.clear();
            for j in (n - failed as u32)..n {
                let t = rng.random_range(0..=j);
                if dead.contains(&t) {
                    dead.push(j);
                } else {
                    dead.push(t);
                }
            }
            if self.sets.is_empty() || self.survives_with(&dead, &mut hits) {
                ok += 1;
            }
        }
        ok
    }
}

/// Seed of Monte Carlo chunk `i` (SplitMix64 finalizer of `seed + i·golden`), so neighbouring
/// chunks get unrelated streams.
fn chunk_seed(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Monte Carlo trials [`recovery_auto`] runs when no exact method is affordable.
pub const AUTO_TRIALS: u64 = 200_000;

/// The recovery probability under `failed` uniform node failures by the cheapest method that
/// works at this size, chosen from limits checked **before** any long work: exact enumeration
/// (`N ≤ 64`, `C(N, k) ≤` [`EXACT_ENUMERATION_LIMIT`]); else the interval closed form when every
/// small critical set is a run of consecutive nodes (MRO plans); else listing the failure sets
/// that contain a small critical set (≤ [`SMALL_K_LIMIT`]); else seeded Monte Carlo with
/// [`AUTO_TRIALS`] trials (`seed`), which returns a confidence interval.
pub fn recovery_auto(
    layers: &[LayerPlacement],
    failed: usize,
    seed: u64,
) -> Result<RecoveryEstimate, PlanError> {
    let nodes = layers.first().ok_or(PlanError::NoLayers(0))?.nodes();
    check_failed(failed, nodes, "nodes")?;
    if nodes <= 64 && binomial(nodes, failed) <= EXACT_ENUMERATION_LIMIT {
        return exact(layers, failed).map(RecoveryEstimate::exact);
    }
    let sets = small_critical_sets(layers, failed)?;
    from_small_sets_auto(nodes, failed, sets, seed)
}

/// [`recovery_auto`] on precomputed small critical sets (node sets of at most `failed` nodes).
pub fn from_small_sets_auto(
    nodes: usize,
    failed: usize,
    sets: Vec<Vec<u32>>,
    seed: u64,
) -> Result<RecoveryEstimate, PlanError> {
    check_failed(failed, nodes, "nodes")?;
    let sets: Vec<Vec<u32>> = sets.into_iter().filter(|s| s.len() <= failed).collect();
    if let Some(p) = exact_small_sets(nodes, failed, sets.clone())? {
        return Ok(RecoveryEstimate::exact(p));
    }
    FailureModel::from_sets(nodes, failed, sets).monte_carlo(failed, AUTO_TRIALS, seed)
}

/// Exact probability from small critical sets when affordable (interval closed form, or a
/// listing within [`SMALL_K_LIMIT`]); `None` when neither is.
fn exact_small_sets(
    nodes: usize,
    failed: usize,
    sets: Vec<Vec<u32>>,
) -> Result<Option<f64>, PlanError> {
    check_failed(failed, nodes, "nodes")?;
    let sets: Vec<Vec<u32>> = sets.into_iter().filter(|s| s.len() <= failed).collect();
    if sets.is_empty() {
        return Ok(Some(1.0));
    }
    let contiguous = sets.iter().all(|s| s.windows(2).all(|w| w[1] == w[0] + 1));
    if contiguous && failed <= INTERVAL_MAX_FAILED {
        let iv: Vec<(usize, usize)> = sets.iter().map(|s| (s[0] as usize, s.len())).collect();
        let p = interval_recovery(nodes, &iv, failed)?;
        return Ok(Some(p[failed]));
    }
    let listed: f64 = sets
        .iter()
        .map(|s| binomial(nodes - s.len(), failed - s.len()))
        .sum();
    if listed <= SMALL_K_LIMIT {
        let as_usize: Vec<Vec<usize>> = sets
            .iter()
            .map(|s| s.iter().map(|&n| n as usize).collect())
            .collect();
        return recovery_from_small_sets(nodes, failed, as_usize.iter().map(Vec::as_slice))
            .map(Some);
    }
    Ok(None)
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
    fn wilson_contains_p() {
        let (lo, hi) = wilson_interval(50, 100);
        assert!(lo < 0.5 && hi > 0.5 && hi - lo < 0.2);
        assert_eq!(wilson_interval(0, 10).0, 0.0);
    }
}
