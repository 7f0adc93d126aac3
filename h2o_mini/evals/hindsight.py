"""Running the `hindsight` policy (`policies/hindsight.py`) over a text: two passes, eviction as a mask.

Hindsight's choices depend only on the full cache's attention, never on the evicting pass, so they can all be
made before the evaluated pass runs:

1. **Choose.** One causal pass with the full cache. In each layer, the attention of every query to every token
   (fp32, GQA summed per KV head) is computed in query blocks, twice: first its column sums (the attention each
   token will ever receive), then in query order, where the cache's rule is replayed (docs/spec.md, stream
   mode: fill, then at each arrival evict the lowest keep-score, ties the oldest; on a sliding layer dead
   tokens first) with keep-score = total - received so far = the attention still to come. What is kept is a
   vector per layer and KV head: `leave[j]`, the arrival at which token j is evicted (T: never).
2. **Evaluate.** The text again, chunk by chunk, with every key and value kept and query q allowed to attend
   token j exactly when j <= q < leave[j] (and q - j < W on a sliding layer): the naive reference's form of a
   cache of C slots, so the logits are those of a cache that evicts as chosen (tests/test_hindsight.py runs the
   same choices through the real cache). Held at once: the leave tables (L x H x T int64: 2.9 MiB at 4096
   tokens of the default model), one block of probabilities (<= 16 MiB) and, in the evaluated pass, every key
   and value (as `full` holds them: 180 MiB at 4096 tokens of the default model); never a T x T table (5.6 GiB
   there in fp32).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import UserError
from ..model import Transformer, causal_attention
from ..policies import Policy

BLOCK_VALUES = 2**22  # fp32 probabilities per query block (16 MiB)


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(Q, K) bool: causal, and inside a sliding layer's window."""
    ok = k_pos[None, :] <= q_pos[:, None]
    return ok if window is None else ok & (q_pos[:, None] - k_pos[None, :] < window)


def attention_logits(q: torch.Tensor, k: torch.Tensor, scale: float, cap: float | None) -> torch.Tensor:
    """q: (n_head, Q, hd), k: (H, K, hd) -> fp32 attention logits (H, g, Q, K), scaled and soft-capped (Gemma 2)."""
    H, g = k.shape[0], q.shape[0] // k.shape[0]
    logits = (q.reshape(H, g * q.shape[1], -1) @ k.transpose(-1, -2)).float() * scale
    if cap is not None:
        logits = logits.div(cap).tanh().mul(cap)
    return logits.view(H, g, q.shape[1], k.shape[1])


class _Chooser:
    """One layer of the first pass: attends with the full cache and replays the rule on hindsight's scores."""

    def __init__(self, model: Transformer, policy: Policy, layer: int, length: int):
        cfg = model.cfg
        self.scale, self.cap, self.window = cfg.attn_scale, cfg.attn_softcap, cfg.window(layer)
        self.recent = policy.for_layer(layer, cfg.n_layer).recent
        self.capacity = min(policy.layer_capacity(layer, cfg.n_layer, length), self.window or length)
        self.leave: torch.Tensor | None = None

    def attend(self, q, k, v, pos):
        self.leave = self.choose(q[0], k[0])
        return causal_attention(q, k, v, pos, self.window, self.scale, self.cap)

    def rows(self, q, k) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, (H, Q, T) fp32): the GQA-summed attention of queries start.. to every token."""
        T = k.shape[1]
        block = max(1, BLOCK_VALUES // (q.shape[0] * T))
        j = torch.arange(T, device=k.device)
        for s in range(0, T, block):
            logits = attention_logits(q[:, s:s + block], k, self.scale, self.cap)
            ok = allowed(j[s:s + block], j, self.window)
            yield s, logits.masked_fill(~ok, -torch.inf).softmax(-1).sum(1)

    @torch.inference_mode()
    def choose(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q: (n_head, T, hd), k: (H, T, hd) -> leave (H, T) int64."""
        H, T = k.shape[0], k.shape[1]
        leave = torch.full((H, T), T, dtype=torch.int64, device=k.device)
        if self.capacity >= T:
            return leave
        total = torch.zeros(H, T, dtype=torch.float64, device=k.device)
        for _, p in self.rows(q, k):
            total += p.sum(1)
        seen = torch.zeros_like(total)  # attention received from the queries before t
        cached = torch.zeros(H, T, dtype=torch.bool, device=k.device)
        j, heads = torch.arange(T, device=k.device), torch.arange(H, device=k.device)
        for s, p in self.rows(q, k):
            for i in range(p.shape[1]):
                t = s + i
                if t >= self.capacity:  # full: evict, as the cache's rule does
                    keep = (total - seen).masked_fill(j > t - self.recent, torch.inf)  # the recent window
                    if self.window is not None:
                        keep = keep.masked_fill(j <= t - self.window, -torch.inf)  # dead tokens go first
                    victim = keep.masked_fill(~cached, torch.inf).argmin(-1)  # (H,): first minimum = oldest
                    cached[heads, victim] = False
                    leave[heads, victim] = t
                cached[:, t] = True
                seen += p[:, i]
        return leave


