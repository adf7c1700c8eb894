//! # The global sample order and the split of a global batch (issue 31)
//!
//! A job with a constant global batch trains, at every step, on the next `B` sequences of one
//! seeded order that does not depend on who is alive. Three pure rules make that order and
//! hand it out:
//!
//! 1. **Which sequence is at position `p`** ([`SampleOrder::locate`]). Every source (one dataset
//!    of a blend) has `n` sequences. A source's draws are taken in epochs; epoch `e` visits its
//!    `n` sequences once each, in the order of a seeded permutation of `0..n` (a Feistel network
//!    over the next power of four with cycle walking: [`permute`]). A blend cuts the positions
//!    into blocks of [`BLEND_BLOCK`]; each block gives source `d` a fixed quota of its slots
//!    (the weights apportioned by largest remainder, [`quotas`]) and the slots are shuffled per
//!    block, so each source is drawn at its weight in every block and its draws are consecutive
//!    from block to block. The result is random access: `locate(p)` costs a few dozen integer
//!    operations and no memory, so any worker can find any position without state.
//! 2. **The data cursor** is the next position to train. A step consumes `B` positions, so the
//!    cursor is part of the job's state; it travels with every reconfiguration and every
//!    checkpoint, and a checkpoint restore rewinds it with the weights.
//! 3. **Who trains what** ([`GlobalBatch::share`]). The `B` sequences of a step are cut into
//!    `K = B / M` micro-batches of `M` consecutive positions (fixed slots: their composition
//!    does not depend on the membership, so the per-micro-batch losses, load-balancing loss
//!    included, are the same whoever computes them). Member `r` of `n` trains a contiguous run
//!    of them, the first `K mod n` members one more. The update is the mean over the `K`
//!    micro-batches, so a run with failures computes the fault-free run's step up to the order
//!    of floating-point sums.

use serde::{Deserialize, Serialize};
use std::ops::Range;
use thiserror::Error;

/// Positions per blend block: the granularity at which every source gets its share.
pub const BLEND_BLOCK: u64 = 4096;

/// Why a data plan is impossible.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum DataPlanError {
    #[error("the global batch must be at least 1 sequence")]
    ZeroBatch,
    #[error("the micro-batch must be at least 1 sequence")]
    ZeroMicroBatch,
    #[error("the global batch ({global}) is not a multiple of the micro-batch ({micro})")]
    NotMultiple { global: u64, micro: u64 },
    #[error("a data blend needs at least one source")]
    NoSource,
    #[error("source {source_index} has no sequence")]
    EmptySource { source_index: usize },
    #[error("the weight of source {source_index} is {weight} (must be finite and > 0)")]
    BadWeight { source_index: usize, weight: f64 },
    #[error(
        "the weight of source {source_index} is too small: it gets no slot of a block of \
         {BLEND_BLOCK} (raise it above 1/{BLEND_BLOCK} of the total)"
    )]
    WeightTooSmall { source_index: usize },
}

/// `B` sequences per optimizer step, trained in micro-batches of `M`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalBatch {
    /// Sequences per step (`B`).
    pub sequences: u64,
    /// Sequences per micro-batch (`M`); divides `B`.
    pub micro: u64,
}

impl GlobalBatch {
    pub fn new(sequences: u64, micro: u64) -> Result<Self, DataPlanError> {
        let b = Self { sequences, micro };
        b.validate()?;
        Ok(b)
    }

    pub fn validate(&self) -> Result<(), DataPlanError> {
        if self.sequences == 0 {
            return Err(DataPlanError::ZeroBatch);
        }
        if self.micro == 0 {
            return Err(DataPlanError::ZeroMicroBatch);
        }
        if !self.sequences.is_multiple_of(self.micro) {
            return Err(DataPlanError::NotMultiple {
                global: self.sequences,
                micro: self.micro,
            });
        }
        Ok(())
    }

    /// Micro-batches per step (`K = B / M`).
    pub fn micro_batches(&self) -> u64 {
        self.sequences / self.micro
    }

