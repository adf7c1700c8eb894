//! # The job controller: one training job driven across agents and their workers
//!
//! [`JobDriver`] is a pure state machine (no I/O, no clock: every call takes `now_ms`) that
//! sequences the data plane around the [`ControllerState`] (registration, heartbeats, routing
//! loads, plans from the planner):
//!
//! * **Start.** Each registering node gets the [`Command::Job`]; its worker binds a data-plane
//!   listener and answers `Ready`. Once `initial_nodes` workers are ready, the first plan
//!   (Eq. 1 + MRO) goes out as one [`Command::Reconfigure`] per member (fresh initialisation,
//!   or the `--resume` checkpoint).
//! * **Training.** Step lines are aggregated into [`StepRecord`]s (when every member reported
//!   the step) and their routing counts into the load history. Checkpoint parts are collected
//!   and the checkpoint is committed once every member wrote its parts.
//! * **Quiescing.** A failure (a worker's `Failed`, a node gone or expired) or a planned change
//!   (a ready newcomer, a rebalance every `rebalance_every_steps`: [`Command::Pause`] to every
//!   member) waits until every live member is idle and has reported the replicas it holds.
//! * **Replan.** The holdings reported are the truth the planner starts from
//!   ([`ControllerState::set_holdings`]); `replan` gives the new plan with optimal migration,
//!   or a checkpoint-restore plan when some expert lost every replica. Every member then gets
//!   its [`Reconfigure`]: resume at the smallest step any member reported (members one step
//!   ahead roll back), a new epoch, transfers in ranks, and where state comes from. A failure
//!   during the reconfiguration sends the driver back to quiescing.
//! * **Stop.** When every member finished the last step, [`Command::Stop`] to every node;
//!   the job ends when every worker sent its checksums.
//!
//! [`run_job`] is the tokio server around the driver; `lzrun controller` and `lzrun local` run
//! it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use lazarus_planner::migrate::{PhysicalNode, lost_experts};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use super::controller::{ConfigError, ControllerConfig, ControllerState};
use super::proto::{self, Framed, ProtoError, ToAgent, ToController};
use super::shutdown_signal;
use crate::checkpoint;
use crate::metrics::{RecoveryRecord, StepRecord};
use crate::model::MoeConfig;
use crate::recovery::{
    CheckpointSpec, Command, JobSpec, Reconfigure, StateSource, WorkerEvent, WorkerLine,
};
use crate::worker::Checksums;

/// What the job trains, besides the controller's own configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobParams {
    pub config: MoeConfig,
    pub steps: u64,
    /// Communicator timeout of the workers.
    pub timeout_ms: u64,
    pub checkpoint: Option<CheckpointSpec>,
    /// How many checkpoints to keep.
    pub checkpoint_keep: usize,
    /// Checksum files of the workers.
    pub out: Option<PathBuf>,
    /// Replan from the routing history every this many steps (0: never).
    pub rebalance_every_steps: u64,
    /// Start from the newest valid checkpoint under this root instead of a fresh model.
    pub resume: Option<PathBuf>,
}

/// What the driver asks its server to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send this command to the node's worker.
    Send(u32, Command),
    /// A step completed on every member.
    Step(StepRecord),
    /// A reconfiguration completed (and training resumed).
    Reconfigured(RecoveryRecord),
    /// Something worth a log line.
    Log(String),
    /// The job is over: `Ok` when every worker finished, `Err` with the reason otherwise.
    Finished(Result<(), String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// The first plan (fresh or `--resume`).
    Start,
    Rebalance,
    Join,
    InPlace,
    Checkpoint,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Start => "start",
            Kind::Rebalance => "rebalance",
            Kind::Join => "join",
            Kind::InPlace => "in-place",
            Kind::Checkpoint => "checkpoint",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quiet {
    Failed,
    Paused,
    Finished,
}

#[derive(Debug, Clone)]
struct Node {
    name: String,
    addr: Option<SocketAddr>,
    /// Why and where the worker is idle, with what it holds.
    quiet: Option<QuietReport>,
    /// Took part in a plan (has trained state).
    trained: bool,
    done: Option<Checksums>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Gathering,
    Training,
    Quiescing,
    Reconfiguring,
    Stopping,
    Over,
}

#[derive(Debug, Clone)]
struct Pending {
    kind: Kind,
    detect_ms: f64,
    replan_ms: f64,
    sent_ms: u64,
    at_step: u64,
    resume_step: u64,
    nodes_before: usize,
    transfers: usize,
    waiting: BTreeSet<u32>,
    bytes: u64,
    /// A step completed before every member reported `Migrated`.
    stepped: bool,
}

/// See the [module docs](self).
#[derive(Debug)]
pub struct JobDriver {
    state: ControllerState,
    job: JobParams,
    nodes: BTreeMap<u32, Node>,
    phase: Phase,
    /// Members of the plan in force, in rank order.
    members: Vec<u32>,
    epoch: u64,
    plan_version: u64,
    /// Why the next reconfiguration happens, and since when.
    cause: Option<(Kind, u64)>,
    pending: Option<Pending>,
    /// A reconfiguration record waiting for the first step after it (its resume time).
    resuming: Option<(RecoveryRecord, u64)>,
    /// Per step, per node: `(loss, tokens, step_ms)` until every member reported.
    steps: BTreeMap<u64, BTreeMap<u32, StepReport>>,
    ckpt_parts: BTreeMap<u64, BTreeMap<u32, Vec<checkpoint::PartInfo>>>,
    start_ms: Option<u64>,
    checksums: Vec<Checksums>,
    /// Members when the cause of the next reconfiguration was first seen.
    members_before: usize,
}

/// One node's report of one step: loss, tokens, milliseconds.
type StepReport = (f32, u64, f64);

/// Why a worker is idle, at which step, holding which `(layer, expert)` replicas.
type QuietReport = (Quiet, u64, Vec<(usize, usize)>);

fn holdings_of(held: &[(usize, usize)], layers: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); layers];
    for &(l, e) in held {
        if l < layers {
            out[l].push(e as u32);
        }
    }
    out
}

