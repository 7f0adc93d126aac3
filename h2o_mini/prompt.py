"""The two ways a `cache.LayerCache` reads a prompt chunk (more than one token per row); docs/spec.md, "Prompts".

* `stream`: the spec's rule token by token, as if the chunk were generated, exactly. Each layer has the whole
  chunk's q, k, v at once, so the attention logits of every token to every slot come from one matmul; only
  the small evict / insert / softmax / update body (`stream_token`) runs once per token, over C + K
  "virtual" slots (the C cached tokens in position order, then the K new ones); the survivors are then
  compacted back into the C slots.
* `dense`: causal attention over the prompt with nothing evicted, the scores summed over its queries, then
  the C tokens with the highest keep-score at the last prompt position stay (the spec's shortcut, for a
  first prompt).
"""
from __future__ import annotations

import torch

from .model import softcap
from .quant import cat_slots, gather_slots

NEWEST = torch.iinfo(torch.int64).max  # a position later than any token: never the oldest


def stream(c, q, k_parts, v_parts, pos) -> torch.Tensor:
    """The chunk through the rule one token at a time. q: (B, n_head, K, hd); k_parts, v_parts: the codec's
    parts of (B, H, K, ...); pos: (B, K) (< 0: padding, which takes no slot). -> (B, n_head, K, hd)."""
    B, H, C = c.pos.shape
    n_head, K, D = q.shape[1], q.shape[2], q.shape[3]
    g = n_head // H
    # Virtual slots: the cached tokens in position order (empty slots first; slots a row does not have last, so
    # that a row's sums run over its slots in the same order whatever its neighbours' capacities), then the K new.
    order = torch.where(c.room, c.pos, NEWEST).argsort(dim=-1, stable=True)  # (B, H, C)
    vk_parts = cat_slots(gather_slots(c.k, order), k_parts)  # (B, H, C+K, ...)
    vv_parts = cat_slots(gather_slots(c.v, order), v_parts)
    vk, vv = c.codec.decode(vk_parts), c.codec.decode(vv_parts)  # (B, H, C+K, hd)
    vpos = torch.cat([c.pos.gather(2, order), pos[:, None, :].expand(B, H, K)], 2)  # (B, H, C+K)
    vscore = torch.cat([c.score.gather(2, order), c.policy.insert_score(vk[:, :, C:])], 2)
    none = vpos.new_zeros(B, H, K, dtype=torch.bool)
    alive = torch.cat([vpos[..., :C] >= 0, none], 2)  # attendable
    member = torch.cat([c.room.expand(B, H, C).gather(2, order), none], 2)  # a slot of the row's cache
    logits = _logits(c, q, vk)  # (B, H, g, K, C+K)
    probs = torch.empty_like(logits)
    slots = torch.arange(C + K, device=q.device)
    padded = bool((pos < 0).any())  # (one host sync a chunk) without padding, the loop leaves out its masks
    for i in range(K):
        t = pos[:, i, None, None]  # (B, 1, 1)
        ok = t >= 0 if padded else None  # padding: ok is False
        if c.window is not None:  # dead tokens: not attended, evicted first (as empty slots are)
            alive = alive & (vpos > t - c.window)
        vscore, alive, member, probs[:, :, :, i] = c.token_fn(c.policy, vscore, vpos, alive, member,
                                                              logits[:, :, :, i], t, ok, slots, vk, vv)
    out = probs.to(vv.dtype).view(B, H, g * K, C + K) @ vv  # (B, H, g*K, hd)
    # Each row still has exactly its own number of members (one left for each one that came in): compact them.
    kept = (~member).to(torch.uint8).argsort(dim=-1, stable=True)[..., :C]  # (B, H, C), members first
    kept_alive = alive.gather(2, kept)
    for stored, virtual in ((c.k, vk_parts), (c.v, vv_parts)):
        for part, survivor in zip(stored, gather_slots(virtual, kept)):
            part.copy_(survivor)
    c.pos.copy_(vpos.gather(2, kept).masked_fill(~kept_alive, -1))
    c.score.copy_(vscore.gather(2, kept).masked_fill(~kept_alive, 0.0))
    return out.view(B, n_head, K, D)


