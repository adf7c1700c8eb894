//! **Reference copy** of the LAER-style re-layout as it was before the frontier-scale work (full
//! re-evaluation of every candidate by apply/score/undo), kept unchanged as the baseline that
//! [`lazarus_planner::relayout::laer`] is measured against for speed and quality
//! (`benches/scale.rs`, `tests/scale.rs`, `examples/laer_decision.rs`). Test and bench support
//! only: it lives under `tests/oracles/`, outside the library, and is compiled into those with
//! `#[path]`. Not for production use.
//!
//! The LAER-style incremental re-layout: hot-spot-first local search over replica additions and
//! swaps, ranked by gain per migrated byte, under slot, `f` and recovery constraints.
//!
//! LAER-MoE's own planner rebuilds the layout from scratch every iteration because its FSEP
//! runtime makes re-layout free (reference §1.6). In an expert-parallel executor every change
//! is a real transfer of weights and optimizer state, so this policy starts from the current
//! layout and only takes actions whose modelled gain pays for their migration:
//!
//! * **Candidates** (all slots are always full, so "add" and "move" become):
//!   * *replace* — on one of the `M` least-loaded devices (at least 1/64 of the
//!     cluster), its lightest surplus replica (`r > f`) becomes a replica of one of the `K`
//!     hottest experts (highest tokens per replica): the hot expert gains a replica, the cold
//!     one loses one;
//!   * *swap* — a replica of a hot expert on the most loaded device holding it trades places
//!     with the lightest replica on one of the `M` least-loaded devices (counts unchanged).
//! * **Ranking**: gain = `C(L) − C(L')` with `C = α·T̃_step + β·T_migrate`
//!   ([`lazarus_planner::relayout`] module docs), where `T̃_step` replaces the step time's two
//!   maxima by power means of order 16 so that relieving any hot device counts (the bare max
//!   has plateaus a local search stalls on); actions that move nothing come first, the rest by
//!   gain per byte.
//! * **Application**: greedily in rank order, skipping actions that touch a device, or evict an
//!   expert, that an earlier action of the round touched; each is re-evaluated on the current state and kept
//!   only if `C` strictly decreases and every constraint holds, so **`C` never increases**.
//!   Rounds repeat until none is accepted or `max_actions` is reached.
//! * **Constraints**: slots per device unchanged; every expert keeps `≥ f` replicas; the bytes
//!   moved stay within `max_bytes`; no expert ends on fewer distinct nodes than
//!   `min(f, before)` (fewer than `f` node failures stay survivable); the layer's recovery
//!   probability for `k = f` simultaneous
//!   node failures never drops below `min(recovery_floor, its current value)` — our addition:
//!   none of LAER, EPLB or FlexMoE considers failures.

use lazarus_planner::error::PlanError;
use lazarus_planner::place::LayerPlacement;
use lazarus_planner::recovery::{exact_small_k, recovery_from_small_sets};
use lazarus_planner::relayout::{Evaluator, LinkModel, Topology, node_view};

use lazarus_planner::relayout::laer::{Action, LaerOutcome, LaerParams};

/// The search state: the layout being edited and everything derived from it incrementally.
struct State<'a> {
    topo: Topology,
    link: LinkModel,
    params: &'a LaerParams,
    ev: Evaluator,
    /// The same layout under longer-term traffic: an action must help there too, so the search
    /// does not chase fluctuations of the short window.
    ev_long: Option<Evaluator>,
    grid: Vec<Vec<u32>>,
    /// Did device `d` hold expert `e` in the starting layout (its state is there already)?
    had: Vec<Vec<bool>>,
    /// Experts newly placed on each device (each one network transfer).
    fetched: Vec<Vec<u32>>,
    replicas: Vec<usize>,
    /// Replicas of each expert per node.
    per_node: Vec<Vec<u32>>,
    /// Distinct nodes each expert must keep: `min(f, its count in the starting layout)`, so
    /// fewer than `f` node failures stay survivable wherever they were.
    min_nodes: Vec<usize>,
    floor: f64,
}

