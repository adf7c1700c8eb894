//! The replicated (dense) half of the model and the MoE forward pass.
//!
//! GPT-2 layout with pre-norm blocks: `x += attn(ln1(x)); x += moe(ln2(x))`, learned position
//! embeddings, final layer norm, LM head tied to the token embedding. Every block's
//! feed-forward is an MoE layer; the experts themselves are not part of [`DenseModel`] but are
//! reached through an [`ExpertExec`].
//!
//! A Hugging Face family (`MoeConfig::hf`, see `model::hf`) is built instead from its own
//! parameters, named exactly by their `transformers` tensor names and stored in their layout
//! (`nn.Linear` weights `[out, in]`, the forward computes `x·Wᵀ`): pre-norm blocks with
//! RMSNorm, rotary positions (`rotate_half` convention, `rope_theta`), grouped-query attention
//! (Qwen2 q/k/v biases, Qwen3 per-head q/k RMSNorm), the family's router (softmax, top-k,
//! renormalised always for Mixtral and with `norm_topk_prob` for Qwen) and the Qwen2-MoE
//! shared expert with its sigmoid gate; final RMSNorm; `lm_head` unless tied.
//!
//! Two candle traps are avoided on purpose: `candle_nn::ops::softmax_last_dim` and the fused
//! `candle_nn::LayerNorm` / `ops::layer_norm` path have **no backward** (gradients silently
//! stop), so this module uses `ops::softmax` and `ops::layer_norm_slow`.

use super::config::HfModel;
use super::config::{MoeConfig, Precision};
use super::experts::{ExpertExec, sigmoid, silu};
use super::hf::{Family, Scoring};
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
    /// The parameters of a Hugging Face family (then `blocks` is empty and `wte` is
    /// `model.embed_tokens.weight`).
    hf: Option<HfParts>,
}

/// An `nn.Linear`: weight `[out, in]` and optional bias `[out]`.
type Linear = (Tensor, Option<Tensor>);

/// The attention of one block of a Hugging Face family.
#[derive(Debug, Clone)]
enum HfAttention {
    /// Grouped-query attention: q, k, v, o.
    Gqa {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        /// Qwen3: RMSNorm weights `[head_dim]` of each query and key head.
        q_norm: Option<Tensor>,
        k_norm: Option<Tensor>,
    },
    /// DeepSeek-V3's multi-head latent attention ([`super::hf::Mla`]).
    Mla {
        q: MlaQuery,
        kv_a: Linear,
        kv_norm: Tensor,
        kv_b: Linear,
        o: Linear,
    },
}

/// MLA's query projection: one `q_proj`, or `q_a_proj`, RMSNorm, `q_b_proj`.
#[derive(Debug, Clone)]
enum MlaQuery {
    Full(Linear),
    LowRank { a: Linear, norm: Tensor, b: Linear },
}

/// One block of a Hugging Face family.
#[derive(Debug, Clone)]
struct HfBlock {
    in_norm: Tensor,
    attn: HfAttention,
    post_norm: Tensor,
    mlp: HfMlp,
}

/// A block's feed-forward.
#[derive(Debug, Clone)]
enum HfMlp {
    Moe(HfMoe),
    /// A dense SwiGLU MLP `(gate [ff, d], up [ff, d], down [d, ff])`.
    Dense(Tensor, Tensor, Tensor),
}

/// An MoE feed-forward's dense parts (the routed experts live in the expert store).
#[derive(Debug, Clone)]
struct HfMoe {
    /// `[E, d]`.
    router: Tensor,
    /// DeepSeek-V3 `e_score_correction_bias [E]`: biases the choice only, never the gates.
    router_bias: Option<Tensor>,
    /// Shared expert `(gate [sff, d], up [sff, d], down [d, sff])`.
    shared: Option<(Tensor, Tensor, Tensor)>,
    /// Qwen2-MoE `shared_expert_gate.weight [1, d]`.
    shared_gate: Option<Tensor>,
}

#[derive(Debug, Clone)]
struct HfParts {
    arch: HfModel,
    blocks: Vec<HfBlock>,
    norm: Tensor,
    /// `lm_head.weight [vocab, d]`; `None` when tied to the embedding.
    lm_head: Option<Tensor>,
    /// Rotary tables `[seq_len, head_dim]`.
    cos: Tensor,
    sin: Tensor,
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

