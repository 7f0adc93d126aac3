"""Where reading a text under eviction spends its work: operator launches per token and layer in the stream
loop, and the wall time split into forward arithmetic, the eviction (the per-token loop and its per-chunk
setup) and scoring (docs/benchmarks.md, "The per-token loop (issue 36)").

* Launches: every aten operator that reaches a kernel (views left out), counted by a TorchDispatchMode over
  the cache's prompt paths only (`prompt.stream` / `prompt.stream_many`, which run on the reading thread),
  divided by tokens x layers: on a GPU each is one kernel launch.
* Wall split, in this process: the forward arithmetic (`evals.ppl.read_logits` under `full`: one causal pass,
  nothing evicted, the head included), the read under the policy (the same with its cache), and the scoring
  of the logits (log-softmax, NLL). Eviction = read - forward.

    python scripts/benchmarks/loop_ops.py --tokens 2048 h2o scissorhands          # the default model, 2048 tokens of GPL-3
    PYTHONPATH=/tmp/before python scripts/benchmarks/loop_ops.py ...              # another checkout (run outside the repo)
    python scripts/benchmarks/loop_ops.py --device cuda [--compile] ...            # on a GPU (scripts/gpu/run.sh)
"""
import argparse
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from h2o_mini import api, prompt
from h2o_mini.evals import ppl
from h2o_mini.generate import Decoder
from h2o_mini.policies import make_policy

VIEWS = {"view", "_unsafe_view", "expand", "select", "slice", "unsqueeze", "squeeze", "as_strided", "t",
         "transpose", "permute", "alias", "detach", "unbind", "split", "split_with_sizes", "unflatten", "flatten",
         "_reshape_alias", "reshape", "lift_fresh", "empty", "empty_like", "new_empty", "new_empty_strided",
         "empty_strided"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.__name__.split(".")[0] not in VIEWS
        return func(*args, **(kwargs or {}))


def counted(fn, counter):
    def wrapper(*a, **kw):
        with counter:
            return fn(*a, **kw)
    return wrapper


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("policies", nargs="*", default=["h2o"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", default="0.1")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--compile", action="store_true", help="the loop body compiled (Decoder(compile=True))")
    args = ap.parse_args()
    lm = api.load(args.model, device=args.device)
    model, device = lm.model, torch.device(args.device)
    ids = api.scored_ids(lm, open("/usr/share/common-licenses/GPL-3").read(), args.tokens)
    T, L = len(ids), model.cfg.n_layer
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        full = Decoder(model, chunk=args.chunk)
        list(ppl.read_logits(full, make_policy("full", None, T), [ids]))
        sync(device)
        t0 = time.perf_counter()
        list(ppl.read_logits(full, make_policy("full", None, T), [ids]))
        sync(device)
        t_forward = time.perf_counter() - t0
        for name in args.policies:
            policy = make_policy(name, args.budget, T)
            decoder = Decoder(model, chunk=args.chunk, compile=args.compile)
            counter = Count()
            names = [n for n in ("stream", "stream_many") if hasattr(prompt, n)]
            saved = {n: getattr(prompt, n) for n in names}
            for n in names:  # counted where the cache calls it; the inner call of stream -> stream_many not twice
                setattr(prompt, n, counted(saved[n], counter) if n == names[-1] else saved[n])
            if "stream_many" in names:
                prompt.stream = lambda c, *a: prompt.stream_many([(c, *a)])[0]
            try:
                list(ppl.read_logits(decoder, policy, [ids]))  # one read counted
            finally:
                for n in names:
                    setattr(prompt, n, saved[n])
            sync(device)
            t0 = time.perf_counter()
            logits = [lg for _, lg in ppl.read_logits(decoder, policy, [ids])]
            sync(device)
            t_read = time.perf_counter() - t0
            t0 = time.perf_counter()
            sums = torch.zeros(3, dtype=torch.float64)
            for s, lg in zip(range(0, T, args.chunk), logits):
                for b, e in ppl.blocks(s, lg.shape[1], T):
                    ppl.tally(sums, lg[0, b - s:e - s], x[0, b + 1:e + 1], None)
            sync(device)
            t_score = time.perf_counter() - t0
            print(json.dumps({"policy": name, "budget": args.budget, "tokens": T, "chunk": args.chunk,
                              "device": str(device), "compiled": args.compile, "launches_per_token_layer": round(counter.n / (T * L), 1),
                              "forward_s": round(t_forward, 2), "eviction_s": round(t_read - t_forward, 2),
                              "read_s": round(t_read, 2), "scoring_s": round(t_score, 2)}), flush=True)


if __name__ == "__main__":
    main()
