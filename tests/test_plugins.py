"""Writing a policy (issue 18): a plugin from a file or an installed package, typed parameters from the command
line, `check-policy` proving a rule exact (and catching one that is not), and sweeps over a parameter."""
import json
import math
import subprocess
import sys

import pytest
import torch

from h2o_mini.checks.checkkit import check_accumulate, steps, fast_logits
from h2o_mini.checks.naive import naive_logits as by_hooks
from h2o_mini.policies import REGISTRY, make_policy, resolve

from .conftest import GPL3, text_bytes
from .restated import restated_logits as restated

VNORM = '''
"""A value-norm rule written outside h2o-mini: keep the tokens whose values are largest, plus a recent window."""
from dataclasses import dataclass

import torch

from h2o_mini import Policy, param


@dataclass(frozen=True)
class VNorm(Policy):
    """Keep the `recent` newest and the tokens with the largest value norm (power `power`)."""

    keep: int
    recent: int
    power: float = param(1.0, lo=0.5, hi=4.0)
    signed: bool = False
    name = "vnorm"
    takes_recent = True

    @property
    def capacity(self):
        return self.keep + self.recent

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        # The same token twice has the same value up to the last bit (a batched matmul may round another row
        # differently), and the tie must hold on every path: so fp64, then rounded to bfloat16 (as knorm does)
        size = (values.double().norm(dim=-1) ** self.power).bfloat16().float()
        return torch.where(pos > t - self.recent, torch.inf, size)

    @classmethod
    def from_budget(cls, capacity, recent):
        recent = capacity // 2 if recent is None else recent
        return cls(keep=capacity - recent, recent=recent)
'''

BROKEN = '''
from dataclasses import dataclass
import torch
from h2o_mini.policies.h2o import H2O


@dataclass(frozen=True)
class WrongClosedForm(H2O):
    """Says it decays scores query by query, but its closed form forgets the decay."""
    name = "wrong_closed_form"

    def update(self, score, p, attended):
        return 0.5 * score + p

    def accumulate(self, score, probs, attended):
        return score + probs.sum(2)


@dataclass(frozen=True)
class Stateful(H2O):
    """Keeps state outside the cache (a call counter), so its result depends on how often a path asks."""
    name = "stateful"
    calls = [0]

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        self.calls[0] += 1
        return torch.where(pos > t - self.recent, torch.inf, score + (self.calls[0] % 3) * pos.float())


@dataclass(frozen=True)
class AcrossRows(H2O):
    """Reads the other rows of the batch: exact alone, wrong beside other sequences."""
    name = "across_rows"

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        return torch.where(pos > t - self.recent, torch.inf, score - 0.5 * score.mean(0, keepdim=True))


class NotAPolicy:
    pass


raise_here = False
'''


