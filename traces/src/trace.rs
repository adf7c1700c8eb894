//! The validated event list: [`Trace`], [`TraceEvent`], [`NodeOp`].
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{ParseEnumError, TraceError};

/// What happened to a node.
///
/// The declaration order is the processing order at equal times: `Add` sorts before `Remove`
/// (the `(time, kind)` event-queue order of the Bamboo and Oobleck simulators).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeOp {
    /// The node became available (Bamboo's simulators then add their own boot delay).
    Add,
    /// The node was preempted / terminated.
    Remove,
}

impl NodeOp {
    /// The op as written in the Bamboo CSV format: `add` or `remove`.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeOp::Add => "add",
            NodeOp::Remove => "remove",
        }
    }
}

impl fmt::Display for NodeOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NodeOp {
    type Err = ParseEnumError;

    /// Exactly `add` or `remove` (case-sensitive, like every real trace file).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "add" => Ok(NodeOp::Add),
            "remove" => Ok(NodeOp::Remove),
            _ => Err(ParseEnumError::new("node op", s, "'add' or 'remove'")),
        }
    }
}

/// One membership change: at `time_ms` (milliseconds since the trace start) node `node` was
/// added or removed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Milliseconds since the trace start.
    pub time_ms: u64,
    /// Add or remove.
    pub op: NodeOp,
    /// Opaque node name, unique per lifetime among live nodes.
    pub node: String,
}

impl TraceEvent {
    /// Convenience constructor.
    pub fn new(time_ms: u64, op: NodeOp, node: impl Into<String>) -> Self {
        Self {
            time_ms,
            op,
            node: node.into(),
        }
    }

    /// An `add` event.
    pub fn add(time_ms: u64, node: impl Into<String>) -> Self {
        Self::new(time_ms, NodeOp::Add, node)
    }

    /// A `remove` event.
    pub fn remove(time_ms: u64, node: impl Into<String>) -> Self {
        Self::new(time_ms, NodeOp::Remove, node)
    }
}

impl fmt::Display for TraceEvent {
    /// The Bamboo CSV row, without line terminator: `time_ms,op,node`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{},{},{}", self.time_ms, self.op, self.node)
    }
}

/// A validated node-availability trace.
///
/// Invariants (established by [`Trace::new`] and kept by every method that returns a `Trace`):
///
/// * events are sorted by `time_ms`; among events with the same time all `add`s come before
///   all `remove`s (Bamboo/Oobleck semantics), otherwise the input order is kept;
/// * replaying the events in that order, every `remove` names a live node and every `add` a
///   node that is not live (a name may be reused after its node was removed);
/// * every node name is representable in the Bamboo CSV format (non-empty, no comma, no control
///   character, no leading/trailing whitespace), so [`Trace::to_bamboo_csv`] round-trips.
///
/// **Counting semantics.** All events with the same time stamp form one *batch* that takes
/// effect atomically: "live nodes at time t" is #adds − #removes over the events with
/// `time_ms <= t` (the counting of the Bamboo and Oobleck simulators' event queues). [`Trace::max_live`] and
/// [`Trace::min_live`] are taken over the counts after each batch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Trace {
    events: Vec<TraceEvent>,
}

impl TryFrom<Vec<TraceEvent>> for Trace {
    type Error = TraceError;

    fn try_from(events: Vec<TraceEvent>) -> Result<Self, Self::Error> {
        Trace::new(events)
    }
}

impl Trace {
    /// Validates `events` and builds a trace.
    ///
    /// Checks, in one pass over the time-stamp batches: times are non-decreasing
    /// ([`TraceError::Unsorted`]); node names are valid ([`TraceError::InvalidNode`]); after
    /// stably moving the `add`s of each batch before its `remove`s, every `remove` is of a live
    /// node ([`TraceError::UnknownNode`]) and every `add` of a non-live node
    /// ([`TraceError::DuplicateAdd`]). The reported `line` is the 1-based index of the offending
    /// event in `events`. An empty vector is rejected with [`TraceError::Empty`] (methods such
    /// as [`Trace::window`] and [`Trace::fit`] can still produce empty traces).
    ///
    /// ```
    /// use lazarus_traces::{Trace, TraceEvent};
    /// // A remove listed before an add at the same time is fine: adds go first.
    /// let t = Trace::new(vec![
    ///     TraceEvent::add(0, "a"),
    ///     TraceEvent::remove(5, "b"),
    ///     TraceEvent::add(5, "b"),
    /// ])
    /// .unwrap();
    /// assert_eq!(t.events()[1], TraceEvent::add(5, "b"));
    /// assert_eq!(t.live_at(5), 1);
    /// ```
    pub fn new(events: Vec<TraceEvent>) -> Result<Self, TraceError> {
        Self::from_lined(
            events
                .into_iter()
                .enumerate()
                .map(|(i, e)| (i + 1, e))
                .collect(),
        )
    }

