#!/usr/bin/env bash
# Every replay here runs the paper's recovery rule (--recovery replan), as the committed outputs
# did; results/repair/ compares it with repair-first recovery (issue 42).
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
# One LAER decision at 1,024 x 256, alternating with the previous sparse version (checks that
# both decide the same), then with the reference.
cargo build --release --quiet -p lazarus-planner --example laer_decision
{ target/release/examples/laer_decision 5 prev; target/release/examples/laer_decision 2 ref; } \
  | tee "$out/laer_decision.txt"
cargo build --release --quiet --bin lzsim
for nodes in 2048 16384; do
  target/release/lzsim reconfig --nodes "$nodes" --gpus-per-node 8 --slots 32 --experts 256 \
    --layers 58 --fail 1 --format json > "$out/reconfig-$nodes.json"
done
cargo test -p lazarus-planner --test scale -- --nocapture 2>&1 | grep -E "reference ratio|600 nodes" \
  > "$out/quality.txt"

# GPU, node and rack failures: 54-day hardware traces at 2,048 nodes x 8 GPUs (counts by
# cause on stderr), recovery under GPU vs node failures, and the 54-day replay.
rm -f "$out"/failures-*-2048.csv "$out/failures.txt" "$out/nofail-2048.csv" "$out/replay-1d-alone.txt"
for preset in llama3 llama3-gpu rsc; do
  target/release/lzsim failures --nodes 2048 --preset "$preset" --duration 54d --seed 1 \
    --out "$out/failures-$preset-2048.csv" 2>> "$out/failures.txt"
done
# The same generator at 16,384 nodes x 8 GPUs (131,072 GPUs, issue 34 item 3): 3,415 GPU faults,
# 355 KB, not committed (results/scale/.gitignore); same seed, so the same command gives it back.
target/release/lzsim failures --nodes 16384 --preset llama3-gpu --duration 54d --seed 1 \
  --out "$out/failures-llama3-gpu-16384.csv" 2>> "$out/failures.txt"
for unit in "" "--gpus-per-node 8"; do
  # shellcheck disable=SC2086
  target/release/lzsim recovery --nodes 128 --slots 32 --experts 256 --layers 4 --f 2 \
    --place mro --failed 2,4,8,16 --method mc --trials 200000 $unit
done > "$out/recovery-gpu-vs-node.csv"
# Profiles of one replay day: build with line tables (CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
# CARGO_TARGET_DIR=<elsewhere> cargo build --release --bin lzsim) and run it under
# `perf record --call-graph dwarf` with `--system S --end 1d`.
# One day of the 54-day trace, five systems; then the 54-day replay (minutes of CPU: see the
# README). Wall clock and peak RSS from GNU time; note the load average.
/usr/bin/time -v target/release/lzsim replay --recovery replan "$out/failures-llama3-gpu-2048.csv" \
  --model deepseek-v3 --hardware h200-400g --system lazarus,dropless-ft,dropless,ds-ft,ds \
  --end 1d --format json > "$out/replay-1d.json" 2> "$out/replay-1d.txt"
# Each system alone for the same day: CPU time and peak RSS (the README compares them with the
# previous binary run the same way, outputs compared with cmp).
for s in lazarus ds-ft ds; do
  /usr/bin/time -f "$s %U s user %S s sys %e s wall %M KB" target/release/lzsim replay --recovery replan \
    "$out/failures-llama3-gpu-2048.csv" --model deepseek-v3 --hardware h200-400g --system "$s" \
    --end 1d --format json > "$out/replay-1d-$s.json" 2>> "$out/replay-1d-alone.txt"
done
# Failure-free throughput (6 h, no checkpoints; lazarus rebalances after 10 steps).
target/release/lzsim failures --nodes 2048 --gpu-hazard 0 --duration 1m > "$out/nofail-2048.csv" 2>/dev/null
for z in 1.2 0.6; do
  target/release/lzsim replay --recovery replan "$out/nofail-2048.csv" --model deepseek-v3 --hardware h200-400g \
    --system dropless,ds --end 6h --zipf "$z" --ckpt-every none --format json > "$out/nofail-z$z.json"
  target/release/lzsim replay --recovery replan "$out/nofail-2048.csv" --model deepseek-v3 --hardware h200-400g \
    --system lazarus --end 6h --zipf "$z" --ckpt-every none --rebalance-every 10 --format json \
    > "$out/nofail-lazarus-z$z.json"
