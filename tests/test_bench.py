"""`bench`: each configuration's own peak memory, rows as they finish, curves against context and their plot.
Nothing here depends on timing: only memory, counts and the shapes of the output are checked."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h2o_mini import api, errors
from h2o_mini.evals import bench

from .test_bad_input import run_cli
from .test_cli import assert_one_line_error, run


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


linux_peak = pytest.mark.skipif(not sys.platform.startswith("linux") or not bench.reset_peak(torch.device("cpu")),
                                reason="needs Linux's resettable VmHWM")


@linux_peak
def test_reset_peak_forgets_what_came_before():
    cpu = torch.device("cpu")
    big = torch.ones(100_000_000 // 4)  # 100 MB, touched
    del big
    assert bench.reset_peak(cpu)
    small = torch.ones(10_000_000 // 4)
    peak = bench.read_peak(cpu, True)
    del small
    assert bench.reset_peak(cpu)
    big = torch.ones(100_000_000 // 4)
    assert bench.read_peak(cpu, True) >= peak + 80_000_000  # the second peak sees the big tensor, the first did not


@linux_peak
def test_each_configuration_reports_its_own_peak(folder):
    """full vs h2o at a quarter of the slots: the peaks differ by about the KV bytes they differ by (not the
    process's one peak, the same in every row)."""
    r = run("bench", "--model", folder, "--policy", "full", "--policy", "h2o", "--budget", "0.25", "--batch", 256,
            "--prompt-tokens", 496, "--new-tokens", 4, "--same-prompt", "--json")
    assert r.returncode == 0, r.stderr
    full, h2o = (json.loads(line) for line in r.stdout.splitlines())
    kv_saved = full["kv_bytes"] - h2o["kv_bytes"]  # 54 MB
    assert full["peak_mem_bytes"] - h2o["peak_mem_bytes"] >= kv_saved / 2


def test_rows_are_yielded_as_each_configuration_finishes(folder, monkeypatch):
    calls = []
    real = bench.bench_one
    monkeypatch.setattr(bench, "bench_one", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rows = bench.run_bench(api.load(folder), ("full", "h2o"), ("0.5",), None, 1, 8, 3, "dense", bench.DEFAULT_TEXT.read_text(),
                           None, 8, False, False)
    first = next(rows)
    assert first["policy"] == "full" and len(calls) == 1  # the second configuration has not started
    assert next(rows)["policy"] == "h2o" and len(calls) == 2


def test_curves_over_prompt_tokens_and_batches_and_their_plot(folder, tmp_path):
    out = tmp_path / "bench.png"
    r = run("bench", "--model", folder, "--policy", "full", "--policy", "h2o", "--budget", "0.5", "--prompt-tokens", 8,
            "--prompt-tokens", 16, "--batch", 1, "--batch", 2, "--new-tokens", 3, "--json", "--plot", out)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["prompt_tokens"], x["batch"], x["policy"]) for x in rows] == [
        (n, b, p) for n in (8, 16) for b in (1, 2) for p in ("full", "h2o")]
    assert all(x["kv_bytes"] > 0 and (x["decode_tok_s"] is None or x["decode_tok_s"] > 0) for x in rows)
    by = {(x["prompt_tokens"], x["batch"], x["policy"]): x["kv_bytes"] for x in rows}
    assert by[16, 2, "full"] > by[8, 2, "full"] and by[16, 2, "full"] == 2 * by[16, 1, "full"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_rows_line_up_under_the_header(folder):
    r = run("bench", "--model", folder, "--policy", "full", "--policy", "local", "--budget", "4", "--prompt-tokens", 8,
            "--new-tokens", 3)
    assert r.returncode == 0, r.stderr
    header, *lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(len(line) == len(header) for line in lines)
    assert header.split()[:2] == ["policy", "budget"] and lines[1].split()[:2] == ["local", "4"]


def test_bad_bench_plot_and_batches(folder, tmp_path):
    assert_one_line_error(run("bench", "--model", folder, "--plot", tmp_path / "x.gif"), "unknown extension")
    assert_one_line_error(run("bench", "--model", folder, "--kv-memory", "1MB", "--batch", 1, "--batch", 2),
                          "--kv-memory")


def test_the_gpu_script_runs_dry_on_cpu(folder, tmp_path):
    """scripts/gpu/run.sh --dry-run: every step of the GPU run (parity tests, the bench curve and plot, the
    OPT-shaped latency/throughput runs, policies batched as rows) on CPU with tiny shapes, so the script does not
    rot before a GPU runs it."""
    script = Path(__file__).resolve().parent.parent / "scripts/gpu/run.sh"
    # from another folder, with no venv on PATH: the script must use the interpreter it is given
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if not Path(p, "h2o-mini").exists() and not Path(p, "pytest").exists())
    env = {**os.environ, "MODEL": str(folder), "PYTHON": sys.executable, "PATH": path}
    r = subprocess.run(["bash", str(script), "--dry-run", "out"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    tmp_path = tmp_path / "out"  # a relative OUT is the caller's folder's
    assert " passed" in (tmp_path / "parity.txt").read_text()
    rows = [json.loads(line) for line in (tmp_path / "default_bf16.jsonl").read_text().splitlines()]
    assert {(x["policy"], x["prompt_tokens"]) for x in rows} == {(p, n) for p in ("full", "h2o") for n in (16, 32)}
    assert (tmp_path / "default_bf16.png").stat().st_size > 0
    opt = [json.loads(line) for line in (tmp_path / "opt_random.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["policy"]) for x in opt] == [(k, p) for k in ("latency", "throughput") for p in ("full", "h2o")]
    latency, throughput = opt[:2], opt[2:]
    assert latency[0]["batch"] == latency[1]["batch"]
    assert throughput[1]["batch"] > throughput[0]["batch"]  # a fifth of the cache: more rows in the same memory
    assert "latency full / h2o" in (tmp_path / "opt_random.md").read_text()
    cost = (tmp_path / "batched_cost.txt").read_text().splitlines()  # batched against one by one, both ways
    assert [line[:2] for line in cost] == ["1.", "1.", "2.", "3."] and "one batch" in cost[-1]


def test_the_gpu_script_fails_loudly(tmp_path):
    """A step that fails stops the script with a non-zero exit and a line on stderr naming where."""
    script = Path(__file__).resolve().parent.parent / "scripts/gpu/run.sh"
    r = subprocess.run(["bash", str(script), "--dry-run", str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": str(tmp_path / "no-such-python")})
    assert r.returncode != 0 and "scripts/gpu/run.sh: failed" in r.stderr


def test_the_sweep_cost_split_attributes_every_part(folder):
    """scripts/benchmarks/sweep_cost.py (docs/benchmarks.md): the parts are timed where they run, nested timers
    subtracted, so a hook counted twice or a part counted outside its parent shows as a negative part; each rule's
    hooks are named, and the sweep's numbers are its ordinary ones."""
    script = Path(__file__).resolve().parent.parent / "scripts/benchmarks/sweep_cost.py"
    r = subprocess.run([sys.executable, str(script), "--model", str(folder), "--tokens", "48", "--chunk", "16",
                        "--policy", "h2o", "--policy", "expected_attention", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout)
    parts = row["parts_s"]
    assert {"hooks: h2o", "hooks: expected_attention", "forward", "scoring", "loop (less its hooks)"} <= set(parts)
    assert all(v >= 0 for v in parts.values()), parts
    assert row["points"] == 4 and abs(sum(parts.values()) - row["sweep_s"]) < 0.1 * len(parts)
    assert 0 < row["nll_h2o_0.1"] < 20
    per_token = row["hooks_us_per_token"]  # a rule's hooks over its 2 points x 48 tokens x the layers, in us
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert set(per_token) == {"h2o", "expected_attention"}
    assert abs(per_token["h2o"] - parts["hooks: h2o"] * 1e6 / (2 * 48 * layers)) <= 0.01 + 0.1e6 / (2 * 48 * layers)


def test_ctrl_c_in_bench_before_any_row_says_how_far_it_got(folder, capsys, monkeypatch):
    from h2o_mini.evals import bench

    def interrupted(*a, status=None, **kw):
        status["stage"] = "decode step 3 of 7"
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "bench_one", interrupted)
    code, out, err = run_cli(capsys, monkeypatch, "bench", "--model", folder, "--policy", "h2o", "--budget", "0.5",
                             "--prompt-tokens", 16, "--new-tokens", 8)
    assert code == 130 and out == ""
    assert "before any configuration finished" in err and "h2o budget=0.5" in err and "decode step 3 of 7" in err


def test_out_of_memory_is_one_line_naming_the_size_and_what_to_lower(folder, capsys, monkeypatch):
    from h2o_mini.evals import bench
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
