//! Cluster and model specifications, and per-layer expert loads aggregated from routing history.

use crate::error::PlanError;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The cluster the plan is made for. The failure unit is the **node** (paper §4.1): all GPUs
/// of a node fail together, so plans are made per node and a node's `slots_per_node` replica
/// slots are spread evenly over its GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterSpec {
    pub nodes: usize,
    /// Expert-replica slots per node (the paper's `c`), limited by GPU memory.
    pub slots_per_node: usize,
    pub gpus_per_node: usize,
    /// Optional failure domain (e.g. rack) of each node; `None` = every node its own domain.
    pub domain_of_node: Option<Vec<usize>>,
}

impl ClusterSpec {
    /// One GPU per node, no failure domains.
    pub fn new(nodes: usize, slots_per_node: usize) -> Self {
        Self {
            nodes,
            slots_per_node,
            gpus_per_node: 1,
            domain_of_node: None,
        }
    }

    pub fn with_gpus_per_node(mut self, gpus_per_node: usize) -> Self {
        self.gpus_per_node = gpus_per_node;
        self
    }

    pub fn with_domains(mut self, domain_of_node: Vec<usize>) -> Self {
        self.domain_of_node = Some(domain_of_node);
        self
    }

    /// `N·c`, the number of replica slots in the cluster (per layer).
    pub fn total_slots(&self) -> usize {
        self.nodes * self.slots_per_node
    }

    /// Checks the shape; slots must split evenly over the GPUs of a node.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.nodes == 0 {
            return Err(PlanError::NoNodes(self.nodes));
        }
        if self.slots_per_node == 0 {
            return Err(PlanError::NoSlots(self.slots_per_node));
        }
        if let Some(d) = &self.domain_of_node
            && d.len() != self.nodes
        {
            return Err(PlanError::DomainCount {
                nodes: self.nodes,
                got: d.len(),
            });
        }
        Ok(())
    }

    /// GPU (0-based, within its node) that holds slot `slot`: slots are split into
    /// `gpus_per_node` contiguous runs. With `c` not divisible by the GPU count the first GPUs
    /// get one slot more.
    pub fn gpu_of_slot(&self, slot: usize) -> usize {
        let g = self.gpus_per_node.max(1);
        let base = self.slots_per_node / g;
        let extra = self.slots_per_node % g;
        // The first `extra` GPUs hold base+1 slots each.
        let big = extra * (base + 1);
        if slot < big {
            slot / (base + 1)
        } else {
            extra + (slot - big) / base.max(1)
        }
    }

    /// Failure domain of every node (node index when none were given), renumbered densely
    /// 0..D in order of first appearance, and D.
    pub fn domains(&self) -> (Vec<usize>, usize) {
        match &self.domain_of_node {
            None => ((0..self.nodes).collect(), self.nodes),
            Some(d) => {
                let mut ids: Vec<usize> = Vec::new();
                let dense = d
                    .iter()
                    .map(|x| match ids.iter().position(|y| y == x) {
                        Some(i) => i,
                        None => {
                            ids.push(*x);
                            ids.len() - 1
                        }
                    })
                    .collect();
                (dense, ids.len())
            }
        }
    }
}

/// The MoE model as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Experts per MoE layer (`E`).
    pub experts: usize,
    /// MoE layers (`L`).
    pub layers: usize,
    /// Fault-tolerance threshold: minimum replicas per expert (`f`, 2 in the paper).
    pub f: usize,
}

impl ModelSpec {
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.experts == 0 {
            return Err(PlanError::NoExperts(self.experts));
        }
        if self.layers == 0 {
            return Err(PlanError::NoLayers(self.layers));
        }
        if self.f == 0 {
            return Err(PlanError::ZeroF(self.f));
        }
        Ok(())
    }
}

/// How routing history is turned into the loads `t_e` that drive allocation. The paper does not
/// specify a window or smoothing (§4.1), so both common choices are offered.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Aggregation {
    /// Sum of the last `window_steps` steps (a sliding window).
    Sum { window_steps: usize },
    /// Exponential moving average `m ← α·x + (1−α)·m`, seeded with the first step.
    Ema { alpha: f64 },
}

