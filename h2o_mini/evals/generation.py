"""What eviction does to the text a model writes (`h2o-mini eval generate`).

Perplexity, tasks and the needle measure how a policy reads a given text. A long answer is different: the cache
grows while the model writes, every token evicted is gone for the rest of the answer, and each written token is
read back by the next ones. Following the decode-time evaluations of the field (kvpress's decoding presses on
long reasoning outputs, 2025-26; R-KV, Cai et al., 2025, arXiv 2505.24133), for each prompt:

1. the **reference**: N new tokens, greedily, with the full cache (past an end token too, so every prompt has N);
2. **teacher-forced fidelity**: the prompt, then the reference read back token by token through the policy's
   cache (the prompt in the `--prefill` mode, then the decode-time rule for every reference token); the mean NLL
   of the reference tokens and the mean KL(full || policy) of the next-token distributions along it;
3. **free-running divergence**: the policy's own greedy N tokens: how many equal the reference before the first
   difference (`agree_tokens`), and the share of positions where they are equal (`agree_share`);
4. **cost**: the bytes of the cache (C slots per layer, row and KV head, allocated up front, so the end is the
   peak), beside full's.

A budget fraction is taken of prompt + N (each prompt's own length; a token count is the same for all).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import LM, encode_prompts
from ..errors import UserError
from ..generate import Decoder, left_pad
from ..policies import Policy, make_policy, parse_budget

# Instructions that ask for long answers, written for this project; a base model gets each as plain text.
BUILTIN = (
    "Write a long story, in many paragraphs, about a lighthouse keeper who finds a message in a bottle.",
    "List fifty different animals, one per line, each with a sentence about where it lives.",
    "Count from one to two hundred in words, separated by commas.",
    "Explain, section by section and in detail, what a software licence such as the GNU GPL allows and requires.",
)


@dataclass
class Prompts:
    name: str  # "builtin" or the file's name: what a row records
    texts: list[str]


def check_room(lm: LM, ids: list[list[int]], new_tokens: int) -> None:
    """N must fit the model's positions after the longest prompt: a long-generation measure is never cut short."""
    longest, limit = max(len(i) for i in ids), lm.model.cfg.max_seq_len
    if longest + new_tokens > limit:
        raise UserError(f"--max-new-tokens {new_tokens} after a prompt of {longest} tokens needs "
                        f"{longest + new_tokens} positions; the model has {limit}")


def policy_for(spec, budget, length: int, recent) -> Policy:
    """The policy for one prompt of `length` tokens (prompt + N); a fraction that rounds to no token is refused."""
    if budget is not None:
        share = parse_budget(budget)
        if isinstance(share, float) and share * length < 0.5:
            raise UserError(f"--budget {budget} of {length} tokens (prompt + --max-new-tokens) rounds to no token")
    return make_policy(spec, budget, length, recent, quiet=True)


@torch.inference_mode()
def teacher_forced(decoder: Decoder, policy: Policy, ids: list[list[int]], ref: torch.Tensor, prefill: str,
                   chunk: int = 64):
    """Yields (start, logits (B, k, V)) of the reference tokens ref[:, start:start+k] read under `policy`, after
    the prompts (left-padded rows): the prompts in `prefill` mode, then the reference in stream mode (the decode
    step's rule, a chunk at a time: equal by the cache's parity tests)."""
    idx, pos = left_pad(ids, device=ref.device)
    N = ref.shape[1]
    cache = decoder.new_cache(policy, len(ids), idx.shape[1] + N)
    yield 0, decoder.prefill(cache, idx, pos, prefill)[:, None]  # (B, 1, V): predicts ref[:, 0]
    start = pos[:, -1:] + 1  # (B, 1): each row's next position
    for s in range(0, N - 1, chunk):
        e = min(N - 1, s + chunk)
        positions = start + torch.arange(s, e, device=ref.device)[None]
        yield s + 1, decoder.model(ref[:, s:e], positions, cache, mode="stream")  # predicts ref[:, s+1..e]