    /// The micro-batches member `rank` of `members` trains: a contiguous run, the first
    /// `K mod members` ranks one more than the others. Over the ranks, the runs cover `0..K`
    /// once each, in rank order.
    pub fn share(&self, members: usize, rank: usize) -> Range<u64> {
        share(self.micro_batches(), members, rank)
    }

    /// Micro-batch rounds every member takes part in (the expert exchanges are collective, so
    /// a member with fewer micro-batches joins the last round without data): `⌈K / n⌉`.
    pub fn rounds(&self, members: usize) -> u64 {
        rounds(self.micro_batches(), members)
    }

    /// The positions of micro-batch `mb` of the step whose first position is `cursor`.
    pub fn positions(&self, cursor: u64, mb: u64) -> Range<u64> {
        let start = cursor + mb * self.micro;
        start..start + self.micro
    }
}

/// The rounds of `k` micro-batches over `members` ([`share`]'s longest run): `⌈k / members⌉`.
pub fn rounds(k: u64, members: usize) -> u64 {
    k.div_ceil(members.max(1) as u64)
}

/// `0..k` cut into `members` contiguous runs, the first `k mod members` one longer; the run of
/// `rank` (empty past `k`, or when `rank ≥ members`).
pub fn share(k: u64, members: usize, rank: usize) -> Range<u64> {
    if members == 0 || rank >= members {
        return 0..0;
    }
    let (n, r) = (members as u64, rank as u64);
    let (base, extra) = (k / n, k % n);
    let start = r * base + r.min(extra);
    start..start + base + u64::from(r < extra)
}

/// One source's slots in every [`BLEND_BLOCK`]: the weights apportioned by largest remainder
/// (ties to the lower index), summing to the block exactly.
pub fn quotas(weights: &[f64]) -> Result<Vec<u64>, DataPlanError> {
    if weights.is_empty() {
        return Err(DataPlanError::NoSource);
    }
    for (i, &w) in weights.iter().enumerate() {
        if !(w.is_finite() && w > 0.0) {
            return Err(DataPlanError::BadWeight {
                source_index: i,
                weight: w,
            });
        }
    }
    let total: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights
        .iter()
        .map(|w| w / total * BLEND_BLOCK as f64)
        .collect();
    let mut q: Vec<u64> = exact.iter().map(|x| x.floor() as u64).collect();
    let given: u64 = q.iter().sum();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    // Largest fractional part first; `total_cmp` keeps it deterministic.
    order.sort_by(|&a, &b| {
        let (fa, fb) = (exact[a] - exact[a].floor(), exact[b] - exact[b].floor());
        fb.total_cmp(&fa).then(a.cmp(&b))
    });
    for &i in order
        .iter()
        .take((BLEND_BLOCK - given.min(BLEND_BLOCK)) as usize)
    {
        q[i] += 1;
    }
    if let Some(i) = q.iter().position(|&x| x == 0) {
        return Err(DataPlanError::WeightTooSmall { source_index: i });
    }
    debug_assert_eq!(q.iter().sum::<u64>(), BLEND_BLOCK);
    Ok(q)
}

/// Where a position of the global order lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Located {
    /// The source (dataset of the blend).
    pub source: usize,
    /// The source's epoch: how many times it was gone through before this draw.
    pub epoch: u64,
    /// The sequence of the source (`0..n`).
    pub sequence: u64,
}

/// The seeded order of every sequence of a blend, for ever (epoch after epoch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleOrder {
    seed: u64,
    /// Sequences of each source.
    sizes: Vec<u64>,
    /// Slots of each source in a block; `starts[d]` = the sum of the quotas before `d`.
    quotas: Vec<u64>,
    starts: Vec<u64>,
}