impl State<'_> {
    fn bytes(&self) -> u64 {
        self.fetched.iter().map(|v| v.len() as u64).sum::<u64>() * self.link.bytes_per_expert
    }

    fn cost(&self) -> f64 {
        let busiest = self.fetched.iter().map(Vec::len).max().unwrap_or(0) as f64;
        let t_mig = busiest * self.link.bytes_per_expert as f64 / self.link.inter_node_bytes_per_s;
        self.params.horizon_steps * self.ev.score().smooth_step_time_s
            + self.params.migration_weight * t_mig
    }

    fn layout(&self, experts: usize) -> LayerPlacement {
        let mut grid = self.grid.clone();
        grid.iter_mut().for_each(|d| d.sort_unstable());
        LayerPlacement::from_grid(grid, experts, Some(&self.replicas)).expect("a valid layout")
    }

    /// Puts one replica of `e` on device `d` (+1) or takes one off (−1).
    fn change(&mut self, d: usize, e: u32, delta: i32) {
        let n = self.topo.node_of(d);
        let ei = e as usize;
        if delta > 0 {
            self.grid[d].push(e);
            self.replicas[ei] += 1;
            self.per_node[ei][n] += 1;
            if !self.had[d][ei] && !self.fetched[d].contains(&e) {
                self.fetched[d].push(e);
            }
        } else {
            let pos = self.grid[d]
                .iter()
                .position(|&x| x == e)
                .expect("replica present");
            self.grid[d].swap_remove(pos);
            self.replicas[ei] -= 1;
            self.per_node[ei][n] -= 1;
            if !self.grid[d].contains(&e)
                && let Some(p) = self.fetched[d].iter().position(|&x| x == e)
            {
                self.fetched[d].swap_remove(p);
            }
        }
        self.ev.adjust(ei, d, delta);
        if let Some(l) = &mut self.ev_long {
            l.adjust(ei, d, delta);
        }
    }

    /// Step time under the long-term traffic (0 when none was given).
    fn long_step(&self) -> f64 {
        self.ev_long.as_ref().map_or(0.0, |l| l.score().step_time_s)
    }

    fn apply(&mut self, a: Action) {
        match a {
            Action::Replace { device, evict, add } => {
                self.change(device, evict, -1);
                self.change(device, add, 1);
            }
            Action::Swap {
                device_a,
                expert_a,
                device_b,
                expert_b,
            } => {
                self.change(device_a, expert_a, -1);
                self.change(device_b, expert_b, -1);
                self.change(device_a, expert_b, 1);
                self.change(device_b, expert_a, 1);
            }
        }
    }

    fn undo(&mut self, a: Action) {
        match a {
            Action::Replace { device, evict, add } => {
                self.change(device, add, -1);
                self.change(device, evict, 1);
            }
            Action::Swap {
                device_a,
                expert_a,
                device_b,
                expert_b,
            } => self.apply(Action::Swap {
                device_a,
                expert_a: expert_b,
                device_b,
                expert_b: expert_a,
            }),
        }
    }

    fn distinct_nodes(&self, e: u32) -> usize {
        self.per_node[e as usize].iter().filter(|&&c| c > 0).count()
    }

    /// Constraints after `a` was applied (it touched `experts`).
    fn feasible(&self, experts: &[u32]) -> bool {
        if self.bytes() > self.params.max_bytes {
            return false;
        }
        if experts.iter().any(|&e| {
            self.replicas[e as usize] < self.params.f
                || self.distinct_nodes(e) < self.min_nodes[e as usize]
        }) {
            return false;
        }
        // Only experts on at most f nodes can be killed by f node failures: recompute the
        // probability only when a touched expert is among them.
        let k = self.params.f.min(self.topo.nodes());
        if self.floor > 0.0 && experts.iter().any(|&e| self.distinct_nodes(e) <= k) {
            let sets: Vec<Vec<usize>> = self
                .per_node
                .iter()
                .filter(|n| n.iter().filter(|&&c| c > 0).count() <= k)
                .map(|n| (0..n.len()).filter(|&i| n[i] > 0).collect())
                .collect();
            let p = recovery_from_small_sets(self.topo.nodes(), k, sets.iter().map(Vec::as_slice))
                .unwrap_or(0.0);
            if p + 1e-12 < self.floor {
                return false;
            }
        }
        true
    }

    fn candidates(&self) -> Vec<Action> {
        let load = self.ev.device_load();
        let experts = self.replicas.len();
        let per_replica = |e: usize| self.ev.expert_tokens(e) / self.replicas[e].max(1) as f64;
        let mut hot: Vec<usize> = (0..experts).collect();
        hot.sort_by(|&a, &b| per_replica(b).total_cmp(&per_replica(a)).then(a.cmp(&b)));
        hot.truncate(self.params.hot_experts);
        let mut cold: Vec<usize> = (0..self.topo.devices).collect();
        cold.sort_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)));
        // At least M, and a sixteenth of the cluster, so large clusters can move enough.
        cold.truncate(self.params.cold_devices.max(self.topo.devices / 64));
        let mut out = Vec::new();
        for &e in &hot {
            let e32 = e as u32;
            // The most loaded device holding e: where a swap would relieve it.
            let busiest = (0..self.topo.devices)
                .filter(|&d| self.grid[d].contains(&e32))
                .max_by(|&a, &b| load[a].total_cmp(&load[b]).then(b.cmp(&a)));
            for &d in &cold {
                // Evict the lightest surplus replica on the device (fewest tokens per replica).
                if let Some(&c) = self.grid[d]
                    .iter()
                    .filter(|&&c| c != e32 && self.replicas[c as usize] > self.params.f)
                    .min_by(|&&x, &&y| {
                        per_replica(x as usize)
                            .total_cmp(&per_replica(y as usize))
                            .then(x.cmp(&y))
                    })
                {
                    out.push(Action::Replace {
                        device: d,
                        evict: c,
                        add: e32,
                    });
                }
                if let Some(b) = busiest
                    && b != d
                    && let Some(&x) =
                        self.grid[d]
                            .iter()
                            .filter(|&&x| x != e32)
                            .min_by(|&&x, &&y| {
                                per_replica(x as usize)
                                    .total_cmp(&per_replica(y as usize))
                                    .then(x.cmp(&y))
                            })
                {
                    out.push(Action::Swap {
                        device_a: b,
                        expert_a: e32,
                        device_b: d,
                        expert_b: x,
                    });
                }
            }
        }
        out
    }
}

