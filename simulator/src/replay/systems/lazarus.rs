//! `lazarus` (paper §3–§5): the job's control rules are [`JobMachine`]'s, the same state
//! machine `lzrun` drives. This module only translates: engine happenings become the machine's
//! [`Event`]s, and the machine's [`Action`]s become the engine's [`Order`]s, which the engine
//! performs with modelled durations (the cost model's migration, restart and checkpoint times).
//! `laer` and `lazarus-fsep` are the same driver with sharded experts ([`Driver::sharded`]):
//! their plans carry the machine's shard placement, and an in-place reconfiguration's
//! migration is its shard copies ([`super::fsep`] models their step cost).
//!
//! * a node becomes ready → [`Event::Joined`] + [`Event::Ready`] (the machine takes it in at the
//!   start, after a wait for nodes, or lazily `scale_out_wait` later);
//! * a node the job does not use is removed → [`Event::Lost`] at once; a node in use is removed
//!   → [`Event::Lost`] once the failure is *detected* (the engine models the detection timeout),
//!   followed by every surviving member's [`Event::Idle`] (`Failed`) with its holdings in the
//!   current plan;
//! * a segment of steps completes → [`Event::StepsDone`] with the workload's routed tokens of
//!   those steps (one event per step for the last `window` steps, so the machine's routing
//!   history is the per-step sliding window it keeps in `lzrun`);
//! * the engine saved a checkpoint → [`Event::CheckpointWritten`] of every member, and the
//!   machine's [`Action::CommitCheckpoint`] is answered [`Event::CheckpointCommitted`]; the
//!   cadence is the engine's (`--ckpt-every` in steps, or Young/Daly converted to steps), the
//!   same number the machine is configured with;
//! * time passes → [`Event::Tick`] (when a lazy scale-out may be due);
//! * [`Action::Pause`] (a rebalance or a join) → the members stop at the next step boundary and
//!   report [`Event::Idle`] (`Paused`) there;
//! * [`Action::FindCheckpoint`] → [`Event::CheckpointFound`] with the newest checkpoint the
//!   engine saved (step 0, the fresh start, when none);
//! * [`Action::Reconfigure`] → [`Order::Start`], [`Order::Reconfigure`] (state from peers: an
//!   in-place reconfiguration with its migration) or [`Order::Restore`] (a restart from the
//!   checkpoint); the engine answers [`Event::Migrated`] of every member when its modelled
//!   pause ends ([`Driver::reconfigured`]);
//! * [`Action::WaitForNodes`] → [`Order::Wait`]: the job idles until nodes join.
//!
//! The machine's own detection (heartbeats, member timeouts) is configured off: the engine
//! models detection, and its simulated workers always answer.

use super::fsep::{FsepLayout, shard_bytes};
use super::{Ctx, Decision, Layout, Migration, NodeId, Replicas, System};
use crate::cost::{Dispatch, LayerRuns};
use lazarus_planner::fsep::ShardPlacement;
use lazarus_planner::job::{
    Action, Event, Holdings, IdleReason, JobConfig, JobMachine, RankShardTransfer, ReconfigKind,
    Reconfiguration, RecoveryPolicy, StateSource,
};
use lazarus_planner::migrate::MappingMethod;
use lazarus_planner::{Aggregation, Alignment, AllocPolicy, ModelPlan, PlacePolicy, plan_model};
use rayon::prelude::*;

/// The cost model's view of a planner plan.
fn layout_of(ctx: &Ctx, mut plan: ModelPlan) -> Layout {
    // The machine plans per node; the GPU split of each node's slots is a view on it.
    plan.cluster.gpus_per_node = ctx.hw.gpus_per_node;
    Layout {
        nodes: plan.node_map.clone(),
        replicas: Replicas::Runs(layer_runs_of(&plan)),
        dispatch: Dispatch::Unpadded,
        ep_groups: None,
        holdings: Vec::new(),
        plan: Some(plan),
        fsep: None,
    }
}