impl SampleOrder {
    /// `sizes[d]` sequences in source `d`, drawn at `weights[d]` (relative).
    pub fn new(seed: u64, sizes: Vec<u64>, weights: &[f64]) -> Result<Self, DataPlanError> {
        if sizes.is_empty() || sizes.len() != weights.len() {
            return Err(DataPlanError::NoSource);
        }
        if let Some(i) = sizes.iter().position(|&n| n == 0) {
            return Err(DataPlanError::EmptySource { source_index: i });
        }
        let quotas = quotas(weights)?;
        let starts = quotas
            .iter()
            .scan(0u64, |acc, &q| {
                let s = *acc;
                *acc += q;
                Some(s)
            })
            .collect();
        Ok(Self {
            seed,
            sizes,
            quotas,
            starts,
        })
    }

    /// One source, every position a draw of it.
    pub fn single(seed: u64, sequences: u64) -> Result<Self, DataPlanError> {
        Self::new(seed, vec![sequences], &[1.0])
    }

    pub fn sizes(&self) -> &[u64] {
        &self.sizes
    }

    /// Positions in one epoch of the first source (the whole epoch with one source).
    pub fn epoch_len(&self) -> u64 {
        // Source 0 is drawn `quota` times per block: its epoch spans this many positions.
        (self.sizes[0] * BLEND_BLOCK).div_ceil(self.quotas[0])
    }

    /// The sequence at `position` of the order.
    pub fn locate(&self, position: u64) -> Located {
        let (source, draw) = if self.sizes.len() == 1 {
            (0, position)
        } else {
            let block = position / BLEND_BLOCK;
            let slot = permute(
                position % BLEND_BLOCK,
                BLEND_BLOCK,
                key(self.seed, u64::MAX, block),
            );
            // The source whose run of slots holds `slot`.
            let d = self.starts.partition_point(|&s| s <= slot) - 1;
            (d, block * self.quotas[d] + (slot - self.starts[d]))
        };
        let n = self.sizes[source];
        let epoch = draw / n;
        Located {
            source,
            epoch,
            sequence: permute(draw % n, n, key(self.seed, source as u64, epoch)),
        }
    }
}

fn key(seed: u64, source: u64, epoch: u64) -> u64 {
    mix(seed ^ mix(source.wrapping_add(0x9e37_79b9_7f4a_7c15) ^ mix(epoch)))
}

/// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rounds of the Feistel network (a balanced Feistel network with a good round function is a
/// pseudo-random permutation from 4 rounds on — Luby and Rackoff 1988; 8 leave margin).
const FEISTEL_ROUNDS: u64 = 8;

