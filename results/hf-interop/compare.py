#!/usr/bin/env python3
"""Does an `lzrun export` compute in `transformers` what it computes in `lzrun`? (issue 32)

For each Hugging Face MoE family `lzrun` trains (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3),
with a tiny config:

1. `transformers` initialises the model (`AutoModelForCausalLM.from_config`) and saves it
   (`save_pretrained`, safetensors); for Mixtral and the Qwens the script writes the family's
   `config.json` over the saved one (the same model, with `rope_theta` spelled at the top
   level, as the Hugging Face hub's configs do); DeepSeek-V3 keeps the `config.json`
   `transformers` wrote (its own spelling: `rope_parameters`, `head_dim`, `num_mtp_layers`).
2. `lzrun local --init-from INIT` trains it for a few steps on 2 nodes (in-place experts or
   FSEP), checkpointing into CKPT; `lzrun export CKPT --out EXPORT` writes it back.
3. A fixed batch of token ids (seeded) runs forward in `lzrun logits` (CPU, f32) and in
   `transformers` (`from_pretrained(EXPORT, dtype=float32, attn_implementation="eager")`,
   `labels = input_ids`), for the initial weights (INIT) and the trained ones (EXPORT).

Printed and written to results.json: per family and state, the max absolute difference of
the logits, the max relative error max|a - b| / max|b| (the goal is at most 1e-4), the mean
next-token cross-entropy of each and their difference.

Optional dependencies: torch, transformers, safetensors, numpy
(`pip install torch transformers safetensors numpy`).

    python3 results/hf-interop/compare.py --lzrun target/release/lzrun --out results/hf-interop
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 256  # the byte tokens of the embedded corpus `lzrun local` trains on

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    # Larger than the usual 0.02: logits of order 1 and routers that do not route uniformly.
    "initializer_range": 0.1,
}

FAMILIES = {
    "mixtral": dict(
        COMMON,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.02,
    ),
    "qwen2_moe": dict(
        COMMON,
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        intermediate_size=128,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        qkv_bias=True,
    ),
    # Multi-head latent attention with low-rank queries and interleaved rotary dims, sigmoid
    # scores, 4 groups of 2 experts (best 2 groups, top-2), one shared expert; of 3 blocks the
    # first is a dense MLP of 128, as the released model's first 3. The routing bias starts at
    # zero and is moved by training, so the trained export checks it too.
    "deepseek_v3": dict(
        COMMON,
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        num_hidden_layers=3,
        num_key_value_heads=4,
        intermediate_size=128,
        moe_intermediate_size=48,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "qwen3_moe": dict(
        COMMON,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        intermediate_size=128,
        moe_intermediate_size=48,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        # 3 blocks, the middle one a dense MLP of 128 (its MoE layers are blocks 0 and 2).
        num_hidden_layers=3,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        use_sliding_window=False,
        attention_bias=False,
    ),
}

# Extra `lzrun local` flags per family: one trains its experts as FSEP shards.
TRAIN_FLAGS = {
    "mixtral": [],
    "qwen2_moe": ["--expert-mode", "fsep"],
    "qwen3_moe": [],
    "deepseek_v3": [],
}

# Families whose config.json is the one `transformers` saved (not written over).
KEEP_SAVED_CONFIG = {"deepseek_v3"}


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def lzrun_logits(lzrun, model_dir, tokens_path, out_npy):
    line = run([lzrun, "logits", "--init-from", model_dir, "--tokens", tokens_path,
                "--out", out_npy])
    info = json.loads(line.strip().splitlines()[-1])
    return np.load(out_npy), float(info["loss"])


def hf_logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), labels=torch.tensor(ids))
    return out.logits.float().numpy(), float(out.loss)


def compare(a, b):
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {
        "max_abs_err": float(diff.max()),
        "max_rel_err": float(diff.max() / np.abs(b).max()),
        "max_abs_logit": float(np.abs(b).max()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lzrun", default="target/release/lzrun")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help="comma-separated subset of: " + ", ".join(FAMILIES))
    args = ap.parse_args()
    lzrun = os.path.abspath(args.lzrun)
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="lz-hf-interop-")
    rng = np.random.default_rng(1234)
    ids = rng.integers(0, VOCAB, size=(4, 32)).tolist()
    tokens_path = os.path.join(work, "tokens.json")
    with open(tokens_path, "w") as f:
        json.dump(ids, f)
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "batch": [len(ids), len(ids[0])],
        "steps": args.steps,
        "families": {},
    }
    for name in args.families.split(","):
        cfg = FAMILIES[name]
        d = os.path.join(work, name)
        init, ckpt, export = (os.path.join(d, x) for x in ("init", "ckpt", "export"))
        # 1. transformers initialises and saves; our config.json over its own.
        hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        model.save_pretrained(init, safe_serialization=True)
        if name not in KEEP_SAVED_CONFIG:
            with open(os.path.join(init, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2)
        # 2. lzrun trains from it and exports.
        train = run([lzrun, "local", "--nodes", "2", "--steps", str(args.steps),
                     "--init-from", init, "--ckpt-dir", ckpt, "--ckpt-every",
                     str(args.steps), "--format", "json"] + TRAIN_FLAGS[name])
        summary = json.loads(train.strip().splitlines()[-1])
        run([lzrun, "export", ckpt, "--out", export])
        row = {"train_flags": TRAIN_FLAGS[name],
               "initial_loss": summary.get("initial_loss"),
               "final_loss": summary.get("final_loss")}
        # 3. the same batch through both, before and after training.
        for state, model_dir in (("initial", init), ("trained", export)):
            lz, lz_loss = lzrun_logits(lzrun, model_dir, tokens_path,
                                       os.path.join(d, f"{state}.npy"))
            hf, hf_loss = hf_logits(model_dir, ids)
            assert lz.shape == hf.shape, (lz.shape, hf.shape)
            r = compare(lz, hf)
            r.update(lzrun_loss=lz_loss, transformers_loss=hf_loss,
                     loss_abs_diff=abs(lz_loss - hf_loss))
            row[state] = r
            print(f"{name:10s} {state:8s} max_rel_err {r['max_rel_err']:.3e} "
                  f"max_abs_err {r['max_abs_err']:.3e} loss lzrun {lz_loss:.6f} "
                  f"transformers {hf_loss:.6f}", flush=True)
        results["families"][name] = row
    results["not_checked"] = {
        "gpt": "the paper's GPT family has no transformers class (exported in the lazarus "
               "naming, read back only by lzrun).",
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    if args.keep:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
