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

/// The FSEP systems' failure decisions are the job machine's (`JobConfig::sharded_experts`):
/// for every single and double failure of a 6-node start, `lazarus-fsep` (f = 2) restores
/// exactly when the planner's shard placement loses every copy of a shard and otherwise
/// repairs in place, moving the copies `fsep::repair` names (each one shard of every expert);
/// `laer` (f = 1) restores on every failure.
#[test]
fn sharded_failure_decisions_are_the_machines() {
    use lazarus_planner::fsep::{RepairOutcome, min_capacity, repair};
    use lazarus_planner::job::ReconfigKind;
    use lazarus_simulator::cost;
    use lazarus_simulator::replay::systems::Ctx;
    use lazarus_simulator::replay::systems::fsep::shard_bytes;
    use lazarus_simulator::replay::systems::lazarus::{Driver, Order};
    let (hw, model) = (
        cost::hardware("rtx3090-100g").unwrap(),
        cost::model("gpt-l").unwrap(),
    );
    let ctx = Ctx {
        hw: &hw,
        model: &model,
    };
    let nodes: Vec<u32> = (0..6).collect();
    let routing = vec![vec![1; model.experts]; model.moe_layers];
    for copies in [1, 2] {
        let mut started = Driver::sharded(&ctx, Some(100), 100, 120_000, copies);
        let Some(Order::Start { layout }) = started.nodes_ready(&ctx, 0, &nodes) else {
            panic!("six nodes start the job");
        };
        started.reconfigured(&ctx, 0);
        started.steps_done(&ctx, 1_000_000_000, 0, 99, &routing);
        started.checkpoint_saved(&ctx, 1_000_000_000, 100);
        let placement = layout.fsep.as_ref().unwrap().placement.clone();
        assert_eq!(
            (placement.shards(), placement.holders(0).len()),
            (6, copies)
        );
        let (mut restores, mut in_place) = (0, 0);
        for a in 0..6u32 {
            for b in a..6u32 {
                let dead: Vec<u32> = if a == b { vec![a] } else { vec![a, b] };
                let survivors = 6 - dead.len();
                let cap = min_capacity(survivors, 6, copies.min(survivors)).max(copies);
                let want = repair(&placement, copies, &dead, cap).unwrap();
                let mut d = started.clone();
                match (
                    d.failure_detected(&ctx, 2e9 as u64, &dead, 100, &layout),
                    want,
                ) {
                    (
                        Some(Order::Restore { step, layout: l }),
                        RepairOutcome::RestoreCheckpoint { .. },
                    ) => {
                        assert_eq!(step, 100);
                        assert_eq!(l.nodes.len(), survivors);
                        restores += 1;
                    }
                    (
                        Some(Order::Reconfigure {
                            kind, migration, ..
                        }),
                        RepairOutcome::InPlace(r),
                    ) => {
                        assert_eq!(kind, ReconfigKind::InPlace);
                        assert_eq!(migration.replicas, r.transfers.len() as u64);
                        assert_eq!(migration.bytes, migration.replicas * shard_bytes(&model, 6));
                        assert_eq!(d.machine().next_step(), 100, "progress is kept");
                        in_place += 1;
                    }
                    (got, want) => panic!("f = {copies}, {dead:?}: {got:?} vs {want:?}"),
                }
            }
        }
        match copies {
            1 => assert_eq!((restores, in_place), (21, 0)),
            // Blocks {0, 1}, {2, 3}, {4, 5}: only losing a whole block loses shards.
            _ => assert_eq!((restores, in_place), (3, 18)),
        }
    }
}

/// End to end on a scripted membership: 4 nodes, one lost at 5 min, two join at 10 min. Each
/// system's counts are the machine's rules: `laer` restores the loss and takes the newcomers in place
/// (no restore, no checkpoint-and-restart any more); `lazarus-fsep` repairs the loss in place
/// and takes the newcomers in place with shard copies. Same seed, same bytes.
#[test]
fn sharded_systems_count_the_machines_decisions_on_a_scripted_membership() {
    let dir = std::env::temp_dir().join(format!("lzsim-fsep-scripted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.csv");
    std::fs::write(
        &trace,
        "0,add,a\n0,add,b\n0,add,c\n0,add,d\n300000,remove,a\n600000,add,e\n600000,add,f\n",
    )
    .unwrap();
    let args = [
        "replay",
        trace.to_str().unwrap(),
        "--model",
        "gpt-l",
        "--system",
        "laer,lazarus-fsep",
        "--end",
        "20m",
        "--format",
        "json",
    ];
    let a = ok_stdout(&args);
    assert_eq!(a, ok_stdout(&args), "same seed, same output");
    let v: Value = serde_json::from_slice(&a).unwrap();
    let count = |sys: &str, k: &str| by_system(&v, sys)[k].as_u64().unwrap();
    let laer = ["fallbacks", "recoveries", "scale_outs"].map(|k| count("laer", k));
    assert_eq!(laer, [1, 0, 1], "{}", by_system(&v, "laer"));
    let fsep = ["fallbacks", "recoveries", "scale_outs"].map(|k| count("lazarus-fsep", k));
    assert_eq!(fsep, [0, 1, 1], "{}", by_system(&v, "lazarus-fsep"));
    // The repair and the join both copied shards (f = 2 over 3 then 5 nodes).
    assert!(count("lazarus-fsep", "migrated_bytes") > 0);
    for sys in ["laer", "lazarus-fsep"] {
        let used = by_system(&v, sys)["avg_used_nodes"].as_f64().unwrap();
        assert!(used > 3.5, "{sys} used the newcomers: {used}");
    }
    std::fs::remove_dir_all(dir).ok();
}
