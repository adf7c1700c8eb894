//! Expert replicas held by one worker, their optimizer state, and pluggable expert execution.
//!
//! An expert of the GPT family is `y = gelu(x·w1)·w2` with `w1: d×ff`, `w2: ff×d`, no biases
//! (GELU is candle's tanh approximation, as in GPT-2). An expert of a Hugging Face family is
//! SwiGLU: `w1: d×2ff` holds the gate projection (columns `0..ff`) and the up projection
//! (`ff..2ff`) side by side, `y = (silu(x·w1[:, ..ff]) ⊙ x·w1[:, ff..])·w2`
//! ([`MoeConfig::w1_cols`]; the layout is the one agreed for export, see `model::hf`). A worker holds only the replicas its plan assigns; each
//! replica carries its own AdamW so that weights *and* moments *and* step move together on
//! migration ([`ExpertStore::export`] / [`ExpertStore::import`]).

use super::config::{MoeConfig, Precision};
use super::init::{Fnv64, normal};
use super::optim::{AdamW, OptimState, ParamState, ParamsAdamW, flat};
use candle_core::backprop::GradStore;
use candle_core::{Device, Result, Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Computes the experts of the MoE layers. [`super::DenseModel::loss`] calls it once per layer
/// with the tokens routed to each expert; the distributed runtime replaces [`LocalExperts`]
/// with an implementation that ships tokens to the workers holding the replicas.
pub trait ExpertExec {
    /// Tokens routed to `(layer, expert)`: `x [n, d] → y [n, d]`, differentiable w.r.t. `x`
    /// (and w.r.t. the expert's weights where they are local).
    fn run(&mut self, layer: usize, expert: usize, x: &Tensor) -> Result<Tensor>;

    /// Every non-empty expert of one layer at once, `batches = [(expert, x)]` in ascending
    /// expert order; returns the outputs in the same order. The default calls [`Self::run`] per
    /// expert; a distributed runtime overrides it to do one all-to-all per layer.
    fn run_layer(&mut self, layer: usize, batches: &[(usize, Tensor)]) -> Result<Vec<Tensor>> {
        batches
            .iter()
            .map(|(e, x)| self.run(layer, *e, x))
            .collect()
    }
}

/// Runs every expert with the weights of a local [`ExpertStore`]; fails on a replica the store
/// does not hold.
#[derive(Debug, Clone, Copy)]
pub struct LocalExperts<'a>(pub &'a ExpertStore);

impl ExpertExec for LocalExperts<'_> {
    fn run(&mut self, layer: usize, expert: usize, x: &Tensor) -> Result<Tensor> {
        match self.0.weights(layer, expert) {
            Some(w) => w.forward(x),
            None => candle_core::bail!("expert ({layer}, {expert}) is not held by this worker"),
        }
    }
}

/// The two weight matrices of one expert (tensors backed by the replica's `Var`s, so gradients
/// of a forward through them land on the replica).
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    /// `[d_model, d_ff]`, or `[d_model, 2·d_ff]` for a SwiGLU expert (gate | up).
    pub w1: Tensor,
    /// `[d_ff, d_model]`
    pub w2: Tensor,
    /// The products' arithmetic (resolved for the device, [`Precision::on`]).
    pub compute: Precision,
}

impl ExpertWeights {
    /// `gelu(x·w1)·w2` for `x [n, d]`; SwiGLU `(silu(x·w1_gate) ⊙ x·w1_up)·w2` when `w1` has
    /// twice as many columns as `w2` has rows (the shapes say which family it is).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ff = self.w2.dims2()?.0;
        let h = self.compute.matmul(x, &self.w1)?;
        let h = if h.dims2()?.1 == 2 * ff {
            super::fused::swiglu(&h, ff)?
        } else {
            super::fused::gelu(&h)?
        };
        self.compute.matmul(&h, &self.w2)
    }
}

/// `silu(x) = x·σ(x)` from ops that all have a backward (`exp`, `recip`, products), checked
/// against finite differences in the tests.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    x * sigmoid(x)?
}

