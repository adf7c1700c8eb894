//! The simulated cluster of the swarm test: nodes (an agent that heartbeats, a worker that
//! answers the machine's actions), a network that delays, reorders and duplicates what the
//! nodes report, a checkpoint store, a seeded fault schedule, and the checks made after every
//! event the machine handles.
//!
//! Simulated state: every piece of training state (the dense state, each expert replica) is a
//! hash chain of the steps trained on it, so the correct value at each step is known
//! (`Canon`): a restore or a peer transfer reproduces it, a process's own initialisation, a
//! replica that was never sent or a state at another step does not. Checking every member
//! against the canonical chain at every counted step catches a member training on the wrong
//! state even when it is the only holder.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::fmt::Write as _;

use lazarus_planner::ModelSpec;
use lazarus_planner::job::{
    Action, Event, IdleReason, JobConfig, JobMachine, NodeId, Phase, ReconfigKind, Reconfiguration,
    StateChecksums, StateSource, StepRecord, StepReport,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const TICK_MS: u64 = 100;
const HEARTBEAT_MS: u64 = 200;
/// Once faults stop (and, where the seed heals, lost nodes were replaced) the job must have
/// finished or be waiting for nodes within this much simulated time: a generous multiple of
/// the longest job (90 steps of 40 ms, a few reconfigurations, the timeouts).
const SETTLE_MS: u64 = 40_000;
const TRACE_LEN: usize = 80;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One step of training applied to a state value.
fn train(v: u64, step: u64) -> u64 {
    splitmix64(v ^ splitmix64(step))
}

/// The correct value of every piece of state after each number of completed steps.
struct Canon {
    /// `dense[s]`: after `s` completed steps.
    dense: Vec<u64>,
    /// `experts[l][e][s]`.
    experts: Vec<Vec<Vec<u64>>>,
}

impl Canon {
    fn new(layers: usize, experts: usize, steps: u64) -> Self {
        let chain = |seed: u64| {
            let mut c = vec![splitmix64(seed)];
            for s in 0..steps {
                c.push(train(c[s as usize], s));
            }
            c
        };
        Self {
            dense: chain(0xDE45E),
            experts: (0..layers)
                .map(|l| {
                    (0..experts)
                        .map(|e| chain(((l as u64) << 32) | e as u64))
                        .collect()
                })
                .collect(),
        }
    }
}

/// What a worker holds: dense state, replicas `[layer] → (expert, value)`, next step to train.
#[derive(Debug, Clone, Default)]
struct State {
    dense: u64,
    held: Vec<Vec<(u32, u64)>>,
    next_step: u64,
}

impl State {
    fn trained(&self) -> Self {
        let s = self.next_step;
        Self {
            dense: train(self.dense, s),
            held: self
                .held
                .iter()
                .map(|l| l.iter().map(|&(e, v)| (e, train(v, s))).collect())
                .collect(),
            next_step: s + 1,
        }
    }
    fn value(&self, layer: usize, expert: u32) -> Option<u64> {
        self.held
            .get(layer)?
            .iter()
            .find(|(e, _)| *e == expert)
            .map(|(_, v)| *v)
    }
    fn holdings(&self) -> Vec<Vec<u32>> {
        self.held
            .iter()
            .map(|l| l.iter().map(|(e, _)| *e).collect())
            .collect()
    }
}

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
    /// The agent stopped heartbeating (its worker may still answer).
    agent_frozen: bool,
    status: Status,
    /// Epoch of the last reconfiguration it took part in.
    epoch: u64,
    state: State,
    /// The state before the last step trained: a member one step ahead rolls back to it.
    prev: Option<State>,
    pause: bool,
    /// Commands to a node travel one connection: in order.
    cmd_free_ms: u64,
    /// Reports from a node travel one connection too.
    report_free_ms: u64,
    last_idle: Option<Event>,
}

/// The collective of one epoch's members.
struct Mesh {
    r: Reconfiguration,
    /// `rows[rank][layer]`: what the plan puts on each member.
    rows: Vec<Vec<Vec<u32>>>,
    arrived: BTreeSet<NodeId>,
    broken: bool,
}

#[derive(Debug, Clone, Copy)]
enum Cmd {
    Start,
    Pause,
    Abort(u64),
    Reconfigure(u64),
    Stop,
}

enum Item {
    ToMachine(Event),
    Cmd(NodeId, Cmd),
    Beat(NodeId),
    Tick,
    WorkerReady(NodeId),
    MigrateDone(u64),
    MeshStep(u64),
    PeerFail(u64),
    Kill(NodeId),
    Fault,
    Heal,
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
}

