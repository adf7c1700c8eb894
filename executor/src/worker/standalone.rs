//! A stand-alone worker: a fixed cluster given on the command line, no controller, no
//! recovery (see the [worker docs](super)).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use candle_core::Device;
use std::net::SocketAddr;
use std::path::PathBuf;

use super::protocol::{Checksums, StepLine};
use super::state::train_step;
use super::{MAX_NONFINITE_STEPS, bind_with_retry, held_replicas, plan_replicas};
use crate::comm::{MeshSecret, TcpCommunicator};
use crate::model::{Corpus, DenseModel, ExpertStore, MoeConfig};
use crate::runtime::DistributedExperts;

/// What a worker is asked to do.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub rank: usize,
    /// Listen address of every rank; the world size is its length.
    pub peers: Vec<SocketAddr>,
    pub config: MoeConfig,
    pub steps: u64,
    /// Membership epoch of the communicator.
    pub epoch: u64,
    /// Rendezvous and per-operation timeout of the communicator.
    pub timeout_ms: u64,
    /// Directory to write `rank<R>.json` ([`Checksums`]) into at the end.
    pub out: Option<PathBuf>,
}

/// What a worker builds before its first step: the plan every worker computes alike, the dense
/// model and its optimizer, its expert replicas, and the communicator mesh.
pub(crate) struct Started {
    pub dev: Device,
    pub model: DenseModel,
    pub opt: crate::model::AdamW,
    pub store: ExpertStore,
    pub dist: DistributedExperts,
}

/// Start-up of [`run_worker`].
pub(crate) fn start(opts: &WorkerOptions) -> Result<Started> {
    let (world, rank) = (opts.peers.len(), opts.rank);
    let cfg = &opts.config;
    cfg.validate().context("model config")?;
    let replicas = plan_replicas(cfg, world)?;
    let dev = crate::device::worker_device()?;
    let model = DenseModel::new(cfg, &dev).context("building the dense model")?;
    let opt = model.optimizer()?;
    let store = ExpertStore::with_replicas(cfg, &dev, held_replicas(&replicas, rank))
        .context("building the expert store")?;
    let timeout = Duration::from_millis(opts.timeout_ms.max(1));
    let listener = bind_with_retry(opts.peers[rank], timeout)?;
    // No controller hands out a secret here (see `MeshSecret::unset`).
    let secret = MeshSecret::unset();
    let comm = TcpCommunicator::connect(
        rank,
        &opts.peers,
        listener,
        opts.epoch,
        &secret,
        opts.timeout_ms,
    )
    .with_context(|| format!("rank {rank}: forming the mesh of {world} workers"))?;
    let dist = DistributedExperts::new(Box::new(comm), &store, replicas)?;
    Ok(Started {
        dev,
        model,
        opt,
        store,
        dist,
    })
}

/// Runs one worker to completion: plan, store, mesh, `steps` training steps (each reported to
/// `on_step`), checksums (also written to `out` when given).
pub fn run_worker(
    opts: &WorkerOptions,
    mut on_step: impl FnMut(&StepLine) -> Result<()>,
) -> Result<Checksums> {
    let world = opts.peers.len();
    let rank = opts.rank;
    ensure!(world >= 1, "no peers given");
    ensure!(
        rank < world,
        "rank {rank} is not below the world size {world}"
    );
    let cfg = &opts.config;
    let Started {
        dev,
        model,
        mut opt,
        mut store,
        dist,
    } = start(opts)?;
    let mut dist = dist;

    let corpus = Corpus::embedded();
    let tokens_per_step = (cfg.batch * cfg.seq_len) as u64;
    let mut nonfinite_run = 0;
    for step in 0..opts.steps {
        let t0 = Instant::now();
        let tokens = corpus.batch(
            cfg.seed,
            step,
            rank as u64,
            cfg.batch,
            cfg.seq_len + 1,
            &dev,
        )?;
        let data_wait_ms = t0.elapsed().as_secs_f64() * 1e3;
        let done = train_step(&model, &mut opt, &mut store, &mut dist, &tokens, false)
            .with_context(|| format!("rank {rank}: step {step}"))?;
        let (expert_ms, expert_tokens) = dist.expert_compute()?;
        let sent_bytes = dist.sent_bytes()?;
        on_step(&StepLine {
            step,
            epoch: opts.epoch,
            loss: done.loss,
            tokens: tokens_per_step,
            ms: t0.elapsed().as_secs_f64() * 1e3,
            routing: done.stats.counts,
            nonfinite: done.nonfinite,
            expert_ms,
            expert_tokens,
            sent_bytes,
            copy_bytes: 0,
            layout_version: 0,
            // Nobody compares them: the stand-alone ranks compare their checksum files.
            fingerprints: None,
            data: None,
            data_wait_ms,
            // Held-out evaluation is the managed worker's (`--eval-data` under a controller).
            eval_loss: None,
        })?;
        // The same rule as under a controller: every rank decided the same skips, so every
        // rank stops here together.
        nonfinite_run = if done.nonfinite { nonfinite_run + 1 } else { 0 };
        ensure!(
            nonfinite_run < MAX_NONFINITE_STEPS,
            "training diverged: {nonfinite_run} steps in a row (the last is step {step}) had a \
             non-finite loss or gradient and were skipped; lower the learning rate (lr)"
        );
    }

    let sums = Checksums::collect(rank, world, opts.steps, &opt, &store, None)?;
    if let Some(dir) = &opts.out {
        sums.write(dir)?;
    }
    Ok(sums)
}
