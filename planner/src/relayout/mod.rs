//! Load-adaptive expert re-layout (LAER-MoE style) and its baselines, on one API.
//!
//! A *layout* is one MoE layer's placement on **devices** (GPUs): a [`LayerPlacement`] whose rows
//! are devices, `devices_per_node` consecutive devices forming a node (the failure unit). Every
//! policy takes the current layout and the recent traffic and returns a new layout; all of them
//! are scored by the same model ([`Evaluator`]) and the same migration accounting
//! ([`migration`]).
//!
//! ## Step-time model (documented decision)
//! Tokens move as the planner's dispatcher moves them (Alg. 1, [`crate::dispatch`]), in its
//! fractional form: for expert `e` with `t_e` tokens and `r_e` replicas, device `d` should
//! process `cap_de = t_e·R_de/r_e`; it keeps `min(T_de, cap_de)` of its own tokens, sends its
//! overflow `O_de` and receives its residual `P_de`, the overflow of each sender split over the
//! receivers in proportion to their residuals. With `b` bytes per token and link bandwidths
//! `bw_intra`, `bw_inter` (the intra-node share of a flow is the receivers' — or senders' —
//! share of `S_e = Σ P_e` on the same node):
//!
//! ```text
//! egress_d  = Σ_e O_de·b·(x_de/bw_intra + (1−x_de)/bw_inter),  x_de = P_e,node(d) / S_e
//! ingress_d = Σ_e P_de·b·(y_de/bw_intra + (1−y_de)/bw_inter),  y_de = O_e,node(d) / S_e
//! load_d    = Σ_e cap_de                              (tokens computed on d)
//! T_step    = 4·max_d max(egress_d, ingress_d) + 3·max_d load_d·s_token
//! ```
//! The factors follow LAER-MoE's planner (two all-to-alls forward and two backward; backward
//! compute ≈ 2× forward), with communication taken as the busiest device's (a collective ends
//! when its slowest member does) instead of LAER's sum over devices.
//!
//! ## Re-layout cost
//! `C(L) = α·T_step(L) + β·T_migrate(L_old → L)`: `α` is the number of steps the layout will
//! serve (the re-layout period), `β` weighs the migration pause (1 = blocking, 0 = fully
//! overlapped). `T_migrate` is the busiest device's received bytes over the inter-node link
//! (pessimistic for intra-node sources).

pub mod eplb;
pub mod flexmoe;
pub mod laer;
pub mod policy;

use crate::error::PlanError;
use crate::migrate::{MappingMethod, PhysicalNode, map_nodes};
use crate::place::LayerPlacement;
use serde::{Deserialize, Serialize};
use std::sync::OnceLock;

/// Devices, nodes and slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    pub devices: usize,
    /// Consecutive devices per node (the failure unit); must divide `devices`.
    pub devices_per_node: usize,
    pub slots_per_device: usize,
}

impl Topology {
    pub fn nodes(&self) -> usize {
        self.devices / self.devices_per_node.max(1)
    }
    pub fn node_of(&self, device: usize) -> usize {
        device / self.devices_per_node.max(1)
    }
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.devices == 0 || self.devices_per_node == 0 {
            return Err(PlanError::NoNodes(self.devices));
        }
        if self.slots_per_device == 0 {
            return Err(PlanError::NoSlots(0));
        }
        if !self.devices.is_multiple_of(self.devices_per_node) {
            return Err(PlanError::DomainCount {
                nodes: self.devices,
                got: self.devices_per_node,
            });
        }
        Ok(())
    }
}

/// Hardware and model numbers the cost model needs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Activation bytes per token sent to an expert (e.g. `2·d_model` in bf16).
    pub bytes_per_token: f64,
    pub intra_node_bytes_per_s: f64,
    pub inter_node_bytes_per_s: f64,
    /// Forward seconds per token per expert MLP on one device.
    pub compute_s_per_token: f64,
    /// Parameters + optimizer state of one expert replica.
    pub bytes_per_expert: u64,
}

/// What a re-layout decision is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Score {
    pub step_time_s: f64,
    pub comm_s: f64,
    pub compute_s: f64,
    /// max / mean tokens computed per device.
    pub load_ratio: f64,
    /// `T_step` with the two maxima replaced by power means of order 16 — a smooth stand-in
    /// for the max that rewards relieving *any* heavily loaded device, not only the single
    /// busiest one (a local search on the bare max stalls on its plateaus).
    pub smooth_step_time_s: f64,
}

/// Per-device fractional dispatch of one layer, kept per expert so that a change to one or two
/// experts re-evaluates in `O(devices)`.
#[derive(Debug, Clone)]
pub struct Evaluator {
    topo: Topology,
    link: LinkModel,
    /// `traffic[e][d]`: tokens routed to `e` by the gate on device `d` (over the window),
    /// expert-major so that re-evaluating one expert reads one contiguous row.
    traffic: Vec<Vec<f64>>,
    /// `tokens[e]`: `Σ_d traffic[e][d]`, summed in device order (constant).
    tokens: Vec<f64>,
    /// `replicas[e][d]`.
    replicas: Vec<Vec<u32>>,
    /// `count[e]`: `Σ_d replicas[e][d]`.
    count: Vec<u64>,
    /// `node_count[e][n]`: replicas of `e` on the devices of node `n`.
    node_count: Vec<Vec<u32>>,
    /// `flows[e]`: did tokens of `e` cross devices at its last refresh (`S_e > 0`)?
    flows: Vec<bool>,
    /// Per expert, per device: (load, egress seconds, ingress seconds), filled on first use
    /// (`Evaluator::row`): a row is a pure function of its expert's traffic and replicas, and
    /// a decision reads or changes a few dozen of the 256 experts' rows, so building all of
    /// them (6 MiB at 1,024 devices, twice per LAER call with the long window) is not needed.
    contrib: Vec<OnceLock<Vec<[f64; 3]>>>,
    /// Per device totals of the same.
    total: Vec<[f64; 3]>,
    /// Reused per-node sums.
    scratch: Vec<f64>,
}

