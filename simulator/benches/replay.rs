//! Simulator benchmarks (criterion). Run: `cargo bench -p lazarus-simulator`.
//!
//! * `replay/p3_full_gpt_l_3_systems`: the whole 11.4-hour Bamboo P3 trace (32 nodes), GPT-L on
//!   rtx3090-100g, lazarus + ds-ft + ds, one after the other on one core. Reads the trace from
//!   the shared-traces directory (`$LAZARUS_TRACES`, else `../shared/traces`) and is skipped,
//!   with one line, when it is absent.
//! * `sweep/hazard_0.3_100_seeds`: 100 stochastic 4-hour traces × 3 systems through the same
//!   code path as `lzsim sweep` (rayon over the machine's cores); the 10,000-seed goal (< 60 s
//!   on 2 cores) scales linearly from it.
//! * `ep_step_cost/same_131072` and `ep_step_cost/each_131072`: the padded step cost of
//!   standard EP (DeepSeek-V3) on 16,384 nodes × 8 GPUs, what `ds-ft` pays at every failure of
//!   the 131,072-GPU replay: its one table for all layers (`LayerRows::Same`, evaluated per
//!   kind of EP group) against the same rows repeated per layer (`LayerRows::Each`, the
//!   per-rank path every layout took before); equal results are asserted, and the ratio of
//!   the medians of 5 timed runs each, alternated, is printed.

use clap::Parser;
use criterion::{Criterion, criterion_group, criterion_main};
use lazarus_simulator::cost::{self, Dispatch, LayerRows, SparseStepInput};
use lazarus_simulator::replay;
use lazarus_simulator::replay::systems::{NodeId, ep};
use lazarus_simulator::replay_cmd::{ReplayArgs, resolve};
use lazarus_simulator::sweep_cmd::{SweepArgs, sweep};
use std::time::Instant;

#[derive(Parser)]
struct ReplayCli {
    #[command(flatten)]
    args: ReplayArgs,
}

#[derive(Parser)]
struct SweepCli {
    #[command(flatten)]
    args: SweepArgs,
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("replay");
    g.sample_size(10);
    if let Some(p3) = lazarus_traces::shared::or_skip("bamboo/traces/p3-trace.csv") {
        let p3 = p3.display().to_string();
        let cli = ReplayCli::parse_from(["bench", &p3, "--model", "gpt-l"]);
        let r = resolve(&cli.args).expect("resolve");
        g.bench_function("p3_full_gpt_l_3_systems", |b| {
            b.iter(|| {
                for &sys in &r.systems {
                    replay::run(&r.configs[&sys], sys, &r.trace, &r.workload, false, None)
                        .expect("the P3 trace replays within the event budget");
                }
            })
        });
    }
    g.finish();
    let mut g = c.benchmark_group("sweep");
    g.sample_size(10);
    let cli = SweepCli::parse_from([
        "bench",
        "--hazard",
        "0.3",
        "--seeds",
        "100",
        "--duration",
        "4h",
    ]);
    g.bench_function("hazard_0.3_100_seeds", |b| {
        b.iter(|| sweep(&cli.args, false).expect("sweep"))
    });
    g.finish();
}

fn ep_step_cost(c: &mut Criterion) {
    let hw = cost::hardware("h200-400g").expect("built-in");
    let model = cost::model("deepseek-v3").expect("built-in");
    let nodes: Vec<NodeId> = (0..16_384).collect();
    let layout = ep::layout(&hw, &model, nodes, Dispatch::Padded);
    let loads =
        lazarus_traces::zipf::ZipfLoads::new(1.2, model.experts, model.moe_layers, 7).loads(0);
    let same = layout.replicas.rows().expect("standard EP rows");
    let each = layout.replicas.ranked(hw.gpus_per_node);
    let input = |replicas| SparseStepInput {
        gpus: layout.gpus(&hw),
        replicas,
        loads: &loads,
        dispatch: Dispatch::Padded,
        ep_groups: layout.ep_groups.as_deref(),
        equal_nodes: None,
    };
    let run = |rows| cost::step_cost_sparse(&hw, &model, &input(rows)).expect("a valid layout");
    assert_eq!(run(same), run(LayerRows::Each(&each)));
    let mut g = c.benchmark_group("ep_step_cost");
    g.sample_size(10);
    g.bench_function("same_131072", |b| b.iter(|| run(same)));
    g.bench_function("each_131072", |b| b.iter(|| run(LayerRows::Each(&each))));
    g.finish();
    let (mut fast, mut slow) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        run(same);
        fast.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        run(LayerRows::Each(&each));
        slow.push(t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (f, s) = (median(&mut fast), median(&mut slow));
    println!(
        "ep_step_cost 131,072 ranks: same {:.2} ms, each {:.1} ms, ratio {:.0}x (medians of 5, alternated)",
        f * 1e3,
        s * 1e3,
        s / f
    );
}

criterion_group!(benches, bench, ep_step_cost);
criterion_main!(benches);
