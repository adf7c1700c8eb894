//! # Slow is not dead: how long to wait for a peer that is alive
//!
//! A fixed collective timeout cannot serve both a 50 ms step of a small model and a 60 s first
//! step of GPT-S on a CPU: set for the first, it declares the second's healthy ranks failed;
//! set for the second, it waits a minute for every hang of the first. So the two questions a
//! timeout mixes are answered apart:
//!
//! * **Gone** — the process died, its connection closed, or its heartbeats stopped (a stopped,
//!   frozen or swapped-out process). Heartbeats come from threads and processes that compute
//!   cannot starve, so this is known within one heartbeat timeout whatever the step time.
//! * **Slow** — alive (heartbeating) but not done with the step. It is waited for up to a
//!   **step deadline** derived from measured step times ([`StepDeadline::limit`]):
//!
//! ```text
//! limit = clamp(factor × the slowest of the last `window_steps` step times, floor_ms, ceiling_ms)
//! limit = ceiling_ms                       while no step has been measured (warm-up)
//! ```
//!
//! This is the rule of the watchdogs in common use, made adaptive: PyTorch's NCCL watchdog and
//! TorchElastic keep a fixed, generous collective timeout (10–30 min) and tell dead workers by
//! heartbeats; here the fixed timeout is the ceiling and the warm-up allowance (the first
//! steps allocate, page in and compile, and nothing is measured yet), and once steps are
//! measured a hang is noticed after a few step times instead of half an hour. The floor keeps
//! a burst of fast steps from making the limit so tight that a scheduling hiccup trips it.
//!
//! Pure: step times are passed in ([`StepTimes::push`]); the caller owns the clock.
//!
//! ```
//! use lazarus_planner::deadline::{Basis, StepDeadline, StepTimes};
//! let rule = StepDeadline::new(10_000, 600_000);
//! let mut times = StepTimes::new(rule.window_steps);
//! assert_eq!(rule.limit(&times).ms, 600_000); // warm-up: nothing measured yet
//! times.push(30_000); // a 30 s step (GPT-S on a CPU)
//! assert_eq!(rule.limit(&times).ms, 120_000); // 4 × 30 s
//! assert_eq!(rule.limit(&times).basis, Basis::Measured { slowest_ms: 30_000 });
//! let mut fast = StepTimes::new(rule.window_steps);
//! fast.push(100);
//! assert_eq!(rule.limit(&fast).ms, 10_000); // fast steps cannot go below the floor
//! ```

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// The step deadline rule (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepDeadline {
    /// The shortest limit, however fast recent steps were.
    pub floor_ms: u64,
    /// The longest limit, and the limit before any step was measured.
    pub ceiling_ms: u64,
    /// The limit is this many times the slowest recent step.
    pub factor: u64,
    /// How many recent steps count.
    pub window_steps: usize,
}

/// What a limit was derived from (for the log line that says why a member was waited for).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Basis {
    /// No step measured yet: the ceiling.
    WarmUp,
    /// `factor ×` this, clamped.
    Measured { slowest_ms: u64 },
}

/// A limit and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limit {
    pub ms: u64,
    pub basis: Basis,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.ms as f64 / 1e3;
        match self.basis {
            Basis::WarmUp => write!(f, "{s:.1} s (warm-up: no step measured yet)"),
            Basis::Measured { slowest_ms } => write!(
                f,
                "{s:.1} s (from the slowest recent step, {:.1} s)",
                slowest_ms as f64 / 1e3
            ),
        }
    }
}

/// Why a [`StepDeadline`] cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeadlineError {
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("the step deadline's ceiling ({ceiling_ms} ms) is below its floor ({floor_ms} ms)")]
    CeilingBelowFloor { floor_ms: u64, ceiling_ms: u64 },
}

impl StepDeadline {
    /// A few step times: room for a slower step (a checkpoint, a busy neighbour) without
    /// waiting long on a hang.
    pub const DEFAULT_FACTOR: u64 = 4;
    /// Recent enough to follow a change of speed (a node joined), long enough to include the
    /// slower steps that come periodically (checkpoints every few steps).
    pub const DEFAULT_WINDOW_STEPS: usize = 20;
    /// PyTorch's default collective timeout for NCCL: 10 minutes.
    pub const DEFAULT_CEILING_MS: u64 = 600_000;

