//! Re-layout policies replayed over a routing trace (the domain behind `lzsim relayout`):
//! compares load balance, modelled step time, migration and resilience, and owns the result
//! rows ([`PolicySummary`], [`Row`]).
//!
//! Every policy starts from the same layout — experts spread round-robin over the devices with
//! equal replica counts (the static baseline) — and sees the same traffic. Each trace sample
//! (SmartMoE samples every 10 iterations) is one evaluation point; a policy re-lays a layer out
//! when its [`Schedule`] says so, from the traffic summed over the last [`Settings::window_samples`].
//! Traffic per device: the sample's expert shares scaled to the modelled cluster's assignments
//! per step (devices × batch × sequence × top-k of the model profile) and split evenly over the
//! devices (remainders to the lowest ids) — SmartMoE's ranks behave alike (TV distance 0.015
//! after warm-up).

use crate::cost::{HardwareProfile, ModelProfile};
use anyhow::{Result, bail};
use lazarus_planner::recovery::exact;
use lazarus_planner::relayout::policy::{RelayoutPolicy, Schedule, relayout_moves};
use lazarus_planner::relayout::{LinkModel, Score, Scorer, Topology, node_view};
use lazarus_planner::{LayerPlacement, PlacePolicy, place};
use lazarus_traces::routing::GateTrace;
use lazarus_traces::zipf::ZipfLoads;
use rayon::prelude::*;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

/// Where the traffic samples come from.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// A routing trace (see [`GateTrace`]): one sample per sampled iteration.
    Routing(&'a Path),
    /// Synthetic drifting Zipf loads, sampled every 10 steps of `steps`.
    Zipf {
        exponent: f64,
        drift_every_steps: u64,
        seed: u64,
        steps: u64,
    },
}

/// What every policy is run with besides its own parameters.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// When a re-layout is considered.
    pub schedule: Schedule,
    /// Trace samples of traffic a decision sums.
    pub window_samples: usize,
    /// laer: a longer window its actions must not hurt (anti-thrashing).
    pub long_window_samples: usize,
    /// Minimum replicas per expert.
    pub f: usize,
    /// Migration pauses training (charged to the total time) rather than overlapping it.
    pub blocking_migration: bool,
}

/// One policy's summary and per-sample rows.
pub type PolicyResult = (PolicySummary, Vec<Row>);

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
    /// Decisions that changed the layout (some device's replicas); a policy that keeps it
    /// (`static`, or a decision that finds nothing to gain) re-lays out nothing.
    pub relayouts: u64,
    /// Decisions taken: (layer, due step) pairs the policy was asked about.
    pub decisions: u64,
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

/// The modelled cluster and the traffic samples every policy sees.
pub struct Setup {
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

/// `nodes` nodes of the hardware profile's devices with `slots` expert slots each, running
/// `model` (which must fit with `f` replicas per expert), and the samples of `source` scaled to
/// the cluster's assignments per step.
pub fn setup(
    hw: &HardwareProfile,
    model: &ModelProfile,
    nodes: usize,
    slots: usize,
    f: usize,
    source: Source,
) -> Result<Setup> {
    if nodes == 0 || slots == 0 {
        bail!("--nodes and --slots must be at least 1");
    }
    let topo = Topology {
        devices: nodes * hw.gpus_per_node,
        devices_per_node: hw.gpus_per_node,
        slots_per_device: slots,
    };
    if topo.devices * topo.slots_per_device < model.experts * f.max(1) {
        bail!(
            "{} devices x {} slots cannot hold {} experts x f = {}",
            topo.devices,
            topo.slots_per_device,
            model.experts,
            f
        );
    }
    let (samples, steps) = match source {
        Source::Routing(p) => {
            let t = GateTrace::load(p, model.moe_layers, model.experts)?;
            let steps: Vec<u64> = t.iterations().to_vec();
            let samples: Vec<Vec<Vec<u64>>> = steps
                .iter()
                .map(|&it| t.loads_at_iteration(it).expect("listed iteration").to_vec())
                .collect();
            (samples, steps)
        }
        Source::Zipf {
            exponent,
            drift_every_steps,
            seed,
            steps,
        } => {
            if steps == 0 {
                bail!("--steps must be at least 1");
            }
            let w = ZipfLoads {
                drift_every_steps,
                ..ZipfLoads::new(exponent, model.experts, model.moe_layers, seed)
            };
            w.validate()?;
            let steps: Vec<u64> = (0..steps).step_by(10).collect();
            (steps.iter().map(|&s| w.loads(s)).collect::<Vec<_>>(), steps)
        }
    };
    // Scale every (sample, layer) to the cluster's assignments per step (devices × tokens per
    // device × top-k): the trace (or the synthetic generator) gives the shares, the model the
    // volume.
    let per_step =
        (model.sequences_per_step(topo.devices) * model.seq_len * model.top_k as u64) as f64;
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
        link: link_model(hw, model),
        samples,
        steps,
        experts: model.experts,
    })
}

