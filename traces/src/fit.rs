//! Fitting a trace onto a smaller cluster: [`FitMode`] and [`Trace::fit`].
//!
//! A real spot trace (P3: up to 32 nodes) usually has more nodes than the cluster it is
//! replayed on (Lazarus: "capped at 10 nodes"). The paper does not say how the mapping was
//! done, and the simple mappings give different failure patterns, so the mapping is an
//! explicit choice. All three modes share these rules:
//!
//! * If the trace already fits (`max_live() <= max_nodes`) it is returned unchanged, in every
//!   mode. `max_nodes == 0` gives an empty trace.
//! * Counts are per batch (all events of one time stamp take effect together, see
//!   [`Trace`]): after every batch the fitted trace has at most `max_nodes` live nodes, and it
//!   never removes a node that is not live (it is a valid [`Trace`]).
//! * Output events happen only at time stamps of the input trace; a batch of simultaneous
//!   removals stays one batch.
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use crate::error::ParseEnumError;
use crate::trace::{LiveSet, NodeOp, Trace, TraceEvent};

/// How [`Trace::fit`] maps a trace onto at most `max_nodes` nodes. Let `c(t)` be the input's
/// live count after the batch at `t` and `m = max_nodes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FitMode {
    /// **Clamp the count**: the output has exactly `min(c(t), m)` live nodes after every batch,
    /// and keeps the original node names.
    ///
    /// Up to `m` live nodes are *tracked* (they are the output's nodes); the others are
    /// *waiting*, in the order they were added. Per batch:
    /// 1. each `add` is tracked if fewer than `m` nodes are tracked, else it waits;
    /// 2. each `remove` of a tracked node is emitted; a `remove` of a waiting node just drops it;
    /// 3. **promotion is immediate**: while fewer than `m` nodes are tracked and some node is
    ///    waiting, the longest-waiting one is promoted and emitted as an `add` *at the same
    ///    time stamp*.
    ///
    /// So a preemption of a tracked node while spare nodes exist shows up as a same-instant
    /// replacement (`add` of the spare, `remove` of the victim; the `add` is listed first, as
    /// in every batch). A consumer that models boot delays will treat the promoted node as
    /// freshly added. Adds while `m` nodes are tracked are ignored until promoted.
    Clamp,
    /// **Track fixed slots**: the first `m` distinct nodes ever added occupy the `m` slots;
    /// when a tracked node is removed its slot stays empty until the *next node added
    /// strictly later* (an `add` at a later time stamp; adds at the removal's own time stamp
    /// were processed first and found no free slot). Already-live untracked nodes are never
    /// promoted: a node that found no free slot when it was added is ignored for its whole
    /// lifetime. Original names are kept; the live count is `<=` that of `Clamp`.
    ///
    /// This models a fixed cluster of `m` machines where a preempted machine is replaced by
    /// the next spot instance the provider grants.
    Track,
    /// **Scale the count**: after every batch the output has
    /// `round(c(t) · m / max_live)` live nodes (round half up, and at least 1 while
    /// `c(t) > 0`), where `max_live` is the input's [`Trace::max_live`]. Node identities are
    /// synthetic: adds create new names `s0, s1, …` (a counter, never reused), removals take
    /// the most recently added live synthetic nodes (LIFO). Changes are emitted at the
    /// input's own time stamps, so a batch of simultaneous removals stays one batch (possibly
    /// smaller). Never scales up.
    Scale,
}

impl FitMode {
    /// All modes, in documentation order.
    pub const ALL: [FitMode; 3] = [FitMode::Clamp, FitMode::Track, FitMode::Scale];

    /// The mapping of a `--map` flag by default (`lzsim replay --map`, `lzrun local --map`):
    /// a fixed cluster whose preempted machines are replaced by the next ones granted.
    pub const DEFAULT: FitMode = FitMode::Track;

    /// The value parser of a `--map clamp|track|scale` flag, shared by `lzsim` and `lzrun` so
    /// both read the same spellings ([`FitMode::from_str`]) with the same error.
    pub fn parse_flag(s: &str) -> Result<FitMode, String> {
        s.parse().map_err(|e: ParseEnumError| e.to_string())
    }

    /// The lower-case name (`clamp`, `track`, `scale`).
    pub fn as_str(self) -> &'static str {
        match self {
            FitMode::Clamp => "clamp",
            FitMode::Track => "track",
            FitMode::Scale => "scale",
        }
    }
}

impl fmt::Display for FitMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FitMode {
    type Err = ParseEnumError;

