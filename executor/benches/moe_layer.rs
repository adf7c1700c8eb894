//! Forward + backward throughput of ONE MoE layer on the CPU (candle), in tokens/s.
//!
//! The layer is the executor's MoE feed-forward, [`moe_layer`] (what `DenseModel` runs in every
//! block), over local experts: router `x·W_r` → differentiable
//! `candle_nn::ops::softmax` → top-k on the host (ties to the lower expert id) → gates gathered
//! from the probabilities, renormalised over the chosen experts when `k ≥ 2` (raw probability
//! for `k = 1`) → per-expert `index_select` of the routed tokens → [`LocalExperts`] over an
//! [`ExpertStore`] (`gelu(x·w1)·w2`) → gate-weighted `index_add` combine, plus the Switch
//! load-balancing loss `E·Σ_e frac_e·mean_prob_e`. One iteration computes
//! `loss = mean(y²) + lb_loss_coef·lb` and `loss.backward()` (gradients w.r.t. the input, the
//! router and every expert's `w1`/`w2`); no optimizer step.
//!
//! Inputs and weights are filled from a SplitMix64 stream that
//! `results/executor/moe_layer_torch.py` reproduces bit for bit, so the PyTorch twin of this
//! layer sees the same numbers and its loss and gradient norms can be compared.
//!
//! * `cargo bench -p lazarus-executor --bench moe_layer` — criterion, one group per
//!   configuration, throughput in elements (= tokens) per second.
//! * `MOE_BENCH_JSON=1 cargo bench -p lazarus-executor --bench moe_layer` — skips criterion
//!   and prints one JSON line per configuration (warm-up, then the median of timed runs), the
//!   format `results/executor/regenerate.sh` compares with PyTorch.
//!
//! candle's CPU matmul uses `RAYON_NUM_THREADS` threads (default: physical cores); set it to
//! pin the thread count.
//!
//! JSON mode also times the layer with the fused CPU kernels turned off (candle's own ops,
//! `set_fused_kernels(false)`), runs interleaved in the same process, and prints
//! `unfused_median_s` and `fused_speedup` (unfused / fused median); the two must compute the
//! same bits, which it checks (loss, routing, gradient norms).
//!
//! `MOE_BENCH_PRECISION=bf16` runs the experts' products in bf16 with f32 masters (the model's
//! mixed precision, `Precision::Bf16`); the default is f32.
//!
//! On a GPU (a build with `--features cuda`): `MOE_BENCH_DEVICE=cuda` runs the same layer on
//! CUDA device 0 and adds the `gpt_s_layer` shape (GPT-S's 4096 tokens per step);
//! `MOE_BENCH_SHAPES=a,b` keeps only the named shapes. `kernels/check-gpu.sh` compares it with
//! the PyTorch twin on the same GPU (`MOE_DEVICE=cuda`).

use candle_core::backprop::GradStore;
use candle_core::{Device, Result, Tensor, Var};
use criterion::{Criterion, Throughput};
use lazarus_executor::model::{
    ExpertState, ExpertStore, LocalExperts, MoeConfig, Precision, moe_layer, set_fused_kernels,
};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// One benchmarked layer shape.
#[derive(Debug, Clone, Copy)]
struct Shape {
    name: &'static str,
    d_model: usize,
    d_ff: usize,
    experts: usize,
    top_k: usize,
    tokens: usize,
}

/// The GPT-S MoE layer with a whole step's tokens (seq 1024 × batch 4); GPU runs only.
const GPU_SHAPES: [Shape; 1] = [Shape {
    name: "gpt_s_layer",
    d_model: 768,
    d_ff: 3072,
    experts: 8,
    top_k: 1,
    tokens: 4096,
}];

const SHAPES: [Shape; 3] = [
    // MoeConfig::tiny(): batch 8 × seq 32.
    Shape {
        name: "tiny",
        d_model: 64,
        d_ff: 128,
        experts: 4,
        top_k: 2,
        tokens: 256,
    },
    Shape {
        name: "medium",
        d_model: 256,
        d_ff: 1024,
        experts: 8,
        top_k: 2,
        tokens: 1024,
    },
    // GPT-S expert shape (d 768, d_ff 3072, 8 experts, top-1) with fewer tokens.
    Shape {
        name: "gpt_s_expert",
        d_model: 768,
        d_ff: 3072,
        experts: 8,
        top_k: 1,
        tokens: 512,
    },
];

/// Seeds of the SplitMix64 streams (shared with the PyTorch script).
const SALT_X: u64 = 1;
const SALT_ROUTER: u64 = 2;
const fn salt_w1(e: usize) -> u64 {
    100 + 2 * e as u64
}
const fn salt_w2(e: usize) -> u64 {
    101 + 2 * e as u64
}

/// `n` values uniform in `[-std·√3, std·√3)` (standard deviation `std`), element `i` from
/// SplitMix64 of `(salt << 32) + i`, with 24 random bits so the f32 is exact.
fn det_uniform(salt: u64, n: usize, std: f64) -> Vec<f32> {
    let half_width = std * 3f64.sqrt();
    (0..n as u64)
        .map(|i| {
            let mut z = (salt << 32).wrapping_add(i);
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 40) as f64 / (1u64 << 24) as f64;
            ((2.0 * u - 1.0) * half_width) as f32
        })
        .collect()
}