def fidelity(decoder: Decoder, full: Policy, policy: Policy, ids: list[list[int]], ref: torch.Tensor, prefill: str):
    """Per row: the mean NLL of the reference under `policy`, and the mean KL(full || policy) along it (full read
    the same way, chunk by chunk beside it: no (B, N, V) tensor is held)."""
    nll = torch.zeros(len(ids), dtype=torch.float64)
    kl = torch.zeros(len(ids), dtype=torch.float64)
    for (s, mine), (_, theirs) in zip(teacher_forced(decoder, policy, ids, ref, prefill),
                                      teacher_forced(decoder, full, ids, ref, prefill)):
        lp, lq = mine.log_softmax(-1), theirs.log_softmax(-1)  # (B, k, V)
        target = ref[:, s:s + lp.shape[1]]
        nll -= lp.gather(2, target[..., None])[..., 0].double().sum(1).cpu()
        kl += (lq.exp() * (lq - lp)).sum((1, 2)).double().cpu()
    return (nll / ref.shape[1]).tolist(), (kl / ref.shape[1]).tolist()


@torch.inference_mode()
def greedy(decoder: Decoder, policy: Policy, ids: list[list[int]], new_tokens: int, prefill: str) -> torch.Tensor:
    """(B, N): each prompt's greedy continuation under `policy` (rows of one batch share it; they never interact).
    Under `full` it is the reference; under the policy evaluated, its free-running text."""
    return torch.stack(list(decoder.generate(ids, policy, new_tokens, prefill)), 1)


def divergence(mine: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    """Tokens equal to the reference before the first difference, and the share of equal positions."""
    same = (mine == ref).tolist()
    first = same.index(False) if False in same else len(same)
    return first, sum(same) / len(same)


def evaluate(lm: LM, prompts: Prompts, new_tokens: int, spec: str, budget, recent=None, prefill: str = "dense",
             chat: bool | None = None, kv_bits: int | None = None, refs: dict | None = None) -> dict:
    """One JSON row: `spec` at `budget` over every prompt (per-prompt numbers in `prompts`, means at the top).
    refs: the references already made for these prompts (filled on first use), so a sweep makes them once."""
    ids = encode_prompts(lm, prompts.texts, chat)
    check_room(lm, ids, new_tokens)
    decoder = Decoder(lm.model, kv_bits=kv_bits)
    plain = Decoder(lm.model)  # the reference is the full cache as the model computes it
    full = make_policy("full", None, 1)
    if refs is not None and "tokens" in refs:
        ref = refs["tokens"]
    else:
        ref = greedy(plain, full, ids, new_tokens, prefill)
        if refs is not None:
            refs["tokens"] = ref
    # Rows of one batch share C; a fraction is each prompt's own, so rows with equal C run together.
    policies = [policy_for(spec, budget, len(i) + new_tokens, recent) for i in ids]
    mine = torch.empty_like(ref)
    nll, kl = [0.0] * len(ids), [0.0] * len(ids)
    for policy in dict.fromkeys(policies):
        rows = [r for r, p in enumerate(policies) if p == policy]
        mine[rows] = greedy(decoder, policy, [ids[r] for r in rows], new_tokens, prefill)
        for r, n, k in zip(rows, *fidelity(decoder, full, policy, [ids[r] for r in rows], ref[rows], prefill)):
            nll[r], kl[r] = n, k
    per_prompt = []
    for r, (row_ids, policy) in enumerate(zip(ids, policies)):
        agree, share = divergence(mine[r], ref[r])
        length = len(row_ids) + new_tokens
        per_prompt.append({"prompt_tokens": len(row_ids), "capacity": min(policy.capacity or length, length),
                           "nll": nll[r], "kl_full": kl[r], "agree_tokens": agree, "agree_share": share,
                           "kv_bytes": decoder.cache_bytes(policy, 1, length),
                           "kv_bytes_full": plain.cache_bytes(full, 1, length)})
    mean = {k: sum(p[k] for p in per_prompt) / len(per_prompt) for k in
            ("nll", "kl_full", "agree_tokens", "agree_share", "kv_bytes", "kv_bytes_full")}
    return {"policy": policies[0].name, "params": policies[0].params(), "budget": budget, "prompt_set": prompts.name,
            "prompts": len(ids), "new_tokens": new_tokens, "prefill": prefill, "kv_bits": decoder.stored_bits,
            **mean, "ppl": float(torch.tensor(mean["nll"]).exp()), "per_prompt": per_prompt}
