//! The collectives of FSEP mode (see the [runtime docs](super)): materialising a layer's
//! experts from their shards, returning gradient shards to their owners summed over the
//! replicas, and gathering whole experts for a checkpoint. Each is one `all_to_all_v`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::{Result, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::comm::{Communicator, Rank};
use crate::model::{ExpertState, ExpertWeights, ShardState, ShardStore, assemble};

/// A rank's shards, shared by the worker's state (they outlive an epoch's mesh: a re-layout
/// at a step boundary keeps them) and the epoch's [`super::DistributedExperts`].
pub type SharedShards = Arc<Mutex<ShardStore>>;

/// Expert gradients `(dL/dw1, dL/dw2)` by `(layer, expert)`.
pub(super) type ExpertGrads = BTreeMap<(usize, usize), (Tensor, Tensor)>;

/// FSEP: summed gradient shards (1-D) by `(layer, expert, shard)`.
pub type ShardGrads = BTreeMap<(usize, usize, usize), Tensor>;

/// A communicator (or other library) error as a candle error, without the backtrace
/// `candle_core::Error::wrap` captures when `RUST_BACKTRACE` is set: capturing one walks the
/// stack on every failed collective, and displaying it resolves symbols (the first time in a
/// process, seconds of reading debug information: `worker::managed::error_text`).
pub(super) fn wrap<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    candle_core::Error::Wrapped(Box::new(e))
}

/// Bytes this rank sent to other ranks, by purpose (what stays on the rank is not counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    /// Routed activations and their gradients (forward and backward token exchanges).
    pub token_bytes: u64,
    /// Expert weights: FSEP's shard all-to-all before each layer (zero when replicated).
    pub expert_param_bytes: u64,
    /// Expert gradients: the all-reduce over replicas, or FSEP's reduce-scatter to owners.
    pub expert_grad_bytes: u64,
}

impl Traffic {
    pub fn total(&self) -> u64 {
        self.token_bytes + self.expert_param_bytes + self.expert_grad_bytes
    }
}

/// f32 bytes of `send` that leave rank `me`.
pub(super) fn bytes_to_others(send: &[Vec<f32>], me: Rank) -> u64 {
    send.iter()
        .enumerate()
        .filter(|(r, _)| *r != me)
        .map(|(_, v)| 4 * v.len() as u64)
        .sum()
}

/// Builds the experts of `layer` that `reps_l[expert][rank]` assigns to this rank from the
/// shards: the primary holder of each shard ([`ShardStore::primary`]) sends its copy of that
/// shard of every expert a peer computes to that peer (ascending expert, then shard), and each
/// rank concatenates shards `0..S` of its experts. The weights are fresh `Var`s, so backward
/// through them yields their gradients. Returns the materialised experts and the bytes sent
/// to other ranks.
pub(super) fn materialise(
    comm: &mut dyn Communicator,
    shards: &ShardStore,
    layer: usize,
    reps_l: &[Vec<u32>],
) -> Result<(BTreeMap<usize, ExpertWeights>, u64)> {
    let (me, world) = (comm.rank(), comm.world());
    let served: Vec<usize> = (0..shards.count())
        .filter(|&w| shards.primary(w) == me)
        .collect();
    let mut send = vec![Vec::new(); world];
    for (e, row) in reps_l.iter().enumerate() {
        if row.iter().all(|&n| n == 0) || served.is_empty() {
            continue;
        }
        let mine = served
            .iter()
            .map(|&w| shards.values(w, layer, e))
            .collect::<Result<Vec<_>>>()?;
        for (r, buf) in send.iter_mut().enumerate() {
            if row.get(r).copied().unwrap_or(0) > 0 {
                mine.iter().for_each(|v| buf.extend_from_slice(v));
            }
        }
    }
    let bytes = bytes_to_others(&send, me);
    let recv = comm.all_to_all_v(send).map_err(wrap)?;
    let (d, f) = (shards.d_model(), shards.d_ff());
    let mut pos = vec![0usize; world];
    let mut out = BTreeMap::new();
    for (e, row) in reps_l.iter().enumerate() {
        if row[me] == 0 {
            continue;
        }
        let mut p = Vec::with_capacity(shards.expert_len());
        for w in 0..shards.count() {
            let src = shards.primary(w);
            let n = shards.range(w).len();
            let Some(part) = recv.get(src).and_then(|b| b.get(pos[src]..pos[src] + n)) else {
                candle_core::bail!("layer {layer}: rank {src} sent too few shard values");
            };
            p.extend_from_slice(part);
            pos[src] += n;
        }
        let dev = shards.device();
        let c = shards.w1_cols();
        let w1 = Var::from_tensor(&Tensor::from_slice(&p[..d * c], (d, c), dev)?)?;
        let w2 = Var::from_tensor(&Tensor::from_slice(&p[d * c..], (f, d), dev)?)?;
        out.insert(
            e,
            ExpertWeights {
                w1: w1.as_tensor().clone(),
                w2: w2.as_tensor().clone(),
                compute: shards.compute(),
            },
        );
    }
    if pos.iter().zip(&recv).any(|(p, b)| *p != b.len()) {
        candle_core::bail!("layer {layer}: unexpected shard values arrived");
    }
    Ok((out, bytes))
}

