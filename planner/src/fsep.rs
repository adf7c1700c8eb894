//! Resilient fully sharded experts (FSEP, LAER-MoE §3 / our reference §1.2) with `f` copies of
//! every shard: where the copies go, how likely they survive `k` node failures, and what to
//! rebuild after a loss.
//!
//! # The storage model
//! LAER-MoE cuts every expert's parameters and Adam state into `S` shards (`S` = devices in
//! LAER) and keeps shard `w` of **every** expert of every layer on device `w`: a layer's
//! experts are re-materialised each step by an all-to-all of shards, so the expert → device
//! layout is free to change. Losing a device loses shard `w` of every expert at once, so the
//! unit that must survive is the *shard index* `w`, not an expert. Here each of the `S` shard
//! indices is kept on `f` distinct **nodes** (the failure unit); a node holds at most
//! `capacity` shard copies (its memory). The model survives a failure set `F` iff no shard has
//! all of its holders in `F`. Because every expert and every layer shares one shard layout,
//! that is also the condition for every layer (layers are aligned for free, the property
//! [`crate::model`] has to construct for replicated plans).
//!
//! # Optimal placement (derivation)
//! Write `H_w` for the node set holding shard `w` (`|H_w| = f`). Under `k` uniformly random
//! node failures the model is lost iff `F ⊇ H_w` for some `w`, so only the *distinct* sets
//! `H_w` matter, and the lost failure sets are the union of their up-sets. This is exactly
//! Lazarus's recovery problem (Theorem 1, App. A.2 of arXiv 2407.04656) with the shards as
//! "experts", every replica count `r_w = f` and `c = capacity` slots per node: a plan there is
//! a `c × N` grid holding expert `w` `r_w` times, and recovery means the live nodes still cover
//! every expert. Our plans are those grids whose copies of a shard sit on distinct nodes — a
//! subset of the paper's plan space — so an MRO plan that respects distinctness is optimal
//! among ours too, for **every** `k` at once. With equal counts MRO reads:
//!
//! * group the shards into `g = ⌈S/c⌉` groups of `c` consecutive shards (the last one smaller);
//! * give group `i` its own block of `f` nodes `[i·f, (i+1)·f)`; every node of the block holds
//!   every shard of the group (`c` copies, one per shard, all distinct nodes per shard);
//! * the model survives iff every block keeps a live node:
//!   `P(k) = Σ_{J ⊆ blocks} (−1)^{|J|} C(N − f·|J|, N − k) / C(N, N − k)`
//!   ([`crate::recovery::mro_closed_form`] with `g` blocks of size `f`).
//!
//! Intuition ("all eggs in one basket", Fig. 5 of the paper): each distinct holder set adds
//! the `C(N−f, k−f)` failure sets containing it, minus overlaps; packing `c` shards onto each
//! set minimises the number of distinct sets (`⌈S/c⌉` is the least possible, a set can carry
//! at most `c` shards), and capacity forbids two sets from sharing a node when both are full.
//! The construction needs `g·f ≤ N`. When the capacity is tight and `f ∤ N` (e.g. `S = N·G`
//! shards with `c = f·G` and an odd `N` at `f = 2`) it does not fit, and MRO's premise (any
//! grid, copies may share a node) no longer covers our distinct-node plans. [`place`] is then
//! the same rule read as a greedy — the `f` roomiest nodes take as many whole shards as they
//! can while the rest stays placeable (Gale–Ryser) — which reproduces the blocks when they fit
//! and otherwise packs the last shards onto few overlapping holder sets. The test
//! `matches_brute_force_optimum` compares it with the best of **all** placements, for every
//! `k`, on every instance with `N ≤ 6`, `S ≤ 6`, `f ≤ 3` and the balanced or one-larger room.
//!
//! # Repair
//! After a failure each shard with no live holder is lost for good (→ restore the checkpoint);
//! otherwise the lost copies are rebuilt on survivors, copying from a surviving holder, which
//! moves the least possible bytes: exactly one shard per missing copy ([`repair`]). Shards
//! that shared a holder set keep sharing one (they are sent to the same new node when it has
//! room), so the repaired placement keeps few distinct holder sets — the MRO property.

