//! # Recovery: in-place reconfiguration of the worker processes after a failure
//!
//! In `lzrun local` the parent process plays the controller: when a worker dies (or is killed
//! with `--kill RANK@STEP`), the survivors' collectives fail, each survivor discards its
//! in-flight step and reports [`WorkerEvent::Failed`] on stdout, then waits for a
//! [`Reconfigure`] command (one JSON line on its stdin). The parent replans with
//! [`lazarus_planner::replan`] on the survivors' holdings ([`survivor_nodes`]) and sends each
//! survivor its new rank, the new peers and epoch, the new replica plan and the expert-state
//! transfers. Survivors then form a new [`TcpCommunicator`], migrate expert states with
//! `send_recv` ([`encode_state`] / [`decode_state`]), drop replicas they no longer hold, report
//! [`WorkerEvent::Migrated`] and resume.
//!
//! ## No partial updates
//!
//! [`train_step_atomic`] runs every collective of a step (forward and backward exchanges, dense
//! and expert all-reduces, then a barrier) before it applies any optimizer step, and keeps a
//! [`Snapshot`] of the state before the update. A peer can still die while the final barrier
//! completes for some ranks and not for others; then the survivors disagree by one step, the
//! parent resumes at the smallest failed step and the ranks that got one step further roll back
//! to their snapshot.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::model::Corpus;
use crate::worker::{Checksums, Started, StepLine, WorkerOptions, start};
use anyhow::{Context, Result, anyhow, bail, ensure};
use candle_core::Tensor;
use lazarus_planner::migrate::{MappingMethod, PhysicalNode, lost_experts};
use lazarus_planner::{AllocPolicy, ModelSpec, PlacePolicy, ReplanOptions, replan};
use serde::{Deserialize, Serialize};

use crate::comm::TcpCommunicator;
use crate::model::{AdamW, DenseModel, ExpertState, ExpertStore, OptimState, RoutingStats};
use crate::runtime::DistributedExperts;
use crate::worker::{FAULT_TOLERANCE, bind_with_retry, slots_per_node};

/// A command the parent sends a worker (one JSON line on its stdin).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconfigure {
    /// This worker's rank in the new membership.
    pub rank: usize,
    /// Listen addresses of the new membership, in rank order (fresh ports).
    pub peers: Vec<SocketAddr>,
    /// Epoch of the new communicator.
    pub epoch: u64,
    /// `[layer][expert][rank]` replicas of the new plan.
    pub replicas: Vec<Vec<Vec<u32>>>,
    /// `(layer, expert, src rank, dst rank)` expert-state transfers, in new ranks.
    pub transfers: Vec<(usize, usize, usize, usize)>,
    /// The step to train next (the in-flight step is redone).
    pub resume_step: u64,
}

/// A non-step line a worker prints on stdout (step lines are [`crate::worker::StepLine`]s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WorkerEvent {
    /// Step `step` failed (it was discarded); the worker waits for a [`Reconfigure`].
    Failed { step: u64, error: String },
    /// The new mesh of `epoch` is formed and the expert states are migrated.
    Migrated {
        epoch: u64,
        rank: usize,
        world: usize,
        ms: f64,
    },
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

/// One distributed training step that applies nothing unless every collective of the step
/// succeeded (see the [module docs](self)). Returns the loss and the pre-update snapshot.
pub fn train_step_atomic(
    model: &DenseModel,
    dense_opt: &mut AdamW,
    store: &mut ExpertStore,
    experts: &mut DistributedExperts,
    tokens: &Tensor,
) -> Result<(f32, Snapshot)> {
    experts.begin_step()?;
    let mut stats = RoutingStats::default();
    let loss = model.loss(tokens, experts, &mut stats)?;
    let grads = loss.backward()?;
    let dense = experts.all_reduce_dense(model, &grads)?;
    let expert_grads = experts.reduce_expert_grads()?;
    experts.with_comm(|c| c.barrier())??;
    let loss = loss.to_scalar::<f32>()?;
    let snap = Snapshot::take(dense_opt, store)?;
    dense_opt.step_with(&dense)?;
    for ((l, e), (g1, g2)) in expert_grads {
        store.step_replica(l, e, &g1, &g2)?;
    }
    Ok((loss, snap))
}