/// The cost model's view of a sharded plan (`laer`, `lazarus-fsep`): the machine's shard
/// placement (`shard_holders`, by rank) over the plan's nodes. Its expert layout is not read
/// for the cost (the cost model re-materialises the balanced layout per load change, LAER's
/// free re-layout: [`super::fsep::layout_step_cost`]); the plan is kept so that the members
/// report their holdings as the machine's plan.
fn sharded_layout_of(plan: ModelPlan, copies: usize, shard_holders: &[Vec<usize>]) -> Layout {
    let nodes = plan.node_map.clone();
    let holders = shard_holders
        .iter()
        .map(|h| h.iter().map(|&r| r as u32).collect())
        .collect();
    let placement =
        ShardPlacement::new(nodes.len(), holders).expect("the machine's placement is valid");
    Layout {
        nodes,
        replicas: Replicas::Ranked(Vec::new()),
        dispatch: Dispatch::Unpadded,
        ep_groups: None,
        holdings: Vec::new(),
        plan: Some(plan),
        fsep: Some(Box::new(FsepLayout { copies, placement })),
    }
}

/// The migration of a sharded reconfiguration: its shard copies, each one shard index of every
/// expert of every MoE layer ([`shard_bytes`]).
fn shard_migration(ctx: &Ctx, shards: usize, transfers: &[RankShardTransfer]) -> Migration {
    let per = shard_bytes(ctx.model, shards);
    let most = |rank: fn(&RankShardTransfer) -> usize| {
        let mut n = std::collections::BTreeMap::<usize, u64>::new();
        transfers
            .iter()
            .for_each(|t| *n.entry(rank(t)).or_default() += 1);
        n.values().copied().max().unwrap_or(0)
    };
    Migration {
        replicas: transfers.len() as u64,
        bytes: transfers.len() as u64 * per,
        max_sent_bytes: most(|t| t.src_rank) * per,
        max_recv_bytes: most(|t| t.dst_rank) * per,
    }
}

/// Every layer of `plan` in runs of equal nodes ([`LayerRuns`]), in parallel (2,048 nodes ×
/// 32 slots per layer, about 250 distinct rows). Expanded, they are `plan.replicas_per_rank`
/// in sparse form (tested).
fn layer_runs_of(plan: &ModelPlan) -> Vec<LayerRuns> {
    let gpu_of: Vec<u32> = (0..plan.cluster.slots_per_node)
        .map(|s| plan.cluster.gpu_of_slot(s) as u32)
        .collect();
    plan.layers
        .par_iter()
        .map(|layer| LayerRuns::from_placement(layer, &gpu_of, plan.model.experts))
        .collect()
}

/// What the engine does next, decided by the machine.
#[derive(Debug, Clone)]
pub enum Order {
    /// The first plan: run on `layout` at once.
    Start { layout: Box<Layout> },
    /// An in-place reconfiguration (state from peers): pause for the migration (and a
    /// communicator rebuild when the membership changed), then run on `layout`.
    Reconfigure {
        kind: ReconfigKind,
        layout: Box<Layout>,
        migration: Migration,
        membership_changed: bool,
    },
    /// Every member restores the checkpoint of `step`, then runs on `layout`.
    Restore { step: u64, layout: Box<Layout> },
    /// Too few nodes to hold every expert: idle until more join.
    Wait,
}

/// The machine and its simulated members; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Driver {
    machine: JobMachine,
    /// Routing-history window (steps) of the machine's load aggregation.
    window: u64,
    /// The machine asked the members to stop at the next step boundary.
    pause_wanted: bool,
    /// Newest checkpoint the engine saved (0: the fresh start).
    newest_checkpoint: u64,
    /// Members of the last reconfiguration, in rank order.
    last_members: Vec<NodeId>,
    /// Sharded experts (`laer`, `lazarus-fsep`): copies of every shard.
    shard_copies: Option<usize>,
}

