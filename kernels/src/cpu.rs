//! CPU references of the dispatch kernels. Plain loops, no floating point except in
//! [`combine`]; they define what `src/dispatch.cu` computes.

use crate::{DispatchTables, KernelError, NO_POSITION, to_u32};

/// Per-expert slot counts (`lz_block_histogram`): `counts[e] = #{s : experts[s] == e}`.
/// These are the `T[e][src]` a rank contributes to the dispatch plan.
pub fn count_experts(experts: &[u32], n_experts: usize) -> Result<Vec<u32>, KernelError> {
    to_u32("slots", experts.len() as u64)?;
    let mut counts = vec![0u32; n_experts];
    for (slot, &e) in experts.iter().enumerate() {
        match counts.get_mut(e as usize) {
            Some(c) => *c += 1,
            None => {
                return Err(KernelError::UnknownExpert {
                    slot,
                    expert: e,
                    experts: n_experts,
                });
            }
        }
    }
    Ok(counts)
}

/// Send-buffer row of every slot (`lz_send_positions`): the `r`-th slot of expert `e` (in order
/// of appearance) goes to the destination `j` with `prefix[j] ≤ r < prefix[j + 1]`, at row
/// `send_offsets[j][e] + r − prefix[j]`. The result is a permutation of
/// `0..tables.send_rows`, the inverse of [`DispatchPlan::send_order`](lazarus_planner::dispatch::DispatchPlan::send_order).
///
/// Errors: an expert id out of range, or counts that disagree with the plan.
pub fn send_positions(experts: &[u32], tables: &DispatchTables) -> Result<Vec<u32>, KernelError> {
    let counts = count_experts(experts, tables.experts)?;
    tables.check_counts(&counts)?;
    let stride = tables.ranks + 1;
    let mut seen = vec![0u32; tables.experts];
    // Current destination of each expert (advances monotonically: ranks are stable).
    let mut dst = vec![0usize; tables.experts];
    let mut pos = Vec::with_capacity(experts.len());
    for &e in experts {
        let e = e as usize;
        let r = seen[e];
        seen[e] += 1;
        let pre = &tables.dst_prefix[e * stride..(e + 1) * stride];
        let j = &mut dst[e];
        while pre[*j + 1] <= r {
            *j += 1;
        }
        pos.push(tables.send_offsets[*j * tables.experts + e] + (r - pre[*j]));
    }
    Ok(pos)
}

/// The gather list of the send buffer: `order[p]` is the slot at row `p` (the inverse of
/// `pos`; rows no slot maps to hold `usize::MAX`). Equals `DispatchPlan::send_order`.
pub fn order_from_positions(pos: &[u32], rows: usize) -> Vec<usize> {
    let mut order = vec![usize::MAX; rows];
    for (slot, &p) in pos.iter().enumerate() {
        if p != NO_POSITION
            && let Some(o) = order.get_mut(p as usize)
        {
            *o = slot;
        }
    }
    order
}

fn check_rows(what: &str, len: usize, rows: usize, row_len: usize) -> Result<(), KernelError> {
    if row_len == 0 || len != rows * row_len {
        return Err(KernelError::Shape(format!(
            "{what} has {len} elements, expected {rows} rows of {row_len} (row length must be > 0)"
        )));
    }
    Ok(())
}

/// The send buffer (`lz_permute_rows_*`): `send[pos[s]] = x[s / top_k]`, rows of `row_len`
/// elements (any element type: the kernels copy bits). `x` holds one row per token,
/// `pos.len() / top_k` tokens.
pub fn permute_rows<T: Copy + Default>(
    x: &[T],
    row_len: usize,
    top_k: usize,
    pos: &[u32],
    send_rows: usize,
) -> Result<Vec<T>, KernelError> {
    if top_k == 0 || !pos.len().is_multiple_of(top_k) {
        return Err(KernelError::Shape(format!(
            "{} slots is not a whole number of tokens with top_k = {top_k}",
            pos.len()
        )));
    }
    check_rows("x", x.len(), pos.len() / top_k, row_len)?;
    let mut send = vec![T::default(); send_rows * row_len];
    for (s, &p) in pos.iter().enumerate() {
        if p == NO_POSITION {
            continue;
        }
        let p = p as usize;
        if p >= send_rows {
            return Err(KernelError::Shape(format!(
                "slot {s} maps to row {p} of a {send_rows}-row send buffer"
            )));
        }
        let t = s / top_k;
        send[p * row_len..(p + 1) * row_len].copy_from_slice(&x[t * row_len..(t + 1) * row_len]);
    }
    Ok(send)
}