/// States of the members that trained one step of one epoch.
struct Trained {
    /// Every member of the mesh trained it together (not a partial step before a failure).
    full: bool,
    states: Vec<(NodeId, State)>,
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
    pub ended_waiting: u64,
    pub in_place: u64,
    pub restores: u64,
    pub joins: u64,
    pub rebalances: u64,
    pub waited_for_nodes: u64,
    pub fenced_stuck: u64,
    pub fenced_silent: u64,
    pub kills: u64,
    pub rolled_back: u64,
    pub steps: u64,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.finished_ok += o.finished_ok;
        self.finished_no_checkpoint += o.finished_no_checkpoint;
        self.final_checkpoint_failed += o.final_checkpoint_failed;
        self.ended_waiting += o.ended_waiting;
        self.in_place += o.in_place;
        self.restores += o.restores;
        self.joins += o.joins;
        self.rebalances += o.rebalances;
        self.waited_for_nodes += o.waited_for_nodes;
        self.fenced_stuck += o.fenced_stuck;
        self.fenced_silent += o.fenced_silent;
        self.kills += o.kills;
        self.rolled_back += o.rolled_back;
        self.steps += o.steps;
    }
}

#[derive(Debug)]
pub struct Failure {
    pub at_ms: u64,
    pub why: String,
    pub trace: String,
}

pub fn run_seed(seed: u64) -> Result<Stats, Failure> {
    let mut sim = Sim::new(seed);
    sim.run();
    match sim.fail.take() {
        None => Ok(sim.stats),
        Some(why) => Err(Failure {
            at_ms: sim.now_ms,
            why,
            trace: sim.trace_text(),
        }),
    }
}

struct Sim {
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
    mesh: Option<Mesh>,
    step_ms: u64,
    ckpt_parts: BTreeMap<(u64, u64), Vec<State>>,
    committed: BTreeMap<u64, Ckpt>,
    commit_fail_p: f64,
    trained: BTreeMap<(u64, u64), Trained>,
    faults_until_ms: u64,
    kill_in_reconfig: u32,
    // What the checks remember.
    last_epoch: u64,
    last_version: u64,
    record_epoch: u64,
    /// The next step the machine may count.
    counted_next: u64,
    /// The machine's members before the event it handles now.
    members_before: Vec<NodeId>,
    finished: Option<Result<(), String>>,
    no_checkpoint_said: bool,
    trace: VecDeque<(u64, TraceItem)>,
    stats: Stats,
    fail: Option<String>,
}

