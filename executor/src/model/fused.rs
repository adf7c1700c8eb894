//! Fused CPU element-wise kernels with a backward, as candle custom ops.
//!
//! candle computes `gelu` in one pass but differentiates it as a chain of twelve tensor ops
//! (cube, four affines, two adds, tanh, square, mul, …), each a full pass over the activations
//! with a fresh allocation; in one MoE layer that backward cost more than the expert matmuls.
//! [`gelu`] runs the same forward and a backward that evaluates the *same* f32 expression per
//! element in one pass, split over rayon's threads. The arithmetic is candle's own, operation by
//! operation and in the same order (`affine(m, a)` is `v·m + a` in f32, `powf` is the libm
//! call, no fused multiply-add), so the gradients are bit-identical to candle's: training does
//! not change, only its speed (checked by the tests below against candle's ops).
//!
//! Only f32 on the CPU takes the fused path; other dtypes and CUDA tensors use candle's ops.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether [`gelu`] takes the fused path ([`set_fused_kernels`]).
static FUSED: AtomicBool = AtomicBool::new(true);

/// Turns the fused kernels off (candle's own ops) or on (the default), process-wide: the
/// baseline of the benchmarks that measure them in one process. The results are the same bits
/// either way.
pub fn set_fused_kernels(on: bool) {
    FUSED.store(on, Ordering::Relaxed);
}

/// Elements per rayon task: large enough that the split costs nothing measurable, small enough
/// that a layer's activations spread over every thread.
const CHUNK: usize = 1 << 14;

/// candle's tanh-approximated GELU, `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))`, with a
/// fused backward on f32 CPU tensors (bit-identical to `Tensor::gelu`, forward and backward).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if !FUSED.load(Ordering::Relaxed) || !x.device().is_cpu() || x.dtype() != DType::F32 {
        return x.gelu();
    }
    x.contiguous()?.apply_op1(Gelu)
}

/// The f32 slice of a contiguous CPU storage.
fn f32_slice<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!("{op}: f32 only, got {:?}", storage.dtype());
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: the input must be contiguous"),
    }
}

/// `out[i] = f(a[i])` over rayon chunks.
fn map1(a: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .for_each(|(o, a)| {
            for (o, &a) in o.iter_mut().zip(a) {
                *o = f(a);
            }
        });
    out
}

/// `out[i] = f(a[i], b[i])` over rayon chunks.
fn map2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = f(a, b);
            }
        });
    out
}

/// candle's f32 `gelu` (`candle_core::op::Gelu::f32`).
#[inline(always)]
fn gelu_f32(v: f32) -> f32 {
    const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
    0.5 * v * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * v * (1.0 + 0.044715 * v * v)))
}

/// candle's `affine(mul, add)` on f32: `v·mul + add` with both constants rounded to f32 (the
/// `+ add` is kept even when it is 0: it turns −0 into +0, as candle's op does).
#[inline(always)]
fn affine(v: f32, mul: f64, add: f64) -> f32 {
    v * (mul as f32) + (add as f32)
}