fn ms(now_ns: u64) -> u64 {
    now_ns / 1_000_000
}

/// The name a node joins under: ranks of the first plan follow it (`n2` before `n10`), so the
/// first plan's ranks are in engine node-id order.
fn node_name(id: NodeId) -> String {
    format!("n{id}")
}

impl Driver {
    /// `checkpoint_every_steps`: the engine's cadence (`None`: only the fresh start's step 0
    /// can be restored, as in the engine). `scale_out_wait_ms`: the lazy scale-out wait.
    pub fn new(
        ctx: &Ctx,
        checkpoint_every_steps: Option<u64>,
        rebalance_every_steps: Option<u64>,
        load_window_steps: u64,
        scale_out_wait_ms: u64,
        recovery: RecoveryPolicy,
    ) -> Self {
        let mut d = Self::with_experts(
            ctx,
            checkpoint_every_steps,
            rebalance_every_steps,
            load_window_steps,
            scale_out_wait_ms,
            None,
        );
        d.machine.set_recovery(recovery);
        d
    }

    /// `laer` (`copies` = 1) and `lazarus-fsep`: the same machine with
    /// [`JobConfig::sharded_experts`] and `copies` copies of every shard. The machine makes
    /// every decision (restore, in-place repair, join); it rebalances never: the cost model
    /// re-materialises the balanced layout at every load change for free (FSEP's re-layout
    /// moves no state), which a rebalance of the machine's would only approximate.
    pub fn sharded(
        ctx: &Ctx,
        checkpoint_every_steps: Option<u64>,
        load_window_steps: u64,
        scale_out_wait_ms: u64,
        copies: usize,
    ) -> Self {
        Self::with_experts(
            ctx,
            checkpoint_every_steps,
            None,
            load_window_steps,
            scale_out_wait_ms,
            Some(copies.max(1)),
        )
    }

    fn with_experts(
        ctx: &Ctx,
        checkpoint_every_steps: Option<u64>,
        rebalance_every_steps: Option<u64>,
        load_window_steps: u64,
        scale_out_wait_ms: u64,
        shard_copies: Option<usize>,
    ) -> Self {
        let model = ctx.model.planner_spec();
        let slots = ctx.model.slots_per_gpu * ctx.hw.gpus_per_node;
        let window = load_window_steps.max(1);
        let mut cfg = JobConfig::new(model, slots, u64::MAX / 4);
        cfg.heartbeat_timeout_ms = u64::MAX;
        cfg.member_timeout_ms = u64::MAX;
        cfg.scale_out_wait_ms = scale_out_wait_ms;
        cfg.rebalance_every_steps = rebalance_every_steps.unwrap_or(0);
        cfg.checkpoint_every_steps = checkpoint_every_steps.unwrap_or(u64::MAX);
        cfg.aggregation = Aggregation::Sum {
            window_steps: window as usize,
        };
        cfg.bytes_per_expert = ctx.model.bytes_per_expert_state;
        // The optimal mapping (Hungarian) up to 256 nodes, the class-based one beyond: a
        // cubic Hungarian at 2,048 nodes took seconds per reconfiguration.
        cfg.mapping = MappingMethod::Scalable;
        if let Some(copies) = shard_copies {
            cfg.sharded_experts = true;
            cfg.shard_copies = copies;
        }
        let machine = JobMachine::new(cfg).expect("the model profile is a valid job");
        Self {
            machine,
            window,
            pause_wanted: false,
            newest_checkpoint: 0,
            last_members: Vec::new(),
            shard_copies,
        }
    }

    pub fn machine(&self) -> &JobMachine {
        &self.machine
    }

    /// The step at which the machine wants the next decision point (its rebalance cadence).
    pub fn next_decision_step(&self) -> Option<u64> {
        self.machine.next_rebalance_step()
    }

