//! The controller: a pure state machine ([`ControllerState`]) that owns the cluster view and
//! asks the planner for plans, and the async server ([`run_controller`]) that feeds it from
//! agent connections and a ticker.
//!
//! # Decisions (where the paper is silent, `shared/reference/lazarus.md` §1)
//! * **Failure detection is heartbeat-only.** A node is dead once its last heartbeat (or its
//!   registration) is *more than* `heartbeat_timeout_ms` old: alive at exactly the timeout,
//!   dead one millisecond later. A closed connection is not a failure signal by itself (a
//!   partition does not close sockets either, and one rule is easier to reason about); a
//!   [`ToController::Bye`] removes a node at once.
//! * **Fencing.** An expired node is told [`ToAgent::Rejected`] (if its connection is still
//!   there) and anything it sends later is refused: its state was already written off by a
//!   replan. A node that restarts must register again and gets a fresh id and empty holdings;
//!   while its old incarnation is still considered alive, the duplicate name is rejected.
//! * **When plans are made.** The first plan waits until `initial_nodes` have registered, or
//!   until `scale_out_wait_ms` after the first registration with whatever registered. After
//!   that, losing a member (expiry or `Bye`) replans at once on the survivors, together with
//!   any nodes waiting to join; new nodes alone trigger a replan only `scale_out_wait_ms`
//!   after the first of them registered (lazy scale-out, paper §1.4: 2 min), so a burst of
//!   arrivals costs one reconfiguration. Every plan includes every live node.
//! * **Planner calls.** The first plan is [`plan_model`] (Eq. 1 + MRO, layers aligned) over the
//!   registered nodes in id order. Later ones are [`lazarus_planner::replan`] with the optimal
//!   (Hungarian) migration mapping, over the survivors (holding what the previous plan gave
//!   them) followed by the new nodes (holding nothing). If some expert has no surviving
//!   replica ([`lost_experts`], or [`MigrateError::ExpertLost`] from the mapping), the plan is
//!   a fresh [`plan_model`] over the live nodes with `restore_from_checkpoint = true` and no
//!   transfers: the whole model rolls back to the checkpoint. A plan that cannot be made (too
//!   few slots for the experts) is recorded in [`ControllerState::last_error`] and retried on
//!   the next membership change.
//! * **Holdings.** A broadcast plan is taken as applied: its assignment becomes each member's
//!   holdings for the next migration. The protocol has no "migration done" acknowledgement, so
//!   a node that dies mid-migration is simply a failure of the next round.
//! * **Loads.** Each [`ToController::RoutingStats`] is one node's counts for one step. Counts of
//!   the same step are summed over nodes, and a step is pushed into the
//!   [`LoadHistory`] (in step order) once every live member reported it, or once more than
//!   [`MAX_PENDING_STEPS`] steps are buffered (a straggler cannot stall aggregation). Reports
//!   for a step already pushed are ignored. Before any report the loads are all zero and Eq. 1
//!   splits the slots evenly.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use lazarus_planner::migrate::{
    MappingMethod, MigrateError, MigrationPlan, PhysicalNode, lost_experts,
};
use lazarus_planner::{
    Aggregation, Alignment, AllocPolicy, ClusterSpec, LoadHistory, ModelPlan, ModelSpec,
    PlacePolicy, PlanError, ReplanError, ReplanOptions, plan_model,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use super::proto::{self, Framed, PROTOCOL_VERSION, ProtoError, ToAgent, ToController};
use super::shutdown_signal;
use crate::control::proto::PlanMsg;

/// Steps of routing counts buffered while waiting for every member's report.
pub const MAX_PENDING_STEPS: usize = 8;

/// How long [`run_controller`] waits for connections to say goodbye on shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Everything the controller is configured with.
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerConfig {
    /// Shared secret every agent must present. It keeps stray or misconfigured agents out of
    /// the cluster; it is not a defence against an attacker on the network (no TLS).
    pub token: String,
    /// A node is dead once its last heartbeat is more than this old.
    pub heartbeat_timeout_ms: u64,
    /// Period of the server's ticker (expiry, replanning, broadcast).
    pub tick_ms: u64,
    /// Lazy scale-out: new nodes join a plan this long after the first of them registered
    /// (paper: 2 min).
    pub scale_out_wait_ms: u64,
    /// The first plan is made as soon as this many nodes registered (or after
    /// `scale_out_wait_ms` with fewer).
    pub initial_nodes: usize,
    /// Expert-replica slots per node (`c`).
    pub slots_per_node: usize,
    /// Experts per MoE layer (`E`).
    pub experts: usize,
    /// MoE layers (`L`).
    pub layers: usize,
    /// Fault-tolerance threshold (minimum replicas per expert; relaxed by the planner when
    /// slots run short).
    pub f: usize,
    /// Size of one expert's state, for the migration byte counts in
    /// [`ControllerState::last_migration`].
    pub bytes_per_expert: u64,
    /// How routing counts become loads.
    pub aggregation: Aggregation,
    /// Replica allocation rule (Lazarus Eq. 1 by default).
    pub alloc: AllocPolicy,
    /// Placement rule (MRO by default).
    pub place: PlacePolicy,
}

impl ControllerConfig {
    /// Defaults: `f = 2`, 10 s heartbeat timeout, 1 s ticker, 2 min scale-out wait, first plan
    /// with the first node, loads summed over the last 200 steps (the paper rebalances every
    /// 200 steps), Eq. 1 + MRO.
    pub fn new(token: impl Into<String>, experts: usize, layers: usize, slots: usize) -> Self {
        Self {
            token: token.into(),
            heartbeat_timeout_ms: 10_000,
            tick_ms: 1_000,
            scale_out_wait_ms: 120_000,
            initial_nodes: 1,
            slots_per_node: slots,
            experts,
            layers,
            f: 2,
            bytes_per_expert: 0,
            aggregation: Aggregation::Sum { window_steps: 200 },
            alloc: AllocPolicy::Lazarus,
            place: PlacePolicy::Mro,
        }
    }

    fn model(&self) -> ModelSpec {
        ModelSpec {
            experts: self.experts,
            layers: self.layers,
            f: self.f,
        }
    }
}

/// A configuration the controller cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("{0} must be at least 1")]
    Zero(&'static str),
}

/// Why a registration was refused; its `Display` is the `reason` sent to the agent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("protocol version mismatch: agent speaks v{agent}, controller speaks v{controller}")]
    Version { agent: u16, controller: u16 },
    #[error("wrong cluster token")]
    BadToken,
    #[error("node name {0:?} is already registered and alive")]
    DuplicateName(String),
    #[error("node {0:?} reports 0 devices")]
    NoDevices(String),
    #[error("node ids exhausted")]
    IdsExhausted,
}

