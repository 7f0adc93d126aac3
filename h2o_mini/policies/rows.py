"""`Rows`: several policies in one batch, each over its own rows (a sweep's configurations as one pass).

A sweep evaluates the same text under many (policy, budget) configurations. As rows of one batch they share
every step of the model: one matmul per weight per chunk for all rows, one set of the eviction loop's
element-wise ops (argmin, masks, softmax) per token for all rows; only each policy's own hooks run once per
policy. `Rows` is what makes that possible without touching any policy: it stands where the cache expects one
policy and answers every hook by handing each policy its own rows (a slice of the batch dimension) and
stacking the answers. (Each row is still its own arithmetic: on a CPU, where a chunk's matmuls are already
compute-bound, one pass of n rows costs about what n passes do; see docs/benchmarks.md.)

Why a row's result cannot depend on the other rows: every hook of the protocol is a function of one row's
tensors (scores, positions, keys, values and attention of that row only; `docs/spec.md`), the cache's
mechanics are per row (the argmin, the softmax and the compaction run along the slot axis), and each row
has its own capacity in every layer (the cache gives every row its own number of slots, as a tensor).
What rows share is only the batched arithmetic of the linear layers, which computes each row on its own.
"""
from __future__ import annotations

import torch

from .base import Policy
from .h2o import adds_attention


class Rows:
    """`parts`: (policy, number of rows) in batch order. Stands where the cache expects a `Policy`: the hooks
    the cache reads per row (`layer_capacity`, `prompt_window`) answer as a policy does, a tensor of one value
    per row where a policy's is a number."""

    def __init__(self, parts: list[tuple[Policy, int]]):
        if not parts or any(n < 1 for _, n in parts):
            raise ValueError("Rows needs at least one policy, each over at least one row")
        self.parts = list(parts)
        self.sizes = [n for _, n in self.parts]
        self.batch = sum(self.sizes)
        self.policies = policies = [p for p, _ in self.parts]
        self.name = "+".join(dict.fromkeys(p.name for p in policies))
        for flag in ("needs_scores", "lookahead"):
            setattr(self, flag, any(getattr(p, flag) for p in policies))
        # the rules whose `update` is H2O's sum (most of them): one addition for all their rows at every token
        self._summed = [p.needs_scores and adds_attention(p) for p in policies]

    def __repr__(self) -> str:
        return f"Rows({', '.join(f'{p} x{n}' for p, n in self.parts)})"

    @classmethod
    def interleaved(cls, policies: list, batch: int):
        """The policy of P caches' rows stacked as row b*P + p (`prompt.stream_many`), each cache's a policy or
        `Rows` of `batch` rows: equal neighbours share one part, so a rule's hooks run once for all its rows."""
        each = [[q for q, n in p.parts for _ in range(n)] if isinstance(p, Rows) else [p] * batch for p in policies]
        parts: list[list] = []
        for q in (each[p][b] for b in range(batch) for p in range(len(policies))):
            if parts and parts[-1][0] == q:
                parts[-1][1] += 1
            else:
                parts.append([q, 1])
        return parts[0][0] if len(parts) == 1 else cls([tuple(x) for x in parts])

    @property
    def capacity(self) -> int | None:
        caps = [p.capacity for p in self.policies]
        return None if None in caps else max(caps)

    def layer_capacity(self, layer: int, n_layer: int, length: int) -> torch.Tensor:
        """(B,) int64: the slots each row holds in `layer` (its policy's `layer_capacity`), in batch order."""
        return torch.tensor([p.layer_capacity(layer, n_layer, length) for p, n in self.parts]).repeat_interleave(
            torch.tensor(self.sizes))

    def for_model(self, cfg) -> "Rows":
        return Rows([(p.for_model(cfg), n) for p, n in self.parts])

    def for_layer(self, layer: int, n_layer: int) -> "Rows":
        return Rows([(p.for_layer(layer, n_layer), n) for p, n in self.parts])

    def _split(self, *tensors):
        """(policy, its rows of every tensor) per part; a tensor without the batch's rows (broadcast) goes whole."""
        pieces = [x.split(self.sizes) if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == self.batch
                  else [x] * len(self.parts) for x in tensors]
        return zip(self.policies, zip(*pieces))

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        hd = keys.shape[-1]  # each rule's state is the first `state_size` numbers of the widest
        return torch.cat([policy.keep_score(s, p, tt, k, v, None if n == 0 else st[..., :n])
                          for policy, (s, p, tt, k, v, st) in self._split(score, pos, t, keys, values, state)
                          for n in [policy.state_size(hd)]])

    def state_size(self, head_dim: int) -> int:
        return max(p.state_size(head_dim) for p in self.policies)

    def observe(self, state, queries, t, rope) -> torch.Tensor:
        return self._observe("observe", state, queries, t, rope)

    def observe_many(self, state, queries, pos, rope) -> torch.Tensor:
        return self._observe("observe_many", state, queries, pos, rope)

    def _observe(self, hook: str, state, queries, at, rope) -> torch.Tensor:
        """Each rule's `hook` on its own rows and its first `state_size` numbers (the rest, up to the widest
        rule's, stay as they are). In place: the state is as wide as the widest rule's for every row, so a new
        tensor would copy every row's (Expected Attention's 8k numbers per query head, for every h2o row beside
        it) at every token. Padding (`at` < 0 for `observe`) is left as it was, as every caller of `observe` leaves
        it; `observe_many` leaves it itself (docs/spec.md)."""
        hd = queries.shape[-1]
        for policy, (st, q, a) in self._split(state, queries, at):
            n = policy.state_size(hd)
            if n:
                new = getattr(policy, hook)(st[..., :n], q, a, rope)
                st[..., :n].copy_(torch.where(a[..., None] >= 0, new, st[..., :n]) if hook == "observe" else new)
        return state

    def insert_score(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.cat([policy.insert_score(k) for policy, (k,) in self._split(keys)])

    def update(self, score, p, attended) -> torch.Tensor:
        new = score + p  # (B, H, S): H2O's sum in every row, then each other rule's own rows written over it
        at = 0
        for (policy, (s, pp, a)), summed, n in zip(self._split(score, p, attended), self._summed, self.sizes):
            if not summed:
                new[at:at + n] = policy.update(s, pp, a) if policy.needs_scores else s
            at += n
        return new

    def accumulate(self, score, probs, attended) -> torch.Tensor:
        return torch.cat([policy.accumulate(s, p, a) if policy.needs_scores else s
                          for policy, (s, p, a) in self._split(score, probs, attended)])

    @property
    def prompt_window(self) -> torch.Tensor:
        """(B,) int64, dense prefill: each row's `prompt_window`, a policy's None (all queries) as the largest int."""
        every = torch.iinfo(torch.int64).max
        return torch.tensor([every if p.prompt_window is None else p.prompt_window for p in self.policies]
                            ).repeat_interleave(torch.tensor(self.sizes))

    def prompt_score(self, score: torch.Tensor) -> torch.Tensor:
        return torch.cat([policy.prompt_score(s) for policy, (s,) in self._split(score)])
