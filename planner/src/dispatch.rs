//! Flexible token dispatch (Lazarus, arXiv 2407.04656, §4.2, Algorithm 1).
//!
//! Given, for every expert `e` and rank `j`, the number of tokens the gate on rank `j` routed
//! to `e` (`T[e][j]`) and the number of replicas of `e` that rank `j` holds (`R[e][j]`),
//! [`plan`] decides how many tokens every rank sends to every other rank for every expert:
//! an integer tensor `D[src][e][dst]` (`dst == src` means "kept and computed locally").
//! It is a pure function: no I/O, no clock, no randomness; the same input always yields the
//! same plan.
//!
//! # Algorithm
//!
//! For each expert `e` independently:
//!
//! 1. `r_e = Σ_j R[e][j]`, `t_e = Σ_j T[e][j]`, `p_e = t_e / r_e` (tokens per replica).
//! 2. **Capacities.** Rank `j` should process `p_e · R[e][j]` tokens of `e`. The paper is
//!    silent on rounding; we apportion `t_e` among ranks proportionally to `R[e][j]` with the
//!    **largest-remainder (Hamilton) method**: `cap[e][j] = ⌊t_e·R[e][j] / r_e⌋`, then the
//!    `t_e − Σ_j ⌊…⌋` leftover tokens go one each to the ranks with the largest remainders
//!    `t_e·R[e][j] mod r_e`, ties broken by **lower rank**. Hence `Σ_j cap[e][j] = t_e`
//!    exactly and `|cap[e][j] − p_e·R[e][j]| < 1`. Everything uses exact integer arithmetic
//!    (`u128` for products), never floats.
//! 3. **Local first.** `keep[e][i] = min(T[e][i], cap[e][i])` tokens stay on rank `i`
//!    (`D[i][e][i] = keep[e][i]`). The overflow `O[e][i] = T[e][i] − keep[e][i]` must be
//!    sent away; the residual capacity `P[e][j] = cap[e][j] − keep[e][j]` is free to receive.
//!    `Σ_i O = Σ_j P =: S`, and no rank has both `O > 0` and `P > 0`.
//! 4. **Proportional split of the overflow.** The ideal amount sender `i` ships to receiver
//!    `j` is `x_ij = O_i·P_j / S`. We round the `x_ij` to integers so that **both margins are
//!    exact** (row sums `= O_i`: every token is sent exactly once; column sums `= P_j`: every
//!    rank receives exactly its capacity) and every entry is `⌊x_ij⌋` or `⌊x_ij⌋ + 1`: take
//!    the floors, compute the row deficits `a_i` and column deficits `b_j`, then build a 0/1
//!    matrix with these margins by the Gale–Ryser (Ryser) greedy — rows in order of
//!    decreasing `a_i` (ties: lower rank first), each row puts its `a_i` ones into the `a_i`
//!    columns with the largest remaining `b_j` (ties: lower rank first). The fractional parts
//!    `x_ij − ⌊x_ij⌋ ∈ [0, 1)` are a fractional solution with these margins, so (the
//!    transportation polytope being integral) a 0/1 solution exists and the greedy finds it.
//!    The success is still checked: a failure is reported as [`DispatchError::Internal`]
//!    (and trips a `debug_assert!` in debug builds) instead of panicking.
//! 5. `send_counts[src][dst] = Σ_e D[src][e][dst]`, `recv_counts[dst][src]` is the same
//!    number. There is no padding anywhere: buffers are exactly as large as the tokens.
//!
//! # Guarantees
//!
//! * Conservation: `Σ_dst D[src][e][dst] = T[e][src]`.
//! * Balance: `received(e, j) = Σ_src D[src][e][j] = cap[e][j]`, and
//!   `|received(e, j) − p_e·R[e][j]| < 1`.
//! * Local first: `D[i][e][i] = min(T[e][i], cap[e][i])`; a rank that overflows for `e`
//!   receives no remote tokens of `e`.
//! * Proportionality: for `i ≠ j`, `D[i][e][j] ∈ {⌊O_i·P_j/S⌋, ⌊O_i·P_j/S⌋ + 1}`, so
//!   `|D[i][e][j] − O_i·P_j/S| ≤ 1`.
//!
//! # Buffer layout (paper step 7)
//!
//! The send buffer `h'` of rank `i` is **destination-major, expert-minor**: the block
//! `(j, e)` starts at `Σ_{j'<j} send_counts[i][j'] + Σ_{e'<e} D[i][e'][j]` and holds
//! `D[i][e][j]` tokens ([`DispatchPlan::send_offsets`]). The tokens of expert `e` on rank `i`
//! are split over destinations in rank order, preserving their order of appearance: the
//! block `(j, e)` takes the tokens of `e` with positions
//! `Σ_{j'<j} D[i][e][j'] .. Σ_{j'≤j} D[i][e][j']` ([`DispatchPlan::send_order`]). After an
//! all-to-all, rank `j`'s receive buffer is **source-major, expert-minor**
//! ([`DispatchPlan::recv_layout`]).
//!
//! # Representation and cost
//!
//! `D` is not stored densely (an `R·E·R` tensor is 2 GiB for `R = 1024, E = 256`): the local
//! part is a dense `[e][rank]` array, and the remote part of expert `e` is a dense
//! `senders_e × receivers_e` block (ranks with `O > 0` × ranks with `P > 0`, both ascending),
//! which is exactly the support of the proportional split. [`plan`] costs
//! `O(E·R + R² + Σ_e senders_e·receivers_e)` time (`R²` for `send_counts`/`recv_counts`) and
//! reuses its scratch buffers across experts.

