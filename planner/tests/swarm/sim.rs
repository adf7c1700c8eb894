//! The simulated cluster of the swarm test: nodes (an agent that heartbeats, a worker that
//! answers the machine's actions), a network that delays, reorders and duplicates what the
//! nodes report, a checkpoint store, and the driver that feeds the real machine and performs
//! its actions. The concerns live in submodules: the simulated state (`model`), the modes
//! (`mode`), the faults and the driver's crash (`faults`), layout switches (`switch`) and the
//! checks (`oracle`).

#[path = "faults.rs"]
mod faults;
#[path = "mode.rs"]
pub mod mode;
#[path = "model.rs"]
mod model;
#[path = "oracle.rs"]
mod oracle;
#[path = "switch.rs"]
mod switch;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::fmt::Write as _;

use lazarus_planner::job::reconcile::{WorkerProcess, WorkerReport};
use lazarus_planner::job::{
    Action, Event, IdleReason, JobConfig, JobMachine, LayoutSwitch, NodeId, Reconfiguration,
    StateChecksums, StateSource, StepReport,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

pub use mode::Mode;
use model::{Canon, Piece, State};

const TICK_MS: u64 = 100;
const HEARTBEAT_MS: u64 = 200;
/// Once faults stop (and, where the seed heals, lost nodes were replaced) the job must have
/// finished or be waiting for nodes within this much simulated time: a generous multiple of
/// the longest job (90 steps of 40 ms, a few reconfigurations, the timeouts).
const SETTLE_MS: u64 = 40_000;
const TRACE_LEN: usize = 400;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// Joined; worker not started or not ready.
    Starting,
    Idle,
    Migrating,
    Training,
    Stopped,
}

struct SimNode {
    alive: bool,
    /// The worker stopped answering (its agent may still heartbeat).
    worker_frozen: bool,
    /// A frozen worker whose heartbeat thread goes on (hung in compute): still `WorkerAlive`.
    hung: bool,
    /// The agent stopped heartbeating (its worker may still answer).
    agent_frozen: bool,
    /// Its steps take this many times as long (a slow member).
    slow: u64,
    /// The agent got the job (`StartWorker`).
    started: bool,
    /// The machine handled its `Joined` (as the `delivered`-th event).
    registered: bool,
    registered_at: u64,
    /// The driver incarnation its agent is connected to (reattached after a restart).
    attached: u64,
    status: Status,
    /// Epoch of the last reconfiguration it took part in.
    epoch: u64,
    /// Plan version of the layout it trains on (its reconfiguration's, or a switch's).
    plan_version: u64,
    /// `[layer]`: the experts its layout gives it (what a sharded member reports holding).
    rows: Vec<Vec<u32>>,
    state: State,
    /// The state before the last step trained: a member one step ahead rolls back to it.
    prev: Option<State>,
    pause: bool,
    /// The newest layout switch of its epoch it was sent, and when its copies arrive.
    switch_held: Option<u64>,
    copies_at_ms: u64,
    /// Commands to a node travel one connection: in order.
    cmd_free_ms: u64,
    /// Reports from a node travel one connection too.
    report_free_ms: u64,
    last_idle: Option<Event>,
    /// What it held when it stopped (the state its `Done` checksums describe).
    stopped: Option<State>,
    /// Hosts: the host and the batch of nodes that joined with it (its siblings).
    host: Option<String>,
    batch: u64,
}

/// The collective of one epoch's members.
struct Mesh {
    r: Reconfiguration,
    /// `rows[rank][layer]`: what the plan in use puts on each member.
    rows: Vec<Vec<Vec<u32>>>,
    arrived: BTreeSet<NodeId>,
    broken: bool,
    /// The layout version the members train on.
    layout: u64,
    /// Layout switches sent to this epoch, by version.
    switches: BTreeMap<u64, LayoutSwitch>,
}

impl Mesh {
    fn shard_count(&self) -> usize {
        self.r.shard_holders.len()
    }
}

#[derive(Debug, Clone, Copy)]
enum Cmd {
    Start,
    Pause,
    Abort(u64),
    Reconfigure(u64),
    /// `(epoch, version)` of a layout switch.
    Switch(u64, u64),
    Stop,
}

enum Item {
    /// Boxed: a step report (the largest event) would make every queued item its size.
    ToMachine(Box<Event>),
    /// A command, the driver incarnation that sent it, and whether a crash of that driver
    /// loses it (it was saved but not yet sent).
    Cmd(NodeId, Cmd, u64, bool),
    Beat(NodeId),
    Tick,
    WorkerReady(NodeId),
    MigrateDone(u64),
    MeshStep(u64),
    PeerFail(u64),
    Kill(NodeId),
    Fault,
    Heal,
    Crash,
    Restart,
}

struct Entry {
    at_ms: u64,
    seq: u64,
    item: Item,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.at_ms, self.seq) == (o.at_ms, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    // Earliest first out of the max-heap.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at_ms, o.seq).cmp(&(self.at_ms, self.seq))
    }
}

struct Ckpt {
    dense: u64,
    experts: BTreeMap<(usize, u32), u64>,
    /// Sharded experts: the cut and the shards written.
    shard_count: usize,
    shards: BTreeMap<u32, u64>,
}

/// States of the members that trained one step of one epoch.
struct Trained {
    /// Every member of the mesh trained it together (not a partial step before a failure).
    full: bool,
    /// Member, its state after the step, the layout version it trained on.
    states: Vec<(NodeId, State, u64)>,
}

enum TraceItem {
    In(Event),
    Out(Action),
    Note(String),
}

