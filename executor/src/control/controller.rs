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
//!
//! # Surviving its own crash
//! With a state directory ([`Controller::save_to`]) the controller saves everything it needs to
//! take the job back — the machine whole, names, data-plane addresses, checkpoint parts
//! reported, the last reconfiguration issued (to send a member its part again), the clock and,
//! per node, the last worker line the state includes — through [`super::state`], whenever
//! something changed and **before** the commands of that change leave (write-ahead): the saved
//! state is never older than what a worker was told. A line that changed nothing worth saving
//! (a step report that does not complete a step) is not saved; it is not acknowledged either,
//! so after a crash its agent sends it again and it is handled as if it had just arrived.
//! [`Controller::recover`] rebuilds the controller from the directory; the machine then
//! reconciles the nodes that come back (`lazarus_planner::job::reconcile`).
//!
//! # Records are delivered at least once, numbered
//! Step and reconfiguration records ([`Notice::Step`], [`Notice::Reconfigured`]) carry a
//! sequence number, 1, 2, … across fail-overs. Each is kept with the saved state until whoever
//! runs the job says it has it ([`Controller::delivered`]); a recovered controller hands the
//! ones kept out again, before anything new, and the receiver skips the numbers it has. So a
//! record that was counted (and saved) but still on its way when the controller died is not
//! lost with it (a launcher that lags behind its controller, as `lzrun local` under a storm of
//! faults does, had a dozen steps counted and never written to `steps.csv`).

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use lazarus_planner::job::{
    self, Action, Event, IdleReason, JobConfig, JobConfigError, JobMachine, NodeId,
    Reconfiguration, StateChecksums, StepReport,
};
use serde::{Deserialize, Serialize};

use super::printable;
use super::proto::{
    MAX_DEVICES_PER_NODE, MAX_NODE_NAME_BYTES, PROTOCOL_VERSION, Reattachment, Registration,
    Reject, ToAgent,
};
use super::state::{self, StateError};
use crate::checkpoint;
use crate::comm::MeshSecret;
use crate::dataset::{DataSpec, EvalSpec};
use crate::metrics::{self, RecoveryRecord, StepRecord};
use crate::model::{ExpertMode, MoeConfig};
use crate::worker::Checksums;
use crate::worker::{
    CheckpointSpec, Command, JobSpec, Reconfigure, StateSource, WorkerEvent, WorkerLine,
};

/// What a job trains and how, besides the control rules ([`JobConfig`]). Saved with the job
/// state, except the token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobParams {
    pub config: MoeConfig,
    /// The control rules' parameters (steps, slots, `f`, timeouts, cadences).
    pub rules: JobConfig,
    /// Shared secret every agent must present. It keeps stray or misconfigured agents out of
    /// the cluster; it is not a defence against an attacker on the network (no TLS). Never
    /// saved: a recovering controller is given it again.
    #[serde(skip)]
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
    /// Zipf router bias of the workers (forced routing skew; 0: none).
    #[serde(default)]
    pub router_skew: f64,
    /// Workers fingerprint their whole state after every this many steps (0: never).
    #[serde(default = "crate::worker::default_verify_every")]
    pub verify_every: u64,
    /// What the workers train on (`None`: the embedded corpus).
    #[serde(default)]
    pub data: Option<DataSpec>,
    /// Held-out evaluation (`--eval-data`; `None`: none).
    #[serde(default)]
    pub eval: Option<EvalSpec>,
}

/// What the controller tells whoever runs the job.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    /// A step counted. `seq` numbers the records (steps and reconfigurations together) from 1
    /// across fail-overs; a record not yet acknowledged ([`Controller::delivered`]) is handed
    /// out again, with the same number and `again` set, by a controller that takes the job
    /// back (see the [module docs](self)): skip the numbers already handled.
    Step {
        seq: u64,
        /// Boxed: a record with its samples and routing is many times the other notices.
        record: Box<StepRecord>,
        again: bool,
    },
    /// A reconfiguration, numbered as [`Notice::Step`].
    Reconfigured {
        seq: u64,
        record: RecoveryRecord,
        again: bool,
    },
    Log(String),
    /// Too few nodes to hold every expert: the job waits for joins (`reason` says for what).
    WaitingForNodes {
        /// Registered nodes, ready or not.
        live: usize,
        /// Ready nodes the job needs to go on.
        needed: usize,
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

/// A record handed out and not acknowledged yet: what a recovered controller hands out again.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Kept {
    /// The record's own `routing` and `trained` are left empty (they are not serialized: they
    /// go to `routing.csv` and `samples.csv`, not `steps.csv`); they are kept beside it.
    Step {
        record: StepRecord,
        routing: Vec<Vec<u64>>,
        #[serde(default)]
        trained: Vec<lazarus_planner::job::MemberSamples>,
    },
    Reconfigured(RecoveryRecord),
}

