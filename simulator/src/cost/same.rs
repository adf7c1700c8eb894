//! The step cost of a layout whose MoE layers all hold the same replica rows
//! ([`LayerRows::Same`], standard EP) under padded dispatch, in time proportional to the
//! *distinct* EP groups instead of the ranks.
//!
//! Why: `ds-ft` shrinks by one EP group at almost every failure, so every failure is a new
//! layout and a new step cost. At 16,384 nodes (2,048 groups of 64 ranks) the per-rank
//! evaluation of 58 layers took about a second, half of a `ds-ft` replay.
//!
//! What makes it exact: under padded dispatch a rank's traffic depends only on its group
//! (the group's capacity, its members' slot counts and which of them share a node); groups
//! whose members look alike get the same per-rank values, so the maxima over ranks are the
//! maxima over one representative of each kind. Every value is computed by the same
//! expressions, in the same order, as [`super::padded_layer`] and
//! [`super::grad_allreduce_s`] compute it for each rank, so the result is the same bit for bit
//! (tested against the per-layer path on random layouts).

use super::{
    HardwareProfile, LayerRows, ModelProfile, Result, StepCost, assemble, check_partition,
    check_sparse_row, routed_tokens,
};
use std::collections::HashMap;

/// [`super::step_cost_sparse`] of padded dispatch on `layers` copies of `rows`; `None` when
/// this path does not apply (a host-cores profile, whose sum over ranks it does not form) or
/// when the input has an error, which the general path then reports as it always did.
pub(super) fn padded_same(
    hw: &HardwareProfile,
    model: &ModelProfile,
    gpus: usize,
    rows: &[Vec<(u32, u32)>],
    layers: usize,
    loads: &[Vec<u64>],
    groups: &[Vec<usize>],
) -> Option<Result<StepCost>> {
    if hw.host_cores.is_some() || rows.len() != model.experts {
        return None;
    }
    if loads.iter().any(|l| l.len() != model.experts) {
        return None;
    }
    for (e, row) in rows.iter().enumerate() {
        check_sparse_row(gpus, 0, e, row).ok()?;
    }
    check_partition(groups, gpus).ok()?;
    let shape = GroupShapes::new(hw, gpus, rows, groups);
    let (inter_bw, intra_bw) = (hw.rank_inter_bandwidth(), hw.rank_intra_bandwidth());
    let mut terms = Vec::with_capacity(layers);
    let mut capacity = vec![0u64; shape.class_k.len()];
    for layer_loads in loads.iter().take(layers) {
        let t = routed_tokens(layer_loads, model.assignments_per_gpu()).ok()?;
        capacity.fill(0);
        for (k, cap) in shape.class_k.iter().zip(&mut capacity) {
            for (&te, &kg) in t.iter().zip(k) {
                if te == 0 {
                    continue;
                }
                if kg == 0 {
                    return None; // an expert without a replica in a group: the general error
                }
                *cap = (*cap).max(te.div_ceil(kg));
            }
        }
        let (mut max_processed, mut max_link) = (0.0f64, 0.0f64);
        for &(gi, class) in &shape.representatives {
            let group = &groups[gi];
            let c = capacity[class] as f64;
            let g = group.len() as f64;
            // As `padded_layer`: (node, slots on it, members on it) in first-seen order.
            let mut node_slots: Vec<(usize, f64, f64)> = Vec::new();
            let mut total = 0.0;
            for &p in group {
                let n = hw.node_of(p);
                match node_slots.iter_mut().find(|e| e.0 == n) {
                    Some(e) => {
                        e.1 += shape.slots[p];
                        e.2 += 1.0;
                    }
                    None => node_slots.push((n, shape.slots[p], 1.0)),
                }
                total += shape.slots[p];
            }
            for &r in group {
                let n = hw.node_of(r);
                let &(_, on_node, members) = node_slots
                    .iter()
                    .find(|e| e.0 == n)
                    .expect("every member's node was summed");
                let s = shape.slots[r];
                // `0.0 + x` in the per-rank buffers is `x`: each rank is in one group.
                let processed = g * s * c;
                let sent_intra = (on_node - s) * c;
                let sent_inter = (total - on_node) * c;
                let recv_intra = s * c * (members - 1.0);
                let recv_inter = s * c * (g - members);
                max_processed = max_processed.max(processed);
                let inter = sent_inter.max(recv_inter) / inter_bw;
                let intra = sent_intra.max(recv_intra) / intra_bw;
                max_link = max_link.max(inter.max(intra));
            }
        }
        terms.push(Some(Ok((max_processed, max_link))));
    }
    Some(assemble(
        hw,
        model,
        gpus,
        terms,
        super::grad_allreduce_s(hw, model, gpus, LayerRows::Same { rows, layers }),
    ))
}

