//! Issue 32 parts 2–3: Hugging Face interop. An export has the family's tensor names and
//! shapes (checked against the Hugging Face naming written out here, not derived from the
//! code under test), a sharded export has a correct index, export → `--init-from` gives the
//! same logits bit for bit (fresh, after training, from an FSEP checkpoint), and each class of
//! bad input is one line and exit 2 with nothing already written lost.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use candle_core::Device;
use lazarus_executor::interop::{self, INDEX_FILE, WEIGHTS_FILE, WeightsDir};
use lazarus_executor::model::{DenseModel, ExpertStore, MoeConfig};
use serde_json::{Value, json};

mod process;
use process::{Outcome, run_within};

const LZRUN: &str = env!("CARGO_BIN_EXE_lzrun");
const LIMIT: Duration = Duration::from_secs(300);
/// One run at a time: the runs share the machine's cores with each other's workers.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lzrun(args: &[&str]) -> Outcome {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run_within(Command::new(LZRUN).args(args), LIMIT)
}

fn scratch(name: &str) -> PathBuf {
    process::scratch("hf", name)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Tiny configs of each family `transformers` has a class for (the fields of their
/// `configuration_*.py`).
fn mixtral() -> Value {
    json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "sliding_window": null, "router_aux_loss_coef": 0.02
    })
}

fn qwen2_moe() -> Value {
    json!({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": false,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": false
    })
}

fn qwen3_moe() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": true, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "use_sliding_window": false, "attention_bias": false
    })
}

/// DeepSeek-V3: latent attention with low-rank queries, 8 experts in 4 groups, one shared
/// expert; the first of 3 blocks dense (an MLP of 64), as the released model's first 3.
fn deepseek_v3() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": false
    })
}