/// Checks a scoring's inputs (the topology, one traffic row of `experts` counts per device, a
/// layout of as many devices); returns the number of experts.
fn check_inputs(
    topo: Topology,
    traffic: &[Vec<u64>],
    layout: &LayerPlacement,
) -> Result<usize, PlanError> {
    topo.validate()?;
    let experts = layout.experts();
    if traffic.len() != topo.devices || layout.nodes() != topo.devices {
        return Err(PlanError::LayerNodeMismatch {
            layer: 0,
            expected: topo.devices,
            got: traffic.len().min(layout.nodes()),
        });
    }
    if let Some(row) = traffic.iter().find(|r| r.len() != experts) {
        return Err(PlanError::LoadCount {
            expected: experts,
            got: row.len(),
        });
    }
    Ok(experts)
}

impl Evaluator {
    /// `traffic[device][expert]` and the layout (`layout.grid()[device]`).
    pub fn new(
        topo: Topology,
        link: LinkModel,
        traffic: &[Vec<u64>],
        layout: &LayerPlacement,
    ) -> Result<Self, PlanError> {
        let mut ev = Self::unbuilt(topo, link, traffic, layout)?;
        // The totals as `refresh(e, None)` for every expert in turn leaves them (its
        // `total − 0` on a fresh evaluator is exact and left out), without storing the rows.
        let mut total = std::mem::take(&mut ev.total);
        let mut pass = ExpertPass::default();
        for e in 0..ev.tokens.len() {
            ev.flows[e] = pass.add_to_totals(&ev, e, &mut total);
        }
        ev.total = total;
        Ok(ev)
    }

    /// [`Evaluator::new`] the way it was built before the rows became lazy: `refresh(e, None)`
    /// for every expert, every row stored (the oracle of the proptests).
    #[cfg(test)]
    fn new_by_refresh(
        topo: Topology,
        link: LinkModel,
        traffic: &[Vec<u64>],
        layout: &LayerPlacement,
    ) -> Result<Self, PlanError> {
        let mut ev = Self::unbuilt(topo, link, traffic, layout)?;
        for e in 0..ev.tokens.len() {
            ev.contrib[e] = OnceLock::from(vec![[0.0; 3]; topo.devices]);
            ev.refresh(e, None);
        }
        Ok(ev)
    }

    /// Everything but the totals and the flows (zero), no row built.
    fn unbuilt(
        topo: Topology,
        link: LinkModel,
        traffic: &[Vec<u64>],
        layout: &LayerPlacement,
    ) -> Result<Self, PlanError> {
        let experts = check_inputs(topo, traffic, layout)?;
        // Transposed in blocks of 8 experts (one cache line of each device's row at a time):
        // pushing every device's row into 256 columns cost half of the construction.
        const BLOCK: usize = 8;
        let mut by_expert: Vec<Vec<f64>> = (0..experts).map(|_| vec![0.0; topo.devices]).collect();
        for (cols, e0) in by_expert.chunks_mut(BLOCK).zip((0..experts).step_by(BLOCK)) {
            for (d, row) in traffic.iter().enumerate() {
                for (col, &x) in cols.iter_mut().zip(&row[e0..]) {
                    col[d] = x as f64;
                }
            }
        }
        let tokens = by_expert.iter().map(|row| row.iter().sum()).collect();
        let mut ev = Evaluator {
            topo,
            link,
            traffic: by_expert,
            tokens,
            count: Vec::new(),
            node_count: Vec::new(),
            flows: vec![false; experts],
            replicas: layout.replica_matrix(),
            contrib: (0..experts).map(|_| OnceLock::new()).collect(),
            total: vec![[0.0; 3]; topo.devices],
            scratch: Vec::new(),
        };
        ev.count = ev
            .replicas
            .iter()
            .map(|r| r.iter().map(|&x| x as u64).sum())
            .collect();
        ev.node_count = ev
            .replicas
            .iter()
            .map(|r| {
                r.chunks(topo.devices_per_node)
                    .map(|c| c.iter().sum())
                    .collect()
            })
            .collect();
        Ok(ev)
    }

    /// Expert `e`'s row, built on first use from its current traffic and replicas (what a
    /// full refresh would store; see `contrib`).
    fn row(&self, e: usize) -> &[[f64; 3]] {
        self.contrib[e].get_or_init(|| {
            let mut row = vec![[0.0; 3]; self.topo.devices];
            ExpertPass::default().run(self, e, |d, c| row[d] = c);
            row
        })
    }

    pub fn topology(&self) -> Topology {
        self.topo
    }

    pub fn replicas(&self) -> &[Vec<u32>] {
        &self.replicas
    }

    /// Total tokens of expert `e` over all devices.
    pub fn expert_tokens(&self, e: usize) -> f64 {
        self.tokens[e]
    }

    /// Per device, `[tokens computed, egress seconds, ingress seconds]` under the current layout:
    /// the terms of `T_step` (module docs) before the maxima.
    pub fn device_totals(&self) -> &[[f64; 3]] {
        &self.total
    }

    /// Expert `e`'s part of [`Evaluator::device_totals`], per device.
    pub fn expert_contributions(&self, e: usize) -> &[[f64; 3]] {
        self.row(e)
    }

