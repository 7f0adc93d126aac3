"""`eval ppl`'s scoring path (evals/ppl.score_text) against the naive reference: every token scored in stream
mode, every registered policy's NLL equal to the reference's logits'."""
import pytest
import torch

from h2o_mini.evals.ppl import score_text
from h2o_mini.policies import REGISTRY, make_policy

from .conftest import text_bytes
from .restated import restated_logits


@pytest.mark.parametrize("name", ["h2o", "heavy_hitter", "local"])
def test_eval_scores_every_token_in_stream_mode(tiny_model, name):
    model, ids = tiny_model("llama_gqa_tied"), text_bytes(60, 5000)
    policy = make_policy(name, 12, len(ids))
    got = score_text(model, ids, policy, chunk=16, compare_full=True)
    ref = restated_logits(model, ids, policy, 12).log_softmax(-1)
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
    ref = restated_logits(model, ids, policy).log_softmax(-1)
    assert abs(got["nll"] - -ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()) < 1e-5
    assert got["params"] == policy.params() and got["kl_full"] >= 0
    full = score_text(model, ids, make_policy("full", None, len(ids)))
    assert abs(score_text(model, ids, make_policy(name, len(ids), len(ids)))["nll"] - full["nll"]) < 1e-5