impl Kept {
    /// The notice that hands the record out as number `seq` (`again`: once more).
    fn notice(&self, seq: u64, again: bool) -> Notice {
        match self {
            Kept::Step {
                record,
                routing,
                trained,
            } => Notice::Step {
                seq,
                record: Box::new(StepRecord {
                    routing: routing.clone(),
                    trained: trained.clone(),
                    ..record.clone()
                }),
                again,
            },
            Kept::Reconfigured(record) => Notice::Reconfigured {
                seq,
                record: record.clone(),
                again,
            },
        }
    }
}

/// Records kept for a receiver that never acknowledges any, at most (the oldest go first): the
/// saved state stays bounded.
const MAX_KEPT_RECORDS: usize = 4_096;

/// The last reconfiguration issued: what a member that never got its part is sent again.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Issued {
    /// The members, in rank order.
    members: Vec<NodeId>,
    /// The command of rank 0 (the others differ only in `rank`).
    command: Reconfigure,
}

/// What the state file holds (see the [module docs](self)); written from borrows.
#[derive(Serialize)]
struct SavedRef<'a> {
    params: &'a JobParams,
    listen: Option<SocketAddr>,
    machine: &'a JobMachine,
    names: &'a BTreeMap<NodeId, String>,
    addrs: &'a BTreeMap<NodeId, SocketAddr>,
    next_id: NodeId,
    parts: &'a BTreeMap<u64, BTreeMap<NodeId, Vec<checkpoint::PartInfo>>>,
    checksums: &'a [Checksums],
    start_ms: Option<u64>,
    now_ms: u64,
    seen: &'a BTreeMap<NodeId, u64>,
    issued: Option<&'a Issued>,
    /// A salted hash of the job's token ([`state::token_fingerprint`]), never the token: a
    /// `--recover` with another token is refused before any agent is.
    token_fingerprint: &'a str,
    /// Every node that was ever a member (joins are counted against it).
    members_seen: &'a std::collections::BTreeSet<NodeId>,
    /// The loss of step 0, for the report of a controller that takes the job back.
    initial_loss: Option<f64>,
    /// Records handed out and not acknowledged, by sequence number.
    kept: &'a VecDeque<(u64, Kept)>,
    /// The sequence number of the next record.
    next_record: u64,
}

/// [`SavedRef`], read back.
#[derive(Deserialize)]
struct Saved {
    params: JobParams,
    listen: Option<SocketAddr>,
    machine: JobMachine,
    names: BTreeMap<NodeId, String>,
    addrs: BTreeMap<NodeId, SocketAddr>,
    next_id: NodeId,
    parts: BTreeMap<u64, BTreeMap<NodeId, Vec<checkpoint::PartInfo>>>,
    checksums: Vec<Checksums>,
    start_ms: Option<u64>,
    now_ms: u64,
    seen: BTreeMap<NodeId, u64>,
    issued: Option<Issued>,
    /// Absent in states saved before it existed: any token is accepted then.
    #[serde(default)]
    token_fingerprint: Option<String>,
    #[serde(default)]
    members_seen: Option<std::collections::BTreeSet<NodeId>>,
    #[serde(default)]
    initial_loss: Option<f64>,
    /// Absent in states saved before records were numbered: none kept.
    #[serde(default)]
    kept: VecDeque<(u64, Kept)>,
    #[serde(default = "first_record")]
    next_record: u64,
}

