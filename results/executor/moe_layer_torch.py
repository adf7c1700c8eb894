#!/usr/bin/env python3
"""PyTorch twin of executor/benches/moe_layer.rs: forward + backward of ONE MoE layer on CPU.

Same layer, same shapes, same numbers:
  probs = softmax(x @ W_r)                     (router Linear(d_model, experts), no bias)
  top-k experts per token (largest first)
  gates = probs[chosen], renormalised over the chosen experts when k >= 2,
          the raw probability when k == 1 (Switch)
  per expert: gather its tokens (ascending slot order), y_e = gelu_tanh(x_e @ w1) @ w2
  out = index_add of gate-weighted y_e
  lb  = E * sum_e (tokens_e / (n*k)) * mean_t probs[t, e]      (Switch load balancing)
  loss = mean(out**2) + 0.01 * lb ; loss.backward()  (grads of x, W_r, every w1/w2)

Inputs and weights come from the same SplitMix64 streams as the Rust bench (bit-identical
f32), so loss, routing counts and gradient norms can be compared with candle's.

Timing: 3 warm-up runs, then timed runs until 30 runs or 4 s (at least 5); prints one JSON
line per configuration with the median. Threads: MOE_THREADS (default 2).

GPU (kernels/check-gpu.sh): MOE_DEVICE=cuda runs on CUDA device 0 and adds the gpt_s_layer
shape (GPT-S's 4096 tokens per step); MOE_DTYPE=bf16 casts inputs and weights to bfloat16.
"""

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = [
    # name, d_model, d_ff, experts, top_k, tokens
    ("tiny", 64, 128, 4, 2, 256),
    ("medium", 256, 1024, 8, 2, 1024),
    ("gpt_s_expert", 768, 3072, 8, 1, 512),
]
GPU_SHAPES = [("gpt_s_layer", 768, 3072, 8, 1, 4096)]
DEVICE = os.environ.get("MOE_DEVICE", "cpu")
DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16}[os.environ.get("MOE_DTYPE", "f32")]
LB_LOSS_COEF = 0.01  # MoeConfig::tiny().lb_loss_coef
SALT_X, SALT_ROUTER = 1, 2


def salt_w1(e):
    return 100 + 2 * e


def salt_w2(e):
    return 101 + 2 * e


def det_uniform(salt, n, std):
    """Uniform in [-std*sqrt(3), std*sqrt(3)), element i from SplitMix64((salt << 32) + i)."""
    half_width = std * math.sqrt(3.0)
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(salt << 32)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return ((2.0 * u - 1.0) * half_width).astype(np.float32)


def make_layer(d, f, ne, n):
    std_out = 0.02 / math.sqrt(2.0 * 1)  # one layer, as in the Rust bench
    t = lambda a, shape: (  # noqa: E731
        torch.from_numpy(a.reshape(shape)).to(DEVICE, DTYPE).requires_grad_(True)
    )
    x = t(det_uniform(SALT_X, n * d, 1.0), (n, d))
    router = t(det_uniform(SALT_ROUTER, d * ne, 0.02), (d, ne))
    w1 = [t(det_uniform(salt_w1(e), d * f, 0.02), (d, f)) for e in range(ne)]
    w2 = [t(det_uniform(salt_w2(e), f * d, std_out), (f, d)) for e in range(ne)]
    return x, router, w1, w2


def moe(h, router, w1, w2, k):
    n = h.shape[0]
    ne = router.shape[1]
    probs = torch.softmax(h @ router, dim=-1)
    with torch.no_grad():
        choice = torch.topk(probs, k, dim=-1, sorted=True).indices  # [n, k]
        flat = choice.reshape(-1)
        _, slots = torch.sort(flat, stable=True)  # slots grouped by expert, ascending
        counts = torch.bincount(flat, minlength=ne)
        counts_host = counts.tolist()
    gates = probs.gather(1, choice)
    if k > 1:
        gates = gates / gates.sum(dim=1, keepdim=True)
    gates = gates.reshape(-1)
    out = torch.zeros_like(h)
    start = 0
    for e, c in enumerate(counts_host):
        if c == 0:
            continue
        si = slots[start : start + c]
        start += c
        ti = si // k
        y = F.gelu(h.index_select(0, ti) @ w1[e], approximate="tanh") @ w2[e]
        out = out.index_add(0, ti, y * gates.index_select(0, si).unsqueeze(1))
    frac = counts.to(probs.dtype) / float(n * k)
    lb = (probs.mean(dim=0) * frac).sum() * ne
    return out, lb, counts_host


def step(layer, k):
    x, router, w1, w2 = layer
    for p in [x, router, *w1, *w2]:
        p.grad = None
    out, lb, counts = moe(x, router, w1, w2, k)
    loss = out.square().mean() + LB_LOSS_COEF * lb
    loss.backward()
    return loss.item(), lb.item(), counts


def gnorm(ps):
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in ps if p.grad is not None))


def main():
    threads = int(os.environ.get("MOE_THREADS", "2"))
    torch.set_num_threads(threads)
    warmup = int(os.environ.get("MOE_BENCH_WARMUP", "3"))
    max_runs = max(1, int(os.environ.get("MOE_BENCH_RUNS", "30")))
    budget = float(os.environ.get("MOE_BENCH_SECONDS", "4"))
    only = set(sys.argv[1:])
    shapes = SHAPES + (GPU_SHAPES if DEVICE == "cuda" else [])
    for name, d, f, ne, k, n in shapes:
        if only and name not in only:
            continue
        layer = make_layer(d, f, ne, n)
        loss, lb, counts = step(layer, k)
        x, router, w1, w2 = layer
        check = {
            "loss": loss,
            "lb": lb,
            "counts": counts,
            "grad_norm_x": gnorm([x]),
            "grad_norm_router": gnorm([router]),
            "grad_norm_experts": gnorm([*w1, *w2]),
        }
        for _ in range(warmup):
            step(layer, k)
        times = []
        t_start = time.perf_counter()
        while len(times) < max_runs and (len(times) < 5 or time.perf_counter() - t_start < budget):
            t0 = time.perf_counter()
            step(layer, k)
            times.append(time.perf_counter() - t0)
        median = float(np.median(times))
        line = {
            "framework": "torch",
            "device": DEVICE,
            "dtype": os.environ.get("MOE_DTYPE", "f32"),
            "torch": torch.__version__,
            "config": name,
            "d_model": d,
            "d_ff": f,
            "experts": ne,
            "top_k": k,
            "tokens": n,
            "threads": torch.get_num_threads(),
            "runs": len(times),
            "median_s": median,
            "min_s": min(times),
            "tokens_per_s": n / median,
            **check,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