    /// Whether the members are to stop at the next step boundary.
    pub fn pause_wanted(&self) -> bool {
        self.pause_wanted
    }

    /// Feeds `first` and answers the machine's requests until it has nothing more to ask.
    fn feed(&mut self, ctx: &Ctx, now_ns: u64, first: Event) -> Option<Order> {
        let now = ms(now_ns);
        let mut queue = std::collections::VecDeque::from([first]);
        let mut order = None;
        let mut out = Vec::new();
        while let Some(ev) = queue.pop_front() {
            self.machine.handle(now, ev, &mut out);
            for action in out.drain(..) {
                match action {
                    Action::Pause { .. } => self.pause_wanted = true,
                    Action::FindCheckpoint => queue.push_back(Event::CheckpointFound {
                        step: self.newest_checkpoint,
                        data_cursor: None,
                    }),
                    // Only a committed checkpoint can be restored (a member lost before it
                    // wrote its parts leaves the step's uncommitted: the machine's rule).
                    Action::CommitCheckpoint { step, .. } => {
                        self.newest_checkpoint = step;
                        queue.push_back(Event::CheckpointCommitted { step })
                    }
                    Action::Reconfigure(r) => order = Some(self.order(ctx, *r)),
                    Action::WaitForNodes { .. } => order = Some(Order::Wait),
                    // The job cannot go on (no plan fits): the engine idles.
                    Action::Finished(Err(_)) => order = Some(Order::Wait),
                    // Workers are simulated: they start with their node, stop when it goes,
                    // and the driver reports every member idle itself (`Abort`).
                    Action::StartWorker { .. }
                    | Action::Abort { .. }
                    | Action::Resend { .. }
                    // Layout switches cost no pause; the machine takes the new plan when the
                    // steps past its first step are done (`Event::StepsDone`). A replicated
                    // one's background copies are not modelled.
                    | Action::SwitchLayout(_)
                    | Action::Fence { .. }
                    | Action::Stop { .. }
                    | Action::Record(_)
                    | Action::Reconfigured(_)
                    | Action::Log(_)
                    | Action::Finished(Ok(())) => {}
                }
            }
        }
        order
    }

    fn order(&mut self, ctx: &Ctx, r: Reconfiguration) -> Order {
        self.pause_wanted = false;
        let membership_changed = r.members() != self.last_members.as_slice();
        self.last_members = r.members().to_vec();
        let shards = r.shard_holders.len();
        let (layout, shard_moves) = match self.shard_copies {
            Some(copies) => (
                Box::new(sharded_layout_of(r.plan, copies, &r.shard_holders)),
                Some(shard_migration(ctx, shards, &r.shard_transfers)),
            ),
            None => (Box::new(layout_of(ctx, r.plan)), None),
        };
        match r.source {
            StateSource::Fresh => Order::Start { layout },
            StateSource::Checkpoint { step } if r.kind == ReconfigKind::Start => {
                debug_assert_eq!(step, 0, "a job never resumes in the simulator");
                Order::Start { layout }
            }
            StateSource::Checkpoint { step } => Order::Restore { step, layout },
            StateSource::Peers { .. } => Order::Reconfigure {
                kind: r.kind,
                layout,
                // Sharded: the shard copies; the expert layout moves no state.
                migration: shard_moves.unwrap_or(Migration {
                    replicas: r.transfers.len() as u64,
                    bytes: r.migration_bytes,
                    max_sent_bytes: r.max_sent_bytes,
                    max_recv_bytes: r.max_recv_bytes,
                }),
                membership_changed,
            },
        }
    }

