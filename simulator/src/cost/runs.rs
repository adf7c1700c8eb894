//! The replica table of a plan in run-length form, and the step cost computed on it.
//!
//! An MRO plan at 2,048 nodes has about 250 distinct node rows per layer (block nodes are
//! equal, and so are round-robin leftovers between the points where an expert's run ends).
//! [`LayerRuns`] keeps one row per run of consecutive equal nodes instead of one
//! `(rank, count)` pair per replica ([`super::SparseReplicas`]: 65,536 pairs per layer there),
//! and [`step_cost_runs`] evaluates the analytic dispatch once per run. Every per-rank sum is
//! formed with the same operations in the same order as [`super::step_cost_sparse`] on the
//! expanded table, so the two agree bit for bit (tested): equal nodes get equal traffic, and
//! the one sum over all holders (the overflow `S` of an expert) is taken in rank order over
//! the expanded runs whenever some replica overflows (never, when every expert's replicas are
//! fewer than the ranks).

use super::{
    ANALYTIC_DISPATCH_ABOVE_GPUS, Dispatch, HardwareProfile, LayerRows, ModelProfile,
    SparseReplicas, SparseStepInput, StepCost, routed_tokens, step_cost_sparse,
};
use anyhow::{Result, bail};
use lazarus_planner::LayerPlacement;
use rayon::prelude::*;

/// One MoE layer's replicas, `gpus_per_node` ranks per node, nodes in runs of equal rows.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct LayerRuns {
    /// `(first node, end node)` of each run, consecutive, covering `0..nodes`.
    pub runs: Vec<(u32, u32)>,
    /// Run `k`'s replicas are `rows[row_start[k]..row_start[k + 1]]`: `(expert, gpu, count)`
    /// ordered by expert, then GPU.
    pub row_start: Vec<u32>,
    pub rows: Vec<(u32, u32, u32)>,
    /// Expert `e`'s items are `items[expert_start[e]..expert_start[e + 1]]`.
    pub expert_start: Vec<u32>,
    /// `(run, gpu, count)`: every node of the run holds `count > 0` replicas of the expert on
    /// its GPU `gpu`; per expert ordered by run, then GPU (so by rank once expanded).
    pub items: Vec<(u32, u32, u32)>,
}

