//! # The managed worker: one training process under a controller, recovering in place
//!
//! An agent starts `lzrun worker --managed` and relays, one JSON line each, the controller's
//! [`Command`]s to the worker's stdin and the worker's [`StepLine`]s and [`WorkerEvent`]s from
//! its stdout. The worker
//!
//! 1. gets a [`Command::Job`] (model configuration, steps, data shard, checkpoint settings),
//!    builds the dense model and binds one data-plane listener for its whole life, and
//!    reports [`WorkerEvent::Ready`] with that address;
//! 2. waits, idle, for a [`Command::Reconfigure`]: its rank, the members' addresses, the
//!    membership epoch, the replica plan, the expert-state transfers, where its state comes
//!    from (fresh initialisation, a peer for the dense state of a joining node, or a
//!    checkpoint), and the step to resume at. It forms a new [`TcpCommunicator`], moves
//!    states with `send_recv`, drops replicas it no longer holds, and reports
//!    [`WorkerEvent::Migrated`];
//! 3. trains. After every step it reports a [`StepLine`] (with its routing counts, which the
//!    controller aggregates into the load history for rebalancing) and, every
//!    `checkpoint.every_steps` steps, writes its parts of a checkpoint
//!    ([`WorkerEvent::Checkpointed`]; the controller commits the checkpoint when every member
//!    wrote its parts);
//! 4. on any error in a step (a peer died: connection reset or timeout) discards the step and
//!    the communicator and reports [`WorkerEvent::Failed`] with the replicas it actually holds;
//!    on [`Command::Pause`] it stops at the next step boundary that every member agrees on and
//!    reports [`WorkerEvent::Paused`]; after the last step it reports
//!    [`WorkerEvent::Finished`]. In each case it goes back to 2. [`Command::Stop`] writes the
//!    replica checksums and ends the process.
//!
//! ## No partial updates
//!
//! [`train_step_atomic`] runs every collective of a step (forward and backward exchanges, dense
//! and expert all-reduces, then a one-value all-reduce that doubles as the barrier and carries
//! the pause flag) before it applies any optimizer step, and keeps a [`Snapshot`] of the state
//! before the update. A peer can still die while that last all-reduce completes for some ranks
//! and not for others; then the survivors disagree by one step, the controller resumes at the
//! smallest reported step and the ranks one step further roll back to their snapshot.
//!
//! ## Pausing at an agreed step
//!
//! A scale-out or a rebalance needs every member to stop at the same step boundary. The pause
//! request travels in the step's final all-reduce: a member that has a pending
//! [`Command::Pause`] contributes 1, so all members learn in the same step that someone asked,
//! finish that step and pause before the next one.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail, ensure};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::checkpoint;
use crate::comm::tcp::AbortHandle;
use crate::comm::{Communicator, TcpCommunicator};
use crate::model::{
    AdamW, Corpus, DenseModel, ExpertState, ExpertStore, MoeConfig, OptimState, RoutingStats,
};
use crate::runtime::DistributedExperts;
use crate::worker::{Checksums, StepLine, held_replicas};

/// Where and how often a job writes checkpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointSpec {
    /// Root directory of the checkpoints (shared by every worker).
    pub root: PathBuf,
    /// Write one after every this many completed steps (0: never).
    pub every_steps: u64,
}

/// The training job a worker runs (the first command it gets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    pub config: MoeConfig,
    /// Steps to train in all.
    pub steps: u64,
    /// The data shard this worker reads (its node index: stable across reconfigurations).
    pub shard: u64,
    /// Node id given by the controller (names the checksum file).
    pub node_id: u32,
    /// Address to listen on for peers (port 0: any free port).
    pub listen: SocketAddr,
    /// Rendezvous and per-collective timeout of the communicator.
    pub timeout_ms: u64,
    pub checkpoint: Option<CheckpointSpec>,
    /// Directory for the checksum file `rank<node_id>.json` written at [`Command::Stop`].
    pub out: Option<PathBuf>,
}

/// Where a worker's state comes from when it applies a [`Reconfigure`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateSource {
    /// The first plan: dense model and the held replicas initialised from the seed (every
    /// worker gets the same values).
    Fresh,
    /// Keep what it has; new replicas arrive as transfers; ranks in `dense_to` (joining
    /// nodes) receive the dense model and its optimizer state from rank `dense_from`.
    Peers {
        dense_from: usize,
        dense_to: Vec<usize>,
    },
    /// Some expert lost every replica: everyone loads the checkpoint under `root` whose
    /// manifest says `step` (the controller checked it is the newest valid one).
    Checkpoint { root: PathBuf, step: u64 },
}