done
cat /proc/loadavg > "$out/replay-54d.txt"
/usr/bin/time -v target/release/lzsim replay --recovery replan "$out/failures-llama3-gpu-2048.csv" \
  --model deepseek-v3 --hardware h200-400g --system lazarus,ds-ft,ds --format json \
  > "$out/replay-54d.json" 2>> "$out/replay-54d.txt"
/usr/bin/time -v target/release/lzsim replay --recovery replan "$out/failures-llama3-gpu-2048.csv" \
  --model deepseek-v3 --hardware h200-400g --system dropless-ft,dropless --format json \
  > "$out/replay-54d-dropless.json" 2>> "$out/replay-54d.txt"
# 131,072 GPUs (issue 34 item 3, see "131,072 GPUs over 54 days, second round" in the README):
# one simulated day of the three systems together, then each alone (CPU time, peak RSS; the
# README compares them with the previous binary's, outputs with cmp), the 54 days of the two
# baselines, and the standard-EP step cost against its per-layer path in one process.
cat /proc/loadavg > "$out/replay-1d-16384.txt"
/usr/bin/time -v target/release/lzsim replay --recovery replan "$out/failures-llama3-gpu-16384.csv" \
  --model deepseek-v3 --hardware h200-400g --system lazarus,ds-ft,ds --end 1d --format json \
  > "$out/replay-1d-16384.json" 2>> "$out/replay-1d-16384.txt"
rm -f "$out/replay-1d-16384-alone.txt"
for s in lazarus ds-ft ds; do
  /usr/bin/time -f "$s %U s user %S s sys %e s wall %M KB" target/release/lzsim replay --recovery replan \
    "$out/failures-llama3-gpu-16384.csv" --model deepseek-v3 --hardware h200-400g --system "$s" \
    --end 1d --format json > "$out/replay-1d-16384-$s.json" 2>> "$out/replay-1d-16384-alone.txt"
done
cat /proc/loadavg > "$out/replay-54d-16384-baselines.txt"
/usr/bin/time -v target/release/lzsim replay --recovery replan "$out/failures-llama3-gpu-16384.csv" \
  --model deepseek-v3 --hardware h200-400g --system ds-ft,ds --format json \
  > "$out/replay-54d-16384-baselines.json" 2>> "$out/replay-54d-16384-baselines.txt"
cat /proc/loadavg >> "$out/replay-54d-16384-baselines.txt"
cargo bench -p lazarus-simulator --bench replay -- ep_step_cost 2>&1 | tee "$out/bench-ep-step-cost.txt"
# The whole goal: 54 days of the three systems at 131,072 GPUs. About 50 min of CPU (measured:
# 2,994 s, 1.16 GB; lazarus about 40 s per simulated day), so it is opt-in: SCALE_54D_16384=1.
if [ "${SCALE_54D_16384:-0}" = 1 ]; then
  cat /proc/loadavg > "$out/replay-54d-16384.txt"
  /usr/bin/time -v target/release/lzsim replay --recovery replan "$out/failures-llama3-gpu-16384.csv" \
    --model deepseek-v3 --hardware h200-400g --system lazarus,ds-ft,ds --format json \
    > "$out/replay-54d-16384.json" 2>> "$out/replay-54d-16384.txt"
  cat /proc/loadavg >> "$out/replay-54d-16384.txt"
fi
# Sweep sharding: 4 shards concatenate to the unsharded CSV (also a test in simulator/tests).
sweep=(sweep --recovery replan --hazard 0.3,0.9 --seeds 8 --nodes 16 --duration 2h --model gpt-s --system lazarus,ds)
target/release/lzsim "${sweep[@]}" > "$out/sweep-whole.csv" 2> "$out/sweep-rate.txt"
for i in 1 2 3 4; do
  target/release/lzsim "${sweep[@]}" --shard "$i/4" 2>> "$out/sweep-rate.txt"
done > "$out/sweep-shards.csv"
cmp "$out/sweep-whole.csv" "$out/sweep-shards.csv" && echo "shards concatenate to the whole" >> "$out/sweep-rate.txt"
# Cost against cluster size, 64 to 16,384 nodes (curves.md, curves.png).
bash "$out/curves.sh"
