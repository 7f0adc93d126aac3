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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import Config
from .policies import Policy


@dataclass
class LayerCache:
    k: torch.Tensor  # (B, n_kv_head, C, head_dim), after RoPE
    v: torch.Tensor  # (B, n_kv_head, C, head_dim)
    pos: torch.Tensor  # (B, n_kv_head, C) int64 original positions, -1 = empty slot
    score: torch.Tensor  # (B, n_kv_head, C) fp32 accumulated attention


class KVCache:
    def __init__(self, cfg: Config, policy: Policy, batch: int, capacity: int, dtype=torch.float32,
                 device="cpu", dense_block: int = 512):
        self.policy, self.capacity, self.dense_block = policy, capacity, dense_block
        self.scale = cfg.head_dim ** -0.5
        shape = (batch, cfg.n_kv_head, capacity)
        self.layers = [
            LayerCache(k=torch.zeros(*shape, cfg.head_dim, dtype=dtype, device=device),
                       v=torch.zeros(*shape, cfg.head_dim, dtype=dtype, device=device),
                       pos=torch.full(shape, -1, dtype=torch.int64, device=device),
                       score=torch.zeros(shape, dtype=torch.float32, device=device))
            for _ in range(cfg.n_layer)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache: keys, values, positions and scores of C slots in every layer."""
        return sum(t.numel() * t.element_size() for lc in self.layers for t in (lc.k, lc.v, lc.pos, lc.score))

    def attend(self, layer: int, q, k, v, pos, mode: str) -> torch.Tensor:
        """q: (B, n_head, T, hd); k, v: (B, n_kv_head, T, hd); pos: (B, T). Returns (B, n_head, T, hd)."""
        lc = self.layers[layer]
        if mode == "step":
            return self._step(lc, q, k, v, pos)
        if mode == "stream":
            return self._stream(lc, q, k, v, pos)
        return self._dense(lc, q, k, v, pos)

    # -- one token per row: the decode step (static shapes, no host sync; compiled by generate.py) --
    def _step(self, lc: LayerCache, q, k, v, pos) -> torch.Tensor:
        B, H, C, D = lc.k.shape
        t = pos[:, :, None]  # (B, 1, 1): every row has a real token here
        keep = self.policy.keep_score(lc.score, lc.pos, t).masked_fill(lc.pos < 0, -torch.inf)  # (B, H, C)
        lowest = keep.amin(-1, keepdim=True)
        oldest_of_lowest = torch.where(keep == lowest, lc.pos, torch.iinfo(torch.int64).max)
        slot = oldest_of_lowest.argmin(-1, keepdim=True)  # (B, H, 1): the slot token t overwrites
        lc.k.scatter_(2, slot[..., None].expand(B, H, 1, D), k)
        lc.v.scatter_(2, slot[..., None].expand(B, H, 1, D), v)
        lc.pos.scatter_(2, slot, t.expand(B, H, 1))
        lc.score.scatter_(2, slot, 0.0)
        out, probs = self._attention(q, lc.k, lc.v, (lc.pos >= 0)[:, :, None, :])
        if self.policy.needs_scores:
            lc.score.copy_(self.policy.accumulate(lc.score, probs[:, :, 0]))
        return out

    def _attention(self, q, k, v, mask):
        """q: (B, n_head, T, hd); k, v: (B, H, S, hd); mask: (B, H, T, S) bool, True = may attend.
        Returns the output (B, n_head, T, hd) and, if the policy needs them, the fp32 probabilities summed
        over each GQA group, (B, H, T, S)."""
        B, n_head, T, D = q.shape
        H, S = k.shape[1], k.shape[2]
        g = n_head // H
        if not self.policy.needs_scores:
            mask = mask.repeat_interleave(g, dim=1)  # (B, n_head, T, S)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=g > 1), None
        qg = q.reshape(B, H, g * T, D)  # query heads of one group side by side
        logits = (qg @ k.transpose(-1, -2)).float() * self.scale  # (B, H, g*T, S)
        logits = logits.view(B, H, g, T, S).masked_fill(~mask[:, :, None], -torch.inf)
        probs = logits.softmax(-1)  # (B, H, g, T, S), fp32
        out = probs.to(v.dtype).view(B, H, g * T, S) @ v  # (B, H, g*T, hd)
        return out.view(B, n_head, T, D), probs.sum(2)

    # -- a prompt, densely: causal attention over it, then keep C tokens per the policy --
    def _dense(self, lc: LayerCache, q, k, v, pos) -> torch.Tensor:
        B, H, C, D = lc.k.shape
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
        lc.k[:, :, :n] = k.gather(2, idx[..., None].expand(B, H, n, D))
        lc.v[:, :, :n] = v.gather(2, idx[..., None].expand(B, H, n, D))
        kept_pos = pos[:, None, :].expand(B, H, T).gather(2, idx)
        lc.pos[:, :, :n] = kept_pos.masked_fill(kept_pos < 0, -1)
        lc.score[:, :, :n] = score.gather(2, idx).masked_fill(kept_pos < 0, 0.0)
        lc.pos[:, :, n:] = -1
        lc.score[:, :, n:] = 0.0
        return out

    # -- a chunk through the per-token rule: prefill (stream mode) and evaluation --
    def _stream(self, lc: LayerCache, q, k, v, pos) -> torch.Tensor:
        B, H, C, D = lc.k.shape
        n_head, K = q.shape[1], q.shape[2]
        g = n_head // H
        # Virtual slots: the C cached tokens in position order (empty ones first), then the K new tokens.
        # In position order, argmin's first-minimum rule *is* "ties evict the oldest".
        order = lc.pos.argsort(dim=-1, stable=True)  # (B, H, C)
        vk = torch.cat([lc.k.gather(2, order[..., None].expand(B, H, C, D)), k], 2)  # (B, H, C+K, hd)
        vv = torch.cat([lc.v.gather(2, order[..., None].expand(B, H, C, D)), v], 2)
        vpos = torch.cat([lc.pos.gather(2, order), pos[:, None, :].expand(B, H, K)], 2)  # (B, H, C+K)
        vscore = torch.cat([lc.score.gather(2, order), vpos.new_zeros(B, H, K, dtype=torch.float32)], 2)
        alive = torch.cat([vpos[..., :C] >= 0, vpos.new_zeros(B, H, K, dtype=torch.bool)], 2)  # attendable
        member = torch.cat([vpos.new_ones(B, H, C, dtype=torch.bool), vpos.new_zeros(B, H, K, dtype=torch.bool)], 2)
        logits = (q.reshape(B, H, g * K, D) @ vk.transpose(-1, -2)).float() * self.scale
        logits = logits.view(B, H, g, K, C + K)
        probs = torch.empty_like(logits)  # (B, H, g, K, C+K)
        valid = pos >= 0  # (B, K)
        for i in range(K):
            ok = valid[:, i, None, None]  # (B, 1, 1); a padding token evicts, inserts and scores nothing
            keep = self.policy.keep_score(vscore, vpos, pos[:, i, None, None])
            keep = keep.masked_fill(~alive, -torch.inf).masked_fill(~member, torch.inf)
            slot = keep.argmin(-1, keepdim=True)  # (B, H, 1): an empty slot while the cache is filling
            member.scatter_(2, slot, ~ok.expand(B, H, 1))  # evicted for good
            alive.scatter_(2, slot, alive.gather(2, slot) & ~ok)
            member[..., C + i] = ok[..., 0]
            alive[..., C + i] = ok[..., 0]
            p = logits[:, :, :, i].masked_fill(~(alive | ~ok)[:, :, None], -torch.inf).softmax(-1)
            probs[:, :, :, i] = p  # (B, H, g, C+K)
            if self.policy.needs_scores:
                vscore = self.policy.accumulate(vscore, p.sum(2) * ok)
        out = probs.to(v.dtype).view(B, H, g * K, C + K) @ vv  # (B, H, g*K, hd)
        # Exactly C virtual slots are still members (one left for each one that came in): compact them.
        kept = (~member).to(torch.uint8).argsort(dim=-1, stable=True)[..., :C]  # (B, H, C), position order
        kept_alive = alive.gather(2, kept)
        lc.k.copy_(vk.gather(2, kept[..., None].expand(B, H, C, D)))
        lc.v.copy_(vv.gather(2, kept[..., None].expand(B, H, C, D)))
        lc.pos.copy_(vpos.gather(2, kept).masked_fill(~kept_alive, -1))
        lc.score.copy_(vscore.gather(2, kept).masked_fill(~kept_alive, 0.0))
        return out.view(B, n_head, K, D)
