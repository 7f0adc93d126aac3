"""The Python API: load a checkpoint, generate under a policy, score a text.

    import h2o_mini
    lm = h2o_mini.load()                                   # the default model (SmolLM2-135M-Instruct)
    print(h2o_mini.generate(lm, "The capital of France is", policy=h2o_mini.H2O(heavy=16, recent=16)))
    print(h2o_mini.generate(lm, ["a", "bb"], policy="h2o", budget=0.2, max_new_tokens=32))
"""
from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError, note
from .generate import Decoder, Sampling
from .model import Transformer
from .parallel import Shard, common_seed
from .policies import Policy, make_policy
from .quant import check_kv_bits
from .tokenizer import Tokenizer
from .weights.prepared import MODELS, names, prepare_model
from .weights.hf import load_hf

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
PREFILL = ("dense", "stream")


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
    """A prepared model's name ('default' or None, 'gemma3-270m') -> its converted folder (prepared on first
    use); else the folder itself."""
    if model is None or str(model) in MODELS:
        return prepare_model(str(model or "default"), log=note)
    folder = Path(model).expanduser()
    if not folder.exists():
        hub = " (a model hub id? nothing is downloaded from hubs)" if re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)) else ""
        raise UserError(f"--model {model} does not exist as a folder here{hub}: h2o-mini runs offline from a local "
                        f"checkpoint folder (config.json, *.safetensors, tokenizer files), or prepares one by name: "
                        f"{names()}")
    return folder


def check_device(device: str) -> str:
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"unknown device {device!r} (choose cpu, cuda or cuda:N)")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device} asked for, but no CUDA device is available")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    return device


ENGINES = ("h2o-mini", "transformers")


def load(model: str | Path | None = None, dtype: str = "float32", device: str = "cpu",
         shard: Shard | None = None, engine: str = "h2o-mini") -> LM:
    """shard: this rank's place under tensor parallelism (`parallel.from_env()` under torchrun): the model then
    holds only its slice of the heads and the MLP, and so will every cache made for it. engine: what computes the
    model, h2o-mini's decoder or "transformers" (`transformers_engine.py`: its AutoModelForCausalLM, the same
    h2o-mini cache inside; needs the `hf` extra)."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    check_device(device)
    folder = resolve_model(model)
    if engine == "transformers":
        if shard is not None:
            raise UserError("tensor parallel runs h2o-mini's decoder: leave out --engine transformers under torchrun")
        if importlib.util.find_spec("transformers") is None:
            raise UserError("--engine transformers needs transformers: pip install 'h2o-mini[hf]'")
        from .transformers_engine import load_transformers  # the optional extra, imported only here
        lm = load_transformers(folder, DTYPES[dtype], device)
    else:
        lm = load_hf(folder, DTYPES[dtype], shard.device(device) if shard else device, shard)
    tokenizer = Tokenizer(folder)
    if tokenizer.vocab_size > lm.cfg.vocab_size:
        raise UserError(f"{folder}: the tokenizer has {tokenizer.vocab_size} ids but the model only "
                        f"{lm.cfg.vocab_size} embeddings")
    return LM(lm, tokenizer, folder)


def as_policy(policy: str | Policy, budget, length: int, recent=None) -> Policy:
    if isinstance(policy, Policy):
        if budget is not None or recent is not None:
            raise UserError("give either a Policy object or budget/recent with a policy name, not both")
        return policy
    return make_policy(policy, budget, length, recent)


def encode_prompts(lm: LM, prompts: list[str], chat: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt. chat: wrap each in the checkpoint's chat template; None: when it has one
    (an instruct model answers a bare prompt with its end token at once)."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise UserError("give at least one prompt (a string, or a non-empty list of strings)")
    for p in prompts:
        if not isinstance(p, str):
            raise UserError(f"a prompt must be a string, not {type(p).__name__}")
        if not p.strip():
            raise UserError("a prompt is empty or only whitespace")
    if chat is None:
        chat = bool(lm.tokenizer.chat_template)
    if chat:
        return [lm.tokenizer.encode(lm.tokenizer.apply_chat_template(p), special=False) for p in prompts]
    return [lm.tokenizer.encode(p) for p in prompts]


def room_for(lm: LM, prompt_len: int, max_new_tokens: int) -> int:
    """`max_new_tokens`, capped so that the sequence fits the model's positions (said in one line), so no
    cache is ever allocated past what the model can place. A prompt that already fills them is the
    model's `check_length` call: refused for learned positions, a warning for RoPE."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise UserError(f"max_new_tokens {max_new_tokens!r} must be an integer >= 1")
    cfg = lm.model.cfg
    room = cfg.max_seq_len - prompt_len
    if room < 1:
        cfg.check_length(prompt_len + max_new_tokens, f"a prompt of {prompt_len} tokens")
        return max_new_tokens
    if max_new_tokens > room:
        note(f"h2o-mini: note: generating at most {room} new tokens, not {max_new_tokens}: the model "
             f"places {cfg.max_seq_len} positions and the prompt takes {prompt_len}")
    return min(max_new_tokens, room)


