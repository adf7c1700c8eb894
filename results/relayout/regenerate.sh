#!/usr/bin/env bash
# Regenerates results/relayout/: re-layout policies on SmartMoE's real gate trace and on a
# synthetic drifting-Zipf trace (GPT-L profile: 16 experts x 12 MoE layers; 4 h200-400g nodes x
# 8 GPUs, 2 slots per GPU; re-layout every 200 steps; f = 2, recovery floor 0.9 at k = 2).
# Run from the repository root:  bash results/relayout/regenerate.sh [path/to/shared/traces]
set -euo pipefail
cd "$(dirname "$0")/../.."
traces=${1:-../shared/traces}
out=results/relayout
cargo build --release --quiet --bin lzsim
lzsim=target/release/lzsim
policies=static,lazarus,eplb,eplb-remap,eplb-hier,flexmoe,laer
rm -rf "$out/smartmoe" "$out/zipf"
$lzsim relayout --routing "$traces/routing/smartmoe/derived/global_expert_counts.csv" \
  --policy "$policies" --out "$out/smartmoe" > "$out/smartmoe.txt"
$lzsim relayout --zipf 1.2 --drift-every 500 --steps 5000 \
  --policy "$policies" --out "$out/zipf" > "$out/zipf.txt"
# LAER's migration weight beta trades balance for bytes (the frontier in the README).
: > "$out/smartmoe-laer-beta.txt"
for beta in 1 10 30 100 300; do
  printf 'beta %s: ' "$beta" >> "$out/smartmoe-laer-beta.txt"
  $lzsim relayout --routing "$traces/routing/smartmoe/derived/global_expert_counts.csv" \
    --policy laer --migration-weight "$beta" | tail -1 >> "$out/smartmoe-laer-beta.txt"
done