/// Why a routing report was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RoutingError {
    #[error("routing stats from unknown or expired node {0}")]
    UnknownNode(u32),
    #[error("routing stats have the wrong shape: {0}")]
    Shape(PlanError),
}

#[derive(Debug, Clone)]
struct NodeEntry {
    name: String,
    devices: usize,
    last_seen_ms: u64,
    /// `[layer]` → expert ids, from the last plan; empty for a node no plan included yet.
    holdings: Vec<Vec<u32>>,
}

#[derive(Debug, Clone)]
struct StepAcc {
    counts: Vec<Vec<u64>>,
    reporters: BTreeSet<u32>,
}

/// The controller's cluster view as a pure state machine: no I/O, no clock (every call that
/// depends on time takes `now_ms`, milliseconds on any monotonic clock).
#[derive(Debug, Clone)]
pub struct ControllerState {
    cfg: ControllerConfig,
    /// Live nodes by id.
    nodes: BTreeMap<u32, NodeEntry>,
    next_id: u32,
    plan: Option<PlanMsg>,
    migration: Option<MigrationPlan>,
    /// Version of the last plan (0 before the first).
    version: u64,
    /// When the first live node that no plan includes yet registered.
    pending_since_ms: Option<u64>,
    /// A member of the current plan died or left since it was issued.
    members_lost: bool,
    rebalance: bool,
    /// The last planning attempt failed; wait for a membership change before retrying.
    blocked: bool,
    last_error: Option<ReplanError>,
    history: LoadHistory,
    steps: BTreeMap<u64, StepAcc>,
    flushed_through: Option<u64>,
}

