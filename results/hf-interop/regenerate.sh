#!/usr/bin/env bash
# Regenerates results/hf-interop/results.json: for each Hugging Face MoE family lzrun trains,
# transformers initialises a tiny model, lzrun trains it from there (--init-from) on 2 nodes
# and exports it (lzrun export), and the same batch runs through `lzrun logits` and
# transformers (float32, eager attention), for the initial and the trained weights.
#
#   bash results/hf-interop/regenerate.sh
#   PYTHON=/path/to/venv/bin/python STEPS=20 bash results/hf-interop/regenerate.sh
#
# Needs: cargo, and a Python with torch, transformers, safetensors and numpy
# (pip install torch transformers safetensors numpy; the CPU wheel of torch is enough).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
STEPS="${STEPS:-20}"
cargo build --release -p lazarus-executor --bin lzrun
"$PYTHON" results/hf-interop/compare.py --lzrun target/release/lzrun \
    --out results/hf-interop --steps "$STEPS"
