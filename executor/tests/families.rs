//! Issue 32: Hugging Face model families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) from a `config.json`.
//! Config parsing and refusals, `transformers` names and shapes, finite-difference checks of
//! every new op's gradient, and training that lowers the loss.

use candle_core::{DType, Device, Result, Tensor, Var};
use lazarus_executor::model::{
    ConfigError, DenseModel, ExpertStore, ExpertWeights, Family, LocalExperts, MoeConfig,
    Precision, RoutingStats, Trainer, apply_rope, deinterleave, rms_norm, sigmoid, silu, swiglu,
};

/// A tiny Mixtral-style `config.json` (byte vocabulary, GQA 4 query / 2 kv heads, 4 experts
/// top-2, untied head).
pub fn mixtral_json() -> String {
    serde_json::json!({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "router_aux_loss_coef": 0.02, "hidden_act": "silu",
        "sliding_window": null, "initializer_range": 0.02
    })
    .to_string()
}

fn qwen2_json() -> String {
    serde_json::json!({
        "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": false,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": false, "use_sliding_window": false
    })
    .to_string()
}

fn qwen3_json() -> String {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "head_dim": 16,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "attention_bias": false
    })
    .to_string()
}

/// A tiny DeepSeek-V3-style `config.json`: multi-head latent attention (low-rank queries,
/// interleaved rotary dims), 8 routed experts in 4 groups (best 2 groups, top-2), sigmoid
/// scores scaled by 2.5, one shared expert, every layer MoE.
pub fn deepseek_json() -> String {
    serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 0,
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 8, "rope_interleave": true, "head_dim": 4,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "attention_bias": false, "initializer_range": 0.02
    })
    .to_string()
}

/// [`deepseek_json`] with a single `q_proj` (`q_lora_rank: null`), the `rotate_half` rotary
/// layout and attention biases.
fn deepseek_full_q_json() -> String {
    let j = with(&deepseek_json(), "q_lora_rank", serde_json::Value::Null);
    let j = with(&j, "rope_interleave", serde_json::json!(false));
    with(&j, "attention_bias", serde_json::json!(true))
}

fn with(json: &str, key: &str, value: serde_json::Value) -> String {
    let mut v: serde_json::Value = serde_json::from_str(json).unwrap();
    v[key] = value;
    v.to_string()
}

fn refused(json: &str, field: &str) {
    match MoeConfig::from_hf_config_json(json) {
        Err(ConfigError::Hf { field: f, why }) => {
            assert_eq!(f, field, "refused for {f}: {why}");
            assert!(!why.contains('\n'));
        }
        other => panic!("expected a refusal naming {field}, got {other:?}"),
    }
}

#[test]
fn mixtral_config_reads_the_hf_fields() {
    let c = MoeConfig::from_hf_config_json(&mixtral_json()).unwrap();
    assert_eq!(c.family(), Family::Mixtral);
    assert_eq!(
        (
            c.vocab, c.d_model, c.n_layers, c.n_heads, c.d_ff, c.experts, c.top_k
        ),
        (256, 32, 2, 4, 48, 4, 2)
    );
    let hf = c.hf.as_ref().unwrap();
    assert_eq!((hf.n_kv_heads, hf.head_dim), (2, 8));
    assert_eq!(hf.rms_norm_eps, 1e-5);
    assert!(!hf.tie_word_embeddings && hf.norm_topk_prob);
    // router_aux_loss_coef · top_k (transformers counts top-k fractions summing to k).
    assert!((c.lb_loss_coef - 0.04).abs() < 1e-12);
    assert_eq!(c.w1_cols(), 96);
    assert_eq!(c.expert_params(), 3 * 32 * 48);
    // Round trip through the job JSON / manifest.
    let back: MoeConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
    // The GPT family serialises as before (old manifests and job JSON unchanged).
    let tiny = serde_json::to_value(MoeConfig::tiny()).unwrap();
    assert!(tiny.get("hf").is_none());
}

#[test]
fn qwen_configs_read_their_fields() {
    let c = MoeConfig::from_hf_config_json(&qwen2_json()).unwrap();
    let hf = c.hf.as_ref().unwrap();
    assert_eq!(c.family(), Family::Qwen2Moe);
    assert_eq!((c.d_ff, c.experts, hf.shared_ff), (16, 8, 32));
    assert!(hf.qkv_bias && !hf.o_bias && hf.shared_gate && !hf.norm_topk_prob && !hf.qk_norm);
    let c = MoeConfig::from_hf_config_json(&qwen3_json()).unwrap();
    let hf = c.hf.as_ref().unwrap();
    assert_eq!(c.family(), Family::Qwen3Moe);
    assert_eq!((hf.head_dim, hf.n_kv_heads, hf.shared_ff), (16, 2, 0));
    assert!(hf.qk_norm && hf.norm_topk_prob && !hf.qkv_bias && hf.tie_word_embeddings);
}

