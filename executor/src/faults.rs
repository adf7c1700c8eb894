//! Fault schedules for `lzrun local`: which node is killed, and when a node joins, measured in
//! training steps.
//!
//! A [`FaultSchedule`] is a list of [`FaultEvent`]s sorted by `after_step`: the launcher
//! applies an event once training has **completed** step `after_step` (steps are 0-based), in
//! schedule order among the events of one step. It comes from one of three sources:
//!
//! * **CLI flags** ([`schedule_from_flags`]): `--nodes N`, `--kill NODE@STEP` (repeatable,
//!   [`parse_kill`]) and `--join @STEP` (repeatable, [`parse_join`]). `--kill-controller @STEP`
//!   ([`parse_kill_controller`], [`FaultSchedule::add_controller_kills`]) kills the controller
//!   instead of a node, with any of the sources.
//! * **A node-availability trace** ([`schedule_from_trace`]): `--fault-trace FILE
//!   --time-scale X`, in any format of the [`lazarus_traces`] crate (a count series, such as
//!   a `time_ms,live_nodes` CSV, names its nodes by the crate's count rule: `n0, n1, …` in
//!   add order, the newest removed first, so node `n<k>` gets index `k` unless a window or
//!   a fit onto fewer nodes changes who is live).
//! * **A seeded random "chaos" schedule** for tests ([`chaos_schedule`]).
//! * **A seeded storm** of every kind of fault ([`storm_schedule`], `lzrun local --storm N`):
//!   kills, simultaneous kills, joins racing kills, frozen workers and agents, controller
//!   kills and a full checkpoint disk.
//!
//! # Node indices
//!
//! The launcher starts `initial_nodes` node agents with indices `0..initial_nodes` in launch
//! order; every node that joins later gets the next unused index, in join order (indices are
//! never reused, so a node that dies and a node that joins later never share one). A
//! [`Fault::Kill`] names a node by that index. A trace names nodes by their trace names instead
//! ([`Fault::KillName`], `Join { name: Some(..) }`); the launcher maps a name to the index it
//! gave the node when the name joined (or was launched, for `initial_names`).
//!
//! # Rules shared by all sources
//!
//! * A fault must leave at least one step to train after it: a run of `steps` steps (`0 ..
//!   steps-1`) accepts faults after steps `0 ..= steps-2`. [`schedule_from_flags`] rejects a
//!   later one ([`FaultError::TooLate`]); [`schedule_from_trace`] drops it and counts it in
//!   [`FaultSchedule::dropped_after_end`].
//! * Among the events of one step, **joins come before kills** for flag schedules (so
//!   `--join @3 --kill 3@3` on 3 nodes kills the node that just joined, matching the
//!   validation rule "a kill may name any node that exists by then"); trace schedules keep the
//!   trace's order (which has the adds of a time stamp before its removes, and earlier time
//!   stamps first).
//!
//! # Trace semantics (`--fault-trace FILE --time-scale X`)
//!
//! * `X` is **trace seconds per training step**: an event at trace time `t_ms` fires after step
//!   `floor(t_ms / (1000·X))`. `X` must be finite and `> 0` ([`FaultError::BadTimeScale`]).
//!   Quotients within a relative `1e-9` of an integer are rounded to it, so that e.g.
//!   `X = 0.3` maps `t = 3000 ms` to step 10 despite floating-point error.
//! * With `max_nodes = Some(m)`, the trace is first fitted onto at most `m` live nodes with
//!   [`FitMode::Clamp`] (original names; a preempted node is replaced at once by a waiting
//!   one, which shows up as a join).
//! * The nodes live at trace time 0 (after the whole batch at `t = 0`) are the initial nodes:
//!   their count is the initial `N`, and they get indices `0..N` in the order they are added in
//!   the `t = 0` batch (`initial_names`). A trace with no live node at `t = 0` is rejected
//!   ([`FaultError::NoInitialNodes`], whose message suggests `--window`); slice it with
//!   [`Trace::window`] first (`lzrun local --window START..END`; the g4dn trace starts at
//!   480 s).
//! * Every later `remove` of a name becomes [`Fault::KillName`] of that name (the node that
//!   currently carries it); every later `add` becomes `Join { name: Some(name) }`: the launcher
//!   assigns the joining node the next index. A name that is removed and added again later is a
//!   new node with a new index.
//! * Events that fire after step `steps-1` or later are dropped and counted.
//! * The trace may drop to zero live nodes (every node preempted); the launcher then has to
//!   wait for the next join (or give up). Flag schedules never do this
//!   ([`FaultError::NoLiveNode`]).
use std::collections::HashMap;

use lazarus_traces::duration::format_ms;
use lazarus_traces::{FitMode, NodeOp, Trace};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// One fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fault {
    /// SIGKILL the node with this executor index (see the [module docs](self)).
    Kill {
        /// Executor node index.
        node: usize,
    },
    /// SIGKILL the node that currently carries this trace name.
    KillName {
        /// Trace node name.
        name: String,
    },
    /// Start a new node; it gets the next unused index. `name` is its trace name, if any.
    Join {
        /// Trace node name (`None` for `--join` and chaos schedules).
        name: Option<String>,
    },
    /// Kill the controller (the launcher restarts it from its saved state); no node is hurt.
    KillController,
    /// SIGSTOP the worker process of the node with this index: alive but silent (no steps, no
    /// heartbeats), as a hung GPU or a kernel stall leaves it. The controller must fence it;
    /// the launcher then kills the node for good.
    FreezeWorker {
        /// Executor node index.
        node: usize,
    },
    /// SIGSTOP the agent process of the node with this index: its worker trains on, but the
    /// node's heartbeats stop, so the controller must fence the node.
    FreezeAgent {
        /// Executor node index.
        node: usize,
    },
    /// The checkpoint storage is full for the next `steps` steps: every checkpoint write fails
    /// part-way with "No space left on device" (the failpoint [`DISK_FULL_FAILPOINT_ENV`]).
    DiskFull {
        /// Steps until the space is back (at least 1).
        steps: u64,
    },
}

/// Environment variable naming a file whose existence makes every checkpoint part write fail
/// part-way with ENOSPC (see `checkpoint::write_part`). `lzrun local` sets it for its nodes
/// when the schedule holds a [`Fault::DiskFull`], and creates and removes the file as the
/// schedule says. A failpoint, as in FoundationDB's or TiKV's fault injection: unset, it costs
/// one environment lookup per process.
pub const DISK_FULL_FAILPOINT_ENV: &str = "LZRUN_FAILPOINT_DISK_FULL";