impl ControllerState {
    pub fn new(cfg: ControllerConfig) -> Result<Self, ConfigError> {
        cfg.model().validate()?;
        ClusterSpec::new(1, cfg.slots_per_node).validate()?;
        for (name, v) in [
            ("heartbeat_timeout_ms", cfg.heartbeat_timeout_ms),
            ("tick_ms", cfg.tick_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        let history = LoadHistory::new(cfg.aggregation, cfg.layers, cfg.experts)?;
        Ok(Self {
            cfg,
            nodes: BTreeMap::new(),
            next_id: 0,
            plan: None,
            migration: None,
            version: 0,
            pending_since_ms: None,
            members_lost: false,
            rebalance: false,
            blocked: false,
            last_error: None,
            history,
            steps: BTreeMap::new(),
            flushed_through: None,
        })
    }

    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }

    /// Admits a node: protocol version, shared token, at least one device, a name no live node
    /// uses. Registration counts as a heartbeat. Ids are never reused.
    pub fn register(
        &mut self,
        version: u16,
        token: &str,
        node: &str,
        devices: usize,
        now_ms: u64,
    ) -> Result<u32, Reject> {
        if version != PROTOCOL_VERSION {
            return Err(Reject::Version {
                agent: version,
                controller: PROTOCOL_VERSION,
            });
        }
        if !tokens_match(token, &self.cfg.token) {
            return Err(Reject::BadToken);
        }
        if devices == 0 {
            return Err(Reject::NoDevices(node.to_owned()));
        }
        if self.nodes.values().any(|n| n.name == node) {
            return Err(Reject::DuplicateName(node.to_owned()));
        }
        let id = self.next_id;
        self.next_id = id.checked_add(1).ok_or(Reject::IdsExhausted)?;
        self.nodes.insert(
            id,
            NodeEntry {
                name: node.to_owned(),
                devices,
                last_seen_ms: now_ms,
                holdings: Vec::new(),
            },
        );
        self.pending_since_ms.get_or_insert(now_ms);
        self.blocked = false;
        Ok(id)
    }

    /// Records a heartbeat; `false` if the node is unknown or already expired (fenced).
    pub fn heartbeat(&mut self, node_id: u32, now_ms: u64) -> bool {
        match self.nodes.get_mut(&node_id) {
            Some(n) => {
                n.last_seen_ms = n.last_seen_ms.max(now_ms);
                true
            }
            None => false,
        }
    }

    /// Removes every node whose last heartbeat is more than `heartbeat_timeout_ms` old and
    /// returns their ids (ascending).
    pub fn expire(&mut self, now_ms: u64) -> Vec<u32> {
        let timeout = self.cfg.heartbeat_timeout_ms;
        let dead: Vec<u32> = self
            .nodes
            .iter()
            .filter(|(_, n)| now_ms.saturating_sub(n.last_seen_ms) > timeout)
            .map(|(&id, _)| id)
            .collect();
        for &id in &dead {
            self.remove(id);
        }
        dead
    }

    /// A graceful departure ([`ToController::Bye`]); `false` if the node was not live.
    pub fn leave(&mut self, node_id: u32) -> bool {
        let live = self.nodes.contains_key(&node_id);
        if live {
            self.remove(node_id);
        }
        live
    }

    fn remove(&mut self, node_id: u32) {
        self.nodes.remove(&node_id);
        if self.plan.as_ref().is_some_and(|p| p.is_member(node_id)) {
            self.members_lost = true;
        }
        if !self.nodes.keys().any(|&id| !self.is_member(id)) {
            self.pending_since_ms = None;
        }
        self.blocked = false;
        self.flush_steps();
    }

    fn is_member(&self, node_id: u32) -> bool {
        self.plan.as_ref().is_some_and(|p| p.is_member(node_id))
    }

    /// Adds one node's routed-token counts for one step (`counts[layer][expert]`); see the
    /// module docs for how steps are aggregated.
    pub fn record_routing(
        &mut self,
        node_id: u32,
        step: u64,
        counts: &[Vec<u64>],
    ) -> Result<(), RoutingError> {
        if !self.nodes.contains_key(&node_id) {
            return Err(RoutingError::UnknownNode(node_id));
        }
        if counts.len() != self.cfg.layers {
            return Err(RoutingError::Shape(PlanError::LayerCount {
                expected: self.cfg.layers,
                got: counts.len(),
            }));
        }
        if let Some(bad) = counts.iter().find(|c| c.len() != self.cfg.experts) {
            return Err(RoutingError::Shape(PlanError::LoadCount {
                expected: self.cfg.experts,
                got: bad.len(),
            }));
        }
        if self.flushed_through.is_some_and(|done| step <= done) {
            return Ok(());
        }
        let (layers, experts) = (self.cfg.layers, self.cfg.experts);
        let acc = self.steps.entry(step).or_insert_with(|| StepAcc {
            counts: vec![vec![0; experts]; layers],
            reporters: BTreeSet::new(),
        });
        if acc.reporters.insert(node_id) {
            for (sum, c) in acc.counts.iter_mut().zip(counts) {
                for (a, &b) in sum.iter_mut().zip(c) {
                    *a = a.saturating_add(b);
                }
            }
        }
        self.flush_steps();
        Ok(())
    }

    /// Pushes complete (or overflowing) steps into the load history, oldest first.
    fn flush_steps(&mut self) {
        let expected: Vec<u32> = match &self.plan {
            Some(p) => p
                .members
                .iter()
                .copied()
                .filter(|id| self.nodes.contains_key(id))
                .collect(),
            None => self.nodes.keys().copied().collect(),
        };
        loop {
            let overflowing = self.steps.len() > MAX_PENDING_STEPS;
            let Some(entry) = self.steps.first_entry() else {
                break;
            };
            let complete = expected.iter().all(|id| entry.get().reporters.contains(id));
            if !complete && !overflowing {
                break;
            }
            let (step, acc) = entry.remove_entry();
            // Shapes were checked in `record_routing`.
            self.history
                .push(&acc.counts)
                .expect("routing counts were shape-checked on arrival");
            self.flushed_through = Some(step);
        }
    }

    /// Replaces what the controller believes `node_id` holds (`holdings[layer]` = expert ids)
    /// with what its worker reported: after a reconfiguration that failed half-way a node
    /// holds neither its old nor its new assignment. `false` if the node is not live.
    pub fn set_holdings(&mut self, node_id: u32, holdings: Vec<Vec<u32>>) -> bool {
        match self.nodes.get_mut(&node_id) {
            Some(n) => {
                n.holdings = holdings;
                true
            }
            None => false,
        }
    }

    /// Asks for a rebalance with the current loads at the next [`replan`](Self::replan), even
    /// without a membership change (the paper rebalances every 200 steps).
    pub fn request_rebalance(&mut self) {
        if self.plan.is_some() {
            self.rebalance = true;
        }
    }

    /// The next plan, if one is due now (see the module docs); `None` otherwise or when no
    /// plan can be made (then [`last_error`](Self::last_error) says why).
    pub fn replan(&mut self, now_ms: u64) -> Option<PlanMsg> {
        if !self.due(now_ms) {
            return None;
        }
        let made = if self.plan.is_none() {
            // Ranks follow node names (natural order: n2 before n10), not the order in which
            // nodes happened to register, so that the first plan is reproducible.
            let mut ids: Vec<u32> = self.nodes.keys().copied().collect();
            ids.sort_by_cached_key(|id| natural_key(&self.nodes[id].name));
            self.fresh_plan(&ids, false).map(|msg| (msg, None))
        } else {
            self.next_plan()
        };
        match made {
            Ok((msg, migration)) => {
                for (id, holdings) in &msg.assignment {
                    if let Some(n) = self.nodes.get_mut(id) {
                        n.holdings = holdings.clone();
                    }
                }
                self.version = msg.version;
                self.plan = Some(msg.clone());
                self.migration = migration;
                self.pending_since_ms = None;
                self.members_lost = false;
                self.rebalance = false;
                self.last_error = None;
                Some(msg)
            }
            Err(e) => {
                self.blocked = true;
                self.last_error = Some(e);
                None
            }
        }
    }

    fn due(&self, now_ms: u64) -> bool {
        if self.blocked || self.nodes.is_empty() {
            return false;
        }
        let waited = self
            .pending_since_ms
            .is_some_and(|t| now_ms.saturating_sub(t) >= self.cfg.scale_out_wait_ms);
        match self.plan {
            None => self.nodes.len() >= self.cfg.initial_nodes || waited,
            Some(_) => self.members_lost || self.rebalance || waited,
        }
    }

    /// Reconfiguration of a running cluster: survivors (plan order) then new nodes (id order).
    fn next_plan(&self) -> Result<(PlanMsg, Option<MigrationPlan>), ReplanError> {
        let members = self.plan.as_ref().map_or(&[][..], |p| &p.members);
        let survivors = members.iter().filter(|id| self.nodes.contains_key(id));
        let newcomers = self.nodes.keys().filter(|&&id| !self.is_member(id));
        let physical: Vec<PhysicalNode> = survivors
            .chain(newcomers)
            .map(|&id| PhysicalNode {
                id,
                holdings: self.nodes[&id].holdings.clone(),
            })
            .collect();
        let ids: Vec<u32> = physical.iter().map(|p| p.id).collect();
        if !lost_experts(&physical, self.cfg.layers, self.cfg.experts).is_empty() {
            return self.fresh_plan(&ids, true).map(|msg| (msg, None));
        }
        let options = ReplanOptions {
            alloc: self.cfg.alloc,
            place: self.cfg.place,
            mapping: MappingMethod::Optimal,
            bytes_per_expert: self.cfg.bytes_per_expert,
        };
        let loads = self.history.loads();
        match lazarus_planner::replan(
            &physical,
            self.cfg.slots_per_node,
            &self.cfg.model(),
            &loads,
            &options,
            self.version,
        ) {
            Ok((plan, migration)) => {
                let transfers = migration
                    .transfers
                    .iter()
                    .map(|t| (t.layer, t.expert, t.src, t.dst))
                    .collect();
                Ok((to_msg(&plan, transfers, false), Some(migration)))
            }
            Err(ReplanError::Migrate(MigrateError::ExpertLost { .. })) => {
                self.fresh_plan(&ids, true).map(|msg| (msg, None))
            }
            Err(e) => Err(e),
        }
    }

    /// A plan over `ids` (in that order) that ignores current holdings.
    fn fresh_plan(&self, ids: &[u32], restore: bool) -> Result<PlanMsg, ReplanError> {
        let cluster = ClusterSpec::new(ids.len(), self.cfg.slots_per_node);
        let mut plan = plan_model(
            &cluster,
            &self.cfg.model(),
            &self.history.loads(),
            self.cfg.alloc,
            self.cfg.place,
            Alignment::Aligned,
        )?;
        plan.node_map = ids.to_vec();
        plan.version = self.version + 1;
        Ok(to_msg(&plan, Vec::new(), restore))
    }

    /// Live node ids, ascending.
    pub fn live_nodes(&self) -> Vec<u32> {
        self.nodes.keys().copied().collect()
    }

    /// Name and device count of a live node.
    pub fn node_info(&self, node_id: u32) -> Option<(&str, usize)> {
        self.nodes
            .get(&node_id)
            .map(|n| (n.name.as_str(), n.devices))
    }

    /// The plan in force (the last one issued).
    pub fn current_plan(&self) -> Option<&PlanMsg> {
        self.plan.as_ref()
    }

    /// Migration behind the current plan (`None` for a first or checkpoint-restore plan).
    pub fn last_migration(&self) -> Option<&MigrationPlan> {
        self.migration.as_ref()
    }

    /// Why the last planning attempt failed, until a plan succeeds.
    pub fn last_error(&self) -> Option<&ReplanError> {
        self.last_error.as_ref()
    }

    /// Current aggregated loads, `[layer][expert]`.
    pub fn loads(&self) -> Vec<Vec<u64>> {
        self.history.loads()
    }

    /// Steps folded into the loads so far.
    pub fn steps_aggregated(&self) -> u64 {
        self.history.steps_seen()
    }
}

fn to_msg(plan: &ModelPlan, transfers: Vec<(u32, u32, u32, u32)>, restore: bool) -> PlanMsg {
    let assignment: Vec<(u32, Vec<Vec<u32>>)> = plan
        .node_map
        .iter()
        .copied()
        .zip(plan.plan_node_contents())
        .collect();
    PlanMsg {
        version: plan.version,
        members: plan.node_map.clone(),
        assignment,
        transfers,
        restore_from_checkpoint: restore,
    }
}

/// Sort key putting `n2` before `n10`: the name without its trailing digits, then their value.
fn natural_key(name: &str) -> (String, u64, String) {
    let stem = name.trim_end_matches(|c: char| c.is_ascii_digit());
    let number = name[stem.len()..].parse().unwrap_or(0);
    (stem.to_owned(), number, name.to_owned())
}

/// Compares without an early exit on the first differing byte.
fn tokens_match(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

/// Why the controller could not run.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("invalid controller configuration: {0}")]
    Config(#[from] ConfigError),
}

struct Shared {
    state: ControllerState,
    /// Per connected node: tells its connection task that the node was fenced out, and why.
    kicks: HashMap<u32, oneshot::Sender<String>>,
}

struct Ctx {
    shared: Mutex<Shared>,
    start: Instant,
    /// The latest plan, encoded once as a `ToAgent::Plan` frame.
    plans: watch::Sender<Option<Bytes>>,
    /// Bound on waiting for `Register` and on every write: a heartbeat timeout.
    io_timeout: Duration,
    heartbeat_timeout_ms: u64,
}

impl Ctx {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panicking connection task must not take the controller down with it.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Expiry, replanning and broadcast: one ticker period's work.
    fn tick(&self) {
        let now = self.now_ms();
        let mut g = self.lock();
        for id in g.state.expire(now) {
            if let Some(kick) = g.kicks.remove(&id) {
                let reason = format!(
                    "node {id} expired: no heartbeat for more than {} ms",
                    self.heartbeat_timeout_ms
                );
                // The connection may already be gone; nothing to tell then.
                let _ = kick.send(reason);
            }
        }
        if let Some(plan) = g.state.replan(now) {
            // Postcard fails only on types it cannot represent (unsized sequences, maps with
            // non-serializable keys); a plan is plain integers and vectors, so a failure here
            // is a programming error.
            let frame = proto::encode(&ToAgent::Plan(plan)).expect("a plan always encodes");
            self.plans.send_replace(Some(frame));
        }
    }
}

/// Runs the controller on `listener` until `shutdown` turns `true` (or its sender is
/// dropped): one task per agent connection, and a ticker every `tick_ms` that expires dead
/// nodes, replans and broadcasts new plans to every live agent. On shutdown every connected
/// agent is sent [`ToAgent::Shutdown`].
pub async fn run_controller(
    listener: TcpListener,
    cfg: ControllerConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), ControllerError> {
    let tick = Duration::from_millis(cfg.tick_ms);
    let heartbeat_timeout_ms = cfg.heartbeat_timeout_ms;
    let state = ControllerState::new(cfg)?;
    let ctx = Arc::new(Ctx {
        shared: Mutex::new(Shared {
            state,
            kicks: HashMap::new(),
        }),
        start: Instant::now(),
        plans: watch::Sender::new(None),
        // An agent sends Register right after connecting, and a healthy one reads what it is
        // sent; a heartbeat timeout is generous for both.
        io_timeout: Duration::from_millis(heartbeat_timeout_ms),
        heartbeat_timeout_ms,
    });
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown_signal(&mut shutdown) => break,
            _ = ticker.tick() => ctx.tick(),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Small frames, latency matters more than throughput.
                    let _ = stream.set_nodelay(true);
                    conns.spawn(serve_conn(stream, ctx.clone(), shutdown.clone()));
                }
                Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    // Connection tasks see the same shutdown signal and send `Shutdown` themselves.
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        conns.abort_all();
    }
    Ok(())
}

