"""A KV cache that really holds C tokens per (layer, batch row, KV head): the slots, and the rule over them.

The contract is `docs/spec.md`. Read this file after the naive reference (`checks/naive.py`) and the policy
(`policies/h2o.py`): `evict` is the rule's one choice and `LayerCache.step` takes one token per row through
steps 1-4 of the spec (evict, insert, attend, update) with static shapes, so that generate.py can compile it
(`prompt.stream_token` is the same four steps over a prompt chunk's slots).

Every slot holds a key and a value (stored by a codec, `quant.py`: as they are, or as 8/4-bit codes), the
original position of its token (-1: no token) and the policy's fp32 score; nothing here is specific to one
policy. Every row has its own number of slots (`room`), so rows of several policies share a batch
(`policies/rows.py`) with no special case. The cache picks its path from the input's shape (as mlx-lm's
rotating cache does): one token per row is the decode step; a longer input is a prompt chunk, which takes
the path the cache was built with (`prompt.py`: `stream`, the same rule token by token, or `dense`, the
spec's dense prompt mode, for a first prompt).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from . import prompt
from .config import Config, layer_inv_freq
from .model import Rope, softcap
from .policies import Policy
from .quant import codec, scatter_slots_


def evict(keep: torch.Tensor, pos: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """The slot each (row, KV head) gives up: the lowest keep-score among the row's slots, ties to the oldest.
    keep: (B, H, S) fp32, -inf where a slot holds no live token (so an empty or dead slot goes first); pos:
    (B, H, S) original positions; room: bool, broadcastable to (B, H, S), the slots the row has. -> (B, H, 1)."""
    keep = torch.where(room, keep, torch.inf)
    lowest = (keep == keep.amin(-1, keepdim=True)) & room  # a slot the row lacks never goes, even if all are +inf
    return torch.where(lowest, pos, prompt.NEWEST).argmin(-1, keepdim=True)  # the oldest of the lowest


class Slots(NamedTuple):
    """A layer's slots as a prompt path reads them (`prompt.py`); `LayerCache.store` writes them back."""
    k: tuple  # the codec's parts of (B, H, C, ...): keys after RoPE, as stored
    v: tuple
    pos: torch.Tensor  # (B, H, C) int64: each slot's original position, -1 = no token
    score: torch.Tensor  # (B, H, C) fp32: the policy's score per token
    room: torch.Tensor  # (B, 1, C) bool: the slots each row has (its first room[b])
    window: int | None  # a sliding layer's W: positions p <= t - W are dead (evicted first, never attended)


class Setup(NamedTuple):
    """What every layer of one cache shares (`KVCache` makes one)."""
    dtype: torch.dtype
    device: torch.device
    prefill: str = "dense"  # the prompt path: "dense" (a first prompt) or "stream"
    kv_bits: int | None = None  # None, 8 or 4 (`quant.py`)
    token_fn: Callable | None = None  # the stream loop's body (`prompt.stream_token`, or a compiled one)


