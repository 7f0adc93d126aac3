"""A KV cache that really holds C tokens per (layer, batch row, KV head), and the eviction mechanics.

Contract: `docs/spec.md`. When token t arrives: (1) if the cache is full, evict the cached token
with the lowest keep-score (the policy's call, ties: the oldest); (2) insert t with the policy's insert
score (0 for H2O); (3) attend over exactly the cached tokens, softmax in fp32; (4) update each cached
token's score from this attention, summed over the query heads of its GQA group (H2O: add it). Nothing here
is specific to one policy: every choice is a call on the `Policy` (see `policies/base.py`).

Every slot has a key, a value, an original position (-1: empty) and a score. Two ideas keep this short:

* **Eviction is one argmin.** Empty slots get keep-score -inf, so the same code fills and evicts, with no
  branch on "is the cache full yet?".
* **Three ways to run the rule, one result.** `step` handles one token per row (the compiled decode step):
  it overwrites the chosen slot in place. `stream` feeds a whole chunk through the rule token by token
  (prefill and evaluation): it computes the chunk's attention logits in one matmul, runs only the small
  evict/insert/softmax loop sequentially over C + chunk "virtual" slots, and compacts the survivors back
  into C slots. `dense` is the spec's dense prompt mode: causal attention over the prompt, then keep C.

Keys and values are stored through a codec (`quant.py`): as they are, or as 8/4-bit integers; attention
and policies always read the decoded tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import Config
from .policies import Policy
from .policies.base import check_causal, keep_scores
from .policies.rows import Rows
from .quant import cat_slots, codec, gather_slots, scatter_slots_

ABSENT = -2  # the position of a slot a row does not have: rows of several policies (`Rows`) share one layer's
# C = the widest row's capacity, and a narrower row's extra slots carry this mark. Like an empty slot (-1) it is
# never attended; unlike one it is never filled (never a victim), so the row holds exactly its own capacity.


class LayerCache:
    """One layer's C slots per (row, KV head), and the eviction mechanics over them."""

    def __init__(self, cfg: Config, policy: Policy, batch: int, capacity: int | list[int], dtype, device,
                 dense_block: int, token_fn, kv_bits: int | None = None, window: int | None = None):
        """window: a sliding-window layer's W (docs/spec.md): tokens with p <= t - W are dead, evicted before
        any live one and never attended; the caller gives it at most W slots. capacity: C, or one per row (`Rows`)."""
        rows = capacity if isinstance(capacity, list) else [capacity] * batch
        capacity = max(rows)
        self.policy, self.capacity, self.dense_block, self.token_fn = policy, capacity, dense_block, token_fn
        self.row_capacity, self.uneven = rows, len(set(rows)) > 1  # uneven: some row has ABSENT slots
        self.window = window
        self.scale, self.cap = cfg.attn_scale, cfg.attn_softcap  # the logits: cap * tanh(scale * q.k / cap) (Gemma 2)
        self.codec = codec(kv_bits, cfg.head_dim, dtype)
        shape = (batch, cfg.n_kv_head, capacity)
        self.k = self.codec.empty(*shape, cfg.head_dim, device)  # parts of (B, n_kv_head, C, ...), after RoPE
        self.v = self.codec.empty(*shape, cfg.head_dim, device)
        self.pos = torch.full(shape, -1, dtype=torch.int64, device=device)  # original positions, -1 = empty
        self.own = torch.tensor(rows, device=device)[:, None, None]  # (B, 1, 1) each row's own C; slots past it:
        self.pos.masked_fill_(torch.arange(capacity, device=device) >= self.own, ABSENT)  # absent (uneven rows only)
        self.score = torch.zeros(shape, dtype=torch.float32, device=device)  # the policy's per-token score

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Everything the cache holds (keys and values in their stored form, positions, scores)."""
        return (*self.k, *self.v, self.pos, self.score)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def keys(self) -> torch.Tensor:
        return self.codec.decode(self.k)  # (B, H, C, hd) as attention reads them

    def attend(self, q, k, v, pos, mode: str) -> torch.Tensor:
        """q: (B, n_head, T, hd); k, v: (B, n_kv_head, T, hd); pos: (B, T). Returns (B, n_head, T, hd)."""
        k, v = self.codec.encode(k), self.codec.encode(v)  # parts; stored as they will be read
        if mode == "step":
            return self._step(q, k, v, pos)
        if mode == "stream":
            return self._stream(q, k, v, pos)
        return self._dense(q, k, v, pos)

    # -- one token per row: the decode step (static shapes, no host sync; compiled by generate.py) --
    def _step(self, q, k, v, pos) -> torch.Tensor:
        policy = self.policy
        t = pos[:, :, None]  # (B, 1, 1): every row has a real token here
        keys = self.keys() if policy.needs_keys else None
        values = self.codec.decode(self.v) if policy.needs_values else None
        dead = self.pos < 0  # empty slots, and on a sliding layer the tokens that left its window
        if self.window is not None:
            dead = dead | (self.pos <= t - self.window)
        keep = keep_scores(policy, self.score, self.pos, t, keys, values).masked_fill(dead, -torch.inf)  # (B, H, C)
        absent = self.pos == ABSENT if self.uneven else None
        if self.uneven:
            keep = keep.masked_fill(absent, torch.inf)
        candidates = keep == keep.amin(-1, keepdim=True)
        if self.uneven:  # a row's absent slots are never filled, even when it protects every slot it has
            candidates = candidates & ~absent
        oldest_of_lowest = torch.where(candidates, self.pos, torch.iinfo(torch.int64).max)
        slot = oldest_of_lowest.argmin(-1, keepdim=True)  # (B, H, 1): the slot token t overwrites
        scatter_slots_(self.k, slot, k)
        scatter_slots_(self.v, slot, v)
        self.pos.scatter_(2, slot, t.expand_as(slot))
        self.score.scatter_(2, slot, policy.insert_score(self.codec.decode(k)))
        live = self.pos >= 0 if self.window is None else (self.pos >= 0) & (self.pos > t - self.window)
        attended = live[:, :, None, :]  # (B, H, 1, C)
        out, probs = self._attention(q, self.keys(), self.codec.decode(self.v), attended, policy.needs_scores)
        if policy.needs_scores:
            self.score.copy_(policy.accumulate(self.score, probs, attended))
        return out

    def _attention(self, q, k, v, mask, scores: bool):
        """q: (B, n_head, T, hd); k, v: (B, H, S, hd); mask: (B, H, T, S) bool, True = may attend.
        Returns the output (B, n_head, T, hd) and, with `scores`, the fp32 probabilities summed over each
        GQA group, (B, H, T, S)."""
        B, n_head, T, D = q.shape
        H, S = k.shape[1], k.shape[2]
        g = n_head // H
        qg = q.reshape(B, H, g * T, D)  # the query heads of a group side by side: K and V are never copied
        if not scores and self.cap is None:  # SDPA cannot soft-cap: capped logits take the explicit path
            mask = mask[:, :, None].expand(B, H, g, T, S).reshape(B, H, g * T, S)
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale).view(B, n_head, T, D), None
        logits = (qg @ k.transpose(-1, -2)).float().view(B, H, g, T, S)  # a new tensor: changed in place below
        probs = self._capped(logits.mul_(self.scale)).masked_fill_(~mask[:, :, None], -torch.inf).softmax(-1)  # fp32
        out = probs.to(v.dtype).view(B, H, g * T, S) @ v  # (B, H, g*T, hd)
        return out.view(B, n_head, T, D), probs.sum(2) if scores else None

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's soft-cap, in place on fp32 logits: cap * tanh(logits / cap)."""
        return logits if self.cap is None else logits.div_(self.cap).tanh_().mul_(self.cap)

    # -- a prompt, densely: causal attention over it, then keep C tokens per the policy --
    def _dense(self, q, k_parts, v_parts, pos) -> torch.Tensor:
        policy, C = self.policy, self.capacity
        k, v = self.codec.decode(k_parts), self.codec.decode(v_parts)
        B, H, T, D = k.shape
        valid = pos >= 0  # (B, T) left padding is invalid
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        # padding queries see themselves so no softmax row is empty; they are dropped below
        mask = causal & valid[:, None, :]  # (B, T, T)
        if self.window is not None:  # a sliding layer's queries see the last W positions only
            mask = mask & ((pos[:, :, None] - pos[:, None, :]) < self.window)
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)
        # Only the last `prompt_window` queries (all, by default) shape the scores; rows end together at T - 1.
        windows = policy.prompt_windows() if isinstance(policy, Rows) else [policy.prompt_window] * B  # per row
        first = torch.tensor([T - min(T, w or T) for w in windows], device=q.device)
        first_scored = int(first.min())
        scored_query = valid & (torch.arange(T, device=q.device) >= first[:, None])  # (B, T)
        out = torch.empty_like(q)
        score = policy.insert_score(k)  # (B, H, T)
        # Query blocks bound the memory of a block's fp32 probabilities: 16 MiB on CPU, where smaller blocks are
        # faster too; 256 MiB on a GPU, where each block is a few kernel launches.
        budget = 2**22 if q.device.type == "cpu" else 2**26  # fp32 values
        rows = max(1, min(self.dense_block, budget // (B * q.shape[1] * T)))
        for s in range(0, T, rows):
            e = min(T, s + rows)
            scores = policy.needs_scores and e > first_scored
            # Causal: queries s..e-1 see keys 0..e-1 only, so later keys are neither computed nor scored (their
            # scores stay as inserted: no query before a token may change its score).
            block = mask[:, None, s:e, :e].expand(B, H, -1, -1)
            out[:, :, s:e], probs = self._attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], block, scores)
            if scores:  # queries left out of the scoring attend nothing, as far as the policy sees
                attended = block & scored_query[:, None, s:e, None]
                if not bool(scored_query[:, s:e].all()):  # masked keys already have probability 0
                    probs.masked_fill_(~attended, 0.0)
                seen = policy.accumulate(score[..., :e], probs, attended)
                score = torch.cat([seen, score[..., e:]], -1)
        score = policy.prompt_score(score)
        t_last = pos.amax(-1)[:, None, None]  # (B, 1, 1): each row's last prompt position
        prompt_pos = pos[:, None, :].expand(B, H, T)
        keys, values = (k if policy.needs_keys else None), (v if policy.needs_values else None)
        keep = keep_scores(policy, score, prompt_pos.masked_fill(~valid[:, None], -1), t_last, keys, values)
        keep = keep.masked_fill(~valid[:, None, :], -torch.inf)
        if self.window is not None:  # chosen among the tokens still inside the last position's window
            keep = keep.masked_fill(prompt_pos <= t_last - self.window, -torch.inf)
        n = min(C, T)
        # the n highest keep-scores, ties to the newest (flip: a stable sort keeps the earlier = newer first)
        ranked = keep.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :n]
        idx = T - 1 - ranked
        if self.uneven:  # a row keeps its own C: its ranks past it sort last, into the slots that are absent
            idx = idx.masked_fill(torch.arange(n, device=q.device) >= self.own, T)
        idx = idx.sort(-1).values.clamp(max=T - 1)  # (B, H, n) kept tokens in position order
        for stored, new in ((self.k, k_parts), (self.v, v_parts)):
            for part, kept in zip(stored, gather_slots(new, idx)):
                part[:, :, :n] = kept
        kept_pos = prompt_pos.gather(2, idx)
        self.pos[:, :, :n] = kept_pos.masked_fill(kept_pos < 0, -1)
        self.score[:, :, :n] = score.gather(2, idx).masked_fill(kept_pos < 0, 0.0)
        self.pos[:, :, n:] = -1
        self.score[:, :, n:] = 0.0
        if self.uneven:
            beyond = torch.arange(C, device=q.device) >= self.own  # (B, 1, C)
            self.pos.masked_fill_(beyond, ABSENT)
            self.score.masked_fill_(beyond, 0.0)
        return out

    # -- a chunk through the per-token rule: prefill (stream mode) and evaluation --
    def _stream(self, q, k_parts, v_parts, pos) -> torch.Tensor:
        B, H, C = self.pos.shape
        n_head, K, D = q.shape[1], q.shape[2], q.shape[3]
        g = n_head // H
        # Virtual slots: the C cached tokens in position order (empty ones first), then the K new tokens.
        # In position order, argmin's first-minimum rule *is* "ties evict the oldest".
        # (A row's absent slots go after its cached ones: never first, where an all-protected argmin would look.)
        rank = self.pos.masked_fill(self.pos == ABSENT, torch.iinfo(torch.int64).max) if self.uneven else self.pos
        order = rank.argsort(dim=-1, stable=True)  # (B, H, C)
        vk_parts = cat_slots(gather_slots(self.k, order), k_parts)  # (B, H, C+K, ...)
        vv_parts = cat_slots(gather_slots(self.v, order), v_parts)
        vk, vv = self.codec.decode(vk_parts), self.codec.decode(vv_parts)  # (B, H, C+K, hd)
        vpos = torch.cat([self.pos.gather(2, order), pos[:, None, :].expand(B, H, K)], 2)  # (B, H, C+K)
        new_score = self.policy.insert_score(vk[:, :, C:])  # (B, H, K)
        vscore = torch.cat([self.score.gather(2, order), new_score], 2)
        alive = torch.cat([vpos[..., :C] >= 0, vpos.new_zeros(B, H, K, dtype=torch.bool)], 2)  # attendable
        member = torch.cat([vpos[..., :C] != ABSENT, vpos.new_zeros(B, H, K, dtype=torch.bool)], 2)  # in the cache
        logits = self._capped((q.reshape(B, H, g * K, D) @ vk.transpose(-1, -2)).float() * self.scale)
        logits = logits.view(B, H, g, K, C + K)
        probs = torch.empty_like(logits)  # (B, H, g, K, C+K)
        slots = torch.arange(C + K, device=q.device)
        keys, values = (vk if self.policy.needs_keys else None), (vv if self.policy.needs_values else None)
        for i in range(K):
            t, ok = pos[:, i, None, None], pos[:, i, None, None] >= 0  # (B, 1, 1); padding: ok is False
            if self.window is not None:  # dead tokens: not attended, evicted first (as empty slots are)
                alive = alive & (vpos > t - self.window)
            vscore, alive, member, probs[:, :, :, i] = self.token_fn(self.policy, vscore, vpos, alive, member,
                                                                     logits[:, :, :, i], t, ok, slots, keys, values)
        out = probs.to(vv.dtype).view(B, H, g * K, C + K) @ vv  # (B, H, g*K, hd)
        # Exactly C virtual slots are still members (one left for each one that came in; a row's own C if it has
        # absent slots, which then fill the rest): compact them.
        kept = (~member).to(torch.uint8).argsort(dim=-1, stable=True)[..., :C]  # (B, H, C), position order
        kept_alive = alive.gather(2, kept)
        for stored, virtual in ((self.k, vk_parts), (self.v, vv_parts)):
            for part, survivor in zip(stored, gather_slots(virtual, kept)):
                part.copy_(survivor)
        self.pos.copy_(vpos.gather(2, kept).masked_fill(~kept_alive, -1))
        if self.uneven:  # the slots past a row's own C (never alive) are absent again
            self.pos.masked_fill_(~member.gather(2, kept), ABSENT)
        self.score.copy_(vscore.gather(2, kept).masked_fill(~kept_alive, 0.0))
        return out.view(B, n_head, K, D)


