"""Recording what a policy keeps: the one recorder behind `h2o-mini plot kept` and `h2o-mini explore`.

`record(model, ids, policy)` reads a text through the real cache (`cache.py`), one token at a time through
the decode step (every token through the rule, the spec's evaluation mode), and notes for every layer and KV
head the step at which each position was evicted, and the scores of the cached tokens at a few chosen steps
(enough to colour a picture; bounded in size). Nothing is re-implemented: the positions and scores are read
off the cache's own slots after each step. `record_many` records several policies in one pass, each the row
of a batch with its own policy and capacity (`policies/rows.py`).

    rec = h2o_mini.record(lm.model, ids, h2o_mini.H2O(heavy=32, recent=32), snapshots=16)
    rec.kept(layer=15, head=0, step=100)      # the positions cached after token 100
    rec.evicted_at[15, 0, 7]                  # when position 7 left layer 15, head 0 (-1: never)

Memory: evicted_at is (n_layer, n_kv_head, T) int32; scores hold, for each snapshot step, the cached tokens
of every layer and head in position order: n_layer * n_kv_head * C * snapshots float32 values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import KVCache
from ..errors import UserError
from ..model import Transformer
from ..policies import Policy
from ..policies.base import refuse_lookahead
from ..policies.rows import Rows


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
    return record_many(model, ids, [policy], snapshots, kv_bits, prefill, progress)[0]


@torch.inference_mode()
def record_many(model: Transformer, ids: list[int], policies: list[Policy], snapshots: int = 16,
                kv_bits: int | None = None, prefill: str = "stream", progress=None,
                max_batch: int = 32) -> list[Recording]:
    """`record` for every policy. Streamed, up to `max_batch` policies read the text together as the rows of one
    batch (`policies/rows.py`), one token per step through the decode step; each row's recording is its policy's
    alone. progress(t): called after each step of each batch."""
    T = len(ids)
    if T < 2:
        raise UserError("recording needs at least 2 tokens")
    for policy in policies:
        refuse_lookahead(policy)
    if prefill == "dense":  # each policy keeps its own C at once: no shared pass (see prompt.dense)
        return [_record_dense(model, ids, policy, kv_bits) for policy in policies]
    return [rec for at in range(0, len(policies), max_batch)
            for rec in _record_rows(model, ids, policies[at:at + max_batch], snapshots, kv_bits, progress)]


def _record_rows(model, ids, policies, snapshots, kv_bits, progress) -> list[Recording]:
    cfg, T, B = model.cfg, len(ids), len(policies)
    p = next(model.parameters())
    cache = KVCache(cfg, Rows([(policy, 1) for policy in policies]), B, T, dtype=p.dtype, device=p.device,
                    kv_bits=kv_bits)
    evicted = torch.full((B, cfg.n_layer, cfg.n_kv_head, T), -1, dtype=torch.int32)
    steps = snapshot_steps(T, snapshots)
    scores = [[] for _ in policies]
    nll = torch.zeros(B, dtype=torch.float64)
    x = torch.tensor([ids], device=p.device).expand(B, -1)  # (B, T): the same text in every row
    arrived = torch.arange(T)  # a position has arrived by step t when it is <= t
    for t in range(T):
        logits = model(x[:, t:t + 1], torch.full((B, 1), t, device=p.device), cache)[:, -1]  # (B, V): a decode step
        if t + 1 < T:
            nll -= logits.float().log_softmax(-1)[:, ids[t + 1]].double().cpu()
        for i, layer in enumerate(cache.layers):  # positions that have arrived, are not cached and had no step yet
            pos = layer.pos.cpu()  # (B, H, C)
            cached = torch.zeros(B, cfg.n_kv_head, T + 1, dtype=torch.bool)  # column T: empty and absent slots
            cached.scatter_(2, pos.masked_fill(pos < 0, T), True)
            gone = ~cached[..., :T] & (arrived <= t) & (evicted[:, i] < 0)
            evicted[:, i].masked_fill_(gone, t)
        if t in steps:
            for b in range(B):
                scores[b].append([_ordered_scores(layer, b) for layer in cache.layers])
        if progress:
            progress(t)
    return [Recording(policy, list(ids), evicted[b], steps, scores[b], float(nll[b]) / (T - 1),
                      [layer.rows[b] for layer in cache.layers],  # a row's own bytes: its cache alone
                      KVCache(cfg, policy, 1, T, dtype=p.dtype, device="meta", kv_bits=kv_bits).nbytes)
            for b, policy in enumerate(policies)]


def _ordered_scores(layer, row: int = 0) -> torch.Tensor:
    """(H, n_cached) the cached tokens' scores of one row, each head's in position order (empty slots left out)."""
    pos, score = layer.pos[row].cpu(), layer.score[row].float().cpu()  # (H, C)
    order = pos.argsort(-1)
    pos, score = pos.gather(-1, order), score.gather(-1, order)
    n = int((pos[0] >= 0).sum())  # every head holds the same number of tokens
    return score[:, -n:] if n else score[:, :0]


def _record_dense(model: Transformer, ids: list[int], policy: Policy, kv_bits: int | None) -> Recording:
    cfg, T = model.cfg, len(ids)
    p = next(model.parameters())
    cache = KVCache(cfg, policy, 1, T, dtype=p.dtype, device=p.device, kv_bits=kv_bits)
    x = torch.tensor([ids], device=p.device)
    logits = model(x, torch.arange(T, device=p.device)[None], cache)[0, :-1]  # one dense prompt
    nll = -logits.float().log_softmax(-1).gather(1, x[0, 1:, None]).mean().item()
    evicted = torch.full((cfg.n_layer, cfg.n_kv_head, T), T - 1, dtype=torch.int32)
    for i, layer in enumerate(cache.layers):
        for h in range(cfg.n_kv_head):
            kept = layer.pos[0, h]
            evicted[i, h, kept[kept >= 0].cpu()] = -1
    return Recording(policy, list(ids), evicted, [T - 1], [[_ordered_scores(layer) for layer in cache.layers]], nll,
                     [layer.capacity for layer in cache.layers], cache.nbytes)