/// The layer's parameters and one input batch.
struct Layer {
    shape: Shape,
    lb_loss_coef: f64,
    /// `[tokens, d_model]`, a `Var` so the backward also produces the input gradient (the layer
    /// sits inside a network).
    x: Var,
    /// `[d_model, experts]`, no bias.
    router: Var,
    store: ExpertStore,
}

/// Scalars of one forward + backward, for comparing with the PyTorch twin.
struct Check {
    loss: f32,
    lb: f32,
    counts: Vec<u64>,
    grad_norm_x: f32,
    grad_norm_router: f32,
    grad_norm_experts: f32,
}

impl Layer {
    fn new(shape: Shape, device: &Device, precision: Precision) -> Result<Self> {
        let device = device.clone();
        let (d, f, e) = (shape.d_model, shape.d_ff, shape.experts);
        let cfg = MoeConfig {
            d_model: d,
            d_ff: f,
            experts: e,
            top_k: shape.top_k,
            n_layers: 1,
            n_heads: 1,
            seq_len: shape.tokens,
            batch: 1,
            precision,
            ..MoeConfig::tiny()
        };
        cfg.validate().map_err(candle_core::Error::wrap)?;
        // Same scales as the model's init: N(0, 0.02) and 0.02/√(2·layers) for w2.
        let std_out = 0.02 / (2.0 * cfg.n_layers as f64).sqrt();
        let mut store = ExpertStore::empty(&cfg, &device);
        for ex in 0..e {
            store.import(&ExpertState {
                layer: 0,
                expert: ex,
                d_model: d,
                d_ff: f,
                w1: det_uniform(salt_w1(ex), d * f, 0.02),
                w2: det_uniform(salt_w2(ex), f * d, std_out),
                m1: vec![0.0; d * f],
                v1: vec![0.0; d * f],
                m2: vec![0.0; d * f],
                v2: vec![0.0; d * f],
                step: 0,
            })?;
        }
        let x = Tensor::from_vec(
            det_uniform(SALT_X, shape.tokens * d, 1.0),
            (shape.tokens, d),
            &device,
        )?;
        let router = Tensor::from_vec(det_uniform(SALT_ROUTER, d * e, 0.02), (d, e), &device)?;
        Ok(Self {
            shape,
            lb_loss_coef: cfg.lb_loss_coef,
            x: Var::from_tensor(&x)?,
            router: Var::from_tensor(&router)?,
            store,
        })
    }

    /// The executor's MoE layer ([`moe_layer`]) on `h [n, d]`: the gate-weighted expert mix
    /// `[n, d]`, the unweighted load-balancing loss, and the tokens routed per expert.
    fn moe(&self, h: &Tensor) -> Result<(Tensor, Tensor, Vec<u64>)> {
        let m = moe_layer(
            0,
            h,
            self.router.as_tensor(),
            self.shape.top_k,
            None,
            &mut LocalExperts(&self.store),
        )?;
        Ok((m.out, m.lb_loss, m.counts))
    }

    /// One forward + backward: `loss = mean(y²) + lb_loss_coef·lb`, `loss.backward()`.
    fn step(&self) -> Result<(f32, Tensor, Vec<u64>, GradStore)> {
        let (y, lb, counts) = self.moe(self.x.as_tensor())?;
        let loss = (y.sqr()?.mean_all()? + (lb.clone() * self.lb_loss_coef)?)?;
        let grads = loss.backward()?;
        Ok((loss.to_scalar::<f32>()?, lb, counts, grads))
    }

