//! A worker's training state, its one atomic training step, and its checkpoint parts.

use std::collections::BTreeMap;

use anyhow::{Context, Result, anyhow};
use candle_core::{Device, Tensor};

use super::protocol::CheckpointSpec;
use crate::checkpoint;
use crate::model::fingerprint;
use crate::model::{
    AdamW, DenseModel, ExpertMode, ExpertState, ExpertStore, MoeConfig, OptimState, RoutingStats,
    ShardState, ShardStore, apply_update, grad_scale, sq_norm,
};
use crate::runtime::{DistributedExperts, ShardGrads, SharedShards};
use lazarus_planner::job::StateChecksums;

/// A worker's training state.
pub(super) struct State {
    pub cfg: MoeConfig,
    pub dev: Device,
    pub model: DenseModel,
    pub opt: AdamW,
    /// Replicated mode: the held replicas (empty in FSEP mode).
    pub store: ExpertStore,
    pub mode: ExpertMode,
    /// FSEP mode: this rank's shard copies of every expert, once a reconfiguration made them
    /// (they stay across a re-layout, and across an in-place repair that adds copies).
    pub shards: Option<SharedShards>,
}

impl State {
    /// The model as initialised from the config's seed (every worker the same values).
    pub fn fresh(cfg: &MoeConfig) -> Result<Self> {
        let dev = crate::device::worker_device()?;
        let model = DenseModel::new(cfg, &dev).context("building the dense model")?;
        let opt = model.optimizer()?;
        let store = ExpertStore::empty(cfg, &dev);
        Ok(Self {
            cfg: cfg.clone(),
            dev,
            model,
            opt,
            store,
            mode: ExpertMode::Replicated,
            shards: None,
        })
    }

    /// The same state for a job whose experts are stored as `mode` says.
    pub fn with_mode(mut self, mode: ExpertMode) -> Self {
        self.mode = mode;
        self
    }
}

/// Fingerprints of everything `st` holds (issue 33, item 2): the dense state with its
/// optimizer, every replica and every FSEP shard copy ([`fingerprint`]; dense and replicas
/// read in place, shard copies exported). Costs one pass over the state
/// (`results/executor/fingerprints.md`).
pub(super) fn fingerprints(st: &State) -> Result<StateChecksums> {
    let dense = st.opt.fingerprint()?;
    let replicas = st
        .store
        .replicas()
        .into_iter()
        .map(|(l, e)| Ok((l as u32, e as u32, st.store.fingerprint(l, e)?)))
        .collect::<Result<Vec<_>>>()?;
    let shards = match &st.shards {
        None => Vec::new(),
        Some(sh) => {
            let sh = sh
                .lock()
                .map_err(|_| anyhow!("shard store: lock poisoned"))?;
            sh.held_shards()
                .into_iter()
                .map(|w| Ok((w as u32, fingerprint::shard_copy(&sh.export_shard(w)?))))
                .collect::<Result<Vec<_>>>()?
        }
    };
    Ok(StateChecksums {
        dense,
        replicas,
        shards,
    })
}

/// A test failpoint: flips the lowest mantissa bit of the first weight of the first replica
/// (or shard copy) `st` holds, as a silent memory or transfer fault would. Returns what it
/// flipped.
pub(super) fn flip_one_bit(st: &mut State) -> Result<String> {
    if let Some((l, e)) = st.store.replicas().first().copied() {
        let mut s = st.store.export(l, e)?;
        s.w1[0] = f32::from_bits(s.w1[0].to_bits() ^ 1);
        st.store.import(&s)?;
        return Ok(format!("expert {e} of layer {l}"));
    }
    if let Some(sh) = &st.shards {
        let mut sh = sh
            .lock()
            .map_err(|_| anyhow!("shard store: lock poisoned"))?;
        if let Some(w) = sh.held_shards().first().copied() {
            let mut s = sh.export(w, 0, 0)?;
            s.value[0] = f32::from_bits(s.value[0].to_bits() ^ 1);
            sh.import(&s)?;
            return Ok(format!("shard {w}"));
        }
    }
    Err(anyhow!("no replica or shard to flip a bit of"))
}