def stream(lm: LM, prompts: list[str], policy: str | Policy = "full", budget=None, recent=None,
           max_new_tokens: int = 64, prefill: str = "dense", sampling: Sampling = Sampling(),
           seed: int | None = None, chat: bool | None = None, compile: bool = False,
           kv_bits: int | None = None) -> Iterator[list[list[int]]]:
    """After every decode step, the new token ids of every row so far, each cut at its first EOS.
    In a batch, a fractional budget is taken of the longest row (longest prompt + max_new_tokens), so every
    row gets the same C; give a token count to make C independent of the other prompts. kv_bits: 8 or 4
    store keys and values quantized (see `quant.py`)."""
    if prefill not in PREFILL:
        raise UserError(f"unknown prefill mode {prefill!r} (choose from {', '.join(PREFILL)})")
    if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise UserError(f"seed {seed!r} must be an integer in [0, 2**63)")
    ids = encode_prompts(lm, prompts, chat)
    longest = max(len(i) for i in ids)
    max_new_tokens = room_for(lm, longest, max_new_tokens)
    pol = as_policy(policy, budget, longest + max_new_tokens, recent)
    rows, ended = [[] for _ in ids], [False] * len(ids)
    decoder = Decoder(lm.model, compile=compile, kv_bits=check_kv_bits(kv_bits))
    seed = common_seed(seed, lm.model.shard)  # every tensor-parallel rank samples the same tokens
    for token in decoder.generate(ids, pol, max_new_tokens, prefill, sampling, lm.eos_ids, seed):
        for r, t in enumerate(token.tolist()):
            ended[r] = ended[r] or t in lm.eos_ids
            if not ended[r]:
                rows[r].append(t)
        yield rows


def generate(lm: LM, prompts: str | list[str], policy: str | Policy = "full", budget=None, recent=None,
             max_new_tokens: int = 64, prefill: str = "dense", sampling: Sampling = Sampling(),
             seed: int | None = None, chat: bool | None = None, compile: bool = False,
             kv_bits: int | None = None) -> str | list[str]:
    """Completions (text after each prompt, cut at the first EOS). One string in, one string out.
    chat=None wraps prompts in the checkpoint's chat template when it has one; False feeds them raw."""
    single = isinstance(prompts, str)
    rows = []
    for rows in stream(lm, [prompts] if single else prompts, policy, budget, recent, max_new_tokens, prefill,
                       sampling, seed, chat, compile, kv_bits):
        pass
    texts = [lm.tokenizer.decode(r) for r in rows]
    return texts[0] if single else texts


def scored_ids(lm: LM, text: str, tokens: int) -> list[int]:
    """The first `tokens` token ids of a text, checked against the text and the model's positions."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
        raise UserError(f"--tokens {tokens!r} must be an integer >= 2 (one prediction)")
    ids = lm.tokenizer.encode(text)
    if tokens > len(ids):
        raise UserError(f"--tokens {tokens} is larger than the text ({len(ids)} tokens)")
    lm.model.cfg.check_length(tokens, f"--tokens {tokens}")
    return ids[:tokens]
