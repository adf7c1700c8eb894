"""Tables of results/repair/regenerate.sh: `paper TMP` or `scale TMP` (CSV on stdout)."""
import csv
import glob
import json
import os
import sys


def pct(xs, q):
    if not xs:
        return 0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def cells(rec, join, reb, pause):
    if rec is None:
        return [""] * 7
    return [f"{mean(rec):.1f}", pct(rec, 0.99), max(rec, default=0), f"{mean(join):.1f}",
            pct(join, 0.99), f"{mean(reb):.1f}", f"{mean(pause):.2f}"]


def paper(tmp):
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(["scenario", "system", "policy", "samples_per_s", "ettr", "recoveries",
                "fallbacks", "migrated_replicas", "reconfigure_s", "rebalance_s"])
    for policy in ("replan", "repair"):
        for f in sorted(glob.glob(os.path.join(tmp, policy, "*.json"))):
            name = os.path.basename(f)[:-5]
            for s in json.load(open(f)):
                if s["system"] != "lazarus" and policy == "repair":
                    continue  # the baselines do not depend on the policy
                w.writerow([name, s["system"], policy if s["system"] == "lazarus" else "-",
                            f'{s["samples_per_s"]:.3f}', f'{s["ettr"]:.4f}', s["recoveries"],
                            s["fallbacks"], s["migrated_replicas"],
                            f'{s["time"]["reconfigure"]:.1f}', f'{s["time"]["rebalance"]:.1f}'])


def scale(tmp):
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(["run", "policy", "system", "samples_per_s", "ettr", "recoveries", "fallbacks",
                "scale_outs", "rebalances", "moved_per_recovery_mean", "moved_per_recovery_p99",
                "moved_per_recovery_max", "moved_per_join_mean", "moved_per_join_p99",
                "moved_per_rebalance_mean", "reconfigure_pause_s_mean", "days_reconfiguring",
                "days_rebalancing", "migrated_replicas"])
    for run in ("s16384", "s2048"):
        for policy in ("replan", "repair"):
            d = os.path.join(tmp, f"{run}-{policy}")
            for s in json.load(open(d + ".json")):
                sysname = s["system"]
                if sysname != "lazarus" and policy == "repair":
                    continue
                rec, join, reb, pause = [], [], [], []
                ev = os.path.join(d, sysname, "events.jsonl")
                for line in open(ev) if os.path.exists(ev) else []:
                    e = json.loads(line)
                    k, det = e["kind"], e["detail"]
                    if k == "reconfigure":
                        rec.append(det.get("migrated_replicas", 0))
                        pause.append(det.get("pause_s", 0.0))
                    elif k == "scale_out":
                        join.append(det.get("migrated_replicas", 0))
                    elif k == "rebalance":
                        reb.append(det.get("migrated_replicas", 0))
                t = s["time"]
                if not os.path.exists(ev):  # no run directory: no per-event columns
                    rec = join = reb = pause = None
                w.writerow([run, policy if sysname == "lazarus" else "-", sysname,
                            f'{s["samples_per_s"]:.2f}', f'{s["ettr"]:.4f}', s["recoveries"],
                            s["fallbacks"], s["scale_outs"], s["rebalances"],
                            *cells(rec, join, reb, pause), f'{t["reconfigure"] / 86400:.3f}',
                            f'{t["rebalance"] / 86400:.3f}', s["migrated_replicas"]])


{"paper": paper, "scale": scale}[sys.argv[1]](sys.argv[2])
