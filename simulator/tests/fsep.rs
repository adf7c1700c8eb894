//! End-to-end tests of the FSEP systems (`laer`, `lazarus-fsep`) in `lzsim replay` and of
//! `lzsim recovery --fsep-shards`.

use serde_json::Value;
use std::process::{Command, Output};

fn lzsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lzsim"))
        .args(args)
        .output()
        .expect("run lzsim")
}

fn ok_stdout(args: &[&str]) -> Vec<u8> {
    let out = lzsim(args);
    assert!(
        out.status.success(),
        "lzsim {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn by_system<'a>(v: &'a Value, sys: &str) -> &'a Value {
    v.as_array()
        .unwrap()
        .iter()
        .find(|x| x["system"] == sys)
        .unwrap_or_else(|| panic!("no {sys} in {v}"))
}

const FIVE: &[&str] = &["--system", "lazarus,laer,lazarus-fsep,ds-ft,ds"];

/// The embedded scenario (one node lost every 5 minutes): `laer` restores the checkpoint on
/// every loss, `lazarus-fsep` (f = 2) repairs every one in place; same seed, same bytes.
#[test]
fn five_systems_on_the_default_scenario() {
    let mut args = vec!["replay", "--format", "json"];
    args.extend_from_slice(FIVE);
    let a = ok_stdout(&args);
    assert_eq!(a, ok_stdout(&args), "same seed, same output");
    let v: Value = serde_json::from_slice(&a).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 5);
    let laer = by_system(&v, "laer");
    let fsep = by_system(&v, "lazarus-fsep");
    let preempted = laer["preemptions"].as_u64().unwrap();
    assert!(preempted > 0);
    assert_eq!(laer["recoveries"], 0);
    assert!(laer["fallbacks"].as_u64().unwrap() > 0);
    assert_eq!(fsep["fallbacks"], 0, "{fsep}");
    assert!(fsep["recoveries"].as_u64().unwrap() > 0);
    assert!(fsep["migrated_bytes"].as_u64().unwrap() > 0);
    // In-place repair keeps progress that laer's restores lose.
    assert!(fsep["samples"].as_u64().unwrap() > laer["samples"].as_u64().unwrap());
}

/// The P3 spot trace (Bamboo), 80 minutes on at most 10 nodes, when the shared traces exist.
#[test]
fn five_systems_on_the_p3_spot_trace() {
    let Some(p3) = lazarus_traces::shared::or_skip("bamboo/traces/p3-trace.csv") else {
        return;
    };
    let p3 = p3.display().to_string();
    let mut args = vec![
        "replay",
        &p3,
        "--window",
        "0m..80m",
        "--max-nodes",
        "10",
        "--format",
        "json",
    ];
    args.extend_from_slice(FIVE);
    let v: Value = serde_json::from_slice(&ok_stdout(&args)).unwrap();
    for sys in ["lazarus", "laer", "lazarus-fsep", "ds-ft", "ds"] {
        assert!(by_system(&v, sys)["samples"].as_u64().unwrap() > 0, "{sys}");
    }
    let fsep = by_system(&v, "lazarus-fsep");
    assert!(fsep["recoveries"].as_u64().unwrap() > 0);
}

#[test]
fn recovery_reports_sharded_plans_next_to_mro() {
    let out = ok_stdout(&[
        "recovery",
        "--place",
        "mro",
        "--fsep-shards",
        "10",
        "--failed",
        "0..3",
        "--format",
        "json",
    ]);
    let v: Value = serde_json::from_slice(&out).unwrap();
    let rows = v.as_array().unwrap();
    let p = |place: &str, k: u64| {
        rows.iter()
            .find(|r| r["place"] == place && r["failed"] == k)
            .unwrap_or_else(|| panic!("no {place} k={k}"))["probability"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(p("fsep-f2", 1), 1.0);
    assert!((p("fsep-f2", 2) - 40.0 / 45.0).abs() < 1e-6);
    assert_eq!(p("laer", 1), 0.0);
    assert_eq!(p("mro", 1), 1.0);
    // Bad input: shards with racks is a usage error.
    let bad = lzsim(&["recovery", "--fsep-shards", "4", "--racks", "2"]);
    assert_eq!(bad.status.code(), Some(2));
}
