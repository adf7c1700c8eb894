//! `lzsim replay`: the discrete-event simulator of MoE training under node failures.
//!
//! [`run`] replays one system on one trace; [`output`] writes run directories. Systems live in
//! [`systems`], the engine in [`engine`], the cost model in [`crate::cost`].

pub mod engine;
pub mod output;
pub mod plot;
pub mod systems;

use crate::cost::{HardwareProfile, ModelProfile};
use crate::workload::Workload;
pub use lazarus_planner::job::RecoveryPolicy;
use lazarus_traces::Trace;
use serde::Serialize;
use systems::SystemKind;

/// Everything a run depends on besides the trace and the workload.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayConfig {
    pub hardware: HardwareProfile,
    pub model: ModelProfile,
    /// Synchronous checkpoint every K steps (`None`: never).
    pub checkpoint_every_steps: Option<u64>,
    /// Lazarus rebalance period (paper: 200 steps); `None` for the baselines.
    pub rebalance_every_steps: Option<u64>,
    /// Steps of routing history a (re)plan aggregates (sum window).
    pub load_window_steps: u64,
    /// Lazy scale-out: wait this long after a node becomes ready (paper: 2 min).
    pub scale_out_wait_s: f64,
    /// Boot time of a node added after time 0 (Bamboo: 45 s).
    pub node_boot_s: f64,
    /// Stop time; `None`: the trace's last event.
    pub end_ms: Option<u64>,
    /// Time-series sampling period (0: none).
    pub sample_every_s: f64,
    /// Node events tied to training progress instead of time (`lzrun local`'s fault schedule:
    /// `--kill N@S`, `--join @S`), sorted by `after_step`; empty for trace replays.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_events: Vec<StepEvent>,
    /// Stop once this many steps are counted (`lzrun`'s `--steps`); `None`: run to the end time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_after_steps: Option<u64>,
    /// `lazarus`: a pause the job machine asks for (a join, a rebalance) takes effect this many
    /// steps after the next step boundary instead of at it. `lzrun`'s workers read a pause
    /// request when a step starts and vote on it in that step's last collective, so a request
    /// that arrives during a step stops the members after the following one: 1 for `lzsim
    /// predict`, 0 (the paper's model) otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pause_lag_steps: u64,
    /// `lazarus`: how an in-place recovery re-lays the experts (issue 42). Written only when
    /// it is not the paper's replan, so a replan run's config.json is what it was before.
    #[serde(default, skip_serializing_if = "is_replan")]
    pub recovery: RecoveryPolicy,
}

fn is_replan(r: &RecoveryPolicy) -> bool {
    *r == RecoveryPolicy::Replan
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// A node event that fires once training has completed step `after_step` (0-based) for the
/// first time, as `lzrun local` injects its faults: at that step boundary, a `Remove` kills the
/// node while whatever starts there runs (the next step, or a checkpoint), an `Add` starts a
/// node that is ready `node_boot_s` later. While the job waits for nodes (no step can
/// complete), the next pending additions fire at once, as `lzrun local` starts its next joins
/// early. A name may come back after its removal: each addition is a new node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepEvent {
    pub after_step: u64,
    pub op: lazarus_traces::NodeOp,
    pub node: String,
}

/// Seconds spent in each activity; they add up to the run's duration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TimeBreakdownSeconds {
    /// Steps that completed and still count (not rolled back).
    pub compute: f64,
    /// Discarded work: in-flight steps cut by a failure, steps rolled back to a checkpoint.
    pub lost: f64,
    pub checkpoint: f64,
    /// Failure detection + restart + checkpoint load (and DS's scale-out restarts).
    pub restart: f64,
    /// Failure detection + in-place reconfiguration (rebuild + migration), scale-out included.
    pub reconfigure: f64,
    pub rebalance: f64,
    /// Not enough nodes to run.
    pub idle: f64,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct TimeBreakdown {
    pub compute_ns: u64,
    pub lost_ns: u64,
    pub checkpoint_ns: u64,
    pub restart_ns: u64,
    pub reconfigure_ns: u64,
    pub rebalance_ns: u64,
    pub idle_ns: u64,
}

impl TimeBreakdown {
    pub fn to_seconds(self) -> TimeBreakdownSeconds {
        let s = |x: u64| x as f64 / 1e9;
        TimeBreakdownSeconds {
            compute: s(self.compute_ns),
            lost: s(self.lost_ns),
            checkpoint: s(self.checkpoint_ns),
            restart: s(self.restart_ns),
            reconfigure: s(self.reconfigure_ns),
            rebalance: s(self.rebalance_ns),
            idle: s(self.idle_ns),
        }
    }
}

/// `summary.json` of one system's run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub system: SystemKind,
    pub samples: u64,
    pub steps: u64,
    /// Effective training time ratio: compute that counts / wall time.
    pub ettr: f64,
    pub samples_per_s: f64,
    pub duration_s: f64,
    /// In-place recoveries after failures.
    pub recoveries: u64,
    /// Restarts from a checkpoint after failures.
    pub fallbacks: u64,
    /// Node removals in the trace (processed before the end).
    pub preemptions: u64,
    /// Of those, removals of nodes the job was using.
    pub preemptions_in_use: u64,
    pub checkpoints: u64,
    pub rebalances: u64,
    pub scale_outs: u64,
    pub migrated_replicas: u64,
    pub migrated_bytes: u64,
    pub avg_live_nodes: f64,
    pub avg_used_nodes: f64,
    pub time: TimeBreakdownSeconds,
}

