//! The replicated (dense) half of the model and the MoE forward pass.
//!
//! GPT-2 layout with pre-norm blocks: `x += attn(ln1(x)); x += moe(ln2(x))`, learned position
//! embeddings, final layer norm, LM head tied to the token embedding. Every block's
//! feed-forward is an MoE layer; the experts themselves are not part of [`DenseModel`] but are
//! reached through an [`ExpertExec`].
//!
//! Two candle traps are avoided on purpose: `candle_nn::ops::softmax_last_dim` and the fused
//! `candle_nn::LayerNorm` / `ops::layer_norm` path have **no backward** (gradients silently
//! stop), so this module uses `ops::softmax` and `ops::layer_norm_slow`.

use super::config::{MoeConfig, Precision};
use super::experts::ExpertExec;
use super::init::normal;
use super::optim::AdamW;
use candle_core::{D, Device, Result, Tensor, Var};
use candle_nn::VarMap;
use candle_nn::ops::{layer_norm_slow, softmax};

const LN_EPS: f32 = 1e-5;
const MASKED: f32 = -1e9;

/// What the routers did in one forward pass (overwritten by every call).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingStats {
    /// `[layer][expert]` tokens routed; each layer sums to `tokens × top_k`.
    pub counts: Vec<Vec<u64>>,
    /// `[layer][token·top_k + j]` the experts chosen, token-major (tokens in `[b, s]`
    /// row-major order). Feeding this to [`DenseModel::set_forced_routing`] replays the step.
    pub choices: Vec<Vec<u32>>,
    /// `[layer]` the unweighted Switch load-balancing loss `E·Σ_e frac_e·mean_prob_e` (1 when
    /// perfectly balanced).
    pub lb_loss: Vec<f32>,
    /// Cross-entropy part of the last [`DenseModel::loss`] (0 after [`DenseModel::logits`]).
    pub ce_loss: f32,
}

impl RoutingStats {
    /// Tokens (× top-k) routed in `layer`.
    pub fn routed(&self, layer: usize) -> u64 {
        self.counts.get(layer).map_or(0, |c| c.iter().sum())
    }
}

/// Parameters of one transformer block (tensors backed by the `Var`s in the model's map).
#[derive(Debug, Clone)]
struct Block {
    ln1_w: Tensor,
    ln1_b: Tensor,
    /// `[d, 3d]` (q | k | v)
    qkv_w: Tensor,
    qkv_b: Tensor,
    /// `[d, d]`
    proj_w: Tensor,
    proj_b: Tensor,
    ln2_w: Tensor,
    ln2_b: Tensor,
    /// `[d, E]`, no bias.
    router_w: Tensor,
}

/// Dense parameters (embeddings, attention, norms, routers, final norm; LM head tied to `wte`),
/// replicated on every worker.
pub struct DenseModel {
    cfg: MoeConfig,
    device: Device,
    varmap: VarMap,
    vars: Vec<(String, Var)>,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    lnf_w: Tensor,
    lnf_b: Tensor,
    forced: Option<Vec<Vec<u32>>>,
    /// Zipf exponent of the router's choice bias ([`DenseModel::set_router_skew`]); 0: none.
    router_skew: f64,
    /// The products' arithmetic on this device ([`crate::model::Precision::on`]): attention,
    /// projections and the LM head; the router, norms, softmaxes and the loss stay f32.
    compute: Precision,
}

impl std::fmt::Debug for DenseModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseModel")
            .field("cfg", &self.cfg)
            .field("device", &self.device)
            .field("vars", &self.vars.len())
            .field("forced_routing", &self.forced.is_some())
            .finish_non_exhaustive()
    }
}

/// Collects `Var`s in creation order while building the model.
struct Builder<'a> {
    seed: u64,
    device: &'a Device,
    vars: Vec<(String, Var)>,
}

impl Builder<'_> {
    fn push(&mut self, name: String, t: Tensor) -> Result<Tensor> {
        let var = Var::from_tensor(&t)?;
        let t = var.as_tensor().clone();
        self.vars.push((name, var));
        Ok(t)
    }

    fn normal(&mut self, name: String, shape: (usize, usize), std: f64) -> Result<Tensor> {
        let t = normal(self.seed, &name, shape, std, self.device)?;
        self.push(name, t)
    }

    fn fill(&mut self, name: String, n: usize, value: f32) -> Result<Tensor> {
        let t = Tensor::full(value, n, self.device)?;
        self.push(name, t)
    }
}

