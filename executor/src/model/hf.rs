//! Hugging Face MoE families read from a `config.json` (issue 32): `MixtralForCausalLM`,
//! `Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM` and `DeepseekV3ForCausalLM`.
//!
//! The fields and their defaults follow the `transformers` configuration and modelling files of
//! each architecture (`models/{mixtral,qwen2_moe,qwen3_moe,deepseek_v3}`). What the executor
//! does not implement is refused with a [`ConfigError::Hf`] naming the field, never trained as
//! something else:
//!
//! * `rope_scaling` (any non-null value), a `rope_parameters` whose `rope_type` is not
//!   `default` (its `rope_theta` is read like the top-level one), a sliding window that would
//!   change the attention (`sliding_window` below `max_position_embeddings` for Mixtral, `use_sliding_window` for
//!   Qwen), router jitter noise, attention dropout, an activation other than `silu`;
//! * a model whose every layer is dense (no MoE layer to train);
//! * DeepSeek-V3 with `num_key_value_heads` other than `num_attention_heads` (its latent
//!   attention expands keys and values to every query head), or groups of fewer than two
//!   experts (the group score is the sum of the group's best two).
//!
//! DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §2.1) trains with its
//! multi-head latent attention ([`Mla`]: low-rank query and key/value projections, a decoupled
//! rotary key shared by the heads, interleaved rotary layout unless `rope_interleave` is
//! false), sigmoid router scores, node-limited routing (`n_group` groups scored by their best
//! two experts, top-k among the best `topk_group` groups), gates renormalised and multiplied by
//! `routed_scaling_factor`, `n_shared_experts` always-on experts, and auxiliary-loss-free
//! balancing: the per-expert `e_score_correction_bias` only biases the choice and is updated
//! after every step by `±bias_update_speed` toward the mean load of the step's global batch
//! (§2.1.2; γ = 0.001 as in the report's pre-training).
//!
//! Dense (non-MoE) blocks are built as `transformers` builds them — Qwen's `mlp_only_layers`
//! and the blocks `decoder_sparse_step` skips, DeepSeek's first `first_k_dense_replace` — each
//! with a SwiGLU MLP of `intermediate_size` (`model.layers.{i}.mlp.{gate,up,down}_proj`).
//! `MoeConfig::n_layers` counts the MoE blocks only: experts, routing statistics and the
//! planner number MoE layers among themselves, and [`HfModel::block_of`] gives a MoE layer's
//! block, whose index its tensor names carry.
//!
//! Naming (the interface agreed with the export side): dense variables carry their Hugging
//! Face tensor names and layouts ([`HfModel::router_name`] etc.); a routed expert keeps the
//! executor's `w1 [d, 2·ff]` (gate projection transposed in columns `0..ff`, up projection
//! transposed in `ff..2·ff`) and `w2 [ff, d]` (down projection transposed), named in Hugging
//! Face terms by [`HfModel::expert_tensor_names`].

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::config::{ConfigError, MoeConfig, SizeLimits, at_most};

/// The model family of a [`MoeConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Family {
    /// The paper's GPT-2-style MoE: learned positions, LayerNorm, GELU experts.
    #[default]
    #[serde(rename = "gpt")]
    Gpt,
    #[serde(rename = "MixtralForCausalLM")]
    Mixtral,
    #[serde(rename = "Qwen2MoeForCausalLM")]
    Qwen2Moe,
    #[serde(rename = "Qwen3MoeForCausalLM")]
    Qwen3Moe,
    #[serde(rename = "DeepseekV3ForCausalLM")]
    DeepseekV3,
}

impl Family {
    /// The `architectures` entry of a `config.json` (`gpt` for the GPT family).
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpt => "gpt",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Qwen2Moe => "Qwen2MoeForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    fn from_architecture(s: &str) -> Option<Self> {
        [
            Self::Mixtral,
            Self::Qwen2Moe,
            Self::Qwen3Moe,
            Self::DeepseekV3,
        ]
        .into_iter()
        .find(|f| f.name() == s)
    }

    fn from_model_type(s: &str) -> Option<Self> {
        match s {
            "mixtral" => Some(Self::Mixtral),
            "qwen2_moe" => Some(Self::Qwen2Moe),
            "qwen3_moe" => Some(Self::Qwen3Moe),
            "deepseek_v3" => Some(Self::DeepseekV3),
            _ => None,
        }
    }
}