/// Expert state as one f32 buffer: `w1, w2, m1, v1, m2, v2`, then the step in four 16-bit
/// pieces (exact in f32).
pub fn encode_state(s: &ExpertState) -> Vec<f32> {
    let mut v = Vec::with_capacity(6 * s.w1.len() + 4);
    for xs in [&s.w1, &s.w2, &s.m1, &s.v1, &s.m2, &s.v2] {
        v.extend_from_slice(xs);
    }
    for k in 0..4 {
        v.push(((s.step >> (16 * k)) & 0xffff) as f32);
    }
    v
}

/// Inverse of [`encode_state`].
pub fn decode_state(
    layer: usize,
    expert: usize,
    d_model: usize,
    d_ff: usize,
    buf: &[f32],
) -> Result<ExpertState> {
    let n = d_model * d_ff;
    ensure!(
        buf.len() == 6 * n + 4,
        "expert state ({layer}, {expert}): {} values, expected {}",
        buf.len(),
        6 * n + 4
    );
    let part = |i: usize| buf[i * n..(i + 1) * n].to_vec();
    let mut step = 0u64;
    for k in 0..4 {
        step |= (buf[6 * n + k] as u64) << (16 * k);
    }
    Ok(ExpertState {
        layer,
        expert,
        d_model,
        d_ff,
        w1: part(0),
        w2: part(1),
        m1: part(2),
        v1: part(3),
        m2: part(4),
        v2: part(5),
        step,
    })
}

/// Forms the new mesh, migrates expert states as `cmd` says, drops replicas the new plan does
/// not give this rank, and returns the new [`DistributedExperts`].
pub fn reconfigure(
    cmd: &Reconfigure,
    store: &mut ExpertStore,
    d_model: usize,
    d_ff: usize,
    timeout_ms: u64,
) -> Result<DistributedExperts> {
    let me = cmd.rank;
    ensure!(me < cmd.peers.len(), "new rank {me} outside the peer list");
    let timeout = Duration::from_millis(timeout_ms.max(1));
    let listener = bind_with_retry(cmd.peers[me], timeout)?;
    let mut comm = TcpCommunicator::connect(me, &cmd.peers, listener, cmd.epoch, timeout_ms)
        .with_context(|| format!("rank {me}: forming the mesh of epoch {}", cmd.epoch))?;
    let mut sends = Vec::new();
    let mut recv_from = Vec::new();
    let mut incoming = Vec::new();
    for &(l, e, src, dst) in &cmd.transfers {
        if src == me {
            sends.push((dst, encode_state(&store.export(l, e)?)));
        }
        if dst == me {
            recv_from.push(src);
            incoming.push((l, e));
        }
    }
    use crate::comm::Communicator;
    let got = comm
        .send_recv(sends, &recv_from)
        .with_context(|| format!("rank {me}: migrating expert states"))?;
    ensure!(
        got.len() == incoming.len(),
        "migration: wrong message count"
    );
    for ((l, e), (_, buf)) in incoming.into_iter().zip(got) {
        store.import(&decode_state(l, e, d_model, d_ff, &buf)?)?;
    }
    for (l, e) in store.replicas() {
        let keep = cmd
            .replicas
            .get(l)
            .and_then(|r| r.get(e))
            .and_then(|r| r.get(me))
            .is_some_and(|&c| c > 0);
        if !keep {
            store.remove(l, e);
        }
    }
    comm.barrier()
        .with_context(|| format!("rank {me}: barrier after migration"))?;
    Ok(DistributedExperts::new(
        Box::new(comm),
        store,
        cmd.replicas.clone(),
    )?)
}

/// The parent's view of one surviving worker before a replan.
#[derive(Debug, Clone)]
pub struct Survivor {
    /// Stable id (the worker's original rank).
    pub id: u32,
    /// Its rank in the failed membership.
    pub rank: usize,
}

/// What the parent decided in one replan.
#[derive(Debug, Clone)]
pub struct RecoveryPlan {
    /// `commands[i]` for `survivors[i]`.
    pub commands: Vec<Reconfigure>,
    /// Stable id of each new rank.
    pub id_of_rank: Vec<u32>,
    pub replicas: Vec<Vec<Vec<u32>>>,
    pub version: u64,
}

/// Holdings of the survivors under the replica plan `replicas[layer][expert][rank]`.
pub fn survivor_nodes(replicas: &[Vec<Vec<u32>>], survivors: &[Survivor]) -> Vec<PhysicalNode> {
    survivors
        .iter()
        .map(|s| PhysicalNode {
            id: s.id,
            holdings: replicas
                .iter()
                .map(|layer| {
                    let mut ids = Vec::new();
                    for (e, row) in layer.iter().enumerate() {
                        for _ in 0..row.get(s.rank).copied().unwrap_or(0) {
                            ids.push(e as u32);
                        }
                    }
                    ids
                })
                .collect(),
        })
        .collect()
}

