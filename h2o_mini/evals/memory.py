"""How many rows of a batched read fit in memory: `eval sweep ppl`'s default --max-batch.

A row of a batch that reads a text in stream mode (`evals/ppl.score_many`) holds, at its widest:

* its cache: every layer's slots, C of the batch's widest row (all rows share the layer's width), each with a
  key and a value as stored and a position and a score (12 bytes);
* the stream loop of every chunk in flight (`wavefront.py`: up to min(chunks, layers) at once, fewer at once
  where their transients pass `wavefront.loop_budget`, which this estimate leaves out to stay generous): the virtual
  slots' keys and values (S = C + chunk, twice: gathered and stacked) and the chunk's fp32 attention logits,
  (heads x chunk x S), three times (the logits, their masked copy, the probabilities);
* the forward pass of each chunk in flight: about 4 activations of the model's width and 3 of the MLP's.

The estimate is deliberately generous (the batch takes at most half of the free memory), so that a sweep is
cut into more batches rather than killed halfway.
"""
from __future__ import annotations

import torch

from ..wavefront import loop_bytes

SHARE = 0.5  # of the free memory, for the batch's rows


def row_bytes(cfg, length: int, capacity: int, chunk: int, kv_bits: int | None, dtype=torch.float32) -> int:
    """Bytes one row needs at its widest, reading `length` tokens in chunks of `chunk` with C = `capacity`."""
    elem = torch.tensor([], dtype=dtype).element_size()
    stored = elem if kv_bits is None else kv_bits / 8 + 4 / 32  # codes plus a scale per 32 (`quant.py`)
    K = min(chunk, length)
    slots = sum(min(capacity, cfg.window(i) or length, length) for i in range(cfg.n_layer))
    cache = slots * cfg.n_kv_head * (2 * cfg.head_dim * stored + 12)
    in_flight = min(-(-length // chunk), cfg.n_layer)
    S = min(capacity, length) + K
    loop = cfg.n_kv_head * S * cfg.head_dim * elem * 4 + loop_bytes((1, cfg.n_head, K, cfg.head_dim), S - K)
    forward = K * (4 * cfg.d_model + 3 * cfg.d_ff) * elem
    return int(cache + in_flight * (loop + forward))


def free_bytes(device: torch.device) -> int:
    """Memory free now: the GPU's, or the machine's (MemAvailable; 8 GiB where /proc/meminfo is missing)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 8 << 30


def rows_that_fit(cfg, length: int, capacity: int, chunk: int, kv_bits: int | None, device, dtype) -> dict:
    """{"row_bytes", "free_bytes", "max_batch"}: how many rows fit in SHARE of the free memory (1 at least)."""
    need, free = row_bytes(cfg, length, capacity, chunk, kv_bits, dtype), free_bytes(torch.device(device))
    return {"row_bytes": need, "free_bytes": free, "max_batch": max(1, int(free * SHARE // need))}
