//! # The controller: the I/O shell of the planner's job state machine
//!
//! Every control decision of a job — start, restore or replan in place, lazy scale-out,
//! rebalance cadence, resume step, which step counts, fencing a stuck member, waiting for
//! nodes, committing a checkpoint, the end-of-job consistency check — is made by
//! [`lazarus_planner::job::JobMachine`], the same code `lzsim replay` drives. [`Controller`]
//! only translates: agents' registrations and worker lines become machine [`Event`]s, and the
//! machine's [`Action`]s become [`Command`]s for the workers, checkpoint file operations (whose
//! outcome goes back to the machine as an event) and [`Notice`]s for whoever runs the job.
//! [`crate::control::server`] puts it behind sockets and a ticker.
//!
//! What stays here is what the machine must not know: credentials (protocol version, token,
//! names), the workers' data-plane addresses, checkpoint paths and files, and wall-clock
//! measurements (the replan time).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use lazarus_planner::job::{
    self, Action, Event, IdleReason, JobConfig, JobConfigError, JobMachine, NodeId,
    Reconfiguration, StateChecksums, StepReport,
};

use super::printable;
use super::proto::{
    MAX_DEVICES_PER_NODE, MAX_NODE_NAME_BYTES, PROTOCOL_VERSION, Registration, Reject, ToAgent,
};
use crate::checkpoint;
use crate::comm::MeshSecret;
use crate::metrics::{RecoveryRecord, StepRecord};
use crate::model::MoeConfig;
use crate::worker::Checksums;
use crate::worker::{
    CheckpointSpec, Command, JobSpec, Reconfigure, StateSource, WorkerEvent, WorkerLine,
};

/// What a job trains and how, besides the control rules ([`JobConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct JobParams {
    pub config: MoeConfig,
    /// The control rules' parameters (steps, slots, `f`, timeouts, cadences).
    pub rules: JobConfig,
    /// Shared secret every agent must present. It keeps stray or misconfigured agents out of
    /// the cluster; it is not a defence against an attacker on the network (no TLS).
    pub token: String,
    /// Communicator timeout of the workers.
    pub timeout_ms: u64,
    pub checkpoint: Option<CheckpointSpec>,
    /// How many checkpoints to keep.
    pub checkpoint_keep: usize,
    /// Checksum files of the workers.
    pub out: Option<PathBuf>,
    /// Start from the newest valid checkpoint under this root instead of a fresh model.
    pub resume: Option<PathBuf>,
}

/// What the controller tells whoever runs the job.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    Step(StepRecord),
    Reconfigured(RecoveryRecord),
    Log(String),
    /// Too few nodes to hold every expert: the job waits for joins (`reason` says for what).
    WaitingForNodes {
        live: usize,
        reason: String,
    },
    /// The node named so was declared failed, and why (its processes should be killed).
    Fenced {
        name: String,
        reason: String,
    },
    Finished(Result<(), String>),
}

/// What the server must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send this to the node's agent.
    Send(NodeId, ToAgent),
    /// Close the node's connection once what was queued for it is sent.
    Close(NodeId),
    Notice(Notice),
}

/// See the [module docs](self).
#[derive(Debug)]
pub struct Controller {
    machine: JobMachine,
    params: JobParams,
    names: BTreeMap<NodeId, String>,
    addrs: BTreeMap<NodeId, SocketAddr>,
    next_id: NodeId,
    /// Checkpoint parts written, by step then node.
    parts: BTreeMap<u64, BTreeMap<NodeId, Vec<checkpoint::PartInfo>>>,
    checksums: Vec<Checksums>,
    start_ms: Option<u64>,
    /// Wall time of the last planning call that issued a reconfiguration.
    replan_ms: f64,
}

impl Controller {
    pub fn new(params: JobParams) -> Result<Self, JobConfigError> {
        Ok(Self {
            machine: JobMachine::new(params.rules.clone())?,
            params,
            names: BTreeMap::new(),
            addrs: BTreeMap::new(),
            next_id: 0,
            parts: BTreeMap::new(),
            checksums: Vec::new(),
            start_ms: None,
            replan_ms: 0.0,
        })
    }

