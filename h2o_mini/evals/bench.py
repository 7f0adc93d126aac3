"""`h2o-mini bench`: what an eviction policy buys in speed and memory, measured side by side in one process.

For each configuration (policy, budget, batch, prompt tokens, new tokens) it reports prefill seconds, decode
tokens/s (batch x generated tokens / decode seconds; the first new token comes from the prefill), the KV
cache's bytes, and that configuration's own peak memory: on CUDA the allocator's peak, reset before it; on
CPU the process's peak resident set (Linux `VmHWM`), reset before it by writing 5 to /proc/self/clear_refs
after freed memory has been handed back to the system (None where that reset is not possible). Both count
the weights, the cache and the prefill's temporary tensors (under tensor parallel: rank 0's). Prompts are
slices of a real text. The decode step is warmed up (and compiled, if asked) on a scratch cache before timing.
"""
from __future__ import annotations

import ctypes
import gc
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import LM
from ..errors import UserError, note
from ..generate import Decoder, left_pad
from ..parallel import kv_bytes
from ..policies import budget_if_taken, make_policy, recent_if_taken, resolve
from ..policies.base import refuse_lookahead

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
COLUMNS = {"policy": 12, "budget": 6, "capacity": 8, "batch": 5, "prompt_tokens": 13, "new_tokens": 10,
           "prefill_s": 9, "decode_tok_s": 12, "kv_bits": 7, "kv_bytes": 11, "peak_mem_bytes": 14}


def text_ids(lm: LM, text: str) -> list[int]:
    """The text's token ids, tokenized once for every configuration's prompts."""
    ids = lm.tokenizer.encode(text, special=False)
    if len(ids) < 2:
        raise UserError("the text is too short (fewer than 2 tokens)")
    return ids