impl Sim {
    fn new(seed: u64) -> Self {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let experts = [4, 6, 8][rng.random_range(0..3)];
        let layers = rng.random_range(1..=2);
        let slots: usize = rng.random_range(2..=4);
        let model = ModelSpec {
            experts,
            layers,
            f: 2,
        };
        let mut cfg = JobConfig::new(model, slots, rng.random_range(30..=90));
        // Enough nodes for f replicas of every expert, sometimes one more.
        cfg.initial_nodes = (experts * 2).div_ceil(slots).max(2) + rng.random_range(0..=1);
        cfg.heartbeat_timeout_ms = 1_000;
        cfg.member_timeout_ms = 2_500;
        cfg.scale_out_wait_ms = [0, 200, 800][rng.random_range(0..3)];
        cfg.rebalance_every_steps = [0, 12, 25][rng.random_range(0..3)];
        cfg.checkpoint_every_steps = [5, 10, 15][rng.random_range(0..3)];
        cfg.bytes_per_expert = 1 << 20;
        let m = JobMachine::new(cfg.clone()).expect("a valid config");
        let faults_until_ms = rng.random_range(1_500..12_000);
        let commit_fail_p = [0.0, 0.1, 0.3][rng.random_range(0..3)];
        let step_ms = rng.random_range(10..=40);
        let canon = Canon::new(layers, experts, cfg.total_steps);
        let mut sim = Self {
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
            mesh: None,
            step_ms,
            ckpt_parts: BTreeMap::new(),
            committed: BTreeMap::new(),
            commit_fail_p,
            trained: BTreeMap::new(),
            faults_until_ms,
            kill_in_reconfig: 0,
            last_epoch: 0,
            last_version: 0,
            record_epoch: 0,
            counted_next: 0,
            members_before: Vec::new(),
            finished: None,
            no_checkpoint_said: false,
            trace: VecDeque::new(),
            stats: Stats::default(),
            fail: None,
        };
        for _ in 0..sim.cfg.initial_nodes {
            sim.join(None);
        }
        let faults = sim.rng.random_range(0..=10);
        for _ in 0..faults {
            let at = sim.rng.random_range(300..faults_until_ms);
            sim.at(at, Item::Fault);
        }
        sim.at(faults_until_ms, Item::Heal);
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
        let d = self.net_ms();
        let mut at = self.now_ms + d;
        if let Some(n) = event_node(&ev).and_then(|id| self.nodes.get_mut(&id)) {
            at = at.max(n.report_free_ms);
            n.report_free_ms = at;
        }
        if self.rng.random_bool(0.05) {
            let d2 = self.net_ms();
            self.at(at + d2, Item::ToMachine(ev.clone()));
        }
        self.at(at, Item::ToMachine(ev));
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
        let Some(n) = self.nodes.get_mut(&node) else {
            return;
        };
        let at = (self.now_ms + d).max(n.cmd_free_ms);
        n.cmd_free_ms = at;
        self.at(at, Item::Cmd(node, c));
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
            Item::ToMachine(ev) => self.deliver(ev),
            Item::Tick => {
                self.deliver(Event::Tick);
                self.at(self.now_ms + TICK_MS, Item::Tick);
            }
            Item::Beat(id) => {
                let n = &self.nodes[&id];
                if n.alive {
                    if !n.agent_frozen {
                        self.send(Event::Heartbeat { node: id });
                    }
                    self.at(self.now_ms + HEARTBEAT_MS, Item::Beat(id));
                }
            }
            Item::Cmd(id, c) => self.command(id, c),
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
        }
    }

    // ---------------------------------------------------------------- the machine's side

    fn deliver(&mut self, ev: Event) {
        if !matches!(ev, Event::Heartbeat { .. } | Event::Tick) {
            self.push_trace(TraceItem::In(ev.clone()));
        }
        let mut out = Vec::new();
        self.members_before.clear();
        self.members_before.extend_from_slice(self.m.members());
        self.m.handle(self.now_ms, ev, &mut out);
        if let Err(e) = self.m.check_invariants() {
            return self.fail(format!("check_invariants: {e}"));
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
    }

    fn perform(&mut self, a: Action) {
        match a {
            Action::StartWorker { node } => self.cmd(node, Cmd::Start),
            Action::Pause { node } => self.cmd(node, Cmd::Pause),
            Action::Abort { node, epoch } => self.cmd(node, Cmd::Abort(epoch)),
            Action::Stop { node } => self.cmd(node, Cmd::Stop),
            Action::Reconfigure(r) => self.reconfigure(*r),
            // Only a restarted driver re-sends (the swarm's driver never restarts).
            Action::Resend { node, epoch } => {
                self.fail(format!("unexpected resend of epoch {epoch} to node {node}"))
            }
            // Only sharded experts with LAER re-layout switch layouts (the swarm replicates).
            Action::SwitchLayout(sw) => self.fail(format!(
                "unexpected layout switch to plan v{}",
                sw.plan.version
            )),
            Action::CommitCheckpoint { step, .. } => self.commit(step),
            Action::FindCheckpoint => match self.committed.keys().next_back() {
                Some(&step) => self.send(Event::CheckpointFound { step }),
                None => {
                    self.no_checkpoint_said = true;
                    self.send(Event::CheckpointMissing {
                        error: "no committed checkpoint".into(),
                    })
                }
            },
            Action::Fence { node, reason } => {
                if reason.contains("heartbeat") {
                    self.stats.fenced_silent += 1;
                } else {
                    self.stats.fenced_stuck += 1;
                }
                self.kill(node, false);
            }
            Action::WaitForNodes { .. } => self.stats.waited_for_nodes += 1,
            Action::Record(r) => self.check_record(&r),
            Action::Reconfigured(_) | Action::Log(_) => {}
            Action::Finished(res) => {
                match &res {
                    Ok(()) if self.counted_next != self.cfg.total_steps => self.fail(format!(
                        "finished after counting {} of {} steps",
                        self.counted_next, self.cfg.total_steps
                    )),
                    Ok(()) => self.stats.finished_ok += 1,
                    // The only acceptable failure: a restore with no checkpoint committed.
                    Err(e) if self.no_checkpoint_said && e.contains("no checkpoint") => {
                        self.stats.finished_no_checkpoint += 1
                    }
                    // Or the simulated storage failed every try of the last step's checkpoint:
                    // the job must not end well without its final state saved.
                    Err(e)
                        if self.commit_fail_p > 0.0
                            && e.contains("checkpoint of the last step") =>
                    {
                        self.stats.final_checkpoint_failed += 1
                    }
                    Err(e) => self.fail(format!("the job failed: {e}")),
                }
                self.finished = Some(res);
            }
        }
    }

    /// Every expert has a replica on a live member while the members train or take a plan in
    /// (a lost expert must have sent the machine to Quiescing/Restoring/WaitingForNodes).
    fn check_coverage(&mut self) {
        if !matches!(self.m.phase(), Phase::Training | Phase::Reconfiguring) {
            return;
        }
        let Some(plan) = self.m.plan() else {
            return self.fail(format!("{:?} without a plan", self.m.phase()));
        };
        let members = self.m.members();
        let mut covered = vec![vec![false; self.cfg.model.experts]; self.cfg.model.layers];
        for p in plan.physical_nodes() {
            if members.contains(&p.id) {
                for (l, es) in p.holdings.iter().enumerate() {
                    for &e in es {
                        covered[l][e as usize] = true;
                    }
                }
            }
        }
        if let Some((l, e)) = first_uncovered(&covered) {
            self.fail(format!(
                "phase {:?}: expert {e} of layer {l} has no replica on a live member",
                self.m.phase()
            ));
        }
    }

    fn check_record(&mut self, r: &StepRecord) {
        if r.epoch != self.record_epoch {
            return self.fail(format!(
                "step {} counted in epoch {} but the plan in force is epoch {}",
                r.step, r.epoch, self.record_epoch
            ));
        }
        if r.step != self.counted_next {
            return self.fail(format!(
                "step {} counted, expected step {} (a step counted twice or skipped)",
                r.step, self.counted_next
            ));
        }
        if r.step >= self.cfg.total_steps {
            return self.fail(format!("step {} counted past the end", r.step));
        }
        self.counted_next += 1;
        self.stats.steps += 1;
        let Some(t) = self.trained.get(&(r.epoch, r.step)) else {
            return self.fail(format!("step {} counted but no member trained it", r.step));
        };
        let mut problems = Vec::new();
        // Members only leave within an epoch until a new plan replaces them (in the same
        // batch of actions, after this record): every member at counting time was a member
        // before the event, and each of them must have trained the step.
        let trainers = t
            .states
            .iter()
            .filter(|(id, _)| self.members_before.contains(id))
            .count();
        if trainers < r.members {
            problems.push(format!(
                "{} members counted it but only {trainers} of {:?} trained it",
                r.members, self.members_before
            ));
        }
        let s = r.step as usize + 1;
        let mut covered = vec![vec![false; self.cfg.model.experts]; self.cfg.model.layers];
        for (id, st) in &t.states {
            if st.dense != self.canon.dense[s] {
                problems.push(format!("node {id} trained on a wrong dense state"));
            }
            for (l, es) in st.held.iter().enumerate() {
                for &(e, v) in es {
                    covered[l][e as usize] = true;
                    if v != self.canon.experts[l][e as usize][s] {
                        problems.push(format!(
                            "node {id}'s replica of expert {e} of layer {l} is wrong"
                        ));
                    }
                }
            }
        }
        if t.full
            && let Some((l, e)) = first_uncovered(&covered)
        {
            problems.push(format!("expert {e} of layer {l} had no replica"));
        }
        if !problems.is_empty() {
            problems.dedup();
            self.fail(format!(
                "counted step {} of epoch {}: {}",
                r.step,
                r.epoch,
                problems.join("; ")
            ));
        }
    }

    /// Checks a new plan against what the nodes really hold, then sends it.
    fn reconfigure(&mut self, r: Reconfiguration) {
        if r.epoch <= self.last_epoch || r.plan.version <= self.last_version {
            return self.fail(format!(
                "epoch {} / plan v{} after epoch {} / plan v{}",
                r.epoch, r.plan.version, self.last_epoch, self.last_version
            ));
        }
        self.last_epoch = r.epoch;
        self.last_version = r.plan.version;
        match r.kind {
            ReconfigKind::InPlace => self.stats.in_place += 1,
            ReconfigKind::Restore => self.stats.restores += 1,
            ReconfigKind::Join => self.stats.joins += 1,
            ReconfigKind::Rebalance => self.stats.rebalances += 1,
            ReconfigKind::Start => {}
        }
        let rows = r.plan.plan_node_contents();
        match &r.source {
            StateSource::Fresh if r.resume_step != 0 => {
                return self.fail(format!("a fresh start resumes at {}", r.resume_step));
            }
            StateSource::Fresh => {}
            StateSource::Checkpoint { step } => {
                let newest = self.committed.keys().next_back().copied();
                if r.resume_step != *step
                    || !self.committed.contains_key(step)
                    || newest.is_none_or(|n| *step > n)
                {
                    return self.fail(format!(
                        "restore of step {step} resuming at {}: newest committed {newest:?}",
                        r.resume_step
                    ));
                }
            }
            StateSource::Peers {
                dense_from,
                dense_to,
            } => {
                if r.resume_step != self.counted_next {
                    return self.fail(format!(
                        "in-place replan resumes at step {} but steps up to {} were counted",
                        r.resume_step, self.counted_next
                    ));
                }
                if let Some(p) = self.peers_plan_problem(&r, &rows, *dense_from, dense_to) {
                    return self.fail(format!("epoch {}: {p}", r.epoch));
                }
            }
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
        self.mesh = Some(Mesh {
            r,
            rows,
            arrived: BTreeSet::new(),
            broken: false,
        });
        for m in members {
            self.cmd(m, Cmd::Reconfigure(epoch));
        }
    }

    /// An in-place plan may only keep and send replicas and a dense state that exist at the
    /// resume step (a member not in `dense_to` must hold the job's dense state).
    fn peers_plan_problem(
        &self,
        r: &Reconfiguration,
        rows: &[Vec<Vec<u32>>],
        dense_from: usize,
        dense_to: &[usize],
    ) -> Option<String> {
        let resume = r.resume_step;
        let good_dense = self.canon.dense[resume as usize];
        let states: Vec<Option<State>> = r
            .members()
            .iter()
            .map(|m| {
                let n = &self.nodes[m];
                // A node that is already dead is the machine's to learn about, not a bad plan.
                n.alive.then(|| resolve(n, resume).unwrap_or_default())
            })
            .collect();
        for (q, st) in states.iter().enumerate() {
            let Some(st) = st else { continue };
            let id = r.members()[q];
            let wants_dense = dense_to.contains(&q);
            if (!wants_dense || q == dense_from) && st.dense != good_dense {
                return Some(format!(
                    "rank {q} (node {id}) is not sent the dense state but does not hold it \
                     at step {resume}"
                ));
            }
            for (l, es) in rows[q].iter().enumerate() {
                for &e in es {
                    let src = r
                        .transfers
                        .iter()
                        .find(|t| t.dst_rank == q && t.layer == l && t.expert == e as usize)
                        .map_or(q, |t| t.src_rank);
                    let Some(src_state) = &states[src] else {
                        continue;
                    };
                    if src_state.value(l, e)
                        != Some(self.canon.experts[l][e as usize][resume as usize])
                    {
                        return Some(format!(
                            "rank {q} (node {id}) gets expert {e} of layer {l} from rank {src}, \
                             which does not hold it at step {resume}"
                        ));
                    }
                }
            }
        }
        None
    }

    fn commit(&mut self, step: u64) {
        let Some(parts) = self.ckpt_parts.remove(&(self.m.epoch(), step)) else {
            return self.fail(format!(
                "commit of the checkpoint of step {step} whose parts nobody wrote"
            ));
        };
        if self.rng.random_bool(self.commit_fail_p) {
            return self.send(Event::CheckpointFailed {
                step,
                error: "simulated storage error".into(),
            });
        }
        // Parts that disagree make a corrupt checkpoint: a restore of it is caught later.
        let mut dense = parts[0].dense;
        let mut experts = BTreeMap::new();
        for p in &parts {
            if p.dense != dense {
                dense = splitmix64(dense ^ p.dense);
            }
            for (l, es) in p.held.iter().enumerate() {
                for &(e, v) in es {
                    let c = experts.entry((l, e)).or_insert(v);
                    if *c != v {
                        *c = splitmix64(*c ^ v);
                    }
                }
            }
        }
        self.committed.insert(step, Ckpt { dense, experts });
        self.send(Event::CheckpointCommitted { step });
    }

    // ---------------------------------------------------------------- the nodes' side

    fn detect_ms(&mut self) -> u64 {
        self.rng.random_range(20..300)
    }

    fn join(&mut self, name: Option<String>) {
        let id = self.next_id;
        self.next_id += 1;
        let name = name.unwrap_or_else(|| format!("n{id}"));
        self.nodes.insert(
            id,
            SimNode {
                alive: true,
                worker_frozen: false,
                agent_frozen: false,
                status: Status::Starting,
                epoch: 0,
                state: State::default(),
                prev: None,
                pause: false,
                cmd_free_ms: 0,
                report_free_ms: 0,
                last_idle: None,
            },
        );
        self.names.insert(id, name.clone());
        self.send(Event::Joined {
            node: id,
            name,
            host: None,
        });
        self.at(self.now_ms + HEARTBEAT_MS, Item::Beat(id));
    }

    fn kill(&mut self, id: NodeId, say_lost: bool) {
        let n = self.nodes.get_mut(&id).unwrap();
        if !n.alive {
            return;
        }
        n.alive = false;
        self.stats.kills += 1;
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
        let n = self.nodes.get_mut(&id).unwrap();
        n.status = Status::Idle;
        n.pause = false;
        let ev = Event::Idle {
            node: id,
            epoch: n.epoch,
            why,
            step: n.state.next_step,
            held: n.state.holdings().into(),
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
            Cmd::Stop => {
                let n = self.nodes.get_mut(&id).unwrap();
                let checksums = if n.status == Status::Starting {
                    StateChecksums::default()
                } else {
                    StateChecksums {
                        dense: n.state.dense,
                        replicas: n
                            .state
                            .held
                            .iter()
                            .enumerate()
                            .flat_map(|(l, es)| es.iter().map(move |&(e, v)| (l as u32, e, v)))
                            .collect(),
                        shards: Vec::new(),
                    }
                };
                n.status = Status::Stopped;
                self.send(Event::Done {
                    node: id,
                    checksums,
                });
            }
        }
    }

    fn reconfigure_arrived(&mut self, id: NodeId, epoch: u64) {
        let Some(mesh) = &self.mesh else { return };
        if mesh.r.epoch != epoch {
            return;
        }
        let (peers, resume, broken) = (
            matches!(mesh.r.source, StateSource::Peers { .. }),
            mesh.r.resume_step,
            mesh.broken,
        );
        let n = self.nodes.get_mut(&id).unwrap();
        if !matches!(n.status, Status::Idle) {
            let why = format!(
                "node {id} got the plan of epoch {epoch} while {:?} in epoch {}",
                n.status, n.epoch
            );
            return self.fail(why);
        }
        n.status = Status::Migrating;
        n.epoch = epoch;
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
                    n.state.dense = splitmix64(n.state.dense ^ 0x57A1E);
                    for l in &mut n.state.held {
                        for (_, v) in l {
                            *v = splitmix64(*v ^ 0x57A1E);
                        }
                    }
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

    fn migrate_done(&mut self, epoch: u64) {
        let Some(members) = self.mesh_ready(epoch, Status::Migrating) else {
            return;
        };
        let mesh = self.mesh.as_ref().unwrap();
        let (source, resume, rows) = (mesh.r.source.clone(), mesh.r.resume_step, mesh.rows.clone());
        let transfers = mesh.r.transfers.clone();
        let bases: Vec<State> = members
            .iter()
            .map(|m| self.nodes[m].state.clone())
            .collect();
        for (q, &id) in members.iter().enumerate() {
            let fill = |l: usize, e: u32, sim: &mut Self| -> u64 {
                let v = match &source {
                    StateSource::Fresh => Some(sim.canon.experts[l][e as usize][0]),
                    StateSource::Checkpoint { step } => sim
                        .committed
                        .get(step)
                        .and_then(|c| c.experts.get(&(l, e)).copied()),
                    StateSource::Peers { .. } => {
                        let src = transfers
                            .iter()
                            .find(|t| t.dst_rank == q && t.layer == l && t.expert == e as usize)
                            .map_or(q, |t| t.src_rank);
                        bases[src].value(l, e)
                    }
                };
                // A slot with nothing to put in it: whatever the process had there.
                v.unwrap_or_else(|| sim.garbage())
            };
            let mut held = Vec::new();
            for (l, es) in rows[q].iter().enumerate() {
                let mut layer = Vec::new();
                for &e in es {
                    layer.push((e, fill(l, e, self)));
                }
                held.push(layer);
            }
            let dense = match &source {
                StateSource::Fresh => self.canon.dense[0],
                StateSource::Checkpoint { step } => match self.committed.get(step) {
                    Some(c) => c.dense,
                    None => self.garbage(),
                },
                StateSource::Peers {
                    dense_from,
                    dense_to,
                } => {
                    if dense_to.contains(&q) {
                        bases[*dense_from].dense
                    } else {
                        bases[q].dense
                    }
                }
            };
            let n = self.nodes.get_mut(&id).unwrap();
            n.state = State {
                dense,
                held,
                next_step: resume,
            };
            n.prev = None;
            n.status = Status::Training;
            let bytes_in = 1 << 20;
            self.send(Event::Migrated {
                node: id,
                epoch,
                bytes_in,
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

    fn report(&mut self) -> StepReport {
        let (layers, experts) = (self.cfg.model.layers, self.cfg.model.experts);
        StepReport {
            loss: self.rng.random_range(1.0..3.0),
            tokens: 64,
            step_ms: self.step_ms as f64,
            routing: (0..layers)
                .map(|_| (0..experts).map(|_| self.rng.random_range(0..50)).collect())
                .collect(),
            nonfinite: false,
            ..StepReport::default()
        }
    }

    /// One member trains its next step (alone: a step in flight when a peer failed, or as
    /// part of the whole mesh).
    fn train_one(&mut self, id: NodeId, epoch: u64, full: bool) {
        let n = self.nodes.get_mut(&id).unwrap();
        let step = n.state.next_step;
        let next = n.state.trained();
        n.prev = Some(std::mem::replace(&mut n.state, next.clone()));
        let t = self.trained.entry((epoch, step)).or_insert(Trained {
            full,
            states: Vec::new(),
        });
        t.states.push((id, next));
        let report = self.report();
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
        let d = self.step_ms + self.rng.random_range(0..5);
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
                let mut arrived: Vec<(usize, u32, Option<u64>)> = Vec::new();
                let mut dense = None;
                match &mesh.r.source {
                    StateSource::Peers {
                        dense_from,
                        dense_to,
                    } => {
                        for t in mesh.r.transfers.iter().filter(|t| t.dst_rank == q) {
                            // Only a source that took the plan in (and rolled back to the
                            // resume step) sends anything.
                            let src = &self.nodes[&mesh.r.members()[t.src_rank]];
                            if src.epoch == epoch && src.state.next_step == resume {
                                let v = src.state.value(t.layer, t.expert as u32);
                                arrived.push((t.layer, t.expert as u32, v));
                            }
                        }
                        let src = &self.nodes[&mesh.r.members()[*dense_from]];
                        if dense_to.contains(&q) && src.epoch == epoch {
                            dense = Some(src.state.dense);
                        }
                    }
                    StateSource::Fresh => {
                        for (l, es) in mesh.rows[q].iter().enumerate() {
                            for &e in es {
                                arrived.push((l, e, Some(self.canon.experts[l][e as usize][0])));
                            }
                        }
                        dense = Some(self.canon.dense[0]);
                    }
                    StateSource::Checkpoint { step } => {
                        let c = self.committed.get(step);
                        for (l, es) in mesh.rows[q].iter().enumerate() {
                            for &e in es {
                                arrived.push((
                                    l,
                                    e,
                                    c.and_then(|c| c.experts.get(&(l, e)).copied()),
                                ));
                            }
                        }
                        dense = c.map(|c| c.dense);
                    }
                }
                for (l, e, v) in arrived {
                    if self.rng.random_bool(0.5) {
                        let v = v.unwrap_or_else(|| self.garbage());
                        let n = self.nodes.get_mut(&id).unwrap();
                        if n.state.value(l, e).is_none() {
                            n.state.held[l].push((e, v));
                        }
                    }
                }
                if let Some(d) = dense
                    && self.rng.random_bool(0.5)
                {
                    self.nodes.get_mut(&id).unwrap().state.dense = d;
                }
            }
            Status::Training if self.rng.random_bool(0.3) => self.train_one(id, epoch, false),
            _ => {}
        }
        self.idle(id, IdleReason::Failed(why.into()));
    }

    // ---------------------------------------------------------------- faults

    fn pick_alive(&mut self) -> Option<NodeId> {
        let alive: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.alive)
            .map(|(&id, _)| id)
            .collect();
        (!alive.is_empty()).then(|| alive[self.rng.random_range(0..alive.len())])
    }

    fn fault(&mut self) {
        let kind = self.rng.random_range(0..100);
        match kind {
            0..30 => {
                if let Some(id) = self.pick_alive() {
                    self.note(format!("fault: kill node {id}"));
                    self.deliver(Event::FaultInjected);
                    self.kill(id, true);
                }
            }
            30..40 => {
                let k = self.rng.random_range(2..=3);
                for _ in 0..k {
                    if let Some(id) = self.pick_alive() {
                        self.note(format!("fault: kill node {id} (simultaneous)"));
                        self.kill(id, true);
                    }
                }
            }
            40..50 => {
                self.note("fault: kill a member during the next reconfiguration".into());
                self.kill_in_reconfig += 1;
            }
            50..68 => {
                self.note("fault: a new node joins".into());
                self.join(None);
            }
            68..80 => {
                // A dead node comes back under a new id and its old name.
                let dead: Vec<NodeId> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| !n.alive)
                    .map(|(&id, _)| id)
                    .collect();
                let name = (!dead.is_empty())
                    .then(|| self.names[&dead[self.rng.random_range(0..dead.len())]].clone());
                self.note(format!("fault: node {name:?} rejoins"));
                self.join(name);
            }
            80..90 => {
                if let Some(id) = self.pick_alive() {
                    self.note(format!("fault: worker of node {id} freezes"));
                    self.nodes.get_mut(&id).unwrap().worker_frozen = true;
                }
            }
            _ => {
                if let Some(id) = self.pick_alive() {
                    self.note(format!("fault: agent of node {id} freezes"));
                    self.nodes.get_mut(&id).unwrap().agent_frozen = true;
                }
            }
        }
    }

    /// Faults stop; most seeds replace the lost nodes (the job must then finish), the others
    /// may be left with too few (the job must then wait for nodes).
    fn heal(&mut self) {
        self.commit_fail_p = 0.0;
        self.kill_in_reconfig = 0;
        if !self.rng.random_bool(0.75) {
            self.note("faults stop; no healing".into());
            return;
        }
        let healthy = self.healthy_nodes();
        self.note(format!("faults stop; healing from {healthy} healthy nodes"));
        for _ in healthy..self.cfg.initial_nodes {
            self.join(None);
        }
    }

    fn healthy_nodes(&self) -> usize {
        self.nodes
            .values()
            .filter(|n| n.alive && !n.worker_frozen && !n.agent_frozen)
            .count()
    }

    /// Liveness: the job finished, or it waits for nodes because there are too few.
    fn check_end(&mut self) {
        if self.finished.is_some() {
            return;
        }
        let healthy = self.healthy_nodes();
        let too_few = healthy * self.cfg.slots_per_node < self.cfg.model.experts;
        match self.m.phase() {
            Phase::WaitingForNodes if too_few => self.stats.ended_waiting += 1,
            Phase::Gathering if healthy < self.cfg.initial_nodes => self.stats.ended_waiting += 1,
            phase => self.fail(format!(
                "stalled: {phase:?} {} ms after faults stopped, {} of {} steps counted, \
                 {healthy} healthy nodes, members {:?}",
                SETTLE_MS,
                self.counted_next,
                self.cfg.total_steps,
                self.m.members()
            )),
        }
    }

    fn trace_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "    config: {} experts x {} layers, {} slots/node, {} initial nodes, {} steps, \
             checkpoint every {}, rebalance every {}, faults until {} ms",
            self.cfg.model.experts,
            self.cfg.model.layers,
            self.cfg.slots_per_node,
            self.cfg.initial_nodes,
            self.cfg.total_steps,
            self.cfg.checkpoint_every_steps,
            self.cfg.rebalance_every_steps,
            self.faults_until_ms
        );
        for (t, item) in &self.trace {
            let line = match item {
                TraceItem::In(ev) => format!("-> {}", brief_event(ev)),
                TraceItem::Out(Action::Reconfigure(r)) => format!(
                    "<- Reconfigure epoch {} {:?} v{} members {:?} {:?} resume {} ({} transfers)",
                    r.epoch,
                    r.kind,
                    r.plan.version,
                    r.members(),
                    r.source,
                    r.resume_step,
                    r.transfers.len()
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
        | Event::Lost { node, .. }
        | Event::Stepped { node, .. }
        | Event::Idle { node, .. }
        | Event::Migrated { node, .. }
        | Event::CheckpointWritten { node, .. }
        | Event::Done { node, .. } => Some(*node),
        _ => None,
    }
}

fn brief_event(ev: &Event) -> String {
    match ev {
        Event::Stepped {
            node, epoch, step, ..
        } => format!("Stepped {{ node: {node}, epoch: {epoch}, step: {step} }}"),
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
