//! `lzsim reconfig`: the cost of one in-place reconfiguration (paper Table 2) — how many expert
//! states move and how long it takes when `k` nodes of a Lazarus cluster fail at once,
//! averaged over every failure set (or a seeded sample of them).

use crate::cost;
use crate::replay::systems::lazarus::Lazarus;
use crate::replay::systems::{Ctx, Decision, NodeId, System};
use crate::replay::window_loads;
use crate::replay_cmd::{Setup, SimArgs};
use anyhow::{Result, bail};
use clap::Args;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use serde::Serialize;

#[derive(Args, Debug)]
pub struct ReconfigArgs {
    /// Nodes before the failure.
    #[arg(long, default_value_t = 10)]
    pub nodes: usize,
    /// Nodes failing at once.
    #[arg(long, default_value_t = 2)]
    pub fail: usize,
    /// Training step whose routing history (the preceding rebalance window) drives the plan.
    #[arg(long, default_value_t = 200)]
    pub step: u64,
    /// Failure sets to evaluate: all of them when there are at most this many, else a seeded
    /// sample of this size.
    #[arg(long, default_value_t = 5000)]
    pub max_sets: usize,
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
    #[command(flatten)]
    pub sim: SimArgs,
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
    if lazarus_planner::recovery::binomial(a.nodes, a.fail) > 5e7 {
        bail!(
            "C({}, {}) failure sets are too many to list",
            a.nodes,
            a.fail
        );
    }
    let setup = Setup::new(&a.sim)?;
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
    })
}

pub fn run(a: &ReconfigArgs) -> Result<()> {
    let r = report(a)?;
    if a.format == "json" {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} on {} nodes, {} failing at step {}: {} failure sets, {} unrecoverable (checkpoint)\n\
             replicas transferred: mean {:.1} (min {}, max {}); transfer {:.2} s; reconfiguration {:.1} s",
            r.model,
            r.nodes,
            r.failed,
            r.step,
            r.failure_sets,
            r.unrecoverable,
            r.replicas_mean,
            r.replicas_min,
            r.replicas_max,
            r.transfer_s_mean,
            r.reconfig_s_mean
        );
    }
    Ok(())
}
