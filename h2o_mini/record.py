"""Recording what a policy keeps: the one recorder behind `h2o-mini plot kept` and `h2o-mini explore`.

`record(lm_or_model, ids, policy)` reads a text through the real cache (`cache.py`), one token at a time in
stream mode (every token through the rule, the spec's evaluation mode), and notes for every layer, batch
row 0 and KV head the step at which each position was evicted, and the scores of the cached tokens at a
few chosen steps (enough to colour a picture; bounded in size). Nothing is re-implemented: the positions
and scores are read off the cache's own slots after each step.

    rec = h2o_mini.record(lm, ids, h2o_mini.H2O(heavy=32, recent=32), snapshots=16)
    rec.kept(layer=15, head=0, step=100)      # the positions cached after token 100
    rec.evicted_at[15, 0, 7]                  # when position 7 left layer 15, head 0 (-1: never)

Memory: evicted_at is (n_layer, n_kv_head, T) int32; scores hold, for each snapshot step, the cached tokens
of every layer and head in position order: n_layer * n_kv_head * C * snapshots float32 values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .errors import UserError
from .model import Transformer
from .policies import Policy


@dataclass
class Recording:
    """What `record` saw. evicted_at: (n_layer, n_kv_head, T) int32, the step (the arriving token's position)
    at which each position was evicted, -1 if it never was; steps: the snapshot steps; scores[i]: per layer,
    a (n_kv_head, n_cached) float32 tensor of the cached tokens' scores after step steps[i], in position
    order; logits_nll: the text's mean next-token NLL under the policy (nats); capacities: slots per layer."""

    policy: Policy
    ids: list[int]
    evicted_at: torch.Tensor
    steps: list[int]
    scores: list[list[torch.Tensor]] = field(repr=False)
    nll: float
    capacities: list[int]
    kv_bytes: int

    def kept(self, layer: int, head: int, step: int) -> list[int]:
        """The positions cached in `layer`, KV `head` after the token at position `step` was read."""
        gone = self.evicted_at[layer, head, :step + 1]
        alive = (gone < 0) | (gone > step)
        return torch.nonzero(alive).flatten().tolist()

    def kept_matrix(self, layer: int, head: int) -> torch.Tensor:
        """(T, T) bool: [p, t] is True when position p is cached after step t (what `plot kept` draws)."""
        T = len(self.ids)
        t = torch.arange(T)
        gone = self.evicted_at[layer, head].long()  # (T,)
        arrived = t[:, None] <= t[None, :]  # position p has arrived by step t
        left = (gone[:, None] >= 0) & (gone[:, None] <= t[None, :])
        return arrived & ~left


def snapshot_steps(T: int, count: int) -> list[int]:
    """`count` steps spread evenly over 0..T-1, the last one always included."""
    count = max(1, min(count, T))
    return sorted({round(i * (T - 1) / max(count - 1, 1)) for i in range(count)})


@torch.inference_mode()
def record(model: Transformer, ids: list[int], policy: Policy, snapshots: int = 16, kv_bits: int | None = None,
           prefill: str = "stream", progress=None) -> Recording:
    """Read `ids` through a cache of `policy` and note what it keeps. prefill "stream": one token at a time,
    every token through the rule; "dense": the whole text as one dense prompt (nothing leaves before its end,
    then the kept set is chosen at once: every evicted position has step T - 1)."""
    if prefill == "dense":
        return _record_dense(model, ids, policy, kv_bits)
    cfg = model.cfg
    T = len(ids)
    if T < 2:
        raise UserError("recording needs at least 2 tokens")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache = KVCache(cfg, policy, 1, T, dtype=dtype, device=device, kv_bits=kv_bits)
    evicted = torch.full((cfg.n_layer, cfg.n_kv_head, T), -1, dtype=torch.int32)
    steps = snapshot_steps(T, snapshots)
    scores, nll = [], 0.0
    previous = [layer.pos[0].clone() for layer in cache.layers]  # (H, C) per layer
    x = torch.tensor([ids], device=device)
    for t in range(T):
        logits = model(x[:, t:t + 1], torch.tensor([[t]], device=device), cache, mode="stream")[0, -1]
        if t + 1 < T:
            nll -= logits.float().log_softmax(-1)[ids[t + 1]].item()
        for i, layer in enumerate(cache.layers):
            now = layer.pos[0]  # (H, C)
            for h in range(cfg.n_kv_head):  # positions that were cached before this token and are not now
                gone = set(previous[i][h].tolist()) - set(now[h].tolist()) - {-1}
                for p in gone:
                    evicted[i, h, p] = t
            previous[i] = now.clone()
        if t in steps:
            scores.append([_ordered_scores(layer) for layer in cache.layers])
        if progress:
            progress(t)
    return Recording(policy, list(ids), evicted, steps, scores, nll / (T - 1),
                     [layer.capacity for layer in cache.layers], cache.nbytes)


def _ordered_scores(layer) -> torch.Tensor:
    """(H, n_cached) the cached tokens' scores, each head's in position order (empty slots left out)."""
    pos, score = layer.pos[0].cpu(), layer.score[0].float().cpu()  # (H, C)
    order = pos.argsort(-1)
    pos, score = pos.gather(-1, order), score.gather(-1, order)
    n = int((pos[0] >= 0).sum())  # every head holds the same number of tokens
    return score[:, -n:] if n else score[:, :0]


def _record_dense(model: Transformer, ids: list[int], policy: Policy, kv_bits: int | None) -> Recording:
    cfg, T = model.cfg, len(ids)
    p = next(model.parameters())
    cache = KVCache(cfg, policy, 1, T, dtype=p.dtype, device=p.device, kv_bits=kv_bits)
    x = torch.tensor([ids], device=p.device)
    logits = model(x, torch.arange(T, device=p.device)[None], cache, mode="dense")[0, :-1]
    nll = -logits.float().log_softmax(-1).gather(1, x[0, 1:, None]).mean().item()
    evicted = torch.full((cfg.n_layer, cfg.n_kv_head, T), T - 1, dtype=torch.int32)
    for i, layer in enumerate(cache.layers):
        for h in range(cfg.n_kv_head):
            kept = layer.pos[0, h]
            evicted[i, h, kept[kept >= 0].cpu()] = -1
    return Recording(policy, list(ids), evicted, [T - 1], [[_ordered_scores(layer) for layer in cache.layers]], nll,
                     [layer.capacity for layer in cache.layers], cache.nbytes)