use crate::recovery::{self, RecoveryEstimate};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why a sharded placement or repair cannot be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FsepError {
    #[error("shards must be at least 1 (got {0})")]
    NoShards(usize),
    #[error("copies per shard f must be at least 1 (got {0})")]
    NoCopies(usize),
    #[error("{copies} copies per shard need {copies} distinct nodes, but only {nodes} exist")]
    TooFewNodes { copies: usize, nodes: usize },
    #[error(
        "{shards} shards x {copies} copies do not fit in {nodes} nodes x {capacity} shard copies per node"
    )]
    NoRoom {
        shards: usize,
        copies: usize,
        nodes: usize,
        capacity: usize,
    },
    #[error("node {node} is out of range: the placement has {nodes} nodes")]
    NodeOutOfRange { node: u32, nodes: usize },
    #[error("shard {shard} has {got} holders, expected {expected} distinct nodes")]
    BadHolders {
        shard: usize,
        expected: usize,
        got: usize,
    },
    #[error("node {node} holds {got} shard copies, over its capacity of {capacity}")]
    OverCapacity {
        node: usize,
        got: usize,
        capacity: usize,
    },
    #[error("no survivor can take a copy of shard {shard} (all with room already hold it)")]
    Stuck { shard: usize },
    #[error(transparent)]
    Recovery(#[from] crate::error::PlanError),
}

/// The problem: `shards` shard indices, `copies` (= f) copies of each on distinct nodes,
/// `nodes` nodes holding at most `capacity` shard copies each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsepSpec {
    pub nodes: usize,
    pub shards: usize,
    pub copies: usize,
    pub capacity: usize,
}

impl FsepSpec {
    /// The balanced capacity: `⌈copies·shards / nodes⌉` (the least that fits).
    pub fn balanced(nodes: usize, shards: usize, copies: usize) -> Self {
        Self {
            nodes,
            shards,
            copies,
            capacity: min_capacity(nodes, shards, copies),
        }
    }

    pub fn validate(&self) -> Result<(), FsepError> {
        if self.shards == 0 {
            return Err(FsepError::NoShards(0));
        }
        if self.copies == 0 {
            return Err(FsepError::NoCopies(0));
        }
        if self.nodes < self.copies {
            return Err(FsepError::TooFewNodes {
                copies: self.copies,
                nodes: self.nodes,
            });
        }
        if self.nodes * self.capacity < self.shards * self.copies {
            return Err(FsepError::NoRoom {
                shards: self.shards,
                copies: self.copies,
                nodes: self.nodes,
                capacity: self.capacity,
            });
        }
        Ok(())
    }
}

/// `⌈copies·shards / nodes⌉`, the least per-node capacity holding every copy (0 nodes: 0).
pub fn min_capacity(nodes: usize, shards: usize, copies: usize) -> usize {
    if nodes == 0 {
        return 0;
    }
    (shards * copies).div_ceil(nodes)
}

/// Where each shard's copies live: `holders[w]` = the distinct nodes (ascending) holding
/// shard `w`, over nodes `0..nodes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardPlacement {
    nodes: usize,
    holders: Vec<Vec<u32>>,
}

impl ShardPlacement {
    /// From explicit holder lists (sorted and checked: distinct, in range).
    pub fn new(nodes: usize, mut holders: Vec<Vec<u32>>) -> Result<Self, FsepError> {
        for (w, h) in holders.iter_mut().enumerate() {
            let len = h.len();
            h.sort_unstable();
            h.dedup();
            if h.len() != len {
                return Err(FsepError::BadHolders {
                    shard: w,
                    expected: len,
                    got: h.len(),
                });
            }
            if let Some(&n) = h.iter().find(|&&n| n as usize >= nodes) {
                return Err(FsepError::NodeOutOfRange { node: n, nodes });
            }
        }
        Ok(Self { nodes, holders })
    }

    pub fn nodes(&self) -> usize {
        self.nodes
    }

    pub fn shards(&self) -> usize {
        self.holders.len()
    }

    /// The nodes holding shard `w`, ascending.
    pub fn holders(&self, w: usize) -> &[u32] {
        &self.holders[w]
    }

