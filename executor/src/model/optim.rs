//! AdamW whose moments can be read, exported and imported.
//!
//! `candle_nn::AdamW` keeps its moments private, so an expert replica could not migrate with its
//! optimizer state. This one performs the same tensor operations in the same order as candle's
//! (checked bit-exactly by a unit test) and keeps one step counter per optimizer: one instance
//! for the dense parameters, one per expert replica.

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use serde::{Deserialize, Serialize};

pub use candle_nn::ParamsAdamW;

/// One parameter with its two moments.
#[derive(Debug)]
struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    /// Held out of the update (a buffer such as DeepSeek-V3's routing bias, which has its own
    /// rule): its value and moments travel with the state, no gradient ever changes it.
    frozen: bool,
}

/// AdamW (decoupled weight decay) over named variables.
#[derive(Debug)]
pub struct AdamW {
    params: ParamsAdamW,
    step: u64,
    slots: Vec<Slot>,
}

/// Exported value and moments of one parameter (row-major f32).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamState {
    pub name: String,
    pub shape: Vec<usize>,
    pub value: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// Exported state of a whole [`AdamW`]: step counter plus every parameter, in slot order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimState {
    pub step: u64,
    pub params: Vec<ParamState>,
}

impl AdamW {
    /// Zero moments, step 0. Variables keep the given order (the export order).
    pub fn new(vars: Vec<(String, Var)>, params: ParamsAdamW) -> Result<Self> {
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                let m = var.as_tensor().zeros_like()?;
                let v = var.as_tensor().zeros_like()?;
                Ok(Slot {
                    name,
                    var,
                    m,
                    v,
                    frozen: false,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            params,
            step: 0,
            slots,
        })
    }

    /// Holds the named parameters out of every later update (an all-reduced gradient of
    /// zeros would otherwise still move them by the weight decay and the moments). Unknown
    /// names are an error.
    pub fn freeze(&mut self, names: &[String]) -> Result<()> {
        for n in names {
            let Some(slot) = self.slots.iter_mut().find(|s| &s.name == n) else {
                candle_core::bail!("AdamW freeze: no parameter {n}");
            };
            slot.frozen = true;
        }
        Ok(())
    }

    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    /// Updates taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Names of the parameters, in slot order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }

    /// `(m, v)` of a parameter.
    pub fn moments(&self, name: &str) -> Option<(&Tensor, &Tensor)> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .map(|s| (&s.m, &s.v))
    }

    /// One update from a backward pass; parameters without a gradient are left alone (as in
    /// candle), the step counter always advances.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        let g: Vec<Option<Tensor>> = self
            .slots
            .iter()
            .map(|s| grads.get(s.var.as_tensor()).cloned())
            .collect();
        self.step_with(&g)
    }

    /// One update from explicit gradients in slot order (e.g. after an all-reduce).
    pub fn step_with(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    /// [`Self::step_with`] of the gradients multiplied by `factor`: the same bits as passing
    /// [`scale_grad`] of each (no multiplication at all when the factor is 1), without the
    /// scaled copies on the fused path.
    pub fn step_scaled(&mut self, grads: &[Option<Tensor>], factor: f64) -> Result<()> {
        if grads.len() != self.slots.len() {
            candle_core::bail!(
                "AdamW: {} gradients for {} parameters",
                grads.len(),
                self.slots.len()
            );
        }
        self.step += 1;
        let p = &self.params;
        let t = i32::try_from(self.step).unwrap_or(i32::MAX);
        let scale_m = 1f64 / (1f64 - p.beta1.powi(t));
        let scale_v = 1f64 / (1f64 - p.beta2.powi(t));
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            let Some(g) = g.as_ref().filter(|_| !slot.frozen) else {
                continue;
            };
            // candle leaves a variable's gradient attached to the forward graph; a moment built
            // from it would keep that graph, and the previous moment's, alive for ever (the
            // GPT-S-shaped step grew ~2.4 GB per step). Same values, no graph.
            let g = &g.detach();
            let coefs = super::fused::AdamCoefs {
                beta1: p.beta1,
                beta2: p.beta2,
                scale_m,
                scale_v,
                decay: 1f64 - p.lr * p.weight_decay,
                eps: p.eps,
                lr: p.lr,
                grad_factor: factor,
            };
            if let Some((m, v)) =
                super::fused::adamw_step(slot.var.as_tensor(), &slot.m, &slot.v, g, coefs)?
            {
                slot.m = m;
                slot.v = v;
                continue;
            }
            let g = &scale_grad(g, factor)?;
            // Same expression tree as candle_nn::AdamW::step.
            let next_m = ((&slot.m * p.beta1)? + (g * (1.0 - p.beta1))?)?;
            let next_v = ((&slot.v * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let theta = (slot.var.as_tensor() * (1f64 - p.lr * p.weight_decay))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let theta = (theta - (adjusted * p.lr)?)?;
            slot.m = next_m;
            slot.v = next_v;
            slot.var.set(&theta)?;
        }
        Ok(())
    }

    /// Copies out the step counter, values and moments.
    pub fn export(&self) -> Result<OptimState> {
        let params = self
            .slots
            .iter()
            .map(|s| {
                Ok(ParamState {
                    name: s.name.clone(),
                    shape: s.var.dims().to_vec(),
                    value: flat(s.var.as_tensor())?,
                    m: flat(&s.m)?,
                    v: flat(&s.v)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(OptimState {
            step: self.step,
            params,
        })
    }

    /// [`super::fingerprint::optim_state`] of [`Self::export`], without the copy: the same
    /// value, read in place from the tensors.
    pub fn fingerprint(&self) -> Result<u64> {
        use super::fingerprint::{Fingerprint, tensor};
        let mut h = Fingerprint::default();
        h.word(self.step);
        h.word(self.slots.len() as u64);
        for s in &self.slots {
            tensor(&mut h, s.var.as_tensor())?;
            tensor(&mut h, &s.m)?;
            tensor(&mut h, &s.v)?;
        }
        Ok(h.finish())
    }

    /// Overwrites values, moments and step from `state`, which must name the same parameters
    /// with the same shapes in the same order.
    pub fn import(&mut self, state: &OptimState) -> Result<()> {
        if state.params.len() != self.slots.len() {
            candle_core::bail!(
                "AdamW import: {} parameters for {} slots",
                state.params.len(),
                self.slots.len()
            );
        }
        for (slot, ps) in self.slots.iter().zip(&state.params) {
            if slot.name != ps.name || slot.var.dims() != ps.shape.as_slice() {
                candle_core::bail!(
                    "AdamW import: slot {} {:?} got {} {:?}",
                    slot.name,
                    slot.var.dims(),
                    ps.name,
                    ps.shape
                );
            }
        }
        for (slot, ps) in self.slots.iter_mut().zip(&state.params) {
            let dev = slot.var.device().clone();
            slot.var
                .set(&Tensor::from_slice(&ps.value, ps.shape.as_slice(), &dev)?)?;
            slot.m = Tensor::from_slice(&ps.m, ps.shape.as_slice(), &dev)?;
            slot.v = Tensor::from_slice(&ps.v, ps.shape.as_slice(), &dev)?;
        }
        self.step = state.step;
        Ok(())
    }
}

/// `Σ ‖g‖²` over `grads`: each tensor's sum of squares in f32, accumulated in f64 in the given
/// order, returned as f32 (the unit a worker contributes to the global norm).
pub fn sq_norm<'a>(grads: impl IntoIterator<Item = &'a Tensor>) -> Result<f32> {
    let mut acc = 0f64;
    for g in grads {
        acc += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
    }
    Ok(acc as f32)
}

/// The factor by which a step's gradients, **summed** over its `members`, are multiplied before
/// the optimizer update: `1 / members` (the update follows the mean of the members' shard
/// losses, so its scale does not change when members come and go), times `clip_norm / ‖ḡ‖`
/// when the global L2 norm `‖ḡ‖` of that mean exceeds `clip_norm > 0`. `norm_sq` holds the
/// squared norms of disjoint parts of the summed gradient (added in f64, in order), so every
/// worker that passes the same values gets the same factor. A non-finite norm leaves the
/// factor at `1 / members` (such a step is skipped anyway).
pub fn grad_scale(members: usize, norm_sq: &[f32], clip_norm: f64) -> f64 {
    let mean = 1.0 / members.max(1) as f64;
    if clip_norm <= 0.0 {
        return mean;
    }
    let norm = norm_sq.iter().map(|&x| f64::from(x)).sum::<f64>().sqrt() * mean;
    if norm.is_finite() && norm > clip_norm {
        mean * clip_norm / norm
    } else {
        mean
    }
}

/// `g · factor`, or `g` itself when the factor is 1.
pub fn scale_grad(g: &Tensor, factor: f64) -> Result<Tensor> {
    if factor == 1.0 {
        Ok(g.clone())
    } else {
        g.affine(factor, 0.0)
    }
}

/// Row-major f32 copy of a tensor.
pub(crate) fn flat(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::Optimizer;

    /// Same updates, bit for bit, as candle's AdamW over several steps.
    #[test]
    fn matches_candle_adamw_bit_exactly() -> Result<()> {
        let dev = Device::Cpu;
        let init = Tensor::arange(0f32, 12., &dev)?
            .reshape((3, 4))?
            .affine(0.1, -0.5)?;
        let a = Var::from_tensor(&init.copy()?)?;
        let b = Var::from_tensor(&init.copy()?)?;
        let params = ParamsAdamW {
            lr: 0.05,
            ..ParamsAdamW::default()
        };
        let mut ours = AdamW::new(vec![("w".into(), a.clone())], params.clone())?;
        let mut theirs = candle_nn::AdamW::new(vec![b.clone()], params)?;
        for _ in 0..5 {
            let la = (a.as_tensor().sqr()?.sum_all()? + a.as_tensor().sin()?.sum_all()?)?;
            let lb = (b.as_tensor().sqr()?.sum_all()? + b.as_tensor().sin()?.sum_all()?)?;
            ours.step(&la.backward()?)?;
            theirs.step(&lb.backward()?)?;
            let (x, y) = (flat(a.as_tensor())?, flat(b.as_tensor())?);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x), bits(&y));
        }
        assert_eq!(ours.step_count(), 5);
        Ok(())
    }

    /// candle leaves a variable's gradient attached to the forward graph (it detaches only
    /// the intermediate gradients), so a moment computed from it would hold that step's whole
    /// graph and, through the previous moment, every earlier step's: the GPT-S-shaped trainer
    /// grew by ~2.4 GB per step. The moments must hold values only.
    #[test]
    fn moments_hold_no_autograd_graph() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::from_tensor(&Tensor::arange(0f32, 6., &dev)?.reshape((2, 3))?)?;
        let mut opt = AdamW::new(vec![("a".into(), a.clone())], ParamsAdamW::default())?;
        for _ in 0..2 {
            let grads = (a.as_tensor().sqr()? * 0.5)?.sum_all()?.backward()?;
            let g = grads.get(a.as_tensor()).cloned();
            assert!(
                g.as_ref().is_some_and(Tensor::track_op),
                "the premise: candle's gradient of a variable is still attached"
            );
            opt.step_with(&[g.map(|g| scale_grad(&g, 0.5)).transpose()?])?;
            let (m, v) = opt.moments("a").expect("slot a");
            assert!(!m.track_op() && !v.track_op(), "a moment holds a graph");
        }
        Ok(())
    }

    #[test]
    fn grad_scale_means_then_clips_the_global_norm() {
        // No clipping: the mean over the members.
        assert_eq!(grad_scale(4, &[100.0], 0.0), 0.25);
        assert_eq!(grad_scale(1, &[100.0], 0.0), 1.0);
        // Mean norm sqrt(9 + 16) / 5 = 1 ≤ 1: unchanged.
        assert_eq!(grad_scale(5, &[9.0, 16.0], 1.0), 0.2);
        // Mean norm 5 > 1: scaled down to norm 1.
        let f = grad_scale(1, &[9.0, 0.0, 16.0], 1.0);
        assert!((f - 0.2).abs() < 1e-12, "{f}");
        let f = grad_scale(2, &[400.0], 2.0);
        assert!((f * 20.0 - 2.0).abs() < 1e-12, "{f}");
        assert_eq!(grad_scale(3, &[f32::NAN], 1.0), 1.0 / 3.0);
        assert_eq!(grad_scale(0, &[], 1.0), 1.0);
    }

    #[test]
    fn sq_norm_adds_every_tensor() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::from_slice(&[3f32, 4.0], 2, &dev)?;
        let b = Tensor::from_slice(&[1f32, 2.0, 2.0], 3, &dev)?;
        assert_eq!(sq_norm([&a, &b])?, 34.0);
        assert_eq!(sq_norm(std::iter::empty())?, 0.0);
        assert_eq!(flat(&scale_grad(&a, 0.5)?)?, vec![1.5, 2.0]);
        Ok(())
    }

    #[test]
    fn export_import_round_trip() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::ones((2, 2), DType::F32, &dev)?;
        let mut opt = AdamW::new(vec![("a".into(), a.clone())], ParamsAdamW::default())?;
        opt.step(&a.as_tensor().sqr()?.sum_all()?.backward()?)?;
        let st = opt.export()?;
        let b = Var::zeros((2, 2), DType::F32, &dev)?;
        let mut other = AdamW::new(vec![("a".into(), b.clone())], ParamsAdamW::default())?;
        other.import(&st)?;
        assert_eq!(other.export()?, st);
        assert_eq!(other.step_count(), 1);
        let wrong = AdamW::new(
            vec![("z".into(), Var::zeros((2, 2), DType::F32, &dev)?)],
            ParamsAdamW::default(),
        );
        assert!(wrong?.import(&st).is_err());
        Ok(())
    }

    #[test]
    fn a_frozen_parameter_never_moves() -> Result<()> {
        let dev = Device::Cpu;
        let (a, b) = (
            Var::ones(3, DType::F32, &dev)?,
            Var::ones(3, DType::F32, &dev)?,
        );
        let mut opt = AdamW::new(
            vec![("a".into(), a.clone()), ("b".into(), b.clone())],
            ParamsAdamW::default(),
        )?;
        opt.freeze(&["b".to_owned()])?;
        assert!(opt.freeze(&["c".to_owned()]).is_err());
        let g = Tensor::ones(3, DType::F32, &dev)?;
        opt.step_with(&[Some(g.clone()), Some(g)])?;
        assert_eq!(flat(b.as_tensor())?, vec![1.0; 3]);
        assert!(flat(a.as_tensor())?.iter().all(|&x| x < 1.0));
        assert_eq!(opt.export()?.params[1].m, vec![0.0; 3]);
        Ok(())
    }
}
