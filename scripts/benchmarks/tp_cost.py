"""What tensor parallelism costs per decode step on this machine: communication against compute.

Each rank times (1) the decode step of the default model (eager, fp32, a cache of 512 + 64 tokens under full
and h2o 0.2, batch 1 and 8) and (2) that step's communication alone: 2 all-reduces per layer of a
(batch, 1, d_model) fp32 tensor, 60 for the 30 layers. Rank 0 prints one line per case.
Run: python scripts/benchmarks/tp_cost.py (one process), torchrun --nproc-per-node 3 scripts/benchmarks/tp_cost.py (three ranks)
"""
import time

import torch

from h2o_mini import api, parallel
from h2o_mini.generate import Decoder
from h2o_mini.policies import make_policy


def timed(fn, steps: int) -> float:
    fn()
    fn()
    if parallel.launched():
        torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


@torch.inference_mode()
def main() -> None:
    shard = parallel.from_env()
    lm = api.load("default", shard=shard)
    model, decoder, length = lm.model, Decoder(lm.model), 512 + 64
    world = shard.size if shard else 1
    for name, budget in (("full", None), ("h2o", "0.2")):
        for batch in (1, 8):
            cache = decoder.new_cache(make_policy(name, budget, length), batch, length)
            idx = torch.randint(0, 1000, (batch, 512), generator=torch.Generator().manual_seed(0))
            pos = torch.arange(512)[None].expand(batch, 512)
            decoder.prefill(cache, idx, pos)
            token, at = idx[:, -1:], torch.full((batch, 1), 512)
            step = timed(lambda: decoder.step(model, cache, token, at), 8)
            x = torch.randn(batch, 1, model.cfg.d_model)
            comm = timed(lambda: [parallel.all_reduce(x, shard) for _ in range(2 * model.cfg.n_layer)], 8)
            if not shard or shard.rank == 0:
                print(f"ranks={world} {name:4s} batch={batch}: step {step * 1e3:6.1f} ms, of which all-reduces "
                      f"{comm * 1e3:5.1f} ms ({comm / step:.0%})", flush=True)
    parallel.leave()


if __name__ == "__main__":
    main()
