"""The look-ahead rules (issue 37): `expected_attention` (in the registry, so every parity suite runs it and
tests/restated.py restates it) and `learned`, fitted by `h2o-mini learn-policy` to hindsight. A rule fitted to one
model is checked on every fast path of that model against the naive reference, and refused on any other."""
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from h2o_mini.cache import KVCache
from h2o_mini.errors import UserError
from h2o_mini.evals.learn import fit, save_rule
from h2o_mini.policies import Policy, make_policy
from h2o_mini.policies.guard import checked
from h2o_mini.policies.learned import FEATURES
from h2o_mini.checks import checkkit

from .conftest import GPL3


def run(*args):
    return subprocess.run([sys.executable, "-m", "h2o_mini", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny_rule(tmp_path_factory):
    """A rule fitted on the kit's tiny LLaMA (GQA) to 120 bytes of the GPL-3."""
    model = checkkit.tiny_model("llama_gqa")
    ids = list(GPL3.read_bytes()[:120])
    weights, report = fit(model, ids, budget=0.1, samples=16)
    path = tmp_path_factory.mktemp("rule") / "rule.safetensors"
    save_rule(path, weights, report, "tiny llama_gqa", model.cfg, "GPL-3", len(ids), 0.1)
    return path, weights, report


def test_the_fit_is_finite_and_says_what_matters(tiny_rule):
    _, weights, report = tiny_rule
    assert weights.shape == (2, len(FEATURES)) and torch.isfinite(weights).all()
    assert set(report["importance"]) == set(FEATURES) and len(report["r2"]) == 2
    assert all(r <= 1 for r in report["r2"])


def test_a_learned_rule_is_exact_on_every_fast_path_of_its_model(tiny_rule):
    path = tiny_rule[0]
    rows = list(checkkit.check_paths(lambda L: make_policy(f"learned:weights={path}", 10, L), "llama_gqa",
                                     compiled=True, quantized=True))
    assert len(rows) >= 12
    for what, diff in rows:
        assert diff <= checkkit.TOL, (what, diff)


def test_each_layer_runs_its_own_weights(tiny_rule):
    policy = make_policy(f"learned:weights={tiny_rule[0]}", 10, 40)
    layers = [policy.for_layer(i, 2) for i in range(2)]
    assert layers[0] != layers[1], "a batch must never merge two layers' rows under one layer's weights"
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 12, 8, generator=gen)
    args = (torch.rand(1, 2, 12, generator=gen), torch.arange(12).expand(1, 2, 12), torch.tensor(12), keys, keys)
    assert not torch.equal(layers[0].keep_score(*args), layers[1].keep_score(*args))


def test_a_rule_from_another_model_is_refused_in_one_line(tiny_rule):
    policy = make_policy(f"learned:weights={tiny_rule[0]}", 10, 40)
    with pytest.raises(UserError, match="fitted to another model"):
        KVCache(checkkit.FAMILIES["qwen3"], policy, 1, 40)


def test_a_file_that_is_not_a_rule_is_refused(tmp_path):
    bad = tmp_path / "rule.safetensors"
    bad.write_bytes(b"not a safetensors file")
    for path in (bad, tmp_path / "missing.safetensors"):
        with pytest.raises(UserError, match="learned: "):
            make_policy(f"learned:weights={path}", 10, 40)


def test_learn_policy_then_run_it_from_the_command_line(byte_folder, tmp_path):
    folder, other = byte_folder("llama_gqa_tied"), byte_folder("qwen3_qknorm")
    out = tmp_path / "rule.safetensors"
    r = run("learn-policy", "--model", folder, "--text", GPL3, "--tokens", 160, "--budget", 0.1, "--samples", 8,
            "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    fitted = json.loads(r.stdout)
    assert set(fitted["importance"]) == set(FEATURES) and out.exists()
    r = run("eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 120, "--policy",
            f"learned:weights={out}", "--budget", 0.1, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"]["weights"] == str(out)
    r = run("eval", "ppl", "--model", other, "--text", GPL3, "--tokens", 120, "--policy",
            f"learned:weights={out}", "--budget", 0.1)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "fitted to another model" in r.stderr
    r = run("learn-policy", "--model", folder, "--text", GPL3, "--tokens", 160, "--out", tmp_path / "rule.pt")
    assert r.returncode != 0 and "Traceback" not in r.stderr and ".safetensors" in r.stderr
    listed = run("policies")  # listed with the way to get its weights (it has no example without a file)
    assert listed.returncode == 0 and "learned (built-in)" in listed.stdout
    assert "learned:weights=FILE" in listed.stdout.split("learned (built-in)")[1]


def test_an_observing_hook_that_breaks_the_protocol_is_named():
    @dataclass(frozen=True)
    class Broken(Policy):
        keep: int = 10
        name = "broken"

        @property
        def capacity(self):
            return self.keep

        def state_size(self, head_dim):
            return 3

        def observe(self, state, queries, t, rope):
            return state[..., :2]  # one number short

        def keep_score(self, score, pos, t, keys=None, values=None, state=None):
            return score

    rows = checkkit.check_policy(lambda L: checked(Broken)(), families=("llama_gqa",))
    assert not rows[-1]["passed"] and "observe returned shape" in rows[-1]["fault"]


def test_expected_attention_statistics_are_the_queries_mean_and_covariance():
    """Welford's running update, one query at a time, equals the batch mean and covariance of the queries counted
    (those from position `sink` on), with RoPE undone."""
    from h2o_mini.model import Rope
    ea = make_policy("expected_attention:sink=2", 10, 40)
    rope = Rope(1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 9, 8, generator=gen)  # (B, H, g, T, d), after RoPE at positions 0..8
    empty, pos = torch.zeros(1, 2, 3, ea.state_size(8)), torch.arange(9)[None]
    pre = rope.rotate(q, -torch.arange(9).view(1, 1, 1, 9))[:, :, :, 2:]  # the counted queries, RoPE undone
    want_mean = pre.mean(3)
    centred = pre - want_mean[:, :, :, None]
    want_cov = centred.transpose(-1, -2) @ centred / 7
    one_by_one = Policy.observe_many(ea, empty, q, pos, rope)  # `observe` per token (Welford)
    in_two_blocks = ea.observe_many(ea.observe_many(empty, q[:, :, :, :4], pos[:, :4], rope), q[:, :, :, 4:],
                                    pos[:, 4:], rope)  # the closed form, merged (Chan et al.)
    for state in (one_by_one, in_two_blocks):
        count, mean, ahead, cov, _ = ea._unpack(state, 8)
        assert torch.equal(count, torch.full_like(count, 7.0))
        torch.testing.assert_close(mean, want_mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cov, want_cov, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(in_two_blocks, one_by_one, atol=1e-5, rtol=1e-5)