/// Global counts split over devices, summed over a window of samples: `[device][expert]`,
/// each count `c` giving every device `c / devices` and one more to the lowest `c % devices`.
fn traffic(devices: usize, window: &[&Vec<u64>]) -> Vec<Vec<u64>> {
    let experts = window[0].len();
    let mut t = vec![vec![0u64; experts]; devices];
    // Per expert: the quotients summed once, and the remainders as a difference array over
    // the devices (`O(window + devices)` instead of `O(window · devices)`; the same integers).
    let mut extra = vec![0u64; devices + 1];
    for e in 0..experts {
        extra.fill(0);
        let mut base = 0u64;
        for counts in window {
            let c = counts[e];
            base += c / devices as u64;
            extra[(c % devices as u64) as usize] += 1;
        }
        // Devices below a remainder get one more: suffix sums of the remainders' counts.
        let mut more = 0u64;
        for d in (0..devices).rev() {
            more += extra[d + 1];
            t[d][e] = base + more;
        }
    }
    t
}

/// One sample's traffic (as [`traffic`] of one sample) expert-major as `f64`, for
/// [`Scorer::score_expert_major`]: `out[e·devices + d]`.
fn traffic_expert_major(devices: usize, counts: &[u64], out: &mut Vec<f64>) {
    out.clear();
    out.reserve(counts.len() * devices);
    for &c in counts {
        let (q, r) = (c / devices as u64, (c % devices as u64) as usize);
        out.extend((0..devices).map(|d| (q + u64::from(d < r)) as f64));
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// The static layout every policy starts from: equal replica counts, round-robin over
/// *nodes*, then each node's slots split over its devices, so every expert starts on as many
/// distinct nodes as it has replicas (up to the node count).
fn start_layout(s: &Setup) -> Result<LayerPlacement> {
    let slots = s.topo.devices * s.topo.slots_per_device;
    let mut r = vec![slots / s.experts; s.experts];
    for x in r.iter_mut().take(slots % s.experts) {
        *x += 1;
    }
    let per_node = s.topo.devices_per_node * s.topo.slots_per_device;
    let nodes = place(PlacePolicy::Spread, &r, s.topo.nodes(), per_node)?;
    let devices: Vec<Vec<u32>> = nodes
        .grid()
        .iter()
        .flat_map(|row| row.chunks(s.topo.slots_per_device).map(<[u32]>::to_vec))
        .collect();
    Ok(LayerPlacement::from_grid(devices, s.experts, Some(&r))?)
}

/// One planner call of the replay: what [`run_policy`] hands [`relayout_moves`].
pub struct DecisionInput {
    pub topo: Topology,
    pub link: LinkModel,
    /// `[device][expert]` over the short and the long window.
    pub traffic: Vec<Vec<u64>>,
    pub long: Vec<Vec<u64>>,
    pub current: LayerPlacement,
}

/// Every layer's planner call at sample `sample` (clamped to the last), from the static
/// layout — the replay's own layout there depends on its earlier decisions — with the
/// replay's topology, link model and windows: one call of `lzsim relayout` for benchmarks.
pub fn decision_inputs(s: &Setup, cfg: &Settings, sample: usize) -> Result<Vec<DecisionInput>> {
    let i = sample.min(s.samples.len() - 1);
    let start = start_layout(s)?;
    let window = |l: usize, w: usize| -> Vec<&Vec<u64>> {
        ((i + 1).saturating_sub(w.max(1))..=i)
            .map(|j| &s.samples[j][l])
            .collect()
    };
    Ok((0..s.samples[i].len())
        .map(|l| DecisionInput {
            topo: s.topo,
            link: s.link,
            traffic: traffic(s.topo.devices, &window(l, cfg.window_samples)),
            long: traffic(s.topo.devices, &window(l, cfg.long_window_samples)),
            current: start.clone(),
        })
        .collect())
}

/// Replays every sample through `policy`, starting from the static layout.
pub fn run_policy(s: &Setup, cfg: &Settings, policy: &RelayoutPolicy) -> Result<PolicyResult> {
    let layers = s.samples[0].len();
    let mut layout: Vec<LayerPlacement> = vec![start_layout(s)?; layers];
    let schedule = cfg.schedule;
    let blocking = cfg.blocking_migration;
    let (mut ratios, mut rows) = (Vec::new(), Vec::new());
    let (mut bytes, mut replicas, mut calls, mut planner_s, mut total_s) =
        (0u64, 0u64, 0u64, 0.0f64, 0.0f64);
    let mut changes = 0u64;
    let mut step_times = Vec::new();
    let mut next_due = 0u64;
    let (mut scorer, mut now) = (Scorer::default(), Vec::new());
    let mut scored: Vec<Option<(usize, Score)>> = vec![None; layers];
    for (i, &step) in s.steps.iter().enumerate() {
        let span = s.steps.get(i + 1).map_or(10, |n| n - step);
        let due_now = step >= next_due;
        let (mut ratio_sum, mut t_step) = (0.0, 0.0);
        for (l, current) in layout.iter_mut().enumerate() {
            let counts = &s.samples[i][l];
            // Synthetic loads stay the same for a drift epoch (and trace samples may repeat):
            // the same counts on the same layout score the same.
            let mut sc = match scored[l] {
                Some((j, sc)) if s.samples[j][l] == *counts => sc,
                _ => {
                    traffic_expert_major(s.topo.devices, counts, &mut now);
                    scorer.score_expert_major(s.topo, s.link, &now, current)?
                }
            };
            if due_now && schedule.due(next_due, sc.load_ratio) {
                let span_of = |w: usize| -> Vec<&Vec<u64>> {
                    ((i + 1).saturating_sub(w.max(1))..=i)
                        .map(|j| &s.samples[j][l])
                        .collect()
                };
                let t = traffic(s.topo.devices, &span_of(cfg.window_samples));
                let long = traffic(s.topo.devices, &span_of(cfg.long_window_samples));
                let t0 = Instant::now();
                let (layout, moved) =
                    relayout_moves(policy, s.topo, s.link, &t, Some(&long), current, cfg.f)?;
                planner_s += t0.elapsed().as_secs_f64();
                calls += 1;
                // A decision that keeps every device's replicas is no re-layout (`static` asked
                // 311 times on the SmartMoE trace reported 311 re-layouts moving 0 bytes).
                let changed = layout.replica_matrix() != current.replica_matrix();
                if changed {
                    changes += 1;
                }
                bytes += moved.bytes;
                replicas += moved.replicas;
                if blocking {
                    total_s += moved.time_s;
                }
                *current = layout;
                // A score reads the replica counts per device only: an unchanged layout keeps
                // the score computed above.
                if changed {
                    traffic_expert_major(s.topo.devices, counts, &mut now);
                    sc = scorer.score_expert_major(s.topo, s.link, &now, current)?;
                }
            }
            // The score of this layer's layout (as it is now) under sample `i`.
            scored[l] = Some((i, sc));
            ratios.push(sc.load_ratio);
            ratio_sum += sc.load_ratio;
            t_step += sc.step_time_s;
        }
        if due_now && schedule.period_steps > 0 {
            next_due = (step / schedule.period_steps + 1) * schedule.period_steps;
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
            relayouts: changes,
            decisions: calls,
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

/// Every policy on the same setup, in parallel; results in the order of `policies`.
pub fn run_policies(
    s: &Setup,
    cfg: &Settings,
    policies: &[RelayoutPolicy],
) -> Result<Vec<PolicyResult>> {
    policies.par_iter().map(|p| run_policy(s, cfg, p)).collect()
}
