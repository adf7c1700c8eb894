"""Cost-vs-size curves of issue 12 from the raw outputs of results/scale/curves.sh.

Reads results/scale/curves/*.json and *.time (GNU time: wall s, user s, sys s, peak RSS KB)
and writes results/scale/curves.csv (one row per measurement), curves.md (the tables of
results/scale/README.md, "Cost against cluster size") and curves.png (log-log plot).
Run from the repository root:  python3 results/scale/curves.py
"""

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402

HERE = Path(__file__).resolve().parent
RAW = HERE / "curves"
SYSTEMS = ["lazarus", "dropless-ft", "dropless", "ds-ft", "ds"]


def read_time(path: Path) -> dict:
    """The last line of a GNU time -f "%e %U %S %M" file (earlier lines are the command's
    own messages when it failed)."""
    last = path.read_text().strip().splitlines()[-1].split()
    wall, user, sys_s, rss_kb = (float(x) for x in last)
    return {"wall_s": wall, "cpu_s": user + sys_s, "rss_mb": rss_kb / 1024}


def nodes_of(path: Path) -> int:
    return int(re.search(r"-(\d+)", path.stem).group(1))


def rows() -> list[dict]:
    out = []
    for jf in sorted(RAW.glob("reconfig-*.json")):
        n = nodes_of(jf)
        d = json.loads(jf.read_text())
        t = read_time(jf.with_suffix(".time"))
        for what in ("plan", "replan"):
            out.append(
                {"what": what, "nodes": n, "system": "", "ms": d[f"{what}_ms"], **t}
            )
    for jf in sorted(RAW.glob("relayout-*.json")):
        n = nodes_of(jf)
        d = json.loads(jf.read_text())[0]
        assert d["policy"] == "laer", jf
        t = read_time(jf.with_suffix(".time"))
        out.append(
            {
                "what": "laer-decision",
                "nodes": n,
                "system": "laer",
                "ms": d["planner_ms_per_call"],
                "load_ratio": d["load_ratio_mean"],
                "decisions": d["relayouts"],
                **t,
            }
        )
    for jf in sorted(RAW.glob("replay-*-*.json")):
        m = re.fullmatch(r"replay-(\d+)-(.+)", jf.stem)
        n, system = int(m.group(1)), m.group(2)
        d = json.loads(jf.read_text())[0]
        assert d["system"] == system, jf
        t = read_time(jf.with_suffix(".time"))
        out.append(
            {
                "what": "replay-1d",
                "nodes": n,
                "system": system,
                "ms": t["wall_s"] * 1000.0,
                "samples_per_s": d["samples_per_s"],
                "ettr": d["ettr"],
                "faults_in_use": d["preemptions_in_use"],
                "recoveries": d["recoveries"],
                "restarts": d["fallbacks"],
                **t,
            }
        )
    return out


def fmt(x, digits=1):
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}"


def md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def main() -> int:
    data = rows()
    if not data:
        print(f"no raw outputs under {RAW}: run results/scale/curves.sh", file=sys.stderr)
        return 2
    df = pl.DataFrame(data, infer_schema_length=None).sort(["what", "nodes", "system"])
    df.write_csv(HERE / "curves.csv")

    def cost(what: str) -> pl.DataFrame:
        return df.filter(pl.col("what") == what).sort("nodes")

    plan, replan, laer = cost("plan"), cost("replan"), cost("laer-decision")
    replay = cost("replay-1d")
    sizes = sorted(df["nodes"].unique().to_list())

    def at(frame: pl.DataFrame, n: int, col: str, system: str | None = None):
        f = frame.filter(pl.col("nodes") == n)
        if system is not None:
            f = f.filter(pl.col("system") == system)
        return f[col][0] if f.height else None

    cost_rows = []
    for n in sizes:
        cost_rows.append(
            [
                fmt(n),
                fmt(n * 8),
                fmt(at(plan, n, "ms")),
                fmt(at(replan, n, "ms")),
                fmt(at(replan, n, "rss_mb"), 0),
                fmt(at(laer, n, "ms")),
                fmt(at(replay, n, "faults_in_use", "lazarus")),
                fmt(at(replay, n, "wall_s", "lazarus")),
                fmt(at(replay, n, "cpu_s", "lazarus")),
                fmt(at(replay, n, "rss_mb", "lazarus"), 0),
                fmt(at(replay, n, "wall_s", "ds-ft")),
                fmt(at(replay, n, "wall_s", "ds")),
            ]
        )
    cost_md = md_table(
        [
            "nodes",
            "GPUs",
            "plan ms",
            "replan ms",
            "reconfig RSS MB",
            "LAER decision ms",
            "faults in the day",
            "replay lazarus wall s",
            "CPU s",
            "RSS MB",
            "replay ds-ft wall s",
            "replay ds wall s",
        ],
        cost_rows,
    )
    buy_rows = []
    for n in sizes:
        faults = at(replay, n, "faults_in_use", "lazarus")
        for s in SYSTEMS:
            sps = at(replay, n, "samples_per_s", s)
            if sps is None:
                continue
            laz = at(replay, n, "samples_per_s", "lazarus")
            buy_rows.append(
                [
                    fmt(n),
                    fmt(faults),
                    s,
                    fmt(sps),
                    fmt(at(replay, n, "ettr", s), 3),
                    fmt(laz / sps, 1) + "×" if sps > 0 else "∞",
                    fmt(at(replay, n, "recoveries", s)),
                    fmt(at(replay, n, "restarts", s)),
                ]
            )
    buy_md = md_table(
        [
            "nodes",
            "faults in use",
            "system",
            "samples/s",
            "ETTR",
            "lazarus ÷ system",
            "in-place recoveries",
            "checkpoint restarts",
        ],
        buy_rows,
    )
    (HERE / "curves.md").write_text(
        "# Cost against cluster size (generated by results/scale/curves.py)\n\n"
        "Planner and replay cost, nodes of 8 GPUs (see results/scale/README.md):\n\n"
        + cost_md
        + "\n\nOne simulated day of Llama-3-like GPU faults (`--preset llama3-gpu`, seed 1), "
        "DeepSeek-V3 on H200:\n\n"
        + buy_md
        + "\n"
    )

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for frame, label in [
        (plan, "plan (whole model, E=256, L=58)"),
        (replan, "replan after losing 1 node"),
        (laer, "LAER decision (1 layer, 4 slots/GPU)"),
    ]:
        ax1.plot(frame["nodes"], frame["ms"], marker="o", label=label)
    ax1.set(xscale="log", yscale="log", xlabel="nodes (8 GPUs each)", ylabel="wall ms")
    ax1.set_title("planner cost")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    for s in ["lazarus", "dropless-ft", "ds-ft", "ds"]:
        # GNU time resolves 10 ms: drop zeros, which a log axis cannot show.
        f = replay.filter((pl.col("system") == s) & (pl.col("cpu_s") > 0))
        ax2.plot(f["nodes"], f["cpu_s"], marker="o", label=f"replay 1 day: {s}")
    ax2.set(xscale="log", yscale="log", xlabel="nodes (8 GPUs each)", ylabel="CPU s")
    ax2.set_title("simulator cost")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "curves.png", dpi=120)
    print(f"wrote {HERE / 'curves.md'}, curves.csv, curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