    /// Nodes become ready together (the initial cluster): all join before any is ready, so
    /// the first plan covers all of them.
    pub fn nodes_ready(&mut self, ctx: &Ctx, now_ns: u64, nodes: &[NodeId]) -> Option<Order> {
        let mut order = None;
        for &node in nodes {
            let name = node_name(node);
            // One node per host: the trace's failure unit is the node.
            let joined = Event::Joined {
                node,
                name,
                host: None,
            };
            order = self.feed(ctx, now_ns, joined).or(order);
        }
        // Last node first: after each report the machine looks for a node still starting, a
        // scan from the lowest id that this order ends at once (linear, not quadratic, for
        // 200,000 nodes at once; the outcome is the same).
        for &node in nodes.iter().rev() {
            order = self.feed(ctx, now_ns, Event::Ready { node }).or(order);
        }
        order
    }

    /// A node the job does not use (or no longer runs on) is gone.
    pub fn node_gone(&mut self, ctx: &Ctx, now_ns: u64, node: NodeId) -> Option<Order> {
        let reason = "removed".to_string();
        self.feed(ctx, now_ns, Event::Lost { node, reason })
    }

    /// Steps `first..=last` completed on every member; `routing` are one step's routed tokens
    /// `[layer][expert]` (constant over a segment).
    pub fn steps_done(
        &mut self,
        ctx: &Ctx,
        now_ns: u64,
        first: u64,
        last: u64,
        routing: &[Vec<u64>],
    ) {
        let epoch = self.machine.epoch();
        // Steps older than the history window only count; the last `window` carry routing.
        let routed_from = (last + 1).saturating_sub(self.window).max(first);
        if routed_from > first {
            let ev = Event::StepsDone {
                epoch,
                first,
                last: routed_from - 1,
                routing: Vec::new(),
            };
            self.feed(ctx, now_ns, ev);
        }
        for s in routed_from..=last {
            let ev = Event::StepsDone {
                epoch,
                first: s,
                last: s,
                routing: routing.to_vec(),
            };
            self.feed(ctx, now_ns, ev);
        }
        debug_assert_eq!(self.machine.next_step(), last + 1, "steps counted in order");
    }

    /// Time passes (a lazy scale-out may be due).
    pub fn tick(&mut self, ctx: &Ctx, now_ns: u64) {
        let order = self.feed(ctx, now_ns, Event::Tick);
        debug_assert!(order.is_none(), "a tick only pauses");
    }

    /// Every member reports idle at the next step `step`, holding what `current` says.
    fn members_idle(
        &mut self,
        ctx: &Ctx,
        now_ns: u64,
        why: IdleReason,
        step: u64,
        current: &Layout,
    ) -> Option<Order> {
        self.pause_wanted = false;
        let epoch = self.machine.epoch();
        let mut order = None;
        let position: std::collections::HashMap<NodeId, usize> = current
            .nodes
            .iter()
            .enumerate()
            .map(|(i, &n)| (n, i))
            .collect();
        // Members hold exactly their part of the layout's plan. When that is the machine's
        // plan, they say so rather than send a copy of it (see `Holdings::Planned`).
        let planned = current
            .plan
            .as_ref()
            .filter(|p| current.holdings.is_empty() && current.nodes == p.node_map)
            .map(|p| p.version)
            .filter(|&v| self.machine.plan().is_some_and(|m| m.version == v));
        let mut held_all = if planned.is_some() {
            Vec::new()
        } else {
            current.held_all()
        };
        // Last member first: the machine checks after each report whether every member is
        // idle, a scan that stops at the first one that is not, so this order keeps the
        // reports of 2,048 members linear instead of quadratic (the outcome is the same).
        for node in self.machine.members().to_vec().into_iter().rev() {
            let held = match (position.get(&node), planned) {
                (Some(_), Some(version)) => Holdings::Planned { version },
                (Some(&i), None) => Holdings::Lists(std::mem::take(&mut held_all[i])),
                (None, _) => Holdings::Lists(Vec::new()),
            };
            let ev = Event::Idle {
                node,
                epoch,
                why: why.clone(),
                step,
                held,
            };
            order = self.feed(ctx, now_ns, ev).or(order);
        }
        order
    }