def run(*args, cwd=None, env=None):
    import os
    return subprocess.run([sys.executable, "-m", "h2o_mini", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outside")  # not in the repository, not installed
    (folder / "vnorm.py").write_text(VNORM)
    (folder / "broken.py").write_text(BROKEN)
    (folder / "crashes.py").write_text("import torch\nraise RuntimeError('my bug')\n")
    return folder


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


def test_a_plugin_file_runs_from_the_cli_with_its_parameters(plugin, folder):
    spec = f"{plugin / 'vnorm.py'}:VNorm:power=2,signed=true"
    r = run("eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 48, "--policy", spec, "--budget", 12,
            "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["policy"] == "vnorm" and out["params"] == {"keep": 6, "recent": 6, "power": 2.0, "signed": True}
    assert out["capacity"] == 12 and math.isfinite(out["nll"])


def test_check_policy_proves_a_plugin_exact_on_every_path(plugin):
    r = run("check-policy", f"{plugin / 'vnorm.py'}:VNorm:power=1.5", "--families", "llama_gqa,neox")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for path in ("decode step", "stream, chunks of 7", "dense prefill in blocks of 7", "ragged batch, dense prefill",
                 "compiled step", "4-bit keys and values", "batched with other policies"):
        assert any(path in line and line.rstrip().endswith("pass") for line in lines), path
    # and inside transformers' own models (an optional extra the test environment has): 3 paths on 2 families
    inside = [line for line in lines if line.startswith("hf ")]
    assert len(inside) == 6 and all(line.rstrip().endswith("pass") for line in inside), r.stdout
    assert lines[-1] == "28 passed, 0 failed"  # 12 paths on the first family, 9 on the second, the closed form, 6


@pytest.mark.parametrize("cls,needle,fault", [("WrongClosedForm", "accumulate = update per query", None),
                                              ("Stateful", "decode step", "compiled again at every call"),
                                              ("AcrossRows", "batched with other policies", None)])
def test_check_policy_catches_a_rule_that_is_not_exact(plugin, cls, needle, fault):
    """The path where the rule goes wrong fails; a rule the compiled step cannot hold ends the check in a row
    that says why (not a traceback)."""
    r = run("check-policy", f"{plugin / 'broken.py'}:{cls}", "--families", "llama_gqa", "--no-transformers")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert any(needle in line and line.endswith("FAIL") for line in lines), r.stdout
    assert fault is None or any(fault in line and "FAIL" in line for line in lines), r.stdout


@pytest.mark.parametrize("spec,needle", [
    ("{p}/missing.py:X", "does not exist"),
    ("{p}/broken.py:Nope", "defines no 'Nope'"),
    ("{p}/broken.py:NotAPolicy", "is not an h2o_mini Policy class"),
    ("{p}/crashes.py:X", "running {p}/crashes.py failed: RuntimeError: my bug"),
    ("no_such_pkg.rules:X", "no module named 'no_such_pkg'"),
    ("h2o:gamma=2", "h2o has no parameter 'gamma' (its parameters: heavy, recent)"),
    ("a2sf:gamma=nan", "gamma=nan must be a finite number in [0.0, 1.0]"),
    ("a2sf:gamma=1.5", "gamma=1.5 must be in [0.0, 1.0]"),
    ("a2sf:heavy=2.5", "heavy='2.5' must be an integer"),
    ("{p}/vnorm.py:VNorm:signed=maybe", "signed='maybe' must be true or false"),
    ("nosuchpolicy", "unknown policy 'nosuchpolicy'"),
])
def test_bad_plugins_and_parameters_are_one_line(plugin, folder, spec, needle):
    spec, needle = spec.format(p=plugin), needle.format(p=plugin)
    r = run("generate", "--model", folder, "--policy", spec, "--budget", 8, "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr, r.stderr


def test_debug_shows_the_plugins_own_traceback(plugin, folder):
    r = run("--debug", "generate", "--model", folder, "--policy", f"{plugin / 'crashes.py'}:X", "--budget", 8, "hi")
    assert r.returncode == 2 and "Traceback" in r.stderr and "my bug" in r.stderr


def test_an_installed_package_registers_by_name(plugin, folder, tmp_path):
    """The entry-point group h2o_mini.policies: what `pip install` of a package with that group writes."""
    site = tmp_path / "site"
    (site / "my_rules").mkdir(parents=True)
    (site / "my_rules" / "__init__.py").write_text(VNORM)
    dist = site / "my_rules-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rules\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[h2o_mini.policies]\nvnorm = my_rules:VNorm\n")
    env = {"PYTHONPATH": str(site)}
    listed = run("policies", env=env)
    assert listed.returncode == 0 and "vnorm (entry point my_rules:VNorm)" in listed.stdout
    r = run("eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 32, "--policy", "vnorm:power=2", "--budget",
            8, "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["params"]["power"] == 2.0, r.stderr


def test_a_sweep_over_a_parameter_is_one_command_and_resumes_by_it(folder, tmp_path):
    out = tmp_path / "g.jsonl"
    args = ["eval", "sweep", "ppl", "--model", folder, "--text", GPL3, "--tokens", 40, "--budget", 10, "--out", out,
            "--json"]
    r = run(*args, "--policy", "a2sf:gamma=0.5", "--policy", "a2sf:gamma=0.99")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["spec"], x["params"].get("gamma")) for x in rows] == [
        ("full", None), ("a2sf:gamma=0.5", 0.5), ("a2sf:gamma=0.99", 0.99)]
    assert rows[1]["nll"] != rows[2]["nll"]  # the parameter reached the rule
    again = run(*args, "--policy", "a2sf:gamma=0.7", "--policy", "a2sf:gamma=0.99")
    # the points already in the file first (reused), then the new one
    assert [json.loads(line)["spec"] for line in again.stdout.splitlines()] == ["full", "a2sf:gamma=0.99",
                                                                                "a2sf:gamma=0.7"]
    assert len(out.read_text().splitlines()) == 4  # only the new point was computed and appended


# ---- the hook-driven reference against the independent restatements, for every registered policy ----

@pytest.mark.parametrize("name", list(REGISTRY))
def test_the_hook_reference_agrees_with_the_restated_rules(tiny_model, name):
    """`check-policy`'s reference (the policy's own hooks) and tests/restated.py (each rule written out again)
    give the same logits: step by step, and after a dense prompt."""
    model, ids = tiny_model("llama_gqa_tied"), text_bytes(40, 2000)
    policy = make_policy(name, 10 if resolve(name).cls.takes_budget else None, 40)
    assert (by_hooks(model, ids, policy) - restated(model, ids, policy)).abs().max() <= 1e-4
    assert (by_hooks(model, ids, policy, dense_prompt=25) - restated(model, ids, policy, dense_prompt=25)).abs().max() <= 1e-4
    assert check_accumulate(policy) <= 1e-5  # a closed form, where there is one, is the per-query rule
    assert (fast_logits(model, ids, policy, steps(0, 40)) - restated(model, ids, policy)).abs().max() <= 1e-4


def test_a2sf_with_gamma_one_is_h2o_and_page_one_is_h2o(tiny_model):
    model, ids = tiny_model("llama_gqa_tied"), text_bytes(40, 500)
    h2o = fast_logits(model, ids, make_policy("h2o", 10, 40), steps(0, 40))
    for spec in ("a2sf:gamma=1", "paged_h2o:block=1"):
        assert (fast_logits(model, ids, make_policy(spec, 10, 40), steps(0, 40)) - h2o).abs().max() <= 1e-5
    decayed = fast_logits(model, ids, make_policy("a2sf:gamma=0.5", 10, 40), steps(0, 40))
    assert (decayed - h2o).abs().max() > 1e-3  # forgetting changes which tokens stay


def test_hand_worked_keep_scores_of_the_new_rules():
    pos = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, -1]]])  # slot 7 is empty
    score = torch.tensor([[[1.0, 2.0, 0.5, 0.5, 4.0, 0.0, 3.0, 9.0]]])
    t = torch.tensor(7)
    paged = make_policy("paged_h2o:block=3", 8, 100, recent="2")  # pages {0,1,2} {3,4,5} {6}; 6 is recent
    assert paged.keep_score(score, pos, t).tolist() == [[[3.5, 3.5, 3.5, 4.5, 4.5, 4.5, math.inf, 0.0]]]
    values = torch.tensor([[[[1.0, -1.0], [0.0, 0.5], [2.0, 2.0], [0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [1.0, 1.0],
                             [0.0, 0.0]]]])
    vatp = make_policy("vatp", 8, 100, recent="2")
    assert vatp.keep_score(score, pos, t, values=values)[0, 0, :6].tolist() == [2.0, 1.0, 2.0, 0.0, 4.0, 0.0]
    keys = torch.tensor([[[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 1.0],
                           [5.0, 5.0]]]])  # slot 7 (empty) must not count
    rkv = make_policy("rkv:lam=0.5", 8, 100, recent="2")
    got = rkv.keep_score(score, pos, t, keys)[0, 0]
    mean = 11.0 / 7  # over the 7 cached tokens
    # token 0's key is shared with tokens 1, 3, 5 (cosine 1) and orthogonal to 2, 4, 6: mean cosine 3/6
    assert math.isclose(got[0].item(), 0.5 * 1.0 / mean - 0.5 * 0.5, abs_tol=1e-6)
    # token 2's key points like 4 and 6: mean cosine 2/6
    assert math.isclose(got[2].item(), 0.5 * 0.5 / mean - 0.5 * (2 / 6), abs_tol=1e-6)  # fp32 cancellation
    assert got[6] == math.inf


