//! Seeded hardware-failure traces of a GPU cluster: GPU, host and rack faults with repairs.
//!
//! The Bamboo hazard of [`crate::synth::hazard`] models spot preemptions: nodes leave for good
//! and new ones arrive. Dedicated training clusters fail differently (Llama 3's 54-day run on
//! 16,384 H100s, Table 5 of arXiv 2407.21783: 419 unexpected interruptions, about half of them
//! GPU or HBM faults, the rest host, network and software): a part breaks, the node is drained,
//! repaired or its GPU swapped, and it comes back under its name.
//!
//! The model ([`HardwareModel`]):
//! * every GPU fails at `gpu_per_hour`, every node at `node_per_hour` for its other parts
//!   (host, NIC, PSU, …): while a node is up, its next fault comes after an exponential time of
//!   rate `G·gpu_per_hour + node_per_hour`, and it is a GPU fault with probability
//!   `G·gpu_per_hour / rate` (competing Poisson processes);
//! * a faulty node is down for a repair time of its cause's mean (`gpu_repair_ms` or
//!   `node_repair_ms`) drawn from `repair` (fixed, exponential or Weibull), then up again;
//! * racks of `nodes_per_rack` consecutive nodes (`n0..n{R-1}` is rack 0, …) fail at
//!   `rack_per_hour` each (a top-of-rack switch or power: every node of the rack at once) and
//!   are down for a repair of mean `rack_repair_ms`;
//! * a node is unavailable while it or its rack is down: the trace removes it when the first of
//!   them starts and adds it back (same name) when the last ends.
//!
//! A node of `G` GPUs that loses one is drained as a whole here, as production clusters do
//! (the job's layout is uniform over nodes); which replicas a GPU fault really loses is the
//! planner's question (`lazarus_planner::gpu_failures`, with the GPU as the unit). The trace
//! is node-level Bamboo CSV, so every consumer of traces replays it.
//!
//! Each node and each rack draws from its own stream seeded from `(seed, index)`: the same
//! seed gives the same trace, and node `i`'s history does not depend on the cluster size.

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

use crate::synth::IntervalDist;
use crate::trace::{Trace, TraceEvent};

const MS_PER_HOUR: f64 = 3_600_000.0;

/// The failure process of a cluster; see the [module docs](self). Rates are per hour; NaN,
/// zero and negative rates never fire.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HardwareModel {
    /// Nodes, all up at time 0 (`n0, n1, …`).
    pub nodes: usize,
    /// GPUs per node (`G`).
    pub gpus_per_node: usize,
    /// Consecutive nodes per rack; 0: no racks (then `rack_per_hour` is unused).
    pub nodes_per_rack: usize,
    /// Faults per GPU-hour.
    pub gpu_per_hour: f64,
    /// Faults per node-hour of everything but the GPUs.
    pub node_per_hour: f64,
    /// Faults per rack-hour that take the whole rack.
    pub rack_per_hour: f64,
    /// Mean repair time of a GPU fault (drain, swap, back).
    pub gpu_repair_ms: u64,
    /// Mean repair time of a host fault.
    pub node_repair_ms: u64,
    /// Mean repair time of a rack fault.
    pub rack_repair_ms: u64,
    /// Distribution of repair times around their means.
    #[serde(serialize_with = "display")]
    pub repair: IntervalDist,
    /// Trace length: no event after it.
    pub duration_ms: u64,
}

fn display<S: serde::Serializer>(d: &IntervalDist, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

/// Faults drawn, by cause (within the duration).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FaultCounts {
    /// GPU faults.
    pub gpu: u64,
    /// Host faults (everything but the GPUs).
    pub node: u64,
    /// Rack faults.
    pub rack: u64,
    /// Node removals in the trace (a fault of a node already down removes nothing).
    pub removals: u64,
}

/// A hardware trace and what caused it.
#[derive(Debug, Clone)]
pub struct HardwareTrace {
    /// The node-level trace.
    pub trace: Trace,
    /// Its faults by cause.
    pub counts: FaultCounts,
}