    pub fn machine(&self) -> &JobMachine {
        &self.machine
    }

    pub fn is_over(&self) -> bool {
        self.machine.is_over()
    }

    /// Checksums of every worker that stopped cleanly.
    pub fn checksums(&self) -> &[Checksums] {
        &self.checksums
    }

    /// Admits a node: protocol version, token, a well-formed name no live node uses (see
    /// [`check_node_name`]), 1 to [`MAX_DEVICES_PER_NODE`] devices. Ids are never reused.
    pub fn register(
        &mut self,
        reg: &Registration,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) -> Result<NodeId, Reject> {
        if reg.version != PROTOCOL_VERSION {
            return Err(Reject::Version {
                agent: reg.version,
                controller: PROTOCOL_VERSION,
            });
        }
        if !tokens_match(&reg.token, &self.params.token) {
            return Err(Reject::BadToken);
        }
        // The name goes into log lines and notices from here on, so it is checked first.
        if let Err(why) = check_node_name(&reg.node) {
            let name = format!("\"{}\"", printable(&reg.node, 64));
            return Err(Reject::BadName { name, why });
        }
        if reg.devices == 0 {
            return Err(Reject::NoDevices(reg.node.clone()));
        }
        if reg.devices > MAX_DEVICES_PER_NODE {
            return Err(Reject::TooManyDevices {
                node: reg.node.clone(),
                devices: reg.devices,
            });
        }
        if self.names.values().any(|n| *n == reg.node) {
            return Err(Reject::DuplicateName(reg.node.clone()));
        }
        if self.machine.is_over() {
            return Err(Reject::Over);
        }
        let id = self.next_id;
        self.next_id = id.checked_add(1).ok_or(Reject::IdsExhausted)?;
        self.names.insert(id, reg.node.clone());
        let name = reg.node.clone();
        self.feed(now_ms, Event::Joined { node: id, name }, out);
        Ok(id)
    }

    /// A heartbeat; `false` if the node is not (any more) part of the job.
    pub fn heartbeat(&mut self, node: NodeId, now_ms: u64, out: &mut Vec<Output>) -> bool {
        if !self.names.contains_key(&node) {
            return false;
        }
        self.feed(now_ms, Event::Heartbeat { node }, out);
        true
    }

    /// The node's connection ended (goodbye, closed, protocol violation).
    pub fn gone(&mut self, node: NodeId, reason: &str, now_ms: u64, out: &mut Vec<Output>) {
        if self.names.remove(&node).is_some() {
            let reason = reason.to_owned();
            self.feed(now_ms, Event::Lost { node, reason }, out);
        }
    }

    pub fn tick(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        self.feed(now_ms, Event::Tick, out);
    }

    /// The launcher injected a fault now (the detection clock starts).
    pub fn fault_injected(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        self.feed(now_ms, Event::FaultInjected, out);
    }

    /// One output line of the node's worker.
    pub fn line(&mut self, node: NodeId, line: &str, now_ms: u64, out: &mut Vec<Output>) {
        if !self.names.contains_key(&node) {
            return;
        }
        let Some(parsed) = WorkerLine::parse(line) else {
            let text: String = line.chars().take(500).collect();
            out.push(Output::Notice(Notice::Log(format!(
                "node {node}: {text:?}"
            ))));
            return;
        };
        let ev = match parsed {
            WorkerLine::Step(s) => Event::Stepped {
                node,
                epoch: s.epoch,
                step: s.step,
                report: StepReport {
                    loss: f64::from(s.loss),
                    tokens: s.tokens,
                    step_ms: s.ms,
                    routing: s.routing,
                    nonfinite: s.nonfinite,
                },
            },
            WorkerLine::Event(ev) => match self.worker_event(node, ev) {
                Some(ev) => ev,
                None => return,
            },
        };
        self.feed(now_ms, ev, out);
    }