/// How the router turns logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scoring {
    /// `softmax` over the experts (Mixtral, Qwen).
    #[default]
    Softmax,
    /// Element-wise `sigmoid` (DeepSeek-V3).
    Sigmoid,
}

/// The architecture fields of a Hugging Face family beyond [`MoeConfig`]'s shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfModel {
    pub family: Family,
    /// `num_key_value_heads` (grouped-query attention; divides `n_heads`).
    pub n_kv_heads: usize,
    /// Size of one attention head (`head_dim`, else `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `false`: a separate `lm_head.weight [vocab, d]`.
    pub tie_word_embeddings: bool,
    /// Upper bound of the training sequence length.
    pub max_position_embeddings: usize,
    /// Std of the normal initialisation of every matrix (`initializer_range`).
    pub initializer_range: f64,
    /// Biases on `q_proj`, `k_proj`, `v_proj` (Qwen2-MoE always; Qwen3-MoE `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on `o_proj` (Qwen3-MoE `attention_bias`).
    pub o_bias: bool,
    /// RMSNorm of each query and key head before the rotation (Qwen3-MoE).
    pub qk_norm: bool,
    /// Renormalise the top-k gates to sum to 1 (always for Mixtral).
    pub norm_topk_prob: bool,
    pub scoring: Scoring,
    /// Intermediate size of the always-on shared expert MLP, 0 for none (Qwen2-MoE
    /// `shared_expert_intermediate_size`, DeepSeek `n_shared_experts · moe_intermediate_size`).
    pub shared_ff: usize,
    /// The shared expert's output is scaled by `sigmoid(x · shared_expert_gate)` (Qwen2-MoE).
    pub shared_gate: bool,
    /// DeepSeek group-limited routing: `n_group` groups, the best `topk_group` of them.
    pub n_group: usize,
    pub topk_group: usize,
    /// DeepSeek: gates are multiplied by this (1 elsewhere).
    pub routed_scaling_factor: f64,
    /// DeepSeek-V3's multi-head latent attention (`None`: grouped-query attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<Mla>,
    /// DeepSeek-V3's auxiliary-loss-free balancing: after every step each expert's routing bias
    /// moves by this much toward the step's mean load (0: no bias, the other families).
    #[serde(default)]
    pub bias_update_speed: f64,
    /// Transformer blocks whose feed-forward is a dense SwiGLU MLP of `dense_ff`, not an MoE
    /// layer (DeepSeek's first `first_k_dense_replace`, Qwen's `mlp_only_layers` and the
    /// blocks `decoder_sparse_step` skips), ascending. The model has `n_layers` MoE blocks
    /// plus these; every MoE-layer index elsewhere (experts, routing, the planner) counts MoE
    /// blocks only, [`HfModel::block_of`] maps it to its block.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
    /// Intermediate size of the dense blocks' MLP (`intermediate_size`; 0 without any).
    #[serde(default)]
    pub dense_ff: usize,
    /// The parsed `config.json`, kept so an export can write it back.
    pub config_json: Value,
}

/// The shape of DeepSeek-V3's multi-head latent attention (DeepSeek-V2 report §2.1;
/// `transformers`' `DeepseekV3Attention`): queries through `q_a_proj [q_lora_rank, d]`,
/// RMSNorm and `q_b_proj [heads·(nope + rope), q_lora_rank]` (or one `q_proj` when
/// `q_lora_rank` is null); `kv_a_proj_with_mqa [kv_lora_rank + rope, d]` gives the latent
/// (RMSNorm, then `kv_b_proj [heads·(nope + v), kv_lora_rank]` into per-head keys and values)
/// and one rotary key of `rope` dims shared by every head; `o_proj [d, heads·v]`. The scores
/// are scaled by `(nope + rope)^-1/2`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mla {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The rotary dims of `q` and `k` come in interleaved pairs `(x0, x1), (x2, x3), …` (the
    /// released DeepSeek weights); `false`: the `rotate_half` halves.
    pub rope_interleave: bool,
}

/// The DeepSeek-V3 report's bias update speed γ (§2.1.2, pre-training).
pub const DEEPSEEK_BIAS_UPDATE_SPEED: f64 = 0.001;

