//! Single-worker training loop: every expert local, dense AdamW plus one AdamW per replica.
//!
//! The distributed runtime composes the same pieces itself ([`DenseModel::loss`] with its own
//! [`super::ExpertExec`], `backward`, gradient all-reduce, the same [`grad_scale`] of the same
//! [`grad_norm_parts`], [`apply_update`]); this loop is the reference it must reproduce on one
//! worker.

use super::config::MoeConfig;
use super::data::Corpus;
use super::dense::{DenseModel, RoutingStats};
use super::experts::{ExpertStore, LocalExperts};
use super::optim::{AdamW, OptimState, grad_scale, sq_norm};
use candle_core::{Device, Result, Tensor};
use std::collections::BTreeMap;

/// The squared L2 norms of a step's gradient in the parts [`grad_scale`] adds: the dense
/// gradient, then each expert's `(w1, w2)` in ascending `(layer, expert)` order. A distributed
/// step contributes the same parts from the ranks that own them, so one worker's run computes
/// the same norm here as in [`crate::worker::train_step`].
pub fn grad_norm_parts(
    dense: &[Option<Tensor>],
    experts: &BTreeMap<(usize, usize), (Tensor, Tensor)>,
) -> Result<Vec<f32>> {
    let mut parts = Vec::with_capacity(1 + experts.len());
    parts.push(sq_norm(dense.iter().flatten())?);
    for (g1, g2) in experts.values() {
        parts.push(sq_norm([g1, g2])?);
    }
    Ok(parts)
}

/// The optimizer updates of one step: the dense AdamW with `dense` and every expert replica in
/// `experts` with its gradients, all multiplied by `factor` (from [`grad_scale`]).
pub fn apply_update(
    dense_opt: &mut AdamW,
    store: &mut ExpertStore,
    dense: &[Option<Tensor>],
    experts: BTreeMap<(usize, usize), (Tensor, Tensor)>,
    factor: f64,
) -> Result<()> {
    // The factor is applied inside the updates (the bits of `scale_grad`, no scaled copies).
    dense_opt.step_scaled(dense, factor)?;
    for ((l, e), (g1, g2)) in experts {
        store.step_replica_scaled(l, e, &g1, &g2, factor)?;
    }
    Ok(())
}

/// What one training step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Index of the step (0-based; the batch was drawn for this step).
    pub step: u64,
    /// The optimised loss: `ce_loss + lb_loss_coef · lb_loss`.
    pub loss: f32,
    pub ce_loss: f32,
    /// Mean over layers of the unweighted load-balancing loss.
    pub lb_loss: f32,
    /// `[layer][expert]` tokens routed this step.
    pub counts: Vec<Vec<u64>>,
}

/// A complete model on one worker with its optimizers and data.
#[derive(Debug)]
pub struct Trainer {
    pub model: DenseModel,
    pub experts: ExpertStore,
    dense_opt: AdamW,
    corpus: Corpus,
    step: u64,
}

impl Trainer {
    /// CPU, the embedded corpus, one replica of every expert.
    pub fn new(cfg: &MoeConfig) -> Result<Self> {
        Self::with_corpus(cfg, Corpus::embedded(), &Device::Cpu)
    }

    pub fn with_corpus(cfg: &MoeConfig, corpus: Corpus, device: &Device) -> Result<Self> {
        if corpus.len() < cfg.seq_len + 1 {
            candle_core::bail!(
                "corpus of {} tokens is shorter than a window of seq_len + 1 = {}",
                corpus.len(),
                cfg.seq_len + 1
            );
        }
        if let Some(&t) = corpus.tokens().iter().find(|&&t| t as usize >= cfg.vocab) {
            candle_core::bail!("corpus token {t} outside vocab {}", cfg.vocab);
        }
        let model = DenseModel::new(cfg, device)?;
        let experts = ExpertStore::all(cfg, device)?;
        let dense_opt = model.optimizer()?;
        Ok(Self {
            model,
            experts,
            dense_opt,
            corpus,
            step: 0,
        })
    }

    /// Steps taken so far (= index of the next step).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    pub fn dense_optimizer(&self) -> &AdamW {
        &self.dense_opt
    }

    /// The batch of step `step`: `[batch, seq_len + 1]`, shard 0.
    pub fn batch(&self, step: u64) -> Result<Tensor> {
        let c = self.model.config();
        self.corpus
            .batch(c.seed, step, 0, c.batch, c.seq_len + 1, self.model.device())
    }

    /// Forward, backward and both optimizers on the next batch.
    pub fn step(&mut self) -> Result<StepReport> {
        let tokens = self.batch(self.step)?;
        let mut stats = RoutingStats::default();
        let loss = self
            .model
            .loss(&tokens, &mut LocalExperts(&self.experts), &mut stats)?;
        let grads = loss.backward()?;
        // Detached gradients and no loss or gradient store kept: the forward graph (every
        // activation of the step) is freed before the optimizer allocates its temporaries.
        let dense: Vec<Option<Tensor>> = self
            .model
            .named_vars()
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).map(Tensor::detach))
            .collect();
        let experts = self.experts.gradients(&grads)?;
        let loss = loss.to_scalar::<f32>()?;
        drop(grads);
        let factor = grad_scale(
            1,
            &grad_norm_parts(&dense, &experts)?,
            self.model.config().grad_clip_norm,
        );
        apply_update(
            &mut self.dense_opt,
            &mut self.experts,
            &dense,
            experts,
            factor,
        )?;
        self.model.update_routing_bias(&stats.counts)?;
        let layers = stats.lb_loss.len().max(1) as f32;
        let report = StepReport {
            step: self.step,
            loss,
            ce_loss: stats.ce_loss,
            lb_loss: stats.lb_loss.iter().sum::<f32>() / layers,
            counts: stats.counts,
        };
        self.step += 1;
        Ok(report)
    }

    /// Dense weights, moments and step (for a worker that joins mid-run).
    pub fn export_dense(&self) -> Result<OptimState> {
        self.dense_opt.export()
    }

    pub fn import_dense(&mut self, state: &OptimState) -> Result<()> {
        self.dense_opt.import(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimizer state a step leaves behind holds no autograd graph (which would keep the
    /// step's activations and gradients, and every earlier step's, alive: the GPT-S-shaped
    /// step's memory blow-up).
    #[test]
    fn a_step_leaves_no_graph_in_the_optimizer() -> Result<()> {
        let mut t = Trainer::new(&MoeConfig::tiny())?;
        for _ in 0..2 {
            t.step()?;
        }
        let opt = t.dense_optimizer();
        let names: Vec<String> = opt.names().map(str::to_owned).collect();
        assert!(!names.is_empty());
        for name in &names {
            let (m, v) = opt.moments(name).expect("named slot");
            assert!(
                !m.track_op() && !v.track_op(),
                "{name}: a moment holds a graph"
            );
        }
        Ok(())
    }
}