/// State before the last optimizer update (to roll one step back).
pub struct Snapshot {
    dense: OptimState,
    experts: Vec<ExpertState>,
    /// FSEP: this rank's shard copies (empty when replicated).
    shards: Vec<ShardState>,
}

impl Snapshot {
    pub fn take(opt: &AdamW, store: &ExpertStore) -> Result<Self> {
        Ok(Self {
            dense: opt.export()?,
            experts: store
                .replicas()
                .into_iter()
                .map(|(l, e)| store.export(l, e))
                .collect::<candle_core::Result<_>>()?,
            shards: Vec::new(),
        })
    }

    /// [`Self::take`] plus this rank's FSEP shards.
    pub fn take_sharded(opt: &AdamW, store: &ExpertStore, shards: &ShardStore) -> Result<Self> {
        let mut s = Self::take(opt, store)?;
        s.shards = shards.export_all()?;
        Ok(s)
    }

    /// Puts the FSEP shards of the snapshot back (nothing when it has none).
    pub fn restore_shards(&self, shards: &SharedShards) -> Result<()> {
        if self.shards.is_empty() {
            return Ok(());
        }
        let mut sh = shards
            .lock()
            .map_err(|_| anyhow!("shard store: lock poisoned"))?;
        for s in &self.shards {
            sh.import(s)?;
        }
        Ok(())
    }

    /// [`Self::restore`], then drops the replicas the snapshot does not have: a replica
    /// migration's switch after the snapshot added them, at a later state than the one
    /// rolled back to.
    pub fn restore_exact(&self, opt: &mut AdamW, store: &mut ExpertStore) -> Result<()> {
        self.restore(opt, store)?;
        for (l, e) in store.replicas() {
            if !self.experts.iter().any(|s| (s.layer, s.expert) == (l, e)) {
                store.remove(l, e);
            }
        }
        Ok(())
    }

    /// [`Self::restore_exact`] and [`Self::restore_shards`] on a worker's whole state.
    pub(super) fn restore_state(&self, st: &mut State) -> Result<()> {
        self.restore_exact(&mut st.opt, &mut st.store)?;
        if let Some(sh) = &st.shards {
            self.restore_shards(sh)?;
        }
        Ok(())
    }

    pub fn restore(&self, opt: &mut AdamW, store: &mut ExpertStore) -> Result<()> {
        opt.import(&self.dense)?;
        for s in &self.experts {
            store.import(s)?;
        }
        Ok(())
    }
}

/// What one [`train_step`] did.
pub struct TrainedStep {
    /// This worker's shard loss (NaN or infinite when the step diverged here).
    pub loss: f32,
    pub stats: RoutingStats,
    /// The state before the step's update, to roll one step back.
    pub snapshot: Snapshot,
    /// Some member voted to pause after this step.
    pub pause: bool,
    /// Some member saw a non-finite loss or gradient, so no member applied the update.
    pub nonfinite: bool,
    /// The layout version every member voted, if they all voted the same
    /// ([`train_step_voting`]); the same on every member.
    pub layout_agreed: Option<u64>,
    /// The migration version every member voted ready ([`StepVotes::ready`]), if they all
    /// voted the same.
    pub ready_agreed: Option<u64>,
    /// Replicated re-layout in flight: the reduced, unscaled gradients of the experts this
    /// rank joined without holding them (`DistributedExperts::set_joining`); not applied.
    pub joined: BTreeMap<(usize, usize), (Tensor, Tensor)>,
    /// The factor every gradient of the step was (or would have been) scaled by.
    pub factor: f64,
}

/// What a worker says in a step's barrier besides its gradient norm: pause after the step,
/// the newest layout version it holds, and the version of the replica migration whose every
/// copy it holds (0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepVotes {
    pub pause: bool,
    pub layout: u64,
    pub ready: u64,
}

