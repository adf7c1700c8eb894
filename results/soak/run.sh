#!/usr/bin/env bash
# Soak of `lzrun local`: one run under a seeded storm of FAULTS mixed faults (kills, several
# nodes at once, joins racing kills, frozen workers and agents, controller kills, a full
# checkpoint disk), then an independent check of the final state. Writes results/soak/soak.md.
#
#   bash results/soak/run.sh                 # 1,000 faults, seed 1 (about 30-40 min on 2 cores)
#   FAULTS=100 SEED=3 bash results/soak/run.sh
#   EXTRA="--expert-mode fsep --shard-copies 2" bash results/soak/run.sh   # more lzrun flags
#   EXTRA="--relayout laer --relayout-every 8 --router-skew 4" bash results/soak/run.sh
#   OUT=results/soak/soak-fsep.md …          # where the table goes
set -euo pipefail
cd "$(dirname "$0")/../.."
FAULTS=${FAULTS:-1000}
SEED=${SEED:-1}
NODES=${NODES:-6}
STEPS=${STEPS:-$((FAULTS * 8 / 5 + 10))}
OUT=${OUT:-results/soak/soak.md}
commit=$(git rev-parse HEAD)
git diff --quiet HEAD -- . || commit="$commit with uncommitted changes"
cargo build --locked -p lazarus-executor --bin lzrun
work=$(mktemp -d)
# The nodes start the launcher's own executable: a copy, so a rebuild meanwhile changes nothing.
cp target/debug/lzrun "$work/lzrun"
args=(local --storm "$FAULTS" --storm-seed "$SEED" --nodes "$NODES" --steps "$STEPS"
  --ckpt-every 2 --timeout-ms 2000 --controller-down-ms 300
  --format json --out "$work/out" --metrics-out "$work/metrics")
# shellcheck disable=SC2206 # EXTRA is a list of flags, split on spaces on purpose
args+=(${EXTRA:-})
echo "lzrun ${args[*]}  (in $work)"
set +e
"$work/lzrun" "${args[@]}" > "$work/summary.json" 2> "$work/log"
code=$?
set -e
echo "exit code $code; log: $work/log"
shown="lzrun ${args[*]}"
python3 results/soak/summarize.py "$work" "$code" "${shown//$work/WORK}" "$commit" > "$OUT"
cat "$OUT"
