//! Property tests: the parsers never panic on any input, and every operation that returns a
//! `Trace` keeps its invariants and its documented counting semantics.
use std::collections::BTreeSet;

use lazarus_traces::synth::{IntervalDist, fixed_interval, hazard};
use lazarus_traces::{
    FitMode, NodeOp, Trace, TraceError, TraceEvent, TraceFormat, detect_format, parse,
};
use proptest::prelude::*;

fn parse_all(text: &str) {
    for format in TraceFormat::ALL {
        if let Ok(t) = parse(text, format) {
            check_trace(&t);
        }
    }
    let _ = parse(text, detect_format(text));
}

/// Invariants every trace must satisfy, checked independently of the crate's own validation.
fn check_trace(t: &Trace) {
    // re-validation accepts exactly the same list
    if !t.is_empty() {
        assert_eq!(&Trace::new(t.events().to_vec()).unwrap(), t);
        // CSV round trip
        assert_eq!(
            &parse(&t.to_bamboo_csv(), TraceFormat::BambooCsv).unwrap(),
            t
        );
    }
    // sorted, adds before removes within a batch
    for w in t.events().windows(2) {
        assert!(w[0].time_ms <= w[1].time_ms);
        if w[0].time_ms == w[1].time_ms {
            assert!(w[0].op <= w[1].op);
        }
    }
}

fn check_sane_error(e: &TraceError) {
    // errors always render, and line numbers are 1-based
    let msg = e.to_string();
    assert!(!msg.is_empty());
    if let TraceError::Parse { line, .. }
    | TraceError::Unsorted { line, .. }
    | TraceError::UnknownNode { line, .. }
    | TraceError::DuplicateAdd { line, .. }
    | TraceError::NegativeTime { line }
    | TraceError::InvalidNode { line, .. } = e
    {
        assert!(*line >= 1, "{msg}");
    }
}

/// A random *valid* event list (in generation order, which may list removes before adds of
/// the same time stamp) over a small name pool so names get reused after removal.
fn valid_events() -> impl Strategy<Value = Vec<TraceEvent>> {
    prop::collection::vec((0u64..3, any::<bool>(), 0usize..16), 1..80).prop_map(|steps| {
        let mut live: Vec<String> = Vec::new();
        let mut events = Vec::new();
        let mut t = 0;
        // Names removed in the current batch may not be re-added in it (they would be added
        // before the remove takes effect).
        let mut removed_now: BTreeSet<String> = BTreeSet::new();
        for (gap, add, pick) in steps {
            if gap > 0 {
                removed_now.clear();
            }
            t += gap * 1000;
            if add || live.is_empty() {
                let name = format!("n{pick}");
                if live.contains(&name) || removed_now.contains(&name) {
                    continue;
                }
                live.push(name.clone());
                events.push(TraceEvent::add(t, name));
            } else {
                let name = live.remove(pick % live.len());
                removed_now.insert(name.clone());
                events.push(TraceEvent::remove(t, name));
            }
        }
        events
    })
}