/// `g · gelu'(x)` exactly as candle's backward of `UnaryOp::Gelu` (candle-core 0.11,
/// `backprop.rs`) computes it, one tensor op per line:
/// `cube = x³; t = tanh(0.0356774·cube + 0.797885·x);`
/// `gelu' = (0.5·t + (0.0535161·cube + 0.398942·x)·(1 − t²)) + 0.5`.
#[inline(always)]
fn gelu_grad_f32(x: f32, g: f32) -> f32 {
    // The exponents go through `black_box`: with a constant 2.0 LLVM turns `powf` into `t·t`,
    // which is not always the libm `powf` result candle's runtime exponent gets.
    let (three, two) = (std::hint::black_box(3.0f32), std::hint::black_box(2.0f32));
    let cube = x.powf(three);
    let t = (affine(cube, 0.0356774, 0.0) + affine(x, 0.797885, 0.0)).tanh();
    let half_t = affine(t, 0.5, 0.0);
    let inner = affine(cube, 0.0535161, 0.0) + affine(x, 0.398942, 0.0);
    let one_minus_t2 = affine(t.powf(two), -1.0, 1.0);
    let d = affine(half_t + inner * one_minus_t2, 1.0, 0.5);
    g * d
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        Ok((CpuStorage::F32(map1(x, gelu_f32)), layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad_res.contiguous()?;
        Ok(Some(arg.apply_op2_no_bwd(&grad, &GeluGrad)?))
    }
}

/// `(x, g) ↦ g·gelu'(x)`, the backward of [`Gelu`].
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "fused-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            candle_core::bail!(
                "{}: shapes {:?} and {:?} differ",
                self.name(),
                l1.shape(),
                l2.shape()
            );
        }
        let x = f32_slice(s1, l1, self.name())?;
        let g = f32_slice(s2, l2, self.name())?;
        Ok((
            CpuStorage::F32(map2(x, g, gelu_grad_f32)),
            l1.shape().clone(),
        ))
    }
}

/// `silu(h[:, ..ff]) ⊙ h[:, ff..]` of `h [n, 2ff]` (SwiGLU, Shazeer 2020, "GLU Variants Improve
/// Transformer", Eq. 6 with Swish β = 1): one pass forward, one pass backward on f32 CPU
/// tensors; elsewhere (and with the fused kernels off) the same from candle's differentiable
/// ops. The forward is candle's `silu` composition op by op (`g·recip(exp(−g)·1 + 1)·u`), so
/// both paths give the same output bits; the backward evaluates
/// `∂/∂g = grad·u·σ(g)·(1 + g·(1 − σ(g)))`, `∂/∂u = grad·silu(g)` in one pass, which rounds
/// differently from candle's chain of ops (checked against it within f32 error and against
/// finite differences).
pub fn swiglu(h: &Tensor, ff: usize) -> Result<Tensor> {
    let (_, cols) = h.dims2()?;
    if cols != 2 * ff {
        candle_core::bail!("swiglu: {cols} columns, need 2·ff = {}", 2 * ff);
    }
    if !FUSED.load(Ordering::Relaxed) || !h.device().is_cpu() || h.dtype() != DType::F32 {
        let g = h.narrow(1, 0, ff)?;
        let sigmoid = (g.neg()?.exp()? + 1.0)?.recip()?;
        return (g * sigmoid)? * h.narrow(1, ff, ff)?;
    }
    h.contiguous()?.apply_op1(SwiGlu { ff })
}

/// candle's `(g.neg().exp() + 1).recip()` on f32: σ(g).
#[inline(always)]
fn sigmoid_f32(g: f32) -> f32 {
    1.0 / affine((-g).exp(), 1.0, 1.0)
}

struct SwiGlu {
    ff: usize,
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = f32_slice(storage, layout, self.name())?;
        let ff = self.ff;
        let rows = h.len() / (2 * ff);
        let mut out = vec![0f32; rows * ff];
        out.par_chunks_mut(ff)
            .zip(h.par_chunks(2 * ff))
            .for_each(|(o, h)| {
                let (g, u) = h.split_at(ff);
                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                    *o = (g * sigmoid_f32(g)) * u;
                }
            });
        Ok((CpuStorage::F32(out), Shape::from((rows, ff))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad_res.contiguous()?;
        Ok(Some(
            arg.apply_op2_no_bwd(&grad, &SwiGluGrad { ff: self.ff })?,
        ))
    }
}

/// `(h [n, 2ff], grad [n, ff]) ↦ ∂ [n, 2ff]`, the backward of [`SwiGlu`].
struct SwiGluGrad {
    ff: usize,
}

