"""Builds results/replay/table.md from the run summaries (standard library only).

Usage: python3 results/replay/tabulate.py results/replay
"""
import json
import sys
from pathlib import Path

# The paper's numbers (Lazarus arXiv 2407.04656 v2, §6.5–6.7), as ratios of samples trained.
PAPER = {
    ("mtbf5m", "gpt-s"): ("2.8x", "1.4x"),
    ("mtbf5m", "gpt-l"): ("5.7x", "2.8x"),
    ("mtbf40m", "gpt-s"): ("1.6x", "≈1.6x: DS ≈ DS(FT)"),
    ("mtbf40m", "gpt-l"): ("2.3x", "≈2.3x: DS ≈ DS(FT)"),
    ("p3-80m", "gpt-s"): ("2.3x", "1.2x"),
    ("p3-80m", "gpt-l"): ("3.4x", "1.8x"),
}


def load(path):
    return {s["system"]: s for s in json.loads(path.read_text())}


def main(root):
    root = Path(root)
    lines = [
        "| scenario | model | lazarus samples | ds-ft | ds | lazarus/ds (paper) | lazarus/ds-ft (paper) | lazarus fallbacks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario in ["mtbf5m", "mtbf40m", "p3-80m"]:
        for model in ["gpt-s", "gpt-m", "gpt-l"]:
            f = root / f"{scenario}-{model}.json"
            if not f.exists():
                continue
            s = load(f)
            lz, ft, ds = (s[k]["samples"] for k in ("lazarus", "ds-ft", "ds"))
            p_ds, p_ft = PAPER.get((scenario, model), ("–", "–"))
            lines.append(
                f"| {scenario} | {model} | {lz} | {ft} | {ds} | {lz / ds:.2f}x ({p_ds}) "
                f"| {lz / ft:.2f}x ({p_ft}) | {s['lazarus']['fallbacks']} |"
            )
    lines += ["", "Time breakdown, P3 80 min, GPT-L (% of wall time; paper Fig. 11):", ""]
    lines += ["| system | compute | lost | checkpoint | restart | reconfigure | rebalance | idle |",
              "|---|---|---|---|---|---|---|---|"]
    f = root / "p3-80m-gpt-l.json"
    if f.exists():
        for name, s in load(f).items():
            t, d = s["time"], s["duration_s"]
            cells = " | ".join(f"{100 * t[k] / d:.1f}" for k in
                               ["compute", "lost", "checkpoint", "restart", "reconfigure", "rebalance", "idle"])
            lines.append(f"| {name} | {cells} |")
    f = root / "table2.json"
    if f.exists():
        paper = {("gpt-s", 2): (11, 2.3, 21.3), ("gpt-s", 3): (52, 3.0, 34.1),
                 ("gpt-l", 4): (160, 7.6, 18.2), ("gpt-l", 5): (55, 7.8, 19.7)}
        lines += ["", "Reconfiguration cost (paper Table 2), mean over all failure sets that are recoverable:", "",
                  "| model | step | lost nodes | replicas moved (paper) | transfer s (paper) | reconfig s (paper) | unrecoverable sets |",
                  "|---|---|---|---|---|---|---|"]
        for r in json.loads(f.read_text()):
            p = paper.get((r["model"], r["failed"]), ("–", "–", "–"))
            lines.append(
                f"| {r['model']} | {r['step']} | {r['failed']} | {r['replicas_mean']:.1f} ({p[0]}) "
                f"| {r['transfer_s_mean']:.2f} ({p[1]}) | {r['reconfig_s_mean']:.1f} ({p[2]}) "
                f"| {r['unrecoverable']}/{r['failure_sets']} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/replay")
