"""The naive reference for `shared/spec/eviction.md`: every key and value is kept, and the policy is applied as
a mask, one token at a time, in plain Python loops. It shares no eviction code with `h2o_mini.cache`: the
four spec policies are written out from the spec's table; other registered policies are ranked by their
own `keep_score`. Single row only (rows never influence each other; batched paths are compared per row).
"""
from __future__ import annotations

import torch

from h2o_mini.policies import Policy


class ReferenceCache:
    def __init__(self, cfg, policy: Policy, capacity: int):
        self.policy, self.C, self.g = policy, capacity, cfg.group
        self.scale = cfg.head_dim ** -0.5
        self.state = [{"K": [], "V": [], "P": [], "cached": [[] for _ in range(cfg.n_kv_head)],
                       "score": [{} for _ in range(cfg.n_kv_head)]} for _ in range(cfg.n_layer)]
        self.layers = [_Layer(self, i) for i in range(cfg.n_layer)]  # what the model indexes

    def attend(self, layer, q, k, v, pos, mode):
        assert q.shape[0] == 1, "the reference runs one row"
        if mode == "dense":
            return self._dense(layer, q, k, v, pos)
        assert q.shape[2] == 1
        st = self.state[layer]
        t = int(pos[0, 0])
        st["K"].append(k[0, :, 0])
        st["V"].append(v[0, :, 0])
        st["P"].append(t)
        new = len(st["P"]) - 1
        out = torch.empty_like(q)
        for h, cached in enumerate(st["cached"]):
            score = st["score"][h]
            if len(cached) == self.C:  # 1. evict exactly one
                victim = self._victim(cached, score, st["P"], t)
                cached.remove(victim)
                del score[victim]
            cached.append(new)  # 2. insert with score 0
            score[new] = 0.0
            keys = torch.stack([st["K"][j][h] for j in cached]).float()
            vals = torch.stack([st["V"][j][h] for j in cached]).float()
            for qh in range(h * self.g, (h + 1) * self.g):  # 3. attend over exactly the cached tokens
                p = (q[0, qh, 0].float() @ keys.T * self.scale).softmax(-1)
                out[0, qh, 0] = (p @ vals).to(q.dtype)
                for j, pj in zip(cached, p.tolist()):  # 4. accumulate over the group's heads
                    score[j] += pj
        return out

    def _victim(self, cached, score, P, t):
        name = self.policy.name
        if name == "local":
            return min(cached, key=lambda j: P[j])
        if name == "heavy_hitter":
            return min(cached, key=lambda j: (score[j], P[j]))
        if name == "h2o":
            candidates = [j for j in cached if P[j] <= t - self.policy.recent]
            return min(candidates, key=lambda j: (score[j], P[j]))
        assert name != "full", "full never evicts"
        keep = self.policy.keep_score(torch.tensor([score[j] for j in cached]), torch.tensor([P[j] for j in cached]),
                                      torch.tensor(t)).tolist()
        return min(zip(cached, keep), key=lambda jk: (jk[1], P[jk[0]]))[0]

    def _dense(self, layer, q, k, v, pos):
        st = self.state[layer]
        T = q.shape[2]
        out = torch.empty_like(q)
        for h, cached in enumerate(st["cached"]):
            assert not cached, "dense prefill starts from an empty cache"
            s = torch.zeros(T)
            for qh in range(h * self.g, (h + 1) * self.g):
                logits = (q[0, qh].float() @ k[0, h].float().T) * self.scale
                logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)
                p = logits.softmax(-1)
                out[0, qh] = (p @ v[0, h].float()).to(q.dtype)
                s += p.sum(0)  # s_j: summed over all prompt queries and the group's heads
            keep = self._dense_keep(s.tolist(), T)
            st["cached"][h] = sorted(keep)
            st["score"][h] = {j: s[j].item() for j in keep}
        st["K"] = list(k[0].transpose(0, 1))  # (H, hd) per token
        st["V"] = list(v[0].transpose(0, 1))
        st["P"] = pos[0].tolist()
        return out

    def _dense_keep(self, s, T):
        """The prompt tokens to keep (indices): the spec's rule, policy by policy."""
        C, name, newest_first = self.C, self.policy.name, list(range(T - 1, -1, -1))
        if T <= C or name == "full":
            return list(range(T))
        if name == "local":
            return newest_first[:C]
        by_score = lambda js: sorted(js, key=lambda j: (-s[j], -j))  # noqa: E731  ties: keep the newer
        if name == "heavy_hitter":
            return by_score(range(T))[:C]
        if name == "h2o":
            r = self.policy.recent
            return newest_first[:r] + by_score(newest_first[r:])[:C - r]
        keep = self.policy.keep_score(torch.tensor(s), torch.arange(T), torch.tensor(T - 1)).tolist()
        return sorted(range(T), key=lambda j: (-keep[j], -j))[:C]


class _Layer:
    def __init__(self, cache: ReferenceCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q, k, v, pos, mode):
        return self.cache.attend(self.index, q, k, v, pos, mode)


def reference_logits(model, ids: list[int], policy: Policy, capacity: int, dense_prompt: int = 0,
                     cache: ReferenceCache | None = None) -> torch.Tensor:
    """Teacher-forced logits (T, V): the first `dense_prompt` tokens as a dense prompt, the rest one at a time."""
    cache = cache or ReferenceCache(model.cfg, policy, capacity)
    x = torch.tensor([ids])
    outs = []
    if dense_prompt:
        outs.append(model(x[:, :dense_prompt], torch.arange(dense_prompt)[None], cache, mode="dense"))
    for t in range(dense_prompt, len(ids)):
        outs.append(model(x[:, t:t + 1], torch.tensor([[t]]), cache, mode="step"))
    return torch.cat(outs, 1)[0]
