//! Cost of the per-step state fingerprints (issue 33, item 2) against the training step they
//! follow, in one process: the ratio `fingerprint time / step time` is what `--verify-every 1`
//! (the default) adds to every step.
//!
//! One worker holds the whole model here (every expert local: the most state a worker can
//! hold), trained by [`Trainer`] (forward, backward, AdamW on the dense part and every
//! expert). The fingerprint is what a worker computes after each step: its dense optimizer
//! state exported (values, both moments, step) and every replica exported, each folded by
//! [`fingerprint`]. Medians of timed runs after a warm-up.
//!
//! `cargo bench -p lazarus-executor --bench fingerprint` (`results/executor/fingerprints.md`).
//! The fingerprint is one pass over the state (3 words per parameter); the step is at least
//! `6 · parameters · tokens` flops, so the ratio falls as the tokens per step grow.

use std::hint::black_box;
use std::time::Instant;

use lazarus_executor::model::{MoeConfig, Trainer, fingerprint};

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// What a worker computes after each step (`worker::state::fingerprints`): in place.
fn state_fingerprint(t: &Trainer) -> u64 {
    let mut acc = t.dense_optimizer().fingerprint().unwrap();
    for (l, e) in t.experts.replicas() {
        acc ^= t.experts.fingerprint(l, e).unwrap();
    }
    acc
}

/// The same through copies of the state ([`fingerprint::optim_state`] of an export), as the
/// first version did: the baseline of the in-place fold.
fn state_fingerprint_copied(t: &Trainer) -> u64 {
    let mut acc = fingerprint::optim_state(&t.dense_optimizer().export().unwrap());
    for (l, e) in t.experts.replicas() {
        acc ^= fingerprint::expert_state(&t.experts.export(l, e).unwrap());
    }
    acc
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken.
    let mut mid = MoeConfig::gpt_s();
    mid.n_layers = 2;
    mid.seq_len = 256;
    mid.batch = 1;
    println!(
        "| config | parameters (dense + experts) | tokens/step | step ms | fingerprint ms (in \
         place) | ratio to the step | fingerprint ms (copies) | ratio to the step |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, cfg, runs) in [
        ("tiny", MoeConfig::tiny(), 20),
        ("gpt-s, 2 layers, 256 tokens", mid, 3),
    ] {
        let mut t = Trainer::new(&cfg).expect("trainer");
        t.step().expect("warm-up step");
        black_box(state_fingerprint(&t));
        let mut steps = Vec::new();
        let mut prints = Vec::new();
        let mut copied = Vec::new();
        for _ in 0..runs {
            let t0 = Instant::now();
            t.step().expect("step");
            steps.push(t0.elapsed().as_secs_f64() * 1e3);
            let t0 = Instant::now();
            black_box(state_fingerprint(&t));
            prints.push(t0.elapsed().as_secs_f64() * 1e3);
            let t0 = Instant::now();
            black_box(state_fingerprint_copied(&t));
            copied.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let dense: usize = t
            .dense_optimizer()
            .export()
            .unwrap()
            .params
            .iter()
            .map(|p| p.value.len())
            .sum();
        let experts = cfg.n_layers * cfg.experts * 2 * cfg.d_model * cfg.d_ff;
        let (s, f, c) = (median(steps), median(prints), median(copied));
        println!(
            "| {name} | {dense} + {experts} | {} | {s:.1} | {f:.2} | {:.3} | {c:.2} | {:.3} |",
            cfg.batch * cfg.seq_len,
            f / s,
            c / s
        );
    }
}
