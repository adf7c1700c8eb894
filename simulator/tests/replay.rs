//! End-to-end tests of `lzsim replay`, `failures` and `sweep`: determinism, conservation of
//! trace events, time accounting, scenario sanity against the paper's orderings, and bad input.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn lzsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lzsim"))
        .args(args)
        .output()
        .expect("run lzsim")
}

fn ok_json(args: &[&str]) -> Value {
    let out = lzsim(args);
    assert!(
        out.status.success(),
        "lzsim {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// A third-party trace under the shared-traces directory (`$LAZARUS_TRACES`, else
/// `../shared/traces`), or `None` after one `skipped:` line when it is absent.
fn shared(rel: &str) -> Option<String> {
    lazarus_traces::shared::or_skip(rel).map(|p| p.display().to_string())
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lzsim-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn by_system<'a>(v: &'a Value, sys: &str) -> &'a Value {
    v.as_array()
        .unwrap()
        .iter()
        .find(|x| x["system"] == sys)
        .unwrap_or_else(|| panic!("no {sys} in {v}"))
}

fn samples(v: &Value, sys: &str) -> u64 {
    by_system(v, sys)["samples"].as_u64().unwrap()
}

#[test]
fn default_replay_has_required_json_keys_and_paper_ordering() {
    let v = ok_json(&["replay", "--format", "json"]);
    for s in v.as_array().unwrap() {
        for key in [
            "system",
            "samples",
            "steps",
            "ettr",
            "recoveries",
            "fallbacks",
            "preemptions",
        ] {
            assert!(s.get(key).is_some(), "missing {key} in {s}");
        }
        // 5 nodes fail in the embedded 30-minute scenario.
        assert_eq!(s["preemptions"], 5);
        let t = &s["time"];
        let total: f64 = [
            "compute",
            "lost",
            "checkpoint",
            "restart",
            "reconfigure",
            "rebalance",
            "idle",
        ]
        .iter()
        .map(|k| t[k].as_f64().unwrap())
        .sum();
        assert!(
            (total - s["duration_s"].as_f64().unwrap()).abs() < 1e-3,
            "{s}"
        );
    }
    let (l, f, d) = (
        samples(&v, "lazarus"),
        samples(&v, "ds-ft"),
        samples(&v, "ds"),
    );
    // The paper's DS(FT) also beats DS here (5.7x vs 2.8x behind Lazarus on GPT-L); ours is
    // within 1 % of DS on this scenario (22560 vs 22640 samples with Zipf loads) since
    // network_efficiency was set from the paper (results/README.md, "Against the paper": our
    // DS checkpoints and restarts more cheaply than the paper's). Lazarus leads both.
    assert!(l >= f && l >= d, "lazarus {l} ds-ft {f} ds {d}");
    assert!(f as f64 >= 0.98 * d as f64, "lazarus {l} ds-ft {f} ds {d}");
    assert!(l > d, "lazarus must beat ds under 5-minute failures");
    assert_eq!(by_system(&v, "lazarus")["fallbacks"], 0);
    assert_eq!(by_system(&v, "lazarus")["recoveries"], 5);
}

#[test]
fn run_directory_is_byte_identical_for_the_same_seed() {
    let (a, b) = (tmp("det-a"), tmp("det-b"));
    for d in [&a, &b] {
        let out = lzsim(&["replay", "--out", d.to_str().unwrap(), "--seed", "7"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut files = Vec::new();
    fn walk(d: &Path, base: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, base, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().to_path_buf());
            }
        }
    }
    walk(&a, &a, &mut files);
    files.sort();
    for sys in ["lazarus", "ds-ft", "ds"] {
        for f in ["summary.json", "timeseries.csv", "events.jsonl"] {
            assert!(
                files.contains(&PathBuf::from(sys).join(f)),
                "{sys}/{f} missing"
            );
        }
    }
    for f in [
        "config.json",
        "throughput.png",
        "throughput.svg",
        "samples.png",
        "samples.svg",
    ] {
        assert!(files.contains(&PathBuf::from(f)), "{f} missing");
    }
    for f in &files {
        if f == Path::new("config.json") {
            continue; // holds the --out path of each run
        }
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{} differs between identical runs",
            f.display()
        );
    }
    let config: Value =
        serde_json::from_slice(&std::fs::read(a.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["seed"], 7);
    assert!(config["git_commit"].is_string());
    // Refuses to overwrite a non-empty run directory.
    let again = lzsim(&["replay", "--out", a.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2));
    for d in [a, b] {
        std::fs::remove_dir_all(d).ok();
    }
}

#[test]
fn p3_window_processes_every_preemption_once() {
    let Some(p3) = shared("bamboo/traces/p3-trace.csv") else {
        return;
    };
    let v = ok_json(&[
        "replay",
        &p3,
        "--window",
        "0m..80m",
        "--max-nodes",
        "10",
        "--map",
        "track",
        "--format",
        "json",
    ]);
    // Count removals the fitted trace holds by asking `failures`-independent ground truth:
    // every system sees the same trace, so the same number of preemptions.
    let p: Vec<u64> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["preemptions"].as_u64().unwrap())
        .collect();
    assert!(p.iter().all(|&x| x == p[0] && x > 0), "{p:?}");
    let (l, f, d) = (
        samples(&v, "lazarus"),
        samples(&v, "ds-ft"),
        samples(&v, "ds"),
    );
    assert!(l > f && l > d, "lazarus {l} ds-ft {f} ds {d}");
}