    pub fn all_holders(&self) -> &[Vec<u32>] {
        &self.holders
    }

    /// `[node]` = shards held, ascending.
    pub fn node_shards(&self) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); self.nodes];
        for (w, h) in self.holders.iter().enumerate() {
            for &n in h {
                out[n as usize].push(w as u32);
            }
        }
        out
    }

    /// Shard copies per node.
    pub fn load(&self) -> Vec<usize> {
        let mut load = vec![0; self.nodes];
        for &n in self.holders.iter().flatten() {
            load[n as usize] += 1;
        }
        load
    }

    /// Checks `spec`: every shard on exactly `copies` distinct nodes, no node over capacity.
    pub fn check(&self, spec: &FsepSpec) -> Result<(), FsepError> {
        assert_eq!(
            self.nodes, spec.nodes,
            "placement and spec disagree on nodes"
        );
        for (w, h) in self.holders.iter().enumerate() {
            if h.len() != spec.copies {
                return Err(FsepError::BadHolders {
                    shard: w,
                    expected: spec.copies,
                    got: h.len(),
                });
            }
        }
        if let Some((node, &got)) = self
            .load()
            .iter()
            .enumerate()
            .find(|&(_, &l)| l > spec.capacity)
        {
            return Err(FsepError::OverCapacity {
                node,
                got,
                capacity: spec.capacity,
            });
        }
        Ok(())
    }

    /// The distinct holder sets (the critical sets: the model dies iff one dies entirely),
    /// sorted.
    pub fn critical_sets(&self) -> Vec<Vec<u32>> {
        let mut sets = self.holders.clone();
        sets.sort();
        sets.dedup();
        sets
    }

    /// Does every shard keep a live holder when `dead` fail?
    pub fn survives(&self, dead: &[u32]) -> bool {
        self.lost_shards(dead).is_empty()
    }

    /// Shards whose every holder is in `dead`.
    pub fn lost_shards(&self, dead: &[u32]) -> Vec<u32> {
        let mut is_dead = vec![false; self.nodes];
        for &n in dead {
            if let Some(d) = is_dead.get_mut(n as usize) {
                *d = true;
            }
        }
        (0..self.holders.len())
            .filter(|&w| self.holders[w].iter().all(|&n| is_dead[n as usize]))
            .map(|w| w as u32)
            .collect()
    }

    /// Block sizes when the placement is a disjoint-block (MRO) one: the distinct holder sets
    /// are pairwise disjoint. `None` otherwise.
    pub fn disjoint_blocks(&self) -> Option<Vec<usize>> {
        let sets = self.critical_sets();
        let mut seen = vec![false; self.nodes];
        for s in &sets {
            for &n in s {
                if std::mem::replace(&mut seen[n as usize], true) {
                    return None;
                }
            }
        }
        Some(sets.iter().map(Vec::len).collect())
    }
}

/// The survival-maximising placement of `spec` (see the [module docs](self)). With a batch
/// limit `b`, repeatedly the `f` nodes with the most room (ties: lowest index) take as many
/// whole shards as they can, at most `b`, while the shards left stay placeable
/// ([`placeable`]). `b = c` is MRO's disjoint blocks when `⌈S/c⌉·f ≤ N`; otherwise smaller
/// batches can spread the last shards over fewer holder sets, so every `b ∈ 1..=c` is tried
/// and the placement with the fewest distinct holder sets wins (then the most overlap
/// between them, then the largest `b`).
pub fn place(spec: &FsepSpec) -> Result<ShardPlacement, FsepError> {
    spec.validate()?;
    let c = spec.capacity.min(spec.shards);
    if spec.shards.div_ceil(c) * spec.copies <= spec.nodes {
        // The blocks fit: MRO, optimal by Theorem 1.
        return Ok(place_batched(spec, c));
    }
    // Every batch size on small instances (where the brute-force test checks optimality);
    // halvings of `c` at scale, where each try costs O(S·N log N / b).
    let batches: Vec<usize> = if spec.shards * spec.nodes <= 1 << 22 {
        (1..=c).rev().collect()
    } else {
        std::iter::successors(Some(c), |&b| (b > 1).then_some(b / 2)).collect()
    };
    let best = batches
        .into_iter()
        .map(|b| place_batched(spec, b))
        .min_by_key(|p| {
            let sets = p.critical_sets();
            (sets.len(), std::cmp::Reverse(overlap(&sets)))
        })
        .expect("at least one batch size");
    best.check(spec)?;
    Ok(best)
}

