"""Tensor parallel on CPU (gloo), 2 ranks: every rank holds and evicts half of the KV heads, and the logits and
greedy tokens equal the single-process run's for every registered policy, family and prefill mode, batched
and compiled. The command line under torchrun: rank 0 alone prints, results equal one process's, a number of
ranks that does not divide the KV heads is refused."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h2o_mini.generate import Decoder
from h2o_mini.parallel import Shard
from h2o_mini.policies import REGISTRY, make_policy
from h2o_mini.weights.hf import load_hf

from .conftest import GPL3, TEST_DEVICE, add_byte_tokenizer, text_bytes
from .test_cli import run

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu" or not dist.is_available(), reason="gloo on CPU")
# 4, 2, 4, 4, 2, 2, 2 KV heads; Mistral with a window of 5 and Gemma 2 (windows, soft-caps) shard like LLaMA
FAMILIES = ["llama_mha", "llama_gqa_tied", "opt_pre_ln_proj", "neox_parallel", "qwen2_bias", "mistral_window",
            "gemma2_softcap"]
T, C, N = 40, 9, 26  # tokens, capacity, dense prompt
IDS = text_bytes(T, offset=3000)
# not the GPL's first bytes: its run of spaces gives KeyDiff exact ties that rounding breaks either way
PROMPTS = [text_bytes(30, 100), text_bytes(17, 700), text_bytes(25, 1500)]


@torch.inference_mode()
def outputs(model, compiled: bool) -> dict:
    """Everything compared: teacher-forced logits (dense prompt + steps, stream chunks) and greedy tokens of a
    ragged batch (dense and stream prefill) under every policy; with `compiled`, h2o's compiled decode step."""
    out = {}
    for name in REGISTRY:
        policy = make_policy(name, None if name == "full" else C, T)
        decoder = Decoder(model, chunk=7)
        cache = decoder.new_cache(policy, 1, T)
        x, pos = torch.tensor([IDS]), torch.arange(T)[None]
        dense = [model(x[:, :N], pos[:, :N], cache)]
        dense += [model(x[:, t:t + 1], pos[:, t:t + 1], cache) for t in range(N, T)]
        cache = decoder.new_cache(policy, 1, T, "stream")
        stream = [model(x[:, s:s + 7], pos[:, s:s + 7], cache) for s in range(0, T, 7)]
        out[name, "logits"] = torch.cat(dense + stream, 1)
        if name == "h2o":  # 4-bit keys and values: quantization groups lie within a head, so within a rank
            cache = Decoder(model, kv_bits=4).new_cache(policy, 1, T)
            quantized = [model(x[:, :N], pos[:, :N], cache)]
            quantized += [model(x[:, t:t + 1], pos[:, t:t + 1], cache) for t in range(N, T)]
            out[name, "logits4"] = torch.cat(quantized, 1)
        bench = make_policy(name, None if name == "full" else 8, 36)
        for prefill in ("dense", "stream"):
            tokens = decoder.generate(PROMPTS, bench, 6, prefill)
            out[name, prefill] = torch.stack(list(tokens)).T.tolist()
    if compiled:
        decoder = Decoder(model, compile="layer")
        out["h2o", "compiled"] = torch.stack(list(decoder.generate(PROMPTS, make_policy("h2o", 8, 36), 6))).T.tolist()
    return out