/// What the seeds exercised (summed over a run; the test asserts the mix).
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub finished_ok: u64,
    pub finished_no_checkpoint: u64,
    pub final_checkpoint_failed: u64,
    pub diverged: u64,
    pub ended_waiting: u64,
    pub in_place: u64,
    pub restores: u64,
    pub joins: u64,
    pub rebalances: u64,
    pub shard_repairs: u64,
    /// Repair-first recoveries (`RecoveryPolicy::Repair`) and the replicas they copied.
    pub repairs: u64,
    pub repair_copies: u64,
    pub switches_sent: u64,
    pub switches_done: u64,
    pub async_copies: u64,
    pub waited_for_nodes: u64,
    pub fenced_stuck: u64,
    pub fenced_silent: u64,
    pub fenced_host: u64,
    /// Healthy members fenced as stuck with a hung or frozen peer that blocked them.
    pub fenced_collateral: u64,
    pub kills: u64,
    pub rolled_back: u64,
    pub restarts: u64,
    pub reattached: u64,
    pub resent: u64,
    pub slow_members: u64,
    /// The machine said a heartbeating member is slow, not gone.
    pub slow_logged: u64,
    /// Driver restarts after which every node came back consistent.
    pub recovered_in_place: u64,
    pub nonfinite_counted: u64,
    pub steps: u64,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        macro_rules! sum {
            ($($f:ident),*) => { $(self.$f += o.$f;)* };
        }
        sum!(
            finished_ok,
            finished_no_checkpoint,
            final_checkpoint_failed,
            diverged,
            ended_waiting,
            in_place,
            restores,
            joins,
            rebalances,
            shard_repairs,
            repairs,
            repair_copies,
            switches_sent,
            switches_done,
            async_copies,
            waited_for_nodes,
            fenced_stuck,
            fenced_silent,
            fenced_host,
            fenced_collateral,
            kills,
            rolled_back,
            restarts,
            reattached,
            resent,
            slow_members,
            slow_logged,
            recovered_in_place,
            nonfinite_counted,
            steps
        );
    }
}

#[derive(Debug)]
pub struct Failure {
    pub at_ms: u64,
    pub why: String,
    pub trace: String,
    /// Only the final-state oracle failed (see `oracle::check_final_state`).
    pub final_state: bool,
}

/// Runs one seed of one mode; `final_state`: whether the final-state oracle is on.
pub fn run_seed(mode: Mode, seed: u64, final_state: bool) -> Result<Stats, Failure> {
    let mut sim = Sim::new(mode, seed, final_state);
    sim.run();
    match sim.fail.take() {
        None => Ok(sim.stats),
        Some(why) => Err(Failure {
            at_ms: sim.now_ms,
            why,
            trace: sim.trace_text(),
            final_state: sim.final_state_failed,
        }),
    }
}

struct Sim {
    mode: Mode,
    rng: Xoshiro256PlusPlus,
    m: JobMachine,
    cfg: JobConfig,
    canon: Canon,
    now_ms: u64,
    seq: u64,
    queue: BinaryHeap<Entry>,
    nodes: BTreeMap<NodeId, SimNode>,
    names: BTreeMap<NodeId, String>,
    next_id: NodeId,
    /// GPUs per host (1: a node per host).
    gpus: usize,
    next_batch: u64,
    mesh: Option<Mesh>,
    step_ms: u64,
    ckpt_parts: BTreeMap<(u64, u64), Vec<State>>,
    committed: BTreeMap<u64, Ckpt>,
    commit_fail_p: f64,
    /// Simulated storage failures of the last step's checkpoint.
    final_commit_failures: u64,
    trained: BTreeMap<(u64, u64), Trained>,
    faults_until_ms: u64,
    kill_in_reconfig: u32,
    // The driver's crash (fail-over mode).
    driver_down: bool,
    incarnation: u64,
    /// Reports the nodes' agents hold while the driver is down, in order.
    buffered: BTreeMap<NodeId, Vec<Event>>,
    // What the checks remember.
    last_epoch: u64,
    last_version: u64,
    record_epoch: u64,
    /// The next step the machine may count.
    counted_next: u64,
    /// The resume step of the last reconfiguration of the current lineage.
    lineage_resume: u64,
    /// Counted non-finite steps in a row.
    nonfinite_run: u64,
    /// The machine's members before the event it handles now.
    members_before: Vec<NodeId>,
    /// Nodes the machine knew and dropped, with the `delivered` count then.
    machine_lost: BTreeMap<NodeId, u64>,
    /// Events the machine handled.
    delivered: u64,
    finished: Option<Result<(), String>>,
    no_checkpoint_said: bool,
    /// The machine logged a repair: the next reconfiguration is its plan.
    repair_said: bool,
    final_state: bool,
    final_state_failed: bool,
    trace: VecDeque<(u64, TraceItem)>,
    stats: Stats,
    fail: Option<String>,
}

impl Sim {
    fn new(mode: Mode, seed: u64, final_state: bool) -> Self {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(mode.stream(seed));
        let setup = mode::setup(mode, &mut rng);
        let cfg = setup.cfg;
        let m = JobMachine::new(cfg.clone()).expect("a valid config");
        let faults_until_ms = rng.random_range(1_500..12_000);
        let commit_fail_p = [0.0, 0.1, 0.3][rng.random_range(0..3)];
        let step_ms = rng.random_range(10..=40);
        let canon = Canon::new(
            cfg.model.layers,
            cfg.model.experts,
            cfg.total_steps,
            setup.nonfinite,
        );
        let mut sim = Self {
            mode,
            rng,
            m,
            cfg,
            canon,
            now_ms: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            nodes: BTreeMap::new(),
            names: BTreeMap::new(),
            next_id: 0,
            gpus: setup.gpus,
            next_batch: 0,
            mesh: None,
            step_ms,
            ckpt_parts: BTreeMap::new(),
            committed: BTreeMap::new(),
            commit_fail_p,
            final_commit_failures: 0,
            trained: BTreeMap::new(),
            faults_until_ms,
            kill_in_reconfig: 0,
            driver_down: false,
            incarnation: 0,
            buffered: BTreeMap::new(),
            last_epoch: 0,
            last_version: 0,
            record_epoch: 0,
            counted_next: 0,
            lineage_resume: 0,
            nonfinite_run: 0,
            members_before: Vec::new(),
            machine_lost: BTreeMap::new(),
            delivered: 0,
            finished: None,
            no_checkpoint_said: false,
            repair_said: false,
            final_state,
            final_state_failed: false,
            trace: VecDeque::new(),
            stats: Stats::default(),
            fail: None,
        };
        if sim.gpus == 1 {
            for _ in 0..sim.cfg.initial_nodes {
                sim.join(None);
            }
        } else {
            for _ in 0..sim.cfg.initial_nodes / sim.gpus {
                sim.join_host(None);
            }
        }
        sim.schedule_faults();
        sim.at(TICK_MS, Item::Tick);
        sim
    }

