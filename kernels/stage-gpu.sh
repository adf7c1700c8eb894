#!/usr/bin/env bash
# Builds, here (no GPU needed), everything kernels/check-gpu.sh runs on a GPU machine, and
# stages it stripped and gzipped in target/gpu-stage (must stay under 64 MiB, the most a device
# run carries):
#   lzrun.gz            the CUDA build of lzrun (release)
#   executor_lib.gz     the executor's unit tests (release, feature cuda): NCCL smoke tests
#   moe_layer.gz        the MoE layer bench (MOE_BENCH_DEVICE=cuda)
#   kernels_device.gz   the kernels' device tests (CUDA vs the CPU references)
#   dispatch_bench.gz   permutation bandwidth vs a device-to-device copy
# Then run the check on the GPU machine from the repository root: kernels/check-gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=kernels/setup-cuda.sh
source kernels/setup-cuda.sh
stage=target/gpu-stage
rm -rf "$stage"
mkdir -p "$stage"
cargo_json() { nice -n 10 cargo "$@" --release --locked --features cuda --message-format=json-render-diagnostics; }
executables() { python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'; }
{
    cargo_json build -p lazarus-executor --bin lzrun
    cargo_json test -p lazarus-executor --lib --no-run
    cargo_json test -p lazarus-executor --bench moe_layer --no-run
    cargo_json test -p lazarus-kernels --test device --no-run
    cargo_json build -p lazarus-kernels --example dispatch_bench
} | executables | while read -r name exe; do
    case "$name" in
        lzrun) dest=lzrun ;;
        lazarus_executor) dest=executor_lib ;;
        moe_layer) dest=moe_layer ;;
        device) dest=kernels_device ;;
        dispatch_bench) dest=dispatch_bench ;;
        *) continue ;;
    esac
    strip -o "$stage/$dest" "$exe"
    gzip -6 -f "$stage/$dest"
done
du -b "$stage"/* | awk '{ s += $1; print } END { printf "total %.1f MiB\n", s / 1048576; if (s > 64 * 1048576) exit 1 }'
