"""Many policies as the rows of one pass (issue 26): a sweep's configurations share the model's pass, each row
with its own policy and capacity (`policies/rows.py`), and every row equals its policy run alone."""
import json
import math

import pytest
import torch

from h2o_mini import api, perplexities, perplexity
from h2o_mini.cache import KVCache
from h2o_mini.evals.ppl import full_logprobs, score_many, score_text
from h2o_mini.policies import LOOKAHEAD, REGISTRY, H2O, Local, make_policy
from h2o_mini.policies.rows import Rows
from h2o_mini.views.record import record, record_many

from .conftest import FAMILIES, GPL3, text_bytes
from .test_plugins import VNORM

T = 48


def _configs(length: int):
    """Every registered policy at a fraction and a token count (rows narrower and wider than each other)."""
    return [make_policy(name, budget, length) for name in REGISTRY
            for budget in ([None] if not REGISTRY[name].takes_budget else [0.2, 7])]


def _alone(model, ids, policy, plan):
    cache = KVCache(model.cfg, policy, 1, len(ids), prefill=plan[0][2])
    x = torch.tensor([ids])
    return torch.cat([model(x[:, s:e], torch.arange(s, e)[None], cache) for s, e, _ in plan], 1)[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefill", ["stream", "dense"])
def test_every_row_of_a_batch_of_policies_equals_its_policy_alone(tiny_model, family, prefill):
    """30 tokens streamed in chunks of 9 (or as one dense prompt: each row keeps its own C of it, scored by its
    own prompt window), then decoded token by token: each row's logits against the same policy run alone
    (itself checked against the naive reference by test_eviction_parity), 1e-4 as there; a different eviction
    moves them by > 1e-2."""
    model, ids = tiny_model(family), text_bytes(T, offset=3000)
    policies = _configs(T)
    plan = [(s, min(s + 9, 30), "stream") for s in range(0, 30, 9)] if prefill == "stream" else [(0, 30, "dense")]
    plan += [(t, t + 1, "step") for t in range(30, T)]
    cache = KVCache(model.cfg, Rows([(p, 1) for p in policies]), len(policies), T, prefill=prefill)
    x, pos = torch.tensor([ids] * len(policies)), torch.arange(T)[None].expand(len(policies), T)
    with torch.inference_mode():
        got = torch.cat([model(x[:, s:e], pos[:, s:e], cache) for s, e, _ in plan], 1)
        for row, policy in enumerate(policies):
            assert (got[row] - _alone(model, ids, policy, plan)).abs().max() <= 1e-4, policy
    for i, layer in enumerate(cache.layers):  # each row holds its own capacity: its other slots stay empty
        for row, policy in enumerate(policies):
            room = min(policy.layer_capacity(i, model.cfg.n_layer, T), model.cfg.window(i) or T)
            assert int(layer.room[row].sum()) == room and int((layer.pos[row] >= 0).sum(-1).max()) == room
            assert bool((layer.pos[row, :, room:] < 0).all())


@pytest.mark.parametrize("family", ["llama_gqa_tied", "gemma3_hybrid"])
def test_a_batched_sweep_gives_every_point_its_solo_numbers(tiny_model, family, tmp_path):
    """score_many (eval sweep ppl's pass) against score_text one policy at a time: NLL, KL to full and top-1
    agreement within 1e-5, for every registered policy, hindsight and a plugin, in batches of 7 rows."""
    (tmp_path / "vnorm.py").write_text(VNORM)
    model, ids = tiny_model(family), text_bytes(120, offset=500)
    n = len(ids)
    policies = _configs(n) + [make_policy(name, 0.2, n) for name in LOOKAHEAD]
    policies.append(make_policy(f"{tmp_path / 'vnorm.py'}:VNorm:power=2", 0.25, n))
    reference = full_logprobs(model, ids)
    seen = set()
    for i, got in score_many(model, ids, policies, reference, chunk=32, max_batch=7, progress=False):
        want = score_text(model, ids, policies[i], chunk=32, compare_full=True, reference=reference, progress=False)
        for key in ("nll", "kl_full", "top1_agree_full"):
            assert abs(got[key] - want[key]) <= 1e-5, (policies[i], key, got[key], want[key])
        assert got["kv_bytes"] == want["kv_bytes"] and got["capacity"] == want["capacity"]
        seen.add(i)
    assert seen == set(range(len(policies)))


def test_a_row_s_result_does_not_depend_on_its_neighbours(tiny_model):
    """The same policy beside different others, in different places of the batch: bit for bit the same NLL
    would be too strict (a batched matmul may round a row differently), so 1e-6."""
    model, ids = tiny_model("qwen2_hybrid"), text_bytes(100, offset=1200)
    reference = full_logprobs(model, ids)
    target = make_policy("tova", 0.2, len(ids))
    mixes = [[target], [Local(recent=5), target, H2O(heavy=30, recent=9)], [make_policy("rkv", 40, 100)] * 3 + [target]]
    nll = [next(r["nll"] for i, r in score_many(model, ids, mix, reference, progress=False) if mix[i] is target)
           for mix in mixes]
    assert max(nll) - min(nll) <= 1e-6 and math.isfinite(nll[0])


def test_record_many_records_each_policy_as_alone(tiny_model):
    """explore's and plot kept's recorder: the step at which every position left every layer and head, and the
    scores, the same in one pass of many policies as in a pass of each."""
    model, ids = tiny_model("gemma3_hybrid"), text_bytes(60, offset=700)
    policies = _configs(60)
    together = record_many(model, ids, policies, snapshots=3, max_batch=11)
    for policy, rec in zip(policies, together):
        alone = record(model, ids, policy, snapshots=3)
        assert torch.equal(rec.evicted_at, alone.evicted_at), policy
        assert abs(rec.nll - alone.nll) <= 1e-5 and rec.capacities == alone.capacities
        assert rec.kv_bytes == alone.kv_bytes == KVCache(model.cfg, policy, 1, 60, device="meta").nbytes
        for mine, theirs in zip(rec.scores, alone.scores):  # sums of up to 60 probabilities each rounded on its own
            for a, b in zip(mine, theirs):
                assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_sweep_ppl_batches_split_by_max_batch_give_the_same_rows(byte_folder, tmp_path, capsys, monkeypatch):
    """The CLI: one pass of every point, or passes of two rows: the same numbers; --out resumes either way."""
    from .test_bad_input import run_cli
    folder = byte_folder("llama_gqa_tied")
    args = ["eval", "sweep", "ppl", "--model", str(folder), "--text", str(GPL3), "--tokens", "80", "--policy", "h2o",
            "--policy", "tova", "--policy", "snapkv", "--budget", "0.2", "--budget", "0.4", "--json"]

    def sweep(*more):
        code, out, err = run_cli(capsys, monkeypatch, *args, *more)
        assert code == 0, err
        return {(r["policy"], r["budget"]): r for r in map(json.loads, out.splitlines())}

    one, pairs = sweep(), sweep("--max-batch", "2", "--out", str(tmp_path / "s.jsonl"))
    assert one.keys() == pairs.keys() and len(one) == 7
    assert all(abs(one[k]["nll"] - pairs[k]["nll"]) <= 1e-6 for k in one)
    assert [one[k]["batch"] for k in one if k[0] != "full"] == [6] * 6
    assert sorted(r.get("batch") for r in pairs.values() if r["policy"] != "full") == [2] * 6
    again = sweep("--max-batch", "2", "--out", str(tmp_path / "s.jsonl"))  # everything from the file
    assert again == pairs and len((tmp_path / "s.jsonl").read_text().splitlines()) == 7


def test_perplexities_api_runs_configs_in_one_pass(byte_folder):
    lm = api.load(byte_folder("llama_gqa_tied"))
    text = GPL3.read_text()
    got = dict(perplexities(lm, text, 64, [("h2o", 0.25), ("local", 16), (H2O(heavy=8, recent=8), None)]))
    assert list(got) == [("h2o", 0.25), ("local", 16), (H2O(heavy=8, recent=8), None)]
    for (policy, budget), result in got.items():
        alone = perplexity(lm, text, 64, policy, budget, compare_full=True)
        assert abs(result["nll"] - alone["nll"]) <= 1e-5 and result["capacity"] == 16


def test_the_default_batch_is_what_fits_in_memory(tiny_model, monkeypatch):
    """--max-batch left out: the rows that fit in half the free memory at the estimated bytes of a row (the
    widest row's C sets every row's slots), said in each result's `memory`; with room for two rows the points
    run two at a time and give the numbers of one batch."""
    from h2o_mini.evals import memory
    model, ids = tiny_model("llama_gqa_tied"), text_bytes(64, offset=700)
    policies = [make_policy(name, 0.25, 64) for name in ("h2o", "tova", "local", "knorm")]
    reference = full_logprobs(model, ids)
    need = memory.row_bytes(model.cfg, 64, 16, 16, None)
    assert need > memory.row_bytes(model.cfg, 64, 8, 16, None) > 0  # a wider row needs more
    wide = dict(score_many(model, ids, policies, reference, chunk=16, max_batch=4, progress=False))
    monkeypatch.setattr(memory, "free_bytes", lambda device: 5 * need)  # half of it: room for two rows
    narrow = dict(score_many(model, ids, policies, reference, chunk=16, progress=False))
    for i, r in narrow.items():
        assert r["batch"] == 2 and r["memory"] == {"row_bytes": need, "free_bytes": 5 * need, "max_batch": 2}
        assert abs(r["nll"] - wide[i]["nll"]) <= 1e-5


class Counted(H2O):
    """h2o that also protects every 3rd position, counted from the number of queries it has observed: a padded
    query observed moves what it protects (of the 17 here, the 8 read after the first eviction reach `observe`)."""
    name = "counted"

    def state_size(self, head_dim: int) -> int:
        return 1

    def observe(self, state, queries, t, rope):
        return state + 1

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        seen = 0 if state is None else state.mean(2).long()  # (B, H, 1) queries observed (none: the kit's probes)
        return super().keep_score(score, pos, t, keys, values) + 100.0 * ((pos - seen) % 3 == 0)


@pytest.mark.parametrize("prefill", ["stream", "dense"])
def test_rows_with_a_rule_s_state_beside_padding_equal_each_prompt_alone(tiny_model, prefill):
    """Left-padded rows of several policies, rules that keep a running state (updated in place by `Rows`) on the
    padded rows beside a rule that keeps none: every row's logits equal the naive reference of
    its own policy and prompt (1e-4, test_eviction_parity's tolerance), so padding reaches no rule's state and
    one rule's state no other row."""
    from dataclasses import asdict

    from h2o_mini.generate import left_pad
    from .restated import restated_logits
    model = tiny_model("llama_gqa_tied")
    texts = [text_bytes(40, 100), text_bytes(23, 700), text_bytes(31, 1500)]  # padded by 0, 17 and 9 tokens
    policies = [make_policy("h2o", 9, 40), Counted(**asdict(make_policy("h2o", 9, 40))),
                make_policy("expected_attention", 12, 40)]
    prompts, follow = [t[:-8] for t in texts], [t[-8:] for t in texts]
    idx, pos = left_pad(prompts)
    cache = KVCache(model.cfg, Rows([(p, 1) for p in policies]), len(texts), 40, prefill=prefill)
    plan = [(0, idx.shape[1])] if prefill == "dense" else [(s, s + 9) for s in range(0, idx.shape[1], 9)]
    with torch.inference_mode():
        prompt_logits = torch.cat([model(idx[:, s:e], pos[:, s:e], cache) for s, e in plan], 1)
        steps = [model(torch.tensor([[f[i]] for f in follow]), pos[:, -1:] + 1 + i, cache) for i in range(8)]
    for row, (p, text, policy) in enumerate(zip(prompts, texts, policies)):
        want = restated_logits(model, text, policy, 40, dense_prompt=len(p) if prefill == "dense" else 0)
        got = torch.cat([prompt_logits[row, -len(p):]] + [s[row] for s in steps])
        assert (got - want).abs().max() <= 1e-4, f"row {row}"
