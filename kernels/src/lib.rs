//! Data path of the flexible token dispatcher (Lazarus, arXiv 2407.04656, §4.3) on one source
//! rank: per-expert slot counting, the permutation of token rows into the send buffer in the
//! planner's order, and after the return all-to-all either the weighted un-permute/combine or
//! the exact un-permute (the inverse of a top_k = 1 permutation, which the executor's workers
//! use for every MoE layer: `executor/src/runtime/dispatch.rs`).
//!
//! * [`cpu`] — the CPU references, always built. They *define* the results: the counts and
//!   the send positions equal what [`lazarus_planner::dispatch`] computes
//!   ([`DispatchPlan::send_order`] is the inverse permutation of [`cpu::send_positions`]), and
//!   the CUDA kernels must match them bit for bit (counts, positions, permuted and un-permuted
//!   rows) or within a
//!   tolerance (combine, because of floating-point contraction).
//! * `cuda` (feature `cuda`) — the same operations as CUDA kernels (`src/dispatch.cu`, compiled
//!   to PTX for `compute_80` by `build.rs` with nvcc and loaded through cudarc), with launch
//!   wrappers. Building it needs a CUDA 13.0 toolchain: `source kernels/setup-cuda.sh`.
//!
//! Terms: a *slot* is one (token, choice) pair of the gate, `slot = token * top_k + j`;
//! `experts[slot]` is the expert id the gate chose. The send buffer is destination-major,
//! expert-minor; the slots of one expert keep their order of appearance and fill the
//! destinations in rank order (see [`lazarus_planner::dispatch`], "Buffer layout").

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use lazarus_planner::dispatch::DispatchPlan;

/// Why a kernel (or its CPU reference) rejected its input.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// A slot is routed to an expert id outside `0..experts`.
    #[error("slot {slot} is routed to expert {expert}, but there are only {experts} experts")]
    UnknownExpert {
        /// Index of the slot.
        slot: usize,
        /// Its expert id.
        expert: u32,
        /// Number of experts.
        experts: usize,
    },
    /// The per-expert slot counts disagree with the dispatch plan.
    #[error("expert {expert}: {found} slots routed here, but the plan dispatches {expected}")]
    CountMismatch {
        /// The expert.
        expert: usize,
        /// The plan's `T[expert][src]`.
        expected: u64,
        /// The count of the slots given.
        found: u64,
    },
    /// Array lengths do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A size exceeds the kernels' 32-bit indices (rows, slots, experts or ranks).
    #[error("{what} = {value} exceeds the kernels' 32-bit index range")]
    TooLarge {
        /// Which size.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// The source rank is not in the plan.
    #[error("rank {rank} is out of range (the plan has {ranks} ranks)")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// Ranks in the plan.
        ranks: usize,
    },
    /// A CUDA call failed (feature `cuda`).
    #[error("{op}: CUDA error: {msg}")]
    Cuda {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        msg: String,
    },
}

/// Marks a send position that belongs to no row (never produced for valid input).
pub const NO_POSITION: u32 = u32::MAX;

fn to_u32(what: &'static str, value: u64) -> Result<u32, KernelError> {
    u32::try_from(value)
        .ok()
        .filter(|&v| v != NO_POSITION)
        .ok_or(KernelError::TooLarge { what, value })
}

/// The per-source-rank tables the position kernel reads, built from a [`DispatchPlan`]:
/// small (`E·(R+1) + R·E` words), uploaded once per step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchTables {
    /// Number of experts `E`.
    pub experts: usize,
    /// Number of ranks `R`.
    pub ranks: usize,
    /// `dst_prefix[e * (R + 1) + j] = Σ_{j' < j} D[src][e][j']`; the last entry of each row is
    /// `T[e][src]`.
    pub dst_prefix: Vec<u32>,
    /// `send_offsets[j * E + e]`: start of block `(j, e)` in the send buffer
    /// ([`DispatchPlan::send_offsets`], flattened).
    pub send_offsets: Vec<u32>,
    /// Rows of the send buffer (`Σ_dst send_counts[src][dst]`).
    pub send_rows: usize,
}

impl DispatchTables {
    /// The tables of source rank `src` of `plan`.
    pub fn from_plan(plan: &DispatchPlan, src: usize) -> Result<Self, KernelError> {
        let (e_n, r_n) = (plan.experts, plan.ranks);
        if src >= r_n {
            return Err(KernelError::RankOutOfRange {
                rank: src,
                ranks: r_n,
            });
        }
        to_u32("experts", e_n as u64)?;
        to_u32("ranks", r_n as u64)?;
        let mut dst_prefix = Vec::with_capacity(e_n * (r_n + 1));
        for e in 0..e_n {
            let mut run = 0u64;
            dst_prefix.push(0);
            for dst in 0..r_n {
                run += plan.count(src, e, dst);
                dst_prefix.push(to_u32("slots of one expert", run)?);
            }
        }
        let mut send_offsets = Vec::with_capacity(r_n * e_n);
        for row in plan.send_offsets(src) {
            for v in row {
                send_offsets.push(to_u32("send offset", v)?);
            }
        }
        let send_rows: u64 = plan.send_counts[src].iter().sum();
        let send_rows = to_u32("send rows", send_rows)? as usize;
        Ok(Self {
            experts: e_n,
            ranks: r_n,
            dst_prefix,
            send_offsets,
            send_rows,
        })
    }

    /// `T[e][src]`: the slots of expert `e` the plan expects from this rank.
    pub fn expected(&self, e: usize) -> u32 {
        self.dst_prefix[e * (self.ranks + 1) + self.ranks]
    }

    /// Checks per-expert counts against the plan.
    pub fn check_counts(&self, counts: &[u32]) -> Result<(), KernelError> {
        if counts.len() != self.experts {
            return Err(KernelError::Shape(format!(
                "{} expert counts for a plan with {} experts",
                counts.len(),
                self.experts
            )));
        }
        for (e, &c) in counts.iter().enumerate() {
            if c != self.expected(e) {
                return Err(KernelError::CountMismatch {
                    expert: e,
                    expected: u64::from(self.expected(e)),
                    found: u64::from(c),
                });
            }
        }
        Ok(())
    }
}

/// bf16 bits of `x`, rounded to nearest even (NaN stays NaN), as CUDA's `__float2bfloat16_rn`.
pub fn bf16_from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The f32 value of bf16 bits (exact).
pub fn f32_from_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}
