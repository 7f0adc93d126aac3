"""Reading a text through an evicting cache with the per-token loops of several layers run as one.

In stream mode every layer runs a short loop per token (`prompt.stream`: evict, insert, attend, update) whose
small operations cost far more than their arithmetic: on a CPU ~2-5 us each, on a GPU one kernel launch each.
Within one layer and chunk that loop is sequential, but nothing ties one layer's loop to another's except
the data flowing up the stack. Chunk c reaches layer l just after chunk c-1 left it, so chunk c at layer l,
chunk c-1 at layer l+1, chunk c-2 at layer l+2, ... (an anti-diagonal of the chunk x layer grid) are ready at
the same time, and their loops run as the rows of one batch (`prompt.stream_many`). A text of n chunks
through L layers then takes n + L - 1 loops over a chunk instead of n x L.

`read` is that schedule written out: for each anti-diagonal, the first stage of every block on it
(`Block.qkv`), the stream loops of all of them as one batch, then the last stage (`Block.finish`). No thread,
nothing waits for anything: every operation is the one reading the chunks one after another runs, each row's
arithmetic its own (the loop's operations run along the slot axis of each row), so the logits are the same.
Under tensor parallel every rank runs the same diagonals in the same order, so the collectives of `finish`
meet. A diagonal whose loops' transients would pass `loop_budget` (a sweep's many rows in every layer) runs as
several batches, in order (`stream_batched`): each row's arithmetic is the same, only fewer rows share a loop.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from . import prompt


def read(model, cache, idx: torch.Tensor, pos: torch.Tensor, chunk: int,
         head: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, the model's output for idx[:, s:s+chunk]) for each chunk of (idx, pos) (B, T), in order: the
    logits (B, k, V), or without `head` the last layer's output (B, k, d_model). `cache` reads in stream mode."""
    starts = list(range(0, idx.shape[1], chunk))
    n, L = len(starts), len(model.layers)
    x, ropes = {}, {}  # per chunk in flight: its hidden state after the layers it has passed, its RoPE
    for d in range(n + L - 1):  # the anti-diagonal d: chunk c at layer d - c
        cells = [(c, d - c) for c in range(max(0, d - L + 1), min(n, d + 1))]
        requests = []
        for c, layer in cells:
            s = starts[c]
            if layer == 0:
                x[c], ropes[c] = model.embed(idx[:, s:s + chunk], pos[:, s:s + chunk])
            q, k, v = model.layers[layer].qkv(x[c], pos[:, s:s + chunk], ropes[c][layer])
            requests.append(cache.layers[layer].streamed(q, k, v, pos[:, s:s + chunk]))
        for (c, layer), o in zip(cells, stream_batched(requests)):
            x[c] = model.layers[layer].finish(x[c], o)
            if layer == L - 1:  # one chunk leaves the top per diagonal, in order
                out = x.pop(c)
                del ropes[c]
                yield starts[c], model.head(out) if head else out


def stream_batched(requests: list[tuple]) -> list[torch.Tensor]:
    """`prompt.stream_many` over requests of the same shapes at once (the last chunk may be shorter, a layer
    narrower), each batch's loop transients within `loop_budget`: each output in the requests' order. A diagonal
    of many wide cells (a sweep's rows in every layer) runs as several batches, so the memory of the read follows
    its caches, not the number of cells in flight."""
    groups: dict[tuple, list[int]] = {}
    for i, (slots, q, *_) in enumerate(requests):
        groups.setdefault((tuple(q.shape), tuple(slots.pos.shape)), []).append(i)
    outs = [None] * len(requests)
    for members in groups.values():
        layer, q = requests[members[0]][:2]
        per = max(1, loop_budget(q.device) // loop_bytes(q.shape, layer.capacity))  # cells per batch
        for s in range(0, len(members), per):
            batch = members[s:s + per]
            for i, o in zip(batch, prompt.stream_many([requests[i] for i in batch])):
                outs[i] = o
    return outs


def loop_bytes(q_shape, C: int) -> int:
    """The stream loop's largest transients for one cell: its fp32 attention logits to the C + K virtual slots,
    about three times (the logits, a masked copy, the probabilities), q_shape (B, n_head, K, hd)."""
    B, n_head, K, _ = q_shape
    return 3 * 4 * B * n_head * K * (C + K)


def loop_budget(device) -> int:
    """512 MiB on a CPU, where a wider batch gains little once a few cells run together (a 30-point sweep: the same
    time within noise as no bound, docs/benchmarks.md); 8 GiB on a GPU, where each batch is the loop's kernel
    launches again."""
    return 2**29 if torch.device(device).type == "cpu" else 2**33
