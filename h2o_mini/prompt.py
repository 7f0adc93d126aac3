"""The two ways a `cache.LayerCache` reads a prompt chunk (more than one token per row); docs/spec.md, "Prompts".

Both read a layer through one small interface: `LayerCache.slots()` (keys and values as stored, positions,
scores, room, window: `cache.Slots`), the layer's public policy, codec, rule state and rope, its `logits` and
`attention`; and they write the survivors back through `LayerCache.store`. What each path is for:

* `stream`: the spec's rule token by token, as if the chunk were generated, exactly. Each layer has the whole
  chunk's q, k, v at once, so the attention logits of every token to every slot come from one matmul, and
  the attention of the whole chunk is one masked softmax; only the choice of what to evict (and a scoring
  rule's update), `stream_token`, runs once per token, over C + K "virtual" slots (the C cached tokens in
  position order, then the K new ones); the survivors are then compacted back into the C slots.
  `stream_many` runs several layers' chunks as one batch (`wavefront.py`).
* `dense`: causal attention over the prompt with nothing evicted, the scores summed over its queries, then
  the C tokens with the highest keep-score at the last prompt position stay (the spec's shortcut, for a
  first prompt).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .policies.rows import Rows
from .quant import cat_slots, gather_slots

NEWEST = torch.iinfo(torch.int64).max  # a position later than any token: never the oldest


class Chunk(NamedTuple):
    """What the stream loop's body reads and never changes: a prompt chunk's virtual slots (`prompt.stream`: the
    cached tokens in position order, then the chunk's)."""
    pos: torch.Tensor  # (B, H, S): each virtual slot's position
    keys: torch.Tensor  # (B, H, S, hd), as attention reads them
    values: torch.Tensor
    window: int | torch.Tensor | None  # a sliding layer's W (per row, (B, 1, 1), where layers of both kinds mix)
    largest: torch.Tensor  # 0-dim, the largest fp32: a protected (+inf) slot still ranks below "never chosen"
    rope: object  # the layer's `model.Rope` (or None), for a rule that observes queries


class Carry(NamedTuple):
    """What the loop's body changes from one token to the next (`seen` and `lid` in place)."""
    score: torch.Tensor  # (B, H, S) fp32: the policy's score per virtual slot
    seen: torch.Tensor  # (B, H, S): the position of each live (attendable) token, -1 elsewhere
    # (B, H, S) fp32, what a slot adds to its keep-score in the choice: 0, a live token; -inf, one of the row's
    # slots with no live token (empty, or dead on a sliding layer: it goes first); +inf, not one of the row's
    # slots (one it lacks, an evicted token's, or one whose token is still to come: never chosen)
    lid: torch.Tensor
    state: torch.Tensor | None  # (B, H, g, n): a rule's running state (`Policy.observe`), else None


class Token(NamedTuple):
    """One token of the chunk, as the loop's body reads it."""
    logits: torch.Tensor  # (B, H, g, S): its attention logits to every virtual slot
    t: torch.Tensor  # (B, H, 1): its position
    slot: torch.Tensor  # (B, H, 1): its virtual slot
    ok: torch.Tensor | None  # t >= 0 (padding evicts, inserts and scores nothing), None when every row's is real
    query: torch.Tensor | None  # (B, H, g, hd), for a rule with a running state (else None)


def stream_token(policy, carry: Carry, token: Token, chunk: Chunk):
    """Steps 1-4 of the rule for one token of a prompt chunk. In the chunk's virtual slots the first lowest slot
    is the oldest, so the first minimum is `cache.evict`'s choice. Returns the new `Carry`, the slot given up
    (B, H, 1) and, for a rule that reads attention, this token's probabilities (B, H, g, S) (else None).
    Additions rather than `where`s (a third of the time on a CPU), and no branch on values, so torch.compile
    fuses it."""
    score, seen, lid, state = carry
    t, ok = token.t, token.ok
    if chunk.window is not None:  # tokens that left the window: no longer attended, and evicted first
        dead = (chunk.pos <= t - chunk.window) & (seen >= 0)
        seen.masked_fill_(dead, -1)
        lid.masked_fill_(dead, -torch.inf)
    if state is not None:  # 0. observe
        new = policy.observe(state, token.query, t[:, :1], chunk.rope)
        state = new if ok is None else torch.where(ok[..., None], new, state)
    keep = torch.minimum(policy.keep_score(score, seen, t[:, :1], chunk.keys, chunk.values, state), chunk.largest)
    # 1. evict (+inf protects, yet a slot goes); -inf + inf: a keep-score of -inf where no slot of the row is
    key = (keep + lid).nan_to_num(nan=torch.inf, posinf=torch.inf, neginf=-torch.inf)
    victim = key.min(-1, keepdim=True).indices  # (B, H, 1): the first of the lowest
    if ok is not None:  # padding gives up its own slot, which never holds a token
        victim = torch.where(ok, victim, token.slot)
    seen.scatter_(2, victim, -1)
    lid.scatter_(2, victim, torch.inf)
    seen.scatter_(2, token.slot, t)  # 2. insert (padding: t < 0, no token)
    if ok is None:
        lid.scatter_(2, token.slot, 0.0)
    else:
        lid.scatter_(2, token.slot, torch.where(ok, 0.0, torch.inf).expand_as(t))
    probs = None
    if policy.needs_scores:  # 3. attend (for a rule that reads none, the chunk's output is attended at once)
        bias = -lid.abs()  # 0 at a live token, -inf elsewhere
        if ok is not None:  # padding attends everything: no empty softmax
            bias = torch.where(ok, bias, 0.0)
        probs = (token.logits + bias[:, :, None]).softmax(-1)  # (B, H, g, S)
        new = policy.update(score, probs.sum(2), seen >= 0)  # 4. update
        score = new if ok is None else torch.where(ok, new, score)
    return Carry(score, seen, lid, state), victim, probs


def stream(c, q, k_parts, v_parts, pos) -> torch.Tensor:
    """The chunk through the rule one token at a time. q: (B, n_head, K, hd); k_parts, v_parts: the codec's
    parts of (B, H, K, ...); pos: (B, K) (< 0: padding, which takes no slot). -> (B, n_head, K, hd)."""
    return stream_many([(c, q, k_parts, v_parts, pos)])[0]


def stream_many(requests: list[tuple]) -> list[torch.Tensor]:
    """`stream` for several caches' chunks at once (one layer's each, all with the same B, H, C and K; e.g.
    chunk c at layer l beside chunk c-1 at layer l+1, `wavefront.py`), as the rows of one batch.

    Only the choice of what to evict is sequential. So: the tokens before the first eviction (while every row
    still has empty slots) need no loop; the loop then records which slot each token gives up (and, for a rule
    that reads attention, updates the scores); and the attention of the whole chunk is one masked softmax at
    the end, each token's mask rebuilt from when every slot arrived and left (for a rule that reads attention,
    the loop's own probabilities)."""
    reads = [_Read(*r) for r in requests]
    P, (B, H, S), K, C = len(reads), reads[0].vpos.shape, reads[0].K, reads[0].C
    stack = (lambda xs: torch.stack(xs, 1).flatten(0, 1)) if P > 1 else (lambda xs: xs[0])  # row b*P + p
    c0, policy = reads[0].c, Rows.interleaved([r.c.policy for r in reads], B)
    vk, vv, vpos, score, member, pos = (stack([getattr(r, name) for r in reads])
                                        for name in ("vk", "vv", "vpos", "score", "member", "pos"))
    state = None if c0.state is None else stack([r.c.state for r in reads])  # (B', H, g, n): a rule's own
    windows = [r.window for r in reads]
    window = windows[0] if len(set(windows)) == 1 else torch.tensor(  # per row: a global layer's never ends
        [w or 2**40 for _ in range(B) for w in windows], device=vpos.device)[:, None, None]
    q = stack([r.q for r in reads])  # (B', n_head, K, hd)
    seq = _Sequence.of(c0.logits(q, vk), vpos, pos, window, C)  # logits (B', H, g, K, S)
    queries = q.reshape(B * P, H, -1, K, q.shape[-1])  # (B', H, g, K, hd)
    # Before the first eviction each row's empty slots (first in the order) take the tokens: no loop, and the
    # scores are the policy's `accumulate` over those queries at once.
    first = min(K, int((member & (vpos < 0)).sum(-1).amin()))
    if first and policy.needs_scores:
        mask = seq.attended(slice(0, first))
        probs = seq.attention(mask, slice(0, first))  # (B', H, g, first, S)
        p = probs.sum(2)  # (B', H, first, S)
        if seq.padded:  # padding attended everything, but counts for nothing
            mask = mask & seq.real[:, None, :first, None]
            p = p.masked_fill(~mask, 0.0)
        score = policy.accumulate(score, p, mask)
        seq.logits[:, :, :, :first] = probs  # a token's logits are not read again once its probabilities are in
    if first and state is not None:
        state = policy.observe_many(state, queries[:, :, :, :first], pos[:, :first], c0.rope)
    taken = torch.arange(S, device=vpos.device) < seq.real[:, :first].sum(-1)[:, None, None]  # the empties filled
    arrived = (seq.arrive >= 0) & (seq.arrive < first)  # the chunk's tokens in the cache (on a sliding layer, some dead)
    alive = seq.arrive < first
    if first and window is not None:  # the tokens still in the window of the last one read
        alive = alive & seq.in_window(slice(first - 1, first))[:, :, 0]
    lid = torch.where(alive, 0.0, torch.where(member & ~taken | arrived, -torch.inf, torch.inf))  # (B', H, S)
    carry = Carry(score, torch.where(alive, vpos, -1), lid, state)
    chunk = Chunk(vpos, vk, vv, window, seq.logits.new_tensor(torch.finfo(torch.float32).max), c0.rope)
    # Each token's views, made once: its logits (B', H, g, S), position and virtual slot (B', H, 1).
    token_logits = seq.logits.unbind(3)
    token_pos = pos[:, None, :, None].expand(-1, H, K, 1).unbind(2)
    token_slot = torch.arange(C, C + K, device=vpos.device).view(1, 1, K, 1).expand(B * P, H, K, 1).unbind(2)
    token_query = queries.unbind(3) if state is not None else [None] * K
    given_up = []
    for i in range(first, K):
        t = token_pos[i]
        token = Token(token_logits[i], t, token_slot[i], t[:, :1] >= 0 if seq.padded else None, token_query[i])
        carry, victim, p = c0.token_fn(policy, carry, token, chunk)
        given_up.append(victim)
        if p is not None:
            token_logits[i].copy_(p)
    if policy.needs_scores:  # every token's attention is already in hand, where its logits were
        probs = seq.logits  # (B', H, g, K, S)
    else:  # padding gives up its own slot: it never arrived, so its "leave" changes no mask
        leave = torch.full_like(seq.arrive, K)
        if given_up:
            leave.scatter_(2, torch.cat(given_up, 2), seq.tokens[first:].expand(B * P, H, -1))
        probs = seq.attention(seq.attended(slice(0, K), leave), slice(0, K))
    out = probs.to(vv.dtype).view(B * P, H, -1, S) @ vv  # (B', H, g*K, hd)
    unstack = (lambda x: x.unflatten(0, (B, P)).unbind(1)) if P > 1 else (lambda x: [x])
    if carry.state is not None:
        for r, s in zip(reads, unstack(carry.state)):
            r.c.state.copy_(s)
    parts = zip(*map(unstack, (carry.score, carry.seen, carry.lid, out)))
    return [r.finish(*part) for r, part in zip(reads, parts)]


class _Sequence(NamedTuple):
    """When each virtual slot's token arrives in a chunk (the token index; -1: cached before the chunk; K:
    never), and what follows from it: a token attends exactly the slots with arrive <= i < leave, on a sliding
    layer the ones still in its window (and padding attends every slot, so that its output, never read, is
    finite)."""
    logits: torch.Tensor  # (B', H, g, K, S) fp32, overwritten by the probabilities as the loop finds them
    arrive: torch.Tensor  # (B', H, S)
    tokens: torch.Tensor  # (K,) the token indices
    vpos: torch.Tensor  # (B', H, S) each virtual slot's position
    pos: torch.Tensor  # (B', K) the chunk's positions (< 0: padding)
    window: int | torch.Tensor | None
    real: torch.Tensor  # (B', K) bool: not padding
    padded: bool  # any padding at all (else the masks leave it out)

    @classmethod
    def of(cls, logits, vpos, pos, window, C: int) -> "_Sequence":
        K, H = pos.shape[1], vpos.shape[1]
        real, tokens = pos >= 0, torch.arange(K, device=vpos.device)
        arrive = torch.cat([torch.where(vpos[..., :C] >= 0, -1, K),
                            torch.where(real, tokens, K)[:, None].expand(-1, H, K)], 2)
        return cls(logits, arrive, tokens, vpos, pos, window, real, not bool(real.all()))  # (one host sync)

    def in_window(self, rows: slice) -> torch.Tensor | bool:  # (B', H, k, S): the slots inside each token's window
        w = self.window if self.window is None or isinstance(self.window, int) else self.window[..., None]
        return True if w is None else self.vpos[:, :, None] > self.pos[:, None, rows, None] - w

    def attended(self, rows: slice, leave=None) -> torch.Tensor:  # (B', H, k, S): the slots tokens `rows` attend
        i = self.tokens[rows, None]  # (k, 1)
        mask = (self.arrive[:, :, None] <= i) & self.in_window(rows)
        return mask if leave is None else mask & (leave[:, :, None] > i)

    def attention(self, mask: torch.Tensor, rows: slice) -> torch.Tensor:  # (B', H, g, k, S) fp32 probabilities
        if self.padded:
            mask = mask | ~self.real[:, None, rows, None]
        return self.logits[:, :, :, rows].masked_fill(~mask[:, :, None], -torch.inf).softmax(-1)


class _Read:
    """One cache's chunk in the stream: its virtual slots, the cached tokens in position order (empty slots
    first; slots a row does not have last, so that a row's sums run over its slots in the same order whatever
    its neighbours' capacities), then the chunk's K; and the survivors compacted back into the C slots."""

    def __init__(self, c, q, k_parts, v_parts, pos):
        slots = c.slots()
        B, H, C = slots.pos.shape
        self.c, self.q, self.pos, self.C, self.K, self.window = c, q, pos, C, q.shape[2], slots.window
        order = torch.where(slots.room, slots.pos, NEWEST).argsort(dim=-1, stable=True)  # (B, H, C)
        self.vk_parts = cat_slots(gather_slots(slots.k, order), k_parts)  # (B, H, C+K, ...)
        self.vv_parts = cat_slots(gather_slots(slots.v, order), v_parts)
        self.vk, self.vv = c.codec.decode(self.vk_parts), c.codec.decode(self.vv_parts)  # (B, H, C+K, hd)
        self.vpos = torch.cat([slots.pos.gather(2, order), pos[:, None, :].expand(B, H, self.K)], 2)  # (B, H, C+K)
        self.score = torch.cat([slots.score.gather(2, order), c.policy.insert_score(self.vk[:, :, C:])], 2)
        self.member = torch.cat([slots.room.expand(B, H, C).gather(2, order),
                                 self.vpos.new_zeros(B, H, self.K, dtype=torch.bool)], 2)

    def finish(self, score, seen, lid, out) -> torch.Tensor:
        """Compacts the members (each row has exactly its own number: one left for each one that came in) into
        the C slots, and returns the chunk's output (B, n_head, K, hd)."""
        alive = seen >= 0
        member = alive | (lid == -torch.inf)
        kept = (~member).to(torch.uint8).argsort(dim=-1, stable=True)[..., :self.C]  # (B, H, C), members first
        kept_alive = alive.gather(2, kept)
        self.c.store(gather_slots(self.vk_parts, kept), gather_slots(self.vv_parts, kept),
                     self.vpos.gather(2, kept).masked_fill(~kept_alive, -1),
                     score.gather(2, kept).masked_fill(~kept_alive, 0.0))
        B, n_head, K, D = self.q.shape
        return out.view(B, n_head, K, D)


def dense(c, q, k_parts, v_parts, pos) -> torch.Tensor:
    """A first prompt, densely: causal attention with nothing evicted, then each row keeps its C tokens with the
    highest keep-score at its last position (ties to the newest). Shapes as in `stream`; T the prompt length."""
    policy, slots = c.policy, c.slots()
    k, v = c.codec.decode(k_parts), c.codec.decode(v_parts)
    B, H, T, D = k.shape
    C = slots.pos.shape[2]
    valid = pos >= 0  # (B, T): left padding is not
    # Only the last `prompt_window` queries (all, by default) shape the scores; rows end together at T - 1.
    windows = policy.prompt_window  # None (all), a number, or (B,) for rows of several policies
    first = T - torch.as_tensor(T if windows is None else windows).clamp(max=T).to(q.device).expand(B)  # (B,)
    first_scored = int(first.min())
    scored_query = valid & (torch.arange(T, device=q.device) >= first[:, None])  # (B, T)
    out = torch.empty_like(q)
    score = policy.insert_score(k)  # (B, H, T)
    # Query blocks bound the memory of a block's fp32 probabilities: 8 MiB on CPU, where smaller blocks are
    # faster too; 256 MiB on a GPU, where each block is a few kernel launches.
    budget = 2**21 if q.device.type == "cpu" else 2**26  # fp32 values
    rows = max(1, min(c.dense_block, budget // (B * q.shape[1] * T)))
    for s in range(0, T, rows):
        e = min(T, s + rows)
        scores = policy.needs_scores and e > first_scored
        # Causal: queries s..e-1 see keys 0..e-1 only, so later keys are neither computed nor scored (their
        # scores stay as inserted: no query before a token may change its score).
        block = _causal_block(pos, valid, s, e, slots.window)[:, None].expand(B, H, -1, -1)  # (B, H, e - s, e)
        out[:, :, s:e], probs = c.attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], block, scores)
        if scores:  # queries left out of the scoring attend nothing, as far as the policy sees
            attended = block & scored_query[:, None, s:e, None]
            if not bool(scored_query[:, s:e].all()):  # masked keys already have probability 0
                probs.masked_fill_(~attended, 0.0)
            score = torch.cat([policy.accumulate(score[..., :e], probs, attended), score[..., e:]], -1)
    score = policy.prompt_score(score)
    if c.state is not None:  # the rule's running state observes every prompt query, in order
        c.state.copy_(policy.observe_many(c.state, q.reshape(B, H, -1, T, D), pos, c.rope))
    t_last = pos.amax(-1)[:, None, None]  # (B, 1, 1): each row's last prompt position
    prompt_pos = pos[:, None, :].expand(B, H, T)
    keep = policy.keep_score(score, prompt_pos.masked_fill(~valid[:, None], -1), t_last, k, v, c.state)
    keep = keep.masked_fill(~valid[:, None, :], -torch.inf)
    if slots.window is not None:  # chosen among the tokens still inside the last position's window
        keep = keep.masked_fill(prompt_pos <= t_last - slots.window, -torch.inf)
    n = min(C, T)
    # the n highest keep-scores, ties to the newest (flip: a stable sort keeps the earlier = newer first)
    ranked = keep.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :n]
    room = slots.room[..., :n]  # (B, 1, n): a row keeps only its own C; its ranks past it sort last, then go
    idx = (T - 1 - ranked).masked_fill(~room, T).sort(-1).values.clamp(max=T - 1)  # (B, H, n) in position order
    kept_pos = prompt_pos.gather(2, idx)
    empty = (kept_pos < 0) | ~room
    c.store(gather_slots(k_parts, idx), gather_slots(v_parts, idx), kept_pos.masked_fill(empty, -1),
            score.gather(2, idx).masked_fill(empty, 0.0))
    return out


def _causal_block(pos, valid, s: int, e: int, window: int | None) -> torch.Tensor:
    """(B, e - s, e) bool: what queries s..e-1 of a dense prompt attend, made per block (never T x T): the keys at
    or before them that are not padding, on a sliding layer only the last W positions; a padding query sees itself
    (no empty row)."""
    i = torch.arange(s, e, device=pos.device)[:, None]  # (e - s, 1)
    j = torch.arange(e, device=pos.device)  # (e,)
    mask = (j <= i) & valid[:, None, :e]
    if window is not None:
        mask = mask & ((pos[:, s:e, None] - pos[:, None, :e]) < window)
    return mask | (j == i)