    fn worker_event(&mut self, node: NodeId, ev: WorkerEvent) -> Option<Event> {
        let layers = self.params.config.n_layers;
        let idle = |epoch, why, step, held: &[(usize, usize)]| Event::Idle {
            node,
            epoch,
            why,
            step,
            held: holdings_of(held, layers),
        };
        Some(match ev {
            WorkerEvent::Ready { addr } => {
                self.addrs.insert(node, addr);
                Event::Ready { node }
            }
            WorkerEvent::Alive => Event::WorkerAlive { node },
            WorkerEvent::Failed {
                epoch,
                step,
                error,
                held,
            } => {
                // The machine logs the error; it comes from the worker, so it is escaped.
                let error = printable(&error, MAX_WORKER_ERROR_CHARS);
                idle(epoch, IdleReason::Failed(error), step, &held)
            }
            WorkerEvent::Paused { epoch, step, held } => {
                idle(epoch, IdleReason::Paused, step, &held)
            }
            WorkerEvent::Finished { epoch, step, held } => {
                idle(epoch, IdleReason::Finished, step, &held)
            }
            WorkerEvent::Migrated {
                epoch, bytes_in, ..
            } => Event::Migrated {
                node,
                epoch,
                bytes_in,
            },
            WorkerEvent::Checkpointed { epoch, step, parts } => {
                if epoch == self.machine.epoch() {
                    self.parts.entry(step).or_default().insert(node, parts);
                }
                Event::CheckpointWritten { node, epoch, step }
            }
            WorkerEvent::CheckpointFailed { epoch, step, error } => {
                // A report of an earlier epoch is about a checkpoint nobody commits any more.
                if epoch != self.machine.epoch() {
                    return None;
                }
                let error = format!("node {node} could not write its parts: {error}");
                Event::CheckpointFailed { step, error }
            }
            WorkerEvent::Done(sums) => {
                let checksums = StateChecksums {
                    dense: sums.dense,
                    replicas: sums
                        .replicas
                        .iter()
                        .map(|r| (r.layer as u32, r.expert as u32, r.checksum))
                        .collect(),
                };
                self.checksums.push(sums);
                Event::Done { node, checksums }
            }
        })
    }

    /// Feeds `first` to the machine and performs every action, including those caused by the
    /// answers of actions performed here (checkpoint commits and look-ups).
    fn feed(&mut self, now_ms: u64, first: Event, out: &mut Vec<Output>) {
        let mut events = vec![first];
        while let Some(ev) = events.pop() {
            let mut actions = Vec::new();
            let t = Instant::now();
            self.machine.handle(now_ms, ev, &mut actions);
            if actions.iter().any(|a| matches!(a, Action::Reconfigure(_))) {
                self.replan_ms = t.elapsed().as_secs_f64() * 1e3;
            }
            for a in actions {
                if let Some(answer) = self.perform(a, now_ms, out) {
                    events.push(answer);
                }
            }
        }
    }

    fn command(node: NodeId, cmd: &Command, out: &mut Vec<Output>) {
        // Commands are plain data; serde_json cannot fail on them.
        let line = serde_json::to_string(cmd).unwrap_or_default();
        out.push(Output::Send(node, ToAgent::Worker { line }));
    }

    fn notice(out: &mut Vec<Output>, n: Notice) {
        out.push(Output::Notice(n));
    }