    fn at(&mut self, at_ms: u64, item: Item) {
        self.seq += 1;
        self.queue.push(Entry {
            at_ms,
            seq: self.seq,
            item,
        });
    }

    fn garbage(&mut self) -> u64 {
        self.rng.random()
    }

    /// A report to the machine: usually quick, sometimes late. What one node reports travels
    /// one connection, in order (reports of different nodes overtake each other); a copy of
    /// it (a retransmission) may arrive later, after newer reports.
    fn send(&mut self, ev: Event) {
        let dup = self.rng.random_bool(0.05);
        self.send_with(ev, dup);
    }

    fn send_with(&mut self, ev: Event, dup: bool) {
        let d = self.net_ms();
        let mut at = self.now_ms + d;
        if let Some(n) = event_node(&ev).and_then(|id| self.nodes.get_mut(&id)) {
            at = at.max(n.report_free_ms);
            n.report_free_ms = at;
        }
        if dup {
            let d2 = self.net_ms();
            self.at(at + d2, Item::ToMachine(Box::new(ev.clone())));
        }
        self.at(at, Item::ToMachine(Box::new(ev)));
    }

    fn net_ms(&mut self) -> u64 {
        match self.rng.random_range(0..100) {
            0..85 => self.rng.random_range(1..20),
            85..97 => self.rng.random_range(20..300),
            _ => self.rng.random_range(300..800),
        }
    }

    fn cmd(&mut self, node: NodeId, c: Cmd) {
        let d = self.rng.random_range(1..15);
        let lost_on_crash = self.rng.random_bool(0.5);
        let Some(n) = self.nodes.get_mut(&node) else {
            return;
        };
        let at = (self.now_ms + d).max(n.cmd_free_ms);
        n.cmd_free_ms = at;
        let inc = self.incarnation;
        self.at(at, Item::Cmd(node, c, inc, lost_on_crash));
    }

    fn note(&mut self, s: String) {
        self.push_trace(TraceItem::Note(s));
    }

    fn push_trace(&mut self, t: TraceItem) {
        if self.trace.len() == TRACE_LEN {
            self.trace.pop_front();
        }
        self.trace.push_back((self.now_ms, t));
    }

    fn fail(&mut self, why: String) {
        if self.fail.is_none() {
            self.fail = Some(why);
        }
    }

    fn run(&mut self) {
        let deadline_ms = self.faults_until_ms + SETTLE_MS;
        while let Some(e) = self.queue.pop() {
            if e.at_ms > deadline_ms {
                break;
            }
            self.now_ms = e.at_ms;
            self.step(e.item);
            if self.fail.is_some() || self.finished.is_some() {
                break;
            }
        }
        if self.fail.is_none() {
            self.check_end();
        }
    }

    fn step(&mut self, item: Item) {
        match item {
            Item::ToMachine(ev) => self.arrive(*ev),
            Item::Tick => {
                if !self.driver_down {
                    self.deliver(Event::Tick);
                }
                self.at(self.now_ms + TICK_MS, Item::Tick);
            }
            Item::Beat(id) => {
                let n = &self.nodes[&id];
                if n.alive {
                    let deadline = self.cfg.step_deadline.is_some();
                    let worker = n.started
                        && !matches!(n.status, Status::Starting | Status::Stopped)
                        && (!n.worker_frozen || n.hung);
                    if !n.agent_frozen {
                        self.send_with(Event::Heartbeat { node: id }, false);
                        if deadline && worker {
                            self.send_with(Event::WorkerAlive { node: id }, false);
                        }
                    }
                    self.at(self.now_ms + HEARTBEAT_MS, Item::Beat(id));
                }
            }
            Item::Cmd(id, c, inc, lost_on_crash) => {
                if inc < self.incarnation && lost_on_crash {
                    return self.note(format!("{c:?} to node {id} lost with the driver"));
                }
                if self.driver_down && inc == self.incarnation {
                    return;
                }
                self.command(id, c)
            }
            Item::WorkerReady(id) => {
                let layers = self.cfg.model.layers;
                let dense = self.garbage();
                let n = self.nodes.get_mut(&id).unwrap();
                if n.alive && !n.worker_frozen && n.status == Status::Starting {
                    n.status = Status::Idle;
                    // Its own initialisation: not the job's state.
                    n.state = State {
                        dense,
                        held: vec![Vec::new(); layers],
                        shards: Vec::new(),
                        next_step: 0,
                    };
                    self.send(Event::Ready { node: id });
                }
            }
            Item::MigrateDone(epoch) => self.migrate_done(epoch),
            Item::MeshStep(epoch) => self.mesh_step(epoch),
            Item::PeerFail(epoch) => self.peer_fail(epoch),
            Item::Kill(id) => {
                if self.nodes[&id].alive {
                    self.note(format!("fault: kill node {id} during the reconfiguration"));
                    self.kill(id, true);
                }
            }
            Item::Fault => self.fault(),
            Item::Heal => self.heal(),
            Item::Crash => self.crash(),
            Item::Restart => self.restart(),
        }
    }

    // ---------------------------------------------------------------- the machine's side

    /// A report reaches the driver, or, while it is down, waits in its node's agent.
    fn arrive(&mut self, ev: Event) {
        let attached = event_node(&ev)
            .and_then(|id| self.nodes.get(&id))
            .is_none_or(|n| n.attached == self.incarnation);
        if !self.driver_down && (attached || matches!(ev, Event::Lost { .. })) {
            return self.deliver(ev);
        }
        match event_node(&ev) {
            // A closed connection is the driver's observation: nobody reports it later.
            _ if matches!(ev, Event::Lost { .. } | Event::Heartbeat { .. }) => {}
            Some(id) if self.nodes[&id].alive => self.buffered.entry(id).or_default().push(ev),
            // A dead node's agent is gone with its lines; the driver's own answers (checkpoint
            // store) are lost with the driver.
            _ => {}
        }
    }

    fn deliver(&mut self, ev: Event) {
        if !matches!(
            ev,
            Event::Heartbeat { .. } | Event::Tick | Event::WorkerAlive { .. }
        ) {
            self.push_trace(TraceItem::In(ev.clone()));
        }
        self.delivered += 1;
        if let Event::Joined { node, .. } = &ev
            && let Some(n) = self.nodes.get_mut(node)
            && !n.registered
        {
            n.registered = true;
            n.registered_at = self.delivered;
        }
        let mut out = Vec::new();
        self.members_before.clear();
        self.members_before.extend_from_slice(self.m.members());
        let known: Vec<NodeId> = self.m.live_nodes();
        self.m.handle(self.now_ms, ev, &mut out);
        self.after_machine(&known, out);
    }