impl DenseModel {
    /// Seeded initialisation (GPT-2 style: N(0, 0.02), residual projections scaled by
    /// `1/√(2·layers)`, norms 1/0, biases 0). Same seed ⇒ same bits on every worker.
    pub fn new(cfg: &MoeConfig, device: &Device) -> Result<Self> {
        cfg.validate().map_err(candle_core::Error::wrap)?;
        let (d, e) = (cfg.d_model, cfg.experts);
        let std = 0.02;
        let std_out = std / (2.0 * cfg.n_layers as f64).sqrt();
        let mut b = Builder {
            seed: cfg.seed,
            device,
            vars: Vec::new(),
        };
        let wte = b.normal("wte".into(), (cfg.vocab, d), std)?;
        let wpe = b.normal("wpe".into(), (cfg.seq_len, d), std / 2.0)?;
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let p = |s: &str| format!("h.{l}.{s}");
            blocks.push(Block {
                ln1_w: b.fill(p("ln1.weight"), d, 1.0)?,
                ln1_b: b.fill(p("ln1.bias"), d, 0.0)?,
                qkv_w: b.normal(p("attn.qkv.weight"), (d, 3 * d), std)?,
                qkv_b: b.fill(p("attn.qkv.bias"), 3 * d, 0.0)?,
                proj_w: b.normal(p("attn.proj.weight"), (d, d), std_out)?,
                proj_b: b.fill(p("attn.proj.bias"), d, 0.0)?,
                ln2_w: b.fill(p("ln2.weight"), d, 1.0)?,
                ln2_b: b.fill(p("ln2.bias"), d, 0.0)?,
                router_w: b.normal(p("router.weight"), (d, e), std)?,
            });
        }
        let lnf_w = b.fill("ln_f.weight".into(), d, 1.0)?;
        let lnf_b = b.fill("ln_f.bias".into(), d, 0.0)?;
        let varmap = VarMap::new();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| candle_core::Error::Msg("varmap lock poisoned".into()))?;
            for (name, var) in &b.vars {
                data.insert(name.clone(), var.clone());
            }
        }
        Ok(Self {
            cfg: cfg.clone(),
            device: device.clone(),
            varmap,
            vars: b.vars,
            wte,
            wpe,
            blocks,
            lnf_w,
            lnf_b,
            forced: None,
            router_skew: 0.0,
            compute: cfg.precision.on(device),
        })
    }

    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// All dense variables by name (the same `Var`s as [`Self::named_vars`]); usable with
    /// `VarMap::save`/`load`.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// Dense variables in a fixed canonical order (the order for gradient all-reduce and
    /// optimizer export).
    pub fn named_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// A dense variable by name, e.g. `"h.0.router.weight"`.
    pub fn var(&self, name: &str) -> Option<&Var> {
        self.vars.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// A fresh AdamW over all dense variables with the config's hyper-parameters
    /// ([`MoeConfig::adam_params`]).
    pub fn optimizer(&self) -> Result<AdamW> {
        AdamW::new(self.vars.clone(), self.cfg.adam_params())
    }

    /// Routing replay: when set, layer `l` sends token `t` to experts
    /// `routing[l][t·top_k .. (t+1)·top_k]` instead of the router's top-k (the gates still
    /// come from the router). Lengths and expert ids are checked at the next forward.
    pub fn set_forced_routing(&mut self, routing: Option<Vec<Vec<u32>>>) {
        self.forced = routing;
    }

    /// Forced routing skew (a Zipf router bias): the top-k *choice* ranks expert `e` by its
    /// router probability times `(e + 1)^-skew`, so low expert ids are hot whatever the router
    /// learns; the gates are still the router's own probabilities. For load-balancing
    /// experiments; 0 (the default) is the plain router.
    pub fn set_router_skew(&mut self, skew: f64) {
        self.router_skew = skew;
    }

    pub fn forced_routing(&self) -> Option<&[Vec<u32>]> {
        self.forced.as_deref()
    }

    /// Next-token training loss for `tokens [b, t]` (u32, `2 ≤ t ≤ seq_len + 1`): predicts
    /// `tokens[:, 1..]` from `tokens[:, ..t-1]`. Returns the scalar
    /// `cross_entropy + lb_loss_coef · mean_layers(lb_loss)` and fills `stats`.
    pub fn loss(
        &self,
        tokens: &Tensor,
        experts: &mut dyn ExpertExec,
        stats: &mut RoutingStats,
    ) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        if t < 2 {
            candle_core::bail!("loss needs at least 2 tokens per sequence, got {t}");
        }
        let inp = tokens.narrow(1, 0, t - 1)?;
        let tgt = tokens.narrow(1, 1, t - 1)?.flatten_all()?;
        let (h, lb) = self.hidden(&inp, experts, stats)?;
        let logits = self.compute.matmul(&h, &self.wte.t()?)?;
        let ce = candle_nn::loss::cross_entropy(&logits, &tgt)?;
        debug_assert_eq!(logits.dims2()?, (b * (t - 1), self.cfg.vocab));
        stats.ce_loss = ce.to_scalar::<f32>()?;
        if self.cfg.lb_loss_coef == 0.0 {
            return Ok(ce);
        }
        let lb = (Tensor::stack(&lb, 0)?.mean_all()? * self.cfg.lb_loss_coef)?;
        ce + lb
    }

    /// Logits `[b, s, vocab]` for `tokens [b, s]` (`s ≤ seq_len`); fills `stats`
    /// (`ce_loss = 0`).
    pub fn logits(
        &self,
        tokens: &Tensor,
        experts: &mut dyn ExpertExec,
        stats: &mut RoutingStats,
    ) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        let (h, _) = self.hidden(tokens, experts, stats)?;
        stats.ce_loss = 0.0;
        self.compute
            .matmul(&h, &self.wte.t()?)?
            .reshape((b, s, self.cfg.vocab))
    }

    /// Final hidden states `[b·s, d]` and the per-layer load-balancing losses.
    fn hidden(
        &self,
        tokens: &Tensor,
        experts: &mut dyn ExpertExec,
        stats: &mut RoutingStats,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let (b, s) = tokens.dims2()?;
        if s == 0 || s > self.cfg.seq_len {
            candle_core::bail!("sequence length {s} outside 1..={}", self.cfg.seq_len);
        }
        let d = self.cfg.d_model;
        let n = b * s;
        let x = self.wte.index_select(&tokens.flatten_all()?, 0)?;
        let x = x
            .reshape((b, s, d))?
            .broadcast_add(&self.wpe.narrow(0, 0, s)?)?;
        let mut x = x.reshape((n, d))?;
        let mask = causal_mask(s, &self.device)?;
        *stats = RoutingStats {
            counts: Vec::with_capacity(self.cfg.n_layers),
            choices: Vec::with_capacity(self.cfg.n_layers),
            lb_loss: Vec::with_capacity(self.cfg.n_layers),
            ce_loss: 0.0,
        };
        let mut lbs = Vec::with_capacity(self.cfg.n_layers);
        for (l, blk) in self.blocks.iter().enumerate() {
            let h = layer_norm_slow(&x, &blk.ln1_w, &blk.ln1_b, LN_EPS)?;
            x = (x + self.attention(blk, &h, b, s, &mask)?)?;
            let h = layer_norm_slow(&x, &blk.ln2_w, &blk.ln2_b, LN_EPS)?;
            let (y, lb) = self.moe(l, blk, &h, experts, stats)?;
            x = (x + y)?;
            lbs.push(lb);
        }
        let h = layer_norm_slow(&x, &self.lnf_w, &self.lnf_b, LN_EPS)?;
        Ok((h, lbs))
    }

    /// Causal multi-head self-attention of `h [b·s, d]`.
    fn attention(
        &self,
        blk: &Block,
        h: &Tensor,
        b: usize,
        s: usize,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let (d, nh) = (self.cfg.d_model, self.cfg.n_heads);
        let dh = d / nh;
        let mm = |a: &Tensor, b: &Tensor| self.compute.matmul(a, b);
        let qkv = mm(h, &blk.qkv_w)?.broadcast_add(&blk.qkv_b)?;
        // [b, s, 3, nh, dh] → [3, b, nh, s, dh]
        let qkv = qkv.reshape((b, s, 3, nh, dh))?.permute((2, 0, 3, 1, 4))?;
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let att = (mm(&q, &k.t()?.contiguous()?)? / (dh as f64).sqrt())?;
        let att = softmax(&att.broadcast_add(mask)?, D::Minus1)?;
        let y = mm(&att, &v)?; // [b, nh, s, dh]
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b * s, d))?;
        mm(&y, &blk.proj_w)?.broadcast_add(&blk.proj_b)
    }

    /// Routes `h [n, d]` to experts; returns the gate-weighted expert mix and the layer's
    /// unweighted load-balancing loss.
    fn moe(
        &self,
        layer: usize,
        blk: &Block,
        h: &Tensor,
        experts: &mut dyn ExpertExec,
        stats: &mut RoutingStats,
    ) -> Result<(Tensor, Tensor)> {
        let forced = match &self.forced {
            Some(f) => Some(forced_choice(
                f,
                layer,
                h.dims2()?.0,
                self.cfg.top_k,
                self.cfg.experts,
            )?),
            None if self.router_skew > 0.0 => Some(skewed_choice(
                &h.matmul(&blk.router_w)?,
                self.cfg.top_k,
                self.router_skew,
            )?),
            None => None,
        };
        let m = moe_layer(layer, h, &blk.router_w, self.cfg.top_k, forced, experts)?;
        stats.lb_loss.push(m.lb_loss.to_scalar::<f32>()?);
        stats.counts.push(m.counts);
        stats.choices.push(m.choice);
        Ok((m.out, m.lb_loss))
    }
}

