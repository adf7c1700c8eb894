//! End-to-end runs of the `lzrun` binary: `lzrun local` starts a controller and one agent
//! process per node, each agent its worker process; workers train over loopback TCP. Faults
//! are real SIGKILLs of a node's process group.
//!
//! The runs share two cores, so they take a lock and run one at a time (recovery times are
//! measured, and parallel runs would measure the machine's load instead).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use lazarus_executor::faults::{Fault, chaos_schedule};
use lazarus_executor::model::MoeConfig;
use lazarus_executor::worker::Checksums;

mod process;
use process::{Outcome, assert_consistent, assert_fsep_consistent, run_within};

const LZRUN: &str = env!("CARGO_BIN_EXE_lzrun");
const LIMIT: Duration = Duration::from_secs(300);
static SERIAL: Mutex<()> = Mutex::new(());

/// Runs `lzrun args…` (one at a time) and kills it if it takes longer than [`LIMIT`].
fn lzrun(args: &[&str]) -> Outcome {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Command::new(LZRUN).args(args))
}

fn run(cmd: &mut Command) -> Outcome {
    run_within(cmd, LIMIT)
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lzrun-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn local_with_no_arguments_trains_and_the_loss_falls() {
    let o = lzrun(&["local"]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(
        o.stdout.contains(" step       19/      19 |"),
        "{}",
        o.show()
    );
    assert!(o.stdout.contains("lm loss: "), "{}", o.show());
    // A CPU has no default peak: the data wait is there, MFU is not (issue 31 item 5).
    assert!(o.stdout.contains(" | data wait (ms): "), "{}", o.show());
    assert!(!o.stdout.contains("MFU"), "{}", o.show());

    let dir = scratch("default");
    let d = dir.to_str().unwrap();
    let metrics = dir.join("metrics");
    let m = metrics.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--format",
        "json",
        "--out",
        d,
        "--metrics-out",
        m,
        "--peak-tflops",
        "1",
    ]);
    let s = o.summary();
    // Given a peak, every step has an MFU, and the summary says what it rests on.
    assert_eq!(s.peak_tflops, Some(1.0));
    assert_eq!(s.model_flops_per_token, Some(740_352.0));
    assert!(s.mfu > 0.0 && s.step_tokens_per_s > 0.0, "{s:?}");
    let steps: Vec<lazarus_executor::metrics::StepRecord> =
        csv::Reader::from_path(metrics.join("steps.csv"))
            .unwrap()
            .deserialize()
            .collect::<Result<_, _>>()
            .unwrap();
    assert_eq!(steps.len(), 20);
    for r in &steps {
        assert!(r.tokens_per_s > 0.0 && r.mfu > 0.0, "{r:?}");
        assert!(r.data_wait_ms >= 0.0 && r.data_wait_ms < r.step_ms, "{r:?}");
    }
    assert_eq!(s.steps, 20);
    assert!(
        s.final_loss < s.initial_loss - 1.0,
        "loss {} → {}",
        s.initial_loss,
        s.final_loss
    );
    assert_eq!((s.recoveries, s.fallbacks), (0, 0));
    assert!(s.recovery_ms.is_empty());
    let sums = assert_consistent(&dir, &MoeConfig::tiny());
    assert_eq!(sums.len(), 2);
    for f in [
        "summary.json",
        "timeseries.csv",
        "steps.csv",
        "reconfigurations.jsonl",
    ] {
        assert!(metrics.join(f).is_file(), "{f} missing");
    }
    let ts = std::fs::read_to_string(metrics.join("timeseries.csv")).unwrap();
    assert_eq!(
        ts.lines().next(),
        Some("t_s,live_nodes,used_nodes,state,steps,samples,throughput_samples_per_s")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn killing_one_of_four_nodes_recovers_in_place() {
    let dir = scratch("kill");
    let d = dir.to_str().unwrap();
    let o = lzrun(&[
        "local", "--nodes", "4", "--steps", "12", "--kill", "2@5", "--format", "json", "--out", d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 12);
    assert_eq!((s.recoveries, s.fallbacks), (1, 0), "{}", o.show());
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "in-place")
        .unwrap();
    assert_eq!((rec.nodes_before, rec.nodes_after), (4, 3), "{rec:?}");
    for ms in [rec.detect_ms, rec.replan_ms, rec.migrate_ms, rec.resume_ms] {
        assert!(ms >= 0.0, "{rec:?}");
    }
    // The issue's goal on loopback; measured ≈ 0.3–0.5 s on this 2-core machine.
    assert!(s.recovery_ms[0] < 3_000.0, "recovery took {rec:?}");
    assert_eq!(s.final_live_nodes, 3);
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kill of rank 0 (the writer of `dense.bin`) right after step 4, when the checkpoint after
/// step 4 is due: it used to fail ("expected part dense.bin is not in the manifest", the
/// survivors' parts being committed without the killed node's), or to be skipped without a
/// word when the survivors' parts came after the recovery began (measured: 4 runs of 4, one
/// way or the other). The recovery resumes at step 5 and its members write that checkpoint
/// again: it is committed whole, whenever the kill lands.
#[test]
fn a_checkpoint_due_when_its_dense_writer_is_killed_is_committed_whole() {
    let dir = scratch("kill-ckpt-writer");
    let ck = dir.join("ckpt");
    let o = lzrun(&[
        "local",
        "--nodes",
        "3",
        "--steps",
        "12",
        "--kill",
        "0@4",
        "--ckpt-every",
        "5",
        "--ckpt-keep",
        "5",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 12);
    assert_eq!((s.recoveries, s.fallbacks), (1, 0), "{}", o.show());
    let failed = |l: &&str| l.contains("checkpoint") && l.contains("failed");
    assert_eq!(o.stderr.lines().find(failed), None, "{}", o.show());
    for label in ["after step 4", "after step 9", "after step 11"] {
        let line = format!("checkpoint {label} committed");
        assert!(o.stderr.contains(&line), "no {line:?}: {}", o.show());
    }
    // A committed checkpoint's manifest lists every part (the commit checks it).
    let manifest = std::fs::read_to_string(ck.join("step-00000005").join("manifest.json"))
        .expect("the checkpoint after step 4");
    assert!(manifest.contains("dense.bin"), "{manifest}");
    assert_latest_checkpoint_is_finite(&ck, &MoeConfig::tiny());
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Three hosts of two CPU workers each (`--gpus-per-node 2`): replicas are placed per host,
/// and killing host 1's agent takes both its workers (ranks 2 and 3) in one failure, which
/// the other two hosts survive in place, with no checkpoint restore.
#[test]
fn killing_one_host_of_two_gpus_takes_both_ranks_and_recovers_in_place() {
    let dir = scratch("hosts");
    let d = dir.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--nodes",
        "3",
        "--gpus-per-node",
        "2",
        "--steps",
        "12",
        "--kill",
        "1@5",
        "--ckpt-every",
        "4",
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 12);
    assert_eq!((s.recoveries, s.fallbacks), (1, 0), "{}", o.show());
    assert!(
        !s.reconfigurations.iter().any(|r| r.kind == "checkpoint"),
        "{}",
        o.show()
    );
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "in-place")
        .unwrap();
    // Both workers of the host left in the one reconfiguration.
    assert_eq!((rec.nodes_before, rec.nodes_after), (6, 4), "{rec:?}");
    assert!(
        o.stderr.contains("killed node n1 (ranks 2 and 3)"),
        "{}",
        o.show()
    );
    assert!(o.stderr.contains("its host n1 failed"), "{}", o.show());
    assert_eq!(s.final_live_nodes, 4);
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tiny on 4 nodes: 2 slots each, MRO puts experts {0, 1} of every layer on nodes 0 and 1
/// only, so killing both loses them and the survivors restore the last checkpoint.
#[test]
fn losing_every_replica_falls_back_to_the_checkpoint_and_completes() {
    let dir = scratch("fallback");
    let d = dir.to_str().unwrap();
    let ck = dir.join("ckpt");
    let o = lzrun(&[
        "local",
        "--nodes",
        "4",
        "--steps",
        "12",
        "--kill",
        "0@6",
        "--kill",
        "1@6",
        "--ckpt-every",
        "4",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 12);
    assert_eq!(s.fallbacks, 1, "{}", o.show());
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "checkpoint")
        .unwrap();
    assert_eq!(
        rec.resume_step, 4,
        "restored the step-4 checkpoint: {rec:?}"
    );
    assert!(o.stderr.contains("lost every replica"), "{}", o.show());
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 2);
    // Committed checkpoints only, newest 3, and a pointer to the last.
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step-00000012");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14 item 3: one survivor of four cannot hold every expert. The job waits for nodes
/// (saying for what), `lzrun local` starts the scheduled joins at once instead of after steps
/// that cannot come, and the job restores the newest checkpoint onto the survivor and the
/// newcomer.
#[test]
fn too_few_survivors_wait_for_joins_then_restore() {
    let dir = scratch("too-few");
    let d = dir.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--nodes",
        "4",
        "--steps",
        "10",
        "--kill",
        "0@4",
        "--kill",
        "1@4",
        "--kill",
        "2@4",
        "--join",
        "@7",
        "--ckpt-every",
        "2",
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 10, "{}", o.show());
    assert!(
        o.stderr.contains("waiting for nodes") && o.stderr.contains("need at least 2 nodes"),
        "{}",
        o.show()
    );
    assert!(
        o.stderr.contains("early (scheduled after step 7)"),
        "{}",
        o.show()
    );
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "checkpoint")
        .unwrap_or_else(|| panic!("no restore\n{}", o.show()));
    assert_eq!(rec.resume_step, 4, "{rec:?}");
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With no join left to wait for, `lzrun local` says so at once (exit 2) instead of hanging.
#[test]
fn too_few_survivors_and_no_joins_left_exit_2() {
    let o = lzrun(&[
        "local", "--nodes", "4", "--steps", "10", "--kill", "0@3", "--kill", "1@3", "--kill", "2@3",
    ]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(o.stderr.contains("starts no more"), "{}", o.show());
}

#[test]
fn without_checkpoints_a_lost_expert_ends_the_job_with_exit_2() {
    let o = lzrun(&[
        "local",
        "--nodes",
        "4",
        "--steps",
        "8",
        "--kill",
        "0@3",
        "--kill",
        "1@3",
        "--ckpt-every",
        "0",
    ]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    let line = o
        .stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line\n{}", o.show()));
    assert!(
        line.contains("expert 0 of layer 0") && line.contains("lost every replica"),
        "{line}"
    );
}

#[test]
fn a_joining_node_receives_experts() {
    let dir = scratch("join");
    let d = dir.to_str().unwrap();
    let o = lzrun(&[
        "local", "--nodes", "3", "--steps", "10", "--join", "@3", "--format", "json", "--out", d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 10);
    assert_eq!(s.joins, 1, "{}", o.show());
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "join")
        .unwrap();
    assert_eq!((rec.nodes_before, rec.nodes_after), (3, 4), "{rec:?}");
    assert!(rec.transfers > 0 && rec.bytes > 0, "{rec:?}");
    let sums = assert_consistent(&dir, &MoeConfig::tiny());
    assert_eq!(sums.len(), 4);
    let joined = sums.iter().find(|c| c.node == Some(3)).expect("node 3");
    assert!(!joined.replicas.is_empty(), "the new node holds no expert");
    let _ = std::fs::remove_dir_all(&dir);
}

/// 20+ seeded faults (kills, simultaneous kills, joins) on 4 nodes; the run completes, the
/// replicas are consistent at the end, and no step after the 10th has a loss above the first
/// step's (bug 4: the old recipe spiked in about one run in six).
#[test]
fn seeded_chaos_run_finishes_with_consistent_replicas() {
    let steps = 40;
    let sched = chaos_schedule(7, 4, steps, 20, 2).unwrap();
    assert!(sched.len() >= 20);
    // The schedule mixes joins, single kills and kills of several nodes at one step.
    let mut kills_at: BTreeMap<u64, usize> = BTreeMap::new();
    for ev in sched.events.iter().filter(|e| e.fault.is_kill()) {
        *kills_at.entry(ev.after_step).or_default() += 1;
    }
    assert!(
        sched.joins() >= 1 && kills_at.values().any(|&n| n >= 2),
        "{sched:?}"
    );
    let mut args: Vec<String> = ["local", "--nodes", "4", "--steps", &steps.to_string()]
        .iter()
        .map(ToString::to_string)
        .collect();
    for ev in &sched.events {
        match &ev.fault {
            Fault::Kill { node } => {
                args.extend(["--kill".into(), format!("{node}@{}", ev.after_step)])
            }
            Fault::Join { .. } => args.extend(["--join".into(), format!("@{}", ev.after_step)]),
            other => unreachable!("chaos schedules kill by index and join only: {other:?}"),
        }
    }
    let dir = scratch("chaos");
    let d = dir.to_str().unwrap().to_owned();
    let metrics = dir.join("metrics");
    args.extend(
        [
            "--ckpt-every",
            "2",
            "--timeout-ms",
            "3000",
            "--format",
            "json",
            "--metrics-out",
            metrics.to_str().unwrap(),
            "--out",
        ]
        .iter()
        .map(ToString::to_string),
    );
    args.push(d);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = lzrun(&argv);
    let s = o.summary();
    assert_eq!(s.steps, steps);
    let reconfigs = s
        .reconfigurations
        .iter()
        .filter(|r| r.kind != "start")
        .count();
    assert!(
        reconfigs >= 8,
        "only {reconfigs} reconfigurations\n{}",
        o.show()
    );
    assert!(s.joins >= 1 && s.recoveries + s.fallbacks >= 1, "{s:?}");
    assert!(s.final_loss.is_finite() && s.final_loss < s.initial_loss);
    assert_no_loss_spike(&metrics, s.initial_loss);
    assert_consistent(&dir, &MoeConfig::tiny());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Once training has settled (after step 10), no step's mean loss exceeds the initial loss:
/// a worker computing with the wrong state (fresh weights, a replica or moments that did not
/// arrive, a stale shard) shows up as a spike.
fn assert_no_loss_spike(metrics: &Path, initial_loss: f64) {
    let mut r = csv::Reader::from_path(metrics.join("steps.csv")).unwrap();
    let h = r.headers().unwrap().clone();
    let col = |name: &str| h.iter().position(|c| c == name).unwrap();
    let (si, li) = (col("step"), col("loss"));
    for rec in r.records() {
        let rec = rec.unwrap();
        let step: u64 = rec[si].parse().unwrap();
        let loss: f64 = rec[li].parse().unwrap();
        assert!(
            step <= 10 || loss <= initial_loss,
            "step {step}: loss {loss} above the initial {initial_loss}"
        );
    }
}

/// Bug 4 of the control-plane issue: a one-step loss spike after some reconfigurations (a
/// mean loss of 11.5 at step 59 of this run, 3.0 before and after). Not a race: the members
/// held identical states; the training recipe (gradients summed over the members, AdamW at
/// lr 3e-3 with β2 0.999, no clipping) was unstable under membership changes. With the
/// gradient mean over the members and global-norm clipping (see the executor README, "Known
/// limits") no step after the 10th exceeds the initial loss. Runs the Bamboo P3 trace; skipped
/// without it.
#[test]
fn a_p3_spot_trace_run_has_no_loss_spike_and_consistent_replicas() {
    let Some(trace) = lazarus_traces::shared::or_skip("bamboo/traces/p3-trace.csv") else {
        return;
    };
    let dir = scratch("p3");
    let metrics = dir.join("metrics");
    let o = lzrun(&[
        "local",
        "--fault-trace",
        trace.to_str().unwrap(),
        "--nodes",
        "8",
        // The mapping this test was written with (before --map, lzrun always clamped).
        "--map",
        "clamp",
        "--steps",
        "100",
        "--time-scale",
        "150",
        "--format",
        "json",
        "--metrics-out",
        metrics.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 100);
    assert!(s.recoveries + s.fallbacks >= 5, "{s:?}");
    assert_no_loss_spike(&metrics, s.initial_loss);
    assert_consistent(&dir, &MoeConfig::tiny());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Train 12 steps with checkpoints every 4; corrupt the newest checkpoint; resume: the
/// corrupt one is skipped, training restarts from step 8, and steps 8..11 have exactly the
/// losses of the uninterrupted run (same nodes, same data, deterministic reductions: the
/// tolerance is 1e-6 relative, and in practice the values are bit-identical).
#[test]
fn resume_from_checkpoint_equals_the_uninterrupted_run() {
    let dir = scratch("resume");
    let ck = dir.join("ckpt");
    let c = ck.to_str().unwrap();
    let first = dir.join("first");
    let o = lzrun(&[
        "local",
        "--steps",
        "12",
        "--ckpt-every",
        "4",
        "--ckpt-dir",
        c,
        "--format",
        "json",
        "--metrics-out",
        first.to_str().unwrap(),
    ]);
    assert_eq!(o.summary().steps, 12);
    let dense = ck.join("step-00000012").join("dense.bin");
    let mut bytes = std::fs::read(&dense).unwrap();
    bytes[100] ^= 0x5a;
    std::fs::write(&dense, bytes).unwrap();
    let second = dir.join("second");
    let o = lzrun(&[
        "local",
        "--steps",
        "12",
        "--resume",
        c,
        "--ckpt-every",
        "0",
        "--format",
        "json",
        "--metrics-out",
        second.to_str().unwrap(),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stderr.contains("skipped checkpoint"), "{}", o.show());
    let losses = |d: &Path| -> BTreeMap<u64, f64> {
        let mut r = csv::Reader::from_path(d.join("steps.csv")).unwrap();
        let h = r.headers().unwrap().clone();
        let (si, li) = (
            h.iter().position(|c| c == "step").unwrap(),
            h.iter().position(|c| c == "loss").unwrap(),
        );
        r.records()
            .map(|x| {
                let x = x.unwrap();
                (x[si].parse().unwrap(), x[li].parse().unwrap())
            })
            .collect()
    };
    let (a, b) = (losses(&first), losses(&second));
    assert_eq!(b.keys().copied().collect::<Vec<_>>(), vec![8, 9, 10, 11]);
    for (step, lb) in &b {
        let la = a[step];
        assert!(
            (la - lb).abs() <= 1e-6 * la.abs(),
            "step {step}: {la} uninterrupted vs {lb} resumed"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn assert_error(o: &Outcome, want: &str) {
    assert_eq!(o.code, Some(2), "{}", o.show());
    let line = o
        .stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line\n{}", o.show()));
    assert!(line.contains(want), "wanted {want:?} in {line:?}");
    assert!(!o.stderr.contains("panicked"), "{}", o.show());
}

#[test]
fn bad_input_exits_2_with_a_clear_error() {
    assert_error(&lzrun(&["local", "--nodes", "0"]), "node");
    assert_error(&lzrun(&["local", "--bogus"]), "--bogus");
    assert_error(&lzrun(&["local", "--config", "huge"]), "huge");
    assert_error(&lzrun(&["local", "--kill", "5@2"]), "5");
    assert_error(&lzrun(&["local", "--kill", "x"]), "x");
    assert_error(&lzrun(&["local", "--steps", "4", "--kill", "0@3"]), "3");

    let dir = scratch("bad");
    let toml = dir.join("train.toml");
    std::fs::write(&toml, "base = \"tiny\"\nd_model = \"wide\"\n").unwrap();
    let metrics = dir.join("metrics");
    let o = lzrun(&[
        "local",
        "--config",
        toml.to_str().unwrap(),
        "--metrics-out",
        metrics.to_str().unwrap(),
    ]);
    assert_error(&o, "train.toml");
    assert!(!metrics.exists(), "nothing may be written for a bad config");
    std::fs::write(&toml, "base = \"tiny\"\nwidth = 3\n").unwrap();
    assert_error(
        &lzrun(&["local", "--config", toml.to_str().unwrap()]),
        "unknown field \"width\"",
    );
    std::fs::write(&toml, "base = \"tiny\"\nn_heads = 5\n").unwrap();
    assert_error(
        &lzrun(&["local", "--config", toml.to_str().unwrap()]),
        "n_heads",
    );
    let trace = dir.join("trace.csv");
    std::fs::write(&trace, "0,add,a\n0,add,b\nsoon,remove,a\n").unwrap();
    assert_error(
        &lzrun(&["local", "--fault-trace", trace.to_str().unwrap()]),
        "line 3",
    );
    // Issue 33 item 6.8: `--map` with lzsim's parser (and only with a trace).
    let t = trace.to_str().unwrap();
    let o = lzrun(&["local", "--fault-trace", t, "--map", "squash"]);
    assert_error(
        &o,
        "invalid fit mode 'squash' (expected 'clamp', 'track' or 'scale')",
    );
    assert_error(&lzrun(&["local", "--map", "clamp"]), "--fault-trace");
    // Issue 35 item 6: without --nodes nothing is fitted, and --map did nothing.
    assert_error(
        &lzrun(&["local", "--fault-trace", t, "--map", "clamp"]),
        "not provided: --nodes <NODES>",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 43, item 6: every refused run left a `lzrun-ckpt-<pid>` directory in the temporary
/// directory, holding only its `lzrun.lock` (the checkpoint directory was made and locked
/// before the later checks refused the run). A refused run leaves nothing behind.
#[test]
fn a_refused_run_leaves_nothing_in_the_temporary_directory() {
    let dir = scratch("refused-tmp");
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let missing = dir.join("no-such-data");
    let refused: [&[&str]; 3] = [
        &["local", "--data", missing.to_str().unwrap()],
        &["local", "--global-batch", "3", "--micro-batch", "2"],
        &[
            "local",
            "--eval-data",
            missing.to_str().unwrap(),
            "--eval-every",
            "2",
        ],
    ];
    for args in refused {
        let o = run(Command::new(LZRUN).env("TMPDIR", &tmp).args(args));
        assert_eq!(o.code, Some(2), "{args:?}: {}", o.show());
        let left: Vec<_> = std::fs::read_dir(&tmp)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            left.is_empty(),
            "{args:?} left {left:?} behind: {}",
            o.show()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33 item 6.1: `lzrun local --slots 18446744073709551615` (or `--fault-tolerance`)
/// panicked in the planner inside the controller and `lzrun local` never exited; other flags
/// sized vectors or were added to clocks. Every numeric flag of every subcommand now has a
/// bound: an absurd value is one line naming the flag and the bound, exit 2, at once.
#[test]
fn absurd_numbers_in_any_flag_exit_2_at_once_naming_the_flag_and_its_bound() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const HUGE: &str = "18446744073709551615";
    let dir = scratch("absurd");
    let profile = dir.join("p.toml");
    let profile = profile.to_str().unwrap();
    let job_flags = [
        "--steps",
        "--fault-tolerance",
        "--slots",
        "--ckpt-every",
        "--ckpt-keep",
        "--max-ckpt-failures",
        "--max-nonfinite-steps",
        "--rebalance-every",
        "--relayout-warmup",
        "--shard-copies",
        "--timeout-ms",
        "--step-timeout-max-ms",
        "--heartbeat-timeout-ms",
        "--wait-for-nodes-ms",
    ];
    let mut cases: Vec<(Vec<&str>, &str)> = Vec::new();
    for flag in job_flags.iter().chain(&[
        "--nodes",
        "--controller-down-ms",
        "--gpus-per-node",
        "--storm",
    ]) {
        cases.push((vec!["local"], flag));
    }
    cases.push((vec!["local", "--storm", "1"], "--storm-min-live"));
    for flag in job_flags.iter().chain(&["--nodes"]) {
        cases.push((vec!["controller", "--token", "t"], flag));
    }
    for flag in [
        "--heartbeat-ms",
        "--register-timeout-ms",
        "--reconnect-grace-ms",
        "--gpus-per-node",
    ] {
        cases.push((
            vec!["agent", "--controller", "127.0.0.1:1", "--token", "t"],
            flag,
        ));
    }
    let peers = ["worker", "--peers", "127.0.0.1:1,127.0.0.1:2"];
    cases.push((
        peers.iter().chain(&["--world", "2"]).copied().collect(),
        "--rank",
    ));
    cases.push((
        peers.iter().chain(&["--rank", "0"]).copied().collect(),
        "--world",
    ));
    cases.push((vec!["worker", "--managed"], "--timeout-ms"));
    cases.push((vec!["worker", "--managed"], "--steps"));
    cases.push((vec!["calibrate", "--out", profile], "--steps"));
    cases.push((vec!["calibrate", "--out", profile], "--nodes"));
    for (args, flag) in &cases {
        let t = Instant::now();
        let o = run_within(
            Command::new(LZRUN).args(args).args([flag, HUGE]),
            Duration::from_secs(60),
        );
        let line = format!("{} {flag} {HUGE}", args.join(" "));
        assert_eq!(o.code, Some(2), "{line}\n{}", o.show());
        assert!(!o.stderr.contains("panicked"), "{line}\n{}", o.show());
        assert_eq!(o.stderr.lines().count(), 1, "{line}\n{}", o.show());
        assert!(
            o.stderr
                .contains(&format!("error: {flag} {HUGE} is out of range")),
            "{line}\n{}",
            o.show()
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{line} took {:?}",
            t.elapsed()
        );
    }
    drop(_serial);
    // Bounds that depend on the model or on other flags name them.
    assert_error(&lzrun(&["local", "--slots", "5"]), "between 1 and 4");
    assert_error(
        &lzrun(&["local", "--router-skew", "1e300"]),
        "--router-skew",
    );
    // Issue 31 item 5: a peak that is no positive number of TFLOP/s, or a typo'd exponent.
    for (peak, want) in [
        (
            "0",
            "--peak-tflops must be a positive number of TFLOP/s of one device, got 0",
        ),
        ("nan", "--peak-tflops must be a positive number"),
        (
            "1e300",
            "--peak-tflops 1e300 is out of range: it must be between 0 and 1000000",
        ),
    ] {
        let o = lzrun(&["local", "--peak-tflops", peak]);
        assert_error(&o, want);
        assert_eq!(o.stderr.lines().count(), 1, "{}", o.show());
        let o = lzrun(&["controller", "--token", "t", "--peak-tflops", peak]);
        assert_error(&o, want);
    }
    let o = lzrun(&[
        "local", "--steps", "5", "--storm", "1000000", "--nodes", "3",
    ]);
    assert_error(
        &o,
        "--storm 1000000 is out of range: it must be between 0 and 3",
    );
    assert!(!profile.is_empty() && !Path::new(profile).exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn agents_are_refused_clearly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Nothing listens on port 1.
    let o = run(Command::new(LZRUN).args(["agent", "--controller", "127.0.0.1:1", "--token", "t"]));
    assert_error(&o, "cannot connect to controller at 127.0.0.1:1");

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut controller = Command::new(LZRUN)
        .args([
            "controller",
            "--listen",
            &addr,
            "--nodes",
            "1",
            "--steps",
            "2",
        ])
        .env("LZRUN_TOKEN", "right")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let agent = |extra: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let o = run(Command::new(LZRUN)
                .args(["agent", "--controller", &addr])
                .args(extra));
            if !o.stderr.contains("cannot connect") || Instant::now() > deadline {
                return o;
            }
            thread::sleep(Duration::from_millis(100));
        }
    };
    let wrong = agent(&["--token", "wrong"]);
    let old = agent(&["--token", "right", "--protocol-version", "1"]);
    let _ = controller.kill();
    let _ = controller.wait();
    assert_error(&wrong, "wrong cluster token");
    assert_error(&old, "protocol version");

    let o = run(Command::new(LZRUN).args(["controller", "--token", ""]));
    assert_error(&o, "token");
}

#[test]
fn help_explains_every_flag() {
    let o = lzrun(&["local", "--help"]);
    assert_eq!(o.code, Some(0));
    for flag in [
        "--nodes",
        "--kill",
        "--join",
        "--fault-trace",
        "--map",
        "--time-scale",
        "--steps",
        "--config",
        "--seed",
        "--ckpt-every",
        "--ckpt-dir",
        "--resume",
        "--rebalance-every",
        "--relayout",
        "--migration",
        "--relayout-warmup",
        "--relayout-threshold",
        "--router-skew",
        "--metrics-out",
        "--format",
        "--timeout-ms",
        "--step-timeout-max-ms",
        "--heartbeat-timeout-ms",
        "--window",
        "--max-ckpt-failures",
        "--data",
        "--data-dtype",
        "--global-batch",
        "--micro-batch",
        "--batch-per-node",
        "--eval-data",
        "--eval-every",
        "--eval-batches",
        "--peak-tflops",
        "--max-nonfinite-steps",
        "--kill-controller",
        "--controller-down-ms",
        "--state-dir",
    ] {
        assert!(o.stdout.contains(flag), "{flag} not in --help");
    }
    for sub in ["controller", "agent", "worker"] {
        let o = lzrun(&[sub, "--help"]);
        assert_eq!(o.code, Some(0), "{sub} --help");
    }
    let o = lzrun(&["controller", "--help"]);
    for flag in ["--state-dir", "--recover", "--listen"] {
        assert!(o.stdout.contains(flag), "{flag} not in controller --help");
    }
    let o = lzrun(&["agent", "--help"]);
    assert!(o.stdout.contains("--reconnect-grace-ms"), "{}", o.stdout);
    // The allocator setting every lzrun process makes, and how to turn it off.
    let o = lzrun(&["--help"]);
    assert!(o.stdout.contains("LAZARUS_MALLOC_TUNING=0"), "{}", o.stdout);
}

/// Processes whose `/proc/PID/<file>` (`cmdline`, `environ`: NUL-separated) satisfies
/// `matches` (Linux; the processes this user may read).
fn processes_whose(file: &str, matches: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let bytes = std::fs::read(e.path().join(file)).ok()?;
        matches(&bytes).then_some(pid)
    })
    .collect()
}

/// Processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    processes_whose("cmdline", |cmd| {
        String::from_utf8_lossy(cmd)
            .replace('\0', " ")
            .contains(needle)
    })
}

/// Processes whose environment holds `entry` (`KEY=VALUE`).
fn processes_with_env(entry: &str) -> Vec<u32> {
    processes_whose("environ", |env| {
        env.split(|&b| b == 0).any(|kv| kv == entry.as_bytes())
    })
}

#[test]
fn ctrl_c_stops_every_process() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Its own TMPDIR: the temporary state and checkpoint directories must be gone afterwards
    // (the controller task, still running at the interruption, wrote its state again after
    // the directory was removed).
    let tmp = scratch("ctrl-c-tmp");
    let mut live = Live::start_cmd(Command::new(LZRUN).env("TMPDIR", &tmp).args([
        "local",
        "--nodes",
        "3",
        "--steps",
        "100000",
        "--ckpt-every",
        "2",
    ]));
    live.wait_for(" step        3/");
    let addr = live.addr.clone();
    assert_eq!(processes_mentioning(&addr).len(), 3, "three agents run");
    // This run's processes: the launcher, three agents and their workers carry its TMPDIR
    // (other runs on the host do not).
    let env = format!("TMPDIR={}", tmp.display());
    let workers: Vec<u32> = processes_mentioning("worker --managed")
        .into_iter()
        .filter(|p| processes_with_env(&env).contains(p))
        .collect();
    assert_eq!(workers.len(), 3, "workers: {workers:?}");
    signal(i32::try_from(live.child.id()).unwrap(), libc::SIGINT);
    let o = live.finish();
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(o.stderr.contains("interrupted"), "{}", o.show());
    let workers_left = || -> Vec<u32> {
        processes_mentioning("worker --managed")
            .into_iter()
            .filter(|p| workers.contains(p))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while (!processes_mentioning(&addr).is_empty() || !workers_left().is_empty())
        && Instant::now() < deadline
    {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        processes_mentioning(&addr),
        Vec::<u32>::new(),
        "agents left behind"
    );
    assert_eq!(workers_left(), Vec::<u32>::new(), "workers left behind");
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Issue 14: `lzrun local | head -3` panicked ("failed printing to stdout", exit 101). A
/// reader that stops early now stops the job like Ctrl-C, and lzrun exits 0 without a word.
#[test]
fn a_closed_stdout_stops_the_job_quietly() {
    use std::io::{BufRead, BufReader};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Long enough that only the closed pipe can end it within the deadline below.
    let mut child = Command::new(LZRUN)
        .args(["local", "--steps", "100000", "--ckpt-every", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let stderr = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let addr = {
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        reader.read_line(&mut first).unwrap();
        let addr = first
            .split("controller ")
            .nth(1)
            .unwrap_or("")
            .trim()
            .to_owned();
        assert!(!addr.is_empty(), "no controller address in {first:?}");
        let mut line = String::new();
        while !line.starts_with(" step ") {
            line.clear();
            assert!(reader.read_line(&mut line).unwrap() > 0, "no step line");
        }
        addr
        // The reader is dropped here: the pipe closes like `| head` exiting.
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lzrun kept running after its stdout closed");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let stderr = stderr.join().unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.code(), Some(0), "{stderr}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_mentioning(&addr).is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        processes_mentioning(&addr),
        Vec::<u32>::new(),
        "agents left behind"
    );
}

/// Issue 14: with stdout on a full disk lzrun panicked; now the job stops with one error line.
#[test]
fn a_full_disk_on_stdout_is_an_error() {
    let full = Path::new("/dev/full");
    if !full.exists() {
        eprintln!("skipped: no /dev/full");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let sink = std::fs::OpenOptions::new().write(true).open(full).unwrap();
    let mut child = Command::new(LZRUN)
        .args(["local", "--steps", "100000", "--ckpt-every", "0"])
        .stdin(Stdio::null())
        .stdout(sink)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = String::new();
    // lzrun closes its stderr only when it exits: a full disk must end the job.
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        "error: cannot write to standard output: No space left on device (os error 28)"
    );
}

/// `lzrun worker` by hand: a fixed two-rank cluster without a controller.
#[test]
fn two_workers_by_hand_train_with_identical_replicas() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ports: Vec<u16> = {
        let ls: Vec<std::net::TcpListener> = (0..2)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
    };
    let peers = format!("127.0.0.1:{},127.0.0.1:{}", ports[0], ports[1]);
    let dir = scratch("by-hand");
    let d = dir.to_str().unwrap().to_owned();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (peers, d) = (peers.clone(), d.clone());
            thread::spawn(move || {
                run(Command::new(LZRUN).args([
                    "worker",
                    "--rank",
                    &rank.to_string(),
                    "--world",
                    "2",
                    "--peers",
                    &peers,
                    "--steps",
                    "3",
                    "--out",
                    &d,
                ]))
            })
        })
        .collect();
    let outs: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for o in &outs {
        assert_eq!(o.code, Some(0), "{}", o.show());
        assert_eq!(
            o.stdout.lines().count(),
            3,
            "one JSON line per step\n{}",
            o.show()
        );
    }
    let sums: Vec<Checksums> = (0..2)
        .map(|r| Checksums::read(&Checksums::path(&dir, r)).expect("checksum file"))
        .collect();
    assert_eq!(sums[0].dense, sums[1].dense, "dense weights differ");
    let mut shared = 0;
    for a in &sums[0].replicas {
        for b in sums[1]
            .replicas
            .iter()
            .filter(|b| (b.layer, b.expert) == (a.layer, a.expert))
        {
            assert_eq!(
                a.checksum, b.checksum,
                "replica ({}, {}) differs",
                a.layer, a.expert
            );
            shared += 1;
        }
    }
    assert!(shared > 0, "no expert is replicated on both workers");
    assert_error(
        &run(Command::new(LZRUN).args([
            "worker",
            "--rank",
            "0",
            "--world",
            "2",
            "--peers",
            "127.0.0.1:1",
        ])),
        "--peers",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Regression tests of the control-plane issue's bugs
// ---------------------------------------------------------------------------------------------

/// Bug 1: a kill that races joins left newcomers on their fresh initialisation (they were taken
/// as full members by the next in-place replan and never got the dense weights): their dense
/// checksums differed, exit 0. Several runs, since the race does not always happen.
#[test]
fn a_kill_racing_joins_leaves_every_copy_of_the_state_identical() {
    for run in 0..3 {
        let dir = scratch(&format!("join-race-{run}"));
        let d = dir.to_str().unwrap();
        let o = lzrun(&[
            "local",
            "--nodes",
            "3",
            "--steps",
            "20",
            "--join",
            "@5",
            "--join",
            "@6",
            "--join",
            "@6",
            "--kill",
            "5@7",
            "--timeout-ms",
            "2000",
            "--format",
            "json",
            "--out",
            d,
        ]);
        let s = o.summary();
        assert_eq!(s.steps, 20, "{}", o.show());
        assert_consistent(&dir, &MoeConfig::tiny());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A running `lzrun local` whose output lines are read as they come.
struct Live {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stdout: Vec<String>,
    stderr: thread::JoinHandle<String>,
    /// The controller address every agent's command line carries.
    addr: String,
}

impl Live {
    fn start(args: &[&str]) -> Self {
        Self::start_cmd(Command::new(LZRUN).args(args))
    }

    fn start_cmd(cmd: &mut Command) -> Self {
        use std::io::{BufRead, BufReader};
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let first = lines.recv_timeout(Duration::from_secs(60)).unwrap();
        let addr = first
            .split("controller ")
            .nth(1)
            .unwrap_or_else(|| panic!("no controller address in {first:?}"))
            .trim()
            .to_owned();
        Self {
            child,
            lines,
            stdout: vec![first],
            stderr,
            addr,
        }
    }

    /// Reads lines until one contains `needle`.
    fn wait_for(&mut self, needle: &str) {
        loop {
            let line = self
                .lines
                .recv_timeout(LIMIT)
                .unwrap_or_else(|_| panic!("no line with {needle:?}: {:?}", self.stdout));
            let found = line.contains(needle);
            self.stdout.push(line);
            if found {
                return;
            }
        }
    }

    /// The pid of node `name`'s agent and of its worker.
    fn node(&self, name: &str) -> (i32, i32) {
        let agents: Vec<u32> = processes_mentioning(&self.addr)
            .into_iter()
            .filter(|&p| {
                let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                String::from_utf8_lossy(&cmd).contains(&format!("\0{name}\0"))
            })
            .collect();
        assert_eq!(agents.len(), 1, "agent {name}: {agents:?}");
        let agent = agents[0];
        let worker = processes_mentioning("worker --managed")
            .into_iter()
            .find(|&p| parent_of(p) == Some(agent))
            .unwrap_or_else(|| panic!("no worker of agent {name}"));
        (agent as i32, worker as i32)
    }

    /// Waits for the end; returns the outcome with every stdout line.
    fn finish(self) -> Outcome {
        self.finish_within(LIMIT)
    }

    /// As [`Live::finish`], failing the test if the run takes longer than `limit`; it is then
    /// stopped with SIGTERM (as a scheduler would), so that it takes its nodes with it.
    fn finish_within(mut self, limit: Duration) -> Outcome {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                signal(self.child.id() as i32, libc::SIGTERM);
                let _ = self.child.wait();
                while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(1)) {
                    self.stdout.push(l);
                }
                panic!(
                    "lzrun did not finish within {limit:?}; the last lines: {:?}",
                    &self.stdout[self.stdout.len().saturating_sub(8)..]
                );
            }
            thread::sleep(Duration::from_millis(20));
        };
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.stdout.push(l);
        }
        Outcome {
            code: status.code(),
            stdout: self.stdout.join("\n"),
            stderr: self.stderr.join().unwrap(),
        }
    }
}

/// The parent pid of `pid` (Linux `/proc`).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`; comm may contain spaces, so split after the last ')'.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process this test started; no memory is shared.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Which process of a node a test stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
    Agent,
    Worker,
}

/// 4 nodes, 60 steps, no checkpoints, `flag`: SIGSTOPs node `name`'s agent or worker after
/// step 3 and returns the outcome and the directory of the replica checksums.
fn run_with_a_stopped_process(name: &str, which: Stopped, flag: [&str; 2]) -> (Outcome, PathBuf) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch(&format!("stopped-{which:?}"));
    let d = dir.to_str().unwrap();
    let mut live = Live::start(&[
        "local",
        "--nodes",
        "4",
        "--steps",
        "60",
        flag[0],
        flag[1],
        "--ckpt-every",
        "0",
        "--out",
        d,
    ]);
    live.wait_for(" step        2/");
    let (agent, worker) = live.node(name);
    signal(
        if which == Stopped::Agent {
            agent
        } else {
            worker
        },
        libc::SIGSTOP,
    );
    (live.finish(), dir)
}

/// Bug 2: a live but stuck worker (SIGSTOP) stalled the job forever: the survivors timed out
/// on it and then nothing happened. It is fenced within the member timeout and the job
/// finishes on the others.
#[test]
fn a_stopped_worker_is_fenced_and_the_job_finishes_without_it() {
    let (o, dir) = run_with_a_stopped_process("n2", Stopped::Worker, ["--timeout-ms", "1000"]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains("node n2 fenced"), "{}", o.show());
    assert!(o.stdout.contains(" step       59/"), "{}", o.show());
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 43, item 6: a worker that dies on its own (SIGKILL of n1's worker alone, not of its
/// node's process group) takes its agent with it, and `lzrun local` still counted that agent
/// as coming: the job waited for it up to the 600 s of `--wait-for-nodes-ms`. The exited node
/// is no longer counted: with no node left to come the job ends at once, saying why.
#[test]
fn a_worker_that_dies_on_its_own_is_not_waited_for() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut live = Live::start_cmd(
        Command::new(LZRUN)
            .env("LZRUN_TEST_STEP_DELAY", "0:200")
            .args(["local", "--nodes", "2", "--steps", "60"])
            .args(["--fault-tolerance", "1", "--ckpt-every", "0"]),
    );
    live.wait_for(" step        2/");
    let (_, worker) = live.node("n1");
    signal(worker, libc::SIGKILL);
    let o = live.finish_within(Duration::from_secs(60));
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(
        o.stdout.contains("node n1 exited on its own"),
        "{}",
        o.show()
    );
    assert!(o.stderr.contains("starts no more"), "{}", o.show());
}

/// A scratch directory holding the embedded corpus, byte-tokenized, as a flat `u16` token
/// file (`--data <bin> --data-dtype u16`): the directory and the file.
fn embedded_corpus_data(name: &str) -> (PathBuf, PathBuf) {
    use lazarus_executor::dataset::{TokenDtype, write_flat};
    use lazarus_executor::model::{ByteTokenizer, EMBEDDED_CORPUS};
    let dir = scratch(name);
    let bin = dir.join("train.bin");
    write_flat(
        &bin,
        TokenDtype::U16,
        &ByteTokenizer::encode(EMBEDDED_CORPUS),
    )
    .unwrap();
    (dir, bin)
}

/// Issue 43, item 6: the dataset's `.bin` truncated while the job trains (`truncate -s 1000`)
/// killed every worker with SIGBUS (a read of the mapping past the file's new end), and no line
/// named the file. The workers check their mapped files before reading a batch: a file that
/// changed under the job is named, and the job ends with exit 2.
#[test]
fn a_data_file_truncated_while_training_is_named_and_the_job_ends_with_exit_2() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, bin) = embedded_corpus_data("truncated-data");
    let mut live = Live::start_cmd(
        Command::new(LZRUN)
            .env("LZRUN_TEST_STEP_DELAY", "0:200")
            .args([
                "local",
                "--nodes",
                "2",
                "--steps",
                "60",
                "--ckpt-every",
                "0",
            ])
            .args(["--data", bin.to_str().unwrap(), "--data-dtype", "u16"]),
    );
    live.wait_for(" step        2/");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&bin)
        .unwrap()
        .set_len(1000)
        .unwrap();
    let o = live.finish_within(Duration::from_secs(60));
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(o.stderr.contains(bin.to_str().unwrap()), "{}", o.show());
    assert!(o.stderr.contains("changed"), "{}", o.show());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 43, item 6: a node that cannot open `--data` (missing on its host: here moved away
/// before the node joins) failed its first step each time it was tried, and the controller
/// replanned with it again at once, for ever (~15,000 epochs and 7 MB of log a minute). A
/// member that fails the same step again and again, among the same members, is fenced: the
/// job goes on without it.
#[test]
fn a_node_that_fails_the_same_step_again_and_again_is_fenced_and_the_job_goes_on() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, bin) = embedded_corpus_data("missing-data");
    let mut live = Live::start_cmd(
        Command::new(LZRUN)
            .env("LZRUN_TEST_STEP_DELAY", "0:200")
            .args([
                "local",
                "--nodes",
                "2",
                "--steps",
                "30",
                "--ckpt-every",
                "0",
            ])
            .args(["--data", bin.to_str().unwrap(), "--data-dtype", "u16"])
            .args(["--join", "@6"]),
    );
    live.wait_for(" step        2/");
    // The running workers keep their open file; the joining node finds none.
    std::fs::rename(&bin, dir.join("elsewhere.bin")).unwrap();
    let o = live.finish_within(Duration::from_secs(120));
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains("node n2 fenced"), "{}", o.show());
    assert!(o.stdout.contains("times in a row"), "{}", o.show());
    assert!(o.stdout.contains(" step       29/"), "{}", o.show());
    let tries = o
        .stdout
        .lines()
        .filter(|l| l.contains("node n2: step") && l.contains("failed"))
        .count();
    assert!(tries <= 5, "{tries} tries: {}", o.show());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bug 3: a node declared gone (its agent stopped: no heartbeat) was not fenced: no
/// reconfiguration, its worker kept training with the others. Now the survivors abort,
/// reconfigure without it, and the job finishes on them.
#[test]
fn a_stopped_agent_is_fenced_and_the_survivors_reconfigure() {
    let (o, dir) =
        run_with_a_stopped_process("n1", Stopped::Agent, ["--heartbeat-timeout-ms", "1000"]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains("no heartbeat"), "{}", o.show());
    assert!(o.stdout.contains("node n1 fenced"), "{}", o.show());
    let reconfigured = o
        .stdout
        .lines()
        .any(|l| l.contains("\"reconfiguration\"") && l.contains("\"nodes_after\":3"));
    assert!(reconfigured, "{}", o.show());
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A trace's remove of a node the controller already fenced (its agent stopped: no heartbeat)
/// and the launcher killed is a logged no-op, as a `--kill` of a gone node is: it used to end
/// `lzrun local` with "trace kills n1, which is not running".
#[test]
fn a_trace_remove_of_a_fenced_node_is_a_no_op() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("trace-remove-fenced");
    let d = dir.to_str().unwrap();
    let trace = dir.join("trace.csv");
    // With one trace second per step, n1's remove fires after step 20, long after the fence
    // (no step is counted while n1's reports are stuck behind its stopped agent).
    std::fs::write(
        &trace,
        "0,add,n0\n0,add,n1\n0,add,n2\n0,add,n3\n20000,remove,n1\n",
    )
    .unwrap();
    let mut live = Live::start(&[
        "local",
        "--fault-trace",
        trace.to_str().unwrap(),
        "--time-scale",
        "1",
        "--steps",
        "30",
        "--heartbeat-timeout-ms",
        "1000",
        "--ckpt-every",
        "0",
        "--out",
        d,
    ]);
    live.wait_for(" step        2/");
    let (agent, _) = live.node("n1");
    signal(agent, libc::SIGSTOP);
    let o = live.finish();
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains("node n1 fenced"), "{}", o.show());
    assert!(
        o.stdout
            .contains("lzrun local: node n1 is gone already; no kill after step 20"),
        "{}",
        o.show()
    );
    assert!(o.stdout.contains(" step       29/"), "{}", o.show());
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rebalance replans from the routing history: with the load-balancing loss off, the router
/// skews and the first rebalance moves expert states (the plan really changes), through the
/// same pause-and-migrate path as a join (`--migration blocking`; the async path is tested in
/// `tests/relayout.rs` and `tests/asyncmig.rs`).
#[test]
fn a_rebalance_under_skewed_routing_changes_the_plan() {
    let dir = scratch("rebalance");
    let config = dir.join("skew.toml");
    std::fs::write(&config, "base = \"tiny\"\nlb_loss_coef = 0.0\n").unwrap();
    let o = lzrun(&[
        "local",
        "--nodes",
        "3",
        "--steps",
        "30",
        "--rebalance-every",
        "5",
        "--migration",
        "blocking",
        "--config",
        config.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 30);
    let rebalances: Vec<_> = s
        .reconfigurations
        .iter()
        .filter(|r| r.kind == "rebalance")
        .collect();
    assert!(rebalances.len() >= 4, "{}", o.show());
    assert!(
        rebalances.iter().any(|r| r.transfers > 0),
        "no rebalance moved anything: {rebalances:?}"
    );
    let versions: Vec<u64> = s.reconfigurations.iter().map(|r| r.plan_version).collect();
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    assert_consistent(&dir, &MoeConfig::tiny());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 43, item 6: sizes no machine can hold, in a `config.json` (`hidden_size` 2^62,
/// 2^40 experts, 10^12 layers) or a TOML config, panicked with "capacity overflow" (exit 101)
/// or aborted on the allocation (134), in `lzrun local` or in its workers. Each is one line
/// naming the field and exit 2, for every command that reads a config; so is a model whose
/// sizes each pass but whose training state no worker of this machine can hold.
#[test]
fn sizes_no_machine_can_hold_are_refused_naming_the_field() {
    let dir = scratch("huge-config");
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/mixtral-tiny.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let cases: [(&str, u64); 5] = [
        ("hidden_size", 1 << 62),
        ("num_local_experts", 1 << 40),
        ("num_hidden_layers", 1_000_000_000_000),
        ("intermediate_size", 1 << 62),
        // Each size passes; the embedding alone is 2^47 parameters.
        ("vocab_size", 1 << 31),
    ];
    for (field, value) in cases {
        let mut cfg = base.clone();
        cfg[field] = value.into();
        if field == "vocab_size" {
            cfg["hidden_size"] = (1u64 << 16).into();
        }
        let path = dir.join(format!("{field}.json"));
        std::fs::write(&path, cfg.to_string()).unwrap();
        let p = path.to_str().unwrap();
        for cmd in [
            &["local", "--steps", "2"][..],
            &[
                "worker",
                "--rank",
                "0",
                "--world",
                "1",
                "--peers",
                "127.0.0.1:1",
            ][..],
        ] {
            let args = [cmd, &["--model-config", p]].concat();
            let o = lzrun(&args);
            let want = if field == "vocab_size" {
                "memory"
            } else {
                field
            };
            assert_error(&o, want);
            assert_eq!(o.stderr.lines().count(), 1, "{args:?}: {}", o.show());
        }
    }
    for (key, value) in [
        ("d_model", "4611686018427387904"),
        ("n_layers", "1000000000000"),
    ] {
        let toml = dir.join(format!("{key}.toml"));
        std::fs::write(&toml, format!("base = \"tiny\"\n{key} = {value}\n")).unwrap();
        let o = lzrun(&["local", "--config", toml.to_str().unwrap(), "--steps", "2"]);
        assert_error(&o, key);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 43, item 6: `lzrun export CKPT --out CKPT` (or a directory under it) was accepted: the
/// model's `config.json` and weights went in among the checkpoints, a directory the job prunes
/// and tidies. Refused with one line, exit 2, and nothing written.
#[test]
fn an_export_into_the_checkpoint_directory_is_refused() {
    let dir = scratch("export-into-ckpt");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--steps",
        "2",
        "--ckpt-every",
        "1",
        "--ckpt-dir",
        c,
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let sorted = |d: &Path| {
        let mut e = entries_starting(d, "");
        e.sort();
        e
    };
    let before = sorted(&ckpt);
    let step_dir = ckpt.join("step-00000002");
    for out in [
        ckpt.clone(),
        ckpt.join("hf"),
        step_dir.clone(),
        ckpt.join("./x/../y"),
    ] {
        let o = lzrun(&["export", c, "--out", out.to_str().unwrap()]);
        assert_error(&o, "inside the checkpoint directory");
        let o = lzrun(&[
            "export",
            step_dir.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_error(&o, "inside the checkpoint directory");
    }
    assert_eq!(sorted(&ckpt), before);
    // Beside it, however written, is fine.
    let beside = ckpt.join("../hf");
    let o = lzrun(&["export", c, "--out", beside.to_str().unwrap()]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(dir.join("hf/config.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The training state of the checkpoint `latest` names (or the newest valid one) is finite.
fn assert_latest_checkpoint_is_finite(root: &Path, cfg: &MoeConfig) -> u64 {
    use lazarus_executor::checkpoint;
    let loaded = checkpoint::load_latest(root, cfg).expect("a valid checkpoint");
    checkpoint::check_dense_finite(&loaded.dense().unwrap()).expect("finite dense state");
    for l in 0..cfg.n_layers {
        for e in 0..cfg.experts {
            checkpoint::check_expert_finite(&loaded.expert(l, e).unwrap()).expect("finite");
        }
    }
    loaded.step()
}

/// Issue 14 item 1: with `lr = 1000` the loss became NaN after 4 steps, the controller could
/// not parse the workers' `"loss":null` lines, counted nothing more, and still ended with
/// "done: 4 steps" and exit 0, with a checkpoint full of NaN as `latest`. Now every worker
/// skips the update of a non-finite step, the job fails after `--max-nonfinite-steps` of them
/// in a row, no checkpoint holds a NaN, and the temporary checkpoints of the failed job are
/// kept and named.
#[test]
fn a_diverging_run_skips_non_finite_steps_then_fails_without_nan_checkpoints() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("diverge");
    let toml = dir.join("hot.toml");
    std::fs::write(&toml, "base = \"tiny\"\nlr = 1000.0\n").unwrap();
    let o = run(Command::new(LZRUN)
        .args(["local", "--steps", "20", "--ckpt-every", "1"])
        .args(["--max-nonfinite-steps", "3", "--config"])
        .arg(&toml)
        .env("TMPDIR", &dir));
    assert_error(&o, "training diverged: 3 steps in a row");
    assert!(o.stderr.contains("lower the learning rate"), "{}", o.show());
    assert!(
        o.stdout.contains("the update was skipped on every member"),
        "{}",
        o.show()
    );
    assert!(!o.stdout.contains("done:"), "{}", o.show());
    let kept = o
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("checkpoints kept in "))
        .and_then(|l| l.split(" (").next())
        .unwrap_or_else(|| panic!("no kept checkpoints\n{}", o.show()));
    let kept = PathBuf::from(kept);
    assert!(kept.starts_with(&dir), "{}", kept.display());
    let cfg = MoeConfig {
        lr: 1000.0,
        ..MoeConfig::tiny()
    };
    assert_latest_checkpoint_is_finite(&kept, &cfg);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14 item 1: `lr = nan` in a config hung the job (the agents could not parse the job
/// command: JSON has no NaN). Numbers out of range are refused up front, naming the key.
#[test]
fn non_finite_or_negative_numbers_in_a_config_are_refused_naming_the_key() {
    let dir = scratch("bad-numbers");
    let toml = dir.join("bad.toml");
    for (line, key) in [
        ("lr = nan", "lr must be a finite number > 0 (got NaN)"),
        ("lr = inf", "lr must be a finite number > 0 (got inf)"),
        ("lr = -0.1", "lr must be a finite number > 0 (got -0.1)"),
        ("lr = 0.0", "lr must be a finite number > 0"),
        (
            "lb_loss_coef = -1.0",
            "lb_loss_coef must be a finite number >= 0",
        ),
        ("lb_loss_coef = nan", "lb_loss_coef"),
    ] {
        std::fs::write(&toml, format!("base = \"tiny\"\n{line}\n")).unwrap();
        let o = lzrun(&["local", "--config", toml.to_str().unwrap()]);
        assert_error(&o, key);
        assert_error(&o, "bad.toml");
    }
    assert_error(
        &lzrun(&["local", "--max-nonfinite-steps", "0"]),
        "--max-nonfinite-steps",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Blocks the checkpoints of `steps` under `root`: a file where the staging directory goes
/// makes every worker's write of that step fail, as a full or read-only directory would (and
/// unlike permissions, it stops root too).
fn block_checkpoints(root: &Path, steps: &[u64]) {
    std::fs::create_dir_all(root).unwrap();
    for step in steps {
        let staging = lazarus_executor::checkpoint::staging_dir(root, *step);
        std::fs::write(staging, b"in the way").unwrap();
    }
}

/// Issue 14 item 2: a checkpoint write that failed killed the worker (its error ended the
/// process), so a full or read-only checkpoint directory took every node down in turn. Now it
/// fails the checkpoint only: logged, training goes on, the next one is a fresh try — and
/// `--max-ckpt-failures N` ends the job after N in a row.
#[test]
fn a_checkpoint_that_cannot_be_written_fails_the_checkpoint_not_the_nodes() {
    let dir = scratch("ckpt-blocked");
    let ck = dir.join("ckpt");
    block_checkpoints(&ck, &[2, 4]);
    let c = ck.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--steps",
        "8",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        c,
        "--format",
        "json",
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 8, "{}", o.show());
    assert_eq!((s.recoveries, s.fallbacks), (0, 0), "{}", o.show());
    assert!(!o.stderr.contains("fenced"), "{}", o.show());
    // Blocked: the checkpoints a restore would resume at steps 2 and 4 from.
    for step in [1, 3] {
        assert!(
            o.stderr.contains(&format!(
                "checkpoint after step {step} failed (training goes on"
            )),
            "{}",
            o.show()
        );
    }
    assert_eq!(
        assert_latest_checkpoint_is_finite(&ck, &MoeConfig::tiny()),
        8
    );
    let leftovers: Vec<_> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    let _ = std::fs::remove_dir_all(&ck);
    block_checkpoints(&ck, &[2, 4]);
    let o = lzrun(&[
        "local",
        "--steps",
        "8",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        c,
        "--max-ckpt-failures",
        "2",
    ]);
    assert_error(
        &o,
        "2 checkpoints in a row failed (the limit), the last the checkpoint after step 3",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether this process can ignore file permissions (root): then a read-only directory is
/// not read-only for the test, and the test is skipped.
fn ignores_permissions() -> bool {
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

/// Issue 14 item 2: a read-only checkpoint directory is refused up front (exit 2, naming it);
/// one that turns read-only mid-run fails checkpoints, not nodes.
#[test]
fn a_read_only_checkpoint_directory_is_refused_up_front_and_tolerated_mid_run() {
    use std::os::unix::fs::PermissionsExt;
    if ignores_permissions() {
        eprintln!("skipped: running as root, which ignores the permissions under test");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("ckpt-read-only");
    let ck = dir.join("ckpt");
    std::fs::create_dir_all(&ck).unwrap();
    let mode = |m: u32| std::fs::set_permissions(&ck, std::fs::Permissions::from_mode(m)).unwrap();
    mode(0o555);
    let c = ck.to_str().unwrap();
    let o = run(Command::new(LZRUN).args(["local", "--steps", "4", "--ckpt-dir", c]));
    mode(0o755);
    assert_error(&o, &format!("checkpoint directory {c} is not usable"));

    let mut live = Live::start(&[
        "local",
        "--steps",
        "12",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        c,
    ]);
    live.wait_for(" step        2/");
    mode(0o555);
    let o = live.finish();
    mode(0o755);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains(" step       11/"), "{}", o.show());
    assert!(
        o.stdout.contains("failed (training goes on"),
        "{}",
        o.show()
    );
    assert!(!o.stdout.contains("fenced"), "{}", o.show());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14 item 2: two jobs on one checkpoint directory pruned and overwrote each other's
/// checkpoints. The second one exits 2 naming the first.
#[test]
fn a_second_job_on_a_checkpoint_directory_exits_2_naming_the_first() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("ckpt-locked");
    let c = dir.join("ckpt");
    let c = c.to_str().unwrap();
    let st = dir.join("state");
    let st = st.to_str().unwrap();
    let mut first = Live::start(&[
        "local",
        "--steps",
        "100000",
        "--ckpt-dir",
        c,
        "--state-dir",
        st,
    ]);
    first.wait_for(" step        0/");
    let second = run(Command::new(LZRUN).args(["local", "--steps", "2", "--ckpt-dir", c]));
    // Issue 33 item 6.9: a locked state directory was called a "checkpoint directory".
    let other = dir.join("other");
    let third = run(Command::new(LZRUN)
        .args(["local", "--steps", "2", "--state-dir", st, "--ckpt-dir"])
        .arg(&other));
    signal(i32::try_from(first.child.id()).unwrap(), libc::SIGINT);
    let pid = first.child.id();
    let o = first.finish();
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert_error(
        &second,
        "is in use by another job (held by lzrun local, pid ",
    );
    assert_error(&second, &format!("pid {pid} on "));
    assert_error(
        &third,
        &format!("state directory {st} is in use by another job"),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33 item 6.6: under a file-size limit (`ulimit -f`) the workers died of SIGXFSZ while
/// writing checkpoint parts, and the cascade left the job waiting forever. lzrun ignores
/// SIGXFSZ, so the write fails with EFBIG: a failed checkpoint, and training goes on. Every
/// checkpoint fails under this limit, the last step's too (tried 3 times): the job trains every
/// step and then ends 2 saying its final state is not saved (issue 33 item 1: exit 0 would
/// claim a state nobody holds once the workers stop).
#[test]
fn a_file_size_limit_fails_the_checkpoints_not_the_nodes() {
    use std::os::unix::process::CommandExt;
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("fsize");
    let mut cmd = Command::new(LZRUN);
    cmd.env("TMPDIR", &dir).args([
        "local",
        "--steps",
        "6",
        "--ckpt-every",
        "2",
        "--timeout-ms",
        "3000",
    ]);
    // 64 KiB: the job state (a few KB) fits, the dense part of a checkpoint does not.
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = run_within(&mut cmd, Duration::from_secs(120));
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert_error(
        &o,
        "the checkpoint after the last step (5) failed 3 times, so the final state is not saved",
    );
    assert!(o.stdout.contains(" step        5/"), "{}", o.show());
    assert!(o.stdout.contains("checkpoint after step"), "{}", o.show());
    assert!(o.stdout.contains("failed"), "{}", o.show());
    assert!(!o.stdout.contains("fenced"), "{}", o.show());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Entries of `dir` whose name starts with `prefix`.
fn entries_starting(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|it| {
            it.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Starts `lzrun local` with `args`, waits for step 4, sends `sig`, and checks that it stops
/// like on Ctrl-C: promptly, exit 2 saying so, no agent or worker left.
fn stop_with(sig: i32, name: &str, args: &[&str], tmp: &Path) -> Outcome {
    let mut live = Live::start_cmd(Command::new(LZRUN).args(args).env("TMPDIR", tmp));
    live.wait_for(" step        3/");
    let addr = live.addr.clone();
    // This run's processes only: other worktrees may be running lzrun tests meanwhile.
    let agents = processes_mentioning(&addr);
    let workers: Vec<u32> = processes_mentioning("worker --managed")
        .into_iter()
        .filter(|&p| parent_of(p).is_some_and(|a| agents.contains(&a)))
        .collect();
    assert_eq!(workers.len(), agents.len(), "one worker per agent");
    let sent = Instant::now();
    signal(i32::try_from(live.child.id()).unwrap(), sig);
    let o = live.finish();
    assert!(
        sent.elapsed() < Duration::from_secs(15),
        "took {:?}",
        sent.elapsed()
    );
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(
        o.stderr.contains(&format!("interrupted ({name})")),
        "{}",
        o.show()
    );
    let left = || -> Vec<u32> {
        let mut v = processes_mentioning(&addr);
        v.extend(
            workers
                .iter()
                .copied()
                .filter(|p| Path::new(&format!("/proc/{p}")).exists()),
        );
        v
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !left().is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(left(), Vec::<u32>::new(), "processes left behind");
    o
}

/// Issue 14 item 3: SIGTERM (what schedulers send) and SIGHUP killed `lzrun local` outright,
/// leaving its temporary checkpoint directory behind. They now stop the job like Ctrl-C: no
/// process or temporary directory left, the checkpoints of `--ckpt-dir` kept (and loadable),
/// no staging directory of an unfinished checkpoint.
#[test]
fn sigterm_and_sighup_stop_the_job_like_ctrl_c() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("sigterm");
    let ck = dir.join("ckpt");
    let c = ck.to_str().unwrap();
    let args = [
        "local",
        "--nodes",
        "3",
        "--steps",
        "100000",
        "--ckpt-every",
        "1",
        "--ckpt-dir",
        c,
    ];
    stop_with(libc::SIGTERM, "SIGTERM", &args, &dir);
    // Every worker reported the checkpoint after step 2 (the one a restore resumes at step 3
    // from) before step 3's line.
    assert!(assert_latest_checkpoint_is_finite(&ck, &MoeConfig::tiny()) >= 3);
    assert_eq!(entries_starting(&ck, "."), Vec::<String>::new());
    // Without --ckpt-dir the checkpoints live in a temporary directory under TMPDIR.
    let args = ["local", "--steps", "100000", "--ckpt-every", "1"];
    stop_with(libc::SIGHUP, "SIGHUP", &args, &dir);
    assert_eq!(entries_starting(&dir, "lzrun-ckpt-"), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33 item 6.2: `lzrun local --steps 5 --storm 1000000 --nodes 3` was accepted, started
/// ~54,000 processes and ignored SIGTERM (it started the scheduled joins in one go between two
/// polls of the signal). The storm is bounded (see the absurd-numbers test), injections stop at
/// a stop signal, and a storm run stops within seconds, leaving no process behind. Its first
/// line counts the faults asked for, not the injections (`--storm 10` said "12 faults").
#[test]
fn sigterm_stops_a_storm_within_seconds_and_leaves_no_process() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = scratch("storm-term");
    let mut live = Live::start_cmd(Command::new(LZRUN).env("TMPDIR", &tmp).args([
        "local",
        "--storm",
        "600",
        "--storm-seed",
        "3",
        "--steps",
        "602",
        "--ckpt-every",
        "2",
        "--timeout-ms",
        "2000",
    ]));
    let first = live.stdout[0].clone();
    assert!(first.contains(", 600 faults scheduled ("), "{first}");
    live.wait_for(" step        5/");
    let env = format!("TMPDIR={}", tmp.display());
    assert!(!processes_with_env(&env).is_empty());
    let sent = Instant::now();
    signal(i32::try_from(live.child.id()).unwrap(), libc::SIGTERM);
    let o = live.finish();
    let took = sent.elapsed();
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(o.stderr.contains("interrupted (SIGTERM)"), "{}", o.show());
    // The agents get 5 s to stop their workers before they are SIGKILLed.
    assert!(took < Duration::from_secs(12), "stopped after {took:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_with_env(&env).is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        processes_with_env(&env),
        Vec::<u32>::new(),
        "processes left"
    );
    eprintln!("measured: SIGTERM to exit of a storm run: {took:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}

// ---------------------------------------------------------------------------------------------
// Controller fail-over (issue 14 item 9)
// ---------------------------------------------------------------------------------------------

/// The milliseconds in a line `… <N> ms <after>…`: the number right before `" ms " + after`.
fn ms_before(text: &str, after: &str) -> Option<u64> {
    let i = text.find(&format!(" ms {after}"))?;
    text[..i].rsplit(' ').next()?.parse().ok()
}

/// `lzrun local --kill-controller @8`: the in-process controller is killed as SIGKILL would
/// (its connections drop, nothing more is saved) and replaced 1 s later by one rebuilt from the
/// saved state. The workers train on meanwhile, the agents reattach and send again the lines
/// the saved state lacks, and the run completes all steps with consistent replicas — without
/// any reconfiguration, let alone a checkpoint restore.
#[test]
fn killing_the_controller_mid_training_resumes_in_place_without_a_restore() {
    let dir = scratch("kill-controller");
    let d = dir.to_str().unwrap();
    let state = dir.join("state");
    let o = lzrun(&[
        "local",
        "--nodes",
        "3",
        "--steps",
        "30",
        "--kill-controller",
        "@8",
        "--controller-down-ms",
        "1000",
        "--ckpt-every",
        "5",
        "--state-dir",
        state.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 30, "{}", o.show());
    assert_eq!((s.recoveries, s.fallbacks), (0, 0), "{}", o.show());
    let kinds: Vec<&str> = s.reconfigurations.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(
        kinds,
        vec!["start"],
        "nothing was reconfigured\n{}",
        o.show()
    );
    assert!(!o.stderr.contains("restoring"), "{}", o.show());
    assert!(
        o.stderr
            .contains("lzrun local: controller killed after step 8"),
        "{}",
        o.show()
    );
    let done = o
        .stderr
        .lines()
        .find(|l| l.contains("controller recovery complete"))
        .unwrap_or_else(|| panic!("no recovery\n{}", o.show()));
    assert!(
        done.contains("all 3 nodes came back consistent: training resumes in place"),
        "{done}"
    );
    // Every agent came back and sent again what the saved state lacked.
    assert_eq!(
        o.stderr.matches("back with the controller (").count(),
        3,
        "{}",
        o.show()
    );
    let reattach_ms = ms_before(done, "after the restart").expect("recovery time");
    let resumed = o
        .stderr
        .lines()
        .find(|l| l.contains("the restarted controller counted step"))
        .unwrap_or_else(|| panic!("no step after the restart\n{}", o.show()));
    let kill_to_step_ms = ms_before(resumed, "after").expect("time to the first step");
    eprintln!(
        "measured: every node back {reattach_ms} ms after the restart; first step counted \
         {kill_to_step_ms} ms after the kill (1000 ms of it the controller was down)"
    );
    assert!(reattach_ms < 3_000, "{done}");
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 3);
    // The state directory holds the finished job's state, and nothing else but its lock.
    let mut left = entries_starting(&state, "");
    left.sort();
    assert_eq!(left, vec!["controller-state", "lzrun.lock"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The soak defect of issue 33 item 7: the launcher lags behind its controller (busy injecting
/// faults), the controller is killed with steps counted and saved whose records the launcher
/// has not read yet, and those records were lost with it (`steps.csv` and the summary missed
/// the last 12 steps of 250). With `LZRUN_TEST_KILL_CONTROLLER_AHEAD=5` the kill due after step
/// 8 waits until the controller has counted step 13, reading none of its notices: the
/// restarted controller hands out again the records not acknowledged, and every step is in
/// `steps.csv` and `routing.csv` exactly once, in order.
#[test]
fn records_a_killed_controller_counted_ahead_of_the_launcher_reach_steps_csv_once() {
    let dir = scratch("kill-controller-ahead");
    let metrics = dir.join("metrics");
    let o = {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        run(Command::new(LZRUN)
            .env("LZRUN_TEST_KILL_CONTROLLER_AHEAD", "5")
            .args(["local", "--nodes", "3", "--steps", "24"])
            .args(["--kill-controller", "@8", "--controller-down-ms", "300"])
            .args(["--ckpt-every", "4", "--format", "json"])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--metrics-out")
            .arg(&metrics))
    };
    let s = o.summary();
    assert!(
        o.stderr
            .contains("lzrun local: controller killed after step 8"),
        "{}",
        o.show()
    );
    assert!(
        o.stderr
            .contains("handing out again the 5 step and reconfiguration records"),
        "the controller was killed with steps 9..=13 counted and not read\n{}",
        o.show()
    );
    let mut r = csv::Reader::from_path(metrics.join("steps.csv")).unwrap();
    let h = r.headers().unwrap().clone();
    let si = h.iter().position(|c| c == "step").unwrap();
    let steps: Vec<u64> = r
        .records()
        .map(|rec| rec.unwrap()[si].parse().unwrap())
        .collect();
    assert_eq!(steps, (0..24).collect::<Vec<u64>>(), "{}", o.show());
    assert_eq!(s.steps, 24, "{}", o.show());
    // Two layers of routing per record, the records of steps.csv.
    let routing = std::fs::read_to_string(metrics.join("routing.csv")).unwrap();
    let blocks: Vec<(u64, u64)> = routing
        .lines()
        .skip(1)
        .map(|l| {
            let mut f = l.split(',');
            let record = f.next().unwrap().parse().unwrap();
            let step = f.next().unwrap().parse().unwrap();
            (record, step)
        })
        .collect();
    let expected: Vec<(u64, u64)> = (0..24).flat_map(|s| [(s, s), (s, s)]).collect();
    assert_eq!(blocks, expected);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A controller kill due after a step whose record the launcher reads only once the job is
/// over (it lagged behind the last steps) has no controller left to kill: the job was saved as
/// over, and a controller rebuilt from that state would refuse it. The launcher says so and
/// reads the last records and the outcome.
#[test]
fn a_controller_kill_due_when_the_job_is_already_over_leaves_it_to_end() {
    let dir = scratch("kill-controller-over");
    let metrics = dir.join("metrics");
    let o = {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        run(Command::new(LZRUN)
            .env("LZRUN_TEST_KILL_CONTROLLER_AHEAD", "1000")
            .args(["local", "--nodes", "3", "--steps", "12"])
            .args([
                "--kill-controller",
                "@6",
                "--ckpt-every",
                "0",
                "--format",
                "json",
            ])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--metrics-out")
            .arg(&metrics))
    };
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(
        o.stderr.contains(
            "the controller to be killed after step 6 is done: the job is over, it is left to end"
        ),
        "{}",
        o.show()
    );
    assert_eq!(o.summary().steps, 12, "{}", o.show());
    let steps = std::fs::read_to_string(metrics.join("steps.csv")).unwrap();
    assert_eq!(steps.lines().count(), 13, "{steps}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A process that prints lines, read as they come (stdout and stderr together).
struct Printing {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Printing {
    fn start(cmd: &mut Command) -> Self {
        use std::io::{BufRead, BufReader};
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let tx2 = tx.clone();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx2.send(line);
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Reads lines until one contains `needle`.
    fn wait_for(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no line with {needle:?}:\n{}", self.seen.join("\n")));
            self.seen.push(line.clone());
            if line.contains(needle) {
                return line;
            }
        }
    }

    /// Waits for the exit; returns the status code and every line.
    fn finish(mut self) -> (Option<i32>, String) {
        let deadline = Instant::now() + LIMIT;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("did not finish:\n{}", self.seen.join("\n"));
            }
            thread::sleep(Duration::from_millis(20));
        };
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(l);
        }
        (status.code(), self.seen.join("\n"))
    }
}

/// A free loopback port (bound and released at once).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Issue 14 item 9 across processes: `lzrun controller --state-dir` with two `lzrun agent`s,
/// the controller SIGKILLed mid-training, `lzrun controller --recover` started on the same
/// address 0.5 s later. The agents reconnect (connection refused meanwhile: backoff), their
/// workers trained on, and the recovered controller completes the run: every step, consistent
/// replicas, no reconfiguration and no checkpoint restore.
#[test]
fn a_sigkilled_controller_is_replaced_by_recover_and_the_run_completes_in_place() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("recover");
    let (state, ckpt, out) = (dir.join("state"), dir.join("ckpt"), dir.join("out"));
    let addr = format!("127.0.0.1:{}", free_port());
    let mut first = Printing::start(
        Command::new(LZRUN)
            .args([
                "controller",
                "--listen",
                &addr,
                "--nodes",
                "2",
                "--steps",
                "40",
            ])
            .args(["--ckpt-every", "10", "--timeout-ms", "5000"])
            .arg("--state-dir")
            .arg(&state)
            .arg("--ckpt-dir")
            .arg(&ckpt)
            .arg("--out")
            .arg(&out)
            .env("LZRUN_TOKEN", "fail-over"),
    );
    first.wait_for("listening on");
    let agents: Vec<Printing> = ["a0", "a1"]
        .iter()
        .map(|name| {
            Printing::start(
                Command::new(LZRUN)
                    .args(["agent", "--controller", &addr, "--name", name])
                    .env("LZRUN_TOKEN", "fail-over"),
            )
        })
        .collect();
    first.wait_for(" step       11/");
    signal(i32::try_from(first.child.id()).unwrap(), libc::SIGKILL);
    let killed = Instant::now();
    let (code, before) = first.finish();
    assert_eq!(code, None, "killed by a signal:\n{before}");
    thread::sleep(Duration::from_millis(500));
    let mut second = Printing::start(
        Command::new(LZRUN)
            .args(["controller", "--recover"])
            .arg(&state)
            .env("LZRUN_TOKEN", "fail-over"),
    );
    let done = second.wait_for("controller recovery complete");
    let back_ms = killed.elapsed().as_millis();
    assert!(
        done.contains("all 2 nodes came back consistent: training resumes in place"),
        "{done}"
    );
    let (code, after) = second.finish();
    assert_eq!(code, Some(0), "{after}");
    assert!(after.contains(&format!("listening on {addr}")), "{after}");
    assert!(after.contains(" step       39/"), "{after}");
    assert!(after.contains("done: 40 steps"), "{after}");
    // Issue 33 item 6.9: the loss of step 0, counted by the dead controller, survives (it
    // printed "loss NaN → …").
    assert!(after.contains("done: 40 steps, loss "), "{after}");
    assert!(!after.contains("NaN"), "{after}");
    assert!(!after.contains("restoring"), "{after}");
    assert!(!after.contains("\"reconfiguration\""), "{after}");
    for agent in agents {
        let (code, text) = agent.finish();
        assert_eq!(code, Some(0), "{text}");
        assert!(text.contains("lost the controller"), "{text}");
        assert!(text.contains("back with the controller"), "{text}");
    }
    eprintln!(
        "measured: SIGKILL to every node back with the recovered controller: {back_ms} ms \
         (500 ms of it before the restart); {}",
        done.trim()
    );
    assert_eq!(assert_consistent(&out, &MoeConfig::tiny()).len(), 2);
    // The finished job cannot be taken back again, and the message says it finished.
    let again = run(Command::new(LZRUN)
        .args(["controller", "--recover"])
        .arg(&state)
        .env("LZRUN_TOKEN", "fail-over"));
    assert_error(&again, "finished: it trained all its steps");
    assert_error(&again, "there is nothing to recover");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--recover` on a directory without a state, or with a cut or damaged one: exit 2 and one
/// clear line naming the file, never a panic (and nothing listens or trains).
#[test]
fn recovering_from_a_missing_or_damaged_state_exits_2_naming_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("bad-state");
    let state = dir.join("state");
    let recover = || {
        run(Command::new(LZRUN)
            .args(["controller", "--recover"])
            .arg(&state)
            .env("LZRUN_TOKEN", "t"))
    };
    assert_error(&recover(), "no such directory");
    std::fs::create_dir_all(&state).unwrap();
    assert_error(&recover(), "no saved controller state");
    // A real state: a controller that saved its initial state, then was killed.
    let addr = format!("127.0.0.1:{}", free_port());
    let mut c = Printing::start(
        Command::new(LZRUN)
            .args(["controller", "--listen", &addr, "--ckpt-every", "0"])
            .arg("--state-dir")
            .arg(&state)
            .env("LZRUN_TOKEN", "t"),
    );
    c.wait_for("listening on");
    signal(i32::try_from(c.child.id()).unwrap(), libc::SIGKILL);
    c.finish();
    let file = state.join("controller-state");
    // Issue 33 item 6.3: a wrong token was accepted, and every agent that came back was then
    // refused ("wrong cluster token"), stopped its worker and the job was gone. The state
    // holds a salted fingerprint of the token (never the token), checked before listening.
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("\"token_fingerprint\":\"sha256:"), "{text}");
    let wrong = run(Command::new(LZRUN)
        .args(["controller", "--recover"])
        .arg(&state)
        .env("LZRUN_TOKEN", "not-t"));
    assert_error(&wrong, "the token does not match the job saved in");
    assert_eq!(wrong.stderr.lines().count(), 1, "{}", wrong.show());
    // A state saved before fingerprints existed takes any token.
    let old = text.replacen(",\"token_fingerprint\":", ",\"old_fingerprint\":", 1);
    let (header, json) = old.split_once('\n').unwrap();
    let fields: Vec<&str> = header.split(' ').collect();
    let sum = lazarus_executor::checkpoint::fnv64(json.as_bytes());
    let header = format!("{} {} {} {sum:016x}", fields[0], fields[1], json.len());
    std::fs::write(&file, format!("{header}\n{json}")).unwrap();
    let mut c = Printing::start(
        Command::new(LZRUN)
            .args(["controller", "--listen", &addr, "--recover"])
            .arg(&state)
            .env("LZRUN_TOKEN", "anything"),
    );
    c.wait_for("taking back the job");
    signal(i32::try_from(c.child.id()).unwrap(), libc::SIGKILL);
    c.finish();
    std::fs::write(&file, text.as_bytes()).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let o = recover();
    assert_error(&o, "is damaged");
    assert_error(&o, "controller-state");
    std::fs::write(&file, b"").unwrap();
    assert_error(&recover(), "is damaged");
    let mut flipped = bytes.clone();
    let i = bytes.len() - 5;
    flipped[i] ^= 0x20;
    std::fs::write(&file, &flipped).unwrap();
    assert_error(&recover(), "checksum");
    std::fs::write(&file, b"lzrun-controller-state 99 2 0\n{}").unwrap();
    assert_error(&recover(), "format version 99");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 35 item 6: `--recover` of a job that ended said its state file "is damaged". A
/// finished job, or a failed one, has nothing to recover, and the message says which, and what
/// to do instead.
#[test]
fn recovering_a_job_that_ended_says_how_it_ended_not_that_its_state_is_damaged() {
    let dir = scratch("ended-state");
    let recover = |state: &Path| {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        run(Command::new(LZRUN)
            .args(["controller", "--recover"])
            .arg(state)
            .env("LZRUN_TOKEN", "t"))
    };
    let finished = dir.join("finished");
    let f = finished.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--steps",
        "2",
        "--state-dir",
        f,
        "--format",
        "json",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let o = recover(&finished);
    assert_error(&o, "finished: it trained all its steps");
    assert_error(&o, "there is nothing to recover");
    assert!(!o.stderr.contains("damaged"), "{}", o.show());
    assert_eq!(o.stderr.lines().count(), 1, "{}", o.show());

    let failed = dir.join("failed");
    let f = failed.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--nodes",
        "4",
        "--steps",
        "8",
        "--kill",
        "0@3",
        "--kill",
        "1@3",
        "--ckpt-every",
        "0",
        "--state-dir",
        f,
    ]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    let o = recover(&failed);
    assert_error(&o, "failed (");
    assert_error(&o, "lost every replica");
    assert_error(&o, "there is nothing to recover");
    assert!(!o.stderr.contains("damaged"), "{}", o.show());
    // The job's options come from its state: one given with --recover had no effect.
    let o = run(Command::new(LZRUN)
        .args(["controller", "--steps", "50", "--recover"])
        .arg(&finished)
        .env("LZRUN_TOKEN", "t"));
    assert_error(&o, "--steps cannot be given with --recover");
    let o = run(Command::new(LZRUN)
        .args(["controller", "--format", "json", "--recover"])
        .arg(&finished)
        .env("LZRUN_TOKEN", "t"));
    assert_error(&o, "there is nothing to recover");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 35 item 6: `--kill 5@3` on 2 nodes named "indices 0..2" (neither how the flag counts
/// nor the valid range); `--join 4` was taken as `--join @4` while `--kill 2` was refused.
#[test]
fn fault_flags_are_refused_in_the_terms_they_count_in() {
    let o = lzrun(&["local", "--nodes", "2", "--kill", "5@3"]);
    assert_error(&o, "--kill 5@3: there is no node n5 by step 3");
    assert_error(&o, "the nodes launched by then are n0..n1");
    assert!(!o.stderr.contains("indices"), "{}", o.show());
    // The node a --join starts is the next name: n2 here.
    let o = lzrun(&[
        "local", "--nodes", "2", "--steps", "3", "--join", "@0", "--kill", "2@1",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let log = &o.stdout;
    assert!(log.contains("started node n2 after step 0"), "{}", o.show());
    assert!(
        log.contains("killed node n2 with SIGKILL after step 1"),
        "{}",
        o.show()
    );
    for (flag, value) in [("--join", "4"), ("--kill-controller", "4")] {
        let o = lzrun(&["local", flag, value]);
        assert_error(
            &o,
            &format!("invalid {flag} '4': missing '@' (expected @STEP"),
        );
        assert_eq!(o.stderr.lines().count(), 1, "{}", o.show());
    }
}

/// Issue 14, item 4 ("slow is not dead"): one node's worker takes 6 s per step (the test hook
/// `LZRUN_TEST_STEP_DELAY` sleeps before each step while its heartbeat thread goes on), six
/// times `--timeout-ms` and more than the member timeout (2 × 1 s + 2 s). Before, its peer's
/// collective timed out after 1 s, the slow node was aborted and fenced when it did not stop
/// within 4 s, and the job went on without it. Now the first step is waited for (warm-up: the
/// ceiling), the later ones up to 4 × the slowest measured step; the log says "slow, not
/// gone", and nothing is fenced or reconfigured.
#[test]
fn a_slow_worker_that_heartbeats_is_waited_for_not_declared_dead() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("slow");
    let d = dir.to_str().unwrap();
    let args = [
        "local",
        "--nodes",
        "2",
        "--steps",
        "3",
        "--timeout-ms",
        "1000",
        "--ckpt-every",
        "0",
        "--format",
        "json",
        "--out",
        d,
    ];
    let o = run_within(
        Command::new(LZRUN)
            .args(args)
            .env("LZRUN_TEST_STEP_DELAY", "1:6000"),
        Duration::from_secs(120),
    );
    let s = o.summary();
    assert_eq!(s.steps, 3, "{}", o.show());
    assert_eq!((s.recoveries, s.fallbacks), (0, 0), "{}", o.show());
    assert!(
        s.reconfigurations.iter().all(|r| r.kind == "start"),
        "{}",
        o.show()
    );
    assert!(!o.stderr.contains("fenced"), "{}", o.show());
    assert!(o.stderr.contains("is slow, not gone"), "{}", o.show());
    // Each step took the slow node's 6 s: the job really waited for it.
    assert!(s.wall_s >= 17.0, "{s:?}");
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14, item 4: a frozen worker (SIGSTOP) is gone, not slow: its heartbeats stop, and it
/// is fenced within the heartbeat timeout (1.5 s here) although the step deadline is 10 s or
/// more. Before, the survivors waited out their 10 s collective timeout and the controller
/// another 22 s before it fenced the node for not stopping.
#[test]
fn a_frozen_worker_is_gone_within_the_heartbeat_timeout_and_the_job_recovers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("frozen");
    let d = dir.to_str().unwrap();
    let mut live = Live::start(&[
        "local",
        "--nodes",
        "3",
        "--steps",
        "40",
        "--heartbeat-timeout-ms",
        "1500",
        "--ckpt-every",
        "0",
        "--out",
        d,
    ]);
    live.wait_for(" step        2/");
    let (_, worker) = live.node("n1");
    signal(worker, libc::SIGSTOP);
    let stopped = Instant::now();
    live.wait_for("node n1 fenced");
    let detect = stopped.elapsed();
    let o = live.finish();
    assert_eq!(o.code, Some(0), "{}", o.show());
    let fence = o.stdout.lines().find(|l| l.contains("node n1 fenced"));
    assert!(
        fence.is_some_and(|l| l.contains("no heartbeat from its worker")),
        "{}",
        o.show()
    );
    assert!(
        detect < Duration::from_secs(8),
        "fenced {detect:?} after the SIGSTOP\n{}",
        o.show()
    );
    assert!(o.stdout.contains(" step       39/"), "{}", o.show());
    assert_eq!(assert_consistent(&dir, &MoeConfig::tiny()).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14, item 8: a usage error named nothing ("the following required arguments were
/// not provided:" and no argument): only clap's first line was printed.
#[test]
fn a_usage_error_names_the_missing_arguments() {
    let o = run(Command::new(LZRUN)
        .args(["agent", "--controller", "127.0.0.1:1"])
        .env_remove("LZRUN_TOKEN"));
    assert_error(&o, "not provided: --token <TOKEN>");
    assert_error(&o, "lzrun agent --help");
    // Issue 35 item 6: the token can come from the environment; the message says so.
    assert_error(&o, "(or the LZRUN_TOKEN environment variable)");
    let o = run(Command::new(LZRUN)
        .args(["controller", "--nodes", "2"])
        .env_remove("LZRUN_TOKEN"));
    assert_error(
        &o,
        "not provided: --token <TOKEN> (or the LZRUN_TOKEN environment variable)",
    );
    // An invalid value: one line, without clap's pointer to a `--help` the hint names better.
    let o = run(Command::new(LZRUN).args(["local", "--kill", "2"]));
    assert_error(&o, "missing '@'");
    assert!(!o.stderr.contains("For more information"), "{}", o.show());
    let o = run(Command::new(LZRUN).args(["worker", "--world", "2"]));
    assert_error(&o, "--rank <RANK>");
    assert_error(&o, "--peers <PEERS>");
    let o = run(Command::new(LZRUN).args(["local", "--format", "yaml"]));
    assert_error(&o, "possible values: text, json");
}

/// Issue 14, item 8: a trace whose first node appears after t = 0 was refused with no way
/// out; `--window START..END` (the syntax of `lzsim replay --window`) replays part of it, and
/// the refusal suggests one.
#[test]
fn a_trace_that_starts_late_is_replayed_with_window() {
    let dir = scratch("late-trace");
    let trace = dir.join("late.csv");
    let t = trace.to_str().unwrap();
    std::fs::write(
        &trace,
        "480000,add,a\n480000,add,b\n600000,remove,b\n660000,add,c\n",
    )
    .unwrap();
    let o = lzrun(&["local", "--fault-trace", t]);
    assert_error(&o, "no live node at t=0");
    assert_error(&o, "--window 480s..661s");
    // A window that starts too early gets the same advice, in the trace's own times.
    let o = lzrun(&["local", "--fault-trace", t, "--window", "100s..700s"]);
    assert_error(&o, "--window 480s..661s");
    assert_error(
        &lzrun(&["local", "--fault-trace", t, "--window", "10m..8m"]),
        "the range is empty",
    );
    assert_error(&lzrun(&["local", "--window", "8m..1h"]), "--fault-trace");

    let o = lzrun(&[
        "local",
        "--fault-trace",
        t,
        "--window",
        "8m..700s",
        "--steps",
        "10",
        "--format",
        "json",
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 10, "{}", o.show());
    // b is removed 120 s into the window (after step 2), c added at 180 s (after step 3).
    assert!(
        o.stderr.contains("killed node b with SIGKILL"),
        "{}",
        o.show()
    );
    assert!(o.stderr.contains("started node c "), "{}", o.show());
    assert_eq!(s.joins, 1, "{s:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 35 item 1: a node-count trace (`time_ms,live_nodes`, the shape some replayers ship
/// the P3 trace in) was `line 1: expected 3 comma-separated fields`. It is detected, and makes
/// the same membership changes as the event CSV it stands for: nodes `n0, n1, …` in add order
/// (so `n<k>` is node `k`), the newest removed first.
#[test]
fn a_node_count_trace_makes_the_changes_of_its_event_csv() {
    let dir = scratch("count-trace");
    let counts = dir.join("counts.csv");
    std::fs::write(
        &counts,
        "time_ms,live_nodes\r\n0,3\r\n120000,2\r\n240000,3\r\n",
    )
    .unwrap();
    let events = dir.join("events.csv");
    std::fs::write(
        &events,
        "0,add,n0\n0,add,n1\n0,add,n2\n120000,remove,n2\n240000,add,n3\n",
    )
    .unwrap();
    // (stderr's membership lines and run.json's injected faults, both without when they fired,
    // which a loaded machine may delay; run.json's schedule)
    let membership = |trace: &Path, name: &str| {
        let metrics = dir.join(name);
        let o = lzrun(&[
            "local",
            "--fault-trace",
            trace.to_str().unwrap(),
            "--time-scale",
            "60",
            "--steps",
            "8",
            "--format",
            "json",
            "--metrics-out",
            metrics.to_str().unwrap(),
        ]);
        let s = o.summary();
        assert_eq!((s.steps, s.joins), (8, 1), "{}", o.show());
        let lines: Vec<String> = o
            .stderr
            .lines()
            .filter(|l| l.contains("lzrun local: killed node") || l.contains("started node"))
            .map(|l| l.split(" after step").next().unwrap().to_owned())
            .collect();
        let run: serde_json::Value =
            serde_json::from_slice(&std::fs::read(metrics.join("run.json")).unwrap()).unwrap();
        let mut injected = run["timeline"]["injected"].clone();
        for i in injected.as_array_mut().unwrap() {
            let i = i.as_object_mut().unwrap();
            i.remove("t_s");
            i.remove("when");
        }
        (lines, run["faults"]["events"].clone(), injected)
    };
    let from_counts = membership(&counts, "m-counts");
    let (lines, schedule, injected) = &from_counts;
    assert_eq!(lines.len(), 2, "{lines:?}");
    // One name per node (issue 35 item 6): the trace's names.
    assert!(
        lines[0].contains("killed node n2 with SIGKILL"),
        "{lines:?}"
    );
    assert!(lines[1].ends_with("started node n3"), "{lines:?}");
    let after: Vec<_> = schedule
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["after_step"].as_u64())
        .collect();
    assert_eq!(after, [Some(2), Some(4)], "{schedule}");
    assert_eq!(injected.as_array().unwrap().len(), 2, "{injected}");
    assert_eq!(from_counts, membership(&events, "m-events"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14, item 8: every `node<ID>.json` said `"world": 0`. After a kill and a join, each
/// survivor's file names the final membership: world 3, ranks 0, 1 and 2.
#[test]
fn node_checksum_files_record_the_world_size() {
    let dir = scratch("world");
    let d = dir.to_str().unwrap();
    let o = lzrun(&[
        "local", "--nodes", "3", "--steps", "8", "--kill", "1@2", "--join", "@4", "--format",
        "json", "--out", d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 8);
    let sums = assert_consistent(&dir, &MoeConfig::tiny());
    assert_eq!(sums.len(), 3, "{sums:?}");
    assert!(sums.iter().all(|c| c.world == 3), "{sums:?}");
    let mut ranks: Vec<usize> = sums.iter().map(|c| c.rank).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, vec![0, 1, 2]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14 item 10: a storm of ≥ 100 mixed faults — kills, several nodes killed at once,
/// joins racing kills, frozen workers and agents, controller kills, a full checkpoint disk —
/// on one `lzrun local --storm` run. Afterwards every replica of every expert and every copy of
/// the dense state is identical across the workers (checksums), the loss is finite and fell
/// and no step after the 10th is above the first step's loss (bug 4 of the control-plane issue),
/// and no process of the run nor any temporary file or directory remains (the run's TMPDIR is
/// its own, and every process it started carries it in its environment).
#[test]
fn a_storm_of_a_hundred_mixed_faults_leaves_every_copy_of_the_state_identical() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("storm");
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let out = dir.join("out");
    let metrics = dir.join("metrics");
    let steps = 160;
    let o = run(Command::new(LZRUN).env("TMPDIR", &tmp).args([
        "local",
        "--storm",
        "100",
        "--storm-seed",
        "3",
        "--nodes",
        "6",
        "--steps",
        &steps.to_string(),
        "--ckpt-every",
        "2",
        "--timeout-ms",
        "2000",
        "--heartbeat-timeout-ms",
        "1000",
        "--controller-down-ms",
        "300",
        "--format",
        "json",
        "--out",
        out.to_str().unwrap(),
        "--metrics-out",
        metrics.to_str().unwrap(),
    ]));
    let s = o.summary();
    assert_eq!(s.steps, steps, "{}", o.show());
    let run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(metrics.join("run.json")).unwrap()).unwrap();
    let injected = run["timeline"]["injected"].as_array().unwrap();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for i in injected {
        *kinds.entry(i["kind"].as_str().unwrap()).or_default() += 1;
    }
    assert!(
        injected.len() >= 100,
        "{} faults: {kinds:?}",
        injected.len()
    );
    for kind in [
        "kill",
        "join",
        "freeze-worker",
        "freeze-agent",
        "kill-controller",
        "disk-full",
    ] {
        assert!(kinds.contains_key(kind), "no {kind}: {kinds:?}");
    }
    assert!(
        s.recoveries >= 5 && s.fallbacks >= 1 && s.joins >= 1,
        "{s:?}"
    );
    assert!(
        o.stderr.contains("(training goes on"),
        "no checkpoint failed on the full disk\n{}",
        o.show()
    );
    assert!(
        s.initial_loss.is_finite() && s.final_loss.is_finite() && s.final_loss < s.initial_loss,
        "loss {} → {}",
        s.initial_loss,
        s.final_loss
    );
    assert_no_loss_spike(&metrics, s.initial_loss);
    assert_consistent(&out, &MoeConfig::tiny());
    let env = format!("TMPDIR={}", tmp.display());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_with_env(&env).is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        processes_with_env(&env),
        Vec::<u32>::new(),
        "processes left"
    );
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--storm` parameters that admit no schedule, or mixed with a hand-made schedule, are usage
/// errors (exit 2, one line naming the problem).
#[test]
fn a_storm_that_cannot_be_built_is_a_clear_error() {
    let o = lzrun(&["local", "--storm", "5", "--nodes", "2"]);
    assert_error(
        &o,
        "--storm 5: cannot build a random fault schedule: no node can be killed: 2 node(s) and at \
         least 2 must stay live",
    );
    let o = lzrun(&["local", "--storm", "5", "--steps", "2"]);
    assert_error(&o, "steps 1..=steps-2 of --steps 2");
    let o = lzrun(&["local", "--storm", "5", "--kill", "0@3"]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(o.stderr.contains("cannot be used with"), "{}", o.show());
}

/// Issue 13 item 1: `lzrun local --expert-mode fsep` trains the default tiny job to the end.
#[test]
fn local_fsep_trains_to_completion_and_the_loss_falls() {
    let dir = scratch("fsep");
    let d = dir.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--expert-mode",
        "fsep",
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 20);
    assert!(
        s.final_loss < s.initial_loss - 1.0,
        "loss {} → {}",
        s.initial_loss,
        s.final_loss
    );
    assert_eq!((s.recoveries, s.fallbacks), (0, 0), "{}", o.show());
    assert_eq!(assert_fsep_consistent(&dir), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// FSEP without resilient shards: a killed node takes its shard of every expert with it, so
/// the survivors restore the newest checkpoint (written from gathered shards) and finish.
#[test]
fn a_kill_in_fsep_mode_restores_the_checkpoint_and_completes() {
    let dir = scratch("fsep-kill");
    let d = dir.to_str().unwrap();
    let ck = dir.join("ckpt");
    let o = lzrun(&[
        "local",
        "--expert-mode",
        "fsep",
        "--nodes",
        "3",
        "--steps",
        "10",
        "--kill",
        "2@5",
        "--ckpt-every",
        "4",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 10);
    assert_eq!((s.recoveries, s.fallbacks), (0, 1), "{}", o.show());
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "checkpoint")
        .unwrap();
    assert_eq!(
        rec.resume_step, 4,
        "restored the step-4 checkpoint: {rec:?}"
    );
    assert_eq!((rec.nodes_before, rec.nodes_after), (3, 2), "{rec:?}");
    assert!(
        o.stderr
            .contains("membership of the sharded experts changed"),
        "{}",
        o.show()
    );
    assert_eq!(assert_fsep_consistent(&dir), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// FSEP under skewed routing: the periodic rebalances change the layout at a step boundary
/// over the same members — no checkpoint restore, the shards stay (moved at most to renumbered
/// ranks), and training goes on to the end.
#[test]
fn rebalances_in_fsep_mode_relayout_in_place() {
    let dir = scratch("fsep-rebalance");
    let config = dir.join("skew.toml");
    std::fs::write(&config, "base = \"tiny\"\nlb_loss_coef = 0.0\n").unwrap();
    let o = lzrun(&[
        "local",
        "--expert-mode",
        "fsep",
        "--nodes",
        "3",
        "--steps",
        "16",
        "--rebalance-every",
        "5",
        "--config",
        config.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 16);
    assert_eq!((s.recoveries, s.fallbacks), (0, 0), "{}", o.show());
    let rebalances: Vec<_> = s
        .reconfigurations
        .iter()
        .filter(|r| r.kind == "rebalance")
        .collect();
    assert!(rebalances.len() >= 2, "{}", o.show());
    assert!(s.final_loss.is_finite());
    assert_eq!(assert_fsep_consistent(&dir), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 13 item 3, resilient FSEP: with `--shard-copies 2` on 4 nodes the planner puts shards
/// {0, 1} on nodes {0, 1} and {2, 3} on {2, 3}. Killing node 2 leaves a copy of every shard,
/// so the survivors copy the two lost shard copies from node 3 and train on in place: an
/// in-place reconfiguration, no checkpoint restore (though checkpoints are there to restore).
#[test]
fn a_kill_in_fsep_mode_with_two_shard_copies_recovers_in_place() {
    let dir = scratch("fsep-f2-kill");
    let d = dir.to_str().unwrap();
    let ck = dir.join("ckpt");
    let o = lzrun(&[
        "local",
        "--expert-mode",
        "fsep",
        "--shard-copies",
        "2",
        "--nodes",
        "4",
        "--steps",
        "12",
        "--kill",
        "2@5",
        "--ckpt-every",
        "4",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 12);
    assert_eq!((s.recoveries, s.fallbacks), (1, 0), "{}", o.show());
    assert!(
        s.reconfigurations.iter().all(|r| r.kind != "checkpoint"),
        "{}",
        o.show()
    );
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "in-place")
        .unwrap_or_else(|| panic!("no in-place reconfiguration\n{}", o.show()));
    assert_eq!((rec.nodes_before, rec.nodes_after), (4, 3), "{rec:?}");
    // Two shard copies rebuilt, each every expert's slice of a shard with its moments.
    assert_eq!(rec.transfers, 2, "{rec:?}");
    assert!(rec.bytes > 0, "{rec:?}");
    assert!(
        o.stderr.contains("rebuilding 2 shard copies in place"),
        "{}",
        o.show()
    );
    assert!(s.final_loss.is_finite());
    eprintln!(
        "fsep f=2 kill: recovery {:.0} ms ({rec:?}), loss {} -> {}",
        s.recovery_ms[0], s.initial_loss, s.final_loss
    );
    assert_eq!(assert_fsep_consistent(&dir), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33 item 3: a node joining a sharded job joins in place (the job machine's one rule
/// for sharded joins, shared with `lzsim replay`): with 2 copies of 4 shards on 4 nodes the
/// newcomer receives one shard copy from a holder and the dense state, no checkpoint is
/// restored, and every worker ends with the same dense state.
#[test]
fn a_join_in_fsep_mode_joins_in_place_with_shard_copies() {
    let dir = scratch("fsep-f2-join");
    let d = dir.to_str().unwrap();
    let ck = dir.join("ckpt");
    let o = lzrun(&[
        "local",
        "--expert-mode",
        "fsep",
        "--shard-copies",
        "2",
        "--nodes",
        "4",
        "--steps",
        "12",
        "--join",
        "@4",
        "--ckpt-every",
        "5",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 12);
    assert_eq!((s.joins, s.fallbacks), (1, 0), "{}", o.show());
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "join")
        .unwrap_or_else(|| panic!("no join\n{}", o.show()));
    assert_eq!((rec.nodes_before, rec.nodes_after), (4, 5), "{rec:?}");
    assert_eq!(rec.transfers, 1, "{rec:?}");
    assert!(rec.bytes > 0, "{rec:?}");
    assert!(
        o.stderr
            .contains("1 newcomer(s) join in place; 1 shard copies re-placed"),
        "{}",
        o.show()
    );
    assert!(s.final_loss.is_finite());
    assert_eq!(assert_fsep_consistent(&dir), 5);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Resilient FSEP: killing nodes 2 and 3 at once kills both copies of shards 2 and 3, so the
/// survivors restore the newest checkpoint.
#[test]
fn a_kill_of_every_copy_of_a_shard_restores_the_checkpoint() {
    let dir = scratch("fsep-f2-lost");
    let d = dir.to_str().unwrap();
    let ck = dir.join("ckpt");
    let o = lzrun(&[
        "local",
        "--expert-mode",
        "fsep",
        "--shard-copies",
        "2",
        "--nodes",
        "4",
        "--steps",
        "10",
        "--kill",
        "2@5",
        "--kill",
        "3@5",
        "--ckpt-every",
        "4",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        d,
    ]);
    let s = o.summary();
    assert_eq!(s.steps, 10);
    assert_eq!(s.fallbacks, 1, "{}", o.show());
    let rec = s
        .reconfigurations
        .iter()
        .find(|r| r.kind == "checkpoint")
        .unwrap();
    assert_eq!(
        rec.resume_step, 4,
        "restored the step-4 checkpoint: {rec:?}"
    );
    assert_eq!(rec.nodes_after, 2, "{rec:?}");
    // Both losses seen together: shards lost. One seen first: its repair (from node 3) fails
    // when node 3 is found gone, and an unfinished repair restores too.
    assert!(
        o.stderr.contains("lost every copy") || o.stderr.contains("not completed on every member"),
        "{}",
        o.show()
    );
    assert_eq!(assert_fsep_consistent(&dir), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn shard_copies_must_fit_the_nodes_and_need_fsep() {
    let o = lzrun(&[
        "local",
        "--expert-mode",
        "fsep",
        "--nodes",
        "3",
        "--shard-copies",
        "4",
    ]);
    assert_error(&o, "--shard-copies must be between 1 and the 3 node(s)");
    let o = lzrun(&["local", "--expert-mode", "fsep", "--shard-copies", "0"]);
    assert_error(&o, "--shard-copies");
    let o = lzrun(&["local", "--shard-copies", "2"]);
    assert_error(&o, "needs --expert-mode fsep");
}

/// Issue 33, item 1 (the reproduction): node n1's agent is stopped (`kill -STOP`) near the
/// end; the workers train the last steps together, n0 finishes, and n1 is declared gone. n1
/// held the only replica of half the experts (f = 1 on 2 nodes), so the survivor does not hold
/// the final state. The job used to print `done: 40 steps` and exit 0 holding 4 of the 8
/// (layer, expert) pairs; now it must not report success: it restores, and with too few nodes
/// left for that it ends non-zero saying why.
#[test]
fn a_node_lost_as_the_job_finishes_never_leaves_a_successful_job_without_its_state() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("final-state");
    let m = dir.join("metrics");
    let mut live = Live::start_cmd(
        Command::new(LZRUN)
            .args([
                "local",
                "--nodes",
                "2",
                "--steps",
                "40",
                "--fault-tolerance",
                "1",
                "--heartbeat-timeout-ms",
                "3000",
                "--wait-for-nodes-ms",
                "1000",
                "--metrics-out",
                m.to_str().unwrap(),
            ])
            .env("LZRUN_TEST_STEP_DELAY", "0:400"),
    );
    live.wait_for(" step       36/");
    let (agent, _) = live.node("n1");
    signal(agent, libc::SIGSTOP);
    let o = live.finish();
    signal(agent, libc::SIGKILL);
    assert_ne!(o.code, Some(0), "{}", o.show());
    assert!(!o.stdout.contains("done: 40 steps"), "{}", o.show());
    // Usually n0 finishes before n1 is declared gone (3 steps of 400 ms < the 3 s heartbeat
    // timeout): the final-state rule. On a loaded machine the loss may come first and abort
    // the last step: the failure rules. Either way it restores, which needs a second node.
    let all = format!("{}\n{}", o.stdout, o.stderr);
    let finished_first = all.contains("every member finished, but")
        && all.contains("lost every replica: recovering the final state");
    assert!(
        finished_first || all.contains("step 39 failed"),
        "{}",
        o.show()
    );
    assert!(all.contains("waiting for nodes"), "{}", o.show());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33, item 1: a resumed run checkpoints where it resumed from (it used to write its
/// continuation into a temporary directory deleted on success), its last step is committed
/// whatever the cadence, and its summary's initial loss is that of its first step.
#[test]
fn a_resumed_run_checkpoints_into_its_resume_directory_up_to_its_last_step() {
    let dir = scratch("resume-dir");
    let a = dir.join("a");
    let o = lzrun(&[
        "local",
        "--steps",
        "12",
        "--ckpt-every",
        "5",
        "--metrics-out",
        a.to_str().unwrap(),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let ck = a.join("ckpt");
    // The last step is checkpointed although 12 is not a multiple of 5.
    assert!(
        ck.join("step-00000012").is_dir(),
        "{:?}",
        entries_starting(&ck, "step-")
    );
    let o = lzrun(&[
        "local",
        "--resume",
        ck.to_str().unwrap(),
        "--steps",
        "23",
        "--ckpt-every",
        "5",
        "--format",
        "json",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let s = o.summary();
    assert!(s.initial_loss.is_finite(), "{}", o.show());
    let steps = entries_starting(&ck, "step-");
    for want in ["step-00000020", "step-00000023"] {
        assert!(steps.iter().any(|s| s == want), "{want} missing: {steps:?}");
    }
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    assert!(latest.contains("step-00000023"), "{latest}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A resume whose checkpoint is already at or past `--steps` has nothing to train: it used to
/// train 0 steps and exit 0 with a NaN loss; it is refused with one line naming the step.
#[test]
fn a_resume_with_nothing_left_to_train_is_refused() {
    let dir = scratch("resume-done");
    let a = dir.join("a");
    let o = lzrun(&[
        "local",
        "--steps",
        "6",
        "--metrics-out",
        a.to_str().unwrap(),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let ck = a.join("ckpt");
    for steps in ["6", "4"] {
        let o = lzrun(&["local", "--resume", ck.to_str().unwrap(), "--steps", steps]);
        assert_eq!(o.code, Some(2), "--steps {steps}: {}", o.show());
        let err = o.stderr.trim();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("step 6") && err.contains("--steps"),
            "the line names the checkpoint's step and the flag: {err}"
        );
        // In the one step numbering (issue 35 item 6): the checkpoint after step 5.
        assert!(
            err.contains("its newest checkpoint is the checkpoint after step 5")
                && err.contains(&format!("--steps {steps} trains steps 0 to")),
            "{err}"
        );
    }
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    assert!(
        latest.contains("step-00000006"),
        "nothing written is lost: {latest}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33, item 2: the failpoint flips one bit of one replica (or, sharded, of one shard
/// copy) of node n1 after step 6's update; the step fingerprints catch it at that step and
/// the job ends non-zero naming the object, the nodes and the step.
#[test]
fn a_flipped_bit_in_one_copy_is_caught_at_the_step_it_happened() {
    for (mode, nodes, want) in [
        (&["--fault-tolerance", "2"][..], "2", "replica differs"),
        (
            &["--expert-mode", "fsep", "--shard-copies", "2"][..],
            "3",
            "copy differs",
        ),
    ] {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let mut args = vec!["local", "--nodes", nodes, "--steps", "12"];
        args.extend_from_slice(mode);
        let o = run(Command::new(LZRUN)
            .args(&args)
            .env("LZRUN_TEST_FLIP_BIT", "1:6"));
        assert_eq!(o.code, Some(2), "{}", o.show());
        let all = format!("{}\n{}", o.stdout, o.stderr);
        assert!(
            all.contains("copies of the state diverged at step 6") && all.contains(want),
            "{}",
            o.show()
        );
        assert!(!o.stdout.contains(" step        7/"), "{}", o.show());
    }
}
