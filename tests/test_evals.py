"""The evaluation workbench: lm-eval tasks against lm-eval's own hf backend, needle in a haystack, sweeps,
the attention power law. Tiny checkpoints and few items."""
import json
import math

import pytest
import torch

from h2o_mini import api
from h2o_mini.policies import make_policy

from .conftest import GPL3, text_bytes
from .restated import restated_logits
from .test_bad_input import one_line_error, run_cli

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


@pytest.fixture(scope="module")
def lm(folder):
    return api.load(folder)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A local multiple-choice task in lm-eval's own format: `dataset_path: json` with `data_files`."""
    d = tmp_path_factory.mktemp("tasks")
    text = GPL3.read_text().split()
    items = [{"context": " ".join(text[i:i + 12 + i % 9]), "choices": [" ".join(text[j:j + 3 + j % 4]) for j in
              (i + 30, i + 12 + i % 9, i + 77)], "gold": 1} for i in range(0, 240, 40)]
    (d / "tiny_choice.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    (d / "tiny_choice.yaml").write_text(f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'tiny_choice.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return d


def _lls(results):
    return [float(r[0][0]) for s in results["samples"]["tiny_choice"] for r in s["resps"]]


@pytest.fixture(scope="module")
def full_run(lm, task_dir):
    """eval tasks with the full cache, batches of 4 (padded rows), every sample logged."""
    from h2o_mini.evals.harness import run_tasks
    return run_tasks(lm, ["tiny_choice"], str(task_dir), num_fewshot=1, batch_size=4, log_samples=True)


@pytest.fixture(scope="module")
def h2o_quarter(lm, task_dir):
    """Each request's log-likelihoods under h2o at 0.25 of its own length, in batches of 3."""
    from h2o_mini.evals.harness import run_tasks
    return _lls(run_tasks(lm, ["tiny_choice"], str(task_dir), num_fewshot=1, log_samples=True, policy="h2o",
                          budget="0.25", batch_size=3))


def test_full_policy_equals_lm_evals_hf_backend(folder, task_dir, full_run):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    # the byte tokenizer has no BOS/EOS: both sides use the config's EOS (2) as the empty-context prefix
    theirs = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32,device=cpu,prefix_token_id=2",
                             tasks=["tiny_choice"], num_fewshot=1, task_manager=TaskManager(include_path=str(task_dir)),
                             log_samples=True)  # lm-eval's default seeds, as run_tasks uses
    a, b = _lls(full_run), _lls(theirs)
    assert len(a) == len(b) == 18
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4
    assert full_run["results"]["tiny_choice"]["acc,none"] == theirs["results"]["tiny_choice"]["acc,none"]