impl Fault {
    /// True for [`Fault::Kill`] and [`Fault::KillName`].
    pub fn is_kill(&self) -> bool {
        matches!(self, Fault::Kill { .. } | Fault::KillName { .. })
    }

    /// True for [`Fault::Join`].
    pub fn is_join(&self) -> bool {
        matches!(self, Fault::Join { .. })
    }

    /// True for the faults that take a node out of the job: kills and freezes.
    pub fn removes_node(&self) -> bool {
        self.is_kill() || matches!(self, Fault::FreezeWorker { .. } | Fault::FreezeAgent { .. })
    }

    /// A short name of the fault's kind, as `run.json` and the storm's tally use it: `kill`,
    /// `join`, `kill-controller`, `freeze-worker`, `freeze-agent`, `disk-full`.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Kill { .. } | Fault::KillName { .. } => "kill",
            Fault::Join { .. } => "join",
            Fault::KillController => "kill-controller",
            Fault::FreezeWorker { .. } => "freeze-worker",
            Fault::FreezeAgent { .. } => "freeze-agent",
            Fault::DiskFull { .. } => "disk-full",
        }
    }
}

/// A fault and the step after which it fires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultEvent {
    /// The fault fires once training has completed this (0-based) step.
    pub after_step: u64,
    /// What happens.
    pub fault: Fault,
}

/// The initial cluster and the faults of one run, sorted by `after_step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultSchedule {
    /// Number of nodes launched at the start (indices `0..initial_nodes`).
    pub initial_nodes: usize,
    /// Their names, by index: `n0, n1, …` for flag and chaos schedules, trace names for a trace.
    pub initial_names: Vec<String>,
    /// The faults, sorted by `after_step` (stable: see the [module docs](self)).
    pub events: Vec<FaultEvent>,
    /// Trace events dropped because they fire after step `steps-1` or later (0 for flags and
    /// chaos).
    pub dropped_after_end: usize,
}

impl FaultSchedule {
    /// A schedule without faults on `nodes` nodes named `n0, n1, …`.
    pub fn none(nodes: usize) -> Self {
        FaultSchedule {
            initial_nodes: nodes,
            initial_names: default_names(nodes),
            events: Vec::new(),
            dropped_after_end: 0,
        }
    }

    /// The faults that fire after step `step`, in schedule order.
    pub fn at(&self, step: u64) -> impl Iterator<Item = &Fault> {
        let start = self.events.partition_point(|e| e.after_step < step);
        self.events[start..]
            .iter()
            .take_while(move |e| e.after_step == step)
            .map(|e| &e.fault)
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True when there is no event.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Number of kills ([`Fault::Kill`] and [`Fault::KillName`]).
    pub fn kills(&self) -> usize {
        self.events.iter().filter(|e| e.fault.is_kill()).count()
    }

    /// Number of joins.
    pub fn joins(&self) -> usize {
        self.events.iter().filter(|e| e.fault.is_join()).count()
    }
}

/// Why a fault schedule could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// A `--kill` argument that is not `NODE@STEP`.
    #[error("invalid --kill '{input}': {reason} (expected NODE@STEP, e.g. 2@5)")]
    BadKill {
        /// The argument as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `--kill-controller` argument that is not `@STEP`.
    #[error("invalid --kill-controller '{input}': {reason} (expected @STEP, e.g. @5)")]
    BadKillController {
        /// The argument as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `--join` argument that is not `@STEP`.
    #[error("invalid --join '{input}': {reason} (expected @STEP, e.g. @5)")]
    BadJoin {
        /// The argument as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A run needs at least one node.
    #[error("a run needs at least one initial node, got 0")]
    NoNodes,
    /// `--time-scale` is not a finite number > 0.
    #[error("invalid --time-scale {0}: expected a finite number of trace seconds per step > 0")]
    BadTimeScale(f64),
    /// `max_nodes` of 0 leaves no node to train on.
    #[error("cannot fit a trace onto 0 nodes: max_nodes must be at least 1")]
    ZeroMaxNodes,
    /// The trace has no live node at time 0.
    #[error(
        "the trace has no live node at t=0 (its first event is at {first_event_ms} ms): the \
         initial nodes are those live when the replay starts; replay from where nodes are live \
         with --window START..END, e.g. --window {}..{}",
        format_ms(*first_event_ms),
        format_ms(window_end_ms(*last_event_ms))
    )]
    NoInitialNodes {
        /// Time of the trace's first event (0 for an empty trace).
        first_event_ms: u64,
        /// Time of the trace's last event (0 for an empty trace).
        last_event_ms: u64,
    },
    /// A kill of a node index that does not exist when the kill fires.
    #[error(
        "--kill {node}@{step}: there is no node n{node} by step {step}: the nodes launched by \
         then are {} (--kill NODE@STEP names node nNODE: --nodes N starts n0 to n<N-1>, each \
         --join the next); kill one of them, or add a --join at or before step {step}",
        name_range(*existing)
    )]
    NoSuchNode {
        /// The index.
        node: usize,
        /// The step.
        step: u64,
        /// Number of nodes launched or joined by then.
        existing: usize,
    },
    /// The same node index is killed twice.
    #[error("node n{node} is killed twice (after step {first} and again after step {second})")]
    KilledTwice {
        /// The index.
        node: usize,
        /// Step of the first kill.
        first: u64,
        /// Step of the second kill.
        second: u64,
    },
    /// A kill that leaves no live node.
    #[error("--kill {node}@{step} leaves no live node to train on")]
    NoLiveNode {
        /// The index.
        node: usize,
        /// The step.
        step: u64,
    },
    /// A kill or join at or after the last step.
    #[error(
        "{what}: fires after step {step}, but a {steps}-step run trains steps 0 to {} (counted \
         from 0) and a fault must leave a step to train after it: {}",
        steps.saturating_sub(1),
        match steps {
            0 | 1 => "such a short run has room for no fault".to_owned(),
            n => format!("the latest is after step {}", n - 2),
        }
    )]
    TooLate {
        /// The fault, as on the command line (`--kill 2@9`, `--join @9`).
        what: String,
        /// Its step.
        step: u64,
        /// Steps of the run.
        steps: u64,
    },
    /// The chaos parameters admit no schedule.
    #[error("cannot build a random fault schedule: {0}")]
    Chaos(String),
}

/// The launch names of nodes `0..count`: `n0`, `n0..n1`, `n0..n4`.
fn name_range(count: usize) -> String {
    match count {
        0 => "none".to_owned(),
        1 => "n0".to_owned(),
        n => format!("n0..n{}", n - 1),
    }
}