impl JobDriver {
    pub fn new(cfg: ControllerConfig, job: JobParams) -> Result<Self, ConfigError> {
        Ok(Self {
            state: ControllerState::new(cfg)?,
            job,
            nodes: BTreeMap::new(),
            phase: Phase::Gathering,
            members: Vec::new(),
            epoch: 0,
            plan_version: 0,
            cause: None,
            pending: None,
            resuming: None,
            steps: BTreeMap::new(),
            ckpt_parts: BTreeMap::new(),
            start_ms: None,
            checksums: Vec::new(),
            members_before: 0,
        })
    }

    /// Checksums of every worker that stopped cleanly.
    pub fn checksums(&self) -> &[Checksums] {
        &self.checksums
    }

    pub fn state(&self) -> &ControllerState {
        &self.state
    }

    pub fn is_over(&self) -> bool {
        self.phase == Phase::Over
    }

    /// A node registers; on success its worker is sent the job.
    pub fn register(
        &mut self,
        version: u16,
        token: &str,
        name: &str,
        devices: usize,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) -> Result<u32, String> {
        if self.phase == Phase::Over || self.phase == Phase::Stopping {
            return Err("the job is over".into());
        }
        let id = self
            .state
            .register(version, token, name, devices, now_ms)
            .map_err(|r| r.to_string())?;
        self.nodes.insert(
            id,
            Node {
                name: name.to_owned(),
                addr: None,
                quiet: None,
                trained: false,
                done: None,
            },
        );
        let spec = JobSpec {
            config: self.job.config.clone(),
            steps: self.job.steps,
            shard: u64::from(id),
            node_id: id,
            // The agent puts its own data-plane address here.
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            timeout_ms: self.job.timeout_ms,
            checkpoint: self.job.checkpoint.clone(),
            out: self.job.out.clone(),
        };
        out.push(Action::Send(id, Command::Job(spec)));
        out.push(Action::Log(format!("node {id} ({name}) registered")));
        Ok(id)
    }

    pub fn heartbeat(&mut self, node_id: u32, now_ms: u64) -> bool {
        self.state.heartbeat(node_id, now_ms)
    }

    /// The launcher injected a fault now (starts the detection clock).
    pub fn fault_injected(&mut self, now_ms: u64) {
        self.note_cause(Kind::InPlace, now_ms);
    }

    /// A node left (goodbye, closed connection or expiry).
    pub fn gone(&mut self, node_id: u32, why: &str, now_ms: u64, out: &mut Vec<Action>) {
        self.state.leave(node_id);
        let Some(node) = self.nodes.remove(&node_id) else {
            return;
        };
        if node.done.is_some() {
            return;
        }
        out.push(Action::Log(format!(
            "node {node_id} ({}) is gone: {why}",
            node.name
        )));
        if self.members.contains(&node_id) {
            self.note_cause(Kind::InPlace, now_ms);
            self.members.retain(|&m| m != node_id);
            if matches!(self.phase, Phase::Training | Phase::Reconfiguring) {
                self.phase = Phase::Quiescing;
            }
        }
        self.progress(now_ms, out);
    }

    /// Expires silent nodes and moves on.
    pub fn tick(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        for id in self.state.expire(now_ms) {
            self.gone(id, "no heartbeat", now_ms, out);
        }
        self.progress(now_ms, out);
    }