def _rank(rank: int, size: int, init: str, folders: dict, queue) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        shard = Shard(rank, size)
        results = {}
        for family, folder in folders.items():
            model = load_hf(folder, shard=shard)
            cache = Decoder(model).new_cache(make_policy("h2o", C, T), 1, T)
            got = outputs(model, compiled=family == "llama_gqa_tied")
            # as numpy arrays: a torch tensor crosses processes through shared memory that dies with this one
            got = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in got.items()}
            results[family] = got, model.cfg.n_kv_head, cache.nbytes
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory):
    folders = {family: str(tiny(family)[0]) for family in FAMILIES}
    init = f"file://{tmp_path_factory.mktemp('tp') / 'init'}"
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, 2, init, folders, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_give_the_single_process_logits_and_tokens(tiny_model, two_ranks, family):
    model = tiny_model(family)
    alone = outputs(model, compiled=family == "llama_gqa_tied")
    (rank0, kv_heads, nbytes), (rank1, _, nbytes1) = two_ranks[0][family], two_ranks[1][family]
    assert kv_heads == model.cfg.n_kv_head // 2  # each rank holds half of the heads...
    full_bytes = Decoder(model).new_cache(make_policy("h2o", C, T), 1, T).nbytes
    assert nbytes == nbytes1 == full_bytes // 2  # ...and half of the cache
    assert rank0.keys() == alone.keys()
    for key, want in alone.items():
        if key[1].startswith("logits"):
            tol = 1e-4 if key[1] == "logits" else 5e-3  # a 4-bit code may round the other way (as in test_quant)
            assert (torch.from_numpy(rank0[key]) - want).abs().max().item() <= tol, key
            assert (rank0[key] == rank1[key]).all(), key  # every rank computes the same logits
        else:
            assert rank0[key] == want and rank1[key] == want, key


def torchrun(*args, n=2):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           "-m", "h2o_mini", *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def folder(tiny):
    return add_byte_tokenizer(tiny("llama_mha")[0])


