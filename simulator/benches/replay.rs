//! Simulator benchmarks (criterion). Run: `cargo bench -p lazarus-simulator`.
//!
//! * `replay/p3_full_gpt_l_3_systems`: the whole 11.4-hour Bamboo P3 trace (32 nodes), GPT-L on
//!   rtx3090-100g, lazarus + ds-ft + ds, one after the other on one core. Reads the trace from
//!   the shared-traces directory (`$LAZARUS_TRACES`, else `../shared/traces`) and is skipped,
//!   with one line, when it is absent.
//! * `sweep/hazard_0.3_100_seeds`: 100 stochastic 4-hour traces × 3 systems through the same
//!   code path as `lzsim sweep` (rayon over the machine's cores); the 10,000-seed goal (< 60 s
//!   on 2 cores) scales linearly from it.

use clap::Parser;
use criterion::{Criterion, criterion_group, criterion_main};
use lazarus_simulator::replay;
use lazarus_simulator::replay_cmd::{ReplayArgs, resolve};
use lazarus_simulator::sweep_cmd::{SweepArgs, sweep};

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

criterion_group!(benches, bench);
criterion_main!(benches);