/// What one MoE layer computed ([`moe_layer`]).
#[derive(Debug, Clone)]
pub struct MoeOutput {
    /// `[n, d]` gate-weighted mix of the chosen experts' outputs.
    pub out: Tensor,
    /// Unweighted Switch load-balancing loss (scalar; 1 when perfectly balanced).
    pub lb_loss: Tensor,
    /// Tokens routed to each expert.
    pub counts: Vec<u64>,
    /// `[token·top_k + j]` the experts chosen, token-major.
    pub choice: Vec<u32>,
}

/// One MoE layer on `h [n, d]` with router `router_w [d, E]`: softmax router, top-`k` choice
/// (or `forced`, `n·k` expert ids), gates, one batch per expert through `experts`, weighted
/// combine, and the load-balancing loss. Differentiable in `h`, the router and the experts.
pub fn moe_layer(
    layer: usize,
    h: &Tensor,
    router_w: &Tensor,
    k: usize,
    forced: Option<Vec<u32>>,
    experts: &mut dyn ExpertExec,
) -> Result<MoeOutput> {
    let (n, _) = h.dims2()?;
    let ne = router_w.dims2()?.1;
    let device = h.device();
    // Differentiable softmax: the router learns through the gates (and the lb loss).
    let probs = softmax(&h.matmul(router_w)?, D::Minus1)?;
    let choice = match forced {
        Some(f) => f,
        None => top_k(&probs.to_vec2::<f32>()?, k),
    };
    let mut counts = vec![0u64; ne];
    let mut tok: Vec<Vec<u32>> = vec![Vec::new(); ne];
    let mut slot: Vec<Vec<u32>> = vec![Vec::new(); ne];
    for (i, &e) in choice.iter().enumerate() {
        let e = e as usize;
        counts[e] += 1;
        tok[e].push(u32::try_from(i / k).map_err(candle_core::Error::wrap)?);
        slot[e].push(u32::try_from(i).map_err(candle_core::Error::wrap)?);
    }
    let idx = Tensor::from_slice(&choice, (n, k), device)?;
    let gates = probs.gather(&idx, 1)?;
    // Top-1 keeps the raw probability (Switch): renormalising one gate would make it 1 and
    // cut the router off from the LM loss. Top-k ≥ 2 renormalises over the chosen experts.
    let gates = if k > 1 {
        gates.broadcast_div(&gates.sum_keepdim(1)?)?
    } else {
        gates
    };
    let gates = gates.flatten_all()?;
    let mut batches = Vec::new();
    let mut index = Vec::new();
    for e in 0..ne {
        if tok[e].is_empty() {
            continue;
        }
        let ti = Tensor::from_slice(&tok[e], tok[e].len(), device)?;
        let si = Tensor::from_slice(&slot[e], slot[e].len(), device)?;
        batches.push((e, h.index_select(&ti, 0)?));
        index.push((ti, si));
    }
    let ys = experts.run_layer(layer, &batches)?;
    if ys.len() != batches.len() {
        candle_core::bail!(
            "expert exec returned {} outputs for {} batches",
            ys.len(),
            batches.len()
        );
    }
    let mut out = h.zeros_like()?;
    for ((y, (ti, si)), (e, x)) in ys.iter().zip(&index).zip(&batches) {
        if y.dims() != x.dims() {
            candle_core::bail!(
                "expert ({layer}, {e}) returned {:?} for input {:?}",
                y.dims(),
                x.dims()
            );
        }
        let g = gates.index_select(si, 0)?.unsqueeze(1)?;
        out = out.index_add(ti, &y.broadcast_mul(&g)?, 0)?;
    }
    // Switch load balancing: E · Σ_e (tokens_e / (n·k)) · mean_t p_e(t).
    let frac: Vec<f32> = counts.iter().map(|&c| c as f32 / (n * k) as f32).collect();
    let frac = Tensor::from_vec(frac, ne, device)?;
    let lb_loss = ((probs.mean(0)? * frac)?.sum_all()? * ne as f64)?;
    Ok(MoeOutput {
        out,
        lb_loss,
        counts,
        choice,
    })
}