/// Per-layer expert loads aggregated over a routing-history window. Pure state machine: the
/// caller pushes one step's token counts per layer and reads the current loads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadHistory {
    aggregation: Aggregation,
    layers: usize,
    experts: usize,
    /// The window's steps as runs of equal steps: `(counts, steps)`, counts `layers × experts`
    /// flat (layer-major). A training run routes alike for many steps in a row (the
    /// simulator's loads change per epoch): a step equal to the one leaving the window leaves
    /// the sums as they are, and a run that leaves lends its buffer to the next one.
    window: VecDeque<(Vec<u64>, usize)>,
    sum: Vec<Vec<u64>>,
    ema: Vec<Vec<f64>>,
    steps_seen: u64,
}

impl LoadHistory {
    pub fn new(aggregation: Aggregation, layers: usize, experts: usize) -> Result<Self, PlanError> {
        match aggregation {
            Aggregation::Sum { window_steps: 0 } => return Err(PlanError::ZeroWindow),
            Aggregation::Ema { alpha } if !(alpha > 0.0 && alpha <= 1.0) => {
                return Err(PlanError::BadAlpha(alpha));
            }
            _ => {}
        }
        Ok(Self {
            aggregation,
            layers,
            experts,
            window: VecDeque::new(),
            sum: vec![vec![0; experts]; layers],
            ema: vec![vec![0.0; experts]; layers],
            steps_seen: 0,
        })
    }

    pub fn steps_seen(&self) -> u64 {
        self.steps_seen
    }

    /// Adds one training step's routed-token counts, `counts[layer][expert]`.
    pub fn push(&mut self, counts: &[Vec<u64>]) -> Result<(), PlanError> {
        if counts.len() != self.layers {
            return Err(PlanError::LayerCount {
                expected: self.layers,
                got: counts.len(),
            });
        }
        if let Some(bad) = counts.iter().find(|c| c.len() != self.experts) {
            return Err(PlanError::LoadCount {
                expected: self.experts,
                got: bad.len(),
            });
        }
        match self.aggregation {
            Aggregation::Sum { window_steps } => {
                let equal = |flat: &[u64]| {
                    flat.chunks_exact(self.experts.max(1))
                        .zip(counts)
                        .all(|(a, b)| a == b.as_slice())
                };
                // Steps held: a sum over the runs (few: equal steps share one).
                let full = self.window.iter().map(|r| r.1).sum::<usize>() >= window_steps;
                // A full window whose oldest step equals this one keeps its sums.
                let same_sums = full && self.window.front().is_some_and(|(c, _)| equal(c));
                if !same_sums {
                    for (s, c) in self.sum.iter_mut().zip(counts) {
                        for (a, b) in s.iter_mut().zip(c) {
                            *a += b;
                        }
                    }
                }
                let mut spare = None;
                if full {
                    let (oldest, steps) = self.window.front_mut().expect("window is non-empty");
                    if !same_sums {
                        for (s, c) in self
                            .sum
                            .iter_mut()
                            .zip(oldest.chunks_exact(self.experts.max(1)))
                        {
                            for (a, b) in s.iter_mut().zip(c) {
                                *a -= b;
                            }
                        }
                    }
                    *steps -= 1;
                    if *steps == 0 {
                        spare = self.window.pop_front().map(|(c, _)| c);
                    }
                }
                match self.window.back_mut() {
                    Some((c, steps)) if equal(c) => *steps += 1,
                    _ => {
                        let mut step =
                            spare.unwrap_or_else(|| Vec::with_capacity(self.layers * self.experts));
                        step.clear();
                        counts.iter().for_each(|c| step.extend_from_slice(c));
                        self.window.push_back((step, 1));
                    }
                }
            }
            Aggregation::Ema { alpha } => {
                let first = self.steps_seen == 0;
                for (m, c) in self.ema.iter_mut().zip(counts) {
                    for (a, &b) in m.iter_mut().zip(c) {
                        *a = if first {
                            b as f64
                        } else {
                            alpha * b as f64 + (1.0 - alpha) * *a
                        };
                    }
                }
            }
        }
        self.steps_seen += 1;
        Ok(())
    }

