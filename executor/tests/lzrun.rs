//! End-to-end runs of the `lzrun` binary: `lzrun local` spawns real worker processes that
//! train over loopback TCP; replicas of one expert must end bit-identical on every worker.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use lazarus_executor::worker::{Checksums, StepLine};

const LZRUN: &str = env!("CARGO_BIN_EXE_lzrun");
const LIMIT: Duration = Duration::from_secs(240);

struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `lzrun args…` and kills it if it takes longer than [`LIMIT`] (its workers stop when
/// their stdin closes with it).
fn lzrun(args: &[&str]) -> Outcome {
    let mut child = Command::new(LZRUN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lzrun");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for lzrun") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lzrun {args:?} did not finish within {LIMIT:?}");
        }
        thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        code: status.code(),
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lzrun-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn local_two_workers_train_and_keep_replicas_identical() {
    let dir = scratch("local2");
    let dir_s = dir.to_str().unwrap();
    let o = lzrun(&["local", "--nodes", "2", "--steps", "4", "--out", dir_s]);
    assert_eq!(
        o.code,
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        o.stdout,
        o.stderr
    );

    // `[rank R] {json}` step lines.
    let mut steps: BTreeMap<usize, Vec<StepLine>> = BTreeMap::new();
    for line in o.stdout.lines() {
        let Some(rest) = line.strip_prefix("[rank ") else {
            continue;
        };
        let (rank, json) = rest.split_once("] ").expect("prefixed line");
        let step: StepLine = serde_json::from_str(json).expect("step JSON");
        steps.entry(rank.parse().unwrap()).or_default().push(step);
    }
    assert_eq!(steps.len(), 2, "stdout:\n{}", o.stdout);
    for (rank, s) in &steps {
        assert_eq!(
            s.iter().map(|x| x.step).collect::<Vec<_>>(),
            vec![0, 1, 2, 3],
            "rank {rank}"
        );
        assert!(s.iter().all(|x| x.tokens > 0 && x.ms >= 0.0));
        let last = s.last().unwrap();
        assert!(
            last.loss.is_finite(),
            "rank {rank}: last loss {}",
            last.loss
        );
    }
    assert!(o.stdout.contains("mean loss"), "no summary:\n{}", o.stdout);

    // Replicas of the same expert have equal checksums on both workers.
    let sums: Vec<Checksums> = (0..2)
        .map(|r| Checksums::read(&Checksums::path(&dir, r)).expect("checksum file"))
        .collect();
    assert_eq!(sums[0].dense, sums[1].dense, "dense weights differ");
    let mut seen: BTreeMap<(usize, usize), Vec<(u64, u64)>> = BTreeMap::new();
    for s in &sums {
        assert_eq!((s.world, s.steps), (2, 4));
        for r in &s.replicas {
            seen.entry((r.layer, r.expert))
                .or_default()
                .push((r.checksum, r.weights_checksum));
        }
    }
    let shared = seen.values().filter(|v| v.len() == 2).count();
    assert!(shared > 0, "no expert is replicated on both workers");
    for (k, v) in &seen {
        assert!(
            v.iter().all(|x| *x == v[0]),
            "replicas of {k:?} differ: {v:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn assert_one_error_line(o: &Outcome, want: &str) {
    assert_eq!(o.code, Some(2), "stderr:\n{}", o.stderr);
    let lines: Vec<&str> = o.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "stderr:\n{}", o.stderr);
    assert!(lines[0].starts_with("error: "), "{}", lines[0]);
    assert!(lines[0].contains(want), "{}", lines[0]);
}

#[test]
fn bad_arguments_exit_2_with_one_clear_line() {
    assert_one_error_line(&lzrun(&["local", "--nodes", "0"]), "--nodes");
    assert_one_error_line(&lzrun(&["local", "--bogus"]), "--bogus");
    assert_one_error_line(&lzrun(&["local", "--config", "huge"]), "huge");
    assert_one_error_line(
        &lzrun(&[
            "worker",
            "--rank",
            "0",
            "--world",
            "2",
            "--peers",
            "127.0.0.1:1",
        ]),
        "--peers",
    );
}

/// `[rank R] {json}` step lines per worker (other prefixed lines are skipped).
fn step_lines(stdout: &str) -> BTreeMap<usize, Vec<StepLine>> {
    let mut steps: BTreeMap<usize, Vec<StepLine>> = BTreeMap::new();
    for line in stdout.lines() {
        let Some(rest) = line.strip_prefix("[rank ") else {
            continue;
        };
        let (rank, json) = rest.split_once("] ").expect("prefixed line");
        if let Ok(step) = serde_json::from_str::<StepLine>(json) {
            steps.entry(rank.parse().unwrap()).or_default().push(step);
        }
    }
    steps
}

#[test]
fn local_recovers_in_place_from_a_killed_worker() {
    let dir = scratch("kill");
    let dir_s = dir.to_str().unwrap();
    let o = lzrun(&[
        "local",
        "--nodes",
        "3",
        "--steps",
        "8",
        "--kill",
        "2@3",
        "--out",
        dir_s,
        "--timeout-ms",
        "2000",
    ]);
    let show = format!("stdout:\n{}\nstderr:\n{}", o.stdout, o.stderr);
    assert_eq!(o.code, Some(0), "{show}");

    // Survivors report every step (a rolled-back step may be reported twice).
    let steps = step_lines(&o.stdout);
    for rank in [0, 1] {
        let mut seen: Vec<u64> = steps[&rank].iter().map(|s| s.step).collect();
        seen.dedup();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, (0..8).collect::<Vec<_>>(), "rank {rank}\n{show}");
        assert!(steps[&rank].iter().all(|s| s.loss.is_finite()));
    }
    let killed_steps: Vec<u64> = steps[&2].iter().map(|s| s.step).collect();
    assert_eq!(killed_steps.last(), Some(&3), "{show}");

    // One recovery line with the four phases.
    let rec: Vec<serde_json::Value> = o
        .stdout
        .lines()
        .filter(|l| l.starts_with("{\"recovery\""))
        .map(|l| serde_json::from_str(l).expect("recovery JSON"))
        .collect();
    assert_eq!(rec.len(), 1, "{show}");
    let r = &rec[0]["recovery"];
    for phase in ["detect_ms", "replan_ms", "migrate_ms", "resume_ms"] {
        let ms = r[phase].as_f64().unwrap_or(-1.0);
        assert!(ms >= 0.0, "{phase}: {r}");
    }
    assert!(r["detect_ms"].as_f64().unwrap() < 2000.0 * 3.0, "{r}");
    assert_eq!(r["killed"], serde_json::json!([2]), "{r}");

    // After recovery: replicas of one expert identical, dense identical, nothing lost.
    let sums: Vec<Checksums> = (0..2)
        .map(|r| Checksums::read(&Checksums::path(&dir, r)).expect("checksum file"))
        .collect();
    assert_eq!(sums[0].dense, sums[1].dense, "dense weights differ");
    let mut seen: BTreeMap<(usize, usize), Vec<(u64, u64)>> = BTreeMap::new();
    for s in &sums {
        assert_eq!((s.world, s.steps), (2, 8));
        for r in &s.replicas {
            seen.entry((r.layer, r.expert))
                .or_default()
                .push((r.checksum, r.weights_checksum));
        }
    }
    let cfg = lazarus_executor::model::MoeConfig::tiny();
    for l in 0..cfg.n_layers {
        for e in 0..cfg.experts {
            assert!(
                seen.contains_key(&(l, e)),
                "expert {e} of layer {l} vanished"
            );
        }
    }
    for (k, v) in &seen {
        assert!(
            v.iter().all(|x| *x == v[0]),
            "replicas of {k:?} differ: {v:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// With 2 nodes the tiny plan keeps every expert on both, so a lost expert needs two kills
/// out of 3 nodes (3 slots each: the survivor holds at most 3 of the 4 experts per layer).
#[test]
fn local_kill_that_loses_every_replica_exits_2() {
    let o = lzrun(&[
        "local",
        "--nodes",
        "3",
        "--steps",
        "6",
        "--kill",
        "1@2",
        "--kill",
        "2@2",
        "--timeout-ms",
        "2000",
    ]);
    let show = format!("stdout:\n{}\nstderr:\n{}", o.stdout, o.stderr);
    assert_eq!(o.code, Some(2), "{show}");
    let line = o
        .stderr
        .lines()
        .find(|l| l.starts_with("error: ") && l.contains("lost every replica"))
        .unwrap_or_else(|| panic!("no lost-expert line\n{show}"));
    assert!(
        line.contains("expert ") && line.contains("of layer "),
        "{line}"
    );
    assert!(line.contains("checkpoint"), "{line}");
}
