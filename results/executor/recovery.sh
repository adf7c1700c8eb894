#!/usr/bin/env bash
# Recovery latency of a kill on 4 loopback nodes (issue 34 item 2): kill -> detect -> next
# step, p50/p95 over >= 20 kills per binary, an old and a new `lzrun` interleaved run by run
# so that both see the same machine load.
#
#   bash results/executor/recovery.sh NEW_LZRUN [OLD_LZRUN]
#
# ROUNDS (default 5) rounds; each round runs, for every binary in turn, one `lzrun local
# --nodes 4 --kill 2@S` job for each S in KILL_STEPS (default "3 4 5 6"): ROUNDS x 4 kills per
# binary, each the first failure of its job; odd rounds run OLD first, even rounds NEW first. LATER=1 adds, per round and binary, a 5-node job
# with two kills (the first and a later failure of one job). RUST_BACKTRACE is left as the
# caller has it (this machine's agents run with RUST_BACKTRACE=1, the setting that made the
# first failure slow). Raw JSON lines go to $OUT (default a temporary directory).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
new="${1:?usage: recovery.sh NEW_LZRUN [OLD_LZRUN]}"
old="${2:-}"
rounds="${ROUNDS:-5}"
steps_after="${STEPS_AFTER:-3}"
read -r -a kill_steps <<< "${KILL_STEPS:-3 4 5 6}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
bins=("new=$new")
[ -n "$old" ] && bins=("old=$old" "new=$new")
echo "recovery.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ), RUST_BACKTRACE=${RUST_BACKTRACE:-unset}, uptime before: $(uptime)"
for r in $(seq 1 "$rounds"); do
  order=("${bins[@]}")
  # Even rounds run the binaries in the other order, so neither always runs first.
  if [ $((r % 2)) = 0 ] && [ "${#bins[@]}" = 2 ]; then order=("${bins[1]}" "${bins[0]}"); fi
  for b in "${order[@]}"; do
    label="${b%%=*}"; exe="${b#*=}"
    for s in "${kill_steps[@]}"; do
      m="$out/m-$label-$r-$s"; rm -rf "$m"
      RECOVERY_LABEL="$label" python3 "$here/recovery.py" "$exe" local --nodes 4 \
        --steps $((s + 1 + steps_after)) --kill "2@$s" --metrics-out "$m" --ckpt-every 1000 \
        >> "$out/kills.jsonl"
    done
    if [ "${LATER:-0}" = 1 ]; then
      m="$out/m2-$label-$r"; rm -rf "$m"
      RECOVERY_LABEL="$label-5nodes" python3 "$here/recovery.py" "$exe" local --nodes 5 \
        --steps 14 --kill 2@4 --kill 3@9 --metrics-out "$m" --ckpt-every 1000 \
        >> "$out/kills.jsonl"
    fi
  done
done
echo "recovery.sh: uptime after: $(uptime)"
python3 "$here/recovery.py" --summarize "$out/kills.jsonl"
echo "raw: $out/kills.jsonl"
