//! `lzsim predict` on recorded `lzrun local --metrics-out` directories (fixtures made by real
//! runs, trimmed: checkpoints removed) with a profile `lzrun calibrate` wrote on the machine that
//! made them, and `lzrun local` then `lzsim predict` end to end.
//!
//! The library checks always run; the ones that run `lzsim` or `lzrun` take the binaries of this
//! workspace (see [`binary`]) and print one `skipped: …` line when they have not been built.

use lazarus_simulator::cost::{self, HardwareProfile};
use lazarus_simulator::predict::{self, RunDir, RunDirError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn profile_path() -> PathBuf {
    fixtures().join("lzrun-local-hardware.toml")
}

fn profile() -> HardwareProfile {
    cost::hardware(profile_path().to_str().unwrap()).expect("the calibrated profile loads")
}

/// The workspace binary `name` (`lzsim` of `lazarus-simulator`, `lzrun` of `lazarus-executor`):
/// `$LZSIM` / `$LZRUN` when set, else the one next to this test's own binary
/// (`target/<profile>/<name>`, built by `cargo test --workspace` or any build of its package).
/// A test binary only gets `CARGO_BIN_EXE_*` for its own package's binaries, hence the search.
/// `None` when absent, after one `skipped: …` line on stderr (written directly, so the test
/// harness's output capture does not hide it).
fn binary(name: &str) -> Option<PathBuf> {
    let var = name.to_uppercase();
    if let Some(p) = std::env::var_os(&var).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    // target/<profile>/deps/predict-<hash> → target/<profile>/<name>
    let exe = std::env::current_exe().ok();
    let p = exe
        .as_deref()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .map(|dir| dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX)));
    match p {
        Some(p) if p.is_file() => Some(p),
        _ => {
            let package = match name {
                "lzrun" => "lazarus-executor",
                _ => "lazarus-simulator",
            };
            let line = format!(
                "skipped: no {name} binary next to the test (cargo build -p {package}, or set {var})\n"
            );
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
            None
        }
    }
}

/// `lzsim ARGS`, or `None` when the binary is not there (see [`binary`]).
fn lzsim_command() -> Option<impl Fn(&[&str]) -> Output> {
    let bin = binary("lzsim")?;
    Some(move |args: &[&str]| Command::new(&bin).args(args).output().expect("lzsim runs"))
}

