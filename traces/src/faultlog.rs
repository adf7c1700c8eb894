//! F6, the fault log of a production GPU cluster (StepFun's InfiniteHBD trace): [`FaultLog`].
//!
//! The file is one JSON array of entries
//! `{"node_id": "<uuid>", "event_time": <days>, "event_type": "fault_start" | "fault_end",
//! "fault_type": {"Level": …, "Class": …, "Desc": …}}`, sorted by `event_time`, a float number
//! of **days** since the trace's first event (the authors' README). A node is unavailable from
//! a `fault_start` to its matching `fault_end` (repaired, back in service).
//!
//! # From faults to a node trace
//!
//! * Every node of the log is live at time 0 (the log holds only faults: a node is up unless
//!   the log says otherwise) and is named by its `node_id`.
//! * A node is **down from its first open fault's start until all its open faults have
//!   ended**: overlapping faults on one node give one `remove` (at the first start) and one
//!   `add` (at the last end). A fault that starts no later than the millisecond the node's
//!   previous faults ended continues the outage (no add and remove at one instant).
//! * A fault that ends at the millisecond it started (`event_time` has 4 decimals, 8.64 s; 14
//!   of the 584 faults of the real log) still takes its node down, for 1 ms: it is a fault the
//!   job sees, and the node comes back (after its boot time, in the simulator) like any other.
//! * A fault still open at the end of the log keeps its node down to the end.
//! * Times are `event_time × 86 400 000` ms, rounded to the millisecond.
//! * The cluster's size is not in the file (only the nodes that ever failed appear):
//!   [`FaultLog::trace_on`] adds the nodes that never fail, live throughout, named `idle-0`,
//!   `idle-1`, … (skipping any name the log uses).
//!
//! # Matching and rejection
//!
//! A `fault_end` closes the oldest open fault of its node with the same `fault_type` (Level,
//! Class and Desc). Every rejection is a [`TraceError::FaultLogEntry`] naming the entry by its
//! 0-based index in the array (what `jq '.[12]'` shows) and its node: an unknown `event_type`,
//! a `fault_end` without an open `fault_start` (of that node and type), a `fault_end` earlier
//! than its `fault_start`, a time earlier than the previous entry's, a time that is not a
//! finite non-negative number of days (`1e999`, `-1`, `"3"`), and missing or mistyped fields.
//! A document that is not a JSON array of objects is a [`TraceError::Parse`] or
//! [`TraceError::Format`]; an empty array is [`TraceError::Empty`].
//!
//! ```
//! use lazarus_traces::faultlog::FaultLog;
//! let log = FaultLog::parse(r#"[
//!   {"node_id": "a", "event_time": 1.0, "event_type": "fault_start",
//!    "fault_type": {"Level": "Hardware Failure", "Class": "GPU", "Desc": "GPU xid Error"}},
//!   {"node_id": "a", "event_time": 1.5, "event_type": "fault_start",
//!    "fault_type": {"Level": "Hardware Failure", "Class": "NIC", "Desc": "NIC Lost"}},
//!   {"node_id": "a", "event_time": 2.0, "event_type": "fault_end",
//!    "fault_type": {"Level": "Hardware Failure", "Class": "GPU", "Desc": "GPU xid Error"}},
//!   {"node_id": "a", "event_time": 3.0, "event_type": "fault_end",
//!    "fault_type": {"Level": "Hardware Failure", "Class": "NIC", "Desc": "NIC Lost"}}
//! ]"#).unwrap();
//! assert_eq!(log.faults().len(), 2);
//! // One outage from day 1 to day 3, on a cluster of 3 nodes.
//! let t = log.trace_on(3).unwrap();
//! assert_eq!(
//!     t.to_bamboo_csv(),
//!     "0,add,a\n0,add,idle-0\n0,add,idle-1\n86400000,remove,a\n259200000,add,a\n"
//! );
//! assert_eq!(log.class_counts(0, u64::MAX)["GPU"], 1);
//! ```
use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::value::RawValue;

use crate::error::TraceError;
use crate::trace::{NodeOp, Trace, TraceEvent, valid_node_name};

/// Milliseconds per day: the unit of `event_time`.
pub const MS_PER_DAY: f64 = 86_400_000.0;

