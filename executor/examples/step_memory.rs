//! Wall time and resident memory of each phase of one training step on the CPU: forward with
//! the loss, backward, gradients collected (graph freed), global gradient norm, optimizer
//! update. The phases are
//! [`Trainer::step`]'s, in its order, on one trainer; memory is the process's `VmRSS` (now),
//! `VmHWM` (peak so far) and `VmSize` (address space, what `prlimit --as` caps) from
//! `/proc/self/status` (Linux; elsewhere `-`).
//!
//! `cargo run --release -p lazarus-executor --example step_memory -- [tiny|gpt_s_2l] [steps]`
//! (default `gpt_s_2l`, 3 steps). `gpt_s_2l` is the train-step bench's GPT-S shape (vocabulary
//! 50,257, d 768, 2 layers, 8 experts, top-1, 2 × 128 tokens): weights, AdamW moments and
//! gradients of its 119 M parameters are 1.9 GB, so run it under a cap, e.g.
//! `prlimit --as=4000000000 …`. The allocator is set as in `lzrun`
//! ([`lazarus_executor::malloc::tune`]; `LAZARUS_MALLOC_TUNING=0` for glibc's defaults).

use lazarus_executor::model::{
    LocalExperts, MoeConfig, RoutingStats, Trainer, apply_update, grad_norm_parts, grad_scale,
};
use std::time::Instant;

/// `rss/hwm/vm` in MB, or `-` where `/proc/self/status` is missing.
fn memory() -> String {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return "-".into();
    };
    let mb = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or_else(|| "-".to_owned(), |kb| (kb / 1024).to_string())
    };
    format!(
        "rss {:>5} MB  peak {:>5} MB  vm {:>5} MB",
        mb("VmRSS:"),
        mb("VmHWM:"),
        mb("VmSize:")
    )
}

fn main() -> anyhow::Result<()> {
    let malloc = lazarus_executor::malloc::tune();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = match args.first().map_or("gpt_s_2l", String::as_str) {
        "tiny" => MoeConfig::tiny(),
        "gpt_s_2l" => MoeConfig {
            n_layers: 2,
            seq_len: 128,
            batch: 2,
            ..MoeConfig::gpt_s()
        },
        other => {
            eprintln!("step_memory: unknown shape {other:?} (tiny or gpt_s_2l)");
            std::process::exit(2);
        }
    };
    let steps: u64 = match args.get(1).map(|s| s.parse()) {
        None => 3,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("step_memory: steps must be a positive integer");
            std::process::exit(2);
        }
    };
    println!("start (malloc {:<11})  {}", malloc.as_str(), memory());
    let mut trainer = Trainer::new(&cfg)?;
    // The trainer's own optimizer is private; a fresh one over the same variables takes the
    // same updates.
    let mut dense_opt = trainer.model.optimizer()?;
    println!("built                      {}", memory());
    for step in 0..steps {
        let tokens = trainer.batch(step)?;
        let mut stats = RoutingStats::default();
        let mut t = Instant::now();
        let mut phase = |name: &str| {
            let ms = t.elapsed().as_secs_f64() * 1e3;
            println!("{step} {name:<13} {ms:>8.1} ms  {}", memory());
            t = Instant::now();
        };
        let loss = trainer
            .model
            .loss(&tokens, &mut LocalExperts(&trainer.experts), &mut stats)?;
        phase("forward+loss");
        let grads = loss.backward()?;
        phase("backward");
        let dense: Vec<_> = trainer
            .model
            .named_vars()
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).map(candle_core::Tensor::detach))
            .collect();
        let experts = trainer.experts.gradients(&grads)?;
        let loss = loss.to_scalar::<f32>()?;
        drop(grads);
        phase("collect");
        let factor = grad_scale(1, &grad_norm_parts(&dense, &experts)?, cfg.grad_clip_norm);
        phase("norm");
        apply_update(
            &mut dense_opt,
            &mut trainer.experts,
            &dense,
            experts,
            factor,
        )?;
        drop(dense);
        phase("update");
        println!("{step} loss {loss}");
    }
    Ok(())
}
