"""Scoring a text under eviction: mean next-token NLL, and fidelity to `full` (top-1 agreement, KL).

Every token is scored in `stream` mode, i.e. as if the text were generated one token at a time through the
evicting cache (spec: "Evaluation scores every token under this mode"). The text goes through the model in
chunks: each layer computes q, k, v for the whole chunk at once and runs only the small per-token
eviction loop sequentially (`cache.KVCache._stream`), which equals one token at a time.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .generate import Decoder
from .model import Transformer
from .policies import Policy


@torch.inference_mode()
def score_text(model: Transformer, ids: list[int], policy: Policy, chunk: int = 256,
               compare_full: bool = False, compile: bool = False) -> dict:
    """Mean NLL (nats) of tokens 1..N-1 given their prefixes under `policy`; with `compare_full`, also the
    share of positions whose argmax equals full's (`top1_agree_full`) and mean KL(full || policy)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    T = x.shape[1]
    reference = None
    if compare_full:
        t0 = time.perf_counter()
        reference = model(x, torch.arange(T, device=device)[None])[0, :-1].log_softmax(-1)  # (T-1, V)
        full_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    logprobs, capacity = _logprobs(Decoder(model, compile=compile, chunk=chunk), policy, x)
    seconds = time.perf_counter() - t0
    lp = logprobs[:-1]  # (T-1, V): position i predicts token i+1
    nll = -lp.gather(1, x[0, 1:, None]).mean().item()
    out = {"policy": policy.name, "params": _params(policy), "capacity": capacity, "tokens": T, "nll": nll,
           "ppl": float(torch.tensor(nll).exp()), "seconds": round(seconds, 3)}
    if reference is not None:
        out["top1_agree_full"] = (lp.argmax(-1) == reference.argmax(-1)).float().mean().item()
        out["kl_full"] = (reference.exp() * (reference - lp)).sum(-1).mean().item()
        out["seconds_full"] = round(full_seconds, 3)
    return out


def _logprobs(decoder: Decoder, policy: Policy, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    model, chunk = decoder.model, decoder.chunk
    T = x.shape[1]
    pos = torch.arange(T, device=x.device)[None]
    cache = decoder.new_cache(policy, 1, T)
    if cache.capacity >= T:  # nothing is ever evicted: one causal pass gives the same logits as streaming
        return model(x, pos)[0].log_softmax(-1), cache.capacity
    chunks = tqdm(range(0, T, chunk), desc=f"eval {policy.name}", unit="chunk", disable=None, leave=False)
    parts = [model(x[:, s:s + chunk], pos[:, s:s + chunk], cache, mode="stream")[0].log_softmax(-1) for s in chunks]
    return torch.cat(parts), cache.capacity


def _params(policy: Policy) -> dict:
    return {k: v for k, v in vars(policy).items()}