    /// Carries out one action; returns the event that answers it, if any.
    fn perform(&mut self, action: Action, now_ms: u64, out: &mut Vec<Output>) -> Option<Event> {
        match action {
            Action::StartWorker { node } => {
                let spec = self.job_spec(node);
                Self::command(node, &Command::Job(spec), out);
            }
            Action::Pause { node } => Self::command(node, &Command::Pause, out),
            Action::Abort { node, epoch } => Self::command(node, &Command::Abort { epoch }, out),
            Action::Stop { node } => Self::command(node, &Command::Stop, out),
            Action::Reconfigure(r) => self.reconfigure(&r, out),
            Action::CommitCheckpoint {
                step,
                members,
                plan_version,
            } => return Some(self.commit(step, members, plan_version)),
            Action::FindCheckpoint => return Some(self.find_checkpoint(out)),
            Action::Fence { node, reason } => {
                let name = self.names.remove(&node).unwrap_or_default();
                out.push(Output::Send(
                    node,
                    ToAgent::Rejected {
                        reason: format!("node {node} fenced: {reason}"),
                    },
                ));
                out.push(Output::Close(node));
                Self::notice(out, Notice::Fenced { name, reason });
            }
            Action::WaitForNodes { live, reason } => {
                Self::notice(out, Notice::WaitingForNodes { live, reason })
            }
            Action::Record(r) => {
                let start = *self.start_ms.get_or_insert(now_ms);
                let rec = StepRecord {
                    step: r.step,
                    t_s: now_ms.saturating_sub(start) as f64 / 1e3,
                    loss: r.loss,
                    tokens: r.tokens,
                    samples: (r.members * self.params.config.batch) as u64,
                    live_nodes: r.live_nodes,
                    used_nodes: r.members,
                    plan_version: r.plan_version,
                    step_ms: r.step_ms,
                };
                Self::notice(out, Notice::Step(rec));
            }
            Action::Reconfigured(r) => {
                let replan_ms = self.replan_ms;
                let total_ms = r.detect_ms + replan_ms + r.migrate_ms + r.resume_ms;
                let rec = RecoveryRecord {
                    kind: r.kind.name().into(),
                    at_step: r.at_step,
                    resume_step: r.resume_step,
                    nodes_before: r.nodes_before,
                    nodes_after: r.nodes_after,
                    transfers: r.transfers,
                    bytes: r.bytes,
                    detect_ms: r.detect_ms,
                    replan_ms,
                    migrate_ms: r.migrate_ms,
                    resume_ms: r.resume_ms,
                    total_ms,
                    plan_version: r.plan_version,
                };
                Self::notice(out, Notice::Reconfigured(rec));
            }
            Action::Log(l) => Self::notice(out, Notice::Log(l)),
            Action::Finished(r) => Self::notice(out, Notice::Finished(r)),
        }
        None
    }

    fn job_spec(&self, node: NodeId) -> JobSpec {
        JobSpec {
            config: self.params.config.clone(),
            steps: self.params.rules.total_steps,
            shard: u64::from(node),
            node_id: node,
            // The agent puts its own data-plane address here.
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            timeout_ms: self.params.timeout_ms,
            step_deadline: self.params.rules.step_deadline,
            // A few beats per heartbeat timeout, at most 4 a second.
            alive_every_ms: (self.params.rules.heartbeat_timeout_ms / 4).clamp(10, 250),
            checkpoint: self.params.checkpoint.clone(),
            out: self.params.out.clone(),
        }
    }

    /// Where checkpoints are read from: the `--resume` root until the job has started, then
    /// the job's own.
    fn checkpoint_root(&self, starting: bool) -> Option<PathBuf> {
        match &self.params.resume {
            Some(root) if starting => Some(root.clone()),
            _ => self.params.checkpoint.as_ref().map(|c| c.root.clone()),
        }
    }