/// `Σ` over pairs of distinct holder sets of their common nodes, squared: more overlap means
/// more failure sets that kill two holder sets at once, i.e. fewer failure sets in all.
fn overlap(sets: &[Vec<u32>]) -> usize {
    let mut total = 0;
    for (i, a) in sets.iter().enumerate() {
        for b in &sets[i + 1..] {
            let common = a.iter().filter(|n| b.contains(n)).count();
            total += common * common;
        }
    }
    total
}

/// [`place`] with batches of at most `batch` shards per holder set.
fn place_batched(spec: &FsepSpec, batch: usize) -> ShardPlacement {
    let FsepSpec {
        nodes: n,
        shards: s,
        copies: f,
        capacity: c,
    } = *spec;
    let mut room = vec![c; n];
    let mut holders: Vec<Vec<u32>> = Vec::with_capacity(s);
    let mut order: Vec<usize> = (0..n).collect();
    while holders.len() < s {
        let left = s - holders.len();
        order.sort_by_key(|&i| (std::cmp::Reverse(room[i]), i));
        let set = &order[..f];
        let most = set
            .iter()
            .map(|&i| room[i])
            .min()
            .unwrap_or(0)
            .min(left)
            .min(batch);
        // The largest batch that leaves the rest placeable; 1 always does (placing a shard on
        // the f roomiest nodes keeps a realisable degree sequence, Havel–Hakimi style).
        let take = (1..=most)
            .rev()
            .find(|&t| {
                let mut r = room.clone();
                set.iter().for_each(|&i| r[i] -= t);
                placeable(&r, left - t, f)
            })
            .expect("validate() and the invariant keep one more shard placeable");
        let mut h: Vec<u32> = set.iter().map(|&i| i as u32).collect();
        h.sort_unstable();
        for &i in set {
            room[i] -= take;
        }
        holders.extend(std::iter::repeat_n(h, take));
    }
    ShardPlacement { nodes: n, holders }
}

/// Can `shards` shards get `f` copies each on distinct nodes with `room[i]` free copies on
/// node `i`? By the Gale–Ryser theorem (bipartite degree sequences, all shard degrees `f`)
/// iff `Σ_i min(room_i, j) ≥ f·j` for every `j ≤ shards`; that sum minus `f·j` is concave in
/// `j`, so checking `j = 1` and `j = shards` suffices.
pub fn placeable(room: &[usize], shards: usize, f: usize) -> bool {
    if shards == 0 {
        return true;
    }
    let cover = |j: usize| room.iter().map(|&r| r.min(j)).sum::<usize>();
    cover(1) >= f && cover(shards) >= f * shards
}

/// Exact survival probability under `failed` uniform node failures for any placement, by the
/// planner's recovery machinery on the critical sets (interval closed form when every holder
/// set is a run of consecutive nodes — block placements —, else listing the failure sets that
/// contain a holder set); seeded Monte Carlo ([`recovery::AUTO_TRIALS`] trials, with a 95 %
/// interval) only when neither is affordable.
pub fn survival(
    p: &ShardPlacement,
    failed: usize,
    seed: u64,
) -> Result<RecoveryEstimate, FsepError> {
    Ok(recovery::from_small_sets_auto(
        p.nodes,
        failed,
        p.critical_sets(),
        seed,
    )?)
}

/// Exact survival for a disjoint-block placement: [`recovery::mro_closed_form`] on its
/// blocks. `None` when the holder sets overlap.
pub fn survival_closed_form(p: &ShardPlacement, failed: usize) -> Option<f64> {
    let blocks = p.disjoint_blocks()?;
    Some(recovery::mro_closed_form(&blocks, p.nodes, failed))
}