    /// Checks the machine after it handled something, then performs its actions.
    fn after_machine(&mut self, known_before: &[NodeId], out: Vec<Action>) {
        if let Err(e) = self.m.check_invariants() {
            return self.fail(format!("check_invariants: {e}"));
        }
        let live = self.m.live_nodes();
        for id in known_before {
            if !live.contains(id) {
                self.machine_lost.entry(*id).or_insert(self.delivered);
            }
        }
        for a in out {
            if !matches!(a, Action::Log(_)) {
                self.push_trace(TraceItem::Out(a.clone()));
            }
            self.perform(a);
            if self.fail.is_some() {
                return;
            }
        }
        self.check_coverage();
        self.check_hosts();
    }

    fn perform(&mut self, a: Action) {
        match a {
            Action::StartWorker { node } => self.cmd(node, Cmd::Start),
            Action::Pause { node } => self.cmd(node, Cmd::Pause),
            Action::Abort { node, epoch } => self.cmd(node, Cmd::Abort(epoch)),
            Action::Stop { node } => self.cmd(node, Cmd::Stop),
            Action::Reconfigure(r) => self.reconfigure(*r),
            // Only a restarted driver re-sends.
            Action::Resend { node, epoch } => {
                if self.mode != Mode::Failover {
                    return self.fail(format!("unexpected resend of epoch {epoch} to {node}"));
                }
                if self.mesh.as_ref().is_none_or(|m| m.r.epoch != epoch) {
                    return self.fail(format!(
                        "resend of epoch {epoch} to node {node}, not the last reconfiguration"
                    ));
                }
                self.stats.resent += 1;
                self.cmd(node, Cmd::Reconfigure(epoch));
            }
            Action::SwitchLayout(sw) => self.switch_layout(*sw),
            Action::CommitCheckpoint { step, .. } => self.commit(step),
            Action::FindCheckpoint => match self.committed.keys().next_back() {
                Some(&step) => self.send(Event::CheckpointFound {
                    step,
                    data_cursor: None,
                }),
                None => {
                    self.no_checkpoint_said = true;
                    self.send(Event::CheckpointMissing {
                        error: "no committed checkpoint".into(),
                    })
                }
            },
            Action::Fence { node, reason } => {
                if reason.contains("its host") {
                    self.stats.fenced_host += 1;
                } else if reason.contains("heartbeat from") || reason.contains("come back") {
                    self.stats.fenced_silent += 1;
                } else {
                    self.stats.fenced_stuck += 1;
                    self.check_fenced_stuck(node, &reason);
                }
                self.kill(node, false);
            }
            Action::WaitForNodes { .. } => self.stats.waited_for_nodes += 1,
            Action::Record(r) => self.check_record(&r),
            Action::Log(line) => {
                if line.starts_with("repair: ") {
                    self.repair_said = true;
                }
                if line.contains("is slow, not gone") {
                    self.stats.slow_logged += 1;
                }
                if line.contains("controller recovery complete") && line.contains("in place") {
                    self.stats.recovered_in_place += 1;
                }
            }
            Action::Reconfigured(_) => {}
            Action::Finished(res) => {
                match &res {
                    Ok(()) if self.counted_next != self.cfg.total_steps => self.fail(format!(
                        "finished after counting {} of {} steps",
                        self.counted_next, self.cfg.total_steps
                    )),
                    Ok(()) => {
                        self.stats.finished_ok += 1;
                        self.check_final_state();
                    }
                    // The acceptable failures: a restore with no checkpoint committed, a
                    // diverged job.
                    Err(e) if self.no_checkpoint_said && e.contains("no checkpoint") => {
                        self.stats.finished_no_checkpoint += 1
                    }
                    // Or the simulated storage failed every try of the last step's checkpoint:
                    // the job must not end well without its final state saved.
                    Err(e)
                        if self.final_commit_failures > 0
                            && e.contains("checkpoint after the last step") =>
                    {
                        self.stats.final_checkpoint_failed += 1
                    }
                    Err(e)
                        if e.contains("training diverged")
                            && self.nonfinite_run >= self.cfg.max_nonfinite_steps =>
                    {
                        self.stats.diverged += 1
                    }
                    Err(e) => self.fail(format!("the job failed: {e}")),
                }
                self.finished = Some(res);
            }
        }
    }

    fn commit(&mut self, step: u64) {
        let Some(parts) = self.ckpt_parts.remove(&(self.m.epoch(), step)) else {
            return self.fail(format!(
                "commit of the checkpoint of step {step} whose parts nobody wrote"
            ));
        };
        if self.rng.random_bool(self.commit_fail_p) {
            if step == self.cfg.total_steps {
                self.final_commit_failures += 1;
            }
            return self.send(Event::CheckpointFailed {
                step,
                error: "simulated storage error".into(),
            });
        }
        // Parts that disagree make a corrupt checkpoint: a restore of it is caught later.
        let mut dense = parts[0].dense;
        let mut experts = BTreeMap::new();
        let mut shards = BTreeMap::new();
        fn merge<K: Ord>(map: &mut BTreeMap<K, u64>, k: K, v: u64) {
            let c = map.entry(k).or_insert(v);
            if *c != v {
                *c = model::splitmix64(*c ^ v);
            }
        }
        for p in &parts {
            if p.dense != dense {
                dense = model::splitmix64(dense ^ p.dense);
            }
            for (l, es) in p.held.iter().enumerate() {
                for &(e, v) in es {
                    merge(&mut experts, (l, e), v);
                }
            }
            for &(s, v) in &p.shards {
                merge(&mut shards, s, v);
            }
        }
        let shard_count = self.mesh.as_ref().map_or(0, Mesh::shard_count);
        // As lzrun's commit does (every expected part must be on disk): a checkpoint whose
        // parts miss an expert, or a shard of the cut, fails (found by the long run: a sharded
        // member lost before it wrote its parts of the last step made a "committed" final
        // checkpoint without its shard).
        let complete = if self.cfg.sharded_experts {
            (0..shard_count as u32).all(|s| shards.contains_key(&s))
        } else {
            (0..self.cfg.model.layers)
                .all(|l| (0..self.cfg.model.experts as u32).all(|e| experts.contains_key(&(l, e))))
        };
        if !complete {
            return self.send(Event::CheckpointFailed {
                step,
                error: "a part of the checkpoint is missing".into(),
            });
        }
        self.committed.insert(
            step,
            Ckpt {
                dense,
                experts,
                shard_count,
                shards,
            },
        );
        self.send(Event::CheckpointCommitted { step });
    }