    fn reconfigure(&mut self, r: &Reconfiguration, out: &mut Vec<Output>) {
        let members = r.members();
        let peers: Vec<SocketAddr> = members
            .iter()
            .map(|m| self.addrs.get(m).copied())
            .collect::<Option<_>>()
            .unwrap_or_default();
        let source = match &r.source {
            job::StateSource::Fresh => StateSource::Fresh,
            job::StateSource::Peers {
                dense_from,
                dense_to,
            } => StateSource::Peers {
                dense_from: *dense_from,
                dense_to: dense_to.clone(),
            },
            job::StateSource::Checkpoint { step } => StateSource::Checkpoint {
                root: self
                    .checkpoint_root(r.kind == job::ReconfigKind::Start)
                    .unwrap_or_default(),
                step: *step,
            },
        };
        let replicas = r.replicas_per_member();
        let transfers: Vec<(usize, usize, usize, usize)> = r
            .transfers
            .iter()
            .map(|t| (t.layer, t.expert, t.src_rank, t.dst_rank))
            .collect();
        self.parts.clear();
        // Fresh for every epoch: only this epoch's members can join its mesh.
        let secret = MeshSecret::random();
        for (rank, &node) in members.iter().enumerate() {
            let cmd = Reconfigure {
                rank,
                peers: peers.clone(),
                epoch: r.epoch,
                secret: secret.clone(),
                plan_version: r.plan.version,
                replicas: replicas.clone(),
                transfers: transfers.clone(),
                source: source.clone(),
                resume_step: r.resume_step,
            };
            Self::command(node, &Command::Reconfigure(cmd), out);
        }
    }

    fn commit(&mut self, step: u64, members: usize, plan_version: u64) -> Event {
        let Some(spec) = self.params.checkpoint.clone() else {
            let error = "checkpoints are off".to_owned();
            return Event::CheckpointFailed { step, error };
        };
        let parts: Vec<_> = self
            .parts
            .remove(&step)
            .unwrap_or_default()
            .into_values()
            .flatten()
            .collect();
        let manifest = checkpoint::Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            step,
            world: members,
            plan_version,
            config: self.params.config.clone(),
            parts,
        };
        let expected =
            checkpoint::all_parts(self.params.config.n_layers, self.params.config.experts);
        match checkpoint::commit(&spec.root, manifest, &expected, self.params.checkpoint_keep) {
            Ok(_) => Event::CheckpointCommitted { step },
            Err(e) => Event::CheckpointFailed {
                step,
                error: e.to_string(),
            },
        }
    }

    fn find_checkpoint(&self, out: &mut Vec<Output>) -> Event {
        let Some(root) = self.checkpoint_root(!self.machine.has_started()) else {
            let error = "checkpoints are off (--ckpt-every 0)".to_owned();
            return Event::CheckpointMissing { error };
        };
        match checkpoint::load_latest(&root, &self.params.config) {
            Ok(l) => {
                for (dir, why) in &l.rejected {
                    let line = format!("skipped checkpoint {}: {why}", dir.display());
                    Self::notice(out, Notice::Log(line));
                }
                let line = format!("newest valid checkpoint: {}", l.dir.display());
                Self::notice(out, Notice::Log(line));
                Event::CheckpointFound {
                    step: l.manifest.step,
                }
            }
            Err(e) => Event::CheckpointMissing {
                error: format!("{}: {e}", root.display()),
            },
        }
    }
}

/// `[layer]` → expert ids from a worker's `(layer, expert)` list.
fn holdings_of(held: &[(usize, usize)], layers: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); layers];
    for &(l, e) in held {
        if l < layers {
            out[l].push(e as u32);
        }
    }
    out
}

/// Why `name` cannot name a node, if it cannot: it must be 1 to [`MAX_NODE_NAME_BYTES`] bytes of
/// ASCII letters, digits, `.`, `_`, `:` and `-` — enough for host names, addresses and the
/// names of availability traces, and nothing that could break a log line apart.
pub fn check_node_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("it is empty");
    }
    if name.len() > MAX_NODE_NAME_BYTES {
        const _: () = assert!(MAX_NODE_NAME_BYTES == 253, "update the message below");
        return Err("it is longer than 253 bytes");
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
    if !name.chars().all(allowed) {
        return Err("only ASCII letters, digits, '.', '_', ':' and '-' are allowed");
    }
    Ok(())
}

/// Longest worker error kept in a log line (characters); a real one is a line or two.
const MAX_WORKER_ERROR_CHARS: usize = 2_000;

/// Constant-time comparison, so the token cannot be guessed byte by byte from timings.
fn tokens_match(given: &str, expected: &str) -> bool {
    crate::comm::constant_time_eq(given.as_bytes(), expected.as_bytes())
}