/// One distributed training step — the only one, for managed and stand-alone workers — that
/// applies nothing unless every collective of the step succeeded (see the
/// [worker docs](super)): forward through `experts`, backward (which runs the backward
/// exchanges), dense gradients summed over all ranks and expert gradients over each expert's
/// replicas, then one small all-reduce that is the barrier and carries the pause vote, the
/// non-finite vote and the parts of the global gradient norm; only then the optimizer
/// updates, with every gradient multiplied by the same [`grad_scale`] factor on every member
/// (the mean over the members, clipped to the config's `grad_clip_norm`). `pause` is this
/// worker's vote to pause after the step.
///
/// # Non-finite steps
/// A worker votes non-finite when its loss, the summed dense gradient or the summed gradient
/// of one of its experts holds a NaN or an infinity. Expert gradients are summed within each
/// expert's replica group only, so no worker sees every gradient: the vote is what makes the
/// decision the same on every member. If any member voted, every member skips the update
/// (weights, moments and optimizer step counters stay as they were, so replicas stay
/// identical and no NaN ever reaches the state); the step still consumed its data. The
/// controller ends the job after too many such steps in a row.
pub fn train_step(
    model: &DenseModel,
    dense_opt: &mut AdamW,
    store: &mut ExpertStore,
    experts: &mut DistributedExperts,
    tokens: &Tensor,
    pause: bool,
) -> Result<TrainedStep> {
    train_step_voting(model, dense_opt, store, experts, tokens, pause, 0)
}

/// Largest layout version the barrier carries exactly (an f32 holds every integer up to
/// 2^24).
pub const MAX_LAYOUT_VERSION: u64 = 1 << 24;

/// [`train_step`] with this worker's layout vote: the newest layout version it holds (the one
/// it trains on, or a [`super::Command::Relayout`] it has staged). The barrier carries one
/// slot per rank, each written by that rank alone (so the sum is exact whatever the order of
/// the additions, and every member reads the same slots); [`TrainedStep::layout_agreed`] is
/// the version when every slot holds the same one. Switching when it equals the staged
/// version makes every member switch at the same step boundary, however late the command
/// reached one of them: if every member voted `u`, every member holds `u`. (Agreement rather
/// than the minimum: a member that staged a newer switch over an older one would otherwise
/// stay behind while the others took the older; the job machine never sends that, and this
/// keeps even that case consistent — nobody switches.)
#[allow(clippy::too_many_arguments)]
pub fn train_step_voting(
    model: &DenseModel,
    dense_opt: &mut AdamW,
    store: &mut ExpertStore,
    experts: &mut DistributedExperts,
    tokens: &Tensor,
    pause: bool,
    layout_vote: u64,
) -> Result<TrainedStep> {
    let votes = StepVotes {
        pause,
        layout: layout_vote,
        ready: 0,
    };
    train_step_votes(model, dense_opt, store, experts, tokens, votes)
}

/// [`train_step_voting`] with every vote, the migration's readiness included: one more slot
/// per rank, agreed the same way as the layout ([`TrainedStep::ready_agreed`]).
pub fn train_step_votes(
    model: &DenseModel,
    dense_opt: &mut AdamW,
    store: &mut ExpertStore,
    experts: &mut DistributedExperts,
    tokens: &Tensor,
    votes: StepVotes,
) -> Result<TrainedStep> {
    let input = StepInput::PerNode(tokens);
    train_step_input(model, dense_opt, store, experts, input, votes)
}

/// What a member trains in one step.
pub enum StepInput<'a> {
    /// Its own batch; the update is the mean over the members (`--batch-per-node`).
    PerNode(&'a Tensor),
    /// Its share of a global batch ([`lazarus_planner::data`]).
    Global(MicroBatches<'a>),
}

/// A member's share of a global batch of `total` micro-batches: `tokens[i]` is micro-batch
/// `first + i` (`[micro, seq_len + 1]`); the member takes part in `rounds ≥ tokens.len()`
/// micro-batch rounds (the same number on every member), the last ones without data.
pub struct MicroBatches<'a> {
    pub tokens: &'a [Tensor],
    pub first: u64,
    pub total: u64,
    pub rounds: u64,
}

