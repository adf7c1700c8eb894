//! Per-step expert loads `[moe_layer][expert]` that drive the simulation: a replayed gate
//! trace (SmartMoE, as the paper does) or a synthetic Zipf popularity that drifts.

use anyhow::{Context, Result, bail};
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;

/// Where the loads of each training step come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// A recorded gate trace (see [`load_gate_trace`]).
    Trace(GateTrace),
    /// Zipf popularity with drift (see [`Workload::loads`]).
    Zipf {
        /// Exponent: the expert of popularity rank `i` (0 = hottest) gets load ∝ `1/(i+1)^s`.
        s: f64,
        /// The ranking changes every this many steps; 0 = never.
        drift_every_steps: u64,
        seed: u64,
        experts: usize,
        layers: usize,
    },
}

/// Scale of the synthetic Zipf loads (load of the hottest expert); only ratios matter. Large
/// so that rounding to integers leaves the shares intact even for steep exponents.
const ZIPF_SCALE: f64 = 1e9;

impl Workload {
    /// Rejects parameters that would make [`loads`](Self::loads) meaningless.
    pub fn validate(&self) -> Result<()> {
        match self {
            Workload::Trace(_) => Ok(()),
            Workload::Zipf {
                s, experts, layers, ..
            } => {
                if !(s.is_finite() && *s >= 0.0) {
                    bail!("Zipf exponent must be finite and >= 0, got {s}");
                }
                if *experts == 0 || *layers == 0 {
                    bail!("Zipf workload needs experts and layers > 0 (got {experts}, {layers})");
                }
                Ok(())
            }
        }
    }

    pub fn layers(&self) -> usize {
        match self {
            Workload::Trace(t) => t.layers(),
            Workload::Zipf { layers, .. } => *layers,
        }
    }

    pub fn experts(&self) -> usize {
        match self {
            Workload::Trace(t) => t.experts(),
            Workload::Zipf { experts, .. } => *experts,
        }
    }

    /// Loads `[layer][expert]` at training step `step` (0-based).
    ///
    /// * `Trace`: [`GateTrace::loads_at_step`].
    /// * `Zipf`: the expert at popularity rank `i` gets `round(10⁹ / (i+1)^s)`. Each layer has
    ///   a base ranking, a permutation of the experts seeded by `(seed, layer)`. With drift,
    ///   step `s` belongs to epoch `k = s / drift_every_steps` and the ranking of epoch `k` is
    ///   the base ranking with `⌈E/8⌉` random adjacent swaps applied (positions drawn from an
    ///   RNG seeded by `(seed, layer, k)`). So the ranking changes at every epoch boundary
    ///   and stays a perturbation of the base ranking — it does not random-walk away, matching
    ///   the trace, where the hottest expert rarely changes after warm-up — and any step's
    ///   loads cost `O(L·E)` without replaying earlier epochs. Deterministic in
    ///   `(seed, step)`.
    pub fn loads(&self, step: u64) -> Vec<Vec<u64>> {
        match self {
            Workload::Trace(t) => t.loads_at_step(step).to_vec(),
            Workload::Zipf {
                s,
                drift_every_steps,
                seed,
                experts,
                layers,
            } => {
                let base: Vec<u64> = (0..*experts)
                    .map(|i| (ZIPF_SCALE / ((i + 1) as f64).powf(*s)).round() as u64)
                    .collect();
                let epoch = step.checked_div(*drift_every_steps);
                (0..*layers)
                    .map(|l| {
                        let ranking = zipf_ranking(*seed, l, *experts, epoch);
                        let mut row = vec![0; *experts];
                        for (rank, &e) in ranking.iter().enumerate() {
                            row[e] = base[rank];
                        }
                        row
                    })
                    .collect()
            }
        }
    }

    /// The first step after `step` at which the loads may change, or `None` if they never
    /// change again.
    pub fn next_change(&self, step: u64) -> Option<u64> {
        match self {
            Workload::Trace(t) => t.next_change(step),
            Workload::Zipf {
                drift_every_steps, ..
            } => {
                let d = *drift_every_steps;
                (d > 0).then(|| (step / d + 1) * d)
            }
        }
    }
}

