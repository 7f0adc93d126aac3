"""Hand-worked eviction examples, budget rules, and conformance tests that run for every registered policy."""
import math

import pytest
import torch

from h2o_mini import H2O, REGISTRY, Full, HeavyHitter, Local, Sinks, UserError, make_policy
from h2o_mini.cache import KVCache
from h2o_mini.config import Config
from h2o_mini.policies import capacity_for, parse_budget

from .conftest import text_bytes

# One layer, one KV head shared by two query heads (GQA group of 2), head_dim 4.
CFG = Config(family="llama", vocab_size=8, n_layer=1, n_head=2, n_kv_head=1, d_model=8, head_dim=4, d_ff=8,
             max_seq_len=64)


def uniform_steps(policy, n, mode):
    """Feed n tokens with q = 0 (uniform attention over the cache); returns the sorted cached positions and
    the scores after every step."""
    cache = KVCache(CFG, policy, 1, policy.capacity or n)
    seen = []
    for t in range(n):
        q, k, v = torch.zeros(1, 2, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
        cache.layers[0].attend(q, k, v, torch.tensor([[t]]), mode)
        lc = cache.layers[0]
        order = lc.pos[0, 0].argsort()
        kept = [(p, s) for p, s in zip(lc.pos[0, 0, order].tolist(), lc.score[0, 0, order].tolist()) if p >= 0]
        seen.append(([p for p, _ in kept], [round(s, 6) for _, s in kept]))
    return seen


@pytest.mark.parametrize("mode", ["step", "stream"])
def test_hand_worked_examples(mode):
    # Uniform attention: a token's score grows by 2 heads x 1/|cache| per step, so early tokens lead.
    assert [p for p, _ in uniform_steps(Local(recent=2), 5, mode)] == [[0], [0, 1], [1, 2], [2, 3], [3, 4]]
    hh = uniform_steps(HeavyHitter(heavy=2), 4, mode)
    # t=0: s0=2. t=1: s0=3, s1=1. t=2: evict 1 (lowest), s0=4, s2=1. t=3: evict 2.
    assert hh == [([0], [2.0]), ([0, 1], [3.0, 1.0]), ([0, 2], [4.0, 1.0]), ([0, 3], [5.0, 1.0])]
    h2o = uniform_steps(H2O(heavy=1, recent=2), 5, mode)
    # C=3. t=3: candidates p <= 1: {0: s=2+1+2/3, 1: 1+2/3} -> evict 1. t=4: candidates p <= 2: {0, 2} -> evict 2.
    assert [p for p, _ in h2o] == [[0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 3, 4]]
    assert [p for p, _ in uniform_steps(Sinks(sink=1, recent=2), 5, mode)] == [[0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 3, 4]]
    assert [p for p, _ in uniform_steps(Full(), 4, mode)] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]


@pytest.mark.parametrize("mode", ["step", "stream"])
def test_ties_evict_the_oldest(mode):
    cache = KVCache(CFG, HeavyHitter(heavy=3), 1, 3)
    lc = cache.layers[0]
    lc.pos[0, 0] = torch.tensor([5, 3, 7])  # slots hold positions out of order, as after evictions
    lc.score[0, 0] = torch.tensor([1.0, 1.0, 2.0])  # 5 and 3 tie for lowest: 3 is older
    cache.layers[0].attend(torch.zeros(1, 2, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), torch.tensor([[8]]), mode)
    assert sorted(lc.pos[0, 0].tolist()) == [5, 7, 8]


def test_dense_ties_keep_the_newest():
    cache = KVCache(CFG, HeavyHitter(heavy=2), 1, 2)
    q = torch.zeros(1, 2, 4, 4)  # uniform causal attention over 4 prompt tokens
    cache.layers[0].attend(q, torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), torch.arange(4)[None], "dense")
    # s = 2 * (1 + 1/2 + 1/3 + 1/4, 1/2 + 1/3 + 1/4, 1/3 + 1/4, 1/4): keep 0 and 1
    assert cache.layers[0].pos[0, 0].tolist() == [0, 1]
    cache = KVCache(CFG, Local(recent=2), 1, 2)
    cache.layers[0].attend(q, torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), torch.arange(4)[None], "dense")
    assert cache.layers[0].pos[0, 0].tolist() == [2, 3]


# ---- conformance: parametrized over the registry, so a new policy is tested the moment it is registered ----

