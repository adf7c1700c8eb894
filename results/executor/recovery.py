#!/usr/bin/env python3
"""Recovery latency of `lzrun local` kills: runs one job, timestamps every line of its output
as it arrives (CLOCK_MONOTONIC, this process), and prints one JSON line per kill.

    recovery.py LZRUN [lzrun local arguments...]     # one job; JSON lines on stdout
    recovery.py --summarize FILE.jsonl...             # p50/p95 per binary label

Per kill (the launcher's `killed node` line is t = 0):
  gone_ms     the controller's `node … is gone` (the agent's connection closed)
  reports_ms  the last survivor's `step S failed` before the new plan
  detect_ms   the new plan (`epoch E: plan vK`): every survivor reported, the replan is made
  resumed_ms  `reconfiguration done`: every member formed the new mesh and holds its state
  next_ms     the first step counted after the kill (the controller's step line)
  resume_ms   next_ms - detect_ms
  overhead_ms next_ms less that step's own compute (`steps.csv` step_ms, with --metrics-out):
              what the failure cost beyond the step itself, which is the machine's compute
The controller's own record of the same recovery (`reconfigurations.jsonl`: detect, replan,
migrate, resume ms) is added when the job wrote one (`--metrics-out`).
"""
import json
import os
import re
import statistics
import csv
import subprocess
import sys
import time

KILLED = re.compile(r"lzrun local: killed node (\S+) with SIGKILL after step (\d+)")
GONE = re.compile(r"\[controller\] node (\S+) is gone")
FAILED = re.compile(r"\[controller\] node (\S+): step (\d+) failed: (.*)")
PLAN = re.compile(r"\[controller\] epoch (\d+): plan v(\d+) \(([^)]*)\)")
DONE = re.compile(r"\[controller\] epoch (\d+): (\S+) reconfiguration done")
STEP = re.compile(r"^\s*step\s+(\d+)/\s*(\d+) \|")


def run(argv):
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         bufsize=1)
    lines = []
    for line in p.stdout:
        lines.append(((time.monotonic() - t0) * 1e3, line.rstrip("\n")))
    rc = p.wait()
    return rc, lines


def kills(lines):
    out = []
    cur = None
    for t, line in lines:
        m = KILLED.search(line)
        if m:
            if cur:
                out.append(cur)
            cur = {"node": m.group(1), "after_step": int(m.group(2)), "t": t, "errors": []}
            continue
        if cur is None:
            continue
        rel = t - cur["t"]
        if GONE.search(line) and "gone_ms" not in cur:
            cur["gone_ms"] = rel
        elif (m := FAILED.search(line)) and "detect_ms" not in cur:
            cur["reports_ms"] = rel
            cur["errors"].append(m.group(3))
        elif (m := PLAN.search(line)) and "detect_ms" not in cur:
            cur["detect_ms"] = rel
            cur["kind"] = m.group(3)
        elif DONE.search(line) and "detect_ms" in cur and "resumed_ms" not in cur:
            cur["resumed_ms"] = rel
        elif (m := STEP.search(line)) and "next_ms" not in cur:
            if int(m.group(1)) > cur["after_step"]:
                cur["next_ms"] = rel
                if "detect_ms" in cur:
                    cur["resume_ms"] = rel - cur["detect_ms"]
    if cur:
        out.append(cur)
    return out


def metrics_dir(argv):
    for i, a in enumerate(argv):
        if a == "--metrics-out" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def one(argv):
    load = os.getloadavg()[0]
    rc, lines = run(argv)
    ks = kills(lines)
    recs = []
    d = metrics_dir(argv)
    if d:
        try:
            with open(f"{d}/reconfigurations.jsonl") as f:
                recs = [json.loads(l) for l in f if l.strip()]
        except OSError:
            pass
        recs = [r for r in recs if r.get("kind") != "start"]
    step_ms = {}
    if d:
        try:
            with open(f"{d}/steps.csv") as f:
                # The last record of a step (a step redone after a rollback has two).
                step_ms = {int(r["step"]): float(r["step_ms"]) for r in csv.DictReader(f)}
        except OSError:
            pass
    for i, k in enumerate(ks):
        nxt = k["after_step"] + 1
        if "next_ms" in k and nxt in step_ms:
            k["next_step_ms"] = step_ms[nxt]
            k["overhead_ms"] = k["next_ms"] - step_ms[nxt]
        k["rc"] = rc
        k["label"] = os.environ.get("RECOVERY_LABEL", argv[0])
        k["load_1m"] = load
        k["nth"] = i + 1
        if i < len(recs):
            k["record"] = {x: recs[i].get(x) for x in
                           ("kind", "detect_ms", "replan_ms", "migrate_ms", "resume_ms")}
        print(json.dumps(k), flush=True)
    if rc != 0:
        sys.stderr.write(f"recovery.py: {' '.join(argv)} exited {rc}\n")
        for _, l in lines[-20:]:
            sys.stderr.write(l + "\n")


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    # Nearest rank (no interpolation): a value that was measured.
    k = max(0, min(len(xs) - 1, int(round(q / 100 * len(xs) + 0.5)) - 1))
    return xs[k]


def summarize(paths):
    rows = {}
    for p in paths:
        for line in open(p):
            if not line.strip():
                continue
            r = json.loads(line)
            rows.setdefault((r.get("label", "?"), r.get("nth", 1)), []).append(r)
    cols = ["gone_ms", "reports_ms", "detect_ms", "resumed_ms", "resume_ms", "next_ms",
            "next_step_ms", "overhead_ms"]
    print("| binary | kill | n | " + " | ".join(f"{c[:-3]} p50 / p95 ms" for c in cols) + " |")
    print("|---|---|---:|" + "---:|" * len(cols))
    for (label, nth), rs in sorted(rows.items()):
        cells = []
        for c in cols:
            xs = [r[c] for r in rs if c in r]
            cells.append(f"{pct(xs, 50):.0f} / {pct(xs, 95):.0f}" if xs else "–")
        which = "first" if nth == 1 else f"#{nth}"
        print(f"| {label} | {which} | {len(rs)} | " + " | ".join(cells) + " |")
    for (label, nth), rs in sorted(rows.items()):
        bt = sum(1 for r in rs if any("aborted" in e for e in r["errors"]))
        bad = sum(1 for r in rs if "next_ms" not in r or r.get("rc", 0) != 0)
        print(f"{label} kill {nth}: {len(rs)} kills, {bt} with a survivor reporting "
              f"'communicator aborted' (the controller's abort came first), {bad} incomplete")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2:])
    else:
        one(sys.argv[1:])
