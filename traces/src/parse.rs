//! Reading traces: [`parse`], [`detect_format`], [`load`] / [`load_file`] and the five formats.
//!
//! Parsing never panics, whatever the input (checked by proptest and a cargo-fuzz target),
//! and never allocates more than a bounded multiple of the input size, except for the two
//! count series (node-count CSV, SkyPilot), whose expansion into events is capped at
//! [`MAX_SYNTH_EVENTS`].
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde_json::Value;

use crate::error::{ParseEnumError, TraceError};
use crate::faultlog::FaultLog;
use crate::trace::{NodeOp, Trace, TraceEvent};

/// Upper bound on the number of events a count series (node-count CSV or SkyPilot) may expand
/// into (sum of the absolute steps); in particular no count may exceed it. Real series have a
/// few thousand steps; the bound only stops corrupt or hostile input (`"data": [1e15]`,
/// `0,1000000000000`) from exhausting memory.
pub const MAX_SYNTH_EVENTS: u64 = 1_000_000;

/// The accepted file formats (F1, F2, F3, F5, F6: see the crate documentation).
///
/// # Node names of the count series (F3, F5)
///
/// The two count formats say only *how many* nodes are live, so [`parse`] names the nodes by
/// one rule, the same for both, which the simulator (`lzsim replay`) and the executor
/// (`lzrun local --fault-trace`) then both replay:
///
/// * counts are applied in file order, each step from the previous count (0 before the first)
///   to the new one at the new count's time;
/// * an increase by `k` adds `k` **fresh** names, `<prefix>0, <prefix>1, …` from one counter
///   (a name is never reused, not even after its node was removed);
/// * a decrease by `k` removes the `k` **most recently added** live nodes, newest first
///   (LIFO: the longest-lived nodes survive).
///
/// The prefix is `n` for [`TraceFormat::NodeCountCsv`] and `sky` for
/// [`TraceFormat::SkyPilot`]. Since `lzrun` numbers nodes in launch and join order, node
/// `n<k>` of a count CSV is the executor's node `k` (without `--window` / `--max-nodes`).
///
/// ```
/// use lazarus_traces::{TraceFormat, parse};
/// let t = parse("time_ms,live_nodes\n0,3\n60000,1\n120000,2\n", TraceFormat::NodeCountCsv)
///     .unwrap();
/// assert_eq!(
///     t.to_bamboo_csv(),
///     "0,add,n0\n0,add,n1\n0,add,n2\n60000,remove,n2\n60000,remove,n1\n120000,add,n3\n"
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceFormat {
    /// F1, Bamboo event CSV: one `time_ms,op,node` row per event, `op` is `add` or `remove`.
    ///
    /// * CRLF and LF line endings, blank lines, spaces around fields and a leading UTF-8 BOM
    ///   are tolerated.
    /// * **Header**: the *first non-blank line* is skipped as a header when it has three
    ///   fields and its first field does not start like a number (an ASCII digit, `+`, `-`
    ///   or `.`); e.g. `time_ms,op,node`. Any later such line, or a first line with a
    ///   different field count, is an error. A misspelt first row such as `x0,add,n1` is
    ///   therefore taken as a header: the format has no header marker to tell them apart.
    /// * `op` is exactly `add` or `remove` (case-sensitive, like every real file).
    /// * Times are non-negative integers of milliseconds written as plain digits (`+` sign
    ///   allowed); `-5` is [`TraceError::NegativeTime`], `1.5`, `5.0`, `1e3` and values
    ///   beyond `u64` are [`TraceError::Parse`].
    /// * Rows must be sorted by time; see [`Trace::new`] for the membership checks. All
    ///   errors carry the 1-based physical line number.
    BambooCsv,
    /// F2, JSON lines as written by Parcae and SpotServe: one `[time_ms, op, payload]` array
    /// per line.
    ///
    /// * `add` / `remove` need a payload object with a `"nodes"` array of strings; each name
    ///   is one event (all at the line's time, in list order). Other payload keys
    ///   (`duration`, `*_strategy`, SpotServe's `required_tpt` on `remove` lines) are
    ///   ignored.
    /// * `no-op`, `migration`, `other` lines are ignored (their time must still be a valid
    ///   non-negative integer; their payload is not looked at).
    /// * `DONE` ends the trace: the rest of the file is not read.
    /// * Any other op, a non-array line or invalid JSON is a [`TraceError::Parse`] with the
    ///   line number; blank lines are skipped; times are non-negative JSON integers (`6e4`
    ///   and `60000.0` are rejected); only `add`/`remove` events take part in the sort check.
    JsonLines,
    /// F3, node-count CSV: one `time_ms,live_nodes` row per change of the number of live nodes
    /// (the count-series shape some replayers ship the AWS P3 trace in, e.g. Parcae's
    /// `aws/traces/p3.csv`).
    ///
    /// * The same tolerance as [`TraceFormat::BambooCsv`]: CRLF and LF, blank lines, spaces
    ///   around fields, a leading UTF-8 BOM, and a header on the first non-blank line when it
    ///   has two fields and its first field does not start like a number (`time_ms,live_nodes`,
    ///   `time,nodes`).
    /// * Times: as in [`TraceFormat::BambooCsv`] (non-negative integer milliseconds), sorted
    ///   non-decreasingly; equal times are allowed and form one batch.
    /// * `live_nodes` is a non-negative integer (`+` sign allowed) of at most
    ///   [`MAX_SYNTH_EVENTS`]; `-1` (negative), `2.5` (non-integer) and larger values are
    ///   [`TraceError::Parse`] errors naming the line, and so is a row without exactly two
    ///   fields; an unsorted time is [`TraceError::Unsorted`] with the row's line.
    /// * Each row is one step from the previous count, expanded into events by the rule of the
    ///   [type documentation](TraceFormat#node-names-of-the-count-series-f3-f5) (names `n0, n1,
    ///   …`). Rows with equal times are applied in order within their batch (`0,5` then `0,4`
    ///   then `0,5` replaces node `n4` by `n5`); a row that repeats the count adds nothing.
    /// * **Before the first row no node is live**: the first row gives the initial count *at
    ///   its time*, so `480000,4` as the first row adds four nodes at 480 s, like a Bamboo trace
    ///   whose first event is later than 0 (replay it in `lzrun` with `--window`).
    /// * The expansion is capped at [`MAX_SYNTH_EVENTS`] events in all
    ///   ([`TraceError::TooLarge`]).
    NodeCountCsv,
    /// F5, SkyPilot count series:
    /// `{"metadata": {"gap_seconds": g}, "data": [n0, n1, ...], "prices": [...]}`.
    ///
    /// `data[i]` is the number of live nodes at time `i·g` seconds. It is converted into
    /// events on synthetic nodes named `sky0, sky1, …` by the rule of the
    /// [type documentation](TraceFormat#node-names-of-the-count-series-f3-f5), shared with
    /// [`TraceFormat::NodeCountCsv`]: at `i = 0` `n0` adds; at each later `i` the step
    /// `data[i] − data[i−1]` becomes that many adds of new names or removes of the **most
    /// recently added** live names (LIFO), all at time `i·g·1000` ms. `g` is a positive number of seconds, rounded to whole
    /// milliseconds (at least 1 ms); `data` entries are non-negative JSON integers; other
    /// keys are ignored. Schema errors are [`TraceError::Format`]; JSON syntax errors are
    /// [`TraceError::Parse`] with serde_json's line.
    SkyPilot,
    /// F6, a fault log (StepFun's InfiniteHBD JSON): one array of
    /// `{"node_id", "event_time" (days), "event_type": "fault_start" | "fault_end",
    /// "fault_type": {"Level", "Class", "Desc"}}` entries. [`parse`] gives the trace of the
    /// log's own nodes (each live at 0, down from its first open fault to the end of its last);
    /// [`load_file`] keeps the [`FaultLog`] with the fault classes and the cluster size to
    /// come ([`FaultLog::trace_on`]). Rules and errors: [`crate::faultlog`].
    FaultLog,
}

