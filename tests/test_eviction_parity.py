"""Every fast path of the evicting cache against every rule restated (tests/restated.py), fp32, 1e-4:
the decode step, stream prefill in chunks, dense prefill then decoding, and ragged batches, for every
registered policy, with keys and values as they are and quantized to 8 and 4 bits."""
from dataclasses import dataclass

import pytest
import torch

from h2o_mini.cache import KVCache
from h2o_mini.checks.checkkit import record_kv
from h2o_mini.generate import Decoder, left_pad
from h2o_mini.policies import H2O, REGISTRY, Policy, make_policy

from .conftest import FAMILIES, text_bytes
from .restated import restated_logits

T, C = 48, 10
# every registered policy at C = 10, plus h2o's two degenerate splits and an uneven one
CASES = [(name, None) for name in REGISTRY] + [("h2o", 0), ("h2o", C), ("h2o", 3)]
IDS = text_bytes(T, offset=2000)


def _policy(name, recent):
    return make_policy(name, None if name == "full" else C, T, recent)


def _run(model, ids, policy, plan, kv_bits=None, dense_block=512, record=False):
    """Teacher-forced logits through KVCache. plan: list of (start, end, mode) covering the text. record: also
    return the keys and values each layer was given (`checkkit.record_kv`)."""
    cache = KVCache(model.cfg, policy, 1, len(ids), prefill="dense" if plan[0][2] == "dense" else "stream",
                    kv_bits=kv_bits)
    for layer in cache.layers:
        layer.dense_block = dense_block
    given = record_kv(cache) if record else None
    x = torch.tensor([ids])
    out = [model(x[:, s:e], torch.arange(s, e)[None], cache) for s, e, _ in plan]
    logits = torch.cat(out, 1)[0]
    return (logits, given) if record else logits


def _close(a, b, tol=1e-4):
    return (a - b).abs().max().item() <= tol




@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name,recent", CASES)
def test_decode_step_matches_reference(tiny_model, family, name, recent):
    model, policy = tiny_model(family), _policy(name, recent)
    want = restated_logits(model, IDS, policy)
    got = _run(model, IDS, policy, [(t, t + 1, "step") for t in range(T)])
    assert _close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name,recent", CASES)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_stream_prefill_matches_reference(tiny_model, family, name, recent, chunk):
    model, policy = tiny_model(family), _policy(name, recent)
    want = restated_logits(model, IDS, policy)
    got = _run(model, IDS, policy, [(s, min(T, s + chunk), "stream") for s in range(0, T, chunk)])
    assert _close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name,recent", CASES)
@pytest.mark.parametrize("block", [512, 7])  # the prompt in one query block, and in causal blocks of 7
def test_dense_prefill_then_decode_matches_reference(tiny_model, family, name, recent, block):
    model, policy, n = tiny_model(family), _policy(name, recent), 30  # a prompt longer than C
    want = restated_logits(model, IDS, policy, dense_prompt=n)
    got = _run(model, IDS, policy, [(0, n, "dense")] + [(t, t + 1, "step") for t in range(n, T)], dense_block=block)
    assert _close(got, want)


@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_quantized_cache_matches_reference(tiny_model, name, kv_bits):
    """Keys and values stored as 8/4-bit codes: dense prompt, stream chunks, then decode steps, against the
    reference that rounds every key and value through its own quantizer as it enters. Both round the same
    key and value tensors (the ones the fast path computed, `record_kv`): a chunk's matmul sums in another
    order than one token's, and a value within 1e-7 of a code boundary would round to the neighbouring code
    (up to ~1e-3 in the logits), so comparing codes of two different computations passes or fails by luck of
    the weights. With the same tensors the codes must be equal, and the logits agree to the fp32 1e-4."""
    model, policy, n = tiny_model("llama_gqa_tied"), _policy(name, None), 20
    plan = [(0, n, "dense"), (n, 27, "stream"), (27, 34, "stream")] + [(t, t + 1, "step") for t in range(34, T)]
    got, given = _run(model, IDS, policy, plan, kv_bits, record=True)
    assert _close(got, restated_logits(model, IDS, policy, dense_prompt=n, kv_bits=kv_bits, given_kv=given))
    got, given = _run(model, IDS, policy, [(0, 16, "stream"), (16, T, "stream")], kv_bits, record=True)
    assert _close(got, restated_logits(model, IDS, policy, kv_bits=kv_bits, given_kv=given))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("prefill", ["stream", "dense"])
