# decode-step cost at 8k context, batch 8: eager vs compiled, full vs h2o (the cache is filled with random
# K/V: a step's work does not depend on the values)
import time, torch
from h2o_mini import api
from h2o_mini.generate import Decoder
from h2o_mini.policies import make_policy
lm = api.load("default"); m = lm.model
B, L = 8, 8192
for how in [False, "layer"]:
    d = Decoder(m, compile=how)
    for name, budget in [("full", None), ("h2o", "0.2")]:
        pol = make_policy(name, budget, L)
        cache = d.new_cache(pol, B, L)
        C = cache.capacity
        for lc in cache.layers:
            lc.k.normal_(); lc.v.normal_(); lc.pos.copy_(torch.arange(L - 32 - C, L - 32)[None, None, :C].expand_as(lc.pos)); lc.score.uniform_()
        tok = torch.full((B, 1), 100); pos = torch.full((B, 1), L - 32)
        with torch.inference_mode():
            for i in range(2): d.step(m, cache, tok, pos + i)
            t = time.perf_counter()
            for i in range(5): d.step(m, cache, tok, pos + 2 + i)
        print(how, name, "C", C, "step s", round((time.perf_counter() - t) / 5, 3), flush=True)
