//! Load-adaptive re-layout during training, from the members' real per-rank traffic (issue 13
//! item 2).
//!
//! Every member reports the tokens *its* gate routed to each expert ([`StepReport::routing`]):
//! stacked in rank order that is the per-(source rank, expert) traffic matrix LAER-MoE's
//! planner works from. [`RelayoutState`] keeps it per layer over the job's [`Aggregation`]
//! window (a [`LoadHistory`] over `ranks × experts` columns, so bounded the same way), and at
//! every re-layout point of the [`Schedule`] (warm-up, period `rebalance_every_steps`,
//! hysteresis on the load ratio) runs [`crate::relayout::laer`] on each layer with the members
//! as devices (one device per node, `c` slots each). A decision that changes some layer is kept
//! as the next plan. With sharded experts (FSEP) it moves nothing: the machine sends it to the
//! members as a [`super::LayoutSwitch`] while they train (no pause; see the job docs). With
//! replicated experts the replicas it adds are migrated with the members' ranks unchanged
//! ([`MappingMethod::Identity`]): in the background, by the same kind of switch carrying the
//! transfers ([`super::ReplicaMigration::Async`]), or by pausing the members and issuing it
//! through the rebalance path ([`super::ReplicaMigration::Blocking`]).
//!
//! The load ratio the hysteresis compares is the current layout's max / mean tokens computed
//! per rank under the window's traffic, as the dispatcher splits them
//! ([`crate::relayout::Score::load_ratio`]): the dispatch is a deterministic function of the
//! traffic and the layout, so this is what the members computed, summed over the window.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{NodeId, StepReport};
use crate::migrate::{MappingMethod, MigrationPlan, PhysicalNode, map_layers};
use crate::place::LayerPlacement;
use crate::relayout::laer::{LaerParams, laer};
use crate::relayout::policy::Schedule;
use crate::relayout::{LinkModel, Topology, score};
use crate::{Aggregation, LoadHistory, ModelPlan};

/// The policy of the periodic rebalance (`rebalance_every_steps`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Relayout {
    /// Lazarus (§5): Eq. 1 + MRO from scratch on the summed routing history, every period.
    #[default]
    Lazarus,
    /// LAER-style incremental re-layout from the per-rank traffic (see the [module docs](self)).
    Laer(LaerRelayout),
}

/// Knobs of [`Relayout::Laer`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LaerRelayout {
    /// The search's knobs; `f` is the plan's own (its `f_effective`), `horizon_steps` the
    /// period, and `migration_weight` is 0 with sharded experts (a re-layout moves nothing).
    pub params: LaerParams,
    /// No re-layout before this many counted steps.
    pub warmup_steps: u64,
    /// Re-layout only when the load ratio (max / mean tokens computed per rank) exceeds this.
    pub imbalance_threshold: f64,
    pub link: LinkModel,
}

impl LaerRelayout {
    /// Defaults for a job whose tokens carry `bytes_per_token` and whose expert states are
    /// `bytes_per_expert`: warm-up 2 steps, threshold 1.1, loopback-like links.
    pub fn new(bytes_per_token: f64, bytes_per_expert: u64) -> Self {
        Self {
            params: LaerParams::default(),
            warmup_steps: 2,
            imbalance_threshold: 1.1,
            link: LinkModel {
                bytes_per_token,
                intra_node_bytes_per_s: 1e9,
                inter_node_bytes_per_s: 1e9,
                compute_s_per_token: 1e-6,
                bytes_per_expert,
            },
        }
    }

    pub fn schedule(&self, period_steps: u64) -> Schedule {
        Schedule {
            warmup_steps: self.warmup_steps,
            period_steps,
            imbalance_threshold: self.imbalance_threshold,
        }
    }
}

/// The outcome of one re-layout point.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Not a re-layout point, or still warming up, or no traffic measured yet.
    NotDue,
    /// Balanced enough (the hysteresis): `load_ratio` is not above the threshold.
    Balanced { load_ratio: f64 },
    /// The search found nothing that pays.
    Unchanged { load_ratio: f64 },
    /// A new layout (kept as the pending plan); ratios are the worst layer's.
    Changed {
        load_ratio_before: f64,
        load_ratio_after: f64,
        slots_changed: usize,
    },
    /// The search failed or broke an invariant; the layout stays.
    Refused(String),
}