    /// An `nn.Linear(inp, out)` weight `[out, in]` named `{prefix}.weight`, N(0, std), and
    /// its zero bias `{prefix}.bias` when `bias`.
    fn linear(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
        std: f64,
        bias: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let w = self.normal(format!("{prefix}.weight"), (out, inp), std)?;
        let b = if bias {
            Some(self.fill(format!("{prefix}.bias"), out, 0.0)?)
        } else {
            None
        };
        Ok((w, b))
    }
}

/// The variables of a Hugging Face family, in `transformers`' module order, with
/// `transformers`' initialisation (`nn.Linear` and `nn.Embedding` N(0, initializer_range),
/// RMSNorm weights 1, biases 0).
fn build_hf(cfg: &MoeConfig, hf: &HfModel, b: &mut Builder<'_>) -> Result<(Tensor, HfParts)> {
    let (d, std) = (cfg.d_model, hf.initializer_range);
    let (q, kv) = (cfg.n_heads * hf.head_dim, hf.n_kv_heads * hf.head_dim);
    let embed = b.normal("model.embed_tokens.weight".into(), (cfg.vocab, d), std)?;
    let n_blocks = hf.n_blocks(cfg);
    let mut blocks = Vec::with_capacity(n_blocks);
    let mut moe_layer = 0;
    for block in 0..n_blocks {
        let p = format!("model.layers.{block}");
        let a = format!("{p}.self_attn");
        let in_norm = b.fill(format!("{p}.input_layernorm.weight"), d, 1.0)?;
        let attn = match &hf.mla {
            None => {
                let qp = b.linear(&format!("{a}.q_proj"), q, d, std, hf.qkv_bias)?;
                let kp = b.linear(&format!("{a}.k_proj"), kv, d, std, hf.qkv_bias)?;
                let vp = b.linear(&format!("{a}.v_proj"), kv, d, std, hf.qkv_bias)?;
                let op = b.linear(&format!("{a}.o_proj"), d, q, std, hf.o_bias)?;
                let (q_norm, k_norm) = if hf.qk_norm {
                    (
                        Some(b.fill(format!("{a}.q_norm.weight"), hf.head_dim, 1.0)?),
                        Some(b.fill(format!("{a}.k_norm.weight"), hf.head_dim, 1.0)?),
                    )
                } else {
                    (None, None)
                };
                HfAttention::Gqa {
                    q: qp,
                    k: kp,
                    v: vp,
                    o: op,
                    q_norm,
                    k_norm,
                }
            }
            Some(m) => {
                // `DeepseekV3Attention`'s module order; `attention_bias` on q_a, kv_a and o.
                let h = cfg.n_heads;
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                let query = match m.q_lora_rank {
                    None => {
                        MlaQuery::Full(b.linear(&format!("{a}.q_proj"), h * qk, d, std, false)?)
                    }
                    Some(r) => MlaQuery::LowRank {
                        a: b.linear(&format!("{a}.q_a_proj"), r, d, std, hf.qkv_bias)?,
                        norm: b.fill(format!("{a}.q_a_layernorm.weight"), r, 1.0)?,
                        b: b.linear(&format!("{a}.q_b_proj"), h * qk, r, std, false)?,
                    },
                };
                let kv_a = b.linear(
                    &format!("{a}.kv_a_proj_with_mqa"),
                    m.kv_lora_rank + m.qk_rope_head_dim,
                    d,
                    std,
                    hf.qkv_bias,
                )?;
                let kv_norm = b.fill(format!("{a}.kv_a_layernorm.weight"), m.kv_lora_rank, 1.0)?;
                let kv_b = b.linear(
                    &format!("{a}.kv_b_proj"),
                    h * (m.qk_nope_head_dim + m.v_head_dim),
                    m.kv_lora_rank,
                    std,
                    false,
                )?;
                let o = b.linear(&format!("{a}.o_proj"), d, h * m.v_head_dim, std, hf.o_bias)?;
                HfAttention::Mla {
                    q: query,
                    kv_a,
                    kv_norm,
                    kv_b,
                    o,
                }
            }
        };
        let post_norm = b.fill(format!("{p}.post_attention_layernorm.weight"), d, 1.0)?;
        let mlp = if hf.dense_layers.contains(&block) {
            let f = hf.dense_ff;
            let m = format!("{p}.mlp");
            HfMlp::Dense(
                b.linear(&format!("{m}.gate_proj"), f, d, std, false)?.0,
                b.linear(&format!("{m}.up_proj"), f, d, std, false)?.0,
                b.linear(&format!("{m}.down_proj"), d, f, std, false)?.0,
            )
        } else {
            let l = moe_layer;
            moe_layer += 1;
            let router = b.normal(hf.router_name(l), (cfg.experts, d), std)?;
            let router_bias = if hf.has_routing_bias() {
                Some(b.fill(hf.routing_bias_name(l), cfg.experts, 0.0)?)
            } else {
                None
            };
            let shared = match hf.shared_prefix(l) {
                Some(sp) => {
                    let f = hf.shared_ff;
                    Some((
                        b.linear(&format!("{sp}.gate_proj"), f, d, std, false)?.0,
                        b.linear(&format!("{sp}.up_proj"), f, d, std, false)?.0,
                        b.linear(&format!("{sp}.down_proj"), d, f, std, false)?.0,
                    ))
                }
                None => None,
            };
            let shared_gate = if hf.shared_gate {
                Some(b.normal(
                    format!("{}.shared_expert_gate.weight", hf.moe_prefix(l)),
                    (1, d),
                    std,
                )?)
            } else {
                None
            };
            HfMlp::Moe(HfMoe {
                router,
                router_bias,
                shared,
                shared_gate,
            })
        };
        blocks.push(HfBlock {
            in_norm,
            attn,
            post_norm,
            mlp,
        });
    }
    let norm = b.fill("model.norm.weight".into(), d, 1.0)?;
    let lm_head = if hf.tie_word_embeddings {
        None
    } else {
        Some(b.normal("lm_head.weight".into(), (cfg.vocab, d), std)?)
    };
    let (cos, sin) = rope_tables(cfg.seq_len, hf.head_dim, hf.rope_theta, b.device)?;
    Ok((
        embed,
        HfParts {
            arch: hf.clone(),
            blocks,
            norm,
            lm_head,
            cos,
            sin,
        },
    ))
}