def test_ragged_batch_rows_match_each_prompt_alone(tiny_model, family, name, prefill):
    """Left-padded rows of different lengths: padding takes no capacity, each row evicts on its own."""
    model, policy = tiny_model(family), _policy(name, None)
    # not the GPL's first bytes: a run of 20 spaces gives keys that differ only by RoPE, whose KeyDiff
    # similarities tie exactly in pairs, so that rounding (which differs between paths) picks the victim
    texts = [text_bytes(40, 100), text_bytes(23, 700), text_bytes(31, 1500), text_bytes(9, 2600)]
    prompts, follow = [t[:-8] for t in texts], [t[-8:] for t in texts]
    idx, pos = left_pad(prompts)
    cache = KVCache(model.cfg, policy, len(texts), 40, prefill=prefill)
    chunk = 9
    plan = [(0, idx.shape[1])] if prefill == "dense" else [(s, s + chunk) for s in range(0, idx.shape[1], chunk)]
    prompt_logits = torch.cat([model(idx[:, s:e], pos[:, s:e], cache) for s, e in plan], 1)
    step_pos = pos[:, -1:] + 1
    steps = []
    for i in range(8):  # teacher-forced decode steps, every row its own next token
        steps.append(model(torch.tensor([[f[i]] for f in follow]), step_pos + i, cache))
    for row, (p, text) in enumerate(zip(prompts, texts)):
        want = restated_logits(model, text, policy, 40, dense_prompt=len(p) if prefill == "dense" else 0)
        got = torch.cat([prompt_logits[row, -len(p):]] + [s[row] for s in steps])
        assert _close(got, want), f"row {row}"


@pytest.mark.parametrize("prefill", ["stream", "dense"])
def test_batched_generation_equals_each_prompt_alone(tiny_model, prefill):
    model = tiny_model("llama_gqa_tied")
    prompts = [text_bytes(30, 0), text_bytes(17, 400), text_bytes(25, 800)]
    policy = _policy("h2o", None)
    decoder = Decoder(model, chunk=8)
    batch = torch.stack(list(decoder.generate(prompts, policy, 12, prefill))).T.tolist()
    for p, row in zip(prompts, batch):
        alone = torch.stack(list(decoder.generate([p], policy, 12, prefill)))[:, 0].tolist()
        assert row == alone


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("prefill", ["stream", "dense"])
def test_capacity_at_least_length_equals_full(tiny_model, name, prefill):
    model = tiny_model("neox_parallel")
    full = _run(model, IDS, make_policy("full", None, T), [(0, 30, "dense")] + [(t, t + 1, "step") for t in range(30, T)])
    policy = make_policy(name, None if name == "full" else T, T)  # C = L
    plan = [(0, 30, prefill)] + [(t, t + 1, "step") for t in range(30, T)]
    assert _close(_run(model, IDS, policy, plan), full)


@dataclass(frozen=True)
class _Unlisted(Policy):
    """A policy the reference does not write out (as a new one would be): it is ranked by its own keep_score."""

    keep: int
    name = "unlisted_mid_window"
    needs_scores = True

    @property
    def capacity(self) -> int:
        return self.keep

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        return torch.where(pos < 2, torch.inf, score - 0.01 * (t - pos).float())  # sinks, then attention - age

    update, accumulate = H2O.update, H2O.accumulate  # attention as H2O sums it


@pytest.mark.parametrize("mode", ["step", "stream", "dense"])
def test_a_new_policy_is_checked_by_its_own_keep_score(tiny_model, mode):
    model, policy = tiny_model("llama_gqa_tied"), _Unlisted(keep=9)
    n = 30 if mode == "dense" else 0
    want = restated_logits(model, IDS, policy, dense_prompt=n)
    first = [(0, n, "dense")] if n else [(0, 20, mode)] if mode == "stream" else []
    start = first[-1][1] if first else 0
    got = _run(model, IDS, policy, first + [(t, t + 1, "step") for t in range(start, T)])
    assert _close(got, want)
