//! Recovery probability when what fails is a **GPU inside a node**, a whole node or a whole
//! rack, in any mix.
//!
//! At frontier scale most interruptions are one GPU (Llama 3's 54-day run on 16,384 H100s: 419
//! unexpected interruptions, of which faulty GPUs 148 and GPU HBM3 72 — about half — and more
//! GPU SRAM, system-processor and thermal faults). A node of `G` GPUs that loses one keeps the
//! other `G − 1` and the replicas in their slots: only the slots of the failed GPU are gone.
//! The plan splits a node's `c` slots over its GPUs in contiguous runs
//! ([`ClusterSpec::gpu_of_slot`]: with `c = 32`, `G = 8`, GPU `g` holds slots `4g..4g + 4`).
//!
//! The failure unit here is the GPU, numbered `node · G + gpu`. An expert is lost exactly when
//! every GPU holding one of its replicas has failed; a node failure fails its `G` GPUs, a rack
//! failure every GPU of its nodes. So the reduction to *critical sets* of
//! [`crate::recovery`] carries over with GPU sets in place of node sets
//! ([`gpu_critical_sets`]), and so do its exact listing and its Monte Carlo sampler.
//!
//! A mixed failure ([`MixedFailures`]) draws `nodes` distinct nodes, `racks` distinct racks and
//! `gpus` distinct GPUs, each uniformly and independently of the others (a GPU may fall on a
//! node that also failed: the union counts once). Pure GPU failures have an exact answer when
//! the listing is affordable ([`gpu_recovery`]); mixes are sampled
//! ([`MixedFailureModel::monte_carlo`]), seeded and independent of the thread count, like
//! [`crate::recovery::FailureModel::monte_carlo`].

use crate::error::PlanError;
use crate::place::LayerPlacement;
use crate::recovery::{FailureModel, RecoveryEstimate, from_small_sets_auto, wilson_interval};
use crate::spec::ClusterSpec;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// What fails at once; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MixedFailures {
    /// Distinct GPUs, uniform over all `N · G`.
    pub gpus: usize,
    /// Distinct whole nodes, uniform over the `N`.
    pub nodes: usize,
    /// Distinct racks (all their nodes), uniform over the racks.
    pub racks: usize,
}

fn layer_shape(layers: &[LayerPlacement]) -> Result<(usize, usize), PlanError> {
    let first = layers.first().ok_or(PlanError::NoLayers(0))?;
    for (l, layer) in layers.iter().enumerate() {
        if layer.nodes() != first.nodes() {
            return Err(PlanError::LayerNodeMismatch {
                layer: l,
                expected: first.nodes(),
                got: layer.nodes(),
            });
        }
    }
    Ok((first.nodes(), first.slots_per_node()))
}

/// GPU of every slot of a node of `slots` slots split over `gpus_per_node` GPUs.
fn slot_gpus(nodes: usize, slots: usize, gpus_per_node: usize) -> Vec<u32> {
    let spec = ClusterSpec::new(nodes, slots).with_gpus_per_node(gpus_per_node);
    (0..slots).map(|s| spec.gpu_of_slot(s) as u32).collect()
}

