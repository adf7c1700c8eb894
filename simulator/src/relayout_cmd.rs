//! `lzsim relayout`: parses the arguments, runs [`crate::relayout`] and prints (or writes) its
//! rows.

use crate::cost;
use crate::limits::{self, MAX_F, MAX_NODES, MAX_REPLICA_SLOTS, MAX_SLOTS_PER_NODE};
use crate::relayout::{self, PolicySummary, Settings, Source};
use crate::replay::output::{prepare_dir, write_atomic};
use anyhow::{Context, Result, bail};
use clap::Args;
use lazarus_planner::relayout::laer::LaerParams;
use lazarus_planner::relayout::policy::{RelayoutPolicy, Schedule};
use std::fmt::Write;
use std::path::PathBuf;

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
    /// laer: a longer window its actions must not hurt (anti-thrashing). [default: 20]
    #[arg(long)]
    pub long_window: Option<usize>,
    /// Nodes (failure domains), 1..=1048576; devices per node come from the hardware profile.
    /// Also devices x slots x layers and devices x experts <= 67108864.
    #[arg(long, default_value_t = 4, value_parser = limits::count(MAX_NODES))]
    pub nodes: usize,
    /// Expert slots per device, 1..=4096.
    #[arg(long, default_value_t = 2, value_parser = limits::count(MAX_SLOTS_PER_NODE))]
    pub slots: usize,
    /// Model profile (experts, layers, d_model, bytes per expert) or TOML file.
    #[arg(long, default_value = "gpt-l")]
    pub model: String,
    /// Hardware profile (GPUs per node, bandwidths, FLOP/s) or TOML file.
    #[arg(long, default_value = "h200-400g")]
    pub hardware: String,
    /// Minimum replicas per expert for lazarus and laer, 1..=1024.
    #[arg(long, default_value_t = 2, value_parser = limits::count(MAX_F))]
    pub f: usize,
    /// laer: recovery-probability floor at k = f node failures. [default: 0.9]
    #[arg(long)]
    pub floor: Option<f64>,
    /// laer: weight of migration time against step time (β; default 1 when blocking, 0 when
    /// overlapped).
    #[arg(long)]
    pub migration_weight: Option<f64>,
    /// laer: an action must shorten the step by this fraction of it (hysteresis). [default: 0]
    #[arg(long)]
    pub min_gain: Option<f64>,
    /// laer: cap on bytes moved per decision (e.g. 2e9; default unlimited).
    #[arg(long)]
    pub max_bytes: Option<f64>,
    /// Migration pauses training (blocking) or overlaps it (overlapped: not charged).
    #[arg(long, default_value = "blocking", value_parser = ["blocking", "overlapped"])]
    pub migration: String,
    /// Synthetic loads: Zipf exponent (not with --routing).
    #[arg(long, default_value_t = 1.2, conflicts_with = "routing")]
    pub zipf: f64,
    /// Synthetic loads: hot experts change every this many steps (not with --routing).
    #[arg(long, default_value_t = 500, conflicts_with = "routing")]
    pub drift_every: u64,
    /// Synthetic loads: steps to simulate (sampled every 10 steps); steps / 10 x layers x
    /// experts <= 134217728 load counts (1 GB). Not with --routing (the trace's steps).
    #[arg(long, default_value_t = 5000, conflicts_with = "routing")]
    pub steps: u64,
    /// Synthetic loads: their seed (not with --routing).
    #[arg(long, default_value_t = 0, conflicts_with = "routing")]
    pub seed: u64,
    /// Write per-policy time series (CSV) and the summary (JSON) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Allow --out to be an existing non-empty directory.
    #[arg(long, requires = "out")]
    pub overwrite: bool,
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

