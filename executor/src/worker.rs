//! # Worker: one training process of `lzrun` (one per device)
//!
//! A worker is told its rank, the listen addresses of every rank and the model configuration.
//! It then
//!
//! 1. computes the whole-model plan with the planner ([`plan_replicas`]): every worker
//!    derives the same plan from `(world, config)` alone, so no coordination is needed;
//! 2. builds its [`ExpertStore`] with only the replicas the plan gives its rank, and the full
//!    [`DenseModel`];
//! 3. binds its listener ([`bind_with_retry`]: in `lzrun local` the parent chose the ports, so
//!    another process may briefly hold one) and forms the [`TcpCommunicator`] mesh;
//! 4. trains `steps` steps with [`train_step`] on its shard of the embedded corpus
//!    (shard = rank), reporting one [`StepLine`] per step;
//! 5. returns (and optionally writes) the [`Checksums`] of its replicas and dense weights, so
//!    that replicas of one expert on different workers can be compared.
//!
//! [`run_worker`] handles no failures: a dead peer makes the others fail. Under a controller
//! (`lzrun local`, `lzrun agent`) workers run [`crate::recovery::run_managed_worker`] instead,
//! which takes its plans from the controller and recovers in place.

use std::fs;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use candle_core::Device;
use lazarus_planner::{Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, plan_model};
use serde::{Deserialize, Serialize};

use crate::comm::TcpCommunicator;
use crate::model::{Corpus, DenseModel, ExpertStore, Fnv64, MoeConfig};
use crate::runtime::{DistributedExperts, train_step};

/// Model configurations a worker can be started with, by name.
pub const CONFIG_NAMES: [&str; 4] = ["tiny", "gpt-s", "gpt-m", "gpt-l"];

/// The fault-tolerance threshold the plan asks for (the paper's `f`).
pub const FAULT_TOLERANCE: usize = 2;

/// The [`MoeConfig`] called `name` (one of [`CONFIG_NAMES`]).
pub fn config_by_name(name: &str) -> Result<MoeConfig> {
    Ok(match name {
        "tiny" => MoeConfig::tiny(),
        "gpt-s" => MoeConfig::gpt_s(),
        "gpt-m" => MoeConfig::gpt_m(),
        "gpt-l" => MoeConfig::gpt_l(),
        other => bail!(
            "unknown model config {other:?} (expected one of {})",
            CONFIG_NAMES.join(", ")
        ),
    })
}

/// Replica slots per node for `world` single-device nodes: enough for
/// [`FAULT_TOLERANCE`] replicas of every expert, `⌈f·E / W⌉`.
pub fn slots_per_node(experts: usize, world: usize) -> usize {
    (FAULT_TOLERANCE * experts).div_ceil(world.max(1)).max(1)
}

/// `[layer][expert][rank]` replica counts of the whole-model plan for `world` nodes of one
/// device each: Lazarus allocation (Eq. 1) on uniform loads, MRO placement, aligned layers.
/// A pure function of its arguments, so every worker computes the same plan.
pub fn plan_replicas(cfg: &MoeConfig, world: usize) -> Result<Vec<Vec<Vec<u32>>>> {
    ensure!(world >= 1, "world size must be at least 1");
    let cluster = ClusterSpec::new(world, slots_per_node(cfg.experts, world));
    let model = ModelSpec {
        experts: cfg.experts,
        layers: cfg.n_layers,
        f: FAULT_TOLERANCE,
    };
    let loads = vec![vec![1u64; cfg.experts]; cfg.n_layers];
    let plan = plan_model(
        &cluster,
        &model,
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .map_err(|e| anyhow!("planning {world} nodes: {e}"))?;
    Ok((0..cfg.n_layers)
        .map(|l| plan.replicas_per_rank(l))
        .collect())
}

/// The `(layer, expert)` pairs `rank` holds at least one replica of.
pub fn held_replicas(replicas: &[Vec<Vec<u32>>], rank: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (l, layer) in replicas.iter().enumerate() {
        for (e, row) in layer.iter().enumerate() {
            if row.get(rank).copied().unwrap_or(0) > 0 {
                out.push((l, e));
            }
        }
    }
    out
}

/// Binds `addr`, retrying while it is in use (another process may hold a port the parent
/// picked as free) until `timeout` has passed.
pub fn bind_with_retry(addr: SocketAddr, timeout: Duration) -> Result<TcpListener> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpListener::bind(addr) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == ErrorKind::AddrInUse && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e).with_context(|| format!("binding {addr}")),
        }
    }
}

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