    /// Sends a new plan (after the oracle checked it against what the nodes really hold).
    fn reconfigure(&mut self, r: Reconfiguration) {
        if !self.check_reconfiguration(&r) {
            return;
        }
        self.counted_next = r.resume_step;
        self.record_epoch = r.epoch;
        self.trained.clear();
        self.ckpt_parts.retain(|&(e, _), _| e >= r.epoch);
        let epoch = r.epoch;
        let members = r.members().to_vec();
        if members.iter().any(|m| !self.nodes[m].alive) {
            let d = self.detect_ms();
            self.at(self.now_ms + d, Item::PeerFail(epoch));
        }
        if self.kill_in_reconfig > 0 {
            self.kill_in_reconfig -= 1;
            let victim = members[self.rng.random_range(0..members.len())];
            let d = self.rng.random_range(0..150);
            self.at(self.now_ms + d, Item::Kill(victim));
        }
        let rows = r.plan.plan_node_contents();
        let layout = r.plan.version;
        self.mesh = Some(Mesh {
            r,
            rows,
            arrived: BTreeSet::new(),
            broken: false,
            layout,
            switches: BTreeMap::new(),
        });
        for m in members {
            self.cmd(m, Cmd::Reconfigure(epoch));
        }
    }

    // ---------------------------------------------------------------- the nodes' side

    fn detect_ms(&mut self) -> u64 {
        self.rng.random_range(20..300)
    }

    fn new_node(&mut self, name: Option<String>, host: Option<String>, batch: u64) {
        let id = self.next_id;
        self.next_id += 1;
        let name = name.unwrap_or_else(|| format!("n{id}"));
        self.nodes.insert(
            id,
            SimNode {
                alive: true,
                worker_frozen: false,
                hung: false,
                agent_frozen: false,
                slow: 1,
                started: false,
                registered: false,
                registered_at: 0,
                attached: self.incarnation,
                status: Status::Starting,
                epoch: 0,
                plan_version: 0,
                rows: Vec::new(),
                state: State::default(),
                prev: None,
                pause: false,
                switch_held: None,
                copies_at_ms: 0,
                cmd_free_ms: 0,
                report_free_ms: 0,
                last_idle: None,
                stopped: None,
                host: host.clone(),
                batch,
            },
        );
        self.names.insert(id, name.clone());
        self.send(Event::Joined {
            node: id,
            name,
            host,
        });
        self.at(self.now_ms + HEARTBEAT_MS, Item::Beat(id));
    }

    fn join(&mut self, name: Option<String>) {
        if self.gpus > 1 {
            return self.join_host(None);
        }
        let batch = self.next_batch;
        self.next_batch += 1;
        self.new_node(name, None, batch);
    }

    /// A host of `gpus` nodes joins (under a dead host's name, or a new one).
    fn join_host(&mut self, host: Option<String>) {
        let batch = self.next_batch;
        self.next_batch += 1;
        let host = host.unwrap_or_else(|| format!("h{batch}"));
        for g in 0..self.gpus {
            self.new_node(Some(format!("{host}g{g}")), Some(host.clone()), batch);
        }
    }

    fn kill(&mut self, id: NodeId, say_lost: bool) {
        let n = self.nodes.get_mut(&id).unwrap();
        if !n.alive {
            return;
        }
        n.alive = false;
        self.stats.kills += 1;
        self.buffered.remove(&id);
        if let Some(mesh) = &self.mesh
            && !mesh.broken
            && mesh.r.members().contains(&id)
        {
            let epoch = mesh.r.epoch;
            let d = self.detect_ms();
            self.at(self.now_ms + d, Item::PeerFail(epoch));
        }
        // A closed connection tells the driver; a silent death shows as missing heartbeats.
        if say_lost && self.rng.random_bool(0.6) {
            self.send(Event::Lost {
                node: id,
                reason: "connection closed".into(),
            });
        }
    }

    fn idle(&mut self, id: NodeId, why: IdleReason) {
        let sharded = self.cfg.sharded_experts;
        let n = self.nodes.get_mut(&id).unwrap();
        n.status = Status::Idle;
        n.pause = false;
        // A sharded member reports the experts its layout gave it to compute.
        let held = if sharded {
            n.rows.clone()
        } else {
            n.state.holdings()
        };
        let ev = Event::Idle {
            node: id,
            epoch: n.epoch,
            why,
            step: n.state.next_step,
            held: held.into(),
        };
        n.last_idle = Some(ev.clone());
        self.send(ev);
    }

    fn command(&mut self, id: NodeId, c: Cmd) {
        let n = &self.nodes[&id];
        if !n.alive || n.worker_frozen {
            return;
        }
        let (status, node_epoch, last_idle) = (n.status, n.epoch, n.last_idle.clone());
        match c {
            Cmd::Start => {
                let n = self.nodes.get_mut(&id).unwrap();
                if n.started {
                    return;
                }
                n.started = true;
                // Now and then a worker that never becomes ready.
                if !self.rng.random_bool(0.03) {
                    let d = self.rng.random_range(20..300);
                    self.at(self.now_ms + d, Item::WorkerReady(id));
                }
            }
            Cmd::Pause => {
                let n = self.nodes.get_mut(&id).unwrap();
                if n.status == Status::Training {
                    n.pause = true;
                }
            }
            Cmd::Abort(epoch) => {
                if node_epoch != epoch {
                    return;
                }
                match status {
                    Status::Migrating | Status::Training => {
                        self.fail_member(id, "aborted");
                        let d = self.detect_ms();
                        self.at(self.now_ms + d, Item::PeerFail(epoch));
                    }
                    Status::Idle => {
                        if let Some(ev) = last_idle {
                            self.send(ev);
                        }
                    }
                    Status::Starting | Status::Stopped => {}
                }
            }
            Cmd::Reconfigure(epoch) => self.reconfigure_arrived(id, epoch),
            Cmd::Switch(epoch, version) => self.switch_arrived(id, epoch, version),
            Cmd::Stop => {
                let n = self.nodes.get_mut(&id).unwrap();
                if n.status == Status::Stopped {
                    return;
                }
                let checksums = if n.status == Status::Starting {
                    StateChecksums::default()
                } else {
                    let experts = n
                        .state
                        .held
                        .iter()
                        .enumerate()
                        .flat_map(|(l, es)| es.iter().map(move |&(e, v)| (l as u32, e, v)));
                    StateChecksums {
                        dense: n.state.dense,
                        replicas: experts.collect(),
                        shards: n.state.shards.clone(),
                    }
                };
                n.status = Status::Stopped;
                n.stopped = Some(n.state.clone());
                self.send(Event::Done {
                    node: id,
                    checksums,
                });
            }
        }
    }