/// A new membership and plan for one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconfigure {
    /// This worker's rank in the new membership.
    pub rank: usize,
    /// Data-plane addresses of the members, in rank order.
    pub peers: Vec<SocketAddr>,
    /// Epoch of the new communicator (strictly increasing).
    pub epoch: u64,
    /// Version of the controller's plan.
    pub plan_version: u64,
    /// `[layer][expert][rank]` replicas of the new plan.
    pub replicas: Vec<Vec<Vec<u32>>>,
    /// `(layer, expert, src rank, dst rank)` expert-state transfers.
    pub transfers: Vec<(usize, usize, usize, usize)>,
    pub source: StateSource,
    /// The step to train next.
    pub resume_step: u64,
}

/// A controller command (one JSON line on the worker's stdin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Job(JobSpec),
    Reconfigure(Reconfigure),
    /// Pause at the next step boundary every member agrees on.
    Pause,
    /// A member of `epoch` is gone: abort the collective or rendezvous in flight (without
    /// waiting for its timeout) and report `Failed`.
    Abort {
        epoch: u64,
    },
    /// Write the checksums and exit.
    Stop,
}

/// What a worker reports besides its [`StepLine`]s (one JSON line each).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WorkerEvent {
    /// The job was accepted; peers reach this worker at `addr`.
    Ready { addr: SocketAddr },
    /// Step `step` (or a reconfiguration to resume at `step`) failed and was discarded.
    Failed {
        epoch: u64,
        step: u64,
        error: String,
        /// `(layer, expert)` replicas this worker holds now.
        held: Vec<(usize, usize)>,
    },
    /// Paused before step `step` (see the module docs).
    Paused {
        epoch: u64,
        step: u64,
        held: Vec<(usize, usize)>,
    },
    /// Trained every step; waiting for `Stop` (or a rollback if a peer failed in the last step).
    Finished {
        epoch: u64,
        step: u64,
        held: Vec<(usize, usize)>,
    },
    /// A reconfiguration completed; training resumes at `resume_step`.
    Migrated {
        epoch: u64,
        rank: usize,
        world: usize,
        resume_step: u64,
        /// Bytes of state this worker received.
        bytes_in: u64,
        ms: f64,
    },
    /// This worker wrote its parts of the checkpoint taken after `step` completed steps.
    Checkpointed {
        epoch: u64,
        step: u64,
        parts: Vec<checkpoint::PartInfo>,
    },
    /// Checksums of the final state (sent at `Stop`).
    Done(Checksums),
}

/// A worker output line: a step or an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WorkerLine {
    Step(StepLine),
    Event(WorkerEvent),
}

impl WorkerLine {
    pub fn parse(line: &str) -> Option<Self> {
        serde_json::from_str(line).ok()
    }
}

/// Lets the thread that reads the controller's commands abort the communicator of the
/// worker's current epoch while the training thread is blocked in a rendezvous or a
/// collective ([`Command::Abort`]).
#[derive(Debug, Default, Clone)]
pub struct AbortSlot(Arc<Mutex<SlotState>>);

#[derive(Debug, Default)]
struct SlotState {
    epoch: u64,
    flag: Arc<AtomicBool>,
    handle: Option<AbortHandle>,
    /// The newest epoch an abort was asked for (it may arrive before the reconfiguration).
    aborted: Option<u64>,
}

