"""`h2o-mini check-policy SPEC`: proves a policy exact on every code path, whoever wrote it.

The kit builds tiny random decoders of each family (LLaMA with GQA, OPT, GPT-NeoX, Qwen3, a hybrid model
with a sliding-window layer, a Gemma-shaped hybrid with soft-capped attention; seeded weights, no download),
reads a real text through them under the policy, and compares every fast path of `cache.py` (the decode step,
stream prefill in chunks of 2/7/64, dense prefill in one block and in causal blocks of 7 then decoding, a ragged
left-padded batch in both prefill modes, the compiled step, keys and values stored at 8 and 4 bits, a row of a
batch of other policies) with
`naive.NaiveCache`: a naive cache that keeps every key and value and applies the rule one token at a time,
eviction as a mask, through the policy's own hooks only, so any policy, registered or plugged in, is checked
against its own statement of the rule. It also checks that `accumulate` (a closed form, if the policy
has one) equals `update` applied query by query. A path passes when its logits are within `TOL` of the
reference: fp32, the same weights, the same tokens; a different eviction moves these logits by > 1e-2.
"""
from __future__ import annotations

import torch

from ..config import Config
from ..generate import Decoder, left_pad
from ..model import Transformer
from .naive import naive_logits
from ..policies import H2O, Local, Policy
from ..policies.guard import PolicyFault
from ..policies.rows import Rows

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


def record_kv(cache) -> list[dict]:
    """Wrap every layer of a fast `KVCache` so that it records the keys and values it is given, before it
    stores them: per layer, position -> (k, v) of row 0. Quantization is a step function: a value within
    rounding of a code boundary takes the neighbouring code when the matmul that made it summed in another
    order (a chunk rather than one token), so the quantized comparison rounds the same tensors on both sides."""
    given = [{} for _ in cache.layers]
    for layer, seen in zip(cache.layers, given):
        def attend(q, k, v, pos, _attend=layer.attend, _seen=seen):
            for i, p in enumerate(pos[0].tolist()):
                _seen[p] = (k[0, :, i].clone(), v[0, :, i].clone())
            return _attend(q, k, v, pos)
        layer.attend = attend
    return given


def fast_logits(model, ids, policy, plan, kv_bits=None, dense_block=512, record=False, decoder=None):
    """(T, V) teacher-forced logits through the real `KVCache`; plan: (start, end, how) covering the ids, how is
    "step" (one token, by the decoder's (compiled) step), or "dense" / "stream" (a prompt chunk: the cache is
    built with the first chunk's). record: also the keys and values it was given."""
    decoder = decoder or Decoder(model, kv_bits=kv_bits)
    cache = decoder.new_cache(policy, 1, len(ids), "dense" if plan[0][2] == "dense" else "stream")
    for layer in cache.layers:
        layer.dense_block = dense_block
    given = record_kv(cache) if record else None
    x = torch.tensor([ids])
    out = []
    for s, e, how in plan:
        if how == "step":
            out.append(decoder.step(model, cache, x[:, s:e], torch.arange(s, e)[None])[:, None])
        else:
            out.append(model(x[:, s:e], torch.arange(s, e)[None], cache))
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
    want = naive_logits(model, ids, policy)
    yield "decode step", _diff(fast_logits(model, ids, policy, steps(0, T)), want)
    for chunk in (2, 7, 64):  # (a chunk of one token is a decode step)
        plan = [(s, min(T, s + chunk), "stream") for s in range(0, T, chunk)]
        yield f"stream, chunks of {chunk}", _diff(fast_logits(model, ids, policy, plan), want)
    n = 30  # a prompt longer than C, then decoding
    dense_want = naive_logits(model, ids, policy, dense_prompt=n)
    for block in (512, 7):
        got = fast_logits(model, ids, policy, [(0, n, "dense")] + steps(n, T), dense_block=block)
        yield f"dense prefill{'' if block > n else f' in blocks of {block}'}, then steps", _diff(got, dense_want)
    for prefill in ("stream", "dense"):
        yield f"ragged batch, {prefill} prefill", _ragged(model, make, prefill)
    yield "batched with other policies", _beside_others(model, policy, ids, want)
    if compiled:
        decoder = Decoder(model, compile="layer")
        yield "compiled step", _diff(fast_logits(model, ids, policy, steps(0, T), decoder=decoder), want)
    if quantized:
        for bits in (8, 4):
            plan = [(0, 20, "dense"), (20, 27, "stream"), (27, 34, "stream")] + steps(34, T)
            got, given = fast_logits(model, ids, policy, plan, kv_bits=bits, record=True)
            ref = naive_logits(model, ids, policy, dense_prompt=20, kv_bits=bits, given_kv=given)
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
    cache = decoder.new_cache(policy, len(texts), 40, prefill)
    chunks = [(0, idx.shape[1])] if prefill == "dense" else [(s, s + 9) for s in range(0, idx.shape[1], 9)]
    first = torch.cat([model(idx[:, s:e], pos[:, s:e], cache) for s, e in chunks], 1)
    rest = [model(torch.tensor([[f[i]] for f in follow]), pos[:, -1:] + 1 + i, cache) for i in range(8)]
    worst = 0.0
    for row, (p, text) in enumerate(zip(prompts, texts)):
        want = naive_logits(model, text, policy, 40, dense_prompt=len(p) if prefill == "dense" else 0)
        got = torch.cat([first[row, -len(p):]] + [r[row] for r in rest])
        worst = max(worst, _diff(got, want))
    return worst