    /// The engine detected that `dead` (members) are gone; the survivors stopped at `step`
    /// holding their replicas of `current`.
    pub fn failure_detected(
        &mut self,
        ctx: &Ctx,
        now_ns: u64,
        dead: &[NodeId],
        step: u64,
        current: &Layout,
    ) -> Option<Order> {
        let mut order = None;
        for &node in dead {
            order = self.node_gone(ctx, now_ns, node).or(order);
        }
        let why = IdleReason::Failed("a peer is gone".into());
        self.members_idle(ctx, now_ns, why, step, current).or(order)
    }

    /// At a step boundary: if the machine asked for a pause, the members stop here.
    pub fn at_boundary(
        &mut self,
        ctx: &Ctx,
        now_ns: u64,
        step: u64,
        current: &Layout,
    ) -> Option<Order> {
        if !self.pause_wanted {
            return None;
        }
        self.members_idle(ctx, now_ns, IdleReason::Paused, step, current)
    }

    /// The engine finished performing the last reconfiguration: every member applied it.
    pub fn reconfigured(&mut self, ctx: &Ctx, now_ns: u64) {
        let epoch = self.machine.epoch();
        for node in self.machine.members().to_vec() {
            let ev = Event::Migrated {
                node,
                epoch,
                bytes_in: 0,
            };
            self.feed(ctx, now_ns, ev);
        }
        // A join whose wait ran out during the reconfiguration is due now.
        self.tick(ctx, now_ns);
    }

    /// The engine saved the checkpoint after `step` completed steps.
    pub fn checkpoint_saved(&mut self, ctx: &Ctx, now_ns: u64, step: u64) {
        let epoch = self.machine.epoch();
        // Last member first, as in `members_idle`.
        for node in self.machine.members().to_vec().into_iter().rev() {
            self.feed(ctx, now_ns, Event::CheckpointWritten { node, epoch, step });
        }
    }
}

/// One-shot view of the same rules for `lzsim reconfig` (one failure of a given layout): a
/// machine started on `current.nodes`, with `loads` as its routing history.
#[derive(Default)]
pub struct Lazarus;

impl System for Lazarus {
    /// The planner's first plan (Eq. 1 + MRO) for `loads` known in advance: used for cost
    /// estimates (Young/Daly, `lzsim reconfig`); the replay's start is the machine's.
    fn start(&mut self, ctx: &Ctx, ready: &[NodeId], loads: &[Vec<u64>]) -> Option<Layout> {
        if ready.is_empty() {
            return None;
        }
        let cluster = ctx.hw.cluster_spec(ctx.model, ready.len());
        let mut plan = plan_model(
            &cluster,
            &ctx.model.planner_spec(),
            loads,
            AllocPolicy::Lazarus,
            PlacePolicy::Mro,
            Alignment::Aligned,
        )
        .ok()?;
        plan.node_map = ready.to_vec();
        Some(layout_of(ctx, plan))
    }

    /// The machine's decision after `dead` fail on `current`: in place, or a restore.
    fn on_failure(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        dead: &[NodeId],
        ready: &[NodeId],
        loads: &[Vec<u64>],
    ) -> Decision {
        let d = Driver::new(ctx, None, None, 1, 0, RecoveryPolicy::Replan);
        one_shot_failure(d, ctx, current, dead, ready, loads)
    }

    /// The replay's lazarus system is [`Driver`]; this one-shot view answers failures only.
    fn wants_scale_out(&self, _ctx: &Ctx, _current: &Layout, _ready: &[NodeId]) -> bool {
        false
    }

    fn scale_out(
        &mut self,
        _ctx: &Ctx,
        _current: &Layout,
        _ready: &[NodeId],
        _loads: &[Vec<u64>],
    ) -> Decision {
        Decision::Keep
    }
}