impl AbortSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Aborts the communicator of `epoch` (now, or as soon as one is formed).
    pub fn abort(&self, epoch: u64) {
        let mut st = self.lock();
        st.aborted = Some(st.aborted.map_or(epoch, |a| a.max(epoch)));
        if st.epoch == epoch {
            st.flag.store(true, Ordering::SeqCst);
            if let Some(h) = &st.handle {
                h.abort();
            }
        }
    }

    /// A fresh abort flag for the rendezvous of `epoch`.
    fn arm(&self, epoch: u64) -> Arc<AtomicBool> {
        let mut st = self.lock();
        let flag = Arc::new(AtomicBool::new(st.aborted.is_some_and(|a| a >= epoch)));
        st.epoch = epoch;
        st.flag = flag.clone();
        st.handle = None;
        flag
    }

    fn set_handle(&self, handle: AbortHandle) {
        let mut st = self.lock();
        if st.flag.load(Ordering::SeqCst) {
            handle.abort();
        }
        st.handle = Some(handle);
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

/// One distributed training step that applies nothing unless every collective of the step
/// succeeded (see the [module docs](self)). `pause` is this worker's vote to pause after the
/// step. Returns the loss, the routing counts, the pre-update snapshot and whether any member
/// voted to pause.
pub fn train_step_atomic(
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

/// Expert state as one f32 buffer: `w1, w2, m1, v1, m2, v2`, then the step in four 16-bit
/// pieces (exact in f32).
pub fn encode_state(s: &ExpertState) -> Vec<f32> {
    let mut v = Vec::with_capacity(6 * s.w1.len() + 4);
    for xs in [&s.w1, &s.w2, &s.m1, &s.v1, &s.m2, &s.v2] {
        v.extend_from_slice(xs);
    }
    push_u64(&mut v, s.step);
    v
}

fn push_u64(v: &mut Vec<f32>, x: u64) {
    for k in 0..4 {
        v.push(((x >> (16 * k)) & 0xffff) as f32);
    }
}

fn read_u64(buf: &[f32]) -> u64 {
    (0..4).fold(0u64, |acc, k| acc | ((buf[k] as u64) << (16 * k)))
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
        step: read_u64(&buf[6 * n..]),
    })
}

/// Dense optimizer state (values and moments of every parameter, then the step) as one f32
/// buffer, for a joining node.
pub fn encode_dense(s: &OptimState) -> Vec<f32> {
    let n: usize = s.params.iter().map(|p| 3 * p.value.len()).sum();
    let mut v = Vec::with_capacity(n + 4);
    for p in &s.params {
        v.extend_from_slice(&p.value);
        v.extend_from_slice(&p.m);
        v.extend_from_slice(&p.v);
    }
    push_u64(&mut v, s.step);
    v
}

/// Inverse of [`encode_dense`]; names and shapes come from `template` (the receiver's own).
pub fn decode_dense(template: &OptimState, buf: &[f32]) -> Result<OptimState> {
    let n: usize = template.params.iter().map(|p| 3 * p.value.len()).sum();
    ensure!(
        buf.len() == n + 4,
        "dense state: {} values, expected {}",
        buf.len(),
        n + 4
    );
    let mut out = template.clone();
    let mut at = 0;
    for p in &mut out.params {
        let k = p.value.len();
        for xs in [&mut p.value, &mut p.m, &mut p.v] {
            xs.copy_from_slice(&buf[at..at + k]);
            at += k;
        }
    }
    out.step = read_u64(&buf[at..]);
    Ok(out)
}

/// A worker's training state.
struct State {
    cfg: MoeConfig,
    dev: Device,
    model: DenseModel,
    opt: AdamW,
    store: ExpertStore,
}