impl LayerRuns {
    /// The runs of a layer's grid (`grid[node]` = the node's slots, expert ids), where slot
    /// `s` is on GPU `gpu_of[s]` (ascending in `s`). Consecutive nodes with equal slot rows
    /// form one run.
    pub fn from_grid<'a>(
        grid: impl ExactSizeIterator<Item = &'a [u32]>,
        gpu_of: &[u32],
        experts: usize,
    ) -> LayerRuns {
        Self::from_rows(grid, |_, before, slots| before == slots, gpu_of, experts)
    }

    /// [`LayerRuns::from_grid`] of a placement's rows: equal to it, with consecutive rows
    /// compared by index when the placement knows its distinct rows
    /// ([`LayerPlacement::same_rows`]) rather than cell by cell.
    pub fn from_placement(placement: &LayerPlacement, gpu_of: &[u32], experts: usize) -> LayerRuns {
        let same = |node: usize, _: &[u32], _: &[u32]| placement.same_rows(node - 1, node);
        Self::from_rows(placement.grid().iter(), same, gpu_of, experts)
    }

    /// `same(node, before, slots)`: whether node `node`'s `slots` equal `before`, the row of
    /// node `node - 1`.
    fn from_rows<'a>(
        grid: impl ExactSizeIterator<Item = &'a [u32]>,
        same: impl Fn(usize, &[u32], &[u32]) -> bool,
        gpu_of: &[u32],
        experts: usize,
    ) -> LayerRuns {
        // `(expert, gpu, count)` of each run, in run order, back to back.
        let mut merged: Vec<(u32, u32, u32)> = Vec::new();
        let mut bounds: Vec<u32> = vec![0];
        let mut runs: Vec<(u32, u32)> = Vec::new();
        // The row of the current run (equal to the previous node's).
        let mut prev: Option<&[u32]> = None;
        for (node, slots) in grid.enumerate() {
            if prev.is_some_and(|before| same(node, before, slots)) {
                if let Some(run) = runs.last_mut() {
                    run.1 = node as u32 + 1;
                }
                continue;
            }
            let start = merged.len();
            for (slot, &e) in slots.iter().enumerate() {
                let gpu = gpu_of[slot];
                // Equal experts on one GPU merge even when not adjacent: one entry per rank.
                match merged[start..]
                    .iter_mut()
                    .rev()
                    .take_while(|m| m.1 == gpu)
                    .find(|m| m.0 == e)
                {
                    Some(m) => m.2 += 1,
                    None => merged.push((e, gpu, 1)),
                }
            }
            merged[start..].sort_unstable_by_key(|&(e, gpu, _)| (e, gpu));
            bounds.push(merged.len() as u32);
            runs.push((node as u32, node as u32 + 1));
            prev = Some(slots);
        }
        // Expert-major (counting sort): runs ascending within each expert.
        let mut expert_start = vec![0u32; experts + 1];
        for &(e, _, _) in &merged {
            expert_start[e as usize + 1] += 1;
        }
        for e in 0..experts {
            expert_start[e + 1] += expert_start[e];
        }
        let mut next: Vec<u32> = expert_start[..experts].to_vec();
        let mut items = vec![(0u32, 0u32, 0u32); merged.len()];
        for (run, w) in bounds.windows(2).enumerate() {
            for &(e, gpu, count) in &merged[w[0] as usize..w[1] as usize] {
                let at = &mut next[e as usize];
                items[*at as usize] = (run as u32, gpu, count);
                *at += 1;
            }
        }
        LayerRuns {
            runs,
            row_start: bounds,
            rows: merged,
            expert_start,
            items,
        }
    }

    /// Nodes covered by the runs.
    pub fn nodes(&self) -> usize {
        self.runs.last().map_or(0, |r| r.1 as usize)
    }

    fn expert(&self, e: usize) -> &[(u32, u32, u32)] {
        &self.items[self.expert_start[e] as usize..self.expert_start[e + 1] as usize]
    }

    /// Holder ranks of expert `e`'s items (each item stands for its run's nodes).
    fn holder_ranks(&self, items: &[(u32, u32, u32)]) -> usize {
        items
            .iter()
            .map(|&(run, _, _)| {
                let (first, end) = self.runs[run as usize];
                (end - first) as usize
            })
            .sum()
    }

    /// Replicas of expert `e`'s items over all their runs' nodes.
    fn replicas(&self, items: &[(u32, u32, u32)]) -> u64 {
        items
            .iter()
            .map(|&(run, _, c)| {
                let (first, end) = self.runs[run as usize];
                u64::from(end - first) * u64::from(c)
            })
            .sum()
    }

    /// Calls `f(rank, count)` for expert `e`'s replicas in rank order.
    fn for_each_rank(&self, e: usize, g: usize, mut f: impl FnMut(usize, u32)) {
        for same_run in self.expert(e).chunk_by(|a, b| a.0 == b.0) {
            let (first, end) = self.runs[same_run[0].0 as usize];
            for node in first as usize..end as usize {
                for &(_, gpu, count) in same_run {
                    f(node * g + gpu as usize, count);
                }
            }
        }
    }

    /// The `[expert]` → `(rank, count)` rows of [`super::SparseReplicas`].
    pub fn expand(&self, g: usize) -> Vec<Vec<(u32, u32)>> {
        (0..self.expert_start.len().saturating_sub(1))
            .map(|e| {
                let mut row = Vec::with_capacity(self.holder_ranks(self.expert(e)));
                self.for_each_rank(e, g, |rank, count| row.push((rank as u32, count)));
                row
            })
            .collect()
    }

    /// Well-formed: runs consecutive from node 0, items in range, ordered and positive.
    fn check(&self, layer: usize, experts: usize, g: usize) -> Result<()> {
        let consecutive = self.runs.iter().try_fold(0u32, |at, &(first, end)| {
            (first == at && end > first).then_some(end)
        });
        let starts_ok = self.expert_start.len() == experts + 1
            && self.expert_start.first() == Some(&0)
            && self.expert_start.windows(2).all(|w| w[0] <= w[1])
            && self.expert_start.last().map(|&s| s as usize) == Some(self.items.len());
        let rows_ok = self.row_start.len() == self.runs.len() + 1
            && self.row_start.first() == Some(&0)
            && self.row_start.windows(2).all(|w| w[0] <= w[1])
            && self.row_start.last().map(|&s| s as usize) == Some(self.rows.len())
            && self.rows.len() == self.items.len();
        if consecutive.is_none() || !starts_ok || !rows_ok {
            bail!("MoE layer {layer}: malformed runs of equal nodes");
        }
        for e in 0..experts {
            let items = self.expert(e);
            let ordered = items
                .windows(2)
                .all(|w| (w[0].0, w[0].1) < (w[1].0, w[1].1));
            let in_range = items.iter().all(|&(run, gpu, count)| {
                (run as usize) < self.runs.len() && (gpu as usize) < g && count > 0
            });
            if !ordered || !in_range {
                bail!(
                    "MoE layer {layer}, expert {e}: replicas are not positive counts on \
                     GPUs below {g} in run order"
                );
            }
        }
        Ok(())
    }
}