impl TraceFormat {
    /// All formats.
    pub const ALL: [TraceFormat; 5] = [
        TraceFormat::BambooCsv,
        TraceFormat::JsonLines,
        TraceFormat::NodeCountCsv,
        TraceFormat::SkyPilot,
        TraceFormat::FaultLog,
    ];

    /// Short name: `csv`, `jsonl`, `counts`, `skypilot`, `fault-log`.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceFormat::BambooCsv => "csv",
            TraceFormat::JsonLines => "jsonl",
            TraceFormat::NodeCountCsv => "counts",
            TraceFormat::SkyPilot => "skypilot",
            TraceFormat::FaultLog => "fault-log",
        }
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TraceFormat {
    type Err = ParseEnumError;

    /// `csv` / `bamboo`, `jsonl` / `json-lines`, `counts` / `node-counts`, `skypilot`,
    /// `fault-log` / `infinitehbd` (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "csv" | "bamboo" | "bamboo-csv" => Ok(TraceFormat::BambooCsv),
            "jsonl" | "json-lines" | "jsonlines" => Ok(TraceFormat::JsonLines),
            "counts" | "node-counts" | "node-count-csv" => Ok(TraceFormat::NodeCountCsv),
            "skypilot" => Ok(TraceFormat::SkyPilot),
            "fault-log" | "faultlog" | "infinitehbd" | "hbd" => Ok(TraceFormat::FaultLog),
            _ => Err(ParseEnumError::new(
                "trace format",
                s,
                "'csv', 'jsonl', 'counts', 'skypilot' or 'fault-log'",
            )),
        }
    }
}

