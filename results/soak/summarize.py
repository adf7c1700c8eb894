"""Summarises one soak run of `lzrun local --storm` (see run.sh): faults injected by kind,
what the job did, and an independent check that every copy of the final state is identical.

usage: summarize.py WORK_DIR EXIT_CODE COMMAND COMMIT

COMMIT is the commit the binary was built from (run.sh records it before the build: lzrun's
own `git_commit` is read when the run ends, from whatever the checkout holds by then).
"""
import collections
import glob
import json
import os
import sys

work, code, command, commit = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
summary = json.load(open(os.path.join(work, "summary.json"))) if code == 0 else {}
run = json.load(open(os.path.join(work, "metrics", "run.json")))
kinds = collections.Counter(i["kind"] for i in run["timeline"]["injected"])

# Independent of lzrun's own end-of-job check: every surviving worker's checksums. `dense`
# fingerprints the dense weights with their AdamW moments and step counter; each replica's
# `checksum` its weights, moments and step; each FSEP shard copy's `checksum` that slice of
# every expert with its moments and step (worker/protocol.rs `Checksums`).
files = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(work, "out", "node*.json")))]
# A node that joined but never became a member (world 0: it never trained) holds no job state.
nodes = [n for n in files if n.get("world", 0) > 0]
divergences = 0
replicas = collections.defaultdict(set)
shards = collections.defaultdict(set)
for n in nodes:
    divergences += n["dense"] != nodes[0]["dense"]
    for r in n["replicas"]:
        replicas[(r["layer"], r["expert"])].add((r["checksum"], r["weights_checksum"]))
    for s in n.get("shards", []):
        shards[s["shard"]].add(s["checksum"])
divergences += sum(len(v) - 1 for v in replicas.values())
divergences += sum(len(v) - 1 for v in shards.values())
held = len(replicas)
# FSEP: shard indices run 0..S-1 for the cut of the last start or restore.
shards_missing = [s for s in range(max(shards, default=-1) + 1) if s not in shards]

print("# Soak of `lzrun local --storm`\n")
print(f"Command (by `bash results/soak/run.sh`):\n\n```\n{command}\n```\n")
print("| what | value |\n|---|---|")
print(f"| built from commit | {commit} |")
print(f"| exit code | {code} |")
print(f"| faults injected | {sum(kinds.values())} |")
for k, v in sorted(kinds.items()):
    print(f"| &nbsp;&nbsp;{k} | {v} |")
if summary:
    print(f"| steps | {summary['steps']} |")
    print(f"| wall time | {summary['wall_s'] / 60:.1f} min |")
    print(f"| in-place recoveries / checkpoint restores / joins | "
          f"{summary['recoveries']} / {summary['fallbacks']} / {summary['joins']} |")
    print(f"| loss first step → last step | {summary['initial_loss']:.3f} → "
          f"{summary['final_loss']:.3f} |")
print(f"| surviving workers checked | {len(nodes)} (+{len(files) - len(nodes)} never members) |")
if shards:
    print(f"| FSEP shard indices held (missing) | {len(shards)} ({shards_missing or 'none'}) |")
else:
    print(f"| experts × layers held | {held} |")
print(f"| divergences (dense, replica or shard-copy checksums that differ) | {divergences} |")
host = run.get("host", {})
if "load_average_1m" in host:
    print(f"| load average at the end (1 min) | {host['load_average_1m']} |")
