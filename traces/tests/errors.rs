//! Every rejection, with its exact 1-based line number and message.
use std::path::Path;

use lazarus_traces::{TraceError, TraceFormat, load, parse};

fn csv_err(text: &str) -> TraceError {
    parse(text, TraceFormat::BambooCsv).unwrap_err()
}

fn jsonl_err(text: &str) -> TraceError {
    parse(text, TraceFormat::JsonLines).unwrap_err()
}

fn counts_err(text: &str) -> TraceError {
    parse(text, TraceFormat::NodeCountCsv).unwrap_err()
}

fn sky_err(text: &str) -> TraceError {
    parse(text, TraceFormat::SkyPilot).unwrap_err()
}

#[test]
fn csv_unsorted_times() {
    let e = csv_err("0,add,a\n0,add,b\n\n100,remove,a\n50,remove,b\n");
    assert!(
        matches!(
            e,
            TraceError::Unsorted {
                line: 5,
                time_ms: 50,
                previous_ms: 100
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "line 5: time 50 ms is earlier than the previous event's 100 ms (events must be sorted \
         by time)"
    );
}

#[test]
fn csv_unknown_op() {
    let e = csv_err("0,add,a\r\n\r\n\r\n\r\n\r\n\r\n60000,kill,a\r\n");
    assert!(matches!(&e, TraceError::Parse { line: 7, .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "line 7: unknown op 'kill' (expected 'add' or 'remove')"
    );
    // ops are case-sensitive
    assert!(matches!(
        csv_err("0,ADD,a\n"),
        TraceError::Parse { line: 1, .. }
    ));
}

#[test]
fn csv_removal_of_unknown_or_dead_node() {
    let e = csv_err("0,add,a\n10,remove,b\n");
    assert!(
        matches!(&e, TraceError::UnknownNode { line: 2, node } if node == "b"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "line 2: remove of node 'b', which is not live (never added, or already removed)"
    );
    let e = csv_err("0,add,a\n10,remove,a\n20,remove,a\n");
    assert!(
        matches!(&e, TraceError::UnknownNode { line: 3, .. }),
        "{e:?}"
    );
}

#[test]
fn csv_re_add_of_live_node() {
    let e = csv_err("time_ms,op,node\n0,add,a\n0,add,b\n5,add,a\n");
    assert!(
        matches!(&e, TraceError::DuplicateAdd { line: 4, node } if node == "a"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "line 4: add of node 'a', which is already live"
    );
    // a re-add after removal is a new lifetime: fine
    parse("0,add,a\n5,remove,a\n9,add,a\n", TraceFormat::BambooCsv).unwrap();
}

#[test]
fn csv_negative_and_non_integer_times() {
    let e = csv_err("0,add,a\n-5,remove,a\n");
    assert!(matches!(e, TraceError::NegativeTime { line: 2 }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "line 2: negative time (times are milliseconds since the trace start, >= 0)"
    );
    let e = csv_err("0,add,a\n\n1.5,remove,a\n");
    assert_eq!(
        e.to_string(),
        "line 3: non-integer time '1.5' (expected whole milliseconds)"
    );
    let e = csv_err("0,add,a\n1x,remove,a\n");
    assert_eq!(
        e.to_string(),
        "line 2: invalid time '1x' (expected a non-negative integer number of milliseconds)"
    );
}

#[test]
fn csv_wrong_field_count() {
    let e = csv_err("0,add,a\n5,remove\n");
    assert!(matches!(&e, TraceError::Parse { line: 2, .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "line 2: expected 3 comma-separated fields `time_ms,op,node`, found 2"
    );
    assert!(matches!(
        csv_err("0,add,a,extra\n"),
        TraceError::Parse { line: 1, .. }
    ));
    // An empty node field is an invalid name.
    assert!(matches!(
        csv_err("0,add,a\n1,add, \n"),
        TraceError::InvalidNode { line: 2, .. }
    ));
}

#[test]
fn csv_header_only_on_the_first_non_blank_line() {
    parse("\n\ntime_ms,op,node\n0,add,a\n", TraceFormat::BambooCsv).unwrap();
    parse("time,event,instance\n0,add,a\n", TraceFormat::BambooCsv).unwrap();
    let e = csv_err("0,add,a\ntime_ms,op,node\n");
    assert_eq!(
        e.to_string(),
        "line 2: invalid time 'time_ms' (expected a non-negative integer number of milliseconds)"
    );
    // a header-like first line with the wrong field count is an error, not a header
    assert!(matches!(
        csv_err("time_ms;op;node\n0,add,a\n"),
        TraceError::Parse { line: 1, .. }
    ));
}

#[test]
fn empty_inputs() {
    for text in ["", "\n\r\n  \n", "time_ms,op,node\n", "\u{feff}"] {
        assert!(matches!(csv_err(text), TraceError::Empty), "{text:?}");
    }
    assert!(matches!(jsonl_err(""), TraceError::Empty));
    assert!(matches!(
        jsonl_err("[0, \"no-op\", {\"nodes\": []}]\n[1, \"DONE\", {}]\n"),
        TraceError::Empty
    ));
    assert!(matches!(
        sky_err(r#"{"metadata": {"gap_seconds": 60}, "data": [0, 0]}"#),
        TraceError::Empty
    ));
}

#[test]
fn json_lines_rejections() {
    let ok = "[0, \"add\", {\"nodes\": [\"a\", \"b\"]}]\n";
    let cases: &[(&str, usize, &str)] = &[
        (
            "[60000, \"kill\", {\"nodes\": [\"a\"]}]",
            2,
            "unknown op 'kill'",
        ),
        (
            "[60000, \"remove\", {\"nodes\": [\"c\"]}]",
            2,
            "remove of node 'c'",
        ),
        (
            "[60000, \"add\", {\"nodes\": [\"a\"]}]",
            2,
            "add of node 'a', which is already live",
        ),
        (
            "[60000, \"remove\", {\"nodes\": [\"a\", \"a\"]}]",
            2,
            "remove of node 'a'",
        ),
        (
            "[60000, \"add\", {\"nodes\": [\"c\", \"c\"]}]",
            2,
            "add of node 'c'",
        ),
        (
            "[60000, \"remove\", {}]",
            2,
            "'remove' needs a payload object",
        ),
        ("[60000, \"remove\"]", 2, "'remove' needs a payload object"),
        (
            "[60000, \"add\", {\"nodes\": [1]}]",
            2,
            "node 1 is not a string",
        ),
        ("[60000, 3, {\"nodes\": []}]", 2, "op 3 is not a string"),
        ("[60000]", 2, "expected a JSON array"),
        ("{\"t\": 1}", 2, "expected a JSON array"),
        ("[60000, \"add\", {\"nodes\": [\"c\"]}", 2, "invalid JSON"),
        ("[-1, \"add\", {\"nodes\": [\"c\"]}]", 2, "negative time"),
        (
            "[6e4, \"add\", {\"nodes\": [\"c\"]}]",
            2,
            "time 60000.0 is not an integer",
        ),
        (
            "[\"0\", \"add\", {\"nodes\": [\"c\"]}]",
            2,
            "time \"0\" is not a number",
        ),
        (
            "[60000, \"add\", {\"nodes\": [\"c,d\"]}]",
            2,
            "invalid node name \"c,d\"",
        ),
    ];
    for &(line2, line, want) in cases {
        let e = jsonl_err(&format!("{ok}{line2}\n"));
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("line {line}: {want}")),
            "{line2}: {msg}"
        );
    }
    // unsorted membership events, with blank lines counted
    let e = jsonl_err(&format!(
        "{ok}\n[50, \"remove\", {{\"nodes\": [\"a\"]}}]\n[40, \"remove\", {{\"nodes\": [\"b\"]}}]\n"
    ));
    assert!(
        matches!(
            e,
            TraceError::Unsorted {
                line: 4,
                time_ms: 40,
                previous_ms: 50
            }
        ),
        "{e:?}"
    );
    // ignored ops still need a valid time
    let e = jsonl_err(&format!("{ok}[-3, \"no-op\", {{}}]\n"));
    assert!(matches!(e, TraceError::NegativeTime { line: 2 }), "{e:?}");
}

#[test]
fn skypilot_rejections() {
    let cases: &[(&str, &str)] = &[
        ("[1, 2]", "SkyPilot trace must be a JSON object"),
        (
            r#"{"metadata": {"gap_seconds": 1e17}, "data": [1]}"#,
            "metadata.gap_seconds = 1e+17 is too large",
        ),
        (
            r#"{"data": [1]}"#,
            "SkyPilot trace has no metadata.gap_seconds",
        ),
        (
            r#"{"metadata": {"gap_seconds": 0}, "data": [1]}"#,
            "metadata.gap_seconds = 0 is not",
        ),
        (
            r#"{"metadata": {"gap_seconds": -5}, "data": [1]}"#,
            "metadata.gap_seconds = -5 is not",
        ),
        (
            r#"{"metadata": {"gap_seconds": "60"}, "data": [1]}"#,
            "metadata.gap_seconds = \"60\"",
        ),
        (
            r#"{"metadata": {"gap_seconds": 60}}"#,
            "SkyPilot trace has no \"data\" array",
        ),
        (
            r#"{"metadata": {"gap_seconds": 60}, "data": [1, -1]}"#,
            "data[1] = -1 is not",
        ),
        (
            r#"{"metadata": {"gap_seconds": 60}, "data": [1, 0.5]}"#,
            "data[1] = 0.5 is not",
        ),
        (
            r#"{"metadata": {"gap_seconds": 60}, "data": [1000000000000]}"#,
            "the count series would expand into 1000000000000 events (limit 1000000)",
        ),
        (
            r#"{"metadata": {"gap_seconds": 1e15}, "data": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2]}"#,
            "time of data[19] overflows",
        ),
    ];
    for &(text, want) in cases {
        let msg = sky_err(text).to_string();
        assert!(msg.starts_with(want), "{text}: {msg}");
    }
    let e = sky_err("{\n  \"metadata\": {\"gap_seconds\": 60},\n  \"data\": [1, 2,]\n}");
    assert!(matches!(&e, TraceError::Parse { line: 3, .. }), "{e:?}");
}

/// Every bad row of a node-count CSV (`time_ms,live_nodes`), with its 1-based physical line
/// (the BOM, the header and blank lines count).
#[test]
fn node_count_csv_rejections() {
    let ok = "\u{feff}time_ms,live_nodes\r\n0,4\r\n\r\n";
    let cases: &[(&str, &str)] = &[
        (
            "-5,3",
            "negative time (times are milliseconds since the trace start, >= 0)",
        ),
        (
            "1.5,3",
            "non-integer time '1.5' (expected whole milliseconds)",
        ),
        (
            "1e3,3",
            "non-integer time '1e3' (expected whole milliseconds)",
        ),
        (
            "x,3",
            "invalid time 'x' (expected a non-negative integer number of milliseconds)",
        ),
        (
            "99999999999999999999,3",
            "time '99999999999999999999' is out of range",
        ),
        (
            "60000,-1",
            "negative count '-1' (expected a number of live nodes, >= 0)",
        ),
        (
            "60000,2.5",
            "non-integer count '2.5' (expected a whole number of live nodes)",
        ),
        (
            "60000,three",
            "invalid count 'three' (expected a non-negative integer number of live nodes)",
        ),
        (
            "60000,",
            "invalid count '' (expected a non-negative integer number of live nodes)",
        ),
        (
            "60000,1000001",
            "count '1000001' is out of range (at most 1000000 live nodes)",
        ),
        (
            "60000,18446744073709551616",
            "count '18446744073709551616' is out of range (at most 1000000 live nodes)",
        ),
        (
            "60000",
            "expected 2 comma-separated fields `time_ms,live_nodes`, found 1",
        ),
        (
            "60000,3,n1",
            "expected 2 comma-separated fields `time_ms,live_nodes`, found 3",
        ),
        (
            "time_ms,live_nodes",
            "invalid time 'time_ms' (expected a non-negative integer number of milliseconds)",
        ),
    ];
    for &(row, want) in cases {
        let e = counts_err(&format!("{ok}{row}\r\n"));
        assert_eq!(e.to_string(), format!("line 4: {want}"), "{row}");
    }
    assert!(matches!(
        counts_err(&format!("{ok}-5,3\n")),
        TraceError::NegativeTime { line: 4 }
    ));

    // Unsorted times, even when the out-of-order row changes nothing.
    for row in ["50,4", "50,2"] {
        let e = counts_err(&format!("0,4\n100,4\n{row}\n"));
        assert!(
            matches!(
                e,
                TraceError::Unsorted {
                    line: 3,
                    time_ms: 50,
                    previous_ms: 100
                }
            ),
            "{row}: {e:?}"
        );
    }
    // Equal times are a batch, not an error.
    parse("0,4\n100,2\n100,3\n", TraceFormat::NodeCountCsv).unwrap();

    // A header-like first line with the wrong field count is an error, not a header.
    let e = counts_err("time_ms;live_nodes\n0,4\n");
    assert!(matches!(&e, TraceError::Parse { line: 1, .. }), "{e:?}");

    // Counts that are each in range but expand into too many events in all.
    let mut flapping = String::new();
    for i in 0..3 {
        flapping += &format!("{},1000000\n{},0\n", 2 * i, 2 * i + 1);
    }
    let e = counts_err(&flapping);
    assert!(
        matches!(
            e,
            TraceError::TooLarge {
                events: 6_000_000,
                limit: 1_000_000
            }
        ),
        "{e:?}"
    );

    // No node is ever live: empty, like an event CSV with only a header.
    for text in ["time_ms,live_nodes\n", "0,0\n60000,0\n", "\u{feff}\r\n"] {
        assert!(matches!(counts_err(text), TraceError::Empty), "{text:?}");
    }
}

/// The error and its causes, as `anyhow`'s `{:#}` prints them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

#[test]
fn load_errors_name_the_file() {
    let missing = Path::new("/nonexistent/dir/trace.csv");
    let e = load(missing).unwrap_err();
    assert!(matches!(e, TraceError::Io { .. }));
    let msg = chain(&e);
    assert!(msg.starts_with("/nonexistent/dir/trace.csv: "), "{msg}");
    // Each part once: the I/O error is the source, not also part of the display.
    let io = std::error::Error::source(&e)
        .expect("the I/O error")
        .to_string();
    assert_eq!(msg.matches(&io).count(), 1, "{msg}");

    let dir = std::env::temp_dir().join(format!("lazarus-traces-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "0,add,a\n5,kill,a\n").unwrap();
    let e = load(&bad).unwrap_err();
    assert_eq!(e.to_string(), bad.display().to_string());
    assert_eq!(
        chain(&e),
        format!(
            "{}: line 2: unknown op 'kill' (expected 'add' or 'remove')",
            bad.display()
        )
    );
    match &e {
        TraceError::InFile { path, source } => {
            assert_eq!(path, &bad);
            assert!(matches!(**source, TraceError::Parse { line: 2, .. }));
        }
        other => panic!("{other:?}"),
    }
    let not_utf8 = dir.join("bin.csv");
    std::fs::write(&not_utf8, [0xff, 0xfe, 0x00]).unwrap();
    let e = load(&not_utf8).unwrap_err();
    assert!(matches!(e, TraceError::Io { .. }), "{e:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
