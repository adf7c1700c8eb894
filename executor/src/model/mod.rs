//! The MoE model of the executor, split so that experts can live on other workers: the
//! paper's GPT-style family, or a Hugging Face family (Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V3) read from its
//! `config.json` (`hf`: [`MoeConfig::from_hf_config_json`], names and layouts of `transformers`).
//!
//! * [`DenseModel`] — everything every worker replicates (embeddings, causal self-attention,
//!   layer norms, one router per MoE layer, final norm, tied LM head) in a candle `VarMap`,
//!   initialised from `(seed, name)` so all workers start bit-identical.
//! * [`ExpertStore`] — only the expert replicas this worker's plan assigns, each with its own
//!   [`AdamW`] state; [`ExpertStore::export`] / [`ExpertStore::import`] move a replica
//!   (weights + moments + step) and [`ExpertStore::checksum`] proves two copies identical.
//! * [`ExpertExec`] — how routed tokens reach the experts: [`LocalExperts`] computes with the
//!   local store; the distributed runtime plugs in its all-to-all.
//! * [`ShardStore`] — FSEP: this rank's shard copies of every expert with their AdamW state
//!   ([`ExpertMode`]).
//! * [`ShadowReplica`] — catches a replica copied at an earlier step up with the updates its
//!   holders applied since (the building block of replicated re-layout without a pause).
//! * [`Trainer`] — the single-worker reference loop on the byte-level [`Corpus`].
//!
//! Routing: `softmax(x·W_r)` over the experts (the differentiable `ops::softmax`), top-k on the
//! host (ties to the lower id), gates renormalised over the chosen experts when `k ≥ 2` and the
//! raw probability when `k = 1` (Switch; a renormalised single gate would be constantly 1 and
//! the router would learn only from the balancing loss), Switch load-balancing loss
//! `E·Σ_e frac_e·mean_prob_e` averaged over layers and weighted by `lb_loss_coef`. Routing can
//! be replayed with [`DenseModel::set_forced_routing`].
mod config;
mod data;
mod dense;
mod experts;
pub mod fingerprint;
mod flops;
mod fsep;
mod fused;
mod hf;
mod init;
mod optim;
mod shadow;
mod train;

pub use config::{ConfigError, Family, HfModel, MoeConfig, Precision, SizeLimits};
pub use data::{ByteTokenizer, Corpus, EMBEDDED_CORPUS};
pub use dense::{
    DenseModel, MoeOutput, RoutingStats, apply_rope, deinterleave, moe_layer, rms_norm,
};
pub use experts::{
    ExpertExec, ExpertState, ExpertStore, ExpertWeights, LocalExperts, sigmoid, silu,
};
pub use flops::{active_matmul_params_per_token, model_flops_per_token};
pub use fsep::{ExpertMode, ShardState, ShardStore, assemble, cut, one_per_rank, shard_range};
pub use fused::{gelu, set_fused_kernels, swiglu};
pub use hf::Mla;
pub use hf::Scoring;
pub use init::Fnv64;
pub(crate) use init::rng_for;
pub use optim::{AdamW, OptimState, ParamState, ParamsAdamW, grad_scale, scale_grad, sq_norm};
pub use shadow::ShadowReplica;
pub use train::{StepReport, Trainer, apply_update, grad_norm_parts};
