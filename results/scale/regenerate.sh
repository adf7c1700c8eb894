#!/usr/bin/env bash
# Regenerates the figures of results/scale/README.md (criterion benches + CLI timings).
# Run from the repository root:  bash results/scale/regenerate.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/scale
cargo bench -p lazarus-planner --bench scale 2>&1 | tee "$out/bench.txt"
# Phase times, thread CPU time and peak RSS (one size per process: VmHWM never goes down);
# the last argument spreads the Zipf exponent over the layers (different MRO shapes).
cargo build --release --quiet -p lazarus-planner --example scale_replan
for args in "2048 5 0" "16384 3 0" "2048 1 0.4" "16384 1 0.4"; do
  # shellcheck disable=SC2086
  target/release/examples/scale_replan $args
done | tee "$out/scale_replan.txt"
cargo build --release --quiet --bin lzsim
for nodes in 2048 16384; do
  target/release/lzsim reconfig --nodes "$nodes" --gpus-per-node 8 --slots 32 --experts 256 \
    --layers 58 --fail 1 --format json > "$out/reconfig-$nodes.json"
done
cargo test -p lazarus-planner --test scale -- --nocapture 2>&1 | grep -E "reference ratio|600 nodes" \
  > "$out/quality.txt"
