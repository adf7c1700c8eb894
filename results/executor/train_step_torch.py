#!/usr/bin/env python3
"""PyTorch twin of executor/benches/train_step.rs: one whole training step on the CPU.

The executor's model (executor/src/model/dense.rs, experts.rs, train.rs), written as a PyTorch
user would write it, eager mode, same shapes and thread count:
  x = wte[tokens] + wpe[:s]; per block (pre-norm):
    x += proj(causal softmax attention(qkv(ln1(x))))            (mask -1e9, as in candle)
    x += MoE(ln2(x)): softmax router, top-k, gates (renormalised when k >= 2), per-expert
         gather -> gelu_tanh(x @ w1) @ w2 -> gate-weighted index_add  (moe_layer_torch.moe)
  logits = ln_f(x) @ wte.T (tied head); loss = cross_entropy + lb_coef * mean_layers(lb)
  loss.backward(); clip_grad_norm_(1.0); AdamW(lr, betas (0.9, 0.999), eps 1e-8, wd 0.01)
Tokens are byte values (the Rust bench trains on the embedded byte corpus). Initial values do
not matter for the time; shapes and operations do.

Prints one JSON line per shape: median of STEP_BENCH_STEPS (8) timed steps after 2 warm-up
steps. Threads: MOE_THREADS (default 2).
"""

import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer_torch import moe  # noqa: E402

# name, vocab, d_model, n_layers, n_heads, d_ff, experts, top_k, seq_len, batch, lr
SHAPES = [
    ("tiny", 256, 64, 2, 4, 128, 4, 2, 32, 8, 1e-3),
    ("gpt_s_2l", 50257, 768, 2, 12, 3072, 8, 1, 128, 2, 1e-4),
]
LB_LOSS_COEF = 0.01
GRAD_CLIP = 1.0


class Model(torch.nn.Module):
    def __init__(self, vocab, d, layers, heads, ff, experts, k, seq):
        super().__init__()
        p = lambda *shape, std=0.02: torch.nn.Parameter(torch.randn(*shape) * std)  # noqa: E731
        z = lambda *shape: torch.nn.Parameter(torch.zeros(*shape))  # noqa: E731
        o = lambda *shape: torch.nn.Parameter(torch.ones(*shape))  # noqa: E731
        std_out = 0.02 / math.sqrt(2 * layers)
        self.heads, self.k = heads, k
        self.wte, self.wpe = p(vocab, d), p(seq, d, std=0.01)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.ln1_w, b.ln1_b, b.ln2_w, b.ln2_b = o(d), z(d), o(d), z(d)
            b.qkv_w, b.qkv_b = p(d, 3 * d), z(3 * d)
            b.proj_w, b.proj_b = p(d, d, std=std_out), z(d)
            b.router = p(d, experts)
            b.w1 = torch.nn.ParameterList([p(d, ff) for _ in range(experts)])
            b.w2 = torch.nn.ParameterList([p(ff, d, std=std_out) for _ in range(experts)])
            self.blocks.append(b)
        self.lnf_w, self.lnf_b = o(d), z(d)

    def attention(self, b, h, bsz, s):
        d = h.shape[1]
        dh = d // self.heads
        qkv = (h @ b.qkv_w + b.qkv_b).reshape(bsz, s, 3, self.heads, dh).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = q @ k.transpose(-1, -2) / math.sqrt(dh)
        mask = torch.triu(torch.full((s, s), -1e9), diagonal=1)
        att = torch.softmax(att + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(bsz * s, d)
        return y @ b.proj_w + b.proj_b

    def forward(self, tokens):
        bsz, t = tokens.shape
        s = t - 1
        inp, tgt = tokens[:, :s], tokens[:, 1:].reshape(-1)
        d = self.wte.shape[1]
        x = (self.wte[inp.reshape(-1)].reshape(bsz, s, d) + self.wpe[:s]).reshape(bsz * s, d)
        lbs = []
        for b in self.blocks:
            x = x + self.attention(b, F.layer_norm(x, (d,), b.ln1_w, b.ln1_b, 1e-5), bsz, s)
            y, lb, _ = moe(F.layer_norm(x, (d,), b.ln2_w, b.ln2_b, 1e-5), b.router, b.w1, b.w2, self.k)
            x = x + y
            lbs.append(lb)
        logits = F.layer_norm(x, (d,), self.lnf_w, self.lnf_b, 1e-5) @ self.wte.T
        return F.cross_entropy(logits, tgt) + LB_LOSS_COEF * torch.stack(lbs).mean()


def main():
    threads = int(os.environ.get("MOE_THREADS", "2"))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    steps = max(1, int(os.environ.get("STEP_BENCH_STEPS", "8")))
    only = set(sys.argv[1:])
    for name, vocab, d, layers, heads, ff, experts, k, seq, batch, lr in SHAPES:
        if only and name not in only:
            continue
        model = Model(vocab, d, layers, heads, ff, experts, k, seq)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        times, losses = [], []
        for i in range(steps + 2):
            tokens = torch.randint(0, 256, (batch, seq + 1))
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model(tokens)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            losses.append(loss.item())
            if i >= 2:
                times.append(time.perf_counter() - t0)
        median = float(np.median(times))
        print(json.dumps({
            "framework": "torch",
            "bench": "train_step",
            "torch": torch.__version__,
            "config": name,
            "vocab": vocab,
            "d_model": d,
            "n_layers": layers,
            "tokens": batch * seq,
            "threads": torch.get_num_threads(),
            "runs": len(times),
            "median_s": median,
            "min_s": min(times),
            "tokens_per_s": batch * seq / median,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            # The process's peak resident memory so far (Linux reports KiB), as the candle
            # bench's peak_rss_mb: it covers every shape run before in this process.
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        }), flush=True)


if __name__ == "__main__":
    main()