impl CustomOp2 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "fused-swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let h = f32_slice(s1, l1, self.name())?;
        let grad = f32_slice(s2, l2, self.name())?;
        let ff = self.ff;
        if h.len() != 2 * grad.len() {
            candle_core::bail!(
                "{}: {} inputs for {} gradients",
                self.name(),
                h.len(),
                grad.len()
            );
        }
        let mut out = vec![0f32; h.len()];
        out.par_chunks_mut(2 * ff)
            .zip(h.par_chunks(2 * ff).zip(grad.par_chunks(ff)))
            .for_each(|(o, (h, gr))| {
                let (dg, du) = o.split_at_mut(ff);
                let (g, u) = h.split_at(ff);
                for j in 0..ff {
                    let s = sigmoid_f32(g[j]);
                    let silu = g[j] * s;
                    du[j] = gr[j] * silu;
                    dg[j] = gr[j] * u[j] * (s * (1.0 + g[j] * (1.0 - s)));
                }
            });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// The f32 constants of one AdamW update, each rounded from f64 as candle's `affine` rounds
/// its operands.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamCoefs {
    pub beta1: f64,
    pub beta2: f64,
    pub scale_m: f64,
    pub scale_v: f64,
    pub decay: f64,
    pub eps: f64,
    pub lr: f64,
    /// The gradient is first multiplied by this, as `scale_grad` does: not at all when it is 1
    /// (`affine(g, 1, 0)` would turn −0 into +0).
    pub grad_factor: f64,
}

/// One AdamW update of a parameter in one pass: writes the new value into `theta`'s storage
/// (as `Var::set` would) and returns the new moments `(m, v)`; `None` (nothing done) when the
/// fused kernels are off or a tensor is not a contiguous f32 CPU tensor, and the caller runs
/// candle's ops instead.
///
/// candle's expression tree (`model::optim`, the same as `candle_nn::AdamW`) is one full pass
/// and one fresh tensor per op — fifteen for each parameter, seven of them alive at once, so
/// the 154 MB embedding of a GPT-2 vocabulary took ~1.1 GB of temporaries. Here each element
/// goes through the same f32 operations in the same order (every `affine` as `v·mul + add`,
/// `+ 0` kept), so the values, moments and training are bit-identical (checked below and by
/// the train-step bench at every step).
pub(crate) fn adamw_step(
    theta: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    k: AdamCoefs,
) -> Result<Option<(Tensor, Tensor)>> {
    if !FUSED.load(Ordering::Relaxed) {
        return Ok(None);
    }
    adamw_step_unchecked(theta, m, v, g, k)
}

/// [`adamw_step`] whatever [`set_fused_kernels`] says (the tests' entry: another test may turn
/// the kernels off meanwhile).
fn adamw_step_unchecked(
    theta: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    k: AdamCoefs,
) -> Result<Option<(Tensor, Tensor)>> {
    let all = [theta, m, v, g];
    if all
        .iter()
        .any(|t| !t.device().is_cpu() || t.dtype() != DType::F32 || !t.is_contiguous())
        || all.iter().any(|t| t.shape() != theta.shape())
    {
        return Ok(None);
    }
    let (m_s, m_l) = m.storage_and_layout();
    let (v_s, v_l) = v.storage_and_layout();
    let (g_s, g_l) = g.storage_and_layout();
    let (
        candle_core::Storage::Cpu(m_c),
        candle_core::Storage::Cpu(v_c),
        candle_core::Storage::Cpu(g_c),
    ) = (&*m_s, &*v_s, &*g_s)
    else {
        return Ok(None);
    };
    let op = AdamStep {
        m: f32_slice(m_c, m_l, "fused-adamw")?,
        v: f32_slice(v_c, v_l, "fused-adamw")?,
        g: f32_slice(g_c, g_l, "fused-adamw")?,
        k,
        out: std::cell::RefCell::new(None),
    };
    theta.inplace_op1(&op)?;
    let Some((nm, nv)) = op.out.into_inner() else {
        candle_core::bail!("fused-adamw: the update did not run");
    };
    Ok(Some((
        Tensor::from_vec(nm, theta.shape(), theta.device())?,
        Tensor::from_vec(nv, theta.shape(), theta.device())?,
    )))
}