/// The ranked form ([`SparseReplicas`]) of run-length layers.
pub fn expand_runs(layers: &[LayerRuns], gpus_per_node: usize) -> SparseReplicas {
    layers.iter().map(|l| l.expand(gpus_per_node)).collect()
}

/// [`step_cost_sparse`] of [`Dispatch::Unpadded`] replicas in run-length form on
/// `nodes × hw.gpus_per_node` ranks: the same result, bit for bit. Above
/// [`ANALYTIC_DISPATCH_ABOVE_GPUS`] ranks each run is evaluated once; at or below it (the
/// planned dispatch needs every rank) the runs are expanded first.
pub fn step_cost_runs(
    hw: &HardwareProfile,
    model: &ModelProfile,
    nodes: usize,
    layers: &[LayerRuns],
    loads: &[Vec<u64>],
) -> Result<StepCost> {
    let g = hw.gpus_per_node;
    let gpus = nodes * g;
    if gpus <= ANALYTIC_DISPATCH_ABOVE_GPUS {
        let replicas = expand_runs(layers, g);
        return step_cost_sparse(
            hw,
            model,
            &SparseStepInput {
                gpus,
                replicas: LayerRows::Each(&replicas),
                loads,
                dispatch: Dispatch::Unpadded,
                ep_groups: None,
                equal_nodes: None,
            },
        );
    }
    // A global batch: every per-rank term at this membership's share (as in the ranked form).
    let model = &*model.at_ranks(gpus);
    super::check_layer_counts(model, gpus, layers.len(), loads)?;
    let (inter_bw, intra_bw) = (hw.rank_inter_bandwidth(), hw.rank_intra_bandwidth());
    let (terms, grad_allreduce_s) = rayon::join(
        || {
            layers
                .par_iter()
                .zip(loads.par_iter())
                .enumerate()
                .map(|(layer, (runs, loads))| -> Result<(f64, f64)> {
                    if runs.expert_start.len() != model.experts + 1 || loads.len() != model.experts
                    {
                        bail!(
                            "MoE layer {layer}: {} replica rows and {} loads, the model has {} \
                             experts",
                            runs.expert_start.len().saturating_sub(1),
                            loads.len(),
                            model.experts
                        );
                    }
                    if runs.nodes() != nodes {
                        bail!(
                            "MoE layer {layer}: runs cover {} nodes, expected {nodes}",
                            runs.nodes()
                        );
                    }
                    runs.check(layer, model.experts, g)?;
                    let t = routed_tokens(loads, model.assignments_per_gpu())
                        .map_err(|e| anyhow::anyhow!("MoE layer {layer}: {e}"))?;
                    let traffic = analytic_runs(&t, runs, g)
                        .map_err(|e| anyhow::anyhow!("MoE layer {layer}: {e}"))?;
                    let max_processed = traffic.processed.iter().copied().fold(0.0, f64::max);
                    let processed = match hw.host_cores {
                        // The rank-order sum of every rank's work, as the ranked form sums it.
                        Some(cores) => {
                            let mut sum = 0.0;
                            for (k, &(first, end)) in runs.runs.iter().enumerate() {
                                for _ in first..end {
                                    for p in &traffic.processed[k * g..(k + 1) * g] {
                                        sum += p;
                                    }
                                }
                            }
                            max_processed.max(sum / cores)
                        }
                        None => max_processed,
                    };
                    Ok((processed, traffic.max_link_time(inter_bw, intra_bw)))
                })
                .collect::<Vec<_>>()
        },
        || grad_allreduce_runs(hw, model, nodes, layers),
    );
    // The first failing layer's error, as the ranked form reports it.
    let terms: Vec<(f64, f64)> = terms.into_iter().collect::<Result<_>>()?;
    super::assemble(
        hw,
        model,
        gpus,
        terms.into_iter().map(|t| Some(Ok(t))),
        grad_allreduce_s,
    )
}

