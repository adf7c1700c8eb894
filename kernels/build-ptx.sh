#!/usr/bin/env bash
# Compiles the project's CUDA kernels (src/dispatch.cu) to PTX for the virtual architecture the
# crate embeds (compute_80, PTX ISA 9.0 with nvcc 13.0) and assembles that PTX with ptxas for
# every GPU generation we support: sm_80 (A100), sm_90 (H100/H200), sm_100 (B200), sm_120
# (RTX Blackwell). Needs nvcc and ptxas on PATH: `source kernels/setup-cuda.sh` first.
# Output: target/kernels/dispatch.ptx and dispatch.<sm>.cubin (a ptxas error fails the script).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/kernels
mkdir -p "$out"
nice -n 10 nvcc -ptx -O3 -std=c++17 -arch compute_80 -o "$out/dispatch.ptx" kernels/src/dispatch.cu
for sm in sm_80 sm_90 sm_100 sm_120; do
    nice -n 10 ptxas -O3 -arch "$sm" -o "$out/dispatch.$sm.cubin" "$out/dispatch.ptx"
done
echo "kernels: $(grep -m1 '^.version' "$out/dispatch.ptx"), assembled for sm_80 sm_90 sm_100 sm_120 ($(grep -c '^.visible .entry' "$out/dispatch.ptx") entry points)"
