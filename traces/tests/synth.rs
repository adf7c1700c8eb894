//! The seeded generators: determinism, schedules, and the rates they are meant to produce.
use std::collections::HashSet;

use lazarus_traces::synth::{IntervalDist, fixed_interval, hazard};
use lazarus_traces::{NodeOp, Trace};

fn removal_times(t: &Trace) -> Vec<u64> {
    t.events()
        .iter()
        .filter(|e| e.op == NodeOp::Remove)
        .map(|e| e.time_ms)
        .collect()
}

fn victims(t: &Trace) -> Vec<String> {
    t.events()
        .iter()
        .filter(|e| e.op == NodeOp::Remove)
        .map(|e| e.node.clone())
        .collect()
}

/// Largest live count seen while replaying events one by one (mid-batch included).
fn sequential_peak(t: &Trace) -> usize {
    let mut live = 0usize;
    let mut peak = 0;
    for e in t.events() {
        match e.op {
            NodeOp::Add => live += 1,
            NodeOp::Remove => live -= 1,
        }
        peak = peak.max(live);
    }
    peak
}

#[test]
fn fixed_interval_paper_scenario() {
    // "one random node every 5 min until half remain" on 32 nodes
    let t = fixed_interval(32, 300_000, IntervalDist::Fixed, 16, 42);
    assert_eq!(t.adds(), 32);
    assert_eq!(
        t.events()[..32].iter().filter(|e| e.time_ms == 0).count(),
        32
    );
    assert_eq!(t.events()[0].node, "n0");
    assert_eq!(
        removal_times(&t),
        (1..=16).map(|k| k * 300_000).collect::<Vec<_>>()
    );
    assert_eq!(t.live_at(u64::MAX), 16);
    assert_eq!(t, fixed_interval(32, 300_000, IntervalDist::Fixed, 16, 42));
    assert_ne!(
        victims(&t),
        victims(&fixed_interval(32, 300_000, IntervalDist::Fixed, 16, 43))
    );
    // victims do not depend on the gap distribution or period
    for d in [IntervalDist::Exp, IntervalDist::Weibull { shape: 1.5 }] {
        assert_eq!(
            victims(&t),
            victims(&fixed_interval(32, 60_000, d, 16, 42)),
            "{d}"
        );
    }
    // gaps do not depend on the population
    let a = fixed_interval(32, 1000, IntervalDist::Exp, 16, 9);
    let b = fixed_interval(64, 1000, IntervalDist::Exp, 0, 9);
    assert_eq!(removal_times(&a)[..], removal_times(&b)[..16]);
}

#[test]
fn fixed_interval_edge_cases() {
    assert!(fixed_interval(0, 1000, IntervalDist::Fixed, 0, 1).is_empty());
    let t = fixed_interval(5, 1000, IntervalDist::Fixed, 5, 1);
    assert_eq!((t.adds(), t.removals()), (5, 0));
    let t = fixed_interval(5, 1000, IntervalDist::Exp, 9, 1);
    assert_eq!((t.adds(), t.removals()), (5, 0));
    let t = fixed_interval(5, 0, IntervalDist::Exp, 0, 1);
    assert_eq!(removal_times(&t), [0; 5]);
    assert_eq!(t.live_at(0), 0);
    // stochastic gaps are at least 1 ms
    let t = fixed_interval(200, 1, IntervalDist::Exp, 0, 3);
    let times = removal_times(&t);
    assert!(times.windows(2).all(|w| w[1] > w[0]));
}

fn mean_gap(t: &Trace) -> f64 {
    let times = removal_times(t);
    *times.last().unwrap() as f64 / times.len() as f64
}

#[test]
fn stochastic_gaps_have_the_requested_mean() {
    let mean = 600_000.0;
    for (d, seed) in [
        (IntervalDist::Exp, 1),
        (IntervalDist::Weibull { shape: 1.5 }, 2),
        (IntervalDist::Weibull { shape: 0.7 }, 3),
        (IntervalDist::Weibull { shape: 1.0 }, 4),
    ] {
        let t = fixed_interval(20_001, 600_000, d, 1, seed);
        let m = mean_gap(&t);
        assert!((m / mean - 1.0).abs() < 0.03, "{d}: mean gap {m}");
    }
    // Weibull shape 3 is much less dispersed than exponential
    let cv = |t: &Trace| {
        let times = removal_times(t);
        let gaps: Vec<f64> = std::iter::once(times[0])
            .chain(times.windows(2).map(|w| w[1] - w[0]))
            .map(|g| g as f64)
            .collect();
        let m = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - m) * (g - m)).sum::<f64>() / gaps.len() as f64;
        var.sqrt() / m
    };
    let exp_cv = cv(&fixed_interval(5001, 600_000, IntervalDist::Exp, 1, 5));
    let w3_cv = cv(&fixed_interval(
        5001,
        600_000,
        IntervalDist::Weibull { shape: 3.0 },
        1,
        5,
    ));
    assert!((exp_cv - 1.0).abs() < 0.06, "{exp_cv}");
    assert!((w3_cv - 0.3634).abs() < 0.03, "{w3_cv}"); // CV of Weibull(k=3)
}

#[test]
fn hazard_is_deterministic_and_bounded() {
    let a = hazard(24, 0.61, 0.8, 12 * 3_600_000, 60_000, 32, 11);
    assert_eq!(a, hazard(24, 0.61, 0.8, 12 * 3_600_000, 60_000, 32, 11));
    assert_ne!(a, hazard(24, 0.61, 0.8, 12 * 3_600_000, 60_000, 32, 12));
    assert!(sequential_peak(&a) <= 32);
    assert!(a.duration_ms() <= 12 * 3_600_000);
    assert!(a.events().iter().all(|e| e.time_ms % 60_000 == 0));
    // names are unique per lifetime: every name is added exactly once
    let mut seen = HashSet::new();
    for e in a.events().iter().filter(|e| e.op == NodeOp::Add) {
        assert!(seen.insert(e.node.clone()), "{} re-added", e.node);
    }
    assert!(
        a.removals() > 50 && a.adds() > 70,
        "{} {}",
        a.removals(),
        a.adds()
    );
    // more initial nodes than max_nodes: the cluster drains, arrivals wait for free slots
    let b = hazard(40, 0.61, 10.0, 3_600_000, 60_000, 32, 1);
    assert!(sequential_peak(&b) <= 40);
    assert!(b.live_steps().iter().skip(1).all(|&(_, c)| c <= 40));
    // no ticks
    assert_eq!(hazard(3, 1.0, 1.0, 1000, 0, 5, 1).len(), 3);
    assert!(hazard(0, 1.0, 0.0, 3_600_000, 1000, 0, 1).is_empty());
}

#[test]
fn hazard_rates() {
    // survival after one hour at 0.61/h: exp(-0.61) = 0.543
    let t = hazard(4000, 0.61, 0.0, 3_600_000, 10_000, 4000, 5);
    let frac = t.live_at(3_600_000) as f64 / 4000.0;
    assert!((frac - (-0.61f64).exp()).abs() < 0.03, "{frac}");
    assert_eq!(t.adds(), 4000);
    // arrivals into 2000 empty slots at 1/h: E[live(1 h)] = 2000 (1 - e^-1) = 1264
    let t = hazard(0, 0.0, 1.0, 3_600_000, 10_000, 2000, 6);
    let live = t.live_at(3_600_000) as f64;
    assert!(
        (live / 2000.0 - (1.0 - (-1.0f64).exp())).abs() < 0.03,
        "{live}"
    );
    assert_eq!(t.removals(), 0);
}