    fn note_cause(&mut self, kind: Kind, now_ms: u64) {
        match &mut self.cause {
            Some((k, _)) => *k = (*k).max(kind),
            None => {
                self.cause = Some((kind, now_ms));
                self.members_before = self.members.len();
            }
        }
    }

    /// One line from a node's worker.
    pub fn line(&mut self, node_id: u32, line: &str, now_ms: u64, out: &mut Vec<Action>) {
        let Some(parsed) = WorkerLine::parse(line) else {
            out.push(Action::Log(format!("node {node_id}: {line}")));
            return;
        };
        if !self.nodes.contains_key(&node_id) {
            return;
        }
        match parsed {
            WorkerLine::Step(s) => {
                // A step completes during quiescing too (the one carrying the pause vote, or
                // the last one while others report `Finished`), and during a reconfiguration:
                // a member may finish the first step after it before another member's
                // `Migrated` got here (different agent connections). Lines of an older epoch
                // cannot arrive after a replan: a worker reports its last step before going
                // idle, and a replan waits for every member to be idle.
                let counting = matches!(
                    self.phase,
                    Phase::Training | Phase::Quiescing | Phase::Reconfiguring
                );
                if !self.members.contains(&node_id) || !counting {
                    return;
                }
                if !s.routing.is_empty()
                    && let Err(e) = self.state.record_routing(node_id, s.step, &s.routing)
                {
                    out.push(Action::Log(format!("node {node_id}: routing counts: {e}")));
                }
                self.steps
                    .entry(s.step)
                    .or_default()
                    .insert(node_id, (s.loss, s.tokens, s.ms));
                self.flush_steps(now_ms, out);
            }
            WorkerLine::Event(ev) => self.event(node_id, ev, now_ms, out),
        }
        self.progress(now_ms, out);
    }

    fn flush_steps(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        while let Some(entry) = self.steps.first_entry() {
            if !self.members.iter().all(|m| entry.get().contains_key(m)) {
                break;
            }
            let (step, by_node) = entry.remove_entry();
            let n = by_node.len().max(1);
            let loss = by_node.values().map(|v| f64::from(v.0)).sum::<f64>() / n as f64;
            let tokens: u64 = by_node.values().map(|v| v.1).sum();
            let step_ms = by_node.values().map(|v| v.2).fold(0.0, f64::max);
            let start = *self.start_ms.get_or_insert(now_ms);
            let rec = StepRecord {
                step,
                t_s: now_ms.saturating_sub(start) as f64 / 1e3,
                loss,
                tokens,
                samples: (by_node.len() * self.job.config.batch) as u64,
                live_nodes: self.nodes.len(),
                used_nodes: self.members.len(),
                plan_version: self.plan_version,
                step_ms,
            };
            if let Some(p) = self.pending.as_mut() {
                p.stepped = true;
            }
            if let Some((mut r, t)) = self.resuming.take() {
                r.resume_ms = now_ms.saturating_sub(t) as f64;
                r.total_ms = r.detect_ms + r.replan_ms + r.migrate_ms + r.resume_ms;
                out.push(Action::Reconfigured(r));
            }
            out.push(Action::Step(rec));
            let done = step + 1;
            let every = self.job.rebalance_every_steps;
            if every > 0
                && done.is_multiple_of(every)
                && done + 1 < self.job.steps
                && self.phase == Phase::Training
            {
                self.note_cause(Kind::Rebalance, now_ms);
                self.pause(out);
            }
        }
    }

    fn pause(&mut self, out: &mut Vec<Action>) {
        if self.phase != Phase::Training {
            return;
        }
        self.phase = Phase::Quiescing;
        for &m in &self.members {
            out.push(Action::Send(m, Command::Pause));
        }
    }

    fn event(&mut self, node_id: u32, ev: WorkerEvent, now_ms: u64, out: &mut Vec<Action>) {
        let is_member = self.members.contains(&node_id);
        let node = self.nodes.get_mut(&node_id).expect("checked by the caller");
        match ev {
            WorkerEvent::Ready { addr } => {
                node.addr = Some(addr);
                if self.phase == Phase::Training && !is_member {
                    out.push(Action::Log(format!(
                        "node {node_id} ready at {addr}: scaling out at the next step"
                    )));
                    self.note_cause(Kind::Join, now_ms);
                    self.pause(out);
                }
            }
            WorkerEvent::Failed { step, error, held } => {
                out.push(Action::Log(format!(
                    "node {node_id}: step {step} failed: {error}"
                )));
                node.quiet = Some((Quiet::Failed, step, held));
                if is_member {
                    self.note_cause(Kind::InPlace, now_ms);
                    if matches!(self.phase, Phase::Training | Phase::Reconfiguring) {
                        self.phase = Phase::Quiescing;
                    }
                }
            }
            WorkerEvent::Paused { step, held } => {
                node.quiet = Some((Quiet::Paused, step, held));
            }
            WorkerEvent::Finished { step, held } => {
                node.quiet = Some((Quiet::Finished, step, held));
                if self.phase == Phase::Training {
                    self.phase = Phase::Quiescing;
                }
            }
            WorkerEvent::Migrated {
                epoch, bytes_in, ..
            } => {
                if epoch != self.epoch {
                    return;
                }
                if let Some(p) = self.pending.as_mut() {
                    p.bytes += bytes_in;
                    p.waiting.remove(&node_id);
                }
            }
            WorkerEvent::Checkpointed { step, parts } => {
                if is_member {
                    self.ckpt_parts
                        .entry(step)
                        .or_default()
                        .insert(node_id, parts);
                    self.commit_checkpoints(out);
                }
            }
            WorkerEvent::Done(sums) => {
                node.done = Some(sums.clone());
                self.checksums.push(sums);
            }
        }
    }