/// Guesses the format from the content: the first non-whitespace character (after an optional
/// UTF-8 BOM) `{` means SkyPilot; `[` followed (after whitespace) by `{` or `]` is a fault log
/// (a JSON array of objects), any other `[` JSON lines; otherwise the first non-blank line decides
/// between the two CSV formats: a node-count CSV when it has exactly two comma-separated
/// fields and either its first field does not start like a number (a header such as
/// `time_ms,live_nodes`) or its second does (a row such as `0,18`), else Bamboo CSV.
///
/// Decisions: every `{` document is taken as SkyPilot, whether or not it contains `"data"`,
/// so that a broken SkyPilot file gets a SkyPilot error ("missing `data`") instead of a
/// meaningless CSV field-count error; no other format starts with `{`. A two-field first row
/// whose second field is not a number (`0,add`) stays a Bamboo CSV, whose error (`expected 3
/// comma-separated fields`) is the helpful one there.
///
/// ```
/// use lazarus_traces::{TraceFormat, detect_format};
/// assert_eq!(detect_format("time,nodes\r\n0,18\r\n"), TraceFormat::NodeCountCsv);
/// assert_eq!(detect_format("\n0, 18\n"), TraceFormat::NodeCountCsv);
/// assert_eq!(detect_format("0,add,n1\n"), TraceFormat::BambooCsv);
/// assert_eq!(detect_format("0,add\n"), TraceFormat::BambooCsv);
/// assert_eq!(detect_format("[\n  {\"node_id\": \"a\""), TraceFormat::FaultLog);
/// assert_eq!(detect_format("[0, \"add\", {\"nodes\": [\"a\"]}]"), TraceFormat::JsonLines);
/// ```
pub fn detect_format(text: &str) -> TraceFormat {
    let text = strip_bom(text);
    match text.trim_start().chars().next() {
        Some('{') => TraceFormat::SkyPilot,
        Some('[') => match text.trim_start()[1..].trim_start().chars().next() {
            Some('{' | ']') => TraceFormat::FaultLog,
            _ => TraceFormat::JsonLines,
        },
        _ => match numbered_lines(text).next() {
            Some((_, first)) if looks_like_counts_row(first) => TraceFormat::NodeCountCsv,
            _ => TraceFormat::BambooCsv,
        },
    }
}

/// Whether a (trimmed, non-blank) first line reads as the start of a node-count CSV.
fn looks_like_counts_row(line: &str) -> bool {
    let mut fields = line.split(',').map(str::trim);
    let (Some(time), Some(count), None) = (fields.next(), fields.next(), fields.next()) else {
        return false;
    };
    looks_like_header(time) || starts_like_number(count)
}