def stream_token(policy: Policy, score, pos, alive, member, logits, t, ok, slots, keys, values=None):
    """Steps 1-4 of the rule for the token at position t, over the virtual slots of `LayerCache._stream`.

    score, pos: (B, H, S) fp32 / int64; alive (attendable) and member (in the cache, empty or not): (B, H, S)
    bool; logits: (B, H, g, S) this token's fp32 attention logits; t, ok: (B, 1, 1) its position and whether
    it is a real token (padding evicts, inserts and scores nothing); slots: arange(S); keys, values:
    (B, H, S, hd) or None. Element-wise masks only (no indexing by t), so torch.compile fuses it into one kernel.
    """
    # A rule across slots (KeyDiff's mean key) must see which slots are cached; element-wise rules need not
    # (the masks below override the keep-score of every other slot), so they are spared the op.
    seen = pos.masked_fill(~alive, -1) if policy.needs_keys or policy.needs_values or policy.across_slots else pos
    keep = keep_scores(policy, score, seen, t, keys, values).masked_fill(~alive, -torch.inf).masked_fill(~member, torch.inf)
    victim = (slots == keep.argmin(-1, keepdim=True)) & ok  # an empty slot while the cache is filling
    arrive = (pos == t) & ok
    member = member & ~victim | arrive
    alive = alive & ~victim | arrive
    probs = logits.masked_fill(~(alive | ~ok)[:, :, None], -torch.inf).softmax(-1)  # (B, H, g, S)
    if policy.needs_scores:
        attended = alive[:, :, None]  # (B, H, 1, S)
        score = torch.where(ok, policy.accumulate(score, probs.sum(2, keepdim=True), attended), score)
    return score, alive, member, probs


