//! Per-step expert loads `[moe_layer][expert]` that drive the simulation: a replayed gate
//! trace (SmartMoE, as the paper does) or a synthetic Zipf popularity that drifts. Both come
//! from `lazarus-traces`; this enum only picks one.

use lazarus_traces::routing::GateTrace;
use lazarus_traces::zipf::{ZipfError, ZipfLoads};

/// Where the loads of each training step come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// A recorded gate trace ([`GateTrace`]).
    Trace(GateTrace),
    /// Zipf popularity with drift ([`ZipfLoads`]).
    Zipf(ZipfLoads),
}

impl Workload {
    /// Rejects parameters that would make [`loads`](Self::loads) meaningless.
    pub fn validate(&self) -> Result<(), ZipfError> {
        match self {
            Workload::Trace(_) => Ok(()),
            Workload::Zipf(z) => z.validate(),
        }
    }

    pub fn layers(&self) -> usize {
        match self {
            Workload::Trace(t) => t.layers(),
            Workload::Zipf(z) => z.layers,
        }
    }

    pub fn experts(&self) -> usize {
        match self {
            Workload::Trace(t) => t.experts(),
            Workload::Zipf(z) => z.experts,
        }
    }

    /// Loads `[layer][expert]` at training step `step` (0-based).
    pub fn loads(&self, step: u64) -> Vec<Vec<u64>> {
        match self {
            Workload::Trace(t) => t.loads_at_step(step).to_vec(),
            Workload::Zipf(z) => z.loads(step),
        }
    }

    /// The first step after `step` at which the loads may change, or `None` if they never
    /// change again.
    pub fn next_change(&self, step: u64) -> Option<u64> {
        match self {
            Workload::Trace(t) => t.next_change(step),
            Workload::Zipf(z) => z.next_change(step),
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
