//! `lzsim relayout`: replays a routing trace through re-layout policies and compares load
//! balance, modelled step time, migration and resilience.
//!
//! Every policy starts from the same layout — experts spread round-robin over the devices with
//! equal replica counts (the static baseline) — and sees the same traffic. Each trace sample
//! (SmartMoE samples every 10 iterations) is one evaluation point; a policy re-lays a layer out
//! when its [`Schedule`] says so, from the traffic summed over the last `--window` samples.
//! Traffic per device: the sample's expert shares scaled to the modelled cluster's assignments
//! per step (devices × batch × sequence × top-k of the model profile) and split evenly over the
//! devices (remainders to the lowest ids) — SmartMoE's ranks behave alike (TV distance 0.015
//! after warm-up).

use crate::cost::{self, HardwareProfile, ModelProfile};
use crate::replay::output::{prepare_dir, write_atomic};
use crate::workload::{Workload, load_gate_trace};
use anyhow::{Context, Result, bail};
use clap::Args;
use lazarus_planner::recovery::exact;
use lazarus_planner::relayout::laer::LaerParams;
use lazarus_planner::relayout::policy::{RelayoutPolicy, Schedule, relayout};
use lazarus_planner::relayout::{LinkModel, Topology, node_view, score};
use lazarus_planner::{LayerPlacement, PlacePolicy, place};
use rayon::prelude::*;
use serde::Serialize;
use std::fmt::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct RelayoutArgs {
    /// Routing trace: SmartMoE derived CSV (`iter,layer,e0,…`) or `step,layer,e0,…` CSV.
    /// Default: synthetic drifting Zipf loads (see --zipf, --drift-every, --steps).
    #[arg(long)]
    pub routing: Option<PathBuf>,
    /// Policies to compare: static, lazarus, eplb, eplb-hier, eplb-remap, eplb-hier-remap,
    /// flexmoe, laer.
    #[arg(long, default_value = "static,lazarus,eplb,flexmoe,laer")]
    pub policy: String,
    /// Re-layout period in training steps.
    #[arg(long, default_value_t = 200)]
    pub period: u64,
    /// No re-layout before this step.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Re-layout only when max/mean device load exceeds this.
    #[arg(long, default_value_t = 1.05)]
    pub threshold: f64,
    /// Trace samples of traffic a decision sums.
    #[arg(long, default_value_t = 5)]
    pub window: usize,
    /// laer: a longer window its actions must not hurt (anti-thrashing).
    #[arg(long, default_value_t = 20)]
    pub long_window: usize,
    /// Nodes (failure domains); devices per node come from the hardware profile.
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// Expert slots per device.
    #[arg(long, default_value_t = 2)]
    pub slots: usize,
    /// Model profile (experts, layers, d_model, bytes per expert) or TOML file.
    #[arg(long, default_value = "gpt-l")]
    pub model: String,
    /// Hardware profile (GPUs per node, bandwidths, FLOP/s) or TOML file.
    #[arg(long, default_value = "h200-400g")]
    pub hardware: String,
    /// Minimum replicas per expert for lazarus and laer.
    #[arg(long, default_value_t = 2)]
    pub f: usize,
    /// laer: recovery-probability floor at k = f node failures.
    #[arg(long, default_value_t = 0.9)]
    pub floor: f64,
    /// laer: weight of migration time against step time (β; default 1 when blocking, 0 when
    /// overlapped).
    #[arg(long)]
    pub migration_weight: Option<f64>,
    /// laer: an action must shorten the step by this fraction of it (hysteresis).
    #[arg(long, default_value_t = 0.0)]
    pub min_gain: f64,
    /// laer: cap on bytes moved per decision (e.g. 2e9; default unlimited).
    #[arg(long)]
    pub max_bytes: Option<f64>,
    /// Migration pauses training (blocking) or overlaps it (overlapped: not charged).
    #[arg(long, default_value = "blocking", value_parser = ["blocking", "overlapped"])]
    pub migration: String,
    /// Synthetic loads: Zipf exponent.
    #[arg(long, default_value_t = 1.2)]
    pub zipf: f64,
    /// Synthetic loads: hot experts change every this many steps.
    #[arg(long, default_value_t = 500)]
    pub drift_every: u64,
    /// Synthetic loads: steps to simulate (sampled every 10 steps).
    #[arg(long, default_value_t = 5000)]
    pub steps: u64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write per-policy time series (CSV) and the summary (JSON) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub overwrite: bool,
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

/// One policy's result.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    pub policy: String,
    pub load_ratio_mean: f64,
    pub load_ratio_p99: f64,
    pub step_time_s_mean: f64,
    /// Step time × steps + blocking migration pauses.
    pub total_time_s: f64,
    pub migrated_bytes: u64,
    pub migrated_replicas: u64,
    pub relayouts: u64,
    pub recovery_k1: f64,
    pub recovery_k2: f64,
    pub recovery_k3: f64,
    pub planner_ms_per_call: f64,
}

