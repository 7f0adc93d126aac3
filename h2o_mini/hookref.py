"""The naive reference of `h2o-mini check-policy` (`checkkit.py`): one row, every key and value kept, and at each
token the policy's own rule applied to the cached set as a mask, straight from `docs/spec.md`.

It shares no eviction code with `cache.py`: it calls only the policy's hooks (`keep_score`, `insert_score`,
`update` once per query, `prompt_score`, `layer_capacity`, `for_layer`), so any policy, registered or plugged
in, is checked against its own statement of the rule. Slow on purpose: Python loops over heads and queries.
"""
from __future__ import annotations

import torch

from .config import Config
from .policies import Policy
from .quant import codec


class HookReference:
    """One row, every key and value kept; each step applies the policy's rule to the cached set (a mask)."""

    def __init__(self, cfg: Config, policy: Policy, length: int, kv_bits: int | None = None, given_kv=None):
        self.cfg, self.length, self.given = cfg, length, given_kv
        self.policies = [policy.for_layer(i, cfg.n_layer) for i in range(cfg.n_layer)]
        self.windows = [cfg.window(i) for i in range(cfg.n_layer)]  # sliding layers: p <= t - W is dead
        self.caps = [min(policy.layer_capacity(i, cfg.n_layer, length), w or length) for i, w in enumerate(self.windows)]
        self.codec = codec(kv_bits, cfg.head_dim, torch.float32)
        # per layer: keys, values (n_kv_head, n, hd), positions (n,); per KV head: the cached mask and scores (n,)
        self.state = [None] * cfg.n_layer
        self.layers = [_Layer(self, i) for i in range(cfg.n_layer)]

    def _store(self, layer, k, v, pos):
        if self.given is not None:  # the fast path's own tensors, so that both round them to the same codes
            k = torch.stack([self.given[layer][int(p)][0] for p in pos[0]], 1)[None]
            v = torch.stack([self.given[layer][int(p)][1] for p in pos[0]], 1)[None]
        k, v = self.codec.decode(self.codec.encode(k)), self.codec.decode(self.codec.encode(v))
        return k[0].float(), v[0].float()

    def attend(self, layer, q, k, v, pos):
        assert q.shape[0] == 1, "the reference runs one row"
        k, v = self._store(layer, k, v, pos)  # (H, T, hd)
        if q.shape[2] > 1:  # a prompt: dense
            return self._dense(layer, q, k, v, pos)
        st, policy = self.state[layer], self.policies[layer]
        H, g = self.cfg.n_kv_head, self.cfg.group
        if st is None:
            st = self.state[layer] = {"K": k[:, :0], "V": v[:, :0], "P": torch.zeros(0, dtype=torch.long),
                                      "cached": torch.zeros(H, 0, dtype=torch.bool), "score": torch.zeros(H, 0)}
        t = int(pos[0, 0])
        out = torch.empty_like(q)
        cached, score = st["cached"], st["score"]
        W = self.windows[layer]
        if int(cached[0].sum()) == self.caps[layer]:  # 1. evict exactly one (every head holds the same count)
            keep = self._keep(policy, st, cached, score, t)  # (H, n)
            if W:  # a dead token goes before any live one, the oldest first
                keep = keep.masked_fill(st["P"] <= t - W, -torch.inf)
            keep = keep.masked_fill(~cached, torch.inf)
            lowest = keep.amin(-1, keepdim=True)
            victim = torch.where(keep == lowest, st["P"], torch.iinfo(torch.long).max).argmin(-1)  # oldest of lowest
            cached = cached.clone()
            cached[torch.arange(H), victim] = False
        st["K"], st["V"] = torch.cat([st["K"], k], 1), torch.cat([st["V"], v], 1)  # 2. insert
        st["P"] = torch.cat([st["P"], torch.tensor([t])])
        cached = torch.cat([cached, torch.ones(H, 1, dtype=torch.bool)], 1)
        score = torch.cat([score, policy.insert_score(k[None])[0]], 1)
        seen = cached & (st["P"] > t - W) if W else cached  # (H, n): what attention reads
        for h in range(H):  # 3. attend over exactly the cached tokens, fp32
            logits = self._logits(q[0, h * g:(h + 1) * g, 0].float() @ st["K"][h].T)  # (g, n)
            p = logits.masked_fill(~seen[h], -torch.inf).softmax(-1)
            out[0, h * g:(h + 1) * g, 0] = (p @ st["V"][h]).to(q.dtype)
            if policy.needs_scores:  # 4. the policy's update, one query
                score[h] = policy.update(score[h][None, None], p.sum(0)[None, None], seen[h][None, None])[0, 0]
        st["cached"], st["score"] = cached, score
        return out

    def _logits(self, qk):
        """q . k scaled (1 / sqrt(hd), or Gemma's 1 / sqrt(query_pre_attn_scalar)), then Gemma 2's soft-cap."""
        logits = qk * (self.cfg.attn_scalar or self.cfg.head_dim) ** -0.5
        cap = self.cfg.attn_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def _keep(self, policy, st, cached, score, t):
        pos = st["P"].expand_as(cached).masked_fill(~cached, -1)[None]  # (1, H, n); not cached: < 0
        return policy.keep_score(score[None], pos, torch.tensor(t), st["K"][None], st["V"][None])[0]

    def _dense(self, layer, q, k, v, pos):
        policy, H, g = self.policies[layer], self.cfg.n_kv_head, self.cfg.group
        T_ = q.shape[2]
        out = torch.empty_like(q)
        score = policy.insert_score(k[None])[0]  # (H, T)
        first = T_ - min(T_, policy.prompt_window or T_)
        W = self.windows[layer]
        causal = torch.ones(T_, T_, dtype=torch.bool).tril()  # and, on a sliding layer, within the window
        if W:
            causal &= (torch.arange(T_)[:, None] - torch.arange(T_)[None, :]) < W
        for h in range(H):
            logits = self._logits(q[0, h * g:(h + 1) * g].float() @ k[h].T)  # (g, T, T)
            p = logits.masked_fill(~causal, -torch.inf).softmax(-1)
            out[0, h * g:(h + 1) * g] = (p @ v[h]).to(q.dtype)
            if policy.needs_scores:
                for i in range(first, T_):  # the prompt's queries in order, one update each
                    score[h] = policy.update(score[h][None, None], p[:, i].sum(0)[None, None],
                                             causal[i][None, None])[0, 0]
        score = policy.prompt_score(score[None])[0]
        P = torch.arange(T_)
        keep = policy.keep_score(score[None], P.expand(H, T_)[None], torch.tensor(T_ - 1), k[None], v[None])[0]
        if W:  # chosen among the tokens still inside the last position's window
            keep = keep.masked_fill(P <= T_ - 1 - W, -torch.inf)
        n = min(self.caps[layer], T_)
        cached = torch.zeros(H, T_, dtype=torch.bool)
        for h in range(H):  # the n highest keep-scores, ties to the newest
            ranked = sorted(range(T_), key=lambda j: (-float(keep[h, j]), -j))[:n]
            cached[h, ranked] = True
        self.state[layer] = {"K": k, "V": v, "P": P, "cached": cached, "score": score}
        return out


class _Layer:
    def __init__(self, cache: HookReference, index: int):
        self.cache, self.index = cache, index

    def attend(self, q, k, v, pos):
        return self.cache.attend(self.index, q, k, v, pos)


def reference_logits(model, ids, policy, length=None, dense_prompt=0, kv_bits=None, given_kv=None) -> torch.Tensor:
    """(T, V) teacher-forced logits through `HookReference`: a dense prompt of `dense_prompt` tokens, then one
    token at a time."""
    cache = HookReference(model.cfg, policy, length or len(ids), kv_bits, given_kv)
    x = torch.tensor([ids])
    outs = [model(x[:, :dense_prompt], torch.arange(dense_prompt)[None], cache)] if dense_prompt else []
    outs += [model(x[:, t:t + 1], torch.tensor([[t]]), cache) for t in range(dense_prompt, len(ids))]
    return torch.cat(outs, 1)[0]