/// The latest accepted `event_time`, in days (about 27,000 years: far beyond any real log,
/// and small enough that milliseconds stay exact in a `u64` and an `f64`).
pub const MAX_DAYS: f64 = 1e7;

/// A fault's classification, as the log gives it (`fault_type`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FaultType {
    /// `Level`: Hardware Failure, Software Failure, Other Failure.
    pub level: String,
    /// `Class`: GPU, NIC, Parameter Plane Cable, Power Supply, Fan, Unknown Error, …
    pub class: String,
    /// `Desc`: the finest description (GPU xid Error, NIC Lost, …).
    pub desc: String,
}

/// One fault: a matched `fault_start` / `fault_end` pair (or a start still open at the end of
/// the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The node (`node_id`).
    pub node: String,
    /// Its classification.
    pub fault_type: FaultType,
    /// Start, ms since the trace start.
    pub start_ms: u64,
    /// End (repair), ms; `None` when the log ends before the fault does.
    pub end_ms: Option<u64>,
    /// 0-based index of the `fault_start` entry.
    pub start_entry: usize,
    /// 0-based index of the `fault_end` entry.
    pub end_entry: Option<usize>,
}

/// A parsed, validated fault log: the faults (with their classes) and the node outages they
/// cause. See the [module documentation](self) for the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultLog {
    /// In order of their `fault_start` entries.
    faults: Vec<Fault>,
    /// Distinct nodes, in order of first appearance.
    nodes: Vec<String>,
    /// The outages: removes and adds of the log's nodes, sorted by time (file order).
    outages: Vec<TraceEvent>,
}

fn entry_err(index: usize, node: Option<&str>, msg: impl Into<String>) -> TraceError {
    TraceError::FaultLogEntry {
        index,
        node: node.unwrap_or("?").to_owned(),
        msg: msg.into(),
    }
}

/// A number of days as written in messages: the shortest form that reads back the same.
fn days(d: f64) -> String {
    format!("{d}")
}