/// Per-rank traffic of the first node of each run: `[run * g + gpu]`.
struct RunTraffic {
    processed: Vec<f64>,
    sent_inter: Vec<f64>,
    recv_inter: Vec<f64>,
    sent_intra: Vec<f64>,
    recv_intra: Vec<f64>,
}

impl RunTraffic {
    /// As `Traffic::max_link_time`: the ranks of a run equal its first node's.
    fn max_link_time(&self, inter_bw: f64, intra_bw: f64) -> f64 {
        (0..self.processed.len())
            .map(|r| {
                let inter = self.sent_inter[r].max(self.recv_inter[r]) / inter_bw;
                let intra = self.sent_intra[r].max(self.recv_intra[r]) / intra_bw;
                inter.max(intra)
            })
            .fold(0.0, f64::max)
    }
}

/// `analytic_layer` on the runs' first nodes: the same operations per rank, in the same
/// order (see that function for the model).
fn analytic_runs(t: &[u64], layer: &LayerRuns, g: usize) -> Result<RunTraffic> {
    let k = layer.runs.len();
    let gpus = layer.nodes() * g;
    let zeros = || vec![0.0; k * g];
    let mut tr = RunTraffic {
        processed: zeros(),
        sent_inter: zeros(),
        recv_inter: zeros(),
        sent_intra: zeros(),
        recv_intra: zeros(),
    };
    let (mut p_node, mut o_node) = (vec![0.0; k], vec![0.0; k]);
    let mut held_on = vec![0usize; k];
    let mut touched: Vec<usize> = Vec::new();
    let (mut nh_intra, mut nh_inter) = (vec![0.0; k], vec![0.0; k]);
    let mut uniform_inter = 0.0;
    for (e, &te) in t.iter().enumerate() {
        if te == 0 {
            continue;
        }
        let items = layer.expert(e);
        if items.is_empty() {
            bail!("expert {e} receives {te} tokens per rank but has no replica");
        }
        // Integers: exact in any order, as in the ranked form.
        let r_e = layer.replicas(items) as f64;
        let te = te as f64;
        let per_replica = te * gpus as f64 / r_e;
        let holders = layer.holder_ranks(items);
        let mut s = te * (gpus - holders) as f64;
        // A holder adds to `S` only when it overflows; then the sum runs in rank order.
        if items
            .iter()
            .any(|&(_, _, r)| te > per_replica * f64::from(r))
        {
            layer.for_each_rank(e, g, |_, r| {
                let c = per_replica * f64::from(r);
                if te > c {
                    s += te - c;
                }
            });
        }
        touched.clear();
        for &(run, _, _) in items {
            let n = run as usize;
            if held_on[n] == 0 {
                touched.push(n);
            }
            held_on[n] += 1;
        }
        for &n in &touched {
            o_node[n] = te * (g - held_on[n]) as f64;
        }
        for &(run, gpu, r) in items {
            let (n, j) = (run as usize, run as usize * g + gpu as usize);
            let c = per_replica * f64::from(r);
            tr.processed[j] += c;
            if te > c {
                o_node[n] += te - c;
            } else {
                p_node[n] += c - te;
            }
        }
        if s > 0.0 {
            uniform_inter += te;
            for &n in &touched {
                let same = p_node[n] / s;
                nh_intra[n] += te * same;
                nh_inter[n] -= te * same;
            }
            for &(run, gpu, r) in items {
                let (n, j) = (run as usize, run as usize * g + gpu as usize);
                let c = per_replica * f64::from(r);
                let same = p_node[n] / s;
                tr.sent_intra[j] -= te * same;
                tr.sent_inter[j] -= te * (1.0 - same);
                if te > c {
                    tr.sent_intra[j] += (te - c) * same;
                    tr.sent_inter[j] += (te - c) * (1.0 - same);
                } else {
                    let from_node = (o_node[n] / s).min(1.0);
                    tr.recv_intra[j] += (c - te) * from_node;
                    tr.recv_inter[j] += (c - te) * (1.0 - from_node);
                }
            }
        }
        for &n in &touched {
            p_node[n] = 0.0;
            o_node[n] = 0.0;
            held_on[n] = 0;
        }
    }
    for n in 0..k {
        for j in n * g..(n + 1) * g {
            tr.sent_intra[j] += nh_intra[n];
            tr.sent_inter[j] += uniform_inter + nh_inter[n];
        }
    }
    Ok(tr)
}

