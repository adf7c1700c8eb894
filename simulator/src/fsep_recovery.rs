//! Survival probability of sharded (FSEP) plans for `lzsim recovery --fsep-shards S`: the
//! planner's resilient placement of `S` shards with `f` copies each
//! ([`lazarus_planner::fsep::place`]) and LAER's own layout (one copy, `f = 1`), as rows next
//! to the replicated placements.

use crate::recovery::{Method, Row};
use anyhow::bail;
use lazarus_planner::fsep::{self, FsepSpec, ShardPlacement};

/// Row names: `fsep-f2` for the resilient plan, `laer` for one copy per shard.
pub fn name(copies: usize) -> String {
    if copies == 1 {
        "laer".to_string()
    } else {
        format!("fsep-f{copies}")
    }
}

/// The plans compared: `f` copies (when `f > 1`) and LAER's single copy, each on the balanced
/// room `⌈copies·S/N⌉` per node.
pub fn plans(
    nodes: usize,
    shards: usize,
    f: usize,
) -> anyhow::Result<Vec<(usize, ShardPlacement)>> {
    let mut copies = vec![f];
    if f > 1 {
        copies.push(1);
    }
    copies
        .into_iter()
        .map(|c| Ok((c, fsep::place(&FsepSpec::balanced(nodes, shards, c))?)))
        .collect()
}

/// One row per (plan, failure count). `Exact` is exact whenever the planner can afford it (the
/// interval closed form covers block placements at any size) and falls back to seeded Monte
/// Carlo with an interval otherwise; `Closed` needs disjoint blocks.
pub fn rows(
    plans: &[(usize, ShardPlacement)],
    failed: &[usize],
    method: Method,
    seed: u64,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (copies, p) in plans {
        for &k in failed {
            let est = match method {
                Method::Closed => match fsep::survival_closed_form(p, k) {
                    Some(x) => lazarus_planner::RecoveryEstimate::exact(x),
                    None => bail!(
                        "--method closed: the {} plan's holder sets overlap (use exact or mc)",
                        name(*copies)
                    ),
                },
                Method::MonteCarlo { trials, seed } => {
                    fsep::survival_monte_carlo(p, k, trials, seed.wrapping_add(k as u64))?
                }
                Method::Exact => fsep::survival(p, k, seed.wrapping_add(k as u64))?,
            };
            rows.push(Row {
                place: name(*copies),
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

    /// 10 nodes, 10 shards: f = 2 gives 5 blocks of 2 (certain at k = 1, 40/45 at k = 2);
    /// LAER's single copies die with any node.
    #[test]
    fn fsep_rows_next_to_laer() {
        let plans = plans(10, 10, 2).unwrap();
        let r = rows(&plans, &[0, 1, 2], Method::Exact, 0).unwrap();
        let p: Vec<(&str, usize, f64)> = r
            .iter()
            .map(|x| (x.place.as_str(), x.failed, x.probability))
            .collect();
        assert_eq!(p[0], ("fsep-f2", 0, 1.0));
        assert_eq!(p[1], ("fsep-f2", 1, 1.0));
        assert!((p[2].2 - 40.0 / 45.0).abs() < 1e-12);
        assert_eq!(p[3], ("laer", 0, 1.0));
        assert_eq!(p[4], ("laer", 1, 0.0));
        let closed = rows(&plans, &[2], Method::Closed, 0).unwrap();
        assert!((closed[0].probability - 40.0 / 45.0).abs() < 1e-12);
    }
}
