"""What running configurations as the rows of one batch (`h2o_mini/policies/rows.py`) saves, and why: the numbers
behind docs/benchmarks.md, "Many configurations in one pass". CPU, fp32, the default model, one process.

    python scripts/benchmarks/batched_cost.py [--tokens 128] [--new-tokens 32] [--model M] [--device cpu|cuda]

1. the forward pass per token and row, at batch 1 and batch 30 (is it bound by arithmetic or by weights?);
2. every registered policy at 0.1 and 0.2 of 2048 tokens reading the first --tokens of GPL-3 in stream mode:
   one policy after another, then all as one batch;
3. the same policies at 0.1 and 0.2 of 256 + --new-tokens writing --new-tokens greedily after a 256-token
   prompt (the decode steps): one after another, then as one batch.
"""
from __future__ import annotations

import argparse
import time

import torch

from h2o_mini import api
from h2o_mini.generate import Decoder
from h2o_mini.policies import REGISTRY, make_policy
from h2o_mini.policies.rows import Rows


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    lm = api.load(args.model, device=args.device)
    model, decoder, dev = lm.model, Decoder(lm.model), args.device
    L = min(2048, model.cfg.max_seq_len)
    ids = api.scored_ids(lm, open("/usr/share/common-licenses/GPL-3").read(), L)
    for B, T in ((1, L), (30, L // 8)):
        x, pos = torch.tensor([ids[:T]] * B, device=dev), torch.arange(T, device=dev)[None].expand(B, T)
        model(x[:, :8], pos[:, :8])  # warm up
        dt = seconds(lambda: model(x, pos))
        print(f"1. forward ({B}, {T}): {dt:.2f} s, {1e3 * dt / (B * T):.2f} ms per token and row")
    policies = [make_policy(n, b, L) for n in REGISTRY if n != "full" for b in ("0.1", "0.2")]
    n, T = len(policies), args.tokens

    def read(policy, rows):
        cache = decoder.new_cache(policy, rows, L, "stream")
        x, pos = torch.tensor([ids[:T]] * rows, device=dev), torch.arange(T, device=dev)[None].expand(rows, T)
        for s in range(0, T, 256):
            model.hidden(x[:, s:s + 256], pos[:, s:s + 256], cache)
    alone = sum(seconds(lambda: read(p, 1)) for p in policies)
    together = seconds(lambda: read(Rows([(p, 1) for p in policies]), n))
    print(f"2. reading {T} tokens, {n} points: one after another {alone:.1f} s, one batch {together:.1f} s "
          f"({alone / together:.2f}x)")
    P, N = min(256, L // 2), args.new_tokens  # a budget of 0.1 / 0.2 of P + N: every point evicts as it writes
    prompt = ids[:P]
    policies = [make_policy(n, b, P + N) for n in REGISTRY if n != "full" for b in ("0.1", "0.2")]

    def write(policy, rows):  # the decode steps only: the dense prompt is compute-bound either way
        steps = decoder.generate([prompt] * rows, policy, N, "dense")
        next(steps)
        return seconds(lambda: list(steps))
    alone = sum(write(p, 1) for p in policies)
    together = write(Rows([(p, 1) for p in policies]), n)
    print(f"3. writing {N} tokens after {P} (decode steps), {n} points: one after another {alone:.1f} s, one batch "
          f"{together:.1f} s ({alone / together:.2f}x)")

if __name__ == "__main__":
    main()