/// SplitMix64 finaliser: mixes seeds so nearby inputs give unrelated RNG streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Experts in popularity order (index 0 = hottest) for `layer` in drift epoch `epoch`
/// (`None`: no drift, the base ranking).
fn zipf_ranking(seed: u64, layer: usize, experts: usize, epoch: Option<u64>) -> Vec<usize> {
    let mut ranking: Vec<usize> = (0..experts).collect();
    let layer_seed = mix(seed ^ mix(layer as u64));
    ranking.shuffle(&mut Xoshiro256PlusPlus::seed_from_u64(layer_seed));
    if let Some(k) = epoch
        && experts > 1
    {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(mix(layer_seed ^ mix(k ^ 0x5eed)));
        for _ in 0..experts.div_ceil(8) {
            let i = rng.random_range(0..experts - 1);
            ranking.swap(i, i + 1);
        }
    }
    ranking
}

/// A gate trace in the SmartMoE derived format, reduced to a model's layers and experts.
#[derive(Debug, Clone, PartialEq)]
pub struct GateTrace {
    /// Sampled training iterations (1-based, as in the trace), ascending.
    iterations: Vec<u64>,
    /// `[row][layer][expert]` assignment counts of the kept experts.
    loads: Vec<Vec<Vec<u64>>>,
    /// `[row][layer][expert]` trace expert id playing each model expert.
    source_ids: Vec<Vec<Vec<u32>>>,
    /// Experts per layer in the file.
    source_experts: usize,
}

impl GateTrace {
    pub fn layers(&self) -> usize {
        self.loads[0].len()
    }

    pub fn experts(&self) -> usize {
        self.loads[0][0].len()
    }

    /// Experts per layer in the trace file.
    pub fn source_experts(&self) -> usize {
        self.source_experts
    }

    /// The sampled iterations, ascending.
    pub fn iterations(&self) -> &[u64] {
        &self.iterations
    }

    /// Row of training step `step` (0-based): the step is trace iteration `step + 1` (the
    /// trace counts from 1), mapped to the latest sampled iteration `≤ step + 1`; before the
    /// first sample, the first; after the last, the last (clamped).
    fn row_of_step(&self, step: u64) -> usize {
        let iter = step.saturating_add(1);
        self.iterations
            .partition_point(|&i| i <= iter)
            .saturating_sub(1)
    }

    /// The sampled iteration whose loads step `step` uses.
    pub fn iteration_for_step(&self, step: u64) -> u64 {
        self.iterations[self.row_of_step(step)]
    }

    /// Loads `[layer][expert]` of training step `step` (0-based).
    pub fn loads_at_step(&self, step: u64) -> &[Vec<u64>] {
        &self.loads[self.row_of_step(step)]
    }

    /// Loads of a sampled iteration, if it is one.
    pub fn loads_at_iteration(&self, iteration: u64) -> Option<&[Vec<u64>]> {
        let row = self.iterations.binary_search(&iteration).ok()?;
        Some(&self.loads[row])
    }

    /// Trace expert id of each model expert, `[layer][expert]`, at step `step`.
    pub fn source_ids_at_step(&self, step: u64) -> &[Vec<u32>] {
        &self.source_ids[self.row_of_step(step)]
    }

    /// First step after `step` that maps to another sampled iteration.
    fn next_change(&self, step: u64) -> Option<u64> {
        let next = self.row_of_step(step) + 1;
        // Iteration i is first used by step i - 1; it is > step + 1 here.
        self.iterations.get(next).map(|&i| (i - 1).max(step + 1))
    }
}

/// Reads the SmartMoE derived gate trace (`iter,layer,e0,…,e{N-1}`, one row per sampled
/// iteration and layer; `shared/traces/routing/README.md`) for a model with `layers` MoE
/// layers and `experts` experts per layer.
///
/// Mapping (the README's reading of the paper's "loads of the top experts at each layer"; the
/// paper gives no details):
/// * **Layers**: the first `layers` layers of the trace (0…layers−1).
/// * **Experts**: in every row, the `experts` most-loaded trace experts (ties: lower id); the
///   others are dropped, and since only shares matter the kept counts are used as they are
///   (implicitly renormalised). The trace counts top-2 assignments; each counts as one token
///   of the top-1 model.
/// * **Expert identity**: model expert ids are assigned at the first sampled iteration, in
///   ascending trace id. When the top set of a later row changes, each entering trace expert
///   takes the model id of a leaving one — paired by load (the most-loaded entering one takes
///   the id of the one that was most loaded in the previous row). So a trace expert keeps its
///   model id for as long as it stays in the top set, and shifts of popularity among kept
///   experts show up as real load drift rather than being sorted away.
///
/// Rows may come in any order; every sampled iteration must have all `layers` layers. Errors
/// name the file and the line.
pub fn load_gate_trace(path: &Path, layers: usize, experts: usize) -> Result<GateTrace> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read gate trace {}", path.display()))?;
    parse_gate_trace(&text, layers, experts)
        .with_context(|| format!("gate trace {}", path.display()))
}

