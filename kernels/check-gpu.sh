#!/usr/bin/env bash
# The prepared device check (issue 10): run on a GPU machine from the repository root, with the
# binaries staged by kernels/stage-gpu.sh in target/gpu-stage. Needs no Rust toolchain and no
# network: a driver (libcuda.so.1), nvidia-smi, and a Python with PyTorch whose site-packages
# hold the CUDA 13 libraries (libcublas/libcublasLt.so.13, libcurand.so.10, libcudart.so.13,
# libnccl.so.2). PYTHON=/path/to/venv/bin/python picks the interpreter (default: python3).
# About 3–4 minutes on one H200; every step has its own timeout.
#
# Writes results/gpu/report.json (and $OUT/report.json when OUT is set): the GPU, kernels vs the
# CPU references, permutation bandwidth vs a device-to-device copy, the MoE layer fwd+bwd in
# candle vs PyTorch on the same GPU, `lzrun local --device cuda` with 3 workers over TCP and a
# kill, one worker over NCCL, and the NCCL smoke tests (2 ranks when 2 GPUs are visible). Exit status 0 when every
# step passed, 1 otherwise (the report says which).
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:-target/gpu-stage}"
py="${PYTHON:-python3}"
results=results/gpu
mkdir -p "$results"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
logs="$work/logs"
mkdir -p "$logs"

for f in "$stage"/*.gz; do
    [[ -e "$f" ]] || { echo "check-gpu: nothing staged in $stage (run kernels/stage-gpu.sh)" >&2; exit 2; }
    b="$(basename "$f" .gz)"
    gunzip -c "$f" >"$work/$b" && chmod +x "$work/$b"
done

# The CUDA libraries from PyTorch's site-packages (never a link stub: the driver is the system's).
libs="$("$py" - <<'PY'
import glob, os, site
roots = set(site.getsitepackages())
try:
    import torch
    roots.add(os.path.dirname(os.path.dirname(torch.__file__)))
except Exception:
    pass
dirs = []
for r in sorted(roots):
    for pat in ("nvidia/*/lib", "nvidia/cu13/lib", "torch/lib"):
        dirs += [d for d in sorted(glob.glob(os.path.join(r, pat))) if d not in dirs]
print(":".join(dirs))
PY
)"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LZ_REQUIRE_GPU=1