/// Seeded Monte Carlo survival with a 95 % Wilson interval, at any size.
pub fn survival_monte_carlo(
    p: &ShardPlacement,
    failed: usize,
    trials: u64,
    seed: u64,
) -> Result<RecoveryEstimate, FsepError> {
    let sets = p.critical_sets();
    Ok(recovery::FailureModel::from_sets(p.nodes, failed, sets)
        .monte_carlo(failed, trials, seed)?)
}

/// One shard copy to rebuild: read shard `shard` from `src` (a surviving holder), write it on
/// `dst`. Nodes are the indices of the placement the repair started from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardTransfer {
    pub shard: u32,
    pub src: u32,
    pub dst: u32,
}

/// An in-place repair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepairPlan {
    pub transfers: Vec<ShardTransfer>,
    /// The survivors, ascending old indices: new node `i` is old node `survivors[i]`.
    pub survivors: Vec<u32>,
    /// The repaired placement over the survivors (new indices).
    pub placement: ShardPlacement,
    /// Copies per shard after the repair: `min(f, survivors)`.
    pub copies: usize,
}

impl RepairPlan {
    /// Shard copies the busiest node sends and the busiest receives.
    pub fn max_sent_received(&self) -> (usize, usize) {
        let mut sent: BTreeMap<u32, usize> = BTreeMap::new();
        let mut recv: BTreeMap<u32, usize> = BTreeMap::new();
        for t in &self.transfers {
            *sent.entry(t.src).or_default() += 1;
            *recv.entry(t.dst).or_default() += 1;
        }
        (
            sent.values().copied().max().unwrap_or(0),
            recv.values().copied().max().unwrap_or(0),
        )
    }
}

/// What to do after `dead` failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RepairOutcome {
    /// Every shard kept a live copy: rebuild the missing copies in place.
    InPlace(RepairPlan),
    /// These shards lost every copy: restore the checkpoint.
    RestoreCheckpoint { lost_shards: Vec<u32> },
}

/// The checks [`repair`] and [`rejoin`] start with: `f ≥ 1`, the dead nodes in range, and
/// the restore when some shard lost every copy (`None`: every shard kept one).
fn check_dead(
    p: &ShardPlacement,
    f: usize,
    dead: &[u32],
) -> Result<Option<RepairOutcome>, FsepError> {
    if f == 0 {
        return Err(FsepError::NoCopies(0));
    }
    if let Some(&n) = dead.iter().find(|&&n| n as usize >= p.nodes) {
        return Err(FsepError::NodeOutOfRange {
            node: n,
            nodes: p.nodes,
        });
    }
    let lost = p.lost_shards(dead);
    Ok((!lost.is_empty()).then_some(RepairOutcome::RestoreCheckpoint { lost_shards: lost }))
}