/// Parses `text` in the given format into a validated [`Trace`]; see [`TraceFormat`] for the
/// rules of each format. Input without any `add`/`remove` event is [`TraceError::Empty`].
///
/// ```
/// use lazarus_traces::{TraceError, TraceFormat, parse};
/// let t = parse("time_ms,op,node\r\n0,add,n1\r\n\r\n60000, remove , n1\r\n", TraceFormat::BambooCsv)
///     .unwrap();
/// assert_eq!((t.adds(), t.removals(), t.duration_ms()), (1, 1, 60000));
/// let err = parse("0,add,n1\n5,kill,n1\n", TraceFormat::BambooCsv).unwrap_err();
/// assert_eq!(err.to_string(), "line 2: unknown op 'kill' (expected 'add' or 'remove')");
/// ```
pub fn parse(text: &str, format: TraceFormat) -> Result<Trace, TraceError> {
    let text = strip_bom(text);
    match format {
        TraceFormat::BambooCsv => parse_csv(text),
        TraceFormat::JsonLines => parse_json_lines(text),
        TraceFormat::NodeCountCsv => parse_counts_csv(text),
        TraceFormat::SkyPilot => parse_skypilot(text),
        TraceFormat::FaultLog => Ok(FaultLog::parse(text)?.trace()),
    }
}

/// Reads the file at `path`, [detects its format](detect_format) and [parses](parse) it.
/// Every error names the file: [`TraceError::Io`] when it cannot be read (or is not UTF-8),
/// [`TraceError::InFile`] wrapping the parse error otherwise; either displays as the path and
/// carries the cause as its [`source`](std::error::Error::source).
///
/// A fault log (F6) becomes the trace of its own nodes ([`FaultLog::trace`]); [`load_file`]
/// keeps the log itself.
pub fn load(path: &Path) -> Result<Trace, TraceError> {
    Ok(match load_file(path)? {
        TraceFile::Trace(t) => t,
        TraceFile::FaultLog(log) => log.trace(),
    })
}

/// What [`load_file`] read: a node trace, or a fault log, which keeps its fault classes and
/// becomes a trace once the cluster size is known ([`FaultLog::trace_on`]).
#[derive(Debug, Clone)]
pub enum TraceFile {
    /// Formats F1–F5.
    Trace(Trace),
    /// F6, a fault log.
    FaultLog(FaultLog),
}

/// [`load`], keeping a fault log as a [`FaultLog`]. The same errors as [`load`].
pub fn load_file(path: &Path) -> Result<TraceFile, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let parsed = match detect_format(&text) {
        TraceFormat::FaultLog => FaultLog::parse(strip_bom(&text)).map(TraceFile::FaultLog),
        format => parse(&text, format).map(TraceFile::Trace),
    };
    parsed.map_err(|e| TraceError::InFile {
        path: path.to_path_buf(),
        source: Box::new(e),
    })
}

fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// Physical lines with 1-based numbers, trimmed (drops `\r` and surrounding spaces), blank
/// lines skipped.
fn numbered_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty())
}

fn parse_err(line: usize, msg: impl Into<String>) -> TraceError {
    TraceError::Parse {
        line,
        msg: msg.into(),
    }
}

/// A first field that does not start like a number (the CSV formats' header test).
fn looks_like_header(first_field: &str) -> bool {
    first_field
        .chars()
        .next()
        .is_some_and(|c| !starts_number(c))
}

fn starts_like_number(field: &str) -> bool {
    field.chars().next().is_some_and(starts_number)
}

fn starts_number(c: char) -> bool {
    c.is_ascii_digit() || matches!(c, '+' | '-' | '.')
}

fn parse_csv(text: &str) -> Result<Trace, TraceError> {
    let mut events = Vec::new();
    for (k, (line, row)) in numbered_lines(text).enumerate() {
        let fields: Vec<&str> = row.split(',').map(str::trim).collect();
        if k == 0 && fields.len() == 3 && looks_like_header(fields[0]) {
            continue;
        }
        if fields.len() != 3 {
            return Err(parse_err(
                line,
                format!(
                    "expected 3 comma-separated fields `time_ms,op,node`, found {}",
                    fields.len()
                ),
            ));
        }
        let time_ms = parse_csv_time(fields[0], line)?;
        let op: NodeOp = fields[1].parse().map_err(|_| {
            parse_err(
                line,
                format!("unknown op '{}' (expected 'add' or 'remove')", fields[1]),
            )
        })?;
        events.push((line, TraceEvent::new(time_ms, op, fields[2])));
    }
    Trace::from_lined(events)
}

fn parse_csv_time(s: &str, line: usize) -> Result<u64, TraceError> {
    if let Ok(t) = s.parse::<u64>() {
        return Ok(t);
    }
    let numeric = s.parse::<f64>().is_ok_and(f64::is_finite);
    if numeric && s.starts_with('-') {
        return Err(TraceError::NegativeTime { line });
    }
    let msg = if numeric
        && s.trim_start_matches('+')
            .bytes()
            .all(|b| b.is_ascii_digit())
    {
        format!("time '{s}' is out of range")
    } else if numeric {
        format!("non-integer time '{s}' (expected whole milliseconds)")
    } else {
        format!("invalid time '{s}' (expected a non-negative integer number of milliseconds)")
    };
    Err(parse_err(line, msg))
}