use serde::{Deserialize, Serialize};

/// Why a dispatch plan (or a send order) could not be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DispatchError {
    /// An input array has the wrong length (ragged or inconsistent shapes).
    #[error("shape mismatch: {what} has length {found}, expected {expected}")]
    ShapeMismatch {
        /// Which array, e.g. `"tokens[3] (ranks)"`.
        what: String,
        /// The length implied by the other inputs.
        expected: usize,
        /// The length found.
        found: usize,
    },
    /// Tokens were routed to an expert that has no replica on any rank.
    #[error("expert {expert} has {tokens} routed tokens but no replica on any rank")]
    NoReplica {
        /// The expert without replicas.
        expert: usize,
        /// How many tokens were routed to it.
        tokens: u64,
    },
    /// The token list given to [`DispatchPlan::send_order`] disagrees with the plan.
    #[error(
        "rank {rank}: the token list has {found} tokens for expert {expert}, the plan expects {expected}"
    )]
    TokenCountMismatch {
        /// The source rank.
        rank: usize,
        /// The expert whose count differs.
        expert: usize,
        /// `T[expert][rank]` as given to [`plan`].
        expected: u64,
        /// The count in the token list.
        found: u64,
    },
    /// A token is routed to an expert id outside `0..experts`.
    #[error("token {index} is routed to expert {expert}, but the plan has only {experts} experts")]
    UnknownExpert {
        /// Position of the token in the list.
        index: usize,
        /// Its expert id.
        expert: u32,
        /// Number of experts in the plan.
        experts: usize,
    },
    /// A rank index outside `0..ranks`.
    #[error("rank {rank} is out of range (the plan has {ranks} ranks)")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// Number of ranks in the plan.
        ranks: usize,
    },
    /// The total number of tokens does not fit in a `u64`.
    #[error("token counts overflow u64: {what}")]
    Overflow {
        /// Which sum overflowed.
        what: String,
    },
    /// An internal invariant failed (a bug in this module, never expected).
    #[error("internal error in the dispatch planner: {0}")]
    Internal(String),
}

/// A remote (src ≠ dst) part of the plan: `count` tokens of `expert` go from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    /// Sending rank.
    pub src: usize,
    /// Expert the tokens are routed to.
    pub expert: usize,
    /// Receiving rank.
    pub dst: usize,
    /// Number of tokens (never zero in a plan).
    pub count: u64,
}

/// One block of a rank's receive buffer (see [`DispatchPlan::recv_layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvBlock {
    /// The rank the tokens come from (may be the receiving rank itself: local tokens).
    pub src: usize,
    /// The expert the tokens are for.
    pub expert: usize,
    /// Offset of the block in the receive buffer, in tokens.
    pub start: u64,
    /// Number of tokens in the block (never zero).
    pub len: u64,
}

/// The integer dispatch plan `D[src][e][dst]` with its send/receive counts.
///
/// Index accessors (`count`, `capacity`, …) panic on out-of-range indices, like slice
/// indexing; [`plan`] itself never panics on bad input. A deserialized plan is trusted to
/// have been produced by [`plan`] (its private fields are not re-validated).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchPlan {
    /// Number of experts `E`.
    pub experts: usize,
    /// Number of ranks `R`.
    pub ranks: usize,
    /// `T[e][rank]`, flat `[e * ranks + rank]`.
    tokens: Vec<u64>,
    /// Integer capacities `cap[e][rank]`, flat `[e * ranks + rank]`.
    caps: Vec<u64>,
    /// Locally kept tokens `D[rank][e][rank]`, flat `[e * ranks + rank]`.
    keep: Vec<u64>,
    /// Overflowing ranks of expert `e`: `senders[sender_start[e]..sender_start[e + 1]]`,
    /// ascending.
    senders: Vec<usize>,
    sender_start: Vec<usize>,
    /// Ranks with residual capacity for expert `e`, same layout, ascending.
    receivers: Vec<usize>,
    receiver_start: Vec<usize>,
    /// Remote counts of expert `e`: a row-major `senders_e × receivers_e` block starting at
    /// `flow_start[e]`.
    flows: Vec<u64>,
    flow_start: Vec<usize>,
    /// `send_counts[src][dst] = Σ_e D[src][e][dst]` (diagonal: tokens kept locally).
    pub send_counts: Vec<Vec<u64>>,
    /// `recv_counts[dst][src] = send_counts[src][dst]`.
    pub recv_counts: Vec<Vec<u64>>,
}

impl DispatchPlan {
    fn check_rank(&self, rank: usize) {
        assert!(
            rank < self.ranks,
            "rank {rank} out of range (plan has {} ranks)",
            self.ranks
        );
    }

    fn idx(&self, expert: usize, rank: usize) -> usize {
        assert!(
            expert < self.experts,
            "expert {expert} out of range (plan has {} experts)",
            self.experts
        );
        self.check_rank(rank);
        expert * self.ranks + rank
    }