/// The Hugging Face tensor names and shapes of these tiny configs, written out from the
/// `transformers` modelling files (`modeling_mixtral.py`, `modeling_qwen2_moe.py`,
/// `modeling_qwen3_moe.py`, `modeling_deepseek_v3.py`): `nn.Linear(in, out)` has
/// `weight [out, in]`.
fn hf_names(cfg: &Value) -> BTreeMap<String, Vec<usize>> {
    let arch = cfg["architectures"][0].as_str().unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (v, d, layers, heads, kv) = (
        n("vocab_size"),
        n("hidden_size"),
        n("num_hidden_layers"),
        n("num_attention_heads"),
        n("num_key_value_heads"),
    );
    let hd = cfg
        .get("head_dim")
        .map_or(d / heads, |h| h.as_u64().unwrap() as usize);
    let mut m = BTreeMap::new();
    m.insert("model.embed_tokens.weight".to_owned(), vec![v, d]);
    m.insert("model.norm.weight".to_owned(), vec![d]);
    if !cfg["tie_word_embeddings"].as_bool().unwrap() {
        m.insert("lm_head.weight".to_owned(), vec![v, d]);
    }
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        m.insert(format!("{p}.input_layernorm.weight"), vec![d]);
        m.insert(format!("{p}.post_attention_layernorm.weight"), vec![d]);
        if arch == "DeepseekV3ForCausalLM" {
            let (qr, kvr, nope, rope, vd) = (
                n("q_lora_rank"),
                n("kv_lora_rank"),
                n("qk_nope_head_dim"),
                n("qk_rope_head_dim"),
                n("v_head_dim"),
            );
            let a = format!("{p}.self_attn");
            m.insert(format!("{a}.q_a_proj.weight"), vec![qr, d]);
            m.insert(format!("{a}.q_a_layernorm.weight"), vec![qr]);
            m.insert(
                format!("{a}.q_b_proj.weight"),
                vec![heads * (nope + rope), qr],
            );
            m.insert(
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![kvr + rope, d],
            );
            m.insert(format!("{a}.kv_a_layernorm.weight"), vec![kvr]);
            m.insert(
                format!("{a}.kv_b_proj.weight"),
                vec![heads * (nope + vd), kvr],
            );
            m.insert(format!("{a}.o_proj.weight"), vec![d, heads * vd]);
            if l < n("first_k_dense_replace") {
                let ff = n("intermediate_size");
                m.insert(format!("{p}.mlp.gate_proj.weight"), vec![ff, d]);
                m.insert(format!("{p}.mlp.up_proj.weight"), vec![ff, d]);
                m.insert(format!("{p}.mlp.down_proj.weight"), vec![d, ff]);
                continue;
            }
            let (e, ff) = (n("n_routed_experts"), n("moe_intermediate_size"));
            m.insert(format!("{p}.mlp.gate.weight"), vec![e, d]);
            m.insert(format!("{p}.mlp.gate.e_score_correction_bias"), vec![e]);
            for j in 0..e {
                let q = format!("{p}.mlp.experts.{j}");
                m.insert(format!("{q}.gate_proj.weight"), vec![ff, d]);
                m.insert(format!("{q}.up_proj.weight"), vec![ff, d]);
                m.insert(format!("{q}.down_proj.weight"), vec![d, ff]);
            }
            let sff = n("n_shared_experts") * ff;
            let q = format!("{p}.mlp.shared_experts");
            m.insert(format!("{q}.gate_proj.weight"), vec![sff, d]);
            m.insert(format!("{q}.up_proj.weight"), vec![sff, d]);
            m.insert(format!("{q}.down_proj.weight"), vec![d, sff]);
            continue;
        }
        m.insert(format!("{p}.self_attn.q_proj.weight"), vec![heads * hd, d]);
        m.insert(format!("{p}.self_attn.k_proj.weight"), vec![kv * hd, d]);
        m.insert(format!("{p}.self_attn.v_proj.weight"), vec![kv * hd, d]);
        m.insert(format!("{p}.self_attn.o_proj.weight"), vec![d, heads * hd]);
        match arch {
            "MixtralForCausalLM" => {
                let (e, ff) = (n("num_local_experts"), n("intermediate_size"));
                m.insert(format!("{p}.block_sparse_moe.gate.weight"), vec![e, d]);
                for j in 0..e {
                    let q = format!("{p}.block_sparse_moe.experts.{j}");
                    m.insert(format!("{q}.w1.weight"), vec![ff, d]);
                    m.insert(format!("{q}.w3.weight"), vec![ff, d]);
                    m.insert(format!("{q}.w2.weight"), vec![d, ff]);
                }
            }
            _ => {
                let (e, ff) = (n("num_experts"), n("moe_intermediate_size"));
                m.insert(format!("{p}.mlp.gate.weight"), vec![e, d]);
                for j in 0..e {
                    let q = format!("{p}.mlp.experts.{j}");
                    m.insert(format!("{q}.gate_proj.weight"), vec![ff, d]);
                    m.insert(format!("{q}.up_proj.weight"), vec![ff, d]);
                    m.insert(format!("{q}.down_proj.weight"), vec![d, ff]);
                }
                if arch == "Qwen2MoeForCausalLM" {
                    for x in ["q", "k", "v"] {
                        let out = if x == "q" { heads * hd } else { kv * hd };
                        m.insert(format!("{p}.self_attn.{x}_proj.bias"), vec![out]);
                    }
                    let sff = n("shared_expert_intermediate_size");
                    let q = format!("{p}.mlp.shared_expert");
                    m.insert(format!("{q}.gate_proj.weight"), vec![sff, d]);
                    m.insert(format!("{q}.up_proj.weight"), vec![sff, d]);
                    m.insert(format!("{q}.down_proj.weight"), vec![d, sff]);
                    m.insert(format!("{p}.mlp.shared_expert_gate.weight"), vec![1, d]);
                } else {
                    m.insert(format!("{p}.self_attn.q_norm.weight"), vec![hd]);
                    m.insert(format!("{p}.self_attn.k_norm.weight"), vec![hd]);
                }
            }
        }
    }
    m
}

/// The model of `hf` (training knobs: tiny's, sequences of 16, batches of 4).
fn config_of(hf: &Value) -> MoeConfig {
    let mut cfg = MoeConfig::from_hf_config_json(&hf.to_string()).expect("a supported config");
    cfg.seq_len = 16;
    cfg.batch = 4;
    cfg
}