def test_policies_inside_the_context(lm, full_run, h2o_quarter):
    """At 0.25 the few-shot context is evicted from, and each request's log-likelihood equals the naive
    reference's for the same tokens and C (a fraction of its own length); at 1.0 h2o is full."""
    from h2o_mini.evals.harness import PolicyLM
    assert max(abs(x - y) for x, y in zip(_lls(full_run), h2o_quarter)) > 1e-3
    ctx, cont = text_bytes(60, 100), text_bytes(5, 160)
    seq = ctx + cont
    full, _ = PolicyLM(lm)._loglikelihood_tokens([(None, ctx, cont)])[0]
    same, _ = PolicyLM(lm, "h2o", "1.0")._loglikelihood_tokens([(None, ctx, cont)])[0]
    assert abs(same - full) <= 1e-4
    got, _ = PolicyLM(lm, "h2o", "0.25")._loglikelihood_tokens([(None, ctx, cont)])[0]
    policy = make_policy("h2o", "0.25", len(seq) - 1)
    ref = restated_logits(lm.model, seq[:-1], policy, policy.capacity).log_softmax(-1)
    want = sum(ref[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
    assert abs(got - want) < 1e-4 and abs(got - full) > 1e-3


def test_tasks_under_a_policy_inside_transformers_give_h2o_minis_answers(folder, task_dir, h2o_quarter):
    """`eval tasks --engine transformers`: every request's log-likelihood under h2o at 0.25 as h2o-mini's decoder."""
    from h2o_mini.evals.harness import run_tasks
    theirs = api.load(folder, engine="transformers")
    got = _lls(run_tasks(theirs, ["tiny_choice"], str(task_dir), num_fewshot=1, log_samples=True, policy="h2o",
                         budget="0.25", batch_size=3))
    assert len(got) == 18 and max(abs(x - y) for x, y in zip(got, h2o_quarter)) <= 1e-4


def test_eval_tasks_cli_json_and_errors(folder, task_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    code, stdout, err = run_cli(capsys, monkeypatch, "eval", "tasks", "--model", folder, "--tasks", "tiny_choice",
                                "--include-path", task_dir, "--policy", "local", "--budget", 16, "--json",
                                "--output", out)
    assert code == 0, err
    row = json.loads(stdout)
    assert row["policy"] == "local" and row["budget"] == "16" and "acc,none" in row["results"]["tiny_choice"]
    cfg = api.load(folder).model.cfg  # a 16-slot cache (fp32 K and V, int64 position, fp32 score) per request
    assert row["kv_bits"] == 32 and row["kv_bytes"] == cfg.n_layer * cfg.n_kv_head * 16 * (2 * cfg.head_dim * 4 + 12)
    assert json.loads(out.read_text())["results"] == row["results"]
    one_line_error(run_cli(capsys, monkeypatch, "eval", "tasks", "--model", folder, "--tasks", "nope_task"),
                   "unknown task 'nope_task'")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files: /nonexistent.jsonl\n"
                                     "output_type: multiple_choice\ntest_split: test\n")
    one_line_error(run_cli(capsys, monkeypatch, "eval", "tasks", "--model", folder, "--tasks", "broken",
                           "--include-path", bad), "cannot load the tasks broken")
    one_line_error(run_cli(capsys, monkeypatch, "eval", "tasks", "--model", folder, "--tasks", "tiny_choice",
                           "--policy", "h2o", "--policy", "local"), "eval sweep tasks")


def test_shipped_task_and_its_builder():
    from h2o_mini.evals.harness import SHIPPED_TASKS
    from h2o_mini.evals.tasks.gpl_next_sentence import build
    folder = SHIPPED_TASKS / "gpl_next_sentence"
    shipped = [json.loads(line) for line in (folder / "gpl_next_sentence.jsonl").read_text().splitlines()]
    assert shipped == build.build(GPL3.read_text())  # the data is exactly what the script builds
    assert all(len(x["choices"]) == 4 and x["choices"][x["gold"]] for x in shipped)


# ---- needle in a haystack ----

def test_haystack_is_exact_length_with_the_needle_at_its_depth(lm):
    from h2o_mini.evals.needle import ANSWER_START, NEEDLE, QUESTION, haystack
    filler = lm.tokenizer.encode(GPL3.read_text(), special=False)
    asked = QUESTION + ANSWER_START  # a tiny byte model has no chat template: it is given the answer's start
    room = 300 - len(lm.tokenizer.encode(NEEDLE.format(n=123456) + asked, special=False))  # filler tokens
    spots = {}
    for depth in (0.0, 0.5, 1.0):
        ids, at = haystack(lm, filler, 300, depth, 123456)
        assert len(ids) == 300
        text = lm.tokenizer.decode(ids)
        assert NEEDLE.format(n=123456) in text and text.endswith(asked)
        spots[depth] = (ids, at)
    assert spots[0.0][1] == 0 and spots[1.0][1] == room
    ids, at = spots[0.5]
    periods = [j for j in range(1, room) if lm.tokenizer.decode(filler[j - 1:j]) == "."]
    assert at == min(periods, key=lambda j: abs(j - round(room / 2)))  # the nearest sentence end to the middle


def test_needle_cli(folder, tmp_path, capsys, monkeypatch):
    png = tmp_path / "needle.png"
    code, out, err = run_cli(capsys, monkeypatch, "eval", "needle", "--model", folder, "--lengths", "200,300",
                             "--depths", "0.2,0.8", "--policy", "full", "--policy", "h2o", "--budget", "0.5",
                             "--prefill", "stream", "--json", "--plot", png)
    assert code == 0, err
    cells = [json.loads(line) for line in out.splitlines()]
    assert len(cells) == 2 * 2 * 2
    keys = {"policy", "budget", "prefill", "length", "depth", "seed", "found", "answer", "kv_bits", "kv_bytes"}
    assert all(keys <= set(c) for c in cells) and {c["policy"] for c in cells} == {"full", "h2o"}
    h2o_bytes = {c["length"]: c["kv_bytes"] for c in cells if c["policy"] == "h2o"}
    full_bytes = {c["length"]: c["kv_bytes"] for c in cells if c["policy"] == "full"}
    assert all(0.45 < h2o_bytes[n] / full_bytes[n] < 0.51 for n in (200, 300))  # budget 0.5 of the sequence
    assert png.read_bytes()[:4] == b"\x89PNG"
    short = tmp_path / "short.txt"
    short.write_text("Too short to hide a needle in. " * 5)
    for args, needle in ((["--depths", "1.5"], "outside [0, 1]"), (["--lengths", "99999"], "past the model's 512"),
                         (["--lengths", "400", "--text", short], "longer than the filler"),
                         (["--lengths", "abc"], "not a comma-separated list")):
        one_line_error(run_cli(capsys, monkeypatch, "eval", "needle", "--model", folder, *args), needle)


# ---- sweeps ----

def test_sweep_ppl_resumes_and_plots(folder, tmp_path, capsys, monkeypatch):
    out, png = tmp_path / "sweep.jsonl", tmp_path / "sweep.png"
    args = ["eval", "sweep", "ppl", "--model", folder, "--text", GPL3, "--tokens", 64, "--policy", "full",
            "--policy", "local", "--policy", "h2o", "--budget", "0.25", "--budget", "0.5", "--out", out]
    code, stdout, err = run_cli(capsys, monkeypatch, *args, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("local", "0.25"), ("local", "0.5"),
                                                         ("h2o", "0.25"), ("h2o", "0.5")]
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # as if interrupted after two points
    from h2o_mini.evals import sweep
    ran = []
    real = sweep.run_sweep

    def counting(kind, todo, run_points, *a, **kw):
        return real(kind, todo, lambda points: ran.extend(points) or run_points(points), *a, **kw)
    monkeypatch.setattr("h2o_mini.cli.eval_sweep.run_sweep", counting)
    code, stdout, err = run_cli(capsys, monkeypatch, *args, "--plot", png)
    assert code == 0, err
    assert ran == [("local", "0.5"), ("h2o", "0.25"), ("h2o", "0.5")]  # the first two were skipped
    # The same rows, but for the time, the batch and the memory free when it ran (3 rows now, 4 before: a batched
    # matmul may round a row's last bits differently in another batch, so numbers to 1e-9)
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r.keys() for r in again] == [r.keys() for r in rows]
    for mine, theirs in zip(again, rows):
        for k, v in mine.items():
            if isinstance(v, float) and not k.startswith("seconds"):
                assert abs(v - theirs[k]) <= 1e-9 * max(1.0, abs(v)), k
            elif not k.startswith("seconds") and k not in ("batch", "memory"):
                assert v == theirs[k], k
        if "memory" in mine:  # the estimate of a row's bytes depends on the rows' widest C only
            assert mine["memory"]["row_bytes"] == theirs["memory"]["row_bytes"]
    assert "h2o" in stdout and png.read_bytes()[:4] == b"\x89PNG"


def test_eval_ppl_refuses_repeated_policies(folder, capsys, monkeypatch):
    one_line_error(run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 10,
                           "--policy", "h2o", "--policy", "local", "--budget", 4), "eval sweep ppl")