/// `--floor` without one.
const DEFAULT_FLOOR: f64 = 0.9;
/// `--long-window` without one.
const DEFAULT_LONG_WINDOW: usize = 20;

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
                recovery_floor: a.floor.unwrap_or(DEFAULT_FLOOR),
                max_bytes: a.max_bytes.map_or(u64::MAX, |b| b as u64),
                min_step_gain: a.min_gain.unwrap_or(0.0),
                ..LaerParams::default()
            };
        }
        out.push(p);
    }
    // The laer parameters were taken and ignored without laer among the policies.
    if !out.iter().any(|p| matches!(p, RelayoutPolicy::Laer(_))) {
        let given = [
            ("--floor", a.floor.is_some()),
            ("--migration-weight", a.migration_weight.is_some()),
            ("--min-gain", a.min_gain.is_some()),
            ("--max-bytes", a.max_bytes.is_some()),
            ("--long-window", a.long_window.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            bail!(
                "{flag} is a parameter of the laer policy, and --policy {} has no laer",
                a.policy
            );
        }
    }
    Ok(out)
}

/// Most synthetic load counts (samples x layers x experts, 8 bytes each) `--steps` may ask for.
pub const MAX_LOAD_COUNTS: u64 = 1 << 27;

/// The memory the replay holds: the layout (devices x slots per layer), one traffic matrix
/// (devices x experts) per decision, and the synthetic samples.
fn check_sizes(
    a: &RelayoutArgs,
    hw: &cost::HardwareProfile,
    model: &cost::ModelProfile,
) -> Result<()> {
    let devices = a.nodes.saturating_mul(hw.gpus_per_node);
    limits::check_product(
        &[
            ("devices (--nodes x GPUs per node)", devices),
            ("--slots", a.slots),
            ("layers", model.moe_layers),
        ],
        MAX_REPLICA_SLOTS,
        "replica slots",
        "",
    )?;
    limits::check_product(
        &[
            ("devices (--nodes x GPUs per node)", devices),
            ("experts", model.experts),
        ],
        MAX_REPLICA_SLOTS,
        "traffic counts",
        "",
    )?;
    if a.routing.is_none() {
        let samples = a.steps.div_ceil(10);
        let counts = samples
            .checked_mul(model.moe_layers as u64)
            .and_then(|x| x.checked_mul(model.experts as u64));
        if counts.is_none_or(|c| c > MAX_LOAD_COUNTS) {
            bail!(
                "--steps {} asks for {samples} samples x {} layers x {} experts, more than the \
                 limit of {MAX_LOAD_COUNTS} load counts",
                a.steps,
                model.moe_layers,
                model.experts
            );
        }
    }
    Ok(())
}

/// The replay's settings from the arguments.
pub fn settings(a: &RelayoutArgs) -> Settings {
    Settings {
        schedule: Schedule {
            warmup_steps: a.warmup,
            period_steps: a.period,
            imbalance_threshold: a.threshold,
        },
        window_samples: a.window,
        long_window_samples: a.long_window.unwrap_or(DEFAULT_LONG_WINDOW),
        f: a.f,
        blocking_migration: a.migration == "blocking",
    }
}

pub fn run(a: &RelayoutArgs) -> Result<()> {
    if !(a.threshold.is_finite() && a.threshold >= 1.0) {
        bail!("--threshold must be >= 1 (max/mean load)");
    }
    if !(0.0..=1.0).contains(&a.floor.unwrap_or(DEFAULT_FLOOR)) {
        bail!("--floor must be a probability in [0, 1]");
    }
    let policies = parse_policies(a)?;
    let hw = cost::hardware(&a.hardware)?;
    let model = cost::model(&a.model)?;
    check_sizes(a, &hw, &model)?;
    let source = match &a.routing {
        Some(p) => Source::Routing(p),
        None => Source::Zipf {
            exponent: a.zipf,
            drift_every_steps: a.drift_every.max(1),
            seed: a.seed,
            steps: a.steps,
        },
    };
    let s = relayout::setup(&hw, &model, a.nodes, a.slots, a.f, source)?;
    if let Some(dir) = &a.out {
        prepare_dir(dir, a.overwrite)?;
    }
    let settings = settings(a);
    let results = relayout::run_policies(&s, &settings, &policies)?;
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
        crate::plot::relayout_charts(dir, &results)?;
    }
    if a.format == "json" {
        let list: Vec<&PolicySummary> = results.iter().map(|r| &r.0).collect();
        crate::stdout::println(&serde_json::to_string_pretty(&list)?)?;
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
        crate::stdout::print(&t)?;
    }
    Ok(())
}