    /// `D[src][expert][dst]`: tokens of `expert` that rank `src` sends to rank `dst`
    /// (`src == dst`: kept locally). `O(log)` lookup.
    pub fn count(&self, src: usize, expert: usize, dst: usize) -> u64 {
        let local = self.idx(expert, src);
        self.check_rank(dst);
        if src == dst {
            return self.keep[local];
        }
        let (snd, rcv, flows) = self.block(expert);
        match (snd.binary_search(&src), rcv.binary_search(&dst)) {
            (Ok(i), Ok(j)) => flows[i * rcv.len() + j],
            _ => 0,
        }
    }

    /// Senders, receivers and the remote-count block of `expert`.
    fn block(&self, expert: usize) -> (&[usize], &[usize], &[u64]) {
        (
            &self.senders[self.sender_start[expert]..self.sender_start[expert + 1]],
            &self.receivers[self.receiver_start[expert]..self.receiver_start[expert + 1]],
            &self.flows[self.flow_start[expert]..self.flow_start[expert + 1]],
        )
    }

    /// Integer capacity `cap[expert][dst]` (largest-remainder apportionment of `t_e`).
    pub fn capacity(&self, expert: usize, dst: usize) -> u64 {
        self.caps[self.idx(expert, dst)]
    }

    /// `Σ_src D[src][expert][dst]`: tokens of `expert` processed on `dst` (equals
    /// [`capacity`](Self::capacity)).
    pub fn received(&self, expert: usize, dst: usize) -> u64 {
        let mut sum = self.keep[self.idx(expert, dst)];
        let (snd, rcv, flows) = self.block(expert);
        if let Ok(j) = rcv.binary_search(&dst) {
            sum += (0..snd.len())
                .map(|i| flows[i * rcv.len() + j])
                .sum::<u64>();
        }
        sum
    }

    /// `T[expert][rank]` as given to [`plan`].
    pub fn routed(&self, expert: usize, rank: usize) -> u64 {
        self.tokens[self.idx(expert, rank)]
    }

    /// `D[rank][expert][rank] = min(T[expert][rank], cap[expert][rank])`.
    pub fn local(&self, expert: usize, rank: usize) -> u64 {
        self.keep[self.idx(expert, rank)]
    }