fn touched(a: Action) -> ([usize; 2], [u32; 2]) {
    match a {
        Action::Replace { device, evict, add } => ([device, device], [evict, add]),
        Action::Swap {
            device_a,
            expert_a,
            device_b,
            expert_b,
        } => ([device_a, device_b], [expert_a, expert_b]),
    }
}

/// One LAER-style re-layout decision from `current` (device rows) under `traffic`
/// (`[device][expert]` tokens over the window). With `long_traffic` (the same over a longer
/// window), an action is also required not to slow the step under it.
pub fn laer(
    topo: Topology,
    link: LinkModel,
    traffic: &[Vec<u64>],
    long_traffic: Option<&[Vec<u64>]>,
    current: &LayerPlacement,
    params: &LaerParams,
) -> Result<LaerOutcome, PlanError> {
    let ev = Evaluator::new(topo, link, traffic, current)?;
    let ev_long = long_traffic
        .map(|t| Evaluator::new(topo, link, t, current))
        .transpose()?;
    let experts = current.experts();
    let mut per_node = vec![vec![0u32; topo.nodes()]; experts];
    let mut had = vec![vec![false; experts]; topo.devices];
    for (d, row) in current.grid().iter().enumerate() {
        for &e in row {
            per_node[e as usize][topo.node_of(d)] += 1;
            had[d][e as usize] = true;
        }
    }
    let k = params.f.min(topo.nodes());
    let start_p = if params.recovery_floor > 0.0 {
        exact_small_k(&[node_view(topo, current)], k)?
    } else {
        0.0
    };
    let min_nodes: Vec<usize> = per_node
        .iter()
        .map(|n| n.iter().filter(|&&c| c > 0).count().min(params.f))
        .collect();
    let mut st = State {
        topo,
        link,
        params,
        ev,
        ev_long,
        grid: current.grid().to_vec(),
        had,
        fetched: vec![Vec::new(); topo.devices],
        replicas: current.replicas(),
        per_node,
        min_nodes,
        floor: params.recovery_floor.min(start_p),
    };
    let cost_before = st.cost();
    let mut cost = cost_before;
    let mut actions = Vec::new();
    let mut rounds = 0;
    'rounds: while actions.len() < params.max_actions && rounds < params.max_rounds {
        rounds += 1;
        // Rank this round's candidates by gain per migrated byte.
        let mut ranked: Vec<(f64, u64, Action)> = Vec::new();
        let step_now = st.ev.score().smooth_step_time_s;
        let min_gain = params.min_step_gain * step_now * params.horizon_steps;
        for a in st.candidates() {
            let bytes_before = st.bytes();
            st.apply(a);
            let gain = cost - st.cost();
            let bytes = st.bytes().saturating_sub(bytes_before);
            st.undo(a);
            if gain > min_gain.max(0.0) {
                ranked.push((gain, bytes, a));
            }
        }
        ranked.sort_by(|x, y| {
            let key = |(g, b, _): &(f64, u64, Action)| {
                if *b == 0 {
                    f64::INFINITY
                } else {
                    g / *b as f64
                }
            };
            key(y).total_cmp(&key(x)).then(y.0.total_cmp(&x.0))
        });
        let (mut used_dev, mut used_exp): (Vec<usize>, Vec<u32>) = (Vec::new(), Vec::new());
        let mut accepted = 0;
        for (_, _, a) in ranked {
            // Within a round, one action per device and per evicted expert; a hot expert may
            // gain several replicas (each action is re-checked on the current state anyway).
            let (devs, exps) = touched(a);
            let evicted = match a {
                Action::Replace { evict, .. } => Some(evict),
                Action::Swap { .. } => None,
            };
            if devs.iter().any(|d| used_dev.contains(d))
                || evicted.is_some_and(|c| used_exp.contains(&c))
            {
                continue;
            }
            let long_before = st.long_step();
            st.apply(a);
            let new_cost = st.cost();
            if cost - new_cost > min_gain.max(0.0)
                && new_cost < cost
                && st.long_step() <= long_before
                && st.feasible(&exps)
            {
                cost = new_cost;
                actions.push(a);
                accepted += 1;
                used_dev.extend(devs);
                used_exp.extend(evicted);
                if actions.len() >= params.max_actions {
                    break 'rounds;
                }
            } else {
                st.undo(a);
            }
        }
        if accepted == 0 {
            break;
        }
    }
    Ok(LaerOutcome {
        layout: st.layout(experts),
        actions,
        cost_before,
        cost_after: cost,
    })
}