#[test]
fn deepseek_config_reads_its_fields_and_the_class_defaults() {
    use lazarus_executor::model::Scoring;
    let c = MoeConfig::from_hf_config_json(&deepseek_json()).unwrap();
    assert_eq!(c.family(), Family::DeepseekV3);
    assert_eq!(
        (c.d_ff, c.experts, c.top_k, c.lb_loss_coef),
        (16, 8, 2, 0.0)
    );
    let hf = c.hf.as_ref().unwrap();
    let m = hf.mla.as_ref().unwrap();
    assert_eq!(
        (
            m.q_lora_rank,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim
        ),
        (Some(16), 16, 8, 4, 8)
    );
    assert!(m.rope_interleave);
    assert_eq!(hf.head_dim, 4, "the rotary tables span qk_rope_head_dim");
    assert_eq!(hf.scoring, Scoring::Sigmoid);
    assert_eq!((hf.n_group, hf.topk_group, hf.shared_ff), (4, 2, 16));
    assert_eq!(
        (hf.routed_scaling_factor, hf.bias_update_speed),
        (2.5, 0.001)
    );
    assert!(hf.norm_topk_prob && !hf.shared_gate && !hf.qkv_bias);
    let full = MoeConfig::from_hf_config_json(&deepseek_full_q_json()).unwrap();
    let fm = full.hf.as_ref().unwrap().mla.clone().unwrap();
    assert_eq!((fm.q_lora_rank, fm.rope_interleave), (None, false));
    // Absent fields take `DeepseekV3Config`'s defaults.
    let mut v: serde_json::Value = serde_json::from_str(&deepseek_json()).unwrap();
    for k in [
        "routed_scaling_factor",
        "n_shared_experts",
        "q_lora_rank",
        "rope_interleave",
    ] {
        v.as_object_mut().unwrap().remove(k);
    }
    let d = MoeConfig::from_hf_config_json(&v.to_string()).unwrap();
    let dh = d.hf.as_ref().unwrap();
    assert_eq!((dh.routed_scaling_factor, dh.shared_ff), (2.5, 16));
    let dm = dh.mla.as_ref().unwrap();
    assert_eq!((dm.q_lora_rank, dm.rope_interleave), (Some(1536), true));
}

/// [`deepseek_json`] with 3 blocks of which the first is dense (`first_k_dense_replace` 1,
/// `intermediate_size` 64): 2 MoE layers, in blocks 1 and 2.
fn deepseek_dense_json() -> String {
    let j = with(&deepseek_json(), "num_hidden_layers", serde_json::json!(3));
    with(&j, "first_k_dense_replace", serde_json::json!(1))
}

/// Dense (non-MoE) blocks as `transformers` builds them: DeepSeek's first
/// `first_k_dense_replace`, Qwen's `mlp_only_layers` and every block `i` with
/// `(i + 1) % decoder_sparse_step != 0`. `n_layers` counts the MoE blocks; MoE layer `l`'s
/// tensors carry its block's index.
#[test]
fn dense_layers_are_read_and_moe_layers_keep_their_block_names() {
    let c = MoeConfig::from_hf_config_json(&deepseek_dense_json()).unwrap();
    let hf = c.hf.as_ref().unwrap();
    assert_eq!((c.n_layers, hf.n_blocks(&c)), (2, 3));
    assert_eq!((hf.dense_layers.clone(), hf.dense_ff), (vec![0], 64));
    assert_eq!(hf.router_name(0), "model.layers.1.mlp.gate.weight");
    assert_eq!(
        hf.expert_tensor_names(1, 7)[2],
        "model.layers.2.mlp.experts.7.down_proj.weight"
    );
    assert_eq!(
        hf.shared_prefix(0).unwrap(),
        "model.layers.1.mlp.shared_experts"
    );
    let q = with(&qwen2_json(), "num_hidden_layers", serde_json::json!(5));
    let q = with(&q, "decoder_sparse_step", serde_json::json!(2));
    let q = with(&q, "mlp_only_layers", serde_json::json!([3]));
    let c = MoeConfig::from_hf_config_json(&q).unwrap();
    let hf = c.hf.as_ref().unwrap();
    // Blocks 1 and 3 pass the step test; 3 is MLP-only: blocks 0, 2, 3, 4 are dense.
    assert_eq!((c.n_layers, hf.dense_layers.clone()), (1, vec![0, 2, 3, 4]));
    assert_eq!(hf.block_of(0), 1);
    assert_eq!(hf.router_name(0), "model.layers.1.mlp.gate.weight");

    let c = MoeConfig::from_hf_config_json(&deepseek_dense_json()).unwrap();
    let m = DenseModel::new(&c, &Device::Cpu).unwrap();
    let shape = |n: &str| m.var(n).unwrap_or_else(|| panic!("no {n}")).dims().to_vec();
    assert_eq!(shape("model.layers.0.mlp.gate_proj.weight"), [64, 32]);
    assert_eq!(shape("model.layers.0.mlp.up_proj.weight"), [64, 32]);
    assert_eq!(shape("model.layers.0.mlp.down_proj.weight"), [32, 64]);
    assert!(m.var("model.layers.0.mlp.gate.weight").is_none());
    assert_eq!(
        shape("model.layers.2.mlp.gate.e_score_correction_bias"),
        [8]
    );
    assert_eq!(shape("model.layers.0.self_attn.kv_b_proj.weight"), [64, 16]);
    let total: usize = m.named_vars().iter().map(|(_, v)| v.elem_count()).sum();
    assert_eq!(total, c.dense_params());
    assert_eq!(
        m.routing_bias_names(),
        [
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.2.mlp.gate.e_score_correction_bias"
        ]
    );
}

