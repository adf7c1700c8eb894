//! # The job's control decisions as one pure state machine
//!
//! Lazarus (arXiv 2407.04656 §3, §5) is a planner *plus* a handful of control rules: replan on
//! the survivors after a failure and migrate only what is missing; restore a checkpoint only
//! when some expert lost every replica; take new nodes in lazily at a step boundary; rebalance
//! from the routing history every so many steps. [`JobMachine`] holds those rules once. It is
//! pure: no I/O, no clock, no threads. A driver feeds it [`Event`]s with the time they happened
//! (`now_ms` on any monotonic clock) and performs the [`Action`]s it returns:
//!
//! * `lzrun`'s controller performs them for real (sockets to agents, files for checkpoints);
//! * `lzsim replay`'s `lazarus` system performs them in simulation (modelled durations);
//! * the swarm test performs them with simulated nodes and a lossy simulated network.
//!
//! ## The rules
//! * **Start.** Nodes join ([`Event::Joined`]) and get their worker started; once
//!   `initial_nodes` workers are [`Event::Ready`] (and no joined node is still starting), the
//!   first plan (Eq. 1 + MRO, ranks in natural node-name order) goes out as one
//!   [`Reconfiguration`] with [`StateSource::Fresh`], or, with `resume`, from the newest
//!   checkpoint ([`Action::FindCheckpoint`] first).
//! * **What counts as one step.** A step counts once, when every member of the current epoch
//!   reported it ([`Event::Stepped`]); steps are counted in order from the resume step of the
//!   epoch, reports of another epoch, of a non-member or of a step already counted are
//!   ignored (a duplicated or late message changes nothing).
//! * **Failures.** A member that is lost (connection closed, heartbeat expired, fenced) or whose
//!   worker reports a failed step starts a reconfiguration: every other member is told to
//!   [`Action::Abort`] what it is doing (a peer it no longer needs to wait for), and the machine
//!   waits until every member is idle and reported the replicas it holds — that report, not the
//!   last plan, is the truth the next plan starts from.
//! * **Restore or replan.** If the survivors still hold a replica of every expert and at least
//!   one of them holds the dense state, the next plan is an in-place replan
//!   ([`crate::replan`] with the optimal migration mapping) with transfers between members;
//!   otherwise every member restores the newest checkpoint (found by the driver:
//!   [`Action::FindCheckpoint`] → [`Event::CheckpointFound`]). A start or a restore that did not
//!   complete on every member is done again as a whole (a half-restored member mixes two
//!   lineages).
//! * **Sharded experts** ([`JobConfig::sharded_experts`]): a lost member restores, unless
//!   every shard kept one of its [`JobConfig::shard_copies`] copies: then the lost copies are
//!   rebuilt in place; a newcomer joins in place, the shard copies re-placed over the new
//!   membership (the `sharded` submodule).
//! * **Resume step.** The smallest step any member with the job's state reported; members one
//!   step ahead roll back. A restore resumes at the checkpoint's step.
//! * **Who has the dense state.** Only a node that completed a reconfiguration
//!   ([`Event::Migrated`] of that epoch) holds the job's dense state. A newcomer whose join was
//!   cut short by a failure still needs it next time (it is named in `dense_to` again).
//! * **Lazy scale-out** (paper §1.4). A ready node that is not a member joins at the first step
//!   boundary `scale_out_wait_ms` after the first such node became ready (members are paused at
//!   an agreed step), so a burst of arrivals costs one reconfiguration.
//! * **Rebalance** every `rebalance_every_steps` counted steps (the paper: 200), from the
//!   routing history, unless the job is about to end. With [`relayout::Relayout::Laer`] the
//!   members are paused only when LAER changed the layout (from the per-rank traffic, after the
//!   warm-up, above the imbalance threshold); the new plan keeps the ranks, so sharded experts
//!   move nothing (if the membership changed meanwhile, Lazarus's replan is used instead).
//! * **Layout switch without a pause** (sharded experts with [`relayout::Relayout::Laer`]):
//!   the layout is only the index table of the shard all-to-all, so a changed layout is not
//!   a reconfiguration. The members get [`Action::SwitchLayout`] ("use plan v from step s")
//!   while they keep training; `s` is a few steps ([`SWITCH_LEAD_STEPS`]) past the newest step
//!   any member reported. The members agree on the boundary among themselves: each adds the
//!   newest layout version it holds to the barrier of every step, and all switch after the
//!   first step `≥ s − 1` whose barrier shows every rank holding `v` — so a command that
//!   reaches one member late delays the switch on every member, never splits it. The machine
//!   takes the new plan as in force when it counts a step every member reports having
//!   trained on it ([`StepReport::layout_version`]); until then no other decision is made and,
//!   at the next rebalance point, the command is sent again (a lost one is harmless: the switch
//!   only waits). Any reconfiguration supersedes a pending switch: it carries its own plan and
//!   a new epoch, and the members drop switches of an older epoch.
//! * **Replica migration without a pause** (replicated experts with
//!   [`ReplicaMigration::Async`], either policy): the rebalance point plans the next layout
//!   over the members with their ranks kept (LAER's decision, or Lazarus's replan renumbered
//!   onto the current ranks; nothing when it keeps every replica) and sends it as the same
//!   [`Action::SwitchLayout`], carrying the replica copies ([`LayoutSwitch::transfers`]) from
//!   the holders of the layout in force. The members copy them in the background and switch
//!   once every copy arrived (the executor's `model::shadow` docs); the machine sees it in
//!   force, resends it and lets a reconfiguration supersede it exactly as above. A failure
//!   meanwhile recovers from what the members report holding: the layout in force (nothing of
//!   the new one was used). With host-aware placement the rebalance stays blocking.
//! * **Stuck members.** A member that does not answer within `member_timeout_ms` (does not go
//!   idle when asked, does not finish a reconfiguration, makes no step progress, a worker that
//!   never becomes ready) is declared failed and [`Action::Fence`]d: the driver stops talking
//!   to it and kills its worker; the membership epoch moves on without it.
//! * **Slow is not dead.** A node is *gone* when its agent's heartbeats stop
//!   (`heartbeat_timeout_ms`) or, once its worker heartbeats on its own
//!   ([`Event::WorkerAlive`], from a thread compute cannot starve), when those stop: fenced at
//!   once, whatever it was doing. A node whose worker heartbeats is *slow*, not gone, when it
//!   keeps the job waiting: with [`JobConfig::step_deadline`] it is logged once as slow past
//!   the rule's floor and the slowest recent step, and waited for up to the larger of `member_timeout_ms` and the step
//!   deadline ([`crate::deadline`]: a multiple of the slowest recent step, measured here as
//!   the time between counted steps; the ceiling before any step was measured), and only then
//!   fenced as stuck.
//! * **Too few nodes.** When the live nodes' slots cannot hold every expert, the machine says
//!   [`Action::WaitForNodes`] and waits for joins (a later plan restores or replans) — for at
//!   most [`JobConfig::wait_for_nodes_ms`], then the job fails saying what it waited for.
//! * **Checkpoints.** Members write their parts every `checkpoint_every_steps` steps
//!   ([`JobConfig::checkpoint_due`]); once every member the epoch began with wrote the parts of
//!   a step the driver is told to [`Action::CommitCheckpoint`]. A member lost before it wrote
//!   its parts (the dense state's writer, say) leaves that checkpoint uncommitted: the
//!   survivors' parts are not the whole state. The recovery resumes at that step (unless the
//!   survivors trained past it, which is logged) and its members write the checkpoint again
//!   before they train on ([`Reconfiguration::checkpoint_at_resume`]). A checkpoint that fails
//!   (a member could not write its parts, or the commit failed: [`Event::CheckpointFailed`]) is
//!   logged and never a node failure; training goes on and the next due checkpoint is a fresh
//!   try. Only `max_checkpoint_failures` failed checkpoints in a row (when set) end the job.
//! * **Non-finite steps.** A step whose loss or gradient was not finite on some member was
//!   trained by nobody: the members agreed (in the step's last collective) to skip its update,
//!   and report it with [`StepReport::nonfinite`]. It is counted (its data is consumed), and
//!   `max_nonfinite_steps` such steps in a row end the job: the state stopped improving and
//!   the learning rate is almost certainly too high.
//! * **Copies agree, at every step.** A member may report with a step the fingerprints of
//!   everything it holds after that step's update ([`StepReport::fingerprints`]: the dense
//!   state with its optimizer, each replica, each shard copy). When the step is counted, the
//!   copies of each object must have equal fingerprints; the first disagreement ends the job
//!   at once, naming the object, the two members and the step (a silent divergence would
//!   otherwise train on, and be checkpointed, for the rest of the job).
//! * **Done: a job that ends well holds its whole final state.** When every member finished
//!   the last step, the job stops only if (1) the members hold all of its state, as they
//!   reported it when they went idle: the dense state and a replica of every
//!   `(layer, expert)` (a copy of every shard, when sharded) — else it is recovered first, by
//!   the failure rules (a restore and the lost steps trained again, or an in-place repair) —
//!   and (2) with checkpoints on, the checkpoint of the last step is committed (it is always
//!   due, [`checkpoint_due`]); one that failed or lacks parts is written again after an
//!   in-place reconfiguration, [`FINAL_CHECKPOINT_TRIES`] tries in all, then the job fails
//!   saying so. Then every node is told to [`Action::Stop`]; the job is over when every node
//!   sent its state checksums, which must agree (one dense state, every replica of an expert
//!   and every copy of a shard identical) and cover the whole state; a member lost while
//!   stopping is excused only when the committed last-step checkpoint holds the state — else
//!   the job fails naming what is missing. Members that say they finished while steps are
//!   still uncounted (their reports never arrived) fail the job: it must not look complete.
//! * **Hosts.** Nodes that say they share a host ([`Event::Joined`]'s `host`: one node per GPU
//!   of the host) are placed per host — MRO over the hosts with `c·G` slots each, each host's
//!   slots split over its `G` nodes — and fail together: a node lost takes its host, whose
//!   other nodes are [`Action::Fence`]d at once (a GPU failure is treated as its host's). See
//!   [`hosts`].
//! * **Driver fail-over.** The machine is serde-serialisable: a driver saves it whole (before it
//!   performs the actions of an event: write-ahead) and a restarted driver deserialises it and
//!   calls [`JobMachine::recover`]. Every node then gets one heartbeat timeout to come back
//!   ([`Event::Reattached`], with what its worker holds); [`reconcile`] decides per node
//!   whether it is kept (and which commands the crash may have swallowed are sent again) or
//!   dropped, and the recovery resumes training in place when every node came back
//!   consistent, or goes through the failure rules above otherwise.

pub mod hosts;
pub mod reconcile;
mod sharded;

pub use sharded::RankShardTransfer;
pub mod relayout;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::data::{DataPlanError, GlobalBatch};
use crate::deadline::{Basis, DeadlineError, Limit, StepDeadline, StepTimes};
use crate::migrate::{
    Held, Holders, MappingMethod, MigrationPlan, PhysicalNode, lost_experts, lost_experts_held,
};
use crate::{
    Aggregation, Alignment, AllocPolicy, ClusterSpec, LoadHistory, ModelPlan, ModelSpec,
    PlacePolicy, PlanError, ReplanOptions, plan_model, replan, replan_held,
};

/// A node id given by the driver; never reused within a job.
pub type NodeId = u32;

/// Everything the machine decides with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobConfig {
    pub model: ModelSpec,
    /// Expert-replica slots per node (`c`).
    pub slots_per_node: usize,
    /// Steps to train in all.
    pub total_steps: u64,
    /// The first plan waits for this many ready workers.
    pub initial_nodes: usize,
    /// A node is gone once its last heartbeat is more than this old.
    pub heartbeat_timeout_ms: u64,
    /// A member that does not answer (go idle, finish a reconfiguration, make progress, become
    /// ready) within this long is declared failed and fenced.
    pub member_timeout_ms: u64,
    /// Lazy scale-out: ready newcomers join this long after the first of them became ready.
    pub scale_out_wait_ms: u64,
    /// With too few nodes to hold every expert, the job waits this long for joins, then
    /// fails (0: waits for ever, as a replay of a trace whose nodes come back does).
    #[serde(default)]
    pub wait_for_nodes_ms: u64,
    /// Replan from the routing history every this many counted steps (0: never).
    pub rebalance_every_steps: u64,
    /// Members write a checkpoint every this many steps (0: no checkpoints).
    pub checkpoint_every_steps: u64,
    /// Start from the newest checkpoint instead of a fresh model.
    pub resume: bool,
    /// This many counted steps in a row whose update was skipped for a non-finite loss or
    /// gradient end the job (at least 1).
    #[serde(default = "default_max_nonfinite_steps")]
    pub max_nonfinite_steps: u64,
    /// This many failed checkpoints in a row end the job (0: never; training goes on without).
    #[serde(default)]
    pub max_checkpoint_failures: u64,
    /// How long a member whose worker heartbeats ([`Event::WorkerAlive`]) may keep the job
    /// waiting (see "Slow is not dead" in the [module docs](self)); `None`: `member_timeout_ms`
    /// for every member.
    #[serde(default)]
    pub step_deadline: Option<StepDeadline>,
    pub aggregation: Aggregation,
    pub alloc: AllocPolicy,
    pub place: PlacePolicy,
    pub mapping: MappingMethod,
    /// Bytes of one expert's state (weights + optimizer), for the migration estimates.
    pub bytes_per_expert: u64,
    /// Experts are fully sharded over the members (FSEP: member `w` holds shard `w` of every
    /// expert, cut for the membership of the start or restore) instead of replicated: a lost
    /// member loses its shard of every expert and restores the checkpoint; a newcomer joins in
    /// place (shards re-placed over the new membership, see the `sharded` submodule); a
    /// rebalance over the same members moves no state. With `shard_copies` ≥ 2, see
    /// [`JobConfig::shard_copies`].
    #[serde(default)]
    pub sharded_experts: bool,
    /// Sharded experts: copies of every shard, on distinct members (`f`, placed by
    /// [`crate::fsep::place`]); with 2 or more a lost member is repaired in place while every
    /// shard keeps a copy (see the `sharded` submodule). 1: the behaviour above.
    #[serde(default = "default_shard_copies")]
    pub shard_copies: usize,
    /// The policy of the periodic rebalance ([`relayout`]): Lazarus's replan (the default) or
    /// LAER's re-layout from the per-rank traffic.
    #[serde(default)]
    pub relayout: relayout::Relayout,
    /// Replicated experts: how a rebalance that moves replicas is carried out (see the
    /// [module docs](self)): a pause and a reconfiguration (the default), or a
    /// [`LayoutSwitch`] with transfers the members stream while they train.
    #[serde(default)]
    pub replica_migration: ReplicaMigration,
    /// A constant global batch (see [`crate::data`]): every step trains the next `B` positions
    /// of the global sample order, split over the members by [`GlobalBatch::share`]; the data
    /// cursor is part of the machine's state, of every reconfiguration and checkpoint, and
    /// every member's report of what it trained is checked against the rule. `None`: each
    /// member trains its own batch (the paper's behaviour; the global batch follows the
    /// membership).
    #[serde(default)]
    pub global_batch: Option<GlobalBatch>,
    /// Replicated experts: how an in-place recovery (a failure or a join) lays out the
    /// experts — the paper's full replan, or a repair of the layout in force with the replan
    /// deferred to the next rebalance ([`RecoveryPolicy`]).
    #[serde(default)]
    pub recovery: RecoveryPolicy,
    /// [`RecoveryPolicy::Repair`]: see [`crate::repair::RepairOptions::load_slack`].
    #[serde(default = "default_repair_load_slack")]
    pub repair_load_slack: f64,
    /// [`RecoveryPolicy::Repair`]: the background re-optimisation is brought forward to the
    /// next step when the repaired layout's probability of surviving `f` more failures is
    /// below the full replan's by more than this (absolute).
    #[serde(default = "default_reoptimise_margin")]
    pub reoptimise_margin: f64,
    /// [`RecoveryPolicy::Repair`]: the re-optimisation is also brought forward when the
    /// repaired layout's busiest replica carries more than this many times what the full
    /// replan's would on the routing window's loads
    /// ([`crate::repair::load_ratio_against_replan`]): a layout made stale by drift, or the
    /// first plan made before any routing was seen, is not kept until the next rebalance.
    #[serde(default = "default_reoptimise_load_ratio")]
    pub reoptimise_load_ratio: f64,
}

/// How an in-place recovery of replicated experts re-lays the model (issue 42).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryPolicy {
    /// The paper's rule (§4.3): Eq. 1 on the routing window's loads and MRO over the
    /// survivors and newcomers, mapped onto them to move the fewest states. Every failure and
    /// join re-lays the whole model: about 131,000 expert states per node loss at 16,384
    /// nodes.
    #[default]
    Replan,
    /// Repair first ([`crate::repair`]): the survivors keep their rows; only the replicas a
    /// floor (`min(f, N)` distinct nodes) or the load bound needs are copied now, newcomers'
    /// slots take hot experts; the full replan follows as the next rebalance (through the
    /// asynchronous migration where configured), brought forward when the repaired layout's
    /// recovery probability falls short of the replan's by more than
    /// [`JobConfig::reoptimise_margin`]. A failure of the repair (no donor slot can keep a
    /// floor; holdings that are not full rows) falls back to the replan, logged.
    Repair,
}

impl RecoveryPolicy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Replan => "replan",
            Self::Repair => "repair",
        }
    }
}