async fn serve_conn(stream: TcpStream, ctx: Arc<Ctx>, mut shutdown: watch::Receiver<bool>) {
    let mut framed = proto::framed(stream);
    // Connection-level errors end only this connection; the node's fate is decided by
    // heartbeats.
    let _ = serve(&mut framed, &ctx, &mut shutdown).await;
}

/// Sends one frame, bounded by the I/O timeout: a peer that stops reading must not pin its
/// connection task forever (its node expires meanwhile and is replanned away).
async fn write(ctx: &Ctx, framed: &mut Framed, frame: Bytes) -> Result<(), ProtoError> {
    match tokio::time::timeout(ctx.io_timeout, framed.send(frame)).await {
        Ok(sent) => Ok(sent?),
        Err(_) => Err(ProtoError::Io(std::io::ErrorKind::TimedOut.into())),
    }
}

async fn write_msg(ctx: &Ctx, framed: &mut Framed, msg: &ToAgent) -> Result<(), ProtoError> {
    write(ctx, framed, proto::encode(msg)?).await
}

/// Tells the peer why it is turned away, then closes the connection.
async fn reject(ctx: &Ctx, framed: &mut Framed, reason: String) -> Result<(), ProtoError> {
    write_msg(ctx, framed, &ToAgent::Rejected { reason }).await?;
    // Closing is best effort: the connection is dropped right after anyway.
    let _ = tokio::time::timeout(ctx.io_timeout, SinkExt::<Bytes>::close(framed)).await;
    Ok(())
}