#[test]
fn unsupported_configs_are_refused_naming_the_field() {
    let m = mixtral_json();
    refused(
        &with(&m, "architectures", serde_json::json!(["LlamaForCausalLM"])),
        "architectures",
    );
    refused(
        &with(
            &m,
            "rope_scaling",
            serde_json::json!({"type": "linear", "factor": 2.0}),
        ),
        "rope_scaling",
    );
    refused(
        &with(&m, "sliding_window", serde_json::json!(16)),
        "sliding_window",
    );
    refused(
        &with(&m, "hidden_act", serde_json::json!("gelu")),
        "hidden_act",
    );
    refused(
        &with(&m, "router_jitter_noise", serde_json::json!(0.1)),
        "router_jitter_noise",
    );
    refused(
        &with(&m, "hidden_size", serde_json::json!("32")),
        "hidden_size",
    );
    refused(
        &with(&m, "num_key_value_heads", serde_json::json!(3)),
        "num_key_value_heads",
    );
    // The training seq_len (from --config) must fit max_position_embeddings.
    let short =
        MoeConfig::from_hf_config_json(&with(&m, "max_position_embeddings", serde_json::json!(16)))
            .unwrap();
    assert_eq!(short.seq_len, 16);
    match (MoeConfig {
        seq_len: 32,
        ..short
    })
    .validate()
    {
        Err(ConfigError::Hf { field, .. }) => assert_eq!(field, "max_position_embeddings"),
        other => panic!("{other:?}"),
    }
    let mut v: serde_json::Value = serde_json::from_str(&m).unwrap();
    v.as_object_mut().unwrap().remove("num_local_experts");
    refused(&v.to_string(), "num_local_experts");
    // Dense layers are built, but not a model of dense layers only, nor a bad index.
    refused(
        &with(&qwen2_json(), "mlp_only_layers", serde_json::json!([0, 1])),
        "num_hidden_layers",
    );
    refused(
        &with(&qwen2_json(), "mlp_only_layers", serde_json::json!([2])),
        "mlp_only_layers",
    );
    refused(
        &with(&qwen2_json(), "mlp_only_layers", serde_json::json!("0")),
        "mlp_only_layers",
    );
    refused(
        &with(&qwen2_json(), "decoder_sparse_step", serde_json::json!(0)),
        "decoder_sparse_step",
    );
    refused(
        &with(&qwen2_json(), "use_sliding_window", serde_json::json!(true)),
        "use_sliding_window",
    );
    let ds = deepseek_json();
    let strip = |k: &str| {
        let mut v: serde_json::Value = serde_json::from_str(&ds).unwrap();
        v.as_object_mut().unwrap().remove(k);
        v.to_string()
    };
    // `transformers`' default is 3 dense layers: of a 2-layer model, every layer.
    refused(&strip("first_k_dense_replace"), "num_hidden_layers");
    refused(
        &with(&ds, "num_key_value_heads", serde_json::json!(2)),
        "num_key_value_heads",
    );
    refused(&with(&ds, "n_group", serde_json::json!(8)), "n_group");
    refused(&with(&ds, "topk_group", serde_json::json!(5)), "n_group");
    refused(
        &with(&ds, "scoring_func", serde_json::json!("softmax")),
        "scoring_func",
    );
    refused(
        &with(&ds, "topk_method", serde_json::json!("greedy")),
        "topk_method",
    );
    refused(
        &with(&ds, "kv_lora_rank", serde_json::json!(0)),
        "kv_lora_rank",
    );
    refused("not json", "(file)");
}

