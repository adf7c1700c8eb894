//! Where `lzsim plan` / `lzsim recovery` get per-layer expert loads from.

use anyhow::{Context, Result, bail};
use lazarus_traces::routing::{GateTrace, GateTraceError};
use lazarus_traces::zipf::{LayerRanking, ZipfLoads};
use std::path::Path;

/// Tokens per layer used to scale synthetic (Zipf) loads; only ratios matter to the planner.
const ZIPF_TOKENS_PER_LAYER: f64 = 1_000_000.0;

/// `--loads 1,1,2,…`: the same loads for every layer.
pub fn from_list(text: &str, experts: usize, layers: usize) -> Result<Vec<Vec<u64>>> {
    let loads = parse_row(text).with_context(|| format!("--loads {text:?}"))?;
    if loads.len() != experts {
        bail!(
            "--loads has {} values but --experts is {experts}",
            loads.len()
        );
    }
    Ok(vec![loads; layers])
}

/// `--zipf S`: load of the expert with popularity rank `i` (0 = hottest) is
/// `10^6 / (i+1)^S`, rounded. Layer 0 ranks experts by id (expert 0 hottest); every further
/// layer uses a permutation seeded by `seed + layer`, since real layers disagree on which
/// experts are hot (paper Fig. 2). See [`ZipfLoads`], [`LayerRanking::FirstById`].
pub fn zipf(s: f64, experts: usize, layers: usize, seed: u64) -> Result<Vec<Vec<u64>>> {
    if !(s.is_finite() && s >= 0.0) {
        bail!("--zipf must be a finite exponent >= 0 (got {s})");
    }
    let z = ZipfLoads {
        hottest_load: ZIPF_TOKENS_PER_LAYER,
        ranking: LayerRanking::FirstById,
        ..ZipfLoads::new(s, experts, layers, seed)
    };
    Ok(z.loads(0))
}

/// `--loads-file F`. Two formats:
/// * a plain matrix: one line per layer, `experts` non-negative integers separated by commas or
///   spaces; blank lines and `#` comments ignored. Needs at least `layers` lines; extra lines are
///   ignored.
/// * the SmartMoE derived gate trace (`iter,layer,e0,…` header, see [`GateTrace`]): the rows
///   of iteration `iter` (default: the last), its first `layers` layers, and — when the trace
///   has more experts than the model — each layer's `experts` most-loaded experts, most loaded
///   first (the reading of the paper's "loads of the top experts at each layer", §6.2).
pub fn from_file(
    path: &Path,
    experts: usize,
    layers: usize,
    iter: Option<u64>,
) -> Result<Vec<Vec<u64>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read loads file {}", path.display()))?;
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let rows = if first.trim_start().starts_with("iter,layer") {
        smartmoe_rows(&text, experts, layers, iter)
    } else {
        matrix_rows(&text, experts, layers)
    };
    rows.with_context(|| format!("loads file {}", path.display()))
}

fn parse_row(line: &str) -> Result<Vec<u64>> {
    line.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u64>()
                .map_err(|_| anyhow::anyhow!("{x:?} is not a non-negative integer load"))
        })
        .collect()
}

fn matrix_rows(text: &str, experts: usize, layers: usize) -> Result<Vec<Vec<u64>>> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let row = parse_row(line).with_context(|| format!("line {}", i + 1))?;
        if row.len() != experts {
            bail!(
                "line {} has {} loads but --experts is {experts}",
                i + 1,
                row.len()
            );
        }
        out.push(row);
        if out.len() == layers {
            return Ok(out);
        }
    }
    bail!("{} layer rows found but --layers is {layers}", out.len())
}

fn smartmoe_rows(
    text: &str,
    experts: usize,
    layers: usize,
    iter: Option<u64>,
) -> Result<Vec<Vec<u64>>> {
    let trace = GateTrace::parse(text, layers, experts).map_err(|e| match e {
        // Name the flag the user can change.
        GateTraceError::TooFewExperts { source_experts, .. } => anyhow::anyhow!(
            "the trace has {source_experts} experts per layer, fewer than --experts {experts}"
        ),
        e => e.into(),
    })?;
    // `parse` rejects a trace without data rows, so there is a last iteration.
    let want = iter.unwrap_or_else(|| *trace.iterations().last().unwrap_or(&0));
    trace
        .top_loads_at_iteration(want)
        .with_context(|| format!("no row for iteration {want}, layer 0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_and_zipf() {
        assert_eq!(from_list("1, 2 3", 3, 2).unwrap(), vec![vec![1, 2, 3]; 2]);
        assert!(from_list("1,x", 2, 1).is_err());
        assert!(from_list("1,2", 3, 1).is_err());
        let z = zipf(1.0, 4, 2, 7).unwrap();
        assert_eq!(z[0], vec![1_000_000, 500_000, 333_333, 250_000]);
        let mut sorted = z[1].clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(sorted, z[0]);
        assert_eq!(z, zipf(1.0, 4, 2, 7).unwrap());
    }

    #[test]
    fn matrix_format() {
        let m = matrix_rows("# comment\n1 2\n\n3,4 # tail\n5 6\n", 2, 2).unwrap();
        assert_eq!(m, vec![vec![1, 2], vec![3, 4]]);
        assert!(matrix_rows("1 2\n", 2, 2).is_err());
        assert!(matrix_rows("1 2 3\n", 2, 1).is_err());
    }

    #[test]
    fn smartmoe_format_takes_top_experts() {
        let t = "iter,layer,e0,e1,e2\n1,0,5,9,1\n1,1,1,2,3\n11,0,7,3,8\n11,1,0,0,4\n";
        assert_eq!(
            smartmoe_rows(t, 2, 2, None).unwrap(),
            vec![vec![8, 7], vec![4, 0]]
        );
        assert_eq!(
            smartmoe_rows(t, 3, 1, Some(1)).unwrap(),
            vec![vec![9, 5, 1]]
        );
        assert!(smartmoe_rows(t, 4, 1, None).is_err());
        assert!(smartmoe_rows(t, 2, 3, None).is_err());
    }
}