/// RMSNorm epsilon of MLA's two latent norms (`DeepseekV3RMSNorm`'s default; the
/// `rms_norm_eps` field is not passed to them).
pub const MLA_NORM_EPS: f64 = 1e-6;

fn err(field: &str, why: impl Into<String>) -> ConfigError {
    ConfigError::Hf {
        field: field.to_owned(),
        why: why.into(),
    }
}

/// The most a size field of `config.json` may be, and what it counts ([`SizeLimits`]).
/// Fields that only bound something (`max_position_embeddings`, `sliding_window`) or only
/// select layers (`decoder_sparse_step`) take any `usize`; `vocab_size` any token id.
fn size_limit(k: &str) -> (usize, &'static str) {
    match k {
        "num_hidden_layers" | "first_k_dense_replace" => (SizeLimits::LAYERS, "layers"),
        "num_local_experts"
        | "num_experts"
        | "n_routed_experts"
        | "n_shared_experts"
        | "num_experts_per_tok"
        | "n_group"
        | "topk_group" => (SizeLimits::EXPERTS, "experts"),
        "num_attention_heads" | "num_key_value_heads" => (SizeLimits::HEADS, "heads"),
        "vocab_size" => (u32::MAX as usize, "token ids are u32"),
        "max_position_embeddings" | "sliding_window" | "decoder_sparse_step" => (usize::MAX, ""),
        _ => (SizeLimits::WIDTH, "a width"),
    }
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn present(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    /// A size: a non-negative integer within its field's [`size_limit`], so that nothing
    /// computed from it (`n_shared_experts × moe_intermediate_size`, the list of a billion
    /// layers) overflows or allocates before [`MoeConfig::validate`] sees it.
    fn usize_req(&self, k: &str) -> Result<usize, ConfigError> {
        let x = self.u64_req(k)?;
        let (max, what) = size_limit(k);
        match usize::try_from(x) {
            Ok(x) if x <= max => Ok(x),
            _ => Err(err(
                k,
                format!("{x} is more than {max}, the most lzrun takes ({what})"),
            )),
        }
    }

    fn u64_req(&self, k: &str) -> Result<u64, ConfigError> {
        match self.present(k) {
            None => Err(err(k, "missing")),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| err(k, format!("must be a non-negative integer, got {v}"))),
        }
    }

    fn usize_or(&self, k: &str, default: usize) -> Result<usize, ConfigError> {
        if self.present(k).is_some() {
            self.usize_req(k)
        } else {
            Ok(default)
        }
    }

    fn f64_or(&self, k: &str, default: f64) -> Result<f64, ConfigError> {
        match self.present(k) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| err(k, format!("must be a finite number, got {v}"))),
        }
    }

    fn bool_or(&self, k: &str, default: bool) -> Result<bool, ConfigError> {
        match self.present(k) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| err(k, format!("must be true or false, got {v}"))),
        }
    }

    fn str_or<'b>(&'b self, k: &str, default: &'b str) -> Result<&'b str, ConfigError> {
        match self.present(k) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| err(k, format!("must be a string, got {v}"))),
        }
    }

    /// Refuses a field that is present and not null.
    fn refuse_set(&self, k: &str, why: &str) -> Result<(), ConfigError> {
        match self.present(k) {
            Some(v) => Err(err(k, format!("{v}: {why}"))),
            None => Ok(()),
        }
    }

    /// Refuses a number field that is present and non-zero.
    fn refuse_nonzero(&self, k: &str, why: &str) -> Result<(), ConfigError> {
        if self.f64_or(k, 0.0)? != 0.0 {
            return Err(err(k, format!("{}: {why}", self.0[k])));
        }
        Ok(())
    }
}

