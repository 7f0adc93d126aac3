"""`h2o-mini eval tasks --policy full` answers what lm-eval's own `hf` backend answers on the same weights.

Both run the same three request types through lm-eval's `simple_evaluate` with lm-eval's default seeds (what
the `lm_eval` command uses): a 4-choice next-sentence task with 2 few-shot examples (loglikelihood), paragraphs
scored whole (loglikelihood_rolling) and greedy sentence endings (generate_until); the tasks ship in
tests/tasks. Every request's answer is compared: log-likelihoods to 1e-4 nats, is_greedy and generated strings
exactly, and so every metric. On a tiny seeded LLaMA (byte tokens, 512 positions, so the longer paragraphs
take several rolling windows) and, marked slow, on the default model's converted folder.
"""
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from .conftest import bytes_to_unicode
from .test_bad_input import run_cli

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

TASKS = str(Path(__file__).with_name("tasks"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the hf backend's run needs no hub either


def close(got: float, want: float) -> bool:
    """1e-4 nats: fp32 log-probs from two attention kernels. Both sides also sum them in fp32, whose own
    resolution reaches 1e-4 near 1000 nats (a whole paragraph): there, a relative 1e-6."""
    return abs(got - want) <= max(1e-4, 1e-6 * abs(want))


def ours(capsys, monkeypatch, tmp_path, folder, task, shots, limit) -> dict:
    out = tmp_path / f"{task}.json"
    code, _, err = run_cli(capsys, monkeypatch, "eval", "tasks", "--model", folder, "--tasks", task,
                           "--include-path", TASKS, "--num-fewshot", shots, "--limit", limit, "--policy", "full",
                           "--output", out, "--log-samples", "--json")
    assert code == 0, err
    return json.loads(out.read_text())


def theirs(folder, task, shots, limit) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from h2o_mini.evals.harness import SHIPPED_TASKS
    return simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32,device=cpu", tasks=[task],
                           num_fewshot=shots, limit=limit, log_samples=True, batch_size=4,
                           task_manager=TaskManager(include_path=[str(SHIPPED_TASKS), TASKS]))


def assert_same_answers(a: dict, b: dict, task: str, n: int):
    sa, sb = a["samples"][task], b["samples"][task]
    assert len(sa) == len(sb) == n
    for x, y in zip(sa, sb):
        assert x["doc_id"] == y["doc_id"] and x["arguments"] == json.loads(json.dumps(y["arguments"], default=str))
        for ra, rb in zip(x["resps"], y["resps"]):
            got, want = ra[0], rb[0]
            if isinstance(want, str):  # generate_until
                assert got == want
            elif isinstance(want, (list, tuple)):  # loglikelihood: (log p, is_greedy)
                assert close(got[0], want[0]) and got[1] == want[1], (x["doc_id"], got, want)
            else:  # loglikelihood_rolling: the summed log p of the whole document
                assert close(got, want), (x["doc_id"], got, want)
    for metric, want in b["results"][task].items():
        if isinstance(want, float) and "stderr" not in metric:
            got = a["results"][task][metric]
            assert got == want if metric.startswith(("acc", "exact")) else math.isclose(got, want, rel_tol=1e-6)


CASES = [("gpl_next_sentence", 2, 12), ("parity_rolling", 0, 8), ("parity_until", 0, 10)]
REAL_CASES = [(task, shots, limit // 2) for task, shots, limit in CASES]  # the default model: 10x the time a request


@pytest.fixture(scope="module")
def tiny_folder(tiny, tmp_path_factory):
    """The tiny LLaMA (256 ids) with a byte-level tokenizer in which ids 1 and 2, the config's BOS and EOS, are
    special tokens <s> and </s> (bytes 1 and 2 never occur in the tasks' text), as a real checkpoint has them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    folder = tmp_path_factory.mktemp("parity") / "tiny"
    shutil.copytree(tiny("llama_gqa_tied")[0], folder)
    vocab = {c: b for b, c in bytes_to_unicode().items() if b not in (1, 2)} | {"<s>": 1, "</s>": 2}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.mark.parametrize("task,shots,limit", CASES)
def test_tiny_model_answers_as_lm_evals_hf_backend(tiny_folder, task, shots, limit, capsys, monkeypatch, tmp_path):
    assert_same_answers(ours(capsys, monkeypatch, tmp_path, tiny_folder, task, shots, limit),
                        theirs(tiny_folder, task, shots, limit), task, limit)


@pytest.mark.slow
@pytest.mark.parametrize("task,shots,limit", REAL_CASES)
def test_default_model_answers_as_lm_evals_hf_backend(task, shots, limit, capsys, monkeypatch, tmp_path):
    from h2o_mini.weights import prepared
    folder = prepared.prepare_model("default", log=lambda m: None)
    assert_same_answers(ours(capsys, monkeypatch, tmp_path, folder, task, shots, limit),
                        theirs(folder, task, shots, limit), task, limit)