/// Rotary tables `cos, sin [s, head_dim]` (Su et al. 2021, "RoFormer", Eq. 34, in the
/// `rotate_half` layout of `transformers`: frequency `i` at columns `i` and `i + head_dim/2`).
/// `inv_freq_i = θ^(−2i/head_dim)` and the angle `pos · inv_freq_i` are rounded to f32 as
/// `transformers` computes them, the cos/sin of the f32 angle in f64 then rounded.
pub(crate) fn rope_tables(
    s: usize,
    hd: usize,
    theta: f64,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = hd / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| (1.0 / theta.powf((2 * i) as f64 / hd as f64)) as f32)
        .collect();
    let (mut cos, mut sin) = (Vec::with_capacity(s * hd), Vec::with_capacity(s * hd));
    for pos in 0..s {
        // The same frequencies in both halves (`torch.cat((freqs, freqs), -1)`).
        for _half in 0..2 {
            for f in &inv {
                let angle = f64::from(pos as f32 * f);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
    }
    Ok((
        Tensor::from_vec(cos, (s, hd), dev)?,
        Tensor::from_vec(sin, (s, hd), dev)?,
    ))
}

/// RMSNorm over the last dimension, `x / sqrt(mean(x²) + eps) · w` (Zhang & Sennrich 2019,
/// Eq. 4), from ops with a backward (candle's fused `rms_norm` has none).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?;
    x.broadcast_mul(&ms.sqrt()?.recip()?)?.broadcast_mul(w)
}

/// `x·cos + rotate_half(x)·sin` for `x [.., s, hd]` and tables `[s, hd]`, where
/// `rotate_half(x) = [−x[hd/2..], x[..hd/2]]` (`transformers`' `apply_rotary_pos_emb`), from
/// `narrow`, `neg`, `cat` and products (candle's `rotary_emb::rope` has no backward).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let half = hd / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rot.broadcast_mul(sin)?
}

/// Each of the `kv` heads of `x [b, kv, s, hd]` repeated `rep` times in place:
/// `[b, kv·rep, s, hd]` with query head `h` reading kv head `h / rep` (`repeat_kv`).
fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, s, hd) = x.dims4()?;
    let x = x.unsqueeze(2)?;
    let copies = vec![&x; rep];
    Tensor::cat(&copies, 2)?.reshape((b, kv * rep, s, hd))
}

/// How attention scores are scaled: divided by `√x` (the GPT and GQA families, as before) or
/// multiplied by `x` (MLA, as `transformers` computes it).
#[derive(Debug, Clone, Copy)]
enum Scale {
    DivSqrt(f64),
    Mul(f64),
}

