"""Needle in a haystack under eviction (`h2o-mini eval needle`).

A random number is planted in a sentence ("The secret number is 481923.") at a relative depth of real filler
text; the question comes last; the answer is generated greedily and `found` says whether it holds the
number. The prompt is wrapped in the checkpoint's chat template when it has one (else it ends with the start of
the answer, which a base model completes), and is exactly `length` tokens long. The two prefill modes ask different questions of a policy: with `dense` it chooses what to
keep after reading the question; with `stream` it must evict before the question arrives.
(Kamradt, 2023, "Needle in a haystack"; the policy comparison follows RULER's single-needle task,
Hsieh et al., 2024, arXiv 2404.06654.)
"""
from __future__ import annotations

import random
from collections.abc import Iterator

from tqdm import tqdm

from ..api import LM
from ..policies import make_policy
from ..errors import UserError
from ..generate import Decoder

NEEDLE = " The secret number is {n}. "
QUESTION = "\n\nWhat is the secret number in the text above? Answer with the number only."
# A base model (no chat template) continues text rather than answering: it is given the answer's start
ANSWER_START = "\n\nThe secret number in the text above is"
ANSWER_TOKENS = 24


def parts(lm: LM, chat: bool | None) -> tuple[list[int], list[int]]:
    """The token ids that come before the user's text and after it: the chat template's, when used; else the BOS
    (where the tokenizer adds one) and the start of the answer, for the model to complete."""
    tok = lm.tokenizer
    if chat is False or (chat is None and not tok.chat_template):
        return tok.encode(""), tok.encode(ANSWER_START, special=False)
    marker = "\u2063"  # a character no template contains: where the user's text goes
    before, after = tok.apply_chat_template(marker).split(marker)
    return tok.encode(before, special=False), tok.encode(after, special=False)


def haystack(lm: LM, filler: list[int], length: int, depth: float, number: int, chat: bool | None = None):
    """A prompt of exactly `length` tokens: the filler with the needle at `depth` (moved to the nearest
    sentence end, except at 0 and 1), then the question. Returns the ids and the needle's token position."""
    before, after = parts(lm, chat)
    needle = lm.tokenizer.encode(NEEDLE.format(n=number), special=False)
    question = lm.tokenizer.encode(QUESTION, special=False)
    room = length - len(before) - len(needle) - len(question) - len(after)
    if room < 1:
        raise UserError(f"--lengths {length} leaves no room for filler text (the question alone takes "
                        f"{length - room} tokens)")
    if room > len(filler):
        raise UserError(f"--lengths {length} is longer than the filler text ({len(filler)} tokens)")
    target = round(depth * room)
    ends = [j for j in range(1, room) if lm.tokenizer.decode(filler[j - 1:j]).rstrip().endswith(".")]
    at = min(ends, key=lambda j: abs(j - target)) if ends and 0 < target < room else target
    ids = before + filler[:at] + needle + filler[at:room] + question + after
    return ids, len(before) + at


def run_needle(lm: LM, text: str, lengths: list[int], depths: list[float], seeds: int, policies: list[tuple],
               prefill: str, chat: bool | None = None, compile: bool = False,
               progress: bool = True, kv_bits: int | None = None) -> Iterator[dict]:
    """One cell per (policy, budget) x length x depth x seed; policies: (name, budget, recent) triples."""
    for d in depths:
        if not 0 <= d <= 1:
            raise UserError(f"--depths: {d} is outside [0, 1]")
    cfg = lm.model.cfg
    filler = lm.tokenizer.encode(text, special=False)
    for n in lengths:  # every length and budget checked before the first cell runs
        if n + ANSWER_TOKENS > cfg.max_seq_len:
            raise UserError(f"--lengths {n} + {ANSWER_TOKENS} answer tokens is past the model's "
                            f"{cfg.max_seq_len} positions")
        haystack(lm, filler, n, 0.5, 100000, chat)
    for name, budget, recent in policies:
        for n in lengths:  # each checked (and a budget that rounds to one token said) before the first cell
            make_policy(name, budget, n + ANSWER_TOKENS, recent)
    decoder = Decoder(lm.model, compile=compile, kv_bits=kv_bits)
    bar = tqdm(total=len(lengths) * len(depths) * seeds * len(policies), desc="needle", unit="cell",
               disable=None if progress else True)
    for length in lengths:
        for depth in depths:
            for seed in range(seeds):
                number = random.Random(f"{length}-{depth}-{seed}").randrange(100000, 1000000)
                ids, at = haystack(lm, filler, length, depth, number, chat)
                for name, budget, recent in policies:
                    policy = make_policy(name, budget, length + ANSWER_TOKENS, recent, quiet=True)
                    tokens = list(decoder.complete(ids, policy, ANSWER_TOKENS, prefill, lm.eos_ids))
                    answer = lm.tokenizer.decode(tokens).strip()
                    yield {"policy": name, "params": policy.params(), "budget": budget,
                           "capacity": policy.capacity or length + ANSWER_TOKENS,
                           "kv_bits": decoder.stored_bits,
                           "kv_bytes": decoder.cache_bytes(policy, 1, length + ANSWER_TOKENS),
                           "prefill": prefill, "length": length, "depth": depth, "seed": seed,
                           "needle_position": at, "number": number, "found": str(number) in answer,
                           "answer": answer}
                    bar.update()
    bar.close()
