//! One LAER re-layout decision at 1,024 devices × 256 experts (the instance of
//! `benches/scale.rs` `scale/laer_*`), timed for the current implementation and, alternating
//! with it in the same process, the previous sparse version (`prev`) or the reference one
//! (`ref`), with process CPU time per run. With `prev` it also checks that both decide the same.
//!
//! Run: `cargo run --release -p lazarus-planner --example laer_decision -- [REPEATS [prev|ref]]`.
//! With `score` instead of `prev|ref` it times scoring one layout on the same instance, the
//! `Scorer` (what `score()` and `lzsim relayout` use) alternated with the full `Evaluator` it
//! replaces, checks that both give the same bits, and prints the ratio.
//! The shared machine's wall clock is noisy: compare the two side by side in one process.

// Test oracles kept outside the library (see `tests/oracles/`).
#[path = "../tests/oracles/laer_previous.rs"]
mod laer_previous;
#[path = "../tests/oracles/laer_reference.rs"]
mod laer_reference;

use lazarus_planner::PlacePolicy;
use lazarus_planner::relayout::laer::{LaerOutcome, LaerParams, laer};
use lazarus_planner::relayout::{Evaluator, LinkModel, Scorer, Topology, migration, score};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use std::time::Instant;

/// Process CPU seconds (user + system) from `/proc/self/stat` (Linux; 0 elsewhere).
fn cpu_s() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let Some(rest) = s.rsplit(')').next() else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the command name; 100 ticks/s.
    (tick(11) + tick(12)) / 100.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let repeats: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(5);
    let other = args.get(2).map(String::as_str);
    let with_ref = matches!(other, Some("ref" | "prev"));
    let prev = other == Some("prev");
    let other_name = if prev { "previous" } else { "reference" };
    let topo = Topology {
        devices: 1024,
        devices_per_node: 8,
        slots_per_device: 4,
    };
    let experts = 256;
    let link = LinkModel {
        bytes_per_token: 2.0 * 7168.0,
        intra_node_bytes_per_s: 360e9,
        inter_node_bytes_per_s: 40e9,
        compute_s_per_token: 2.0 * 3.0 * 7168.0 * 2048.0 / 494e12,
        bytes_per_expert: 44_040_192 * 14 / 2,
    };
    let slots = topo.devices * topo.slots_per_device;
    let r = vec![slots / experts; experts];
    let nodes = lazarus_planner::place(PlacePolicy::Spread, &r, 128, 32).unwrap();
    let grid: Vec<Vec<u32>> = nodes
        .grid()
        .iter()
        .flat_map(|row| row.chunks(4).map(<[u32]>::to_vec))
        .collect();
    let current = lazarus_planner::LayerPlacement::from_grid(grid, experts, Some(&r)).unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(9);
    let traffic: Vec<Vec<u64>> = (0..topo.devices)
        .map(|_| {
            (0..experts)
                .map(|e| 8192 / (e as u64 + 1) + rng.random_range(0..4))
                .collect()
        })
        .collect();
    if other == Some("score") {
        score_side_by_side(topo, link, &traffic, &current, repeats);
        return;
    }
    let params = LaerParams {
        f: 2,
        recovery_floor: 0.9,
        ..LaerParams::default()
    };
    let report = |name: &str, d: &LaerOutcome| {
        println!(
            "{name}: load ratio {:.4}, {} bytes moved, {} actions, cost {:.6} -> {:.6}",
            score(topo, link, &traffic, &d.layout).unwrap().load_ratio,
            migration(&current, &d.layout, &link).unwrap().bytes,
            d.actions.len(),
            d.cost_before,
            d.cost_after
        );
    };
    let (mut best_new, mut best_ref) = (f64::INFINITY, f64::INFINITY);
    for i in 0..repeats {
        let (c0, t0) = (cpu_s(), Instant::now());
        let d = laer(topo, link, &traffic, None, &current, &params).unwrap();
        let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_s() - c0);
        best_new = best_new.min(wall);
        println!(
            "run {i} sparse: wall {:.1} ms, cpu {:.0} ms",
            wall * 1e3,
            cpu * 1e3
        );
        if i == 0 {
            report("sparse", &d);
        }
        if with_ref {
            let (c0, t0) = (cpu_s(), Instant::now());
            let o = if prev {
                laer_previous::laer(topo, link, &traffic, None, &current, &params).unwrap()
            } else {
                laer_reference::laer(topo, link, &traffic, None, &current, &params).unwrap()
            };
            let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_s() - c0);
            best_ref = best_ref.min(wall);
            println!(
                "run {i} {other_name}: wall {:.1} ms, cpu {:.0} ms",
                wall * 1e3,
                cpu * 1e3
            );
            if i == 0 {
                report(other_name, &o);
                if prev {
                    assert_eq!(o, d, "the previous version decided differently");
                    println!("identical decision (actions, layout, costs)");
                }
            }
        }
    }
    print!("fastest sparse {:.1} ms", best_new * 1e3);
    if with_ref {
        print!(
            ", {other_name} {:.1} ms, ratio {:.1}x",
            best_ref * 1e3,
            best_ref / best_new
        );
    }
    println!();
}

/// Medians over `repeats` alternated runs of the evaluator's score (the baseline) and the
/// scorer's, each run scoring the layout 10 times.
fn score_side_by_side(
    topo: Topology,
    link: LinkModel,
    traffic: &[Vec<u64>],
    layout: &lazarus_planner::LayerPlacement,
    repeats: usize,
) {
    let mut scorer = Scorer::default();
    let want = Evaluator::new(topo, link, traffic, layout).unwrap().score();
    let got = scorer.score(topo, link, traffic, layout).unwrap();
    assert_eq!(
        format!("{want:?}"),
        format!("{got:?}"),
        "the scorer and the evaluator differ"
    );
    let (mut base, mut new) = (Vec::new(), Vec::new());
    for _ in 0..repeats.max(1) {
        let t0 = Instant::now();
        for _ in 0..10 {
            std::hint::black_box(Evaluator::new(topo, link, traffic, layout).unwrap().score());
        }
        base.push(t0.elapsed().as_secs_f64() / 10.0);
        let t0 = Instant::now();
        for _ in 0..10 {
            std::hint::black_box(scorer.score(topo, link, traffic, layout).unwrap());
        }
        new.push(t0.elapsed().as_secs_f64() / 10.0);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (b, n) = (median(&mut base), median(&mut new));
    println!(
        "score one layout, median of {} alternated runs: evaluator {:.2} ms, scorer {:.2} ms, \
         ratio {:.2}x (same score)",
        base.len(),
        b * 1e3,
        n * 1e3,
        b / n
    );
}