/// A `live_nodes` field: a non-negative integer of at most [`MAX_SYNTH_EVENTS`].
fn parse_count(s: &str, line: usize) -> Result<u64, TraceError> {
    let msg = match s.parse::<u64>() {
        Ok(c) if c <= MAX_SYNTH_EVENTS => return Ok(c),
        Ok(_) => format!("count '{s}' is out of range (at most {MAX_SYNTH_EVENTS} live nodes)"),
        Err(_) => {
            let numeric = s.parse::<f64>().is_ok_and(f64::is_finite);
            let integer = s
                .trim_start_matches(['+', '-'])
                .bytes()
                .all(|b| b.is_ascii_digit());
            if numeric && s.starts_with('-') {
                format!("negative count '{s}' (expected a number of live nodes, >= 0)")
            } else if numeric && integer {
                format!("count '{s}' is out of range (at most {MAX_SYNTH_EVENTS} live nodes)")
            } else if numeric {
                format!("non-integer count '{s}' (expected a whole number of live nodes)")
            } else {
                format!(
                    "invalid count '{s}' (expected a non-negative integer number of live nodes)"
                )
            }
        }
    };
    Err(parse_err(line, msg))
}

fn parse_counts_csv(text: &str) -> Result<Trace, TraceError> {
    let mut steps: Vec<CountStep> = Vec::new();
    for (k, (line, row)) in numbered_lines(text).enumerate() {
        let fields: Vec<&str> = row.split(',').map(str::trim).collect();
        if k == 0 && fields.len() == 2 && looks_like_header(fields[0]) {
            continue;
        }
        if fields.len() != 2 {
            return Err(parse_err(
                line,
                format!(
                    "expected 2 comma-separated fields `time_ms,live_nodes`, found {}",
                    fields.len()
                ),
            ));
        }
        let time_ms = parse_csv_time(fields[0], line)?;
        if let Some(previous) = steps.last()
            && time_ms < previous.time_ms
        {
            return Err(TraceError::Unsorted {
                line,
                time_ms,
                previous_ms: previous.time_ms,
            });
        }
        let count = parse_count(fields[1], line)?;
        steps.push(CountStep {
            line,
            time_ms,
            count,
        });
    }
    expand_counts(&steps, "n")
}

/// One entry of a count series: `count` nodes live from `time_ms` on; `line` is what errors
/// name.
struct CountStep {
    line: usize,
    time_ms: u64,
    count: u64,
}

/// The one expansion of a count series (node-count CSV, SkyPilot) into events, by the rule
/// documented on [`TraceFormat`]: from 0 live nodes, each step adds fresh names
/// `{prefix}0, {prefix}1, …` (never reused) or removes the most recently added live nodes,
/// newest first, at the step's time. `steps` must be sorted by time. Rejects an expansion of
/// more than [`MAX_SYNTH_EVENTS`] events before allocating it.
fn expand_counts(steps: &[CountStep], prefix: &str) -> Result<Trace, TraceError> {
    let mut total: u64 = 0;
    let mut prev = 0u64;
    for s in steps {
        total = total.saturating_add(s.count.abs_diff(prev));
        prev = s.count;
    }
    if total > MAX_SYNTH_EVENTS {
        return Err(TraceError::TooLarge {
            events: total,
            limit: MAX_SYNTH_EVENTS,
        });
    }
    let mut events = Vec::with_capacity(total as usize);
    let mut live: Vec<String> = Vec::new();
    let mut next = 0u64;
    for s in steps {
        let c = s.count as usize; // <= total <= MAX_SYNTH_EVENTS
        while live.len() < c {
            let name = format!("{prefix}{next}");
            next += 1;
            events.push((s.line, TraceEvent::add(s.time_ms, name.clone())));
            live.push(name);
        }
        while live.len() > c {
            let name = live.pop().expect("live.len() > c >= 0");
            events.push((s.line, TraceEvent::remove(s.time_ms, name)));
        }
    }
    Trace::from_lined(events)
}