    /// What a node's agent says when it comes back to a restarted driver.
    fn worker_report(&self, id: NodeId) -> WorkerReport {
        let n = &self.nodes[&id];
        let process = if !n.started {
            WorkerProcess::NotStarted
        } else if n.status == Status::Stopped {
            WorkerProcess::Stopped
        } else {
            WorkerProcess::Running
        };
        WorkerReport {
            process,
            epoch: n.epoch,
            plan_version: n.plan_version,
            next_step: n.state.next_step,
        }
    }

    fn reconfigure_arrived(&mut self, id: NodeId, epoch: u64) {
        let Some(mesh) = &self.mesh else { return };
        if mesh.r.epoch != epoch {
            return;
        }
        let (peers, resume, broken, version) = (
            matches!(mesh.r.source, StateSource::Peers { .. }),
            mesh.r.resume_step,
            mesh.broken,
            mesh.r.plan.version,
        );
        let n = self.nodes.get_mut(&id).unwrap();
        if n.epoch == epoch {
            // A resent plan that had arrived after all.
            return;
        }
        if !matches!(n.status, Status::Idle) {
            let why = format!(
                "node {id} got the plan of epoch {epoch} while {:?} in epoch {}",
                n.status, n.epoch
            );
            return self.fail(why);
        }
        n.status = Status::Migrating;
        n.epoch = epoch;
        n.plan_version = version;
        n.switch_held = None;
        n.pause = false;
        n.last_idle = None;
        if peers {
            // A member one step ahead rolls back first; one that cannot reach the resume
            // step keeps a state that is wrong there.
            match resolve(n, resume) {
                Some(s) => {
                    if s.next_step != n.state.next_step {
                        self.stats.rolled_back += 1;
                    }
                    n.state = s;
                }
                None => {
                    n.state.next_step = resume;
                    n.state.spoil();
                }
            }
            n.prev = None;
        }
        if broken {
            return self.fail_member(id, "a peer of the new mesh is gone");
        }
        let mesh = self.mesh.as_mut().unwrap();
        mesh.arrived.insert(id);
        if mesh.arrived.len() == mesh.r.members().len() {
            let d = self.rng.random_range(20..200);
            self.at(self.now_ms + d, Item::MigrateDone(epoch));
        }
    }

    /// The members of the mesh of `epoch` that can act now, or `None` if some cannot (dead,
    /// frozen, gone idle): a dead or idle one makes the others fail (`PeerFail`), a frozen one
    /// blocks them until it is fenced.
    fn mesh_ready(&self, epoch: u64, status: Status) -> Option<Vec<NodeId>> {
        let mesh = self.mesh.as_ref()?;
        if mesh.r.epoch != epoch || mesh.broken {
            return None;
        }
        let members = mesh.r.members().to_vec();
        members
            .iter()
            .all(|m| {
                let n = &self.nodes[m];
                n.alive && !n.worker_frozen && n.status == status && n.epoch == epoch
            })
            .then_some(members)
    }

    /// What rank `q` of the mesh is to hold once the plan's state arrived: each piece with
    /// its value from its source (`None`: the source has nothing to give), and the dense
    /// state. `bases[r]`: rank `r`'s state at the resume step, `None` when it did not take
    /// the plan in (it sends nothing).
    fn arrivals(
        &self,
        q: usize,
        bases: &[Option<State>],
    ) -> (Option<u64>, Vec<(Piece, Option<u64>)>) {
        let mesh = self.mesh.as_ref().unwrap();
        let r = &mesh.r;
        let count = mesh.shard_count();
        let mut pieces: Vec<Piece> = Vec::new();
        if self.cfg.sharded_experts {
            for (s, holders) in r.shard_holders.iter().enumerate() {
                if holders.contains(&q) {
                    pieces.push(Piece::Shard(s as u32));
                }
            }
        } else {
            for (l, es) in mesh.rows[q].iter().enumerate() {
                pieces.extend(es.iter().map(|&e| Piece::Expert(l, e)));
            }
        }
        let from = |src: usize, p: Piece| bases[src].as_ref().and_then(|b| b.piece(p));
        // A peer that did not take the plan in sends nothing.
        let sends = |src: usize| bases[src].is_some();
        let values: Vec<(Piece, Option<u64>)> = pieces
            .into_iter()
            .filter(|&p| {
                let src = match (&r.source, p) {
                    (StateSource::Peers { .. }, Piece::Expert(l, e)) => r
                        .transfers
                        .iter()
                        .find(|t| t.dst_rank == q && t.layer == l && t.expert == e as usize)
                        .map_or(q, |t| t.src_rank),
                    (StateSource::Peers { .. }, Piece::Shard(s)) => r
                        .shard_transfers
                        .iter()
                        .find(|t| t.dst_rank == q && t.shard == s as usize)
                        .map_or(q, |t| t.src_rank),
                    _ => return true,
                };
                sends(src)
            })
            .map(|p| {
                let v = match (&r.source, p) {
                    (StateSource::Fresh, Piece::Expert(l, e)) => {
                        Some(self.canon.experts[l][e as usize][0])
                    }
                    (StateSource::Fresh, Piece::Shard(s)) => Some(self.canon.shard(count, s, 0)),
                    (StateSource::Checkpoint { step }, Piece::Expert(l, e)) => self
                        .committed
                        .get(step)
                        .and_then(|c| c.experts.get(&(l, e)).copied()),
                    (StateSource::Checkpoint { step }, Piece::Shard(s)) => self
                        .committed
                        .get(step)
                        .filter(|c| self.reshards(c, *step))
                        .map(|_| self.canon.shard(count, s, *step)),
                    (StateSource::Peers { .. }, Piece::Expert(l, e)) => {
                        let src = r
                            .transfers
                            .iter()
                            .find(|t| t.dst_rank == q && t.layer == l && t.expert == e as usize)
                            .map_or(q, |t| t.src_rank);
                        from(src, p)
                    }
                    (StateSource::Peers { .. }, Piece::Shard(s)) => {
                        let src = r
                            .shard_transfers
                            .iter()
                            .find(|t| t.dst_rank == q && t.shard == s as usize)
                            .map_or(q, |t| t.src_rank);
                        from(src, p)
                    }
                };
                (p, v)
            })
            .collect();
        let dense = match &r.source {
            StateSource::Fresh => Some(self.canon.dense[0]),
            StateSource::Checkpoint { step } => self.committed.get(step).map(|c| c.dense),
            StateSource::Peers {
                dense_from,
                dense_to,
            } => {
                let src = if dense_to.contains(&q) {
                    *dense_from
                } else {
                    q
                };
                bases[src].as_ref().map(|b| b.dense)
            }
        };
        (dense, values)
    }

