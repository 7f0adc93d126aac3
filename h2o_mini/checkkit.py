"""`h2o-mini check-policy SPEC`: proves a policy exact on every code path, whoever wrote it.

The kit builds tiny random decoders of each family (LLaMA with GQA, OPT, GPT-NeoX, Qwen3, a hybrid model
with a sliding-window layer, a Gemma-shaped hybrid with soft-capped attention; seeded weights, no download), reads a real text through them under the policy, and
compares every fast path of `cache.py` (the decode step, stream prefill in chunks of 1/7/64, dense prefill in
one block and in causal blocks of 7 then decoding, a ragged left-padded batch in both prefill modes, the
compiled step, keys and values stored at 8 and 4 bits) with `HookReference`: a naive cache that keeps every key
and value and applies the rule one token at a time, eviction as a mask, straight from `docs/spec.md`. It shares
no eviction code with `cache.py`; it calls only the policy's own hooks (`keep_score`, `insert_score`, `update`
once per query, `prompt_score`, `layer_capacity`, `for_layer`), so any policy, registered or plugged in, is
checked against its own statement of the rule. It also checks that `accumulate` (a closed form, if the policy
has one) equals `update` applied query by query. A path passes when its logits are within `TOL` of the
reference: fp32, the same weights, the same tokens; a different eviction moves these logits by > 1e-2.
"""
from __future__ import annotations

import torch

from .config import Config
from .generate import Decoder, left_pad
from .model import Transformer
from .policies import Policy
from .policies.base import keep_scores
from .quant import codec

TOL = 1e-4
TEXT = ("The licenses for most software and other practical works are designed to take away your freedom to share "
        "and change the works. By contrast, the GNU General Public License is intended to guarantee your freedom.")
T, C = 40, 10  # tokens read, and the default budget: the cache fills at token 10 and evicts 30 times

FAMILIES = {  # tiny, but each with its family's quirks: GQA, learned positions + projections, partial RoPE
    "llama_gqa": Config("llama", 256, 2, 4, 2, 32, 8, 48, 256, rotary_dim=8, tie_embeddings=True, attn_bias=True),
    "opt": Config("opt", 256, 2, 4, 4, 32, 8, 48, 256, norm="layer", act="relu", gated_mlp=False, learned_pos=True,
                  d_embed=16, attn_bias=True, out_bias=True, mlp_bias=True),
    "neox": Config("gpt_neox", 256, 2, 4, 4, 32, 8, 48, 256, norm="layer", act="gelu", gated_mlp=False,
                   parallel_residual=True, rotary_dim=4, attn_bias=True, out_bias=True, mlp_bias=True),
    # Qwen3: per-head q/k norms, head_dim 12 != 32 / 4, one KV head for four query heads
    "qwen3": Config("qwen3", 256, 2, 4, 1, 32, 12, 48, 256, rotary_dim=12, qk_norm=True),
    # hybrid local/global: layer 0 attends to its last 6 positions only (docs/spec.md, sliding-window layers)
    "hybrid": Config("qwen2", 256, 2, 4, 2, 32, 8, 48, 256, rotary_dim=8, attn_bias=True, windows=(6, None)),
    # Gemma-shaped hybrid: (1 + w) norms around both branches, scaled embeddings, its own attention scalar and a
    # tight attention soft-cap (the logits the policy's scores come from are capped), q/k norms, two RoPE bases
    "gemma": Config("gemma3", 256, 2, 4, 1, 32, 16, 48, 256, norm="rms_1p", act="gelu_tanh", rotary_dim=16,
                    rope_theta=1e6, rope_theta_local=1e4, qk_norm=True, windows=(6, None), embed_scale=True,
                    sandwich_norm=True, attn_scalar=12.0, attn_softcap=3.0, logit_softcap=8.0, tie_embeddings=True),
}