/// The end of a window `[first, end)` that takes in an event at `last_ms`: the next whole
/// second after it (a window is half-open).
fn window_end_ms(last_ms: u64) -> u64 {
    (last_ms / 1000 + 1).saturating_mul(1000)
}

/// Parses a `--kill` argument `NODE@STEP` (e.g. `2@5`: kill node 2 after step 5). Spaces around
/// the parts are ignored.
pub fn parse_kill(s: &str) -> Result<(usize, u64), FaultError> {
    let bad = |reason: String| FaultError::BadKill {
        input: s.to_string(),
        reason,
    };
    let (node, step) = s.split_once('@').ok_or_else(|| bad("missing '@'".into()))?;
    let node = node.trim();
    let step = step.trim();
    let node: usize = node
        .parse()
        .map_err(|e| bad(format!("node '{node}' is not a node index: {e}")))?;
    let step: u64 = step
        .parse()
        .map_err(|e| bad(format!("step '{step}' is not a step number: {e}")))?;
    Ok((node, step))
}

/// The step of an `@STEP` argument; `reason` says what is wrong with one that is not.
fn parse_at_step(s: &str) -> Result<u64, String> {
    let t = s.trim();
    // A bare number was taken as a step here while `--kill 2` was refused: both need the `@`.
    let step = t.strip_prefix('@').ok_or("missing '@'")?.trim();
    step.parse()
        .map_err(|e| format!("step '{step}' is not a step number: {e}"))
}

/// Parses a `--join` argument `@STEP` (e.g. `@5`: a node joins after step 5). Spaces around
/// the parts are ignored; the `@` is required, as in `--kill NODE@STEP`.
pub fn parse_join(s: &str) -> Result<u64, FaultError> {
    parse_at_step(s).map_err(|reason| FaultError::BadJoin {
        input: s.to_string(),
        reason,
    })
}

/// Parses a `--kill-controller` argument `@STEP` (e.g. `@5`: kill the controller after step 5);
/// the `@` is required.
pub fn parse_kill_controller(s: &str) -> Result<u64, FaultError> {
    parse_at_step(s).map_err(|reason| FaultError::BadKillController {
        input: s.to_string(),
        reason,
    })
}

impl FaultSchedule {
    /// Adds a [`Fault::KillController`] after each of `steps` (of a `total_steps`-step run),
    /// after the other events of that step. Each must leave a step to train after it
    /// ([`FaultError::TooLate`]).
    pub fn add_controller_kills(
        &mut self,
        steps: &[u64],
        total_steps: u64,
    ) -> Result<(), FaultError> {
        for &step in steps {
            if !in_range(step, total_steps) {
                return Err(FaultError::TooLate {
                    what: format!("--kill-controller @{step}"),
                    step,
                    steps: total_steps,
                });
            }
            self.events.push(FaultEvent {
                after_step: step,
                fault: Fault::KillController,
            });
        }
        // Stable: a step's node events keep their order, the controller kills come last.
        self.events
            .sort_by_key(|e| (e.after_step, e.fault == Fault::KillController));
        Ok(())
    }
}

fn default_names(nodes: usize) -> Vec<String> {
    (0..nodes).map(|i| format!("n{i}")).collect()
}

/// A fault may fire after steps `0 ..= steps-2`.
fn in_range(step: u64, steps: u64) -> bool {
    step.saturating_add(1) < steps
}

/// Builds the schedule of `--nodes`, `--kill` and `--join`.
///
/// `nodes` initial nodes named `n0 … n{nodes-1}`; `kills` are `(index, step)` pairs (see
/// [`parse_kill`]), `joins` steps (see [`parse_join`]); joins are unnamed. The events are
/// sorted by step; within a step joins come first, then kills, each in the order given.
///
/// Validation: at least one node ([`FaultError::NoNodes`]); every step `< steps-1`
/// ([`FaultError::TooLate`]); a kill names an index below the number of nodes that exist by
/// then, i.e. `nodes` plus the joins at or before its step ([`FaultError::NoSuchNode`]); no
/// index is killed twice ([`FaultError::KilledTwice`]); no kill leaves zero live nodes
/// ([`FaultError::NoLiveNode`]).
pub fn schedule_from_flags(
    nodes: usize,
    kills: &[(usize, u64)],
    joins: &[u64],
    steps: u64,
) -> Result<FaultSchedule, FaultError> {
    if nodes == 0 {
        return Err(FaultError::NoNodes);
    }
    // Report range errors in command-line order: kills, then joins.
    for &(node, step) in kills {
        if !in_range(step, steps) {
            return Err(FaultError::TooLate {
                what: format!("--kill {node}@{step}"),
                step,
                steps,
            });
        }
    }
    for &step in joins {
        if !in_range(step, steps) {
            return Err(FaultError::TooLate {
                what: format!("--join @{step}"),
                step,
                steps,
            });
        }
    }
    let mut events: Vec<FaultEvent> = joins
        .iter()
        .map(|&step| FaultEvent {
            after_step: step,
            fault: Fault::Join { name: None },
        })
        .chain(kills.iter().map(|&(node, step)| FaultEvent {
            after_step: step,
            fault: Fault::Kill { node },
        }))
        .collect();
    // Stable: joins before kills within a step, each in the order given.
    events.sort_by_key(|e| (e.after_step, e.fault.is_kill()));

    let mut existing = nodes;
    let mut live = nodes;
    let mut killed_at: HashMap<usize, u64> = HashMap::new();
    for e in &events {
        match e.fault {
            Fault::Join { .. } => {
                existing += 1;
                live += 1;
            }
            Fault::Kill { node } => {
                let step = e.after_step;
                if let Some(&first) = killed_at.get(&node) {
                    return Err(FaultError::KilledTwice {
                        node,
                        first,
                        second: step,
                    });
                }
                if node >= existing {
                    return Err(FaultError::NoSuchNode {
                        node,
                        step,
                        existing,
                    });
                }
                killed_at.insert(node, step);
                live -= 1;
                if live == 0 {
                    return Err(FaultError::NoLiveNode { node, step });
                }
            }
            _ => unreachable!("flag schedules hold kills by index and joins only"),
        }
    }
    Ok(FaultSchedule {
        initial_nodes: nodes,
        initial_names: default_names(nodes),
        events,
        dropped_after_end: 0,
    })
}

/// The step after which an event at `t_ms` fires: `floor(t_ms / ms_per_step)`, with quotients
/// within a relative 1e-9 of an integer rounded to it.
fn step_of(t_ms: u64, ms_per_step: f64) -> u64 {
    let q = t_ms as f64 / ms_per_step;
    let r = q.round();
    let k = if (q - r).abs() <= 1e-9 * r.max(1.0) {
        r
    } else {
        q.floor()
    };
    // `as` saturates: an overflowing quotient lands past the end and is dropped.
    k as u64
}

