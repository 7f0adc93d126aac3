"""`h2o-mini bench`: what an eviction policy buys in speed and memory, measured side by side in one process.

For one configuration (policy, budget, batch, prompt and new tokens) it reports prefill seconds, decode
tokens/s (batch x generated tokens / decode seconds; the first new token comes from the prefill), the
KV cache's bytes, and peak memory (max RSS on CPU, the allocator's peak on CUDA). Prompts are slices of
a real text. The decode step is warmed up (and compiled, if asked) on a scratch cache before timing.
"""
from __future__ import annotations

import math
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .api import LM
from .files import read_text
from .errors import UserError, note
from .generate import Decoder, left_pad
from .policies import REGISTRY, make_policy, recent_if_taken

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def text_prompts(lm: LM, text: Path, batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` prompts of `prompt_tokens` tokens each, cut from the text at different offsets (wrapping)."""
    ids = lm.tokenizer.encode(read_text(text), special=False)
    if len(ids) < 2:
        raise UserError(f"text file {text} is too short")
    while len(ids) < prompt_tokens + 97 * batch:
        ids = ids + ids
    return [ids[97 * b: 97 * b + prompt_tokens] for b in range(batch)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@torch.inference_mode()
def bench_one(lm: LM, decoder: Decoder, policy_name: str, budget, batch: int, prompt_tokens: int,
              new_tokens: int, prefill: str = "dense", recent=None, text: Path = DEFAULT_TEXT,
              same_prompt: bool = False) -> dict:
    """One configuration. `same_prompt`: every row gets the same prompt, prefilled once and its cache copied
    into each row; the decode step does exactly the same work per row as with distinct prompts (static
    shapes), so decode tokens/s are unchanged while a long-context prefill costs 1/batch of the time."""
    model = lm.model
    device = next(model.parameters()).device
    length = prompt_tokens + new_tokens
    policy = make_policy(policy_name, budget, length, recent)
    prompts = text_prompts(lm, text, batch, prompt_tokens)
    idx, pos = left_pad(prompts[:1] * batch if same_prompt else prompts, device=device)
    step_pos = pos[:, -1:] + 1
    token = idx[:, -1:]
    scratch = decoder.new_cache(policy, batch, length)  # warm-up (and compilation) on the same shapes
    for i in range(3):
        decoder.step(model, scratch, token, step_pos + i)
    del scratch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    cache = decoder.new_cache(policy, batch, length)
    if same_prompt:
        one = decoder.new_cache(policy, 1, length)
        token = decoder.prefill(one, idx[:1], pos[:1], prefill).argmax(-1, keepdim=True).expand(batch, 1)
        for row, src in zip(cache.layers, one.layers):
            for mine, its in zip(row.tensors(), src.tensors()):
                mine.copy_(its.expand_as(mine))
        del one
    else:
        token = decoder.prefill(cache, idx, pos, prefill).argmax(-1, keepdim=True)  # (B, 1)
    _sync(device)
    t1 = time.perf_counter()
    for i in range(new_tokens - 1):
        token = decoder.step(model, cache, token, step_pos + i).argmax(-1, keepdim=True)
    _sync(device)
    t2 = time.perf_counter()
    return {"policy": policy.name, "budget": budget, "capacity": cache.capacity, "batch": batch,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "prefill": prefill, "same_prompt": same_prompt,
            "prefill_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4),
            "decode_tok_s": rate(batch * (new_tokens - 1), t2 - t1), "kv_bytes": cache.nbytes,
            "kv_bits": cache.kv_bits,
            "peak_mem_bytes": _peak(device), "compiled": decoder.compiled,
            "device": str(device), "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


class _StepClock:
    """A transformers streamer that only notes the time of each `put`: the prompt, then every new token."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def bench_hf(folder: Path, batch: int, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype,
             device: torch.device) -> dict:
    """transformers' own `generate` (greedy, full cache) on the same checkpoint and prompts. The decode
    steps are timed themselves: a streamer stamps the clock as each new token arrives, and the rate is
    batch x (new_tokens - 1) over the time from the first new token to the last (always positive)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise UserError("--vs-hf needs transformers (pip install 'h2o-mini[dev]')") from None
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    x = torch.tensor(prompts, device=device)
    mask = torch.ones_like(x)

    def timed(n: int) -> list[float]:
        clock = _StepClock(device)
        hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                    streamer=clock)
        return clock.times

    timed(2)  # warm-up
    times = timed(new_tokens)  # [prompt, token 1, ..., token n]
    return {"hf_prefill_s": round(times[1] - times[0], 4), "hf_decode_tok_s": rate(batch * (new_tokens - 1),
                                                                                  times[-1] - times[1])}


def rate(count: int, seconds: float) -> float | None:
    """count / seconds, rounded; None where the clock saw no time pass (never negative or infinite)."""
    return round(count / seconds, 3) if seconds > 0 else None


def run_bench(lm: LM, policies, budgets, recent, batch: int, prompt_tokens: int, new_tokens: int, prefill: str,
              text: Path, kv_memory: str | None, max_batch: int, vs_hf: bool, compile: bool, repeat: int = 1,
              same_prompt: bool = False, kv_bits: int | None = None) -> Iterator[dict]:
    """Every policy x budget (full once), one decoder (compiled once) for all; with `kv_memory`, each at the
    largest batch whose cache fits the cap (how the paper's throughput gain arises). With `repeat` > 1 the
    configurations run interleaved that many times and each row reports the median decode tokens/s (the
    machine is shared and noisy: side-by-side ratios need it). kv_bits: 8 or 4 quantize keys and values."""
    cap = parse_bytes(kv_memory) if kv_memory else None
    policies = policies or ("full",)
    if budgets and all(p == "full" for p in policies):
        raise UserError("policy 'full' keeps every token: --budget does not apply to it")
    if recent is not None and not any(REGISTRY[p].takes_recent for p in policies):
        raise UserError(f"--recent does not apply to {', '.join(policies)}")
    budgets = budgets or ("0.2",)
    configs = list(dict.fromkeys((p, None if p == "full" else b) for p in policies for b in budgets))
    length = prompt_tokens + new_tokens
    lm.model.cfg.check_length(length, f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens}")
    decoder = Decoder(lm.model, compile=compile, kv_bits=kv_bits)
    batches = {}
    for policy, budget in configs:  # every configuration checked before the first one runs
        per_row = decoder.cache_bytes(make_policy(policy, budget, length, recent_if_taken(policy, recent)), 1, length)
        batches[policy, budget] = batch if cap is None else min(max_batch, cap // per_row)
        if batches[policy, budget] < 1:
            raise UserError(f"--kv-memory {kv_memory}: one row of {policy} needs {per_row} bytes")
    param = next(lm.model.parameters())
    runs = {config: [] for config in configs}
    for r in range(repeat):
        for (policy, budget), b in batches.items():
            note(f"bench: {policy} budget={budget} batch={b} prompt={prompt_tokens} new={new_tokens} "
                 f"run {r + 1}/{repeat}")
            runs[policy, budget].append(bench_one(lm, decoder, policy, budget, b, prompt_tokens, new_tokens, prefill,
                                                  recent_if_taken(policy, recent), text, same_prompt))
            if r < repeat - 1:
                continue
            row = _median(runs[policy, budget], cap)  # this configuration's last run: its row is ready now
            if vs_hf:
                row.update(bench_hf(lm.folder, b, text_prompts(lm, text, b, prompt_tokens), new_tokens, param.dtype,
                                    param.device))
                both = row["decode_tok_s"] and row["hf_decode_tok_s"]
                row["vs_hf"] = round(row["decode_tok_s"] / row["hf_decode_tok_s"], 3) if both else None
            yield row


def _median(runs: list[dict], cap: int | None) -> dict:
    """The run of one configuration with the median decode rate, and every run's rate."""
    done = sorted(runs, key=lambda row: row["decode_tok_s"] or 0.0)
    row = dict(done[len(done) // 2], decode_tok_s_runs=[x["decode_tok_s"] for x in runs])
    if cap is not None:
        row["kv_memory_cap"] = cap
    return row


def parse_bytes(text: str) -> int:
    """'1000000', '512MB', '2GiB' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        value = float(num) * units[t[len(num):]]
    except (ValueError, KeyError):
        raise UserError(f"--kv-memory {text!r} is not a size (e.g. 1000000, 512MB, 2GiB)") from None
    if not math.isfinite(value) or value < 1:
        raise UserError(f"--kv-memory {text!r} must be positive")
    return int(value)


def table(rows: list[dict]) -> str:
    cols = ["policy", "budget", "capacity", "batch", "prompt_tokens", "new_tokens", "prefill_s", "decode_tok_s",
            "kv_bits", "kv_bytes", "peak_mem_bytes"] + [c for c in ("hf_decode_tok_s", "vs_hf") if c in rows[0]]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([fmt(cols)] + [fmt(row) for row in cells])