    fn commit_checkpoints(&mut self, out: &mut Vec<Action>) {
        let Some(spec) = self.job.checkpoint.clone() else {
            return;
        };
        while let Some(entry) = self.ckpt_parts.first_entry() {
            if !self.members.iter().all(|m| entry.get().contains_key(m)) {
                break;
            }
            let (step, by_node) = entry.remove_entry();
            let parts: Vec<_> = by_node.into_values().flatten().collect();
            let manifest = checkpoint::Manifest {
                format_version: checkpoint::FORMAT_VERSION,
                step,
                world: self.members.len(),
                plan_version: self.plan_version,
                config: self.job.config.clone(),
                parts,
            };
            let expected = checkpoint::all_parts(self.job.config.n_layers, self.job.config.experts);
            match checkpoint::commit(&spec.root, manifest, &expected, self.job.checkpoint_keep) {
                Ok(dir) => out.push(Action::Log(format!(
                    "checkpoint after step {} committed: {}",
                    step.saturating_sub(1),
                    dir.display()
                ))),
                Err(e) => out.push(Action::Log(format!(
                    "checkpoint of step {step} failed: {e}"
                ))),
            }
        }
    }

    /// Moves the job forward once the conditions of the current phase hold.
    fn progress(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        match self.phase {
            Phase::Gathering => {
                let ready = self.nodes.values().filter(|n| n.addr.is_some()).count();
                let all_ready = self.nodes.values().all(|n| n.addr.is_some());
                if ready >= self.state.config().initial_nodes && all_ready {
                    self.cause = Some((Kind::Start, now_ms));
                    self.replan(now_ms, out);
                }
            }
            Phase::Quiescing => {
                let live: Vec<u32> = self.members.clone();
                let all_quiet = live.iter().all(|m| self.nodes[m].quiet.is_some());
                let all_ready = self.nodes.values().all(|n| n.addr.is_some());
                if !all_quiet || !all_ready {
                    return;
                }
                let finished = !live.is_empty()
                    && live.iter().all(|m| {
                        matches!(self.nodes[m].quiet, Some((Quiet::Finished, s, _)) if s >= self.job.steps)
                    });
                if finished {
                    self.phase = Phase::Stopping;
                    for &id in self.nodes.keys() {
                        out.push(Action::Send(id, Command::Stop));
                    }
                    out.push(Action::Log("every member finished; stopping".into()));
                    return;
                }
                self.replan(now_ms, out);
            }
            Phase::Reconfiguring => {
                if self.pending.as_ref().is_some_and(|p| p.waiting.is_empty()) {
                    let p = self.pending.take().expect("checked");
                    let mut rec = RecoveryRecord {
                        kind: p.kind.name().into(),
                        at_step: p.at_step,
                        resume_step: p.resume_step,
                        nodes_before: p.nodes_before,
                        nodes_after: self.members.len(),
                        transfers: p.transfers,
                        bytes: p.bytes,
                        detect_ms: p.detect_ms,
                        replan_ms: p.replan_ms,
                        migrate_ms: now_ms.saturating_sub(p.sent_ms) as f64,
                        resume_ms: 0.0,
                        total_ms: 0.0,
                        plan_version: self.plan_version,
                    };
                    out.push(Action::Log(format!(
                        "epoch {}: {} reconfiguration done, {} members, resuming at step {}",
                        self.epoch,
                        p.kind.name(),
                        self.members.len(),
                        p.resume_step
                    )));
                    if p.stepped {
                        // Training already resumed before the last `Migrated` arrived.
                        rec.total_ms = rec.detect_ms + rec.replan_ms + rec.migrate_ms;
                        out.push(Action::Reconfigured(rec));
                    } else {
                        self.resuming = Some((rec, now_ms));
                    }
                    self.phase = Phase::Training;
                    // A node that became ready meanwhile joins at the next step.
                    if self
                        .nodes
                        .iter()
                        .any(|(id, n)| n.addr.is_some() && !self.members.contains(id))
                    {
                        self.note_cause(Kind::Join, now_ms);
                        self.pause(out);
                    }
                }
            }
            Phase::Stopping => {
                if self.nodes.values().all(|n| n.done.is_some()) {
                    self.phase = Phase::Over;
                    out.push(Action::Finished(Ok(())));
                }
            }
            Phase::Training | Phase::Over => {}
        }
    }

