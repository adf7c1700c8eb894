//! Shape and training hyper-parameters of the MoE model: the paper's GPT-style family
//! (the default) or a Hugging Face family read from its `config.json`
//! ([`MoeConfig::from_hf_config_json`], [`HfModel`]).

use serde::{Deserialize, Serialize};

pub use super::hf::{Family, HfModel};

/// Why a [`MoeConfig`] cannot build a model. Each variant names the offending quantity.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{name} must be at least 1 (got 0)")]
    Zero { name: &'static str },
    #[error("d_model {d_model} is not divisible by n_heads {n_heads}")]
    HeadSplit { d_model: usize, n_heads: usize },
    #[error("top_k must be in 1..=experts ({experts}), got {top_k}")]
    TopK { top_k: usize, experts: usize },
    #[error("vocab {vocab} does not fit in u32 token ids")]
    Vocab { vocab: usize },
    /// A hyper-parameter that is NaN, infinite or out of its range: it would poison every
    /// weight at the first update (and NaN does not even survive the JSON the job is sent in).
    #[error("{name} must be a finite number {range} (got {value})")]
    Number {
        name: &'static str,
        value: f64,
        range: &'static str,
    },
    #[error("precision must be auto, f32 or bf16 (got {0:?})")]
    Precision(String),
    /// A Hugging Face `config.json` field that is missing, malformed or asks for something the
    /// executor does not implement (it refuses rather than train another model).
    #[error("config.json: {field}: {why}")]
    Hf { field: String, why: String },
    /// A size beyond what the executor takes ([`SizeLimits`]): the model's arithmetic and its
    /// allocations would overflow long before a machine could hold it.
    #[error("{name} {value} is more than {max}, the most lzrun takes ({what})")]
    TooLarge {
        name: &'static str,
        value: usize,
        max: usize,
        what: &'static str,
    },
}

/// The largest sizes a model may have, each well beyond the models in use (DeepSeek-V3: 7,168
/// wide, 61 layers, 256 experts, 128 heads). Within them every parameter count of
/// [`MoeConfig`] (degree-3 products of these sizes, times the layers) fits in a `u64` with room
/// to spare: an adversarial `config.json` (`hidden_size` 2^62, 2^40 experts, 10^12 layers)
/// used to panic with "capacity overflow" or abort on the allocation instead of being refused.
pub struct SizeLimits;

impl SizeLimits {
    /// A width: `d_model`, `d_ff`, intermediate sizes, head and latent dimensions.
    pub const WIDTH: usize = 1 << 17;
    /// Attention heads (query or key/value).
    pub const HEADS: usize = 1 << 10;
    /// Routed experts per layer (also shared experts, groups, `top_k`).
    pub const EXPERTS: usize = 1 << 12;
    /// Transformer blocks (MoE and dense).
    pub const LAYERS: usize = 1 << 10;
    /// Positions per training sequence, and sequences per step and worker.
    pub const SEQUENCE: usize = 1 << 20;
}

/// `value` of `name` at most `max`, else [`ConfigError::TooLarge`].
pub(crate) fn at_most(
    name: &'static str,
    value: usize,
    max: usize,
    what: &'static str,
) -> Result<(), ConfigError> {
    if value > max {
        return Err(ConfigError::TooLarge {
            name,
            value,
            max,
            what,
        });
    }
    Ok(())
}

/// The arithmetic of the matrix products in the forward and backward passes (mixed precision).
///
/// Master weights, AdamW moments, the gradients the optimizer sees, the router, layer norms,
/// softmaxes and the loss stay f32 in every mode: `bf16` only rounds the operands and results
/// of the products (PyTorch autocast's rule for matmuls; cuBLAS and candle's CPU path both
/// accumulate in f32). A checkpoint holds f32 state either way, so a run may resume in another
/// precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 on a CUDA device, f32 on the CPU (where candle has no bf16 kernel: it widens bf16
    /// products to f32, so bf16 there only adds conversions — use `bf16` to reproduce a GPU
    /// run's rounding on a CPU).
    #[default]
    Auto,
    F32,
    Bf16,
}