def _beside_others(model, policy: Policy, ids: list[int], want: torch.Tensor) -> float:
    """The policy over two rows of a batch of several policies with other capacities (`Rows`: a sweep's one
    pass), streamed in chunks of 9 then decoded, its first row against its reference run alone."""
    others = [Local(recent=C - 3), H2O(heavy=C // 2 + 2, recent=C // 2 + 2)]  # narrower and wider than C
    rows = Rows([(others[0], 1), (policy, 2), (others[1], 1)])
    data = list(TEXT.encode())
    x = torch.tensor([data[60:60 + T], ids, data[100:100 + T], data[140:140 + T]])
    pos = torch.arange(T)[None].expand(4, T)
    cache = Decoder(model).new_cache(rows, 4, T, "stream")
    out = [model(x[:, s:min(s + 9, 30)], pos[:, s:min(s + 9, 30)], cache) for s in range(0, 30, 9)]
    out += [model(x[:, t:t + 1], pos[:, t:t + 1], cache) for t in range(30, T)]
    return _diff(torch.cat(out, 1)[1], want)


@torch.inference_mode()
def check_policy(make, families=tuple(FAMILIES), progress=None, transformers: bool = False) -> list[dict]:
    """Every path on every family (the compiled step and quantized storage on the first family), and the
    closed form against the per-query rule; with `transformers`, the policy inside transformers' own models too
    (`check_transformers.py`: families "hf llama_gqa", "hf gemma3"). Rows: family, path, max_diff, passed.
    A hook that breaks the protocol (`policies/guard.py`: it raises, returns NaN, a wrong shape or dtype, or
    changes its inputs; or the compiled step cannot hold it) ends the check with a failed row whose `fault`
    names the fault."""
    rows, family = [], "-"
    try:
        rows.append({"family": "-", "path": "accumulate = update per query", "max_diff": check_accumulate(make(T))})
        for i, family in enumerate(families):
            for path, diff in check_paths(make, family, compiled=i == 0, quantized=i == 0):
                rows.append({"family": family, "path": path, "max_diff": diff})
                if progress:
                    progress(rows[-1])
        if transformers:
            from . import check_transformers  # the optional extra, imported only when asked for
            for family in check_transformers.CONFIGS:
                family = f"hf {family}"
                for path, diff in check_transformers.check_paths(make, family[3:], list(TEXT.encode())[:T]):
                    rows.append({"family": family, "path": f"in transformers: {path}", "max_diff": diff})
                    if progress:
                        progress(rows[-1])
    except PolicyFault as e:
        rows.append({"family": family, "path": "the protocol (docs/spec.md)", "max_diff": float("inf"), "fault": str(e)})
        if progress:
            progress(rows[-1])
    for row in rows:
        row["passed"] = row["max_diff"] <= TOL
    return rows
