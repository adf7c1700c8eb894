//! Issue 31 item 1: held-out evaluation end to end. `lzrun local --eval-data` reports the
//! eval loss and perplexity at the due steps (log line, steps.csv, summary.json) without
//! changing the training, and the eval loss does not depend on how many members split the
//! eval set (phantom forwards keep the exchanges collective). Bad eval flags are one line and
//! exit 2.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lazarus_executor::metrics::StepRecord;
use lazarus_executor::model::EMBEDDED_CORPUS;

mod process;
use process::{Outcome, run_within};

const LZRUN: &str = env!("CARGO_BIN_EXE_lzrun");
const LIMIT: Duration = Duration::from_secs(300);
/// One run at a time: the runs share the machine's cores with each other's workers.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lzrun(args: &[&str]) -> Outcome {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run_within(Command::new(LZRUN).args(args), LIMIT)
}

fn scratch(name: &str) -> PathBuf {
    process::scratch("eval", name)
}

/// Evaluate three micro-batches of the flat u16 file `data` after every second step.
fn eval_every_2(data: &Path) -> [&str; 8] {
    [
        "--eval-data",
        data.to_str().unwrap(),
        "--data-dtype",
        "u16",
        "--eval-every",
        "2",
        "--eval-batches",
        "3",
    ]
}