impl Decision {
    /// The log line of a decision taken at counted step `step` (none when it was not due).
    pub fn describe(&self, step: u64) -> Option<String> {
        let what = match self {
            Self::NotDue => return None,
            Self::Balanced { load_ratio } => {
                format!("load ratio {load_ratio:.3} within the threshold, layout kept")
            }
            Self::Unchanged { load_ratio } => {
                format!("load ratio {load_ratio:.3}, no change pays, layout kept")
            }
            Self::Changed {
                load_ratio_before,
                load_ratio_after,
                slots_changed,
            } => format!(
                "load ratio {load_ratio_before:.3} -> {load_ratio_after:.3}, {slots_changed} slots change"
            ),
            Self::Refused(why) => format!("refused: {why}"),
        };
        Some(format!("re-layout (laer) at step {step}: {what}"))
    }
}

/// Per-rank traffic window and the decided plan waiting for the members to pause.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RelayoutState {
    /// Members (rank order) the window was measured over; another membership starts afresh.
    members: Vec<NodeId>,
    experts: usize,
    /// `[layer][rank·experts + expert]`.
    window: Option<LoadHistory>,
    pending: Option<ModelPlan>,
}

impl RelayoutState {
    /// Adds one counted step's reports (members in rank order) to the window.
    pub fn observe(
        &mut self,
        aggregation: Aggregation,
        experts: usize,
        members: &[NodeId],
        reports: &BTreeMap<NodeId, StepReport>,
    ) {
        let layers = members
            .iter()
            .filter_map(|m| reports.get(m))
            .map(|r| r.routing.len())
            .max()
            .unwrap_or(0);
        if layers == 0 || experts == 0 {
            return;
        }
        if self.members != members || self.experts != experts || self.window.is_none() {
            self.members = members.to_vec();
            self.experts = experts;
            self.window = LoadHistory::new(aggregation, layers, members.len() * experts).ok();
        }
        let mut counts = vec![vec![0u64; members.len() * experts]; layers];
        for (rank, m) in members.iter().enumerate() {
            let Some(r) = reports.get(m) else { continue };
            for (l, row) in r.routing.iter().enumerate().take(layers) {
                for (e, &c) in row.iter().enumerate().take(experts) {
                    counts[l][rank * experts + e] = c;
                }
            }
        }
        if let Some(w) = &mut self.window
            && w.push(&counts).is_err()
        {
            // A member reported another shape: start the window again.
            self.window = None;
        }
    }

    /// The window's traffic of `layer`: `[rank][expert]`.
    pub fn traffic(&self, layer: usize) -> Vec<Vec<u64>> {
        let Some(w) = &self.window else {
            return Vec::new();
        };
        let loads = w.loads();
        let Some(row) = loads.get(layer) else {
            return Vec::new();
        };
        row.chunks(self.experts.max(1))
            .map(<[u64]>::to_vec)
            .collect()
    }