def _logits(c, q, vk) -> torch.Tensor:
    """(B, H, g, K, S) fp32: every new token's soft-capped attention logits to every virtual slot, one matmul."""
    B, H, S, D = vk.shape
    n_head, K = q.shape[1], q.shape[2]
    logits = softcap((q.reshape(B, H, n_head // H * K, D) @ vk.transpose(-1, -2)).float() * c.scale, c.cap)
    return logits.view(B, H, n_head // H, K, S)


def dense(c, q, k_parts, v_parts, pos) -> torch.Tensor:
    """A first prompt, densely: causal attention with nothing evicted, then each row keeps its C tokens with the
    highest keep-score at its last position (ties to the newest). Shapes as in `stream`; T the prompt length."""
    policy = c.policy
    k, v = c.codec.decode(k_parts), c.codec.decode(v_parts)
    B, H, T, D = k.shape
    C = c.pos.shape[2]
    valid = pos >= 0  # (B, T): left padding is not
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    mask = causal & valid[:, None, :]  # (B, T, T)
    if c.window is not None:  # a sliding layer's queries see the last W positions only
        mask = mask & ((pos[:, :, None] - pos[:, None, :]) < c.window)
    mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)  # padding queries see themselves: no empty row
    # Only the last `prompt_window` queries (all, by default) shape the scores; rows end together at T - 1.
    windows = policy.prompt_window  # one for all rows, or one per row (rows of several policies)
    windows = windows if isinstance(windows, list) else [windows] * B
    first = torch.tensor([T - min(T, w or T) for w in windows], device=q.device)  # (B,)
    first_scored = int(first.min())
    scored_query = valid & (torch.arange(T, device=q.device) >= first[:, None])  # (B, T)
    out = torch.empty_like(q)
    score = policy.insert_score(k)  # (B, H, T)
    # Query blocks bound the memory of a block's fp32 probabilities: 16 MiB on CPU, where smaller blocks are
    # faster too; 256 MiB on a GPU, where each block is a few kernel launches.
    budget = 2**22 if q.device.type == "cpu" else 2**26  # fp32 values
    rows = max(1, min(c.dense_block, budget // (B * q.shape[1] * T)))
    for s in range(0, T, rows):
        e = min(T, s + rows)
        scores = policy.needs_scores and e > first_scored
        # Causal: queries s..e-1 see keys 0..e-1 only, so later keys are neither computed nor scored (their
        # scores stay as inserted: no query before a token may change its score).
        block = mask[:, None, s:e, :e].expand(B, H, -1, -1)
        out[:, :, s:e], probs = c.attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], block, scores)
        if scores:  # queries left out of the scoring attend nothing, as far as the policy sees
            attended = block & scored_query[:, None, s:e, None]
            if not bool(scored_query[:, s:e].all()):  # masked keys already have probability 0
                probs.masked_fill_(~attended, 0.0)
            score = torch.cat([policy.accumulate(score[..., :e], probs, attended), score[..., e:]], -1)
    score = policy.prompt_score(score)
    t_last = pos.amax(-1)[:, None, None]  # (B, 1, 1): each row's last prompt position
    prompt_pos = pos[:, None, :].expand(B, H, T)
    keep = policy.keep_score(score, prompt_pos.masked_fill(~valid[:, None], -1), t_last, k, v)
    keep = keep.masked_fill(~valid[:, None, :], -torch.inf)
    if c.window is not None:  # chosen among the tokens still inside the last position's window
        keep = keep.masked_fill(prompt_pos <= t_last - c.window, -torch.inf)
    n = min(C, T)
    # the n highest keep-scores, ties to the newest (flip: a stable sort keeps the earlier = newer first)
    ranked = keep.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :n]
    room = c.room[..., :n]  # (B, 1, n): a row keeps only its own C; its ranks past it sort last, then go
    idx = (T - 1 - ranked).masked_fill(~room, T).sort(-1).values.clamp(max=T - 1)  # (B, H, n) in position order
    for stored, new in ((c.k, k_parts), (c.v, v_parts)):
        for part, kept in zip(stored, gather_slots(new, idx)):
            part[:, :, :n] = kept
    kept_pos = prompt_pos.gather(2, idx)
    empty = (kept_pos < 0) | ~room
    c.pos[:, :, :n] = kept_pos.masked_fill(empty, -1)
    c.score[:, :, :n] = score.gather(2, idx).masked_fill(empty, 0.0)
    c.pos[:, :, n:] = -1
    c.score[:, :, n:] = 0.0
    return out