class LayerCache:
    """One layer's slots: (B, n_kv_head, C), C the widest row's; row b has the first `room[b]` of them."""

    dense_block = 128  # dense prompts attend in blocks of this many queries (tests set smaller ones)

    def __init__(self, cfg: Config, layer: int, policy: Policy, rows: list[int], setup: Setup):
        """rows: each row's slots. The layer's window (a sliding layer's W) and rotary embedding (for a rule that
        observes queries, `Policy.observe`) come from `cfg`."""
        device = setup.device
        self.policy, self.window, self.prefill = policy, cfg.window(layer), setup.prefill
        self.token_fn = setup.token_fn or prompt.stream_token
        self.rows, self.capacity = rows, max(rows)
        self.scale, self.cap = cfg.attn_scale, cfg.attn_softcap  # logits: cap * tanh(scale * q.k / cap) (Gemma 2)
        self.codec = codec(setup.kv_bits, cfg.head_dim, setup.dtype)
        shape = (len(rows), cfg.n_kv_head, max(rows))
        self.k = self.codec.empty(*shape, cfg.head_dim, device)  # parts of (B, H, C, ...): keys after RoPE
        self.v = self.codec.empty(*shape, cfg.head_dim, device)
        self.pos = torch.full(shape, -1, dtype=torch.int64, device=device)  # original positions, -1 = no token
        self.score = torch.zeros(shape, dtype=torch.float32, device=device)  # the policy's score per token
        own = torch.tensor(rows, device=device)[:, None, None]  # (B, 1, 1)
        self.room = torch.arange(max(rows), device=device) < own  # (B, 1, C): the slots each row has
        n = policy.state_size(cfg.head_dim)  # a rule's own running numbers per query head (docs/spec.md)
        self.state = torch.zeros(*shape[:2], cfg.group, n, device=device) if n else None
        inv_freq = layer_inv_freq(cfg, layer)
        self.rope = None if inv_freq is None else Rope(inv_freq.to(device))
        self.fresh = True  # nothing read yet: a dense prompt may come

    def slots(self) -> Slots:
        return Slots(self.k, self.v, self.pos, self.score, self.room, self.window)

    def store(self, k: tuple, v: tuple, pos: torch.Tensor, score: torch.Tensor) -> None:
        """A prompt path's survivors into the first n slots, in place, the rest emptied: k, v the codec's parts of
        (B, H, n, ...) as stored; pos (B, H, n), -1 = no token; score (B, H, n) fp32."""
        n = pos.shape[2]
        for stored, new in ((self.k, k), (self.v, v)):
            for part, kept in zip(stored, new):
                part[:, :, :n] = kept
        self.pos[:, :, :n], self.score[:, :, :n] = pos, score
        self.pos[:, :, n:], self.score[:, :, n:] = -1, 0.0

    def tensors(self) -> tuple[torch.Tensor, ...]:  # what the slots hold: K and V as stored, positions, scores
        return (*self.k, *self.v, self.pos, self.score)

    @property
    def nbytes(self) -> int:  # the slots, and a rule's own state (per query head, not per token)
        held = self.tensors() + (() if self.state is None else (self.state,))
        return sum(t.numel() * t.element_size() for t in held)

    def keys(self) -> torch.Tensor:
        return self.codec.decode(self.k)  # (B, H, C, hd) as attention reads them

    def values(self) -> torch.Tensor:
        return self.codec.decode(self.v)

    def live(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, C) bool: the slots attention reads at position t (a token, and on a sliding layer, in the window)."""
        live = self.pos >= 0
        return live if self.window is None else live & (self.pos > t - self.window)

    def attend(self, q, k, v, pos) -> torch.Tensor:
        """q: (B, n_head, T, hd); k, v: (B, H, T, hd) after RoPE; pos: (B, T) original positions (< 0: padding).
        Returns (B, n_head, T, hd). T = 1 is a decode step; T > 1 a prompt chunk."""
        k, v = self.codec.encode(k), self.codec.encode(v)  # parts: attention reads them as stored
        if q.shape[2] == 1:
            return self.step(q, k, v, pos)
        dense, self.fresh = self.prefill == "dense" and self.fresh, False
        return (prompt.dense if dense else prompt.stream)(self, q, k, v, pos)

    def streamed(self, q, k, v, pos) -> tuple:
        """This layer's prompt chunk as a request for `prompt.stream_many` (keys and values as stored), where a
        reader batches several layers' stream loops (`wavefront.py`): read in stream mode, no dense prompt after."""
        self.fresh = False
        return self, q, self.codec.encode(k), self.codec.encode(v), pos

    def step(self, q, k, v, pos) -> torch.Tensor:
        """One token per row through the rule, in place: no host sync, no branch on values (it is compiled)."""
        policy, t = self.policy, pos[:, :, None]  # t: (B, 1, 1)
        if self.state is not None:  # 0. observe: a rule's running state takes this token's queries (not padding's)
            B, H, g, _ = self.state.shape
            new = policy.observe(self.state, q.reshape(B, H, g, q.shape[-1]), t, self.rope)
            self.state.copy_(torch.where(t[..., None] >= 0, new, self.state))
        # 1. evict: the lowest keep-score, where a slot with no live token (empty, or dead) scores -inf
        keep = policy.keep_score(self.score, self.pos, t, self.keys(), self.values(), self.state)  # (B, H, C)
        slot = evict(keep.masked_fill(~self.live(t), -torch.inf), self.pos, self.room)  # (B, H, 1)
        # 2. insert token t into that slot, with the score it enters with (0 for H2O)
        scatter_slots_(self.k, slot, k)
        scatter_slots_(self.v, slot, v)
        self.pos.scatter_(2, slot, t.expand_as(slot))
        self.score.scatter_(2, slot, policy.insert_score(self.codec.decode(k)))
        # 3. attend over exactly the live tokens (padding, t < 0, comes before a row's first token and takes no
        # slot: it attends every slot, so that its output, never read, stays finite)
        live = (self.live(t) | (t < 0))[:, :, None]  # (B, H, 1, C)
        out, probs = self.attention(q, self.keys(), self.values(), live, policy.needs_scores)
        # 4. update the scores with this query's attention (H2O: add it)
        if policy.needs_scores:
            self.score.copy_(policy.accumulate(self.score, probs, live))
        return out

    def attention(self, q, k, v, mask, scores: bool):
        """q: (B, n_head, T, hd); k, v: (B, H, S, hd); mask: (B, H, T, S) bool, True = may attend. Returns the
        output (B, n_head, T, hd) and, with `scores`, the fp32 probabilities summed over each GQA group, (B, H, T, S)."""
        B, n_head, T, D = q.shape
        H, S = k.shape[1], k.shape[2]
        g = n_head // H
        if not scores and self.cap is None:  # SDPA cannot soft-cap: capped logits take the explicit path
            qg = q.reshape(B, H, g * T, D)  # the query heads of a group side by side: K and V are never copied
            mask = mask[:, :, None].expand(B, H, g, T, S).reshape(B, H, g * T, S)
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale).view(B, n_head, T, D), None
        probs = self.logits(q, k).masked_fill_(~mask[:, :, None], -torch.inf).softmax(-1)  # fp32
        out = probs.to(v.dtype).view(B, H, g * T, S) @ v  # (B, H, g*T, hd)
        return out.view(B, n_head, T, D), probs.sum(2) if scores else None

    def logits(self, q, k) -> torch.Tensor:
        """q: (B, n_head, T, hd); k: (B, H, S, hd). -> (B, H, g, T, S) fp32, soft-capped (Gemma 2)."""
        B, n_head, T, D = q.shape
        H, S = k.shape[1], k.shape[2]
        qg = q.reshape(B, H, n_head // H * T, D)  # the query heads of a group side by side: K is never copied
        # in place on the fresh product: a prompt block's fp32 logits are its largest tensor, held once, not thrice
        return softcap((qg @ k.transpose(-1, -2)).float().mul_(self.scale), self.cap).view(B, H, n_head // H, T, S)


class KVCache:
    """The whole model's cache: one `LayerCache` per layer, each with the capacity the policy gives its layer (the
    same C in every layer, except for per-layer policies such as PyramidKV), never more than a sliding layer's W."""

    def __init__(self, cfg: Config, policy: Policy, batch: int, length: int, dtype=torch.float32, device=None,
                 prefill: str = "dense", kv_bits: int | None = None, compile: bool = False):
        """Room for sequences of up to `length` tokens. prefill: how a prompt is read ("dense" or "stream"; a
        cache that never evicts reads it densely, which is the same); kv_bits: None, 8 or 4 (`quant.py`);
        compile: the stream loop's body as one compiled kernel. device: None = torch's default device."""
        device = torch.get_default_device() if device is None else device
        policy = policy.for_model(cfg)  # a rule fitted to one model refuses another here
        self.policy, self.length = policy, length
        self.capacity = min(policy.capacity or length, length)  # C: the mean over layers, as the budget set it
        rows = [self._rows(cfg, policy, i, batch, length) for i in range(cfg.n_layer)]
        self.evicts = any(min(r) < length for r in rows)  # else nothing ever leaves: full's logits
        self.prefill = prefill if self.evicts else "dense"
        # compiled: one graph for the loop body, dynamic in the rows (a wavefront's width varies, `wavefront.py`)
        token_fn = torch.compile(prompt.stream_token, fullgraph=True, dynamic=None) if compile else None
        setup = Setup(dtype, device, self.prefill, kv_bits, token_fn)
        self.layers = [LayerCache(cfg, i, policy.for_layer(i, cfg.n_layer), r, setup) for i, r in enumerate(rows)]
        self.kv_bits = self.layers[0].codec.bits

    @staticmethod
    def _rows(cfg: Config, policy: Policy, layer: int, batch: int, length: int) -> list[int]:
        """Layer `layer`'s slots for each row: the policy's share (rows of several policies answer one per row)."""
        caps = policy.layer_capacity(layer, cfg.n_layer, length)  # a number, or (B,) for rows of several policies
        caps = caps.tolist() if isinstance(caps, torch.Tensor) else [caps] * batch
        if len(caps) != batch:
            raise ValueError(f"{policy} covers {len(caps)} rows, not the batch's {batch}")
        return [min(c, cfg.window(layer) or length, length) for c in caps]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache: keys and values as stored, positions and scores, in every layer."""
        return sum(layer.nbytes for layer in self.layers)