def tiny_model(name: str) -> Transformer:
    """A tiny decoder of a family, its weights drawn from a generator seeded by the name (same on every machine)."""
    cfg = FAMILIES[name]
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.3 if p.ndim >= 2 else noise * 0.1 + (0 if pname.endswith("bias") else 1))
    return model.eval().requires_grad_(False)


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

    def attend(self, layer, q, k, v, pos, mode):
        assert q.shape[0] == 1, "the reference runs one row"
        k, v = self._store(layer, k, v, pos)  # (H, T, hd)
        if mode == "dense":
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
        return keep_scores(policy, score[None], pos, torch.tensor(t), st["K"][None], st["V"][None])[0]

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
        keep = keep_scores(policy, score[None], P.expand(H, T_)[None], torch.tensor(T_ - 1), k[None], v[None])[0]
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

    def attend(self, q, k, v, pos, mode):
        return self.cache.attend(self.index, q, k, v, pos, mode)


def record_kv(cache) -> list[dict]:
    """Wrap every layer of a fast `KVCache` so that it records the keys and values it is given, before it
    stores them: per layer, position -> (k, v) of row 0. Quantization is a step function: a value within
    rounding of a code boundary takes the neighbouring code when the matmul that made it summed in another
    order (a chunk rather than one token), so the quantized comparison rounds the same tensors on both sides."""
    given = [{} for _ in cache.layers]
    for layer, seen in zip(cache.layers, given):
        def attend(q, k, v, pos, mode, _attend=layer.attend, _seen=seen):
            for i, p in enumerate(pos[0].tolist()):
                _seen[p] = (k[0, :, i].clone(), v[0, :, i].clone())
            return _attend(q, k, v, pos, mode)
        layer.attend = attend
    return given


def reference_logits(model, ids, policy, length=None, dense_prompt=0, kv_bits=None, given_kv=None) -> torch.Tensor:
    """(T, V) teacher-forced logits through `HookReference`: a dense prompt of `dense_prompt` tokens, then one
    token at a time."""
    cache = HookReference(model.cfg, policy, length or len(ids), kv_bits, given_kv)
    x = torch.tensor([ids])
    outs = [model(x[:, :dense_prompt], torch.arange(dense_prompt)[None], cache, mode="dense")] if dense_prompt else []
    outs += [model(x[:, t:t + 1], torch.tensor([[t]]), cache, mode="step") for t in range(dense_prompt, len(ids))]
    return torch.cat(outs, 1)[0]


def fast_logits(model, ids, policy, plan, kv_bits=None, dense_block=512, record=False, decoder=None):
    """(T, V) teacher-forced logits through the real `KVCache`; plan: (start, end, mode) covering the ids.
    decoder: its (compiled) step runs the "step" parts. record: also the keys and values it was given."""
    decoder = decoder or Decoder(model, kv_bits=kv_bits)
    cache = decoder.new_cache(policy, 1, len(ids))
    for layer in cache.layers:
        layer.dense_block = dense_block
    given = record_kv(cache) if record else None
    x = torch.tensor([ids])
    out = []
    for s, e, mode in plan:
        if mode == "step":
            out.append(decoder.step(model, cache, x[:, s:e], torch.arange(s, e)[None])[:, None])
        else:
            out.append(model(x[:, s:e], torch.arange(s, e)[None], cache, mode=mode))
    logits = torch.cat(out, 1)[0]
    return (logits, given) if record else logits


def steps(a: int, b: int) -> list[tuple[int, int, str]]:
    return [(t, t + 1, "step") for t in range(a, b)]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def check_accumulate(policy: Policy) -> float:
    """The largest difference between `accumulate` over 9 queries and `update` applied query by query, on
    random attention (some queries attending nothing, as padding does)."""
    if not policy.needs_scores:
        return 0.0
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 3, 9, 12, generator=gen).softmax(-1)
    attended = torch.rand(2, 3, 9, 12, generator=gen) > 0.2
    attended[:, :, 3] = False  # a query that counts for nothing
    probs = probs * attended
    score = torch.rand(2, 3, 12, generator=gen)
    want = score
    for i in range(9):
        counts = attended[:, :, i].any(-1, keepdim=True)
        want = torch.where(counts, policy.update(want, probs[:, :, i], attended[:, :, i]), want)
    return _diff(policy.accumulate(score, probs, attended), want)


