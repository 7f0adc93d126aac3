"""The naive reference: docs/spec.md read as plainly as code can, and the first file to read to learn H2O.

One row. Every key and value ever seen is kept, and the cache of C tokens is a mask over them: at each token
the four steps of the spec run in order (1. evict the lowest keep-score, ties the oldest; 2. insert; 3. attend
over exactly the cached tokens; 4. update the scores with that attention), in Python loops over heads and
queries. It calls only the policy's hooks, so any policy, built in or a plugin, is run by its own statement of
the rule; it shares no code with the fast paths (`cache.py`, `prompt.py`), which `h2o-mini check-policy`
(`checkkit.py`) compares with it. Slow on purpose.
"""
from __future__ import annotations

import torch

from ..config import Config, layer_inv_freq
from ..model import Rope, softcap
from ..policies import Policy
from ..quant import codec


class NaiveCache:
    """Stands where the model expects a `cache.KVCache`: `layers[i].attend(q, k, v, pos)` per layer."""

    def __init__(self, cfg: Config, policy: Policy, length: int, kv_bits: int | None = None, given_kv=None):
        """given_kv: per layer, position -> (k, v), the keys and values a fast path computed (`checkkit.record_kv`),
        stored instead of this run's own so that both sides round the same tensors to the same 8/4-bit codes."""
        self.cfg, self.given = cfg, given_kv
        policy = policy.for_model(cfg)
        self.policies = [policy.for_layer(i, cfg.n_layer) for i in range(cfg.n_layer)]
        self.windows = [cfg.window(i) for i in range(cfg.n_layer)]  # sliding layers: p <= t - W is dead
        self.caps = [min(policy.layer_capacity(i, cfg.n_layer, length), w or length) for i, w in enumerate(self.windows)]
        self.codec = codec(kv_bits, cfg.head_dim, torch.float32)
        self.state = [None] * cfg.n_layer  # per layer: keys, values, positions, the cached mask and the scores
        # a rule's running state per query head (`Policy.observe`), and each layer's rotary embedding for it
        self.own = [torch.zeros(1, cfg.n_kv_head, cfg.group, n) if (n := p.state_size(cfg.head_dim)) else None
                    for p in self.policies]
        self.ropes = [None if (f := layer_inv_freq(cfg, i)) is None else Rope(f) for i in range(cfg.n_layer)]
        self.layers = [_Layer(self, i) for i in range(cfg.n_layer)]

    def attend(self, layer, q, k, v, pos):
        """q: (1, n_head, T, hd); k, v: (1, H, T, hd); pos: (1, T). T > 1 is a dense prompt, else one token."""
        k, v = self._store(layer, k, v, pos)  # (H, T, hd)
        if q.shape[2] > 1:
            return self._dense(layer, q, k, v)
        st, policy, W = self.state[layer], self.policies[layer], self.windows[layer]
        H, g, t = self.cfg.n_kv_head, self.cfg.group, int(pos[0, 0])
        if st is None:
            st = self.state[layer] = {"K": k[:, :0], "V": v[:, :0], "P": torch.zeros(0, dtype=torch.long),
                                      "cached": torch.zeros(H, 0, dtype=torch.bool), "score": torch.zeros(H, 0)}
        cached, score = st["cached"].clone(), st["score"]  # (H, n) each: per KV head, which tokens are cached
        if self.own[layer] is not None:  # 0. observe: the rule's own state sees this token's queries
            self.own[layer] = policy.observe(self.own[layer], q[0, :, 0].reshape(1, H, g, -1),
                                             torch.tensor(t).view(1, 1, 1), self.ropes[layer])
        if int(cached[0].sum()) == self.caps[layer]:  # 1. evict exactly one (every head holds the same count)
            seen = st["P"].expand_as(cached).masked_fill(~cached, -1)[None]  # (1, H, n): not cached is < 0
            keep = policy.keep_score(score[None], seen, torch.tensor(t), st["K"][None], st["V"][None],
                               self.own[layer])[0]
            if W:  # a dead token goes before any live one, the oldest first
                keep = keep.masked_fill(st["P"] <= t - W, -torch.inf)
            keep = keep.masked_fill(~cached, torch.inf)
            lowest = keep == keep.amin(-1, keepdim=True)
            victim = torch.where(lowest, st["P"], torch.iinfo(torch.long).max).argmin(-1)  # the oldest of the lowest
            cached[torch.arange(H), victim] = False
        st["K"], st["V"] = torch.cat([st["K"], k], 1), torch.cat([st["V"], v], 1)  # 2. insert t
        st["P"] = torch.cat([st["P"], torch.tensor([t])])
        cached = torch.cat([cached, torch.ones(H, 1, dtype=torch.bool)], 1)
        score = torch.cat([score, policy.insert_score(k[None])[0]], 1)
        seen = cached & (st["P"] > t - W) if W else cached  # (H, n): what attention reads
        out = torch.empty_like(q)
        for h in range(H):  # 3. attend over exactly the cached tokens, fp32
            p = self._logits(q[0, h * g:(h + 1) * g, 0].float() @ st["K"][h].T)  # (g, n)
            p = p.masked_fill(~seen[h], -torch.inf).softmax(-1)
            out[0, h * g:(h + 1) * g, 0] = (p @ st["V"][h]).to(q.dtype)
            if policy.needs_scores:  # 4. update the scores: the policy's rule for one query (H2O: add p)
                score[h] = policy.update(score[h][None, None], p.sum(0)[None, None], seen[h][None, None])[0, 0]
        st["cached"], st["score"] = cached, score
        return out

    def _store(self, layer, k, v, pos):
        if self.given is not None:
            k = torch.stack([self.given[layer][int(p)][0] for p in pos[0]], 1)[None]
            v = torch.stack([self.given[layer][int(p)][1] for p in pos[0]], 1)[None]
        k, v = self.codec.decode(self.codec.encode(k)), self.codec.decode(self.codec.encode(v))
        return k[0].float(), v[0].float()

    def _logits(self, qk):
        """q . k scaled (1 / sqrt(hd), or Gemma's 1 / sqrt(query_pre_attn_scalar)), then Gemma 2's soft-cap."""
        return softcap(qk * (self.cfg.attn_scalar or self.cfg.head_dim) ** -0.5, self.cfg.attn_softcap)

    def _dense(self, layer, q, k, v):
        """A first prompt: causal attention, scores from its last `prompt_window` queries, then keep C."""
        policy, H, g, W = self.policies[layer], self.cfg.n_kv_head, self.cfg.group, self.windows[layer]
        T = q.shape[2]
        out = torch.empty_like(q)
        score = policy.insert_score(k[None])[0]  # (H, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()  # and, on a sliding layer, within the window
        if W:
            causal &= (torch.arange(T)[:, None] - torch.arange(T)[None, :]) < W
        for h in range(H):
            p = self._logits(q[0, h * g:(h + 1) * g].float() @ k[h].T).masked_fill(~causal, -torch.inf).softmax(-1)
            out[0, h * g:(h + 1) * g] = (p @ v[h]).to(q.dtype)
            if policy.needs_scores:
                for i in range(T - min(T, policy.prompt_window or T), T):  # the scoring queries, in order
                    score[h] = policy.update(score[h][None, None], p[:, i].sum(0)[None, None],
                                             causal[i][None, None])[0, 0]
        score = policy.prompt_score(score[None])[0]
        for i in range(T if self.own[layer] is not None else 0):  # the rule's own state sees every query, in order
            self.own[layer] = policy.observe(self.own[layer], q[0, :, i].reshape(1, H, g, -1),
                                             torch.tensor(i).view(1, 1, 1), self.ropes[layer])
        P = torch.arange(T)
        keep = policy.keep_score(score[None], P.expand(H, T)[None], torch.tensor(T - 1), k[None], v[None],
                           self.own[layer])[0]
        if W:  # chosen among the tokens still inside the last position's window
            keep = keep.masked_fill(P <= T - 1 - W, -torch.inf)
        cached = torch.zeros(H, T, dtype=torch.bool)
        for h in range(H):  # the C highest keep-scores, ties to the newest
            cached[h, sorted(range(T), key=lambda j: (-float(keep[h, j]), -j))[:self.caps[layer]]] = True
        self.state[layer] = {"K": k, "V": v, "P": P, "cached": cached, "score": score}
        return out


class _Layer:
    def __init__(self, cache: NaiveCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q, k, v, pos):
        return self.cache.attend(self.index, q, k, v, pos)


def naive_logits(model, ids, policy, length=None, dense_prompt=0, kv_bits=None, given_kv=None) -> torch.Tensor:
    """(T, V) teacher-forced logits through `NaiveCache`: a dense prompt of `dense_prompt` tokens, then one
    token at a time."""
    cache = NaiveCache(model.cfg, policy, length or len(ids), kv_bits, given_kv)
    x = torch.tensor([ids])
    outs = [model(x[:, :dense_prompt], torch.arange(dense_prompt)[None], cache)] if dense_prompt else []
    outs += [model(x[:, t:t + 1], torch.tensor([[t]]), cache) for t in range(dense_prompt, len(ids))]
    return torch.cat(outs, 1)[0]