    /// All non-zero remote transfers, in `(expert, src, dst)` order.
    pub fn transfers(&self) -> impl Iterator<Item = Transfer> + '_ {
        (0..self.experts).flat_map(move |expert| {
            let (snd, rcv, flows) = self.block(expert);
            snd.iter().enumerate().flat_map(move |(i, &src)| {
                rcv.iter().enumerate().filter_map(move |(j, &dst)| {
                    let count = flows[i * rcv.len() + j];
                    (count > 0).then_some(Transfer {
                        src,
                        expert,
                        dst,
                        count,
                    })
                })
            })
        })
    }

    /// The non-zero remote transfers sent by `src`, sorted by `(expert, dst)`.
    pub fn sent_by(&self, src: usize) -> Vec<Transfer> {
        self.check_rank(src);
        let mut out = Vec::new();
        for expert in 0..self.experts {
            let (snd, rcv, flows) = self.block(expert);
            if let Ok(i) = snd.binary_search(&src) {
                let row = &flows[i * rcv.len()..(i + 1) * rcv.len()];
                for (&dst, &count) in rcv.iter().zip(row) {
                    if count > 0 {
                        out.push(Transfer {
                            src,
                            expert,
                            dst,
                            count,
                        });
                    }
                }
            }
        }
        out
    }

    /// The non-zero remote transfers received by `dst`, sorted by `(src, expert)`.
    pub fn received_by(&self, dst: usize) -> Vec<Transfer> {
        self.check_rank(dst);
        let mut out = Vec::new();
        for expert in 0..self.experts {
            let (snd, rcv, flows) = self.block(expert);
            if let Ok(j) = rcv.binary_search(&dst) {
                for (i, &src) in snd.iter().enumerate() {
                    let count = flows[i * rcv.len() + j];
                    if count > 0 {
                        out.push(Transfer {
                            src,
                            expert,
                            dst,
                            count,
                        });
                    }
                }
            }
        }
        // Stable: runs are already in (expert, src) order.
        out.sort_by_key(|t| t.src);
        out
    }

    /// Start of every `(dst, expert)` block in the send buffer `h'` of `src`, as
    /// `offsets[dst][expert]` (destination-major, expert-minor; see the module docs).
    pub fn send_offsets(&self, src: usize) -> Vec<Vec<u64>> {
        self.check_rank(src);
        let mut out = vec![vec![0u64; self.experts]; self.ranks];
        for (e, v) in out[src].iter_mut().enumerate() {
            *v = self.keep[e * self.ranks + src];
        }
        for t in self.sent_by(src) {
            out[t.dst][t.expert] = t.count;
        }
        let mut pos = 0u64;
        for row in &mut out {
            for v in row.iter_mut() {
                let len = *v;
                *v = pos;
                pos += len;
            }
        }
        out
    }

    /// The permutation that builds the send buffer `h'` of rank `src`: `order[k]` is the index
    /// into `token_experts` of the token placed at position `k` of `h'`.
    ///
    /// `token_experts[t]` is the expert of the `t`-th local token of `src`. Tokens of each
    /// expert keep their order of appearance; the first `D[src][e][0]` of them go to rank 0,
    /// the next `D[src][e][1]` to rank 1, and so on; blocks are laid out destination-major,
    /// expert-minor (see [`send_offsets`](Self::send_offsets)).
    ///
    /// Errors: [`DispatchError::RankOutOfRange`], [`DispatchError::UnknownExpert`], or
    /// [`DispatchError::TokenCountMismatch`] if the per-expert counts differ from
    /// `T[e][src]`.
    pub fn send_order(
        &self,
        src: usize,
        token_experts: &[u32],
    ) -> Result<Vec<usize>, DispatchError> {
        if src >= self.ranks {
            return Err(DispatchError::RankOutOfRange {
                rank: src,
                ranks: self.ranks,
            });
        }
        let (e_n, r_n) = (self.experts, self.ranks);
        let mut counts = vec![0u64; e_n];
        for (index, &x) in token_experts.iter().enumerate() {
            match counts.get_mut(x as usize) {
                Some(c) => *c += 1,
                None => {
                    return Err(DispatchError::UnknownExpert {
                        index,
                        expert: x,
                        experts: e_n,
                    });
                }
            }
        }
        for (e, &found) in counts.iter().enumerate() {
            let expected = self.tokens[e * r_n + src];
            if found != expected {
                return Err(DispatchError::TokenCountMismatch {
                    rank: src,
                    expert: e,
                    expected,
                    found,
                });
            }
        }

        // Start of each destination's region, then per-destination running expert offsets.
        let mut base = Vec::with_capacity(r_n);
        let mut pos = 0u64;
        for &s in &self.send_counts[src] {
            base.push(pos);
            pos += s;
        }
        let mut acc = vec![0u64; r_n];
        // Segments (start in h', len) per expert in destination-rank order.
        let mut segs: Vec<(u64, u64)> = Vec::new();
        let mut seg_begin = Vec::with_capacity(e_n + 1);
        let sent = self.sent_by(src);
        let mut k = 0;
        for e in 0..e_n {
            seg_begin.push(segs.len());
            let mut push = |dst: usize, len: u64, segs: &mut Vec<(u64, u64)>| {
                if len > 0 {
                    segs.push((base[dst] + acc[dst], len));
                    acc[dst] += len;
                }
            };
            let mut local_done = false;
            while k < sent.len() && sent[k].expert == e {
                let t = sent[k];
                if !local_done && t.dst > src {
                    push(src, self.keep[e * r_n + src], &mut segs);
                    local_done = true;
                }
                push(t.dst, t.count, &mut segs);
                k += 1;
            }
            if !local_done {
                push(src, self.keep[e * r_n + src], &mut segs);
            }
        }
        seg_begin.push(segs.len());

        let n = token_experts.len();
        let mut order = vec![usize::MAX; n];
        // Per expert: (current segment, tokens already placed in it).
        let mut cursor: Vec<(usize, u64)> = seg_begin[..e_n].iter().map(|&s| (s, 0)).collect();
        for (index, &x) in token_experts.iter().enumerate() {
            let e = x as usize;
            let (seg, used) = &mut cursor[e];
            while *seg < seg_begin[e + 1] && *used == segs[*seg].1 {
                *seg += 1;
                *used = 0;
            }
            if *seg >= seg_begin[e + 1] {
                return Err(DispatchError::Internal(format!(
                    "send_order: no segment left for token {index} of expert {e} on rank {src}"
                )));
            }
            let start = segs[*seg].0;
            let p = usize::try_from(start + *used).map_err(|_| {
                DispatchError::Internal("send_order: position exceeds usize".into())
            })?;
            match order.get_mut(p) {
                Some(slot) if *slot == usize::MAX => *slot = index,
                _ => {
                    return Err(DispatchError::Internal(format!(
                        "send_order: position {p} invalid or filled twice"
                    )));
                }
            }
            *used += 1;
        }
        Ok(order)
    }

    /// Layout of rank `dst`'s receive buffer after the all-to-all: source-major,
    /// expert-minor, one [`RecvBlock`] per non-zero `D[src][e][dst]` (including `src == dst`,
    /// the locally kept tokens), with contiguous `start` offsets.
    pub fn recv_layout(&self, dst: usize) -> Vec<RecvBlock> {
        self.check_rank(dst);
        let mut blocks = Vec::new();
        let mut pos = 0u64;
        let mut push = |src: usize, expert: usize, len: u64, blocks: &mut Vec<RecvBlock>| {
            if len > 0 {
                blocks.push(RecvBlock {
                    src,
                    expert,
                    start: pos,
                    len,
                });
                pos += len;
            }
        };
        let mut local_done = false;
        for t in &self.received_by(dst) {
            if !local_done && t.src > dst {
                for e in 0..self.experts {
                    push(dst, e, self.keep[e * self.ranks + dst], &mut blocks);
                }
                local_done = true;
            }
            push(t.src, t.expert, t.count, &mut blocks);
        }
        if !local_done {
            for e in 0..self.experts {
                push(dst, e, self.keep[e * self.ranks + dst], &mut blocks);
            }
        }
        blocks
    }

    /// Total tokens in rank `dst`'s receive buffer (local ones included) = `Σ_e cap[e][dst]`.
    pub fn recv_tokens(&self, dst: usize) -> u64 {
        self.check_rank(dst);
        self.recv_counts[dst].iter().sum()
    }

    /// Largest receive buffer over all ranks (local tokens included): the per-rank compute
    /// load of the MoE layer.
    pub fn max_recv_tokens(&self) -> u64 {
        (0..self.ranks)
            .map(|d| self.recv_tokens(d))
            .max()
            .unwrap_or(0)
    }

    /// Tokens that cross ranks (`Σ D[src][e][dst]` over `src ≠ dst`).
    pub fn total_remote_tokens(&self) -> u64 {
        self.flows.iter().sum()
    }
}