#[test]
fn dense_variables_have_transformers_names_and_shapes() -> Result<()> {
    let c = MoeConfig::from_hf_config_json(&mixtral_json()).unwrap();
    let m = DenseModel::new(&c, &Device::Cpu)?;
    let shape = |n: &str| m.var(n).unwrap_or_else(|| panic!("no {n}")).dims().to_vec();
    assert_eq!(shape("model.embed_tokens.weight"), [256, 32]);
    assert_eq!(shape("model.layers.1.self_attn.q_proj.weight"), [32, 32]);
    assert_eq!(shape("model.layers.1.self_attn.k_proj.weight"), [16, 32]);
    assert_eq!(shape("model.layers.1.self_attn.v_proj.weight"), [16, 32]);
    assert_eq!(shape("model.layers.1.self_attn.o_proj.weight"), [32, 32]);
    assert_eq!(shape("model.layers.0.input_layernorm.weight"), [32]);
    assert_eq!(
        shape("model.layers.0.post_attention_layernorm.weight"),
        [32]
    );
    assert_eq!(
        shape("model.layers.0.block_sparse_moe.gate.weight"),
        [4, 32]
    );
    assert_eq!(shape("model.norm.weight"), [32]);
    assert_eq!(shape("lm_head.weight"), [256, 32]);
    let total: usize = m.named_vars().iter().map(|(_, v)| v.elem_count()).sum();
    assert_eq!(total, c.dense_params());
    assert!(
        m.named_vars()
            .iter()
            .all(|(n, _)| n.starts_with("model.") || n == "lm_head.weight")
    );

    let c = MoeConfig::from_hf_config_json(&qwen2_json()).unwrap();
    let m = DenseModel::new(&c, &Device::Cpu)?;
    let shape = |n: &str| m.var(n).unwrap_or_else(|| panic!("no {n}")).dims().to_vec();
    assert_eq!(shape("model.layers.0.self_attn.q_proj.bias"), [32]);
    assert_eq!(shape("model.layers.0.self_attn.k_proj.bias"), [32]);
    assert!(m.var("model.layers.0.self_attn.o_proj.bias").is_none());
    assert_eq!(shape("model.layers.0.mlp.gate.weight"), [8, 32]);
    assert_eq!(
        shape("model.layers.0.mlp.shared_expert.gate_proj.weight"),
        [32, 32]
    );
    assert_eq!(
        shape("model.layers.0.mlp.shared_expert.down_proj.weight"),
        [32, 32]
    );
    assert_eq!(
        shape("model.layers.0.mlp.shared_expert_gate.weight"),
        [1, 32]
    );
    let total: usize = m.named_vars().iter().map(|(_, v)| v.elem_count()).sum();
    assert_eq!(total, c.dense_params());

    let c = MoeConfig::from_hf_config_json(&qwen3_json()).unwrap();
    let m = DenseModel::new(&c, &Device::Cpu)?;
    let shape = |n: &str| m.var(n).unwrap_or_else(|| panic!("no {n}")).dims().to_vec();
    assert_eq!(shape("model.layers.0.self_attn.q_norm.weight"), [16]);
    assert_eq!(shape("model.layers.0.self_attn.k_norm.weight"), [16]);
    assert_eq!(shape("model.layers.0.self_attn.q_proj.weight"), [64, 32]);
    assert_eq!(shape("model.layers.0.self_attn.o_proj.weight"), [32, 64]);
    assert!(m.var("lm_head.weight").is_none(), "tied");
    let total: usize = m.named_vars().iter().map(|(_, v)| v.elem_count()).sum();
    assert_eq!(total, c.dense_params());
    let hf = c.hf.as_ref().unwrap();
    assert_eq!(
        hf.expert_tensor_names(1, 3),
        [
            "model.layers.1.mlp.experts.3.gate_proj.weight".to_owned(),
            "model.layers.1.mlp.experts.3.up_proj.weight".to_owned(),
            "model.layers.1.mlp.experts.3.down_proj.weight".to_owned(),
        ]
    );

    // DeepSeek-V3: MLA (`DeepseekV3Attention`'s names and `[out, in]` shapes), the router
    // with its bias buffer, the shared experts.
    for (json, full_q) in [(deepseek_json(), false), (deepseek_full_q_json(), true)] {
        let c = MoeConfig::from_hf_config_json(&json).unwrap();
        let m = DenseModel::new(&c, &Device::Cpu)?;
        let shape = |n: &str| m.var(n).unwrap_or_else(|| panic!("no {n}")).dims().to_vec();
        let a = "model.layers.1.self_attn";
        if full_q {
            assert_eq!(shape(&format!("{a}.q_proj.weight")), [4 * 12, 32]);
            assert!(m.var(&format!("{a}.q_a_proj.weight")).is_none());
            assert_eq!(shape(&format!("{a}.kv_a_proj_with_mqa.bias")), [20]);
            assert_eq!(shape(&format!("{a}.o_proj.bias")), [32]);
        } else {
            assert_eq!(shape(&format!("{a}.q_a_proj.weight")), [16, 32]);
            assert_eq!(shape(&format!("{a}.q_a_layernorm.weight")), [16]);
            assert_eq!(shape(&format!("{a}.q_b_proj.weight")), [4 * 12, 16]);
            assert!(m.var(&format!("{a}.q_proj.weight")).is_none());
            assert!(m.var(&format!("{a}.o_proj.bias")).is_none());
        }
        assert_eq!(
            shape(&format!("{a}.kv_a_proj_with_mqa.weight")),
            [16 + 4, 32]
        );
        assert_eq!(shape(&format!("{a}.kv_a_layernorm.weight")), [16]);
        assert_eq!(shape(&format!("{a}.kv_b_proj.weight")), [4 * (8 + 8), 16]);
        assert_eq!(shape(&format!("{a}.o_proj.weight")), [32, 4 * 8]);
        assert_eq!(shape("model.layers.0.mlp.gate.weight"), [8, 32]);
        assert_eq!(
            shape("model.layers.0.mlp.gate.e_score_correction_bias"),
            [8]
        );
        assert_eq!(
            shape("model.layers.0.mlp.shared_experts.gate_proj.weight"),
            [16, 32]
        );
        assert_eq!(
            shape("model.layers.0.mlp.shared_experts.down_proj.weight"),
            [32, 16]
        );
        assert_eq!(shape("lm_head.weight"), [256, 32]);
        let total: usize = m.named_vars().iter().map(|(_, v)| v.elem_count()).sum();
        assert_eq!(total, c.dense_params());
        assert_eq!(
            m.routing_bias_names(),
            [
                "model.layers.0.mlp.gate.e_score_correction_bias",
                "model.layers.1.mlp.gate.e_score_correction_bias"
            ]
        );
    }
    Ok(())
}