    /// Current loads per layer. EMA values are rounded to whole tokens (loads are token counts;
    /// the rounding error is far below one replica's share).
    pub fn loads(&self) -> Vec<Vec<u64>> {
        match self.aggregation {
            Aggregation::Sum { .. } => self.sum.clone(),
            Aggregation::Ema { .. } => self
                .ema
                .iter()
                .map(|l| l.iter().map(|x| x.round() as u64).collect())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_window_slides() {
        let mut h = LoadHistory::new(Aggregation::Sum { window_steps: 2 }, 1, 2).unwrap();
        h.push(&[vec![1, 10]]).unwrap();
        h.push(&[vec![2, 20]]).unwrap();
        assert_eq!(h.loads(), vec![vec![3, 30]]);
        h.push(&[vec![4, 40]]).unwrap();
        assert_eq!(h.loads(), vec![vec![6, 60]]);
    }

    /// Runs of equal steps and reused buffers: the sums stay those of the last `window_steps`
    /// steps, recomputed naively (seeded pushes, many of them repeats, windows 1 to 5), and a
    /// serialised history reads back equal and slides on the same.
    #[test]
    fn sum_window_matches_a_naive_sum_while_buffers_are_reused() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for window_steps in 1..=5usize {
            let (layers, experts) = (3, 4);
            let mut h =
                LoadHistory::new(Aggregation::Sum { window_steps }, layers, experts).unwrap();
            let mut pushed: Vec<Vec<Vec<u64>>> = Vec::new();
            // Runs of equal steps (the fast path) as well as fresh ones.
            let pool: Vec<Vec<Vec<u64>>> = (0..3)
                .map(|_| {
                    (0..layers)
                        .map(|_| (0..experts).map(|_| next(1000)).collect())
                        .collect()
                })
                .collect();
            for step in 0..40 {
                let counts: Vec<Vec<u64>> = match next(4) {
                    0 => (0..layers)
                        .map(|_| (0..experts).map(|_| next(1000)).collect())
                        .collect(),
                    _ => pool[next(2) as usize + usize::from(step % 7 == 0)].clone(),
                };
                h.push(&counts).unwrap();
                pushed.push(counts);
                let from = pushed.len().saturating_sub(window_steps);
                let naive: Vec<Vec<u64>> = (0..layers)
                    .map(|l| {
                        (0..experts)
                            .map(|e| pushed[from..].iter().map(|c| c[l][e]).sum())
                            .collect()
                    })
                    .collect();
                assert_eq!(h.loads(), naive, "window {window_steps}, step {step}");
                if step == 20 {
                    let json = serde_json::to_string(&h).unwrap();
                    let back: LoadHistory = serde_json::from_str(&json).unwrap();
                    assert_eq!(back, h);
                    h = back;
                }
            }
        }
    }

    #[test]
    fn ema_smooths() {
        let mut h = LoadHistory::new(Aggregation::Ema { alpha: 0.5 }, 1, 2).unwrap();
        h.push(&[vec![100, 0]]).unwrap();
        h.push(&[vec![0, 100]]).unwrap();
        assert_eq!(h.loads(), vec![vec![50, 50]]);
        h.push(&[vec![0, 100]]).unwrap();
        assert_eq!(h.loads(), vec![vec![25, 75]]);
    }

    #[test]
    fn bad_shapes_and_params_are_errors() {
        assert_eq!(
            LoadHistory::new(Aggregation::Ema { alpha: 0.0 }, 1, 2).unwrap_err(),
            PlanError::BadAlpha(0.0)
        );
        assert!(LoadHistory::new(Aggregation::Sum { window_steps: 0 }, 1, 2).is_err());
        let mut h = LoadHistory::new(Aggregation::Sum { window_steps: 1 }, 2, 2).unwrap();
        assert!(h.push(&[vec![1, 2]]).is_err());
        assert!(h.push(&[vec![1, 2], vec![1]]).is_err());
    }

    #[test]
    fn gpu_of_slot_splits_evenly() {
        let c = ClusterSpec::new(1, 32).with_gpus_per_node(8);
        assert_eq!(c.gpu_of_slot(0), 0);
        assert_eq!(c.gpu_of_slot(3), 0);
        assert_eq!(c.gpu_of_slot(4), 1);
        assert_eq!(c.gpu_of_slot(31), 7);
        let c = ClusterSpec::new(1, 5).with_gpus_per_node(2);
        let gpus: Vec<usize> = (0..5).map(|s| c.gpu_of_slot(s)).collect();
        assert_eq!(gpus, vec![0, 0, 0, 1, 1]);
    }
}
