//! The bounds of every numeric flag of `lzrun`'s subcommands, checked before anything starts.
//!
//! An adversarial probe (issue 33, item 6.1) found that absurd numbers reached code that
//! cannot take them: `--slots 18446744073709551615` or `--fault-tolerance 18446744073709551615`
//! made the planner allocate a capacity-overflowing grid (a panic inside the controller, and
//! `lzrun local` never exited), `--gpus-per-node` sized a vector, `--nodes` built a schedule
//! of that many names, millisecond flags were added to clocks. Each flag now has a sane range;
//! a value outside it is one line on stderr naming the flag and the bound, and exit status 2.
//! Seeds (`--seed`, `--storm-seed`) and `--epoch` take any value; `--protocol-version` is a
//! test hook whose whole `u16` range is meaningful.

use anyhow::{Result, bail};

use crate::args::{AgentArgs, ControllerArgs, DeviceArgs, JobArgs, LocalArgs, WorkerArgs};

/// Workers (nodes × GPUs) one controller serves at most: the connections it keeps
/// (`ServerConfig::DEFAULT_MAX_CONNS`).
pub const MAX_WORKERS: usize = 1_000;
/// GPUs (worker processes) per node at most.
pub const MAX_GPUS_PER_NODE: usize = 64;
/// Nodes `lzrun local` starts on this machine at most (and workers, with `--gpus-per-node`).
pub const MAX_LOCAL_NODES: usize = 64;
/// Training steps at most: a billion, far beyond any run (and clear of overflow in step
/// arithmetic).
pub const MAX_STEPS: u64 = 1_000_000_000;
/// Any duration flag in milliseconds at most: a day (clear of overflow when added to a clock;
/// `--wait-for-nodes-ms 0` waits for ever).
pub const MAX_MS: u64 = 86_400_000;
/// Checkpoints kept at most.
pub const MAX_CKPT_KEEP: usize = 10_000;
/// `--storm` faults at most, whatever the steps.
pub const MAX_STORM_FAULTS: usize = 100_000;
/// `--router-skew` at most: `(e+1)^-S` is already below f32's range for 2 experts at 150.
pub const MAX_ROUTER_SKEW: f64 = 64.0;
/// `--peak-tflops` at most: a thousand times today's largest GPU, so a typo in the exponent
/// is caught rather than reported as a tiny MFU.
pub const MAX_PEAK_TFLOPS: f64 = 1e6;

/// `--eval-batches` at most: each eval micro-batch is one slot of the eval's all-reduce.
pub const MAX_EVAL_BATCHES: u64 = 1 << 16;

/// `value` must lie in `min..=max`; else an error naming the flag and the bound.
pub fn within<T: PartialOrd + std::fmt::Display>(
    flag: &str,
    value: T,
    min: T,
    max: T,
    why: &str,
) -> Result<()> {
    if value < min || value > max {
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(" ({why})")
        };
        bail!("{flag} {value} is out of range: it must be between {min} and {max}{why}");
    }
    Ok(())
}

fn ms(flag: &str, value: u64, min: u64) -> Result<()> {
    within(flag, value, min, MAX_MS, "milliseconds; at most a day")
}

/// `--device`, `--comm`, `--gpus-per-node`.
pub fn check_device(d: &DeviceArgs) -> Result<()> {
    within("--gpus-per-node", d.gpus_per_node, 1, MAX_GPUS_PER_NODE, "")
}

/// The job flags shared by `lzrun local` and `lzrun controller` (the ones whose bound depends
/// on the model, `--slots` and `--fault-tolerance`, are checked again once it is loaded).
pub fn check_job(a: &JobArgs) -> Result<()> {
    within("--steps", a.model.steps, 1, MAX_STEPS, "")?;
    within(
        "--fault-tolerance",
        a.fault_tolerance,
        1,
        MAX_WORKERS,
        "replicas per expert, on distinct workers",
    )?;
    if let Some(s) = a.slots {
        within(
            "--slots",
            s,
            1,
            MAX_WORKERS,
            "expert slots per worker; the model's expert count is the useful most",
        )?;
    }
    within(
        "--ckpt-every",
        a.ckpt_every,
        0,
        MAX_STEPS,
        "steps; 0: never",
    )?;
    within("--ckpt-keep", a.ckpt_keep, 1, MAX_CKPT_KEEP, "")?;
    if let Some(n) = a.eval_every {
        within(
            "--eval-every",
            n,
            0,
            MAX_STEPS,
            "steps; 0: only after the last step",
        )?;
    }
    if let Some(b) = a.eval_batches {
        within(
            "--eval-batches",
            b,
            1,
            MAX_EVAL_BATCHES,
            "eval micro-batches",
        )?;
    }
    within(
        "--max-ckpt-failures",
        a.max_ckpt_failures,
        0,
        MAX_STEPS,
        "0: never",
    )?;
    within(
        "--max-nonfinite-steps",
        a.max_nonfinite_steps,
        1,
        MAX_STEPS,
        "",
    )?;
    within(
        "--rebalance-every",
        a.rebalance_every,
        0,
        MAX_STEPS,
        "steps; 0: never",
    )?;
    within(
        "--relayout-warmup",
        a.relayout_warmup,
        0,
        MAX_STEPS,
        "steps",
    )?;
    within(
        "--shard-copies",
        a.shard_copies,
        1,
        MAX_WORKERS,
        "at most the number of nodes",
    )?;
    ms("--timeout-ms", a.timeout_ms, 1)?;
    ms("--step-timeout-max-ms", a.step_timeout_max_ms, 1)?;
    ms("--heartbeat-timeout-ms", a.heartbeat_timeout_ms, 1)?;
    ms("--wait-for-nodes-ms", a.wait_for_nodes_ms, 0)?;
    if !(a.relayout_threshold.is_finite() && a.relayout_threshold >= 1.0) {
        bail!(
            "--relayout-threshold must be a finite number >= 1, got {}",
            a.relayout_threshold
        );
    }
    if !(a.router_skew.is_finite() && (0.0..=MAX_ROUTER_SKEW).contains(&a.router_skew)) {
        bail!(
            "--router-skew {} is out of range: it must be a number between 0 and \
             {MAX_ROUTER_SKEW}",
            a.router_skew
        );
    }
    check_peak_tflops(a.peak_tflops)
}