/// Replans for `survivors` (Lazarus allocation, MRO placement, optimal mapping) and builds one
/// [`Reconfigure`] per survivor. Fails with a message naming the expert(s) when some expert
/// lost every replica (a checkpoint restore would be needed).
#[allow(clippy::too_many_arguments)]
pub fn plan_recovery(
    replicas: &[Vec<Vec<u32>>],
    survivors: &[Survivor],
    experts: usize,
    bytes_per_expert: u64,
    peers: &[SocketAddr],
    epoch: u64,
    resume_step: u64,
    version: u64,
) -> Result<RecoveryPlan> {
    ensure!(!survivors.is_empty(), "no worker survived");
    ensure!(peers.len() == survivors.len(), "one address per survivor");
    let layers = replicas.len();
    let nodes = survivor_nodes(replicas, survivors);
    let lost = lost_experts(&nodes, layers, experts);
    if !lost.is_empty() {
        let names = lost
            .iter()
            .map(|(l, e)| format!("expert {e} of layer {l}"))
            .collect::<Vec<_>>()
            .join(", ");
        bail!(
            "{names} lost every replica; recovery would need a checkpoint restore, which lzrun \
             does not support yet (checkpoints are a later step)"
        );
    }
    let model = ModelSpec {
        experts,
        layers,
        f: FAULT_TOLERANCE,
    };
    let loads = vec![vec![1u64; experts]; layers];
    let opts = ReplanOptions {
        alloc: AllocPolicy::Lazarus,
        place: PlacePolicy::Mro,
        mapping: MappingMethod::Optimal,
        bytes_per_expert,
    };
    let (plan, migration) = replan(
        &nodes,
        slots_per_node(experts, survivors.len()),
        &model,
        &loads,
        &opts,
        version,
    )
    .map_err(|e| anyhow!("replanning {} survivors: {e}", survivors.len()))?;
    let id_of_rank = plan.node_map.clone();
    let rank_of: BTreeMap<u32, usize> = id_of_rank
        .iter()
        .enumerate()
        .map(|(r, &id)| (id, r))
        .collect();
    let new_replicas: Vec<Vec<Vec<u32>>> = (0..layers).map(|l| plan.replicas_per_rank(l)).collect();
    let transfers = migration
        .transfers
        .iter()
        .map(|t| {
            let src = rank_of.get(&t.src).copied();
            let dst = rank_of.get(&t.dst).copied();
            match (src, dst) {
                (Some(s), Some(d)) => Ok((t.layer as usize, t.expert as usize, s, d)),
                _ => Err(anyhow!("transfer {t:?} names an unknown node")),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let commands = survivors
        .iter()
        .map(|s| {
            let rank = *rank_of
                .get(&s.id)
                .ok_or_else(|| anyhow!("survivor {} is not in the new plan", s.id))?;
            Ok(Reconfigure {
                rank,
                peers: peers.to_vec(),
                epoch,
                replicas: new_replicas.clone(),
                transfers: transfers.clone(),
                resume_step,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecoveryPlan {
        commands,
        id_of_rank,
        replicas: new_replicas,
        version: plan.version,
    })
}

/// Waits for the next command line on `commands` (the stdin reader's channel).
pub fn wait_command(commands: &Receiver<String>) -> Result<Reconfigure> {
    let line = commands
        .recv()
        .map_err(|_| anyhow!("control channel closed while waiting for a new plan"))?;
    serde_json::from_str(&line).with_context(|| format!("parsing command {line:?}"))
}

/// Elapsed milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Like [`crate::worker::run_worker`], but recovers in place: when a step fails it reports
/// [`WorkerEvent::Failed`], waits for a [`Reconfigure`] line on `commands`, reconfigures and
/// resumes (see the [module docs](self)). The data shard stays `opts.rank` (the original rank)
/// across reconfigurations, so the data schedule is unchanged. `emit` gets every output line.
pub fn run_elastic_worker(
    opts: &WorkerOptions,
    commands: &Receiver<String>,
    mut emit: impl FnMut(&str) -> Result<()>,
) -> Result<Checksums> {
    let mut world = opts.peers.len();
    let mut rank = opts.rank;
    ensure!(
        rank < world,
        "rank {rank} is not below the world size {world}"
    );
    let shard = opts.rank as u64;
    let cfg = &opts.config;
    let Started {
        dev,
        model,
        mut opt,
        mut store,
        dist,
    } = start(opts)?;
    let mut dist = Some(dist);

    let corpus = Corpus::embedded();
    let tokens_per_step = (cfg.batch * cfg.seq_len) as u64;
    let mut snapshot: Option<(u64, Snapshot)> = None;
    let mut step = 0u64;
    while step < opts.steps {
        let t0 = Instant::now();
        let res = match dist.as_mut() {
            Some(d) => corpus
                .batch(cfg.seed, step, shard, cfg.batch, cfg.seq_len + 1, &dev)
                .map_err(anyhow::Error::from)
                .and_then(|tokens| train_step_atomic(&model, &mut opt, &mut store, d, &tokens)),
            None => Err(anyhow!("no communicator")),
        };
        match res {
            Ok((loss, snap)) => {
                snapshot = Some((step, snap));
                let line = StepLine {
                    step,
                    loss,
                    tokens: tokens_per_step,
                    ms: ms_since(t0),
                };
                emit(&serde_json::to_string(&line)?)?;
                step += 1;
            }
            Err(e) => {
                // Discard the step and the broken communicator, then wait for the parent.
                drop(dist.take());
                let ev = WorkerEvent::Failed {
                    step,
                    error: e
                        .chain()
                        .map(|c| c.to_string().lines().next().unwrap_or("").to_owned())
                        .collect::<Vec<_>>()
                        .join(": "),
                };
                emit(&serde_json::to_string(&ev)?)?;
                let cmd = wait_command(commands)?;
                let t1 = Instant::now();
                if cmd.resume_step < step {
                    ensure!(
                        cmd.resume_step + 1 == step,
                        "cannot roll back from step {step} to {}",
                        cmd.resume_step
                    );
                    let Some((s, snap)) = snapshot.take().filter(|(s, _)| *s == cmd.resume_step)
                    else {
                        bail!("no snapshot of step {} to roll back to", cmd.resume_step);
                    };
                    snap.restore(&mut opt, &mut store)?;
                    step = s;
                }
                ensure!(
                    cmd.resume_step == step,
                    "asked to resume at step {} but this worker is at step {step}",
                    cmd.resume_step
                );
                let d = reconfigure(&cmd, &mut store, cfg.d_model, cfg.d_ff, opts.timeout_ms)?;
                rank = cmd.rank;
                world = cmd.peers.len();
                dist = Some(d);
                let ev = WorkerEvent::Migrated {
                    epoch: cmd.epoch,
                    rank,
                    world,
                    ms: ms_since(t1),
                };
                emit(&serde_json::to_string(&ev)?)?;
            }
        }
    }
    drop(dist);

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
    fn state_roundtrip_is_exact() {
        let n = 6;
        let s = ExpertState {
            layer: 1,
            expert: 2,
            d_model: 2,
            d_ff: 3,
            w1: (0..n).map(|i| i as f32 * 0.1).collect(),
            w2: vec![-1.5; n],
            m1: vec![1e-9; n],
            v1: vec![3.0; n],
            m2: vec![0.0; n],
            v2: vec![7.25; n],
            step: 0x1234_5678_9abc,
        };
        let back = decode_state(1, 2, 2, 3, &encode_state(&s)).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn losing_both_holders_is_reported() {
        let cfg = crate::model::MoeConfig::tiny();
        let replicas = crate::worker::plan_replicas(&cfg, 3).unwrap();
        let peers: Vec<SocketAddr> = vec!["127.0.0.1:1".parse().unwrap()];
        let survivors = [Survivor { id: 0, rank: 0 }];
        let err = plan_recovery(&replicas, &survivors, cfg.experts, 1, &peers, 1, 0, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("lost every replica"), "{err}");
        let peers: Vec<SocketAddr> = vec![
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ];
        let survivors = [Survivor { id: 0, rank: 0 }, Survivor { id: 1, rank: 1 }];
        let p = plan_recovery(&replicas, &survivors, cfg.experts, 1, &peers, 1, 4, 0).unwrap();
        assert_eq!(p.commands.len(), 2);
        for layer in &p.replicas {
            for row in layer {
                assert_eq!(row.len(), 2);
                assert!(row.iter().sum::<u32>() >= 1);
            }
        }
    }
}