impl FaultLog {
    /// Parses and validates the JSON text of a fault log.
    pub fn parse(text: &str) -> Result<FaultLog, TraceError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let entries: Vec<&RawValue> = serde_json::from_str(text).map_err(|e| {
            if e.is_data() {
                TraceError::Format {
                    msg: "a fault log must be a JSON array of {node_id, event_time, event_type, \
                          fault_type} objects"
                        .to_owned(),
                }
            } else {
                TraceError::Parse {
                    line: e.line().max(1),
                    msg: format!("invalid JSON: {e}"),
                }
            }
        })?;
        if entries.is_empty() {
            return Err(TraceError::Empty);
        }
        let mut log = FaultLog {
            faults: Vec::new(),
            nodes: Vec::new(),
            outages: Vec::new(),
        };
        let mut known: HashSet<String> = HashSet::new();
        // Per node: indices into `log.faults` of its open faults, oldest first.
        let mut open: HashMap<String, Vec<usize>> = HashMap::new();
        // The outages' events, and per node the indices of its own (an `Option` so that a
        // repair can be cancelled by a fault that starts before it took effect: the outage
        // goes on).
        let mut outages: Vec<Option<TraceEvent>> = Vec::new();
        let mut node_events: HashMap<String, Vec<usize>> = HashMap::new();
        let mut previous: Option<(usize, f64)> = None;
        // `event_time` of each fault's start, in days (parallel to `log.faults`).
        let mut start_days: Vec<f64> = Vec::new();
        for (index, raw) in entries.iter().enumerate() {
            let e = Entry::read(index, raw)?;
            let node = Some(e.node.as_str());
            let ms = (e.days * MS_PER_DAY).round() as u64;
            if e.start {
                if let Some((p, pd)) = previous
                    && e.days < pd
                {
                    return Err(backwards(index, node, e.days, p, pd));
                }
                if known.insert(e.node.clone()) {
                    log.nodes.push(e.node.clone());
                }
                let list = open.entry(e.node.clone()).or_default();
                if list.is_empty() {
                    // Down now, unless its repair is not in effect yet (at this very
                    // millisecond, or the 1 ms of a zero-length fault): then the outage goes
                    // on.
                    let evs = node_events.entry(e.node.clone()).or_default();
                    match evs.last().and_then(|&i| outages[i].as_ref()) {
                        Some(last) if last.op == NodeOp::Add && last.time_ms >= ms => {
                            let i = evs.pop().expect("last exists");
                            outages[i] = None;
                        }
                        _ => {
                            evs.push(outages.len());
                            outages.push(Some(TraceEvent::remove(ms, e.node.clone())));
                        }
                    }
                }
                list.push(log.faults.len());
                start_days.push(e.days);
                log.faults.push(Fault {
                    node: e.node,
                    fault_type: e.fault_type,
                    start_ms: ms,
                    end_ms: None,
                    start_entry: index,
                    end_entry: None,
                });
            } else {
                let list = open.get_mut(&e.node).filter(|l| !l.is_empty());
                let Some(list) = list else {
                    return Err(entry_err(
                        index,
                        node,
                        format!(
                            "fault_end at day {} without a fault_start: the node has no open \
                             fault",
                            days(e.days)
                        ),
                    ));
                };
                let Some(pos) = list
                    .iter()
                    .position(|&f| log.faults[f].fault_type == e.fault_type)
                else {
                    return Err(entry_err(
                        index,
                        node,
                        format!(
                            "fault_end at day {} without a fault_start: none of the node's {} \
                             open fault(s) has fault_type {}/{}/{}",
                            days(e.days),
                            list.len(),
                            e.fault_type.level,
                            e.fault_type.class,
                            e.fault_type.desc
                        ),
                    ));
                };
                let f = &mut log.faults[list[pos]];
                let start_days = start_days[list[pos]];
                if e.days < start_days {
                    return Err(entry_err(
                        index,
                        node,
                        format!(
                            "fault_end at day {} is before its fault_start at day {} (entry {})",
                            days(e.days),
                            days(start_days),
                            f.start_entry
                        ),
                    ));
                }
                if let Some((p, pd)) = previous
                    && e.days < pd
                {
                    return Err(backwards(index, node, e.days, p, pd));
                }
                f.end_ms = Some(ms);
                f.end_entry = Some(index);
                list.remove(pos);
                if list.is_empty() {
                    // Up again; down for 1 ms when it went down at this very millisecond.
                    let evs = node_events.entry(e.node.clone()).or_default();
                    let up = match evs.last().and_then(|&i| outages[i].as_ref()) {
                        Some(last) if last.op == NodeOp::Remove && last.time_ms == ms => ms + 1,
                        _ => ms,
                    };
                    evs.push(outages.len());
                    outages.push(Some(TraceEvent::add(up, e.node.clone())));
                }
            }
            previous = Some((index, e.days));
        }
        log.outages = outages.into_iter().flatten().collect();
        // The 1 ms repairs of zero-length faults may come after later entries' events.
        log.outages.sort_by_key(|e| e.time_ms);
        Ok(log)
    }

    /// The faults, in the order of their `fault_start` entries.
    pub fn faults(&self) -> &[Fault] {
        &self.faults
    }

    /// The distinct nodes of the log, in order of first appearance.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The node trace of the log's own nodes: each added at 0, then its outages.
    pub fn trace(&self) -> Trace {
        self.build(std::iter::empty())
            .expect("a validated fault log gives a valid trace")
    }

    /// The node trace on a cluster of `cluster_nodes` nodes: [`FaultLog::trace`] plus
    /// `cluster_nodes − nodes().len()` nodes that never fail (`idle-0`, `idle-1`, …), all
    /// added at 0. Fewer nodes than the log names is [`TraceError::ClusterTooSmall`].
    pub fn trace_on(&self, cluster_nodes: usize) -> Result<Trace, TraceError> {
        let logged = self.nodes.len();
        if cluster_nodes < logged {
            return Err(TraceError::ClusterTooSmall {
                cluster: cluster_nodes,
                nodes: logged,
            });
        }
        let used: HashSet<&str> = self.nodes.iter().map(String::as_str).collect();
        let idle = (0..)
            .map(|k| format!("idle-{k}"))
            .filter(|n| !used.contains(n.as_str()))
            .take(cluster_nodes - logged);
        self.build(idle)
    }

    fn build(&self, idle: impl Iterator<Item = String>) -> Result<Trace, TraceError> {
        let initial = self.nodes.iter().cloned().chain(idle);
        let events: Vec<(usize, TraceEvent)> = initial
            .map(|n| TraceEvent::add(0, n))
            .chain(self.outages.iter().cloned())
            .enumerate()
            .map(|(i, e)| (i + 1, e))
            .collect();
        Trace::from_lined(events)
    }

    /// The faults whose `fault_start` lies in `[start_ms, end_ms)`.
    pub fn faults_starting_in(&self, start_ms: u64, end_ms: u64) -> impl Iterator<Item = &Fault> {
        self.faults
            .iter()
            .filter(move |f| (start_ms..end_ms).contains(&f.start_ms))
    }

    /// How many faults of each `Class` start in `[start_ms, end_ms)`.
    pub fn class_counts(&self, start_ms: u64, end_ms: u64) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for f in self.faults_starting_in(start_ms, end_ms) {
            *counts.entry(f.fault_type.class.clone()).or_insert(0) += 1;
        }
        counts
    }
}