/// `[s, s]` additive mask: 0 on and below the diagonal, `-1e9` above.
fn causal_mask(s: usize, dev: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..s)
        .flat_map(|i| (0..s).map(move |j| if j > i { MASKED } else { 0.0 }))
        .collect();
    Tensor::from_vec(m, (s, s), dev)
}

/// The `k` largest entries of each row, largest first; ties go to the lower expert id.
pub(crate) fn top_k(probs: &[Vec<f32>], k: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(probs.len() * k);
    let mut order: Vec<u32> = Vec::new();
    for row in probs {
        order.clear();
        order.extend(0..row.len() as u32);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        out.extend_from_slice(&order[..k]);
    }
    out
}

/// Top-`k` of the router logits `[n, E]` after a Zipf bias `−skew·ln(e + 1)` (softmax is
/// monotonic, so biasing the logits ranks like scaling the probabilities).
fn skewed_choice(logits: &Tensor, k: usize, skew: f64) -> Result<Vec<u32>> {
    let mut rows = logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    for row in &mut rows {
        for (e, x) in row.iter_mut().enumerate() {
            *x -= (skew * ((e + 1) as f64).ln()) as f32;
        }
    }
    Ok(top_k(&rows, k))
}

/// Validated forced choices of one layer.
fn forced_choice(f: &[Vec<u32>], layer: usize, n: usize, k: usize, ne: usize) -> Result<Vec<u32>> {
    let Some(c) = f.get(layer) else {
        candle_core::bail!("forced routing has {} layers, need layer {layer}", f.len());
    };
    if c.len() != n * k {
        candle_core::bail!(
            "forced routing of layer {layer} has {} entries, need tokens x top_k = {}",
            c.len(),
            n * k
        );
    }
    for (t, row) in c.chunks(k).enumerate() {
        for (j, &e) in row.iter().enumerate() {
            if e as usize >= ne {
                candle_core::bail!("forced routing: layer {layer} token {t} -> expert {e} >= {ne}");
            }
            if row[..j].contains(&e) {
                candle_core::bail!(
                    "forced routing: layer {layer} token {t} picks expert {e} twice"
                );
            }
        }
    }
    Ok(c.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_and_breaks_ties_low() {
        let p = vec![vec![0.1, 0.4, 0.4, 0.1], vec![0.7, 0.1, 0.05, 0.15]];
        assert_eq!(top_k(&p, 1), vec![1, 0]);
        assert_eq!(top_k(&p, 2), vec![1, 2, 0, 3]);
    }

    #[test]
    fn forced_choice_is_checked() {
        let f = vec![vec![0, 1, 2, 3]];
        assert_eq!(forced_choice(&f, 0, 2, 2, 4).unwrap(), vec![0, 1, 2, 3]);
        assert!(forced_choice(&f, 1, 2, 2, 4).is_err());
        assert!(forced_choice(&f, 0, 3, 2, 4).is_err());
        assert!(forced_choice(&f, 0, 2, 2, 3).is_err());
        assert!(forced_choice(&[vec![1, 1]], 0, 1, 2, 4).is_err());
    }

    #[test]
    fn causal_mask_shape() -> Result<()> {
        let m = causal_mask(3, &Device::Cpu)?.to_vec2::<f32>()?;
        assert_eq!(m[0], vec![0.0, MASKED, MASKED]);
        assert_eq!(m[2], vec![0.0, 0.0, 0.0]);
        Ok(())
    }
}