impl State {
    /// The model as initialised from the config's seed (every worker the same values).
    fn fresh(cfg: &MoeConfig) -> Result<Self> {
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

/// Applies `cmd`: new mesh, state from its source, transfers, drop of replicas no longer
/// held. On error the store still holds at least what it held before (imports only add), so
/// the worker can report its holdings truthfully. Returns the new runtime and the bytes
/// received.
fn reconfigure(
    cmd: &Reconfigure,
    st: &mut State,
    listener: &TcpListener,
    timeout_ms: u64,
    abort: &AbortSlot,
) -> Result<(DistributedExperts, u64)> {
    let me = cmd.rank;
    ensure!(me < cmd.peers.len(), "new rank {me} outside the peer list");
    let mine: BTreeSet<(usize, usize)> = held_replicas(&cmd.replicas, me).into_iter().collect();
    match &cmd.source {
        StateSource::Fresh => {
            for &(l, e) in &mine {
                if !st.store.contains(l, e) {
                    st.store.add(l, e)?;
                }
            }
        }
        StateSource::Checkpoint { root, step } => {
            let loaded = checkpoint::load_latest(root, &st.cfg)
                .map_err(|e| anyhow!("loading the checkpoint: {e}"))?;
            ensure!(
                loaded.manifest.step == *step,
                "the newest valid checkpoint under {} is at step {}, the controller chose step {step}",
                root.display(),
                loaded.manifest.step
            );
            st.opt
                .import(&loaded.dense().map_err(|e| anyhow!("{e}"))?)
                .context("restoring the dense state")?;
            for &(l, e) in &mine {
                let s = loaded.expert(l, e).map_err(|e| anyhow!("{e}"))?;
                st.store.import(&s)?;
            }
        }
        StateSource::Peers { .. } => {}
    }
    let listener = listener.try_clone().context("cloning the data listener")?;
    let flag = abort.arm(cmd.epoch);
    let mut comm =
        TcpCommunicator::connect_abortable(me, &cmd.peers, listener, cmd.epoch, timeout_ms, flag)
            .with_context(|| format!("rank {me}: forming the mesh of epoch {}", cmd.epoch))?;
    abort.set_handle(comm.abort_handle()?);
    let mut sends = Vec::new();
    let mut recv_from = Vec::new();
    let mut incoming: Vec<Option<(usize, usize)>> = Vec::new();
    if let StateSource::Peers {
        dense_from,
        dense_to,
    } = &cmd.source
    {
        for &dst in dense_to {
            if *dense_from == me {
                sends.push((dst, encode_dense(&st.opt.export()?)));
            }
            if dst == me {
                recv_from.push(*dense_from);
                incoming.push(None);
            }
        }
    }
    for &(l, e, src, dst) in &cmd.transfers {
        if src == me {
            sends.push((dst, encode_state(&st.store.export(l, e)?)));
        }
        if dst == me {
            recv_from.push(src);
            incoming.push(Some((l, e)));
        }
    }
    let got = comm
        .send_recv(sends, &recv_from)
        .with_context(|| format!("rank {me}: migrating states"))?;
    ensure!(
        got.len() == incoming.len(),
        "migration: wrong message count"
    );
    let mut bytes_in = 0u64;
    for (what, (_, buf)) in incoming.into_iter().zip(got) {
        bytes_in += 4 * buf.len() as u64;
        match what {
            None => {
                let template = st.opt.export()?;
                st.opt.import(&decode_dense(&template, &buf)?)?;
            }
            Some((l, e)) => {
                let s = decode_state(l, e, st.cfg.d_model, st.cfg.d_ff, &buf)?;
                st.store.import(&s)?;
            }
        }
    }
    comm.barrier()
        .with_context(|| format!("rank {me}: barrier after migration"))?;
    for (l, e) in st.store.replicas() {
        if !mine.contains(&(l, e)) {
            st.store.remove(l, e);
        }
    }
    for &(l, e) in &mine {
        ensure!(
            st.store.contains(l, e),
            "the plan gives rank {me} expert {e} of layer {l}, but no state arrived for it"
        );
    }
    let dist = DistributedExperts::new(Box::new(comm), &st.store, cmd.replicas.clone())?;
    Ok((dist, bytes_in))
}

/// Writes this worker's parts of the checkpoint after `step` completed steps.
fn write_checkpoint(
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

fn held(store: &ExpertStore) -> Vec<(usize, usize)> {
    store.replicas()
}

fn error_text(e: &anyhow::Error) -> String {
    e.chain()
        .map(|c| c.to_string().lines().next().unwrap_or("").to_owned())
        .collect::<Vec<_>>()
        .join(": ")
}

/// Waits for the job, then runs the managed worker loop of the [module docs](self) until
/// [`Command::Stop`]. `emit` gets every output line (JSON).
pub fn run_managed_worker(
    commands: &Receiver<Command>,
    abort: &AbortSlot,
    mut emit: impl FnMut(&str) -> Result<()>,
) -> Result<Checksums> {
    let emit_ev = |ev: &WorkerEvent, emit: &mut dyn FnMut(&str) -> Result<()>| {
        emit(&serde_json::to_string(ev)?)
    };
    let job = match commands.recv() {
        Ok(Command::Job(job)) => job,
        Ok(other) => bail!("the first command must be Job, got {other:?}"),
        Err(_) => bail!("control channel closed before the job arrived"),
    };
    let cfg = job.config.clone();
    cfg.validate().context("model config")?;
    let mut st = State::fresh(&cfg)?;
    let listener = TcpListener::bind(job.listen)
        .with_context(|| format!("binding the data-plane listener {}", job.listen))?;
    let mut addr = listener.local_addr()?;
    if addr.ip().is_unspecified() {
        addr.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    emit_ev(&WorkerEvent::Ready { addr }, &mut emit)?;

    let corpus = Corpus::embedded();
    let tokens_per_step = (cfg.batch * cfg.seq_len) as u64;
    let mut dist: Option<DistributedExperts> = None;
    let mut rank = 0usize;
    let mut replicas: Vec<Vec<Vec<u32>>> = Vec::new();
    let mut snapshot: Option<(u64, Snapshot)> = None;
    let mut step = 0u64;
    let mut epoch = 0u64;
    let mut pause_pending = false;
    loop {
        let Some(d) = dist.as_mut() else {
            // Idle: wait for the controller.
            let cmd = commands
                .recv()
                .map_err(|_| anyhow!("control channel closed while waiting for a command"))?;
            match cmd {
                Command::Job(_) => bail!("a second Job command"),
                // Idle already: the controller has (or will get) this worker's idle report.
                Command::Pause | Command::Abort { .. } => {}
                Command::Stop => break,
                Command::Reconfigure(cmd) => {
                    let t1 = Instant::now();
                    pause_pending = false;
                    epoch = cmd.epoch;
                    if cmd.source == StateSource::Fresh && (step != 0 || !st.store.is_empty()) {
                        // A start that did not complete everywhere is redone from scratch.
                        st = State::fresh(&cfg)?;
                        step = cmd.resume_step;
                        snapshot = None;
                    }
                    let restoring = matches!(cmd.source, StateSource::Checkpoint { .. });
                    if !restoring && cmd.resume_step + 1 == step {
                        let Some((s, snap)) =
                            snapshot.take().filter(|(s, _)| *s == cmd.resume_step)
                        else {
                            bail!("no snapshot of step {} to roll back to", cmd.resume_step);
                        };
                        snap.restore(&mut st.opt, &mut st.store)?;
                        step = s;
                    }
                    let joining = matches!(&cmd.source,
                        StateSource::Peers { dense_to, .. } if dense_to.contains(&cmd.rank));
                    if joining {
                        // The dense state and the step counter come from a peer.
                        step = cmd.resume_step;
                        snapshot = None;
                    }
                    ensure!(
                        restoring || cmd.resume_step == step,
                        "asked to resume at step {} but this worker is at step {step}",
                        cmd.resume_step
                    );
                    match reconfigure(&cmd, &mut st, &listener, job.timeout_ms, abort) {
                        Ok((d, bytes_in)) => {
                            if restoring {
                                step = cmd.resume_step;
                                snapshot = None;
                            }
                            dist = Some(d);
                            rank = cmd.rank;
                            replicas = cmd.replicas.clone();
                            // A fresh start checkpoints its initial state, so that losing every
                            // replica of an expert before the first periodic checkpoint can
                            // still be recovered.
                            if cmd.source == StateSource::Fresh
                                && let Some(spec) =
                                    job.checkpoint.as_ref().filter(|c| c.every_steps > 0)
                            {
                                let parts = write_checkpoint(spec, step, &st, &replicas, rank)?;
                                let ev = WorkerEvent::Checkpointed { epoch, step, parts };
                                emit_ev(&ev, &mut emit)?;
                            }
                            let ev = WorkerEvent::Migrated {
                                epoch: cmd.epoch,
                                rank,
                                world: cmd.peers.len(),
                                resume_step: step,
                                bytes_in,
                                ms: ms_since(t1),
                            };
                            emit_ev(&ev, &mut emit)?;
                        }
                        Err(e) => {
                            let ev = WorkerEvent::Failed {
                                epoch,
                                step: if restoring { cmd.resume_step } else { step },
                                error: error_text(&e),
                                held: held(&st.store),
                            };
                            if restoring {
                                step = cmd.resume_step;
                                snapshot = None;
                            }
                            emit_ev(&ev, &mut emit)?;
                        }
                    }
                }
            }
            continue;
        };
        if step >= job.steps {
            dist = None;
            let ev = WorkerEvent::Finished {
                epoch,
                step,
                held: held(&st.store),
            };
            emit_ev(&ev, &mut emit)?;
            continue;
        }
        loop {
            match commands.try_recv() {
                Ok(Command::Pause) => pause_pending = true,
                // The communicator was aborted by the command reader; the step below fails.
                Ok(Command::Abort { .. }) => {}
                Ok(Command::Stop) => return finish(&job, rank, step, &st, emit),
                Ok(other) => bail!("unexpected command while training: {other:?}"),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    bail!("control channel closed while training")
                }
            }
        }
        let t0 = Instant::now();
        let res = corpus
            .batch(
                cfg.seed,
                step,
                job.shard,
                cfg.batch,
                cfg.seq_len + 1,
                &st.dev,
            )
            .map_err(anyhow::Error::from)
            .and_then(|tokens| {
                train_step_atomic(
                    &st.model,
                    &mut st.opt,
                    &mut st.store,
                    d,
                    &tokens,
                    pause_pending,
                )
            });
        match res {
            Ok((loss, stats, snap, pause)) => {
                snapshot = Some((step, snap));
                let line = StepLine {
                    step,
                    epoch,
                    loss,
                    tokens: tokens_per_step,
                    ms: ms_since(t0),
                    routing: stats.counts,
                };
                emit(&serde_json::to_string(&line)?)?;
                step += 1;
                if let Some(spec) = job.checkpoint.as_ref().filter(|c| c.every_steps > 0)
                    && step.is_multiple_of(spec.every_steps)
                {
                    let parts = write_checkpoint(spec, step, &st, &replicas, rank)?;
                    emit_ev(&WorkerEvent::Checkpointed { epoch, step, parts }, &mut emit)?;
                }
                if pause {
                    dist = None;
                    pause_pending = false;
                    let ev = WorkerEvent::Paused {
                        epoch,
                        step,
                        held: held(&st.store),
                    };
                    emit_ev(&ev, &mut emit)?;
                }
            }
            Err(e) => {
                // Discard the step and the broken communicator, then wait for the controller.
                dist = None;
                let ev = WorkerEvent::Failed {
                    epoch,
                    step,
                    error: error_text(&e),
                    held: held(&st.store),
                };
                emit_ev(&ev, &mut emit)?;
            }
        }
    }
    finish(&job, rank, step, &st, emit)
}

fn finish(
    job: &JobSpec,
    rank: usize,
    step: u64,
    st: &State,
    mut emit: impl FnMut(&str) -> Result<()>,
) -> Result<Checksums> {
    let mut sums = Checksums::collect(rank, 0, step, &st.model, &st.store)?;
    sums.node = Some(job.node_id);
    if let Some(dir) = &job.out {
        sums.write_named(dir, &format!("node{}.json", job.node_id))?;
    }
    emit(&serde_json::to_string(&WorkerEvent::Done(sums.clone()))?)?;
    Ok(sums)
}

/// Elapsed milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ParamState;

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
        assert!(decode_state(1, 2, 2, 4, &encode_state(&s)).is_err());
    }

    #[test]
    fn dense_roundtrip_is_exact() {
        let p = |name: &str, k: usize, x: f32| ParamState {
            name: name.into(),
            shape: vec![k],
            value: vec![x; k],
            m: vec![x * 2.0; k],
            v: vec![x * 3.0; k],
        };
        let s = OptimState {
            step: 77,
            params: vec![p("a", 3, 1.5), p("b", 2, -0.25)],
        };
        let template = OptimState {
            step: 0,
            params: vec![p("a", 3, 0.0), p("b", 2, 0.0)],
        };
        assert_eq!(decode_dense(&template, &encode_dense(&s)).unwrap(), s);
        assert!(decode_dense(&template, &[0.0; 3]).is_err());
    }

    #[test]
    fn lines_parse_as_steps_or_events() {
        let step = r#"{"step":3,"loss":2.5,"tokens":10,"ms":1.0,"routing":[[1,2]]}"#;
        assert!(matches!(WorkerLine::parse(step), Some(WorkerLine::Step(s)) if s.step == 3));
        let ev = serde_json::to_string(&WorkerEvent::Paused {
            epoch: 1,
            step: 4,
            held: vec![(0, 1)],
        })
        .unwrap();
        assert!(matches!(
            WorkerLine::parse(&ev),
            Some(WorkerLine::Event(WorkerEvent::Paused { step: 4, .. }))
        ));
        assert!(WorkerLine::parse("not json").is_none());
    }
}