impl HardwareModel {
    /// Expected faults per day of the whole cluster (all causes, ignoring repair downtime).
    pub fn faults_per_day(&self) -> f64 {
        let rate = |r: f64| if r.is_nan() || r <= 0.0 { 0.0 } else { r };
        let racks = self.nodes.checked_div(self.nodes_per_rack).unwrap_or(0) as f64
            + if self.nodes_per_rack > 0 && !self.nodes.is_multiple_of(self.nodes_per_rack) {
                1.0
            } else {
                0.0
            };
        24.0 * (self.nodes as f64
            * (self.gpus_per_node as f64 * rate(self.gpu_per_hour) + rate(self.node_per_hour))
            + racks * rate(self.rack_per_hour))
    }
}

/// Stream of node or rack `index` (`salt` tells them apart): SplitMix64 finalizer.
fn stream(seed: u64, salt: u64, index: u64) -> Xoshiro256PlusPlus {
    let mut z =
        (seed ^ salt).wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    Xoshiro256PlusPlus::seed_from_u64(z ^ (z >> 31))
}

const NODE_SALT: u64 = 0x243f_6a88_85a3_08d3;
const RACK_SALT: u64 = 0x1319_8a2e_0370_7344;

/// Exponential time (ms, at least 1) for `per_hour`; `None` when the rate never fires or the
/// time is beyond `u64`.
fn next_fault(rng: &mut Xoshiro256PlusPlus, per_hour: f64) -> Option<u64> {
    if per_hour.is_nan() || per_hour <= 0.0 {
        return None;
    }
    let u: f64 = rng.random();
    let t = -(1.0 - u).ln() / per_hour * MS_PER_HOUR;
    (t < 1.8e19).then(|| (t.round() as u64).max(1))
}

fn repair_ms(rng: &mut Xoshiro256PlusPlus, dist: IntervalDist, mean_ms: u64) -> u64 {
    let t = dist.sample(mean_ms as f64, rng);
    if t >= 1.8e19 {
        u64::MAX
    } else {
        (t.round() as u64).max(1)
    }
}

/// Down intervals `[start, end)` of an alternating up/down process starting up at 0; only
/// those starting within `duration_ms`. `pick` returns the repair time of one fault and counts
/// its cause.
fn down_intervals(
    rng: &mut Xoshiro256PlusPlus,
    per_hour: f64,
    duration_ms: u64,
    mut pick: impl FnMut(&mut Xoshiro256PlusPlus) -> u64,
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut t = 0u64;
    while let Some(gap) = next_fault(rng, per_hour) {
        let start = t.saturating_add(gap);
        if start > duration_ms {
            break;
        }
        let end = start.saturating_add(pick(rng));
        out.push((start, end));
        t = end;
    }
    out
}