async fn serve(
    framed: &mut Framed,
    ctx: &Ctx,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), ProtoError> {
    let (version, token, node, devices) = match proto::read_register(framed, ctx.io_timeout).await?
    {
        proto::FirstFrame::Register(r) => (r.version, r.token, r.node, r.devices),
        proto::FirstFrame::Closed => return Ok(()),
        proto::FirstFrame::Reject(reason) => return reject(ctx, framed, reason).await,
    };
    // Subscribe before registering so no plan issued in between is missed.
    let mut plans = ctx.plans.subscribe();
    let (kick_tx, kick_rx) = oneshot::channel();
    let registered = {
        let now = ctx.now_ms();
        let mut g = ctx.lock();
        let r = g.state.register(version, &token, &node, devices, now);
        if let Ok(id) = r {
            g.kicks.insert(id, kick_tx);
        }
        r
    };
    let node_id = match registered {
        Ok(id) => id,
        Err(r) => return reject(ctx, framed, r.to_string()).await,
    };
    let result = session(framed, ctx, shutdown, node_id, kick_rx, &mut plans).await;
    ctx.lock().kicks.remove(&node_id);
    result
}

/// The registered part of a connection.
async fn session(
    framed: &mut Framed,
    ctx: &Ctx,
    shutdown: &mut watch::Receiver<bool>,
    node_id: u32,
    mut kick: oneshot::Receiver<String>,
    plans: &mut watch::Receiver<Option<Bytes>>,
) -> Result<(), ProtoError> {
    write_msg(ctx, framed, &ToAgent::Registered { node_id }).await?;
    // A newcomer learns the plan in force (it is not a member yet).
    let current = plans.borrow_and_update().clone();
    if let Some(frame) = current {
        write(ctx, framed, frame).await?;
    }
    loop {
        tokio::select! {
            _ = shutdown_signal(shutdown) => {
                write_msg(ctx, framed, &ToAgent::Shutdown).await?;
                let _ = tokio::time::timeout(ctx.io_timeout, SinkExt::<Bytes>::close(framed)).await;
                return Ok(());
            }
            reason = &mut kick => {
                let reason = reason.unwrap_or_else(|_| format!("node {node_id} was removed"));
                return reject(ctx, framed, reason).await;
            }
            changed = plans.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                let latest = plans.borrow_and_update().clone();
                if let Some(frame) = latest {
                    write(ctx, framed, frame).await?;
                }
            }
            frame = framed.next() => {
                // End of stream or a reset: not a failure signal by itself (module docs).
                let Some(frame) = frame else { return Ok(()) };
                let msg = match proto::decode::<ToController>(&frame?) {
                    Ok(msg) => msg,
                    Err(e) => {
                        ctx.lock().state.leave(node_id);
                        return reject(ctx, framed, format!("node {node_id} fenced: {e}")).await;
                    }
                };
                if let Some(reason) = handle(ctx, node_id, msg) {
                    return match reason {
                        Handled::Left => Ok(()),
                        Handled::Fenced(reason) => reject(ctx, framed, reason).await,
                    };
                }
            }
        }
    }
}