/// Seeded: two builds of the same HF model and experts are bit-identical (what lets workers
/// start identical).
#[test]
fn hf_initialisation_is_seeded() -> Result<()> {
    let c = MoeConfig::from_hf_config_json(&mixtral_json()).unwrap();
    let dev = Device::Cpu;
    let (a, b) = (DenseModel::new(&c, &dev)?, DenseModel::new(&c, &dev)?);
    for ((na, va), (nb, vb)) in a.named_vars().iter().zip(b.named_vars()) {
        assert_eq!(na, nb);
        let (x, y) = (
            va.flatten_all()?.to_vec1::<f32>()?,
            vb.flatten_all()?.to_vec1::<f32>()?,
        );
        assert_eq!(x, y, "{na}");
    }
    let e1 = ExpertStore::with_replicas(&c, &dev, [(1, 2)])?.export(1, 2)?;
    let e2 = ExpertStore::all(&c, &dev)?.export(1, 2)?;
    assert_eq!(e1, e2);
    assert_eq!((e1.w1.len(), e1.w2.len()), (32 * 96, 48 * 32));
    Ok(())
}

// ---- finite-difference gradient checks (f64, central differences) ----

/// Checks `d/dx Σ f(x)·r` (fixed random `r`, so every output element matters differently)
/// against central differences of step `h` for every element of `x`, in f64.
fn check_grad(name: &str, x0: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
    let x = Var::from_tensor(x0)?;
    let y = f(x.as_tensor())?;
    let r = Tensor::randn(0.0f64, 1.0, y.shape(), &Device::Cpu)?;
    let obj = |t: &Tensor| -> Result<f64> { (f(t)? * &r)?.sum_all()?.to_scalar::<f64>() };
    let loss = (y * &r)?.sum_all()?;
    let grads = loss.backward()?;
    let g = grads
        .get(x.as_tensor())
        .unwrap_or_else(|| panic!("{name}: no gradient reached the input"))
        .flatten_all()?
        .to_vec1::<f64>()?;
    let base = x0.flatten_all()?.to_vec1::<f64>()?;
    let h = 1e-5;
    let mut worst = 0.0f64;
    for i in 0..base.len() {
        let mut p = base.clone();
        p[i] += h;
        let up = obj(&Tensor::from_vec(p.clone(), x0.shape(), &Device::Cpu)?)?;
        p[i] -= 2.0 * h;
        let down = obj(&Tensor::from_vec(p, x0.shape(), &Device::Cpu)?)?;
        let num = (up - down) / (2.0 * h);
        let err = (num - g[i]).abs() / (1.0 + num.abs());
        worst = worst.max(err);
    }
    assert!(worst < 1e-6, "{name}: gradient off by {worst:e} (relative)");
    assert!(
        g.iter().any(|v| v.abs() > 1e-3),
        "{name}: a vanishing gradient proves nothing"
    );
    Ok(())
}

fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(0.0f64, 1.0, shape, &Device::Cpu)
}

#[test]
fn gradient_of_rms_norm_matches_finite_differences() -> Result<()> {
    let w = ((randn(&[6])? * 0.5)? + 1.0)?;
    check_grad("rms_norm(x)", &randn(&[3, 2, 6])?, |x| {
        rms_norm(x, &w, 1e-5)
    })?;
    let x = randn(&[4, 6])?;
    check_grad("rms_norm(w)", &w, |w| rms_norm(&x, w, 1e-5))
}

#[test]
fn gradient_of_rotary_embedding_matches_finite_differences() -> Result<()> {
    let (s, hd) = (5, 8);
    let ang: Vec<f64> = (0..s * hd).map(|i| 0.37 * i as f64).collect();
    let cos = Tensor::from_vec(
        ang.iter().map(|a| a.cos()).collect::<Vec<_>>(),
        (s, hd),
        &Device::Cpu,
    )?;
    let sin = Tensor::from_vec(
        ang.iter().map(|a| a.sin()).collect::<Vec<_>>(),
        (s, hd),
        &Device::Cpu,
    )?;
    check_grad("rope", &randn(&[2, 3, s, hd])?, |x| {
        apply_rope(x, &cos, &sin)
    })?;
    // DeepSeek's interleaved layout: pairs regrouped, then rotated.
    check_grad("deinterleave + rope", &randn(&[2, 3, s, hd])?, |x| {
        apply_rope(&deinterleave(x)?, &cos, &sin)
    })?;
    let x = Tensor::arange(0f32, 8.0, &Device::Cpu)?.reshape((1, 8))?;
    assert_eq!(
        deinterleave(&x)?.to_vec2::<f32>()?,
        [[0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]]
    );
    Ok(())
}

#[test]
fn gradient_of_silu_sigmoid_and_swiglu_matches_finite_differences() -> Result<()> {
    check_grad("sigmoid", &(randn(&[4, 5])? * 3.0)?, sigmoid)?;
    check_grad("silu", &(randn(&[4, 5])? * 3.0)?, silu)?;
    check_grad("swiglu", &(randn(&[4, 10])? * 2.0)?, |h| swiglu(h, 5))
}

#[test]
fn gradient_of_a_swiglu_expert_matches_finite_differences() -> Result<()> {
    let (d, ff) = (4, 3);
    let w1 = (randn(&[d, 2 * ff])? * 0.5)?;
    let w2 = (randn(&[ff, d])? * 0.5)?;
    let x = randn(&[5, d])?;
    let fwd = |x: &Tensor, w1: &Tensor, w2: &Tensor| {
        ExpertWeights {
            w1: w1.clone(),
            w2: w2.clone(),
            compute: Precision::F32,
        }
        .forward(x)
    };
    check_grad("expert(x)", &x, |x| fwd(x, &w1, &w2))?;
    check_grad("expert(w1)", &w1, |w| fwd(&x, w, &w2))?;
    check_grad("expert(w2)", &w2, |w| fwd(&x, &w1, w))
}