    /// The rule with `floor_ms`, `ceiling_ms` and the default factor and window.
    pub fn new(floor_ms: u64, ceiling_ms: u64) -> Self {
        Self {
            floor_ms,
            ceiling_ms,
            factor: Self::DEFAULT_FACTOR,
            window_steps: Self::DEFAULT_WINDOW_STEPS,
        }
    }

    pub fn validate(&self) -> Result<(), DeadlineError> {
        for (name, v) in [
            ("the step deadline's floor_ms", self.floor_ms),
            ("the step deadline's factor", self.factor),
            ("the step deadline's window_steps", self.window_steps as u64),
        ] {
            if v == 0 {
                return Err(DeadlineError::Zero(name));
            }
        }
        if self.ceiling_ms < self.floor_ms {
            return Err(DeadlineError::CeilingBelowFloor {
                floor_ms: self.floor_ms,
                ceiling_ms: self.ceiling_ms,
            });
        }
        Ok(())
    }

    /// The limit after the step times `times` (see the [module docs](self)).
    pub fn limit(&self, times: &StepTimes) -> Limit {
        match times.slowest_ms() {
            None => Limit {
                ms: self.ceiling_ms,
                basis: Basis::WarmUp,
            },
            Some(slowest_ms) => Limit {
                ms: slowest_ms
                    .saturating_mul(self.factor)
                    .clamp(self.floor_ms, self.ceiling_ms.max(self.floor_ms)),
                basis: Basis::Measured { slowest_ms },
            },
        }
    }
}

/// The most recent step times, at most `window` of them.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepTimes {
    window: usize,
    times_ms: VecDeque<u64>,
}

impl StepTimes {
    /// Keeps the last `window` (at least 1) times.
    pub fn new(window: usize) -> Self {
        Self {
            window: window.max(1),
            times_ms: VecDeque::new(),
        }
    }

    /// A step took `ms`; the oldest beyond the window is forgotten.
    pub fn push(&mut self, ms: u64) {
        if self.times_ms.len() == self.window {
            self.times_ms.pop_front();
        }
        self.times_ms.push_back(ms);
        debug_assert!(self.times_ms.len() <= self.window);
    }

    /// The slowest of the kept times; `None` before the first.
    pub fn slowest_ms(&self) -> Option<u64> {
        self.times_ms.iter().copied().max()
    }

    /// How many times are kept.
    pub fn len(&self) -> usize {
        self.times_ms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.times_ms.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_then_a_multiple_of_the_slowest_recent_step_clamped() {
        let rule = StepDeadline::new(1_000, 60_000);
        rule.validate().unwrap();
        let mut t = StepTimes::new(3);
        assert_eq!(
            rule.limit(&t),
            Limit {
                ms: 60_000,
                basis: Basis::WarmUp
            }
        );
        t.push(2_000);
        assert_eq!(rule.limit(&t).ms, 8_000);
        t.push(100_000);
        assert_eq!(rule.limit(&t).ms, 60_000, "never above the ceiling");
        // The slow step leaves the window after three more.
        for _ in 0..3 {
            t.push(50);
        }
        assert_eq!(t.len(), 3);
        assert_eq!(rule.limit(&t).ms, 1_000, "never below the floor");
        assert_eq!(rule.limit(&t).basis, Basis::Measured { slowest_ms: 50 });
    }

    #[test]
    fn a_fixed_timeout_is_a_ceiling_equal_to_the_floor() {
        let rule = StepDeadline::new(5_000, 5_000);
        let mut t = StepTimes::new(20);
        assert_eq!(rule.limit(&t).ms, 5_000);
        t.push(1);
        assert_eq!(rule.limit(&t).ms, 5_000);
        t.push(u64::MAX);
        assert_eq!(rule.limit(&t).ms, 5_000, "no overflow");
    }

    #[test]
    fn bad_rules_are_refused() {
        assert!(StepDeadline::new(0, 10).validate().is_err());
        assert_eq!(
            StepDeadline::new(10, 5).validate(),
            Err(DeadlineError::CeilingBelowFloor {
                floor_ms: 10,
                ceiling_ms: 5
            })
        );
        let mut r = StepDeadline::new(1, 5);
        r.factor = 0;
        assert!(r.validate().is_err());
    }
}