@pytest.mark.parametrize("name", list(REGISTRY))
def test_eval_ppl_on_the_cli_takes_every_registered_policy(folder, name, capsys, monkeypatch):
    from .test_bad_input import run_cli
    budget = ["--budget", 12] if REGISTRY[name].takes_budget else []
    code, out, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 48,
                             "--policy", name, *budget, "--json")
    assert code == 0, err
    row = json.loads(out)
    assert row["policy"] == name and row["params"] == make_policy(name, 12 if budget else None, 48).params()
    assert row["capacity"] == (12 if budget else 48)


def test_a_per_layer_rule_runs_its_own_parameters_in_each_layer(tiny_model):
    """`for_layer`: each layer's cache runs the policy the hook returns (here a wider window in layer 0)."""
    from dataclasses import dataclass, replace
    from h2o_mini.cache import KVCache
    from h2o_mini.checks.naive import naive_logits as hooks
    from h2o_mini.policies.h2o import H2O

    @dataclass(frozen=True)
    class Deeper(H2O):
        name = "deeper"

        def for_layer(self, layer, n_layer):
            return replace(self, heavy=self.heavy - 2, recent=self.recent + 2) if layer == 0 else self

    model, ids = tiny_model("llama_gqa_tied"), text_bytes(40, 1200)
    policy = Deeper(heavy=5, recent=5)
    cache = KVCache(model.cfg, policy, 1, 40)
    assert [lc.policy.recent for lc in cache.layers] == [7, 5]
    got = fast_logits(model, ids, policy, steps(0, 40))
    assert (got - hooks(model, ids, policy)).abs().max() <= 1e-4
    assert (got - fast_logits(model, ids, H2O(heavy=5, recent=5), steps(0, 40))).abs().max() > 1e-3
