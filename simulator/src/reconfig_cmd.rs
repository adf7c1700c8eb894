//! `lzsim reconfig`: the cost of one in-place reconfiguration (paper Table 2) — how many expert
//! states move and how long it takes when `k` nodes of a Lazarus cluster fail at once,
//! averaged over every failure set (or a seeded sample of them).

use crate::cost;
use crate::limits::{
    self, MAX_EXPERTS, MAX_F, MAX_GPUS_PER_NODE, MAX_LAYERS, MAX_NODES, MAX_REPLICA_SLOTS,
    MAX_SLOTS_PER_NODE,
};
use crate::replay::systems::lazarus::Lazarus;
use crate::replay::systems::{Ctx, Decision, NodeId, System};
use crate::replay::window_loads;
use crate::replay_cmd::{Setup, SimArgs};
use anyhow::{Result, bail};
use clap::Args;
use lazarus_planner::migrate::{MappingMethod, PhysicalNode, lost_experts};
use lazarus_planner::{
    Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, ReplanOptions, plan_model, replan,
};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct ReconfigArgs {
    /// Nodes before the failure, at most 1048576.
    #[arg(long, default_value_t = 10, value_parser = limits::count(MAX_NODES))]
    pub nodes: usize,
    /// Nodes failing at once (fewer than --nodes).
    #[arg(long, default_value_t = 2, value_parser = limits::count(MAX_NODES))]
    pub fail: usize,
    /// Training step whose routing history (the preceding rebalance window) drives the plan,
    /// at most 1000000000000. Not in cluster-shape mode (its loads do not change with the
    /// step).
    #[arg(long, default_value_t = 200, conflicts_with_all = SHAPE_FLAGS)]
    pub step: u64,
    /// Failure sets to evaluate: all of them when there are at most this many, else a seeded
    /// sample of this size.
    #[arg(long, default_value_t = 5000)]
    pub max_sets: usize,
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
    /// Cluster-shape mode (frontier scale): GPUs per node. Giving any of `--gpus-per-node`,
    /// `--slots`, `--experts`, `--layers` plans that shape directly with the planner (Zipf loads
    /// from `--zipf`/`--seed`), fails `--fail` seeded nodes once and times the replan.
    /// 1..=256 (default 8).
    #[arg(long, value_parser = limits::count(MAX_GPUS_PER_NODE))]
    pub gpus_per_node: Option<usize>,
    /// Cluster-shape mode: expert slots per node (`c`, all GPUs together), 1..=4096 (default
    /// 32). Also nodes x slots x layers <= 67108864 replica slots (about 1.6 GB of plan).
    #[arg(long, value_parser = limits::count(MAX_SLOTS_PER_NODE))]
    pub slots: Option<usize>,
    /// Cluster-shape mode: experts per MoE layer, 1..=65536 (default 256).
    #[arg(long, value_parser = limits::count(MAX_EXPERTS))]
    pub experts: Option<usize>,
    /// Cluster-shape mode: MoE layers, 1..=1024 (default 58).
    #[arg(long, value_parser = limits::count(MAX_LAYERS))]
    pub layers: Option<usize>,
    #[command(flatten)]
    pub sim: ReconfigSimArgs,
}

/// The flags that select cluster-shape mode.
const SHAPE_FLAGS: [&str; 4] = ["gpus_per_node", "slots", "experts", "layers"];

