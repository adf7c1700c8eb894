//! # Worker: one training process of `lzrun` (one per device)
//!
//! A worker holds the dense model, the expert replicas its plan gives it and their optimizer
//! state, and trains one atomic step at a time ([`train_step`]) over a communicator mesh.
//!
//! **Managed** ([`run_managed_worker`], under `lzrun local` / `lzrun agent`): the node's agent
//! relays, one JSON line each, the controller's [`Command`]s to the worker's stdin and the
//! worker's [`StepLine`]s and [`WorkerEvent`]s from its stdout ([`protocol`]). The worker is in
//! one of three phases ([`managed`]):
//!
//! 1. **idle**: after [`Command::Job`] it builds the model, binds one data-plane listener for
//!    its whole life, reports [`WorkerEvent::Ready`], and waits;
//! 2. **reconfiguring** on [`Command::Reconfigure`] ([`migrate`]): its rank, the members'
//!    addresses, the epoch and its mesh secret, the replica plan, the expert-state transfers, where its state
//!    comes from (fresh, peers — a joining node also gets the dense state — or a checkpoint),
//!    and the step to resume at. It forms the epoch's mesh, moves states, drops replicas it no
//!    longer holds and reports [`WorkerEvent::Migrated`] (or `Failed`, back to idle);
//! 3. **training**: one [`StepLine`] per step (with its routing counts and epoch), its
//!    checkpoint parts when one is due ([`WorkerEvent::Checkpointed`]); on any error in a step
//!    (a peer died, or [`Command::Abort`] aborted the communicator from the command reader:
//!    [`AbortSlot`]) it discards the step and reports `Failed` with the replicas it holds; on
//!    [`Command::Pause`] it stops at the next step boundary every member agrees on
//!    (`Paused`); after the last step `Finished`. Each goes back to idle. [`Command::Stop`]
//!    writes the checksums and ends the process.
//!
//! ## No partial updates
//!
//! [`train_step`] runs every collective of a step (forward and backward exchanges, dense and
//! expert all-reduces, then a small all-reduce that doubles as the barrier and carries the
//! pause vote, the non-finite vote and the parts of the global gradient norm that clipping
//! needs) before it applies any optimizer step, and keeps a
//! [`Snapshot`] of the state before the update. When some member saw a NaN or an infinity in
//! its loss or gradients, every member skips the update of that step (see [`train_step`]). A peer can still die while that last all-reduce completes for some ranks
//! and not for others; then the survivors disagree by one step, the controller resumes at the
//! smallest reported step and the ranks one step further roll back to their snapshot.
//!
//! **Stand-alone** ([`run_worker`], `lzrun worker --rank R --world W --peers …`): every worker
//! computes the same whole-model plan from `(world, config)` ([`plan_replicas`]), keeps its
//! replicas, forms the mesh and trains; no failures are handled.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use lazarus_planner::{Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, plan_model};

use crate::model::MoeConfig;

pub mod abort;
mod background;
pub mod managed;
pub mod migrate;
mod plane;
pub mod protocol;
pub mod standalone;
pub mod state;

pub use abort::AbortSlot;
pub use managed::{EvalFail, FlipBit, StepDelay, TestHooks, ms_since, run_managed_worker};
pub use protocol::default_verify_every;
pub use protocol::{
    CheckpointSpec, Checksums, Command, JobSpec, Reconfigure, ReplicaChecksum, StateSource,
    StepLine, WorkerEvent, WorkerLine,
};
pub use standalone::{WorkerOptions, run_worker};
pub use state::{
    Snapshot, StepVotes, TrainedStep, all_finite, train_step, train_step_votes, train_step_voting,
};

/// Model configurations a worker can be started with, by name.
pub const CONFIG_NAMES: [&str; 4] = ["tiny", "gpt-s", "gpt-m", "gpt-l"];

/// Steps in a row whose update was skipped for a non-finite loss or gradient after which a job
/// (or a stand-alone worker) gives up: one or two can be a transient spike, more means the
/// training diverged.
pub const MAX_NONFINITE_STEPS: u64 = 3;

/// The fault-tolerance threshold the plan asks for (the paper's `f`).
pub const FAULT_TOLERANCE: usize = 2;

/// The [`MoeConfig`] called `name` (one of [`CONFIG_NAMES`]).
pub fn config_by_name(name: &str) -> Result<MoeConfig> {
    Ok(match name {
        "tiny" => MoeConfig::tiny(),
        "gpt-s" => MoeConfig::gpt_s(),
        "gpt-m" => MoeConfig::gpt_m(),
        "gpt-l" => MoeConfig::gpt_l(),
        other => bail!(
            "unknown model config {other:?} (expected one of {})",
            CONFIG_NAMES.join(", ")
        ),
    })
}

/// Replica slots per node for `world` single-device nodes: enough for
/// [`FAULT_TOLERANCE`] replicas of every expert, `⌈f·E / W⌉`.
pub fn slots_per_node(experts: usize, world: usize) -> usize {
    (FAULT_TOLERANCE * experts).div_ceil(world.max(1)).max(1)
}

/// `[layer][expert][rank]` replica counts of the whole-model plan for `world` nodes of one
/// device each: Lazarus allocation (Eq. 1) on uniform loads, MRO placement, aligned layers.
/// A pure function of its arguments, so every worker computes the same plan.
pub fn plan_replicas(cfg: &MoeConfig, world: usize) -> Result<Vec<Vec<Vec<u32>>>> {
    ensure!(world >= 1, "world size must be at least 1");
    let cluster = ClusterSpec::new(world, slots_per_node(cfg.experts, world));
    let model = ModelSpec {
        experts: cfg.experts,
        layers: cfg.n_layers,
        f: FAULT_TOLERANCE,
    };
    let loads = vec![vec![1u64; cfg.experts]; cfg.n_layers];
    let plan = plan_model(
        &cluster,
        &model,
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .map_err(|e| anyhow!("planning {world} nodes: {e}"))?;
    Ok((0..cfg.n_layers)
        .map(|l| plan.replicas_per_rank(l))
        .collect())
}

/// The `(layer, expert)` pairs `rank` holds at least one replica of.
pub fn held_replicas(replicas: &[Vec<Vec<u32>>], rank: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (l, layer) in replicas.iter().enumerate() {
        for (e, row) in layer.iter().enumerate() {
            if row.get(rank).copied().unwrap_or(0) > 0 {
                out.push((l, e));
            }
        }
    }
    out
}

/// Binds `addr`, retrying while it is in use (another process may hold a port the parent
/// picked as free) until `timeout` has passed.
pub fn bind_with_retry(addr: SocketAddr, timeout: Duration) -> Result<TcpListener> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpListener::bind(addr) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == ErrorKind::AddrInUse && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e).with_context(|| format!("binding {addr}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_gives_every_expert_f_replicas_and_is_deterministic() {
        let cfg = MoeConfig::tiny();
        for world in 1..=5 {
            let a = plan_replicas(&cfg, world).unwrap();
            assert_eq!(a, plan_replicas(&cfg, world).unwrap());
            assert_eq!(a.len(), cfg.n_layers);
            for layer in &a {
                assert_eq!(layer.len(), cfg.experts);
                for row in layer {
                    assert_eq!(row.len(), world);
                    assert!(row.iter().sum::<u32>() >= FAULT_TOLERANCE as u32);
                }
            }
        }
    }

    #[test]
    fn unknown_config_is_an_error() {
        assert!(config_by_name("tiny").is_ok());
        assert!(config_by_name("huge").is_err());
    }
}