/// [`train_step_votes`] for either [`StepInput`]. With a global batch the member runs its
/// micro-batches one round each (forward, backward, gradients accumulated) and
/// [`DistributedExperts::phantom_round`]s after them; the update is the mean over the
/// global batch's micro-batches (`grad_scale(total, …)`), and [`TrainedStep::loss`] is the
/// step's loss: the mean of every micro-batch's loss, which the barrier carries one slot per
/// micro-batch (each written by the one member that trained it, so every member reads the
/// same values and sums them in micro-batch order).
pub fn train_step_input(
    model: &DenseModel,
    dense_opt: &mut AdamW,
    store: &mut ExpertStore,
    experts: &mut DistributedExperts,
    input: StepInput<'_>,
    votes: StepVotes,
) -> Result<TrainedStep> {
    let StepVotes {
        pause,
        layout: layout_vote,
        ready: ready_vote,
    } = votes;
    anyhow::ensure!(
        layout_vote <= MAX_LAYOUT_VERSION && ready_vote <= MAX_LAYOUT_VERSION,
        "layout version {} too large for the step barrier",
        layout_vote.max(ready_vote)
    );
    experts.begin_step()?;
    let (tokens, first, total, rounds): (&[Tensor], u64, u64, u64) = match &input {
        StepInput::PerNode(t) => (std::slice::from_ref(*t), 0, 0, 1),
        StepInput::Global(m) => (m.tokens, m.first, m.total, m.rounds),
    };
    anyhow::ensure!(
        tokens.len() as u64 <= rounds,
        "{} micro-batches in {rounds} rounds",
        tokens.len()
    );
    let vars = model.named_vars();
    let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut stats = RoutingStats::default();
    let mut losses = Vec::with_capacity(tokens.len());
    for round in 0..rounds as usize {
        // A peer is gone (or the controller aborted the step): every round left is wasted
        // compute that delays this member's failure report.
        if experts.with_comm(|c| c.is_aborted())? {
            return Err(crate::comm::CommError::Aborted.into());
        }
        let Some(t) = tokens.get(round) else {
            experts.phantom_round(model.config().d_model)?;
            continue;
        };
        let mut s = RoutingStats::default();
        let loss = model.loss(t, experts, &mut s)?;
        let grads = loss.backward()?;
        for (a, (_, v)) in acc.iter_mut().zip(vars) {
            if let Some(g) = grads.get(v.as_tensor()) {
                // Detached: candle leaves a variable's gradient attached to the forward
                // graph, which would keep every round's activations alive until the update.
                let g = g.detach();
                *a = Some(match a.take() {
                    Some(x) => (x + g)?,
                    None => g,
                });
            }
        }
        losses.push(loss.to_scalar::<f32>()?);
        merge_stats(&mut stats, s, losses.len() - 1);
    }
    let dense = experts.all_reduce_dense_grads(model, acc)?;
    let sharded = experts.is_sharded()?;
    let (mut expert_grads, shard_grads) = if sharded {
        (BTreeMap::new(), experts.reduce_shard_grads()?)
    } else {
        (experts.reduce_expert_grads()?, BTreeMap::new())
    };
    // The experts this rank joined the reduction of without holding them (a migration).
    let joined_keys: Vec<(usize, usize)> = expert_grads
        .keys()
        .filter(|(l, e)| !store.contains(*l, *e))
        .copied()
        .collect();
    let joined: BTreeMap<_, _> = joined_keys
        .into_iter()
        .filter_map(|k| expert_grads.remove_entry(&k))
        .collect();
    let mut finite = losses.iter().all(|l| l.is_finite());
    for g in dense.iter().flatten() {
        finite = finite && all_finite(g)?;
    }
    for (g1, g2) in expert_grads.values().chain(joined.values()) {
        finite = finite && all_finite(g1)? && all_finite(g2)?;
    }
    for g in shard_grads.values() {
        finite = finite && all_finite(g)?;
    }
    // The last collective: a barrier that also carries the pause and non-finite votes and the
    // parts of the global gradient norm.
    let world = experts.world();
    let mut v = vec![f32::from(u8::from(pause)), f32::from(u8::from(!finite))];
    let mut layout = vec![0f32; 2 * world];
    layout[experts.rank()] = layout_vote as f32;
    layout[world + experts.rank()] = ready_vote as f32;
    v.extend(layout);
    // Global batch: one loss slot per micro-batch, written by the member that trained it.
    let mut loss_slots = vec![0f32; total as usize];
    if matches!(input, StepInput::Global(_)) {
        for (i, l) in losses.iter().enumerate() {
            loss_slots[first as usize + i] = *l;
        }
    }
    v.extend(&loss_slots);
    // DeepSeek-V3's routing bias follows the step's global load: each member adds the tokens
    // its micro-batches routed (exact in f32 up to 2^24 per expert and step), so every member
    // reads the same counts and applies the same update.
    let bias_counts = routing_bias_slots(model, &stats);
    v.extend(&bias_counts);
    v.extend(norm_parts(
        model,
        experts,
        &dense,
        &expert_grads,
        &shard_grads,
    )?);
    let votes = experts.with_comm(|c| {
        let all: Vec<usize> = (0..c.world()).collect();
        c.all_reduce_sum(&all, &mut v).map(|()| v)
    })??;
    let nonfinite = votes[1] > 0.0;
    let agreed = |slots: &[f32]| {
        slots
            .iter()
            .all(|&x| x == slots[0])
            .then(|| slots[0] as u64)
    };
    let layout_agreed = agreed(&votes[2..2 + world]);
    let ready_agreed = agreed(&votes[2 + world..2 + 2 * world]);
    let slots = &votes[2 + 2 * world..2 + 2 * world + total as usize];
    let (loss, mean_over) = match input {
        StepInput::PerNode(_) => (losses[0], world),
        // The sum in micro-batch order, whoever trained which.
        StepInput::Global(_) => (
            (slots.iter().map(|&x| f64::from(x)).sum::<f64>() / total as f64) as f32,
            total as usize,
        ),
    };
    let counts_at = 2 + 2 * world + total as usize;
    let global_counts = &votes[counts_at..counts_at + bias_counts.len()];
    let factor = grad_scale(
        mean_over,
        &votes[counts_at + bias_counts.len()..],
        model.config().grad_clip_norm,
    );
    let snapshot = match experts.shard_store()? {
        Some(sh) => {
            let sh = sh
                .lock()
                .map_err(|_| anyhow!("shard store: lock poisoned"))?;
            Snapshot::take_sharded(dense_opt, store, &sh)?
        }
        None => Snapshot::take(dense_opt, store)?,
    };
    if !nonfinite {
        if sharded {
            // FSEP: the dense update here, each expert's on the copies of its shards.
            apply_update(dense_opt, store, &dense, BTreeMap::new(), factor)?;
            experts.step_shards(shard_grads, factor)?;
        } else {
            apply_update(dense_opt, store, &dense, expert_grads, factor)?;
        }
        if !bias_counts.is_empty() {
            let e = model.config().experts;
            let counts: Vec<Vec<u64>> = global_counts
                .chunks(e)
                .map(|c| c.iter().map(|&x| x as u64).collect())
                .collect();
            model.update_routing_bias(&counts)?;
        }
    }
    Ok(TrainedStep {
        loss,
        stats,
        snapshot,
        pause: votes[0] > 0.0,
        nonfinite,
        layout_agreed,
        ready_agreed,
        joined,
        factor,
    })
}