    /// Expert `e`'s contributions per device as they would be with `replicas` (one count per
    /// device) in place of its own: the row a full refresh would store after that change.
    pub fn row_for(&self, e: usize, replicas: &[u32]) -> Vec<[f64; 3]> {
        let count = replicas.iter().map(|&x| x as u64).sum();
        let mut row = vec![[0.0; 3]; self.topo.devices];
        ExpertPass::default().run_with(self, e, replicas, count, |d, c| row[d] = c);
        row
    }

    /// Tokens computed on each device.
    pub fn device_load(&self) -> Vec<f64> {
        self.total.iter().map(|t| t[0]).collect()
    }

    /// Recomputes expert `e`'s contribution after its replica counts changed (on `changed`'s
    /// node only; `None`: anywhere). Allocation-free: it runs for every candidate action the
    /// searches evaluate.
    ///
    /// Sparse where that is exact: on a node holding no replica of `e` (and not `changed`'s),
    /// every device keeps its contribution `[0, own·b/bw_inter or 0, 0]` (all its tokens leave
    /// the node; `x = 0` whatever the layout) unless `S_e` switches between zero and non-zero.
    /// Such a device is not recomputed; its totals still take `(total − c) + c`, the rounding
    /// of a full refresh, bit for bit (the searches' exact ties depend on it).
    fn refresh(&mut self, e: usize, changed: Option<usize>) {
        let nodes = self.topo.nodes();
        let dpn = self.topo.devices_per_node;
        // A sum of small integers: exact in any order, so the cached count gives the same `r`.
        let r = self.count[e] as f64;
        let t = self.tokens[e];
        let b = self.link.bytes_per_token;
        let (bi, bo) = (
            self.link.intra_node_bytes_per_s,
            self.link.inter_node_bytes_per_s,
        );
        let contrib = self.contrib[e]
            .get_mut()
            .expect("a row is built before its expert changes");
        let traffic = &self.traffic[e];
        let replicas = &self.replicas[e];
        let node_count = &self.node_count[e];
        // Nodes recomputed: those holding `e` and the changed one (all on a full refresh).
        let full = |n: usize| changed.is_none_or(|d| d / dpn == n) || node_count[n] > 0;
        let scratch = &mut self.scratch;
        scratch.clear();
        scratch.resize(4 * nodes, 0.0);
        let (over_node, rest) = scratch.split_at_mut(nodes);
        let (resid_node, rest) = rest.split_at_mut(nodes);
        let (w_eg, w_ing) = rest.split_at_mut(nodes);
        // First pass: per-device capacity, overflow and residual (stored in `contrib` as
        // [cap, over, resid] for now), node sums. Devices of the other nodes add `+0.0` to
        // `s` (which leaves it as it is), so skipping them keeps `s` bit for bit.
        let mut s = 0.0;
        let first = |d: usize,
                     contrib: &mut [[f64; 3]],
                     total: &mut [[f64; 3]],
                     over_node: &mut [f64],
                     resid_node: &mut [f64],
                     s: &mut f64| {
            let n = d / dpn;
            // `t·0/r` is `+0.0` (`t`, `r` finite and non-negative): no division for devices
            // without a replica.
            let cap = if r > 0.0 && replicas[d] > 0 {
                t * replicas[d] as f64 / r
            } else {
                0.0
            };
            let own = traffic[d];
            let keep = own.min(cap);
            let (over, resid) = (own - keep, cap - keep);
            over_node[n] += over;
            resid_node[n] += resid;
            *s += resid;
            let old = contrib[d];
            for (tot, o) in total[d].iter_mut().zip(old) {
                *tot -= o;
            }
            contrib[d] = [cap, over, resid];
        };
        for n in (0..nodes).filter(|&n| full(n)) {
            for d in n * dpn..(n + 1) * dpn {
                first(d, contrib, &mut self.total, over_node, resid_node, &mut s);
            }
        }
        let flows = s > 0.0 && r > 0.0 && t > 0.0;
        // Where `S_e` switched, the other nodes' contributions change too.
        let all = changed.is_none() || flows != self.flows[e];
        self.flows[e] = flows;
        if all {
            for n in (0..nodes).filter(|&n| !full(n)) {
                for d in n * dpn..(n + 1) * dpn {
                    first(d, contrib, &mut self.total, over_node, resid_node, &mut s);
                }
            }
        }
        // Second pass: seconds of egress and ingress. The per-byte link times depend on the
        // node only (`x`, `y` below), so they are computed once per node.
        if flows {
            // Only the recomputed nodes read them (all of them when `all`).
            for n in (0..nodes).filter(|&n| all || full(n)) {
                let x = resid_node[n] / s;
                w_eg[n] = x / bi + (1.0 - x) / bo;
                let y = over_node[n] / s;
                w_ing[n] = y / bi + (1.0 - y) / bo;
            }
        }
        let live = r > 0.0 && t > 0.0;
        for (n, (cs, tots)) in contrib
            .chunks_mut(dpn)
            .zip(self.total.chunks_mut(dpn))
            .enumerate()
        {
            if !all && !full(n) {
                // Unchanged contribution: only the rounding of `(total − c) + c`.
                for (c, tot) in cs.iter().zip(tots) {
                    for (tot, x) in tot.iter_mut().zip(c) {
                        *tot = (*tot - x) + x;
                    }
                }
                continue;
            }
            for (c, tot) in cs.iter_mut().zip(tots) {
                let [cap, over, resid] = *c;
                let (mut eg, mut ing) = (0.0, 0.0);
                if flows {
                    eg = over * b * w_eg[n];
                    ing = resid * b * w_ing[n];
                }
                let cap = if live { cap } else { 0.0 };
                *c = [cap, eg, ing];
                for (tot, x) in tot.iter_mut().zip(*c) {
                    *tot += x;
                }
            }
        }
    }

