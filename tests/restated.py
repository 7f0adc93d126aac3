"""Every built-in rule restated (docs/policies.md), the tests' oracle beside the one naive reference: where
`h2o_mini.checks.naive` drives a policy's own hooks (so a hook that misstates its rule would pass there), this
file writes each rule out again from its documented statement. Every key and value is kept, and the rule is
applied as a mask, one token at a time, in plain Python loops (docs/spec.md). It shares no eviction code with
`h2o_mini.cache` or the policy classes (only the parameters are read off the policy object). A policy not written
out here (a plugin) goes to `h2o_mini.checks.naive.NaiveCache`, its own hooks one token at a time (what
`h2o-mini check-policy` runs). Single row only (rows never influence each other; batched paths are
compared per row). With `kv_bits`, every key and value is rounded through the documented quantizer as it enters
(written out again here too).
"""
from __future__ import annotations

import math
from fractions import Fraction

import torch

from h2o_mini.config import layer_inv_freq
from h2o_mini.policies import Policy

SUMMED = {"full", "local", "heavy_hitter", "h2o", "sinks", "snapkv", "pyramidkv", "vatp", "paged_h2o", "rkv"}
WINDOWED = {"h2o": "recent", "scissorhands": "recent", "snapkv": "window", "pyramidkv": "window", "a2sf": "recent",
            "vatp": "recent", "paged_h2o": "recent", "rkv": "recent"}
KNOWN = SUMMED | {"tova", "scissorhands", "knorm", "keydiff", "a2sf", "expected_attention"}  # others: NaiveCache


def fake_quant(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """(..., hd) -> the same values after storing them as `bits`-bit codes: per group of gcd(hd, 32) channels,
    zero = fp16(min), scale = fp16((max - min) / (2^bits - 1)), code = clamp(round((x - zero) / scale))."""
    if bits is None:
        return x
    hd, levels = x.shape[-1], 2**bits - 1
    group = math.gcd(hd, 32)
    out = torch.empty_like(x)
    for s in range(0, hd, group):
        g = x[..., s:s + group].float()
        zero = g.amin(-1, keepdim=True).half().float()
        scale = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / levels).half().float()
        step = torch.where(scale == 0, torch.ones_like(scale), scale)
        code = torch.clamp(torch.round((g - zero) / step), 0, levels)
        out[..., s:s + group] = (code * scale + zero).to(x.dtype)
    return out


def layer_capacities(policy: Policy, n_layer: int, length: int) -> list[int]:
    """C per layer: the policy's C (at most L), or PyramidKV's linear shares in exact rational arithmetic."""
    C = min(policy.capacity or length, length)
    if policy.name != "pyramidkv" or C >= length or n_layer == 1:
        return [C] * n_layer
    h, w = policy.heavy, policy.window
    top = Fraction(h, policy.beta)
    bottom = min(2 * h - top, Fraction(length - w))
    top = 2 * h - bottom
    shares = [bottom + (top - bottom) * Fraction(i, n_layer - 1) for i in range(n_layer)]
    ends = [math.floor(sum(shares[:i])) for i in range(n_layer + 1)]
    return [min(length, w + ends[i + 1] - ends[i]) for i in range(n_layer)]


