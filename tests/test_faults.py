"""A plugin that breaks the protocol is named, in one line, by every command, and check-policy fails it with the
same words (issue 38, part 1; h2o_mini/policies/guard.py). Each fault is a policy file a new user could write."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from .conftest import GPL3
from .test_bad_input import one_line_error, run_cli

BASE = '''
from dataclasses import dataclass
import torch
from h2o_mini import Policy


@dataclass(frozen=True)
class Rule(Policy):
    keep: int = 8
    name = "myrule"
    needs_scores = True

    @property
    def capacity(self):
        return self.keep

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        {keep}

    def update(self, score, p, attended):
        {update}

    def insert_score(self, keys):
        {insert}

    @classmethod
    def from_budget(cls, capacity, recent):
        return cls(keep=capacity)
'''
GOOD = {"keep": "return score", "update": "return score + p",
        "insert": "return keys.new_zeros(keys.shape[:-1], dtype=torch.float32)"}
FAULTS = {  # what the hook does -> the words of the one line
    "raises": ({"keep": 'raise ValueError("no rule today")'}, "keep_score raised ValueError: no rule today"),
    "nan keep-score": ({"keep": "return torch.where(pos >= 3, torch.nan, score)"},
                       "keep_score returned NaN for"),
    "nan score": ({"update": "return score + p * torch.nan"}, "update returned NaN for"),
    "wrong shape": ({"keep": "return score[..., :-1]"}, "keep_score returned shape"),
    "wrong dtype": ({"insert": "return keys.new_zeros(keys.shape[:-1], dtype=torch.float64)"},
                    "insert_score returned dtype torch.float64: scores are float32"),
    "not a tensor": ({"insert": "return 0.0"}, "insert_score returned float, not a tensor"),
    "in place": ({"update": "return score.add_(p)"}, "update changed its input tensors in place"),
}


def rule_file(tmp_path, fault: str):
    hooks = dict(GOOD, **FAULTS[fault][0])
    path = tmp_path / f"rule_{fault.replace(' ', '_').replace('-', '_')}.py"
    path.write_text(textwrap.dedent(BASE).format(**hooks))
    return f"{path}:Rule"


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


@pytest.mark.parametrize("fault", FAULTS)
def test_every_command_names_the_policy_the_hook_and_the_fault(folder, capsys, monkeypatch, tmp_path, fault):
    spec, words = rule_file(tmp_path, fault), FAULTS[fault][1]
    for args in (["eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 48, "--policy", spec, "--budget", 12],
                 ["generate", "--model", folder, "--no-chat", "--max-new-tokens", 12, "--policy", spec, "--budget", 8,
                  "Hello there, how are you"]):
        one_line_error(run_cli(capsys, monkeypatch, *args), f"policy 'myrule' (Rule): {words}")


@pytest.mark.parametrize("fault", FAULTS)
def test_check_policy_fails_it_with_the_same_words(capsys, monkeypatch, tmp_path, fault):
    spec, words = rule_file(tmp_path, fault), FAULTS[fault][1]
    code, out, err = run_cli(capsys, monkeypatch, "check-policy", spec, "--families", "llama_gqa")
    assert code == 1, err
    fail = [line for line in out.splitlines() if "FAIL" in line]
    assert len(fail) == 1 and f"policy 'myrule' (Rule): {words}" in fail[0], out


def test_a_rule_that_keeps_the_protocol_is_not_slowed_or_changed(capsys, monkeypatch, tmp_path):
    """The same file with every hook well-behaved passes every path of check-policy (the checks run once)."""
    path = tmp_path / "good.py"
    path.write_text(textwrap.dedent(BASE).format(**GOOD))
    code, out, err = run_cli(capsys, monkeypatch, "check-policy", f"{path}:Rule", "--families", "llama_gqa")
    assert code == 0 and "FAIL" not in out, out + err


# ---- one bad point does not sink a sweep (part 2) ----

def test_a_failing_point_is_named_the_others_saved_and_a_rerun_retries_only_it(folder, capsys, monkeypatch, tmp_path):
    import h2o_mini.cli.eval_sweep as eval_sweep
    asked = []
    real = eval_sweep.perplexities

    def recording(lm, text, tokens, configs, *a, **kw):
        asked.append(list(configs))
        return real(lm, text, tokens, configs, *a, **kw)
    monkeypatch.setattr(eval_sweep, "perplexities", recording)
    bad, out = rule_file(tmp_path, "nan score"), tmp_path / "sweep.jsonl"
    args = ["eval", "sweep", "ppl", "--model", folder, "--text", GPL3, "--tokens", 48, "--policy", "local",
            "--policy", bad, "--policy", "h2o", "--budget", 12, "--out", out]
    code, stdout, err = run_cli(capsys, monkeypatch, *args)
    assert code != 0 and "Traceback" not in err
    assert f"{bad} 12: failed: policy 'myrule' (Rule): update returned NaN" in err
    assert "1 of 4 points failed" in err and "a rerun with it retries only these" in err
    assert {line.split()[0] for line in stdout.splitlines()[1:4]} == {"full", "local", "h2o"}
    saved = [line for line in out.read_text().splitlines() if line]
    assert len(saved) == 3 and not any("myrule" in line for line in saved)
    asked.clear()
    code, stdout, err = run_cli(capsys, monkeypatch, *args)
    assert code != 0 and asked and all(points == [(bad, "12")] for points in asked), asked
    assert len([line for line in out.read_text().splitlines() if line]) == 3


def test_eval_generate_goes_on_past_a_failing_point(folder, capsys, monkeypatch, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a color.\nName a large animal.\n")
    bad, out = rule_file(tmp_path, "nan score"), tmp_path / "gen.jsonl"
    code, stdout, err = run_cli(capsys, monkeypatch, "eval", "generate", "--model", folder, "--prompts-file", prompts,
                                "--max-new-tokens", 8, "--policy", "local", "--policy", bad, "--budget", 8,
                                "--out", out, "--no-chat")
    assert code != 0 and "update returned NaN" in err and "1 of 3 points failed" in err
    assert {json.loads(line)["policy"] for line in out.read_text().splitlines()} == {"full", "local"}


def test_ctrl_c_in_a_sweep_says_what_is_saved_and_that_a_rerun_resumes(folder, capsys, monkeypatch, tmp_path):
    import h2o_mini.cli.eval_sweep as eval_sweep
    real = eval_sweep.perplexities

    def one_then_ctrl_c(*a, **kw):
        for i, item in enumerate(real(*a, **kw)):
            if i == 1:
                raise KeyboardInterrupt
            yield item
    monkeypatch.setattr(eval_sweep, "perplexities", one_then_ctrl_c)
    out = tmp_path / "sweep.jsonl"
    code, stdout, err = run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3,
                                "--tokens", 48, "--policy", "local", "--policy", "h2o", "--budget", 12, "--out", out)
    assert code == 130
    assert f"interrupted after 1 of 3 points; they are saved in {out}, and a rerun with the same --out resumes" in err
    assert len(out.read_text().splitlines()) == 1 and stdout.splitlines()[1].split()[0] == "full"


# ---- an interrupted benchmark keeps its rounds (part 3): a real SIGINT after two rounds ----

def test_ctrl_c_after_two_rounds_prints_their_medians_and_writes_out(folder, tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "h2o_mini", "bench", "--model", str(folder), "--policy", "local",
                             "--policy", "h2o", "--budget", "8", "--prompt-tokens", "16", "--new-tokens", "400",
                             "--repeat", "3", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # each run announces itself: the third round's first run means two rounds are done
        seen.append(line)
        if "run 3/3" in line:
            proc.send_signal(signal.SIGINT)
            break
    stdout, rest = proc.communicate(timeout=120)
    err = "".join(seen) + rest
    assert proc.returncode == 130, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["policy"] for r in rows] == ["local", "h2o"] and all(r["rounds"] in (2, 3) for r in rows), rows
    assert any(r["rounds"] == 2 for r in rows) and "(2 of 3 rounds)" in stdout, stdout
    assert "medians of the rounds that finished" in err and "Traceback" not in err


# ---- what a new user hit (part 5) ----

@pytest.mark.parametrize("policy, budget", [("paged_h2o:block=8,recent=16", "64"), ("h2o:recent=8", "64"),
                                            ("h2o:heavy=8,recent=24", "0.2")])
def test_parameters_that_change_c_never_silently_override_the_budget(folder, capsys, monkeypatch, policy, budget):
    one_line_error(run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 200,
                           "--policy", policy, "--budget", budget), "the parameters make C =")


def test_parameters_alone_may_define_the_policy(folder, capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 100,
                             "--policy", "h2o:heavy=8,recent=24", "--json")
    assert code == 0, err
    assert json.loads(out)["capacity"] == 32 and json.loads(out)["params"] == {"heavy": 8, "recent": 24}


def test_the_json_params_agree_with_the_capacity_even_past_the_text(folder, capsys, monkeypatch):
    """A budget larger than the text is honoured (every token kept): the JSON states the policy that ran, its
    parameters summing to its C, and counts the bytes of the cache actually held."""
    code, out, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 100,
                             "--policy", "h2o", "--budget", 2000, "--json")
    assert code == 0, err
    roomy = json.loads(out)
    assert roomy["capacity"] == sum(roomy["params"].values()) == 2000
    code, out, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 100,
                             "--policy", "full", "--json")
    full = json.loads(out)
    assert roomy["kv_bytes"] == full["kv_bytes"] and roomy["nll"] == full["nll"]


def test_refusals_come_before_the_work(folder, capsys, monkeypatch, tmp_path):
    from h2o_mini import api
    import importlib.util
    monkeypatch.setattr(api, "load", lambda *a, **kw: pytest.fail("the model was loaded before the refusal"))
    one_line_error(run_cli(capsys, monkeypatch, "eval", "generate", "--model", folder, "--policy", "hindsight",
                           "--budget", 8, "--max-new-tokens", 8), "reads the text ahead")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("matplotlib", "transformers") else real(name, *a))
    one_line_error(run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3,
                           "--tokens", 48, "--policy", "h2o", "--budget", 12, "--plot", tmp_path / "s.png"),
                   "needs matplotlib")
    one_line_error(run_cli(capsys, monkeypatch, "bench", "--model", folder, "--vs-hf", "--new-tokens", 4),
                   "--vs-hf needs transformers")


def test_a_closed_pipe_ends_quietly():
    """A reader that stops (`| head -1`; here `| true`, which reads nothing, so the pipe is surely closed by the
    time h2o-mini writes): no message, and 141 (128 + SIGPIPE) as Unix tools end."""
    r = subprocess.run(f"{sys.executable} -m h2o_mini policies | true; echo status=${{PIPESTATUS[0]}}", shell=True,
                       capture_output=True, text=True, executable="/bin/bash")
    assert r.stderr == "" and r.stdout == "status=141\n", (r.stdout, r.stderr)


def test_sweep_tables_show_only_the_shares_they_can_read(folder, capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3,
                             "--tokens", 48, "--policy", "local", "--policy", "h2o", "--budget", 12)
    assert code == 0, err
    header = out.splitlines()[0]
    assert "of h2o's gap to full" in header and "hindsight" not in out
    from h2o_mini.evals.sweep import share
    assert share(10.0, 10.00001, 10.0) is None and share(11.0, 12.0, 10.0) == 0.5