    fn check(&self) -> Result<Check> {
        let (loss, lb, counts, grads) = self.step()?;
        let norm2 = |t: &Tensor| -> Result<f64> {
            match grads.get(t) {
                Some(g) => Ok(f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?)),
                None => Ok(0.0),
            }
        };
        let mut experts = 0.0;
        for (l, e) in self.store.replicas() {
            if let Some((w1, w2)) = self.store.vars(l, e) {
                experts += norm2(w1.as_tensor())? + norm2(w2.as_tensor())?;
            }
        }
        Ok(Check {
            loss,
            lb: lb.to_scalar::<f32>()?,
            counts,
            grad_norm_x: norm2(self.x.as_tensor())?.sqrt() as f32,
            grad_norm_router: norm2(self.router.as_tensor())?.sqrt() as f32,
            grad_norm_experts: experts.sqrt() as f32,
        })
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// JSON mode: per shape, `MOE_BENCH_WARMUP` (3) untimed runs, then timed runs until
/// `MOE_BENCH_RUNS` (30) runs or `MOE_BENCH_SECONDS` (4) seconds, at least 5; prints the median.
fn json_mode() -> Result<()> {
    let (device, shapes) = bench_device()?;
    let precision = bench_precision()?;
    let warmup = env_usize("MOE_BENCH_WARMUP", 3);
    let max_runs = env_usize("MOE_BENCH_RUNS", 30).max(1);
    let budget = Duration::from_secs_f64(env_usize("MOE_BENCH_SECONDS", 4) as f64);
    let threads = candle_core::utils::get_num_threads();
    for shape in shapes {
        let layer = Layer::new(shape, &device, precision)?;
        set_fused_kernels(false);
        let unfused = layer.check()?;
        set_fused_kernels(true);
        let check = layer.check()?;
        if (
            check.loss,
            check.lb,
            &check.counts,
            check.grad_norm_x,
            check.grad_norm_router,
        ) != (
            unfused.loss,
            unfused.lb,
            &unfused.counts,
            unfused.grad_norm_x,
            unfused.grad_norm_router,
        ) || check.grad_norm_experts.to_bits() != unfused.grad_norm_experts.to_bits()
        {
            candle_core::bail!(
                "{}: the fused kernels changed the layer's results",
                shape.name
            );
        }
        for _ in 0..warmup {
            black_box(layer.step()?);
        }
        // Fused and unfused runs alternate so both see the same background load.
        let mut times = Vec::with_capacity(max_runs);
        let mut base_times = Vec::with_capacity(max_runs);
        let start = Instant::now();
        while times.len() < max_runs && (times.len() < 5 || start.elapsed() < budget) {
            set_fused_kernels(false);
            let t0 = Instant::now();
            black_box(layer.step()?);
            base_times.push(t0.elapsed().as_secs_f64());
            set_fused_kernels(true);
            let t0 = Instant::now();
            black_box(layer.step()?);
            times.push(t0.elapsed().as_secs_f64());
        }
        let median = median_of(&mut times);
        let base_median = median_of(&mut base_times);
        let line = serde_json::json!({
            "framework": "candle",
            "device": if device.is_cuda() { "cuda" } else { "cpu" },
            "dtype": precision.to_string(),
            "config": shape.name,
            "d_model": shape.d_model,
            "d_ff": shape.d_ff,
            "experts": shape.experts,
            "top_k": shape.top_k,
            "tokens": shape.tokens,
            "threads": threads,
            "runs": times.len(),
            "median_s": median,
            "min_s": times[0],
            "tokens_per_s": shape.tokens as f64 / median,
            "unfused_median_s": base_median,
            "fused_speedup": base_median / median,
            "loss": check.loss,
            "lb": check.lb,
            "counts": check.counts,
            "grad_norm_x": check.grad_norm_x,
            "grad_norm_router": check.grad_norm_router,
            "grad_norm_experts": check.grad_norm_experts,
        });
        println!("{line}");
    }
    Ok(())
}

/// The median of `times` (sorted in place).
fn median_of(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    if n % 2 == 1 {
        times[n / 2]
    } else {
        0.5 * (times[n / 2 - 1] + times[n / 2])
    }
}

/// `MOE_BENCH_PRECISION`: f32 (default) or bf16.
fn bench_precision() -> Result<Precision> {
    match std::env::var("MOE_BENCH_PRECISION") {
        Ok(v) if v == "f32" || v == "bf16" => {
            Precision::parse(&v).map_err(candle_core::Error::wrap)
        }
        Ok(v) => candle_core::bail!("MOE_BENCH_PRECISION must be f32 or bf16 (got {v:?})"),
        Err(_) => Ok(Precision::F32),
    }
}

/// `MOE_BENCH_DEVICE` (cpu | cuda) and the shapes to run (`MOE_BENCH_SHAPES` filters).
fn bench_device() -> Result<(Device, Vec<Shape>)> {
    use lazarus_executor::device::{CommKind, DeviceChoice, DeviceKind};
    let kind = match std::env::var("MOE_BENCH_DEVICE") {
        Ok(v) => DeviceKind::parse(&v).map_err(candle_core::Error::wrap)?,
        Err(_) => DeviceKind::Cpu,
    };
    let device = DeviceChoice::resolve(kind, Some(CommKind::Tcp), 1)
        .and_then(|c| c.open())
        .map_err(candle_core::Error::wrap)?;
    let mut shapes = SHAPES.to_vec();
    if device.is_cuda() {
        shapes.extend(GPU_SHAPES);
    }
    if let Ok(only) = std::env::var("MOE_BENCH_SHAPES") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        shapes.retain(|s| only.contains(&s.name));
    }
    Ok((device, shapes))
}

fn criterion_mode() -> Result<()> {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let (device, shapes) = bench_device()?;
    let precision = bench_precision()?;
    for shape in shapes {
        let layer = Layer::new(shape, &device, precision)?;
        layer.step()?;
        let mut group = c.benchmark_group(format!("moe_layer/{}", shape.name));
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3))
            .throughput(Throughput::Elements(shape.tokens as u64));
        group.bench_function("fwd_bwd", |b| {
            b.iter(|| black_box(layer.step().expect("MoE layer forward + backward")))
        });
        group.finish();
    }
    c.final_summary();
    Ok(())
}

fn main() -> Result<()> {
    if std::env::var("MOE_BENCH_JSON").is_ok_and(|v| !v.is_empty() && v != "0") {
        json_mode()
    } else {
        criterion_mode()
    }
}
