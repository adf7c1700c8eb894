//! Per-step expert loads `[moe_layer][expert]` that drive the simulation: a replayed gate
//! trace (SmartMoE, as the paper does), a synthetic Zipf popularity that drifts (both from
//! `lazarus-traces`), or the routing a real run recorded (`lzsim predict`).

use lazarus_traces::routing::GateTrace;
use lazarus_traces::zipf::{ZipfError, ZipfLoads};
use std::collections::BTreeMap;

/// The routed tokens of a real run, step by step (`routing.csv` of `lzrun local
/// --metrics-out`): for each step, the routing of every time it was counted, in order (a step
/// rolled back by a restore is counted again, with the routing of its second run).
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRouting {
    layers: usize,
    experts: usize,
    by_step: BTreeMap<u64, Vec<Vec<Vec<u64>>>>,
}

impl RecordedRouting {
    /// `records`: `(step, [layer][expert] tokens)` in the order the run counted them.
    pub fn new(layers: usize, experts: usize, records: Vec<(u64, Vec<Vec<u64>>)>) -> Self {
        let mut by_step: BTreeMap<u64, Vec<Vec<Vec<u64>>>> = BTreeMap::new();
        for (step, routing) in records {
            by_step.entry(step).or_default().push(routing);
        }
        Self {
            layers,
            experts,
            by_step,
        }
    }

    /// What the run's job machine added to its routing history the `nth` time (0-based) it
    /// counted `step`: the last recorded count when counted more often, nothing (no history)
    /// for a step the run never recorded.
    pub fn history(&self, step: u64, nth: usize) -> Vec<Vec<u64>> {
        self.by_step
            .get(&step)
            .and_then(|v| v.get(nth).or(v.last()))
            .cloned()
            .unwrap_or_default()
    }

    /// Loads of `step` for the cost model: its first recorded routing; uniform for a step
    /// never recorded and for a layer that routed nothing.
    pub fn loads(&self, step: u64) -> Vec<Vec<u64>> {
        let first = self.by_step.get(&step).and_then(|v| v.first());
        (0..self.layers)
            .map(|l| match first.and_then(|r| r.get(l)) {
                Some(row) if row.len() == self.experts && row.iter().any(|&c| c > 0) => row.clone(),
                _ => vec![1; self.experts],
            })
            .collect()
    }
}

/// Where the loads of each training step come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// A recorded gate trace ([`GateTrace`]).
    Trace(GateTrace),
    /// Zipf popularity with drift ([`ZipfLoads`]).
    Zipf(ZipfLoads),
    /// A real run's routing ([`RecordedRouting`]): it may change every step.
    Recorded(RecordedRouting),
}

impl Workload {
    /// Rejects parameters that would make [`loads`](Self::loads) meaningless.
    pub fn validate(&self) -> Result<(), ZipfError> {
        match self {
            Workload::Trace(_) | Workload::Recorded(_) => Ok(()),
            Workload::Zipf(z) => z.validate(),
        }
    }

    pub fn layers(&self) -> usize {
        match self {
            Workload::Trace(t) => t.layers(),
            Workload::Zipf(z) => z.layers,
            Workload::Recorded(r) => r.layers,
        }
    }

    pub fn experts(&self) -> usize {
        match self {
            Workload::Trace(t) => t.experts(),
            Workload::Zipf(z) => z.experts,
            Workload::Recorded(r) => r.experts,
        }
    }

    /// Loads `[layer][expert]` at training step `step` (0-based).
    pub fn loads(&self, step: u64) -> Vec<Vec<u64>> {
        match self {
            Workload::Trace(t) => t.loads_at_step(step).to_vec(),
            Workload::Zipf(z) => z.loads(step),
            Workload::Recorded(r) => r.loads(step),
        }
    }

    /// The routing the job machine's history gets the `nth` time (0-based) step `step` is
    /// counted: a recorded run's own ([`RecordedRouting::history`]), else [`Self::loads`].
    pub fn history(&self, step: u64, nth: usize) -> Vec<Vec<u64>> {
        match self {
            Workload::Recorded(r) => r.history(step, nth),
            _ => self.loads(step),
        }
    }

    /// Whether the history depends on how often a step was counted (a recorded run).
    pub fn counts_repeats(&self) -> bool {
        matches!(self, Workload::Recorded(_))
    }

    /// The first step after `step` at which the loads may change, or `None` if they never
    /// change again.
    pub fn next_change(&self, step: u64) -> Option<u64> {
        match self {
            Workload::Trace(t) => t.next_change(step),
            Workload::Zipf(z) => z.next_change(step),
            Workload::Recorded(_) => step.checked_add(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatches_to_the_source() {
        let g = GateTrace::parse("iter,layer,e0,e1\n1,0,1,2\n11,0,3,1\n", 1, 2).unwrap();
        let w = Workload::Trace(g.clone());
        assert_eq!(w.loads(15), g.loads_at_step(15).to_vec());
        assert_eq!(
            (w.layers(), w.experts(), w.next_change(0)),
            (1, 2, Some(10))
        );
        let z = ZipfLoads {
            drift_every_steps: 100,
            ..ZipfLoads::new(1.0, 4, 3, 2)
        };
        let w = Workload::Zipf(z.clone());
        w.validate().unwrap();
        assert_eq!(w.loads(150), z.loads(150));
        assert_eq!(
            (w.layers(), w.experts(), w.next_change(5)),
            (3, 4, Some(100))
        );
    }
}
