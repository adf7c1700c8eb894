//! A worker's training state, its one atomic training step, and its checkpoint parts.

use anyhow::{Context, Result, anyhow};
use candle_core::{Device, Tensor};

use super::protocol::CheckpointSpec;
use crate::checkpoint;
use crate::model::{
    AdamW, DenseModel, ExpertState, ExpertStore, MoeConfig, OptimState, RoutingStats,
};
use crate::runtime::DistributedExperts;

/// A worker's training state.
pub(super) struct State {
    pub cfg: MoeConfig,
    pub dev: Device,
    pub model: DenseModel,
    pub opt: AdamW,
    pub store: ExpertStore,
}

impl State {
    /// The model as initialised from the config's seed (every worker the same values).
    pub fn fresh(cfg: &MoeConfig) -> Result<Self> {
        let dev = Device::Cpu;
        let model = DenseModel::new(cfg, &dev).context("building the dense model")?;
        let opt = model.optimizer()?;
        let store = ExpertStore::empty(cfg, &dev);
        Ok(Self {
            cfg: cfg.clone(),
            dev,
            model,
            opt,
            store,
        })
    }
}

/// State before the last optimizer update (to roll one step back).
pub struct Snapshot {
    dense: OptimState,
    experts: Vec<ExpertState>,
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
        })
    }

    pub fn restore(&self, opt: &mut AdamW, store: &mut ExpertStore) -> Result<()> {
        opt.import(&self.dense)?;
        for s in &self.experts {
            store.import(s)?;
        }
        Ok(())
    }
}

/// One distributed training step — the only one, for managed and stand-alone workers — that
/// applies nothing unless every collective of the step succeeded (see the
/// [worker docs](super)): forward through `experts`, backward (which runs the backward
/// exchanges), dense gradients summed over all ranks and expert gradients over each expert's
/// replicas, then a one-value all-reduce that is both the barrier and the pause vote; only
/// then the optimizer updates. `pause` is this worker's vote to pause after the
/// step. Returns the loss, the routing counts, the pre-update snapshot and whether any member
/// voted to pause.
pub fn train_step(
    model: &DenseModel,
    dense_opt: &mut AdamW,
    store: &mut ExpertStore,
    experts: &mut DistributedExperts,
    tokens: &Tensor,
    pause: bool,
) -> Result<(f32, RoutingStats, Snapshot, bool)> {
    experts.begin_step()?;
    let mut stats = RoutingStats::default();
    let loss = model.loss(tokens, experts, &mut stats)?;
    let grads = loss.backward()?;
    let dense = experts.all_reduce_dense(model, &grads)?;
    let expert_grads = experts.reduce_expert_grads()?;
    // The last collective: a barrier that also carries the pause votes.
    let votes = experts.with_comm(|c| {
        let all: Vec<usize> = (0..c.world()).collect();
        let mut v = [f32::from(u8::from(pause))];
        c.all_reduce_sum(&all, &mut v).map(|()| v[0])
    })??;
    let loss = loss.to_scalar::<f32>()?;
    let snap = Snapshot::take(dense_opt, store)?;
    dense_opt.step_with(&dense)?;
    for ((l, e), (g1, g2)) in expert_grads {
        store.step_replica(l, e, &g1, &g2)?;
    }
    Ok((loss, stats, snap, votes > 0.0))
}

/// Writes this worker's parts of the checkpoint after `step` completed steps.
pub(super) fn write_checkpoint(
    spec: &CheckpointSpec,
    step: u64,
    st: &State,
    replicas: &[Vec<Vec<u32>>],
    rank: usize,
) -> Result<Vec<checkpoint::PartInfo>> {
    let mut parts = Vec::new();
    for part in checkpoint::parts_to_write(replicas, rank) {
        let bytes = match part {
            checkpoint::Part::Dense => checkpoint::encode_dense(&st.opt.export()?),
            checkpoint::Part::Expert { layer, expert } => {
                checkpoint::encode_expert(&st.store.export(layer, expert)?)
            }
        };
        let name = part.name();
        parts.push(
            checkpoint::write_part(&spec.root, step, &name, &bytes)
                .map_err(|e| anyhow!("writing checkpoint part {name}: {e}"))?,
        );
    }
    Ok(parts)
}
