//! `lzsim relayout`'s LAER planner calls on its own instance, timed three ways side by side in
//! one process: the call as the replay makes it (`relayout_moves`: the decision with the long
//! window, then the migration plan), the decision alone with the long window, and the decision
//! without it (the kind of work `planner/examples/laer_decision.rs` times, on this instance).
//! Each call is one layer's decision at one sample, from the static layout (the replay's own
//! layout there depends on its earlier decisions); the three are alternated per repeat.
//!
//! Run: `cargo run --release -p lazarus-simulator --example laer_calls -- [REPEATS [SAMPLE]]
//! [-- lzsim relayout arguments]`, e.g. `-- 3 20 -- --nodes 128 --hardware h200-400g --model
//! deepseek-v3 --zipf 1.2 --steps 1000 --period 200` (sample 20 is step 200, the replay's
//! second decision). The arguments default to that command.

use anyhow::{Context, Result, bail};
use clap::Parser;
use lazarus_planner::relayout::laer::laer;
use lazarus_planner::relayout::policy::{RelayoutPolicy, relayout_moves};
use lazarus_simulator::cost;
use lazarus_simulator::relayout::{self, DecisionInput, Source};
use lazarus_simulator::relayout_cmd::{RelayoutArgs, parse_policies, settings};
use std::time::Instant;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    relayout: RelayoutArgs,
}

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
    // utime and stime are fields 14 and 15, at 11 and 12 after the command name; 100 ticks/s.
    (tick(11) + tick(12)) / 100.0
}

/// Wall and CPU milliseconds per call of `f` over every input.
fn per_call(inputs: &[DecisionInput], mut f: impl FnMut(&DecisionInput)) -> (f64, f64) {
    let (c0, t0) = (cpu_s(), Instant::now());
    for x in inputs {
        f(x);
    }
    let n = inputs.len().max(1) as f64;
    (
        1e3 * t0.elapsed().as_secs_f64() / n,
        1e3 * (cpu_s() - c0) / n,
    )
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let own = &args[1..split];
    let repeats: usize = own
        .first()
        .map_or(Ok(3), |s| s.parse())
        .context("REPEATS")?;
    let sample: usize = own.get(1).map_or(Ok(20), |s| s.parse()).context("SAMPLE")?;
    let default =
        "--nodes 128 --hardware h200-400g --model deepseek-v3 --zipf 1.2 --steps 1000 --period 200";
    let rest: Vec<String> = if split < args.len() {
        args[split + 1..].to_vec()
    } else {
        default.split(' ').map(String::from).collect()
    };
    let a = Cli::parse_from(std::iter::once("laer_calls".to_string()).chain(rest)).relayout;
    let a = RelayoutArgs {
        policy: "laer".into(),
        ..a
    };
    let Some(policy) = parse_policies(&a)?.pop() else {
        bail!("no laer policy");
    };
    let RelayoutPolicy::Laer(params) = policy else {
        bail!("not the laer policy");
    };
    let (hw, model) = (cost::hardware(&a.hardware)?, cost::model(&a.model)?);
    let source = Source::Zipf {
        exponent: a.zipf,
        drift_every_steps: a.drift_every.max(1),
        seed: a.seed,
        steps: a.steps,
    };
    let s = relayout::setup(&hw, &model, a.nodes, a.slots, a.f, source)?;
    let inputs = relayout::decision_inputs(&s, &settings(&a), sample)?;
    let topo = inputs[0].topo;
    println!(
        "{} calls (one per layer at sample {sample}): {} devices x {} slots, {} experts, \
         long window {} samples",
        inputs.len(),
        topo.devices,
        topo.slots_per_device,
        inputs[0].current.experts(),
        settings(&a).long_window_samples
    );
    let mut best = [f64::INFINITY; 3];
    for r in 0..repeats.max(1) {
        let call = per_call(&inputs, |x| {
            let long = Some(x.long.as_slice());
            relayout_moves(&policy, x.topo, x.link, &x.traffic, long, &x.current, a.f)
                .expect("a valid instance");
        });
        let with_long = per_call(&inputs, |x| {
            let long = Some(x.long.as_slice());
            laer(x.topo, x.link, &x.traffic, long, &x.current, &params).expect("a valid instance");
        });
        let alone = per_call(&inputs, |x| {
            laer(x.topo, x.link, &x.traffic, None, &x.current, &params).expect("a valid instance");
        });
        for (b, x) in best.iter_mut().zip([call, with_long, alone]) {
            *b = b.min(x.0);
        }
        println!(
            "run {r}: ms per call (wall / cpu): lzsim's call {:.1} / {:.1}, decision with long \
             window {:.1} / {:.1}, decision alone {:.1} / {:.1}",
            call.0, call.1, with_long.0, with_long.1, alone.0, alone.1
        );
    }
    println!(
        "fastest: lzsim's call {:.1} ms, decision with long window {:.1} ms, decision alone \
         {:.1} ms; call / decision alone {:.2}x",
        best[0],
        best[1],
        best[2],
        best[0] / best[2]
    );
    Ok(())
}