/// Builds the schedule of `--fault-trace FILE --time-scale X` from a loaded trace; see the
/// [module docs](self) for the semantics. `time_scale_s_per_step` is `X` (trace seconds per
/// training step); `max_nodes` fits the trace with `map` first (`--map`, see [`FitMode`]; it
/// always clamped before, while `lzsim replay` tracks by default).
pub fn schedule_from_trace(
    trace: &Trace,
    time_scale_s_per_step: f64,
    steps: u64,
    max_nodes: Option<usize>,
    map: FitMode,
) -> Result<FaultSchedule, FaultError> {
    let x = time_scale_s_per_step;
    if !(x.is_finite() && x > 0.0) {
        return Err(FaultError::BadTimeScale(x));
    }
    let fitted;
    let trace = match max_nodes {
        Some(0) => return Err(FaultError::ZeroMaxNodes),
        Some(m) => {
            fitted = trace.fit(m, map);
            &fitted
        }
        None => trace,
    };
    let initial_names = trace.live_nodes_at(0);
    if initial_names.is_empty() {
        return Err(FaultError::NoInitialNodes {
            first_event_ms: trace.events().first().map_or(0, |e| e.time_ms),
            last_event_ms: trace.events().last().map_or(0, |e| e.time_ms),
        });
    }
    let ms_per_step = 1000.0 * x;
    let mut events = Vec::new();
    let mut dropped = 0;
    for e in trace.events().iter().filter(|e| e.time_ms > 0) {
        let after_step = step_of(e.time_ms, ms_per_step);
        if !in_range(after_step, steps) {
            dropped += 1;
            continue;
        }
        let fault = match e.op {
            NodeOp::Add => Fault::Join {
                name: Some(e.node.clone()),
            },
            NodeOp::Remove => Fault::KillName {
                name: e.node.clone(),
            },
        };
        events.push(FaultEvent { after_step, fault });
    }
    Ok(FaultSchedule {
        initial_nodes: initial_names.len(),
        initial_names,
        events,
        dropped_after_end: dropped,
    })
}

/// What [`chaos_schedule`] and [`storm_schedule`] start from: the empty schedule, the seeded
/// RNG, `faults` fault slots drawn uniformly from steps `1 ..= steps-2` and sorted (none when
/// `faults == 0`), and the live-node floor `max(min_live, 1)`.
struct RandomStart {
    schedule: FaultSchedule,
    rng: StdRng,
    slots: Vec<u64>,
    floor: usize,
}