fn parse_gate_trace(text: &str, layers: usize, experts: usize) -> Result<GateTrace> {
    if layers == 0 || experts == 0 {
        bail!("need at least one layer and one expert (got {layers} layers, {experts} experts)");
    }
    let mut lines = text.lines().enumerate();
    let (_, header) = lines
        .find(|(_, l)| !l.trim().is_empty())
        .context("the file is empty")?;
    let cols: Vec<&str> = header.trim().split(',').map(str::trim).collect();
    // `iter` (SmartMoE derived) or `step` (our plain per-step CSV: `step,layer,e0,…,e{N-1}`,
    // one row per (step, layer), steps ascending).
    if cols.len() < 3 || !(cols[0] == "iter" || cols[0] == "step") || cols[1] != "layer" {
        bail!("line 1: expected a header `iter,layer,e0,…` or `step,layer,e0,…`, found {header:?}");
    }
    let source_experts = cols.len() - 2;
    if experts > source_experts {
        bail!("the trace has {source_experts} experts per layer, fewer than the model's {experts}");
    }

    // iter → layer → (line number, counts)
    let mut rows: BTreeMap<u64, BTreeMap<u64, (usize, Vec<u64>)>> = BTreeMap::new();
    for (i, raw) in lines {
        let line_no = i + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let values = line
            .split(',')
            .map(|x| {
                x.trim()
                    .parse::<u64>()
                    .with_context(|| format!("line {line_no}: {x:?} is not a non-negative integer"))
            })
            .collect::<Result<Vec<u64>>>()?;
        if values.len() != cols.len() {
            bail!(
                "line {line_no}: {} fields, the header has {}",
                values.len(),
                cols.len()
            );
        }
        let (iter, layer) = (values[0], values[1]);
        if let Some((first, _)) = rows
            .entry(iter)
            .or_default()
            .insert(layer, (line_no, values[2..].to_vec()))
        {
            bail!("line {line_no}: iteration {iter}, layer {layer} already given on line {first}");
        }
    }
    if rows.is_empty() {
        bail!("no data rows after the header");
    }

    let mut iterations = Vec::with_capacity(rows.len());
    let mut loads = Vec::with_capacity(rows.len());
    let mut source_ids: Vec<Vec<Vec<u32>>> = Vec::with_capacity(rows.len());
    for (iter, by_layer) in &rows {
        let mut row_loads = Vec::with_capacity(layers);
        let mut row_ids = Vec::with_capacity(layers);
        for layer in 0..layers {
            let (_, counts) = by_layer.get(&(layer as u64)).with_context(|| {
                format!("iteration {iter} has no row for layer {layer} (the model needs {layers} layers)")
            })?;
            let prev_ids = source_ids.last().map(|r| &r[layer]);
            let prev_loads = loads.last().map(|r: &Vec<Vec<u64>>| &r[layer]);
            let ids = keep_top(counts, experts, prev_ids.zip(prev_loads));
            row_loads.push(ids.iter().map(|&id| counts[id as usize]).collect());
            row_ids.push(ids);
        }
        iterations.push(*iter);
        loads.push(row_loads);
        source_ids.push(row_ids);
    }
    Ok(GateTrace {
        iterations,
        loads,
        source_ids,
        source_experts,
    })
}