impl std::str::FromStr for RecoveryPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "replan" => Ok(Self::Replan),
            "repair" => Ok(Self::Repair),
            _ => Err(format!(
                "unknown recovery policy {s:?} (expected replan or repair)"
            )),
        }
    }
}

impl std::fmt::Display for RecoveryPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn default_repair_load_slack() -> f64 {
    crate::repair::DEFAULT_LOAD_SLACK
}

/// An absolute shortfall of 1 % in the probability of surviving the next `f` failures.
pub const DEFAULT_REOPTIMISE_MARGIN: f64 = 0.01;

fn default_reoptimise_margin() -> f64 {
    DEFAULT_REOPTIMISE_MARGIN
}

/// 10 % slower than the replan's busiest replica.
pub const DEFAULT_REOPTIMISE_LOAD_RATIO: f64 = 1.1;

fn default_reoptimise_load_ratio() -> f64 {
    DEFAULT_REOPTIMISE_LOAD_RATIO
}

/// How a rebalance of replicated experts moves the replicas the new layout adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplicaMigration {
    /// Pause every member, reconfigure, migrate over the new mesh, resume.
    #[default]
    Blocking,
    /// No pause: the members get an [`Action::SwitchLayout`] carrying the transfers, copy the
    /// replicas in the background (a copy taken at an agreed boundary, caught up by replaying
    /// the updates since) and switch at the first boundary where every copy arrived. Not with
    /// host-aware placement (its replan may renumber the members).
    Async,
}

fn default_shard_copies() -> usize {
    1
}

impl JobConfig {
    /// Defaults of the paper where it has them (`f` from `model`, Eq. 1 + MRO, rebalance every
    /// 200 steps over a 200-step window, 2 min lazy scale-out) and of `lzrun` otherwise.
    pub fn new(model: ModelSpec, slots_per_node: usize, total_steps: u64) -> Self {
        Self {
            model,
            slots_per_node,
            total_steps,
            initial_nodes: 1,
            heartbeat_timeout_ms: 10_000,
            member_timeout_ms: 30_000,
            scale_out_wait_ms: 0,
            wait_for_nodes_ms: 0,
            rebalance_every_steps: 0,
            checkpoint_every_steps: 0,
            resume: false,
            max_nonfinite_steps: default_max_nonfinite_steps(),
            max_checkpoint_failures: 0,
            step_deadline: None,
            aggregation: Aggregation::Sum { window_steps: 200 },
            alloc: AllocPolicy::Lazarus,
            place: PlacePolicy::Mro,
            mapping: MappingMethod::Optimal,
            bytes_per_expert: 0,
            sharded_experts: false,
            shard_copies: default_shard_copies(),
            relayout: relayout::Relayout::Lazarus,
            replica_migration: ReplicaMigration::Blocking,
            global_batch: None,
            recovery: RecoveryPolicy::Replan,
            repair_load_slack: default_repair_load_slack(),
            reoptimise_margin: default_reoptimise_margin(),
            reoptimise_load_ratio: default_reoptimise_load_ratio(),
        }
    }

    /// Whether members write a checkpoint once `completed_steps` steps are done (a fresh start
    /// writes one at step 0, so a lost expert before the first periodic one is recoverable).
    /// The last step's state is always checkpointed: a job that ends holds its final state on
    /// disk, whatever the cadence (see "Done" in the [module docs](JobMachine)).
    pub fn checkpoint_due(&self, completed_steps: u64) -> bool {
        checkpoint_due(
            self.checkpoint_every_steps,
            self.total_steps,
            completed_steps,
        )
    }

    pub fn validate(&self) -> Result<(), JobConfigError> {
        self.model.validate()?;
        ClusterSpec::new(1, self.slots_per_node).validate()?;
        LoadHistory::new(self.aggregation, self.model.layers, self.model.experts)?;
        for (name, v) in [
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
            ("member_timeout_ms", self.member_timeout_ms),
            ("initial_nodes", self.initial_nodes as u64),
            ("max_nonfinite_steps", self.max_nonfinite_steps),
            ("shard_copies", self.shard_copies as u64),
        ] {
            if v == 0 {
                return Err(JobConfigError::Zero(name));
            }
        }
        if let Some(d) = &self.step_deadline {
            d.validate()?;
        }
        if let Some(b) = &self.global_batch {
            b.validate()?;
        }
        if !(self.repair_load_slack.is_finite() && self.repair_load_slack >= 0.0) {
            return Err(JobConfigError::Range(
                "repair_load_slack",
                "a finite number ≥ 0",
            ));
        }
        if !(0.0..=1.0).contains(&self.reoptimise_margin) {
            return Err(JobConfigError::Range(
                "reoptimise_margin",
                "between 0 and 1",
            ));
        }
        Ok(())
    }
}

/// Whether a job of `total_steps` that checkpoints every `every_steps` steps (0: never) writes
/// a checkpoint once `completed_steps` are done: every multiple of the cadence (a fresh start
/// writes one at step 0) and the last step. One function for the machine and the workers.
pub fn checkpoint_due(every_steps: u64, total_steps: u64, completed_steps: u64) -> bool {
    every_steps > 0
        && (completed_steps.is_multiple_of(every_steps) || completed_steps == total_steps)
}

/// How many times the checkpoint of the last step is tried before the job fails saying so.
pub const FINAL_CHECKPOINT_TRIES: u64 = 3;

/// When a member whose worker heartbeats is logged as slow: past the floor, and past the
/// slowest recent step (a job whose every step is long is not slow at each of them).
fn slow_after_ms(floor_ms: u64, limit: Limit) -> u64 {
    match limit.basis {
        Basis::WarmUp => floor_ms,
        Basis::Measured { slowest_ms } => floor_ms.max(slowest_ms),
    }
}

/// A few skipped steps in a row can be a transient spike; more means training diverged.
fn default_max_nonfinite_steps() -> u64 {
    3
}

/// A configuration the machine cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum JobConfigError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("{0} must be {1}")]
    Range(&'static str, &'static str),
    #[error(transparent)]
    Deadline(#[from] DeadlineError),
    #[error(transparent)]
    Data(#[from] DataPlanError),
}

/// What a member reports about one step it trained.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepReport {
    /// JSON has no NaN: a non-finite loss is written as `null` and read back as NaN.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    pub tokens: u64,
    pub step_ms: f64,
    /// Routed tokens `[layer][expert]` of this member (empty: none reported).
    pub routing: Vec<Vec<u64>>,
    /// The loss or a gradient of this step was not finite on some member, and every member
    /// skipped the update (the decision is collective, so replicas stay identical).
    #[serde(default)]
    pub nonfinite: bool,
    /// CPU milliseconds this member spent computing its experts (forward and backward).
    #[serde(default)]
    pub expert_ms: f64,
    /// Token rows this member computed through its experts (forward).
    #[serde(default)]
    pub expert_tokens: u64,
    /// Bytes this member sent to other members during the step.
    #[serde(default)]
    pub sent_bytes: u64,
    /// Bytes of replica copies this member sends in the background for a [`LayoutSwitch`]
    /// with transfers (reported once, with the first step after the copies started).
    #[serde(default)]
    pub copy_bytes: u64,
    /// The plan version of the layout the step ran on (0: not reported). It differs from the
    /// epoch's plan after a [`LayoutSwitch`].
    #[serde(default)]
    pub layout_version: u64,
    /// Fingerprints of everything the member holds after the step's update (see "Copies
    /// agree" in the [module docs](JobMachine)); `None`: not taken at this step.
    #[serde(default)]
    pub fingerprints: Option<StateChecksums>,
    /// With a global batch: what the member trained ([`JobConfig::global_batch`]).
    #[serde(default)]
    pub data: Option<StepData>,
    /// Milliseconds of the step this member spent getting its batch (part of `step_ms`).
    #[serde(default)]
    pub data_wait_ms: f64,
    /// The held-out loss after the step's update, when the job evaluated at this step (every
    /// member computes the same value); `None`: not evaluated. NaN (`null` in JSON) when it
    /// was not finite.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "some_nan_if_null"
    )]
    pub eval_loss: Option<f64>,
}

/// What a member trained of a global batch: the step's cursor as it saw it, its micro-batches
/// and the sequences they held (`(source, sequence)` in position order).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepData {
    pub cursor: u64,
    pub first_micro_batch: u64,
    pub micro_batches: u64,
    #[serde(default)]
    pub sequences: Vec<(u32, u64)>,
}

/// One member's sequences of a counted step (for `samples.csv`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberSamples {
    pub node: NodeId,
    /// The node's name (what `samples.csv` calls the member).
    #[serde(default)]
    pub name: String,
    pub rank: usize,
    /// The position of `sequences[0]` in the global order.
    pub first_position: u64,
    pub sequences: Vec<(u32, u64)>,
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// A field that is present: `null` (how JSON writes NaN) is `Some(NaN)`; an absent one is
/// `None` through `#[serde(default)]`.
fn some_nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    nan_if_null(d).map(Some)
}

/// Why a member's worker is idle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum IdleReason {
    /// A step or a reconfiguration failed (and was discarded).
    Failed(String),
    /// Paused or aborted at a step boundary, as asked.
    Paused,
    /// Trained every step.
    Finished,
}

/// Fingerprints of what a worker holds: at a step boundary ([`StepReport::fingerprints`]) or
/// at the end ([`Event::Done`]). Copies of one object must have equal fingerprints.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StateChecksums {
    /// Dense model + optimizer state.
    pub dense: u64,
    /// `(layer, expert, checksum)` of every replica held.
    pub replicas: Vec<(u32, u32, u64)>,
    /// Sharded experts: `(shard, checksum)` of every shard copy held (each folds that slice of
    /// every expert of every layer, with its optimizer state).
    #[serde(default)]
    pub shards: Vec<(u32, u64)>,
}

/// What a member reports holding when it stops ([`Event::Idle`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Holdings {
    /// `[layer]`: the expert ids held now (empty: nothing).
    Lists(Vec<Vec<u32>>),
    /// Exactly what plan `version` assigned to this node, for drivers whose members cannot
    /// diverge from their plan (the simulator). The machine then reads the node's rows of its
    /// own plan of that version instead of receiving a copy: at 2,048 nodes × 58 layers the
    /// copies and their release were about a fifth of a replayed reconfiguration. A version
    /// the machine's plan is not at counts as holding nothing (and is logged).
    Planned { version: u64 },
}

impl From<Vec<Vec<u32>>> for Holdings {
    fn from(lists: Vec<Vec<u32>>) -> Self {
        Holdings::Lists(lists)
    }
}

/// Something that happened, reported by the driver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// A node was admitted under `node` (credentials are the driver's business); `name` orders
    /// the first plan's ranks.
    Joined {
        node: NodeId,
        name: String,
        /// The physical host the node runs on, shared by the nodes (one per GPU) of one host;
        /// `None`: the node is a host of its own (see "Hosts" in the [module docs](self)).
        #[serde(default)]
        host: Option<String>,
    },
    /// The node's worker can take part in a plan.
    Ready {
        node: NodeId,
    },
    /// The node's agent is alive.
    Heartbeat {
        node: NodeId,
    },
    /// The node's worker is alive: it heartbeats from a thread of its own, so it does while it
    /// computes a long step, and stops when the process is stopped, frozen or dead. From the
    /// first one on, the worker's silence makes the node gone (see the [module docs](self)).
    WorkerAlive {
        node: NodeId,
    },
    /// The node is gone (closed connection, goodbye, killed).
    Lost {
        node: NodeId,
        reason: String,
    },
    /// A member trained `step` in `epoch`.
    Stepped {
        node: NodeId,
        epoch: u64,
        step: u64,
        report: StepReport,
    },
    /// Every member of `epoch` trained the steps `first..=last` (for drivers that model the
    /// members as one, like the simulator); counted like a full set of [`Event::Stepped`].
    StepsDone {
        epoch: u64,
        first: u64,
        last: u64,
        routing: Vec<Vec<u64>>,
    },
    /// The node's worker stopped in `epoch` and waits; `step` is the next step it would train
    /// and `held` the expert ids it holds now.
    Idle {
        node: NodeId,
        epoch: u64,
        why: IdleReason,
        step: u64,
        held: Holdings,
    },
    /// The node applied the reconfiguration of `epoch`.
    Migrated {
        node: NodeId,
        epoch: u64,
        bytes_in: u64,
    },
    /// A member wrote its parts of the checkpoint taken after `step` completed steps.
    CheckpointWritten {
        node: NodeId,
        epoch: u64,
        step: u64,
    },
    /// Answers to [`Action::CommitCheckpoint`].
    CheckpointCommitted {
        step: u64,
    },
    /// The commit of `step` failed, or a member of the current epoch could not write its parts
    /// of it (then no commit is asked for that step).
    CheckpointFailed {
        step: u64,
        error: String,
    },
    /// Answers to [`Action::FindCheckpoint`]: the newest valid checkpoint, or why there is none.
    CheckpointFound {
        step: u64,
        /// The data cursor saved with it (a global batch; `None`: a checkpoint without one).
        #[serde(default)]
        data_cursor: Option<u64>,
    },
    CheckpointMissing {
        error: String,
    },
    /// The node's worker stopped (after [`Action::Stop`]) with these checksums.
    Done {
        node: NodeId,
        checksums: StateChecksums,
    },
    /// The driver injected a fault now (starts the detection clock of the recovery record).
    FaultInjected,
    /// The node came back to a (restarted) driver and reports what its worker holds; see
    /// [`reconcile`].
    Reattached {
        node: NodeId,
        report: reconcile::WorkerReport,
    },
    /// Time passes: expiries and timeouts.
    Tick,
}

/// Why a reconfiguration happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReconfigKind {
    /// The first plan (fresh or resumed).
    Start,
    Rebalance,
    Join,
    InPlace,
    /// Some expert lost every replica: every member restores a checkpoint.
    Restore,
}

impl ReconfigKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Start => "start",
            Self::Rebalance => "rebalance",
            Self::Join => "join",
            Self::InPlace => "in-place",
            Self::Restore => "checkpoint",
        }
    }
}

/// Where the members' state comes from in a [`Reconfiguration`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateSource {
    /// Initialised from the seed (every member the same values).
    Fresh,
    /// Kept; missing replicas arrive as transfers; ranks in `dense_to` receive the dense state
    /// from rank `dense_from`.
    Peers {
        dense_from: usize,
        dense_to: Vec<usize>,
    },
    /// Every member loads the checkpoint of `step`.
    Checkpoint { step: u64 },
}

/// One expert state to move, between ranks of the new membership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankTransfer {
    pub layer: usize,
    pub expert: usize,
    pub src_rank: usize,
    pub dst_rank: usize,
}

/// A new membership and plan, for every member.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reconfiguration {
    pub kind: ReconfigKind,
    /// Strictly increasing; a member never talks to a peer of another epoch.
    pub epoch: u64,
    /// The plan; `plan.node_map` are the members in rank order.
    pub plan: ModelPlan,
    pub transfers: Vec<RankTransfer>,
    pub source: StateSource,
    /// The step every member trains next.
    pub resume_step: u64,
    /// The planner's estimate of the bytes migrated.
    pub migration_bytes: u64,
    /// The largest bytes one member sends / receives (planner estimate).
    pub max_sent_bytes: u64,
    pub max_recv_bytes: u64,
    /// Sharded experts: `[shard]` = the ranks holding a copy, ascending (empty otherwise).
    #[serde(default)]
    pub shard_holders: Vec<Vec<usize>>,
    /// Sharded experts: shard copies to rebuild before training (an in-place repair).
    #[serde(default)]
    pub shard_transfers: Vec<RankShardTransfer>,
    /// A global batch: the data cursor at `resume_step` (rewound with a checkpoint restore).
    #[serde(default)]
    pub data_cursor: Option<u64>,
    /// The members write the checkpoint of `resume_step` before they train on: it is due and
    /// not committed (a fresh start's, the last step's, or one whose parts a lost member never
    /// wrote; see "Checkpoints" in the [module docs](JobMachine)).
    #[serde(default)]
    pub checkpoint_at_resume: bool,
}

impl Reconfiguration {
    pub fn members(&self) -> &[NodeId] {
        &self.plan.node_map
    }

    /// `[layer][expert][rank]` replica counts (one rank per member).
    pub fn replicas_per_member(&self) -> Vec<Vec<Vec<u32>>> {
        replicas_per_rank(&self.plan)
    }
}

/// `[layer][expert][rank]` replica counts of `plan` (one rank per member of `node_map`).
fn replicas_per_rank(plan: &ModelPlan) -> Vec<Vec<Vec<u32>>> {
    let world = plan.node_map.len();
    let experts = plan.model.experts;
    plan.layers
        .iter()
        .map(|layer| {
            let mut r = vec![vec![0u32; world]; experts];
            for (rank, slots) in layer.grid().iter().enumerate() {
                for &e in slots {
                    r[e as usize][rank] += 1;
                }
            }
            r
        })
        .collect()
}

/// Steps past the newest reported one at which a [`LayoutSwitch`] may take effect at the
/// earliest (the members agree on the exact boundary themselves; see the [module docs](self)).
pub const SWITCH_LEAD_STEPS: u64 = 2;

/// A new layout for the members of `epoch`, without a reconfiguration: sharded experts move
/// nothing (the layout is the index table of the shard all-to-all); replicated experts
/// ([`ReplicaMigration::Async`]) copy the replicas `transfers` names while they train and
/// switch once every copy arrived.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayoutSwitch {
    pub epoch: u64,
    /// The new plan: the same members, ranks and shard placement; `plan.version` names the
    /// layout.
    pub plan: ModelPlan,
    /// The first step that may run on it (the members switch at the first boundary from here
    /// at which every one of them holds it, and, with transfers, every copy arrived).
    pub from_step: u64,
    /// Replicated experts: the replica copies the new layout needs, between ranks of the
    /// epoch (empty with sharded experts).
    #[serde(default)]
    pub transfers: Vec<RankTransfer>,
}