/// The rotary base: `transformers` 4 writes `rope_theta` at the top level, `transformers` 5
/// inside `rope_parameters` (`{"rope_type": "default", "rope_theta": …}`); either is read, and
/// two different values, a `rope_type` other than `default` (YaRN, linear, dynamic, … scale
/// the frequencies, which this model does not) or a malformed object are refused. With neither,
/// the family's own default: Mixtral 1e6, the others 10,000 (the `transformers` config
/// classes' defaults).
fn rope_theta(f: &Fields<'_>, family: Family) -> Result<f64, ConfigError> {
    let top = f
        .present("rope_theta")
        .map(|_| f.f64_or("rope_theta", 0.0))
        .transpose()?;
    let nested = match f.present("rope_parameters") {
        None => None,
        Some(Value::Object(p)) => {
            let p = Fields(p);
            let kind = p
                .str_or("rope_type", "default")
                .map_err(|e| err("rope_parameters", format!("rope_type: {e}")))?;
            if kind != "default" {
                return Err(err(
                    "rope_parameters",
                    format!("rope_type {kind:?} is not supported (only \"default\")"),
                ));
            }
            p.present("rope_theta")
                .map(|_| p.f64_or("rope_theta", 0.0))
                .transpose()
                .map_err(|e| err("rope_parameters", format!("rope_theta: {e}")))?
        }
        Some(v) => {
            return Err(err(
                "rope_parameters",
                format!("must be an object, got {v}"),
            ));
        }
    };
    match (top, nested) {
        (Some(a), Some(b)) if a != b => Err(err(
            "rope_parameters",
            format!("rope_theta {b} differs from the top-level rope_theta {a}"),
        )),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Ok(match family {
            Family::Mixtral => 1e6,
            _ => 10000.0,
        }),
    }
}