/// A freshly initialised model of `cfg` written as a Hugging Face directory `dir`.
fn write_fresh(cfg: &MoeConfig, dir: &Path, shard_bytes: u64) -> interop::Written {
    let dense = DenseModel::new(cfg, &Device::Cpu).unwrap();
    let dense = dense.optimizer().unwrap().export().unwrap();
    let store = ExpertStore::all(cfg, &Device::Cpu).unwrap();
    let experts: Vec<_> = store
        .replicas()
        .into_iter()
        .map(|(l, e)| store.export(l, e).unwrap())
        .collect();
    let tensors = interop::export_tensors(cfg, &dense, &experts);
    interop::write_model_dir(dir, &interop::config_json(cfg), &tensors, shard_bytes).unwrap()
}

#[test]
fn an_export_has_the_hugging_face_names_and_shapes_of_each_family() {
    let dir = scratch("names");
    for (i, hf) in [mixtral(), qwen2_moe(), qwen3_moe(), deepseek_v3()]
        .iter()
        .enumerate()
    {
        let cfg = config_of(hf);
        let out = dir.join(format!("m{i}"));
        write_fresh(&cfg, &out, u64::MAX);
        let w = WeightsDir::open(&out).unwrap();
        let got: BTreeMap<String, Vec<usize>> = w
            .names()
            .map(|n| (n.to_owned(), w.shape(n).unwrap().to_vec()))
            .collect();
        let want = hf_names(hf);
        let missing: Vec<_> = want.keys().filter(|k| !got.contains_key(*k)).collect();
        let extra: Vec<_> = got.keys().filter(|k| !want.contains_key(*k)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{}: missing {missing:?}, extra {extra:?}",
            hf["architectures"][0]
        );
        assert_eq!(got, want, "{}: shapes", hf["architectures"][0]);
        // config.json is the family's, as read, with the dtype of the weights.
        let c: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(c["torch_dtype"], json!("float32"));
        assert_eq!(c["architectures"], hf["architectures"]);
        assert_eq!(c["hidden_size"], hf["hidden_size"]);
    }
    // The GPT family: the lazarus naming of the module docs.
    let cfg = MoeConfig::tiny();
    let out = dir.join("gpt");
    write_fresh(&cfg, &out, u64::MAX);
    let w = WeightsDir::open(&out).unwrap();
    assert_eq!(w.shape("h.1.experts.3.w1"), Some(&[64, 128][..]));
    assert_eq!(w.shape("h.1.experts.3.w2"), Some(&[128, 64][..]));
    assert_eq!(w.shape("wte"), Some(&[256, 64][..]));
    let c: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(c["model_type"], json!("lazarus_gpt_moe"));
    let back = interop::read_config(&out, &cfg).unwrap();
    assert_eq!(back, cfg);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sharded_export_has_a_correct_index_and_reads_back_the_same_values() {
    let dir = scratch("shards");
    let cfg = config_of(&mixtral());
    let one = dir.join("one");
    let many = dir.join("many");
    let w1 = write_fresh(&cfg, &one, u64::MAX);
    // ~8 KiB shards: the 32 KiB embedding gets one of its own, experts share.
    let w = write_fresh(&cfg, &many, 8 << 10);
    assert_eq!(w1.files, vec![WEIGHTS_FILE.to_owned()]);
    assert!(w.files.len() > 3, "{:?}", w.files);
    let n = w.files.len();
    for (i, f) in w.files.iter().enumerate() {
        assert_eq!(f, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }
    assert!(!many.join(WEIGHTS_FILE).exists());
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(many.join(INDEX_FILE)).unwrap()).unwrap();
    let a = WeightsDir::open(&one).unwrap();
    let b = WeightsDir::open(&many).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), a.names().count());
    let mut total = 0u64;
    for name in a.names() {
        let shape = a.shape(name).unwrap().to_vec();
        total += 4 * shape.iter().product::<usize>() as u64;
        // The index names the file that holds it, and the values are the same.
        let file = map[name].as_str().unwrap();
        assert_eq!(b.file_of(name).unwrap(), many.join(file));
        assert_eq!(
            a.read_f32(name, &shape).unwrap(),
            b.read_f32(name, &shape).unwrap(),
            "{name}"
        );
    }
    assert_eq!(index["metadata"]["total_size"], json!(total));
    assert_eq!(w.total_bytes, total);
    // A shard holds at most the limit unless it is one tensor alone.
    for f in &w.files {
        let in_file: Vec<&str> = map
            .iter()
            .filter(|(_, v)| v.as_str() == Some(f))
            .map(|(k, _)| k.as_str())
            .collect();
        let bytes: usize = in_file
            .iter()
            .map(|k| 4 * a.shape(k).unwrap().iter().product::<usize>())
            .sum();
        assert!(in_file.len() == 1 || bytes <= 8 << 10, "{f}: {bytes} bytes");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fixed batch of 3 sequences of 12 byte tokens, written as `lzrun logits --tokens` reads it.
fn tokens_file(dir: &Path) -> PathBuf {
    let text = b"The quick brown fox jumps over the lazy dog, twice over.";
    let batch: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            text[i * 12..i * 12 + 12]
                .iter()
                .map(|&b| u32::from(b))
                .collect()
        })
        .collect();
    let path = dir.join("tokens.json");
    std::fs::write(&path, serde_json::to_string(&batch).unwrap()).unwrap();
    path
}