/// Trace ids of the model experts for one row: the `experts` most-loaded (ties: lower id),
/// keeping the previous row's id assignment where possible (see [`load_gate_trace`]).
/// `prev`: the previous row's ids and loads, both in model-expert order.
fn keep_top(counts: &[u64], experts: usize, prev: Option<(&Vec<u32>, &Vec<u64>)>) -> Vec<u32> {
    let mut order: Vec<u32> = (0..counts.len() as u32).collect();
    order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    let top = &order[..experts];
    let Some((prev_ids, prev_loads)) = prev else {
        let mut ids = top.to_vec();
        ids.sort_unstable();
        return ids;
    };
    let mut ids = prev_ids.clone();
    // Model slots whose trace expert left the top set, most loaded (previous row) first.
    let mut vacated: Vec<usize> = (0..experts).filter(|&j| !top.contains(&ids[j])).collect();
    vacated.sort_by(|&a, &b| prev_loads[b].cmp(&prev_loads[a]).then(a.cmp(&b)));
    // Entering trace experts, most loaded first (`top` is already in that order).
    let entering = top.iter().filter(|id| !prev_ids.contains(id));
    for (slot, &id) in vacated.into_iter().zip(entering) {
        ids[slot] = id;
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMARTMOE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/routing/smartmoe/derived/global_expert_counts.csv"
    );

    #[test]
    fn zipf_is_deterministic_and_shaped() {
        let w = Workload::Zipf {
            s: 1.2,
            drift_every_steps: 100,
            seed: 7,
            experts: 16,
            layers: 12,
        };
        w.validate().unwrap();
        let a = w.loads(250);
        assert_eq!(a.len(), 12);
        assert!(a.iter().all(|r| r.len() == 16));
        assert_eq!(a, w.loads(250));
        assert_eq!(a, w.loads(200)); // same epoch
        // Every layer holds the Zipf values, permuted.
        let mut want: Vec<u64> = (0..16)
            .map(|i| (ZIPF_SCALE / ((i + 1) as f64).powf(1.2)).round() as u64)
            .collect();
        want.sort_unstable();
        for row in &a {
            let mut got = row.clone();
            got.sort_unstable();
            assert_eq!(got, want);
        }
        // Layers disagree on which expert is hot.
        assert!(a.iter().any(|r| r != &a[0]));
        // Drift: some epoch boundary changes some layer, and a different seed differs.
        assert!((1..20).any(|k| w.loads(k * 100) != w.loads((k - 1) * 100)));
        let other = Workload::Zipf {
            s: 1.2,
            drift_every_steps: 100,
            seed: 8,
            experts: 16,
            layers: 12,
        };
        assert_ne!(other.loads(250), a);
        assert_eq!(w.next_change(250), Some(300));
        assert_eq!(w.next_change(299), Some(300));
        assert_eq!(w.next_change(300), Some(400));
    }

    #[test]
    fn zipf_without_drift_is_static() {
        let w = Workload::Zipf {
            s: 0.0,
            drift_every_steps: 0,
            seed: 1,
            experts: 4,
            layers: 2,
        };
        assert_eq!(w.loads(0), vec![vec![1_000_000_000; 4]; 2]);
        assert_eq!(w.loads(0), w.loads(1_000_000));
        assert_eq!(w.next_change(5), None);
        let bad = Workload::Zipf {
            s: f64::NAN,
            drift_every_steps: 0,
            seed: 1,
            experts: 4,
            layers: 2,
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn drift_stays_near_the_base_ranking() {
        // With E = 8 one adjacent swap per epoch: an epoch differs from the base ranking in at
        // most two experts.
        for k in 0..50 {
            let base = zipf_ranking(3, 1, 8, None);
            let r = zipf_ranking(3, 1, 8, Some(k));
            assert!(base.iter().zip(&r).filter(|(a, b)| a != b).count() <= 2);
        }
    }

    #[test]
    fn small_trace_mapping() {
        let t = "iter,layer,e0,e1,e2,e3\n\
                 11,0,1,9,5,0\n11,1,4,3,2,1\n\
                 1,0,5,9,1,0\n1,1,1,2,3,4\n\
                 21,0,9,1,0,5\n21,1,1,2,3,4\n";
        let g = parse_gate_trace(t, 2, 2).unwrap();
        assert_eq!(g.iterations(), &[1, 11, 21]);
        assert_eq!((g.layers(), g.experts(), g.source_experts()), (2, 2, 4));
        // Iteration 1, layer 0: top-2 are e1 (9), e0 (5) → ids ascending [0, 1].
        assert_eq!(g.loads_at_iteration(1).unwrap()[0], vec![5, 9]);
        // Iteration 11, layer 0: top-2 e1 (9), e2 (5): e0 left slot 0, e2 takes it.
        assert_eq!(g.source_ids_at_step(10)[0], vec![2, 1]);
        assert_eq!(g.loads_at_step(10)[0], vec![5, 9]);
        // Iteration 21: e0 (9) and e3 (5) enter; e1 (prev 9, slot 1) ↔ e0, e2 (slot 0) ↔ e3.
        assert_eq!(g.source_ids_at_step(20)[0], vec![3, 0]);
        assert_eq!(g.loads_at_step(20)[0], vec![5, 9]);
        // Layer 1, iteration 1: top-2 e3, e2 → [2, 3]; iteration 11: e0 (4), e1 (3) replace.
        assert_eq!(g.source_ids_at_step(0)[1], vec![2, 3]);
        assert_eq!(g.source_ids_at_step(10)[1], vec![1, 0]);
        // Step mapping: step s → latest sampled iteration ≤ s + 1, clamped.
        assert_eq!(g.iteration_for_step(0), 1);
        assert_eq!(g.iteration_for_step(9), 1);
        assert_eq!(g.iteration_for_step(10), 11);
        assert_eq!(g.iteration_for_step(1_000_000), 21);
        assert_eq!(g.next_change(0), Some(10));
        assert_eq!(g.next_change(10), Some(20));
        assert_eq!(g.next_change(25), None);
        let w = Workload::Trace(g.clone());
        assert_eq!(w.loads(15), g.loads_at_step(15).to_vec());
        assert_eq!((w.layers(), w.experts()), (2, 2));
    }

    #[test]
    fn trace_errors_name_the_line() {
        let e = |t: &str, l, x| format!("{:#}", parse_gate_trace(t, l, x).unwrap_err());
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n1,1,x,2\n", 2, 2);
        assert!(msg.contains("line 3"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n1,0,1,2\n", 1, 2);
        assert!(msg.contains("line 3") && msg.contains("line 2"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2,3\n", 1, 2);
        assert!(msg.contains("line 2"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n", 2, 2);
        assert!(msg.contains("layer 1"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n", 1, 3);
        assert!(msg.contains("2 experts"), "{msg}");
        let msg = e("it,layer,e0\n", 1, 1);
        assert!(msg.contains("line 1"), "{msg}");
        let msg = format!(
            "{:#}",
            load_gate_trace(Path::new("/nonexistent/trace.csv"), 1, 1).unwrap_err()
        );
        assert!(msg.contains("/nonexistent/trace.csv"), "{msg}");
    }

    #[test]
    fn real_smartmoe_trace() {
        let g = load_gate_trace(Path::new(SMARTMOE), 12, 16).unwrap();
        assert_eq!(g.iterations().len(), 501);
        assert_eq!(g.iterations()[0], 1);
        assert_eq!(*g.iterations().last().unwrap(), 5001);
        assert_eq!(g.iteration_for_step(2000), 2001);
        let l = g.loads_at_step(2000);
        assert_eq!(l.len(), 12);
        assert!(l.iter().all(|r| r.len() == 16));
        // Each full row sums to 262,144 assignments (README); the top 16 of 32 keep most.
        for row in l {
            let kept: u64 = row.iter().sum();
            assert!(kept <= 262_144 && kept > 262_144 * 9 / 10, "{kept}");
        }
        // Skewed after warm-up: in some layer one expert takes > 25 % of the kept load.
        assert!(l.iter().any(|r| {
            let s: u64 = r.iter().sum();
            *r.iter().max().unwrap() * 4 > s
        }));
        // Identity is stable: the hottest model expert of a layer with a fixed hot expert
        // (README: layer 1 never changes after iteration 1000) stays the same.
        let hot = |step: u64| {
            let r = &g.loads_at_step(step)[1];
            (0..r.len()).max_by_key(|&e| r[e]).unwrap()
        };
        assert_eq!(hot(1000), hot(4000));
        // Same model expert → same trace expert while it stays in the top set.
        assert_eq!(
            g.source_ids_at_step(1000)[1][hot(1000)],
            g.source_ids_at_step(4000)[1][hot(4000)]
        );
        // Deterministic.
        assert_eq!(g, load_gate_trace(Path::new(SMARTMOE), 12, 16).unwrap());
        assert!(load_gate_trace(Path::new(SMARTMOE), 25, 8).is_err());
    }
}