impl MoeConfig {
    /// The model of a Hugging Face `config.json` (see the [module docs](super::hf) for the
    /// families and what is refused). The training knobs (`seq_len`, `batch`, `lr`,
    /// `adam_beta2`, `grad_clip_norm`, `seed`, `precision`) are [`MoeConfig::tiny`]'s; set them
    /// afterwards ([`MoeConfig::with_training_of`]). `lb_loss_coef` is
    /// `router_aux_loss_coef · top_k` (default coefficient 0.001 for Mixtral and Qwen, 0 for
    /// DeepSeek-V3, which balances with its bias instead): `transformers`' loss counts each
    /// token's `top_k` choices as fractions summing to `top_k` where the executor's sum to 1,
    /// so the scaled coefficient gives the same loss term.
    pub fn from_hf_config_json(text: &str) -> Result<MoeConfig, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| err("(file)", format!("not JSON: {e}")))?;
        let Value::Object(map) = &value else {
            return Err(err("(file)", "not a JSON object"));
        };
        let f = Fields(map);
        let family = match map.get("architectures") {
            Some(Value::Array(a)) if !a.is_empty() => {
                let s = a[0]
                    .as_str()
                    .ok_or_else(|| err("architectures", "must be a list of strings"))?;
                Family::from_architecture(s).ok_or_else(|| {
                    err(
                        "architectures",
                        format!(
                            "{s:?} is not supported (supported: MixtralForCausalLM, \
                             Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM)"
                        ),
                    )
                })?
            }
            _ => {
                let t = f.str_or("model_type", "")?;
                Family::from_model_type(t).ok_or_else(|| {
                    err(
                        "architectures",
                        format!("missing, and model_type {t:?} is not a supported MoE family"),
                    )
                })?
            }
        };
        let d = f.usize_req("hidden_size")?;
        let n_heads = f.usize_req("num_attention_heads")?;
        if n_heads == 0 {
            return Err(err("num_attention_heads", "must be at least 1"));
        }
        let n_kv_heads = f.usize_or("num_key_value_heads", n_heads)?;
        let head_dim = f.usize_or("head_dim", d / n_heads)?;
        let act = f.str_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(err(
                "hidden_act",
                format!("{act:?}: only silu is supported"),
            ));
        }
        f.refuse_set("rope_scaling", "rope scaling is not supported")?;
        f.refuse_nonzero("attention_dropout", "dropout is not supported")?;
        let max_pos = f.usize_or("max_position_embeddings", 4096)?;
        let mut hf = HfModel {
            family,
            n_kv_heads,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta: rope_theta(&f, family)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            max_position_embeddings: max_pos,
            initializer_range: f.f64_or("initializer_range", 0.02)?,
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            norm_topk_prob: true,
            scoring: Scoring::Softmax,
            shared_ff: 0,
            shared_gate: false,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
            mla: None,
            bias_update_speed: 0.0,
            dense_layers: Vec::new(),
            dense_ff: 0,
            config_json: value.clone(),
        };
        let (experts, d_ff, aux_default) = match family {
            Family::Gpt => unreachable!("not an architecture name"),
            Family::Mixtral => {
                f.refuse_nonzero("router_jitter_noise", "router jitter is not supported")?;
                if f.present("sliding_window").is_some() {
                    let w = f.usize_req("sliding_window")?;
                    if w < max_pos {
                        return Err(err(
                            "sliding_window",
                            format!(
                                "{w} below max_position_embeddings {max_pos}: sliding-window \
                                 attention is not supported"
                            ),
                        ));
                    }
                }
                (
                    f.usize_req("num_local_experts")?,
                    f.usize_req("intermediate_size")?,
                    0.02,
                )
            }
            Family::Qwen2Moe | Family::Qwen3Moe => {
                if f.bool_or("use_sliding_window", false)? {
                    return Err(err(
                        "use_sliding_window",
                        "sliding-window attention is not supported",
                    ));
                }
                // `Qwen2MoeDecoderLayer`: block i is MoE unless it is in `mlp_only_layers` or
                // `(i + 1) % decoder_sparse_step != 0`.
                let step = f.usize_or("decoder_sparse_step", 1)?;
                if step == 0 {
                    return Err(err("decoder_sparse_step", "must be at least 1"));
                }
                let mlp_only: Vec<usize> = match f.present("mlp_only_layers") {
                    None => Vec::new(),
                    Some(v) => v
                        .as_array()
                        .and_then(|a| {
                            a.iter()
                                .map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
                                .collect::<Option<Vec<_>>>()
                        })
                        .ok_or_else(|| {
                            err(
                                "mlp_only_layers",
                                format!("must be a list of layer indices, got {v}"),
                            )
                        })?,
                };
                let blocks = f.usize_req("num_hidden_layers")?;
                if let Some(&i) = mlp_only.iter().find(|&&i| i >= blocks) {
                    return Err(err(
                        "mlp_only_layers",
                        format!("layer {i} is not below num_hidden_layers {blocks}"),
                    ));
                }
                hf.dense_layers = (0..blocks)
                    .filter(|i| mlp_only.contains(i) || (i + 1) % step != 0)
                    .collect();
                hf.norm_topk_prob = f.bool_or("norm_topk_prob", false)?;
                if family == Family::Qwen2Moe {
                    hf.qkv_bias = f.bool_or("qkv_bias", true)?;
                    hf.shared_ff = f.usize_or("shared_expert_intermediate_size", 0)?;
                    hf.shared_gate = hf.shared_ff > 0;
                } else {
                    let bias = f.bool_or("attention_bias", false)?;
                    hf.qkv_bias = bias;
                    hf.o_bias = bias;
                    hf.qk_norm = true;
                }
                (
                    f.usize_req("num_experts")?,
                    f.usize_req("moe_intermediate_size")?,
                    0.001,
                )
            }
            Family::DeepseekV3 => {
                // Defaults are `DeepseekV3Config`'s (what `transformers` builds from a file
                // that omits the field).
                hf.scoring = match f.str_or("scoring_func", "sigmoid")? {
                    "sigmoid" => Scoring::Sigmoid,
                    s => return Err(err("scoring_func", format!("{s:?}: only sigmoid"))),
                };
                let m = f.str_or("topk_method", "noaux_tc")?;
                if m != "noaux_tc" {
                    return Err(err("topk_method", format!("{m:?}: only noaux_tc")));
                }
                hf.norm_topk_prob = f.bool_or("norm_topk_prob", true)?;
                hf.n_group = f.usize_or("n_group", 8)?;
                hf.topk_group = f.usize_or("topk_group", 4)?;
                hf.routed_scaling_factor = f.f64_or("routed_scaling_factor", 2.5)?;
                hf.bias_update_speed = DEEPSEEK_BIAS_UPDATE_SPEED;
                let d_ff = f.usize_req("moe_intermediate_size")?;
                hf.shared_ff = f.usize_or("n_shared_experts", 1)? * d_ff;
                // `DeepseekV3DecoderLayer`: blocks below first_k_dense_replace are dense.
                let dense = f.usize_or("first_k_dense_replace", 3)?;
                hf.dense_layers = (0..dense.min(f.usize_req("num_hidden_layers")?)).collect();
                if hf.n_kv_heads != n_heads {
                    return Err(err(
                        "num_key_value_heads",
                        format!(
                            "{}: DeepSeek-V3's latent attention needs num_attention_heads \
                             ({n_heads})",
                            hf.n_kv_heads
                        ),
                    ));
                }
                let bias = f.bool_or("attention_bias", false)?;
                hf.qkv_bias = bias;
                hf.o_bias = bias;
                // `q_lora_rank: null` is a single q_proj; absent is the class default.
                let q_lora_rank = match map.get("q_lora_rank") {
                    Some(Value::Null) => None,
                    _ => Some(f.usize_or("q_lora_rank", 1536)?),
                };
                let mla = Mla {
                    q_lora_rank,
                    kv_lora_rank: f.usize_or("kv_lora_rank", 512)?,
                    qk_nope_head_dim: f.usize_or("qk_nope_head_dim", 128)?,
                    qk_rope_head_dim: f.usize_or("qk_rope_head_dim", 64)?,
                    v_head_dim: f.usize_or("v_head_dim", 128)?,
                    rope_interleave: f.bool_or("rope_interleave", true)?,
                };
                // The rotary tables span the decoupled rotary dims (`transformers` sets
                // `head_dim = qk_rope_head_dim`).
                hf.head_dim = mla.qk_rope_head_dim;
                hf.mla = Some(mla);
                (f.usize_req("n_routed_experts")?, d_ff, 0.0)
            }
        };
        let top_k = f.usize_req("num_experts_per_tok")?;
        let blocks = f.usize_req("num_hidden_layers")?;
        if !hf.dense_layers.is_empty() {
            hf.dense_ff = f.usize_req("intermediate_size")?;
        }
        let moe_blocks = blocks - hf.dense_layers.len();
        if blocks > 0 && moe_blocks == 0 {
            return Err(err(
                "num_hidden_layers",
                format!("all {blocks} layers are dense (non-MoE): there is no MoE layer to train"),
            ));
        }
        let mut cfg = MoeConfig {
            vocab: f.usize_req("vocab_size")?,
            d_model: d,
            n_layers: moe_blocks,
            n_heads,
            d_ff,
            experts,
            top_k,
            lb_loss_coef: f.f64_or("router_aux_loss_coef", aux_default)? * top_k as f64,
            hf: Some(Box::new(hf)),
            ..MoeConfig::tiny()
        };
        cfg.seq_len = cfg.seq_len.min(max_pos);
        cfg.validate()?;
        Ok(cfg)
    }

    /// This model with the training knobs of `base` (`seq_len`, `batch`, `lr`, `adam_beta2`,
    /// `grad_clip_norm`, `seed`, `precision`); the shape and `lb_loss_coef` stay this config's.
    pub fn with_training_of(self, base: &MoeConfig) -> MoeConfig {
        MoeConfig {
            seq_len: base.seq_len,
            batch: base.batch,
            lr: base.lr,
            adam_beta2: base.adam_beta2,
            grad_clip_norm: base.grad_clip_norm,
            seed: base.seed,
            precision: base.precision,
            ..self
        }
    }
}