enum Handled {
    /// The node said goodbye.
    Left,
    /// The node is out; tell it why and close.
    Fenced(String),
}

/// Applies one message of a registered node; `Some` ends the session.
fn handle(ctx: &Ctx, node_id: u32, msg: ToController) -> Option<Handled> {
    let now = ctx.now_ms();
    let mut g = ctx.lock();
    match msg {
        ToController::Heartbeat { node_id: id, .. } if id == node_id => {
            if g.state.heartbeat(node_id, now) {
                None
            } else {
                Some(Handled::Fenced(format!(
                    "node {node_id} expired: no heartbeat for more than {} ms",
                    ctx.heartbeat_timeout_ms
                )))
            }
        }
        ToController::RoutingStats {
            node_id: id,
            step,
            counts,
        } if id == node_id => match g.state.record_routing(node_id, step, &counts) {
            Ok(()) => None,
            Err(e) => {
                g.state.leave(node_id);
                Some(Handled::Fenced(format!("node {node_id} fenced: {e}")))
            }
        },
        ToController::Bye { node_id: id } if id == node_id => {
            g.state.leave(node_id);
            Some(Handled::Left)
        }
        other => {
            g.state.leave(node_id);
            Some(Handled::Fenced(format!(
                "node {node_id} fenced: unexpected message {}",
                match other {
                    ToController::Register { .. } => "Register after registration".to_owned(),
                    ToController::Heartbeat { node_id: id, .. }
                    | ToController::RoutingStats { node_id: id, .. }
                    | ToController::Bye { node_id: id }
                    | ToController::Worker { node_id: id, .. } => format!("for node {id}"),
                }
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ControllerConfig {
        let mut c = ControllerConfig::new("s3cret", 4, 1, 4);
        c.heartbeat_timeout_ms = 100;
        c.initial_nodes = 2;
        c
    }

    #[test]
    fn tokens_compare_exactly() {
        assert!(tokens_match("abc", "abc"));
        assert!(!tokens_match("abd", "abc"));
        assert!(!tokens_match("ab", "abc"));
        assert!(tokens_match("", ""));
    }

    #[test]
    fn routing_steps_wait_for_every_member() {
        let mut s = ControllerState::new(cfg()).unwrap();
        let a = s.register(PROTOCOL_VERSION, "s3cret", "a", 1, 0).unwrap();
        let b = s.register(PROTOCOL_VERSION, "s3cret", "b", 1, 0).unwrap();
        assert!(s.replan(0).is_some());
        s.record_routing(a, 1, &[vec![1, 2, 3, 4]]).unwrap();
        assert_eq!(s.steps_aggregated(), 0, "b has not reported step 1");
        s.record_routing(b, 1, &[vec![10, 0, 0, 0]]).unwrap();
        assert_eq!(s.steps_aggregated(), 1);
        assert_eq!(s.loads(), vec![vec![11, 2, 3, 4]]);
        // A late duplicate of a folded step is ignored.
        s.record_routing(a, 1, &[vec![100, 0, 0, 0]]).unwrap();
        assert_eq!(s.loads(), vec![vec![11, 2, 3, 4]]);
        // A dead member no longer holds steps back.
        s.record_routing(a, 2, &[vec![0, 0, 0, 5]]).unwrap();
        s.heartbeat(a, 150);
        assert_eq!(s.expire(150), vec![b]);
        assert_eq!(s.loads(), vec![vec![11, 2, 3, 9]]);
        assert!(matches!(
            s.record_routing(a, 3, &[vec![1]]),
            Err(RoutingError::Shape(_))
        ));
        assert_eq!(
            s.record_routing(b, 3, &[vec![0; 4]]),
            Err(RoutingError::UnknownNode(b))
        );
    }

    #[test]
    fn stragglers_cannot_stall_aggregation() {
        let mut s = ControllerState::new(cfg()).unwrap();
        let a = s.register(PROTOCOL_VERSION, "s3cret", "a", 1, 0).unwrap();
        s.register(PROTOCOL_VERSION, "s3cret", "b", 1, 0).unwrap();
        for step in 0..=MAX_PENDING_STEPS as u64 {
            s.record_routing(a, step, &[vec![1, 0, 0, 0]]).unwrap();
        }
        assert_eq!(s.steps_aggregated(), 1);
    }

    #[test]
    fn too_few_slots_is_reported_and_retried_on_join() {
        let mut c = ControllerConfig::new("t", 8, 1, 4);
        c.initial_nodes = 1;
        let mut s = ControllerState::new(c).unwrap();
        s.register(PROTOCOL_VERSION, "t", "a", 1, 0).unwrap();
        assert_eq!(s.replan(0), None);
        assert!(matches!(
            s.last_error(),
            Some(ReplanError::Plan(PlanError::TooFewSlots { .. }))
        ));
        s.register(PROTOCOL_VERSION, "t", "b", 1, 1).unwrap();
        let plan = s.replan(1).expect("8 slots now hold 8 experts");
        assert_eq!(plan.version, 1);
        assert_eq!(s.last_error(), None);
    }

    #[test]
    fn bad_config_is_an_error() {
        let mut c = cfg();
        c.tick_ms = 0;
        assert_eq!(
            ControllerState::new(c).unwrap_err(),
            ConfigError::Zero("tick_ms")
        );
        let mut c = cfg();
        c.aggregation = Aggregation::Sum { window_steps: 0 };
        assert!(ControllerState::new(c).is_err());
    }
}