    fn fail(&mut self, why: String, out: &mut Vec<Action>) {
        self.phase = Phase::Over;
        for &id in self.nodes.keys() {
            out.push(Action::Send(id, Command::Stop));
        }
        out.push(Action::Finished(Err(why)));
    }

    /// Plans the next membership and sends every member its [`Reconfigure`].
    fn replan(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let (mut kind, since) = self.cause.take().unwrap_or((Kind::Rebalance, now_ms));
        let layers = self.job.config.n_layers;
        let experts = self.job.config.experts;
        let first = self.epoch == 0;
        // The holdings workers reported are what the planner starts from.
        let mut resume_step = u64::MAX;
        let mut physical = Vec::new();
        for (&id, n) in &self.nodes {
            if let Some((_, step, held)) = &n.quiet {
                self.state.set_holdings(id, holdings_of(held, layers));
                if self.members.contains(&id) {
                    resume_step = resume_step.min(*step);
                }
            }
            if n.trained {
                let held = n.quiet.as_ref().map(|q| q.2.clone()).unwrap_or_default();
                physical.push(PhysicalNode {
                    id,
                    holdings: holdings_of(&held, layers),
                });
            }
        }
        if resume_step == u64::MAX {
            resume_step = 0;
        }
        let lost = if first {
            Vec::new()
        } else {
            lost_experts(&physical, layers, experts)
        };
        self.state.request_rebalance();
        let t = std::time::Instant::now();
        let Some(plan) = self.state.replan(now_ms) else {
            let why = self
                .state
                .last_error()
                .map_or_else(|| "no plan was due".to_owned(), ToString::to_string);
            return self.fail(
                format!("replanning for {} nodes failed: {why}", self.nodes.len()),
                out,
            );
        };
        let replan_ms = t.elapsed().as_secs_f64() * 1e3;
        let rank_of: HashMap<u32, usize> = plan
            .members
            .iter()
            .enumerate()
            .map(|(r, &id)| (id, r))
            .collect();
        let source;
        if first {
            if let Some(root) = self.job.resume.clone() {
                match checkpoint::load_latest(&root, &self.job.config) {
                    Ok(l) => {
                        for (dir, why) in &l.rejected {
                            out.push(Action::Log(format!(
                                "skipped checkpoint {}: {why}",
                                dir.display()
                            )));
                        }
                        out.push(Action::Log(format!(
                            "resuming from {} (step {})",
                            l.dir.display(),
                            l.manifest.step
                        )));
                        resume_step = l.manifest.step;
                        source = StateSource::Checkpoint {
                            root,
                            step: l.manifest.step,
                        };
                    }
                    Err(e) => return self.fail(format!("--resume: {e}"), out),
                }
            } else {
                source = StateSource::Fresh;
            }
        } else if plan.restore_from_checkpoint {
            kind = Kind::Checkpoint;
            let names = lost
                .iter()
                .map(|(l, e)| format!("expert {e} of layer {l}"))
                .collect::<Vec<_>>()
                .join(", ");
            let Some(spec) = self.job.checkpoint.clone() else {
                return self.fail(
                    format!("{names} lost every replica and checkpoints are off (--ckpt-every 0)"),
                    out,
                );
            };
            match checkpoint::load_latest(&spec.root, &self.job.config) {
                Ok(l) => {
                    out.push(Action::Log(format!(
                        "{names} lost every replica: restoring the checkpoint of step {} ({})",
                        l.manifest.step,
                        l.dir.display()
                    )));
                    for (dir, why) in &l.rejected {
                        out.push(Action::Log(format!(
                            "skipped checkpoint {}: {why}",
                            dir.display()
                        )));
                    }
                    resume_step = l.manifest.step;
                    source = StateSource::Checkpoint {
                        root: spec.root,
                        step: l.manifest.step,
                    };
                }
                Err(e) => {
                    return self.fail(
                        format!(
                            "{names} lost every replica and no checkpoint can be restored: {e}"
                        ),
                        out,
                    );
                }
            }
        } else {
            let dense_from = plan
                .members
                .iter()
                .position(|id| self.nodes.get(id).is_some_and(|n| n.trained))
                .unwrap_or(0);
            let dense_to = plan
                .members
                .iter()
                .filter(|id| self.nodes.get(id).is_some_and(|n| !n.trained))
                .map(|id| rank_of[id])
                .collect();
            source = StateSource::Peers {
                dense_from,
                dense_to,
            };
        }
        let world = plan.members.len();
        let mut replicas = vec![vec![vec![0u32; world]; experts]; layers];
        for (id, holdings) in &plan.assignment {
            let r = rank_of[id];
            for (l, ids) in holdings.iter().enumerate() {
                for &e in ids {
                    replicas[l][e as usize][r] += 1;
                }
            }
        }
        let transfers: Vec<(usize, usize, usize, usize)> =
            if matches!(source, StateSource::Peers { .. }) {
                plan.transfers
                    .iter()
                    .filter_map(|&(l, e, s, d)| {
                        Some((l as usize, e as usize, *rank_of.get(&s)?, *rank_of.get(&d)?))
                    })
                    .collect()
            } else {
                Vec::new()
            };
        let peers: Option<Vec<SocketAddr>> =
            plan.members.iter().map(|id| self.nodes[id].addr).collect();
        let Some(peers) = peers else {
            return self.fail("a member has no data-plane address".into(), out);
        };
        self.epoch += 1;
        self.plan_version = plan.version;
        let nodes_before = self.members_before;
        self.members = plan.members.clone();
        self.ckpt_parts.clear();
        self.steps.clear();
        let at_step = resume_step;
        for (r, &id) in plan.members.iter().enumerate() {
            let cmd = Reconfigure {
                rank: r,
                peers: peers.clone(),
                epoch: self.epoch,
                plan_version: plan.version,
                replicas: replicas.clone(),
                transfers: transfers.clone(),
                source: source.clone(),
                resume_step,
            };
            out.push(Action::Send(id, Command::Reconfigure(cmd)));
        }
        for n in self.nodes.values_mut() {
            n.quiet = None;
        }
        for id in &plan.members {
            if let Some(n) = self.nodes.get_mut(id) {
                n.trained = true;
            }
        }
        out.push(Action::Log(format!(
            "epoch {}: plan v{} ({}) over {world} nodes {:?}, {} transfers, resume at step {resume_step}",
            self.epoch,
            plan.version,
            kind.name(),
            plan.members,
            transfers.len()
        )));
        self.pending = Some(Pending {
            kind,
            detect_ms: now_ms.saturating_sub(since) as f64,
            replan_ms,
            sent_ms: now_ms,
            at_step,
            resume_step,
            nodes_before,
            transfers: transfers.len(),
            waiting: plan.members.iter().copied().collect(),
            bytes: 0,
            stepped: false,
        });
        self.phase = Phase::Reconfiguring;
    }
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

/// Why the job controller could not run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("invalid controller configuration: {0}")]
    Config(#[from] ConfigError),
}

/// What the server tells whoever runs it (the `lzrun` binary).
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    Step(StepRecord),
    Reconfigured(RecoveryRecord),
    Log(String),
    Finished(Result<(), String>),
}