#[test]
fn full_p3_trace_counts_all_167_removals() {
    let Some(p3) = shared("bamboo/traces/p3-trace.csv") else {
        return;
    };
    let v = ok_json(&["replay", &p3, "--system", "lazarus", "--format", "json"]);
    assert_eq!(v[0]["preemptions"], 167);
}

/// Issue 35 item 1: a node-count CSV (`time_ms,live_nodes`) replays exactly like the event
/// CSV it stands for (nodes `n0, n1, …`, the newest removed first; see lazarus-traces'
/// `TraceFormat`): the same summaries, and the same per-system events and time series.
#[test]
fn a_node_count_csv_replays_like_its_event_csv() {
    let dir = tmp("counts");
    std::fs::create_dir_all(&dir).unwrap();
    let counts = dir.join("aws-counts.csv");
    std::fs::write(
        &counts,
        "time_ms,live_nodes\r\n0,10\r\n300000,8\r\n600000,8\r\n900000,9\r\n1200000,6\r\n",
    )
    .unwrap();
    let events = dir.join("aws-events.csv");
    let mut csv: String = (0..10).map(|i| format!("0,add,n{i}\n")).collect();
    csv += "300000,remove,n9\n300000,remove,n8\n900000,add,n10\n\
            1200000,remove,n10\n1200000,remove,n7\n1200000,remove,n6\n";
    std::fs::write(&events, csv).unwrap();
    let (c, e) = (counts.to_str().unwrap(), events.to_str().unwrap());

    let json = |trace: &str| ok_json(&["replay", trace, "--end", "30m", "--format", "json"]);
    let v = json(c);
    assert_eq!(v, json(e));
    assert_eq!(by_system(&v, "lazarus")["preemptions"], 5, "{v}");
    let text = |trace: &str| lzsim(&["replay", trace, "--end", "30m"]);
    let (tc, te) = (text(c), text(e));
    assert!(
        tc.status.success(),
        "{}",
        String::from_utf8_lossy(&tc.stderr)
    );
    assert_eq!(tc.stdout, te.stdout);

    // The run directories agree system by system (config.json and the plot titles name the
    // trace file, so only the per-system files are compared).
    let (oc, oe) = (dir.join("out-counts"), dir.join("out-events"));
    for (trace, out) in [(c, &oc), (e, &oe)] {
        let o = lzsim(&[
            "replay",
            trace,
            "--end",
            "30m",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let mut compared = 0;
    for sys in std::fs::read_dir(&oc).unwrap() {
        let sys = sys.unwrap().path();
        if !sys.is_dir() {
            continue;
        }
        for f in ["summary.json", "timeseries.csv", "events.jsonl"] {
            let a = std::fs::read(sys.join(f)).unwrap();
            let b = std::fs::read(oe.join(sys.file_name().unwrap()).join(f)).unwrap();
            assert!(a == b, "{} differs", sys.join(f).display());
            compared += 1;
        }
    }
    assert!(compared >= 9, "{compared} files compared");
    std::fs::remove_dir_all(dir).ok();
}

/// The P3 trace as Parcae ships it, a count series, is auto-detected (it was a `line 1:
/// expected 3 comma-separated fields` error) and replays all 167 removals.
#[test]
fn parcae_p3_count_series_replays_all_167_removals() {
    let Some(p3) = shared("parcae/aws/traces/p3.csv") else {
        return;
    };
    let v = ok_json(&["replay", &p3, "--system", "lazarus", "--format", "json"]);
    assert_eq!(v[0]["preemptions"], 167);
}

#[test]
fn failures_writes_a_trace_that_replays() {
    let out = lzsim(&["failures", "--nodes", "10", "--every", "40m", "--seed", "3"]);
    assert!(out.status.success());
    let csv = String::from_utf8(out.stdout).unwrap();
    let removes = csv.lines().filter(|l| l.contains(",remove,")).count();
    assert_eq!(removes, 5);
    assert_eq!(csv.lines().filter(|l| l.contains(",add,")).count(), 10);
    // Same seed, same sequence.
    let again = lzsim(&["failures", "--nodes", "10", "--every", "40m", "--seed", "3"]);
    assert_eq!(csv.as_bytes(), again.stdout.as_slice());
    let dir = tmp("fail");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f.csv");
    std::fs::write(&path, &csv).unwrap();
    let v = ok_json(&[
        "replay",
        path.to_str().unwrap(),
        "--end",
        "240m",
        "--model",
        "gpt-s",
        "--format",
        "json",
    ]);
    assert!(samples(&v, "lazarus") >= samples(&v, "ds"));
    // Refuses to replace an existing file.
    let o = lzsim(&["failures", "--every", "5m", "--out", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn sweep_is_deterministic_csv() {
    let args = [
        "sweep",
        "--hazard",
        "0.3",
        "--seeds",
        "3",
        "--duration",
        "1h",
        "--system",
        "lazarus,ds",
    ];
    let a = lzsim(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let text = String::from_utf8(a.stdout.clone()).unwrap();
    assert!(text.starts_with("hazard_per_hour,seed,system,samples,"));
    assert_eq!(text.lines().count(), 1 + 3 * 2);
    assert_eq!(a.stdout, lzsim(&args).stdout);
}

#[test]
fn bad_replay_input_exits_2_with_a_clear_line() {
    let dir = tmp("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let unsorted = dir.join("unsorted.csv");
    std::fs::write(&unsorted, "0,add,a\n0,add,b\n500,remove,a\n100,remove,b\n").unwrap();
    let unknown = dir.join("unknown.csv");
    std::fs::write(&unknown, "0,add,a\n10,remove,zz\n").unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["replay", unsorted.to_str().unwrap()], "line 4"),
        (vec!["replay", unknown.to_str().unwrap()], "line 2"),
        (vec!["replay", "/nonexistent/trace.csv"], "trace.csv"),
        (vec!["replay", "--model", "gpt-xxl"], "gpt-xxl"),
        (vec!["replay", "--hardware", "tpu"], "tpu"),
        (vec!["replay", "--system", "megatron"], "unknown system"),
        (vec!["replay", "--window", "9m..1m"], "empty"),
        (vec!["replay", "--ckpt-every", "ds=x"], "integer"),
        (vec!["failures"], "--every"),
        (vec!["sweep", "--hazard=-1"], "--hazard"),
    ];
    for (args, needle) in cases {
        let out = lzsim(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn forty_minute_scenario_lazarus_leads() {
    let v = ok_json(&[
        "replay",
        &format!(
            "{}/../traces/data/paper-40min-10nodes.csv",
            env!("CARGO_MANIFEST_DIR")
        ),
        "--end",
        "240m",
        "--ckpt-every",
        "ds=200,ds-ft=1000,lazarus=1000",
        "--format",
        "json",
    ]);
    let (l, f, d) = (
        samples(&v, "lazarus"),
        samples(&v, "ds-ft"),
        samples(&v, "ds"),
    );
    // The paper finds DS and DS(FT) about equal here (Fig. 7): only Lazarus's lead is asserted.
    assert!(l > f && l > d, "lazarus {l} ds-ft {f} ds {d}");
}

#[test]
fn rollback_without_checkpoints_loses_all_progress_and_in_place_recovery_keeps_it() {
    let dir = tmp("rollback");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.csv");
    std::fs::write(&trace, "0,add,a\n0,add,b\n0,add,c\n600000,remove,a\n").unwrap();
    let v = ok_json(&[
        "replay",
        trace.to_str().unwrap(),
        "--model",
        "gpt-s",
        "--ckpt-every",
        "none",
        "--end",
        "20m",
        "--format",
        "json",
    ]);
    let lz = by_system(&v, "lazarus");
    assert_eq!(lz["fallbacks"], 0);
    assert_eq!(lz["recoveries"], 1);
    assert!(lz["time"]["lost"].as_f64().unwrap() < 5.0, "{lz}");
    // DS uses nodes a and b (EP 2): losing a restarts from step 0, so the first 10 minutes of
    // work are lost, and it resumes on b and c after detection and restart.
    let ds = by_system(&v, "ds");
    assert_eq!(ds["fallbacks"], 1);
    // Lost: the 600 s before the failure, plus the step cut off by the end of the run.
    let lost = ds["time"]["lost"].as_f64().unwrap();
    assert!((600.0..=602.0).contains(&lost), "{ds}");
    assert!(ds["samples"].as_u64().unwrap() < lz["samples"].as_u64().unwrap() / 2);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn relayout_on_the_smartmoe_trace() {
    let Some(routing) = shared("routing/smartmoe/derived/global_expert_counts.csv") else {
        return;
    };
    let v = ok_json(&[
        "relayout",
        "--routing",
        &routing,
        "--policy",
        "static,lazarus,eplb,laer",
        "--format",
        "json",
    ]);
    let get = |p: &str| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|x| x["policy"] == p)
            .unwrap_or_else(|| panic!("no {p}"))
            .clone()
    };
    for p in ["static", "lazarus", "eplb", "laer"] {
        let x = get(p);
        for key in [
            "policy",
            "load_ratio_mean",
            "step_time_s_mean",
            "migrated_bytes",
            "recovery_k1",
        ] {
            assert!(x.get(key).is_some(), "{p} lacks {key}");
        }
    }
    let f = |p: &str, k: &str| get(p)[k].as_f64().unwrap();
    assert_eq!(f("static", "migrated_bytes"), 0.0);
    // LAER: EPLB's balance (within 10 %) for a fraction of its bytes, keeping single-node
    // resilience that EPLB gives up; better balance than Lazarus's full replan.
    assert!(f("laer", "migrated_bytes") < f("eplb", "migrated_bytes") / 3.0);
    assert!(f("laer", "load_ratio_mean") <= 1.1 * f("eplb", "load_ratio_mean"));
    assert!(f("laer", "load_ratio_mean") < f("lazarus", "load_ratio_mean"));
    assert_eq!(f("laer", "recovery_k1"), 1.0);
    assert!(f("eplb", "recovery_k1") < 1.0);
    let bad = lzsim(&["relayout", "--policy", "megablocks"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown policy"));
}

/// The lazarus system's decisions are the job state machine's: a failure that leaves some
/// expert without a replica restores the checkpoint, any other one replans in place.
#[test]
fn lazarus_failure_decisions_are_the_machines() {
    use lazarus_planner::job::{ReconfigKind, RecoveryPolicy};
    use lazarus_planner::migrate::{PhysicalNode, lost_experts};
    use lazarus_simulator::cost;
    use lazarus_simulator::replay::systems::Ctx;
    use lazarus_simulator::replay::systems::lazarus::{Driver, Order};
    let (hw, model) = (
        cost::hardware("rtx3090-100g").unwrap(),
        cost::model("gpt-s").unwrap(),
    );
    let ctx = Ctx {
        hw: &hw,
        model: &model,
    };
    // Checkpoints every 50 steps, so the one saved after step 249 is due and committed.
    let mut started = Driver::new(
        &ctx,
        Some(50),
        Some(200),
        200,
        120_000,
        RecoveryPolicy::Replan,
    );
    let nodes: Vec<u32> = (0..4).collect();
    let Some(Order::Start { layout }) = started.nodes_ready(&ctx, 0, &nodes) else {
        panic!("four nodes start the job");
    };
    started.reconfigured(&ctx, 0);
    // Skewed routing: at the rebalance (step 200) expert 0 takes most slots, the others keep
    // the f = 2 minimum, so some pairs of nodes hold every replica of an expert.
    let mut routing = vec![vec![1; 8]; 12];
    routing.iter_mut().for_each(|l| l[0] = 1000);
    started.steps_done(&ctx, 1_000_000_000, 0, 199, &routing);
    assert!(started.pause_wanted(), "a rebalance every 200 steps");
    let Some(Order::Reconfigure {
        kind: ReconfigKind::Rebalance,
        layout,
        ..
    }) = started.at_boundary(&ctx, 1_000_000_000, 200, &layout)
    else {
        panic!("the rebalance replans in place");
    };
    started.reconfigured(&ctx, 1_000_000_000);
    started.steps_done(&ctx, 2_000_000_000, 200, 249, &routing);
    started.checkpoint_saved(&ctx, 2_000_000_000, 250);
    let survivors = |dead: &[u32]| -> Vec<PhysicalNode> {
        layout
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, id)| !dead.contains(id))
            .map(|(i, &id)| PhysicalNode {
                id,
                holdings: layout.held(i),
            })
            .collect()
    };
    let (mut restores, mut in_place) = (0, 0);
    for a in 0..4u32 {
        for b in a..4u32 {
            let dead: Vec<u32> = if a == b { vec![a] } else { vec![a, b] };
            let lost = !lost_experts(&survivors(&dead), 12, 8).is_empty();
            let mut d = started.clone();
            match d.failure_detected(&ctx, 3_000_000_000, &dead, 250, &layout) {
                Some(Order::Restore { step, layout: l }) => {
                    assert!(lost, "{dead:?}: restored with every expert alive");
                    assert_eq!(step, 250, "the newest checkpoint");
                    assert_eq!(l.nodes.len(), 4 - dead.len());
                    restores += 1;
                }
                Some(Order::Reconfigure {
                    kind,
                    layout: l,
                    migration,
                    membership_changed,
                }) => {
                    assert!(!lost, "{dead:?}: in place with an expert lost");
                    assert_eq!(kind, ReconfigKind::InPlace);
                    assert!(membership_changed);
                    assert_eq!(
                        migration.bytes,
                        migration.replicas * model.bytes_per_expert_state
                    );
                    assert!(l.nodes.iter().all(|n| !dead.contains(n)));
                    assert_eq!(d.machine().next_step(), 250, "progress is kept");
                    in_place += 1;
                }
                other => panic!("{dead:?}: {other:?}"),
            }
        }
    }
    // Every single failure is recovered in place (f = 2); some pairs lose an expert.
    assert!(in_place >= 4 && restores > 0, "{in_place} {restores}");
}

/// End to end: losing two of three nodes leaves too few slots (the job waits), and the nodes
/// that join later cannot bring back the experts only the dead held: a restore. One node that
/// joins a running job is taken in after the lazy scale-out wait.
#[test]
fn lazarus_restores_after_losing_experts_and_scales_out_lazily() {
    let dir = tmp("lz-machine");
    std::fs::create_dir_all(&dir).unwrap();
    let restore = dir.join("restore.csv");
    std::fs::write(
        &restore,
        "0,add,a\n0,add,b\n0,add,c\n600000,remove,a\n600000,remove,b\n660000,add,d\n660000,add,e\n",
    )
    .unwrap();
    let join = dir.join("join.csv");
    std::fs::write(&join, "0,add,a\n0,add,b\n300000,add,c\n").unwrap();
    let run = |trace: &Path, rebalance: &str| {
        ok_json(&[
            "replay",
            trace.to_str().unwrap(),
            "--model",
            "gpt-s",
            "--system",
            "lazarus",
            "--end",
            "20m",
            "--rebalance-every",
            rebalance,
            "--format",
            "json",
        ])
    };
    let r = run(&restore, "200");
    let lz = by_system(&r, "lazarus");
    assert_eq!(lz["fallbacks"], 1, "{lz}");
    assert_eq!(lz["recoveries"], 0, "{lz}");
    // Without rebalances the lazy scale-out takes the newcomer in (one reconfiguration)...
    let j = run(&join, "0");
    let lz = by_system(&j, "lazarus");
    assert_eq!(lz["scale_outs"], 1, "{lz}");
    assert_eq!(lz["fallbacks"], 0, "{lz}");
    // ...with them, the first rebalance during the wait does (gpt-s trains 200 steps in < 2 min).
    let j = run(&join, "200");
    let lz = by_system(&j, "lazarus");
    assert_eq!(lz["scale_outs"], 0, "{lz}");
    let used = lz["avg_used_nodes"].as_f64().unwrap();
    assert!(used > 2.5, "{lz}");
    std::fs::remove_dir_all(dir).ok();
}

/// Issue 14: a trace error printed each part twice (`f: line 3: X: line 3: X`), because the
/// file wrapper displayed its cause and also returned it as the source that `{:#}` prints.
#[test]
fn trace_errors_say_each_part_once() {
    let dir = tmp("chain");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad-op.csv");
    std::fs::write(&bad, "0,add,a\n0,add,b\n100,bogus,a\n").unwrap();
    let out = lzsim(&["replay", bad.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.matches("line 3").count(), 1, "{err}");
    assert_eq!(err.matches("bogus").count(), 1, "{err}");
    assert_eq!(err.matches("bad-op.csv").count(), 1, "{err}");
    let missing = dir.join("missing.csv");
    let out = lzsim(&["replay", missing.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.matches("missing.csv").count(), 1, "{err}");
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    std::fs::remove_dir_all(dir).ok();
}

/// Runs lzsim, killing it after `limit_s`: before issue 14 some of these inputs ran for days.
fn lzsim_within(args: &[&str], limit_s: u64) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lzsim"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run lzsim");
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed().as_secs() >= limit_s {
            child.kill().ok();
            child.wait().ok();
            panic!("lzsim {args:?} still running after {limit_s} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// Issue 14: the simulated time and every period are bounded. `--end 99999999999h` and a trace
/// event at 10^11 ms made the engine step through years of training (or overflow its
/// nanosecond clock), and `--sample-every 0s` wrote empty time series with exit 0.
#[test]
fn durations_are_bounded_and_periods_positive() {
    let dir = tmp("durations");
    std::fs::create_dir_all(&dir).unwrap();
    let far = dir.join("far.csv");
    std::fs::write(&far, "0,add,a\n0,add,b\n100000000000,remove,a\n").unwrap();
    let out = dir.join("run");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["replay", "--end", "99999999999h"],
            "--end \"99999999999h\" is longer than the limit of 365d",
        ),
        (
            vec!["replay", far.to_str().unwrap()],
            "later than the limit of 365d",
        ),
        (
            vec![
                "replay",
                "--sample-every",
                "0s",
                "--out",
                out.to_str().unwrap(),
            ],
            "--sample-every \"0s\" must be at least 1ms",
        ),
        (
            vec!["replay", "--end", "200d", "--out", out.to_str().unwrap()],
            "samples per system, more than the limit",
        ),
        (
            vec!["replay", "--end", "0s"],
            "--end \"0s\" must be at least 1ms",
        ),
        (vec!["replay", "--window", "0s..400d"], "--window"),
        (vec!["replay", "--boot", "400d"], "--boot"),
        (
            vec!["sweep", "--tick", "0.1ms"],
            "--tick \"0.1ms\" must be at least 1ms",
        ),
        (vec!["sweep", "--duration", "400d"], "--duration"),
        (
            vec!["sweep", "--duration", "365d", "--tick", "1ms"],
            "random draws, more than the limit",
        ),
        (
            vec![
                "failures",
                "--hazard",
                "0.1",
                "--tick",
                "1ms",
                "--duration",
                "365d",
            ],
            "use a coarser --tick",
        ),
        (
            vec!["failures", "--every", "0s"],
            "--every \"0s\" must be at least 1ms",
        ),
    ];
    for (args, needle) in cases {
        let o = lzsim_within(&args, 30);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
    assert!(!out.exists(), "a rejected run created its directory");
    std::fs::remove_dir_all(dir).ok();
}

/// Issue 14: trace events after `--end` are never simulated, so their times (up to u64 ms,
/// beyond the engine's u64 nanosecond clock) must not overflow it.
#[test]
fn events_after_the_end_do_not_overflow_the_clock() {
    let dir = tmp("overflow");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("max.csv");
    // Four nodes: the default model trains on them (on two, no system can, an error).
    std::fs::write(
        &trace,
        "0,add,a\n0,add,b\n0,add,c\n0,add,d\n18446744073709551615,remove,a\n",
    )
    .unwrap();
    let v = ok_json(&[
        "replay",
        trace.to_str().unwrap(),
        "--end",
        "30m",
        "--format",
        "json",
    ]);
    assert_eq!(by_system(&v, "ds")["preemptions"], 0);
    assert_eq!(by_system(&v, "ds")["duration_s"], 1800.0);
    std::fs::remove_dir_all(dir).ok();
}