/// The reverse of [`materialise`] for gradients: for every `(layer, expert)` in `keys`
/// (ascending), every rank the layout assigns the expert to sends shard `w` of its local
/// gradient (zeros if it computed nothing) to **every holder** of shard `w`; each holder sums
/// what it received in ascending rank order — the left fold of
/// [`Communicator::all_reduce_sum`], so the result is bit-identical to the slice of the
/// replicated all-reduce, and identical on every copy of the shard (which is what keeps the
/// copies equal: each applies the same AdamW update to the same state). With `f` copies the
/// gradient bytes are `f` times LAER's. Returns this rank's copy of every summed gradient
/// shard by `(layer, expert, shard)` (1-D), and the bytes sent to other ranks.
pub(super) fn reduce_scatter(
    comm: &mut dyn Communicator,
    shards: &ShardStore,
    replicas: &[Vec<Vec<u32>>],
    keys: &[(usize, usize)],
    local: &ExpertGrads,
) -> Result<(ShardGrads, u64)> {
    let (me, world) = (comm.rank(), comm.world());
    let len = shards.expert_len();
    let mut send = vec![Vec::new(); world];
    for &(l, e) in keys {
        if replicas[l][e][me] == 0 {
            continue;
        }
        let g = match local.get(&(l, e)) {
            Some((g1, g2)) => {
                let mut g = g1.flatten_all()?.to_vec1::<f32>()?;
                g.extend(g2.flatten_all()?.to_vec1::<f32>()?);
                g
            }
            None => vec![0f32; len],
        };
        if g.len() != len {
            candle_core::bail!(
                "gradient of ({l}, {e}) has {} values, expected {len}",
                g.len()
            );
        }
        for (w, holders) in shards.holders().iter().enumerate() {
            for &h in holders {
                send[h].extend_from_slice(&g[shards.range(w)]);
            }
        }
    }
    let bytes = bytes_to_others(&send, me);
    let recv = comm.all_to_all_v(send).map_err(wrap)?;
    let held = shards.held_shards();
    let mut pos = vec![0usize; world];
    let mut out = BTreeMap::new();
    for &(l, e) in keys {
        for &w in &held {
            let n = shards.range(w).len();
            let mut acc: Option<Vec<f32>> = None;
            for (h, buf) in recv.iter().enumerate() {
                if replicas[l][e][h] == 0 {
                    continue;
                }
                let Some(part) = buf.get(pos[h]..pos[h] + n) else {
                    candle_core::bail!("gradient of ({l}, {e}): rank {h} sent too few values");
                };
                pos[h] += n;
                match &mut acc {
                    None => acc = Some(part.to_vec()),
                    Some(a) => a.iter_mut().zip(part).for_each(|(x, y)| *x += *y),
                }
            }
            let Some(g) = acc else {
                candle_core::bail!("expert ({l}, {e}) has tokens but no rank computes it");
            };
            out.insert((l, e, w), Tensor::from_vec(g, n, shards.device())?);
        }
    }
    if pos.iter().zip(&recv).any(|(p, b)| *p != b.len()) {
        candle_core::bail!("unexpected gradient values arrived");
    }
    Ok((out, bytes))
}

/// Whole expert states (weights, moments, step) for the `(layer, expert)` pairs `writers`
/// gives this rank, assembled from the primary copy of every shard (one all-to-all; every
/// rank must call it with the same `writers`). Ascending `(layer, expert)`.
pub fn gather_experts(
    comm: &mut dyn Communicator,
    shards: &ShardStore,
    writers: &BTreeMap<(usize, usize), Rank>,
) -> Result<Vec<ExpertState>> {
    let (me, world) = (comm.rank(), comm.world());
    let served: Vec<usize> = (0..shards.count())
        .filter(|&w| shards.primary(w) == me)
        .collect();
    let mut send = vec![Vec::new(); world];
    for (&(l, e), &to) in writers {
        if to >= world {
            candle_core::bail!("writer rank {to} of ({l}, {e}) outside world {world}");
        }
        for &w in &served {
            send[to].extend(shards.export(w, l, e)?.to_words());
        }
    }
    let recv = comm.all_to_all_v(send).map_err(wrap)?;
    let mut pos = vec![0usize; world];
    let mut out = Vec::new();
    for (&(l, e), &to) in writers {
        if to != me {
            continue;
        }
        let mut parts = Vec::with_capacity(shards.count());
        for w in 0..shards.count() {
            let src = shards.primary(w);
            let n = shards.range(w).len();
            let words = 2 + 3 * n;
            let Some(chunk) = recv
                .get(src)
                .and_then(|b| b.get(pos[src]..pos[src] + words))
            else {
                candle_core::bail!("({l}, {e}): rank {src} sent too few shard words");
            };
            pos[src] += words;
            parts.push(ShardState::from_words(w, l, e, n, chunk)?);
        }
        out.push(assemble(shards.d_model(), shards.d_ff(), &parts)?);
    }
    Ok(out)
}