def text_prompts(ids: list[int], batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` prompts of `prompt_tokens` tokens each, cut from the ids at different offsets (wrapping)."""
    while len(ids) < prompt_tokens + 97 * batch:
        ids = ids + ids
    return [ids[97 * b: 97 * b + prompt_tokens] for b in range(batch)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: torch.device) -> bool:
    """Start a new peak-memory measurement; False where the platform cannot (then `read_peak` gives None)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the system, so they leave the RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: VmHWM := the current RSS
        return True
    except OSError:
        return False


def read_resident(device: torch.device) -> int | None:
    """Bytes held now: the allocator's on CUDA, the resident set on CPU (what a peak starts from)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except OSError:
        return None


def read_peak(device: torch.device, was_reset: bool) -> int | None:
    """Bytes at the peak since `reset_peak`."""
    if not was_reset:
        return None
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@torch.inference_mode()
def bench_one(model, decoder: Decoder, policy_name: str, budget, prompts: list[list[int]], new_tokens: int,
              prefill: str = "dense", recent=None, same_prompt: bool = False, label: str = "",
              status: dict | None = None) -> dict:
    """One configuration: every prompt a row. `same_prompt`: the first prompt is prefilled once and its cache
    copied into each row; the decode step does exactly the same work per row as with distinct prompts (static
    shapes), so decode tokens/s are unchanged while a long-context prefill costs 1/batch of the time.
    `status["stage"]` says how far it got (what an interrupt reports)."""
    status = {} if status is None else status
    device = next(model.parameters()).device
    batch, prompt_tokens = len(prompts), max(len(p) for p in prompts)
    length = prompt_tokens + new_tokens
    policy = make_policy(policy_name, budget, length, recent)
    idx, pos = left_pad(prompts[:1] * batch if same_prompt else prompts, device=device)
    step_pos = pos[:, -1:] + 1
    token = idx[:, -1:]
    status["stage"] = "warming up" + (" and compiling" if decoder.compiled else "")
    scratch = decoder.new_cache(policy, batch, length, prefill)  # warm-up (and compilation) on the same shapes
    for i in range(3):
        decoder.step(model, scratch, token, step_pos + i)
    del scratch
    was_reset = reset_peak(device)
    before = read_resident(device)  # the weights, the libraries, the interpreter: what the run starts from
    _sync(device)
    t0 = time.perf_counter()
    status["stage"] = f"prefilling {prompt_tokens} tokens x {batch} rows"
    cache = decoder.new_cache(policy, batch, length, prefill)
    if same_prompt:
        one = decoder.new_cache(policy, 1, length, prefill)
        token = decoder.prefill(one, idx[:1], pos[:1]).argmax(-1, keepdim=True).expand(batch, 1)
        for row, src in zip(cache.layers, one.layers):
            for mine, its in zip(row.tensors(), src.tensors()):
                mine.copy_(its.expand_as(mine))
            if row.state is not None:  # a rule's own running state, too
                row.state.copy_(src.state.expand_as(row.state))
        del one
    else:
        token = decoder.prefill(cache, idx, pos).argmax(-1, keepdim=True)  # (B, 1)
    _sync(device)
    t1 = time.perf_counter()
    for i in tqdm(range(new_tokens - 1), desc=label or policy.name, unit="step", disable=None, leave=False):
        status["stage"] = f"decode step {i + 1} of {new_tokens - 1}"
        token = decoder.step(model, cache, token, step_pos + i).argmax(-1, keepdim=True)
    _sync(device)
    t2 = time.perf_counter()
    return {"policy": policy.name, "params": policy.params(), "budget": budget, "capacity": cache.capacity,
            "batch": batch,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "prefill": prefill, "same_prompt": same_prompt,
            "prefill_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4),
            "decode_tok_s": rate(batch * (new_tokens - 1), t2 - t1), **kv_bytes(model, cache.nbytes),
            "kv_bits": cache.kv_bits, "peak_mem_bytes": read_peak(device, was_reset),
            "base_mem_bytes": before if was_reset else None, "compiled": decoder.compiled,
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
             device: torch.device, policy=None) -> dict:
    """transformers' own `generate` (greedy) on the same checkpoint and prompts: with its own full cache, and
    with `policy` (one that evicts) with h2o-mini's evicting cache inside (`transformers_cache.py`: what a user
    of transformers runs). The decode steps are timed themselves: a streamer stamps the clock as each new token
    arrives, and the rate is batch x (new_tokens - 1) over the time from the first new token to the last."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise UserError("--vs-hf needs transformers (pip install 'h2o-mini[hf]')") from None
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    x = torch.tensor(prompts, device=device)
    mask = torch.ones_like(x)

    def timed(n: int, cache=None) -> list[float]:
        clock = _StepClock(device)
        kw = {} if cache is None else {"cache": cache()}
        hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                    streamer=clock, **kw)
        return clock.times

    timed(2)  # warm-up
    times = timed(new_tokens)  # [prompt, token 1, ..., token n]
    out = {"hf_prefill_s": round(times[1] - times[0], 4),
           "hf_decode_tok_s": rate(batch * (new_tokens - 1), times[-1] - times[1])}
    if policy is not None and policy.takes_budget:
        from ..transformers_cache import evicting_cache
        length = x.shape[1] + new_tokens
        timed(2, lambda: evicting_cache(hf, policy, length=length))
        times = timed(new_tokens, lambda: evicting_cache(hf, policy, length=length))
        out["hf_evicting_tok_s"] = rate(batch * (new_tokens - 1), times[-1] - times[1])
    return out


def rate(count: int, seconds: float) -> float | None:
    """count / seconds, rounded; None where the clock saw no time pass (never negative or infinite)."""
    return round(count / seconds, 3) if seconds > 0 else None


def run_bench(lm: LM, policies, budgets, recent, batches, prompt_tokens, new_tokens: int, prefill: str,
              text: str, kv_memory: str | None, max_batch: int, vs_hf: bool, compile: bool, repeat: int = 1,
              same_prompt: bool = False, kv_bits: int | None = None, status: dict | None = None) -> Iterator[dict]:
    """Every prompt length x batch x policy x budget (full once), one decoder (compiled once) for all; each
    row is yielded as soon as its configuration has finished. With `kv_memory`, each configuration runs at the
    largest batch whose cache fits the cap (how the paper's throughput gain arises). With `repeat` > 1 the
    configurations run interleaved that many times and each row reports the median prefill seconds and decode
    tokens/s (the machine is shared and noisy: side-by-side ratios need it) and the highest peak memory.
    kv_bits: 8 or 4 quantize keys and values. batches, prompt_tokens: an int or a sequence of them (a curve).
    `vs_hf`: transformers `generate` runs right after each configuration's run, on the same prompts. text: the
    prompts' source text. `status`: kept up to date with what runs ("label", "stage") and with the runs so far,
    for an interrupt (`unfinished_rows`)."""
    status = {} if status is None else status
    batches = (batches,) if isinstance(batches, int) else tuple(dict.fromkeys(batches))
    lengths = (prompt_tokens,) if isinstance(prompt_tokens, int) else tuple(dict.fromkeys(prompt_tokens))
    cap = parse_bytes(kv_memory) if kv_memory else None
    policies = policies or ("full",)
    if budgets and not any(resolve(p).cls.takes_budget for p in policies):
        raise UserError(f"{', '.join(policies)} keep{'s' if len(policies) == 1 else ''} every token: --budget does "
                        "not apply")
    if recent is not None and not any(resolve(p).cls.takes_recent for p in policies):
        raise UserError(f"--recent does not apply to {', '.join(policies)}")
    if cap is not None and len(batches) > 1:
        raise UserError("--kv-memory chooses each configuration's batch: give no --batch with it")
    budgets = budgets or ("0.2",)
    configs = list(dict.fromkeys((p, budget_if_taken(p, b)) for p in policies for b in budgets))
    for n in lengths:
        lm.model.cfg.check_length(n + new_tokens, f"--prompt-tokens {n} + --new-tokens {new_tokens}")
    decoder = Decoder(lm.model, compile=compile, kv_bits=kv_bits)
    plan = {}  # (prompt tokens, policy, budget, batch) -> the batch it runs at
    for n in lengths:  # every configuration checked before the first one runs; side-by-side ones adjacent
        for b in batches:
            for policy, budget in configs:
                made = make_policy(policy, budget, n + new_tokens, recent_if_taken(policy, recent))
                refuse_lookahead(made)
                per_row = decoder.cache_bytes(made, 1, n + new_tokens)
                plan[n, policy, budget, b] = b if cap is None else min(max_batch, cap // per_row)
                if plan[n, policy, budget, b] < 1:
                    raise UserError(f"--kv-memory {kv_memory}: one row of {policy} needs {per_row} bytes")
    param = next(lm.model.parameters())
    ids = text_ids(lm, text)
    runs = {key: [] for key in plan}
    status.update(runs=runs, yielded=set(), cap=cap, vs_hf=vs_hf)
    for r in range(repeat):
        for key, b in plan.items():
            n, policy, budget, _ = key
            label = f"{policy} budget={budget} batch={b} prompt={n} new={new_tokens}"
            note(f"bench: {label} run {r + 1}/{repeat}")
            status.update(label=label, stage="starting")
            prompts = text_prompts(ids, b, n)
            run = bench_one(lm.model, decoder, policy, budget, prompts, new_tokens, prefill,
                            recent_if_taken(policy, recent), same_prompt, label=f"{policy} {budget or ''}",
                            status=status)
            if vs_hf:  # transformers right after, on the same prompts: interleaved like the configurations
                made = make_policy(policy, budget, n + new_tokens, recent_if_taken(policy, recent))
                run.update(bench_hf(lm.folder, b, prompts, new_tokens, param.dtype, param.device, made))
            runs[key].append(run)
            if r == repeat - 1:  # this configuration's last run: its row is ready now
                status["yielded"].add(key)
                yield _median(runs[key], cap, vs_hf)


def unfinished_rows(status: dict) -> list[dict]:
    """After an interrupt: a row for every configuration with some rounds finished but not all (its `rounds`
    says how many), the medians of those rounds."""
    runs = status.get("runs", {})
    return [_median(r, status["cap"], status["vs_hf"]) for key, r in runs.items()
            if r and key not in status["yielded"]]


def _median(runs: list[dict], cap: int | None, vs_hf: bool = False) -> dict:
    """One configuration's runs as one row: median prefill seconds and decode rates (h2o-mini's and, with
    `vs_hf`, transformers'), the highest peak memory, and every run's decode rate."""
    def median(key):
        values = [x[key] for x in runs]
        return statistics.median(values) if all(v is not None for v in values) else None

    row = dict(runs[-1], prefill_s=round(median("prefill_s"), 4), decode_tok_s=median("decode_tok_s"),
               decode_tok_s_runs=[x["decode_tok_s"] for x in runs], rounds=len(runs))
    if vs_hf:
        row.update(hf_prefill_s=median("hf_prefill_s"), hf_decode_tok_s=median("hf_decode_tok_s"),
                   hf_decode_tok_s_runs=[x["hf_decode_tok_s"] for x in runs])
        if "hf_evicting_tok_s" in runs[-1]:  # the row's policy inside transformers' generate
            row.update(hf_evicting_tok_s=median("hf_evicting_tok_s"),
                       hf_evicting_tok_s_runs=[x["hf_evicting_tok_s"] for x in runs])
        both = row["decode_tok_s"] and row["hf_decode_tok_s"]
        row["vs_hf"] = round(row["decode_tok_s"] / row["hf_decode_tok_s"], 3) if both else None
    peaks = [x["peak_mem_bytes"] for x in runs]
    row["peak_mem_bytes"] = max(peaks) if all(p is not None for p in peaks) else None
    if row["peak_mem_bytes"] is not None:  # what that peak started from (weights, libraries): the rest is the run's
        row["base_mem_bytes"] = runs[peaks.index(row["peak_mem_bytes"])].get("base_mem_bytes")
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


def table_header(vs_hf: bool = False) -> str:
    """The table's header line; `table_row` gives each row's line as it finishes (fixed column widths)."""
    return _line({c: c for c in _columns(vs_hf)}, vs_hf)


def table_row(row: dict, vs_hf: bool = False) -> str:
    return _line(row, vs_hf)


def _columns(vs_hf: bool) -> dict[str, int]:
    return {**COLUMNS, **({"hf_decode_tok_s": 15, "hf_evicting_tok_s": 17, "vs_hf": 6} if vs_hf else {})}


def _line(row: dict, vs_hf: bool) -> str:
    return "  ".join(str("" if row.get(c) is None else row[c]).rjust(w) for c, w in _columns(vs_hf).items())