/// The whole HF model (GQA, q/k norms, biases, shared expert and gate, untied head): with the
/// routing held fixed, the f32 loss's central differences agree with the backward pass on the
/// entry of largest gradient of every dense variable, and every variable gets a gradient.
#[test]
fn whole_model_gradients_match_finite_differences() -> Result<()> {
    for json in [
        mixtral_json(),
        qwen2_json(),
        qwen3_json(),
        deepseek_json(),
        deepseek_full_q_json(),
        deepseek_dense_json(),
        with(&qwen3_json(), "mlp_only_layers", serde_json::json!([0])),
    ] {
        let c = MoeConfig::from_hf_config_json(&json).unwrap();
        let c = MoeConfig {
            precision: Precision::F32,
            seq_len: 8,
            ..c
        };
        let dev = Device::Cpu;
        let mut m = DenseModel::new(&c, &dev)?;
        let store = ExpertStore::all(&c, &dev)?;
        let tokens: Vec<u32> = (0..18).map(|i| (i * 37 % 256) as u32).collect();
        let tokens = Tensor::from_vec(tokens, (2, 9), &dev)?;
        let mut stats = RoutingStats::default();
        let loss = m.loss(&tokens, &mut LocalExperts(&store), &mut stats)?;
        m.set_forced_routing(Some(stats.choices.clone()));
        let grads = loss.backward()?;
        let frozen = m.routing_bias_names();
        for (name, var) in m.named_vars().to_vec() {
            if frozen.contains(&name) {
                // The routing bias steers the choice only: no gradient reaches it.
                assert!(
                    grads.get(var.as_tensor()).is_none(),
                    "{name} has a gradient"
                );
                continue;
            }
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{:?}: no gradient for {name}", c.family()))
                .flatten_all()?
                .to_vec1::<f32>()?;
            let (i, gi) = g
                .iter()
                .copied()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            assert!(gi.abs() > 1e-6, "{name}: gradient all zero");
            let base = var.flatten_all()?.to_vec1::<f32>()?;
            let h = 1e-2f32;
            let mut at = |delta: f32| -> Result<f64> {
                let mut p = base.clone();
                p[i] += delta;
                var.set(&Tensor::from_vec(p, var.shape(), &dev)?)?;
                let l = m.loss(&tokens, &mut LocalExperts(&store), &mut stats)?;
                Ok(f64::from(l.to_scalar::<f32>()?))
            };
            let num = (at(h)? - at(-h)?) / (2.0 * f64::from(h));
            var.set(&Tensor::from_vec(base, var.shape(), &dev)?)?;
            let err = (num - f64::from(gi)).abs();
            assert!(
                err < 0.03 * f64::from(gi.abs()) + 2e-4,
                "{:?} {name}[{i}]: backward {gi}, finite differences {num}",
                c.family()
            );
        }
    }
    Ok(())
}

#[test]
fn hf_families_train_and_the_loss_falls() -> Result<()> {
    for json in [
        mixtral_json(),
        qwen2_json(),
        qwen3_json(),
        deepseek_json(),
        deepseek_dense_json(),
    ] {
        let c = MoeConfig::from_hf_config_json(&json).unwrap();
        let c = MoeConfig {
            precision: Precision::F32,
            lr: 3e-3,
            ..c
        };
        let mut t = Trainer::new(&c)?;
        let first = t.step()?.loss;
        let mut last = first;
        for _ in 0..25 {
            last = t.step()?.loss;
        }
        assert!(
            last.is_finite() && last < first - 0.3,
            "{:?}: {first} -> {last}",
            c.family()
        );
    }
    Ok(())
}

/// Auxiliary-loss-free balancing (DeepSeek-V3 report §2.1.2): after each step every bias
/// moves by exactly ±γ toward the step's mean load (or stays when the load equals it), AdamW
/// never touches it (its weight decay would), and the gates are the raw scores.
#[test]
fn deepseek_routing_bias_follows_the_load_and_nothing_else() -> Result<()> {
    let c = MoeConfig::from_hf_config_json(&deepseek_json()).unwrap();
    let gamma = c.hf.as_ref().unwrap().bias_update_speed as f32;
    let mut t = Trainer::new(&c)?;
    let names = t.model.routing_bias_names();
    let bias = |t: &Trainer, l: usize| -> Vec<f32> {
        t.model.var(&names[l]).unwrap().to_vec1::<f32>().unwrap()
    };
    for _ in 0..3 {
        let before: Vec<Vec<f32>> = (0..2).map(|l| bias(&t, l)).collect();
        let r = t.step()?;
        for (l, counts) in r.counts.iter().enumerate() {
            let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
            let after = bias(&t, l);
            for e in 0..counts.len() {
                let want = if (counts[e] as f64) < mean {
                    before[l][e] + gamma
                } else if (counts[e] as f64) > mean {
                    before[l][e] - gamma
                } else {
                    before[l][e]
                };
                assert_eq!(after[e], want, "layer {l} expert {e}: counts {counts:?}");
            }
        }
    }
    // Exported as the optimizer's state with zero moments (never updated by AdamW).
    let st = t.export_dense()?;
    let p = st.params.iter().find(|p| p.name == names[0]).unwrap();
    assert!(p.m.iter().chain(&p.v).all(|&x| x == 0.0));
    assert!(p.value.iter().any(|&x| x != 0.0));
    Ok(())
}