    /// `clamp`, `track` or `scale` (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FitMode::ALL
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| ParseEnumError::new("fit mode", s, "'clamp', 'track' or 'scale'"))
    }
}

impl Trace {
    /// Fits the trace onto a cluster of at most `max_nodes` nodes; see [`FitMode`] for the
    /// exact semantics of each mode and the [module docs](crate::fit) for the common rules.
    ///
    /// ```
    /// use lazarus_traces::{FitMode, TraceFormat, parse};
    /// let t = parse("0,add,a\n0,add,b\n0,add,c\n5,remove,a\n", TraceFormat::BambooCsv).unwrap();
    /// let clamp = t.fit(2, FitMode::Clamp);
    /// assert_eq!(clamp.to_bamboo_csv(), "0,add,a\n0,add,b\n5,add,c\n5,remove,a\n");
    /// let track = t.fit(2, FitMode::Track);
    /// assert_eq!(track.to_bamboo_csv(), "0,add,a\n0,add,b\n5,remove,a\n");
    /// let scale = t.fit(2, FitMode::Scale); // 3 -> 2, then 2 -> round(4/3) = 1
    /// assert_eq!(scale.to_bamboo_csv(), "0,add,s0\n0,add,s1\n5,remove,s1\n");
    /// ```
    pub fn fit(&self, max_nodes: usize, mode: FitMode) -> Trace {
        if max_nodes == 0 {
            return Trace::from_valid(Vec::new());
        }
        let max_live = self.max_live();
        if max_live <= max_nodes {
            return self.clone();
        }
        let events = match mode {
            FitMode::Clamp => clamp(self, max_nodes),
            FitMode::Track => track(self, max_nodes),
            FitMode::Scale => scale(self, max_nodes, max_live),
        };
        Trace::from_valid(events)
    }
}

fn clamp(trace: &Trace, max: usize) -> Vec<TraceEvent> {
    let mut tracked: HashSet<String> = HashSet::new();
    let mut waiting = LiveSet::default();
    let mut out = Vec::new();
    for (t, batch) in trace.batches() {
        // Invariant before and after each batch: `waiting` non-empty => `tracked` is full.
        let mut adds: Vec<String> = Vec::new();
        let mut removes: Vec<String> = Vec::new();
        for e in batch {
            match e.op {
                NodeOp::Add if tracked.len() < max => {
                    tracked.insert(e.node.clone());
                    adds.push(e.node.clone());
                }
                NodeOp::Add => {
                    waiting.insert(&e.node);
                }
                NodeOp::Remove => {
                    if tracked.remove(&e.node) {
                        removes.push(e.node.clone());
                    } else {
                        waiting.remove(&e.node);
                    }
                }
            }
        }
        while tracked.len() < max {
            let Some(promoted) = waiting.pop_oldest() else {
                break;
            };
            tracked.insert(promoted.clone());
            adds.push(promoted);
        }
        debug_assert!(waiting.is_empty() || tracked.len() == max);
        out.extend(adds.into_iter().map(|n| TraceEvent::add(t, n)));
        out.extend(removes.into_iter().map(|n| TraceEvent::remove(t, n)));
    }
    out
}

fn track(trace: &Trace, max: usize) -> Vec<TraceEvent> {
    let mut tracked: HashSet<&str> = HashSet::new();
    let mut out = Vec::new();
    // Events are already in replay order (adds before removes within a batch), so a slot
    // freed at time t is first visible to adds at a later time stamp.
    for e in trace.events() {
        match e.op {
            NodeOp::Add => {
                if tracked.len() < max {
                    tracked.insert(&e.node);
                    out.push(e.clone());
                }
            }
            NodeOp::Remove => {
                if tracked.remove(e.node.as_str()) {
                    out.push(e.clone());
                }
            }
        }
    }
    out
}

/// `round(c · max / max_live)`, half up, at least 1 while `c > 0`.
pub(crate) fn scaled_count(c: usize, max: usize, max_live: usize) -> usize {
    if c == 0 || max_live == 0 {
        return 0;
    }
    let (c, max, ml) = (c as u128, max as u128, max_live as u128);
    let (q, rem) = (c * max / ml, c * max % ml);
    let r = if 2 * rem >= ml { q + 1 } else { q };
    usize::try_from(r).unwrap_or(usize::MAX).max(1)
}

