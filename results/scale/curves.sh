#!/usr/bin/env bash
# Cost-vs-size curves of issue 12 (results/scale/README.md, "Cost against cluster size"):
# plan and replan, one LAER re-layout decision, and one simulated day of `lzsim replay`,
# from 64 to 16,384 nodes of 8 GPUs. Raw outputs go to results/scale/curves/, the table and
# the log-log plot are made by curves.py (polars + matplotlib: pip install -r
# notebooks/requirements.txt).
# Run from the repository root:  bash results/scale/curves.sh   (about 10 minutes on 2 cores)
# SIZES="64 256" bash results/scale/curves.sh runs a subset.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/scale/curves
mkdir -p "$out"
sizes=${SIZES:-"64 128 256 512 1024 2048 4096 8192 16384"}
cargo build --release --quiet --bin lzsim
lzsim=target/release/lzsim
# GNU time line: wall s, user s, sys s, peak RSS KB.
timed() { /usr/bin/time -f "%e %U %S %M" -o "$1" "${@:2}"; }
# One MoE layer of DeepSeek-V3 for the re-layout decision (the decision is per layer).
sed 's/^moe_layers = 58$/moe_layers = 1/' simulator/profiles/model/deepseek-v3.toml \
  > "$out/deepseek-v3-1layer.toml"
grep -q '^moe_layers = 1$' "$out/deepseek-v3-1layer.toml"
cat /proc/loadavg > "$out/loadavg-start.txt"
for n in $sizes; do
  # Whole-model plan and replan after losing one node: c = 32 slots per node (8 GPUs x 4),
  # E = 256, 58 MoE layers; plan_ms and replan_ms are the planner's own wall times.
  timed "$out/reconfig-$n.time" $lzsim reconfig --nodes "$n" --gpus-per-node 8 --slots 32 \
    --experts 256 --layers 58 --fail 1 --format json > "$out/reconfig-$n.json"
  # LAER re-layout: two decisions (steps 10 and 20); planner_ms_per_call is the mean wall
  # time of a decision. Its cost grows about as devices^1.6 (7 s at 2,048 nodes, 25 s at 4,096),
  # so it stops at LAER_MAX_NODES (default 4,096).
  if [ "$n" -le "${LAER_MAX_NODES:-4096}" ]; then
    timed "$out/relayout-$n.time" $lzsim relayout --policy laer --nodes "$n" --slots 4 \
      --model "$out/deepseek-v3-1layer.toml" --hardware h200-400g --steps 20 --period 10 \
      --format json > "$out/relayout-$n.json"
  fi
  # One day of Llama-3-like GPU faults (the llama3-gpu preset scales the per-GPU rate), then
  # the replay of each system alone (its own wall time and memory).
  $lzsim failures --nodes "$n" --preset llama3-gpu --duration 1d --seed 1 \
    --out "$out/failures-$n.csv" 2> "$out/failures-$n.txt"
  for s in lazarus dropless-ft dropless ds-ft ds; do
    timed "$out/replay-$n-$s.time" $lzsim replay --recovery replan "$out/failures-$n.csv" --model deepseek-v3 \
      --hardware h200-400g --system "$s" --end 1d --format json > "$out/replay-$n-$s.json"
  done
  rm "$out/failures-$n.csv"
  echo "nodes $n done: $(cat /proc/loadavg)"
done
cat /proc/loadavg > "$out/loadavg-end.txt"
python3 results/scale/curves.py