/// One-shot view of the machine's rules for sharded experts (`laer`: `copies` = 1,
/// `lazarus-fsep`): the first plan for cost estimates (Young/Daly), and a failure of the
/// machine's first plan on `current.nodes`. The replay drives [`Driver::sharded`].
#[derive(Debug, Clone, Copy)]
pub struct Sharded {
    /// Copies of every shard; `None`: the model profile's `f` (`--f`).
    pub copies: Option<usize>,
}

impl Sharded {
    fn driver(&self, ctx: &Ctx) -> Driver {
        let copies = self.copies.unwrap_or(ctx.model.f);
        Driver::sharded(ctx, None, 1, 0, copies)
    }
}

impl System for Sharded {
    /// The machine's first plan over `ready` (its shard placement, `S` = the nodes).
    fn start(&mut self, ctx: &Ctx, ready: &[NodeId], _loads: &[Vec<u64>]) -> Option<Layout> {
        let mut d = self.driver(ctx);
        match d.nodes_ready(ctx, 0, ready) {
            Some(Order::Start { layout }) => Some(*layout),
            _ => None,
        }
    }

    /// The machine's decision after `dead` fail on its first plan over `current.nodes`.
    fn on_failure(
        &mut self,
        ctx: &Ctx,
        current: &Layout,
        dead: &[NodeId],
        ready: &[NodeId],
        loads: &[Vec<u64>],
    ) -> Decision {
        let d = self.driver(ctx);
        one_shot_failure(d, ctx, current, dead, ready, loads)
    }

    fn wants_scale_out(&self, _ctx: &Ctx, _current: &Layout, _ready: &[NodeId]) -> bool {
        false
    }

    fn scale_out(
        &mut self,
        _ctx: &Ctx,
        _current: &Layout,
        _ready: &[NodeId],
        _loads: &[Vec<u64>],
    ) -> Decision {
        Decision::Keep
    }
}