/// Checks the parameters of a random schedule (see [`chaos_schedule`]'s errors) and draws its
/// slots.
fn random_start(
    seed: u64,
    nodes: usize,
    steps: u64,
    faults: usize,
    min_live: usize,
) -> Result<RandomStart, FaultError> {
    if nodes == 0 {
        return Err(FaultError::NoNodes);
    }
    let floor = min_live.max(1);
    if faults > 0 && steps < 3 {
        return Err(FaultError::Chaos(format!(
            "{faults} fault(s) need steps 1..=steps-2 to fire after, but the run has {steps} step(s)"
        )));
    }
    if faults > 0 && nodes <= floor {
        return Err(FaultError::Chaos(format!(
            "no node can be killed: {nodes} node(s) and at least {floor} must stay live"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut slots: Vec<u64> = (0..faults)
        .map(|_| rng.random_range(1..=steps - 2))
        .collect();
    slots.sort_unstable();
    Ok(RandomStart {
        schedule: FaultSchedule::none(nodes),
        rng,
        slots,
        floor,
    })
}

/// A seeded random schedule for chaos tests on `nodes` initial nodes (named `n0, n1, …`).
///
/// `faults` fault slots are drawn uniformly from steps `1 ..= steps-2` (so several may share a
/// step). At each slot, in step order:
/// * if a kill is possible (more than `max(min_live, 1)` nodes live) and a join is not (live
///   count back at `nodes`), a kill; if only a join is possible, a join; otherwise either, with
///   probability ½;
/// * a kill takes a uniformly random live node; with probability ¼ (when at least two nodes
///   can be spared) it is a burst that kills 2..=spare random live nodes at that same step,
///   so some schedules lose every replica of an expert at once;
/// * a join starts a new node (the next index), and only happens while fewer than `nodes`
///   are live.
///
/// So the schedule has at least `faults` events, never kills a node twice, never takes the
/// live count below `max(min_live, 1)` and never above `nodes`, and is valid input to
/// [`schedule_from_flags`]. Deterministic for a seed ([`StdRng::seed_from_u64`]).
///
/// Errors ([`FaultError::Chaos`], [`FaultError::NoNodes`]) when `faults > 0` and no schedule
/// exists: no node, fewer than 3 steps, or `nodes <= max(min_live, 1)` (nothing can be
/// killed). `faults == 0` gives an empty schedule.
pub fn chaos_schedule(
    seed: u64,
    nodes: usize,
    steps: u64,
    faults: usize,
    min_live: usize,
) -> Result<FaultSchedule, FaultError> {
    let RandomStart {
        mut schedule,
        mut rng,
        slots,
        floor,
    } = random_start(seed, nodes, steps, faults, min_live)?;
    let mut live: Vec<usize> = (0..nodes).collect();
    let mut next_index = nodes;
    for after_step in slots {
        let can_kill = live.len() > floor;
        let can_join = live.len() < nodes;
        let kill = can_kill && (!can_join || rng.random_bool(0.5));
        if kill {
            let spare = live.len() - floor;
            let count = if spare >= 2 && rng.random_ratio(1, 4) {
                rng.random_range(2..=spare)
            } else {
                1
            };
            for _ in 0..count {
                let node = live.swap_remove(rng.random_range(0..live.len()));
                schedule.events.push(FaultEvent {
                    after_step,
                    fault: Fault::Kill { node },
                });
            }
        } else {
            live.push(next_index);
            next_index += 1;
            schedule.events.push(FaultEvent {
                after_step,
                fault: Fault::Join { name: None },
            });
        }
    }
    Ok(schedule)
}

/// The kinds of fault a [`storm_schedule`] draws from, with their weights (see there).
const STORM_KINDS: [(StormKind, u32); 8] = [
    (StormKind::Kill, 4),
    (StormKind::Burst, 1),
    (StormKind::Join, 3),
    (StormKind::JoinRacingKill, 1),
    (StormKind::FreezeWorker, 1),
    (StormKind::FreezeAgent, 1),
    (StormKind::KillController, 1),
    (StormKind::DiskFull, 1),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StormKind {
    Kill,
    Burst,
    Join,
    JoinRacingKill,
    FreezeWorker,
    FreezeAgent,
    KillController,
    DiskFull,
}

/// Steps a node must have been in the schedule before a storm freezes it, so that its worker
/// process exists by then (a node that just joined may still be starting it).
const FREEZE_AFTER_JOIN_STEPS: u64 = 3;

/// A seeded storm of every kind of fault on `nodes` initial nodes (named `n0, n1, …`), for
/// `lzrun local --storm` and the storm test.
///
/// `faults` fault slots are drawn uniformly from steps `1 ..= steps-2` and sorted; at each
/// slot one kind is drawn, by weight, among those possible then (`floor = max(min_live, 1)`):
///
/// | kind | weight | possible when |
/// |---|---|---|
/// | kill one random live node | 4 | more than `floor` nodes live |
/// | burst: kill 2..=spare random live nodes at once (may take every replica of an expert: a checkpoint restore) | 1 | at least 2 nodes above `floor` |
/// | join | 3 | fewer than `nodes` live |
/// | join racing a kill: a join and a kill of another node at the same step | 1 | both of the above |
/// | freeze the worker (SIGSTOP) of a random node live for ≥ 3 steps | 1 | a kill is possible |
/// | freeze the agent of such a node | 1 | a kill is possible |
/// | kill the controller | 1 | none at this step yet |
/// | the checkpoint disk is full for 1..=4 steps | 1 | no such window open |
///
/// A frozen node counts as gone from its slot on (the controller fences it). Events are in slot
/// order (so by step; a racing join comes before its kill). So the schedule has at least
/// `faults` events, never names a node twice for removal nor one that does not exist by then,
/// keeps the live count within `floor ..= nodes`, and fires every event after steps
/// `1 ..= steps-2`. Deterministic for a seed. Errors as [`chaos_schedule`].
pub fn storm_schedule(
    seed: u64,
    nodes: usize,
    steps: u64,
    faults: usize,
    min_live: usize,
) -> Result<FaultSchedule, FaultError> {
    let RandomStart {
        mut schedule,
        mut rng,
        slots,
        floor,
    } = random_start(seed, nodes, steps, faults, min_live)?;
    // Live nodes with the step they (were scheduled to) join at; 0 for the initial ones.
    let mut live: Vec<(usize, u64)> = (0..nodes).map(|i| (i, 0)).collect();
    let mut next_index = nodes;
    let mut disk_full_until = 0u64;
    let mut controller_killed_at = None;
    let events = &mut schedule.events;
    for after_step in slots {
        let can_kill = live.len() > floor;
        let can_join = live.len() < nodes;
        let settled = |live: &[(usize, u64)]| {
            live.iter()
                .any(|&(_, joined)| joined + FREEZE_AFTER_JOIN_STEPS <= after_step)
        };
        let possible = |kind: StormKind| match kind {
            StormKind::Kill => can_kill,
            StormKind::Burst => live.len() >= floor + 2,
            StormKind::Join => can_join,
            StormKind::JoinRacingKill => can_join && can_kill,
            StormKind::FreezeWorker | StormKind::FreezeAgent => can_kill && settled(&live),
            StormKind::KillController => controller_killed_at != Some(after_step),
            StormKind::DiskFull => disk_full_until <= after_step,
        };
        let choices: Vec<(StormKind, u32)> = STORM_KINDS
            .iter()
            .copied()
            .filter(|&(k, _)| possible(k))
            .collect();
        let total: u32 = choices.iter().map(|c| c.1).sum();
        let mut pick = rng.random_range(0..total);
        let kind = choices
            .iter()
            .find(|&&(_, w)| {
                let hit = pick < w;
                pick = pick.saturating_sub(w);
                hit
            })
            .map_or(StormKind::KillController, |c| c.0);
        let mut push = |fault| events.push(FaultEvent { after_step, fault });
        let kill_random = |rng: &mut StdRng, live: &mut Vec<(usize, u64)>| {
            live.swap_remove(rng.random_range(0..live.len())).0
        };
        match kind {
            StormKind::Kill => push(Fault::Kill {
                node: kill_random(&mut rng, &mut live),
            }),
            StormKind::Burst => {
                let spare = live.len() - floor;
                let count = rng.random_range(2..=spare);
                for _ in 0..count {
                    push(Fault::Kill {
                        node: kill_random(&mut rng, &mut live),
                    });
                }
            }
            StormKind::Join | StormKind::JoinRacingKill => {
                // Joins before kills within a step (the launcher's order): the kill may not
                // take the newcomer, which `kill_random` could, so it picks before the join.
                let victim =
                    (kind == StormKind::JoinRacingKill).then(|| kill_random(&mut rng, &mut live));
                live.push((next_index, after_step));
                next_index += 1;
                push(Fault::Join { name: None });
                if let Some(node) = victim {
                    push(Fault::Kill { node });
                }
            }
            StormKind::FreezeWorker | StormKind::FreezeAgent => {
                let candidates: Vec<usize> = (0..live.len())
                    .filter(|&i| live[i].1 + FREEZE_AFTER_JOIN_STEPS <= after_step)
                    .collect();
                let node = live
                    .swap_remove(candidates[rng.random_range(0..candidates.len())])
                    .0;
                push(if kind == StormKind::FreezeWorker {
                    Fault::FreezeWorker { node }
                } else {
                    Fault::FreezeAgent { node }
                });
            }
            StormKind::KillController => {
                controller_killed_at = Some(after_step);
                push(Fault::KillController);
            }
            StormKind::DiskFull => {
                let len = rng.random_range(1..=4u64);
                disk_full_until = after_step + len;
                push(Fault::DiskFull { steps: len });
            }
        }
    }
    Ok(schedule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazarus_traces::{TraceFormat, parse};

    fn kill(after_step: u64, node: usize) -> FaultEvent {
        FaultEvent {
            after_step,
            fault: Fault::Kill { node },
        }
    }

    fn join(after_step: u64, name: Option<&str>) -> FaultEvent {
        FaultEvent {
            after_step,
            fault: Fault::Join {
                name: name.map(str::to_string),
            },
        }
    }

    fn kill_name(after_step: u64, name: &str) -> FaultEvent {
        FaultEvent {
            after_step,
            fault: Fault::KillName {
                name: name.to_string(),
            },
        }
    }

    #[test]
    fn parse_flags() {
        assert_eq!(parse_kill("2@5").unwrap(), (2, 5));
        assert_eq!(parse_kill(" 0 @ 17 ").unwrap(), (0, 17));
        assert_eq!(parse_join("@5").unwrap(), 5);
        assert_eq!(parse_join(" @ 7 ").unwrap(), 7);
        for bad in ["25", "x@5", "2@", "@5", "-1@5", "2@-3", "2@5@6", ""] {
            let err = parse_kill(bad).unwrap_err();
            assert!(matches!(err, FaultError::BadKill { .. }), "{bad:?}");
            let msg = err.to_string();
            assert!(msg.contains(&format!("'{bad}'")), "{msg}");
            assert!(msg.contains("NODE@STEP"), "{msg}");
        }
        // Issue 35 item 6: a bare step (`--join 4`) was taken while `--kill 2` was refused.
        for bad in ["@", "@x", "2@5", "@-1", "", "4", " 7 "] {
            let err = parse_join(bad).unwrap_err();
            assert!(matches!(err, FaultError::BadJoin { .. }), "{bad:?}");
            assert!(err.to_string().contains(&format!("'{bad}'")), "{err}");
            assert!(err.to_string().contains("expected @STEP"), "{err}");
        }
        let err = parse_join("4").unwrap_err().to_string();
        assert!(err.contains("missing '@'"), "{err}");
    }

    #[test]
    fn flags_schedule_sorted_joins_first() {
        let s = schedule_from_flags(3, &[(1, 6), (2, 4), (3, 4)], &[4, 2], 10).unwrap();
        assert_eq!(s.initial_nodes, 3);
        assert_eq!(s.initial_names, ["n0", "n1", "n2"]);
        assert_eq!(
            s.events,
            [
                join(2, None),
                join(4, None),
                kill(4, 2),
                kill(4, 3),
                kill(6, 1)
            ]
        );
        assert_eq!((s.len(), s.kills(), s.joins()), (5, 3, 2));
        assert_eq!(s.dropped_after_end, 0);
        let at4: Vec<_> = s.at(4).cloned().collect();
        assert_eq!(
            at4,
            [
                Fault::Join { name: None },
                Fault::Kill { node: 2 },
                Fault::Kill { node: 3 }
            ]
        );
        assert_eq!(s.at(0).count(), 0);
        assert_eq!(s.at(7).count(), 0);
        assert!(schedule_from_flags(2, &[], &[], 5).unwrap().is_empty());
    }

    #[test]
    fn flags_validation() {
        // index 3 does not exist on 3 nodes ...
        let err = schedule_from_flags(3, &[(3, 2)], &[], 10).unwrap_err();
        assert!(
            matches!(
                err,
                FaultError::NoSuchNode {
                    node: 3,
                    step: 2,
                    existing: 3
                }
            ),
            "{err}"
        );
        // Issue 35 item 6: the range in the terms --kill counts nodes in (launch names).
        let msg = err.to_string();
        assert!(msg.contains("there is no node n3 by step 2"), "{msg}");
        assert!(
            msg.contains("the nodes launched by then are n0..n2"),
            "{msg}"
        );
        assert!(!msg.contains("indices"), "{msg}");
        let one = schedule_from_flags(1, &[(5, 3)], &[], 10)
            .unwrap_err()
            .to_string();
        assert!(one.contains("launched by then are n0 ("), "{one}");
        // ... nor if the join comes later ...
        assert!(matches!(
            schedule_from_flags(3, &[(3, 2)], &[3], 10),
            Err(FaultError::NoSuchNode { .. })
        ));
        // ... but it does after a join at an earlier or the same step
        assert!(schedule_from_flags(3, &[(3, 2)], &[1], 10).is_ok());
        assert!(schedule_from_flags(3, &[(3, 2)], &[2], 10).is_ok());
        // killed twice
        assert!(matches!(
            schedule_from_flags(3, &[(1, 5), (1, 2)], &[], 10),
            Err(FaultError::KilledTwice {
                node: 1,
                first: 2,
                second: 5
            })
        ));
        // at the last step (9 of 0..=9) or later: rejected; step 8 is the last accepted
        let err = schedule_from_flags(3, &[(1, 9)], &[], 10).unwrap_err();
        assert!(
            matches!(
                err,
                FaultError::TooLate {
                    step: 9,
                    steps: 10,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("--kill 1@9"), "{err}");
        assert!(
            err.to_string().contains("10-step run trains steps 0 to 9"),
            "{err}"
        );
        assert!(
            err.to_string().contains("the latest is after step 8"),
            "{err}"
        );
        assert!(schedule_from_flags(3, &[(1, 8)], &[], 10).is_ok());
        let err = schedule_from_flags(3, &[], &[12], 10).unwrap_err();
        assert!(err.to_string().contains("--join @12"), "{err}");
        assert!(matches!(
            schedule_from_flags(3, &[(0, 0)], &[], 1),
            Err(FaultError::TooLate { .. })
        ));
        // no node left
        assert!(matches!(
            schedule_from_flags(2, &[(0, 1), (1, 3)], &[], 10),
            Err(FaultError::NoLiveNode { node: 1, step: 3 })
        ));
        // ... unless one joined before
        assert!(schedule_from_flags(1, &[(0, 3)], &[3], 10).is_ok());
        assert!(matches!(
            schedule_from_flags(0, &[], &[], 10),
            Err(FaultError::NoNodes)
        ));
    }

    const SMALL: &str = "0,add,a\n0,add,b\n0,add,c\n60000,remove,b\n120000,add,d\n";

    #[test]
    fn trace_schedule() {
        let trace = parse(SMALL, TraceFormat::BambooCsv).unwrap();
        let s = schedule_from_trace(&trace, 30.0, 10, None, FitMode::Clamp).unwrap();
        assert_eq!(s.initial_nodes, 3);
        assert_eq!(s.initial_names, ["a", "b", "c"]);
        assert_eq!(s.events, [kill_name(2, "b"), join(4, Some("d"))]);
        assert_eq!((s.kills(), s.joins(), s.dropped_after_end), (1, 1, 0));

        // a coarser scale puts both at step 0 (in trace order); a finer one past the end
        let s = schedule_from_trace(&trace, 1000.0, 10, None, FitMode::Clamp).unwrap();
        assert_eq!(s.events, [kill_name(0, "b"), join(0, Some("d"))]);
        let s = schedule_from_trace(&trace, 20.0, 6, None, FitMode::Clamp).unwrap(); // steps 3 and 6
        assert_eq!(s.events, [kill_name(3, "b")]);
        assert_eq!(s.dropped_after_end, 1);
        // step 4 is the last step of a 5-step run: dropped
        let s = schedule_from_trace(&trace, 30.0, 5, None, FitMode::Clamp).unwrap();
        assert_eq!((s.len(), s.dropped_after_end), (1, 1));
        let s = schedule_from_trace(&trace, 30.0, 0, None, FitMode::Clamp).unwrap();
        assert_eq!((s.len(), s.dropped_after_end), (0, 2));

        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                schedule_from_trace(&trace, bad, 10, None, FitMode::Clamp),
                Err(FaultError::BadTimeScale(_))
            ));
        }
        // floating-point: 3000 ms at 0.3 s/step is step 10, not 9
        let t = parse("0,add,a\n0,add,b\n3000,remove,a\n", TraceFormat::BambooCsv).unwrap();
        let s = schedule_from_trace(&t, 0.3, 100, None, FitMode::Clamp).unwrap();
        assert_eq!(s.events, [kill_name(10, "a")]);
    }

    #[test]
    fn trace_names_removed_and_readded_and_equal_times() {
        let csv = "0,add,x\n0,add,y\n0,remove,x\n0,add,z\n\
                   10000,remove,y\n10000,add,w\n25000,add,y\n25000,remove,z\n";
        let trace = parse(csv, TraceFormat::BambooCsv).unwrap();
        let s = schedule_from_trace(&trace, 10.0, 100, None, FitMode::Clamp).unwrap();
        // x was added and removed within the t=0 batch: not an initial node
        assert_eq!(s.initial_names, ["y", "z"]);
        assert_eq!(
            s.events,
            [
                join(1, Some("w")),
                kill_name(1, "y"),
                join(2, Some("y")),
                kill_name(2, "z")
            ]
        );
    }

    #[test]
    fn trace_without_initial_nodes() {
        let trace = parse("5000,add,a\n9000,add,b\n", TraceFormat::BambooCsv).unwrap();
        let err = schedule_from_trace(&trace, 1.0, 100, None, FitMode::Clamp).unwrap_err();
        assert!(
            matches!(
                err,
                FaultError::NoInitialNodes {
                    first_event_ms: 5000,
                    last_event_ms: 9000
                }
            ),
            "{err}"
        );
        // The message names the way out: a window that starts at the first event and takes
        // in the last one.
        assert!(err.to_string().contains("t=0"), "{err}");
        assert!(err.to_string().contains("--window 5s..10s"), "{err}");
        let small = parse(SMALL, TraceFormat::BambooCsv).unwrap();
        assert!(matches!(
            schedule_from_trace(&small, 1.0, 100, Some(0), FitMode::Clamp),
            Err(FaultError::ZeroMaxNodes)
        ));
    }

    #[test]
    fn trace_fitted_to_max_nodes() {
        let trace = parse(SMALL, TraceFormat::BambooCsv).unwrap();
        let s = schedule_from_trace(&trace, 30.0, 10, Some(2), FitMode::Clamp).unwrap();
        // clamp: c waits, replaces b when b is removed; d waits forever
        assert_eq!(s.initial_names, ["a", "b"]);
        assert_eq!(s.events, [join(2, Some("c")), kill_name(2, "b")]);
        // track (lzsim replay's default): a and b are the cluster, c never gets a slot; b's
        // slot goes to d, the next node added after b left
        let t = schedule_from_trace(&trace, 30.0, 10, Some(2), FitMode::Track).unwrap();
        assert_eq!(t.initial_names, ["a", "b"]);
        assert_eq!(t.events, [kill_name(2, "b"), join(4, Some("d"))]);
        // fits already: unchanged
        assert_eq!(
            schedule_from_trace(&trace, 30.0, 10, Some(3), FitMode::Clamp).unwrap(),
            schedule_from_trace(&trace, 30.0, 10, None, FitMode::Clamp).unwrap()
        );
    }

    /// Replays a schedule by index and checks every invariant; returns the minimum live count.
    fn replay(s: &FaultSchedule, steps: u64) -> usize {
        let mut live: Vec<usize> = (0..s.initial_nodes).collect();
        let mut next = s.initial_nodes;
        let mut min = live.len();
        let mut last_step = 0;
        let mut joined_at: HashMap<usize, u64> = HashMap::new();
        let mut disk_full_until = 0;
        for e in &s.events {
            assert!(e.after_step >= last_step, "unsorted");
            assert!(e.after_step >= 1 && e.after_step + 1 < steps, "{e:?}");
            last_step = e.after_step;
            match &e.fault {
                Fault::Kill { node }
                | Fault::FreezeWorker { node }
                | Fault::FreezeAgent { node } => {
                    let pos = live
                        .iter()
                        .position(|n| n == node)
                        .expect("removal of a dead node");
                    live.swap_remove(pos);
                    if !e.fault.is_kill() {
                        let joined = joined_at.get(node).copied().unwrap_or(0);
                        assert!(joined + FREEZE_AFTER_JOIN_STEPS <= e.after_step, "{e:?}");
                    }
                }
                Fault::Join { name: None } => {
                    joined_at.insert(next, e.after_step);
                    live.push(next);
                    next += 1;
                }
                Fault::KillController => {}
                Fault::DiskFull { steps } => {
                    assert!((1..=4).contains(steps) && e.after_step >= disk_full_until);
                    disk_full_until = e.after_step + steps;
                }
                other => panic!("unexpected {other:?}"),
            }
            assert!(live.len() <= s.initial_nodes);
            min = min.min(live.len());
        }
        min
    }

    #[test]
    fn controller_kills_parse_and_come_after_the_node_events_of_their_step() {
        assert_eq!(parse_kill_controller("@5").unwrap(), 5);
        assert_eq!(parse_kill_controller(" @7 ").unwrap(), 7);
        let e = parse_kill_controller("7").unwrap_err().to_string();
        assert!(
            e.contains("missing '@'") && e.contains("expected @STEP"),
            "{e}"
        );
        let e = parse_kill_controller("@x").unwrap_err().to_string();
        assert!(e.contains("--kill-controller '@x'"), "{e}");
        let mut s = schedule_from_flags(3, &[(1, 4)], &[4], 10).unwrap();
        s.add_controller_kills(&[4, 2], 10).unwrap();
        let faults: Vec<(u64, &Fault)> =
            s.events.iter().map(|e| (e.after_step, &e.fault)).collect();
        assert_eq!(
            faults,
            vec![
                (2, &Fault::KillController),
                (4, &Fault::Join { name: None }),
                (4, &Fault::Kill { node: 1 }),
                (4, &Fault::KillController),
            ]
        );
        assert!(!Fault::KillController.is_kill() && !Fault::KillController.is_join());
        let late = s.add_controller_kills(&[9], 10).unwrap_err().to_string();
        assert!(late.contains("--kill-controller @9"), "{late}");
    }

    #[test]
    fn chaos_properties() {
        let a = chaos_schedule(7, 6, 50, 12, 2).unwrap();
        assert_eq!(a, chaos_schedule(7, 6, 50, 12, 2).unwrap());
        assert_ne!(a, chaos_schedule(8, 6, 50, 12, 2).unwrap());
        let mut bursts = 0;
        for seed in 0..200 {
            for &(nodes, steps, faults, min_live) in
                &[(6, 50, 12, 2), (4, 5, 9, 0), (2, 3, 4, 1), (10, 100, 30, 3)]
            {
                let s = chaos_schedule(seed, nodes, steps, faults, min_live).unwrap();
                assert!(s.len() >= faults);
                assert_eq!(s.initial_nodes, nodes);
                assert_eq!(s.dropped_after_end, 0);
                assert!(replay(&s, steps) >= min_live.max(1));
                // valid input for the flag schedule too
                let kills: Vec<(usize, u64)> = s
                    .events
                    .iter()
                    .filter_map(|e| match e.fault {
                        Fault::Kill { node } => Some((node, e.after_step)),
                        _ => None,
                    })
                    .collect();
                let joins: Vec<u64> = s
                    .events
                    .iter()
                    .filter(|e| e.fault.is_join())
                    .map(|e| e.after_step)
                    .collect();
                let flags = schedule_from_flags(nodes, &kills, &joins, steps).unwrap();
                assert_eq!((flags.kills(), flags.joins()), (s.kills(), s.joins()));
                let mut per_step: HashMap<u64, usize> = HashMap::new();
                for (_, step) in &kills {
                    *per_step.entry(*step).or_default() += 1;
                }
                if per_step.values().any(|&n| n >= 2) {
                    bursts += 1;
                }
            }
        }
        assert!(bursts > 0, "no schedule kills two nodes at one step");
        assert!(chaos_schedule(1, 3, 10, 0, 5).unwrap().is_empty());
        assert!(matches!(
            chaos_schedule(1, 3, 2, 1, 0),
            Err(FaultError::Chaos(_))
        ));
        assert!(matches!(
            chaos_schedule(1, 3, 10, 1, 3),
            Err(FaultError::Chaos(_))
        ));
        assert!(matches!(
            chaos_schedule(1, 1, 10, 1, 0),
            Err(FaultError::Chaos(_))
        ));
        assert!(matches!(
            chaos_schedule(1, 0, 10, 1, 0),
            Err(FaultError::NoNodes)
        ));
    }

    #[test]
    fn schedule_serde_round_trip() {
        let trace = parse(SMALL, TraceFormat::BambooCsv).unwrap();
        let s = schedule_from_trace(&trace, 30.0, 10, None, FitMode::Clamp).unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<FaultSchedule>(&json).unwrap(), s);
    }

    #[test]
    fn real_p3_trace() {
        let Some(path) = lazarus_traces::shared::or_skip("bamboo/traces/p3-trace.csv") else {
            return;
        };
        let trace = lazarus_traces::load(&path).unwrap();
        let s = schedule_from_trace(&trace, 60.0, 100, Some(8), FitMode::Clamp).unwrap();
        assert!((1..=8).contains(&s.initial_nodes));
        assert_eq!(s.initial_names.len(), s.initial_nodes);
        assert!(s.events.iter().all(|e| e.after_step < 99));
        assert!(
            s.events
                .windows(2)
                .all(|w| w[0].after_step <= w[1].after_step)
        );
        // every kill names a live node; never more than 8 live once a step's events are
        // applied (a same-instant replacement lists the join before the kill)
        let mut live: std::collections::HashSet<String> = s.initial_names.iter().cloned().collect();
        for (i, e) in s.events.iter().enumerate() {
            match &e.fault {
                Fault::KillName { name } => assert!(live.remove(name), "{name}"),
                Fault::Join { name: Some(name) } => assert!(live.insert(name.clone())),
                other => panic!("unexpected {other:?}"),
            }
            let step_done = s
                .events
                .get(i + 1)
                .is_none_or(|n| n.after_step != e.after_step);
            if step_done {
                assert!(
                    live.len() <= 8,
                    "{} live after step {}",
                    live.len(),
                    e.after_step
                );
            }
        }
        assert!(s.kills() > 0 && s.joins() > 0);
        let fitted = trace.fit(8, FitMode::Clamp);
        let total = fitted.events().iter().filter(|e| e.time_ms > 0).count();
        assert_eq!(s.len() + s.dropped_after_end, total);
    }

    #[test]
    fn storm_properties() {
        let a = storm_schedule(7, 6, 150, 100, 2).unwrap();
        assert_eq!(a, storm_schedule(7, 6, 150, 100, 2).unwrap());
        assert_ne!(a, storm_schedule(8, 6, 150, 100, 2).unwrap());
        let mut kinds: HashMap<&str, usize> = HashMap::new();
        let mut racing = 0;
        for seed in 0..100 {
            for &(nodes, steps, faults, min_live) in &[
                (6, 150, 100, 2),
                (4, 5, 9, 0),
                (2, 3, 4, 1),
                (8, 1000, 1000, 2),
            ] {
                let s = storm_schedule(seed, nodes, steps, faults, min_live).unwrap();
                assert!(s.len() >= faults);
                assert_eq!((s.initial_nodes, s.dropped_after_end), (nodes, 0));
                assert!(replay(&s, steps) >= min_live.max(1));
                for e in &s.events {
                    *kinds.entry(e.fault.kind()).or_default() += 1;
                }
                racing += s
                    .events
                    .windows(2)
                    .filter(|w| {
                        w[0].after_step == w[1].after_step
                            && w[0].fault.is_join()
                            && w[1].fault.is_kill()
                    })
                    .count();
            }
        }
        for kind in [
            "kill",
            "join",
            "kill-controller",
            "freeze-worker",
            "freeze-agent",
            "disk-full",
        ] {
            assert!(
                kinds.get(kind).copied().unwrap_or(0) > 100,
                "{kind}: {kinds:?}"
            );
        }
        assert!(racing > 100, "{racing} joins racing a kill");
        assert!(storm_schedule(1, 3, 10, 0, 5).unwrap().is_empty());
        assert!(matches!(
            storm_schedule(1, 3, 10, 1, 3),
            Err(FaultError::Chaos(_))
        ));
    }
}