/// The in-place update of `theta` ([`adamw_step`]); the new moments land in `out`.
struct AdamStep<'a> {
    m: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    k: AdamCoefs,
    out: std::cell::RefCell<Option<(Vec<f32>, Vec<f32>)>>,
}

impl candle_core::InplaceOp1 for AdamStep<'_> {
    fn name(&self) -> &'static str {
        "fused-adamw"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("{}: f32 only", self.name());
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("{}: the parameter must be contiguous", self.name());
        };
        let theta = &mut data[start..end];
        let n = theta.len();
        if [self.m.len(), self.v.len(), self.g.len()] != [n; 3] {
            candle_core::bail!("{}: lengths differ", self.name());
        }
        let k = self.k;
        let scaled = k.grad_factor != 1.0;
        let (mut nm, mut nv) = (vec![0f32; n], vec![0f32; n]);
        theta
            .par_chunks_mut(CHUNK)
            .zip(nm.par_chunks_mut(CHUNK).zip(nv.par_chunks_mut(CHUNK)))
            .enumerate()
            .for_each(|(c, (th, (nm, nv)))| {
                let r = c * CHUNK..c * CHUNK + th.len();
                let (m, v, g) = (&self.m[r.clone()], &self.v[r.clone()], &self.g[r]);
                for i in 0..th.len() {
                    // One candle tensor op per line of `scale_grad` and `AdamW::step_scaled`.
                    let g = if scaled {
                        affine(g[i], k.grad_factor, 0.0)
                    } else {
                        g[i]
                    };
                    let next_m = affine(m[i], k.beta1, 0.0) + affine(g, 1.0 - k.beta1, 0.0);
                    let next_v = affine(v[i], k.beta2, 0.0) + affine(g * g, 1.0 - k.beta2, 0.0);
                    let m_hat = affine(next_m, k.scale_m, 0.0);
                    let v_hat = affine(next_v, k.scale_v, 0.0);
                    let decayed = affine(th[i], k.decay, 0.0);
                    let adjusted = m_hat / affine(v_hat.sqrt(), 1.0, k.eps);
                    th[i] = decayed - affine(adjusted, k.lr, 0.0);
                    nm[i] = next_m;
                    nv[i] = next_v;
                }
            });
        *self.out.borrow_mut() = Some((nm, nv));
        Ok(())
    }
}

/// The mean cross-entropy of `logits [n, v]` against `targets [n]` (u32 class ids), as
/// `candle_nn::loss::cross_entropy` computes it, with one fused pass forward and one backward
/// on f32 CPU logits; elsewhere (and with the fused kernels off) candle's own function.
///
/// candle's function is a chain of logits-sized tensors: the shifted logits, their `exp`, the
/// log-softmax, and in the backward about ten more (zeroed accumulators, sums, products), each
/// a full pass and a fresh allocation — at a GPT-2 vocabulary 51 MB apiece for 256 tokens. Here
/// the forward keeps nothing but the targets and the backward writes one tensor, the logits'
/// gradient. Every value goes through the f32 operations of candle's graph in the same order
/// (the row sums through candle's own vectorised `vec_reduce_sum`, the `0 + …` of its
/// gradient accumulators kept), so loss and gradient are bit-identical to candle's (tests
/// below; the train-step bench compares the losses of both paths at every step).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if !FUSED.load(Ordering::Relaxed) || !logits.device().is_cpu() || logits.dtype() != DType::F32 {
        return candle_nn::loss::cross_entropy(logits, targets);
    }
    cross_entropy_unchecked(logits, targets)
}

