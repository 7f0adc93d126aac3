"""Operator calls per token and layer in the stream loop (torch.profiler, aten ops, views and allocations left
out), for the policies named, on check-policy's tiny LLaMA: a second chunk of 100 tokens read into a cache of 20
slots that is already full, so every token evicts. Run it on two checkouts to compare their loops:

    PYTHONPATH=/tmp/before python scripts/loop_ops.py h2o tova scissorhands keydiff   # (run from outside the repo)
    python scripts/loop_ops.py h2o tova scissorhands keydiff
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from h2o_mini.generate import Decoder
from h2o_mini.policies import make_policy

try:  # the layout before and after h2o_mini/tools/
    from h2o_mini.tools.checkkit import tiny_model
except ImportError:
    from h2o_mini.checkkit import tiny_model

NOT_WORK = ("empty", "as_strided", "view", "_reshape", "resolve", "detach", "alias", "expand", "select", "slice",
            "unsqueeze", "lift")
model = tiny_model("llama_gqa")
T, K = 200, 100
ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
pos = torch.arange(T)[None]
for name in sys.argv[1:] or ["h2o"]:
    policy = make_policy(name, 20, T)
    decoder = Decoder(model, chunk=K)
    try:
        cache, read = decoder.new_cache(policy, 1, T, "stream"), lambda s, e: model(ids[:, s:e], pos[:, s:e], cache)
    except TypeError:  # before the cache chose its own path
        cache = decoder.new_cache(policy, 1, T)
        read = lambda s, e: model(ids[:, s:e], pos[:, s:e], cache, mode="stream")  # noqa: E731
    with torch.inference_mode():
        read(0, K)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            read(K, T)
    calls = sum(e.count for e in prof.key_averages()
                if e.key.startswith("aten::") and not e.key[6:].startswith(NOT_WORK))
    print(f"{name}: {calls / (K * model.cfg.n_layer):.1f} aten calls per token and layer")
