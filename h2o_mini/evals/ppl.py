"""Scoring a text under eviction: mean next-token NLL, and fidelity to `full` (top-1 agreement, KL).

Every token is scored in `stream` mode, i.e. as if the text were generated one token at a time through the
evicting cache (spec: "Evaluation scores every token under this mode"). The text goes through the model in
chunks: each layer computes q, k, v for the whole chunk at once and runs only the small per-token
eviction loop sequentially (`prompt.stream`), which equals one token at a time.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from ..api import LM, as_policy, scored_ids
from ..errors import UserError
from .. import wavefront
from ..generate import Decoder, left_pad
from ..model import Transformer
from ..parallel import kv_bytes
from ..policies import Policy, recent_if_taken
from ..policies.base import keeps_all_of
from ..policies.rows import Rows
from ..quant import check_kv_bits
from .hindsight import hindsight_logits
from .memory import rows_that_fit

CHUNK = 128  # tokens a stream chunk reads at once (`wavefront.py`: 128 beat 256 by a third on a 28-point sweep here)


@torch.inference_mode()
def score_text(model: Transformer, ids: list[int], policy: Policy, chunk: int = CHUNK,
               compare_full: bool = False, compile: bool = False, reference: torch.Tensor | None = None,
               progress: bool = True, kv_bits: int | None = None) -> dict:
    """Mean NLL (nats) of tokens 1..N-1 given their prefixes under `policy`; with `compare_full`, also the
    share of positions whose argmax equals full's (`top1_agree_full`) and mean KL(full || policy).
    `reference`: full's log-probs (`full_logprobs`), when a sweep has them already. kv_bits: 8 or 4 quantize
    the cache's keys and values. `kv_bytes`: what the cache holds (for C >= N no cache is needed to score,
    but that is what one would hold)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    T = x.shape[1]
    full_seconds = 0.0
    if compare_full and reference is None:
        t0 = time.perf_counter()
        reference = full_logprobs(model, ids)
        full_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoder = Decoder(model, compile=compile, chunk=chunk, kv_bits=kv_bits)
    if policy.lookahead:  # hindsight: its choices read from a full pass first, then applied as a mask
        if kv_bits:
            raise UserError(f"policy {policy.name!r} is evaluated with keys and values as the model computes them: "
                            "leave out --kv-bits")
        logits = hindsight_logits(model, ids, policy, chunk)
    else:
        logits = read_logits(decoder, policy, [ids])
    slots = decoder.cache_bytes(policy, 1, T)  # hindsight: what a cache of its capacities holds
    chunks = tqdm(logits, total=-(-T // chunk), desc=f"eval {policy.name}", unit="chunk",
                  disable=None if progress else True, leave=False)
    # Each chunk is scored as it comes and dropped: at a 262k vocabulary (Gemma) a (T, V) tensor is GBs.
    sums = torch.zeros(3, dtype=torch.float64)  # NLL, top-1 agreements with full, KL(full || policy)
    for s, logits in chunks:
        for b, e in blocks(s, logits.shape[1], T):
            tally(sums, logits[0, b - s:e - s], x[0, b + 1:e + 1], reference[b:e] if compare_full else None)
    out = result(model, policy, sums, T, time.perf_counter() - t0, decoder.stored_bits, slots, compare_full)
    if compare_full:
        out.update(seconds_full=round(full_seconds, 3))
    return out


@torch.inference_mode()
def score_many(model: Transformer, ids: list[int], policies: list[Policy], reference: torch.Tensor, chunk: int = CHUNK,
               max_batch: int | None = None, progress: bool = True, kv_bits: int | None = None
               ) -> Iterator[tuple[int, dict]]:
    """`score_text(..., compare_full=True)` for every policy, as (index in `policies`, result) when it finishes.
    The policies that evict run up to `max_batch` at a time as the rows of one batch (`policies/rows.py`): the
    text in every row, each row with its own policy and capacities, one pass for all; each row's numbers are
    its policy's run alone (to the rounding of batched matmuls; tested to 1e-5 nats). Those that keep every token
    (full; their slots would widen every row's) or read ahead (hindsight: a pass of its own) run alone. `reference`: full's
    log-probs (`full_logprobs`). A result's `seconds` is its batch's time over its rows (`batch`). max_batch None:
    as many rows as fit in memory (`memory.rows_that_fit`, reported in each result's `memory`)."""
    device = next(model.parameters()).device
    T = len(ids)
    decoder = Decoder(model, chunk=chunk, kv_bits=kv_bits)
    alone = [i for i, p in enumerate(policies) if p.lookahead or keeps_all_of(p, T)]
    for i in alone:
        yield i, score_text(model, ids, policies[i], chunk, True, reference=reference, progress=progress,
                            kv_bits=kv_bits)
    rest = [i for i in range(len(policies)) if i not in alone]
    x = torch.tensor([ids], device=device)
    fit = None
    if max_batch is None and rest:  # the widest row sets every row's slots
        widest = max(min(policies[i].capacity or T, T) for i in rest)
        fit = rows_that_fit(model.cfg, T, widest, chunk, kv_bits, device, next(model.parameters()).dtype)
        max_batch = fit["max_batch"]
    for at in range(0, len(rest), max_batch):
        batch = rest[at:at + max_batch]
        t0, n = time.perf_counter(), len(batch)
        cache = decoder.new_cache(Rows([(policies[i], 1) for i in batch]), n, T, "stream")
        sums = torch.zeros(n, 3, dtype=torch.float64)  # per row: NLL, top-1 agreements, KL(full || policy)
        idx, pos = x.expand(n, -1), torch.arange(T, device=device).expand(n, -1)  # the same tokens in every row
        chunks = read_chunks(model, cache, idx, pos, chunk, head=False)
        for s, h in tqdm(chunks, total=-(-T // chunk), desc=f"eval {n} policies", unit="chunk",
                         disable=None if progress else True, leave=False):
            for b, e in blocks(s, h.shape[1], T):  # the head one row and block at a time: never (n, k, V)
                for r in range(n):
                    tally(sums[r], model.head(h[r, b - s:e - s]), x[0, b + 1:e + 1], reference[b:e])
        seconds = (time.perf_counter() - t0) / n
        for r, i in enumerate(batch):
            slots = decoder.cache_bytes(policies[i], 1, T)
            out = dict(result(model, policies[i], sums[r], T, seconds, decoder.stored_bits, slots), batch=n)
            yield i, out if fit is None else dict(out, memory=fit)


def blocks(start: int, length: int, T: int) -> Iterator[tuple[int, int]]:
    """[b, e) blocks of at most 256 scored positions of the chunk at `start` (position i predicts token i + 1,
    so position T - 1 is never scored)."""
    for b in range(start, min(start + length, T - 1), 256):
        yield b, min(b + 256, start + length, T - 1)


def tally(sums: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None) -> None:
    """Adds one block's NLL, top-1 agreements with full and KL(full || policy) to `sums` (3,) float64.
    logits: (n, V) fp32; targets: (n,) the next tokens; ref: (n, V) full's log-probs, or None."""
    lp = logits.log_softmax(-1)
    sums[0] -= lp.gather(1, targets[:, None]).double().sum()
    if ref is not None:
        sums[1] += (lp.argmax(-1) == ref.argmax(-1)).sum()
        sums[2] += (ref.exp() * (ref - lp)).sum().double()


def result(model, policy: Policy, sums: torch.Tensor, T: int, seconds: float, bits: int, slots: int,
           compare_full: bool = True) -> dict:
    """One policy's numbers from its sums over the T - 1 scored positions. `capacity` is the policy's C, as its
    `params` make it (past the text's T it keeps every token; `kv_bytes` counts what was held)."""
    nll, agree, kl = (sums / (T - 1)).tolist()
    out = {"policy": policy.name, "params": policy.params(), "capacity": policy.capacity or T,
           "tokens": T, "nll": nll, "ppl": float(torch.tensor(nll).exp()), "seconds": round(seconds, 3),
           "kv_bits": bits, **kv_bytes(model, slots)}
    if compare_full:
        out.update(top1_agree_full=agree, kl_full=kl)
    return out


@torch.inference_mode()
def full_logprobs(model: Transformer, ids: list[int]) -> torch.Tensor:
    """(T-1, V): full's next-token log-probs, one causal pass (what `compare_full` compares with)."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    return model(x, torch.arange(x.shape[1], device=x.device)[None])[0, :-1].log_softmax(-1)


def read_logits(decoder: Decoder, policy: Policy, rows: list[list[int]]) -> Iterator[tuple[int, torch.Tensor]]:
    """The logits of left-padded rows read teacher-forced under `policy`, chunk by chunk:
    (start, (B, k, V) fp32). Stream mode, unless C >= the longest row: then nothing is ever evicted and one
    causal pass gives the same logits (through the cache's dense path if it quantizes keys and values, so
    that attention reads them as stored; with no cache at all otherwise)."""
    model, chunk = decoder.model, decoder.chunk
    idx, pos = left_pad(rows, device=next(model.parameters()).device)
    T = idx.shape[1]
    cache = decoder.new_cache(policy, idx.shape[0], T, "stream")
    if not cache.evicts:  # one pass: with the cache if it quantizes (attention reads K and V as stored)
        yield 0, model(idx, pos) if decoder.kv_bits is None else model(idx, pos, cache)
        return
    yield from read_chunks(model, cache, idx, pos, chunk)


def read_chunks(model: Transformer, cache, idx, pos, chunk: int, head: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, the logits of the chunk at start, or without `head` its last layer's output) in order: the loops of
    chunk c at layer l, chunk c-1 at layer l+1, ... as one (`wavefront.py`, tensor parallel too). A model without
    h2o-mini's block stages (`--engine transformers`) reads the chunks in turn."""
    if isinstance(model, Transformer):
        yield from wavefront.read(model, cache, idx, pos, chunk, head)
        return
    forward = model if head else model.hidden
    for s in range(0, idx.shape[1], chunk):
        yield s, forward(idx[:, s:s + chunk], pos[:, s:s + chunk], cache)


def perplexity(lm: LM, text: str, tokens: int, policy: str | Policy = "full", budget=None, recent=None,
               compare_full: bool = False, chunk: int = CHUNK, compile: bool = False, reference=None,
               progress: bool = True, kv_bits: int | None = None) -> dict:
    """eval ppl: NLL and perplexity of the text's first `tokens` tokens under a policy (see score_text)."""
    ids = scored_ids(lm, text, tokens)
    pol = as_policy(policy, budget, tokens, recent)
    return _finite(score_text(lm.model, ids, pol, chunk=chunk, compare_full=compare_full, compile=compile,
                              reference=reference, progress=progress, kv_bits=check_kv_bits(kv_bits)))


def perplexities(lm: LM, text: str, tokens: int, configs: list[tuple], recent=None, chunk: int = CHUNK,
                 max_batch: int | None = None, progress: bool = True, kv_bits: int | None = None) -> Iterator[tuple]:
    """eval sweep ppl: `perplexity(..., compare_full=True)` for every (policy, budget) in `configs`, yielded as
    (config, result) when it finishes; the evicting ones run `max_batch` at a time as the rows of one batched
    pass (`score_many`; None: as many as fit in memory). `recent` reaches only the policies that take it. Every policy is made (and
    checked) before the first pass.

        results = dict(h2o_mini.perplexities(lm, text, 2048, [("h2o", 0.1), ("tova", 0.1), ("local", 0.2)]))
    """
    ids = scored_ids(lm, text, tokens)
    made = [as_policy(p, b, tokens, None if isinstance(p, Policy) else recent_if_taken(p, recent))
            for p, b in configs]
    kv_bits = check_kv_bits(kv_bits)
    if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
        raise UserError(f"--max-batch {max_batch!r} must be an integer >= 1")
    reference = full_logprobs(lm.model, ids)
    for i, result in score_many(lm.model, ids, made, reference, chunk, max_batch, progress, kv_bits):
        yield configs[i], _finite(result)


def _finite(result: dict) -> dict:
    if not all(math.isfinite(v) for v in result.values() if isinstance(v, float)):
        raise UserError(f"the model gave non-finite log-probabilities on this text ({result})")
    return result
