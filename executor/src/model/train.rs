//! Single-worker training loop: every expert local, dense AdamW plus one AdamW per replica.
//!
//! The distributed runtime composes the same pieces itself ([`DenseModel::loss`] with its own
//! [`super::ExpertExec`], `backward`, gradient all-reduce, [`AdamW::step_with`],
//! [`ExpertStore::step_replica`]); this loop is the reference it must reproduce on one worker.

use super::config::MoeConfig;
use super::data::Corpus;
use super::dense::{DenseModel, RoutingStats};
use super::experts::{ExpertStore, LocalExperts};
use super::optim::{AdamW, OptimState};
use candle_core::{Device, Result, Tensor};

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
        self.dense_opt.step(&grads)?;
        self.experts.step(&grads)?;
        let layers = stats.lb_loss.len().max(1) as f32;
        let report = StepReport {
            step: self.step,
            loss: loss.to_scalar::<f32>()?,
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