# ---- the attention power law ----

def test_accumulated_attention_is_every_querys_probabilities(lm):
    from h2o_mini.evals.attention import accumulated_attention, top_share
    ids = text_bytes(40, 900)
    got = accumulated_attention(lm.model, ids, [0, 1])
    cfg = lm.model.cfg
    for layer in (0, 1):
        assert got[layer].shape == (40,)
        assert math.isclose(got[layer].sum().item(), 40 * cfg.n_head, rel_tol=1e-5)  # every query's rows sum to 1
        assert got[layer][0] > got[layer][-1]  # the first token is seen by all 40 queries, the last by one
    flat = torch.ones(10)
    assert math.isclose(top_share(flat), 0.2, rel_tol=1e-6)
    assert math.isclose(top_share(torch.tensor([9.0] + [1 / 9] * 9)), 0.9 + 1 / 90, rel_tol=1e-6)


def test_plot_attention_cli(folder, tmp_path, capsys, monkeypatch):
    png = tmp_path / "attn.png"
    code, out, err = run_cli(capsys, monkeypatch, "plot", "attention", "--model", folder, "--tokens", 64,
                             "--layers", "0,1", "--out", png, "--json")
    assert code == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["layer"] for x in lines] == [0, 1] and all(0.2 <= x["top20_share"] <= 1 for x in lines)
    assert png.read_bytes()[:4] == b"\x89PNG"
    one_line_error(run_cli(capsys, monkeypatch, "plot", "attention", "--model", folder, "--layers", "7",
                           "--out", png), "--layers")