/// The bias balances: from a router initialised to prefer two experts, 60 steps with the
/// report's bias update (γ = 0.001) end with a far more even load (mean max/mean over the
/// last 20 steps and both layers) than the same run without it.
#[test]
fn deepseek_routing_bias_evens_the_load() -> Result<()> {
    let imbalance = |speed: f64| -> Result<f64> {
        let mut c = MoeConfig::from_hf_config_json(&deepseek_json()).unwrap();
        c.hf.as_mut().unwrap().bias_update_speed = speed;
        c.lr = 1e-9; // the router stays (nearly) as initialised: only the bias can even the load
        let mut t = Trainer::new(&c)?;
        // A router that scores experts 0 and 1 high for every token.
        for l in 0..c.n_layers {
            let v = t
                .model
                .var(&format!("model.layers.{l}.mlp.gate.weight"))
                .unwrap();
            let w = v.to_vec2::<f32>()?;
            let w: Vec<f32> = w
                .iter()
                .enumerate()
                .flat_map(|(e, row)| row.iter().map(move |&x| x + if e < 2 { 0.05 } else { 0.0 }))
                .collect();
            v.set(&Tensor::from_vec(w, (c.experts, c.d_model), &Device::Cpu)?)?;
        }
        let (mut sum, mut n) = (0.0f64, 0);
        for step in 0..60 {
            let r = t.step()?;
            if step >= 40 {
                for counts in &r.counts {
                    let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
                    sum += *counts.iter().max().unwrap() as f64 / mean;
                    n += 1;
                }
            }
        }
        Ok(sum / f64::from(n))
    };
    let (without, with_bias) = (imbalance(0.0)?, imbalance(0.001)?);
    assert!(
        with_bias < 1.5 && with_bias < 0.6 * without,
        "max/mean load: {with_bias:.2} with the bias update, {without:.2} without"
    );
    Ok(())
}

#[test]
fn bf16_products_train_an_hf_family() -> Result<()> {
    for json in [mixtral_json(), deepseek_json()] {
        let c = MoeConfig::from_hf_config_json(&json).unwrap();
        let c = MoeConfig {
            precision: Precision::Bf16,
            ..c
        };
        let mut t = Trainer::new(&c)?;
        let r = t.step()?;
        assert!(r.loss.is_finite(), "{:?}", c.family());
    }
    let _ = DType::BF16;
    Ok(())
}

/// Model FLOPs of the tiny Mixtral by hand: attention q, k, v, o `32·(32 + 2·16) + 32·32 =
/// 3072`, router `32·4 = 128`, two SwiGLU experts `2·3·32·48 = 9216`: 12416 per layer, 24832
/// for two; LM head `256·32 = 8192`; 33024 active weights. 6 · 33024 = 198144, attention
/// scores `12·2·(4·8)·32 = 24576`: 222720 FLOPs per token.
#[test]
fn model_flops_of_a_mixtral_by_hand() {
    use lazarus_executor::model::{active_matmul_params_per_token, model_flops_per_token};
    let c = MoeConfig::from_hf_config_json(&mixtral_json()).unwrap();
    assert_eq!(c.seq_len, 32);
    assert_eq!(active_matmul_params_per_token(&c), 33_024);
    assert_eq!(model_flops_per_token(&c), 222_720.0);
}

/// Model FLOPs of the tiny DeepSeek-V3 by hand. Attention (MLA): q `32·16 + 16·4·12 = 1280`,
/// kv_a `32·20 = 640`, kv_b `16·4·16 = 1024`, o `4·8·32 = 1024`: 3968; router `32·8 = 256`;
/// two SwiGLU experts `2·3·32·16 = 3072`; shared expert `3·32·16 = 1536`: 8832 per layer,
/// 17664 for two; LM head 8192; 25856 active weights, 6 · 25856 = 155136. Scores: `QKᵀ`
/// `4·12` wide and `AV` `4·8`, mean 40: `12·2·40·32 = 30720`. 185856 FLOPs per token.
#[test]
fn model_flops_of_a_deepseek_v3_by_hand() {
    use lazarus_executor::model::{active_matmul_params_per_token, model_flops_per_token};
    let c = MoeConfig::from_hf_config_json(&deepseek_json()).unwrap();
    assert_eq!(c.seq_len, 32);
    assert_eq!(active_matmul_params_per_token(&c), 25_856);
    assert_eq!(model_flops_per_token(&c), 185_856.0);
    // A dense first block: its attention 3968 and MLP `3·32·64 = 6144` add 10112 weights
    // (35968 in all, 6· = 215808), and it attends: scores `12·3·40·32 = 46080`.
    let c = MoeConfig::from_hf_config_json(&deepseek_dense_json()).unwrap();
    assert_eq!(active_matmul_params_per_token(&c), 35_968);
    assert_eq!(model_flops_per_token(&c), 261_888.0);
}