/// Held-out evaluation ([`crate::dataset::EvalSpec`]) after a step's update: the member runs
/// its eval micro-batches forward through `experts` (no gradient is taken, the optimizer and
/// the state are untouched) and [`DistributedExperts::phantom_forward`]s in the rounds it has
/// none, then one all-reduce with one slot per eval micro-batch, each written by the member
/// that computed it: every member reads the same slots and returns the same loss, their mean
/// in micro-batch order. The loss is the cross-entropy alone (`RoutingStats::ce_loss`, what
/// perplexity is `exp` of), without the load-balancing term of the training loss.
///
/// The eval's routed counts and exchange logs land in `experts` after the step's were read;
/// the next step's [`DistributedExperts::begin_step`] clears them.
pub fn eval_step(
    model: &DenseModel,
    experts: &mut DistributedExperts,
    input: MicroBatches<'_>,
) -> Result<f32> {
    let MicroBatches {
        tokens,
        first,
        total,
        rounds,
    } = input;
    anyhow::ensure!(
        tokens.len() as u64 <= rounds && first + tokens.len() as u64 <= total,
        "{} eval micro-batches from {first} in {rounds} rounds of {total}",
        tokens.len()
    );
    let mut slots = vec![0f32; total as usize];
    for round in 0..rounds as usize {
        let Some(t) = tokens.get(round) else {
            experts.phantom_forward(model.config().d_model)?;
            continue;
        };
        let mut s = RoutingStats::default();
        // The training loss's graph is built and dropped: nothing calls `backward()`.
        model.loss(t, experts, &mut s)?;
        slots[first as usize + round] = s.ce_loss;
    }
    let slots = experts.with_comm(|c| {
        let all: Vec<usize> = (0..c.world()).collect();
        c.all_reduce_sum(&all, &mut slots).map(|()| slots)
    })??;
    let sum: f64 = slots.iter().map(|&x| f64::from(x)).sum();
    Ok((sum / total as f64) as f32)
}