/// `d` (fresh) started on `current.nodes` (by position), with `loads` as its routing
/// history, then told that `dead` failed: its decision, in physical node ids.
fn one_shot_failure(
    mut d: Driver,
    ctx: &Ctx,
    current: &Layout,
    dead: &[NodeId],
    ready: &[NodeId],
    loads: &[Vec<u64>],
) -> Decision {
    // Members join under their position in `current`, so ranks follow it.
    let positions: Vec<NodeId> = (0..current.nodes.len() as NodeId).collect();
    let started = matches!(d.nodes_ready(ctx, 0, &positions), Some(Order::Start { .. }));
    if !started {
        return Decision::RestartFromCheckpoint;
    }
    d.reconfigured(ctx, 0);
    d.steps_done(ctx, 0, 0, 0, loads);
    // Ready nodes the layout does not use join after the start: the machine's newcomers.
    let spares: Vec<NodeId> = ready
        .iter()
        .copied()
        .filter(|id| !current.nodes.contains(id))
        .collect();
    for i in 0..spares.len() {
        d.nodes_ready(ctx, 0, &[(current.nodes.len() + i) as NodeId]);
    }
    let physical = |p: NodeId| match current.nodes.get(p as usize) {
        Some(&id) => id,
        None => spares[p as usize - current.nodes.len()],
    };
    let dead_pos: Vec<NodeId> = dead
        .iter()
        .filter_map(|id| current.nodes.iter().position(|n| n == id))
        .map(|p| p as NodeId)
        .collect();
    let view = Layout {
        nodes: positions,
        ..current.clone()
    };
    match d.failure_detected(ctx, 0, &dead_pos, 1, &view) {
        Some(Order::Reconfigure {
            mut layout,
            migration,
            ..
        }) => {
            layout.nodes = layout.nodes.iter().map(|&p| physical(p)).collect();
            if let Some(plan) = layout.plan.as_mut() {
                plan.node_map = layout.nodes.clone();
            }
            Decision::Reconfigure { layout, migration }
        }
        _ => Decision::RestartFromCheckpoint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost;

    /// The step cost of a plan's layout (runs of equal nodes) is exactly the ranked form's,
    /// with and without the equal-nodes hint, on a plan above the analytic-dispatch threshold
    /// (40 nodes × 8 GPUs), for several loads.
    #[test]
    fn runs_step_cost_is_the_ranked_one() {
        let hw = cost::hardware("h200-400g").unwrap();
        let model = cost::model("deepseek-v3").unwrap();
        let ctx = Ctx {
            hw: &hw,
            model: &model,
        };
        for skew in [1u64, 3, 17] {
            let loads: Vec<Vec<u64>> = (0..model.moe_layers as u64)
                .map(|l| {
                    (0..model.experts as u64)
                        .map(|e| 1 + (e * 7919 * skew + l * 104_729) % (97 * skew))
                        .collect()
                })
                .collect();
            let layout = Lazarus
                .start(&ctx, &(0..40).collect::<Vec<_>>(), &loads)
                .unwrap();
            let gpus = layout.gpus(&hw);
            assert!(gpus > cost::ANALYTIC_DISPATCH_ABOVE_GPUS);
            let Replicas::Runs(runs) = &layout.replicas else {
                panic!("a plan's layout is in runs");
            };
            let count: usize = runs.iter().map(|l| l.runs.len()).sum();
            assert!(count < 40 * model.moe_layers, "some nodes repeat");
            // Each node's first node of its run, the ranked form's hint.
            let equal_nodes: Vec<Vec<u32>> = runs
                .iter()
                .map(|l| {
                    l.runs
                        .iter()
                        .flat_map(|&(first, end)| {
                            std::iter::repeat_n(first, (end - first) as usize)
                        })
                        .collect()
                })
                .collect();
            let ranked = layout.replicas.ranked(hw.gpus_per_node);
            let input = |equal_nodes| cost::SparseStepInput {
                gpus,
                replicas: cost::LayerRows::Each(&ranked),
                loads: &loads,
                dispatch: Dispatch::Unpadded,
                ep_groups: None,
                equal_nodes,
            };
            let with = cost::step_cost_sparse(&hw, &model, &input(Some(&equal_nodes))).unwrap();
            let without = cost::step_cost_sparse(&hw, &model, &input(None)).unwrap();
            let (on_runs, _) =
                super::super::fsep::layout_step_cost(&hw, &model, &layout, &loads).unwrap();
            assert_eq!(with.total_s.to_bits(), without.total_s.to_bits());
            assert_eq!(on_runs.total_s.to_bits(), without.total_s.to_bits());
            assert_eq!(with, without);
            assert_eq!(on_runs, without);
        }
    }

    #[test]
    fn sparse_replicas_equal_the_dense_ones() {
        let hw = cost::hardware("h200-400g").unwrap();
        let model = cost::model("deepseek-v3").unwrap();
        let ctx = Ctx {
            hw: &hw,
            model: &model,
        };
        let loads: Vec<Vec<u64>> = (0..model.moe_layers as u64)
            .map(|l| {
                (0..model.experts as u64)
                    .map(|e| 1 + (e * 7919 + l * 104_729) % 977)
                    .collect()
            })
            .collect();
        let layout = Lazarus
            .start(&ctx, &(0..12).collect::<Vec<_>>(), &loads)
            .unwrap();
        let plan = layout.plan.as_ref().unwrap();
        let dense: Vec<Vec<Vec<u32>>> = (0..plan.layers.len())
            .map(|l| plan.replicas_per_rank(l))
            .collect();
        assert_eq!(
            *layout.replicas.ranked(hw.gpus_per_node),
            cost::sparse_replicas(&dense)
        );
        let all = layout.held_all();
        assert_eq!(all.len(), layout.nodes.len());
        for (i, held) in all.iter().enumerate() {
            assert_eq!(*held, layout.held(i), "node {i}");
        }
    }
}