/// The sequence number of a job's first record.
fn first_record() -> u64 {
    1
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
    /// Per node, the sequence number of the last worker line handled.
    seen: BTreeMap<NodeId, u64>,
    /// `seen` as of the last saved state (what agents may forget).
    saved_seen: BTreeMap<NodeId, u64>,
    issued: Option<Issued>,
    /// Where the state is saved (none: not saved, and every handled line is acknowledged).
    state_dir: Option<PathBuf>,
    /// The address agents reach this controller at (saved, for `--recover`).
    listen: Option<SocketAddr>,
    /// Something worth saving changed since the last save.
    dirty: bool,
    /// The last save failed (said once, until one succeeds again).
    save_failing: bool,
    /// The latest time the controller was fed (saved: a recovered clock goes on from it).
    now_ms: u64,
    /// Rebuilt from a saved state and not started yet ([`Controller::start`]).
    recovering: bool,
    /// Saved instead of the token (see [`state::token_fingerprint`]).
    token_fingerprint: String,
    /// Every node that was ever a member of a plan in force: a node that becomes a member and
    /// is not in it joined (see [`RecoveryRecord::joined`]).
    members_seen: std::collections::BTreeSet<NodeId>,
    /// The loss of step 0 (kept across a fail-over, for the report).
    initial_loss: Option<f64>,
    /// Records handed out and not acknowledged yet ([`Controller::delivered`]), saved: a
    /// recovered controller hands them out again. None kept when the state is not saved.
    kept: VecDeque<(u64, Kept)>,
    /// The sequence number of the next record (saved).
    next_record: u64,
}

