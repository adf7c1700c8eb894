//! Upper bounds on every size the command line takes, checked before anything is computed.
//!
//! Without them a typo (`--layers 18446744073709551615`) panicked on a capacity overflow and a
//! large shape (`--nodes 1000000000`) took gigabytes before failing. Each bound is far above
//! today's largest training clusters (16K nodes x 8 GPUs, 256 experts x 58 layers) and keeps
//! the plan state of the largest shape within about 2 GB (the planner holds about 24 bytes per
//! replica slot).

use anyhow::bail;
use clap::builder::RangedU64ValueParser;

/// Nodes of a cluster (the failure unit).
pub const MAX_NODES: usize = 1 << 20;
/// GPUs per node (a rack-scale NVL72 "node" still fits).
pub const MAX_GPUS_PER_NODE: usize = 256;
/// Expert-replica slots per node (or per device, for `relayout`).
pub const MAX_SLOTS_PER_NODE: usize = 4096;
/// Experts per MoE layer.
pub const MAX_EXPERTS: usize = 1 << 16;
/// MoE layers.
pub const MAX_LAYERS: usize = 1024;
/// Minimum replicas per expert (the fault-tolerance threshold `f`).
pub const MAX_F: usize = 1024;
/// Replica slots of a whole-model plan: nodes x slots per node x layers (about 1.6 GB of plan
/// state at 24 bytes per slot).
pub const MAX_REPLICA_SLOTS: usize = 1 << 26;

/// A training step index (`lzsim reconfig --step`): 10^12 steps, thirty thousand years at one
/// step a second. Step arithmetic near `u64::MAX` (the drift epoch after the step) overflowed,
/// and the routing-window sum then walked from a wrapped step to the end: `--step
/// 18446744073709551515` never returned.
pub const MAX_STEP: u64 = 1_000_000_000_000;

/// Random draws of a hazard trace (ticks x node slots): about ten seconds of generation.
pub const MAX_HAZARD_DRAWS: usize = 1 << 30;

/// Rejects a hazard process whose generation would take more than [`MAX_HAZARD_DRAWS`]
/// draws: one per node slot per tick.
pub fn check_hazard_draws(duration_ms: u64, tick_ms: u64, max_nodes: usize) -> anyhow::Result<()> {
    let ticks = usize::try_from(duration_ms / tick_ms.max(1)).unwrap_or(usize::MAX);
    check_product(
        &[("ticks (--duration / --tick)", ticks), ("nodes", max_nodes)],
        MAX_HAZARD_DRAWS,
        "random draws",
        "use a coarser --tick",
    )
}

/// A clap parser for a count in `1..=max`; clap's message names the argument and the range,
/// and the process exits with code 2.
pub fn count(max: usize) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..=max as u64)
}

/// Rejects a product of sizes above `max`, naming each factor (`--nodes 4000 x --slots 64 x
/// --layers 512`) and what the product counts; `hint` (if not empty) says what to do instead.
pub fn check_product(
    factors: &[(&str, usize)],
    max: usize,
    what: &str,
    hint: &str,
) -> anyhow::Result<()> {
    let product = factors
        .iter()
        .try_fold(1usize, |acc, &(_, v)| acc.checked_mul(v));
    if product.is_none_or(|p| p > max) {
        let named: Vec<String> = factors.iter().map(|(n, v)| format!("{n} {v}")).collect();
        let product = product.map_or("more than 2^64".to_string(), |p| p.to_string());
        let hint = if hint.is_empty() {
            String::new()
        } else {
            format!("; {hint}")
        };
        bail!(
            "{} is {product} {what}, more than the limit of {max}{hint}",
            named.join(" x ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_name_their_factors() {
        assert!(check_product(&[("--a", 4), ("--b", 5)], 20, "slots", "").is_ok());
        let e = check_product(&[("--a", 4), ("--b", 6)], 20, "slots", "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--a 4 x --b 6 is 24 slots, more than the limit of 20"
        );
        let e =
            check_product(&[("--a", usize::MAX), ("--b", 2)], 20, "slots", "use less").unwrap_err();
        assert!(
            e.to_string()
                .ends_with("more than the limit of 20; use less"),
            "{e}"
        );
    }
}