    /// Whether a committed sharded checkpoint holds every shard of its cut, correct: then a
    /// restore can cut it anew for any membership.
    fn reshards(&self, c: &Ckpt, step: u64) -> bool {
        c.shard_count > 0
            && (0..c.shard_count as u32)
                .all(|s| c.shards.get(&s) == Some(&self.canon.shard(c.shard_count, s, step)))
    }

    fn migrate_done(&mut self, epoch: u64) {
        let Some(members) = self.mesh_ready(epoch, Status::Migrating) else {
            return;
        };
        let mesh = self.mesh.as_ref().unwrap();
        let (resume, rows) = (mesh.r.resume_step, mesh.rows.clone());
        let bases: Vec<Option<State>> = members
            .iter()
            .map(|m| Some(self.nodes[m].state.clone()))
            .collect();
        for (q, &id) in members.iter().enumerate() {
            let (dense, pieces) = self.arrivals(q, &bases);
            // A slot with nothing to put in it: whatever the process had there.
            let mut st = State {
                dense: dense.unwrap_or_else(|| self.garbage()),
                held: vec![Vec::new(); self.cfg.model.layers],
                shards: Vec::new(),
                next_step: resume,
            };
            for (p, v) in pieces {
                let v = v.unwrap_or_else(|| self.garbage());
                st.set(p, v);
            }
            let n = self.nodes.get_mut(&id).unwrap();
            n.state = st;
            n.rows = rows[q].clone();
            n.prev = None;
            n.status = Status::Training;
            self.send(Event::Migrated {
                node: id,
                epoch,
                bytes_in: 1 << 20,
            });
        }
        self.write_checkpoint(epoch, &members, resume);
        let d = self.step_ms;
        self.at(self.now_ms + d, Item::MeshStep(epoch));
    }

    fn write_checkpoint(&mut self, epoch: u64, members: &[NodeId], step: u64) {
        if !self.cfg.checkpoint_due(step) {
            return;
        }
        for &id in members {
            let st = self.nodes[&id].state.clone();
            self.ckpt_parts.entry((epoch, step)).or_default().push(st);
            self.send(Event::CheckpointWritten {
                node: id,
                epoch,
                step,
            });
        }
    }

    fn report(&mut self, step: u64, layout_version: u64) -> StepReport {
        let (layers, experts) = (self.cfg.model.layers, self.cfg.model.experts);
        // Skewed routing (low experts hot), so LAER sees imbalance worth a re-layout.
        let routing = (0..layers)
            .map(|_| {
                (0..experts)
                    .map(|e| self.rng.random_range(0..50) * (experts - e) as u64)
                    .collect()
            })
            .collect();
        StepReport {
            loss: self.rng.random_range(1.0..3.0),
            tokens: 64,
            step_ms: self.step_ms as f64,
            routing,
            nonfinite: self.canon.skipped(step),
            layout_version,
            ..StepReport::default()
        }
    }

    /// One member trains its next step (alone: a step in flight when a peer failed, or as
    /// part of the whole mesh).
    fn train_one(&mut self, id: NodeId, epoch: u64, full: bool) {
        let n = self.nodes.get_mut(&id).unwrap();
        let step = n.state.next_step;
        let next = n.state.trained(&self.canon);
        let layout = n.plan_version;
        n.prev = Some(std::mem::replace(&mut n.state, next.clone()));
        let t = self.trained.entry((epoch, step)).or_insert(Trained {
            full,
            states: Vec::new(),
        });
        t.states.push((id, next, layout));
        let report = self.report(step, layout);
        self.send(Event::Stepped {
            node: id,
            epoch,
            step,
            report,
        });
    }

    fn mesh_step(&mut self, epoch: u64) {
        let Some(members) = self.mesh_ready(epoch, Status::Training) else {
            return;
        };
        let steps: BTreeSet<u64> = members
            .iter()
            .map(|m| self.nodes[m].state.next_step)
            .collect();
        let step = *steps.first().unwrap();
        if steps.len() != 1 {
            return self.fail(format!("members of epoch {epoch} train different steps"));
        }
        let total = self.cfg.total_steps;
        if step >= total {
            for &m in &members {
                self.idle(m, IdleReason::Finished);
            }
            return;
        }
        // A pause takes effect at the first boundary where every member was asked.
        if members.iter().all(|m| self.nodes[m].pause) {
            for &m in &members {
                self.idle(m, IdleReason::Paused);
            }
            return;
        }
        for &m in &members {
            self.train_one(m, epoch, true);
        }
        self.write_checkpoint(epoch, &members, step + 1);
        if step + 1 == total {
            for &m in &members {
                self.idle(m, IdleReason::Finished);
            }
            return;
        }
        // The barrier of this step may show every member ready for a new layout.
        self.maybe_switch(epoch, &members, step);
        let slowest = members
            .iter()
            .map(|m| self.nodes[m].slow)
            .max()
            .unwrap_or(1);
        let d = self.step_ms * slowest + self.rng.random_range(0..5);
        self.at(self.now_ms + d, Item::MeshStep(epoch));
    }