    /// Changes the replica count of `expert` on `device` by `delta` and re-evaluates.
    pub fn adjust(&mut self, expert: usize, device: usize, delta: i32) {
        // The row as it is before the change: `refresh` takes it out of the totals.
        self.row(expert);
        let r = &mut self.replicas[expert][device];
        let before = *r;
        *r = (*r as i64 + delta as i64).max(0) as u32;
        self.count[expert] = self.count[expert] - before as u64 + *r as u64;
        let n = &mut self.node_count[expert][device / self.topo.devices_per_node];
        *n = *n - before + *r;
        self.refresh(expert, Some(device));
    }

    pub fn score(&self) -> Score {
        score_totals(self.topo, self.link, &self.total)
    }

    /// `self.score().step_time_s` without the power means (the same maxima, the same bits).
    pub fn step_time_s(&self) -> f64 {
        let (mut max_load, mut max_comm) = (0.0f64, 0.0f64);
        for t in &self.total {
            max_load = max_load.max(t[0]);
            max_comm = max_comm.max(t[1].max(t[2]));
        }
        4.0 * max_comm + 3.0 * max_load * self.link.compute_s_per_token
    }
}

/// One expert's contributions as `Evaluator::refresh(e, None)` computes them, the same
/// expressions in the same order, handed to `emit` device by device in device order (buffers
/// kept between experts).
#[derive(Default)]
struct ExpertPass {
    /// Per node: overflow, residual, egress and ingress link seconds per byte.
    node: Vec<f64>,
    /// Per device: `[cap, over, resid]`.
    row: Vec<[f64; 3]>,
}

impl ExpertPass {
    /// Returns whether the expert's tokens cross devices (`S_e > 0`, the evaluator's `flows`).
    fn run(&mut self, ev: &Evaluator, e: usize, emit: impl FnMut(usize, [f64; 3])) -> bool {
        self.run_with(ev, e, &ev.replicas[e], ev.count[e], emit)
    }

    /// [`ExpertPass::run`] with `replicas` (summing to `count`) in place of the expert's.
    fn run_with(
        &mut self,
        ev: &Evaluator,
        e: usize,
        replicas: &[u32],
        count: u64,
        mut emit: impl FnMut(usize, [f64; 3]),
    ) -> bool {
        let (nodes, dpn) = (ev.topo.nodes(), ev.topo.devices_per_node);
        let r = count as f64;
        let t = ev.tokens[e];
        let b = ev.link.bytes_per_token;
        let (bi, bo) = (
            ev.link.intra_node_bytes_per_s,
            ev.link.inter_node_bytes_per_s,
        );
        let traffic = &ev.traffic[e];
        self.node.clear();
        self.node.resize(4 * nodes, 0.0);
        let (over_node, rest) = self.node.split_at_mut(nodes);
        let (resid_node, rest) = rest.split_at_mut(nodes);
        let (w_eg, w_ing) = rest.split_at_mut(nodes);
        self.row.clear();
        let mut s = 0.0;
        for n in 0..nodes {
            for d in n * dpn..(n + 1) * dpn {
                let cap = if r > 0.0 && replicas[d] > 0 {
                    t * replicas[d] as f64 / r
                } else {
                    0.0
                };
                let own = traffic[d];
                let keep = own.min(cap);
                let (over, resid) = (own - keep, cap - keep);
                over_node[n] += over;
                resid_node[n] += resid;
                s += resid;
                self.row.push([cap, over, resid]);
            }
        }
        let flows = s > 0.0 && r > 0.0 && t > 0.0;
        if flows {
            for n in 0..nodes {
                let x = resid_node[n] / s;
                w_eg[n] = x / bi + (1.0 - x) / bo;
                let y = over_node[n] / s;
                w_ing[n] = y / bi + (1.0 - y) / bo;
            }
        }
        let live = r > 0.0 && t > 0.0;
        for (d, &[cap, over, resid]) in self.row.iter().enumerate() {
            let n = d / dpn;
            let (mut eg, mut ing) = (0.0, 0.0);
            if flows {
                eg = over * b * w_eg[n];
                ing = resid * b * w_ing[n];
            }
            let cap = if live { cap } else { 0.0 };
            emit(d, [cap, eg, ing]);
        }
        flows
    }