/// This member's routed tokens per `(layer, expert)`, layer-major, when the model balances
/// with a routing bias (DeepSeek-V3); empty otherwise. A member without data this step (only
/// phantom rounds) contributes zeros.
fn routing_bias_slots(model: &DenseModel, stats: &RoutingStats) -> Vec<f32> {
    if !model.has_routing_bias() {
        return Vec::new();
    }
    let (layers, e) = (model.config().n_layers, model.config().experts);
    let mut slots = vec![0f32; layers * e];
    for (l, c) in stats.counts.iter().enumerate().take(layers) {
        for (x, &n) in slots[l * e..(l + 1) * e].iter_mut().zip(c) {
            *x = n as f32;
        }
    }
    slots
}

/// Adds a micro-batch's routing statistics to the step's: counts and choices append/add,
/// the losses become the mean over the `merged + 1` micro-batches.
fn merge_stats(into: &mut RoutingStats, s: RoutingStats, merged: usize) {
    let n = merged as f32;
    if into.counts.is_empty() {
        into.counts = s.counts;
    } else {
        for (a, b) in into.counts.iter_mut().zip(&s.counts) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
    }
    if into.lb_loss.is_empty() {
        into.lb_loss = s.lb_loss;
    } else {
        for (a, b) in into.lb_loss.iter_mut().zip(&s.lb_loss) {
            *a = (*a * n + b) / (n + 1.0);
        }
    }
    into.ce_loss = (into.ce_loss * n + s.ce_loss) / (n + 1.0);
    // Token-major per micro-batch: the micro-batches' choices one after the other.
    for (a, b) in into.choices.iter_mut().zip(&s.choices) {
        a.extend(b);
    }
    if into.choices.is_empty() {
        into.choices = s.choices;
    }
}

/// This rank's share of the global gradient norm
/// ([`grad_norm_parts`](crate::model::grad_norm_parts) laid out over the whole
/// model): `[dense, (layer, expert) for every layer and expert]`, each squared norm written by
/// exactly one rank (the dense one by rank 0, an expert's by the lowest rank holding a replica
/// of it; all holders have the same reduced gradient) and zeros elsewhere. Summed over the
/// ranks, every slot holds one exact value, so every member computes the same norm and the
/// same [`grad_scale`] factor. Empty when clipping is off (the norm is not needed).
///
/// FSEP: the shards of each summed expert gradient are spread over the ranks, so the primary
/// holder of each shard (one per shard, whatever the copies) adds the squared norm of its
/// copy into the expert's slot and the sum over ranks is the whole expert's (equal to the
/// replicated value up to the order of the f32 additions).
fn norm_parts(
    model: &DenseModel,
    experts: &DistributedExperts,
    dense: &[Option<Tensor>],
    expert_grads: &BTreeMap<(usize, usize), (Tensor, Tensor)>,
    shard_grads: &ShardGrads,
) -> Result<Vec<f32>> {
    if model.config().grad_clip_norm <= 0.0 {
        return Ok(Vec::new());
    }
    let replicas = experts.replicas();
    let n_experts = model.config().experts;
    let mut parts = vec![0f32; 1 + replicas.len() * n_experts];
    let rank = experts.rank();
    if rank == 0 {
        parts[0] = sq_norm(dense.iter().flatten())?;
    }
    for (&(l, e), (g1, g2)) in expert_grads {
        let owner = replicas[l][e].iter().position(|&n| n > 0);
        if owner == Some(rank) {
            parts[1 + l * n_experts + e] = sq_norm([g1, g2])?;
        }
    }
    if let Some(sh) = experts.shard_store()? {
        let sh = sh
            .lock()
            .map_err(|_| anyhow!("shard store: lock poisoned"))?;
        for (&(l, e, w), g) in shard_grads {
            if sh.primary(w) == rank {
                parts[1 + l * n_experts + e] += sq_norm([g])?;
            }
        }
    }
    Ok(parts)
}

