//! `lzsim failures`: synthetic failure traces as Bamboo CSV, so the simulator and the executor
//! can replay the very same sequence.

use crate::duration::{parse_ms, parse_period_ms};
use crate::limits::{self, MAX_NODES};
use crate::replay::output::write_atomic;
use anyhow::{Result, bail};
use clap::Args;
use lazarus_traces::synth::{self, IntervalDist};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct FailuresArgs {
    /// Nodes at time 0, 1..=1048576.
    #[arg(long, default_value_t = 10, value_parser = limits::count(MAX_NODES))]
    pub nodes: usize,
    /// Controlled scenario: one uniformly random node fails per interval (paper §6.4: 5m, 40m),
    /// 1ms..=365d.
    #[arg(long, conflicts_with = "hazard")]
    pub every: Option<String>,
    /// Interval distribution for --every: fixed, exp, or weibull:SHAPE (mean = --every).
    #[arg(long, default_value = "fixed")]
    pub dist: String,
    /// Stop failing nodes when this many remain (default: half, as in the paper).
    #[arg(long)]
    pub until_live: Option<usize>,
    /// Stochastic mode (Bamboo style): per-node preemption rate per hour.
    #[arg(long)]
    pub hazard: Option<f64>,
    /// Stochastic mode: expected node arrivals per hour.
    #[arg(long, default_value_t = 0.0)]
    pub add_rate: f64,
    /// Stochastic mode: trace length, at most 365d.
    #[arg(long, default_value = "4h")]
    pub duration: String,
    /// Stochastic mode: time step of the hazard process, at least 1ms; duration / tick x
    /// max nodes <= 1073741824 random draws.
    #[arg(long, default_value = "1m")]
    pub tick: String,
    /// Stochastic mode: cap on live nodes (default: --nodes), 1..=1048576.
    #[arg(long, value_parser = limits::count(MAX_NODES))]
    pub max_nodes: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write here instead of stdout (refuses to replace an existing file).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(a: &FailuresArgs) -> Result<()> {
    let trace = match (&a.every, a.hazard) {
        (Some(every), None) => {
            let dist: IntervalDist = a.dist.parse().map_err(|e| anyhow::anyhow!("--dist: {e}"))?;
            let every_ms = parse_period_ms("--every", every)?;
            let until = a.until_live.unwrap_or(a.nodes.div_ceil(2));
            if until > a.nodes {
                bail!("--until-live {until} exceeds --nodes {}", a.nodes);
            }
            synth::fixed_interval(a.nodes, every_ms, dist, until, a.seed)
        }
        (None, Some(h)) => {
            if !(h.is_finite() && h >= 0.0 && a.add_rate.is_finite() && a.add_rate >= 0.0) {
                bail!("--hazard and --add-rate must be finite rates >= 0");
            }
            let tick = parse_period_ms("--tick", &a.tick)?;
            let duration = parse_ms("--duration", &a.duration)?;
            let max_nodes = a.max_nodes.unwrap_or(a.nodes).max(a.nodes);
            limits::check_hazard_draws(duration, tick, max_nodes)?;
            synth::hazard(a.nodes, h, a.add_rate, duration, tick, max_nodes, a.seed)
        }
        _ => bail!("give either --every INTERVAL or --hazard RATE"),
    };
    let csv = trace.to_bamboo_csv();
    match &a.out {
        None => crate::stdout::print(&csv)?,
        Some(p) => {
            if p.exists() {
                bail!("{} exists; not replacing it", p.display());
            }
            write_atomic(p, csv.as_bytes())?;
        }
    }
    Ok(())
}