    /// At counted step `step` (steps `< step` are done): runs the re-layout if the schedule says
    /// so; a changed layout becomes the pending plan (version `plan.version + 1`).
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        &mut self,
        laer_cfg: &LaerRelayout,
        period_steps: u64,
        sharded: bool,
        plan: &ModelPlan,
        members: &[NodeId],
        steps: std::ops::RangeInclusive<u64>,
    ) -> Decision {
        self.pending = None;
        let schedule = laer_cfg.schedule(period_steps);
        // Without the load ratio yet: is some step of the range a re-layout point at all?
        if !steps.clone().any(|s| schedule.due(s, f64::INFINITY))
            || self.members != members
            || plan.node_map != members
            || self.window.is_none()
        {
            return Decision::NotDue;
        }
        let topo = Topology {
            devices: members.len(),
            devices_per_node: 1,
            slots_per_device: plan.cluster.slots_per_node,
        };
        let traffic: Vec<Vec<Vec<u64>>> = (0..plan.layers.len()).map(|l| self.traffic(l)).collect();
        let mut ratio = 0.0f64;
        for (l, t) in traffic.iter().enumerate() {
            match score(topo, laer_cfg.link, t, &plan.layers[l]) {
                Ok(s) => ratio = ratio.max(s.load_ratio),
                Err(e) => return Decision::Refused(format!("scoring layer {l}: {e}")),
            }
        }
        if !steps.clone().any(|s| schedule.due(s, ratio)) {
            return Decision::Balanced { load_ratio: ratio };
        }
        match self.search(laer_cfg, period_steps, sharded, plan, topo, &traffic) {
            Ok(Some((next, after, changed))) => {
                self.pending = Some(next);
                Decision::Changed {
                    load_ratio_before: ratio,
                    load_ratio_after: after,
                    slots_changed: changed,
                }
            }
            Ok(None) => Decision::Unchanged { load_ratio: ratio },
            Err(e) => Decision::Refused(e),
        }
    }

    /// LAER on every layer; `Some((plan, worst load ratio after, slots changed))` if some layer
    /// changed.
    fn search(
        &self,
        laer_cfg: &LaerRelayout,
        period_steps: u64,
        sharded: bool,
        plan: &ModelPlan,
        topo: Topology,
        traffic: &[Vec<Vec<u64>>],
    ) -> Result<Option<(ModelPlan, f64, usize)>, String> {
        let mut next = plan.clone();
        let (mut after, mut changed) = (0.0f64, 0usize);
        for (l, t) in traffic.iter().enumerate() {
            let mut params = laer_cfg.params;
            params.f = plan.allocations[l].f_effective;
            params.horizon_steps = period_steps.max(1) as f64;
            if sharded {
                // FSEP: the layout is only the index table of the shard all-to-all.
                params.migration_weight = 0.0;
            }
            let current = &plan.layers[l];
            let out = laer(topo, laer_cfg.link, t, None, current, &params)
                .map_err(|e| format!("layer {l}: {e}"))?;
            check_invariants(current, &out.layout, params.f)
                .map_err(|e| format!("layer {l}: {e}"))?;
            changed += slots_changed(current, &out.layout);
            let s = score(topo, laer_cfg.link, t, &out.layout).map_err(|e| e.to_string())?;
            after = after.max(s.load_ratio);
            next.allocations[l].replicas = out.layout.replicas();
            next.layers[l] = out.layout;
        }
        next.version = plan.version + 1;
        Ok((changed > 0).then_some((next, after, changed)))
    }

    /// The pending plan, if it was made over exactly `candidates` (in rank order) and the
    /// reconfiguration is the rebalance it was made for; with its migration (identity ranks;
    /// nothing moves with sharded experts). Forgets the pending plan either way.
    pub fn take(
        &mut self,
        rebalance: bool,
        candidates: &[NodeId],
        physical: &[PhysicalNode],
        experts: usize,
        bytes_per_expert: u64,
        sharded: bool,
    ) -> Option<(ModelPlan, MigrationPlan)> {
        let plan = self.pending.take()?;
        if !rebalance || plan.node_map != candidates {
            return None;
        }
        let migration = if sharded {
            let n = candidates.len();
            MigrationPlan {
                method: MappingMethod::Identity,
                plan_to_physical: candidates.to_vec(),
                transfers: Vec::new(),
                new_replicas: 0,
                bytes: 0,
                sent_bytes: vec![0; n],
                recv_bytes: vec![0; n],
                max_sent_bytes: 0,
                max_recv_bytes: 0,
            }
        } else {
            map_layers(
                &plan.layers,
                physical,
                experts,
                MappingMethod::Identity,
                bytes_per_expert,
            )
            .ok()?
        };
        Some((plan, migration))
    }

    /// The pending plan for a [`super::LayoutSwitch`] (sharded experts: no pause, no
    /// migration), if it was made over exactly `members` (in rank order). Forgets it either way.
    pub fn take_switch(&mut self, members: &[NodeId]) -> Option<ModelPlan> {
        self.pending.take().filter(|p| p.node_map == members)
    }

    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }
}

/// The job's invariants for a new layout of one layer: the same slots per rank, every expert at
/// least `min(f, before)` replicas on at least `min(f, before)` distinct ranks (each rank is a
/// node here).
pub fn check_invariants(
    before: &LayerPlacement,
    after: &LayerPlacement,
    f: usize,
) -> Result<(), String> {
    if before.nodes() != after.nodes() || before.experts() != after.experts() {
        return Err("the layout's shape changed".into());
    }
    for (d, (a, b)) in before.grid().iter().zip(after.grid()).enumerate() {
        if a.len() != b.len() {
            return Err(format!("rank {d}: {} slots became {}", a.len(), b.len()));
        }
    }
    let (rb, ra) = (before.replica_matrix(), after.replica_matrix());
    for e in 0..before.experts() {
        let count = |m: &[Vec<u32>]| m[e].iter().map(|&x| x as usize).sum::<usize>();
        let distinct = |m: &[Vec<u32>]| m[e].iter().filter(|&&x| x > 0).count();
        if count(&ra) < f.min(count(&rb)) || distinct(&ra) < f.min(distinct(&rb)) {
            return Err(format!(
                "expert {e}: {} replicas on {} ranks, at least {f} required",
                count(&ra),
                distinct(&ra)
            ));
        }
    }
    Ok(())
}

