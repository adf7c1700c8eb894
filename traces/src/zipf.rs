//! Synthetic expert loads with Zipf popularity that may drift over training: the stand-in for a
//! gate trace when none is given (expert popularity in MoE training is heavily skewed and
//! differs between layers; Lazarus, Wu et al., arXiv 2407.04656, Fig. 2).
//!
//! ```
//! use lazarus_traces::zipf::ZipfLoads;
//! let z = ZipfLoads { drift_every_steps: 100, ..ZipfLoads::new(1.2, 16, 12, 7) };
//! z.validate().unwrap();
//! assert_eq!(z.loads(250), z.loads(200)); // same drift epoch
//! assert_eq!(z.next_change(250), Some(300));
//! ```
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

/// Parameters [`ZipfLoads::loads`] cannot work with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ZipfError {
    /// The exponent is negative, infinite or NaN.
    #[error("Zipf exponent must be finite and >= 0, got {0}")]
    Exponent(f64),
    /// No experts or no layers.
    #[error("Zipf workload needs experts and layers > 0 (got {experts}, {layers})")]
    Empty {
        /// Experts per layer.
        experts: usize,
        /// MoE layers.
        layers: usize,
    },
}

/// How each layer's base popularity ranking is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerRanking {
    /// Every layer a permutation seeded by SplitMix64-mixed `(seed, layer)`, so nearby seeds
    /// and layers give unrelated rankings (`lzsim replay`, `lzsim relayout`).
    #[default]
    Mixed,
    /// Layer 0 ranks experts by id (expert 0 hottest); layer `l > 0` uses a permutation
    /// seeded by `seed + l` (`lzsim plan` / `lzsim recovery`, whose printed plans depend on it).
    FirstById,
}

/// Zipf loads `[layer][expert]` per training step: the expert at popularity rank `i`
/// (0 = hottest) gets `round(hottest_load / (i+1)^exponent)`.
///
/// With drift, step `s` belongs to epoch `k = s / drift_every_steps` and the ranking of epoch
/// `k` is the layer's base ranking with `⌈E/8⌉` random adjacent swaps applied (positions drawn
/// from an RNG seeded by `(seed, layer, k)`). So the ranking changes at every epoch boundary
/// and stays a perturbation of the base ranking — it does not random-walk away, matching the
/// SmartMoE trace, where the hottest expert rarely changes after warm-up — and any step's
/// loads cost `O(L·E)` without replaying earlier epochs. Deterministic in `(seed, step)`.
#[derive(Debug, Clone, PartialEq)]
pub struct ZipfLoads {
    /// Zipf exponent `s`: load ∝ `1/(rank+1)^s`.
    pub exponent: f64,
    /// Experts per layer.
    pub experts: usize,
    /// MoE layers.
    pub layers: usize,
    /// Seed of the rankings.
    pub seed: u64,
    /// The ranking changes every this many steps; 0 = never.
    pub drift_every_steps: u64,
    /// Load of the hottest expert; only ratios matter, so it is large enough that rounding
    /// to integers keeps the shares even for steep exponents.
    pub hottest_load: f64,
    /// How the base rankings are drawn.
    pub ranking: LayerRanking,
}

impl ZipfLoads {
    /// Static (no drift) loads on the scale `1e9`, [`LayerRanking::Mixed`].
    pub fn new(exponent: f64, experts: usize, layers: usize, seed: u64) -> Self {
        ZipfLoads {
            exponent,
            experts,
            layers,
            seed,
            drift_every_steps: 0,
            hottest_load: 1e9,
            ranking: LayerRanking::Mixed,
        }
    }

    /// Rejects parameters that would make [`loads`](Self::loads) meaningless.
    pub fn validate(&self) -> Result<(), ZipfError> {
        if !(self.exponent.is_finite() && self.exponent >= 0.0) {
            return Err(ZipfError::Exponent(self.exponent));
        }
        if self.experts == 0 || self.layers == 0 {
            return Err(ZipfError::Empty {
                experts: self.experts,
                layers: self.layers,
            });
        }
        Ok(())
    }

    /// Loads `[layer][expert]` at training step `step` (0-based).
    pub fn loads(&self, step: u64) -> Vec<Vec<u64>> {
        let base: Vec<u64> = (0..self.experts)
            .map(|i| (self.hottest_load / ((i + 1) as f64).powf(self.exponent)).round() as u64)
            .collect();
        let epoch = step.checked_div(self.drift_every_steps);
        (0..self.layers)
            .map(|layer| {
                let mut row = vec![0; self.experts];
                for (rank, &e) in self.ranking_of(layer, epoch).iter().enumerate() {
                    row[e] = base[rank];
                }
                row
            })
            .collect()
    }