/// The layer-independent part of a padded layer on fixed rows.
struct GroupShapes {
    /// Replica slots of each rank (the same in every layer).
    slots: Vec<f64>,
    /// Per class of groups: replicas of each expert in any group of the class.
    class_k: Vec<Vec<u64>>,
    /// One group of each kind (its index and its class): groups of one kind have the same
    /// class and the same members' slots and node sharing, member by member.
    representatives: Vec<(usize, usize)>,
}

impl GroupShapes {
    fn new(
        hw: &HardwareProfile,
        gpus: usize,
        rows: &[Vec<(u32, u32)>],
        groups: &[Vec<usize>],
    ) -> Self {
        let mut group_of = vec![0usize; gpus];
        for (gi, group) in groups.iter().enumerate() {
            for &r in group {
                group_of[r] = gi;
            }
        }
        let mut slots = vec![0.0f64; gpus];
        let ng = groups.len();
        // `[group][expert]` replica counts.
        let mut k = vec![0u64; ng * rows.len()];
        for (e, row) in rows.iter().enumerate() {
            for &(r, c) in row {
                slots[r as usize] += f64::from(c);
                k[group_of[r as usize] * rows.len() + e] += u64::from(c);
            }
        }
        let mut class_of: HashMap<&[u64], usize> = HashMap::new();
        let mut class_k: Vec<Vec<u64>> = Vec::new();
        let mut kinds: HashMap<(usize, Vec<(u64, usize)>), ()> = HashMap::new();
        let mut representatives = Vec::new();
        for (gi, group) in groups.iter().enumerate() {
            let column = &k[gi * rows.len()..(gi + 1) * rows.len()];
            let class = *class_of.entry(column).or_insert_with(|| {
                class_k.push(column.to_vec());
                class_k.len() - 1
            });
            // Each member's slots (bits) and the first-seen index of its node in the group.
            let mut nodes: Vec<usize> = Vec::new();
            let members: Vec<(u64, usize)> = group
                .iter()
                .map(|&p| {
                    let n = hw.node_of(p);
                    let local = nodes.iter().position(|&m| m == n).unwrap_or_else(|| {
                        nodes.push(n);
                        nodes.len() - 1
                    });
                    (slots[p].to_bits(), local)
                })
                .collect();
            if kinds.insert((class, members), ()).is_none() {
                representatives.push((gi, class));
            }
        }
        GroupShapes {
            slots,
            class_k,
            representatives,
        }
    }
}

/// [`super::grad_allreduce_s`] of `layers` copies of `rows`: each rank receives the same
/// sequence of additions in every layer, so ranks whose one-layer sequences are equal end
/// with equal sums; each distinct sequence is summed once, `layers` times over, in the order
/// the per-row loop adds it.
pub(super) fn grad_allreduce_same(
    hw: &HardwareProfile,
    gpus: usize,
    init: (f64, f64),
    rows: &[Vec<(u32, u32)>],
    layers: usize,
    ring: impl Fn(usize) -> f64,
) -> f64 {
    // One layer's additions per rank: (to the inter-node sum?, value bits), in row order.
    let mut count = vec![0usize; gpus + 1];
    for row in rows.iter().filter(|r| r.len() >= 2) {
        for &(j, _) in row {
            count[j as usize + 1] += 1;
        }
    }
    for j in 0..gpus {
        count[j + 1] += count[j];
    }
    let mut fill = count.clone();
    let mut adds = vec![(false, 0u64); count[gpus]];
    for row in rows.iter().filter(|r| r.len() >= 2) {
        let m = row.len();
        let v = ring(m);
        let spans = hw.node_of(row[0].0 as usize) != hw.node_of(row[m - 1].0 as usize);
        for &(j, _) in row {
            adds[fill[j as usize]] = (spans, v.to_bits());
            fill[j as usize] += 1;
        }
    }
    let (inter_bw, intra_bw) = (hw.rank_inter_bandwidth(), hw.rank_intra_bandwidth());
    let mut done: HashMap<&[(bool, u64)], f64> = HashMap::new();
    let mut most = 0.0f64;
    for j in 0..gpus {
        let seq = &adds[count[j]..count[j + 1]];
        let value = *done.entry(seq).or_insert_with(|| {
            let (mut inter, mut intra) = init;
            for _ in 0..layers {
                for &(spans, v) in seq {
                    let v = f64::from_bits(v);
                    if spans {
                        inter += v;
                    } else {
                        intra += v;
                    }
                }
            }
            (inter / inter_bw).max(intra / intra_bw)
        });
        most = most.max(value);
    }
    most
}