impl LayoutSwitch {
    /// `[layer][expert][rank]` replica counts of the new layout (one rank per member).
    pub fn replicas_per_member(&self) -> Vec<Vec<Vec<u32>>> {
        replicas_per_rank(&self.plan)
    }
}

/// A [`LayoutSwitch`] sent and not yet seen in force.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PendingSwitch {
    switch: LayoutSwitch,
    since_ms: u64,
    /// Counted steps when it was decided.
    at_step: u64,
}

/// One counted step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: u64,
    pub plan_version: u64,
    /// Mean loss over the members.
    pub loss: f64,
    pub tokens: u64,
    /// Slowest member's step time.
    pub step_ms: f64,
    pub members: usize,
    pub live_nodes: usize,
    /// Per member in rank order: [`StepReport::expert_ms`] and [`StepReport::expert_tokens`].
    #[serde(default)]
    pub expert_ms: Vec<f64>,
    #[serde(default)]
    pub expert_tokens: Vec<u64>,
    /// Bytes all members sent to each other during the step.
    #[serde(default)]
    pub sent_bytes: u64,
    /// Bytes of background replica copies all members reported with the step
    /// ([`StepReport::copy_bytes`]).
    #[serde(default)]
    pub copy_bytes: u64,
    /// Routed tokens `[layer][expert]` summed over the members: what the step added to the
    /// routing history (empty when no member reported routing). Drivers record it so a
    /// replay can feed the same history (`lzsim predict`).
    #[serde(default)]
    pub routing: Vec<Vec<u64>>,
    /// A global batch: the cursor of the step's first sequence.
    #[serde(default)]
    pub data_cursor: Option<u64>,
    /// A global batch: the sequences each member trained, in rank order.
    #[serde(default)]
    pub samples: Vec<MemberSamples>,
    /// The longest [`StepReport::data_wait_ms`] of the members: a synchronous step waits for
    /// its slowest input.
    #[serde(default)]
    pub data_wait_ms: f64,
    /// The held-out loss after the step's update ([`StepReport::eval_loss`]) when every member
    /// reported the same one; NaN when they disagree (logged) or it was not finite; `None`
    /// when the step was not evaluated.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "some_nan_if_null"
    )]
    pub eval_loss: Option<f64>,
}

/// A completed reconfiguration, with its phases (the replan time is the driver's to measure).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReconfigRecord {
    pub kind: ReconfigKind,
    pub epoch: u64,
    pub plan_version: u64,
    /// Steps counted when the cause was noticed.
    pub at_step: u64,
    pub resume_step: u64,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub transfers: usize,
    /// Bytes the members reported receiving.
    pub bytes: u64,
    /// From the cause (fault, failure report, rebalance point, ready newcomer) to the plan.
    pub detect_ms: f64,
    /// From the plan to the last member's `Migrated`.
    pub migrate_ms: f64,
    /// From the last `Migrated` to the first counted step after it (0 if that came first).
    pub resume_ms: f64,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Action {
    /// Start the node's worker.
    StartWorker {
        node: NodeId,
    },
    /// Stop at the next step boundary all members agree on, then report [`Event::Idle`].
    Pause {
        node: NodeId,
    },
    /// Abort what the member does in `epoch` (a collective, a mesh being formed) and report
    /// [`Event::Idle`]: a peer is gone.
    Abort {
        node: NodeId,
        epoch: u64,
    },
    /// Send every member its part of this reconfiguration.
    Reconfigure(Box<Reconfiguration>),
    /// Send every member of `epoch` this layout while it trains (no pause; see the
    /// [module docs](self)); sending it again is harmless.
    SwitchLayout(Box<LayoutSwitch>),
    /// Send `node` its part of the reconfiguration of `epoch` (the last one issued) again: it
    /// never arrived (the driver crashed before delivering it, see [`reconcile`]).
    Resend {
        node: NodeId,
        epoch: u64,
    },
    /// Every member wrote its parts of the checkpoint of `step`: commit it atomically and answer
    /// [`Event::CheckpointCommitted`] or [`Event::CheckpointFailed`].
    CommitCheckpoint {
        step: u64,
        members: usize,
        plan_version: u64,
        /// The data cursor at `step` (a global batch), to save with the checkpoint.
        data_cursor: Option<u64>,
    },
    /// Find the newest valid checkpoint; answer [`Event::CheckpointFound`] or
    /// [`Event::CheckpointMissing`].
    FindCheckpoint,
    /// The node is declared failed: stop talking to it, kill its worker.
    Fence {
        node: NodeId,
        reason: String,
    },
    /// Stop the node's worker (it answers [`Event::Done`]).
    Stop {
        node: NodeId,
    },
    /// Too few nodes to hold every expert: wait for more.
    WaitForNodes {
        /// Registered nodes, ready or not.
        live: usize,
        /// Nodes that can hold every expert: once this many are ready, the job goes on.
        needed: usize,
        reason: String,
    },
    Record(StepRecord),
    Reconfigured(ReconfigRecord),
    Log(String),
    /// The job is over.
    Finished(Result<(), String>),
}

/// Where the job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Waiting for the first plan's nodes.
    Gathering,
    Training,
    /// Waiting for every member to be idle.
    Quiescing,
    /// Waiting for the driver to find a checkpoint.
    Restoring,
    /// Waiting for every member's `Migrated`.
    Reconfiguring,
    /// Too few nodes; waiting for joins.
    WaitingForNodes,
    /// Waiting for every node's checksums.
    Stopping,
    Over,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Node {
    name: String,
    joined_ms: u64,
    /// The agent's last heartbeat.
    last_seen_ms: u64,
    /// The worker's last heartbeat ([`Event::WorkerAlive`]); `None` before the first.
    worker_seen_ms: Option<u64>,
    ready: bool,
    /// Reported idle in the current epoch: why, next step, holdings.
    idle: Option<(IdleReason, u64, Holdings)>,
    /// Holds the job's dense state (completed a reconfiguration of the current lineage).
    has_state: bool,
    done: Option<StateChecksums>,
    /// The host the node shares with its siblings ([`Event::Joined`]); `None`: its own.
    #[serde(default)]
    host: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pending {
    kind: ReconfigKind,
    detect_ms: f64,
    sent_ms: u64,
    at_step: u64,
    resume_step: u64,
    nodes_before: usize,
    transfers: usize,
    waiting: BTreeSet<NodeId>,
    bytes: u64,
    /// A step was counted before the last `Migrated` arrived.
    stepped: bool,
}

/// A cause of the next reconfiguration, and since when.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Cause {
    kind: ReconfigKind,
    since_ms: u64,
    nodes_before: usize,
}

/// Tries of one step a member may fail in a row, each time first among the same members,
/// before it is fenced ([`JobMachine::count_repeated_failure`]).
pub const MAX_REPEATED_FAILURES: u32 = 3;

/// How long the name of a node fenced for repeated failures is refused at first (doubled at
/// each such fencing of the name, up to [`MAX_REPEATED_FAILURE_BACKOFF_MS`]).
pub const REPEATED_FAILURE_BACKOFF_MS: u64 = 10_000;
/// The longest back-off of [`REPEATED_FAILURE_BACKOFF_MS`].
pub const MAX_REPEATED_FAILURE_BACKOFF_MS: u64 = 600_000;

/// A member's failed tries of one step in a row, among one set of members.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RepeatedFailure {
    step: u64,
    members: Vec<NodeId>,
    tries: u32,
}

/// A recovery in progress ([`JobMachine::recover`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Recovery {
    since_ms: u64,
    /// Nodes of the saved state that have not come back (nor been lost) yet.
    awaiting: BTreeSet<NodeId>,
    /// Nodes that came back consistent.
    back: usize,
    /// Nodes lost or dropped since the restart: name, why.
    lost: Vec<(String, String)>,
}

/// See the [module docs](self). Serialisable whole, for a driver that must survive its own
/// crash (see [`reconcile`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobMachine {
    cfg: JobConfig,
    phase: Phase,
    nodes: BTreeMap<NodeId, Node>,
    /// Members of the plan in force, in rank order (lost ones removed).
    members: Vec<NodeId>,
    /// `members`, sorted, for the membership test of every report ([`Self::is_member`]):
    /// `members.contains` per report was quadratic over the reports of 200,000 members.
    /// Rebuilt wherever `members` changes; not saved (a restored machine scans `members`
    /// until its next plan, see [`Self::is_member`]).
    #[serde(skip)]
    members_sorted: Vec<NodeId>,
    epoch: u64,
    plan_version: u64,
    /// The last plan issued (the next replan's version base).
    plan: Option<ModelPlan>,
    cause: Option<Cause>,
    pending: Option<Pending>,
    /// A reconfiguration record waiting for the first step after it.
    resuming: Option<(ReconfigRecord, u64)>,
    /// The next step to count.
    next_step: u64,
    /// Per step, per member: reports until every member reported.
    step_reports: BTreeMap<u64, BTreeMap<NodeId, StepReport>>,
    checkpoint_parts: BTreeMap<u64, BTreeSet<NodeId>>,
    /// The newest checkpoint step this epoch asked to commit (a late duplicate of one of its
    /// parts must not commit it again).
    commit_asked: Option<u64>,
    last_committed: Option<u64>,
    /// `(epoch, step)` of the checkpoints that failed since the last commit (one entry per
    /// checkpoint however many members report its failure).
    failed_checkpoints: BTreeSet<(u64, u64)>,
    /// Counted steps in a row whose update was skipped (non-finite loss or gradient).
    nonfinite_run: u64,
    history: LoadHistory,
    /// Per-rank traffic and the pending LAER re-layout ([`relayout`]).
    #[serde(default)]
    relayout: relayout::RelayoutState,
    /// The current lineage was set up completely (Fresh/restore done on every member).
    lineage_complete: bool,
    /// Some reconfiguration completed on every member (the job has started).
    started: bool,
    /// Since when some ready node waits to join.
    join_waiting_since: Option<u64>,
    /// Since when the job waits for enough nodes to hold every expert.
    nodes_waiting_since: Option<u64>,
    /// Live nodes when the job last announced `WaitForNodes` (announced again when that
    /// changes and every node is ready: one became ready, or one was lost, and more are needed).
    #[serde(default)]
    waiting_announced_live: Option<usize>,
    /// When the phase last made progress (timeouts count from here).
    progress_ms: u64,
    /// A driver restart being reconciled.
    #[serde(default)]
    recovery: Option<Recovery>,
    /// Times between counted steps in training, for [`JobConfig::step_deadline`].
    step_times: StepTimes,
    /// Members logged as slow, with the start of the wait they were logged for (once each).
    slow_noted: BTreeMap<NodeId, u64>,
    /// Sharded experts: where the shard copies are.
    #[serde(default)]
    shards: sharded::Shards,
    /// A layout switch sent to the members and not yet seen in force.
    #[serde(default)]
    switch: Option<PendingSwitch>,
    /// Failed tries of the last step's checkpoint (see "Done" in the [module docs](self)).
    #[serde(default)]
    final_checkpoint_failures: u64,
    /// The last step's checkpoint failed in this epoch (kept apart from `failed_checkpoints`,
    /// which a later commit of an older step clears).
    #[serde(default)]
    final_checkpoint_failed: bool,
    /// Members that sent their final checksums ([`Event::Done`]) and then left (their agent
    /// exits after its worker stopped): name and checksums, for the end-of-job checks.
    #[serde(default)]
    stopped: BTreeMap<NodeId, (String, StateChecksums)>,
    /// A global batch: `(step, cursor)` the data cursor counts from (a fresh start's `(0, 0)`,
    /// or a restored checkpoint's); the cursor of step `s` is `cursor + (s - step) · B`.
    #[serde(default)]
    data_origin: (u64, u64),
    /// How the job ended ([`Action::Finished`]): `None` while it runs, and in a state saved
    /// before this was recorded.
    #[serde(default)]
    outcome: Option<Result<(), String>>,
    /// The name of every node that registered, lost ones too: messages name nodes by their
    /// names (`n3`), never by the ids the driver numbers them with as they register.
    #[serde(default)]
    names: BTreeMap<NodeId, String>,
    /// A repaired layout's recovery probability fell short of the replan's: the next counted
    /// step is a rebalance point ([`RecoveryPolicy::Repair`]).
    #[serde(default)]
    reoptimise_due: bool,
    /// Per node, the step it failed first in the last tries ([`Self::count_repeated_failure`]).
    #[serde(default)]
    repeated_failures: BTreeMap<NodeId, RepeatedFailure>,
    /// Names fenced for repeated failures: refused until when, and how often fenced so.
    #[serde(default)]
    backed_off: BTreeMap<String, (u64, u32)>,
}

impl JobMachine {
    pub fn new(cfg: JobConfig) -> Result<Self, JobConfigError> {
        cfg.validate()?;
        let history = LoadHistory::new(cfg.aggregation, cfg.model.layers, cfg.model.experts)?;
        let window_steps = cfg
            .step_deadline
            .map_or(StepDeadline::DEFAULT_WINDOW_STEPS, |d| d.window_steps);
        Ok(Self {
            cfg,
            phase: Phase::Gathering,
            nodes: BTreeMap::new(),
            members: Vec::new(),
            members_sorted: Vec::new(),
            epoch: 0,
            plan_version: 0,
            plan: None,
            cause: None,
            pending: None,
            resuming: None,
            next_step: 0,
            step_reports: BTreeMap::new(),
            checkpoint_parts: BTreeMap::new(),
            commit_asked: None,
            last_committed: None,
            failed_checkpoints: BTreeSet::new(),
            nonfinite_run: 0,
            history,
            relayout: relayout::RelayoutState::default(),
            lineage_complete: false,
            started: false,
            join_waiting_since: None,
            nodes_waiting_since: None,
            waiting_announced_live: None,
            progress_ms: 0,
            recovery: None,
            step_times: StepTimes::new(window_steps),
            slow_noted: BTreeMap::new(),
            shards: sharded::Shards::default(),
            switch: None,
            final_checkpoint_failures: 0,
            final_checkpoint_failed: false,
            stopped: BTreeMap::new(),
            data_origin: (0, 0),
            outcome: None,
            names: BTreeMap::new(),
            reoptimise_due: false,
            repeated_failures: BTreeMap::new(),
            backed_off: BTreeMap::new(),
        })
    }

    pub fn config(&self) -> &JobConfig {
        &self.cfg
    }

    /// Sets the recovery policy of a machine not yet started (a driver that builds its
    /// configuration in steps).
    pub fn set_recovery(&mut self, recovery: RecoveryPolicy) {
        debug_assert!(!self.started, "the policy is set before the job starts");
        self.cfg.recovery = recovery;
    }
    pub fn phase(&self) -> Phase {
        self.phase
    }
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    pub fn plan_version(&self) -> u64 {
        self.plan_version
    }
    /// Members of the plan in force, in rank order.
    pub fn members(&self) -> &[NodeId] {
        &self.members
    }
    /// Nodes the machine considers alive.
    pub fn live_nodes(&self) -> Vec<NodeId> {
        self.nodes.keys().copied().collect()
    }
    /// The next step to be counted (= steps counted in the current lineage).
    pub fn next_step(&self) -> u64 {
        self.next_step
    }
    /// The newest checkpoint the driver reported committed.
    /// A global batch: the data cursor (position of the first sequence) of `step`.
    pub fn data_cursor(&self, step: u64) -> Option<u64> {
        let b = self.cfg.global_batch?.sequences;
        let (s0, c0) = self.data_origin;
        Some(if step >= s0 {
            c0.saturating_add((step - s0).saturating_mul(b))
        } else {
            c0.saturating_sub((s0 - step).saturating_mul(b))
        })
    }

    pub fn last_committed_checkpoint(&self) -> Option<u64> {
        self.last_committed
    }
    /// The plan in force.
    pub fn plan(&self) -> Option<&ModelPlan> {
        self.plan.as_ref()
    }
    /// The layout switch sent to the members and not yet seen in force.
    pub fn pending_switch(&self) -> Option<&LayoutSwitch> {
        self.switch.as_ref().map(|p| &p.switch)
    }
    /// Loads `[layer][expert]` from the routing history.
    pub fn loads(&self) -> Vec<Vec<u64>> {
        self.history.loads()
    }
    /// Whether some reconfiguration completed on every member (training has begun).
    pub fn has_started(&self) -> bool {
        self.started
    }
    pub fn is_over(&self) -> bool {
        self.phase == Phase::Over
    }
    /// How the job ended: `Ok` finished, `Err` failed (why); `None` while it runs, or for a
    /// job that ended before its outcome was recorded in the saved state.
    pub fn outcome(&self) -> Option<&Result<(), String>> {
        self.outcome.as_ref()
    }
    /// Whether a driver restart is still being reconciled (some node of the saved state has
    /// neither come back nor been lost).
    pub fn is_recovering(&self) -> bool {
        self.recovery.is_some()
    }