impl Precision {
    /// `auto`, `f32` or `bf16`.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        match s {
            "auto" => Ok(Self::Auto),
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            _ => Err(ConfigError::Precision(s.to_owned())),
        }
    }

    /// What this setting means on `device`: [`Precision::F32`] or [`Precision::Bf16`].
    pub fn on(self, device: &candle_core::Device) -> Self {
        match self {
            Self::Auto if device.is_cuda() => Self::Bf16,
            Self::Auto => Self::F32,
            p => p,
        }
    }

    /// `a·b` in this precision (resolved with [`Precision::on`]; `Auto` computes in f32):
    /// in `Bf16` both operands are rounded to bf16 and the f32-accumulated product is rounded
    /// to bf16 and returned as f32. Differentiable: the gradients reaching f32 variables are f32.
    pub fn matmul(
        self,
        a: &candle_core::Tensor,
        b: &candle_core::Tensor,
    ) -> candle_core::Result<candle_core::Tensor> {
        use candle_core::DType;
        match self {
            Self::Bf16 => a
                .to_dtype(DType::BF16)?
                .matmul(&b.to_dtype(DType::BF16)?)?
                .to_dtype(DType::F32),
            Self::Auto | Self::F32 => a.matmul(b),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        })
    }
}

/// Model shape plus the few training knobs the executor needs.
///
/// Every one of the `n_layers` transformer blocks has an MoE feed-forward (`experts` experts of
/// `d_model → d_ff → d_model`, GELU) chosen by a router `Linear(d_model, experts)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub d_ff: usize,
    pub experts: usize,
    /// Experts per token: 1 (Switch) or 2 (GShard); any `1..=experts` works.
    pub top_k: usize,
    /// Positions per training sequence (the model predicts `seq_len` next tokens from
    /// `seq_len + 1` sampled tokens).
    pub seq_len: usize,
    /// Sequences per step and worker.
    pub batch: usize,
    /// Weight of the Switch load-balancing loss (mean over layers); 0 disables it.
    pub lb_loss_coef: f64,
    /// AdamW learning rate (dense parameters and every expert replica).
    pub lr: f64,
    /// AdamW second-moment decay β2 (β1 is 0.9, ε 1e-8, weight decay 0.01). A file or
    /// checkpoint manifest without it means 0.999 (candle's default, the recipe before it was
    /// a field).
    #[serde(default = "default_adam_beta2")]
    pub adam_beta2: f64,
    /// Largest global L2 norm of the step's gradient (dense and every expert together, after
    /// the mean over the members); a larger gradient is scaled down to it. 0 disables clipping
    /// (also what a file or manifest without the field means).
    #[serde(default)]
    pub grad_clip_norm: f64,
    pub seed: u64,
    /// Mixed precision of the matrix products ([`Precision`]); a file or checkpoint manifest
    /// without it means `auto`.
    #[serde(default)]
    pub precision: Precision,
    /// The Hugging Face family and its architecture fields when the model comes from a
    /// `config.json` ([`MoeConfig::from_hf_config_json`]); `None` (absent from old files, job
    /// JSON and checkpoint manifests) is the GPT-style model. For an HF family `d_ff` is the
    /// routed experts' intermediate size (`intermediate_size` for Mixtral,
    /// `moe_intermediate_size` for Qwen-MoE and DeepSeek-V3) and `n_heads` the query heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf: Option<Box<HfModel>>,
}

fn default_adam_beta2() -> f64 {
    0.999
}

impl MoeConfig {
    /// A byte-level model that trains visibly in well under a minute on 2 CPU cores (release).
    ///
    /// Recipe: lr 1e-3, gradient clipping at global norm 1.0 (of the mean over the members).
    /// At lr 3e-3 with summed gradients and no clipping it trained faster but about one run in
    /// six with faults had a one-step loss spike after a change of membership (README, "Known
    /// limits").
    pub fn tiny() -> Self {
        Self {
            vocab: 256,
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            d_ff: 128,
            experts: 4,
            top_k: 2,
            seq_len: 32,
            batch: 8,
            lb_loss_coef: 0.01,
            lr: 1e-3,
            adam_beta2: 0.999,
            grad_clip_norm: 1.0,
            seed: 0,
            precision: Precision::Auto,
            hf: None,
        }
    }

    /// The paper's GPT-S (Lazarus §6.1): 12 layers, d 768, 8 experts, top-1.
    pub fn gpt_s() -> Self {
        Self::gpt(768, 12, 8)
    }

    /// The paper's GPT-M: 12 layers, d 1024, 12 experts, top-1.
    pub fn gpt_m() -> Self {
        Self::gpt(1024, 16, 12)
    }

