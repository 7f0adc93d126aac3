"""Decode-step cost of full vs h2o at the shapes of targets 2 and 4 (docs/benchmarks.md), and what bounds it.

The cache is filled with random keys and values at realistic positions instead of running a long prefill:
a decode step does the same work whatever the values (static shapes). Also measured, in the same process:
the weights alone (every linear layer and the vocabulary projection applied to `batch` vectors: what any
implementation must stream each step), the step with one cached token (`local`, C = 1: everything but the
KV cache) and, from it, the step h2o would take if its cache cost exactly its share C / L of full's. Prints one line per case; `--compiled` adds the per-block compiled step.
Run: python scripts/benchmarks/step_cost.py [--compiled]
"""
import sys
import time

import torch
import torch.nn.functional as F

from h2o_mini import api
from h2o_mini.generate import Decoder
from h2o_mini.policies import make_policy

CASES = [  # (label, policy, budget, batch, sequence length L, new tokens already decoded)
    ("t2 8k batch 8", "local", "1", 8, 8192, 32),  # one cached token: the step without its KV cache
    ("t2 8k batch 8", "full", None, 8, 8192, 32), ("t2 8k batch 8", "h2o", "0.2", 8, 8192, 32),
    ("t4 256MB cap", "full", None, 2, 2560, 1024), ("t4 256MB cap", "h2o", "0.2", 10, 2560, 1024),
]


def timed(fn, steps: int) -> float:
    fn()
    fn()  # warm-up (and compilation)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


@torch.inference_mode()
def step_seconds(decoder, policy, batch, length, at, steps=5):
    model = decoder.model
    cache = decoder.new_cache(policy, batch, length)
    for lc in cache.layers:  # the cache holding the most recent positions before `at`
        n = min(lc.capacity, at)
        for part in (*lc.k, *lc.v):
            part.normal_()
        lc.pos[..., :n] = torch.arange(at - n, at)
        lc.score.uniform_()
    token, pos = torch.full((batch, 1), 100), torch.full((batch, 1), at)
    return timed(lambda: decoder.step(model, cache, token, pos), steps), cache.capacity


@torch.inference_mode()
def weights_seconds(model, batch, steps=5):
    """Every weight matrix applied to `batch` vectors, as a decode step applies them (the bound at batch 1)."""
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.cfg.tie_embeddings:
        mats.append(model.tok_emb.weight)
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in mats}
    return timed(lambda: [F.linear(xs[w.shape[1]], w) for w in mats], steps), sum(w.numel() * 4 for w in mats)


lm = api.load("default")
for batch in (1, 8):
    s, nbytes = weights_seconds(lm.model, batch)
    print(f"weights alone, batch {batch}: {s * 1e3:.1f} ms ({nbytes / s / 1e9:.1f} GB/s of {nbytes / 1e6:.0f} MB)",
          flush=True)
for how in (False, "layer") if "--compiled" in sys.argv else (False,):
    decoder = Decoder(lm.model, compile=how)
    full = {}
    for label, name, budget, batch, length, done in CASES:
        s, C = step_seconds(decoder, make_policy(name, budget, length), batch, length, length - done)
        line = f"{label}: {name:5s} C={C:5d} batch={batch:2d} compiled={how or 'no':5s} step {s:.3f} s = " \
               f"{batch / s:.2f} tok/s"
        if name in ("full", "local"):
            full[label, name] = (s, C)
        elif label.startswith("t2"):
            (fs, fC), (ls, _) = full[label, "full"], full[label, "local"]
            bound = ls + (fs - ls) * C / fC  # the step without a cache, plus full's cache work scaled by C / L
            line += f"; vs full {fs / s:.2f}x (bound {bound:.3f} s: {fs / bound:.2f}x)"
        print(line, flush=True)
