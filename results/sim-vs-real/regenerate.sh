#!/usr/bin/env bash
# Regenerates results/sim-vs-real/: real `lzrun local` runs of the tiny model under faults
# (kills, simultaneous kills, a join, a checkpoint restore, a kill and a join, a spot trace),
# each predicted by `lzsim predict` with the profile `lzrun calibrate` measured on this machine
# just before that scenario's runs (hardware-<scenario>.toml). About 12 minutes.
# Run from anywhere:   bash results/sim-vs-real/regenerate.sh
# Environment: RUNS (runs per scenario, default 3), PROFILE (cargo profile of the binaries:
# debug, the default, or release), KEEP (a directory to keep the run directories in; by
# default they go to a temporary directory, removed at the end: they hold checkpoints).
# PREDICT_ONLY=1 skips the calibrations and the runs and predicts the runs kept in runs/ again
# with the kept profiles (after a change to the simulator).
# Other work on the machine slows the runs unevenly; the load average of each run is in the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/sim-vs-real
runs=${RUNS:-3}
profile=${PROFILE:-debug}
if [ "$profile" = release ]; then
  cargo build --release --quiet --bin lzrun --bin lzsim
else
  cargo build --quiet --bin lzrun --bin lzsim
fi
lzrun=target/$profile/lzrun
lzsim=target/$profile/lzsim
if [ -n "${KEEP:-}" ]; then work=$KEEP; mkdir -p "$work"; else
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi

# 1. Scenarios: name, then `lzrun local` arguments (40 steps of the tiny model each).
scenarios=(
  "kill|--nodes 4 --steps 40 --kill 2@12 --ckpt-every 10"
  "kill2|--nodes 6 --steps 40 --kill 1@12 --kill 4@12 --ckpt-every 10"
  "join|--nodes 4 --steps 40 --join @12 --ckpt-every 10"
  "restore|--nodes 4 --steps 40 --kill 0@12 --kill 1@12 --ckpt-every 10"
  "kill-join|--nodes 5 --steps 40 --kill 3@10 --join @24 --ckpt-every 10"
  "trace|--fault-trace $out/spot-5nodes.csv --time-scale 60 --steps 40 --ckpt-every 10"
  # The held-out run of issue 33 item 5 (80 steps): a kill, a double kill that restores the
  # checkpoint, a join, a kill.
  "heldout|--nodes 5 --steps 80 --kill 2@13 --kill 0@29 --kill 3@29 --join @41 --kill 4@55 --ckpt-every 10"
)
if [ -n "${PREDICT_ONLY:-}" ]; then
  for keep in "$out"/runs/*; do
    name=$(basename "$keep"); name=${name%-*}
    $lzsim predict "$keep/measured" --hardware "$out/hardware-$name.toml" --format json \
      --out "$keep/predicted" > /dev/null
    if [ "${keep##*-}" != 1 ]; then rm -f "$keep/predicted/overlay.svg"; fi
  done
  scenarios=()
else
  rm -rf "$out"/runs "$out"/hardware*.toml
  mkdir -p "$out/runs"
fi
for s in "${scenarios[@]}"; do
  name=${s%%|*}
  args=${s#*|}
  # 2. Calibrate right before each scenario's runs: the load other jobs put on this machine
  # changes within minutes, and every step time measured here moves with it.
  hw=$out/hardware-$name.toml
  $lzrun calibrate --nodes 6 --out "$hw" > "$work/calibrate-$name.log"
  for i in $(seq 1 "$runs"); do
    dir=$work/$name-$i
    rm -rf "$dir"
    # shellcheck disable=SC2086
    $lzrun local $args --metrics-out "$dir" --format json > /dev/null 2> "$work/$name-$i.log"
    keep=$out/runs/$name-$i
    mkdir -p "$keep/measured"
    cp "$dir"/{run.json,summary.json,steps.csv,timeseries.csv,reconfigurations.jsonl,routing.csv} "$keep/measured/"
    # The run's command names its scratch directory: keep this machine's paths out.
    sed -i "s|$work/|<work>/|g" "$keep/measured/run.json"
    $lzsim predict "$dir" --hardware "$hw" --format json --out "$keep/predicted" > /dev/null
    # One overlay plot per scenario is enough.
    if [ "$i" != 1 ]; then rm -f "$keep/predicted/overlay.svg"; fi
    echo "$name $i done"
  done
done

# 3. The table and the overlay plots.
python3 - "$out" "$runs" <<'PY'
import json, sys, os
out, runs = sys.argv[1], int(sys.argv[2])
counted = ["steps", "samples", "recoveries", "fallbacks", "joins", "rebalances"]
keys = ["wall_s", "steps", "samples", "recoveries", "fallbacks", "joins",
        "compute_s", "checkpoint_s", "reconfigure_s", "restore_s", "lost_s", "idle_s"]
phases = ["compute_s", "checkpoint_s", "reconfigure_s", "restore_s", "lost_s"]
rows = []
names = []
for d in sorted(os.listdir(f"{out}/runs")):
    name, i = d.rsplit("-", 1)
    if name not in names:
        names.append(name)
for name in names:
    for i in range(1, runs + 1):
        d = f"{out}/runs/{name}-{i}"
        p = json.load(open(f"{d}/predicted/prediction.json"))
        run = json.load(open(f"{d}/measured/run.json"))
        rows.append((name, i, p, run["host"].get("load_average_1m")))
def pct(e):
    return "–" if e is None else f"{100*e:+.1f}"
lines = []
lines.append("| scenario | run | load | wall s meas / pred (err %) | steps | samples | recov | fallbk | joins | rebal | "
             + " | ".join(k[:-2] + " s meas / pred (err %)" for k in phases) + " | idle s meas / pred |")
lines.append("|" + "---|" * (11 + len(phases)))
misses = []
for name, i, p, load in rows:
    m, q, e = p["measured"], p["predicted"], p["relative_error"]
    cells = [name, str(i), "?" if load is None else f"{load:.1f}",
             f"{m['wall_s']:.2f} / {q['wall_s']:.2f} ({pct(e['wall_s'])})"]
    for k in counted:
        cells.append(f"{m[k]}" if m[k] == q[k] else f"{m[k]} ≠ {q[k]}")
    for k in phases:
        cells.append(f"{m[k]:.2f} / {q[k]:.2f} ({pct(e[k])})")
    cells.append(f"{m['idle_s']:.2f} / {q['idle_s']:.2f}")
    lines.append("| " + " | ".join(cells) + " |")
    miss = []
    if e["wall_s"] is None or abs(e["wall_s"]) > 0.10:
        miss.append(f"wall {pct(e['wall_s'])} %")
    for k in phases:
        # A phase counts when either side spends at least 2 % of the wall time in it.
        big = max(m[k], q[k]) >= 0.02 * m["wall_s"]
        if big and (e[k] is None or abs(e[k]) > 0.25):
            miss.append(f"{k[:-2]} {pct(e[k])} %")
    for k in counted:
        if m[k] != q[k]:
            miss.append(f"{k} {m[k]} vs {q[k]}")
    if miss:
        misses.append(f"- {name} run {i}: " + ", ".join(miss))
# Per scenario: the three measured walls against the one prediction (the scenario and the
# profile are the same for its runs; what differs is the load other jobs put on the machine).
summary = ["| scenario | measured wall s (runs) | mean | spread (max-min)/mean | predicted | error of the mean |",
           "|---|---|---|---|---|---|"]
for name in names:
    ws = [p["measured"]["wall_s"] for n, _, p, _ in rows if n == name]
    pred = [p["predicted"]["wall_s"] for n, _, p, _ in rows if n == name][0]
    m = sum(ws) / len(ws)
    summary.append(f"| {name} | {' / '.join(f'{w:.2f}' for w in ws)} | {m:.2f} | "
                   f"{100 * (max(ws) - min(ws)) / m:.0f} % | {pred:.2f} | {100 * (pred / m - 1):+.1f} % |")
within = sum(1 for _, _, p, _ in rows if p["relative_error"]["wall_s"] is not None
             and abs(p["relative_error"]["wall_s"]) <= 0.10)
counts = sum(1 for _, _, p, _ in rows
             if all(p["measured"][k] == p["predicted"][k] for k in counted))
with open(f"{out}/table.md", "w") as f:
    f.write("\n".join(summary) + "\n\n")
    f.write(f"Runs with the predicted wall time within 10 %: {within} of {len(rows)}; "
            f"steps, samples, recoveries, fallbacks, joins and rebalances all equal: "
            f"{counts} of {len(rows)}.\n\n")
    f.write("\n".join(lines) + "\n")
    f.write("\nMisses of the goal (wall within 10 %, each phase with at least 2 % of the wall time "
            "within 25 %, counts equal):\n\n")
    f.write("\n".join(misses) + "\n" if misses else "none\n")
print(open(f"{out}/table.md").read())
PY