/// `σ(x) = 1 / (1 + e^{−x})` from differentiable primitives.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// Everything that migrates with one expert replica: weights, AdamW moments, step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertState {
    pub layer: usize,
    pub expert: usize,
    pub d_model: usize,
    pub d_ff: usize,
    /// `w1` row-major `[d_model, d_ff]`
    pub w1: Vec<f32>,
    /// `w2` row-major `[d_ff, d_model]`
    pub w2: Vec<f32>,
    /// AdamW first / second moments of `w1`.
    pub m1: Vec<f32>,
    pub v1: Vec<f32>,
    /// AdamW first / second moments of `w2`.
    pub m2: Vec<f32>,
    pub v2: Vec<f32>,
    /// AdamW updates applied to this expert.
    pub step: u64,
}

impl ExpertState {
    /// FNV-1a over the bits of `w1, w2, m1, v1, m2, v2` and the step: equal checksums mean
    /// bit-identical replicas (including optimizer state).
    pub fn checksum(&self) -> u64 {
        let mut h = Fnv64::default();
        for xs in [&self.w1, &self.w2, &self.m1, &self.v1, &self.m2, &self.v2] {
            h.write_f32s(xs);
        }
        h.write(&self.step.to_le_bytes());
        h.finish()
    }

    /// FNV-1a over the bits of `w1` then `w2` only.
    pub fn weights_checksum(&self) -> u64 {
        let mut h = Fnv64::default();
        h.write_f32s(&self.w1);
        h.write_f32s(&self.w2);
        h.finish()
    }

    /// Wire size of the f32 payload.
    pub fn payload_bytes(&self) -> usize {
        4 * (self.w1.len() + self.w2.len() + self.m1.len() + self.v1.len())
            + 4 * (self.m2.len() + self.v2.len())
    }
}

#[derive(Debug)]
struct Replica {
    w1: Var,
    w2: Var,
    opt: AdamW,
}

/// The expert replicas of one worker, keyed by `(layer, expert)`.
#[derive(Debug)]
pub struct ExpertStore {
    d_model: usize,
    d_ff: usize,
    /// Columns of `w1` ([`MoeConfig::w1_cols`]).
    w1_cols: usize,
    /// Init std of `w1`.
    std_in: f64,
    n_layers: usize,
    std_out: f64,
    seed: u64,
    device: Device,
    params: ParamsAdamW,
    replicas: BTreeMap<(usize, usize), Replica>,
    compute: Precision,
}

impl ExpertStore {
    /// A store with no replicas.
    pub fn empty(cfg: &MoeConfig, device: &Device) -> Self {
        Self {
            d_model: cfg.d_model,
            d_ff: cfg.d_ff,
            w1_cols: cfg.w1_cols(),
            // Hugging Face families: every matrix N(0, initializer_range) as `transformers`
            // initialises them; GPT: 0.02 and the GPT-2 residual scaling.
            std_in: cfg.hf.as_ref().map_or(0.02, |h| h.initializer_range),
            n_layers: cfg.n_layers,
            std_out: cfg.hf.as_ref().map_or_else(
                || 0.02 / (2.0 * cfg.n_layers as f64).sqrt(),
                |h| h.initializer_range,
            ),
            seed: cfg.seed,
            device: device.clone(),
            params: cfg.adam_params(),
            replicas: BTreeMap::new(),
            compute: cfg.precision.on(device),
        }
    }

    /// Freshly initialised replicas of the given `(layer, expert)` pairs.
    pub fn with_replicas(
        cfg: &MoeConfig,
        device: &Device,
        replicas: impl IntoIterator<Item = (usize, usize)>,
    ) -> Result<Self> {
        let mut s = Self::empty(cfg, device);
        for (l, e) in replicas {
            if l >= cfg.n_layers || e >= cfg.experts {
                candle_core::bail!(
                    "replica ({l}, {e}) out of range: {} layers x {} experts",
                    cfg.n_layers,
                    cfg.experts
                );
            }
            s.add(l, e)?;
        }
        Ok(s)
    }

    /// One replica of every expert of every layer (a single-worker run).
    pub fn all(cfg: &MoeConfig, device: &Device) -> Result<Self> {
        let pairs = (0..cfg.n_layers).flat_map(|l| (0..cfg.experts).map(move |e| (l, e)));
        Self::with_replicas(cfg, device, pairs)
    }