/// [`cross_entropy`] whatever [`set_fused_kernels`] says (for the tests).
fn cross_entropy_unchecked(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    let targets: Vec<u32> = targets.to_vec1()?;
    if targets.len() != n {
        candle_core::bail!("cross_entropy: {} targets for {n} rows", targets.len());
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= v) {
        candle_core::bail!("cross_entropy: target {t} outside the {v} classes");
    }
    logits.contiguous()?.apply_op1(CrossEntropy { targets })
}

/// candle's f32 sum of a row (`ReduceOp::Sum` over the last dimension), vectorised in its
/// own order, which the fused op must reproduce.
fn row_sum(xs: &[f32]) -> f32 {
    use candle_core::cpu::kernels::VecOps;
    let mut sum = 0f32;
    // SAFETY: `xs` holds `xs.len()` elements and `sum` is one valid f32.
    unsafe { <f32 as VecOps>::vec_reduce_sum(xs.as_ptr(), &mut sum, xs.len()) };
    sum
}

/// One row's `max` (candle's `max_keepdim`) and `exp(x − max)` into `e`.
fn shifted_exp(row: &[f32], e: &mut [f32]) -> f32 {
    let max = row.iter().copied().fold(row[0], f32::max);
    for (e, &x) in e.iter_mut().zip(row) {
        *e = (x - max).exp();
    }
    max
}

/// The fused cross-entropy (`cross_entropy`); holds the targets for the backward.
struct CrossEntropy {
    targets: Vec<u32>,
}

