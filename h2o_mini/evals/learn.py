"""Fitting `learned` (`policies/learned.py`) to the hindsight reference on one text: `h2o-mini learn-policy`.

One full pass over the text records every layer's queries, keys and values; nothing is evicted. From them, per
layer and KV head, the attention every token j receives from every query (summed over the group, as the cache
scores it) gives both sides of the fit at a sample of positions t:

* what the cache would know at t: the attention j received from queries before t, its age, its key and value
  norms, Expected Attention's prediction from the queries up to t (their mean and covariance, RoPE averaged over
  the next positions) and the logit of query t to j (`learned.features`, the same function the policy runs);
* what hindsight ranks by: the attention still to come, from queries t onward (log).

The candidates at t are the tokens a cache of C = budget x tokens would be choosing among, outside the recent
window of C / 2 that the rule keeps: the C / 2 that received most, and the C / 2 with most still to come. Each
choice's candidates are centred on their mean, so the least-squares fit (ridge 1e-3) learns how to rank within
one eviction, not the level of attention at t.
"""
from __future__ import annotations

import json

import torch

from ..config import layer_inv_freq
from ..errors import UserError
from ..model import Rope, causal_attention
from ..policies.expected_attention import ExpectedAttention
from ..policies.learned import FEATURES, features, model_id
from .hindsight import allowed, attention_logits


class _Recorder:
    """Stands where the model expects a cache: each layer attends causally and keeps its q, k, v."""

    def __init__(self, cfg):
        self.cfg, self.kept = cfg, []
        self.layers = [self._Layer(self, cfg.window(i)) for i in range(cfg.n_layer)]

    class _Layer:
        def __init__(self, owner, window):
            self.owner, self.window = owner, window

        def attend(self, q, k, v, pos):
            self.owner.kept.append((q, k, v))
            cfg = self.owner.cfg
            return causal_attention(q, k, v, pos, self.window, cfg.attn_scale, cfg.attn_softcap)


@torch.inference_mode()
def fit(model, ids: list[int], budget: float, samples: int = 48, seed: int = 0, ridge: float = 1e-3,
        sink: int = 4, future: int = 512) -> tuple[torch.Tensor, dict]:
    """(weights (n_layer, 8), report) fitted on the text `ids`. report: per feature its weight times its spread
    over the candidates, averaged over layers (how much it moves the ranking), and the fit's R^2 per layer."""
    cfg, T = model.cfg, len(ids)
    C = max(8, round(budget * T))
    if T - C - 1 < 1:
        raise UserError(f"--budget {budget} of {T} tokens leaves no position where the cache is full: lower it or "
                        "raise --tokens")
    recorder = _Recorder(cfg)
    model.hidden(torch.tensor([ids]), torch.arange(T)[None], recorder)
    gen = torch.Generator().manual_seed(seed)
    times = (torch.randperm(T - C - 1, generator=gen)[:samples] + C + 1).sort().values.tolist()
    ea = ExpectedAttention(keep=C, future=future, sink=sink, vnorm=False)
    weights, spread, r2, rows = [], [], [], 0
    for layer, (q, k, v) in enumerate(recorder.kept):
        X, y = _samples(cfg, layer, q[0].float(), k[0].float(), v[0].float(), times, C, ea)
        rows += X.shape[0]
        A = X.T @ X + ridge * X.shape[0] * torch.eye(X.shape[1], dtype=X.dtype)
        w = torch.linalg.solve(A, X.T @ y)
        resid = y - X @ w
        weights.append(w.float())
        spread.append((w * X.std(0)).float())
        r2.append(float(1 - resid.var() / y.var().clamp(min=1e-12)))
    weights = torch.stack(weights)
    report = {"importance": dict(zip(FEATURES, torch.stack(spread).mean(0).tolist())), "r2": r2,
              "candidates_per_choice": rows / (len(recorder.kept) * cfg.n_kv_head * len(times)),
              "positions": len(times)}
    return weights, report


def _samples(cfg, layer, q, k, v, times, C, ea: ExpectedAttention):
    """Features and targets (centred per choice) at the positions `times` (in order) of one layer, float64."""
    H, T, d = k.shape
    g = q.shape[0] // H
    window, j = cfg.window(layer), torch.arange(T)
    logits = attention_logits(q, k, cfg.attn_scale, cfg.attn_softcap)  # (H, g, T, T), as hindsight reads them
    attention = logits.masked_fill(~allowed(j, j, window), -torch.inf).softmax(-1).sum(1)  # (H, queries, tokens)
    received = attention.cumsum(1) - attention  # [h, t, j]: from queries before t
    ahead = attention.flip(1).cumsum(1).flip(1)  # [h, t, j]: from queries t onward
    inv = layer_inv_freq(cfg, layer)
    rope = None if inv is None else Rope(inv)
    queries = q.view(H, g, T, d)[None]  # (1, H, g, T, d)
    state, seen = torch.zeros(1, H, g, ea.state_size(d)), 0
    Xs, ys = [], []
    for t in times:  # Expected Attention's state after query t, as the cache's would be
        state = ea.observe_many(state, queries[:, :, :, seen:t + 1], j[None, seen:t + 1], rope)
        seen = t + 1
        for h in range(H):
            cand = _candidates(received[h, t, :t], ahead[h, t, :t], C, t, ea.sink, window)  # (n,) token indices
            kk, vv = k[h, cand][None, None], v[h, cand][None, None]  # (1, 1, n, d)
            P = cand[None, None]
            expected = ea.expected(P, kk, state[:, h:h + 1])
            query = q[h * g:(h + 1) * g, t][None, None]  # (1, 1, g, d)
            f = features(received[h, t, cand][None, None], P, t, kk, vv, expected, query)[0, 0].double()  # (n, 8)
            target = ahead[h, t, cand].double().add(1e-6).log()  # (n,)
            Xs.append(f - f.mean(0))
            ys.append(target - target.mean())
    return torch.cat(Xs), torch.cat(ys)


def _candidates(received, ahead, C, t, sink, window) -> torch.Tensor:
    """(n,) the tokens a cache of C would choose among at t, outside its recent window of C // 2 (kept by the rule):
    the C // 2 that received most, and the C // 2 with most still to come."""
    first, last = max(sink, t - window + 1) if window else sink, t - C // 2
    if last - first <= C // 2:
        return torch.arange(first, max(first, last))
    chosen = torch.zeros(t, dtype=torch.bool)
    for scores in (received, ahead):
        chosen[scores[first:last].topk(C // 2).indices + first] = True
    return chosen.nonzero()[:, 0]


def save_rule(path, weights: torch.Tensor, report: dict, lm_name: str, cfg, text: str, tokens: int,
              budget: float) -> None:
    """The rule as safetensors (the weights, and what they belong to as metadata), written atomically."""
    from safetensors.torch import save_file

    from ..files import write_atomic
    meta = {"features": list(FEATURES), "model": model_id(cfg), "name": lm_name, "text": text, "tokens": tokens,
            "budget": budget, "importance": report["importance"], "r2": report["r2"]}
    write_atomic(path, lambda tmp: save_file({"weights": weights.contiguous()}, str(tmp),
                                             metadata={"h2o_mini_rule": json.dumps(meta)}))