    /// [`ExpertPass::run`] added to `total` (device by device, `[load, egress, ingress]`),
    /// without the work for devices holding no replica where it changes nothing: there `cap =
    /// 0`, so `over = own` and `resid = +0.0`, and the sums and totals, which start at `+0.0`
    /// and are only added to, are never `−0.0`, so adding a zero of either sign leaves them
    /// as they are. Such a device adds its `own` to its node's overflow and, when tokens flow,
    /// its egress `own·b·w` and its ingress `0·b·w` only where that is not zero (a NaN with a
    /// zero or infinite bandwidth). The other devices compute as `run` does. Returns `flows`.
    fn add_to_totals(&mut self, ev: &Evaluator, e: usize, total: &mut [[f64; 3]]) -> bool {
        let (nodes, dpn) = (ev.topo.nodes(), ev.topo.devices_per_node);
        let r = ev.count[e] as f64;
        let t = ev.tokens[e];
        let b = ev.link.bytes_per_token;
        let (bi, bo) = (
            ev.link.intra_node_bytes_per_s,
            ev.link.inter_node_bytes_per_s,
        );
        let (traffic, replicas) = (&ev.traffic[e], &ev.replicas[e]);
        self.node.clear();
        self.node.resize(4 * nodes, 0.0);
        self.row.resize(ev.topo.devices, [0.0; 3]);
        let flows = first_pass(
            traffic,
            replicas,
            (r, t),
            (nodes, dpn),
            (bi, bo),
            &mut self.node,
            &mut self.row,
        );
        let (_, rest) = self.node.split_at(2 * nodes);
        let (w_eg, w_ing) = rest.split_at(nodes);
        let live = r > 0.0 && t > 0.0;
        for n in 0..nodes {
            let ing_none = 0.0 * b * w_ing[n];
            for d in n * dpn..(n + 1) * dpn {
                let tot = &mut total[d];
                if replicas[d] == 0 {
                    if flows {
                        tot[1] += traffic[d] * b * w_eg[n];
                        if ing_none != 0.0 {
                            tot[2] += ing_none;
                        }
                    }
                    continue;
                }
                let [cap, over, resid] = self.row[d];
                let (mut eg, mut ing) = (0.0, 0.0);
                if flows {
                    eg = over * b * w_eg[n];
                    ing = resid * b * w_ing[n];
                }
                let cap = if live { cap } else { 0.0 };
                tot[0] += cap;
                tot[1] += eg;
                tot[2] += ing;
            }
        }
        flows
    }
}

/// [`Score`] from the per-device totals of an [`Evaluator`] (or of [`Scorer`], which adds them
/// up the same way).
fn score_totals(topo: Topology, link: LinkModel, total: &[[f64; 3]]) -> Score {
    let (mut max_load, mut sum_load, mut max_comm) = (0.0f64, 0.0, 0.0f64);
    for t in total {
        max_load = max_load.max(t[0]);
        sum_load += t[0];
        max_comm = max_comm.max(t[1].max(t[2]));
    }
    // Power means of order P, scaled by the maxima for numerical range.
    const P: i32 = 16;
    let (mut pl, mut pc) = (0.0f64, 0.0f64);
    for t in total {
        if max_load > 0.0 {
            pl += (t[0] / max_load).powi(P);
        }
        if max_comm > 0.0 {
            pc += (t[1].max(t[2]) / max_comm).powi(P);
        }
    }
    let n = topo.devices as f64;
    let pmean = |sum: f64, max: f64| max * (sum / n).powf(1.0 / P as f64);
    let mean = sum_load / n;
    let comm_s = 4.0 * max_comm;
    let compute_s = 3.0 * max_load * link.compute_s_per_token;
    Score {
        step_time_s: comm_s + compute_s,
        comm_s,
        compute_s,
        load_ratio: if mean > 0.0 { max_load / mean } else { 1.0 },
        smooth_step_time_s: 4.0 * pmean(pc, max_comm)
            + 3.0 * pmean(pl, max_load) * link.compute_s_per_token,
    }
}

/// Scores a layout under `traffic` (see the module docs).
pub fn score(
    topo: Topology,
    link: LinkModel,
    traffic: &[Vec<u64>],
    layout: &LayerPlacement,
) -> Result<Score, PlanError> {
    Scorer::default().score(topo, link, traffic, layout)
}

/// Scores layouts with the arithmetic of [`Evaluator::new`] + [`Evaluator::score`], bit for
/// bit, without keeping each expert's per-device contributions (256 × 1,024 × 3 values, 6 MiB
/// at 1,024 devices, allocated and faulted in afresh by every [`Evaluator`]): a score only needs
/// the per-device totals, which add the experts' contributions in expert order either way.
/// Its buffers are reused from call to call (`lzsim relayout` scores every layer of every
/// sample).
#[derive(Debug, Clone, Default)]
pub struct Scorer {
    /// `traffic[e·devices + d]`, as `f64` (the evaluator's conversion).
    traffic: Vec<f64>,
    /// Holders of each expert, in device order (a device once per replica): CSR rows.
    holder_start: Vec<usize>,
    holders: Vec<u32>,
    /// One expert's replicas per device (zero outside its holders between experts).
    rep: Vec<u32>,
    /// One expert's `[cap, over, resid]` per device.
    row: Vec<[f64; 3]>,
    node: Vec<f64>,
    total: Vec<[f64; 3]>,
}

impl Scorer {
    /// [`score`] with this scorer's buffers.
    pub fn score(
        &mut self,
        topo: Topology,
        link: LinkModel,
        traffic: &[Vec<u64>],
        layout: &LayerPlacement,
    ) -> Result<Score, PlanError> {
        let experts = check_inputs(topo, traffic, layout)?;
        let devices = topo.devices;
        let mut by_expert = std::mem::take(&mut self.traffic);
        by_expert.clear();
        by_expert.resize(experts * devices, 0.0);
        for (d, row) in traffic.iter().enumerate() {
            for (e, &x) in row.iter().enumerate() {
                by_expert[e * devices + d] = x as f64;
            }
        }
        let out = self.score_expert_major(topo, link, &by_expert, layout);
        self.traffic = by_expert;
        out
    }