/// Reference live count at `t` straight from the event list.
fn count_at(events: &[TraceEvent], t: u64) -> usize {
    let adds = events
        .iter()
        .filter(|e| e.time_ms <= t && e.op == NodeOp::Add)
        .count();
    adds - events
        .iter()
        .filter(|e| e.time_ms <= t && e.op == NodeOp::Remove)
        .count()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn parsers_never_panic_on_strings(s in any::<String>()) {
        parse_all(&s);
        for f in TraceFormat::ALL {
            if let Err(e) = parse(&s, f) {
                check_sane_error(&e);
            }
        }
    }

    #[test]
    fn parsers_never_panic_on_lossy_bytes(b in prop::collection::vec(any::<u8>(), 0..400)) {
        parse_all(&String::from_utf8_lossy(&b));
    }

    #[test]
    fn parsers_never_panic_on_csv_like_input(
        s in r"((time_ms,op,node|[-+0-9. e]{0,6}, ?(add|remove|kill|ADD)? ?,[ a-c,]{0,3})?\r?\n){0,12}"
    ) {
        parse_all(&s);
    }

    #[test]
    fn parsers_never_panic_on_node_count_like_input(
        s in "\u{feff}?((time_ms,live_nodes|[-+0-9. e]{0,6} ?, ?[-+0-9. ex]{0,5}(,[a-c])?)?\r?\n){0,12}"
    ) {
        parse_all(&s);
        if let Err(e) = parse(&s, TraceFormat::NodeCountCsv) {
            check_sane_error(&e);
        }
    }

    /// Any valid count series parses, expands to exactly its counts (the last row of each time
    /// stamp), and its event form is the same trace.
    #[test]
    fn node_count_series_expand_to_their_counts(
        rows in prop::collection::vec((0u64..3, 0u64..12), 1..40),
        header in any::<bool>(),
        crlf in any::<bool>(),
    ) {
        let mut text = String::from(if header { "time_ms,live_nodes\n" } else { "" });
        let mut t = 0;
        let mut want: Vec<(u64, usize)> = Vec::new();
        for &(gap, count) in &rows {
            t += gap * 1000;
            text += &format!("{t},{count}{}", if crlf { "\r\n" } else { "\n" });
            match want.last_mut() {
                Some(last) if last.0 == t => last.1 = count as usize,
                _ => want.push((t, count as usize)),
            }
        }
        prop_assert_eq!(detect_format(&text), TraceFormat::NodeCountCsv);
        match parse(&text, TraceFormat::NodeCountCsv) {
            Ok(trace) => {
                check_trace(&trace);
                for &(time, c) in &want {
                    prop_assert_eq!(trace.live_at(time), c, "t = {}", time);
                }
                prop_assert_eq!(
                    &parse(&trace.to_bamboo_csv(), TraceFormat::BambooCsv).unwrap(),
                    &trace
                );
            }
            Err(e) => {
                prop_assert!(matches!(e, TraceError::Empty), "{e:?}");
                prop_assert!(rows.iter().all(|&(_, c)| c == 0));
            }
        }
    }

    #[test]
    fn parsers_never_panic_on_json_lines_like_input(
        s in r#"(\[[-0-9.e]{0,4}, ?"(add|remove|no-op|migration|other|DONE|x)"(, ?\{"nodes": ?\[("[a-c]?",? ?){0,3}\]\})?\]?\n){0,10}"#
    ) {
        parse_all(&s);
    }

    #[test]
    fn parsers_never_panic_on_skypilot_like_input(
        s in r#"\{"metadata": ?\{"gap_seconds": ?[-0-9.e]{0,5}\}, ?"data": ?\[([-0-9.e]{0,4},? ?){0,8}\]\}"#
    ) {
        parse_all(&s);
    }

    #[test]
    fn valid_traces_round_trip_and_count(events in valid_events()) {
        let t = Trace::new(events.clone()).unwrap();
        check_trace(&t);
        // same multiset of events, reordered only within batches
        let mut a: Vec<_> = events.iter().map(|e| (e.time_ms, e.op, e.node.clone())).collect();
        let mut b: Vec<_> = t.events().iter().map(|e| (e.time_ms, e.op, e.node.clone())).collect();
        a.sort();
        b.sort();
        prop_assert_eq!(a, b);
        for &(time, c) in &t.live_steps() {
            prop_assert_eq!(c, count_at(&events, time));
            prop_assert_eq!(t.live_at(time), c);
            prop_assert_eq!(t.live_nodes_at(time).len(), c);
        }
        // JSON lines rendering parses to the same trace
        let jsonl: String = t
            .events()
            .iter()
            .map(|e| format!("[{}, \"{}\", {{\"nodes\": [\"{}\"]}}]\n", e.time_ms, e.op, e.node))
            .collect();
        prop_assert_eq!(&parse(&jsonl, TraceFormat::JsonLines).unwrap(), &t);
    }

    #[test]
    fn windows_preserve_counts(events in valid_events(), s in 0u64..60, len in 0u64..60) {
        let t = Trace::new(events).unwrap();
        let (start, end) = (s * 1000, (s + len) * 1000);
        let w = t.window(start, end);
        check_trace(&w);
        for x in start..end {
            prop_assert_eq!(w.live_at(x - start), t.live_at(x), "x = {}", x);
        }
        prop_assert!(w.events().iter().all(|e| e.time_ms < end - start || len == 0));
    }

    #[test]
    fn fit_respects_each_mode(events in valid_events(), max in 1usize..7) {
        let t = Trace::new(events).unwrap();
        let times: BTreeSet<u64> = t.events().iter().map(|e| e.time_ms).collect();
        let clamp = t.fit(max, FitMode::Clamp);
        for mode in FitMode::ALL {
            let f = t.fit(max, mode);
            check_trace(&f);
            prop_assert!(f.max_live() <= max);
            prop_assert!(f.events().iter().all(|e| times.contains(&e.time_ms)));
            if t.max_live() <= max {
                prop_assert_eq!(&f, &t);
            }
            for &time in &times {
                let c = t.live_at(time);
                let got = f.live_at(time);
                match mode {
                    FitMode::Clamp => prop_assert_eq!(got, c.min(max)),
                    FitMode::Track => prop_assert!(got <= clamp.live_at(time)),
                    FitMode::Scale => {
                        let ml = t.max_live().max(max);
                        let want = if c == 0 { 0 } else { ((2 * c * max + ml) / (2 * ml)).max(1) };
                        prop_assert_eq!(got, want);
                    }
                }
            }
            // When fitting is needed, Track and Scale never exceed the cap even in the middle
            // of a batch (an already-fitting trace is returned as is, mid-batch peaks included).
            if mode != FitMode::Clamp && t.max_live() > max {
                let mut live = 0usize;
                for e in f.events() {
                    if e.op == NodeOp::Add { live += 1 } else { live -= 1 }
                    prop_assert!(live <= max);
                }
            }
        }
        prop_assert!(t.fit(0, FitMode::Track).is_empty());
    }

    #[test]
    fn generators_produce_valid_traces(
        nodes in 0usize..40,
        until in 0usize..40,
        every in 0u64..100_000,
        shape in 0.2f64..5.0,
        seed in any::<u64>(),
    ) {
        for d in [IntervalDist::Fixed, IntervalDist::Exp, IntervalDist::Weibull { shape }] {
            let t = fixed_interval(nodes, every, d, until, seed);
            check_trace(&t);
            prop_assert_eq!(t.adds(), nodes);
            prop_assert_eq!(t.removals(), nodes.saturating_sub(until));
        }
        let h = hazard(nodes, 2.0, 3.0, 600_000, 10_000, until, seed);
        check_trace(&h);
        let mut live = 0usize;
        for e in h.events() {
            if e.op == NodeOp::Add { live += 1 } else { live -= 1 }
            prop_assert!(live <= nodes.max(until));
        }
    }
}

