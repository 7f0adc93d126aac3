"""Sampling, and `eval ppl`'s scoring path against the naive reference."""
import pytest
import torch

from h2o_mini.evals.ppl import score_text
from h2o_mini.generate import Sampling, sample
from h2o_mini.policies import REGISTRY, make_policy

from .conftest import text_bytes
from .reference import reference_logits


def test_sampling_rules():
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, Sampling()), greedy)
    assert torch.equal(sample(logits, Sampling(temperature=1.0, top_k=1)), greedy)
    assert torch.equal(sample(logits, Sampling(temperature=1.0, top_p=1e-6)), greedy)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = sample(logits, Sampling(temperature=0.8, top_k=10), g())
    assert torch.equal(a, sample(logits, Sampling(temperature=0.8, top_k=10), g()))  # seeded: reproducible
    top10 = logits.topk(10, -1).indices
    draws = torch.stack([sample(logits, Sampling(temperature=2.0, top_k=10)) for _ in range(200)], 1)
    assert all(set(draws[r].tolist()) <= set(top10[r].tolist()) for r in range(4))  # never outside the top k
    assert len(set(draws[0].tolist())) > 1  # and really random


@pytest.mark.parametrize("name", ["h2o", "heavy_hitter", "local"])
def test_eval_scores_every_token_in_stream_mode(tiny_model, name):
    model, ids = tiny_model("llama_gqa_tied"), text_bytes(60, 5000)
    policy = make_policy(name, 12, len(ids))
    got = score_text(model, ids, policy, chunk=16, compare_full=True)
    ref = reference_logits(model, ids, policy, 12).log_softmax(-1)
    want = -ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert got["capacity"] == 12 and got["tokens"] == 60
    assert abs(got["nll"] - want) < 1e-5
    full = score_text(model, ids, make_policy("full", None, len(ids)))
    assert got["nll"] != full["nll"] and 0 < got["top1_agree_full"] < 1 and got["kl_full"] > 0
    same = score_text(model, ids, make_policy(name, len(ids), len(ids)), compare_full=True)  # C = L
    assert abs(same["nll"] - full["nll"]) < 1e-5 and same["top1_agree_full"] == 1.0 and same["kl_full"] < 1e-6


@pytest.mark.parametrize("name", [n for n, cls in REGISTRY.items() if cls.takes_budget])
def test_eval_of_every_registered_policy_equals_the_reference(tiny_model, name):
    """eval ppl's scoring (stream chunks) against the naive reference, for every registered policy; at C = L
    each equals full."""
    model, ids = tiny_model("llama_gqa_tied"), text_bytes(48, 4000)
    policy = make_policy(name, 10, len(ids))
    got = score_text(model, ids, policy, chunk=16, compare_full=True)
    ref = reference_logits(model, ids, policy).log_softmax(-1)
    assert abs(got["nll"] - -ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()) < 1e-5
    assert got["params"] == policy.params() and got["kl_full"] >= 0
    full = score_text(model, ids, make_policy("full", None, len(ids)))
    assert abs(score_text(model, ids, make_policy(name, len(ids), len(ids)))["nll"] - full["nll"]) < 1e-5