/// Turns a placement grid (`grid[rank]` = the expert ids in that rank's slots) into the
/// replica counts `R[e][rank]` that [`plan`] takes. Ids `>= experts` (e.g. a `u32::MAX`
/// empty-slot sentinel) are ignored.
pub fn replicas_per_rank(placement_grid: &[Vec<u32>], experts: usize) -> Vec<Vec<u32>> {
    let ranks = placement_grid.len();
    let mut out = vec![vec![0u32; ranks]; experts];
    for (rank, slots) in placement_grid.iter().enumerate() {
        for &id in slots {
            if let Some(row) = out.get_mut(id as usize) {
                row[rank] = row[rank].saturating_add(1);
            }
        }
    }
    out
}

/// Tokens each rank computes when expert `e`'s `loads[e]` tokens are dispatched over the
/// replicas `replicas[e][rank]`: `Σ_e cap[e][rank]`. The capacities depend only on the
/// totals, not on which rank's gate routed the tokens (step 2 of the module docs), so this is
/// exactly [`DispatchPlan::received`] summed over experts for any per-rank split of `loads`,
/// in `O(E·R)` without building the plan. It shows how even a placement is under the
/// dispatcher: Eq. 1 equalises tokens per replica, but a node's load also depends on which
/// replicas the placement puts together (with the `f` floor binding, an MRO block of cold
/// experts' replicas carries less than one of hot experts').
///
/// Errors: [`DispatchError::ShapeMismatch`] on ragged shapes, [`DispatchError::NoReplica`]
/// if an expert with tokens has no replica, [`DispatchError::Overflow`] if a rank's tokens do
/// not fit in a `u64`.
pub fn tokens_per_rank(loads: &[u64], replicas: &[Vec<u32>]) -> Result<Vec<u64>, DispatchError> {
    if replicas.len() != loads.len() {
        return Err(DispatchError::ShapeMismatch {
            what: "replicas (experts)".into(),
            expected: loads.len(),
            found: replicas.len(),
        });
    }
    let ranks = replicas.first().map_or(0, Vec::len);
    let mut total = vec![0u64; ranks];
    let (mut cap, mut holders) = (vec![0u64; ranks], Vec::new());
    for (e, (&t, row)) in loads.iter().zip(replicas).enumerate() {
        if row.len() != ranks {
            return Err(DispatchError::ShapeMismatch {
                what: format!("replicas[{e}] (ranks)"),
                expected: ranks,
                found: row.len(),
            });
        }
        let r: u64 = row.iter().map(|&x| u64::from(x)).sum();
        if t == 0 {
            continue;
        }
        if r == 0 {
            return Err(DispatchError::NoReplica {
                expert: e,
                tokens: t,
            });
        }
        apportion(t, row, r, &mut cap, &mut holders)?;
        for (acc, &c) in total.iter_mut().zip(&cap) {
            *acc = acc.checked_add(c).ok_or_else(|| DispatchError::Overflow {
                what: "tokens of one rank".into(),
            })?;
        }
    }
    Ok(total)
}