/// Element `i` of a seeded permutation of `0..n` (`i < n`), computed alone: a Feistel network
/// over the `2h`-bit domain just above `n` (at most `4n`), cycle-walking until the value
/// falls in `0..n` (Black and Rogaway 2002). Expected under 4 passes; terminates because the
/// network is a permutation of its domain, so the cycle through `i` comes back below `n`.
pub fn permute(i: u64, n: u64, key: u64) -> u64 {
    assert!(i < n, "permute: {i} outside 0..{n}");
    if n <= 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2).max(1);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..FEISTEL_ROUNDS {
            let f = mix(key ^ mix(r ^ (round << 56))) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_is_a_permutation_for_every_small_n() {
        for n in 1..300u64 {
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let x = permute(i, n, 7 + n);
                assert!(!seen[x as usize], "n {n}: {x} twice");
                seen[x as usize] = true;
            }
        }
    }

    #[test]
    fn permutations_differ_by_key_and_are_not_the_identity() {
        let n = 1000;
        let a: Vec<u64> = (0..n).map(|i| permute(i, n, 1)).collect();
        let b: Vec<u64> = (0..n).map(|i| permute(i, n, 2)).collect();
        assert_ne!(a, b);
        let fixed = a
            .iter()
            .enumerate()
            .filter(|(i, x)| *i as u64 == **x)
            .count();
        assert!(fixed < 10, "{fixed} fixed points");
    }

    #[test]
    fn shares_cover_every_micro_batch_once_in_rank_order() {
        for k in 0..40u64 {
            for n in 1..12usize {
                let runs: Vec<Range<u64>> = (0..n).map(|r| share(k, n, r)).collect();
                let mut next = 0;
                for (r, run) in runs.iter().enumerate() {
                    assert_eq!(run.start, next, "k {k} n {n} rank {r}");
                    next = run.end;
                    let len = run.end - run.start;
                    let n64 = n as u64;
                    assert!(len == k / n64 || len == k / n64 + 1);
                }
                assert_eq!(next, k);
                let b = GlobalBatch::new(k.max(1) * 2, 2).unwrap();
                assert!(runs.iter().all(|r| r.end - r.start <= b.rounds(n)) || k == 0);
            }
        }
        assert_eq!(share(5, 3, 3), 0..0);
    }

    #[test]
    fn global_batch_checks_its_numbers() {
        assert_eq!(GlobalBatch::new(0, 1), Err(DataPlanError::ZeroBatch));
        assert_eq!(GlobalBatch::new(4, 0), Err(DataPlanError::ZeroMicroBatch));
        assert!(matches!(
            GlobalBatch::new(10, 4),
            Err(DataPlanError::NotMultiple { .. })
        ));
        let b = GlobalBatch::new(16, 4).unwrap();
        assert_eq!(b.micro_batches(), 4);
        assert_eq!(b.rounds(3), 2);
        assert_eq!(b.positions(32, 2), 40..44);
    }

    #[test]
    fn one_source_visits_every_sequence_once_per_epoch() {
        let n = 997;
        let o = SampleOrder::single(5, n).unwrap();
        assert_eq!(o.epoch_len(), n);
        for epoch in 0..3 {
            let mut seen = vec![false; n as usize];
            for p in epoch * n..(epoch + 1) * n {
                let l = o.locate(p);
                assert_eq!((l.source, l.epoch), (0, epoch));
                assert!(!seen[l.sequence as usize]);
                seen[l.sequence as usize] = true;
            }
        }
        // Another epoch, another order.
        assert_ne!(o.locate(0).sequence, o.locate(n).sequence);
    }

    #[test]
    fn quotas_follow_the_weights_and_fill_the_block() {
        let q = quotas(&[0.7, 0.3]).unwrap();
        assert_eq!(q.iter().sum::<u64>(), BLEND_BLOCK);
        assert_eq!(q, vec![2867, 1229]);
        assert_eq!(quotas(&[1.0, 1.0, 1.0]).unwrap(), vec![1366, 1365, 1365]);
        assert!(matches!(
            quotas(&[1.0, 1e-9]),
            Err(DataPlanError::WeightTooSmall { source_index: 1 })
        ));
        assert!(matches!(
            quotas(&[1.0, f64::NAN]),
            Err(DataPlanError::BadWeight { .. })
        ));
        assert_eq!(quotas(&[]), Err(DataPlanError::NoSource));
    }

    #[test]
    fn a_blend_draws_each_source_at_its_weight_and_each_sequence_once_per_epoch() {
        let sizes = vec![3000u64, 500];
        let o = SampleOrder::new(9, sizes.clone(), &[0.7, 0.3]).unwrap();
        let q = quotas(&[0.7, 0.3]).unwrap();
        let blocks = 3;
        let mut draws = vec![Vec::new(); 2];
        for p in 0..blocks * BLEND_BLOCK {
            let l = o.locate(p);
            draws[l.source].push((l.epoch, l.sequence));
        }
        for d in 0..2 {
            assert_eq!(draws[d].len() as u64, blocks * q[d]);
            // Within each epoch of the source, no sequence twice.
            let mut seen = std::collections::HashSet::new();
            for &(e, s) in &draws[d] {
                assert!(s < sizes[d]);
                assert!(seen.insert((e, s)), "source {d}: {e}/{s} twice");
            }
        }
        // Source 1 (500 sequences, ~1229 draws per block) went through several full epochs.
        let full = (blocks * q[1]) / sizes[1];
        for e in 0..full {
            assert_eq!(
                draws[1].iter().filter(|x| x.0 == e).count() as u64,
                sizes[1]
            );
        }
        assert!(matches!(
            SampleOrder::new(1, vec![10, 0], &[1.0, 1.0]),
            Err(DataPlanError::EmptySource { source_index: 1 })
        ));
    }
}
