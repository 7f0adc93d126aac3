"""What eviction does to the text a model writes (`h2o-mini eval generate`).

Perplexity, tasks and the needle measure how a policy reads a given text. A long answer is different: the cache
grows while the model writes, every token evicted is gone for the rest of the answer, and each written token is
read back by the next ones. Following the decode-time evaluations of the field (kvpress's decoding presses on
long reasoning outputs, 2025-26; R-KV, Cai et al., 2025, arXiv 2505.24133), for each prompt:

1. the **reference**: N new tokens with the full cache, greedily or sampled (below; past an end token too, so
   every prompt has N);
2. **teacher-forced fidelity**: the prompt, then the reference read back token by token through the policy's
   cache (the prompt in the `--prefill` mode, then the decode-time rule for every reference token); the mean NLL
   of the reference tokens and the mean KL(full || policy) of the next-token distributions along it;
3. **free-running divergence**: the policy's own N tokens, written as the reference was: how many equal it
   before the first difference (`agree_tokens`), and the share of positions where they are equal (`agree_share`);
4. **cost**: the bytes of the cache (C slots per layer, row and KV head, allocated up front, so the end is the
   peak), beside full's;
5. **how much the reference repeats itself** (`ref_repeated`, the share of its 4-grams seen earlier in it): a
   small model often falls into a loop, and a loop shorter than the budget is kept by any policy that keeps the
   most recent tokens, so a prompt whose reference loops says little about a policy.

A budget fraction is taken of prompt + N (each prompt's own length; a token count is the same for all).

With a temperature the reference and every policy's text are sampled, coupled (`CoupledDraws`): token i of a
prompt's text is drawn with random numbers that depend only on the seed, the prompt and i, so where a policy's
cache leaves the distribution as full's, it draws full's token. Greedy references of small models loop; sampled
ones need not, and a divergence then measures the cache, not whether it holds a loop.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..api import LM, encode_prompts
from ..errors import UserError
from ..generate import Decoder, Sampling, left_pad
from ..policies import Policy, make_policy, parse_budget, recent_if_taken
from ..policies.base import keeps_all_of
from ..policies.rows import Rows

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
def read_reference(decoder: Decoder, policy, ids: list[list[int]], ref: torch.Tensor, prefill: str, chunk: int = 64):
    """Yields (start, hidden (B, k, d)) for the reference tokens ref[:, start:start+k] read under `policy` (or
    `Rows`), after the prompts (left-padded rows): the prompts in `prefill` mode, then the reference in stream
    mode (the decode step's rule, a chunk at a time: equal by the cache's parity tests). The last layer's output,
    not the logits: the caller takes the head a row at a time (at a 262k vocabulary (B, k, V) is GBs)."""
    model = decoder.model
    idx, pos = left_pad(ids, device=ref.device)
    N = ref.shape[1]
    cache = decoder.new_cache(policy, len(ids), idx.shape[1] + N, prefill)
    yield 0, decoder.prefill(cache, idx, pos, head=False)[:, None]  # (B, 1, d): predicts ref[:, 0]
    start = pos[:, -1:] + 1  # (B, 1): each row's next position
    for s in range(0, N - 1, chunk):
        e = min(N - 1, s + chunk)
        positions = start + torch.arange(s, e, device=ref.device)[None]
        yield s + 1, model.hidden(ref[:, s:e], positions, cache)  # predicts ref[:, s+1..e]


def fidelity(decoder: Decoder, full: Policy, policy, ids: list[list[int]], ref: torch.Tensor, prefill: str,
             copies: int = 1):
    """Per row of `policy` (`copies` x the prompts, copy-major: a batch of points): the mean NLL of its prompt's
    reference under the policy, and the mean KL(full || policy) along it (full reads each prompt once, chunk by
    chunk beside it: no (B, N, V) tensor is held)."""
    P, N, head = len(ids), ref.shape[1], decoder.model.head
    nll = torch.zeros(P * copies, dtype=torch.float64)
    kl = torch.zeros(P * copies, dtype=torch.float64)
    for (s, mine), (_, theirs) in zip(read_reference(decoder, policy, ids * copies, ref.repeat(copies, 1), prefill),
                                      read_reference(decoder, full, ids, ref, prefill)):
        # every row's head on its own, full's as the policy's: under full itself both are the same numbers
        lq = [head(theirs[r]).log_softmax(-1) for r in range(P)]  # (k, V) each
        target = ref[:, s:s + theirs.shape[1]]  # (P, k)
        for row in range(P * copies):
            r = row % P
            lp = head(mine[row]).log_softmax(-1)  # (k, V)
            nll[row] -= lp.gather(1, target[r, :, None]).double().sum().cpu()
            kl[row] += (lq[r].exp() * (lq[r] - lp)).sum().double().cpu()
    return (nll / N).tolist(), (kl / N).tolist()


class CoupledDraws:
    """Common random numbers for sampled texts: the exponential draws of token i (`sample` takes argmax(p / E))
    for each prompt come from a generator seeded by (seed, the prompt's token ids, i), whatever the row's place in
    a batch and whichever policy reads it. `copies` x the prompts, copy-major, as a batch of points lays them."""

    def __init__(self, ids: list[list[int]], seed: int, copies: int = 1):
        self.keys = [hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in ids]
        self.copies = copies

    def __call__(self, i: int, logits: torch.Tensor) -> torch.Tensor:  # logits (copies * P, V) -> E's, same shape
        V, step = logits.shape[-1], i.to_bytes(8, "little")
        seeds = [int.from_bytes(hashlib.sha256(key + step).digest()[:8], "little") >> 1 for key in self.keys]
        draws = torch.stack([torch.empty(V).exponential_(1, generator=torch.Generator().manual_seed(s))
                             for s in seeds])  # (P, V), on the CPU: the same numbers on every device
        return draws.repeat(self.copies, 1).to(logits.device)


@torch.inference_mode()
def written(decoder: Decoder, policy, ids: list[list[int]], new_tokens: int, prefill: str,
            sampling: Sampling = Sampling(), seed: int = 0, copies: int = 1) -> torch.Tensor:
    """(copies * P, N): each row's continuation under `policy` (rows of one batch share it; they never interact;
    `Rows` gives each row its own), greedy or sampled with coupled draws. Under `full` it is the reference; under
    a policy evaluated, its own text."""
    draws = CoupledDraws(ids, seed, copies) if sampling.temperature > 0 else None  # greedy needs no draws
    return torch.stack(list(decoder.generate(ids * copies, policy, new_tokens, prefill, sampling, noise=draws)), 1)


def divergence(mine: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    """Tokens equal to the reference before the first difference, and the share of equal positions."""
    same = (mine == ref).tolist()
    first = same.index(False) if False in same else len(same)
    return first, sum(same) / len(same)


def repeated(ref: torch.Tensor, n: int = 4) -> float:
    """The share of the reference's n-grams that already occurred earlier in it: 0 for a text that never repeats
    an n-gram, near 1 for one that loops (N tokens hold N - n + 1 n-grams)."""
    grams = [tuple(g) for g in ref.unfold(0, n, 1).tolist()] if len(ref) >= n else []
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def evaluate(lm: LM, prompts: Prompts, new_tokens: int, spec: str, budget, recent=None, prefill: str = "dense",
             chat: bool | None = None, kv_bits: int | None = None, refs: dict | None = None, *,
             sampling: Sampling = Sampling(), seed: int = 0) -> dict:
    """One JSON row: `spec` at `budget` over every prompt (per-prompt numbers in `prompts`, means at the top)."""
    point = [(spec, budget)]
    return next(evaluate_many(lm, prompts, new_tokens, point, recent, prefill, chat, kv_bits, refs=refs,
                              sampling=sampling, seed=seed))[1]


def evaluate_many(lm: LM, prompts: Prompts, new_tokens: int, points: list[tuple], recent=None, prefill: str = "dense",
                  chat: bool | None = None, kv_bits: int | None = None, max_batch: int = 32,
                  refs: dict | None = None, *, sampling: Sampling = Sampling(),
                  seed: int = 0) -> Iterator[tuple[int, dict]]:
    """(index, row) for every (spec, budget) point as it finishes. A point is one row per prompt; the points run
    up to `max_batch` rows at a time as the rows of one batch (`policies/rows.py`: each row its own policy and
    capacity), both free-running and teacher-forced, so the model's weights are read once per decode step for
    all of them. refs: the reference made for these prompts (filled on first use), so a sweep makes it once.
    sampling, seed: greedy by default; with a temperature, every text is sampled with `CoupledDraws(seed)`."""
    ids = encode_prompts(lm, prompts.texts, chat)
    check_room(lm, ids, new_tokens)
    decoder = Decoder(lm.model, kv_bits=kv_bits)
    plain = Decoder(lm.model)  # the reference is the full cache as the model computes it
    full = make_policy("full", None, 1)
    refs = {} if refs is None else refs
    if "tokens" not in refs:
        refs["tokens"] = written(plain, full, ids, new_tokens, prefill, sampling, seed)
    ref = refs["tokens"]
    made = [[policy_for(spec, budget, len(i) + new_tokens, recent_if_taken(spec, recent)) for i in ids]
            for spec, budget in points]
    P, step = len(ids), max(1, max_batch // len(ids))
    # Points that keep every token (full) in batches of their own: a row that keeps everything widens every row's
    # slots (the widest row's C) and so slows the per-token loop of the batch it is in.
    keeps_all = [j for j in range(len(points)) if all(keeps_all_of(p, len(i) + new_tokens) for p, i in
                                                     zip(made[j], ids))]
    rest = [j for j in range(len(points)) if j not in keeps_all]
    for batch in [group[at:at + step] for group in (keeps_all, rest) for at in range(0, len(group), step)]:
        rows = Rows([(policy, 1) for j in batch for policy in made[j]])
        mine = written(decoder, rows, ids, new_tokens, prefill, sampling, seed, len(batch))  # (len(batch) * P, N)
        nll, kl = fidelity(decoder, full, rows, ids, ref, prefill, copies=len(batch))
        for c, j in enumerate(batch):
            per_prompt = []
            for r, (row_ids, policy) in enumerate(zip(ids, made[j])):
                agree, share = divergence(mine[c * P + r], ref[r])
                length = len(row_ids) + new_tokens
                per_prompt.append({"prompt_tokens": len(row_ids), "capacity": policy.capacity or length,
                                   "nll": nll[c * P + r], "kl_full": kl[c * P + r], "agree_tokens": agree,
                                   "agree_share": share, "kv_bytes": decoder.cache_bytes(policy, 1, length),
                                   "kv_bytes_full": plain.cache_bytes(full, 1, length),
                                   "ref_repeated": repeated(ref[r])})
            row = _row(made[j][0], points[j][1], prompts, new_tokens, prefill, decoder.stored_bits, per_prompt)
            yield j, {**row, "sampling": None if sampling.temperature <= 0 else {**vars(sampling), "seed": seed}}


def _row(policy: Policy, budget, prompts: Prompts, new_tokens: int, prefill: str, bits: int, per_prompt) -> dict:
    mean = {k: sum(p[k] for p in per_prompt) / len(per_prompt) for k in
            ("nll", "kl_full", "agree_tokens", "agree_share", "kv_bytes", "kv_bytes_full", "ref_repeated")}
    return {"policy": policy.name, "params": policy.params(), "budget": budget, "prompt_set": prompts.name,
            "prompts": len(per_prompt), "new_tokens": new_tokens, "prefill": prefill, "kv_bits": bits,
            **mean, "ppl": float(torch.tensor(mean["nll"]).exp()), "per_prompt": per_prompt}