#[test]
fn the_calibrated_profile_round_trips() {
    let hw = profile();
    // Every optional host term of a calibrated profile is there.
    assert!(hw.host_cores.is_some() && hw.step_per_peer_s.is_some() && hw.job_stop_s.is_some());
    let text = toml::to_string(&hw).unwrap();
    let back: HardwareProfile = toml::from_str(&text).unwrap();
    assert_eq!(back, hw);
    // And through a file, as lzsim reads it.
    let dir = std::env::temp_dir().join(format!("lzsim-predict-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("hw.toml");
    std::fs::write(&file, &text).unwrap();
    assert_eq!(cost::hardware(file.to_str().unwrap()).unwrap(), hw);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `(fixture, recoveries, fallbacks, joins, steps)`. `run-heldout` is the held-out run of
/// issue 33 item 5 (`lzrun local --nodes 5 --steps 80 --kill 2@13 --kill 0@29 --kill 3@29
/// --join @41 --kill 4@55 --ckpt-every 10`), with its `routing.csv`: predicted with uniform
/// loads it had 3 recoveries and no restore; its nodes registered as n4, n1, n3, n2, n0.
/// `run-global-batch`: `lzrun local --nodes 4 --global-batch 16 --micro-batch 4 --steps 12
/// --kill 1@5` (16 samples per step on 4 members and then on 3; samples.csv left out).
const RUNS: [(&str, u64, u64, u64, u64); 4] = [
    ("run-kill-join", 1, 0, 1, 16),
    ("run-restore", 0, 1, 0, 16),
    ("run-heldout", 2, 1, 1, 80),
    ("run-global-batch", 1, 0, 0, 12),
];

#[test]
fn predict_gives_the_recorded_counts_and_the_same_output_every_time() {
    // The held-out run records its routing; the others predate routing.csv (uniform loads).
    assert!(fixtures().join("run-heldout/routing.csv").is_file());
    assert!(
        RunDir::load(&fixtures().join("run-heldout"))
            .unwrap()
            .routing
            .is_some()
    );
    let hw = profile();
    for (name, recoveries, fallbacks, joins, steps) in RUNS {
        let run = RunDir::load(&fixtures().join(name)).unwrap();
        let p = predict::predict(&run, &hw).unwrap();
        for o in [&p.measured, &p.predicted] {
            assert_eq!(
                (o.recoveries, o.fallbacks, o.joins, o.steps),
                (recoveries, fallbacks, joins, steps),
                "{name}: {o:?}"
            );
        }
        // Every count exactly: steps, samples, recoveries, restores, joins, rebalances.
        let counts = |o: &predict::Outcome| {
            (
                o.steps,
                o.samples,
                o.recoveries,
                o.fallbacks,
                o.joins,
                o.rebalances,
            )
        };
        assert_eq!(counts(&p.predicted), counts(&p.measured), "{name}");
        let a = serde_json::to_string(&p.json()).unwrap();
        let b = serde_json::to_string(&predict::predict(&run, &hw).unwrap().json()).unwrap();
        assert_eq!(a, b, "{name}: the prediction changed between two calls");
        // The breakdowns add up to the wall time.
        for o in [&p.measured, &p.predicted] {
            let t = o.time;
            let sum =
                t.compute_s + t.checkpoint_s + t.reconfigure_s + t.restore_s + t.lost_s + t.idle_s;
            assert!(
                (sum - o.wall_s).abs() < 1e-6,
                "{name}: {sum} vs {}",
                o.wall_s
            );
        }
    }
}

#[test]
fn the_command_prints_the_same_json_every_time() {
    let Some(lzsim) = lzsim_command() else {
        return;
    };
    let hw = profile_path();
    for (name, recoveries, fallbacks, _, _) in RUNS {
        let dir = fixtures().join(name);
        let args = [
            "predict",
            dir.to_str().unwrap(),
            "--hardware",
            hw.to_str().unwrap(),
            "--format",
            "json",
        ];
        let a = lzsim(&args);
        assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
        let b = lzsim(&args);
        assert_eq!(a.stdout, b.stdout, "{name}");
        let v: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
        for side in ["measured", "predicted", "relative_error"] {
            for key in ["wall_s", "steps", "samples", "recoveries", "fallbacks"] {
                assert!(v[side].get(key).is_some(), "{name}: {side}.{key} missing");
            }
        }
        assert_eq!(v["predicted"]["recoveries"], recoveries);
        assert_eq!(v["predicted"]["fallbacks"], fallbacks);
        assert_eq!(v["relative_error"]["steps"], 0.0);
        // The text table names every quantity.
        let t = lzsim(&args[..4]);
        assert!(t.status.success());
        let text = String::from_utf8(t.stdout).unwrap();
        for word in [
            "wall_s",
            "recoveries",
            "fallbacks",
            "compute",
            "restore",
            "idle",
        ] {
            assert!(text.contains(word), "{name}: {word} missing in\n{text}");
        }
    }
}

#[test]
fn the_profile_defaults_to_the_run_directory() {
    let Some(lzsim) = lzsim_command() else {
        return;
    };
    let tmp = std::env::temp_dir().join(format!("lzsim-predict-default-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let src = fixtures().join(RUNS[0].0);
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), tmp.join(f.file_name())).unwrap();
    }
    let out = lzsim(&["predict", tmp.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no hardware profile") && err.contains("hardware.toml"),
        "{err}"
    );
    std::fs::copy(profile_path(), tmp.join("hardware.toml")).unwrap();
    let out = lzsim(&["predict", tmp.to_str().unwrap(), "--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn bad_input_names_the_problem_and_exits_2() {
    let Some(lzsim) = lzsim_command() else {
        return;
    };
    let tmp = std::env::temp_dir().join(format!("lzsim-predict-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let hw = profile_path();
    let hw = hw.to_str().unwrap();
    let check = |args: &[&str], want: &[&str]| {
        let out = lzsim(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{err}");
        for w in want {
            assert!(err.contains(w), "{args:?}: {w:?} not in {err}");
        }
    };
    // No such directory.
    let missing = tmp.join("nope");
    check(
        &["predict", missing.to_str().unwrap(), "--hardware", hw],
        &["nope", "no such directory"],
    );
    // A directory without run.json.
    let empty = tmp.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    check(
        &["predict", empty.to_str().unwrap(), "--hardware", hw],
        &["run.json", "missing"],
    );
    // Malformed files, one at a time.
    let src = fixtures().join(RUNS[0].0);
    for (file, bad) in [
        ("run.json", "{\"format\": \"lzrun-run/1\"}"),
        ("summary.json", "not json"),
        ("steps.csv", "step,t_s\nx,y\n"),
        ("reconfigurations.jsonl", "{\"kind\": 3}\n"),
    ] {
        let d = tmp.join(format!("bad-{file}"));
        std::fs::create_dir_all(&d).unwrap();
        for f in std::fs::read_dir(&src).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), d.join(f.file_name())).unwrap();
        }
        std::fs::write(d.join(file), bad).unwrap();
        check(&["predict", d.to_str().unwrap(), "--hardware", hw], &[file]);
        match RunDir::load(&d) {
            Err(RunDirError::Malformed { path, .. }) => assert!(path.ends_with(file)),
            other => panic!("{file}: {other:?}"),
        }
    }
    // A malformed or missing profile.
    let bad_hw = tmp.join("bad-hw.toml");
    std::fs::write(&bad_hw, "name = \"x\"\nhost_cores = -1\n").unwrap();
    check(
        &[
            "predict",
            src.to_str().unwrap(),
            "--hardware",
            bad_hw.to_str().unwrap(),
        ],
        &["bad-hw.toml"],
    );
    check(
        &[
            "predict",
            src.to_str().unwrap(),
            "--hardware",
            "no-such-profile.toml",
        ],
        &["no-such-profile.toml"],
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A copy of the run directory `src` at `dst` whose `run.json` went through `edit`.
fn edited_copy(src: &Path, dst: &Path, edit: &dyn Fn(&mut serde_json::Value)) -> PathBuf {
    std::fs::create_dir_all(dst).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
    let mut run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dst.join("run.json")).unwrap()).unwrap();
    edit(&mut run);
    std::fs::write(dst.join("run.json"), serde_json::to_vec(&run).unwrap()).unwrap();
    dst.to_path_buf()
}

/// A `--storm` run's schedule: a frozen worker or agent is a lost node (predicted like the
/// kill it replaces); a controller kill or a full disk is named as not modelled (exit 2).
#[test]
fn storm_faults_are_predicted_as_lost_nodes_or_named_as_not_modelled() {
    let Some(lzsim) = lzsim_command() else {
        return;
    };
    let tmp = std::env::temp_dir().join(format!("lzsim-predict-storm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let src = fixtures().join(RUNS[0].0);
    let with_events = |name: &str, edit: &dyn Fn(&mut Vec<serde_json::Value>)| {
        edited_copy(&src, &tmp.join(name), &|run| {
            edit(run["faults"]["events"].as_array_mut().unwrap())
        })
    };
    let frozen = with_events("frozen", &|events| {
        for e in events.iter_mut() {
            if let Some(kill) = e["fault"].get("Kill").cloned() {
                e["fault"] = serde_json::json!({ "FreezeWorker": kill });
            }
        }
    });
    let steps = |d: &Path| RunDir::load(d).unwrap().step_events().unwrap();
    assert_eq!(steps(&frozen), steps(&src));
    for (fault, want) in [
        (
            serde_json::json!("KillController"),
            "controller kill after step 6",
        ),
        (
            serde_json::json!({"DiskFull": {"steps": 2}}),
            "full checkpoint disk after step 6",
        ),
    ] {
        let d = with_events("unmodelled", &|events| {
            events.push(serde_json::json!({"after_step": 6, "fault": fault.clone()}));
        });
        let out = lzsim(&[
            "predict",
            d.to_str().unwrap(),
            "--hardware",
            profile_path().to_str().unwrap(),
        ]);
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(want) && err.contains("does not model"),
            "{err}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// An `--expert-mode fsep` run is replayed by the FSEP systems: with one copy of every shard
/// (`laer`) the kill restores the checkpoint, with two (`lazarus-fsep`) it is repaired in
/// place — the same kill that the replicated run (`lazarus`) recovers in place.
#[test]
fn sharded_runs_are_predicted_by_the_fsep_systems() {
    use lazarus_simulator::replay::systems::SystemKind;
    let tmp = std::env::temp_dir().join(format!("lzsim-predict-fsep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let src = fixtures().join(RUNS[0].0);
    let hw = profile();
    let sharded = |name: &str, copies: Option<usize>| {
        let d = edited_copy(&src, &tmp.join(name), &|run| {
            run["rules"]["sharded_experts"] = serde_json::json!(true);
            if let Some(c) = copies {
                run["rules"]["shard_copies"] = serde_json::json!(c);
            }
        });
        RunDir::load(&d).unwrap()
    };
    let replicated = RunDir::load(&src).unwrap();
    assert_eq!(replicated.config.system(), SystemKind::Lazarus);
    let one = sharded("one-copy", None);
    assert_eq!(one.config.system(), SystemKind::Laer);
    let two = sharded("two-copies", Some(2));
    assert_eq!(two.config.system(), SystemKind::LazarusFsep);
    let p1 = predict::predict(&one, &hw).unwrap().predicted;
    let p2 = predict::predict(&two, &hw).unwrap().predicted;
    assert_eq!((p1.recoveries, p1.fallbacks), (0, 1), "laer: {p1:?}");
    assert_eq!(
        (p2.recoveries, p2.fallbacks),
        (1, 0),
        "lazarus-fsep: {p2:?}"
    );
    for p in [&p1, &p2] {
        assert_eq!(p.steps, 16);
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The held-out run without its `routing.csv` is replayed with uniform loads and mispredicted
/// (3 recoveries and no restore instead of 2 and 1: the run's plans followed its routing), and
/// a malformed `routing.csv` is an error naming the file.
#[test]
fn the_recorded_routing_decides_the_held_out_run() {
    let hw = profile();
    let tmp = std::env::temp_dir().join(format!("lzsim-predict-routing-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    for f in [
        "run.json",
        "summary.json",
        "steps.csv",
        "timeseries.csv",
        "reconfigurations.jsonl",
    ] {
        std::fs::copy(fixtures().join("run-heldout").join(f), tmp.join(f)).unwrap();
    }
    let run = RunDir::load(&tmp).unwrap();
    assert!(run.routing.is_none());
    let p = predict::predict(&run, &hw).unwrap().predicted;
    assert_eq!((p.recoveries, p.fallbacks), (3, 0), "{p:?}");
    std::fs::write(
        tmp.join("routing.csv"),
        "record,step,layer,e0,e1,e2,e3\n0,0,0,1,2\n",
    )
    .unwrap();
    let e = RunDir::load(&tmp).unwrap_err().to_string();
    assert!(e.contains("routing.csv") && e.contains("line 2"), "{e}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A `--global-batch` run is predicted at the members' share: B samples per step whatever the
/// membership, and a step of 3 members (2 micro-batch rounds) above one of 4 (1 round).
#[test]
fn a_global_batch_run_is_predicted_at_the_members_share() {
    let run = RunDir::load(&fixtures().join("run-global-batch")).unwrap();
    let b = run.config.global_batch().unwrap().expect("a global batch");
    assert_eq!((b.sequences, b.micro), (16, 4));
    assert!(
        run.steps.iter().all(|r| r.samples == 16),
        "steps.csv samples = B"
    );
    let model = run.model_profile().unwrap();
    assert_eq!(model.sequences_per_rank(4), 4);
    assert_eq!(model.sequences_per_rank(3), 8);
    let p = predict::predict(&run, &profile()).unwrap();
    assert_eq!(p.predicted.samples, 16 * 12);
    assert_eq!(p.measured.samples, 16 * 12);
}

/// End to end: `lzrun local --global-batch 16 --micro-batch 4` on 4 nodes with a kill after
/// step 5, then `lzsim predict` on its metrics: the same steps, samples and reconfigurations
/// as measured (times are not compared: they depend on the host's load). Skipped (one
/// `skipped:` line) when `lzrun` or `lzsim` has not been built.
#[test]
fn lzrun_with_a_global_batch_then_lzsim_predict() {
    let Some(lzrun) = binary("lzrun") else {
        return;
    };
    let Some(lzsim) = lzsim_command() else {
        return;
    };
    let tmp = std::env::temp_dir().join(format!("lzsim-predict-gb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let dir = tmp.join("run");
    let out = Command::new(&lzrun)
        .args([
            "local",
            "--nodes",
            "4",
            "--global-batch",
            "16",
            "--micro-batch",
            "4",
            "--steps",
            "12",
            "--kill",
            "1@5",
            "--format",
            "json",
            "--metrics-out",
        ])
        .arg(&dir)
        .output()
        .expect("lzrun runs");
    assert!(
        out.status.success(),
        "lzrun local: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = RunDir::load(&dir).unwrap();
    assert_eq!(run.config.global_batch, Some(16));
    assert_eq!(run.config.micro_batch, Some(4));
    let hw = profile_path();
    let p = lzsim(&[
        "predict",
        dir.to_str().unwrap(),
        "--hardware",
        hw.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let v: serde_json::Value = serde_json::from_slice(&p.stdout).unwrap();
    for key in [
        "steps",
        "samples",
        "recoveries",
        "fallbacks",
        "joins",
        "rebalances",
    ] {
        assert_eq!(v["predicted"][key], v["measured"][key], "{key}: {v}");
    }
    assert_eq!(v["measured"]["steps"], 12);
    assert_eq!(v["measured"]["samples"], 16 * 12);
    assert_eq!(v["measured"]["recoveries"], 1);
    std::fs::remove_dir_all(&tmp).unwrap();
}
