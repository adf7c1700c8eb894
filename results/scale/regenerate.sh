#!/usr/bin/env bash
# Regenerates the figures of results/scale/README.md (criterion benches + CLI timings).
# Run from the repository root:  bash results/scale/regenerate.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/scale
cargo bench -p lazarus-planner --bench scale 2>&1 | tee "$out/bench.txt"
cargo build --release --quiet --bin lzsim
for nodes in 2048 16384; do
  target/release/lzsim reconfig --nodes "$nodes" --gpus-per-node 8 --slots 32 --experts 256 \
    --layers 58 --fail 1 --format json > "$out/reconfig-$nodes.json"
done
cargo test -p lazarus-planner --test scale -- --nocapture 2>&1 | grep -E "reference ratio|600 nodes" \
  > "$out/quality.txt"