fn parse_json_time(v: &Value, line: usize) -> Result<u64, TraceError> {
    if let Some(t) = v.as_u64() {
        return Ok(t);
    }
    match v.as_f64() {
        Some(f) if f < 0.0 => Err(TraceError::NegativeTime { line }),
        Some(_) => Err(parse_err(
            line,
            format!("time {v} is not an integer number of milliseconds (or out of range)"),
        )),
        None => Err(parse_err(
            line,
            format!("time {v} is not a number (expected milliseconds)"),
        )),
    }
}

fn parse_json_lines(text: &str) -> Result<Trace, TraceError> {
    let mut events = Vec::new();
    for (line, row) in numbered_lines(text) {
        let value: Value =
            serde_json::from_str(row).map_err(|e| parse_err(line, format!("invalid JSON: {e}")))?;
        let Some(arr) = value.as_array().filter(|a| a.len() >= 2) else {
            return Err(parse_err(
                line,
                "expected a JSON array `[time_ms, op, {\"nodes\": [...]}]`",
            ));
        };
        let time_ms = parse_json_time(&arr[0], line)?;
        let Some(op) = arr[1].as_str() else {
            return Err(parse_err(line, format!("op {} is not a string", arr[1])));
        };
        let op = match op {
            "add" => NodeOp::Add,
            "remove" => NodeOp::Remove,
            "no-op" | "migration" | "other" => continue,
            "DONE" => break,
            other => {
                return Err(parse_err(
                    line,
                    format!(
                        "unknown op '{other}' (expected add, remove, no-op, migration, other \
                         or DONE)"
                    ),
                ));
            }
        };
        let Some(nodes) = arr
            .get(2)
            .and_then(Value::as_object)
            .and_then(|p| p.get("nodes"))
            .and_then(Value::as_array)
        else {
            return Err(parse_err(
                line,
                format!("'{op}' needs a payload object with a \"nodes\" array"),
            ));
        };
        for n in nodes {
            let Some(name) = n.as_str() else {
                return Err(parse_err(line, format!("node {n} is not a string")));
            };
            events.push((line, TraceEvent::new(time_ms, op, name)));
        }
    }
    Trace::from_lined(events)
}

fn format_err(msg: impl Into<String>) -> TraceError {
    TraceError::Format { msg: msg.into() }
}

