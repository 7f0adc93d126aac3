"""A KV cache that really holds C tokens per (layer, batch row, KV head), and the eviction mechanics.

Contract: `shared/spec/eviction.md`. When token t arrives: (1) if the cache is full, evict the cached token
with the lowest keep-score (the policy's call, ties: the oldest); (2) insert t with score 0; (3) attend over
exactly the cached tokens, softmax in fp32; (4) add each cached token's attention, summed over the query
heads of its GQA group, to its score. Nothing here is specific to one policy.

Every slot has a key, a value, an original position (-1: empty) and a score. Two ideas keep this short:

* **Eviction is one argmin.** Empty slots get keep-score -inf, so the same code fills and evicts, with no
  branch on "is the cache full yet?".
* **Three ways to run the rule, one result.** `step` handles one token per row (the compiled decode step):
  it overwrites the chosen slot in place. `stream` feeds a whole chunk through the rule token by token
  (prefill and evaluation): it computes the chunk's attention logits in one matmul, runs only the small
  evict/insert/softmax loop sequentially over C + chunk "virtual" slots, and compacts the survivors back
  into C slots. `dense` is the spec's dense prompt mode: causal attention over the prompt, then keep C.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import Config
from .policies import Policy


class LayerCache:
    """One layer's C slots per (row, KV head), and the eviction mechanics over them."""

    def __init__(self, cfg: Config, policy: Policy, batch: int, capacity: int, dtype, device, dense_block: int,
                 token_fn):
        self.policy, self.dense_block, self.token_fn = policy, dense_block, token_fn
        self.scale = cfg.head_dim ** -0.5
        shape = (batch, cfg.n_kv_head, capacity)
        self.k = torch.zeros(*shape, cfg.head_dim, dtype=dtype, device=device)  # (B, n_kv_head, C, hd), after RoPE
        self.v = torch.zeros(*shape, cfg.head_dim, dtype=dtype, device=device)  # (B, n_kv_head, C, hd)
        self.pos = torch.full(shape, -1, dtype=torch.int64, device=device)  # original positions, -1 = empty
        self.score = torch.zeros(shape, dtype=torch.float32, device=device)  # accumulated attention

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.score))

    def attend(self, q, k, v, pos, mode: str) -> torch.Tensor:
        """q: (B, n_head, T, hd); k, v: (B, n_kv_head, T, hd); pos: (B, T). Returns (B, n_head, T, hd)."""
        if mode == "step":
            return self._step(q, k, v, pos)
        if mode == "stream":
            return self._stream(q, k, v, pos)
        return self._dense(q, k, v, pos)

    # -- one token per row: the decode step (static shapes, no host sync; compiled by generate.py) --
    def _step(self, q, k, v, pos) -> torch.Tensor:
        B, H, C, D = self.k.shape
        t = pos[:, :, None]  # (B, 1, 1): every row has a real token here
        keep = self.policy.keep_score(self.score, self.pos, t).masked_fill(self.pos < 0, -torch.inf)  # (B, H, C)
        lowest = keep.amin(-1, keepdim=True)
        oldest_of_lowest = torch.where(keep == lowest, self.pos, torch.iinfo(torch.int64).max)
        slot = oldest_of_lowest.argmin(-1, keepdim=True)  # (B, H, 1): the slot token t overwrites
        self.k.scatter_(2, slot[..., None].expand(B, H, 1, D), k)
        self.v.scatter_(2, slot[..., None].expand(B, H, 1, D), v)
        self.pos.scatter_(2, slot, t.expand(B, H, 1))
        self.score.scatter_(2, slot, 0.0)
        out, probs = self._attention(q, self.k, self.v, (self.pos >= 0)[:, :, None, :])
        if self.policy.needs_scores:
            self.score.copy_(self.policy.accumulate(self.score, probs[:, :, 0]))
        return out

    def _attention(self, q, k, v, mask):
        """q: (B, n_head, T, hd); k, v: (B, H, S, hd); mask: (B, H, T, S) bool, True = may attend.
        Returns the output (B, n_head, T, hd) and, if the policy needs them, the fp32 probabilities summed
        over each GQA group, (B, H, T, S)."""
        B, n_head, T, D = q.shape
        H, S = k.shape[1], k.shape[2]
        g = n_head // H
        qg = q.reshape(B, H, g * T, D)  # the query heads of a group side by side: K and V are never copied
        if not self.policy.needs_scores:
            mask = mask[:, :, None].expand(B, H, g, T, S).reshape(B, H, g * T, S)
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).view(B, n_head, T, D), None
        logits = (qg @ k.transpose(-1, -2)).float() * self.scale  # (B, H, g*T, S)
        logits = logits.view(B, H, g, T, S).masked_fill(~mask[:, :, None], -torch.inf)
        probs = logits.softmax(-1)  # (B, H, g, T, S), fp32
        out = probs.to(v.dtype).view(B, H, g * T, S) @ v  # (B, H, g*T, hd)
        return out.view(B, n_head, T, D), probs.sum(2)

    # -- a prompt, densely: causal attention over it, then keep C tokens per the policy --
    def _dense(self, q, k, v, pos) -> torch.Tensor:
        B, H, C, D = self.k.shape
        T = q.shape[2]
        valid = pos >= 0  # (B, T) left padding is invalid
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        # padding queries see themselves so no softmax row is empty; they are dropped below
        mask = (causal & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=q.device)  # (B, T, T)
        out = torch.empty_like(q)
        score = torch.zeros(B, H, T, device=q.device)
        for s in range(0, T, self.dense_block):  # query blocks bound the (T x T) probability memory
            e = min(T, s + self.dense_block)
            out[:, :, s:e], probs = self._attention(q[:, :, s:e], k, v, mask[:, None, s:e].expand(B, H, -1, -1))
            if probs is not None:
                score += (probs * valid[:, None, s:e, None]).sum(2)  # s_j = sum over prompt queries
        t_last = pos.amax(-1)[:, None, None]  # (B, 1, 1): each row's last prompt position
        keep = self.policy.keep_score(score, pos[:, None, :].expand(B, H, T), t_last)
        keep = keep.masked_fill(~valid[:, None, :], -torch.inf)
        n = min(C, T)
        # the n highest keep-scores, ties to the newest (flip: a stable sort keeps the earlier = newer first)
        ranked = keep.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :n]
        idx = (T - 1 - ranked).sort(-1).values  # (B, H, n) kept tokens in position order
        self.k[:, :, :n] = k.gather(2, idx[..., None].expand(B, H, n, D))
        self.v[:, :, :n] = v.gather(2, idx[..., None].expand(B, H, n, D))
        kept_pos = pos[:, None, :].expand(B, H, T).gather(2, idx)
        self.pos[:, :, :n] = kept_pos.masked_fill(kept_pos < 0, -1)
        self.score[:, :, :n] = score.gather(2, idx).masked_fill(kept_pos < 0, 0.0)
        self.pos[:, :, n:] = -1
        self.score[:, :, n:] = 0.0
        return out

    # -- a chunk through the per-token rule: prefill (stream mode) and evaluation --
    def _stream(self, q, k, v, pos) -> torch.Tensor:
        B, H, C, D = self.k.shape
        n_head, K = q.shape[1], q.shape[2]
        g = n_head // H
        # Virtual slots: the C cached tokens in position order (empty ones first), then the K new tokens.
        # In position order, argmin's first-minimum rule *is* "ties evict the oldest".
        order = self.pos.argsort(dim=-1, stable=True)  # (B, H, C)
        vk = torch.cat([self.k.gather(2, order[..., None].expand(B, H, C, D)), k], 2)  # (B, H, C+K, hd)
        vv = torch.cat([self.v.gather(2, order[..., None].expand(B, H, C, D)), v], 2)
        vpos = torch.cat([self.pos.gather(2, order), pos[:, None, :].expand(B, H, K)], 2)  # (B, H, C+K)
        vscore = torch.cat([self.score.gather(2, order), vpos.new_zeros(B, H, K, dtype=torch.float32)], 2)
        alive = torch.cat([vpos[..., :C] >= 0, vpos.new_zeros(B, H, K, dtype=torch.bool)], 2)  # attendable
        member = torch.cat([vpos.new_ones(B, H, C, dtype=torch.bool), vpos.new_zeros(B, H, K, dtype=torch.bool)], 2)
        logits = (q.reshape(B, H, g * K, D) @ vk.transpose(-1, -2)).float() * self.scale
        logits = logits.view(B, H, g, K, C + K)
        probs = torch.empty_like(logits)  # (B, H, g, K, C+K)
        slots = torch.arange(C + K, device=q.device)
        for i in range(K):
            t, ok = pos[:, i, None, None], pos[:, i, None, None] >= 0  # (B, 1, 1); padding: ok is False
            vscore, alive, member, probs[:, :, :, i] = self.token_fn(self.policy, vscore, vpos, alive, member,
                                                                     logits[:, :, :, i], t, ok, slots)
        out = probs.to(v.dtype).view(B, H, g * K, C + K) @ vv  # (B, H, g*K, hd)
        # Exactly C virtual slots are still members (one left for each one that came in): compact them.
        kept = (~member).to(torch.uint8).argsort(dim=-1, stable=True)[..., :C]  # (B, H, C), position order
        kept_alive = alive.gather(2, kept)
        self.k.copy_(vk.gather(2, kept[..., None].expand(B, H, C, D)))
        self.v.copy_(vv.gather(2, kept[..., None].expand(B, H, C, D)))
        self.pos.copy_(vpos.gather(2, kept).masked_fill(~kept_alive, -1))
        self.score.copy_(vscore.gather(2, kept).masked_fill(~kept_alive, 0.0))
        return out.view(B, n_head, K, D)