class RestatedCache:
    def __init__(self, cfg, policy: Policy, length: int, kv_bits: int | None = None, given_kv=None):
        """given_kv: per layer, position -> (k, v), each (n_kv_head, hd): the keys and values a fast path
        computed (`record_kv`), used instead of this model's own before they are rounded. Quantization is
        a step function: a key within rounding of a code boundary takes the neighbouring code when the
        matmul that made it summed in another order (a chunk rather than one token), so the quantized
        comparison rounds the *same* tensors on both sides; everything else is still computed here."""
        self.policy, self.g, self.bits, self.given = policy, cfg.group, kv_bits, given_kv
        # a sliding-window layer (docs/spec.md) holds at most W tokens; a token with p <= t - W is dead
        self.windows = [cfg.window(i) for i in range(cfg.n_layer)]
        self.caps = [min(c, w or c) for c, w in zip(layer_capacities(policy, cfg.n_layer, length), self.windows)]
        # logits = scale * q.k, then Gemma 2's soft-cap: cap * tanh(logits / cap)
        self.scale, self.cap = (cfg.attn_scalar or cfg.head_dim) ** -0.5, cfg.attn_softcap
        # per layer: every K/V/position ever seen; per KV head: the cached indices and their scores, and for
        # scissorhands the list of important/not verdicts of every query since the token arrived
        self.state = [{"K": [], "V": [], "P": [], "cached": [[] for _ in range(cfg.n_kv_head)],
                       "score": [{} for _ in range(cfg.n_kv_head)], "hist": [{} for _ in range(cfg.n_kv_head)],
                       "layer": i} for i in range(cfg.n_layer)]
        self.layers = [_Layer(self, i) for i in range(cfg.n_layer)]  # what the model indexes
        # Expected Attention: every query counted so far, as the model projected it (RoPE undone), per layer
        self.cfg, self.queries = cfg, [[] for _ in range(cfg.n_layer)]

    def attend(self, layer, q, k, v, pos):
        assert q.shape[0] == 1, "the reference runs one row"
        if self.given is not None:
            given = [self.given[layer][int(p)] for p in pos[0]]
            k = torch.stack([kv[0] for kv in given], 1)[None].to(k.dtype)  # (1, H, T, hd)
            v = torch.stack([kv[1] for kv in given], 1)[None].to(v.dtype)
        k, v = fake_quant(k, self.bits), fake_quant(v, self.bits)
        if q.shape[2] > 1:  # a prompt: dense
            return self._dense(layer, q, k, v, pos)
        st, C, name = self.state[layer], self.caps[layer], self.policy.name
        t = int(pos[0, 0])
        self._observe(layer, q[0, :, 0], t)
        st["K"].append(k[0, :, 0])
        st["V"].append(v[0, :, 0])
        st["P"].append(t)
        new = len(st["P"]) - 1
        out = torch.empty_like(q)
        W = self.windows[layer]
        live = (lambda j: st["P"][j] > t - W) if W else (lambda j: True)  # noqa: E731
        for h, cached in enumerate(st["cached"]):
            score, hist = st["score"][h], st["hist"][h]
            if len(cached) == C:  # 1. evict exactly one: a dead token (the oldest) if any, else the policy's
                dead = [j for j in cached if not live(j)]
                victim = min(dead, key=lambda j: st["P"][j]) if dead else self._victim(cached, score, hist, st, h, t)
                cached.remove(victim)
                del score[victim]
            cached.append(new)  # 2. insert
            score[new] = self._knorm(st["K"][new][h]) if name == "knorm" else 0.0
            hist[new] = []
            seen = [j for j in cached if live(j)]
            keys = torch.stack([st["K"][j][h] for j in seen]).float()
            vals = torch.stack([st["V"][j][h] for j in seen]).float()
            group = [0.0] * len(seen)
            for qh in range(h * self.g, (h + 1) * self.g):  # 3. attend over exactly the cached live tokens
                p = self._logits(q[0, qh, 0].float(), keys).softmax(-1)
                out[0, qh, 0] = (p @ vals).to(q.dtype)
                group = [a + b for a, b in zip(group, p.tolist())]
            self._update(seen, score, hist, group)  # 4. the policy's score update, over what was attended
        return out

    def _logits(self, q, keys):
        logits = q @ keys.T * self.scale
        return logits if self.cap is None else self.cap * torch.tanh(logits / self.cap)

    def _update(self, cached, score, hist, group):
        name = self.policy.name
        if name in SUMMED:
            for j, pj in zip(cached, group):
                score[j] += pj
        elif name == "a2sf":  # every score decays by gamma, then this query's attention is added
            for j, pj in zip(cached, group):
                score[j] = self.policy.gamma * score[j] + pj
        elif name == "tova":
            for j, pj in zip(cached, group):
                score[j] = pj
        elif name == "scissorhands":
            share = sum(group) / len(group)  # the group's uniform share
            for j, pj in zip(cached, group):
                hist[j].append(pj >= share)

    def _victim(self, cached, score, hist, st, h, t):
        name, P = self.policy.name, st["P"]
        oldest_lowest = lambda js, f: min(js, key=lambda j: (f(j), P[j]))  # noqa: E731
        assert name != "full", "full never evicts"
        if name == "local":
            return min(cached, key=lambda j: P[j])
        if name == "sinks":
            return min((j for j in cached if P[j] >= self.policy.sink), key=lambda j: P[j])
        candidates = cached
        if name in WINDOWED:
            candidates = [j for j in cached if P[j] <= t - getattr(self.policy, WINDOWED[name])]
        if name == "scissorhands":
            return oldest_lowest(candidates, lambda j: sum(hist[j][-self.policy.window:]))
        if name == "keydiff":
            return oldest_lowest(candidates, self._similarity(st["K"], cached, h))
        if name in ("vatp", "paged_h2o", "rkv"):
            return oldest_lowest(candidates, self._combined(cached, score, st, h))
        if name == "expected_attention":
            return oldest_lowest(candidates, self._expected(st["layer"], h, cached, t))
        return oldest_lowest(candidates, lambda j: score[j])  # heavy_hitter, h2o, snapkv, pyramidkv, tova, knorm, a2sf

    def _rotation(self, layer: int, angles_of) -> torch.Tensor:
        """The (hd, hd) matrix that turns channel pair (i, i + rd/2) by cos/sin `angles_of(inv_freq)` (rotate-half
        RoPE on the first rd channels; the identity without RoPE), built entry by entry, in float64."""
        d, inv = self.cfg.head_dim, layer_inv_freq(self.cfg, layer)
        R = torch.eye(d, dtype=torch.float64)
        if inv is None:
            return R
        half = inv.shape[0]
        for i, (c, s) in enumerate(angles_of(inv.double())):
            R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
        return R

    def _observe(self, layer: int, q: torch.Tensor, t: int) -> None:
        """Expected Attention's statistics take query t (n_head, hd), its rotation to t undone, from position sink on."""
        if self.policy.name == "expected_attention" and t >= self.policy.sink:
            R = self._rotation(layer, lambda inv: [(math.cos(t * w), math.sin(t * w)) for w in inv.tolist()])
            self.queries[layer].append(q.double() @ R)  # R^T q per head: the query before RoPE

    def _expected(self, layer: int, h: int, among, t: int):
        """j -> Expected Attention's keep-score at t (docs/policies.md): the mean and covariance of the counted
        queries of each head of the group, turned by the rotation averaged over t+1 .. t+future, the expected
        exp(q.k / sqrt(d)) normalised over the non-sink tokens of `among`, averaged over the group, times |v|."""
        pol, st, d = self.policy, self.state[layer], self.cfg.head_dim
        A = self._rotation(layer, lambda inv: [
            (sum(math.cos((t + n) * w) for n in range(1, pol.future + 1)) / pol.future,
             sum(math.sin((t + n) * w) for n in range(1, pol.future + 1)) / pol.future) for w in inv.tolist()])
        others = [j for j in among if st["P"][j] >= pol.sink]
        keys = torch.stack([st["K"][j][h].double() for j in others]) if others else None
        share = {j: 0.0 for j in others}
        for qh in range(h * self.g, (h + 1) * self.g):
            qs = [q[qh] for q in self.queries[layer]]
            z = torch.zeros(len(others), dtype=torch.float64)
            if qs and others:
                m = sum(qs) / len(qs)
                S = sum(torch.outer(x - m, x - m) for x in qs) / len(qs)
                z = keys @ (A @ m) / math.sqrt(d)
                if pol.covariance:
                    z = z + torch.stack([k @ A @ S @ A.T @ k for k in keys]) / (2 * d)
            for j, p in zip(others, z.softmax(0).tolist() if others else []):
                share[j] += p / self.g
        norm = (lambda j: float(st["V"][j][h].double().norm())) if pol.vnorm else (lambda j: 1.0)
        return lambda j: math.inf if st["P"][j] < pol.sink or st["P"][j] > t - pol.recent else share[j] * norm(j)

    def _combined(self, among, score, st, h):
        """j -> the rank of vatp (score x |v|_1), paged_h2o (the summed score of j's page among `among`) or rkv
        (lam x score over the mean score - (1 - lam) x the mean cosine of j's key to the other keys of `among`)."""
        name, P = self.policy.name, st["P"]
        if name == "vatp":
            return lambda j: score[j] * float(st["V"][j][h].float().abs().sum())
        if name == "paged_h2o":
            b = self.policy.block
            return lambda j: sum(score[i] for i in among if P[i] // b == P[j] // b)
        unit = {j: st["K"][j][h].double() / st["K"][j][h].double().norm().clamp(min=1e-12) for j in among}
        mean = sum(score[i] for i in among) / len(among)
        lam = self.policy.lam

        def rank(j):
            others = [float(unit[j] @ unit[i]) for i in among if i != j]
            return lam * score[j] / max(mean, 1e-6) - (1 - lam) * (sum(others) / max(len(others), 1))
        return rank

    @staticmethod
    def _knorm(key) -> float:
        """Minus the key's L2 norm, at bf16 resolution (documented: equal norms must tie)."""
        return -float(torch.tensor(math.sqrt(sum(x * x for x in key.double().tolist()))).bfloat16())

    @staticmethod
    def _similarity(K, among, h):
        """j -> minus the cosine of key j with the mean of the unit keys of `among` (KeyDiff)."""
        unit = {j: K[j][h].float() / K[j][h].float().norm().clamp(min=1e-12) for j in among}
        anchor = sum(unit.values()) / len(among)
        anchor = anchor / anchor.norm().clamp(min=1e-12)
        return lambda j: -(unit[j] @ anchor).item()

    def _dense(self, layer, q, k, v, pos):
        st, C, policy, name = self.state[layer], self.caps[layer], self.policy, self.policy.name
        T = q.shape[2]
        out = torch.empty_like(q)
        st["K"] = list(k[0].transpose(0, 1))  # (H, hd) per token
        st["V"] = list(v[0].transpose(0, 1))
        st["P"] = pos[0].tolist()
        for i in range(T):
            self._observe(layer, q[0, :, i], i)
        W = self.windows[layer]
        sees = torch.ones(T, T, dtype=torch.bool).tril()  # [query i, token j]: causal, and within the window
        if W:
            sees &= (torch.arange(T)[:, None] - torch.arange(T)[None, :]) < W
        among = [j for j in range(T) if not W or j > T - 1 - W]  # the tokens still live at the last position
        for h, cached in enumerate(st["cached"]):
            assert not cached, "dense prefill starts from an empty cache"
            group = torch.zeros(T, T)  # [query i, token j]: attention summed over the group's heads
            for qh in range(h * self.g, (h + 1) * self.g):
                logits = self._logits(q[0, qh].float(), k[0, h].float())
                p = logits.masked_fill(~sees, -torch.inf).softmax(-1)
                out[0, qh] = (p @ v[0, h].float()).to(q.dtype)
                group += p
            if name in ("snapkv", "pyramidkv"):  # the observation window's queries, then max-pooled
                w, r = max(policy.window, 1), policy.kernel // 2
                raw = group[T - min(T, w):].sum(0).tolist()
                s = [max(raw[max(0, j - r):j + r + 1]) for j in range(T)]
            elif name == "tova":
                s = group[T - 1].tolist()
            elif name == "knorm":
                s = [self._knorm(st["K"][j][h]) for j in range(T)]
            elif name == "a2sf":  # each prompt query in turn: decay every score, add its attention
                s = [0.0] * T
                for i in range(T):
                    s = [self.policy.gamma * s[j] + group[i, j].item() for j in range(T)]
            else:
                s = group.sum(0).tolist()  # s_j: summed over all prompt queries (and the group's heads)
            hist = {j: [sees[i, j].item() and group[i, j].item() >= group[i].sum().item() / sees[i].sum().item()
                        for i in range(j, T)] for j in range(T)} if name == "scissorhands" else {j: [] for j in range(T)}
            keep = self._dense_keep(s, hist, st, h, T, C, among)
            st["cached"][h] = sorted(keep)
            st["score"][h] = {j: s[j] for j in keep}
            st["hist"][h] = {j: hist[j] for j in keep}
        return out

    def _dense_keep(self, s, hist, st, h, T, C, among):
        """The prompt tokens to keep (indices), chosen among `among` (on a sliding layer the tokens still inside
        the last position's window; else all): the spec's rule for the four of the spec, else each rule. Rules
        across tokens (KeyDiff's anchor, a page's sum, R-KV's mean) read every prompt token, as the cache does."""
        name, newest_first = self.policy.name, among[::-1]
        if len(among) <= C or name == "full":
            return newest_first[:C][::-1]
        if name == "local":
            return newest_first[:C]
        if name == "sinks":
            sink = self.policy.sink
            return sorted(among, key=lambda j: (j >= sink, -j))[:C]
        best = lambda js, f: sorted(js, key=lambda j: (-f(j), -j))  # noqa: E731  ties: keep the newer
        if name in WINDOWED:
            r = getattr(self.policy, WINDOWED[name])
            rank = (lambda j: sum(hist[j][-self.policy.window:])) if name == "scissorhands" else (lambda j: s[j])
            if name in ("vatp", "paged_h2o", "rkv"):  # ranked among every prompt token (all are cached here)
                rank = self._combined(list(range(T)), dict(enumerate(s)), st, h)
            return newest_first[:r] + best(newest_first[r:], rank)[:C - r]
        if name == "keydiff":
            sim = self._similarity(st["K"], range(T), h)
            return best(among, lambda j: sim(j))[:C]
        if name == "expected_attention":  # over every prompt token, as the cache passes them
            rank = self._expected(st["layer"], h, range(T), T - 1)
            return best(among, rank)[:C]
        return best(among, lambda j: s[j])[:C]  # heavy_hitter, tova, knorm


class _Layer:
    def __init__(self, cache: RestatedCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q, k, v, pos):
        return self.cache.attend(self.index, q, k, v, pos)


def restated_logits(model, ids: list[int], policy: Policy, length: int | None = None, dense_prompt: int = 0,
                     kv_bits: int | None = None, given_kv=None) -> torch.Tensor:
    """Teacher-forced logits (T, V): the first `dense_prompt` tokens as a dense prompt, the rest one at a time,
    in a cache sized for `length` tokens (default: the ids). given_kv: see `RestatedCache`."""
    if policy.name not in KNOWN:  # a plugin: its own hooks, one token at a time
        from h2o_mini.checks.naive import naive_logits as by_hooks
        return by_hooks(model, ids, policy, length, dense_prompt, kv_bits, given_kv)
    cache = RestatedCache(model.cfg, policy, length or len(ids), kv_bits, given_kv)
    x = torch.tensor([ids])
    outs = []
    if dense_prompt:
        outs.append(model(x[:, :dense_prompt], torch.arange(dense_prompt)[None], cache))
    for t in range(dense_prompt, len(ids)):
        outs.append(model(x[:, t:t + 1], torch.tensor([[t]]), cache))
    return torch.cat(outs, 1)[0]
