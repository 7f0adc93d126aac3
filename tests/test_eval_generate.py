"""eval generate (evals/generation.py): the reference, teacher-forced fidelity, free-running divergence and cost,
on a tiny seeded LLaMA with a byte tokenizer; checked against plain forward passes, full, a cache that never
evicts, and one prompt at a time."""
import json

import pytest
import torch

from h2o_mini import api
from h2o_mini.evals.generation import CoupledDraws, Prompts, evaluate, evaluate_many, repeated
from h2o_mini.generate import Sampling

from .test_bad_input import one_line_error, run_cli

N = 20
PROMPTS = Prompts("test", ["The licence says that you may", "Free software is a matter of", "Copy"])


@pytest.fixture(scope="module")
def folder(llama_bytes):
    return llama_bytes


@pytest.fixture(scope="module")
def lm(llama_bytes):
    return api.load(llama_bytes)


def test_full_has_no_divergence_and_the_references_own_nll(lm):
    refs = {}
    row = evaluate(lm, PROMPTS, N, "full", None, chat=False, refs=refs)
    assert row["agree_tokens"] == N and row["agree_share"] == 1.0 and row["kl_full"] == 0.0
    for p, text in zip(row["per_prompt"], PROMPTS.texts):  # the reference's NLL, from one plain causal pass
        ids = lm.tokenizer.encode(text)
        ref = refs["tokens"][PROMPTS.texts.index(text)].tolist()
        x = torch.tensor([ids + ref])
        lp = lm.model(x, torch.arange(x.shape[1])[None])[0, len(ids) - 1:-1].log_softmax(-1)
        want = -lp.gather(1, torch.tensor(ref)[:, None]).mean().item()
        assert abs(p["nll"] - want) <= 1e-5
        # and the reference is the greedy continuation of that pass
        assert lp.argmax(-1).tolist() == ref


def test_a_cache_that_never_evicts_equals_full_and_one_that_does_diverges(lm):
    full = evaluate(lm, PROMPTS, N, "full", None, chat=False)
    roomy = evaluate(lm, PROMPTS, N, "local", "64", chat=False)  # 64 > prompt + N for every prompt
    assert [p["nll"] for p in roomy["per_prompt"]] == [p["nll"] for p in full["per_prompt"]]
    assert roomy["agree_tokens"] == N and roomy["kl_full"] == 0.0
    tight = evaluate(lm, PROMPTS, N, "local", "4", chat=False)
    assert tight["kl_full"] > 1e-3 and tight["nll"] != full["nll"]
    assert tight["kv_bytes"] < tight["kv_bytes_full"] == full["kv_bytes"]


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv"])
def test_a_batch_of_prompts_gives_each_prompts_own_numbers(lm, policy):
    together = evaluate(lm, PROMPTS, N, policy, "8", chat=False)["per_prompt"]
    for text, mine in zip(PROMPTS.texts, together):
        alone = evaluate(lm, Prompts("one", [text]), N, policy, "8", chat=False)["per_prompt"][0]
        assert alone["agree_tokens"] == mine["agree_tokens"] and alone["agree_share"] == mine["agree_share"]
        assert abs(alone["nll"] - mine["nll"]) <= 1e-5 and abs(alone["kl_full"] - mine["kl_full"]) <= 1e-5


def test_points_batched_together_give_each_point_its_own_numbers(lm):
    """eval generate's one pass: every point (full, and policies at fractions and token counts, so the rows have
    different capacities) as rows of batches of 5, against each point evaluated alone."""
    points = [("full", None), ("h2o", "8"), ("tova", "0.3"), ("snapkv", "12"), ("a2sf", "0.25"), ("local", "6")]
    refs = {}
    together = dict(evaluate_many(lm, PROMPTS, N, points, chat=False, max_batch=5, refs=refs))
    assert sorted(together) == list(range(len(points)))
    for j, (spec, budget) in enumerate(points):
        alone = evaluate(lm, PROMPTS, N, spec, budget, chat=False, refs=refs)
        assert together[j]["policy"] == alone["policy"] and together[j]["params"] == alone["params"]
        for mine, theirs in zip(together[j]["per_prompt"], alone["per_prompt"]):
            assert mine["agree_tokens"] == theirs["agree_tokens"] and mine["capacity"] == theirs["capacity"]
            assert abs(mine["nll"] - theirs["nll"]) <= 1e-5 and abs(mine["kl_full"] - theirs["kl_full"]) <= 1e-5


def test_how_much_the_reference_repeats_itself(lm):
    assert repeated(torch.arange(40)) == 0.0  # no 4-gram twice
    loop = torch.tensor([7, 8, 9] * 20)  # 57 4-grams, 3 distinct: every one after the first three repeats
    assert repeated(loop) == 54 / 57 and repeated(torch.tensor([1, 2])) == 0.0
    refs = {}
    row = evaluate(lm, PROMPTS, N, "full", None, chat=False, refs=refs)
    for p, ref in zip(row["per_prompt"], refs["tokens"]):
        assert p["ref_repeated"] == repeated(ref)
    assert row["ref_repeated"] == sum(p["ref_repeated"] for p in row["per_prompt"]) / len(PROMPTS.texts)


