//! **Previous copy** of the sparse LAER-style re-layout
//! ([`lazarus_planner::relayout::laer`] before its per-device caches: issue 12's fifth round),
//! kept unchanged as the oracle the current version must equal decision for decision (proptest
//! `laer_equals_previous_sparse_version` in `tests/scale.rs`) and as the side-by-side speed
//! baseline (`benches/scale.rs`, `examples/laer_decision.rs`). Test and bench support only: it
//! lives under `tests/oracles/`, outside the library, and is compiled into the test, the bench
//! and the example with `#[path]`. Not for production use; see
//! [`lazarus_planner::relayout::laer`] for the algorithm.

use lazarus_planner::error::PlanError;
use lazarus_planner::place::LayerPlacement;
use lazarus_planner::recovery::{from_small_sets_auto, recovery_auto};
use lazarus_planner::relayout::laer::{Action, LaerOutcome, LaerParams};
use lazarus_planner::relayout::{Evaluator, LinkModel, Topology, node_view};

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
    /// Tokens of each expert under the short window (constant during a decision).
    tokens: Vec<f64>,
    /// Devices holding each expert (any order).
    holders: Vec<Vec<u32>>,
    /// The sparse predictor of candidate costs.
    fast: Fast,
}

/// Sparse, exact prediction of `C` after a candidate action, without touching the evaluator.
///
/// Why it is sparse: in the step-time model ([`lazarus_planner::relayout`] docs) an expert's tokens on a device of a
/// node holding none of its replicas all leave the node (`x = 0`): that device's egress for the
/// expert is `own·b/bw_inter` whatever the layout, and its load and ingress are zero. A change
/// to expert `e`'s replicas therefore changes `e`'s contribution only on the nodes that hold
/// `e` before or after the change (unless the expert's total residual switches between zero and
/// non-zero, which falls back to the full evaluation). The smooth step time is kept as two power
/// sums over devices; a candidate updates them on the affected devices only, so ranking a
/// candidate costs `O(devices on the holder nodes)` instead of `O(devices)` per touched expert
/// and an apply/undo of the evaluator (the LAER-MoE planner's incremental objective idea,
/// applied to our cost model).
struct Fast {
    /// `own[e][d]`: short-window tokens of `e` routed on device `d` (transposed traffic).
    own: Vec<Vec<f64>>,
    /// `own_node[e][n]`: the same summed over the devices of node `n`.
    own_node: Vec<Vec<f64>>,
    /// Power-sum scales and sums of the current state (see `Fast::base`).
    scale_load: f64,
    scale_comm: f64,
    sum_load: f64,
    sum_comm: f64,
    /// Scratch: per node sums of the (up to two) touched experts, node stamps, device stamps.
    resid_node: [Vec<f64>; 2],
    keep_node: [Vec<f64>; 2],
    node_stamp: Vec<u32>,
    dev_stamp: Vec<u32>,
    epoch: u32,
}

/// Order of the power means in [`Score::smooth_step_time_s`](lazarus_planner::relayout::Score::smooth_step_time_s).
const POWER: i32 = 16;

/// One touched expert of a candidate: up to two devices whose count changes.
struct Touch {
    e: usize,
    devs: [(usize, i32); 2],
    n_devs: usize,
}

/// Expert `e`'s per-node sums after the change.
struct ExpertAfter {
    r: f64,
    t: f64,
    s: f64,
}