    /// Takes the job back after the driver restarted from a saved copy of this machine (see
    /// [`reconcile`]): every node of the saved state gets one heartbeat timeout from `now_ms`
    /// to come back ([`Event::Reattached`]); the stall timeouts count from `now_ms` too. The
    /// driver's clock must go on from the saved one (`now_ms` not below the last time it fed).
    pub fn recover(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if self.phase == Phase::Over {
            return;
        }
        for n in self.nodes.values_mut() {
            n.last_seen_ms = n.last_seen_ms.max(now_ms);
            n.joined_ms = n.joined_ms.max(now_ms);
        }
        self.progress_ms = now_ms;
        if let Some(t) = self.join_waiting_since.as_mut() {
            *t = now_ms;
        }
        // A commit asked before the restart and never answered: the old driver may or may not
        // have made it, and nobody will answer now. The machine stops waiting for it (a driver
        // that finds it committed says [`Event::CheckpointCommitted`] after this call); the
        // last step's checkpoint is then written again if it is missing (found by the swarm's
        // fail-over mode: the job waited for ever at its end).
        if self
            .commit_asked
            .is_some_and(|s| self.last_committed.is_none_or(|c| c < s))
        {
            self.commit_asked = None;
        }
        self.recovery = Some(Recovery {
            since_ms: now_ms,
            awaiting: self.nodes.keys().copied().collect(),
            back: 0,
            lost: Vec::new(),
        });
        out.push(Action::Log(format!(
            "recovered the saved job state: {:?}, epoch {}, plan v{}, {} of {} steps counted; \
             waiting up to {} ms for {} nodes to come back",
            self.phase,
            self.epoch,
            self.plan_version,
            self.next_step,
            self.cfg.total_steps,
            self.cfg.heartbeat_timeout_ms,
            self.nodes.len()
        )));
        if self.phase == Phase::Restoring {
            // The old driver's answer to this request was lost with it.
            out.push(Action::FindCheckpoint);
        }
        self.recovery_progress(now_ms, out);
    }

    /// The machine's view of `node`, for [`reconcile::verdict`].
    fn view(&self, node: NodeId) -> Option<reconcile::NodeView> {
        let n = self.nodes.get(&node)?;
        Some(reconcile::NodeView {
            phase: self.phase,
            epoch: self.epoch,
            plan_version: self.plan_version,
            next_step: self.next_step,
            member: self.is_member(node),
            ready: n.ready,
            idle: n.idle.is_some(),
            migrating: self
                .pending
                .as_ref()
                .is_some_and(|p| p.waiting.contains(&node)),
            done: n.done.is_some(),
            pausing: self
                .cause
                .is_some_and(|c| matches!(c.kind, ReconfigKind::Join | ReconfigKind::Rebalance)),
            switching_to: self.switch.as_ref().map(|p| p.switch.plan.version),
        })
    }

    fn reattached(
        &mut self,
        node: NodeId,
        report: &reconcile::WorkerReport,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(view) = self.view(node) else {
            return;
        };
        if let Some(n) = self.nodes.get_mut(&node) {
            n.last_seen_ms = n.last_seen_ms.max(now_ms);
        }
        match reconcile::verdict(&view, report) {
            reconcile::Verdict::Keep(reissue) => {
                if let Some(r) = self.recovery.as_mut()
                    && r.awaiting.remove(&node)
                {
                    r.back += 1;
                }
                for what in reissue {
                    out.push(match what {
                        reconcile::Reissue::StartWorker => Action::StartWorker { node },
                        reconcile::Reissue::Reconfigure => Action::Resend {
                            node,
                            epoch: self.epoch,
                        },
                        reconcile::Reissue::Abort => Action::Abort {
                            node,
                            epoch: self.epoch,
                        },
                        reconcile::Reissue::Pause => Action::Pause { node },
                        reconcile::Reissue::Stop => Action::Stop { node },
                    });
                }
            }
            reconcile::Verdict::Drop(why) => self.fence(node, why, now_ms, out),
        }
        self.recovery_progress(now_ms, out);
    }

    /// Ends the recovery once every node of the saved state came back or was lost.
    fn recovery_progress(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if !self
            .recovery
            .as_ref()
            .is_some_and(|r| r.awaiting.is_empty())
        {
            return;
        }
        let r = self.recovery.take().expect("checked");
        let outcome = reconcile::outcome(r.back, &r.lost);
        out.push(Action::Log(format!(
            "controller recovery complete {} ms after the restart: {outcome}",
            now_ms.saturating_sub(r.since_ms)
        )));
    }
    /// The next step at which the machine plans a rebalance (for drivers that advance many
    /// steps at once).
    pub fn next_rebalance_step(&self) -> Option<u64> {
        // Due: once the next step is counted.
        if self.reoptimise_due && self.next_step + 2 < self.cfg.total_steps {
            return Some(self.next_step + 1);
        }
        let every = self.cfg.rebalance_every_steps;
        if every == 0 {
            return None;
        }
        let next = (self.next_step / every + 1) * every;
        (next + 1 < self.cfg.total_steps).then_some(next)
    }