impl CrossEntropy {
    /// candle's `affine(−1/n, 0)` after the sum over the batch.
    fn mean_factor(&self) -> f64 {
        -1f64 / self.targets.len() as f64
    }
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        let (n, v) = layout.shape().dims2()?;
        if n == 0 || v == 0 || n != self.targets.len() {
            candle_core::bail!("{}: logits {:?}", self.name(), layout.shape());
        }
        // Per row, `log_softmax(x)[target]` as candle's graph: `diff = x − max`,
        // `ls = ln(sum(exp(diff)))`, `diff[t] − ls`.
        let picked: Vec<f32> = x
            .par_chunks(v)
            .zip(self.targets.par_iter())
            .map_init(
                || vec![0f32; v],
                |e, (row, &t)| {
                    let max = shifted_exp(row, e);
                    (row[t as usize] - max) - row_sum(e).ln()
                },
            )
            .collect();
        let loss = affine(row_sum(&picked), self.mean_factor(), 0.0);
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g_out = grad_res.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let x = arg.contiguous()?;
        let (n, v) = x.dims2()?;
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("{}: CPU logits only", self.name());
        };
        let x = f32_slice(cpu, layout, self.name())?;
        // The nodes of candle's graph, each as its backward leaves it (`0 + …` included):
        // affine → sum_all → gather: `c` at each target; the log's input gets
        // `r / sum` with `r = 0 + (0 − c)` (the row sum of `0 − G`, one non-zero term).
        let c = 0.0 + affine(g_out, self.mean_factor(), 0.0);
        let r = 0.0 + (0.0 - c);
        let mut grad = vec![0f32; n * v];
        grad.par_chunks_mut(v)
            .zip(x.par_chunks(v))
            .zip(self.targets.par_iter())
            .for_each_init(
                || vec![0f32; v],
                |neg, ((gx, row), &t)| {
                    let max = shifted_exp(row, gx);
                    let q = 0.0 + r / row_sum(gx);
                    // d(diff) = G + q·exp(diff), G = c at the target, +0 elsewhere; the
                    // max's broadcast gets `0 − d(diff)`, summed over the row.
                    for (j, (g, o)) in gx.iter_mut().zip(neg.iter_mut()).enumerate() {
                        let big_g = if j == t as usize { c } else { 0.0 };
                        *g = big_g + q * *g;
                        *o = 0.0 - *g;
                    }
                    let g_max = 0.0 + row_sum(neg);
                    // `0 + d(diff)`, then the max's share where x equals the row max.
                    for (g, &x) in gx.iter_mut().zip(row) {
                        let mask = if x == max { 1f32 } else { 0f32 };
                        *g = (0.0 + *g) + mask * g_max;
                    }
                },
            );
        Ok(Some(Tensor::from_vec(grad, (n, v), arg.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Values that exercise every branch of the formula: zeros of both signs, tiny, large,
    /// saturated tanh, and a dense sweep.
    fn inputs(n: usize) -> Vec<f32> {
        let mut v = vec![
            0.0, -0.0, 1e-30, -1e-30, 1e-7, -3.0, 3.0, 9.5, -9.5, 40.0, -40.0,
        ];
        let mut s = 0x9e37_79b9_u32;
        while v.len() < n {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            v.push((s as f32 / u32::MAX as f32 - 0.5) * 12.0);
        }
        v
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// Loss and logits' gradient equal `candle_nn::loss::cross_entropy`'s bit for bit: rows
    /// with ties at the maximum, zeros of both signs, saturated `exp`, a target at the
    /// maximum, widths around candle's 32-wide vector sum, and an upstream gradient ≠ 1.
    #[test]
    fn cross_entropy_matches_candle_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        for (n, v) in [(1, 1), (3, 7), (5, 37), (4, 64), (6, 1000), (3, 4099)] {
            let mut x = inputs(n * v);
            x.truncate(n * v);
            x.rotate_left(n % 5);
            for r in 0..n {
                // A tie at the row's maximum in every other row, a very negative logit in all.
                if v > 2 && r % 2 == 0 {
                    let (a, b) = (r * v + 1, r * v + v - 1);
                    x[a] = 50.0;
                    x[b] = 50.0;
                }
                x[r * v] = -90.0;
            }
            let targets: Vec<u32> = (0..n).map(|r| ((r * 7 + 1) % v) as u32).collect();
            let tgt = Tensor::new(targets.as_slice(), &dev)?;
            let run = |fused: bool| -> Result<(Tensor, Tensor)> {
                let var = Var::from_vec(x.clone(), (n, v), &dev)?;
                let ce = if fused {
                    cross_entropy_unchecked(var.as_tensor(), &tgt)?
                } else {
                    candle_nn::loss::cross_entropy(var.as_tensor(), &tgt)?
                };
                let grads = ce.affine(3.0, 0.5)?.backward()?;
                Ok((ce, grads.get(var.as_tensor()).unwrap().clone()))
            };
            let (ce_ref, g_ref) = run(false)?;
            let (ce, g) = run(true)?;
            assert_eq!(bits(&ce), bits(&ce_ref), "loss, n {n} v {v}");
            assert_eq!(bits(&g), bits(&g_ref), "gradient, n {n} v {v}");
        }
        Ok(())
    }

    #[test]
    fn cross_entropy_rejects_bad_targets() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 3), DType::F32, &dev)?;
        assert!(cross_entropy_unchecked(&x, &Tensor::new(&[0u32, 3], &dev)?).is_err());
        assert!(cross_entropy_unchecked(&x, &Tensor::new(&[0u32], &dev)?).is_err());
        Ok(())
    }

    /// Forward and backward equal candle's `gelu` bit for bit, over more than one rayon chunk
    /// and with a non-trivial upstream gradient.
    #[test]
    fn gelu_matches_candle_bit_for_bit() -> Result<()> {
        let rows = 3 * CHUNK / 7 + 5;
        let n = rows * 7;
        let x = Var::from_vec(inputs(n), (rows, 7), &Device::Cpu)?;
        let w = Tensor::from_vec(inputs(n + 5)[5..].to_vec(), x.shape(), &Device::Cpu)?;
        let ours = gelu(x.as_tensor())?;
        let theirs = x.as_tensor().gelu()?;
        assert_eq!(bits(&ours), bits(&theirs));
        let g_ours = ours.mul(&w)?.sum_all()?.backward()?;
        let g_theirs = theirs.mul(&w)?.sum_all()?.backward()?;
        let (a, b) = (g_ours.get(&x).unwrap(), g_theirs.get(&x).unwrap());
        let (a, b) = (bits(a), bits(b));
        let xs = x.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        for i in 0..n {
            assert_eq!(
                a[i],
                b[i],
                "element {i}: x {} grad {} vs candle {}",
                xs[i],
                f32::from_bits(a[i]),
                f32::from_bits(b[i])
            );
        }
        Ok(())
    }

    /// The fused AdamW update equals candle's expression tree (`AdamW::step_with`'s unfused
    /// path) bit for bit over several steps and more than one rayon chunk, signed zeros
    /// included; a strided tensor is refused (the caller falls back to candle's ops).
    #[test]
    fn adamw_matches_candle_ops_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let n = 2 * CHUNK + 77;
        let mut xs = inputs(n + 3 * n);
        // Zeros of both signs in the value, the gradient and (through them) the moments.
        for i in (0..xs.len()).step_by(97) {
            xs[i] = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        let theta0 = Tensor::from_vec(xs[..n].to_vec(), n, &dev)?;
        let (ours, theirs) = (Var::from_tensor(&theta0)?, Var::from_tensor(&theta0)?);
        let (mut m_o, mut v_o) = (ours.zeros_like()?, ours.zeros_like()?);
        let (mut m_t, mut v_t) = (m_o.clone(), v_o.clone());
        let (beta1, beta2, lr, wd, eps) = (0.9, 0.999, 3e-3, 0.01, 1e-8);
        for step in 1..=3 {
            let g = Tensor::from_vec(xs[step * n..(step + 1) * n].to_vec(), n, &dev)?;
            let g = (g * 0.01)?;
            // Step 1 unscaled (keeps −0 gradients), then clipped by a factor.
            let grad_factor = if step == 1 { 1.0 } else { 0.37 };
            let k = AdamCoefs {
                beta1,
                beta2,
                scale_m: 1.0 / (1.0 - f64::powi(beta1, step as i32)),
                scale_v: 1.0 / (1.0 - f64::powi(beta2, step as i32)),
                decay: 1.0 - lr * wd,
                eps,
                lr,
                grad_factor,
            };
            let (m, v) = adamw_step_unchecked(ours.as_tensor(), &m_o, &v_o, &g, k)?
                .expect("contiguous f32 CPU tensors take the fused path");
            (m_o, v_o) = (m, v);
            let g = crate::model::scale_grad(&g, grad_factor)?;
            let next_m = ((&m_t * beta1)? + (&g * (1.0 - beta1))?)?;
            let next_v = ((&v_t * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * k.scale_m)?;
            let v_hat = (&next_v * k.scale_v)?;
            let th = (theirs.as_tensor() * k.decay)?;
            let adjusted = (m_hat / (v_hat.sqrt()? + eps)?)?;
            theirs.set(&(th - (adjusted * lr)?)?)?;
            (m_t, v_t) = (next_m, next_v);
            assert_eq!(bits(&m_o), bits(&m_t), "m, step {step}");
            assert_eq!(bits(&v_o), bits(&v_t), "v, step {step}");
            assert_eq!(
                bits(ours.as_tensor()),
                bits(theirs.as_tensor()),
                "step {step}"
            );
        }
        let strided = Tensor::from_vec(inputs(6)[..6].to_vec(), (2, 3), &dev)?.t()?;
        let k = AdamCoefs {
            beta1,
            beta2,
            scale_m: 1.0,
            scale_v: 1.0,
            decay: 1.0,
            eps,
            lr,
            grad_factor: 1.0,
        };
        let z = strided.zeros_like()?;
        assert!(adamw_step_unchecked(&strided, &z, &z, &z, k)?.is_none());
        Ok(())
    }

    /// A strided input (a transpose) goes through `contiguous` and still matches.
    #[test]
    fn gelu_of_a_strided_input() -> Result<()> {
        let x = Var::from_vec(inputs(6 * 5), (6, 5), &Device::Cpu)?;
        let xt = x.as_tensor().t()?;
        let ours = gelu(&xt)?;
        let theirs = xt.gelu()?;
        assert_eq!(bits(&ours), bits(&theirs));
        let ga = ours.sqr()?.sum_all()?.backward()?;
        let gb = theirs.sqr()?.sum_all()?.backward()?;
        assert_eq!(bits(ga.get(&x).unwrap()), bits(gb.get(&x).unwrap()));
        Ok(())
    }

    /// The gradient against central finite differences in f64 of the exact GELU (guards the
    /// formula itself, not only its agreement with candle).
    #[test]
    fn gelu_gradient_against_finite_differences() -> Result<()> {
        let xs: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.1).collect();
        let x = Var::from_vec(xs.clone(), xs.len(), &Device::Cpu)?;
        let g = gelu(x.as_tensor())?.sum_all()?.backward()?;
        let g = g.get(&x).unwrap().to_vec1::<f32>()?;
        let f = |v: f64| {
            0.5 * v
                * (1.0
                    + (((2.0 / std::f64::consts::PI).sqrt()) * (v + 0.044715 * v.powi(3))).tanh())
        };
        for (&v, &gv) in xs.iter().zip(&g) {
            let h = 1e-4;
            let v = v as f64;
            let fd = (f(v + h) - f(v - h)) / (2.0 * h);
            assert!((gv as f64 - fd).abs() < 1e-4, "x {v}: {gv} vs {fd}");
        }
        Ok(())
    }

    /// SwiGLU: forward bit-identical to candle's ops, backward within f32 rounding of them, and
    /// against central finite differences in f64.
    #[test]
    fn swiglu_matches_candle_and_finite_differences() -> Result<()> {
        let (rows, ff) = (CHUNK / 64 + 3, 40);
        let xs: Vec<f32> = inputs(rows * 2 * ff).iter().map(|v| v * 0.5).collect();
        let h = Var::from_vec(xs.clone(), (rows, 2 * ff), &Device::Cpu)?;
        let w = Tensor::from_vec(
            inputs(rows * ff + 3)[3..].to_vec(),
            (rows, ff),
            &Device::Cpu,
        )?;
        set_fused_kernels(false);
        let theirs = swiglu(h.as_tensor(), ff)?;
        let g_theirs = theirs.mul(&w)?.sum_all()?.backward()?;
        set_fused_kernels(true);
        let ours = swiglu(h.as_tensor(), ff)?;
        assert_eq!(bits(&ours), bits(&theirs));
        let g_ours = ours.mul(&w)?.sum_all()?.backward()?;
        let a = g_ours.get(&h).unwrap().flatten_all()?.to_vec1::<f32>()?;
        let b = g_theirs.get(&h).unwrap().flatten_all()?.to_vec1::<f32>()?;
        let wv = w.flatten_all()?.to_vec1::<f32>()?;
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        for (i, (&a, &b)) in a.iter().zip(&b).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "element {i}: {a} vs candle {b}"
            );
            let (r, c) = (i / (2 * ff), i % (2 * ff));
            let (j, gate) = if c < ff { (c, true) } else { (c - ff, false) };
            let g = xs[r * 2 * ff + j] as f64;
            let u = xs[r * 2 * ff + ff + j] as f64;
            let f = |g: f64, u: f64| g * sig(g) * u * wv[r * ff + j] as f64;
            let e = 1e-4;
            let fd = if gate {
                (f(g + e, u) - f(g - e, u)) / (2.0 * e)
            } else {
                (f(g, u + e) - f(g, u - e)) / (2.0 * e)
            };
            assert!(
                (a as f64 - fd).abs() < 1e-3 * (1.0 + fd.abs()),
                "element {i}: {a} vs fd {fd}"
            );
        }
        Ok(())
    }
}
