//! `lzsim sweep`: many stochastic failure traces × systems, in parallel (rayon), one CSV row
//! per run, with a progress bar on a terminal.

use crate::duration::parse_period_ms;
use crate::limits::{self, MAX_NODES};
use crate::replay;
use crate::replay::output::write_atomic;
use crate::replay_cmd::{Setup, SimArgs};
use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use lazarus_traces::synth;
use rayon::prelude::*;
use serde::Serialize;
use std::fmt::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct SweepArgs {
    /// Per-node preemption rates per hour to sweep (Bamboo-style hazard), comma-separated.
    #[arg(long, default_value = "0.1,0.3,0.6")]
    pub hazard: String,
    /// Expected node arrivals per hour.
    #[arg(long, default_value_t = 0.0)]
    pub add_rate: f64,
    /// Traces per hazard rate (seeds 0..N, mixed with --seed), 1..=100000.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=MAX_SEEDS))]
    pub seeds: u64,
    /// Nodes at time 0 (and the cap on live nodes), 1..=1048576.
    #[arg(long, default_value_t = 10, value_parser = limits::count(MAX_NODES))]
    pub nodes: usize,
    /// Length of each trace, 1ms..=365d.
    #[arg(long, default_value = "4h")]
    pub duration: String,
    /// Time step of the hazard process, at least 1ms; duration / tick x nodes <= 1073741824
    /// random draws per trace.
    #[arg(long, default_value = "1m")]
    pub tick: String,
    /// Write the CSV here (refuses to replace a file) and print a summary; default: CSV on stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub sim: SimArgs,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub hazard_per_hour: f64,
    pub seed: u64,
    pub system: String,
    pub samples: u64,
    pub steps: u64,
    pub ettr: f64,
    pub samples_per_s: f64,
    pub recoveries: u64,
    pub fallbacks: u64,
    pub preemptions: u64,
    pub avg_live_nodes: f64,
}

fn parse_rates(text: &str) -> Result<Vec<f64>> {
    text.split(',')
        .map(|x| {
            let v: f64 = x
                .trim()
                .parse()
                .with_context(|| format!("--hazard {x:?} is not a number"))?;
            if !(v.is_finite() && v >= 0.0) {
                bail!("--hazard {x:?} must be a rate >= 0");
            }
            Ok(v)
        })
        .collect()
}

/// Most traces per hazard rate: each is a full replay of every system.
pub const MAX_SEEDS: u64 = 100_000;

/// Runs the sweep and returns its rows in (hazard, seed, system) order.
pub fn sweep(a: &SweepArgs, progress: bool) -> Result<Vec<Row>> {
    let rates = parse_rates(&a.hazard)?;
    let duration = parse_period_ms("--duration", &a.duration)?;
    let tick = parse_period_ms("--tick", &a.tick)?;
    limits::check_hazard_draws(duration, tick, a.nodes)?;
    let setup = Setup::new(&a.sim)?;
    let cache = replay::StepCache::default();
    let jobs: Vec<(f64, u64)> = rates
        .iter()
        .flat_map(|&h| (0..a.seeds).map(move |s| (h, s)))
        .collect();
    let bar = if progress {
        ProgressBar::new(jobs.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} traces  {elapsed} (eta {eta})")
            .expect("valid template"),
    );
    let rows: Vec<Vec<Row>> = jobs
        .par_iter()
        .map(|&(h, s)| {
            let seed = a
                .sim
                .seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(s);
            let trace = synth::hazard(a.nodes, h, a.add_rate, duration, tick, a.nodes, seed);
            let out = setup
                .systems
                .iter()
                .map(|&sys| {
                    let cfg = setup.config(sys, &trace, Some(duration));
                    let m = replay::run(&cfg, sys, &trace, &setup.workload, false, Some(&cache))?
                        .summary;
                    Ok(Row {
                        hazard_per_hour: h,
                        seed: s,
                        system: sys.name().to_string(),
                        samples: m.samples,
                        steps: m.steps,
                        ettr: m.ettr,
                        samples_per_s: m.samples_per_s,
                        recoveries: m.recoveries,
                        fallbacks: m.fallbacks,
                        preemptions: m.preemptions,
                        avg_live_nodes: m.avg_live_nodes,
                    })
                })
                .collect::<Result<Vec<Row>, replay::ReplayError>>();
            bar.inc(1);
            out
        })
        .collect::<Result<_, _>>()?;
    bar.finish_and_clear();
    Ok(rows.into_iter().flatten().collect())
}

fn to_csv(rows: &[Row]) -> Result<Vec<u8>> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in rows {
        w.serialize(r)?;
    }
    Ok(w.into_inner()?)
}

/// Mean samples and ETTR per (hazard, system) with a normal 95 % interval on the mean.
pub fn summary(rows: &[Row]) -> String {
    let mut keys: Vec<(u64, String)> = Vec::new();
    for r in rows {
        let k = (r.hazard_per_hour.to_bits(), r.system.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut s = format!(
        "{:>8} {:<8} {:>6} {:>14} {:>14}\n",
        "hazard/h", "system", "runs", "samples (±95%)", "ettr (±95%)"
    );
    for (h, sys) in keys {
        let sel: Vec<&Row> = rows
            .iter()
            .filter(|r| r.hazard_per_hour.to_bits() == h && r.system == sys)
            .collect();
        let stat = |f: &dyn Fn(&Row) -> f64| {
            let n = sel.len() as f64;
            let mean = sel.iter().map(|r| f(r)).sum::<f64>() / n;
            let var = sel.iter().map(|r| (f(r) - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
            (mean, 1.96 * (var / n).sqrt())
        };
        let (ms, cs) = stat(&|r| r.samples as f64);
        let (me, ce) = stat(&|r| r.ettr);
        let _ = writeln!(
            s,
            "{:>8} {:<8} {:>6} {:>8.0}±{:<5.0} {:>8.3}±{:<5.3}",
            f64::from_bits(h),
            sys,
            sel.len(),
            ms,
            cs,
            me,
            ce
        );
    }
    s
}

pub fn run(a: &SweepArgs) -> Result<()> {
    if let Some(p) = &a.out
        && p.exists()
    {
        bail!("{} exists; not replacing it", p.display());
    }
    let rows = sweep(a, true)?;
    let csv = to_csv(&rows)?;
    match &a.out {
        None => crate::stdout::print(&String::from_utf8(csv)?)?,
        Some(p) => {
            write_atomic(p, &csv)?;
            crate::stdout::print(&summary(&rows))?;
        }
    }
    Ok(())
}
