"""Bad input at the level where the user meets it: every case is one line on stderr and a non-zero exit
(or the documented behaviour), never a traceback. The CLI runs in-process here (`cli.main`, exactly what
the `h2o-mini` script calls), so the table stays fast; test_cli.py runs real subprocesses."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from h2o_mini import H2O, UserError, api, cli, perplexity
from h2o_mini.evals.bench import rate
from h2o_mini.files import write_atomic
from h2o_mini.generate import Sampling
from h2o_mini.weights import prepared

from .conftest import GPL3


def run_cli(capsys, monkeypatch, *args):
    """(exit code, stdout, stderr) of `h2o-mini ARGS`, run in this process."""
    monkeypatch.setattr(sys, "argv", ["h2o-mini", *map(str, args)])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(result, needle):
    code, _, err = result
    assert code != 0, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


def edited(folder, tmp_path, config=None, tensors=None, files=None):
    """A copy of the checkpoint with config.json keys, tensors or whole files replaced."""
    out = tmp_path / "ckpt"
    shutil.copytree(folder, out)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config(cfg) or cfg))
    if tensors is not None:
        t = load_file(out / "model.safetensors")
        tensors(t)
        save_file(t, out / "model.safetensors")
    for name, data in (files or {}).items():
        if data is None:
            (out / name).unlink()
        else:
            (out / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return out


def _set(**kw):
    return lambda cfg: cfg.update(kw)


CHECKPOINTS = {
    "config not an object": (dict(files={"config.json": "[1, 2]"}), "must hold a JSON object"),
    "config wrong type": (dict(config=_set(num_hidden_layers="2")), "'num_hidden_layers' is '2', expected int"),
    "config negative size": (dict(config=_set(hidden_size=-64)), "'hidden_size' is -64"),
    "config NaN": (dict(config=_set(rms_norm_eps=math.nan)), "expected a finite number"),
    "config bool as int": (dict(config=_set(vocab_size=True)), "'vocab_size' is True"),
    "config heads do not split": (dict(config=_set(num_key_value_heads=3)), "do not split into 3 KV heads"),
    "config eos not an id": (dict(config=_set(eos_token_id="x")), "'eos_token_id'"),
    "config rope params": (dict(config=_set(rope_scaling=[1])), "'rope_scaling' is [1], expected dict"),
    "tokenizer.json corrupt": (dict(files={"tokenizer.json": b"\x00\xffnot json"}), "cannot read"),
    "tokenizer.model corrupt": (dict(files={"tokenizer.json": None, "tokenizer.model": b"\x08\x01garbage"}),
                                "cannot read"),
    "tokenizer_config not an object": (dict(files={"tokenizer_config.json": "3"}), "must hold a JSON object"),
    "chat template not a string": (dict(files={"tokenizer_config.json": '{"chat_template": 5}'}),
                                   "chat_template must be a string"),
    "bos token not a string": (dict(files={"tokenizer_config.json": '{"bos_token": 7}'}), "bos_token is 7"),
    "index not an object": (dict(files={"model.safetensors.index.json": "[]"}), "not a valid safetensors index"),
    "index escapes the folder": (dict(files={"model.safetensors.index.json":
                                             '{"weight_map": {"a": "../x.safetensors"}}'}), "names the shard"),
    "index values not names": (dict(files={"model.safetensors.index.json": '{"weight_map": {"a": [1]}}'}),
                               "names the shard"),
    "NaN weights": (dict(tensors=lambda t: t["model.norm.weight"].__setitem__(0, math.nan)),
                    "model.norm.weight in the checkpoint holds NaN"),
    "inf weights": (dict(tensors=lambda t: t["model.layers.0.mlp.up_proj.weight"].__setitem__((0, 0), math.inf)),
                    "holds NaN or infinite"),
    "vocab smaller than the tokenizer": (dict(config=_set(vocab_size=100), tensors=lambda t: t.update(
        {"model.embed_tokens.weight": t["model.embed_tokens.weight"][:100].clone()})),
        "the tokenizer has 256 ids but the model only 100"),
}


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_malformed_checkpoints(case, folder, tmp_path, capsys, monkeypatch):
    edits, needle = CHECKPOINTS[case]
    bad = edited(folder, tmp_path, **edits)
    one_line_error(run_cli(capsys, monkeypatch, "generate", "--model", bad, "--max-new-tokens", 2, "hi"), needle)


OPTIONS = {
    "device gpu": (["generate", "--device", "gpu", "hi"], "unknown device 'gpu'"),
    "temperature NaN": (["generate", "--temperature", "nan", "hi"], "not a finite number"),
    "top-p inf": (["generate", "--top-p", "inf", "hi"], "--top-p"),
    "seed too large": (["generate", "--seed", 10**20, "hi"], "--seed"),
    "max-new-tokens too large": (["generate", "--max-new-tokens", 10**12, "hi"], "--max-new-tokens"),
    "budget NaN": (["generate", "--policy", "h2o", "--budget", "nan", "hi"], "budget 'nan' must be"),
    "budget 1.5": (["generate", "--policy", "h2o", "--budget", "1.5", "hi"], "1.0 = everything"),
    "budget huge": (["generate", "--policy", "h2o", "--budget", 10**12, "hi"], "too large"),
    "recent -1": (["generate", "--policy", "h2o", "--budget", 8, "--recent", "-1", "hi"], "--recent '-1' must be"),
    "budget for full": (["generate", "--budget", "0.2", "hi"], "--budget does not apply"),
    "recent for local": (["generate", "--policy", "local", "--budget", 8, "--recent", 2, "hi"],
                         "--recent does not apply to policy 'local'"),
    "whitespace prompt": (["generate", "   "], "empty or only whitespace"),
    "no prompt": (["generate"], "give a PROMPT"),
    "text is a folder": (["eval", "ppl", "--text", "/usr/share", "--tokens", 10], "is a folder"),
    "chunk 0": (["eval", "ppl", "--text", GPL3, "--tokens", 10, "--chunk", 0], "--chunk"),
    "bench later budget bad": (["bench", "--policy", "h2o", "--budget", "0.2", "--budget", "abc"], "not a number"),
    "bench kv-memory NaN": (["bench", "--kv-memory", "nan"], "--kv-memory"),
    "bench budget only for full": (["bench", "--budget", "0.2"], "--budget does not apply"),
    "bench repeat too large": (["bench", "--repeat", 10**6], "--repeat"),
    "plot unknown extension": (["plot", "kept", "--out", "kept.txt"], "unknown extension '.txt'"),
    "plot missing folder": (["plot", "kept", "--out", "/nonexistent/dir/kept.png"], "does not exist"),
    "eval budget past 1": (["eval", "ppl", "--text", GPL3, "--tokens", 10, "--policy", "local", "--budget", "2.5"],
                           "a fraction in (0, 1]"),
}


@pytest.mark.parametrize("case", OPTIONS)
def test_bad_options(case, folder, capsys, monkeypatch):
    args, needle = OPTIONS[case]
    result = run_cli(capsys, monkeypatch, *args[:2], "--model", folder, *args[2:]) if args[0] in ("eval", "plot") \
        else run_cli(capsys, monkeypatch, args[0], "--model", folder, *args[1:])
    one_line_error(result, needle)
    assert result[1] == ""  # nothing ran before the error


def test_prompt_and_prompts_file_together(folder, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    one_line_error(run_cli(capsys, monkeypatch, "generate", "--model", folder, "--prompts-file", prompts, "three"),
                   "not both")


def test_output_on_a_full_disk(folder):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "h2o_mini", "generate", "--model", str(folder), "--max-new-tokens",
                            "4", "hi"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot write the output" in r.stderr and "Traceback" not in r.stderr


def test_unwritable_model_cache(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("H2O_MINI_CACHE", str(blocker / "cache"))
    one_line_error(run_cli(capsys, monkeypatch, "generate", "hi"), "cannot write the model cache")


def test_stale_conversion_folders_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_MINI_CACHE", str(tmp_path))
    target = prepared.model_dir()
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_text("")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".tmp-{dead.pid}-abc").mkdir()  # a conversion whose process was killed
    (tmp_path / f".tmp-{os.getpid()}-xyz").mkdir()  # one still running (this process)
    assert prepared.prepare_model("default", log=lambda m: None) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".tmp-{os.getpid()}-xyz", target.name]


def test_outputs_keep_the_umask_and_never_half_written(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a.txt", lambda p: p.write_text("done"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o640

    def interrupted(p):
        p.write_text("half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "b.txt", interrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no b.txt, no temporary file


def test_rates_are_never_negative_or_infinite():
    assert rate(10, 2.0) == 5.0
    assert rate(10, 0.0) is None and rate(10, -1e-3) is None


# ---- positions: learned positions (OPT) refuse, RoPE (LLaMA, NeoX) warns; generation is capped ----

def test_positions_per_family(byte_folder, capsys, monkeypatch):
    opt, llama = byte_folder("opt_pre_ln_proj"), byte_folder("llama_gqa_tied")  # both: 512 positions
    capsys.readouterr()  # building them printed progress
    long_prompt = "x" * 600
    for args in (["generate", "--model", opt, long_prompt], ["eval", "ppl", "--model", opt, "--text", GPL3,
                 "--tokens", 600], ["bench", "--model", opt, "--prompt-tokens", 500, "--new-tokens", 100],
                 ["plot", "kept", "--model", opt, "--tokens", 600, "--out", "/tmp/never.png"]):
        one_line_error(run_cli(capsys, monkeypatch, *args), "learned position embeddings end there")
    code, out, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", llama, "--text", GPL3, "--tokens", 600,
                             "--policy", "h2o", "--budget", 64, "--json")
    assert code == 0 and "warning" in err and "past the 512 positions" in err and len(err.strip().splitlines()) == 1
    assert json.loads(out)["tokens"] == 600
    code, out, err = run_cli(capsys, monkeypatch, "generate", "--model", opt, "--max-new-tokens", 10**5, "Hello")
    assert code == 0 and "generating at most 507 new tokens, not 100000" in err, err


# ---- the Python API ----

@pytest.fixture(scope="module")
def lm(folder):
    return api.load(folder)


@pytest.mark.parametrize("call,needle", [
    (lambda lm: api.generate(lm, "hi", prefill="bogus"), "unknown prefill mode 'bogus'"),
    (lambda lm: api.generate(lm, "hi", policy=H2O(heavy=-1, recent=2)), "heavy=-1"),
    (lambda lm: api.generate(lm, "hi", policy=H2O(heavy=0, recent=0)), "at least one token"),
    (lambda lm: api.generate(lm, "hi", sampling=Sampling(temperature=-1)), "temperature"),
    (lambda lm: api.generate(lm, "hi", sampling=Sampling(top_p=0)), "top_p"),
    (lambda lm: api.generate(lm, []), "at least one prompt"),
    (lambda lm: api.generate(lm, ["hi", 3]), "must be a string"),
    (lambda lm: api.generate(lm, "hi", max_new_tokens=0), "max_new_tokens 0"),
    (lambda lm: api.generate(lm, "hi", policy=H2O(heavy=2, recent=2), budget=0.5), "not both"),
    (lambda lm: api.generate(lm, "hi", seed=-1), "seed"),
    (lambda lm: perplexity(lm, GPL3.read_text(), 1), ">= 2"),
    (lambda lm: api.load("/nonexistent"), "does not exist"),
])
def test_api_refuses_nonsense(lm, call, needle):
    with pytest.raises(UserError) as e:
        call(lm)
    assert needle in str(e.value)


def test_batch_fraction_is_of_the_longest_row(lm):
    """Documented: in a batch a fractional budget is taken of the longest prompt + max_new_tokens."""
    short, long = "Hello there", "A much longer prompt, " * 4
    n_long = len(lm.tokenizer.encode(long))
    batch = api.generate(lm, [short, long], policy="h2o", budget=0.25, max_new_tokens=16, chat=False)
    as_count = H2O.from_budget(round(0.25 * (n_long + 16)), None)
    assert batch[0] == api.generate(lm, short, policy=as_count, max_new_tokens=16, chat=False)


def test_chat_template_from_a_jinja_file_is_used_by_default(folder, tmp_path):
    ckpt = edited(folder, tmp_path, files={"chat_template.jinja": "<{{ messages[0]['content'] }}>"})
    chatty = api.load(ckpt)
    assert chatty.tokenizer.chat_template == "<{{ messages[0]['content'] }}>"
    assert api.encode_prompts(chatty, ["hi"]) == [chatty.tokenizer.encode("<hi>", special=False)]
    assert api.encode_prompts(chatty, ["hi"], chat=False) == [chatty.tokenizer.encode("hi")]
    assert api.encode_prompts(api.load(folder), ["hi"]) == [chatty.tokenizer.encode("hi")]  # none: raw


# ---- Ctrl-C: what was finished is printed, then exit 130 ----

def test_ctrl_c_in_bench_prints_the_finished_rows(folder, capsys, monkeypatch):
    from h2o_mini.evals import bench
    real, calls = bench.bench_one, []

    def interrupted_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(bench, "bench_one", interrupted_second)
    args = ["bench", "--model", folder, "--policy", "full", "--policy", "h2o", "--budget", "0.5",
            "--prompt-tokens", 16, "--new-tokens", 4]
    code, out, err = run_cli(capsys, monkeypatch, *args, "--json")
    assert code == 130 and "interrupted" in err
    assert [json.loads(line)["policy"] for line in out.splitlines()] == ["full"]
    calls.clear()
    code, out, err = run_cli(capsys, monkeypatch, *args)
    assert code == 130 and out.splitlines()[0].split()[0] == "policy" and len(out.splitlines()) == 2


def test_ctrl_c_in_batched_generate_prints_the_rows_so_far(folder, tmp_path, capsys, monkeypatch):
    from h2o_mini.generate import Decoder
    real = Decoder.generate

    def three_then_interrupt(self, *a, **kw):
        for i, token in enumerate(real(self, *a, **kw)):
            if i == 3:
                raise KeyboardInterrupt
            yield token
    monkeypatch.setattr(Decoder, "generate", three_then_interrupt)
    prompts = tmp_path / "p.txt"
    prompts.write_text("first prompt\nsecond one\n")
    code, out, err = run_cli(capsys, monkeypatch, "generate", "--model", folder, "--prompts-file", prompts,
                             "--max-new-tokens", 20)
    assert code == 130 and "interrupted" in err
    assert out.count("### ") == 2 and "### first prompt" in out and "### second one" in out