    /// A peer of `epoch` is gone or left: every member that can still act fails.
    fn peer_fail(&mut self, epoch: u64) {
        let Some(mesh) = self.mesh.as_mut() else {
            return;
        };
        if mesh.r.epoch != epoch {
            return;
        }
        mesh.broken = true;
        let members = mesh.r.members().to_vec();
        for id in members {
            let n = &self.nodes[&id];
            if n.alive
                && !n.worker_frozen
                && n.epoch == epoch
                && matches!(n.status, Status::Migrating | Status::Training)
            {
                self.fail_member(id, "a peer is gone");
            }
        }
    }

    /// A member stops in the middle of what it does and reports idle with what it holds: a
    /// reconfiguration keeps what it had plus what arrived; a step in flight may have
    /// completed on it.
    fn fail_member(&mut self, id: NodeId, why: &str) {
        let mesh = self.mesh.as_ref().unwrap();
        let epoch = mesh.r.epoch;
        match self.nodes[&id].status {
            Status::Migrating => {
                let q = mesh.r.members().iter().position(|&m| m == id).unwrap();
                let resume = mesh.r.resume_step;
                // Only a source that took the plan in (and rolled back to the resume step)
                // sends anything.
                let bases: Vec<Option<State>> = mesh
                    .r
                    .members()
                    .iter()
                    .map(|m| {
                        let n = &self.nodes[m];
                        (n.epoch == epoch && n.state.next_step == resume).then(|| n.state.clone())
                    })
                    .collect();
                let (dense, pieces) = self.arrivals(q, &bases);
                for (p, v) in pieces {
                    if self.rng.random_bool(0.5) {
                        let v = v.unwrap_or_else(|| self.garbage());
                        let n = self.nodes.get_mut(&id).unwrap();
                        if n.state.piece(p).is_none() {
                            n.state.set(p, v);
                        }
                    }
                }
                if let Some(d) = dense
                    && self.rng.random_bool(0.5)
                {
                    self.nodes.get_mut(&id).unwrap().state.dense = d;
                }
            }
            // A step in flight, if there is one left to train (a worker that trained the last
            // step trains no more: it reports that it finished).
            Status::Training
                if self.nodes[&id].state.next_step < self.cfg.total_steps
                    && self.rng.random_bool(0.3) =>
            {
                self.train_one(id, epoch, false)
            }
            _ => {}
        }
        self.idle(id, IdleReason::Failed(why.into()));
    }

    fn healthy_nodes(&self) -> usize {
        self.nodes
            .values()
            .filter(|n| n.alive && !n.worker_frozen && !n.agent_frozen)
            .count()
    }

    fn trace_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "    config ({}): {} experts x {} layers, {} slots/node, {} initial nodes ({} per \
             host), {} steps, checkpoint every {}, rebalance every {}, sharded {} ({} copies), \
             {:?}, {:?}, faults until {} ms",
            self.mode.name(),
            self.cfg.model.experts,
            self.cfg.model.layers,
            self.cfg.slots_per_node,
            self.cfg.initial_nodes,
            self.gpus,
            self.cfg.total_steps,
            self.cfg.checkpoint_every_steps,
            self.cfg.rebalance_every_steps,
            self.cfg.sharded_experts,
            self.cfg.shard_copies,
            self.cfg.replica_migration,
            matches!(
                self.cfg.relayout,
                lazarus_planner::job::relayout::Relayout::Laer(_)
            )
            .then_some("laer"),
            self.faults_until_ms
        );
        for (t, item) in &self.trace {
            let line = match item {
                TraceItem::In(ev) => format!("-> {}", brief_event(ev)),
                TraceItem::Out(Action::Reconfigure(r)) => format!(
                    "<- Reconfigure epoch {} {:?} v{} members {:?} {:?} resume {} ({} transfers, \
                     shards {:?}, {} shard transfers)",
                    r.epoch,
                    r.kind,
                    r.plan.version,
                    r.members(),
                    r.source,
                    r.resume_step,
                    r.transfers.len(),
                    r.shard_holders,
                    r.shard_transfers.len()
                ),
                TraceItem::Out(Action::SwitchLayout(sw)) => format!(
                    "<- SwitchLayout epoch {} v{} from step {} ({} transfers)",
                    sw.epoch,
                    sw.plan.version,
                    sw.from_step,
                    sw.transfers.len()
                ),
                TraceItem::Out(a) => format!("<- {a:?}"),
                TraceItem::Note(n) => format!("** {n}"),
            };
            let _ = writeln!(s, "    {t:>6} ms {line}");
        }
        s
    }
}

fn event_node(ev: &Event) -> Option<NodeId> {
    match ev {
        Event::Joined { node, .. }
        | Event::Ready { node }
        | Event::Heartbeat { node }
        | Event::WorkerAlive { node }
        | Event::Lost { node, .. }
        | Event::Stepped { node, .. }
        | Event::Idle { node, .. }
        | Event::Migrated { node, .. }
        | Event::CheckpointWritten { node, .. }
        | Event::Reattached { node, .. }
        | Event::Done { node, .. } => Some(*node),
        _ => None,
    }
}

fn brief_event(ev: &Event) -> String {
    match ev {
        Event::Stepped {
            node,
            epoch,
            step,
            report,
        } => format!(
            "Stepped {{ node: {node}, epoch: {epoch}, step: {step}, layout v{}{} }}",
            report.layout_version,
            if report.nonfinite { ", non-finite" } else { "" }
        ),
        ev => format!("{ev:?}"),
    }
}

/// A node's state at `resume`: as it is, rolled back one step, or `None`.
fn resolve(n: &SimNode, resume: u64) -> Option<State> {
    if n.state.next_step == resume {
        Some(n.state.clone())
    } else {
        n.prev
            .as_ref()
            .filter(|p| p.next_step == resume && n.state.next_step == resume + 1)
            .cloned()
    }
}

fn first_uncovered(covered: &[Vec<bool>]) -> Option<(usize, usize)> {
    covered
        .iter()
        .enumerate()
        .find_map(|(l, es)| es.iter().position(|c| !c).map(|e| (l, e)))
}