/// One training step as a worker reports it (one JSON line on stdout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepLine {
    pub step: u64,
    /// Membership epoch the step was trained in (0 for a stand-alone worker).
    #[serde(default)]
    pub epoch: u64,
    /// This worker's shard loss.
    pub loss: f32,
    /// Tokens predicted by this worker in this step.
    pub tokens: u64,
    /// Wall-clock time of the step in milliseconds.
    pub ms: f64,
    /// `[layer][expert]` tokens this worker routed to each expert in this step (the
    /// controller's load history for rebalancing).
    #[serde(default)]
    pub routing: Vec<Vec<u64>>,
}

/// Checksum of one held expert replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaChecksum {
    pub layer: usize,
    pub expert: usize,
    /// [`ExpertStore::checksum`]: weights, optimizer moments and step.
    pub checksum: u64,
    /// [`ExpertStore::weights_checksum`]: weights only.
    pub weights_checksum: u64,
}

/// What a worker holds after training: written to `<out>/rank<R>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checksums {
    /// Node id under a controller (`lzrun local`); absent for a stand-alone worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    pub rank: usize,
    pub world: usize,
    pub steps: u64,
    /// FNV-1a over every dense variable's f32 values, in `named_vars` order.
    pub dense: u64,
    pub replicas: Vec<ReplicaChecksum>,
}

impl Checksums {
    /// Checksums of a worker's dense weights and of every replica it holds.
    pub fn collect(
        rank: usize,
        world: usize,
        steps: u64,
        model: &DenseModel,
        store: &ExpertStore,
    ) -> Result<Self> {
        let mut dense = Fnv64::default();
        for (_, v) in model.named_vars() {
            dense.write_f32s(&v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        let replicas = store
            .replicas()
            .into_iter()
            .map(|(layer, expert)| {
                let missing = || anyhow!("replica ({layer}, {expert}) vanished");
                Ok(ReplicaChecksum {
                    layer,
                    expert,
                    checksum: store.checksum(layer, expert).ok_or_else(missing)?,
                    weights_checksum: store.weights_checksum(layer, expert).ok_or_else(missing)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            node: None,
            rank,
            world,
            steps,
            dense: dense.finish(),
            replicas,
        })
    }

    /// The file a worker of rank `rank` writes into `dir`.
    pub fn path(dir: &Path, rank: usize) -> PathBuf {
        dir.join(format!("rank{rank}.json"))
    }

    /// Writes `<dir>/rank<R>.json` (through a temporary file and a rename).
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        self.write_named(dir, &format!("rank{}.json", self.rank))
    }

    /// Writes `<dir>/<name>` (through a temporary file and a rename).
    pub fn write_named(&self, dir: &Path, name: &str) -> Result<PathBuf> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        fs::write(&tmp, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
        Ok(path)
    }

    /// Reads a file written by [`Checksums::write`].
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
    }
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
    let dev = Device::Cpu;
    let model = DenseModel::new(cfg, &dev).context("building the dense model")?;
    let opt = model.optimizer()?;
    let store = ExpertStore::with_replicas(cfg, &dev, held_replicas(&replicas, rank))
        .context("building the expert store")?;
    let timeout = Duration::from_millis(opts.timeout_ms.max(1));
    let listener = bind_with_retry(opts.peers[rank], timeout)?;
    let comm = TcpCommunicator::connect(rank, &opts.peers, listener, opts.epoch, opts.timeout_ms)
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
        let (loss, stats) = train_step(&model, &mut opt, &mut store, &mut dist, &tokens)
            .with_context(|| format!("rank {rank}: step {step}"))?;
        on_step(&StepLine {
            step,
            epoch: opts.epoch,
            loss,
            tokens: tokens_per_step,
            ms: t0.elapsed().as_secs_f64() * 1e3,
            routing: stats.counts,
        })?;
    }

    let sums = Checksums::collect(rank, world, opts.steps, &model, &store)?;
    if let Some(dir) = &opts.out {
        sums.write(dir)?;
    }
    Ok(sums)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_gives_every_expert_f_replicas_and_is_deterministic() {
        let cfg = MoeConfig::tiny();
        for world in 1..=5 {
            let a = plan_replicas(&cfg, world).unwrap();
            assert_eq!(a, plan_replicas(&cfg, world).unwrap());
            assert_eq!(a.len(), cfg.n_layers);
            for layer in &a {
                assert_eq!(layer.len(), cfg.experts);
                for row in layer {
                    assert_eq!(row.len(), world);
                    assert!(row.iter().sum::<u32>() >= FAULT_TOLERANCE as u32);
                }
            }
        }
    }

    #[test]
    fn unknown_config_is_an_error() {
        assert!(config_by_name("tiny").is_ok());
        assert!(config_by_name("huge").is_err());
    }
}