impl Controller {
    pub fn new(params: JobParams) -> Result<Self, JobConfigError> {
        let token_fingerprint = state::token_fingerprint(&params.token);
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
            seen: BTreeMap::new(),
            saved_seen: BTreeMap::new(),
            issued: None,
            state_dir: None,
            listen: None,
            dirty: false,
            save_failing: false,
            now_ms: 0,
            recovering: false,
            token_fingerprint,
            members_seen: std::collections::BTreeSet::new(),
            initial_loss: None,
            kept: VecDeque::new(),
            next_record: first_record(),
        })
    }

    /// Saves the job state into `dir` from now on (see the [module docs](self)), starting
    /// with the state as it is; `listen` is the address agents reach this controller at. An
    /// unusable directory is an error here, before the job starts.
    pub fn save_to(&mut self, dir: &Path, listen: Option<SocketAddr>) -> Result<(), StateError> {
        self.state_dir = Some(dir.to_path_buf());
        self.listen = listen;
        self.write_state()
    }

    /// Rebuilds the controller of the job saved in `dir` (see [`Controller::save_to`]), which
    /// goes on saving there; agents must present `token`. The job resumes when
    /// [`Controller::start`] runs.
    pub fn recover(dir: &Path, token: &str) -> Result<Self, StateError> {
        let saved: Saved = state::read_state(dir)?;
        let path = dir.join(state::STATE_FILE);
        let damaged = |why: String| StateError::Damaged {
            path: path.clone(),
            why,
        };
        saved
            .machine
            .config()
            .validate()
            .map_err(|e| damaged(format!("its job configuration is invalid: {e}")))?;
        if saved.machine.is_over() {
            return Err(StateError::Over {
                dir: dir.to_path_buf(),
                outcome: saved.machine.outcome().cloned(),
            });
        }
        // Every agent of the job would be refused with "wrong cluster token", exit and stop its
        // worker: refuse here, before anything listens. A state saved before fingerprints
        // existed accepts any token (and saves the fingerprint of this one from now on).
        let token_fingerprint = match saved.token_fingerprint {
            Some(fp) => {
                if !state::token_matches(&fp, token).map_err(damaged)? {
                    return Err(StateError::WrongToken { path });
                }
                fp
            }
            None => state::token_fingerprint(token),
        };
        let members_seen = saved.members_seen.unwrap_or_else(|| {
            saved
                .machine
                .plan()
                .map(|p| p.node_map.iter().copied().collect())
                .unwrap_or_default()
        });
        let mut params = saved.params;
        params.token = token.to_owned();
        Ok(Self {
            machine: saved.machine,
            params,
            names: saved.names,
            addrs: saved.addrs,
            next_id: saved.next_id,
            parts: saved.parts,
            checksums: saved.checksums,
            start_ms: saved.start_ms,
            replan_ms: 0.0,
            saved_seen: saved.seen.clone(),
            seen: saved.seen,
            issued: saved.issued,
            state_dir: Some(dir.to_path_buf()),
            listen: saved.listen,
            dirty: false,
            save_failing: false,
            now_ms: saved.now_ms,
            recovering: true,
            token_fingerprint,
            members_seen,
            initial_loss: saved.initial_loss,
            kept: saved.kept,
            next_record: saved.next_record,
        })
    }

    /// The loss of step 0, if it was counted (by this controller or, before a fail-over, by
    /// the one whose state it took back).
    pub fn initial_loss(&self) -> Option<f64> {
        self.initial_loss
    }

    /// What the job was started with (for a recovered controller: what was saved).
    pub fn params(&self) -> &JobParams {
        &self.params
    }

    /// The address agents reached the saved controller at, if it was saved.
    pub fn saved_listen_addr(&self) -> Option<SocketAddr> {
        self.listen
    }

    /// The time the controller's clock starts from: 0, or for a recovered controller the last
    /// time the saved one was fed (the machine's times go on from there).
    pub fn clock_start_ms(&self) -> u64 {
        self.now_ms
    }

    /// Starts the job: a recovered controller takes it back here (the machine reconciles the
    /// nodes that come back within one heartbeat timeout of `now_ms`).
    pub fn start(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        if !std::mem::take(&mut self.recovering) {
            return;
        }
        self.now_ms = self.now_ms.max(now_ms);
        // First the records the saved controller may not have delivered, in order.
        if !self.kept.is_empty() {
            let line = format!(
                "handing out again the {} step and reconfiguration records not acknowledged \
                 before the fail-over (numbers {} to {})",
                self.kept.len(),
                self.kept.front().map_or(0, |k| k.0),
                self.kept.back().map_or(0, |k| k.0),
            );
            Self::notice(out, Notice::Log(line));
        }
        for (seq, kept) in &self.kept {
            Self::notice(out, kept.notice(*seq, true));
        }
        let mut actions = Vec::new();
        self.machine.recover(now_ms, &mut actions);
        self.perform_all(now_ms, actions, out);
        // The saved controller may have committed a checkpoint and died before the answer was
        // fed (the state is saved before actions are performed): the directory says.
        if let Some(root) = self.checkpoint_root(false)
            && let Ok(Some(step)) = checkpoint::latest_step(&root)
            && self
                .machine
                .last_committed_checkpoint()
                .is_none_or(|c| c < step)
        {
            self.feed(now_ms, Event::CheckpointCommitted { step }, out);
        }
        self.dirty = true;
        self.settle(out);
    }

    /// The sequence number of `node`'s last worker line the saved state includes (every line
    /// handled, when the state is not saved): what its agent may forget.
    pub fn acked(&self, node: NodeId) -> u64 {
        let seen = if self.state_dir.is_some() {
            &self.saved_seen
        } else {
            &self.seen
        };
        seen.get(&node).copied().unwrap_or(0)
    }

    /// Whoever runs the job has the records numbered up to `seq`: they are not kept any more
    /// (the next save drops them; until then a recovered controller may hand them out again).
    pub fn delivered(&mut self, seq: u64) {
        while self.kept.front().is_some_and(|(s, _)| *s <= seq) {
            self.kept.pop_front();
        }
    }

    /// The records kept for a fail-over: their sequence numbers, oldest first.
    pub fn undelivered(&self) -> Vec<u64> {
        self.kept.iter().map(|(s, _)| *s).collect()
    }

    /// Numbers `record`, keeps it until it is acknowledged (when the state is saved) and hands
    /// it out.
    fn hand_out(&mut self, record: Kept, out: &mut Vec<Output>) {
        let seq = self.next_record;
        self.next_record += 1;
        Self::notice(out, record.notice(seq, false));
        if self.state_dir.is_some() {
            if self.kept.len() >= MAX_KEPT_RECORDS {
                self.kept.pop_front();
            }
            self.kept.push_back((seq, record));
        }
    }

    fn write_state(&mut self) -> Result<(), StateError> {
        let Some(dir) = &self.state_dir else {
            return Ok(());
        };
        let saved = SavedRef {
            params: &self.params,
            listen: self.listen,
            machine: &self.machine,
            names: &self.names,
            addrs: &self.addrs,
            next_id: self.next_id,
            parts: &self.parts,
            checksums: &self.checksums,
            start_ms: self.start_ms,
            now_ms: self.now_ms,
            seen: &self.seen,
            issued: self.issued.as_ref(),
            token_fingerprint: &self.token_fingerprint,
            members_seen: &self.members_seen,
            initial_loss: self.initial_loss,
            kept: &self.kept,
            next_record: self.next_record,
        };
        state::write_state(dir, &saved)?;
        self.saved_seen = self.seen.clone();
        self.dirty = false;
        Ok(())
    }

    /// Saves the state if something changed, before the caller delivers `out` (write-ahead).
    /// A failed save is reported once and the job goes on (unsaved lines stay unacknowledged).
    fn settle(&mut self, out: &mut Vec<Output>) {
        if !self.dirty || self.state_dir.is_none() {
            return;
        }
        match self.write_state() {
            Ok(()) if self.save_failing => {
                self.save_failing = false;
                Self::notice(out, Notice::Log("the job state is saved again".into()));
            }
            Ok(()) => {}
            Err(e) if !self.save_failing => {
                self.save_failing = true;
                Self::notice(
                    out,
                    Notice::Log(format!(
                        "cannot save the job state (training goes on, but a controller crash \
                         now would lose the job): {e}"
                    )),
                );
            }
            Err(_) => {}
        }
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

    /// What a registration and a reattachment must both present: this protocol version, the
    /// job's token and a well-formed name (checked before anything logs it).
    fn check_credentials(&self, reg: &Registration) -> Result<(), Reject> {
        if reg.version != PROTOCOL_VERSION {
            return Err(Reject::Version {
                agent: reg.version,
                controller: PROTOCOL_VERSION,
            });
        }
        if !tokens_match(&reg.token, &self.params.token) {
            return Err(Reject::BadToken);
        }
        check_node_name(&reg.node).map_err(|why| Reject::BadName {
            name: format!("\"{}\"", printable(&reg.node, 64)),
            why,
        })
    }

    /// Admits a node: protocol version, token, a well-formed name no live node uses (see
    /// [`check_node_name`]), 1 to [`MAX_DEVICES_PER_NODE`] devices, a well-formed host name
    /// or none. Ids are never reused.
    pub fn register(
        &mut self,
        reg: &Registration,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) -> Result<NodeId, Reject> {
        self.check_credentials(reg)?;
        if reg.devices == 0 {
            return Err(Reject::NoDevices(reg.node.clone()));
        }
        if reg.devices > MAX_DEVICES_PER_NODE {
            return Err(Reject::TooManyDevices {
                node: reg.node.clone(),
                devices: reg.devices,
            });
        }
        if !reg.host.is_empty() {
            check_node_name(&reg.host).map_err(|why| Reject::BadName {
                name: format!("host \"{}\"", printable(&reg.host, 64)),
                why,
            })?;
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
        self.dirty = true;
        let host = (!reg.host.is_empty()).then(|| reg.host.clone());
        self.feed(
            now_ms,
            Event::Joined {
                node: id,
                name,
                host,
            },
            out,
        );
        self.settle(out);
        Ok(id)
    }

    /// Takes back node `r.node_id` after its agent lost the connection (to this controller or
    /// to the one it recovers from): same checks as [`Controller::register`], the node must be
    /// live under that id and name, and the machine reconciles what its worker holds (it may
    /// drop the node). Returns the id and the sequence number of its last line handled (its
    /// agent sends the later ones again).
    pub fn reattach(
        &mut self,
        r: &Reattachment,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) -> Result<(NodeId, u64), Reject> {
        let reg = &r.registration;
        self.check_credentials(reg)?;
        let id = r.node_id;
        if self.names.get(&id) != Some(&reg.node) {
            return Err(Reject::UnknownNode {
                node_id: id,
                name: reg.node.clone(),
            });
        }
        if self.machine.is_over() {
            return Err(Reject::Over);
        }
        self.now_ms = self.now_ms.max(now_ms);
        let report = r.worker;
        self.feed(now_ms, Event::Reattached { node: id, report }, out);
        self.settle(out);
        if !self.names.contains_key(&id) {
            // Dropped by the reconciliation: the fence notice says why.
            let reason = out
                .iter()
                .find_map(|o| match o {
                    Output::Notice(Notice::Fenced { name, reason }) if *name == reg.node => {
                        Some(reason.clone())
                    }
                    _ => None,
                })
                .unwrap_or_default();
            // The fence's message goes to a connection that does not exist yet.
            out.retain(|o| !matches!(o, Output::Send(n, _) | Output::Close(n) if *n == id));
            return Err(Reject::Dropped {
                node_id: id,
                name: reg.node.clone(),
                reason,
            });
        }
        Ok((id, self.seen.get(&id).copied().unwrap_or(0)))
    }

    /// What messages call node `node`: its name ([`JobMachine::name_of`]).
    pub fn name_of(&self, node: NodeId) -> String {
        match self.names.get(&node) {
            Some(name) => name.clone(),
            None => self.machine.name_of(node),
        }
    }

    /// A heartbeat; `false` if the node is not (any more) part of the job.
    pub fn heartbeat(&mut self, node: NodeId, now_ms: u64, out: &mut Vec<Output>) -> bool {
        if !self.names.contains_key(&node) {
            return false;
        }
        self.feed(now_ms, Event::Heartbeat { node }, out);
        self.settle(out);
        true
    }

    /// The node's connection ended (goodbye, closed, protocol violation).
    pub fn gone(&mut self, node: NodeId, reason: &str, now_ms: u64, out: &mut Vec<Output>) {
        if self.names.remove(&node).is_some() {
            let reason = reason.to_owned();
            self.dirty = true;
            self.feed(now_ms, Event::Lost { node, reason }, out);
            self.settle(out);
        }
    }

    pub fn tick(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        self.feed(now_ms, Event::Tick, out);
        self.settle(out);
    }

    /// The rank node `name` holds in the plan in force (`None`: not a member).
    pub fn rank_of(&self, name: &str) -> Option<usize> {
        let id = self
            .names
            .iter()
            .find_map(|(id, n)| (n == name).then_some(*id))?;
        self.machine.members().iter().position(|m| *m == id)
    }

    /// The launcher injected a fault now (the detection clock starts).
    pub fn fault_injected(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        self.feed(now_ms, Event::FaultInjected, out);
        self.settle(out);
    }

    /// One output line of the node's worker, the next in its sequence (for drivers that do not
    /// number lines; see [`Controller::worker_line`]).
    pub fn line(&mut self, node: NodeId, line: &str, now_ms: u64, out: &mut Vec<Output>) {
        let seq = self.seen.get(&node).copied().unwrap_or(0) + 1;
        self.worker_line(node, seq, line, now_ms, out);
    }

    /// Line `seq` of the node's worker; a line already handled (an agent sends the lines after
    /// the last acknowledged one again when it reattaches) is ignored.
    pub fn worker_line(
        &mut self,
        node: NodeId,
        seq: u64,
        line: &str,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        if !self.names.contains_key(&node) {
            return;
        }
        let seen = self.seen.entry(node).or_insert(0);
        if seq <= *seen {
            return;
        }
        *seen = seq;
        self.handle_line(node, line, now_ms, out);
        self.settle(out);
    }

    fn handle_line(&mut self, node: NodeId, line: &str, now_ms: u64, out: &mut Vec<Output>) {
        let Some(parsed) = WorkerLine::parse(line) else {
            let text: String = line.chars().take(500).collect();
            out.push(Output::Notice(Notice::Log(format!(
                "node {}: {text:?}",
                self.name_of(node)
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
                    expert_ms: s.expert_ms,
                    expert_tokens: s.expert_tokens,
                    sent_bytes: s.sent_bytes,
                    copy_bytes: s.copy_bytes,
                    layout_version: s.layout_version,
                    fingerprints: s.fingerprints,
                    data: s.data,
                    data_wait_ms: s.data_wait_ms,
                    eval_loss: s.eval_loss.map(f64::from),
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
            held: holdings_of(held, layers).into(),
        };
        Some(match ev {
            WorkerEvent::Ready { addr } => {
                self.addrs.insert(node, addr);
                self.dirty = true;
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
                    self.dirty = true;
                }
                Event::CheckpointWritten { node, epoch, step }
            }
            WorkerEvent::CheckpointFailed { epoch, step, error } => {
                // A report of an earlier epoch is about a checkpoint nobody commits any more.
                if epoch != self.machine.epoch() {
                    return None;
                }
                let error = format!(
                    "node {} could not write its parts: {error}",
                    self.name_of(node)
                );
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
                    shards: sums
                        .shards
                        .iter()
                        .map(|s| (s.shard as u32, s.checksum))
                        .collect(),
                };
                self.checksums.push(sums);
                self.dirty = true;
                Event::Done { node, checksums }
            }
        })
    }

    /// Feeds `first` to the machine and performs every action, including those caused by the
    /// answers of actions performed here (checkpoint commits and look-ups). Any action makes
    /// the state worth saving.
    fn feed(&mut self, now_ms: u64, first: Event, out: &mut Vec<Output>) {
        self.now_ms = self.now_ms.max(now_ms);
        let mut actions = Vec::new();
        let t = Instant::now();
        self.machine.handle(now_ms, first, &mut actions);
        if actions.iter().any(|a| matches!(a, Action::Reconfigure(_))) {
            self.replan_ms = t.elapsed().as_secs_f64() * 1e3;
        }
        self.perform_all(now_ms, actions, out);
    }

    fn perform_all(&mut self, now_ms: u64, actions: Vec<Action>, out: &mut Vec<Output>) {
        if actions.is_empty() {
            return;
        }
        self.dirty = true;
        let mut answers = Vec::new();
        for a in actions {
            if let Some(answer) = self.perform(a, now_ms, out) {
                answers.push(answer);
            }
        }
        for ev in answers {
            self.feed(now_ms, ev, out);
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
            Action::SwitchLayout(sw) => {
                let cmd = Command::Relayout {
                    epoch: sw.epoch,
                    version: sw.plan.version,
                    from_step: sw.from_step,
                    replicas: sw.replicas_per_member(),
                    transfers: sw
                        .transfers
                        .iter()
                        .map(|t| (t.layer, t.expert, t.src_rank, t.dst_rank))
                        .collect(),
                };
                for &node in &sw.plan.node_map {
                    Self::command(node, &cmd, out);
                }
            }
            Action::Resend { node, epoch } => self.resend(node, epoch, out),
            Action::CommitCheckpoint {
                step,
                members,
                plan_version,
                data_cursor,
            } => return Some(self.commit(step, members, plan_version, data_cursor)),
            Action::FindCheckpoint => return Some(self.find_checkpoint(out)),
            Action::Fence { node, reason } => {
                let name = self.names.remove(&node).unwrap_or_default();
                out.push(Output::Send(
                    node,
                    ToAgent::Rejected {
                        reason: format!("node {name} fenced: {reason}"),
                    },
                ));
                out.push(Output::Close(node));
                Self::notice(out, Notice::Fenced { name, reason });
            }
            Action::WaitForNodes {
                live,
                needed,
                reason,
            } => Self::notice(
                out,
                Notice::WaitingForNodes {
                    live,
                    needed,
                    reason,
                },
            ),
            Action::Record(r) => {
                if r.step == 0 && self.initial_loss.is_none() {
                    self.initial_loss = Some(r.loss);
                }
                let start = *self.start_ms.get_or_insert(now_ms);
                let rec = StepRecord {
                    step: r.step,
                    t_s: now_ms.saturating_sub(start) as f64 / 1e3,
                    loss: r.loss,
                    tokens: r.tokens,
                    samples: match self.params.rules.global_batch {
                        Some(b) => b.sequences,
                        None => (r.members * self.params.config.batch) as u64,
                    },
                    live_nodes: r.live_nodes,
                    used_nodes: r.members,
                    plan_version: r.plan_version,
                    step_ms: r.step_ms,
                    expert_ms_max: r.expert_ms.iter().copied().fold(0.0, f64::max),
                    expert_ms_mean: mean(r.expert_ms.iter().copied()),
                    expert_tokens_max: r.expert_tokens.iter().copied().max().unwrap_or(0),
                    expert_tokens_mean: mean(r.expert_tokens.iter().map(|&t| t as f64)),
                    sent_bytes: r.sent_bytes,
                    copy_bytes: r.copy_bytes,
                    routing: Vec::new(),
                    trained: Vec::new(),
                    tokens_per_s: metrics::step_tokens_per_s(r.tokens, r.step_ms),
                    data_wait_ms: r.data_wait_ms,
                    // The devices' peak is the launcher's to know (`lzrun --peak-tflops`).
                    mfu: f64::NAN,
                    data_cursor: r.data_cursor,
                    eval_loss: r.eval_loss,
                    eval_ppl: r.eval_loss.map(metrics::eval_ppl),
                };
                let (routing, trained) = (r.routing, r.samples);
                self.hand_out(
                    Kept::Step {
                        record: rec,
                        routing,
                        trained,
                    },
                    out,
                );
            }
            Action::Reconfigured(r) => {
                // Members of the plan now in force that never were members before joined
                // (whatever the kind: a join may ride on a failure's reconfiguration or a
                // restore); those of the first plan are the job's own.
                let members: Vec<NodeId> = self
                    .machine
                    .plan()
                    .map(|p| p.node_map.clone())
                    .unwrap_or_default();
                let joined = members
                    .iter()
                    .filter(|m| !self.members_seen.contains(m))
                    .count();
                let joined = if r.kind == job::ReconfigKind::Start {
                    0
                } else {
                    joined
                };
                self.members_seen.extend(members);
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
                    joined,
                };
                self.hand_out(Kept::Reconfigured(rec), out);
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
            // The control rules know the experts are sharded (a lost member is repaired from
            // the shard copies or restores): the workers store them so.
            expert_mode: if self.params.rules.sharded_experts {
                ExpertMode::Fsep
            } else {
                ExpertMode::Replicated
            },
            router_skew: self.params.router_skew,
            verify_every: self.params.verify_every,
            data: self.params.data.clone(),
            global_batch: self.params.rules.global_batch,
            eval: self.params.eval.clone(),
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
        let mut cmd = Reconfigure {
            rank: 0,
            peers,
            epoch: r.epoch,
            secret,
            plan_version: r.plan.version,
            replicas,
            transfers,
            source,
            resume_step: r.resume_step,
            data_cursor: r.data_cursor,
            shard_holders: r.shard_holders.clone(),
            shard_transfers: r
                .shard_transfers
                .iter()
                .map(|t| (t.shard, t.src_rank, t.dst_rank))
                .collect(),
            checkpoint_at_resume: r.checkpoint_at_resume,
        };
        for (rank, &node) in members.iter().enumerate() {
            cmd.rank = rank;
            Self::command(node, &Command::Reconfigure(cmd.clone()), out);
        }
        cmd.rank = 0;
        self.issued = Some(Issued {
            members: members.to_vec(),
            command: cmd,
        });
    }

    /// Sends `node` its part of the reconfiguration of `epoch` again.
    fn resend(&mut self, node: NodeId, epoch: u64, out: &mut Vec<Output>) {
        let Some(issued) = self.issued.as_ref().filter(|i| i.command.epoch == epoch) else {
            let line = format!(
                "cannot send node {} epoch {epoch} again: it is not the last",
                self.name_of(node)
            );
            return Self::notice(out, Notice::Log(line));
        };
        let Some(rank) = issued.members.iter().position(|&m| m == node) else {
            return;
        };
        let mut cmd = issued.command.clone();
        cmd.rank = rank;
        Self::command(node, &Command::Reconfigure(cmd), out);
        let line = format!(
            "node {} never got its part of epoch {epoch}: sent again",
            self.name_of(node)
        );
        Self::notice(out, Notice::Log(line));
    }

    fn commit(
        &mut self,
        step: u64,
        members: usize,
        plan_version: u64,
        data_cursor: Option<u64>,
    ) -> Event {
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
            data_cursor,
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
                    data_cursor: l.manifest.data_cursor,
                }
            }
            Err(e) => Event::CheckpointMissing {
                error: format!("{}: {e}", root.display()),
            },
        }
    }
}

/// `[layer]` → expert ids from a worker's `(layer, expert)` list.
/// The mean of `xs` (0 for none).
fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

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