/// The embedded corpus as a flat u16 token file (its byte tokens: the tiny model's vocab).
fn eval_file(dir: &Path) -> PathBuf {
    let path = dir.join("eval.bin");
    let bytes: Vec<u8> = EMBEDDED_CORPUS
        .bytes()
        .flat_map(|b| u16::from(b).to_le_bytes())
        .collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

fn steps_csv(dir: &Path) -> Vec<StepRecord> {
    csv::Reader::from_path(dir.join("steps.csv"))
        .expect("steps.csv")
        .deserialize()
        .collect::<Result<_, _>>()
        .expect("steps.csv rows")
}

/// A 6-step global-batch run on `nodes` nodes, with the eval flags `eval` (none: no eval);
/// its step records, in step order, and its output.
fn run(dir: &Path, name: &str, nodes: &str, eval: &[&str]) -> (Vec<StepRecord>, Outcome) {
    let metrics = dir.join(name);
    let m = metrics.to_str().unwrap();
    let mut args = vec![
        "local",
        "--nodes",
        nodes,
        "--global-batch",
        "8",
        "--micro-batch",
        "4",
        "--steps",
        "6",
        "--metrics-out",
        m,
    ];
    args.extend(eval);
    let o = lzrun(&args);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let rows = steps_csv(&metrics);
    assert_eq!(
        rows.iter().map(|r| r.step).collect::<Vec<_>>(),
        (0..6).collect::<Vec<u64>>(),
        "one record per step, no fault"
    );
    (rows, o)
}

#[test]
fn eval_reports_held_out_loss_at_due_steps_and_leaves_training_unchanged() {
    let dir = scratch("e2e");
    let data = eval_file(&dir);
    let eval = eval_every_2(&data);
    let (with, o) = run(&dir, "with", "2", &eval);
    let (without, _) = run(&dir, "without", "2", &[]);

    // Evaluated after steps 1, 3 and 5 (the last), nowhere else; ppl = exp(loss).
    for r in &with {
        let due = matches!(r.step, 1 | 3 | 5);
        assert_eq!(r.eval_loss.is_some(), due, "{r:?}");
        assert_eq!(r.eval_ppl.is_some(), due, "{r:?}");
        if let (Some(l), Some(p)) = (r.eval_loss, r.eval_ppl) {
            assert!(l.is_finite() && l > 0.0, "{r:?}");
            assert!((p - l.exp()).abs() <= 1e-9 * p, "{r:?}");
        }
    }
    // An empty field, not NaN, where the step was not evaluated.
    let text = std::fs::read_to_string(dir.join("with/steps.csv")).unwrap();
    assert!(
        text.lines()
            .next()
            .unwrap()
            .ends_with(",eval_loss,eval_ppl")
    );
    assert!(text.lines().nth(1).unwrap().ends_with(",,"), "{text}");
    // Training on the held-out text lowers its loss too.
    let losses: Vec<f64> = with.iter().filter_map(|r| r.eval_loss).collect();
    assert!(losses[2] < losses[0], "{losses:?}");

    // The eval changes nothing of the training: the same losses, bit for bit.
    let bits = |rows: &[StepRecord]| rows.iter().map(|r| r.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&with), bits(&without));
    assert!(without.iter().all(|r| r.eval_loss.is_none()));

    // The log line of an evaluated step, Megatron-style, and only there.
    let lines: Vec<&str> = o
        .stdout
        .lines()
        .filter(|l| l.starts_with(" step "))
        .collect();
    assert_eq!(lines.len(), 6, "{}", o.show());
    for (line, r) in lines.iter().zip(&with) {
        assert_eq!(
            line.contains(" | eval loss: "),
            r.eval_loss.is_some(),
            "{line}"
        );
        assert_eq!(
            line.contains(" | eval ppl: "),
            r.eval_ppl.is_some(),
            "{line}"
        );
    }

    // summary.json: the first and the final eval.
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("with/summary.json")).unwrap())
            .unwrap();
    assert_eq!(s["first_eval_loss"].as_f64(), with[1].eval_loss);
    assert_eq!(s["first_eval_ppl"].as_f64(), with[1].eval_ppl);
    assert_eq!(s["final_eval_loss"].as_f64(), with[5].eval_loss);
    assert_eq!(s["final_eval_ppl"].as_f64(), with[5].eval_ppl);
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("without/summary.json")).unwrap())
            .unwrap();
    assert!(s.get("final_eval_loss").is_none(), "{s}");

    // Three members split 3 eval micro-batches 1:1:1 and 8 training sequences 1:1:0 (the
    // third runs phantom rounds in training, none in eval); two members split them 2:1 (a
    // phantom forward for the second). The eval losses agree.
    let (three, _) = run(&dir, "three", "3", &eval);
    for (a, b) in with.iter().zip(&three) {
        match (a.eval_loss, b.eval_loss) {
            (Some(x), Some(y)) => assert!((x - y).abs() <= 1e-5 * x.abs(), "{x} vs {y}"),
            (x, y) => assert_eq!(x, y, "step {}", a.step),
        }
    }
    // Four eval micro-batches over three members (2:1:1): the others run a phantom forward
    // in the second round.
    let four = [
        "--eval-data",
        data.to_str().unwrap(),
        "--data-dtype",
        "u16",
        "--eval-every",
        "0",
    ];
    let (three4, _) = run(&dir, "three4", "3", &four);
    let (two4, _) = run(&dir, "two4", "2", &four);
    let evaluated = |rows: &[StepRecord]| {
        rows.iter()
            .filter(|r| r.eval_loss.is_some())
            .map(|r| r.step)
            .collect::<Vec<_>>()
    };
    // --eval-every 0: the last step only.
    assert_eq!(evaluated(&three4), [5]);
    assert_eq!(evaluated(&two4), [5]);
    let (x, y) = (three4[5].eval_loss.unwrap(), two4[5].eval_loss.unwrap());
    assert!((x - y).abs() <= 1e-5 * x.abs(), "{x} vs {y}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A failed evaluation fails its step like any collective of the step: every member puts its
/// state back to before the step's update (its snapshot), the job reconfigures in place and
/// redoes the step, and the run computes the fault-free run's losses and eval losses bit for
/// bit (without the undo the step's update would be applied twice). The failpoint
/// `LZRUN_TEST_EVAL_FAIL=1:3` fails node 1's evaluation after step 3 once, before its first
/// eval collective; the other members' eval collectives then fail.
#[test]
fn a_failed_evaluation_redoes_the_step_from_before_its_update() {
    let dir = scratch("fail");
    let data = eval_file(&dir);
    let eval = eval_every_2(&data);
    let (clean, _) = run(&dir, "clean", "3", &eval);
    let metrics = dir.join("failed");
    let o = {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        run_within(
            Command::new(LZRUN)
                .args([
                    "local",
                    "--nodes",
                    "3",
                    "--global-batch",
                    "8",
                    "--micro-batch",
                    "4",
                    "--steps",
                    "6",
                    "--metrics-out",
                    metrics.to_str().unwrap(),
                ])
                .args(eval)
                .env("LZRUN_TEST_EVAL_FAIL", "1:3"),
            LIMIT,
        )
    };
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(
        o.stdout
            .contains("step 3 failed: held-out evaluation: test failpoint"),
        "{}",
        o.show()
    );
    let failed = steps_csv(&metrics);
    let bits = |rows: &[StepRecord]| {
        rows.iter()
            .map(|r| (r.step, r.loss.to_bits(), r.eval_loss.map(f64::to_bits)))
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&failed), bits(&clean), "{}", o.show());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(metrics.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(s["recoveries"], 1, "{s}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_eval_flags_exit_2_with_one_line() {
    let dir = scratch("bad");
    let data = eval_file(&dir);
    let d = data.to_str().unwrap();
    let missing = dir.join("missing.bin");
    let cases: [(Vec<&str>, &str); 6] = [
        (
            vec![
                "--eval-data",
                missing.to_str().unwrap(),
                "--data-dtype",
                "u16",
            ],
            "--eval-data",
        ),
        (
            vec!["--eval-every", "2"],
            "--eval-every without --eval-data",
        ),
        (
            vec!["--eval-batches", "2"],
            "--eval-batches without --eval-data",
        ),
        (
            vec![
                "--eval-data",
                d,
                "--data-dtype",
                "u16",
                "--eval-batches",
                "0",
            ],
            "--eval-batches 0 is out of range",
        ),
        (vec!["--eval-data", d], "--data-dtype u16|u32"),
        // Token ids past the vocabulary: read as u32, two byte tokens make one large id.
        (vec!["--eval-data", d, "--data-dtype", "u32"], "--eval-data"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["local", "--steps", "2"];
        args.extend(&flags);
        let o = lzrun(&args);
        assert_eq!(o.code, Some(2), "{flags:?}\n{}", o.show());
        assert!(!o.stderr.contains("panicked"), "{flags:?}\n{}", o.show());
        assert_eq!(o.stderr.lines().count(), 1, "{flags:?}\n{}", o.show());
        assert!(
            o.stderr.starts_with("error: ") && o.stderr.contains(want),
            "{flags:?}: wanted {want:?}\n{}",
            o.show()
        );
    }
    // Absurd numbers are one line naming the flag and its bound (issue 33 item 6.1), for
    // `lzrun controller` too.
    const HUGE: &str = "18446744073709551615";
    for flag in ["--eval-every", "--eval-batches"] {
        for sub in [&["local"][..], &["controller", "--token", "t"][..]] {
            let mut args = sub.to_vec();
            args.extend([flag, HUGE]);
            let o = lzrun(&args);
            assert_eq!(o.code, Some(2), "{args:?}\n{}", o.show());
            assert_eq!(o.stderr.lines().count(), 1, "{args:?}\n{}", o.show());
            assert!(
                o.stderr
                    .contains(&format!("error: {flag} {HUGE} is out of range")),
                "{args:?}\n{}",
                o.show()
            );
        }
    }
    let o = lzrun(&["local", "--help"]);
    for flag in ["--eval-data", "--eval-every", "--eval-batches"] {
        assert!(o.stdout.contains(flag), "{flag} not in --help");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
