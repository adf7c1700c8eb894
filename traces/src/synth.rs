//! Seeded synthetic failure traces.
//!
//! Pure functions of their arguments: the same arguments (seed included) give the same trace
//! on every platform (the RNG is rand's portable `Xoshiro256PlusPlus`, seeded with
//! `seed_from_u64`). Node names are unique per lifetime.
use std::fmt;
use std::str::FromStr;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use crate::error::ParseEnumError;
use crate::trace::{Trace, TraceEvent};

/// Distribution of the gaps between successive failures in [`fixed_interval`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IntervalDist {
    /// Every gap is exactly the mean (the controlled "one node every 5 or 40 min" scenario of
    /// the Lazarus paper, and Oobleck's `5m.csv` … `6h.csv`).
    Fixed,
    /// Exponential gaps with the given mean (memoryless failures, a Poisson process).
    Exp,
    /// Weibull gaps with the given mean and this shape `k` (> 0): scale
    /// `λ = mean / Γ(1 + 1/k)`, sampled by inversion `λ·(−ln(1−u))^(1/k)`. `k = 1` is `Exp`;
    /// the P3 trace's lifetimes fit `k ≈ 1.1`.
    Weibull {
        /// Shape parameter `k` (finite, > 0).
        shape: f64,
    },
}

impl fmt::Display for IntervalDist {
    /// `fixed`, `exp`, `weibull:<shape>` (the [`FromStr`] syntax).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IntervalDist::Fixed => f.write_str("fixed"),
            IntervalDist::Exp => f.write_str("exp"),
            IntervalDist::Weibull { shape } => write!(f, "weibull:{shape}"),
        }
    }
}

impl FromStr for IntervalDist {
    type Err = ParseEnumError;

    /// `fixed`, `exp` (or `exponential`), `weibull:<shape>` with a finite shape > 0, e.g.
    /// `weibull:1.5`. ASCII case-insensitive keywords.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        const EXPECTED: &str = "'fixed', 'exp' or 'weibull:<shape>' with shape > 0";
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "fixed" => Ok(IntervalDist::Fixed),
            "exp" | "exponential" => Ok(IntervalDist::Exp),
            _ => lower
                .strip_prefix("weibull:")
                .and_then(|k| k.trim().parse::<f64>().ok())
                .filter(|k| k.is_finite() && *k > 0.0)
                .map(|shape| IntervalDist::Weibull { shape })
                .ok_or_else(|| ParseEnumError::new("interval distribution", s, EXPECTED)),
        }
    }
}

impl IntervalDist {
    /// One gap in (possibly fractional) milliseconds for mean `mean_ms`.
    pub(crate) fn sample(self, mean_ms: f64, rng: &mut Xoshiro256PlusPlus) -> f64 {
        match self {
            IntervalDist::Fixed => mean_ms,
            IntervalDist::Exp => mean_ms * std_exp(rng),
            IntervalDist::Weibull { shape } => {
                let scale = mean_ms / gamma(1.0 + 1.0 / shape);
                scale * std_exp(rng).powf(1.0 / shape)
            }
        }
    }
}

/// A standard exponential variate `−ln(1−u)`, `u` uniform in `[0, 1)`.
fn std_exp(rng: &mut Xoshiro256PlusPlus) -> f64 {
    let u: f64 = rng.random();
    -(1.0 - u).ln()
}

/// Γ(x) by the Lanczos approximation (g = 7, 9 coefficients; relative error ~1e-15), with the
/// reflection formula below 0.5. Overflows to `+∞` above x ≈ 171.6.
pub fn gamma(x: f64) -> f64 {
    use std::f64::consts::PI;
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        return PI / ((PI * x).sin() * gamma(1.0 - x));
    }
    let x = x - 1.0;
    let t = x + G + 0.5;
    let a = C[1..]
        .iter()
        .enumerate()
        .fold(C[0], |a, (i, c)| a + c / (x + i as f64 + 1.0));
    // In log space so that t^(x+0.5) does not overflow before e^-t underflows.
    (0.5 * (2.0 * PI).ln() + (x + 0.5) * t.ln() - t + a.ln()).exp()
}

/// `nodes` nodes (`n0, n1, …`) added at t = 0, then one uniformly random live node removed per
/// failure event until `until_live` remain (nothing is removed when
/// `until_live >= nodes`); never any re-add.
///
/// The failure times are cumulative gaps drawn from `dist` with mean `every_ms`:
/// `Fixed` gives failures at exactly `k·every_ms` (k = 1, 2, …). Stochastic gaps are rounded
/// to whole milliseconds and at least 1 ms (so every failure is its own batch), unless
/// `every_ms == 0`, where all gaps are 0 and the failures form one batch at t = 0.
///
/// Determinism: victims and gaps come from two independent streams derived from `seed`, so
/// the same seed gives the same victims whatever `dist` and `every_ms` are, and the same
/// times whatever `nodes` and `until_live` are (for the failures both produce). Victim `k` is
/// `live[random_range(0..live.len())]` with `live` kept in add order.
pub fn fixed_interval(
    nodes: usize,
    every_ms: u64,
    dist: IntervalDist,
    until_live: usize,
    seed: u64,
) -> Trace {
    let mut victims = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut gaps = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5851_f42d_4c95_7f2d);
    let mut live: Vec<String> = (0..nodes).map(|i| format!("n{i}")).collect();
    let mut events: Vec<TraceEvent> = live.iter().map(|n| TraceEvent::add(0, n)).collect();
    let mut t = 0u64;
    while live.len() > until_live {
        let gap = match dist {
            IntervalDist::Fixed => every_ms,
            _ if every_ms == 0 => 0,
            _ => (dist.sample(every_ms as f64, &mut gaps).round() as u64).max(1),
        };
        t = t.saturating_add(gap);
        let victim = live.remove(victims.random_range(0..live.len()));
        events.push(TraceEvent::remove(t, victim));
    }
    Trace::from_valid(events)
}