    /// The paper's GPT-L: 12 layers, d 1024, 16 experts, top-1.
    pub fn gpt_l() -> Self {
        Self::gpt(1024, 16, 16)
    }

    /// GPT-2 vocabulary, 12 layers, head size 64, `d_ff = 4·d`, seq 1024, batch 4, top-1.
    fn gpt(d_model: usize, n_heads: usize, experts: usize) -> Self {
        Self {
            vocab: 50257,
            d_model,
            n_layers: 12,
            n_heads,
            d_ff: 4 * d_model,
            experts,
            top_k: 1,
            seq_len: 1024,
            batch: 4,
            lb_loss_coef: 0.01,
            lr: 1e-4,
            adam_beta2: 0.999,
            grad_clip_norm: 1.0,
            seed: 0,
            precision: Precision::Auto,
            hf: None,
        }
    }

    /// The model family: [`Family::Gpt`] unless the config came from a `config.json`.
    pub fn family(&self) -> Family {
        self.hf.as_ref().map_or(Family::Gpt, |h| h.family)
    }

    /// Whether routed experts are SwiGLU (`w1` holds the gate and up projections side by side).
    pub fn gated_experts(&self) -> bool {
        self.hf.is_some()
    }

    /// Columns of an expert's `w1`: `d_ff` for the GPT family's GELU experts, `2·d_ff` for a
    /// SwiGLU family (gate projection in columns `0..d_ff`, up projection in `d_ff..2·d_ff`).
    pub fn w1_cols(&self) -> usize {
        if self.gated_experts() {
            2 * self.d_ff
        } else {
            self.d_ff
        }
    }