/// The options of `lzsim replay` that one reconfiguration depends on. The others (`--system`:
/// this is Lazarus's; `--ckpt-every`, `--scale-out-wait`, `--boot`, `--sample-every`: a replay
/// over time) were listed here and silently ignored; now they are usage errors.
#[derive(Args, Debug, Clone)]
pub struct ReconfigSimArgs {
    /// Model profile: gpt-s, gpt-m, gpt-l, deepseek-v3, or a TOML file (in cluster-shape mode,
    /// only its bytes per expert state).
    #[arg(long, default_value = "gpt-l")]
    pub model: String,
    /// Hardware profile: rtx3090-100g, h200-400g, or a TOML file.
    #[arg(long, default_value = "rtx3090-100g")]
    pub hardware: String,
    /// Expert loads from a SmartMoE gate trace (global_expert_counts.csv); default: Zipf. Not
    /// in cluster-shape mode.
    #[arg(long, conflicts_with_all = SHAPE_FLAGS)]
    pub loads_trace: Option<PathBuf>,
    /// Zipf exponent of synthetic loads (not with --loads-trace).
    #[arg(long, default_value_t = 1.2, conflicts_with = "loads_trace")]
    pub zipf: f64,
    /// Synthetic loads drift (hot experts change) every this many steps (not with
    /// --loads-trace, nor in cluster-shape mode).
    #[arg(long, default_value_t = 500, conflicts_with_all = SHAPE_FLAGS, conflicts_with = "loads_trace")]
    pub drift_every: u64,
    /// Lazarus fault-tolerance threshold (default: the model profile's; 2 in cluster-shape
    /// mode), 1..=1024.
    #[arg(long, value_parser = limits::count(MAX_F))]
    pub f: Option<usize>,
    /// Lazarus rebalance period in steps: the routing window before --step that drives the
    /// plan. Not in cluster-shape mode.
    #[arg(long, default_value_t = 200, conflicts_with_all = SHAPE_FLAGS)]
    pub rebalance_every: u64,
    /// Seed (synthetic loads, the sample of failure sets, the failed nodes in cluster-shape
    /// mode).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl ReconfigSimArgs {
    /// The replay options these stand for (the others at values no reconfiguration reads).
    fn sim(&self) -> SimArgs {
        SimArgs {
            system: "lazarus".into(),
            model: self.model.clone(),
            hardware: self.hardware.clone(),
            loads_trace: self.loads_trace.clone(),
            zipf: self.zipf,
            drift_every: self.drift_every,
            f: self.f,
            ckpt_every: "none".into(),
            rebalance_every: self.rebalance_every,
            recovery: "replan".into(),
            scale_out_wait: "2m".into(),
            boot: None,
            sample_every: None,
            seed: self.seed,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct ReconfigReport {
    pub model: String,
    pub nodes: usize,
    pub failed: usize,
    pub step: u64,
    pub failure_sets: usize,
    /// Failure sets where some expert lost every replica (checkpoint fallback).
    pub unrecoverable: usize,
    pub replicas_mean: f64,
    pub replicas_min: u64,
    pub replicas_max: u64,
    pub transfer_s_mean: f64,
    /// Detection timeout + communicator rebuild + transfer.
    pub reconfig_s_mean: f64,
    /// Wall time of the planner's replan (allocation + placement + mapping), mean per failure
    /// set.
    pub replan_ms: f64,
    /// Cluster-shape mode: wall time of the first whole-model plan (allocation + MRO of every
    /// layer, `plan_model`) before the failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan_ms: Option<f64>,
}

fn subsets(n: usize, k: usize) -> Vec<Vec<NodeId>> {
    fn rec(start: usize, n: usize, k: usize, cur: &mut Vec<NodeId>, out: &mut Vec<Vec<NodeId>>) {
        if cur.len() == k {
            out.push(cur.clone());
            return;
        }
        for x in start..n {
            if n - x < k - cur.len() {
                break;
            }
            cur.push(x as NodeId);
            rec(x + 1, n, k, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    rec(0, n, k, &mut Vec::new(), &mut out);
    out
}

pub fn report(a: &ReconfigArgs) -> Result<ReconfigReport> {
    if a.nodes == 0 || a.fail == 0 || a.fail >= a.nodes {
        bail!(
            "need 0 < --fail < --nodes (got --fail {} --nodes {})",
            a.fail,
            a.nodes
        );
    }
    if a.step > limits::MAX_STEP {
        bail!(
            "--step {} is more than the limit of {} steps",
            a.step,
            limits::MAX_STEP
        );
    }
    if a.gpus_per_node.is_some() || a.slots.is_some() || a.experts.is_some() || a.layers.is_some() {
        return shape_report(a);
    }
    if lazarus_planner::recovery::binomial(a.nodes, a.fail) > 5e7 {
        bail!(
            "C({}, {}) failure sets are too many to list",
            a.nodes,
            a.fail
        );
    }
    let setup = Setup::new(&a.sim.sim())?;
    let cfg = &setup.base;
    let ctx = Ctx {
        hw: &cfg.hardware,
        model: &cfg.model,
    };
    let loads = window_loads(&setup.workload, a.step, cfg.load_window_steps);
    let ready: Vec<NodeId> = (0..a.nodes as NodeId).collect();
    let mut system = Lazarus;
    let Some(layout) = system.start(&ctx, &ready, &loads) else {
        bail!("{} nodes cannot hold the model's experts", a.nodes);
    };
    let mut sets = subsets(a.nodes, a.fail);
    if sets.len() > a.max_sets {
        sets.shuffle(&mut Xoshiro256PlusPlus::seed_from_u64(a.sim.seed));
        sets.truncate(a.max_sets);
    }
    let (mut unrecoverable, mut reps, mut secs) = (0usize, Vec::new(), Vec::new());
    let started = Instant::now();
    for dead in &sets {
        let alive: Vec<NodeId> = ready
            .iter()
            .copied()
            .filter(|n| !dead.contains(n))
            .collect();
        match system.on_failure(&ctx, &layout, dead, &alive, &loads) {
            Decision::Reconfigure { migration, .. } => {
                reps.push(migration.replicas);
                secs.push(cost::migration_s(
                    &cfg.hardware,
                    migration.max_sent_bytes,
                    migration.max_recv_bytes,
                    false,
                ));
            }
            _ => unrecoverable += 1,
        }
    }
    let replan_ms = started.elapsed().as_secs_f64() * 1e3 / sets.len().max(1) as f64;
    let n = reps.len().max(1) as f64;
    let transfer = secs.iter().sum::<f64>() / n;
    Ok(ReconfigReport {
        model: cfg.model.name.clone(),
        nodes: a.nodes,
        failed: a.fail,
        step: a.step,
        failure_sets: sets.len(),
        unrecoverable,
        replicas_mean: reps.iter().sum::<u64>() as f64 / n,
        replicas_min: reps.iter().copied().min().unwrap_or(0),
        replicas_max: reps.iter().copied().max().unwrap_or(0),
        transfer_s_mean: transfer,
        reconfig_s_mean: cost::reconfigure_s(&cfg.hardware) + transfer,
        replan_ms,
        plan_ms: None,
    })
}

/// Cluster-shape mode: plan the given shape directly, fail `--fail` seeded nodes, time the
/// replan with the planner's scalable mapping.
fn shape_report(a: &ReconfigArgs) -> Result<ReconfigReport> {
    let gpus = a.gpus_per_node.unwrap_or(8);
    let slots = a.slots.unwrap_or(32);
    let experts = a.experts.unwrap_or(256);
    let layers = a.layers.unwrap_or(58);
    if !a.sim.zipf.is_finite() || a.sim.zipf < 0.0 {
        bail!("--zipf must be a finite number >= 0 (got {})", a.sim.zipf);
    }
    let f = a.sim.f.unwrap_or(2);
    limits::check_product(
        &[
            ("--nodes", a.nodes),
            ("--slots", slots),
            ("--layers", layers),
        ],
        MAX_REPLICA_SLOTS,
        "replica slots",
        "",
    )?;
    let survivors_slots = (a.nodes - a.fail) * slots;
    if survivors_slots < experts * f {
        bail!(
            "{} surviving nodes x {slots} slots cannot hold {experts} experts x f = {f}",
            a.nodes - a.fail
        );
    }
    let setup = Setup::new(&a.sim.sim())?;
    let hw = &setup.base.hardware;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(a.sim.seed);
    let loads: Vec<Vec<u64>> = (0..layers)
        .map(|_| {
            let mut perm: Vec<usize> = (0..experts).collect();
            perm.shuffle(&mut rng);
            let mut row = vec![0u64; experts];
            for (rank, &e) in perm.iter().enumerate() {
                row[e] = (1e6 / ((rank + 1) as f64).powf(a.sim.zipf)) as u64 + 1;
            }
            row
        })
        .collect();
    let model = ModelSpec { experts, layers, f };
    let plan_started = Instant::now();
    let plan = plan_model(
        &ClusterSpec::new(a.nodes, slots).with_gpus_per_node(gpus),
        &model,
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )?;
    let plan_ms = plan_started.elapsed().as_secs_f64() * 1e3;
    let mut ids: Vec<u32> = (0..a.nodes as u32).collect();
    ids.shuffle(&mut rng);
    let dead: Vec<u32> = ids[..a.fail].to_vec();
    let survivors: Vec<PhysicalNode> = plan
        .physical_nodes()
        .into_iter()
        .filter(|n| !dead.contains(&n.id))
        .collect();
    drop(plan);
    let lost = !lost_experts(&survivors, layers, experts).is_empty();
    let options = ReplanOptions {
        alloc: AllocPolicy::Lazarus,
        place: PlacePolicy::Mro,
        mapping: MappingMethod::Scalable,
        bytes_per_expert: setup.base.model.bytes_per_expert_state,
    };
    let started = Instant::now();
    let result = if lost {
        None
    } else {
        Some(replan(&survivors, slots, &model, &loads, &options, 0)?)
    };
    let replan_ms = started.elapsed().as_secs_f64() * 1e3;
    let (reps, transfer) = match &result {
        Some((_, m)) => (
            m.new_replicas,
            cost::migration_s(hw, m.max_sent_bytes, m.max_recv_bytes, false),
        ),
        None => (0, 0.0),
    };
    Ok(ReconfigReport {
        model: format!("custom E={experts} L={layers}"),
        nodes: a.nodes,
        failed: a.fail,
        step: a.step,
        failure_sets: 1,
        unrecoverable: usize::from(lost),
        replicas_mean: reps as f64,
        replicas_min: reps,
        replicas_max: reps,
        transfer_s_mean: transfer,
        reconfig_s_mean: cost::reconfigure_s(hw) + transfer,
        replan_ms,
        plan_ms: Some(plan_ms),
    })
}

pub fn run(a: &ReconfigArgs) -> Result<()> {
    let r = report(a)?;
    if a.format == "json" {
        crate::stdout::println(&serde_json::to_string_pretty(&r)?)?;
    } else {
        // Cluster-shape loads do not depend on a step.
        let at = match r.plan_ms {
            Some(_) => String::new(),
            None => format!(" at step {}", r.step),
        };
        crate::stdout::println(&format!(
            "{} on {} nodes, {} failing{at}: {} failure sets, {} unrecoverable (checkpoint)\n\
             replicas transferred: mean {:.1} (min {}, max {}); transfer {:.2} s; reconfiguration {:.1} s; \
             replan {:.1} ms",
            r.model,
            r.nodes,
            r.failed,
            r.failure_sets,
            r.unrecoverable,
            r.replicas_mean,
            r.replicas_min,
            r.replicas_max,
            r.transfer_s_mean,
            r.reconfig_s_mean,
            r.replan_ms
        ))?;
    }
    Ok(())
}