impl HfModel {
    /// Shape checks of an HF family (called by [`MoeConfig::validate`]).
    pub(crate) fn validate(&self, cfg: &MoeConfig) -> Result<(), ConfigError> {
        let mla = self.mla.as_ref();
        for (name, v, max, what) in [
            (
                "num_key_value_heads",
                self.n_kv_heads,
                SizeLimits::HEADS,
                "heads",
            ),
            ("head_dim", self.head_dim, SizeLimits::WIDTH, "a width"),
            (
                "shared expert size",
                self.shared_ff,
                SizeLimits::WIDTH * SizeLimits::EXPERTS,
                "widths",
            ),
            (
                "intermediate_size",
                self.dense_ff,
                SizeLimits::WIDTH,
                "a width",
            ),
            (
                "dense layers",
                self.dense_layers.len(),
                SizeLimits::LAYERS,
                "layers",
            ),
            ("n_group", self.n_group, SizeLimits::EXPERTS, "experts"),
            (
                "kv_lora_rank",
                mla.map_or(0, |m| m.kv_lora_rank),
                SizeLimits::WIDTH,
                "a width",
            ),
            (
                "q_lora_rank",
                mla.and_then(|m| m.q_lora_rank).unwrap_or(0),
                SizeLimits::WIDTH,
                "a width",
            ),
            (
                "qk_nope_head_dim",
                mla.map_or(0, |m| m.qk_nope_head_dim),
                SizeLimits::WIDTH,
                "a width",
            ),
            (
                "qk_rope_head_dim",
                mla.map_or(0, |m| m.qk_rope_head_dim),
                SizeLimits::WIDTH,
                "a width",
            ),
            (
                "v_head_dim",
                mla.map_or(0, |m| m.v_head_dim),
                SizeLimits::WIDTH,
                "a width",
            ),
        ] {
            at_most(name, v, max, what)?;
        }
        if self.n_kv_heads == 0 || !cfg.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{} must divide num_attention_heads {}",
                    self.n_kv_heads, cfg.n_heads
                ),
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(err(
                "head_dim",
                format!("{} must be even and at least 2 (rotary)", self.head_dim),
            ));
        }
        if cfg.seq_len > self.max_position_embeddings {
            return Err(err(
                "max_position_embeddings",
                format!(
                    "{} is below the training seq_len {}",
                    self.max_position_embeddings, cfg.seq_len
                ),
            ));
        }
        if !(self.rms_norm_eps > 0.0 && self.rope_theta > 0.0 && self.initializer_range > 0.0) {
            return Err(err(
                "rms_norm_eps",
                "rms_norm_eps, rope_theta and initializer_range must be > 0",
            ));
        }
        if self.n_group == 0
            || !cfg.experts.is_multiple_of(self.n_group)
            || self.topk_group == 0
            || self.topk_group > self.n_group
        {
            return Err(err(
                "n_group",
                format!(
                    "n_group {} must divide the experts {} and topk_group {} be in 1..=n_group",
                    self.n_group, cfg.experts, self.topk_group
                ),
            ));
        }
        let blocks = self.n_blocks(cfg);
        if !self.dense_layers.windows(2).all(|w| w[0] < w[1])
            || self.dense_layers.iter().any(|&i| i >= blocks)
            || (!self.dense_layers.is_empty() && self.dense_ff == 0)
        {
            return Err(err(
                "num_hidden_layers",
                format!(
                    "dense layers {:?} of {blocks} must be distinct, ascending and below it, \
                     with an intermediate_size",
                    self.dense_layers
                ),
            ));
        }
        if self.scoring == Scoring::Sigmoid {
            let per_group = cfg.experts / self.n_group;
            if per_group < 2 || cfg.top_k > self.topk_group * per_group {
                return Err(err(
                    "n_group",
                    format!(
                        "{} groups of {per_group} experts: each group needs at least 2 and the \
                         best topk_group {} groups at least top_k {} experts",
                        self.n_group, self.topk_group, cfg.top_k
                    ),
                ));
            }
        }
        if let Some(m) = &self.mla {
            let dims = [
                ("kv_lora_rank", m.kv_lora_rank),
                ("qk_nope_head_dim", m.qk_nope_head_dim),
                ("v_head_dim", m.v_head_dim),
                ("q_lora_rank", m.q_lora_rank.unwrap_or(1)),
            ];
            if let Some((k, _)) = dims.iter().find(|(_, v)| *v == 0) {
                return Err(err(k, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// Parameters replicated on every worker (embeddings, LM head unless tied, attention,
    /// norms, routers, shared experts).
    pub(crate) fn dense_params(&self, cfg: &MoeConfig) -> usize {
        let d = cfg.d_model;
        let mut per_layer = 2 * d // input / post-attention norms
            + self.attention_params(cfg)
            + d * cfg.experts; // router
        per_layer += 3 * d * self.shared_ff;
        if self.shared_gate {
            per_layer += d;
        }
        if self.family == Family::DeepseekV3 {
            per_layer += cfg.experts; // e_score_correction_bias
        }
        let dense_block = 2 * d + self.attention_params(cfg) + 3 * d * self.dense_ff;
        let head = if self.tie_word_embeddings {
            0
        } else {
            cfg.vocab * d
        };
        cfg.vocab * d + head + cfg.n_layers * per_layer + self.dense_layers.len() * dense_block + d
    }

    /// Transformer blocks: the `n_layers` MoE blocks and the dense ones.
    pub fn n_blocks(&self, cfg: &MoeConfig) -> usize {
        cfg.n_layers + self.dense_layers.len()
    }

    /// The block of MoE layer `moe_layer` (the `moe_layer`-th block that is not dense).
    pub fn block_of(&self, moe_layer: usize) -> usize {
        let mut block = moe_layer;
        for &d in &self.dense_layers {
            if d <= block {
                block += 1;
            }
        }
        block
    }

    /// Weights and biases of one layer's attention (q, k, v, o and their norms; MLA's
    /// projections and latent norms).
    pub(crate) fn attention_params(&self, cfg: &MoeConfig) -> usize {
        let (d, h) = (cfg.d_model, cfg.n_heads);
        if let Some(m) = &self.mla {
            let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let q = match m.q_lora_rank {
                None => d * h * qk,
                Some(r) => d * r + r + r * h * qk + if self.qkv_bias { r } else { 0 },
            };
            let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
            let kv = d * kv_a
                + if self.qkv_bias { kv_a } else { 0 }
                + m.kv_lora_rank
                + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim);
            let o = h * m.v_head_dim * d + if self.o_bias { d } else { 0 };
            return q + kv + o;
        }
        let (q, kv) = (h * self.head_dim, self.n_kv_heads * self.head_dim);
        let mut n = d * (q + 2 * kv) + q * d;
        if self.qkv_bias {
            n += q + 2 * kv;
        }
        if self.o_bias {
            n += d;
        }
        if self.qk_norm {
            n += 2 * self.head_dim;
        }
        n
    }

    /// Weights of one layer's attention products (no norms, no biases).
    pub(crate) fn attention_matmul_params(&self, cfg: &MoeConfig) -> usize {
        let (d, h) = (cfg.d_model, cfg.n_heads);
        match &self.mla {
            Some(m) => {
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                let q = m.q_lora_rank.map_or(d * h * qk, |r| d * r + r * h * qk);
                q + d * (m.kv_lora_rank + m.qk_rope_head_dim)
                    + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
                    + h * m.v_head_dim * d
            }
            None => {
                let (q, kv) = (h * self.head_dim, self.n_kv_heads * self.head_dim);
                d * (q + 2 * kv) + q * d
            }
        }
    }

    /// The routing-bias tensor of `layer` (DeepSeek-V3 `e_score_correction_bias`, `[E]`).
    pub fn routing_bias_name(&self, layer: usize) -> String {
        format!("{}.gate.e_score_correction_bias", self.moe_prefix(layer))
    }

    /// `model.layers.{block}.block_sparse_moe` (Mixtral) or `model.layers.{block}.mlp` of MoE
    /// layer `layer` (its block: [`Self::block_of`]).
    pub fn moe_prefix(&self, layer: usize) -> String {
        let block = self.block_of(layer);
        match self.family {
            Family::Mixtral => format!("model.layers.{block}.block_sparse_moe"),
            _ => format!("model.layers.{block}.mlp"),
        }
    }

    /// The router's tensor name, `[E, d]`.
    pub fn router_name(&self, layer: usize) -> String {
        format!("{}.gate.weight", self.moe_prefix(layer))
    }

    /// The Hugging Face names of routed expert `(layer, expert)`'s gate, up and down
    /// projections (shapes `[ff, d]`, `[ff, d]`, `[d, ff]`): `w1` columns `0..ff` are the
    /// gate's transpose, columns `ff..2·ff` the up's, `w2` the down's transpose.
    pub fn expert_tensor_names(&self, layer: usize, expert: usize) -> [String; 3] {
        let p = format!("{}.experts.{expert}", self.moe_prefix(layer));
        match self.family {
            Family::Mixtral => [
                format!("{p}.w1.weight"),
                format!("{p}.w3.weight"),
                format!("{p}.w2.weight"),
            ],
            _ => [
                format!("{p}.gate_proj.weight"),
                format!("{p}.up_proj.weight"),
                format!("{p}.down_proj.weight"),
            ],
        }
    }

    /// Prefix of MoE layer `layer`'s shared expert MLP (`{gate,up,down}_proj.weight` below
    /// it), if any.
    pub fn shared_prefix(&self, layer: usize) -> Option<String> {
        let p = self.moe_prefix(layer);
        (self.shared_ff > 0).then(|| match self.family {
            Family::DeepseekV3 => format!("{p}.shared_experts"),
            _ => format!("{p}.shared_expert"),
        })
    }

    /// Whether the routers carry DeepSeek-V3's `e_score_correction_bias`.
    pub fn has_routing_bias(&self) -> bool {
        self.family == Family::DeepseekV3 || self.bias_update_speed > 0.0
    }
}
