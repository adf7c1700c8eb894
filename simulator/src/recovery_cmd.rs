//! `lzsim recovery`: parses the arguments, computes [`crate::recovery`] rows and prints them.

use crate::SpecArgs;
use crate::limits::{self, MAX_NODES};
use crate::recovery::{self, Method, Query};
use anyhow::{Context, bail};
use clap::Args;
use lazarus_planner::PlacePolicy;
use std::fmt::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct RecoveryArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Placements to compare, comma-separated: mro, spread, compact, `random[:SEED]`.
    #[arg(long, default_value = "mro,spread,compact")]
    pub place: String,
    /// Simultaneous failures: `0..6` (inclusive), `4`, or `1,2,5`. Default 0..min(units, 6).
    #[arg(long)]
    pub failed: Option<String>,
    /// exact: enumerate every failure set (≤ 64 units); closed: MRO closed form (one layer);
    /// mc: Monte Carlo with a 95 % Wilson interval.
    #[arg(long, default_value = "exact", value_parser = ["exact", "closed", "mc"])]
    pub method: String,
    /// Monte Carlo trials per (placement, k), 1..=1000000000.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=MAX_TRIALS))]
    pub trials: u64,
    /// Failure-domain mode: node j is in rack j mod R, and --failed counts whole racks.
    #[arg(long, value_parser = limits::count(MAX_NODES))]
    pub racks: Option<usize>,
    /// GPU mode: a node has G GPUs (its slots split evenly over them) and --failed counts
    /// failed GPUs, uniform over all of them; a node that loses one GPU keeps the replicas of
    /// the others. Exact when the listing is affordable, else Monte Carlo (--trials, seeded).
    #[arg(long, conflicts_with = "racks", value_parser = limits::count(limits::MAX_GPUS_PER_NODE))]
    pub gpus_per_node: Option<usize>,
    /// Also rows for fully sharded experts (FSEP): S shards of every expert, each on f distinct
    /// nodes (`fsep-fF`, the planner's resilient placement) and on one node (`laer`), with
    /// the balanced room per node. Node failures only (no --racks, --gpus-per-node).
    #[arg(long, value_parser = limits::count(MAX_NODES), conflicts_with_all = ["racks", "gpus_per_node"])]
    pub fsep_shards: Option<usize>,
    /// Output format.
    #[arg(long, default_value = "csv", value_parser = ["csv", "json"])]
    pub format: String,
    /// Also draw probability vs. failures to this file (.png or .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Most Monte Carlo trials per (placement, k): minutes of work at large shapes already.
pub const MAX_TRIALS: u64 = 1_000_000_000;

/// `0..6` (inclusive), `4`, `1,2,5`.
pub fn parse_failed(text: &str) -> anyhow::Result<Vec<usize>> {
    let bad = || format!("--failed {text:?}: expected A..B, a number, or a comma list");
    if let Some((a, b)) = text.split_once("..") {
        let a: usize = a.trim().parse().with_context(bad)?;
        let b: usize = b.trim().trim_start_matches('=').parse().with_context(bad)?;
        if a > b {
            bail!("--failed {text:?}: the range is empty");
        }
        // Checked before the range is listed: `0..1000000000000` would otherwise allocate
        // terabytes before `run` finds it exceeds the node count.
        if b > MAX_NODES {
            bail!("--failed {text:?}: at most {MAX_NODES} nodes can fail");
        }
        return Ok((a..=b).collect());
    }
    text.split(',')
        .map(|x| x.trim().parse::<usize>().with_context(bad))
        .collect()
}