def check_paths(make, family: str, compiled: bool = False, quantized: bool = False):
    """(path, largest |logit difference| against the reference) for every path on one tiny family.
    make(length) -> the policy for a sequence of `length` tokens."""
    model = tiny_model(family)
    ids = list(TEXT.encode())[:T]
    policy = make(T)
    want = reference_logits(model, ids, policy)
    yield "decode step", _diff(fast_logits(model, ids, policy, steps(0, T)), want)
    for chunk in (1, 7, 64):
        plan = [(s, min(T, s + chunk), "stream") for s in range(0, T, chunk)]
        yield f"stream, chunks of {chunk}", _diff(fast_logits(model, ids, policy, plan), want)
    n = 30  # a prompt longer than C, then decoding
    dense_want = reference_logits(model, ids, policy, dense_prompt=n)
    for block in (512, 7):
        got = fast_logits(model, ids, policy, [(0, n, "dense")] + steps(n, T), dense_block=block)
        yield f"dense prefill{'' if block > n else f' in blocks of {block}'}, then steps", _diff(got, dense_want)
    for prefill in ("stream", "dense"):
        yield f"ragged batch, {prefill} prefill", _ragged(model, make, prefill)
    if compiled:
        decoder = Decoder(model, compile="layer")
        yield "compiled step", _diff(fast_logits(model, ids, policy, steps(0, T), decoder=decoder), want)
    if quantized:
        for bits in (8, 4):
            plan = [(0, 20, "dense"), (20, 27, "stream"), (27, 34, "stream")] + steps(34, T)
            got, given = fast_logits(model, ids, policy, plan, kv_bits=bits, record=True)
            ref = reference_logits(model, ids, policy, dense_prompt=20, kv_bits=bits, given_kv=given)
            yield f"{bits}-bit keys and values", _diff(got, ref)


def _ragged(model, make, prefill: str) -> float:
    """Left-padded rows of different lengths, prefilled together then decoded 8 steps, each row against the
    reference run of that row alone."""
    data = list(TEXT.encode())
    texts = [data[0:40], data[50:73], data[80:111], data[120:129]]
    prompts, follow = [t[:-8] for t in texts], [t[-8:] for t in texts]
    policy = make(40)
    idx, pos = left_pad(prompts)
    decoder = Decoder(model)
    cache = decoder.new_cache(policy, len(texts), 40)
    chunks = [(0, idx.shape[1])] if prefill == "dense" else [(s, s + 9) for s in range(0, idx.shape[1], 9)]
    first = torch.cat([model(idx[:, s:e], pos[:, s:e], cache, mode=prefill) for s, e in chunks], 1)
    rest = [model(torch.tensor([[f[i]] for f in follow]), pos[:, -1:] + 1 + i, cache, mode="step") for i in range(8)]
    worst = 0.0
    for row, (p, text) in enumerate(zip(prompts, texts)):
        want = reference_logits(model, text, policy, 40, dense_prompt=len(p) if prefill == "dense" else 0)
        got = torch.cat([first[row, -len(p):]] + [r[row] for r in rest])
        worst = max(worst, _diff(got, want))
    return worst


@torch.inference_mode()
def check_policy(make, families=tuple(FAMILIES), progress=None) -> list[dict]:
    """Every path on every family (the compiled step and quantized storage on the first family), and the
    closed form against the per-query rule. Rows: family, path, max_diff, passed."""
    rows = [{"family": "-", "path": "accumulate = update per query", "max_diff": check_accumulate(make(T))}]
    for i, family in enumerate(families):
        for path, diff in check_paths(make, family, compiled=i == 0, quantized=i == 0):
            rows.append({"family": family, "path": path, "max_diff": diff})
            if progress:
                progress(rows[-1])
    for row in rows:
        row["passed"] = row["max_diff"] <= TOL
    return rows