    /// Feeds one event; the actions it causes are appended to `out`.
    pub fn handle(&mut self, now_ms: u64, event: Event, out: &mut Vec<Action>) {
        if self.phase == Phase::Over {
            return;
        }
        match event {
            Event::Joined { node, name, host } => self.joined(node, name, host, now_ms, out),
            Event::Ready { node } => self.ready(node, now_ms, out),
            Event::Heartbeat { node } => {
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.last_seen_ms = n.last_seen_ms.max(now_ms);
                }
            }
            Event::WorkerAlive { node } => {
                // Relayed by the agent: both are alive.
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.last_seen_ms = n.last_seen_ms.max(now_ms);
                    n.worker_seen_ms = Some(n.worker_seen_ms.map_or(now_ms, |t| t.max(now_ms)));
                }
            }
            Event::Lost { node, reason } => self.lose(node, &reason, now_ms, out),
            Event::Stepped {
                node,
                epoch,
                step,
                report,
            } => self.stepped(node, epoch, step, report, now_ms, out),
            Event::StepsDone {
                epoch,
                first,
                last,
                routing,
            } => self.steps_done(epoch, first, last, &routing, now_ms, out),
            Event::Idle {
                node,
                epoch,
                why,
                step,
                held,
            } => self.idle(node, epoch, why, step, held, now_ms, out),
            Event::Migrated {
                node,
                epoch,
                bytes_in,
            } => self.migrated(node, epoch, bytes_in, now_ms),
            Event::CheckpointWritten { node, epoch, step } => {
                self.checkpoint_written(node, epoch, step, out)
            }
            Event::CheckpointCommitted { step } => {
                self.last_committed = Some(self.last_committed.map_or(step, |s| s.max(step)));
                self.failed_checkpoints.clear();
                out.push(Action::Log(format!("{} committed", checkpoint_label(step))));
            }
            Event::CheckpointFailed { step, error } => self.checkpoint_failed(step, &error, out),
            Event::CheckpointFound { step, data_cursor } => {
                self.restore_from(step, data_cursor, now_ms, out)
            }
            Event::CheckpointMissing { error } => self.no_checkpoint(&error, out),
            Event::Done { node, checksums } => {
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.done = Some(checksums);
                }
            }
            Event::FaultInjected => self.note_cause(ReconfigKind::InPlace, now_ms),
            Event::Reattached { node, report } => self.reattached(node, &report, now_ms, out),
            Event::Tick => self.tick(now_ms, out),
        }
        self.progress(now_ms, out);
        self.recovery_progress(now_ms, out);
    }

    fn joined(
        &mut self,
        node: NodeId,
        name: String,
        host: Option<String>,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        if self.nodes.contains_key(&node) {
            return;
        }
        if self.phase == Phase::Stopping {
            out.push(Action::Stop { node });
            return;
        }
        if let Some(&(until_ms, _)) = self.backed_off.get(&name).filter(|b| now_ms < b.0) {
            out.push(Action::Fence {
                node,
                reason: format!(
                    "it failed its step try after try when last a member: refused for another \
                     {:.1} s (back-off)",
                    until_ms.saturating_sub(now_ms) as f64 / 1e3
                ),
            });
            return;
        }
        self.nodes.insert(
            node,
            Node {
                name: name.clone(),
                joined_ms: now_ms,
                last_seen_ms: now_ms,
                worker_seen_ms: None,
                ready: false,
                idle: None,
                has_state: false,
                done: None,
                host: host.clone(),
            },
        );
        self.names.insert(node, name.clone());
        out.push(Action::StartWorker { node });
        match host {
            Some(h) => out.push(Action::Log(format!("node {name} joined on host {h}"))),
            None => out.push(Action::Log(format!("node {name} joined"))),
        }
    }

    fn ready(&mut self, node: NodeId, now_ms: u64, out: &mut Vec<Action>) {
        let Some(n) = self.nodes.get_mut(&node) else {
            return;
        };
        if n.ready {
            return;
        }
        n.ready = true;
        let name = n.name.clone();
        if !self.is_member(node) && self.plan.is_some() {
            self.join_waiting_since.get_or_insert(now_ms);
            out.push(Action::Log(format!(
                "node {name} ready: joins at a step boundary"
            )));
        }
    }

    fn note_cause(&mut self, kind: ReconfigKind, now_ms: u64) {
        match &mut self.cause {
            Some(c) => c.kind = c.kind.max(kind),
            None => {
                self.cause = Some(Cause {
                    kind,
                    since_ms: now_ms,
                    nodes_before: self.members.len(),
                })
            }
        }
    }

    /// A member failed or is gone: every other member stops what it does.
    fn interrupt(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        self.note_cause(ReconfigKind::InPlace, now_ms);
        if matches!(self.phase, Phase::Training | Phase::Reconfiguring) {
            self.enter(Phase::Quiescing, now_ms);
            for &m in &self.members {
                if self.nodes[&m].idle.is_none() {
                    out.push(Action::Abort {
                        node: m,
                        epoch: self.epoch,
                    });
                }
            }
        }
    }

    fn enter(&mut self, phase: Phase, now_ms: u64) {
        self.phase = phase;
        self.progress_ms = now_ms;
    }

    fn lose(&mut self, node: NodeId, why: &str, now_ms: u64, out: &mut Vec<Action>) {
        let Some(n) = self.nodes.remove(&node) else {
            return;
        };
        if let Some(r) = self.recovery.as_mut() {
            r.awaiting.remove(&node);
            r.lost.push((n.name.clone(), why.to_owned()));
        }
        self.slow_noted.remove(&node);
        if n.done.is_some() || self.phase == Phase::Stopping {
            // No replan any more, but a member is a live node. Its final checksums still count
            // (a node leaves once its worker stopped).
            if let Some(done) = n.done.clone()
                && self.members.contains(&node)
            {
                self.stopped.insert(node, (n.name.clone(), done));
            }
            self.members.retain(|&m| m != node);
            self.members_sorted.retain(|&m| m != node);
            if let Some(p) = self.pending.as_mut() {
                p.waiting.remove(&node);
            }
            return;
        }
        out.push(Action::Log(format!("node {} is gone: {why}", n.name)));
        // A host fails whole: its other nodes (GPUs) are fenced with it (see "Hosts").
        let mut gone = vec![node];
        if let Some(host) = &n.host {
            let siblings: Vec<NodeId> = self
                .nodes
                .iter()
                .filter(|(_, m)| m.host.as_ref() == Some(host))
                .map(|(&id, _)| id)
                .collect();
            for sibling in siblings {
                let Some(s) = self.nodes.remove(&sibling) else {
                    continue;
                };
                let reason = format!("its host {host} failed with node {}", n.name);
                if let Some(r) = self.recovery.as_mut() {
                    r.awaiting.remove(&sibling);
                    r.lost.push((s.name.clone(), reason.clone()));
                }
                self.slow_noted.remove(&sibling);
                out.push(Action::Fence {
                    node: sibling,
                    reason: reason.clone(),
                });
                out.push(Action::Log(format!(
                    "node {} is gone: fenced: {reason}",
                    s.name
                )));
                gone.push(sibling);
            }
        }
        if self.members.iter().any(|m| gone.contains(m)) {
            // Noted before the members are dropped: the record counts them among the nodes
            // before.
            self.note_cause(ReconfigKind::InPlace, now_ms);
            self.members.retain(|m| !gone.contains(m));
            self.members_sorted.retain(|m| !gone.contains(m));
            if let Some(p) = self.pending.as_mut() {
                for g in &gone {
                    p.waiting.remove(g);
                }
            }
            self.interrupt(now_ms, out);
            // Steps every survivor reported were trained: count them (the survivors resume
            // after them).
            if !self.members.is_empty() && self.phase == Phase::Quiescing {
                self.count_reported(now_ms, out);
            }
        }
        if !self.ready_newcomer() {
            self.join_waiting_since = None;
        }
    }

    /// Counts a try of `step` that `node` failed first among the members in force, and
    /// returns its tries of that step in a row among these members. A node that fails every
    /// try alike (its data is missing on its host, its device is broken) was replanned with
    /// at once, for ever: ~15,000 epochs a minute, each logged. A change of members (a node
    /// lost meanwhile, whose loss the survivors failed first) starts the count again.
    fn count_repeated_failure(&mut self, node: NodeId, step: u64) -> u32 {
        let members = self.members.clone();
        let r = self
            .repeated_failures
            .entry(node)
            .or_insert_with(|| RepeatedFailure {
                step,
                members: members.clone(),
                tries: 0,
            });
        if r.step != step || r.members != members {
            *r = RepeatedFailure {
                step,
                members,
                tries: 0,
            };
        }
        r.tries += 1;
        r.tries
    }

    /// Refuses `name` for a back-off from `now_ms`, doubled at each such fencing of the
    /// name; its length. A fenced agent exits, but a supervisor may start it again, and each
    /// return would cost the job a join and `MAX_REPEATED_FAILURES` more tries.
    fn back_off(&mut self, name: String, now_ms: u64) -> u64 {
        let b = self.backed_off.entry(name).or_insert((0, 0));
        b.1 = b.1.saturating_add(1);
        let ms = REPEATED_FAILURE_BACKOFF_MS
            .saturating_mul(1 << (b.1 - 1).min(16))
            .min(MAX_REPEATED_FAILURE_BACKOFF_MS);
        b.0 = now_ms.saturating_add(ms);
        ms
    }

    /// Fences a node that stopped answering.
    fn fence(&mut self, node: NodeId, reason: String, now_ms: u64, out: &mut Vec<Action>) {
        if !self.nodes.contains_key(&node) {
            // Fenced already (with its host, say).
            return;
        }
        out.push(Action::Fence {
            node,
            reason: reason.clone(),
        });
        self.lose(node, &format!("fenced: {reason}"), now_ms, out);
    }

    fn tick(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        for (id, why) in self.gone(now_ms) {
            self.fence(id, why, now_ms, out);
        }
        self.fence_stuck(now_ms, out);
        if self.phase == Phase::Training
            && self
                .join_waiting_since
                .is_some_and(|t| now_ms.saturating_sub(t) >= self.cfg.scale_out_wait_ms)
        {
            self.note_cause(ReconfigKind::Join, now_ms);
            self.pause_members(now_ms, out);
        }
        let wait_ms = self.cfg.wait_for_nodes_ms;
        if self.phase == Phase::WaitingForNodes
            && wait_ms > 0
            && self
                .nodes_waiting_since
                .is_some_and(|t| now_ms.saturating_sub(t) > wait_ms)
        {
            self.enter(Phase::Over, now_ms);
            let why = format!(
                "gave up after waiting {:.0} s for nodes: {} experts need at least {} nodes of {} slots, {} live",
                wait_ms as f64 / 1e3,
                self.cfg.model.experts,
                self.cfg.model.experts.div_ceil(self.cfg.slots_per_node),
                self.cfg.slots_per_node,
                self.nodes.len()
            );
            self.fail(why, out);
        }
    }

    /// Nodes that are gone: their agent stopped heartbeating, or their worker did after it
    /// had started to (a stopped, frozen or dead process), with why.
    fn gone(&self, now_ms: u64) -> Vec<(NodeId, String)> {
        let hb = self.cfg.heartbeat_timeout_ms;
        self.nodes
            .iter()
            .filter_map(|(&id, n)| {
                let agent_ms = now_ms.saturating_sub(n.last_seen_ms);
                if agent_ms > hb {
                    let awaited = self
                        .recovery
                        .as_ref()
                        .is_some_and(|r| r.awaiting.contains(&id));
                    let why = if awaited {
                        format!("did not come back within {hb} ms of the controller's restart")
                    } else {
                        format!("no heartbeat from its agent for {agent_ms} ms")
                    };
                    return Some((id, why));
                }
                let worker_ms = now_ms.saturating_sub(n.worker_seen_ms?);
                (worker_ms > hb && n.done.is_none()).then(|| {
                    // The worker's heartbeats come through its agent: when the agent is silent
                    // too (far longer than its period), the agent is what stopped.
                    let why = if agent_ms > hb / 2 {
                        format!(
                            "no heartbeat from its agent for {agent_ms} ms nor from its worker \
                             for {worker_ms} ms (the agent, which relays the worker's, is \
                             stopped, frozen or cut off)"
                        )
                    } else {
                        format!(
                            "no heartbeat from its worker for {worker_ms} ms (the process is \
                             stopped, frozen or starved)"
                        )
                    };
                    (id, why)
                })
            })
            .collect()
    }

    /// The nodes the current phase waits for, each with since when and what it has not done.
    fn awaited(&self) -> Vec<(NodeId, u64, String)> {
        let since = self.progress_ms;
        match self.phase {
            Phase::Gathering | Phase::WaitingForNodes => self
                .nodes
                .iter()
                .filter(|(_, n)| !n.ready)
                .map(|(&id, n)| (id, n.joined_ms, "its worker never became ready".into()))
                .collect(),
            Phase::Quiescing => self
                .members
                .iter()
                .filter(|m| self.nodes[m].idle.is_none())
                .map(|&m| (m, since, "did not stop when asked".into()))
                .collect(),
            Phase::Reconfiguring => self
                .pending
                .iter()
                .flat_map(|p| p.waiting.iter())
                .map(|&m| (m, since, "did not finish the reconfiguration".into()))
                .collect(),
            Phase::Training => {
                // Whoever has not reported the next step keeps the job waiting.
                let reported = self.step_reports.get(&self.next_step);
                let step = self.next_step;
                self.members
                    .iter()
                    .filter(|m| !reported.is_some_and(|r| r.contains_key(m)))
                    .map(|&m| (m, since, format!("made no progress in step {step}")))
                    .collect()
            }
            Phase::Stopping => self
                .nodes
                .iter()
                .filter(|(_, n)| n.done.is_none())
                .map(|(&id, _)| (id, since, "did not stop when asked".into()))
                .collect(),
            Phase::Restoring | Phase::Over => Vec::new(),
        }
    }

    /// How long `node` may keep the job waiting: the step deadline (at least
    /// `member_timeout_ms`) when its worker heartbeats and the rule is set, else
    /// `member_timeout_ms`.
    fn member_deadline(&self, node: NodeId) -> (u64, Option<Limit>) {
        let alive = self
            .nodes
            .get(&node)
            .is_some_and(|n| n.worker_seen_ms.is_some());
        match &self.cfg.step_deadline {
            Some(rule) if alive => {
                let limit = rule.limit(&self.step_times);
                (limit.ms.max(self.cfg.member_timeout_ms), Some(limit))
            }
            _ => (self.cfg.member_timeout_ms, None),
        }
    }

    /// Logs members that are slow (their worker heartbeating, waited for longer than the step
    /// deadline's floor and than the slowest recent step) once per wait, and fences those past
    /// their deadline.
    fn fence_stuck(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let floor_ms = self.cfg.step_deadline.map_or(u64::MAX, |d| d.floor_ms);
        let mut stuck = Vec::new();
        let mut slow = Vec::new();
        for (id, since, what) in self.awaited() {
            let waited_ms = now_ms.saturating_sub(since);
            let (deadline_ms, limit) = self.member_deadline(id);
            if waited_ms > deadline_ms {
                let why = match limit {
                    None => format!("{what} within {deadline_ms} ms"),
                    Some(_) => format!(
                        "{what} within {:.1} s although its worker heartbeats (hung, or slower \
                         than the step deadline)",
                        deadline_ms as f64 / 1e3
                    ),
                };
                stuck.push((id, why));
            } else if let Some(limit) = limit
                && waited_ms > slow_after_ms(floor_ms, limit)
                && self.slow_noted.get(&id) != Some(&since)
            {
                self.slow_noted.insert(id, since);
                slow.push((id, waited_ms, what, limit));
            }
        }
        for (id, waited_ms, what, limit) in slow {
            let name = &self.nodes[&id].name;
            let deadline_ms = self.member_deadline(id).0;
            let up_to = if deadline_ms == limit.ms {
                limit.to_string()
            } else {
                format!("{:.1} s (the member timeout)", deadline_ms as f64 / 1e3)
            };
            out.push(Action::Log(format!(
                "node {name} is slow, not gone: {what} for {:.1} s, but its worker \
                 heartbeats; waiting up to {up_to}",
                waited_ms as f64 / 1e3,
            )));
        }
        for (id, why) in stuck {
            self.fence(id, why, now_ms, out);
        }
    }

    fn pause_members(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if self.phase != Phase::Training {
            return;
        }
        self.enter(Phase::Quiescing, now_ms);
        for &m in &self.members {
            out.push(Action::Pause { node: m });
        }
    }

    fn counting(&self, node: Option<NodeId>, epoch: u64) -> bool {
        epoch == self.epoch
            && node.is_none_or(|n| self.is_member(n))
            && matches!(
                self.phase,
                Phase::Training | Phase::Quiescing | Phase::Reconfiguring
            )
    }

    fn stepped(
        &mut self,
        node: NodeId,
        epoch: u64,
        step: u64,
        report: StepReport,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        if !self.counting(Some(node), epoch) || step < self.next_step {
            return;
        }
        self.step_reports
            .entry(step)
            .or_default()
            .entry(node)
            .or_insert(report);
        self.count_reported(now_ms, out);
    }

    /// Counts, in order, the steps every member reported.
    fn count_reported(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        while let Some(entry) = self.step_reports.first_entry() {
            // Reports come from members only: the full test once there are enough of them.
            if *entry.key() != self.next_step
                || entry.get().len() < self.members.len()
                || !self.members.iter().all(|m| entry.get().contains_key(m))
            {
                break;
            }
            let (step, by_node) = entry.remove_entry();
            let problems = diverged_copies(
                by_node
                    .iter()
                    .filter_map(|(&id, r)| r.fingerprints.as_ref().map(|f| (id, f))),
                |id| self.nodes.get(&id).map_or("", |n| n.name.as_str()),
            );
            if !problems.is_empty() {
                return self.fail(
                    format!(
                        "copies of the state diverged at step {step} (fingerprints taken after \
                         its update): {}",
                        problems.join("; ")
                    ),
                    out,
                );
            }
            let samples = match self.check_step_data(step, &by_node) {
                Ok(s) => s,
                Err(why) => return self.fail(why, out),
            };
            let on_switch = self.switch.as_ref().is_some_and(|p| {
                let v = p.switch.plan.version;
                self.members
                    .iter()
                    .all(|m| by_node.get(m).is_some_and(|r| r.layout_version == v))
            });
            if on_switch {
                self.switch_done(step, now_ms, out);
            }
            let mut routing: Vec<Vec<u64>> = Vec::new();
            for r in by_node.values().filter(|r| !r.routing.is_empty()) {
                add_counts(&mut routing, &r.routing);
            }
            let n = by_node.len().max(1) as f64;
            let nonfinite = by_node.values().any(|r| r.nonfinite);
            let record = StepRecord {
                step,
                epoch: self.epoch,
                plan_version: self.plan_version,
                loss: by_node.values().map(|r| r.loss).sum::<f64>() / n,
                tokens: by_node.values().map(|r| r.tokens).sum(),
                step_ms: by_node.values().map(|r| r.step_ms).fold(0.0, f64::max),
                members: self.members.len(),
                live_nodes: self.nodes.len(),
                expert_ms: self
                    .members
                    .iter()
                    .filter_map(|m| by_node.get(m))
                    .map(|r| r.expert_ms)
                    .collect(),
                expert_tokens: self
                    .members
                    .iter()
                    .filter_map(|m| by_node.get(m))
                    .map(|r| r.expert_tokens)
                    .collect(),
                sent_bytes: by_node.values().map(|r| r.sent_bytes).sum(),
                copy_bytes: by_node.values().map(|r| r.copy_bytes).sum(),
                routing: routing.clone(),
                data_cursor: self.data_cursor(step),
                samples,
                data_wait_ms: by_node.values().map(|r| r.data_wait_ms).fold(0.0, f64::max),
                eval_loss: self.agreed_eval_loss(step, &by_node, out),
            };
            if matches!(self.cfg.relayout, relayout::Relayout::Laer(_)) {
                let (agg, experts) = (self.cfg.aggregation, self.cfg.model.experts);
                self.relayout.observe(agg, experts, &self.members, &by_node);
            }
            self.count_steps(step, step, &routing, now_ms, out);
            out.push(Action::Record(record));
            if nonfinite {
                self.nonfinite_run += 1;
                let max = self.cfg.max_nonfinite_steps;
                out.push(Action::Log(format!(
                    "step {step}: non-finite loss or gradient, the update was skipped on every \
                     member ({} in a row, the limit is {max})",
                    self.nonfinite_run
                )));
                if self.nonfinite_run >= max {
                    return self.fail(
                        format!(
                            "training diverged: {} steps in a row (the last is step {step}) had \
                             a non-finite loss or gradient and were skipped; lower the \
                             learning rate (lr) or resume from an earlier checkpoint",
                            self.nonfinite_run
                        ),
                        out,
                    );
                }
            } else {
                self.nonfinite_run = 0;
            }
        }
    }

    /// The members' held-out loss of `step`: the one they all reported (the eval's all-reduce
    /// gives every member the same value); NaN, with a log line, when they disagree (some
    /// evaluated and some did not, or the values differ: a bug, not a fault); `None` when none
    /// evaluated.
    fn agreed_eval_loss(
        &self,
        step: u64,
        by_node: &BTreeMap<NodeId, StepReport>,
        out: &mut Vec<Action>,
    ) -> Option<f64> {
        let mut losses = by_node.values().map(|r| r.eval_loss);
        let first = losses.next().flatten();
        // Bit equality: NaN agrees with NaN (a diverged eval everywhere is one value).
        let same = |a: Option<f64>, b: Option<f64>| a.map(f64::to_bits) == b.map(f64::to_bits);
        if losses.all(|l| same(l, first)) {
            return first;
        }
        let seen: Vec<String> = by_node
            .iter()
            .map(|(id, r)| {
                let name = self.nodes.get(id).map_or("", |n| n.name.as_str());
                match r.eval_loss {
                    Some(l) => format!("{name} {l}"),
                    None => format!("{name} none"),
                }
            })
            .collect();
        out.push(Action::Log(format!(
            "step {step}: the members reported different eval losses ({}); recorded as NaN",
            seen.join(", ")
        )));
        Some(f64::NAN)
    }

    /// A global batch: every member trained exactly its share of the step's micro-batches, from
    /// the step's cursor (see [`crate::data`]); the sequences each trained, in rank order.
    fn check_step_data(
        &self,
        step: u64,
        by_node: &BTreeMap<NodeId, StepReport>,
    ) -> Result<Vec<MemberSamples>, String> {
        let (Some(b), Some(cursor)) = (self.cfg.global_batch, self.data_cursor(step)) else {
            return Ok(Vec::new());
        };
        let n = self.members.len();
        let mut out = Vec::with_capacity(n);
        for (rank, &node) in self.members.iter().enumerate() {
            let name = self.nodes.get(&node).map_or("", |x| x.name.as_str());
            let want = b.share(n, rank);
            let Some(d) = by_node.get(&node).and_then(|r| r.data.as_ref()) else {
                return Err(format!(
                    "step {step}: member {name} (rank {rank}) did not say what it trained of \
                     the global batch"
                ));
            };
            let got = d.first_micro_batch..d.first_micro_batch + d.micro_batches;
            if d.cursor != cursor || got != want {
                return Err(format!(
                    "step {step}: member {name} (rank {rank}) trained micro-batches {got:?} from \
                     data cursor {}, the plan gives it {want:?} from cursor {cursor}",
                    d.cursor
                ));
            }
            if d.sequences.len() as u64 != d.micro_batches * b.micro {
                return Err(format!(
                    "step {step}: member {name} (rank {rank}) reports {} sequences for {} \
                     micro-batches of {}",
                    d.sequences.len(),
                    d.micro_batches,
                    b.micro
                ));
            }
            out.push(MemberSamples {
                node,
                name: name.to_owned(),
                rank,
                first_position: b.positions(cursor, want.start).start,
                sequences: d.sequences.clone(),
            });
        }
        Ok(out)
    }

    fn steps_done(
        &mut self,
        epoch: u64,
        first: u64,
        last: u64,
        routing: &[Vec<u64>],
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        if !self.counting(None, epoch) || first != self.next_step || last < first {
            return;
        }
        // Members modelled as one switch at the first step they may.
        if let Some(from) = self.switch.as_ref().map(|p| p.switch.from_step)
            && last >= from
        {
            self.switch_done(from.max(first), now_ms, out);
        }
        self.count_steps(first, last, routing, now_ms, out);
    }

    /// Steps `first..=last` completed on every member.
    fn count_steps(
        &mut self,
        first: u64,
        last: u64,
        routing: &[Vec<u64>],
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        debug_assert_eq!(first, self.next_step, "steps are counted in order");
        if !routing.is_empty()
            && let Err(e) = self.history.push(routing)
        {
            out.push(Action::Log(format!("routing counts ignored: {e}")));
        }
        if self.phase == Phase::Training {
            let steps = last - first + 1;
            self.step_times
                .push(now_ms.saturating_sub(self.progress_ms) / steps);
        }
        self.next_step = last + 1;
        self.progress_ms = now_ms;
        if let Some(p) = self.pending.as_mut() {
            p.stepped = true;
        }
        if let Some((mut r, t)) = self.resuming.take() {
            r.resume_ms = now_ms.saturating_sub(t) as f64;
            out.push(Action::Reconfigured(r));
        }
        let every = self.cfg.rebalance_every_steps;
        let crossed = every > 0 && (first..=last).any(|s| (s + 1).is_multiple_of(every))
            || self.reoptimise_due;
        if crossed && self.next_step + 1 < self.cfg.total_steps && self.phase == Phase::Training {
            self.reoptimise_due = false;
            let laer = match self.cfg.relayout {
                relayout::Relayout::Laer(laer) => Some(laer),
                relayout::Relayout::Lazarus => None,
            };
            let steps = first + 1..=last + 1;
            if self.cfg.sharded_experts && laer.is_some() || self.migrates_async() {
                return self.switch_layout(laer.as_ref(), steps, now_ms, out);
            }
            if let Some(laer) = &laer
                && !self.laer_changes_layout(laer, steps, out)
            {
                return;
            }
            self.note_cause(ReconfigKind::Rebalance, now_ms);
            self.pause_members(now_ms, out);
        }
    }

    /// Whether a rebalance of replicated experts goes out as a [`LayoutSwitch`] with
    /// transfers ([`ReplicaMigration::Async`]): not with host-aware placement, whose replan
    /// may give a host's runs of slots to other ranks.
    fn migrates_async(&self) -> bool {
        !self.cfg.sharded_experts
            && self.cfg.replica_migration == ReplicaMigration::Async
            && !hosts::uniform(&hosts::group(&self.members, |id| {
                self.nodes.get(&id).and_then(|n| n.host.as_deref())
            }))
    }

    /// The next layout over the current members, their ranks kept, and the replica copies it
    /// needs (none with sharded experts): LAER's decision, or Lazarus's replan from the
    /// routing history renumbered onto the current ranks. `None` when nothing changes.
    fn next_layout(
        &mut self,
        laer: Option<&relayout::LaerRelayout>,
        steps: std::ops::RangeInclusive<u64>,
        out: &mut Vec<Action>,
    ) -> Option<(ModelPlan, Vec<RankTransfer>)> {
        let current = self.plan.as_ref()?;
        if current.node_map != self.members {
            return None;
        }
        // Training members hold exactly what their plan gives them.
        let physical: Vec<PhysicalNode> = self
            .members
            .iter()
            .enumerate()
            .map(|(rank, &id)| PhysicalNode {
                id,
                holdings: current
                    .layers
                    .iter()
                    .map(|l| l.grid().row(rank).to_vec())
                    .collect(),
            })
            .collect();
        let (plan, migration) = match laer {
            Some(laer) => {
                if !self.laer_changes_layout(laer, steps, out) {
                    return None;
                }
                self.relayout.take(
                    true,
                    &self.members,
                    &physical,
                    self.cfg.model.experts,
                    self.cfg.bytes_per_expert,
                    self.cfg.sharded_experts,
                )?
            }
            None => {
                let options = ReplanOptions {
                    alloc: self.cfg.alloc,
                    place: self.cfg.place,
                    mapping: self.cfg.mapping,
                    bytes_per_expert: self.cfg.bytes_per_expert,
                };
                let made = replan(
                    &physical,
                    self.cfg.slots_per_node,
                    &self.cfg.model,
                    &self.history.loads(),
                    &options,
                    self.plan_version,
                );
                let (mut plan, migration) = match made {
                    Ok(pm) => pm,
                    Err(e) => {
                        out.push(Action::Log(format!("rebalance: replan failed ({e})")));
                        return None;
                    }
                };
                // The replan maps its plan nodes onto the members; the switch keeps the ranks.
                let pos = RankOf::new(&self.members);
                let perm: Vec<usize> = plan.node_map.iter().map(|&id| pos.of(id)).collect();
                plan.layers = plan.layers.iter().map(|l| l.permute_nodes(&perm)).collect();
                plan.node_map = self.members.clone();
                let same = plan
                    .layers
                    .iter()
                    .zip(&current.layers)
                    .all(|(a, b)| a.replica_matrix() == b.replica_matrix());
                if same {
                    out.push(Action::Log(format!(
                        "rebalance at step {}: the replan keeps every replica, layout kept",
                        self.next_step
                    )));
                    return None;
                }
                (plan, migration)
            }
        };
        let rank = RankOf::new(&self.members);
        let transfers = migration
            .transfers
            .iter()
            .map(|t| RankTransfer {
                layer: t.layer as usize,
                expert: t.expert as usize,
                src_rank: rank.of(t.src),
                dst_rank: rank.of(t.dst),
            })
            .collect();
        Some((plan, transfers))
    }

    /// LAER at a rebalance point (see [`relayout`]): whether it decided a new layout (then
    /// pending until the members pause).
    fn laer_changes_layout(
        &mut self,
        laer: &relayout::LaerRelayout,
        steps: std::ops::RangeInclusive<u64>,
        out: &mut Vec<Action>,
    ) -> bool {
        let Some(plan) = &self.plan else {
            return false;
        };
        let (every, sharded) = (self.cfg.rebalance_every_steps, self.cfg.sharded_experts);
        let d = self
            .relayout
            .decide(laer, every, sharded, plan, &self.members, steps);
        if let Some(line) = d.describe(self.next_step) {
            out.push(Action::Log(line));
        }
        matches!(d, relayout::Decision::Changed { .. })
    }

    /// A rebalance point without a pause (sharded experts with LAER, or replicated experts
    /// with [`ReplicaMigration::Async`]): the new layout goes to the members as a
    /// [`LayoutSwitch`] while they train (see the [module docs](self)); a switch still pending
    /// is sent again instead.
    fn switch_layout(
        &mut self,
        laer: Option<&relayout::LaerRelayout>,
        steps: std::ops::RangeInclusive<u64>,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        if let Some(p) = &self.switch {
            out.push(Action::Log(format!(
                "layout switch to plan v{} (from step {}) not in force yet: sent again",
                p.switch.plan.version, p.switch.from_step
            )));
            out.push(Action::SwitchLayout(Box::new(p.switch.clone())));
            return;
        }
        let Some((plan, transfers)) = self.next_layout(laer, steps, out) else {
            return;
        };
        let newest = self.step_reports.keys().next_back().map_or(0, |s| s + 1);
        let from_step = self.next_step.max(newest) + SWITCH_LEAD_STEPS;
        let moves = if self.cfg.sharded_experts {
            "nothing moves".to_string()
        } else {
            format!("{} replica copies in the background", transfers.len())
        };
        let switch = LayoutSwitch {
            epoch: self.epoch,
            plan,
            from_step,
            transfers,
        };
        out.push(Action::Log(format!(
            "epoch {}: layout switch to plan v{} from step {from_step} or the first step after \
             it every member holds it (no pause, {moves})",
            self.epoch, switch.plan.version
        )));
        out.push(Action::SwitchLayout(Box::new(switch.clone())));
        self.switch = Some(PendingSwitch {
            switch,
            since_ms: now_ms,
            at_step: self.next_step,
        });
    }

    /// Every member trained `step` on the pending switch's layout: its plan is in force.
    fn switch_done(&mut self, step: u64, now_ms: u64, out: &mut Vec<Action>) {
        let Some(p) = self.switch.take() else {
            return;
        };
        let v = p.switch.plan.version;
        out.push(Action::Log(format!(
            "epoch {}: layout of plan v{v} in force from step {step} (decided at step {}, {:.0} ms \
             before; no pause)",
            self.epoch,
            p.at_step,
            now_ms.saturating_sub(p.since_ms) as f64
        )));
        self.plan_version = v;
        self.materialize_planned();
        self.plan = Some(p.switch.plan);
    }

    /// Replaces the [`Holdings::Planned`] reports of the current plan by their lists, before
    /// that plan is replaced.
    fn materialize_planned(&mut self) {
        let Some(plan) = &self.plan else {
            return;
        };
        let rows: BTreeMap<NodeId, usize> = plan
            .node_map
            .iter()
            .enumerate()
            .map(|(r, &id)| (id, r))
            .collect();
        for (id, n) in self.nodes.iter_mut() {
            if let Some((_, _, held @ Holdings::Planned { .. })) = &mut n.idle {
                *held = Holdings::Lists(rows.get(id).map_or_else(Vec::new, |&r| {
                    plan.layers
                        .iter()
                        .map(|l| l.grid().row(r).to_vec())
                        .collect()
                }));
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn idle(
        &mut self,
        node: NodeId,
        epoch: u64,
        why: IdleReason,
        step: u64,
        held: Holdings,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        if epoch != self.epoch || !self.is_member(node) {
            return;
        }
        let current = self.plan.as_ref().map(|p| p.version);
        let Some(n) = self.nodes.get_mut(&node) else {
            return;
        };
        if n.idle.is_some() {
            return;
        }
        let held = match held {
            Holdings::Planned { version } if Some(version) != current => {
                out.push(Action::Log(format!(
                    "node {} reports the holdings of plan v{version}, but the plan is {}: \
                     counted as holding nothing",
                    n.name,
                    current.map_or("none".to_owned(), |v| format!("v{v}"))
                )));
                Holdings::Lists(Vec::new())
            }
            h => h,
        };
        n.idle = Some((why.clone(), step, held));
        self.progress_ms = now_ms;
        match why {
            IdleReason::Failed(error) => {
                let name = &self.nodes[&node].name;
                let error = self.name_ranks(&error);
                out.push(Action::Log(format!(
                    "node {name}: step {step} failed: {error}"
                )));
                // The failure that interrupts the epoch is this member's own; the others'
                // follow from the abort.
                let first = matches!(self.phase, Phase::Training | Phase::Reconfiguring);
                let tries = if first {
                    self.count_repeated_failure(node, step)
                } else {
                    0
                };
                self.interrupt(now_ms, out);
                if tries >= MAX_REPEATED_FAILURES {
                    let name = self.nodes[&node].name.clone();
                    let backoff_ms = self.back_off(name, now_ms);
                    let why = format!(
                        "failed step {step} {tries} times in a row among the same members, \
                         each time first (a retry does not mend it; its name is refused for \
                         {:.0} s): {error}",
                        backoff_ms as f64 / 1e3
                    );
                    self.fence(node, why, now_ms, out);
                }
            }
            // Finished; or paused by a pause this epoch did not ask for (a late command of an
            // earlier epoch): either way wait for every member and decide then.
            IdleReason::Finished | IdleReason::Paused => {
                if self.phase == Phase::Training {
                    self.enter(Phase::Quiescing, now_ms);
                }
            }
        }
    }

    fn migrated(&mut self, node: NodeId, epoch: u64, bytes_in: u64, now_ms: u64) {
        if epoch != self.epoch || self.phase != Phase::Reconfiguring {
            return;
        }
        let Some(p) = self.pending.as_mut() else {
            return;
        };
        if p.waiting.remove(&node) {
            p.bytes += bytes_in;
            if let Some(n) = self.nodes.get_mut(&node) {
                n.has_state = true;
            }
            self.progress_ms = now_ms;
        }
    }

    fn checkpoint_written(&mut self, node: NodeId, epoch: u64, step: u64, out: &mut Vec<Action>) {
        if epoch != self.epoch
            || !self.is_member(node)
            || !self.cfg.checkpoint_due(step)
            || self.commit_asked.is_some_and(|s| step <= s)
            || self.last_committed.is_some_and(|c| step <= c)
        {
            return;
        }
        let parts = self.checkpoint_parts.entry(step).or_default();
        parts.insert(node);
        // Every member the epoch began with writes parts (rank 0 the dense state, each expert
        // its lowest-ranked holder), lost ones too: the survivors' parts alone lack the lost
        // member's, and a commit of them could only fail. A lost member that wrote its parts
        // before it went still counts; one that did not leaves the checkpoint to the next
        // epoch, which writes it at resume (`checkpoint_at_resume`). Parts come from members
        // only: the full test once there are enough of them.
        let writers = self.plan.as_ref().map_or(&self.members, |p| &p.node_map);
        if parts.len() >= writers.len() && writers.iter().all(|m| parts.contains(m)) {
            self.checkpoint_parts.remove(&step);
            self.commit_asked = Some(step);
            out.push(Action::CommitCheckpoint {
                step,
                members: self.members.len(),
                plan_version: self.plan_version,
                data_cursor: self.data_cursor(step),
            });
        }
    }

    /// Whether the members of a reconfiguration resuming at `resume_step` write its checkpoint
    /// first: it is due and not committed (a fresh start's, the last step's, or one the epoch
    /// before left uncommitted because a member was lost before it wrote its parts). Says so
    /// for such a recovery, and says when the newest due checkpoint was neither committed nor
    /// reported failed and cannot be written any more (the members trained past it): the next
    /// due one is the next try, as after a failed one.
    fn checkpoint_at_resume(
        &self,
        kind: ReconfigKind,
        resume_step: u64,
        out: &mut Vec<Action>,
    ) -> bool {
        let every = self.cfg.checkpoint_every_steps;
        if every == 0 {
            return false;
        }
        let newest_due = if self.cfg.checkpoint_due(resume_step) {
            resume_step
        } else {
            resume_step - resume_step % every
        };
        if self.last_committed.is_some_and(|c| c >= newest_due) {
            return false;
        }
        let label = checkpoint_label(newest_due);
        if newest_due == resume_step {
            if kind != ReconfigKind::Start {
                out.push(Action::Log(format!(
                    "the {label} is not committed: the members write it at resume"
                )));
            }
            return true;
        }
        let failed = self
            .failed_checkpoints
            .iter()
            .any(|&(_, s)| s == newest_due);
        if self.started && !failed {
            out.push(Action::Log(format!(
                "the {label} was not committed, and the members trained past it: the next due \
                 checkpoint is the next try"
            )));
        }
        false
    }

    fn checkpoint_failed(&mut self, step: u64, error: &str, out: &mut Vec<Action>) {
        if step == self.cfg.total_steps {
            self.final_checkpoint_failed = true;
        }
        if !self.failed_checkpoints.insert((self.epoch, step)) {
            return;
        }
        // The other members' parts of this step will never make a checkpoint: ask no commit.
        self.checkpoint_parts.remove(&step);
        self.commit_asked = Some(self.commit_asked.map_or(step, |s| s.max(step)));
        let failures = self.failed_checkpoints.len() as u64;
        let max = self.cfg.max_checkpoint_failures;
        if max > 0 && failures >= max {
            let label = checkpoint_label(step);
            out.push(Action::Log(format!("{label} failed: {error}")));
            return self.fail(
                format!(
                    "{failures} checkpoints in a row failed (the limit), the last the {label}: \
                     {error}"
                ),
                out,
            );
        }
        out.push(Action::Log(format!(
            "{} failed (training goes on; {failures} in a row): {error}",
            checkpoint_label(step)
        )));
    }

    /// Moves the job on once the conditions of the current phase hold.
    fn progress(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        match self.phase {
            Phase::Gathering => {
                // Checked after every event while nodes gather: a scan that stops at the
                // first starting node, not a count of every ready one (quadratic over a
                // cluster of 200,000 joining at once). Once none is starting, all are ready.
                let starting = self.nodes.values().any(|n| !n.ready);
                if !starting && self.nodes.len() >= self.cfg.initial_nodes {
                    self.cause = Some(Cause {
                        kind: ReconfigKind::Start,
                        since_ms: now_ms,
                        nodes_before: 0,
                    });
                    self.plan_next(now_ms, out);
                }
            }
            Phase::WaitingForNodes => {
                if self.nodes.values().any(|n| !n.ready) {
                    return;
                }
                let slots = self.nodes.len() * self.cfg.slots_per_node;
                if slots >= self.cfg.model.experts
                    || self.waiting_announced_live != Some(self.nodes.len())
                {
                    self.plan_next(now_ms, out);
                }
            }
            Phase::Quiescing => {
                if !self.members.iter().all(|m| self.nodes[m].idle.is_some()) {
                    return;
                }
                let finished = !self.members.is_empty()
                    && self.members.iter().all(|m| {
                        matches!(&self.nodes[m].idle, Some((IdleReason::Finished, s, _)) if *s >= self.cfg.total_steps)
                    });
                if finished && self.next_step < self.cfg.total_steps {
                    // Stopping now would report a complete job that is not.
                    return self.fail(
                        format!(
                            "every member finished, but only {} of {} steps were counted \
                             (the reports of step {} never arrived)",
                            self.next_step, self.cfg.total_steps, self.next_step
                        ),
                        out,
                    );
                }
                if finished {
                    self.finish_or_recover(now_ms, out);
                } else {
                    self.plan_next(now_ms, out);
                }
            }
            Phase::Reconfiguring => self.finish_reconfiguration(now_ms, out),
            Phase::Stopping => {
                if self.nodes.values().all(|n| n.done.is_some()) {
                    self.phase = Phase::Over;
                    let result = self.check_final_state(out);
                    self.outcome = Some(result.clone());
                    out.push(Action::Finished(result));
                }
            }
            Phase::Training | Phase::Restoring | Phase::Over => {}
        }
    }

    /// Every member finished the last step. The job stops only once the members hold its
    /// whole final state and, with checkpoints, the last step's checkpoint is committed;
    /// otherwise the state is recovered first (see "Done" in the [module docs](self)).
    fn finish_or_recover(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if let Some(missing) = self.final_state_missing() {
            out.push(Action::Log(format!(
                "every member finished, but {missing}: recovering the final state before the \
                 job ends"
            )));
            self.note_cause(ReconfigKind::InPlace, now_ms);
            return self.plan_next(now_ms, out);
        }
        let total = self.cfg.total_steps;
        if self.cfg.checkpoint_every_steps > 0 && self.last_committed.is_none_or(|c| c < total) {
            if self.commit_asked == Some(total) && !self.final_checkpoint_failed {
                // Every member wrote its parts; the commit's answer is due.
                return;
            }
            // A member reports its parts of a checkpoint before it reports that it finished
            // (the driver keeps each node's messages in order): every member finished, so a
            // part that is missing now will not come.

            self.final_checkpoint_failures += 1;
            let newest = self.last_committed.map_or_else(
                || "no checkpoint was committed".to_owned(),
                |s| format!("the newest committed is the {}", checkpoint_label(s)),
            );
            let last = total.saturating_sub(1);
            if self.final_checkpoint_failures >= FINAL_CHECKPOINT_TRIES {
                return self.fail(
                    format!(
                        "the checkpoint after the last step ({last}) failed {} times, so the \
                         final state is not saved ({newest})",
                        self.final_checkpoint_failures
                    ),
                    out,
                );
            }
            out.push(Action::Log(format!(
                "the checkpoint after the last step ({last}) was not committed (try {} of \
                 {FINAL_CHECKPOINT_TRIES}): the members write it again",
                self.final_checkpoint_failures
            )));
            self.note_cause(ReconfigKind::InPlace, now_ms);
            return self.plan_next(now_ms, out);
        }
        // A reconfiguration that resumed at the last step (the final checkpoint written again,
        // the final state recovered) has no step after it to report it with: reported now,
        // its resume time running to the stop.
        if let Some((mut r, t)) = self.resuming.take() {
            r.resume_ms = now_ms.saturating_sub(t) as f64;
            out.push(Action::Reconfigured(r));
        }
        self.enter(Phase::Stopping, now_ms);
        for &id in self.nodes.keys() {
            out.push(Action::Stop { node: id });
        }
        out.push(Action::Log("every member finished; stopping".into()));
    }

    /// What of the job's state the members do not hold (from what they reported when they
    /// went idle); `None` when they hold all of it.
    fn final_state_missing(&self) -> Option<String> {
        if !self.members.iter().any(|m| self.nodes[m].has_state) {
            return Some("no member holds the dense state".into());
        }
        if self.cfg.sharded_experts {
            let lost: Vec<usize> = self
                .shards
                .holders()
                .iter()
                .enumerate()
                .filter(|(_, h)| !h.iter().any(|id| self.members.contains(id)))
                .map(|(s, _)| s)
                .collect();
            return (!lost.is_empty()).then(|| format!("shards {lost:?} lost every copy"));
        }
        let held = self.reported_held(&self.members);
        let lost = lost_experts_held(
            Holders::Rows {
                ids: &self.members,
                held: &held,
                layers: self.planned_layers(),
            },
            self.cfg.model.layers,
            self.cfg.model.experts,
        );
        (!lost.is_empty()).then(|| format!("{} lost every replica", describe_lost(&lost)))
    }

    fn finish_reconfiguration(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if !self.pending.as_ref().is_some_and(|p| p.waiting.is_empty()) {
            return;
        }
        let p = self.pending.take().expect("checked");
        self.shards.commit();
        self.lineage_complete = true;
        self.started = true;
        let rec = ReconfigRecord {
            kind: p.kind,
            epoch: self.epoch,
            plan_version: self.plan_version,
            at_step: p.at_step,
            resume_step: p.resume_step,
            nodes_before: p.nodes_before,
            nodes_after: self.members.len(),
            transfers: p.transfers,
            bytes: p.bytes,
            detect_ms: p.detect_ms,
            migrate_ms: now_ms.saturating_sub(p.sent_ms) as f64,
            resume_ms: 0.0,
        };
        out.push(Action::Log(format!(
            "epoch {}: {} reconfiguration done, {} members, resuming at step {}",
            self.epoch,
            p.kind.name(),
            self.members.len(),
            p.resume_step
        )));
        if p.stepped {
            out.push(Action::Reconfigured(rec));
        } else {
            self.resuming = Some((rec, now_ms));
        }
        self.enter(Phase::Training, now_ms);
        if self.ready_newcomer() {
            self.join_waiting_since.get_or_insert(now_ms);
        }
    }

    /// Whether `node` is a member of the plan in force. `members_sorted` is `members` sorted
    /// unless the machine was restored from a saved state (it is not saved): then the two
    /// lengths differ (or both are empty) and `members` is scanned.
    fn is_member(&self, node: NodeId) -> bool {
        if self.members_sorted.len() == self.members.len() {
            self.members_sorted.binary_search(&node).is_ok()
        } else {
            self.members.contains(&node)
        }
    }

    /// Whether some ready node is not a member (a newcomer).
    fn ready_newcomer(&self) -> bool {
        self.nodes
            .iter()
            .any(|(&id, n)| n.ready && !self.is_member(id))
    }

    /// Ids of the nodes the next plan is made over: members in rank order, then ready
    /// newcomers in the natural order of their names (`n2` before `n10`), never in id order:
    /// a driver numbers nodes as they register, and plans must not depend on that order.
    fn candidate_ids(&self) -> Vec<NodeId> {
        // Sorted for the membership test: `members.contains` per node was quadratic.
        let mut sorted = self.members.clone();
        sorted.sort_unstable();
        let mut newcomers: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(id, n)| n.ready && sorted.binary_search(id).is_err())
            .map(|(&id, _)| id)
            .collect();
        newcomers.sort_by_cached_key(|id| natural_key(&self.nodes[id].name));
        self.members.iter().copied().chain(newcomers).collect()
    }

    /// `ids` grouped by host when the next plan is made per host (see [`hosts`]); `None` when
    /// it is made per node (every node its own host, or hosts of different sizes: logged).
    fn host_groups(&self, ids: &[NodeId], out: &mut Vec<Action>) -> Option<Vec<Vec<NodeId>>> {
        let groups = hosts::group(ids, |id| self.nodes[&id].host.as_deref());
        if hosts::uniform(&groups) {
            return Some(groups);
        }
        if groups.len() < ids.len() {
            let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
            out.push(Action::Log(format!(
                "hosts of unequal sizes {sizes:?}: planning per node, not per host"
            )));
        }
        None
    }

    /// What each of `ids` reported holding, by reference (nothing for a node without the
    /// job's state); rows are those of the current plan (`Holdings::Planned` of another
    /// version was turned into nothing when reported, see [`Self::materialize_planned`]).
    fn reported_held(&self, ids: &[NodeId]) -> Vec<Held<'_>> {
        let rows: Option<BTreeMap<NodeId, u32>> = ids
            .iter()
            .any(|id| {
                matches!(
                    &self.nodes[id],
                    Node {
                        idle: Some((_, _, Holdings::Planned { .. })),
                        has_state: true,
                        ..
                    }
                )
            })
            .then(|| {
                let plan = self.plan.as_ref().expect("a Planned report has a plan");
                plan.node_map
                    .iter()
                    .enumerate()
                    .map(|(r, &id)| (id, r as u32))
                    .collect()
            });
        ids.iter()
            .map(|id| {
                let n = &self.nodes[id];
                match (&n.idle, n.has_state) {
                    (Some((_, _, Holdings::Lists(held))), true) => Held::Lists(held),
                    (Some((_, _, Holdings::Planned { .. })), true) => rows
                        .as_ref()
                        .and_then(|r| r.get(id))
                        .map_or(Held::Lists(&[]), |&r| Held::Row(r)),
                    _ => Held::Lists(&[]),
                }
            })
            .collect()
    }

    /// The placements that [`Held::Row`]s index (the current plan's; none without a plan).
    fn planned_layers(&self) -> &[crate::LayerPlacement] {
        self.plan.as_ref().map_or(&[], |p| &p.layers)
    }

    /// The candidates as the planner's [`PhysicalNode`]s, their reported lists moved out of
    /// the machine's records (a copy was 15 MB at 2,048 nodes) and planned rows copied.
    /// [`Self::restore_holdings`] puts the lists back when no plan is issued from them.
    fn take_holdings(&mut self, ids: &[NodeId]) -> Vec<PhysicalNode> {
        let held = self.reported_held(ids);
        let holders = Holders::Rows {
            ids,
            held: &held,
            layers: self.planned_layers(),
        };
        let planned: Vec<Option<Vec<Vec<u32>>>> = (0..ids.len())
            .map(|p| {
                // Rows are positions in the current plan's node map.
                matches!(held[p], Held::Row(_)).then(|| holders.lists_of(p))
            })
            .collect();
        drop(held);
        ids.iter()
            .zip(planned)
            .map(|(&id, planned)| {
                let n = self.nodes.get_mut(&id).expect("candidates are known nodes");
                let holdings = match (planned, &mut n.idle, n.has_state) {
                    (Some(lists), _, _) => lists,
                    (None, Some((_, _, Holdings::Lists(held))), true) => std::mem::take(held),
                    _ => Vec::new(),
                };
                PhysicalNode { id, holdings }
            })
            .collect()
    }

    fn restore_holdings(&mut self, physical: Vec<PhysicalNode>) {
        for p in physical {
            if let Some(n) = self.nodes.get_mut(&p.id)
                && let (Some((_, _, Holdings::Lists(held))), true) = (&mut n.idle, n.has_state)
            {
                *held = p.holdings;
            }
        }
    }

    /// Plans the next membership: in place, a restore, or a fresh start.
    fn plan_next(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        self.join_waiting_since = None;
        let candidates = self.candidate_ids();
        let slots = candidates.len() * self.cfg.slots_per_node;
        if slots < self.cfg.model.experts {
            self.enter(Phase::WaitingForNodes, now_ms);
            self.nodes_waiting_since.get_or_insert(now_ms);
            let wait = match self.cfg.wait_for_nodes_ms {
                0 => String::new(),
                ms => format!(" (waiting up to {:.0} s)", ms as f64 / 1e3),
            };
            let reason = format!(
                "{} experts need at least {} nodes of {} slots, {} ready{wait}",
                self.cfg.model.experts,
                self.cfg.model.experts.div_ceil(self.cfg.slots_per_node),
                self.cfg.slots_per_node,
                candidates.len()
            );
            self.waiting_announced_live = Some(self.nodes.len());
            out.push(Action::WaitForNodes {
                live: self.nodes.len(),
                needed: self.cfg.model.experts.div_ceil(self.cfg.slots_per_node),
                reason,
            });
            return;
        }
        self.nodes_waiting_since = None;
        self.waiting_announced_live = None;
        if !self.started && !self.cfg.resume {
            // The first start, or one that did not complete on every member: start afresh.
            return self.send_plan(ReconfigKind::Start, StateSource::Fresh, 0, now_ms, out);
        }
        // Candidates without state hold nothing, so the experts lost are those of the nodes
        // with state.
        let held = self.reported_held(&candidates);
        let lost = lost_experts_held(
            Holders::Rows {
                ids: &candidates,
                held: &held,
                layers: self.planned_layers(),
            },
            self.cfg.model.layers,
            self.cfg.model.experts,
        );
        drop(held);
        let has_state: Vec<bool> = candidates
            .iter()
            .map(|id| self.nodes[id].has_state)
            .collect();
        let none_with_state = !has_state.contains(&true);
        let resharded = self.started && self.membership_changes(&candidates);
        if resharded && self.lineage_complete && self.repair_shards(now_ms, out) {
            return;
        }
        if !self.started
            || !self.lineage_complete
            || none_with_state
            || !lost.is_empty()
            || resharded
        {
            // Sharded: the replica tables say which experts a member computed, not what it holds.
            let what = if resharded {
                "the membership of the sharded experts changed".to_owned()
            } else {
                format!("{} lost every replica", describe_lost(&lost))
            };
            if self.lineage_complete && (!lost.is_empty() || resharded) {
                out.push(Action::Log(format!("{what}: restoring a checkpoint")));
            }
            // A resumed job's start reads its checkpoint whatever the cadence.
            if self.started && self.cfg.checkpoint_every_steps == 0 {
                self.enter(Phase::Over, now_ms);
                return self.fail(format!("{what} and checkpoints are off"), out);
            }
            self.enter(Phase::Restoring, now_ms);
            out.push(Action::FindCheckpoint);
            return;
        }
        self.replan_in_place(&candidates, &has_state, now_ms, out);
    }

    /// With sharded experts: whether the next plan's nodes differ from the last plan's (see
    /// [`JobConfig::sharded_experts`]). Always false for replicated experts.
    fn membership_changes(&self, candidates: &[NodeId]) -> bool {
        if !self.cfg.sharded_experts {
            return false;
        }
        let Some(plan) = &self.plan else {
            return false;
        };
        let before: BTreeSet<NodeId> = plan.node_map.iter().copied().collect();
        let next: BTreeSet<NodeId> = candidates.iter().copied().collect();
        before != next
    }

    /// `has_state[i]`: whether node `candidates[i]` holds the job's state.
    fn replan_in_place(
        &mut self,
        candidates: &[NodeId],
        has_state: &[bool],
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        let resume_step = self
            .members
            .iter()
            .filter_map(|m| {
                let n = &self.nodes[m];
                n.has_state.then(|| n.idle.as_ref().map(|i| i.1)).flatten()
            })
            .min()
            // Not past the first uncounted step: members that trained a step a member without
            // state never reported roll it back (else it would never be counted).
            .map_or(self.next_step, |s| s.min(self.next_step));
        let options = ReplanOptions {
            alloc: self.cfg.alloc,
            place: self.cfg.place,
            mapping: self.cfg.mapping,
            bytes_per_expert: self.cfg.bytes_per_expert,
        };
        let groups = self.host_groups(candidates, out);
        let mut reoptimise = false;
        let made = if groups.is_none() && !self.relayout.has_pending() {
            // Lazarus's replan reads the holdings where they are.
            let held = self.reported_held(candidates);
            let holders = Holders::Rows {
                ids: candidates,
                held: &held,
                layers: self.planned_layers(),
            };
            let loads = self.history.loads();
            match self.repair(holders, &loads, out) {
                Some((repaired, due)) => {
                    reoptimise = due;
                    Ok(repaired)
                }
                None => replan_held(
                    holders,
                    self.cfg.slots_per_node,
                    &self.cfg.model,
                    &loads,
                    &options,
                    self.plan_version,
                )
                .map_err(|e| e.to_string()),
            }
        } else {
            self.replan_from_lists(candidates, groups.as_deref(), &options)
        };
        // A full replan is the re-optimisation; a repair may bring the next one forward.
        self.reoptimise_due = reoptimise;
        match made {
            Ok((plan, migration)) => self.issue_in_place(
                candidates,
                has_state,
                plan,
                migration,
                resume_step,
                now_ms,
                out,
            ),
            Err(e) => self.replan_failed(&e, now_ms, out),
        }
    }

    /// [`RecoveryPolicy::Repair`] of a failure or join (never a rebalance, which is the
    /// re-optimisation itself): the repaired plan and migration, and whether the
    /// re-optimisation is due at once (the repaired layout's recovery probability falls short
    /// of the replan's by more than the margin). `None`: the replan decides (another policy,
    /// sharded experts, no plan, or a repair that cannot be made, logged).
    fn repair(
        &self,
        holders: Holders<'_>,
        loads: &[Vec<u64>],
        out: &mut Vec<Action>,
    ) -> Option<((ModelPlan, MigrationPlan), bool)> {
        let kind = self.cause.map(|c| c.kind);
        if self.cfg.recovery != RecoveryPolicy::Repair
            || self.cfg.sharded_experts
            || matches!(kind, Some(ReconfigKind::Rebalance) | None)
        {
            return None;
        }
        let previous = self.plan.as_ref()?;
        let options = crate::repair::RepairOptions {
            load_slack: self.cfg.repair_load_slack,
            bytes_per_expert: self.cfg.bytes_per_expert,
        };
        let r = match crate::repair::repair_held(
            holders,
            previous,
            &self.cfg.model,
            loads,
            &options,
            self.plan_version + 1,
        ) {
            Ok(r) => r,
            Err(e) => {
                out.push(Action::Log(format!(
                    "repair not possible ({e}): full replan"
                )));
                return None;
            }
        };
        let s = r.stats;
        let failed = self.cfg.model.f;
        let shortfall =
            crate::repair::recovery_against_replan(&r.plan, s.min_distinct, loads, failed);
        let load_ratio = crate::repair::load_ratio_against_replan(&r.plan, loads).unwrap_or(1.0);
        let why = match shortfall {
            Ok(Some((a, b))) if a + self.cfg.reoptimise_margin < b => Some(format!(
                "recovery from {failed} more failures {a:.4} against the replan's {b:.4}"
            )),
            // Too many failure sets to list: re-optimise rather than guess.
            Err(_) => Some(format!("recovery from {failed} more failures not computed")),
            _ if load_ratio > self.cfg.reoptimise_load_ratio => {
                Some(format!("its busiest replica {load_ratio:.2}x the replan's"))
            }
            _ => None,
        };
        out.push(Action::Log(format!(
            "repair: {} replicas copied ({} to restore the floor of {} nodes, {} for load, {} \
             into newcomers), {} lost replicas left to the re-optimisation; {}",
            s.copies(),
            s.floor_copies,
            self.cfg.model.f.min(holders.len()),
            s.load_copies,
            s.join_copies,
            s.deferred,
            match &why {
                Some(w) => format!("{w}: re-optimising at the next step"),
                None => "re-optimising at the next rebalance".to_owned(),
            }
        )));
        let reoptimise = why.is_some();
        Some(((r.plan, r.migration), reoptimise))
    }

    /// The replan of [`Self::replan_in_place`] from the holdings as lists: a pending LAER
    /// layout, or per-host plans (`groups`), or Lazarus's replan.
    fn replan_from_lists(
        &mut self,
        candidates: &[NodeId],
        groups: Option<&[Vec<NodeId>]>,
        options: &ReplanOptions,
    ) -> Result<(ModelPlan, MigrationPlan), String> {
        let physical = self.take_holdings(candidates);
        let rebalance = self
            .cause
            .is_some_and(|c| c.kind == ReconfigKind::Rebalance);
        // LAER's re-layout is not host-aware: with hosts, Lazarus's replan (see `hosts`).
        let laer = self.relayout.take(
            rebalance && groups.is_none(),
            candidates,
            &physical,
            self.cfg.model.experts,
            self.cfg.bytes_per_expert,
            self.cfg.sharded_experts,
        );
        let made = match (laer, groups) {
            (Some(pm), _) => Ok(pm),
            (None, Some(groups)) => hosts::replan_hosts(
                groups,
                &physical,
                self.cfg.slots_per_node,
                &self.cfg.model,
                &self.history.loads(),
                options,
                self.plan_version,
            )
            .map_err(|e| e.to_string()),
            (None, None) => replan(
                &physical,
                self.cfg.slots_per_node,
                &self.cfg.model,
                &self.history.loads(),
                options,
                self.plan_version,
            )
            .map_err(|e| e.to_string()),
        };
        match made {
            Ok(pm) => {
                free_holdings(physical);
                Ok(pm)
            }
            Err(e) => {
                self.restore_holdings(physical);
                Err(e)
            }
        }
    }

    /// Holdings that no plan can be mapped onto (should not happen once lost experts were
    /// ruled out): fall back to a restore rather than stall.
    fn replan_failed(&mut self, e: &str, now_ms: u64, out: &mut Vec<Action>) {
        out.push(Action::Log(format!(
            "in-place replan failed ({e}): restoring"
        )));
        self.enter(Phase::Restoring, now_ms);
        out.push(Action::FindCheckpoint);
    }

    /// Issues an in-place plan over `candidates` (`has_state[i]` for `candidates[i]`).
    #[allow(clippy::too_many_arguments)]
    fn issue_in_place(
        &mut self,
        candidates: &[NodeId],
        has_state: &[bool],
        plan: ModelPlan,
        migration: MigrationPlan,
        resume_step: u64,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        let has_state: BTreeMap<NodeId, bool> = candidates
            .iter()
            .zip(has_state)
            .map(|(&id, &s)| (id, s))
            .collect();
        let dense_from = plan
            .node_map
            .iter()
            .position(|id| has_state[id])
            .expect("a member with state exists (checked by plan_next)");
        let dense_to = plan
            .node_map
            .iter()
            .enumerate()
            .filter(|(_, id)| !has_state[id])
            .map(|(r, _)| r)
            .collect();
        let kind = self.cause.map_or(ReconfigKind::Rebalance, |c| c.kind);
        let source = StateSource::Peers {
            dense_from,
            dense_to,
        };
        self.issue(
            kind,
            plan,
            Some(&migration),
            source,
            resume_step,
            now_ms,
            out,
        );
    }

    /// A fresh plan over the candidates (start or restore), no transfers.
    fn send_plan(
        &mut self,
        kind: ReconfigKind,
        source: StateSource,
        resume_step: u64,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        self.reoptimise_due = false;
        let mut ids: Vec<NodeId> = self.candidate_ids();
        if kind == ReconfigKind::Start {
            // Ranks follow node names (n2 before n10), not registration order: reproducible.
            ids.sort_by_cached_key(|id| natural_key(&self.nodes[id].name));
        }
        let groups = self.host_groups(&ids, out);
        let made = match &groups {
            Some(groups) => hosts::plan_hosts(
                groups,
                self.cfg.slots_per_node,
                &self.cfg.model,
                &self.history.loads(),
                self.cfg.alloc,
                self.cfg.place,
            ),
            None => plan_model(
                &ClusterSpec::new(ids.len(), self.cfg.slots_per_node),
                &self.cfg.model,
                &self.history.loads(),
                self.cfg.alloc,
                self.cfg.place,
                Alignment::Aligned,
            ),
        };
        let mut plan = match made {
            Ok(p) => p,
            Err(e) => return self.fail(format!("planning {} nodes failed: {e}", ids.len()), out),
        };
        if groups.is_none() {
            plan.node_map = ids;
        }
        let source = match source {
            // Sharded in place (`sharded`): the dense state to the ranks of this plan.
            StateSource::Peers { .. } => self.peers_source(&plan.node_map),
            s => s,
        };
        plan.version = self.plan_version + 1;
        self.issue(kind, plan, None, source, resume_step, now_ms, out);
    }

    #[allow(clippy::too_many_arguments)]
    fn issue(
        &mut self,
        kind: ReconfigKind,
        plan: ModelPlan,
        migration: Option<&MigrationPlan>,
        source: StateSource,
        resume_step: u64,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        let cause = self.cause.take().unwrap_or(Cause {
            kind,
            since_ms: now_ms,
            nodes_before: self.members.len(),
        });
        let rank = RankOf::new(&plan.node_map);
        let transfers: Vec<RankTransfer> = migration
            .map(|m| {
                m.transfers
                    .iter()
                    .map(|t| RankTransfer {
                        layer: t.layer as usize,
                        expert: t.expert as usize,
                        src_rank: rank.of(t.src),
                        dst_rank: rank.of(t.dst),
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(p) = self.switch.take() {
            out.push(Action::Log(format!(
                "the {} reconfiguration supersedes the layout switch to plan v{}",
                kind.name(),
                p.switch.plan.version
            )));
        }
        let fresh = !matches!(source, StateSource::Peers { .. });
        let Some((shard_holders, shard_transfers)) = self.shard_layout(&plan.node_map, fresh)
        else {
            return self.fail("no shard placement fits the members".into(), out);
        };
        let checkpoint_at_resume = self.checkpoint_at_resume(kind, resume_step, out);
        self.epoch += 1;
        self.plan_version = plan.version;
        self.members = plan.node_map.clone();
        self.members_sorted = self.members.clone();
        self.members_sorted.sort_unstable();
        self.next_step = resume_step;
        self.step_reports.clear();
        self.checkpoint_parts.clear();
        self.commit_asked = None;
        self.final_checkpoint_failed = false;
        self.resuming = None;
        if !matches!(source, StateSource::Peers { .. }) {
            // A new lineage: nobody holds its state until it reports `Migrated`.
            self.lineage_complete = false;
            for n in self.nodes.values_mut() {
                n.has_state = false;
            }
        }
        for n in self.nodes.values_mut() {
            n.idle = None;
        }
        let names: Vec<String> = self.members.iter().map(|&m| self.name_of(m)).collect();
        out.push(Action::Log(format!(
            "epoch {}: plan v{} ({}) over {} nodes [{}] (rank order), {} transfers, resume at \
             step {resume_step}",
            self.epoch,
            plan.version,
            kind.name(),
            self.members.len(),
            names.join(", "),
            // Replica transfers and FSEP shard copies alike (what the record counts).
            transfers.len() + shard_transfers.len()
        )));
        self.pending = Some(Pending {
            kind,
            detect_ms: now_ms.saturating_sub(cause.since_ms) as f64,
            sent_ms: now_ms,
            at_step: resume_step,
            resume_step,
            nodes_before: cause.nodes_before,
            transfers: transfers.len() + shard_transfers.len(),
            waiting: self.members.iter().copied().collect(),
            bytes: 0,
            stepped: false,
        });
        let reconfig = Reconfiguration {
            kind,
            epoch: self.epoch,
            plan: plan.clone(),
            transfers,
            source,
            resume_step,
            migration_bytes: migration.map_or(0, |m| m.bytes),
            max_sent_bytes: migration.map_or(0, |m| m.max_sent_bytes),
            max_recv_bytes: migration.map_or(0, |m| m.max_recv_bytes),
            shard_holders,
            shard_transfers,
            data_cursor: self.data_cursor(resume_step),
            checkpoint_at_resume,
        };
        self.plan = Some(plan);
        self.enter(Phase::Reconfiguring, now_ms);
        out.push(Action::Reconfigure(Box::new(reconfig)));
    }

    fn restore_from(
        &mut self,
        step: u64,
        data_cursor: Option<u64>,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        if self.phase != Phase::Restoring {
            return;
        }
        let kind = if self.started {
            ReconfigKind::Restore
        } else {
            ReconfigKind::Start
        };
        if let Some(c) = self.cause.as_mut() {
            c.kind = kind;
        }
        if self.candidate_ids().len() * self.cfg.slots_per_node < self.cfg.model.experts {
            // Nodes were lost while the checkpoint was looked for: wait for more.
            return self.plan_next(now_ms, out);
        }
        out.push(Action::Log(format!(
            "restoring the {}: training resumes at step {step}",
            checkpoint_label(step)
        )));
        // The lineage goes on from this checkpoint: a newer one (damaged, or of an abandoned
        // history) does not hold its final state.
        self.last_committed = Some(step);
        // The data cursor rewinds with the weights.
        if let Some(b) = self.cfg.global_batch {
            let cursor = data_cursor.unwrap_or_else(|| {
                let assumed = step.saturating_mul(b.sequences);
                out.push(Action::Log(format!(
                    "the {} holds no data cursor (written without a global batch): assuming \
                     {step} steps × {} = {assumed}",
                    checkpoint_label(step),
                    b.sequences
                )));
                assumed
            });
            self.data_origin = (step, cursor);
        }
        self.send_plan(kind, StateSource::Checkpoint { step }, step, now_ms, out);
    }

    fn no_checkpoint(&mut self, error: &str, out: &mut Vec<Action>) {
        if self.phase != Phase::Restoring {
            return;
        }
        self.fail(format!("no checkpoint can be restored: {error}"), out);
    }

    fn fail(&mut self, why: String, out: &mut Vec<Action>) {
        self.phase = Phase::Over;
        for &id in self.nodes.keys() {
            out.push(Action::Stop { node: id });
        }
        self.outcome = Some(Err(why.clone()));
        out.push(Action::Finished(Err(why)));
    }

    /// The end of a job: the final checksums agree ([`Self::check_consistency`]) and cover the
    /// whole state — the dense state and every `(layer, expert)` (every shard, when sharded) —
    /// unless a member was lost before it reported them and the committed checkpoint of the
    /// last step holds the state instead.
    fn check_final_state(&self, out: &mut Vec<Action>) -> Result<(), String> {
        self.check_consistency()?;
        let Some(missing) = self.final_checksums_missing() else {
            return Ok(());
        };
        let total = self.cfg.total_steps;
        if self.cfg.checkpoint_every_steps > 0 && self.last_committed.is_some_and(|c| c >= total) {
            out.push(Action::Log(format!(
                "{missing} in the members' final checksums (lost while stopping); the committed \
                 checkpoint after the last step ({}) holds the final state",
                total.saturating_sub(1)
            )));
            return Ok(());
        }
        Err(format!(
            "the final state is incomplete: {missing} in the final checksums of the members \
             that stopped, and no checkpoint after the last step ({}) was committed",
            total.saturating_sub(1)
        ))
    }

    /// The final checksums ([`Event::Done`]) of the members, those still connected and those
    /// that left after sending them, by node id.
    fn final_sums(&self) -> BTreeMap<NodeId, &StateChecksums> {
        let live = self
            .members
            .iter()
            .filter_map(|&m| self.nodes.get(&m)?.done.as_ref().map(|d| (m, d)));
        let left = self.stopped.iter().map(|(&id, (_, d))| (id, d));
        live.chain(left).collect()
    }

    /// The name of node `id`, live or stopped.
    /// The name node `id` registered with, live or lost (its id where none is known: a
    /// state saved before names were kept). What messages call a node.
    pub fn name_of(&self, id: NodeId) -> String {
        match self.names.get(&id) {
            Some(name) => name.clone(),
            None => match self.node_name(id) {
                "" => format!("id {id}"),
                name => name.to_owned(),
            },
        }
    }

    /// `error` (a worker's) with the node name after each `rank R` of the plan in force, so
    /// that `rank 2 closed the connection` reads `rank 2 (n2) closed the connection`.
    fn name_ranks(&self, error: &str) -> String {
        let Some(plan) = &self.plan else {
            return error.to_owned();
        };
        let mut out = String::with_capacity(error.len() + 16);
        let mut rest = error;
        while let Some(at) = rest.find("rank ") {
            let (before, after) = rest.split_at(at + "rank ".len());
            out.push_str(before);
            let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let (number, tail) = after.split_at(digits);
            out.push_str(number);
            let id = number
                .parse::<usize>()
                .ok()
                .and_then(|r| plan.node_map.get(r));
            if let Some(&id) = id
                && !tail.starts_with(" (")
            {
                let _ = write!(out, " ({})", self.name_of(id));
            }
            rest = tail;
        }
        out.push_str(rest);
        out
    }

    fn node_name(&self, id: NodeId) -> &str {
        match self.nodes.get(&id) {
            Some(n) => &n.name,
            None => self.stopped.get(&id).map_or("", |(name, _)| name),
        }
    }

    /// What the members' final checksums ([`Event::Done`]) do not cover; `None`: everything.
    fn final_checksums_missing(&self) -> Option<String> {
        let sums: Vec<&StateChecksums> = self.final_sums().into_values().collect();
        if sums.is_empty() {
            return Some("no member's state".into());
        }
        if self.cfg.sharded_experts {
            let shards = self.shards.holders().len() as u32;
            let held: BTreeSet<u32> = sums
                .iter()
                .flat_map(|s| s.shards.iter().map(|c| c.0))
                .collect();
            let lost: Vec<u32> = (0..shards).filter(|s| !held.contains(s)).collect();
            return (!lost.is_empty()).then(|| format!("shards {lost:?} are missing"));
        }
        let held: BTreeSet<(u32, u32)> = sums
            .iter()
            .flat_map(|s| s.replicas.iter().map(|&(l, e, _)| (l, e)))
            .collect();
        let mut lost = Vec::new();
        for l in 0..self.cfg.model.layers as u32 {
            for e in 0..self.cfg.model.experts as u32 {
                if !held.contains(&(l, e)) {
                    lost.push((l, e));
                }
            }
        }
        (!lost.is_empty()).then(|| format!("{} are missing", describe_lost(&lost)))
    }

    /// Every node's final state: one dense state, identical replicas of each expert and copies
    /// of each shard.
    fn check_consistency(&self) -> Result<(), String> {
        let problems = diverged_copies(self.final_sums().into_iter(), |id| self.node_name(id));
        if problems.is_empty() {
            Ok(())
        } else {
            Err(format!("replicas diverged: {}", problems.join("; ")))
        }
    }

    /// The machine's own invariants (the swarm test checks them after every event).
    pub fn check_invariants(&self) -> Result<(), String> {
        let layers = self.cfg.model.layers;
        let experts = self.cfg.model.experts;
        for m in &self.members {
            if !self.nodes.contains_key(m) {
                return Err(format!(
                    "member {m} ({}) is not a live node",
                    self.name_of(*m)
                ));
            }
        }
        let training = matches!(self.phase, Phase::Training);
        if training {
            // Every expert has a replica on a live member.
            let plan = self.plan.as_ref().ok_or("training without a plan")?;
            let holders: Vec<PhysicalNode> = plan
                .physical_nodes()
                .into_iter()
                .filter(|p| self.members.contains(&p.id))
                .collect();
            let lost = lost_experts(&holders, layers, experts);
            if !lost.is_empty() {
                return Err(format!(
                    "training while {} lost every replica",
                    describe_lost(&lost)
                ));
            }
        }
        if let Some(p) = &self.pending
            && p.waiting.iter().any(|w| !self.members.contains(w))
        {
            return Err("waiting for a Migrated from a non-member".into());
        }
        if self.next_step > self.cfg.total_steps {
            return Err(format!("counted step {} past the end", self.next_step));
        }
        Ok(())
    }
}

/// Drops the members' reported holdings one layer of a block of nodes at a time, the order
/// in which the replay's reports are allocated: freed node by node, each small vector's chunk
/// (and its neighbours', which the allocator coalesces) was a cache miss.
fn free_holdings(mut physical: Vec<PhysicalNode>) {
    let layers = physical.iter().map(|p| p.holdings.len()).max().unwrap_or(0);
    for block in physical.chunks_mut(64) {
        for l in 0..layers {
            for node in block.iter_mut() {
                if let Some(ids) = node.holdings.get_mut(l) {
                    drop(std::mem::take(ids));
                }
            }
        }
    }
}

fn add_counts(sum: &mut Vec<Vec<u64>>, counts: &[Vec<u64>]) {
    if sum.is_empty() {
        *sum = counts.to_vec();
        return;
    }
    for (s, c) in sum.iter_mut().zip(counts) {
        for (a, &b) in s.iter_mut().zip(c) {
            *a = a.saturating_add(b);
        }
    }
}

/// What messages call the checkpoint a restore resumes at step `step` from (its directory is
/// `step-<step>`): the checkpoint after step `step - 1`, or of the initial state for 0. Steps
/// are counted from 0, as in `--kill NODE@STEP` and the step records: "the checkpoint after
/// step 4" holds the state that step 4's update left.
pub fn checkpoint_label(step: u64) -> String {
    match step.checked_sub(1) {
        Some(last) => format!("checkpoint after step {last}"),
        None => "checkpoint of the initial state".to_owned(),
    }
}

/// Where copies of one object disagree among `sums` (node id, its fingerprints): the dense
/// state (every node holds one), each `(layer, expert)` replica and each shard copy; one line
/// per object that differs, naming it, the two nodes and (by `name`) their names.
fn diverged_copies<'a>(
    sums: impl Iterator<Item = (NodeId, &'a StateChecksums)>,
    name: impl Fn(NodeId) -> &'a str,
) -> Vec<String> {
    let node = |id: NodeId| format!("node {}", name(id));
    let mut problems = Vec::new();
    let mut dense: Option<(NodeId, u64)> = None;
    let mut replicas: BTreeMap<(u32, u32), (NodeId, u64)> = BTreeMap::new();
    let mut shards: BTreeMap<u32, (NodeId, u64)> = BTreeMap::new();
    for (id, s) in sums {
        match dense {
            Some((first, d)) if d != s.dense => problems.push(format!(
                "the dense state of {} differs from {}'s",
                node(id),
                node(first)
            )),
            Some(_) => {}
            None => dense = Some((id, s.dense)),
        }
        for &(l, e, c) in &s.replicas {
            match replicas.get(&(l, e)) {
                Some(&(other, c0)) if c0 != c => problems.push(format!(
                    "expert {e} of layer {l}: {}'s replica differs from {}'s",
                    node(id),
                    node(other)
                )),
                Some(_) => {}
                None => {
                    replicas.insert((l, e), (id, c));
                }
            }
        }
        for &(shard, c) in &s.shards {
            match shards.get(&shard) {
                Some(&(other, c0)) if c0 != c => problems.push(format!(
                    "shard {shard}: {}'s copy differs from {}'s",
                    node(id),
                    node(other)
                )),
                Some(_) => {}
                None => {
                    shards.insert(shard, (id, c));
                }
            }
        }
    }
    problems
}

fn describe_lost(lost: &[(u32, u32)]) -> String {
    let names: Vec<String> = lost
        .iter()
        .take(8)
        .map(|(l, e)| format!("expert {e} of layer {l}"))
        .collect();
    if lost.len() > names.len() {
        format!("{} and {} more", names.join(", "), lost.len() - names.len())
    } else {
        names.join(", ")
    }
}

/// Sort key putting `n2` before `n10`: the name without its trailing digits, then their value.
pub fn natural_key(name: &str) -> (String, u64, String) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, num) = name.split_at(name.len() - digits);
    (
        stem.to_owned(),
        num.parse().unwrap_or(u64::MAX),
        name.to_owned(),
    )
}

/// Rank of each node of a plan's `node_map`, looked up once per transfer (about 10⁵ per
/// reconfiguration at 2,048 nodes, where a `BTreeMap` lookup per transfer was a visible cost).
/// Node ids are small counters in practice, so the table is dense, indexed by id; ids far
/// beyond the node count fall back to a sorted table and binary search.
enum RankOf {
    Dense(Vec<u32>),
    Sorted(Vec<(NodeId, usize)>),
}

impl RankOf {
    /// Ids up to this many times the node count (plus a margin) use the dense table.
    const DENSE_FACTOR: usize = 16;

    fn new(node_map: &[NodeId]) -> Self {
        let max_id = node_map.iter().copied().max().map_or(0, |m| m as usize);
        if max_id <= Self::DENSE_FACTOR * node_map.len() + 1024 {
            let mut rank = vec![u32::MAX; max_id + 1];
            for (r, &id) in node_map.iter().enumerate() {
                rank[id as usize] = r as u32;
            }
            Self::Dense(rank)
        } else {
            let mut rank: Vec<(NodeId, usize)> = node_map
                .iter()
                .enumerate()
                .map(|(r, &id)| (id, r))
                .collect();
            rank.sort_unstable();
            Self::Sorted(rank)
        }
    }

    /// # Panics
    /// If `id` is not in the plan (a transfer always names plan members), as the map lookup
    /// it replaces did.
    fn of(&self, id: NodeId) -> usize {
        let r = match self {
            Self::Dense(rank) => rank
                .get(id as usize)
                .copied()
                .filter(|&r| r != u32::MAX)
                .map(|r| r as usize),
            Self::Sorted(rank) => rank
                .binary_search_by_key(&id, |&(i, _)| i)
                .ok()
                .map(|i| rank[i].1),
        };
        r.unwrap_or_else(|| panic!("node {id} of a transfer is not in the plan"))
    }
}

#[cfg(test)]
mod rank_of_tests {
    use super::RankOf;

    /// The dense and the sorted table give every member's rank.
    #[test]
    fn dense_and_sorted_tables_agree() {
        let small: Vec<u32> = vec![7, 3, 0, 12, 5];
        let sparse: Vec<u32> = vec![4_000_000_000, 3, 90_000, 12, 5];
        for map in [small, sparse] {
            let rank = RankOf::new(&map);
            for (r, &id) in map.iter().enumerate() {
                assert_eq!(rank.of(id), r);
            }
        }
        assert!(matches!(RankOf::new(&[7, 3, 0]), RankOf::Dense(_)));
        assert!(matches!(RankOf::new(&[4_000_000_000]), RankOf::Sorted(_)));
    }
}