/// `grad_allreduce_s` of run-length layers: every rank's bytes summed in (layer, expert)
/// order as the ranked form sums them. Nodes that share a run in every layer get equal sums,
/// so one node per segment of the layers' common refinement is evaluated (layers with equal
/// sorted counts share their run bounds: few segments), segments in parallel. Each run's own
/// rows (by expert) are the items of the node's row, so its adds come in expert order.
fn grad_allreduce_runs(
    hw: &HardwareProfile,
    model: &ModelProfile,
    nodes: usize,
    layers: &[LayerRuns],
) -> f64 {
    let g = hw.gpus_per_node;
    let gpus = nodes * g;
    let ring = |m: usize, bytes: f64| 2.0 * (m - 1) as f64 / m as f64 * bytes;
    let dense = (gpus >= 2).then(|| {
        (
            ring(gpus, model.dense_grad_bytes() as f64),
            hw.node_of(gpus - 1) > 0,
        )
    });
    let expert_bytes = model.expert_grad_bytes() as f64;
    // Per (layer, expert): the ring's bytes and whether it spans nodes; `None` below 2 ranks.
    let rings: Vec<Vec<Option<(f64, bool)>>> = layers
        .par_iter()
        .map(|layer| {
            (0..layer.expert_start.len().saturating_sub(1))
                .map(|e| {
                    let items = layer.expert(e);
                    let m = layer.holder_ranks(items);
                    if m < 2 {
                        return None;
                    }
                    let first = layer.runs[items[0].0 as usize].0;
                    let last = layer.runs[items[items.len() - 1].0 as usize].1 - 1;
                    Some((ring(m, expert_bytes), first != last))
                })
                .collect()
        })
        .collect();
    // The first node of every segment of the common refinement.
    let mut starts: Vec<u32> = layers
        .iter()
        .flat_map(|l| l.runs.iter().map(|r| r.0))
        .collect();
    starts.sort_unstable();
    starts.dedup();
    let (inter_bw, intra_bw) = (hw.rank_inter_bandwidth(), hw.rank_intra_bandwidth());
    starts
        .par_iter()
        .map_init(
            || (vec![0.0; g], vec![0.0; g]),
            |(inter, intra), &node| {
                inter.fill(0.0);
                intra.fill(0.0);
                if let Some((v, spans)) = dense {
                    let target = if spans { &mut *inter } else { &mut *intra };
                    target.iter_mut().for_each(|x| *x += v);
                }
                for (layer, rings) in layers.iter().zip(&rings) {
                    let k = layer.runs.partition_point(|r| r.1 <= node);
                    let row =
                        &layer.rows[layer.row_start[k] as usize..layer.row_start[k + 1] as usize];
                    for &(e, gpu, _) in row {
                        let Some((v, spans)) = rings[e as usize] else {
                            continue;
                        };
                        let target = if spans { &mut *inter } else { &mut *intra };
                        target[gpu as usize] += v;
                    }
                }
                (0..g)
                    .map(|r| (inter[r] / inter_bw).max(intra[r] / intra_bw))
                    .fold(0.0, f64::max)
            },
        )
        .reduce(|| 0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{hardware, model};

    /// Seeded xorshift: `next(n)` in `0..n`.
    fn rng(seed: u64) -> impl FnMut(u64) -> usize {
        let mut x = seed | 1;
        move |n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        }
    }

    /// `[expert]` → `(rank, count)` slot by slot, merging into the row's last entry.
    fn ranked_reference(
        grid: &[Vec<u32>],
        g: usize,
        gpu_of: &[u32],
        experts: usize,
    ) -> Vec<Vec<(u32, u32)>> {
        let mut rows: Vec<Vec<(u32, u32)>> = vec![Vec::new(); experts];
        for (node, slots) in grid.iter().enumerate() {
            for (slot, &e) in slots.iter().enumerate() {
                let rank = (node * g) as u32 + gpu_of[slot];
                let row = &mut rows[e as usize];
                match row.last_mut() {
                    Some(last) if last.0 == rank => last.1 += 1,
                    _ => row.push((rank, 1)),
                }
            }
        }
        rows
    }

    /// A grid of `nodes` rows drawn from a few distinct ones (runs of equal nodes), slots in
    /// any order, an expert twice on a GPU with another between; every expert placed.
    fn random_grid(
        next: &mut impl FnMut(u64) -> usize,
        nodes: usize,
        slots: usize,
        experts: usize,
    ) -> Vec<Vec<u32>> {
        let distinct: Vec<Vec<u32>> = (0..1 + next(6))
            .map(|_| (0..slots).map(|_| next(experts as u64) as u32).collect())
            .collect();
        let mut grid: Vec<Vec<u32>> = Vec::with_capacity(nodes);
        while grid.len() < nodes {
            let row = &distinct[next(distinct.len() as u64)];
            for _ in 0..(1 + next(8)).min(nodes - grid.len()) {
                grid.push(row.clone());
            }
        }
        for e in 0..experts.min(nodes * slots) {
            grid[e / slots][e % slots] = e as u32;
        }
        grid
    }

    /// The runs of an MRO plan's placements (which compare rows by index) are the runs of
    /// their cells, for every layer of seeded plans of skewed loads.
    #[test]
    fn runs_of_a_placement_are_the_runs_of_its_grid() {
        let mut next = rng(0x5851_F42D_4C95_7F2D);
        let mut planned = 0;
        for case in 0..40 {
            let (g, experts, layers) = (1 + next(4), 2 + next(30), 1 + next(4));
            let slots = g * (1 + next(4));
            let nodes = experts.div_ceil(slots) + next(40);
            let cluster = lazarus_planner::ClusterSpec::new(nodes, slots).with_gpus_per_node(g);
            let spec = lazarus_planner::ModelSpec {
                experts,
                layers,
                f: 1 + next(2),
            };
            let loads: Vec<Vec<u64>> = (0..layers)
                .map(|_| (0..experts).map(|_| 1 + next(1000) as u64).collect())
                .collect();
            let Ok(plan) = lazarus_planner::plan_model(
                &cluster,
                &spec,
                &loads,
                lazarus_planner::AllocPolicy::Lazarus,
                lazarus_planner::PlacePolicy::Mro,
                lazarus_planner::Alignment::Aligned,
            ) else {
                continue;
            };
            planned += 1;
            let gpu_of: Vec<u32> = (0..slots).map(|s| cluster.gpu_of_slot(s) as u32).collect();
            for layer in &plan.layers {
                let want = LayerRuns::from_grid(layer.grid().iter(), &gpu_of, experts);
                let got = LayerRuns::from_placement(layer, &gpu_of, experts);
                assert_eq!(got, want, "case {case}");
            }
        }
        assert!(
            planned >= 30,
            "only {planned} of 40 seeded plans were feasible"
        );
    }

    /// Runs expand to the slot-by-slot rows (300 seeded grids), and are maximal: a run starts
    /// exactly where a node's row differs from the previous node's.
    #[test]
    fn runs_expand_to_the_slot_by_slot_rows() {
        let mut next = rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..300 {
            let (slots, experts, g) = (1 + next(12), 1 + next(6), 1 + next(4));
            let nodes = 1 + next(30);
            let grid = random_grid(&mut next, nodes, slots, experts);
            let cluster =
                lazarus_planner::ClusterSpec::new(grid.len(), slots).with_gpus_per_node(g);
            let gpu_of: Vec<u32> = (0..slots).map(|s| cluster.gpu_of_slot(s) as u32).collect();
            let runs = LayerRuns::from_grid(grid.iter().map(Vec::as_slice), &gpu_of, experts);
            assert_eq!(
                runs.expand(g),
                ranked_reference(&grid, g, &gpu_of, experts),
                "grid {grid:?}, {g} GPUs per node"
            );
            runs.check(0, experts, g).unwrap();
            assert_eq!(runs.nodes(), grid.len());
            for &(first, end) in &runs.runs {
                let (first, end) = (first as usize, end as usize);
                assert!(grid[first..end].iter().all(|r| *r == grid[first]));
                assert!(
                    first == 0 || grid[first - 1] != grid[first],
                    "grid {grid:?}"
                );
            }
        }
    }

    /// The step cost on runs is the ranked form's bit for bit, above the analytic threshold
    /// (and below it, where the runs are expanded): random grids of few experts on many
    /// slots, so that some replicas overflow (`T_e > c`, the rank-order sum of `S`); hosts
    /// with and without a core limit; zero loads; global batches.
    #[test]
    fn step_cost_on_runs_is_the_ranked_one_bit_for_bit() {
        let mut next = rng(0x2545_F491_4F6C_DD1D);
        let base_hw = hardware("h200-400g").unwrap();
        let base_model = model("deepseek-v3").unwrap();
        let mut overflowed = 0;
        for case in 0..40 {
            let mut hw = base_hw.clone();
            hw.gpus_per_node = 1 + next(8);
            hw.host_cores = (case % 3 == 0).then_some(4.0 + next(60) as f64);
            let mut model = base_model.clone();
            model.experts = 2 + next(14);
            model.moe_layers = 1 + next(4);
            // A global batch's share of the ranks (and its data-less rounds on shared cores).
            if case % 4 == 2 {
                let micro = 1 + next(4) as u64;
                let k = 1 + next(600) as u64;
                model.global_batch =
                    Some(lazarus_planner::data::GlobalBatch::new(k * micro, micro).unwrap());
            }
            let g = hw.gpus_per_node;
            let nodes = if case % 5 == 0 {
                1 + next(16)
            } else {
                257 / g + 1 + next(40)
            };
            let slots = g * (1 + next(6));
            let cluster = lazarus_planner::ClusterSpec::new(nodes, slots).with_gpus_per_node(g);
            let gpu_of: Vec<u32> = (0..slots).map(|s| cluster.gpu_of_slot(s) as u32).collect();
            let layers: Vec<LayerRuns> = (0..model.moe_layers)
                .map(|_| {
                    let grid = random_grid(&mut next, nodes, slots, model.experts);
                    LayerRuns::from_grid(grid.iter().map(Vec::as_slice), &gpu_of, model.experts)
                })
                .collect();
            let loads: Vec<Vec<u64>> = (0..model.moe_layers)
                .map(|_| {
                    (0..model.experts)
                        .map(|e| {
                            if e == 1 && case % 4 == 1 {
                                0
                            } else {
                                1 + next(1000) as u64
                            }
                        })
                        .collect()
                })
                .collect();
            let ranked = expand_runs(&layers, g);
            let want = step_cost_sparse(
                &hw,
                &model,
                &SparseStepInput {
                    gpus: nodes * g,
                    replicas: LayerRows::Each(&ranked),
                    loads: &loads,
                    dispatch: Dispatch::Unpadded,
                    ep_groups: None,
                    equal_nodes: None,
                },
            )
            .unwrap();
            let got = step_cost_runs(&hw, &model, nodes, &layers, &loads).unwrap();
            assert_eq!(got.total_s.to_bits(), want.total_s.to_bits(), "case {case}");
            assert_eq!(got.all_to_all_s.to_bits(), want.all_to_all_s.to_bits());
            assert_eq!(
                got.grad_allreduce_s.to_bits(),
                want.grad_allreduce_s.to_bits()
            );
            assert_eq!(got, want, "case {case}");
            let t: Vec<u64> = routed_tokens(&loads[0], model.assignments_per_gpu()).unwrap();
            let gpus = (nodes * g) as f64;
            // Whether some replica of layer 0 overflows (`T_e > c`).
            let layer = &layers[0];
            overflowed += usize::from((0..model.experts).any(|e| {
                let items = layer.expert(e);
                let r_e = layer.replicas(items) as f64;
                let te = t[e] as f64;
                te > 0.0
                    && items
                        .iter()
                        .any(|&(_, _, c)| te > te * gpus / r_e * f64::from(c))
            }));
        }
        assert!(
            overflowed > 5,
            "the overflow sum is exercised ({overflowed} cases)"
        );
    }

    /// Malformed runs are an error naming the layer, not a panic.
    #[test]
    fn malformed_runs_are_an_error() {
        let hw = hardware("h200-400g").unwrap();
        let mut model = model("deepseek-v3").unwrap();
        model.experts = 2;
        model.moe_layers = 1;
        let g = hw.gpus_per_node;
        let slots = [0u32, 1];
        let grid: Vec<&[u32]> = vec![&slots[..]; 40];
        let gpu_of = vec![0u32, 1];
        let good = LayerRuns::from_grid(grid.into_iter(), &gpu_of, 2);
        let loads = vec![vec![3u64, 5]];
        step_cost_runs(&hw, &model, 40, std::slice::from_ref(&good), &loads).unwrap();
        let mut gap = good.clone();
        gap.runs[0].0 = 1;
        let mut far = good.clone();
        far.items[0].1 = g as u32;
        let wrong_nodes = step_cost_runs(&hw, &model, 41, std::slice::from_ref(&good), &loads);
        for (bad, nodes) in [(gap, 40), (far, 40)] {
            let e = step_cost_runs(&hw, &model, nodes, &[bad], &loads).unwrap_err();
            assert!(e.to_string().starts_with("MoE layer 0"), "{e}");
        }
        assert!(
            wrong_nodes
                .unwrap_err()
                .to_string()
                .contains("runs cover 40 nodes")
        );
    }
}