/// A fault-log-like JSON array: entries on a small pool of nodes and classes, with times that
/// mostly go forward, some event types unknown and some fields missing.
fn fault_log_text() -> impl Strategy<Value = String> {
    let entry = (0usize..4, 0u32..3, 0u8..10, 0usize..2, 0u8..20);
    prop::collection::vec(entry, 0..40).prop_map(|entries| {
        let mut t = 0.0f64;
        let items: Vec<String> = entries
            .into_iter()
            .map(|(node, step, kind, class, with_type)| {
                t += f64::from(step) * 0.25;
                let event = match kind {
                    0..=4 => "fault_start",
                    5..=8 => "fault_end",
                    _ if with_type == 1 => "fault_stop",
                    _ => "fault_end",
                };
                let time = if with_type == 2 { -t } else { t };
                let fault_type = if with_type > 0 {
                    format!(
                        r#", "fault_type": {{"Level": "L", "Class": "C{class}", "Desc": "D"}}"#
                    )
                } else {
                    String::new()
                };
                format!(
                    r#"{{"node_id": "n{node}", "event_time": {time}, "event_type": "{event}"{fault_type}}}"#
                )
            })
            .collect();
        format!("[{}]", items.join(",\n"))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Fault logs never panic; an accepted one gives a valid trace whose removals are at most
    /// the starts that find their node without an open fault, on a cluster of its nodes.
    #[test]
    fn fault_logs_never_panic(text in fault_log_text()) {
        prop_assert_eq!(detect_format(&text), TraceFormat::FaultLog);
        match lazarus_traces::FaultLog::parse(&text) {
            Ok(log) => {
                let t = log.trace();
                check_trace(&t);
                // Every node of the log is added at 0 (its faults may take it down at once).
                let at_zero = t.events().iter().take_while(|e| e.op == NodeOp::Add && e.time_ms == 0);
                prop_assert_eq!(at_zero.count(), log.nodes().len());
                prop_assert!(t.removals() <= log.faults().len());
                let wide = log.trace_on(log.nodes().len() + 3).unwrap();
                check_trace(&wide);
                prop_assert_eq!(wide.removals(), t.removals());
                prop_assert_eq!(wide.min_live(), t.min_live() + 3);
            }
            Err(e) => check_sane_error(&e),
        }
    }
}
