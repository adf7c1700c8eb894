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
use lazarus_traces::hardware::{self, HardwareModel};
use lazarus_traces::synth::{self, IntervalDist};
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
    /// Run only shard I of N (1-based, e.g. `--shard 3/8`, or `$((SLURM_ARRAY_TASK_ID+1))/N`
    /// for a 0-based Slurm array): the (hazard, seed) traces are cut into N contiguous runs in
    /// sweep order. Shard 1 writes the CSV header, the others none, so the shards' CSVs
    /// concatenated in shard order (`cat s1.csv s2.csv …`) equal the unsharded CSV byte for
    /// byte.
    #[arg(long, value_parser = parse_shard)]
    pub shard: Option<Shard>,
    /// Dedicated-cluster mode: the --hazard rates are GPU faults per GPU-hour (`lzsim failures
    /// --gpu-hazard`, GPUs per node from the hardware profile); a faulty node is repaired
    /// after --repair on average (exponential) and comes back, and --tick and --add-rate are
    /// not used.
    #[arg(long)]
    pub gpu_faults: bool,
    /// Dedicated-cluster mode: mean repair time of a GPU fault.
    #[arg(long, default_value = "24h")]
    pub repair: String,
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

/// Shard `index` (1-based) of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// The contiguous range of `0..jobs` this shard runs: the first `jobs % count` shards get
    /// one job more than the others.
    pub fn range(self, jobs: usize) -> std::ops::Range<usize> {
        let (base, extra) = (jobs / self.count, jobs % self.count);
        let i = self.index - 1;
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    }
}

/// Most shards of one sweep.
pub const MAX_SHARDS: usize = 1 << 20;

/// `I/N` with `1 <= I <= N <= 2^20`.
pub fn parse_shard(text: &str) -> Result<Shard, String> {
    let err = || format!("{text:?} is not a shard I/N with 1 <= I <= N <= {MAX_SHARDS} (e.g. 2/8)");
    let (i, n) = text.trim().split_once('/').ok_or_else(err)?;
    let index: usize = i.trim().parse().map_err(|_| err())?;
    let count: usize = n.trim().parse().map_err(|_| err())?;
    if index == 0 || index > count || count > MAX_SHARDS {
        return Err(err());
    }
    Ok(Shard { index, count })
}

/// GPU faults only, at `per_gpu_hour`, exponential repairs of mean `repair_ms`.
fn hardware_model(
    nodes: usize,
    gpus_per_node: usize,
    per_gpu_hour: f64,
    repair_ms: u64,
    duration_ms: u64,
) -> HardwareModel {
    HardwareModel {
        nodes,
        gpus_per_node,
        nodes_per_rack: 0,
        gpu_per_hour: per_gpu_hour,
        node_per_hour: 0.0,
        rack_per_hour: 0.0,
        gpu_repair_ms: repair_ms,
        node_repair_ms: repair_ms,
        rack_repair_ms: repair_ms,
        repair: IntervalDist::Exp,
        duration_ms,
    }
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
    if a.sim.sample_every.is_some() {
        bail!("--sample-every is for the time series of `lzsim replay --out`: a sweep writes none");
    }
    let rates = parse_rates(&a.hazard)?;
    let duration = parse_period_ms("--duration", &a.duration)?;
    let tick = parse_period_ms("--tick", &a.tick)?;
    if !a.gpu_faults {
        limits::check_hazard_draws(duration, tick, a.nodes)?;
    }
    let repair_ms = parse_period_ms("--repair", &a.repair)?;
    let setup = Setup::new(&a.sim)?;
    let gpus_per_node = setup.base.hardware.gpus_per_node;
    if a.gpu_faults {
        for &h in &rates {
            let m = hardware_model(a.nodes, gpus_per_node, h, repair_ms, duration);
            let expected = m.faults_per_day() * duration as f64 / 86_400_000.0;
            if expected > crate::failures_cmd::MAX_HARDWARE_FAULTS {
                bail!(
                    "--hazard {h} expects {expected:.3e} GPU faults per trace, more than the \
                     limit of {:e}",
                    crate::failures_cmd::MAX_HARDWARE_FAULTS
                );
            }
        }
    }
    let cache = replay::StepCache::default();
    let mut jobs: Vec<(f64, u64)> = rates
        .iter()
        .flat_map(|&h| (0..a.seeds).map(move |s| (h, s)))
        .collect();
    if let Some(shard) = a.shard {
        jobs = jobs[shard.range(jobs.len())].to_vec();
    }
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
            let trace = if a.gpu_faults {
                let m = hardware_model(a.nodes, gpus_per_node, h, repair_ms, duration);
                hardware::hardware(&m, seed).trace
            } else {
                synth::hazard(a.nodes, h, a.add_rate, duration, tick, a.nodes, seed)
            };
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

/// The CSV of `rows`, with the header line when `header` (shard 1, or no shard). The header
/// does not depend on the rows, so an empty shard 1 still writes it.
pub fn to_csv(rows: &[Row], header: bool) -> Result<Vec<u8>> {
    let mut w = csv::WriterBuilder::new()
        .has_headers(false)
        .from_writer(Vec::new());
    if header {
        w.write_record([
            "hazard_per_hour",
            "seed",
            "system",
            "samples",
            "steps",
            "ettr",
            "samples_per_s",
            "recoveries",
            "fallbacks",
            "preemptions",
            "avg_live_nodes",
        ])?;
    }
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
    let started = std::time::Instant::now();
    let rows = sweep(a, true)?;
    let wall = started.elapsed().as_secs_f64();
    let header = a.shard.is_none_or(|s| s.index == 1);
    let csv = to_csv(&rows, header)?;
    let rate = format!(
        "{} runs in {wall:.2} s: {:.2} runs/s",
        rows.len(),
        rows.len() as f64 / wall.max(1e-9)
    );
    match &a.out {
        None => {
            crate::stdout::print(&String::from_utf8(csv)?)?;
            eprintln!("{rate}");
        }
        Some(p) => {
            write_atomic(p, &csv)?;
            if rows.is_empty() {
                crate::stdout::println(&rate)?;
            } else {
                crate::stdout::print(&format!("{}{rate}\n", summary(&rows)))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_jobs_in_order() {
        for jobs in [0usize, 1, 5, 7, 64] {
            for count in 1..=9 {
                let mut next = 0;
                for index in 1..=count {
                    let r = Shard { index, count }.range(jobs);
                    assert_eq!(r.start, next, "jobs {jobs} shard {index}/{count}");
                    assert!(r.len() == jobs / count || r.len() == jobs / count + 1);
                    next = r.end;
                }
                assert_eq!(next, jobs);
            }
        }
    }

    #[test]
    fn shard_syntax() {
        assert_eq!(parse_shard("2/8"), Ok(Shard { index: 2, count: 8 }));
        assert_eq!(parse_shard(" 1 / 1 "), Ok(Shard { index: 1, count: 1 }));
        for bad in [
            "0/4",
            "5/4",
            "1",
            "a/b",
            "1/0",
            "-1/4",
            "1/2/3",
            "1/2000000",
        ] {
            assert!(parse_shard(bad).is_err(), "{bad}");
        }
    }
}
