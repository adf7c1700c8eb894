//! Model FLOPs per trained token, the numerator of the model-FLOPs utilisation (MFU).
//!
//! "Model FLOPs" count what the model needs, not what the implementation executes: no
//! activation recomputation, no padding or capacity slack, only matrix products. Each weight
//! that takes part in a product costs 2 FLOPs per token forward and 4 backward (the gradients
//! of its input and of the weight), so training costs `6 · active parameters` per token
//! (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
//! Using Megatron-LM", §5.1 and Appendix, Eq. (3) without its recomputation term; Chowdhery
//! et al. 2022, "PaLM", Appendix B). The attention scores `QKᵀ` and their use `AV` have no
//! weights: `2 · seq_len · d_model` FLOPs each per token and layer forward, three times that
//! with the backward, so `12 · n_layers · d_model · seq_len` (PaLM Appendix B; the causal mask
//! is not exploited, as in both papers).
//!
//! An MoE token is only multiplied by the `top_k` experts it is routed to, so the active
//! parameters are the dense matrices plus `top_k` experts per layer. It is the formula the
//! simulator costs steps with (`lazarus_simulator::cost::ModelProfile`), so measured MFU and
//! simulated step times rest on the same count.

use super::MoeConfig;

/// Weights of the matrix products one token goes through in a training step of `cfg`'s model:
/// per layer the attention (`qkv` `3·d²` and the output projection `d²`), the router (`d·E`)
/// and `top_k` experts (`2·d·d_ff` each); then the LM head (`vocab·d`, tied to the token
/// embedding but still a product). Not counted: the embedding lookups (token and position: a
/// gather, no product), biases and layer norms (elementwise, a vanishing share of the FLOPs).
pub fn active_matmul_params_per_token(cfg: &MoeConfig) -> u64 {
    if let Some(hf) = &cfg.hf {
        // A Hugging Face family: the attention's projections (q, k, v, o of grouped-query
        // attention; MLA's low-rank ones), the router, `top_k` SwiGLU experts (`3·d·d_ff`),
        // the shared expert (`3·d·shared_ff` and its gate `d`), and the LM head (tied or not,
        // one product).
        let d = cfg.d_model as u64;
        let shared = 3 * d * hf.shared_ff as u64 + if hf.shared_gate { d } else { 0 };
        let per_layer = hf.attention_matmul_params(cfg) as u64
            + d * cfg.experts as u64
            + cfg.top_k as u64 * cfg.expert_params() as u64
            + shared;
        // Dense blocks: their attention and a SwiGLU MLP of `dense_ff`.
        let dense_block = hf.attention_matmul_params(cfg) as u64 + 3 * d * hf.dense_ff as u64;
        return cfg.n_layers as u64 * per_layer
            + hf.dense_layers.len() as u64 * dense_block
            + cfg.vocab as u64 * d;
    }
    let d = cfg.d_model as u64;
    let per_layer = 4 * d * d + d * cfg.experts as u64 + cfg.top_k as u64 * 2 * d * cfg.d_ff as u64;
    cfg.n_layers as u64 * per_layer + cfg.vocab as u64 * d
}

/// Training FLOPs per token (forward and backward) of `cfg`'s model, by the Megatron / PaLM
/// model-FLOPs convention (see the module docs): `6 · active parameters + 12 · n_layers ·
/// d_model · seq_len`. Multiply by tokens per second for the model FLOP/s of a run.
pub fn model_flops_per_token(cfg: &MoeConfig) -> f64 {
    // The score products' width is heads · head_dim (d_model for the GPT family); MLA's
    // `QKᵀ` is `heads·(nope + rope)` wide and its `AV` `heads·v`, so their mean. Every
    // block attends, dense ones too.
    let blocks = cfg.hf.as_ref().map_or(cfg.n_layers, |h| h.n_blocks(cfg));
    let width = cfg
        .hf
        .as_ref()
        .map_or(cfg.d_model as f64, |h| match &h.mla {
            None => (cfg.n_heads * h.head_dim) as f64,
            Some(m) => {
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                (cfg.n_heads * (qk + m.v_head_dim)) as f64 / 2.0
            }
        });
    6.0 * active_matmul_params_per_token(cfg) as f64
        + 12.0 * blocks as f64 * width * cfg.seq_len as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tiny` by hand: d 64, 2 layers, 4 experts, top-2, d_ff 128, vocab 256, seq 32.
    /// Per layer: attention 4·64² = 16384, router 64·4 = 256, two experts 2·2·64·128 = 32768,
    /// so 49408; two layers 98816; LM head 256·64 = 16384; 115200 active weights.
    /// 6 · 115200 = 691200, attention scores 12·2·64·32 = 49152: 740352 FLOPs per token.
    #[test]
    fn tiny_by_hand() {
        let cfg = MoeConfig::tiny();
        assert_eq!(active_matmul_params_per_token(&cfg), 115_200);
        assert_eq!(model_flops_per_token(&cfg), 740_352.0);
    }

    /// Only the routed experts count: top-1 drops one expert per layer, more experts add only
    /// router weights.
    #[test]
    fn only_routed_experts_count() {
        let tiny = MoeConfig::tiny();
        let top1 = MoeConfig {
            top_k: 1,
            ..tiny.clone()
        };
        let expert = 6.0 * tiny.expert_params() as f64 * tiny.n_layers as f64;
        assert_eq!(
            model_flops_per_token(&tiny) - model_flops_per_token(&top1),
            expert
        );
        let wide = MoeConfig {
            experts: 8,
            ..tiny.clone()
        };
        let router = 6.0 * (4 * tiny.d_model * tiny.n_layers) as f64;
        assert_eq!(
            model_flops_per_token(&wide) - model_flops_per_token(&tiny),
            router
        );
    }

    /// GPT-S (d 768, 12 layers, 8 experts, top-1, d_ff 3072, vocab 50257, seq 1024): the
    /// order of magnitude a reader can check against "6 · params": about 0.85 GFLOPs per token.
    #[test]
    fn gpt_s_is_under_a_gigaflop_per_token() {
        let f = model_flops_per_token(&MoeConfig::gpt_s());
        let active = 12 * (4 * 768 * 768 + 768 * 8 + 2 * 768 * 3072) + 50257 * 768;
        assert_eq!(f, 6.0 * active as f64 + 12.0 * 12.0 * 768.0 * 1024.0);
        assert!((0.8e9..0.9e9).contains(&f), "{f}");
    }
}