pub fn run(args: &RecoveryArgs) -> anyhow::Result<()> {
    let spec = &args.spec;
    spec.validate()?;
    let places: Vec<PlacePolicy> = args
        .place
        .split(',')
        .map(|p| p.trim().parse::<PlacePolicy>().map_err(anyhow::Error::msg))
        .collect::<Result<_, _>>()?;
    let domains: Option<Vec<usize>> = match args.racks {
        Some(r) if r > spec.nodes => bail!("--racks {r} exceeds --nodes {}", spec.nodes),
        Some(r) => Some((0..spec.nodes).map(|j| j % r).collect()),
        None => None,
    };
    let units = match args.gpus_per_node {
        Some(g) => spec.nodes * g,
        None => args.racks.unwrap_or(spec.nodes),
    };
    let failed = match &args.failed {
        Some(t) => parse_failed(t)?,
        None => (0..=units.min(6)).collect(),
    };
    if let Some(&k) = failed.iter().find(|&&k| k > units) {
        bail!(
            "--failed {k} exceeds the {units} {}",
            if args.racks.is_some() {
                "racks"
            } else if args.gpus_per_node.is_some() {
                "GPUs"
            } else {
                "nodes"
            }
        );
    }
    if args.method == "closed" && (spec.layers != 1 || domains.is_some()) {
        bail!("--method closed needs --layers 1 and no --racks (use exact or mc)");
    }
    let loads = spec.loads()?;
    let plans = places
        .into_iter()
        .map(|place| Ok((place, spec.plan(place, &loads)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let method = match args.method.as_str() {
        "closed" => Method::Closed,
        "mc" => Method::MonteCarlo {
            trials: args.trials,
            seed: spec.seed,
        },
        _ => Method::Exact,
    };
    let mut rows = match args.gpus_per_node {
        Some(g) => gpu_rows(&plans, g, &failed, args.trials, spec.seed)?,
        None => recovery::rows(
            &plans,
            &Query {
                nodes: spec.nodes,
                slots: spec.slots,
                failed: &failed,
                domains: domains.as_deref(),
                method,
            },
        )?,
    };
    if let Some(shards) = args.fsep_shards {
        let plans = crate::fsep_recovery::plans(spec.nodes, shards, spec.f)?;
        rows.extend(crate::fsep_recovery::rows(
            &plans, &failed, method, spec.seed,
        )?);
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "{} nodes x {} slots, {} experts, {} layer(s), f={} ({})",
            spec.nodes, spec.slots, spec.experts, spec.layers, spec.f, args.method
        );
        let x_label = if args.racks.is_some() {
            "failed racks"
        } else if args.gpus_per_node.is_some() {
            "failed GPUs"
        } else {
            "failed nodes"
        };
        crate::plot::recovery_chart(path, &title, x_label, &rows)?;
    }
    if args.format == "json" {
        crate::stdout::println(&serde_json::to_string_pretty(&rows)?)?;
    } else {
        let mut csv = String::from("place,failed,probability,ci_low,ci_high\n");
        for r in &rows {
            let opt = |x: Option<f64>| x.map(|v| format!("{v:.6}")).unwrap_or_default();
            let _ = writeln!(
                csv,
                "{},{},{:.6},{},{}",
                r.place,
                r.failed,
                r.probability,
                opt(r.ci_low),
                opt(r.ci_high)
            );
        }
        crate::stdout::print(&csv)?;
    }
    Ok(())
}

/// GPU mode: `gpu_failures::gpu_recovery` (exact listing when affordable), or seeded Monte
/// Carlo with `trials` when it is not.
fn gpu_rows(
    plans: &[(PlacePolicy, lazarus_planner::ModelPlan)],
    gpus_per_node: usize,
    failed: &[usize],
    trials: u64,
    seed: u64,
) -> anyhow::Result<Vec<recovery::Row>> {
    use lazarus_planner::gpu_failures::{MixedFailureModel, MixedFailures, gpu_recovery};
    let mut rows = Vec::new();
    for (place, plan) in plans {
        for &k in failed {
            let exact = gpu_recovery(&plan.layers, gpus_per_node, k, seed)?;
            let est = if exact.trials.is_none() {
                exact
            } else {
                let f = MixedFailures {
                    gpus: k,
                    ..Default::default()
                };
                MixedFailureModel::new(&plan.layers, gpus_per_node, None, f)?
                    .monte_carlo(trials, seed)?
            };
            rows.push(recovery::Row {
                place: place.to_string(),
                failed: k,
                probability: est.probability,
                ci_low: est.ci_low,
                ci_high: est.ci_high,
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_syntax() {
        assert_eq!(parse_failed("0..3").unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(parse_failed("0..=2").unwrap(), vec![0, 1, 2]);
        assert_eq!(parse_failed("4").unwrap(), vec![4]);
        assert_eq!(parse_failed("1, 5").unwrap(), vec![1, 5]);
        assert!(parse_failed("3..1").is_err());
        assert!(parse_failed("a..2").is_err());
        assert!(parse_failed("0..1000000000000").is_err());
    }
}
