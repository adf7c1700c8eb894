//! Where `lzsim plan` / `lzsim recovery` get per-layer expert loads from.

use anyhow::{Context, Result, bail};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
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
/// experts are hot (paper Fig. 2).
pub fn zipf(s: f64, experts: usize, layers: usize, seed: u64) -> Result<Vec<Vec<u64>>> {
    if !(s.is_finite() && s >= 0.0) {
        bail!("--zipf must be a finite exponent >= 0 (got {s})");
    }
    let base: Vec<u64> = (0..experts)
        .map(|i| (ZIPF_TOKENS_PER_LAYER / ((i + 1) as f64).powf(s)).round() as u64)
        .collect();
    Ok((0..layers)
        .map(|l| {
            if l == 0 {
                return base.clone();
            }
            let mut perm: Vec<usize> = (0..experts).collect();
            perm.shuffle(&mut Xoshiro256PlusPlus::seed_from_u64(
                seed.wrapping_add(l as u64),
            ));
            let mut row = vec![0; experts];
            for (rank, &e) in perm.iter().enumerate() {
                row[e] = base[rank];
            }
            row
        })
        .collect())
}

/// `--loads-file F`. Two formats:
/// * a plain matrix: one line per layer, `experts` non-negative integers separated by commas or
///   spaces; blank lines and `#` comments ignored. Needs at least `layers` lines; extra lines are
///   ignored.
/// * the SmartMoE derived gate trace (`iter,layer,e0,…` header, see
///   `shared/traces/routing/README.md`): the rows of iteration `iter` (default: the last), its
///   first `layers` layers, and — when the trace has more experts than the model — each layer's
///   `experts` most-loaded experts (the reading of Lazarus's "loads of the top experts").
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
    let mut rows: Vec<(u64, u64, Vec<u64>)> = Vec::new();
    for (i, raw) in text.lines().enumerate().skip(1) {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let v = parse_row(line).with_context(|| format!("line {}", i + 1))?;
        if v.len() < 3 {
            bail!("line {}: expected iter,layer,e0,…", i + 1);
        }
        rows.push((v[0], v[1], v[2..].to_vec()));
    }
    let want = match iter {
        Some(i) => i,
        None => rows
            .iter()
            .map(|r| r.0)
            .max()
            .context("no data rows in the trace")?,
    };
    let mut out = Vec::new();
    for layer in 0..layers as u64 {
        let (_, _, counts) = rows
            .iter()
            .find(|r| r.0 == want && r.1 == layer)
            .with_context(|| format!("no row for iteration {want}, layer {layer}"))?;
        if counts.len() < experts {
            bail!(
                "the trace has {} experts per layer, fewer than --experts {experts}",
                counts.len()
            );
        }
        let mut top = counts.clone();
        top.sort_unstable_by(|a, b| b.cmp(a));
        top.truncate(experts);
        out.push(top);
    }
    Ok(out)
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
