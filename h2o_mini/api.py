"""The Python API: load a checkpoint, generate under a policy, score a text.

    import h2o_mini
    lm = h2o_mini.load()                                   # the default model (SmolLM2-135M-Instruct)
    print(h2o_mini.generate(lm, "The capital of France is", policy=h2o_mini.H2O(heavy=16, recent=16)))
    print(h2o_mini.generate(lm, ["a", "bb"], policy="h2o", budget=0.2, max_new_tokens=32))
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError
from .evaluate import score_text
from .generate import Decoder, Sampling
from .model import Transformer
from .policies import Policy, make_policy
from .tokenizer import Tokenizer
from .weights.default import prepare_default_model
from .weights.hf import load_hf

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LM:
    model: Transformer
    tokenizer: Tokenizer
    folder: Path

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model.cfg.eos_token_id)
        tok_eos = self.tokenizer.token_id(self.tokenizer.special.get("eos_token"))
        return tuple(sorted(ids | ({tok_eos} if tok_eos is not None else set())))


def resolve_model(model: str | Path | None) -> Path:
    """'default' or None -> the converted default model (prepared on first use); else the folder itself."""
    if model is None or str(model) == "default":
        return prepare_default_model(log=lambda msg: print(msg, file=sys.stderr))
    return Path(model)


def load(model: str | Path | None = None, dtype: str = "float32", device: str = "cpu") -> LM:
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but no CUDA device is available")
    folder = resolve_model(model)
    lm = load_hf(folder, DTYPES[dtype], device)
    return LM(lm, Tokenizer(folder), folder)


def as_policy(policy: str | Policy, budget, length: int, recent=None) -> Policy:
    return policy if isinstance(policy, Policy) else make_policy(policy, budget, length, recent)


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents, or a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"text file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"text file {path} is not UTF-8") from None


def encode_prompts(lm: LM, prompts: list[str], chat: bool = False) -> list[list[int]]:
    if chat:
        return [lm.tokenizer.encode(lm.tokenizer.apply_chat_template(p), special=False) for p in prompts]
    ids = [lm.tokenizer.encode(p) for p in prompts]
    if any(len(i) == 0 for i in ids):
        raise UserError("a prompt is empty (it encodes to no tokens)")
    return ids


def stream(lm: LM, prompts: list[str], policy: str | Policy = "full", budget=None, recent=None,
           max_new_tokens: int = 64, prefill: str = "dense", sampling: Sampling = Sampling(),
           seed: int | None = None, chat: bool = False, compile: bool = False) -> Iterator[list[list[int]]]:
    """After every decode step, the new token ids of every row so far, each cut at its first EOS."""
    ids = encode_prompts(lm, prompts, chat)
    pol = as_policy(policy, budget, max(len(i) for i in ids) + max_new_tokens, recent)
    rows, ended = [[] for _ in ids], [False] * len(ids)
    for token in Decoder(lm.model, compile=compile).generate(ids, pol, max_new_tokens, prefill, sampling,
                                                             lm.eos_ids, seed):
        for r, t in enumerate(token.tolist()):
            ended[r] = ended[r] or t in lm.eos_ids
            if not ended[r]:
                rows[r].append(t)
        yield rows


def generate(lm: LM, prompts: str | list[str], policy: str | Policy = "full", budget=None, recent=None,
             max_new_tokens: int = 64, prefill: str = "dense", sampling: Sampling = Sampling(),
             seed: int | None = None, chat: bool = False, compile: bool = False) -> str | list[str]:
    """Completions (text after each prompt, cut at the first EOS). One string in, one string out."""
    single = isinstance(prompts, str)
    rows = [[] for _ in ([prompts] if single else prompts)]
    for rows in stream(lm, [prompts] if single else prompts, policy, budget, recent, max_new_tokens, prefill,
                       sampling, seed, chat, compile):
        pass
    texts = [lm.tokenizer.decode(r) for r in rows]
    return texts[0] if single else texts


def perplexity(lm: LM, text: str, tokens: int, policy: str | Policy = "full", budget=None, recent=None,
               compare_full: bool = False, chunk: int = 256, compile: bool = False) -> dict:
    ids = lm.tokenizer.encode(text)
    if tokens > len(ids):
        raise UserError(f"--tokens {tokens} is larger than the text ({len(ids)} tokens)")
    if tokens < 2:
        raise UserError("--tokens must be at least 2 (one prediction)")
    pol = as_policy(policy, budget, tokens, recent)
    return score_text(lm.model, ids[:tokens], pol, chunk=chunk, compare_full=compare_full, compile=compile)