/// The recovery action after `dead` nodes of `p` failed, with `capacity` shard copies per
/// survivor. Rebuilds the missing copies (`min(f, survivors) − live copies` per shard — the
/// fewest bytes any repair can move), each from the surviving holder that sent least so far,
/// onto survivors that do not hold the shard: shards that shared a holder set go to the same
/// new node while it has room (keeping the distinct holder sets few, as MRO wants), else to the
/// survivor with the most room (ties: lowest index). When the only room left is on nodes that
/// already hold the shard, an augmenting path re-targets earlier new copies, and only if that
/// fails moves a surviving copy (one extra transfer each; property-tested to always succeed
/// when the survivors have room). Every transfer reads the state before the repair: a moved
/// surviving copy is deleted at its source only after all transfers.
///
/// # Errors
/// [`FsepError::NoRoom`] when the survivors cannot hold `min(f, survivors)` copies of every
/// shard; [`FsepError::Stuck`] when no assignment exists; [`FsepError::OverCapacity`] when
/// the survivors already hold more than `capacity`.
pub fn repair(
    p: &ShardPlacement,
    f: usize,
    dead: &[u32],
    capacity: usize,
) -> Result<RepairOutcome, FsepError> {
    if let Some(restore) = check_dead(p, f, dead)? {
        return Ok(restore);
    }
    let mut is_dead = vec![false; p.nodes];
    dead.iter().for_each(|&n| is_dead[n as usize] = true);
    let survivors: Vec<u32> = (0..p.nodes as u32)
        .filter(|&n| !is_dead[n as usize])
        .collect();
    let copies = f.min(survivors.len());
    let spec = FsepSpec {
        nodes: survivors.len(),
        shards: p.shards(),
        copies,
        capacity,
    };
    spec.validate()?;
    // Live holders per shard (old indices), and per-node load and sends.
    let mut holders: Vec<Vec<u32>> = p
        .holders
        .iter()
        .map(|h| {
            h.iter()
                .copied()
                .filter(|&n| !is_dead[n as usize])
                .collect()
        })
        .collect();
    let mut load = vec![0usize; p.nodes];
    for &n in holders.iter().flatten() {
        load[n as usize] += 1;
    }
    let mut sent = vec![0usize; p.nodes];
    // Damaged shards grouped by their live holder set (block-mates stay together).
    let mut groups: BTreeMap<Vec<u32>, Vec<usize>> = BTreeMap::new();
    for (w, h) in holders.iter().enumerate() {
        if h.len() < copies {
            groups.entry(h.clone()).or_default().push(w);
        }
    }
    let mut transfers = Vec::new();
    for (live, shards) in groups {
        // Targets chosen for this group so far, in order: later shards reuse them first.
        let mut group_targets: Vec<u32> = Vec::new();
        for w in shards {
            while holders[w].len() < copies {
                let held = &holders[w];
                let fits = |n: u32| load[n as usize] < capacity && !held.contains(&n);
                let dst = group_targets
                    .iter()
                    .copied()
                    .find(|&n| fits(n))
                    .or_else(|| {
                        survivors
                            .iter()
                            .copied()
                            .filter(|&n| fits(n))
                            .min_by_key(|&n| (load[n as usize], n))
                    })
                    .or_else(|| {
                        [false, true].into_iter().find_map(|surviving| {
                            augment(
                                w,
                                &mut holders,
                                &mut load,
                                &mut transfers,
                                &survivors,
                                capacity,
                                surviving,
                            )
                        })
                    })
                    .ok_or(FsepError::Stuck { shard: w })?;
                let augmented = holders[w].last() == Some(&dst);
                // Source: a holder that was alive before this repair (never a fresh copy, so
                // every transfer can start at once), the one that sent least.
                let src = live
                    .iter()
                    .copied()
                    .min_by_key(|&n| (sent[n as usize], n))
                    .expect("a damaged shard kept a live holder");
                sent[src as usize] += 1;
                if !augmented {
                    load[dst as usize] += 1;
                    holders[w].push(dst);
                }
                if !group_targets.contains(&dst) {
                    group_targets.push(dst);
                }
                transfers.push(ShardTransfer {
                    shard: w as u32,
                    src,
                    dst,
                });
            }
        }
    }
    let mut new_index = vec![u32::MAX; p.nodes];
    for (i, &n) in survivors.iter().enumerate() {
        new_index[n as usize] = i as u32;
    }
    let renumbered: Vec<Vec<u32>> = holders
        .into_iter()
        .map(|h| h.into_iter().map(|n| new_index[n as usize]).collect())
        .collect();
    let placement = ShardPlacement::new(survivors.len(), renumbered)?;
    placement.check(&spec)?;
    Ok(RepairOutcome::InPlace(RepairPlan {
        transfers,
        survivors,
        placement,
        copies,
    }))
}

