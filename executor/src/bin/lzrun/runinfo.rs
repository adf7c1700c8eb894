//! `run.json`: everything `lzsim predict` needs to replay a `lzrun local --metrics-out DIR`
//! run through the simulator — the model, the nodes, the seed, the checkpoint and rebalance
//! settings, the job machine's rules, the fault schedule with its source (flags or a trace and
//! the trace's time mapping) — and when things happened, in seconds since the launch:
//!
//! | key | content |
//! |---|---|
//! | `format` | `"lzrun-run/1"` |
//! | `command`, `git_commit`, `build` | how the run was made (`build`: `debug` or `release`) |
//! | `model_spec`, `model` | the `--config` argument and the resolved model config |
//! | `expert_params`, `dense_params`, `expert_state_bytes` | sizes of that model |
//! | `nodes`, `initial_names`, `seed`, `steps` | the initial cluster and the run's length |
//! | `global_batch`, `micro_batch` | `--global-batch` B and its micro-batch M, or `null` (`--batch-per-node`: every worker trains the model's `batch`) |
//! | `fault_tolerance`, `slots_per_node` | the planner's `f` and slots per node |
//! | `checkpoint` | `{every_steps, keep}` or `null` (a fresh start also checkpoints step 0) |
//! | `rebalance_every_steps`, `timeout_ms`, `heartbeat_timeout_ms`, `wait_for_nodes_ms` | |
//! | `rules` | the job machine's configuration (`lazarus_planner::job::JobConfig`, with its `relayout` policy) |
//! | `router_skew` | `--router-skew` (0: the plain router) |
//! | `faults` | `{source: "flags" \| "trace", trace, time_scale_s_per_step, max_nodes, map, dropped_after_end, events}`: `events` are the schedule's `{after_step, fault}` (a fault fires once every worker completed step `after_step`, 0-based; a trace event at `t_ms` fires after step `⌊t_ms / (1000·time_scale_s_per_step)⌋`) |
//! | `timeline` | launch-relative seconds: `first_step_s` (when the first step record arrived: the origin of `t_s` in `steps.csv`), `injected` (every fault as it was injected: `t_s, after_step, kind, node, name, when`, and for a kill of a member `rank`, its rank in the plan in force), `reconfigurations` (when each reconfiguration record arrived, with its kind), `wall_s` |
//! | `host` | `cpus` (available parallelism) and the 1-minute load average at the end |
//!
//! Next to it, `routing.csv` ([`lazarus_executor::metrics::routing_csv`]) records every step
//! record's routed tokens per MoE layer and expert (summed over the workers): the routing
//! history the job machine planned from, which `lzsim predict` replays into its own job
//! machine so both plan alike. Node ids do not enter the plans: the controller numbers nodes
//! as they register, and the plans follow the nodes' names (`lazarus_planner::job`).

use std::path::Path;

use anyhow::{Context, Result};
use lazarus_executor::control::JobParams;
use lazarus_executor::faults::FaultSchedule;
use serde::Serialize;
use serde_json::json;

use crate::args::LocalArgs;
use crate::report::Report;

/// One injected fault, for `run.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Injection {
    /// Seconds since the launch.
    pub t_s: f64,
    /// The step the schedule fired it after.
    pub after_step: u64,
    /// [`lazarus_executor::faults::Fault::kind`]: `kill`, `join`, `freeze-worker`, …
    pub kind: &'static str,
    /// The node's launch index (none for a controller kill or a full disk).
    pub node: Option<usize>,
    /// The node's name (empty for a controller kill or a full disk).
    pub name: String,
    /// `after step S`, or `early (…)` for a join started while the job waited for nodes.
    pub when: String,
    /// A kill: the rank the node held in the plan in force when it was killed (absent: it
    /// was not a member, or a join).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
}

impl Injection {
    pub fn new(
        t_s: f64,
        after_step: u64,
        kind: &'static str,
        node: Option<usize>,
        name: &str,
        when: &str,
    ) -> Self {
        Self {
            t_s,
            after_step,
            kind,
            node,
            name: name.to_owned(),
            when: when.to_owned(),
            rank: None,
        }
    }

    /// The same, with the killed node's rank.
    pub fn with_rank(mut self, rank: Option<usize>) -> Self {
        self.rank = rank;
        self
    }
}

/// What `run.json` is made of.
pub struct RunInfo<'a> {
    pub args: &'a LocalArgs,
    pub params: &'a JobParams,
    pub schedule: &'a FaultSchedule,
    pub injected: &'a [Injection],
    pub report: &'a Report,
}

/// The 1-minute load average, if the system tells it.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The CPUs this process may use.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `run.json`'s content (see the module docs).
pub fn to_json(info: &RunInfo) -> serde_json::Value {
    let a = info.args;
    let p = info.params;
    let cfg = &p.config;
    let (first_step_s, arrivals) = info.report.arrivals();
    let source = if a.fault_trace.is_some() {
        "trace"
    } else {
        "flags"
    };
    json!({
        "format": "lzrun-run/1",
        "command": std::env::args().collect::<Vec<_>>(),
        "git_commit": info.report.git_commit(),
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "model_spec": a.job.model.config,
        "model": cfg,
        "expert_params": cfg.expert_params(),
        "dense_params": cfg.dense_params(),
        "expert_state_bytes": cfg.expert_state_bytes(),
        "nodes": info.schedule.initial_nodes,
        "initial_names": info.schedule.initial_names,
        "seed": cfg.seed,
        "steps": a.job.model.steps,
        "global_batch": p.rules.global_batch.map(|g| g.sequences),
        "micro_batch": p.rules.global_batch.map(|g| g.micro),
        "fault_tolerance": a.job.fault_tolerance,
        "slots_per_node": p.rules.slots_per_node,
        "checkpoint": p.checkpoint.as_ref().map(|c| json!({
            "every_steps": c.every_steps,
            "keep": p.checkpoint_keep,
        })),
        "rebalance_every_steps": a.job.rebalance_every,
        "timeout_ms": a.job.timeout_ms,
        "heartbeat_timeout_ms": a.job.heartbeat_timeout_ms,
        "wait_for_nodes_ms": a.job.wait_for_nodes_ms,
        "rules": p.rules,
        "router_skew": p.router_skew,
        "faults": {
            "source": source,
            "trace": a.fault_trace.as_ref().map(|t| t.display().to_string()),
            "time_scale_s_per_step": a.fault_trace.as_ref().map(|_| a.time_scale),
            "max_nodes": if a.fault_trace.is_some() { a.nodes } else { None },
            "map": if a.fault_trace.is_some() { Some(a.map.as_str()) } else { None },
            "dropped_after_end": info.schedule.dropped_after_end,
            "events": info.schedule.events,
        },
        "timeline": {
            "first_step_s": first_step_s,
            "injected": info.injected,
            "reconfigurations": arrivals
                .iter()
                .map(|(t, kind)| json!({"t_s": t, "kind": kind}))
                .collect::<Vec<_>>(),
            "wall_s": info.report.started().elapsed().as_secs_f64(),
        },
        "host": {
            "cpus": cpus(),
            "load_average_1m": load_average(),
        },
    })
}

/// Writes `DIR/run.json` (through a temporary file and a rename).
pub fn write(dir: &Path, info: &RunInfo) -> Result<()> {
    let path = dir.join("run.json");
    let tmp = dir.join("run.json.tmp");
    let mut bytes = serde_json::to_vec_pretty(&to_json(info))?;
    bytes.push(b'\n');
    std::fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