    /// Checks that the shape can be built and that the learning rate, the Adam β2, the clipping
    /// norm and the load-balancing coefficient are finite and in range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
            ("experts", self.experts),
            ("seq_len", self.seq_len),
            ("batch", self.batch),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { name });
            }
        }
        for (name, v, max, what) in [
            ("d_model", self.d_model, SizeLimits::WIDTH, "a width"),
            ("d_ff", self.d_ff, SizeLimits::WIDTH, "a width"),
            ("n_heads", self.n_heads, SizeLimits::HEADS, "heads"),
            (
                "experts",
                self.experts,
                SizeLimits::EXPERTS,
                "experts per layer",
            ),
            ("n_layers", self.n_layers, SizeLimits::LAYERS, "layers"),
            ("seq_len", self.seq_len, SizeLimits::SEQUENCE, "positions"),
            ("batch", self.batch, SizeLimits::SEQUENCE, "sequences"),
        ] {
            at_most(name, v, max, what)?;
        }
        if let Some(hf) = &self.hf {
            hf.validate(self)?;
        } else if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ConfigError::HeadSplit {
                d_model: self.d_model,
                n_heads: self.n_heads,
            });
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(ConfigError::TopK {
                top_k: self.top_k,
                experts: self.experts,
            });
        }
        if u32::try_from(self.vocab).is_err() {
            return Err(ConfigError::Vocab { vocab: self.vocab });
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(ConfigError::Number {
                name: "lr",
                value: self.lr,
                range: "> 0",
            });
        }
        if !(self.adam_beta2.is_finite() && (0.0..1.0).contains(&self.adam_beta2)) {
            return Err(ConfigError::Number {
                name: "adam_beta2",
                value: self.adam_beta2,
                range: "in [0, 1)",
            });
        }
        if !(self.grad_clip_norm.is_finite() && self.grad_clip_norm >= 0.0) {
            return Err(ConfigError::Number {
                name: "grad_clip_norm",
                value: self.grad_clip_norm,
                range: ">= 0",
            });
        }
        if !(self.lb_loss_coef.is_finite() && self.lb_loss_coef >= 0.0) {
            return Err(ConfigError::Number {
                name: "lb_loss_coef",
                value: self.lb_loss_coef,
                range: ">= 0",
            });
        }
        Ok(())
    }

    /// The AdamW hyper-parameters of every optimizer of the model (the dense one and each
    /// expert replica's): `lr`, `adam_beta2`, otherwise candle's defaults.
    pub fn adam_params(&self) -> candle_nn::ParamsAdamW {
        candle_nn::ParamsAdamW {
            lr: self.lr,
            beta2: self.adam_beta2,
            ..candle_nn::ParamsAdamW::default()
        }
    }

    /// Parameters of one routed expert (`w1` + `w2`, no biases; `3·d·d_ff` for SwiGLU).
    pub fn expert_params(&self) -> usize {
        (self.w1_cols() + self.d_ff) * self.d_model
    }

    /// Parameters replicated on every worker: embeddings (LM head tied to the token
    /// embedding), attention, layer norms, routers, final norm.
    pub fn dense_params(&self) -> usize {
        if let Some(hf) = &self.hf {
            return hf.dense_params(self);
        }
        let d = self.d_model;
        let per_layer = 2 * 2 * d // ln1, ln2
            + 3 * d * d + 3 * d // qkv
            + d * d + d // proj
            + d * self.experts; // router
        self.vocab * d + self.seq_len * d + self.n_layers * per_layer + 2 * d
    }

    /// Bytes of one expert replica's training state in f32: weights plus two AdamW moments.
    pub fn expert_state_bytes(&self) -> usize {
        3 * 4 * self.expert_params()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tiny`'s `config.json` with `fields` replaced.
    fn hf(tiny: &str, fields: &[(&str, u64)]) -> Result<MoeConfig, ConfigError> {
        let mut v: serde_json::Value = serde_json::from_str(tiny).unwrap();
        for &(k, x) in fields {
            v[k] = x.into();
        }
        MoeConfig::from_hf_config_json(&v.to_string())
    }

    const DEEPSEEK: &str = include_str!("../../configs/deepseek-v3-tiny.json");
    const MIXTRAL: &str = include_str!("../../configs/mixtral-tiny.json");

    /// The limits leave room for the models in use: DeepSeek-V3's shape (its `config.json`
    /// less the YaRN `rope_scaling` this executor refuses) and Mixtral 8x22B's are accepted.
    #[test]
    fn the_shapes_of_models_in_use_are_within_the_limits() {
        let deepseek = [
            ("vocab_size", 129_280),
            ("hidden_size", 7_168),
            ("intermediate_size", 18_432),
            ("moe_intermediate_size", 2_048),
            ("num_hidden_layers", 61),
            ("first_k_dense_replace", 3),
            ("num_attention_heads", 128),
            ("num_key_value_heads", 128),
            ("q_lora_rank", 1_536),
            ("kv_lora_rank", 512),
            ("qk_nope_head_dim", 128),
            ("qk_rope_head_dim", 64),
            ("v_head_dim", 128),
            ("n_routed_experts", 256),
            ("num_experts_per_tok", 8),
            ("n_group", 8),
            ("topk_group", 4),
            ("max_position_embeddings", 163_840),
        ];
        let cfg = hf(DEEPSEEK, &deepseek).unwrap();
        assert_eq!((cfg.experts, cfg.n_layers), (256, 58));
        // 671 B parameters in all, as published.
        let total = cfg.dense_params() + cfg.n_layers * cfg.experts * cfg.expert_params();
        assert!((670e9..673e9).contains(&(total as f64)), "{total}");
        let mixtral = [
            ("vocab_size", 32_768),
            ("hidden_size", 6_144),
            ("intermediate_size", 16_384),
            ("num_hidden_layers", 56),
            ("num_attention_heads", 48),
            ("num_key_value_heads", 8),
            ("num_local_experts", 8),
            ("max_position_embeddings", 65_536),
        ];
        hf(MIXTRAL, &mixtral).unwrap();
    }

    /// Issue 43, item 6: sizes beyond the limits are refused naming the field, before anything
    /// is computed from them (they overflowed or allocated first).
    #[test]
    fn sizes_beyond_the_limits_are_refused_naming_the_field() {
        for (tiny, field, value) in [
            (MIXTRAL, "hidden_size", 1u64 << 62),
            (MIXTRAL, "num_local_experts", 1 << 40),
            (MIXTRAL, "num_hidden_layers", 1_000_000_000_000),
            (MIXTRAL, "vocab_size", 1 << 33),
            (DEEPSEEK, "n_shared_experts", 1 << 62),
            (DEEPSEEK, "kv_lora_rank", 1 << 62),
            (DEEPSEEK, "first_k_dense_replace", u64::MAX),
        ] {
            let e = hf(tiny, &[(field, value)]).unwrap_err().to_string();
            assert!(e.contains(&format!("{field}: {value} is more than")), "{e}");
        }
        let mut cfg = MoeConfig::tiny();
        cfg.n_layers = 1 << 40;
        assert_eq!(
            cfg.validate().unwrap_err().to_string(),
            "n_layers 1099511627776 is more than 1024, the most lzrun takes (layers)"
        );
    }
}
