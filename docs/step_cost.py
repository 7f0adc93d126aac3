"""Decode-step cost of full vs h2o at the shapes of targets 3 and 4 (docs/benchmarks.md), eager and compiled.

The cache is filled with random keys and values at realistic positions instead of running a long prefill:
a decode step does the same work whatever the values (static shapes). Prints one line per case.
Run: python docs/step_cost.py
"""
import time

import torch

from h2o_mini import api
from h2o_mini.generate import Decoder
from h2o_mini.policies import make_policy

CASES = [  # (label, policy, budget, batch, sequence length L, new tokens already decoded)
    ("t3 8k batch 8", "full", None, 8, 8192, 32), ("t3 8k batch 8", "h2o", "0.2", 8, 8192, 32),
    ("t4 256MB cap", "full", None, 2, 2560, 1024), ("t4 256MB cap", "h2o", "0.2", 10, 2560, 1024),
]


@torch.inference_mode()
def step_seconds(decoder, policy, batch, length, at, steps=5):
    model = decoder.model
    cache = decoder.new_cache(policy, batch, length)
    C = cache.capacity
    n = min(C, at)
    for lc in cache.layers:  # the cache holding the n most recent positions before `at`
        lc.k.normal_()
        lc.v.normal_()
        lc.pos[..., :n] = torch.arange(at - n, at)
        lc.score.uniform_()
    token, pos = torch.full((batch, 1), 100), torch.full((batch, 1), at)
    for i in range(2):  # warm-up (and compilation)
        decoder.step(model, cache, token, pos + i)
    t0 = time.perf_counter()
    for i in range(steps):
        decoder.step(model, cache, token, pos + 2 + i)
    return (time.perf_counter() - t0) / steps, C


lm = api.load("default")
for how in (False, "layer"):
    decoder = Decoder(lm.model, compile=how)
    for label, name, budget, batch, length, done in CASES:
        s, C = step_seconds(decoder, make_policy(name, budget, length), batch, length, length - done)
        print(f"{label}: {name:5s} C={C:5d} batch={batch:2d} compiled={how or 'no':5s} step {s:.3f} s = "
              f"{batch / s:.2f} tok/s", flush=True)