def stream_token(policy: Policy, score, pos, alive, member, logits, t, ok, slots):
    """Steps 1-4 of the rule for the token at position t, over the virtual slots of `LayerCache._stream`.

    score, pos: (B, H, S) fp32 / int64; alive (attendable) and member (in the cache, empty or not): (B, H, S)
    bool; logits: (B, H, g, S) this token's fp32 attention logits; t, ok: (B, 1, 1) its position and whether
    it is a real token (padding evicts, inserts and scores nothing); slots: arange(S).
    Element-wise masks only (no indexing by t), so torch.compile fuses it into one kernel.
    """
    keep = policy.keep_score(score, pos, t).masked_fill(~alive, -torch.inf).masked_fill(~member, torch.inf)
    victim = (slots == keep.argmin(-1, keepdim=True)) & ok  # an empty slot while the cache is filling
    arrive = (pos == t) & ok
    member = member & ~victim | arrive
    alive = alive & ~victim | arrive
    probs = logits.masked_fill(~(alive | ~ok)[:, :, None], -torch.inf).softmax(-1)  # (B, H, g, S)
    if policy.needs_scores:
        score = policy.accumulate(score, probs.sum(2) * ok)
    return score, alive, member, probs


class KVCache:
    """The whole model's cache: one `LayerCache` per layer, all with the same policy and capacity C."""

    def __init__(self, cfg: Config, policy: Policy, batch: int, capacity: int, dtype=torch.float32,
                 device="cpu", dense_block: int = 512, token_fn=stream_token):
        self.policy, self.capacity = policy, capacity
        self.layers = [LayerCache(cfg, policy, batch, capacity, dtype, device, dense_block, token_fn)
                       for _ in range(cfg.n_layer)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache: keys, values, positions and scores of C slots in every layer."""
        return sum(layer.nbytes for layer in self.layers)