impl Summary {
    pub fn new(system: SystemKind) -> Self {
        Self {
            system,
            samples: 0,
            steps: 0,
            ettr: 0.0,
            samples_per_s: 0.0,
            duration_s: 0.0,
            recoveries: 0,
            fallbacks: 0,
            preemptions: 0,
            preemptions_in_use: 0,
            checkpoints: 0,
            rebalances: 0,
            scale_outs: 0,
            migrated_replicas: 0,
            migrated_bytes: 0,
            avg_live_nodes: 0.0,
            avg_used_nodes: 0.0,
            time: TimeBreakdownSeconds::default(),
        }
    }
}

/// One row of `timeseries.csv`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub live_nodes: usize,
    pub used_nodes: usize,
    pub state: String,
    pub steps: u64,
    pub samples: u64,
    pub throughput_samples_per_s: f64,
}

/// One line of `events.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventRecord {
    pub t_s: f64,
    pub kind: String,
    pub step: u64,
    pub detail: serde_json::Value,
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub summary: Summary,
    pub timeseries: Vec<Sample>,
    pub events: Vec<EventRecord>,
}

/// Step costs shared across runs on the same profiles and workload (a sweep): keyed by the
/// layout's content and the load epoch.
pub type StepCache = std::sync::Mutex<std::collections::HashMap<u64, (u64, u64, u32)>>;

/// Why a replay stopped before its end.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReplayError {
    /// The run needed more than [`engine::MAX_EVENTS`] events: its steps are so short, or its
    /// checkpoints, rebalances and load changes so frequent, that it would run for hours.
    #[error(
        "{} stopped after {events} events at {reached_s:.0} s of {end_s:.0} s simulated: the \
         step cadence is too fine for a run this long; shorten it (--end, --window, --duration) \
         or coarsen the cadence (--ckpt-every, --rebalance-every, --drift-every)",
        system.name()
    )]
    TooManyEvents {
        system: SystemKind,
        events: u64,
        reached_s: f64,
        end_s: f64,
    },
}

/// Replays `system` on `trace`. `record` keeps the time series and event log (off in sweeps);
/// `cache` shares step costs between runs with the same configuration and workload.
pub fn run(
    cfg: &ReplayConfig,
    system: SystemKind,
    trace: &Trace,
    workload: &Workload,
    record: bool,
    cache: Option<&StepCache>,
) -> Result<RunResult, ReplayError> {
    engine::Engine::new(cfg, system, trace, workload, record, cache).run()
}

/// Young/Daly optimal checkpoint interval `τ* = √(2·δ·M)` (Young 1974, Daly 2006), in steps of
/// the system's initial layout: `δ` is the checkpoint save time and `M` the job's mean time
/// between failures, estimated as the trace's duration over its number of distinct removal
/// instants (any preemption is assumed to hit the job — exact for systems using every node,
/// conservative otherwise). A trace without removals gets no checkpoints beyond one per
/// 10⁶ steps.
pub fn young_daly_steps(
    cfg: &ReplayConfig,
    system: SystemKind,
    trace: &Trace,
    workload: &Workload,
) -> u64 {
    use lazarus_traces::NodeOp;
    let mut instants: Vec<u64> = trace
        .events()
        .iter()
        .filter(|e| e.op == NodeOp::Remove)
        .map(|e| e.time_ms)
        .collect();
    instants.dedup();
    let duration_ms = cfg
        .end_ms
        .unwrap_or_else(|| trace.events().last().map_or(0, |e| e.time_ms));
    if instants.is_empty() || duration_ms == 0 {
        return 1_000_000;
    }
    let mtbf_s = duration_ms as f64 / 1e3 / instants.len() as f64;
    let initial = trace
        .events()
        .iter()
        .take_while(|e| e.time_ms == 0)
        .filter(|e| e.op == NodeOp::Add)
        .count()
        .max(1);
    let ready: Vec<systems::NodeId> = (0..initial as systems::NodeId).collect();
    let ctx = systems::Ctx {
        hw: &cfg.hardware,
        model: &cfg.model,
    };
    let loads = workload.loads(0);
    let Some(layout) = system.build().start(&ctx, &ready, &loads) else {
        return 1_000_000;
    };
    let step_s = systems::fsep::layout_step_cost(&cfg.hardware, &cfg.model, &layout, &loads)
        .map_or(1.0, |(c, _)| c.total_s);
    let delta =
        crate::cost::checkpoint_save_s(&cfg.hardware, &cfg.model, layout.gpus(&cfg.hardware));
    let tau = (2.0 * delta * mtbf_s).sqrt();
    ((tau / step_s).round() as u64).max(1)
}

/// Routing history the planner sees at `step`: the per-step loads of the last `window` steps
/// (`step − window, step]`, summed — a sliding-window aggregation, evaluated per load epoch.
pub fn window_loads(workload: &Workload, step: u64, window: u64) -> Vec<Vec<u64>> {
    // Saturating: `lzsim reconfig --step` takes any u64.
    let end = step.saturating_add(1);
    let mut x = end.saturating_sub(window.max(1));
    let mut sum: Vec<Vec<u64>> = Vec::new();
    while x < end {
        // A change point at or before `x` (never from a sound workload) ends the walk
        // rather than restarting it.
        let next = workload
            .next_change(x)
            .map_or(end, |c| c.min(end))
            .max(x + 1);
        let weight = next - x;
        let loads = workload.loads(x);
        if sum.is_empty() {
            sum = vec![Vec::new(); loads.len()];
            for (s, l) in sum.iter_mut().zip(&loads) {
                *s = vec![0; l.len()];
            }
        }
        for (s, l) in sum.iter_mut().zip(&loads) {
            for (a, b) in s.iter_mut().zip(l) {
                *a = a.saturating_add(b.saturating_mul(weight));
            }
        }
        x = next;
    }
    sum
}