    /// [`Trace::new`] with caller-supplied line numbers for the error messages.
    pub(crate) fn from_lined(mut lined: Vec<(usize, TraceEvent)>) -> Result<Self, TraceError> {
        if lined.is_empty() {
            return Err(TraceError::Empty);
        }
        let mut live: HashSet<String> = HashSet::new();
        let mut start = 0;
        while start < lined.len() {
            let time = lined[start].1.time_ms;
            if start > 0 {
                let previous_ms = lined[start - 1].1.time_ms;
                if time < previous_ms {
                    return Err(TraceError::Unsorted {
                        line: lined[start].0,
                        time_ms: time,
                        previous_ms,
                    });
                }
            }
            let mut end = start + 1;
            while end < lined.len() && lined[end].1.time_ms == time {
                end += 1;
            }
            let batch = &mut lined[start..end];
            // Stable: adds keep their relative order, then removes keep theirs.
            batch.sort_by_key(|(_, e)| e.op);
            for (line, e) in batch.iter() {
                if !valid_node_name(&e.node) {
                    return Err(TraceError::InvalidNode {
                        line: *line,
                        node: e.node.clone(),
                    });
                }
                match e.op {
                    NodeOp::Add => {
                        if !live.insert(e.node.clone()) {
                            return Err(TraceError::DuplicateAdd {
                                line: *line,
                                node: e.node.clone(),
                            });
                        }
                    }
                    NodeOp::Remove => {
                        if !live.remove(&e.node) {
                            return Err(TraceError::UnknownNode {
                                line: *line,
                                node: e.node.clone(),
                            });
                        }
                    }
                }
            }
            start = end;
        }
        Ok(Trace {
            events: lined.into_iter().map(|(_, e)| e).collect(),
        })
    }

    /// Builds a trace from events that the caller guarantees satisfy the invariants (possibly
    /// empty). Checked in debug builds.
    pub(crate) fn from_valid(events: Vec<TraceEvent>) -> Self {
        debug_assert!(
            events.is_empty() || Trace::new(events.clone()).is_ok_and(|t| t.events == events),
            "internal error: invalid trace constructed"
        );
        Trace { events }
    }