/// A hardware-failure trace of `model` (see the [module docs](self)): nodes `n0…` added at 0,
/// then removals and re-additions. Cost `O(nodes + faults)`.
pub fn hardware(model: &HardwareModel, seed: u64) -> HardwareTrace {
    let m = model;
    let mut counts = FaultCounts::default();
    let g = m.gpus_per_node as f64;
    let gpu_rate = if m.gpu_per_hour > 0.0 {
        g * m.gpu_per_hour
    } else {
        0.0
    };
    let node_rate = if m.node_per_hour > 0.0 {
        m.node_per_hour
    } else {
        0.0
    };
    let rate = gpu_rate + node_rate;
    let racks = if m.nodes_per_rack == 0 {
        0
    } else {
        m.nodes.div_ceil(m.nodes_per_rack)
    };
    let rack_down: Vec<Vec<(u64, u64)>> = (0..racks)
        .map(|r| {
            let mut rng = stream(seed, RACK_SALT, r as u64);
            down_intervals(&mut rng, m.rack_per_hour, m.duration_ms, |rng| {
                counts.rack += 1;
                repair_ms(rng, m.repair, m.rack_repair_ms)
            })
        })
        .collect();
    // (time, 0 = add / 1 = remove, node): sorted, adds first at equal times.
    let mut changes: Vec<(u64, u8, u32)> = Vec::new();
    for n in 0..m.nodes {
        let mut rng = stream(seed, NODE_SALT, n as u64);
        let mut own = down_intervals(&mut rng, rate, m.duration_ms, |rng| {
            let gpu = rng.random::<f64>() * rate < gpu_rate;
            if gpu {
                counts.gpu += 1;
                repair_ms(rng, m.repair, m.gpu_repair_ms)
            } else {
                counts.node += 1;
                repair_ms(rng, m.repair, m.node_repair_ms)
            }
        });
        if racks > 0 {
            own.extend_from_slice(&rack_down[n / m.nodes_per_rack]);
            own.sort_unstable();
        }
        // Merge overlapping or touching intervals: the node is down on their union.
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(own.len());
        for (a, b) in own {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        for (a, b) in merged {
            changes.push((a, 1, n as u32));
            counts.removals += 1;
            if b <= m.duration_ms {
                changes.push((b, 0, n as u32));
            }
        }
    }
    changes.sort_unstable();
    let names: Vec<String> = (0..m.nodes).map(|i| format!("n{i}")).collect();
    let mut events: Vec<TraceEvent> = names.iter().map(|n| TraceEvent::add(0, n)).collect();
    events.extend(changes.into_iter().map(|(t, op, n)| {
        if op == 0 {
            TraceEvent::add(t, &names[n as usize])
        } else {
            TraceEvent::remove(t, &names[n as usize])
        }
    }));
    HardwareTrace {
        trace: Trace::from_valid(events),
        counts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NodeOp;

    fn model() -> HardwareModel {
        HardwareModel {
            nodes: 64,
            gpus_per_node: 8,
            nodes_per_rack: 4,
            gpu_per_hour: 1e-3,
            node_per_hour: 2e-3,
            rack_per_hour: 1e-3,
            gpu_repair_ms: 3_600_000,
            node_repair_ms: 7_200_000,
            rack_repair_ms: 600_000,
            repair: IntervalDist::Exp,
            duration_ms: 30 * 24 * 3_600_000,
        }
    }

    #[test]
    fn valid_deterministic_and_counted() {
        let m = model();
        let a = hardware(&m, 7);
        let b = hardware(&m, 7);
        assert_eq!(a.trace, b.trace);
        assert_ne!(a.trace, hardware(&m, 8).trace);
        // Valid under the full check, names come back after their repair.
        let t = Trace::new(a.trace.events().to_vec()).unwrap();
        assert_eq!(t.removals() as u64, a.counts.removals);
        assert!(t.duration_ms() <= m.duration_ms);
        assert_eq!(t.max_live(), 64);
        // Expected faults: 30 days x 24 h x (64 x (8e-3 + 2e-3) + 16 x 1e-3) = 472.3.
        let total = (a.counts.gpu + a.counts.node + a.counts.rack) as f64;
        let want = m.faults_per_day() * 30.0;
        assert!((want - 472.32).abs() < 1e-6);
        assert!(
            (total - want).abs() < 5.0 * want.sqrt(),
            "{total} vs {want}"
        );
        // Repairs bring nodes back under their names.
        assert!(a.trace.adds() > 64);
    }

    #[test]
    fn causes_split_by_rate_and_racks_fail_together() {
        let mut m = model();
        m.rack_per_hour = 0.0;
        m.duration_ms *= 10;
        let c = hardware(&m, 1).counts;
        // GPU share 8e-3 / 10e-3 = 0.8.
        let share = c.gpu as f64 / (c.gpu + c.node) as f64;
        assert!((share - 0.8).abs() < 0.03, "{share}");
        assert_eq!(c.rack, 0);

        let racks_only = HardwareModel {
            gpu_per_hour: 0.0,
            node_per_hour: 0.0,
            rack_per_hour: 1e-2,
            repair: IntervalDist::Fixed,
            ..model()
        };
        let h = hardware(&racks_only, 3);
        assert!(h.counts.rack > 0);
        assert_eq!(h.counts.removals, 4 * h.counts.rack);
        for (_, batch) in h.trace.batches().skip(1) {
            let removed: Vec<usize> = batch
                .iter()
                .filter(|e| e.op == NodeOp::Remove)
                .map(|e| e.node[1..].parse::<usize>().unwrap() / 4)
                .collect();
            if !removed.is_empty() {
                assert_eq!(removed.len(), 4, "a whole rack at once");
                assert!(removed.iter().all(|&r| r == removed[0]));
            }
        }
    }

    #[test]
    fn no_rates_no_failures() {
        let m = HardwareModel {
            gpu_per_hour: 0.0,
            node_per_hour: f64::NAN,
            rack_per_hour: -1.0,
            ..model()
        };
        let h = hardware(&m, 0);
        assert_eq!(h.trace.len(), 64);
        assert_eq!(h.counts, FaultCounts::default());
        assert_eq!(m.faults_per_day(), 0.0);
    }
}