/// The GPU sets (`node · G + gpu`, ascending) holding each expert of each layer that have at
/// most `max_size` GPUs, deduplicated and sorted: the critical sets of [`crate::recovery`] with
/// the GPU as the failure unit. `O(total slots)`.
///
/// Errors: no layers, layers on different node counts, `gpus_per_node` 0 or more than the
/// slots of a node (a GPU would hold nothing).
pub fn gpu_critical_sets(
    layers: &[LayerPlacement],
    gpus_per_node: usize,
    max_size: usize,
) -> Result<Vec<Vec<u32>>, PlanError> {
    let (nodes, slots) = layer_shape(layers)?;
    check_gpus(gpus_per_node, slots)?;
    let gpu_of = slot_gpus(nodes, slots, gpus_per_node);
    let g = gpus_per_node as u32;
    let mut out: Vec<Vec<u32>> = Vec::new();
    for layer in layers {
        let mut sets: Vec<Vec<u32>> = vec![Vec::new(); layer.experts()];
        for (n, row) in layer.grid().iter().enumerate() {
            for (s, &e) in row.iter().enumerate() {
                let unit = n as u32 * g + gpu_of[s];
                let set = &mut sets[e as usize];
                // Slots of one node are visited in order, so a GPU repeats only at the end.
                if set.len() <= max_size && set.last() != Some(&unit) {
                    set.push(unit);
                }
            }
        }
        out.extend(
            sets.into_iter()
                .filter(|s| !s.is_empty() && s.len() <= max_size),
        );
    }
    for s in &mut out {
        s.sort_unstable();
        s.dedup();
    }
    out.retain(|s| s.len() <= max_size);
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn check_gpus(gpus_per_node: usize, slots: usize) -> Result<(), PlanError> {
    if gpus_per_node == 0 || gpus_per_node > slots {
        return Err(PlanError::BadGpusPerNode {
            gpus: gpus_per_node,
            slots,
        });
    }
    Ok(())
}

/// Recovery probability under `failed` uniformly random **GPU** failures among the `N · G`
/// GPUs: exact (interval closed form or listing of the failure sets that contain a small
/// critical set) when affordable, else seeded Monte Carlo with
/// [`crate::recovery::AUTO_TRIALS`] trials, as [`crate::recovery::recovery_auto`] decides for
/// nodes. With `gpus_per_node = 1` it is the node-failure probability.
pub fn gpu_recovery(
    layers: &[LayerPlacement],
    gpus_per_node: usize,
    failed: usize,
    seed: u64,
) -> Result<RecoveryEstimate, PlanError> {
    let (nodes, _) = layer_shape(layers)?;
    let units = nodes * gpus_per_node;
    if failed > units {
        return Err(PlanError::TooManyFailures {
            failed,
            units,
            unit: "GPUs",
        });
    }
    let sets = gpu_critical_sets(layers, gpus_per_node, failed)?;
    from_small_sets_auto(units, failed, sets, seed)
}

/// Monte Carlo trials per rayon chunk (as in [`crate::recovery`]).
const CHUNK: u64 = 1 << 14;

/// A plan reduced to what one [`MixedFailures`] draw can break, on GPU units. Build once,
/// sample many times.
#[derive(Debug, Clone)]
pub struct MixedFailureModel {
    nodes: usize,
    gpus_per_node: usize,
    failures: MixedFailures,
    /// Nodes of each rack (empty without racks).
    racks: Vec<Vec<u32>>,
    model: FailureModel,
}

impl MixedFailureModel {
    /// `rack_of_node`: each node's rack id (any numbers; `None`: no racks, then
    /// `failures.racks` must be 0). Errors name the offending count.
    pub fn new(
        layers: &[LayerPlacement],
        gpus_per_node: usize,
        rack_of_node: Option<&[usize]>,
        failures: MixedFailures,
    ) -> Result<Self, PlanError> {
        let (nodes, slots) = layer_shape(layers)?;
        check_gpus(gpus_per_node, slots)?;
        let racks: Vec<Vec<u32>> = match rack_of_node {
            None => Vec::new(),
            Some(r) => {
                if r.len() != nodes {
                    return Err(PlanError::DomainCount {
                        nodes,
                        got: r.len(),
                    });
                }
                let (dense, count) = ClusterSpec::new(nodes, slots)
                    .with_domains(r.to_vec())
                    .domains();
                let mut racks = vec![Vec::new(); count];
                for (n, &d) in dense.iter().enumerate() {
                    racks[d].push(n as u32);
                }
                racks
            }
        };
        let too_many = |failed, units, unit| {
            if failed > units {
                Err(PlanError::TooManyFailures {
                    failed,
                    units,
                    unit,
                })
            } else {
                Ok(())
            }
        };
        too_many(failures.gpus, nodes * gpus_per_node, "GPUs")?;
        too_many(failures.nodes, nodes, "nodes")?;
        too_many(failures.racks, racks.len(), "racks")?;
        let largest_racks: usize = {
            let mut sizes: Vec<usize> = racks.iter().map(Vec::len).collect();
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            sizes.iter().take(failures.racks).sum()
        };
        let units = nodes * gpus_per_node;
        let max_dead =
            (failures.gpus + (failures.nodes + largest_racks) * gpus_per_node).min(units);
        let sets = gpu_critical_sets(layers, gpus_per_node, max_dead)?;
        Ok(Self {
            nodes,
            gpus_per_node,
            failures,
            racks,
            model: FailureModel::from_sets(units, max_dead, sets),
        })
    }

    /// The small GPU sets kept (sets no draw can wipe out are dropped).
    pub fn sets(&self) -> &[Vec<u32>] {
        self.model.sets()
    }

    /// Does the plan survive the failure of these GPU units (`node · G + gpu`; any number,
    /// duplicates ignored)?
    pub fn survives(&self, dead_gpus: &[u32]) -> bool {
        self.model.survives(dead_gpus)
    }

    /// The dead GPU units of one draw, sorted and distinct.
    fn draw(&self, rng: &mut Xoshiro256PlusPlus, scratch: &mut Vec<u32>, dead: &mut Vec<u32>) {
        let g = self.gpus_per_node as u32;
        dead.clear();
        floyd(rng, self.nodes as u32, self.failures.nodes, scratch);
        for &n in scratch.iter() {
            dead.extend(n * g..n * g + g);
        }
        floyd(rng, self.racks.len() as u32, self.failures.racks, scratch);
        for &r in scratch.iter() {
            for &n in &self.racks[r as usize] {
                dead.extend(n * g..n * g + g);
            }
        }
        floyd(rng, self.nodes as u32 * g, self.failures.gpus, scratch);
        dead.extend_from_slice(scratch);
        dead.sort_unstable();
        dead.dedup();
    }

    /// Seeded Monte Carlo estimate with a 95 % Wilson interval. Chunks of 16,384 trials run on
    /// rayon's pool, chunk `i` seeded from `(seed, i)`: the same seed gives the same estimate
    /// whatever the thread count.
    pub fn monte_carlo(&self, trials: u64, seed: u64) -> Result<RecoveryEstimate, PlanError> {
        use rayon::prelude::*;
        if trials == 0 {
            return Err(PlanError::ZeroTrials);
        }
        let chunks = trials.div_ceil(CHUNK);
        let ok: u64 = (0..chunks)
            .into_par_iter()
            .map(|i| {
                let n = CHUNK.min(trials - i * CHUNK);
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(chunk_seed(seed, i));
                let (mut scratch, mut dead) = (Vec::new(), Vec::new());
                let mut hits = vec![0u32; self.model.sets().len()];
                let mut ok = 0u64;
                for _ in 0..n {
                    self.draw(&mut rng, &mut scratch, &mut dead);
                    if self.model.survives_distinct(&dead, &mut hits) {
                        ok += 1;
                    }
                }
                ok
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
}

/// A uniform `k`-subset of `0..n` (Floyd's algorithm) into `out`.
fn floyd(rng: &mut Xoshiro256PlusPlus, n: u32, k: usize, out: &mut Vec<u32>) {
    out.clear();
    for j in (n - k as u32)..n {
        let t = rng.random_range(0..=j);
        if out.contains(&t) {
            out.push(j);
        } else {
            out.push(t);
        }
    }
}

/// SplitMix64 finalizer of `seed + (i + 1)·golden`, salted so the streams differ from the
/// node sampler's.
fn chunk_seed(seed: u64, i: u64) -> u64 {
    let mut z = (seed ^ 0x6a09_e667_f3bc_c909)
        .wrapping_add(i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(grid: Vec<Vec<u32>>, experts: usize) -> LayerPlacement {
        LayerPlacement::from_grid(grid, experts, None).unwrap()
    }

    #[test]
    fn gpu_sets_follow_the_slot_split() {
        // 2 nodes x 4 slots, 2 GPUs per node: GPU 0 = slots 0-1, GPU 1 = slots 2-3.
        let l = layer(vec![vec![0, 1, 2, 3], vec![0, 0, 1, 2]], 4);
        let sets = gpu_critical_sets(&[l], 2, 8).unwrap();
        // expert 0: GPUs 0 and 2; 1: 0 and 3; 2: 1 and 3; 3: 1.
        assert_eq!(sets, vec![vec![0, 2], vec![0, 3], vec![1], vec![1, 3]]);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let l = layer(vec![vec![0, 1], vec![1, 0]], 2);
        assert!(matches!(
            gpu_critical_sets(std::slice::from_ref(&l), 0, 2),
            Err(PlanError::BadGpusPerNode { .. })
        ));
        assert!(matches!(
            gpu_critical_sets(std::slice::from_ref(&l), 3, 2),
            Err(PlanError::BadGpusPerNode { .. })
        ));
        assert!(matches!(
            gpu_recovery(std::slice::from_ref(&l), 2, 5, 0),
            Err(PlanError::TooManyFailures { .. })
        ));
        let f = MixedFailures {
            racks: 1,
            ..Default::default()
        };
        assert!(matches!(
            MixedFailureModel::new(std::slice::from_ref(&l), 2, None, f),
            Err(PlanError::TooManyFailures { .. })
        ));
        assert!(matches!(
            MixedFailureModel::new(std::slice::from_ref(&l), 2, Some(&[0]), f),
            Err(PlanError::DomainCount { .. })
        ));
        assert!(matches!(
            MixedFailureModel::new(&[l], 2, None, MixedFailures::default())
                .unwrap()
                .monte_carlo(0, 0),
            Err(PlanError::ZeroTrials)
        ));
    }
}