/// Builds the dispatch plan for `tokens[e][rank]` (`T`) and `replicas[e][rank]` (`R`).
///
/// Both arrays must be `E × R` (`E = tokens.len()`, `R = tokens[0].len()`).
///
/// Errors: [`DispatchError::ShapeMismatch`] on ragged or inconsistent shapes,
/// [`DispatchError::NoReplica`] if an expert with tokens has no replica (an expert with no
/// tokens needs none), [`DispatchError::Overflow`] if the total number of tokens does not fit
/// in a `u64`.
pub fn plan(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<DispatchPlan, DispatchError> {
    let experts = tokens.len();
    if replicas.len() != experts {
        return Err(DispatchError::ShapeMismatch {
            what: "replicas (experts)".into(),
            expected: experts,
            found: replicas.len(),
        });
    }
    let ranks = tokens.first().map_or(0, Vec::len);
    for (e, row) in tokens.iter().enumerate() {
        if row.len() != ranks {
            return Err(DispatchError::ShapeMismatch {
                what: format!("tokens[{e}] (ranks)"),
                expected: ranks,
                found: row.len(),
            });
        }
    }
    for (e, row) in replicas.iter().enumerate() {
        if row.len() != ranks {
            return Err(DispatchError::ShapeMismatch {
                what: format!("replicas[{e}] (ranks)"),
                expected: ranks,
                found: row.len(),
            });
        }
    }
    // Once the grand total fits, every partial sum below fits too.
    let mut total = 0u64;
    for row in tokens {
        for &t in row {
            total = total
                .checked_add(t)
                .ok_or_else(|| DispatchError::Overflow {
                    what: "total number of tokens".into(),
                })?;
        }
    }

    let n = experts * ranks;
    let mut flat_tokens = Vec::with_capacity(n);
    for row in tokens {
        flat_tokens.extend_from_slice(row);
    }
    let mut caps = vec![0u64; n];
    let mut keep = vec![0u64; n];
    let mut local_sum = vec![0u64; ranks];
    // Pass 1 (O(E·R)): capacities, local-first split, senders and receivers of every expert.
    let mut sender_ranks: Vec<usize> = Vec::new();
    let mut sender_amounts: Vec<u64> = Vec::new(); // O
    let mut receiver_ranks: Vec<usize> = Vec::new();
    let mut receiver_amounts: Vec<u64> = Vec::new(); // P
    let mut sender_start = Vec::with_capacity(experts + 1);
    let mut receiver_start = Vec::with_capacity(experts + 1);
    let mut flow_start = Vec::with_capacity(experts + 1);
    let mut flow_len = 0usize;
    let mut holders: Vec<(u64, usize)> = Vec::new();
    for e in 0..experts {
        sender_start.push(sender_ranks.len());
        receiver_start.push(receiver_ranks.len());
        flow_start.push(flow_len);
        let t_row = &tokens[e];
        let t_e: u64 = t_row.iter().sum();
        if t_e == 0 {
            continue;
        }
        let r_row = &replicas[e];
        let r_e: u64 = r_row.iter().map(|&r| u64::from(r)).sum();
        if r_e == 0 {
            return Err(DispatchError::NoReplica {
                expert: e,
                tokens: t_e,
            });
        }
        let lo = e * ranks;
        let cap_row = &mut caps[lo..lo + ranks];
        apportion(t_e, r_row, r_e, cap_row, &mut holders)?;
        let (s0, r0) = (sender_ranks.len(), receiver_ranks.len());
        for (j, ((&t, &c), k)) in t_row
            .iter()
            .zip(cap_row.iter())
            .zip(&mut keep[lo..lo + ranks])
            .enumerate()
        {
            *k = t.min(c);
            local_sum[j] += *k;
            if t > *k {
                sender_ranks.push(j);
                sender_amounts.push(t - *k);
            }
            if c > *k {
                receiver_ranks.push(j);
                receiver_amounts.push(c - *k);
            }
        }
        let cells = (sender_ranks.len() - s0)
            .checked_mul(receiver_ranks.len() - r0)
            .and_then(|c| c.checked_add(flow_len));
        flow_len = cells.ok_or_else(|| DispatchError::Overflow {
            what: "size of the remote-count blocks".into(),
        })?;
    }
    sender_start.push(sender_ranks.len());
    receiver_start.push(receiver_ranks.len());
    flow_start.push(flow_len);

    // Pass 2 (O(Σ_e senders_e·receivers_e)): proportional split with exact margins.
    let mut flows = vec![0u64; flow_len];
    let mut rounder = Rounder::default();
    // recv_counts[dst][src] is filled in ascending `src` for the few receivers of each expert
    // (a handful of rows streamed in parallel, cache-friendly); send_counts is its transpose.
    let mut recv_counts = zeros(ranks);
    for (j, row) in recv_counts.iter_mut().enumerate() {
        row[j] = local_sum[j];
    }
    for e in 0..experts {
        let (s0, s1) = (sender_start[e], sender_start[e + 1]);
        let (r0, r1) = (receiver_start[e], receiver_start[e + 1]);
        if s0 == s1 && r0 == r1 {
            continue;
        }
        let block = &mut flows[flow_start[e]..flow_start[e + 1]];
        rounder.round(&sender_amounts[s0..s1], &receiver_amounts[r0..r1], block)?;
        let nr = r1 - r0;
        for (&src, cells) in sender_ranks[s0..s1].iter().zip(block.chunks_exact(nr)) {
            for (&dst, &count) in receiver_ranks[r0..r1].iter().zip(cells) {
                recv_counts[dst][src] += count;
            }
        }
    }
    let send_counts = transpose(&recv_counts, ranks);

    Ok(DispatchPlan {
        experts,
        ranks,
        tokens: flat_tokens,
        caps,
        keep,
        senders: sender_ranks,
        sender_start,
        receivers: receiver_ranks,
        receiver_start,
        flows,
        flow_start,
        send_counts,
        recv_counts,
    })
}

/// An `n × n` zero matrix (each row freshly zero-allocated, not cloned).
fn zeros(n: usize) -> Vec<Vec<u64>> {
    (0..n).map(|_| vec![0u64; n]).collect()
}

/// Transpose of a square `n × n` matrix, in cache-friendly tiles.
fn transpose(m: &[Vec<u64>], n: usize) -> Vec<Vec<u64>> {
    const TILE: usize = 64;
    let mut out = zeros(n);
    for i0 in (0..n).step_by(TILE) {
        for j0 in (0..n).step_by(TILE) {
            for i in i0..(i0 + TILE).min(n) {
                for j in j0..(j0 + TILE).min(n) {
                    out[j][i] = m[i][j];
                }
            }
        }
    }
    out
}

/// Exact floor division by a fixed divisor `d > 0`, via a precomputed reciprocal
/// `m = ⌊2^64 / d⌋`: `q̂ = ⌊x·m / 2^64⌋` is `⌊x/d⌋` or one less, fixed with one remainder test.
#[derive(Clone, Copy)]
struct Divisor {
    d: u64,
    m: u64,
}

impl Divisor {
    fn new(d: u64) -> Self {
        debug_assert!(d > 0);
        let m = if d > 1 {
            ((1u128 << 64) / u128::from(d)) as u64
        } else {
            0
        };
        Divisor { d, m }
    }

    fn div(self, x: u64) -> u64 {
        if self.d == 1 {
            return x;
        }
        let q = ((u128::from(x) * u128::from(self.m)) >> 64) as u64;
        if x - q * self.d >= self.d { q + 1 } else { q }
    }

    /// `⌊a·b / d⌋` exactly (result known to fit in `u64`).
    fn mul_div(self, a: u64, b: u64) -> u64 {
        match a.checked_mul(b) {
            Some(x) => self.div(x),
            None => (u128::from(a) * u128::from(b) / u128::from(self.d)) as u64,
        }
    }
}

/// Largest-remainder (Hamilton) apportionment of `t` among ranks proportionally to `r_row`
/// (`r = Σ r_row > 0`), ties to the lower rank. Writes into `out` (same length as `r_row`).
fn apportion(
    t: u64,
    r_row: &[u32],
    r: u64,
    out: &mut [u64],
    holders: &mut Vec<(u64, usize)>,
) -> Result<(), DispatchError> {
    holders.clear();
    let mut assigned = 0u64;
    let r128 = u128::from(r);
    for (j, (&rj, o)) in r_row.iter().zip(out.iter_mut()).enumerate() {
        if rj == 0 {
            *o = 0;
            continue;
        }
        let x = u128::from(t) * u128::from(rj);
        let f = (x / r128) as u64; // ≤ t
        *o = f;
        assigned += f;
        holders.push(((x % r128) as u64, j));
    }
    let deficit = t - assigned;
    let d = usize::try_from(deficit).unwrap_or(usize::MAX);
    if d > holders.len() {
        debug_assert!(false, "apportionment deficit too large");
        return Err(DispatchError::Internal(format!(
            "apportionment deficit {deficit} exceeds {} holders",
            holders.len()
        )));
    }
    if d > 0 {
        // Strict total order: larger remainder first, then lower rank.
        let by = |a: &(u64, usize), b: &(u64, usize)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
        if d < holders.len() {
            holders.select_nth_unstable_by(d - 1, by);
        }
        for &(_, j) in &holders[..d] {
            out[j] += 1;
        }
    }
    Ok(())
}

/// Scratch buffers for the integer rounding of one expert's transportation problem.
#[derive(Default)]
struct Rounder {
    a: Vec<u64>,
    b: Vec<u64>,
    bucket: Vec<usize>,
    rows: Vec<usize>,
    ord: Vec<usize>,
    tmp: Vec<usize>,
}

impl Rounder {
    /// Rounds `x_ij = O_i·P_j / S` to integers with exact margins (rows `O_i`, columns
    /// `P_j`), each entry `⌊x_ij⌋` or `⌊x_ij⌋ + 1`; `Σ O = Σ P = S > 0` must hold. The result
    /// goes into `mat`, `senders × receivers`, row-major (every cell is written).
    fn round(&mut self, o: &[u64], p: &[u64], mat: &mut [u64]) -> Result<(), DispatchError> {
        let (ns, nr) = (o.len(), p.len());
        let s: u64 = o.iter().sum();
        let s_cols: u64 = p.iter().sum();
        if s != s_cols || s == 0 || mat.len() != ns * nr {
            debug_assert!(false, "unbalanced transportation problem");
            return Err(DispatchError::Internal(format!(
                "overflow {s} vs residual capacity {s_cols}, {} cells for {ns}×{nr}",
                mat.len()
            )));
        }
        let Rounder {
            a,
            b,
            bucket,
            rows,
            ord,
            tmp,
        } = self;
        let div = Divisor::new(s);
        a.clear();
        b.clear();
        b.extend_from_slice(p);
        for (&oi, row) in o.iter().zip(mat.chunks_exact_mut(nr)) {
            let mut sum = 0u64;
            for ((cell, &pj), bj) in row.iter_mut().zip(p).zip(b.iter_mut()) {
                let f = div.mul_div(oi, pj);
                *cell = f;
                sum += f;
                *bj -= f; // column floors sum to ≤ P_j
            }
            a.push(oi - sum); // < nr: the fractional parts of a row sum to it
        }

        // Ryser greedy: rows by decreasing deficit (ties: lower index; a stable counting sort,
        // deficits being < nr), each into the columns with the largest remaining deficit.
        if a.iter().any(|&ai| ai >= nr as u64) {
            debug_assert!(false, "row deficit not below the number of columns");
            return Err(DispatchError::Internal(
                "rounding failed: row deficit too large".into(),
            ));
        }
        bucket.clear();
        bucket.resize(nr + 1, 0);
        for &ai in a.iter() {
            bucket[ai as usize] += 1;
        }
        // Start of each deficit value in decreasing order; value 0 is not placed.
        let mut at = 0;
        for v in (1..nr).rev() {
            let c = bucket[v];
            bucket[v] = at;
            at += c;
        }
        rows.clear();
        rows.resize(at, 0);
        for (i, &ai) in a.iter().enumerate() {
            if ai > 0 {
                rows[bucket[ai as usize]] = i;
                bucket[ai as usize] += 1;
            }
        }
        ord.clear();
        ord.extend(0..nr);
        ord.sort_unstable_by(|&x, &y| b[y].cmp(&b[x]).then(x.cmp(&y)));
        for &ii in rows.iter() {
            let k = a[ii] as usize;
            if b[ord[k - 1]] == 0 {
                debug_assert!(false, "Ryser greedy failed");
                return Err(DispatchError::Internal(format!(
                    "rounding failed: row deficit {k} cannot be placed"
                )));
            }
            let row = &mut mat[ii * nr..(ii + 1) * nr];
            for &jj in &ord[..k] {
                row[jj] += 1;
                b[jj] -= 1;
            }
            // ord[..k] and ord[k..] are each still sorted by (b desc, index asc): merge.
            tmp.clear();
            let (mut x, mut y) = (0, k);
            while x < k && y < nr {
                let (u, v) = (ord[x], ord[y]);
                // u goes first iff b[u] > b[v], or equal and u < v.
                if (b[u], v) > (b[v], u) {
                    tmp.push(u);
                    x += 1;
                } else {
                    tmp.push(v);
                    y += 1;
                }
            }
            tmp.extend_from_slice(&ord[x..k]);
            tmp.extend_from_slice(&ord[y..nr]);
            std::mem::swap(ord, tmp);
        }
        if b.iter().any(|&v| v != 0) {
            debug_assert!(false, "column deficits left after rounding");
            return Err(DispatchError::Internal(
                "rounding failed: column deficits left".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apportion_largest_remainder_ties_to_lower_rank() {
        let mut out = vec![0; 3];
        let mut h = Vec::new();
        apportion(7, &[1, 1, 1], 3, &mut out, &mut h).unwrap();
        assert_eq!(out, [3, 2, 2]);
        apportion(10, &[1, 2, 4], 7, &mut out, &mut h).unwrap();
        assert_eq!(out, [1, 3, 6]); // remainders 3, 6, 5
        apportion(2, &[1, 0, 1], 2, &mut out, &mut h).unwrap();
        assert_eq!(out, [1, 0, 1]);
        apportion(1, &[0, 1, 1], 2, &mut out, &mut h).unwrap();
        assert_eq!(out, [0, 1, 0]);
    }

    /// Checks exact margins and `⌊x⌋ ≤ D ≤ ⌊x⌋ + 1` for one rounding problem.
    fn check_round(o: &[u64], p: &[u64]) -> Vec<u64> {
        let (ns, nr) = (o.len(), p.len());
        let s: u64 = o.iter().sum();
        let mut mat = vec![7; ns * nr];
        Rounder::default().round(o, p, &mut mat).unwrap();
        for i in 0..ns {
            assert_eq!(mat[i * nr..(i + 1) * nr].iter().sum::<u64>(), o[i]);
            for j in 0..nr {
                let f = (u128::from(o[i]) * u128::from(p[j]) / u128::from(s)) as u64;
                let v = mat[i * nr + j];
                assert!(v == f || v == f + 1, "cell ({i},{j}) = {v}, floor {f}");
            }
        }
        for j in 0..nr {
            assert_eq!((0..ns).map(|i| mat[i * nr + j]).sum::<u64>(), p[j]);
        }
        mat
    }

    #[test]
    fn rounder_exact_margins_and_within_one() {
        check_round(&[5, 3, 3], &[4, 4, 3]);
        check_round(&[1, 1, 1], &[1, 2]);
        check_round(&[1; 7], &[1; 7]);
        check_round(&[9], &[2, 3, 4]);
        check_round(
            &[u64::MAX / 2, u64::MAX / 2 - 5],
            &[u64::MAX / 3, u64::MAX - 5 - u64::MAX / 3 - 1],
        );
        // Ryser order: row deficits [1, 1, 1], column deficits [2, 1] → rows 0, 1 take column 0.
        assert_eq!(check_round(&[1, 1, 1], &[2, 1]), [1, 0, 1, 0, 0, 1]);
        let mut seed = 0x1234_5678_9abc_def1u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let ns = 1 + (next() % 9) as usize;
            let nr = 1 + (next() % 9) as usize;
            let o: Vec<u64> = (0..ns).map(|_| 1 + next() % 50).collect();
            let s: u64 = o.iter().sum();
            // random composition of s into nr positive-or-zero parts, at least one positive
            let mut cuts: Vec<u64> = (0..nr - 1).map(|_| next() % (s + 1)).collect();
            cuts.sort_unstable();
            let mut p = Vec::with_capacity(nr);
            let mut prev = 0;
            for &c in cuts.iter().chain(std::iter::once(&s)) {
                p.push(c - prev);
                prev = c;
            }
            check_round(&o, &p);
        }
    }

    #[test]
    fn divisor_is_exact() {
        let mut seed = 0x0bad_cafe_dead_beefu64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let specials = [
            1,
            2,
            3,
            7,
            10,
            u64::MAX,
            u64::MAX - 1,
            1 << 63,
            (1 << 63) + 1,
            1 << 32,
        ];
        for &d in specials.iter() {
            let div = Divisor::new(d);
            for &x in specials.iter().chain(&[0, d - 1, d, d.wrapping_add(1)]) {
                assert_eq!(div.div(x), x / d, "{x} / {d}");
            }
        }
        for _ in 0..100_000 {
            let d = match next() % 3 {
                0 => next() % 1000 + 1,
                1 => next() >> (next() % 64) | 1,
                _ => next().max(1),
            };
            let x = next() >> (next() % 64);
            let div = Divisor::new(d);
            assert_eq!(div.div(x), x / d, "{x} / {d}");
            let (a, b) = (next() >> (next() % 64), next() >> (next() % 64));
            let want = u128::from(a) * u128::from(b) / u128::from(d);
            if want <= u128::from(u64::MAX) {
                assert_eq!(u128::from(div.mul_div(a, b)), want);
            }
        }
    }
}
