//! `lzrun local --metrics-out` writes `run.json` (what `lzsim predict` replays), and `lzrun
//! calibrate` writes a hardware profile with every number commented. Runs one at a time (they
//! share the machine's cores).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Mutex;

const LZRUN: &str = env!("CARGO_BIN_EXE_lzrun");
static SERIAL: Mutex<()> = Mutex::new(());

fn lzrun(args: &[&str]) -> Output {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Command::new(LZRUN).args(args).output().expect("lzrun runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lzrun-calibrate-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn run_json_records_the_schedule_the_settings_and_the_timeline() {
    let dir = scratch("runjson");
    let out = dir.join("run");
    let o = lzrun(&[
        "local",
        "--nodes",
        "3",
        "--steps",
        "8",
        "--kill",
        "1@2",
        "--join",
        "@4",
        "--ckpt-every",
        "3",
        "--metrics-out",
        out.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", show(&o));
    let run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(run["format"], "lzrun-run/1");
    assert_eq!(run["nodes"], 3);
    assert_eq!(run["initial_names"], serde_json::json!(["n0", "n1", "n2"]));
    assert_eq!(run["steps"], 8);
    // Per-node batches: no global batch (`lzsim predict` prices `batch` per rank).
    assert_eq!(run["global_batch"], serde_json::Value::Null);
    assert_eq!(run["micro_batch"], serde_json::Value::Null);
    assert_eq!(run["seed"], 0);
    assert_eq!(run["fault_tolerance"], 2);
    assert_eq!(run["slots_per_node"], 3); // ⌈2·4 / 3⌉
    assert_eq!(run["checkpoint"]["every_steps"], 3);
    assert_eq!(run["model"]["d_model"], 64);
    assert_eq!(run["expert_state_bytes"], 3 * 4 * 2 * 64 * 128);
    assert_eq!(run["faults"]["source"], "flags");
    assert_eq!(
        run["faults"]["events"],
        serde_json::json!([
            {"after_step": 2, "fault": {"Kill": {"node": 1}}},
            {"after_step": 4, "fault": {"Join": {"name": null}}},
        ])
    );
    let tl = &run["timeline"];
    let first = tl["first_step_s"].as_f64().unwrap();
    assert!(first > 0.0, "{tl}");
    let injected = tl["injected"].as_array().unwrap();
    let kinds: Vec<&str> = injected
        .iter()
        .map(|i| i["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["kill", "join"]);
    assert_eq!(injected[1]["name"], "n3");
    assert!(injected[0]["t_s"].as_f64().unwrap() > first);
    let reconfigs: Vec<&str> = tl["reconfigurations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["kind"].as_str().unwrap())
        .collect();
    assert_eq!(reconfigs, ["start", "in-place", "join"]);
    // routing.csv: the routed tokens of every step record, 2 layers x 4 experts, each row
    // top_k (2) x the step's tokens in all (what `lzsim predict` feeds its job machine).
    let steps = std::fs::read_to_string(out.join("steps.csv")).unwrap();
    let records = steps.lines().count() - 1;
    let routing = std::fs::read_to_string(out.join("routing.csv")).unwrap();
    let mut lines = routing.lines();
    assert_eq!(lines.next(), Some("record,step,layer,e0,e1,e2,e3"));
    let rows: Vec<Vec<u64>> = lines
        .map(|l| l.split(',').map(|x| x.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 2 * records, "{routing}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(
            row[..3],
            [(i / 2) as u64, row[1], (i % 2) as u64],
            "{routing}"
        );
        let tokens: u64 = steps
            .lines()
            .nth(1 + i / 2)
            .unwrap()
            .split(',')
            .nth(3)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(row[3..].iter().sum::<u64>(), 2 * tokens, "{routing}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn calibrate_refuses_bad_input_with_exit_2() {
    let dir = scratch("bad");
    let out = dir.join("hw.toml");
    let out = out.to_str().unwrap();
    let missing = dir.join("no/such/dir/hw.toml");
    for (args, want) in [
        (
            vec!["calibrate", "--nodes", "1", "--out", out],
            "between 2 and 64",
        ),
        (
            vec!["calibrate", "--steps", "2", "--out", out],
            "between 4 and 100000",
        ),
        (
            vec!["calibrate", "--out", missing.to_str().unwrap()],
            "does not exist",
        ),
        (
            vec!["calibrate", "--config", "no-such.toml", "--out", out],
            "no-such.toml",
        ),
        (vec!["calibrate"], "required"),
        (
            vec!["calibrate", "--model-config", "no-such.json", "--out", out],
            "no-such.json",
        ),
    ] {
        let o = lzrun(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", show(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: {want:?} not in {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert!(!dir.join("hw.toml").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn calibrate_writes_every_number_with_how_it_was_measured() {
    let dir = scratch("profile");
    let out = dir.join("hw.toml");
    let o = lzrun(&[
        "calibrate",
        "--nodes",
        "2",
        "--steps",
        "4",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", show(&o));
    let text = std::fs::read_to_string(&out).unwrap();
    let table: toml::Table = text.parse().unwrap();
    let keys = [
        "gpu_flops_effective",
        "host_cores",
        "step_overhead_s",
        "step_per_peer_s",
        "checkpoint_bandwidth_bytes_per_s",
        "failure_detection_timeout_s",
        "failure_detection_steps",
        "failure_detection_steps_later",
        "replan_s",
        "communicator_rebuild_s",
        "process_restart_s",
        "node_boot_s",
        "state_transfer_bandwidth_bytes_per_s",
        "inter_node_bandwidth_bytes_per_s",
        "job_start_s",
        "job_start_per_node_s",
        "job_stop_s",
    ];
    let lines: Vec<&str> = text.lines().collect();
    for key in keys {
        let v = table
            .get(key)
            .and_then(|v| v.as_float())
            .unwrap_or_else(|| panic!("{key} missing or not a number:\n{text}"));
        assert!(v.is_finite() && v >= 0.0, "{key} = {v}");
        // A comment right above every number says how it was measured.
        let at = lines
            .iter()
            .position(|l| l.starts_with(&format!("{key} = ")))
            .unwrap();
        assert!(lines[at - 1].starts_with("# "), "{key} has no comment");
    }
    assert!(table["gpu_flops_effective"].as_float().unwrap() > 0.0);
    // The temporary measuring runs are gone.
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(left.len(), 1, "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--model-config`: every measuring job trains the Hugging Face model (here the repository's
/// tiny DeepSeek-V3), and the profile says so in its model line.
#[test]
fn calibrate_measures_a_hugging_face_model() {
    let dir = scratch("hf");
    let out = dir.join("hw.toml");
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/deepseek-v3-tiny.json");
    let work = dir.join("work");
    let o = lzrun(&[
        "calibrate",
        "--model-config",
        model,
        "--nodes",
        "2",
        "--steps",
        "4",
        "--out",
        out.to_str().unwrap(),
        "--work-dir",
        work.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", show(&o));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("DeepseekV3ForCausalLM"), "{text}");
    let table: toml::Table = text.parse().unwrap();
    assert!(table["gpu_flops_effective"].as_float().unwrap() > 0.0);
    // Every measuring run recorded the DeepSeek model in its run.json.
    let runs = std::fs::read_dir(&work).unwrap();
    let mut n = 0;
    for r in runs {
        let p = r.unwrap().path().join("run.json");
        if p.exists() {
            let run = std::fs::read_to_string(&p).unwrap();
            assert!(run.contains("DeepseekV3ForCausalLM"), "{}", p.display());
            n += 1;
        }
    }
    assert!(n >= 4, "{n} measuring runs");
    let _ = std::fs::remove_dir_all(&dir);
}
