//! One whole training step on the CPU (forward, backward, gradient clipping, AdamW on the dense
//! part and every expert), in tokens/s: the executor's single-worker [`Trainer`] on the
//! embedded corpus. Two shapes: `tiny` ([`MoeConfig::tiny`]) and `gpt_s_2l`, GPT-S's layer and
//! vocabulary shapes (d 768, 12 heads, d_ff 3072, 8 experts, top-1, vocab 50,257) with 2 of its
//! 12 layers and 2 × 128 tokens, so that weights, moments and gradients fit a shared machine.
//!
//! Two trainers of the same seed run side by side in one process, steps alternating: one with
//! the fused CPU kernels off (candle's own ops, `set_fused_kernels(false)`), the baseline, and
//! one with them on (GELU/SwiGLU, AdamW, cross-entropy). Their losses must agree bit for bit at every step (checked), and the bench
//! prints one JSON line per shape with both medians and `fused_speedup` = unfused / fused.
//! `results/executor/train_step_torch.py` is the PyTorch twin of the same step, and
//! `results/executor/regenerate-step.sh` runs both, interleaved.
//!
//! `cargo bench -p lazarus-executor --bench train_step` (RAYON_NUM_THREADS pins the threads;
//! `STEP_BENCH_STEPS`, default 8, timed steps per trainer after 2 warm-up steps;
//! `STEP_BENCH_SHAPES=tiny,gpt_s_2l` picks the shapes, default `tiny` only).
//!
//! `gpt_s_2l` is opt-in because of its memory: weights, AdamW moments and gradients of its
//! 119 M parameters are 1.9 GB per trainer, and the process peaks at about 5 GB resident
//! with both trainers (`peak_rss_mb`, the process's `VmHWM` so far, so it covers every shape
//! run before; `executor/examples/step_memory.rs` splits one trainer's memory by phase). Run
//! it under a cap, e.g. `prlimit --as=7000000000`. (It used to grow by ~2.4 GB per step and
//! was killed at 23 GB: the AdamW moments kept every step's autograd graph alive.)
//!
//! Like `lzrun`, the bench first sets glibc's allocator to keep large freed blocks
//! ([`lazarus_executor::malloc::tune`]); `LAZARUS_MALLOC_TUNING=0` runs it with glibc's
//! defaults, and the JSON line's `malloc` says which.

use candle_core::Result;
use lazarus_executor::model::{MoeConfig, Trainer, set_fused_kernels};
use std::time::Instant;

fn shapes() -> Vec<(&'static str, MoeConfig)> {
    let gpt_s_2l = MoeConfig {
        n_layers: 2,
        seq_len: 128,
        batch: 2,
        ..MoeConfig::gpt_s()
    };
    vec![("tiny", MoeConfig::tiny()), ("gpt_s_2l", gpt_s_2l)]
}

fn median_of(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    if n % 2 == 1 {
        times[n / 2]
    } else {
        0.5 * (times[n / 2 - 1] + times[n / 2])
    }
}

/// The process's peak resident memory so far (`VmHWM`, Linux), in MB.
fn peak_rss_mb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? / 1024)
}

fn timed(trainer: &mut Trainer, fused: bool) -> Result<(f64, f32)> {
    set_fused_kernels(fused);
    let t0 = Instant::now();
    let report = trainer.step()?;
    Ok((t0.elapsed().as_secs_f64(), report.loss))
}

fn main() -> Result<()> {
    let malloc = lazarus_executor::malloc::tune();
    let steps: usize = std::env::var("STEP_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8)
        .max(1);
    let only: Vec<String> = std::env::var("STEP_BENCH_SHAPES")
        .unwrap_or_else(|_| "tiny".into())
        .split(',')
        .map(|x| x.trim().to_owned())
        .collect();
    let threads = candle_core::utils::get_num_threads();
    for (name, cfg) in shapes() {
        if !only.iter().any(|x| x == name) {
            continue;
        }
        let mut base = Trainer::new(&cfg)?;
        let mut fused = Trainer::new(&cfg)?;
        let (mut base_times, mut times, mut losses) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..steps + 2 {
            let (tb, lb) = timed(&mut base, false)?;
            let (tf, lf) = timed(&mut fused, true)?;
            if lb.to_bits() != lf.to_bits() {
                candle_core::bail!(
                    "{name} step {i}: loss {lf} with the fused kernels, {lb} without"
                );
            }
            losses.push(lf);
            if i >= 2 {
                base_times.push(tb);
                times.push(tf);
            }
        }
        let tokens = cfg.batch * cfg.seq_len;
        let (median, base_median) = (median_of(&mut times), median_of(&mut base_times));
        let line = serde_json::json!({
            "framework": "candle",
            "bench": "train_step",
            "config": name,
            "vocab": cfg.vocab,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "d_ff": cfg.d_ff,
            "experts": cfg.experts,
            "top_k": cfg.top_k,
            "tokens": tokens,
            "threads": threads,
            "runs": times.len(),
            "median_s": median,
            "min_s": times[0],
            "tokens_per_s": tokens as f64 / median,
            "unfused_median_s": base_median,
            "fused_speedup": base_median / median,
            "first_loss": losses[0],
            "last_loss": losses[losses.len() - 1],
        });
        let mut line = line;
        line["peak_rss_mb"] = peak_rss_mb().map_or(serde_json::Value::Null, Into::into);
        line["malloc"] = malloc.as_str().into();
        println!("{line}");
    }
    Ok(())
}
