//! The discrete-event engine: one single-threaded queue ordered by `(time_ns, seq)`.
//!
//! Training is simulated in *segments*: between two interesting step boundaries (checkpoint,
//! rebalance, load change, a pending scale-out) the step time is constant, so one event covers
//! the whole segment. A failure in the middle credits the whole steps completed before it and
//! discards the in-flight step (paper §1.3: the failed step does not update the model).
//!
//! Semantics (documented decisions):
//! * nodes present at the trace's time 0 are ready at once; later additions boot for
//!   `node_boot_s` (Bamboo's 45 s) before they can be used;
//! * at equal times, trace events keep the trace's order (adds before removes);
//! * a removed node in use stops the job at once; the failure is *detected* after the
//!   hardware's detection timeout, during which more nodes may die (one detection covers them);
//!   that wait is charged to the recovery that follows (reconfigure or restart);
//! * scale-out is lazy: `scale_out_wait_s` after a node becomes ready the system is asked
//!   whether it wants more nodes, and if so it scales at the next step boundary (§1.4);
//! * `lazarus`, `laer` and `lazarus-fsep` are not asked: the job state machine ([`Driver`],
//!   with sharded experts for the last two) is told what happens (node
//!   ready or gone, failure detected, steps done, checkpoint saved, time) and the engine
//!   performs what it decides (start, in-place reconfiguration, restore, wait, a pause at the
//!   next step boundary), with the same modelled durations; the machine keeps its own
//!   rebalance cadence (segments end at its next decision step) and lazy scale-out wait;
//! * checkpoints are synchronous pauses; a failure during one loses it;
//! * the run stops at `end_ms` (default: the trace's last event, which is still processed;
//!   the Oobleck artifact stops just before it, so it counts one preemption fewer on P3), or
//!   once `end_after_steps` steps are counted;
//! * step events (`lzsim predict`'s replay of an `lzrun` fault schedule) fire at the step
//!   boundary after their step completed for the first time: additions before what starts
//!   there, removals after (they interrupt it); while the machine waits for nodes, the next
//!   pending additions fire at once ([`super::StepEvent`]).

use super::systems::lazarus::{Driver, Order};
use super::systems::{Ctx, Decision, Layout, Migration, NodeId, Replicas, System, SystemKind};
use super::{
    EventRecord, ReplayConfig, ReplayError, RunResult, Sample, StepCache, Summary, TimeBreakdown,
};
use crate::cost;
use crate::workload::Workload;
use lazarus_planner::job::ReconfigKind;
use lazarus_traces::{NodeOp, Trace};
use serde_json::json;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::hash::{Hash, Hasher};
use std::rc::Rc;

const NS_PER_S: f64 = 1e9;
const NS_PER_MS: u64 = 1_000_000;

/// Most events one run may handle (samples aside). Training is simulated in segments between
/// checkpoints, rebalances and load changes, so a simulated year of the default scenario is
/// about a million events per system (minutes); a run that needs more has steps, or a
/// cadence, so short that it would go on for hours or years: it stops with
/// [`ReplayError::TooManyEvents`] instead.
pub const MAX_EVENTS: u64 = 2_000_000;

/// A fast 64-bit hasher for the layout fingerprint (millions of replica pairs at 16K GPUs,
/// where SipHash took about 9 % of a replay): a multiply-rotate mix per word, seeded with a
/// fixed constant, so fingerprints are the same in every run.
struct FastHasher(u64);

