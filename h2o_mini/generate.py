"""Prefill, the decode step, sampling and the generation loop (gpt-fast's shape, with an evicting cache).

* Prompts of different lengths are left-padded into one batch; padding gets negative positions, so it is
  never inserted into the cache and never attended.
* The cache is allocated once, before the prompt, with C slots per (layer, row, KV head).
* The decode step has static shapes: token (B, 1), positions (B, 1) as tensors advanced on the device, the
  eviction inside the graph. It can be compiled with `fullgraph=True` (`Decoder(compile=True)`).
* Sampling uses the exponential-race trick (argmax of p / Exp(1) noise), so no host sync per token; the
  host looks at the tokens only to stream them and, every few steps, to stop when every row has ended.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from .cache import KVCache
from .errors import UserError
from .model import Transformer
from .policies import Policy
from .policies.base import refuse_lookahead
from .policies.guard import PolicyFault


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
        if not number(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature {self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise UserError(f"top_k {self.top_k!r} must be an integer >= 0 (0 = off)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise UserError(f"top_p {self.top_p!r} must be in (0, 1] (1 = off)")


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, V) fp32 -> next tokens (B,) int64, without a host sync. A draw is argmax(p / E) with E ~ Exp(1)
    per token (the exponential race, Gumbel-max's twin); `noise`, (B, V), gives the E's instead of `generator`."""
    if s.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k > 0:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = logits.softmax(-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > s.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    if noise is None:
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


def decode_step(model: Transformer, cache: KVCache, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One token per row through every layer, evicting inside the cache. token, pos: (B, 1). -> (B, V)."""
    return model(token, pos, cache)[:, -1]


def run_block(block, x, pos, rope, layer_cache) -> torch.Tensor:
    return block(x, pos, rope, layer_cache)


def layerwise_decode_step(block_fn, model: Transformer, cache: KVCache, token, pos) -> torch.Tensor:
    """`decode_step` with every block run by `block_fn`: a compiled `run_block`, one graph for all layers."""
    x, ropes = model.embed(token, pos)
    for block, layer_cache, rope in zip(model.layers, cache.layers, ropes):
        x = block_fn(block, x, pos, rope, layer_cache)
    return model.head(x)[:, -1]


def allow_recompiles(limit: int = 64) -> None:
    """One process may compile the step for many policies and cache shapes (bench, sweeps): each is one more
    compilation of the same function, and dynamo's default limit (8) would make the ninth an error."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(config, name, max(getattr(config, name), limit))


def refuse_endless_recompiles(step):
    """The compiled `step`, where dynamo gives up recompiling it as one line: a hook that reads Python state
    which changes between calls (a counter, an unseeded draw) makes every call a new graph."""
    exc = torch._dynamo.exc
    limit_hit = getattr(exc, "FailOnRecompileLimitHit", None) or getattr(exc, "FailOnCacheLimitHit", RuntimeError)

    def run(*args):
        try:
            return step(*args)
        except limit_hit:
            raise PolicyFault("the compiled decode step was compiled again at every call: a hook of the policy "
                              "reads Python state that changes between calls, which a compiled step cannot hold "
                              "(a hook is pure tensor code, docs/spec.md; or run without --compile)") from None
    return run


def left_pad(prompts: list[list[int]], pad_id: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, pos), both (B, T): prompts right-aligned; padding has token `pad_id` and a negative position."""
    T = max(len(p) for p in prompts)
    idx = torch.tensor([[pad_id] * (T - len(p)) + list(p) for p in prompts], device=device)
    pos = torch.arange(T, device=device)[None, :] - torch.tensor([T - len(p) for p in prompts], device=device)[:, None]
    return idx, pos


class Decoder:
    """Runs prefill and decoding for one model; holds the (optionally compiled) decode step."""

    def __init__(self, model: Transformer, compile: bool | str = False, chunk: int = 256, kv_bits: int | None = None):
        """compile: False (eager), "step" (the whole decode step as one graph; CUDA graphs on a GPU), "layer"
        (one compiled graph that every block reuses), or True: "step" on CUDA, "layer" on CPU, where
        inductor takes over 15 minutes on the 30-layer graph of the default model and ~30 s on one block.
        kv_bits: None (keys and values in the model's dtype), 8 or 4 (quantized; see `quant.py`)."""
        cuda = next(model.parameters()).is_cuda
        self.model, self.chunk, self.kv_bits = model, chunk, kv_bits
        self.stored_bits = kv_bits or torch.finfo(next(model.parameters()).dtype).bits  # bits per key/value element
        self.compiled = ("step" if cuda else "layer") if compile is True else compile
        # Compiled once per Decoder and kept on it (no global reassignment); shapes are static per cache.
        if compile:
            allow_recompiles()
        if self.compiled == "step":
            mode = "reduce-overhead" if cuda else None  # CUDA graphs on GPU
            self.step = refuse_endless_recompiles(torch.compile(decode_step, fullgraph=True, mode=mode))
        elif self.compiled == "layer":
            block = torch.compile(run_block, fullgraph=True, dynamic=False)
            self.step = refuse_endless_recompiles(partial(layerwise_decode_step, block))
        else:
            self.step = decode_step
        # With `compile`, the caches' stream loop body is fused into one kernel too. (On this project's CPUs it
        # does not pay: a compiled call costs ~80 us of guards and wrappers, about what its tiny eager ops cost.)
        self.compile_loop = bool(compile)

    def new_cache(self, policy: Policy, batch: int, length: int, prefill: str = "dense") -> KVCache:
        """A cache for `batch` rows of up to `length` tokens; prefill: how it reads a prompt ("dense" / "stream")."""
        refuse_lookahead(policy)  # every command that runs a policy causally builds its cache here
        p = next(self.model.parameters())
        return KVCache(self.model.cfg, policy, batch, length, dtype=p.dtype, device=p.device, prefill=prefill,
                       kv_bits=self.kv_bits, compile=self.compile_loop)

    def cache_bytes(self, policy: Policy, batch: int, length: int) -> int:
        """What `new_cache` would hold, in bytes, without allocating it (a cache on the meta device)."""
        p = next(self.model.parameters())
        return KVCache(self.model.cfg, policy, batch, length, dtype=p.dtype, device="meta", kv_bits=self.kv_bits).nbytes

    def prefill(self, cache: KVCache, idx: torch.Tensor, pos: torch.Tensor, head: bool = True) -> torch.Tensor:
        """Run the prompts into the cache; returns the last position's logits (B, V), or without `head` its last
        layer's output (B, d_model) (a caller that takes the head a row at a time).

        A `stream` cache takes the prompt in chunks through the per-token rule; a `dense` one in one pass."""
        chunk = idx.shape[1] if cache.prefill == "dense" else self.chunk
        for s in range(0, idx.shape[1], chunk):
            x = self.model.hidden(idx[:, s:s + chunk], pos[:, s:s + chunk], cache)
        x = x[:, -1:]  # (B, 1, d_model)
        return (self.model.head(x) if head else x)[:, -1]

    def complete(self, prompt: list[int], policy: Policy, max_new_tokens: int, prefill: str = "dense",
                 eos_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """One prompt, greedily: its new token ids, one at a time, up to (not including) the first EOS."""
        for token in self.generate([prompt], policy, max_new_tokens, prefill, eos_ids=eos_ids):
            t = int(token[0])
            if t in eos_ids:
                return
            yield t

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], policy: Policy, max_new_tokens: int, prefill: str = "dense",
                 sampling: Sampling = Sampling(), eos_ids: tuple[int, ...] = (), seed: int | None = None,
                 check_every: int = 8, noise=None) -> Iterator[torch.Tensor]:
        """Yields the next token of every row, (B,) on the model's device, `max_new_tokens` times at most.
        Rows that ended keep producing tokens until all have ended; callers cut at the first EOS. noise(i, logits)
        gives the draws of token i, (B, V), where they must not depend on a row's place in the batch (eval
        generate's coupled sampling); otherwise they come from one generator seeded with `seed`."""
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        idx, pos = left_pad(prompts, device=device)
        length = idx.shape[1] + max_new_tokens
        cache = self.new_cache(policy, idx.shape[0], length, prefill)
        draw = (lambda i, logits: None) if noise is None else noise  # noqa: E731
        logits = self.prefill(cache, idx, pos)
        token = sample(logits, sampling, gen, draw(0, logits))
        pos = pos[:, -1:] + 1  # (B, 1) next original position of every row
        eos = torch.tensor(eos_ids or (-1,), device=device)
        done = torch.isin(token, eos)
        for i in range(max_new_tokens):
            yield token
            if i == max_new_tokens - 1 or (i % check_every == check_every - 1 and bool(done.all())):
                return
            logits = self.step(self.model, cache, token[:, None], pos)
            token = sample(logits, sampling, gen, draw(i + 1, logits))
            pos = pos + 1
            done |= torch.isin(token, eos)