fn backwards(index: usize, node: Option<&str>, d: f64, p: usize, pd: f64) -> TraceError {
    entry_err(
        index,
        node,
        format!(
            "event_time {} days is earlier than entry {p}'s {} days (the log must be sorted by \
             event_time)",
            days(d),
            days(pd)
        ),
    )
}

/// One entry, its fields checked.
struct Entry {
    node: String,
    days: f64,
    start: bool,
    fault_type: FaultType,
}

impl Entry {
    fn read(index: usize, raw: &RawValue) -> Result<Entry, TraceError> {
        let Ok(map) = serde_json::from_str::<BTreeMap<String, &RawValue>>(raw.get()) else {
            return Err(entry_err(
                index,
                None,
                format!(
                    "not an object {{node_id, event_time, event_type, fault_type}}: {}",
                    clip(raw.get())
                ),
            ));
        };
        let node = match map.get("node_id") {
            None => return Err(entry_err(index, None, "no node_id")),
            Some(v) => match serde_json::from_str::<String>(v.get()) {
                Ok(n) if valid_node_name(&n) => n,
                Ok(n) => {
                    return Err(entry_err(
                        index,
                        None,
                        format!(
                            "invalid node_id {n:?} (must be non-empty, without commas, control \
                             characters or surrounding whitespace)"
                        ),
                    ));
                }
                Err(_) => {
                    return Err(entry_err(
                        index,
                        None,
                        format!("node_id {} is not a string", clip(v.get())),
                    ));
                }
            },
        };
        let node_ref = Some(node.as_str());
        let start = match map
            .get("event_type")
            .map(|v| serde_json::from_str::<String>(v.get()))
        {
            Some(Ok(t)) if t == "fault_start" => true,
            Some(Ok(t)) if t == "fault_end" => false,
            Some(Ok(t)) => {
                return Err(entry_err(
                    index,
                    node_ref,
                    format!("unknown event_type {t:?} (expected \"fault_start\" or \"fault_end\")"),
                ));
            }
            Some(Err(_)) => {
                return Err(entry_err(
                    index,
                    node_ref,
                    format!(
                        "event_type {} is not a string (expected \"fault_start\" or \
                         \"fault_end\")",
                        clip(map["event_type"].get())
                    ),
                ));
            }
            None => return Err(entry_err(index, node_ref, "no event_type")),
        };
        let Some(time) = map.get("event_time") else {
            return Err(entry_err(index, node_ref, "no event_time"));
        };
        let t = time.get();
        // A JSON number (the raw text is never parsed by serde_json, so `1e999` arrives here).
        let days = match t.as_bytes().first() {
            Some(b'-' | b'0'..=b'9') => t.parse::<f64>().ok(),
            _ => None,
        };
        let days = match days {
            None => {
                return Err(entry_err(
                    index,
                    node_ref,
                    format!("event_time {} is not a number of days", clip(t)),
                ));
            }
            Some(d) if !d.is_finite() => {
                return Err(entry_err(
                    index,
                    node_ref,
                    format!("event_time {t} is not a finite number of days"),
                ));
            }
            Some(d) if d < 0.0 => {
                return Err(entry_err(
                    index,
                    node_ref,
                    format!("negative event_time {t} (days since the trace start, >= 0)"),
                ));
            }
            Some(d) if d > MAX_DAYS => {
                return Err(entry_err(
                    index,
                    node_ref,
                    format!("event_time {t} is out of range (at most {MAX_DAYS} days)"),
                ));
            }
            Some(d) => d + 0.0, // -0 is 0
        };
        let fault_type = fault_type(map.get("fault_type").copied())
            .map_err(|msg| entry_err(index, node_ref, msg))?;
        Ok(Entry {
            node,
            days,
            start,
            fault_type,
        })
    }
}