    /// [`score`] of traffic given expert-major (`traffic[e·devices + d]`: tokens routed to `e`
    /// by the gate on device `d`, integers as `f64`).
    // Devices index several per-device arrays (traffic, replicas, rows, totals) in one loop.
    #[allow(clippy::needless_range_loop)]
    pub fn score_expert_major(
        &mut self,
        topo: Topology,
        link: LinkModel,
        traffic: &[f64],
        layout: &LayerPlacement,
    ) -> Result<Score, PlanError> {
        topo.validate()?;
        let (devices, experts) = (topo.devices, layout.experts());
        if layout.nodes() != devices {
            return Err(PlanError::LayerNodeMismatch {
                layer: 0,
                expected: devices,
                got: layout.nodes(),
            });
        }
        if traffic.len() != experts * devices {
            return Err(PlanError::LoadCount {
                expected: experts,
                got: traffic.len() / devices,
            });
        }
        let (nodes, dpn) = (topo.nodes(), topo.devices_per_node);
        // Holders per expert in device order (counting sort of the grid's cells).
        let grid = layout.grid();
        self.holder_start.clear();
        self.holder_start.resize(experts + 1, 0);
        for &e in grid.cells() {
            self.holder_start[e as usize + 1] += 1;
        }
        for e in 0..experts {
            self.holder_start[e + 1] += self.holder_start[e];
        }
        self.holders.clear();
        self.holders.resize(grid.cells().len(), 0);
        {
            let mut next = self.holder_start[..experts].to_vec();
            for (d, row) in grid.iter().enumerate() {
                for &e in row {
                    self.holders[next[e as usize]] = d as u32;
                    next[e as usize] += 1;
                }
            }
        }
        self.rep.clear();
        self.rep.resize(devices, 0);
        self.row.clear();
        self.row.resize(devices, [0.0; 3]);
        self.total.clear();
        self.total.resize(devices, [0.0; 3]);
        let b = link.bytes_per_token;
        let (bi, bo) = (link.intra_node_bytes_per_s, link.inter_node_bytes_per_s);
        for e in 0..experts {
            let held = &self.holders[self.holder_start[e]..self.holder_start[e + 1]];
            for &d in held {
                self.rep[d as usize] += 1;
            }
            let own_row = &traffic[e * devices..(e + 1) * devices];
            // As `Evaluator::refresh(e, None)` on a fresh evaluator: the same expressions in
            // the same order (its `total − 0` is exact and left out).
            let r = held.len() as u64 as f64;
            let t: f64 = own_row.iter().sum();
            self.node.clear();
            self.node.resize(4 * nodes, 0.0);
            let flows = first_pass(
                own_row,
                &self.rep,
                (r, t),
                (nodes, dpn),
                (bi, bo),
                &mut self.node,
                &mut self.row,
            );
            let (_, rest) = self.node.split_at(2 * nodes);
            let (w_eg, w_ing) = rest.split_at(nodes);
            // A device without a replica adds `cap = 0` and `ingress = 0·b·w`, which is `+0.0`
            // (no change) unless `b·w` is not finite (a zero bandwidth): then it is added.
            let zero_ing = flows && !(b.is_finite() && w_ing.iter().all(|w| w.is_finite()));
            let live = r > 0.0 && t > 0.0;
            for n in 0..nodes {
                for d in n * dpn..(n + 1) * dpn {
                    let tot = &mut self.total[d];
                    if self.rep[d] == 0 {
                        if flows {
                            tot[1] += own_row[d] * b * w_eg[n];
                            if zero_ing {
                                tot[2] += 0.0 * b * w_ing[n];
                            }
                        }
                        continue;
                    }
                    let [cap, over, resid] = self.row[d];
                    let (mut eg, mut ing) = (0.0, 0.0);
                    if flows {
                        eg = over * b * w_eg[n];
                        ing = resid * b * w_ing[n];
                    }
                    let cap = if live { cap } else { 0.0 };
                    tot[0] += cap;
                    tot[1] += eg;
                    tot[2] += ing;
                }
            }
            for &d in held {
                self.rep[d as usize] = 0;
            }
        }
        Ok(score_totals(topo, link, &self.total))
    }
}

/// State moved from `old` to `new` (same devices): every expert a device holds in `new` but not
/// in `old` is fetched once (duplicates on one device are local copies), from a device that
/// holds it in `old` — the planner's migration machinery with the device identities kept
/// ([`MappingMethod::Identity`]), so sources are spread over holders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayoutMigration {
    pub replicas: u64,
    pub bytes: u64,
    /// `(expert, src_device, dst_device)`.
    pub transfers: Vec<(u32, u32, u32)>,
    /// Busiest device's sent or received bytes over the inter-node link.
    pub time_s: f64,
}

pub fn migration(
    old: &LayerPlacement,
    new: &LayerPlacement,
    link: &LinkModel,
) -> Result<LayoutMigration, PlanError> {
    if old.nodes() != new.nodes() || old.experts() != new.experts() {
        return Err(PlanError::LayerNodeMismatch {
            layer: 0,
            expected: old.nodes(),
            got: new.nodes(),
        });
    }
    let (plan, physical) = device_rows(new, old);
    let m = map_nodes(
        &plan,
        &physical,
        new.experts(),
        MappingMethod::Identity,
        link.bytes_per_expert,
    )
    .map_err(|e| match e {
        crate::migrate::MigrateError::ExpertLost { expert, .. } => PlanError::ZeroReplicas {
            expert: expert as usize,
        },
        _ => PlanError::LayerNodeMismatch {
            layer: 0,
            expected: old.nodes(),
            got: new.nodes(),
        },
    })?;
    Ok(LayoutMigration {
        replicas: m.new_replicas,
        bytes: m.bytes,
        transfers: m
            .transfers
            .iter()
            .map(|t| (t.expert, t.src, t.dst))
            .collect(),
        time_s: m.max_sent_bytes.max(m.max_recv_bytes) as f64 / link.inter_node_bytes_per_s,
    })
}