class _Masked:
    """One layer of the evaluated pass: every key and value kept, attention limited to what the cache holds."""

    def __init__(self, cfg, layer: int, leave: torch.Tensor, dtype, device):
        self.scale, self.cap, self.window, self.leave = cfg.attn_scale, cfg.attn_softcap, cfg.window(layer), leave
        shape = (cfg.n_kv_head, leave.shape[1], cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # (H, T, hd), written in place chunk by chunk
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.n = 0

    def attend(self, q, k, v, pos):
        s, e = self.n, self.n + k.shape[2]
        self.k[:, s:e], self.v[:, s:e] = k[0], v[0]
        self.n = e
        j = torch.arange(e, device=q.device)
        ok = allowed(j[s:], j, self.window)[None] & (j[s:, None] < self.leave[:, None, :e])  # (H, Q, e)
        logits = attention_logits(q[0], self.k[:, :e], self.scale, self.cap)  # (H, g, Q, e)
        probs = logits.masked_fill(~ok[:, None], -torch.inf).softmax(-1)
        out = probs.to(v.dtype).flatten(1, 2) @ self.v[:, :e]  # (H, g * Q, hd)
        return out.view(1, q.shape[1], q.shape[2], -1)


class _Layers:
    def __init__(self, layers):
        self.layers = layers


@torch.inference_mode()
def leave_times(model: Transformer, ids: list[int], policy: Policy) -> list[torch.Tensor]:
    """Per layer, (H, T) int64: the arrival at which each token leaves that layer's cache (T: never)."""
    p = next(model.parameters())
    x = torch.tensor([ids], device=p.device)
    choosers = [_Chooser(model, policy, i, x.shape[1]) for i in range(model.cfg.n_layer)]
    model(x, torch.arange(x.shape[1], device=p.device)[None], _Layers(choosers), last_only=True)
    return [c.leave for c in choosers]


@torch.inference_mode()
def masked_logits(model: Transformer, ids: list[int], leave: list[torch.Tensor], chunk: int = 256
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, (1, k, V) fp32) logits of the text with query q attending token j only while j <= q < leave[j]
    (per layer, (H, T)): a cache that evicts token j when token leave[j] arrives."""
    p = next(model.parameters())
    x = torch.tensor([ids], device=p.device)
    pos = torch.arange(x.shape[1], device=p.device)[None]
    cache = _Layers([_Masked(model.cfg, i, table, p.dtype, p.device) for i, table in enumerate(leave)])
    for s in range(0, x.shape[1], chunk):
        yield s, model(x[:, s:s + chunk], pos[:, s:s + chunk], cache)


def hindsight_logits(model: Transformer, ids: list[int], policy: Policy, chunk: int = 256
                     ) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, (1, k, V) fp32) logits of the text read under `policy` (a lookahead policy), chunk by chunk."""
    if model.shard is not None:
        raise UserError(f"policy {policy.name!r} runs in one process, not under tensor parallel")
    return masked_logits(model, ids, leave_times(model, ids, policy), chunk)