fn parse_skypilot(text: &str) -> Result<Trace, TraceError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| parse_err(e.line().max(1), format!("invalid JSON: {e}")))?;
    let Some(obj) = value.as_object() else {
        return Err(format_err(
            "SkyPilot trace must be a JSON object with \"metadata\" and \"data\"",
        ));
    };
    let gap_s = obj
        .get("metadata")
        .and_then(|m| m.get("gap_seconds"))
        .ok_or_else(|| format_err("SkyPilot trace has no metadata.gap_seconds"))?;
    let gap_ms = match gap_s.as_f64().map(|g| (g * 1000.0).round()) {
        Some(g) if (1.0..1.8e19).contains(&g) => g as u64,
        Some(g) if g >= 1.8e19 => {
            return Err(format_err(format!(
                "metadata.gap_seconds = {gap_s} is too large"
            )));
        }
        _ => {
            return Err(format_err(format!(
                "metadata.gap_seconds = {gap_s} is not a positive number of seconds (>= 0.001)"
            )));
        }
    };
    let data = obj
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| format_err("SkyPilot trace has no \"data\" array"))?;
    let counts = data
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .ok_or_else(|| format_err(format!("data[{i}] = {v} is not a non-negative integer")))
        })
        .collect::<Result<Vec<u64>, _>>()?;
    let steps = counts
        .iter()
        .enumerate()
        .map(|(i, &count)| {
            let time_ms = (i as u64).checked_mul(gap_ms).ok_or_else(|| {
                format_err(format!("time of data[{i}] overflows u64 milliseconds"))
            })?;
            Ok(CountStep {
                line: i + 1,
                time_ms,
                count,
            })
        })
        .collect::<Result<Vec<_>, TraceError>>()?;
    expand_counts(&steps, "sky")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_formats() {
        assert_eq!(detect_format("0,add,a"), TraceFormat::BambooCsv);
        assert_eq!(detect_format(""), TraceFormat::BambooCsv);
        assert_eq!(
            detect_format("\u{feff}  \n[0, \"add\""),
            TraceFormat::JsonLines
        );
        assert_eq!(detect_format(" {\"data\": []}"), TraceFormat::SkyPilot);
        assert_eq!(detect_format("{}"), TraceFormat::SkyPilot);
        assert_eq!(detect_format("\u{feff} [ ]"), TraceFormat::FaultLog);
        assert_eq!(detect_format("[\r\n\t{}]"), TraceFormat::FaultLog);
        assert_eq!(detect_format("["), TraceFormat::JsonLines);
        for counts in [
            "0,3\n",
            "\u{feff}\r\n time_ms , live_nodes \r\n0,3\r\n",
            "time,nodes\n",
            "x,y",
            "5, +2",
            "-5,-2",
        ] {
            assert_eq!(
                detect_format(counts),
                TraceFormat::NodeCountCsv,
                "{counts:?}"
            );
        }
        for bamboo in ["0,add", "0,add,a", "0", "0,3,a\n0,3", ",\n0,3", "\n\n0,,\n"] {
            assert_eq!(detect_format(bamboo), TraceFormat::BambooCsv, "{bamboo:?}");
        }
    }

    #[test]
    fn format_names_round_trip() {
        for f in TraceFormat::ALL {
            assert_eq!(f.to_string().parse::<TraceFormat>(), Ok(f));
        }
        assert!("xml".parse::<TraceFormat>().is_err());
        assert_eq!("Node-Counts".parse(), Ok(TraceFormat::NodeCountCsv));
        assert!(
            "xml"
                .parse::<TraceFormat>()
                .unwrap_err()
                .to_string()
                .contains("'counts'")
        );
    }

    #[test]
    fn csv_times() {
        assert_eq!(parse_csv_time("+7", 1).unwrap(), 7);
        assert!(matches!(
            parse_csv_time("-7", 3),
            Err(TraceError::NegativeTime { line: 3 })
        ));
        for (s, want) in [
            ("1.5", "non-integer time '1.5'"),
            ("5.0", "non-integer time '5.0'"),
            ("1e3", "non-integer time '1e3'"),
            (
                "99999999999999999999",
                "time '99999999999999999999' is out of range",
            ),
            ("abc", "invalid time 'abc'"),
            ("", "invalid time ''"),
            ("inf", "invalid time 'inf'"),
            ("-inf", "invalid time '-inf'"),
        ] {
            let e = parse_csv_time(s, 9).unwrap_err().to_string();
            assert!(e.starts_with(&format!("line 9: {want}")), "{s}: {e}");
        }
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("+7", 1).unwrap(), 7);
        assert_eq!(parse_count("0", 1).unwrap(), 0);
        assert_eq!(parse_count("1000000", 1).unwrap(), MAX_SYNTH_EVENTS);
        for (s, want) in [
            ("-1", "negative count '-1'"),
            ("-0", "negative count '-0'"),
            ("-1.5", "negative count '-1.5'"),
            ("2.5", "non-integer count '2.5'"),
            ("3.0", "non-integer count '3.0'"),
            ("1e3", "non-integer count '1e3'"),
            (
                "1000001",
                "count '1000001' is out of range (at most 1000000 live nodes)",
            ),
            (
                "99999999999999999999",
                "count '99999999999999999999' is out of range",
            ),
            ("abc", "invalid count 'abc'"),
            ("", "invalid count ''"),
            ("inf", "invalid count 'inf'"),
            ("0x10", "invalid count '0x10'"),
        ] {
            let e = parse_count(s, 4).unwrap_err().to_string();
            assert!(e.starts_with(&format!("line 4: {want}")), "{s}: {e}");
        }
    }

    /// The SkyPilot and node-count parsers share one expansion: the same series gives the same
    /// events up to the name prefix.
    #[test]
    fn both_count_formats_expand_alike() {
        let sky = parse(
            r#"{"metadata": {"gap_seconds": 60}, "data": [3, 1, 1, 2, 0, 4]}"#,
            TraceFormat::SkyPilot,
        )
        .unwrap();
        let csv = parse(
            "0,3\n60000,1\n120000,1\n180000,2\n240000,0\n300000,4\n",
            TraceFormat::NodeCountCsv,
        )
        .unwrap();
        assert_eq!(sky.to_bamboo_csv().replace("sky", "n"), csv.to_bamboo_csv());
    }
}