/// One row of `<policy>.csv`.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub step: u64,
    pub load_ratio: f64,
    pub step_time_s: f64,
    pub migrated_bytes_cumulative: u64,
}

struct Setup {
    topo: Topology,
    link: LinkModel,
    /// `[sample][layer][expert]` global counts, and the step of each sample.
    samples: Vec<Vec<Vec<u64>>>,
    steps: Vec<u64>,
    experts: usize,
}

fn link_model(hw: &HardwareProfile, model: &ModelProfile) -> LinkModel {
    LinkModel {
        bytes_per_token: (model.d_model * 2) as f64,
        intra_node_bytes_per_s: hw.rank_intra_bandwidth(),
        inter_node_bytes_per_s: hw.rank_inter_bandwidth(),
        compute_s_per_token: 2.0 * model.expert_params() as f64 / hw.gpu_flops_effective,
        bytes_per_expert: model.bytes_per_expert_state,
    }
}

fn setup(a: &RelayoutArgs) -> Result<Setup> {
    let hw = cost::hardware(&a.hardware)?;
    let model = cost::model(&a.model)?;
    if a.nodes == 0 || a.slots == 0 {
        bail!("--nodes and --slots must be at least 1");
    }
    let topo = Topology {
        devices: a.nodes * hw.gpus_per_node,
        devices_per_node: hw.gpus_per_node,
        slots_per_device: a.slots,
    };
    if topo.devices * topo.slots_per_device < model.experts * a.f.max(1) {
        bail!(
            "{} devices x {} slots cannot hold {} experts x f = {}",
            topo.devices,
            topo.slots_per_device,
            model.experts,
            a.f
        );
    }
    let (samples, steps) = match &a.routing {
        Some(p) => {
            let t = load_gate_trace(p, model.moe_layers, model.experts)?;
            let steps: Vec<u64> = t.iterations().to_vec();
            let samples: Vec<Vec<Vec<u64>>> = steps
                .iter()
                .map(|&it| t.loads_at_iteration(it).expect("listed iteration").to_vec())
                .collect();
            (samples, steps)
        }
        None => {
            if a.steps == 0 {
                bail!("--steps must be at least 1");
            }
            let w = Workload::Zipf {
                s: a.zipf,
                drift_every_steps: a.drift_every.max(1),
                seed: a.seed,
                experts: model.experts,
                layers: model.moe_layers,
            };
            w.validate()?;
            let steps: Vec<u64> = (0..a.steps).step_by(10).collect();
            (steps.iter().map(|&s| w.loads(s)).collect::<Vec<_>>(), steps)
        }
    };
    // Scale every (sample, layer) to the cluster's assignments per step (devices × tokens per
    // device × top-k): the trace (or the synthetic generator) gives the shares, the model the
    // volume.
    let per_step = (topo.devices as u64 * model.assignments_per_gpu()) as f64;
    let samples: Vec<Vec<Vec<u64>>> = samples
        .into_iter()
        .map(|layers| {
            layers
                .into_iter()
                .map(|counts| {
                    let total: u64 = counts.iter().sum();
                    counts
                        .iter()
                        .map(|&c| {
                            if total == 0 {
                                0
                            } else {
                                (c as f64 * per_step / total as f64).round() as u64
                            }
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    Ok(Setup {
        topo,
        link: link_model(&hw, &model),
        samples,
        steps,
        experts: model.experts,
    })
}

/// Global counts split over devices, summed over a window of samples.
fn traffic(devices: usize, window: &[&Vec<u64>]) -> Vec<Vec<u64>> {
    let experts = window[0].len();
    let mut t = vec![vec![0u64; experts]; devices];
    for counts in window {
        for (e, &c) in counts.iter().enumerate() {
            let (q, r) = (c / devices as u64, (c % devices as u64) as usize);
            for (d, row) in t.iter_mut().enumerate() {
                row[e] += q + u64::from(d < r);
            }
        }
    }
    t
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn run_policy(
    s: &Setup,
    a: &RelayoutArgs,
    policy: &RelayoutPolicy,
) -> Result<(PolicySummary, Vec<Row>)> {
    let layers = s.samples[0].len();
    let slots = s.topo.devices * s.topo.slots_per_device;
    let mut r = vec![slots / s.experts; s.experts];
    for x in r.iter_mut().take(slots % s.experts) {
        *x += 1;
    }
    // Round-robin over *nodes*, then each node's slots split over its devices, so every
    // expert starts on as many distinct nodes as it has replicas (up to the node count).
    let per_node = s.topo.devices_per_node * s.topo.slots_per_device;
    let nodes = place(PlacePolicy::Spread, &r, s.topo.nodes(), per_node)?;
    let devices: Vec<Vec<u32>> = nodes
        .grid()
        .iter()
        .flat_map(|row| row.chunks(s.topo.slots_per_device).map(<[u32]>::to_vec))
        .collect();
    let start = LayerPlacement::from_grid(devices, s.experts, Some(&r))?;
    let mut layout: Vec<LayerPlacement> = vec![start; layers];
    let schedule = Schedule {
        warmup_steps: a.warmup,
        period_steps: a.period,
        imbalance_threshold: a.threshold,
    };
    let blocking = a.migration == "blocking";
    let (mut ratios, mut rows) = (Vec::new(), Vec::new());
    let (mut bytes, mut replicas, mut calls, mut planner_s, mut total_s) =
        (0u64, 0u64, 0u64, 0.0f64, 0.0f64);
    let mut step_times = Vec::new();
    let mut next_due = 0u64;
    for (i, &step) in s.steps.iter().enumerate() {
        let span = s.steps.get(i + 1).map_or(10, |n| n - step);
        let due_now = step >= next_due;
        let (mut ratio_sum, mut t_step) = (0.0, 0.0);
        for (l, current) in layout.iter_mut().enumerate() {
            let now = traffic(s.topo.devices, &[&s.samples[i][l]]);
            let sc = score(s.topo, s.link, &now, current)?;
            if due_now && schedule.due(next_due, sc.load_ratio) {
                let span_of = |w: usize| -> Vec<&Vec<u64>> {
                    ((i + 1).saturating_sub(w.max(1))..=i)
                        .map(|j| &s.samples[j][l])
                        .collect()
                };
                let t = traffic(s.topo.devices, &span_of(a.window));
                let long = traffic(s.topo.devices, &span_of(a.long_window));
                let t0 = Instant::now();
                let d = relayout(policy, s.topo, s.link, &t, Some(&long), current, a.f)?;
                planner_s += t0.elapsed().as_secs_f64();
                calls += 1;
                bytes += d.migration.bytes;
                replicas += d.migration.replicas;
                if blocking {
                    total_s += d.migration.time_s;
                }
                *current = d.layout;
            }
            let sc = score(s.topo, s.link, &now, current)?;
            ratios.push(sc.load_ratio);
            ratio_sum += sc.load_ratio;
            t_step += sc.step_time_s;
        }
        if due_now && a.period > 0 {
            next_due = (step / a.period + 1) * a.period;
        }
        total_s += t_step * span as f64;
        step_times.push(t_step);
        rows.push(Row {
            step,
            load_ratio: ratio_sum / layers as f64,
            step_time_s: t_step,
            migrated_bytes_cumulative: bytes,
        });
    }
    let nodes: Vec<LayerPlacement> = layout.iter().map(|l| node_view(s.topo, l)).collect();
    let rec = |k: usize| -> Result<f64> {
        if k > s.topo.nodes() {
            return Ok(0.0);
        }
        Ok(exact(&nodes, k)?)
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok((
        PolicySummary {
            policy: policy.name().to_string(),
            load_ratio_mean: mean(&ratios),
            load_ratio_p99: percentile(&mut ratios.clone(), 0.99),
            step_time_s_mean: mean(&step_times),
            total_time_s: total_s,
            migrated_bytes: bytes,
            migrated_replicas: replicas,
            relayouts: calls,
            recovery_k1: rec(1)?,
            recovery_k2: rec(2)?,
            recovery_k3: rec(3)?,
            planner_ms_per_call: if calls > 0 {
                1e3 * planner_s / calls as f64
            } else {
                0.0
            },
        },
        rows,
    ))
}

pub fn parse_policies(a: &RelayoutArgs) -> Result<Vec<RelayoutPolicy>> {
    let mut out = Vec::new();
    for name in a.policy.split(',') {
        let mut p: RelayoutPolicy = name.trim().parse().map_err(anyhow::Error::msg)?;
        if let RelayoutPolicy::Laer(params) = &mut p {
            *params = LaerParams {
                f: a.f,
                horizon_steps: a.period.max(1) as f64,
                migration_weight: a.migration_weight.unwrap_or(if a.migration == "blocking" {
                    1.0
                } else {
                    0.0
                }),
                recovery_floor: a.floor,
                max_bytes: a.max_bytes.map_or(u64::MAX, |b| b as u64),
                min_step_gain: a.min_gain,
                ..LaerParams::default()
            };
        }
        out.push(p);
    }
    Ok(out)
}

pub fn run(a: &RelayoutArgs) -> Result<()> {
    if !(a.threshold.is_finite() && a.threshold >= 1.0) {
        bail!("--threshold must be >= 1 (max/mean load)");
    }
    if !(0.0..=1.0).contains(&a.floor) {
        bail!("--floor must be a probability in [0, 1]");
    }
    let policies = parse_policies(a)?;
    let s = setup(a)?;
    if let Some(dir) = &a.out {
        prepare_dir(dir, a.overwrite)?;
    }
    let results: Vec<(PolicySummary, Vec<Row>)> = policies
        .par_iter()
        .map(|p| run_policy(&s, a, p))
        .collect::<Result<_>>()?;
    if let Some(dir) = &a.out {
        for (sum, rows) in &results {
            let mut w = csv::Writer::from_writer(Vec::new());
            for r in rows {
                w.serialize(r)?;
            }
            write_atomic(&dir.join(format!("{}.csv", sum.policy)), &w.into_inner()?)
                .context("writing time series")?;
        }
        let list: Vec<&PolicySummary> = results.iter().map(|r| &r.0).collect();
        let mut json = serde_json::to_vec_pretty(&list)?;
        json.push(b'\n');
        write_atomic(&dir.join("summary.json"), &json)?;
        crate::replay::plot::relayout_charts(dir, &results)?;
    }
    if a.format == "json" {
        let list: Vec<&PolicySummary> = results.iter().map(|r| &r.0).collect();
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        let mut t = format!(
            "{:<16} {:>8} {:>8} {:>10} {:>12} {:>9} {:>9} {:>7} {:>7} {:>7} {:>10}\n",
            "policy",
            "ratio",
            "p99",
            "step s",
            "moved GB",
            "replicas",
            "relayouts",
            "rec k1",
            "rec k2",
            "rec k3",
            "ms/call"
        );
        for (p, _) in &results {
            let _ = writeln!(
                t,
                "{:<16} {:>8.3} {:>8.3} {:>10.4} {:>12.2} {:>9} {:>9} {:>7.3} {:>7.3} {:>7.3} {:>10.3}",
                p.policy,
                p.load_ratio_mean,
                p.load_ratio_p99,
                p.step_time_s_mean,
                p.migrated_bytes as f64 / 1e9,
                p.migrated_replicas,
                p.relayouts,
                p.recovery_k1,
                p.recovery_k2,
                p.recovery_k3,
                p.planner_ms_per_call
            );
        }
        print!("{t}");
    }
    Ok(())
}