def test_sweep_needle_and_tasks(folder, task_dir, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "eval", "sweep", "needle", "--model", folder, "--lengths", 200,
                             "--depths", "0.5", "--policy", "full", "--policy", "local", "--budget", "0.5",
                             "--budget", 64)
    assert code == 0, err
    table = out.splitlines()
    assert table[0].split() == ["policy", "budget", "found"] and len(table) == 4  # full, local 0.5, local 64
    out_file = tmp_path / "tasks.jsonl"
    code, out, err = run_cli(capsys, monkeypatch, "eval", "sweep", "tasks", "--model", folder, "--tasks",
                             "tiny_choice", "--include-path", task_dir, "--policy", "full", "--policy", "h2o",
                             "--budget", "0.5", "--out", out_file, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("h2o", "0.5")]
    assert all(r["metric"] == "acc,none" and 0 <= r["score"] <= 1 for r in rows)
    one_line_error(run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3,
                           "--tokens", 10, "--out", tmp_path / "x.txt"), "unknown extension")


class _Request:  # what lm-eval hands a model: an object with .args
    def __init__(self, *args):
        self.args = args


def test_generate_until_and_loglikelihood_rolling(lm):
    from h2o_mini.evals.harness import PolicyLM
    harness = PolicyLM(lm, "h2o", 16)
    context = GPL3.read_text()[2000:2100]
    free = api.generate(lm, context, policy="h2o", budget=16, max_new_tokens=12, chat=False, prefill="dense")
    stop = free[3:5]  # a stop string that occurs in the greedy continuation
    [got] = harness.generate_until([_Request(context, {"until": [stop], "max_gen_toks": 12})])
    assert got == free.split(stop)[0] and len(got) < len(free)
    want = api.generate(lm, context, max_new_tokens=12, chat=False)
    never = want + "\x00"  # longer than the whole greedy continuation: it cannot occur in it, whatever the weights
    [whole] = PolicyLM(lm).generate_until([_Request(context, {"until": [never], "max_gen_toks": 12})])
    assert whole == want
    text = GPL3.read_text()[3000:3050]
    [rolling] = PolicyLM(lm).loglikelihood_rolling([_Request(text)])
    x = torch.tensor([[2] + lm.tokenizer.encode(text)])  # one window, after EOS (2) as lm-eval's prefix
    lp = lm.model(x, torch.arange(x.shape[1])[None])[0, :-1].log_softmax(-1)
    assert abs(rolling - lp.gather(1, x[0, 1:, None]).sum().item()) < 1e-3