/// `lzrun logits` of `source` (`--init-from DIR` or `--ckpt DIR`): the .npy bytes and loss.
fn logits(flag: &str, source: &Path, tokens: &Path, out: &Path) -> (Vec<u8>, f64) {
    let o = lzrun(&[
        "logits",
        flag,
        s(source),
        "--tokens",
        s(tokens),
        "--out",
        s(out),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let line: Value = serde_json::from_str(o.stdout.trim()).expect("one JSON line");
    assert_eq!(line["shape"], json!([3, 12, 256]));
    (std::fs::read(out).unwrap(), line["loss"].as_f64().unwrap())
}

/// Trains `steps` steps on 2 nodes from the Hugging Face directory `init` into `ckpt`
/// (checkpoint after every step), with `extra` flags.
fn train_from(init: &Path, ckpt: &Path, steps: &str, extra: &[&str]) -> Outcome {
    let mut args = vec![
        "local",
        "--nodes",
        "2",
        "--steps",
        steps,
        "--init-from",
        s(init),
        "--ckpt-dir",
        s(ckpt),
        "--ckpt-every",
        "1",
        "--ckpt-keep",
        "10",
        "--config",
        "tiny",
    ];
    args.extend_from_slice(extra);
    lzrun(&args)
}

/// init → train → export → `--init-from`: the logits of the export are those of the
/// checkpoint, bit for bit; the initial state went through `--init-from` bit for bit.
fn round_trip(name: &str, hf: Value, extra: &[&str]) {
    round_trip_then(name, hf, extra, |_| {});
}

/// [`round_trip`], then `check` on the trained export's directory.
fn round_trip_then(name: &str, hf: Value, extra: &[&str], check: impl FnOnce(&Path)) {
    let dir = scratch(name);
    let cfg = config_of(&hf);
    let init = dir.join("init");
    write_fresh(&cfg, &init, u64::MAX);
    let tokens = tokens_file(&dir);
    let ckpt = dir.join("ckpt");
    let o = train_from(&init, &ckpt, "3", extra);
    assert_eq!(o.code, Some(0), "{}", o.show());

    // The checkpoint of the initial state is the directory's weights, bit for bit: its export
    // is the same file, and its logits are those of the directory.
    let step0 = ckpt.join("step-00000000");
    let e0 = dir.join("export0");
    let o = lzrun(&["export", s(&step0), "--out", s(&e0)]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert_eq!(
        std::fs::read(e0.join(WEIGHTS_FILE)).unwrap(),
        std::fs::read(init.join(WEIGHTS_FILE)).unwrap(),
        "the initial checkpoint's export differs from the --init-from weights"
    );
    let (l_init, loss_init) = logits("--init-from", &init, &tokens, &dir.join("init.npy"));
    let (l_ck0, _) = logits("--ckpt", &step0, &tokens, &dir.join("ck0.npy"));
    assert!(l_init == l_ck0, "initial logits differ");

    // After 3 steps: the export's logits are the checkpoint's, bit for bit, and differ from
    // the initial ones (training changed the weights).
    let e = dir.join("export");
    let o = lzrun(&["export", s(&ckpt), "--out", s(&e)]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains("checkpoint after step 2"), "{}", o.show());
    let (l_ck, loss_ck) = logits("--ckpt", &ckpt, &tokens, &dir.join("ck.npy"));
    let (l_ex, loss_ex) = logits("--init-from", &e, &tokens, &dir.join("ex.npy"));
    assert!(
        l_ck == l_ex,
        "logits of the export differ from the checkpoint's"
    );
    assert_eq!(loss_ck.to_bits(), loss_ex.to_bits());
    assert!(l_ck != l_init, "3 steps left the logits as they were");
    assert!(loss_ck.is_finite() && loss_init.is_finite());

    // And a sharded export of the same checkpoint computes the same bits.
    let es = dir.join("export-sharded");
    let o = lzrun(&["export", s(&ckpt), "--out", s(&es), "--shard-size-mb", "1"]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let (l_sh, _) = logits("--init-from", &es, &tokens, &dir.join("sh.npy"));
    assert!(l_sh == l_ck);

    // Fine-tuning from the export: its initial checkpoint is the trained state, bit for bit.
    let ckpt2 = dir.join("ckpt2");
    let o = train_from(&e, &ckpt2, "1", extra);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let (l_ft0, _) = logits(
        "--ckpt",
        &ckpt2.join("step-00000000"),
        &tokens,
        &dir.join("ft0.npy"),
    );
    assert!(l_ft0 == l_ck);
    check(&e);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mixtral_round_trips_bit_for_bit_after_training() {
    round_trip("mixtral", mixtral(), &[]);
}

#[test]
fn qwen2_moe_round_trips_bit_for_bit_from_an_fsep_checkpoint() {
    round_trip("qwen2-fsep", qwen2_moe(), &["--expert-mode", "fsep"]);
}

#[test]
fn qwen3_moe_round_trips_bit_for_bit_after_training() {
    round_trip("qwen3", qwen3_moe(), &[]);
}

/// DeepSeek-V3 (a dense first block) from FSEP shards; the export carries the routing biases
/// training moved (they start at zero), so `--init-from` continues with the same choices.
#[test]
fn deepseek_v3_round_trips_bit_for_bit_with_its_routing_bias() {
    round_trip_then(
        "deepseek",
        deepseek_v3(),
        &["--expert-mode", "fsep"],
        |export| {
            let w = WeightsDir::open(export).unwrap();
            assert!(
                w.shape("model.layers.0.mlp.gate.e_score_correction_bias")
                    .is_none()
            );
            for l in 1..3 {
                let name = format!("model.layers.{l}.mlp.gate.e_score_correction_bias");
                assert_eq!(w.shape(&name), Some(&[8][..]));
                let v = w.read_f32(&name, &[8]).unwrap();
                assert!(v.iter().any(|&x| x != 0.0), "{name} never moved: {v:?}");
                // Three updates of ±0.001 (or none): within 0.003 of zero.
                assert!(v.iter().all(|x| x.abs() <= 0.0031), "{name}: {v:?}");
            }
        },
    );
}

/// `lzrun logits --init-from DIR`: exit 2 and one stderr line containing every `needles`.
fn refused(dir: &Path, tokens: &Path, needles: &[&str]) {
    let o = lzrun(&[
        "logits",
        "--init-from",
        s(dir),
        "--tokens",
        s(tokens),
        "--out",
        s(&dir.join("out.npy")),
    ]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert_eq!(o.stderr.trim().lines().count(), 1, "{}", o.show());
    for n in needles {
        assert!(o.stderr.contains(n), "{n:?} not in: {}", o.stderr);
    }
    assert!(!dir.join("out.npy").exists());
}

/// Rewrites `dir`'s single weights file with `edit` applied to its tensors.
fn rewrite(
    dir: &Path,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    ts.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut ts);
    let views: Vec<_> = ts
        .iter()
        .map(|(n, d, sh, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, sh.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let out = safetensors::tensor::serialize(views, Some(meta)).unwrap();
    std::fs::write(dir.join(WEIGHTS_FILE), out).unwrap();
}

#[test]
fn bad_model_directories_are_one_line_and_exit_2() {
    let dir = scratch("bad");
    let tokens = tokens_file(&dir);
    let cfg = config_of(&mixtral());
    let fresh = |name: &str| {
        let d = dir.join(name);
        write_fresh(&cfg, &d, u64::MAX);
        d
    };
    let gate = "model.layers.1.block_sparse_moe.experts.2.w3.weight";

    // A missing tensor.
    let d = fresh("missing");
    rewrite(&d, |ts| ts.retain(|t| t.0 != gate));
    refused(&d, &tokens, &["tensor", gate, "missing"]);

    // A wrong shape.
    let d = fresh("shape");
    rewrite(&d, |ts| {
        let t = ts.iter_mut().find(|t| t.0 == gate).unwrap();
        t.2 = vec![t.2[1], t.2[0]];
    });
    refused(&d, &tokens, &[gate, "shape [32, 48]", "[48, 32]"]);

    // A dtype that is not read (I32), and one that is (BF16: read, widened).
    let d = fresh("dtype");
    rewrite(&d, |ts| {
        let t = ts.iter_mut().find(|t| t.0 == gate).unwrap();
        t.1 = safetensors::Dtype::I32;
    });
    refused(&d, &tokens, &[gate, "I32"]);
    let d = fresh("bf16");
    rewrite(&d, |ts| {
        for t in ts.iter_mut() {
            t.1 = safetensors::Dtype::BF16;
            t.3 = t.3.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        }
    });
    let (_, loss) = logits("--init-from", &d, &tokens, &dir.join("bf16.npy"));
    assert!(loss.is_finite());

    // An extra tensor (a model this executor would not compute).
    let d = fresh("extra");
    rewrite(&d, |ts| {
        ts.push((
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight".into(),
            safetensors::Dtype::F32,
            vec![2],
            vec![0; 8],
        ))
    });
    refused(&d, &tokens, &["kv_a_proj_with_mqa", "not a parameter"]);

    // An unsupported architecture, and an unsupported field.
    let d = fresh("arch");
    let mut c = mixtral();
    c["architectures"] = json!(["LlamaForCausalLM"]);
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    refused(&d, &tokens, &["architectures", "LlamaForCausalLM"]);
    let d = fresh("field");
    let mut c = mixtral();
    c["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    refused(&d, &tokens, &["rope_scaling"]);

    // A truncated file.
    let d = fresh("truncated");
    let bytes = std::fs::read(d.join(WEIGHTS_FILE)).unwrap();
    std::fs::write(d.join(WEIGHTS_FILE), &bytes[..bytes.len() - 100]).unwrap();
    refused(&d, &tokens, &[WEIGHTS_FILE, "truncated"]);

    // An index naming a missing file.
    let d = dir.join("index");
    write_fresh(&cfg, &d, 8 << 10);
    std::fs::remove_file(d.join("model-00002-of-00009.safetensors"))
        .or_else(|_| {
            // The shard count follows the layout; remove the second shard whatever its name.
            let second = std::fs::read_dir(&d)
                .unwrap()
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().into_string().unwrap())
                .find(|n| n.starts_with("model-00002-of-"))
                .unwrap();
            std::fs::remove_file(d.join(second))
        })
        .unwrap();
    refused(
        &d,
        &tokens,
        &[INDEX_FILE, "model-00002-of-", "does not exist"],
    );

    // No weights at all.
    let d = dir.join("empty");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("config.json"), mixtral().to_string()).unwrap();
    refused(&d, &tokens, &["neither", WEIGHTS_FILE]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn init_from_refuses_bad_input_and_a_directory_with_checkpoints_and_loses_nothing() {
    let dir = scratch("init-refused");
    let cfg = config_of(&mixtral());
    let init = dir.join("init");
    write_fresh(&cfg, &init, u64::MAX);
    let ckpt = dir.join("ckpt");
    let o = train_from(&init, &ckpt, "1", &[]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    let listing = |p: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    let before = listing(&ckpt);

    // --init-from into a directory that holds checkpoints: refused, nothing touched.
    let o = train_from(&init, &ckpt, "2", &[]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert_eq!(o.stderr.trim().lines().count(), 1, "{}", o.show());
    assert!(
        o.stderr.contains("already holds checkpoints"),
        "{}",
        o.show()
    );
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        latest
    );
    assert_eq!(listing(&ckpt), before);

    // With --resume on it, the checkpoint wins and training goes on from it.
    let o = lzrun(&[
        "local",
        "--nodes",
        "2",
        "--steps",
        "3",
        "--init-from",
        s(&init),
        "--resume",
        s(&ckpt),
        "--ckpt-every",
        "1",
        "--ckpt-keep",
        "10",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(ckpt.join("step-00000003").is_dir(), "{}", o.show());
    assert!(ckpt.join("step-00000000").is_dir());

    // A bad model directory: one line, exit 2, the fresh checkpoint directory left empty of
    // checkpoints (no half-written initial state).
    let bad = dir.join("bad");
    write_fresh(&cfg, &bad, u64::MAX);
    rewrite(&bad, |ts| ts.retain(|t| t.0 != "model.norm.weight"));
    let fresh_ckpt = dir.join("ckpt-bad");
    let o = train_from(&bad, &fresh_ckpt, "2", &[]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert_eq!(o.stderr.trim().lines().count(), 1, "{}", o.show());
    assert!(o.stderr.contains("model.norm.weight"), "{}", o.show());
    assert!(
        listing(&fresh_ckpt)
            .iter()
            .all(|n| !n.starts_with("step-") && !n.starts_with(".staging") && n != "latest"),
        "{:?}",
        listing(&fresh_ckpt)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn export_refuses_a_missing_checkpoint_and_an_occupied_out() {
    let dir = scratch("export-refused");
    let o = lzrun(&["export", s(&dir.join("nope")), "--out", s(&dir.join("o"))]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert_eq!(o.stderr.trim().lines().count(), 1, "{}", o.show());
    // An --out outside the checkpoint directory (one inside it is refused first, by its own
    // rule: `an_export_into_the_checkpoint_directory_is_refused`).
    let out = scratch("export-refused-out");
    let o = lzrun(&["export", s(&dir), "--out", s(&out.join("o"))]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(o.stderr.contains("no valid checkpoint"), "{}", o.show());
    std::fs::remove_dir_all(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_restore_before_the_first_checkpoint_goes_back_to_the_init_from_weights() {
    let dir = scratch("init-restore");
    let cfg = config_of(&qwen3_moe());
    let init = dir.join("init");
    write_fresh(&cfg, &init, u64::MAX);
    let ckpt = dir.join("ckpt");
    // One replica per expert on 2 nodes of 2 slots: killing n1 after step 1 loses experts,
    // and the only checkpoint is the initial state (--ckpt-every 5 > --steps).
    let o = lzrun(&[
        "local",
        "--nodes",
        "2",
        "--steps",
        "3",
        "--init-from",
        s(&init),
        "--ckpt-dir",
        s(&ckpt),
        "--ckpt-every",
        "5",
        "--fault-tolerance",
        "1",
        "--slots",
        "2",
        "--kill",
        "1@1",
        "--join",
        "@1",
        "--format",
        "json",
    ]);
    let summary = o.summary();
    assert_eq!(summary.fallbacks, 1, "{}", o.show());
    assert!(
        o.stderr
            .contains("lost every replica: restoring a checkpoint"),
        "{}",
        o.show()
    );
    assert!(
        o.stderr
            .matches("restoring the checkpoint of the initial state")
            .count()
            >= 2,
        "{}",
        o.show()
    );
    assert_eq!(summary.steps, 3);
    std::fs::remove_dir_all(&dir).unwrap();
}