class KVCache:
    """The whole model's cache: one `LayerCache` per layer, all with the same policy, each with the capacity
    the policy gives its layer (the same C in every layer, except for per-layer policies such as PyramidKV).
    With `Rows` (several policies, each over its own rows) each row has its own policy's capacity."""

    def __init__(self, cfg: Config, policy: Policy, batch: int, length: int, dtype=torch.float32,
                 device=None, dense_block: int = 128, token_fn=stream_token, kv_bits: int | None = None):
        """Room for sequences of up to `length` tokens: layer i holds `policy.layer_capacity(i, n_layer, length)`
        tokens per row and KV head (never more than `length`). kv_bits: None, 8 or 4 (see `quant.py`).
        device: None = torch's default device (like its tensor factories)."""
        check_causal(policy)  # every command that runs a policy token by token builds its cache here
        device = torch.get_default_device() if device is None else device
        self.policy, self.length = policy, length
        self.capacity = min(policy.capacity or length, length)  # C: the mean over layers, as the budget set it
        if isinstance(policy, Rows) and policy.batch != batch:
            raise ValueError(f"{policy} covers {policy.batch} rows, not the batch's {batch}")

        def slots(i: int) -> int | list[int]:  # layer i's C (one per row for Rows), never past its window
            n, room = cfg.n_layer, cfg.window(i) or length
            if isinstance(policy, Rows):
                return [min(c, room) for c in policy.row_capacities(i, n, length)]
            return min(policy.layer_capacity(i, n, length), room)
        self.layers = [LayerCache(cfg, policy.for_layer(i, cfg.n_layer), batch, slots(i), dtype, device,
                                  dense_block, token_fn, kv_bits, cfg.window(i)) for i in range(cfg.n_layer)]
        self.kv_bits = self.layers[0].codec.bits

    @property
    def evicts(self) -> bool:
        """Whether some layer holds fewer slots than `length` (else nothing is ever evicted: full's logits)."""
        return any(min(layer.row_capacity) < self.length for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache: keys and values as stored, positions and scores, in every layer."""
        return sum(layer.nbytes for layer in self.layers)
