#!/usr/bin/env bash
# Regenerates results/fsep/measured.md and its plots: real `lzrun local` runs on this machine of
# a small MoE (results/fsep/skew.toml) with routing forced skewed (a Zipf router bias), in five
# set-ups — static replicated, replicated + Lazarus rebalance, replicated + LAER re-layout,
# FSEP + LAER re-layout, and FSEP with two copies of every shard and a node killed mid-run —
# each predicted by `lzsim predict` with the profile `lzrun calibrate` measured just before.
# Run from anywhere:   bash results/fsep/measured.sh
# Environment: RUNS (runs per set-up, default 2), PROFILE (cargo profile: release, the
# default — candle in debug builds is ~30x slower and distorts the compute/communication
# balance — or debug), KEEP (keep the run directories there; default: a temporary directory).
# Needs python3 with polars and matplotlib (notebooks/requirements.txt) for the table and plots.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/fsep
runs=${RUNS:-2}
profile=${PROFILE:-release}
if [ "$profile" = release ]; then
  cargo build --release --quiet --bin lzrun --bin lzsim
else
  cargo build --quiet --bin lzrun --bin lzsim
fi
lzrun=target/$profile/lzrun
lzsim=target/$profile/lzsim
if [ -n "${KEEP:-}" ]; then work=$KEEP; mkdir -p "$work"; else
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi

# Every set-up: 4 nodes with 6 expert slots each (room for Eq. 1 to give hot experts more than
# f = 2 replicas: 24 slots for 8 experts), 60 steps, the same seed and the same forced skew (a
# Zipf 1.2 router bias), checkpoints every 20 steps; re-layouts every 10 steps after a 10-step
# warm-up.
common="--nodes 4 --slots 6 --steps 60 --config $out/skew.toml --seed 7 --router-skew 1.2 --ckpt-every 20"
relayout="--rebalance-every 10 --relayout-warmup 10"
setups=(
  "static|"
  "lazarus|$relayout --relayout lazarus"
  "laer|$relayout --relayout laer"
  "fsep-laer|--expert-mode fsep $relayout --relayout laer"
  "fsep2-kill|--expert-mode fsep --shard-copies 2 $relayout --relayout laer --kill 2@30"
)
rm -rf "$out/runs" "$out"/hardware.toml
mkdir -p "$out/runs"
hw=$out/hardware.toml
$lzrun calibrate --nodes 4 --out "$hw" > "$work/calibrate.log"
for s in "${setups[@]}"; do
  name=${s%%|*}
  args=${s#*|}
  for i in $(seq 1 "$runs"); do
    dir=$work/$name-$i
    rm -rf "$dir"
    # shellcheck disable=SC2086
    $lzrun local $common $args --metrics-out "$dir" --format json > /dev/null 2> "$work/$name-$i.log"
    keep=$out/runs/$name-$i
    mkdir -p "$keep/measured"
    cp "$dir"/{run.json,summary.json,steps.csv,timeseries.csv,reconfigurations.jsonl} "$keep/measured/"
    # The run's command names its scratch directory: keep this machine's paths out.
    sed -i "s|$work/|<work>/|g" "$keep/measured/run.json"
    $lzsim predict "$dir" --hardware "$hw" --format json --out "$keep/predicted" > /dev/null
    rm -f "$keep/predicted/overlay.svg"
    echo "$name $i done"
  done
done
python3 "$out/measured.py" "$out" "$runs"
echo "wrote $out/measured.md"