    /// Adds a freshly initialised replica (the same bits on every worker for the same seed);
    /// replaces an existing one.
    pub fn add(&mut self, layer: usize, expert: usize) -> Result<()> {
        let (d, f, c) = (self.d_model, self.d_ff, self.w1_cols);
        let w1 = normal(
            self.seed,
            &name(layer, expert, "w1"),
            (d, c),
            self.std_in,
            &self.device,
        )?;
        let w2 = normal(
            self.seed,
            &name(layer, expert, "w2"),
            (f, d),
            self.std_out,
            &self.device,
        )?;
        let w1 = Var::from_tensor(&w1)?;
        let w2 = Var::from_tensor(&w2)?;
        let opt = AdamW::new(
            vec![("w1".into(), w1.clone()), ("w2".into(), w2.clone())],
            self.params.clone(),
        )?;
        self.replicas
            .insert((layer, expert), Replica { w1, w2, opt });
        Ok(())
    }

    /// Drops a replica; `false` when it was not held.
    pub fn remove(&mut self, layer: usize, expert: usize) -> bool {
        self.replicas.remove(&(layer, expert)).is_some()
    }

    pub fn contains(&self, layer: usize, expert: usize) -> bool {
        self.replicas.contains_key(&(layer, expert))
    }

    /// Held `(layer, expert)` pairs, ascending.
    pub fn replicas(&self) -> Vec<(usize, usize)> {
        self.replicas.keys().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    /// Layers of the model this store belongs to.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// The replica's weights as tensors (sharing the `Var` storage).
    pub fn weights(&self, layer: usize, expert: usize) -> Option<ExpertWeights> {
        self.replicas.get(&(layer, expert)).map(|r| ExpertWeights {
            w1: r.w1.as_tensor().clone(),
            w2: r.w2.as_tensor().clone(),
            compute: self.compute,
        })
    }

    /// The replica's trainable variables `(w1, w2)`.
    pub fn vars(&self, layer: usize, expert: usize) -> Option<(Var, Var)> {
        self.replicas
            .get(&(layer, expert))
            .map(|r| (r.w1.clone(), r.w2.clone()))
    }

    /// Sets the learning rate of every replica (present and future).
    pub fn set_lr(&mut self, lr: f64) {
        self.params.lr = lr;
        for r in self.replicas.values_mut() {
            r.opt.set_lr(lr);
        }
    }

    /// `(dL/dw1, dL/dw2)` of every replica that has a gradient in `grads` (a half without one
    /// is zeros); replicas no token reached are absent. Ascending `(layer, expert)`.
    pub fn gradients(
        &self,
        grads: &GradStore,
    ) -> Result<BTreeMap<(usize, usize), (Tensor, Tensor)>> {
        let mut out = BTreeMap::new();
        for (&key, r) in &self.replicas {
            // Detached: candle leaves a variable's gradient attached to the forward graph.
            let g1 = grads.get(r.w1.as_tensor()).map(Tensor::detach);
            let g2 = grads.get(r.w2.as_tensor()).map(Tensor::detach);
            if g1.is_none() && g2.is_none() {
                continue;
            }
            let g1 = match g1 {
                Some(g) => g,
                None => r.w1.as_tensor().zeros_like()?,
            };
            let g2 = match g2 {
                Some(g) => g,
                None => r.w2.as_tensor().zeros_like()?,
            };
            out.insert(key, (g1, g2));
        }
        Ok(out)
    }

    /// One AdamW update of one replica from explicit gradients (e.g. all-reduced).
    pub fn step_replica(
        &mut self,
        layer: usize,
        expert: usize,
        g1: &Tensor,
        g2: &Tensor,
    ) -> Result<()> {
        self.step_replica_scaled(layer, expert, g1, g2, 1.0)
    }

    /// [`Self::step_replica`] with the gradients multiplied by `factor` first (the same bits
    /// as passing [`super::scale_grad`] of them, without the scaled copies).
    pub fn step_replica_scaled(
        &mut self,
        layer: usize,
        expert: usize,
        g1: &Tensor,
        g2: &Tensor,
        factor: f64,
    ) -> Result<()> {
        let Some(r) = self.replicas.get_mut(&(layer, expert)) else {
            candle_core::bail!("expert ({layer}, {expert}) is not held by this worker");
        };
        r.opt
            .step_scaled(&[Some(g1.clone()), Some(g2.clone())], factor)
    }

    /// Copies out weights, moments and step of one replica.
    pub fn export(&self, layer: usize, expert: usize) -> Result<ExpertState> {
        let Some(r) = self.replicas.get(&(layer, expert)) else {
            candle_core::bail!("expert ({layer}, {expert}) is not held by this worker");
        };
        let st = r.opt.export()?;
        let [p1, p2]: [ParamState; 2] = st
            .params
            .try_into()
            .map_err(|_| candle_core::Error::Msg("expert optimizer has 2 slots".into()))?;
        Ok(ExpertState {
            layer,
            expert,
            d_model: self.d_model,
            d_ff: self.d_ff,
            w1: p1.value,
            w2: p2.value,
            m1: p1.m,
            v1: p1.v,
            m2: p2.m,
            v2: p2.v,
            step: st.step,
        })
    }

    /// Fingerprint of a held replica's whole state (its optimizer's: step, then `w1` and `w2`
    /// each with both moments), read in place ([`AdamW::fingerprint`]).
    pub fn fingerprint(&self, layer: usize, expert: usize) -> Result<u64> {
        let Some(r) = self.replicas.get(&(layer, expert)) else {
            candle_core::bail!("expert ({layer}, {expert}) is not held by this worker");
        };
        r.opt.fingerprint()
    }

    /// Installs `state` as the replica `(state.layer, state.expert)`, creating it or
    /// overwriting it in place (existing `ExpertWeights` tensors see the new values).
    pub fn import(&mut self, state: &ExpertState) -> Result<()> {
        let (d, f, c) = (self.d_model, self.d_ff, self.w1_cols);
        if state.d_model != d || state.d_ff != f {
            candle_core::bail!(
                "expert state is {}x{}, this model is {d}x{f}",
                state.d_model,
                state.d_ff
            );
        }
        for (what, len, want) in [
            ("w1", state.w1.len(), d * c),
            ("w2", state.w2.len(), d * f),
            ("m1", state.m1.len(), d * c),
            ("v1", state.v1.len(), d * c),
            ("m2", state.m2.len(), d * f),
            ("v2", state.v2.len(), d * f),
        ] {
            if len != want {
                candle_core::bail!("expert state {what} has {len} values, expected {want}");
            }
        }
        let key = (state.layer, state.expert);
        if !self.replicas.contains_key(&key) {
            let w1 = Var::zeros((d, c), candle_core::DType::F32, &self.device)?;
            let w2 = Var::zeros((f, d), candle_core::DType::F32, &self.device)?;
            let opt = AdamW::new(
                vec![("w1".into(), w1.clone()), ("w2".into(), w2.clone())],
                self.params.clone(),
            )?;
            self.replicas.insert(key, Replica { w1, w2, opt });
        }
        let r = self.replicas.get_mut(&key).expect("inserted above");
        r.opt.import(&OptimState {
            step: state.step,
            params: vec![
                ParamState {
                    name: "w1".into(),
                    shape: vec![d, c],
                    value: state.w1.clone(),
                    m: state.m1.clone(),
                    v: state.v1.clone(),
                },
                ParamState {
                    name: "w2".into(),
                    shape: vec![f, d],
                    value: state.w2.clone(),
                    m: state.m2.clone(),
                    v: state.v2.clone(),
                },
            ],
        })
    }

    /// [`ExpertState::checksum`] of a held replica (weights, moments, step).
    pub fn checksum(&self, layer: usize, expert: usize) -> Option<u64> {
        self.export(layer, expert).ok().map(|s| s.checksum())
    }

    /// [`ExpertState::weights_checksum`] of a held replica.
    pub fn weights_checksum(&self, layer: usize, expert: usize) -> Option<u64> {
        let r = self.replicas.get(&(layer, expert))?;
        let mut h = Fnv64::default();
        h.write_f32s(&flat(r.w1.as_tensor()).ok()?);
        h.write_f32s(&flat(r.w2.as_tensor()).ok()?);
        Some(h.finish())
    }
}

/// Stream name of an expert parameter (also its seed key).
fn name(layer: usize, expert: usize, what: &str) -> String {
    format!("h.{layer}.experts.{expert}.{what}")
}