/// `--peak-tflops`: a positive number, at most [`MAX_PEAK_TFLOPS`].
pub fn check_peak_tflops(peak: Option<f64>) -> Result<()> {
    let Some(p) = peak else { return Ok(()) };
    if !(p.is_finite() && p > 0.0) {
        bail!("--peak-tflops must be a positive number of TFLOP/s of one device, got {p}");
    }
    within(
        "--peak-tflops",
        Tflops(p),
        Tflops(0.0),
        Tflops(MAX_PEAK_TFLOPS),
        "TFLOP/s of one device",
    )
}

/// A TFLOP/s figure in a message: as written up to the bound, in exponent form beyond it
/// (`1e300` would otherwise print 301 digits).
#[derive(PartialEq, PartialOrd)]
struct Tflops(f64);

impl std::fmt::Display for Tflops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.abs() >= 1e7 {
            write!(f, "{:e}", self.0)
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// `--slots` and `--fault-tolerance` against the loaded model (`experts` per layer): a worker
/// holds at most one replica of each expert, so more slots than experts are never used.
pub fn check_model_bounds(a: &JobArgs, experts: usize) -> Result<()> {
    if let Some(s) = a.slots {
        within(
            "--slots",
            s,
            1,
            experts,
            "a worker holds at most one replica of each of the model's experts",
        )?;
    }
    Ok(())
}

/// Every numeric flag of `lzrun local`.
pub fn check_local(a: &LocalArgs) -> Result<()> {
    check_device(&a.device)?;
    check_job(&a.job)?;
    if let Some(n) = a.nodes {
        within(
            "--nodes",
            n,
            1,
            MAX_LOCAL_NODES,
            "processes on this machine",
        )?;
        within(
            "--nodes × --gpus-per-node",
            n * a.device.gpus_per_node,
            1,
            MAX_LOCAL_NODES,
            "worker processes on this machine",
        )?;
    }
    ms("--controller-down-ms", a.controller_down_ms, 0)?;
    within("--storm-min-live", a.storm_min_live, 0, MAX_LOCAL_NODES, "")?;
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        bail!(
            "--time-scale must be a positive number of trace seconds per step, got {}",
            a.time_scale
        );
    }
    if let Some(n) = a.storm {
        // Faults fire after steps 1..=steps-2: one per such step on average at most, so a
        // storm cannot start more processes than the run has steps.
        let room = usize::try_from(a.job.model.steps.saturating_sub(2)).unwrap_or(usize::MAX);
        let max = room.min(MAX_STORM_FAULTS);
        within(
            "--storm",
            n,
            0,
            max,
            &format!(
                "at most one fault per step the faults can fire after (steps 1..=steps-2 of \
                 --steps {}), and at most {MAX_STORM_FAULTS}",
                a.job.model.steps
            ),
        )?;
    }
    Ok(())
}

/// Every numeric flag of `lzrun controller`.
pub fn check_controller(a: &ControllerArgs) -> Result<()> {
    within("--nodes", a.nodes, 1, MAX_WORKERS, "workers")?;
    check_job(&a.job)
}

/// Every numeric flag of `lzrun agent`.
pub fn check_agent(a: &AgentArgs) -> Result<()> {
    check_device(&a.device)?;
    ms("--heartbeat-ms", a.heartbeat_ms, 1)?;
    ms("--register-timeout-ms", a.register_timeout_ms, 1)?;
    ms("--reconnect-grace-ms", a.reconnect_grace_ms, 0)
}

/// Every numeric flag of `lzrun worker`.
pub fn check_worker(a: &WorkerArgs) -> Result<()> {
    check_device(&a.device)?;
    within("--steps", a.model.steps, 0, MAX_STEPS, "")?;
    ms("--timeout-ms", a.timeout_ms, 1)?;
    if let Some(w) = a.world {
        within("--world", w, 1, MAX_WORKERS, "")?;
    }
    if let (Some(r), Some(w)) = (a.rank, a.world) {
        within(
            "--rank",
            r,
            0,
            w.saturating_sub(1),
            "0-based, below --world",
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_tflops_is_a_positive_finite_number_up_to_a_million() {
        for ok in [None, Some(989.0), Some(0.05), Some(MAX_PEAK_TFLOPS)] {
            check_peak_tflops(ok).unwrap();
        }
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let e = check_peak_tflops(Some(bad)).unwrap_err().to_string();
            assert!(
                e.starts_with("--peak-tflops must be a positive number"),
                "{e}"
            );
        }
        let e = check_peak_tflops(Some(2e6)).unwrap_err().to_string();
        assert_eq!(
            e,
            "--peak-tflops 2000000 is out of range: it must be between 0 and 1000000 (TFLOP/s \
             of one device)"
        );
        let e = check_peak_tflops(Some(1e300)).unwrap_err().to_string();
        assert!(e.starts_with("--peak-tflops 1e300 is out of range"), "{e}");
    }
}
