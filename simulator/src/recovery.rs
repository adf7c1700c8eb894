//! Recovery probabilities of replica plans (the domain behind `lzsim recovery`): for each
//! placement and number of simultaneous failures, the probability that the survivors still
//! hold every expert of every layer (Lazarus, Wu et al., arXiv 2407.04656, §4.1, App. A.2,
//! Figs. 4, 5 and 8).

use anyhow::bail;
use lazarus_planner::place::mro_structure;
use lazarus_planner::recovery::{exact, exact_domains, monte_carlo, mro_closed_form};
use lazarus_planner::{ModelPlan, PlacePolicy, RecoveryEstimate};
use serde::Serialize;

/// One (placement, failures) point.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub place: String,
    pub failed: usize,
    pub probability: f64,
    /// 95 % Wilson interval (Monte Carlo only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ci_low: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ci_high: Option<f64>,
}

/// How the probability is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Enumerate every failure set.
    Exact,
    /// The MRO closed form (one layer, no failure domains; paper §4.3).
    Closed,
    /// Monte Carlo with `trials` draws per point, seeded by `seed + k`.
    MonteCarlo { trials: u64, seed: u64 },
}

/// The cluster the plans run on and the failures to evaluate.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    pub nodes: usize,
    pub slots: usize,
    /// Numbers of simultaneous failures (nodes, or failure domains when `domains` is set).
    pub failed: &'a [usize],
    /// Failure domain of each node: a failure takes a whole domain down.
    pub domains: Option<&'a [usize]>,
    pub method: Method,
}

/// One row per (plan, failure count), in the order of `plans` then `q.failed`.
pub fn rows(plans: &[(PlacePolicy, ModelPlan)], q: &Query) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (place, plan) in plans {
        for &k in q.failed {
            let est = match q.method {
                Method::Closed => {
                    if *place != PlacePolicy::Mro {
                        bail!("--method closed applies to --place mro only (got {place})");
                    }
                    let st = mro_structure(&plan.allocations[0].replicas, q.nodes, q.slots);
                    if st.spread_fallback {
                        bail!("this layer fell back to spread placement; use --method exact");
                    }
                    RecoveryEstimate::exact(mro_closed_form(&st.block_sizes, q.nodes, k))
                }
                Method::MonteCarlo { trials, seed } => monte_carlo(
                    &plan.layers,
                    q.domains,
                    k,
                    trials,
                    seed.wrapping_add(k as u64),
                )?,
                Method::Exact => RecoveryEstimate::exact(match q.domains {
                    Some(d) => exact_domains(&plan.layers, d, k)?,
                    None => exact(&plan.layers, k)?,
                }),
            };
            rows.push(Row {
                place: place.name().to_string(),
                failed: k,
                probability: est.probability,
                ci_low: est.ci_low,
                ci_high: est.ci_high,
            });
        }
    }
    Ok(rows)
}
