//! The crate's error types.
//!
//! Every rejection of a trace names where the problem is: the 1-based line of the input file
//! for the line-oriented formats (Bamboo CSV, JSON lines), the position in the input vector for
//! [`Trace::new`](crate::Trace::new), and the file itself when the trace came from
//! [`load`](crate::load()).
use std::path::PathBuf;

/// Why a trace could not be read, parsed or validated.
///
/// Like [`GateTraceError`](crate::routing::GateTraceError), a variant that wraps another error
/// displays only its own part (the file name) and returns the wrapped error from
/// [`source`](std::error::Error::source): printers that walk the chain (`anyhow`'s `{:#}`) then
/// show each part once, `path: line 7: …`.
///
/// `line` fields are 1-based. For [`parse`](crate::parse()) they are physical line numbers of the
/// input text (blank lines and a skipped header count); for [`Trace::new`](crate::Trace::new)
/// they are the 1-based index of the offending event in the input vector.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read (missing, unreadable, not UTF-8). Displays as the path; the
    /// I/O error is the source.
    #[error("{}", path.display())]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A parse or validation error inside a named file (wraps the error with the file name;
    /// produced by [`load`](crate::load())). Displays as the path; the content error is the
    /// source.
    #[error("{}", path.display())]
    InFile {
        /// The file that was being parsed.
        path: PathBuf,
        /// What was wrong with its content.
        #[source]
        source: Box<TraceError>,
    },
    /// A line could not be parsed: wrong field count, unknown op, invalid JSON, malformed time.
    /// Displays as `line 7: unknown op 'kill' …`.
    #[error("line {line}: {msg}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        msg: String,
    },
    /// A whole-document format error without a meaningful line (SkyPilot JSON schema errors).
    #[error("{msg}")]
    Format {
        /// What is wrong with the document.
        msg: String,
    },
    /// An event's time is earlier than the previous event's (traces must be sorted by time).
    #[error(
        "line {line}: time {time_ms} ms is earlier than the previous event's {previous_ms} ms \
         (events must be sorted by time)"
    )]
    Unsorted {
        /// 1-based line number of the out-of-order event.
        line: usize,
        /// Its time.
        time_ms: u64,
        /// The time of the event before it.
        previous_ms: u64,
    },
    /// A `remove` of a node that is not live at that moment (never added, or already removed).
    #[error(
        "line {line}: remove of node '{node}', which is not live (never added, or already \
         removed)"
    )]
    UnknownNode {
        /// 1-based line number.
        line: usize,
        /// The node name.
        node: String,
    },
    /// An `add` of a node that is already live (node names are unique per lifetime; a node may
    /// be added again only after it was removed).
    #[error("line {line}: add of node '{node}', which is already live")]
    DuplicateAdd {
        /// 1-based line number.
        line: usize,
        /// The node name.
        node: String,
    },
    /// A negative time stamp.
    #[error("line {line}: negative time (times are milliseconds since the trace start, >= 0)")]
    NegativeTime {
        /// 1-based line number.
        line: usize,
    },
    /// A node name that cannot be represented in the Bamboo CSV format: empty, containing a
    /// comma or a control character, or with leading/trailing whitespace.
    #[error(
        "line {line}: invalid node name {node:?} (must be non-empty, without commas, control \
         characters or surrounding whitespace)"
    )]
    InvalidNode {
        /// 1-based line number.
        line: usize,
        /// The rejected name.
        node: String,
    },
    /// An entry of a fault log ([`FaultLog`](crate::faultlog::FaultLog), InfiniteHBD JSON) that
    /// cannot be replayed: an unknown `event_type`, a `fault_end` without an open
    /// `fault_start` or earlier than it, a time going backwards, a time that is not a finite
    /// non-negative number of days, a missing or mistyped field. Displays as
    /// `entry 12 (node 6f24…): unknown event_type "fault_stop" …`.
    #[error("entry {index} (node {node}): {msg}")]
    FaultLogEntry {
        /// 0-based index of the entry in the JSON array (`jq '.[12]'`).
        index: usize,
        /// Its `node_id`, or `?` when it has none.
        node: String,
        /// What is wrong with it.
        msg: String,
    },
    /// A fault log asked onto a cluster smaller than the number of distinct nodes it names
    /// ([`FaultLog::trace_on`](crate::faultlog::FaultLog::trace_on)).
    #[error(
        "a cluster of {cluster} nodes is smaller than the {nodes} distinct nodes of the fault log"
    )]
    ClusterTooSmall {
        /// The requested cluster size.
        cluster: usize,
        /// The distinct nodes of the log.
        nodes: usize,
    },
    /// The input holds no `add`/`remove` event at all.
    #[error("the trace has no add/remove events")]
    Empty,
    /// A count series would expand into more than [`MAX_SYNTH_EVENTS`](crate::MAX_SYNTH_EVENTS)
    /// synthetic events (guards memory against hostile or corrupt input).
    #[error("the count series would expand into {events} events (limit {limit})")]
    TooLarge {
        /// The number of events the input asked for (saturating).
        events: u64,
        /// The limit.
        limit: u64,
    },
}

/// A string did not name a value of one of this crate's small enums ([`FitMode`](crate::FitMode),
/// [`NodeOp`](crate::NodeOp), [`TraceFormat`](crate::TraceFormat),
/// [`IntervalDist`](crate::synth::IntervalDist)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} '{input}' (expected {expected})")]
pub struct ParseEnumError {
    /// What was being parsed ("fit mode", "node op", …).
    pub what: &'static str,
    /// The rejected input.
    pub input: String,
    /// The accepted spellings.
    pub expected: &'static str,
}

impl ParseEnumError {
    pub(crate) fn new(what: &'static str, input: &str, expected: &'static str) -> Self {
        Self {
            what,
            input: input.to_owned(),
            expected,
        }
    }
}