/// Device rows as the migration planner's inputs: `new`'s rows as one-layer plan nodes, `old`'s
/// as physical nodes (id = device index) holding what they hold now.
pub(crate) fn device_rows(
    new: &LayerPlacement,
    old: &LayerPlacement,
) -> (Vec<Vec<Vec<u32>>>, Vec<PhysicalNode>) {
    let plan = new.grid().iter().map(|d| vec![d.to_vec()]).collect();
    let physical = old
        .grid()
        .iter()
        .enumerate()
        .map(|(d, row)| PhysicalNode {
            id: d as u32,
            holdings: vec![row.to_vec()],
        })
        .collect();
    (plan, physical)
}

/// The node-level view of a device layout (each node's slots = its devices' slots), for
/// recovery probabilities under node failures.
pub fn node_view(topo: Topology, layout: &LayerPlacement) -> LayerPlacement {
    // A node's devices are consecutive rows, so its slots are one run of cells.
    let grid = layout.grid();
    let grid: Vec<Vec<u32>> = grid
        .cells()
        .chunks(topo.devices_per_node * grid.slots())
        .map(<[u32]>::to_vec)
        .collect();
    LayerPlacement::from_grid(grid, layout.experts(), None).expect("a regrouped valid layout")
}

/// The first pass of an expert's contribution, shared by [`ExpertPass::add_to_totals`] and the
/// evaluator's build without rows: each device's `[cap, over, resid]` into `row` (devices with
/// a replica only), and into `node` (`4 × nodes`, zero) each node's overflow, residual
/// capacity, egress and ingress weights. `own[d]`: the expert's tokens on device `d`;
/// `replicas[d]`: its replicas there; `(r, t)`: its replicas and tokens in all. A device
/// without a replica has `cap = 0`, so `keep = 0`, `over = own` and `resid = +0.0`, whose
/// additions leave the sums as they are (they start at `+0.0` and only add non-negative
/// values): only its `over` is added. Returns whether tokens flow between devices.
fn first_pass(
    own: &[f64],
    replicas: &[u32],
    (r, t): (f64, f64),
    (nodes, dpn): (usize, usize),
    (bi, bo): (f64, f64),
    node: &mut [f64],
    row: &mut [[f64; 3]],
) -> bool {
    let (over_node, rest) = node.split_at_mut(nodes);
    let (resid_node, rest) = rest.split_at_mut(nodes);
    let (w_eg, w_ing) = rest.split_at_mut(nodes);
    let mut s = 0.0;
    for n in 0..nodes {
        let (mut o, mut rs) = (0.0f64, 0.0f64);
        for d in n * dpn..(n + 1) * dpn {
            let own = own[d];
            let rep = replicas[d];
            if rep == 0 {
                o += own;
                continue;
            }
            let cap = if r > 0.0 { t * rep as f64 / r } else { 0.0 };
            let keep = own.min(cap);
            let (over, resid) = (own - keep, cap - keep);
            o += over;
            rs += resid;
            s += resid;
            row[d] = [cap, over, resid];
        }
        over_node[n] = o;
        resid_node[n] = rs;
    }
    let flows = s > 0.0 && r > 0.0 && t > 0.0;
    if flows {
        for n in 0..nodes {
            let x = resid_node[n] / s;
            w_eg[n] = x / bi + (1.0 - x) / bo;
            let y = over_node[n] / s;
            w_ing[n] = y / bi + (1.0 - y) / bo;
        }
    }
    flows
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The tests' seeded xorshift generator: `next(m)` draws from `0..m`.
    pub(super) fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut z = seed | 1;
        move |m| {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            z % m
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The sparse refresh of `adjust` leaves every contribution and total bit for bit as a
        /// full refresh would, including experts that lose every replica or all their tokens'
        /// flows and get them back.
        #[test]
        fn sparse_refresh_equals_full_refresh(
            nodes in 1usize..=6,
            dpn in 1usize..=4,
            slots in 1usize..=3,
            experts_frac in 0.1f64..=1.0,
            seed in any::<u64>(),
        ) {
            let mut next = xorshift(seed);
            let topo = Topology { devices: nodes * dpn, devices_per_node: dpn, slots_per_device: slots };
            let total = topo.devices * slots;
            let experts = ((total as f64 * experts_frac) as usize).clamp(1, total);
            let cells: Vec<u32> = (0..total)
                .map(|i| if i < experts { i as u32 } else { next(experts as u64) as u32 })
                .collect();
            let grid: Vec<Vec<u32>> = cells.chunks(slots).map(<[u32]>::to_vec).collect();
            let layout = LayerPlacement::from_grid(grid, experts, None).unwrap();
            // Some experts without tokens, some with tokens on one device only.
            let traffic: Vec<Vec<u64>> = (0..topo.devices)
                .map(|_| (0..experts).map(|e| if e % 5 == 1 { 0 } else { next(200) * (e as u64 % 3) }).collect())
                .collect();
            let link = LinkModel {
                bytes_per_token: 14336.0,
                intra_node_bytes_per_s: 360e9,
                inter_node_bytes_per_s: 40e9,
                compute_s_per_token: 1e-10,
                bytes_per_expert: 1 << 20,
            };
            // The lazy rows against rows all built by full refreshes.
            let mut sparse = Evaluator::new(topo, link, &traffic, &layout).unwrap();
            let mut full = Evaluator::new_by_refresh(topo, link, &traffic, &layout).unwrap();
            for _ in 0..200 {
                let e = next(experts as u64) as usize;
                let d = next(topo.devices as u64) as usize;
                let delta = if sparse.replicas[e][d] > 0 && next(2) == 0 { -1 } else { 1 };
                sparse.adjust(e, d, delta);
                let r = &mut full.replicas[e][d];
                *r = (*r as i64 + delta as i64) as u32;
                full.count[e] = (full.count[e] as i64 + delta as i64) as u64;
                full.refresh(e, None);
                let bits = |ev: &Evaluator| -> (Vec<u64>, Vec<u64>) {
                    (
                        ev.total.iter().flatten().map(|x| x.to_bits()).collect(),
                        (0..ev.contrib.len()).flat_map(|e| ev.row(e)).flatten().map(|x| x.to_bits()).collect(),
                    )
                };
                prop_assert_eq!(bits(&sparse), bits(&full));
                prop_assert_eq!(sparse.step_time_s().to_bits(), sparse.score().step_time_s.to_bits());
            }
        }

        /// The evaluator built without its rows has the totals and flows of one built by a
        /// full refresh of every expert, bit for bit, and builds each row as that one stored
        /// it (in any order, also after some experts changed), zero bandwidths included.
        #[test]
        fn lazy_rows_equal_rows_built_by_refresh(
            nodes in 1usize..=6,
            dpn in 1usize..=4,
            slots in 1usize..=3,
            experts in 1usize..=24,
            seed in any::<u64>(),
        ) {
            let mut next = xorshift(seed);
            let link = LinkModel {
                bytes_per_token: 14336.0,
                intra_node_bytes_per_s: if next(5) == 0 { 0.0 } else { 360e9 },
                inter_node_bytes_per_s: if next(7) == 0 { 0.0 } else { 40e9 },
                compute_s_per_token: 1e-10,
                bytes_per_expert: 1 << 20,
            };
            let topo = Topology { devices: nodes * dpn, devices_per_node: dpn, slots_per_device: slots };
            let cells: Vec<u32> = (0..topo.devices * slots).map(|_| next(experts as u64) as u32).collect();
            let grid: Vec<Vec<u32>> = cells.chunks(slots).map(<[u32]>::to_vec).collect();
            let layout = LayerPlacement::from_grid(grid, experts, None).unwrap();
            let traffic: Vec<Vec<u64>> = (0..topo.devices)
                .map(|d| (0..experts).map(|e| match e % 4 {
                    0 => 0,
                    1 => if d == 0 { next(1000) } else { 0 },
                    _ => next(5000),
                }).collect())
                .collect();
            let mut lazy = Evaluator::new(topo, link, &traffic, &layout).unwrap();
            let mut full = Evaluator::new_by_refresh(topo, link, &traffic, &layout).unwrap();
            let totals = |ev: &Evaluator| -> Vec<u64> { ev.total.iter().flatten().map(|x| x.to_bits()).collect() };
            prop_assert_eq!(totals(&lazy), totals(&full));
            prop_assert_eq!(&lazy.flows, &full.flows);
            for _ in 0..8 {
                // The same change on both (a row built lazily first, or not yet built).
                let e = next(experts as u64) as usize;
                let d = next(topo.devices as u64) as usize;
                lazy.adjust(e, d, 1);
                full.adjust(e, d, 1);
                let e = next(experts as u64) as usize;
                let bits = |r: &[[f64; 3]]| -> Vec<u64> { r.iter().flatten().map(|x| x.to_bits()).collect() };
                prop_assert_eq!(bits(lazy.row(e)), bits(full.row(e)));
                prop_assert_eq!(totals(&lazy), totals(&full));
            }
        }

        /// The scorer gives the evaluator's score bit for bit (duplicate replicas, experts
        /// without replicas or tokens, tokens on one device), also reusing its buffers over
        /// layouts of different shapes.
        #[test]
        fn scorer_equals_evaluator(
            nodes in 1usize..=6,
            dpn in 1usize..=4,
            slots in 1usize..=3,
            experts in 1usize..=24,
            seed in any::<u64>(),
        ) {
            let mut next = xorshift(seed);
            // Now and then a zero bandwidth: infinite link times, whose products with zero
            // tokens are NaN in the evaluator and must be in the scorer too.
            let link = LinkModel {
                bytes_per_token: 14336.0,
                intra_node_bytes_per_s: if next(5) == 0 { 0.0 } else { 360e9 },
                inter_node_bytes_per_s: 40e9,
                compute_s_per_token: 1e-10,
                bytes_per_expert: 1 << 20,
            };
            let mut scorer = Scorer::default();
            for shrink in 0..2 {
                let dpn = (dpn - shrink).max(1);
                let topo = Topology { devices: nodes * dpn, devices_per_node: dpn, slots_per_device: slots };
                let total = topo.devices * slots;
                // Some experts may hold no slot at all.
                let cells: Vec<u32> = (0..total).map(|_| next(experts as u64) as u32).collect();
                let grid: Vec<Vec<u32>> = cells.chunks(slots).map(<[u32]>::to_vec).collect();
                let layout = LayerPlacement::from_grid(grid, experts, None).unwrap();
                let traffic: Vec<Vec<u64>> = (0..topo.devices)
                    .map(|d| (0..experts).map(|e| match e % 4 {
                        0 => 0,
                        1 => if d == 0 { next(1000) } else { 0 },
                        _ => next(5000),
                    }).collect())
                    .collect();
                let want = Evaluator::new(topo, link, &traffic, &layout).unwrap().score();
                let got = scorer.score(topo, link, &traffic, &layout).unwrap();
                let bits = |s: Score| [s.step_time_s, s.comm_s, s.compute_s, s.load_ratio, s.smooth_step_time_s].map(f64::to_bits);
                prop_assert_eq!(bits(got), bits(want));
            }
        }
    }
}
