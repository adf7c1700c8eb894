//! `lzsim replay` of a fault log (InfiniteHBD JSON): `--cluster-nodes`, the faults per class,
//! bad input (one line naming the entry, exit 2), and the real 348-day log recounted from its
//! raw JSON.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn lzsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lzsim"))
        .args(args)
        .output()
        .expect("run lzsim")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lzsim-faultlog-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn entry(node: &str, days: &str, event: &str, class: &str) -> String {
    format!(
        r#"{{"node_id": "{node}", "event_time": {days}, "event_type": "{event}",
            "fault_type": {{"Level": "Hardware Failure", "Class": "{class}", "Desc": "x"}}}}"#
    )
}

/// Writes a fault log of `entries` and returns its path.
fn write_log(name: &str, entries: &[String]) -> PathBuf {
    let dir = tmp(name);
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("faults.json");
    std::fs::write(&p, format!("[\n{}\n]\n", entries.join(",\n"))).unwrap();
    p
}

fn s(node: &str, days: &str) -> String {
    entry(node, days, "fault_start", "GPU")
}

fn e(node: &str, days: &str) -> String {
    entry(node, days, "fault_end", "GPU")
}

/// A small model on few nodes, quick to replay.
const SMALL: [&str; 6] = [
    "--model",
    "gpt-s",
    "--hardware",
    "rtx3090-100g",
    "--system",
    "lazarus",
];

fn replay(path: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["replay", path.to_str().unwrap()];
    args.extend(SMALL);
    args.extend(extra);
    lzsim(&args)
}

#[test]
fn fault_log_replays_with_cluster_nodes_and_classes() {
    // 0.01 day = 864 s. Node a: GPU fault overlapped by a NIC fault (one outage); b: one
    // fault; c never fails (only in --cluster-nodes).
    let p = write_log(
        "ok",
        &[
            s("a", "0.01"),
            entry("a", "0.012", "fault_start", "NIC"),
            s("b", "0.015"),
            e("a", "0.02"),
            e("b", "0.03"),
            entry("a", "0.04", "fault_end", "NIC"),
        ],
    );
    let out = replay(&p, &["--cluster-nodes", "10"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(
            "fault log: 3 faults on 2 nodes (of 2 in the log, 10 in the cluster) in days \
             0.0000..0.0400, 2 node removals"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("faults by class: GPU 2, NIC 1\n"),
        "{stdout}"
    );

    // JSON: stdout is the summaries only; the counts are in config.json and on stderr.
    let dir = tmp("ok-out");
    let out = replay(
        &p,
        &[
            "--cluster-nodes",
            "10",
            "--format",
            "json",
            "--out",
            dir.to_str().unwrap(),
            "--window",
            "0m..20m",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["preemptions"], 1);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    // [0, 1200 s): a's faults at 864 s and 1036.8 s (one outage); b's at 1296 s is outside.
    assert_eq!(config["fault_log"]["faults"], 2);
    assert_eq!(config["fault_log"]["removals"], 1);
    assert_eq!(config["fault_log"]["by_class"]["GPU"], 1);
    assert_eq!(config["fault_log"]["by_class"]["NIC"], 1);
    assert_eq!(config["fault_log"]["cluster_nodes"], 10);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(p.parent().unwrap());
}

#[test]
fn fault_log_bad_input_names_the_entry() {
    let cases: Vec<(&str, Vec<String>, &[&str], &str)> = vec![
        (
            "end-before-start",
            vec![s("a", "2"), e("a", "1")],
            &[],
            "entry 1 (node a): fault_end at day 1 is before its fault_start at day 2 (entry 0)",
        ),
        (
            "unknown-type",
            vec![s("a", "1"), entry("a", "2", "fault_repaired", "GPU")],
            &[],
            "entry 1 (node a): unknown event_type \"fault_repaired\"",
        ),
        (
            "end-without-start",
            vec![s("a", "1"), e("b", "2")],
            &[],
            "entry 1 (node b): fault_end at day 2 without a fault_start",
        ),
        (
            "backwards",
            vec![s("a", "2"), s("b", "1")],
            &[],
            "entry 1 (node b): event_time 1 days is earlier than entry 0's 2 days",
        ),
        (
            "non-finite",
            vec![s("a", "1"), s("b", "1e400")],
            &[],
            "entry 1 (node b): event_time 1e400 is not a finite number of days",
        ),
        (
            "negative",
            vec![s("a", "-1")],
            &[],
            "entry 0 (node a): negative event_time -1",
        ),
        (
            "cluster-too-small",
            vec![s("a", "1"), s("b", "1")],
            &["--cluster-nodes", "1"],
            "--cluster-nodes 1: ",
        ),
    ];
    for (name, entries, extra, needle) in cases {
        let p = write_log(name, &entries);
        let out = replay(&p, extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains(needle), "{name}: {err}");
        assert_eq!(err.lines().count(), 1, "{name}: {err}");
        assert!(err.contains("faults.json"), "{name}: names the file: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
    }
    assert!(
        String::from_utf8_lossy(&lzsim(&["replay", "--cluster-nodes", "4"]).stderr)
            .contains("--cluster-nodes sizes a fault log's cluster")
    );
}

/// The real log (StepFun's InfiniteHBD trace, 348 days, 400 servers): the replay's counts —
/// faults in the window, per class, node removals (in the printed counts and in every
/// system's summary) — equal a count made here from the raw JSON.
#[test]
fn infinitehbd_replay_counts_match_the_raw_log() {
    let Some(path) = lazarus_traces::shared::or_skip("infinitehbd/fault_trace.json") else {
        return;
    };
    let raw: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let (mut faults, mut removals) = (0u64, 0u64);
    let mut by_class: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_level: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut open: BTreeMap<&str, u32> = BTreeMap::new();
    for ev in &raw {
        let depth = open.entry(ev["node_id"].as_str().unwrap()).or_default();
        match ev["event_type"].as_str().unwrap() {
            "fault_start" => {
                faults += 1;
                *by_class
                    .entry(ev["fault_type"]["Class"].as_str().unwrap().to_owned())
                    .or_default() += 1;
                *by_level
                    .entry(ev["fault_type"]["Level"].as_str().unwrap().to_owned())
                    .or_default()
                    .entry(ev["fault_type"]["Class"].as_str().unwrap().to_owned())
                    .or_default() += 1;
                removals += u64::from(*depth == 0);
                *depth += 1;
            }
            _ => *depth -= 1,
        }
    }
    let dir = tmp("hbd");
    let out = lzsim(&[
        "replay",
        path.to_str().unwrap(),
        "--cluster-nodes",
        "400",
        "--model",
        "deepseek-v3",
        "--hardware",
        "h200-400g",
        // Lazarus takes minutes over 348 days; the counts are the engine's, the same for all.
        "--system",
        "ds-ft,ds",
        "--format",
        "json",
        "--out",
        dir.to_str().unwrap(),
        "--sample-every",
        "1h",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let counts = &config["fault_log"];
    assert_eq!(counts["faults"], faults);
    assert_eq!(counts["removals"], removals);
    assert_eq!(counts["cluster_nodes"], 400);
    assert_eq!(
        serde_json::from_value::<BTreeMap<String, u64>>(counts["by_class"].clone()).unwrap(),
        by_class
    );
    assert_eq!(
        serde_json::from_value::<BTreeMap<String, BTreeMap<String, u64>>>(
            counts["by_level"].clone()
        )
        .unwrap(),
        by_level
    );
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    for summary in list.as_array().unwrap() {
        assert_eq!(summary["preemptions"], removals, "{}", summary["system"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
