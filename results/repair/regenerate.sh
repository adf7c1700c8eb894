#!/usr/bin/env bash
# Regenerates results/repair/ (issue 42): repair-first recovery against the paper's replan.
# Run from the repository root:   bash results/repair/regenerate.sh [path/to/shared/traces]
#  1. `--recovery replan` reproduces the committed paper scenarios of results/replay byte for
#     byte (stdout JSON and whole run directories), and the committed 2,048-node day of
#     results/scale;
#  2. the paper scenarios with `--recovery repair` (paper.csv);
#  3. one simulated day at 16,384 nodes x 8 GPUs and 54 days at 2,048 nodes (Llama-3 GPU
#     failure rate, DeepSeek-V3 on H200), both policies: states moved per recovery and per
#     join (16,384 nodes, from the run directories' events), reconfiguration time, ETTR,
#     samples/s, CPU and wall time (GNU time). The 54-day runs write no run directory, as the
#     committed results/scale/replay-54d.json was made (`--out` adds sampling events, which
#     changes the last digit of the averages).
# The load average is written next to each timing.
set -euo pipefail
cd "$(dirname "$0")/../.."
traces=${1:-../shared/traces}
loads=$traces/routing/smartmoe/derived/global_expert_counts.csv
p3=$traces/bamboo/traces/p3-trace.csv
out=results/repair
tmp=${LAZARUS_REPAIR_TMP:-$(mktemp -d)}
cargo build --release --quiet --bin lzsim
lzsim=target/release/lzsim
# A run directory equal to a committed one: every file, and config.json but for the command line
# and the commit it records.
same_run() { # new dir, committed dir
  diff -r -q -x config.json "$1" "$2" > /dev/null && python3 - "$1/config.json" "$2/config.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
for d in (a, b):
    d.pop("command", None)
    d.pop("git_commit", None)
sys.exit(0 if a == b else 1)
PY
}
scenario() { # policy, name, then lzsim replay arguments
  local policy=$1 name=$2; shift 2
  $lzsim replay "$@" --loads-trace "$loads" --recovery "$policy" --out "$tmp/$policy/$name" \
    --format json > "$tmp/$policy/$name.json"
}
: > "$out/identical.txt"
for policy in replan repair; do
  mkdir -p "$tmp/$policy"
  for m in gpt-s gpt-m gpt-l; do
    scenario $policy "mtbf5m-$m" --model "$m" traces/data/paper-5min-10nodes.csv --end 30m \
      --ckpt-every ds=50,ds-ft=250,lazarus=0
    scenario $policy "mtbf40m-$m" --model "$m" traces/data/paper-40min-10nodes.csv --end 240m \
      --ckpt-every ds=200,ds-ft=1000,lazarus=0
    if [ -f "$p3" ]; then
      scenario $policy "p3-80m-$m" --model "$m" "$p3" --window 0m..80m --max-nodes 10 \
        --map track --ckpt-every ds=50,ds-ft=250,lazarus=250
    fi
  done
done
for f in "$tmp"/replan/*.json; do
  name=$(basename "$f" .json)
  if cmp -s "$f" "results/replay/$name.json" && same_run "$tmp/replan/$name" "results/replay/$name"; then
    echo "identical: results/replay/$name (stdout, and the run directory but the command line and commit in config.json)" >> "$out/identical.txt"
  else
    echo "DIFFERENT: results/replay/$name" >> "$out/identical.txt"
  fi
done
python3 "$out/summarize.py" paper "$tmp" > "$out/paper.csv"
# Frontier scale.
$lzsim failures --nodes 2048 --preset llama3-gpu --duration 54d --seed 1 \
  --out "$tmp/f2048.csv" 2> /dev/null
$lzsim failures --nodes 16384 --preset llama3-gpu --duration 54d --seed 1 \
  --out "$tmp/f16384.csv" 2> /dev/null
$lzsim replay "$tmp/f2048.csv" --model deepseek-v3 --hardware h200-400g \
  --system lazarus,dropless-ft,dropless,ds-ft,ds --end 1d --recovery replan --format json \
  > "$tmp/replay-1d.json"
if cmp -s "$tmp/replay-1d.json" results/scale/replay-1d.json; then
  echo "identical: results/scale/replay-1d.json" >> "$out/identical.txt"
else
  echo "DIFFERENT: results/scale/replay-1d.json" >> "$out/identical.txt"
fi
: > "$out/timing.txt"
for policy in replan repair; do
  echo "load before 16384/1d/$policy: $(cat /proc/loadavg)" >> "$out/timing.txt"
  /usr/bin/time -f "16384 nodes, 1 day, lazarus, $policy: %U s user %S s sys %e s wall %M KB" \
    $lzsim replay "$tmp/f16384.csv" --model deepseek-v3 --hardware h200-400g --system lazarus \
    --end 1d --recovery "$policy" --out "$tmp/s16384-$policy" --format json \
    > "$tmp/s16384-$policy.json" 2>> "$out/timing.txt"
  echo "load before 2048/54d/$policy: $(cat /proc/loadavg)" >> "$out/timing.txt"
  /usr/bin/time -f "2048 nodes, 54 days, lazarus,ds-ft,ds, $policy: %U s user %S s sys %e s wall %M KB" \
    $lzsim replay "$tmp/f2048.csv" --model deepseek-v3 --hardware h200-400g \
    --system lazarus,ds-ft,ds --recovery "$policy" --format json \
    > "$tmp/s2048-$policy.json" 2>> "$out/timing.txt"
done
echo "load after: $(cat /proc/loadavg)" >> "$out/timing.txt"
if cmp -s "$tmp/s2048-replan.json" results/scale/replay-54d.json; then
  echo "identical: results/scale/replay-54d.json" >> "$out/identical.txt"
else
  echo "DIFFERENT: results/scale/replay-54d.json" >> "$out/identical.txt"
fi
python3 "$out/summarize.py" scale "$tmp" > "$out/scale.csv"
rm -rf "$tmp"
