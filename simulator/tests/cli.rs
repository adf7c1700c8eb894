//! End-to-end tests of the `lzsim` binary: output formats, golden numbers, and bad input
//! (one clear line on stderr, exit code 2, no panic).

use serde_json::Value;
use std::process::{Command, Output};

fn lzsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lzsim"))
        .args(args)
        .output()
        .expect("run lzsim")
}

fn stdout_json(args: &[&str]) -> Value {
    let out = lzsim(args);
    assert!(
        out.status.success(),
        "lzsim {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

#[test]
fn plan_json_golden_allocation() {
    let v = stdout_json(&[
        "plan",
        "--nodes",
        "10",
        "--slots",
        "6",
        "--experts",
        "8",
        "--f",
        "2",
        "--loads",
        "1,1,1,1,2,4,10,20",
        "--format",
        "json",
    ]);
    assert_eq!(v["nodes"], 10);
    assert_eq!(v["slots"], 6);
    assert_eq!(v["experts"], 8);
    assert_eq!(v["f"], 2);
    assert_eq!(v["replicas"], serde_json::json!([2, 2, 2, 2, 2, 5, 15, 30]));
    let placement = v["placement"].as_array().unwrap();
    assert_eq!(placement.len(), 10);
    let mut counts = [0u64; 8];
    for node in placement {
        let slots = node.as_array().unwrap();
        assert_eq!(slots.len(), 6);
        for e in slots {
            counts[e.as_u64().unwrap() as usize] += 1;
        }
    }
    assert_eq!(counts, [2, 2, 2, 2, 2, 5, 15, 30]);
    // Tokens as the dispatcher splits them: every token counted once, on some node.
    let tokens: u64 = v["tokens_per_node"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .sum();
    assert_eq!(tokens, 40);
    assert!(v["load_ratio"].as_f64().unwrap() >= 1.0);
}

/// The forced-skew case of results/fsep: Eq. 1 + MRO leaves its blocks unequally loaded where
/// `spread` of the same allocation is near even (the text shows both).
#[test]
fn plan_shows_the_tokens_each_node_computes() {
    let node_line = |place: &str| {
        let out = lzsim(&[
            "plan",
            "--nodes",
            "4",
            "--slots",
            "6",
            "--experts",
            "8",
            "--loads",
            "1618,1018,564,336,241,151,95,73",
            "--place",
            place,
        ]);
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines()
            .find(|l| l.contains("tokens per node as dispatched"))
            .expect("a tokens-per-node line")
            .trim()
            .to_string()
    };
    assert_eq!(
        node_line("mro"),
        "tokens per node as dispatched: [732, 728, 1318, 1318]  (max / mean 1.287)"
    );
    assert_eq!(
        node_line("spread"),
        "tokens per node as dispatched: [1111, 1109, 939, 937]  (max / mean 1.085)"
    );
}

#[test]
fn plan_json_lists_layers_when_more_than_one() {
    let v = stdout_json(&["plan", "--layers", "3", "--zipf", "1.0", "--format", "json"]);
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 3);
    for l in layers {
        assert_eq!(l["replicas"].as_array().unwrap().len(), 16);
        assert_eq!(l["placement"].as_array().unwrap().len(), 10);
    }
    assert!(v.get("replicas").is_none());
}

#[test]
fn plan_text_shows_grid() {
    let out = lzsim(&["plan", "--experts", "8", "--loads", "1,1,1,1,2,4,10,20"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("node   0 |"));
    assert!(text.contains("MRO blocks"));
}

#[test]
fn recovery_json_matches_section10_table() {
    // r = [2×15, 30] comes from loads where 15 experts are tiny and one is huge.
    let mut loads = vec!["1"; 15];
    loads.push("1000");
    let loads = loads.join(",");
    let v = stdout_json(&[
        "recovery",
        "--nodes",
        "10",
        "--slots",
        "6",
        "--experts",
        "16",
        "--loads",
        &loads,
        "--place",
        "mro",
        "--failed",
        "0..6",
        "--format",
        "json",
    ]);
    let rows = v.as_array().unwrap();
    let want = [1.0, 1.0, 0.9333, 0.8, 0.6143, 0.4048, 0.2095];
    assert_eq!(rows.len(), want.len());
    for (row, w) in rows.iter().zip(want) {
        assert_eq!(row["place"], "mro");
        assert!(
            (row["probability"].as_f64().unwrap() - w).abs() < 5e-5,
            "{row}"
        );
    }
    // The closed form gives the same numbers.
    let c = stdout_json(&[
        "recovery",
        "--nodes",
        "10",
        "--slots",
        "6",
        "--experts",
        "16",
        "--loads",
        &loads,
        "--place",
        "mro",
        "--failed",
        "0..6",
        "--format",
        "json",
        "--method",
        "closed",
    ]);
    for (a, b) in rows.iter().zip(c.as_array().unwrap()) {
        assert!(
            (a["probability"].as_f64().unwrap() - b["probability"].as_f64().unwrap()).abs() < 1e-9
        );
    }
}

#[test]
fn recovery_mc_has_confidence_interval_and_csv_has_header() {
    let v = stdout_json(&[
        "recovery",
        "--failed",
        "4",
        "--method",
        "mc",
        "--trials",
        "5000",
        "--format",
        "json",
        "--place",
        "mro,spread",
    ]);
    for row in v.as_array().unwrap() {
        let p = row["probability"].as_f64().unwrap();
        assert!(row["ci_low"].as_f64().unwrap() <= p && p <= row["ci_high"].as_f64().unwrap());
        assert_eq!(row["failed"], 4);
    }
    let out = lzsim(&["recovery", "--failed", "0..2"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("place,failed,probability,ci_low,ci_high\n"));
    assert_eq!(text.lines().count(), 1 + 3 * 3);
}

#[test]
fn recovery_plot_writes_png_and_svg() {
    let dir = std::env::temp_dir().join(format!("lzsim-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for ext in ["png", "svg"] {
        let path = dir.join(format!("r.{ext}"));
        let out = lzsim(&[
            "recovery",
            "--failed",
            "0..3",
            "--plot",
            path.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(std::fs::metadata(&path).unwrap().len() > 1000);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn model_level_recovery_with_racks() {
    let v = stdout_json(&[
        "recovery", "--layers", "4", "--racks", "5", "--failed", "0..2", "--format", "json",
        "--place", "mro",
    ]);
    assert_eq!(v.as_array().unwrap().len(), 3);
    assert_eq!(v[0]["probability"], 1.0);
}

#[test]
fn bad_arguments_exit_2_with_one_clear_line() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["plan", "--nodes", "2", "--slots", "2", "--experts", "5"],
            "exceeds",
        ),
        (&["plan", "--slots", "0"], "slots"),
        (
            &["plan", "--experts", "3", "--loads", "1,x,3"],
            "not a non-negative integer",
        ),
        (
            &["plan", "--experts", "3", "--loads", "1,2"],
            "--loads has 2 values",
        ),
        (&["plan", "--place", "bogus"], "unknown placement"),
        (
            &["plan", "--loads-file", "/nonexistent/loads.csv"],
            "cannot read loads file",
        ),
        (&["recovery", "--failed", "11"], "exceeds the 10 nodes"),
        (&["recovery", "--failed", "5..2"], "empty"),
        (
            &["recovery", "--method", "closed", "--place", "spread"],
            "mro only",
        ),
        (
            &["reconfig", "--nodes", "64", "--fail", "1", "--slots", "0"],
            "'--slots <SLOTS>': 0 is not in 1..=4096",
        ),
        (
            &[
                "reconfig",
                "--nodes",
                "4",
                "--fail",
                "1",
                "--experts",
                "100",
                "--slots",
                "2",
            ],
            "cannot hold",
        ),
        (&["recovery", "--zipf=-1"], "--zipf"),
        (
            &["recovery", "--alloc", "nope"],
            "unknown allocation policy",
        ),
    ];
    for (args, needle) in cases {
        let out = lzsim(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: stderr {err:?} lacks {needle:?}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked");
        assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
    }
}

#[test]
fn reconfig_cluster_shape_reports_replan_ms() {
    let v = stdout_json(&[
        "reconfig",
        "--nodes",
        "300",
        "--gpus-per-node",
        "8",
        "--slots",
        "16",
        "--experts",
        "64",
        "--layers",
        "4",
        "--fail",
        "1",
        "--format",
        "json",
    ]);
    assert_eq!(v["nodes"], 300);
    assert_eq!(v["failure_sets"], 1);
    assert!(v["replan_ms"].as_f64().unwrap() > 0.0);
    assert!(v["plan_ms"].as_f64().unwrap() > 0.0);
    assert!(v["replicas_mean"].as_f64().unwrap() >= 0.0);
}

/// Issue 14: sizes are bounded when the arguments are parsed. Before, `--layers u64::MAX`
/// panicked (capacity overflow, exit 101), `--nodes 4e9 --slots 4e9` aborted on allocation and
/// `--failed 0..1e11` tried to list 10^11 failure counts.
#[test]
fn sizes_are_bounded_with_a_message_naming_the_argument() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["plan", "--layers", "18446744073709551615"],
            "'--layers <LAYERS>': 18446744073709551615 is not in 1..=1024",
        ),
        (
            &["plan", "--nodes", "4000000000", "--slots", "4000000000"],
            "'--nodes <NODES>': 4000000000 is not in 1..=1048576",
        ),
        (&["plan", "--experts", "70000"], "'--experts <EXPERTS>'"),
        (&["plan", "--f", "5000"], "'--f <F>'"),
        (
            &["plan", "--nodes", "1048576", "--slots", "4096"],
            "--nodes 1048576 x --slots 4096 x --layers 1 is 4294967296 replica slots, more than \
             the limit of 67108864",
        ),
        (
            &[
                "plan",
                "--nodes",
                "10000",
                "--experts",
                "256",
                "--layers",
                "100",
                "--format",
                "json",
            ],
            "JSON values, more than the limit of 33554432",
        ),
        (
            &["recovery", "--failed", "0..100000000000"],
            "at most 1048576 nodes can fail",
        ),
        (&["recovery", "--trials", "0"], "'--trials <TRIALS>'"),
        (&["recovery", "--racks", "0"], "'--racks <RACKS>'"),
        (
            &[
                "reconfig", "--nodes", "64", "--fail", "1", "--layers", "5000",
            ],
            "'--layers <LAYERS>'",
        ),
        (
            &[
                "reconfig", "--nodes", "1048576", "--fail", "1", "--slots", "4096",
            ],
            "replica slots, more than the limit",
        ),
        (&["reconfig", "--gpus-per-node", "1000"], "'--gpus-per-node"),
        (&["relayout", "--nodes", "2000000"], "'--nodes <NODES>'"),
        (
            &["relayout", "--nodes", "1048576", "--slots", "4096"],
            "replica slots, more than the limit",
        ),
        (
            &["relayout", "--steps", "18446744073709551615"],
            "--steps 18446744073709551615 asks for",
        ),
        (&["sweep", "--seeds", "0"], "'--seeds <SEEDS>'"),
        (&["sweep", "--nodes", "4000000000"], "'--nodes <NODES>'"),
        (
            &["failures", "--every", "5m", "--nodes", "0"],
            "'--nodes <NODES>'",
        ),
        (&["replay", "--max-nodes", "0"], "'--max-nodes <MAX_NODES>'"),
        (&["replay", "--f", "0"], "'--f <F>'"),
    ];
    for (args, needle) in cases {
        let out = lzsim(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: stderr {err:?} lacks {needle:?}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked");
        assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
    }
}

#[test]
fn help_documents_the_limits() {
    let out = lzsim(&["plan", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "1..=1048576",
        "1..=4096",
        "1..=65536",
        "1..=1024",
        "67108864",
    ] {
        assert!(help.contains(needle), "plan --help lacks {needle}: {help}");
    }
}

/// Issue 14: `lzsim plan | head -1` panicked ("failed printing to stdout", exit 101). A closed
/// pipe now ends the run quietly with exit code 0.
#[test]
fn a_closed_stdout_ends_quietly() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    // About 800 KB of text: far more than a pipe buffers, so lzsim is still writing when the
    // reader goes away.
    let mut child = Command::new(env!("CARGO_BIN_EXE_lzsim"))
        .args([
            "plan",
            "--nodes",
            "20000",
            "--slots",
            "8",
            "--experts",
            "256",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run lzsim");
    let mut first = String::new();
    {
        let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
        reader.read_line(&mut first).expect("first line");
    }
    assert!(first.starts_with("20000 nodes x 8 slots"), "{first}");
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.is_empty(), "{err}");
}

/// Issue 14: `lzsim plan > /dev/full` panicked. A full disk is an error: one line, exit 2.
#[test]
fn a_full_disk_is_an_error() {
    let full = std::path::Path::new("/dev/full");
    if !full.exists() {
        eprintln!("skipped: no /dev/full");
        return;
    }
    for args in [
        &["plan"][..],
        &["plan", "--format", "json"],
        &["recovery"],
        &["failures", "--every", "5m"],
    ] {
        let sink = std::fs::OpenOptions::new()
            .write(true)
            .open(full)
            .expect("/dev/full");
        let out = Command::new(env!("CARGO_BIN_EXE_lzsim"))
            .args(args)
            .stdout(sink)
            .output()
            .expect("run lzsim");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            err.trim_end(),
            "error: cannot write to standard output: No space left on device (os error 28)",
            "{args:?}"
        );
    }
}

/// `sweep --shard I/N`: the shards' CSVs, concatenated in shard order, are the unsharded CSV
/// byte for byte (shard 1 alone writes the header, an empty shard writes nothing).
#[test]
fn sweep_shards_concatenate_to_the_unsharded_csv() {
    let base = [
        "sweep",
        "--hazard",
        "0.3,0.9",
        "--seeds",
        "3",
        "--nodes",
        "4",
        "--duration",
        "20m",
        "--model",
        "gpt-s",
        "--system",
        "lazarus,ds",
    ];
    let run = |shard: Option<&str>| {
        let mut args: Vec<&str> = base.to_vec();
        if let Some(s) = shard {
            args.extend(["--shard", s]);
        }
        let out = lzsim(&args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(err.contains("runs/s"), "{err}");
        out.stdout
    };
    let whole = run(None);
    let text = String::from_utf8_lossy(&whole).to_string();
    assert!(text.starts_with("hazard_per_hour,seed,system,"), "{text}");
    assert_eq!(text.lines().count(), 1 + 2 * 3 * 2);
    for n in [1usize, 2, 4, 7] {
        let mut cat = Vec::new();
        for i in 1..=n {
            cat.extend(run(Some(&format!("{i}/{n}"))));
        }
        assert_eq!(
            String::from_utf8_lossy(&cat),
            text,
            "{n} shards concatenated"
        );
    }
    let out = lzsim(&[&base[..], &["--shard", "3/2"][..]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a shard I/N"));
}

/// `failures` in hardware mode: a preset, repairs bring nodes back under their names, the
/// causes are counted on stderr, and bad rates exit 2.
#[test]
fn failures_hardware_mode() {
    let out = lzsim(&[
        "failures",
        "--nodes",
        "64",
        "--preset",
        "llama3",
        "--gpu-hazard",
        "0.001",
        "--duration",
        "30d",
        "--seed",
        "3",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("hardware faults over 30.0 days: gpu "),
        "{err}"
    );
    let trace = lazarus_traces::parse(
        &String::from_utf8_lossy(&out.stdout),
        lazarus_traces::TraceFormat::BambooCsv,
    )
    .unwrap();
    assert_eq!(trace.max_live(), 64);
    assert!(trace.removals() > 10, "{}", trace.removals());
    assert!(trace.adds() > 64);
    for (args, needle) in [
        (
            &["failures", "--gpu-hazard=-1"][..],
            "--gpu-hazard must be a finite rate",
        ),
        (
            &["failures", "--rack-hazard", "0.1"][..],
            "--rack-hazard needs --nodes-per-rack",
        ),
        (
            &[
                "failures",
                "--gpu-hazard",
                "1000",
                "--nodes",
                "100000",
                "--duration",
                "365d",
            ][..],
            "faults over --duration, more than the limit",
        ),
        (
            &["failures", "--gpu-hazard", "0.1", "--every", "5m"][..],
            "cannot be used with",
        ),
        (
            &["failures", "--preset", "nope"][..],
            "invalid value 'nope'",
        ),
    ] {
        let out = lzsim(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// `recovery --gpus-per-node`: a GPU failure loses only that GPU's slots, so k GPU failures
/// are survived at least as often as k node failures.
#[test]
fn recovery_gpu_mode() {
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "recovery",
            "--nodes",
            "8",
            "--slots",
            "4",
            "--experts",
            "8",
            "--f",
            "2",
            "--place",
            "mro",
            "--failed",
            "0..3",
            "--format",
            "json",
        ];
        a.extend_from_slice(extra);
        a
    };
    let nodes = stdout_json(&args(&[]));
    let gpus = stdout_json(&args(&["--gpus-per-node", "2"]));
    for k in 0..=3 {
        let p = |v: &Value| v[k]["probability"].as_f64().unwrap();
        assert!(p(&gpus) >= p(&nodes) - 1e-12, "k={k}: {gpus} vs {nodes}");
        assert!(gpus[k].get("ci_low").is_none(), "exact at this size");
    }
    assert!(nodes[3]["probability"].as_f64().unwrap() < 1.0);
    let out = lzsim(&args(&["--gpus-per-node", "5"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("GPUs per node must be between 1"));
}

/// Runs lzsim with `args`, killing it after `limit`: `None` if it was still running (a hang is
/// a test failure, not a stuck test run).
fn lzsim_within(args: &[&str], limit: std::time::Duration) -> Option<Output> {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_lzsim"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run lzsim");
    let start = std::time::Instant::now();
    loop {
        if child.try_wait().expect("poll lzsim").is_some() {
            return Some(child.wait_with_output().expect("wait"));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Issue 33 item 6: `lzsim reconfig --step 18446744073709551515` spun forever (the drift
/// epoch after the step wrapped around). A step past the limit is one line, exit 2, at once;
/// a step just inside it is answered.
#[test]
fn reconfig_bounds_its_step() {
    let limit = std::time::Duration::from_secs(60);
    for step in [
        "18446744073709551515",
        "18446744073709551615",
        "1000000000001",
    ] {
        let out = lzsim_within(&["reconfig", "--step", step], limit)
            .unwrap_or_else(|| panic!("lzsim reconfig --step {step} still ran after {limit:?}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--step {step}: {err}");
        assert_eq!(err.lines().count(), 1, "--step {step}: {err}");
        assert!(err.contains("--step") && err.contains("limit"), "{err}");
    }
    let out = lzsim_within(
        &["reconfig", "--step", "1000000000000", "--format", "json"],
        limit,
    )
    .expect("--step 1000000000000 is answered");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["step"], 1_000_000_000_000u64);
}

/// Issue 33 item 6: `lzsim replay --model deepseek-v3` on the default hardware and trace
/// (at most 10 single-GPU nodes: 40 expert slots for 256 experts, and standard EP needs 64
/// GPUs) printed all zeros and exited 0. A model no system can train on the trace's largest
/// cluster is an error saying why.
#[test]
fn replay_of_a_model_the_cluster_cannot_hold_is_an_error() {
    for args in [
        &["replay", "--model", "deepseek-v3"][..],
        &["replay", "--model", "deepseek-v3", "--system", "lazarus"],
        &["replay", "--model", "deepseek-v3", "--system", "ds"],
    ] {
        let out = lzsim(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains("deepseek-v3") && err.contains("256 experts"),
            "{args:?}: {err}"
        );
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // A model that fits is still replayed.
    let out = lzsim(&["replay", "--model", "gpt-s", "--system", "lazarus"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 33 item 6: a trace adding 200,000 nodes at t = 0 took minutes (20,000 nodes: 2.8 s,
/// quadratic in the nodes: the live-node count per event at t = 0, and the job machine's
/// membership tests per node). Linear, the debug build replays it in about 7 s on a loaded
/// machine; the bound is generous for that and far below what quadratic work takes (100 ×
/// the 2.8 s of 20,000 nodes).
#[test]
fn a_trace_of_200000_nodes_at_time_0_replays_in_bounded_time() {
    let dir = std::env::temp_dir().join(format!("lzsim-200k-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("200k.csv");
    let mut text = String::with_capacity(200_000 * 16);
    for i in 0..200_000 {
        text.push_str(&format!("0,add,n{i}\n"));
    }
    text.push_str("60000,remove,n7\n");
    std::fs::write(&trace, text).unwrap();
    let limit = std::time::Duration::from_secs(60);
    let started = std::time::Instant::now();
    let out = lzsim_within(
        &[
            "replay",
            trace.to_str().unwrap(),
            "--system",
            "lazarus",
            "--model",
            "gpt-s",
            "--end",
            "2m",
            "--format",
            "json",
        ],
        limit,
    )
    .unwrap_or_else(|| panic!("200,000 nodes at t = 0 still replaying after {limit:?}"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("200,000 nodes replayed in {:?}", started.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(v.to_string().contains("lazarus"), "{v}");
}

/// Issue 35 item 6, the walk over every flag of `lzsim replay` and `lzsim relayout`: flags that
/// were taken and had no effect in the command they were given to are refused, one line,
/// exit 2 — `--map` without `--max-nodes` (nothing is fitted), `--overwrite` without `--out`,
/// `--sample-every` without a run directory, the synthetic-load flags with a loads or routing
/// trace, the laer parameters without laer among the policies.
#[test]
fn flags_that_would_have_no_effect_are_refused() {
    let cases: &[(&[&str], &str)] = &[
        (&["replay", "--map", "track"], "--max-nodes"),
        (&["replay", "--overwrite"], "--out"),
        (&["replay", "--sample-every", "1s"], "give --out DIR too"),
        (&["sweep", "--sample-every", "1s"], "a sweep writes none"),
        (
            &["replay", "--loads-trace", "x.csv", "--zipf", "1.1"],
            "--loads-trace",
        ),
        (
            &["replay", "--loads-trace", "x.csv", "--drift-every", "9"],
            "--loads-trace",
        ),
        (
            &["relayout", "--routing", "x.csv", "--steps", "100"],
            "--routing",
        ),
        (
            &["relayout", "--routing", "x.csv", "--seed", "3"],
            "--routing",
        ),
        (
            &["relayout", "--routing", "x.csv", "--zipf", "1.1"],
            "--routing",
        ),
        (&["relayout", "--overwrite"], "--out"),
        (
            &["relayout", "--policy", "static,lazarus", "--floor", "0.5"],
            "--floor is a parameter of the laer policy, and --policy static,lazarus has no laer",
        ),
        (
            &["relayout", "--policy", "eplb", "--min-gain", "0.1"],
            "--min-gain is a parameter of the laer policy",
        ),
        (
            &["relayout", "--policy", "eplb", "--long-window", "9"],
            "--long-window",
        ),
    ];
    for (args, needle) in cases {
        let out = lzsim(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // With what they act on, they are taken.
    let v = stdout_json(&[
        "relayout", "--policy", "laer", "--floor", "0.5", "--steps", "300", "--format", "json",
    ]);
    assert_eq!(v[0]["policy"], "laer", "{v}");
}

/// Issue 35 item 6: `lzsim reconfig` listed the replay's `--system`, `--ckpt-every`,
/// `--scale-out-wait`, `--boot` and `--sample-every` and ignored them (it costs one Lazarus
/// reconfiguration); cluster-shape mode ignored `--loads-trace`, `--drift-every`,
/// `--rebalance-every` and `--step`. Each is now one line, exit 2, and `--help` lists none of
/// the replay-only ones.
#[test]
fn reconfig_refuses_the_flags_it_does_not_use() {
    let help = lzsim(&["reconfig", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--system",
        "--ckpt-every",
        "--scale-out-wait",
        "--boot",
        "--sample-every",
    ] {
        assert!(!help.contains(flag), "{flag} in reconfig --help:\n{help}");
        let out = lzsim(&["reconfig", flag, "1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert_eq!(err.lines().count(), 1, "{flag}: {err}");
        assert!(
            err.contains(&format!("unexpected argument '{flag}'")),
            "{err}"
        );
        assert!(err.contains("lzsim reconfig --help"), "{err}");
        assert!(out.stdout.is_empty(), "{flag}");
    }
    for flag in [
        "--loads-trace",
        "--drift-every",
        "--rebalance-every",
        "--step",
    ] {
        let out = lzsim(&[
            "reconfig", "--nodes", "16", "--fail", "1", "--slots", "4", flag, "7",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert_eq!(err.lines().count(), 1, "{flag}: {err}");
        assert!(err.contains(flag) && err.contains("--slots"), "{err}");
    }
    // What reconfig does use still works, in both modes.
    let v = stdout_json(&[
        "reconfig", "--model", "gpt-s", "--f", "2", "--format", "json",
    ]);
    assert_eq!(v["nodes"], 10);
    let out = lzsim(&[
        "reconfig",
        "--nodes",
        "16",
        "--fail",
        "1",
        "--slots",
        "4",
        "--experts",
        "16",
        "--layers",
        "2",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("at step"), "{text}");
}

/// Issue 35 item 6: `lzsim relayout`'s `static` policy, which never changes its layout,
/// reported a re-layout for every decision (311 on the SmartMoE trace, 0 bytes moved).
/// `relayouts` counts the decisions that changed the layout; `decisions` counts them all.
#[test]
fn relayout_counts_only_decisions_that_change_the_layout() {
    let v = stdout_json(&[
        "relayout",
        "--policy",
        "static,lazarus",
        "--steps",
        "2000",
        "--format",
        "json",
    ]);
    let get = |p: &str, k: &str| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|x| x["policy"] == p)
            .unwrap_or_else(|| panic!("no {p}: {v}"))[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{p} lacks {k}: {v}"))
    };
    assert!(get("static", "decisions") > 0, "{v}");
    assert_eq!(get("static", "relayouts"), 0, "{v}");
    assert_eq!(get("static", "migrated_bytes"), 0, "{v}");
    assert_eq!(
        get("lazarus", "decisions"),
        get("static", "decisions"),
        "{v}"
    );
    let lazarus = get("lazarus", "relayouts");
    assert!(lazarus > 0 && lazarus <= get("lazarus", "decisions"), "{v}");
    let out = lzsim(&["relayout", "--policy", "static", "--steps", "2000"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text.lines().find(|l| l.starts_with("static")).unwrap();
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[6], "0", "relayouts column of {row:?}");
}
