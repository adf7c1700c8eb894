//! The modes of the swarm: each a family of job configurations and faults with its own seeds.

use std::collections::BTreeSet;

use lazarus_planner::ModelSpec;
use lazarus_planner::deadline::StepDeadline;
use lazarus_planner::job::relayout::{LaerRelayout, Relayout};
use lazarus_planner::job::{JobConfig, RecoveryPolicy, ReplicaMigration};
use rand::RngExt;
use rand::rngs::Xoshiro256PlusPlus;

use super::model::splitmix64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Replicated experts (`f = 2`), blocking migration, a node per host.
    Base,
    /// The driver crashes and restarts: the machine is saved (serde), dropped, loaded and
    /// `recover`ed; the nodes come back with `Reattached`. The job is one of any mode's.
    Failover,
    /// Sharded experts with 2 or 3 copies of every shard: a lost member is repaired in place.
    Sharded,
    /// LAER re-layout: sharded experts switch layouts without a pause (`SwitchLayout`),
    /// replicated experts pause and reconfigure.
    Laer,
    /// Replicated experts with asynchronous replica migration (`SwitchLayout` with transfers).
    AsyncMigration,
    /// Hosts of 2 or 3 GPUs (a node per GPU) that fail whole.
    Hosts,
    /// A step deadline, worker heartbeats (`WorkerAlive`), slow members and hung workers.
    Deadline,
    /// Steps with a non-finite loss (skipped on every member), some runs long enough to end
    /// the job.
    Nonfinite,
    /// Replicated experts recovered repair-first (`RecoveryPolicy::Repair`, issue 42): a
    /// failure or join keeps the survivors' rows, the rebalance re-optimises (blocking or
    /// asynchronous); invariants of every repair checked.
    Repair,
}

impl Mode {
    pub const ALL: [Mode; 9] = [
        Mode::Base,
        Mode::Failover,
        Mode::Sharded,
        Mode::Laer,
        Mode::AsyncMigration,
        Mode::Hosts,
        Mode::Deadline,
        Mode::Nonfinite,
        Mode::Repair,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Base => "base",
            Mode::Failover => "failover",
            Mode::Sharded => "sharded",
            Mode::Laer => "laer",
            Mode::AsyncMigration => "async",
            Mode::Hosts => "hosts",
            Mode::Deadline => "deadline",
            Mode::Nonfinite => "nonfinite",
            Mode::Repair => "repair",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The RNG seed of `seed` in this mode (the base mode keeps the seeds of the first swarm).
    pub fn stream(self, seed: u64) -> u64 {
        match self {
            Mode::Base => seed,
            m => splitmix64(seed ^ ((m as u64) << 56)),
        }
    }
}

/// A job configuration of `mode` and what the simulation adds to it.
pub struct Setup {
    pub cfg: JobConfig,
    /// GPUs (nodes) per host; 1: every node its own host.
    pub gpus: usize,
    /// Steps trained with a non-finite loss.
    pub nonfinite: BTreeSet<u64>,
}

pub fn setup(mode: Mode, rng: &mut Xoshiro256PlusPlus) -> Setup {
    let experts = [4, 6, 8][rng.random_range(0..3)];
    let layers = rng.random_range(1..=2);
    let slots: usize = rng.random_range(2..=4);
    let model = ModelSpec {
        experts,
        layers,
        f: 2,
    };
    let mut cfg = JobConfig::new(model, slots, rng.random_range(30..=90));
    // Enough nodes for f replicas of every expert, sometimes one more.
    cfg.initial_nodes = (experts * 2).div_ceil(slots).max(2) + rng.random_range(0..=1);
    cfg.heartbeat_timeout_ms = 1_000;
    cfg.member_timeout_ms = 2_500;
    cfg.scale_out_wait_ms = [0, 200, 800][rng.random_range(0..3)];
    cfg.rebalance_every_steps = [0, 12, 25][rng.random_range(0..3)];
    cfg.checkpoint_every_steps = [5, 10, 15][rng.random_range(0..3)];
    cfg.bytes_per_expert = 1 << 20;
    let mut gpus = 1;
    let mut nonfinite = BTreeSet::new();
    let laer = || Relayout::Laer(LaerRelayout::new(1024.0, 1 << 20));
    // The driver's crash over the job of any other mode.
    let mode = match mode {
        Mode::Failover => Mode::ALL[rng.random_range(0..Mode::ALL.len())],
        m => m,
    };
    match mode {
        Mode::Base | Mode::Failover => {}
        Mode::Sharded => {
            cfg.sharded_experts = true;
            cfg.shard_copies = rng.random_range(2..=3);
            cfg.initial_nodes = cfg.initial_nodes.max(cfg.shard_copies + 1);
        }
        Mode::Laer => {
            cfg.relayout = laer();
            cfg.rebalance_every_steps = [4, 6, 10][rng.random_range(0..3)];
            if rng.random_bool(0.75) {
                cfg.sharded_experts = true;
                cfg.shard_copies = rng.random_range(1..=3);
            }
        }
        Mode::AsyncMigration => {
            cfg.replica_migration = ReplicaMigration::Async;
            if rng.random_bool(0.5) {
                cfg.relayout = laer();
            }
            cfg.rebalance_every_steps = [4, 6, 10][rng.random_range(0..3)];
        }
        Mode::Hosts => {
            gpus = rng.random_range(2..=3);
            cfg.initial_nodes = cfg.initial_nodes.div_ceil(gpus) * gpus;
            if rng.random_bool(0.3) {
                // Host-aware placement keeps the rebalance blocking.
                cfg.replica_migration = ReplicaMigration::Async;
            }
        }
        Mode::Repair => {
            cfg.recovery = RecoveryPolicy::Repair;
            cfg.repair_load_slack = [0.0, 0.5, 1.0][rng.random_range(0..3)];
            cfg.rebalance_every_steps = [0, 8, 16][rng.random_range(0..3)];
            if rng.random_bool(0.4) {
                cfg.replica_migration = ReplicaMigration::Async;
            }
        }
        Mode::Deadline => {
            cfg.step_deadline = Some(StepDeadline {
                floor_ms: 300,
                ceiling_ms: 4_000,
                factor: 4,
                window_steps: 8,
            });
        }
        Mode::Nonfinite => {
            cfg.max_nonfinite_steps = rng.random_range(2..=3);
            let max = cfg.max_nonfinite_steps;
            for _ in 0..rng.random_range(1..=4) {
                let start = rng.random_range(0..cfg.total_steps);
                // Mostly shorter than the limit; now and then exactly the limit.
                let len = if rng.random_bool(0.15) {
                    max
                } else {
                    rng.random_range(1..max)
                };
                nonfinite.extend(start..(start + len).min(cfg.total_steps));
            }
        }
    }
    Setup {
        cfg,
        gpus,
        nonfinite,
    }
}