HOT = Sampling(temperature=1.0)


def test_coupled_draws_depend_on_the_prompt_and_the_step_only():
    ids = [[5, 6, 7], [8, 9]]
    like = torch.zeros(4, 1000)
    a, b = CoupledDraws(ids, seed=3, copies=2)(7, like), CoupledDraws(ids[1:], seed=3)(7, like[:1])
    assert torch.equal(a[:2], a[2:]) and torch.equal(a[1], b[0])  # a prompt's draws wherever its row sits
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, CoupledDraws(ids, 3, 2)(8, like))
    assert not torch.equal(a, CoupledDraws(ids, seed=4, copies=2)(7, like))
    assert a.min() > 0 and abs(a.mean().item() - 1) < 0.1  # Exp(1): mean 1, sd 1/sqrt(4000) ~ 0.016


def test_sampled_full_keeps_to_its_own_sampled_text(lm):
    """With a temperature, full's text is drawn with the draws the reference had: nothing diverges; the text is
    the seed's (another seed writes another) and not the greedy one."""
    refs, greedy_refs = {}, {}
    row = evaluate(lm, PROMPTS, N, "full", None, chat=False, refs=refs, sampling=HOT, seed=1)
    assert row["agree_tokens"] == N and row["kl_full"] == 0.0 and row["sampling"]["seed"] == 1
    evaluate(lm, PROMPTS, N, "full", None, chat=False, refs=greedy_refs)
    again = {}
    evaluate(lm, PROMPTS, N, "full", None, chat=False, refs=again, sampling=HOT, seed=2)
    assert not torch.equal(refs["tokens"], greedy_refs["tokens"]) and not torch.equal(refs["tokens"], again["tokens"])


def test_sampled_points_batched_give_each_prompt_and_point_its_own_numbers(lm):
    points = [("h2o", "8"), ("tova", "0.3"), ("local", "6")]
    refs = {}
    together = dict(evaluate_many(lm, PROMPTS, N, points, chat=False, max_batch=5, refs=refs, sampling=HOT, seed=1))
    for j, (spec, budget) in enumerate(points):
        for r, text in enumerate(PROMPTS.texts):  # one prompt, one point, alone
            alone = evaluate(lm, Prompts("one", [text]), N, spec, budget, chat=False, sampling=HOT, seed=1)
            mine, theirs = together[j]["per_prompt"][r], alone["per_prompt"][0]
            assert mine["agree_tokens"] == theirs["agree_tokens"] and abs(mine["nll"] - theirs["nll"]) <= 1e-5
    assert any(row["agree_tokens"] < N for row in together.values())  # a 6-token window does leave the text


def test_cli_json_table_resume_and_plot(folder, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    prompts = tmp_path / "p.txt"
    prompts.write_text("The licence says that you may\n\nCopy\n")
    out, plot = tmp_path / "g.jsonl", tmp_path / "g.png"
    args = ["eval", "generate", "--model", folder, "--prompts-file", prompts, "--max-new-tokens", 12,
            "--policy", "h2o", "--budget", 8, "--budget", 16, "--out", out]
    code, stdout, err = run_cli(capsys, monkeypatch, *args, "--plot", plot)
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["policy", "budget", "nll"] and len(lines) == 5
    assert lines[-1].startswith("full's text: ") and "per prompt: " in lines[-1]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("h2o", "8"), ("h2o", "16")]
    assert all(r["prompts"] == 2 and r["new_tokens"] == 12 and r["prompt_set"] == "p.txt" for r in rows)
    assert plot.stat().st_size > 0
    code, again, err = run_cli(capsys, monkeypatch, *args, "--json")  # every point already in --out: none rerun
    assert code == 0 and [json.loads(line)["nll"] for line in again.splitlines()] == [r["nll"] for r in rows]
    code, hot, err = run_cli(capsys, monkeypatch, *args, "--temperature", 1, "--seed", 3, "--json")
    assert code == 0 and "sampling" in err  # a sampled run reuses no greedy row: it says so, and runs every point
    assert [json.loads(line)["sampling"] for line in hot.splitlines()] == [
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 3}] * 3


def test_bad_input_is_one_line(folder, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    base = ["eval", "generate", "--model", folder, "--no-chat"]
    one_line_error(run_cli(capsys, monkeypatch, *base, "--prompts-file", empty), "has no prompts")
    one_line_error(run_cli(capsys, monkeypatch, *base, "--max-new-tokens", 600), "positions")
    one_line_error(run_cli(capsys, monkeypatch, *base, "--max-new-tokens", 8, "--policy", "h2o", "--budget", "0.001"),
                   "rounds to no token")
    one_line_error(run_cli(capsys, monkeypatch, *base, "--max-new-tokens", 8, "--policy", "hindsight", "--budget",
                           16), "reads the text ahead")