/// A copy an augmenting path moves: a new one (transfer index) or a surviving one (shard).
/// The recovery action for a change of membership with newcomers: the `dead` nodes of `p`
/// leave and `joined` nodes that hold nothing join (indices `p.nodes()..p.nodes() + joined`
/// before renumbering). The shard count stays (shards are cut once per lineage); the copies
/// are re-placed over the new membership, on the balanced room
/// `⌈S·min(f, n')/n'⌉` ([`min_capacity`]) of its `n'` nodes:
///
/// 1. the copies the dead held are rebuilt as [`repair`] does, over the survivors *and* the
///    newcomers (a newcomer has the most room, so it takes them first);
/// 2. while the fullest node holds two copies more than some other node, its copy of one of
///    its shards (the highest-numbered one such a node lacks) moves to such a node,
///    preferring one that already took a shard of the same holder set (so shards that shared
///    a holder set keep sharing one: few distinct sets, as MRO wants), else the emptiest. The
///    loads end within one of each other, so within the balanced room.
///
/// Every new copy is one transfer from a holder of the shard before the change (the one that
/// sent least, ties: lowest index); a copy that moved away is dropped at its old holder once
/// every transfer arrived. `f = 1` (plain FSEP) is the same rule: a newcomer takes whole
/// shards from the fullest nodes, and a lost node restores (its shards had no other copy).
/// When every node is within one copy of the others already (e.g. `S = n` shards, `f = 1`,
/// cut for `n` nodes, `n'` > `n`), nothing moves: the newcomers join holding no shard and
/// compute on the shards the all-to-all brings them.
///
/// # Errors
/// As [`repair`].
pub fn rejoin(
    p: &ShardPlacement,
    f: usize,
    dead: &[u32],
    joined: usize,
) -> Result<RepairOutcome, FsepError> {
    if let Some(restore) = check_dead(p, f, dead)? {
        return Ok(restore);
    }
    let ext = ShardPlacement {
        nodes: p.nodes + joined,
        holders: p.holders.clone(),
    };
    let mut is_dead = vec![false; ext.nodes];
    dead.iter().for_each(|&n| is_dead[n as usize] = true);
    let alive = ext.nodes - dead.iter().filter(|&&n| is_dead[n as usize]).count();
    let copies = f.min(alive);
    let room = min_capacity(alive, p.shards(), copies);
    let held_most = ext
        .load()
        .iter()
        .enumerate()
        .filter(|&(n, _)| !is_dead[n])
        .map(|(_, &l)| l)
        .max()
        .unwrap_or(0);
    let RepairOutcome::InPlace(repaired) = repair(&ext, f, dead, room.max(held_most))? else {
        unreachable!("no shard lost every copy (checked above)");
    };
    let RepairPlan {
        survivors,
        placement,
        ..
    } = repaired;
    let n = survivors.len();
    let mut holders = placement.holders;
    let mut load = vec![0usize; n];
    for &h in holders.iter().flatten() {
        load[h as usize] += 1;
    }
    // The holder set of each shard before the spread: the group it moves with.
    let group_of: Vec<Vec<u32>> = holders.clone();
    let mut group_targets: BTreeMap<Vec<u32>, Vec<u32>> = BTreeMap::new();
    loop {
        let over = (0..n as u32)
            .max_by_key(|&o| (load[o as usize], std::cmp::Reverse(o)))
            .expect("a survivor");
        let most = load[over as usize];
        let with_room = |w: usize, holders: &[Vec<u32>], load: &[usize]| -> Vec<u32> {
            (0..n as u32)
                .filter(|&d| load[d as usize] + 2 <= most && !holders[w].contains(&d))
                .collect()
        };
        // Its highest shard that some node with two fewer lacks (one exists when such a node
        // does: it holds fewer shards than `over`).
        let Some((w, dsts)) = (0..holders.len())
            .rev()
            .filter(|&w| holders[w].contains(&over))
            .map(|w| (w, with_room(w, &holders, &load)))
            .find(|(_, d)| !d.is_empty())
        else {
            // Every node within one copy of the fullest: balanced (within the room).
            break;
        };
        let targets = group_targets.entry(group_of[w].clone()).or_default();
        let dst = targets
            .iter()
            .copied()
            .find(|t| dsts.contains(t))
            .unwrap_or_else(|| {
                *dsts
                    .iter()
                    .min_by_key(|&&d| (load[d as usize], d))
                    .expect("not empty")
            });
        if !targets.contains(&dst) {
            targets.push(dst);
        }
        holders[w].retain(|&h| h != over);
        holders[w].push(dst);
        load[over as usize] -= 1;
        load[dst as usize] += 1;
    }
    // Transfers: every copy a node did not hold before, from a holder before the change.
    let mut index = vec![u32::MAX; ext.nodes];
    for (i, &s) in survivors.iter().enumerate() {
        index[s as usize] = i as u32;
    }
    let mut sent = vec![0usize; n];
    let mut transfers = Vec::new();
    for (w, h) in holders.iter_mut().enumerate() {
        h.sort_unstable();
        let before: Vec<u32> = p.holders[w]
            .iter()
            .filter(|&&x| !is_dead[x as usize])
            .map(|&x| index[x as usize])
            .collect();
        for &dst in h.iter().filter(|d| !before.contains(d)) {
            let src = *before
                .iter()
                .min_by_key(|&&s| (sent[s as usize], s))
                .expect("a shard kept a live holder (checked above)");
            sent[src as usize] += 1;
            // In the indices before the change (newcomers after the old nodes), as
            // [`repair`]'s.
            transfers.push(ShardTransfer {
                shard: w as u32,
                src: survivors[src as usize],
                dst: survivors[dst as usize],
            });
        }
    }
    let spec = FsepSpec {
        nodes: n,
        shards: p.shards(),
        copies,
        capacity: room,
    };
    let placement = ShardPlacement::new(n, holders)?;
    placement.check(&spec)?;
    Ok(RepairOutcome::InPlace(RepairPlan {
        transfers,
        survivors,
        placement,
        copies,
    }))
}