/// The un-permute (`lz_unpermute_rows_*`): `out[s] = back[pos[s]]`, rows of `row_len` elements
/// copied bit for bit (any element type). With the positions of a top_k = 1 permutation it is
/// the exact inverse of [`permute_rows`] (`unpermute_rows(permute_rows(x, 1, pos), pos) == x`,
/// `-0.0` and NaN payloads included, which a [`combine`] with weight 1 does not guarantee:
/// `fma(1, -0.0, +0.0) = +0.0`); with top_k > 1 it gives every slot its own row. `back` has the
/// send buffer's layout (whole rows, any number of them: the rows that came back after the
/// return all-to-all); `out` has `rows_out == pos.len()` rows, and the row of a slot whose
/// position is [`NO_POSITION`] is left `T::default()`.
///
/// Errors: `row_len == 0`, `back` not a whole number of rows, `pos.len() != rows_out`, or a
/// position past the end of `back`.
pub fn unpermute_rows<T: Copy + Default>(
    back: &[T],
    row_len: usize,
    pos: &[u32],
    rows_out: usize,
) -> Result<Vec<T>, KernelError> {
    if row_len == 0 || !back.len().is_multiple_of(row_len) {
        return Err(KernelError::Shape(format!(
            "back has {} elements, not a whole number of rows of {row_len} (row length must be > 0)",
            back.len()
        )));
    }
    if pos.len() != rows_out {
        return Err(KernelError::Shape(format!(
            "{} positions for {rows_out} output rows (one position per row)",
            pos.len()
        )));
    }
    let back_rows = back.len() / row_len;
    let mut out = vec![T::default(); rows_out * row_len];
    for (s, &p) in pos.iter().enumerate() {
        if p == NO_POSITION {
            continue;
        }
        let p = p as usize;
        if p >= back_rows {
            return Err(KernelError::Shape(format!(
                "slot {s} maps to row {p} of a {back_rows}-row buffer"
            )));
        }
        out[s * row_len..(s + 1) * row_len].copy_from_slice(&back[p * row_len..(p + 1) * row_len]);
    }
    Ok(out)
}

/// The weighted un-permute (`lz_combine_*`): `out[t][i] = Σ_{j<top_k} w[t·top_k + j] ·
/// back[pos[t·top_k + j]][i]`, accumulated in f32 with fused multiply-adds in ascending `j`
/// (the kernel's order). `back` has the send buffer's layout (the expert outputs after the
/// return all-to-all).
pub fn combine(
    back: &[f32],
    hidden: usize,
    top_k: usize,
    pos: &[u32],
    weights: &[f32],
) -> Result<Vec<f32>, KernelError> {
    combine_with(back, hidden, top_k, pos, weights, |v| v, |v| v)
}

/// [`combine`] on bf16 rows (bits, as `u16`): f32 accumulation, one rounding at the end
/// (`lz_combine_bf16`).
pub fn combine_bf16(
    back: &[u16],
    hidden: usize,
    top_k: usize,
    pos: &[u32],
    weights: &[f32],
) -> Result<Vec<u16>, KernelError> {
    combine_with(
        back,
        hidden,
        top_k,
        pos,
        weights,
        crate::f32_from_bf16,
        crate::bf16_from_f32,
    )
}

fn combine_with<T: Copy>(
    back: &[T],
    hidden: usize,
    top_k: usize,
    pos: &[u32],
    weights: &[f32],
    load: impl Fn(T) -> f32,
    store: impl Fn(f32) -> T,
) -> Result<Vec<T>, KernelError> {
    if top_k == 0 || !pos.len().is_multiple_of(top_k) || weights.len() != pos.len() {
        return Err(KernelError::Shape(format!(
            "{} slots, {} weights, top_k = {top_k}: need one weight per slot and whole tokens",
            pos.len(),
            weights.len()
        )));
    }
    if hidden == 0 || !back.len().is_multiple_of(hidden) {
        return Err(KernelError::Shape(format!(
            "back has {} elements, not a whole number of rows of {hidden}",
            back.len()
        )));
    }
    let rows = back.len() / hidden;
    let tokens = pos.len() / top_k;
    let mut out = Vec::with_capacity(tokens * hidden);
    for t in 0..tokens {
        for i in 0..hidden {
            let mut acc = 0.0f32;
            for j in 0..top_k {
                let s = t * top_k + j;
                let p = pos[s];
                if p == NO_POSITION {
                    continue;
                }
                let p = p as usize;
                if p >= rows {
                    return Err(KernelError::Shape(format!(
                        "slot {s} maps to row {p} of a {rows}-row buffer"
                    )));
                }
                acc = weights[s].mul_add(load(back[p * hidden + i]), acc);
            }
            out.push(store(acc));
        }
    }
    Ok(out)
}