def test_eval_ppl_under_torchrun_equals_one_process(folder):
    args = ["eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 96, "--policy", "h2o", "--budget", "0.25",
            "--json"]
    tp, alone = torchrun(*args), run(*args)
    assert tp.returncode == 0 and alone.returncode == 0, tp.stderr[-2000:]
    lines = tp.stdout.splitlines()
    assert len(lines) == 1  # rank 0 alone prints
    got, want = json.loads(lines[0]), json.loads(alone.stdout)
    assert got["world_size"] == 2 and want["world_size"] == 1
    assert abs(got["nll"] - want["nll"]) <= 1e-5
    assert got["kv_bytes"] == want["kv_bytes"] and got["kv_bytes_per_rank"] == [want["kv_bytes"] // 2] * 2


def test_generate_and_bench_under_torchrun(folder):
    args = ["generate", "--model", folder, "--policy", "h2o", "--budget", 8, "--max-new-tokens", 12, "Once upon a"]
    tp, alone = torchrun(*args), run(*args)
    assert tp.returncode == 0, tp.stderr[-2000:]
    assert tp.stdout == alone.stdout and tp.stdout.strip()  # printed once, the same text
    tp = torchrun("bench", "--model", folder, "--policy", "h2o", "--budget", "0.5", "--prompt-tokens", 16,
                  "--new-tokens", 3, "--json")
    assert tp.returncode == 0, tp.stderr[-2000:]
    (row,) = [json.loads(line) for line in tp.stdout.splitlines()]
    assert row["world_size"] == 2 and len(row["kv_bytes_per_rank"]) == 2
    assert sum(row["kv_bytes_per_rank"]) == row["kv_bytes"]


def test_ranks_that_do_not_divide_the_kv_heads_are_refused(folder):
    r = torchrun("eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 32, n=3)
    assert r.returncode != 0
    assert "h2o-mini: error: tensor parallel over 3 ranks needs the model's 4 KV heads, 4 query heads and MLP " \
           "width 96 to divide by 3" in r.stderr
    assert r.stdout == ""
    r = torchrun("eval", "needle", "--model", folder)
    assert r.returncode != 0 and "'eval needle' does not run tensor parallel" in r.stderr
    r = torchrun("bench", "--model", folder, "--vs-hf")
    assert r.returncode != 0 and "'bench --vs-hf' does not run tensor parallel" in r.stderr


def test_a_single_kv_head_is_refused_under_torchrun(tiny):
    """Gemma 3 270M's shape: one KV head cannot be split over two ranks; h2o-mini's one line comes first (torchrun
    then adds its own failure report)."""
    r = torchrun("eval", "ppl", "--model", add_byte_tokenizer(tiny("gemma3_hybrid")[0]), "--text", GPL3, "--tokens", 32)
    assert r.returncode != 0 and r.stdout == ""
    assert "h2o-mini: error: tensor parallel over 2 ranks splits the KV heads, and this model has only 1 (fewer " \
           "than the ranks): run it in one process" in r.stderr
    assert "Traceback" not in r.stderr[:r.stderr.index("h2o-mini: error")]


def test_a_shard_takes_its_heads_and_its_mlp_columns():
    from h2o_mini import UserError
    w = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    one, two = Shard(0, 2), Shard(1, 2)
    assert torch.equal(two.take("layers.0.attn.wk.weight", w), w[4:])  # rows: the second half of the heads
    assert torch.equal(two.take("layers.0.attn.wo.weight", w), w[:, 3:])  # columns: what those heads wrote
    assert torch.equal(two.take("layers.0.mlp.w_down.weight", w), w[:, 3:])
    bias = torch.ones(6)
    assert torch.equal(one.take("layers.0.attn.wo.bias", bias), bias)  # added once, after the sum
    assert torch.equal(two.take("layers.0.attn.wo.bias", bias), torch.zeros(6))
    assert two.take("norm_f.weight", bias) is bias  # replicated
    with pytest.raises(UserError, match="each rank's own GPU"):
        one.device("cuda:1")


def test_a_sweep_under_torchrun_splits_its_points_and_equals_one_process(folder, tmp_path):
    """Two CPU ranks (gloo), each with the whole model and its share of the points, batched as one process
    batches them; rank 0 gathers, prints the table and writes --out: row for row what one process gives (to the
    rounding of batched matmuls, 1e-5 nats as in test_batched), and a rerun resumes from the file."""
    args = ["eval", "sweep", "ppl", "--model", folder, "--text", GPL3, "--tokens", 64, "--policy", "local",
            "--policy", "h2o", "--policy", "tova", "--policy", "hindsight", "--budget", 12, "--budget", "0.5"]
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    tp, alone = torchrun(*args, "--out", two), run(*args, "--out", one)
    assert tp.returncode == 0 and alone.returncode == 0, tp.stderr[:3000] + alone.stderr[-1000:]
    table = [line.split()[:2] for line in tp.stdout.splitlines()]
    assert table == [line.split()[:2] for line in alone.stdout.splitlines()]
    rows = {}
    for path in (two, one):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            rows.setdefault((r["spec"], r["budget"]), []).append(r)
    assert len(rows) == 9 and all(len(pair) == 2 for pair in rows.values())  # full and 4 policies x 2 budgets
    for (a, b) in rows.values():
        assert abs(a["nll"] - b["nll"]) <= 1e-5 and abs(a["kl_full"] - b["kl_full"]) <= 1e-5
        assert a["kv_bytes"] == b["kv_bytes"] and a["params"] == b["params"]
    again = torchrun(*args, "--out", two)
    assert again.returncode == 0 and again.stdout == tp.stdout and len(two.read_text().splitlines()) == 9


def test_eval_generate_under_torchrun_splits_its_points_and_equals_one_process(folder, tmp_path):
    """`eval generate` under two CPU ranks: each rank writes its share of the points (full's reference is every
    rank's own), rank 0 gathers, prints and writes --out: point for point what one process gives."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("The licence says that you may\n\nCopy\n")
    args = ["eval", "generate", "--model", folder, "--prompts-file", prompts, "--max-new-tokens", 10,
            "--policy", "local", "--policy", "h2o", "--policy", "tova", "--budget", 6, "--budget", 12]
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    tp, alone = torchrun(*args, "--out", two), run(*args, "--out", one)
    assert tp.returncode == 0 and alone.returncode == 0, tp.stderr[:3000] + alone.stderr[-1000:]
    assert [line.split()[:2] for line in tp.stdout.splitlines()] == [line.split()[:2] for line in alone.stdout.splitlines()]
    got = {(r["policy"], r["budget"]): r for r in map(json.loads, two.read_text().splitlines())}
    want = {(r["policy"], r["budget"]): r for r in map(json.loads, one.read_text().splitlines())}
    assert got.keys() == want.keys() and len(got) == 7  # full and 3 policies x 2 budgets
    for key, r in got.items():
        assert abs(r["nll"] - want[key]["nll"]) <= 1e-5 and abs(r["kl_full"] - want[key]["kl_full"]) <= 1e-5, key
        assert r["agree_tokens"] == want[key]["agree_tokens"] and r["kv_bytes"] == want[key]["kv_bytes"], key