    /// The first step after `step` at which the loads may change, or `None` if they never
    /// change again.
    pub fn next_change(&self, step: u64) -> Option<u64> {
        let d = self.drift_every_steps;
        // `None` past the last epoch that starts below 2^64 (the product overflowed and
        // wrapped to an early step, which sent callers walking back to it).
        (d > 0)
            .then(|| (step / d).checked_add(1)?.checked_mul(d))
            .flatten()
    }

    /// Experts in popularity order (index 0 = hottest) for `layer` in drift epoch `epoch`
    /// (`None`: no drift, the base ranking).
    fn ranking_of(&self, layer: usize, epoch: Option<u64>) -> Vec<usize> {
        let mut ranking: Vec<usize> = (0..self.experts).collect();
        let layer_seed = match self.ranking {
            LayerRanking::Mixed => mix(self.seed ^ mix(layer as u64)),
            LayerRanking::FirstById => self.seed.wrapping_add(layer as u64),
        };
        if !(self.ranking == LayerRanking::FirstById && layer == 0) {
            ranking.shuffle(&mut Xoshiro256PlusPlus::seed_from_u64(layer_seed));
        }
        if let Some(k) = epoch
            && self.experts > 1
        {
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(mix(layer_seed ^ mix(k ^ 0x5eed)));
            for _ in 0..self.experts.div_ceil(8) {
                let i = rng.random_range(0..self.experts - 1);
                ranking.swap(i, i + 1);
            }
        }
        ranking
    }
}

/// SplitMix64 finaliser: mixes seeds so nearby inputs give unrelated RNG streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_shaped() {
        let w = ZipfLoads {
            drift_every_steps: 100,
            ..ZipfLoads::new(1.2, 16, 12, 7)
        };
        w.validate().unwrap();
        let a = w.loads(250);
        assert_eq!(a.len(), 12);
        assert!(a.iter().all(|r| r.len() == 16));
        assert_eq!(a, w.loads(250));
        assert_eq!(a, w.loads(200)); // same epoch
        // Every layer holds the Zipf values, permuted.
        let mut want: Vec<u64> = (0..16)
            .map(|i| (1e9 / ((i + 1) as f64).powf(1.2)).round() as u64)
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
        let other = ZipfLoads {
            seed: 8,
            ..w.clone()
        };
        assert_ne!(other.loads(250), a);
        assert_eq!(w.next_change(250), Some(300));
        assert_eq!(w.next_change(299), Some(300));
        assert_eq!(w.next_change(300), Some(400));
    }

    /// The change after a step near `u64::MAX` is later than the step or never: the product
    /// wrapped to an early step (`lzsim reconfig --step 18446744073709551515` spun).
    #[test]
    fn the_next_change_never_wraps() {
        for d in [1u64, 7, 100, 500, 1 << 40] {
            let w = ZipfLoads {
                drift_every_steps: d,
                ..ZipfLoads::new(1.0, 4, 2, 1)
            };
            for step in [u64::MAX, u64::MAX - 1, u64::MAX - 100, u64::MAX - d] {
                if let Some(c) = w.next_change(step) {
                    assert!(c > step, "drift {d}: change {c} after step {step}");
                }
            }
        }
    }

    #[test]
    fn without_drift_is_static() {
        let w = ZipfLoads::new(0.0, 4, 2, 1);
        assert_eq!(w.loads(0), vec![vec![1_000_000_000; 4]; 2]);
        assert_eq!(w.loads(0), w.loads(1_000_000));
        assert_eq!(w.next_change(5), None);
        let bad = ZipfLoads::new(f64::NAN, 4, 2, 1);
        assert!(matches!(bad.validate(), Err(ZipfError::Exponent(_))));
        let empty = ZipfLoads::new(1.0, 0, 2, 1);
        assert!(matches!(empty.validate(), Err(ZipfError::Empty { .. })));
    }

    #[test]
    fn first_by_id_ranks_layer_zero_by_id() {
        let z = ZipfLoads {
            hottest_load: 1e6,
            ranking: LayerRanking::FirstById,
            ..ZipfLoads::new(1.0, 4, 2, 7)
        };
        let l = z.loads(0);
        assert_eq!(l[0], vec![1_000_000, 500_000, 333_333, 250_000]);
        let mut sorted = l[1].clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(sorted, l[0]);
    }

    #[test]
    fn drift_stays_near_the_base_ranking() {
        // With E = 8 one adjacent swap per epoch: an epoch differs from the base ranking in at
        // most two experts.
        let z = ZipfLoads::new(1.0, 8, 2, 3);
        for k in 0..50 {
            let base = z.ranking_of(1, None);
            let r = z.ranking_of(1, Some(k));
            assert!(base.iter().zip(&r).filter(|(a, b)| a != b).count() <= 2);
        }
    }
}