fn fault_type(raw: Option<&RawValue>) -> Result<FaultType, String> {
    const WANT: &str = "fault_type must be an object with string Level, Class and Desc";
    let Some(raw) = raw else {
        return Err("no fault_type".to_owned());
    };
    let Ok(map) = serde_json::from_str::<BTreeMap<String, serde_json::Value>>(raw.get()) else {
        return Err(format!("{WANT}, found {}", clip(raw.get())));
    };
    let field = |k: &str| match map.get(k) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(v) => Err(format!("{WANT}: {k} is {v}")),
        None => Err(format!("{WANT}: no {k}")),
    };
    Ok(FaultType {
        level: field("Level")?,
        class: field("Class")?,
        desc: field("Desc")?,
    })
}

/// At most 60 characters of a raw JSON value, on one line, for messages.
fn clip(raw: &str) -> String {
    let one: String = raw.split_whitespace().collect::<Vec<_>>().join(" ");
    match one.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &one[..i]),
        None => one,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(node: &str, t: &str, ty: &str, class: &str) -> String {
        format!(
            r#"{{"node_id": "{node}", "event_time": {t}, "event_type": "{ty}",
                "fault_type": {{"Level": "Hardware Failure", "Class": "{class}", "Desc": "d"}}}}"#
        )
    }

    fn log(entries: &[String]) -> String {
        format!("[\n{}\n]", entries.join(",\n"))
    }

    fn err(entries: &[String]) -> String {
        FaultLog::parse(&log(entries)).unwrap_err().to_string()
    }

    fn s(node: &str, t: &str) -> String {
        entry(node, t, "fault_start", "GPU")
    }

    fn e(node: &str, t: &str) -> String {
        entry(node, t, "fault_end", "GPU")
    }

    #[test]
    fn overlapping_faults_make_one_outage() {
        let l = FaultLog::parse(&log(&[
            s("a", "1"),
            s("b", "1"),
            entry("a", "1.5", "fault_start", "NIC"),
            e("a", "2"),
            e("b", "2"),
            entry("a", "3", "fault_end", "NIC"),
            s("b", "4"),
        ]))
        .unwrap();
        assert_eq!(l.nodes(), ["a", "b"]);
        assert_eq!(l.faults().len(), 4);
        assert_eq!(l.faults()[3].end_ms, None);
        let d = 86_400_000u64;
        let t = l.trace();
        let ev: Vec<(u64, NodeOp, &str)> = t
            .events()
            .iter()
            .map(|x| (x.time_ms, x.op, x.node.as_str()))
            .collect();
        use NodeOp::{Add, Remove};
        assert_eq!(
            ev,
            [
                (0, Add, "a"),
                (0, Add, "b"),
                (d, Remove, "a"),
                (d, Remove, "b"),
                (2 * d, Add, "b"),
                (3 * d, Add, "a"),
                (4 * d, Remove, "b"),
            ]
        );
        assert_eq!(t.removals(), 3);
        assert_eq!(l.class_counts(0, u64::MAX).len(), 2);
        assert_eq!(l.class_counts(0, u64::MAX)["GPU"], 3);
        assert_eq!(l.class_counts(d + 1, 4 * d)["NIC"], 1);
        assert_eq!(l.class_counts(d + 1, 4 * d).get("GPU"), None);
        assert_eq!(l.trace_on(2).unwrap(), t);
        assert_eq!(l.trace_on(5).unwrap().max_live(), 5);
        assert_eq!(
            l.trace_on(1).unwrap_err().to_string(),
            "a cluster of 1 nodes is smaller than the 2 distinct nodes of the fault log"
        );
    }

    #[test]
    fn touching_and_zero_length_faults() {
        // A repair and a new fault at the same instant: the outage goes on. A fault of zero
        // length: the node is down for 1 ms (b at 0; c at day 1, whose second fault at the
        // same instant continues that outage; d listed before a later entry of day 1).
        let l = FaultLog::parse(&log(&[
            s("a", "0"),
            s("b", "0"),
            e("b", "0"),
            s("c", "1"),
            s("d", "1"),
            e("d", "1"),
            e("c", "1"),
            s("c", "1"),
            e("a", "1"),
            s("a", "1"),
            e("c", "1.5"),
            e("a", "2"),
        ]))
        .unwrap();
        assert_eq!(
            l.trace().to_bamboo_csv(),
            "0,add,a\n0,add,b\n0,add,c\n0,add,d\n0,remove,a\n0,remove,b\n1,add,b\n\
             86400000,remove,c\n86400000,remove,d\n86400001,add,d\n129600000,add,c\n\
             172800000,add,a\n"
        );
        assert_eq!(l.faults().len(), 6);
    }

    #[test]
    fn idle_names_skip_the_logs() {
        let l = FaultLog::parse(&log(&[s("idle-0", "1")])).unwrap();
        assert_eq!(
            l.trace_on(3).unwrap().live_nodes_at(0),
            ["idle-0", "idle-1", "idle-2"]
        );
    }

    #[test]
    fn bad_entries_are_named() {
        for (entries, want) in [
            (
                vec![s("a", "2"), e("a", "1")],
                "entry 1 (node a): fault_end at day 1 is before its fault_start at day 2 (entry 0)",
            ),
            (
                vec![s("a", "1"), entry("a", "2", "fault_stop", "GPU")],
                "entry 1 (node a): unknown event_type \"fault_stop\" (expected \"fault_start\" \
                 or \"fault_end\")",
            ),
            (
                vec![s("a", "1"), e("b", "2")],
                "entry 1 (node b): fault_end at day 2 without a fault_start: the node has no \
                 open fault",
            ),
            (
                vec![s("a", "1"), entry("a", "2", "fault_end", "NIC")],
                "entry 1 (node a): fault_end at day 2 without a fault_start: none of the node's \
                 1 open fault(s) has fault_type Hardware Failure/NIC/d",
            ),
            (
                vec![s("a", "1"), e("a", "2"), e("a", "3")],
                "entry 2 (node a): fault_end at day 3 without a fault_start: the node has no \
                 open fault",
            ),
            (
                vec![s("a", "2"), s("b", "1.5")],
                "entry 1 (node b): event_time 1.5 days is earlier than entry 0's 2 days (the log \
                 must be sorted by event_time)",
            ),
            (
                vec![s("a", "1e999")],
                "entry 0 (node a): event_time 1e999 is not a finite number of days",
            ),
            (
                vec![s("a", "-0.5")],
                "entry 0 (node a): negative event_time -0.5 (days since the trace start, >= 0)",
            ),
            (
                vec![s("a", "\"3\"")],
                "entry 0 (node a): event_time \"3\" is not a number of days",
            ),
            (
                vec![s("a", "1e300")],
                "entry 0 (node a): event_time 1e300 is out of range (at most 10000000 days)",
            ),
            (
                vec![s("a", "1"), "17".to_owned()],
                "entry 1 (node ?): not an object {node_id, event_time, event_type, \
                 fault_type}: 17",
            ),
            (
                vec![r#"{"event_time": 1}"#.to_owned()],
                "entry 0 (node ?): no node_id",
            ),
            (
                vec![r#"{"node_id": "a,b"}"#.to_owned()],
                "entry 0 (node ?): invalid node_id \"a,b\" (must be non-empty, without commas, \
                 control characters or surrounding whitespace)",
            ),
            (
                vec![r#"{"node_id": "a", "event_type": "fault_start"}"#.to_owned()],
                "entry 0 (node a): no event_time",
            ),
            (
                vec![
                    r#"{"node_id": "a", "event_type": "fault_start", "event_time": 1}"#.to_owned(),
                ],
                "entry 0 (node a): no fault_type",
            ),
            (
                vec![
                    r#"{"node_id": "a", "event_type": "fault_start", "event_time": 1,
                        "fault_type": {"Level": "x", "Class": 3, "Desc": "y"}}"#
                        .to_owned(),
                ],
                "entry 0 (node a): fault_type must be an object with string Level, Class and \
                 Desc: Class is 3",
            ),
        ] {
            assert_eq!(err(&entries), want);
        }
        assert!(matches!(FaultLog::parse("[]"), Err(TraceError::Empty)));
        assert!(matches!(
            FaultLog::parse("[1,"),
            Err(TraceError::Parse { line: 1, .. })
        ));
        assert!(matches!(
            FaultLog::parse("{}"),
            Err(TraceError::Format { .. })
        ));
    }
}