fn scale(trace: &Trace, max: usize, max_live: usize) -> Vec<TraceEvent> {
    let mut out = Vec::new();
    let mut live = LiveSet::default();
    let mut next = 0u64;
    for (t, c) in trace.live_steps() {
        let want = scaled_count(c, max, max_live);
        while live.len() < want {
            let name = format!("s{next}");
            next += 1;
            live.insert(&name);
            out.push(TraceEvent::add(t, name));
        }
        while live.len() > want {
            let name = live.pop_newest().expect("live.len() > want >= 0");
            out.push(TraceEvent::remove(t, name));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_mode_names_round_trip() {
        for m in FitMode::ALL {
            assert_eq!(m.to_string().parse::<FitMode>(), Ok(m));
        }
        assert_eq!("CLAMP".parse::<FitMode>(), Ok(FitMode::Clamp));
        let err = "squash".parse::<FitMode>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid fit mode 'squash' (expected 'clamp', 'track' or 'scale')"
        );
        assert_eq!(FitMode::parse_flag("scale"), Ok(FitMode::Scale));
        assert_eq!(FitMode::parse_flag("squash"), Err(err.to_string()));
        assert_eq!(FitMode::DEFAULT, FitMode::Track);
    }

    #[test]
    fn scaled_count_rounds_half_up_and_keeps_one() {
        assert_eq!(scaled_count(32, 10, 32), 10);
        assert_eq!(scaled_count(16, 10, 32), 5);
        assert_eq!(scaled_count(24, 10, 32), 8); // 7.5 -> 8
        assert_eq!(scaled_count(1, 10, 32), 1); // 0.3125 -> 0 -> at least 1
        assert_eq!(scaled_count(0, 10, 32), 0);
        assert_eq!(scaled_count(usize::MAX, usize::MAX, usize::MAX), usize::MAX);
    }

    fn csv(s: &str) -> Trace {
        crate::parse(s, crate::TraceFormat::BambooCsv).unwrap()
    }

    #[test]
    fn clamp_promotes_the_longest_waiting_node_immediately() {
        let t = csv("0,add,a\n0,add,b\n1,add,c\n2,add,d\n3,remove,a\n4,remove,c\n5,remove,b\n");
        let f = t.fit(2, FitMode::Clamp);
        assert_eq!(
            f.to_bamboo_csv(),
            "0,add,a\n0,add,b\n3,add,c\n3,remove,a\n4,add,d\n4,remove,c\n5,remove,b\n"
        );
        // Track: c and d arrived while both slots were full: never tracked.
        let f = t.fit(2, FitMode::Track);
        assert_eq!(
            f.to_bamboo_csv(),
            "0,add,a\n0,add,b\n3,remove,a\n5,remove,b\n"
        );
    }

    #[test]
    fn clamp_drops_waiting_nodes_removed_in_the_promotion_batch() {
        // At t=3 tracked a and waiting c die together: d (not c) is promoted.
        let t = csv("0,add,a\n0,add,b\n1,add,c\n2,add,d\n3,remove,a\n3,remove,c\n");
        let f = t.fit(2, FitMode::Clamp);
        assert_eq!(f.to_bamboo_csv(), "0,add,a\n0,add,b\n3,add,d\n3,remove,a\n");
    }

    #[test]
    fn track_refills_slots_only_with_strictly_later_adds() {
        // a is removed at 3 while e is added at 3: e was processed first (adds before removes)
        // and found no slot; f at 4 takes a's slot.
        let t = csv("0,add,a\n0,add,b\n0,add,c\n3,add,e\n3,remove,a\n4,add,f\n");
        let f = t.fit(2, FitMode::Track);
        assert_eq!(f.to_bamboo_csv(), "0,add,a\n0,add,b\n3,remove,a\n4,add,f\n");
    }

    #[test]
    fn scale_keeps_removal_batches_and_is_lifo() {
        let t = csv("0,add,a\n0,add,b\n0,add,c\n0,add,d\n2,remove,a\n2,remove,b\n3,add,e\n");
        // max_live 4 -> 2: counts 4,2,3 -> 2,1,2 (1.5 rounds up)
        let f = t.fit(2, FitMode::Scale);
        assert_eq!(
            f.to_bamboo_csv(),
            "0,add,s0\n0,add,s1\n2,remove,s1\n3,add,s2\n"
        );
    }

    #[test]
    fn fitting_traces_and_zero_are_special() {
        let t = csv("0,add,a\n1,add,b\n2,remove,a\n");
        for m in FitMode::ALL {
            assert_eq!(t.fit(2, m), t);
            assert!(t.fit(0, m).is_empty());
        }
    }
}