impl State<'_> {
    /// Recomputes the power sums of the current evaluator state (after accepted actions).
    fn rebase(&mut self) {
        let f = &mut self.fast;
        let (mut ml, mut mc) = (0.0f64, 0.0f64);
        for t in self.ev.device_totals() {
            ml = ml.max(t[0]);
            mc = mc.max(t[1].max(t[2]));
        }
        f.scale_load = if ml > 0.0 { ml } else { 1.0 };
        f.scale_comm = if mc > 0.0 { mc } else { 1.0 };
        let (mut sl, mut sc) = (0.0, 0.0);
        for t in self.ev.device_totals() {
            sl += (t[0] / f.scale_load).powi(POWER);
            sc += (t[1].max(t[2]) / f.scale_comm).powi(POWER);
        }
        f.sum_load = sl;
        f.sum_comm = sc;
    }

    /// Replica count of `e` on `d` after the touch.
    fn count_after(&self, t: &Touch, d: usize) -> f64 {
        let mut r = self.ev.replicas()[t.e][d] as i64;
        for &(dd, delta) in &t.devs[..t.n_devs] {
            if dd == d {
                r += delta as i64;
            }
        }
        r.max(0) as f64
    }

    /// Per-node residual and kept sums of expert `t.e` after the touch (written into the
    /// scratch arrays for the nodes of `nodes`), and its totals.
    fn expert_after(&mut self, slot: usize, t: &Touch, nodes: &[usize]) -> ExpertAfter {
        let e = t.e;
        let dpn = self.topo.devices_per_node;
        let tok = self.tokens[e];
        let mut r = 0.0;
        for &h in &self.holders[e] {
            r += self.count_after(t, h as usize);
        }
        for &(d, _) in &t.devs[..t.n_devs] {
            if self.ev.replicas()[e][d] == 0 {
                r += self.count_after(t, d);
            }
        }
        for &n in nodes {
            self.fast.resid_node[slot][n] = 0.0;
            self.fast.keep_node[slot][n] = 0.0;
        }
        let mut s = 0.0;
        if r > 0.0 {
            for &n in nodes {
                for d in n * dpn..(n + 1) * dpn {
                    let rd = self.count_after(t, d);
                    if rd == 0.0 {
                        continue;
                    }
                    let cap = tok * rd / r;
                    let own = self.fast.own[e][d];
                    let keep = own.min(cap);
                    self.fast.resid_node[slot][n] += cap - keep;
                    self.fast.keep_node[slot][n] += keep;
                }
            }
            s = nodes.iter().map(|&n| self.fast.resid_node[slot][n]).sum();
        }
        ExpertAfter { r, t: tok, s }
    }

    /// The old expert total residual (`s` before the touch).
    fn resid_before(&self, e: usize) -> f64 {
        let tok = self.tokens[e];
        let r: f64 = self.holders[e]
            .iter()
            .map(|&h| self.ev.replicas()[e][h as usize] as f64)
            .sum();
        if r == 0.0 {
            return 0.0;
        }
        self.holders[e]
            .iter()
            .map(|&h| {
                let cap = tok * self.ev.replicas()[e][h as usize] as f64 / r;
                cap - self.fast.own[e][h as usize].min(cap)
            })
            .sum()
    }

    /// New `[load, egress, ingress]` of expert `t.e` on device `d` (its node among the
    /// expert's affected nodes, whose sums `expert_after` wrote).
    fn contrib_after(&self, slot: usize, t: &Touch, a: &ExpertAfter, d: usize) -> [f64; 3] {
        if a.r <= 0.0 || a.t <= 0.0 {
            return [0.0; 3];
        }
        let e = t.e;
        let n = self.topo.node_of(d);
        let rd = self.count_after(t, d);
        let cap = a.t * rd / a.r;
        let own = self.fast.own[e][d];
        let keep = own.min(cap);
        let (over, resid) = (own - keep, cap - keep);
        let (mut eg, mut ing) = (0.0, 0.0);
        if a.s > 0.0 {
            let b = self.link.bytes_per_token;
            let (bi, bo) = (
                self.link.intra_node_bytes_per_s,
                self.link.inter_node_bytes_per_s,
            );
            let x = self.fast.resid_node[slot][n] / a.s;
            eg = over * b * (x / bi + (1.0 - x) / bo);
            let over_node = self.fast.own_node[e][n] - self.fast.keep_node[slot][n];
            let y = over_node / a.s;
            ing = resid * b * (y / bi + (1.0 - y) / bo);
        }
        [cap, eg, ing]
    }

    /// `C` after action `a`, predicted without applying it to the evaluator (see [`Fast`]);
    /// `None` when the sparse form does not apply (then the caller evaluates exactly).
    fn predict(&mut self, a: Action) -> Option<f64> {
        // Migration part: the cheap bookkeeping, applied and undone.
        self.book(a, false);
        let busiest = self.fetched.iter().map(Vec::len).max().unwrap_or(0) as f64;
        self.book(a, true);
        let touches: [Touch; 2] = match a {
            Action::Replace { device, evict, add } => [
                Touch {
                    e: evict as usize,
                    devs: [(device, -1), (device, 0)],
                    n_devs: 1,
                },
                Touch {
                    e: add as usize,
                    devs: [(device, 1), (device, 0)],
                    n_devs: 1,
                },
            ],
            Action::Swap {
                device_a,
                expert_a,
                device_b,
                expert_b,
            } => [
                Touch {
                    e: expert_a as usize,
                    devs: [(device_a, -1), (device_b, 1)],
                    n_devs: 2,
                },
                Touch {
                    e: expert_b as usize,
                    devs: [(device_b, -1), (device_a, 1)],
                    n_devs: 2,
                },
            ],
        };
        if touches[0].e == touches[1].e {
            return None;
        }
        let dpn = self.topo.devices_per_node;
        // Affected nodes of each touched expert: its holders' nodes before and after.
        let mut nodes: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
        let mut afters: Vec<ExpertAfter> = Vec::with_capacity(2);
        for (i, t) in touches.iter().enumerate() {
            self.fast.epoch = self.fast.epoch.wrapping_add(1);
            let ep = self.fast.epoch;
            let list = &mut nodes[i];
            let holders = self.holders[t.e]
                .iter()
                .map(|&h| h as usize)
                .chain(t.devs[..t.n_devs].iter().map(|&(d, _)| d));
            for d in holders {
                let n = self.topo.node_of(d);
                if self.fast.node_stamp[n] != ep {
                    self.fast.node_stamp[n] = ep;
                    list.push(n);
                }
            }
            let before = self.resid_before(t.e);
            let after = self.expert_after(i, t, &nodes[i]);
            if self.tokens[t.e] > 0.0 && ((before > 0.0) != (after.s > 0.0) || after.r <= 0.0) {
                return None;
            }
            afters.push(after);
        }
        // New totals on the affected devices, and the power-sum corrections.
        self.fast.epoch = self.fast.epoch.wrapping_add(1);
        let ep = self.fast.epoch;
        let (mut dl, mut dc) = (0.0, 0.0);
        let (sl, sc) = (self.fast.scale_load, self.fast.scale_comm);
        let all: Vec<usize> = nodes[0].iter().chain(&nodes[1]).copied().collect();
        for n in all {
            for d in n * dpn..(n + 1) * dpn {
                if self.fast.dev_stamp[d] == ep {
                    continue;
                }
                self.fast.dev_stamp[d] = ep;
                let old = self.ev.device_totals()[d];
                let mut new = old;
                for (i, t) in touches.iter().enumerate() {
                    if !nodes[i].contains(&n) {
                        continue;
                    }
                    let c = self.contrib_after(i, t, &afters[i], d);
                    let o = self.ev.expert_contributions(t.e)[d];
                    for k in 0..3 {
                        new[k] += c[k] - o[k];
                    }
                }
                dl += (new[0] / sl).powi(POWER) - (old[0] / sl).powi(POWER);
                dc += (new[1].max(new[2]) / sc).powi(POWER) - (old[1].max(old[2]) / sc).powi(POWER);
            }
        }
        let n = self.topo.devices as f64;
        let pmean = |sum: f64, scale: f64| scale * (sum.max(0.0) / n).powf(1.0 / POWER as f64);
        let smooth = 4.0 * pmean(self.fast.sum_comm + dc, sc)
            + 3.0 * pmean(self.fast.sum_load + dl, sl) * self.link.compute_s_per_token;
        let t_mig = busiest * self.link.bytes_per_expert as f64 / self.link.inter_node_bytes_per_s;
        Some(self.params.horizon_steps * smooth + self.params.migration_weight * t_mig)
    }

    /// The grid/fetched/count bookkeeping of `a` (or its undo), without the evaluator.
    fn book(&mut self, a: Action, undo: bool) {
        let steps: [(usize, u32, i32); 4];
        let n_steps;
        match a {
            Action::Replace { device, evict, add } => {
                steps = [(device, evict, -1), (device, add, 1), (0, 0, 0), (0, 0, 0)];
                n_steps = 2;
            }
            Action::Swap {
                device_a,
                expert_a,
                device_b,
                expert_b,
            } => {
                steps = [
                    (device_a, expert_a, -1),
                    (device_b, expert_b, -1),
                    (device_a, expert_b, 1),
                    (device_b, expert_a, 1),
                ];
                n_steps = 4;
            }
        }
        if undo {
            for &(d, e, delta) in steps[..n_steps].iter().rev() {
                self.book_change(d, e, -delta);
            }
        } else {
            for &(d, e, delta) in &steps[..n_steps] {
                self.book_change(d, e, delta);
            }
        }
    }

    fn book_change(&mut self, d: usize, e: u32, delta: i32) {
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
    }

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
        let ei = e as usize;
        self.book_change(d, e, delta);
        let before = self.ev.replicas()[ei][d];
        self.ev.adjust(ei, d, delta);
        let after = self.ev.replicas()[ei][d];
        // Kept sorted, so that predictions sum in a fixed order.
        if before == 0 && after > 0 {
            let h = &mut self.holders[ei];
            let p = h.partition_point(|&x| (x as usize) < d);
            h.insert(p, d as u32);
        } else if before > 0
            && after == 0
            && let Ok(p) = self.holders[ei].binary_search(&(d as u32))
        {
            self.holders[ei].remove(p);
        }
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
            let sets: Vec<Vec<u32>> = self
                .per_node
                .iter()
                .filter(|n| n.iter().filter(|&&c| c > 0).count() <= k)
                .map(|n| (0..n.len() as u32).filter(|&i| n[i as usize] > 0).collect())
                .collect();
            // Exact when affordable, seeded Monte Carlo beyond (never an error at scale).
            let p =
                from_small_sets_auto(self.topo.nodes(), k, sets, 0).map_or(0.0, |r| r.probability);
            if p + 1e-12 < self.floor {
                return false;
            }
        }
        true
    }

    fn candidates(&self) -> Vec<Action> {
        let load = self.ev.device_load();
        let experts = self.replicas.len();
        let per_replica = |e: usize| self.tokens[e] / self.replicas[e].max(1) as f64;
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
            let busiest = self.holders[e]
                .iter()
                .map(|&d| d as usize)
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

/// A fixed pseudo-random key of an action, to break exact ties without favouring the
/// candidate generation order (hottest expert first).
fn tie_hash(a: Action, round: u64) -> u64 {
    let (devs, exps) = touched(a);
    let mut z = round
        ^ (devs[0] as u64) << 8
        ^ (devs[1] as u64) << 28
        ^ (exps[0] as u64) << 44
        ^ (exps[1] as u64) << 54;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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
        // Exact when affordable; the closed form or Monte Carlo at scale (checked up front).
        recovery_auto(&[node_view(topo, current)], k, 0)?.probability
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
        tokens: Vec::new(),
        holders: Vec::new(),
        fast: Fast {
            own: Vec::new(),
            own_node: Vec::new(),
            scale_load: 1.0,
            scale_comm: 1.0,
            sum_load: 0.0,
            sum_comm: 0.0,
            resid_node: [vec![0.0; topo.nodes()], vec![0.0; topo.nodes()]],
            keep_node: [vec![0.0; topo.nodes()], vec![0.0; topo.nodes()]],
            node_stamp: vec![0; topo.nodes()],
            dev_stamp: vec![0; topo.devices],
            epoch: 0,
        },
    };
    st.fast.own = (0..experts)
        .map(|e| traffic.iter().map(|row| row[e] as f64).collect())
        .collect();
    st.fast.own_node = st
        .fast
        .own
        .iter()
        .map(|row| {
            row.chunks(topo.devices_per_node)
                .map(|c| c.iter().sum())
                .collect()
        })
        .collect();
    st.tokens = (0..experts).map(|e| st.ev.expert_tokens(e)).collect();
    st.holders = st
        .ev
        .replicas()
        .iter()
        .map(|r| (0..r.len() as u32).filter(|&d| r[d as usize] > 0).collect())
        .collect();
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
        st.rebase();
        for a in st.candidates() {
            let bytes_before = st.bytes();
            st.book(a, false);
            let bytes = st.bytes().saturating_sub(bytes_before);
            st.book(a, true);
            let predicted = match st.predict(a) {
                Some(c) => c,
                None => {
                    st.apply(a);
                    let c = st.cost();
                    st.undo(a);
                    c
                }
            };
            let gain = cost - predicted;
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
        {
            // Exact ties are common (symmetric devices). The reference broke them by the
            // rounding noise of its apply/undo; the sparse predictor is noise-free, and a
            // stable sort would always favour the hottest expert's candidates (measured: 18 %
            // worse load ratio on SmartMoE). Break them pseudo-randomly, deterministically.
            let mut i = 0;
            while i < ranked.len() {
                let mut j = i + 1;
                while j < ranked.len() && ranked[j].0 == ranked[i].0 && ranked[j].1 == ranked[i].1 {
                    j += 1;
                }
                ranked[i..j].sort_by_key(|x| tie_hash(x.2, rounds as u64));
                i = j;
            }
        }
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