/// Probability of at least one event of a Poisson process with `per_hour` rate in `tick_ms`:
/// `1 − exp(−λ·tick)`. NaN, zero and negative rates never fire; `+∞` always fires.
fn tick_probability(per_hour: f64, tick_ms: u64) -> f64 {
    if per_hour.is_nan() || per_hour <= 0.0 {
        return 0.0;
    }
    (1.0 - (-per_hour * tick_ms as f64 / 3_600_000.0).exp()).clamp(0.0, 1.0)
}

/// A Bamboo-style stochastic availability trace.
///
/// * `nodes` nodes (`h0, h1, …`) are added at t = 0 (even if more than `max_nodes`).
/// * At every tick `t = k·tick_ms` (k = 1, 2, … while `t <= duration_ms`):
///   - each live node is preempted with probability `1 − exp(−per_hour_preempt·tick)`
///     (tick in hours): one draw per live node, in add order;
///   - then one arrival draw with probability `1 − exp(−per_hour_add·tick)` is made for each
///     slot that was free *at the start of the tick* (`max_nodes − live`, saturating), and
///     each success adds one new node. Slots freed by this tick's preemptions can be refilled
///     from the next tick on, so the live count never exceeds `max(nodes, max_nodes)`, even
///     in the middle of a batch.
/// * Names are never reused (`h{counter}`), so each name is one lifetime.
/// * `tick_ms == 0` gives just the initial adds. The cost is O(ticks · max_nodes).
///
/// Rates: NaN, zero or negative never fire, `+∞` always fires.
pub fn hazard(
    nodes: usize,
    per_hour_preempt: f64,
    per_hour_add: f64,
    duration_ms: u64,
    tick_ms: u64,
    max_nodes: usize,
    seed: u64,
) -> Trace {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut live: Vec<String> = (0..nodes).map(|i| format!("h{i}")).collect();
    let mut next = nodes;
    let mut events: Vec<TraceEvent> = live.iter().map(|n| TraceEvent::add(0, n)).collect();
    if tick_ms == 0 {
        return Trace::from_valid(events);
    }
    let p_remove = tick_probability(per_hour_preempt, tick_ms);
    let p_add = tick_probability(per_hour_add, tick_ms);
    let mut t = tick_ms;
    while t <= duration_ms {
        let free = max_nodes.saturating_sub(live.len());
        let mut survivors = Vec::with_capacity(live.len());
        let mut removed = Vec::new();
        for n in live {
            if rng.random::<f64>() < p_remove {
                removed.push(n);
            } else {
                survivors.push(n);
            }
        }
        live = survivors;
        for _ in 0..free {
            if rng.random::<f64>() < p_add {
                let name = format!("h{next}");
                next += 1;
                events.push(TraceEvent::add(t, name.clone()));
                live.push(name);
            }
        }
        events.extend(removed.into_iter().map(|n| TraceEvent::remove(t, n)));
        let Some(nt) = t.checked_add(tick_ms) else {
            break;
        };
        t = nt;
    }
    Trace::from_valid(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gamma_matches_known_values() {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        assert!(close(gamma(1.0), 1.0));
        assert!(close(gamma(2.0), 1.0));
        assert!(close(gamma(5.0), 24.0));
        assert!(close(gamma(0.5), std::f64::consts::PI.sqrt()));
        assert!(close(gamma(1.5), std::f64::consts::PI.sqrt() / 2.0));
        assert!(close(gamma(1.0 + 1.0 / 1.5), 0.902_745_292_950_933_6));
        assert!(close(gamma(-0.5), -2.0 * std::f64::consts::PI.sqrt()));
        assert!((gamma(171.0) / 7.257_415_615_307_999e306 - 1.0).abs() < 1e-10);
        assert!(gamma(200.0).is_infinite());
    }

    #[test]
    fn interval_dist_syntax() {
        assert_eq!("fixed".parse(), Ok(IntervalDist::Fixed));
        assert_eq!("Exp".parse(), Ok(IntervalDist::Exp));
        assert_eq!(
            "weibull:1.5".parse(),
            Ok(IntervalDist::Weibull { shape: 1.5 })
        );
        for bad in [
            "weibull",
            "weibull:",
            "weibull:0",
            "weibull:-1",
            "weibull:nan",
            "gauss",
        ] {
            assert!(bad.parse::<IntervalDist>().is_err(), "{bad}");
        }
        for d in [
            IntervalDist::Fixed,
            IntervalDist::Exp,
            IntervalDist::Weibull { shape: 0.75 },
        ] {
            assert_eq!(d.to_string().parse(), Ok(d));
        }
    }

    #[test]
    fn tick_probability_edges() {
        assert_eq!(tick_probability(0.0, 1000), 0.0);
        assert_eq!(tick_probability(-1.0, 1000), 0.0);
        assert_eq!(tick_probability(f64::NAN, 1000), 0.0);
        assert_eq!(tick_probability(f64::INFINITY, 1000), 1.0);
        let p = tick_probability(0.61, 3_600_000);
        assert!((p - (1.0 - (-0.61f64).exp())).abs() < 1e-15);
    }
}