impl Default for FastHasher {
    fn default() -> Self {
        Self(0x243f_6a88_85a3_08d3)
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &b in chunks.remainder() {
            self.write_u64(u64::from(b) | 0x100);
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Fingerprint of a layout's replicas: one word per `(rank, count)` pair (or per run and
/// `(run, gpu, count)` item) where the derived `Hash` wrote two or three (each a dependent
/// multiply), layers hashed in parallel and combined in layer order, so the value does not
/// depend on the thread count. Row and layer lengths are hashed too, so entries cannot shift
/// between rows unnoticed. The two forms hash apart: the same table in both is a cache miss.
fn replicas_fingerprint(replicas: &Replicas) -> u64 {
    use rayon::prelude::*;
    let ranked_layer = |layer: &[Vec<(u32, u32)>]| {
        let mut h = FastHasher::default();
        h.write_usize(layer.len());
        for row in layer {
            h.write_usize(row.len());
            for &(rank, count) in row {
                h.write_u64(u64::from(rank) | (u64::from(count) << 32));
            }
        }
        h.finish()
    };
    let layers: Vec<u64> = match replicas {
        Replicas::Ranked(ranked) => ranked.par_iter().map(|l| ranked_layer(l)).collect(),
        // As its ranked form hashes: `layers` equal layer hashes.
        Replicas::Uniform { rows, layers } => vec![ranked_layer(rows); *layers],
        Replicas::Runs(runs) => runs
            .par_iter()
            .map(|layer| {
                let mut h = FastHasher::default();
                h.write_u64(u64::MAX);
                h.write_usize(layer.runs.len());
                for &(first, end) in &layer.runs {
                    h.write_u64(u64::from(first) | (u64::from(end) << 32));
                }
                h.write_usize(layer.expert_start.len());
                for &s in &layer.expert_start {
                    h.write_u32(s);
                }
                for &(run, gpu, count) in &layer.items {
                    h.write_u64(u64::from(run) | (u64::from(gpu) << 32));
                    h.write_u32(count);
                }
                h.finish()
            })
            .collect(),
    };
    let mut h = FastHasher::default();
    h.write_usize(layers.len());
    for x in layers {
        h.write_u64(x);
    }
    h.finish()
}

fn ns(s: f64) -> u64 {
    (s * NS_PER_S).round().max(0.0) as u64
}

fn secs(ns: u64) -> f64 {
    ns as f64 / NS_PER_S
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    End,
    TraceAdd(NodeId),
    TraceRemove(NodeId),
    NodeReady(NodeId),
    TryStart,
    SegmentDone {
        generation: u64,
    },
    PauseDone {
        generation: u64,
    },
    FailureDetected {
        generation: u64,
    },
    ScaleOutDue,
    /// Time for the lazarus machine (a lazy scale-out may be due).
    Tick,
    Sample,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeState {
    Booting,
    Ready,
    Dead,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PauseKind {
    Checkpoint,
    Reconfigure,
    Rebalance,
    ScaleOut,
    Restart,
    /// DS scale-out: save a checkpoint, then restart on more nodes.
    CheckpointThenRestart,
}

#[derive(Debug, Clone, Copy)]
enum Job {
    Idle,
    Running {
        since: u64,
        step_ns: u64,
        steps: u64,
    },
    Paused {
        kind: PauseKind,
        since: u64,
    },
    Detecting {
        since: u64,
    },
}

/// Who decides.
enum Control {
    /// The baselines answer the engine's questions at its decision points.
    Rules(Box<dyn System>),
    /// `lazarus`: the job state machine decides; the engine performs.
    Machine(Box<Driver>),
}

struct StepInfo {
    step_ns: u64,
    samples_per_step: u64,
    /// The part of the step its network is busy (all-to-all and gradient all-reduce), in
    /// parts per million.
    network_ppm: u32,
}

pub struct Engine<'a> {
    cfg: &'a ReplayConfig,
    workload: &'a Workload,
    control: Control,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    now: u64,
    end: u64,
    generation: u64,
    names: Vec<String>,
    state: Vec<NodeState>,
    job: Job,
    layout: Option<Rc<Layout>>,
    /// Hash of the layout's cost-relevant content (replicas, dispatch, EP groups, GPUs).
    layout_hash: u64,
    ever_started: bool,
    steps: u64,
    samples: u64,
    ckpt_steps: u64,
    ckpt_samples: u64,
    compute_since_ckpt: u64,
    last_ckpt_handled: u64,
    dead_pending: Vec<NodeId>,
    /// Failure detections started so far (the first is timed apart from later ones).
    failures_detected: u64,
    scale_out_timer: bool,
    scale_out_requested: bool,
    /// A failure interrupted a restart: the next decision is another restart.
    force_restart: bool,
    t: TimeBreakdown,
    summary: Summary,
    step_cache: Option<&'a StepCache>,
    /// `(step_ns, samples, network share in ppm)` per layout and load epoch.
    local_cache: BTreeMap<u64, (u64, u64, u32)>,
    /// Times each step was counted (only for a recorded workload, see [`Workload::history`]).
    counted: BTreeMap<u64, usize>,
    live_integral: f64,
    used_integral: f64,
    last_integral_t: u64,
    events: Vec<EventRecord>,
    samples_out: Vec<Sample>,
    record: bool,
    /// `cfg.step_events` with node ids (each addition a new node), and whether each fired.
    step_events: Vec<(u64, NodeOp, NodeId)>,
    fired: Vec<bool>,
    /// `cfg.end_after_steps` was reached: nothing more starts.
    steps_done: bool,
    /// With `cfg.pause_lag_steps`: the step count at which the pending pause takes effect.
    pause_at_steps: Option<u64>,
}

impl<'a> Engine<'a> {
    pub fn new(
        cfg: &'a ReplayConfig,
        system: SystemKind,
        trace: &Trace,
        workload: &'a Workload,
        record: bool,
        step_cache: Option<&'a StepCache>,
    ) -> Self {
        let mut e = Engine {
            cfg,
            workload,
            control: match system {
                SystemKind::Lazarus => Control::Machine(Box::new(Driver::new(
                    &Ctx {
                        hw: &cfg.hardware,
                        model: &cfg.model,
                    },
                    cfg.checkpoint_every_steps,
                    cfg.rebalance_every_steps,
                    cfg.load_window_steps,
                    (cfg.scale_out_wait_s * 1e3).round() as u64,
                    cfg.recovery,
                ))),
                SystemKind::Laer | SystemKind::LazarusFsep => {
                    Control::Machine(Box::new(Driver::sharded(
                        &Ctx {
                            hw: &cfg.hardware,
                            model: &cfg.model,
                        },
                        cfg.checkpoint_every_steps,
                        cfg.load_window_steps,
                        (cfg.scale_out_wait_s * 1e3).round() as u64,
                        match system {
                            SystemKind::Laer => 1,
                            _ => cfg.model.f,
                        },
                    )))
                }
                _ => Control::Rules(system.build()),
            },
            queue: BinaryHeap::new(),
            seq: 0,
            now: 0,
            end: 0,
            generation: 0,
            names: Vec::new(),
            state: Vec::new(),
            job: Job::Idle,
            layout: None,
            layout_hash: 0,
            ever_started: false,
            steps: 0,
            samples: 0,
            ckpt_steps: 0,
            ckpt_samples: 0,
            compute_since_ckpt: 0,
            last_ckpt_handled: 0,
            dead_pending: Vec::new(),
            failures_detected: 0,
            scale_out_timer: false,
            scale_out_requested: false,
            force_restart: false,
            t: TimeBreakdown::default(),
            summary: Summary::new(system),
            step_cache,
            local_cache: BTreeMap::new(),
            counted: BTreeMap::new(),
            live_integral: 0.0,
            used_integral: 0.0,
            last_integral_t: 0,
            events: Vec::new(),
            samples_out: Vec::new(),
            record,
            step_events: Vec::new(),
            fired: Vec::new(),
            steps_done: false,
            pause_at_steps: None,
        };
        let mut ids: BTreeMap<&str, NodeId> = BTreeMap::new();
        let end_ms = cfg
            .end_ms
            .unwrap_or_else(|| trace.events().last().map_or(0, |e| e.time_ms));
        e.end = end_ms.saturating_mul(NS_PER_MS);
        for ev in trace.events() {
            let id = *ids.entry(ev.node.as_str()).or_insert_with(|| {
                e.names.push(ev.node.clone());
                e.state.push(NodeState::Dead);
                (e.names.len() - 1) as NodeId
            });
            // Events after the end are never handled: skipping them also keeps a trace time
            // beyond u64 nanoseconds (5.8e14 ms) from overflowing.
            let t = ev.time_ms.saturating_mul(NS_PER_MS);
            if t > e.end {
                continue;
            }
            match ev.op {
                NodeOp::Add => e.push(t, Ev::TraceAdd(id)),
                NodeOp::Remove => e.push(t, Ev::TraceRemove(id)),
            }
        }
        // Step events: an addition is always a new node (a name can come back after its
        // removal); a removal takes the name's newest node.
        let mut current: BTreeMap<String, NodeId> = ids
            .iter()
            .map(|(name, &id)| ((*name).to_string(), id))
            .collect();
        for ev in &cfg.step_events {
            let id = match (ev.op, current.get(&ev.node)) {
                (NodeOp::Remove, Some(&id)) => id,
                _ => {
                    e.names.push(ev.node.clone());
                    e.state.push(NodeState::Dead);
                    let id = (e.names.len() - 1) as NodeId;
                    current.insert(ev.node.clone(), id);
                    id
                }
            };
            e.step_events.push((ev.after_step, ev.op, id));
        }
        e.fired = vec![false; e.step_events.len()];
        e.push(0, Ev::TryStart);
        if record && cfg.sample_every_s > 0.0 {
            e.push(0, Ev::Sample);
        }
        // Pushed last, so events at the end time itself are still processed.
        e.push(e.end, Ev::End);
        e
    }

    fn push(&mut self, t: u64, ev: Ev) {
        self.queue.push(Reverse((t, self.seq, ev)));
        self.seq += 1;
    }

    /// Schedules `ev` `delay_ns` from now. Saturating: a delay from a profile can be anything,
    /// and an event past the end is never handled anyway.
    fn push_after(&mut self, delay_ns: u64, ev: Ev) {
        self.push(self.now.saturating_add(delay_ns), ev);
    }

    fn rules(&mut self) -> &mut dyn System {
        match &mut self.control {
            Control::Rules(s) => s.as_mut(),
            Control::Machine(_) => unreachable!("lazarus is not asked"),
        }
    }

    fn driver(&mut self) -> Option<&mut Driver> {
        match &mut self.control {
            Control::Machine(d) => Some(d.as_mut()),
            Control::Rules(_) => None,
        }
    }

    fn ctx(&self) -> Ctx<'a> {
        Ctx {
            hw: &self.cfg.hardware,
            model: &self.cfg.model,
        }
    }

    fn log(&mut self, kind: &str, detail: serde_json::Value) {
        if self.record {
            self.events.push(EventRecord {
                t_s: secs(self.now),
                kind: kind.to_string(),
                step: self.steps,
                detail,
            });
        }
    }

    fn ready_nodes(&self) -> Vec<NodeId> {
        (0..self.state.len() as NodeId)
            .filter(|&n| self.state[n as usize] == NodeState::Ready)
            .collect()
    }

    fn live_count(&self) -> usize {
        self.state.iter().filter(|s| **s != NodeState::Dead).count()
    }

    fn used_count(&self) -> usize {
        match (self.job, &self.layout) {
            (Job::Idle, _) | (_, None) => 0,
            (_, Some(l)) => l.nodes.len(),
        }
    }

    /// Advances the node-count integrals to `now`.
    fn integrate(&mut self) {
        // Events at the same time add nothing, and counting the live nodes is a scan: per
        // event of 200,000 nodes added at once it was quadratic.
        if self.now == self.last_integral_t {
            return;
        }
        let dt = secs(self.now - self.last_integral_t);
        self.live_integral += dt * self.live_count() as f64;
        self.used_integral += dt * self.used_count() as f64;
        self.last_integral_t = self.now;
    }

    /// Runs the simulation to the end and returns the result, or [`ReplayError::TooManyEvents`]
    /// once [`MAX_EVENTS`] events were handled before the end.
    pub fn run(self) -> Result<RunResult, ReplayError> {
        self.run_with_budget(MAX_EVENTS)
    }

    fn run_with_budget(mut self, max_events: u64) -> Result<RunResult, ReplayError> {
        let mut handled = 0u64;
        while let Some(Reverse((t, _, ev))) = self.queue.pop() {
            self.now = t;
            self.integrate();
            if ev == Ev::End {
                break;
            }
            // Samples are bounded by the caller (duration / period); everything else counts.
            if ev != Ev::Sample {
                handled += 1;
                if handled > max_events {
                    return Err(ReplayError::TooManyEvents {
                        system: self.summary.system,
                        events: max_events,
                        reached_s: secs(self.now),
                        end_s: secs(self.end),
                    });
                }
            }
            self.handle(ev);
        }
        Ok(self.finish())
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::End => {}
            Ev::TraceAdd(n) => {
                self.log("node_add", json!({"node": self.names[n as usize]}));
                if self.now == 0 {
                    // The initial cluster: usable at once; the job starts after all of it.
                    self.state[n as usize] = NodeState::Ready;
                } else {
                    self.state[n as usize] = NodeState::Booting;
                    self.push_after(ns(self.cfg.node_boot_s), Ev::NodeReady(n));
                }
            }
            Ev::NodeReady(n) => {
                if self.state[n as usize] != NodeState::Booting {
                    return; // died while booting
                }
                self.state[n as usize] = NodeState::Ready;
                self.log("node_ready", json!({"node": self.names[n as usize]}));
                if self.driver().is_some() {
                    self.machine_ready(n);
                } else {
                    self.on_ready();
                }
            }
            Ev::TraceRemove(n) => self.on_remove(n),
            Ev::TryStart => {
                if matches!(self.job, Job::Idle) {
                    if self.driver().is_some() {
                        self.machine_start();
                    } else {
                        self.try_start();
                    }
                }
            }
            Ev::SegmentDone { generation } if generation == self.generation => {
                self.close_segment();
                self.at_boundary();
            }
            Ev::PauseDone { generation } if generation == self.generation => self.pause_done(),
            Ev::FailureDetected { generation } if generation == self.generation => {
                self.failure_detected()
            }
            Ev::ScaleOutDue => {
                self.scale_out_timer = false;
                let wants = match self.layout.clone() {
                    Some(l) if !matches!(self.job, Job::Idle) => {
                        let (ctx, ready) = (self.ctx(), self.ready_nodes());
                        self.rules().wants_scale_out(&ctx, &l, &ready)
                    }
                    _ => false,
                };
                if wants {
                    self.scale_out_requested = true;
                    self.cut_segment();
                }
            }
            Ev::Tick => {
                let (ctx, now) = (self.ctx(), self.now);
                if let Some(d) = self.driver() {
                    d.tick(&ctx, now);
                    if d.pause_wanted() {
                        self.cut_segment();
                    }
                }
            }
            Ev::Sample => {
                self.sample();
                // At least 1 ns: a period that rounds to zero would sample forever at `now`.
                let next = self.now.saturating_add(ns(self.cfg.sample_every_s).max(1));
                if next <= self.end {
                    self.push(next, Ev::Sample);
                }
            }
            Ev::SegmentDone { .. } | Ev::PauseDone { .. } | Ev::FailureDetected { .. } => {}
        }
    }

    fn on_ready(&mut self) {
        match (self.job, self.layout.clone()) {
            (Job::Idle, _) => self.try_start(),
            (_, Some(l)) if !self.scale_out_timer => {
                let (ctx, ready) = (self.ctx(), self.ready_nodes());
                if self.rules().wants_scale_out(&ctx, &l, &ready) {
                    self.scale_out_timer = true;
                    self.push_after(ns(self.cfg.scale_out_wait_s), Ev::ScaleOutDue);
                }
            }
            _ => {}
        }
    }

    /// Lazarus: the initial cluster joins the machine together.
    fn machine_start(&mut self) {
        let (ctx, now, ready) = (self.ctx(), self.now, self.ready_nodes());
        let d = self.driver().expect("lazarus");
        match d.nodes_ready(&ctx, now, &ready) {
            Some(order) => self.perform(order, None),
            None => {
                self.log("idle", json!({"ready": ready.len()}));
                self.job = Job::Idle;
            }
        }
    }

    /// Lazarus: a booted node joins the machine; a lazy scale-out may be due after the wait.
    fn machine_ready(&mut self, n: NodeId) {
        let (ctx, now) = (self.ctx(), self.now);
        let wait_ms = (self.cfg.scale_out_wait_s * 1e3).round() as u64;
        let d = self.driver().expect("lazarus");
        let order = d.nodes_ready(&ctx, now, &[n]);
        self.push_after(wait_ms.saturating_mul(NS_PER_MS), Ev::Tick);
        if let Some(order) = order {
            debug_assert!(
                matches!(self.job, Job::Idle),
                "joins only decide while idle"
            );
            self.perform(order, None);
        }
    }

    /// Lazarus: performs what the machine decided. `failure`: the detection time and the dead
    /// nodes' names when a detected failure led to it.
    fn perform(&mut self, order: Order, failure: Option<(u64, Vec<String>)>) {
        let (detect, dead_names) = failure.unwrap_or_default();
        let (ctx, now) = (self.ctx(), self.now);
        match order {
            Order::Start { layout } => {
                let nodes = layout.nodes.len();
                self.set_layout(Some(*layout));
                self.ever_started = true;
                self.log("start", json!({"nodes": nodes}));
                self.driver().expect("lazarus").reconfigured(&ctx, now);
                self.at_boundary();
            }
            Order::Wait => {
                // The job stopped; until nodes join the machine decides nothing more.
                self.t.restart_ns += detect;
                if self.layout.is_some() || !self.ever_started {
                    self.log(
                        "idle",
                        json!({"ready": self.ready_nodes().len(), "dead": dead_names}),
                    );
                }
                self.set_layout(None);
                self.job = Job::Idle;
                self.fire_next_additions();
            }
            Order::Restore { step, layout } => {
                self.t.restart_ns += detect;
                self.summary.fallbacks += 1;
                self.log(
                    "checkpoint_fallback",
                    json!({"dead": dead_names, "rollback_steps": self.steps - self.ckpt_steps}),
                );
                debug_assert_eq!(step, self.ckpt_steps, "the newest checkpoint saved");
                self.rollback();
                let nodes = layout.nodes.len();
                self.set_layout(Some(*layout));
                self.log("restart", json!({"nodes": nodes}));
                let gpus = nodes * self.cfg.hardware.gpus_per_node;
                let s = cost::restart_s(&self.cfg.hardware, &self.cfg.model, gpus)
                    + self.cfg.hardware.replan_s.unwrap_or(0.0);
                self.pause(PauseKind::Restart, s);
            }
            Order::Reconfigure {
                kind,
                layout,
                migration,
                membership_changed,
            } => {
                // The cheap tests first: comparing the replicas reads every layer of both.
                let unchanged = || {
                    self.layout.as_ref().is_some_and(|l| {
                        l.replicas
                            .same_ranks(&layout.replicas, self.cfg.hardware.gpus_per_node)
                    })
                };
                if kind == ReconfigKind::Rebalance
                    && migration.replicas == 0
                    && !membership_changed
                    && unchanged()
                {
                    // Nothing moves and the step cost stays: no pause, not counted.
                    self.set_layout(Some(*layout));
                    self.driver().expect("lazarus").reconfigured(&ctx, now);
                    self.at_boundary();
                    return;
                }
                self.add_migration(&migration);
                let mut pause =
                    self.migration_pause_s(&migration) + self.cfg.hardware.replan_s.unwrap_or(0.0);
                if membership_changed {
                    pause += self.cfg.hardware.communicator_rebuild_s;
                }
                if kind == ReconfigKind::Rebalance
                    && self.cfg.recovery == super::RecoveryPolicy::Repair
                {
                    // The background re-optimisation of repair-first recovery (issue 42): the
                    // copies stream while training goes on (`lzrun`'s asynchronous migration,
                    // planned off the critical path). Model: they run at the full rate for
                    // the migration time T, and training loses the part of T in which it
                    // needed the network itself (its all-to-all and all-reduce share u of a
                    // step): u·T, charged as rebalance time; the new layout is used from then
                    // on (T − u·T early: contention beyond that share is not modelled). The
                    // members keep their ranks (the switch renumbers the replan onto them), so
                    // no communicator is rebuilt.
                    let u = self
                        .layout
                        .clone()
                        .map_or(1.0, |l| self.step_info(&l).network_ppm as f64 / 1e6);
                    pause = self.migration_pause_s(&migration) * u;
                }
                let nodes = layout.nodes.len();
                let (m_replicas, m_bytes) = (migration.replicas, migration.bytes);
                let kind = match kind {
                    ReconfigKind::InPlace | ReconfigKind::Restore | ReconfigKind::Start => {
                        self.t.reconfigure_ns += detect;
                        self.summary.recoveries += 1;
                        self.log(
                            "reconfigure",
                            json!({"dead": dead_names, "nodes": nodes, "migrated_replicas": m_replicas,
                                   "migrated_bytes": m_bytes, "pause_s": pause + secs(detect)}),
                        );
                        PauseKind::Reconfigure
                    }
                    ReconfigKind::Join => {
                        self.summary.scale_outs += 1;
                        self.log(
                            "scale_out",
                            json!({"nodes": nodes, "migrated_replicas": m_replicas,
                                   "migrated_bytes": m_bytes, "pause_s": pause}),
                        );
                        PauseKind::ScaleOut
                    }
                    ReconfigKind::Rebalance => {
                        self.summary.rebalances += 1;
                        self.log(
                            "rebalance",
                            json!({"nodes": nodes, "migrated_replicas": m_replicas,
                                   "migrated_bytes": m_bytes, "pause_s": pause}),
                        );
                        PauseKind::Rebalance
                    }
                };
                self.set_layout(Some(*layout));
                self.pause(kind, pause);
            }
        }
    }

    fn on_remove(&mut self, n: NodeId) {
        let was = self.state[n as usize];
        self.state[n as usize] = NodeState::Dead;
        self.summary.preemptions += 1;
        let in_use = !matches!(self.job, Job::Idle)
            && self.layout.as_ref().is_some_and(|l| l.nodes.contains(&n));
        self.log(
            "node_remove",
            json!({"node": self.names[n as usize], "in_use": in_use, "was_booting": was == NodeState::Booting}),
        );
        if !in_use {
            let (ctx, now) = (self.ctx(), self.now);
            if let Some(order) = self.driver().and_then(|d| d.node_gone(&ctx, now, n)) {
                self.perform(order, None);
            }
            return;
        }
        self.summary.preemptions_in_use += 1;
        self.dead_pending.push(n);
        // The step time the detection may scale with (only read with
        // `failure_detection_steps`): the running segment's, else the layout's.
        let step_ns = match (self.job, self.cfg.hardware.failure_detection_steps) {
            (_, None) => 0,
            (Job::Running { step_ns, .. }, _) => step_ns,
            _ => match self.layout.clone() {
                Some(l) => self.step_info(&l).step_ns,
                None => 0,
            },
        };
        match self.job {
            Job::Detecting { .. } => {}
            Job::Running { .. } => {
                self.close_segment();
                self.start_detection(step_ns);
            }
            Job::Paused { kind, since } => {
                *self.pause_bucket(kind) += self.now - since;
                // A failure while restarting means restarting again. One during a
                // reconfiguration is handled from the new plan's holdings, i.e. as if the
                // migration had completed (the paper does not discuss this case).
                self.force_restart |= kind == PauseKind::Restart;
                self.start_detection(step_ns);
            }
            Job::Idle => unreachable!("in_use implies a running job"),
        }
    }

    /// Detection of a failure, scaled by the step time `step_ns` where the profile measures
    /// detection in steps (the job's first failure and later ones apart).
    fn start_detection(&mut self, step_ns: u64) {
        self.generation += 1;
        self.job = Job::Detecting { since: self.now };
        let steps = self
            .cfg
            .hardware
            .detection_steps(self.failures_detected > 0);
        self.failures_detected += 1;
        let timeout = ns(self.cfg.hardware.failure_detection_timeout_s)
            .saturating_add(ns(steps * secs(step_ns)));
        self.push_after(
            timeout,
            Ev::FailureDetected {
                generation: self.generation,
            },
        );
    }

    fn pause_bucket(&mut self, kind: PauseKind) -> &mut u64 {
        match kind {
            PauseKind::Checkpoint => &mut self.t.checkpoint_ns,
            PauseKind::Reconfigure | PauseKind::ScaleOut => &mut self.t.reconfigure_ns,
            PauseKind::Rebalance => &mut self.t.rebalance_ns,
            PauseKind::Restart | PauseKind::CheckpointThenRestart => &mut self.t.restart_ns,
        }
    }

    /// Closes the running segment at `now`: whole steps count, the partial step is lost.
    fn close_segment(&mut self) {
        if let Job::Running {
            since,
            step_ns,
            steps,
        } = self.job
        {
            let elapsed = self.now - since;
            let done = (elapsed / step_ns).min(steps);
            if done > 0 && self.driver().is_some() {
                let (ctx, now, first) = (self.ctx(), self.now, self.steps);
                // A recorded run's routing of this count of the step (a rollback counts
                // steps again, with the routing their second run recorded).
                let nth = if self.workload.counts_repeats() {
                    let nth = self.counted.get(&first).copied().unwrap_or(0);
                    for s in first..first + done {
                        *self.counted.entry(s).or_insert(0) += 1;
                    }
                    nth
                } else {
                    0
                };
                let routing = self.workload.history(first, nth);
                let d = self.driver().expect("lazarus");
                d.steps_done(&ctx, now, first, first + done - 1, &routing);
            }
            let sps = self.current_samples_per_step();
            self.steps += done;
            self.samples += done * sps;
            self.t.compute_ns += done * step_ns;
            self.compute_since_ckpt += done * step_ns;
            self.t.lost_ns += elapsed - done * step_ns;
            self.job = Job::Idle;
        }
    }

    fn current_samples_per_step(&self) -> u64 {
        self.layout.as_ref().map_or(0, |l| {
            self.cfg
                .model
                .sequences_per_step(l.gpus(&self.cfg.hardware))
        })
    }

    /// A scale-out was requested: end the running segment at the next step boundary.
    fn cut_segment(&mut self) {
        if let Job::Running {
            since,
            step_ns,
            steps,
        } = self.job
        {
            let next = (self.now - since) / step_ns + 1;
            if next < steps {
                self.generation += 1;
                self.job = Job::Running {
                    since,
                    step_ns,
                    steps: next,
                };
                self.push(
                    since + next * step_ns,
                    Ev::SegmentDone {
                        generation: self.generation,
                    },
                );
            }
        }
    }

    fn pause(&mut self, kind: PauseKind, seconds: f64) {
        self.generation += 1;
        self.job = Job::Paused {
            kind,
            since: self.now,
        };
        self.push_after(
            ns(seconds),
            Ev::PauseDone {
                generation: self.generation,
            },
        );
    }

    fn planning_loads(&self) -> Vec<Vec<u64>> {
        super::window_loads(self.workload, self.steps, self.cfg.load_window_steps)
    }

    fn set_layout(&mut self, layout: Option<Layout>) {
        self.layout_hash = layout.as_ref().map_or(0, |l| {
            let mut h = FastHasher::default();
            (
                l.gpus(&self.cfg.hardware),
                replicas_fingerprint(&l.replicas),
                l.dispatch,
                &l.ep_groups,
                l.fsep
                    .as_ref()
                    .map(|f| f.shape(self.cfg.hardware.gpus_per_node)),
            )
                .hash(&mut h);
            h.finish()
        });
        self.layout = layout.map(Rc::new);
    }

    fn try_start(&mut self) {
        let ready = self.ready_nodes();
        let loads = self.planning_loads();
        let ctx = self.ctx();
        match self.rules().start(&ctx, &ready, &loads) {
            None => {
                if self.layout.is_some() || !self.ever_started {
                    self.log("idle", json!({"ready": ready.len()}));
                }
                self.set_layout(None);
                self.job = Job::Idle;
            }
            Some(layout) => {
                let nodes = layout.nodes.len();
                self.set_layout(Some(layout));
                if self.ever_started {
                    self.log("restart", json!({"nodes": nodes}));
                    let gpus = nodes * self.cfg.hardware.gpus_per_node;
                    let s = cost::restart_s(&self.cfg.hardware, &self.cfg.model, gpus);
                    self.pause(PauseKind::Restart, s);
                } else {
                    self.ever_started = true;
                    self.log("start", json!({"nodes": nodes}));
                    self.at_boundary();
                }
            }
        }
    }

    fn migration_pause_s(&self, m: &Migration) -> f64 {
        cost::migration_s(
            &self.cfg.hardware,
            m.max_sent_bytes,
            m.max_recv_bytes,
            false,
        )
    }

    fn failure_detected(&mut self) {
        let detect = match self.job {
            Job::Detecting { since } => self.now - since,
            _ => 0,
        };
        let dead = std::mem::take(&mut self.dead_pending);
        let ready = self.ready_nodes();
        let loads = self.planning_loads();
        let ctx = self.ctx();
        let layout = self.layout.clone().expect("a failure needs a layout");
        let dead_names: Vec<String> = dead
            .iter()
            .map(|&n| self.names[n as usize].clone())
            .collect();
        let (now, steps) = (self.now, self.steps);
        if let Some(d) = self.driver() {
            // A restart interrupted by a failure is done again: the machine's rule.
            let order = d.failure_detected(&ctx, now, &dead, steps, &layout);
            self.force_restart = false;
            let order = order.expect("every member reported idle: the machine decides");
            return self.perform(order, Some((detect, dead_names)));
        }
        let decision = if std::mem::take(&mut self.force_restart) {
            Decision::RestartFromCheckpoint
        } else {
            self.rules()
                .on_failure(&ctx, &layout, &dead, &ready, &loads)
        };
        match decision {
            Decision::Reconfigure { layout, migration } => {
                self.t.reconfigure_ns += detect;
                self.summary.recoveries += 1;
                self.add_migration(&migration);
                let pause =
                    self.cfg.hardware.communicator_rebuild_s + self.migration_pause_s(&migration);
                self.log(
                    "reconfigure",
                    json!({"dead": dead_names, "nodes": layout.nodes.len(), "migrated_replicas": migration.replicas,
                           "migrated_bytes": migration.bytes, "pause_s": pause + secs(detect)}),
                );
                self.set_layout(Some(*layout));
                self.pause(PauseKind::Reconfigure, pause);
            }
            _ => {
                self.t.restart_ns += detect;
                self.summary.fallbacks += 1;
                self.log(
                    "checkpoint_fallback",
                    json!({"dead": dead_names, "rollback_steps": self.steps - self.ckpt_steps}),
                );
                self.rollback();
                self.set_layout(None);
                self.job = Job::Idle;
                self.try_start();
            }
        }
    }

    fn add_migration(&mut self, m: &Migration) {
        self.summary.migrated_replicas += m.replicas;
        self.summary.migrated_bytes += m.bytes;
    }

    fn rollback(&mut self) {
        self.t.compute_ns -= self.compute_since_ckpt;
        self.t.lost_ns += self.compute_since_ckpt;
        self.compute_since_ckpt = 0;
        self.steps = self.ckpt_steps;
        self.samples = self.ckpt_samples;
        self.last_ckpt_handled = self.steps;
    }

    fn pause_done(&mut self) {
        let Job::Paused { kind, since } = self.job else {
            return;
        };
        *self.pause_bucket(kind) += self.now - since;
        self.job = Job::Idle;
        match kind {
            PauseKind::Checkpoint => self.save_checkpoint(),
            PauseKind::CheckpointThenRestart => {
                self.save_checkpoint();
                self.summary.scale_outs += 1;
                self.set_layout(None);
                self.try_start();
                return;
            }
            PauseKind::Reconfigure
            | PauseKind::ScaleOut
            | PauseKind::Rebalance
            | PauseKind::Restart => {
                let (ctx, now) = (self.ctx(), self.now);
                if let Some(d) = self.driver() {
                    d.reconfigured(&ctx, now);
                }
            }
        }
        self.at_boundary();
    }

    fn save_checkpoint(&mut self) {
        self.ckpt_steps = self.steps;
        self.ckpt_samples = self.samples;
        self.compute_since_ckpt = 0;
        self.summary.checkpoints += 1;
        self.log("checkpoint", json!({}));
        let (ctx, now, steps) = (self.ctx(), self.now, self.steps);
        if let Some(d) = self.driver() {
            d.checkpoint_saved(&ctx, now, steps);
        }
    }

    /// At a step boundary: stop if `end_after_steps` is reached; fire the step events due
    /// (additions first, then what happens next at this boundary, then the removals, which
    /// interrupt it).
    fn at_boundary(&mut self) {
        if self.steps_done {
            return;
        }
        if self.cfg.end_after_steps.is_some_and(|n| self.steps >= n) {
            self.steps_done = true;
            self.log("steps_done", json!({}));
            self.push(self.now, Ev::End);
            return;
        }
        let due: Vec<usize> = (0..self.step_events.len())
            .filter(|&i| !self.fired[i] && self.step_events[i].0 < self.steps)
            .collect();
        for &i in &due {
            self.fired[i] = true;
        }
        for &i in &due {
            let (_, op, id) = self.step_events[i];
            if op == NodeOp::Add {
                self.handle(Ev::TraceAdd(id));
            }
        }
        self.boundary_decision();
        for &i in &due {
            let (_, op, id) = self.step_events[i];
            if op == NodeOp::Remove && self.state[id as usize] != NodeState::Dead {
                self.on_remove(id);
            }
        }
    }

    /// While the job waits for nodes no step completes: start the next pending additions of
    /// the step events now (as `lzrun local` does).
    fn fire_next_additions(&mut self) {
        let next = (0..self.step_events.len())
            .filter(|&i| !self.fired[i] && self.step_events[i].1 == NodeOp::Add)
            .map(|i| self.step_events[i].0)
            .min();
        let Some(step) = next else {
            return;
        };
        for i in 0..self.step_events.len() {
            let (after, op, id) = self.step_events[i];
            if !self.fired[i] && op == NodeOp::Add && after == step {
                self.fired[i] = true;
                self.log(
                    "early_add",
                    json!({"node": self.names[id as usize], "after_step": after}),
                );
                self.handle(Ev::TraceAdd(id));
            }
        }
    }

    /// The steps until the next step event can fire (`u64::MAX` without one).
    fn steps_to_next_event(&self) -> u64 {
        let s = self.steps;
        let mut n = u64::MAX;
        for (i, &(after, _, _)) in self.step_events.iter().enumerate() {
            if !self.fired[i] && after + 1 > s {
                n = n.min(after + 1 - s);
            }
        }
        if let Some(end) = self.cfg.end_after_steps {
            n = n.min(end.saturating_sub(s).max(1));
        }
        n
    }

    /// At a step boundary with a layout: checkpoint if due, then (baselines) a scale-out if
    /// due, or (lazarus) what the machine decides if it asked for a pause; else run the next
    /// segment.
    fn boundary_decision(&mut self) {
        let Some(layout) = self.layout.clone() else {
            self.job = Job::Idle;
            return;
        };
        let ckpt_every = self.cfg.checkpoint_every_steps.unwrap_or(0);
        if ckpt_every > 0
            && self.steps > self.ckpt_steps
            && self.steps.is_multiple_of(ckpt_every)
            && self.last_ckpt_handled != self.steps
        {
            self.last_ckpt_handled = self.steps;
            let s = cost::checkpoint_save_s(
                &self.cfg.hardware,
                &self.cfg.model,
                layout.gpus(&self.cfg.hardware),
            );
            self.pause(PauseKind::Checkpoint, s);
            return;
        }
        if self.driver().is_some() {
            let (ctx, now, steps) = (self.ctx(), self.now, self.steps);
            let lag = self.cfg.pause_lag_steps;
            let d = self.driver().expect("lazarus");
            // A pause takes effect `pause_lag_steps` steps after the first boundary since it
            // was asked for (lzrun's members read the request when a step starts).
            if !d.pause_wanted() {
                self.pause_at_steps = None;
            } else if lag > 0 {
                let at = *self.pause_at_steps.get_or_insert(steps + lag);
                if steps < at {
                    self.run_segment(&layout);
                    return;
                }
            }
            let d = self.driver().expect("lazarus");
            match d.at_boundary(&ctx, now, steps, &layout) {
                Some(order) => self.perform(order, None),
                None => self.run_segment(&layout),
            }
            return;
        }
        if self.scale_out_requested {
            self.scale_out_requested = false;
            let ready = self.ready_nodes();
            let loads = self.planning_loads();
            let ctx = self.ctx();
            match self.rules().scale_out(&ctx, &layout, &ready, &loads) {
                Decision::Reconfigure { layout, migration } => {
                    self.summary.scale_outs += 1;
                    self.add_migration(&migration);
                    let pause = self.cfg.hardware.communicator_rebuild_s
                        + self.migration_pause_s(&migration);
                    self.log(
                        "scale_out",
                        json!({"nodes": layout.nodes.len(), "migrated_replicas": migration.replicas,
                               "migrated_bytes": migration.bytes, "pause_s": pause}),
                    );
                    self.set_layout(Some(*layout));
                    self.pause(PauseKind::ScaleOut, pause);
                    return;
                }
                Decision::CheckpointAndRestart => {
                    self.log("scale_out", json!({"restart": true}));
                    let s = cost::checkpoint_save_s(
                        &self.cfg.hardware,
                        &self.cfg.model,
                        layout.gpus(&self.cfg.hardware),
                    );
                    self.pause(PauseKind::CheckpointThenRestart, s);
                    return;
                }
                Decision::RestartFromCheckpoint | Decision::Keep => {}
            }
        }
        self.run_segment(&layout);
    }

    fn step_info(&mut self, layout: &Layout) -> StepInfo {
        // The step time depends only on the layout's content and the load epoch (steps of one
        // epoch share their next change point), not on which physical nodes play which part.
        let epoch = self.workload.next_change(self.steps).unwrap_or(u64::MAX);
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (epoch, self.layout_hash).hash(&mut h);
        let key = h.finish();
        let cached = self.local_cache.get(&key).copied().or_else(|| {
            self.step_cache
                .and_then(|c| c.lock().ok().and_then(|m| m.get(&key).copied()))
        });
        let (step_ns, samples_per_step, network_ppm) = match cached {
            Some(v) => v,
            None => {
                let loads = self.workload.loads(self.steps);
                // FSEP layouts re-materialise for these loads and pay the shard traffic.
                let (c, _) = super::systems::fsep::layout_step_cost(
                    &self.cfg.hardware,
                    &self.cfg.model,
                    layout,
                    &loads,
                )
                .expect("the step cost of a valid layout");
                let network = if c.total_s > 0.0 {
                    ((c.all_to_all_s + c.grad_allreduce_s) / c.total_s).clamp(0.0, 1.0)
                } else {
                    1.0
                };
                let v = (
                    ns(c.total_s).max(1),
                    c.samples,
                    (network * 1e6).round() as u32,
                );
                if let Some(shared) = self.step_cache
                    && let Ok(mut m) = shared.lock()
                {
                    m.insert(key, v);
                }
                v
            }
        };
        self.local_cache
            .insert(key, (step_ns, samples_per_step, network_ppm));
        StepInfo {
            step_ns,
            samples_per_step,
            network_ppm,
        }
    }

    fn run_segment(&mut self, layout: &Layout) {
        let info = self.step_info(layout);
        debug_assert_eq!(info.samples_per_step, self.current_samples_per_step());
        let s = self.steps;
        let until_multiple = |every: Option<u64>| match every {
            Some(k) if k > 0 => k - s % k,
            _ => u64::MAX,
        };
        let decision = match &self.control {
            Control::Rules(_) => until_multiple(self.cfg.rebalance_every_steps),
            Control::Machine(d) => d.next_decision_step().map_or(u64::MAX, |k| k - s),
        };
        let mut n = until_multiple(self.cfg.checkpoint_every_steps)
            .min(decision)
            .min(self.steps_to_next_event())
            .min(
                self.pause_at_steps
                    .map_or(u64::MAX, |k| k.saturating_sub(s).max(1)),
            )
            .min(self.workload.next_change(s).map_or(u64::MAX, |c| c - s))
            .min(1_000_000);
        if self.scale_out_requested {
            n = 1;
        }
        self.generation += 1;
        self.job = Job::Running {
            since: self.now,
            step_ns: info.step_ns,
            steps: n,
        };
        self.push_after(
            n.saturating_mul(info.step_ns),
            Ev::SegmentDone {
                generation: self.generation,
            },
        );
    }

    fn sample(&mut self) {
        let (steps, samples, throughput, state) = match self.job {
            Job::Running {
                since,
                step_ns,
                steps,
            } => {
                let done = ((self.now - since) / step_ns).min(steps);
                let sps = self.current_samples_per_step();
                (
                    self.steps + done,
                    self.samples + done * sps,
                    sps as f64 / secs(step_ns),
                    "running",
                )
            }
            Job::Idle => (self.steps, self.samples, 0.0, "idle"),
            Job::Paused { kind, .. } => (
                self.steps,
                self.samples,
                0.0,
                match kind {
                    PauseKind::Checkpoint => "checkpoint",
                    PauseKind::Reconfigure | PauseKind::ScaleOut => "reconfigure",
                    PauseKind::Rebalance => "rebalance",
                    PauseKind::Restart | PauseKind::CheckpointThenRestart => "restart",
                },
            ),
            Job::Detecting { .. } => (self.steps, self.samples, 0.0, "detecting"),
        };
        self.samples_out.push(Sample {
            t_s: secs(self.now),
            live_nodes: self.live_count(),
            used_nodes: self.used_count(),
            state: state.to_string(),
            steps,
            samples,
            throughput_samples_per_s: throughput,
        });
    }

    fn finish(mut self) -> RunResult {
        if self.record && self.cfg.sample_every_s > 0.0 {
            self.sample();
        }
        // Account the activity in progress at the end.
        match self.job {
            Job::Running { .. } => self.close_segment(),
            Job::Paused { kind, since } => *self.pause_bucket(kind) += self.now - since,
            Job::Detecting { since } => self.t.restart_ns += self.now - since,
            Job::Idle => {}
        }
        let wall = self.now;
        let accounted = self.t.compute_ns
            + self.t.lost_ns
            + self.t.checkpoint_ns
            + self.t.restart_ns
            + self.t.reconfigure_ns
            + self.t.rebalance_ns;
        self.t.idle_ns = wall.saturating_sub(accounted);
        let mut s = self.summary;
        s.duration_s = secs(wall);
        s.steps = self.steps;
        s.samples = self.samples;
        s.ettr = if wall > 0 {
            self.t.compute_ns as f64 / wall as f64
        } else {
            0.0
        };
        s.samples_per_s = if wall > 0 {
            self.samples as f64 / secs(wall)
        } else {
            0.0
        };
        s.avg_live_nodes = if wall > 0 {
            self.live_integral / secs(wall)
        } else {
            0.0
        };
        s.avg_used_nodes = if wall > 0 {
            self.used_integral / secs(wall)
        } else {
            0.0
        };
        s.time = self.t.to_seconds();
        RunResult {
            summary: s,
            timeseries: self.samples_out,
            events: self.events,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{self, ModelProfile};
    use lazarus_traces::zipf::ZipfLoads;
    use lazarus_traces::{TraceFormat, parse};

    /// A model so small that a step takes microseconds: a checkpoint every 50 steps is then a
    /// segment every few hundred microseconds, millions of events per simulated hour.
    const TINY_MODEL: &str = "name = \"tiny\"\nlayers = 1\nmoe_layers = 1\nd_model = 1\n\
        ffn_hidden = 1\nffn_matrices = 2\nexperts = 2\nshared_experts = 0\ntop_k = 1\n\
        vocab = 1\ntied_embeddings = true\nseq_len = 1\nbatch_per_gpu = 1\n\
        bytes_per_param_weights = 2\nbytes_per_param_state = 14\nbytes_per_expert_state = 28\n\
        ep_size = 2\nslots_per_gpu = 6\nf = 2\n";

    fn step_event(after_step: u64, op: NodeOp, node: &str) -> crate::replay::StepEvent {
        crate::replay::StepEvent {
            after_step,
            op,
            node: node.to_string(),
        }
    }

    fn step_config(events: Vec<crate::replay::StepEvent>) -> ReplayConfig {
        let model: ModelProfile = toml::from_str(TINY_MODEL).expect("tiny model");
        ReplayConfig {
            hardware: cost::hardware("rtx3090-100g").expect("built-in"),
            model,
            checkpoint_every_steps: Some(10),
            rebalance_every_steps: None,
            load_window_steps: 200,
            scale_out_wait_s: 0.0,
            node_boot_s: 0.0,
            end_ms: Some(3_600_000),
            sample_every_s: 0.0,
            step_events: events,
            end_after_steps: Some(30),
            pause_lag_steps: 0,
            recovery: Default::default(),
        }
    }

    fn run_steps(cfg: &ReplayConfig, nodes: usize) -> RunResult {
        let text: String = (0..nodes).map(|i| format!("0,add,n{i}\n")).collect();
        let trace = parse(&text, TraceFormat::BambooCsv).expect("trace");
        let model = &cfg.model;
        let workload = Workload::Zipf(ZipfLoads::new(0.0, model.experts, model.moe_layers, 0));
        Engine::new(cfg, SystemKind::Lazarus, &trace, &workload, true, None)
            .run()
            .expect("a short run")
    }

    #[test]
    fn the_first_failure_and_later_ones_are_detected_in_their_own_steps() {
        // Detection only in steps (no fixed timeout), so the reconfiguration time shows it.
        let reconfigure = |kills: &[(u64, &str)], steps: f64, later: Option<f64>| {
            let events = kills
                .iter()
                .map(|&(at, node)| step_event(at, NodeOp::Remove, node))
                .collect();
            let mut cfg = step_config(events);
            cfg.hardware.failure_detection_timeout_s = 0.0;
            cfg.hardware.failure_detection_steps = Some(steps);
            cfg.hardware.failure_detection_steps_later = later;
            let r = run_steps(&cfg, 5);
            let mut steps_killed: Vec<u64> = kills.iter().map(|k| k.0).collect();
            steps_killed.dedup();
            assert_eq!(r.summary.recoveries, steps_killed.len() as u64);
            r.summary.time.reconfigure
        };
        let two = [(5, "n2"), (12, "n0")];
        // The first failure takes failure_detection_steps, later ones their own ...
        let (slow, fast) = (
            reconfigure(&two, 3.0, None),
            reconfigure(&two, 3.0, Some(1.0)),
        );
        assert!(fast < slow, "{fast} s, {slow} s");
        assert_eq!(
            reconfigure(&two[..1], 3.0, Some(1.0)),
            reconfigure(&two[..1], 3.0, None)
        );
        // ... and a profile without the key detects every failure alike.
        assert_eq!(slow, reconfigure(&two, 3.0, Some(3.0)));
        // Nodes killed together are one failure.
        let together = [(5, "n2"), (5, "n0")];
        assert_eq!(
            reconfigure(&together, 3.0, Some(1.0)),
            reconfigure(&together, 3.0, None)
        );
    }

    #[test]
    fn step_events_fire_after_their_step_and_the_run_stops_at_its_steps() {
        let cfg = step_config(vec![
            step_event(5, NodeOp::Remove, "n2"),
            step_event(12, NodeOp::Add, "n4"),
        ]);
        let r = run_steps(&cfg, 4);
        let s = &r.summary;
        assert_eq!(s.steps, 30);
        assert_eq!((s.recoveries, s.fallbacks, s.scale_outs), (1, 0, 1));
        assert_eq!((s.preemptions, s.preemptions_in_use), (1, 1));
        let remove = r.events.iter().find(|e| e.kind == "node_remove").unwrap();
        assert_eq!(remove.step, 6, "killed once step 5 (0-based) completed");
        let add = r
            .events
            .iter()
            .find(|e| e.kind == "node_add" && e.step > 0)
            .unwrap();
        assert_eq!(add.step, 13);
        assert_eq!(r.events.last().unwrap().kind, "steps_done");
        // The run ends when its last step completes.
        let t = s.time;
        let busy = t.compute + t.lost + t.checkpoint + t.restart + t.reconfigure + t.rebalance;
        assert!((busy + t.idle - s.duration_s).abs() < 1e-6);
        assert_eq!(t.idle, 0.0);
        // Deterministic.
        let again = run_steps(&cfg, 4);
        assert_eq!(again.summary, r.summary);
        assert_eq!(again.events, r.events);
    }

    #[test]
    fn killing_every_holder_restores_the_checkpoint_and_waiting_starts_joins_early() {
        // Two nodes, f = 2: each holds every expert; killing both leaves nothing, the machine
        // waits, and the join scheduled much later starts at once (as lzrun local does).
        let mut cfg = step_config(vec![
            step_event(14, NodeOp::Remove, "n0"),
            step_event(14, NodeOp::Remove, "n1"),
            step_event(25, NodeOp::Add, "n2"),
            step_event(25, NodeOp::Add, "n3"),
        ]);
        cfg.end_after_steps = Some(20);
        let r = run_steps(&cfg, 2);
        let s = &r.summary;
        assert_eq!(s.steps, 20);
        assert_eq!(s.fallbacks, 1, "{:?}", r.events);
        assert!(r.events.iter().any(|e| e.kind == "early_add"));
        // Steps 10..=14 were rolled back to the checkpoint of step 10 and trained again.
        assert!(s.time.lost > 0.0);
    }

    #[test]
    fn a_run_stops_at_its_event_budget() {
        let model: ModelProfile = toml::from_str(TINY_MODEL).expect("tiny model");
        let workload = Workload::Zipf(ZipfLoads::new(1.2, model.experts, model.moe_layers, 0));
        let cfg = ReplayConfig {
            hardware: cost::hardware("rtx3090-100g").expect("built-in"),
            model,
            checkpoint_every_steps: Some(50),
            rebalance_every_steps: None,
            load_window_steps: 200,
            scale_out_wait_s: 120.0,
            node_boot_s: 45.0,
            end_ms: Some(3_600_000),
            sample_every_s: 0.0,
            step_events: Vec::new(),
            end_after_steps: None,
            pause_lag_steps: 0,
            recovery: Default::default(),
        };
        let trace = parse("0,add,a\n0,add,b\n", TraceFormat::BambooCsv).expect("trace");
        let engine = Engine::new(&cfg, SystemKind::Ds, &trace, &workload, false, None);
        match engine.run_with_budget(1000) {
            Err(ReplayError::TooManyEvents {
                events, reached_s, ..
            }) => {
                assert_eq!(events, 1000);
                assert!(reached_s < 3600.0, "{reached_s}");
            }
            Ok(r) => panic!("ran to the end: {:?}", r.summary),
        }
    }
}