# step NAME TIMEOUT CMD...: runs CMD, keeps its output and exit status for the report.
step() {
    local name="$1" t="$2"
    shift 2
    local t0=$SECONDS
    timeout "$t" "$@" >"$logs/$name.out" 2>"$logs/$name.err"
    echo "$? $((SECONDS - t0))" >"$logs/$name.rc"
    echo "check-gpu: $name: exit $(cut -d' ' -f1 "$logs/$name.rc") in $((SECONDS - t0)) s" >&2
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$logs/gpu.txt" 2>&1
for b in "$work"/*; do
    [[ -f "$b" ]] || continue
    ldd "$b" 2>&1 | grep 'not found' | sed "s|^|$(basename "$b"): |" >>"$logs/missing_libs.txt"
done
step kernels_device 120 "$work/kernels_device" --test-threads=1
step dispatch_bench 60 "$work/dispatch_bench" 16384 4096 2 64
step moe_candle 120 env MOE_BENCH_JSON=1 MOE_BENCH_DEVICE=cuda \
    MOE_BENCH_SHAPES=gpt_s_expert,gpt_s_layer MOE_BENCH_SECONDS=3 "$work/moe_layer"
step moe_candle_bf16 120 env MOE_BENCH_JSON=1 MOE_BENCH_DEVICE=cuda MOE_BENCH_PRECISION=bf16 \
    MOE_BENCH_SHAPES=gpt_s_expert,gpt_s_layer MOE_BENCH_SECONDS=3 "$work/moe_layer"
step moe_torch_bf16 120 env MOE_DEVICE=cuda MOE_DTYPE=bf16 MOE_BENCH_SECONDS=3 \
    "$py" results/executor/moe_layer_torch.py gpt_s_expert gpt_s_layer
step moe_torch_f32 120 env MOE_DEVICE=cuda MOE_DTYPE=f32 MOE_BENCH_SECONDS=3 \
    "$py" results/executor/moe_layer_torch.py gpt_s_expert gpt_s_layer
step lzrun_local 180 "$work/lzrun" local --device cuda --comm tcp --nodes 3 --kill 1@3 \
    --steps 8 --config tiny --format json
# One worker on the GPU with the default data plane for --device cuda: NCCL (world 1; NCCL
# cannot put two ranks on one GPU), its unique id carried over the worker's TCP mesh.
step lzrun_nccl_default 60 "$work/lzrun" local --device cuda --nodes 1 --steps 3 --format json
step nccl_smoke 120 "$work/executor_lib" --test-threads=1 comm::nccl device:: runtime::dispatch::

"$py" - "$logs" "$results/report.json" <<'PY'
import json, os, sys
logs, dest = sys.argv[1], sys.argv[2]
def read(name):
    p = os.path.join(logs, name)
    return open(p, errors="replace").read() if os.path.exists(p) else ""
def rc(name):
    r = read(name + ".rc").split()
    return (int(r[0]), int(r[1])) if r else (None, None)
def jsonl(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
def step(name, want_rc=0):
    code, secs = rc(name)
    return {"exit": code, "seconds": secs, "ok": code == want_rc,
            "stderr_tail": read(name + ".err")[-1500:]}
rep = {"gpu": read("gpu.txt").strip(), "missing_libs": read("missing_libs.txt").splitlines()}
rep["kernels_vs_cpu"] = step("kernels_device") | {"stdout_tail": read("kernels_device.out")[-1500:]}
b = jsonl(read("dispatch_bench.out"))
rep["permutation_bandwidth"] = step("dispatch_bench") | {"result": b[0] if b else None,
    "goal_ratio": 0.7, "meets_goal": bool(b) and b[0].get("ratio", 0) >= 0.7}
cand = {"f32": jsonl(read("moe_candle.out")), "bf16": jsonl(read("moe_candle_bf16.out"))}
torch = {"bf16": jsonl(read("moe_torch_bf16.out")), "f32": jsonl(read("moe_torch_f32.out"))}
cmp = []
for dtype, rows in cand.items():
    for c in rows:
        row = {"config": c["config"], "dtype": dtype, "tokens": c["tokens"],
               "candle_tokens_per_s": c["tokens_per_s"]}
        for label, trows in torch.items():
            t = next((r for r in trows if r["config"] == c["config"]), None)
            if t:
                row["torch_" + label + "_tokens_per_s"] = t["tokens_per_s"]
                row["ratio_vs_torch_" + label] = c["tokens_per_s"] / t["tokens_per_s"]
        cmp.append(row)
rep["moe_layer_fwd_bwd"] = {"candle_f32": step("moe_candle"), "candle_bf16": step("moe_candle_bf16"),
    "torch_bf16": step("moe_torch_bf16"), "torch_f32": step("moe_torch_f32"), "comparison": cmp,
    "goal_ratio": 0.7, "goal": "candle bf16 (experts' products in bf16, f32 masters; router f32) "
    "vs PyTorch bf16, same shapes"}
s = jsonl(read("lzrun_local.out"))
rep["lzrun_local_cuda_tcp_kill"] = step("lzrun_local") | {"summary": s[-1] if s else None}
rep["lzrun_local_cuda_default_comm"] = step("lzrun_nccl_default") | {
    "expected": "exit 0: one worker trains 3 steps over an NCCL communicator"}
rep["nccl_smoke"] = step("nccl_smoke") | {"stdout_tail": read("nccl_smoke.out")[-1500:]}
checks = [rep["kernels_vs_cpu"], rep["permutation_bandwidth"], rep["moe_layer_fwd_bwd"]["candle_f32"], rep["moe_layer_fwd_bwd"]["candle_bf16"],
          rep["lzrun_local_cuda_tcp_kill"], rep["lzrun_local_cuda_default_comm"], rep["nccl_smoke"]]
rep["all_ok"] = all(c["ok"] for c in checks)
text = json.dumps(rep, indent=2)
open(dest, "w").write(text + "\n")
if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], "report.json"), "w").write(text + "\n")
print(text)
sys.exit(0 if rep["all_ok"] else 1)
PY