struct Shared {
    driver: JobDriver,
    outboxes: HashMap<u32, mpsc::UnboundedSender<ToAgent>>,
}

struct Ctx {
    shared: Mutex<Shared>,
    start: Instant,
    notices: mpsc::UnboundedSender<Notice>,
    io_timeout: Duration,
}

impl Ctx {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the driver and carries out the actions it returns.
    fn with_driver<T>(&self, f: impl FnOnce(&mut JobDriver, u64, &mut Vec<Action>) -> T) -> T {
        let now = self.now_ms();
        let mut g = self.lock();
        let mut actions = Vec::new();
        let r = f(&mut g.driver, now, &mut actions);
        for a in actions {
            match a {
                Action::Send(id, cmd) => {
                    if let Some(tx) = g.outboxes.get(&id) {
                        // Commands are plain data; serde_json cannot fail on them.
                        let line = serde_json::to_string(&cmd).unwrap_or_default();
                        let _ = tx.send(ToAgent::Worker { line });
                    }
                }
                Action::Step(s) => {
                    let _ = self.notices.send(Notice::Step(s));
                }
                Action::Reconfigured(r) => {
                    let _ = self.notices.send(Notice::Reconfigured(r));
                }
                Action::Log(l) => {
                    let _ = self.notices.send(Notice::Log(l));
                }
                Action::Finished(r) => {
                    let _ = self.notices.send(Notice::Finished(r));
                }
            }
        }
        r
    }
}

/// A handle to tell the running job that a fault was injected (for the detection clock).
#[derive(Clone)]
pub struct JobHandle {
    ctx: Arc<Ctx>,
}

impl JobHandle {
    pub fn fault_injected(&self) {
        self.ctx.with_driver(|d, now, _| d.fault_injected(now));
    }
}