#[derive(Debug, Clone, Copy)]
enum Moved {
    New(usize),
    Surviving(usize),
}

/// No survivor with room lacks shard `w`: find an augmenting path (a copy moves from a full
/// node to another node that lacks its shard, and so on, until a node with room), apply it and
/// give `w` the freed place. Breadth-first, so the fewest copies move. Moving one of this
/// repair's new copies is free (its transfer just lands elsewhere); with `move_surviving` a
/// surviving copy may move too, at the price of one more transfer — needed when the room left
/// sits only on nodes that already hold the shard. `None` when no path exists (then, by the
/// max-flow argument, no placement of the remaining copies exists with these moves).
fn augment(
    w: usize,
    holders: &mut [Vec<u32>],
    load: &mut [usize],
    transfers: &mut Vec<ShardTransfer>,
    survivors: &[u32],
    capacity: usize,
    move_surviving: bool,
) -> Option<u32> {
    // parent[n]: unvisited (None), an entry where `w` lands (Some(None)), or reached by
    // moving a copy away from `prev` (Some(Some((prev, moved)))).
    let mut parent: Vec<Option<Option<(u32, Moved)>>> = vec![None; load.len()];
    let mut queue = std::collections::VecDeque::new();
    for &n in survivors {
        if !holders[w].contains(&n) {
            parent[n as usize] = Some(None);
            queue.push_back(n);
        }
    }
    let is_new = |transfers: &[ShardTransfer], s: usize, n: u32| {
        transfers
            .iter()
            .any(|t| t.shard as usize == s && t.dst == n)
    };
    while let Some(n) = queue.pop_front() {
        if load[n as usize] < capacity {
            load[n as usize] += 1;
            let mut cur = n;
            while let Some(Some((prev, moved))) = parent[cur as usize] {
                let s = match moved {
                    Moved::New(t) => {
                        transfers[t].dst = cur;
                        transfers[t].shard as usize
                    }
                    Moved::Surviving(s) => {
                        // Read before the repair's deletions: `prev` still has it.
                        transfers.push(ShardTransfer {
                            shard: s as u32,
                            src: prev,
                            dst: cur,
                        });
                        s
                    }
                };
                let at = holders[s]
                    .iter()
                    .position(|&x| x == prev)
                    .expect("moved copy");
                holders[s][at] = cur;
                cur = prev;
            }
            holders[w].push(cur);
            return Some(cur);
        }
        let mut moves: Vec<(usize, Moved)> = transfers
            .iter()
            .enumerate()
            .filter(|(_, t)| t.dst == n)
            .map(|(t, tr)| (tr.shard as usize, Moved::New(t)))
            .collect();
        if move_surviving {
            moves.extend(
                (0..holders.len())
                    .filter(|&s| s != w && holders[s].contains(&n) && !is_new(transfers, s, n))
                    .map(|s| (s, Moved::Surviving(s))),
            );
        }
        for (s, moved) in moves {
            for &n2 in survivors {
                if parent[n2 as usize].is_none() && !holders[s].contains(&n2) {
                    parent[n2 as usize] = Some(Some((n, moved)));
                    queue.push_back(n2);
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests;