/// Whether every value of `t` is finite. `0·x` is ±0 for a finite `x` and NaN for a NaN or an
/// infinity, so the sum is exactly 0 when all are finite; summing the values themselves could
/// overflow to infinity on large but finite gradients.
pub fn all_finite(t: &Tensor) -> Result<bool> {
    let z = t
        .affine(0.0, 0.0)?
        .sum_all()?
        .to_dtype(candle_core::DType::F32)?;
    Ok(z.to_scalar::<f32>()? == 0.0)
}

/// Writes this worker's parts of the checkpoint after `step` completed steps. A state holding a
/// NaN or an infinity is refused before anything is written: a checkpoint exists to be
/// restored, and restoring it would only bring the divergence back.
///
/// FSEP: `gathered` holds the whole experts this rank writes, assembled from every rank's
/// shards (`DistributedExperts::gather_experts` with [`checkpoint_writers`]).
pub(super) fn write_checkpoint(
    spec: &CheckpointSpec,
    step: u64,
    st: &State,
    replicas: &[Vec<Vec<u32>>],
    rank: usize,
    gathered: &BTreeMap<(usize, usize), ExpertState>,
) -> Result<Vec<checkpoint::PartInfo>> {
    let mut parts = Vec::new();
    for part in checkpoint::parts_to_write(replicas, rank) {
        let name = part.name();
        let bytes = match part {
            checkpoint::Part::Dense => {
                let s = st.opt.export()?;
                checkpoint::check_dense_finite(&s).map_err(|e| anyhow!("{name}: {e}"))?;
                checkpoint::encode_dense(&s)
            }
            checkpoint::Part::Expert { layer, expert } => {
                let s = match (&st.shards, gathered.get(&(layer, expert))) {
                    (None, _) => st.store.export(layer, expert)?,
                    (Some(_), Some(s)) => s.clone(),
                    (Some(_), None) => {
                        return Err(anyhow!(
                            "{name}: the shards of this expert were not gathered"
                        ));
                    }
                };
                checkpoint::check_expert_finite(&s).map_err(|e| anyhow!("{name}: {e}"))?;
                checkpoint::encode_expert(&s)
            }
        };
        parts.push(
            checkpoint::write_part(&spec.root, step, &name, &bytes)
                .map_err(|e| anyhow!("writing checkpoint part {name}: {e}"))?,
        );
    }
    Ok(parts)
}

/// Which rank writes each expert's checkpoint part under `replicas` (for the FSEP gather).
pub(super) fn checkpoint_writers(replicas: &[Vec<Vec<u32>>]) -> BTreeMap<(usize, usize), usize> {
    let world = replicas.first().and_then(|l| l.first()).map_or(0, Vec::len);
    let mut out = BTreeMap::new();
    for rank in 0..world {
        for part in checkpoint::parts_to_write(replicas, rank) {
            if let checkpoint::Part::Expert { layer, expert } = part {
                out.insert((layer, expert), rank);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_finite_finds_nan_and_infinities_without_overflowing() {
        let t = |v: &[f32]| Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap();
        // Their sum would overflow to infinity; they are finite.
        assert!(all_finite(&t(&[3e38, 3e38, -0.0, 1.0])).unwrap());
        assert!(all_finite(&t(&[])).unwrap());
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert!(!all_finite(&t(&[1.0, bad, 2.0])).unwrap(), "{bad}");
        }
    }
}
