#!/usr/bin/env bash
# Regenerates every table and plot in results/recovery/. Run from the repository root:
#   bash results/recovery/regenerate.sh [path/to/global_expert_counts.csv]
# The SmartMoE gate trace is read from where you keep it (default: ../shared/traces/...).
set -euo pipefail
cd "$(dirname "$0")/../.."
trace=${1:-../shared/traces/routing/smartmoe/derived/global_expert_counts.csv}
out=results/recovery
cargo build --release --quiet --bin lzsim
lzsim=target/release/lzsim
# Paper testbed: 10 nodes x 6 slots, f = 2, 12 MoE layers, loads from SmartMoE iteration 201
# (the paper's "step 200"); GPT-S has 8 experts, GPT-L 16.
for model in gpt-s:8 gpt-l:16; do
  name=${model%%:*}; experts=${model##*:}
  $lzsim recovery --layers 12 --experts "$experts" --loads-file "$trace" --iter 201 \
    --place mro,spread,compact --failed 0..6 \
    --plot "$out/$name-it201.png" > "$out/$name-it201.csv"
  $lzsim recovery --layers 12 --experts "$experts" --loads-file "$trace" --iter 201 \
    --place mro --align independent --failed 0..6 > "$out/$name-it201-independent.csv"
done
# Rack failures: 10 nodes in 5 racks (node j in rack j mod 5), GPT-L.
$lzsim recovery --layers 12 --experts 16 --loads-file "$trace" --iter 201 \
  --place mro,spread,compact --racks 5 --failed 0..3 > "$out/gpt-l-it201-racks5.csv"