/// Runs the job controller on `listener` until the job is over or `shutdown` turns `true`
/// (then every agent is told to shut down). Notices go to `notices`; the returned driver
/// holds the final state (checksums). `on_start` gets a [`JobHandle`] before serving.
pub async fn run_job(
    listener: TcpListener,
    cfg: ControllerConfig,
    job: JobParams,
    notices: mpsc::UnboundedSender<Notice>,
    mut shutdown: watch::Receiver<bool>,
    on_start: impl FnOnce(JobHandle),
) -> Result<Vec<Checksums>, JobError> {
    let tick = Duration::from_millis(cfg.tick_ms);
    let io_timeout = Duration::from_millis(cfg.heartbeat_timeout_ms);
    let driver = JobDriver::new(cfg, job)?;
    let ctx = Arc::new(Ctx {
        shared: Mutex::new(Shared {
            driver,
            outboxes: HashMap::new(),
        }),
        start: Instant::now(),
        notices,
        io_timeout,
    });
    on_start(JobHandle { ctx: ctx.clone() });
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut conns = JoinSet::new();
    loop {
        if ctx.lock().driver.is_over() {
            break;
        }
        tokio::select! {
            _ = shutdown_signal(&mut shutdown) => break,
            _ = ticker.tick() => ctx.with_driver(|d, now, out| d.tick(now, out)),
            accepted = listener.accept() => if let Ok((stream, _)) = accepted {
                let _ = stream.set_nodelay(true);
                conns.spawn(serve_conn(stream, ctx.clone()));
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    // Tell every connected agent to stop, then give the connections a moment to drain.
    {
        let g = ctx.lock();
        for tx in g.outboxes.values() {
            let _ = tx.send(ToAgent::Shutdown);
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    conns.abort_all();
    let sums = ctx.lock().driver.checksums().to_vec();
    Ok(sums)
}

async fn serve_conn(stream: TcpStream, ctx: Arc<Ctx>) {
    let mut framed = proto::framed(stream);
    let _ = serve(&mut framed, &ctx).await;
}

async fn write(ctx: &Ctx, framed: &mut Framed, msg: &ToAgent) -> Result<(), ProtoError> {
    let frame: Bytes = proto::encode(msg)?;
    match tokio::time::timeout(ctx.io_timeout, framed.send(frame)).await {
        Ok(sent) => Ok(sent?),
        Err(_) => Err(ProtoError::Io(std::io::ErrorKind::TimedOut.into())),
    }
}

async fn reject(ctx: &Ctx, framed: &mut Framed, reason: String) -> Result<(), ProtoError> {
    write(ctx, framed, &ToAgent::Rejected { reason }).await?;
    let _ = tokio::time::timeout(ctx.io_timeout, SinkExt::<Bytes>::close(framed)).await;
    Ok(())
}

async fn serve(framed: &mut Framed, ctx: &Ctx) -> Result<(), ProtoError> {
    let (version, token, node, devices) = match proto::read_register(framed, ctx.io_timeout).await?
    {
        proto::FirstFrame::Register(r) => (r.version, r.token, r.node, r.devices),
        proto::FirstFrame::Closed => return Ok(()),
        proto::FirstFrame::Reject(reason) => return reject(ctx, framed, reason).await,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Register and install the outbox under one lock, so the Job command is not lost.
    let registered = {
        let now = ctx.now_ms();
        let mut g = ctx.lock();
        let mut actions = Vec::new();
        let r = g
            .driver
            .register(version, &token, &node, devices, now, &mut actions);
        if let Ok(id) = r {
            g.outboxes.insert(id, tx);
            // The actions (the Job command, a log line) go out through `with_driver`'s path.
            drop(g);
            ctx.with_driver(|_, _, out| out.extend(actions));
        }
        r
    };
    let node_id = match registered {
        Ok(id) => id,
        Err(reason) => return reject(ctx, framed, reason).await,
    };
    write(ctx, framed, &ToAgent::Registered { node_id }).await?;
    let why = loop {
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(m) => {
                    let stop = matches!(m, ToAgent::Shutdown);
                    if write(ctx, framed, &m).await.is_err() {
                        break "connection lost".to_owned();
                    }
                    if stop {
                        break "shut down".to_owned();
                    }
                }
                None => break "outbox closed".to_owned(),
            },
            frame = framed.next() => {
                let Some(Ok(frame)) = frame else {
                    // The agent process is gone (a reconnecting agent registers anew).
                    break "connection closed".to_owned();
                };
                match proto::decode::<ToController>(&frame) {
                    Ok(ToController::Heartbeat { node_id: id, .. }) if id == node_id => {
                        let live = ctx.with_driver(|d, now, _| d.heartbeat(node_id, now));
                        if !live {
                            let _ = reject(ctx, framed, format!("node {node_id} expired")).await;
                            break "expired".to_owned();
                        }
                    }
                    Ok(ToController::Worker { node_id: id, line }) if id == node_id => {
                        ctx.with_driver(|d, now, out| d.line(node_id, &line, now, out));
                    }
                    Ok(ToController::Bye { node_id: id }) if id == node_id => {
                        break "said goodbye".to_owned();
                    }
                    Ok(ToController::RoutingStats { .. }) => {}
                    Ok(_) => {
                        let _ = reject(ctx, framed, format!("node {node_id} fenced: unexpected message")).await;
                        break "protocol violation".to_owned();
                    }
                    Err(e) => {
                        let _ = reject(ctx, framed, format!("node {node_id} fenced: {e}")).await;
                        break format!("protocol violation: {e}");
                    }
                }
            }
        }
    };
    ctx.lock().outboxes.remove(&node_id);
    ctx.with_driver(|d, now, out| d.gone(node_id, &why, now, out));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::PROTOCOL_VERSION;
    use crate::worker::StepLine;

    fn driver() -> JobDriver {
        let config = MoeConfig::tiny();
        let mut cfg = ControllerConfig::new("t", config.experts, config.n_layers, 4);
        cfg.initial_nodes = 2;
        cfg.scale_out_wait_ms = 0;
        let job = JobParams {
            config,
            steps: 4,
            timeout_ms: 1_000,
            checkpoint: None,
            checkpoint_keep: 1,
            out: None,
            rebalance_every_steps: 0,
            resume: None,
        };
        JobDriver::new(cfg, job).unwrap()
    }

    fn event(ev: &WorkerEvent) -> String {
        serde_json::to_string(ev).unwrap()
    }

    fn step(step: u64) -> String {
        serde_json::to_string(&StepLine {
            step,
            loss: 1.0,
            tokens: 8,
            ms: 1.0,
            routing: Vec::new(),
        })
        .unwrap()
    }

    fn steps_in(out: &[Action]) -> Vec<u64> {
        out.iter()
            .filter_map(|a| match a {
                Action::Step(r) => Some(r.step),
                _ => None,
            })
            .collect()
    }

    /// Two nodes started: both got their first `Reconfigure`.
    fn started() -> (JobDriver, u32, u32) {
        let mut d = driver();
        let mut out = Vec::new();
        let a = d
            .register(PROTOCOL_VERSION, "t", "n0", 1, 0, &mut out)
            .unwrap();
        let b = d
            .register(PROTOCOL_VERSION, "t", "n1", 1, 0, &mut out)
            .unwrap();
        for (id, port) in [(a, 1), (b, 2)] {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            d.line(id, &event(&WorkerEvent::Ready { addr }), 1, &mut out);
        }
        let sent = out
            .iter()
            .filter(|a| matches!(a, Action::Send(_, Command::Reconfigure(_))))
            .count();
        assert_eq!(sent, 2);
        (d, a, b)
    }

    fn migrated() -> String {
        event(&WorkerEvent::Migrated {
            epoch: 1,
            rank: 0,
            world: 2,
            resume_step: 0,
            bytes_in: 0,
            ms: 1.0,
        })
    }

    #[test]
    fn a_step_completed_before_the_last_migrated_arrives_is_counted() {
        let (mut d, a, b) = started();
        let mut out = Vec::new();
        d.line(a, &migrated(), 2, &mut out);
        // Node a's relay is faster: both members' step 0 arrive before b's `Migrated`.
        d.line(a, &step(0), 3, &mut out);
        d.line(b, &step(0), 3, &mut out);
        d.line(b, &migrated(), 4, &mut out);
        d.line(a, &step(1), 5, &mut out);
        d.line(b, &step(1), 5, &mut out);
        assert_eq!(steps_in(&out), vec![0, 1]);
        let recs: Vec<&RecoveryRecord> = out
            .iter()
            .filter_map(|a| match a {
                Action::Reconfigured(r) => Some(r),
                _ => None,
            })
            .collect();
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].resume_ms, 0.0);
    }

    #[test]
    fn a_step_needs_every_member_and_resume_time_is_measured() {
        let (mut d, a, b) = started();
        let mut out = Vec::new();
        d.line(a, &migrated(), 2, &mut out);
        d.line(b, &migrated(), 2, &mut out);
        d.line(a, &step(0), 10, &mut out);
        assert!(steps_in(&out).is_empty(), "b has not reported step 0");
        d.line(b, &step(0), 12, &mut out);
        assert_eq!(steps_in(&out), vec![0]);
        let rec = out
            .iter()
            .find_map(|a| match a {
                Action::Reconfigured(r) => Some(r),
                _ => None,
            })
            .expect("the start record");
        assert_eq!((rec.kind.as_str(), rec.resume_ms), ("start", 10.0));
    }
}