    /// The events, in replay order.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// Consumes the trace, returning its events.
    pub fn into_events(self) -> Vec<TraceEvent> {
        self.events
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True when the trace has no events (only possible for results of [`Trace::window`],
    /// [`Trace::fit`] and the generators).
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Time of the last event (0 for an empty trace). Traces start at time 0, so this is the
    /// trace's length; a trace whose first event is later than 0 (g4dn starts at 480 000 ms)
    /// still counts from 0. A [`Trace::window`] does not remember its `end_ms`: its duration is
    /// the time of its last event, the caller knows the window length.
    pub fn duration_ms(&self) -> u64 {
        self.events.last().map_or(0, |e| e.time_ms)
    }

    /// Number of live nodes at time `t_ms`: #adds − #removes over events with `time_ms <= t_ms`
    /// (a batch at `t_ms` has already taken effect).
    pub fn live_at(&self, t_ms: u64) -> usize {
        let end = self.events.partition_point(|e| e.time_ms <= t_ms);
        live_count(&self.events[..end])
    }

    /// Names of the nodes live at `t_ms` (events with `time_ms <= t_ms` applied), in the order
    /// they were added.
    pub fn live_nodes_at(&self, t_ms: u64) -> Vec<String> {
        let end = self.events.partition_point(|e| e.time_ms <= t_ms);
        let mut live = LiveSet::default();
        for e in &self.events[..end] {
            live.apply(e);
        }
        live.into_names()
    }

    /// The batches: for each distinct time stamp, the time and its events (adds first).
    pub fn batches(&self) -> impl Iterator<Item = (u64, &[TraceEvent])> {
        self.events
            .chunk_by(|a, b| a.time_ms == b.time_ms)
            .map(|batch| (batch[0].time_ms, batch))
    }

    /// The live-node step function: for each distinct time stamp, the time and the number of
    /// live nodes after its batch.
    pub fn live_steps(&self) -> Vec<(u64, usize)> {
        let mut live = 0usize;
        self.batches()
            .map(|(t, batch)| {
                live = live + adds_in(batch) - removes_in(batch);
                (t, live)
            })
            .collect()
    }

    /// Largest number of live nodes after any batch (0 for an empty trace).
    pub fn max_live(&self) -> usize {
        self.live_steps()
            .into_iter()
            .map(|(_, c)| c)
            .max()
            .unwrap_or(0)
    }

    /// Smallest number of live nodes after any batch (0 for an empty trace). The count before
    /// the first event (0) is not included.
    pub fn min_live(&self) -> usize {
        self.live_steps()
            .into_iter()
            .map(|(_, c)| c)
            .min()
            .unwrap_or(0)
    }

    /// Number of `remove` events.
    pub fn removals(&self) -> usize {
        removes_in(&self.events)
    }

    /// Number of `add` events (including the ones at time 0).
    pub fn adds(&self) -> usize {
        adds_in(&self.events)
    }

    /// The half-open window `[start_ms, end_ms)`, rebased to start at 0.
    ///
    /// The nodes live just before `start_ms` (all events with `time_ms < start_ms` applied)
    /// become `add`s at time 0, in the order they were added; then every event with
    /// `start_ms <= time_ms < end_ms` follows, shifted by `−start_ms` (so events at exactly
    /// `start_ms` land at 0, after the carried-over adds). Node names are kept. This is the
    /// usual slice-and-rebase (an `awk` one-liner over the CSV) and that of Parcae's
    /// `trace_gen.py` without the 1-minute quantisation. `end_ms <= start_ms` gives an empty
    /// trace.
    pub fn window(&self, start_ms: u64, end_ms: u64) -> Trace {
        if end_ms <= start_ms {
            return Trace::from_valid(Vec::new());
        }
        let first = self.events.partition_point(|e| e.time_ms < start_ms);
        let last = self.events.partition_point(|e| e.time_ms < end_ms);
        let mut live = LiveSet::default();
        for e in &self.events[..first] {
            live.apply(e);
        }
        let mut out: Vec<TraceEvent> = live
            .into_names()
            .into_iter()
            .map(|n| TraceEvent::add(0, n))
            .collect();
        out.extend(self.events[first..last].iter().map(|e| TraceEvent {
            time_ms: e.time_ms - start_ms,
            op: e.op,
            node: e.node.clone(),
        }));
        Trace::from_valid(out)
    }

    /// The trace in Bamboo CSV: one `time_ms,add|remove,node` row per event, LF line endings,
    /// no header. [`parse`](crate::parse()) of the result gives back an identical trace.
    pub fn to_bamboo_csv(&self) -> String {
        let mut s = String::with_capacity(self.events.len() * 24);
        for e in &self.events {
            use fmt::Write;
            let _ = writeln!(s, "{e}");
        }
        s
    }
}

fn adds_in(events: &[TraceEvent]) -> usize {
    events.iter().filter(|e| e.op == NodeOp::Add).count()
}

fn removes_in(events: &[TraceEvent]) -> usize {
    events.iter().filter(|e| e.op == NodeOp::Remove).count()
}

/// Live count after `events` (a valid trace prefix: never negative).
fn live_count(events: &[TraceEvent]) -> usize {
    adds_in(events) - removes_in(events)
}

/// Node names must survive a round trip through the Bamboo CSV format.
pub(crate) fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && !name.contains(',')
        && !name.chars().any(char::is_control)
        && name.trim() == name
}

/// A set of live node names that remembers the order in which they were added.
#[derive(Debug, Default, Clone)]
pub(crate) struct LiveSet {
    next_seq: u64,
    seq_of: HashMap<String, u64>,
    by_seq: BTreeMap<u64, String>,
}

impl LiveSet {
    /// Inserts `name` as the newest member; false if it was already present.
    pub(crate) fn insert(&mut self, name: &str) -> bool {
        if self.seq_of.contains_key(name) {
            return false;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.seq_of.insert(name.to_owned(), seq);
        self.by_seq.insert(seq, name.to_owned());
        true
    }

    /// Removes `name`; false if it was not present.
    pub(crate) fn remove(&mut self, name: &str) -> bool {
        match self.seq_of.remove(name) {
            Some(seq) => {
                self.by_seq.remove(&seq);
                true
            }
            None => false,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.seq_of.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.seq_of.is_empty()
    }

    /// Removes and returns the member added first.
    pub(crate) fn pop_oldest(&mut self) -> Option<String> {
        let (_, name) = self.by_seq.pop_first()?;
        self.seq_of.remove(&name);
        Some(name)
    }

    /// Removes and returns the member added last.
    pub(crate) fn pop_newest(&mut self) -> Option<String> {
        let (_, name) = self.by_seq.pop_last()?;
        self.seq_of.remove(&name);
        Some(name)
    }

    /// Applies a (valid) event.
    pub(crate) fn apply(&mut self, e: &TraceEvent) {
        match e.op {
            NodeOp::Add => self.insert(&e.node),
            NodeOp::Remove => self.remove(&e.node),
        };
    }

    /// The members, oldest first.
    pub(crate) fn into_names(self) -> Vec<String> {
        self.by_seq.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(events: &[(u64, NodeOp, &str)]) -> Result<Trace, TraceError> {
        Trace::new(
            events
                .iter()
                .map(|&(time, op, n)| TraceEvent::new(time, op, n))
                .collect(),
        )
    }

    use NodeOp::{Add, Remove};

    #[test]
    fn adds_move_before_removes_within_a_batch() {
        let tr = t(&[(0, Add, "a"), (0, Remove, "a"), (0, Add, "b")]).unwrap();
        let ops: Vec<_> = tr
            .events()
            .iter()
            .map(|e| (e.op, e.node.as_str()))
            .collect();
        assert_eq!(ops, [(Add, "a"), (Add, "b"), (Remove, "a")]);
    }

    #[test]
    fn validation_errors_name_the_event_index() {
        assert!(matches!(t(&[]), Err(TraceError::Empty)));
        assert!(matches!(
            t(&[(5, Add, "a"), (4, Add, "b")]),
            Err(TraceError::Unsorted {
                line: 2,
                time_ms: 4,
                previous_ms: 5
            })
        ));
        assert!(matches!(
            t(&[(0, Add, "a"), (1, Remove, "b")]),
            Err(TraceError::UnknownNode { line: 2, .. })
        ));
        assert!(matches!(
            t(&[(0, Add, "a"), (1, Remove, "a"), (2, Remove, "a")]),
            Err(TraceError::UnknownNode { line: 3, .. })
        ));
        assert!(matches!(
            t(&[(0, Add, "a"), (1, Add, "a")]),
            Err(TraceError::DuplicateAdd { line: 2, .. })
        ));
        // remove-then-re-add of the same name at the same instant is an add of a live node
        assert!(matches!(
            t(&[(0, Add, "a"), (1, Remove, "a"), (1, Add, "a")]),
            Err(TraceError::DuplicateAdd { line: 3, .. })
        ));
        // ... but a later re-add is fine
        assert!(t(&[(0, Add, "a"), (1, Remove, "a"), (2, Add, "a")]).is_ok());
        for bad in ["", "a,b", " a", "a\n", "a\tb"] {
            assert!(
                matches!(
                    t(&[(0, Add, bad)]),
                    Err(TraceError::InvalidNode { line: 1, .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn counts_and_window() {
        let tr = t(&[
            (0, Add, "a"),
            (0, Add, "b"),
            (0, Add, "c"),
            (10, Remove, "b"),
            (20, Add, "d"),
            (30, Remove, "a"),
            (30, Remove, "c"),
        ])
        .unwrap();
        assert_eq!(tr.duration_ms(), 30);
        assert_eq!(tr.live_at(0), 3);
        assert_eq!(tr.live_at(9), 3);
        assert_eq!(tr.live_at(10), 2);
        assert_eq!(tr.live_at(u64::MAX), 1);
        assert_eq!(tr.max_live(), 3);
        assert_eq!(tr.min_live(), 1);
        assert_eq!((tr.adds(), tr.removals()), (4, 3));
        assert_eq!(tr.live_nodes_at(25), ["a", "c", "d"]);
        assert_eq!(tr.live_steps(), [(0, 3), (10, 2), (20, 3), (30, 1)]);

        let w = tr.window(10, 30);
        assert_eq!(
            w.to_bamboo_csv(),
            "0,add,a\n0,add,b\n0,add,c\n0,remove,b\n10,add,d\n"
        );
        let w = tr.window(11, 31);
        assert_eq!(
            w.to_bamboo_csv(),
            "0,add,a\n0,add,c\n9,add,d\n19,remove,a\n19,remove,c\n"
        );
        assert!(tr.window(5, 5).is_empty());
        assert_eq!(tr.window(31, 100).to_bamboo_csv(), "0,add,d\n");
        assert_eq!(tr.window(0, u64::MAX), tr);
    }
}