def _conformance_run(model, policy, ids):
    cache = KVCache(model.cfg, policy, 1, len(ids))
    evicted, logits = set(), []
    for t, tok in enumerate(ids):
        before = []
        for lc in cache.layers:
            keys = lc.keys() if policy.needs_keys else None
            keep = policy.keep_score(lc.score, lc.pos, torch.tensor(t), keys).masked_fill(lc.pos < 0, -torch.inf)
            before.append((lc.pos.clone(), lc.pos[keep == torch.inf].tolist()))
        logits.append(model(torch.tensor([[tok]]), torch.tensor([[t]]), cache, mode="step"))
        for lc, (old, protected) in zip(cache.layers, before):
            C = lc.capacity
            for h in range(lc.pos.shape[1]):
                now = set(lc.pos[0, h].tolist()) - {-1}
                assert len(now) == min(t + 1, C), "holds exactly min(t+1, C) tokens, never more than C"
                assert t in now, "the arriving token is inserted"
                gone = set(old[0, h].tolist()) - {-1} - now
                assert len(gone) == (1 if t >= C else 0), "evicts exactly one token when full, else none"
                assert not gone & evicted and not now & {e for e in evicted}, "an evicted token never comes back"
                evicted |= {(h, p) for p in gone}
            assert not set(protected) - set(lc.pos.flatten().tolist()), "protected (+inf) tokens are never evicted"
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("name", list(REGISTRY))
def test_conformance(tiny_model, name):
    model = tiny_model("llama_gqa_tied")
    ids = text_bytes(30, 4000)
    policy = make_policy(name, None if name == "full" else 6, len(ids))
    logits1, cache1 = _conformance_run(model, policy, ids)
    logits2, cache2 = _conformance_run(model, policy, ids)
    assert torch.equal(logits1, logits2), "deterministic"
    assert all(torch.equal(a.pos, b.pos) for a, b in zip(cache1.layers, cache2.layers))
    cfg, C = model.cfg, cache1.capacity
    slot_bytes = 2 * cfg.head_dim * 4 + 8 + 4  # fp32 key and value, int64 position, fp32 score
    assert cache1.nbytes == cfg.n_layer * 1 * cfg.n_kv_head * C * slot_bytes, "the same total as C in every layer"
    for lc in cache1.layers:
        assert all(t.shape[2] == lc.capacity for t in lc.tensors()), "storage really is the layer's C slots"


def test_h2o_cache_is_a_fifth_of_full_at_budget_02(tiny_model):
    model, L = tiny_model("llama_gqa_tied"), 1000
    full = KVCache(model.cfg, Full(), 2, L)
    pol = make_policy("h2o", "0.2", L)
    h2o = KVCache(model.cfg, pol, 2, pol.capacity)
    slot = full.nbytes / L
    assert abs(h2o.nbytes - 0.2 * full.nbytes) <= slot


def test_budget_rules():
    assert parse_budget("0.2") == 0.2 and parse_budget("256") == 256 and parse_budget("1") == 1
    assert parse_budget("1.0") == 1.0  # a fraction: the whole sequence
    assert capacity_for(0.2, 1024) == math.floor(0.2 * 1024 + 0.5) == 205
    assert capacity_for(0.001, 10) == 1 and capacity_for(64, 10) == 64
    assert make_policy("h2o", "0.2", 100) == H2O(heavy=10, recent=10)
    assert make_policy("h2o", "21", 100) == H2O(heavy=10, recent=11)
    assert make_policy("h2o", "20", 100, recent="0.25") == H2O(heavy=15, recent=5)
    assert make_policy("h2o", "20", 100, recent="0") == H2O(heavy=20, recent=0)
    assert make_policy("local", "0.5", 10) == Local(recent=5)
    assert make_policy("full", None, 10) == Full()
    for bad in ["0", "-1", "1.5", "abc", "nan", "inf", "2.5"]:
        with pytest.raises(UserError):
            make_policy("h2o", bad, 100)
    with pytest.raises(UserError):
        make_policy("h2o", "10", 100, recent="11")  # negative heavy share
    with pytest.raises(UserError):
        make_policy("h2o", None, 100)


def test_h2o_degenerates_to_local_and_heavy_hitter(tiny_model):
    model, ids = tiny_model("neox_parallel"), text_bytes(30, 100)
    for h2o, other in [(H2O(heavy=0, recent=6), Local(recent=6)), (H2O(heavy=6, recent=0), HeavyHitter(heavy=6))]:
        (a, ca), (b, cb) = _conformance_run(model, h2o, ids), _conformance_run(model, other, ids)
        assert all(torch.equal(x.pos.sort(-1).values, y.pos.sort(-1).values) for x, y in zip(ca.layers, cb.layers))
        assert (a - b).abs().max().item() <= 1e-5  # the same tokens kept; local attends through SDPA