/// The last dimension's interleaved pairs `(x0, x1), (x2, x3), …` regrouped as
/// `[x0, x2, …, x1, x3, …]`, after which [`apply_rope`]'s `rotate_half` rotates each pair by
/// its frequency: DeepSeek's interleaved rotary layout (`transformers`'
/// `apply_rotary_pos_emb_interleave` gives the same values in the same regrouped order).
pub fn deinterleave(x: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let Some((&hd, lead)) = dims.split_last() else {
        candle_core::bail!("deinterleave of a scalar");
    };
    let mut pairs = lead.to_vec();
    pairs.extend([hd / 2, 2]);
    let r = pairs.len();
    x.reshape(pairs)?
        .transpose(r - 2, r - 1)?
        .contiguous()?
        .reshape(dims)
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
        let (wte, wpe, hf) = match &cfg.hf {
            Some(arch) => {
                let (embed, parts) = build_hf(cfg, arch, &mut b)?;
                (
                    embed,
                    Tensor::zeros((1, d), candle_core::DType::F32, device)?,
                    Some(parts),
                )
            }
            None => {
                let wte = b.normal("wte".into(), (cfg.vocab, d), std)?;
                let wpe = b.normal("wpe".into(), (cfg.seq_len, d), std / 2.0)?;
                (wte, wpe, None)
            }
        };
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in (0..cfg.n_layers).filter(|_| hf.is_none()) {
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
        let (lnf_w, lnf_b) = if hf.is_some() {
            (
                Tensor::ones(d, candle_core::DType::F32, device)?,
                Tensor::zeros(d, candle_core::DType::F32, device)?,
            )
        } else {
            (
                b.fill("ln_f.weight".into(), d, 1.0)?,
                b.fill("ln_f.bias".into(), d, 0.0)?,
            )
        };
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
            hf,
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
    /// The routing biases ([`Self::routing_bias_names`]) are held out of its updates.
    pub fn optimizer(&self) -> Result<AdamW> {
        let mut opt = AdamW::new(self.vars.clone(), self.cfg.adam_params())?;
        opt.freeze(&self.routing_bias_names())?;
        Ok(opt)
    }

    /// The dense variables no gradient updates: DeepSeek-V3's per-layer routing biases
    /// (`…mlp.gate.e_score_correction_bias`), moved by [`Self::update_routing_bias`] instead.
    /// Empty for every other family.
    pub fn routing_bias_names(&self) -> Vec<String> {
        match self.cfg.hf.as_deref() {
            Some(arch) if arch.has_routing_bias() => (0..self.cfg.n_layers)
                .map(|l| arch.routing_bias_name(l))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Whether the routers carry DeepSeek-V3's routing bias ([`Self::update_routing_bias`]).
    pub fn has_routing_bias(&self) -> bool {
        self.cfg.hf.as_ref().is_some_and(|h| h.has_routing_bias())
    }

    /// Auxiliary-loss-free balancing (DeepSeek-V3 report §2.1.2): after a step whose routing
    /// sent `counts[layer][expert]` tokens (the whole step's global batch, every member's
    /// micro-batches together, so every member applies the same update), each expert's bias
    /// moves by `bias_update_speed` up when its load is below the layer's mean, down when
    /// above, not at all when equal. A no-op for families without the bias.
    pub fn update_routing_bias(&self, counts: &[Vec<u64>]) -> Result<()> {
        let (Some(parts), Some(arch)) = (&self.hf, &self.cfg.hf) else {
            return Ok(());
        };
        let speed = arch.bias_update_speed as f32;
        let moe = parts.blocks.iter().filter_map(|b| match &b.mlp {
            HfMlp::Moe(m) => Some(m),
            HfMlp::Dense(..) => None,
        });
        for (l, blk) in moe.enumerate() {
            let Some(bias) = &blk.router_bias else {
                continue;
            };
            let Some(c) = counts.get(l).filter(|c| c.len() == self.cfg.experts) else {
                candle_core::bail!(
                    "routing bias update: no counts of {} experts for layer {l}",
                    self.cfg.experts
                );
            };
            let mean = c.iter().sum::<u64>() as f64 / c.len() as f64;
            let next: Vec<f32> = bias
                .to_vec1::<f32>()?
                .iter()
                .zip(c)
                .map(|(&b, &n)| match (n as f64).total_cmp(&mean) {
                    std::cmp::Ordering::Less => b + speed,
                    std::cmp::Ordering::Greater => b - speed,
                    std::cmp::Ordering::Equal => b,
                })
                .collect();
            let var = self
                .var(&arch.routing_bias_name(l))
                .ok_or_else(|| candle_core::Error::Msg("routing bias variable missing".into()))?;
            var.set(&Tensor::from_vec(next, self.cfg.experts, &self.device)?)?;
        }
        Ok(())
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
        let logits = self.compute.matmul(&h, &self.head().t()?)?;
        let ce = super::fused::cross_entropy(&logits, &tgt)?;
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
            .matmul(&h, &self.head().t()?)?
            .reshape((b, s, self.cfg.vocab))
    }

    /// The LM head `[vocab, d]`: `lm_head.weight`, else the (tied) token embedding.
    fn head(&self) -> &Tensor {
        self.hf
            .as_ref()
            .and_then(|h| h.lm_head.as_ref())
            .unwrap_or(&self.wte)
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
        if let Some(hf) = &self.hf {
            return self.hf_hidden(hf, tokens, experts, stats);
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

impl DenseModel {
    /// [`Self::hidden`] of a Hugging Face family: embedding, pre-norm blocks
    /// `x += attn(rms(x)); x += moe(rms(x))`, final RMSNorm.
    fn hf_hidden(
        &self,
        hf: &HfParts,
        tokens: &Tensor,
        experts: &mut dyn ExpertExec,
        stats: &mut RoutingStats,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let (b, s) = tokens.dims2()?;
        let eps = hf.arch.rms_norm_eps;
        let mut x = self.wte.index_select(&tokens.flatten_all()?, 0)?;
        let mask = causal_mask(s, &self.device)?;
        let cos = hf.cos.narrow(0, 0, s)?;
        let sin = hf.sin.narrow(0, 0, s)?;
        *stats = RoutingStats {
            counts: Vec::with_capacity(self.cfg.n_layers),
            choices: Vec::with_capacity(self.cfg.n_layers),
            lb_loss: Vec::with_capacity(self.cfg.n_layers),
            ce_loss: 0.0,
        };
        let mut lbs = Vec::with_capacity(self.cfg.n_layers);
        for blk in &hf.blocks {
            let h = rms_norm(&x, &blk.in_norm, eps)?;
            x = (x + self.hf_attention(&hf.arch, blk, &h, (b, s), &mask, (&cos, &sin))?)?;
            let h = rms_norm(&x, &blk.post_norm, eps)?;
            let y = match &blk.mlp {
                // The MoE layers are numbered among themselves (experts, routing, planner).
                HfMlp::Moe(m) => {
                    let (y, lb) = self.hf_moe(lbs.len(), &hf.arch, m, &h, experts, stats)?;
                    lbs.push(lb);
                    y
                }
                HfMlp::Dense(g, u, d) => self.swiglu_mlp(&h, (g, u, d))?,
            };
            x = (x + y)?;
        }
        Ok((rms_norm(&x, &hf.norm, eps)?, lbs))
    }

    /// `down(silu(gate(h)) · up(h))` with `nn.Linear` weights (a dense block's MLP, a shared
    /// expert).
    fn swiglu_mlp(&self, h: &Tensor, (g, u, d): (&Tensor, &Tensor, &Tensor)) -> Result<Tensor> {
        let mm = |a: &Tensor, b: &Tensor| self.compute.matmul(a, b);
        let a = (silu(&mm(h, &g.t()?)?)? * mm(h, &u.t()?)?)?;
        mm(&a, &d.t()?)
    }

    /// `x·Wᵀ (+ bias)` in the model's precision.
    fn linear(&self, x: &Tensor, (w, bias): &(Tensor, Option<Tensor>)) -> Result<Tensor> {
        let y = self.compute.matmul(x, &w.t()?)?;
        match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// Causal self-attention with rotary positions of `h [b·s, d]`: grouped-query attention,
    /// or DeepSeek's multi-head latent attention.
    fn hf_attention(
        &self,
        arch: &HfModel,
        blk: &HfBlock,
        h: &Tensor,
        (b, s): (usize, usize),
        mask: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Tensor> {
        let (nh, nkv, hd) = (self.cfg.n_heads, arch.n_kv_heads, arch.head_dim);
        let eps = arch.rms_norm_eps;
        let (q, k, v, o, q_norm, k_norm) = match &blk.attn {
            HfAttention::Gqa {
                q,
                k,
                v,
                o,
                q_norm,
                k_norm,
            } => (q, k, v, o, q_norm, k_norm),
            HfAttention::Mla {
                q,
                kv_a,
                kv_norm,
                kv_b,
                o,
            } => {
                let Some(m) = &arch.mla else {
                    candle_core::bail!("MLA weights without an MLA shape");
                };
                return self.mla_attention(
                    m,
                    (q, kv_a, kv_norm, kv_b, o),
                    h,
                    (b, s),
                    mask,
                    (cos, sin),
                );
            }
        };
        let mut q = self.linear(h, q)?.reshape((b, s, nh, hd))?;
        let mut k = self.linear(h, k)?.reshape((b, s, nkv, hd))?;
        let v = self.linear(h, v)?.reshape((b, s, nkv, hd))?;
        if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
            q = rms_norm(&q, qn, eps)?;
            k = rms_norm(&k, kn, eps)?;
        }
        let q = apply_rope(&q.transpose(1, 2)?.contiguous()?, cos, sin)?;
        let k = apply_rope(&k.transpose(1, 2)?.contiguous()?, cos, sin)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        let k = repeat_kv(&k, nh / nkv)?;
        let v = repeat_kv(&v, nh / nkv)?;
        let y = self.attend(&q, &k, &v, Scale::DivSqrt(hd as f64), mask)?; // [b, nh, s, hd]
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b * s, nh * hd))?;
        self.linear(&y, o)
    }

    /// `softmax(scale(q·kᵀ) + mask)·v` over `[b, heads, s, ·]`.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: Scale,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let mm = |a: &Tensor, b: &Tensor| self.compute.matmul(a, b);
        let scores = mm(&q.contiguous()?, &k.t()?.contiguous()?)?;
        let att = match scale {
            Scale::DivSqrt(x) => (scores / x.sqrt())?,
            Scale::Mul(x) => (scores * x)?,
        };
        let att = softmax(&att.broadcast_add(mask)?, D::Minus1)?;
        mm(&att, &v.contiguous()?)
    }

    /// DeepSeek-V3's multi-head latent attention of `h [b·s, d]` (`transformers`'
    /// `DeepseekV3Attention`): per-head queries of `nope + rope` dims, the latent `c_kv`
    /// (RMSNorm) expanded into per-head keys (`nope`) and values (`v`), one rotary key
    /// (`rope`) shared by every head, scores scaled by `(nope + rope)^-1/2`.
    #[allow(clippy::type_complexity)]
    fn mla_attention(
        &self,
        m: &super::hf::Mla,
        (q, kv_a, kv_norm, kv_b, o): (&MlaQuery, &Linear, &Tensor, &Linear, &Linear),
        h: &Tensor,
        (b, s): (usize, usize),
        mask: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Tensor> {
        use super::hf::MLA_NORM_EPS;
        let nh = self.cfg.n_heads;
        let (nope, rope, vd, r) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        let q = match q {
            MlaQuery::Full(w) => self.linear(h, w)?,
            MlaQuery::LowRank { a, norm, b: wb } => {
                let c = rms_norm(&self.linear(h, a)?, norm, MLA_NORM_EPS)?;
                self.linear(&c, wb)?
            }
        };
        let q = q.reshape((b, s, nh, nope + rope))?.transpose(1, 2)?; // [b, nh, s, nope+rope]
        let q_pass = q.narrow(D::Minus1, 0, nope)?;
        let q_rot = q.narrow(D::Minus1, nope, rope)?.contiguous()?;
        let ckv = self.linear(h, kv_a)?; // [b·s, r + rope]
        let latent = rms_norm(&ckv.narrow(1, 0, r)?, kv_norm, MLA_NORM_EPS)?;
        let k_rot = ckv.narrow(1, r, rope)?.reshape((b, 1, s, rope))?;
        let (q_rot, k_rot) = if m.rope_interleave {
            (deinterleave(&q_rot)?, deinterleave(&k_rot)?)
        } else {
            (q_rot, k_rot.contiguous()?)
        };
        let q_rot = apply_rope(&q_rot, cos, sin)?;
        let k_rot = apply_rope(&k_rot, cos, sin)?;
        let kv = self
            .linear(&latent, kv_b)?
            .reshape((b, s, nh, nope + vd))?
            .transpose(1, 2)?; // [b, nh, s, nope+v]
        let k_pass = kv.narrow(D::Minus1, 0, nope)?;
        let v = kv.narrow(D::Minus1, nope, vd)?;
        let k_rot = k_rot.broadcast_as((b, nh, s, rope))?.contiguous()?;
        let q = Tensor::cat(&[&q_pass.contiguous()?, &q_rot], D::Minus1)?;
        let k = Tensor::cat(&[&k_pass.contiguous()?, &k_rot], D::Minus1)?;
        // `transformers` multiplies by the rounded `qk_head_dim ** -0.5`.
        let scale = Scale::Mul(((nope + rope) as f64).powf(-0.5));
        let y = self.attend(&q, &k, &v, scale, mask)?; // [b, nh, s, v]
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b * s, nh * vd))?;
        self.linear(&y, o)
    }

    /// The family's MoE feed-forward of `h [n, d]`: routed experts (softmax router, top-k,
    /// gates renormalised for Mixtral and with `norm_topk_prob`) plus the shared expert
    /// (Qwen2-MoE: scaled by `sigmoid(h·shared_expert_gateᵀ)`).
    fn hf_moe(
        &self,
        layer: usize,
        arch: &HfModel,
        blk: &HfMoe,
        h: &Tensor,
        experts: &mut dyn ExpertExec,
        stats: &mut RoutingStats,
    ) -> Result<(Tensor, Tensor)> {
        let k = self.cfg.top_k;
        let logits = h.matmul(&blk.router.t()?)?;
        let forced = match &self.forced {
            Some(f) => Some(forced_choice(f, layer, h.dims2()?.0, k, self.cfg.experts)?),
            None if self.router_skew > 0.0 => Some(skewed_choice(&logits, k, self.router_skew)?),
            None => None,
        };
        let m = if arch.scoring == Scoring::Sigmoid {
            // DeepSeek-V3: sigmoid scores; the bias only steers the (group-limited) choice;
            // gates are the chosen scores, renormalised (`+ 1e-20` as `transformers`) and
            // scaled. The balance statistic uses each token's scores normalised to sum 1 (the
            // report's complementary sequence-wise loss does the same, §2.1.2).
            let scores = sigmoid(&logits)?;
            let choice = match forced {
                Some(f) => f,
                None => {
                    let bias = match &blk.router_bias {
                        Some(b) => b.to_vec1::<f32>()?,
                        None => vec![0.0; self.cfg.experts],
                    };
                    group_limited_top_k(
                        &scores.to_vec2::<f32>()?,
                        &bias,
                        arch.n_group,
                        arch.topk_group,
                        k,
                    )
                }
            };
            let gating = Gating {
                renorm: arch.norm_topk_prob,
                eps: 1e-20,
                scale: arch.routed_scaling_factor,
            };
            let lb_probs = scores.broadcast_div(&scores.sum_keepdim(1)?)?;
            moe_from_scores(
                layer,
                h,
                (&scores, &lb_probs),
                k,
                gating,
                Some(choice),
                experts,
            )?
        } else {
            let probs = softmax(&logits, D::Minus1)?;
            let renorm = arch.family == Family::Mixtral || arch.norm_topk_prob;
            moe_from_probs(layer, h, &probs, k, renorm, forced, experts)?
        };
        stats.lb_loss.push(m.lb_loss.to_scalar::<f32>()?);
        stats.counts.push(m.counts);
        stats.choices.push(m.choice);
        let mut out = m.out;
        if let Some((g, u, d)) = &blk.shared {
            let mut y = self.swiglu_mlp(h, (g, u, d))?;
            if let Some(sg) = &blk.shared_gate {
                y = y.broadcast_mul(&sigmoid(&h.matmul(&sg.t()?)?)?)?;
            }
            out = (out + y)?;
        }
        Ok((out, m.lb_loss))
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
    // Differentiable softmax: the router learns through the gates (and the lb loss).
    let probs = softmax(&h.matmul(router_w)?, D::Minus1)?;
    // Top-1 keeps the raw probability (Switch): renormalising one gate would make it 1 and
    // cut the router off from the LM loss. Top-k ≥ 2 renormalises over the chosen experts.
    moe_from_probs(layer, h, &probs, k, k > 1, forced, experts)
}

/// [`moe_layer`] from the router's probabilities `probs [n, E]`: top-`k` (or `forced`),
/// gates = the chosen probabilities, renormalised to sum 1 when `renorm`.
fn moe_from_probs(
    layer: usize,
    h: &Tensor,
    probs: &Tensor,
    k: usize,
    renorm: bool,
    forced: Option<Vec<u32>>,
    experts: &mut dyn ExpertExec,
) -> Result<MoeOutput> {
    let gating = Gating {
        renorm,
        eps: 0.0,
        scale: 1.0,
    };
    moe_from_scores(layer, h, (probs, probs), k, gating, forced, experts)
}

/// How the chosen experts' scores become gates: renormalised over the chosen (`sum + eps`
/// when `eps > 0`) when `renorm`, then multiplied by `scale` unless it is 1.
#[derive(Debug, Clone, Copy)]
struct Gating {
    renorm: bool,
    eps: f64,
    scale: f64,
}

/// One MoE layer from the router's `scores [n, E]` (the gates' source) and `lb_probs [n, E]`
/// (rows summing to 1, for the balance statistic): top-`k` of the scores (or `forced`), gates
/// by `gating`, one batch per expert through `experts`, weighted combine.
fn moe_from_scores(
    layer: usize,
    h: &Tensor,
    (probs, lb_probs): (&Tensor, &Tensor),
    k: usize,
    gating: Gating,
    forced: Option<Vec<u32>>,
    experts: &mut dyn ExpertExec,
) -> Result<MoeOutput> {
    let (n, _) = h.dims2()?;
    let ne = probs.dims2()?.1;
    let device = h.device();
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
    let gates = match gating {
        Gating { renorm: false, .. } => gates,
        Gating { eps, .. } if eps > 0.0 => gates.broadcast_div(&(gates.sum_keepdim(1)? + eps)?)?,
        _ => gates.broadcast_div(&gates.sum_keepdim(1)?)?,
    };
    let gates = if gating.scale == 1.0 {
        gates
    } else {
        (gates * gating.scale)?
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
    let lb_loss = ((lb_probs.mean(0)? * frac)?.sum_all()? * ne as f64)?;
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

/// DeepSeek-V3's node-limited choice (`transformers`' `DeepseekV3TopkRouter`): per token the
/// biased scores `s + bias` (f32), each of the `n_group` equal groups scored by the sum of its
/// best two, the best `topk_group` groups kept, and the `k` best biased scores among their
/// experts, largest first. Ties go to the lower group and expert id.
pub(crate) fn group_limited_top_k(
    scores: &[Vec<f32>],
    bias: &[f32],
    n_group: usize,
    topk_group: usize,
    k: usize,
) -> Vec<u32> {
    let mut out = Vec::with_capacity(scores.len() * k);
    for row in scores {
        let biased: Vec<f32> = row.iter().zip(bias).map(|(s, b)| s + b).collect();
        let per = biased.len() / n_group;
        let group_score: Vec<f32> = biased
            .chunks(per)
            .map(|g| {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &x in g {
                    if x.total_cmp(&a).is_gt() {
                        (a, b) = (x, a);
                    } else if x.total_cmp(&b).is_gt() {
                        b = x;
                    }
                }
                a + b
            })
            .collect();
        let mut groups: Vec<usize> = (0..n_group).collect();
        groups.sort_by(|&x, &y| group_score[y].total_cmp(&group_score[x]).then(x.cmp(&y)));
        let mut cand: Vec<u32> = groups[..topk_group]
            .iter()
            .flat_map(|&g| (g * per..(g + 1) * per).map(|e| e as u32))
            .collect();
        cand.sort_by(|&x, &y| {
            biased[y as usize]
                .total_cmp(&biased[x as usize])
                .then(x.cmp(&y))
        });
        out.extend_from_slice(&cand[..k]);
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

    /// Node-limited routing: the best single expert (4) loses when its group's best two sum
    /// below two other groups'; a bias on it lifts its group and makes it the first choice.
    #[test]
    fn group_limited_top_k_picks_within_the_best_groups() {
        let row = vec![0.9, 0.0, 0.5, 0.5, 0.8, 0.0, 0.1, 0.1];
        assert_eq!(top_k(std::slice::from_ref(&row), 2), vec![0, 4]);
        let zero = [0f32; 8];
        assert_eq!(
            group_limited_top_k(std::slice::from_ref(&row), &zero, 4, 2, 2),
            vec![0, 2]
        );
        // One group of all: plain top-k of the biased scores.
        assert_eq!(
            group_limited_top_k(std::slice::from_ref(&row), &zero, 1, 1, 2),
            vec![0, 4]
        );
        let mut bias = zero;
        bias[4] = 0.3;
        assert_eq!(group_limited_top_k(&[row], &bias, 4, 2, 2), vec![4, 2]);
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