/// Slots whose expert differs between two layouts of the same shape (as multisets per rank).
fn slots_changed(before: &LayerPlacement, after: &LayerPlacement) -> usize {
    before
        .grid()
        .iter()
        .zip(after.grid())
        .map(|(a, b)| {
            let mut left = b.to_vec();
            a.iter()
                .filter(|e| match left.iter().position(|x| x == *e) {
                    Some(i) => {
                        left.swap_remove(i);
                        false
                    }
                    None => true,
                })
                .count()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, plan_model};

    const MEMBERS: [NodeId; 4] = [10, 11, 12, 13];

    /// 4 members of 3 slots, 4 experts, `f = 2`, planned for uniform loads (3 replicas each).
    fn plan() -> ModelPlan {
        let model = ModelSpec {
            experts: 4,
            layers: 1,
            f: 2,
        };
        let mut p = plan_model(
            &ClusterSpec::new(4, 3),
            &model,
            &[vec![1; 4]],
            AllocPolicy::Lazarus,
            PlacePolicy::Mro,
            Alignment::Aligned,
        )
        .unwrap();
        p.node_map = MEMBERS.to_vec();
        p
    }

    fn cfg() -> LaerRelayout {
        LaerRelayout::new(256.0, 100_000)
    }

    /// `steps` counted steps in which every rank routes `per_rank[rank]` (one layer).
    fn observed(per_rank: &[Vec<u64>], steps: usize) -> RelayoutState {
        let mut st = RelayoutState::default();
        let agg = Aggregation::Sum { window_steps: 8 };
        for _ in 0..steps {
            let reports: BTreeMap<NodeId, StepReport> = MEMBERS
                .iter()
                .zip(per_rank)
                .map(|(&m, r)| {
                    let rep = StepReport {
                        routing: vec![r.clone()],
                        ..StepReport::default()
                    };
                    (m, rep)
                })
                .collect();
            st.observe(agg, 4, &MEMBERS, &reports);
        }
        st
    }

    fn skewed() -> Vec<Vec<u64>> {
        vec![vec![100, 10, 5, 5]; 4]
    }

    #[test]
    fn the_window_is_the_per_rank_traffic_summed_and_bounded() {
        let mut per_rank = skewed();
        per_rank[2] = vec![1, 2, 3, 4];
        let st = observed(&per_rank, 20);
        let t = st.traffic(0);
        assert_eq!(t.len(), 4);
        // A window of 8 steps, not 20.
        assert_eq!(t[0], vec![800, 80, 40, 40]);
        assert_eq!(t[2], vec![8, 16, 24, 32]);
    }

    #[test]
    fn skewed_traffic_changes_the_layout_within_the_invariants() {
        let p = plan();
        for sharded in [false, true] {
            let mut st = observed(&skewed(), 5);
            let d = st.decide(&cfg(), 5, sharded, &p, &MEMBERS, 5..=5);
            let Decision::Changed {
                load_ratio_before,
                load_ratio_after,
                slots_changed,
            } = d
            else {
                panic!("sharded {sharded}: {d:?}");
            };
            assert!(load_ratio_after < load_ratio_before, "{d:?}");
            assert!(slots_changed > 0);
            let physical: Vec<PhysicalNode> = MEMBERS
                .iter()
                .enumerate()
                .map(|(r, &id)| PhysicalNode {
                    id,
                    holdings: vec![p.layers[0].grid()[r].to_vec()],
                })
                .collect();
            let (next, migration) = st
                .take(true, &MEMBERS, &physical, 4, 100_000, sharded)
                .expect("the pending plan");
            assert_eq!(next.version, p.version + 1);
            assert_eq!(next.node_map, MEMBERS.to_vec());
            check_invariants(&p.layers[0], &next.layers[0], 2).unwrap();
            assert_eq!(next.allocations[0].replicas, next.layers[0].replicas());
            // FSEP moves no state; replicated experts fetch each added replica once.
            if sharded {
                assert!(migration.transfers.is_empty());
            } else {
                assert_eq!(migration.transfers.len(), slots_changed);
            }
            assert!(!st.has_pending());
        }
    }

    #[test]
    fn balanced_traffic_keeps_the_layout() {
        let p = plan();
        let mut st = observed(&vec![vec![30, 30, 30, 30]; 4], 5);
        let d = st.decide(&cfg(), 5, true, &p, &MEMBERS, 5..=5);
        assert!(
            matches!(d, Decision::Balanced { load_ratio } if load_ratio <= 1.1),
            "{d:?}"
        );
        assert!(!st.has_pending());
    }

    #[test]
    fn warm_up_and_period_are_respected() {
        let p = plan();
        let mut c = cfg();
        c.warmup_steps = 10;
        let mut st = observed(&skewed(), 5);
        assert_eq!(
            st.decide(&c, 5, true, &p, &MEMBERS, 5..=5),
            Decision::NotDue
        );
        // Past the warm-up but not a multiple of the period.
        assert_eq!(
            st.decide(&c, 5, true, &p, &MEMBERS, 11..=11),
            Decision::NotDue
        );
        assert!(matches!(
            st.decide(&c, 5, true, &p, &MEMBERS, 15..=15),
            Decision::Changed { .. }
        ));
    }

    #[test]
    fn a_pending_plan_is_dropped_for_another_membership_or_cause() {
        let p = plan();
        let mut st = observed(&skewed(), 5);
        assert!(matches!(
            st.decide(&cfg(), 5, true, &p, &MEMBERS, 5..=5),
            Decision::Changed { .. }
        ));
        assert!(st.take(true, &MEMBERS[..3], &[], 4, 0, true).is_none());
        assert!(!st.has_pending());
        // Another membership than the window's: not due.
        assert_eq!(
            st.decide(&cfg(), 5, true, &p, &MEMBERS[..3], 5..=5),
            Decision::NotDue
        );
        assert!(matches!(
            st.decide(&cfg(), 5, true, &p, &MEMBERS, 5..=5),
            Decision::Changed { .. }
        ));
        assert!(st.take(false, &MEMBERS, &[], 4, 0, true).is_none());
    }

    #[test]
    fn invariants_catch_a_lost_replica_or_slot() {
        let before = LayerPlacement::from_grid(
            vec![vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]],
            4,
            None,
        )
        .unwrap();
        let fewer = LayerPlacement::from_grid(
            vec![vec![0, 0], vec![0, 1], vec![2, 3], vec![2, 3]],
            4,
            None,
        )
        .unwrap();
        assert!(check_invariants(&before, &fewer, 2).is_err());
        assert!(check_invariants(&before, &before, 2).is_ok());
    }

    /// Every member of `m` reports `step` with `routing`, trained on layout `layout_version`.
    fn report_step(
        m: &mut super::super::JobMachine,
        now: u64,
        step: u64,
        routing: &[u64],
        layout_version: u64,
        out: &mut Vec<super::super::Action>,
    ) {
        use super::super::Event;
        let epoch = m.epoch();
        for n in m.members().to_vec() {
            let report = StepReport {
                routing: vec![routing.to_vec()],
                layout_version,
                ..StepReport::default()
            };
            m.handle(
                now,
                Event::Stepped {
                    node: n,
                    epoch,
                    step,
                    report,
                },
                out,
            );
        }
    }

    /// Drives a [`super::super::JobMachine`] of 4 members (3 slots, FSEP with `copies` shard
    /// copies, checkpoints off) through 4 steps in which every member routes `routing`;
    /// returns every action.
    fn machine_run(
        routing: Vec<u64>,
        copies: usize,
    ) -> (super::super::JobMachine, Vec<super::super::Action>) {
        machine_run_with(routing, Mode::Fsep { copies })
    }

    /// How [`machine_run_with`] stores experts and rebalances.
    #[derive(Clone, Copy)]
    enum Mode {
        Fsep {
            copies: usize,
        },
        /// Replicated experts, LAER or Lazarus's replan, migrated as the machine's
        /// `replica_migration` says.
        Replicated {
            laer: bool,
            migration: super::super::ReplicaMigration,
        },
    }

    /// [`machine_run`] in any [`Mode`].
    fn machine_run_with(
        routing: Vec<u64>,
        mode: Mode,
    ) -> (super::super::JobMachine, Vec<super::super::Action>) {
        use super::super::{Action, Event, JobConfig, JobMachine};
        let model = crate::ModelSpec {
            experts: 4,
            layers: 1,
            f: 2,
        };
        let mut cfg = JobConfig::new(model, 3, 40);
        cfg.initial_nodes = 4;
        cfg.rebalance_every_steps = 4;
        cfg.relayout = Relayout::Laer(LaerRelayout::new(256.0, 100_000));
        match mode {
            Mode::Fsep { copies } => {
                cfg.sharded_experts = true;
                cfg.shard_copies = copies;
            }
            Mode::Replicated { laer, migration } => {
                cfg.aggregation = Aggregation::Sum { window_steps: 8 };
                cfg.bytes_per_expert = 100_000;
                cfg.replica_migration = migration;
                if !laer {
                    cfg.relayout = Relayout::Lazarus;
                }
            }
        }
        let mut m = JobMachine::new(cfg).unwrap();
        let mut out = Vec::new();
        for n in 0..4 {
            m.handle(
                0,
                Event::Joined {
                    node: n,
                    name: format!("n{n}"),
                    host: None,
                },
                &mut out,
            );
            m.handle(0, Event::Ready { node: n }, &mut out);
        }
        let epoch = m.epoch();
        for n in 0..4 {
            m.handle(
                1,
                Event::Migrated {
                    node: n,
                    epoch,
                    bytes_in: 0,
                },
                &mut out,
            );
        }
        let v = m.plan_version();
        for step in 0..4 {
            report_step(&mut m, 2 + step, step, &routing, v, &mut out);
        }
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::Record(r) if r.step == 3))
        );
        (m, out)
    }

    /// Node 3 of `m` (epoch `old_epoch`, plan `before`) is lost while a switch is pending;
    /// the three others report idle after `step` holding what `before` gave them. Checks the
    /// recovery is in place and supersedes the pending switch, and returns it.
    fn lose_node_3_with_a_switch_pending(
        m: &mut super::super::JobMachine,
        before: &crate::ModelPlan,
        old_epoch: u64,
        step: u64,
        out: &mut Vec<super::super::Action>,
    ) -> super::super::Reconfiguration {
        use super::super::{Action, Event, IdleReason, ReconfigKind};
        m.handle(
            30,
            Event::Lost {
                node: 3,
                reason: "killed".into(),
            },
            out,
        );
        for n in 0..3u32 {
            let q = before.node_map.iter().position(|&x| x == n).unwrap();
            let held = vec![before.layers[0].grid()[q].to_vec()];
            let why = IdleReason::Failed("peer gone".into());
            m.handle(
                31,
                Event::Idle {
                    node: n,
                    epoch: old_epoch,
                    why,
                    step,
                    held: held.into(),
                },
                out,
            );
        }
        let r = out
            .iter()
            .find_map(|a| match a {
                Action::Reconfigure(r) => Some((**r).clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no reconfiguration: {out:?}"));
        assert_eq!(r.kind, ReconfigKind::InPlace);
        assert_eq!(r.plan.node_map, vec![0, 1, 2]);
        assert!(m.pending_switch().is_none());
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::Log(l) if l.contains("supersedes the layout switch")))
        );
        r
    }

    fn switches(out: &[super::super::Action]) -> Vec<super::super::LayoutSwitch> {
        out.iter()
            .filter_map(|a| match a {
                super::super::Action::SwitchLayout(s) => Some((**s).clone()),
                _ => None,
            })
            .collect()
    }

    /// FSEP: the decision is a layout switch sent while the members train — no pause, no
    /// reconfiguration — in force once every member reports a step trained on it.
    #[test]
    fn the_machine_switches_the_fsep_layout_without_a_pause() {
        use super::super::{Action, Phase};
        let (mut m, out) = machine_run(vec![100, 10, 5, 5], 1);
        // The start is the only reconfiguration; nobody is paused.
        let reconfigs = out
            .iter()
            .filter(|a| matches!(a, Action::Reconfigure(_)))
            .count();
        assert_eq!(reconfigs, 1, "{out:?}");
        assert!(
            !out.iter().any(|a| matches!(a, Action::Pause { .. })),
            "{out:?}"
        );
        let sw = switches(&out);
        assert_eq!(sw.len(), 1, "{out:?}");
        let (sw, before) = (&sw[0], m.plan().unwrap().clone());
        assert_eq!(sw.epoch, m.epoch());
        assert_eq!(sw.plan.version, before.version + 1);
        assert_eq!(sw.plan.node_map, before.node_map, "ranks unchanged");
        assert_ne!(sw.plan.layers[0], before.layers[0], "the layout changed");
        check_invariants(&before.layers[0], &sw.plan.layers[0], 2).unwrap();
        // Decided once steps 0..=3 were counted: a few steps past the newest reported one.
        assert_eq!(sw.from_step, 4 + super::super::SWITCH_LEAD_STEPS);
        assert_eq!(m.pending_switch(), Some(sw));
        let epoch = m.epoch();
        // The members keep training on the old layout until they all hold the new one...
        let mut out = Vec::new();
        for step in 4..6 {
            report_step(
                &mut m,
                10 + step,
                step,
                &[100, 10, 5, 5],
                before.version,
                &mut out,
            );
        }
        assert_eq!(m.plan_version(), before.version);
        assert!(m.pending_switch().is_some());
        // ...then every member reports step 6 on it: in force, same epoch, still training.
        report_step(&mut m, 20, 6, &[100, 10, 5, 5], sw.plan.version, &mut out);
        assert!(m.pending_switch().is_none());
        assert_eq!(m.plan_version(), sw.plan.version);
        assert_eq!(m.plan().unwrap().layers, sw.plan.layers);
        assert_eq!((m.epoch(), m.phase()), (epoch, Phase::Training));
        let rec = out
            .iter()
            .find_map(|a| match a {
                Action::Record(r) if r.step == 6 => Some(r.clone()),
                _ => None,
            })
            .unwrap();
        assert_eq!(rec.plan_version, sw.plan.version);
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::Log(l) if l.contains("in force from step 6")))
        );
        assert!(
            !out.iter()
                .any(|a| matches!(a, Action::Pause { .. } | Action::Reconfigure(_)))
        );
        m.check_invariants().unwrap();
    }

    /// A switch no step was trained on by the next rebalance point (a command lost on the way)
    /// is sent again, unchanged, and no new decision is made meanwhile.
    #[test]
    fn a_pending_switch_is_sent_again_not_replaced() {
        let (mut m, out) = machine_run(vec![100, 10, 5, 5], 1);
        let first = switches(&out).pop().unwrap();
        let v = m.plan_version();
        let mut out = Vec::new();
        for step in 4..8 {
            report_step(&mut m, 10 + step, step, &[5, 5, 10, 100], v, &mut out);
        }
        assert_eq!(switches(&out), vec![first.clone()]);
        assert_eq!(m.pending_switch(), Some(&first));
        assert_eq!(m.plan_version(), v);
    }

    /// A member lost while a switch is pending: the failure rules run as always (an in-place
    /// repair from the shard copies), the reconfiguration supersedes the switch, and late
    /// reports of steps on the switched layout (the old epoch) change nothing.
    #[test]
    fn a_kill_during_a_pending_switch_recovers_and_drops_it() {
        use super::super::{Action, Event};
        let (mut m, out) = machine_run(vec![100, 10, 5, 5], 2);
        let sw = switches(&out).pop().unwrap();
        let (old_epoch, before) = (m.epoch(), m.plan().unwrap().clone());
        let mut out = Vec::new();
        let r = lose_node_3_with_a_switch_pending(&mut m, &before, old_epoch, 4, &mut out);
        assert!(out.iter().any(|a| matches!(a, Action::Abort { .. })));
        // A late report of the old epoch on the switched layout is ignored.
        let late = StepReport {
            layout_version: sw.plan.version,
            ..StepReport::default()
        };
        let mut more = Vec::new();
        m.handle(
            32,
            Event::Stepped {
                node: 0,
                epoch: old_epoch,
                step: 4,
                report: late,
            },
            &mut more,
        );
        assert!(more.iter().all(|a| !matches!(a, Action::Record(_))));
        let epoch = m.epoch();
        for n in 0..3 {
            m.handle(
                33,
                Event::Migrated {
                    node: n,
                    epoch,
                    bytes_in: 0,
                },
                &mut more,
            );
        }
        let v = m.plan_version();
        assert_eq!(v, r.plan.version);
        let mut out = Vec::new();
        report_step(&mut m, 40, 4, &[100, 10, 5, 5], v, &mut out);
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::Record(r) if r.step == 4 && r.members == 3))
        );
        m.check_invariants().unwrap();
    }

    #[test]
    fn the_machine_keeps_training_on_balanced_traffic() {
        use super::super::Action;
        let (_, out) = machine_run(vec![30, 30, 30, 30], 1);
        assert!(
            !out.iter().any(|a| matches!(a, Action::Pause { .. })),
            "{out:?}"
        );
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::Log(l) if l.contains("within the threshold")))
        );
    }

    const ASYNC: super::super::ReplicaMigration = super::super::ReplicaMigration::Async;

    /// Every transfer of `sw` copies a replica its source holds to a rank that gains it under
    /// the new layout, and every replica a rank gains has exactly one transfer.
    fn check_transfers(before: &crate::ModelPlan, sw: &super::super::LayoutSwitch) {
        let (old, new) = (
            before.layers[0].replica_matrix(),
            sw.plan.layers[0].replica_matrix(),
        );
        let mut gained = Vec::new();
        for (e, (o, n)) in old.iter().zip(&new).enumerate() {
            for r in 0..o.len() {
                if o[r] == 0 && n[r] > 0 {
                    gained.push((0, e, r));
                }
            }
        }
        let mut got: Vec<(usize, usize, usize)> = sw
            .transfers
            .iter()
            .map(|t| {
                assert!(
                    old[t.expert][t.src_rank] > 0,
                    "{t:?}: the source holds none"
                );
                (t.layer, t.expert, t.dst_rank)
            })
            .collect();
        got.sort_unstable();
        gained.sort_unstable();
        assert_eq!(got, gained);
    }

    /// Replicated experts, async migration: LAER's (and Lazarus's) decision goes out as a
    /// layout switch carrying the replica copies — no pause, no reconfiguration — and is in
    /// force once every member reports a step trained on it.
    #[test]
    fn replicated_rebalances_migrate_without_a_pause() {
        use super::super::{Action, Phase};
        for laer in [true, false] {
            let mode = Mode::Replicated {
                laer,
                migration: ASYNC,
            };
            let (mut m, out) = machine_run_with(vec![100, 10, 5, 5], mode);
            let reconfigs = out
                .iter()
                .filter(|a| matches!(a, Action::Reconfigure(_)))
                .count();
            assert_eq!(reconfigs, 1, "laer {laer}: {out:?}");
            assert!(
                !out.iter().any(|a| matches!(a, Action::Pause { .. })),
                "laer {laer}: {out:?}"
            );
            let sw = switches(&out);
            assert_eq!(sw.len(), 1, "laer {laer}: {out:?}");
            let (sw, before) = (sw[0].clone(), m.plan().unwrap().clone());
            assert_eq!(sw.plan.version, before.version + 1);
            assert_eq!(sw.plan.node_map, before.node_map, "ranks unchanged");
            assert_ne!(sw.plan.layers[0], before.layers[0], "the layout changed");
            assert!(!sw.transfers.is_empty(), "replicas move");
            check_transfers(&before, &sw);
            assert_eq!(sw.from_step, 4 + super::super::SWITCH_LEAD_STEPS);
            assert!(
                out.iter()
                    .any(|a| matches!(a, Action::Log(l) if l.contains("replica copies in the background"))),
                "{out:?}"
            );
            let epoch = m.epoch();
            let mut out = Vec::new();
            // The copies take a while: steps 4..=8 still on the old layout.
            for step in 4..9 {
                report_step(
                    &mut m,
                    10 + step,
                    step,
                    &[100, 10, 5, 5],
                    before.version,
                    &mut out,
                );
            }
            assert_eq!(m.plan_version(), before.version);
            assert!(m.pending_switch().is_some());
            report_step(&mut m, 20, 9, &[100, 10, 5, 5], sw.plan.version, &mut out);
            assert!(m.pending_switch().is_none());
            assert_eq!(m.plan().unwrap().layers, sw.plan.layers);
            assert_eq!((m.epoch(), m.phase()), (epoch, Phase::Training));
            assert!(
                !out.iter()
                    .any(|a| matches!(a, Action::Pause { .. } | Action::Reconfigure(_))),
                "{out:?}"
            );
            m.check_invariants().unwrap();
        }
    }

    /// The default (blocking) replicated rebalance still pauses the members.
    #[test]
    fn blocking_replicated_rebalance_still_pauses() {
        use super::super::{Action, ReplicaMigration};
        let mode = Mode::Replicated {
            laer: true,
            migration: ReplicaMigration::Blocking,
        };
        let (_, out) = machine_run_with(vec![100, 10, 5, 5], mode);
        assert!(out.iter().any(|a| matches!(a, Action::Pause { .. })));
        assert!(switches(&out).is_empty());
    }

    /// A pending migration whose switch no member reached by the next rebalance point is sent
    /// again, unchanged.
    #[test]
    fn a_pending_migration_is_sent_again_not_replaced() {
        let mode = Mode::Replicated {
            laer: true,
            migration: ASYNC,
        };
        let (mut m, out) = machine_run_with(vec![100, 10, 5, 5], mode);
        let first = switches(&out).pop().unwrap();
        let v = m.plan_version();
        let mut out = Vec::new();
        for step in 4..8 {
            report_step(&mut m, 10 + step, step, &[5, 5, 10, 100], v, &mut out);
        }
        assert_eq!(switches(&out), vec![first.clone()]);
        assert_eq!(m.pending_switch(), Some(&first));
    }

    /// A member lost while a migration is pending: the members report what they really hold
    /// (the old layout: nothing of the new one was used), the in-place replan recovers from
    /// that, and the reconfiguration supersedes the migration.
    #[test]
    fn a_kill_during_a_pending_migration_recovers_and_drops_it() {
        use super::super::{Action, Event};
        let mode = Mode::Replicated {
            laer: true,
            migration: ASYNC,
        };
        let (mut m, out) = machine_run_with(vec![100, 10, 5, 5], mode);
        assert_eq!(switches(&out).len(), 1);
        let (old_epoch, before) = (m.epoch(), m.plan().unwrap().clone());
        let mut out = Vec::new();
        lose_node_3_with_a_switch_pending(&mut m, &before, old_epoch, 5, &mut out);
        let epoch = m.epoch();
        let mut more = Vec::new();
        for n in 0..3 {
            m.handle(
                33,
                Event::Migrated {
                    node: n,
                    epoch,
                    bytes_in: 0,
                },
                &mut more,
            );
        }
        let v = m.plan_version();
        report_step(&mut m, 40, 4, &[100, 10, 5, 5], v, &mut more);
        assert!(
            more.iter()
                .any(|a| matches!(a, Action::Record(r) if r.step == 4 && r.members == 3))
        );
        m.check_invariants().unwrap();
    }
}
